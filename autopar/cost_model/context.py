"""Context-parallel attention's time on one device: its share of the attention kernel plus the
transfers its strategy makes over the context axis of n devices (`strategies/attention.py`,
executed by `runtime/attention.py`).

With c_f, c_b the kernel's forward and backward seconds on this device's share of the work (equal
on every device: the chunks are in the causal-balanced order), q_b the bytes of this device's
queries (as many as of its output) and kv_b of its keys and values together:

    ring          forward   c_f/n + (n-1) max(c_f/n, hop(kv_b))          each hop is issued before the
                  backward  c_b/n + (n-1) max(c_b/n, hop(kv_b + g_b))    block in hand is computed, so it
                            + hop(g_b)                                   overlaps; in the backward K/V and
                                                                         their gradients travel together
                                                                         (a block's dK/dV are waited for
                                                                         after its kernels), and a last hop
                                                                         brings dK/dV home
    allgather_kv  forward   c_f + all_gather(n kv_b)                     not overlapped (Llama 3 gathers
                  backward  c_b + all_gather(n kv_b) + reduce_scatter(n kv_b)   first; small next to
                                                                         attention at long context)
    ulysses       forward   c_f + all_to_all(n (2 q_b + kv_b))           q, k, v to heads, output back
                  backward  c_b + all_to_all(n (2 q_b + kv_b))           their gradients, mirrored

Ring and allgather_kv run c_f, c_b times `padding` (values narrower than the queries, as in
multi-head latent attention, are zero-padded to the queries' head dim for the fused kernel; the
padded copies of a block's values are not counted in its buffers).
hop(b) = p2p_time(b, link): each device sends b bytes to its neighbour while receiving as many.
dK/dV accumulate and travel in fp32 (g_b = kv_b * 4 / itemsize of them): the backward's hops carry
kv_b + g_b and the last g_b; allgather_kv reduce-scatters n g_b.
Ring and allgather_kv under a causal (or any) mask also move their chunks into the balanced order
and back: in each pass one all-to-all per tensor, of q, k, v and the output (or their gradients):
2 all_to_all(n q_b) + 2 all_to_all(n kv_b / 2).

Memory (per device, as `runtime/attention.py` allocates it; q_b also stands for the output's bytes):
kept for the backward beyond the op's inputs (whose exchanged copies replace them) and output, the
output's fp32 log-sum-exp (lse_b) and, in the balanced order, the output's copy in that order
(Ulysses: the heads-split output its inner attention keeps); and working buffers, largest in the
backward, while one block is differentiated:

    ring          dq in fp32 + dK/dV sent and arriving (2 g_b) + the next K/V block (kv_b) + the block's
                  gradients (q_b + kv_b)
    allgather_kv  dq in fp32 + every K/V block (n kv_b) and its gradients (n g_b) + the block's (q_b + kv_b)

(the forward's, an fp32 output, its block's output and the next K/V block, are fewer). The fused
kernel's own workspace (tiles per thread; on CPU measured at 2 q_b in the backward at 4,096 local
tokens) is not counted. Ulysses' working buffers are its reshards' (`runtime/reshard.py`), not counted.
"""
from __future__ import annotations

from typing import NamedTuple

from .comm import AnyLink, all_gather_time, all_to_all_time, p2p_time, reduce_scatter_time
from ..symbolic import smax

# the executor accumulates dq, dK/dV and the log-sum-exp in fp32, whatever the inputs' dtype
FP32_BYTES = 4


class ContextComm(NamedTuple):
    """What pricing a context-parallel attention strategy needs beyond its kernel."""
    label: str           # "ring" | "allgather_kv" | "ulysses"
    n: int               # devices on the context axis
    link: AnyLink        # that axis's link
    q_b: float           # bytes of this device's queries
    kv_b: float          # bytes of this device's keys and values
    balanced: bool       # chunks exchanged into the causal-balanced order and back
    fp32: float          # FP32_BYTES over the inputs' element size
    head_dim: int        # of the queries (and keys)
    value_dim: int       # of the values

    @property
    def padding(self) -> float:
        """The blockwise kernels' work over the op's: their fused kernels take one head dim, so values
        narrower than the queries (multi-head latent attention) are zero-padded to it
        (`compat.attention_block`): scores 2 S^2 d_q, output 2 S^2 max(d_q, d_v) FLOPs a head."""
        wide = max(self.head_dim, self.value_dim)
        return 2 * wide / (self.head_dim + self.value_dim)

    @property
    def grad_b(self):
        """Bytes of this device's dK/dV as they accumulate and travel (fp32)."""
        return self.kv_b * self.fp32

    @property
    def lse_b(self):
        """Bytes of the log-sum-exp (fp32) of this device's queries."""
        return self.q_b * (self.fp32 / self.head_dim)


def context_times(fwd: float, bwd: float, c: ContextComm) -> tuple[float, float]:
    """(forward, backward) seconds of the kernel's share (fwd, bwd) run under strategy c."""
    n = c.n
    if c.label == "ulysses":
        moved = n * (2 * c.q_b + c.kv_b)
        return fwd + all_to_all_time(moved, n, c.link), bwd + all_to_all_time(moved, n, c.link)
    fwd, bwd = fwd * c.padding, bwd * c.padding       # ring and allgather_kv: blocks through the fused kernel
    balance = (2 * all_to_all_time(n * c.q_b, n, c.link) + 2 * all_to_all_time(n * c.kv_b / 2, n, c.link)
               if c.balanced else 0.0)
    if c.label == "allgather_kv":
        gather = all_gather_time(n * c.kv_b, n, c.link)
        return (fwd + gather + balance,
                bwd + gather + reduce_scatter_time(n * c.grad_b, n, c.link) + balance)
    return (fwd / n + (n - 1) * smax(fwd / n, p2p_time(c.kv_b, c.link)) + balance,
            bwd / n + (n - 1) * smax(bwd / n, p2p_time(c.kv_b + c.grad_b, c.link)) + p2p_time(c.grad_b, c.link)
            + balance)


def context_saved_bytes(c: ContextComm) -> float:
    """Bytes strategy c keeps for the backward beyond the op's inputs and output (module docstring)."""
    return c.lse_b + (c.q_b if c.balanced or c.label == "ulysses" else 0.0)


def context_work_bytes(c: ContextComm) -> float:
    """Bytes of strategy c's working buffers at their largest, in the backward (module docstring)."""
    if c.label == "ulysses":
        return 0.0
    dq, block = c.q_b * c.fp32, c.q_b + c.kv_b
    if c.label == "allgather_kv":
        return dq + c.n * (c.kv_b + c.grad_b) + block
    return dq + 2 * c.grad_b + c.kv_b + block
