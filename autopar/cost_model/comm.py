"""Collective and resharding costs over the axes of an N-D mesh (alpha-beta; ring, tree, hierarchical).

A collective over one mesh axis of n devices, with `nbytes` the FULL buffer on that axis
(gathered / unreduced size; each device holds nbytes/n of it when sharded), on a Link of
one-direction bandwidth B and per-step latency alpha, with the ring algorithm:

    all_reduce       2(n-1)/n   * nbytes / B  +  2(n-1) alpha    (reduce-scatter then all-gather)
    all_gather       (n-1)/n    * nbytes / B  +   (n-1) alpha
    reduce_scatter   (n-1)/n    * nbytes / B  +   (n-1) alpha
    all_to_all       (n-1)/n**2 * nbytes / B  +   (n-1) alpha    (each device keeps 1/n of its
                                                                   nbytes/n local buffer, sends the rest)

The first factor is what each device sends (`collective_bytes_on_wire`). Every cost is 0 for n == 1.
A backend whose reduce_scatter moves its bytes slower than the ring's multiplies its bytes term by
the link's `reduce_scatter_factor`, measured by `autopar calibrate` on the reduce-scatter the runtime
issues (on gloo an all-to-all of the chunks and a local sum, runtime/direct_reshard.py: gloo's own
all-reduces the whole input, about an all_reduce's time).

Tree all-reduce (NCCL's double binary tree, pipelined: a reduce up the tree then a broadcast
down, each moving the whole buffer through the slowest link once):

    all_reduce (tree)    2 * nbytes / B  +  2 ceil(log2 n) alpha

It loses to the ring on bandwidth (2 vs 2(n-1)/n) and wins on latency; `algorithm="auto"` takes
the faster, as NCCL's tuner does. Trees exist only for all-reduce (as in NCCL); the other
collectives always use rings.

Hierarchical (`profiles.HierarchicalLink`: k devices of the axis in each of m = n/k nodes; each
of a node's k devices drives its own NIC, on 1/k of the data):

    all_reduce       reduce_scatter(nbytes, k, intra) + all_reduce(nbytes/k, m, inter) + all_gather(nbytes, k, intra)
    all_gather       all_gather(nbytes/k, m, inter) + all_gather(nbytes, k, intra)          (reduce_scatter mirrored)
    all_to_all       (k-1) nbytes/n**2 / B_intra + (n-k) nbytes/n**2 / B_inter + (k-1) alpha_intra + (m-1) alpha_inter

Point-to-point and broadcast (pipelined chain; a tree has the same bandwidth term):

    p2p              nbytes / B + alpha
    broadcast        nbytes / B + (n-1) alpha   (ring)   or   nbytes / B + ceil(log2 n) alpha   (tree)

Expert parallelism (`expert_exchange_times`): a MoE layer whose tokens and experts are split over
an axis sends each token-slot to its expert's device and back, two all-to-alls of the device's
routed rows R = tokens x top_k x hidden x itemsize (pairwise exchange: n-1 steps, each device sends
(n-1)/n of R), after one all-to-all of the n split counts (latency only). The splits follow the
routing, so the exchange ends when the busiest device does: its bandwidth term is `imbalance`
(`DeviceProfile.moe_load_imbalance`) times the mean, or the capacity factor where a plan sets a
lower one (`moe_routed_load`: slots past capacity are dropped, never sent). The backward runs the two
all-to-alls reversed. Tensor parallelism inside the experts (`expert_tp_exchange_times`) trades the
device's fused gate/up shard with its peers once per step and direction: one all-to-all of the shard.

Vocab-split cross-entropy and log_softmax (`row_reduce_times`): logits split on the vocabulary over an
axis all-reduce a few fp32 statistics per row (the maximum, the sum-exp, ...; how many bytes per row
is the op's rule's fact: `strategies.vocab.ROW_STATISTICS`), each all-reduce one launch.

Gradient synchronisation is bucketed (`bucketed_time`): the bandwidth term of all buckets plus
one latency term per bucket, as DDP's 25 MiB buckets or Megatron's one contiguous buffer run it.
As DDP, the first bucket of each kind is small (`first_bucket_bytes`: 1 MiB, or the bucket size if
less), so that its reduction starts early in the backward; `bucket_count` counts the buckets.
`bucketed_reduction` says which parameter gradients the runtime reduces in buckets
(runtime/grad_sync.py): those go to a flat bucket of their kind (collective, group size, link); a
gradient's own share of the price is its transfer (`transfer_time`, the bandwidth term) less the share
`profile.grad_sync_overlap` that the backward hides (measured by `autopar calibrate`), each bucket adds
one latency and launch per step (`bucket_launch_time`), and the last bucket of each kind, launched when
the backward ends, is exposed whole (`final_bucket_time` adds back what the overlap took off it).

Resharding between layouts (`reshard_cost`) is priced step by step as the runtime moves the tensor
(`redistribute_steps`: DTensor's greedy redistribute, which `runtime/direct_reshard.py` issues step by
step as c10d collectives), each collective on the local
tensor as it is at that step. Where two axes split one dim, an outer axis's change first gathers
the inner one whole: (S(0), S(0)) -> (R, S(0)) is two all-gathers, not one.
`tests/test_reshard_pricing.py` checks the priced collectives against those the runtime issues.

Each collective of a reshard also pays the local copies torch makes around it
(`local_copy_bytes`, at the profile's memory bandwidth, read + write; torch 2.13's functional
collectives, which DTensor's redistribute issues; `runtime/direct_reshard.py` makes the same): an all-reduce clones its input
(the functional all_reduce is out of place; the runtime's own clones too); an all-gather on a dim
other than 0 gets the chunks stacked on dim 0 and concatenates them on that dim (a copy of the
gathered tensor, `_maybe_view_chunk_cat`) unless every dim before it is 1 long; a reduce-scatter on
a dim other than 0 first concatenates its input's chunks on dim 0 (`_chunk_or_narrow_cat`).

A program output made whole from a partial sum over one axis (`async_output_axis`: a mean loss, its
division by the global count taken on each rank's partial sum) is all-reduced asynchronously and
waited at the caller's first use of it, after the backward in a training step: priced at its launch.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache, lru_cache
from typing import Literal

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from .profiles import DDP_FIRST_BUCKET_BYTES, HierarchicalLink, Link
from ..symbolic import ceil_div, is_symbolic, smin, to_float

__all__ = ["Collective", "Algorithm", "collective_bytes_on_wire", "collective_time", "all_reduce_time",
           "all_gather_time", "reduce_scatter_time", "all_to_all_time", "broadcast_time", "p2p_time",
           "latency_steps", "bucketed_time", "bucket_count", "first_bucket_bytes", "bucketed_reduction", "GradBucket", "transfer_time",
           "flat_gather_axis", "regather_seconds", "async_output_axis",
           "bucket_launch_time", "final_bucket_time", "expert_exchange_times", "expert_tp_exchange_times", "moe_routed_load",
           "row_reduce_times", "row_reduce_bytes_on_wire", "ReshardCost", "reshard_cost",
           "coded_reshard_cost", "layout_code", "placement_code"]

Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
Algorithm = Literal["ring", "tree", "auto"]
AnyLink = Link | HierarchicalLink


def _ring(kind: Collective, n: int) -> tuple[float, int]:
    """(fraction of the full buffer each device sends, number of latency-bound steps)."""
    if n < 1:
        raise ValueError(f"a mesh axis has at least 1 device, got n={n}")
    if kind == "all_reduce":
        return 2 * (n - 1) / n, 2 * (n - 1)
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n, n - 1
    if kind == "all_to_all":
        return (n - 1) / n ** 2, n - 1
    raise ValueError(f"unknown collective {kind!r}: use all_reduce, all_gather, reduce_scatter or all_to_all")


def collective_bytes_on_wire(kind: Collective, nbytes: float, n: int) -> float:
    """Bytes each device sends for one collective over n devices on a buffer of full size nbytes."""
    return _ring(kind, n)[0] * nbytes


def latency_steps(kind: Collective, n: int, algorithm: Algorithm = "ring") -> int:
    """Latency-bound steps of one flat collective over n devices."""
    if algorithm == "tree" and kind == "all_reduce" and n > 1:
        return 2 * math.ceil(math.log2(n))
    return _ring(kind, n)[1]


def _flat(kind: Collective, nbytes: float, n: int, link: Link, algorithm: Algorithm) -> float:
    if n <= 1:
        return 0.0
    fraction, steps = _ring(kind, n)
    if kind == "reduce_scatter":
        fraction *= link.reduce_scatter_factor
    ring = fraction * nbytes / link.bandwidth + steps * link.latency
    if kind != "all_reduce" or algorithm == "ring":
        return ring
    tree = 2 * nbytes / link.bandwidth + latency_steps("all_reduce", n, "tree") * link.latency
    return tree if algorithm == "tree" else min(ring, tree)


def collective_time(kind: Collective, nbytes: float, n: int, link: AnyLink, algorithm: Algorithm = "ring") -> float:
    """Seconds for one collective over n devices on a buffer of full size nbytes (see module docstring)."""
    if algorithm not in ("ring", "tree", "auto"):
        raise ValueError(f"unknown algorithm {algorithm!r}: use ring, tree or auto")
    _ring(kind, n)  # validates kind and n
    if not isinstance(link, HierarchicalLink) or n != link.size:
        flat = link if isinstance(link, Link) else Link(link.bandwidth, link.latency)
        return _flat(kind, nbytes, n, flat, algorithm)
    k, m = link.local, n // link.local
    if kind == "all_reduce":
        return (_flat("reduce_scatter", nbytes, k, link.intra, "ring")
                + _flat("all_reduce", nbytes / k, m, link.inter, algorithm)
                + _flat("all_gather", nbytes, k, link.intra, "ring"))
    if kind in ("all_gather", "reduce_scatter"):
        return _flat(kind, nbytes / k, m, link.inter, "ring") + _flat(kind, nbytes, k, link.intra, "ring")
    chunk = nbytes / n ** 2                     # all_to_all: what one device sends to one other
    return ((k - 1) * chunk / link.intra.bandwidth + (n - k) * chunk / link.inter.bandwidth
            + (k - 1) * link.intra.latency + (m - 1) * link.inter.latency)


def p2p_time(nbytes: float, link: AnyLink) -> float:
    """One point-to-point transfer of nbytes (e.g. activations between pipeline stages)."""
    if isinstance(link, HierarchicalLink):
        link = link.inter
    return nbytes / link.bandwidth + link.latency if nbytes > 0 else 0.0


def broadcast_time(nbytes: float, n: int, link: AnyLink, algorithm: Algorithm = "ring") -> float:
    """Broadcast of nbytes from one device to n (pipelined chain or tree)."""
    if n <= 1:
        return 0.0
    if isinstance(link, HierarchicalLink) and n == link.size:
        m = n // link.local
        return (broadcast_time(nbytes, m, link.inter, algorithm)
                + broadcast_time(nbytes, link.local, link.intra, algorithm))
    steps = n - 1 if algorithm == "ring" else math.ceil(math.log2(n))
    return nbytes / link.bandwidth + steps * link.latency


def first_bucket_bytes(bucket_bytes: float) -> float:
    """The size at which the first gradient bucket of a kind leaves (runtime/grad_sync.py): DDP's 1 MiB,
    or `bucket_bytes` if smaller."""
    return min(DDP_FIRST_BUCKET_BYTES, bucket_bytes)


def bucket_count(nbytes: float, bucket_bytes: float | None) -> int:
    """How many buckets `nbytes` of gradients of one kind fill: a first of `first_bucket_bytes`, then
    buckets of `bucket_bytes` (None: one bucket)."""
    if not bucket_bytes:
        return 1
    first = first_bucket_bytes(bucket_bytes)
    return 1 + max(0, math.ceil((nbytes - first) / bucket_bytes))


def bucketed_time(kind: Collective, nbytes: float, n: int, link: AnyLink, bucket_bytes: float | None,
                  launch_overhead: float = 0.0, algorithm: Algorithm = "ring") -> float:
    """`nbytes` of gradients synchronised in buckets (`bucket_count`; None: one bucket): the first
    holding `first_bucket_bytes`, the rest shared evenly by the others."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    buckets = bucket_count(nbytes, bucket_bytes)
    if buckets == 1:
        return collective_time(kind, nbytes, n, link, algorithm) + launch_overhead
    first = first_bucket_bytes(bucket_bytes)
    rest = (nbytes - first) / (buckets - 1)
    return (collective_time(kind, first, n, link, algorithm)
            + (buckets - 1) * collective_time(kind, rest, n, link, algorithm) + buckets * launch_overhead)


