"""Symbolic costs: a plan priced at other batch sizes / sequence lengths without tracing again
(`Plan.estimate_at`) equals the same layouts priced on a graph captured at those sizes."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.dirname(__file__))

import autopar  # noqa: E402
from autopar.errors import PlanMismatchError  # noqa: E402
from autopar.passes.capture import capture  # noqa: E402
from autopar.passes.shape_prop import annotate  # noqa: E402
from autopar.placement import parse_layout  # noqa: E402
from autopar.plan import Plan  # noqa: E402
from autopar.views.scaling import _batch_step  # noqa: E402
from autopar.solver.evaluate import evaluate  # noqa: E402
from autopar.solver.problem import build_problem  # noqa: E402
from autopar.strategies.strategy import Strategy  # noqa: E402
from dist_checks import shard_happy_profile  # noqa: E402
from models import GPT, Llama, gpt_inputs  # noqa: E402


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)


def price_layouts_at(plan: Plan, model, inputs, mesh, batch_axes=None):
    """The plan's layouts priced by the planner's own tables on a graph captured at `inputs`' sizes."""
    cap = capture(model, inputs)
    only = {}
    for n in plan.nodes:
        if n.executor == "output":
            continue
        only[n.name] = Strategy(tuple(parse_layout(i) for i in n.inputs), parse_layout(n.output), n.labels)
    p = build_problem(cap, annotate(cap.gm), mesh, only=only, batch_axes=batch_axes)
    ev = evaluate(p, {k: 0 for k in p.decisions})
    compute, comm, peak, state = ev.compute_s, ev.comm_s, ev.peak_bytes, ev.state_bytes
    return compute, comm, peak, state


# symbolic costs cover the layout family; the memory families are fixed to their defaults
LAYOUTS_ONLY = dict(recompute="none", offload="none", residency="keep")

CASES = [
    # name, model builder, (batch, seq) planned, (batch, seq) re-priced, mesh, batch_axes
    ("gpt-dp-tp", lambda: GPT(vocab=64, seq=32, hidden=32, heads=4, layers=3), (8, 16), [(16, 16), (8, 32), (24, 8)],
     ((2, 2), ("dp", "tp")), ("dp",)),
    # 6 blocks: traced with variable sizes as a 2-block stack (symbolic_shapes._short_stacks)
    ("gpt-deep", lambda: GPT(vocab=64, seq=32, hidden=32, heads=4, layers=6), (8, 16), [(16, 32)],
     ((4,), ("dp",)), ("dp",)),
    ("llama-3d", lambda: Llama(vocab=64, hidden=32, heads=4, kv_heads=2, ffn=64, layers=3, seq=32), (8, 16),
     [(16, 32), (32, 8)], ((2, 2, 2), ("a", "b", "c")), ("a",)),
]


@pytest.mark.parametrize("name,build,planned,others,mesh_spec,batch_axes", CASES, ids=[c[0] for c in CASES])
def test_estimate_at_equals_repricing_at_new_sizes(name, build, planned, others, mesh_spec, batch_axes):
    torch.manual_seed(0)
    model = build()
    mesh = autopar.Mesh(mesh_spec[0], mesh_spec[1], device=shard_happy_profile() if len(mesh_spec[0]) < 3 else "cpu")
    b0, s0 = planned
    plan = autopar.plan(model, gpt_inputs(batch=b0, seq=s0, vocab=64), mesh, batch_axes=batch_axes,
                        time_limit=1,    # any plan will do: the test compares two ways of pricing it
                        **LAYOUTS_ONLY)
    assert not plan.scaling.unavailable, plan.scaling.unavailable
    # splits really vary with the sizes (the test would be weak on an all-replicated plan)
    assert plan.scaling.divisible, "expected a plan that splits a batch or sequence dim"
    at0 = plan.estimate_at()
    est = plan.estimate
    for a, b in ((at0.compute_s, est.compute_s), (at0.comm_s, est.comm_s),
                 (at0.peak_memory_bytes, est.peak_memory_bytes), (at0.param_state_bytes, est.param_state_bytes)):
        assert _same(a, b), (a, b)
    assert at0.comm_bytes_per_axis.keys() == est.comm_bytes_per_axis.keys()
    assert all(_same(at0.comm_bytes_per_axis[k], v) for k, v in est.comm_bytes_per_axis.items())
    for b, s in others:
        got = plan.estimate_at(batch=b, seq=s)
        compute, comm, peak, state = price_layouts_at(plan, model, gpt_inputs(batch=b, seq=s, vocab=64), mesh,
                                                      batch_axes)
        assert _same(got.compute_s, compute) and _same(got.comm_s, comm), (b, s, got, compute, comm)
        assert _same(got.peak_memory_bytes, peak) and _same(got.param_state_bytes, state), (b, s, got, peak)
        assert got.step_time_s != est.step_time_s


def test_scaling_survives_json_and_reports_a_table(tmp_path):
    model = GPT(vocab=64, seq=32, hidden=32, heads=4, layers=2)
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device=shard_happy_profile())
    plan = autopar.plan(model, gpt_inputs(batch=8, seq=16, vocab=64), mesh, batch_axes=("dp",),
                        memory_budget=2**30, **LAYOUTS_ONLY)
    plan.save(tmp_path / "p.json")
    loaded = Plan.load(tmp_path / "p.json")
    assert loaded.estimate_at(batch=32, seq=8) == plan.estimate_at(batch=32, seq=8)
    # largest batch: fits at the answer, not at the next size that splits evenly
    budget = plan.estimate_at(batch=64).peak_memory_bytes * 1.01
    n = loaded.largest_batch(memory_budget=budget)
    assert n >= 64 and loaded.estimate_at(batch=n).peak_memory_bytes <= budget
    step = _batch_step(loaded.scaling, 16)    # B is split at least over dp (2)
    assert step % 2 == 0 and n % step == 0 and loaded.estimate_at(batch=n + step).peak_memory_bytes > budget
    text = loaded.report()
    assert "Scaling" in text and "largest batch" in text


