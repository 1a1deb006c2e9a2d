"""The planner chooses pipelines (issue 12): stages over one mesh axis or none, microbatches, schedule
and virtual stages, jointly with layouts and memory, priced per pipeline rank by the one evaluator."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import autopar
from autopar.cost_model.pipeline import in_flight_microbatches, pipeline_time, step_floor
from autopar.cost_model.screen import pipeline_floor
from autopar.estimate import estimate
from autopar.passes.capture import capture
from autopar.passes.shape_prop import annotate
from autopar.planner.pipeline_search import _ordered
from autopar.planner.solve import PlanOptions, planning_problem
from autopar.solver.decisions import stages
from autopar.solver.decisions.stages import Candidate, choose_pipeline
from autopar.solver.evaluate import evaluate
from autopar.solver.ilp import least_seconds
from autopar.solver.solve import AT_TIME_LIMIT
from memory_checks import gpt

KW = dict(symbolic=False, progress=False, time_limit=30)


def _gpt(layers=4, batch=8, hidden=32):
    return gpt(hidden=hidden, batch=batch, layers=layers)


@pytest.fixture(scope="module")
def chosen():
    model, inputs = _gpt()
    mesh = autopar.Mesh((2, 2), ("pp", "dp"), device="h100")
    return model, inputs, mesh, autopar.plan(model, inputs, mesh, batch_axes=("dp",), pipeline={"axis": "pp"}, **KW)


def test_planner_chooses_a_pipeline_priced_by_the_evaluator(chosen):
    model, inputs, mesh, plan = chosen
    pp = plan.pipeline
    assert pp.axis == "pp" and pp.stages == 2 and pp.microbatches >= 2
    assert len(pp.boundaries) == pp.chunks and pp.boundaries[0] == ""
    assert all(lay[0] == "R" for lay in plan.placements.values())          # stages own nodes: "R" on pp
    est = estimate(model, inputs, mesh, plan)
    assert est.step_time_s == plan.estimate.step_time_s                       # one pricing path, to the last bit
    assert est.peak_memory_bytes == plan.estimate.peak_memory_bytes
    assert est.bubble_s == plan.estimate.bubble_s > 0
    assert set(plan.estimate.stage_memory_bytes) == {"0", "1"}
    text = plan.report()
    assert "Pipeline:" in text and "timeline" in text
    assert autopar.Plan.from_json(plan.to_json()) == plan                     # a pipelined plan is data


def test_fixed_keys_are_respected_and_false_forbids(chosen):
    model, inputs = _gpt()
    mesh = autopar.Mesh((2, 2), ("pp", "dp"), device="h100")
    plan = autopar.plan(model, inputs, mesh, batch_axes=("dp",),
                        pipeline={"axis": "pp", "schedule": "gpipe", "microbatches": 4}, **KW)
    assert (plan.pipeline.axis, plan.pipeline.schedule, plan.pipeline.microbatches) == ("pp", "gpipe", 4)
    assert plan.pipeline.virtual_stages == 1
    flat = autopar.plan(model, inputs, mesh, batch_axes=("dp",), pipeline=False, **KW)
    assert flat.pipeline.stages == 1 and flat.pipeline.axis is None
    # the default (pipeline=None) chooses among both: no slower than either (the axis named "pp" is
    # searched first: a hint)
    default = autopar.plan(model, inputs, mesh, batch_axes=("dp",), **KW)
    assert default.estimate.step_time_s <= min(flat.estimate.step_time_s, chosen[3].estimate.step_time_s)
    assert default.pipeline.stages == 1 and "no pipeline is faster" in default.solver.status
    # on an axis not named for pipelines the plan without one comes first; it is near its floor, which
    # no pipeline's lower bound beats: none is solved (issue 37)
    other = autopar.Mesh((2, 2), ("a", "dp"), device="h100")
    unnamed = autopar.plan(model, inputs, other, batch_axes=("dp",), **KW)
    assert unnamed.pipeline.stages == 1 and unnamed.estimate.step_time_s == flat.estimate.step_time_s
    assert "no pipeline is faster (0 of 2 (axis, microbatch count) candidates solved, 2 ruled out" in unnamed.solver.status
    # at the time limit the best plan found is the answer, and says so; the candidates' bounds cost no
    # solve and are still weighed, so the same candidates are ruled out as with time to spare
    cut = autopar.plan(model, inputs, other, batch_axes=("dp",), **dict(KW, time_limit=0))
    assert cut.pipeline.stages == 1 and cut.solver.status.startswith(AT_TIME_LIMIT)
    assert "0 of 2 (axis, microbatch count) candidates solved, 2 ruled out" in cut.solver.status


def test_axes_named_for_pipelines_then_slower_links_are_searched_first():
    """The groups' order (a hint, never a restriction): an axis named for pipelines first, then the
    axes of slower links (stages across nodes keep the fast links for the layouts' collectives),
    then the least lower bound."""
    mesh = autopar.Mesh((2, 2, 8), ("pp", "a", "b"), device="h100")       # a: inter-node, b: NVLink
    cands = [Candidate(axis, 2 if axis != "b" else 8, m, "1f1b", 1) for axis in ("b", "a", "pp") for m in (2, 4)]
    order = _ordered(cands, lambda c: 1.0 / c.microbatches + (0.0 if c.axis == "b" else 1.0), mesh)
    assert [(c.axis, c.microbatches) for c in order] == [("pp", 4), ("pp", 2), ("a", 4), ("a", 2), ("b", 4), ("b", 2)]


def test_at_the_time_limit_only_groups_whose_bound_could_win_go_unsearched():
    """Out of time with a plan in hand, the search solves nothing more: a group whose lower bound cannot
    beat that plan is ruled out (as with time to spare), one whose bound could is left unsearched."""
    cands = [Candidate("pp", 2, m, "1f1b", 1) for m in (2, 4, 8)]
    bound = {2: 1.0, 4: 3.0, 8: 0.5}

    def never(*_):
        raise AssertionError("solved a group past the time limit")
    found = choose_pipeline(None, cands, never, 1.0, out_of_time=lambda after=0.0: True,
                            floor=lambda c: bound[c.microbatches],
                            incumbent_s=2.0)
    assert (found.best, found.solved, found.pruned, found.unsearched) == (None, 0, 1, (("pp", 2), ("pp", 8)))


def test_with_no_plan_in_hand_a_group_that_overflowed_waits_for_more_microbatches(monkeypatch):
    """A group every pipeline of which overflows a rank, with no plan in hand, is solved again only after
    the groups of its axis with more microbatches (fewer bytes in flight per rank), whatever the time
    left, and those start at the budget scale its overflow suggests; its re-solves follow, while they
    could beat the plan found (here they do)."""
    calls = []

    def solve_at(axis, m, scale, first):
        calls.append((m, round(scale, 3), first))
        return m, {"scale": scale}, {}, None        # (problem, layouts, options, graph)

    def priced(mesh, group, solved, budget, floor, beat, out_of_time, past):     # m=2 fits below 0.4 of the budget
        m, scale = solved[0], solved[1]["scale"]
        fits = m == 4 or scale < 0.4
        found = SimpleNamespace(evaluation=SimpleNamespace(step_s=m / 2)) if fits else None
        return found, budget * (1 if fits else 2)
    monkeypatch.setattr(stages, "_best_of", priced)
    found = choose_pipeline(None, [Candidate("pp", 2, m, "1f1b", 1) for m in (2, 4)], solve_at, 1.0,
                            floor=lambda c: 0.1)
    assert calls == [(2, 1.0, True), (4, 0.475, True), (2, 0.475, False), (2, 0.226, False)]
    assert found.best.evaluation.step_s == 1.0 and found.solved == 2



def test_a_re_solve_that_returns_a_plan_priced_already_is_not_priced_again(monkeypatch):
    """A group whose pipelines all overflow is solved again at lower budgets; where a re-solve returns the
    layouts and options of a plan priced already, its pricing (a few evaluations of the whole model a
    candidate) is not made again: the answer is the one made."""
    plans, priced = [{"a": 0}, {"a": 0}, {"a": 1}], []

    def solve_at(axis, m, scale, first):
        return m, plans.pop(0), {}, None

    def price(mesh, group, solved, budget, floor, beat, out_of_time, past):
        priced.append(solved[1])
        return None, 2 * budget                      # every pipeline overflows
    monkeypatch.setattr(stages, "_best_of", price)
    found = choose_pipeline(None, [Candidate("pp", 2, 4, "1f1b", 1)], solve_at, 1.0, floor=lambda c: 0.1)
    assert not plans and priced == [{"a": 0}, {"a": 1}]     # three solves, two pricings
    assert found.best is None and found.least == 2.0

def test_the_lower_bound_is_below_the_priced_step(chosen):
    """The search leaves a candidate unsolved when its lower bound cannot beat a plan found: the bound
    must never be above what the evaluator prices (here the chosen pipeline, and the plan without one)."""
    model, inputs, mesh, plan = chosen
    cap = capture(model, inputs, None)
    floor = pipeline_floor(cap.gm.graph, annotate(cap.gm), mesh)
    pp = plan.pipeline
    assert floor(Candidate(pp.axis, pp.stages, pp.microbatches, pp.schedule, pp.virtual_stages)) <= plan.estimate.step_time_s
    flat = autopar.plan(model, inputs, mesh, batch_axes=("dp",), pipeline=False, **KW)
    assert 0.5 * flat.estimate.step_time_s < floor(Candidate(None, 1, 1, "1f1b", 1)) <= flat.estimate.step_time_s
    # with a pipeline in hand, the plan without one is ruled out by its layouts' least seconds (an LP)
    problem = planning_problem(cap, annotate(cap.gm), mesh, PlanOptions(batch_axes=("dp",), symbolic=False))
    assert 0.5 * flat.estimate.step_time_s < least_seconds(problem) <= flat.estimate.step_time_s


def test_the_layout_floor_is_below_every_priced_step(monkeypatch):
    """Once a group has a plan, its cuts and options whose floor at the group's layouts (`layout_work`:
    the ranks' seconds of a microbatch summed, through the schedule's least T) cannot beat the best
    found are left unpriced: the floor must never be above what the evaluator prices."""
    seen = []

    def checked(problem, choice, options=None, staging=None, memo=None):
        ev = evaluate(problem, choice, options, staging, memo)
        p = staging.pipe
        cand = Candidate(p.axis, p.stages, p.microbatches, p.schedule, p.virtual_stages)
        seen.append(stages._layout_floor(cand, stages.layout_work(problem, choice)) / ev.step_s)
        return ev
    monkeypatch.setattr(stages, "evaluate", checked)
    model, inputs = _gpt()
    autopar.plan(model, inputs, autopar.Mesh((2, 2), ("pp", "dp"), device="h100"), batch_axes=("dp",), pipeline={},
                 **KW)
    assert seen and max(seen) <= 1 + 1e-9 and max(seen) > 0.5      # a floor, and not a vacuous one


def test_the_microbatch_floor_is_below_every_priced_step(monkeypatch):
    """With a plan in hand a group is ruled out before its solve where `microbatch_floor` at its problem's
    LP bound (gradients synced once a step included) cannot beat it: that floor must never be above what
    the evaluator prices, at any of the search's candidates."""
    seen, least = [], {}

    def checked(problem, choice, options=None, staging=None, memo=None):
        ev = evaluate(problem, choice, options, staging, memo)
        p = staging.pipe
        if id(problem) not in least:
            least[id(problem)] = least_seconds(stages.per_step_view(problem, p.microbatches))
        cand = Candidate(p.axis, p.stages, p.microbatches, p.schedule, p.virtual_stages)
        seen.append(stages.microbatch_floor(cand, least[id(problem)]) / ev.step_s)
        return ev
    monkeypatch.setattr(stages, "evaluate", checked)
    model, inputs = _gpt()
    autopar.plan(model, inputs, autopar.Mesh((2, 2), ("pp", "dp"), device="h100"), pipeline={}, **KW)
    assert seen and max(seen) <= 1 + 1e-9 and max(seen) > 0.3      # a floor, and not a vacuous one


