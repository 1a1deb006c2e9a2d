"""Vocab parallelism (issue 13): the embedding and the cross-entropy split over the vocabulary.

* On 4 CPU ranks, a GPT (tied embedding and head) with its embedding, head and loss pinned to the
  vocab-parallel layouts (the table split on rows, the head column-parallel, the loss on logits split
  on the classes) trains 2 AdamW steps like one process (loss, gradients, parameters within 1e-4);
  the plan never gathers the logits and labels those nodes "vocab_parallel". Also on a (dp, tp) mesh,
  for a Hugging Face Llama (its loss ignores the last position), for a GPT whose loss is
  log_softmax + nll_loss (on the flattened logits, and on the 3-D logits: the classes are dim 2
  there), and with the vocabulary split over two axes.
* The planner chooses them by itself where the logits are large: a wide-vocabulary model on a tp axis.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import autopar  # noqa: E402
from dist_checks import LAYOUTS_ONLY, build_any, shard_happy_profile, train_and_compare  # noqa: E402
from models import GPT, gpt_inputs  # noqa: E402

TOL = 1e-4
VOCAB = "vocab_parallel"
# per model: its head's linear (-> logits) and the view that flattens the logits for the loss
LOGITS = {"gpt": ("linear_8", "view_8"), "gpt-nll": ("linear_4", "view_4", "log_softmax"),
          "gpt-nll3d": ("linear_4", "view_4", "log_softmax"), "zoo:llama": ("linear_14", "view_6")}
# per model: its loss's nodes and the label of their batch split (others: cross_entropy_loss, "batch")
LOSS = {"gpt-nll": {"log_softmax": "split", "nll_loss*": "batch"},
        "gpt-nll3d": {"log_softmax": "split", "nll_loss*": "batch"}}


def vocab_pins(name: str, axis_names: tuple) -> dict:
    """Vocab-parallel pins on the mesh axes named tp*; "batch" (or the batch split) on the others."""
    def per_axis(on_tp: str, other: str) -> tuple:
        return tuple(on_tp if ax.startswith("tp") else other for ax in axis_names)
    head, flat = LOGITS[name][:2]
    return {"embedding": per_axis(VOCAB, "batch"), head: per_axis("column", "batch"), flat: per_axis("S(1)", "S(0)"),
            **{op: per_axis(VOCAB, batch) for op, batch in LOSS.get(name, {"cross_entropy_loss*": "batch"}).items()}}


def _plan(mesh_shape, axis_names, pins, name):
    model, args, kwargs, _ = build_any(name)
    mesh = autopar.Mesh(mesh_shape, axis_names, device=shard_happy_profile())
    return autopar.plan(model, args, mesh, example_kwargs=kwargs, pins=pins, symbolic=False, **LAYOUTS_ONLY)


def _gathers_logits(plan, logits) -> list[str]:
    """Gathers of the logits on their way to the loss (a model that returns its logits gets them
    whole at the output: that is asked for)."""
    return [f"{n.name}: {c.kind} of {c.tensor}" for n in plan.nodes for c in n.collectives
            if c.tensor in logits and n.name != "output" and c.kind.startswith("all_gather") and c.phase == "forward"]


# the vocabulary split 4 ways on one axis: the Llama's case; the GPT's tied table and head split 4 ways
# over two axes, and 2 ways beside dp
CASES = [("gpt", (2, 2), ("dp", "tp")), ("zoo:llama", (4,), ("tp",)),
         ("gpt-nll", (2, 2), ("dp", "tp")), ("gpt-nll3d", (2, 2), ("dp", "tp")), ("gpt", (2, 2), ("tp0", "tp1"))]


@pytest.mark.parametrize("name,mesh_shape,axis_names", CASES,
                         ids=["gpt-dp2xtp2", "llama-tp4", "nll-dp2xtp2", "nll-3d-logits-dp2xtp2",
                              "gpt-vocab-over-2-axes"])
def test_vocab_parallel_trains_like_one_process(rank_pool, name, mesh_shape, axis_names):
    pins = vocab_pins(name, axis_names)
    plan = _plan(mesh_shape, axis_names, pins, name)
    by_name = {n.name: n for n in plan.nodes}
    assert all(p == "S(0)" for p, ax in zip(by_name["embedding"].inputs[0], axis_names) if ax.startswith("tp"))
    losses = [n for n in plan.nodes if n.op in ("aten.cross_entropy_loss", "aten.log_softmax", "aten.nll_loss_nd")]
    assert VOCAB in by_name["embedding"].labels and all(VOCAB in n.labels for n in losses), losses
    assert _gathers_logits(plan, LOGITS[name]) == []
    results = rank_pool(4).run(train_and_compare, name, mesh_shape, axis_names, pins, timeout=300)
    r = results[0]
    for key in ("loss", "grad", "param"):
        assert max(x[key] for x in results) < TOL, (key, {k: r[k] for k in ("loss", "grad", "param")})
    assert VOCAB in r["labels"] and r["fallbacks"] == []


def test_planner_chooses_the_vocab_parallel_loss_after_a_column_parallel_head():
    """With the head column-parallel on "tp" (its logits split on the vocabulary), the planner takes
    the loss on the split logits rather than moving them (gathering, or an all-to-all to rows)."""
    model = GPT(vocab=8192, seq=64, hidden=64, heads=4, layers=1)
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="h100")
    plan = autopar.plan(model, gpt_inputs(batch=8, seq=64, vocab=8192), mesh, batch_axes=("dp",),
                        pins={"linear_4": ("batch", "column")}, symbolic=False, recompute="none",
                        offload="none", residency="keep")
    loss = next(n for n in plan.nodes if n.op == "aten.cross_entropy_loss")
    assert loss.labels == ("batch", VOCAB), loss
    logits = LOGITS["gpt"]
    assert _gathers_logits(plan, logits) == []
    assert not any(c.tensor in logits for c in loss.collectives), loss.collectives


def test_vocab_parallel_loss_prices_its_all_reduces_and_splits_the_logits_memory():
    """The vocab-parallel loss's two all-reduces (rows x 4 bytes, then rows x 8: the maximum, then the
    sum-exp and the target logit) are priced by the cost model and listed on the node; the plan holds
    a tp-th of the logits, so it needs less memory than the one that gathers them for the loss."""
    from autopar.cost_model.comm import row_reduce_times
    from autopar.strategies.vocab import ROW_STATISTICS
    model = GPT(vocab=8192, seq=64, hidden=64, heads=4, layers=1)
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="h100")
    plans = {}
    for loss in ("vocab_parallel", "replicate"):
        pins = {"linear_4": ("batch", "column"), "cross_entropy_loss*": ("batch", loss)}
        plans[loss] = autopar.plan(model, gpt_inputs(batch=8, seq=64, vocab=8192), mesh, batch_axes=("dp",),
                                   pins=pins, symbolic=False, **LAYOUTS_ONLY)
    node = next(n for n in plans["vocab_parallel"].nodes if n.op == "aten.cross_entropy_loss")
    rows = 8 * 64 // 2                                    # the batch is split over dp
    inside = [c for c in node.collectives if c.tensor == node.name]
    want = row_reduce_times(ROW_STATISTICS["aten.cross_entropy_loss"], rows, 2, mesh.links[1],
                            mesh.profile.kernel_overhead + mesh.profile.collective_overhead)[0]
    assert [(c.kind, c.phase) for c in inside] == [("all_reduce@tp", "forward")]
    assert inside[0].seconds == pytest.approx(want)
    logits_b = 8 * 64 * 8192 * 4 / 2                      # fp32 logits on a dp rank
    saved = plans["replicate"].estimate.peak_memory_bytes - plans["vocab_parallel"].estimate.peak_memory_bytes
    assert saved >= logits_b / 2, (saved, logits_b)


@pytest.mark.parametrize("padding_idx", [None, 5, 12])
def test_vocab_embedding_slices_sum_to_the_lookup(padding_idx):
    """Each device's masked lookup in its rows of the table sums to the whole lookup, and its table
    gradient is its rows' slice of the whole gradient (a padding row, wherever it lives, gets none)."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Replicate, Shard

    from autopar.runtime.vocab import vocab_embedding
    torch.manual_seed(0)
    table = torch.randn(16, 4, requires_grad=True)
    ids = torch.randint(0, 16, (3, 7))
    pad = () if padding_idx is None else (padding_idx,)
    whole = torch.ops.aten.embedding.default(table, ids, *pad)
    whole.pow(2).sum().backward()
    n, outs, grads = 2, [], []
    for r in range(n):
        shard = table.detach()[r * 8:(r + 1) * 8].clone().requires_grad_()
        op = SimpleNamespace(target=torch.ops.aten.embedding.default, inputs=((Shard(0),), (Replicate(),)),
                             mesh=SimpleNamespace(get_coordinate=lambda r=r: [r], shape=(n,)))
        out = vocab_embedding(op, (shard, ids, *pad), {})
        out.backward(2 * whole.detach())            # d/dout of the whole loss
        outs.append(out.detach())
        grads.append(shard.grad)
    assert torch.allclose(sum(outs), whole.detach())
    assert torch.allclose(torch.cat(grads), table.grad)