@dataclass(frozen=True, slots=True)
class GradBucket:
    """The kind of gradient bucket a parameter's gradient goes into: one collective over `n` devices
    (mesh axes taken together) on `link` (the slowest of theirs)."""
    collective: Collective
    n: int
    link: AnyLink


def bucketed_reduction(grad: Sequence[Placement], stored: Sequence[Placement], shape: Sequence[int],
                       sizes: Sequence[int]) -> tuple[tuple[int, ...], int | None] | None:
    """How the runtime's gradient buckets reduce a parameter gradient in layout `grad` to the
    parameter's `stored` layout: (axes, None) an all-reduce over those mesh axes together; ((a,), d)
    a reduce-scatter over axis a onto dim d (which must split evenly and be split by no other axis).
    None: nothing to reduce, or a move buckets do not make (the parameter's Reshard runs it)."""
    reduce, scatter = [], None
    for a, (g, t) in enumerate(zip(grad, stored)):
        if g == t:
            continue
        if not (isinstance(g, Partial) and g.reduce_op == "sum"):
            return None
        if isinstance(t, Replicate):
            reduce.append(a)
        elif isinstance(t, Shard) and scatter is None:
            scatter = (a, t.dim)
        else:
            return None
    if scatter is None:
        return (tuple(reduce), None) if reduce else None
    a, d = scatter
    if reduce or shape[d] % sizes[a] or any(isinstance(t, Shard) and t.dim == d for i, t in enumerate(stored) if i != a):
        return None
    return (a,), d


