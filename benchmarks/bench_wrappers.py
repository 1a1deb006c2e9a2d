"""autopar's executed plans against torch's own wrappers, measured side by side in one run.

    python benchmarks/bench_wrappers.py [--steps 12] [--warmup 3] [--only dp2,dp4,fsdp2,tp2,auto2] [--aten]
                                        [--model small,narrow,deep,wide,tall,fat,long]
    torchrun --nproc-per-node N benchmarks/bench_wrappers.py --device cuda [--model gpt2]


A GPT of 4 layers, hidden 256, 8 heads, sequence 128, vocabulary 512, global batch 16, fp32
(CPU gloo ranks; bf16 matmuls on this CPU would time the emulation, not the runtime), AdamW:

  dp2, dp4  data parallel on a (2,) / (4,) mesh: autopar's plan with every parameter replicated
            and the batch split over "dp", against `DistributedDataParallel` (25 MiB buckets)
  fsdp2     every parameter stored sharded on dim 0 over "dp", gathered for use and freed after
            the forward (plan.residency "regather"), against `fully_shard` per block and root
  tp2       Megatron layouts over "tp" (column q/k/v/fc, row proj/fc2; the batch whole), against
            `parallelize_module` with ColwiseParallel / RowwiseParallel on the same linears
  auto2     the planner's own plan on a (2,) mesh, no pins, the inputs given whole (on these models it
            replicates every parameter and splits the batch), against `DistributedDataParallel` fed
            each rank's share

`--model narrow,deep,wide,tall,fat,long` runs the cases on GPTs of other shapes than the default's (MODELS), one
shape after the other, so the ratios are not the default shape's alone.

autopar's side trains with `dmodel.optimizer(torch.optim.AdamW)` (the documented way), the
reference with `torch.optim.AdamW` over its module's parameters (default settings on both sides).
Both sides live in the same ranks and run alternately, one step each (the order flips every
step), each step timed barrier to barrier, the slowest rank's time; the ratio is autopar's median
over the reference's, steps after the warm-up. The CPU ratio is the same for the ranks' CPU time
per step (time.process_time, every thread of the rank): on a machine shared with other jobs it
moves less than the wall time. Before each case the script records the busy cores
and the 1-minute load average (the machine is shared). `--aten` also counts the ATen ops one step
calls on rank 0 (torch.profiler), each side.

`--device cuda` runs the same three comparisons with NCCL over the ranks torchrun started, one GPU
each (cases dp{N}, fsdp{N}, tp{N}; plain `python` is one rank), fp32 with TF32 matmuls; each step is
timed from a device synchronisation and barrier to the next. `--model gpt2` is GPT-2 small's shape
(12 layers, hidden 768, 12 heads, sequence 1024, vocabulary 50304, global batch 8) instead of the
small default, so kernels rather than launches take the time.
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

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import autopar  # noqa: E402
from bench_cpu_plans import wait_for_quiet  # noqa: E402

MODELS = {"small": (dict(vocab=512, seq=128, hidden=256, heads=8, layers=4), 16),
          "gpt2": (dict(vocab=50304, seq=1024, hidden=768, heads=12, layers=12), 8),     # (shape, global batch)
          # other shapes than the benchmark's own (issue 35: data parallel within 1.05x of DDP on them too):
          "narrow": (dict(vocab=1000, seq=64, hidden=192, heads=6, layers=4), 16),     # a larger vocabulary
          "deep": (dict(vocab=512, seq=64, hidden=128, heads=4, layers=8), 16),        # many small layers
          "wide": (dict(vocab=2048, seq=32, hidden=384, heads=6, layers=2), 32),       # few wide layers
          "tall": (dict(vocab=256, seq=64, hidden=64, heads=4, layers=12), 16),        # more layers, narrower
          "fat": (dict(vocab=4096, seq=32, hidden=512, heads=8, layers=1), 16),        # one wide layer, large vocabulary
          "long": (dict(vocab=512, seq=256, hidden=128, heads=4, layers=3), 8)}        # a longer sequence
WAIT_S = 30          # at most this long for a quiet machine before each case (then measured anyway, load recorded)


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v projections and heads counted from the local width,
    so that the same module runs whole, under autopar, and column-sharded by `parallelize_module`."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.hd = hidden // heads
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (m(x).view(B, T, -1, self.hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.fc, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, hidden: int, heads: int, layers: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build(size: str = "small"):
    shape, batch_size = MODELS[size]
    torch.manual_seed(0)
    model = GPT(**shape)
    g = torch.Generator().manual_seed(0)
    batch = tuple(torch.randint(0, shape["vocab"], (batch_size, shape["seq"]), generator=g) for _ in range(2))
    return model, batch


MEGATRON = {"q": "col", "k": "col", "v": "col", "fc": "col", "proj": "row", "fc2": "row"}
CASES = {     # name -> (world size, axis, what)
    "dp2": (2, "dp", "dp"), "dp4": (4, "dp", "dp"), "fsdp2": (2, "dp", "fsdp"), "tp2": (2, "tp", "tp"),
    "auto2": (2, "dp", "auto")}


def plan_for(what: str, world: int, axis: str, device: str = "cpu", size: str = "small") -> autopar.Plan:
    model, batch = build(size)
    mesh = autopar.Mesh((world,), (axis,), device=_profile(device))
    names = [n for n, _ in model.named_parameters()]
    if what == "dp":
        return autopar.plan(model, batch, mesh, pins={n: ("R",) for n in names}, batch_axes=(axis,),
                            memory_budget=float("inf"))
    if what == "auto":       # the planner's own choice, inputs given whole (it replicates these models' parameters)
        return autopar.plan(model, batch, mesh, memory_budget=float("inf"))
    if what == "fsdp":
        return autopar.plan(model, batch, mesh, pins={n: ("S(0)",) for n in names}, batch_axes=(axis,),
                            residency="regather", memory_budget=float("inf"))
    pins = {}
    for n in names:
        kind = MEGATRON.get(n.split(".")[-2]) if n.startswith("blocks.") else None
        if kind == "col":
            pins[n] = ("S(0)",)
        elif kind == "row" and n.endswith("weight"):
            pins[n] = ("S(1)",)
        else:
            pins[n] = ("R",)
    return autopar.plan(model, batch, mesh, pins=pins, memory_budget=float("inf"))


def reference(what: str, model: nn.Module, device_mesh) -> nn.Module:
    """The torch wrapper for `what` around a copy of `model` (moved to the mesh's device)."""
    model = copy.deepcopy(model).to(_device(device_mesh.device_type))
    if what in ("dp", "auto"):
        return nn.parallel.DistributedDataParallel(model)
    if what == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block, mesh=device_mesh)
        return fully_shard(model, mesh=device_mesh)
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    for block in model.blocks:
        plan = {f"attn.{k}" if k in ("q", "k", "v", "proj") else k: ColwiseParallel() if v == "col" else RowwiseParallel()
                for k, v in MEGATRON.items()}
        parallelize_module(block, device_mesh, plan)
    return model


