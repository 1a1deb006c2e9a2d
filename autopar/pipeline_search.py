"""The planner choosing a pipeline: `search_pipeline` runs the stage family's search
(`solver/decisions/stages.py`) with the planner's own capture, problem and ILP per candidate, and
makes the winner a Plan priced by the one evaluator.

Each (pipeline axis, microbatch count) is one capture of one microbatch and one ILP on the mesh
without the pipeline axis; the ILP sees the whole model on one device, so its memory budget is the
budget times the stage count (a rank holds about 1/stages of the parameters); the evaluator then
checks every rank's memory against the real budget.
"""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Mapping
from dataclasses import replace

import torch

from .compat import pytree
from .errors import InfeasibleError, PlanOptionError
from .mesh import Mesh
from .passes.capture import capture
from .passes.layers import layer_key
from .passes.stages import microbatch
from .passes.shape_prop import annotate
from .plan import PIPELINE_SCHEDULES, Plan, SolverInfo, Timings
from .pipelining import fixed_pipeline, lifted, stage_options
from .planner import PlanOptions, assemble, deadline_of, frozen_gc, planning_problem, remaining
from .solver.decisions.stages import PIPELINE_KEYS, candidates, choose_pipeline, node_chunks, per_step_view
from .solver.evaluate import Staging
from .solver.ilp import AT_TIME_LIMIT, solve

log = logging.getLogger("autopar")


def search_pipeline(model: torch.nn.Module, args: tuple, kwargs: dict | None, mesh: Mesh, opts: PlanOptions,
                    fixed: Mapping, captured: dict[int, tuple] | None = None) -> Plan:
    """The fastest plan, pipelined or not, whose every pipeline rank fits the budget; `fixed`: the
    pipeline keys the user gave (the rest are chosen); `captured`: microbatch count -> (capture of one
    microbatch, its annotations) made already (filled with those the search makes)."""
    with frozen_gc():
        return _search(model, args, kwargs, mesh, opts, fixed, captured)


def _search(model: torch.nn.Module, args: tuple, kwargs: dict | None, mesh: Mesh, opts: PlanOptions,
            fixed: Mapping, captured: dict[int, tuple] | None) -> Plan:
    t0 = time.perf_counter()
    deadline = deadline_of(opts)        # every candidate's solve within the one time limit
    _check(fixed, mesh)
    budget = opts.memory_budget if opts.memory_budget is not None else mesh.profile.memory_budget
    n_layers = len({k for name, _ in model.named_parameters() if (k := layer_key(name))})
    batch = _batch(args, kwargs)
    cands = candidates(mesh, batch, opts.batch_axes, n_layers, fixed)
    if not cands:
        raise PlanOptionError(f"pipeline={dict(fixed)}: no pipeline of this mesh {mesh.axis_names} {mesh.shape}, "
                              f"batch {batch} and {n_layers} layers has these settings (pipeline.stages x "
                              f"pipeline.virtual_stages chunks need a layer each; pipeline.microbatches must divide "
                              f"the batch of one pipeline)")
    captured = {} if captured is None else captured
    stage_opts = replace(opts, symbolic=False)
    problems: dict[tuple, object] = {}      # (axis, microbatches) -> its problem (re-solved at tighter budgets)
    statuses: dict[tuple, str] = {}         # (axis, microbatches) -> its last solve's status

    def solve_at(axis, m, scale):
        if m not in captured:
            cap = capture(model, *microbatch(args, kwargs, m))
            captured[m] = (cap, annotate(cap.gm))
            gc.freeze()       # kept for the whole search (`frozen_gc`)
        cap, infos = captured[m]
        sub = mesh.stage_mesh(axis)
        stages = 1 if axis is None else mesh.shape[mesh.axis_index(axis)]
        if (axis, m) not in problems:
            problems[axis, m] = planning_problem(cap, infos, sub, _stage_opts(stage_opts, mesh, axis))
            gc.freeze()
        problem = problems[axis, m]
        try:
            result = solve(per_step_view(problem, m), budget * stages * scale, remaining(deadline))
        except InfeasibleError as e:
            log.info("pipeline candidate axis=%s microbatches=%d: infeasible (%s)", axis, m, e)
            return None
        statuses[axis, m] = result.status
        return problem, result.choice, result.options, cap.gm.graph

    def out_of_time() -> bool:
        return deadline is not None and time.perf_counter() >= deadline

    best, least = choose_pipeline(mesh, cands, solve_at, budget, out_of_time)
    if best is None:
        raise InfeasibleError(f"no pipeline of {len(cands)} candidates fits the budget of {budget / 2**30:.2f} GiB "
                              f"per device; the least memory one needs is {least / 2**30:.2f} GiB", least)
    c = best.candidate
    cap = captured[c.microbatches][0]
    sub = mesh.stage_mesh(c.axis)
    staging = Staging(best.pipeline, node_chunks(best.problem, cap.gm.graph, best.pipeline),
                      mesh.axes[mesh.axis_index(c.axis)].link if c.axis is not None else None)
    plan = assemble(cap, best.problem, best.choice, sub, _stage_opts(stage_opts, mesh, c.axis), best.options,
                    staging if c.stages > 1 else None)
    if c.axis is not None:
        plan = lifted(plan, mesh, mesh.axis_index(c.axis), opts, best.pipeline)
    plan = replace(plan, options=opts.to_dict(), pipeline=best.pipeline)
    plan.solver = SolverInfo("search", _status(cands, statuses, c, out_of_time()), 0, 0, plan.estimate.step_time_s,
                             len(best.problem.leaders), len(best.problem.order), len(best.problem.rep))
    plan.timings = Timings(0.0, time.perf_counter() - t0)
    return plan


