"""Residency of gathered copies: "keep" or "regather" (`Plan.residency`).

A tensor stored sharded and gathered for use keeps the gathered copy from its forward use to its
backward ("keep") or frees it after the forward and gathers it again for the backward
("regather"). Two kinds of copies, one mechanism (`runtime/regather.py`):

* a parameter (key: its FQN), decided per layer as FSDP wraps a block (all its gathered parameters
  alike; repeated layers linked), and per parameter outside the layers. With the shard stored over
  the data axes, "keep" is ZeRO-2's memory (FSDP with reshard_after_forward=False) and "regather"
  ZeRO-3 / FSDP's default;
* an activation all-gathered before an op that saves it (key "activations:<layer>", or
  "activations:<node>" for a consumer outside the layers): Megatron sequence parallelism
  (Korthikanti et al. 2022) keeps a column-parallel matmul's input sequence-sharded over the
  tensor-parallel axis and all-gathers it again in the backward, so the saved input is 1/tp of the
  gathered one. Only the copies whose reshard gathers some axis (Shard -> Replicate) are candidates;
  the pre-gather shard stays saved (the liveness model counts it saved by the consumer already).

The second gather is priced as the runtime runs it: when the backward needs the copy, not
prefetched behind the previous op's backward (no overlap assumed): the forward gather's seconds
once more, for the layout pairs that gather.
"""
from __future__ import annotations

from ...plan import ACTIVATIONS, RESIDENCY_MODES
from ..families import Cost, Expr, Families, Group
from ..problem import Problem
from .common import Masked, allowed_options, layer_groups
from .recompute import copy_freed

REGATHER = 1


def build(problem: Problem, setting: str) -> Families:
    allowed = allowed_options("residency", setting, RESIDENCY_MODES)
    groups = layer_groups(problem)
    fam = Families()
    edges: dict[str, list[tuple[int, tuple | None]]] = {}   # group -> (edge, [a][b] gathers? or None: all)
    names: dict[str, list[str]] = {}                        # group -> the plan keys it decides
    for k, e in enumerate(problem.edges):
        if not e.keeps_copy:
            continue
        src, mask = problem.decisions[e.src], None
        if src.kind == "param":
            layer = problem.layer.get(e.src)
            rep, member = (groups.rep[layer] if layer in groups.rep else src.fqn), src.fqn
        elif src.kind == "op" and any(map(any, mask := e.gathers)):
            layer = problem.layer.get(e.dst)
            rep = ACTIVATIONS + (groups.rep[layer] if layer in groups.rep else e.dst)
            member = ACTIVATIONS + (layer or e.dst)
        else:
            continue
        edges.setdefault(rep, []).append((k, mask))
        if member not in names.setdefault(rep, []):
            names[rep].append(member)
    masks = Masked()
    for rep, items in edges.items():
        key = f"residency:{rep}"
        fam.groups.append(Group(key, "residency", RESIDENCY_MODES, tuple(names[rep]), allowed))
        if REGATHER not in allowed:
            continue
        for k, mask in items:
            e = problem.edges[k]
            # freed after the consumer runs, gathered again for its backward
            fam.freed.append(copy_freed(problem, k, ((key, REGATHER),), problem.live.backward_of(e.dst_pos) - 1,
                                        masks(e.saved, mask)))
            fam.costs.append(Cost(Expr((), ((k, masks(e.fwd, mask)),)), (key, REGATHER), 1.0,
                                  f"re-gather {problem.decisions[e.src].fqn or e.src} for {e.dst}"))
    return fam