def flat_gather_axis(stored: Sequence[Placement], used: Sequence[Placement], shape: Sequence[int],
                     sizes: Sequence[int]) -> int | None:
    """The mesh axis over which the runtime gathers a parameter stored in `stored` and used in `used`
    together with the rest of its layer, in one flat all-gather (runtime/layer_gather.py): the one
    axis that changes, from `Shard(0)` (even, no other axis splitting dim 0) to `Replicate`. None:
    the parameter is gathered on its own (and where a symbolic size may not split evenly)."""
    changed = [a for a, (s, t) in enumerate(zip(stored, used)) if s != t]
    if len(changed) != 1:
        return None
    a = changed[0]
    if not (isinstance(stored[a], Shard) and stored[a].dim == 0 and isinstance(used[a], Replicate)):
        return None
    if not shape or shape[0] % sizes[a] != 0:
        return None
    if any(isinstance(p, Shard) and p.dim == 0 for i, p in enumerate(stored) if i != a):
        return None
    return a


def regather_seconds(fwd, flat, n: int) -> tuple[tuple[float, ...], ...]:
    """[a][b] seconds of gathering a layer's parameter again for its backward (a residency option): its
    forward gather's `fwd`, less 2 (n - 1) / n of its latency and launch `flat` where the runtime gathers
    the layer's n such parameters as one flat all-gather in each pass (n collectives become one)."""
    saved = 2 * (n - 1) / n if n else 0.0
    flat = flat or [[0.0] * len(row) for row in fwd]
    return tuple(tuple(f - saved * x for f, x in zip(row, frow)) for row, frow in zip(fwd, flat))


