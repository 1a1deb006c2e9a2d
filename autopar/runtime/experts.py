"""Expert parallelism at run time: token-slots travel to their experts and back by all-to-all.

`autopar::moe_experts` under the `expert_parallel` option (strategies/moe.py) holds this device's
tokens and its block of experts. Each token-slot (a token and one of its top-k experts) is sent to
the device that holds its expert, over every mesh axis that splits both (one hop per axis, in mesh
order: the slot's coordinate on that axis is its expert's block digit there), run through the local
experts, and sent back the way it came; the router weights are applied where the token lives.

The splits are the routing's real counts (uneven, exchanged first as a small all-to-all of counts:
the hop's one host sync). The received slots are sorted by expert on the device and run through
two grouped GEMMs (`passes.lowering.experts_in_order`, `torch.nn.functional.grouped_mm`), and
autograd differentiates them: nothing runs twice. Forward and backward are exact:
`torch.distributed.nn.functional.all_to_all_single` carries the gradient back by the reverse
all-to-all, and the arithmetic per slot is one process's (`passes.lowering.moe_grouped`: the same
products, the weight applied then cast, added into the token), so the result is one process's up to
the order the k slots are added in and the matmuls' blocking.

Dropless by default: every slot is computed. With the plan option `moe_capacity_factor` (GShard,
Switch Transformer) expert e takes at most C = ceil(factor * T * k / E) slots of the layer's T tokens
(the global batch of one forward call, every device's tokens together; under a pipeline, of one
microbatch; k choices each; E experts). Slots queue
choice-major: every token's first choice in token order, then every second choice, and so on (as
GShard ranks top-1 choices before top-2 ones). A slot past its expert's capacity is dropped under
every strategy: its expert index becomes -1, it is sent and computed nowhere, it adds nothing to its
token's output (its combine weight gets no gradient) and the layer's residual carries the token.
The rule reads the global token set only, so one process (`moe_capacity`) drops exactly the slots a
plan drops on any mesh: a device finds its place in each expert's queue from every device's counts
per (choice, expert), gathered over the mesh axes that split the tokens.

Tensor parallelism inside the experts (`expert_tp`, strategies/moe.py): device r of the axis holds
rows [rc, (r+1)c) of every local expert's fused gate_up (c = 2I/n), i.e. half-blocks 2r and 2r+1 of
I/n rows, where half-block h is gate rows of block h (h < n) or up rows of block h - n. It sends
half-block h to device h mod n and receives gate block r and up block r: its shard in Megatron's
pairing, one differentiable all-to-all (its backward returns the weights' gradient the reverse way).
The experts then run as on one device on that pairing and down's rows [rI/n, (r+1)I/n); the outputs
are partial sums over the axis, reduced where the plan says (the op's output layout is P there).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

from ..compat import all_gather_single
from ..passes.lowering import add_into_tokens, experts_as_one_op, experts_in_order, inverse_permutation, moe_grouped
from ..strategies.moe import check_capacity_factor, exchange_axes, expert_axes, tensor_axis, token_axes

__all__ = ["expert_capacity", "routing_counts", "drop_over_capacity", "moe_capacity", "run_experts"]


def expert_capacity(tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Token-slots one expert takes of `tokens` tokens with k choices each (module docstring)."""
    return math.ceil(factor * tokens * k / num_experts)


