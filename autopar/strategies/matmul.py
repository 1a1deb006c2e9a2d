"""Matrix products: batch, column, row (Partial) options; combined over axes they give 2-D/3-D TP.

All products are read as out[b..., m, n] = sum_k a[b..., m, k] * w[b..., k, n]:
sharding a batch dim or m or n splits the output; sharding k leaves each device a partial
sum (Partial), reduced later by an all-reduce or reduce-scatter on the consuming edge.
"""
from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard

from .registry import AxisOption, register
import torch

aten = torch.ops.aten
R, P = Replicate(), Partial()


@register(aten.linear, family="matmul")
def linear_rule(node, ins, outs):
    """x[..., K] @ w[N, K]^T + b[N]."""
    x, has_bias = ins[0], len(ins) == 3
    opts = []
    for d in range(x.ndim - 1):                      # batch-like dims of x (batch, sequence)
        opts.append(AxisOption((Shard(d), R) + ((R,) if has_bias else ()), Shard(d), "batch" if d == 0 else f"dim{d}"))
    last = x.ndim - 1
    opts.append(AxisOption((R, Shard(0)) + ((Shard(0),) if has_bias else ()), Shard(last), "column"))
    opts.append(AxisOption((Shard(last), Shard(1)) + ((P,) if has_bias else ()), P, "row"))
    return opts


def _bmm_options(a_nd: int, b_nd: int, out_nd: int, a_shape, b_shape, out_shape) -> list[AxisOption]:
    """a[..., M, K] @ b[..., K, N] with broadcast batch dims (matmul, bmm, mm)."""
    opts = []
    nb = out_nd - 2
    for i in range(nb):                               # batch dims, right-aligned
        ai, bi = i - (out_nd - a_nd), i - (out_nd - b_nd)
        pa = Shard(ai) if ai >= 0 and a_shape[ai] == out_shape[i] else R
        pb = Shard(bi) if bi >= 0 and b_shape[bi] == out_shape[i] else R
        if pa == R and pb == R:
            continue
        opts.append(AxisOption((pa, pb), Shard(i), f"batch{i}"))
    opts.append(AxisOption((Shard(a_nd - 2), R), Shard(out_nd - 2), "rows"))
    opts.append(AxisOption((R, Shard(b_nd - 1)), Shard(out_nd - 1), "column"))
    opts.append(AxisOption((Shard(a_nd - 1), Shard(b_nd - 2)), P, "contract"))
    return opts


@register(aten.mm, aten.bmm, family="matmul")
def mm_rule(node, ins, outs):
    a, b = ins
    return _bmm_options(a.ndim, b.ndim, outs[0].ndim, a.shape, b.shape, outs[0].shape)


@register(aten.matmul, family="matmul")
def matmul_rule(node, ins, outs):
    a, b = ins
    if a.ndim < 2 or b.ndim < 2:      # vector products: leave to the replicate option
        return []
    return _bmm_options(a.ndim, b.ndim, outs[0].ndim, a.shape, b.shape, outs[0].shape)


@register(aten.addmm, family="matmul")
def addmm_rule(node, ins, outs):
    """bias + a[M, K] @ b[K, N]; a 1-D bias broadcasts over rows."""
    bias, a, b = ins
    out = []
    for o in _bmm_options(2, 2, 2, a.shape, b.shape, outs[0].shape):
        if o.output == P:
            pb = P
        elif isinstance(o.output, Shard) and bias.ndim == 2 and bias.shape[o.output.dim] == outs[0].shape[o.output.dim]:
            pb = o.output
        elif isinstance(o.output, Shard) and o.output.dim == 1 and bias.ndim == 1 and bias.shape[0] > 1:
            pb = Shard(0)
        else:
            pb = R
        out.append(AxisOption((pb,) + o.inputs, o.output, o.label))
    return out
