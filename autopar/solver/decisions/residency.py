"""Parameter residency: "keep" or "regather" per parameter (`Plan.residency`), linked per layer.

A parameter stored sharded and gathered for use (layout family: a stored shard, a kept copy)
either keeps the gathered copy from its forward use to its backward ("keep"; with the shard
stored over the data axes this is ZeRO-2's memory and FSDP with reshard_after_forward=False),
or frees it after the forward and gathers it again for the backward ("regather": ZeRO-3, FSDP's
default). The second gather runs while the previous layer's backward computes (FSDP
prefetches it): its transfer costs only what the consumer's backward compute does not hide, and
its launch (the per-collective overhead the device profile names) is paid in full.
"""
from __future__ import annotations

from ...plan import RESIDENCY_MODES
from ..families import Cost, Expr, Families, Group
from ..problem import Problem
from .common import allowed_options, back_row, layer_groups
from .recompute import copy_freed

REGATHER = 1


def build(problem: Problem, setting: str) -> Families:
    allowed = allowed_options("residency", setting, RESIDENCY_MODES)
    groups = layer_groups(problem)
    fam = Families()
    launch = problem.mesh.profile.kernel_overhead + problem.mesh.profile.collective_overhead
    copies: dict[str, list[int]] = {}
    for k, e in enumerate(problem.edges):
        if e.keeps_copy and problem.decisions[e.src].kind == "param":
            copies.setdefault(e.src, []).append(k)
    members: dict[str, list[str]] = {}
    for p in copies:
        members.setdefault(problem.rep.get(p, p), []).append(p)
    for rep, params in members.items():
        key = f"residency:{problem.decisions[rep].fqn}"
        fam.groups.append(Group(key, "residency", RESIDENCY_MODES,
                                tuple(problem.decisions[p].fqn for p in params), allowed))
        if REGATHER not in allowed:
            continue
        for p in params:
            for k in copies[p]:
                e = problem.edges[k]
                fam.freed.append(copy_freed(problem, k, ((key, REGATHER),), back_row(groups, problem.layer.get(e.dst))))
                d = problem.decisions[e.dst]
                hidden = tuple(f - c for c, f in zip(d.compute_s, d.fwd_s))     # minus the consumer's backward
                what = f"re-gather {problem.decisions[p].fqn} for {e.dst}"
                fam.costs += [Cost(Expr(((e.dst, hidden),), ((k, tuple(map(tuple, e.fwd))),)), (key, REGATHER), 1.0, what),
                              Cost(Expr(const=launch), (key, REGATHER), 1.0, what + " (launch)")]
    return fam
