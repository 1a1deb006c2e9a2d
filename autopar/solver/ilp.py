"""The strategy ILP (after Alpa's intra-operator pass, with liveness-based memory).

Sets: leaders l (decisions), their choices i; edges e between decisions with source layout
classes a and destination classes b; liveness points t.

    minimise   sum_l sum_i C[l,i] x[l,i]  +  sum_e sum_{a,b} c_e[a,b] y[e,a,b]
    subject to
    (A) one_choice[l]:     sum_i x[l,i] = 1
    (B) edge_src[e,a]:     sum_b y[e,a,b] = sum_{i: a_e(i) = a} x[src(e), i]
    (C) edge_dst[e,b]:     sum_a y[e,a,b] = sum_{j: b_e(j) = b} x[dst(e), j]
    (D) memory[t]:         sum_l sum_i (S[l,i] + A_t[l,i]) x[l,i] + sum_{e: pos(dst e) <= t} k[e]
                           + sum_{e: pos(dst e) = t} u[e]  <= M
    (E) copy_bytes[e]:     k[e] = sum_{a,b} K_e[a,b] y[e,a,b]
    (F) temp_bytes[e]:     u[e] = sum_{a,b} T_e[a,b] y[e,a,b]
        x binary, 0 <= y <= 1, k, u >= 0

C[l,i]: compute seconds (forward + backward) of every node merged into l when l picks i;
c_e[a,b]: seconds to reshard forward plus to return the gradient; S: parameter, gradient and
optimizer bytes; A_t: bytes of the activations live at point t; K_e: bytes of the resharded
copy a consumer keeps for its backward (a weight gathered for use); T_e: bytes of a resharded
copy it does not keep (a collective's output), alive while the consumer runs; M: the per-device
budget.
(B) and (C) make y the product x[src,i] x[dst,j] aggregated over layout classes, which
linearises the edge cost exactly when x is integral. An edge with one class on either side
is linear in the other side's x and needs no y. Pins remove choices before the ILP.

The objective is `Evaluation.objective_s` of the solution (`evaluate.py`): the step less the
optimizer step and the runtime's per-node cost, which the layouts barely move.

The other decision families (recomputation, residency, offload) add option variables g, gated
cost terms w, freed bytes z and tier bytes v, rows (G)-(L): `ilp_terms.py` states them. (D) then
also has one row per backward row of a family (a recomputed layer's backward) and subtracts the
bytes freed at each point; the objective adds the families' seconds.
"""
from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass, field

import pulp

from ..errors import InfeasibleError
from .evaluate import evaluate
from .ilp_terms import FamilyTerms
from .problem import Problem

GIB = float(2**30)
# HiGHS and CBC accept a MIP row within 1e-6 of its bound (their MIP feasibility tolerance); memory
# rows are in GiB, so a plan up to ~1.07 kB over the budget could pass. The budget rows are
# tightened by twice that, and `min_memory` adds it, so a budget of `min_memory_bytes` fits.
FEASIBILITY_SLACK_BYTES = 2e-6 * GIB


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


def pick_solver(time_limit: float | None):
    # memory rows are in GiB: HiGHS's default feasibility tolerances (1e-7 on rows, 1e-6 in the MIP)
    # would let a plan ~1 kB over its budget; 1e-9 keeps that to a byte
    highs = pulp.HiGHS(msg=False, timeLimit=time_limit, threads=1, primal_feasibility_tolerance=1e-9,
                       mip_feasibility_tolerance=1e-9)
    if highs.available():
        return highs, "HiGHS"
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, threads=1), "CBC"


