"""The planning pipeline: capture -> annotate -> strategies and costs -> ILP -> Plan."""
from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from ..errors import InfeasibleError, PlanMismatchError, PlanOptionError, ShardingError
from ..mesh import Mesh
from ..passes.capture import Captured, capture
from ..passes.shape_prop import annotate, tensor_meta
from ..placement import layout_str, parse_pin
from ..passes.symbolic_shapes import SymbolicUnavailable, symbolic_graph
from ..plan import Collective, Estimate, NodePlan, Plan, Scaling, SolverInfo, Timings
from .cache import PlanCache
from .scaling import Planned, build_scaling
from ..solver.decisions import add_families
from ..solver.evaluate import Evaluation, Staging, chosen_options, effective_options, evaluate, recorded_options
from ..solver.solve import min_memory, solve
from ..solver.problem import Problem, build_problem, chosen_edges, edge_legs, op_exchanges
from ..strategies import op_name, rule_for
from ..strategies.attention import context_axis
from ..strategies.moe import check_capacity_factor


@dataclass(frozen=True, slots=True)
class PlanOptions:
    memory_budget: float | None = None          # bytes per device; default: the profile's memory_budget
    pins: Mapping[str, Sequence[str]] | None = None
    batch_axes: Sequence[str] | None = None     # inputs arrive split on dim 0 over these axes
    sharded_outputs: bool = False               # leave outputs in their planned layout
    optimizer: str = "adamw"
    time_limit: float | None = 60.0
    progress: bool = field(default_factory=lambda: sys.stderr.isatty())   # a line every 5 s of solving
    cache_dir: str | None = None                # reuse plans solved before (see planner/cache.py)
    symbolic: bool = True                       # price the plan in B and S too (Plan.estimate_at; planner/scaling.py)
    recompute: str = "auto"                     # "auto" | "none" | "selective" | "full"
    residency: str = "auto"                     # "auto" | "keep" | "regather"
    offload: str = "auto"                       # "auto" | "none" | "host" | "disk"
    precision: str = "auto"                     # optimizer state: "auto" | "same" | "mixed" (cost_model.memory)
    pipeline: Mapping | bool | None = None      # plan(): None chooses, False forbids, a dict fixes keys;
                                                # make_plan() plans without one (planner/pipeline_search.py)
    moe_capacity_factor: float | None = None    # None: dropless MoE routing; a number: each expert's capacity
                                                # (runtime/experts.py)
    stage: bool = False                         # one pipeline stage's problem (planner/pipeline.stage_options)
    on_phase: Callable[[str, str], None] | None = None   # called as each phase starts (autopar/progress.py)

    def __post_init__(self):
        check_capacity_factor(self.moe_capacity_factor)
        for name, layout in (self.pins or {}).items():
            if isinstance(layout, str) or not isinstance(layout, Sequence):
                raise ShardingError(f"pin {name!r}: {layout!r} is not a layout: give one placement (or strategy "
                                    f"label) per mesh axis, e.g. ('S(0)', 'R') or ('batch', 'ring')")
            try:
                parse_pin(layout)
            except (ValueError, TypeError) as e:
                raise ShardingError(f"pin {name!r}: {e}") from None

    def to_dict(self) -> dict:
        return {"memory_budget": self.memory_budget,
                "pins": {k: list(v) for k, v in sorted((self.pins or {}).items())},
                "batch_axes": list(self.batch_axes or []), "sharded_outputs": self.sharded_outputs,
                "optimizer": self.optimizer, "symbolic": self.symbolic, "recompute": self.recompute,
                "residency": self.residency, "offload": self.offload, "precision": self.precision,
                "pipeline": (dict(sorted(self.pipeline.items())) if isinstance(self.pipeline, Mapping)
                             else self.pipeline),
                "moe_capacity_factor": self.moe_capacity_factor, **({"stage": True} if self.stage else {})}

    @classmethod
    def from_dict(cls, d: Mapping) -> PlanOptions:
        """The options a plan was made with (`Plan.options`), to rebuild its planning problem."""
        keep = {k: d[k] for k in ("memory_budget", "sharded_outputs", "optimizer", "symbolic", "recompute",
                                  "residency", "offload", "precision", "pipeline", "moe_capacity_factor", "stage")
                if k in d}
        return cls(pins=dict(d.get("pins") or {}) or None, batch_axes=tuple(d.get("batch_axes") or ()) or None,
                   progress=False, **keep)

    @property
    def frees_activations(self) -> bool:
        return self.recompute != "none" or self.offload != "none"


