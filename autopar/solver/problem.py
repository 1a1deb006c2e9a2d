"""The planning problem as data: decisions, their costs, and the edges between them.

Built once from the annotated graph; the ILP (`ilp.py`), exhaustive search (tests) and plan
evaluation all read these same tables, so they price a plan identically.

* A *decision* ("leader") is a node with a strategy to choose. Followers (views, splits,
  element-wise ops with one tensor input) are merged into the leader they follow: their
  strategy list is aligned with the leader's, entry i being theirs when the leader picks i.
* Node cost[i]: forward + backward compute seconds of the node's share of the work.
* Edge cost[a][b]: seconds to reshard the producer's output layout class a into the layout
  class b the consumer wants (forward), plus moving the gradient back (backward).
* Memory: parameter state per leader choice, activation bytes per node per choice, and the
  liveness points at which their sum must fit the budget.
"""
from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from ..cost_model import op_times
from ..cost_model.comm import (VOCAB_REDUCES, collective_bytes_on_wire, expert_exchange_times,
                               expert_tp_exchange_times, flat_gather_axis, layout_code, moe_routed_load,
                               vocab_reduce_bytes_on_wire, vocab_reduce_times)
from ..cost_model.compute import RANDOM_OPS, random_time
from ..cost_model.context import FP32_BYTES, ContextComm, context_saved_bytes, context_times, context_work_bytes
from ..cost_model.experts import expert_pass_times, expert_saved_bytes
from ..cost_model.autograd import NO_GRAD_WORK, GradWork, grad_work, grad_work_time, gradient_sums_time
from ..cost_model.memory import (Liveness, backward_temporary_bytes, is_mixed, liveness, state_bytes,
                                 weight_gradient_temporary_bytes)
from ..errors import ShardingError
from ..mesh import Mesh
from ..passes.capture import Captured
from ..passes.shape_prop import NodeInfo, TensorMeta, tensor_inputs, tensor_meta
from ..placement import gathers, parse_pin, to_str
from ..strategies import Strategy, op_name, rule_for
from ..strategies.attention import context_axis, sdpa_args
from ..strategies.gradients import input_grad_layouts, output_grad_layout
from ..strategies.moe import MOE_OP, exchange_axes, expert_axes, tensor_axis, token_axes
from ..strategies.vocab import op_class_dim, vocab_axes
from ..passes.layers import layer_key, module_path
from ..passes.parameter_side import parameter_side
from .families import Families
from .layers import repeated_layers
from ..strategies.strategy import axis_options, layout_space, node_strategies, parallel_count, shard_count

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
class EdgeTable:
    src: str
    dst: str                           # consumer node, or "output"
    slot: int
    a_of: list[int]                    # leader(src) choice -> source layout class
    b_of: list[int]                    # leader(dst) choice -> destination class (one entry for "output")
    cost: list[list[float]]            # [a][b] seconds, forward reshard + the gradient's way back
    saved: list[list[float]]           # [a][b] bytes of a resharded copy the consumer keeps for backward
    dst_pos: int = -1                  # consumer's position in the forward (for liveness)
    temp: list[list[float]] | None = None   # [a][b] bytes of a resharded copy alive only while the consumer runs
    fwd: list[list[float]] | None = None    # [a][b] seconds of the forward reshard alone
    sync: list[list[tuple | None]] | None = None   # [a][b] (GradBucket, bytes, seconds more alone) of a parameter
                                                   # gradient the runtime reduces in a bucket (Mesh.grad_sync_leg)
    flat: list[list[float]] | None = None   # [a][b] a parameter's forward gather the runtime can make one flat
                                            # all-gather with its layer's (comm.flat_gather_axis): its latency
                                            # and launch (the seconds one such gather of 0 bytes takes); else 0
    gathers: tuple[tuple[bool, ...], ...] = ()     # [a][b] does the reshard gather some mesh axis (Shard -> Replicate)
    grad_temp: list[list[float]] | None = None     # [a][b] bytes of a parameter's gradient as the consumer makes it,
                                                   # alive in its backward until bucketed (weight_gradient_temporary_bytes)

    @property
    def keeps_copy(self) -> bool:
        return any(any(row) for row in self.saved)


@dataclass(slots=True)
class Problem:
    mesh: Mesh
    order: list[str]                           # node names in topological order
    decisions: dict[str, Decision]
    leaders: list[str]
    edges: list[EdgeTable]
    live: Liveness
    fallbacks: list[str] = field(default_factory=list)
    rep: dict[str, str] = field(default_factory=dict)   # leader -> leader whose variables it shares
    needs_grad: dict[str, bool] = field(default_factory=dict)   # node -> does its output need a gradient
    families: Families = field(default_factory=lambda: Families())   # decisions beyond layouts (families.py)
    layer: dict[str, str] = field(default_factory=dict)  # node -> its layer (`passes.layers.layer_key`)
    optimizer: str = "adamw"
    # parameter -> forward position of its last consumer: its gradient exists from that op's backward
    # on (a parameter no edge reaches, from the start of the backward)
    grad_from: dict[str, int] = field(default_factory=dict)
    moe_load: float = 1.0     # MoE layers' busiest device's routed slots over the mean (comm.moe_routed_load)
    # the most gradient bytes the runtime's buckets can take, whatever the layouts (`bucketable_bytes`):
    # how the ILP bounds the buckets' buffers (`memory_rows.MemoryRows`)
    bucketable: float = 0.0
    # ops whose gradient flows into parameters alone, run by a rule (passes/parameter_side.py): their
    # gradients stay partial sums where they are replicated (strategies/gradients.py)
    parameter_side: frozenset[str] = frozenset()

    def grad_since(self, name: str) -> int:
        """The timeline position from which parameter `name`'s gradient exists."""
        return self.live.backward_of(self.grad_from.get(name, self.live.last))

    def n_choices(self, leader: str) -> int:
        return len(self.decisions[leader].strategies)


