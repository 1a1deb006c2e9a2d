"""The problem's edges: per producer -> consumer tensor, the cost of every pair of layouts.

Edge cost[a][b]: seconds to reshard the producer's output layout class a into the layout class b
the consumer wants (forward), plus moving the gradient back (backward); with the bytes of a
resharded copy the consumer keeps (or holds while it runs), a parameter's gradient bucket, and
whether the reshard gathers. Identical edges (repeated layers) share one table.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Replicate

from ..cost_model.comm import flat_gather_axis, layout_code
from ..cost_model.memory import weight_gradient_temporary_bytes
from ..mesh import Mesh
from ..passes.shape_prop import TensorMeta
from ..placement import gathers
from ..strategies import Strategy
from ..strategies.gradients import input_grad_layouts, output_grad_layout
from ..strategies.strategy import shard_count

R = Replicate()


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
    keeps_copy: bool = False           # some entry of `saved` is not 0 (worked out once per table, not per edge:
                                       # the memory rows' sweep asked it of every edge for every model built)


def grad_layout_in(s: Strategy, slot: int, parameter_side: bool = False) -> tuple:
    """Layout of the gradient an op sends back to input `slot` under strategy s
    (strategies/gradients.py; a parameter-side op keeps partial sums on every axis it is replicated)."""
    return input_grad_layouts(s.inputs, s.output, side_axes(parameter_side, len(s.output)))[slot]


def side_axes(parameter_side: bool, ndim: int) -> tuple[bool, ...]:
    return (True,) * ndim if parameter_side else ()


def bucketable_bytes(edges: list[EdgeTable]) -> float:
    """The most gradient bytes the runtime's buckets can take, whatever the layouts: per parameter
    edge, its largest bucketed gradient."""
    return sum(max((s[1] for row in e.sync for s in row if s is not None), default=0.0)
               for e in edges if e.sync is not None)


def edge_tables(cap, infos, mesh: Mesh, decisions, ng, sharded_outputs: bool, saves,
                side: frozenset[str]) -> list[EdgeTable]:
    """Every edge from a decision into an op (or the program's outputs, unless they stay sharded) of
    another leader, in graph order. `ng`: does a node's output need a gradient; `saves`: does an op keep
    its inputs for the backward; `side`: the parameter-side ops (passes/parameter_side.py)."""
    tables = _Tables(mesh)
    edges = []
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
            if src.name in decisions:
                edge = _edge(tables, node, src, slot, infos, decisions, ng, saves, side)
                if edge is not None:
                    edges.append(edge)
    return edges


def _edge(tables: _Tables, node, src, slot: int | None, infos, decisions, ng, saves, side) -> EdgeTable | None:
    """The edge from `src` into input `slot` of `node` (None: into the outputs); None inside one
    merged group (priced by the follower's alignment: free)."""
    u = decisions[src.name]
    meta = infos[src.name].out[0]
    grad = ng.get(src.name, False) and meta.dtype.is_floating_point
    a_keys, a_of = tables.classes_of(u.strategies, None)
    if slot is None:
        want = tuple(R for _ in tables.mesh.shape)
        b_keys, b_of = [(want, want)], [0]
        dst = "output"
    else:
        v = decisions[node.name]
        if v.leader == u.leader:
            return None
        b_keys, b_of = tables.classes_of(v.strategies, slot, node.name in side)
        dst = node.name
    keeps = slot is not None and grad and saves.get(node.name, True)
    table, saved, temp, fwd, sync, flat, gather, grad_temp, kept = tables.table_for(
        meta, a_keys, b_keys, grad, keeps, u.kind == "param", slot is None, src.name in side)
    return EdgeTable(src.name, dst, -1 if slot is None else slot, a_of, b_of, table, saved,
                     temp=temp, fwd=fwd, sync=sync, flat=flat, gathers=gather, grad_temp=grad_temp, keeps_copy=kept)


def _classes(keys):
    uniq, idx = {}, []
    for k in keys:
        idx.append(uniq.setdefault(k, len(uniq)))
    return list(uniq), idx


def _or_none(table):
    """A table, or None where every entry is empty."""
    return table if any(any(r) for r in table) else None


class _Tables:
    """The edge tables of one problem, each worked out once: identical edges (repeated layers) share
    one, layouts are numbered and coded once, reshard seconds cached per tensor meta."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.cache: dict = {}        # meta -> (layout number, layout number) -> seconds
        self.numbers: dict = {}      # layout -> (its number, `layout_code`, it)
        self.gathered: dict = {}     # (number, number) -> `gathers`
        self.tables: dict = {}       # identical edges share one table
        self.quick: dict = {}        # the same, by the class lists' identity (`classes_of` hands a linked layer's copies one)
        self.by_strategies: dict = {}

    def numbered(self, layouts) -> list[tuple[int, tuple, tuple]]:
        out = []
        for L in layouts:       # coded once per layout (setdefault would code it on every call)
            if L not in self.numbers:
                self.numbers[L] = (len(self.numbers), layout_code(L), L)
            out.append(self.numbers[L])
        return out

    def gathering(self, a, b) -> bool:
        key = (a[0], b[0])
        if key not in self.gathered:
            self.gathered[key] = gathers(a[2], b[2])
        return self.gathered[key]

    def reshard_seconds(self, meta: TensorMeta):
        """seconds(a, b): resharding a tensor of `meta` from layout a to b, each (number, code)."""
        known, mesh = self.cache.setdefault(meta, {}), self.mesh

        def seconds(a, b) -> float:
            key = (a[0], b[0])
            if key not in known:
                known[key] = mesh.coded_reshard_cost(meta.shape, meta.dtype.itemsize, a[1], b[1]).seconds
            return known[key]
        return seconds

    def classes_of(self, strategies: list[Strategy], slot: int | None, side: bool = False):
        """The layout classes of a producer's outputs (slot None) or of a consumer's (input, gradient)
        layouts at `slot` (`side`: the consumer is parameter-side), and each strategy's class: worked
        out once per list of strategies (a linked layer's copies hold the same Strategy objects, in the
        same order)."""
        key = (slot, side, tuple(map(id, strategies)))
        if key not in self.by_strategies:    # the strategies are kept with it: their ids stay their own
            keys = ([s.output for s in strategies] if slot is None else
                    [(t.inputs[slot], grad_layout_in(t, slot, side)) for t in strategies])
            self.by_strategies[key] = (*_classes(keys), strategies)
        uniq, idx, _ = self.by_strategies[key]
        return uniq, list(idx)

    def table_for(self, meta: TensorMeta, a_keys, b_keys, grad: bool, keeps: bool, param: bool, output: bool,
                  side: bool):
        key = (id(a_keys), id(b_keys), meta, grad, keeps, param, output, side)
        if key not in self.quick:      # the lists are kept with the table: their ids stay their own
            self.quick[key] = (a_keys, b_keys, self.table_of(meta, a_keys, b_keys, grad, keeps, param, output, side))
        return self.quick[key][2]

    def table_of(self, meta: TensorMeta, a_keys, b_keys, grad: bool, keeps: bool, param: bool, output: bool,
                 side: bool):
        """(cost, saved, temp, fwd, sync, flat, gathers, grad_temp, keeps_copy) of an edge (`EdgeTable`'s fields;
        temp None where every entry is 0)."""
        key = (meta, tuple(a_keys), tuple(b_keys), grad, keeps, param, output, side)
        if key not in self.tables:
            ga = [output_grad_layout(a, side_axes(side, len(a))) for a in a_keys]
            na, nga = self.numbered(a_keys), self.numbered(ga)
            nb, ngb = self.numbered(b for b, _ in b_keys), self.numbered(gb for _, gb in b_keys)
            cost, fwd, sync = self._seconds(meta, na, nga, nb, ngb, ga, b_keys, grad, param, output)
            saved, temp = self._copies(meta, na, nb, b_keys, keeps)
            flat = [[self.mesh.coded_reshard_cost(meta.shape, 0, a[1], b[1]).seconds
                     if param and flat_gather_axis(a[2], b[2], meta.shape, self.mesh.shape) is not None else 0.0
                     for b in nb] for a in na]
            gather = tuple(tuple(self.gathering(a, b) for b in nb) for a in na)
            grads = [meta.nbytes / shard_count(gb, self.mesh.shape) for _, gb in b_keys]   # per class, not per pair
            grad_temp = [[weight_gradient_temporary_bytes(g, s is not None) for g, s in zip(grads, row)]
                         for row in sync]
            self.tables[key] = (cost, saved, _or_none(temp), fwd, sync if any(any(r) for r in sync) else None,
                                _or_none(flat), gather, _or_none(grad_temp), any(any(r) for r in saved))
        return self.tables[key]

    def _seconds(self, meta: TensorMeta, na, nga, nb, ngb, ga, b_keys, grad: bool, param: bool, output: bool):
        """(cost, fwd, sync) tables of an edge: its forward reshard, plus the gradient's way back."""
        mesh, seconds = self.mesh, self.reshard_seconds(meta)
        # a program output: made whole asynchronously where it is a partial sum (mesh.output_reshard_cost)
        fwd = [[mesh.output_reshard_cost(meta.shape, meta.dtype.itemsize, a[2], b[2]).seconds if output
                else seconds(a, b) for b in nb] for a in na]
        # a parameter's gradient the runtime reduces in a bucket: its transfer here, the buckets'
        # launches per step (solver/evaluate.py); any other gradient: its reshard
        sync = [[mesh.grad_sync_leg(meta.shape, meta.dtype.itemsize, gb, g) if grad and param else None
                 for (b, gb) in b_keys] for g in ga]
        cost = [[f + (0.0 if not grad else seconds(gb, g) if s is None else s[0])
                 for f, gb, s in zip(row, ngb, srow)] for row, g, srow in zip(fwd, nga, sync)]
        # (bucket kind, bytes, seconds more it costs reduced alone in the backward: a gradient moved
        # to the host as it is made, solver/decisions/offload.py)
        sync = [[None if s is None else (*s[1:], seconds(gb, g) - s[0]) for gb, s in zip(ngb, row)]
                for row, g in zip(sync, nga)]
        return cost, fwd, sync

    def _copies(self, meta: TensorMeta, na, nb, b_keys, keeps: bool):
        """(saved, temp): a consumer that keeps its inputs for the backward keeps the resharded copy (e.g.
        a weight stored sharded and gathered whole for use): that copy lives until the backward;
        otherwise the collective's output is a temporary: it lives while the consumer runs."""
        sizes = [meta.nbytes / shard_count(b, self.mesh.shape) for b, _ in b_keys]
        copy = [[size if a[0] != b[0] else 0.0 for b, size in zip(nb, sizes)] for a in na]
        none = [[0.0] * len(nb) for _ in na]
        return (copy, none) if keeps else (none, copy)
