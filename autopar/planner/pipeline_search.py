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
import math
import time
from collections.abc import Mapping
from dataclasses import replace

import torch

from ..compat import pytree
from ..cost_model.screen import pipeline_floor
from ..errors import InfeasibleError, PlanOptionError
from ..mesh import Mesh
from ..passes.capture import capture
from ..passes.layers import layer_key
from ..passes.stages import microbatch
from ..passes.shape_prop import annotate
from ..placement import layout_str
from ..plan import PIPELINE_SCHEDULES, Plan, SolverInfo, Timings
from .cache import PlanCache
from .pipeline import fixed_pipeline, lifted, stage_options
from .solve import (PlanOptions, assemble, deadline_of, fingerprint, frozen_gc, layout_problem, phase,
                      remaining, solve_captured, with_families)
from ..solver.decisions.stages import (PIPELINE_KEYS, Candidate, Searched, candidates, choose_pipeline,
                                      microbatch_floor, node_chunks, per_step_view)
from ..solver.evaluate import Staging
from ..solver.heuristic import families_for
from ..solver.ilp import least_seconds, most_sharded
from ..solver.solve import AT_TIME_LIMIT, solve

log = logging.getLogger("autopar")


def search_pipeline(model: torch.nn.Module, args: tuple, kwargs: dict | None, mesh: Mesh, opts: PlanOptions,
                    fixed: Mapping, captured: dict[int, tuple] | None = None) -> Plan:
    """The fastest plan, pipelined or not, whose every pipeline rank fits the budget; `fixed`: the
    pipeline keys the user gave (the rest are chosen); `captured`: microbatch count -> (capture of one
    microbatch, its annotations) made already (filled with those the search makes). The plan cache
    (`cache_dir=`) keeps the search's answer under every option, `pipeline=` and the time limit too."""
    t0 = time.perf_counter()
    _check(fixed, mesh)
    captured = {} if captured is None else captured
    with frozen_gc():
        cap1 = _captured(model, args, kwargs, 1, captured, opts)[0]
        # one deadline for the whole call, the model's capture aside (as `make_plan`'s): the captures of
        # other microbatch counts, the problems, solves and pricing of every candidate all count against it
        deadline = deadline_of(opts)
        cache = PlanCache.open(opts.cache_dir)
        key = cache.key(fingerprint(cap1), mesh, opts) if cache else None
        if cache and (hit := cache.get(key)) is not None:
            hit.timings = Timings(0.0, time.perf_counter() - t0, cached=True)
            return hit
        plan = _search(model, args, kwargs, mesh, opts, fixed, captured, t0, deadline)
    if cache:
        cache.put(key, plan)
    return plan


def _captured(model, args, kwargs, m: int, captured: dict[int, tuple], opts: PlanOptions) -> tuple:
    """(capture of one of `m` microbatches, its annotations), made once per count."""
    if m not in captured:
        phase(opts, "capture", "" if m == 1 else f"{m} microbatches")
        cap = capture(model, *microbatch(args, kwargs, m))
        captured[m] = (cap, annotate(cap.gm))
        gc.freeze()       # kept for the whole search (`frozen_gc`)
    return captured[m]


def _search(model: torch.nn.Module, args: tuple, kwargs: dict | None, mesh: Mesh, opts: PlanOptions,
            fixed: Mapping, captured: dict[int, tuple], t0: float, deadline: float | None) -> Plan:
    cands = _pipelines(model, args, kwargs, mesh, opts, fixed)
    unpiped = cands[0].axis is None       # "no pipeline" among the choices
    cands = cands[1:] if unpiped else cands
    floor = pipeline_floor(captured[1][0].gm.graph, captured[1][1], mesh)
    cands = _ordered(cands, floor, mesh)
    hinted = [c for c in cands if c.axis in PIPELINE_AXIS_HINTS] if unpiped else []
    run = _Groups(model, args, kwargs, mesh, opts, captured, deadline)
    # axes named for pipelines first, then the plan without one (unless a pipeline found is faster than
    # its floor, or the time is out), then the other axes
    found = choose_pipeline(mesh, hinted, run.solve_at, run.budget, run.out_of_time, floor, past=run.past,
                            bound=run.bound)
    if unpiped:
        found = run.flat_after(found, floor, t0, len(cands) > len(hinted))
    flat = run.flat
    rest = choose_pipeline(mesh, [c for c in cands if c not in hinted], run.solve_at, run.budget, run.out_of_time,
                           floor, min(flat.estimate.step_time_s if flat is not None else math.inf,
                                      found.best.evaluation.step_s if found.best is not None else math.inf),
                           past=run.past, bound=run.bound)
    found = _merged(found, rest)
    if found.best is None or (flat is not None and flat.estimate.step_time_s <= found.best.evaluation.step_s):
        if flat is not None:
            return _flat_status(flat, found)
        raise _nothing_fits(found, run.why, len(cands), run.budget)
    return _pipelined_plan(found, run, mesh, opts, captured, t0, deadline)


