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
        for name in VARIANTS:
            measured, predicted = r[name]["peak_device"], r[name]["predicted_peak"]
            assert abs(measured - predicted) <= 0.05 * measured, (name, measured, predicted)
