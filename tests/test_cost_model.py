"""Cost model: profiles, roofline, collectives and resharding, checked against hand-derived numbers."""
import copy
import dataclasses
import json
import pickle

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.cost_model import (Link, all_gather_time, all_reduce_time, all_to_all_time,
                                collective_bytes_on_wire, compute_time, known_profiles,
                                load_profile, matmul_efficiency_at, op_times, reduce_scatter_time, reshard_cost,
                                save_profile)
from autopar.cost_model.profiles import PROFILE_DIR

R, S, P = Replicate(), Shard, Partial()
NVLINK = Link(bandwidth=300e9, latency=2e-6)
SLOW = Link(bandwidth=25e9, latency=10e-6)


# -- profiles ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a100", "h100", "h200", "cpu"])
def test_every_shipped_profile_loads(name):
    p = load_profile(name.upper())
    assert p.name == name and p == load_profile(name) and hash(p) == hash(load_profile(name))
    assert p.inter_node.bandwidth <= p.intra_node.bandwidth
    assert p.flops_for(torch.bfloat16) >= p.flops_for(torch.float32) > 0
    assert p.memory_capacity > 10 * 2**30


def test_known_profiles_and_datasheet_figures():
    assert set(known_profiles()) == {"a100", "h100", "h200", "cpu"}
    a100, h100, h200 = load_profile("a100"), load_profile("h100"), load_profile("h200")
    assert a100.flops_for(torch.bfloat16) == 312e12
    assert a100.flops_for(torch.float32) == 19.5e12          # fp32 is not silently tf32
    assert a100.flops_for(torch.float64) == 19.5e12          # no entry: falls back to fp32
    assert h100.flops_for(torch.float16) == 989e12 and h100.memory_bandwidth == 3.35e12
    assert h200.flops_for(torch.bfloat16) == h100.flops_for(torch.bfloat16) and h200.memory_bandwidth == 4.8e12
    assert h200.memory_capacity > 1.7 * h100.memory_capacity


def test_gpu_profiles_reserve_memory_beside_tensors_and_plan_within_the_rest():
    """The default budget is the capacity less a named reserve (CUDA context and cuBLAS workspaces,
    NCCL buffers, allocator fragmentation), each figure cited in the profile's notes."""
    for name in ("a100", "h100", "h200"):
        p = load_profile(name)
        notes = json.loads((PROFILE_DIR / f"{name}.json").read_text())["_notes"]
        assert p.context_memory >= 2**29 and p.communicator_memory > 0 and 0 < p.fragmentation < 0.2, name
        assert {"context_memory", "communicator_memory", "fragmentation"} <= set(notes), name
        assert p.memory_budget == p.memory_capacity - p.context_memory - p.communicator_memory \
            - p.fragmentation * p.memory_capacity
    h100 = load_profile("h100")
    assert h100.memory_capacity - h100.memory_budget >= 4 * 2**30         # the 80 GB part keeps 4 GiB free
    assert load_profile("cpu").memory_budget == load_profile("cpu").memory_capacity
    with pytest.raises(ValueError, match="fragmentation"):
        dataclasses.replace(h100, fragmentation=1.5)
    with pytest.raises(ValueError, match="leave no memory"):
        dataclasses.replace(h100, context_memory=h100.memory_capacity)


def test_unknown_profile_lists_known_names():
    with pytest.raises(ValueError, match="a100, cpu, h100, h200"):
        load_profile("tpu-v9")


def test_profile_is_frozen_and_read_only():
    p = load_profile("h100")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.memory_bandwidth = 1.0
    with pytest.raises(TypeError):
        p.peak_flops["bfloat16"] = 1.0


def test_profile_json_round_trip(tmp_path):
    p = dataclasses.replace(load_profile("a100"), name="my-a100", memory_bandwidth=1.9e12,
                            intra_node=Link(250e9, 3e-6))
    path = save_profile(p, tmp_path / "my.json")
    q = load_profile(path)
    assert q == p and q.intra_node == Link(250e9, 3e-6) and dict(q.peak_flops) == dict(p.peak_flops)
    assert load_profile(str(path)) == p and load_profile(p) is p
    r = dataclasses.replace(p, intra_node=Link(1e9, 3e-4, reduce_scatter_factor=2.5))   # a calibrated gloo link
    assert load_profile(save_profile(r, tmp_path / "gloo.json")).intra_node.reduce_scatter_factor == 2.5
    with pytest.raises(ValueError):
        Link(1e9, 3e-4, reduce_scatter_factor=0.0)


