"""The planner choosing the mesh: from a `Cluster` to the best mesh shape, axis roles and plan.

1. one capture of the whole batch gives the model's facts (`mesh_screen.ModelFacts`): its layers,
   FLOPs, parameters, experts, attention and sequence length;
2. `mesh_screen.mesh_candidates` enumerates the meshes whose roles the model can use, and
   `mesh_screen.screen` gives each a lower bound and a quick estimate (with the microbatch count it
   prefers where it pipelines);
   (`pipeline=False`: no "pp" axis);
3. candidates are planned in the order of their estimates by the planner itself, every family on
   auto: a pipelined one by the pipeline search with its axis ("pp") and microbatch count fixed
   (schedule, virtual stages, layouts and memory decisions chosen), the others by one solve; a
   candidate is not planned when its bound is above the best plan found ("pruned"), when its
   estimate is over SCREEN_SLACK times the best estimate, when its estimate scaled by the meshes
   planned so far (their least price over estimate) is over the best plan by more than
   SCREEN_MARGIN, or when the time is out;
4. the fastest plan that fits wins (ties: the earlier candidate); `plan.mesh` records its mesh and
   the cluster, `plan.mesh_search` every candidate with its price or why it was not planned.

`time_limit` bounds the whole search after the model's capture (as `plan()` on a Mesh counts its
time limit from the capture on): the candidates share one deadline, each planned with its slice of
it as its own `time_limit` (`_time_slice`: the SHARED first ones equal shares of the time left, so
that runners-up are planned however slow the machine; the later ones what is left). Each candidate
planned gets its solver's first plans whatever its slice (`floor`: a mesh's price is at least those on
a loaded machine), so a plan may take longer than its slice: until a plan is found a candidate is
planned whatever the time left, so that there is a plan; after that one is started only while the
time left is at least MIN_SLICE_S and what the slowest mesh planned so far took (its floor, the best
guess of the next one's), so that the search ends by the deadline unless the first plan alone takes
longer; the others are "not planned" for the time limit, the report saying how much was left.
Without a time limit the result depends on the inputs alone; with one, on how far the search got
(the report says how many were planned).
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import replace

import torch

from ..cluster import DEVICE_ORDER, Cluster
from ..errors import InfeasibleError, PlanOptionError
from .mesh_screen import ModelFacts, Screened, mesh_candidates, screen
from ..passes.capture import capture
from ..passes.shape_prop import annotate
from .pipeline_search import search_pipeline
from ..plan import MeshCandidate, Plan, Timings
from ..solver.solve import AT_TIME_LIMIT
from .solve import PlanOptions, frozen_gc, solve_captured

log = logging.getLogger("autopar")

SCREEN_SLACK = 2.0       # candidates whose screen estimate is over this many times the best are not planned:
                         # the screen is a rough account (transformer constants, no layout choice), so a
                         # margin of 2x leaves it room to misjudge a contender
MAX_PLANNED = 8          # at most this many candidates are planned (each is one or a few ILP solves)
SHARED = 3               # under a time limit the first this many meshes planned share it (`_time_slice`), so that
                         # the winner is compared with runners-up however slow the machine: planning one mesh
                         # with all of the time gains little (the solver's first plans come in its first seconds)
MIN_SLICE_S = 1.0        # a mesh is not planned in less: capture and problem building alone take about that on a
                         # small model
SCREEN_MARGIN = 0.25     # once meshes are planned, the screen is calibrated by them: a candidate whose estimate
                         # times the least (price / estimate) seen is over the best plan's step by more than
                         # this fraction is not planned. Measured price / estimate: GPT-3 175B 1.246-1.267 over
                         # three meshes; Llama-3-8B at 8 x 8192 on 8 H100 1.47-2.08 over eight, its winner
                         # (dp=2, tp=4) at 1.47 against 1.63 for (dp=8): 25% is over twice that 11% gap


def search_mesh(model: torch.nn.Module, args: tuple, kwargs: dict | None, cluster: Cluster,
                opts: PlanOptions) -> Plan:
    """The best plan over every mesh of `cluster` the model can use (see the module docstring)."""
    if opts.pins or opts.batch_axes:
        raise PlanOptionError("pins and batch_axes name mesh axes: with a Cluster the planner chooses the mesh; "
                              "give a Mesh to pin layouts or to say which axes split the inputs")
    if isinstance(opts.pipeline, Mapping) and opts.pipeline:
        raise PlanOptionError(f"pipeline={dict(opts.pipeline)!r} fixes a pipeline on a mesh's axis: with a Cluster the "
                              f"planner chooses the mesh and its pipeline (pipeline=None or {{}}), or forbids "
                              f"pipelines (pipeline=False); give a Mesh to fix one")
    t0 = time.perf_counter()
    with frozen_gc():
        cap = capture(model, args, kwargs)
        infos = annotate(cap.gm)
        facts = ModelFacts.of(cap, infos)
        budget = opts.memory_budget if opts.memory_budget is not None else cluster.profile.memory_capacity
        degrees = mesh_candidates(cluster.size, cluster.devices_per_node, facts, pipeline=opts.pipeline is not False)
        screened = sorted((screen(cluster, facts, d, budget, opts.optimizer, opts.precision) for d in degrees),
                          key=lambda s: (not s.fits, s.estimate_s))
        # the deadline starts after the capture, as `plan()` on a Mesh starts its own (planner.deadline_of)
        deadline = None if opts.time_limit is None else time.perf_counter() + opts.time_limit
        best, rows, priced = _plan_in_order(model, args, kwargs, cap, infos, screened, opts, deadline)
    if best is None:
        raise InfeasibleError(f"no mesh of {cluster} fits a plan in the memory budget of {budget / 2**30:.2f} GiB "
                              f"per device ({len(rows)} meshes weighed; " + "; ".join(
                                  f"{r.shape}: {r.note}" for r in rows[:3] if r.note) + ")")
    plan, chosen = best
    rows.remove(chosen)
    planned = sorted((r for r in rows if r.status in ("planned", "infeasible")),
                     key=lambda r: (r.step_time_s is None, r.step_time_s or 0.0))
    rest = [r for r in rows if r.status not in ("planned", "infeasible")]
    plan.mesh = dict(plan.mesh, nodes=cluster.nodes, devices_per_node=cluster.devices_per_node,
                     device_order=DEVICE_ORDER)
    plan.mesh_search = [replace(chosen, status="chosen", note=_why(plan, chosen, planned, priced))] + planned + rest
    plan.timings = Timings(plan.timings.solve_s, time.perf_counter() - t0)
    return plan


def _plan_in_order(model, args, kwargs, cap, infos, screened: list[Screened], opts: PlanOptions,
                   deadline: float | None):
    """(the best plan and its row, or None; a row per candidate; (shape, axis names) -> the Estimate of each
    mesh planned, for `_why`) planning `screened` in order."""
    captured = {1: (cap, infos)}        # microbatch count -> (capture of one microbatch, its annotations)
    best: tuple[Plan, MeshCandidate] | None = None
    rows: list[MeshCandidate] = []
    priced: dict[tuple, object] = {}    # (shape, names) -> the Estimate of a mesh planned
    slowest_s, n_planned = 0.0, 0        # the longest a mesh's plan took, and how many were planned
    top = screened[0].estimate_s if screened else math.inf
    scale = math.inf        # the least (price / screen estimate) of the meshes planned
    first_of: dict[tuple, Screened] = {}     # (shape, pipeline axis index) -> the first candidate of that mesh
    for s in screened:
        row = MeshCandidate(s.mesh.shape, s.mesh.axis_names, "not planned", screen_s=_finite(s.estimate_s))
        same = first_of.setdefault(_problem_key(s), s)
        if same is not s:
            rows.append(replace(row, note=f"the same mesh as {_label(same.mesh)}, planned as that one (the names "
                                          f"of axes other than pp are labels: the planner chooses what every op "
                                          f"does on each axis)"))
            continue
        limit = _time_slice(deadline, n_planned)
        skip = None if best is None else _skipped(s, best[0].estimate.step_time_s, n_planned, top, scale,
                                                  _left(deadline), slowest_s)
        if skip is not None:
            rows.append(replace(row, status=skip[0], note=skip[1]))
            continue
        t = time.perf_counter()
        log.info("mesh search: planning %s (screen %.4g s, bound %.4g s, time limit %s)", _label(s.mesh),
                 s.estimate_s, s.bound_s, "none" if limit is None else f"{limit:.1f} s")
        plan = _plan_one(model, args, kwargs, captured, s, opts, limit)
        slowest_s, n_planned = max(slowest_s, time.perf_counter() - t), n_planned + 1
        if isinstance(plan, str):
            rows.append(replace(row, status="infeasible", note=plan))
            continue
        e = priced[s.mesh.shape, s.mesh.axis_names] = plan.estimate
        row = replace(row, status="planned", step_time_s=e.step_time_s, peak_memory_bytes=e.peak_memory_bytes,
                      note=_shape_note(plan) + _cut_short(plan, limit))
        rows.append(row)
        if 0 < s.estimate_s < math.inf:
            scale = min(scale, e.step_time_s / s.estimate_s)
        if best is None or e.step_time_s < best[0].estimate.step_time_s * (1 - 1e-12):
            best = (plan, row)
    return best, rows, priced


def _time_slice(deadline: float | None, n_planned: int) -> float | None:
    """The time limit of the next mesh's plan: of the time left, an equal share among the SHARED first
    meshes planned still to come (the first gets 1/SHARED, the second 1/(SHARED - 1) of what is left, ...),
    all of it after them; None without a deadline."""
    left = _left(deadline)
    return None if left is None else left / max(SHARED - n_planned, 1)


def _left(deadline: float | None) -> float | None:
    """Seconds left to the search's deadline (None: no limit)."""
    return None if deadline is None else max(deadline - time.perf_counter(), 0.0)


