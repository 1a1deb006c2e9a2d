"""Resharding as an explicit, differentiable graph op.

`Reshard(mesh, layout)` moves a DTensor to `layout` and sends its gradient back in the
layout the input had (Partial inputs get a whole gradient). That second half is why we do
not call `DTensor.redistribute` alone: a weight replicated over a data-parallel axis
receives a partial-sum gradient from its matmul, and only an explicit reshard on its way
into the op turns that into the all-reduce (or, for a sharded weight, the reduce-scatter)
that data parallelism needs before the optimizer sees it.

DTensor refuses `Replicate -> Partial`; we do it here exactly: for a partial sum the
coordinate-0 device keeps the value and the others hold zeros, so the sum equals the original
bit for bit; for a partial average every device keeps the value. Traced into the compiled
per-rank program (`compiled.py`), which device keeps it is read from an input of the program
(`traced_coordinate`), not decided while tracing: the traced graph is the same on every rank.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..compat import dtensor_from, tracing
from ..placement import layout_str, over_one_device
from .direct_reshard import direct_steps, local_block, local_collective
from .faults import watched


def to_layout(x: DTensor, layout: Sequence[Placement]) -> DTensor:
    """Redistribute x to layout (no autograd): the steps DTensor's redistribute would take, issued as
    c10d collectives on the local tensor where each is one (`one_collective`, `local_split`,
    `direct_reshard.direct_steps`), DTensor's redistribute else; plus exact R/S -> P; watched
    (`faults.py`) when the module was built with a collective timeout."""
    layout = tuple(layout)
    cur = tuple(x.placements)
    if cur == layout:
        return x
    with watched(x.device_mesh, lambda: _describe(x, cur, layout)):
        return _to_layout(x, cur, layout)


def _describe(x: DTensor, cur: tuple, layout: tuple) -> str:
    axes = x.device_mesh.mesh_dim_names or tuple(range(x.device_mesh.ndim))
    changed = ", ".join(str(ax) for ax, c, t in zip(axes, cur, layout) if c != t)
    return f"reshard over {changed}: {layout_str(cur)} -> {layout_str(layout)}, shape {list(x.shape)}"


def _to_layout(x: DTensor, cur: tuple, layout: tuple) -> DTensor:
    if over_one_device(x.device_mesh.shape, cur, layout):
        return _relabel(x, layout)
    to_partial = [i for i, (c, t) in enumerate(zip(cur, layout)) if isinstance(t, Partial) and c != t]
    mid = tuple(Replicate() if i in to_partial else t for i, t in enumerate(layout))
    # Partial -> other Partial kinds are not needed by any rule; go through Replicate
    mid = tuple(Replicate() if isinstance(c, Partial) and isinstance(m, Partial) and c != m else m
                for c, m in zip(cur, mid))
    # traced (the compile backend): DTensor's functional collectives, which trace; c10d's do not
    issued = None if mid == cur or tracing() else (one_collective(x, cur, mid) or local_split(x, cur, mid)
                                                   or direct_steps(x, cur, mid))
    y = x if mid == cur else issued[0] if issued is not None else x.redistribute(x.device_mesh, mid)
    if to_partial:
        local = _first_keeps(y.to_local(), x.device_mesh, [i for i in to_partial if layout[i].reduce_op == "sum"])
        y = dtensor_from(local, x.device_mesh, layout)
    local = y.to_local()
    if not local.is_contiguous():
        # chunking a non-leading dim (gloo's all-to-all fallback) leaves strided shards, which
        # later views, forward or backward, cannot take
        y = dtensor_from(local.contiguous(), y.device_mesh, layout)
    return y


# the traced input holding this rank's mesh coordinate, while a per-rank program is traced (per thread)
_TRACED = threading.local()


@contextlib.contextmanager
def traced_coordinate(device_mesh):
    """While the per-rank program over `device_mesh` is traced, forward and backward: yields
    `set(t)`, which names the traced tensor (an input of the program) holding this rank's coordinate.
    A move to a partial sum then keeps or zeros the value by that tensor. Decided while tracing, by
    the Python coordinate, the graph would differ between ranks (zeros have no inputs): inductor's
    partitioner then moves a collective reducing such zeros into the forward on some ranks and
    leaves it in the backward on others, and the ranks wait on different collectives."""
    _TRACED.mesh, _TRACED.coordinate = device_mesh, None

    def set_coordinate(t: torch.Tensor) -> None:
        _TRACED.coordinate = t
    try:
        yield set_coordinate
    finally:
        _TRACED.mesh = _TRACED.coordinate = None


def _first_keeps(local: torch.Tensor, mesh, axes: list[int]) -> torch.Tensor:
    """`local` on the device at coordinate 0 of every axis in `axes`, zeros on the others (a partial
    sum over `axes` of a whole value)."""
    if not axes:
        return local
    if not tracing():
        coord = mesh.get_coordinate()
        return local if all(coord[i] == 0 for i in axes) else torch.zeros_like(local)
    coordinate = getattr(_TRACED, "coordinate", None)
    if coordinate is None or _TRACED.mesh is not mesh:
        raise RuntimeError("autopar: a move to a partial sum traced outside compiled.compile_program, which feeds "
                           "the program this rank's mesh coordinate: the graph would differ between ranks")
    keep = (coordinate[list(axes)] == 0).all()
    return torch.where(keep, local, local.new_zeros(()))


def carries_grad(dtype: torch.dtype) -> bool:
    """Can a gradient flow through a tensor of `dtype` (floating or complex; not integers, bools)?"""
    return dtype.is_floating_point or dtype.is_complex


def _relabel(x: DTensor, layout: tuple) -> DTensor:
    return dtensor_from(x.to_local(), x.device_mesh, layout, shape=x.shape, stride=x.stride())


def one_collective(x: DTensor, cur: tuple, layout: tuple, async_op: bool = False) -> tuple | None:
    """(`x` moved to `layout`, the collective's work handle: None unless `async_op`, else wait on it
    before reading the result) by one c10d collective (none over axes of one device), where the move is one of the two a data-parallel
    step makes (a loss summed over the batch, a gradient reduced): one axis from a partial sum to
    whole (all-reduce), or from an even shard on dim 0 to whole (all-gather). None otherwise.
    DTensor's redistribute issues the same collective through its functional-collective layer, at
    about 0.4 ms more CPU per call (measured on 2 gloo ranks: a scalar all-reduce 650 vs 240 us of
    CPU; gathering a 1,024-element mask 1,100 vs about 300 us), paid per step on the hot path."""
    if over_one_device(x.device_mesh.shape, cur, layout):
        return _relabel(x, layout), None
    move = collective_move(cur, layout, x.shape, x.device_mesh.shape)
    if move is None:
        return None
    out, work = local_collective(x.to_local(), x.device_mesh, *move, async_op=async_op)
    return dtensor_from(out, x.device_mesh, layout, shape=x.shape, stride=x.stride()), work


def collective_move(cur: Sequence[Placement], layout: Sequence[Placement], shape: Sequence[int],
                    mesh_shape: Sequence[int]) -> tuple[int, bool] | None:
    """(mesh axis, gathered) where moving a tensor of global `shape` from `cur` to `layout` is one c10d
    collective over that axis (`one_collective`): an all-reduce of a partial sum (gathered False) or
    an all-gather of an even shard on dim 0 (True); None for any other move."""
    changed = [a for a, (c, t) in enumerate(zip(cur, layout)) if c != t]
    if len(changed) != 1 or not isinstance(layout[changed[0]], Replicate):
        return None
    a = changed[0]
    src = cur[a]
    if isinstance(src, Partial) and src.reduce_op == "sum":
        return a, False
    if (isinstance(src, Shard) and src.dim == 0 and len(shape) and shape[0] % mesh_shape[a] == 0
            and not any(isinstance(p, Shard) and p.dim == 0 for i, p in enumerate(cur) if i != a)):
        return a, True
    return None


def split_axes(cur: Sequence[Placement], layout: Sequence[Placement], shape: Sequence[int],
               mesh_shape: Sequence[int]) -> tuple[tuple[int, int], ...] | None:
    """((mesh axis, dim), ...) where moving a tensor of global `shape` from `cur` to `layout` only splits
    whole axes evenly (`Replicate` -> `Shard(d)`, no other axis of `cur` splitting dim d): each rank's
    block is a slice of its local tensor, no communication. None otherwise."""
    changed = [a for a, (c, t) in enumerate(zip(cur, layout)) if c != t]
    if not changed or not all(isinstance(cur[a], Replicate) and isinstance(layout[a], Shard) for a in changed):
        return None
    size = {}
    for a in changed:
        d = layout[a].dim
        if any(isinstance(p, Shard) and p.dim == d for p in cur) or d >= len(shape):
            return None
        size[d] = size.get(d, shape[d])
        if size[d] % mesh_shape[a]:
            return None
        size[d] //= mesh_shape[a]
    return tuple((a, layout[a].dim) for a in changed)


def local_split(x: DTensor, cur: tuple, layout: tuple) -> tuple | None:
    """(`x` moved to `layout`, None) where the move only splits whole axes evenly (`split_axes`): this
    rank's block of its local tensor, taken without communication or DTensor's redistribute (whose
    Python costs about a millisecond a call: an input given whole and split over the batch, every
    step). None otherwise."""
    mesh = x.device_mesh
    axes = split_axes(cur, layout, x.shape, mesh.shape)
    if axes is None:
        return None
    local = local_block(x.to_local(), axes, mesh.get_coordinate(), mesh.shape)
    return dtensor_from(local, mesh, layout, shape=x.shape, stride=x.stride()), None


def grad_layout(layout: Sequence[Placement]) -> tuple[Placement, ...]:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in layout)


class _Reshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor, layout: tuple, sync, grad_to):  # type: ignore[override]
        ctx.src, ctx.sync, ctx.grad_to = tuple(x.placements), sync, grad_to
        return to_layout(x, layout)

    @staticmethod
    def backward(ctx, grad: DTensor):  # type: ignore[override]
        return reduce_grad(grad, ctx.src, ctx.sync, ctx.grad_to), None, None, None


def reduce_grad(grad: DTensor, src: tuple, sync, grad_to: tuple | None = None) -> DTensor | None:
    """The gradient of a reshard from layout `src`: handed to a gradient bucket by `sync` (None
    returned: grad_sync.py reduces it), or moved to `grad_to` here (default: back to `src`, partial
    sums made whole; a parameter-side producer's takes partial sums, strategies/gradients.py)."""
    if sync is not None and sync.take(grad.placements, src, grad.to_local()):
        return None
    return to_layout(grad, grad_to or grad_layout(src))


def reduce_local_grad(grad: torch.Tensor, layout: tuple, src: tuple, sync, meta: tuple) -> DTensor | None:
    """`reduce_grad` of a gradient that arrives as this rank's local part `grad` in `layout`, of a
    tensor whose (mesh, global shape, stride) is `meta`: no DTensor made when a bucket takes it."""
    if sync is not None and sync.take(layout, src, grad):
        return None
    mesh, shape, stride = meta
    whole = dtensor_from(grad.contiguous(), mesh, layout, shape=shape, stride=stride)
    return to_layout(whole, grad_layout(src))


def reshard(x: DTensor, layout: Sequence[Placement], sync=None, grad_to: tuple | None = None) -> DTensor:
    """x moved to `layout`, differentiably; `sync` (a `grad_sync.ParamGrad`, on a parameter's edge)
    takes the gradient's reduction into the module's buckets; `grad_to`: see `reduce_grad`."""
    return _Reshard.apply(x, tuple(layout), sync, grad_to)


class Reshard(torch.nn.Module):
    """Graph op: `y = self.reshard_x(x)` moves x to `layout` (see module docstring). On a parameter's
    edge, `sync` links it to the module's gradient buckets (grad_sync.attach)."""

    def __init__(self, layout: Sequence[Placement], grad_to: Sequence[Placement] | None = None):
        super().__init__()
        self.layout = tuple(layout)
        self.sync = None
        self.grad_to = None if grad_to is None else tuple(grad_to)   # see `reduce_grad`

    def forward(self, x):
        return reshard(x, self.layout, self.sync, self.grad_to) if isinstance(x, DTensor) else x

    def extra_repr(self) -> str:
        return ", ".join(layout_str(self.layout))


class LocalSplit(Reshard):
    """Graph op: `y = self.reshard_x(x)` on an edge where a tensor no gradient flows through (an
    integer input given whole: token ids, targets) is split evenly over whole axes (`split_axes`):
    this rank's block of the local tensor, handed on as a plain tensor to the `LocalOp` that takes
    it (which takes local tensors as they are), with no DTensor made or redistributed. `x` may
    arrive as a plain tensor in layout `source` (an input fed local, an op handing its result on
    local: trim_wrappers.py, rewrite.passes_local) or as a DTensor. Traced (the compile backend),
    it moves the DTensor as `Reshard` does, so that every rank traces the same graph."""

    def __init__(self, layout: Sequence[Placement], source: Sequence[Placement], axes: Sequence[tuple[int, int]],
                 mesh):
        super().__init__(layout)
        self.source, self.axes, self.mesh = tuple(source), tuple(axes), mesh
        self._coord = mesh.get_coordinate()

    def forward(self, x):
        if tracing():
            if not isinstance(x, DTensor):
                x = dtensor_from(x, self.mesh, self.source)
            return to_layout(x, self.layout).to_local()
        local = x.to_local() if isinstance(x, DTensor) else x
        return local_block(local, self.axes, self._coord, self.mesh.shape)

    def extra_repr(self) -> str:
        src, dst = ", ".join(layout_str(self.source)), ", ".join(layout_str(self.layout))
        return f"{src} -> {dst} (this rank's block, local)"
