"""The one price of a complete assignment: a layout per decision and an option per family group.

The ILP (`ilp.py`) is built from the same tables and terms, so for an integral solution its
objective and memory rows equal what `evaluate` returns; the planner's `Plan.estimate`, the
report and `autopar.estimate` all come from here. Works on numbers and on sympy expressions
alike for the layout family's parts (a problem priced at symbolic sizes, `autopar.planner.scaling`).

A pipelined assignment (`Staging`: the problem is one microbatch on the mesh without the
pipeline axis, each node in one model chunk, chunk c on pipeline rank c % stages) is priced from
the same tables, per pipeline rank (`evaluate_pipeline`):

* per microbatch: forward and backward seconds of the rank's nodes and of the edges into them,
  the runtime's per-node cost, the families' per-layer seconds (recompute, re-gather, activation
  offload) for the layers the rank holds, and the point-to-point sends of every tensor entering
  a chunk from the chunk before it (over the pipeline axis' link; its gradient comes back);
* per step: the gradient legs of parameter edges (synchronised once, after the rank's last
  backward: they overlap the cool-down while earlier ranks still drain), the optimizer step of
  the rank's parameters and the per-step families (optimizer offload); a parameter used on
  several ranks (tied embedding and head) is held by each and its gradient all-reduced between them;
* the step: `cost_model.pipeline.pipeline_time` (bubble per schedule), then each rank ends at
  its last backward + its gradient sync + its optimizer step; the step is the latest;
* memory per rank: its state, plus its forward points over one microbatch, plus
  `in_flight_microbatches - 1` more microbatches of what its chunks save; the plan's peak is the
  largest rank's. The first and last chunks hold the nodes before and after the layer stack
  (embedding, head, loss), so their ranks' times and memory carry that imbalance.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from ..cost_model.comm import bucket_launch_time, collective_time, final_bucket_time, p2p_time, transfer_time
from ..cost_model.compute import optimizer_seconds
from ..cost_model.pipeline import in_flight_microbatches, pipeline_time
from ..symbolic import Poly2, smax, ssum
from ..passes.layers import layer_key
from ..plan_records import OFFLOAD_CLASSES
from ..passes.reshard_edges import output_modules, reshards_edge
from .families import Families
from .memory_timeline import (act_bytes, backward_temps, bucket_buffers, grouped_member_sums, memory_points, prefix_sums,
                              window_sums)
from .problem import Problem, picked_edges

# Zero-bubble schedules split each backward into the input gradient and the weight gradient; for a
# matrix multiplication the two are GEMMs of equal FLOPs, so half of the backward of an op that
# takes a parameter is weight gradient (the ZB paper's T_B = T_W for transformer layers).
WEIGHT_GRAD_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class Evaluation:
    compute_s: float                  # forward + backward compute of every op
    comm_s: float                     # resharding, forward and the gradients' way back
    family_s: dict[str, float]        # seconds each family adds (recompute, re-gather, offload transfers)
    peak_bytes: float                 # per device: the largest of the points and the state after the backward
    state_bytes: float                # parameters, gradients and optimizer state kept on the device
    points: tuple                     # bytes at each liveness point (forward and backward)
    tiers: dict[str, float] = field(default_factory=dict)         # bytes held in "host" and "disk"
    freed_bytes: dict[str, float] = field(default_factory=dict)   # family -> bytes it frees at the peak point
    grad_sync_s: float = 0.0          # gradient synchronisation: its part of comm_s plus grad_buckets_s
    grad_buckets_s: float = 0.0       # the gradient buckets' latencies and launches (per step, not in comm_s)
    optimizer_s: float = 0.0          # the optimizer step on the device (offloaded parameters: family_s)
    runtime_s: float = 0.0            # autopar runtime's per-node cost (profile.runtime_op_overhead)
    graph_nodes: int = 0              # modules of the rank's graph (LocalOp, Reshard, ...)
    pipeline: PipelinePrice | None = None   # a pipelined assignment: per pipeline rank (then step_s is its step)

    @property
    def objective_s(self) -> float:
        """What the ILP minimises: compute, communication and the families' seconds (the step less
        the optimizer step, the runtime's per-node cost and the gradient buckets' launches, which
        layouts barely move: a gradient's own transfer is in its edge's cost)."""
        return self.compute_s + self.comm_s + sum(self.family_s.values())

    @property
    def step_s(self) -> float:
        if self.pipeline is not None:
            return self.pipeline.step_s
        return self.objective_s + self.grad_buckets_s + self.optimizer_s + self.runtime_s


@dataclass(frozen=True, slots=True)
class Staging:
    """How a problem's nodes are pipelined: the plan's `PipelinePlan`, node -> model chunk, and the
    link of the pipeline axis (stage-to-stage sends)."""
    pipe: object                      # plan.PipelinePlan (axis, stages, virtual_stages, microbatches, schedule)
    chunk_of: Mapping[str, int]
    link: object                      # cost_model.comm link of the pipeline axis


@dataclass(frozen=True, slots=True)
class StagePrice:
    """One pipeline rank: seconds per microbatch, per step, and its memory."""
    chunks: tuple[int, ...]
    layers: tuple[str, ...]           # the layers its chunks hold, in order
    fwd_s: float                      # one microbatch's forward (compute, collectives, runtime, p2p in)
    bwd_s: float                      # one microbatch's backward (with recompute and the families' seconds)
    weight_grad_s: float              # the weight-gradient part of bwd_s (zero-bubble schedules)
    p2p_s: float                      # one microbatch's sends into its chunks, both directions (in fwd_s + bwd_s)
    grad_sync_s: float                # its parameters' gradient synchronisation per step (zb: m per-microbatch
                                      # reductions, inside bwd_s; otherwise once, after its last backward)
    optimizer_s: float                # its optimizer step (and per-step family seconds)
    state_bytes: float
    saved_bytes: float                # what one microbatch leaves saved at the end of its forward
    in_flight: float                  # microbatches of saved activations it holds at its peak
    peak_bytes: float
    done_s: float                     # when its step ends


@dataclass(frozen=True, slots=True)
class PipelinePrice:
    stages: tuple[StagePrice, ...]
    schedule: str
    microbatches: int
    virtual_stages: int
    pipeline_s: float                 # forward and backward of every microbatch, bubble included
    bubble_s: float
    p2p_s: float                      # point-to-point seconds on the critical path
    step_s: float


def evaluate(problem: Problem, choice: Mapping[str, int], options: Mapping[str, int] | None = None,
             staging: Staging | None = None, memo: dict | None = None) -> Evaluation:
    """Price `choice` (leader -> strategy index) with family `options` (group key -> option index;
    a missing group takes its first allowed option); with `staging`, as a pipeline. `memo`: a dict the
    caller keeps for pipelines of one `problem` and `choice`: what the options leave alone is worked out
    once per cut (`evaluate_pipeline`)."""
    if staging is not None and (staging.pipe.stages > 1 or staging.pipe.microbatches > 1
                                or staging.pipe.virtual_stages > 1):
        return evaluate_pipeline(problem, choice, options, staging, memo)
    fam = problem.families
    on = {**fam.defaults(), **(options or {})}
    family_of = fam.family_of()
    state, points = memory_points(problem, choice)
    family_s: dict[str, float] = {}
    for c in fam.costs:
        if c.applies(on):
            fam_name = family_of[c.gate[0]]
            family_s[fam_name] = family_s.get(fam_name, 0.0) + c.count * smax(0.0, c.expr.value(problem, choice))
    freed = freed_items(problem, choice, on)
    positions = problem.live.positions
    gone = window_sums(positions, ((f.after, f.until, b) for f, b in freed))
    points = [pt - g for pt, g in zip(points, gone)]
    tiers: dict[str, float] = {}
    for h in fam.held:
        if on.get(h.gate[0]) == h.gate[1]:
            tiers[h.tier] = tiers.get(h.tier, 0.0) + h.count * h.expr.value(problem, choice)
    state_dev = state - ssum(b for f, b in freed if f.until >= problem.live.step_end)   # off the device after the backward
    if isinstance(state_dev, Poly2):      # memory as polynomials in B and S (`autopar.planner.scaling`): no one peak
        peak, at = None, -1
    else:
        peak = smax(state_dev, *points)
        at = max(range(len(points)), key=lambda i: points[i]) if points else -1
    by_family: dict[str, float] = {}
    for f, b in freed:
        if at >= 0 and f.after < positions[at] <= f.until:
            g = next(g for g, i in f.gates if on.get(g) == i)
            by_family[family_of[g]] = by_family.get(family_of[g], 0.0) + b
    offloaded = {name for f, _ in freed if f.after < 0 for name, _ in f.expr.nodes}
    nodes = graph_nodes(problem, choice)
    buckets = grad_buckets_total(problem, choice, grads_to_host(problem, freed))
    return Evaluation(compute_total(problem, choice), comm_total(problem, choice), family_s, peak, state_dev,
                      tuple(points), tiers, by_family, grad_sync_total(problem, choice) + buckets, buckets,
                      optimizer_total(problem, choice, offloaded), nodes * problem.mesh.profile.runtime_op_overhead,
                      nodes)


FREED_MEMO = 8      # (layouts, options) pairs whose freed items a problem keeps: the pipeline search prices
                    # one layout choice under up to three option sets (`stages._option_choices`) at every staging


def freed_items(problem: Problem, choice: Mapping[str, int], on: Mapping[str, int]) -> list:
    """(Freed, bytes) of every item freed under the options `on` and the layouts `choice`, kept on the
    problem for the last few pairs (`FREED_MEMO`): the same at every staging of a plan."""
    freed = problem.families.freed
    key = (tuple(choice[n] for n in problem.leaders), tuple(sorted(on.items())))
    hit = problem.freed_memo.get(key)
    if hit is None or hit[0] is not freed:
        if len(problem.freed_memo) >= FREED_MEMO:
            problem.freed_memo.clear()
        hit = problem.freed_memo[key] = (freed, [(f, f.expr.value(problem, choice)) for f in freed if f.frees(on)])
    return hit[1]


def grads_to_host(p: Problem, freed) -> set[str]:
    """Parameters whose gradient leaves the device as it is made: items (Freed, bytes) freed from
    within the step through its end."""
    return {name for f, _ in freed if f.after >= 0 and f.until >= p.live.step_end for name, _ in f.expr.nodes}


def compute_total(p: Problem, choice: Mapping[str, int]):
    return ssum(d.compute_s[choice[d.leader]] for d in p.decisions.values())


def comm_total(p: Problem, choice: Mapping[str, int]):
    return ssum(e.cost[a][b] for e, a, b in picked_edges(p, choice))


def seconds_by_part(p: Problem, choice: Mapping[str, int], part_of: Mapping[str, int], parts: int,
                    output_part: int) -> list:
    """Compute and resharding seconds (forward and backward, one microbatch) summed per part of the
    graph: a node's in its part (`part_of`), an edge's in its consumer's (`output_part` for the
    program's outputs). What the stage-boundary search balances (`decisions.stages.layer_seconds`)."""
    per = [0.0] * parts
    for d in p.decisions.values():
        per[part_of[d.name]] += d.compute_s[choice[d.leader]]
    for e, a, b in picked_edges(p, choice):
        per[output_part if e.dst == "output" else part_of[e.dst]] += e.cost[a][b]
    return per


