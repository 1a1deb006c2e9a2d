"""autopar's torch.compile backend against torch.compile(DDP(model)), side by side in the same ranks.

    python benchmarks/bench_compile.py [--steps 8] [--warmup 2] [--only whole,batch_axes]

A GPT of 4 layers, hidden 256, 8 heads, sequence 128, vocabulary 1024 (examples/models.py), global
batch 8, fp32, AdamW, 2 gloo CPU ranks, mesh (2,) "dp":

  whole       `torch.compile(model, backend=autopar.compile_backend(mesh))`, every rank called with
              the whole batch (the plan splits it)
  batch_axes  `compile_backend(mesh, batch_axes=("dp",))` with `dynamic=True`, each rank called with
              its half, as under DDP

against `torch.compile(DistributedDataParallel(model))`, each rank its half. Both sides start from the
same weights, run alternately one step each (the order flips every step), each step timed barrier to
barrier, the slowest rank's wall time and the ranks' CPU time (time.process_time); the ratio is
autopar's median over DDP's, steps after the warm-up (the first, compiling, step is warm-up). The
losses of the two sides, step by step, are the same training run: their largest relative gap is
reported (`loss_gap`). The machine may be shared: the 1-minute load average is recorded.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

SHAPE = dict(vocab=1024, seq=128, hidden=256, heads=8, layers=4)
BATCH = 8
CASES = ("whole", "batch_axes")


def run_case(rank, world, case: str, steps: int, warmup: int) -> dict:
    import torch
    import torch._dynamo
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import autopar
    from models import GPT, gpt_inputs
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(**SHAPE)
    ref_model = copy.deepcopy(model)
    idx, tgt = gpt_inputs(BATCH, SHAPE["seq"], SHAPE["vocab"])
    half = (idx.chunk(world)[rank], tgt.chunk(world)[rank])
    mesh = autopar.Mesh((world,), ("dp",))
    if case == "whole":
        ours = torch.compile(model, backend=autopar.compile_backend(mesh), dynamic=False)
        ours_in = (idx, tgt)
    else:
        ours = torch.compile(model, backend=autopar.compile_backend(mesh, batch_axes=("dp",)), dynamic=True)
        ours_in = half
    ref = torch.compile(DDP(ref_model))
    sides = {"autopar": (ours, ours_in, torch.optim.AdamW(model.parameters(), lr=1e-3)),
             "ddp": (ref, half, torch.optim.AdamW(ref_model.parameters(), lr=1e-3))}
    times = {k: [] for k in sides}
    cpu = {k: [] for k in sides}
    losses = {k: [] for k in sides}

    def step(name):
        m, x, opt = sides[name]
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = m(*x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        c = time.process_time() - c0
        dist.barrier()
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)          # the slowest rank's step
        loss = loss.detach().clone()
        if name == "ddp":                                  # DDP's loss is its rank's: the global mean
            dist.all_reduce(loss)
            loss /= world
        return float(t), c, float(loss)

    for i in range(warmup + steps):
        for name in (("autopar", "ddp") if i % 2 == 0 else ("ddp", "autopar")):
            t, c, loss = step(name)
            losses[name].append(loss)
            if i >= warmup:
                times[name].append(t)
                cpu[name].append(c)
    med = {k: statistics.median(v) for k, v in times.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    gap = max(abs(a - b) / abs(b) for a, b in zip(losses["autopar"], losses["ddp"]))
    return {"case": case, "world": world, "autopar_ms": med["autopar"] * 1e3, "ddp_ms": med["ddp"] * 1e3,
            "ratio": med["autopar"] / med["ddp"], "cpu_ratio": cpu_med["autopar"] / cpu_med["ddp"],
            "loss_gap": gap, "steps": steps, "loadavg": os.getloadavg()[0]}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--only", default=",".join(CASES), help="comma-separated cases: " + ", ".join(CASES))
    a = ap.parse_args(argv)
    from rank_pool import get_pool, shutdown_all
    try:
        out = [get_pool(2).run(run_case, case, a.steps, a.warmup, timeout=3600)[0] for case in a.only.split(",")]
    finally:
        shutdown_all()
    for r in out:
        print(json.dumps(r), flush=True)
    print("| case | autopar ms | torch.compile(DDP) ms | ratio | CPU ratio | loss gap | load avg |")
    print("|---|---|---|---|---|---|---|")
    for r in out:
        print(f"| {r['case']} | {r['autopar_ms']:.0f} | {r['ddp_ms']:.0f} | {r['ratio']:.3f} | {r['cpu_ratio']:.3f} "
              f"| {r['loss_gap']:.1e} | {r['loadavg']:.1f} |")
    return out


if __name__ == "__main__":
    main()
