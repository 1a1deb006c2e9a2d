"""Vocab parallelism at run time: the embedding lookup and the cross-entropy loss on a slice of
the vocabulary (`strategies/vocab.py` states the layouts).

* Embedding: this device holds rows [start, start + rows) of the table. Ids outside them look up
  row 0 and their output rows are zeroed, so the outputs of the devices sum to the whole lookup
  (the `P` the strategy states); autograd sends the masked rows no gradient, so each device's
  table gradient is exactly its rows' slice.
* Cross-entropy (Megatron-LM's vocab-parallel loss): per row, the logits' maximum is all-reduced
  (max), then the sum of exp(x - max) over the local classes and the target's logit (taken by the
  device whose slice holds the target, zero elsewhere) are all-reduced together (sum), in fp32. The
  loss of a row is log(sum) - (target logit - max); the backward needs no communication:
  d logits = (softmax - one_hot(target)) * d loss on the local classes, softmax recomputed from the
  saved max and log-sum. Rows whose target is `ignore_index` get loss 0 and no gradient.
* log_softmax over a split dim: the maximum and the sum of exp(x - max) all-reduced as above, in
  fp32; its backward d x = dy - exp(y) sum(dy) all-reduces sum(dy) (a float per row).
* nll_loss on log-probabilities split on the classes: each device picks the targets in its slice
  (the others, and `ignore_index` rows, are ignored: target -1 with ignore_index -1), so the
  devices' sums are a partial sum of the loss; its gradient stays on the owner's slice.

Why our own code: DTensor has both. Its embedding's `MaskPartial` keeps the mask for the reduction
instead of zeroing the rows, so the local result is not the plain partial sum our reshards (all-reduce,
reduce-scatter to a sequence split) take. `torch.distributed.tensor.parallel.loss_parallel` needs the
backward to run inside its context manager, which installs process-wide op handlers: the backward of a
planned module runs when the user calls `loss.backward()`, outside any context we could hold. Its
building blocks on local tensors are private functions.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..compat import funcol, tracing
from ..placement import block_index
from ..strategies.vocab import CLASS_DIM, op_class_dim, vocab_axes

_STATS_DTYPE = torch.float32      # the max and sums are kept in fp32 whatever the logits' dtype


def splits_vocab(op, node) -> bool:
    """Does the LocalOp `op` of vocab op `node` (a rank-graph node: embedding, a loss, log_softmax) run
    on a slice of the vocabulary? If not, it is the plain op on local shards."""
    dim = (0 if op.target is torch.ops.aten.embedding.default
           else op_class_dim(op.target, node.args, node.meta["val"].ndim))
    return bool(vocab_axes(op.inputs[0], dim))


def _groups(op, dim: int) -> tuple:
    """The process groups of the mesh axes that split input 0's dim `dim`."""
    return tuple(op.mesh.get_group(a) for a in vocab_axes(op.inputs[0], dim))


def _all_reduce(t: torch.Tensor, reduce_op, groups: tuple) -> torch.Tensor:
    """t reduced over every group (the axes that split the vocabulary): in place, or, traced (the
    compile backend), by the functional all-reduce (c10d's in-place one does not trace)."""
    for g in groups:
        if tracing():
            t = funcol.all_reduce(t, "max" if reduce_op == dist.ReduceOp.MAX else "sum", g)
        else:
            dist.all_reduce(t, reduce_op, group=g)
    return t


def _start(op, dim: int, rows: int) -> int:
    """The first index of this device's slice of tensor dim `dim` (`rows` long) under input 0's layout."""
    return block_index(op.inputs[0], dim, op.mesh.get_coordinate(), op.mesh.shape) * rows