def async_output_axis(src: Sequence[Placement], dst: Sequence[Placement]) -> int | None:
    """The mesh axis over which the runtime makes a program output whole by one all-reduce issued
    asynchronously, waited where the caller first uses the value (runtime/ops.py `AsyncOutput`): the
    one axis that changes, from a partial sum to `Replicate` (a loss summed over each rank's rows).
    Nothing of the step waits for it, so it is priced at its launch alone. None: a blocking reshard."""
    changed = [a for a, (s, t) in enumerate(zip(src, dst)) if s != t]
    if len(changed) != 1:
        return None
    a = changed[0]
    ok = isinstance(src[a], Partial) and src[a].reduce_op == "sum" and isinstance(dst[a], Replicate)
    return a if ok else None


def _no_latency(link: AnyLink) -> AnyLink:
    if isinstance(link, HierarchicalLink):
        return HierarchicalLink(_no_latency(link.intra), _no_latency(link.inter), link.local, link.size)
    return replace(link, latency=0.0)


def transfer_time(kind: Collective, nbytes: float, n: int, link: AnyLink) -> float:
    """The bandwidth term of a collective (no latency): what one more gradient adds to a bucket."""
    return collective_time(kind, nbytes, n, _no_latency(link))


def bucket_launch_time(bucket: GradBucket, nbytes: float, bucket_bytes: float, launch_overhead: float) -> float:
    """Seconds `nbytes` of gradients in buckets of `bucket_bytes` add beyond their transfer: one
    latency and one launch per bucket; none over one device, where the runtime launches nothing."""
    b = bucket
    if b.n == 1:
        return 0.0
    return (bucketed_time(b.collective, nbytes, b.n, b.link, bucket_bytes, launch_overhead)
            - transfer_time(b.collective, nbytes, b.n, b.link))