def test_profile_pickles_and_deep_copies():
    p = load_profile("h100")
    assert pickle.loads(pickle.dumps(p)) == p and copy.deepcopy(p) == p


def test_profile_json_rejects_unknown_keys(tmp_path):
    d = json.loads(save_profile(load_profile("cpu"), tmp_path / "c.json").read_text())
    d["memory_bandwith"] = 1.0   # a typo must not be ignored
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="memory_bandwith"):
        load_profile(tmp_path / "bad.json")


# -- roofline ------------------------------------------------------------------------------
def test_roofline_memory_bound_op():
    h100 = load_profile("h100")
    t = compute_time(1e6, 1e9, torch.bfloat16, h100, is_matmul=False)
    assert t == pytest.approx(1e9 / (3.35e12 * 0.9) + 5e-6)


def test_roofline_compute_bound_matmul():
    h100 = load_profile("h100")
    flops = 1e15
    eff = 0.8 * flops / (flops + 2.8e-6 * 989e12 * 0.8)
    t = compute_time(flops, 1e6, torch.bfloat16, h100, is_matmul=True)
    assert t == pytest.approx(flops / (989e12 * eff) + 5e-6)
    assert t == pytest.approx(flops / (989e12 * 0.8) + 2.8e-6 + 5e-6)   # ideal + ramp + launch
    # fp32 matmul runs at the fp32 (not tensor-core bf16) peak, with the same ramp in seconds
    t32 = compute_time(flops, 1e6, torch.float32, h100, is_matmul=True)
    assert t32 == pytest.approx(flops / (67e12 * 0.8) + 2.8e-6 + 5e-6)


def test_roofline_picks_the_larger_term():
    p = load_profile("a100")
    flops, nbytes = 1e12, 1e10
    t_c = compute_time(flops, 0, torch.bfloat16, p, is_matmul=True)
    t_m = compute_time(0, nbytes, torch.bfloat16, p, is_matmul=True)
    assert compute_time(flops, nbytes, torch.bfloat16, p, is_matmul=True) == pytest.approx(max(t_c, t_m))
    assert t_c != pytest.approx(t_m)


def test_pointwise_flops_use_vector_rate_not_tensor_cores():
    p = load_profile("a100")
    t = compute_time(1e12, 0, torch.bfloat16, p, is_matmul=False)
    assert t == pytest.approx(1e12 / (19.5e12 * 0.5) + 5e-6)


def test_view_costs_nothing():
    assert compute_time(0, 0, torch.float32, load_profile("h100"), is_matmul=False) == 0.0


def test_small_matmul_efficiency_curve_is_monotone():
    p = load_profile("h100")
    sizes = [2 * n**3 for n in (16, 64, 256, 1024, 4096, 16384)]
    effs = [matmul_efficiency_at(f, torch.bfloat16, p) for f in sizes]
    assert all(a < b for a, b in zip(effs, effs[1:]))
    assert effs[0] < 0.01 and effs[-1] == pytest.approx(0.8, rel=1e-3)
    # half efficiency at 2.8 us * 989 TFLOP/s * 0.8 = 2.2 GFLOP, about a 1040^3 bf16 matmul
    assert matmul_efficiency_at(2.8e-6 * 989e12 * 0.8, torch.bfloat16, p) == pytest.approx(0.4)
    assert matmul_efficiency_at(2 * 1040**3, torch.bfloat16, p) == pytest.approx(0.4, rel=0.02)


def test_backward_factors():
    p = load_profile("h100")
    f, b = op_times(1e12, 1e6, torch.bfloat16, p, family="matmul", op="aten.mm")
    assert b == pytest.approx(2.0 * f)                 # dX and dW
    f, b = op_times(0, 1e9, torch.bfloat16, p, family="pointwise", op="aten.add")
    assert f > 0 and b == 0.0                         # the gradient passes through