def grad_layout_in(s: Strategy, slot: int, parameter_side: bool = False) -> tuple:
    """Layout of the gradient an op sends back to input `slot` under strategy s
    (strategies/gradients.py; a parameter-side op keeps partial sums on every axis it is replicated)."""
    return input_grad_layouts(s.inputs, s.output, _side_axes(parameter_side, len(s.output)))[slot]


def _side_axes(parameter_side: bool, ndim: int) -> tuple[bool, ...]:
    return (True,) * ndim if parameter_side else ()


@dataclass(frozen=True, slots=True)
class ChosenEdge:
    """One edge under a chosen plan: the tensor, its layout out of the producer, the layout the
    consumer wants, and the layouts its gradient leaves the consumer in and must arrive in."""
    edge: EdgeTable
    meta: TensorMeta
    src: tuple                 # producer's output layout
    dst: tuple                 # consumer's input layout
    grad_src: tuple            # gradient as the consumer sends it back
    grad_dst: tuple            # gradient as the producer needs it


def chosen_edges(problem: Problem, choice: Mapping[str, int], cap: Captured,
                 metas: Mapping[str, TensorMeta] | None = None):
    """Every edge of the problem with its layouts under `choice` (for reports and estimates);
    `metas` (node -> output meta) overrides the captured shapes (symbolic sizes)."""
    whole = tuple(R for _ in problem.mesh.shape)
    vals = {n.name: n.meta.get("val") for n in cap.gm.graph.nodes}
    for e in problem.edges:
        a = problem.decisions[e.src].strategies[choice[problem.decisions[e.src].leader]].output
        if e.dst == "output":
            b = gb = whole
        else:
            t = problem.decisions[e.dst].strategies[choice[problem.decisions[e.dst].leader]]
            b, gb = t.inputs[e.slot], grad_layout_in(t, e.slot, e.dst in problem.parameter_side)
        meta = metas[e.src] if metas is not None else tensor_meta(vals[e.src])[0]
        yield ChosenEdge(e, meta, a, b, gb, output_grad_layout(a, _side_axes(e.src in problem.parameter_side, len(a))))


def picked_edges(p: Problem, choice: Mapping[str, int]):
    """(edge, source class, destination class) of every edge under `choice`."""
    for e in p.edges:
        a = e.a_of[choice[p.decisions[e.src].leader]]
        b = 0 if e.dst == "output" else e.b_of[choice[p.decisions[e.dst].leader]]
        yield e, a, b


def edge_legs(problem: Problem, c: ChosenEdge):
    """(phase, ReshardCost) of an edge under a plan: the forward reshard, and the gradient's way
    back for a floating-point tensor that is not an input."""
    mesh, meta = problem.mesh, c.meta
    cost = mesh.output_reshard_cost if c.edge.dst == "output" else mesh.reshard_cost
    legs = [("forward", cost(meta.shape, meta.dtype.itemsize, c.src, c.dst))]
    if meta.dtype.is_floating_point and problem.decisions[c.edge.src].kind != "input":
        legs.append(("backward", mesh.reshard_cost(meta.shape, meta.dtype.itemsize, c.grad_src, c.grad_dst)))
    return legs


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


class OpCostArgs(NamedTuple):
    """What `op_times` needs to price a node's share of work on one device under a strategy.
    Hashable: equal ops (a repeated layer's) price once."""
    flops: float             # over the devices sharing the work
    bytes_moved: float
    dtype: object
    in_b: float              # bytes it reads on one device
    out_b: float             # bytes of its (first) output on one device (a partial output is whole)
    all_out_b: float         # all its outputs on one device (when its autograd work needs it)
    facts: OpFacts
    context: ContextComm | None = None    # context-parallel attention's transfers (cost_model/context.py)
    routed: float = 0.0      # a MoE op whose experts are split: its busiest device's load over the mean
    exchange: tuple = ()     # (axis, its size, link, routed bytes on one device) per all-to-all axis of a MoE op
    vocab: tuple = ()        # (op, axis size, link, rows on one device, axis) per vocab axis of a vocab-split op
    paired: tuple = ()       # (axis, its size, link, gate/up shard bytes): a MoE op's expert_tp weight trade
    slots: tuple = ()        # a MoE op's token-slots run on one device, hidden and intermediate widths, itemsize,
                             # whether it exchanges them (cost_model/experts.py)