def per_microbatch_seconds(cost, fwd, microbatches: int) -> list[list[float]]:
    """[a][b] seconds of a parameter edge per microbatch of `microbatches`: its forward gather every
    microbatch, its gradient's leg (synchronised once per step) a 1/microbatches share."""
    k = 1.0 / microbatches
    return [[f + k * (c - f) for c, f in zip(rc, rf)] for rc, rf in zip(cost, fwd)]


def grad_sync_total(p: Problem, choice: Mapping[str, int]):
    """Seconds of the gradient legs of parameter edges in the edge tables: a gradient reduced in a
    bucket its transfer (less what the backward hides), any other its own collectives."""
    return ssum(e.cost[a][b] - e.fwd[a][b] for e, a, b in picked_edges(p, choice)
                if p.decisions[e.src].kind == "param" and e.fwd is not None)


def grad_buckets_total(p: Problem, choice: Mapping[str, int], alone=frozenset()) -> float:
    """The gradient buckets' latencies and launches per step (runtime/grad_sync.py), and the part of the
    last bucket of each kind the overlap took off (`final_bucket_time`: it leaves when the backward
    ends): the bucketed gradients' bytes summed per bucket kind, `profile.grad_bucket_bytes` to a bucket; parameters in
    `alone` (gradients moved to the host as they are made) are reduced outside the buckets."""
    per_kind: dict = {}
    for e, a, b in picked_edges(p, choice):
        if e.sync is not None and e.sync[a][b] is not None and e.src not in alone:
            kind, nbytes, _ = e.sync[a][b]
            per_kind[kind] = per_kind.get(kind, 0.0) + nbytes
    prof = p.mesh.profile
    launch = prof.kernel_overhead + prof.collective_overhead        # per collective, as Mesh.reshard_cost
    return sum(bucket_launch_time(k, nb, prof.grad_bucket_bytes, launch)
               + final_bucket_time(k, nb, prof.grad_bucket_bytes, prof.grad_sync_overlap) for k, nb in per_kind.items())