def test_matmul_output_store_follows_the_main_loop():
    """With its reads and writes known, a matmul pays its output store after the K loop: a short-K
    product with a big output (attention scores, K = head_dim) falls well below the roofline, a
    long-K GEMM stays within a few percent of it (compute.matmul_time)."""
    import sympy
    p = load_profile("a100")
    bw = p.memory_bandwidth * p.memory_efficiency

    def fwd(m, n, k, batch=1):
        flops, ins, out = 2.0 * batch * m * n * k, 2.0 * batch * (m * k + k * n), 2.0 * batch * m * n
        return op_times(flops, ins + out, torch.float16, p, family="matmul", in_bytes=ins, out_bytes=out), flops

    (scores, _), flops = fwd(2048, 2048, 96, batch=32)                 # QK^T of Korthikanti's 22B layer
    roofline = compute_time(flops, 2.0 * 32 * (2 * 2048 * 96 + 2048**2), torch.float16, p, is_matmul=True)
    assert scores == pytest.approx(flops / (312e12 * matmul_efficiency_at(flops, torch.float16, p))
                                   + 2.0 * 32 * 2048**2 / bw + p.kernel_overhead)
    assert scores > 1.5 * roofline
    (big, big_b), flops = fwd(8192, 2304, 6144)                        # the 22B layer's QKV GEMM
    assert big == pytest.approx(compute_time(flops, 0, torch.float16, p, is_matmul=True), rel=0.03)
    assert big_b == pytest.approx(2 * big, rel=0.03)                   # dX and dW, stores of X and W
    # efficiency vs K at a large output: K / (K + K0), K0 = rate * 2 bytes / (2 * bandwidth), 136 here
    for k in (64, 256, 1024, 8192):
        (t, _), flops = fwd(16384, 16384, k)
        rate = 312e12 * matmul_efficiency_at(flops, torch.float16, p)
        k0 = rate / bw
        assert (flops / rate) / (t - p.kernel_overhead) == pytest.approx(k / (k + k0), rel=0.02)
    # FLOPs-only callers keep the roofline; symbolic sizes go through the same code
    f, b = op_times(1e12, 1e6, torch.float16, p, family="matmul")
    assert b == pytest.approx(2.0 * f)
    B = sympy.Symbol("B", positive=True)
    f, b = op_times(2 * B * 2048 * 96 * 2048, 4 * B * 2048 * 96, torch.float16, p, family="matmul",
                    in_bytes=4 * B * 2048 * 96, out_bytes=2 * B * 2048**2)
    assert float(f.subs(B, 32)) == pytest.approx(scores)

# -- collectives ---------------------------------------------------------------------------
def test_all_reduce_8_devices_1GB_nvlink():
    expected = 2 * 7 / 8 * 1e9 / 300e9 + 2 * 7 * 2e-6
    assert all_reduce_time(1e9, 8, NVLINK) == pytest.approx(expected)
    assert expected == pytest.approx(5.8613e-3, rel=1e-4)


def test_gather_scatter_all_to_all_formulas():
    assert all_gather_time(1e9, 8, NVLINK) == pytest.approx(7 / 8 * 1e9 / 300e9 + 7 * 2e-6)
    assert reduce_scatter_time(1e9, 8, NVLINK) == all_gather_time(1e9, 8, NVLINK)
    # a backend whose reduce_scatter is slower than the ring's (gloo's): its bytes term scaled
    slow = Link(300e9, 2e-6, reduce_scatter_factor=2.5)
    assert reduce_scatter_time(1e9, 8, slow) == pytest.approx(2.5 * 7 / 8 * 1e9 / 300e9 + 7 * 2e-6)
    assert all_gather_time(1e9, 8, slow) == all_gather_time(1e9, 8, NVLINK)
    assert all_to_all_time(1e9, 8, NVLINK) == pytest.approx(7 / 64 * 1e9 / 300e9 + 7 * 2e-6)
    assert collective_bytes_on_wire("all_reduce", 1e9, 4) == 1.5e9
    assert collective_bytes_on_wire("all_gather", 1e9, 4) == 0.75e9
    assert collective_bytes_on_wire("all_to_all", 1e9, 4) == pytest.approx(3 / 16 * 1e9)
    with pytest.raises(ValueError):
        collective_bytes_on_wire("broadcast", 1e9, 4)


@pytest.mark.parametrize("fn", [all_reduce_time, all_gather_time, reduce_scatter_time, all_to_all_time])
def test_one_device_collective_is_free(fn):
    assert fn(1e9, 1, NVLINK) == 0.0


# -- resharding ----------------------------------------------------------------------------
SHAPE, ITEM = (1024, 2048), 4
B = 1024 * 2048 * 4   # 8 MiB


def cost(src, dst, sizes=(2, 4), links=(NVLINK, SLOW), names=("dp", "tp")):
    return reshard_cost(SHAPE, ITEM, src, dst, sizes, links, names)


