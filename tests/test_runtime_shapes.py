"""A call at another batch size than planned: the layouts stay, the program follows the sizes.

Sizes that divide as the plan splits them train exactly like one process; sizes that do not are a
PlanMismatchError on every rank, before any collective (the job goes on), naming the input, the
planned and the given sizes."""
from __future__ import annotations

import copy
import os
import sys

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
    return out


def test_other_batch_sizes_train_exactly_and_one_that_does_not_divide_is_an_error_on_every_rank(rank_pool):
    """Whole inputs (every rank gets the global batch): 4 and 12 train exactly; 5 does not split as the
    plan splits the batch: an error on every rank, and the job goes on at the next call."""
    results = rank_pool(4).run(_train_at_other_batches, None, [4, 5, PLANNED, 4, 12])
    for r in results:
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
