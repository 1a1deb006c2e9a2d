"""Mixture-of-experts layers, captured as one op (`autopar::moe_experts`, see passes/lowering.py).

Experts are a natural axis: a device holding experts [e0, e1) runs them on every token routed
to them; tokens routed elsewhere contribute zero, so the devices' outputs are partial sums of
the layer's output (expert parallelism; the runtime tells each device which experts it holds).
Tokens are independent too: split them, with every expert on every device.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ..passes import lowering  # noqa: F401  (defines the autopar:: ops)
from .registry import AxisOption, register

R, P = Replicate(), Partial()


@register(torch.ops.autopar.moe_experts, family="moe")
def moe_rule(node, ins, outs):
    """hidden[T, H], top_k_index[T, k], top_k_weights[T, k], gate_up[E, 2I, H], down[E, H, I]."""
    return [AxisOption((Shard(0), Shard(0), Shard(0), R, R), Shard(0), "tokens"),
            AxisOption((R, R, R, Shard(0), Shard(0)), P, "experts")]
