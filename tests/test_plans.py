"""Plans chosen by the solver (no process group: planning runs on meta tensors)."""
from __future__ import annotations

import itertools
import math
import os
import re
import sys

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import autopar  # noqa: E402
from autopar.passes.capture import capture  # noqa: E402
from autopar.passes.shape_prop import annotate  # noqa: E402
from autopar.solver.evaluate import evaluate
from autopar.solver.ilp import FEASIBILITY_SLACK_BYTES  # noqa: E402
from autopar.solver.solve import solve  # noqa: E402
from autopar.solver.problem import build_problem  # noqa: E402
from models import GPT, MLP, Block  # noqa: E402


def meta_block(hidden=4096, heads=32, batch=1, seq=1024):
    with torch.device("meta"):
        return Block(hidden, heads), (torch.randn(batch, seq, hidden, device="meta"),)


def forward_collectives(plan):
    return [c.kind.split("@")[0] for n in plan.nodes for c in n.collectives if c.phase == "forward"]


MEGATRON_PINS = {"attn.qkv.weight": ("S(0)",), "fc.weight": ("S(0)",),        # column
                 "attn.proj.weight": ("S(1)",), "fc2.weight": ("S(1)",)}     # row


def test_megatron_pattern_for_a_wide_block_on_8_gpus():
    """On a wide block over 8 devices the planner's plan is at least as fast as Megatron's tensor
    parallelism priced by the same model, and splits every weight matrix as Megatron does (which
    dim may differ: a plan with the attention's sequence split over the axis ties with it)."""
    model, inputs = meta_block()
    mesh = autopar.Mesh((8,), ("tp",), device="h100")
    plan = autopar.plan(model, inputs, mesh)
    megatron = autopar.plan(model, inputs, mesh, pins=MEGATRON_PINS)
    assert plan.estimate.step_time_s <= megatron.estimate.step_time_s * (1 + 1e-9)
    assert all(plan.placements[k] != ("R",) for k in MEGATRON_PINS), plan.placements
    fwd = forward_collectives(megatron)
    # Megatron's block: two all-reduces (or Megatron-SP's reduce-scatter + all-gather pairs), nothing
    # else beyond gathering the block's output whole
    ar, rs = fwd.count("all_reduce"), fwd.count("reduce_scatter")
    assert (ar, rs) in ((2, 0), (0, 2)), fwd


def test_small_hidden_large_batch_is_data_parallel():
    model, inputs = meta_block(hidden=256, heads=4, batch=512, seq=128)
    plan = autopar.plan(model, inputs, autopar.Mesh((8,), ("dp",), device="h100"))
    assert set(plan.placements.values()) == {("R",)}
    ops = [n for n in plan.nodes if n.executor not in ("param", "input", "output")]
    assert ops and all(n.output == ("S(0)",) for n in ops), [(n.name, n.output) for n in ops if n.output != ("S(0)",)]


def test_memory_budget_below_replicated_footprint_forces_sharding():
    model, inputs = meta_block(hidden=1024, heads=16, batch=8, seq=256)
    mesh = autopar.Mesh((8,), ("dp",), device="h100")
    free = autopar.plan(model, inputs, mesh)
    replicated_state = sum(p.numel() * 4 * 4 for p in model.parameters())
    tight = autopar.plan(model, inputs, mesh, memory_budget=replicated_state * 0.6)
    assert tight.estimate.peak_memory_bytes <= replicated_state * 0.6
    assert any(any(pl.startswith("S") for pl in lay) for lay in tight.placements.values())
    assert tight.estimate.step_time_s >= free.estimate.step_time_s