def optimizer_total(p: Problem, choice: Mapping[str, int], offloaded=frozenset(), only=None) -> float:
    """The optimizer step on the device over every parameter whose state is not offloaded (and is
    in `only`, when given: one pipeline rank's)."""
    params = [d for d in p.decisions.values() if d.kind == "param" and d.name not in offloaded
              and (only is None or d.name in only)]
    total = 0.0
    for mixed in (False, True):      # one fused step over the parameters of each precision
        group = [d for d in params if d.mixed == mixed]
        if group:
            total += optimizer_seconds(ssum(d.elements[choice[d.leader]] for d in group), len(group),
                                       p.mesh.profile, p.optimizer, mixed)
    return total


def graph_nodes(p: Problem, choice: Mapping[str, int]) -> int:
    """Modules of the rank's graph the runtime runs per step (runtime/rewrite.py): one per op but
    getitem, a Reshard per edge that needs one, two per graph output."""
    return sum(k for _, k in node_modules(p, choice))


def node_modules(p: Problem, choice: Mapping[str, int]):
    """(node, modules the rewrite makes for it or on the edge into it; "output" for the outputs')."""
    for d in p.decisions.values():
        if d.kind == "op" and d.facts.op != "getitem":
            yield d.name, 1
    for e, a, b in picked_edges(p, choice):
        src = p.decisions[e.src]
        if e.dst == "output":
            yield "output", output_modules(False, tuple(src.strategies[choice[src.leader]].output), p.mesh.shape)
        else:
            t = p.decisions[e.dst].strategies[choice[p.decisions[e.dst].leader]]
            yield e.dst, int(reshards_edge(src.kind, tuple(src.strategies[choice[src.leader]].output),
                                           tuple(t.inputs[e.slot]), p.mesh.shape))