def _skipped(s: Screened, best_s: float, n_planned: int, top: float, scale: float, left: float | None,
             slowest_s: float) -> tuple[str, str] | None:
    """(status, why) where candidate `s` is not planned (a plan of `best_s` seconds found already;
    `scale`: the least price over screen estimate of the meshes planned; `left`: the seconds left to the
    search's deadline; `slowest_s`: the longest a mesh's plan took so far)."""
    if s.bound_s >= best_s:
        return "pruned", f"its lower bound {s.bound_s:.4g} s is above the best plan's step"
    if n_planned >= MAX_PLANNED:
        return "not planned", f"{MAX_PLANNED} meshes planned already"
    if s.estimate_s > SCREEN_SLACK * top:
        return "not planned", f"its screen estimate is over {SCREEN_SLACK:g}x the best one's"
    if s.estimate_s * scale > best_s * (1 + SCREEN_MARGIN):
        return "not planned", (f"its screen estimate scaled as the planned meshes' prices (x{scale:.3g}) is "
                               f"{s.estimate_s * scale / best_s - 1:.1%} over the best plan's step")
    if left is not None and left < max(MIN_SLICE_S, slowest_s):
        need = (f"the {slowest_s:.1f} s the slowest mesh's plan took" if slowest_s > MIN_SLICE_S else
                f"the {MIN_SLICE_S:g} s a mesh's plan takes at least")
        return "not planned", f"the time limit: {left:.1f} s left, less than {need}"
    return None


