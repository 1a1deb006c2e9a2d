"""Plan files and plan-cache files are data: a crafted file runs no code on load, report(),
estimate_at() or largest_batch(), and a damaged one is a PlanFileError naming the file and field."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import autopar  # noqa: E402
from autopar import PlanFileError  # noqa: E402
from dist_checks import LAYOUTS_ONLY, shard_happy_profile  # noqa: E402
from models import GPT, gpt_inputs  # noqa: E402

MESH = ((2, 2), ("dp", "tp"))


def _gpt():
    torch.manual_seed(0)
    return GPT(vocab=64, seq=16, hidden=32, heads=4, layers=1), gpt_inputs(batch=4, seq=16, vocab=64)


@pytest.fixture(scope="module")
def saved():
    """(plan, its JSON as a dict): a plan that splits, with symbolic costs and divisibility conditions."""
    model, inputs = _gpt()
    plan = autopar.plan(model, inputs, autopar.Mesh(*MESH, device=shard_happy_profile()), batch_axes=("dp",),
                        **LAYOUTS_ONLY)
    assert plan.scaling.divisible and not plan.scaling.unavailable
    return plan, json.loads(plan.to_json())


def _payload(marker) -> str:
    return f"__import__('os').system('touch {marker}')"


EXPRESSION_FIELDS = [("compute_s",), ("comm_s",), ("state_bytes",), ("memory_points", 0), ("divisible", 0, 0),
                     ("comm_bytes_per_axis", "tp")]


def _put(d: dict, path: tuple, value) -> None:
    *head, last = path
    for k in head:
        d = d[k]
    d[last] = value


@pytest.mark.parametrize("path", EXPRESSION_FIELDS, ids=[".".join(map(str, p)) for p in EXPRESSION_FIELDS])
def test_crafted_expression_in_a_plan_file_runs_no_code(saved, tmp_path, path):
    marker = tmp_path / "pwned"
    d = copy.deepcopy(saved[1])
    _put(d["scaling"], path, _payload(marker))
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(d))
    with pytest.raises(PlanFileError) as e:
        autopar.Plan.load(f)
    field = "scaling." + "".join(f"[{p}]" if isinstance(p, int) else ("." if i else "") + p for i, p in enumerate(path))
    assert str(f) in str(e.value) and field in str(e.value) and "not allowed" in str(e.value)
    assert not marker.exists()


def test_crafted_plan_object_runs_no_code_in_report_estimate_at_largest_batch(saved, tmp_path):
    """A Plan built in memory around crafted text (never loaded, never checked) still evaluates nothing."""
    marker = tmp_path / "pwned"
    plan = copy.deepcopy(saved[0])
    for field in ("compute_s", "memory_points"):
        value = _payload(marker) if field == "compute_s" else (_payload(marker),)
        plan.scaling = dataclasses.replace(saved[0].scaling, **{field: value})
        for call in (plan.report, lambda: plan.estimate_at(batch=8), plan.largest_batch):
            with pytest.raises(PlanFileError, match=f"scaling.{field}"):
                call()
    assert not marker.exists()


def test_cost_expressions_round_trip_exactly(saved, tmp_path):
    plan = saved[0]
    plan.save(tmp_path / "p.json")
    again = autopar.Plan.load(tmp_path / "p.json")
    assert again == plan and again.to_json() == plan.to_json()
    assert again.estimate_at(batch=8) == plan.estimate_at(batch=8) and again.largest_batch() == plan.largest_batch()


DAMAGE = [
    # (id, mutate(d), field the error must name)
    ("version", lambda d: d.update(version=1), "version"),
    ("missing-field", lambda d: d.pop("placements"), "placements"),
    ("unknown-field", lambda d: d.update(placement={}), "placement"),
    ("mesh-type", lambda d: d["mesh"].update(shape="2x2"), "mesh.shape"),
    ("layout-length", lambda d: d["placements"].update({next(iter(d["placements"])): ["R"]}), "placements."),
    ("layout-text", lambda d: d["nodes"][-1].update(output=["R", "Shard(0)"]), "].output[1]"),
    ("negative-dim", lambda d: d["nodes"][-1].update(output=["R", "S(-1)"]), "].output[1]"),
    ("executor", lambda d: d["nodes"][0].update(executor="exec"), "nodes[0].executor"),
    ("estimate-type", lambda d: d["estimate"].update(step_time_s="fast"), "estimate.step_time_s"),
    ("solver-int", lambda d: d["solver"].update(n_variables=1.5), "solver.n_variables"),
    ("recompute", lambda d: d.update(recompute={"blocks.0": "sometimes"}), "recompute.blocks.0"),
    ("residency", lambda d: d.update(residency={"head.weight": 1}), "residency.head.weight"),
    ("offload-tier", lambda d: d.update(offload={"activations:blocks.0": "tape"}), "offload.activations:blocks.0"),
    ("offload-class", lambda d: d.update(offload={"weights:blocks.0": "host"}), "offload.weights:blocks.0"),
    ("pipeline-axis", lambda d: d.update(pipeline={"axis": "pp", "stages": 2, "boundaries": ["", "b"]}),
     "pipeline.axis"),
    ("pipeline-boundaries", lambda d: d.update(pipeline={"axis": "dp", "stages": 2, "boundaries": [""]}),
     "pipeline.boundaries"),
    ("pipeline-schedule", lambda d: d["pipeline"].update(schedule="zigzag"), "pipeline.schedule"),
    ("batch-axes", lambda d: d["options"].update(batch_axes=["pp"]), "options.batch_axes[0]"),
    ("divisible-parts", lambda d: d["scaling"].update(divisible=[["B", 0]]), "scaling.divisible[0][1]"),
    ("expression-name", lambda d: d["scaling"].update(comm_s="B*x"), "scaling.comm_s"),
    ("huge-power", lambda d: d["scaling"].update(comm_s="B**9**9**9"), "scaling.comm_s"),
    ("not-an-object", lambda d: d["nodes"].__setitem__(0, "node"), "nodes[0]"),
]


@pytest.mark.parametrize("mutate,field", [d[1:] for d in DAMAGE], ids=[d[0] for d in DAMAGE])
def test_damaged_plan_file_names_file_and_field(saved, tmp_path, mutate, field):
    d = copy.deepcopy(saved[1])
    mutate(d)
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(d))
    with pytest.raises(PlanFileError) as e:
        autopar.Plan.load(f)
    assert str(e.value).startswith(f"{f}: ") and field in str(e.value), str(e.value)


@pytest.mark.parametrize("text", ["", "{", "[1, 2]", "null", "not json", "{\"version\": 2"])
def test_truncated_or_non_json_plan_file(saved, tmp_path, text):
    f = tmp_path / "plan.json"
    f.write_text(text)
    with pytest.raises(PlanFileError, match=str(f)):
        autopar.Plan.load(f)
    f.write_text(saved[0].to_json()[: len(saved[0].to_json()) // 2])     # cut in the middle
    with pytest.raises(PlanFileError, match="truncated"):
        autopar.Plan.load(f)


def test_missing_plan_file_is_a_plan_file_error(tmp_path):
    with pytest.raises(PlanFileError, match="nope.json"):
        autopar.Plan.load(tmp_path / "nope.json")


def test_crafted_plan_cache_entry_is_ignored_with_a_warning(tmp_path):
    """A cache entry is a plan file too: a crafted one runs nothing, is reported and re-solved."""
    model, inputs = _gpt()
    mesh = autopar.Mesh((2,), ("dp",), device="cpu")
    first = autopar.plan(model, inputs, mesh, cache_dir=str(tmp_path))
    (entry,) = tmp_path.glob("*.json")
    d = json.loads(entry.read_text())
    marker = tmp_path / "pwned"
    d["scaling"]["memory_points"] = [_payload(marker)]
    entry.write_text(json.dumps(d))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = autopar.plan(model, inputs, mesh, cache_dir=str(tmp_path))
    assert not again.timings.cached and again == first and not marker.exists()
    assert any("plan cache" in str(w.message) and "scaling.memory_points[0]" in str(w.message) for w in caught)


def _apply_tampered(rank, world_size, plan_json):
    model, inputs = _gpt()
    mesh = autopar.Mesh(*MESH, device=shard_happy_profile())
    try:
        autopar.autoparallelize(model, mesh, inputs, plan=autopar.Plan.from_json(plan_json))
    except autopar.AutoparError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_tampered_layouts_are_refused_when_applied(saved, rank_pool):
    """Layouts that parse but do not fit the model (a dim the tensor lacks, a size that does not divide)."""
    d = copy.deepcopy(saved[1])
    fqn = "blocks.0.ln1.weight"         # shape (32,): one dim
    d["placements"][fqn] = ["S(1)", "R"]
    lin = next(i for i, n in enumerate(d["nodes"]) if n["op"].startswith("aten.linear"))
    d2 = copy.deepcopy(saved[1])
    d2["nodes"][lin]["inputs"] = d2["nodes"][lin]["inputs"][:1]  # one layout for its three tensor inputs
    msgs = rank_pool(4).run(_apply_tampered, json.dumps(d)) + rank_pool(4).run(_apply_tampered, json.dumps(d2))
    assert all(m.startswith("PlanFileError") for m in msgs), msgs
    assert f"placements.{fqn}" in msgs[0] and "has no dim 1" in msgs[0]
    assert f"nodes[{lin}].inputs" in msgs[4] and "1 layouts for" in msgs[4]
