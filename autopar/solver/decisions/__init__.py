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
    offloaded, a gathered copy re-gathered, recomputed or offloaded) add their gates to one item, so its
    bytes are freed once. Where they bring it back at different points (a recomputed layer's tensors all
    at its backward's start, an offloaded or re-gathered one when its op's backward needs it), the item is
    split: up to the earliest point under any gate, after it under the later families' gates unless the
    earlier's are on."""
    by_key: dict[str, dict[int, list[Freed]]] = {}
    for f in fam.freed:
        by_key.setdefault(f.key, {}).setdefault(f.until, []).append(f)
    out = []
    for bands in by_key.values():
        untils = sorted(bands)
        gates = [tuple(g for f in bands[u] for g in f.gates) for u in untils]
        for i, until in enumerate(untils):
            first, later = bands[until][0], tuple(g for gs in gates[i:] for g in gs)   # who frees this window
            if i == 0:       # an item one family alone frees (most) is kept as it is: terms are frozen
                out.append(first if later == first.gates else replace(first, gates=later))
                continue
            earlier = tuple(g for gs in gates[:i] for g in gs)
            if len({g for g, _ in earlier}) > 1:     # (K') needs them exclusive
                raise ValueError(f"{first.key}: brought back at different points by more than two families")
            prev = untils[i - 1]
            out.append(replace(first, gates=later, after=max(first.after, prev), key=f"{first.key}@{prev}",
                               unless=earlier))
    fam.freed = out
    return fam
