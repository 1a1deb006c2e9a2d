"""`autoparallelize` leaves the user's model untouched: its parameters are copied, never aliased,
whether the plan replicates or shards them, so training the distributed module changes nothing
in the user's model (bit for bit)."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import autopar  # noqa: E402
from dist_checks import LAYOUTS_ONLY, shard_happy_profile  # noqa: E402
from models import GPT, gpt_inputs  # noqa: E402

PINS = {"blocks.0.ln1.weight": ("R", "R"), "blocks.0.ln1.bias": ("R", "R"), "wte.weight": ("R", "R"),
        "blocks.0.attn.qkv.weight": ("S(0)", "R"), "blocks.0.fc.weight": ("R", "S(0)")}


def _train_and_diff(rank, world_size, pins):
    torch.manual_seed(0)
    model = GPT(vocab=64, seq=16, hidden=32, heads=4, layers=1)
    inputs = gpt_inputs(batch=4, seq=16, vocab=64)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device=shard_happy_profile())
    dmodel = autopar.autoparallelize(model, mesh, inputs, pins=pins, **LAYOUTS_ONLY)
    opt = torch.optim.AdamW(dmodel.parameters(), lr=1e-2)
    for _ in range(2):
        dmodel(*inputs).backward()
        opt.step()
        opt.zero_grad()
    moved = sorted(k for k, v in model.state_dict().items() if not torch.equal(before[k], v))
    trained = sorted(k for k, p in dmodel.named_parameters()
                     if not torch.equal(p.detach().full_tensor(), before[k]))
    return moved, trained, dict(dmodel.plan.placements)


def test_training_the_distributed_module_leaves_the_users_parameters_bit_identical(rank_pool):
    results = rank_pool(4).run(_train_and_diff, PINS)
    for moved, trained, placements in results:
        assert moved == [], f"the user's model changed: {moved}"
        assert len(trained) >= 10          # the distributed module did train
        layouts = set(placements.values())
        assert ("R", "R") in layouts and any("S(0)" in lay for lay in layouts)
        assert all(tuple(placements[k]) == v for k, v in PINS.items())