def routing_counts(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[k, E]: how many of these tokens chose each expert as their j-th choice (dropped slots, -1, not counted)."""
    k = top_k_index.shape[1]
    key = top_k_index + num_experts * torch.arange(k, device=top_k_index.device)
    return torch.bincount(key[top_k_index >= 0], minlength=k * num_experts).view(k, num_experts)


def drop_over_capacity(top_k_index: torch.Tensor, num_experts: int, factor: float, counts: torch.Tensor,
                       block: int = 0) -> torch.Tensor:
    """`top_k_index` [T, k] with the slots past their expert's capacity set to -1. `counts` [D, k, E]:
    `routing_counts` of the D blocks of the global token set in token order; these tokens are block
    `block` (one process: counts of these tokens alone, block 0). The capacity stays on the device
    (`expert_capacity`'s arithmetic in float64): no host sync."""
    T, k = top_k_index.shape
    cap = torch.ceil(counts[:, 0].sum().double() * factor * k / num_experts)
    total = counts.sum(0)
    ahead = (total.cumsum(0) - total + counts[:block].sum(0)).reshape(-1)   # queued before, per (choice, expert)
    key = (top_k_index + num_experts * torch.arange(k, device=top_k_index.device)).reshape(-1)
    own = counts[block].reshape(-1)
    order = torch.argsort(key, stable=True)         # per (choice, expert), these tokens in token order
    rank = torch.empty_like(key)
    rank[order] = torch.arange(key.numel(), device=key.device) - (own.cumsum(0) - own)[key[order]]
    return torch.where((ahead[key] + rank).view(T, k) < cap, top_k_index, -1)


def _capped(op, top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """This device's routing under the capacity rule: every token block's counts gathered over the
    axes that split tokens, innermost first, so blocks stand in mixed radix of those coordinates in
    mesh order (as DTensor chunks a dim over several axes)."""
    counts = routing_counts(top_k_index, num_experts)
    gathered, block, coord = counts.unsqueeze(0), 0, op.mesh.get_coordinate()
    for a in reversed(token_axes(op.inputs)):
        n = op.mesh.shape[a]
        out = gathered.new_empty((n * gathered.shape[0], *counts.shape))
        all_gather_single(out, gathered.contiguous(), group=op.mesh.get_group(a))
        block += coord[a] * gathered.shape[0]
        gathered = out
    return drop_over_capacity(top_k_index, num_experts, op.capacity_factor, gathered, block)


@contextlib.contextmanager
def moe_capacity(model: torch.nn.Module, factor: float):
    """One process as a plan with `moe_capacity_factor=factor` runs: inside, each Hugging Face experts
    module of `model` drops the token-slots over capacity (module docstring). Yields a dict
    {experts module path: token-slots dropped so far}."""
    check_capacity_factor(factor)
    names = {m: n for n, m in model.named_modules()}
    dropped: dict[str, int] = {}

    def route(top_k_index, num_experts, module):
        kept = drop_over_capacity(top_k_index, num_experts, factor, routing_counts(top_k_index, num_experts)[None])
        dropped[names[module]] = dropped.get(names[module], 0) + int((kept < 0).sum())
        return kept
    with experts_as_one_op(model, route, run=moe_grouped):
        yield dropped


def _paired(op, gate_up: torch.Tensor, axis: int) -> torch.Tensor:
    """This device's gate_up shard over the expert_tp `axis`, traded into gate and up rows of one block."""
    n, r = op.mesh.shape[axis], op.mesh.get_coordinate()[axis]
    half = gate_up.shape[1] // 2
    send = [0] * n
    for h in (2 * r, 2 * r + 1):
        send[h % n] += half
    mine = gate_up.transpose(0, 1).split(half)              # [half, E_local, H] each
    out = torch.cat([mine[0], mine[1]] if (2 * r) % n < (2 * r + 1) % n else [mine[1], mine[0]])
    recv = [0] * n
    for src in (r // 2, (n + r) // 2):                   # gate block r, then up block r (a later source)
        recv[src] += half
    got = all_to_all_single(out.new_empty(out.shape), out.contiguous(), recv, send,
                            group=op.mesh.get_group(axis))
    return got.transpose(0, 1)


def _hop(src: torch.Tensor, take: torch.Tensor | None, expert: torch.Tensor, dest: torch.Tensor, n: int, group):
    """Send rows to device `dest` of the axis's group (dest n: dropped, sent nowhere): row `take[s]`
    of src for slot s (take None: row s). Return the received rows and ids and what the way back
    needs (the slots sent, in the order sent, and the counts). The counts are the hop's one host sync."""
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=n + 1)[:n]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    counts = torch.cat([send, recv]).tolist()
    send_l, recv_l = counts[:n], counts[n:]
    order = order[:sum(send_l)]
    rows = src.index_select(0, order if take is None else take.index_select(0, order))
    rows = all_to_all_single(rows.new_empty((sum(recv_l), rows.shape[1])), rows, recv_l, send_l, group=group)
    ids = expert.new_empty(sum(recv_l))
    dist.all_to_all_single(ids, expert.index_select(0, order), recv_l, send_l, group=group)
    return rows, ids, (order, send_l, recv_l, group)


def _hop_back(rows: torch.Tensor, back, unsort: bool) -> torch.Tensor:
    """Rows back to the devices they came from, in the order they were sent (`unsort`: in the order
    the slots stood before the hop sorted them, every slot sent)."""
    order, send_l, recv_l, group = back
    rows = all_to_all_single(rows.new_empty((sum(send_l), rows.shape[1])), rows, send_l, recv_l, group=group)
    return rows.index_select(0, inverse_permutation(order)) if unsort else rows


def run_experts(op, args, kwargs):
    """Run `autopar::moe_experts` for the LocalOp `op` (arguments already local, first_expert set):
    the capacity's drops if the plan has one, then the grouped experts, with the dispatch over the
    exchange axes if any."""
    hidden, top_k_index, top_k_weights, gate_up, down, act, first_expert = args
    split = expert_axes(op.inputs)
    e_local = gate_up.shape[0]
    if (tp := tensor_axis(op.inputs)) is not None:
        gate_up = _paired(op, gate_up, tp)
    if op.capacity_factor is not None:
        top_k_index = _capped(op, top_k_index, e_local * math.prod(op.mesh.shape[a] for a in split))
    axes = exchange_axes(op.inputs)
    if not axes:
        return moe_grouped(hidden, top_k_index, top_k_weights, gate_up, down, act, first_expert,
                           every_slot_local=not split and op.capacity_factor is None)
    T, k = top_k_index.shape
    expert = top_k_index.reshape(-1)
    token = torch.div(torch.arange(T * k, device=expert.device), k, rounding_mode="floor")

    def digit(ids, a):          # the mesh coordinate on axis a of the device holding expert `ids`
        stride = math.prod(op.mesh.shape[b] for b in split if b > a)
        return torch.div(ids, e_local * stride, rounding_mode="floor") % op.mesh.shape[a]
    # sent nowhere: a dropped slot (-1), and one whose expert another device holds on an axis splitting
    # experts alone (there the tokens are whole, and that device runs the slot)
    sent = expert >= 0
    for a in split:
        if a not in axes:
            sent &= digit(expert, a) == op.mesh.get_coordinate()[a]
    rows, take, backs = hidden, token, []
    for i, a in enumerate(axes):
        n = op.mesh.shape[a]
        dest = digit(expert, a) if i else torch.where(sent, digit(expert, a), n)
        rows, expert, back = _hop(rows, take, expert, dest, n, op.mesh.get_group(a))
        take = None
        backs.append(back)
    out = experts_in_order(rows, expert - first_expert, gate_up, down, act)
    for i, back in reversed(list(enumerate(backs))):
        out = _hop_back(out, back, unsort=i > 0)
    slots = backs[0][0]         # the slots sent, in the order the first hop sent them: out's rows
    out = out * top_k_weights.reshape(-1).index_select(0, slots).unsqueeze(-1)
    return add_into_tokens(hidden, token.index_select(0, slots), out)
