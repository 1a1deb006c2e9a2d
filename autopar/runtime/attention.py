"""Context-parallel attention: how the "ring", "allgather_kv" and "ulysses" strategies of
scaled_dot_product_attention run (`strategies/attention.py` states them).

q, k, v (and the mask's rows) arrive split on the sequence over one mesh axis of n devices,
device i holding the i-th contiguous chunk; the output leaves the same way.

* ring, allgather_kv: queries stay where they are. Under a causal mask device i would do i+1 of
  n blocks of work, so the chunks are first exchanged (one all-to-all) so that device i holds
  half-chunks i and 2n-1-i of 2n: every device then has the same share of the causal triangle
  (the Llama 3 / torch context-parallel order); the output is exchanged back. K/V blocks then
  visit every device: "ring" passes its block to the next device n-1 times, each hop issued before
  the block in hand is computed, so transfer overlaps compute (functional collectives are
  asynchronous); "allgather_kv" gathers every block at once. Each block gives scores masked by
  the global positions of its queries and keys (and the user's mask, its columns for those keys),
  merged by online softmax (running max, sum and output), in fp32.
  The backward recomputes each block's probabilities from the saved log-sum-exp, as
  FlashAttention's backward does. In the ring each block's dK/dV travel with it and reach
  its owner after n hops; allgather_kv gathers K/V again and reduce-scatters dK/dV.
* ulysses: DTensor moves q, k, v from the sequence split to a heads split (an all-to-all),
  attention runs on whole sequences of n-th of the heads, and the output moves back; all through
  the differentiable `reshard`, so autograd does the mirrored all-to-alls.

Why not torch's ring attention (`torch.distributed.tensor.experimental.context_parallel`): in
torch 2.13 it runs each block through the CUDA flash / efficient / cuDNN kernels and passes the
same keyword arguments to every block, so it cannot take an explicit mask (Hugging Face models
captured by torch.export hand attention a materialised causal mask), and its load balancing is a
process-wide flag. We use its collectives (`funcol.permute_tensor`, the hop its all-to-all
rotater makes) and its order of chunks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..compat import funcol
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

    def positions(self, r: int, device) -> torch.Tensor:
        if not self.balanced:
            return torch.arange(r * self.local, (r + 1) * self.local, device=device)
        half = self.local // 2
        return torch.cat([torch.arange(c * half, (c + 1) * half, device=device) for c in self.held(r, True)])


def _ready(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited for."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _exchange(x: torch.Tensor, dim: int, split: _Split, to_balanced: bool) -> torch.Tensor:
    """Move x's half-chunks along `dim` between the contiguous and the balanced order (one all-to-all)."""
    src = lambda r: split.held(r, not to_balanced)   # noqa: E731
    dst = lambda r: split.held(r, to_balanced)       # noqa: E731
    xs = x.movedim(dim, 0)
    half = xs.shape[0] // 2
    mine = dict(zip(src(split.rank), xs.split(half)))
    send, in_splits, arrival, out_splits = [], [], [], []
    for r in range(split.n):
        cs = [c for c in dst(r) if c in mine]
        send += [mine[c] for c in cs]
        in_splits.append(len(cs) * half)
        cs = [c for c in dst(split.rank) if c in src(r)]
        arrival += cs
        out_splits.append(len(cs) * half)
    got = funcol.all_to_all_single(torch.cat(send).contiguous(), out_splits, in_splits, split.group)
    pieces = _ready(got).split(half)
    return torch.cat([pieces[arrival.index(c)] for c in dst(split.rank)]).movedim(0, dim).contiguous()


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, split, to_balanced):  # type: ignore[override]
        ctx.args = (dim, split, to_balanced)
        return _exchange(x, dim, split, to_balanced)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        dim, split, to_balanced = ctx.args
        return _exchange(grad.contiguous(), dim, split, not to_balanced), None, None, None


@dataclass(frozen=True)
class _Attn:
    split: _Split
    mode: str            # "ring" | "allgather_kv"
    is_causal: bool
    scale: float


def _block_scores(a: _Attn, q, k, mask, qpos, kpos):
    """fp32 scores of local queries against one K block, masked (-inf) where not attended."""
    s = torch.matmul(q, k.transpose(-2, -1)) * a.scale
    keep = qpos[:, None] >= kpos[None, :] if a.is_causal else None
    if mask is not None:
        cols = mask.index_select(-1, kpos)
        if cols.dtype == torch.bool:
            keep = cols if keep is None else keep & cols
        else:
            s = s + cols.float()
    return s if keep is None else s.masked_fill(~keep, float("-inf"))


def _heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """K/V heads repeated for grouped-query attention."""
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _unheads(g: torch.Tensor, groups: int) -> torch.Tensor:
    return g.unflatten(1, (-1, groups)).sum(2) if groups > 1 else g


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


