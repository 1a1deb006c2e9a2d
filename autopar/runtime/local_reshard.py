"""A reshard edge between two ops that hand on local tensors: the move on the plain local tensor, its
gradient's move in the backward, one autograd node, no DTensor.

An edge whose move the runtime issues step by step on the local tensor (`direct_reshard.direct_plan`:
all-reduces and reduce-scatters of sums, all-gathers, local slices, on even shards), out of a `LocalOp`
and into a `LocalOp`, ran as three autograd wrappers: the producer's `_FromLocal` (a DTensor made),
the `Reshard` (`to_layout`: the steps found per call, a DTensor made for the result) and the
consumer's `_ToLocal`, each again in the backward (`ops.py`, `reshard.py`). Measured (rank 0 of a
(2, 2) fake process group alone, CPU inclusive per step, 2026-11-28, load ~5): the wrappers of
tensor parallel's 18 reshard edges (4 activations, 14 weight gathers: those are `trim_wrappers.ParamEdge`s
now) 10.9 ms of CPU a step, of which 7.8 ms in `to_layout`; 2-D's 14, 6.8 and 5.0 ms; with both
(the plan built twice in one process, steps alternated) tensor parallel's step took 3.4 ms less CPU,
2-D's 2.7 ms (docs/cost_model.md, stop 52). Here the producer hands on its local result
(`rewrite.passes_local`), the edge
(`LocalReshard`) runs the steps fixed when the program is built (`direct_reshard.run_steps`) in the
forward and the gradient's steps (from the layout the consumer sends it back in to the one the
producer takes it in) in the backward, and the consumer takes the plain result. The same
collectives, in the same order, with the same copies: the price is unchanged.

Taken only where both moves are such steps, the producer's output is no partial average (its
gradient is scaled on the way back), and the plan re-gathers no activations (runtime/memory.py
swaps a gathering `Reshard` for a `GatherCopy`); traced (the compile backend) or watched (a collective
timeout), the edge runs the three wrappers as before, on DTensor's functional collectives where traced.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from ..compat import tracing
from ..cost_model.comm import layout_code
from ..placement import layout_str
from .direct_reshard import direct_plan, run_steps
from .faults import watch_of
from .ops import _FromLocal, _ToLocal
from .reshard import Reshard, reshard


def local_reshard_steps(shape: Sequence[int], src: Sequence[Placement], want: Sequence[Placement],
                        grad: Sequence[Placement], arrives: Sequence[Placement], mesh_shape) -> tuple | None:
    """(forward steps, backward steps) of an edge moving a tensor of global `shape` from `src` to `want`,
    whose gradient comes back in `grad` and leaves in `arrives`, where both are `direct_plan`s and the
    shape is known; None otherwise."""
    if not all(isinstance(d, int) for d in shape):
        return None
    sizes = tuple(mesh_shape)
    fwd = direct_plan(tuple(shape), layout_code(src), layout_code(want), sizes)
    bwd = direct_plan(tuple(shape), layout_code(grad), layout_code(arrives), sizes)
    return None if fwd is None or bwd is None else (fwd, bwd)


class _LocalMove(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, edge: "LocalReshard"):  # type: ignore[override]
        ctx.edge = edge
        return run_steps(x, edge.steps[0], edge.mesh, edge.coord).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        edge = ctx.edge
        return run_steps(grad.contiguous(), edge.steps[1], edge.mesh, edge.coord).contiguous(), None


class LocalReshard(Reshard):
    """Graph op: `y = self.reshard_x(x)` moves the plain local tensor `x` (in `source`) to `layout` and
    hands on the plain result; its gradient (arriving in `grad`) goes back in `arrives`, by `steps`
    (`local_reshard_steps`). See the module docstring."""

    def __init__(self, layout: Sequence[Placement], source: Sequence[Placement], grad: Sequence[Placement],
                 arrives: Sequence[Placement], steps: tuple, mesh):
        super().__init__(layout)
        self.source, self.grad, self.arrives = tuple(source), tuple(grad), tuple(arrives)
        self.steps, self.mesh = steps, mesh
        self.coord = mesh.get_coordinate()

    def forward(self, x):
        if isinstance(x, DTensor):       # handed on as a DTensor after all: unwrapped, its gradient in `arrives`
            x = _ToLocal.apply(x, self.arrives)
        if tracing() or watch_of(self.mesh) is not None:
            # the wrappers the edge had: traced, DTensor's functional collectives; watched, the watched moves
            y = reshard(_FromLocal.apply(x, self.mesh, self.source, self.arrives), self.layout)
            return _ToLocal.apply(y, self.grad)
        return _LocalMove.apply(x, self)

    def extra_repr(self) -> str:
        src, dst = ", ".join(layout_str(self.source)), ", ".join(layout_str(self.layout))
        return f"{src} -> {dst} (local; gradient {', '.join(layout_str(self.grad))} -> {', '.join(layout_str(self.arrives))})"
