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
                 offload_mode: str = "auto") -> Problem:
    fam = Families()
    fam.extend(recompute.build(problem, recompute_mode))
    fam.extend(residency.build(problem, residency_mode))
    fam.extend(offload.build(problem, offload_mode))
    problem.families = merge_freed(fam)
    return problem


def merge_freed(fam: Families) -> Families:
    """One `Freed` per item: families that free the same bytes (an activation recomputed or offloaded)
    add their gates to one item, so its bytes are freed once."""
    by_key: dict[str, Freed] = {}
    for f in fam.freed:
        old = by_key.get(f.key)
        if old is None:
            by_key[f.key] = f
        else:
            by_key[f.key] = replace(old, gates=old.gates + f.gates, back=old.back or f.back,
                                    returns=old.returns + f.returns)
    fam.freed = list(by_key.values())
    return fam
