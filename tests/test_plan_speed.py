"""Planning under a time limit: the heuristic plan is the floor, so a longer limit never gives a
slower plan and a short one is close to the best; the pulp fallback solves the same model."""
from __future__ import annotations

import pytest
import torch

import autopar  # noqa: E402
from autopar.solver import heuristic, ilp, mip, solve  # noqa: E402


def _plan(time_limit, budget=None, shape=(2, 2, 2), **kw):
    with torch.device("meta"):
        model = torch.nn.Sequential(*(Block() for _ in range(4)))
        x = torch.zeros(64, 512, 1024)
    mesh = autopar.Mesh(shape, ("dp", "sp", "tp")[:len(shape)], device="h100")
    return autopar.plan(model, (x,), mesh, time_limit=time_limit, memory_budget=budget, symbolic=False, **kw)


class Block(torch.nn.Module):
    def __init__(self, hidden=1024):
        super().__init__()
        self.up, self.down = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.fixture(scope="module")
def unbounded():
    return _plan(None, float("inf"))


@pytest.fixture(scope="module")
def unbounded_2x4():
    """The best plan on (2, 4) without a budget: two tests set their budgets from its peak."""
    return _plan(None, float("inf"), shape=(2, 4))


@pytest.fixture(scope="module")
def tight(unbounded):
    """A budget that needs memory decisions: 75% of the peak of the best plan without a budget (at 80%
    the LP relaxation's rounded layouts, solved without presolve, fit with none)."""
    return 0.75 * unbounded.estimate.peak_memory_bytes


@pytest.fixture(scope="module")
def whole(tight):
    """The tight plan with its layout model solved whole, not in subspaces: the best plan there is."""
    from autopar.solver import prune
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prune, "SUBSPACE_FROM", float("inf"))
        return _plan(None, tight)


def test_longer_time_limit_never_gives_a_slower_plan(tight, whole):
    """This (2, 2, 2) model's layout model (152k columns) is solved in subspaces (Llama-3-8B on (4, 4, 4):
    1.24M): the alternation's first plans with two mesh axes merged are the floor, found whatever the
    time limit; the MIP there, the other merged pairs and local search improve on it while time remains."""
    plans = [_plan(t, tight) for t in (0.01, 1.0, 4.0)]
    steps = [p.solver.objective_s for p in plans]          # what the solver minimises
    assert all("subspaces of merged mesh axes" in p.solver.status for p in plans)
    assert steps[0] >= steps[1] * (1 - 1e-9) and steps[1] >= steps[2] * (1 - 1e-9)
    assert steps[1] <= 1.25 * whole.solver.objective_s  # 1 s of solving: within 1.25x of the best
    assert "time limit" in plans[0].solver.status        # a plan the limit cut short says so
    for p in plans:
        assert p.estimate.peak_memory_bytes <= tight * (1 + 1e-9)
        assert {v for d in (p.recompute, p.residency, p.offload) for v in d.values()} - {"none", "keep", "device"}


def test_pulp_fallback_finds_the_same_optimum(monkeypatch):
    best = _plan(None, 1.6 * 2**30, shape=(4,))
    monkeypatch.setattr(mip, "highs_available", lambda: False)
    plan = _plan(None, 1.6 * 2**30, shape=(4,))
    assert best.solver.solver == "HiGHS" and plan.solver.solver == "CBC" and plan.solver.status == solve.OPTIMAL
    assert plan.solver.objective_s == pytest.approx(best.solver.objective_s, rel=1e-6)


def test_alternated_plan_on_a_large_model_is_close_to_the_joint_optimum(monkeypatch, unbounded_2x4):
    """Where the joint model is not built (large models), layouts and memory options are alternated:
    the plan fits, is priced as estimate() prices it, and is near the joint model's optimum. On (2, 4)
    the joint model is small enough to build (13k columns), so the two can be compared."""
    tight = 0.75 * unbounded_2x4.estimate.peak_memory_bytes
    joint = _plan(None, tight, shape=(2, 4))
    assert joint.solver.status.startswith(solve.OPTIMAL) and joint.solver.status != solve.OPTIMAL_ALTERNATION
    monkeypatch.setattr(solve, "JOINT_MAX_COLUMNS", 0)
    alone = _plan(None, tight, shape=(2, 4))
    assert alone.solver.status == solve.OPTIMAL_ALTERNATION
    assert alone.estimate.peak_memory_bytes <= tight * (1 + 1e-9)
    assert alone.solver.objective_s <= 1.05 * joint.solver.objective_s
    assert alone.solver.objective_s >= joint.solver.objective_s * (1 - 1e-3)      # the joint model's gap