def _pack(k, v):
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(kv, k_like):
    kv = _ready(kv).float()
    return kv[:k_like.numel()].view(k_like.shape), kv[k_like.numel():].view(k_like.shape)


class _ContextAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, a: _Attn):  # type: ignore[override]
        groups = q.shape[1] // k.shape[1]
        qf = q.float()
        qpos = a.split.positions(a.split.rank, q.device)
        run_max = torch.full((*q.shape[:-1], 1), float("-inf"), device=q.device)
        total = torch.zeros_like(run_max)
        acc = torch.zeros(q.shape, device=q.device)
        for origin, kv in _kv_blocks(a, _pack(k, v)):
            kpos = a.split.positions(origin, q.device)
            if a.is_causal and int(kpos.min()) > int(qpos.max()):
                continue          # wholly in the future of every local query
            kb, vb = _unpack(kv, k)
            s = _block_scores(a, qf, _heads(kb, groups), mask, qpos, kpos)
            new_max = torch.maximum(run_max, s.amax(-1, keepdim=True))
            shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            p = torch.exp(s - shift)
            rescale = torch.exp(run_max - shift)
            total = total * rescale + p.sum(-1, keepdim=True)
            acc = acc * rescale + torch.matmul(p, _heads(vb, groups))
            run_max = new_max
        out = acc / total
        lse = torch.where(torch.isinf(run_max), torch.zeros_like(run_max), run_max) + torch.log(total)
        ctx.a = a
        ctx.save_for_backward(q, k, v, mask, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        a: _Attn = ctx.a
        q, k, v, mask, out, lse = ctx.saved_tensors
        sp, groups = a.split, q.shape[1] // k.shape[1]
        qf, dof = q.float(), dout.float()
        qpos = sp.positions(sp.rank, q.device)
        delta = (dof * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qf)
        nxt = [(r + 1) % sp.n for r in range(sp.n)]
        gathered = []      # allgather_kv: dK/dV of every block, reduce-scattered at the end
        travelling = torch.zeros(2 * k.numel(), device=q.device)     # ring: dK/dV of the block in hand
        for origin, kv in _kv_blocks(a, _pack(k, v)):
            kpos = sp.positions(origin, q.device)
            dkv = torch.zeros(2 * k.numel(), device=q.device)
            if not (a.is_causal and int(kpos.min()) > int(qpos.max())):
                kb, vb = _unpack(kv, k)
                kh, vh = _heads(kb, groups), _heads(vb, groups)
                p = torch.exp(_block_scores(a, qf, kh, mask, qpos, kpos) - lse)
                ds = p * (torch.matmul(dof, vh.transpose(-2, -1)) - delta)
                dq += torch.matmul(ds, kh) * a.scale
                dk = _unheads(torch.matmul(ds.transpose(-2, -1), qf) * a.scale, groups)
                dv = _unheads(torch.matmul(p.transpose(-2, -1), dof), groups)
                dkv = torch.cat([dk.reshape(-1), dv.reshape(-1)])
            if a.mode == "allgather_kv":
                gathered.append(dkv)
            else:             # add ours, pass it on with the block; after n hops it is home
                travelling = funcol.permute_tensor(travelling + dkv, nxt, sp.group)
        if a.mode == "allgather_kv":
            travelling = funcol.reduce_scatter_single(torch.cat(gathered), "sum", 0, sp.group)
        dk, dv = _unpack(travelling, k)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def context_attention(args: dict, device_mesh, axis: int, mode: str) -> torch.Tensor:
    """Attention of local q, k, v (and mask rows) split on the sequence over mesh axis `axis`."""
    q, k, v, mask = args["query"], args["key"], args["value"], args["attn_mask"]
    n, local = device_mesh.shape[axis], q.shape[_SEQ]
    causal_like = bool(args["is_causal"]) or mask is not None
    split = _Split(device_mesh.get_group(axis), n, device_mesh.get_local_rank(axis), local,
                   balanced=causal_like and n > 1 and local % 2 == 0)
    scale = args["scale"] if args["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    rows_split = mask is not None and mask.shape[-2] == local and mask.shape[-2] > 1
    if split.balanced:
        q, k, v = (_Exchange.apply(t, _SEQ, split, True) for t in (q, k, v))
        if rows_split:
            mask = _Exchange.apply(mask, mask.ndim - 2, split, True)
    if mask is not None and not rows_split and mask.shape[-2] != 1:
        raise ValueError(f"attention mask rows {mask.shape[-2]} match neither the local queries ({local}) nor 1")
    out = _ContextAttention.apply(q, k, v, mask, _Attn(split, mode, bool(args["is_causal"]), float(scale)))
    return _Exchange.apply(out, _SEQ, split, False) if split.balanced else out


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