def _problem_key(s: Screened) -> tuple:
    """What planning a candidate depends on: its axis sizes in order on the devices (each axis's links follow
    from them) and which is the pipeline's; the names of the others are labels."""
    names = s.mesh.axis_names
    return s.mesh.shape, names.index("pp") if "pp" in names else None


def _plan_one(model, args, kwargs, captured: dict, s: Screened, opts: PlanOptions, limit: float | None):
    """The planner's best plan on candidate `s`'s mesh within `limit` seconds (its public `time_limit`), or
    why none fits (text)."""
    sub = replace(opts, time_limit=limit, symbolic=False, pipeline=False)
    try:
        if s.degrees["pp"] > 1:
            return search_pipeline(model, args, kwargs, s.mesh, replace(sub, pipeline={"axis": "pp"}),
                                   {"axis": "pp", "microbatches": s.microbatches}, captured=captured)
        # floor: the solver's first plans (the most sharded, the LP relaxation's layouts rounded) whatever the
        # slice, so that a mesh's plan is at least those however loaded the machine (Llama-3-8B at 8 x 8192 over
        # (8,): 1.105 s, its best known, in 4.4 CPU s; a third of 120 s at a load of 30 stopped at 1.269 s); the
        # capture's annotations reused. Not the plan cache: its key holds the slice, a figure of the clock.
        cap, infos = captured[1]
        return solve_captured(cap, s.mesh, sub, time.perf_counter(), (model, args, kwargs), infos=infos, floor=True)
    except InfeasibleError as e:
        log.info("mesh %s %s: no plan fits (%s)", s.mesh.shape, s.mesh.axis_names, e)
        return f"no plan fits the memory budget ({str(e).split(';')[0][:160]})"


