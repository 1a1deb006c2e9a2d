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
            "zoo:llama@1": {"input_ids": ("S(1)",), "labels": ("S(1)",)}}   # one layer: the same ops
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


# the blockwise executor against one process: (dtype, causal, boolean mask, local tokens, kv heads,
# value head dim; the queries' and keys' is 16)
BLOCK_CASES = {
    "fp32-causal": (torch.float32, True, False, 8, 4, 16),
    "fp32-causal-odd-chunk": (torch.float32, True, False, 7, 4, 16),    # no balanced order: blocks skipped
    "bf16-causal-gqa": (torch.bfloat16, True, False, 8, 2, 16),
    "fp32-mask": (torch.float32, False, True, 8, 2, 16),                # rows wholly masked within a block
    "fp32-causal-narrow-values": (torch.float32, True, False, 8, 4, 12),  # multi-head latent attention's shape
}


def _blockwise_vs_one_process(rank, world_size, mode, dtype, causal, masked, local, kv_heads, dv):
    """(worst relative difference of the output, of dq/dk/dv) of `context_attention` on this rank's
    contiguous chunk against one process's SDPA on the whole sequence."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from autopar.runtime.attention import context_attention
    from autopar.strategies.attention import sdpa_args
    g = torch.Generator().manual_seed(0)
    b, h, d, s = 2, 4, 16, local * world_size
    q, k, v = (torch.randn(b, n, s, w, generator=g).to(dtype) for n, w in ((h, d), (kv_heads, d), (kv_heads, dv)))
    mask = (torch.rand(s, s, generator=g) < 0.3) | torch.eye(s, dtype=torch.bool) if masked else None
    dout = torch.randn(b, h, s, dv, generator=g).to(dtype)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*whole, attn_mask=mask, is_causal=causal, enable_gqa=kv_heads != h)
    ref.backward(dout)
    rows = slice(rank * local, (rank + 1) * local)
    mine = [t[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
    mesh = init_device_mesh("cpu", (world_size,))
    out = context_attention(sdpa_args(*mine, attn_mask=None if mask is None else mask[rows], is_causal=causal,
                                      enable_gqa=kv_heads != h), mesh, 0, mode)
    out.backward(dout[:, :, rows])

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())
    return rel(out, ref[:, :, rows]), max(rel(m.grad, w.grad[:, :, rows]) for m, w in zip(mine, whole))


@pytest.mark.parametrize("case", list(BLOCK_CASES))
@pytest.mark.parametrize("mode", ["ring", "allgather_kv"])
def test_blockwise_attention_matches_one_process(rank_pool, mode, case):
    """Each K/V block through the fused kernel, merged by log-sum-exp: the output and gradients of one
    process's SDPA (bf16: within its rounding; the blocks' outputs are merged in fp32)."""
    dtype, *rest = BLOCK_CASES[case]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for out_err, grad_err in rank_pool(2).run(_blockwise_vs_one_process, mode, dtype, *rest):
        assert out_err < tol and grad_err < tol, (out_err, grad_err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernels need a GPU")
@pytest.mark.parametrize("dtype,masked", [(torch.bfloat16, False), (torch.float32, True)])
def test_cuda_attention_block_matches_sdpa(dtype, masked):
    """compat.attention_block (flash for 16-bit without a mask, else efficient) gives SDPA's output and
    its log-sum-exp, and its backward from them SDPA's gradients."""
    import torch.nn.functional as F
    from autopar.compat import attention_block, attention_block_backward
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(2, 4, 100, 64, device="cuda", generator=g, dtype=dtype) for _ in range(4))
    mask = torch.rand(100, 100, device="cuda", generator=g) < 0.5 if masked else None
    bias = None if mask is None else torch.zeros(mask.shape, dtype=dtype, device="cuda").masked_fill(~mask, -torch.inf)
    scale = 0.125
    out, lse, state = attention_block(q, k, v, bias, not masked, scale)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~(mask if masked else torch.ones(100, 100, device="cuda").tril().bool()), -torch.inf)
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=1e-2, atol=1e-2)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*whole, attn_mask=mask, is_causal=not masked, scale=scale)
    ref.backward(dout)
    torch.testing.assert_close(out, ref)
    grads = attention_block_backward(dout, q, k, v, out, lse, bias, not masked, scale, state)
    for mine, w in zip(grads, whole):
        torch.testing.assert_close(mine, w.grad, rtol=2e-2, atol=2e-2)
