"""The strategy ILP (after Alpa's intra-operator pass, with liveness-based memory).

Sets: leaders l (decisions), their choices i; edges e between decisions with source layout
classes a and destination classes b; liveness points t.

    minimise   sum_l sum_i C[l,i] x[l,i]  +  sum_e sum_{a,b} c_e[a,b] y[e,a,b]
    subject to
    (A) one_choice[l]:     sum_i x[l,i] = 1
    (B) edge_src[e,a]:     sum_b y[e,a,b] = sum_{i: a_e(i) = a} x[src(e), i]
    (C) edge_dst[e,b]:     sum_a y[e,a,b] = sum_{j: b_e(j) = b} x[dst(e), j]
    (D) memory[t]:         sum_l sum_i (S[l,i] + A_t[l,i]) x[l,i]
                           + sum_{e: pos(dst e) <= t} sum_{a,b} K_e[a,b] y[e,a,b]  <= M
        x binary, 0 <= y <= 1

C[l,i]: compute seconds (forward + backward) of every node merged into l when l picks i;
c_e[a,b]: seconds to reshard forward plus to return the gradient; S: parameter, gradient and
optimizer bytes; A_t: bytes of the activations live at point t; K_e: bytes of the resharded
copy a consumer keeps for its backward (a weight gathered for use); M: the per-device budget.
(B) and (C) make y the product x[src,i] x[dst,j] aggregated over layout classes, which
linearises the edge cost exactly when x is integral. An edge with one class on either side
is linear in the other side's x and needs no y. Pins remove choices before the ILP.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import pulp

from ..errors import InfeasibleError
from .problem import Problem


@dataclass(frozen=True, slots=True)
class SolveResult:
    choice: dict[str, int]
    objective: float
    status: str
    solver: str
    seconds: float
    n_variables: int
    n_constraints: int


def pick_solver(time_limit: float | None):
    highs = pulp.HiGHS(msg=False, timeLimit=time_limit, threads=1)
    if highs.available():
        return highs, "HiGHS"
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, threads=1), "CBC"


class StrategyILP:
    def __init__(self, problem: Problem, memory_budget: float):
        self.p = problem
        self.budget = memory_budget
        self.lp = pulp.LpProblem("autopar_strategies", pulp.LpMinimize)
        self.x = {l: [self.lp.add_variable(f"x_{k}_{i}", 0, 1, cat="Binary") for i in range(problem.n_choices(l))]
                  for k, l in enumerate(problem.leaders)}
        self.y: dict[int, list[list]] = {}
        self.add_one_choice()
        self.add_edges()

    # (A)
    def add_one_choice(self) -> None:
        for k, l in enumerate(self.p.leaders):
            self.lp += pulp.lpSum(self.x[l]) == 1, f"A_one_choice_{k}"

    def class_sum(self, leader: str, of: list[int], cls: int):
        return pulp.lpSum(v for v, c in zip(self.x[leader], of) if c == cls)

    def _src(self, e) -> str:
        return self.p.decisions[e.src].leader

    def _dst(self, e) -> str | None:
        return None if e.dst == "output" else self.p.decisions[e.dst].leader

    # (B), (C): y only where both ends have several layout classes
    def add_edges(self) -> None:
        for k, e in enumerate(self.p.edges):
            n_a, n_b = len(e.cost), len(e.cost[0])
            if n_a == 1 or n_b == 1:
                continue
            y = [[self.lp.add_variable(f"y_{k}_{a}_{b}", 0, 1) for b in range(n_b)] for a in range(n_a)]
            for a in range(n_a):
                self.lp += pulp.lpSum(y[a]) == self.class_sum(self._src(e), e.a_of, a), f"B_edge_src_{k}_{a}"
            for b in range(n_b):
                self.lp += pulp.lpSum(y[a][b] for a in range(n_a)) == self.class_sum(self._dst(e), e.b_of, b), \
                    f"C_edge_dst_{k}_{b}"
            self.y[k] = y

    def edge_expr(self, k: int, which: str) -> list:
        """Terms of sum_{a,b} table[a][b] [src picks a and dst picks b], linear in x or y."""
        e = self.p.edges[k]
        table = getattr(e, which)
        if k in self.y:
            return [table[a][b] * v for a, row in enumerate(self.y[k]) for b, v in enumerate(row) if table[a][b]]
        if len(table[0]) == 1:
            return [table[e.a_of[i]][0] * v for i, v in enumerate(self.x[self._src(e)]) if table[e.a_of[i]][0]]
        return [table[0][e.b_of[j]] * v for j, v in enumerate(self.x[self._dst(e)]) if table[0][e.b_of[j]]]

    def objective(self):
        p = self.p
        node_cost = {l: [0.0] * p.n_choices(l) for l in p.leaders}
        for d in p.decisions.values():
            for i, c in enumerate(d.compute_s):
                node_cost[d.leader][i] += c
        terms = [c * v for l in p.leaders for c, v in zip(node_cost[l], self.x[l]) if c]
        for k in range(len(p.edges)):
            terms += self.edge_expr(k, "cost")
        return pulp.lpSum(terms)

    def memory_expr(self, t: int):
        """Per-device bytes at liveness point t (t = -1: parameter state only)."""
        p = self.p
        coef = {l: [0.0] * p.n_choices(l) for l in p.leaders}
        for d in p.decisions.values():
            for i, b in enumerate(d.state_bytes):
                coef[d.leader][i] += b
        terms = []
        if t >= 0:
            for name in p.live.points[t]:
                d = p.decisions[name]
                for i, b in enumerate(d.act_bytes):
                    coef[d.leader][i] += b
            for k, e in enumerate(p.edges):
                if e.dst_pos <= p.live.positions[t] and any(any(r) for r in e.saved):
                    terms += self.edge_expr(k, "saved")
        return pulp.lpSum([c * v for l in p.leaders for c, v in zip(coef[l], self.x[l]) if c] + terms)

    def memory_points(self):
        return range(len(self.p.live.points)) if self.p.live.points else [-1]

    # (D)
    def add_memory(self) -> None:
        if self.budget == float("inf"):
            return
        for t in self.memory_points():
            self.lp += self.memory_expr(t) <= self.budget, f"D_memory_{t}"

    def solve(self, time_limit: float | None = None) -> SolveResult:
        self.add_memory()
        self.lp += self.objective()
        solver, name = pick_solver(time_limit)
        t0 = time.perf_counter()
        self.lp.solve(solver)
        secs = time.perf_counter() - t0
        status = pulp.LpStatus[self.lp.status]
        if status != "Optimal" or self.lp.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            if status == "Infeasible":
                need = min_memory(self.p)
                raise InfeasibleError(
                    f"no plan fits {self.budget / 2**30:.3f} GiB per device on mesh {self.p.mesh.shape}: "
                    f"this model needs at least {need / 2**30:.3f} GiB per device ({need:.0f} bytes). "
                    f"Raise memory_budget, use a larger mesh, or a smaller batch.", need)
            if self.lp.sol_status != pulp.LpSolutionIntegerFeasible:
                raise InfeasibleError(f"the solver stopped without a plan (status {status}); raise time_limit")
            status = "Feasible (time limit)"
        choice = {l: max(range(len(v)), key=lambda i: v[i].varValue or 0.0) for l, v in self.x.items()}
        return SolveResult(choice, float(pulp.value(self.lp.objective) or 0.0), status, name, secs,
                           self.lp.numVariables(), self.lp.numConstraints())


def min_memory(problem: Problem) -> float:
    """The smallest peak per-device memory any plan reaches (ignoring time)."""
    ilp = StrategyILP(problem, memory_budget=float("inf"))
    z = ilp.lp.add_variable("peak_bytes", 0)
    ilp.lp += z
    for t in ilp.memory_points():
        ilp.lp += ilp.memory_expr(t) <= z, f"D_peak_{t}"
    solver, _ = pick_solver(None)
    ilp.lp.solve(solver)
    return float(z.varValue or 0.0)


def solve(problem: Problem, memory_budget: float, time_limit: float | None = None) -> SolveResult:
    return StrategyILP(problem, memory_budget).solve(time_limit)


def evaluate(problem: Problem, choice: Mapping[str, int]) -> tuple[float, float, float, float]:
    """(compute_s, comm_s, peak_bytes, state_bytes) of a choice, from the same tables the ILP uses."""
    p = problem
    compute = sum(d.compute_s[choice[d.leader]] for d in p.decisions.values())
    comm = 0.0
    picked = []
    for e in p.edges:
        a = e.a_of[choice[p.decisions[e.src].leader]]
        b = 0 if e.dst == "output" else e.b_of[choice[p.decisions[e.dst].leader]]
        comm += e.cost[a][b]
        picked.append((e.dst_pos, e.saved[a][b]))
    state = sum(d.state_bytes[choice[d.leader]] for d in p.decisions.values())
    peak = state
    for live, where in zip(p.live.points, p.live.positions):
        acts = sum(p.decisions[n].act_bytes[choice[p.decisions[n].leader]] for n in live)
        copies = sum(b for pos, b in picked if pos <= where)
        peak = max(peak, state + acts + copies)
    return compute, comm, peak, state