def _shape_note(plan: Plan) -> str:
    pp = plan.pipeline
    if pp.stages <= 1:
        return "no pipeline"
    return (f"{pp.stages} stages x {pp.virtual_stages} virtual, {pp.microbatches} microbatches, {pp.schedule}; "
            f"bubble {plan.estimate.bubble_s:.3f} s")


def _cut_short(plan: Plan, limit: float | None) -> str:
    """Where the mesh's plan stopped at its time limit, saying so: its price is of the plan found by then."""
    if plan.solver is None or AT_TIME_LIMIT not in plan.solver.status:
        return ""
    within = "" if limit is None else f" ({limit:.1f} s)"
    return f"; stopped at its time limit{within}: a longer time_limit may find it a faster plan"


def _why(plan: Plan, chosen: MeshCandidate, planned: list[MeshCandidate], priced: dict) -> str:
    """Why the winner won: its margin over the runner-up, and the parts of their steps that differ most."""
    base = _shape_note(plan)
    runner = next((r for r in planned if r.step_time_s is not None), None)
    if runner is None:
        return f"{base}; the only mesh planned"
    gap = runner.step_time_s / chosen.step_time_s - 1
    parts = _parts(priced[runner.shape, runner.axis_names]), _parts(plan.estimate)
    diffs = sorted(((r - w, name) for name, r, w in zip(PARTS, *parts) if abs(r - w) > 0), key=lambda d: -abs(d[0]))
    where = ", ".join(f"{name} {abs(d):.3g} s {'less' if d > 0 else 'more'}" for d, name in diffs[:2])
    return (f"{base}; fastest predicted step of {sum(r.status == 'planned' for r in planned) + 1} meshes planned, "
            f"{gap:.1%} ahead of {_label(runner)} ({runner.step_time_s:.4g} s)" + (f": {where}" if where else ""))


PARTS = ("compute", "communication", "pipeline bubble", "recompute/residency/offload")


def _parts(e) -> tuple[float, ...]:
    """An estimate's step in PARTS (the evaluator's own breakdown; they overlap where it overlaps them)."""
    return e.compute_s, e.comm_s, e.bubble_s, sum(e.family_s.values())


def _label(r) -> str:       # a MeshCandidate or a Mesh
    return "(" + ", ".join(f"{n}={s}" for n, s in zip(r.axis_names, r.shape)) + ")"


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


__all__ = ["search_mesh", "SCREEN_SLACK", "SCREEN_MARGIN", "MAX_PLANNED"]
