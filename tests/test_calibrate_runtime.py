"""The runtime and collective costs `autopar calibrate` measures (runtime_op_overhead,
collective_overhead, optimizer_param_overhead) and how `autopar.estimate` charges them.
Correctness only: no timing assertions."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest

import autopar
from autopar.cost_model.calibrate import _fit_overhead
from autopar.cost_model.profiles import load_profile, save_profile
from autopar.estimate import estimate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from models import GPT, gpt_inputs  # noqa: E402

FIELDS = ("runtime_op_overhead", "collective_overhead", "optimizer_param_overhead", "optimizer_element_time")


def test_shipped_profiles_default_the_new_fields_and_round_trip(tmp_path):
    for name in ("cpu", "a100", "h100"):
        p = load_profile(name)
        assert all(getattr(p, f) == 0.0 for f in FIELDS)
    p = dataclasses.replace(load_profile("cpu"), runtime_op_overhead=1e-4, collective_overhead=2e-3,
                            optimizer_param_overhead=3e-4)
    assert load_profile(save_profile(p, tmp_path / "p.json")) == p
    with pytest.raises(ValueError):
        dataclasses.replace(p, collective_overhead=-1.0)


def test_fit_overhead_splits_per_collective_and_per_step():
    # 2 devices: all_reduce = c + 2 alpha, all_gather = c + alpha
    c, alpha = _fit_overhead(2, {"all_reduce": 1e-3 + 2 * 2e-4, "all_gather": 1e-3 + 2e-4})
    assert c == pytest.approx(1e-3) and alpha == pytest.approx(2e-4)
    c, alpha = _fit_overhead(2, {"all_reduce": 1e-3, "all_gather": 2e-3})     # noise: alpha < 0 -> 0
    assert alpha == 0.0 and c == pytest.approx(1.5e-3)


def _est(profile, plan_kw):
    torch_model = GPT(vocab=64, seq=16, hidden=32, heads=4, layers=2)
    batch = gpt_inputs(batch=8, seq=16, vocab=64)
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device=profile)
    return estimate(torch_model, batch, mesh, plan_kw, batch_axes=("dp", "tp"))


def test_estimate_charges_each_measured_overhead():
    base = load_profile("cpu")
    pins = {n: ("R", "R") for n, _ in GPT(vocab=64, seq=16, hidden=32, heads=4, layers=2).named_parameters()}
    e0 = _est(base, pins)
    assert e0.runtime_s == 0.0 and e0.graph_nodes > 0
    n_params = len(e0.layout_summary)

    e1 = _est(dataclasses.replace(base, runtime_op_overhead=1e-3), pins)       # per node of the rank's graph
    assert e1.graph_nodes == e0.graph_nodes
    assert e1.runtime_s == pytest.approx(e0.graph_nodes * 1e-3)
    assert e1.step_time_s - e0.step_time_s == pytest.approx(e0.graph_nodes * 1e-3)

    e2 = _est(dataclasses.replace(base, optimizer_param_overhead=1e-3), pins)  # per parameter tensor
    assert e2.optimizer_s - e0.optimizer_s == pytest.approx(n_params * 1e-3)
    # a measured time per element replaces the fused roofline: the step is then linear in the elements
    e4 = _est(dataclasses.replace(base, optimizer_element_time=1e-8), pins)
    e5 = _est(dataclasses.replace(base, optimizer_element_time=2e-8), pins)
    assert e5.optimizer_s == pytest.approx(2 * e4.optimizer_s) and e4.optimizer_s != e0.optimizer_s

    # every collective Mesh.reshard_cost prices (resharding edges, gradient sync) pays it once
    from torch.distributed.tensor import Partial, Replicate
    m0 = autopar.Mesh((2, 2), ("dp", "tp"), device=base)
    m1 = autopar.Mesh((2, 2), ("dp", "tp"), device=dataclasses.replace(base, collective_overhead=1e-3))
    args = ((64, 32), 4, (Partial(), Partial()), (Replicate(), Replicate()))
    r0, r1 = m0.reshard_cost(*args), m1.reshard_cost(*args)
    assert len(r1.collectives) == 2 and r1.seconds - r0.seconds == pytest.approx(2e-3)
    e3 = _est(dataclasses.replace(base, collective_overhead=1e-3), pins)
    assert e3.comm_s + e3.grad_sync_s > e0.comm_s + e0.grad_sync_s