def fingerprint(cap: Captured) -> str:
    """The captured graph's identity: per node its op, target, output shapes and dtypes, and its
    arguments with every constant among them (a softmax's dim, an attention's is_causal, a view's
    sizes): two graphs that differ in any of these are different problems (the plan cache, `check_plan`)."""
    h = hashlib.sha256()
    for n in cap.gm.graph.nodes:
        metas = tensor_meta(n.meta.get("val")) if n.op != "output" else ()
        h.update(f"{n.op}|{n.name}|{op_name(n.target) if n.op == 'call_function' else n.target}|"
                 f"{[(m.shape, str(m.dtype)) for m in metas]}|{_constant_text(n.args)}|"
                 f"{_constant_text(n.kwargs)}\n".encode())
    return h.hexdigest()[:16]


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _constant_text(v) -> str:
    """A node argument as text that is the same on every run: another node by its name, a constant
    by its value, a container item by item; anything else by its type (a repr may hold an address)."""
    if isinstance(v, torch.fx.Node):
        return f"%{v.name}"
    if isinstance(v, _PLAIN):
        return repr(v)
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(_constant_text(x) for x in v) + ")"
    if isinstance(v, Mapping):
        return "{" + ",".join(f"{k}:{_constant_text(x)}" for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))) + "}"
    if isinstance(v, slice):
        return f"slice({_constant_text(v.start)},{_constant_text(v.stop)},{_constant_text(v.step)})"
    if isinstance(v, torch.Tensor):
        return f"tensor{tuple(v.shape)}{v.dtype}"
    return type(v).__qualname__


def make_plan(model: torch.nn.Module, args: tuple, kwargs: dict | None, mesh: Mesh, opts: PlanOptions) -> Plan:
    t0 = time.perf_counter()
    phase(opts, "capture")
    with frozen_gc():       # the model and everything before the call left out of the collector's passes
        return plan_captured(capture(model, args, kwargs), mesh, opts, t0, source=(model, args, kwargs))


def plan_captured(cap: Captured, mesh: Mesh, opts: PlanOptions, t0: float | None = None,
                  source: tuple | None = None) -> Plan:
    """Plan a captured graph; `source` = (model, args, kwargs) it came from, for symbolic costs.
    No pipeline: `pipeline_search.search_pipeline` chooses among pipelines."""
    t0 = time.perf_counter() if t0 is None else t0
    cache = PlanCache.open(opts.cache_dir)
    key = cache.key(fingerprint(cap), mesh, opts) if cache else None
    if cache and (hit := cache.get(key)) is not None:
        hit.timings = Timings(0.0, time.perf_counter() - t0, cached=True)
        phase(opts, "done", "from the plan cache")
        return hit
    plan = _solve_captured(cap, mesh, opts, t0, source)
    if cache:
        cache.put(key, plan)
    return plan


def _solve_captured(cap: Captured, mesh: Mesh, opts: PlanOptions, t0: float, source: tuple | None) -> Plan:
    # the solver's first plans whatever the time limit (`floor`): cut at the limit before them, the answer
    # was the most sharded plan, 11x the best step on Gemma-2-9B and Qwen3-8B over (8, 8) at time_limit=5
    # on a loaded machine, where the LP relaxation's rounded layouts are near the best (issue 37)
    with frozen_gc():
        return solve_captured(cap, mesh, opts, t0, source, floor=True)


@contextlib.contextmanager
def frozen_gc():
    """Planning builds millions of long-lived objects (the graph, the liveness sets, the ILP's rows);
    every full pass of Python's cyclic garbage collector walked them all again (2.7 of 18 CPU
    seconds on Llama-3-8B over 64 devices, 6.5 of 40 in GPT-3's pipeline search). What exists on
    entry is frozen (`gc.freeze`: left out of later passes), and so is what the planner calls
    gc.freeze() on once built (a problem, a capture); all is thawed on exit. Young garbage is still
    collected. Re-entrant: only the outermost use thaws, and only where nothing was frozen before it
    (objects the caller froze stay frozen: gc cannot thaw ours alone, so ours stay frozen with them)."""
    thaw = gc.get_freeze_count() == 0
    gc.freeze()
    try:
        yield
    finally:
        if thaw:
            gc.unfreeze()


