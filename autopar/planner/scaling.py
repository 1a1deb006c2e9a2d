"""A plan's costs as functions of batch size and sequence length.

The chosen layouts are priced once more with the graph's sizes as sympy expressions in `B` and
`S` (`passes/symbolic_shapes.py`): `build_problem(..., only=chosen)` prices the one chosen
strategy per node through the planner's own code, the plan's memory decisions are added back
(`solver.decisions`) with what the planning problem worked out over every layout it weighs
(`Planned`), and `solver.evaluate` sums it all, so
at the captured sizes the expressions give exactly the plan's estimate. The results are saved in
the plan (`Plan.scaling`) as text:

    compute_s(B, S), comm_s(B, S)     sums over ops and edges (roofline maxima stay `Max(...)`)
    other_s(B, S)                     the memory decisions' seconds (recomputation, offload copies, ...),
                                      the optimizer step and the runtime's per-node cost
    state_bytes                       parameters, gradients, optimizer state (no B or S)
    memory_points(B, S)               bytes at each liveness point that can be the peak: a point
                                      whose polynomial is <= another's in every coefficient is
                                      never above it (B, S > 0) and is dropped

`Plan.estimate_at(batch=, seq=)` evaluates them; `Plan.largest_batch()` searches the batch sizes
that keep every split even for the largest whose peak fits the budget.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from torch.distributed.tensor import Shard

from ..symbolic import Poly2, ssum
from ..plan_records import Scaling
from ..solver.decisions import add_families
from ..solver.decisions.residency import FlatGathers, flat_gathers
from ..solver.families import Expr
from ..solver.evaluate import evaluate, recorded_options
from ..solver.problem import Problem, build_problem, chosen_edges, edge_legs, op_exchanges

__all__ = ["build_scaling", "Planned"]


@dataclass(frozen=True, slots=True)
class Planned:
    """What the planning problem works out over every layout it weighs, which a problem of one plan's
    layouts (`build_problem(only=)`) cannot: the flat parameter gathers (`residency.flat_gathers`: a
    layer the plan gathers in part), the most bytes the gradient buckets can take and the position from
    which they hold buffers (`Problem.bucketable`, `Problem.buckets_from`: the buffers' sizes and the
    gradients offload takes out of them). None of them varies with batch or sequence."""
    flat: FlatGathers
    bucketable: float
    buckets_from: int

    @classmethod
    def of(cls, problem: Problem) -> Planned:
        return cls(flat_gathers(problem), problem.bucketable, problem.buckets_from)


def build_scaling(cap, mesh, only, sym, opts, budget: float, decided: dict, planned: Planned) -> Scaling:
    """Scaling of the plan that picks the strategies `only` (node -> Strategy) on `mesh`, from the
    symbolic graph `sym` (SymbolicGraph), with the memory decisions `decided` (family -> {plan key ->
    option}, as the plan records them) and what its planning problem worked out over every layout
    (`planned`), so that the plan is priced as the planner priced it."""
    sp = build_problem(cap, sym.infos, mesh, only=only, optimizer=opts.optimizer,
                       batch_axes=opts.batch_axes, sharded_outputs=opts.sharded_outputs, precision=opts.precision,
                       saved_frees=opts.frees_activations, capacity_factor=opts.moe_capacity_factor)
    sp.bucketable, sp.buckets_from = planned.bucketable, planned.buckets_from
    one = {name: 0 for name in sp.decisions}
    add_families(sp, recompute_mode=opts.recompute, residency_mode=opts.residency, offload_mode=opts.offload,
                 flat=planned.flat)
    # memory is polynomial: priced on coefficient arrays, the same liveness sums as the planner's
    poly = functools.lru_cache(maxsize=None)(Poly2.of)
    for d in sp.decisions.values():
        for f in ("act_bytes", "state_bytes", "grad_bytes", "opt_bytes", "bwd_temp"):
            setattr(d, f, [poly(x) for x in getattr(d, f)])
    for e in sp.edges:
        e.saved = [[poly(x) for x in row] for row in e.saved]
        e.temp = [[poly(x) for x in row] for row in e.temp] if e.temp else None
        e.grad_temp = [[poly(x) for x in row] for row in e.grad_temp] if e.grad_temp else None
    fam = sp.families       # bytes the families free and hold, as polynomials too (their seconds stay sympy)
    fam.freed = [replace(f, expr=_poly_expr(f.expr, poly)) for f in fam.freed]
    fam.held = [replace(h, expr=_poly_expr(h.expr, poly)) for h in fam.held]
    ev = evaluate(sp, one, recorded_options(sp.families, decided))
    other = ssum([*ev.family_s.values(), ev.grad_buckets_s, ev.optimizer_s, ev.runtime_s])
    points = [*ev.points, ev.state_bytes]
    per_axis = {ax: [] for ax in mesh.axis_names}
    metas = {name: info.out[0] for name, info in sym.infos.items() if info.out}
    for c in chosen_edges(sp, one, cap, metas):
        for _, rc in edge_legs(sp, c):
            for ax, nbytes in zip(mesh.axis_names, rc.bytes_per_axis):
                per_axis[ax].append(nbytes)
    for node in cap.gm.graph.nodes:         # collectives an op runs inside itself, as planner.communication
        d = sp.decisions.get(node.name)
        if d is not None and d.kind == "op":
            for *_, sent, ax in op_exchanges(sp, node, d.strategies[one[d.leader]], metas):
                per_axis[ax].append(sent)
    return Scaling(batch=sym.batch, seq=sym.seq, fixed=sym.fixed, compute_s=str(ev.compute_s), comm_s=str(ev.comm_s),
                   other_s=str(other), state_bytes=str(ev.state_bytes.to_expr()),
                   memory_points=tuple(str(p.to_expr()) for p in _undominated(points, sym)),
                   divisible=_divisibility(sp, only, sym),
                   comm_bytes_per_axis={ax: str(ssum(v)) for ax, v in per_axis.items()},
                   memory_budget=float(budget))


def _poly_expr(expr: Expr, poly) -> Expr:
    return Expr(tuple((n, tuple(poly(v) for v in vals)) for n, vals in expr.nodes),
                tuple((k, tuple(tuple(poly(v) for v in row) for row in t)) for k, t in expr.edges), poly(expr.const))


def _undominated(points: list[Poly2], sym) -> list[Poly2]:
    """Memory points that some sizes can make the peak (see the module docstring)."""
    b0, s0 = sym.batch, sym.seq or 1
    kept: list[Poly2] = []
    for p in sorted(points, key=lambda p: -p.at(b0, s0)):
        if not any(p.dominated_by(k) for k in kept):
            kept.append(p)
    return kept


def _divisibility(sp: Problem, only, sym) -> tuple[tuple[str, int], ...]:
    """(size expression, parts) for every split dim whose size varies with B or S."""
    sizes = sp.mesh.shape
    conds = set()
    for name, s in only.items():
        metas = [sym.infos[name].out[0]] if sym.infos[name].out else []
        metas += [sym.infos[a.name].out[0] for a in sym.infos[name].ins if a.name in sym.infos]
        layouts = [s.output] + list(s.inputs)
        for meta, layout in zip(metas, layouts):
            parts: dict[int, int] = {}
            for p, n in zip(layout, sizes):
                if isinstance(p, Shard):
                    parts[p.dim] = parts.get(p.dim, 1) * n
            for d, n in parts.items():
                e = meta.shape[d]
                if n > 1 and getattr(e, "free_symbols", None):
                    conds.add((str(e), n))
    return tuple(sorted(conds))
