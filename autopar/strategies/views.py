"""Shape-only ops (views, transposes, splits, slices): a shard moves to wherever its dim goes.

They cost no compute, so every one of them is a *follower*: merged into its producer, its
layout implied by the producer's (see `strategy.py`).
"""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from .pointwise import broadcast_options
from .registry import AxisOption, register

aten = torch.ops.aten
R, P = Replicate(), Partial()


def view_dim_map(src: tuple[int, ...], dst: tuple[int, ...]) -> dict[int, int]:
    """Which dst dim a Shard of each src dim becomes under a reshape (only the leading dim of a
    merged or split group can carry a shard; size-1 dims carry none)."""
    return {group[0]: lead for group, lead, _ in view_groups(src, dst)}


def view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], int]]:
    """The reshape as groups: (src dims of size > 1, the dst dim leading the dims they become, and
    whether they become that one dim: a merge)."""
    groups, i, j = [], 0, 0
    while i < len(src) and j < len(dst):
        if src[i] == 1 and (dst[j] != 1):
            i += 1
            continue
        if dst[j] == 1 and src[i] != 1:
            j += 1
            continue
        gi, gj = [i], [j]
        ps, pd = src[i], dst[j]
        while ps != pd:
            if ps < pd:
                i += 1
                gi.append(i)
                ps *= src[i]
            else:
                j += 1
                gj.append(j)
                pd *= dst[j]
        if ps > 1:
            groups.append(([d for d in gi if src[d] > 1], gj[0], len([d for d in gj if dst[d] > 1]) == 1))
        i, j = i + 1, j + 1
    return groups


def _mapped(ins, outs, dmap, label="view", partial=True):
    opts = [AxisOption((Shard(s),), Shard(d), label) for s, d in dmap.items()]
    if partial:
        opts.append(AxisOption((P,), P, "partial"))
    return opts


def merge_admitted(labels, inputs, output, ins, outs, mesh_shape, fits) -> bool:
    """A "merge" axis splits an inner dim k of merged dims (the sequence of (B, S) -> B*S): each
    device's piece stays one contiguous block of the merged dim, as Shard of it says, when every
    dim merged before k is split to size 1 by axes earlier in the mesh and none after k is split."""
    for a, lab in enumerate(labels):
        if lab != "merge":
            continue
        k = inputs[0][a].dim
        group = next(g for g, _, _ in view_groups(ins[0].shape, outs[0].shape) if k in g)
        for j in group:
            axes = [b for b, p in enumerate(inputs[0]) if p == Shard(j)]
            if j > k and axes:
                return False
            if j < k and (ins[0].shape[j] != math.prod(mesh_shape[b] for b in axes) or any(b > a for b in axes)):
                return False
    return True


@register(aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten, family="view",
          saves_inputs=False, is_view=True, follower=True, admits=merge_admitted)
def view_rule(node, ins, outs):
    """A group's leading dim keeps its shard; so does an inner merged dim ("merge") if pieces stay contiguous.

    (Groups: `view_groups`; when the pieces are contiguous: `merge_admitted`.)"""
    groups = view_groups(ins[0].shape, outs[0].shape)
    merges = [AxisOption((Shard(k),), Shard(lead), "merge") for group, lead, merged in groups if merged
              for k in group[1:]]
    return _mapped(ins, outs, {g[0]: lead for g, lead, _ in groups}) + merges


@register(aten.transpose, aten.permute, aten.t, aten.unsqueeze, aten.squeeze, aten.expand,
          aten.contiguous, aten.alias, aten.detach,
          family="view", saves_inputs=False, is_view=True, follower=True)
# clone copies (a reshape of a non-contiguous tensor traces as clone + _unsafe_view): a new tensor,
# a kernel reading and writing it; its gradient passes straight through
@register(aten.clone, aten.lift_fresh_copy, family="copy", saves_inputs=False, follower=True)
def permute_rule(node, ins, outs):
    src, dst = ins[0], outs[0]
    target = node.target.overloadpacket
    n = src.ndim
    if target in (aten.transpose, aten.t):
        if n < 2:
            dmap = {i: i for i in range(n)}
        else:
            a, b = (node.args[1], node.args[2]) if target is aten.transpose else (0, 1)
            a, b = a % n, b % n
            perm = list(range(n))
            perm[a], perm[b] = perm[b], perm[a]
            dmap = {perm[i]: i for i in range(n)}
    elif target is aten.permute:
        perm = [p % n for p in node.args[1]]
        dmap = {perm[i]: i for i in range(n)}
    elif target is aten.expand:
        off = dst.ndim - n
        dmap = {i: i + off for i in range(n) if src.shape[i] == dst.shape[i + off] and src.shape[i] > 1}
    else:  # unsqueeze/squeeze/contiguous/clone/alias/detach: sizes > 1 keep their order
        dmap = view_dim_map(src.shape, dst.shape)
    return _mapped(ins, outs, {s: d for s, d in dmap.items() if src.shape[s] > 1},
                   partial=target is not aten.expand)


def _dim_arg(node, index, default, ndim):
    d = node.args[index] if len(node.args) > index else node.kwargs.get("dim", default)
    return d % ndim


@register(aten.split, aten.split_with_sizes, aten.chunk, aten.unbind, family="view", saves_inputs=False,
          is_view=True, follower=True)
def split_rule(node, ins, outs):
    x = ins[0]
    dim = _dim_arg(node, 1 if node.target.overloadpacket is aten.unbind else 2, 0, x.ndim)
    if node.target.overloadpacket is aten.unbind:
        return [AxisOption((Shard(d),), Shard(d if d < dim else d - 1), "split") for d in range(x.ndim) if d != dim]
    return [AxisOption((Shard(d),), Shard(d), "split") for d in range(x.ndim) if d != dim] + [
        AxisOption((P,), P, "partial")]


@register(aten.slice, aten.narrow, aten.select, family="view", saves_inputs=False, is_view=True, follower=True)
def slice_rule(node, ins, outs):
    x = ins[0]
    dim = _dim_arg(node, 1, 0, x.ndim)
    if node.target.overloadpacket is aten.select:
        return [AxisOption((Shard(d),), Shard(d if d < dim else d - 1), "slice") for d in range(x.ndim) if d != dim]
    sliced_whole = outs[0].shape[dim] == x.shape[dim]
    return [AxisOption((Shard(d),), Shard(d), "slice") for d in range(x.ndim)
            if d != dim or sliced_whole] + [AxisOption((P,), P, "partial")]


@register(aten.cat, aten.stack, family="view", saves_inputs=False)
def cat_rule(node, ins, outs):
    out = outs[0]
    dim = _dim_arg(node, 1, 0, out.ndim)
    stack = node.target.overloadpacket is aten.stack
    opts = []
    for d in range(ins[0].ndim):
        od = d + 1 if stack and d >= dim else d
        if not stack and d == dim:
            continue
        opts.append(AxisOption(tuple(Shard(d) for _ in ins), Shard(od), "cat"))
    return opts


# getitem on a multi-output op: the element has its producer's layout.
import operator  # noqa: E402


@register(operator.getitem, family="view", saves_inputs=False, is_view=True, follower=True)
def getitem_rule(node, ins, outs):
    out = outs[0]
    return [AxisOption((Shard(d),), Shard(d), "item") for d in range(out.ndim)] + [AxisOption((P,), P, "partial")]


@register(aten.broadcast_tensors, family="view", saves_inputs=False, is_view=True)
def broadcast_tensors_rule(node, ins, outs):
    """Every input expanded to the common shape: a dim an input carries splits with the outputs."""
    return broadcast_options(ins, outs[0], label="split")
