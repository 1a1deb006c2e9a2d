"""A program output made whole by an all-reduce that nothing in the step waits for.

A mean loss is a sum over each rank's rows divided by a global count; the plan may divide each
rank's partial sum (strategies/pointwise.py `scaled_partial_options`) so that the loss leaves the
program a partial sum over one axis (`comm.async_output_axis`). Its all-reduce is then issued
asynchronously and the caller gets a `Pending` tensor: waited at the first op that reads it
(`loss.item()`, a print, arithmetic on it), as funcol's AsyncCollectiveTensor, except that the
factories that read only its shape (`ones_like`: `loss.backward()` seeding the gradient) do not wait.
So in a training step the ranks do not meet at the end of the forward (the slowest rank's forward
no longer stops the others there); they meet once, at the gradient buckets, as under DDP.

The backward needs no collective: the gradient of a partial input made whole is whole.
With a collective timeout (faults.py) the output is made whole by the watched, blocking `Reshard`.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

from ..compat import dtensor_from, pytree, tracing, wrapper_tensor
from ..cost_model.comm import async_output_axis
from .direct_reshard import local_collective
from .faults import watch_of
from .reshard import one_collective, reshard

aten = torch.ops.aten
# ops that read a tensor's metadata only: they run on a pending value without waiting for it
_SHAPE_ONLY = frozenset({aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default})


class Pending(torch.Tensor):
    """A tensor an asynchronous all-reduce is still writing (module docstring)."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor, work):
        r = wrapper_tensor(cls, elem)
        r.elem, r.work = elem, work
        return r

    def wait(self) -> torch.Tensor:
        """The value, once the collective has written it."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.elem

    def __repr__(self) -> str:  # type: ignore[override]
        return repr(self.wait())

    def tolist(self):
        return self.wait().tolist()

    def numpy(self, *args, **kwargs):  # type: ignore[override]
        return self.wait().numpy(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func in _SHAPE_ONLY:
            unwrap = lambda t: t.elem if isinstance(t, Pending) else t  # noqa: E731
        else:
            unwrap = lambda t: t.wait() if isinstance(t, Pending) else t  # noqa: E731
        args, kwargs = pytree.tree_map(unwrap, (args, kwargs or {}))
        return func(*args, **kwargs)


class _AllReduceLater(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor):  # type: ignore[override]
        mesh = x.device_mesh
        ctx.meta = (mesh, x.shape, x.stride())
        whole = tuple(Replicate() for _ in range(mesh.ndim))
        y, work = one_collective(x, tuple(x.placements), whole, async_op=True)
        return Pending(y.to_local(), work)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        mesh, shape, stride = ctx.meta
        whole = tuple(Replicate() for _ in range(mesh.ndim))
        return dtensor_from(grad.contiguous(), mesh, whole, shape=shape, stride=stride)


class _AllReduceLocalLater(torch.autograd.Function):
    """`_AllReduceLater` of the plain local partial sum `x`: the gradient of each rank's term is the
    whole output's gradient, as it arrives."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh, axis: int):  # type: ignore[override]
        return Pending(*local_collective(x, mesh, axis, gathered=False, async_op=True))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None, None


class AsyncOutput(torch.nn.Module):
    """Graph op: `y = self.reshard_output_k(x)` for an output that is a partial sum over mesh axis
    `axis` and whole elsewhere: `y` is this rank's whole value as a `Pending` plain tensor. `x` is a
    DTensor, or this rank's plain local tensor in layout `source` (its op hands it on local:
    `rewrite.passes_local`), all-reduced as it is with no DTensor made; traced or watched, it moves
    as a DTensor in `source`. `blocking`: made whole by the plain reshard (a traced program, whose
    outputs cannot hold a pending work handle: compiled.py)."""

    def __init__(self, axis: int, source: tuple, mesh):
        super().__init__()
        self.axis, self.source, self.mesh = axis, tuple(source), mesh
        self.blocking = False

    def forward(self, x):
        if not isinstance(x, DTensor):
            if self.blocking or tracing() or watch_of(self.mesh) is not None:
                x = dtensor_from(x, self.mesh, self.source)
            else:
                return _AllReduceLocalLater.apply(x, self.mesh, self.axis)
        whole = tuple(Replicate() for _ in range(x.device_mesh.ndim))
        if (self.blocking or watch_of(x.device_mesh) is not None
                or async_output_axis(x.placements, whole) != self.axis):
            return reshard(x, whole).to_local()
        return _AllReduceLater.apply(x)

    def extra_repr(self) -> str:
        return f"all-reduce over axis {self.axis}, waited at first use"
