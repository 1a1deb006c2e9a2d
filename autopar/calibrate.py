"""`autopar calibrate` (autopar/cli.py): measure this machine, write a device profile.

    autopar calibrate [--out my.json] [--world-size 4] [--mesh 2,2] [--base cpu] [--quick]

`calibrate` measures this machine and writes a device profile that `Mesh(device="my.json")`
accepts. It starts `world-size` ranks (forked, gloo on CPU, nccl on GPU) that measure at the
same time, so every figure is what one rank gets while the others run too (on CPU, ranks share
the cores):

Each compute and runtime figure is the group's time over several repeats run back to back by
every rank at once (barrier to barrier: the rate a rank gets while the others run, as in a step),
the collectives' the mean time they add to a burst of compute over several repeats, mean over
ranks; any other figure's median over ranks.

* matmul throughput per dtype (torch.mm of square matrices; the median over ranks) -> peak_flops,
  with matmul_efficiency = 1 (the figures are achieved rates); the time a small matmul loses
  beyond its ideal time -> matmul_ramp_time;
* memory bandwidth (y.copy_(x), read + write bytes) -> memory_bandwidth, memory_efficiency = 1;
* a dropout's time beyond its bytes, per element -> rng_element_time (random numbers);
* per-op overhead (a 16-element add) -> kernel_overhead;
* causal SDPA forward + backward at a layer's shape, against the planner's price of it at the matmul
  rate -> attention_efficiency;
* all_reduce and all_gather as a training step issues them (a compute burst, then the runtime's
  DTensor redistribute, all ranks at once, cycling over the mesh axes; what each adds to the
  bursts' time when every rank bursts alone) at 4 KiB, 512 KiB and 2 MiB, and per mesh axis
  isolated back-to-back raw collectives, fitted to the ring alpha-beta model of `cost_model.comm`
  plus a per-collective cost (`_fit_links`) -> intra_node (the slowest axis; one machine is one
  node), inter_node (the same unless the base profile's is slower), collective_overhead, and the
  fits under `_measured`;
* autopar's runtime against eager PyTorch on a 2-block transformer of width 16 (all replicated)
  -> runtime_op_overhead per node of the rank's graph (as the evaluator counts them); AdamW's step
  through `dmodel.optimizer` ->
  optimizer_param_overhead, and on one 2^20-element parameter -> optimizer_element_time;
* a data-parallel step's gradient buckets against the same compute with nothing to reduce and
  against the buckets alone -> grad_sync_overlap (the share of the early buckets' transfer the
  backward hides; `_measure_overlap`).

`_measured.launch` records ranks, mesh, cores and the load average before and after: the figures
hold for that launch (with 4 ranks on 2 cores every rate is a shared one).

Figures not measured (memory capacity, host link on GPU, devices per node) come from `--base`.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

from .cost_model.comm import collective_bytes_on_wire, collective_time, latency_steps

__all__ = ["calibrate"]


# -- measurements (run inside each rank) -----------------------------------------------------
def _timeit(fn, reps: int, sync) -> float:
    """The median of `reps` runs after a warm-up (typical, not best, conditions: ranks that share
    cores and links slow each other down in training too)."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _timeit_together(fn, reps: int, sync) -> float:
    """The time of one run of `fn` while every rank runs it: `reps` runs back to back between two
    barriers, the group's wall time over `reps` (one rank alone: `_timeit`). With more ranks than
    cores a single short run is often timed while the rank sharing its core waits, so a median of
    single runs reports an unshared rate, or not, by chance (4 ranks on 2 cores, fp32 512^3 matmuls:
    32-93 GFLOP/s per rank from medians of single runs, 39-44 from the group's time); a training
    step, timed barrier to barrier on the slowest rank, gets the shared one."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return _timeit(fn, reps, sync)
    fn()
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    dist.barrier()
    return (time.perf_counter() - t0) / reps


# compute rates (matmul, fused attention) are measured this many times, spread over the calibration
# (before and after each phase), and their median kept: on a shared machine one round can catch a
# passing slowdown (CPU, 4 ranks: one round 34 GFLOP/s, the rounds on either side 49-52)
RATE_ROUNDS = 3


def _measure_rates(device: str, quick: bool, sync) -> dict:
    """One round of the compute rates: `matmul_flops` per dtype and fused attention's time."""
    import torch
    n = (512 if quick else 1536) if device == "cpu" else (4096 if quick else 8192)
    reps = 3 if quick else 7
    out: dict = {"matmul_flops": {}, "matmul_n": n}
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    for key, dt in dtypes.items():
        a = torch.randn(n, n, device=device).to(dt)
        b = torch.randn(n, n, device=device).to(dt)
        c = torch.empty(n, n, device=device, dtype=dt)
        # a dtype without a fast kernel (fp16 on most CPUs) would take minutes at full size; the ranks
        # agree on the size (the fastest probe decides: a rank whose probe was slowed by a neighbour
        # must not time a smaller product while the others' larger ones hold the barrier)
        probe = _timeit(lambda: torch.mm(a[:128, :128], b[:128, :128]), 1, sync)
        m = n if device == "cuda" or _fastest(2 * 128 ** 3 / probe) > 2e10 else 256
        a2, b2, c2 = a[:m, :m].contiguous(), b[:m, :m].contiguous(), c[:m, :m].contiguous()
        t = _timeit_together(lambda: torch.mm(a2, b2, out=c2), reps, sync)
        out["matmul_flops"][key] = 2 * m ** 3 / t
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        a = torch.randn(n, n, device=device)
        t = _timeit_together(lambda: torch.mm(a, a), reps, sync)
        out["matmul_flops"]["tf32"] = 2 * n ** 3 / t
        torch.backends.cuda.matmul.allow_tf32 = False
    out["attention"] = _measure_attention(device, reps, sync)
    return out


