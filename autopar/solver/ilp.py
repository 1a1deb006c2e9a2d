"""The strategy ILP (after Alpa's intra-operator pass, with liveness-based memory).

Sets: leaders l (decisions), their choices i; edges e between decisions with source layout
classes a and destination classes b; liveness points t.

    minimise   sum_l sum_i C[l,i] x[l,i]  +  sum_e sum_{a,b} c_e[a,b] y[e,a,b]
    subject to
    (A) one_choice[l]:     sum_i x[l,i] = 1
    (B) edge_src[e,a]:     sum_b y[e,a,b] = sum_{i: a_e(i) = a} x[src(e), i]
    (C) edge_dst[e,b]:     sum_a y[e,a,b] = sum_{j: b_e(j) = b} x[dst(e), j]
    (D) memory[t]:         sum_l sum_i (S[l,i] + A_t[l,i]) x[l,i] + sum_{e: pos(dst e) <= t} k[e]
                           + sum_{e: pos(dst e) = t} u[e]  <= M - F_t
    (E) copy_bytes[e]:     k[e] = sum_{a,b} K_e[a,b] y[e,a,b]
    (F) temp_bytes[e]:     u[e] = sum_{a,b} T_e[a,b] y[e,a,b]
        x binary, 0 <= y <= 1, k, u >= 0

C[l,i]: compute seconds (forward + backward) of every node merged into l when l picks i;
c_e[a,b]: seconds to reshard forward plus to return the gradient; S: parameter, gradient and
optimizer bytes; A_t: bytes of the activations live at point t; K_e: bytes of the resharded
copy a consumer keeps for its backward (a weight gathered for use); T_e: bytes of a resharded
copy it does not keep (a collective's output), alive while the consumer runs; M: the per-device
budget; at the backward's points (D) also holds the gradient buckets' buffers, min(bucketed
bytes, three buckets) (`cost_model.memory.buckets_in_flight_bytes`): where no layouts bucket more
than three buckets' worth, the bucketed bytes, linear in y; otherwise F_t, the three buckets, a
constant (exact once the chosen layouts bucket that much, an upper bound below:
`memory_rows.MemoryRows._buckets`).
(B) and (C) make y the product x[src,i] x[dst,j] aggregated over layout classes, which
linearises the edge cost exactly when x is integral. An edge with one class on either side
is linear in the other side's x and needs no y. Pins remove choices before the ILP.

The objective is `Evaluation.objective_s` of the solution (`evaluate.py`): the step less the
optimizer step and the runtime's per-node cost, which the layouts barely move.

The other decision families (recomputation, residency, offload) add option variables g, gated
cost terms w, freed bytes z and tier bytes v, rows (G)-(L): `ilp_terms.py` states them. (D) then
subtracts the bytes freed at each point; the objective adds the families' seconds. The points t
run over the whole step (`cost_model.memory`): the backward's points also hold the gradients in
flight and the parameter gradients made so far, and keep a copy k[e] until its consumer's backward.

The model is written as arrays (`mip.py`) and solved by HiGHS through highspy (CBC through pulp
where highspy is missing). `solve.solve` first runs the alternation of `heuristic.py`: layouts with the
family options fixed (no products of layout and option columns: the layout model's size) and
options with the layouts fixed (a few dozen binaries), each optimal for the other. That plan is
the floor, so a longer time limit never gives a slower plan. The joint model above starts from it
where the layout model is small (`solve.JOINT_MAX_COLUMNS`); on larger ones the alternation's plan is the
answer, and its status says so. Memory rows (D) are added lazily when the budget is far from
binding: the model is solved without the rows that the start's slack shows to be loose, and any
row the solution violates is added and the model re-solved. A large MIP first solves its LP
relaxation and rounds it: within the MIP gap of the relaxation's bound, that plan is the answer
(`StrategyILP.solve_lazy`).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from ..errors import InfeasibleError
from .branch import branch
from .evaluate import evaluate
from .families import Families
from .ilp_terms import FamilyTerms
from .memory_rows import GIB, MemoryRows
from .mip import INF, MIP_GAP, Defined, Mip, MipResult
from .problem import Problem

# HiGHS and CBC accept a MIP row within 1e-6 of its bound (their MIP feasibility tolerance); memory
# rows are in GiB, so a plan up to ~1.07 kB over the budget could pass. The budget rows are
# tightened by twice that, and `min_memory` adds it, so a budget of `min_memory_bytes` fits.
FEASIBILITY_SLACK_BYTES = 2e-6 * GIB
ROW_TOLERANCE = 1e-9  # GiB: a row is violated beyond the solver's own feasibility tolerance
LAZY_ROWS = 10      # memory rows added per round (the most violated first): a few rounds on real models
LAZY_FROM = 200     # fewer memory rows than this are all added at once (a small model's rounds cost more)
# A MIP of this many columns or more first rounds its LP relaxation (`StrategyILP.solve_lazy`): HiGHS's
# MIP costs seconds there (Llama-3-8B over 64 devices, 68k columns: 1.0-1.5 s against the LP's 0.09 s);
# the option models (3k columns) and the test models' MIPs take it hundredths of a second.
ROUND_FROM = 10_000


@dataclass(frozen=True, slots=True)
class SolveResult:
    choice: dict[str, int]
    objective: float
    status: str
    solver: str
    seconds: float
    n_variables: int
    n_constraints: int
    gap: float = 0.0          # relative MIP gap proven at the stop (0 when optimal)
    options: dict[str, int] = field(default_factory=dict)   # family group -> chosen option


class StrategyILP:
    """The model above, written into a `Mip` with one coefficient dict per row. `rep` maps each
    decision to the representative whose variables it uses: decisions of repeated layers share
    one set (see `layers.py`), so their costs add up on one variable and edges with the same ends
    and tables share one y."""

    def __init__(self, problem: Problem, memory_budget: float, *, choice: Mapping[str, int] | None = None,
                 options: Mapping[str, int] | None = None, shared: dict | None = None,
                 allowed: Mapping[str, tuple[int, ...]] | None = None, memo: dict | None = None):
        """`choice` (leader -> strategy): the layouts are fixed, only family options are decided (a
        small model); `options` (group -> option): the family options are fixed, only layouts are
        decided (no products of layout and option variables). Neither: the joint model. `allowed`
        (representative leader -> strategy indices; `prune.py`): x columns for those choices only (a
        leader it leaves out keeps all). `shared`: a dict the caller keeps for every model of this
        problem with the same `choice` and `allowed` (their layout columns are the same): what depends
        on those columns alone is worked out once. `memo`: a dict the caller keeps for every model of this
        problem: what depends on the problem alone (`FamilyTerms._alike`)."""
        p = self.p = problem
        self.shared = {} if shared is None else shared
        self.memo = {} if memo is None else memo
        self.budget = memory_budget
        self.m = Mip()
        self.defs: dict[int, Defined] = {}       # auxiliary columns -> how an assignment sets them
        self.rep = {l: p.rep.get(l, l) for l in p.leaders}
        self.x: dict[str, dict[int, int]] = {}   # per representative: strategy index -> column
        self.group_of: list[tuple] = []          # per edge: its group key (src, dst, group number)
        self.y: dict[tuple, dict[tuple[int, int], int]] = {}   # group -> (a, b) -> column
        self.linear: dict[tuple, tuple[str, int]] = {}   # group without y -> ("src", b) | ("dst", a) | ("same", 0)
        self.copy_bytes: dict[tuple, int] = {}   # (E) per group: GiB of its kept copy
        self.temp_bytes: dict[tuple, int] = {}   # (F) per group: GiB of its temporary copy
        self.choice = choice
        self.add_layouts(choice, allowed or {})
        self.m.presolve = choice is not None        # layouts fixed: presolve removes nearly every row
        self.terms = FamilyTerms(self, options)
        self.memory: MemoryRows | None = None           # (D) rows by point, in GiB (added lazily)
        self.memory_added: dict[int, int] = {}          # point -> its row in the model

    def var(self, leader: str) -> dict[int, int]:
        return self.x[self.rep[leader]]

    def add_aux(self, d: Defined, hi: float = INF) -> int:
        j = self.m.add_col(0, hi)
        self.defs[j] = d
        return j

    _LAYOUT = ("x", "group_of", "y", "linear", "copy_bytes", "temp_bytes")     # what (A)-(C), (E), (F) set

    def add_layouts(self, choice: Mapping[str, int] | None, allowed: Mapping[str, tuple[int, ...]]) -> None:
        """The layout columns and rows (A)-(C), (E), (F): written once for all models sharing them
        (`shared`), each later one starting from a copy (they are the same for any fixed options)."""
        if "layouts" in self.shared:
            m, defs, named = self.shared["layouts"]        # read only: every model takes its own copy of m
            self.m, self.defs = m.copy(), dict(defs)
            for k, v in named.items():
                setattr(self, k, v)
            return
        # x: per representative, strategy index -> column (only the chosen one when `choice` is given)
        self.x = {r: {i: self.m.add_col(0, 1, integral=True)
                      for i in ((choice[r],) if choice is not None else allowed.get(r, range(self.p.n_choices(r))))}
                  for r in dict.fromkeys(self.rep.values())}
        self.add_one_choice()
        self.add_edges()
        self.shared["layouts"] = (self.m.copy(), dict(self.defs), {k: getattr(self, k) for k in self._LAYOUT})

    # (A)
    def add_one_choice(self) -> None:
        for v in self.x.values():
            self.m.add_row(dict.fromkeys(v.values(), 1.0), 1.0, 1.0)

    def _ends(self, e) -> tuple[str, str | None]:
        src = self.rep[self.p.decisions[e.src].leader]
        dst = None if e.dst == "output" else self.rep[self.p.decisions[e.dst].leader]
        return src, dst

    # (B), (C): one y per group of edges with the same ends and layout classes
    def add_edges(self) -> None:
        m = self.m
        numbers: dict[tuple, tuple] = {}    # (ends, layout classes) -> key: a short key, quick to hash
        for e in self.p.edges:
            src, dst = self._ends(e)
            key = numbers.setdefault((src, dst, tuple(e.a_of), tuple(e.b_of)), (src, dst, len(numbers)))
            self.group_of.append(key)
            if key in self.y or key in self.linear:
                continue
            a_used = sorted({e.a_of[i] for i in self.x[src]})
            b_used = [0] if dst is None else sorted({e.b_of[j] for j in self.x[dst]})
            if dst == src:
                self.linear[key] = ("same", 0)
            elif len(b_used) == 1:       # linear in the source's x
                self.linear[key] = ("src", b_used[0])
            elif len(a_used) == 1:       # linear in the consumer's x
                self.linear[key] = ("dst", a_used[0])
            if key in self.linear:
                continue
            y = self.y[key] = {(a, b): m.add_col(0, 1) for a in a_used for b in b_used}
            for a in a_used:
                row = {y[a, b]: 1.0 for b in b_used}
                row.update((x, -1.0) for i, x in self.x[src].items() if e.a_of[i] == a)
                m.add_row(row, 0.0, 0.0)
            for b in b_used:
                row = {y[a, b]: 1.0 for a in a_used}
                row.update((x, -1.0) for j, x in self.x[dst].items() if e.b_of[j] == b)
                m.add_row(row, 0.0, 0.0)
            # (E), (F): memory rows then name one variable instead of every y (in GiB, like the rows)
            for table, out in ((e.saved, self.copy_bytes), (e.temp, self.temp_bytes)):
                if table and any(any(r) for r in table):
                    coef = {v: table[a][b] / GIB for (a, b), v in y.items() if table[a][b]}
                    kv = self.add_aux(Defined(coef))
                    m.add_row({kv: 1.0, **{j: -c for j, c in coef.items()}}, 0.0, 0.0)
                    out[key] = kv

    def add_edge_terms(self, coef: dict, k: int, table: list[list[float]], scale: float = 1.0) -> None:
        """coef += scale * sum_{a,b} table[a][b] [edge k's source picks a and its consumer b]."""
        for v, c in self.edge_coefs(k, table):
            coef[v] = coef.get(v, 0.0) + scale * c

    def edge_coefs(self, k: int, table: list[list[float]]) -> tuple:
        """(column, coefficient) of table's nonzero entries on edge k's variables (y, or the x of the
        side it is linear in). Edges of one group (a linked layer's copies) and one table have the same
        terms: worked out once for all models sharing the layout columns."""
        known = self.shared.setdefault("edge_coefs", {})
        key = (self.group_of[k], id(table))
        if key not in known:
            known[key] = (table, tuple(self._edge_terms(k, table)))    # the table is kept: its id stays its own
        return known[key][1]

    def _edge_terms(self, k: int, table: list[list[float]]):
        e, key = self.p.edges[k], self.group_of[k]
        if key in self.y:
            terms = ((v, table[a][b]) for (a, b), v in self.y[key].items())
        else:
            how, fixed = self.linear[key]
            if how == "same":       # both ends on one variable set: linear in it
                terms = ((v, table[e.a_of[i]][e.b_of[i]]) for i, v in self.x[key[0]].items())
            elif how == "src":
                terms = ((v, table[e.a_of[i]][fixed]) for i, v in self.x[key[0]].items())
            else:
                terms = ((v, table[fixed][e.b_of[j]]) for j, v in self.x[key[1]].items())
        return ((v, c) for v, c in terms if c)

    def _node_terms(self, coef: dict, field: str, names, scale: float = 1.0) -> None:
        for name in names:
            d = self.p.decisions[name]
            vals = getattr(d, field)
            for i, v in self.var(d.leader).items():
                if vals[i]:
                    coef[v] = coef.get(v, 0.0) + scale * vals[i]

    def set_objective(self) -> None:
        if "objective" not in self.shared:       # the layouts' part: compute and resharding seconds
            coef: dict = {}
            self._node_terms(coef, "compute_s", self.p.decisions)
            for k, e in enumerate(self.p.edges):
                self.add_edge_terms(coef, k, e.cost)
            self.shared["objective"] = coef
        coef = dict(self.shared["objective"])
        self.terms.objective_terms(coef)
        for j, c in coef.items():
            self.m.cost[j] += c

    # (D) and (L)
    def add_memory(self) -> None:
        prof = self.p.mesh.profile
        self.terms.add_tiers({"host": prof.host_memory_capacity, "disk": prof.disk_capacity})
        if self.budget == INF:
            return
        self.memory = MemoryRows(self)
        if len(self.memory) < LAZY_FROM:
            self.add_memory_rows(range(len(self.memory)))

    def add_memory_rows(self, points) -> None:
        """Add the memory rows (D) of these points (all of a small model's; those another model of
        the same problem found binding), in this order, unless added already."""
        if self.memory is None:
            return
        cap = (self.budget - FEASIBILITY_SLACK_BYTES) / GIB
        new = [t for t in points if 0 <= t < len(self.memory) and t not in self.memory_added]
        rows = self.memory.rows(new)
        for t in new:
            self.memory_added[t] = self.m.add_row(rows[t], -INF, cap - self.memory.fixed[t] / GIB)

    def build(self) -> None:
        self.add_memory()
        self.set_objective()
        self.terms.tighten([*self.x.values(), *self.y.values()])

    def solve_lazy(self, deadline: float | None, start: list[float] | None = None, progress: bool = False,
                   relax: bool = False) -> MipResult:
        """Solve with the memory rows (D) added as they are violated (`_solve_rows`). A MIP first
        solves its LP relaxation (rows added alike) and rounds it, each decision at its largest fraction
        (`assignment`, then `values_of`): where the rounded plan satisfies every row and is within
        MIP_GAP of the relaxation's bound, it is the answer, with the guarantee the MIP solver's own
        stop gives (on Llama-3-8B over 64 devices the relaxation leaves 2 of 2,967 binaries
        fractional: 0.09 s against 1.0-1.5 s for HiGHS's MIP, the same plan); otherwise it starts the
        MIP where it is better than `start`. Models of fewer than ROUND_FROM columns go to the MIP
        straight away (their MIPs take HiGHS hundredths of a second).
        `relax`: the LP relaxation only."""
        if relax or not self.m.integer or self.m.n_cols < ROUND_FROM:
            return self._solve_rows(deadline, start, progress, relax)
        lp = self._solve_rows(deadline, None, progress, True)
        if lp.values is None:
            return lp if lp.status == "Infeasible" else self._solve_rows(deadline, start, progress, False)
        values = self.rounded(lp.values)
        if values is not None:
            obj = self.m.objective(values)
            answer = _rounded_answer(values, obj, lp)
            if answer is not None:
                return answer
            if start is None or obj < self.m.objective(start):
                start = values
        if lp.solver == "HiGHS":      # a few LPs branching on the relaxation's fractional columns (`branch.py`)
            b = branch(self.m, start, self.rounded, deadline, first=self.terms.weights())
            if b.proven:
                return MipResult(b.values, b.objective, f"Optimal (branched on the LP relaxation: {b.lps} LPs, gap "
                                                        f"{b.gap:.2%})", lp.solver, b.gap)
            start = b.values
        return self._solve_rows(deadline, start, progress, False)

    def rounded(self, values: list[float]) -> list[float] | None:
        """The plan of an LP solution, each decision at its largest fraction (`assignment`), as column
        values; None where it breaks a row (a memory row left out of the model included)."""
        out = self.values_of(*self.assignment(values))
        return out if self.m.violation(out) <= ROW_TOLERANCE and not self.violated(out) else None

    def violated(self, values: list[float]) -> list[int]:
        """The memory points (D) not in the model whose rows `values` break, the most violated first."""
        if self.memory is None:
            return []
        cap = (self.budget - FEASIBILITY_SLACK_BYTES) / GIB
        over = sorted(((v - cap, t) for t, v in enumerate(self.memory.values(values)) if t not in self.memory_added),
                      reverse=True)
        return [t for v, t in over if v > ROW_TOLERANCE]

    def _solve_rows(self, deadline: float | None, start: list[float] | None, progress: bool,
                    relax: bool) -> MipResult:
        """Solve with the rows found binding so far, add the most violated of the others, re-solve,
        until none is violated. Each round solved to optimality makes the last one optimal for the
        whole model (it satisfies every row and is optimal for a subset). Rows once added stay for
        later calls. `start` must satisfy every row."""
        m = self.m
        while True:
            limit = None if deadline is None else max(deadline - time.perf_counter(), 1e-3)
            what = f"{m.n_cols} variables, {m.n_rows} constraints" if progress else None
            r = m.solve(limit, start, what, relax)
            if r.values is None:
                return r
            over = self.violated(r.values)
            if not over:
                return r
            self.add_memory_rows(over[:LAZY_ROWS])
            if deadline is not None and time.perf_counter() >= deadline:
                return MipResult(None, INF, "Not solved (memory rows left violated at the time limit)", r.solver)

    # -- complete assignments <-> column values --------------------------------------------------

    def values_of(self, choice: dict[str, int], options: dict[str, int]) -> list[float]:
        """The column values of a complete assignment (a start for the solver)."""
        val = [0.0] * self.m.n_cols
        picked = {r: choice[r] for r in self.x}
        for r, cols in self.x.items():
            val[cols[picked[r]]] = 1.0
        for k, e in enumerate(self.p.edges):
            key = self.group_of[k]
            if key in self.y:
                val[self.y[key][e.a_of[picked[key[0]]], e.b_of[picked[key[1]]]]] = 1.0
        for key, cols in self.terms.g.items():
            val[cols[options[key]]] = 1.0
        for j, d in sorted(self.defs.items()):
            if d.product is not None:
                val[j] = val[d.product[0]] * val[d.product[1]]
                continue
            if d.gates is not None and not any(val[g] > 0.5 for g in d.gates):
                continue
            if any(val[g] > 0.5 for g in d.unless):
                continue
            v = d.const + sum(c * val[i] for i, c in d.coef.items())
            val[j] = max(0.0, v) if d.clamp else v
        return val

    def assignment(self, values: list[float]) -> tuple[dict[str, int], dict[str, int]]:
        """(choice per leader, option per group) of a solution."""
        picked = {r: max(v, key=lambda i: values[v[i]]) for r, v in self.x.items()}
        choice = {l: picked[self.rep[l]] for l in self.p.leaders}
        return choice, self.terms.options(values)

    def solve_from(self, start, deadline: float | None, t0: float, progress: bool = False) -> SolveResult:
        """The joint model's best plan by `deadline`, never worse than the heuristic `start`
        (`heuristic.Heuristic` or None), which also starts the solver."""
        self.build()
        plan = None if start is None else start.plan
        r = self.solve_lazy(deadline, None if plan is None else self.values_of(*plan), progress)
        secs = time.perf_counter() - t0
        if r.values is None and plan is None:
            if r.status == "Infeasible":
                raise infeasible(self.p, self.budget, min_memory(self.p))
            return self.fallback(r.status, r.solver, secs)
        if plan is not None and (r.values is None or start.objective_s
                                 < evaluate(self.p, *self.assignment(r.values)).objective_s * (1 - 1e-9)):
            note = "the heuristic plan" if r.values is None else "the heuristic plan, better than the solver's"
            return SolveResult(plan[0], start.objective_s, f"Feasible ({note}; solver: {r.status})", r.solver,
                               secs, self.m.n_cols, self.m.n_rows, known_gap(r.gap), plan[1])
        choice, options = self.assignment(r.values)
        return SolveResult(choice, r.objective, r.status, r.solver, secs, self.m.n_cols, self.m.n_rows,
                           known_gap(r.gap), options)

    def fallback(self, status: str, name: str, secs: float) -> SolveResult:
        """The solver stopped with no plan: every decision takes its smallest-memory strategy (the
        most sharded) and every family group its last allowed option (the options are ordered
        from keeping most to freeing most), so the search always ends with a plan that fits if any
        simple one does."""
        p = self.p
        choice = most_sharded(p)
        options = {g.key: g.allowed[-1] for g in p.families.groups}
        ev = evaluate(p, choice, options)
        if ev.peak_bytes > self.budget:
            raise InfeasibleError(f"the solver stopped without a plan (status {status}) and the most sharded "
                                  f"plan needs {ev.peak_bytes / GIB:.2f} GiB per device: raise time_limit or "
                                  f"memory_budget")
        return SolveResult(choice, ev.step_s, f"Heuristic (solver: {status})", name, secs,
                           self.m.n_cols, self.m.n_rows, known_gap(float("nan")), options)


def infeasible(problem: Problem, budget: float, need: float, cut: bool = False) -> InfeasibleError:
    """The error for a budget below `need`, the smallest that fits a plan found (`min_memory`); `cut`: the
    least-memory search stopped at the time limit."""
    proven = not cut and not any(len(g.allowed) > 1 for g in problem.families.groups)
    needs = (f"this model needs at least {readable_bytes(need)} per device ({need:.0f} bytes)" if proven else
             f"the least-memory plan found by the time limit needs {readable_bytes(need)} per device ({need:.0f} "
             f"bytes; the search stopped there: raise time_limit)" if cut else
             f"the least-memory plan found needs {readable_bytes(need)} per device ({need:.0f} bytes; layouts "
             f"and memory options alternated, not proven the least)")
    return InfeasibleError(f"no plan fits {readable_bytes(budget)} per device on mesh {problem.mesh.shape}: {needs}. "
                           f"Raise memory_budget, use a larger mesh, or a smaller batch.", need)


def readable_bytes(n: float) -> str:
    """GiB to 3 decimals where that shows the size (0.001 GiB and up); smaller sizes in KiB or bytes."""
    if n >= 2**30 / 1000:
        return f"{n / 2**30:.3f} GiB"
    return f"{n / 2**10:.3f} KiB" if n >= 2**10 else f"{n:.0f} bytes"


def known_gap(gap: float) -> float:
    """The gap a plan records: a number (1.0, i.e. 100%, where the solver proved no bound)."""
    return gap if math.isfinite(gap) else 1.0


def most_sharded(p: Problem, allowed: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, int]:
    """Every decision at its smallest-memory strategy (among its representative's `allowed` ones)."""
    members: dict[str, list] = {}
    for d in p.decisions.values():
        members.setdefault(d.leader, []).append(d)
    choice = {}
    for l in p.leaders:
        mem = [sum(d.state_bytes[i] + d.act_bytes[i] for d in members[l]) for i in range(p.n_choices(l))]
        among = (allowed or {}).get(p.rep.get(l, l), range(len(mem)))
        choice[l] = min(among, key=lambda i: (mem[i], i))
    return choice


LP_BOUND_SLACK = 1e-6     # relative: HiGHS's LP optimum is within its tolerances (1e-7) of the true minimum


def least_seconds(problem: Problem, deadline: float | None = None) -> float:
    """A lower bound on `Evaluation.objective_s` of every plan of `problem` the solver can return (any
    layouts, repeated layers sharing theirs as `Problem.rep` links them; any family options and
    budget; its step adds only seconds >= 0): the LP relaxation of the layout ILP without memory
    rows or families, whose objective is the compute and resharding seconds (the families' seconds,
    `smax(0, ...)`, are >= 0 and the budget only removes plans). 0.0 where the LP is not solved to
    its optimum (`deadline` cut it). On GPT-3 175B without a pipeline over (16, 8, 8) H100 (263k columns),
    1 CPU s: 7.97 s, where the plan found steps 10.2 s and the compute floor
    (`cost_model.screen.pipeline_floor`) is 4.34 s."""
    if past(deadline):
        return 0.0
    ilp = StrategyILP(replace(problem, families=Families()), INF)
    ilp.build()
    r = ilp.solve_lazy(deadline, relax=True)
    return max(r.objective, 0.0) * (1 - LP_BOUND_SLACK) if r.status == "Optimal" else 0.0


LEAST_ROUNDS = 4     # alternation rounds of `least_memory` at most (the test models settle in one)


@dataclass(frozen=True, slots=True)
class Least:
    """`least_memory`'s answer: the plan, the budget it needs (`min_memory`), and whether the deadline cut
    the search (then a plan that fits its `need`, not the least the search would find)."""
    plan: tuple[dict[str, int], dict[str, int]]
    need: float
    cut: bool = False


def least_memory(problem: Problem, allowed: Mapping[str, tuple[int, ...]] | None = None,
                 first: Callable[[dict[str, int]], dict[str, int]] | None = None, enough: float = 0.0,
                 deadline: float | None = None) -> Least:
    """The plan that needs least memory and the budget it needs (`min_memory`); `allowed`: among these
    strategies only (`StrategyILP`'s argument: a subspace of `prune.py` where the whole model is too large).

    With the family options fixed (none free) this is the exact minimum of the peak over the layouts.
    With free options, the joint min-max model is hard: on a 2-block GPT over a (2, 2) CPU mesh with
    host memory (30k columns, 53k rows, parameter offload offered) HiGHS took 153 s to prove its
    minimum and found no plan at all in 5 s. So layouts and options are alternated as in
    `heuristic.py`, each side's minimum for the other's (1.8 s there, 6% above the proven minimum):
    the options for the most sharded layouts, the layouts for those options, and so on while the
    peak falls. The result is a plan that fits its budget, not proven the least. `first`:
    `least_memory_options` where the caller keeps its answers (`heuristic._Models.least_options`).
    `enough`: the alternation stops at the first plan that needs at most this (a search that wants a
    plan that fits a budget, not the least: on Hugging Face Llama-3-8B at 64 x 4,096 over (4, 4, 4) H100
    the second round, 4.6 of the floor's 17 CPU s, found no lower peak). `deadline` (a `perf_counter`
    time; None: none): the search stops there with the best plan found (`Least.cut`); with none found
    yet, the most sharded layouts with the options found for them (each group's last allowed option,
    which frees most, where the deadline had passed before the search began), priced: its
    min-max models (Llama-3-405B's 16-microbatch stage: 587 s) had no bound."""
    sharded = most_sharded(problem, allowed)
    if past(deadline):
        return _priced(problem, sharded)
    if not any(len(g.allowed) > 1 for g in problem.families.groups):
        found = _least_peak(problem, deadline, allowed=allowed)
        return found if found is not None else _priced(problem, sharded)
    options = (first or (lambda c: least_memory_options(problem, c)))(sharded)
    best = None
    for _ in range(LEAST_ROUNDS):
        layouts = _least_peak(problem, deadline, options=options, allowed=allowed)
        found = None if layouts is None else _least_peak(problem, deadline, choice=layouts.plan[0])
        if found is None:       # the deadline came first
            return _priced(problem, sharded, options) if best is None else replace(best, cut=True)
        if best is not None and found.need >= best.need:
            return best
        best, options = replace(found, cut=found.cut or layouts.cut), found.plan[1]
        if best.need <= enough or best.cut:
            return best
    return best


def _priced(problem: Problem, choice: dict[str, int], options: dict[str, int] | None = None) -> Least:
    """`least_memory`'s answer where the deadline cut it before a plan: `choice` with `options` (default: each
    group's last allowed option, which frees most), priced."""
    options = {g.key: g.allowed[-1] for g in problem.families.groups} if options is None else options
    need = evaluate(problem, choice, options).peak_bytes
    return Least((choice, options), float(math.ceil(need + FEASIBILITY_SLACK_BYTES)), cut=True)


def past(deadline: float | None) -> bool:
    """`deadline` (a `perf_counter` time; None: none) has passed."""
    return deadline is not None and time.perf_counter() >= deadline


def _left(deadline: float | None) -> float | None:
    """Seconds a solve may take before `deadline` (None: no limit)."""
    return None if deadline is None else max(deadline - time.perf_counter(), 1e-3)


def least_memory_options(problem: Problem, choice: dict[str, int]) -> dict[str, int]:
    """The family options of least peak memory for the layout choice `choice` (`least_memory`'s first step:
    a model of the options alone, small however large the layout model)."""
    return _least_peak(problem, None, choice=choice).plan[1]


def _least_peak(problem: Problem, deadline: float | None, **fixed) -> Least | None:
    """The plan of least peak memory, `fixed` as `StrategyILP` takes it, and the budget it needs; by
    `deadline`, the best found (`Least.cut`), None where none was (or the deadline had passed)."""
    if past(deadline):
        return None
    ilp = StrategyILP(problem, memory_budget=INF, **fixed)
    ilp.add_memory()      # the tiers' capacity rows (no budget row: the budget is infinite)
    z = ilp.m.add_col(0, INF)
    ilp.m.cost[z] = 1.0
    rows = MemoryRows(ilp)
    for t, row in rows.rows(range(len(rows))).items():
        ilp.m.add_row({**row, z: -1.0}, -INF, -rows.fixed[t] / GIB)
    r = _min_max(ilp, rows, z, deadline)
    if r.values is None:
        return None
    plan = ilp.assignment(r.values)
    # the larger of the rows' peak (what a budget row must admit) and the plan's exact price
    peak = max(r.values[z] * GIB, evaluate(problem, *plan).peak_bytes)
    cut = deadline is not None and not r.status.startswith("Optimal")      # the MIP stopped at the deadline
    return Least(plan, float(math.ceil(peak + FEASIBILITY_SLACK_BYTES)), cut)


def _min_max(ilp: StrategyILP, rows: MemoryRows, z: int, deadline: float | None = None) -> MipResult:
    """`_least_peak`'s min-max model solved as `StrategyILP.solve_lazy` solves a large MIP: its LP
    relaxation rounded first (each decision at its largest fraction, `z` the rounded plan's highest
    row), the answer where that satisfies every row within MIP_GAP of the relaxation's bound, else
    HiGHS's MIP started from it. On Hugging Face Llama-3-8B at 64 x 4,096 over (4, 4, 4) H100 (its
    logits returned whole: 63 GiB of a 74 GiB budget on every device) the first subspace's model,
    63k columns, has a relaxation whose rounded plan is its bound, 1.7 CPU s; HiGHS's MIP took
    ~65 CPU s to prove a plan, 48 to find one 3% above it. Each solve stops at `deadline` (the MIP
    from the rounded plan then returns at least that plan)."""
    m = ilp.m
    if m.n_cols < ROUND_FROM:
        return m.solve(_left(deadline))
    lp = m.solve(_left(deadline), relax=True)
    if lp.values is None:
        return lp if past(deadline) else m.solve(_left(deadline))
    x = ilp.values_of(*ilp.assignment(lp.values))
    x[z] = max(rows.values(x))
    if m.violation(x) > ROW_TOLERANCE:
        return m.solve(_left(deadline))
    answer = _rounded_answer(x, x[z], lp)
    return answer if answer is not None else m.solve(_left(deadline), start=x)


def _rounded_answer(values: list[float], objective: float, lp: MipResult) -> MipResult | None:
    """The rounded plan of LP relaxation `lp` as the answer, where its `objective` is within MIP_GAP of
    the relaxation's bound (the guarantee the MIP solver's own stop gives); else None."""
    gap = max(objective - lp.objective, 0.0) / max(abs(objective), 1e-12)
    if gap > MIP_GAP:
        return None
    return MipResult(values, objective, f"Optimal (the LP relaxation rounded, gap {gap:.2%})", lp.solver, gap)
