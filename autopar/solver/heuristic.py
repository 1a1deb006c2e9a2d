"""A plan by alternating layouts and memory families: the ILP's start and floor, and on large
models the answer.

Solving layouts and family options together needs the products of layout and option variables
(`ilp_terms.py`); on Hugging Face Llama-3-8B over 64 H100 they made the joint model 176k columns
and 336k rows, which HiGHS did not solve in a minute. Each side alone is easy: with the options
fixed, every gated term is linear in the layouts (no products: the model is the layout ILP's
size); with the layouts fixed, only the options are left (a few dozen binaries). So:

1. layouts: every decision at its smallest-memory strategy (the most sharded plan), and the
   best options for it; if no options make it fit (a budget near the minimum, or edges whose
   copies the most sharded layouts ignore: Llama-3-8B at 131,072 tokens over (8, 2, 4)), the plan
   that needs least memory (`ilp.least_memory`) when it fits, a start steps 2 and 3 improve on
   with its options;
2. layouts from the LP relaxation (memory rows added lazily), each decision at its largest
   fraction, with the default options and with step 1's, and the best options for them: on
   Llama-3-8B over 64 H100 a plan within 0.4% of the best known, in a tenth of the time HiGHS
   took to find a first plan as good from step 1's; the best so far starts the next step. With
   no plan in hand where that rounding fits no options, each decision at its least-memory
   strategy among those the relaxation gives a share (`_least_of_support`);
3. layouts for the best plan's options (memory rows added lazily), then the best options for
   those layouts; repeated while the plan improves and the options change.
Each step keeps the better plan (by what the ILP minimises, `Evaluation.objective_s`), so the
result never gets worse with more time. Step 3's last plan is optimal in its layouts for its
options and in its options for its layouts; it is not proven optimal jointly. On small models
the joint model then starts from it (`solve.solve`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from . import prune
from .evaluate import evaluate
from .ilp import StrategyILP, infeasible, least_memory, least_memory_options, most_sharded, past

Assignment = tuple[dict[str, int], dict[str, int]]     # (strategy per leader, option per family group)
ROUNDS = 4         # step 3 rounds at most (Llama-3-8B and GPT-3 settle in one or two)
LEAST_STATUS = "Feasible (the plan that needs least memory)"     # `start_plan`'s, near the minimum
LEAST_ROUNDED = "Feasible (the LP relaxation's layouts, each at its least memory)"    # `_least_of_support`'s
SHARE = 1e-6       # an LP column above this is in the relaxation's support (HiGHS's tolerances are ~1e-7)
STOPPED = "; stopped at the time limit"     # a status's tail where the deadline cut the search that found its plan
# The floor's local search (`_local`) repeats its LP rounding while a round gains more than FLOOR_GAIN, at most
# FLOOR_ROUNDS rounds (each an LP of the neighbourhood and an options model, bounded work whatever the limit).
# Hugging Face Llama-3-8B at 64 x 4,096 over (4, 4, 4) H100 (its logits whole: the first plan is the one that
# needs least memory, 19.1 s): rounds gave 3.03, 2.15, 1.81, 1.743, 1.741 s, ~1.2 CPU s each, where one round
# left limit 1 at 3.03 (1.8x the best known, 1.648).
FLOOR_ROUNDS = 8
FLOOR_GAIN = 1e-3      # a round gaining less than 0.1% (the MIP gap's size) ends the floor's search
# Past the deadline another round runs only after one that gained more than PAST_GAIN (the first always runs):
# the rounds' gains fall fast, and a round after one of under 1% gained ~0.05% at 0.5-1.1 CPU s (limit 1 over
# (4, 4, 4): Llama-3-8B 17%, 0.46%, 0.05%; Gemma-2-9B 14%, 0.58%, 0.05%; Qwen3-8B 12.9%, 6.8%, 0), so the call
# ends nearer its time limit; before the deadline the rounds go on while they gain more than FLOOR_GAIN.
PAST_GAIN = 1e-2


@dataclass(frozen=True, slots=True)
class Heuristic:
    plan: Assignment
    objective_s: float        # `Evaluation.objective_s` of the plan
    status: str               # how the layout solve that found it ended
    solver: str
    gap: float                # that solve's proven gap (its options fixed); 1.0 when none was solved
    n_variables: int = 0      # size of the layout models (0: none was built)
    n_constraints: int = 0


def start_plan(problem, budget: float, deadline: float | None, progress: bool = False,
               allowed: dict[str, tuple[int, ...]] | None = None, floor: bool = False,
               options: Callable[[dict[str, int]], dict[str, int]] | None = None,
               improving: bool = True, models: _Models | None = None) -> Heuristic | None:
    """The best plan the alternation finds by `deadline`; InfeasibleError if no plan fits the budget
    (the plan that needs least memory, solved to optimality, does not). `allowed`: the layouts are
    searched among these strategies only (`StrategyILP`'s argument). `floor`: step 1 and step 2's first
    rounded relaxation that gives a plan run to their end whatever the deadline (their plan is the same on
    every run); its other relaxation, while time remains. `options`: a function of the most
    sharded layouts giving family options a plan of the same problem fits with (another subspace's),
    called only where no options fit those layouts: step 2 then starts from them instead of the plan
    that needs least memory, and None is returned where that finds no plan (a search that has a plan
    already then has nothing to gain). `improving`: False, steps 1 and 2 only (`subspace_plan`'s floor).
    `models`: the layout models (and what they found) of an earlier call with the same `allowed` and budget."""
    models = _Models(problem, budget, allowed) if models is None else models
    best = _first(problem, budget, deadline, models, options, floor)
    if best is None or not improving:
        return best
    return improve(problem, budget, best, deadline, progress, models)


CARRIED = "Feasible (a neighbouring problem's plan, carried over)"


def resume_plan(problem, budget: float, plan: Assignment, deadline: float | None,
                progress: bool = False) -> Heuristic | None:
    """Step 3 from `plan` instead of steps 1 and 2: a plan carried over from a neighbouring problem
    (the pipeline search's same stage mesh at another microbatch count, whose layouts mostly stay
    best); None where it does not fit the budget (the caller then starts from step 1)."""
    ev = evaluate(problem, *plan)
    if ev.peak_bytes > budget:
        return None
    models = _Models(problem, budget)
    return improve(problem, budget, Heuristic(plan, ev.objective_s, CARRIED, "HiGHS", 1.0), deadline, progress,
                   models)


def _first(problem, budget: float, deadline: float | None, models: _Models,
           known: Callable[[dict[str, int]], dict[str, int]] | None = None, floor: bool = False) -> Heuristic | None:
    """Steps 1 and 2 (among `models`' allowed strategies): the most sharded plan, then the LP
    relaxation's layouts rounded, the better; `known`: `start_plan`'s `options`. Each relaxation is
    built and solved only before `deadline` (past it, its solve would stop before a plan), except with
    `floor` until one gives a better plan; so is the search for the plan that needs least memory (its
    best by the deadline); with `floor` each is solved to its end, whatever the deadline
    (on Gemma-2-9B over (8, 8), 2.8 CPU s with the default options, their model built first; step 1's
    options then cost 0.9 more for a plan 2% slower)."""
    choice = most_sharded(problem, models.allowed)
    options = models.options_for(choice)
    best = None
    if options is not None:
        best = Heuristic((choice, options), evaluate(problem, choice, options).objective_s,
                         "Feasible (the most sharded plan)", "HiGHS", 1.0)
    elif known is not None:     # no options fit the most sharded layouts: step 2 from options that fit elsewhere
        options = known(choice)
    else:                       # the plan that needs least, if it fits (by the deadline, unless `floor`)
        least = least_memory(problem, models.allowed, models.least_options, enough=budget,
                             deadline=None if floor else deadline)
        if least.need > budget:
            raise infeasible(problem, budget, least.need, least.cut)
        options = least.plan[1]
        best = Heuristic(least.plan, evaluate(problem, *least.plan).objective_s,
                         LEAST_STATUS + (STOPPED if least.cut else ""), "HiGHS", 1.0)
    defaults = problem.families.defaults()
    rounded = False         # a relaxation has given the best plan so far
    for fixed in ([defaults, options] if options != defaults else [options]) if _free(problem) else []:
        if (rounded or not floor) and past(deadline):
            break
        model = models.get(fixed)           # step 2: the LP relaxation's layouts, rounded
        r = models.relaxed(model) if floor else model.solve_lazy(deadline, relax=True)
        if r.values is not None:
            new = _better(problem, models, best, model.assignment(r.values)[0],
                          "Feasible (the LP relaxation's layouts, rounded)", r.solver, 1.0)
            if new is None:         # no plan yet, and that rounding fits no options: round to least memory
                new = _better(problem, models, best, _least_of_support(problem, model, r.values),
                              LEAST_ROUNDED, r.solver, 1.0)
            rounded, best = rounded or new is not best, new
    return best


def _least_of_support(problem, model, values: list[float]) -> dict[str, int]:
    """Each decision at its smallest-memory strategy among those the LP relaxation `values` of `model`
    gives a share (`most_sharded` among them): where rounding each to its largest share breaks the
    budget, this one keeps every decision's own bytes at most the relaxation's (a least of the shares is
    at most their weighted sum), a first plan that often fits, found in the time of an evaluation. On
    Hugging Face Llama-3-8B at 64 x 4,096 over (4, 4, 4) H100 (its logits whole) the floor's first subspace
    took 6.3 CPU s for a plan of 19.10 s, the one that needs least memory (`ilp.least_memory`, min-max LPs of
    63k columns); this rounding gives 2.11 s in 1.4 (`bench_time_limit.py`, stop 52)."""
    return most_sharded(problem, {r: tuple(i for i, j in cols.items() if values[j] > SHARE)
                                  for r, cols in model.x.items()})


def _free(problem) -> bool:
    return any(len(g.allowed) > 1 for g in problem.families.groups)


def improve(problem, budget: float, best: Heuristic, deadline: float | None, progress: bool,
            models: _Models) -> Heuristic:
    """Step 3 from `best`: layouts for its options (among `models`' allowed strategies), then the
    best options for those layouts, while the plan improves; never worse than `best`."""
    for _ in range(ROUNDS if _free(problem) else 1):
        if past(deadline):
            break
        model = models.get(best.plan[1])
        r = model.solve_lazy(deadline, start=model.values_of(*best.plan), progress=progress)
        if r.values is None:
            break
        before = best
        best = _better(problem, models, best, model.assignment(r.values)[0], r.status, r.solver, r.gap)
        if best is before:      # the solver's plan is no better: its bound covers the plan we have
            best = replace(best, status=r.status, solver=r.solver, gap=r.gap)
            break
        if best.plan[1] == before.plan[1]:
            break
    return replace(_timed_out(best, deadline), n_variables=models.n_cols, n_constraints=models.n_rows)


def subspace_plan(problem, budget: float, deadline: float | None, progress: bool = False,
                  floor: bool = True) -> Heuristic:
    """A plan for a mesh of three or more axes whose layout model is too large to solve
    (`prune.too_large`), by steps in a fixed order, each keeping the best plan so far (so a longer
    time limit never gives a slower plan): the floor, solved before any step the limit cuts (so every
    limit's plan is at most its floor): steps 1 and 2 of the alternation in the first merged-axes subspace
    of `prune.axis_merges` (`prune.merged_axes`) whatever the time limit, then rounds of local search from
    that plan while they gain (the layouts within one mesh axis of the plan's, `prune.near`: their LP
    relaxation rounded; `_local`'s floor: past the deadline only while the last round gained more than
    PAST_GAIN, so a longer limit only adds rounds and its floor is at most a shorter one's). Then, while
    time remains, local search with step 3's MIPs while the plan improves, the alternation in each merger's
    subspace, the first's again (from the best plan's options where no options fit their most sharded
    layouts: their own plan that needs least memory took
    Llama-3-8B at 131,072 tokens on (8, 2, 4) 99 CPU s past the limit), and local search again after a
    merger that improved the plan. Step 3 in the first subspace came before the floor's local search until
    stop 50: the local search then started where that MIP ended or the limit cut it, a plan that depended
    on the limit (Qwen2-7B at 56 x 4,096 on (4, 4, 4): 2.03 s at limit 90 against 1.94 at limit 1;
    `bench_time_limit.py`).

    The local search is in the floor because a merged subspace makes the merged axes do the same: a
    plan whose axes of one link level do different things (on Llama-3-8B at 131,072 tokens over
    (8, 2, 4) H100, the sequence split over the second axis and heads over the third) is in no
    subspace, and one step across one axis reaches it from the first subspace's plan, heads over both
    (9.38 s a step -> 8.76 s; 72 CPU s for the subspace, 4.7 for the step).

    `floor` False (a caller with another plan in hand, `solve.solve`'s): the floor's steps stop at the
    deadline too (Llama-3-405B's plan without a pipeline over (128, 16, 8), weighed after its pipelines:
    still in the floor at 660 s wall under time_limit=300)."""
    merges = prune.axis_merges(problem)
    best = _merged(problem, budget, deadline, progress, merges[0], None, floor=True, bounded=not floor)
    best = _local(problem, budget, best, deadline, progress, floor=True, bounded=not floor)
    best = _local(problem, budget, best, deadline, progress)
    solved = 1
    for k, groups in enumerate(merges):
        if past(deadline):
            break
        solved = max(solved, k + 1)
        h = _merged(problem, budget, deadline, progress, groups, best.plan[1])
        if h is not None and h.objective_s < best.objective_s * (1 - 1e-9):
            best = _local(problem, budget, h, deadline, progress)
    best = replace(best, status=f"{best.status} (best of {solved} of {len(merges)} mergers of mesh axes)")
    return _timed_out(best, deadline)


def _merged(problem, budget: float, deadline: float | None, progress: bool, groups: tuple[tuple[int, ...], ...],
            options: dict[str, int] | None, floor: bool = False, bounded: bool = False) -> Heuristic | None:
    """The alternation's plan in the subspace of merged axes `groups` (`start_plan`'s `options`, `floor`).
    The floor's subspace (no `options`) starts from the options of least memory for its most sharded
    layouts, where no options fit those (`ilp.least_memory_options`: a model of the options alone), and
    only where that finds no plan (its relaxation rounded two ways, `_first`) from the plan that needs
    least memory (`ilp.least_memory`: layouts and options alternated, each a min-max model of the
    subspace's size; 66-99 CPU s of the floor on Llama-3-8B at 131,072 tokens over (8, 2, 4) H100)."""
    allowed = prune.merged_axes(problem, *groups)
    models = _Models(problem, budget, allowed)      # both calls below: their models, relaxations, options

    def start(choice):      # called only where no options fit the most sharded layouts `choice`
        return options if options is not None else models.least_options(choice)
    whatever = floor and not bounded     # `bounded`: the floor's steps, each only before the deadline
    h = start_plan(problem, budget, deadline, progress, allowed, whatever,
                   start if floor or options is not None else None, improving=not floor, models=models)
    if h is None and options is None:
        h = start_plan(problem, budget, deadline, progress, allowed, whatever, improving=not floor, models=models)
    if h is None:
        return None
    names = "; ".join(" and ".join(repr(problem.mesh.axis_names[a]) for a in g) for g in groups)
    return replace(h, status=f"{h.status}; mesh axes {names} merged")


def _local(problem, budget: float, best: Heuristic, deadline: float | None, progress: bool,
           floor: bool = False, bounded: bool = False) -> Heuristic:
    """Local search from `best`: the layouts within one mesh axis of its own (`prune.near`) re-solved from
    it with the alternation's step 3, round after round while the plan improves and time remains. `floor`:
    rounds as step 2 solves (`_rounded_near`: no MIP, whose time has no bound), while a round gains more than
    FLOOR_GAIN, at most FLOOR_ROUNDS; past the deadline the first whatever the time, another only after one
    that gained more than PAST_GAIN (a longer limit only adds rounds); `bounded`: rounds only before the
    deadline."""
    views, memo = {}, {}    # `prune.near`'s and the models' `memo` (the problem's alone), for every round
    if floor:
        gain = 1.0      # the last round's (none yet: the first runs whatever the time)
        for _ in range(FLOOR_ROUNDS):
            if past(deadline) and (bounded or gain <= PAST_GAIN):
                break
            h = _rounded_near(problem, budget, best, views, memo)
            if h.objective_s >= best.objective_s * (1 - FLOOR_GAIN):
                return h
            gain, best = 1 - h.objective_s / best.objective_s, h
        return best
    while not past(deadline):
        h = improve(problem, budget, best, deadline, progress,
                    _Models(problem, budget, prune.near(problem, best.plan[0], views=views), memo))
        if h.objective_s >= best.objective_s * (1 - 1e-9):
            return replace(best, n_variables=h.n_variables, n_constraints=h.n_constraints)
        best = replace(h, status=f"{h.status}; local search")
    return best


def _rounded_near(problem, budget: float, best: Heuristic, views: dict, memo: dict) -> Heuristic:
    """One round of the floor's local search: the LP relaxation of the layouts within one mesh axis of
    `best`'s, with its options, rounded, and the best options for those layouts; `best` where no better.
    `views`: `prune.near`'s; `memo`: `StrategyILP`'s."""
    models = _Models(problem, budget, prune.near(problem, best.plan[0], views=views), memo)
    model = models.get(best.plan[1])
    r = model.solve_lazy(None, relax=True)
    h = best if r.values is None else _better(problem, models, best, model.assignment(r.values)[0],
                                              "Feasible (the LP relaxation's layouts, rounded)", r.solver, 1.0)
    return h if h is best else replace(h, status=f"{h.status}; local search")


def _timed_out(best: Heuristic, deadline: float | None) -> Heuristic:
    """`best`, its status saying so where the time limit ended the alternation early (the plan then
    depends on how fast this machine ran: a loaded machine may stop at a slower plan)."""
    if not past(deadline) or "time limit" in best.status:
        return best
    logging.getLogger("autopar").warning(
        "planning stopped at its time limit with the plan found so far (%s): a longer time_limit (or None) "
        "may find a faster plan, and the same plan each time", best.status)
    return replace(best, status=best.status + STOPPED)


class _Models:
    """The layout models by their fixed options; a new one starts with the memory rows found
    binding in the last (the liveness points are the same)."""

    def __init__(self, problem, budget: float, allowed: dict[str, tuple[int, ...]] | None = None,
                 memo: dict | None = None):
        self.problem, self.budget, self.allowed = problem, budget, allowed
        self.built: dict[tuple, object] = {}
        self.shared: dict = {}           # what the models' common layout columns determine (`StrategyILP`)
        self.memo = {} if memo is None else memo    # what the problem alone determines, for every model (`StrategyILP`)
        self.binding: dict[int, int] = {}
        self.n_cols = self.n_rows = 0
        self.options: dict[tuple, dict[str, int] | None] = {}     # layout choice -> `families_for` it
        self.least: dict[tuple, dict[str, int]] = {}     # layout choice -> `least_memory_options` for it
        self.relaxations: dict[int, object] = {}         # id(model) -> its LP relaxation solved to its end

    def options_for(self, choice: dict[str, int]) -> dict[str, int] | None:
        """`families_for(choice)`, once per choice (the LP roundings of steps 2 and 3 may meet again)."""
        key = tuple(sorted(choice.items()))
        if key not in self.options:
            self.options[key] = families_for(self.problem, self.budget, choice, self.memo)
        return self.options[key]

    def least_options(self, choice: dict[str, int]) -> dict[str, int]:
        """`ilp.least_memory_options(choice)`, once per choice (a subspace's floor asks it of its most
        sharded layouts twice: for step 2's start, then as `least_memory`'s first step)."""
        key = tuple(sorted(choice.items()))
        if key not in self.least:
            self.least[key] = least_memory_options(self.problem, choice)
        return self.least[key]

    def relaxed(self, model):
        """`model.solve_lazy(None, relax=True)`, once per model: solved to its end with no deadline, the same
        answer each time (a model's rows are added in a fixed order), so a second ask is the first's."""
        if id(model) not in self.relaxations:
            self.relaxations[id(model)] = model.solve_lazy(None, relax=True)
        return self.relaxations[id(model)]

    def get(self, options: dict[str, int]):
        key = tuple(sorted(options.items()))
        if key not in self.built:
            model = StrategyILP(self.problem, self.budget, options=options, shared=self.shared, allowed=self.allowed,
                                memo=self.memo)
            model.build()
            model.add_memory_rows(self.binding)
            self.built[key] = model
        model = self.built[key]
        self.binding = model.memory_added
        self.n_cols, self.n_rows = model.m.n_cols, model.m.n_rows
        return model


def _better(problem, models: _Models, best: Heuristic | None, choice: dict[str, int], status: str, solver: str,
            gap: float) -> Heuristic:
    """`best`, or the plan of `choice` with its best options where that is faster."""
    options = models.options_for(choice)
    if options is None:
        return best
    objective = evaluate(problem, choice, options).objective_s
    if best is not None and objective >= best.objective_s * (1 - 1e-9):
        return best
    return Heuristic((choice, options), objective, status, solver, gap)


def families_for(problem, budget: float, choice: dict[str, int], memo: dict | None = None) -> dict[str, int] | None:
    """The best family options for a fixed layout choice, or None if no options make it fit; `memo`:
    `StrategyILP`'s."""
    model = StrategyILP(problem, budget, choice=choice, memo=memo)
    model.build()
    r = model.solve_lazy(None)
    return None if r.values is None else model.assignment(r.values)[1]