def test_a_group_whose_costlier_bound_cannot_win_is_not_solved():
    """With a step in hand, a group the cheap floor cannot rule out but its costlier bound can is counted
    ruled out and not solved; without a step in hand the costlier bound is not asked."""
    cands = [Candidate("pp", 2, m, "1f1b", 1) for m in (2, 4)]
    asked = []

    def bound(c):
        asked.append(c.microbatches)
        return 3.0

    def never(*_):
        raise AssertionError("solved a group its bound rules out")
    found = choose_pipeline(None, cands, never, 1.0, floor=lambda c: 0.5, incumbent_s=2.0, bound=bound)
    assert (found.best, found.solved, found.pruned) == (None, 0, 2) and asked == [2, 4]
    asked.clear()
    found = choose_pipeline(None, cands, lambda *_: None, 1.0, floor=lambda c: 0.5, bound=bound)
    assert found.solved == 2 and asked == []


def test_schedules_bubble_and_memory():
    # equal stages: 1F1B and GPipe take (m + p - 1) t; interleaving divides the fill by v; zero bubble
    # fills with F + B - W only
    t = pipeline_time([1.0] * 4, [2.0] * 4, 8)
    assert t.total_s == 8 * 3 + 3 * 3
    assert pipeline_time([1.0] * 4, [2.0] * 4, 8, virtual_stages=2).bubble_s == t.bubble_s / 2
    zb = pipeline_time([1.0] * 4, [2.0] * 4, 8, weight_grad=[1.0] * 4)
    assert zb.bubble_s == 3 * (1.0 + 2.0 - 2 * 1.0) < t.bubble_s
    # the search's lower bound: never above the step, equal on equal stages (m t >= work, p t >= kernels)
    for fwd, bwd, m, v in (([1.0] * 4, [2.0] * 4, 8, 1), ([1.0, 3.0], [2.0, 1.0], 4, 2), ([0.5] * 3, [4.0] * 3, 3, 3)):
        t = pipeline_time(fwd, bwd, m, virtual_stages=v).total_s
        per = [f + b for f, b in zip(fwd, bwd)]
        floor = step_floor(m * sum(per) / len(per), sum(per), len(per), m, "interleaved", v)
        assert floor <= t * (1 + 1e-12) and (len(set(per)) > 1 or floor == pytest.approx(t))
    # in flight: GPipe all m, 1F1B p - d on rank d, interleaved more than 1F1B on rank 0
    assert [in_flight_microbatches(d, 4, 8, "gpipe") for d in range(4)] == [8.0] * 4
    assert [in_flight_microbatches(d, 4, 8, "1f1b") for d in range(4)] == [4.0, 3.0, 2.0, 1.0]
    assert in_flight_microbatches(0, 4, 8, "zb") == 4.0
    assert in_flight_microbatches(0, 4, 8, "interleaved", 2) > 4.0


