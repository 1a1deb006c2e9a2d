"""How a planned op runs: on each device's local shards, exactly as the plan's strategy says.

A strategy (from the op's rule) states the layout of every input and of the output; the
rule is what proves that running the op on local shards yields that output layout. So an op
runs as plain PyTorch on local tensors, with three adjustments:

* shape arguments (view/reshape/expand sizes) become the local output shape;
* each input's gradient leaves in the layout the strategy implies (strategies/gradients.py): a
  Partial input gets a whole gradient, a Replicate input used by work split over an axis gets a
  partial sum over it (a weight under data parallelism), a Shard input a shard; a parameter-side
  op keeps partial sums where it is replicated;
* an output that is a partial *average* (a mean over a split batch) passes 1/n of the gradient to
  each device, since each device's term enters the whole with weight 1/n.

DTensor is used for what it is best at: storing shards and moving them (`Reshard`).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Placement

from ..compat import dtensor_from, pytree
from ..passes import lowering  # noqa: F401  (defines the autopar:: ops)
from ..placement import block_index, layout_str, local_shape
from ..strategies.gradients import input_grad_layouts, output_grad_layout
from . import rng
from .experts import run_experts
from .reshard import reshard, to_layout
from .vocab import vocab_cross_entropy, vocab_embedding, vocab_log_softmax, vocab_nll_loss


def mesh_device(device_mesh) -> torch.device:
    """The torch device this rank runs `device_mesh`'s plan on."""
    if device_mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_mesh.device_type, torch.accelerator.current_device_index()
                        if hasattr(torch, "accelerator") else torch.cuda.current_device())

aten = torch.ops.aten
_SHAPE_ARG = {aten.view.default: 1, aten.reshape.default: 1, aten._unsafe_view.default: 1, aten.expand.default: 1}
# a local shard can be strided where the global tensor was not (a transposed shard): reshape is
# view where it can be and copies where it must, with the same gradient
_RESHAPE_FOR = {aten.view.default: aten.reshape.default, aten._unsafe_view.default: aten.reshape.default}


def _moe_first_expert(op: "LocalOp", args, kwargs):
    """`autopar::moe_experts` on a device holding a slice of the experts: say which ones (mixed
    radix over the axes that split them, in mesh order, as DTensor chunks a dim)."""
    args = list(args)
    args[6] = block_index(op.inputs[3], 0, op.mesh.get_coordinate(), op.mesh.shape) * args[3].shape[0]
    return args, kwargs


# Ops whose non-tensor arguments depend on which shard this device holds: target -> fn(op, args, kwargs)
LOCALIZE = {torch.ops.autopar.moe_experts.default: _moe_first_expert}
# Ops that run otherwise than the plain op on local shards under some strategies (moving data between
# devices inside themselves, or masking a lookup to their slice): target -> fn(op, args, kwargs)
EXCHANGE = {torch.ops.autopar.moe_experts.default: run_experts,
            aten.embedding.default: vocab_embedding, aten.cross_entropy_loss.default: vocab_cross_entropy,
            aten.log_softmax.int: vocab_log_softmax, aten._log_softmax.default: vocab_log_softmax,
            aten.nll_loss.default: vocab_nll_loss, aten.nll_loss_nd.default: vocab_nll_loss}
# those of them that are the plain op where their strategy does not split the vocabulary (vocab.splits_vocab)
VOCAB = frozenset(t for t, fn in EXCHANGE.items() if fn is not run_experts)


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: DTensor, grad_layout: tuple):  # type: ignore[override]
        ctx.meta = (x.device_mesh, grad_layout, x.shape, x.stride())
        local = x.to_local()
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        mesh, layout, shape, stride = ctx.meta
        return dtensor_from(grad.contiguous(), mesh, layout, shape=shape, stride=stride), None


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, mesh, layout: tuple, grad_layout: tuple):  # type: ignore[override]
        ctx.grad_layout = grad_layout
        ctx.avg_scale = 1.0
        for p, n in zip(layout, mesh.shape):
            if isinstance(p, Partial) and p.reduce_op == "avg":
                ctx.avg_scale /= n
        return dtensor_from(t, mesh, layout)

    @staticmethod
    def backward(ctx, grad: DTensor):  # type: ignore[override]
        local = to_layout(grad, ctx.grad_layout).to_local()
        if ctx.avg_scale != 1.0:
            local = local * ctx.avg_scale
        return local.contiguous(), None, None, None


class LocalOp(torch.nn.Module):
    """`out = self.op_x(*inputs)`: the op on local shards; inputs arrive in the planned layouts."""

    def __init__(self, target, inputs: Sequence[tuple], output: Sequence[Placement], mesh,
                 global_shape: tuple[int, ...] | None = None, side_axes: Sequence[bool] = ()):
        super().__init__()
        self.target, self.mesh = _RESHAPE_FOR.get(target, target), mesh
        self.output = tuple(output)
        self.inputs = tuple(tuple(i) for i in inputs)
        # a parameter-side op (passes/parameter_side.py): gradients stay partial sums where replicated,
        # on `side_axes`
        self.grad_layouts = input_grad_layouts(self.inputs, self.output, side_axes)
        self.out_grad_layout = output_grad_layout(self.output, side_axes)
        self.shape_arg = _SHAPE_ARG.get(self.target)
        self.local_out_shape = (local_shape(global_shape, self.output, mesh.shape)
                                if global_shape is not None and self.shape_arg is not None else None)
        self.rng: rng.RngState | None = None      # a dropout's (rng.attach), with its node's name
        self.node = ""
        self.local_out = False      # hand the result on as a plain local tensor (runtime/rewrite.passes_local)
        self.capacity_factor: float | None = None    # the plan's moe_capacity_factor (an experts op's, experts.py)

    def _localize(self, args, kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        k = 0
        for i, a in enumerate(leaves):      # tensor inputs in slot order: DTensors, or locals already
            if isinstance(a, torch.Tensor):
                if isinstance(a, DTensor):
                    leaves[i] = _ToLocal.apply(a, self.grad_layouts[k])
                k += 1
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        if self.local_out_shape is not None:
            args = list(args)
            args[self.shape_arg] = list(self.local_out_shape)
        if self.target in LOCALIZE:
            args, kwargs = LOCALIZE[self.target](self, args, kwargs)
        return args, kwargs

    def forward(self, *args, **kwargs):
        args, kwargs = self._localize(args, kwargs)
        if self.target in rng.DROPOUT_OPS:
            out = rng.dropout(self, *args, **kwargs)
        elif self.target in EXCHANGE:
            out = EXCHANGE[self.target](self, args, kwargs)
        else:
            out = self.target(*args, **kwargs)
        if self.local_out:
            return out
        return pytree.tree_map(lambda t: _FromLocal.apply(t, self.mesh, self.output, self.out_grad_layout)
                               if isinstance(t, torch.Tensor) else t, out)

    def extra_repr(self) -> str:
        return f"{self.target} -> {', '.join(layout_str(self.output))}"


class ReplicateOp(LocalOp):
    """An op no rule knows: every input gathered whole, run as on one device (the safe fallback)."""

    def forward(self, *args, **kwargs):
        whole = tuple(Replicate() for _ in self.output)
        args, kwargs = pytree.tree_map(lambda t: reshard(t, whole) if isinstance(t, DTensor) else t, (args, kwargs))
        return super().forward(*args, **kwargs)


class ToLocal(torch.nn.Module):
    """A whole (replicated) DTensor back to a plain tensor for the caller."""

    def forward(self, x):
        return x.to_local() if isinstance(x, DTensor) else x