def final_bucket_time(bucket: GradBucket, nbytes: float, bucket_bytes: float, overlap: float) -> float:
    """Seconds of the last bucket of `nbytes` of gradients of one kind that a per-gradient price of
    `(1 - overlap)` of its transfer (`Mesh.grad_sync_leg`) leaves out: the runtime launches every
    bucket as it fills, while the backward goes on, but the last (what is left once the buckets before
    it, the first of `first_bucket_bytes` and then `bucket_bytes` each, have left; all of it when one
    bucket holds everything) when the backward ends (runtime/grad_sync.py `finish`): nothing hides it."""
    if bucket.n == 1 or nbytes <= 0 or overlap <= 0:
        return 0.0
    buckets = bucket_count(nbytes, bucket_bytes)
    last = nbytes if buckets == 1 else nbytes - first_bucket_bytes(bucket_bytes) - (buckets - 2) * bucket_bytes
    return overlap * transfer_time(bucket.collective, last, bucket.n, bucket.link)


# bytes of one routed-row count (int64) in the counts exchange before an expert-parallel dispatch
_COUNT_BYTES = 8


def moe_routed_load(imbalance: float, capacity_factor: float | None = None) -> float:
    """The busiest device's routed token-slots over the mean: the profile's `moe_load_imbalance`, at
    most the capacity factor where one is set (no expert takes more than factor x its mean share of
    the slots, so no device does: runtime/experts.py)."""
    return imbalance if capacity_factor is None else min(imbalance, capacity_factor)


def expert_exchange_times(row_bytes: float, n: int, link: AnyLink, imbalance: float = 1.0,
                          launch_overhead: float = 0.0) -> tuple[float, float]:
    """(forward, backward) seconds of an expert-parallel layer's dispatch and combine over one mesh
    axis of n devices; `row_bytes`: the token-slots one device routes, in bytes (module docstring)."""
    if n <= 1:
        return 0.0, 0.0
    rows = collective_time("all_to_all", n * row_bytes * imbalance, n, link) + launch_overhead
    counts = collective_time("all_to_all", n * n * _COUNT_BYTES, n, link) + launch_overhead
    return counts + 2 * rows, 2 * rows


def row_reduce_times(per_row: tuple[tuple[int, ...], tuple[int, ...]], rows: float, n: int, link: AnyLink,
                     launch_overhead: float = 0.0) -> tuple[float, float]:
    """(forward, backward) seconds of an op's all-reduces of a few statistics per row over one mesh axis
    of n devices, each its own launch: `per_row` the (forward, backward) bytes per row of each, for
    `rows` rows on one device (a vocab-split loss: `strategies.vocab.ROW_STATISTICS`)."""
    if n <= 1:
        return 0.0, 0.0
    return tuple(sum(collective_time("all_reduce", rows * b, n, link) + launch_overhead for b in phase)
                 for phase in per_row)


