"""Capturing a deep stack of alike blocks three blocks deep and copying the last gives the graph
tracing every block gives (up to node names), and the same loss on real weights; a stack whose
blocks differ is traced whole."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.fx as fx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import autopar.passes.capture as capture_module  # noqa: E402
from autopar.passes.capture import capture  # noqa: E402
from autopar.passes.layers import module_path  # noqa: E402
from models import GPT, gpt_inputs  # noqa: E402


def _whole(model, args, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(capture_module, "deep_stack", lambda model: None)
        return capture(model, args)


def _canonical(cap) -> list:
    """The graph with every node named by its position: ops, wiring, shapes, module paths, inputs."""
    index = {n: i for i, n in enumerate(cap.gm.graph.nodes)}

    def arg(a):
        if isinstance(a, fx.Node):
            return ("node", index[a])
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        return repr(a)
    return [(n.op, str(n.target) if n.op != "placeholder" else "", arg(n.args), arg(n.kwargs), module_path(n, cap),
             cap.inputs.get(n.name), tuple(n.meta["val"].shape) if isinstance(n.meta.get("val"), torch.Tensor) else None)
            for n in cap.gm.graph.nodes]


def _loss(cap, model, args) -> torch.Tensor:
    feed = []
    for n in cap.gm.graph.nodes:
        if n.op == "placeholder":
            slot = cap.inputs[n.name]
            feed.append(model.get_parameter(slot.target) if slot.kind == "param" else args[slot.target])
    return cap.gm(*feed)[0]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_deep_stack_captures_as_the_whole_trace(monkeypatch, dropout):
    torch.manual_seed(0)
    model = GPT(vocab=64, seq=16, hidden=32, heads=4, layers=5, dropout=dropout).train(dropout > 0)
    args = gpt_inputs(batch=2, seq=16, vocab=64)
    short, whole = capture(model, args), _whole(model, args, monkeypatch)
    assert len([n for n in short.gm.graph.nodes if "blocks.4." in module_path(n, short)]) > 10
    assert _canonical(short) == _canonical(whole)
    assert short.param_names == whole.param_names and short.outputs == whole.outputs
    # inputs listed in the program's argument order, as a whole trace lists them
    assert list(short.inputs) == [n.name for n in short.gm.graph.nodes if n.op == "placeholder"]
    if not dropout:
        torch.testing.assert_close(_loss(short, model, args), model(*args), rtol=0, atol=0)


def test_a_stack_whose_blocks_differ_is_traced_whole(monkeypatch):
    model = GPT(vocab=64, seq=16, hidden=32, heads=4, layers=5)
    model.blocks[4].ln2.eps = 1e-3          # the last block computes with another constant
    args = gpt_inputs(batch=2, seq=16, vocab=64)
    assert _canonical(capture(model, args)) == _canonical(_whole(model, args, monkeypatch))


class _Indexed(torch.nn.Module):
    """A block that branches on its own index, past block 2 only."""

    def __init__(self, index: int):
        super().__init__()
        self.index, self.lin = index, torch.nn.Linear(8, 8)

    def forward(self, x):
        x = self.lin(x)
        return x * 2 if self.index >= 4 else x


class _IndexedStack(torch.nn.Module):
    def __init__(self, depth: int = 6):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Indexed(i) for i in range(depth))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.sum()


def test_blocks_that_branch_on_their_index_deep_in_the_stack_are_traced_whole(monkeypatch):
    """The deepest block is traced (in block 2's place): a branch taken by late blocks only shows."""
    torch.manual_seed(0)
    model, args = _IndexedStack(), (torch.randn(4, 8),)
    short = capture(model, args)
    assert _canonical(short) == _canonical(_whole(model, args, monkeypatch))
    torch.testing.assert_close(_loss(short, model, args), model(*args), rtol=0, atol=0)


class _Middle(torch.nn.Module):
    """A block whose code branches on its index for one middle block, which the short trace never traces."""

    def __init__(self, index: int):
        super().__init__()
        self.index, self.lin = index, torch.nn.Linear(8, 8)

    def forward(self, x):
        x = torch.tanh(self.lin(x))
        return x * 2 if self.index == 3 else x


class _MiddleStack(torch.nn.Module):
    def __init__(self, depth: int = 6):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Middle(i) for i in range(depth))

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return torch.nn.functional.mse_loss(x, y)


