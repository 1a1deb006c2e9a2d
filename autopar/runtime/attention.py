"""Context-parallel attention: how the "ring", "allgather_kv" and "ulysses" strategies of
scaled_dot_product_attention run (`strategies/attention.py` states them, `cost_model/context.py`
prices their time and memory).

q, k, v (and the mask's rows) arrive split on the sequence over one mesh axis of n devices,
device i holding the i-th contiguous chunk; the output leaves the same way.

* ring, allgather_kv: queries stay where they are. Under a causal mask device i would do i+1 of
  n blocks of work, so the chunks are first exchanged (one all-to-all per tensor) so that device i
  holds half-chunks i and 2n-1-i of 2n: every device then has the same share of the causal
  triangle (the Llama 3 / torch context-parallel order); the output is exchanged back. The
  exchange happens here, inside the op, so the rest of the plan (and rotary positions, applied
  before attention) sees the contiguous split; it costs an all-to-all of q, k, v and the output
  per pass, which the cost model prices. q, k, v leave the exchange packed in one flat tensor, so
  K/V are one buffer the ring passes on as they are. K/V blocks then visit every device: "ring"
  passes its block to the next device n-1 times, each hop issued before the block in hand is
  computed, so transfer overlaps compute (functional collectives are asynchronous); "allgather_kv"
  gathers every block at once. Which part of a block a device computes, and whether under the
  causal diagonal, follows from the ranks alone (`_block`: no tensor is read on the host). Each
  block runs through one fused attention kernel in the inputs' dtype that returns its
  log-sum-exp (`compat.attention_block`: CPU flash; CUDA flash, or efficient with a mask or in
  fp32); blocks merge online into an fp32 output and log-sum-exp, the only fp32 buffers.
  The backward runs the fused backward kernel per block with the merged output and log-sum-exp,
  as FlashAttention's backward does (the kernels' own autograd would keep every block's K/V for
  the backward: O(n) blocks; this keeps one or two). In the ring each block's dK/dV (fp32) travel
  with it and reach their owner after n hops: a device computes its block's gradients before it
  waits for that block's dK/dV from its neighbour, so each hop overlaps a block's kernels (torch's
  ring backward's order), and while it computes, the hop in flight holds two fp32 dK/dV buffers,
  the one sent and the one arriving; allgather_kv gathers K/V again and reduce-scatters
  dK/dV. A user's boolean mask becomes an additive mask per block (its columns for the block's
  keys); a row it masks wholly within a block gets log-sum-exp -inf (the kernels return 0).
* ulysses: DTensor moves q, k, v from the sequence split to a heads split (an all-to-all),
  attention runs on whole sequences of n-th of the heads, and the output moves back; all through
  the differentiable `reshard`, so autograd does the mirrored all-to-alls.

What comes from torch's context parallelism (`torch.distributed.tensor.experimental`,
`_templated_ring_attention`): the kernels per block (the same private ops), its order of chunks
and its split of each block under the causal mask (`_block`), its collectives (`funcol`,
`permute_tensor` for a hop). Why not call it: it takes no explicit mask (Hugging Face models
captured by torch.export hand attention a materialised causal mask), expects the sequence already
in the balanced order (its load balancer permutes the whole model's inputs, which would change
every other op's layout in the plan), sets load balancing as a process-wide flag, runs only
through DTensor's dispatcher on CUDA kernels, and its merge allocates a whole new output per
block (`_partial_update` concatenates); here blocks merge in place.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..compat import attention_block, attention_block_backward, funcol
from ..strategies.attention import context_axis, sdpa_args, ulysses_layouts
from .ops import LocalOp, _FromLocal
from .reshard import reshard

_SEQ = 2


@dataclass(frozen=True)
class _Split:
    """Where the sequence lies: n devices of a process group, this one `rank`, `local` tokens each,
    in contiguous chunks or in the balanced causal order (half-chunks i and 2n-1-i)."""
    group: object
    n: int
    rank: int
    local: int
    balanced: bool

    def held(self, r: int, balanced: bool) -> list[int]:
        """The half-chunks (of 2n) device r holds, in local order."""
        return [r, 2 * self.n - 1 - r] if balanced else [2 * r, 2 * r + 1]


def _ready(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited for."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _exchange(xs: list[torch.Tensor], dim: int, split: _Split, to_balanced: bool) -> torch.Tensor:
    """The tensors xs (of one dtype) with their half-chunks along `dim` moved between the contiguous
    and the balanced order, packed one after another into one flat tensor: one all-to-all per
    tensor, so that only one tensor's send and receive buffers exist at a time. Each half-chunk is
    copied into the send buffer and from the received one into its place."""
    src = lambda r: split.held(r, not to_balanced)   # noqa: E731
    dst = lambda r: split.held(r, to_balanced)       # noqa: E731
    mine = {c: i for i, c in enumerate(src(split.rank))}
    outgoing = [c for r in range(split.n) for c in dst(r) if c in mine]
    arrival = [c for r in range(split.n) for c in dst(split.rank) if c in src(r)]
    in_splits = [sum(1 for c in dst(r) if c in mine) for r in range(split.n)]
    out_splits = [sum(1 for c in dst(split.rank) if c in src(r)) for r in range(split.n)]
    out = torch.empty(sum(x.numel() for x in xs), dtype=xs[0].dtype, device=xs[0].device)
    for x, whole in zip(xs, _unpacked(out, [x.shape for x in xs])):
        half = x.shape[dim] // 2
        piece = x.narrow(dim, 0, half).shape
        send = torch.empty(len(outgoing) * piece.numel(), dtype=x.dtype, device=x.device)
        for c, part in zip(outgoing, send.split(piece.numel())):
            part.view(piece).copy_(x.narrow(dim, mine[c] * half, half))
        got = funcol.all_to_all_single(send, [k * piece.numel() for k in out_splits],
                                       [k * piece.numel() for k in in_splits], split.group)
        del send       # held by the collective until it completes, no longer
        for c, part in zip(arrival, _ready(got).split(piece.numel())):
            whole.narrow(dim, dst(split.rank).index(c) * half, half).copy_(part.view(piece))
    return out


def _unpacked(flat: torch.Tensor, shapes) -> list[torch.Tensor]:
    """Views of the tensors of these shapes packed one after another in a flat tensor."""
    sizes = [math.prod(s) for s in shapes]
    return [t.view(s) for t, s in zip(flat[:sum(sizes)].split(sizes), shapes)]


class _Exchange(torch.autograd.Function):
    """`_exchange` as an autograd op: its backward moves the packed gradients back the other way."""

    @staticmethod
    def forward(ctx, dim, split, to_balanced, *xs):  # type: ignore[override]
        ctx.args, ctx.shapes = (dim, split, to_balanced), [x.shape for x in xs]
        return _exchange(list(xs), dim, split, to_balanced)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        dim, split, to_balanced = ctx.args
        back = _exchange(_unpacked(grad.contiguous(), ctx.shapes), dim, split, not to_balanced)
        return (None, None, None, *_unpacked(back, ctx.shapes))


@dataclass(frozen=True)
class _Attn:
    split: _Split
    mode: str            # "ring" | "allgather_kv"
    is_causal: bool
    scale: float
    shapes: tuple        # of this device's q, k, v (packed one after another into one flat tensor)


class _Block(NamedTuple):
    """The part of a K/V block one device computes with: its queries from `q_from` on, the block's
    first `k_len` keys, under the causal diagonal or not."""
    q_from: int
    k_len: int
    causal: bool


def _block(a: _Attn, origin: int) -> _Block | None:
    """What this device computes against the K/V block of device `origin` (None: nothing), decided
    from the ranks alone. Under a causal mask with the balanced order (this device holds half-chunks
    r < 2n-1-r, the origin o and 2n-1-o): its own block is the causal diagonal; a block from o < r
    sees its first half-chunk before both of ours and its second after both (its first half, all
    queries); from o > r both of its half-chunks lie between ours (all its keys, our second half).
    Each is half of a square of 2 half-chunks: every device does equal work (torch's
    `_templated_ring_attention` splits blocks the same way). Without balance (an odd chunk) a block
    from an earlier device is whole, from a later one skipped."""
    sp, local = a.split, a.split.local
    if not a.is_causal:
        return _Block(0, local, False)
    if origin == sp.rank:
        return _Block(0, local, True)
    if not sp.balanced:
        return _Block(0, local, False) if origin < sp.rank else None
    half = local // 2
    return _Block(0, half, False) if origin < sp.rank else _Block(half, local, False)


def _mask_block(a: _Attn, mask, origin: int, blk: _Block, dtype):
    """(additive mask in `dtype`, rows it masks wholly) of the user's boolean mask for this device's
    queries in blk against the block's keys: its columns at those keys' global positions."""
    if mask is None:
        return None, None
    sp, local = a.split, a.split.local
    width = local // 2 if sp.balanced else local
    starts = [c * width for c in sp.held(origin, True)] if sp.balanced else [origin * local]
    cols = torch.cat([mask.narrow(-1, s, width) for s in starts], -1).narrow(-1, 0, blk.k_len)
    if cols.shape[-2] > 1:
        cols = cols.narrow(-2, blk.q_from, local - blk.q_from)
    bias = torch.zeros(cols.shape, dtype=dtype, device=cols.device).masked_fill_(~cols, float("-inf"))
    return bias, ~cols.any(-1)


def _kv_blocks(a: _Attn, kv: torch.Tensor):
    """(origin device, its packed K/V): the ring's hops (each issued before the block in hand is
    used) or one all-gather."""
    sp = a.split
    if a.mode == "allgather_kv":
        whole = funcol.all_gather_single(kv, 0, sp.group)
        for t, block in enumerate(_ready(whole).chunk(sp.n)):
            yield t, block
        return
    nxt = [(r + 1) % sp.n for r in range(sp.n)]
    for t in range(sp.n):
        following = funcol.permute_tensor(kv, nxt, sp.group) if t < sp.n - 1 else None
        yield (sp.rank - t) % sp.n, kv
        kv = following


def _unpack(a: _Attn, kv, k_len: int):
    """The first k_len keys and values of a packed K/V block (views)."""
    return [t.narrow(_SEQ, 0, k_len) for t in _unpacked(_ready(kv), a.shapes[1:])]


def _merge(acc, lse, out, out_lse) -> None:
    """Fold one block's (output, log-sum-exp) into the running fp32 (acc, lse), in place (online
    softmax: each weighted by its share of the merged sum). A row no key reached yet has lse -inf."""
    new = torch.logaddexp(lse, out_lse)
    ref = new.masked_fill(new == float("-inf"), 0.0)
    acc.mul_(torch.exp(lse - ref).unsqueeze(-1)).addcmul_(out, torch.exp(out_lse - ref).unsqueeze(-1))
    lse.copy_(new)


def _rows(t: torch.Tensor, blk: _Block) -> torch.Tensor:
    return t.narrow(_SEQ, blk.q_from, t.shape[_SEQ] - blk.q_from) if blk.q_from else t


def _attend(a: _Attn, q, kv, mask, origin: int, blk: _Block, acc, lse) -> tuple:
    """Merge one K/V block's attention into (acc, lse); the kernel's state for the backward.
    (A function of its own so that the block's temporaries are freed before the next block.)"""
    kb, vb = _unpack(a, kv, blk.k_len)
    bias, dead = _mask_block(a, mask, origin, blk, q.dtype)
    out, out_lse, state = attention_block(_rows(q, blk), kb, vb, bias, blk.causal, a.scale)
    if dead is not None:  # the fused kernel gives a row with no key a log-sum-exp of 0
        out_lse = out_lse.masked_fill(dead, float("-inf"))
    _merge(_rows(acc, blk), _rows(lse, blk), out, out_lse)
    return state


def _attend_backward(a: _Attn, state, saved, kv, mask, origin: int, blk: _Block, dq) -> tuple:
    """Add one K/V block's share of the query gradient into dq; its (dK, dV) for the block's first
    blk.k_len keys (`_add_kv_grads` adds them where they accumulate); saved: this device's (q,
    attention output, its log-sum-exp, the output's gradient)."""
    q, out, lse, dout = saved
    kb, vb = _unpack(a, kv, blk.k_len)
    bias, _ = _mask_block(a, mask, origin, blk, q.dtype)
    gq, gk, gv = attention_block_backward(_rows(dout, blk), _rows(q, blk), kb, vb, _rows(out, blk),
                                          _rows(lse, blk).contiguous(), bias, blk.causal, a.scale, state)
    _rows(dq, blk).add_(gq)
    return gk, gv


def _add_kv_grads(a: _Attn, dkv, grads: tuple | None) -> None:
    """Add a block's (dK, dV) (None: it computed nothing) into its packed fp32 dK/dV, dkv."""
    if grads is not None:
        for acc, g in zip(_unpacked(dkv, a.shapes[1:]), grads):
            acc.narrow(_SEQ, 0, g.shape[_SEQ]).add_(g)


class _ContextAttention(torch.autograd.Function):
    """Blockwise attention of q, k, v packed in one flat tensor over the K/V blocks of the context
    axis, each block through one fused kernel in the inputs' dtype (`compat.attention_block`),
    merged by log-sum-exp in fp32; only the output, its log-sum-exp and one or two K/V blocks (and
    their gradients) exist at a time. The packed K/V are what the ring passes on, as they are."""

    @staticmethod
    def forward(ctx, qkv, mask, a: _Attn):  # type: ignore[override]
        q = _unpacked(qkv, a.shapes[:1])[0]
        acc = torch.zeros((*q.shape[:-1], a.shapes[2][-1]), dtype=torch.float32, device=q.device)   # v's head dim
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        state = None
        for origin, kv in _kv_blocks(a, qkv[q.numel():]):
            blk = _block(a, origin)
            if blk is not None:   # None: wholly in the future of every local query
                st = _attend(a, q, kv, mask, origin, blk, acc, lse)
                state = st if state is None else state
        out = acc.to(q.dtype)
        ctx.a, ctx.state = a, state
        ctx.save_for_backward(qkv, mask, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        a: _Attn = ctx.a
        qkv, mask, out, lse = ctx.saved_tensors
        sp, dout = a.split, dout.contiguous()
        q = _unpacked(qkv, a.shapes[:1])[0]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        nxt = [(r + 1) % sp.n for r in range(sp.n)]
        # dK/dV in fp32: of every block (allgather_kv, reduce-scattered at the end), or of the block in
        # hand, travelling with it (ring: after n hops it is home; a buffer sent on is not kept)
        kv_numel = qkv.numel() - q.numel()
        grads = torch.zeros((sp.n, kv_numel), device=q.device) if a.mode == "allgather_kv" else None
        travelling = torch.zeros(kv_numel, device=q.device) if grads is None else None
        for origin, kv in _kv_blocks(a, qkv[q.numel():]):
            blk = _block(a, origin)
            g = None if blk is None else _attend_backward(a, ctx.state, (q, out, lse, dout), kv, mask, origin,
                                                          blk, dq)
            # ring: the block's dK/dV so far, sent on by the previous device after its own block, is waited
            # for only now, so that its hop overlaps this block's kernels (as torch's ring backward does)
            dkv = _ready(travelling) if grads is None else grads[origin]
            _add_kv_grads(a, dkv, g)
            if grads is None:
                travelling = funcol.permute_tensor(dkv, nxt, sp.group)
                del dkv
        if grads is not None:
            travelling = funcol.reduce_scatter_single(grads.view(-1), "sum", 0, sp.group)
        return torch.cat([dq.view(-1).to(qkv.dtype), _ready(travelling).to(qkv.dtype)]), None, None


def context_attention(args: dict, device_mesh, axis: int, mode: str) -> torch.Tensor:
    """Attention of local q, k, v (and mask rows) split on the sequence over mesh axis `axis`."""
    q, k, v, mask = args["query"], args["key"], args["value"], args["attn_mask"]
    n, local = device_mesh.shape[axis], q.shape[_SEQ]
    causal_like = bool(args["is_causal"]) or mask is not None
    split = _Split(device_mesh.get_group(axis), n, device_mesh.get_local_rank(axis), local,
                   balanced=causal_like and n > 1 and local % 2 == 0)
    scale = args["scale"] if args["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    rows_split = mask is not None and mask.shape[-2] == local and mask.shape[-2] > 1
    if mask is not None and not rows_split and mask.shape[-2] != 1:
        raise ValueError(f"attention mask rows {mask.shape[-2]} match neither the local queries ({local}) nor 1")
    a = _Attn(split, mode, bool(args["is_causal"]), float(scale), (q.shape, k.shape, v.shape))
    if not split.balanced:
        return _ContextAttention.apply(torch.cat([t.reshape(-1) for t in (q, k, v)]), mask, a)
    if rows_split:
        mask = _Exchange.apply(mask.ndim - 2, split, True, mask).view(mask.shape)
    out = _ContextAttention.apply(_Exchange.apply(_SEQ, split, True, q, k, v), mask, a)
    return _Exchange.apply(_SEQ, split, False, out).view(out.shape)


class RingAttentionOp(LocalOp):
    """`out = self.op_x(q, k, v, ...)` with a "ring" or "allgather_kv" axis (module docstring)."""

    def __init__(self, target, inputs, output, mesh, global_shape=None, labels=()):
        super().__init__(target, inputs, output, mesh, global_shape)
        self.axis = context_axis(labels)
        self.mode = labels[self.axis]

    def forward(self, *args, **kwargs):
        args, kwargs = self._localize(args, kwargs)
        out = context_attention(sdpa_args(*args, **kwargs), self.mesh, self.axis, self.mode)
        return _FromLocal.apply(out, self.mesh, self.output, self.out_grad_layout)

    def extra_repr(self) -> str:
        return f"{self.mode} over mesh axis {self.axis}, " + super().extra_repr()


class UlyssesAttentionOp(torch.nn.Module):
    """`out = self.op_x(q, k, v, ...)` with a "ulysses" axis: q, k, v resharded to heads, attention
    on local shards (`LocalOp`), the output resharded back to the sequence split."""

    def __init__(self, target, inputs, output, mesh, global_shape=None, labels=()):
        super().__init__()
        inner_in, inner_out = ulysses_layouts(inputs, output, labels)
        self.heads = inner_in[:3]
        self.output = tuple(output)
        self.inner = LocalOp(target, inner_in, inner_out, mesh, global_shape)

    def forward(self, *args, **kwargs):
        args = [reshard(a, L) for a, L in zip(args[:3], self.heads)] + list(args[3:])
        return reshard(self.inner(*args, **kwargs), self.output)


def context_executor(target, inputs, output, mesh, global_shape, labels):
    """The executor of an attention strategy with a context-parallel axis."""
    cls = UlyssesAttentionOp if labels[context_axis(labels)] == "ulysses" else RingAttentionOp
    return cls(target, inputs, output, mesh, global_shape, labels)
