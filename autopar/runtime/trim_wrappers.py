"""The rank graph's hot path, trimmed once per program: wrappers that do nothing at run time removed.

The rewrite states every layout change explicitly: a `Reshard` after every parameter, and each
`LocalOp` unwrapping its DTensor inputs to local shards (one autograd node each way, and a
DTensor built for every gradient). Where the layouts are fixed by the plan, most of that is
known to be a no-op before the first step. Here, per program (not per step):

* a parameter all of whose edges keep its stored layout, each into a `LocalOp` sending the gradient
  back in one layout (every weight of data parallelism; a Megatron weight used in its own shard),
  is fed to the program as its local shard itself: an autograd leaf sharing the shard's storage
  (`LeafParams`), its edges removed. Autograd accumulates its gradient in C++ (the uses of a tied
  weight summed there too) and a post-accumulate hook hands it to the gradient buckets, as DDP's
  hooks do; once its bucket is laid out the gradient is accumulated straight into the bucket and
  the bucket has one hook (grad_sync.py, `GradSync.view`): no Python per parameter in the forward,
  and none in the backward but a list's append;
* an edge of any other parameter whose `Reshard` keeps the stored layout and whose one consumer is
  a `LocalOp` (a parameter also gathered elsewhere, or sending gradients back in two layouts)
  becomes a `ParamEdge`: one autograd node that hands the consumer the parameter's local shard,
  and in the backward hands the local gradient straight to the gradient buckets (grad_sync.py),
  with no DTensor made on the way. A gradient the buckets do not take is reduced as the
  `Reshard` would (the same DTensor redistribution), so results are those of the explicit graph.
* a `LocalOp` that would only call its op (no dropout, no exchange, no shard-dependent argument),
  whose tensor inputs all arrive as local tensors (a leaf, a `ParamEdge`, another such op) and whose
  result is handed on local (`local_out`), becomes a plain call of the op in the generated code,
  its shape argument already the local shape: no module call, no argument flattening per step.
  Regions (regions.py) are trimmed inside too.

Why our own pass and not torch.compile: the graph must run op by op without a compiler (CPU
machines without a C++ toolchain), keep its collectives in autograd's order on every rank, and stay
printable as the plan's program.
"""
from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from ..compat import dtensor_from, local_tensor, pytree
from ..cost_model.comm import layout_code
from ..passes.captured import Captured
from ..passes.shape_prop import tensor_meta
from ..placement import layout_str, over_one_device, parse_layout
from ..plan import Plan
from ..plan_records import ACTIVATIONS
from . import rng
from .direct_reshard import direct_plan, run_steps
from .early_reshard import LocalCollective
from .faults import watch_of
from .grad_sync import GradSync, write_grad
from .local_reshard import LocalReshard
from .ops import EXCHANGE, LOCALIZE, VOCAB, LocalOp, ReplicateOp
from .reshard import LocalSplit, Reshard, carries_grad, reduce_local_grad, to_layout
from .vocab import splits_vocab


class _ParamEdge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p: DTensor, edge: "ParamEdge"):  # type: ignore[override]
        ctx.edge = edge
        if edge.meta is None:
            edge.meta = (p.device_mesh, p.shape, p.stride())
            edge.coord = p.device_mesh.get_coordinate()
        if edge.steps:         # a gather of the shard: the steps on the local tensor (watched: the watched move)
            if watch_of(p.device_mesh) is not None:
                return to_layout(p, edge.layout).to_local()
            return run_steps(p.to_local(), edge.steps, p.device_mesh, edge.coord).contiguous()
        local = p.to_local()
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        edge = ctx.edge       # None: a gradient bucket reduces it (grad_sync.py)
        return reduce_local_grad(grad, edge.grad_layout, edge.stored, edge.sync, edge.meta), None


class ParamEdge(Reshard):
    """Graph op: `w = self.reshard_x(p_w)` on a parameter edge into one `LocalOp` slot: the local shard,
    moved from the stored layout to `layout` by `steps` (`direct_reshard.direct_plan`; none where it
    keeps the stored layout), its gradient (in `grad_layout`, the consumer's) reduced to the stored
    layout (see the module docstring). A `Reshard` still for every pass that looks for one (layers,
    residency)."""

    def __init__(self, layout: Sequence[Placement], grad_layout: Sequence[Placement], sync=None,
                 stored: Sequence[Placement] | None = None, steps: tuple = ()):
        super().__init__(layout)
        self.grad_layout = tuple(grad_layout)
        self.stored = self.layout if stored is None else tuple(stored)
        self.steps = steps
        self.sync = sync
        self.meta = None           # (mesh, global shape, stride) of the parameter, from its first call
        self.coord = None          # this rank's mesh coordinate, from its first call

    def forward(self, x):
        return _ParamEdge.apply(x, self) if isinstance(x, DTensor) else x

    def extra_repr(self) -> str:
        moved = f"{', '.join(layout_str(self.stored))} -> " if self.steps else ""
        return f"{moved}{', '.join(layout_str(self.layout))} (local; gradient {', '.join(layout_str(self.grad_layout))})"


