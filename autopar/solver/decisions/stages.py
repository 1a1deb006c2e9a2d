"""The stage family: which mesh axis (if any) carries pipeline stages, how many microbatches, which
schedule and how many virtual stages; where the stages start; chosen jointly with the layouts.

Alpa's two levels (Zheng et al. 2022):

* outside, `choose_pipeline` enumerates candidates (`candidates`): the pipeline axis (each mesh
  axis not carrying the batch, or none), stages = that axis' size, the microbatch count (a
  divisor of the batch one pipeline runs), the schedule and virtual stages;
* inside, the intra-op problem of one microbatch on the mesh without the pipeline axis is solved
  once per (axis, microbatch count) by the ILP (layouts and memory families jointly: a caller's
  `solve_at`). Repeated layers share their variables, so the stages of equal layers are priced
  by the same tables: every schedule and virtual-stage count of that (axis, microbatches) is then
  re-priced by the one evaluator (`evaluate.evaluate` with a `Staging`), with the layer
  boundaries a dynamic program over the layers places (`balanced_boundaries`: the first and
  last chunks also hold the embedding and the head, so they get fewer layers when that is faster)
  and, where the per-rank memory needs it, the layers' recomputation raised uniformly.

The best candidate is the fastest step that fits the memory budget; ties go to the earlier
candidate in `candidates`' order (fewer stages, fewer microbatches, the simpler schedule), so the
choice is deterministic.
"""
from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from ...cost_model.pipeline import check_schedule, in_flight_microbatches, step_floor
from ...passes.stages import chunk_of, even_boundaries, layer_sequence
from ...plan_records import PIPELINE_KEYS, PipelinePlan
from ..evaluate import (Evaluation, Staging, comm_total, compute_total, evaluate, grad_sync_total,
                       per_microbatch_seconds, seconds_by_part)
from ..problem import Problem

# schedules the planner chooses among (each has an executor in runtime/pipeline.py). "zb" runs there too
# and is priced as it runs (its weight pass reduces gradients per microbatch, solver/evaluate.py), but
# is planned only when a user fixes it: searching it is a change of the planner's defaults, not made yet
CHOSEN_SCHEDULES = ("1f1b", "interleaved", "gpipe")
VIRTUAL_STAGES = (2, 3, 4)           # interleaved: chunks per pipeline rank tried
MICROBATCH_SIZES = 3                 # the smallest microbatch sizes tried per axis (each one ILP solve)

log = logging.getLogger("autopar")


@dataclass(frozen=True, slots=True)
class Candidate:
    axis: str | None
    stages: int
    microbatches: int
    schedule: str
    virtual_stages: int


def node_chunks(problem: Problem, graph, pipe: PipelinePlan) -> dict[str, int]:
    """Decision -> model chunk: the partition of `passes.stages.chunk_of` for the graph's call nodes;
    a placeholder (parameter, input) goes with the earliest chunk that reads it."""
    part = {n.name: c for n, c in chunk_of(graph, pipe).items()}
    last = max(pipe.chunks, 1) - 1
    out = {n: part[n] for n in problem.decisions if n in part}
    for e in problem.edges:
        if e.src not in part:
            c = last if e.dst == "output" else part.get(e.dst, 0)
            out[e.src] = min(out.get(e.src, c), c)
    return {n: out.get(n, 0) for n in problem.decisions}


def layer_seconds(problem: Problem, graph, choice: Mapping[str, int]) -> tuple[float, list[float], float]:
    """(seconds before the first layer, per layer, after the last): compute of the nodes and the
    resharding into them, one microbatch, as the evaluator sums them (`evaluate.seconds_by_part`; what
    the boundary program balances). Nodes between two layers go with the next, as in `node_chunks`."""
    order = layer_sequence(graph)
    n = len(order)
    seg = node_chunks(problem, graph, PipelinePlan("_", max(n, 1), 1, 1, "1f1b", ("",) + tuple(order[1:])))
    first = next((i for i, q in enumerate(problem.order) if q in problem.layer), 0)
    last = max((i for i, q in enumerate(problem.order) if q in problem.layer), default=-1)
    for i, q in enumerate(problem.order):     # -1: before the layers, n: after them
        if q not in problem.layer and (i < first or i > last):
            seg[q] = -1 if i < first else n
    per = seconds_by_part(problem, choice, {q: c + 1 for q, c in seg.items()}, n + 2, n + 1)
    return per[0], per[1:-1], per[-1]