def test_rounded_lp_relaxation_is_within_the_mip_gap(monkeypatch, unbounded_2x4):
    """A large layout model (here (2, 4) with memory decisions: 13k columns) first solves its LP
    relaxation and rounds it; where the rounded plan is within the MIP gap of the relaxation's bound,
    that is the answer (the guarantee the MIP solver's own stop gives). Forcing the MIP everywhere
    gives a plan of the same objective within that gap, and both fit the budget."""
    # 0.8: a budget where rounding is what answers. Measured (stop 50, collectives' local copies priced):
    # 0.80-0.82 of the unbounded peak, the rounded relaxation within the gap; 0.85-0.95, the MIP answers;
    # at 0.75 the rounded relaxation is not within the gap, and 0.65 fits no plan
    tight = 0.8 * unbounded_2x4.estimate.peak_memory_bytes
    monkeypatch.setattr(ilp, "ROUND_FROM", float("inf"))     # every model solved as a MIP
    by_mip = _plan(None, tight, shape=(2, 4))
    monkeypatch.setattr(ilp, "ROUND_FROM", 0)                # every model's relaxation rounded first
    rounded = _plan(None, tight, shape=(2, 4))
    assert "LP relaxation rounded" not in by_mip.solver.status
    assert "LP relaxation rounded" in rounded.solver.status
    assert rounded.solver.objective_s == pytest.approx(by_mip.solver.objective_s, rel=mip.MIP_GAP)
    for p in (by_mip, rounded):
        assert p.estimate.peak_memory_bytes <= tight * (1 + 1e-9)


def test_branching_on_the_lp_relaxation_proves_a_knapsack_optimum():
    """A MIP whose LP relaxation takes an item in part (a family option taken in part to meet the
    budget exactly) is proven by fixing that column both ways (`solver/branch.py`), not left to the MIP
    solver: the best plan found, within MIP_GAP of a proven bound, in a few LPs."""
    from autopar.solver.branch import branch
    m = mip.Mip()
    value, weight = [6.0, 5.0, 4.0], [5.0, 4.0, 3.0]
    cols = [m.add_col(0, 1, integral=True) for _ in value]
    for j, v in zip(cols, value):
        m.cost[j] = -v                                   # maximise the value taken
    m.add_row(dict(zip(cols, weight)), -mip.INF, 8.0)    # capacity 8: the LP takes 1/5 of the first item

    def rounded(values):
        out = [float(round(v)) for v in values]
        return out if m.violation(out) <= 1e-9 else None
    b = branch(m, [0.0, 0.0, 0.0], rounded, None)
    assert rounded([0.2, 1.0, 1.0]) == [0.0, 1.0, 1.0]         # the LP's plan rounded: value 9, not 10
    assert b.proven and b.values == [1.0, 0.0, 1.0] and b.objective == -10.0 and 3 <= b.lps <= 12


def test_branching_takes_the_weighty_fractional_option_first():
    """Branching spends its LPs on the fractional column that moves the objective most (`first`: the family
    options by the seconds their costs move, `ilp_terms.FamilyTerms.weights`), not on the most fractional:
    beside the knapsack above, an independent item worth almost nothing sits at 1/2 in the relaxation.
    Fixing it proves nothing; fixing the item of weight 6 (at 1/5) proves the optimum in three LPs."""
    from autopar.solver.branch import branch
    m = mip.Mip()
    value, weight = [6.0, 5.0, 4.0], [5.0, 4.0, 3.0]
    cols = [m.add_col(0, 1, integral=True) for _ in value]
    for j, v in zip(cols, value):
        m.cost[j] = -v
    m.add_row(dict(zip(cols, weight)), -mip.INF, 8.0)
    tiny = m.add_col(0, 1, integral=True)
    m.cost[tiny] = -1e-3
    m.add_row({tiny: 2.0}, -mip.INF, 1.0)               # the LP takes half of it

    def rounded(values):
        out = [float(round(v)) for v in values]
        return out if m.violation(out) <= 1e-9 else None
    first = {**dict(zip(cols, value)), tiny: 1e-3}
    b = branch(m, [0.0] * 4, rounded, None, max_lps=3, first=first)
    assert b.proven and b.values == [1.0, 0.0, 1.0, 0.0] and b.lps == 3
    assert not branch(m, [0.0] * 4, rounded, None, max_lps=3).proven      # the most fractional first: not in 3


