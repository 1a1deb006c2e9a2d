"""Ops whose gradient flows into parameters alone (a position embedding looked up at `arange`, a
weight's transpose) keep their gradients partial sums where they are replicated: the sum is taken
in the parameters' gradient buckets, as DDP does, instead of an all-reduce of the activation's
gradient where the replicated part meets the split batch. Priced so by the planner, run so by the
runtime, and trained as one process."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import autopar
from dist_checks import grad_gap, param_gap, rel, step_both

TOL = 1e-4     # three SGD steps; partial sums added in another order than one process adds them


class PosMix(nn.Module):
    def __init__(self, vocab: int = 32, seq: int = 8, d: int = 16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.w = nn.Parameter(torch.randn(d, d) / 4)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, tgt):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        x = torch.tanh(x @ self.w.t())          # the weight's transpose: parameter-side too
        return F.cross_entropy(self.head(x).flatten(0, 1), tgt.flatten())


def _inputs():
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, 32, (8, 8), generator=g) for _ in range(2))


def _plan(model, mesh, data_parallel: bool):
    pins = {n: tuple("R" for _ in mesh.shape) for n, _ in model.named_parameters()} if data_parallel else None
    return autopar.plan(model, _inputs(), mesh, pins=pins, batch_axes=("dp",), memory_budget=float("inf"))


def _train(rank, world_size, shape, names, data_parallel):
    torch.manual_seed(0)
    model = PosMix()
    ref = copy.deepcopy(model)
    mesh = autopar.Mesh(shape, names, device="cpu")
    plan = _plan(model, mesh, data_parallel)
    dmodel = autopar.autoparallelize(model, mesh, _inputs(), plan=plan)
    opt, ref_opt = dmodel.optimizer(torch.optim.SGD, lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    local = mesh.local_batch(_inputs(), ("dp",))
    worst = 0.0
    for _ in range(3):
        loss, ref_loss = dmodel(*local), ref(*_inputs())
        loss.backward(), ref_loss.backward()
        worst = max(worst, rel(torch.as_tensor(float(loss)), ref_loss.detach()))
        worst = max(worst, grad_gap(dmodel, ref))
        step_both(opt, ref_opt)
    return max(worst, param_gap(dmodel, ref))


def test_data_parallel_reduces_the_position_gradient_in_the_buckets():
    plan = _plan(PosMix(), autopar.Mesh((2,), ("dp",), device="cpu"), data_parallel=True)
    nodes = {n.name: n for n in plan.nodes}
    kinds = {name: [c.kind for c in n.collectives] for name, n in nodes.items()}
    add = next(n for n in plan.nodes if n.op == "aten.add")
    assert kinds[add.name] == [], kinds            # no all-reduce where the positions meet the batch
    # the position table's gradient (its lookup's input) and the transposed weight's reach their buckets
    pos = next(n for n in plan.nodes if n.op == "aten.embedding" and n.name != "embedding")
    t = next(n for n in plan.nodes if n.op == "aten.t")
    for node in (pos, t):
        assert kinds[node.name] == ["all_reduce@dp"], kinds
        assert node.collectives[0].seconds < plan.estimate.grad_sync_s


def test_parameter_side_gradients_train_as_one_process(rank_pool):
    assert rank_pool(2).run(_train, (2,), ("dp",), True)[0] < TOL
    assert rank_pool(4).run(_train, (2, 2), ("dp", "tp"), False)[0] < TOL
