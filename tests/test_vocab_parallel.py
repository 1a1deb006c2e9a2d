"""Vocab parallelism (issue 13): the embedding and the cross-entropy split over the vocabulary.

* On 4 CPU ranks, a GPT (tied embedding and head) with its embedding, head and loss pinned to the
  vocab-parallel layouts (the table split on rows, the head column-parallel, the loss on logits split
  on the classes) trains 3 AdamW steps like one process (loss, gradients, parameters within 1e-4);
  the plan never gathers the logits and labels those nodes "vocab_parallel". Also on a (dp, tp) mesh.
* The planner chooses them by itself where the logits are large: a wide-vocabulary model on a tp axis.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import autopar  # noqa: E402
from dist_checks import build, train_and_compare  # noqa: E402

TOL = 1e-4
VOCAB = "vocab_parallel"
# the GPT's token lookup, its head (linear_4 -> logits, view_4 flattens them) and its loss
LOGITS = ("linear_4", "view_4")


def vocab_pins(mesh_ndim: int, tp: int) -> dict:
    """Vocab-parallel pins on axis `tp` of a mesh; "batch" (or the batch split) on the others."""
    def per_axis(on_tp: str, other: str) -> tuple:
        return tuple(on_tp if a == tp else other for a in range(mesh_ndim))
    return {"embedding": per_axis(VOCAB, "batch"), "linear_4": per_axis("column", "batch"),
            "view_4": per_axis("S(1)", "S(0)"), "cross_entropy_loss*": per_axis(VOCAB, "batch")}


def _plan(mesh_shape, axis_names, pins, name="gpt"):
    from dist_checks import LAYOUTS_ONLY, shard_happy_profile
    model, inputs, _ = build(name)
    mesh = autopar.Mesh(mesh_shape, axis_names, device=shard_happy_profile())
    return autopar.plan(model, inputs, mesh, pins=pins, symbolic=False, **LAYOUTS_ONLY)


def _gathers_logits(plan) -> list[str]:
    return [f"{n.name}: {c.kind} of {c.tensor}" for n in plan.nodes for c in n.collectives
            if c.tensor in LOGITS and c.kind.startswith("all_gather") and c.phase == "forward"]


@pytest.mark.parametrize("mesh_shape,axis_names,name", [((4,), ("tp",), "gpt"), ((2, 2), ("dp", "tp"), "gpt")],
                         ids=["tp4", "dp2xtp2"])
def test_vocab_parallel_trains_like_one_process(rank_pool, mesh_shape, axis_names, name):
    pins = vocab_pins(len(mesh_shape), axis_names.index("tp"))
    plan = _plan(mesh_shape, axis_names, pins, name)
    by_name = {n.name: n for n in plan.nodes}
    assert by_name["embedding"].inputs[0][axis_names.index("tp")] == "S(0)"
    assert VOCAB in by_name["embedding"].labels and VOCAB in by_name["cross_entropy_loss_default"].labels
    assert _gathers_logits(plan) == []
    results = rank_pool(4).run(train_and_compare, name, mesh_shape, axis_names, pins, timeout=300)
    r = results[0]
    for key in ("loss", "grad", "param"):
        assert max(x[key] for x in results) < TOL, (key, {k: r[k] for k in ("loss", "grad", "param")})
    assert VOCAB in r["labels"] and r["fallbacks"] == []
