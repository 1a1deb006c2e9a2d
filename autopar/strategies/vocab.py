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

The head between them is a column-parallel linear (output S(-1)), which the matmul rule already
offers: with both options the logits stay split from the head to the loss. Both run in
`runtime/vocab.py`. The loss's two all-reduces (a float per row, then two) are priced with the op
(`solver.problem.op_cost`, `cost_model.comm.vocab_loss_reduce_times`); the embedding moves nothing
the edges do not show (its partial sum is all-reduced, or reduce-scattered, on the way out).
Several axes may split the vocabulary; a device's rows are then block `mixed radix of its
coordinates on those axes, in mesh order` (as DTensor chunks a dim).
"""
from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard

from .registry import AxisOption

VOCAB_PARALLEL = "vocab_parallel"
VOCAB_LOSS_OP = "aten.cross_entropy_loss"     # the loss with a vocab-split option (its collectives are priced)
CLASS_DIM = 1          # of cross-entropy's input (N, C, d1, ...)
R = Replicate()


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


def vocab_axes(layout: Sequence, dim: int) -> list[int]:
    """The mesh axes on which `layout` splits tensor dim `dim` (the vocabulary), in mesh order."""
    return [a for a, p in enumerate(layout) if isinstance(p, Shard) and p.dim == dim]