def test_schedules_priced_on_a_plan(chosen):
    # one plan's layouts re-priced under each schedule (estimate() of a Plan runs the evaluator)
    model, inputs, mesh, plan = chosen
    pipe = replace(plan.pipeline, virtual_stages=1, microbatches=4, boundaries=("", "blocks.2"))
    e = {s: estimate(model, inputs, mesh, replace(plan, pipeline=replace(pipe, schedule=s)))
         for s in ("1f1b", "gpipe", "zb")}
    assert e["gpipe"].step_time_s == e["1f1b"].step_time_s
    assert e["gpipe"].peak_memory_bytes > e["1f1b"].peak_memory_bytes       # all 4 microbatches in flight, not 2
    assert e["zb"].bubble_s < e["1f1b"].bubble_s
    assert e["zb"].peak_memory_bytes == e["1f1b"].peak_memory_bytes


def test_a_budget_only_a_pipeline_fits():
    model, inputs = _gpt(layers=4, batch=4, hidden=64)
    mesh = autopar.Mesh((2,), ("pp",), device="h100")
    fixed = dict(recompute="none", residency="keep", offload="none")
    with pytest.raises(autopar.InfeasibleError) as e:
        autopar.plan(model, inputs, mesh, memory_budget=1, pipeline=False, **fixed, **KW)
    flat = e.value.min_memory_bytes
    piped = autopar.plan(model, inputs, mesh, pipeline={"axis": "pp"}, **fixed, **KW)
    assert piped.estimate.peak_memory_bytes < flat
    budget = (piped.estimate.peak_memory_bytes + flat) / 2
    plan = autopar.plan(model, inputs, mesh, memory_budget=budget, **fixed, **KW)     # the default chooses it
    assert plan.pipeline.stages == 2 and plan.estimate.peak_memory_bytes <= budget


