"""Gradients on the host (`plan.offload["gradients:<layer>"] = "host"`): moved out as they are made,
back for their own update; trained on 2 gloo ranks against one process, memory measured against the
evaluator's prediction."""
from __future__ import annotations

import pytest

from rank_pool import get_pool

from memory_checks import run_variants

TOL = 1e-4
# measured 2.4% over to 5.5% under on this GPT (before the buckets' buffers were priced from their first
# gradient on and without the gradients on the host: 12-17% over)
PEAK_TOLERANCE = 0.08
BLOCKS = ("blocks.0", "blocks.1")
VARIANTS = {
    "none": {},
    "grads_host": {"offload": {f"gradients:{b}": "host" for b in BLOCKS}},
    "grads_and_opt_host": {"offload": {**{f"gradients:{b}": "host" for b in BLOCKS},
                                       **{f"optimizer:{b}": "host" for b in BLOCKS}}},
}


@pytest.fixture(scope="module")
def dp():
    return get_pool(2).run(run_variants, (2,), ("dp",), None, VARIANTS)


def test_gradients_on_the_host_train_exactly(dp):
    for r in dp:
        for name in ("grads_host", "grads_and_opt_host"):
            for key in ("loss", "grad", "param"):
                assert r[name][key] < TOL, (name, key, r[name][key])


def test_gradients_on_the_host_leave_the_device_as_predicted(dp):
    for r in dp:
        none, out = r["none"], r["grads_host"]
        block_grads = 4 * sum(n for k, n in out["local_numel"].items() if k.startswith("blocks."))
        assert out["pool_after_bwd"] == block_grads                # the blocks' gradients, on the host
        assert none["before_step"] - out["before_step"] >= block_grads      # ... and not on the device
        assert out["predicted_host"] == out["pool_after_bwd"]
        for name in VARIANTS:
            # device bytes after the backward (what the family changes), measured and as the evaluator prices it
            measured, predicted = r[name]["before_step"], r[name]["predicted_state"]
            assert abs(measured - predicted) <= 0.02 * measured, (name, measured, predicted)
            # the step's peak, measured and priced (the gradient buckets' buffers from their first gradient
            # on, without the gradients reduced alone: Problem.buckets_from, offload.gradients_out)
            measured, predicted = r[name]["peak_device"], r[name]["predicted_peak"]
            assert abs(predicted / measured - 1) < PEAK_TOLERANCE, (name, measured, predicted)
        # the step's peak never rises, measured or priced: on some of the tied layouts the peak is the
        # loss's backward, before any gradient is made, where moving gradients cannot lower it; the
        # gradients leaving the device are checked above, after the backward
        assert out["peak_device"] <= none["peak_device"] and out["predicted_peak"] <= none["predicted_peak"]


def test_the_planner_moves_gradients_to_the_host_when_the_budget_needs_it():
    """offload="auto": under a tight budget the planner moves gradients to the host (the plan file keeps
    the decision, the evaluator prices it within the budget); a fixed offload="host" keeps its meaning
    (activations and optimizer state), gradients stay on the device."""
    import autopar
    from memory_checks import gpt
    model, inputs = gpt()
    n = sum(p.numel() for p in model.parameters())
    mesh = autopar.Mesh((1,), ("dp",), device="cpu", host_memory=2**30)
    plan = autopar.plan(model, inputs, mesh, memory_budget=9 * n, symbolic=False)
    grads = {k: v for k, v in plan.offload.items() if k.startswith("gradients:")}
    assert "host" in grads.values(), plan.offload
    assert plan.estimate.peak_memory_bytes <= 9 * n and plan.estimate.family_s["offload"] > 0
    assert autopar.Plan.from_json(plan.to_json()).offload == plan.offload
    fixed = autopar.plan(model, inputs, mesh, offload="host", recompute="none", symbolic=False)
    assert {v for k, v in fixed.offload.items() if k.startswith("gradients:")} == {"device"}
