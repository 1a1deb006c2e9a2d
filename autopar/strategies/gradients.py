"""The layouts gradients travel in under a strategy: one rule for the planner's prices
(solver/problem.py's edge tables, `estimate()`) and for the runtime that sends them (runtime/ops.py).

Per mesh axis, for an op's input:

* a Partial input gets a whole (Replicate) gradient;
* a Replicate input used by work split over the axis gets a partial sum over it (a weight under
  data parallelism);
* a Shard input gets its shard.

A *parameter-side* op (passes/parameter_side.py: its gradient flows into parameters alone, such as
a position embedding looked up at constant positions, or a weight's transpose) also keeps partial
sums on the axes where it is replicated: a vector-Jacobian product is linear in the gradient, and
its forward values are the same on every device of the axis, so the op's backward on each device's
partial sum yields partial sums of its inputs' gradients. Their reduction then happens once, in the
parameters' gradient buckets, overlapped with the backward (DDP's way), instead of as a blocking
all-reduce of the activation's gradient at the edge where the replicated region meets split work.
"""
from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.placement_types import Placement

Layout = tuple[Placement, ...]


def input_grad_layouts(inputs: Sequence[Layout], output: Layout, side_axes: Sequence[bool] = ()) -> list[Layout]:
    """Per input of an op with these layouts, the layout its gradient leaves the op in. `side_axes`:
    per mesh axis, may a parameter-side op keep partial sums there (empty: not parameter-side; a
    pipeline's axis never: its stages hold different ops)."""
    n = len(output)
    side = tuple(side_axes) or (False,) * n
    partial = [side[a] or not (isinstance(output[a], Replicate) and all(isinstance(i[a], Replicate) for i in inputs))
               for a in range(n)]
    return [tuple(Replicate() if isinstance(p, Partial) else Partial() if isinstance(p, Replicate) and partial[a]
                  else p for a, p in enumerate(lay)) for lay in inputs]


def output_grad_layout(output: Layout, side_axes: Sequence[bool] = ()) -> Layout:
    """The layout an op's output gradient must arrive in: whole where the output was a partial sum;
    a parameter-side op takes partial sums where its output is replicated (on `side_axes`)."""
    side = tuple(side_axes) or (False,) * len(output)
    return tuple(Replicate() if isinstance(p, Partial) else Partial() if isinstance(p, Replicate) and s else p
                 for p, s in zip(output, side))
