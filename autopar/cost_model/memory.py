"""Per-device memory: training state of parameters, and activations by liveness.

Parameter state, bytes per element of a stored shard (`state_bytes`, the one definition the
planner and `estimate()` use), split into what always stays with the parameter (the parameter
and its gradient) and the optimizer's part (its moments and, in mixed precision, the fp32
master weight), which the offload family may move to the host:

* "same" precision (every copy in the parameter's dtype): AdamW keeps param, grad, exp_avg,
  exp_avg_sq = 4 copies, 16 bytes per fp32 parameter; SGD param + grad = 2 copies;
* "mixed" (16-bit parameter and gradient, fp32 master weight and fp32 moments):
  2 + 2 + 4 + 4 + 4 = 16 bytes for AdamW (the "16 bytes per parameter" of ZeRO, Rajbhandari et
  al. 2020, section 3.1, and of Megatron-LM's fp16 training); SGD 2 + 2 + 4 = 8.
  A 32-bit parameter has no finer copy to keep: under "mixed" it trains as under "same".
* "auto" (the default): as "mixed" (what bf16 training with FSDP's MixedPrecisionPolicy or
  Megatron does).
`runtime/optimizer.py` executes the same rule (`is_mixed`): a master weight exactly where it is priced.

Activations, on one timeline of the step: the forward runs ops 0 .. last-1 at positions 0 .. last-1,
`last` is the end of the forward, and the backward of op i runs at position 2*last - i (the last
op's backward first). Forward position t holds every tensor defined at or before t that is still
needed: by a later forward op, or by the backward (an input an op saves for its gradient).
Memory only rises at definitions and only falls at frees, so its local maxima sit just
before frees: those positions, plus the end of the forward (where every saved activation is
live at once), are the forward points a memory constraint must be checked at.

The backward of op i holds (a backward point, one per op that has a gradient):
* every saved tensor whose first saver has not run its backward yet (saver position <= i);
* the gradient of every tensor that spans op i in the forward (defined at or before i, last used
  at or after i): autograd holds a tensor's gradient from the backward of its last consumer to
  that of its producer, so these are exactly the gradients in flight, op i's own output and
  input gradients among them;
* the parameters' gradients made so far (`Problem` adds them: a parameter's gradient exists from
  the backward of its last consumer on), and the copies kept for backwards not run yet.
* the gradient buckets in flight (`buckets_in_flight_bytes`);
* the op's own backward temporaries, the largest of a step's: fused attention's fp32 accumulator
  and cross-entropy's gradient of its log-probabilities (`backward_temporary_bytes`), and each
  weight's gradient as the op makes it, before the gradient buckets take it
  (`weight_gradient_temporary_bytes`); the working buffers an executor declares for its backward
  (context-parallel attention's K/V blocks and their gradients, `cost_model/context.py`), added to
  the op's own.
A view's gradient is not counted apart from its base's; gradient reshards in the backward and
smaller backward temporaries (an element-wise op's) are not counted.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch.fx as fx

ADAMW_STATE_COPIES = 4     # param + grad + exp_avg + exp_avg_sq
SGD_STATE_COPIES = 2       # param + grad
OPTIMIZER_STATE_COPIES = {"adamw": ADAMW_STATE_COPIES, "adam": ADAMW_STATE_COPIES, "sgd": SGD_STATE_COPIES}


PRECISIONS = ("auto", "same", "mixed")

# Gradient buckets (runtime/grad_sync.py) hold memory beyond the gradients the backward has made:
# the open bucket of each kind (an all-reduce bucket's buffer is allocated whole at its first
# gradient; a reduce-scatter bucket holds its unreduced gradients until it launches) and the
# reduce-scatters launched and not yet waited, each holding its whole-size input
# (grad_sync.REDUCE_SCATTERS_IN_FLIGHT = 2). Three buckets' worth at the most.
BUCKETS_IN_FLIGHT = 3


def buckets_in_flight_bytes(bucketed_bytes: float, bucket_bytes: float) -> float:
    """Bytes the gradient buckets hold in the backward beyond the gradients made, at most:
    `BUCKETS_IN_FLIGHT` buckets of `bucket_bytes`, never more than the `bucketed_bytes` of
    gradients that can go into a bucket at all."""
    return min(float(bucketed_bytes), BUCKETS_IN_FLIGHT * float(bucket_bytes))


def is_mixed(param_itemsize: int, precision: str = "auto") -> bool:
    """Is a parameter of this size trained in mixed precision (an fp32 master weight and fp32
    moments)? 16-bit parameters under "mixed" or "auto"; never under "same", never a 32-bit one."""
    return precision != "same" and param_itemsize == 2


def state_bytes(param_itemsize: int, optimizer: str = "adamw", precision: str = "auto") -> tuple[float, float]:
    """(bytes per element kept with the parameter: itself and its gradient, bytes per element of
    optimizer state: moments and the fp32 master weight in mixed precision)."""
    if optimizer not in OPTIMIZER_STATE_COPIES:
        raise ValueError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZER_STATE_COPIES)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    copies = OPTIMIZER_STATE_COPIES[optimizer]
    if not is_mixed(param_itemsize, precision):
        return 2.0 * param_itemsize, float((copies - 2) * param_itemsize)
    return 2.0 * param_itemsize, 4.0 * (copies - 1)


def state_bytes_per_element(param_itemsize: int, optimizer: str = "adamw", precision: str = "auto") -> float:
    """Bytes of training state per parameter element (`state_bytes`' two parts together)."""
    kept, opt = state_bytes(param_itemsize, optimizer, precision)
    return kept + opt


# Fused attention's backward (FlashAttention-2, and torch's flash, memory-efficient and cuDNN kernels
# after it) accumulates dq in fp32 over the key blocks: 4 bytes per element of the local query, beside
# the dq, dk, dv it returns (gradients in flight). Its per-row softmax statistics are S/D of that: left out.
ATTENTION_BACKWARD_ACCUMULATOR_ITEMSIZE = 4
ATTENTION_OPS = frozenset({"aten.scaled_dot_product_attention"})
# Cross-entropy on the logits (`aten.cross_entropy_loss`, composite: log_softmax then nll_loss, the
# log-probabilities kept for the backward) makes the gradient of the log-probabilities (nll_loss's
# backward) before log_softmax's backward turns it into the logits' gradient: one more tensor of the
# logits' size in their dtype (the largest temporary of a language model's step: tokens x vocabulary).
LOGITS_GRADIENT_COPIES = {"aten.cross_entropy_loss": 1.0}


def backward_temporary_bytes(op: str, inputs: Sequence[tuple[float, int]]) -> float:
    """Bytes an op's backward holds beyond the gradients in flight (module docstring), from its
    inputs on this device as (local bytes, itemsize): fused attention's fp32 accumulator of the
    query's gradient; cross-entropy's gradient of the log-probabilities, the size of its input."""
    total = 0.0
    if op in ATTENTION_OPS and inputs:
        q_bytes, itemsize = inputs[0]
        total += q_bytes / itemsize * ATTENTION_BACKWARD_ACCUMULATOR_ITEMSIZE
    if op in LOGITS_GRADIENT_COPIES and inputs:
        total += LOGITS_GRADIENT_COPIES[op] * inputs[0][0]
    return total


def weight_gradient_temporary_bytes(grad_bytes: float, bucketed: bool) -> float:
    """Bytes a parameter's gradient holds, as the op that uses it makes it (in the layout the op takes
    the parameter in), before the gradient buckets take it (`runtime/grad_sync.py` copies it into a
    bucket, or a reduce-scatter's input, and drops it): the whole gradient of a weight stored sharded
    and gathered for use; a gradient nothing reduces goes to `.grad` as it is (no second copy)."""
    return float(grad_bytes) if bucketed else 0.0


@dataclass(frozen=True, slots=True)
class Liveness:
    owners: tuple[str, ...]                     # nodes that allocate their output (views excluded)
    points: tuple[int, ...]                     # how many owners live at each checked position
    point_names: tuple[str, ...]                # the node at which each point is taken
    positions: tuple[int, ...]                  # position of each point on the step's timeline
    defined: Mapping[str, int]                  # owner -> position of its op
    fwd_end: Mapping[str, int]                  # owner -> its last use in the forward
    end: Mapping[str, int]                      # owner -> where it is freed (`last` if saved)
    savers: Mapping[str, tuple[str, ...]]       # owner -> the ops that save it for their backward
    last: int                                   # the end of the forward (the backward's start)
    grads: tuple[int, ...] = ()                 # how many owners' gradients are in flight at each point
    op_pos: Mapping[str, int] | None = None     # every op -> its forward position
    # what sums over the points carry from one point to the next (`Timeline`): who leaves, who joins
    point_changes: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()
    grad_changes: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()

    def backward_of(self, i: int) -> int:
        """The timeline position of the backward of the op at forward position i."""
        return 2 * self.last - i

    def mirror(self, t: int) -> int:
        """The forward position whose backward is at t (t itself in the forward): what is kept for the
        backward of ops at forward positions <= mirror(t) is still alive at t."""
        return min(t, 2 * self.last - t)

    @property
    def step_end(self) -> int:
        """A position after every point: items freed up to it stay freed for the whole step."""
        return 2 * self.last + 1

    @property
    def end_index(self) -> int:
        """The index of the point at the end of the forward (-1: none)."""
        return self.positions.index(self.last) if self.last in self.positions else -1


def liveness(nodes: list[fx.Node], is_view: Mapping[str, bool], saves_inputs: Mapping[str, bool],
             tensor_nodes: Iterable[str], saved_frees: bool = True,
             needs_grad: Mapping[str, bool] | None = None) -> Liveness:
    """Live-set of activations at each candidate peak of the forward pass and, given `needs_grad`
    (node -> its output gets a gradient), of the backward (module docstring).

    nodes: topological order; is_view[n]: n's output aliases its first input; saves_inputs[n]:
    n keeps its inputs for the backward; tensor_nodes: call_function nodes producing tensors.
    With `saved_frees`, the points also include the last forward use of every saved tensor: where
    memory falls when a decision (recomputation, offload) stops saving it.
    """
    tensor_nodes = set(tensor_nodes)
    pos = {n.name: i for i, n in enumerate(nodes)}
    owner: dict[str, str] = {}
    for n in nodes:
        if n.name not in tensor_nodes:
            continue
        if is_view.get(n.name) and n.all_input_nodes and n.all_input_nodes[0].name in owner:
            owner[n.name] = owner[n.all_input_nodes[0].name]
        else:
            owner[n.name] = n.name
    fwd_end = {o: pos[o] for o in set(owner.values())}
    savers: dict[str, list[str]] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            o = owner.get(a.name)
            if o is None:
                continue
            fwd_end[o] = max(fwd_end[o], pos[n.name])
            if saves_inputs.get(n.name, True) and n.op == "call_function" and n.name not in savers.get(o, ()):
                savers.setdefault(o, []).append(n.name)
    last = len(nodes)
    end = {o: (last if o in savers else e) for o, e in fwd_end.items()}
    owners = tuple(sorted(end, key=lambda o: pos[o]))
    frees = {end[o] for o in owners if end[o] < last} | {fwd_end[o] for o in savers if fwd_end[o] < last and saved_frees}
    checks = sorted(frees) + [last]
    born = [pos[o] for o in owners]
    forward = Timeline(owners)
    taken = forward.sweep(born, [end[o] for o in owners], checks, skip_empty=True)
    names = [nodes[min(t, last - 1)].name for t in taken]
    where = list(taken)
    grads = Timeline(owners)
    grads.empty(len(taken))
    if needs_grad is not None:
        back = [i for i in range(last - 1, -1, -1)          # the backward, in the order it runs
                if nodes[i].name in tensor_nodes and needs_grad.get(nodes[i].name) and not is_view.get(nodes[i].name)]
        first_saver = {o: min(pos[s] for s in ss) for o, ss in savers.items()}
        saved_from = [first_saver.get(o, last) for o in owners]
        grad_until = [fwd_end[o] if needs_grad.get(o) else -1 for o in owners]   # -1: no gradient
        forward.sweep(saved_from, [last] * len(owners), back)
        grads.sweep(born, grad_until, back)
        names += [nodes[i].name for i in back]
        where += [2 * last - i for i in back]
    return Liveness(owners, tuple(forward.sizes), tuple(names), tuple(where), {o: pos[o] for o in owners}, fwd_end,
                    end, {o: tuple(v) for o, v in savers.items()}, last, tuple(grads.sizes), pos,
                    tuple(forward.changes), tuple(grads.changes))


class Timeline:
    """Points of a liveness timeline, each as its change from the point before: (the members of the
    point before that it lacks, in the owners' order; its members that the point before lacks, in the
    owners' order), and how many members it has. Every memory sum (`solver.memory_timeline`, the ILP's
    memory rows) is carried point to point through these changes, so the members of every point are
    never listed: a sweep over the owners' intervals [lo, hi] (sorted by the end met first) tracks the
    owners that joined or left since the last point, in time linear in the changes (listing every
    point's members was quadratic: 3 of Gemma-2-9B's 27 CPU seconds of planning)."""

    def __init__(self, owners: tuple[str, ...]):
        self.owners = owners
        self.sizes: list[int] = []
        self.changes: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
        self._kept: set[int] = set()        # the members of the last point

    def empty(self, k: int) -> None:
        """k points with no members (the timeline has none so far)."""
        assert not self._kept
        self.sizes += [0] * k
        self.changes += [((), ())] * k

    def sweep(self, lo: Sequence[int], hi: Sequence[int], times: Sequence[int], skip_empty: bool = False) -> list[int]:
        """A point per position t of `times` (increasing or decreasing; with `skip_empty` only where some
        owner o has lo[o] <= t <= hi[o]), its members those owners. Returns the positions taken."""
        n = len(self.owners)
        down = len(times) > 1 and times[0] > times[-1]
        first, then = (hi, lo) if down else (lo, hi)
        joins = sorted((j for j in range(n) if lo[j] <= hi[j]), key=first.__getitem__, reverse=down)   # never: empty
        leaves = sorted(range(n), key=then.__getitem__, reverse=down)
        mask, a, b, count, touched, fresh, taken = bytearray(n), 0, 0, 0, set(), True, []
        for t in times:
            while a < len(joins) and (first[joins[a]] >= t if down else first[joins[a]] <= t):
                j = joins[a]
                count += not mask[j]
                mask[j] = 1
                touched.add(j)
                a += 1
            while b < n and (then[leaves[b]] > t if down else then[leaves[b]] < t):
                j = leaves[b]
                count -= mask[j]
                mask[j] = 0
                touched.add(j)
                b += 1
            if skip_empty and not count:
                continue
            if fresh:       # the sweep's first point against the last point before it
                now = {j for j in range(n) if mask[j]}
                left, joined = self._kept - now, now - self._kept
                fresh = False
            else:
                left = {j for j in touched if not mask[j] and j in self._kept}
                joined = {j for j in touched if mask[j] and j not in self._kept}
            touched.clear()
            self._kept -= left
            self._kept |= joined
            self.changes.append((tuple(self.owners[j] for j in sorted(left)),
                                 tuple(self.owners[j] for j in sorted(joined))))
            self.sizes.append(count)
            taken.append(t)
        return taken
