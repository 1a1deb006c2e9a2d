"""Decision families: what the planner decides besides layouts, as data the ILP and the evaluator share.

The layout family (a strategy per node, `problem.py`) fixes how every tensor is split. Every
other family (`solver/decisions/*.py`) is a list of `Group`s, each one choice among named options
(shared by the repeated layers it is linked over), plus terms saying what an option does, each
linear in the layout choice:

* `Cost`: seconds added to the step when a group takes an option, clamped at 0 (a transfer
  hidden behind compute costs nothing), times `count` (the linked layers it stands for); not when
  one of its `unless` gates is on (another family's option does that work instead: a recomputed
  layer's re-gathered parameters are gathered by the residency family's flat gather, not again);
* `Freed`: bytes the device stops holding at the points of the step's timeline in (after, until]
  (`cost_model.memory`: forward positions, then each op's backward) when any of its `gates` is
  on: a saved activation recomputed or offloaded (held again from its layer's backward on), a
  gathered parameter copy freed after use (gathered again for its consumer's backward), optimizer
  state kept off the device (the whole step). An item is freed once, whichever gates free it,
  and not when one of its `unless` gates is on;
* `Held`: bytes another tier ("host", "disk") holds when an option is on, against that tier's
  capacity.

`Expr` is linear in the layout choice: a value per choice of some decisions, [a][b] tables of
some edges, and a constant. The ILP (`ilp.py`) turns terms into rows without knowing which
family made them; `evaluate.py` prices any complete assignment from the same terms.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

Gate = tuple[str, int]        # (group key, option index)


@dataclass(frozen=True, slots=True)
class Expr:
    nodes: tuple[tuple[str, tuple[float, ...]], ...] = ()           # (decision, value per choice)
    edges: tuple[tuple[int, tuple[tuple[float, ...], ...]], ...] = ()   # (edge index, [a][b] table)
    const: float = 0.0

    def __add__(self, other: Expr) -> Expr:
        return Expr(self.nodes + other.nodes, self.edges + other.edges, self.const + other.const)

    def scaled(self, k: float, table_scaled: Callable | None = None) -> Expr:
        """k times every value. `table_scaled(table, k)` scales an edge's table where given (a memo:
        `decisions.common.Masked.scaled` hands edges that share a table one scaled copy)."""
        by = table_scaled or scaled_table
        return Expr(tuple((n, tuple(k * v for v in vals)) for n, vals in self.nodes),
                    tuple((e, by(t, k)) for e, t in self.edges), k * self.const)

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


def scaled_table(table, k: float) -> tuple[tuple[float, ...], ...]:
    """k times every entry of an [a][b] table."""
    return tuple(tuple(k * v for v in row) for row in table)


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
    unless: tuple[Gate, ...] = ()  # not paid when one of these is on

    def applies(self, on: Mapping[str, int]) -> bool:
        """Is it paid under the options `on` (group key -> option)?"""
        return on.get(self.gate[0]) == self.gate[1] and not any(on.get(g) == i for g, i in self.unless)


@dataclass(frozen=True, slots=True)
class Freed:
    expr: Expr                    # bytes per device
    gates: tuple[Gate, ...]
    after: int                    # freed at points with timeline position > after ...
    until: int                    # ... and <= until (after < 0: from the start of the step)
    what: str = ""
    key: str = ""                 # the item: terms with one key free the same bytes
    unless: tuple[Gate, ...] = ()    # not freed when one of these is on (another family brought it back)

    def frees(self, on: Mapping[str, int]) -> bool:
        """Is it freed under the options `on` (group key -> option)?"""
        return any(on.get(g) == i for g, i in self.gates) and not any(on.get(g) == i for g, i in self.unless)


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

    def family_of(self) -> dict[str, str]:
        """group key -> its family's name."""
        return {g.key: g.family for g in self.groups}

    def defaults(self) -> dict[str, int]:
        """Every group at its first allowed option."""
        return {g.key: g.allowed[0] for g in self.groups}