def _param_groups(module: nn.Module) -> list[dict]:
    """DTensor and plain parameters in groups of their own: torch's foreach optimizer kernels (its
    default on GPUs) refuse a group that mixes them, as `parallelize_module` on some linears leaves."""
    from torch.distributed.tensor import DTensor
    groups = {}
    for p in module.parameters():
        groups.setdefault(isinstance(p, DTensor), []).append(p)
    return [{"params": ps} for _, ps in sorted(groups.items())]


def _profile(kind: str) -> str:
    """autopar's device profile for a torch device kind: the shipped profile of this GPU."""
    if kind == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name()
    return next((p for p in ("h200", "h100", "a100") if p in name.lower()), "h100")


def _device(kind: str) -> torch.device:
    return torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


def _side_by_side(rank, world, what, axis, plan, steps, warmup, aten, device="cpu", size="small"):
    import logging

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    model, batch = build(size)
    mesh = autopar.Mesh((world,), (axis,), device=_profile(device))
    dmodel = autopar.autoparallelize(model, mesh, batch, plan=plan)
    ours_in = mesh.local_batch(batch, (axis,)) if what in ("dp", "fsdp") else batch
    ours_in = tuple(t.to(_device(device)) for t in ours_in)
    ref = reference(what, model, init_device_mesh(device, (world,), mesh_dim_names=(axis,)))
    ref_in = mesh.local_batch(batch, (axis,)) if what == "auto" else ours_in   # DDP: this rank's share
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sides = {"autopar": (dmodel, ours_in, dmodel.optimizer(torch.optim.AdamW, lr=1e-3)),
             "torch": (ref, ref_in, torch.optim.AdamW(_param_groups(ref), lr=1e-3))}
    times = {k: [] for k in sides}
    cpu = {k: [] for k in sides}
    losses = {k: [] for k in sides}

    def step(name):
        m, x, opt = sides[name]
        sync()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = m(*x)
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        sync()
        c = time.process_time() - c0          # this rank's CPU seconds (all its threads), the final barrier's spin
        dist.barrier()                          # included: robust to other jobs' load, unlike the wall time
        t = time.perf_counter() - t0
        if name == "torch" and what != "tp":     # a data-parallel wrapper's loss is its rank's: the global mean
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= world
        return t, c, float(loss)

    for i in range(warmup + steps):
        for name in (("autopar", "torch") if i % 2 == 0 else ("torch", "autopar")):
            t, c, loss = step(name)
            losses[name].append(loss)
            if i >= warmup:
                times[name].append(t)
                cpu[name].append(c)
    counts = {}
    if aten:
        from torch.profiler import ProfilerActivity, profile
        for name in sides:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step(name)
            counts[name] = sum(1 for e in prof.events() if e.name.startswith("aten::"))
    local_ops = sum(bool(getattr(m, "local_out", False)) for m in dmodel.graph_module.modules())
    local_ops += sum(n.op == "call_function" for g in dmodel.graph_module.modules() if isinstance(g, torch.fx.GraphModule)
                     for n in g.graph.nodes)
    return {"times": times, "cpu": cpu, "losses": losses, "aten": counts, "local_ops": local_ops}


