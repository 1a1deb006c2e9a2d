"""`autopar calibrate` (autopar/cli.py): measure this machine, write a device profile.

    autopar calibrate [--out my.json] [--world-size 4] [--mesh 2,2] [--base cpu] [--quick]

`calibrate` measures this machine and writes a device profile that `Mesh(device="my.json")`
accepts. It starts `world-size` ranks (forked, gloo on CPU, nccl on GPU) that measure at the
same time, so every figure is what one rank gets while the others run too (on CPU, ranks share
the cores):

Each compute and runtime figure is the group's time over several repeats run back to back by
every rank at once (barrier to barrier: the rate a rank gets while the others run, as in a step),
the collectives' what they add to a burst of compute (median of several repeats); then the median
over ranks.

* matmul throughput per dtype (torch.mm of square matrices; the median over ranks) -> peak_flops,
  with matmul_efficiency = 1 (the figures are achieved rates); the time a small matmul loses
  beyond its ideal time -> matmul_ramp_time;
* memory bandwidth (y.copy_(x), read + write bytes) -> memory_bandwidth, memory_efficiency = 1;
* a dropout's time beyond its bytes, per element -> rng_element_time (random numbers);
* per-op overhead (a 16-element add) -> kernel_overhead;
* causal SDPA forward + backward at a layer's shape, against the planner's price of it at the matmul
  rate -> attention_efficiency;
* per mesh axis, all_reduce and all_gather as a training step issues them (a compute burst, then
  the runtime's DTensor redistribute, all ranks at once) at 4 KiB, 512 KiB and 2 MiB, fitted to
  the ring alpha-beta model of `cost_model.comm` plus a per-collective cost -> intra_node (the
  slowest axis; one machine is one node), inter_node (the same unless the base profile's is
  slower), collective_overhead, and the per-axis fits under `_measured` (with the isolated,
  back-to-back raw collectives for comparison);
* autopar's runtime against eager PyTorch on a 2-block transformer of width 16 (all replicated)
  -> runtime_op_overhead per node of the rank's graph (as the evaluator counts them); AdamW's step
  through `dmodel.optimizer` ->
  optimizer_param_overhead, and on one 2^20-element parameter -> optimizer_element_time.

`_measured.launch` records ranks, mesh, cores and the load average before and after: the figures
hold for that launch (with 4 ranks on 2 cores every rate is a shared one).

Figures not measured (memory capacity, host link on GPU, devices per node) come from `--base`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

from .comm import collective_bytes_on_wire, latency_steps

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
    t = _timeit_together(lambda: torch.ops.aten.native_dropout(src[:n_el], 0.1, True), reps, sync)
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

    from .compute import op_times
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
        for kind in ("all_reduce", "all_gather"):
            pts = []
            for nbytes in sizes:
                full = torch.zeros(nbytes // 4, device=device)
                part = torch.zeros(nbytes // 4 // n, device=device)
                if kind == "all_reduce":
                    fn = lambda: dist.all_reduce(full, group=group)  # noqa: E731
                else:
                    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
                    fn = lambda: gather(full[: part.numel() * n], part, group=group)  # noqa: E731
                dist.barrier()
                pts.append((float(part.numel() * n * 4), _timeit(fn, reps, sync)))
            res[kind] = pts
        out[name] = {"size": n, "points": res}
    return out


# A compute burst between two collectives, as a training step has: BURST_REPEATS matmuls of
# 128x512x512 (67 MFLOP each; ~10 ms in all on one core of this class of CPU, ~20 ms with two ranks
# per core). It must outlast the scheduler's time slice (EEVDF's base slice is a few ms) so that,
# as in a training step where every rank computes all the time, ranks sharing a core are preempted
# mid-burst and arrive at the collective out of step; a sub-millisecond burst runs each rank alone
# in its slice (one 0.6 ms matmul measured at the unshared rate) and understates the wait.
BURST_SHAPE = (128, 512, 512)
BURST_REPEATS = 16
# The graph that measures autopar's runtime overhead: TINY_DEPTH transformer blocks (layer norm,
# qkv projection, heads split by view/transpose, scaled dot-product attention, output projection,
# residual adds, GELU MLP) of width TINY_WIDTH: the op mix of the models autopar runs, at sizes
# where kernels cost microseconds and the per-node cost dominates.
TINY_WIDTH, TINY_DEPTH = 16, 2


def _measure_step_collectives(mesh_shape, names, device: str, quick: bool) -> dict:
    """Collectives as a training step issues them: every rank computes a burst, then moves a DTensor
    with the runtime's own `to_layout` (DTensor redistribute: Partial -> Replicate is an all_reduce,
    Shard(0) -> Replicate an all_gather) over one mesh axis, all ranks at once, `reps` times in a
    row. A collective's cost is what it adds to the iteration: the median iteration (burst and
    collective) less the burst's time when every rank runs bursts alone, barrier to barrier (the
    shared rate the compute model prices). Not the collective's own span: with more ranks than
    cores a rank's burst often runs unshared while the rank sharing its core waits in the previous
    collective, so the span of one collective holds a peer's burst and the span of a burst is short
    (4 ranks on 2 cores, 128x512x512 matmuls: 0.75 ms each inside an iteration against 1.5 ms shared;
    after 4 of them the collective's span was 4.9 ms, the iteration less the shared burst 3.2 ms)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from ..mesh import Mesh
    from ..runtime.reshard import to_layout
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dmesh = Mesh(tuple(mesh_shape), tuple(names), device="cpu" if device == "cpu" else "h100").device_mesh()
    m_, k_, n_ = BURST_SHAPE
    a, b = torch.randn(m_, k_, device=device), torch.randn(k_, n_, device=device)

    def burst():
        for _ in range(2 if quick else BURST_REPEATS):
            torch.mm(a, b)
    reps = 9 if quick else 41
    sizes = (4096, 256 * 2 ** 10) if quick else (4096, 512 * 2 ** 10, 2 * 2 ** 20)

    def timed(src, dst, local) -> tuple[float, float]:
        """(median seconds an iteration of burst and collective takes beyond the burst alone, median
        seconds of this rank's burst inside it); the burst alone is timed next to each point, so a
        change of load between points moves both alike"""
        burst_alone = _timeit_together(burst, reps, sync)
        its, comp = [], []
        dist.barrier()
        for r in range(reps + 1):
            t0 = time.perf_counter()
            burst()
            sync()
            t1 = time.perf_counter()
            to_layout(DTensor.from_local(local, dmesh, src, run_check=False), dst)
            sync()
            t2 = time.perf_counter()
            if r:                                     # the first is a warm-up
                its.append(t2 - t0)
                comp.append(t1 - t0)
        return statistics.median(its) - burst_alone, statistics.median(comp)

    out = {"burst_repeats": BURST_REPEATS, "axes": {}}
    burst_s = None                          # stays None where no axis has two devices (a world of one)
    whole = tuple(Replicate() for _ in names)
    # every axis at once, as a gradient partial over all axes is reduced (one all_reduce per axis,
    # back to back: DTensor redistribute on a 2-D mesh), small message
    split = [i for i, n in enumerate(mesh_shape) if n > 1]
    if len(split) > 1:
        t, burst_s = timed(tuple(Partial() for _ in names), whole, torch.ones(sizes[0] // 4, device=device))
        out["all_axes_all_reduce"] = {"nbytes": float(sizes[0]), "collectives": len(split),
                                      "sizes": [mesh_shape[i] for i in split], "seconds": t}
        out["burst_s"] = burst_s
    for i, name in enumerate(names):
        n = mesh_shape[i]
        if n == 1:
            continue
        res = {}
        for kind, src_p in (("all_reduce", Partial()), ("all_gather", Shard(0))):
            src = tuple(src_p if j == i else Replicate() for j in range(len(names)))
            pts = []
            for nbytes in sizes:
                numel = nbytes // 4 if kind == "all_reduce" else nbytes // 4 // n
                t, burst_s = timed(src, whole, torch.ones(numel, device=device))
                pts.append((float(nbytes), t))
            res[kind] = pts
        out["axes"][name] = {"size": n, "points": res}
    out.setdefault("burst_s", burst_s)
    return out


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
    import torch.distributed as dist
    from torch import nn

    from ..api import autoparallelize
    from ..api import plan as make_plan
    from ..estimate import estimate
    from ..mesh import Mesh

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

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = Tiny().to(device)
    x = torch.randn(2, 8, TINY_WIDTH, device=device)
    mesh = Mesh(tuple(mesh_shape), tuple(names), device="cpu" if device == "cpu" else "h100")
    whole = tuple("R" for _ in mesh_shape)        # no split: no collective, only the runtime's own cost
    plan = make_plan(model, (x,), mesh, pins={n: whole for n, _ in model.named_parameters()}, batch_axes=None,
                     memory_budget=float("inf"))
    dmodel = autoparallelize(model, mesh, (x,), plan=plan)
    # the nodes the evaluator charges runtime_op_overhead for (the rewrite's modules: LocalOp,
    # Reshard, ToLocal; runtime/fastpath.py then trims many of them, which is what the figure measures)
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
    # the same optimizer on one large DTensor parameter: its time per element beyond the per-tensor cost
    from torch.distributed.tensor import Replicate, distribute_tensor
    elems = 2 ** 18 if quick else 2 ** 20
    big = torch.nn.Parameter(distribute_tensor(torch.randn(elems, device=device), mesh.device_mesh(),
                                               [Replicate()] * len(mesh_shape)))
    big.grad = distribute_tensor(torch.randn(elems, device=device), mesh.device_mesh(), [Replicate()] * len(mesh_shape))
    opt_big = torch.optim.AdamW([big], lr=1e-6)
    t_big = _timeit_together(opt_big.step, max(reps // 4, 5), sync)
    per_tensor = t_opt / n_params
    return {"graph_nodes": nodes, "params": n_params, "step_autopar_s": t_rt, "step_eager_s": t_eager,
            "optimizer_step_s": t_opt, "runtime_op_overhead": max(t_rt - t_eager, 0.0) / nodes,
            "optimizer_param_overhead": per_tensor, "optimizer_big_elements": elems, "optimizer_big_s": t_big,
            "optimizer_element_time": max(t_big - per_tensor, 0.0) / elems}


def _fit_overhead(n: int, small: dict[str, float]) -> tuple[float, float]:
    """(per-collective cost c, per-ring-step latency alpha) from the small-message times left after
    the bandwidth term, all_reduce = c + 2(n-1) alpha and all_gather = c + (n-1) alpha (clamped >= 0)."""
    s_ar, s_ag = latency_steps("all_reduce", n), latency_steps("all_gather", n)
    t_ar, t_ag = small["all_reduce"], small["all_gather"]
    alpha = (t_ar - t_ag) / (s_ar - s_ag)
    c = t_ag - s_ag * alpha
    if alpha < 0:
        alpha, c = 0.0, (t_ar + t_ag) / 2
    elif c < 0:
        c, alpha = 0.0, (t_ar / s_ar + t_ag / s_ag) / 2
    return c, alpha


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
        while len(rounds) < RATE_ROUNDS:
            rounds.append(_measure_rates(device, quick, sync))
        compute.update(median_rates(rounds))
        queue.put((rank, compute, axes))
    finally:
        dist.destroy_process_group()


def calibrate(out: str | Path, *, world_size: int = 2, mesh: tuple[int, ...] | None = None,
              base: str = "cpu", name: str | None = None, quick: bool = False, device: str | None = None) -> Path:
    """Measure this machine with `world_size` ranks and write a profile JSON to `out`."""
    import multiprocessing as mp

    import torch

    from .profiles import Link, load_profile, save_profile
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    mesh = tuple(mesh) if mesh else (world_size,)
    if math.prod(mesh) != world_size:
        raise SystemExit(f"autopar calibrate: mesh {mesh} has {math.prod(mesh)} devices, not --world-size {world_size}")
    names = tuple(f"axis{i}" for i in range(len(mesh)))
    # forked ranks on CPU (fast); spawned on GPU: CUDA cannot be used in a child forked from a process
    # that has touched it (torch.cuda.is_available() above may have)
    ctx = mp.get_context("spawn" if device == "cuda" else "fork")
    queue = ctx.Queue()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="autopar_calibrate_") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, init_file, mesh, names, device, quick, queue))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results = []
        try:
            import queue as queue_mod
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
    # the figures hold for this launch: with more ranks than cores, each rank gets a share of a core
    launch = {"ranks": world_size, "mesh": list(mesh), "cores": os.cpu_count(), "ranks_per_core":
              world_size / (os.cpu_count() or 1), "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    comp = [r[1] for r in results]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    flops = {k: med([c["matmul_flops"][k] for c in comp]) for k in comp[0]["matmul_flops"]}
    bw = med([c["memory_bandwidth"] for c in comp])
    base_p = load_profile(base)
    kernel_overhead = med([c["kernel_overhead"] for c in comp])
    # isolated collectives (back to back, raw torch.distributed): recorded for comparison only
    isolated = {}
    for ax_name, info in results[0][2].items():
        n = info["size"]
        fits = {kind: _fit_ring(kind, n, *pts) for kind, pts in info["points"].items()}
        isolated[ax_name] = {"size": n, "fits": {k: {"bandwidth": b, "latency": l} for k, (b, l) in fits.items()},
                             "points_s": info["points"]}
    # collectives as a training step issues them (_measure_step_collectives), mean over ranks (see
    # there); per axis and kind a least-squares line of seconds against bytes: bandwidth from its
    # slope (the lower of all_reduce's and all_gather's), and its intercept (the cost of a collective
    # that moves nothing) split into a per-collective cost and a per-ring-step latency
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    axes_fit, links, overheads = {}, [], []
    for ax_name, info in comp[0]["step_collectives"]["axes"].items():
        n = info["size"]
        pts = {kind: [(sz, mean([c["step_collectives"]["axes"][ax_name]["points"][kind][j][1] for c in comp]))
                      for j, (sz, _) in enumerate(p)] for kind, p in info["points"].items()}
        lines = {kind: _line(p) for kind, p in pts.items()}
        # a step cannot move bytes faster than back-to-back collectives do: where the slope is lost in
        # scheduling noise, the isolated fit's bandwidth bounds it
        bandwidth = min(min(collective_bytes_on_wire(kind, 1.0, n) / max(lines[kind][1], 1e-15), isolated[ax_name]["fits"][kind]["bandwidth"])
                        for kind in pts)
        per_coll, latency = _fit_overhead(n, {kind: max(lines[kind][0], 0.0) for kind in pts})
        axes_fit[ax_name] = {"size": n, "bandwidth": bandwidth, "latency": latency, "per_collective": per_coll,
                             "lines": {k: {"intercept_s": a, "slope_s_per_byte": b} for k, (a, b) in lines.items()},
                             "points_s": pts, "isolated": isolated.get(ax_name)}
        links.append(Link(bandwidth, latency))
        overheads.append(per_coll)
    # every axis at once: per collective, what is left after each axis's ring terms
    both = [c["step_collectives"].get("all_axes_all_reduce") for c in comp]
    if both[0] is not None:
        nb = both[0]["nbytes"]
        secs = mean([x["seconds"] for x in both])
        ring = sum(2 * (axes_fit[a]["size"] - 1) / axes_fit[a]["size"] * nb / axes_fit[a]["bandwidth"]
                   + 2 * (axes_fit[a]["size"] - 1) * axes_fit[a]["latency"] for a in list(axes_fit))
        per_coll = max(secs - ring, 0.0) / both[0]["collectives"]
        axes_fit["all_axes_all_reduce"] = {**both[0], "seconds": secs, "per_collective": per_coll}
        overheads.append(per_coll)
    # Mesh.reshard_cost charges kernel_overhead + collective_overhead per collective, one figure for
    # every axis: the mean of the per-collective estimates above
    collective_overhead = max(mean(overheads) - kernel_overhead, 0.0) if overheads else 0.0
    rt = [c["runtime"] for c in comp]
    intra = min(links, key=lambda l: l.bandwidth) if links else base_p.intra_node
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
        devices_per_node=max(base_p.devices_per_node, world_size) if device == "cpu" else base_p.devices_per_node,
        source=f"autopar calibrate on {os.uname().nodename}, {world_size} ranks measuring at once, mesh {mesh}, "
               f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    profile = dataclasses.replace(profile, attention_efficiency=_attention_efficiency(comp, profile))
    path = save_profile(profile, out)
    d = json.loads(path.read_text())
    d["_notes"] = {
        "peak_flops": f"torch.mm of square matrices (n={comp[0]['matmul_n']}, smaller for dtypes without a fast "
                      f"kernel), median over {RATE_ROUNDS} rounds spread over the calibration, then over ranks: "
                      "achieved rates, hence matmul_efficiency = 1",
        "memory_bandwidth": "y.copy_(x), read + write bytes, median over ranks",
        "links": "ring alpha-beta fits per mesh axis of all_reduce and all_gather issued as a training step issues "
                 "them (a compute burst, then DTensor redistribute; minus the burst alone), median over ranks: "
                 "bandwidth from the slope between the two sizes, then the small message's remainder split into "
                 "latency per ring step and collective_overhead (see _measured.axes; the isolated back-to-back "
                 "fits are under each axis's 'isolated'); intra_node is the slowest axis; figures not measured "
                 "come from the base profile " + base_p.name,
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
        "rng_element_time": "aten.native_dropout(x, 0.1, train=True) of fp32 x (up to 4M elements on CPU), minus "
                            "the time its bytes (read x, write y and a 1-byte mask) take at memory_bandwidth, per "
                            "element; median over ranks",
        "collective_overhead": "per collective beyond the ring terms and kernel_overhead: DTensor's redistribute and "
                               "waiting for the peers to be scheduled; holds for the launch in _measured.launch",
        "runtime_op_overhead": f"per node of the rank's graph (LocalOp, Reshard, ToLocal), forward + backward: a "
                               f"{TINY_DEPTH}-block transformer (attention, MLP) of width {TINY_WIDTH} through "
                               "autoparallelize (all replicated: no collective) minus the same model in eager "
                               "PyTorch, divided by the graph's nodes; median over ranks",
        "optimizer_param_overhead": "torch.optim.AdamW().step() on that graph's DTensor parameters, divided by their "
                                    "number (their bytes are negligible); median over ranks",
        "optimizer_element_time": "the same AdamW step on one replicated DTensor parameter of 2^20 elements, minus "
                                  "optimizer_param_overhead, per element: torch's default CPU AdamW runs one kernel "
                                  "per operation of the update (about 19 passes of 4 bytes, not the fused 28 bytes "
                                  "cost_model.compute assumes); median over ranks",
    }
    d["_measured"] = {"launch": launch, "axes": axes_fit, "per_rank": comp}
    path.write_text(json.dumps(d, indent=2) + "\n")
    return path
