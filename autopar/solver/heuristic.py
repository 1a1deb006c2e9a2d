"""A heuristic plan: the ILP's start and the floor of its answer.

Solving layouts and memory families together is hard for the solver (its bound is weak where a
family's option gates a term); each alone is easy. So, alternating once:

1. layouts: every decision at its smallest-memory strategy (the most sharded plan);
2. families for those layouts: the ILP with the layout columns fixed (a small problem: the
   family options and their terms);
3. layouts for those families: the ILP with the family options fixed, within half the time left;
4. families for those layouts again.
If step 2 finds no plan within the budget (a budget near the minimum), the plan that needs least
memory (`ilp.least_memory`) is the start when it fits.

The better of the plans after steps 2 and 4 (by what the ILP minimises, `Evaluation.objective_s`)
is the result. On Hugging Face Llama-3-8B over 64 H100 (families on) it was the best plan known,
found in seconds, where the solver alone had not found a plan after a minute. Without families, step 2
is that plan and steps 3-4 would be the ILP itself: skipped.
"""
from __future__ import annotations

import time

from .evaluate import evaluate

Assignment = tuple[dict[str, int], dict[str, int]]     # (strategy per leader, option per family group)


def start_plan(ilp, deadline: float | None) -> Assignment | None:
    """The best heuristic assignment that fits the budget, or None if none of them does."""
    from .ilp import least_memory, most_sharded
    best: list[tuple[float, Assignment]] = []
    first = _families_for(ilp, most_sharded(ilp.p), None)
    if first is None:     # a budget near the minimum: the plan that needs least, if it fits
        plan, need = least_memory(ilp.p)
        return plan if need <= ilp.budget else None
    best.append((evaluate(ilp.p, *first).objective_s, first))
    if ilp.terms.g:
        half = None if deadline is None else time.perf_counter() + (deadline - time.perf_counter()) / 2
        r = ilp.solve_lazy(half, fix=_fixed(ilp.terms.g, first[1]), start=ilp.values_of(*first))
        if r.values is not None:
            second = _families_for(ilp, ilp.assignment(r.values)[0], None)
            if second is not None:
                best.append((evaluate(ilp.p, *second).objective_s, second))
    return min(best, key=lambda b: b[0])[1]


def _families_for(ilp, choice: dict[str, int], deadline: float | None) -> Assignment | None:
    """The best family options for a fixed layout choice, or None if no options make it fit."""
    fix = _fixed({r: dict(enumerate(cols)) for r, cols in ilp.x.items()}, choice)
    r = ilp.solve_lazy(deadline, fix=fix)
    return None if r.values is None else ilp.assignment(r.values)


def _fixed(columns: dict, picked: dict) -> dict[int, float]:
    """column -> 1 for each key's picked entry, 0 for its others (key -> {entry: column})."""
    return {c: float(i == picked[k]) for k, cols in columns.items() for i, c in cols.items()}
