"""Predicted vs measured step time of the demo GPT on 4 gloo ranks (this machine), four plans.

    python benchmarks/bench_cpu_plans.py [--steps 8] [--profile calibrated.json] [--quick]

1. `autopar calibrate --world-size 4 --mesh 2,2` measures this machine with 4 ranks at once
   (unless --profile gives a profile already measured).
2. Four plans of the demo GPT (examples/demo_gpt.py: vocab 512, seq 128, hidden 256, 8 heads,
   2 layers, batch 16) on a (2, 2) mesh ("dp", "tp") of the calibrated device:
     data parallel  every parameter replicated, the batch split 4 ways (both axes)
     tensor parallel  Megatron layouts split 4 ways (column qkv/fc, row proj/fc2), batch whole
     2-D            data parallel over "dp", Megatron tensor parallel over "tp"
     solver         autopar.plan's own choice
   Hand-written plans are pins; the ops between pinned parameters take the planner's fastest
   consistent layouts (autopar.plan with those pins).
3. `autopar.estimate` prices each plan (one microbatch, gradient sync after the backward, one
   collective per parameter as the runtime issues them); the plan then trains on 4 forked gloo
   ranks (AdamW); the median step (forward, backward, optimizer; barrier to barrier; the
   slowest rank's time) is the measurement, as calibration takes medians too.
Prints one JSON line per plan and a summary with the ranking check.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import torch  # noqa: E402

import autopar  # noqa: E402
from autopar.estimate import estimate  # noqa: E402
from models import GPT, gpt_inputs  # noqa: E402

MODEL = dict(vocab=512, seq=128, hidden=256, heads=8, layers=2)
BATCH = 16
AXES = ("dp", "tp")


def megatron_pins(axis_layout):
    """Column-parallel qkv and fc, row-parallel proj and fc2, given the placement names per axis."""
    col, row, bias_col = axis_layout("S(0)"), axis_layout("S(1)"), axis_layout("S(0)")
    return {"blocks.*.attn.qkv.weight": col, "blocks.*.attn.qkv.bias": bias_col,
            "blocks.*.attn.proj.weight": row, "blocks.*.fc.weight": col, "blocks.*.fc.bias": bias_col,
            "blocks.*.fc2.weight": row}


def replicate_all():
    """Every parameter whole on every rank (by name: a bare "*" would pin the ops too)."""
    model, _ = build()
    return {name: ("R", "R") for name, _ in model.named_parameters()}


PLANS = {
    "data parallel": dict(pins="replicate_all", batch_axes=("dp", "tp")),
    "tensor parallel": dict(pins=megatron_pins(lambda p: (p, p)), batch_axes=None),
    "2-D": dict(pins=megatron_pins(lambda p: ("R", p)), batch_axes=("dp",)),
    "solver": dict(pins=None, batch_axes=None),
}


def build():
    torch.manual_seed(0)
    return GPT(**MODEL), gpt_inputs(batch=BATCH, seq=MODEL["seq"], vocab=MODEL["vocab"])


def _train(rank, world_size, plan, profile_path, steps):
    """On every rank: train `steps` steps with `plan`; return per-step seconds (barrier to barrier)."""
    import logging

    import torch.distributed as dist
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    model, batch = build()
    mesh = autopar.Mesh((2, 2), AXES, device=profile_path)
    batch_axes = plan.options.get("batch_axes") or []
    local = batch
    if batch_axes:
        local = mesh.local_batch(batch, batch_axes)
    dmodel = autopar.autoparallelize(model, mesh, batch, plan=plan)
    opt = torch.optim.AdamW(dmodel.parameters(), lr=1e-3)
    times = []
    for step in range(steps + 2):          # two warm-up steps
        dist.barrier()
        t0 = time.perf_counter()
        out = dmodel(*local)
        loss = out.full_tensor() if hasattr(out, "full_tensor") else out
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if step >= 2:
            times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--profile", default=None, help="a calibrated profile (default: calibrate now)")
    ap.add_argument("--quick", action="store_true", help="quick calibration and 3 steps (smoke test)")
    a = ap.parse_args(argv)
    steps = 3 if a.quick else a.steps
    tmp = tempfile.mkdtemp(prefix="autopar_bench_cpu_")
    profile = a.profile
    if profile is None:
        from autopar.cli import calibrate
        t0 = time.perf_counter()
        profile = str(calibrate(os.path.join(tmp, "calibrated.json"), world_size=4, mesh=(2, 2), base="cpu",
                                quick=a.quick, name="this-machine-4-ranks"))
        print(json.dumps({"calibration_s": round(time.perf_counter() - t0, 1), "profile": profile}), flush=True)
    from rank_pool import get_pool, shutdown_all
    model, batch = build()
    mesh = autopar.Mesh((2, 2), AXES, device=profile)
    results = []
    try:
        pool = get_pool(4)
        for name, cfg in PLANS.items():
            pins = replicate_all() if cfg["pins"] == "replicate_all" else cfg["pins"]
            plan = autopar.plan(model, batch, mesh, pins=pins, batch_axes=cfg["batch_axes"],
                                memory_budget=float("inf"))
            est = estimate(model, batch, mesh, plan, bucket_bytes=0, grad_overlap=0.0)
            per_rank = pool.run(_train, plan, profile, steps, timeout=600)
            step_times = [max(ts) for ts in zip(*per_rank)]      # the slowest rank sets the step
            measured = statistics.median(step_times)
            r = {"plan": name, "predicted_ms": round(est.step_time_s * 1e3, 2), "measured_ms": round(measured * 1e3, 2),
                 "measured_min_ms": round(min(step_times) * 1e3, 2),
                 "error": round(est.step_time_s / measured - 1, 4), "compute_ms": round(est.compute_s * 1e3, 2),
                 "comm_ms": round((est.comm_s + est.grad_sync_exposed_s) * 1e3, 2),
                 "optimizer_ms": round(est.optimizer_s * 1e3, 2),
                 "steps_ms": [round(t * 1e3, 1) for t in step_times], "fallbacks": len(plan.fallbacks),
                 "placements": {k: v for k, v in plan.placements.items() if "blocks.0" in k and "weight" in k}}
            results.append(r)
            print(json.dumps(r), flush=True)
    finally:
        shutdown_all()
    by_pred = [r["plan"] for r in sorted(results, key=lambda r: r["predicted_ms"])]
    by_meas = [r["plan"] for r in sorted(results, key=lambda r: r["measured_ms"])]
    errs = [abs(r["error"]) for r in results]
    print(json.dumps({"benchmark": "cpu_plans_4_ranks", "ranking_predicted": by_pred, "ranking_measured": by_meas,
                      "ranking_matches": by_pred == by_meas, "max_abs_error": round(max(errs), 4),
                      "within_25pct": all(e <= 0.25 for e in errs)}))
    return results


if __name__ == "__main__":
    main()
