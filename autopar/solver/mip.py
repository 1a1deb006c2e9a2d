"""A mixed-integer program as arrays, and the solvers that take it.

The strategy ILP (`ilp.py`) is written here column by column and row by row (plain lists of
indices and coefficients), then handed to HiGHS through `highspy` in one call per kind of data:
building it through pulp's objects took seconds for a real model. Where `highspy` is not
installed, the same arrays become a pulp problem solved by CBC (the documented fallback; slower
to build and to solve, same optimum).

A start (a value per column, typically a heuristic plan) is passed to the solver as its first
incumbent; HiGHS then never returns anything worse, whatever the time limit.
"""
from __future__ import annotations

import sys
import threading
import time
from array import array
from dataclasses import dataclass, field

INF = float("inf")
# A solve stops once its plan is proven within 0.1% of the best (the solvers' default, 0.01%, cost
# HiGHS ten more seconds of bound tightening on Llama-3-8B over 64 devices after the root had
# already bounded the gap to 0.06%); the cost model itself is not that close to measured steps.
MIP_GAP = 1e-3
# HiGHS's presolve is most of an LP relaxation's time on the layout models and removes little: on
# Llama-3-8B over 64 devices (68k columns, 8k rows) it took ~0.9 of 1.1 s per LP and cut 8% of the
# rows, where the simplex alone solved the LP in 0.15-0.2 s (and proved the infeasible one in 0.06 s).
# The MIPs are solved without it too: there it took a third of the MIP (2.1 against 3.3 CPU s, the
# root LP's rounding then finds the optimum), and removed 600 of 68k columns; the plan it ends at has
# the same objective, step time and peak (GPT-3 175B's pipeline search: the same plan).
# The models that ask for it (`Mip.presolve`) are presolved: the family options' models, whose layouts
# are fixed (~3k columns, ~8.5k rows of which presolve removes nearly all), solve in 0.01-0.02 s with
# it and took up to 0.75 s without (Llama-3-8B over 64 devices, the most sharded plan's options).
# So is every MIP given a start (a plan to improve on): there the solver spends its time at the root
# (a node limit of 100 did not shorten it), and presolve cut it by four. Gemma-2-9B over (8, 8): the
# layout MIP after a rounding outside the gap, 98k columns, 25 CPU s without presolve, 6.3 s with it
# (the same start; the plans' objectives within MIP_GAP of each other); Llama-3-8B on (8,) at
# 8 x 8192 with memory decisions: the joint model from the alternation's plan, 14k columns and 31k
# rows, 91 CPU s without, 22 s with, the same plan. Since an offloaded layer's kept activation copies
# are priced as moved (solver/decisions/offload.py) that model is 17.8k columns and 41.6k rows: 54 CPU s
# with presolve at load 1.1-1.4, the same plan. With the RLT rows (`ilp_terms.FamilyTerms.tighten`) and
# branching on the LP's fractional columns first (`branch.py`) it is proven in three LPs (7.7 CPU s in all).


@dataclass(frozen=True, slots=True)
class MipResult:
    values: list[float] | None     # per column; None when no solution was found
    objective: float
    status: str                    # "Optimal", "Feasible (stopped at the time limit, gap x%)", "Infeasible", ...
    solver: str                    # "HiGHS" | "CBC"
    gap: float = 0.0               # relative gap proven at the stop (0 when optimal)


@dataclass(frozen=True, slots=True)
class Defined:
    """A continuous column whose value a complete assignment fixes: `coef . values + const`,
    clamped at 0 when `clamp`, and 0 unless one of `gates` is on (None: always); or the product
    of two columns."""
    coef: dict[int, float]
    const: float = 0.0
    gates: tuple[int, ...] | None = None
    clamp: bool = False
    product: tuple[int, int] | None = None      # instead: the product of these two columns
    unless: tuple[int, ...] = ()                 # and 0 when one of these is on


def _floats() -> array:
    return array("d")


def _ints() -> array:
    return array("q")