def effective_options(problem: Problem, choice: Mapping[str, int], options: Mapping[str, int]) -> dict[str, int]:
    """`options`, with every group whose option does nothing under `choice` (frees, holds and costs
    nothing: re-gathering a parameter that is never gathered) set back to its default, so that a
    plan records, and the runtime runs, only what matters. The price is unchanged."""
    fam = problem.families
    out = {**fam.defaults(), **options}
    busy = {c.gate for c in fam.costs if c.expr.value(problem, choice) > 0}
    busy |= {h.gate for h in fam.held if h.expr.value(problem, choice) > 0}
    busy |= {g for f in fam.freed if f.expr.value(problem, choice) > 0 for g in f.gates}
    for g in fam.groups:
        if out[g.key] != g.allowed[0] and (g.key, out[g.key]) not in busy:
            out[g.key] = g.allowed[0]
    return out


def chosen_options(fam: Families, options: Mapping[str, int]) -> dict[str, dict[str, str]]:
    """family -> {plan key -> option name}: what a plan records (`Plan.recompute`, ...)."""
    out: dict[str, dict[str, str]] = {}
    for g in fam.groups:
        name = g.options[options.get(g.key, g.allowed[0])]
        for m in g.members:
            out.setdefault(g.family, {})[m] = name
    return out


def recorded_options(fam: Families, recorded: Mapping[str, Mapping[str, str]]) -> dict[str, int]:
    """The group options a plan records (family -> {member: option name}; `chosen_options` inverted).
    A member the record does not name takes its group's default."""
    out = {}
    for g in fam.groups:
        names = sorted({recorded.get(g.family, {}).get(m) for m in g.members} - {None})
        if len(names) > 1:
            raise ValueError(f"the plan gives {g.family} options {names} to {', '.join(g.members)}, which are "
                             f"linked (repeated layers share one decision): give them one option")
        if names and names[0] not in g.options:
            raise ValueError(f"{g.family} option {names[0]!r} for {g.members[0]} is not one of {g.options}")
        out[g.key] = g.options.index(names[0]) if names else g.allowed[0]
    return out