def test_infeasible_budget_names_the_minimum():
    model, inputs = meta_block(hidden=1024, heads=16, batch=8, seq=256)
    with pytest.raises(autopar.InfeasibleError) as e:
        autopar.plan(model, inputs, autopar.Mesh((2,), ("dp",), device="h100"), memory_budget=1e6)
    assert e.value.min_memory_bytes > 1e6
    assert f"needs {e.value.min_memory_bytes / 2**30:.3f} GiB per device" in str(e.value)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_ilp_equals_exhaustive_search(mesh_shape):
    with torch.device("meta"):
        model = MLP(d_in=8, hidden=16, d_out=8, depth=1)
        x = torch.randn(8, 8, device="meta")
    mesh = autopar.Mesh(mesh_shape, tuple(f"a{i}" for i in range(len(mesh_shape))), device="h100")
    cap = capture(model, (x,))
    # biases and the head's weight pinned whole to keep the exhaustive search small (0.4 ms a plan;
    # the first layer's weight, both products and the activation stay free: 20,736 plans on (2, 2))
    whole = ("R",) * len(mesh_shape)
    problem = build_problem(cap, annotate(cap.gm), mesh, pins={"*.bias": whole, "head.weight": whole})
    ilp = solve(problem, memory_budget=float("inf"))
    sizes = [problem.n_choices(l) for l in problem.leaders]
    assert 100 < math.prod(sizes) < 2.5e4, sizes
    best = min(evaluate(problem, dict(zip(problem.leaders, c))).objective_s
               for c in itertools.product(*(range(s) for s in sizes)))
    assert ilp.objective == pytest.approx(best, rel=1e-6)
    assert evaluate(problem, ilp.choice).objective_s == pytest.approx(best, rel=1e-6)


def test_plan_round_trips_through_json(tmp_path):
    with torch.device("meta"):
        model = GPT()
    idx = torch.zeros(4, 16, dtype=torch.long, device="meta")
    plan = autopar.plan(model, (idx, idx), autopar.Mesh((2, 2), ("dp", "tp"), device="a100"))
    plan.save(tmp_path / "plan.json")
    same = autopar.Plan.load(tmp_path / "plan.json")
    assert same.to_json() == plan.to_json()
    assert same.diff(plan) == []
    again = autopar.plan(model, (idx, idx), autopar.Mesh((2, 2), ("dp", "tp"), device="a100"))
    assert again.placements == plan.placements          # deterministic
    assert "wte.weight" in plan.placements and "lm_head.weight" not in plan.placements  # tied: one entry
    text = plan.report()
    assert "estimated step" in text and "wte.weight" in text and "Ops with no sharding rule: none" in text


class _AddChain(torch.nn.Module):
    """Ten `+ w` in a row: a sum keeps nothing for the backward, so only neighbours coexist."""

    def __init__(self, n=1024):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n, n))

    def forward(self, x):
        for _ in range(10):
            x = x + self.w
        return x


def test_peak_memory_comes_from_liveness():
    n = 1024
    plan = autopar.plan(_AddChain(n), (torch.zeros(n, n),), autopar.Mesh((1,), ("x",), device="h100"))
    act = n * n * 4
    state = 4 * act                              # w, its grad, two AdamW moments
    assert plan.estimate.param_state_bytes == state
    # in the forward at most the input's successor and the next result live at once (the input itself
    # is data), and the gradient does not exist yet (zero_grad sets it to None): w and two moments;
    # in the backward of a sum, w's gradient exists (its last consumer's backward ran) and the
    # gradients of the sum's output and input are in flight (the model does not credit a sum for
    # passing its gradient on unchanged): the whole state and two activations, the peak
    assert plan.estimate.peak_memory_bytes == state + 2 * act


class _Head(torch.nn.Module):
    def __init__(self, hidden, vocab):
        super().__init__()
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.head(x), y, reduction="sum")