def _pipelines(model, args, kwargs, mesh: Mesh, opts: PlanOptions, fixed: Mapping) -> list[Candidate]:
    """The pipelines (axis, stages, microbatches, schedule) to weigh, "no pipeline" first where it is one."""
    n_layers = len({k for name, _ in model.named_parameters() if (k := layer_key(name))})
    batch = _batch(args, kwargs)
    cands = candidates(mesh, batch, opts.batch_axes, n_layers, fixed)
    if "axis" not in fixed:     # an axis a pin splits over cannot carry stages (`stage_options`): not a choice
        split = {a for k, a in enumerate(mesh.axis_names) for lay in (opts.pins or {}).values()
                 if len(lay) == mesh.ndim and str(lay[k]).strip() != "R"}
        cands = [c for c in cands if c.axis not in split]
    if not cands:
        raise PlanOptionError(f"pipeline={dict(fixed)}: no pipeline of this mesh {mesh.axis_names} {mesh.shape}, "
                              f"batch {batch} and {n_layers} layers has these settings (pipeline.stages x "
                              f"pipeline.virtual_stages chunks need a layer each; pipeline.microbatches must divide "
                              f"the batch of one pipeline)")
    return cands


class _Groups:
    """The (axis, microbatch count) groups of one search: each solved once on its stage mesh, its
    problem kept for re-solves at tighter budgets, warm-started from the nearest count solved; and
    the plan without a pipeline (`flat`, or `why` none fits)."""

    def __init__(self, model, args, kwargs, mesh: Mesh, opts: PlanOptions, captured: dict, deadline: float | None):
        self.model, self.args, self.kwargs, self.mesh, self.opts = model, args, kwargs, mesh, opts
        self.captured, self.deadline = captured, deadline
        self.budget = opts.memory_budget if opts.memory_budget is not None else mesh.profile.memory_budget
        self.stage_opts = replace(opts, symbolic=False)
        self.layouts: dict[tuple, object] = {}    # (axis, microbatches) -> its problem's layout family (`bound`)
        self.problems: dict[tuple, object] = {}   # (axis, microbatches) -> its problem, families added
        self.statuses: dict[tuple, str] = {}      # (axis, microbatches) -> its last solve's status
        self.plans: dict[tuple, tuple] = {}       # (axis, microbatches) -> (problem, choice, options) solved
        self.least: dict[tuple, float] = {}       # (axis, microbatches) -> `least_seconds` of its problem's view
        self.took = 0.0     # seconds of the costliest group so far (the first is tried whatever the time left)
        self.priced = 0.0   # CPU seconds of the costliest pricing of a group (its solve's end to the next solve)
        self.solved_at: float | None = None     # CPU clock at the last solve's end (None: none, or flat plan since)
        self.started = (time.perf_counter(), time.process_time())
        self.flat: Plan | None = None
        self.why: InfeasibleError | None = None

    def solve_at(self, axis, m: int, scale: float, first: bool):
        """`choose_pipeline`'s `solve_at`: `first`, no plan that fits is in hand (the plan without a
        pipeline counted), so the solver's first plans come whatever the time (`solver.solve`'s `floor`)."""
        t = time.perf_counter()
        if self.solved_at is not None:      # since the last solve: its group's pricing
            self.priced = max(self.priced, time.process_time() - self.solved_at)
        problem = self._problem(axis, m)
        cap = self.captured[m][0]
        stages = 1 if axis is None else self.mesh.shape[self.mesh.axis_index(axis)]
        start = _carried(problem, self.plans, axis, m) if (axis, m) not in self.plans else None
        view, budget = per_step_view(problem, m), self.budget * stages * scale
        try:
            if not first and scale < 1.0 and families_for(view, budget, most_sharded(view)) is None:
                # a re-solve with a plan in hand would seek the plan of least memory, which no deadline bounds
                # (Llama-3-405B's 16-microbatch group at x0.111: 159 CPU s, to find it needs 252 GiB a device)
                log.info("pipeline group axis=%s microbatches=%d, whole-model budget x%.3f: no memory options fit "
                         "its most sharded layouts; not solved, a plan is in hand", axis, m, scale)
                return None
            result = solve(view, budget, self._solve_limit(), start=start, floor=first)
        except InfeasibleError as e:
            log.info("pipeline candidate axis=%s microbatches=%d: infeasible (%s)", axis, m, e)
            return None
        finally:
            self.solved_at = time.process_time()
            self.took = max(self.took, time.perf_counter() - t)
        self.statuses[axis, m] = result.status
        self.plans[axis, m] = (problem, result.choice, result.options)
        return problem, result.choice, result.options, cap.gm.graph

    def _problem(self, axis, m: int):
        """The group's problem (one microbatch of `m` on the mesh without `axis`), built once: its
        layout family (`_layouts`), then the other families, only for a group solved."""
        if (axis, m) not in self.problems:
            self.problems[axis, m] = with_families(self._layouts(axis, m), _stage_opts(self.stage_opts, self.mesh, axis))
            gc.freeze()
        return self.problems[axis, m]

    def _layouts(self, axis, m: int):
        """The group's problem with its layout family alone, built once (what `bound` needs: 0.3 CPU s on
        GPT-3 175B's stage meshes, its families 0.2 more)."""
        if (axis, m) not in self.layouts:
            cap, infos = _captured(self.model, self.args, self.kwargs, m, self.captured, self.opts)
            self.layouts[axis, m] = layout_problem(cap, infos, self.mesh.stage_mesh(axis),
                                                   _stage_opts(self.stage_opts, self.mesh, axis))
            gc.freeze()
        return self.layouts[axis, m]

    def bound(self, c: Candidate) -> float:
        """`choose_pipeline`'s `bound`: `microbatch_floor` at the LP bound of the group's problem as its
        solve sees it (`ilp.least_seconds` of `per_step_view`: 0.06-0.11 CPU s on GPT-3 175B's stage
        meshes, after the build of its layout family, 0.3 s, which the group's solve reuses)."""
        key = (c.axis, c.microbatches)
        if key not in self.least:
            self.least[key] = least_seconds(per_step_view(self._layouts(*key), c.microbatches))
        return microbatch_floor(c, self.least[key])

    def _solve_limit(self) -> float | None:
        """A group's solve ends in time for its pricing by the deadline: as many CPU seconds as the costliest
        so far, at the share of a core the search has had (on a loaded machine a pricing of 0.8 CPU s took
        1.5-10 s wall: its CPU seconds, not its wall time, carry over to the next group)."""
        left = remaining(self.deadline)
        if left is None or not self.priced:
            return left
        wall, cpu = time.perf_counter() - self.started[0], time.process_time() - self.started[1]
        return max(left - self.priced * max(wall / max(cpu, 1e-9), 1.0), 0.0)     # a pricing runs on one core

    def out_of_time(self, after: float = 0.0) -> bool:
        """A group as long as the costliest so far, started `after` seconds from now, would end past the deadline."""
        return self.deadline is not None and time.perf_counter() + after + self.took >= self.deadline

    def past(self) -> bool:
        """The deadline has passed (a group solved is priced until then)."""
        return self.deadline is not None and time.perf_counter() >= self.deadline

    def flat_after(self, found: Searched, floor, t0: float, more: bool) -> Searched:
        """After the hinted axes: the plan without a pipeline, unless a pipeline found beats its floor
        (counted pruned) or the time is out (counted unsearched). With a pipeline in hand its floor
        is then the least compute and resharding seconds of its layouts (`ilp.least_seconds`: an LP
        of the planning problem, which its solve needs anyway), and where that cannot beat the
        pipeline it is not solved (counted pruned): GPT-3 175B over (16, 8, 8) H100, 7.97 s against
        the 7.49 s of the pipelines over pp, 1 CPU s, where its solve takes ~110 CPU s to its end."""
        beat = found.best.evaluation.step_s if found.best is not None else math.inf
        if floor(Candidate(None, 1, 1, "1f1b", 1)) >= beat:
            return replace(found, pruned=found.pruned + 1)
        if found.best is not None and self.out_of_time():
            return replace(found, unsearched=found.unsearched + ((None, 1),))
        problem = None
        if found.best is not None:
            problem = layout_problem(*self.captured[1], self.mesh, self.opts)
            if least_seconds(problem, self.deadline) >= beat:
                return replace(found, pruned=found.pruned + 1)
            problem = with_families(problem, self.opts)
        # not counted in `took` (its solve has its own share of the time, FLAT_SHARE) nor in `priced`
        self.solved_at = None
        self.flat, self.why = _flat(self.model, self.args, self.kwargs, self.mesh, self.opts, self.captured, t0,
                                    self.deadline, more, problem, floor=found.best is None)
        return found