def solve_captured(cap: Captured, mesh: Mesh, opts: PlanOptions, t0: float, source: tuple | None,
                   deadline: float | None = None, infos=None, floor: bool = False, problem: Problem | None = None
                   ) -> Plan:
    """The plan of a captured graph without a pipeline, uncached; `deadline`: when it must be
    done (default: the time limit from now: the capture aside, the whole call within it); `infos`:
    its annotations where the caller made them. `floor`: the solver's first plans (`solver.solve`'s:
    the most sharded plan and the LP relaxation's layouts rounded) are found whatever the deadline (a
    search's first plan, the same on every run however loaded the machine). `problem`: its
    `planning_problem` where the caller built it."""
    deadline = deadline_of(opts) if deadline is None else deadline
    phase(opts, "strategies")
    infos = annotate(cap.gm) if infos is None else infos
    problem = planning_problem(cap, infos, mesh, opts) if problem is None else problem
    gc.freeze()
    budget = opts.memory_budget if opts.memory_budget is not None else mesh.profile.memory_budget
    phase(opts, "solve", f"{len(problem.leaders)} decisions")
    try:
        result, priced = solve_within(problem, budget, deadline, opts.progress, floor)
    except InfeasibleError as e:
        raise _with_hint(e, cap, infos, mesh, opts) from None
    plan = assemble(cap, problem, result.choice, mesh, opts, result.options, priced=priced)
    if not opts.symbolic:
        plan.scaling = Scaling(unavailable="not asked for (symbolic=False)")
    elif source is None:
        plan.scaling = Scaling(unavailable="the graph was given without its model (torch.compile)")
    else:
        plan.pending_scaling = lazy_scaling(cap, infos, problem, result.choice, opts, budget, source, plan)
    plan.solver = SolverInfo(result.solver, result.status, result.n_variables, result.n_constraints,
                             result.objective, len(problem.leaders), len(problem.order), len(problem.rep),
                             result.gap, cap.trace)
    plan.timings = Timings(result.seconds, time.perf_counter() - t0)
    phase(opts, "done", f"{result.solver}: {result.status}")
    return plan


def phase(opts: PlanOptions, name: str, note: str = "") -> None:
    """Phase `name` of the call starts (`opts.on_phase`: autopar/progress.py prints it)."""
    if opts.on_phase is not None:
        opts.on_phase(name, note)


BUDGET_RETRIES = 3     # re-solves when the solver's feasibility tolerance lets a plan over the budget


def deadline_of(opts: PlanOptions) -> float | None:
    """When a planning call started now must end (`time_limit` from now; None: no limit)."""
    return None if opts.time_limit is None else time.perf_counter() + opts.time_limit


def remaining(deadline: float | None) -> float | None:
    """Seconds left to `deadline` (none left: 0, and the solver returns its first plan)."""
    return None if deadline is None else max(deadline - time.perf_counter(), 0.0)


def solve_within(problem: Problem, budget: float, deadline: float | None, progress: bool = False,
                 floor: bool = False):
    """(SolveResult, its Evaluation) by `deadline`: solve, and check the answer with the evaluator: a MIP solver
    accepts rows a tolerance over their bound, so a plan it returns may price a few bytes over the
    budget; then solve again with the budget lowered by the excess. `floor`: as `solver.solve`'s."""
    target = budget
    for _ in range(BUDGET_RETRIES):
        result = solve(problem, target, remaining(deadline), progress=progress, floor=floor)
        ev = evaluate(problem, result.choice, effective_options(problem, result.choice, result.options))
        over = ev.peak_bytes - budget
        if over <= 0:
            return result, ev
        target -= over + 1.0
    raise InfeasibleError(f"the solver's plans stay {over:.0f} bytes over the budget of {budget:.0f} bytes per "
                          f"device after {BUDGET_RETRIES} tries (its feasibility tolerance): raise memory_budget "
                          f"slightly", budget + over)