def _masked_ids(ids: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids shifted into the local slice with outsiders on 0, the mask of the outsiders)."""
    outside = (ids < start) | (ids >= start + rows)
    return (ids - start).masked_fill(outside, 0), outside


def vocab_embedding(op, args, kwargs):
    """`aten.embedding(weight, ids, padding_idx, ...)` for the LocalOp `op` (arguments already local)."""
    if not vocab_axes(op.inputs[0], 0):
        return op.target(*args, **kwargs)
    weight, ids = args[:2]
    given = dict(zip(("padding_idx", "scale_grad_by_freq", "sparse"), args[2:]), **kwargs)
    rows = weight.shape[0]
    start = _start(op, 0, rows)
    local, outside = _masked_ids(ids, start, rows)
    pad = given.get("padding_idx", -1)     # a row that gets no gradient: on the device holding it
    given["padding_idx"] = pad - start if 0 <= pad and start <= pad < start + rows else -1
    return op.target(weight, local, **given).masked_fill(outside.unsqueeze(-1), 0)


class _VocabParallelLoss(torch.autograd.Function):
    """Per-row cross-entropy of logits split on the class dim (module docstring)."""

    @staticmethod
    def forward(ctx, x, target, start: int, groups: tuple, ignore_index: int):  # type: ignore[override]
        xf = x.to(_STATS_DTYPE)
        top = _all_reduce(xf.amax(CLASS_DIM, keepdim=True), dist.ReduceOp.MAX, groups)
        local, outside = _masked_ids(target, start, x.shape[CLASS_DIM])
        shifted = xf - top
        picked = shifted.gather(CLASS_DIM, local.unsqueeze(CLASS_DIM)).squeeze(CLASS_DIM).masked_fill(outside, 0)
        sums = _all_reduce(torch.stack([shifted.exp().sum(CLASS_DIM), picked]), dist.ReduceOp.SUM, groups)
        logsum = sums[0].log()
        keep = target != ignore_index
        ctx.save_for_backward(x, top + logsum.unsqueeze(CLASS_DIM), local, outside, keep)
        return (logsum - sums[1]).masked_fill(~keep, 0)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, lse, local, outside, keep = ctx.saved_tensors
        dx = (x.to(_STATS_DTYPE) - lse).exp()
        dx.scatter_add_(CLASS_DIM, local.unsqueeze(CLASS_DIM), -(~outside).to(dx.dtype).unsqueeze(CLASS_DIM))
        dx.mul_((grad * keep).unsqueeze(CLASS_DIM))
        return dx.to(x.dtype), None, None, None, None


def vocab_cross_entropy(op, args, kwargs):
    """`aten.cross_entropy_loss(logits, target, weight, reduction, ignore_index, label_smoothing)` for
    the LocalOp `op` (arguments already local; the strategy admits no weight and no smoothing)."""
    if not vocab_axes(op.inputs[0], CLASS_DIM):
        return op.target(*args, **kwargs)
    given = dict(zip(("weight", "reduction", "ignore_index"), args[2:]), **kwargs)
    logits, target = args[0], args[1]
    start = _start(op, CLASS_DIM, logits.shape[CLASS_DIM])
    ignore = given.get("ignore_index", -100)
    loss = _VocabParallelLoss.apply(logits, target, start, _groups(op, CLASS_DIM), ignore)
    reduction = given.get("reduction", 1)        # at::Reduction: 0 none, 1 mean, 2 sum
    if reduction == 0:
        return loss.to(logits.dtype)
    total = loss.sum()
    if reduction == 1:
        total = total / (target != ignore).sum()
    return total.to(logits.dtype)


class _VocabParallelLogSoftmax(torch.autograd.Function):
    """log_softmax over a dim split over the devices of `groups` (module docstring)."""

    @staticmethod
    def forward(ctx, x, dim: int, groups: tuple, dtype):  # type: ignore[override]
        xf = x.to(_STATS_DTYPE)
        shifted = xf - _all_reduce(xf.amax(dim, keepdim=True), dist.ReduceOp.MAX, groups)
        y = shifted - _all_reduce(shifted.exp().sum(dim, keepdim=True), dist.ReduceOp.SUM, groups).log()
        y = y.to(dtype)
        ctx.dim, ctx.groups, ctx.in_dtype = dim, groups, x.dtype
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        (y,) = ctx.saved_tensors
        g = dy.to(_STATS_DTYPE)
        total = _all_reduce(g.sum(ctx.dim, keepdim=True), dist.ReduceOp.SUM, ctx.groups)
        return (g - y.to(_STATS_DTYPE).exp() * total).to(ctx.in_dtype), None, None, None


def vocab_log_softmax(op, args, kwargs):
    """`aten.log_softmax(x, dim, dtype)` / `aten._log_softmax(x, dim, half_to_float)` for the LocalOp
    `op` (arguments already local)."""
    x, dim = args[0], args[1] % args[0].ndim
    if not vocab_axes(op.inputs[0], dim):
        return op.target(*args, **kwargs)
    third = args[2] if len(args) > 2 else kwargs.get("dtype", kwargs.get("half_to_float"))
    dtype = (torch.float32 if third else x.dtype) if isinstance(third, bool) else (third or x.dtype)
    return _VocabParallelLogSoftmax.apply(x, dim, _groups(op, dim), dtype)


def vocab_nll_loss(op, args, kwargs):
    """`aten.nll_loss(log_probs, target, weight, reduction, ignore_index)` for the LocalOp `op`
    (arguments already local; the strategy admits no weight and no mean reduction)."""
    if not vocab_axes(op.inputs[0], CLASS_DIM):
        return op.target(*args, **kwargs)
    given = dict(zip(("weight", "reduction", "ignore_index"), args[2:]), **kwargs)
    logp, target = args[0], args[1]
    start = _start(op, CLASS_DIM, logp.shape[CLASS_DIM])
    local, outside = _masked_ids(target, start, logp.shape[CLASS_DIM])
    local = local.masked_fill(outside | (target == given.get("ignore_index", -100)), -1)
    return op.target(logp, local, None, given.get("reduction", 1), -1)
