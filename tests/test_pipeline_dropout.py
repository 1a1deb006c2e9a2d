"""Dropout in a pipelined plan: each microbatch draws the mask the unpipelined plan draws for its rows
(runtime/rng.py), so a pipelined GPT with dropout trains exactly like the same plan without a pipeline."""
from __future__ import annotations

import os
import sys

import torch

import autopar

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from dist_checks import LAYOUTS_ONLY, rel, shard_happy_profile  # noqa: E402
from models import GPT, gpt_inputs  # noqa: E402

STEPS = 2   # the second step's masks differ from the first's (the calls counter) and run from its update


def _train(dmodel):
    dmodel.manual_seed(11)
    opt = torch.optim.SGD(dmodel.parameters(), lr=0.5)
    losses = []
    for _ in range(STEPS):
        loss = dmodel(*gpt_inputs(batch=8, seq=16, vocab=64))
        loss.backward()
        opt.step(), opt.zero_grad()
        losses.append(float(loss))
    return losses, {k: p.detach().full_tensor() for k, p in dmodel.named_parameters()}


def _pipelined_and_not(rank, world_size):
    import torch.distributed as dist
    mesh = autopar.Mesh((2, 2, 2), ("pp", "dp", "tp"), device=shard_happy_profile())
    torch.manual_seed(0)
    model = GPT(vocab=64, seq=16, hidden=32, heads=4, layers=2, dropout=0.1)
    inputs = gpt_inputs(batch=8, seq=16, vocab=64)
    # parameters replicated (a quick plan): the batch, and so every dropout, split over dp and tp
    pins = {k: ("R", "R", "R") for k, _ in model.named_parameters()}
    piped = autopar.autoparallelize(model, mesh, inputs, symbolic=False, pins=pins, **LAYOUTS_ONLY, pipeline=dict(
        axis="pp", stages=2, microbatches=2, schedule="1f1b"))
    losses, params = _train(piped)
    held = [None] * world_size
    dist.all_gather_object(held, params)
    params = {k: v for part in held for k, v in part.items()}
    plain = autopar.autoparallelize(model, mesh, inputs, symbolic=False, pins=dict(piped.plan.placements),
                                    **LAYOUTS_ONLY, pipeline=False)
    ref_losses, ref_params = _train(plain)
    dropouts = sum(1 for n in plain.plan.nodes if "dropout" in n.name)
    gaps = [rel(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, ref_losses)]
    return dropouts, max(gaps), max(rel(params[k], p) for k, p in ref_params.items()), losses


def test_a_pipelined_gpt_with_dropout_trains_like_the_same_plan_without_a_pipeline(rank_pool):
    for dropouts, loss_gap, param_gap, losses in rank_pool(8).run(_pipelined_and_not, timeout=600):
        assert dropouts == 4 and len(set(losses)) == STEPS          # two residual dropouts per block
        assert loss_gap < 1e-5 and param_gap < 1e-4, (loss_gap, param_gap)