def _middle():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return _MiddleStack(), (torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g))


def test_a_block_that_reads_its_index_is_traced_whole_and_the_plan_says_so(monkeypatch):
    model, args = _middle()
    short = capture(model, args)
    assert short.trace.startswith("whole: all 6 blocks of blocks traced") and "_Middle.index" in short.trace
    assert _canonical(short) == _canonical(_whole(model, args, monkeypatch))
    torch.testing.assert_close(_loss(short, model, args), model(*args), rtol=0, atol=0)
    alike = GPT(vocab=64, seq=16, hidden=32, heads=4, layers=5)
    assert capture(alike, gpt_inputs(batch=2, seq=16, vocab=64)).trace.startswith("short: blocks, 5 blocks proven")


class _Kind(torch.nn.Module):
    """A block of one of two kinds (Gemma-2's sliding-window and global layers): its own constant
    differs by kind, and the model's loop hands it an input picked by its position."""

    def __init__(self, index: int):
        super().__init__()
        self.index, self.kind, self.lin = index, ("local", "global")[index % 2], torch.nn.Linear(8, 8)
        self.scale = 0.5 if self.kind == "local" else 2.0

    def forward(self, x, bias):
        return torch.tanh(self.lin(x) * self.scale + bias)


class _Alternating(torch.nn.Module):
    def __init__(self, depth: int = 8):
        super().__init__()
        self.kinds = [("local", "global")[i % 2] for i in range(depth)]
        self.blocks = torch.nn.ModuleList(_Kind(i) for i in range(depth))

    def forward(self, x):
        bias = {"local": x.mean(0), "global": x.amax(0)}
        for i, b in enumerate(self.blocks):
            x = b(x, bias[self.kinds[i]])
        return x.sum()


def test_a_stack_of_alternating_blocks_is_traced_one_period_deep_per_check(monkeypatch):
    """Blocks alike every 2 (not every 1): the first two periods and the last are traced, the rest
    copied by kind; the graph is a whole trace's, the loss exact."""
    torch.manual_seed(0)
    model, args = _Alternating(), (torch.randn(4, 8),)
    short = capture(model, args)
    assert short.trace == "short: blocks, 8 blocks proven alike every 2 blocks, 6 traced and the rest copied"
    assert _canonical(short) == _canonical(_whole(model, args, monkeypatch))
    torch.testing.assert_close(_loss(short, model, args), model(*args), rtol=0, atol=0)
    odd = _Alternating(depth=9)          # a period that does not divide the stack: traced whole
    assert capture(odd, args).trace == ""


def _train_middle(rank, world_size):
    import copy

    import autopar
    from dist_checks import LAYOUTS_ONLY, rel, shard_happy_profile
    model, args = _middle()
    ref = copy.deepcopy(model)
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device=shard_happy_profile())
    dmodel = autopar.autoparallelize(model, mesh, args, symbolic=False, **LAYOUTS_ONLY)
    opt, ref_opt = torch.optim.SGD(dmodel.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    gaps = []
    for _ in range(2):
        loss, ref_loss = dmodel(*args), ref(*args)
        loss.backward(), ref_loss.backward()
        gaps.append(rel(loss.detach(), ref_loss.detach()))
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    mine = dict(dmodel.named_parameters())
    gaps += [rel(mine[k].detach().full_tensor(), p.detach()) for k, p in ref.named_parameters()]
    return max(gaps), dmodel.plan.report()


def test_a_model_with_a_different_middle_layer_plans_and_trains_exactly(rank_pool):
    for gap, report in rank_pool(4).run(_train_middle):
        assert gap < 1e-5
        assert "capture: whole: all 6 blocks of blocks traced" in report