def op_cost_args(info: NodeInfo, s: Strategy, shape, facts: OpFacts, context: ContextComm | None = None,
                 links=None, vocab: tuple = (), moe_load: float = 1.0) -> OpCostArgs:
    """The `OpCostArgs` of a node under strategy s (`links`, one per mesh axis: to price the
    collectives an op runs inside itself; without them, its compute alone; `moe_load`: `Problem.moe_load`)."""
    pf = parallel_count(s, shape)
    out_b = info.out[0].nbytes / shard_count(s.output, shape)
    all_out_b = sum(m.nbytes for m in info.out) / shard_count(s.output, shape) if facts.work.all_passes else 0.0
    in_b = (info.bytes_moved - sum(m.nbytes for m in info.out)) / pf
    routed, exchange, paired, slots = 0.0, (), (), ()
    if facts.op == MOE_OP:
        routed = moe_load if expert_axes(s.inputs) else 0.0
        exchange = moe_exchange(info.out[0], info.ins[1], s, shape, links) if links else ()
        paired = expert_tp_trade(info.ins[3], s, shape, links) if links else ()
        run, _, hidden, inter = moe_slots(info, s, shape, moe_load)
        slots = (run, hidden, inter, info.out[0].dtype.itemsize, bool(exchange_axes(s.inputs)))
    return OpCostArgs(info.flops / pf, info.bytes_moved / pf, info.out[0].dtype, in_b, out_b, all_out_b, facts,
                      context, routed, exchange, vocab, paired, slots)


def vocab_reductions(node: fx.Node, s: Strategy, ins: Sequence[TensorMeta], mesh: Mesh) -> tuple:
    """(op, axis size, link, rows on one device, axis) per axis over which an op that all-reduces inside
    itself when vocab-split (`cost_model.comm.VOCAB_REDUCES`) splits its vocabulary under s (none for
    any other op or strategy). Rows: the elements of its input on one device per vocabulary entry."""
    op = op_name(node.target)
    if op not in VOCAB_REDUCES:
        return ()
    x, dim = ins[0], op_class_dim(node.target, node.args, ins[0].ndim)
    axes = vocab_axes(s.inputs[0], dim)
    split = 1
    for a in axes:
        split *= mesh.shape[a]
    rows = x.nbytes / x.dtype.itemsize / shard_count(s.inputs[0], mesh.shape) / (x.shape[dim] / split)
    return tuple((op, mesh.shape[a], mesh.links[a], rows, a) for a in axes)


def context_comm(node: fx.Node, s: Strategy, ins: Sequence[TensorMeta], mesh: Mesh) -> ContextComm | None:
    """The transfers of an attention strategy with a context-parallel axis (None for any other)."""
    axis = context_axis(s.labels) if op_name(node.target) == "aten.scaled_dot_product_attention" else None
    if axis is None:
        return None
    args = sdpa_args(*node.args, **node.kwargs)
    q_b = ins[0].nbytes / shard_count(s.inputs[0], mesh.shape)
    kv_b = (ins[1].nbytes + ins[2].nbytes) / shard_count(s.inputs[1], mesh.shape)
    return ContextComm(s.labels[axis], mesh.shape[axis], mesh.links[axis], q_b, kv_b,
                       balanced=bool(args["is_causal"]) or args["attn_mask"] is not None,
                       fp32=FP32_BYTES / ins[1].dtype.itemsize, head_dim=int(ins[0].shape[-1]))


def moe_routed_bytes(out: TensorMeta, top_k_index: fx.Node, s: Strategy, shape) -> float:
    """Bytes of the token-slots (its tokens x top-k, hidden wide) a MoE op under s routes on one device."""
    return out.nbytes / shard_count(s.output, shape) * tensor_meta(top_k_index.meta["val"])[0].shape[1]


def moe_exchange(out: TensorMeta, top_k_index: fx.Node, s: Strategy, shape, links) -> tuple:
    """(axis, its size, link, routed bytes on one device) per axis on which a MoE op under s dispatches
    its token-slots by all-to-all (`strategies.moe.exchange_axes`): the slots whose experts it holds on
    the axes splitting experts alone (runtime/experts.py sends no other)."""
    exchange = exchange_axes(s.inputs)
    elsewhere = math.prod(shape[a] for a in expert_axes(s.inputs) if a not in exchange)
    routed_b = moe_routed_bytes(out, top_k_index, s, shape) / elsewhere
    return tuple((a, shape[a], links[a], routed_b) for a in exchange)


def gate_up_shard_bytes(gate_up: fx.Node, s: Strategy, shape) -> float:
    """Bytes of one device's shard of a MoE op's fused gate/up weight under s."""
    return tensor_meta(gate_up.meta["val"])[0].nbytes / shard_count(s.inputs[3], shape)


def expert_tp_trade(gate_up: fx.Node, s: Strategy, shape, links) -> tuple:
    """(axis, its size, link, bytes of one device's gate/up shard) where a MoE op under s trades its
    fused gate/up shard into Megatron's pairing (`strategies.moe`, expert_tp); () if no axis does."""
    a = tensor_axis(s.inputs)
    return () if a is None else ((a, shape[a], links[a], gate_up_shard_bytes(gate_up, s, shape)),)


def moe_slots(info: NodeInfo, s: Strategy, shape, moe_load: float) -> tuple:
    """(token-slots the busiest device's experts run, token-slots added into one device's tokens, hidden
    width, intermediate width on one device) of a MoE op under s: the slots split over every axis that
    splits tokens or experts, the load imbalance where experts are split, the intermediate width over
    the expert_tp axis."""
    experts, tokens, tp = expert_axes(s.inputs), token_axes(s.inputs), tensor_axis(s.inputs)
    slots = info.out[0].shape[0] * tensor_meta(info.ins[1].meta["val"])[0].shape[1]
    run = slots / math.prod(shape[a] for a in set(experts) | set(tokens)) * (moe_load if experts else 1.0)
    combined = slots / math.prod(shape[a] for a in tokens) if exchange_axes(s.inputs) else run
    gate_up = tensor_meta(info.ins[3].meta["val"])[0].shape
    return run, combined, gate_up[2], gate_up[1] / 2 / (shape[tp] if tp is not None else 1)


