"""The planning problem as data: decisions, their costs, and the edges between them.

Built once from the annotated graph; the ILP (`ilp.py`), exhaustive search (tests) and plan
evaluation all read these same tables, so they price a plan identically.

* The decisions (`nodes.py`): a layout per parameter, input and op, with each choice's seconds and
  bytes; followers merged into the leader they follow.
* The edges (`edges.py`): per producer -> consumer tensor, the seconds and bytes of every pair of
  layout classes.
* Memory: parameter state per leader choice, activation bytes per node per choice, and the
  liveness points at which their sum must fit the budget (`cost_model.memory.liveness`).

Nothing here knows an op: what an op does inside itself is its rule's facts (`strategies/inner.py`),
priced by `cost_model/inner.py` and `cost_model/ops.py`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch.fx as fx
from torch.distributed.tensor import Replicate

from ..cost_model.inner import busiest_load, inner_collectives
from ..cost_model.memory import Liveness, liveness
from ..mesh import Mesh
from ..passes.capture import Captured
from ..passes.layers import layer_key, module_path
from ..passes.parameter_side import parameter_side
from ..passes.shape_prop import NodeInfo, TensorMeta, tensor_inputs, tensor_meta
from ..strategies import Strategy, rule_for
from ..strategies.gradients import output_grad_layout
from ..strategies.registry import inner_facts
from .edges import EdgeTable, bucketable_bytes, edge_tables, grad_layout_in, side_axes
from .families import Families
from .layers import repeated_layers
from .nodes import Decision, Pricing, node_decisions
from .pins import Pins

R = Replicate()


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
    load: float = 1.0         # the busiest device's work dealt by data over the mean (`cost_model.inner.busiest_load`)
    # the most gradient bytes the runtime's buckets can take, whatever the layouts (`bucketable_bytes`):
    # how the ILP bounds the buckets' buffers (`memory_rows.MemoryRows`)
    bucketable: float = 0.0
    # the timeline position from which the gradient buckets hold buffers, whatever the layouts
    # (`first_bucketed`): where the ILP's rows (`memory_rows`) and the evaluator add them
    buckets_from: int = 0
    # ops whose gradient flows into parameters alone, run by a rule (passes/parameter_side.py): their
    # gradients stay partial sums where they are replicated (strategies/gradients.py)
    parameter_side: frozenset[str] = frozenset()
    # per edge (edge, its source's leader, its consumer's leader or None for the outputs): what
    # `picked_edges` reads for every plan it is asked about, made on its first call
    edge_leaders: list | None = field(default=None, init=False, repr=False, compare=False)
    # the evaluator's items freed per (layouts, family options) priced lately (`evaluate.freed_items`)
    freed_memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def grad_since(self, name: str) -> int:
        """The timeline position from which parameter `name`'s gradient exists."""
        return self.live.backward_of(self.grad_from.get(name, self.live.last))

    def n_choices(self, leader: str) -> int:
        return len(self.decisions[leader].strategies)


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
        yield ChosenEdge(e, meta, a, b, gb, output_grad_layout(a, side_axes(e.src in problem.parameter_side, len(a))))


def picked_edges(p: Problem, choice: Mapping[str, int]):
    """(edge, source class, destination class) of every edge under `choice`."""
    if p.edge_leaders is None:
        dec = p.decisions
        p.edge_leaders = [(e, dec[e.src].leader, None if e.dst == "output" else dec[e.dst].leader) for e in p.edges]
    for e, src, dst in p.edge_leaders:
        yield e, e.a_of[choice[src]], 0 if dst is None else e.b_of[choice[dst]]


def edge_legs(problem: Problem, c: ChosenEdge):
    """(phase, ReshardCost) of an edge under a plan: the forward reshard, and the gradient's way
    back for a floating-point tensor that is not an input."""
    mesh, meta = problem.mesh, c.meta
    cost = mesh.output_reshard_cost if c.edge.dst == "output" else mesh.reshard_cost
    legs = [("forward", cost(meta.shape, meta.dtype.itemsize, c.src, c.dst))]
    if meta.dtype.is_floating_point and problem.decisions[c.edge.src].kind != "input":
        legs.append(("backward", mesh.reshard_cost(meta.shape, meta.dtype.itemsize, c.grad_src, c.grad_dst)))
    return legs