def test_identical_placements_are_free():
    for layout in [(R, R), (S(0), S(1)), (P, S(0)), (Partial("avg"), R)]:
        rc = cost(layout, layout)
        assert rc.seconds == 0.0 and rc.bytes_per_axis == (0.0, 0.0) and rc.collectives == ()


def test_local_transitions_are_free():
    assert cost((R, R), (S(0), S(1))).seconds == 0.0       # R -> S slices locally
    assert cost((R, R), (P, R)).seconds == 0.0             # R -> P keeps one copy


def test_partial_to_another_partial_kind_goes_through_replicate():
    # as the runtime moves it (runtime/reshard.py): made whole, then relabelled
    assert cost((P, R), (Partial("avg"), R)).collectives == ("all_reduce@dp",)


def test_shard_to_replicate_is_an_all_gather_of_the_full_bytes():
    rc = reshard_cost(SHAPE, ITEM, [S(0)], [R], [4], [NVLINK], ["tp"])
    assert rc.seconds == pytest.approx(all_gather_time(B, 4, NVLINK))
    assert rc.bytes_per_axis == (0.75 * B,) and rc.collectives == ("all_gather@tp",)


def test_2d_gather_runs_the_inner_axis_first_on_the_small_tensor():
    rc = cost((S(0), S(1)), (R, R))
    # as DTensor's redistribute: the inner axis first, tp (4 devices, 25 GB/s) gathers B/2 from
    # chunks of B/8; then dp (2, 300 GB/s) gathers B.
    t_tp = 3 / 4 * (B / 2) / 25e9 + 3 * 10e-6
    t_dp = 1 / 2 * B / 300e9 + 1 * 2e-6
    assert rc.collectives == ("all_gather@tp", "all_gather@dp")
    assert rc.seconds == pytest.approx(t_tp + t_dp) == pytest.approx(1.7181e-4, rel=1e-4)
    assert rc.bytes_per_axis == (B / 2, 3 / 8 * B)


def test_partial_to_replicate_charges_only_the_partial_axis():
    rc = reshard_cost(SHAPE, ITEM, (P, S(0)), (R, S(0)), (2, 2), (NVLINK, NVLINK), ("a", "b"))
    assert rc.seconds == pytest.approx(all_reduce_time(B / 2, 2, NVLINK))
    assert rc.bytes_per_axis == (B / 2, 0.0) and rc.collectives == ("all_reduce@a",)


def test_nested_shard_is_gathered_whole_before_the_outer_axis_changes():
    # (S(0), S(0)) -> (R, S(0)): one all-gather over dp alone would leave each rank rows of both
    # halves; the runtime gathers tp (B/8 -> B/4 local), then dp (-> B), then slices tp again.
    rc = cost((S(0), S(0)), (R, S(0)), sizes=(2, 2), links=(NVLINK, NVLINK))
    assert rc.collectives == ("all_gather@tp", "all_gather@dp")
    assert rc.seconds == pytest.approx(all_gather_time(B / 2, 2, NVLINK) + all_gather_time(B, 2, NVLINK))
    # the inner axis alone is one all-gather
    assert cost((S(0), S(0)), (S(0), R), sizes=(2, 2)).collectives == ("all_gather@tp",)


def test_partial_inner_axis_under_a_sharded_outer_one_is_all_reduced():
    # dp: S(0) -> R; tp: P -> S(0). The target's S(0) over tp would nest under dp's S(0) differently
    # than now, so tp is made whole first (an all-reduce of the B/2 local), dp gathered, tp sliced.
    rc = cost((S(0), P), (R, S(0)))
    assert rc.collectives == ("all_reduce@tp", "all_gather@dp")
    assert rc.seconds == pytest.approx(all_reduce_time(B / 2, 4, SLOW) + all_gather_time(B, 2, NVLINK))


def test_shard_to_other_dim_is_an_all_to_all():
    rc = reshard_cost(SHAPE, ITEM, [S(0)], [S(1)], [4], [NVLINK], ["tp"])
    assert rc.seconds == pytest.approx(all_to_all_time(B, 4, NVLINK))
    assert rc.collectives == ("all_to_all@tp",)


def test_size_one_axis_is_free():
    rc = cost((P, S(0)), (R, R), sizes=(1, 4))
    assert rc.collectives == ("all_gather@tp",) and rc.bytes_per_axis[0] == 0.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="one entry per mesh axis"):
        reshard_cost(SHAPE, ITEM, (R,), (R, R), (2, 4), (NVLINK, SLOW), ("dp", "tp"))
    with pytest.raises(ValueError, match="does not fit"):
        cost((S(2), R), (R, R))