def exchange_saved_bytes(info: NodeInfo, s: Strategy, shape, facts: OpFacts, moe_load: float) -> float:
    """Bytes an op keeps for its backward besides its inputs and output, where it runs more than one
    kernel: a MoE layer keeps its grouped GEMMs' inputs and activations (`cost_model.experts`); under
    expert_tp also its traded gate/up shard (runtime/experts.py)."""
    if facts.op != MOE_OP:
        return 0.0
    paired = 0.0 if tensor_axis(s.inputs) is None else gate_up_shard_bytes(info.ins[3], s, shape)
    run, combined, hidden, inter = moe_slots(info, s, shape, moe_load)
    experts = tensor_meta(info.ins[3].meta["val"])[0].shape[0] / math.prod(shape[a] for a in expert_axes(s.inputs))
    return expert_saved_bytes(run, combined, hidden, inter, info.out[0].dtype.itemsize, experts) + paired


def op_exchanges(problem: Problem, node: fx.Node, s: Strategy, metas: Mapping | None = None):
    """(phase, "<collective>@<axis>", seconds, bytes one device sends, axis) of the collectives an op
    runs inside itself under s, as `op_cost` prices them (the plan lists them on the op): an
    expert-parallel MoE layer's all-to-alls, a vocab-split op's all-reduces. metas: node name ->
    TensorMeta to price with instead of the graph's (the symbolic sizes of `planner/scaling.py`)."""
    mesh, out = problem.mesh, []

    def meta(n: fx.Node):
        return metas[n.name] if metas is not None else tensor_meta(n.meta.get("val"))[0]
    if op_name(node.target) in VOCAB_REDUCES:
        ins = [meta(a) for a in tensor_inputs(node)]
        for op, n, link, rows, a in vocab_reductions(node, s, ins, mesh):
            launch = mesh.profile.kernel_overhead + mesh.profile.collective_overhead
            times = vocab_reduce_times(op, rows, n, link, launch)
            ax = mesh.axis_names[a]
            out += [(phase, f"all_reduce@{ax}", t, sent, ax) for phase, t, sent in
                    zip(("forward", "backward"), times, vocab_reduce_bytes_on_wire(op, rows, n)) if sent]
        return out
    if op_name(node.target) != MOE_OP:
        return []
    for a, n, link, routed_b in moe_exchange(meta(node), node.args[1], s, mesh.shape, mesh.links):
        ax = mesh.axis_names[a]
        xf, xb = expert_exchange_times(routed_b, n, link, problem.moe_load,
                                       mesh.profile.kernel_overhead + mesh.profile.collective_overhead)
        sent = 2 * collective_bytes_on_wire("all_to_all", n * routed_b, n)
        out += [("forward", f"all_to_all@{ax}", xf, sent, ax), ("backward", f"all_to_all@{ax}", xb, sent, ax)]
    for a, n, link, shard_b in expert_tp_trade(node.args[3], s, mesh.shape, mesh.links):
        ax = mesh.axis_names[a]
        xf, xb = expert_tp_exchange_times(shard_b, n, link, mesh.profile.kernel_overhead
                                          + mesh.profile.collective_overhead)
        sent = collective_bytes_on_wire("all_to_all", n * shard_b, n)
        out += [("forward", f"all_to_all@{ax}", xf, sent, ax), ("backward", f"all_to_all@{ax}", xb, sent, ax)]
    return out


def op_cost(a: OpCostArgs, profile) -> tuple:
    """(forward, backward) seconds: the one compute price of the planner and estimate(). An op that
    moves data inside itself (an expert-parallel MoE layer's all-to-alls) has that in its price."""
    f = a.facts
    fwd, bwd = (0.0, 0.0) if f.view else op_times(a.flops, a.bytes_moved, a.dtype, profile, family=f.family,
                                                   op=f.op, in_bytes=a.in_b, out_bytes=a.out_b)
    if a.context is not None:
        fwd, bwd = context_times(fwd, bwd, a.context)
    if a.routed:       # experts split over devices: the busiest device sets the pace (profiles.py)
        fwd, bwd = fwd * a.routed, bwd * a.routed
    for _, n, link, routed_b in a.exchange:
        xf, xb = expert_exchange_times(routed_b, n, link, a.routed,
                                       profile.kernel_overhead + profile.collective_overhead)
        fwd, bwd = fwd + xf, bwd + xb
    for op, n, link, rows, _ in a.vocab:
        vf, vb = vocab_reduce_times(op, rows, n, link, profile.kernel_overhead + profile.collective_overhead)
        fwd, bwd = fwd + vf, bwd + vb
    for _, n, link, shard_b in a.paired:
        xf, xb = expert_tp_exchange_times(shard_b, n, link, profile.kernel_overhead + profile.collective_overhead)
        fwd, bwd = fwd + xf, bwd + xb
    if a.slots:        # the grouped experts' sort, gathers, activation and weighting (cost_model/experts.py)
        pf, pb = expert_pass_times(*a.slots, profile)
        fwd, bwd = fwd + pf, bwd + pb
    if f.random:
        fwd = fwd + random_time(a.out_b / a.dtype.itemsize, profile)
    return fwd, bwd + grad_work_time(f.work, a.out_b, a.all_out_b, a.in_b, profile)


