"""Neural-network ops: normalisation, softmax, embedding, losses, reductions, factories (attention: attention.py)."""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from .pointwise import broadcast_options
from .registry import AxisOption, register
from .vocab import cross_entropy_option, embedding_option, log_softmax_option, nll_loss_option, row_reductions

aten = torch.ops.aten
R, P = Replicate(), Partial()


@register(aten.layer_norm, aten.rms_norm, family="norm")
def norm_rule(node, ins, outs):
    """Normalised over the trailing `normalized_shape` dims: any leading dim may be split."""
    x = ins[0]
    n_norm = len(node.args[1])
    rest = (R,) * (len(ins) - 1)          # weight and bias stay whole; their grads are partial sums
    return [AxisOption((Shard(d),) + rest, Shard(d), "split") for d in range(x.ndim - n_norm)]


@register(aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax, family="softmax", inner=row_reductions)
def softmax_rule(node, ins, outs):
    """Normalised over `dim`: split any other dim, or (log_softmax) that one (`vocab.py`)."""
    x = ins[0]
    dim = node.args[1] % x.ndim
    vocab = log_softmax_option(node, ins) if node.target.overloadpacket in (aten.log_softmax, aten._log_softmax) else []
    return [AxisOption((Shard(d),), Shard(d), "split") for d in range(x.ndim) if d != dim] + vocab


@register(aten.embedding, family="embedding")
def embedding_rule(node, ins, outs):
    """weight[V, H] gathered at indices[...]: split the indices (batch), the hidden dim, or the
    vocabulary (`vocab.py`)."""
    w, idx = ins
    out = outs[0]
    opts = [AxisOption((R, Shard(d)), Shard(d), "batch" if d == 0 else f"dim{d}") for d in range(idx.ndim)]
    opts.append(AxisOption((Shard(1), R), Shard(out.ndim - 1), "hidden"))
    return opts + embedding_option(node)


def _reduction_kind(node) -> str:
    red = node.kwargs.get("reduction", node.args[3] if len(node.args) > 3 else 1)
    return {0: "none", 1: "mean", 2: "sum"}.get(red, red)


@register(aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd, family="loss", inner=row_reductions)
def cross_entropy_rule(node, ins, outs):
    """Split the batch: each device's loss is a partial sum (or partial mean) of the whole; or split
    cross-entropy's classes (`vocab.py`)."""
    logits = ins[0]
    kind = _reduction_kind(node)
    out = {"none": Shard(0), "mean": Partial("avg"), "sum": P}[kind]
    if logits.ndim == 1:
        return []
    rest = tuple(Shard(0) if t.ndim >= 1 and t.shape[0] == logits.shape[0] else R for t in ins[1:])
    vocab_option = cross_entropy_option if node.target.overloadpacket is aten.cross_entropy_loss else nll_loss_option
    vocab = vocab_option(node, ins)
    return [AxisOption((Shard(0),) + rest, out, "batch")] + vocab


@register(aten.mse_loss, aten.l1_loss, aten.smooth_l1_loss, family="loss")
def elementwise_loss_rule(node, ins, outs):
    red = node.args[2] if len(node.args) > 2 else node.kwargs.get("reduction", 1)
    out_of = {0: None, 1: Partial("avg"), 2: P}[red]
    target = ins[0]
    if out_of is None:
        return broadcast_options(ins, outs[0])
    return [AxisOption(tuple(Shard(d) for _ in ins), out_of, f"split{d}") for d in range(target.ndim)]


@register(aten.sum, aten.mean, aten.amax, aten.amin, aten.max, aten.min, aten.var, aten.std, family="reduction")
def reduction_rule(node, ins, outs):
    """Split a kept dim: the output is split; split a reduced dim: a partial sum (sum/mean only)."""
    x = ins[0]
    if not ins or x.ndim == 0:
        return []
    packet = node.target.overloadpacket
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or dims == [] or not isinstance(dims, (list, tuple, int)):
        dims = list(range(x.ndim))
    dims = {d % x.ndim for d in ([dims] if isinstance(dims, int) else dims)}
    keepdim = node.args[2] if len(node.args) > 2 and isinstance(node.args[2], bool) else node.kwargs.get(
        "keepdim", False)
    partial = {aten.sum: P, aten.mean: Partial("avg")}.get(packet)
    opts = []
    for d in range(x.ndim):
        if d in dims:
            if partial is not None:
                opts.append(AxisOption((Shard(d),), partial, "partial"))
            continue
        od = d if keepdim else d - sum(1 for r in dims if r < d)
        if outs and outs[0].ndim > od:
            opts.append(AxisOption((Shard(d),), Shard(od), "split"))
    return opts


@register(aten.arange, aten.full, aten.zeros, aten.ones, aten.empty, aten.scalar_tensor, aten.tensor,
          aten.tril, aten.triu, aten.randn, aten.rand, family="factory", saves_inputs=False)
def factory_rule(node, ins, outs):
    """Created whole on every device (tril/triu of such a constant too)."""
    return []