def row_reduce_bytes_on_wire(per_row: tuple[tuple[int, ...], tuple[int, ...]], rows: float,
                             n: int) -> tuple[float, float]:
    """(forward, backward) bytes one device sends in those all-reduces (`row_reduce_times`)."""
    return tuple(collective_bytes_on_wire("all_reduce", rows * sum(phase), n) for phase in per_row)


def expert_tp_exchange_times(shard_bytes: float, n: int, link: AnyLink,
                             launch_overhead: float = 0.0) -> tuple[float, float]:
    """(forward, backward) seconds of trading a MoE layer's fused gate/up shard into Megatron's pairing
    over its expert_tp axis of n devices (runtime/experts.py): one all-to-all of the device's
    `shard_bytes` forward, its reverse for the gradient backward."""
    if n <= 1:
        return 0.0, 0.0
    t = collective_time("all_to_all", n * shard_bytes, n, link) + launch_overhead
    return t, t


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    return collective_time("all_reduce", nbytes, n, link)


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    return collective_time("all_gather", nbytes, n, link)


def reduce_scatter_time(nbytes: float, n: int, link: Link) -> float:
    return collective_time("reduce_scatter", nbytes, n, link)


def all_to_all_time(nbytes: float, n: int, link: Link) -> float:
    return collective_time("all_to_all", nbytes, n, link)


@dataclass(frozen=True, slots=True)
class ReshardCost:
    seconds: float
    bytes_per_axis: tuple[float, ...]     # per-device bytes sent on each mesh axis
    collectives: tuple[str, ...]          # e.g. ("all_reduce@tp", "all_gather@dp"), in execution order


_R, _S, _P = range(3)
Code = tuple     # a placement as plain data: (_R,), (_S, dim) or (_P, reduce op); a subclass's adds itself


@cache
def placement_code(p: Placement) -> Code:
    """p as a tuple of ints and strings, equal where the placements are equal. Pricing works on
    these: hashing and isinstance on torch's placement classes run Python hooks (about 1 us each),
    and the edge tables of a 3-axis mesh price hundreds of thousands of reshards (Hugging Face
    Llama-3-8B on (4, 4, 4): 153k). A subclass's code (`_StridedShard`, `_MaskPartial`) holds the
    placement itself, so it compares as torch compares them."""
    if isinstance(p, Shard):
        return (_S, p.dim) if type(p) is Shard else (_S, p.dim, p)
    if isinstance(p, Replicate):
        return (_R,)
    if isinstance(p, Partial):
        return (_P, p.reduce_op) if type(p) is Partial else (_P, p.reduce_op, p)
    raise ValueError(f"reshard_cost: unknown placement {p!r}")


def layout_code(layout: Sequence[Placement]) -> tuple[Code, ...]:
    """`placement_code` of each mesh axis's placement."""
    return tuple(map(placement_code, layout))


@cache      # a few hundred distinct pairs
def _transition(cur: Code, tgt: Code) -> Collective | None:
    """The collective taking one mesh axis from cur to tgt, as DTensor's redistribute issues it
    (None: a local step). tgt is never Partial here (`redistribute_steps` goes to R first)."""
    if cur == tgt or cur[0] == _R:                          # R -> S(d) slices
        return None
    if cur[0] == _P:
        return "reduce_scatter" if tgt[0] == _S else "all_reduce"
    return "all_to_all" if tgt[0] == _S else "all_gather"   # S(d) -> S(d'), S(d) -> R


def _shards(layout, dim: int, below: int) -> tuple[int, ...]:
    """The mesh axes before axis `below` that split tensor dim `dim` in `layout`."""
    return tuple(j for j in range(below) if layout[j][0] == _S and layout[j][1] == dim)


