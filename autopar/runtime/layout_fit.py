"""Does a plan fit a captured graph? Every layout names shard dims its tensor has, and the mesh
axes that split a dim divide its size evenly (the runtime's local ops assume even shards).

Checked when a plan is applied (it may come from an edited file) and when a call brings inputs of
other sizes than planned (`runtime/respecialize.py`): the layouts stay, the sizes change.
"""
from __future__ import annotations

import operator
from collections.abc import Sequence

from ..passes.captured import Captured
from ..passes.shape_prop import tensor_inputs, tensor_meta
from ..placement import Shard, parse_layout
from ..plan import Plan

__all__ = ["layout_misfits", "split_parts"]


def layout_misfits(plan: Plan, cap: Captured) -> list[str]:
    """One line per layout of `plan` that does not fit `cap`'s tensors ("nodes[3].output (view): ...")."""
    graph = {n.name: n for n in cap.gm.graph.nodes}
    sizes = plan.mesh["shape"]
    params = {cap.param_names.get(slot.target, slot.target): _shape(graph[name])
              for name, slot in cap.inputs.items() if slot.kind == "param"}
    out = []
    for fqn, layout in plan.placements.items():
        if fqn not in params:
            out.append(f"placements.{fqn}: this model has no parameter {fqn!r}")
            continue
        out += _misfit(layout, params[fqn], sizes, f"placements.{fqn}")
    for i, np in enumerate(plan.nodes):
        if np.executor == "output":
            continue
        node = graph.get(np.name)
        if node is None:
            out.append(f"nodes[{i}]: this model's graph has no node {np.name!r}")
            continue
        out += _misfit(np.output, _shape(node), sizes, f"nodes[{i}].output ({np.name})")
        if np.executor in ("param", "input") or node.target is operator.getitem:
            continue
        ins = tensor_inputs(node)
        if len(np.inputs) != len(ins):
            out.append(f"nodes[{i}].inputs ({np.name}): {len(np.inputs)} layouts for {len(ins)} tensor inputs")
            continue
        for j, (layout, a) in enumerate(zip(np.inputs, ins)):
            out += _misfit(layout, _shape(a), sizes, f"nodes[{i}].inputs[{j}] ({np.name})")
    return out


def split_parts(layout: Sequence, sizes: Sequence[int]) -> dict[int, int]:
    """dim -> into how many parts the layout splits it over a mesh of these axis sizes."""
    parts: dict[int, int] = {}
    for p, n in zip(parse_layout(layout), sizes):
        if isinstance(p, Shard):
            parts[p.dim] = parts.get(p.dim, 1) * n
    return parts


def _shape(node) -> tuple[int, ...] | None:
    metas = tensor_meta(node.meta.get("val"))
    return metas[0].shape if metas else None


def _misfit(layout, shape: tuple[int, ...] | None, sizes, field: str) -> list[str]:
    if shape is None:
        return []
    for dim, n in split_parts(layout, sizes).items():
        if dim >= len(shape) or shape[dim] % n:
            what = f"has no dim {dim}" if dim >= len(shape) else f"dim {dim} of size {shape[dim]} does not split {n} ways"
            return [f"{field}: layout {tuple(layout)} does not fit its tensor of shape {list(shape)} ({what})"]
    return []
