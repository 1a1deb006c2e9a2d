"""Megatron sequence parallelism (Korthikanti et al. 2022): the layer norms and the residual stream
split on the sequence over the tensor-parallel axis, an all-gather before each column matmul and a
reduce-scatter after each row matmul, and the column matmul's saved input kept sequence-sharded and
all-gathered again in the backward (`Plan.residency["activations:<layer>"] = "regather"`).
Trained on 4 gloo ranks (tp 4, and dp 2 x tp 2) against one process; memory measured with
`MemoryMeter` and priced by the planner's evaluator, which chooses the re-gather under a tight
budget. And the report's name for a plan's tensor-parallel family (1D, 2D, 2.5D, 3D, sequence,
context), from its layouts per axis.
"""
from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.passes.capture import capture
from autopar.passes.shape_prop import annotate
from autopar.plan import Collective
from autopar.planner.solve import PlanOptions, plan_assignment, planning_problem
from autopar.views.report import tensor_parallel_family as tp_family
from autopar.solver.evaluate import evaluate
from dist_checks import shard_happy_profile
from memory_checks import SP_PINS, TP_PINS, gpt, unpriced_variants
from rank_pool import get_pool

TOL = 1e-4
TP = 4
REGATHER = {"residency": {"activations:blocks.0": "regather", "activations:blocks.1": "regather"}}
# per block, the inputs of the qkv and fc matmuls are gathered: [batch 4, seq 16, hidden 32] in fp32
GATHERED_BYTES = 2 * 2 * 4 * 16 * 32 * 4


# the same on a (dp, tp) = (2, 2) mesh: batch split over dp, weights replicated over it
DP_SP_PINS = {k: ("R", *v) if "blocks" in k else ("batch", *v) if k.startswith("scaled") else ("S(0)", *v)
              for k, v in SP_PINS.items()}
MESHES = {"tp4": ((TP,), ("tp",), SP_PINS, TP, 1), "dp2xtp2": ((2, 2), ("dp", "tp"), DP_SP_PINS, 2, 2)}


@pytest.fixture(scope="module", params=list(MESHES))
def trained(request):
    shape, axes, pins, tp, dp = MESHES[request.param]
    results = get_pool(4).run(unpriced_variants, shape, axes, pins, {"keep": {}, "regather": REGATHER}, timeout=300)
    return results, tp, dp


def test_sequence_parallel_plan_has_megatron_sp_collectives():
    model, inputs = gpt()
    plan = autopar.plan(model, inputs, autopar.Mesh((TP,), ("tp",), device=shard_happy_profile()), pins=SP_PINS,
                        symbolic=False, residency="keep")
    kinds = {n.name: [c.kind for c in n.collectives if c.phase == "forward"] for n in plan.nodes}
    assert kinds["linear"] == ["all_gather@tp"] and kinds["linear_2"] == ["all_gather@tp"]   # before column
    assert kinds["add_1"] == ["reduce_scatter@tp"] and kinds["add_2"] == ["reduce_scatter@tp"]   # after row


def test_regathered_sequence_parallel_trains_exactly_and_saves_the_shard_only(trained):
    results, tp, dp = trained
    for r in results:
        for name in ("keep", "regather"):
            for key in ("loss", "grad", "param"):
                assert r[name][key] < TOL, (name, key, r[name][key])
        assert r["regather"]["act_gathers"] == 4 and r["keep"]["act_gathers"] == 0   # qkv's and fc's inputs
        # each rank keeps 1/tp of each gathered input (its batch share) instead of all of it, between
        # forward and backward
        assert r["keep"]["fwd_device"] - r["regather"]["fwd_device"] == GATHERED_BYTES // dp * (tp - 1) // tp


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
    # the layouts held to the plan's (other layouts may fit too, within the MIP's gap): re-gathering is
    # then what makes it fit
    layouts = {n.name: n.output for n in plan.nodes if n.output}
    chosen = autopar.plan(model, inputs, mesh, pins=layouts, symbolic=False, memory_budget=budget, recompute="none",
                          offload="none")
    assert chosen.estimate.peak_memory_bytes <= budget
    assert "regather" in {chosen.residency.get(f"activations:blocks.{i}") for i in range(2)}