@cache
def redistribute_steps(src: tuple[Code, ...], dst: tuple[Code, ...],
                        sizes: tuple[int, ...]) -> tuple[tuple[int, Code, Code], ...]:
    """The single-axis steps (axis, from, to) the runtime takes from src to dst (`runtime/reshard.py`;
    `runtime/direct_reshard.py` issues these very steps): nothing where only axes of one device
    change (a relabelling); else every axis going to a Partial (or between two Partial kinds) goes to
    Replicate, the local tensor zeroed or kept after (free),
    and DTensor's redistribute runs its greedy plan to that layout (torch 2.13,
    `_redistribute.generate_greedy_transform_infos`), read from it:
      1. if src shards anything, the axes from the innermost out, each straight to its target, but
         where the target shards dim d and the axes before it shard d differently in the current and
         the target layout (nested sharding: (S(0), S(0)) -> (R, S(0))) to Replicate first;
      2. the axes from the outermost in, each still off its target straight to it.
    So (S(0), S(0)) -> (R, S(0)) is two all-gathers (tp, then dp) and a slice, not one all-gather
    over dp: one over dp alone would leave each rank rows of both halves."""
    changed = [i for i, (a, b) in enumerate(zip(src, dst)) if a != b]
    if all(sizes[i] == 1 for i in changed):
        return ()
    mid = tuple((_R,) if b[0] == _P and (a != b) else b for a, b in zip(src, dst))
    cur, steps = list(src), []
    if math.prod(n for c, n in zip(src, sizes) if c[0] == _S) > 1:
        for i in reversed(range(len(cur))):
            tgt = mid[i]
            if tgt[0] == _S and _shards(cur, tgt[1], i) != _shards(mid, tgt[1], i):
                tgt = (_R,)
            if cur[i] != tgt:
                steps.append((i, cur[i], tgt))
                cur[i] = tgt
    for i, tgt in enumerate(mid):
        if cur[i] != tgt:
            steps.append((i, cur[i], tgt))
            cur[i] = tgt
    return tuple(steps)


@lru_cache(maxsize=1 << 16)
def _local_bytes(shape: tuple, itemsize: int, layout: tuple[Code, ...], sizes: tuple[int, ...]) -> float:
    """Bytes of the largest local chunk (uneven shards are padded to it, as DTensor's collectives do).
    Cached: a 3-axis mesh's edge tables ask it of the same tensor and layout thousands of times
    (Hugging Face Llama-3-8B on (4, 4, 4): 590k calls, a few thousand distinct)."""
    s = list(shape)
    for c, n in zip(layout, sizes):
        if c[0] == _S:
            s[c[1]] = ceil_div(s[c[1]], n)
    return to_float(math.prod(s) * itemsize)


def local_copy_bytes(kind: Collective, shape: Sequence[int], layout: Sequence[Code], sizes: Sequence[int],
                     dim: int, full: float) -> float:
    """Bytes read and written by the local copies around one collective of a reshard (module
    docstring), the tensor of global `shape` in `layout` before it; `dim` the tensor dim gathered or
    scattered, `full` the collective's whole buffer (gathered or unreduced bytes)."""
    if kind == "all_reduce":
        return 2 * full
    if kind == "reduce_scatter" and dim != 0:
        return 2 * full
    if kind == "all_gather" and dim != 0:
        before = [ceil_div(shape[d], math.prod(n for c, n in zip(layout, sizes) if c[0] == _S and c[1] == d))
                  for d in range(dim)]
        return 2 * full if any(is_symbolic(x) or x != 1 for x in before) else 0.0
    return 0.0


def reshard_cost(global_shape: Sequence[int], itemsize: int, src: Sequence[Placement], dst: Sequence[Placement],
                 axis_sizes: Sequence[int], axis_links: Sequence[Link], axis_names: Sequence[str],
                 launch_overhead: float = 0.0, copy_bandwidth: float = math.inf) -> ReshardCost:
    """Cost of redistributing a tensor from layout `src` to `dst` (one placement per mesh axis).

    Axis by axis in the steps the runtime takes (`redistribute_steps`: DTensor's redistribute), each
    collective on the local tensor as it is at that step. Shard dims must be normalised (>= 0).
    Collectives on different axes are charged one after another (no overlap). Works the same for
    gradients flowing backward (pass the gradient layouts). `launch_overhead` is charged once per
    collective: each is one kernel launch (so one all-reduce beats a reduce-scatter + all-gather
    that move the same bytes). The local copies around each collective (`local_copy_bytes`) are
    charged at `copy_bandwidth` (bytes/s; the profile's memory bandwidth). A shard moved to another
    dim is priced as an all-to-all, as NCCL runs it; on gloo DTensor gathers the whole tensor
    instead (docs/cost_model.md, Known limits).
    """
    return coded_reshard_cost(global_shape, itemsize, layout_code(src), layout_code(dst), axis_sizes,
                              axis_links, axis_names, launch_overhead, copy_bandwidth)


