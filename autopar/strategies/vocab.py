"""Vocab parallelism: the embedding table and the loss split over the vocabulary (Megatron-LM).

A language model's largest tensors are its vocabulary-wide ones: the embedding table [V, H], the
head's weight (often the same, tied) and the logits [tokens, V]. Split over the vocabulary on one
mesh axis of n devices, none of them is ever whole on a device:

    embedding       weight S(0), ids R                -> P      each device looks up the ids in its
                                                                 rows (others give zero rows): the
                                                                 outputs are a partial sum
    cross-entropy   logits S(1), target R [, R...]    -> R      (logits [N, V]; dim 1 is the class
                                                                 dim) max, then sum-exp and the target
                                                                 logit (from the device that holds it)
                                                                 all-reduced over the axis; each device
                                                                 has every row's loss
    log_softmax     x S(d)                            -> S(d)   (over dim d) max and sum-exp all-reduced;
                                                                 its backward all-reduces sum(dy)
    nll_loss        log-probs S(1), target R          -> P      each device picks the targets in its
                                                                 slice (sum or none reductions)

The head between them is a column-parallel linear (output S(-1)), which the matmul rule already
offers: with these options the logits stay split from the head to the loss, whether the model calls
cross_entropy or log_softmax and nll_loss. All run in `runtime/vocab.py`. The all-reduces (a few
floats per row: `ROW_STATISTICS`) are the ops' facts (`row_reductions`, `inner.RowReductions`), priced
with the op (`cost_model/inner.py`, `cost_model.comm.row_reduce_times`);
the embedding and nll_loss move nothing the edges do not show (their partial sums are reduced on the
way out). Several axes may split the vocabulary; a device's slice is then block `mixed radix of its
coordinates on those axes, in mesh order` (as DTensor chunks a dim).
"""
from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard

from .inner import RowReductions
from .registry import AxisOption, op_name
from .strategy import shard_count

VOCAB_PARALLEL = "vocab_parallel"
CLASS_DIM = 1          # of cross-entropy's input (N, C, d1, ...)
LOG_SOFTMAX_OPS = ("aten.log_softmax", "aten._log_softmax")
R = Replicate()
# Per row on the device, the bytes of each all-reduce a vocab-split op runs inside itself (fp32
# statistics: runtime/vocab.py), (forward, backward): cross-entropy all-reduces the maximum, then the
# sum-exp and the target logit in one buffer, and nothing in its backward; log_softmax the maximum,
# then the sum-exp, and in its backward sum(dy).
ROW_STATISTICS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "aten.cross_entropy_loss": ((4, 8), ()),
    "aten.log_softmax": ((4, 4), (4,)), "aten._log_softmax": ((4, 4), (4,))}


def _arg(node, index: int, name: str, default):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def embedding_option(node) -> list[AxisOption]:
    """The vocab-split lookup, where its backward stays exact on a slice of the table: not with
    `scale_grad_by_freq` (counts over all ids) or a sparse gradient."""
    if _arg(node, 3, "scale_grad_by_freq", False) or _arg(node, 4, "sparse", False):
        return []
    return [AxisOption((Shard(0), R), Partial(), VOCAB_PARALLEL)]


def cross_entropy_option(node, ins) -> list[AxisOption]:
    """The vocab-split loss of `aten.cross_entropy_loss(logits, target, weight, reduction, ignore_index,
    label_smoothing)` with class indices as targets, no class weights and no label smoothing."""
    logits, target = ins[0], ins[1]
    if (logits.ndim < 2 or target.dtype.is_floating_point or _arg(node, 2, "weight", None) is not None
            or _arg(node, 5, "label_smoothing", 0.0)):
        return []
    return [AxisOption((Shard(CLASS_DIM),) + (R,) * (len(ins) - 1), R, VOCAB_PARALLEL)]


def log_softmax_option(node, ins) -> list[AxisOption]:
    """The vocab-split log_softmax over its `dim`."""
    x = ins[0]
    if x.ndim < 2:
        return []
    return [AxisOption((Shard(node.args[1] % x.ndim),), Shard(node.args[1] % x.ndim), VOCAB_PARALLEL)]


def nll_loss_option(node, ins) -> list[AxisOption]:
    """The vocab-split `aten.nll_loss(log_probs, target, weight, reduction, ignore_index)`, without class
    weights and with reduction none or sum (a mean is lowered to sum / count: passes/lowering.py)."""
    if ins[0].ndim < 2 or _arg(node, 2, "weight", None) is not None or _arg(node, 3, "reduction", 1) == 1:
        return []
    return [AxisOption((Shard(CLASS_DIM),) + (R,) * (len(ins) - 1), Partial(), VOCAB_PARALLEL)]


def op_class_dim(target, args, ndim: int) -> int:
    """The vocabulary's dim of the first input of op `target` called with `args`: a log_softmax's
    `dim`, a loss's class dim (a rank graph's op runs the captured one's target)."""
    return args[1] % ndim if op_name(target) in LOG_SOFTMAX_OPS else CLASS_DIM


def vocab_axes(layout: Sequence, dim: int) -> list[int]:
    """The mesh axes on which `layout` splits tensor dim `dim` (the vocabulary), in mesh order."""
    return [a for a, p in enumerate(layout) if isinstance(p, Shard) and p.dim == dim]


def row_reductions(node, s, ins, outs, mesh_shape) -> tuple[RowReductions, ...]:
    """The `inner` hook of the softmax and loss rules: one `RowReductions` per mesh axis over which an
    op that all-reduces inside itself when vocab-split (`ROW_STATISTICS`) splits its vocabulary under
    strategy s (none for any other op or strategy). Rows: the elements of its input on one device per
    vocabulary entry."""
    op = op_name(node.target)
    if op not in ROW_STATISTICS:
        return ()
    x, dim = ins[0], op_class_dim(node.target, node.args, ins[0].ndim)
    axes = vocab_axes(s.inputs[0], dim)
    split = 1
    for a in axes:
        split *= mesh_shape[a]
    rows = x.nbytes / x.dtype.itemsize / shard_count(s.inputs[0], mesh_shape) / (x.shape[dim] / split)
    return tuple(RowReductions(a, mesh_shape[a], rows, ROW_STATISTICS[op]) for a in axes)