@dataclass(slots=True)
class Mip:
    """min cost . x  s.t.  row_lo <= A x <= row_hi,  col_lo <= x <= col_hi,  some x integral.
    The columns' and rows' numbers are typed arrays (`array.array`), not lists: a layout model holds ~1M
    coefficients, and Python's cyclic garbage collector walks every item of a list at each full pass (a
    third of Gemma-2-9B's collector time while solving), never the items of an array; they also reach
    the solver as arrays without a conversion item by item."""
    col_lo: array = field(default_factory=_floats)
    col_hi: array = field(default_factory=_floats)
    cost: array = field(default_factory=_floats)
    integer: list[int] = field(default_factory=list)        # integral columns
    row_lo: array = field(default_factory=_floats)
    row_hi: array = field(default_factory=_floats)
    row_start: array = field(default_factory=lambda: array("q", [0]))
    row_index: array = field(default_factory=_ints)
    row_value: array = field(default_factory=_floats)
    presolve: bool = False          # let the solver presolve (see above)
    # `violation`'s arrays of the rows and bounds, with the sizes they were made at: rows and columns are
    # only ever appended, so equal sizes mean equal arrays (a layout model checks ~10 roundings against
    # the same ~1M coefficients: converting the lists each time was most of each check)
    _checked: tuple = field(default=(), repr=False, compare=False)

    def copy(self) -> Mip:
        return Mip(*(getattr(self, f)[:] for f in ("col_lo", "col_hi", "cost", "integer", "row_lo", "row_hi",
                                                       "row_start", "row_index", "row_value")), self.presolve)

    @property
    def n_cols(self) -> int:
        return len(self.col_lo)

    @property
    def n_rows(self) -> int:
        return len(self.row_lo)

    def add_col(self, lo: float = 0.0, hi: float = INF, integral: bool = False) -> int:
        self.col_lo.append(lo)
        self.col_hi.append(hi)
        self.cost.append(0.0)
        if integral:
            self.integer.append(len(self.col_lo) - 1)
        return len(self.col_lo) - 1

    def add_row(self, coef: dict[int, float], lo: float = -INF, hi: float = INF) -> int:
        for j, c in coef.items():
            if c:
                self.row_index.append(j)
                self.row_value.append(c)
        self.row_start.append(len(self.row_index))
        self.row_lo.append(lo)
        self.row_hi.append(hi)
        return len(self.row_lo) - 1

    def objective(self, values) -> float:
        """cost . values"""
        import numpy as np
        return float(np.dot(np.array(self.cost, dtype=np.float64), np.asarray(values, dtype=np.float64)))

    def violation(self, values) -> float:
        """The largest amount by which `values` breaks a row's or a column's bounds (0: feasible);
        integrality is not checked."""
        import numpy as np
        x = np.asarray(values, dtype=np.float64)
        col_lo, col_hi, rows, index, value, row_lo, row_hi = self._arrays()
        worst = max(float(np.max(col_lo - x, initial=0.0)), float(np.max(x - col_hi, initial=0.0)))
        if not self.n_rows:
            return worst
        ax = np.bincount(rows, weights=value * x[index], minlength=self.n_rows)
        return max(worst, float(np.max(row_lo - ax, initial=0.0)), float(np.max(ax - row_hi, initial=0.0)))

    def _arrays(self) -> tuple:
        """The bounds and rows as arrays (`_checked`), made again only where rows or columns were added."""
        import numpy as np
        sizes = (self.n_cols, self.n_rows, len(self.row_index))
        if not self._checked or self._checked[0] != sizes:
            rows = np.repeat(np.arange(self.n_rows), np.diff(np.array(self.row_start)))
            # copies (np.array), not views: an array exporting its buffer cannot grow
            self._checked = (sizes, (np.array(self.col_lo), np.array(self.col_hi), rows,
                                     np.array(self.row_index, dtype=np.int64), np.array(self.row_value),
                                     np.array(self.row_lo), np.array(self.row_hi)))
        return self._checked[1]

    def solve(self, time_limit: float | None = None, start: list[float] | None = None,
              progress: str | None = None, relax: bool = False) -> MipResult:
        """Solve with HiGHS (highspy), or CBC through pulp where highspy is missing. `progress`: what
        to say on stderr every few seconds while it runs (None: nothing); `relax`: the LP relaxation
        (every column continuous)."""
        global _solver_seconds
        t0 = time.perf_counter()
        try:
            with _Progress(progress, time_limit):
                if highs_available():
                    return _solve_highs(self, time_limit, start, relax)
                return _solve_pulp(self, time_limit, start, relax)
        finally:
            _solver_seconds += time.perf_counter() - t0


_solver_seconds = 0.0      # wall seconds spent inside the solvers by this process (`solver_seconds`)


def solver_seconds() -> float:
    """Wall seconds this process has spent inside MIP solvers so far (a clock, like time.process_time:
    the difference over a planning phase is its solving time, the rest of the phase building models)."""
    return _solver_seconds


def timed(run):
    """run(), its wall seconds counted as time inside the solvers (`solver_seconds`)."""
    global _solver_seconds
    t0 = time.perf_counter()
    try:
        return run()
    finally:
        _solver_seconds += time.perf_counter() - t0


