"""A call with inputs of other sizes than planned: the plan's layouts stay, the program follows.

The per-rank program bakes in the captured sizes (view/reshape/expand shape arguments, `arange`
lengths, ...). When a call brings inputs of other shapes (another batch size or sequence length),
the model is captured again at the new global shapes, the new graph must be the planned one (the
same nodes and ops; only sizes differ), every planned layout must split the new sizes evenly
(`fit.layout_misfits`), and the plan is rewritten over the new capture. The program is kept for
later calls at those shapes. No re-planning: the layouts, and so the parameters, stay.

Nothing here communicates: every rank sees the same global shapes (an input is whole on every
rank, or its dim 0 is this rank's even slice over the batch axes, as `Mesh.local_batch` and a
DistributedSampler with `drop_last=True` give), so every rank reaches the same decision, and sizes
that do not divide are a `PlanMismatchError` on every rank before any collective.
"""
from __future__ import annotations

import torch

from ..compat import pytree
from ..errors import PlanMismatchError
from ..passes.capture import Captured, capture
from ..plan import Plan
from .layout_fit import layout_misfits, split_parts

__all__ = ["input_shapes", "input_shapes_of", "respecialize", "user_inputs"]


def user_inputs(cap: Captured) -> tuple[tuple[str, int], ...]:
    """(placeholder name, index among the caller's flattened inputs) of each input the caller passes:
    what `input_shapes` reads each call (a model's parameters are most of `cap.inputs`)."""
    return tuple((name, slot.target) for name, slot in cap.inputs.items() if slot.kind == "input")


def input_shapes(inputs: tuple[tuple[str, int], ...], leaves: list, n_batch: int) -> dict[str, tuple[int, ...]]:
    """Placeholder name -> global shape of each tensor the caller passes (`inputs`: `user_inputs`);
    `n_batch` ranks share the batch (dim 0 of what a rank gets is 1/n_batch of the global batch)."""
    out = {}
    for name, i in inputs:
        x = leaves[i]
        if isinstance(x, torch.Tensor):
            shape = tuple(x.shape)
            out[name] = (shape[0] * n_batch,) + shape[1:] if shape else shape
    return out


def respecialize(model: torch.nn.Module, planned: Captured, plan: Plan, args: tuple, kwargs: dict,
                 shapes: dict[str, tuple[int, ...]]) -> Captured:
    """`model` captured at the global input `shapes` of this call, checked to run `plan` exactly."""
    was = input_shapes_of(planned)
    changed = "; ".join(f"input {name!r}: planned {list(was[name])}, given {list(s)}"
                        for name, s in shapes.items() if tuple(was.get(name, ())) != s)
    planned_layouts = {n.name: n.output for n in plan.nodes if n.executor == "input"}
    for name, shape in shapes.items():   # the inputs themselves first: the clearest message
        for dim, n in split_parts(planned_layouts.get(name, ()), plan.mesh["shape"]).items():
            if dim < len(shape) and shape[dim] % n:
                raise PlanMismatchError(f"{changed}: this plan splits dim {dim} of input {name!r} {n} ways and "
                                        f"{shape[dim]} does not divide: use a size that is a multiple of {n}, "
                                        f"or re-plan at these sizes")
    flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    names = {slot.target: name for name, slot in planned.inputs.items() if slot.kind == "input"}
    # a batch-split input stands for the global batch: zeros of its shape (capture reads no values)
    flat = [x.new_zeros(shapes[names[i]]) if i in names and names[i] in shapes and tuple(x.shape) != shapes[names[i]]
            else x for i, x in enumerate(flat)]
    g_args, g_kwargs = pytree.tree_unflatten(flat, spec)
    cap = capture(model, g_args, g_kwargs)
    if _structure(cap) != _structure(planned):
        raise PlanMismatchError(f"{changed}: at these sizes the model's graph is not the planned one (its code "
                                f"branches on a size): re-plan at these sizes")
    misfits = layout_misfits(plan, cap)
    if misfits:
        raise PlanMismatchError(f"{changed}: the plan's {misfits[0]}: use sizes that divide as the plan "
                                f"splits them, or re-plan at these sizes")
    return cap


def input_shapes_of(cap: Captured) -> dict[str, tuple[int, ...]]:
    """Placeholder name -> captured global shape of each user input tensor."""
    out = {}
    for node in cap.gm.graph.nodes:
        if node.op == "placeholder" and cap.inputs[node.name].kind == "input":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                out[node.name] = tuple(int(s) for s in val.shape)
    return out


def _structure(cap: Captured) -> list[tuple[str, str, str]]:
    return [(n.op, n.name, str(n.target)) for n in cap.gm.graph.nodes]