def _fastest(rate: float) -> float:
    """The highest of the ranks' `rate` (this rank's alone without a process group)."""
    import torch
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return rate
    t = torch.tensor([rate], dtype=torch.float64)
    dist.all_reduce(t, dist.ReduceOp.MAX)      # a CPU tensor: gloo (GPUs never probe)
    return float(t)


def median_rates(rounds: list[dict]) -> dict:
    """The rounds of `_measure_rates` as one: each rate's median over the rounds (`rounds`: them all)."""
    med = statistics.median
    att = rounds[0]["attention"]
    return {"matmul_flops": {k: med(r["matmul_flops"][k] for r in rounds) for k in rounds[0]["matmul_flops"]},
            "matmul_n": rounds[0]["matmul_n"],
            "attention": {**att, "seconds": med(r["attention"]["seconds"] for r in rounds)}, "rounds": rounds}


def _measure_compute(device: str, quick: bool) -> dict:
    """Everything measured on one device but the compute rates' later rounds (`_rank_main`)."""
    import torch
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    reps = 3 if quick else 7
    out: dict = _measure_rates(device, quick, sync)
    tiny = torch.randn(16, device=device)
    out["kernel_overhead"] = _timeit_together(lambda: tiny + 1.0, 200 if quick else 1000, sync)
    # ramp: a small fp32 matmul's time beyond its ideal time and the per-op overhead
    s = 64
    x = torch.randn(s, s, device=device)
    y = torch.empty(s, s, device=device)
    t_small = _timeit_together(lambda: torch.mm(x, x, out=y), 200 if quick else 1000, sync)
    out["matmul_ramp_time"] = max(t_small - 2 * s ** 3 / out["matmul_flops"]["float32"] - out["kernel_overhead"], 0.0)
    nbytes = (16 if quick else 256) * 2 ** 20
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = _timeit_together(lambda: dst.copy_(src), 3 * reps, sync)
    out["memory_bandwidth"] = 2 * nbytes / t
    # random numbers: a dropout's time beyond the bytes it moves (read x, write y and a 1-byte mask);
    # a CPU's generator is slow, so a smaller tensor there
    n_el = (nbytes if device == "cuda" else min(nbytes, 16 * 2 ** 20)) // 4
    # at p = 0.1, the usual training rate: a CPU's sampling is branchy, so its cost depends on p
    # the runtime's dropout (a counter-based hash of each element's place, runtime/rng.py), as it runs
    from .runtime.rng import draw
    x = src[:n_el]
    t = _timeit_together(lambda: draw(x, 0.1, 1, (0,), (n_el,), 0), reps, sync)
    out["rng_element_time"] = max(t - 9 * n_el / out["memory_bandwidth"], 0.0) / n_el
    if device == "cuda":
        host = torch.empty(nbytes // 4, pin_memory=True)
        t = _timeit(lambda: src.copy_(host, non_blocking=True), reps, sync)
        out["host_bandwidth"] = nbytes / t
    out.update(_measure_offload_tiers(quick))
    return out


# fused attention timed at a transformer layer's shape: (batch, heads, sequence, head dim), causal
ATTENTION_SHAPE = {"cpu": (4, 8, 128, 32), "cuda": (4, 16, 2048, 128)}
# the lowest attention_efficiency written (a profile needs > 0): 100x below the matmul rate, far under
# what was measured (0.38-0.69 on a CPU's flash kernel, 0.87 on an H200), so it only guards a broken timing
MIN_ATTENTION_EFFICIENCY = 0.01


def _measure_attention(device: str, reps: int, sync) -> dict:
    """SDPA's forward + backward (causal; fp32 on CPU, bf16 on GPU) with the forward FLOPs and bytes as
    the planner counts them (FlopCounterMode; inputs read + output written): `calibrate` turns it
    into `attention_efficiency` with the planner's own price (`compute.op_times`)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = (torch.randn(ATTENTION_SHAPE[device], device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:    # on meta tensors, as passes/shape_prop counts
        F.scaled_dot_product_attention(*(t.to("meta") for t in (q, k, v)), is_causal=True)

    def step():
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad)
    return {"shape": list(q.shape), "dtype": str(dtype).removeprefix("torch."), "flops": fc.get_total_flops(),
            "bytes": 4 * q.numel() * q.element_size(), "seconds": _timeit_together(step, reps, sync)}


def _attention_efficiency(comp: list[dict], profile) -> float:
    """The fraction of the matmul rate that makes the planner's price of the measured attention (forward
    and backward, `compute.op_times` at efficiency 1) equal to its median time over ranks."""
    import torch

    from .cost_model.compute import op_times
    a = comp[0]["attention"]
    at_full = dataclasses.replace(profile, attention_efficiency=1.0)
    fwd, bwd = op_times(a["flops"], a["bytes"], getattr(torch, a["dtype"]), at_full, family="attention",
                        op="aten.scaled_dot_product_attention")
    ratio = (fwd + bwd) / statistics.median(c["attention"]["seconds"] for c in comp)
    return min(max(ratio, MIN_ATTENTION_EFFICIENCY), 1.0)


def _measure_offload_tiers(quick: bool) -> dict:
    """The disk tier (a file written and synced, then read back memory-mapped, as the offload
    executor does) and the optimizer step on the host (AdamW over fp32 CPU tensors)."""
    import torch
    nbytes = (8 if quick else 64) * 2 ** 20
    data = torch.ones(nbytes // 4)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "probe.bin")

        def write(t: torch.Tensor) -> None:
            with open(path, "wb") as f:
                f.write(t.numpy().tobytes())
                f.flush()
                os.fsync(f.fileno())

        def read(n: int) -> None:
            torch.from_file(path, shared=False, size=n, dtype=torch.float32).sum()

        t_small = _timeit(lambda: (write(data[:1024]), read(1024)), 5, lambda: None)
        t_big = _timeit(lambda: (write(data), read(data.numel())), 2 if quick else 3, lambda: None)
    param = torch.nn.Parameter(torch.zeros(2 ** 18 if quick else 2 ** 20))
    param.grad = torch.ones_like(param)
    opt = torch.optim.AdamW([param], lr=1e-3)
    opt.step()
    t_opt = _timeit(opt.step, 3 if quick else 5, lambda: None)
    return {"disk_bandwidth": 2 * nbytes / max(t_big - t_small, 1e-9), "disk_latency": t_small / 2,
            "host_optimizer_element_time": t_opt / param.numel()}


def _fit_ring(kind: str, n: int, small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """(bandwidth, latency) of a Link such that the ring formula gives the measured times."""
    fraction, steps = collective_bytes_on_wire(kind, 1.0, n), latency_steps(kind, n)
    (s0, t0), (s1, t1) = small, large
    per_byte = max((t1 - t0) / (s1 - s0), 1e-15)
    bandwidth = fraction / per_byte
    latency = max(t0 - fraction * s0 / bandwidth, 0.0) / steps
    return bandwidth, latency


def _measure_axes(rank: int, world: int, mesh_shape, names, device: str, quick: bool) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dm = init_device_mesh(device, mesh_shape, mesh_dim_names=names)
    sizes = (4096, (1 if quick else 8) * 2 ** 20)
    reps = 5 if quick else 15
    out = {}
    for name in names:
        group = dm.get_group(name)
        n = dist.get_world_size(group)
        if n == 1:
            continue
        res = {}
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):
            pts = []
            for nbytes in sizes:
                full = torch.zeros(nbytes // 4, device=device)
                part = torch.zeros(nbytes // 4 // n, device=device)
                if kind == "all_reduce":
                    fn = lambda: dist.all_reduce(full, group=group)  # noqa: E731
                elif kind == "reduce_scatter":
                    fn = lambda: dist.reduce_scatter_tensor(part, full[: part.numel() * n], group=group)  # noqa: E731
                else:
                    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
                    fn = lambda: gather(full[: part.numel() * n], part, group=group)  # noqa: E731
                dist.barrier()
                pts.append((float(part.numel() * n * 4), _timeit(fn, reps, sync)))
            res[kind] = pts
        out[name] = {"size": n, "points": res}
    return out


# A compute burst between two collectives, as a training step has: BURST_REPEATS matmuls of
# 128x512x512 (67 MFLOP each; ~1.5 ms with two ranks per core on this class of CPU), about the compute
# a step runs between two of its collectives (the five plans of benchmarks/bench_cpu_plans.py: 1.7 ms
# (ZeRO-3) to 10 ms (2-D) of compute per collective; data parallel's few buckets follow longer).
# What a collective adds grows with the burst before it (4 ranks on 2 cores, small all_gathers cycling
# over the axes: 1.8 ms after no compute, 2.3 after one matmul, 3.4 after 4, 4.5 after 16): ranks
# sharing a core drift apart while they compute, and the collective waits for the one behind.
BURST_SHAPE = (128, 512, 512)
BURST_REPEATS = 4
# The graph that measures autopar's runtime overhead: TINY_DEPTH transformer blocks (layer norm,
# qkv projection, heads split by view/transpose, scaled dot-product attention, output projection,
# residual adds, GELU MLP) of width TINY_WIDTH: the op mix of the models autopar runs, at sizes
# where kernels cost microseconds and the per-node cost dominates.
TINY_WIDTH, TINY_DEPTH = 16, 2


def _measure_step_collectives(mesh_shape, names, device: str, quick: bool) -> dict:
    """Collectives as a training step issues them: every rank computes a burst, then moves a DTensor
    with the runtime's own `to_layout` (DTensor redistribute: Partial -> Replicate is an all_reduce,
    Shard(0) -> Replicate an all_gather) over one mesh axis, all ranks at once; then a burst and the
    same over the next axis, cycling over the axes of more than one device as a step's collectives
    move from one group to another (a collective on the group of the one before meets peers already
    in step: small all_gathers after 4 matmuls add 2 ms on one axis, 3.4 ms cycling over two).
    A collective's cost is what it adds to the cycle: the mean cycle less the bursts' time when
    every rank runs bursts alone, barrier to barrier (the shared rate the compute model prices),
    per collective. Not the collective's own span: with more ranks than cores a rank's burst often
    runs unshared while the rank sharing its core waits in the previous collective, so the span of
    a collective holds a peer's burst and the span of a burst is short (4 ranks on 2 cores: a
    128x512x512 matmul took 0.75 ms inside such a loop against 1.5 ms shared; after 4 of them the
    collective's span was 4.9 ms, the cycle less the shared bursts 3.2 ms)."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate

    from .mesh import Mesh
    from .runtime.reshard import to_layout
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dmesh = Mesh(tuple(mesh_shape), tuple(names), device="cpu" if device == "cpu" else "h100").device_mesh()
    m_, k_, n_ = BURST_SHAPE
    a, b = torch.randn(m_, k_, device=device), torch.randn(k_, n_, device=device)

    def burst():
        for _ in range(BURST_REPEATS):
            torch.mm(a, b)
    reps = 9 if quick else 41
    sizes = (4096, 256 * 2 ** 10) if quick else (4096, 512 * 2 ** 10, 2 * 2 ** 20)
    whole = tuple(Replicate() for _ in names)
    cycle = [i for i, n in enumerate(mesh_shape) if n > 1]

    def move(src, local):
        to_layout(DTensor.from_local(local, dmesh, src, run_check=False), whole)

    def timed(moves) -> float:
        """Mean seconds one collective adds to a burst: `moves`, a list of (placements, local tensor),
        each after a burst, `reps` times in a row (module docstring), in a forward and again inside
        a backward, the mean of the two (a step issues about half its collectives in each; a small
        all_gather added 3.0-3.5 ms issued in the forward and 4.1-4.4 ms by the backward). The
        bursts alone are timed next to them, so a change of load between points moves both alike.
        The mean, not the median: a step is the sum of its collectives, and their cost is bimodal
        (the peer is scheduled or not)."""
        steps = [f for src, local in moves for f in (burst, lambda src=src, local=local: move(src, local))]

        def forward_cycle():
            for f in steps:
                f()
        fwd = _timeit_together(forward_cycle, reps, sync) - len(moves) * _timeit_together(burst, reps, sync)
        bwd = (_timeit_together(lambda: _in_backward(steps), reps, sync)
               - _timeit_together(lambda: _in_backward([burst] * len(moves)), reps, sync))
        return (fwd + bwd) / (2 * len(moves))

    return _step_collective_points(timed, mesh_shape, names, cycle, sizes, device)


