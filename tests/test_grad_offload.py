"""Gradients on the host (`plan.offload["gradients:<layer>"] = "host"`): moved out as they are made,
back for their own update; trained on 2 gloo ranks against one process, memory measured against the
evaluator's prediction."""
from __future__ import annotations

import pytest

from rank_pool import get_pool

from memory_checks import run_variants

TOL = 1e-4
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
        # the step's peak falls, measured and predicted
        assert out["peak_device"] < none["peak_device"] and out["predicted_peak"] < none["predicted_peak"]


def test_the_planner_offers_gradients_to_the_host():
    """offload="host" puts every gradient on the host with the optimizer state; the plan file keeps the
    decision, and the evaluator prices it: the state after the backward holds no gradient, the host
    holds them, the step pays their trips."""
    import autopar
    from memory_checks import gpt
    model, inputs = gpt()
    mesh = autopar.Mesh((1,), ("dp",), device="cpu", host_memory=2**30)
    kept = autopar.plan(model, inputs, mesh, offload="none", recompute="none", symbolic=False)
    moved = autopar.plan(model, inputs, mesh, offload="host", recompute="none", symbolic=False)
    assert moved.offload["gradients:blocks.0"] == moved.offload["gradients:blocks.1"] == "host"
    assert autopar.Plan.from_json(moved.to_json()).offload == moved.offload
    grads = 4 * sum(p.numel() for p in model.parameters())          # fp32 gradients, one device
    state = 16 * sum(p.numel() for p in model.parameters())
    assert kept.estimate.param_state_bytes == state
    assert moved.estimate.param_state_bytes == state - grads - 8 * sum(p.numel() for p in model.parameters())
    assert moved.estimate.family_s["offload"] > 0
