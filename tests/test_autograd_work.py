"""The autograd work priced beyond each op's own backward kernel (cost_model/autograd.py) is work
PyTorch really runs: each case is checked twice, against the ops torch's profiler records in a real
backward and against the GradWork the planner attaches to the node."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.cost_model.autograd import SUM_PASSES, GradWork, grad_work_time
from autopar.passes.capture import capture
from autopar.passes.shape_prop import annotate
from autopar.solver.problem import build_problem


class FanOut(nn.Module):          # a residual stream: h feeds a layer norm and the residual add
    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        h = self.fc(x)
        return (h + self.ln(h)).sum()


class Split(nn.Module):            # q and k cut out of one projection
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 16))

    def forward(self, x):
        q, k = (x @ self.w).split(8, dim=-1)
        return (q.exp() * 2).sum() + (k.sin() * 3).sum()


class Broadcast(nn.Module):        # a position embedding added to every sample
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        return (x + self.pos).tanh().sum()


class Product(nn.Module):          # a gated unit: both factors need their gradient
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return (F.silu(self.a(x)) * self.b(x)).sum()


class Slices(nn.Module):           # rotary embeddings' halves; a position table expanded to the batch
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8, bias=False)
        self.pos = nn.Parameter(torch.randn(1, 4, 8))

    def forward(self, x):
        h = self.fc(x) * self.pos.expand(2, 4, 8)
        return h[..., :4].exp().sum() + h[..., 4:].sin().sum()


def backward_ops(model, x) -> list[str]:
    loss = model(x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss.backward()
    return [e.name for e in prof.events()]


def work_of(model, x) -> dict[str, GradWork]:
    cap = capture(model, (x,))
    mesh = autopar.Mesh((1,), ("dp",), device="cpu")
    problem = build_problem(cap, annotate(cap.gm), mesh)
    return {n: d.facts.work for n, d in problem.decisions.items() if d.kind == "op" and d.facts.work}


X = torch.randn(2, 4, 8)


def test_gradients_of_two_consumers_are_added():
    ops = backward_ops(FanOut(), X)
    assert "aten::add" in ops or "aten::add_" in ops
    work = work_of(FanOut(), X)
    assert [w.sums for w in work.values() if w.sums] == [1]      # h: layer norm + residual add


def test_split_backward_concatenates():
    assert "aten::cat" in backward_ops(Split(), X)
    work = work_of(Split(), X)
    assert any(w.all_passes == 2.0 and w.kernels == 1 for w in work.values())


def test_broadcast_input_gradient_is_summed_and_bias_gradient_too():
    assert "aten::sum" in backward_ops(Broadcast(), X)
    assert any(w.out_passes == 1.0 for w in work_of(Broadcast(), X).values())
    assert "aten::sum" in backward_ops(FanOut(), X)               # fc's bias: dY summed over rows
    assert any(w.out_passes >= 1.0 for w in work_of(FanOut(), X).values())


def test_a_product_of_two_trained_factors_runs_two_gradient_kernels():
    ops = backward_ops(Product(), X)
    assert ops.count("aten::mul") >= 2
    work = work_of(Product(), X)
    assert [w.kernels for w in work.values() if w.out_passes == 3.0] == [1]


def test_work_is_priced_as_memory_bound_passes():
    prof = autopar.Mesh((1,), ("dp",), device="a100").profile
    bw = prof.memory_bandwidth * prof.memory_efficiency
    w = GradWork(out_passes=1.0, all_passes=2.0, in_passes=1.0, kernels=2, sums=1)
    t = grad_work_time(w, 1e9, 3e9, 5e9, prof)
    assert t == pytest.approx(((1.0 + SUM_PASSES) * 1e9 + 2.0 * 3e9 + 5e9) / bw + 3 * prof.kernel_overhead)
    assert grad_work_time(GradWork(), 1e9, 1e9, 1e9, prof) == 0.0


def test_slice_backward_fills_zeros_and_expand_backward_sums():
    ops = backward_ops(Slices(), X)
    assert "aten::slice_backward" in ops and "ExpandBackward0" in ops
    work = work_of(Slices(), X)
    slices = [w for w in work.values() if w.in_passes == 1.0]
    assert len(slices) == 2 and all(w.kernels == 2 for w in slices)
    assert any(w.out_passes == 1.0 and w.kernels == 1 for w in work.values())   # the expand


class Tied(nn.Module):             # one weight used twice (an autoencoder with tied weights)
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        return F.linear(F.linear(x, self.w).tanh(), self.w.t()).sum()


def test_a_parameter_used_twice_sums_its_gradients():
    assert "aten::add" in backward_ops(Tied(), X) or "aten::add_" in backward_ops(Tied(), X)
    cap = capture(Tied(), (X,))
    problem = build_problem(cap, annotate(cap.gm), autopar.Mesh((1,), ("dp",), device="a100"))
    (param,) = [d for d in problem.decisions.values() if d.kind == "param"]
    assert param.facts.work.sums == 1 and param.compute_s[0] > 0