def evaluate_pipeline(problem: Problem, choice: Mapping[str, int], options: Mapping[str, int] | None,
                      staging: Staging, memo: dict | None = None) -> Evaluation:
    """Price a pipelined assignment per pipeline rank (the module docstring says how). `memo`:
    `evaluate`'s; the chunks' seconds and bytes but the families' (`_layout_chunks`) and the ranks'
    timelines (`_Timelines`) are the same for every option and schedule of a cut: kept there by cut (its
    `chunk_of` kept with them, so that its id names no other while the memo lasts)."""
    pipe = staging.pipe
    p, v, m = pipe.stages, pipe.virtual_stages, pipe.microbatches
    on = {**problem.families.defaults(), **(options or {})}
    memo = {} if memo is None else memo
    key = (id(staging.chunk_of), p, v, pipe.schedule == "zb", staging.link)
    if key not in memo:
        memo[key] = (staging.chunk_of, _layout_chunks(problem, choice, staging),
                     _Timelines(problem, choice, staging.chunk_of, p, v))
    _, base, timelines = memo[key]
    ch = replace(base, bwd=list(base.bwd), once=list(base.once), fam_s=[{} for _ in base.fam_s])
    ch.per_step = _family_seconds(problem, choice, on, ch.terms, ch.bwd, ch.once, ch.fam_s)
    ranks = [tuple(range(r, p * v, p)) for r in range(p)]
    sums = lambda xs, r: sum(xs[c] for c in ranks[r])  # noqa: E731
    f_r = [sums(ch.fwd, r) + sums(ch.p2p, r) for r in range(p)]
    b_r = [sums(ch.bwd, r) + sums(ch.p2p, r) for r in range(p)]
    pt = pipeline_time(f_r, b_r, m, virtual_stages=v,
                       weight_grad=[sums(ch.wgrad, r) for r in range(p)] if pipe.schedule == "zb" else None)
    mem = _rank_memory(problem, choice, on, timelines, ch.terms, ch.state, ch.grads, pipe)
    stages, drained = [], 0.0
    params, layers_of = _per_rank(problem, staging.chunk_of, p)
    for r in range(p):
        opt = optimizer_total(problem, choice, mem.offloaded, params[r]) + sums(ch.once, r)
        done = pt.total_s - drained + sums(ch.sync, r) + opt      # rank r's last backward ends `drained` early
        drained += b_r[r] / v
        layers = tuple(dict.fromkeys(layers_of[r]))
        stages.append(StagePrice(ranks[r], layers, f_r[r], b_r[r], sums(ch.wgrad, r), 2 * sums(ch.p2p, r),
                                 sums(ch.sync, r) + m * sums(ch.wsync, r), opt, mem.state[r], mem.saved[r], mem.in_flight[r], mem.peak[r],
                                 done))
    slow = max(range(p), key=lambda r: pt.per_device_s[r])
    top = max(range(p), key=lambda r: mem.peak[r])
    family: dict[str, float] = {}
    for c in ranks[slow]:
        for k, x in ch.fam_s[c].items():
            family[k] = family.get(k, 0.0) + m * x
        for k, x in ch.per_step[c].items():
            family[k] = family.get(k, 0.0) + x
    price = PipelinePrice(tuple(stages), pipe.schedule, m, v, pt.total_s, pt.bubble_s, m * stages[slow].p2p_s,
                          max(s.done_s for s in stages))
    sync = sums(ch.sync, slow)
    return Evaluation(m * sums(ch.comp, slow), m * (sums(ch.comm, slow) - sync) + sync, family, mem.peak[top],
                      mem.state[top], tuple(mem.points[top]), mem.tiers[top], {},
                      grad_sync_s=max(s.grad_sync_s for s in stages), optimizer_s=max(s.optimizer_s for s in stages),
                      runtime_s=m * sums(ch.runtime, slow),
                      graph_nodes=ch.modules, pipeline=price)


@dataclass(slots=True)
class _Chunks:
    """Per model chunk: seconds of one microbatch (fwd, bwd, its weight-gradient part wgrad, compute
    comp, collectives comm, runtime, p2p sends into it, the gradient reductions of the zero-bubble weight
    pass wsync, in bwd), per step (sync, once), the families' seconds
    (fam_s per microbatch, per_step), state and gradient bytes, where family terms land (terms), and
    the modules of the rank's graph (`node_modules`, all chunks)."""
    fwd: list
    bwd: list
    wgrad: list
    comp: list
    comm: list
    runtime: list
    p2p: list
    wsync: list
    sync: list
    once: list
    fam_s: list
    per_step: list
    state: list
    grads: list
    terms: tuple
    modules: int = 0