@dataclass(frozen=True, slots=True)
class LeafParam:
    """A parameter its program takes as its local shard (module docstring): stored and used in
    `layout`, its gradient arriving in `grad_layout`."""
    fqn: str
    layout: tuple[Placement, ...]
    grad_layout: tuple[Placement, ...]


def _fusable(gm: fx.GraphModule, node: fx.Node, stored_of, captured, sizes: tuple | None) -> tuple | None:
    """(layout, gradient layout, steps) of a parameter `Reshard` node into one `LocalOp` slot that keeps
    the stored layout (no steps) or, given the mesh's `sizes`, moves it by steps the runtime issues on
    the local tensor (`direct_reshard.direct_plan`); None otherwise."""
    mod = gm.get_submodule(node.target) if node.op == "call_module" else None
    if type(mod) is not Reshard or len(node.users) != 1:
        return None
    stored, steps = stored_of(node.args[0].name), ()
    if stored != mod.layout:
        val = node.args[0].meta.get("val")
        steps = direct_plan(tuple(val.shape), layout_code(stored), layout_code(mod.layout), sizes) \
            if sizes is not None and val is not None and all(isinstance(d, int) for d in val.shape) else None
        if not steps:
            return None
    user = next(iter(node.users))
    consumer = gm.get_submodule(user.target) if user.op == "call_module" else None
    slot = _tensor_slot(user, node, captured.get(user.meta.get("autopar_node")))
    if type(consumer) is not LocalOp or slot is None:
        return None
    return mod.layout, consumer.grad_layouts[slot], steps


def fuse_param_edges(gm: fx.GraphModule, cap: Captured, plan: Plan, param_of: dict[str, str],
                     alone: frozenset[str] = frozenset(), skip: frozenset[str] = frozenset()) -> dict[str, LeafParam]:
    """Trim the parameter edges of `gm` (module docstring), after `grad_sync.attach`. Returns the
    placeholders now fed local shards (`LeafParams.value`): placeholder name -> `LeafParam`.
    `alone`: parameters whose gradient must reach `.grad` through autograd (grad_offload.py);
    `skip`: parameters whose edges stay as they are (fetched from the host: param_offload.py)."""
    captured = {n.name: n for n in cap.gm.graph.nodes}

    def stored_of(placeholder: str) -> tuple:
        fqn = param_of[placeholder]
        return parse_layout(plan.placements.get(fqn, tuple("R" for _ in plan.mesh["axis_names"])))

    # gathers moved on the local tensor too, unless the memory plan swaps gathering Reshards for its
    # GatherCopy (runtime/memory.py: where it re-gathers or offloads any)
    sizes = None if "regather" in plan.residency.values() or any(
        k.startswith(ACTIVATIONS) and v != "device" for k, v in plan.offload.items()) else tuple(plan.mesh["shape"])
    leaves: dict[str, LeafParam] = {}
    for ph in [n for n in gm.graph.nodes if n.op == "placeholder" and n.name in param_of
               and param_of[n.name] not in skip]:
        edges = {u: _fusable(gm, u, stored_of, captured, sizes) for u in ph.users}
        kinds = set(edges.values())
        if param_of[ph.name] not in alone and edges and None not in kinds and len(kinds) == 1 \
                and not next(iter(kinds))[2]:
            layout, grad, _ = kinds.pop()
            leaves[ph.name] = LeafParam(param_of[ph.name], layout, grad)
            for u in edges:
                u.replace_all_uses_with(ph)
                gm.graph.erase_node(u)
            continue
        for u, fused in edges.items():
            if fused is not None:
                gm.add_submodule(u.target, ParamEdge(fused[0], fused[1], gm.get_submodule(u.target).sync,
                                                     stored_of(ph.name), fused[2]))
    if leaves:
        gm.delete_all_unused_submodules()
        gm.recompile()
    return leaves