def test_cross_entropy_backward_holds_the_log_probabilities_gradient():
    """The backward of cross-entropy holds its saved log-probabilities, the gradient it makes of them
    and the logits' gradient it returns: three logits' worth (and the state: the weight and its two
    moments; its gradient comes later, in the head's backward). The ILP's rows count it alike."""
    from autopar.solver.ilp import FEASIBILITY_SLACK_BYTES
    n, h, v = 256, 8, 4096
    model, inputs = _Head(h, v), (torch.randn(n, h), torch.randint(0, v, (n,)))
    fixed = dict(symbolic=False, recompute="none", offload="none")
    mesh = autopar.Mesh((1,), ("x",), device="h100")
    plan = autopar.plan(model, inputs, mesh, **fixed)
    logits, weight = n * v * 4, h * v * 4
    peak = plan.estimate.peak_memory_bytes
    assert peak == pytest.approx(3 * weight + 3 * logits, rel=1e-3)
    with pytest.raises(autopar.InfeasibleError):
        autopar.plan(model, inputs, mesh, memory_budget=peak - logits / 2, **fixed)
    assert autopar.plan(model, inputs, mesh, memory_budget=peak + FEASIBILITY_SLACK_BYTES, **fixed)


def test_a_weight_gradient_counts_whole_until_its_bucket_takes_it():
    """A weight stored split over "dp" and gathered for use gets its whole gradient from the matmul's
    backward; it lives until the gradient buckets reduce-scatter it. On one device nothing reduces it:
    the gradient is `.grad` itself, no second copy."""
    from autopar.solver.memory_timeline import memory_points
    model = torch.nn.Linear(512, 512, bias=False)
    cap = capture(model, (torch.randn(4, 512),))
    for devices, extra in ((2, 512 * 512 * 4), (1, 0)):
        p = build_problem(cap, annotate(cap.gm), autopar.Mesh((devices,), ("dp",), device="h100"), batch_axes=("dp",))
        choice = {name: 0 for name in p.leaders}
        for name, d in p.decisions.items():     # the weight stored split on its rows, used whole
            if d.leader == name:
                want = (Shard(0),) if d.kind == "param" else (Shard(0),) if devices > 1 else (Replicate(),)
                choice[name] = next(i for i, s in enumerate(d.strategies) if s.output == want or devices == 1)
        _, with_temp = memory_points(p, choice)
        edge = next(e for e in p.edges if p.decisions[e.src].kind == "param")
        saved, edge.grad_temp = edge.grad_temp, None
        _, without = memory_points(p, choice)
        edge.grad_temp = saved
        assert max(a - b for a, b in zip(with_temp, without)) == extra, devices


def test_collective_output_counts_while_its_consumer_runs():
    """A resharded copy the consumer does not keep (here: the batch-split output gathered whole
    for the caller) is a temporary: it adds its bytes at the consumer's liveness point only."""
    from autopar.solver.memory_timeline import memory_points
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    n = 1024                   # rows: the activations, not the weights, set the peak
    cap = capture(model, (torch.randn(n, 64),))
    mesh = autopar.Mesh((4,), ("dp",), device="h100")
    p = build_problem(cap, annotate(cap.gm), mesh, batch_axes=("dp",))
    choice = {name: 0 for name in p.leaders}
    for name, d in p.decisions.items():   # parameters whole, every op on its batch shard
        if d.leader == name:
            choice[name] = next(i for i, s in enumerate(d.strategies)
                                if s.output == ((Shard(0),) if d.kind != "param" else (Replicate(),)))
    out_edge = next(e for e in p.edges if e.dst == "output")
    assert any(any(row) for row in out_edge.temp)
    state, with_temp = memory_points(p, choice)
    saved, out_edge.temp = out_edge.temp, None
    _, without = memory_points(p, choice)
    out_edge.temp = saved
    end = p.live.end_index
    assert with_temp[end] - without[end] == n * 64 * 4          # the whole output, at the end of the forward
    assert [m for t, m in enumerate(with_temp) if t != end] == [m for t, m in enumerate(without) if t != end]
    peak = max(with_temp)          # the end of the forward: above the backward's points and the state after it
    assert peak == with_temp[end]
    assert peak > state and math.isclose(evaluate(p, choice).peak_bytes, peak, rel_tol=1e-12)
    # the ILP's memory rows count it too: with every layout pinned to this plan (and no memory family
    # to free anything), a budget half the temporary below its peak (above the peak without it) is
    # infeasible, one at the peak (plus the solver's feasibility slack, see ilp.py) is not
    pins = {n.name: ("S(0)",) for n in cap.gm.graph.nodes if n.op == "call_function"}
    pins.update({"*.weight": ("R",), "*.bias": ("R",)})
    inputs = (torch.randn(n, 64),)
    fixed = dict(batch_axes=("dp",), pins=pins, symbolic=False, recompute="none", offload="none")
    ok = autopar.plan(model, inputs, mesh, memory_budget=peak + FEASIBILITY_SLACK_BYTES, **fixed)
    assert math.isclose(ok.estimate.peak_memory_bytes, peak, rel_tol=1e-12)
    with pytest.raises(autopar.InfeasibleError):
        autopar.plan(model, inputs, mesh, memory_budget=peak - n * 64 * 4 / 2, **fixed)


