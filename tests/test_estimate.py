"""autopar.estimate: FLOPs against torch's counter, hand-written configurations priced as the Plan they
describe (one evaluator), pipelines."""
from __future__ import annotations

import ast
import dataclasses
import math
import os
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import autopar
from autopar.cost_model.profiles import load_profile
from autopar.cost_model.pipeline import Pipeline, in_flight_microbatches, pipeline_time
from autopar.estimate import estimate
from autopar.passes.capture import capture
from autopar.passes.shape_prop import annotate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from models import GPT, MLP, gpt_inputs  # noqa: E402

DEMO = dict(vocab=512, seq=128, hidden=256, heads=8, layers=2)


def meta_gpt(layers=2, batch=16, **kw):
    cfg = {**DEMO, "layers": layers, **kw}
    with torch.device("meta"):
        model = GPT(**cfg)
    idx, tgt = gpt_inputs(batch=batch, seq=cfg["seq"], vocab=cfg["vocab"])
    return model, (idx.to("meta"), tgt.to("meta"))


# -- FLOPs ---------------------------------------------------------------------------------
def test_flops_equal_flop_counter_mode_on_the_demo_gpt():
    model, batch = meta_gpt()
    per_node = sum(i.flops for i in annotate(capture(model, batch).gm).values())
    with FlopCounterMode(display=False) as fwd:
        loss = model(*batch)
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    # every matmul, attention included; torch's counter counts causal attention's whole square of
    # (query, key) pairs, the planner the pairs its fused kernel computes (query i sees keys 0..i)
    b, s, h, d = 16, DEMO["seq"], DEMO["heads"], DEMO["hidden"] // DEMO["heads"]
    skipped = DEMO["layers"] * 2 * b * h * (s * s - s * (s + 1) // 2) * 2 * d
    assert per_node == fwd.get_total_flops() - skipped > 0
    est = estimate(model, batch, autopar.Mesh((1,), ("dp",), device="cpu"))
    assert est.model_flops == fwd.get_total_flops() + bwd.get_total_flops() - 3 * skipped   # backward: 2x forward
    assert est.hardware_flops == est.model_flops        # no recomputation
    rec = estimate(model, batch, autopar.Mesh((1,), ("dp",), device="cpu"), recompute=True)
    layers_fwd = per_node - 2 * 16 * 128 * 256 * 512   # minus the head (the only op outside blocks)
    assert rec.hardware_flops == est.model_flops + layers_fwd


# -- agreement with the planner ------------------------------------------------------------------
def test_estimate_of_a_plan_is_the_planners_own_price():
    """estimate() prices an autopar plan through the planner's one evaluator: equal to the last bit,
    memory decisions included; pins of the same layouts give the same step."""
    torch.manual_seed(0)
    model = MLP(d_in=64, hidden=256, d_out=32, depth=2)
    x = torch.randn(64, 64)
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
    plan = autopar.plan(model, (x,), mesh)
    est = estimate(model, (x,), mesh, plan)
    _assert_same_price(est, plan)
    assert est.layout_summary == plan.placements
    again = estimate(model, (x,), mesh, dict(plan.placements))
    assert again.step_time_s == pytest.approx(est.step_time_s, rel=1e-9)
    with pytest.raises(autopar.InfeasibleError) as e:
        autopar.plan(model, (x,), mesh, recompute="none", offload="none", memory_budget=1)
    tight = autopar.plan(model, (x,), mesh, memory_budget=0.8 * e.value.min_memory_bytes, symbolic=False)
    assert {*tight.recompute.values(), *tight.offload.values(), *tight.residency.values()} - {"none", "device", "keep"}
    _assert_same_price(estimate(model, (x,), mesh, tight), tight)
    with pytest.raises(ValueError, match="decides its own recomputation"):
        estimate(model, (x,), mesh, plan, recompute=True)


def _assert_same_price(est, plan):
    p = plan.estimate
    assert est.step_time_s == p.step_time_s and est.peak_memory_bytes == p.peak_memory_bytes
    assert est.param_state_bytes == p.param_state_bytes and est.optimizer_s == p.optimizer_s
    assert est.grad_sync_s == p.grad_sync_s and est.runtime_s == p.runtime_s
    assert est.comm_bytes_per_axis == p.comm_bytes_per_axis


def test_hand_written_pins_are_priced_as_written():
    with torch.device("meta"):
        model = MLP(d_in=1024, hidden=4096, d_out=1024, depth=2)
        x = torch.empty(8192, 1024)
    mesh = autopar.Mesh((4,), ("dp",), device="h100")
    dp = estimate(model, (x,), mesh, {n: ("R",) for n, _ in model.named_parameters()}, batch_axes=("dp",))
    assert set(dp.layout_summary.values()) == {("R",)}
    assert dp.grad_sync_s > dp.comm_s > 0            # the gradient all-reduce; the output gathered whole
    hidden = dp.grad_sync_s
    overlapped = estimate(model, (x,), mesh, {n: ("R",) for n, _ in model.named_parameters()},
                          batch_axes=("dp",), grad_overlap=1.0)       # the profile's grad_sync_overlap
    assert overlapped.grad_overlap == 1.0 and overlapped.grad_sync_s < hidden
    one_bucket = estimate(model, (x,), mesh, {n: ("R",) for n, _ in model.named_parameters()},
                          batch_axes=("dp",), bucket_bytes=math.inf)
    assert one_bucket.grad_sync_s <= hidden
    # one bucket leaves when the backward ends (runtime/grad_sync.py): no overlap hides any of it
    one_overlapped = estimate(model, (x,), mesh, {n: ("R",) for n, _ in model.named_parameters()},
                              batch_axes=("dp",), bucket_bytes=math.inf, grad_overlap=1.0)
    assert one_overlapped.grad_sync_s == pytest.approx(one_bucket.grad_sync_s)


# -- layers and pipelines ----------------------------------------------------------------------
def test_hand_written_pipeline_is_priced_as_the_plan_it_describes():
    """Pins (over the non-pipeline axes), a pipeline and recomputation written by hand: estimate() is
    exactly the evaluator's price of the Plan the planner makes with all of them fixed."""
    model, batch = meta_gpt(layers=4, batch=32)
    mesh = autopar.Mesh((2, 2), ("pp", "dp"), device="a100")
    pins = {"blocks.*.fc.weight": ("R",), "blocks.*.fc2.weight": ("S(1)",)}
    pipe = Pipeline(stages=2, microbatches=4, schedule="interleaved", virtual_stages=2)
    est = estimate(model, batch, mesh, pins, batch_axes=("dp",), pipeline=pipe, recompute="selective")
    plan = autopar.plan(model, batch, mesh, pins={k: ("R", *v) for k, v in pins.items()}, batch_axes=("dp",),
                        pipeline=dict(axis="pp", stages=2, microbatches=4, schedule="interleaved", virtual_stages=2),
                        recompute="selective", residency="keep", offload="none", memory_budget=math.inf,
                        symbolic=False, progress=False)
    _assert_same_price(est, plan)
    assert est.bubble_s == plan.estimate.bubble_s and est.p2p_s == plan.estimate.p2p_s > 0
    # not only one path priced twice: the bubble is interleaved 1F1B's fill from the ranks' own times,
    # (sum_d t_d - max_d t_d) / v, t_d one microbatch's forward and backward on rank d
    t = [plan.estimate.stage_fwd_s[r] + plan.estimate.stage_bwd_s[r] for r in ("0", "1")]
    assert len(set(t)) == 2 and est.bubble_s == pytest.approx((sum(t) - max(t)) / 2, rel=1e-12)
    assert est.layout_summary == plan.placements and est.layout_summary["blocks.0.fc2.weight"] == ("R", "S(1)")
    assert set(plan.recompute.values()) == {"selective"} and (est.stages, est.virtual_stages) == (2, 2)


def test_estimate_has_no_pricing_of_its_own():
    """estimate.py only turns a configuration into a Plan and calls the evaluator: it imports no cost
    function (only the Pipeline vocabulary, the default bucket size, and for the FLOP count which ops
    selective recomputation keeps and the cost model's FLOPs of an op in a training step)."""
    tree = ast.parse(open(os.path.join(os.path.dirname(autopar.__file__), "estimate.py")).read())
    imported = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert {(m, a) for m, a in imported if m and m.startswith("cost_model")} == {
        ("cost_model.pipeline", "Pipeline"), ("cost_model.profiles", "DDP_BUCKET_BYTES"),
        ("cost_model.recompute", "saved_under_selective"), ("cost_model.compute", "step_flops")}
    assert {(m, a) for m, a in imported if m and m.startswith("solver")} == {
        ("solver.decisions.stages", "node_chunks"), ("solver.evaluate", "Staging"), ("solver.evaluate", "evaluate")}
    model, batch = meta_gpt(layers=1)
    with pytest.raises(autopar.AutoparError, match="build the model at its depth"):
        estimate(model, batch, autopar.Mesh((1,), ("dp",), device="cpu"), num_layers=4)


def test_pipeline_bubble_microbatches_and_recomputation():
    model, batch = meta_gpt(layers=4, batch=32)
    mesh = autopar.Mesh((2, 2), ("pp", "dp"), device="a100")
    kw = dict(batch_axes=("dp",))
    base = estimate(model, batch, mesh, None, pipeline=Pipeline(stages=2, microbatches=4), **kw)
    more = estimate(model, batch, mesh, None, pipeline=Pipeline(stages=2, microbatches=8), **kw)
    inter = estimate(model, batch, mesh, None, pipeline=Pipeline(stages=2, microbatches=4, schedule="interleaved",
                                                                 virtual_stages=2), **kw)
    rec = estimate(model, batch, mesh, None, pipeline=Pipeline(stages=2, microbatches=4), recompute=True, **kw)
    assert base.stages == 2 and base.bubble_s > 0 and base.p2p_s > 0
    assert more.bubble_s / more.pipeline_s < base.bubble_s / base.pipeline_s     # (p-1)/m shrinks
    assert inter.bubble_s < base.bubble_s and inter.p2p_s > base.p2p_s            # interleaving trades p2p for bubble
    assert rec.step_time_s > base.step_time_s and rec.hardware_flops > rec.model_flops == base.model_flops
    assert rec.activation_bytes < base.activation_bytes                          # only layer inputs are kept
    with pytest.raises(ValueError, match="must equal the size"):
        estimate(model, batch, mesh, None, pipeline=Pipeline(stages=4, microbatches=8), **kw)


def test_pipeline_arithmetic():
    # equal stages: (m + (p - 1) / v) t, the bubble fraction (p - 1) / (v m)
    pt = pipeline_time([1.0] * 4, [2.0] * 4, 8)
    assert pt.total_s == pytest.approx((8 + 3) * 3.0) and pt.bubble_fraction == pytest.approx(3 / 8)
    pt = pipeline_time([1.0] * 4, [2.0] * 4, 8, virtual_stages=3)
    assert pt.total_s == pytest.approx((8 + 3 / 3) * 3.0)
    # unequal stages (Alpa): sum_d t_d + (m - 1) max_d t_d
    pt = pipeline_time([1.0, 1.0, 2.0], [1.0, 1.0, 2.0], 5)
    assert pt.total_s == pytest.approx(2 + 2 + 4 + 4 * 4)
    # point-to-point on every device's microbatch, both directions, per chunk
    pt = pipeline_time([1.0] * 2, [1.0] * 2, 4, virtual_stages=2, p2p_forward=0.1, p2p_backward=0.1)
    assert pt.per_device_s == pytest.approx((2.4, 2.4))
    assert pipeline_time([1.0], [2.0], 4, p2p_forward=5.0).total_s == 12.0          # one stage: no p2p
    assert in_flight_microbatches(0, 4, 8) == 4 and in_flight_microbatches(3, 4, 8) == 1
    assert in_flight_microbatches(0, 4, 8, "gpipe") == 8
    assert in_flight_microbatches(0, 4, 8, "interleaved", 2) == pytest.approx((6 + 4 + 1) / 2)
    with pytest.raises(ValueError, match="interleaved"):
        Pipeline(stages=2, microbatches=4, virtual_stages=2)


# -- Megatron-LM Table 1, first row (the full table: benchmarks/bench_megatron.py) ---------------------
# The target is every row within 15% and a median within 7% (docs/cost_model.md). Row 1 (1.7B,
# +11.9% priced by the evaluator at its 24 layers) is inside 15% (the residual of the small models, see the
# doc), so its test holds it where it is: a change of 2 points either way fails it. The pipelined rows
# take a minute each at their depth on this machine: the benchmark runs them.
def test_megatron_row_is_priced_with_megatrons_own_flop_count():
    import bench_megatron as bm
    r = bm.price_row(bm.ROWS[0])
    assert r["graph_flops_ratio"] == pytest.approx(1.0, abs=1e-3)   # our graph's FLOPs = the paper's formula
    assert 0.10 <= r["error"] <= 0.14


# -- outputs returned whole ----------------------------------------------------------------------
class LogitsLM(torch.nn.Module):
    """Returns its loss and its logits, as Hugging Face's causal LMs do: the logits dominate memory."""

    def __init__(self, vocab=2048, hidden=32):
        super().__init__()
        self.emb, self.fc, self.head = (torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, hidden),
                                        torch.nn.Linear(hidden, vocab, bias=False))

    def forward(self, ids, labels):
        logits = self.head(torch.relu(self.fc(self.emb(ids))))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


