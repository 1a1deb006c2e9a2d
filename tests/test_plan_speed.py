"""Planning under a time limit: the heuristic plan is the floor, so a longer limit never gives a
slower plan and a short one is close to the best; the pulp fallback solves the same model."""
from __future__ import annotations

import pytest
import torch

import autopar  # noqa: E402
from autopar.solver import mip  # noqa: E402


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
def tight(unbounded):
    """A budget that needs memory decisions: 75% of the peak of the best plan without a budget (at 80%
    the LP relaxation's rounded layouts, solved without presolve, fit with none)."""
    return 0.75 * unbounded.estimate.peak_memory_bytes


def test_longer_time_limit_never_gives_a_slower_plan(tight):
    plans = [_plan(t, tight) for t in (0.01, 1.0, 4.0)]
    steps = [p.solver.objective_s for p in plans]          # what the solver minimises
    assert steps[0] >= steps[1] * (1 - 1e-9) and steps[1] >= steps[2] * (1 - 1e-9)
    assert steps[1] <= 1.25 * steps[2]                  # 1 s of solving: within 1.25x of 4 s
    assert "time limit" in plans[0].solver.status        # a plan the limit cut short says so
    for p in plans:
        assert p.estimate.peak_memory_bytes <= tight * (1 + 1e-9)
        assert {v for d in (p.recompute, p.residency, p.offload) for v in d.values()} - {"none", "keep", "device"}


def test_pulp_fallback_finds_the_same_optimum(monkeypatch):
    best = _plan(None, 1.6 * 2**30, shape=(4,))
    monkeypatch.setattr(mip, "highs_available", lambda: False)
    plan = _plan(None, 1.6 * 2**30, shape=(4,))
    assert best.solver.solver == "HiGHS" and plan.solver.solver == "CBC" and plan.solver.status == "Optimal"
    assert plan.solver.objective_s == pytest.approx(best.solver.objective_s, rel=1e-6)


def test_alternated_plan_on_a_large_model_is_close_to_the_joint_optimum(tight, monkeypatch):
    """Where the joint model is not built (large models), layouts and memory options are alternated:
    the plan fits, is priced as estimate() prices it, and is near the joint model's optimum."""
    from autopar.solver import ilp, prune
    monkeypatch.setattr(prune, "SUBSPACE_FROM", float("inf"))     # solved whole, not in subspaces
    joint = _plan(None, tight)
    monkeypatch.setattr(ilp, "JOINT_MAX_COLUMNS", 0)
    alone = _plan(None, tight)
    assert alone.solver.status.startswith("Feasible (layouts and memory options alternated")
    assert alone.estimate.peak_memory_bytes <= tight * (1 + 1e-9)
    assert alone.solver.objective_s <= 1.05 * joint.solver.objective_s
    assert alone.solver.objective_s >= joint.solver.objective_s * (1 - 1e-3)      # the joint model's gap


def test_three_axis_model_too_large_to_solve_whole_is_planned_in_subspaces(tight, monkeypatch):
    """On a mesh of three or more axes a layout model too large to solve whole (Llama-3-8B on (4, 4, 4):
    1.24M columns) is solved in subspaces: the best plan with two mesh axes merged is the floor, found
    whatever the time limit; local search improves it while time remains, never giving a slower plan."""
    from autopar.solver import prune
    monkeypatch.setattr(prune, "SUBSPACE_FROM", float("inf"))
    best = _plan(None, tight)                      # small enough here to solve whole: the optimum
    monkeypatch.setattr(prune, "SUBSPACE_FROM", 0)
    plans = [_plan(t, tight) for t in (0.01, 1.0, None)]
    steps = [p.solver.objective_s for p in plans]
    assert all(p.solver.status.startswith("Feasible (solved in subspaces") for p in plans)
    assert steps[0] >= steps[1] * (1 - 1e-9) and steps[1] >= steps[2] * (1 - 1e-9)
    assert steps[0] <= 1.25 * best.solver.objective_s       # the floor alone: within 1.25x of the optimum
    assert steps[2] >= best.solver.objective_s * (1 - 1e-3)
    for p in plans:
        assert p.estimate.peak_memory_bytes <= tight * (1 + 1e-9)
