"""Which edges of the per-rank program move data: the rules the rewrite (runtime/rewrite.py) builds
the program with and the evaluator (solver/evaluate.py) counts its runtime modules with, in one place
below both, so the two agree on every edge.
"""
from __future__ import annotations

from functools import lru_cache

from ..placement import over_one_device, parse_layout


def reshards_edge(src_executor: str | None, src_layout, want, mesh_shape) -> bool:
    """Does the rewrite put a Reshard between a producer and a consumer's input? Always after a
    parameter (its stored shard becomes a DTensor there) and after anything the plan does not know;
    otherwise where the layouts differ over an axis of more than one device (over axes of one device
    every layout holds the same local tensor: the consumer takes the producer's as it is).
    (`autopar.estimate` counts runtime modules with this.)"""
    return src_executor in (None, "param") or not _relabels(tuple(mesh_shape), tuple(src_layout), tuple(want))


def output_modules(sharded_outputs: bool, src_layout, mesh_shape) -> int:
    """Runtime modules the rewrite adds per tensor output in `src_layout`: a Reshard to whole and a
    ToLocal, or none when outputs stay sharded or the output is whole already (up to axes of one
    device: then its op hands it on as a plain tensor, `runtime/rewrite.passes_local`)."""
    return 0 if sharded_outputs or _relabels(tuple(mesh_shape), tuple(src_layout), ("R",) * len(mesh_shape)) else 2


@lru_cache(maxsize=4096)
def _relabels(mesh_shape: tuple, src_layout: tuple, want: tuple) -> bool:
    """`over_one_device` between two layouts (placements or their strings), remembered: the evaluator
    asks it of every edge of every plan it prices, over a few distinct layouts."""
    return over_one_device(mesh_shape, parse_layout(src_layout), parse_layout(want))
