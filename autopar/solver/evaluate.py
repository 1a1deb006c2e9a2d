"""The one price of a complete assignment: a layout per decision and an option per family group.

The ILP (`ilp.py`) is built from the same tables and terms, so for an integral solution its
objective and memory rows equal what `evaluate` returns; the planner's `Plan.estimate`, the
report and `autopar.estimate` all come from here. Works on numbers and on sympy expressions
alike for the layout family's parts (a problem priced at symbolic sizes, `autopar.scaling`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..cost_model.symbolic import smax, ssum
from .families import Families
from .problem import Problem


@dataclass(frozen=True, slots=True)
class Evaluation:
    compute_s: float                  # forward + backward compute of every op
    comm_s: float                     # resharding, forward and the gradients' way back
    family_s: dict[str, float]        # seconds each family adds (recompute, re-gather, offload transfers)
    peak_bytes: float                 # per device: the largest of the forward points and backward rows
    state_bytes: float                # parameters, gradients and optimizer state kept on the device
    points: tuple                     # bytes at each liveness point (forward)
    backward: dict[str, float] = field(default_factory=dict)      # bytes of each backward row
    tiers: dict[str, float] = field(default_factory=dict)         # bytes held in "host" and "disk"
    freed_bytes: dict[str, float] = field(default_factory=dict)   # family -> bytes it frees at the peak point

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s + sum(self.family_s.values())


def evaluate(problem: Problem, choice: Mapping[str, int], options: Mapping[str, int] | None = None) -> Evaluation:
    """Price `choice` (leader -> strategy index) with family `options` (group key -> option index;
    a missing group takes its first allowed option)."""
    fam = problem.families
    on = {**fam.defaults(), **(options or {})}
    state, points = memory_points(problem, choice)
    family_s: dict[str, float] = {}
    for c in fam.costs:
        if on.get(c.gate[0]) == c.gate[1]:
            fam_name = fam.group(c.gate[0]).family
            family_s[fam_name] = family_s.get(fam_name, 0.0) + c.count * max(0.0, c.expr.value(problem, choice))
    freed = [(f, f.expr.value(problem, choice)) for f in fam.freed if any(on.get(g) == i for g, i in f.gates)]
    positions = problem.live.positions
    points = [pt - ssum(b for f, b in freed if f.after < t <= f.until) for pt, t in zip(points, positions)]
    end = points[-1] if points else state
    backward = {key: end + ssum(b for f, b in freed if f.back == key) for key in fam.backs}
    tiers: dict[str, float] = {}
    for h in fam.held:
        if on.get(h.gate[0]) == h.gate[1]:
            tiers[h.tier] = tiers.get(h.tier, 0.0) + h.count * h.expr.value(problem, choice)
    state_dev = state - ssum(b for f, b in freed if f.key.startswith("opt:"))
    peak = smax(state_dev, *points, *backward.values())
    at = max(range(len(points)), key=lambda i: points[i]) if points else -1
    by_family: dict[str, float] = {}
    for f, b in freed:
        if at >= 0 and f.after < positions[at] <= f.until:
            g = next(g for g, i in f.gates if on.get(g) == i)
            by_family[fam.group(g).family] = by_family.get(fam.group(g).family, 0.0) + b
    return Evaluation(compute_total(problem, choice), comm_total(problem, choice), family_s, peak, state_dev,
                      tuple(points), backward, tiers, by_family)


def compute_total(p: Problem, choice: Mapping[str, int]):
    return ssum(d.compute_s[choice[d.leader]] for d in p.decisions.values())


def comm_total(p: Problem, choice: Mapping[str, int]):
    return ssum(e.cost[a][b] for e, a, b in picked_edges(p, choice))


def picked_edges(p: Problem, choice: Mapping[str, int]):
    """(edge, source class, destination class) of every edge under `choice`."""
    for e in p.edges:
        a = e.a_of[choice[p.decisions[e.src].leader]]
        b = 0 if e.dst == "output" else e.b_of[choice[p.decisions[e.dst].leader]]
        yield e, a, b


def memory_points(p: Problem, choice: Mapping[str, int]):
    """(parameter state bytes, total bytes at each liveness point) under a layout choice, before
    any family frees anything."""
    picked = [(e.dst_pos, e.saved[a][b], e.temp[a][b] if e.temp else 0.0) for e, a, b in picked_edges(p, choice)]
    state = ssum(d.state_bytes[choice[d.leader]] for d in p.decisions.values())
    points = []
    for live, where in zip(p.live.points, p.live.positions):
        acts = ssum(p.decisions[n].act_bytes[choice[p.decisions[n].leader]] for n in live)
        copies = ssum(b for pos, b, _ in picked if pos <= where)
        temps = ssum(t for pos, _, t in picked if pos == where)
        points.append(state + acts + copies + temps)
    return state, points


def effective_options(problem: Problem, choice: Mapping[str, int], options: Mapping[str, int]) -> dict[str, int]:
    """`options`, with every group whose option does nothing under `choice` (frees, holds and costs
    nothing: re-gathering a parameter that is never gathered) set back to its default, so that a
    plan records, and the runtime runs, only what matters. The price is unchanged."""
    fam = problem.families
    out = {**fam.defaults(), **options}
    busy = {c.gate for c in fam.costs if c.expr.value(problem, choice) > 0}
    busy |= {h.gate for h in fam.held if h.expr.value(problem, choice) > 0}
    busy |= {g for f in fam.freed if f.expr.value(problem, choice) > 0 for g in f.gates}
    for g in fam.groups:
        if out[g.key] != g.allowed[0] and (g.key, out[g.key]) not in busy:
            out[g.key] = g.allowed[0]
    return out


def chosen_options(fam: Families, options: Mapping[str, int]) -> dict[str, dict[str, str]]:
    """family -> {plan key -> option name}: what a plan records (`Plan.recompute`, ...)."""
    out: dict[str, dict[str, str]] = {}
    for g in fam.groups:
        name = g.options[options.get(g.key, g.allowed[0])]
        for m in g.members:
            out.setdefault(g.family, {})[m] = name
    return out


def recorded_options(fam: Families, recorded: Mapping[str, Mapping[str, str]]) -> dict[str, int]:
    """The group options a plan records (family -> {member: option name}; `chosen_options` inverted).
    A member the record does not name takes its group's default."""
    out = {}
    for g in fam.groups:
        names = sorted({recorded.get(g.family, {}).get(m) for m in g.members} - {None})
        if len(names) > 1:
            raise ValueError(f"the plan gives {g.family} options {names} to {', '.join(g.members)}, which are "
                             f"linked (repeated layers share one decision): give them one option")
        if names and names[0] not in g.options:
            raise ValueError(f"{g.family} option {names[0]!r} for {g.members[0]} is not one of {g.options}")
        out[g.key] = g.options.index(names[0]) if names else g.allowed[0]
    return out
