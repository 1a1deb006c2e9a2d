"""The plan's memory decisions, executed: each trains exactly like one process and does to memory
what it says (measured on real gloo ranks with `autopar.runtime.memory_meter.MemoryMeter`).

Plans come from `autopar.plan`; the decisions are set on them by hand (`dataclasses.replace(plan,
recompute=..., residency=..., offload=...)`), as a planner that chose them would.
"""
from __future__ import annotations

import pytest

from rank_pool import get_pool

from memory_checks import (TP_PINS, ZERO3_PINS, bad_memory_plans, mixed_precision_state, optimizer_state_bytes,
                           run_variants, unpriced_variants)

TOL = 1e-4
BLOCKS = ("blocks.0", "blocks.1")
LINEARS = ("attn.qkv", "attn.proj", "fc", "fc2")


def each(value, prefix=""):
    return {f"{prefix}{b}": value for b in BLOCKS}


DP_VARIANTS = {
    "none": {},
    "full": {"recompute": each("full")},
    "selective": {"recompute": each("selective")},
    # one tier per block: the two blocks are alike, so each tier's bytes are checked on its own block
    "act_host_disk": {"offload": {"activations:blocks.0": "host", "activations:blocks.1": "disk"}},
    "opt_disk_host": {"offload": {"optimizer:blocks.0": "disk", "optimizer:blocks.1": "host"}},
    "planner": None,          # the memory decisions autopar.plan made itself
}
RECOMPUTE_VARIANTS = {k: DP_VARIANTS[k] for k in ("none", "full", "selective")}
TP_VARIANTS = {**RECOMPUTE_VARIANTS, "act_host": {"offload": each("host", "activations:")}}
REGATHERED = [f"blocks.{i}.{w}.weight" for i in range(2) for w in LINEARS]


@pytest.fixture(scope="module")
def dp():
    return get_pool(2).run(unpriced_variants, (2,), ("dp",), None, DP_VARIANTS, timeout=600)


@pytest.fixture(scope="module")
def tp():
    # priced where a test reads the price: activation offload's host bytes
    return get_pool(2).run(run_variants, (2,), ("tp",), TP_PINS, TP_VARIANTS, 0.0, None, True, None, ("act_host",),
                           timeout=600)


def exact(results, name):
    for r in results:
        for key in ("loss", "grad", "param"):
            assert r[name][key] < TOL, (name, key, r[name][key])


@pytest.mark.parametrize("mesh", ["dp", "tp"])
def test_recompute_trains_exactly_and_keeps_less(request, mesh):
    results = request.getfixturevalue(mesh)
    for name in ("full", "selective"):
        exact(results, name)
        assert results[0][name]["regions"] == list(BLOCKS)
    for r in results:
        kept = {k: r[k]["fwd_device"] for k in RECOMPUTE_VARIANTS}   # bytes alive between forward and backward
        assert kept["full"] < kept["selective"] < kept["none"], kept
        assert r["full"]["peak_fwd_bwd"] < r["none"]["peak_fwd_bwd"]


def test_recompute_replays_dropout(rank_pool, dp):
    results = rank_pool(2).run(unpriced_variants, (2,), ("dp",), None, RECOMPUTE_VARIANTS, 0.1, None, False)
    for r in results:
        base = r["none"]
        assert base["losses"] != dp[0]["none"]["losses"], "dropout must change the loss"
        for name in ("full", "selective"):
            assert r[name]["losses"] == base["losses"]
            for k, g in base["grads"].items():
                assert float((r[name]["grads"][k] - g).abs().max()) <= TOL * float(g.abs().max()), k
            for k, p in base["params"].items():
                assert float((r[name]["params"][k] - p).abs().max()) <= TOL * float(p.abs().max()), k