def _nothing_fits(found: Searched, why: InfeasibleError | None, n: int, budget: float) -> InfeasibleError:
    least = found.least
    if why is not None and (why.min_memory_bytes or math.inf) <= least:     # the plan without one needs least
        return InfeasibleError(f"{why} No pipeline fits either ({n} candidates).", why.min_memory_bytes)
    return InfeasibleError(f"no pipeline of {n} candidates fits the budget of {budget / 2**30:.2f} GiB "
                           f"per device; the least memory one needs is {least / 2**30:.2f} GiB", least)


def _pipelined_plan(found: Searched, run: _Groups, mesh: Mesh, opts: PlanOptions, captured: dict, t0: float,
                    deadline: float | None) -> Plan:
    """The best pipeline's plan: its stage plan assembled, priced with its staging, lifted to the mesh."""
    best = found.best
    c = best.candidate
    cap = captured[c.microbatches][0]
    sub = mesh.stage_mesh(c.axis)
    staging = Staging(best.pipeline, node_chunks(best.problem, cap.gm.graph, best.pipeline),
                      mesh.axes[mesh.axis_index(c.axis)].link if c.axis is not None else None)
    # priced as the search priced it (`stages._best_of`: the same problem, choice, options and staging)
    plan = assemble(cap, best.problem, best.choice, sub, _stage_opts(run.stage_opts, mesh, c.axis), best.options,
                    *((staging, best.evaluation) if c.stages > 1 else ()))
    if c.axis is not None:
        plan = lifted(plan, mesh, mesh.axis_index(c.axis), opts, best.pipeline)
    plan = replace(plan, options=opts.to_dict(), pipeline=best.pipeline)
    timed_out = bool(found.unsearched) or (deadline is not None and time.perf_counter() >= deadline)
    plan.solver = SolverInfo("search", _status(run.statuses, c, found, timed_out), 0, 0, plan.estimate.step_time_s,
                             len(best.problem.leaders), len(best.problem.order), len(best.problem.rep))
    plan.timings = Timings(0.0, time.perf_counter() - t0)
    return plan


