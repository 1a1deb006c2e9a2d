"""What autopar's runtime costs beyond its kernels, measured on calibrating ranks (`launch.py` runs
it, every rank at once): per node of the rank's graph against eager PyTorch, AdamW's step per
parameter and per element (`measure_runtime`), and the share of the gradient buckets' transfer the
backward hides (`measure_overlap`)."""
from __future__ import annotations

import math
import statistics

from .rank import device_sync, measuring_mesh, timeit_together


# The graph that measures autopar's runtime overhead: TINY_DEPTH transformer blocks (layer norm,
# qkv projection, heads split by view/transpose, scaled dot-product attention, output projection,
# residual adds, GELU MLP) of width TINY_WIDTH: the op mix of the models autopar runs, at sizes
# where kernels cost microseconds and the per-node cost dominates.
TINY_WIDTH, TINY_DEPTH = 16, 2


def measure_runtime(mesh_shape, names, device: str, quick: bool) -> dict:
    """autopar's runtime against eager PyTorch on a tiny graph, all ranks at once: the extra cost per
    node of the rank's graph (LocalOp: unwrap and rewrap DTensors in autograd functions; Reshard),
    forward + backward; and AdamW's step per parameter through `dmodel.optimizer`."""
    import torch

    from ..api import autoparallelize
    from ..api import plan as make_plan
    from ..estimate import estimate
    sync = device_sync(device)
    torch.manual_seed(0)
    model = _tiny_model().to(device)
    x = torch.randn(2, 8, TINY_WIDTH, device=device)
    mesh = measuring_mesh(mesh_shape, names, device)
    whole = tuple("R" for _ in mesh_shape)        # no split: no collective, only the runtime's own cost
    plan = make_plan(model, (x,), mesh, pins={n: whole for n, _ in model.named_parameters()}, batch_axes=None,
                     memory_budget=float("inf"))
    dmodel = autoparallelize(model, mesh, (x,), plan=plan)
    # the nodes the evaluator charges runtime_op_overhead for (the rewrite's modules: LocalOp,
    # Reshard, ToLocal; runtime/trim_wrappers.py then trims many of them, which is what the figure measures)
    nodes = estimate(model, (x,), mesh, plan).graph_nodes
    reps = 15 if quick else 61
    # every rank times the same thing at the same time (planning took each rank its own time):
    # with more ranks than cores, each rank's figure is then what it gets while the others run too
    t_rt = timeit_together(lambda: _train_step(dmodel, x), reps, sync)
    t_eager = timeit_together(lambda: _train_step(model, x), reps, sync)
    opt = dmodel.optimizer(torch.optim.AdamW, lr=1e-6)      # as a training step runs it
    _train_step(dmodel, x)                        # gradients stay: step() alone is timed
    n_params = sum(1 for _ in dmodel.parameters())
    t_opt = timeit_together(opt.step, reps, sync)
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
    return timeit_together(opt_big.step, reps, sync)


# The model that measures how much of the gradient buckets' transfer the backward hides: OVERLAP_DEPTH
# linear layers of OVERLAP_WIDTH (each layer's gradient one bucket: every bucket but the last leaves
# while layers are still to go) over OVERLAP_ROWS rows per rank, so that the backward's compute outlasts
# the transfer (one layer's backward, 4 x rows x width^2 FLOPs, against its all-reduce of 4 x width^2
# bytes: at the shipped CPU figures about 5x the transfer), as in the steps whose buckets it prices.
OVERLAP_WIDTH, OVERLAP_DEPTH, OVERLAP_ROWS = 512, 8, 512
OVERLAP_ROUNDS = 3


def measure_overlap(mesh_shape, names, device: str, quick: bool) -> dict:
    """The share of the gradient buckets' transfer the backward hides, as the runtime runs them
    (runtime/grad_sync.py), all ranks at once: a data-parallel step of a linear stack (every axis
    splitting the batch, each rank OVERLAP_ROWS rows) against the same program with nothing to reduce
    (every parameter replicated, each rank the same rows whole: the same compute); the difference is
    the buckets' exposed time. The same buckets' all-reduces issued back to back give their time
    alone; the last, launched when the backward ends, hides nothing (`cost_model.comm.final_bucket_time`
    prices it so). overlap = 1 - (exposed - last) / (alone - last), the share of the early buckets'
    time hidden, in [0, 1]; the copies into the buckets are part of what is exposed."""
    import torch
    width, depth, rows = (256, 4, 256) if quick else (OVERLAP_WIDTH, OVERLAP_DEPTH, OVERLAP_ROWS)
    if math.prod(mesh_shape) == 1:
        return {}
    sync = device_sync(device)
    torch.manual_seed(0)
    model = _linear_stack(width, depth).to(device)
    layer_bytes = 4 * (width * width + width)
    mesh = measuring_mesh(mesh_shape, names, device, grad_bucket_bytes=layer_bytes)
    x_local = torch.randn(rows, width, device=device)
    dp, alone = _data_parallel_and_alone(model, mesh, x_local)
    reps = 3 if quick else 7
    dp._grad_sync.buckets_launched = 0
    _train_step(dp, x_local)
    buckets = dp._grad_sync.buckets_launched          # one backward's
    flat = [torch.randn(layer_bytes // 4, device=device) for _ in range(buckets)]
    t_dp, t_alone, t_comm, t_last = _overlap_times(lambda: _train_step(dp, x_local),
                                                   lambda: _train_step(alone, x_local), flat, reps, sync)
    exposed = t_dp - t_alone
    early = max(t_comm - t_last, 1e-9)
    return {"width": width, "depth": depth, "rows": rows, "buckets": buckets, "step_s": t_dp, "no_sync_s": t_alone,
            "buckets_alone_s": t_comm, "last_bucket_s": t_last,
            "overlap": min(max(1.0 - (exposed - t_last) / early, 0.0), 1.0)}


def _data_parallel_and_alone(model, mesh, x_local):
    """`model` run data parallel over every axis of `mesh` (each rank the rows `x_local` of a batch of
    them all, every parameter replicated), and run with nothing split (each rank `x_local` whole: the
    same compute, nothing to reduce)."""
    import torch

    from ..api import autoparallelize
    from ..api import plan as make_plan
    whole = {n: tuple("R" for _ in mesh.shape) for n, _ in model.named_parameters()}
    x_global = torch.cat([x_local] * math.prod(mesh.shape))
    dp = autoparallelize(model, mesh, (x_global,), plan=make_plan(
        model, (x_global,), mesh, pins=whole, batch_axes=tuple(mesh.axis_names), memory_budget=float("inf")))
    alone = autoparallelize(model, mesh, (x_local,), plan=make_plan(
        model, (x_local,), mesh, pins={"*": tuple("R" for _ in mesh.shape)}, batch_axes=None,   # ops too: no split
        memory_budget=float("inf")))
    return dp, alone


def _train_step(model, x) -> None:
    """One forward and backward of `model` on `x` (a DTensor loss made whole first)."""
    out = model(x)
    out = out.full_tensor() if hasattr(out, "full_tensor") else out
    out.backward()


def _linear_stack(width: int, depth: int):
    """The model `measure_overlap` steps: `depth` linear layers of `width`, ReLU between."""
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
    rounds = [(timeit_together(step, reps, sync), timeit_together(no_sync_step, reps, sync),
               timeit_together(reduce_all, reps, sync), timeit_together(lambda: dist.all_reduce(flat[0]), reps, sync))
              for _ in range(OVERLAP_ROUNDS)]
    return tuple(statistics.median(r[i] for r in rounds) for i in range(4))