class StrategyILP:
    """The model above, built with one coefficient dict per row (pulp's operator overloading is
    far too slow at this size). `rep` maps each decision to the representative whose variables it
    uses: decisions of repeated layers share one set (see `layers.py`), so their costs add up on
    one variable and edges with the same ends and tables share one y."""

    def __init__(self, problem: Problem, memory_budget: float):
        p = self.p = problem
        self.budget = memory_budget
        self.lp = pulp.LpProblem("autopar_strategies", pulp.LpMinimize)
        self.rep = {l: p.rep.get(l, l) for l in p.leaders}
        reps = list(dict.fromkeys(self.rep.values()))
        self.x = {r: [self.lp.add_variable(f"x_{k}_{i}", 0, 1, cat="Binary") for i in range(p.n_choices(r))]
                  for k, r in enumerate(reps)}
        self.group_of: list[tuple] = []          # per edge: its group key
        self.y: dict[tuple, list[list]] = {}
        self.copy_bytes: dict[tuple, pulp.LpVariable] = {}   # (E) per group: bytes of its kept copy
        self.temp_bytes: dict[tuple, pulp.LpVariable] = {}   # (F) per group: bytes of its temporary copy
        self.add_one_choice()
        self.add_edges()
        self.terms = FamilyTerms(self)

    def var(self, leader: str) -> list:
        return self.x[self.rep[leader]]

    # (A)
    def add_one_choice(self) -> None:
        for k, v in enumerate(self.x.values()):
            self.lp += pulp.LpAffineExpression([(x, 1.0) for x in v]) == 1, f"A_one_choice_{k}"

    def _ends(self, e) -> tuple[str, str | None]:
        src = self.rep[self.p.decisions[e.src].leader]
        dst = None if e.dst == "output" else self.rep[self.p.decisions[e.dst].leader]
        return src, dst

    # (B), (C): one y per group of edges with the same ends and layout classes
    def add_edges(self) -> None:
        for e in self.p.edges:
            src, dst = self._ends(e)
            key = (src, dst, tuple(e.a_of), tuple(e.b_of))
            self.group_of.append(key)
            n_a, n_b = len(e.cost), len(e.cost[0])
            if key in self.y or dst is None or dst == src or n_a == 1 or n_b == 1:
                continue
            g = len(self.y)
            y = [[self.lp.add_variable(f"y_{g}_{a}_{b}", 0, 1) for b in range(n_b)] for a in range(n_a)]
            for a in range(n_a):
                row = [(v, 1.0) for v in y[a]] + [(x, -1.0) for x, c in zip(self.x[src], e.a_of) if c == a]
                self.lp += pulp.LpAffineExpression(row) == 0, f"B_edge_src_{g}_{a}"
            for b in range(n_b):
                row = [(y[a][b], 1.0) for a in range(n_a)] + [(x, -1.0) for x, c in zip(self.x[dst], e.b_of) if c == b]
                self.lp += pulp.LpAffineExpression(row) == 0, f"C_edge_dst_{g}_{b}"
            self.y[key] = y
            if e.keeps_copy:   # (E): memory rows then name one variable instead of every y
                kv = self.lp.add_variable(f"k_{g}", 0)
                row = [(kv, 1.0)] + [(y[a][b], -e.saved[a][b] / GIB) for a in range(n_a) for b in range(n_b)
                                     if e.saved[a][b]]   # k in GiB, like the memory rows
                self.lp += pulp.LpAffineExpression(row) == 0, f"E_copy_bytes_{g}"
                self.copy_bytes[key] = kv
            if e.temp and any(any(r) for r in e.temp):   # (F): likewise for a temporary copy
                uv = self.lp.add_variable(f"u_{g}", 0)
                row = [(uv, 1.0)] + [(y[a][b], -e.temp[a][b] / GIB) for a in range(n_a) for b in range(n_b)
                                     if e.temp[a][b]]
                self.lp += pulp.LpAffineExpression(row) == 0, f"F_temp_bytes_{g}"
                self.temp_bytes[key] = uv

    def add_edge_terms(self, coef: dict, k: int, table: list[list[float]], scale: float = 1.0) -> None:
        """coef += scale * sum_{a,b} table[a][b] [edge k's source picks a and its consumer b]."""
        e, key = self.p.edges[k], self.group_of[k]
        src, dst = key[0], key[1]
        if key in self.y:
            for a, row in enumerate(self.y[key]):
                for b, v in enumerate(row):
                    if table[a][b]:
                        coef[v] = coef.get(v, 0.0) + scale * table[a][b]
        elif dst == src:        # both ends on one variable set: linear in it
            for i, v in enumerate(self.x[src]):
                if table[e.a_of[i]][e.b_of[i]]:
                    coef[v] = coef.get(v, 0.0) + scale * table[e.a_of[i]][e.b_of[i]]
        elif dst is None or len(table[0]) == 1:
            for i, v in enumerate(self.x[src]):
                if table[e.a_of[i]][0]:
                    coef[v] = coef.get(v, 0.0) + scale * table[e.a_of[i]][0]
        else:
            for j, v in enumerate(self.x[dst]):
                if table[0][e.b_of[j]]:
                    coef[v] = coef.get(v, 0.0) + scale * table[0][e.b_of[j]]

    def _node_terms(self, coef: dict, field: str, names, scale: float = 1.0) -> None:
        for name in names:
            d = self.p.decisions[name]
            for i, c in enumerate(getattr(d, field)):
                if c:
                    v = self.var(d.leader)[i]
                    coef[v] = coef.get(v, 0.0) + scale * c

    def objective(self) -> pulp.LpAffineExpression:
        coef: dict = {}
        self._node_terms(coef, "compute_s", self.p.decisions)
        for k, e in enumerate(self.p.edges):
            self.add_edge_terms(coef, k, e.cost)
        self.terms.objective_terms(coef)
        return pulp.LpAffineExpression(list(coef.items()))

    def memory_rows(self) -> list[pulp.LpAffineExpression]:
        """Per-device memory at every liveness point, in GiB (rows in bytes, 1e9-1e11 next to 0/1
        variables, trip the solver's tolerances). Built in one sweep over the points: between
        neighbours only the activations defined or freed, and the copies kept since, change."""
        p = self.p
        params = [n for n, d in p.decisions.items() if d.kind == "param"]
        whole: dict = {}                 # after the backward: every gradient exists, no activation
        self._node_terms(whole, "state_bytes", params)
        for z, n in self.terms.freed_at(-1, throughout=True).items():     # optimizer state offloaded
            whole[z] = whole.get(z, 0.0) - n * GIB
        state: dict = {}                 # in the forward: no gradient yet (zero_grad sets them to None)
        self._node_terms(state, "state_bytes", params)
        self._node_terms(state, "grad_bytes", params, -1.0)
        if not p.live.points:
            return [pulp.LpAffineExpression([(v, c / GIB) for v, c in whole.items()])]
        acts: dict = {}
        live: set[str] = set()
        kept = sorted((e.dst_pos, k) for k, e in enumerate(p.edges) if e.keeps_copy)
        copies: dict = {}
        temps_at: dict[int, list[int]] = {}
        for k, e in enumerate(p.edges):
            if e.temp and any(any(row) for row in e.temp):
                temps_at.setdefault(e.dst_pos, []).append(k)
        nk = 0
        rows = []
        for members, where in zip(p.live.points, p.live.positions):
            now = set(members)
            self._add_nodes(acts, live - now, -1.0)
            self._add_nodes(acts, now - live, 1.0)
            live = now
            while nk < len(kept) and kept[nk][0] <= where:
                k = kept[nk][1]
                kv = self.copy_bytes.get(self.group_of[k])
                if kv is None:
                    self.add_edge_terms(copies, k, p.edges[k].saved)
                else:
                    copies[kv] = copies.get(kv, 0.0) + GIB    # k is in GiB already
                nk += 1
            temps: dict = {}
            for k in temps_at.get(where, ()):
                uv = self.temp_bytes.get(self.group_of[k])
                if uv is None:
                    self.add_edge_terms(temps, k, p.edges[k].temp)
                else:
                    temps[uv] = temps.get(uv, 0.0) + GIB    # u is in GiB already
            total = dict(state)
            for part in (acts, copies, temps):
                for v, c in part.items():
                    total[v] = total.get(v, 0.0) + c
            for z, n in self.terms.freed_at(where).items():
                total[z] = total.get(z, 0.0) - n * GIB    # z is in GiB already
            rows.append(total)
        rows += self.terms.backward_rows(rows[-1]).values()
        rows.append(whole)
        return [pulp.LpAffineExpression([(v, c / GIB) for v, c in row.items() if abs(c) > 1e-6]) for row in rows]

    def _add_nodes(self, coef: dict, names, sign: float) -> None:
        for name in sorted(names):
            d = self.p.decisions[name]
            for i, c in enumerate(d.act_bytes):
                if c:
                    v = self.var(d.leader)[i]
                    coef[v] = coef.get(v, 0.0) + sign * c

    # (D)
    def add_memory(self) -> None:
        prof = self.p.mesh.profile
        self.terms.add_tiers({"host": prof.host_memory_capacity, "disk": prof.disk_capacity})
        if self.budget == float("inf"):
            return
        for t, row in enumerate(self.memory_rows()):
            self.lp += row <= (self.budget - FEASIBILITY_SLACK_BYTES) / GIB, f"D_memory_{t}"

    def solve(self, time_limit: float | None = None, progress: bool = False) -> SolveResult:
        self.add_memory()
        self.lp.setObjective(self.objective())
        solver, name = pick_solver(time_limit)
        t0 = time.perf_counter()
        with _Progress(progress, f"{self.lp.numVariables()} variables, {self.lp.numConstraints()} constraints",
                       time_limit):
            self.lp.solve(solver)
        secs = time.perf_counter() - t0
        status = pulp.LpStatus[self.lp.status]
        # pulp's HiGHS wrapper calls a time-limit stop "Optimal": only sol_status tells them apart
        gap = _mip_gap(self.lp)
        if status == "Optimal" and self.lp.sol_status == pulp.LpSolutionIntegerFeasible:
            status = f"Feasible (stopped at the time limit, gap {gap:.2%})"
        if not status.startswith(("Optimal", "Feasible")) or self.lp.sol_status not in (
                pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            if status == "Infeasible":
                need = min_memory(self.p)
                raise InfeasibleError(
                    f"no plan fits {self.budget / 2**30:.3f} GiB per device on mesh {self.p.mesh.shape}: "
                    f"this model needs at least {need / 2**30:.3f} GiB per device ({need:.0f} bytes). "
                    f"Raise memory_budget, use a larger mesh, or a smaller batch.", need)
            return self.fallback(status, name, secs)
        choice = self.choice()
        return SolveResult(choice, float(pulp.value(self.lp.objective) or 0.0), status, name, secs,
                           self.lp.numVariables(), self.lp.numConstraints(), gap, self.terms.options())

    def choice(self) -> dict[str, int]:
        """The solved choice per leader (its largest x)."""
        picked = {r: max(range(len(v)), key=lambda i: v[i].varValue or 0.0) for r, v in self.x.items()}
        return {l: picked[self.rep[l]] for l in self.p.leaders}

    def fallback(self, status: str, name: str, secs: float) -> SolveResult:
        """The solver stopped with no plan: every decision takes its smallest-memory strategy (the
        most sharded) and every family group its last allowed option (the options are ordered
        from keeping most to freeing most), so the search always ends with a plan that fits if any
        simple one does."""
        p = self.p
        choice = {}
        for l in p.leaders:
            members = [d for d in p.decisions.values() if d.leader == l]
            mem = [sum(d.state_bytes[i] + d.act_bytes[i] for d in members) for i in range(p.n_choices(l))]
            choice[l] = min(range(len(mem)), key=lambda i: (mem[i], i))
        options = {g.key: g.allowed[-1] for g in p.families.groups}
        ev = evaluate(p, choice, options)
        if ev.peak_bytes > self.budget:
            raise InfeasibleError(f"the solver stopped without a plan (status {status}) and the most sharded "
                                  f"plan needs {ev.peak_bytes / GIB:.2f} GiB per device: raise time_limit or "
                                  f"memory_budget")
        return SolveResult(choice, ev.step_s, f"Heuristic (solver: {status})", name, secs,
                           self.lp.numVariables(), self.lp.numConstraints(), float("nan"), options)


def _mip_gap(lp) -> float:
    model = getattr(lp, "solverModel", None)
    try:
        return float(model.getInfo().mip_gap) if model is not None else 0.0
    except Exception:  # noqa: BLE001 - CBC, or a HiGHS without the field: no gap to report
        return 0.0


class _Progress:
    """Prints a line every few seconds while a long solve runs (when asked: planning in a terminal)."""

    EVERY_S = 5.0

    def __init__(self, on: bool, what: str, limit: float | None):
        self.on, self.what, self.limit = on, what, limit
        self.done = threading.Event()

    def __enter__(self):
        if self.on:
            self.t0 = time.perf_counter()
            threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self):
        while not self.done.wait(self.EVERY_S):
            left = f", stops at {self.limit:.0f} s" if self.limit else ""
            print(f"autopar: solving the strategy ILP ({self.what}): {time.perf_counter() - self.t0:.0f} s{left}",
                  file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        self.done.set()


def min_memory(problem: Problem) -> float:
    """The smallest budget that fits a plan: the peak per-device memory of the plan that needs least
    (ignoring time), as the ILP's rows and the evaluator price it, plus the solver's slack."""
    ilp = StrategyILP(problem, memory_budget=float("inf"))
    ilp.add_memory()      # the tiers' capacity rows (no budget row: the budget is infinite)
    z = ilp.lp.add_variable("peak_gib", 0)
    ilp.lp += z
    for t, row in enumerate(ilp.memory_rows()):
        ilp.lp += row - z <= 0, f"D_peak_{t}"
    solver, _ = pick_solver(None)
    ilp.lp.solve(solver)
    # the larger of the rows' peak (what a budget row must admit) and the plan's exact price
    peak = max(float(z.varValue or 0.0) * GIB, evaluate(problem, ilp.choice(), ilp.terms.options()).peak_bytes)
    return float(math.ceil(peak + FEASIBILITY_SLACK_BYTES))


def solve(problem: Problem, memory_budget: float, time_limit: float | None = None,
          progress: bool = False) -> SolveResult:
    return StrategyILP(problem, memory_budget).solve(time_limit, progress)
