"""The experts executor (`passes.lowering.moe_grouped`): token-slots sorted by expert through two
grouped GEMMs (torch.nn.functional.grouped_mm), differentiated by autograd.

* It equals a loop over experts (Hugging Face's eager experts), forward and gradients, dropless or
  with dropped slots, on all experts or on a block of them (the blocks' results sum to the whole),
  and where grouped_mm cannot take the shapes or dtype (float64, rows not 16-byte aligned).
* Its forward+backward executes 3x the forward's FLOPs (dX and dW grouped GEMMs, nothing run twice).
* What it keeps for the backward is what the cost model prices (`cost_model.experts`).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from autopar.cost_model.experts import expert_saved_bytes
from autopar.passes.lowering import moe_grouped

T, K, E, H = 12, 2, 4, 16


def _inputs(inter=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    leaves = [torch.randn(T, H, generator=g), torch.rand(T, K, generator=g),
              torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5,
              torch.randn(E, H, inter, generator=g) / inter ** 0.5]
    hidden, weights, gate_up, down = (t.to(dtype).requires_grad_() for t in leaves)
    return hidden, index, weights, gate_up, down


def _loop(hidden, index, weights, gate_up, down):
    """One expert at a time, as transformers' eager experts run."""
    out = torch.zeros_like(hidden)
    for e in range(gate_up.shape[0]):
        tok, slot = torch.where(index == e)
        gate, up = F.linear(hidden[tok], gate_up[e]).chunk(2, dim=-1)
        out = out.index_add(0, tok, F.linear(F.silu(gate) * up, down[e]) * weights[tok, slot, None])
    return out


def _grads(fn, leaves, cotangent):
    out = fn()
    return [out.detach()] + list(torch.autograd.grad(out, leaves, cotangent))


@pytest.mark.parametrize("inter,dtype", [(8, torch.float32), (6, torch.float32), (8, torch.float64)],
                         ids=["grouped_mm", "unaligned", "float64"])
@pytest.mark.parametrize("drop", [False, True], ids=["dropless", "dropped"])
def test_equals_a_loop_over_experts_forward_and_backward(inter, dtype, drop):
    hidden, index, weights, gate_up, down = _inputs(inter, dtype)
    if drop:
        index = index.clone()
        index[::3, 1] = -1
    leaves = [hidden, weights, gate_up, down]
    cotangent = torch.randn(T, H, generator=torch.Generator().manual_seed(1), dtype=dtype)
    want = _grads(lambda: _loop(hidden, index, weights, gate_up, down), leaves, cotangent)
    whole = _grads(lambda: moe_grouped(hidden, index, weights, gate_up, down, "silu", 0, every_slot_local=not drop),
                   leaves, cotangent)
    # two devices' blocks of experts: partial sums
    blocks = _grads(lambda: sum(moe_grouped(hidden, index, weights, gate_up[b:b + 2], down[b:b + 2], "silu", b)
                                for b in (0, 2)), leaves, cotangent)
    for got in (whole, blocks):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_backward_runs_no_forward_again():
    hidden, index, weights, gate_up, down = _inputs()
    with FlopCounterMode(display=False) as fwd:
        out = moe_grouped(hidden, index, weights, gate_up, down, "silu", 0, every_slot_local=True)
    with FlopCounterMode(display=False) as bwd:
        out.sum().backward()
    inter = down.shape[2]
    forward = 2 * T * K * (2 * inter * H + H * inter)
    assert fwd.get_total_flops() == forward
    assert bwd.get_total_flops() == 2 * forward       # dX and dW of both grouped GEMMs


@pytest.mark.parametrize("experts", [E, E // 2], ids=["all", "half"])
def test_saved_bytes_are_the_priced_ones(experts):
    hidden, index, weights, gate_up, down = _inputs()
    params = {t.untyped_storage().data_ptr() for t in (gate_up, down)}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        moe_grouped(hidden, index, weights, gate_up[:experts], down[:experts], "silu", 0,
                    every_slot_local=experts == E)
    slots = int((index < experts).sum())
    assert sum(saved.values()) == expert_saved_bytes(slots, slots, H, down.shape[2], 4, experts)