def node_grad_work(node: fx.Node, infos: Mapping[str, NodeInfo], ng: Mapping[str, bool]) -> GradWork:
    """The autograd work of `node`'s backward beyond its own kernel (`cost_model.autograd`)."""
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


def _needs_grad(node: fx.Node, kinds: Mapping[str, str], ng: Mapping[str, bool]) -> bool:
    k = kinds.get(node.name)
    if k == "param":
        return True
    if k in ("input", "buffer", "constant"):
        return False
    metas = tensor_meta(node.meta.get("val"))
    return bool(metas) and metas[0].dtype.is_floating_point and any(ng.get(a.name, False)
                                                                  for a in node.all_input_nodes)


def build_problem(cap: Captured, infos: Mapping[str, NodeInfo], mesh: Mesh, *,
                  pins: Mapping[str, Sequence[str]] | None = None, optimizer: str = "adamw",
                  batch_axes: Sequence[str] | None = None, sharded_outputs: bool = False,
                  link_layers: bool = True, only: Mapping[str, Strategy] | None = None,
                  precision: str = "auto", saved_frees: bool = False,
                  moe_capacity_factor: float | None = None) -> Problem:
    """The planning problem of a captured graph (the layout family; `solver.decisions` adds the others).

    `precision` prices optimizer state (`cost_model.memory.state_bytes`); `saved_frees` adds the
    liveness points where freeing families (recomputation, offload) lower memory.
    `moe_capacity_factor` caps MoE layers' load (`cost_model.comm.moe_routed_load`).

    `only` (node name -> strategy) prices that one strategy per node instead of enumerating them:
    how a chosen plan is re-priced at symbolic sizes (`autopar.planner.scaling`), where `infos` hold
    sympy shapes and FLOPs. Pins, merging and layer tying are then moot and skipped."""
    shape = mesh.shape
    if only is not None:
        pins, link_layers = None, False
    nodes = list(cap.gm.graph.nodes)
    kinds = {name: slot.kind for name, slot in cap.inputs.items()}
    pins = dict(pins or {})
    used_pins: set[str] = set()
    decisions: dict[str, Decision] = {}
    ng: dict[str, bool] = {}
    is_view, saves = {}, {}
    fallbacks: list[str] = []
    batch_idx = {mesh.axis_index(a) for a in (batch_axes or ())}
    priced: dict = {}         # OpCostArgs -> (forward, backward) seconds
    enumerated: dict = {}     # op signature -> its strategies
    node_costs: dict = {}     # op signature and strategies -> (strategies, compute, forward, act)
    moe_load = moe_routed_load(mesh.profile.moe_load_imbalance, moe_capacity_factor)

    def pinned(keys: Sequence[str]):
        for pat, layout in pins.items():
            if any(fnmatch.fnmatchcase(k, pat) for k in keys if k):
                used_pins.add(pat)
                want = parse_pin(layout)
                if len(want) != mesh.ndim:
                    raise ShardingError(f"pin {pat!r}: {tuple(layout)} has {len(want)} entries but the mesh has "
                                        f"{mesh.ndim} axes {mesh.axis_names}: give one per axis")
                return pat, want
        return None, None

    def placements_only(pat, want, what):
        if any(isinstance(p, str) for p in want):
            raise ShardingError(f"pin {pat!r} gives strategy labels {want} for {what}, which has a layout, not a "
                                f"strategy: pin it with placements ('R', 'S(d)'), or pin the op that uses it")
        return want

    for node in nodes:    # first, so a node knows which of its users send it a gradient
        ng[node.name] = _needs_grad(node, kinds, ng)
    for node in nodes:
        info = infos[node.name]
        if node.op == "placeholder":
            slot = cap.inputs[node.name]
            if not node.users or not info.out:
                continue
            meta = info.out[0]
            if slot.kind == "param":
                layouts = [only[node.name].output] if only is not None else layout_space(meta, shape)
                pat, want = pinned([slot.target, node.name])
                if want is not None:
                    want = placements_only(pat, want, f"parameter {slot.target!r}")
                    _check_pin(want, meta, mesh, slot.target)
                    layouts = [want]
                strategies = [Strategy((), L) for L in layouts]
                kept_b, opt_b = state_bytes(meta.dtype.itemsize, optimizer, precision)
                elems = [meta.nbytes / meta.dtype.itemsize / shard_count(L, shape) for L in layouts]
                # a parameter used by several ops (tied embeddings) sums their gradients (AccumulateGrad)
                work = node_grad_work(node, infos, ng)
                sums = [gradient_sums_time(work, meta.nbytes / shard_count(L, shape), mesh.profile) for L in layouts]
                decisions[node.name] = Decision(node.name, "param", node.name, strategies, sums,
                                                [0.0] * len(layouts), [e * (kept_b + opt_b) for e in elems],
                                                fqn=slot.target, facts=OpFacts(op="param", work=work),
                                                fwd_s=[0.0] * len(layouts), opt_bytes=[e * opt_b for e in elems],
                                                elements=elems, mixed=is_mixed(meta.dtype.itemsize, precision),
                                                grad_bytes=[e * meta.dtype.itemsize for e in elems])
            else:
                L = tuple(Shard(0) if (slot.kind == "input" and a in batch_idx and meta.ndim) else R
                          for a in range(mesh.ndim))
                pat, want = pinned([str(slot.target), node.name]) if slot.kind == "input" else (None, None)
                if only is not None and node.name in only:
                    L = only[node.name].output
                elif want is not None:   # the input arrives whole (or batch-split) and is kept in this layout
                    L = placements_only(pat, want, f"input {slot.target} ({node.name})")
                if slot.kind == "input" and (batch_idx or want is not None) and only is None:
                    _check_pin(L, meta, mesh, f"input {slot.target} ({node.name})")
                decisions[node.name] = Decision(node.name, "input", node.name, [Strategy((), L)], [0.0], [0.0],
                                                [0.0], fqn=str(slot.target), fwd_s=[0.0], opt_bytes=[0.0])
            continue
        if node.op != "call_function" or not info.out:
            continue
        rule = rule_for(node.target)
        ins_meta = [infos[a.name].out[0] for a in info.ins]
        if any(a.name not in decisions for a in info.ins):
            continue   # fed by something we do not plan (should not happen for ATen graphs)
        if rule is None:
            fallbacks.append(node.name)
        is_view[node.name] = bool(rule and rule.is_view)
        saves[node.name] = rule.saves_inputs if rule else True
        sig = (node.target, tuple(ins_meta), tuple(info.out), _const_args(node.args), _const_args(node.kwargs))
        if only is not None:
            own = [only[node.name]]
        else:
            if sig not in enumerated:    # a repeated layer's ops have the same options: enumerate once
                enumerated[sig] = node_strategies(axis_options(rule, node, ins_meta, info.out), ins_meta, info.out,
                                                  shape, rule)
            own = enumerated[sig]
        pat, want = pinned([node.name])
        if want is not None:
            own = [s for s in own if _matches(s, want)] or _bad_pin(node.name, want)
        leader, strategies = node.name, own
        if rule is not None and rule.follower and len(info.ins) == 1 and want is None:
            src = decisions[info.ins[0].name]
            by_input = {s.inputs[0]: s for s in own}
            follow = [by_input.get(s.output) for s in (decisions[src.name].strategies)]
            if all(f is not None for f in follow) and src.kind == "op":
                leader, strategies = src.leader, follow
        facts = op_facts(node, infos, ng)
        # a repeated layer's op prices the same under the same strategies: its lists are worked out once
        key = (sig, tuple(map(id, strategies)), facts, ng[node.name], info.flops, info.bytes_moved)
        if key not in node_costs:      # the strategies are kept with it: their ids stay their own
            node_costs[key] = (strategies, *_node_costs(node, info, strategies, ins_meta, facts, ng[node.name],
                                                        is_view[node.name], mesh, moe_load, priced))
        _, compute, forward, act, work = node_costs[key]
        if (key, "bwd_temp") not in node_costs:
            temps = _backward_temps(facts, strategies, ins_meta, ng[node.name], shape)
            node_costs[(key, "bwd_temp")] = [t + w for t, w in zip(temps, work)] if work else temps
        decisions[node.name] = Decision(node.name, "op", leader, strategies, compute, act, [0.0] * len(strategies),
                                        fallback=rule is None, facts=facts, fwd_s=forward,
                                        opt_bytes=[0.0] * len(strategies), bwd_temp=node_costs[(key, "bwd_temp")])
    unused = set(pins) - used_pins
    if unused:
        raise ShardingError(f"pin(s) {sorted(unused)} match no parameter, input or node of the model: "
                            f"use parameter names as in model.named_parameters() (glob patterns allowed)")
    # parameter-side ops run by a rule (a replicated fallback gathers its inputs whole: not one)
    side = frozenset(n for n in parameter_side(cap.gm, cap.inputs) if n in decisions and not decisions[n].fallback)
    edges = _edges(cap, infos, mesh, decisions, ng, sharded_outputs, saves, side)
    order = [n.name for n in nodes if n.name in decisions]
    op_nodes = [n for n in nodes if n.name in decisions and decisions[n.name].kind == "op"]
    live = liveness(op_nodes, is_view, saves, [n.name for n in op_nodes], saved_frees=saved_frees, needs_grad=ng)
    op_pos = {n.name: i for i, n in enumerate(op_nodes)}
    grad_from: dict[str, int] = {}
    for e in edges:
        e.dst_pos = op_pos.get(e.dst, len(op_nodes))
        if decisions[e.src].kind == "param":
            grad_from[e.src] = max(grad_from.get(e.src, -1), e.dst_pos)
    leaders = [n for n in order if decisions[n].leader == n]
    rep = repeated_layers(cap, {n: d.leader for n, d in decisions.items()}) if link_layers else {}
    layer = {n.name: k for n in nodes if n.name in decisions and (k := layer_key(module_path(n, cap)))}
    return Problem(mesh, order, decisions, leaders, edges, live, fallbacks, rep, ng, layer=layer, optimizer=optimizer,
                   grad_from=grad_from, moe_load=moe_load,
                   bucketable=bucketable_bytes(edges), parameter_side=side)


