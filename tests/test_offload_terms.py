"""Offload's activation terms: each derived table (scaled to seconds, counted, replaced by the copy a
consumer keeps) is made once and shared wherever layer groups use the same table, and equals the table
made anew for every use."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import autopar  # noqa: E402
from autopar.passes.capture import capture  # noqa: E402
from autopar.passes.shape_prop import annotate  # noqa: E402
from autopar.solver.decisions import offload  # noqa: E402
from autopar.solver.decisions.common import Masked, layer_groups  # noqa: E402
from autopar.solver.problem import build_problem  # noqa: E402
from models import GPT  # noqa: E402


class _Anew(Masked):
    """Every table made again at each use: what the terms must equal."""

    def once(self, key, keep, make):
        return make()


def _activation_costs(problem):
    return [c for c in offload.build(problem, "auto").costs if c.what.startswith("offload activations")]


def test_offload_activation_tables_are_made_once_per_distinct_table_and_equal_the_tables_made_anew(monkeypatch):
    with torch.device("meta"):
        model = GPT(vocab=512, seq=256, hidden=256, heads=8, layers=4).to(torch.bfloat16)
    idx = torch.zeros(8, 256, dtype=torch.long, device="meta")
    cap = capture(model, (idx, idx))
    problem = build_problem(cap, annotate(cap.gm), autopar.Mesh((2, 2, 2), ("a", "b", "c"), device="h100"))
    assert len(layer_groups(problem).members) == 3        # the first block, the middle two, the last
    shared = _activation_costs(problem)
    tables = [t for c in shared for _, t in c.expr.edges]
    assert len({id(t) for t in tables}) == len(set(tables)) < len(tables) / 3
    monkeypatch.setattr(offload, "Masked", _Anew)
    assert _activation_costs(problem) == shared
