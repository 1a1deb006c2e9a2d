"""One tensor passed as two inputs (`model(input_ids=x, labels=x)`, Hugging Face's usual call) keeps both
names: two placeholders, each pinnable, each fed from its own position."""
from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import autopar  # noqa: E402
import zoo  # noqa: E402
from dist_checks import LAYOUTS_ONLY, rel, shard_happy_profile  # noqa: E402
from models import GPT  # noqa: E402

MESH = autopar.Mesh((2, 2), ("dp", "tp"), "h100")


def _inputs(plan):
    return {n.name: n.output for n in plan.nodes if n.name in ("idx", "targets", "input_ids", "labels")}


def test_a_tensor_passed_twice_positionally_keeps_both_names_and_pins():
    torch.manual_seed(0)
    x = torch.randint(0, 64, (4, 16))
    plan = autopar.plan(GPT(vocab=64, seq=16, hidden=32, heads=4, layers=1), (x, x), MESH, progress=False,
                        symbolic=False, pins={"idx": ("S(0)", "R"), "targets": ("R", "R")}, **LAYOUTS_ONLY)
    assert _inputs(plan) == {"idx": ("S(0)", "R"), "targets": ("R", "R")}


def _hf_same_tensor(rank, world_size):
    """A causal LM called as `model(input_ids=x, labels=x)`: the distributed step is one process's."""
    model, _, kwargs, loss_fn = zoo.build("llama")
    x = kwargs["input_ids"]
    same = {"input_ids": x, "labels": x}
    ref = copy.deepcopy(model)
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device=shard_happy_profile())
    dmodel = autopar.autoparallelize(model, mesh, (), example_kwargs=same, symbolic=False,
                                     pins={"input_ids": ("S(0)", "R"), "labels": ("R", "S(1)")}, **LAYOUTS_ONLY)
    loss, ref_loss = loss_fn(dmodel(**same)), loss_fn(ref(**same))
    loss.backward(), ref_loss.backward()
    grads = dict(dmodel.named_parameters())
    worst = max(rel(grads[k].grad.full_tensor(), p.grad) for k, p in ref.named_parameters())
    return rel(loss.detach(), ref_loss.detach()), worst, _inputs(dmodel.plan)


def test_a_tensor_passed_twice_by_keyword_is_pinned_and_fed_under_both_names(rank_pool):
    for loss_gap, grad_gap, layouts in rank_pool(4).run(_hf_same_tensor):
        assert layouts == {"input_ids": ("S(0)", "R"), "labels": ("R", "S(1)")}
        assert loss_gap < 1e-5 and grad_gap < 1e-4
