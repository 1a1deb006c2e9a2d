"""How a calibrating rank measures collectives (`launch.py` runs it, every rank at once): per mesh
axis, raw collectives back to back (`measure_isolated`: the transport's own latency and a bound on
its bandwidth), and the runtime's collectives as a training step issues them, each after a burst of
compute, cycling over the axes (`measure_step_collectives`: what they cost in a step). `fit.py` turns
both into the profile's links and per-collective cost."""
from __future__ import annotations

import functools

from .rank import device_sync, measuring_mesh, timeit, timeit_together


def measure_isolated(mesh_shape, names, device: str, quick: bool) -> dict:
    """Per mesh axis of more than one device, its size and `points`: per kind (all_reduce, all_gather,
    reduce_scatter) (bytes, seconds) of raw torch.distributed collectives back to back at a small and
    a large size, the median of a few repeats; the reduce-scatter as the runtime issues it
    (`runtime.direct_reshard.reduce_scatter`)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ..compat import all_gather_single
    from ..runtime.direct_reshard import reduce_scatter
    sync = device_sync(device)
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
                elif kind == "reduce_scatter":       # the runtime's (on gloo an all-to-all and a sum)
                    fn = lambda: reduce_scatter(part, full[: part.numel() * n], group)  # noqa: E731
                else:
                    fn = lambda: all_gather_single(full[: part.numel() * n], part, group=group)  # noqa: E731
                dist.barrier()
                pts.append((float(part.numel() * n * 4), timeit(fn, reps, sync)))
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


def measure_step_collectives(mesh_shape, names, device: str, quick: bool) -> dict:
    """Collectives as a training step issues them: every rank computes a burst, then moves a DTensor
    with the runtime's own `to_layout` (one c10d collective, as a step's reshards issue theirs:
    Partial -> Replicate is an all_reduce, Shard(0) -> Replicate an all_gather) over one mesh axis, all ranks at once; then a burst and the
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

    from ..runtime.reshard import to_layout
    sync = device_sync(device)
    dmesh = measuring_mesh(mesh_shape, names, device).device_mesh()
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
        each after a burst, `reps` times in a row (above), in a forward and again inside
        a backward, the mean of the two (a step issues about half its collectives in each; a small
        all_gather added 3.0-3.5 ms issued in the forward and 4.1-4.4 ms by the backward). The
        bursts alone are timed next to them, so a change of load between points moves both alike.
        The mean, not the median: a step is the sum of its collectives, and their cost is bimodal
        (the peer is scheduled or not)."""
        steps = [f for src, local in moves for f in (burst, lambda src=src, local=local: move(src, local))]

        def forward_cycle():
            for f in steps:
                f()
        fwd = timeit_together(forward_cycle, reps, sync) - len(moves) * timeit_together(burst, reps, sync)
        bwd = (timeit_together(lambda: _in_backward(steps), reps, sync)
               - timeit_together(lambda: _in_backward([burst] * len(moves)), reps, sync))
        return (fwd + bwd) / (2 * len(moves))

    return _step_collective_points(timed, mesh_shape, names, cycle, sizes, device)


def _step_collective_points(timed, mesh_shape, names, cycle: list[int], sizes: tuple[int, ...], device: str) -> dict:
    """`measure_step_collectives`' figures: `timed(moves)` of every axis's all_reduce at once, and of
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