def run_case(pool, name: str, steps: int, warmup: int, aten: bool, size: str = "small") -> dict:
    """One CPU case on forked gloo ranks."""
    world, axis, what = CASES[name]
    plan = plan_for(what, world, axis, size=size)
    q = wait_for_quiet(0.5, 2.0, WAIT_S)
    label = name if size == "small" else f"{name} ({size})"
    return summarize(label, world, pool.run(_side_by_side, what, axis, plan, steps, warmup, aten, "cpu", size,
                                            timeout=900), q)


def run_case_cuda(what: str, steps: int, warmup: int, aten: bool, size: str) -> dict | None:
    """One case on the NCCL ranks torchrun started (this process is one of them); rank 0 returns it."""
    import torch.distributed as dist
    world, rank = dist.get_world_size(), dist.get_rank()
    axis = "tp" if what == "tp" else "dp"
    plan = plan_for(what, world, axis, device="cuda", size=size)       # deterministic: the same on every rank
    mine = _side_by_side(rank, world, what, axis, plan, steps, warmup, aten, device="cuda", size=size)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, mine)
    name = {"dp": "dp", "fsdp": "fsdp", "tp": "tp"}[what] + str(world)
    q = {"busy_cores_before": None, "loadavg_before": round(os.getloadavg()[0], 2), "waited_s": 0, "quiet": None}
    return summarize(f"{name} ({size}, cuda)", world, per_rank, q) if rank == 0 else None


def summarize(name: str, world: int, per_rank: list[dict], q: dict) -> dict:
    med, cpu = {}, {}
    for side in ("autopar", "torch"):
        slowest = [max(ts) for ts in zip(*(r["times"][side] for r in per_rank))]
        med[side] = statistics.median(slowest)
        cpu[side] = statistics.median([max(ts) for ts in zip(*(r["cpu"][side] for r in per_rank))])
    r0 = per_rank[0]
    loss_gap = max(abs(a - b) for a, b in zip(r0["losses"]["autopar"], r0["losses"]["torch"]))
    return {"case": name, "world": world, "autopar_ms": round(med["autopar"] * 1e3, 1),
            "torch_ms": round(med["torch"] * 1e3, 1), "ratio": round(med["autopar"] / med["torch"], 3),
            "autopar_cpu_ms": round(cpu["autopar"] * 1e3, 1), "torch_cpu_ms": round(cpu["torch"] * 1e3, 1),
            "cpu_ratio": round(cpu["autopar"] / cpu["torch"], 3),
            "max_loss_gap": loss_gap, "aten_per_step": r0["aten"], "ops_passing_local": r0["local_ops"], **q,
            "loadavg_after": round(os.getloadavg()[0], 2)}


def _cases(a) -> list[dict]:
    if a.device == "cuda":
        import torch.distributed as dist
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": "29511"}.items():
            os.environ.setdefault(k, v)                      # plain `python`: a world of one
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        whats = [w for w in ("dp", "fsdp", "tp") if a.only == "all" or w in a.only.split(",")]
        try:
            return [r for w in whats if (r := run_case_cuda(w, a.steps, a.warmup, a.aten, a.model)) is not None]
        finally:
            dist.destroy_process_group()
    from rank_pool import get_pool, shutdown_all
    try:
        return [run_case(get_pool(CASES[name][0]), name, a.steps, a.warmup, a.aten, size)
                for size in a.model.split(",") for name in a.only.split(",")]
    finally:
        shutdown_all()


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default=None,
                    help="comma-separated cases: " + ", ".join(CASES) + " (with --device cuda: dp, fsdp, tp)")
    ap.add_argument("--aten", action="store_true", help="count ATen ops per step (torch.profiler, rank 0)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default="small",
                    help="GPT shape: " + ", ".join(MODELS) + " (on cpu a comma-separated list, each shape in turn)")
    a = ap.parse_args(argv)
    bad = [m for m in a.model.split(",") if m not in MODELS] or ([a.model] if a.device == "cuda" and "," in a.model else [])
    if bad:
        ap.error(f"--model {bad[0]!r}: use one of {', '.join(MODELS)} (one shape with --device cuda)")
    a.only = a.only or (",".join(CASES) if a.device == "cpu" else "all")
    out = _cases(a)
    for r in out:
        print(json.dumps(r), flush=True)
    if not out:
        return out
    print("| case | ranks | autopar ms | torch ms | ratio | CPU ms autopar / torch | CPU ratio | load avg before/after |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out:
        print(f"| {r['case']} | {r['world']} | {r['autopar_ms']:.0f} | {r['torch_ms']:.0f} | {r['ratio']:.3f} "
              f"| {r['autopar_cpu_ms']:.0f} / {r['torch_cpu_ms']:.0f} | {r['cpu_ratio']:.3f} "
              f"| {r['loadavg_before']:.1f}/{r['loadavg_after']:.1f} |")
    return out


if __name__ == "__main__":
    main()
