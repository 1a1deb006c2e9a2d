"""The one price of a complete assignment: a layout per decision and an option per family group.

The ILP (`ilp.py`) is built from the same tables and terms, so for an integral solution its
objective and memory rows equal what `evaluate` returns; the planner's `Plan.estimate`, the
report and `autopar.estimate` all come from here. Works on numbers and on sympy expressions
alike for the layout family's parts (a problem priced at symbolic sizes, `autopar.scaling`).
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..cost_model.comm import bucket_launch_time
from ..cost_model.compute import optimizer_seconds
from ..cost_model.symbolic import Poly2, smax, ssum
from ..passes.rewrite import output_modules, reshards_edge
from .families import Families
from .problem import Problem


@dataclass(frozen=True, slots=True)
class Evaluation:
    compute_s: float                  # forward + backward compute of every op
    comm_s: float                     # resharding, forward and the gradients' way back
    family_s: dict[str, float]        # seconds each family adds (recompute, re-gather, offload transfers)
    peak_bytes: float                 # per device: the largest of the points and the state after the backward
    state_bytes: float                # parameters, gradients and optimizer state kept on the device
    points: tuple                     # bytes at each liveness point (forward and backward)
    tiers: dict[str, float] = field(default_factory=dict)         # bytes held in "host" and "disk"
    freed_bytes: dict[str, float] = field(default_factory=dict)   # family -> bytes it frees at the peak point
    grad_sync_s: float = 0.0          # gradient synchronisation: its part of comm_s plus grad_buckets_s
    grad_buckets_s: float = 0.0       # the gradient buckets' latencies and launches (per step, not in comm_s)
    optimizer_s: float = 0.0          # the optimizer step on the device (offloaded parameters: family_s)
    runtime_s: float = 0.0            # autopar runtime's per-node cost (profile.runtime_op_overhead)
    graph_nodes: int = 0              # modules of the rank's graph (LocalOp, Reshard, ...)

    @property
    def objective_s(self) -> float:
        """What the ILP minimises: compute, communication and the families' seconds (the step less
        the optimizer step, the runtime's per-node cost and the gradient buckets' launches, which
        layouts barely move: a gradient's own transfer is in its edge's cost)."""
        return self.compute_s + self.comm_s + sum(self.family_s.values())

    @property
    def step_s(self) -> float:
        return self.objective_s + self.grad_buckets_s + self.optimizer_s + self.runtime_s


def evaluate(problem: Problem, choice: Mapping[str, int], options: Mapping[str, int] | None = None) -> Evaluation:
    """Price `choice` (leader -> strategy index) with family `options` (group key -> option index;
    a missing group takes its first allowed option)."""
    fam = problem.families
    on = {**fam.defaults(), **(options or {})}
    family_of = fam.family_of()
    state, points = memory_points(problem, choice)
    family_s: dict[str, float] = {}
    for c in fam.costs:
        if on.get(c.gate[0]) == c.gate[1]:
            fam_name = family_of[c.gate[0]]
            family_s[fam_name] = family_s.get(fam_name, 0.0) + c.count * smax(0.0, c.expr.value(problem, choice))
    freed = [(f, f.expr.value(problem, choice)) for f in fam.freed if f.frees(on)]
    positions = problem.live.positions
    points = [pt - ssum(b for f, b in freed if f.after < t <= f.until) for pt, t in zip(points, positions)]
    tiers: dict[str, float] = {}
    for h in fam.held:
        if on.get(h.gate[0]) == h.gate[1]:
            tiers[h.tier] = tiers.get(h.tier, 0.0) + h.count * h.expr.value(problem, choice)
    state_dev = state - ssum(b for f, b in freed if f.after < 0)      # kept off the device the whole step
    if isinstance(state_dev, Poly2):      # memory as polynomials in B and S (`autopar.scaling`): no one peak
        peak, at = None, -1
    else:
        peak = smax(state_dev, *points)
        at = max(range(len(points)), key=lambda i: points[i]) if points else -1
    by_family: dict[str, float] = {}
    for f, b in freed:
        if at >= 0 and f.after < positions[at] <= f.until:
            g = next(g for g, i in f.gates if on.get(g) == i)
            by_family[family_of[g]] = by_family.get(family_of[g], 0.0) + b
    offloaded = {name for f, _ in freed if f.after < 0 for name, _ in f.expr.nodes}
    nodes = graph_nodes(problem, choice)
    buckets = grad_buckets_total(problem, choice)
    return Evaluation(compute_total(problem, choice), comm_total(problem, choice), family_s, peak, state_dev,
                      tuple(points), tiers, by_family, grad_sync_total(problem, choice) + buckets, buckets,
                      optimizer_total(problem, choice, offloaded), nodes * problem.mesh.profile.runtime_op_overhead,
                      nodes)


def compute_total(p: Problem, choice: Mapping[str, int]):
    return ssum(d.compute_s[choice[d.leader]] for d in p.decisions.values())


def comm_total(p: Problem, choice: Mapping[str, int]):
    return ssum(e.cost[a][b] for e, a, b in picked_edges(p, choice))


def grad_sync_total(p: Problem, choice: Mapping[str, int]):
    """Seconds of the gradient legs of parameter edges in the edge tables: a gradient reduced in a
    bucket its transfer (less what the backward hides), any other its own collectives."""
    return ssum(e.cost[a][b] - e.fwd[a][b] for e, a, b in picked_edges(p, choice)
                if p.decisions[e.src].kind == "param" and e.fwd is not None)


def grad_buckets_total(p: Problem, choice: Mapping[str, int]) -> float:
    """The gradient buckets' latencies and launches per step (runtime/grad_sync.py): the bucketed
    gradients' bytes summed per bucket kind, `profile.grad_bucket_bytes` to a bucket."""
    per_kind: dict = {}
    for e, a, b in picked_edges(p, choice):
        if e.sync is not None and e.sync[a][b] is not None:
            kind, nbytes = e.sync[a][b]
            per_kind[kind] = per_kind.get(kind, 0.0) + nbytes
    prof = p.mesh.profile
    launch = prof.kernel_overhead + prof.collective_overhead        # per collective, as Mesh.reshard_cost
    return sum(bucket_launch_time(k, nb, prof.grad_bucket_bytes, launch) for k, nb in per_kind.items())


