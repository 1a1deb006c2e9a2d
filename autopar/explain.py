"""`autopar.explain`: why a node or parameter got its layout, and what the next-best options cost.

A plan stores only the layouts it chose, so explaining rebuilds the planning problem from the
model (`planner.planning_problem`, as the planner did), reads the plan back as one choice per
decision and one option per memory decision, and prices that with the named node's decision
switched to each of its other options, everything else fixed (`solver.evaluate`, the tables
and terms the solver optimised; a pipelined plan on its own problem, one microbatch on the mesh
without the pipeline axis, priced per pipeline rank as `estimate()` prices it). The
answer is the chosen option and the best alternatives with their step-time and memory
differences; an alternative that is cheaper but over the memory budget says so.

The rest of the plan stays fixed: an option that is better only together with other changes
(its consumers re-laid out too) shows as worse here. Copies of a repeated layer share one ILP
variable, so the solver could not switch one copy alone; switching it here is still a valid plan.

This module uses the solver's tables through `planning_problem`, `Problem.decisions` /
`Problem.leaders`, and `evaluate(problem, choice, options)`.
"""
from __future__ import annotations

from dataclasses import dataclass

from .api import _as_tuple, check_plan
from .errors import AutoparError
from .estimate import stage_view
from .mesh import Mesh
from .passes.capture import capture
from .passes.shape_prop import annotate
from .passes.stages import microbatch
from .planner.pipeline import STAGE_LABEL, stage_options
from .placement import layout_str
from .plan import Plan
from .planner.solve import PlanOptions, plan_assignment, planning_problem
from .solver.decisions.stages import node_chunks
from .solver.evaluate import Staging, evaluate
from .solver.problem import Problem

TIE_S = 1e-12     # step times closer than this are equal (float sums in another order)


class UnknownNameError(AutoparError):
    """The name given is neither a node nor a parameter of the plan."""


@dataclass(frozen=True, slots=True)
class Option:
    inputs: tuple[tuple[str, ...], ...]    # layout of each tensor input
    output: tuple[str, ...]
    labels: tuple[str, ...]                # strategy per mesh axis ("batch", "column", ...)
    step_time_s: float                     # the whole plan's step with this option
    peak_memory_bytes: float
    fits: bool                             # within the memory budget

    def describe(self) -> str:
        ins = " ".join("(" + ", ".join(i) + ")" for i in self.inputs)
        how = f" [{'/'.join(self.labels)}]" if self.labels else ""
        return f"({', '.join(self.output)})" + (f" from {ins}" if ins else "") + how


@dataclass(frozen=True, slots=True)
class Explanation:
    name: str                   # as asked: a node name or a parameter FQN
    node: str                   # the graph node
    leader: str                 # the decision it belongs to (itself, or the node whose choice it follows)
    chosen: Option
    alternatives: tuple[Option, ...]    # best first: those that fit by step time, then those that do not
    n_options: int
    memory_budget: float

    def __str__(self) -> str:
        c = self.chosen
        follows = f"; follows {self.leader}'s choice" if self.leader != self.node else ""
        lines = [f"{self.name} (node {self.node}{follows}): chosen {c.describe()}",
                 f"  plan step {c.step_time_s * 1e3:.3f} ms, peak {c.peak_memory_bytes / 2**20:.1f} MiB per device "
                 f"(budget {self.memory_budget / 2**30:.2f} GiB); {self.n_options} options",
                 "  next best, the rest of the plan fixed:" if self.alternatives else "  no other option"]
        for o in self.alternatives:
            why = "" if o.fits else "  does not fit the memory budget"
            lines.append(f"    {(o.step_time_s - c.step_time_s) * 1e3:+.3f} ms "
                         f"{(o.peak_memory_bytes - c.peak_memory_bytes) / 2**20:+9.1f} MiB  {o.describe()}{why}")
        return "\n".join(lines)