def _node_costs(node: fx.Node, info: NodeInfo, strategies: list[Strategy], ins_meta, facts: OpFacts, grad: bool,
                view: bool, mesh: Mesh, moe_load: float, priced: dict) -> tuple[list, list, list]:
    """(compute, forward, activation bytes) of an op per strategy; `priced`: op_cost by its arguments."""
    shape = mesh.shape
    compute, forward = [], []
    for s in ([] if facts.view and not facts.work else strategies):   # a plain view costs nothing
        key = op_cost_args(info, s, shape, facts, context_comm(node, s, ins_meta, mesh), mesh.links,
                           vocab_reductions(node, s, ins_meta, mesh), moe_load)
        if key not in priced:    # equal ops in other places cost the same: price each once
            priced[key] = op_cost(key, mesh.profile)
        fwd, bwd = priced[key]
        compute.append(fwd + (bwd if grad else 0.0))
        forward.append(fwd)
    compute = compute or [0.0] * len(strategies)
    forward = forward or [0.0] * len(strategies)
    contexts = [context_comm(node, s, ins_meta, mesh) for s in strategies]
    act = [0.0 if view else sum(m.nbytes / shard_count(s.output, shape) for m in info.out)
           + exchange_saved_bytes(info, s, shape, facts, moe_load) + (context_saved_bytes(c) if c else 0.0)
           for s, c in zip(strategies, contexts)]
    work = [context_work_bytes(c) if c and grad else 0.0 for c in contexts]
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


