"""Residency of gathered copies: "keep" or "regather" (`Plan.residency`).

A tensor stored sharded and gathered for use keeps the gathered copy from its forward use to its
backward ("keep") or frees it after the forward and gathers it again for the backward
("regather"). Two kinds of copies, one mechanism (`runtime/regather.py`):

* a parameter (key: its FQN), decided per layer as FSDP wraps a block (all its gathered parameters
  alike; repeated layers linked), and per parameter outside the layers. With the shard stored over
  the data axes, "keep" is ZeRO-2's memory (FSDP with reshard_after_forward=False) and "regather"
  ZeRO-3 / FSDP's default;
* an activation all-gathered before an op that saves it (key "activations:<layer>", or
  "activations:<node>" for a consumer outside the layers): Megatron sequence parallelism
  (Korthikanti et al. 2022) keeps a column-parallel matmul's input sequence-sharded over the
  tensor-parallel axis and all-gathers it again in the backward, so the saved input is 1/tp of the
  gathered one. Only the copies whose reshard gathers some axis (Shard -> Replicate) are candidates;
  the pre-gather shard stays saved (the liveness model counts it saved by the consumer already).

The second gather is priced as the runtime runs it, with no overlap assumed (the runtime launches
a layer's backward gather one layer ahead, but on the ranks measured so far that hides little):

* an activation's copy: gathered again when the backward needs it: the forward gather's seconds
  once more, for the layout pairs that gather;
* a layer's parameters: the runtime gathers those a flat gather can take (`comm.flat_gather_axis`)
  as ONE all-gather per pass (runtime/layer_gather.py), forward and backward, where the edge tables
  price one gather per parameter. So per layer of n such parameters, one cost: their forward
  gathers' seconds once more (the backward), less 2 (n - 1) / n of each one's latency and launch
  (`EdgeTable.flat`, `comm.regather_seconds`): n collectives become one in each pass. Outside the
  layers (decided per parameter) n = 1: the forward gather once more. The edge tables' forward
  stays per parameter: it is also the price under "keep", where the runtime gathers one by one.
"""
from __future__ import annotations

from collections.abc import Mapping

from ...cost_model.comm import regather_seconds
from ...plan_records import RESIDENCY_MODES
from ..families import Cost, Expr, Families, Group
from ..problem import Problem
from .common import REGATHER, Masked, allowed_options, layer_groups, residency_of
from .recompute import copy_freed

FlatGathers = Mapping[tuple[str, str, int], tuple[str, int, int]]   # (src, dst, slot) -> (layer, n, at)


def build(problem: Problem, setting: str, flat: FlatGathers | None = None) -> Families:
    """`flat`: the layers' flat gathers as the planning problem has them (`flat_gathers`), for a problem
    holding only a plan's own layouts (`autopar.planner.scaling`); default: this problem's."""
    allowed = allowed_options("residency", setting, RESIDENCY_MODES)
    groups = layer_groups(problem)
    fam = Families()
    edges: dict[str, list[tuple[int, tuple | None]]] = {}   # group -> (edge, [a][b] gathers? or None: all)
    names: dict[str, list[str]] = {}                        # group -> the plan keys it decides
    for k in range(len(problem.edges)):
        decided = residency_of(problem, groups, k)
        if decided is None:
            continue
        key, member, mask = decided
        edges.setdefault(key, []).append((k, mask))
        if member not in names.setdefault(key, []):
            names[key].append(member)
    flat = flat_gathers(problem) if flat is None else flat
    back = {k: flat[key][2] for k, e in enumerate(problem.edges) if (key := (e.src, e.dst, e.slot)) in flat}
    n_of = {layer: n for layer, n, _ in flat.values()}
    masks = Masked()
    for key, items in edges.items():
        fam.groups.append(Group(key, "residency", RESIDENCY_MODES, tuple(names[key]), allowed))
        if REGATHER not in allowed:
            continue
        layers: dict[str, list[int]] = {}          # a layer's parameter edges (all gathered at once)
        for k, mask in items:
            e = problem.edges[k]
            # freed after the consumer runs, gathered again for its backward
            fam.freed.append(copy_freed(problem, k, ((key, REGATHER),),
                                        back.get(k, problem.live.backward_of(e.dst_pos) - 1), masks(e.saved, mask)))
            if mask is None:
                layers.setdefault(problem.layer.get(e.src) or e.src, []).append(k)
            else:
                fam.costs.append(Cost(Expr((), ((k, masks(e.fwd, mask)),)), (key, REGATHER), 1.0,
                                      f"re-gather {problem.decisions[e.src].fqn or e.src} for {e.dst}"))
        for layer, ks in layers.items():
            fam.costs.append(layer_regather(problem, layer, ks, (key, REGATHER), n_of.get(layer)))
    return fam


def flat_gathers(problem: Problem) -> dict[tuple[str, str, int], tuple[str, int, int]]:
    """The parameter edges of layers gathered flat (runtime/layer_gather.py), by (src, dst, slot): (their
    layer, how many of its parameter edges a flat gather can take under some layout of `problem`, the
    timeline position after which the backward has the copy again). The whole layer is gathered when
    its backward starts (the backward of its last consumer), and launched one layer earlier still,
    when the next layer's backward gathers (the prefetch); the edges of one layer, alike.
    The figures are the planning problem's, over every layout it weighs: a problem of one plan's layouts
    (`build_problem(only=)`) holds only the edges that plan gathers, so it takes them from there."""
    layers: dict[str, list[int]] = {}
    for k, e in enumerate(problem.edges):
        layer = problem.layer.get(e.src)
        if e.keeps_copy and problem.decisions[e.src].kind == "param" and layer is not None and e.flat is not None:
            layers.setdefault(layer, []).append(k)
    starts = {layer: min(problem.live.backward_of(problem.edges[k].dst_pos) for k in ks)
              for layer, ks in layers.items()}
    order = sorted(layers, key=lambda layer: min(problem.edges[k].dst_pos for k in layers[layer]))
    out = {}
    for i, layer in enumerate(order):
        at = starts[order[i + 1]] if i + 1 < len(order) else starts[layer]
        for k in layers[layer]:
            e = problem.edges[k]
            out[e.src, e.dst, e.slot] = (layer, len(layers[layer]), at - 1)
    return out


def layer_regather(problem: Problem, layer: str, ks: list[int], gate, n: int | None = None) -> Cost:
    """The re-gather of parameter edges `ks` of one layer (module docstring): their forward gathers
    again, n collectives made one in each pass for the n a flat gather takes (default: the edges of
    `ks` it can take)."""
    n = sum(problem.edges[k].flat is not None for k in ks) if n is None else n
    terms = [(k, regather_seconds(problem.edges[k].fwd, problem.edges[k].flat, n)) for k in ks]
    what = f"re-gather {layer}" + (f": its {n} parameters in one flat all-gather per pass" if n > 1 else "")
    return Cost(Expr((), tuple(terms)), gate, 1.0, what)