def explain(model, example_inputs, mesh: Mesh, plan: Plan, name: str, *, example_kwargs: dict | None = None,
            top: int = 5) -> Explanation:
    """Explain the plan's choice for node or parameter `name` (see the module docstring)."""
    problem, viewed, staging, lift = _planned_problem(model, _as_tuple(example_inputs), example_kwargs, mesh, plan)
    o = plan.options
    node = _node_named(problem, plan, name)
    choice, memory = plan_assignment(problem, viewed)
    # the budget the plan was solved for (not `plan.scaling.memory_budget`: reading that prices a pending
    # symbolic table, a whole trace of the model, which explaining one choice does not need)
    budget = o["memory_budget"] if o.get("memory_budget") is not None else mesh.profile.memory_budget
    leader = problem.decisions[node].leader
    options: dict[tuple, Option] = {}
    for i in range(problem.n_choices(leader)):
        ev = evaluate(problem, {**choice, leader: i}, memory, staging)
        s = problem.decisions[node].strategies[i]
        opt = Option(tuple(lift(layout_str(x)) for x in s.inputs), lift(layout_str(s.output)),
                     lift(tuple(s.labels), STAGE_LABEL) if s.labels else (),
                     float(ev.step_s), float(ev.peak_bytes), float(ev.peak_bytes) <= budget)
        key = (opt.inputs, opt.output, opt.labels)
        if i == choice[leader]:
            chosen = opt
        elif key not in options or _rank(opt) < _rank(options[key]):
            options[key] = opt
    alts = sorted((v for k, v in options.items() if k != (chosen.inputs, chosen.output, chosen.labels)), key=_rank)
    return Explanation(name, node, leader, chosen, tuple(alts[:top]), problem.n_choices(leader), float(budget))


def _planned_problem(model, args: tuple, kwargs, mesh: Mesh, plan: Plan):
    """The problem the plan was solved on, the plan as one choice on it, its `Staging` (None without a
    pipeline) and `lift(layout, entry="R")`, a layout of that problem as the plan writes it. A pipelined
    plan was solved for one microbatch on the mesh without the pipeline axis, as estimate() prices it."""
    pp = plan.pipeline
    if pp.stages <= 1:
        cap = capture(model, args, kwargs)
        check_plan(plan, cap, mesh)
        return (planning_problem(cap, annotate(cap.gm), mesh, PlanOptions.from_dict(plan.options)), plan, None,
                lambda lay, entry="R": lay)
    k = mesh.axis_index(pp.axis)
    cap = capture(model, *microbatch(args, kwargs, pp.microbatches))
    check_plan(plan, cap, mesh)
    opts = stage_options(PlanOptions.from_dict(plan.options), mesh, k)
    problem = planning_problem(cap, annotate(cap.gm), mesh.stage_mesh(pp.axis), opts)
    staging = Staging(pp, node_chunks(problem, cap.gm.graph, pp), mesh.axes[k].link)
    alone = mesh.ndim == 1       # the stage mesh was one device standing for no axis

    def lift(lay: tuple, entry: str = "R") -> tuple:
        rest = () if alone else tuple(lay)
        return rest[:k] + (entry,) + rest[k:]
    return problem, stage_view(plan, k), staging, lift


def _rank(o: Option) -> tuple:
    return (not o.fits, o.step_time_s, o.peak_memory_bytes, o.output, o.inputs)


def _node_named(problem: Problem, plan: Plan, name: str) -> str:
    if name in problem.decisions:
        return name
    for node, d in problem.decisions.items():
        if d.kind == "param" and d.fqn == name:
            return node
    close = sorted(n for n in list(plan.placements) + [n.name for n in plan.nodes] if name.split(".")[-1] in n)[:5]
    hint = f" (similar: {', '.join(close)})" if close else ""
    raise UnknownNameError(f"{name!r} is neither a node nor a parameter of this plan{hint}: use a parameter "
                           f"name as in model.named_parameters() or a node name from plan.report(detail=True)")