def planning_problem(cap: Captured, infos, mesh: Mesh, opts: PlanOptions) -> Problem:
    """The planning problem: the layout family, then the others as the options allow."""
    return with_families(layout_problem(cap, infos, mesh, opts), opts)


def layout_problem(cap: Captured, infos, mesh: Mesh, opts: PlanOptions) -> Problem:
    """The planning problem's layout family alone (what a lower bound on its seconds needs,
    `ilp.least_seconds`); `with_families` adds the others."""
    return build_problem(cap, infos, mesh, pins=opts.pins, optimizer=opts.optimizer, batch_axes=opts.batch_axes,
                         sharded_outputs=opts.sharded_outputs, precision=opts.precision,
                         saved_frees=opts.frees_activations, capacity_factor=opts.moe_capacity_factor)


def with_families(problem: Problem, opts: PlanOptions) -> Problem:
    """`problem` (a `layout_problem`) with the decision families the options allow, in place."""
    try:
        # a pipeline stage's problem (`opts.stage`) offers no gradient offload: the pipelined runtime
        # sums a tied parameter's gradient over its ranks after the schedule, on the device
        return add_families(problem, recompute_mode=opts.recompute, residency_mode=opts.residency,
                            offload_mode=opts.offload, gradient_offload=not opts.stage)
    except ValueError as e:
        raise PlanOptionError(str(e)) from None


def _with_hint(e: InfeasibleError, cap: Captured, infos, mesh: Mesh, opts: PlanOptions) -> InfeasibleError:
    """Say which options would lower the minimum: outputs returned whole where they dominate it, and
    the memory families the options forbid, and to what they would lower it."""
    e = _outputs_hint(e, cap, infos, opts)
    fixed = {k: getattr(opts, k) for k in ("recompute", "residency", "offload") if getattr(opts, k) != "auto"}
    if not fixed or e.min_memory_bytes is None:
        return e
    free = replace(opts, **dict.fromkeys(fixed, "auto"))
    need = min_memory(planning_problem(cap, infos, mesh, free))
    if need >= e.min_memory_bytes * (1 - 1e-9):
        return InfeasibleError(f"{e} Allowing {', '.join(f'{k}=auto' for k in fixed)} would not lower that.",
                               e.min_memory_bytes)
    return InfeasibleError(f"{e} With {', '.join(f'{k}=auto' for k in fixed)} (instead of "
                           f"{', '.join(f'{k}={v!r}' for k, v in fixed.items())}) it needs {need / 2**30:.3f} GiB.",
                           e.min_memory_bytes)


def _outputs_hint(e: InfeasibleError, cap: Captured, infos, opts: PlanOptions) -> InfeasibleError:
    """Name the outputs returned whole where they are at least half the least-memory plan's need: each
    is gathered whole on every device at the end of the forward (a Hugging Face causal LM returns
    its logits beside its loss: 501 GiB on Llama-3-70B at batch 256 x 8192, held by every device)."""
    if opts.sharded_outputs or e.min_memory_bytes is None:
        return e
    out = next(n for n in cap.gm.graph.nodes if n.op == "output")
    whole = sorted((infos[a.name].out[0] for a in infos[out.name].ins if a.name in infos and infos[a.name].out),
                   key=lambda m: -m.nbytes)
    total = sum(m.nbytes for m in whole)
    if total < e.min_memory_bytes / 2:
        return e
    shown = ", ".join(f"{tuple(m.shape)} {str(m.dtype).removeprefix('torch.')}" for m in whole[:3]
                      if m.nbytes >= total / 100)
    return InfeasibleError(f"{e} The outputs, returned whole, take {total / 2**30:.3f} GiB on every device "
                           f"({shown}): sharded_outputs=True leaves them in their planned layout (where the caller "
                           f"uses only the loss, a model's logits then stay split).", e.min_memory_bytes)


