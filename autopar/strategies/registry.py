"""The rule registry: for each op, its sharding options along ONE mesh axis.

A rule looks at a node's global input/output shapes and returns `AxisOption`s: the
placement of every tensor input and of the output when one mesh axis is used for that
op. For `aten.linear` (x[..., K] @ w[N, K]^T) they are

    batch   S(d), R,    R    -> S(d)     (data parallel, one per non-feature dim d of x)
    column  R,    S(0), S(0) -> S(-1)    (Megatron's first MLP linear)
    row     S(-1),S(1), P    -> P        (Megatron's second; the output is a partial sum)

and `strategy.py` combines per-axis options into N-D strategies. Registering rules per op
with a decorator follows DTensor's `_ops/` layout; the all-replicate option is implicit.

Every option is a promise that running the op on the local shards gives the output layout
stated (the runtime relies on it: `runtime/ops.py`); the numerics tests hold rules to it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement

from ..compat import OpOverload, OpOverloadPacket, op_packet_name

from ..passes.shape_prop import TensorMeta


@dataclass(frozen=True, slots=True)
class AxisOption:
    inputs: tuple[Placement, ...]
    output: Placement
    label: str = ""          # "batch", "column", "row", ... (shown in reports)


RuleFn = Callable[[fx.Node, Sequence[TensorMeta], Sequence[TensorMeta]], list[AxisOption]]


@dataclass(frozen=True, slots=True)
class OpRule:
    fn: RuleFn
    family: str              # "matmul", "pointwise", "view", "norm", "reduction", ...
    saves_inputs: bool = True    # are the inputs kept alive for the backward?
    is_view: bool = False        # output aliases the input (no new memory)
    follower: bool = False       # one tensor input, strategy implied by it: merged into its producer
    # which N-D combinations of its options run (labels, input layouts, output layout, input metas,
    # output metas, mesh shape, fits) -> bool; None: all that split evenly
    admits: Callable | None = None
    # what the op does inside itself beyond its kernel under a strategy, as facts for pricing:
    # (node, strategy, input metas, output metas, mesh shape) -> tuple of facts (`inner.py`); None: nothing
    inner: Callable | None = None


RULES: dict[object, OpRule] = {}


def register(*targets, family: str, saves_inputs: bool = True,
             is_view: bool = False, follower: bool = False, admits: Callable | None = None,
             inner: Callable | None = None):
    """Register `fn` as the rule of every op in `targets` (OpOverloadPackets or Python callables)."""
    def deco(fn: RuleFn) -> RuleFn:
        for t in targets:
            RULES[t] = OpRule(fn, family, saves_inputs, is_view, follower, admits, inner)
        return fn
    return deco


def rule_for(target) -> OpRule | None:
    if target in RULES:
        return RULES[target]
    packet = getattr(target, "overloadpacket", None)
    return RULES.get(packet) if packet is not None else None


def inner_facts(rule: OpRule | None, node: fx.Node, strategy, ins: Sequence[TensorMeta],
                outs: Sequence[TensorMeta], mesh_shape: Sequence[int]) -> tuple:
    """The facts of what a node's op does inside itself under `strategy` (its rule's `inner` hook; none
    without one)."""
    if rule is None or rule.inner is None:
        return ()
    return rule.inner(node, strategy, ins, outs, mesh_shape)


def op_name(target) -> str:
    """'aten.linear' for aten.linear.default and for the packet aten.linear; 'autopar.moe_experts' alike."""
    if isinstance(target, OpOverload):
        return f"{target.namespace}.{target.overloadpacket.__name__}"
    if isinstance(target, OpOverloadPacket):
        return op_packet_name(target).replace("::", ".")
    return getattr(target, "__name__", str(target))