def test_a_search_given_a_passed_deadline_returns_at_once_saying_so():
    """Every search inside a planning call takes the call's deadline (issue 37). The search for the plan
    that needs least memory, its deadline passed, returns at once the cheapest plan it can price (the most
    sharded layouts, each memory option freeing most) and says it was cut; a solve with another plan in
    hand (`floor` off, as a pipeline search's) stops there too, and where that plan does not fit, says
    the time limit, not the model, is why; so does the floor of a search in subspaces with another plan
    in hand."""
    import time
    from autopar.errors import InfeasibleError
    from autopar.passes.capture import capture
    from autopar.passes.shape_prop import annotate
    from autopar.planner.solve import PlanOptions, planning_problem
    from autopar.solver.evaluate import evaluate
    from memory_checks import gpt
    model, inputs = gpt(layers=2)
    cap = capture(model, inputs, None)
    infos = annotate(cap.gm)
    problem = planning_problem(cap, infos, autopar.Mesh((2, 2), ("dp", "tp"), device="h100"), PlanOptions(symbolic=False))
    t = time.process_time()
    cut = ilp.least_memory(problem, deadline=time.perf_counter())
    assert time.process_time() - t < 0.2 and cut.cut
    assert cut.need >= evaluate(problem, *cut.plan).peak_bytes
    least = ilp.least_memory(problem)
    assert not least.cut and least.need < cut.need
    assert solve.solve(problem, cut.need, time_limit=0.0).status.startswith(solve.AT_TIME_LIMIT)
    with pytest.raises(InfeasibleError, match="found by the time limit"):
        solve.solve(problem, least.need, time_limit=0.0)
    # on a mesh searched in subspaces, the floor's steps too: the first subspace's most sharded plan
    problem = planning_problem(cap, infos, autopar.Mesh((2, 2, 2), ("dp", "sp", "tp"), device="h100"),
                               PlanOptions(symbolic=False))
    t = time.process_time()
    h = heuristic.subspace_plan(problem, float("inf"), time.perf_counter(), floor=False)
    assert time.process_time() - t < 0.2 and h.status.startswith("Feasible (the most sharded plan)")
    assert h.status.endswith(heuristic.STOPPED)


def test_past_the_deadline_the_floor_rounds_go_on_only_while_they_gain_much(monkeypatch):
    """The floor's local search (`heuristic._local`) runs its first round whatever the time limit; past the
    deadline another only after a round that gained more than PAST_GAIN, so a call ends nearer its limit;
    with time left (or no limit), rounds go on while they gain more than FLOOR_GAIN: a longer limit only
    adds rounds, and its plan is never slower."""
    import time
    gains = [0.10, 0.005, 0.004, 0.003, 0.0]       # each round's gain: over PAST_GAIN once, then under it

    def fake_round(problem, budget, best, views, memo):
        seen.append(best.objective_s)
        return heuristic.replace(best, objective_s=best.objective_s * (1 - gains[len(seen) - 1]))
    start = heuristic.Heuristic(({}, {}), 2.0, "start", "HiGHS", 1.0)
    monkeypatch.setattr(heuristic, "_rounded_near", fake_round)
    ends = {}
    for deadline in (time.perf_counter(), None):
        seen = []
        ends[deadline is None] = heuristic._local(None, 1.0, start, deadline, False, floor=True), len(seen)
    (cut, cut_rounds), (full, full_rounds) = ends[False], ends[True]
    assert cut_rounds == 2 and cut.objective_s == pytest.approx(2.0 * 0.90 * 0.995)
    assert full_rounds == 5 and full.objective_s == pytest.approx(2.0 * 0.90 * 0.995 * 0.996 * 0.997)
