"""Planning at scale: shrinking keeps the optimum, repeated layers share variables, plans are
deterministic byte for byte."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import autopar  # noqa: E402
from autopar.passes.capture import capture  # noqa: E402
from autopar.passes.shape_prop import annotate  # noqa: E402
from autopar.solver.evaluate import evaluate
from autopar.solver.solve import solve  # noqa: E402
from autopar.passes.layers import layer_of  # noqa: E402
from autopar.solver.problem import build_problem  # noqa: E402
from models import GPT  # noqa: E402


def _meta_gpt(layers=5, hidden=512, batch=8, seq=256):
    with torch.device("meta"):
        model = GPT(vocab=1024, seq=seq, hidden=hidden, heads=8, layers=layers)
        idx = torch.zeros(batch, seq, dtype=torch.long)
    return model, (idx, idx)


def test_layer_paths():
    assert layer_of("blocks.7.attn.qkv") == ("blocks", 7, "attn.qkv")
    assert layer_of("model.layers.12") == ("model.layers", 12, "")
    assert layer_of("lm_head") is None


@pytest.mark.parametrize("mesh_shape", [(8,), (4, 2)])
def test_linked_layers_keep_the_optimum(mesh_shape):
    model, inputs = _meta_gpt()
    mesh = autopar.Mesh(mesh_shape, ("dp", "tp")[:len(mesh_shape)], device="h100")
    cap = capture(model, inputs)
    infos = annotate(cap.gm)
    linked = build_problem(cap, infos, mesh)
    free = build_problem(cap, infos, mesh, link_layers=False)
    per_layer = len(linked.rep) // 2
    assert per_layer > 10 and len(linked.rep) == 2 * per_layer   # layers 2 and 3 share layer 1's
    a = solve(linked, float("inf"))
    b = solve(free, float("inf"))
    assert a.objective == pytest.approx(b.objective, rel=1e-3)
    assert evaluate(linked, a.choice).objective_s == pytest.approx(a.objective, rel=1e-6)


def test_same_inputs_same_plan_byte_for_byte():
    model, inputs = _meta_gpt(layers=2)
    mesh = autopar.Mesh((2, 4), ("dp", "tp"), device="a100")
    one = autopar.plan(model, inputs, mesh).to_json()
    two = autopar.plan(model, inputs, mesh).to_json()
    assert one == two


def test_plan_cache_serves_an_unchanged_model(tmp_path):
    model, inputs = _meta_gpt(layers=2, hidden=256)
    mesh = autopar.Mesh((4,), ("dp",), device="h100")
    first = autopar.plan(model, inputs, mesh, cache_dir=str(tmp_path))
    again = autopar.plan(model, inputs, mesh, cache_dir=str(tmp_path))
    assert again.timings.cached and not first.timings.cached
    assert again.to_json() == first.to_json()
    _, bigger = _meta_gpt(layers=2, hidden=256, batch=16)          # a new batch size is a new problem
    other = autopar.plan(model, bigger, mesh, cache_dir=str(tmp_path))
    assert not other.timings.cached


def test_time_limit_fallback_is_a_plan_that_fits():
    from autopar.solver.ilp import StrategyILP
    model, inputs = _meta_gpt(layers=2, hidden=256)
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="h100")
    cap = capture(model, inputs)
    problem = build_problem(cap, annotate(cap.gm), mesh)
    budget = 2 * 2**30
    r = StrategyILP(problem, budget).fallback("Not Solved", "HiGHS", 0.0)
    assert r.status.startswith("Heuristic")
    assert evaluate(problem, r.choice).peak_bytes <= budget