def test_regather_frees_the_gathered_copy_until_the_backward(rank_pool):
    regather = {"residency": {k: "regather" for k in REGATHERED}}
    results = rank_pool(2).run(unpriced_variants, (2,), ("dp",), ZERO3_PINS,
                               {"keep": {}, "regather": regather,
                                "regather_from_host": {**regather, "offload": each("host", "parameters:")},
                                "regather_act_host": {**regather, "offload": each("host", "activations:")}})
    exact(results, "regather")
    exact(results, "regather_from_host")
    exact(results, "regather_act_host")
    for r in results:
        assert r["regather"]["gathers"] > 0
        assert r["regather"]["layer_gathers"] == list(BLOCKS)       # one flat gather per block (layer_gather.py)
        # activations offloaded to the host: the blocks still gather flat (priced so: residency.layer_regather)
        assert r["regather_act_host"]["layer_gathers"] == list(BLOCKS)
        assert r["regather_act_host"]["fwd_device"] < r["regather"]["fwd_device"]
        assert r["regather_from_host"]["layer_gathers"] == []      # fetched from the host: gathered one by one
        # each regathered weight is whole when gathered (one axis): its fp32 bytes, no longer kept
        whole_bytes = 4 * sum(2 * r["regather"]["local_numel"][k] for k in REGATHERED)
        assert r["keep"]["fwd_device"] - r["regather"]["fwd_device"] == whole_bytes
        # gathered from the host: the same copies freed, and the blocks' stored shards off the device too
        host = r["regather_from_host"]
        block_bytes = 4 * sum(n for k, n in host["local_numel"].items() if k.startswith("blocks."))
        assert r["regather"]["fwd_device"] - host["fwd_device"] == block_bytes == host["fwd_host"]


ACCURACY_VARIANTS = {**{k: DP_VARIANTS[k] for k in ("none", "full", "selective")},
                     "act_host": TP_VARIANTS["act_host"], "opt_host": {"offload": each("host", "optimizer:")}}


# benchmarks/bench_memory.py measures every family within 7% on a quiet machine; one run of the
# suite under load measured selective recomputation 0.5 MB higher (-11.8%): a buffer some collective
# holds was released later. The runtime's old buckets, which held every gradient to the end of the
# backward, were 20% off.
PEAK_TOLERANCE = 0.15


def test_predicted_peak_memory_is_measured_within_tolerance(rank_pool):
    """For each memory decision the planner's price of the step's peak (forward and backward: the
    liveness points, the copies kept, the gradient buckets' buffers) is the measured peak of live
    tensor bytes within PEAK_TOLERANCE, on a GPT whose activations and gradients are a few MB and
    whose gradient buckets are as small against them as DDP's 25 MiB against a large model's
    gradients (benchmarks/bench_memory.py prints the same for every family)."""
    model_kw = dict(hidden=128, seq=64, batch=8, layers=2)
    for r in rank_pool(2).run(run_variants, (2,), ("dp",), None, ACCURACY_VARIANTS, 0.0, model_kw, False, 65536,
                              timeout=300):
        for name in ACCURACY_VARIANTS:
            assert abs(r[name]["predicted_peak"] / r[name]["peak_fwd_bwd"] - 1) < PEAK_TOLERANCE, \
                (name, r[name]["predicted_peak"], r[name]["peak_fwd_bwd"])


def test_the_planners_own_memory_decisions_train_exactly(dp):
    """Planned under 80% of the undecided plan's peak: the planner must free memory, and what it
    chose trains exactly."""
    exact(dp, "planner")
    assert all(r["planner"]["decisions"] for r in dp), dp[0]["planner"]["decisions"]


def test_activation_offload_moves_saved_tensors_to_the_host_pool_and_to_files(dp):
    """blocks.0's saved tensors go to the host pool, blocks.1's to files; both come back in the backward."""
    exact(dp, "act_host_disk")
    for r in dp:
        moved = r["act_host_disk"]
        assert moved["pool_after_fwd"] > 0 and moved["fwd_host"] == moved["pool_after_fwd"]   # files are no host memory
        assert moved["files_after_fwd"] > 0
        assert moved["pool_after_bwd"] == 0 and moved["files_after_bwd"] == 0
        # the alike blocks' activations each leave the device: about twice what the host holds
        assert r["none"]["fwd_device"] - moved["fwd_device"] > 1.5 * moved["pool_after_fwd"], \
            (r["none"]["fwd_device"], moved["fwd_device"], moved["pool_after_fwd"])