def balanced_boundaries(problem: Problem, graph, choice: Mapping[str, int], chunks: int,
                        seconds: tuple | None = None) -> tuple[str, ...]:
    """Boundaries cutting the layers into `chunks` contiguous runs that minimise the slowest chunk,
    the first chunk carrying what precedes the layers and the last what follows them: a dynamic
    program over (chunks, layers), O(chunks x layers^2). Ties keep the earliest cut. `seconds`:
    `layer_seconds(problem, graph, choice)` where the caller has it."""
    order = layer_sequence(graph)
    if chunks <= 1:
        return ("",)
    pre, per, post = seconds if seconds is not None else layer_seconds(problem, graph, choice)
    n = len(order)
    prefix = [0.0]
    for x in per:
        prefix.append(prefix[-1] + x)
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = 0.0
    for c in range(1, chunks + 1):
        for j in range(c, n - (chunks - c) + 1):
            for i in range(c - 1, j):
                cost = prefix[j] - prefix[i] + (pre if c == 1 else 0.0) + (post if c == chunks else 0.0)
                val = max(best[c - 1][i], cost)
                if val < best[c][j] * (1 - 1e-12):
                    best[c][j], cut[c][j] = val, i
    starts, j = [], n
    for c in range(chunks, 0, -1):
        i = cut[c][j]
        starts.append(i)
        j = i
    starts.reverse()
    return tuple("" if i == 0 else order[i] for i in starts)


def candidates(mesh, batch: int, batch_axes, n_layers: int, fixed: Mapping) -> list[Candidate]:
    """Every pipeline the options allow, in tie-break order. `batch`: the global batch of a step;
    `fixed`: the keys of `PIPELINE_KEYS` the user gave."""
    if "axis" in fixed:
        axes = [fixed["axis"]]
    else:
        axes = [None] + [a for a, n in zip(mesh.axis_names, mesh.shape)
                         if n > 1 and a not in (batch_axes or ()) and n <= n_layers]
    out = []
    for axis in axes:
        stages = 1 if axis is None else mesh.shape[mesh.axis_index(axis)]
        if fixed.get("stages", stages) != stages:
            continue
        ms = _microbatch_counts(mesh, axis, batch, batch_axes, stages)
        if "microbatches" in fixed:     # one stage runs one microbatch (no gradient accumulation yet)
            ms = [fixed["microbatches"]] if stages > 1 or fixed["microbatches"] == 1 else []
        for m in ms:
            for sched, v in _schedules(stages, n_layers, fixed):
                out.append(Candidate(axis, stages, m, sched, v))
    return out


def _microbatch_counts(mesh, axis: str | None, batch: int, batch_axes, stages: int) -> list[int]:
    """No pipeline: one microbatch. A pipeline: counts m (at least the stage count: fewer leave ranks
    idle) whose microbatch the other axes can still split by batch, fewest first.

    With `batch_axes` the split is theirs, and the MICROBATCH_SIZES largest counts dividing the batch of
    one pipeline are tried. Without, the ILP may split a microbatch over any other axes, which it can
    only do where their sizes divide it: for each product D of a subset of the other axes, largest
    first, the MICROBATCH_SIZES largest counts whose microbatch (batch / m) is a multiple of D, until
    MICROBATCH_SIZES counts are gathered. (Taking only the largest counts overall gave GPT-3 175B
    microbatches of 1-3 sequences on a 16 x 8 stage mesh: nothing left to split over data, 1.8x the
    step of 48 microbatches of 32.)"""
    if stages == 1:
        return [1]
    if batch_axes:
        split = math.prod(mesh.shape[mesh.axis_index(a)] for a in batch_axes if a != axis)
        per_pipe = batch // split if split and batch % split == 0 else batch
        return _largest_counts(per_pipe, 1, stages)
    others = [n for a, n in zip(mesh.axis_names, mesh.shape) if a != axis and n > 1]
    splits = sorted({math.prod(c) for k in range(len(others) + 1) for c in itertools.combinations(others, k)},
                    reverse=True)
    ms: set[int] = set()
    for d in splits:
        if len(ms) >= MICROBATCH_SIZES:
            break
        ms.update(_largest_counts(batch, d, stages))
    return sorted(ms)