def assemble(cap: Captured, problem: Problem, choice: Mapping[str, int], mesh: Mesh, opts: PlanOptions,
             options: Mapping[str, int] | None = None, staging: Staging | None = None,
             priced: Evaluation | None = None) -> Plan:
    """Turn a choice per decision (and an option per family group) into a Plan with per-node layouts,
    collectives, memory decisions and estimates (`staging`: priced as that pipeline; `priced`: the
    evaluator's price of this choice and these options, with this staging, where the caller has it)."""
    options = effective_options(problem, choice, options or {})
    ev = priced if priced is not None else evaluate(problem, choice, options, staging)
    chosen = {name: d.strategies[choice[d.leader]] for name, d in problem.decisions.items()}
    by_name = {n.name: n for n in cap.gm.graph.nodes}
    collectives, per_axis = communication(problem, choice, cap)
    estimate = estimate_of(ev, per_axis)
    nodes = []
    placements = {}
    for node in cap.gm.graph.nodes:
        if node.name not in problem.decisions and node.op != "output":
            continue
        if node.op == "output":
            if collectives.get("output"):
                nodes.append(NodePlan("output", "output", "", (), (), (), "output",
                                      collectives=tuple(collectives["output"])))
            continue
        d = problem.decisions[node.name]
        s = chosen[node.name]
        if d.kind == "param":
            placements[d.fqn] = layout_str(s.output)
            executor, op = "param", f"param {d.fqn}"
        elif d.kind == "input":
            executor, op = "input", f"input {d.fqn}"
        else:
            rule = rule_for(node.target)
            executor = "replicate" if rule is None else "context" if context_axis(s.labels) is not None else "local"
            op = op_name(node.target)
        nodes.append(NodePlan(node.name, op, _module_path(node), tuple(layout_str(i) for i in s.inputs),
                              layout_str(s.output), tuple(s.labels) or tuple("-" for _ in mesh.shape), executor,
                              d.compute_s[choice[d.leader]], tuple(collectives.get(node.name, ())), d.fallback))
    fallbacks = [f"{n} ({op_name(by_name[n].target)})" for n in problem.fallbacks]
    decided = chosen_options(problem.families, options)
    return Plan(cap.model_name, fingerprint(cap), mesh.to_dict(), opts.to_dict(), nodes, placements, estimate,
                SolverInfo("none", "unsolved", 0, 0, ev.step_s, len(problem.leaders), len(problem.order)),
                fallbacks, recompute=decided.get("recompute", {}), residency=decided.get("residency", {}),
                offload=decided.get("offload", {}), indivisible=_indivisible(cap, placements, mesh))


def estimate_of(ev: Evaluation, per_axis: Mapping[str, float]) -> Estimate:
    """A plan's `Estimate` from the evaluator's price (per pipeline rank where it is pipelined)."""
    pp = ev.pipeline
    ranks = {} if pp is None else {str(r): s for r, s in enumerate(pp.stages)}
    return Estimate(ev.step_s, ev.compute_s, ev.comm_s, ev.peak_bytes, ev.state_bytes,
                    max(ev.peak_bytes - ev.state_bytes, 0.0), dict(per_axis), dict(ev.family_s), dict(ev.tiers),
                    dict(ev.freed_bytes), ev.grad_sync_s, ev.optimizer_s, ev.runtime_s,
                    pp.bubble_s if pp else 0.0, pp.p2p_s if pp else 0.0,
                    {r: s.peak_bytes for r, s in ranks.items()}, {r: s.fwd_s for r, s in ranks.items()},
                    {r: s.bwd_s for r, s in ranks.items()})


def _indivisible(cap: Captured, placements: dict[str, tuple[str, ...]], mesh: Mesh) -> list[str]:
    """Parameters a mesh axis replicates because none of their dims divides by its size (the report
    says so: the solver never saw a split of them over that axis)."""
    out = []
    for node in cap.gm.graph.nodes:
        slot = cap.inputs.get(node.name)
        fqn = cap.param_names.get(slot.target, slot.target) if slot and slot.kind == "param" else None
        metas = tensor_meta(node.meta.get("val")) if fqn in placements else ()
        if not metas or not metas[0].shape:
            continue
        shape = metas[0].shape
        for ax, n, p in zip(mesh.axis_names, mesh.shape, placements[fqn]):
            if p == "R" and n > 1 and all(s % n for s in shape):
                out.append(f"{fqn} {list(shape)}: no dim divisible by {ax}={n}")
    return out


