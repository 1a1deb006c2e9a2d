"""Activation recomputation per layer: "none", "selective" or "full" (`Plan.recompute`).

* full: the layer keeps only its inputs; every tensor it made and saved for its backward is
  freed after its last forward use, and the whole forward of the layer (compute and the
  collectives inside it, parameter gathers included) runs again before its backward;
* selective: as full, but the outputs of matrix multiplications are kept
  (`cost_model.recompute.SELECTIVE_SAVED_OPS`), so only the other ops run again;
* from the layer's backward on, its freed tensors exist again (the `Freed` window ends there).
The runtime runs it with `torch.utils.checkpoint` (`runtime/checkpoint.py`). A gathered copy the
residency family re-gathers ("regather") is not gathered a third time: the recomputation takes the
backward's re-gather (a layer's parameters: its one flat gather, `runtime/layer_gather.py`; they reach
the checkpointed region as its inputs, which checkpoint saves through the re-gathering hooks; an
activation's: the gather re-run inside the region is the re-gather), so the forward's gathers again
are priced here only where that copy is kept (`Cost.unless`).
"""
from __future__ import annotations

from dataclasses import replace

from ...cost_model.recompute import saved_under_selective
from ...plan_records import RECOMPUTE_MODES
from ..families import Cost, Expr, Families, Freed, Group
from ..problem import Problem
from .common import REGATHER, Masked, allowed_options, before_backward, edges_by, layer_groups, residency_of, \
    saved_only_in

SELECTIVE, FULL = 1, 2


def build(problem: Problem, setting: str) -> Families:
    allowed = allowed_options("recompute", setting, RECOMPUTE_MODES)
    groups = layer_groups(problem)
    saved = saved_only_in(problem)
    fam = Families()
    into, masks = edges_by(problem, "dst"), Masked()
    for rep, layers in groups.members.items():
        key = f"recompute:{rep}"
        fam.groups.append(Group(key, "recompute", RECOMPUTE_MODES, layers, allowed))
        if allowed == (0,):
            continue
        full, sel, again = forward_expr(problem, groups.nodes[rep], into, masks, groups)
        fam.costs += [Cost(full, (key, FULL), len(layers), f"recompute {rep} (full)"),
                      Cost(sel, (key, SELECTIVE), len(layers), f"recompute {rep} (selective)")]
        fam.costs += [Cost(expr, (key, mode), len(layers), f"recompute {rep}: the copies of {residency} gathered again",
                           unless=((residency, REGATHER),))
                      for residency, expr in again.items() for mode in (FULL, SELECTIVE)]
        for layer in layers:
            fam.freed += freed_in(problem, layer, groups.nodes[layer], saved.get(layer, ()), key,
                                  before_backward(problem, groups, layer), into, masks)
    return fam


def _edges_into(into: dict[str, list[int]], names) -> list[int]:
    """The indices of the edges into any of `names`, in the problem's edge order."""
    return sorted(k for n in dict.fromkeys(names) for k in into.get(n, ()))


def forward_expr(problem: Problem, names, into: dict[str, list[int]], masks: Masked,
                 groups) -> tuple[Expr, Expr, dict[str, Expr]]:
    """Seconds of a layer's forward run again: (all of it, all but the ops selective recomputation keeps,
    both without the gathers of copies a residency decision governs; those gathers by that decision's
    group); `into`: `edges_by(problem, "dst")`; `groups`: `layer_groups(problem)`."""
    full, sel = [], []
    for n in names:
        d = problem.decisions[n]
        if d.kind == "op" and any(d.fwd_s):
            full.append((n, tuple(d.fwd_s)))
            if not saved_under_selective(d.facts.op):
                sel.append((n, tuple(d.fwd_s)))
    comm, again = [], {}
    for k in _edges_into(into, names):
        fwd, decided = problem.edges[k].fwd, residency_of(problem, groups, k)
        if decided is None:
            comm.append((k, masks(fwd)))
            continue
        residency, _, mask = decided
        again[residency] = again.get(residency, Expr()) + Expr((), ((k, masks(fwd, mask)),))
        if mask is not None:        # the pairs that do not gather: no residency decision, gathered again
            comm.append((k, masks(fwd, mask, keep=False)))
    comm = tuple(comm)
    return Expr(tuple(full), comm), Expr(tuple(sel), comm), again


