"""Pins: the layouts (or strategy labels) a user fixes for parameters, inputs and nodes, by name or glob.

`build_problem(pins=...)` maps patterns (parameter names as in `model.named_parameters()`, input or
node names; `fnmatch` globs) to one placement per mesh axis ("R", "S(d)") or, for an op, a strategy
label per axis. A node's strategies are narrowed to those that follow its pin; a pin that matches
nothing, or that no strategy follows, is an error the user can act on.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence

from torch.distributed.tensor import Shard

from ..errors import ShardingError
from ..mesh import Mesh
from ..passes.shape_prop import TensorMeta
from ..placement import parse_pin, to_str
from ..strategies import Strategy


class Pins:
    """The pins of one problem, and which of them matched something."""

    def __init__(self, pins: Mapping[str, Sequence[str]] | None, mesh: Mesh):
        self.pins, self.mesh = dict(pins or {}), mesh
        self.used: set[str] = set()

    def pinned(self, keys: Sequence[str]):
        """(pattern, wanted layout or labels) of the first pin matching one of `keys`; (None, None) if none."""
        for pat, layout in self.pins.items():
            if any(fnmatch.fnmatchcase(k, pat) for k in keys if k):
                self.used.add(pat)
                want = parse_pin(layout)
                if len(want) != self.mesh.ndim:
                    raise ShardingError(f"pin {pat!r}: {tuple(layout)} has {len(want)} entries but the mesh has "
                                        f"{self.mesh.ndim} axes {self.mesh.axis_names}: give one per axis")
                return pat, want
        return None, None

    @staticmethod
    def placements_only(pat, want, what):
        if any(isinstance(p, str) for p in want):
            raise ShardingError(f"pin {pat!r} gives strategy labels {want} for {what}, which has a layout, not a "
                                f"strategy: pin it with placements ('R', 'S(d)'), or pin the op that uses it")
        return want

    def check(self, layout, meta: TensorMeta, what: str) -> None:
        """`layout` has one placement per mesh axis and splits `meta` evenly."""
        mesh = self.mesh
        if len(layout) != mesh.ndim:
            raise ShardingError(f"placement {tuple(to_str(p) for p in layout)} for {what} has {len(layout)} entries "
                                f"but the mesh has {mesh.ndim} axes {mesh.axis_names}: give one per axis")
        split: dict[int, int] = {}
        for p, ax in zip(layout, mesh.axes):
            if isinstance(p, Shard):
                if not 0 <= p.dim < meta.ndim:
                    raise ShardingError(f"{what} has {meta.ndim} dims; it has no dim {p.dim} to split over mesh axis "
                                        f"{ax.name!r}")
                split[p.dim] = split.get(p.dim, 1) * ax.size
                if meta.shape[p.dim] % split[p.dim]:
                    raise ShardingError(
                        f"cannot split dim {p.dim} (size {meta.shape[p.dim]}) of {what} over mesh axis {ax.name!r} "
                        f"(into {split[p.dim]} pieces in all): choose a size divisible by {split[p.dim]}, "
                        f"another dim, or Replicate on that axis")

    @staticmethod
    def narrowed(name: str, strategies: list[Strategy], want) -> list[Strategy]:
        """The strategies of node `name` that follow its pin: per axis its output placement, or its label
        where a label is given."""
        kept = [s for s in strategies
                if all(s.labels[a] == w if isinstance(w, str) else s.output[a] == w for a, w in enumerate(want))]
        if not kept:
            shown = tuple(w if isinstance(w, str) else to_str(w) for w in want)
            raise ShardingError(f"node {name!r} has no strategy with output placement or label {shown} per mesh "
                                f"axis: pin another layout or label, or leave it to the solver")
        return kept

    def check_used(self) -> None:
        unused = set(self.pins) - self.used
        if unused:
            raise ShardingError(f"pin(s) {sorted(unused)} match no parameter, input or node of the model: "
                                f"use parameter names as in model.named_parameters() (glob patterns allowed)")
