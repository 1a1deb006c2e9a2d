"""The rank graph's hot path, trimmed once per program: wrappers that do nothing at run time removed.

The rewrite states every layout change explicitly: a `Reshard` after every parameter, and each
`LocalOp` unwrapping its DTensor inputs to local shards (one autograd node each way, and a
DTensor built for every gradient). Where the layouts are fixed by the plan, most of that is
known to be a no-op before the first step. Here, per program (not per step):

* a parameter's edge whose `Reshard` keeps the stored layout (data parallelism's replicated
  weights, a Megatron weight used in its own shard) and whose one consumer is a `LocalOp`
  becomes a `ParamEdge`: one autograd node that hands the consumer the parameter's local shard,
  and in the backward hands the local gradient straight to the gradient buckets (grad_sync.py),
  with no DTensor made on the way. A gradient the buckets do not take is reduced as the
  `Reshard` would (the same DTensor redistribution), so results are those of the explicit graph.
* a `LocalOp` that would only call its op (no dropout, no exchange, no shard-dependent argument),
  whose tensor inputs all arrive as local tensors (from a `ParamEdge` or another such op) and whose
  result is handed on local (`local_out`), becomes a plain call of the op in the generated code,
  its shape argument already the local shape: no module call, no argument flattening per step.
  Regions (regions.py) are trimmed inside too.

Why our own pass and not torch.compile: the graph must run op by op without a compiler (CPU
machines without a C++ toolchain), keep its collectives in autograd's order on every rank, and stay
printable as the plan's program.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from ..compat import pytree
from ..passes.capture import Captured
from ..passes.shape_prop import tensor_meta
from ..placement import layout_str, parse_layout
from ..plan import Plan
from . import rng
from .ops import EXCHANGE, LOCALIZE, LocalOp, ReplicateOp
from .reshard import Reshard, to_layout


class _ParamEdge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p: DTensor, edge: "ParamEdge"):  # type: ignore[override]
        ctx.edge, ctx.meta = edge, (p.device_mesh, p.shape, p.stride())
        local = p.to_local()
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        edge = ctx.edge
        if edge.sync is not None and edge.sync.take(edge.grad_layout, edge.layout, grad):
            return None, None            # a gradient bucket reduces it (grad_sync.py)
        mesh, shape, stride = ctx.meta
        whole = DTensor.from_local(grad.contiguous(), mesh, edge.grad_layout, run_check=False, shape=shape,
                                   stride=stride)
        return to_layout(whole, edge.layout), None


class ParamEdge(Reshard):
    """Graph op: `w = self.reshard_x(p_w)` on a parameter edge that keeps the stored layout: the local
    shard, its gradient (in `grad_layout`, the consumer's) reduced to the stored layout (see the
    module docstring). A `Reshard` still for every pass that looks for one (layers, residency)."""

    def __init__(self, layout: Sequence[Placement], grad_layout: Sequence[Placement], sync=None):
        super().__init__(layout)
        self.grad_layout = tuple(grad_layout)
        self.sync = sync

    def forward(self, x):
        return _ParamEdge.apply(x, self) if isinstance(x, DTensor) else x

    def extra_repr(self) -> str:
        return f"{', '.join(layout_str(self.layout))} (local; gradient {', '.join(layout_str(self.grad_layout))})"


def fuse_param_edges(gm: fx.GraphModule, cap: Captured, plan: Plan, param_of: dict[str, str]) -> int:
    """Turn every eligible parameter `Reshard` of `gm` into a `ParamEdge` (module docstring); after
    `grad_sync.attach` (its link is kept). Returns how many."""
    captured = {n.name: n for n in cap.gm.graph.nodes}
    fused = 0
    for node in gm.graph.nodes:
        mod = gm.get_submodule(node.target) if node.op == "call_module" else None
        src = node.args[0] if node.args else None
        if type(mod) is not Reshard or not isinstance(src, fx.Node) or src.name not in param_of or len(node.users) != 1:
            continue
        stored = parse_layout(plan.placements.get(param_of[src.name], tuple("R" for _ in mod.layout)))
        user = next(iter(node.users))
        consumer = gm.get_submodule(user.target) if user.op == "call_module" else None
        slot = _tensor_slot(user, node, captured.get(user.meta.get("autopar_node")))
        if stored != mod.layout or type(consumer) is not LocalOp or slot is None:
            continue
        gm.add_submodule(node.target, ParamEdge(mod.layout, consumer.grad_layouts[slot], mod.sync))
        fused += 1
    return fused


def _tensor_slot(user: fx.Node, node: fx.Node, captured: fx.Node | None) -> int | None:
    """The index of `node` among the tensor inputs of `user` (as `LocalOp` counts them: the captured
    op's tensor arguments in flattening order); None if it is not there exactly once."""
    if captured is None:
        return None
    leaves = pytree.tree_leaves((user.args, user.kwargs))
    ref = pytree.tree_leaves((captured.args, captured.kwargs))
    if len(leaves) != len(ref):
        return None
    slots, k = [], 0
    for mine, theirs in zip(leaves, ref):
        if isinstance(theirs, fx.Node) and tensor_meta(theirs.meta.get("val")):
            if mine is node:
                slots.append(k)
            k += 1
    return slots[0] if len(slots) == 1 else None


def direct_calls(gm: fx.GraphModule) -> int:
    """Every eligible `LocalOp` of `gm` and of the graphs inside it (regions) as a plain call of its
    op (module docstring). Returns how many."""
    done = 0
    for sub in list(gm.modules()):
        if isinstance(sub, fx.GraphModule):
            done += _direct_calls(sub)
    return done


def _plain(mod) -> bool:
    return (type(mod) is LocalOp and mod.local_out and mod.target not in rng.DROPOUT_OPS
            and mod.target not in EXCHANGE and mod.target not in LOCALIZE)


def _direct_calls(gm: fx.GraphModule) -> int:
    local: set[fx.Node] = set()        # nodes whose value is a plain local tensor at run time
    done = 0
    for node in list(gm.graph.nodes):
        mod = gm.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(mod, ParamEdge) or (type(mod) in (LocalOp, ReplicateOp) and mod.local_out):
            local.add(node)         # its result is a plain tensor (a LocalOp's whatever its inputs)
        if not _plain(mod) or not all(a in local for a in _tensor_args(node)):
            continue
        args = list(node.args)
        if mod.local_out_shape is not None:
            args[mod.shape_arg] = list(mod.local_out_shape)
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(mod.target, tuple(args), dict(node.kwargs))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        local.add(call)
        done += 1
    if done:
        gm.delete_all_unused_submodules()
        gm.recompile()
    return done


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    """The argument nodes of a rank-graph op that carry tensors: all its node arguments (a rank
    graph's ops take no node that is not a tensor but sizes, which are not nodes here)."""
    return [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]
