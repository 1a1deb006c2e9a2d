"""Expert parallelism at run time: token-slots travel to their experts and back by all-to-all.

`autopar::moe_experts` under the `expert_parallel` option (strategies/moe.py) holds this device's
tokens and its block of experts. Each token-slot (a token and one of its top-k experts) is sent to
the device that holds its expert, over every mesh axis that splits both (one hop per axis, in mesh
order: the slot's coordinate on that axis is its expert's block digit there), run through the local
experts, and sent back the way it came; the router weights are applied where the token lives.

The splits are the routing's real counts (uneven, exchanged first as a small all-to-all of counts):
dropless, every slot is computed. Forward and backward are exact: `torch.distributed.nn.functional.
all_to_all_single` carries the gradient back by the reverse all-to-all, and the arithmetic per slot
is the reference's (`passes.lowering.moe_reference`: the same products, the weight applied then
cast, the k slots summed), so the result is one process's up to the matmuls' blocking.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

from ..strategies.moe import expert_axes, exchange_axes


def _hop(rows: torch.Tensor, expert: torch.Tensor, dest: torch.Tensor, n: int, group):
    """Send each row (and its expert id) to device `dest` of the axis's group; return the received
    rows and ids and what the way back needs (the permutation and the counts)."""
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=n)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_l, recv_l = send.tolist(), recv.tolist()
    rows = all_to_all_single(rows.new_empty((sum(recv_l), rows.shape[1])), rows.index_select(0, order),
                             recv_l, send_l, group=group)
    ids = expert.new_empty(sum(recv_l))
    dist.all_to_all_single(ids, expert.index_select(0, order), recv_l, send_l, group=group)
    return rows, ids, (order, send_l, recv_l, group)


def _hop_back(rows: torch.Tensor, back) -> torch.Tensor:
    order, send_l, recv_l, group = back
    rows = all_to_all_single(rows.new_empty((sum(send_l), rows.shape[1])), rows, send_l, recv_l, group=group)
    return rows.index_select(0, torch.argsort(order))      # back into the order the slots left in


def expert_parallel(op, args, kwargs):
    """Run `autopar::moe_experts` for the LocalOp `op` (arguments already local, first_expert set)."""
    axes = exchange_axes(op.inputs)
    if not axes:
        return op.target(*args, **kwargs)
    hidden, top_k_index, top_k_weights, gate_up, down, act, first_expert = args
    T, k = top_k_index.shape
    e_local = gate_up.shape[0]
    split = expert_axes(op.inputs)
    rows = hidden.unsqueeze(1).expand(T, k, hidden.shape[-1]).reshape(T * k, -1)
    expert = top_k_index.reshape(-1)
    backs = []
    for a in axes:
        n = op.mesh.shape[a]
        stride = math.prod(op.mesh.shape[b] for b in split if b > a)
        dest = torch.div(expert, e_local * stride, rounding_mode="floor") % n
        rows, expert, back = _hop(rows, expert, dest, n, op.mesh.get_group(a))
        backs.append(back)
    ones = rows.new_ones((rows.shape[0], 1))
    out = op.target(rows, expert.view(-1, 1), ones, gate_up, down, act, first_expert)
    for back in reversed(backs):
        out = _hop_back(out, back)
    return (out.view(T, k, -1) * top_k_weights.unsqueeze(-1)).to(hidden.dtype).sum(dim=1)