def _layout_chunks(problem: Problem, choice, staging: Staging) -> _Chunks:
    """The chunks' seconds and bytes but the families' (`_family_seconds` adds those: per_step, fam_s, and
    their part of bwd and once)."""
    chunk_of, pipe, dec = staging.chunk_of, staging.pipe, problem.decisions
    n, p = pipe.stages * pipe.virtual_stages, pipe.stages
    where = lambda name: n - 1 if name == "output" else chunk_of[name]  # noqa: E731
    ch = _Chunks(*([0.0] * n for _ in range(10)), [dict() for _ in range(n)], [], [], [], _term_chunks(problem, chunk_of))
    weighted = {e.dst for e in problem.edges if dec[e.src].kind == "param"}
    for d in dec.values():
        i, c = choice[d.leader], chunk_of[d.name]
        f = d.fwd_s[i] if d.fwd_s else 0.0
        ch.fwd[c] += f
        ch.bwd[c] += d.compute_s[i] - f
        ch.comp[c] += d.compute_s[i]
        if d.name in weighted:
            ch.wgrad[c] += WEIGHT_GRAD_SHARE * (d.compute_s[i] - f)
    entering, users = _edge_costs(problem, choice, staging, ch, where)
    for name, k in node_modules(problem, choice):
        ch.runtime[where(name)] += k * problem.mesh.profile.runtime_op_overhead
        ch.modules += k
    for c in range(n):
        ch.fwd[c] += ch.runtime[c]
        ch.bwd[c] += ch.wsync[c]
        ch.wgrad[c] += ch.wsync[c]
        ch.p2p[c] = sum(p2p_time(b, staging.link) for b in entering[c].values()) if p > 1 else 0.0
    ch.state, ch.grads = [0.0] * n, [0.0] * n
    for d in dec.values():
        for c in users.get(d.name, {chunk_of[d.name]}):
            ch.state[c] += d.state_bytes[choice[d.leader]]
            ch.grads[c] += d.grad_bytes[choice[d.leader]] if d.grad_bytes else 0.0
    for name, cs in users.items():      # tied parameters: their gradients all-reduced over the ranks using them
        held = sorted({c % p for c in cs})
        if len(held) > 1:
            d = dec[name]
            nbytes = d.grad_bytes[choice[d.leader]] if d.grad_bytes else 0.0
            for r in held:
                t = collective_time("all_reduce", nbytes, len(held), staging.link)
                ch.sync[r] += t
                ch.comm[r] += t
    return ch


def _edge_costs(problem: Problem, choice, staging: Staging, ch: _Chunks, where):
    """Add the edges' seconds to the chunks of their consumers (`where`); returns per chunk the tensors
    sent into it (name -> bytes) and per parameter the chunks using it."""
    chunk_of, pipe, dec = staging.chunk_of, staging.pipe, problem.decisions
    entering: list[dict[str, float]] = [dict() for _ in ch.fwd]    # chunk -> tensors sent into it
    users: dict[str, set[int]] = {}                                 # parameter -> chunks using it
    for e, a, b in picked_edges(problem, choice):
        src, c = dec[e.src], where(e.dst)
        f = e.fwd[a][b] if e.fwd is not None else e.cost[a][b]
        ch.fwd[c] += f
        ch.comm[c] += e.cost[a][b]
        if src.kind == "param":
            users.setdefault(e.src, {chunk_of[e.src]}).add(c)
            if pipe.schedule == "zb":
                # zero bubble: the weight pass reduces each gradient alone, every microbatch (no bucket:
                # runtime/pipeline.py), as its reshard: the bucketed leg and what it costs alone
                s = e.sync[a][b] if e.sync is not None else None
                alone = e.cost[a][b] - f + (s[2] if s is not None else 0.0)
                ch.wsync[c] += alone
                ch.comm[c] += alone - (e.cost[a][b] - f)
            else:
                # deferred to the schedule's end (runtime/pipeline.py): no backward left to hide it behind
                s = e.sync[a][b] if e.sync is not None else None
                hidden = (problem.mesh.profile.grad_sync_overlap * transfer_time(s[0].collective, s[1], s[0].n, s[0].link)
                          if s is not None else 0.0)
                ch.sync[c] += e.cost[a][b] - f + hidden
        else:
            ch.bwd[c] += e.cost[a][b] - f
            if chunk_of[e.src] != c and src.kind == "op":     # inputs reach every rank from its data loader
                entering[c][e.src] = src.act_bytes[choice[src.leader]]
    return entering, users