def bucketable_bytes(edges: list[EdgeTable]) -> float:
    """The most gradient bytes the runtime's buckets can take, whatever the layouts: per parameter
    edge, its largest bucketed gradient."""
    return sum(max((s[1] for row in e.sync for s in row if s is not None), default=0.0)
               for e in edges if e.sync is not None)


def _edges(cap, infos, mesh, decisions, ng, sharded_outputs, saves, side: frozenset[str]) -> list[EdgeTable]:
    shape = mesh.shape
    edges = []
    cache: dict = {}        # meta -> (layout number, layout number) -> seconds
    numbers: dict = {}      # layout -> (its number, `layout_code`, it): a table hashes and codes each layout once
    gathered: dict = {}     # (number, number) -> `gathers`

    def numbered(layouts) -> list[tuple[int, tuple, tuple]]:
        return [numbers.setdefault(L, (len(numbers), layout_code(L), L)) for L in layouts]

    def gathering(a, b) -> bool:
        key = (a[0], b[0])
        if key not in gathered:
            gathered[key] = gathers(a[2], b[2])
        return gathered[key]

    def reshard_seconds(meta: TensorMeta):
        """seconds(a, b): resharding a tensor of `meta` from layout a to b, each (number, code)."""
        known = cache.setdefault(meta, {})

        def seconds(a, b) -> float:
            key = (a[0], b[0])
            if key not in known:
                known[key] = mesh.coded_reshard_cost(meta.shape, meta.dtype.itemsize, a[1], b[1]).seconds
            return known[key]
        return seconds

    tables: dict = {}   # identical edges (repeated layers) share one table
    quick: dict = {}    # the same, by the class lists' identity (`classes_of` hands a linked layer's copies one)

    def table_for(meta: TensorMeta, a_keys, b_keys, grad: bool, keeps: bool, param: bool, output: bool, side: bool):
        key = (id(a_keys), id(b_keys), meta, grad, keeps, param, output, side)
        if key not in quick:      # the lists are kept with the table: their ids stay their own
            quick[key] = (a_keys, b_keys, table_of(meta, a_keys, b_keys, grad, keeps, param, output, side))
        return quick[key][2]

    def table_of(meta: TensorMeta, a_keys, b_keys, grad: bool, keeps: bool, param: bool, output: bool, side: bool):
        key = (meta, tuple(a_keys), tuple(b_keys), grad, keeps, param, output, side)
        if key not in tables:
            seconds = reshard_seconds(meta)
            ga = [output_grad_layout(a, _side_axes(side, len(a))) for a in a_keys]
            na, nga = numbered(a_keys), numbered(ga)
            nb, ngb = numbered(b for b, _ in b_keys), numbered(gb for _, gb in b_keys)
            # a program output: made whole asynchronously where it is a partial sum (mesh.output_reshard_cost)
            fwd = [[mesh.output_reshard_cost(meta.shape, meta.dtype.itemsize, a[2], b[2]).seconds if output
                    else seconds(a, b) for b in nb] for a in na]
            # a parameter's gradient the runtime reduces in a bucket: its transfer here, the buckets'
            # launches per step (solver/evaluate.py); any other gradient: its reshard
            sync = [[mesh.grad_sync_leg(meta.shape, meta.dtype.itemsize, gb, g) if grad and param else None
                     for (b, gb) in b_keys] for g in ga]
            cost = [[f + (0.0 if not grad else seconds(gb, g) if s is None else s[0])
                     for f, gb, s in zip(row, ngb, srow)] for row, g, srow in zip(fwd, nga, sync)]
            # a consumer that keeps its inputs for the backward keeps the resharded copy (e.g. a weight
            # stored sharded and gathered whole for use): that copy lives until the backward; otherwise
            # the collective's output is a temporary: it lives while the consumer runs
            sizes = [meta.nbytes / shard_count(b, shape) for b, _ in b_keys]
            copy = [[size if a[0] != b[0] else 0.0 for b, size in zip(nb, sizes)] for a in na]
            none = [[0.0] * len(nb) for _ in na]
            saved, temp = (copy, none) if keeps else (none, copy)
            # (bucket kind, bytes, seconds more it costs reduced alone in the backward: a gradient moved
            # to the host as it is made, solver/decisions/offload.py)
            sync = [[None if s is None else (*s[1:], seconds(gb, g) - s[0]) for gb, s in zip(ngb, row)]
                    for row, g in zip(sync, nga)]
            flat = [[mesh.reshard_cost(meta.shape, 0, a, b).seconds
                     if param and flat_gather_axis(a, b, meta.shape, shape) is not None else 0.0 for (b, _) in b_keys]
                    for a in a_keys]
            gather = tuple(tuple(gathering(a, b) for b in nb) for a in na)
            grad_temp = [[weight_gradient_temporary_bytes(meta.nbytes / shard_count(gb, shape), s is not None)
                          for (_, gb), s in zip(b_keys, row)] for row in sync]
            tables[key] = (cost, saved, temp, fwd, sync if any(any(r) for r in sync) else None,
                           flat if any(any(r) for r in flat) else None, gather,
                           grad_temp if any(any(r) for r in grad_temp) else None)
        return tables[key]

    def classes(keys):
        uniq, idx = {}, []
        for k in keys:
            idx.append(uniq.setdefault(k, len(uniq)))
        return list(uniq), idx

    by_strategies: dict = {}

    def classes_of(strategies: list[Strategy], slot: int | None, side: bool = False):
        """The layout classes of a producer's outputs (slot None) or of a consumer's (input, gradient)
        layouts at `slot` (`side`: the consumer is parameter-side), and each strategy's class: worked
        out once per list of strategies (a linked layer's copies hold the same Strategy objects, in the
        same order)."""
        key = (slot, side, tuple(map(id, strategies)))
        if key not in by_strategies:    # the strategies are kept with it: their ids stay their own
            keys = ([s.output for s in strategies] if slot is None else
                    [(t.inputs[slot], grad_layout_in(t, slot, side)) for t in strategies])
            by_strategies[key] = (*classes(keys), strategies)
        uniq, idx, _ = by_strategies[key]
        return uniq, list(idx)

    for node in cap.gm.graph.nodes:
        if node.op == "output":
            if sharded_outputs:
                continue
            consumers = [(a, None) for a in infos[node.name].ins]
        elif node.name in decisions and decisions[node.name].kind == "op":
            consumers = [(a, k) for k, a in enumerate(infos[node.name].ins)]
        else:
            continue
        for src, slot in consumers:
            if src.name not in decisions:
                continue
            u = decisions[src.name]
            meta = infos[src.name].out[0]
            grad = ng.get(src.name, False) and meta.dtype.is_floating_point
            a_keys, a_of = classes_of(u.strategies, None)
            if slot is None:
                want = tuple(R for _ in shape)
                b_keys, b_of = [(want, want)], [0]
                dst = "output"
            else:
                v = decisions[node.name]
                if v.leader == u.leader:
                    continue      # inside one merged group: priced by the follower's alignment (free)
                b_keys, b_of = classes_of(v.strategies, slot, node.name in side)
                dst = node.name
            keeps = slot is not None and grad and saves.get(node.name, True)
            table, saved, temp, fwd, sync, flat, gather, grad_temp = table_for(
                meta, a_keys, b_keys, grad, keeps, u.kind == "param", slot is None, src.name in side)
            edges.append(EdgeTable(src.name, dst, -1 if slot is None else slot, a_of, b_of, table, saved,
                                   temp=temp, fwd=fwd, sync=sync, flat=flat, gathers=gather, grad_temp=grad_temp))
    return edges


