"""Indexing, scans, sorting, padding, scatters and `new_*` factories.

These mostly move integer data (position ids, masks, labels, routing) but also gather
activations (`x[idx]`). An op may be split along a dim its indices do not address: every
device gathers, scans or sorts its slice exactly as the whole would. Splitting the indices
themselves is exact when the source is whole (each output element reads one source element).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from .registry import AxisOption, register

aten = torch.ops.aten
R, P = Replicate(), Partial()


def _dim(node, index: int, default: int, ndim: int, name: str = "dim") -> int:
    d = node.args[index] if len(node.args) > index else node.kwargs.get(name, default)
    return d % ndim if ndim else 0


def _other_dims(ins, outs, dim: int, label: str, keep_dim: bool = True) -> list[AxisOption]:
    """Split any dim but `dim`, every tensor the same way (scans, sorts: independent rows)."""
    x = ins[0]
    opts = []
    for d in range(x.ndim):
        if d == dim:
            continue
        od = d if keep_dim or d < dim else d - 1
        placements = tuple(Shard(d) if t.ndim == x.ndim and t.shape[d] == x.shape[d] else R for t in ins)
        if placements[0] == Shard(d):
            opts.append(AxisOption(placements, Shard(od), label))
    return opts


@register(aten.cumsum, aten.cumprod, aten.logcumsumexp, family="scan")
def scan_rule(node, ins, outs):
    """A running sum along `dim`: rows along the other dims are independent."""
    return _other_dims(ins, outs, _dim(node, 1, 0, ins[0].ndim), "split")


@register(aten.topk, aten.sort, aten.argsort, family="sort", saves_inputs=False)
def sort_rule(node, ins, outs):
    """Top-k / sort along `dim` (default last): values and indices split like the other dims."""
    packet = node.target.overloadpacket
    x = ins[0]
    if x.ndim == 0:
        return []
    index = 2 if packet is aten.topk else 1
    return _other_dims(ins, outs, _dim(node, index, -1, x.ndim), "split")


@register(aten.argmax, aten.argmin, family="reduction", saves_inputs=False)
def argmax_rule(node, ins, outs):
    x = ins[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dim is None or x.ndim == 0:
        return []
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return _other_dims(ins, outs, dim % x.ndim, "split", keep_dim=bool(keep))


@register(aten.diff, family="scan")
def diff_rule(node, ins, outs):
    """x[..., 1:] - x[..., :-1] along `dim` (with prepend/append): the other dims split freely."""
    x = ins[0]
    return _other_dims(ins, outs, _dim(node, 2, -1, x.ndim), "split")


@register(aten.histc, family="reduction", saves_inputs=False)
def histc_rule(node, ins, outs):
    """Counts over all elements: each device counts its slice, the counts are a partial sum."""
    return [AxisOption((Shard(d),), P, "partial") for d in range(ins[0].ndim)]


@register(aten.pad, aten.constant_pad_nd, family="pad")
def pad_rule(node, ins, outs):
    """Pads the last len(pad)//2 dims; dims not padded split freely."""
    x = ins[0]
    pad = list(node.args[1])
    mode = node.args[2] if len(node.args) > 2 and node.target.overloadpacket is aten.pad else "constant"
    padded = {x.ndim - 1 - i: (pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)}
    opts = [AxisOption((Shard(d),), Shard(d), "split") for d in range(x.ndim)
            if padded.get(d, (0, 0)) == (0, 0)]
    if mode == "constant" and not _pad_value(node):
        opts.append(AxisOption((P,), P, "partial"))   # zero padding is linear
    return opts


def _pad_value(node):
    if node.target.overloadpacket is aten.constant_pad_nd:
        return node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    return node.args[3] if len(node.args) > 3 else (node.kwargs.get("value") or 0)


@register(aten.gather, family="indexing")
def gather_rule(node, ins, outs):
    """out[i][j] = x[i][index[i][j]] (dim 1): split a dim both share, or the index along `dim`."""
    x, index = ins[0], ins[1]
    dim = node.args[1] % x.ndim
    opts = [AxisOption((Shard(d), Shard(d)), Shard(d), "split") for d in range(x.ndim)
            if d != dim and x.shape[d] == index.shape[d]]
    opts.append(AxisOption((R, Shard(dim)), Shard(dim), "index"))
    return opts