def test_a_tight_budget_is_met_by_re_solving_the_stages_tighter():
    """The ILP of a pipeline candidate sees the whole model against the budget times the stages; where
    every pipeline it gives overflows a rank, it is solved again with a lower budget: half the peak of
    the unconstrained plan is met (one solve alone overflows it)."""
    model, inputs = _gpt()
    mesh = autopar.Mesh((2, 2), ("pp", "dp"), device="h100")
    fixed = {"axis": "pp", "microbatches": 4, "schedule": "1f1b"}
    free = autopar.plan(model, inputs, mesh, batch_axes=("dp",), pipeline=fixed, memory_budget=1e12, **KW)
    budget = 0.5 * free.estimate.peak_memory_bytes
    plan = autopar.plan(model, inputs, mesh, batch_axes=("dp",), pipeline=fixed, memory_budget=budget, **KW)
    assert plan.estimate.peak_memory_bytes <= budget
    assert max(plan.estimate.stage_memory_bytes.values()) <= budget


def test_without_batch_axes_microbatches_stay_splittable_over_the_other_axes():
    """Without `batch_axes` the search still tries microbatches the other axes can split by batch (on
    GPT-3 175B, (16, 8, 8), the largest counts alone gave microbatches of 1-3 sequences: a 1.8x slower
    step); with them, the counts of one pipeline's batch."""
    from autopar.solver.decisions.stages import candidates
    mesh = autopar.Mesh((4, 2, 2), ("dp", "pp", "tp"), device="h100")

    def counts(batch_axes):
        return sorted({c.microbatches for c in candidates(mesh, 64, batch_axes, 8, {"axis": "pp"})})
    assert counts(None) == [2, 4, 8]                  # microbatches of 32, 16, 8: split 8 ways over dp x tp
    assert counts(("dp",)) == [4, 8, 16]              # of one dp rank's 16 sequences: 4, 2, 1 each
    assert counts(("dp", "tp")) == [2, 4, 8]          # of one pipeline's 8 sequences


