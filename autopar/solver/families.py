"""Decision families: what the planner decides besides layouts, as data the ILP and the evaluator share.

The layout family (a strategy per node, `problem.py`) fixes how every tensor is split. Every
other family (`solver/decisions/*.py`) is a list of `Group`s, each one choice among named options
(shared by the repeated layers it is linked over), plus terms saying what an option does, each
linear in the layout choice:

* `Cost`: seconds added to the step when a group takes an option, clamped at 0 (a transfer
  hidden behind compute costs nothing), times `count` (the linked layers it stands for);
* `Freed`: bytes the device stops holding at the forward points in (after, until] when any of
  its `gates` is on (a saved activation recomputed or offloaded, a gathered parameter copy
  freed after use; an item is freed once, whichever gates free it), held again in the backward
  row `back` (the layer's backward) when one of its `returns` gates is on (a recomputed layer's
  tensors all exist again at once; offloaded ones are fetched one op at a time and are not);
* `Held`: bytes another tier ("host", "disk") holds when an option is on, against that tier's
  capacity.

`Expr` is linear in the layout choice: a value per choice of some decisions, [a][b] tables of
some edges, and a constant. The ILP (`ilp.py`) turns terms into rows without knowing which
family made them; `evaluate.py` prices any complete assignment from the same terms.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

Gate = tuple[str, int]        # (group key, option index)


@dataclass(frozen=True, slots=True)
class Expr:
    nodes: tuple[tuple[str, tuple[float, ...]], ...] = ()           # (decision, value per choice)
    edges: tuple[tuple[int, tuple[tuple[float, ...], ...]], ...] = ()   # (edge index, [a][b] table)
    const: float = 0.0

    def __add__(self, other: Expr) -> Expr:
        return Expr(self.nodes + other.nodes, self.edges + other.edges, self.const + other.const)

    def scaled(self, k: float) -> Expr:
        return Expr(tuple((n, tuple(k * v for v in vals)) for n, vals in self.nodes),
                    tuple((e, tuple(tuple(k * v for v in row) for row in t)) for e, t in self.edges), k * self.const)

    def value(self, problem, choice: Mapping[str, int]) -> float:
        """Its value when the layout family picks `choice` (leader -> strategy index)."""
        total = self.const
        for name, vals in self.nodes:
            total += vals[choice[problem.decisions[name].leader]]
        for k, table in self.edges:
            e = problem.edges[k]
            a = e.a_of[choice[problem.decisions[e.src].leader]]
            b = 0 if e.dst == "output" else e.b_of[choice[problem.decisions[e.dst].leader]]
            total += table[a][b]
        return total

    def bound(self) -> float:
        """An upper bound over every layout choice (the ILP's big-M)."""
        return (self.const + sum(max(vals, default=0.0) for _, vals in self.nodes)
                + sum(max((max(row, default=0.0) for row in t), default=0.0) for _, t in self.edges))

    @property
    def empty(self) -> bool:
        return not self.nodes and not self.edges and not self.const


@dataclass(frozen=True, slots=True)
class Group:
    key: str                      # "recompute:blocks.1"
    family: str                   # "recompute", "residency", "offload"
    options: tuple[str, ...]      # option 0 is the default (does nothing)
    members: tuple[str, ...]      # the plan keys it decides (layer paths, parameter names, "activations:blocks.3")
    allowed: tuple[int, ...]      # the options the user allows


@dataclass(frozen=True, slots=True)
class Cost:
    expr: Expr                    # seconds
    gate: Gate
    count: float = 1.0
    what: str = ""


@dataclass(frozen=True, slots=True)
class Freed:
    expr: Expr                    # bytes per device
    gates: tuple[Gate, ...]
    after: int                    # freed at forward points with position > after ...
    until: int                    # ... and <= until
    back: str | None = None       # the backward row it is held again in ...
    what: str = ""
    key: str = ""                 # the item: terms with one key free the same bytes
    returns: tuple[Gate, ...] = ()   # ... under these gates


@dataclass(frozen=True, slots=True)
class Held:
    expr: Expr                    # bytes per device
    gate: Gate
    tier: str                     # "host" | "disk"
    count: float = 1.0
    what: str = ""


@dataclass(slots=True)
class Families:
    """Every family's groups and terms, merged (the order of families is the order they were added)."""
    groups: list[Group] = field(default_factory=list)
    costs: list[Cost] = field(default_factory=list)
    freed: list[Freed] = field(default_factory=list)
    held: list[Held] = field(default_factory=list)

    def extend(self, other: Families) -> None:
        self.groups += other.groups
        self.costs += other.costs
        self.freed += other.freed
        self.held += other.held

    @property
    def backs(self) -> list[str]:
        """The backward rows: `Freed.back` of the items that can come back there, in order."""
        return list(dict.fromkeys(f.back for f in self.freed if f.back is not None and f.returns))

    def family_of(self) -> dict[str, str]:
        """group key -> its family's name."""
        return {g.key: g.family for g in self.groups}

    def defaults(self) -> dict[str, int]:
        """Every group at its first allowed option."""
        return {g.key: g.allowed[0] for g in self.groups}
