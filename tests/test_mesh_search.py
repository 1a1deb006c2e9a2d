"""A Cluster instead of a Mesh: the planner chooses the mesh shape, the axes' roles and their order on
the devices (autopar/planner/mesh_search.py), records the mesh in the plan, and autoparallelize runs it."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import autopar
from autopar.cluster import Cluster
from autopar.errors import MeshError, PlanFileError, PlanOptionError
from autopar.planner.mesh_screen import ModelFacts, mesh_candidates
from autopar.strategies.attention import CONTEXT_LABELS
from dist_checks import grad_gap, param_gap, rel, step_both
from models import GPT, gpt_inputs


def _facts(**kw) -> ModelFacts:
    base = dict(batch=64, seq=2048, layers=16, flops=1e15, dense_elements=1e9, expert_elements=0.0, param_itemsize=2,
                layer_out_bytes=1e9, experts=0, top_k=0, attention=True)
    return ModelFacts(**{**base, **kw})


def test_candidates_cover_the_devices_with_the_roles_the_model_can_use():
    dense = mesh_candidates(32, 8, _facts())
    assert dense and all(math.prod(d.values()) == 32 for d in dense)
    assert all(d["ep"] == 1 and d["cp"] == 1 for d in dense)             # no experts, a short sequence
    assert all(d["tp"] * d["ep"] <= 8 for d in dense)                    # tensor axes stay inside a node
    assert {d["pp"] for d in dense} >= {1, 2, 4, 8, 16}
    assert all(d["pp"] == 1 for d in mesh_candidates(32, 8, _facts(), pipeline=False))
    moe = mesh_candidates(32, 8, _facts(experts=4, top_k=2, expert_elements=1e9))
    assert {d["ep"] for d in moe} == {1, 2, 4}                          # divisors of the expert count
    long = mesh_candidates(32, 8, _facts(seq=65536, batch=2))
    assert max(d["cp"] for d in long) > 1 and all(64 % d["dp"] == 0 or d["dp"] <= 2 for d in long)
    assert all(d["cp"] == 1 for d in mesh_candidates(32, 8, _facts(seq=65536, attention=False)))


def test_the_facts_come_from_the_captured_graph():
    import zoo
    from autopar.passes.capture import capture
    from autopar.passes.shape_prop import annotate
    model, args, kwargs, _ = zoo.build("mixtral")
    cap = capture(model, args, kwargs)
    f = ModelFacts.of(cap, annotate(cap.gm))
    cfg = model.config
    assert (f.experts, f.top_k, f.layers) == (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers)
    assert f.expert_elements > 0 and f.attention and f.flops > 0 and f.layer_out_bytes > 0
    assert f.dense_elements + f.expert_elements == sum(p.numel() for p in model.parameters())
    assert (f.batch, f.seq) == tuple(kwargs.get("input_ids", args[0] if args else None).shape)


def test_a_cluster_lays_inner_axes_inside_a_node():
    c = Cluster(nodes=4, devices_per_node=8, device="h100")
    mesh = c.mesh((4, 8), ("dp", "tp"))
    assert [a.scope for a in mesh.axes] == ["inter-node", "intra-node"]
    assert Cluster.parse("128x8") == Cluster(128, 8)
    for bad in (dict(nodes=0), dict(nodes=2, devices_per_node=1.5)):
        with pytest.raises(MeshError):
            Cluster(**bad)
    with pytest.raises(MeshError):
        c.mesh((4, 4), ("dp", "tp"))


def test_a_mesh_of_four_split_axes_is_searched_in_subspaces_of_two():
    """A candidate without a pipeline may split four axes, (dp, cp, ep, tp): its layout model is too large to
    solve whole, and each subspace searched merges axes until two are left (`prune.axis_merges`), the first
    keeping the fast intra-node axes together and the inter-node ones together."""
    from types import SimpleNamespace
    from autopar.solver.prune import axis_merges
    mesh = Cluster(nodes=8, devices_per_node=8, device="h100").mesh((4, 2, 2, 4), ("dp", "cp", "ep", "tp"))
    merges = axis_merges(SimpleNamespace(mesh=mesh))
    assert merges[0] == ((0, 1), (2, 3))
    for groups in merges:
        merged = {a for g in groups for a in g}
        assert len(merged) - sum(len(g) - 1 for g in groups) + (4 - len(merged)) == 2   # two axes left
    assert len(set(merges)) == len(merges) == 3
    assert [len(m) for m in axis_merges(SimpleNamespace(mesh=mesh.__class__((8, 2, 4), ("dp", "cp", "tp"),
                                                                           mesh.profile)))] == [1, 1, 1]


def test_a_three_axis_mesh_reaches_roles_its_merged_subspaces_leave_out():
    """A mesh of three split axes is searched in subspaces that merge two axes (they do the same); a plan whose
    two intra-node axes do different things, the sequence split over one (context-parallel attention) and heads
    over the other, is in none of them. The floor, found whatever the time limit, takes one local-search step
    across one axis from the first subspace's plan and reaches it; the other subspaces wait for time left."""
    from models import Llama
    with torch.device("meta"):
        model = Llama(vocab=1024, hidden=1024, heads=8, kv_heads=2, ffn=2048, layers=2, seq=65536)
        idx = torch.zeros(2, 65536, dtype=torch.long)
    mesh = Cluster(nodes=2, devices_per_node=4, device="h100").mesh((2, 2, 2), ("dp", "cp", "tp"))
    plan = autopar.plan(model, (idx, idx), mesh, time_limit=1e-3, sharded_outputs=True, symbolic=False,
                        pipeline=False, progress=False)
    assert plan.solver.status == "best found at the time limit (subspaces of merged mesh axes searched)"
    attention = {tuple(n.labels) for n in plan.nodes if "scaled_dot_product" in n.op}
    assert attention and all(sum(lab in CONTEXT_LABELS for lab in labels[1:]) == 1 and "heads" in labels[1:]
                             for labels in attention), attention


