"""What the decision families share: user settings, and the layers they decide for."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ...plan_records import ACTIVATIONS, RESIDENCY_MODES
from ..families import scaled_table
from ..problem import Problem

REGATHER = RESIDENCY_MODES.index("regather")

CHOICES = {
    "recompute": ("auto", "none", "selective", "full"),
    "residency": ("auto", "keep", "regather"),
    "offload": ("auto", "none", "host", "disk"),
}


def allowed_options(family: str, setting: str, options: tuple[str, ...]) -> tuple[int, ...]:
    """The option indices a user setting allows: "auto" all of them, "none" the default, a name that one."""
    if setting not in CHOICES[family]:
        raise ValueError(f"{family}={setting!r}: use one of {', '.join(map(repr, CHOICES[family]))}")
    if setting == "auto":
        return tuple(range(len(options)))
    if setting == "none":
        return (0,)
    return (options.index(setting),)


@dataclass(frozen=True, slots=True)
class LayerGroups:
    """Layers of the problem: their nodes, and which representative layer's group each belongs to."""
    nodes: Mapping[str, tuple[str, ...]]        # layer -> its decisions, in graph order
    rep: Mapping[str, str]                      # layer -> the representative layer of its group
    members: Mapping[str, tuple[str, ...]]      # representative -> the layers of its group, in order


def layer_groups(problem: Problem) -> LayerGroups:
    nodes: dict[str, list[str]] = {}
    for name in problem.order:
        layer = problem.layer.get(name)
        if layer is not None:
            nodes.setdefault(layer, []).append(name)
    rep: dict[str, str] = {}
    for layer, names in nodes.items():
        tied = [problem.layer.get(problem.rep[n]) for n in names if n in problem.rep]
        rep[layer] = tied[0] if tied and tied[0] is not None else layer
    members: dict[str, list[str]] = {}
    for layer in nodes:
        members.setdefault(rep[layer], []).append(layer)
    return LayerGroups({k: tuple(v) for k, v in nodes.items()}, rep, {k: tuple(v) for k, v in members.items()})


def residency_of(problem: Problem, groups: LayerGroups, k: int) -> tuple[str, str, tuple | None] | None:
    """The residency decision over edge k's gathered copy, if any: (its group's key, the plan key it
    decides, the [a][b] layout pairs that gather or None for all of them). A parameter's copy is decided
    with its layer's (or alone outside the layers); an activation's where its consumer's reshard gathers
    some axis, with the consumer's layer (`solver/decisions/residency.py`)."""
    e = problem.edges[k]
    if not e.keeps_copy:
        return None
    src = problem.decisions[e.src]
    if src.kind == "param":
        layer = problem.layer.get(e.src)
        return f"residency:{groups.rep[layer] if layer in groups.rep else src.fqn}", src.fqn, None
    if src.kind == "op" and any(map(any, e.gathers)):
        layer = problem.layer.get(e.dst)
        rep = ACTIVATIONS + (groups.rep[layer] if layer in groups.rep else e.dst)
        return f"residency:{rep}", ACTIVATIONS + (layer or e.dst), e.gathers
    return None


def before_backward(problem: Problem, groups: LayerGroups, layer: str) -> int:
    """The last timeline point before `layer`'s backward starts (its last op's backward): what the
    layer frees until then exists again for its backward (recomputed, or fetched back)."""
    live = problem.live
    ops = [live.op_pos[n] for n in groups.nodes[layer] if n in live.op_pos]
    return live.backward_of(max(ops)) - 1 if ops else live.last      # no op: the layer frees nothing


def saved_only_in(problem: Problem) -> dict[str, list[str]]:
    """layer -> the activations only that layer's ops save for their backward, and that the forward
    no longer needs before its end (what recomputing or offloading the layer can free), in order."""
    live, out = problem.live, {}
    for o in live.owners:
        layers = {problem.layer.get(s) for s in live.savers.get(o, ())}
        if len(layers) == 1 and None not in layers and live.fwd_end[o] < live.last:
            out.setdefault(layers.pop(), []).append(o)
    return out


def edges_by(problem: Problem, end: str) -> dict[str, list[int]]:
    """Node -> the indices of the edges whose `end` ("src" or "dst") it is, in the problem's order."""
    out: dict[str, list[int]] = {}
    for k, e in enumerate(problem.edges):
        out.setdefault(getattr(e, end), []).append(k)
    return out


class Masked:
    """`masks(table, mask, keep)`: table's entries where mask is `keep` (all of them without a mask), 0
    elsewhere, as tuples. One copy per (table, mask, keep): edges that share their tables (a linked
    layer's copies) share the masked ones too, so the ILP works their terms out once
    (`StrategyILP.edge_coefs`). Likewise `scaled` and `ones`, the tables a family derives from those
    (the layer groups' representatives share most of them: on Qwen3-8B over (4, 4, 4) offload's
    activation terms scaled 294 tables, 52 of them distinct)."""

    def __init__(self):
        self._known: dict[tuple, tuple] = {}

    def __call__(self, table, mask=None, keep: bool = True) -> tuple[tuple[float, ...], ...]:
        return self.once(("mask", id(table), id(mask), keep), (table, mask), lambda: tuple(
            tuple(v if mask is None or mask[a][b] == keep else 0.0 for b, v in enumerate(row))
            for a, row in enumerate(table)))

    def scaled(self, table, k: float) -> tuple[tuple[float, ...], ...]:
        """`families.scaled_table(table, k)`, once per (table, k) (`Expr.scaled`'s `table_scaled`)."""
        return self.once(("scaled", id(table), k), (table,), lambda: scaled_table(table, k))

    def ones(self, table, value: float) -> tuple[tuple[float, ...], ...]:
        """`value` where the table's entry is not 0, else 0: a count of the pairs that hold something."""
        return self.once(("ones", id(table), value), (table,),
                          lambda: tuple(tuple(value if v else 0.0 for v in row) for row in table))

    def once(self, key: tuple, keep: tuple, make):
        """make(), once per `key` (which may name tables by id: `keep` holds them meanwhile)."""
        if key not in self._known:      # the tables are kept with it: their ids stay their own
            self._known[key] = (keep, make())
        return self._known[key][1]
