"""How a planned op runs on DTensors: through DTensor, on local shards, or replicated."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement

from ..placement import layout_str
from .reshard import reshard


def _wrap_plain(out, mesh, layout):
    """Factory ops return plain tensors: they are whole on every device."""
    return pytree.tree_map(
        lambda t: DTensor.from_local(t, mesh, tuple(Replicate() for _ in layout), run_check=False)
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t, out)


_RESHAPE_FOR = {torch.ops.aten.view.default: torch.ops.aten.reshape.default,
                torch.ops.aten._unsafe_view.default: torch.ops.aten.reshape.default}


class OpCall(torch.nn.Module):
    """Runs the op through DTensor on inputs already in their planned layouts.

    `mismatches` counts calls whose output layout differed from the plan (DTensor chose
    another rule): results stay correct, the consumer's reshard absorbs the difference."""

    def __init__(self, target, layout: Sequence[Placement], mesh):
        super().__init__()
        # a local shard may be non-contiguous where the global tensor is not: reshape copies then
        target = _RESHAPE_FOR.get(target, target)
        self.target, self.layout, self.mesh = target, tuple(layout), mesh
        self.mismatches = 0

    def forward(self, *args, **kwargs):
        out = _wrap_plain(self.target(*args, **kwargs), self.mesh, self.layout)
        out = pytree.tree_map(lambda t: _ContiguousGrad.apply(t) if isinstance(t, DTensor) and t.requires_grad
                              else t, out)
        first = next((t for t in pytree.tree_leaves(out) if isinstance(t, DTensor)), None)
        if first is not None and tuple(first.placements) != self.layout:
            self.mismatches += 1
        return out

    def extra_repr(self) -> str:
        return f"{self.target} -> {', '.join(layout_str(self.layout))}"


def contiguous_local(t):
    """t with a contiguous local tensor. DTensor reports the *global* strides, so a DTensor whose
    local shard is strided (a transpose's gradient, gloo's all-to-all fallback) looks contiguous,
    and the next `reshape` takes the view path and fails on the shard."""
    if isinstance(t, DTensor):
        local = t._local_tensor
        if local.is_contiguous():
            return t
        return DTensor.from_local(local.contiguous(), t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return t if t is None or t.is_contiguous() else t.contiguous()


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a gradient with a contiguous local tensor."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return contiguous_local(grad)


def _to_local(t):
    return _ContiguousGrad.apply(t.to_local()) if isinstance(t, DTensor) else t


class LocalOp(torch.nn.Module):
    """Runs the op on each device's local shards (the rule proves the op is shard-local)."""

    def __init__(self, target, layout: Sequence[Placement], mesh):
        super().__init__()
        self.target, self.layout, self.mesh = target, tuple(layout), mesh

    def forward(self, *args, **kwargs):
        args, kwargs = pytree.tree_map(_to_local, (args, kwargs))
        out = self.target(*args, **kwargs)
        # gradients enter and leave the local op contiguous (fused kernels' backwards view them)
        return pytree.tree_map(lambda t: DTensor.from_local(_ContiguousGrad.apply(t), self.mesh, self.layout,
                                                            run_check=False)
                               if isinstance(t, torch.Tensor) else t, out)

    def extra_repr(self) -> str:
        return f"{self.target} on local shards -> {', '.join(layout_str(self.layout))}"


class ReplicateOp(LocalOp):
    """An op no rule knows: every input gathered whole, run as on one device (the safe fallback)."""

    def forward(self, *args, **kwargs):
        whole = tuple(Replicate() for _ in self.layout)
        args, kwargs = pytree.tree_map(lambda t: reshard(t, whole) if isinstance(t, DTensor) else t, (args, kwargs))
        return super().forward(*args, **kwargs)


class ToLocal(torch.nn.Module):
    """A whole (replicated) DTensor back to a plain tensor for the caller."""

    def forward(self, x):
        return x.to_local() if isinstance(x, DTensor) else x