def _merged(a: Searched, b: Searched) -> Searched:
    """Two searches' outcomes as one: the faster best (the first on a tie), the counts summed."""
    best = a.best if b.best is None or (a.best is not None and a.best.evaluation.step_s <= b.best.evaluation.step_s) \
        else b.best
    return Searched(best, min(a.least, b.least), a.solved + b.solved, a.pruned + b.pruned,
                    a.unsearched + b.unsearched)


FLAT_SHARE = 0.25    # of the time left, the no-pipeline plan's solve at most where pipelines are candidates too:
                     # its first plans come whatever the limit (the fallback, the same on every run; what
                     # follows only refines them); the pipeline groups, one solve each, get the rest


def _flat(model, args, kwargs, mesh: Mesh, opts: PlanOptions, captured: dict, t0: float, deadline: float | None,
          more: bool, problem=None, floor: bool = True) -> tuple[Plan | None, InfeasibleError | None]:
    """(the plan without a pipeline, None), the planner's own plan of the whole batch; (None, why)
    where nothing fits. `problem`: its planning problem where the caller built it. `floor`: no pipeline
    is in hand, so the solver's first plans come whatever the time (`solver.solve`'s); with one, every
    step stops at the deadline, and where none gave a plan by then the pipeline stands (Llama-3-405B over
    (128, 16, 8) at time_limit=300: this plan's first plans were still running at 660 s wall)."""
    cap, infos = captured[1]
    own = deadline
    if more and deadline is not None:
        own = time.perf_counter() + FLAT_SHARE * max(deadline - time.perf_counter(), 0.0)
    try:
        return solve_captured(cap, mesh, opts, t0, (model, args, kwargs), own, infos, floor=floor,
                              problem=problem), None
    except InfeasibleError as e:
        log.info("no pipeline: infeasible (%s)", e)
        return None, e