class LeafParams:
    """Per module: each `LeafParam`'s local shard as an autograd leaf (sharing the DTensor parameter's
    storage: the optimizer's updates are its values), with the hook that hands its gradient to the
    module's buckets, or, where they do not take it, reduces it to `.grad` as the `Reshard` would."""

    def __init__(self, sync: GradSync):
        self.sync = sync
        self._made: dict[str, tuple] = {}     # fqn -> (parameter, leaf, the parameter's local tensor then)

    def value(self, p: torch.nn.Parameter, spec: LeafParam) -> torch.Tensor:
        """The leaf for parameter `p` (made again if `p` or its local tensor was replaced)."""
        made = self._made.get(spec.fqn)
        if made is not None and made[0] is p and made[2] is local_tensor(p):
            return made[1]
        with torch.no_grad():
            local = p.to_local()
        leaf = local.detach().requires_grad_(p.requires_grad)
        # already the stored layout (or differing over axes of one device alone): nothing to reduce
        keep = over_one_device(p.device_mesh.shape, spec.grad_layout, spec.layout)
        kind = []       # the bucket's kind, found at the first backward (the leaf's shape and dtype are fixed)

        def hook(t: torch.Tensor, p=p, spec=spec) -> None:
            grad, t.grad = t.grad, None
            if keep:
                write_grad(p, grad)
                return
            if not kind:
                kind.append(self.sync.kind(spec.grad_layout, spec.layout, grad))
            # one use: autograd summed the parameter's uses before the hook
            if not self.sync.take(spec.fqn, 1, kind[0], grad):
                whole = dtensor_from(grad.contiguous(), p.device_mesh, spec.grad_layout, shape=p.shape, stride=p.stride())
                write_grad(p, to_layout(whole, spec.layout).to_local())

        if leaf.requires_grad and keep:
            leaf.register_post_accumulate_grad_hook(hook)
        elif leaf.requires_grad:        # the buckets may take its gradient as a view (`GradSync.view`)
            self.sync.leaf(spec.fqn, leaf, hook)
        self._made[spec.fqn] = (p, leaf, local_tensor(p))
        return leaf


def local_inputs(gm: fx.GraphModule, cap: Captured, layouts: dict[str, tuple]) -> frozenset[str]:
    """The user inputs of `gm` (placeholder name -> the layout it arrives in) that can be fed as the
    local tensor the caller gave, with no DTensor made: every use a `LocalOp` taking it in that layout
    and sending its gradient back in it, if one can flow (up to axes of one device: `over_one_device`),
    or a `LocalSplit` of it from that layout (an integer input given whole, split over the batch)."""
    captured = {n.name: n for n in cap.gm.graph.nodes}
    out = set()
    for ph in [n for n in gm.graph.nodes if n.op == "placeholder" and n.name in layouts and n.users]:
        layout, grad_flows = layouts[ph.name], carries_grad(ph.meta["val"].dtype)
        for user in ph.users:
            mod = gm.get_submodule(user.target) if user.op == "call_module" else None
            if type(mod) is LocalSplit and over_one_device(mod.mesh.shape, mod.source, layout):
                continue
            slot = _tensor_slot(user, ph, captured.get(user.meta.get("autopar_node")))
            if type(mod) is not LocalOp or slot is None:
                break
            wants = (mod.inputs[slot], mod.grad_layouts[slot]) if grad_flows else (mod.inputs[slot],)
            if not all(over_one_device(mod.mesh.shape, want, layout) for want in wants):
                break
        else:
            out.add(ph.name)
    return frozenset(out)


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


def direct_calls(gm: fx.GraphModule, local_inputs: frozenset[str] = frozenset()) -> int:
    """Every eligible `LocalOp` of `gm` and of the graphs inside it (regions) as a plain call of its
    op (module docstring); `local_inputs`: placeholders fed plain local tensors. Returns how many."""
    done = 0
    for sub in list(gm.modules()):
        if isinstance(sub, fx.GraphModule):
            done += _direct_calls(sub, local_inputs)
    return done


def _plain(mod, node: fx.Node) -> bool:
    if type(mod) is not LocalOp or not mod.local_out:
        return False
    exchanges = mod.target in EXCHANGE and (mod.target not in VOCAB or splits_vocab(mod, node))
    return mod.target not in rng.DROPOUT_OPS and not exchanges and mod.target not in LOCALIZE


def _direct_calls(gm: fx.GraphModule, local_inputs: frozenset[str]) -> int:
    # nodes whose value is a plain local tensor at run time
    local: set[fx.Node] = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name in local_inputs}
    done = 0
    for node in list(gm.graph.nodes):
        mod = gm.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(mod, (ParamEdge, LocalSplit, LocalCollective, LocalReshard)) \
                or (type(mod) in (LocalOp, ReplicateOp) and mod.local_out) \
                or node.meta.get("autopar_local") or (node.target is operator.getitem and node.args[0] in local):
            local.add(node)         # its result is a plain tensor (a LocalOp's whatever its inputs; a flat
                                    # gather's member handed on local: layer_gather.py)
        if not _plain(mod, node) or not all(a in local for a in tensor_args(node)):
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


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The argument nodes of a rank-graph op that carry tensors: all its node arguments (a rank
    graph's ops take no node that is not a tensor but sizes, which are not nodes here)."""
    return [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]
