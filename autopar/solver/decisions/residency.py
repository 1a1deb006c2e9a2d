"""Parameter residency: "keep" or "regather" (`Plan.residency`, per parameter FQN), decided per
layer as FSDP wraps a block (all its gathered parameters alike; repeated layers linked), and per
parameter outside the layers.

A parameter stored sharded and gathered for use (layout family: a stored shard, a kept copy)
either keeps the gathered copy from its forward use to its backward ("keep"; with the shard
stored over the data axes this is ZeRO-2's memory and FSDP with reshard_after_forward=False),
or frees it after the forward and gathers it again for the backward ("regather": ZeRO-3, FSDP's
default). The second gather is priced as the runtime runs it (`runtime/regather.py`): when the
backward needs the copy, not prefetched behind the previous layer's backward (FSDP's prefetch is
not built yet, so no overlap is assumed): the forward gather's seconds once more.
"""
from __future__ import annotations

from ...plan import RESIDENCY_MODES
from ..families import Cost, Expr, Families, Group
from ..problem import Problem
from .common import allowed_options, layer_groups
from .recompute import copy_freed

REGATHER = 1


def build(problem: Problem, setting: str) -> Families:
    allowed = allowed_options("residency", setting, RESIDENCY_MODES)
    groups = layer_groups(problem)
    fam = Families()
    copies: dict[str, list[int]] = {}
    for k, e in enumerate(problem.edges):
        if e.keeps_copy and problem.decisions[e.src].kind == "param":
            copies.setdefault(e.src, []).append(k)
    members: dict[str, list[str]] = {}
    for p in copies:
        layer = problem.layer.get(p)
        members.setdefault(groups.rep[layer] if layer in groups.rep else problem.decisions[p].fqn, []).append(p)
    for rep, params in members.items():
        key = f"residency:{rep}"
        fam.groups.append(Group(key, "residency", RESIDENCY_MODES,
                                tuple(problem.decisions[p].fqn for p in params), allowed))
        if REGATHER not in allowed:
            continue
        for p in params:
            for k in copies[p]:
                e = problem.edges[k]
                # gathered again for the consumer's backward
                fam.freed.append(copy_freed(problem, k, ((key, REGATHER),), problem.live.backward_of(e.dst_pos) - 1))
                fam.costs.append(Cost(Expr((), ((k, tuple(map(tuple, e.fwd))),)), (key, REGATHER), 1.0,
                                      f"re-gather {problem.decisions[p].fqn} for {e.dst}"))
    return fam