def _tiny():
    torch.manual_seed(0)
    return GPT(vocab=64, seq=16, hidden=32, heads=4, layers=2), gpt_inputs(batch=8, seq=16, vocab=64)


def test_the_chosen_mesh_is_the_fastest_planned_recorded_and_reproducible():
    model, inputs = _tiny()
    cluster = Cluster(nodes=1, devices_per_node=2, device="cpu")
    plans = [autopar.plan(model, inputs, cluster, time_limit=None, progress=False) for _ in range(2)]
    plan = plans[0]
    assert plans[0].to_json() == plans[1].to_json()
    # a limit too short for any solve: the first mesh is planned to the solver's floor (its first plans, the
    # LP relaxation's layouts rounded, found whatever the limit), the optimum on this model, however loaded the machine
    rushed = autopar.plan(model, inputs, cluster, time_limit=1e-3, progress=False)
    assert rushed.mesh == plans[0].mesh and rushed.estimate.step_time_s == plans[0].estimate.step_time_s
    assert math.prod(plan.mesh["shape"]) == 2 and plan.mesh["devices_per_node"] == 2
    chosen, *others = plan.mesh_search
    assert chosen.status == "chosen" and list(chosen.shape) == list(plan.mesh["shape"])
    assert chosen.step_time_s == plan.estimate.step_time_s
    assert {r.axis_names for r in plan.mesh_search} == {("dp",), ("pp",), ("tp",)}
    assert all(r.step_time_s >= chosen.step_time_s for r in others if r.status == "planned")
    assert all(r.note for r in others if r.status != "planned")      # why it was not planned
    twins = [r for r in others if r.note.startswith("the same mesh as")]  # (dp=2) and (tp=2): one problem
    assert len(twins) == 1 and tuple(twins[0].shape) == (2,) and twins[0].status == "not planned"
    assert "Mesh search" in plan.report()
    priced = autopar.estimate(model, inputs, cluster, plan)        # a Cluster where a Mesh goes: the plan's mesh
    assert priced.devices == 2 and priced.step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-6)
    assert autopar.Plan.from_json(plan.to_json()) == plan
    bad = json.loads(plan.to_json())
    bad["mesh_search"][0]["status"] = "best"
    with pytest.raises(PlanFileError, match="mesh_search"):
        autopar.Plan.from_dict(bad)
    bad = json.loads(plan.to_json())
    bad["mesh"]["nodes"] = 3
    with pytest.raises(PlanFileError, match="mesh"):
        autopar.Plan.from_dict(bad)
    with pytest.raises(PlanOptionError):
        autopar.plan(model, inputs, cluster, batch_axes=("dp",))


