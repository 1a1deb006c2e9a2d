"""Convolutions, pooling and BatchNorm statistics (vision models).

A convolution is a matmul over channels slid over space, so it has the options of one: split
the batch, the output channels (a column split: weight rows and bias follow), or the input
channels (a row split: each device sums over its channels, a partial sum). Splitting space
would need halos; it is not offered. Pooling is independent per sample and channel.
BatchNorm reaches the planner lowered (`passes/lowering.py`): `autopar::batch_stat_mean` is
its mean over batch and space, whose batch-split option (a partial average, all-reduced
before use) is SyncBatchNorm.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ..passes import lowering  # noqa: F401  (defines the autopar:: ops)
from .registry import AxisOption, register

aten = torch.ops.aten
R, P = Replicate(), Partial()

# (index of `groups`, index of `transposed` or None) in each op's arguments
_CONV_ARGS = {aten.conv1d: (6, None), aten.conv2d: (6, None), aten.conv3d: (6, None), aten.convolution: (8, 6)}


@register(*_CONV_ARGS, family="matmul")
def conv_rule(node, ins, outs):
    """x[N, C, *space] conv w[O, C/groups, *kernel] (+ b[O]) -> [N, O, *space']."""
    x, w = ins[0], ins[1]
    has_bias = len(ins) > 2
    g_at, t_at = _CONV_ARGS[node.target.overloadpacket]
    groups = node.args[g_at] if len(node.args) > g_at else node.kwargs.get("groups", 1)
    transposed = t_at is not None and len(node.args) > t_at and node.args[t_at]
    batched = x.ndim == w.ndim
    ch = 1 if batched else 0
    bias = lambda p: (p,) if has_bias else ()  # noqa: E731
    opts = []
    if batched:
        opts.append(AxisOption((Shard(0), R) + bias(R), Shard(0), "batch"))
    if groups == 1 and not transposed:
        opts.append(AxisOption((R, Shard(0)) + bias(Shard(0)), Shard(ch), "out-channels"))
        opts.append(AxisOption((Shard(ch), Shard(1)) + bias(P), P, "in-channels"))
    return opts


_POOLS = {aten.max_pool1d: 1, aten.max_pool2d: 2, aten.max_pool3d: 3, aten.max_pool2d_with_indices: 2,
          aten.avg_pool1d: 1, aten.avg_pool2d: 2, aten.avg_pool3d: 3, aten.adaptive_avg_pool1d: 1,
          aten.adaptive_avg_pool2d: 2, aten._adaptive_avg_pool2d: 2, aten.adaptive_avg_pool3d: 3,
          aten.adaptive_max_pool2d: 2}
_LINEAR_POOLS = {aten.avg_pool1d, aten.avg_pool2d, aten.avg_pool3d, aten.adaptive_avg_pool1d,
                 aten.adaptive_avg_pool2d, aten._adaptive_avg_pool2d, aten.adaptive_avg_pool3d}


@register(*_POOLS, family="pool")
def pool_rule(node, ins, outs):
    """Pooling over the trailing spatial dims: batch and channel dims split freely."""
    x = ins[0]
    packet = node.target.overloadpacket
    opts = [AxisOption((Shard(d),), Shard(d), "batch" if d == 0 and x.ndim > _POOLS[packet] + 1 else "channels")
            for d in range(x.ndim - _POOLS[packet])]
    if packet in _LINEAR_POOLS:
        opts.append(AxisOption((P,), P, "partial"))
    return opts


@register(torch.ops.autopar.batch_stat_mean, family="norm", saves_inputs=False)
def batch_stat_rule(node, ins, outs):
    """Mean over the batch (and spatial) dims, kept as size-1 dims. Split a reduced dim: each
    device's mean of its samples is a partial average (all-reduced before use: SyncBatchNorm);
    split a kept dim (channels): the statistics are split alike."""
    x = ins[0]
    dims = {d % x.ndim for d in node.args[1]}
    return [AxisOption((Shard(d),), Partial("avg") if d in dims else Shard(d), "sync-stats" if d in dims else "split")
            for d in range(x.ndim)]
