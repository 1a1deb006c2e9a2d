"""Pipelined plans: the partition into chunks, planning a given pipeline, and running it on real
CPU ranks exactly like one process (issue 12)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

import autopar
from autopar.errors import PlanOptionError
from autopar.passes.capture import capture
from autopar.passes.stages import chunk_of, cut, even_boundaries, layer_sequence, microbatch
from autopar.pipelining import pipeline_of
from autopar.plan import PipelinePlan
from autopar.planner import PlanOptions

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from models import GPT, gpt_inputs  # noqa: E402

LAYOUTS_ONLY = dict(recompute="none", offload="none", residency="keep")


def _gpt(layers=4, batch=8):
    torch.manual_seed(0)
    return GPT(vocab=64, seq=16, hidden=32, heads=4, layers=layers), gpt_inputs(batch=batch, seq=16, vocab=64)


def test_even_boundaries_split_layers_evenly_earlier_chunks_take_the_rest():
    layers = [f"blocks.{i}" for i in range(10)]
    assert even_boundaries(layers, 1) == ("",)
    assert even_boundaries(layers, 2) == ("", "blocks.5")
    assert even_boundaries(layers, 4) == ("", "blocks.3", "blocks.6", "blocks.8")
    with pytest.raises(PlanOptionError, match="pipeline.stages"):
        even_boundaries(layers[:3], 4)


@pytest.mark.parametrize("stages,virtual", [(2, 1), (2, 2)])
def test_chunks_run_the_whole_graph_in_order(stages, virtual):
    model, (x, y) = _gpt()
    cap = capture(model, (x, y))
    layers = layer_sequence(cap.gm.graph)
    assert layers == [f"blocks.{i}" for i in range(4)]
    pipe = PipelinePlan("pp", stages, virtual, 1, "interleaved", even_boundaries(layers, stages * virtual))
    part = chunk_of(cap.gm.graph, pipe)
    by_name = {n.name: c for n, c in part.items()}
    assert by_name["embedding"] == 0                                  # before the first layer: chunk 0
    assert max(part.values()) == pipe.chunks - 1
    loss_node = next(n for n in cap.gm.graph.nodes if n.op == "output").args[0][0]
    assert part[loss_node] == pipe.chunks - 1                         # head and loss: the last chunk
    for n, c in part.items():                                         # values flow forward only
        assert all(part.get(a, 0) <= c for a in n.all_input_nodes)
    chunks = cut(cap.gm, part, pipe.chunks)
    assert chunks[0].received == () and all(len(c.sent) == 1 for c in chunks[:-1])   # the residual stream
    # running the chunks one after the other computes the whole graph's loss
    values = {}
    for name, slot in cap.inputs.items():
        values[name] = (dict(model.named_parameters())[cap.param_names.get(slot.target, slot.target)]
                        if slot.kind == "param" else (x, y)[slot.target])
    sent = ()
    for c in chunks:
        out = c.module(*sent, *[values[p] for p in c.placeholders])
        sent = out
    torch.testing.assert_close(out[0], model(x, y))


def test_microbatch_cuts_batch_tensors_only():
    x, y = torch.arange(8).view(4, 2), torch.zeros(3)
    (a, b), kw = microbatch((x, y), {"z": 5}, 2, index=1)
    assert torch.equal(a, x[2:]) and b is y and kw == {"z": 5}
    with pytest.raises(PlanOptionError, match="pipeline.microbatches"):
        microbatch((x,), None, 3)


def test_plan_fixed_pipeline_layouts_replicate_the_pipeline_axis():
    model, inputs = _gpt()
    mesh = autopar.Mesh((2, 2, 2), axis_names=("pp", "dp", "tp"), device="cpu")
    plan = autopar.plan(model, inputs, mesh, pipeline=dict(axis="pp", stages=2, microbatches=4, schedule="1f1b"),
                        symbolic=False, **LAYOUTS_ONLY)
    assert plan.pipeline == PipelinePlan("pp", 2, 1, 4, "1f1b", ("", "blocks.2"))
    assert all(n.output[0] == "R" for n in plan.nodes if n.output)
    assert all(p[0] == "R" for p in plan.placements.values())
    assert autopar.Plan.from_json(plan.to_json()) == plan
    # planned at the microbatch size: the loss's input is one microbatch of 2 sequences
    interleaved = autopar.plan(model, inputs, mesh, symbolic=False, **LAYOUTS_ONLY, pipeline=dict(
        axis="pp", stages=2, microbatches=4, schedule="interleaved", virtual_stages=2))
    assert interleaved.pipeline.boundaries == ("", "blocks.1", "blocks.2", "blocks.3")
    for off in (None, False):
        assert pipeline_of(PlanOptions(pipeline=off), mesh) is None       # planned as without the option


@pytest.mark.parametrize("spec,key", [
    (dict(axis="zz", stages=2, microbatches=4, schedule="1f1b"), "pipeline.axis"),
    (dict(axis="pp", stages=4, microbatches=4, schedule="1f1b"), "pipeline.stages"),
    (dict(axis="pp", stages=2, microbatches=3, schedule="1f1b"), "pipeline.microbatches"),
    (dict(axis="pp", stages=2, microbatches=1, schedule="1f1b"), "pipeline.microbatches"),
    (dict(axis="pp", stages=2, microbatches=4, schedule="gpipe", virtual_stages=2), "pipeline.virtual_stages"),
    (dict(axis="pp", stages=2, microbatches=4, schedule="interleaved", virtual_stages=4), "pipeline.stages"),
    (dict(axis="pp", stages=2, microbatches=4, schedule="xx"), "pipeline.schedule"),
    (dict(axis="pp", stages=2, microbatchs=4, schedule="1f1b"), "microbatchs"),
])
def test_invalid_pipeline_is_an_error_naming_the_key(spec, key):
    model, inputs = _gpt()
    mesh = autopar.Mesh((2, 2, 2), axis_names=("pp", "dp", "tp"), device="cpu")
    with pytest.raises(PlanOptionError, match=key):
        autopar.plan(model, inputs, mesh, pipeline=spec, symbolic=False)