def coded_reshard_cost(global_shape: Sequence[int], itemsize: int, src: tuple[Code, ...], dst: tuple[Code, ...],
                       axis_sizes: Sequence[int], axis_links: Sequence[Link], axis_names: Sequence[str],
                       launch_overhead: float = 0.0, copy_bandwidth: float = math.inf) -> ReshardCost:
    """`reshard_cost` of layouts given as `layout_code`s (the edge tables code each layout once)."""
    k = len(axis_sizes)
    if not len(src) == len(dst) == len(axis_links) == len(axis_names) == k:
        raise ValueError(f"reshard_cost: src {tuple(src)}, dst {tuple(dst)}, axis_sizes, axis_links and "
                         f"axis_names must all have one entry per mesh axis ({k})")
    for c in (*src, *dst):
        if c[0] == _S and not 0 <= c[1] < len(global_shape):
            raise ValueError(f"reshard_cost: Shard({c[1]}) does not fit a tensor of shape {tuple(global_shape)}")
    rc = _reshard_cost(tuple(global_shape), itemsize, src, dst, tuple(axis_sizes), tuple(axis_links),
                       tuple(axis_names), copy_bandwidth)
    if launch_overhead and rc.collectives:
        rc = ReshardCost(rc.seconds + launch_overhead * len(rc.collectives), rc.bytes_per_axis, rc.collectives)
    return rc


def _reshard_cost(shape: tuple[int, ...], itemsize: int, src: tuple[Code, ...], dst: tuple[Code, ...],
                  sizes: tuple[int, ...], links: tuple[Link, ...], names: tuple[str, ...],
                  copy_bandwidth: float) -> ReshardCost:
    seconds, sent, names_out = 0.0, [0.0] * len(sizes), []
    cur = tuple(src)
    for i, _, b in redistribute_steps(src, dst, sizes):
        cur, kind, wire, copy, on_wire = _step(shape, itemsize, cur, i, b, sizes, links[i], copy_bandwidth)
        if kind is None:
            continue
        seconds += wire
        seconds += copy
        sent[i] += on_wire
        names_out.append(f"{kind}@{names[i]}")
    return ReshardCost(seconds, tuple(sent), tuple(names_out))


@lru_cache(maxsize=1 << 17)
def _step(shape: tuple, itemsize: int, cur: tuple[Code, ...], i: int, b: Code, sizes: tuple[int, ...], link: Link,
          copy_bandwidth: float) -> tuple[tuple[Code, ...], Collective | None, float, float, float]:
    """One step of `_reshard_cost`: mesh axis i of the layout `cur` goes to `b`. (The layout after it, its
    collective (None: a slice or a one-device axis, free), the collective's seconds, the seconds of its
    local copies, the bytes each device sends.) Cached: the edge tables price thousands of layout pairs per
    tensor whose steps are mostly the same few (Hugging Face Llama-3-8B on (4, 4, 4): 148k reshards)."""
    a, after = cur[i], (*cur[:i], b, *cur[i + 1:])
    kind = _transition(a, b)
    if kind is None or sizes[i] == 1:
        return after, None, 0.0, 0.0, 0.0
    before, done = _local_bytes(shape, itemsize, cur, sizes), _local_bytes(shape, itemsize, after, sizes)
    full = before if kind == "all_reduce" else sizes[i] * smin(before, done)
    dim = b[1] if kind == "reduce_scatter" else a[1] if kind == "all_gather" else 0
    return (after, kind, collective_time(kind, full, sizes[i], link),
            local_copy_bytes(kind, shape, cur, sizes, dim, full) / copy_bandwidth,
            collective_bytes_on_wire(kind, full, sizes[i]))
