"""Context-parallel attention's time on one device: its share of the attention kernel plus the
transfers its strategy makes over the context axis of n devices (`strategies/attention.py`,
executed by `runtime/attention.py`).

With c_f, c_b the kernel's forward and backward seconds on this device's share of the work (equal
on every device: the chunks are in the causal-balanced order), q_b the bytes of this device's
queries (as many as of its output) and kv_b of its keys and values together:

    ring          forward   c_f/n + (n-1) max(c_f/n, hop(kv_b))          each hop is issued before the
                  backward  c_b/n + (n-1) max(c_b/n, hop(2 kv_b))        block in hand is computed, so it
                            + hop(kv_b)                                  overlaps; in the backward K/V and
                                                                         their gradients travel together,
                                                                         and a last hop brings dK/dV home
    allgather_kv  forward   c_f + all_gather(n kv_b)                     not overlapped (Llama 3 gathers
                  backward  c_b + all_gather(n kv_b) + reduce_scatter(n kv_b)   first; small next to
                                                                         attention at long context)
    ulysses       forward   c_f + all_to_all(n (2 q_b + kv_b))           q, k, v to heads, output back
                  backward  c_b + all_to_all(n (2 q_b + kv_b))           their gradients, mirrored

hop(b) = p2p_time(b, link): each device sends b bytes to its neighbour while receiving as many.
Ring and allgather_kv under a causal (or any) mask also move their chunks into the balanced order
and back: an all-to-all of q, k, v and the output in each pass, all_to_all(n (2 q_b + kv_b)).
"""
from __future__ import annotations

from typing import NamedTuple

from .comm import AnyLink, all_gather_time, all_to_all_time, p2p_time, reduce_scatter_time
from .symbolic import smax


class ContextComm(NamedTuple):
    """What pricing a context-parallel attention strategy needs beyond its kernel."""
    label: str           # "ring" | "allgather_kv" | "ulysses"
    n: int               # devices on the context axis
    link: AnyLink        # that axis's link
    q_b: float           # bytes of this device's queries
    kv_b: float          # bytes of this device's keys and values
    balanced: bool       # chunks exchanged into the causal-balanced order and back


def context_times(fwd: float, bwd: float, c: ContextComm) -> tuple[float, float]:
    """(forward, backward) seconds of the kernel's share (fwd, bwd) run under strategy c."""
    n, moved = c.n, c.n * (2 * c.q_b + c.kv_b)
    if c.label == "ulysses":
        return fwd + all_to_all_time(moved, n, c.link), bwd + all_to_all_time(moved, n, c.link)
    balance = all_to_all_time(moved, n, c.link) if c.balanced else 0.0
    if c.label == "allgather_kv":
        gather = all_gather_time(n * c.kv_b, n, c.link)
        return (fwd + gather + balance,
                bwd + gather + reduce_scatter_time(n * c.kv_b, n, c.link) + balance)
    hop = p2p_time(c.kv_b, c.link)
    return (fwd / n + (n - 1) * smax(fwd / n, hop) + balance,
            bwd / n + (n - 1) * smax(bwd / n, p2p_time(2 * c.kv_b, c.link)) + hop + balance)