@register(aten.scatter, family="indexing")
def scatter_rule(node, ins, outs):
    """out = x; out[i][index[i][j]] = src[i][j] (dim 1): split a dim x, index and src share whole."""
    x = ins[0]
    dim = node.args[1] % x.ndim
    return [AxisOption((Shard(d),) * len(ins), Shard(d), "split") for d in range(x.ndim)
            if d != dim and all(t.shape[d] == x.shape[d] for t in ins)]


def _index_layout(node):
    """(positions of the tensor indices, whether they are adjacent, where their broadcast block
    sits in the result): adjacent indices keep their place, scattered ones put the block first."""
    pos = [i for i, t in enumerate(node.args[1]) if t is not None]
    adjacent = bool(pos) and pos == list(range(pos[0], pos[-1] + 1))
    return pos, adjacent, (pos[0] if adjacent else 0)


def _free_dim_position(k: int, adjacent: bool, at: int, nb: int) -> int:
    """Result dim of the k-th dim of x that no index addresses."""
    return k if adjacent and k < at else k + nb


@register(aten.index, family="indexing")
def index_rule(node, ins, outs):
    """x[i0, i1, ...] with integer index tensors (advanced indexing)."""
    x, idx = ins[0], ins[1:]
    out = outs[0]
    if not idx or any(t.dtype == torch.bool for t in idx):
        return []              # a boolean mask gives a data-dependent shape
    pos, adjacent, at = _index_layout(node)
    nb = out.ndim - (x.ndim - len(pos))            # dims of the broadcast index block
    free = [d for d in range(x.ndim) if d not in pos]
    opts = [AxisOption((Shard(d),) + (R,) * len(idx), Shard(_free_dim_position(k, adjacent, at, nb)), "split")
            for k, d in enumerate(free)]
    for j in range(nb):                            # a dim of the index block, x whole
        placements = []
        for t in idx:
            kk = j - (nb - t.ndim)
            placements.append(Shard(kk) if kk >= 0 and t.shape[kk] == out.shape[at + j] else R)
        if any(isinstance(p, Shard) for p in placements):
            opts.append(AxisOption((R,) + tuple(placements), Shard(at + j), "index"))
    return opts


@register(aten.index_put, family="indexing")
def index_put_rule(node, ins, outs):
    """out = x; out[indices] = values (or +=): split a dim no index addresses; values follow."""
    x, rest = ins[0], ins[1:]
    pos, adjacent, at = _index_layout(node)
    idx, values = rest[:len(pos)], rest[len(pos)] if len(rest) > len(pos) else None
    if any(t.dtype == torch.bool for t in idx):
        return []
    nb = max((t.ndim for t in idx), default=0)
    res_ndim = x.ndim - len(pos) + nb              # ndim of x[indices], which values broadcast to
    opts = []
    for k, d in enumerate(dd for dd in range(x.ndim) if dd not in pos):
        placements = [Shard(d)] + [R] * len(idx)
        if values is not None:
            vd = _free_dim_position(k, adjacent, at, nb) - (res_ndim - values.ndim)
            placements.append(Shard(vd) if vd >= 0 and values.shape[vd] == x.shape[d] else R)
        opts.append(AxisOption(tuple(placements), Shard(d), "split"))
    return opts


@register(aten.slice_scatter, family="indexing")
def slice_scatter_rule(node, ins, outs):
    """x with x[..., start:end, ...] = src along `dim`: the other dims split, src alike."""
    x = ins[0]
    dim = _dim(node, 2, 0, x.ndim)
    return [AxisOption((Shard(d), Shard(d)), Shard(d), "split") for d in range(x.ndim) if d != dim]


@register(aten.select_scatter, family="indexing")
def select_scatter_rule(node, ins, outs):
    """x with x.select(dim, i) = src: src lacks `dim`."""
    x = ins[0]
    dim = _dim(node, 2, 0, x.ndim)
    return [AxisOption((Shard(d), Shard(d if d < dim else d - 1)), Shard(d), "split") for d in range(x.ndim)
            if d != dim]


@register(aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full, family="factory", saves_inputs=False)
def new_factory_rule(node, ins, outs):
    """A new whole tensor; the input only lends dtype and device, so it may arrive in any layout."""
    x = ins[0]
    return [AxisOption((Shard(d),), R, "whole") for d in range(x.ndim)] + [AxisOption((P,), R, "whole")]
