"""The one price of an op's share of work on one device, forward and backward, under a strategy.

Its kernel (`compute.op_times`), what it does inside itself (the facts of its rule's `inner` hook,
`strategies/inner.py`, priced by `inner.py`), the random numbers it draws (`compute.random_time`)
and the autograd work of its backward beyond its own kernel (`autograd.py`). The planner
(`solver/problem.py`), `autopar.estimate` and the benchmarks price every op with `op_cost`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch.fx as fx

from ..passes.shape_prop import NodeInfo
from ..strategies import Strategy, op_name, rule_for
from ..strategies.strategy import parallel_count, shard_count
from .autograd import NO_GRAD_WORK, GradWork, grad_work, grad_work_time
from .compute import RANDOM_OPS, op_times, random_time
from .inner import inner_times


@dataclass(frozen=True, slots=True)
class OpFacts:
    """What pricing needs to know of a node besides its sizes and strategy: found once per node
    (`op_facts`) and kept on its Decision, so the planner, estimate() and benchmarks price alike."""
    family: str | None = None        # its rule's family (None: no rule)
    op: str = ""                     # aten name
    view: bool = False               # no kernel of its own
    work: GradWork = NO_GRAD_WORK    # autograd work of its backward beyond its own kernel
    random: bool = False             # draws a random number per output element (`draws_random`)


def op_facts(node: fx.Node, infos: Mapping[str, NodeInfo], ng: Mapping[str, bool]) -> OpFacts:
    """The `OpFacts` of `node`; `ng`: node name -> does its output need a gradient."""
    rule = rule_for(node.target)
    return OpFacts(rule.family if rule else None, op_name(node.target), bool(rule and rule.is_view),
                   node_grad_work(node, infos, ng), draws_random(node))


def draws_random(node: fx.Node) -> bool:
    """Does the op draw random numbers when it runs (a dropout with p > 0 in training, rand*, bernoulli)?"""
    op = op_name(node.target)
    if op not in RANDOM_OPS:
        return False
    if op in ("aten.native_dropout", "aten.dropout"):
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return bool(train) and p != 0
    return True


def node_grad_work(node: fx.Node, infos: Mapping[str, NodeInfo], ng: Mapping[str, bool]) -> GradWork:
    """The autograd work of `node`'s backward beyond its own kernel (`autograd.py`)."""
    if not ng.get(node.name):
        return NO_GRAD_WORK
    info = infos[node.name]
    ins = [a for a in node.args if isinstance(a, fx.Node)]
    in_shapes = [infos[a.name].out[0].shape if a.name in infos and infos[a.name].out else None for a in ins]
    op = op_name(node.target)
    bias = None
    if op == "aten.linear" and len(node.args) > 2:
        bias = node.args[2]
    elif op == "aten.addmm":
        bias = node.args[0]
    return grad_work(op, len(info.out), info.out[0].shape, in_shapes, [ng.get(a.name, False) for a in ins],
                     grad_consumers=sum(1 for u in node.users if ng.get(u.name, False)),
                     bias_needs_grad=isinstance(bias, fx.Node) and ng.get(bias.name, False))


class OpCostArgs(NamedTuple):
    """What `op_cost` needs to price a node's share of work on one device under a strategy.
    Hashable: equal ops (a repeated layer's) price once."""
    flops: float             # over the devices sharing the work
    bytes_moved: float
    dtype: object
    in_b: float              # bytes it reads on one device
    out_b: float             # bytes of its (first) output on one device (a partial output is whole)
    all_out_b: float         # all its outputs on one device (when its autograd work needs it)
    facts: OpFacts
    inner: tuple = ()        # what it does inside itself (its rule's `inner` facts, strategies/inner.py)
    links: tuple = ()        # one per mesh axis: the links its inner collectives run on
    load: float = 1.0        # the busiest device's routed work over the mean (`inner.busiest_load`)


def op_cost_args(info: NodeInfo, s: Strategy, shape, facts: OpFacts, inner: tuple = (), links: tuple = (),
                 load: float = 1.0) -> OpCostArgs:
    """The `OpCostArgs` of a node under strategy s on a mesh of `shape` (`inner`, `links`, `load`: as
    `OpCostArgs` holds them; without them, its kernel alone)."""
    pf = parallel_count(s, shape)
    out_b = info.out[0].nbytes / shard_count(s.output, shape)
    all_out_b = sum(m.nbytes for m in info.out) / shard_count(s.output, shape) if facts.work.all_passes else 0.0
    in_b = (info.bytes_moved - sum(m.nbytes for m in info.out)) / pf
    return OpCostArgs(info.flops / pf, info.bytes_moved / pf, info.out[0].dtype, in_b, out_b, all_out_b, facts,
                      inner, tuple(links), load)


def op_cost(a: OpCostArgs, profile) -> tuple:
    """(forward, backward) seconds: the one compute price of the planner and estimate(). An op that
    moves data inside itself (an expert-parallel MoE layer's all-to-alls) has that in its price."""
    f = a.facts
    fwd, bwd = (0.0, 0.0) if f.view else op_times(a.flops, a.bytes_moved, a.dtype, profile, family=f.family,
                                                   op=f.op, in_bytes=a.in_b, out_bytes=a.out_b)
    fwd, bwd = inner_times(a.inner, fwd, bwd, a.links, a.load, profile)
    if f.random:
        fwd = fwd + random_time(a.out_b / a.dtype.itemsize, profile)
    return fwd, bwd + grad_work_time(f.work, a.out_b, a.all_out_b, a.in_b, profile)