def test_explain_prices_a_pipelined_plan_as_the_plan(chosen):
    """explain() rebuilds the problem the pipelined plan was solved on (one microbatch, the stage mesh):
    the chosen option is the plan's layout at the plan's step time."""
    model, inputs, mesh, plan = chosen
    e = autopar.explain(model, inputs, mesh, plan, "blocks.0.fc.weight")
    assert e.chosen.output == tuple(plan.placements["blocks.0.fc.weight"])
    assert e.chosen.step_time_s == plan.estimate.step_time_s
    assert e.alternatives and all(o.output[0] == "R" for o in e.alternatives)     # "R" on the pipeline axis


def test_a_memo_prices_each_option_and_schedule_of_a_cut_as_alone():
    """The search prices each cut at several schedules and memory options with one `memo` (what the options
    leave alone, worked out once per cut): every evaluation equals the one made without it, to the last bit."""
    from autopar.passes.stages import even_boundaries, layer_sequence
    from autopar.plan_records import PipelinePlan
    from autopar.solver.evaluate import Staging
    from autopar.solver.ilp import most_sharded
    model, inputs = _gpt()
    mesh = autopar.Mesh((2, 2), ("pp", "dp"), device="h100")
    cap = capture(model, inputs, None)
    problem = planning_problem(cap, annotate(cap.gm), mesh.stage_mesh("pp"), PlanOptions(batch_axes=("dp",),
                                                                                         symbolic=False))
    choice, link = most_sharded(problem), mesh.axes[0].link
    options = stages._option_choices(problem, problem.families.defaults())
    assert len(options) > 1                                  # recomputation raised: several options a cut
    memo, parts, priced = {}, {}, 0
    for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2)):
        bounds = even_boundaries(layer_sequence(cap.gm.graph), 2 * v)
        pipe = PipelinePlan("pp", 2, v, 4, schedule, bounds)
        chunk_of = parts.setdefault(bounds, stages.node_chunks(problem, cap.gm.graph, pipe))
        for opts in options:
            alone = evaluate(problem, choice, opts, Staging(pipe, dict(chunk_of), link))
            assert evaluate(problem, choice, opts, Staging(pipe, chunk_of, link), memo) == alone
            priced += 1
    assert priced == 3 * len(options) and len(memo) == 2     # one entry per cut: 1F1B and GPipe share theirs