def freed_in(problem: Problem, layer: str, names, saved, key: str, until: int,
             into: dict[str, list[int]], masks: Masked) -> list[Freed]:
    """What recomputing `layer` frees until its backward (timeline position `until`): tensors it
    made and only it saves (`saved`: what only it saves), and the resharded copies its ops keep
    (parameters gathered for them, activations gathered or reduced for them: made again when it
    runs again; `into`: `edges_by(problem, "dst")`)."""
    live, inside = problem.live, set(names)
    out = []
    for o in saved:
        if o not in inside:          # made before the layer: its input, which the checkpoint keeps
            continue
        d = problem.decisions[o]
        gates = ((key, FULL),) + (() if saved_under_selective(d.facts.op) else ((key, SELECTIVE),))
        out.append(Freed(Expr(((o, tuple(d.act_bytes)),)), gates, live.fwd_end[o], until,
                         f"activation {o} of {layer}", f"act:{o}"))
    gates = ((key, FULL), (key, SELECTIVE))
    for k in _edges_into(into, names):
        e = problem.edges[k]
        if e.keeps_copy and problem.decisions[e.src].kind == "param":
            out.append(copy_freed(problem, k, gates, until, masks(e.saved)))
        elif e.keeps_copy and problem.decisions[e.src].kind == "op":
            out += [replace(f, gates=gates, until=until) for f in activation_copy(problem, k, masks)]
    return out


def activation_copies(problem: Problem, names, into: dict[str, list[int]], masks: Masked) -> list[tuple[int, Freed]]:
    """(edge, item) for each resharded copy of an activation that the ops `names` keep for their
    backward (`activation_copy`), in the problem's edge order."""
    return [(k, f) for k in _edges_into(into, names)
            if problem.edges[k].keeps_copy and problem.decisions[problem.edges[k].src].kind == "op"
            for f in activation_copy(problem, k, masks)]


def source_replaced(problem: Problem, k: int, into: dict[str, list[int]], masks: Masked
                    ) -> tuple[str, tuple[tuple[float, ...], ...]] | None:
    """Where the one op that saves an activation saves resharded copies of it instead (edge k the first
    of its edges from the activation or its views into that op): (the activation, an [a][b] table on k of
    its bytes where every such edge keeps a copy, else 0). The liveness model keeps the activation saved
    for that op as well (docs/architecture.md, Known limits), but what the op saves at run time, and what
    activation offload moves, is the copies alone. None where the activation has other savers, or the
    table is not a function of k's pair. `into`: `edges_by(problem, "dst")`; `masks` holds the tables
    made (a linked layer's copies, and the layer groups' representatives, mostly share them)."""
    e, live = problem.edges[k], problem.live
    lead = problem.decisions[e.src].leader
    # the activation: the edge's source, or the one whose view it is (a view follows its source's leader)
    found = [o for o in ((e.src,) if e.src in live.defined else live.owners)
             if live.savers.get(o) == (e.dst,) and problem.decisions[o].kind == "op"
             and problem.decisions[o].leader == lead]
    if len(found) != 1:
        return None
    o = found[0]
    ks = [j for j in into[e.dst] if problem.decisions[problem.edges[j].src].kind == "op"
          and problem.decisions[problem.edges[j].src].leader == lead
          and (problem.edges[j].src == o or problem.edges[j].src not in live.defined)]
    if ks[0] != k:
        return None
    xs, act = [problem.edges[j] for j in ks], problem.decisions[o].act_bytes
    key = ("replaced", tuple(act), tuple((id(x.saved), tuple(x.a_of), tuple(x.b_of)) for x in xs))
    table = masks.once(key, tuple(x.saved for x in xs), lambda: _replaced_table(xs, act))
    return None if table is None else (o, table)


def _replaced_table(xs, act) -> tuple[tuple[float, ...], ...] | None:
    """`source_replaced`'s table on the first of the edges `xs` (`act`: the activation's bytes per
    strategy), or None where it is not a function of that edge's pair."""
    e = xs[0]
    table: dict[tuple[int, int], float] = {}
    for i, a in enumerate(e.a_of):
        for j, b in enumerate(e.b_of):
            copied = all(x.saved[x.a_of[i]][x.b_of[j]] > 0 for x in xs)
            v = act[i] if copied else 0.0
            if table.setdefault((a, b), v) != v:
                return None
    return tuple(tuple(table.get((a, b), 0.0) for b in range(len(row))) for a, row in enumerate(e.saved))


def activation_copy(problem: Problem, k: int, masks: Masked) -> tuple[Freed, Freed]:
    """The resharded copy of an activation edge k keeps for its consumer's backward, as two items: the
    gathered pairs, which residency may free too (one item, `merge_freed`), and the rest; no gates, freed
    until the consumer's backward (callers set both)."""
    e = problem.edges[k]
    until = problem.live.backward_of(e.dst_pos) - 1
    return (copy_freed(problem, k, (), until, masks(e.saved, e.gathers)),
            replace(copy_freed(problem, k, (), until, masks(e.saved, e.gathers, keep=False)), key=f"copy:{k}:other"))


def copy_freed(problem: Problem, k: int, gates, until: int, table) -> Freed:
    """The resharded copy edge k keeps for its consumer's backward (its [a][b] bytes: `table`, all or
    part of `e.saved`), freed after the consumer runs and made again at timeline position `until` + 1."""
    e = problem.edges[k]
    return Freed(Expr((), ((k, table),)), tuple(gates), e.dst_pos, until,
                 f"gathered {problem.decisions[e.src].fqn or e.src} for {e.dst}", f"copy:{k}")
