"""Parameter-side ops: the ops whose gradient flows into parameters alone.

An op is parameter-side when at least one of its tensor inputs is a parameter or another
parameter-side op, and each of the others is a constant of the program: a buffer, a lifted
constant, or a tensor made from nothing the caller passes (`torch.arange(T)` for position ids,
whose size may be the input's, but whose values are not). A position embedding looked up at
`arange(T)`, a weight's transpose or slice, and a tied weight's view are parameter-side; an
embedding looked up at the caller's token ids is not (its values depend on the batch).

Their gradients may stay partial sums where they are replicated (strategies/gradients.py): the
sum is taken in the parameters' gradient buckets.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch.fx as fx

from .captured import InputSlot
from .shape_prop import tensor_meta


def parameter_side(gm: fx.GraphModule, inputs: Mapping[str, InputSlot]) -> frozenset[str]:
    """The names of `gm`'s parameter-side call_function nodes (`inputs`: what feeds each placeholder)."""
    params, constant, side = set(), set(), set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            kind = inputs[node.name].kind if node.name in inputs else "input"
            (params if kind == "param" else constant if kind in ("buffer", "constant") else set()).add(node.name)
            continue
        if node.op != "call_function":
            continue
        tensors = [a.name for a in node.all_input_nodes if tensor_meta(a.meta.get("val"))]
        if all(t in constant for t in tensors):
            constant.add(node.name)
        elif all(t in constant or t in params or t in side for t in tensors):
            metas = tensor_meta(node.meta.get("val"))
            if len(metas) == 1 and metas[0].dtype.is_floating_point:
                side.add(node.name)
    return frozenset(side)
