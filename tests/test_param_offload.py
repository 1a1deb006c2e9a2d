"""Parameters off the device (`plan.offload["parameters:<layer>"]` = "host" or "disk"): stored in the
host pool or in memory-mapped files, brought to the device for each use; trained on 2 gloo ranks
against one process."""
from __future__ import annotations

import pytest

from rank_pool import get_pool

from memory_checks import unpriced_variants

TOL = 1e-4
BLOCKS = ("blocks.0", "blocks.1")
VARIANTS = {
    "params_host": {"offload": {f"parameters:{b}": "host" for b in BLOCKS}},
    "params_and_opt_host": {"offload": {**{f"parameters:{b}": "host" for b in BLOCKS},
                                        **{f"optimizer:{b}": "host" for b in BLOCKS}}},
    "params_disk": {"offload": {f"parameters:{b}": "disk" for b in BLOCKS}},
}


@pytest.fixture(scope="module")
def dp():
    return get_pool(2).run(unpriced_variants, (2,), ("dp",), None, VARIANTS)


def test_parameters_on_the_host_train_exactly(dp):
    for r in dp:
        for name in VARIANTS:
            for key in ("loss", "grad", "param"):
                assert r[name][key] < TOL, (name, key, r[name][key])


def test_parameters_on_the_host_live_in_the_pool(dp):
    for r in dp:
        out = r["params_host"]
        block_params = 4 * sum(n for k, n in out["local_numel"].items() if k.startswith("blocks."))
        assert out["pool_after_step"] == block_params


def test_parameters_on_disk_live_in_files_off_the_device(dp):
    for r in dp:
        disk, device = r["params_disk"], r["params_host"]
        n_block_params = sum(1 for k in disk["local_numel"] if k.startswith("blocks."))
        assert disk["files_after_fwd"] == disk["files_after_bwd"] == n_block_params
        assert disk["pool_after_step"] == 0 and disk["before_step"] == device["before_step"]


def test_the_planner_puts_parameters_on_the_host_when_the_budget_needs_it():
    """offload="auto": a budget below what optimizer, gradient and activation offload reach is met by
    parameters on the host (plan.offload shows it, the evaluator prices it within the budget, the report
    shows its seconds and bytes); offload="none" cannot meet it."""
    import autopar
    from memory_checks import gpt
    model, inputs = gpt()
    n = sum(p.numel() for p in model.parameters())
    mesh = autopar.Mesh((1,), ("dp",), device="cpu", host_memory=2**30)
    plan = autopar.plan(model, inputs, mesh, memory_budget=7 * n, symbolic=False)
    assert "host" in {v for k, v in plan.offload.items() if k.startswith("parameters:")}, plan.offload
    assert plan.estimate.peak_memory_bytes <= 7 * n and plan.estimate.family_s["offload"] > 0
    assert autopar.Plan.from_json(plan.to_json()).offload == plan.offload
    with pytest.raises(autopar.InfeasibleError):
        autopar.plan(model, inputs, mesh, memory_budget=7 * n, offload="none", symbolic=False)
    # a disk and no host tier: at the least memory the planner finds, parameters are on disk
    mesh = autopar.Mesh((1,), ("dp",), device="cpu", host_memory=0, disk=2**30)
    with pytest.raises(autopar.InfeasibleError) as e:
        autopar.plan(model, inputs, mesh, memory_budget=1, symbolic=False)
    least = e.value.min_memory_bytes
    disk = autopar.plan(model, inputs, mesh, memory_budget=least, symbolic=False)
    assert "disk" in {v for k, v in disk.offload.items() if k.startswith("parameters:")}, disk.offload
    assert disk.estimate.peak_memory_bytes <= least
