"""A causal mask that a traced model materialises runs as `is_causal=True` (passes/causal_mask.py).

* A Hugging Face Llama captured by autopar hands every attention no mask and `is_causal=True`, and
  the planner prices the causal kernel's work: the (query, key) pairs it keeps, S(S+1)/2 per head.
* Masks that are not the plain causal one stay as they are: padding (an attention_mask with zeros),
  a sliding window shorter than the sequence, a mask that hides the diagonal.
* The rewritten model computes what the masked one does (forward and gradients; training against one
  process over context parallelism: tests/test_context_parallel.py, tests/test_models.py).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from autopar.passes.capture import capture  # noqa: E402
from autopar.passes.shape_prop import annotate  # noqa: E402
from zoo import hf_config  # noqa: E402

SEQ = 12


def _attention(cap):
    return [n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]


def _mask_of(node):
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")


def _llama(**config):
    import transformers
    torch.manual_seed(0)
    cfg = hf_config("llama")
    for k, v in config.items():
        setattr(cfg, k, v)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_a_llama_attends_causally_without_a_mask_and_is_priced_so():
    model = _llama()
    ids = torch.randint(0, 64, (2, SEQ))
    cap = capture(model, (ids,))
    nodes = _attention(cap)
    assert nodes and all(_mask_of(n) is None and n.kwargs.get("is_causal") is True for n in nodes)
    cfg = model.config
    info = annotate(cap.gm)[nodes[0].name]
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert info.flops == 2 * 2 * cfg.num_attention_heads * (SEQ * (SEQ + 1) // 2) * 2 * head_dim


def test_a_padding_mask_is_kept():
    model = _llama()
    ids = torch.randint(0, 64, (2, SEQ))
    pad = torch.ones(2, SEQ, dtype=torch.long)
    pad[0, :3] = 0
    nodes = _attention(capture(model, (ids,), {"attention_mask": pad}))
    assert nodes and all(_mask_of(n) is not None and not n.kwargs.get("is_causal") for n in nodes)


def test_a_sliding_window_shorter_than_the_sequence_is_kept():
    import transformers
    cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                     sliding_window=4)
    nodes = _attention(capture(transformers.MistralForCausalLM(cfg), (torch.randint(0, 64, (1, SEQ)),)))
    assert nodes and all(_mask_of(n) is not None for n in nodes)


class PositionMask(nn.Module):
    """Attention under a mask built from positions, as traced models build theirs."""

    def __init__(self, kind: str):
        super().__init__()
        self.qkv, self.kind = nn.Linear(8, 24), kind

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        pos = torch.arange(x.shape[1], device=x.device)
        keys, queries = pos[None, :], pos[:, None]
        mask = {"le": keys <= queries, "ge": queries >= keys, "lt-next": keys < queries + 1,
                "one-ahead": keys <= queries + 1}[self.kind]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


@pytest.mark.parametrize("kind,causal", [("le", True), ("ge", True), ("lt-next", True), ("one-ahead", False)])
def test_only_the_lower_triangle_with_its_diagonal_becomes_causal(kind, causal):
    nodes = _attention(capture(PositionMask(kind), (torch.randn(2, 6, 8),)))
    assert len(nodes) == 1
    assert (_mask_of(nodes[0]) is None) is causal
    assert bool(nodes[0].kwargs.get("is_causal")) is causal