def _term_chunks(problem: Problem, chunk_of: Mapping[str, int]):
    """(chunk of a family group's member, chunk of a term's first node or edge)."""
    last = max(chunk_of.values(), default=0)
    layer_chunk: dict[str, int] = {}
    for n in problem.order:
        if n in problem.layer:
            layer_chunk.setdefault(problem.layer[n], chunk_of[n])
    fqn_chunk = {d.fqn: chunk_of[d.name] for d in problem.decisions.values() if d.kind == "param"}

    seen: dict[str, int] = {}       # member -> chunk: a family group's members are asked once per cost

    def member(m: str) -> int:
        if m in seen:
            return seen[m]
        kind, sep, what = m.partition(":")
        what = what if sep and kind in OFFLOAD_CLASSES else m
        if what in layer_chunk:
            c = layer_chunk[what]
        else:
            c = fqn_chunk.get(what, layer_chunk.get(layer_key(what) or "", 0))
        seen[m] = c
        return c

    def term(expr) -> int:
        if expr.nodes:
            return chunk_of[expr.nodes[0][0]]
        if expr.edges:
            dst = problem.edges[expr.edges[0][0]].dst
            return last if dst == "output" else chunk_of[dst]
        return 0
    return member, term


def _shares(group, member) -> dict[int, float]:
    """chunk -> the fraction of a group's members (linked layers, parameters) it holds."""
    out: dict[int, float] = {}
    for m_ in group.members:
        c = member(m_)
        out[c] = out.get(c, 0.0) + 1.0 / len(group.members)
    return out


def _family_seconds(problem: Problem, choice, on, chunks, bwd: list, once: list, fam_s: list) -> list[dict]:
    """Add the families' seconds to the chunks holding their layers: per microbatch to `bwd` (and
    `fam_s`), per step (optimizer offload) to `once`; returns the per-step seconds by chunk and family."""
    member, _ = chunks
    groups = {g.key: g for g in problem.families.groups}
    shares: dict = {}           # group key -> its `_shares` (many costs gate on one group)
    per_step = [dict() for _ in bwd]
    for c in problem.families.costs:
        if not c.applies(on):
            continue
        g = groups[c.gate[0]]
        total = c.count * smax(0.0, c.expr.value(problem, choice))
        step_wise = any(x.startswith("optimizer:") for x in g.members)
        if g.key not in shares:
            shares[g.key] = _shares(g, member)
        for k, share in shares[g.key].items():
            (once if step_wise else bwd)[k] += share * total
            book = per_step[k] if step_wise else fam_s[k]
            book[g.family] = book.get(g.family, 0.0) + share * total
    return per_step


def _per_rank(problem: Problem, chunk_of: Mapping[str, int], p: int) -> tuple[list[set], list[list]]:
    """Per pipeline rank (of p): its parameters, and the layers of its nodes in graph order (repeats
    kept), in one pass over the nodes."""
    params: list[set] = [set() for _ in range(p)]
    layers: list[list] = [[] for _ in range(p)]
    for n, d in problem.decisions.items():
        if d.kind == "param":
            params[chunk_of[n] % p].add(n)
    for n in problem.order:
        if n in problem.layer:
            layers[chunk_of[n] % p].append(problem.layer[n])
    return params, layers


@dataclass(slots=True)
class _RankMemory:
    state: list            # per rank, on the device (offloaded optimizer state left out)
    saved: list
    in_flight: list
    peak: list
    points: list           # per rank: bytes at each point of the step, in-flight microbatches included
    tiers: list            # per rank: tier -> bytes
    offloaded: set


def _rank_memory(problem: Problem, choice, on, timelines: _Timelines, chunks, state: list, grads: list,
                 pipe) -> _RankMemory:
    """Per rank: `memory_points` over the nodes its chunks hold, plus `in_flight - 1` more
    microbatches of what they save (at the end of the forward) at every point of the step."""
    p, live = pipe.stages, problem.live
    member, term = chunks
    rank = lambda c: c % p  # noqa: E731
    positions = live.positions
    freed = freed_items(problem, choice, on)
    freed_on: list[list] = [[] for _ in range(p)]      # per rank, (Freed, bytes) of the items it frees
    for f, b in freed:
        freed_on[rank(term(f.expr))].append((f, b))
    fwd_end = max((t for t, w in enumerate(positions) if w <= live.last), default=-1)
    by_rank = lambda xs: [sum(xs[c] for c in range(r, len(xs), p)) for r in range(p)]  # noqa: E731
    st, gr = by_rank(state), by_rank(grads)
    out = _RankMemory([], [], [], [], [], [], {n for f, _ in freed if f.after < 0 for n, _ in f.expr.nodes})
    for r in range(p):
        gone = window_sums(positions, ((f.after, f.until, b) for f, b in freed_on[r]))
        one = timelines.points(r, gone)
        k = in_flight_microbatches(r, p, pipe.microbatches, pipe.schedule, pipe.virtual_stages)
        saved = one[fwd_end] if fwd_end >= 0 else 0.0
        fwd_state = st[r] - gr[r]
        pts = [fwd_state + x + (k - 1) * saved for x in one]
        device_state = st[r] - sum(b for f, b in freed_on[r] if f.until >= live.step_end)
        out.state.append(device_state)
        out.saved.append(saved)
        out.in_flight.append(k)
        out.points.append(pts)
        out.peak.append(max(device_state, *pts))
    out.tiers = _rank_tiers(problem, choice, on, p, rank, member)
    return out