def logits_lm(batch=32, seq=64, vocab=2048):
    with torch.device("meta"):
        model, ids = LogitsLM(vocab), torch.zeros(batch, seq, dtype=torch.long)
    return model, (ids, ids), batch * seq * vocab * 4      # the logits' bytes, whole


def test_outputs_left_split_are_priced_so_by_estimate():
    """A hand-written configuration of a model returning its logits beside its loss, priced with
    sharded_outputs=True (torchtitan's loop uses only the loss), holds no whole copy of the logits
    on each device (Llama-3-70B at 256 x 8192 on (32, 8), FSDP x TP, full recomputation: 501 GiB of
    logits whole; 24.7 GiB per device in all split)."""
    model, batch, logits = logits_lm()
    # collectives at their ring terms alone: the ops between the pins take split layouts, as this needs
    free_collectives = dataclasses.replace(load_profile("cpu"), collective_overhead=0.0)
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device=free_collectives)
    pins = {"head.weight": ("S(0)", "S(0)"), "emb.weight": ("S(0)", "S(1)")}
    whole = estimate(model, batch, mesh, pins, batch_axes=("dp",), recompute="full")
    split = estimate(model, batch, mesh, pins, batch_axes=("dp",), recompute="full", sharded_outputs=True)
    assert whole.peak_memory_bytes - split.peak_memory_bytes >= logits * (1 - 1 / mesh.size)
    assert split.peak_memory_bytes < logits