def test_a_time_limit_is_shared_among_the_first_meshes_planned(monkeypatch):
    """Under a time limit the first SHARED meshes planned each get an equal share of the time left (their
    own `time_limit`), so that runners-up are planned however slow the machine; the ones after, what is left."""
    from autopar.planner import mesh_search
    now = [100.0]
    monkeypatch.setattr(mesh_search.time, "perf_counter", lambda: now[0])
    deadline, n = 190.0, mesh_search.SHARED
    assert mesh_search._time_slice(deadline, 0) == pytest.approx(90.0 / n)
    limits = []
    for k in range(n + 1):
        limits.append(mesh_search._time_slice(deadline, k))
        now[0] += limits[-1] / 2                    # each plan takes half its slice
    assert all(b > a for a, b in zip(limits[:n], limits[1:n]))   # what one leaves is shared by the rest
    assert limits[-1] == pytest.approx(deadline - (now[0] - limits[-1] / 2))   # after them: all that is left
    assert mesh_search._time_slice(None, 0) is None
    now[0] = 200.0
    assert mesh_search._time_slice(deadline, 1) == 0.0


def test_once_a_plan_is_found_a_mesh_is_started_only_in_the_time_the_slowest_took():
    """The time limit bounds the whole search: each mesh gets its solver's first plans whatever its slice, so
    after the first plan a mesh is started only while the time left is at least what the slowest mesh's plan
    took; the others are not planned, for the time limit, saying how much was left."""
    from types import SimpleNamespace
    from autopar.planner import mesh_search
    s = SimpleNamespace(bound_s=0.0, estimate_s=1.0)
    found = dict(best_s=2.0, n_planned=1, top=1.0, scale=1.0)
    assert mesh_search._skipped(s, left=30.0, slowest_s=20.0, **found) is None
    status, why = mesh_search._skipped(s, left=10.0, slowest_s=20.0, **found)
    assert status == "not planned" and why.startswith("the time limit") and "10.0 s left" in why and "20.0 s" in why
    assert mesh_search._skipped(s, left=0.5, slowest_s=0.1, **found)[0] == "not planned"    # MIN_SLICE_S
    assert mesh_search._skipped(s, left=None, slowest_s=1e9, **found) is None               # no time limit


def test_the_cli_takes_a_cluster_for_the_mesh():
    from autopar.cli import CliError, _mesh, build_parser
    a = build_parser().parse_args(["plan", "my_models:small", "--cluster", "4x8", "--device", "a100"])
    assert _mesh(a) == Cluster(4, 8, "a100")
    with pytest.raises(CliError):
        _mesh(build_parser().parse_args(["plan", "my_models:small", "--cluster", "4x8", "--mesh", "32"]))
    with pytest.raises(MeshError):
        _mesh(build_parser().parse_args(["plan", "my_models:small", "--cluster", "4"]))


TOL = 1e-4     # three SGD steps


def _train_on_cluster(rank, world_size):
    model, inputs = _tiny()
    ref = copy.deepcopy(model)
    cluster = autopar.Cluster(nodes=2, devices_per_node=2, device="cpu")
    dmodel = autopar.autoparallelize(model, cluster, inputs, pipeline=False, symbolic=False, time_limit=None)
    opt, ref_opt = dmodel.optimizer(torch.optim.SGD, lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    worst = 0.0
    for _ in range(3):
        loss, ref_loss = dmodel(*inputs), ref(*inputs)
        loss.backward(), ref_loss.backward()
        worst = max(worst, rel(torch.as_tensor(float(loss)), ref_loss.detach()), grad_gap(dmodel, ref))
        step_both(opt, ref_opt)
    worst = max(worst, param_gap(dmodel, ref))
    mesh = dmodel.plan.mesh
    return worst, list(mesh["shape"]), list(mesh["axis_names"]), tuple(next(dmodel.parameters()).device_mesh.shape)


def test_autoparallelize_on_a_cluster_trains_as_one_process(rank_pool):
    results = rank_pool(4).run(_train_on_cluster)
    worst, shape, names, device_mesh = results[0]
    assert worst < TOL, worst
    assert math.prod(shape) == 4 and tuple(shape) == device_mesh
    assert all(r[1:] == results[0][1:] for r in results)      # every rank runs the mesh rank 0 chose