def _status(cands, statuses: dict[tuple, str], chosen, timed_out: bool) -> str:
    """The search's outcome in words (`solver.ilp.status_words`): the chosen pipeline's own solve's
    status, and how many of the (axis, microbatch count) groups were solved."""
    groups = len(dict.fromkeys((c.axis, c.microbatches) for c in cands))
    own = statuses.get((chosen.axis, chosen.microbatches), "")
    head = AT_TIME_LIMIT if timed_out or own.startswith(AT_TIME_LIMIT) else "the best pipeline found"
    return (f"{head}: {len(statuses)} of {groups} (axis, microbatch count) candidates solved, the chosen one's "
            f"layouts {own}")


def _check(fixed: Mapping, mesh: Mesh) -> None:
    """The keys given, each checked (a PlanOptionError naming it); a full pipeline by
    `pipelining.fixed_pipeline`, which also checks the keys against each other."""
    unknown = sorted(set(fixed) - set(PIPELINE_KEYS))
    if unknown:
        raise PlanOptionError(f"pipeline: unknown key(s) {unknown}; the keys are {', '.join(PIPELINE_KEYS)}")
    if fixed.get("axis") is not None:
        if all(k in fixed for k in ("axis", "stages", "microbatches", "schedule")):
            fixed_pipeline(fixed, mesh)
        elif fixed["axis"] not in mesh.axis_names:
            raise PlanOptionError(f"pipeline.axis = {fixed['axis']!r} is not an axis of the mesh {mesh.axis_names}")
    if "schedule" in fixed and fixed["schedule"] not in PIPELINE_SCHEDULES:
        raise PlanOptionError(f"pipeline.schedule = {fixed['schedule']!r} is not one of {', '.join(PIPELINE_SCHEDULES)}")
    for key in ("stages", "virtual_stages", "microbatches"):
        v = fixed.get(key, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PlanOptionError(f"pipeline.{key} = {v!r}: give a positive int")


def _batch(args, kwargs) -> int:
    leaves = pytree.tree_leaves((args, kwargs or {}))
    return next((t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.ndim >= 1), 1)


def _stage_opts(opts: PlanOptions, mesh: Mesh, axis: str | None) -> PlanOptions:
    """Options for the mesh without the pipeline axis (`pipelining.stage_options`); unchanged without one."""
    return opts if axis is None else stage_options(opts, mesh, mesh.axis_index(axis))


__all__ = ["search_pipeline"]
