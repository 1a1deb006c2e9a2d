"""A call at another batch size than planned: the layouts stay, the program follows the sizes.

Sizes that divide as the plan splits them train exactly like one process; sizes that do not are a
PlanMismatchError on every rank, before any collective (the job goes on), naming the input, the
planned and the given sizes."""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import autopar  # noqa: E402
from dist_checks import LAYOUTS_ONLY, rel, shard_happy_profile  # noqa: E402
from models import GPT, gpt_inputs  # noqa: E402

PLANNED = 8


def _train_at_other_batches(rank, world_size, batch_axes, batches):
    """Plan at batch 8; train one step per batch in `batches` (global sizes); the worst relative
    difference to one process per batch, or the error's text."""
    torch.manual_seed(0)
    model = GPT(vocab=64, seq=16, hidden=32, heads=4, layers=1)
    ref = copy.deepcopy(model)
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device=shard_happy_profile())
    dmodel = autopar.autoparallelize(model, mesh, gpt_inputs(batch=PLANNED, seq=16, vocab=64),
                                     batch_axes=batch_axes, **LAYOUTS_ONLY)
    opt = torch.optim.SGD(dmodel.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    out = {}
    for step, b in enumerate(batches):
        inputs = gpt_inputs(batch=b, seq=16, vocab=64, seed=step)
        mine = mesh.local_batch(inputs, batch_axes) if batch_axes else inputs
        try:
            loss = dmodel(*mine)
        except autopar.AutoparError as e:
            out[b] = f"{type(e).__name__}: {e}"
            continue
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        loss.backward()
        ref_loss = ref(*inputs)
        ref_loss.backward()
        grads = dict(dmodel.named_parameters())
        worst = max(rel(grads[k].grad.full_tensor(), p.grad) for k, p in ref.named_parameters())
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        params = dict(dmodel.named_parameters())
        worst = max([worst, rel(loss.detach(), ref_loss.detach())] +
                    [rel(params[k].detach().full_tensor(), p.detach()) for k, p in ref.named_parameters()])
        out[b] = worst
    out["programs"] = len(dmodel._autopar["programs"])
    out["local_splits"] = sorted(m.extra_repr() for m in dmodel.graph_module.modules()
                                 if type(m).__name__ == "LocalSplit")
    return out


def test_other_batch_sizes_train_exactly_and_one_that_does_not_divide_is_an_error_on_every_rank(rank_pool):
    """Whole inputs (every rank gets the global batch): 4 and 12 train exactly; 5 does not split as the
    plan splits the batch: an error on every rank, and the job goes on at the next call. The integer
    inputs (token ids, targets) are split as the plan splits them by taking this rank's block of the
    tensor given (`LocalSplit`: no DTensor)."""
    results = rank_pool(4).run(_train_at_other_batches, None, [4, 5, PLANNED, 4, 12])
    for r in results:
        assert r["local_splits"], r      # the plan's split (over one axis or both, as the solver chose)
        assert all(not isinstance(r[b], str) and r[b] < 1e-4 for b in (4, PLANNED, 12)), r
        assert r["programs"] == 3          # one per distinct shape, reused
        msg = r[5]
        assert msg.startswith("PlanMismatchError"), msg
        assert "input 'idx'" in msg and f"planned [{PLANNED}, 16]" in msg and "given [5, 16]" in msg, msg


def test_batch_split_inputs_at_other_batch_sizes(rank_pool):
    """Inputs split over dp (a DistributedSampler's slices): global 4 and 12 train exactly; global 6
    gives every rank 3 rows, which the plan splits further (over tp): an error on every rank."""
    results = rank_pool(4).run(_train_at_other_batches, ("dp",), [4, 6, 12, PLANNED])
    for r in results:
        assert all(not isinstance(r[b], str) and r[b] < 1e-4 for b in (4, 12, PLANNED)), r
        msg = r[6]
        assert msg.startswith("PlanMismatchError") and "given [6, 16]" in msg and "split 4 ways" in msg, msg


def _input_gradient(rank, world_size, first):
    """A data-parallel MLP whose input needs a gradient, its first linear's output pinned to `first`
    (its rows: the input taken as given; whole: the input gathered first): each rank is given its
    rows (a leaf of its own); (the worst relative gap of its gradient to one process's rows, of the
    loss, and the program's code)."""
    from models import MLP
    torch.manual_seed(0)
    model = MLP(d_in=16, hidden=32, d_out=8, depth=2)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    mesh = autopar.Mesh((world_size,), ("dp",), device="cpu")
    pins = {**{n: ("R",) for n, _ in model.named_parameters()}, "linear": (first,)}
    dmodel = autopar.autoparallelize(model, mesh, (x,), pins=pins, batch_axes=("dp",), memory_budget=float("inf"))
    mine = mesh.local_batch((x,), ("dp",))[0].clone().requires_grad_()
    loss = (dmodel(mine) ** 2).sum()
    loss.backward()
    whole = x.clone().requires_grad_()
    ref_loss = (model(whole) ** 2).sum()
    ref_loss.backward()
    rows = mesh.local_batch((whole.grad,), ("dp",))[0]
    return rel(mine.grad, rows), rel(loss.detach(), ref_loss.detach()), dmodel.graph_module.code


@pytest.mark.parametrize("first", ["S(0)", "R"])
def test_an_input_that_needs_a_gradient_gets_the_gradient_of_its_rows(rank_pool, first):
    """Taken as the tensor it was given (no DTensor made for it) or gathered first (a collective
    issued at the program's start): autograd reaches the caller's tensor either way, with the
    gradient one process gives those rows."""
    for grad_gap, loss_gap, code in rank_pool(2).run(_input_gradient, first):
        assert grad_gap < 1e-5 and loss_gap < 1e-5, (grad_gap, loss_gap)
        assert ("reshard_linear_0(x)" in code) == (first == "R"), code
