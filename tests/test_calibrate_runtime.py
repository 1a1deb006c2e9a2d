"""The runtime and collective costs `autopar calibrate` measures (runtime_op_overhead,
collective_overhead, optimizer_param_overhead) and how `autopar.estimate` charges them.
Correctness only: no timing assertions."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest

import autopar
from autopar.calibrate.fit import fit_links
from autopar.cost_model.profiles import load_profile, save_profile
from autopar.estimate import estimate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from models import GPT, gpt_inputs  # noqa: E402

FIELDS = ("runtime_op_overhead", "collective_overhead", "optimizer_param_overhead", "optimizer_element_time")


def test_shipped_profiles_default_the_new_fields_and_round_trip(tmp_path):
    for name in ("cpu", "a100", "h100"):
        p = load_profile(name)
        # the CPU profile prices what a collective inside a step costs beyond its ring terms (its _notes)
        assert all(getattr(p, f) == 0.0 for f in FIELDS if (name, f) != ("cpu", "collective_overhead"))
    assert load_profile("cpu").collective_overhead > 0
    p = dataclasses.replace(load_profile("cpu"), runtime_op_overhead=1e-4, collective_overhead=2e-3,
                            optimizer_param_overhead=3e-4)
    assert load_profile(save_profile(p, tmp_path / "p.json")) == p
    with pytest.raises(ValueError):
        dataclasses.replace(p, collective_overhead=-1.0)


def _step_record(per_coll: float, seconds_per_byte: float, latency: float) -> dict:
    """One rank's `measure_step_collectives` on a (2, 2) mesh whose collectives cost exactly
    per_coll + ring latency + bytes * seconds_per_byte."""
    pts = {kind: [(nb, per_coll + steps * latency + nb * seconds_per_byte) for nb in (4096.0, 2.0 ** 21)]
           for kind, steps in (("all_reduce", 2), ("all_gather", 1))}
    # two all_reduces of 4 KiB at the bandwidth the fit will find (all_gather's slope: half the bytes)
    ring = 2 * latency + 4096.0 * (seconds_per_byte / 0.5 if seconds_per_byte else 1e-9)
    both = {"nbytes": 4096.0, "collectives": 2, "sizes": [2, 2], "seconds": 2 * (per_coll + ring)}
    return {"step_collectives": {"cycle": ["axis0", "axis1"], "burst_repeats": 4, "points": pts,
                                 "all_axes_all_reduce": both}}


def test_fit_links_takes_latency_from_isolated_collectives_and_the_rest_as_per_collective_cost():
    latency, kernel = 2e-4, 1e-5
    iso = {ax: {"size": 2, "fits": {k: {"bandwidth": 1e9, "latency": latency} for k in ("all_reduce", "all_gather")}}
           for ax in ("axis0", "axis1")}
    for ax in iso:      # a reduce_scatter 2.5x slower per byte than the all_gather
        iso[ax]["fits"]["reduce_scatter"] = {"bandwidth": 4e8, "latency": 1e-3}
    # a step moves bytes at 1/4 of the isolated bandwidth (all_reduce over 2 puts 1x its bytes on the wire)
    axes, record, links, overhead = fit_links([_step_record(3e-3, 4e-9, latency)] * 4, iso, kernel)
    assert overhead == pytest.approx(3e-3 - kernel)
    assert [link.latency for link in links] == [latency, latency]
    assert [link.reduce_scatter_factor for link in links] == [pytest.approx(2.5)] * 2
    assert links[0].bandwidth == pytest.approx(min(1 / 4e-9, 0.5 / 4e-9))      # all_gather: (n-1)/n on the wire
    assert set(axes) == {"axis0", "axis1"} and set(record["per_collective"]) == {"all_reduce", "all_gather",
                                                                              "all_axes_all_reduce"}
    # a step cannot move bytes faster than isolated collectives: a flat line is bounded by them
    _, _, links, _ = fit_links([_step_record(3e-3, 0.0, latency)] * 4, iso, kernel)
    assert links[0].bandwidth == pytest.approx(1e9)
    # a world of one measures no collective
    none = {"step_collectives": {"cycle": [], "burst_repeats": 4, "points": {}}}
    assert fit_links([none], {}, kernel) == ({}, {}, [], 0.0)


def test_fit_links_prices_a_small_collective_at_what_the_step_cycle_measured():
    """The per-collective cost is what the cycle measured beyond the ring latency of the link the
    profile prices every axis with (the slowest axis's), not beyond another axis's isolated latency:
    one axis reading 3 ms per ring step in back-to-back collectives (noise) must not eat the cost."""
    latency, noisy, kernel = 2e-4, 3e-3, 1e-5
    iso = {ax: {"size": 2, "fits": {k: {"bandwidth": 1e9, "latency": lat} for k in ("all_reduce", "all_gather")}}
           for ax, lat in (("axis0", latency), ("axis1", noisy))}
    axes, record, links, overhead = fit_links([_step_record(3e-3, 4e-9, latency)] * 4, iso, kernel)
    assert [link.latency for link in links] == [latency, noisy]      # each axis's own fit is kept on record
    assert overhead == pytest.approx(3e-3 - kernel)
    priced = min(links, key=lambda link: link.bandwidth)            # the profile's intra_node
    for kind, steps in (("all_reduce", 2), ("all_gather", 1)):
        intercept = record["lines"][kind]["intercept_s"]
        assert kernel + overhead + steps * priced.latency == pytest.approx(intercept)


def _est(profile, plan_kw):
    torch_model = GPT(vocab=64, seq=16, hidden=32, heads=4, layers=2)
    batch = gpt_inputs(batch=8, seq=16, vocab=64)
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device=profile)
    return estimate(torch_model, batch, mesh, plan_kw, batch_axes=("dp", "tp"))


def test_estimate_charges_each_measured_overhead():
    base = dataclasses.replace(load_profile("cpu"), collective_overhead=0.0)     # every overhead from 0
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


def _overlap_on_ranks(rank, world_size):
    from autopar.calibrate.runtime_costs import measure_overlap
    return measure_overlap((world_size,), ("axis0",), "cpu", quick=True)


def test_calibrate_measures_the_overlap_of_the_runtimes_buckets(rank_pool):
    """`autopar calibrate` times a data-parallel step whose every layer fills a bucket against the same
    compute with nothing to reduce and the buckets alone: the overlap it writes is a fraction."""
    for r in rank_pool(2).run(_overlap_on_ranks):
        assert r["buckets"] == r["depth"]               # one bucket per layer, as the measurement intends
        # times only (their order is the machine's: under load one bucket can read slower than all four)
        assert min(r["buckets_alone_s"], r["last_bucket_s"], r["step_s"], r["no_sync_s"]) > 0
        assert 0.0 <= r["overlap"] <= 1.0