def optimizer_total(p: Problem, choice: Mapping[str, int], offloaded=frozenset()) -> float:
    """The optimizer step on the device over every parameter whose state is not offloaded."""
    params = [d for d in p.decisions.values() if d.kind == "param" and d.name not in offloaded]
    total = 0.0
    for mixed in (False, True):      # one fused step over the parameters of each precision
        group = [d for d in params if d.mixed == mixed]
        if group:
            total += optimizer_seconds(ssum(d.elements[choice[d.leader]] for d in group), len(group),
                                       p.mesh.profile, p.optimizer, mixed)
    return total


def graph_nodes(p: Problem, choice: Mapping[str, int]) -> int:
    """Modules of the rank's graph the runtime runs per step (passes/rewrite.py): one per op but
    getitem, a Reshard per edge that needs one, two per graph output."""
    n = sum(1 for d in p.decisions.values() if d.kind == "op" and d.facts.op != "getitem")
    for e, a, b in picked_edges(p, choice):
        src = p.decisions[e.src]
        if e.dst == "output":
            n += output_modules(False)
        else:
            t = p.decisions[e.dst].strategies[choice[p.decisions[e.dst].leader]]
            n += int(reshards_edge(src.kind, tuple(src.strategies[choice[src.leader]].output),
                                   tuple(t.inputs[e.slot])))
    return n


def picked_edges(p: Problem, choice: Mapping[str, int]):
    """(edge, source class, destination class) of every edge under `choice`."""
    for e in p.edges:
        a = e.a_of[choice[p.decisions[e.src].leader]]
        b = 0 if e.dst == "output" else e.b_of[choice[p.decisions[e.dst].leader]]
        yield e, a, b


def memory_points(p: Problem, choice: Mapping[str, int]):
    """(training state bytes, total bytes at each liveness point of the step) under a layout
    choice, before any family frees anything (`cost_model.memory`: forward and backward points).
    No gradient exists before the backward (the optimizer's zero_grad sets them to None): the
    forward's points count the state less them, a backward point the parameter gradients made so
    far and the activation gradients in flight; the state in full is the memory after the backward."""
    live = p.live
    picked = sorted(((e.dst_pos, e.saved[a][b], e.temp[a][b] if e.temp else 0.0) for e, a, b in picked_edges(p, choice)),
                    key=lambda x: x[0])
    state = ssum(d.state_bytes[choice[d.leader]] for d in p.decisions.values())
    grads = sorted(((p.grad_since(n), d.grad_bytes[choice[d.leader]]) for n, d in p.decisions.items()
                    if d.grad_bytes), key=lambda x: x[0])
    fwd_state = state - ssum(b for _, b in grads)
    copies, copy_at = _prefix([b for _, b, _ in picked]), [pos for pos, _, _ in picked]
    made, made_at = _prefix([b for _, b in grads]), [since for since, _ in grads]
    temps: dict = {}
    for pos, _, t in picked:
        temps[pos] = temps.get(pos, 0.0) + t
    points = []
    for owners, flight, where in zip(live.points, live.grads or [()] * len(live.points), live.positions):
        acts = ssum(act_bytes(p, n, choice) for n in (*owners, *flight))
        total = fwd_state + acts + copies[bisect_right(copy_at, live.mirror(where))] + temps.get(where, 0.0)
        points.append(total + made[bisect_right(made_at, where)] if where > live.last else total)
    return state, points


def _prefix(values) -> list:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def act_bytes(p: Problem, name: str, choice: Mapping[str, int]):
    d = p.decisions[name]
    return d.act_bytes[choice[d.leader]]


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
