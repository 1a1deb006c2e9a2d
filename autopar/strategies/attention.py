"""Scaled dot-product attention: split over batch, heads, or the sequence (context parallelism).

q, k, v are (B, H, S, D) (k and v may have fewer heads: GQA), an optional mask broadcasts against
the scores (B, H, Sq, Sk). Along one mesh axis of n devices:

    batch         S(0), S(0), S(0) [, mask S(0)]  -> S(0)   independent per sample
    heads         S(1), S(1), S(1) [, mask S(1)]  -> S(1)   independent per head
    ring          S(2), S(2), S(2) [, mask S(-2)] -> S(2)   queries stay; K/V blocks go round the axis,
                                                            merged by online softmax (Liu et al. 2023)
    allgather_kv  S(2), S(2), S(2) [, mask S(-2)] -> S(2)   queries stay; K/V gathered whole (Llama 3)
    ulysses       S(2), S(2), S(2) [, mask R]     -> S(2)   all-to-all sequence -> heads, attention on
                                                            n-th of the heads, all-to-all back
                                                            (DeepSpeed-Ulysses; heads must divide)

The last three are context parallelism: the sequence stays split through attention, so the whole
model can keep activations split on the sequence. Their executor is `runtime/attention.py`, which
balances causal work (each device computes on sequence chunks i and 2n-1-i) and runs each block
through a fused kernel; their time, with the ring's transfers overlapped with its blocks, and the
memory their executor keeps and works in, are `cost_model/context.py`, from the facts of
`sequence_split` (`inner.SequenceSplit`). A strategy uses at most one
context-parallel axis.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import Replicate, Shard

from .inner import SequenceSplit
from .registry import AxisOption, register
from .strategy import shard_count

aten = torch.ops.aten
R = Replicate()

CONTEXT_LABELS = ("ring", "allgather_kv", "ulysses")
SEQ, HEADS = 2, 1      # dims of q, k, v (and of the output)


def sdpa_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """The arguments of aten.scaled_dot_product_attention by name."""
    return dict(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                scale=scale, enable_gqa=enable_gqa)


def _mask_placement(q, mask, d: int):
    """The mask's placement when q's dim d is split: split alike where it has that dim whole."""
    k = d - (q.ndim - mask.ndim)
    return Shard(k) if k >= 0 and mask.shape[k] == q.shape[d] else R


def _sequence_splittable(node, ins) -> bool:
    """Context parallelism needs self-attention (as many keys as queries) and no attention dropout."""
    a = sdpa_args(*node.args, **node.kwargs)
    q, k = ins[0], ins[1]
    return q.ndim == 4 and q.shape[SEQ] == k.shape[SEQ] and not a["dropout_p"]


def ulysses_layouts(inputs: Sequence[tuple], output: tuple, labels: Sequence[str]):
    """(inputs, output) layouts in which a Ulysses strategy computes: q, k, v and the output split on
    heads instead of the sequence over its "ulysses" axis (the mask as it arrives)."""
    def swap(layout):
        return tuple(Shard(HEADS) if lab == "ulysses" else p for p, lab in zip(layout, labels))
    return tuple(swap(L) if i < 3 else tuple(L) for i, L in enumerate(inputs)), swap(output)


def context_axis(labels: Sequence[str]) -> int | None:
    """The mesh axis a strategy runs context-parallel attention over, if any."""
    axes = [a for a, lab in enumerate(labels) if lab in CONTEXT_LABELS]
    return axes[0] if axes else None


def admissible(labels: Sequence[str], inputs, output, ins, outs, mesh_shape, fits) -> bool:
    """At most one context-parallel axis; under Ulysses the heads of q, k and v divide as well."""
    if sum(lab in CONTEXT_LABELS for lab in labels) > 1:
        return False
    if "ulysses" not in labels:
        return True
    inner, _ = ulysses_layouts(inputs, output, labels)
    return all(fits(L, m, mesh_shape) for L, m in zip(inner[:3], ins[:3]))


def sequence_split(node, s, ins, outs, mesh_shape) -> tuple[SequenceSplit, ...]:
    """The `inner` hook: the transfers of a strategy with a context-parallel axis (none for any other)."""
    axis = context_axis(s.labels)
    if axis is None:
        return ()
    args = sdpa_args(*node.args, **node.kwargs)
    q_b = ins[0].nbytes / shard_count(s.inputs[0], mesh_shape)
    kv_b = (ins[1].nbytes + ins[2].nbytes) / shard_count(s.inputs[1], mesh_shape)
    return (SequenceSplit(s.labels[axis], axis, mesh_shape[axis], q_b, kv_b,
                          balanced=bool(args["is_causal"]) or args["attn_mask"] is not None,
                          itemsize=ins[1].dtype.itemsize, head_dim=int(ins[0].shape[-1]),
                          value_dim=int(ins[2].shape[-1])),)


@register(aten.scaled_dot_product_attention, family="attention", admits=admissible, inner=sequence_split)
def sdpa_rule(node, ins, outs):
    """Split the batch, the heads, or the sequence ("ring", "allgather_kv", "ulysses": context parallelism)."""
    q = ins[0]
    opts = []
    for d in range(q.ndim - 2):
        placements = [Shard(d), Shard(d), Shard(d)] + [_mask_placement(q, m, d) for m in ins[3:]]
        opts.append(AxisOption(tuple(placements), Shard(d), "batch" if d == 0 else "heads"))
    if _sequence_splittable(node, ins):
        seq = (Shard(SEQ),) * 3
        rows = tuple(_mask_placement(q, m, SEQ) for m in ins[3:])
        # the blockwise executor (runtime/attention.py) sends no gradient to the mask: a float mask can
        # be a learned bias (T5's relative positions), so only a boolean mask, or none, goes blockwise
        if all(m.dtype == torch.bool for m in ins[3:]):
            opts.append(AxisOption(seq + rows, Shard(SEQ), "ring"))
            opts.append(AxisOption(seq + rows, Shard(SEQ), "allgather_kv"))
        # Ulysses runs on whole sequences of some heads: a mask without a full heads dim goes whole
        heads = tuple(_mask_placement(q, m, HEADS) for m in ins[3:])
        opts.append(AxisOption(seq + heads, Shard(SEQ), "ulysses"))
    return opts
