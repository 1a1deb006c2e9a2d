"""Sequence and context parallelism (issue 13).

* On 4 CPU ranks over `Mesh((4,), ("cp",))`, a GPT (causal SDPA, learned positions) and a Hugging
  Face Llama (rotary positions, GQA, the causal mask materialised by export) with their inputs
  pinned split on the sequence and their attention pinned "ring", "ulysses" or "allgather_kv"
  train 2 AdamW steps like one process (loss, gradients, parameters within 1e-5), and the plan's
  attention nodes carry those labels.
* A pin that is neither a placement nor a strategy label is an error naming it.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import autopar  # noqa: E402
from autopar.errors import AutoparError  # noqa: E402
from dist_checks import train_and_compare  # noqa: E402
from models import GPT, gpt_inputs  # noqa: E402

TOL = 1e-5
SEQ_PINS = {"gpt": {"idx": ("S(1)",), "targets": ("S(1)",)},
            "zoo:llama": {"input_ids": ("S(1)",), "labels": ("S(1)",)}}
CASES = [(m, lab) for m in SEQ_PINS for lab in ("ring", "ulysses", "allgather_kv")]


@pytest.mark.parametrize("model,label", CASES, ids=[f"{m}-{lab}" for m, lab in CASES])
def test_context_parallel_trains_like_one_process(rank_pool, model, label):
    pins = {**SEQ_PINS[model], "scaled_dot_product_attention*": (label,)}
    results = rank_pool(4).run(train_and_compare, model, (4,), ("cp",), pins, timeout=300)
    r = results[0]
    for key in ("loss", "grad", "param", "buffer"):
        assert max(x[key] for x in results) < TOL, (key, {k: r[k] for k in ("loss", "grad", "param", "buffer")})
    assert label in r["labels"], r["labels"]
    assert r["fallbacks"] == [], r["fallbacks"]


def test_data_and_context_parallel_together(rank_pool):
    """(dp, cp) = (2, 2): batch over dp, sequence over cp, ring attention; the loss's flattening of
    (batch, sequence) keeps both splits ("merge"), so no rank gathers the logits."""
    seq = ("S(0)", "S(1)")
    pins = {"idx": seq, "targets": seq, "scaled_dot_product_attention*": ("batch", "ring"),
            "view_8": ("S(0)", "S(0)"), "view_9": ("S(0)", "S(0)")}    # logits and targets flattened
    results = rank_pool(4).run(train_and_compare, "gpt-b2", (2, 2), ("dp", "cp"), pins, timeout=300)
    r = results[0]
    for key in ("loss", "grad", "param", "buffer"):
        assert max(x[key] for x in results) < TOL, (key, {k: r[k] for k in ("loss", "grad", "param", "buffer")})
    assert {"ring", "merge"} <= set(r["labels"]), r["labels"]


def test_unparseable_pin_names_it():
    model = GPT(vocab=64, seq=16, hidden=32, heads=4, layers=1)
    with pytest.raises(AutoparError, match="scaled_dot_product_attention.*Ring!"):
        autopar.plan(model, gpt_inputs(batch=2, seq=16), autopar.Mesh((4,), ("cp",), device="cpu"),
                     pins={"scaled_dot_product_attention*": ("Ring!",)})
