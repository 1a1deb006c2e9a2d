"""The problem's decisions: every parameter, input and op of the graph with its strategies, and per
strategy its seconds and bytes.

* A *decision* ("leader") is a node with a strategy to choose. Followers (views, splits,
  element-wise ops with one tensor input) are merged into the leader they follow: their
  strategy list is aligned with the leader's, entry i being theirs when the leader picks i.
* Node cost[i]: forward + backward compute seconds of the node's share of the work, priced by
  `cost_model.ops.op_cost` (with what the op does inside itself: its rule's `inner` facts).
* Memory: parameter state per choice, activation bytes per node per choice.
Pins (`pins.py`) narrow a node's strategies to the one a user fixed.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from ..cost_model.autograd import gradient_sums_time
from ..cost_model.inner import inner_saved_bytes, inner_work_bytes
from ..cost_model.memory import backward_temporary_bytes, is_mixed, state_bytes
from ..cost_model.ops import OpFacts, node_grad_work, op_cost, op_cost_args, op_facts
from ..mesh import Mesh
from ..passes.capture import Captured
from ..passes.shape_prop import NodeInfo, tensor_meta
from ..strategies import Strategy, rule_for
from ..strategies.registry import inner_facts
from ..strategies.strategy import axis_options, layout_space, node_strategies, shard_count
from .pins import Pins

R = Replicate()


@dataclass(slots=True)
class Decision:
    name: str
    kind: str                          # "param" | "input" | "op"
    leader: str
    strategies: list[Strategy]         # aligned with the leader's choice index
    compute_s: list[float]             # forward + backward seconds per choice
    act_bytes: list[float]             # bytes this node's output adds per device (0 for views)
    state_bytes: list[float]           # parameter + grad + optimizer state per device
    fallback: bool = False             # unknown op: replicated
    fqn: str | None = None
    facts: OpFacts | None = None       # an op's pricing facts; a parameter's gradient sums (facts.work)
    fwd_s: list[float] = field(default_factory=list)       # forward seconds per choice (part of compute_s)
    opt_bytes: list[float] = field(default_factory=list)   # optimizer part of state_bytes (offloadable)
    elements: list[float] = field(default_factory=list)    # a parameter's local elements per choice
    mixed: bool = False                                    # a parameter trained in mixed precision
    grad_bytes: list[float] = field(default_factory=list)  # its gradient's part of state_bytes (absent in the forward)
    bwd_temp: list[float] = field(default_factory=list)    # an op's backward temporaries per choice
                                                           # (cost_model.memory.backward_temporary_bytes)


@dataclass(slots=True)
class NodeDecisions:
    """What `node_decisions` finds: the decisions by node, does a node's output need a gradient, is an
    op a view, does it keep its inputs for the backward, and the ops without a rule (replicated)."""
    decisions: dict[str, Decision]
    needs_grad: dict[str, bool]
    is_view: dict[str, bool] = field(default_factory=dict)
    saves: dict[str, bool] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Pricing:
    """How the decisions are priced: the optimizer and precision of parameter state, the mesh axes
    inputs arrive batch-split on, the busiest device's load over the mean (`cost_model.inner.busiest_load`),
    and `only` (node -> the one strategy to price, `build_problem`)."""
    optimizer: str = "adamw"
    precision: str = "auto"
    batch_axes: Sequence[str] = ()
    load: float = 1.0
    only: Mapping[str, Strategy] | None = None


def node_decisions(cap: Captured, infos: Mapping[str, NodeInfo], mesh: Mesh, pins: Pins,
                   pricing: Pricing) -> NodeDecisions:
    """The decisions of every node of the captured graph that has a strategy to choose."""
    nodes = list(cap.gm.graph.nodes)
    out = NodeDecisions({}, needs_grad(nodes, {name: slot.kind for name, slot in cap.inputs.items()}))
    ops = _Ops(mesh, pricing.load, pricing.only)
    for node in nodes:
        info = infos[node.name]
        if node.op == "placeholder":
            if node.users and info.out:
                out.decisions[node.name] = _placeholder(node, cap.inputs[node.name], info.out[0], infos, out.needs_grad,
                                                        mesh, pins, pricing)
        elif node.op == "call_function" and info.out:
            ops.decide(node, info, infos, out, pins)
    pins.check_used()
    return out


def needs_grad(nodes: list[fx.Node], kinds: Mapping[str, str]) -> dict[str, bool]:
    """node -> does its output need a gradient (a parameter, or floating point from one that does)."""
    ng: dict[str, bool] = {}
    for node in nodes:
        k = kinds.get(node.name)
        if k in ("param", "input", "buffer", "constant"):
            ng[node.name] = k == "param"
            continue
        metas = tensor_meta(node.meta.get("val"))
        ng[node.name] = bool(metas) and metas[0].dtype.is_floating_point and any(
            ng.get(a.name, False) for a in node.all_input_nodes)
    return ng


def _placeholder(node: fx.Node, slot, meta, infos, ng, mesh: Mesh, pins: Pins, pricing: Pricing) -> Decision:
    if slot.kind == "param":
        return _parameter(node, slot, meta, infos, ng, mesh, pins, pricing)
    batch_idx = {mesh.axis_index(a) for a in (pricing.batch_axes or ())}
    L = tuple(Shard(0) if (slot.kind == "input" and a in batch_idx and meta.ndim) else R for a in range(mesh.ndim))
    pat, want = pins.pinned([str(slot.target), node.name]) if slot.kind == "input" else (None, None)
    only = pricing.only
    if only is not None and node.name in only:
        L = only[node.name].output
    elif want is not None:   # the input arrives whole (or batch-split) and is kept in this layout
        L = pins.placements_only(pat, want, f"input {slot.target} ({node.name})")
    if slot.kind == "input" and (batch_idx or want is not None) and only is None:
        pins.check(L, meta, f"input {slot.target} ({node.name})")
    return Decision(node.name, "input", node.name, [Strategy((), L)], [0.0], [0.0], [0.0], fqn=str(slot.target),
                    fwd_s=[0.0], opt_bytes=[0.0])


def _parameter(node: fx.Node, slot, meta, infos, ng, mesh: Mesh, pins: Pins, pricing: Pricing) -> Decision:
    shape = mesh.shape
    layouts = [pricing.only[node.name].output] if pricing.only is not None else layout_space(meta, shape)
    pat, want = pins.pinned([slot.target, node.name])
    if want is not None:
        want = pins.placements_only(pat, want, f"parameter {slot.target!r}")
        pins.check(want, meta, slot.target)
        layouts = [want]
    strategies = [Strategy((), L) for L in layouts]
    kept_b, opt_b = state_bytes(meta.dtype.itemsize, pricing.optimizer, pricing.precision)
    elems = [meta.nbytes / meta.dtype.itemsize / shard_count(L, shape) for L in layouts]
    # a parameter used by several ops (tied embeddings) sums their gradients (AccumulateGrad)
    work = node_grad_work(node, infos, ng)
    sums = [gradient_sums_time(work, meta.nbytes / shard_count(L, shape), mesh.profile) for L in layouts]
    return Decision(node.name, "param", node.name, strategies, sums, [0.0] * len(layouts),
                    [e * (kept_b + opt_b) for e in elems], fqn=slot.target, facts=OpFacts(op="param", work=work),
                    fwd_s=[0.0] * len(layouts), opt_bytes=[e * opt_b for e in elems],
                    elements=elems, mixed=is_mixed(meta.dtype.itemsize, pricing.precision),
                    grad_bytes=[e * meta.dtype.itemsize for e in elems])


class _Ops:
    """The op decisions, with what equal ops share worked out once: a repeated layer's ops have the
    same strategies (enumerated once per signature), the same lists of costs, the same prices."""

    def __init__(self, mesh: Mesh, load: float, only: Mapping[str, Strategy] | None):
        self.mesh, self.load, self.only = mesh, load, only
        self.priced: dict = {}         # OpCostArgs -> (forward, backward) seconds
        self.enumerated: dict = {}     # op signature -> its strategies
        self.node_costs: dict = {}     # op signature and strategies -> (strategies, compute, forward, act, work)
        self.followed: dict = {}       # (own strategies, producer's) -> a follower's strategies

    def decide(self, node: fx.Node, info: NodeInfo, infos, out: NodeDecisions, pins: Pins) -> None:
        rule = rule_for(node.target)
        ins_meta = [infos[a.name].out[0] for a in info.ins]
        decisions, ng = out.decisions, out.needs_grad
        if any(a.name not in decisions for a in info.ins):
            return     # fed by something we do not plan (should not happen for ATen graphs)
        if rule is None:
            out.fallbacks.append(node.name)
        out.is_view[node.name] = bool(rule and rule.is_view)
        out.saves[node.name] = rule.saves_inputs if rule else True
        sig = (node.target, tuple(ins_meta), tuple(info.out), _const_args(node.args), _const_args(node.kwargs))
        leader, strategies = self._strategies(node, info, rule, ins_meta, sig, decisions, pins)
        facts = op_facts(node, infos, ng)
        # a repeated layer's op prices the same under the same strategies: its lists are worked out once
        key = (sig, tuple(map(id, strategies)), facts, ng[node.name], info.flops, info.bytes_moved)
        if key not in self.node_costs:      # the strategies are kept with it: their ids stay their own
            self.node_costs[key] = (strategies, *self._costs(node, info, rule, strategies, ins_meta, facts,
                                                             ng[node.name], out.is_view[node.name]))
        _, compute, forward, act, work = self.node_costs[key]
        if (key, "bwd_temp") not in self.node_costs:
            temps = _backward_temps(facts, strategies, ins_meta, ng[node.name], self.mesh.shape)
            self.node_costs[(key, "bwd_temp")] = [t + w for t, w in zip(temps, work)] if work else temps
        n = len(strategies)
        decisions[node.name] = Decision(node.name, "op", leader, strategies, compute, act, [0.0] * n,
                                        fallback=rule is None, facts=facts, fwd_s=forward, opt_bytes=[0.0] * n,
                                        bwd_temp=self.node_costs[(key, "bwd_temp")])

    def _strategies(self, node, info, rule, ins_meta, sig, decisions, pins: Pins):
        """(leader, strategies aligned with the leader's choice): a follower takes its producer's order."""
        if self.only is not None:
            own = [self.only[node.name]]
        else:
            if sig not in self.enumerated:    # a repeated layer's ops have the same options: enumerate once
                self.enumerated[sig] = node_strategies(axis_options(rule, node, ins_meta, info.out), ins_meta,
                                                       info.out, self.mesh.shape, rule)
            own = self.enumerated[sig]
        _, want = pins.pinned([node.name])
        if want is not None:
            own = pins.narrowed(node.name, own, want)
        if rule is not None and rule.follower and len(info.ins) == 1 and want is None:
            src = decisions[info.ins[0].name]
            follow = self._following(own, src.strategies)
            if all(f is not None for f in follow) and src.kind == "op":
                return src.leader, follow
        return node.name, own

    def _following(self, own: list[Strategy], theirs: list[Strategy]) -> list[Strategy | None]:
        """For each of a producer's strategies `theirs`, the one of `own` that takes its output as input
        (None where none does): once per pair of lists (a repeated layer's ops hold the same Strategy
        objects, and a follower's list is its producer's next follower's `theirs`)."""
        key = (tuple(map(id, own)), tuple(map(id, theirs)))
        if key not in self.followed:      # the lists are kept with it: their ids stay their own
            by_input = {s.inputs[0]: s for s in own}
            self.followed[key] = (own, theirs, [by_input.get(s.output) for s in theirs])
        return self.followed[key][2]

    def _costs(self, node, info, rule, strategies: list[Strategy], ins_meta, facts: OpFacts, grad: bool,
               view: bool) -> tuple[list, list, list, list]:
        """(compute, forward, activation bytes, backward working bytes) of an op per strategy."""
        shape, links = self.mesh.shape, self.mesh.links
        inner = [inner_facts(rule, node, s, ins_meta, info.out, shape) for s in strategies]
        compute, forward = [], []
        for s, facts_s in ([] if facts.view and not facts.work else zip(strategies, inner)):   # a plain view costs nothing
            key = op_cost_args(info, s, shape, facts, facts_s, links, self.load)
            if key not in self.priced:    # equal ops in other places cost the same: price each once
                self.priced[key] = op_cost(key, self.mesh.profile)
            fwd, bwd = self.priced[key]
            compute.append(fwd + (bwd if grad else 0.0))
            forward.append(fwd)
        compute = compute or [0.0] * len(strategies)
        forward = forward or [0.0] * len(strategies)
        act = [0.0 if view else sum(m.nbytes / shard_count(s.output, shape) for m in info.out)
               + inner_saved_bytes(f, self.load) for s, f in zip(strategies, inner)]
        work = [inner_work_bytes(f) if grad else 0.0 for f in inner]
        return compute, forward, act, (work if any(work) else [])


def _backward_temps(facts: OpFacts, strategies: list[Strategy], ins_meta, grad: bool, shape) -> list[float]:
    """An op's backward temporaries per strategy, from its inputs' local sizes (none without a backward)."""
    if not grad or facts.view:
        return [0.0] * len(strategies)
    return [backward_temporary_bytes(facts.op, [(m.nbytes / shard_count(L, shape), m.dtype.itemsize)
                                                for m, L in zip(ins_meta, s.inputs)]) for s in strategies]


def _const_args(a):
    """An op's arguments with every node replaced by a marker: what its strategies and price can read
    of them besides its inputs' shapes (dims, flags, whether an optional tensor is given)."""
    if isinstance(a, fx.Node):
        return "<node>"
    if isinstance(a, (list, tuple)):
        return tuple(_const_args(x) for x in a)
    if isinstance(a, dict):
        return tuple((k, _const_args(v)) for k, v in a.items())
    # typed: 1, 1.0 and True are equal keys to a dict but not the same argument to an op
    return (type(a).__name__, a) if isinstance(a, (int, float, str, bool, type(None))) else repr(a)
