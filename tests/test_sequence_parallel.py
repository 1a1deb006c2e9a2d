"""Megatron sequence parallelism (Korthikanti et al. 2022): the layer norms and the residual stream
split on the sequence over the tensor-parallel axis, an all-gather before each column matmul and a
reduce-scatter after each row matmul, and the column matmul's saved input kept sequence-sharded and
all-gathered again in the backward (`Plan.residency["activations:<layer>"] = "regather"`).
Trained on 4 gloo ranks against one process; memory measured with `MemoryMeter` and priced by the
planner's evaluator.
"""
from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.passes.capture import capture
from autopar.passes.shape_prop import annotate
from autopar.planner import PlanOptions, plan_assignment, planning_problem
from autopar.solver.evaluate import evaluate
from dist_checks import shard_happy_profile
from memory_checks import SP_PINS, gpt, run_variants
from rank_pool import get_pool

TOL = 1e-4
TP = 4
REGATHER = {"residency": {"activations:blocks.0": "regather", "activations:blocks.1": "regather"}}
# per block, the inputs of the qkv and fc matmuls are gathered: [batch 4, seq 16, hidden 32] in fp32
GATHERED_BYTES = 2 * 2 * 4 * 16 * 32 * 4


@pytest.fixture(scope="module")
def trained():
    return get_pool(TP).run(run_variants, (TP,), ("tp",), SP_PINS, {"keep": {}, "regather": REGATHER})


def test_sequence_parallel_plan_has_megatron_sp_collectives():
    model, inputs = gpt()
    plan = autopar.plan(model, inputs, autopar.Mesh((TP,), ("tp",), device=shard_happy_profile()), pins=SP_PINS,
                        symbolic=False, residency="keep")
    kinds = {n.name: [c.kind for c in n.collectives if c.phase == "forward"] for n in plan.nodes}
    assert kinds["linear"] == ["all_gather@tp"] and kinds["linear_2"] == ["all_gather@tp"]   # before column
    assert kinds["add_1"] == ["reduce_scatter@tp"] and kinds["add_2"] == ["reduce_scatter@tp"]   # after row


def test_regathered_sequence_parallel_trains_exactly_and_saves_the_shard_only(trained):
    for r in trained:
        for name in ("keep", "regather"):
            for key in ("loss", "grad", "param"):
                assert r[name][key] < TOL, (name, key, r[name][key])
        assert r["regather"]["act_gathers"] == 4 and r["keep"]["act_gathers"] == 0   # qkv's and fc's inputs
        # each rank keeps 1/TP of each gathered input instead of all of it, between forward and backward
        assert r["keep"]["fwd_device"] - r["regather"]["fwd_device"] == GATHERED_BYTES * (TP - 1) // TP


def test_planner_prices_the_regather_and_chooses_it_under_a_budget():
    model, inputs = gpt()
    mesh = autopar.Mesh((TP,), ("tp",), device=shard_happy_profile())
    plan = autopar.plan(model, inputs, mesh, pins=SP_PINS, symbolic=False, residency="keep")
    cap = capture(model, inputs)
    problem = planning_problem(cap, annotate(cap.gm), mesh, PlanOptions.from_dict(plan.options | {"residency": "auto"}))
    keep = evaluate(problem, *plan_assignment(problem, plan))
    regather = evaluate(problem, *plan_assignment(problem, dataclasses.replace(plan, **REGATHER)))
    end = problem.live.end_index
    # the model counts each gathered copy whole under "keep" (and the shard saved either way)
    assert keep.points[end] - regather.points[end] == GATHERED_BYTES
    assert regather.family_s["residency"] > 0 and regather.comm_s == keep.comm_s
    budget = (keep.peak_bytes + regather.peak_bytes) / 2
    chosen = autopar.plan(model, inputs, mesh, pins=SP_PINS, symbolic=False, memory_budget=budget, recompute="none",
                          offload="none")
    assert chosen.estimate.peak_memory_bytes <= budget
    assert "regather" in {chosen.residency.get(f"activations:blocks.{i}") for i in range(2)}