def test_liveness_timeline_sweeps_intervals_as_a_filter_would():
    """liveness' sweep (`Timeline`) gives, point to point, the changes of the members that filtering
    every owner at every point gives, going forward then backward, with empty intervals (lo > hi)
    never members and, where asked, points without members skipped."""
    import random

    from autopar.cost_model.memory import Timeline
    rng = random.Random(1)

    def changes(points):
        out, before = [], ()
        for members in points:
            out.append((tuple(o for o in before if o not in members), tuple(o for o in members if o not in before)))
            before = members
        return out

    for _ in range(300):
        n = rng.randint(0, 30)
        owners = tuple(f"o{i}" for i in range(n))
        tl, want = Timeline(owners), []
        for down in (False, rng.random() < 0.5):
            lo = [rng.randint(-2, 20) for _ in range(n)]
            hi = [rng.randint(-2, 20) for _ in range(n)]
            times = sorted(rng.sample(range(-3, 24), rng.randint(1, 10)), reverse=down)
            skip = rng.random() < 0.5
            points = [tuple(o for o, a, b in zip(owners, lo, hi) if a <= t <= b) for t in times]
            kept = [(t, p) for t, p in zip(times, points) if p or not skip]
            assert tl.sweep(lo, hi, times, skip_empty=skip) == [t for t, _ in kept]
            want += [p for _, p in kept]
        assert tl.changes == changes(want) and tl.sizes == [len(p) for p in want]


# -- what an op does inside itself (strategies/inner.py, cost_model/inner.py) --------------------
def test_a_rules_inner_facts_are_priced_with_the_op_and_listed_on_it(monkeypatch):
    """An op's rule states what it does inside itself through its `inner` hook alone: the problem
    builder prices those facts with the op (its forward and backward under each strategy) and the
    plan lists its collectives, with no change to the solver. Here linear's rule is given a hook that
    all-reduces 4 bytes per row forward and 8 backward on every axis its strategy splits the batch."""
    import torch.nn as nn
    from torch.distributed.tensor import Shard as Sh

    import autopar
    from autopar.cost_model.comm import row_reduce_bytes_on_wire, row_reduce_times
    from autopar.passes.capture import capture
    from autopar.passes.shape_prop import annotate
    from autopar.solver.problem import build_problem, op_exchanges
    from autopar.strategies.inner import RowReductions
    from autopar.strategies.registry import RULES

    per_row = ((4,), (8,))

    def hook(node, s, ins, outs, mesh_shape):
        return tuple(RowReductions(a, mesh_shape[a], 16 / mesh_shape[a], per_row)
                     for a, p in enumerate(s.inputs[0]) if p == Sh(0))

    def problem():
        cap = capture(nn.Sequential(nn.Linear(32, 32)), (torch.randn(16, 32),))
        return cap, build_problem(cap, annotate(cap.gm), autopar.Mesh((2,), ("x",), device="h100"))
    _, plain = problem()
    linear = torch.ops.aten.linear
    monkeypatch.setitem(RULES, linear, dataclasses.replace(RULES[linear], inner=hook))
    cap, hooked = problem()
    name = next(n for n, d in hooked.decisions.items() if d.kind == "op" and d.facts.op == "aten.linear")
    mesh = hooked.mesh
    launch = mesh.profile.kernel_overhead + mesh.profile.collective_overhead
    fwd, bwd = row_reduce_times(per_row, 8, 2, mesh.links[0], launch)
    for i, s in enumerate(hooked.decisions[name].strategies):
        split = s.inputs[0][0] == Sh(0)
        assert hooked.decisions[name].fwd_s[i] == pytest.approx(plain.decisions[name].fwd_s[i] + (fwd if split else 0))
        assert hooked.decisions[name].compute_s[i] == pytest.approx(
            plain.decisions[name].compute_s[i] + (fwd + bwd if split else 0))
        node = next(n for n in cap.gm.graph.nodes if n.name == name)
        listed = op_exchanges(hooked, node, s)
        sent = row_reduce_bytes_on_wire(per_row, 8, 2)
        assert listed == ([("forward", "all_reduce@x", pytest.approx(fwd), sent[0], "x"),
                           ("backward", "all_reduce@x", pytest.approx(bwd), sent[1], "x")] if split else [])
