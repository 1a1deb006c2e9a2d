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
    expert_tp        R,    R,    R,    S(1), S(2) -> P      tensor parallelism inside every expert
                                                            (Megatron-LM's expert TP): gate/up split by
                                                            columns, down by rows, outputs partial sums

(inputs: hidden[T, H], top_k_index[T, k], top_k_weights[T, k], gate_up[E, 2I, H], down[E, H, I]).
Under every option a device runs the token-slots its experts take as two grouped GEMMs
(`passes.lowering.moe_grouped`; priced by `cost_model.experts` besides the FLOPs). Only
expert_parallel moves data inside the op: its dispatch and combine are priced with the op
(`cost_model.comm.expert_exchange_times`), the other two move nothing the edges do not already
show. What the op does inside itself under a strategy are the facts of `moe_inner`
(`inner.py`), priced by `cost_model/inner.py`. Several axes may split experts; a device's experts are then block
`mixed radix of its coordinates on those axes, in mesh order` (as DTensor chunks a dim); beside an
experts axis, expert_parallel sends only the slots whose experts the device's block holds there.

expert_tp: Hugging Face stores gate and up fused, gate_up[E, 2I, H] with the I gate rows first, so a
Shard(1) of it gives device r rows [2rI/n, 2(r+1)I/n): gate rows or up rows, not the pairs Megatron
keeps together. Before its experts run, the device trades halves of its shard with its peers on
that axis (one all-to-all of the expert weights, priced with the op: `cost_model.comm.
expert_tp_exchange_times`) so that it holds gate and up rows [rI/n, (r+1)I/n), matching its rows of
down's Shard(2) (`runtime/experts.py`). One axis per op takes expert_tp (`admissible`); it composes
with expert_parallel, experts and tokens on the others.
"""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ..errors import PlanOptionError
from ..passes import lowering  # noqa: F401  (defines the autopar:: ops)
from ..passes.shape_prop import tensor_meta
from .inner import GroupedExperts, Imbalanced, RoutedExchange, WeightTrade
from .registry import AxisOption, register
from .strategy import shard_count

R, P, S0 = Replicate(), Partial(), Shard(0)
MOE_OP = "autopar.moe_experts"
EXPERT_PARALLEL = "expert_parallel"
_HIDDEN, _INDEX, _GATE_UP = 0, 1, 3    # input slots of the tokens, their routing and the expert weights


EXPERT_TP = "expert_tp"


def admissible(labels, inputs, output, ins, outs, mesh_shape, fits) -> bool:
    """At most one axis splits the experts' matrices (expert_tp)."""
    return sum(lab == EXPERT_TP for lab in labels) <= 1


def moe_inner(node, s, ins, outs, mesh_shape) -> tuple:
    """The `inner` hook: under strategy s, the load imbalance where experts are split, the token-slot
    exchange per expert-parallel axis, the expert_tp weight trade, and the grouped experts' passes.
    The routing's and the weights' sizes are the graph's (fixed whatever the batch and sequence)."""
    experts, tokens, exchange = expert_axes(s.inputs), token_axes(s.inputs), exchange_axes(s.inputs)
    top_k = tensor_meta(node.args[_INDEX].meta["val"])[0].shape[1]
    gate_up = tensor_meta(node.args[_GATE_UP].meta["val"])[0]
    out, tp = outs[0], tensor_axis(s.inputs)
    facts: list = [Imbalanced()] if experts else []
    # the slots whose experts it holds on the axes splitting experts alone (runtime/experts.py sends no other)
    elsewhere = math.prod(mesh_shape[a] for a in experts if a not in exchange)
    routed_b = out.nbytes / shard_count(s.output, mesh_shape) * top_k / elsewhere
    facts += [RoutedExchange(a, mesh_shape[a], routed_b) for a in exchange]
    if tp is not None:
        facts.append(WeightTrade(tp, mesh_shape[tp], gate_up.nbytes / shard_count(s.inputs[_GATE_UP], mesh_shape)))
    slots = out.shape[0] * top_k
    facts.append(GroupedExperts(
        slots / math.prod(mesh_shape[a] for a in set(experts) | set(tokens)), bool(experts),
        slots / math.prod(mesh_shape[a] for a in tokens) if exchange else None, gate_up.shape[2],
        gate_up.shape[1] / 2 / (mesh_shape[tp] if tp is not None else 1), out.dtype.itemsize, bool(exchange),
        gate_up.shape[0] / math.prod(mesh_shape[a] for a in experts)))
    return tuple(facts)


@register(torch.ops.autopar.moe_experts, family="moe", admits=admissible, inner=moe_inner)
def moe_rule(node, ins, outs):
    """hidden[T, H], top_k_index[T, k], top_k_weights[T, k], gate_up[E, 2I, H], down[E, H, I]."""
    return [AxisOption((S0, S0, S0, R, R), S0, "tokens"),
            AxisOption((R, R, R, S0, S0), P, "experts"),
            AxisOption((S0, S0, S0, S0, S0), S0, EXPERT_PARALLEL),
            AxisOption((R, R, R, Shard(1), Shard(2)), P, EXPERT_TP)]


def expert_axes(inputs) -> tuple[int, ...]:
    """Mesh axes (indices) that split the experts, in mesh order (from the op's input layouts)."""
    return tuple(a for a, p in enumerate(inputs[_GATE_UP]) if isinstance(p, Shard) and p.dim == 0)


def exchange_axes(inputs) -> tuple[int, ...]:
    """Mesh axes on which the op dispatches tokens by all-to-all: tokens and experts both split."""
    return tuple(a for a in expert_axes(inputs) if inputs[_HIDDEN][a] == S0)


def tensor_axis(inputs) -> int | None:
    """The mesh axis that splits the experts' matrices (expert_tp: gate_up by rows), if one does."""
    return next((a for a, p in enumerate(inputs[_GATE_UP]) if isinstance(p, Shard) and p.dim == 1), None)


def token_axes(inputs) -> tuple[int, ...]:
    """Mesh axes (indices) that split the op's tokens (its routing), in mesh order."""
    return tuple(a for a, p in enumerate(inputs[_INDEX]) if isinstance(p, Shard) and p.dim == 0)


def check_capacity_factor(factor) -> None:
    """The option `moe_capacity_factor`: None (dropless) or a finite number above 0 (runtime/experts.py)."""
    if factor is None:
        return
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise PlanOptionError(f"moe_capacity_factor={factor!r}: give a number above 0 (each expert takes at most "
                              f"ceil(factor x tokens x top_k / experts) token-slots, e.g. 1.25), or None for "
                              f"dropless routing")
