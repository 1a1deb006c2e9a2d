"""Every rule option is exact: run each op of the zoo's graphs on simulated shards and compare.

For every node of every small zoo model (examples/zoo.py), with the values it really sees in a
forward, and for every option its rule gives along one mesh axis of 2 devices: cut the inputs
as the option says (S(d): halves of dim d; R: whole; P: two random terms that sum to the
value), run the op on each device's pieces as the runtime would (view shapes made local; MoE
told its experts), and put the outputs back together as the option claims (S(d): concatenate;
R: both equal; P: sum; P(avg): mean). The result must be the op's output on whole tensors.
Options a rule admits only in combination with other axes (`OpRule.admits`) are checked where
they are used, context-parallel attention, which has its own executor, in test_context_parallel.py,
and the vocab-parallel embedding and loss in test_vocab_parallel.py. docs/models.md is what the
rule registry generates from the same graphs.
"""
from __future__ import annotations

import operator
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import Partial, Shard

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from autopar.passes.capture import flatten_inputs  # noqa: E402
from autopar.passes.shape_prop import tensor_inputs, tensor_meta  # noqa: E402
from autopar.placement import local_shape  # noqa: E402
from autopar.runtime.ops import _SHAPE_ARG  # noqa: E402
from autopar.strategies import rule_for  # noqa: E402
from autopar.strategies.attention import CONTEXT_LABELS  # noqa: E402
from autopar.strategies.moe import EXPERT_PARALLEL, EXPERT_TP  # noqa: E402
from autopar.strategies.strategy import axis_options, fits  # noqa: E402
from autopar.strategies.vocab import VOCAB_PARALLEL  # noqa: E402
from zoo import MODELS  # noqa: E402

N = 2   # devices on the simulated mesh axis
MOE = torch.ops.autopar.moe_experts.default


def _recorded_values(cap, model, args, kwargs) -> dict[str, object]:
    """The value of every node in one forward on the example inputs."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    leaves = flatten_inputs(args, kwargs)
    feeds = []
    for name, slot in cap.inputs.items():
        feeds.append({"param": lambda t: params[t], "buffer": lambda t: buffers[t],
                      "constant": lambda t: cap.constants[t], "input": lambda t: leaves[t]}[slot.kind](slot.target))
    env: dict[str, object] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            env[n.name] = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
            return out

    with torch.no_grad():
        Recorder(cap.gm).run(*feeds)
    return env


def _pieces(value: torch.Tensor, p, gen) -> list[torch.Tensor] | None:
    if isinstance(p, Shard):
        if value.ndim <= p.dim or value.shape[p.dim] % N:
            return None
        return list(value.chunk(N, p.dim))
    if isinstance(p, Partial):
        if not value.is_floating_point():
            return None
        ordinary = value.abs()[value.abs() < 1e30]        # not the -3.4e38 of a "-inf" mask
        scale = max(ordinary.max().item() if ordinary.numel() else 0.0, 1e-6)
        noise = torch.randn(value.shape, generator=gen, dtype=value.dtype) * scale
        return [value - noise, noise]
    return [value] * N


def _combine(outs: list, p):
    if not isinstance(outs[0], torch.Tensor):
        return outs[0]
    if isinstance(p, Shard):
        return torch.cat(outs, p.dim)
    if isinstance(p, Partial):
        total = sum(outs[1:], outs[0].double() if outs[0].is_floating_point() else outs[0])
        return (total / N if p.reduce_op == "avg" else total).to(outs[0].dtype)
    for o in outs[1:]:
        assert torch.equal(o, outs[0]), "a replicated output differs between devices"
    return outs[0]


def _close(a, b) -> bool:
    if not isinstance(a, torch.Tensor):
        return a == b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    scale = b.abs().max().item() if b.numel() else 0.0
    return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-5 * max(scale, 1e-6), equal_nan=True))


def check_node(node: fx.Node, env: dict[str, object], gen) -> list[str]:
    """The options of node's rule that are not exact (empty: all exact)."""
    rule = rule_for(node.target)
    ins_nodes = tensor_inputs(node)
    ins = [tensor_meta(a.meta["val"])[0] for a in ins_nodes]
    outs = tensor_meta(node.meta.get("val"))
    if rule is None or not ins or not outs or node.target is operator.getitem:
        return []
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    whole = node.target(*pytree.tree_unflatten([env[a.name] if isinstance(a, fx.Node) else a for a in leaves],
                                                spec)[0], **pytree.tree_unflatten(
        [env[a.name] if isinstance(a, fx.Node) else a for a in leaves], spec)[1])
    bad = []
    for opt in axis_options(rule, node, ins, outs):
        inside = ("replicate", EXPERT_PARALLEL, EXPERT_TP, VOCAB_PARALLEL)
        if opt.label in inside or opt.label in CONTEXT_LABELS or (
                rule.admits is not None and not rule.admits((opt.label,), tuple((p,) for p in opt.inputs),
                                                            (opt.output,), ins, outs, (N,), fits)):
            continue      # these move data inside the op or mask it to a slice: their own test files
        pieces, k = [], 0
        for a in leaves:
            if isinstance(a, fx.Node) and a in ins_nodes:
                pieces.append(_pieces(env[a.name], opt.inputs[ins_nodes.index(a)], gen))
                k += 1
            else:
                pieces.append(None)
        if any(p is None for a, p in zip(leaves, pieces) if isinstance(a, fx.Node) and a in ins_nodes):
            continue          # this option does not fit these shapes (the planner drops it too)
        if any(isinstance(opt.output, Shard) and m.shape[opt.output.dim] % N for m in outs):
            continue
        results = []
        for r in range(N):
            local = [p[r] if p is not None else (env[a.name] if isinstance(a, fx.Node) else a)
                     for a, p in zip(leaves, pieces)]
            args, kwargs = pytree.tree_unflatten(local, spec)
            args = list(args)
            if node.target in _SHAPE_ARG:
                args[_SHAPE_ARG[node.target]] = list(local_shape(outs[0].shape, (opt.output,), (N,)))
            if node.target is MOE and isinstance(opt.inputs[3], Shard):
                args[6] = r * args[3].shape[0]
            results.append(node.target(*args, **kwargs))
        flat = [pytree.tree_leaves(res) for res in results]
        combined = [_combine([f[i] for f in flat], opt.output) for i in range(len(flat[0]))]
        if not all(_close(c, w) for c, w in zip(combined, pytree.tree_leaves(whole))):
            bad.append(f"{node.name} ({node.target}) option {opt}")
    return bad


@pytest.mark.parametrize("name", MODELS)
def test_every_rule_option_is_exact(zoo_small, name):
    model, args, kwargs, cap = zoo_small[name]
    env = _recorded_values(cap, model, args, kwargs)
    gen = torch.Generator().manual_seed(0)
    bad, checked = [], 0
    for node in cap.gm.graph.nodes:
        if node.op == "call_function":
            bad += check_node(node, env, gen)
            checked += 1
    assert checked > 0 and not bad, "\n".join(bad)


def test_docs_models_md_is_generated(zoo_small):
    """docs/models.md is what the rule registry generates from the zoo's graphs."""
    from autopar.strategies.doc import render
    path = Path(__file__).resolve().parents[1] / "docs" / "models.md"
    captured = [(name, type(model).__name__, cap) for name, (model, _, _, cap) in zoo_small.items()]
    assert path.read_text() == render(captured), \
        "docs/models.md is stale: run `python -m autopar.strategies.doc > docs/models.md`"
