"""Element-wise ops: the output may be split along any dim; broadcast inputs follow or replicate."""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from .registry import AxisOption, register

aten = torch.ops.aten
R, P = Replicate(), Partial()


def broadcast_options(ins, out, label="split") -> list[AxisOption]:
    """One option per output dim d: inputs that carry dim d (right-aligned, same size) shard it."""
    opts = []
    for d in range(out.ndim):
        placements = []
        for t in ins:
            k = d - (out.ndim - t.ndim)
            placements.append(Shard(k) if k >= 0 and t.shape[k] == out.shape[d] else R)
        opts.append(AxisOption(tuple(placements), Shard(d), f"{label}{d}"))
    return opts


# the gradient of a sum needs neither operand: nothing is kept for the backward
_LINEAR = (aten.add, aten.sub, aten.neg)

_POINTWISE = (
    aten.mul, aten.div, aten.pow, aten.exp, aten.log, aten.sqrt, aten.rsqrt,
    aten.tanh, aten.sigmoid, aten.relu, aten.gelu, aten.silu, aten.abs, aten.sin, aten.cos, aten.clamp,
    aten.where, aten.masked_fill, aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge, aten.logical_not,
    aten.maximum, aten.minimum, aten.reciprocal, aten.erf, aten.square, aten.bitwise_and, aten.bitwise_or,
    aten.leaky_relu, aten.hardtanh, aten.elu, aten.softplus, aten.mish, aten.hardswish, aten.hardsigmoid,
    aten.type_as, aten._to_copy, aten.to, aten.fill, aten.zeros_like, aten.ones_like, aten.full_like,
    aten.empty_like, aten.__and__, aten.__or__, aten.__xor__, aten.logical_and, aten.logical_or, aten.logical_xor,
    aten.bitwise_xor, aten.bitwise_not, aten.floor_divide, aten.remainder, aten.fmod, aten.floor, aten.ceil,
    aten.round, aten.trunc, aten.frac, aten.sign, aten.sgn, aten.log1p, aten.expm1, aten.log2, aten.log10,
    aten.exp2, aten.isnan, aten.isinf, aten.isfinite, aten.clamp_min, aten.clamp_max, aten.rsub, aten.atan,
    aten.atan2, aten.tan, aten.asin, aten.acos, aten.erfc, aten.relu6, aten.selu, aten.celu, aten.logit,
    aten.addcmul, aten.addcdiv, aten.lerp, aten.xlogy, aten.hypot, aten.copysign, aten.nan_to_num,
    aten.threshold, aten.positive, aten.softshrink, aten.hardshrink, aten.copy,
)


@register(*_LINEAR, family="pointwise", saves_inputs=False)
@register(*_POINTWISE, family="pointwise", saves_inputs=True, admits=lambda labels, *_: labels.count("partial") <= 1)
def pointwise_rule(node, ins, outs):
    if not outs:
        return []
    # No Partial pass-through (P + P -> P): Megatron-style plans reduce before the residual add,
    # and the extra option would multiply every residual edge of the ILP by 5/4 per mesh axis.
    return broadcast_options(ins, outs[0]) + scaled_partial_options(node, ins, outs[0])


# linear in the partial operand (the dividend; a rounding division is not linear)
_SCALES = (aten.div.Tensor, aten.div.Scalar, aten.mul.Tensor, aten.mul.Scalar)


def scaled_partial_options(node, ins, out) -> list[AxisOption]:
    """A scalar partial sum divided (or multiplied) by a whole scalar stays a partial sum: a mean loss's
    sum over this rank's rows divided by the global count, so that its one all-reduce is the program
    output's (issued asynchronously, waited where the caller first uses the loss: runtime/async_output.py
    `AsyncOutput`), not a blocking one before the division. Scalars only: no cost to the ILP's size; on
    one mesh axis only (the rule's `admits`): an output partial over two axes is made whole by blocking
    reshards, so there the option would only tie with the division of the whole sum."""
    if node.target not in _SCALES or out.ndim or any(t.ndim for t in ins):
        return []
    packet = node.target.overloadpacket
    if len(ins) == 1:
        return [AxisOption((P,), P, "partial")]
    opts = [AxisOption((P, R), P, "partial")]
    return opts + [AxisOption((R, P), P, "partial")] if packet is aten.mul else opts


@register(aten.dropout, aten.native_dropout, family="pointwise")
def dropout_rule(node, ins, outs):
    return broadcast_options(ins, outs[0])
