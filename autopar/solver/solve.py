"""Solving a planning problem: the alternation's plan first, then the joint ILP where it is small.

`solve` runs the alternation of `heuristic.py` (layouts with the family options fixed, options with
the layouts fixed, each optimal for the other): that plan is the floor, so a longer time limit never
gives a slower plan. The joint model (`ilp.StrategyILP`: layouts and family options together)
starts from it where the layout model is small (JOINT_MAX_COLUMNS); on larger ones the alternation's
plan is the answer, and its status says so (`status_words`). A mesh whose layout model is too large
(`prune.too_large`) is searched in subspaces of merged axes (`heuristic.subspace_plan`).
`min_memory` is the smallest budget that fits a plan found.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

from .heuristic import LEAST_STATUS, resume_plan, start_plan, subspace_plan
from .ilp import SolveResult, StrategyILP, known_gap, least_memory
from .problem import Problem
from .prune import floor_subspace, too_large

# The joint model multiplies each gated term's layout columns by the option columns (McCormick products):
# from a layout model of this many columns on it is not built and the alternation's plan is the answer
# (Llama-3-8B on (8, 8): 66k layout columns, a joint model of 176k columns that HiGHS did not solve in
# a minute; GPT-3 175B's pipeline stage on (16, 8): 17k layout columns, a joint model of 50k columns and
# 104k rows whose first solve took HiGHS 13 s and which found no plan better than the alternation's in
# a minute; the 4-block test models: a few hundred columns, joint optimum in well under a second).
JOINT_MAX_COLUMNS = 10_000

log = logging.getLogger("autopar")


def min_memory(problem: Problem) -> float:
    """The smallest budget that fits a plan found: the peak per-device memory of the plan that needs
    least (`least_memory`, ignoring time), as the ILP's rows and the evaluator price it, plus the
    solver's slack. On a model too large to solve whole, among the first subspace searched
    (`prune.floor_subspace`)."""
    return least_memory(problem, floor_subspace(problem)).need


def solve(problem: Problem, memory_budget: float, time_limit: float | None = None,
          progress: bool = False, start: tuple[dict[str, int], dict[str, int]] | None = None,
          floor: bool = False) -> SolveResult:
    """The best plan found within `time_limit` seconds (None: the optimum of the alternation, and of
    the joint model where that is built), never worse than the alternating heuristic's plan
    (`heuristic.py`). The joint model (layouts and family options together) is built only where
    the layout model has at most JOINT_MAX_COLUMNS columns; without free family options the
    layout model is the joint model and its solve is the answer. The status is in `status_words`'
    words; how the solver got there is logged. `start`: a (layout choice, family options) to improve
    instead of the heuristic's first plans (`heuristic.resume_plan`), where it fits the budget.
    `floor`: the heuristic's first plans run to their end whatever the time limit (`start_plan`, the
    floor of `subspace_plan`: a caller with no other plan to return); without it every step, the search
    for the plan that needs least memory included, stops at the time limit, and the status says so."""
    t0 = time.perf_counter()
    deadline = None if time_limit is None else t0 + time_limit
    r = _solve(problem, memory_budget, deadline, t0, progress, start, floor)
    log.info("solver: %s (%s, %.2f s)", r.status, r.solver, r.seconds)
    timed_out = deadline is not None and time.perf_counter() >= deadline
    return replace(r, status=status_words(r.status, r.gap, timed_out=timed_out))


OPTIMAL = "optimal"
OPTIMAL_ALTERNATION = "optimal for each family given the others (alternation)"
AT_TIME_LIMIT = "best found at the time limit"
ALTERNATED = "Feasible (layouts and memory options alternated"     # `_solve`'s raw status of that answer
SUBSPACES = "Feasible (solved in subspaces"


def status_words(raw: str, gap: float, *, timed_out: bool) -> str:
    """A solve's outcome in words a user can act on, from the solver's raw status: "optimal" (proven,
    within the MIP gap); OPTIMAL_ALTERNATION (layouts optimal for the memory options and the options
    for the layouts, not proven jointly); "best found at the time limit, gap x%" where the solver
    proved a bound on the whole problem (not the alternation's layouts alone, not a trivial 100%),
    without a gap otherwise; the subspace search and the fallbacks by what they are."""
    stopped = "Feasible (stopped" in raw or "time limit" in raw
    alternated = raw.startswith(ALTERNATED)
    if raw.startswith(SUBSPACES):
        return (f"{AT_TIME_LIMIT} (subspaces of merged mesh axes searched)" if timed_out or stopped else
                "best found by searching subspaces of merged mesh axes (no bound computed)")
    if raw.startswith("Heuristic"):
        return "the most sharded plan: the solver stopped without a plan (raise time_limit)"
    if LEAST_STATUS in raw:
        return (f"{AT_TIME_LIMIT}: the plan that needs least memory found by then" if stopped else
                "the plan that needs least memory: the budget leaves no other choice found (not proven optimal)")
    if stopped or (timed_out and not raw.startswith(("Optimal", ALTERNATED))):
        proved = raw.startswith("Feasible (stopped") and 0.0 <= gap < 1.0
        return f"{AT_TIME_LIMIT}, gap {gap:.2%}" if proved else AT_TIME_LIMIT
    if alternated:
        return OPTIMAL_ALTERNATION if "layout solve: Optimal" in raw else "best found (not proven optimal)"
    if raw.startswith("Optimal (the LP relaxation rounded"):         # within the MIP gap of the relaxation's bound
        return f"{OPTIMAL} (the LP relaxation rounded)"
    if raw.startswith("Optimal") or raw.endswith("solver: Optimal)"):    # the heuristic's plan ties the optimum
        return OPTIMAL
    return "best found (not proven optimal)"


def _solve(problem: Problem, memory_budget: float, deadline: float | None, t0: float,
           progress: bool, carried: tuple[dict[str, int], dict[str, int]] | None = None,
           floor: bool = False) -> SolveResult:
    if too_large(problem):
        start = subspace_plan(problem, memory_budget, deadline, progress, floor)
        return SolveResult(start.plan[0], start.objective_s, f"{SUBSPACES}: {start.status})",
                           start.solver, time.perf_counter() - t0, start.n_variables, start.n_constraints,
                           known_gap(float("nan")), start.plan[1])
    start = None if carried is None else resume_plan(problem, memory_budget, carried, deadline, progress)
    if start is None:
        start = start_plan(problem, memory_budget, deadline, progress, floor=floor)
    free = any(len(g.allowed) > 1 for g in problem.families.groups)
    late = deadline is not None and time.perf_counter() >= deadline     # the joint model's build alone would overrun
    if start is not None and (not free or start.n_variables > JOINT_MAX_COLUMNS or late):
        joint = ("at the time limit" if start.n_variables <= JOINT_MAX_COLUMNS else
                 f"of {start.n_variables} layout columns times the options")
        status = start.status if not free else (
            f"{ALTERNATED}, each optimal for the other; the joint model {joint} was not built; the plan's layout "
            f"solve: {start.status})")
        return SolveResult(start.plan[0], start.objective_s, status, start.solver, time.perf_counter() - t0,
                           start.n_variables, start.n_constraints, known_gap(start.gap if not free else float("nan")),
                           start.plan[1])
    return StrategyILP(problem, memory_budget).solve_from(start, deadline, t0, progress)
