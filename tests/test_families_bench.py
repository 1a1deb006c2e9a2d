"""The families sweep's measure of "trains exactly" (benchmarks/bench_families.py, docs/families.md).

A key projection's bias gets a gradient that is zero in exact arithmetic (softmax ignores a shift common
to one query's scores), so after training from zero it holds only rounding: two exact computations of
opt differ there by O(1) of its own size. Here the one-process model trained on the whole batch is
compared with the same model trained on two accumulated half batches (the same arithmetic a data-parallel
plan does, in another order): the sweep's measure must call that exact and still flag a wrong update.
"""
import copy
import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_families import LR, TOL, build, largest_step, state_gap  # noqa: E402

pytest.importorskip("transformers")


def _train(model, kwargs, halves: int, steps: int = 2) -> float:
    opt, step = torch.optim.SGD(model.parameters(), lr=LR), 0.0
    for _ in range(steps):
        for part in range(halves):
            piece = {k: v.chunk(halves)[part] for k, v in kwargs.items()}
            (model(**piece).loss / halves).backward()
        step = max(step, largest_step(model))
        opt.step(), opt.zero_grad()
    return step


def test_a_zero_gradient_bias_is_compared_at_the_scale_of_a_step():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, kwargs = build("opt")
        split = copy.deepcopy(model)
        step = _train(model, kwargs, 1)
        _train(split, kwargs, 2)
    ref = {k: p.detach() for k, p in model.named_parameters()}
    mine = {k: p.detach() for k, p in split.named_parameters()}
    bias = "model.decoder.layers.0.self_attn.k_proj.bias"
    own_size = float((mine[bias] - ref[bias]).abs().max() / ref[bias].abs().max())
    assert own_size > TOL                      # rounding only: against its own size it looks wrong
    assert state_gap(mine, ref, step) < TOL    # against a step, exact
    mine[bias] = mine[bias] + 0.01 * step      # an update off by a hundredth of a step is still caught
    assert state_gap(mine, ref, step) > TOL
