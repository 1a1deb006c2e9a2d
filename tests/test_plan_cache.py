"""The plan cache's key (every option that changes a plan, the graph's constants) and the solver's
status in words (issue 37)."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.passes.capture import capture
from autopar.planner.cache import NOT_KEYED, PlanCache
from autopar.planner.solve import PlanOptions, fingerprint
from autopar.solver.heuristic import LEAST_STATUS, STOPPED
from autopar.solver.solve import ALTERNATED, AT_TIME_LIMIT, OPTIMAL, OPTIMAL_ALTERNATION, status_words

# one value per option that changes the plan, other than its default
CHANGED = dict(memory_budget=2**30, pins={"w": ("R",)}, batch_axes=("dp",), sharded_outputs=True, optimizer="sgd",
               time_limit=1.0, symbolic=False, recompute="full", residency="keep", offload="none",
               precision="same", pipeline={"axis": "dp"}, moe_capacity_factor=1.25, stage=True)


def test_every_option_that_changes_a_plan_is_in_the_cache_key(tmp_path):
    cache, mesh = PlanCache(tmp_path), autopar.Mesh((2,), ("dp",), device="h100")
    # a new option is either keyed or named as one that cannot change the plan
    assert set(CHANGED) | set(NOT_KEYED) == {f.name for f in dataclasses.fields(PlanOptions)}
    base = PlanOptions(progress=False)
    key = cache.key("f" * 16, mesh, base)
    for name, value in CHANGED.items():
        assert cache.key("f" * 16, mesh, dataclasses.replace(base, **{name: value})) != key, name
    for name, value in dict(progress=True, cache_dir=str(tmp_path), on_phase=print).items():
        assert cache.key("f" * 16, mesh, dataclasses.replace(base, **{name: value})) == key, name
    assert cache.key("e" * 16, mesh, base) != key
    assert cache.key("f" * 16, autopar.Mesh((2,), ("tp",), device="h100"), base) != key


class Attend(torch.nn.Module):
    def __init__(self, dim: int, causal: bool):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.dim, self.causal = dim, causal

    def forward(self, x):
        y = F.scaled_dot_product_attention(x, x, x, is_causal=self.causal)
        return torch.softmax(self.proj(y), dim=self.dim)


def test_fingerprint_includes_constant_arguments():
    x = torch.randn(2, 4, 8, 16)

    def fp(dim, causal):
        return fingerprint(capture(Attend(dim, causal), (x,)))
    assert fp(-1, True) == fp(-1, True)
    assert fp(-1, True) != fp(-2, True)          # a softmax over another dim
    assert fp(-1, True) != fp(-1, False)         # attention without the causal mask


def test_status_words():
    assert status_words("Optimal", 0.0, timed_out=False) == OPTIMAL
    assert status_words("Optimal (the LP relaxation rounded, gap 0.01%)", 1e-4,
                        timed_out=True) == f"{OPTIMAL} (the LP relaxation rounded)"   # proven, whatever the clock
    raw = f"{ALTERNATED}, each optimal for the other; ...; the plan's layout solve: Optimal)"
    assert status_words(raw, 1.0, timed_out=False) == OPTIMAL_ALTERNATION
    stopped = "Feasible (stopped: time limit reached, gap 3.25%)"
    assert status_words(stopped, 0.0325, timed_out=True) == f"{AT_TIME_LIMIT}, gap 3.25%"
    # no gap where none bounds the plan: the solver proved none (100%), or it bounds the alternation's
    # layouts for fixed options only
    assert status_words(stopped, 1.0, timed_out=True) == AT_TIME_LIMIT
    assert status_words(f"{ALTERNATED} ...; the plan's layout solve: {stopped})", 0.0325,
                        timed_out=True) == AT_TIME_LIMIT
    assert status_words("Feasible (the most sharded plan)", 1.0, timed_out=True) == AT_TIME_LIMIT
    assert "gap" not in status_words("Feasible (solved in subspaces: ...)", math.nan, timed_out=False)
    # the plan that needs least memory: proven the answer, or the best the time limit left
    assert not status_words(LEAST_STATUS, 1.0, timed_out=True).startswith(AT_TIME_LIMIT)
    assert status_words(LEAST_STATUS + STOPPED, 1.0, timed_out=True).startswith(AT_TIME_LIMIT)


def test_a_solved_plan_says_optimal_in_its_report():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
        x = torch.randn(32, 64)
    plan = autopar.plan(model, (x,), autopar.Mesh((2,), ("dp",), device="h100"), symbolic=False)
    assert plan.solver.status == OPTIMAL
    line = next(s for s in plan.report().splitlines() if s.strip().startswith("solver:"))
    assert f" {OPTIMAL} " in line and "gap" not in line


@pytest.mark.parametrize("limit", [None, 5.0])
def test_cache_serves_a_plan_only_to_the_same_time_limit(tmp_path, limit):
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
        x = torch.randn(16, 64)
    mesh = autopar.Mesh((2,), ("dp",), device="h100")
    first = autopar.plan(model, (x,), mesh, cache_dir=str(tmp_path), time_limit=limit, symbolic=False)
    again = autopar.plan(model, (x,), mesh, cache_dir=str(tmp_path), time_limit=limit, symbolic=False)
    other = autopar.plan(model, (x,), mesh, cache_dir=str(tmp_path), time_limit=1.0, symbolic=False)
    assert again.timings.cached and not first.timings.cached and not other.timings.cached


def test_scaling_is_priced_when_first_read_and_saved_alike():
    """`plan()` leaves the symbolic costs to their first reader (they trace the model once more);
    reading them, or saving the plan, prices them, and the saved plan is the same either way."""
    from memory_checks import gpt
    model, inputs = gpt(hidden=32, batch=8, layers=2)
    mesh = autopar.Mesh((2,), ("dp",), device="h100")
    saved_first = autopar.plan(model, inputs, mesh, progress=False)
    assert saved_first.pending_scaling is not None and saved_first.timings.scaling_s == 0
    text = saved_first.to_json()                                    # saving prices it
    assert saved_first.pending_scaling is None and not saved_first.scaling.unavailable
    read_first = autopar.plan(model, inputs, mesh, progress=False)
    assert read_first.estimate_at(batch=16).step_time_s > read_first.estimate.step_time_s
    assert read_first.timings.scaling_s > 0 and read_first.to_json() == text


def test_the_pipeline_search_stops_at_its_time_limit_with_the_best_so_far(monkeypatch):
    """`time_limit` bounds the whole call (issue 37): out of time with a plan in hand, the search starts
    nothing more, neither another group's solve nor the pricing of the solved group's other pipelines
    (each prices the whole model at every boundary and memory option: 0.85 CPU s apiece on Llama-3-405B,
    127 of the 186 CPU s its 60 s call took), and the status names the groups it left."""
    from memory_checks import gpt
    from autopar.solver.decisions import stages
    priced = []

    def evaluate(problem, choice, options, staging=None, memo=None):
        priced.append((staging.pipe.schedule, staging.pipe.virtual_stages))
        return real(problem, choice, options, staging, memo)
    real = stages.evaluate
    monkeypatch.setattr(stages, "evaluate", evaluate)
    model, inputs = gpt(hidden=32, batch=8, layers=4)
    mesh = autopar.Mesh((2, 2), ("pp", "dp"), device="h100")
    plan = autopar.plan(model, inputs, mesh, batch_axes=("dp",), symbolic=False, progress=False, time_limit=0)
    assert plan.solver.status.startswith(f"{AT_TIME_LIMIT}: 1 of ")     # the first group solved, no more
    assert "1 not searched (no pipeline)" in plan.solver.status
    assert len(set(priced)) == 1          # of its pipelines (schedules, virtual stages), the first that fits
    assert plan.pipeline.axis == "pp" and plan.estimate.peak_memory_bytes <= mesh.profile.memory_capacity
