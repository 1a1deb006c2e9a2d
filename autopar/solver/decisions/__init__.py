"""The decision families beyond layouts, one module each; `add_families` puts them on a Problem.

Each module has `build(problem, allowed) -> Families` (see `solver/families.py` for the terms).
A family's groups follow the layer linking of the layout family: repeated layers whose layout
variables are shared (`solver/layers.py`) share one group too, and the group's terms are
written once for a representative layer and counted for every copy.
"""
from __future__ import annotations

from dataclasses import replace

from ..families import Families, Freed
from ..problem import Problem
from . import offload, recompute, residency


def add_families(problem: Problem, *, recompute_mode: str = "auto", residency_mode: str = "auto",
                 offload_mode: str = "auto", gradient_offload: bool = True,
                 flat: residency.FlatGathers | None = None) -> Problem:
    """`flat`: the planning problem's flat parameter gathers (`residency.flat_gathers`), where `problem`
    holds one plan's layouts only."""
    fam = Families()
    fam.extend(recompute.build(problem, recompute_mode))
    fam.extend(residency.build(problem, residency_mode, flat))
    fam.extend(offload.build(problem, offload_mode, gradient_offload))
    problem.families = merge_freed(fam)
    return problem


def merge_freed(fam: Families) -> Families:
    """One `Freed` per item and window: families that free the same bytes (an activation recomputed or
    offloaded, a gathered copy re-gathered or recomputed) add their gates to one item, so its bytes
    are freed once. Where they bring it back at different points (a recomputed layer's tensors all at
    its backward's start, an offloaded one when its op's backward needs it), the item is split: up to
    the earlier point under any gate, after it under the later family's gates unless the earlier's
    are on."""
    by_key: dict[str, list[Freed]] = {}
    for f in fam.freed:
        by_key.setdefault(f.key, []).append(f)
    out = []
    for items in by_key.values():
        items.sort(key=lambda f: f.until)
        first = items[0]
        out.append(replace(first, gates=tuple(g for f in items for g in f.gates)))
        for k in range(1, len(items)):
            f = items[k]
            if f.until > items[k - 1].until:
                if len({g for e in items[:k] for g, _ in e.gates}) > 1:     # (K') needs them exclusive
                    raise ValueError(f"{f.key}: brought back at different points by more than two families")
                out.append(replace(f, after=max(f.after, items[k - 1].until), key=f"{f.key}@{items[k - 1].until}",
                                   unless=tuple(g for e in items[:k] for g in e.gates)))
    fam.freed = out
    return fam