class _Timelines:
    """Per pipeline rank, what its chunks hold at each point of one microbatch whatever the family
    options: `points` subtracts what they free. Each point's sum keeps the order of the one it was
    split from, so every bit is the same."""

    def __init__(self, problem: Problem, choice, chunk_of, p: int, v: int):
        live = problem.live
        rank = lambda c: c % p  # noqa: E731
        last = p * v - 1
        positions, n_pts = live.positions, len(live.positions)
        size, rank_of = (lambda n: act_bytes(problem, n, choice)), (lambda n: rank(chunk_of[n]))  # noqa: E731
        owned = grouped_member_sums(live.point_changes, size, rank_of, p)
        moving = grouped_member_sums(live.grad_changes, size, rank_of, p) if live.grads else [[0.0] * n_pts] * p
        copies: list[list] = [[] for _ in range(p)]
        for e, a, b in picked_edges(problem, choice):
            r = rank(last if e.dst == "output" else chunk_of[e.dst])
            copies[r].append((e.dst_pos, e.saved[a][b], e.temp[a][b] if e.temp else 0.0))
        made: list[list] = [[] for _ in range(p)]
        for n, d in problem.decisions.items():
            if d.grad_bytes:
                made[rank(chunk_of[n])].append((problem.grad_since(n), d.grad_bytes[choice[d.leader]]))
        buckets = bucket_buffers(problem, choice)     # the whole model's: no less than any rank's own
        since = problem.buckets_from
        back = [[0.0] * n_pts for _ in range(p)]
        for t, name, nbytes in backward_temps(problem, choice):
            back[rank_of(name)][t] += nbytes
        mirrors = [live.mirror(where) for where in positions]
        self.held, self.added = [], []     # per rank, per point: before the frees; after them, in the backward
        for r in range(p):
            cs = sorted(copies[r], key=lambda x: x[0])
            kept, kept_at = prefix_sums([b for _, b, _ in cs]), [pos for pos, _, _ in cs]
            temps: dict = {}
            for pos, _, tmp in cs:
                temps[pos] = temps.get(pos, 0.0) + tmp
            ms = sorted(made[r], key=lambda x: x[0])
            grown, grown_at = prefix_sums([b for _, b in ms]), [since for since, _ in ms]
            self.held.append([o + m + kept[bisect_right(kept_at, mirrors[t])] + temps.get(where, 0.0)
                              for t, (o, m, where) in enumerate(zip(owned[r], moving[r], positions))])
            self.added.append([(grown[bisect_right(grown_at, where)], back[r][t], buckets if where >= since else 0.0)
                               if where > live.last else None for t, where in enumerate(positions)])

    def points(self, r: int, gone: list) -> list:
        """Rank r's bytes at each point of one microbatch, less `gone` (what the options free there)."""
        out = []
        for x, g, add in zip(self.held[r], gone, self.added[r]):
            x -= g
            out.append(x if add is None else x + add[0] + add[1] + add[2])
        return out


def _rank_tiers(problem: Problem, choice, on, p: int, rank, member) -> list[dict[str, float]]:
    """Per pipeline rank (of p): tier -> bytes it holds there, its share of each held term's group."""
    groups = {g.key: g for g in problem.families.groups}
    shares: dict = {}           # group key -> per rank, the fraction of the group's members it holds
    tiers: list[dict[str, float]] = [{} for _ in range(p)]
    for h in problem.families.held:
        if on.get(h.gate[0]) == h.gate[1]:
            if h.gate[0] not in shares:
                held = _shares(groups[h.gate[0]], member)
                shares[h.gate[0]] = [sum(x for c, x in held.items() if rank(c) == r) for r in range(p)]
            value = h.expr.value(problem, choice)
            for r, share in enumerate(shares[h.gate[0]]):
                tiers[r][h.tier] = tiers[r].get(h.tier, 0.0) + share * h.count * value
    return tiers