def test_estimate_at_rejects_sizes_the_plan_cannot_split():
    model = GPT(vocab=64, seq=32, hidden=32, heads=4, layers=2)
    mesh = autopar.Mesh((4,), ("dp",), device=shard_happy_profile())
    plan = autopar.plan(model, gpt_inputs(batch=8, seq=16, vocab=64), mesh, batch_axes=("dp",), **LAYOUTS_ONLY)
    with pytest.raises(PlanMismatchError, match="divide evenly"):
        plan.estimate_at(batch=6)
    with pytest.raises(ValueError):
        plan.estimate_at(batch=0)


def test_fixed_sizes_and_symbolic_off_are_explained():
    mlp_plan = autopar.plan(torch.nn.Linear(8, 8), (torch.randn(4, 8),), autopar.Mesh((2,), ("dp",)))
    assert mlp_plan.scaling.fixed == ("seq",)          # no sequence dim: only the batch varies
    assert mlp_plan.estimate_at(batch=16).step_time_s > 0
    with pytest.raises(PlanMismatchError, match="seq"):
        mlp_plan.estimate_at(seq=16)
    off = autopar.plan(torch.nn.Linear(8, 8), (torch.randn(4, 8),), autopar.Mesh((2,), ("dp",)), symbolic=False)
    with pytest.raises(PlanMismatchError, match="symbolic=False"):
        off.estimate_at(batch=8)


def test_deep_stack_is_traced_short_and_restored(monkeypatch):
    import autopar.passes.symbolic_shapes as ss
    model = GPT(vocab=64, seq=32, hidden=32, heads=4, layers=6)
    blocks = model.blocks
    inputs = gpt_inputs(batch=8, seq=16, vocab=64)
    cap = capture(model, inputs)
    traced = []
    real = ss.capture

    def spy(m, *a, **k):
        traced.append(len(m.blocks))
        return real(m, *a, **k)

    monkeypatch.setattr(ss, "capture", spy)
    sym = ss.symbolic_graph(model, inputs, {}, cap, annotate(cap.gm))
    assert traced == [ss._KEEP]                  # one variable-size trace, of the short stack
    assert model.blocks is blocks and len(model.blocks) == 6     # the user's model is as it was
    assert set(sym.infos) == {n.name for n in cap.gm.graph.nodes}


def test_scaling_covers_memory_decisions():
    """A plan that recomputes or offloads is priced at other sizes with its decisions: equal to the
    evaluator's price of the same layouts and decisions on a graph captured at those sizes."""
    torch.manual_seed(0)
    model = GPT(vocab=64, seq=32, hidden=32, heads=4, layers=4)
    mesh = autopar.Mesh((2,), ("dp",), device="cpu")
    inputs = gpt_inputs(batch=8, seq=16, vocab=64)
    with pytest.raises(autopar.InfeasibleError) as e:
        autopar.plan(model, inputs, mesh, batch_axes=("dp",), recompute="none", offload="none", memory_budget=1)
    for fixed in ({"offload": "none"}, {"recompute": "none"}):
        # any plan that fits will do (the test compares ways of pricing it); one cut short by the time limit
        # gathers a layer's parameters in part, which the scaling must price as the planner did
        plan = autopar.plan(model, inputs, mesh, batch_axes=("dp",), memory_budget=0.85 * e.value.min_memory_bytes,
                            time_limit=1, **fixed)
        assert {*plan.recompute.values(), *plan.offload.values()} - {"none", "device"}, plan.recompute
        assert not plan.scaling.unavailable, plan.scaling.unavailable
        at0 = plan.estimate_at()
        assert _same(at0.step_time_s, plan.estimate.step_time_s)
        assert _same(at0.peak_memory_bytes, plan.estimate.peak_memory_bytes)
        for b, s in ((16, 16), (8, 32)):
            got = plan.estimate_at(batch=b, seq=s)
            want = autopar.estimate(model, gpt_inputs(batch=b, seq=s, vocab=64), mesh, plan)
            assert _same(got.step_time_s, want.step_time_s) and _same(got.peak_memory_bytes, want.peak_memory_bytes)
        assert plan.largest_batch() >= 8


def test_layer_gathered_in_part_is_priced_at_other_sizes_as_planned():
    """Only qkv's weight stored split (ZeRO-3 style, re-gathered): the rest of each layer stays whole, so
    its flat gather takes one parameter of the several the planning problem's layouts could gather. The
    scaling, priced on the plan's own layouts, counts the layer as the planner did."""
    torch.manual_seed(0)
    model = GPT(vocab=64, seq=32, hidden=32, heads=4, layers=2)
    mesh = autopar.Mesh((2,), ("dp",), device="cpu")
    plan = autopar.plan(model, gpt_inputs(batch=8, seq=16, vocab=64), mesh, batch_axes=("dp",),
                        pins={"blocks.*.attn.qkv.weight": ("S(0)",)}, recompute="none", offload="none",
                        residency="regather")
    assert {k for k, lay in plan.placements.items() if lay != ("R",)} == {"blocks.0.attn.qkv.weight",
                                                                          "blocks.1.attn.qkv.weight"}
    assert plan.residency["blocks.0.attn.qkv.weight"] == "regather"
    at0 = plan.estimate_at()
    assert _same(at0.step_time_s, plan.estimate.step_time_s), (at0.step_time_s, plan.estimate.step_time_s)
    assert _same(at0.peak_memory_bytes, plan.estimate.peak_memory_bytes)
