"""An axis of one device moves nothing: every layout over it holds the same local tensor (a whole
shard, a one-term sum), so the runtime relabels where the plan changes layout over such an axis,
and sends no gradient bucket and no parameter gather over it (DDP and FSDP2 send nothing on a world
of one either); the planner prices none. Meshes like (dp=8, tp=1) keep an axis of one."""
from __future__ import annotations

import copy

import torch

import autopar
from dist_checks import grad_gap, param_gap, rel, step_both
from models import GPT, gpt_inputs

TOL = 1e-4     # three SGD steps


def _train(rank, world_size, shape, names):
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)
    model = GPT(vocab=64, seq=16, hidden=64, heads=4, layers=2)
    inputs = gpt_inputs(batch=8, seq=16, vocab=64)
    ref = copy.deepcopy(model)
    mesh = autopar.Mesh(shape, names, device="cpu")
    pins = {n: tuple("S(0)" if a == "one" else "R" for a in names) for n, _ in model.named_parameters()}
    plan = autopar.plan(model, inputs, mesh, pins=pins, batch_axes=names, residency="regather",
                        memory_budget=float("inf"))
    dmodel = autopar.autoparallelize(model, mesh, inputs, plan=plan)
    opt, ref_opt = dmodel.optimizer(torch.optim.SGD, lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    local = mesh.local_batch(inputs, names)
    worst, collectives = 0.0, None
    for step in range(3):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss, ref_loss = dmodel(*local), ref(*inputs)
            loss.backward(), ref_loss.backward()
            worst = max(worst, rel(torch.as_tensor(float(loss)), ref_loss.detach()))
        if step == 2:
            collectives = sorted({e.name for e in prof.events() if e.name.startswith("c10d::")})
        worst = max(worst, grad_gap(dmodel, ref))
        step_both(opt, ref_opt)
    worst = max(worst, param_gap(dmodel, ref))
    return worst, collectives, plan.estimate.grad_sync_s


def test_a_world_of_one_sends_nothing_and_trains_as_one_process(rank_pool):
    worst, collectives, grad_sync = rank_pool(1).run(_train, (1,), ("one",))[0]
    assert worst < TOL, worst
    assert collectives == [], collectives
    assert grad_sync == 0.0


def test_an_axis_of_one_beside_a_real_one_trains_as_one_process(rank_pool):
    worst, _, _ = rank_pool(2).run(_train, (1, 2), ("one", "dp"))[0]
    assert worst < TOL, worst


def _data_parallel_program(rank, world_size):
    torch.manual_seed(0)
    model = GPT(vocab=64, seq=16, hidden=64, heads=4, layers=2)
    inputs = gpt_inputs(batch=8, seq=16, vocab=64)
    mesh = autopar.Mesh((1,), ("dp",), device="cpu")
    pins = {n: ("R",) for n, _ in model.named_parameters()}
    dmodel = autopar.autoparallelize(model, mesh, inputs, pins=pins, batch_axes=("dp",), memory_budget=float("inf"))
    ref = copy.deepcopy(model)
    loss, ref_loss = dmodel(*inputs), ref(*inputs)
    loss.backward(), ref_loss.backward()
    wrappers = [n.target for n in dmodel.graph_module.graph.nodes if n.op in ("call_module", "call_method")]
    return wrappers, type(loss) is torch.Tensor, max(rel(loss.detach(), ref_loss.detach()), grad_gap(dmodel, ref))


def test_a_world_of_one_runs_the_models_ops_and_nothing_else(rank_pool):
    """On one device a data-parallel program is the model's own ops called in order: no reshard, no
    wrapper module, the loss handed back as the plain tensor it is (as one process computes it)."""
    wrappers, plain_loss, worst = rank_pool(1).run(_data_parallel_program)[0]
    assert wrappers == [], wrappers
    assert plain_loss
    assert worst < 1e-6, worst