def communication(problem: Problem, choice: Mapping[str, int], cap: Captured):
    """The collectives on the way into each node (consumer -> [Collective]) and the bytes each
    device sends per step over each mesh axis, under a layout choice."""
    collectives: dict[str, list[Collective]] = {}
    per_axis = dict.fromkeys(problem.mesh.axis_names, 0.0)
    for c in chosen_edges(problem, choice, cap):
        e = c.edge
        for phase, rc in edge_legs(problem, c):
            for ax, nbytes in zip(problem.mesh.axis_names, rc.bytes_per_axis):
                per_axis[ax] += nbytes
            for kind in rc.collectives:
                collectives.setdefault(e.dst, []).append(
                    Collective(kind, phase, e.src, rc.seconds / max(1, len(rc.collectives))))
    for node in cap.gm.graph.nodes:      # collectives an op runs inside itself (expert parallelism)
        d = problem.decisions.get(node.name)
        if d is not None and d.kind == "op":
            for phase, kind, seconds, sent, ax in op_exchanges(problem, node, d.strategies[choice[d.leader]]):
                collectives.setdefault(node.name, []).append(Collective(kind, phase, node.name, seconds))
                per_axis[ax] += sent
    return collectives, per_axis


def lazy_scaling(cap, infos, problem, choice, opts: PlanOptions, budget: float, source, plan: Plan):
    """`Plan.pending_scaling`: the plan priced at symbolic sizes (`scaling.build_scaling`) when
    first read (the report, the HTML page, `estimate_at`, `largest_batch`, saving): it traces the
    model once more, which on a model whose code branches on a size traces every layer (Mistral-7B:
    125 s against a 2 s solve), so `plan()` does not wait for it. Holds the capture and the
    chosen strategies (not the planning problem) until then."""
    only = {name: d.strategies[choice[d.leader]] for name, d in problem.decisions.items()}
    mesh = problem.mesh
    decided = {"recompute": plan.recompute, "residency": plan.residency, "offload": plan.offload}
    planned = Planned.of(problem)

    def price() -> Scaling:
        try:
            return build_scaling(cap, mesh, only, symbolic_graph(*source, cap, infos), opts, budget, decided, planned)
        except SymbolicUnavailable as e:
            return Scaling(unavailable=str(e))
        except Exception as e:  # noqa: BLE001 - the plan stands without its scaling; the report and the log say why
            logging.getLogger("autopar").exception("pricing the plan at symbolic sizes failed")
            return Scaling(unavailable=f"pricing at symbolic sizes failed ({type(e).__name__}: {e}); please report it")
    return price


def _module_path(node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path.replace("L['self'].", "").replace("L__self___", "")


__all__ = ["PlanOptions", "make_plan", "assemble", "InfeasibleError"]


def plan_assignment(problem: Problem, plan: Plan) -> tuple[dict[str, int], dict[str, int]]:
    """A saved plan read back on its planning problem: one choice index per layout decision (the
    option whose layouts and strategy match the plan's for the leader and every node that follows
    it) and one option per memory-family group (`plan.recompute`, `.residency`, `.offload`)."""
    saved = {n.name: n for n in plan.nodes}
    members: dict[str, list] = {}
    for d in problem.decisions.values():
        members.setdefault(d.leader, []).append(d)
    choice = {}
    for leader in problem.leaders:
        found = [i for i in range(problem.n_choices(leader)) if all(_same(d, i, saved) for d in members[leader])]
        if not found:
            raise PlanMismatchError(f"the plan's layouts for node {leader!r} are not among its options: the plan "
                                    f"was made with other options or another autopar version; re-plan")
        choice[leader] = found[0]
    try:
        options = recorded_options(problem.families, {"recompute": plan.recompute, "residency": plan.residency,
                                                      "offload": plan.offload})
    except ValueError as e:
        raise PlanMismatchError(f"{e}; re-plan") from None
    return choice, options


def _same(d, i: int, saved) -> bool:
    n = saved.get(d.name)
    if n is None:
        return True
    s = d.strategies[i]
    ok = layout_str(s.output) == n.output and tuple(layout_str(x) for x in s.inputs) == n.inputs
    return ok and (d.kind != "op" or not s.labels or tuple(s.labels) == n.labels)