def _step_collective_points(timed, mesh_shape, names, cycle: list[int], sizes: tuple[int, ...], device: str) -> dict:
    """`_measure_step_collectives`' figures: `timed(moves)` of every axis's all_reduce at once, and of
    all_reduce and all_gather cycling over the axes `cycle` at each of `sizes` bytes."""
    import torch
    from torch.distributed.tensor import Partial, Replicate, Shard

    out = {"burst_repeats": BURST_REPEATS, "cycle": [names[i] for i in cycle], "points": {}}
    if not cycle:                                     # a world of one: nothing to measure
        return out
    # every axis at once, as a gradient partial over all axes is reduced (one all_reduce per axis,
    # back to back: DTensor redistribute on a 2-D mesh), small message
    if len(cycle) > 1:
        t = timed([(tuple(Partial() for _ in names), torch.ones(sizes[0] // 4, device=device))])
        out["all_axes_all_reduce"] = {"nbytes": float(sizes[0]), "collectives": len(cycle),
                                      "sizes": [mesh_shape[i] for i in cycle], "seconds": t}
    for kind, src_p in (("all_reduce", Partial()), ("all_gather", Shard(0))):
        pts = []
        for nbytes in sizes:
            moves = [(tuple(src_p if j == i else Replicate() for j in range(len(names))),
                      torch.ones(nbytes // 4 if kind == "all_reduce" else nbytes // 4 // mesh_shape[i], device=device))
                     for i in cycle]
            pts.append((float(nbytes), timed(moves)))
        out["points"][kind] = pts
    return out


def _in_backward(fns) -> None:
    """`fns` run in order by one backward pass: work issued by autograd's engine, as a step's backward
    issues its collectives."""
    import torch
    h = torch.zeros(1, requires_grad=True)
    for fn in reversed(fns):
        h = _runs_in_backward().apply(h, fn)
    h.sum().backward()


@functools.cache
def _runs_in_backward():
    """Identity whose backward runs `fn` first (made once: torch is imported where it is measured)."""
    import torch

    class InBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, fn):  # type: ignore[override]
            ctx.fn = fn
            return h.view_as(h)

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            ctx.fn()
            return g, None
    return InBackward


def _line(points) -> tuple[float, float]:
    """Least-squares (intercept, slope) of seconds against bytes."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def _measure_runtime(mesh_shape, names, device: str, quick: bool) -> dict:
    """autopar's runtime against eager PyTorch on a tiny graph, all ranks at once: the extra cost per
    node of the rank's graph (LocalOp: unwrap and rewrap DTensors in autograd functions; Reshard),
    forward + backward; and AdamW's step per parameter through `dmodel.optimizer`."""
    import torch

    from .api import autoparallelize
    from .api import plan as make_plan
    from .estimate import estimate
    from .mesh import Mesh
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = _tiny_model().to(device)
    x = torch.randn(2, 8, TINY_WIDTH, device=device)
    mesh = Mesh(tuple(mesh_shape), tuple(names), device="cpu" if device == "cpu" else "h100")
    whole = tuple("R" for _ in mesh_shape)        # no split: no collective, only the runtime's own cost
    plan = make_plan(model, (x,), mesh, pins={n: whole for n, _ in model.named_parameters()}, batch_axes=None,
                     memory_budget=float("inf"))
    dmodel = autoparallelize(model, mesh, (x,), plan=plan)
    # the nodes the evaluator charges runtime_op_overhead for (the rewrite's modules: LocalOp,
    # Reshard, ToLocal; runtime/trim_wrappers.py then trims many of them, which is what the figure measures)
    nodes = estimate(model, (x,), mesh, plan).graph_nodes
    reps = 15 if quick else 61

    def run(mod):
        out = mod(x)
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        out.backward()
    # every rank times the same thing at the same time (planning took each rank its own time):
    # with more ranks than cores, each rank's figure is then what it gets while the others run too
    t_rt = _timeit_together(lambda: run(dmodel), reps, sync)
    t_eager = _timeit_together(lambda: run(model), reps, sync)
    opt = dmodel.optimizer(torch.optim.AdamW, lr=1e-6)      # as a training step runs it
    run(dmodel)                                   # gradients stay: step() alone is timed
    n_params = sum(1 for _ in dmodel.parameters())
    t_opt = _timeit_together(opt.step, reps, sync)
    elems = 2 ** 18 if quick else 2 ** 20
    t_big = _time_big_adamw(mesh, elems, device, max(reps // 4, 5), sync)
    per_tensor = t_opt / n_params
    return {"graph_nodes": nodes, "params": n_params, "step_autopar_s": t_rt, "step_eager_s": t_eager,
            "optimizer_step_s": t_opt, "runtime_op_overhead": max(t_rt - t_eager, 0.0) / nodes,
            "optimizer_param_overhead": per_tensor, "optimizer_big_elements": elems, "optimizer_big_s": t_big,
            "optimizer_element_time": max(t_big - per_tensor, 0.0) / elems}


def _tiny_model():
    """The graph that measures autopar's runtime overhead (TINY_WIDTH, TINY_DEPTH)."""
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            w = TINY_WIDTH
            self.blocks = nn.ModuleList(nn.ModuleDict(dict(
                ln1=nn.LayerNorm(w), qkv=nn.Linear(w, 3 * w), proj=nn.Linear(w, w), ln2=nn.LayerNorm(w),
                fc=nn.Linear(w, 4 * w), fc2=nn.Linear(4 * w, w))) for _ in range(TINY_DEPTH))

        def forward(self, x):
            b, t, w = x.shape
            for blk in self.blocks:
                q, k, v = blk["qkv"](blk["ln1"](x)).split(w, dim=-1)
                q, k, v = (z.view(b, t, 2, w // 2).transpose(1, 2) for z in (q, k, v))
                y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + blk["proj"](y.transpose(1, 2).reshape(b, t, w))
                x = x + blk["fc2"](torch.nn.functional.gelu(blk["fc"](blk["ln2"](x))))
            return x.square().mean()
    return Tiny()


def _time_big_adamw(mesh, elems: int, device: str, reps: int, sync) -> float:
    """Seconds of AdamW's step on one replicated DTensor parameter of `elems` elements: its time per
    element beyond the per-tensor cost."""
    import torch
    from torch.distributed.tensor import Replicate, distribute_tensor
    whole = [Replicate()] * len(mesh.shape)
    big = torch.nn.Parameter(distribute_tensor(torch.randn(elems, device=device), mesh.device_mesh(), whole))
    big.grad = distribute_tensor(torch.randn(elems, device=device), mesh.device_mesh(), whole)
    opt_big = torch.optim.AdamW([big], lr=1e-6)
    return _timeit_together(opt_big.step, reps, sync)


# The model that measures how much of the gradient buckets' transfer the backward hides: OVERLAP_DEPTH
# linear layers of OVERLAP_WIDTH (each layer's gradient one bucket: every bucket but the last leaves
# while layers are still to go) over OVERLAP_ROWS rows per rank, so that the backward's compute outlasts
# the transfer (one layer's backward, 4 x rows x width^2 FLOPs, against its all-reduce of 4 x width^2
# bytes: at the shipped CPU figures about 5x the transfer), as in the steps whose buckets it prices.
OVERLAP_WIDTH, OVERLAP_DEPTH, OVERLAP_ROWS = 512, 8, 512
OVERLAP_ROUNDS = 3


def _measure_overlap(mesh_shape, names, device: str, quick: bool) -> dict:
    """The share of the gradient buckets' transfer the backward hides, as the runtime runs them
    (runtime/grad_sync.py), all ranks at once: a data-parallel step of a linear stack (every axis
    splitting the batch, each rank OVERLAP_ROWS rows) against the same program with nothing to reduce
    (every parameter replicated, each rank the same rows whole: the same compute); the difference is
    the buckets' exposed time. The same buckets' all-reduces issued back to back give their time
    alone; the last, launched when the backward ends, hides nothing (`cost_model.comm.final_bucket_time`
    prices it so). overlap = 1 - (exposed - last) / (alone - last), the share of the early buckets'
    time hidden, in [0, 1]; the copies into the buckets are part of what is exposed."""
    import dataclasses as dc

    import torch

    from .api import autoparallelize
    from .api import plan as make_plan
    from .mesh import Mesh
    from .cost_model.profiles import load_profile
    width, depth, rows = (256, 4, 256) if quick else (OVERLAP_WIDTH, OVERLAP_DEPTH, OVERLAP_ROWS)
    world = math.prod(mesh_shape)
    if world == 1:
        return {}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = _linear_stack(width, depth).to(device)
    layer_bytes = 4 * (width * width + width)
    base = load_profile("cpu" if device == "cpu" else "h100")
    mesh = Mesh(tuple(mesh_shape), tuple(names), device=dc.replace(base, grad_bucket_bytes=layer_bytes))
    whole = {n: tuple("R" for _ in mesh_shape) for n, _ in model.named_parameters()}
    x_local = torch.randn(rows, width, device=device)
    x_global = torch.cat([x_local] * world)
    dp = autoparallelize(model, mesh, (x_global,), plan=make_plan(
        model, (x_global,), mesh, pins=whole, batch_axes=tuple(names), memory_budget=float("inf")))
    alone = autoparallelize(model, mesh, (x_local,), plan=make_plan(
        model, (x_local,), mesh, pins={"*": tuple("R" for _ in mesh_shape)}, batch_axes=None,   # ops too: no split
        memory_budget=float("inf")))
    reps = 3 if quick else 7

    def run(mod, x):
        out = mod(x)
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        out.backward()
    dp._grad_sync.buckets_launched = 0
    run(dp, x_local)
    buckets = dp._grad_sync.buckets_launched          # one backward's
    flat = [torch.randn(layer_bytes // 4, device=device) for _ in range(buckets)]
    t_dp, t_alone, t_comm, t_last = _overlap_times(lambda: run(dp, x_local), lambda: run(alone, x_local), flat,
                                                   reps, sync)
    exposed = t_dp - t_alone
    early = max(t_comm - t_last, 1e-9)
    return {"width": width, "depth": depth, "rows": rows, "buckets": buckets, "step_s": t_dp, "no_sync_s": t_alone,
            "buckets_alone_s": t_comm, "last_bucket_s": t_last,
            "overlap": min(max(1.0 - (exposed - t_last) / early, 0.0), 1.0)}


def _linear_stack(width: int, depth: int):
    """The model `_measure_overlap` steps: `depth` linear layers of `width`, ReLU between."""
    import torch
    from torch import nn

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x.square().mean()
    return Stack()


def _overlap_times(step, no_sync_step, flat: list, reps: int, sync) -> tuple[float, ...]:
    """Seconds of (the data-parallel step, the step with nothing to reduce, the buckets' all-reduces
    `flat` alone, the last bucket's alone): the four timed in turn, OVERLAP_ROUNDS times, each
    figure's median (a change of load hits all alike)."""
    import torch.distributed as dist

    def reduce_all():
        works = [dist.all_reduce(t, async_op=True) for t in flat]
        for w in works:
            w.wait()
    rounds = [(_timeit_together(step, reps, sync), _timeit_together(no_sync_step, reps, sync),
               _timeit_together(reduce_all, reps, sync), _timeit_together(lambda: dist.all_reduce(flat[0]), reps, sync))
              for _ in range(OVERLAP_ROUNDS)]
    return tuple(statistics.median(r[i] for r in rounds) for i in range(4))


def _fit_links(comp: list[dict], isolated: dict, kernel_overhead: float) -> tuple[dict, dict, list, float]:
    """(per-axis fits, the fit's record, a Link per axis, collective_overhead) from the ranks'
    `_measure_step_collectives` (mean over ranks: in lockstep each rank's cycle takes as long) and
    the isolated fits.

    Per kind, a least-squares line of seconds against bytes over the cycled points. An axis's
    bandwidth: the line's slope, bounded by the isolated collectives' (a step cannot move bytes
    faster than back-to-back collectives do; the slope can be lost in scheduling noise). Its
    latency per ring step: the isolated collectives' (the transport's). What the intercepts hold
    beyond the ring steps of the link the profile prices every axis with (`_priced_link`) is a
    per-collective cost, the same for every kind and axis as `Mesh.reshard_cost` charges it; an
    all_reduce over every axis at once gives one more estimate. So a collective that moves nothing
    is priced at what the cycle measured, whatever an axis's own isolated latency read (one axis's
    read 2.8 ms per ring step where the other's read 0.37: taken off the intercepts, it left no
    per-collective cost at all, and the profile then priced the other axis's 0.37 ms). Splitting
    the intercepts into latency and per-collective cost by fitting both instead gave 0-3.2 ms per
    ring step from one calibration to the next."""
    from .cost_model.profiles import Link
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    steps = comp[0]["step_collectives"]
    if not steps["points"]:
        return {}, {}, [], 0.0
    pts = {kind: [(sz, mean([c["step_collectives"]["points"][kind][j][1] for c in comp]))
                  for j, (sz, _) in enumerate(p)] for kind, p in steps["points"].items()}
    lines = {kind: _line(p) for kind, p in pts.items()}
    axes_fit, links = {}, []
    for ax_name in steps["cycle"]:
        iso = isolated[ax_name]
        n = iso["size"]
        bandwidth = min(min(collective_bytes_on_wire(kind, 1.0, n) / max(lines[kind][1], 1e-15),
                            iso["fits"][kind]["bandwidth"]) for kind in pts)
        latency = mean([iso["fits"][kind]["latency"] for kind in pts])
        # a reduce_scatter moves its bytes this many times slower than an all_gather (the ring formula
        # equates them); gloo's takes about an all_reduce's time
        rs = iso["fits"].get("reduce_scatter")
        factor = iso["fits"]["all_gather"]["bandwidth"] / rs["bandwidth"] if rs else 1.0
        axes_fit[ax_name] = {"size": n, "bandwidth": bandwidth, "latency": latency, "reduce_scatter_factor": factor,
                             "isolated": iso}
        links.append(Link(bandwidth, latency, factor))
    link = _priced_link(links)
    ring_latency = {kind: mean([latency_steps(kind, f["size"]) * link.latency for f in axes_fit.values()])
                    for kind in pts}
    overheads = [max(lines[kind][0] - ring_latency[kind], 0.0) for kind in pts]
    both, all_axes = [c["step_collectives"].get("all_axes_all_reduce") for c in comp], None
    if both[0] is not None:
        all_axes = {**both[0], "seconds": mean([x["seconds"] for x in both])}
        ring = sum(collective_time("all_reduce", all_axes["nbytes"], f["size"], link) for f in axes_fit.values())
        overheads.append(max(all_axes["seconds"] - ring, 0.0) / all_axes["collectives"])
    record = {"cycle": steps["cycle"], "burst_repeats": steps["burst_repeats"], "points_s": pts,
              "lines": {k: {"intercept_s": a, "slope_s_per_byte": b} for k, (a, b) in lines.items()},
              "per_collective": dict(zip([*pts, "all_axes_all_reduce"], overheads)), "all_axes_all_reduce": all_axes}
    # Mesh.reshard_cost charges kernel_overhead + collective_overhead per collective
    return axes_fit, record, links, max(mean(overheads) - kernel_overhead, 0.0)


def _priced_link(links: list):
    """The one Link a calibrated profile prices every axis with (`intra_node`; one machine is one
    node): the slowest axis's."""
    return min(links, key=lambda l: l.bandwidth)


def _rank_main(rank: int, world: int, init_file: str, mesh_shape, names, device: str, quick: bool, queue) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        dist.barrier()
        compute = _measure_compute(device, quick)      # every rank at once: shared cores, as in training
        rounds = [{k: compute[k] for k in ("matmul_flops", "matmul_n", "attention")}]
        dist.barrier()
        axes = _measure_axes(rank, world, mesh_shape, names, device, quick)
        dist.barrier()
        compute["step_collectives"] = _measure_step_collectives(mesh_shape, names, device, quick)
        dist.barrier()
        rounds.append(_measure_rates(device, quick, sync))
        dist.barrier()
        compute["runtime"] = _measure_runtime(mesh_shape, names, device, quick)
        dist.barrier()
        compute["overlap"] = _measure_overlap(mesh_shape, names, device, quick)
        dist.barrier()
        while len(rounds) < RATE_ROUNDS:
            rounds.append(_measure_rates(device, quick, sync))
        compute.update(median_rates(rounds))
        queue.put((rank, compute, axes))
    finally:
        dist.destroy_process_group()


def calibrate(out: str | Path, *, world_size: int = 2, mesh: tuple[int, ...] | None = None,
              base: str = "cpu", name: str | None = None, quick: bool = False, device: str | None = None) -> Path:
    """Measure this machine with `world_size` ranks and write a profile JSON to `out`."""
    import torch

    from .cost_model.profiles import load_profile, save_profile
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    mesh = tuple(mesh) if mesh else (world_size,)
    if math.prod(mesh) != world_size:
        raise SystemExit(f"autopar calibrate: mesh {mesh} has {math.prod(mesh)} devices, not --world-size {world_size}")
    names = tuple(f"axis{i}" for i in range(len(mesh)))
    load_before = os.getloadavg()
    results = _run_ranks(world_size, mesh, names, device, quick)
    # the figures hold for this launch: with more ranks than cores, each rank gets a share of a core
    launch = {"ranks": world_size, "mesh": list(mesh), "cores": os.cpu_count(), "ranks_per_core":
              world_size / (os.cpu_count() or 1), "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    comp = [r[1] for r in results]
    base_p = load_profile(base)
    profile, axes_fit, collectives = _fitted_profile(results, base_p, device, world_size, mesh, name)
    path = save_profile(profile, out)
    d = json.loads(path.read_text())
    d["_notes"] = _notes(comp, base_p.name)
    d["_measured"] = {"launch": launch, "axes": axes_fit, "collectives": collectives, "per_rank": comp}
    path.write_text(json.dumps(d, indent=2) + "\n")
    return path


def _run_ranks(world_size: int, mesh: tuple[int, ...], names: tuple[str, ...], device: str, quick: bool) -> list:
    """Each rank's (rank, measurements, axes' isolated collectives), in rank order, measured by
    `world_size` processes at once (SystemExit if one fails or the 600 s pass)."""
    import multiprocessing as mp
    import queue as queue_mod

    # forked ranks on CPU (fast); spawned on GPU: CUDA cannot be used in a child forked from a process
    # that has touched it (torch.cuda.is_available() above may have)
    ctx = mp.get_context("spawn" if device == "cuda" else "fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="autopar_calibrate_") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, init_file, mesh, names, device, quick, queue))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results = []
        try:
            deadline = time.monotonic() + 600
            while len(results) < len(procs) and time.monotonic() < deadline:
                try:
                    results.append(queue.get(timeout=1.0))
                except queue_mod.Empty:
                    if any(p.exitcode not in (0, None) for p in procs):   # a rank died: do not wait for it
                        break
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()
        if any(p.exitcode not in (0, None) for p in procs) or len(results) < len(procs):
            raise SystemExit("autopar calibrate: a measuring rank failed (see its traceback above)")
    results.sort(key=lambda r: r[0])
    return results


def _fitted_profile(results: list, base_p, device: str, world_size: int, mesh: tuple[int, ...], name: str | None):
    """(the profile the ranks' measurements give, over `base_p` for what is not measured; the axes'
    ring fits; the collectives measured as a step issues them)."""
    import torch

    from .cost_model.profiles import Link
    comp = [r[1] for r in results]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    flops = {k: med([c["matmul_flops"][k] for c in comp]) for k in comp[0]["matmul_flops"]}
    bw = med([c["memory_bandwidth"] for c in comp])
    kernel_overhead = med([c["kernel_overhead"] for c in comp])
    axes_fit, collectives, links, collective_overhead = _fit_links(comp, _isolated(results), kernel_overhead)
    rt = [c["runtime"] for c in comp]
    intra = _priced_link(links) if links else base_p.intra_node
    inter = intra if base_p.inter_node.bandwidth >= intra.bandwidth or device == "cpu" else base_p.inter_node
    host = (Link(bw / 2, base_p.host_link.latency) if device == "cpu"
            else Link(med([c["host_bandwidth"] for c in comp]), base_p.host_link.latency))
    profile = dataclasses.replace(
        base_p, name=name or f"calibrated-{device}", device_type=device,
        backend="nccl" if device == "cuda" else "gloo", peak_flops=flops, memory_bandwidth=bw, host_link=host,
        intra_node=intra, inter_node=inter, matmul_efficiency=1.0, memory_efficiency=1.0,
        matmul_ramp_time=med([c["matmul_ramp_time"] for c in comp]),
        kernel_overhead=kernel_overhead, collective_overhead=collective_overhead,
        runtime_op_overhead=med([r["runtime_op_overhead"] for r in rt]),
        optimizer_param_overhead=med([r["optimizer_param_overhead"] for r in rt]),
        optimizer_element_time=med([r["optimizer_element_time"] for r in rt]),
        rng_element_time=med([c["rng_element_time"] for c in comp]),
        disk_link=Link(med([c["disk_bandwidth"] for c in comp]), med([c["disk_latency"] for c in comp])),
        host_optimizer_element_time=med([c["host_optimizer_element_time"] for c in comp]),
        grad_sync_overlap=med([c["overlap"]["overlap"] for c in comp]) if comp[0]["overlap"] else base_p.grad_sync_overlap,
        devices_per_node=max(base_p.devices_per_node, world_size) if device == "cpu" else base_p.devices_per_node,
        source=f"autopar calibrate on {os.uname().nodename}, {world_size} ranks measuring at once, mesh {mesh}, "
               f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    profile = dataclasses.replace(profile, attention_efficiency=_attention_efficiency(comp, profile))
    return profile, axes_fit, collectives


def _isolated(results: list) -> dict:
    """Per axis, isolated collectives (back to back, raw torch.distributed): the transport's own
    latency per ring step, and a bound on the bandwidth (rank 0's measurements)."""
    isolated = {}
    for ax_name, info in results[0][2].items():
        n = info["size"]
        fits = {kind: _fit_ring(kind, n, *pts) for kind, pts in info["points"].items()}
        isolated[ax_name] = {"size": n, "fits": {k: {"bandwidth": b, "latency": l} for k, (b, l) in fits.items()},
                             "points_s": info["points"]}
    return isolated


def _notes(comp: list, base_name: str) -> dict[str, str]:
    """How each figure of the profile was measured (the profile file's `_notes`)."""
    return {
        "peak_flops": f"torch.mm of square matrices (n={comp[0]['matmul_n']}, smaller for dtypes without a fast "
                      f"kernel), median over {RATE_ROUNDS} rounds spread over the calibration, then over ranks: "
                      "achieved rates, hence matmul_efficiency = 1",
        "memory_bandwidth": "y.copy_(x), read + write bytes, median over ranks",
        "links": "ring alpha-beta fits per mesh axis: latency per ring step from isolated back-to-back collectives "
                 "(the transport's, under each axis's 'isolated'); bandwidth from the slope of all_reduce and "
                 "all_gather issued as a training step issues them (a compute burst, then DTensor redistribute, "
                 "cycling over the axes; minus the bursts alone), mean over ranks, bounded by the isolated "
                 "bandwidth (see _measured.collectives); intra_node is the slowest axis; figures not measured "
                 "come from the base profile " + base_name,
        "kernel_overhead": "a 16-element add, median over ranks (eager PyTorch's per-op dispatch)",
        "attention_efficiency": "causal scaled_dot_product_attention, forward + backward, at (batch, heads, sequence, "
                                f"head dim) {comp[0]['attention']['shape']} ({comp[0]['attention']['dtype']}): the "
                                "planner's price of it at the matmul rate over its time (median over "
                                f"{RATE_ROUNDS} rounds, then over ranks)",
        "disk_link": "a file of 64 MiB written, fsync'ed and read back memory-mapped (torch.from_file), as the "
                     "disk offload tier does, minus the same for 4 KiB (latency: half of that small round trip); "
                     "median over ranks",
        "host_optimizer_element_time": "torch.optim.AdamW().step() over one fp32 CPU tensor of 2^20 elements, per "
                                       "element: the optimizer step of offloaded parameters; median over ranks",
        "rng_element_time": "the runtime's dropout (runtime/rng.draw, p = 0.1) of fp32 x (up to 4M elements on CPU), minus "
                            "the time its bytes (read x, write y and a 1-byte mask) take at memory_bandwidth, per "
                            "element; median over ranks",
        "collective_overhead": "per collective beyond the ring terms and kernel_overhead: DTensor's redistribute and "
                               "waiting for the peers to be scheduled, after a burst of " + str(BURST_REPEATS) + " "
                               "matmuls of " + "x".join(map(str, BURST_SHAPE)) + " (what a collective adds grows "
                               "with the compute before it); holds for the launch in _measured.launch",
        "runtime_op_overhead": f"per node of the rank's graph (LocalOp, Reshard, ToLocal), forward + backward: a "
                               f"{TINY_DEPTH}-block transformer (attention, MLP) of width {TINY_WIDTH} through "
                               "autoparallelize (all replicated: no collective) minus the same model in eager "
                               "PyTorch, divided by the graph's nodes; median over ranks",
        "grad_sync_overlap": f"the share of the gradient buckets' transfer a backward hides, as the runtime runs them: a "
                             f"data-parallel step of {OVERLAP_DEPTH} linear layers of width {OVERLAP_WIDTH} ({OVERLAP_ROWS} "
                             "rows per rank, a bucket per layer) against the same compute with nothing to reduce, "
                             "against the same buckets' all-reduces alone; the last bucket, launched when the backward "
                             "ends, is priced exposed (cost_model.comm.final_bucket_time); median over ranks",
        "optimizer_param_overhead": "torch.optim.AdamW().step() on that graph's DTensor parameters, divided by their "
                                    "number (their bytes are negligible); median over ranks",
        "optimizer_element_time": "the same AdamW step on one replicated DTensor parameter of 2^20 elements, minus "
                                  "optimizer_param_overhead, per element: torch's default CPU AdamW runs one kernel "
                                  "per operation of the update (about 19 passes of 4 bytes, not the fused 28 bytes "
                                  "cost_model.compute assumes); median over ranks",
    }