def op_exchanges(problem: Problem, node: fx.Node, s: Strategy, metas: Mapping | None = None):
    """(phase, "<collective>@<axis>", seconds, bytes one device sends, axis) of the collectives an op
    runs inside itself under s, as `op_cost` prices them (the plan lists them on the op): those of its
    rule's `inner` facts (strategies/inner.py) that `cost_model.inner` lists. metas:
    node name -> TensorMeta to price with instead of the graph's (the symbolic sizes of `planner/scaling.py`)."""
    rule = rule_for(node.target)
    if rule is None or rule.inner is None:
        return []
    mesh = problem.mesh

    def meta(n: fx.Node):
        return metas[n.name] if metas is not None else tensor_meta(n.meta.get("val"))[0]
    facts = inner_facts(rule, node, s, [meta(a) for a in tensor_inputs(node)], [meta(node)], mesh.shape)
    return [(c.phase, f"{c.kind}@{mesh.axis_names[a]}", c.seconds, c.sent, mesh.axis_names[a])
            for c, a in inner_collectives(facts, mesh.links, problem.load, mesh.profile)]


def build_problem(cap: Captured, infos: Mapping[str, NodeInfo], mesh: Mesh, *,
                  pins: Mapping[str, Sequence[str]] | None = None, optimizer: str = "adamw",
                  batch_axes: Sequence[str] | None = None, sharded_outputs: bool = False,
                  link_layers: bool = True, only: Mapping[str, Strategy] | None = None,
                  precision: str = "auto", saved_frees: bool = False,
                  capacity_factor: float | None = None) -> Problem:
    """The planning problem of a captured graph (the layout family; `solver.decisions` adds the others).

    `precision` prices optimizer state (`cost_model.memory.state_bytes`); `saved_frees` adds the
    liveness points where freeing families (recomputation, offload) lower memory.
    `capacity_factor` (the plan option) caps the busiest device's load where ops deal work by routing (`cost_model.inner.busiest_load`).

    `only` (node name -> strategy) prices that one strategy per node instead of enumerating them:
    how a chosen plan is re-priced at symbolic sizes (`autopar.planner.scaling`), where `infos` hold
    sympy shapes and FLOPs. Pins, merging and layer tying are then moot and skipped."""
    if only is not None:
        pins, link_layers = None, False
    load = busiest_load(mesh.profile, capacity_factor)
    found = node_decisions(cap, infos, mesh, Pins(pins, mesh),
                           Pricing(optimizer, precision, tuple(batch_axes or ()), load, only))
    decisions = found.decisions
    # parameter-side ops run by a rule (a replicated fallback gathers its inputs whole: not one)
    side = frozenset(n for n in parameter_side(cap.gm, cap.inputs) if n in decisions and not decisions[n].fallback)
    edges = edge_tables(cap, infos, mesh, decisions, found.needs_grad, sharded_outputs, found.saves, side)
    nodes = [n for n in cap.gm.graph.nodes if n.name in decisions]
    op_nodes = [n for n in nodes if decisions[n.name].kind == "op"]
    live = liveness(op_nodes, found.is_view, found.saves, [n.name for n in op_nodes], saved_frees=saved_frees,
                    needs_grad=found.needs_grad)
    order = [n.name for n in nodes]
    rep = repeated_layers(cap, {n: d.leader for n, d in decisions.items()}) if link_layers else {}
    layer = {n.name: k for n in nodes if (k := layer_key(module_path(n, cap)))}
    problem = Problem(mesh, order, decisions, [n for n in order if decisions[n].leader == n], edges, live,
                      found.fallbacks, rep, found.needs_grad, layer=layer, optimizer=optimizer,
                      grad_from=_grad_from(edges, decisions, op_nodes), load=load,
                      bucketable=bucketable_bytes(edges), parameter_side=side)
    problem.buckets_from = first_bucketed(problem)
    return problem


def first_bucketed(p: Problem) -> int:
    """The timeline position from which the gradient buckets hold buffers: the backward of the first
    parameter gradient some layout puts in a bucket (a bucket's buffer is made at its first gradient,
    runtime/grad_sync.py; before it, at the loss's backward, there is none). Whatever the chosen layouts,
    so that the ILP's rows (`memory_rows`) and the evaluator agree; a problem of one plan's layouts
    (`only`) takes it from its planning problem (`planner/scaling.py`)."""
    return min((p.grad_since(e.src) for e in p.edges
                if e.sync is not None and any(s is not None for row in e.sync for s in row)), default=p.live.step_end)


def _grad_from(edges: list[EdgeTable], decisions: Mapping[str, Decision], op_nodes: list[fx.Node]) -> dict[str, int]:
    """Set each edge's consumer position; parameter -> forward position of its last consumer."""
    op_pos = {n.name: i for i, n in enumerate(op_nodes)}
    grad_from: dict[str, int] = {}
    for e in edges:
        e.dst_pos = op_pos.get(e.dst, len(op_nodes))
        if decisions[e.src].kind == "param":
            grad_from[e.src] = max(grad_from.get(e.src, -1), e.dst_pos)
    return grad_from