def _check_pin(layout, meta: TensorMeta, mesh: Mesh, what: str) -> None:
    if len(layout) != mesh.ndim:
        raise ShardingError(f"placement {tuple(to_str(p) for p in layout)} for {what} has {len(layout)} entries "
                            f"but the mesh has {mesh.ndim} axes {mesh.axis_names}: give one per axis")
    split: dict[int, int] = {}
    for p, ax in zip(layout, mesh.axes):
        if isinstance(p, Shard):
            if not 0 <= p.dim < meta.ndim:
                raise ShardingError(f"{what} has {meta.ndim} dims; it has no dim {p.dim} to split over mesh axis "
                                    f"{ax.name!r}")
            split[p.dim] = split.get(p.dim, 1) * ax.size
            if meta.shape[p.dim] % split[p.dim]:
                raise ShardingError(
                    f"cannot split dim {p.dim} (size {meta.shape[p.dim]}) of {what} over mesh axis {ax.name!r} "
                    f"(into {split[p.dim]} pieces in all): choose a size divisible by {split[p.dim]}, "
                    f"another dim, or Replicate on that axis")


def _matches(s: Strategy, want) -> bool:
    """Does strategy s follow a pin: per axis its output placement, or its label where a label is given?"""
    return all(s.labels[a] == w if isinstance(w, str) else s.output[a] == w for a, w in enumerate(want))


def _bad_pin(name, want):
    shown = tuple(w if isinstance(w, str) else to_str(w) for w in want)
    raise ShardingError(f"node {name!r} has no strategy with output placement or label {shown} per mesh axis: pin "
                        f"another layout or label, or leave it to the solver")