def _plan(mesh_shape, axes, pins, **kw):
    model, inputs = gpt(**kw)
    return autopar.plan(model, inputs, autopar.Mesh(mesh_shape, axes, device=shard_happy_profile()), pins=pins,
                        symbolic=False, recompute="none", residency="keep", offload="none")


def _relabelled(plan, mesh_shape, axes, labels, gathered=()):
    """`plan` on another mesh, its weight products' strategy labels per axis `labels` (and a forward
    all-gather of their weight over the axes `gathered`), everything else whole: the layouts of a
    plan of another family, as data."""
    whole = tuple("R" for _ in axes)
    params = [n.name for n in plan.nodes if n.executor == "param"]
    gathers = tuple(Collective(f"all_gather@{ax}", "forward", params[0], 0.0) for ax in gathered)
    nodes = [dataclasses.replace(n, labels=labels, output=whole, collectives=gathers) if n.op == "aten.linear"
             else dataclasses.replace(n, labels=tuple("replicate" for _ in axes), output=whole) for n in plan.nodes]
    return dataclasses.replace(plan, mesh={**plan.mesh, "shape": list(mesh_shape), "axis_names": list(axes)},
                               nodes=nodes)


def test_report_names_the_tensor_parallel_family():
    tp = _plan((2,), ("tp",), TP_PINS | {f"layer_norm{s}": ("S(0)",) for s in ("", "_1", "_2", "_3", "_4")})
    assert (tp_family(tp).family, tp_family(tp).axes, tp_family(tp).sequence) == ("1D", ("tp",), ())
    sp = _plan((2,), ("tp",), SP_PINS | {"layer_norm_4": ("S(1)",)})
    assert tp_family(sp).sequence == ("tp",)
    assert "Parallelism: 1D tensor parallelism (Megatron) over tp; sequence parallelism (Megatron-SP) over tp" \
        in sp.report(symbolic=False)
    cp = _plan((2,), ("cp",), {"idx": ("S(1)",), "targets": ("S(1)",), "scaled_dot_product_attention*": ("ring",)})
    assert tp_family(cp).context == {"cp": "ring"} and tp_family(cp).sequence == ()
    # heads over cp inside attention, the sequence over cp outside it: Ulysses by the plan's own all-to-alls
    def ulysses(n):      # as data: the layers split on the sequence (norms and products), attention on heads
        if "scaled_dot_product" in n.op:
            return dataclasses.replace(n, labels=("heads",), output=("S(1)",))
        if n.op == "aten.linear":
            return dataclasses.replace(n, labels=("dim1",), output=("S(1)",))
        return dataclasses.replace(n, output=("S(1)",)) if n.op == "aten.layer_norm" else n
    heads = dataclasses.replace(cp, nodes=[ulysses(n) for n in cp.nodes])
    assert tp_family(heads).context == {"cp": "ulysses"} and tp_family(heads).family == "none"
    assert "context parallelism (ulysses: the sequence split outside attention, heads inside) over cp" in \
        heads.report(symbolic=False)
    assert tp_family(_relabelled(tp, (2, 2), ("x", "y"), ("column", "row"))).family == "2D"
    depth = _relabelled(tp, (2, 2, 2), ("x", "y", "z"), ("column", "row", "batch"))
    assert (tp_family(depth).family, tp_family(depth).depth) == ("2.5D", ("z",))
    cube = _relabelled(tp, (2, 2, 2), ("x", "y", "z"), ("column", "row", "batch"), gathered=("z",))
    assert (tp_family(cube).family, tp_family(cube).axes, tp_family(cube).depth) == ("3D", ("x", "y"), ("z",))
    dp = dataclasses.replace(depth, options={**depth.options, "batch_axes": ["z"]})
    assert tp_family(dp).family == "2D"          # a declared batch axis is data parallelism, not depth