def _flat_status(flat: Plan, found: Searched) -> Plan:
    """The plan without a pipeline, its status saying how the pipelines were weighed."""
    groups = found.solved + found.pruned + len(found.unsearched)
    if found.unsearched:
        own = flat.solver.status
        flat.solver = replace(flat.solver, status=(
            f"{'' if own.startswith(AT_TIME_LIMIT) else AT_TIME_LIMIT + ': '}{own}; pipelines: {found.solved} of "
            f"{groups} (axis, microbatch count) candidates solved, {found.pruned} ruled out by their lower bound, "
            f"{_unsearched(found)}"))
    elif groups:
        flat.solver = replace(flat.solver, status=(
            f"{flat.solver.status}; no pipeline is faster ({found.solved} of {groups} (axis, microbatch count) "
            f"candidates solved, {found.pruned} ruled out by their lower bound)"))
    return flat


PIPELINE_AXIS_HINTS = ("pp", "pipe", "pipeline", "stage", "stages")   # axis names searched first (hints only)


def _ordered(cands: list[Candidate], floor, mesh: Mesh) -> list[Candidate]:
    """The pipeline candidates by group, most promising first: axes named for pipelines
    (PIPELINE_AXIS_HINTS) before the others, then the axes of slower links before faster ones (a
    pipeline's sends are one boundary's activations a microbatch, while the stage mesh keeps the
    other axes for the layouts' collectives: Megatron-LM and Alpa put stages across nodes; GPT-3
    175B over (16, 8, 8) dp/pp/tp H100: the groups over dp plan 6.9-7.5 s steps, over tp, the
    NVLink axis, 20-24 s, though their compute floors are the lower), then the least lower bound
    (more microbatches, a smaller bubble); stable, so the order is the same on every run. The names
    and links order the search, never restrict it: every axis stays a candidate."""
    bound: dict[tuple, float] = {}
    for c in cands:
        key = (c.axis, c.microbatches)
        bound[key] = min(bound.get(key, math.inf), floor(c))
    speed = {a.name: a.link.bandwidth for a in mesh.axes}
    rank = {k: (k[0] not in PIPELINE_AXIS_HINTS, speed.get(k[0], 0.0), b) for k, b in bound.items()}
    return sorted(cands, key=lambda c: rank[c.axis, c.microbatches])


def _carried(problem, plans: dict[tuple, tuple], axis, m: int):
    """A start for (axis, m): the plan solved for the nearest microbatch count on the same stage mesh,
    each decision's layouts and strategy found among this problem's options (else its most sharded),
    the family options where this problem has the same groups; None where none was solved."""
    near = sorted((abs(k[1] - m), k[1]) for k in plans if k[0] == axis)
    if not near:
        return None
    old, choice, options = plans[axis, near[0][1]]
    sharded = most_sharded(problem)
    out = {}
    for leader in problem.leaders:
        d = old.decisions.get(leader)
        want = None if d is None else _signature(d.strategies[choice[d.leader]])
        mine = problem.decisions[leader].strategies
        out[leader] = next((i for i, s in enumerate(mine) if _signature(s) == want), sharded[leader])
    opts = {g.key: options[g.key] if options.get(g.key) in g.allowed else g.allowed[0]
            for g in problem.families.groups}
    return out, opts


def _signature(s) -> tuple:
    return layout_str(s.output), tuple(layout_str(i) for i in s.inputs), tuple(s.labels)


def _status(statuses: dict[tuple, str], chosen, found: Searched, timed_out: bool) -> str:
    """The search's outcome in words (`solver.solve.status_words`): the chosen pipeline's own solve's
    status, and how many of the (axis, microbatch count) groups were solved and ruled out by bound."""
    groups = found.solved + found.pruned + len(found.unsearched)
    own = statuses.get((chosen.axis, chosen.microbatches), "")
    head = AT_TIME_LIMIT if timed_out or own.startswith(AT_TIME_LIMIT) else "the best pipeline found"
    skipped = f", {_unsearched(found)}" if found.unsearched else ""
    return (f"{head}: {found.solved} of {groups} (axis, microbatch count) candidates solved, {found.pruned} ruled "
            f"out by their lower bound{skipped}, the chosen one's layouts {own}")


def _unsearched(found: Searched) -> str:
    """The groups the time limit left unsearched, by name: "2 not searched (pp with 64, 128 microbatches;
    no pipeline)"."""
    by_axis: dict = {}
    for axis, m in found.unsearched:
        by_axis.setdefault(axis, []).append(m)
    for ms in by_axis.values():
        ms.sort()
    named = "; ".join("no pipeline" if axis is None else f"{axis} with {', '.join(map(str, ms))} microbatches"
                      for axis, ms in by_axis.items())
    return f"{len(found.unsearched)} not searched ({named})"


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