# what the host pool holds after the forward against the plan's price of it; the price leaves out some 6%
# on these GPTs under data and tensor parallelism alike (a small saved tensor per block, not a copy)
HOST_TOLERANCE = 0.1


def test_activation_offload_moves_what_the_plan_prices_under_tensor_parallelism(tp):
    """Column products split over "tp" save their input gathered (a resharded copy), not the sharded
    activation it was made from: offload moves the copy alone, and the plan prices the copy alone."""
    exact(tp, "act_host")
    for r in tp:
        moved = r["act_host"]
        assert moved["pool_after_fwd"] > 0 and moved["pool_after_bwd"] == 0
        assert abs(moved["predicted_host"] / moved["pool_after_fwd"] - 1) < HOST_TOLERANCE, \
            (moved["predicted_host"], moved["pool_after_fwd"])


def test_optimizer_offload_keeps_master_and_state_off_the_device(dp):
    """blocks.0's optimizer state on disk, blocks.1's in the host pool."""
    exact(dp, "opt_disk_host")
    for r in dp:
        moved = r["opt_disk_host"]
        host = [k for k, t in moved["tiers"].items() if t == "host"]
        on_disk = [k for k, t in moved["tiers"].items() if t == "disk"]
        assert host and all(k.startswith("blocks.1.") for k in host)
        assert on_disk and all(k.startswith("blocks.0.") for k in on_disk)
        # fp32 master + two AdamW moments per element, and AdamW's 4-byte step counter per tensor
        assert moved["pool_after_step"] == sum(12 * moved["local_numel"][k] + 4 for k in host)
        assert moved["files_after_bwd"] == 4 * len(on_disk)       # master, two moments, step
        assert moved["opt_step_device"] < r["none"]["opt_step_device"]


def test_bf16_parameters_get_fp32_master_weights_and_state_dict_round_trips(rank_pool):
    for r in rank_pool(2).run(mixed_precision_state):
        assert r["param_dtypes"] == ["torch.bfloat16"] and r["master_dtypes"] == ["torch.float32"]
        assert {r["tiers"]["blocks.0.fc.weight"], r["tiers"]["blocks.1.fc.weight"], r["tiers"]["wte.weight"]} == \
            {"host", "disk", "device"}
        assert r["param_is_rounded_master"] and r["master_finer_than_param"]
        assert r["reloaded_max_diff"] == 0.0
        assert r["pool_bytes"] > 0 and r["files"] > 0


def test_optimizer_state_is_what_the_plan_prices_in_every_precision(rank_pool):
    """`plan.precision` as executed: "same" keeps no master and moments in the parameter's dtype
    (bf16: 4 bytes per element), "mixed" an fp32 master and fp32 moments for bf16 parameters (12),
    and fp32 parameters train alike under both (8); the plan's price within 2% on each rank."""
    per_element = {"bfloat16/same": 4, "bfloat16/mixed": 12, "float32/same": 8, "float32/mixed": 8}
    for r in rank_pool(2).run(optimizer_state_bytes):
        assert set(r) == set(per_element)
        for case, m in r.items():
            assert m["measured"] == pytest.approx(m["predicted"], rel=0.02), case
            assert m["predicted"] == per_element[case] * m["local_elements"], case
        assert r["bfloat16/same"]["state_dtypes"] == ["bfloat16"]
        assert r["bfloat16/mixed"]["state_dtypes"] == ["float32"]


def test_memory_decisions_naming_nothing_are_errors(rank_pool):
    messages = rank_pool(2).run(bad_memory_plans)[0]
    assert all(messages), messages
    for m, culprits in zip(messages, (("blocks.9", "sometimes", "blocks.0.nope.weight", "'block.0'"), ("blocks.7",),
                                      ("blocks.8",), ("disk",))):
        assert all(c in m for c in culprits), (culprits, m)
    assert "Layers here: blocks.0, blocks.1" in messages[0]