def test_a_budget_of_the_reported_minimum_gives_a_plan_within_it():
    """`InfeasibleError.min_memory_bytes` is a budget that fits: the plan made with it peaks at or below it
    (the solver's tolerance once let a plan 1 KiB over through)."""
    torch.manual_seed(0)
    model, inputs = GPT(vocab=64, seq=16, hidden=32, heads=4, layers=2), (torch.randint(0, 64, (8, 16)),) * 2
    mesh = autopar.Mesh((4,), ("tp",), device="h100")      # one axis: the min-max memory MIP of (2, 2) takes a minute
    with pytest.raises(autopar.InfeasibleError) as e:
        autopar.plan(model, inputs, mesh, memory_budget=1e3, symbolic=False)
    need = e.value.min_memory_bytes
    plan = autopar.plan(model, inputs, mesh, memory_budget=need, symbolic=False)
    assert plan.estimate.peak_memory_bytes <= need
    assert need - plan.estimate.peak_memory_bytes < 16 * 2**10       # and the minimum is tight


def test_report_says_which_parameters_no_axis_could_split():
    """A dim that does not divide by an axis is replicated over it, and the report says so."""
    plan = autopar.plan(MLP(d_in=6, hidden=6, d_out=6, depth=1), (torch.randn(8, 6),), autopar.Mesh((4,), ("tp",)))
    assert "layers.0.weight [6, 6]: no dim divisible by tp=4" in plan.indivisible
    assert "head.bias [6]: no dim divisible by tp=4" in plan.indivisible
    assert "no dim of theirs divides" in plan.report() and "layers.0.weight [6, 6]" in plan.report()
    deep = autopar.plan(MLP(d_in=6, hidden=6, d_out=6, depth=3), (torch.randn(8, 6),), autopar.Mesh((4,), ("tp",)))
    text = deep.report()        # repeated layers alike: one row, their indices listed
    assert "layers.{0-2}.weight [6, 6]: no dim divisible by tp=4" in text and "layers.1.weight" not in text
    assert re.search(r"\n  layers\.\{0-2\}\.weight +\(R\)\n", text), text
    even = autopar.plan(MLP(d_in=8, hidden=8, d_out=8, depth=1), (torch.randn(8, 8),), autopar.Mesh((4,), ("tp",)))
    assert even.indivisible == [] and "no dim of theirs divides" not in even.report()


def test_report_without_the_scaling_table():
    plan = autopar.plan(MLP(), (torch.randn(8, 16),), autopar.Mesh((2,), ("dp",)))
    assert "Scaling with the global batch" in plan.report()
    short = plan.report(symbolic=False)
    assert "Scaling" not in short and short.splitlines()[0] == plan.report().splitlines()[0]
