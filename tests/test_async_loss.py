"""A data-parallel mean loss does not stop the ranks at the end of the forward: its count of kept
targets is gathered at the program's start, asynchronously, as a plain tensor
(runtime/early_reshard.py), and the loss leaves the program a partial sum whose all-reduce is waited
at the caller's first use (the plan divides each rank's partial sum: strategies/pointwise.py;
runtime/async_output.py). Trained as one process."""
from __future__ import annotations

import copy

import torch

import autopar
from autopar.api import planned_on_rank0
from dist_checks import grad_gap, param_gap, rel, step_both
from models import GPT, gpt_inputs

TOL = 1e-4     # three steps: the loss's terms summed in another order per rank


def _inputs():
    idx, tgt = gpt_inputs(batch=16, seq=16, vocab=64)     # work enough that the planner splits the batch
    return idx, tgt.index_fill(1, torch.tensor([0, 15]), -100)      # ignored targets: the count matters


def _train(rank, world_size, read_first):
    torch.manual_seed(0)
    model = GPT(vocab=64, seq=16, hidden=128, heads=4, layers=2)
    inputs = _inputs()
    ref = copy.deepcopy(model)
    mesh = autopar.Mesh((world_size,), ("dp",), device="cpu")
    plan = planned_on_rank0(lambda: autopar.plan(       # planned once, run on every rank
        model, inputs, mesh, pins={n: ("R",) for n, _ in model.named_parameters()}, batch_axes=("dp",),
        memory_budget=float("inf")))
    dmodel = autopar.autoparallelize(model, mesh, inputs, plan=plan)
    # the mask's gather, of a plain boolean tensor, issued early; the ops around it plain calls
    kinds = sorted(type(m).__name__ + (" early" if getattr(m, "early", False) else "")
                   for m in dmodel.graph_module.modules()
                   if type(m).__name__ in ("AsyncOutput", "EarlyReshard", "LocalCollective", "LocalOp"))
    # SGD: linear in the gradient (Adam's normalisation blows the rounding of near-zero gradients up)
    opt, ref_opt = dmodel.optimizer(torch.optim.SGD, lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    local = mesh.local_batch(inputs, ("dp",))
    worst = 0.0
    for _ in range(3):
        loss = dmodel(*local)
        ref_loss = ref(*inputs)
        if read_first:       # the value read before the backward, and the backward through arithmetic on it
            worst = max(worst, rel(loss.detach().clone(), ref_loss.detach()))
            (loss * 2).backward()
            (ref_loss * 2).backward()
        else:                # the backward first: the value read after it
            loss.backward()
            ref_loss.backward()
        worst = max(worst, rel(torch.as_tensor(float(loss)), ref_loss.detach()))
        worst = max(worst, grad_gap(dmodel, ref))
        step_both(opt, ref_opt)
    worst = max(worst, param_gap(dmodel, ref))
    return kinds, worst, plan


def test_mean_loss_all_reduced_after_the_forward_trains_as_one_process(rank_pool):
    for read_first in (False, True):
        kinds, worst, plan = rank_pool(2).run(_train, read_first)[0]
        assert kinds == ["AsyncOutput", "LocalCollective early"], kinds
        assert worst < TOL, (read_first, worst)
    div = next(n for n in plan.nodes if n.op == "aten.div")
    assert div.inputs[0] == ("P",) and div.output == ("P",), div
    out = next(n for n in plan.nodes if n.op == "output")
    assert [c.kind for c in out.collectives] == ["all_reduce@dp"]
    # priced at its launch: nothing in the step waits for it
    assert out.collectives[0].seconds < min(c.seconds for n in plan.nodes for c in n.collectives
                                            if n.op != "output" and c.kind == "all_reduce@dp")
