"""The one notion of a layer: where a node sits in the model's stack of repeated blocks.

A layer is an indexed child of a container module: `blocks.7.attn.qkv` is in layer `blocks.7`
(container `blocks`, index 7), `model.layers.12.mlp` in `model.layers.12`. The planner ties
repeated layers' decisions (`solver/layers.py`), plans recomputation and offload per layer
(`Plan.recompute`, `Plan.offload` are keyed by `layer_key`), and the runtime groups a layer's
ops into one region to execute those decisions; all of them ask this module.
"""
from __future__ import annotations

import re
import torch.fx as fx

from .captured import Captured

_LAYER = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def layer_of(path: str) -> tuple[str, int, str] | None:
    """'blocks.7.attn.qkv' -> ('blocks', 7, 'attn.qkv')."""
    m = _LAYER.match(path)
    if not m:
        return None
    return m.group(1), int(m.group(2)), path[m.end():]


def layer_key(path: str) -> str | None:
    """'blocks.7.attn.qkv' -> 'blocks.7'; None outside any layer."""
    where = layer_of(path)
    return None if where is None else f"{where[0]}.{where[1]}"


def module_path(node: fx.Node, cap: Captured | None = None) -> str:
    """The module a node comes from ("blocks.7.attn.qkv"); for a placeholder (when `cap` is given) a
    parameter's own name, and the module owning a lifted constant (`model.layers.3.self_attn` for
    `model.layers.3.self_attn.lifted_tensor_7`: torch numbers them across the model, so the
    module, not the name, is what repeats from layer to layer)."""
    slot = cap.inputs.get(node.name) if cap is not None else None
    if slot is not None:
        if slot.kind == "param":
            return str(slot.target)
        return str(slot.target).rpartition(".")[0] if slot.kind == "constant" else ""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return list(stack.values())[-1][0].replace("L['self'].", "").replace("L__self___", "")