def highs_available() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def highs_model(m: Mip, relax: bool = False, presolve: bool | None = None):
    """A highspy.Highs holding `m` (every column continuous where `relax`), with this module's options;
    `presolve`: None as `m.presolve` says."""
    import highspy
    import numpy as np
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    # memory rows are in GiB: HiGHS's default feasibility tolerances (1e-7 on rows, 1e-6 in the MIP)
    # would let a plan ~1 kB over its budget; 1e-9 keeps that to a byte
    h.setOptionValue("primal_feasibility_tolerance", 1e-9)
    h.setOptionValue("mip_feasibility_tolerance", 1e-9)
    h.setOptionValue("mip_rel_gap", MIP_GAP)
    h.setOptionValue("presolve", "on" if (m.presolve if presolve is None else presolve) else "off")
    n = m.n_cols
    h.addVars(n, np.array(m.col_lo, dtype=np.float64), np.array(m.col_hi, dtype=np.float64))
    h.changeColsCost(n, np.arange(n, dtype=np.int32), np.array(m.cost, dtype=np.float64))
    if m.integer and not relax:
        idx = np.array(m.integer, dtype=np.int32)
        h.changeColsIntegrality(len(idx), idx, np.full(len(idx), highspy.HighsVarType.kInteger))
    if m.n_rows:
        h.addRows(m.n_rows, np.array(m.row_lo, dtype=np.float64), np.array(m.row_hi, dtype=np.float64),
                  len(m.row_index), np.array(m.row_start[:-1], dtype=np.int32),
                  np.array(m.row_index, dtype=np.int32), np.array(m.row_value, dtype=np.float64))
    return h


def _solve_highs(m: Mip, time_limit: float | None, start: list[float] | None, relax: bool = False) -> MipResult:
    import highspy
    h = highs_model(m, relax, m.presolve or (start is not None and not relax))
    if time_limit is not None:
        h.setOptionValue("time_limit", float(max(time_limit, 1e-3)))
    if start is not None:
        sol = highspy.HighsSolution()
        sol.col_value = list(start)
        sol.value_valid = True
        h.setSolution(sol)
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    has = info.primal_solution_status == 2     # kSolutionStatusFeasible
    if status == highspy.HighsModelStatus.kOptimal:
        return MipResult(list(h.getSolution().col_value), info.objective_function_value, "Optimal", "HiGHS", 0.0)
    if status == highspy.HighsModelStatus.kInfeasible:
        return MipResult(None, INF, "Infeasible", "HiGHS")
    name = h.modelStatusToString(status)
    if has:
        gap = float(info.mip_gap)
        return MipResult(list(h.getSolution().col_value), info.objective_function_value,
                         f"Feasible (stopped: {name.lower()}, gap {gap:.2%})", "HiGHS", gap)
    return MipResult(None, INF, name, "HiGHS", float("nan"))


def _solve_pulp(m: Mip, time_limit: float | None, start: list[float] | None, relax: bool = False) -> MipResult:
    import pulp
    lp = pulp.LpProblem("autopar", pulp.LpMinimize)
    integer = set() if relax else set(m.integer)
    cols = [lp.add_variable(f"c{j}", None if m.col_lo[j] == -INF else m.col_lo[j],
                            None if m.col_hi[j] == INF else m.col_hi[j],
                            cat="Integer" if j in integer else "Continuous") for j in range(m.n_cols)]
    lp.setObjective(pulp.LpAffineExpression([(cols[j], c) for j, c in enumerate(m.cost) if c]))
    for r in range(m.n_rows):
        a, b = m.row_start[r], m.row_start[r + 1]
        expr = pulp.LpAffineExpression([(cols[j], c) for j, c in zip(m.row_index[a:b], m.row_value[a:b])])
        if m.row_lo[r] == m.row_hi[r]:
            lp += expr == m.row_lo[r], f"r{r}"
            continue
        if m.row_lo[r] > -INF:
            lp += expr >= m.row_lo[r], f"r{r}lo"
        if m.row_hi[r] < INF:
            lp += expr <= m.row_hi[r], f"r{r}hi"
    if start is not None:
        for v, x in zip(cols, start):
            v.setInitialValue(x)
    lp.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, threads=1, warmStart=start is not None,
                               gapRel=MIP_GAP))
    if lp.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        status = pulp.LpStatus[lp.status]
        return MipResult(None, INF, status, "CBC", float("nan"))
    values = [v.varValue or 0.0 for v in cols]
    if lp.sol_status == pulp.LpSolutionOptimal:
        return MipResult(values, float(pulp.value(lp.objective) or 0.0), "Optimal", "CBC")
    return MipResult(values, float(pulp.value(lp.objective) or 0.0), "Feasible (stopped: time limit)", "CBC",
                     float("nan"))


class _Progress:
    """Prints a line every few seconds while a long solve runs (when asked: planning in a terminal)."""

    EVERY_S = 5.0

    def __init__(self, what: str | None, limit: float | None):
        self.what, self.limit = what, limit
        self.done = threading.Event()

    def __enter__(self):
        if self.what:
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
