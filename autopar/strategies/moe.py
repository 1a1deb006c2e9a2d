"""Mixture-of-experts layers, captured as one op (`autopar::moe_experts`, see passes/lowering.py).

Along one mesh axis the op has three ways to split its work:

    tokens           S(0), S(0), S(0), R,    R    -> S(0)   every expert on every device, tokens split
    experts          R,    R,    R,    S(0), S(0) -> P      every token everywhere, experts split; a device
                                                            runs its experts on the tokens routed to them
                                                            and the outputs are partial sums
    expert_parallel  S(0), S(0), S(0), S(0), S(0) -> S(0)   tokens AND experts split (GShard, Switch,
                                                            Megatron-LM, torchtitan): each token-slot
                                                            travels to the device holding its expert and
                                                            back by all-to-all (`runtime/experts.py`)

(inputs: hidden[T, H], top_k_index[T, k], top_k_weights[T, k], gate_up[E, 2I, H], down[E, H, I]).
Only expert_parallel moves data inside the op: its dispatch and combine are priced with the op
(`solver.problem.op_cost`, `cost_model.comm.expert_exchange_time`), the other two move nothing
the edges do not already show. Several axes may split experts; a device's experts are then block
`mixed radix of its coordinates on those axes, in mesh order` (as DTensor chunks a dim).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ..passes import lowering  # noqa: F401  (defines the autopar:: ops)
from .registry import AxisOption, register

R, P, S0 = Replicate(), Partial(), Shard(0)
MOE_OP = "autopar.moe_experts"
EXPERT_PARALLEL = "expert_parallel"
_HIDDEN, _GATE_UP = 0, 3    # input slots of the tokens and of the expert weights


@register(torch.ops.autopar.moe_experts, family="moe")
def moe_rule(node, ins, outs):
    """hidden[T, H], top_k_index[T, k], top_k_weights[T, k], gate_up[E, 2I, H], down[E, H, I]."""
    return [AxisOption((S0, S0, S0, R, R), S0, "tokens"),
            AxisOption((R, R, R, S0, S0), P, "experts"),
            AxisOption((S0, S0, S0, S0, S0), S0, EXPERT_PARALLEL)]


def expert_axes(inputs) -> tuple[int, ...]:
    """Mesh axes (indices) that split the experts, in mesh order (from the op's input layouts)."""
    return tuple(a for a, p in enumerate(inputs[_GATE_UP]) if isinstance(p, Shard) and p.dim == 0)


def exchange_axes(inputs) -> tuple[int, ...]:
    """Mesh axes on which the op dispatches tokens by all-to-all: tokens and experts both split."""
    return tuple(a for a in expert_axes(inputs) if inputs[_HIDDEN][a] == S0)