def test_infeasible_plan_names_outputs_returned_whole():
    """Where the outputs gathered whole dominate the least memory, the error says so and names
    sharded_outputs=True, with which the model fits."""
    model, batch, logits = logits_lm()
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
    with pytest.raises(autopar.InfeasibleError, match=r"outputs, returned whole, take 0\.016 GiB .*"
                                                      r"\(\(32, 64, 2048\) float32\): sharded_outputs=True") as e:
        autopar.plan(model, batch, mesh, memory_budget=1, symbolic=False)
    assert e.value.min_memory_bytes > logits
    plan = autopar.plan(model, batch, mesh, memory_budget=e.value.min_memory_bytes - logits / 2, symbolic=False,
                        sharded_outputs=True)
    assert plan.estimate.peak_memory_bytes < e.value.min_memory_bytes - logits / 2


def test_report_points_out_outputs_gathered_whole():
    """The report says what returning the logits whole costs a step, and names sharded_outputs=True,
    after which the line is gone and the step is faster."""
    model, batch, _ = logits_lm(batch=64, seq=256, vocab=8192)
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="h100")
    whole = autopar.plan(model, batch, mesh, symbolic=False, batch_axes=("dp",))
    split = autopar.plan(model, batch, mesh, symbolic=False, batch_axes=("dp",), sharded_outputs=True)
    assert "Outputs returned whole" in whole.report() and "sharded_outputs=True" in whole.report()
    assert "Outputs returned whole" not in split.report()
    assert split.estimate.step_time_s < whole.estimate.step_time_s
