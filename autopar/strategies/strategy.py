"""N-D strategies: one `AxisOption` per mesh axis, combined.

A `Strategy` fixes the layout (one placement per mesh axis) of every tensor input and of the
output. Using column on one axis and row on another of a (2, 4) mesh is 2-D tensor
parallelism; batch on one axis and column on the next is DP x TP; the same dim split on two
axes is split over their product. Combinations that would split a dim unevenly are dropped
(an even split keeps every device's work, and our cost of it, exact).
"""
from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..passes.shape_prop import TensorMeta
from ..placement import to_str
from .registry import AxisOption, OpRule

Layout = tuple[Placement, ...]
_REPLICATE_OPTION_LABEL = "replicate"


@dataclass(frozen=True, slots=True)
class Strategy:
    inputs: tuple[Layout, ...]
    output: Layout
    labels: tuple[str, ...] = ()     # per mesh axis: which option ("batch", "column", "row", ...)

    def parallel_axes(self) -> tuple[bool, ...]:
        """Axes on which the work is divided (anything but all-replicate)."""
        n = len(self.output)
        return tuple(not (isinstance(self.output[a], Replicate) and all(isinstance(i[a], Replicate)
                                                                         for i in self.inputs)) for a in range(n))

    def name(self) -> str:
        lay = lambda L: "".join(to_str(p) for p in L)  # noqa: E731
        ins = ", ".join(lay(i) for i in self.inputs)
        return f"{ins} -> {lay(self.output)}" if ins else lay(self.output)


def normalize(p: Placement, ndim: int) -> Placement:
    return Shard(p.dim % ndim) if isinstance(p, Shard) and ndim > 0 else p


def fits(layout: Layout, meta: TensorMeta, mesh_shape: Sequence[int]) -> bool:
    """Every split dim divides evenly by the product of the axes that split it."""
    split = [1] * meta.ndim
    for p, n in zip(layout, mesh_shape):
        if isinstance(p, Shard):
            if not 0 <= p.dim < meta.ndim:
                return False
            split[p.dim] *= n
    return all(meta.shape[d] % split[d] == 0 for d in range(meta.ndim))


def axis_options(rule: OpRule | None, node, ins: Sequence[TensorMeta], outs: Sequence[TensorMeta]) -> list[AxisOption]:
    out_nd = outs[0].ndim if outs else 0
    replicate = AxisOption(tuple(Replicate() for _ in ins), Replicate(), _REPLICATE_OPTION_LABEL)
    opts = [replicate]
    if rule is not None:
        for o in rule.fn(node, ins, outs):
            o = AxisOption(tuple(normalize(p, t.ndim) for p, t in zip(o.inputs, ins)), normalize(o.output, out_nd),
                           o.label)
            if o not in opts:
                opts.append(o)
    return opts


def node_strategies(options: Sequence[AxisOption], ins: Sequence[TensorMeta], outs: Sequence[TensorMeta],
                    mesh_shape: Sequence[int], rule: OpRule | None = None) -> list[Strategy]:
    """All combinations of per-axis options that split every tensor evenly (and that the op's rule
    admits), in a fixed order. An axis of one device splits nothing: it takes only the options that
    keep everything whole. Enumerated once per signature (options, shapes, mesh, rule): a model's
    repeated layers ask for the same lists (an 8B model's 2,100 ops have ~100 signatures)."""
    return list(_strategies(tuple(options), tuple(ins), tuple(outs), tuple(mesh_shape), rule))


@functools.lru_cache(maxsize=4096)
def _strategies(options: tuple[AxisOption, ...], ins: tuple[TensorMeta, ...], outs: tuple[TensorMeta, ...],
                mesh_shape: tuple[int, ...], rule: OpRule | None) -> tuple[Strategy, ...]:
    whole = [o for o in options if all(isinstance(p, Replicate) for p in (o.output, *o.inputs))] or list(options)
    out = []
    for combo in itertools.product(*[options if n > 1 else whole for n in mesh_shape]):
        s = Strategy(tuple(tuple(o.inputs[k] for o in combo) for k in range(len(ins))),
                     tuple(o.output for o in combo), tuple(o.label for o in combo))
        if all(fits(s.output, m, mesh_shape) for m in outs) and all(
                fits(L, m, mesh_shape) for L, m in zip(s.inputs, ins)) and (
                rule is None or rule.admits is None or rule.admits(s.labels, s.inputs, s.output, ins, outs, mesh_shape, fits)):
            out.append(s)
    return tuple(out)


def layout_space(meta: TensorMeta, mesh_shape: Sequence[int]) -> list[Layout]:
    """Every way to store a tensor: each axis replicates it or splits one of its dims."""
    per_axis = [Replicate()] + [Shard(d) for d in range(meta.ndim)]
    return [L for L in itertools.product(*[per_axis if n > 1 else [Replicate()] for n in mesh_shape])
            if fits(L, meta, mesh_shape)]


def shard_count(layout: Layout, mesh_shape: Sequence[int]) -> int:
    return math.prod(n for p, n in zip(layout, mesh_shape) if isinstance(p, Shard))


def parallel_count(strategy: Strategy, mesh_shape: Sequence[int]) -> int:
    return math.prod(n for par, n in zip(strategy.parallel_axes(), mesh_shape) if par)