def _largest_counts(batch: int, split: int, stages: int) -> list[int]:
    """The MICROBATCH_SIZES largest m dividing `batch` into microbatches that `split` divides, at least
    `stages` of them (or the largest such m where none is that many); [] if `split` divides no microbatch."""
    ms = [m for m in range(1, batch + 1) if batch % m == 0 and (batch // m) % split == 0]
    enough = [m for m in ms if m >= stages] or ms[-1:]
    return enough[-MICROBATCH_SIZES:]


def _schedules(stages: int, n_layers: int, fixed: Mapping) -> list[tuple[str, int]]:
    if stages == 1:             # no pipeline: nothing to schedule
        return [("1f1b", 1)]
    out = []
    for sched in ([fixed["schedule"]] if "schedule" in fixed else CHOSEN_SCHEDULES):
        vs = [1] if sched != "interleaved" else [v for v in VIRTUAL_STAGES if stages * v <= n_layers]
        if "virtual_stages" in fixed:       # interleaving needs several chunks per rank, zero bubble takes any
            v = fixed["virtual_stages"]
            fits = (v > 1 or sched != "interleaved") and check_schedule(sched, v) is None
            vs = [v] if fits and stages * v <= n_layers else []
        out += [(sched, v) for v in vs]
    return out


def per_step_view(problem: Problem, microbatches: int) -> Problem:
    """The problem as the ILP should see one microbatch of m: a parameter's gradient is synchronised
    once per step, its forward gather every microbatch, so the gradient leg of a parameter edge
    weighs 1/m against the per-microbatch costs. A copy (edge tables are shared between identical
    edges and priced as they are by the evaluator); the same choice indices."""
    if microbatches == 1:
        return problem
    tables: dict = {}

    def weighed(e):
        key = (id(e.cost), id(e.fwd))       # identical edges keep sharing one table
        if key not in tables:
            tables[key] = per_microbatch_seconds(e.cost, e.fwd, microbatches)
        return replace(e, cost=tables[key])
    edges = [weighed(e) if problem.decisions[e.src].kind == "param" and e.fwd is not None else e
             for e in problem.edges]
    return replace(problem, edges=edges)


@dataclass(frozen=True, slots=True)
class Chosen:
    candidate: Candidate
    pipeline: PipelinePlan
    problem: Problem
    choice: dict
    options: dict
    evaluation: Evaluation


SolveAt = Callable[[str | None, int, float, bool], tuple[Problem, dict, dict, object] | None]
Floor = Callable[[Candidate], float]
OutOfTime = Callable[[float], bool]
TIGHTEN_ROUNDS = 2       # re-solves of one (axis, microbatches) whose every pipeline overflowed its ranks
TIGHTEN_MARGIN = 0.95    # each aims the whole-model budget this much below the overflow seen


@dataclass(frozen=True, slots=True)
class Searched:
    best: Chosen | None      # the fastest candidate that fits (None: none found)
    least: float             # the least peak memory seen (inf: nothing priced)
    solved: int              # (axis, microbatches) groups solved
    pruned: int              # groups whose lower bound was no faster than the best step found
    unsearched: tuple        # the (axis, microbatches) groups left when the time ran out


def choose_pipeline(mesh, cands: list[Candidate], solve_at: SolveAt, budget: float,
                    out_of_time: OutOfTime = lambda after=0.0: False, floor: Floor | None = None,
                    incumbent_s: float = math.inf, past: Callable[[], bool] | None = None,
                    bound: Floor | None = None) -> Searched:
    """The fastest candidate whose every pipeline rank fits `budget`. `solve_at(axis, microbatches,
    scale, first)` -> (problem of one microbatch on the mesh without `axis`, its layout choice, its
    family options, the captured graph), the ILP's whole-model budget scaled by `scale`; None when
    nothing fits; `first`: no plan that fits is in hand yet (the solve's first plans are then made
    whatever the time). The groups are searched in the order of `cands`. `floor(candidate)`: a lower
    bound on its step: a group none of whose candidates can beat the best step found (or
    `incumbent_s`, a plan the caller has) is not solved. The whole-model budget only approximates
    the ranks' (a rank holds 1/stages of the parameters and several microbatches in flight): where
    no pipeline of an (axis, microbatches) fits its ranks, that ILP is solved again with the budget
    lowered by the overflow, at most TIGHTEN_ROUNDS times. `out_of_time(after)`: True where a solve
    as long as the costliest so far, started `after` seconds from now, would end past the deadline.
    Once `out_of_time(0)`, the best found so far is the answer (the search goes on only while
    neither it nor `incumbent_s` exists); the groups' bounds, which cost no solve, are still
    weighed, so a group is counted unsearched only where its bound could beat the answer (the
    status is then the same under any load where the bounds decide). With no plan in hand, a group that
    overflowed waits while a group of the same axis with more microbatches (smaller ones: fewer bytes in
    flight per rank) is still to be searched (`_Search.tighten`), whatever the time left, so the path to
    the first plan that fits depends on the machine's speed only where the deadline cuts it; the groups
    put off are solved again after the others, the most microbatches first, where none fits yet or, with
    a plan in hand, while time remains and their bound could beat it (on Llama-3-405B over (128, 16, 8)
    at time_limit=60 the group of 64 microbatches' two re-solves, peaks of 96 and 100 GiB against 74,
    took ~27 s before the group of 128 was solved, which then fit at its first solve at the scale 64's
    overflow suggests). With no plan in hand, out of time or after a group of its axis was put off, a
    group starts at the budget scale the last overflow of its axis suggests (the ranks' state,
    parameters and optimizer, does not shrink with the microbatch: on Llama-3-405B the groups of 64, 128
    and 256 microbatches at the whole budget all overflowed the 74 GiB, peaks of 126, 88 and 78 GiB),
    and the groups of an axis with fewer microbatches than one that overflowed (larger microbatches, more
    bytes in flight) are left. `past()`: the deadline has passed, which stops the pricing of a group
    solved (a few evaluations a candidate, not a group's solve; default: `out_of_time(0)`). `bound(candidate)`:
    a costlier lower bound (its group's problem built, an LP solved: `microbatch_floor`), asked with a
    step in hand and time left, where `floor` cannot rule the group out."""
    state = _Search(mesh, solve_at, budget, floor, incumbent_s, out_of_time,
                    past if past is not None else lambda: out_of_time(0.0), bound)
    keys = list(dict.fromkeys((c.axis, c.microbatches) for c in cands))
    waiting: list[tuple[tuple, float, int]] = []     # (group, scale, re-solves left) put off by `tighten`
    for i, key in enumerate(keys):
        beat = state.beat()
        group = [c for c in cands if (c.axis, c.microbatches) == key]
        if floor is not None and min(floor(c) for c in group) >= beat:
            state.pruned += 1
            continue
        hurried = math.isinf(beat) and out_of_time(0.0)
        if (math.isfinite(beat) and out_of_time(0.0)) or (hurried and any(k[0] == key[0] and k[1] > key[1]
                                                                          for k in state.overflowed)):
            state.unsearched.append(key)
            continue
        if state.bounded(group, beat):
            state.pruned += 1
            continue
        state.solved += 1
        later = any(k[0] == key[0] and k[1] > key[1] for k in keys[i + 1:])
        pressed = hurried or (math.isinf(beat) and any(k[0] == key[0] for k, _, _ in waiting))
        put_off = state.tighten(key, group, state.tighter.get(key[0], 1.0) if pressed else 1.0, TIGHTEN_ROUNDS, later)
        if put_off is not None:
            waiting.append(put_off)
    for key, scale, rounds in reversed(waiting):     # the groups put off, the most microbatches first
        group = [c for c in cands if (c.axis, c.microbatches) == key]
        beat = state.beat()
        if math.isinf(beat) or not (out_of_time(0.0) or (floor is not None and min(map(floor, group)) >= beat)
                                    or state.bounded(group, beat)):
            state.tighten(key, group, scale, rounds, False)
    return Searched(state.best, state.least, state.solved, state.pruned, tuple(state.unsearched))


@dataclass(slots=True)
class _Search:
    """`choose_pipeline`'s inputs (see there) and what it has found so far."""
    mesh: object
    solve_at: SolveAt
    budget: float
    floor: Floor | None
    incumbent_s: float
    out_of_time: OutOfTime
    past: Callable[[], bool]
    bound: Floor | None
    best: Chosen | None = None
    least: float = math.inf
    solved: int = 0
    pruned: int = 0
    unsearched: list = field(default_factory=list)
    overflowed: set = field(default_factory=set)        # groups priced whose every pipeline overflowed
    tighter: dict = field(default_factory=dict)         # axis -> the budget scale its last overflow suggests

    def beat(self) -> float:
        """The step to beat: the best found's, or the caller's plan's."""
        return min(self.incumbent_s, self.best.evaluation.step_s if self.best is not None else math.inf)

    def bounded(self, group: list[Candidate], beat: float) -> bool:
        """`bound` rules the group out against a step in hand (`beat`)."""
        return self.bound is not None and math.isfinite(beat) and min(map(self.bound, group)) >= beat

    def tighten(self, key: tuple, group: list[Candidate], scale: float, rounds: int,
                later: bool) -> tuple[tuple, float, int] | None:
        """One group solved at `scale` and priced, and solved again with the budget lowered by the
        overflow while no pipeline fits, at most `rounds` times; the best found is kept. Returns (key,
        scale, re-solves left) where the re-solves are put off (`later`: a group of the same axis with
        more microbatches is still to come; no plan in hand), else None. A re-solve that returns a plan
        priced already (the same layouts and options: GPT-3 175B's group of 24 microbatches over dp at x1.0
        and x0.935) is not priced again: nothing it is priced against has changed (the best is as it was)."""
        priced: dict[tuple, tuple] = {}     # (layouts, options) -> `_best_of`'s answer for them
        while True:
            beat = self.beat()
            found_plan = self.solve_at(key[0], key[1], scale, math.isinf(beat))
            if found_plan is None:          # no plan of this microbatch fits even the relaxed budget
                return None
            plan = (tuple(sorted(found_plan[1].items())), tuple(sorted(found_plan[2].items())))
            if plan not in priced:
                priced[plan] = _best_of(self.mesh, group, found_plan, self.budget, self.floor, beat,
                                        self.out_of_time, self.past)
            found, low = priced[plan]
            log.info("pipeline group axis=%s microbatches=%d, whole-model budget x%.3f: %s", key[0], key[1], scale,
                     f"{found.evaluation.step_s:.4g} s a step" if found is not None
                     else f"least peak {low / 2**30:.1f} GiB")
            self.least = min(self.least, low)
            if found is not None:
                if self.best is None or found.evaluation.step_s < self.best.evaluation.step_s * (1 - 1e-12):
                    self.best = found
                return None
            if not math.isfinite(low):
                return None                 # nothing was priced: a lower budget changes nothing
            scale *= TIGHTEN_MARGIN * self.budget / low
            self.overflowed.add(key)
            self.tighter[key[0]] = scale
            if rounds == 0 or (math.isfinite(beat) and self.out_of_time(0.0)):
                return None
            rounds -= 1
            if later and math.isinf(beat):
                return key, scale, rounds


def _best_of(mesh, group: list[Candidate], solved, budget: float, floor: Floor | None, beat: float,
             out_of_time: OutOfTime, past: Callable[[], bool]) -> tuple[Chosen | None, float]:
    """The fastest of `group` (one axis and microbatch count, solved) that fits, and the least peak.
    Each candidate is priced by the evaluator at each of its boundaries and family options (a few
    evaluations of the whole model each: 0.85 CPU s apiece on Llama-3-405B's 126 layers), so the
    candidates go by their lower bound `floor`, least first: one whose bound cannot beat the best step
    found (or `beat`, the search's) is not priced, and once `past()` with a plan in hand (this group's
    or the search's) the rest are not priced either, but for the first (the group's solve, paid for, is
    weighed: a group of Llama-3-405B solved as the time ran out was left unpriced, where its first
    candidate costs a few evaluations). With no plan in hand (`wanting`) the candidates go by the
    microbatches in flight on the first rank (`in_flight_microbatches`: its activations), fewest first,
    and one that fits nowhere rules out those holding as many (Llama-3-405B's group of 64 microbatches,
    which fits nowhere: 1F1B's two cuts priced, not its interleaved and GPipe ones, 8 evaluations and
    ~20 s wall fewer at load 6); out of time so (`hurried`), the first plan that fits is the
    answer. Each cut's options go from the most recomputation down,
    and where that overflows the others (which free less, so neither fit nor lower the least peak) are
    not priced: a cut that fits nowhere costs one evaluation, not three (Llama-3-405B's first group on
    (128, 16, 8): 30 evaluations, ~25 CPU s, where its interleaved and GPipe schedules, holding more
    microbatches, overflow several times over)."""
    problem, choice, options, graph = solved
    best, least = None, math.inf
    bound = {c: floor(c) for c in group} if floor is not None else dict.fromkeys(group, 0.0)
    seconds = functools.cache(lambda: layer_seconds(problem, graph, choice))     # one layout: every cut's
    wanting = not math.isfinite(beat)
    hurried = wanting and out_of_time(0.0)
    held = {c: in_flight_microbatches(0, c.stages, c.microbatches, c.schedule, c.virtual_stages) for c in group}
    overflowed = math.inf       # wanting: the fewest in flight of a candidate that fit nowhere
    choices = _option_choices(problem, options)         # the same for every candidate and cut
    work = functools.cache(lambda: layout_work(problem, choice))
    cuts = functools.cache(lambda chunks: _boundary_choices(problem, graph, choice, chunks, seconds))
    parts = functools.cache(lambda pipe: node_chunks(problem, graph, pipe))    # by cut: the same for every schedule
    memo: dict = {}     # `evaluate`'s, for this problem and choice (`parts` holds the cuts' chunk maps)
    priced = False
    for cand in sorted(group, key=lambda c: (held[c], bound[c]) if wanting else bound[c]):
        win = min(beat, best.evaluation.step_s if best is not None else math.inf)
        late = hurried or past()
        if (bound[cand] >= win or (math.isfinite(win) and late and priced)
                or (best is None and held[cand] >= overflowed)
                or (best is not None and _layout_floor(cand, work()) * (1 - LAYOUT_FLOOR_SLACK) >= win)):
            continue
        priced = True
        link = mesh.axes[mesh.axis_index(cand.axis)].link if cand.axis is not None else None
        for bounds in cuts(cand.stages * cand.virtual_stages):
            pipe = PipelinePlan(cand.axis, cand.stages, cand.virtual_stages, cand.microbatches, cand.schedule, bounds)
            staging = Staging(pipe, parts(PipelinePlan("_", pipe.chunks, 1, 1, "1f1b", bounds)), link)
            for opts in choices[::-1]:
                ev = evaluate(problem, choice, opts, staging, memo)
                least = min(least, ev.peak_bytes)
                if ev.peak_bytes > budget:
                    break
                if best is None or ev.step_s < best.evaluation.step_s * (1 - 1e-12):
                    best = Chosen(cand, pipe if cand.stages > 1 else replace(pipe, boundaries=()), problem,
                                  choice, opts, ev)
        if wanting and best is None:
            overflowed = min(overflowed, held[cand])
    return best, least


LAYOUT_FLOOR_SLACK = 1e-9   # `_layout_floor` sums the evaluator's terms in another order: rounding, not a margin


def layout_work(problem: Problem, choice: Mapping[str, int]) -> float:
    """A floor on the seconds of one microbatch summed over a pipeline's ranks under `choice`, for any
    stages, cut and family options (`evaluate_pipeline`): every node's compute and every edge's cost
    but a parameter gradient's leg (synchronised per step, after the schedule); the runtime's per-node
    cost, the sends between chunks and the families' seconds, which the evaluator adds, are >= 0."""
    return compute_total(problem, choice) + comm_total(problem, choice) - grad_sync_total(problem, choice)


def _layout_floor(cand: Candidate, work: float) -> float:
    """A lower bound on `cand`'s step at the layouts whose `layout_work` is `work`: the ranks' times
    sum to at least `work` a microbatch, so the schedule's T is at least `step_floor`'s (the step ends
    after T). Used once a plan of the group is priced: cuts and options left unpriced where this
    cannot beat it (the group's own re-solves, which follow overflows, are unaffected)."""
    return step_floor(work * cand.microbatches / cand.stages, 0.0, cand.stages, cand.microbatches, cand.schedule,
                      cand.virtual_stages)


def microbatch_floor(cand: Candidate, seconds: float) -> float:
    """A lower bound on `cand`'s step where `seconds` is one below every plan of its group's problem as
    the ILP sees it (`per_step_view`; e.g. its LP relaxation, `ilp.least_seconds`): W + G/m >= `seconds`,
    W the seconds of one microbatch summed over the p ranks (compute, collectives, and the runtime's and
    families' seconds, >= 0), G their gradient legs summed (synchronised once per step). The schedule's T
    >= q W / p, q = m + (p - 1) / v (`step_floor`), and the rank that syncs most ends at least its G / p
    after its last backward, itself at most one microbatch's fill before T >= m W / p: the step >= (m - 1)
    W / p + G / p. The least of the larger of the two over W, G >= 0 with W + G/m >= seconds: q m seconds
    / (p (q + 1)). Unlike `_layout_floor` this needs no solve, and it counts the gradients' sync, which
    the LP without memory rows buys where the layouts of fewer collectives a microbatch hold every
    parameter: GPT-3 175B over (16, 8, 8) H100 piped over tp, whose stage mesh has only inter-node
    links: 7.29, 7.42 and 7.65 s for 32, 48 and 96 microbatches against the 6.942 s step found over dp
    (their plans step 20-24 s); 5.86 s for 12 (solved). 0.0 for the zero-bubble schedule, whose weight
    gradients sync per microbatch."""
    if cand.schedule == "zb":
        return 0.0
    p, m = cand.stages, cand.microbatches
    q = m + (p - 1) / cand.virtual_stages
    return q * m * seconds / (p * (q + 1))


def _boundary_choices(problem: Problem, graph, choice, chunks: int, seconds) -> list[tuple[str, ...]]:
    if chunks == 1:
        return [("",)]
    return list(dict.fromkeys([balanced_boundaries(problem, graph, choice, chunks, seconds()),
                               even_boundaries(layer_sequence(graph), chunks)]))


def _option_choices(problem: Problem, options: Mapping[str, int]) -> list[dict]:
    """The ILP's family options, then with every layer's recomputation raised to selective, then to
    full (where allowed): the ILP saw one microbatch of the whole model on one device, a pipeline
    rank holds fewer layers but several microbatches in flight."""
    out = [dict(options)]
    for level in (1, 2):
        raised = dict(options)
        for g in problem.families.groups:
            if g.family == "recompute" and level in g.allowed and options.get(g.key, g.allowed[0]) < level:
                raised[g.key] = level
        if raised not in out:
            out.append(raised)
    return out
