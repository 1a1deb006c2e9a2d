"""Zero bubble (ZB-1P) is priced as it runs: its weight pass reduces every parameter's gradient alone, once
per microbatch (runtime/pipeline.py), and the plan's gradient-sync seconds are those collectives, counted
on real ranks; virtual stages are priced (time and memory in flight), and plan, estimate and the runtime
take the same schedules."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate

import autopar
from autopar.compat import TorchDispatchMode
from autopar.cost_model.pipeline import Pipeline, in_flight_microbatches
from dist_checks import LAYOUTS_ONLY, shard_happy_profile

M, LAYERS = 4, 4


class Stack(nn.Module):
    """Untied layers (every gradient is reduced by its own stage alone), its loss inside."""

    def __init__(self, width=16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(LAYERS))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(x, y)


def _setup(virtual=2):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g))
    # memory as fast as the links: at the shard-happy profile's 1 MB/s, an all-reduce's clone of a
    # gradient (cost_model.comm.local_copy_bytes) costs more than computing the batch whole
    mesh = autopar.Mesh((2, 2), ("pp", "dp"), device=replace(shard_happy_profile(), memory_bandwidth=1e15))
    pins = {k: ("R", "R") for k, _ in Stack().named_parameters()}
    kw = dict(symbolic=False, pins=pins, batch_axes=("dp",), **LAYOUTS_ONLY,
              pipeline=dict(axis="pp", stages=2, microbatches=M, schedule="zb", virtual_stages=virtual))
    return Stack(), inputs, mesh, kw


C10D = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")   # what runtime/reshard.py calls


class _Collectives(TorchDispatchMode):
    """Counts the collectives issued: c10d's that the runtime calls itself, and DTensor's functional ones
    (torch's CommDebugMode sees the latter only, and its module tracker does not follow pipeline stages)."""

    def __init__(self):
        super().__init__()
        self.issued = Counter()     # collective name -> how many
        self._patches = [mock.patch.object(dist, name, self._counted(getattr(dist, name))) for name in C10D]

    def _counted(self, fn):
        def run(*args, **kwargs):
            self.issued[fn.__name__] += 1
            return fn(*args, **kwargs)
        return run

    def __enter__(self):
        for p in self._patches:
            p.start()
        return super().__enter__()

    def __exit__(self, *exc):
        for p in self._patches:
            p.stop()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and not func.__name__.startswith("wait"):
            self.issued[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _count_reductions(rank, world_size):
    """Per rank: the collectives a training step issues beyond a forward-only call (the gradients' and
    those of the activations' gradients), by name, the parameters it holds, and the plan."""
    model, inputs, mesh, kw = _setup()
    dmodel = autopar.autoparallelize(model, mesh, inputs, **kw)
    local = mesh.local_batch(inputs, ("dp",))
    counts = []
    for grad in (True, False):
        with _Collectives() as comm, torch.set_grad_enabled(grad):
            dmodel(*local)
        counts.append(comm.issued)
    held = {k: tuple(p.shape) for k, p in dmodel.named_parameters()}
    return counts[0] - counts[1], held, dmodel.plan.to_json() if rank == 0 else None


def test_zero_bubble_gradient_sync_is_priced_as_the_collectives_it_issues(rank_pool):
    results = rank_pool(4).run(_count_reductions, timeout=300)
    plan = autopar.Plan.from_json(results[0][2])
    mesh = _setup()[2]
    stage_mesh = mesh.stage_mesh("pp")          # the mesh a stage's layouts are priced on
    backward = [c for n in plan.nodes for c in n.collectives if c.phase == "backward"]
    params = {f"p_{k.replace('.', '_')}" for k, _ in Stack().named_parameters()}
    # the plan's gradient collectives: one all-reduce over dp per parameter (pinned replicated)
    assert sorted(c.tensor for c in backward if c.tensor in params) == sorted(params)
    assert {c.kind for c in backward if c.tensor in params} == {"all_reduce@dp"}
    # every backward collective the plan lists (the activations' gradients' too, wherever the
    # solver placed them) runs once per microbatch on each rank of its stage, and no other runs
    dp = mesh.shape[mesh.axis_names.index("dp")]
    assert sum(sum(issued.values()) for issued, _, _ in results) == dp * M * len(backward)
    for issued, held, _ in results:      # every rank holds two of the four equal layers
        assert issued["all_reduce"] == M * len(held) > 0      # each gradient reduced alone, every microbatch
        counted = sum(M * stage_mesh.reshard_cost(shape, 4, (Partial(),), (Replicate(),)).seconds for shape in held.values())
        assert plan.estimate.grad_sync_s == pytest.approx(counted, rel=1e-9)


def test_zero_bubble_takes_virtual_stages_in_plan_estimate_and_memory():
    model, inputs, mesh, kw = _setup(virtual=2)
    plan = autopar.plan(model, inputs, mesh, progress=False, **kw)
    pipe = Pipeline(stages=2, microbatches=M, schedule="zb", virtual_stages=2)      # accepted, as plan() takes it
    est = autopar.estimate(model, inputs, mesh, {k: v[1:] for k, v in kw["pins"].items()}, batch_axes=("dp",),
                           pipeline=pipe, **LAYOUTS_ONLY)
    assert est.step_time_s == plan.estimate.step_time_s and est.virtual_stages == 2
    one = autopar.plan(model, inputs, mesh, progress=False, **{**kw, "pipeline": {**kw["pipeline"], "virtual_stages": 1}})
    assert plan.estimate.bubble_s < one.estimate.bubble_s                        # the fill divided over 2 chunks
    # in flight: one chunk-forward per hop to the last stage (torch's warm-up), (v - 1) rounds more
    assert [in_flight_microbatches(d, 2, M, "zb", 2) for d in range(2)] == [(1 + 2 + 1) / 2, (0 + 2 + 1) / 2]
    assert [in_flight_microbatches(d, 2, M, "zb", 1) for d in range(2)] == [2.0, 1.0]
    assert plan.estimate.stage_memory_bytes != one.estimate.stage_memory_bytes
    with pytest.raises(ValueError, match="'interleaved' or 'zb'"):
        Pipeline(stages=2, microbatches=M, schedule="1f1b", virtual_stages=2)
