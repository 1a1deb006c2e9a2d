"""A layer's re-gathered parameters gathered as one flat all-gather, forward and backward (FSDP2's way).

Where the plan re-gathers a layer's parameters (`plan.residency` "regather"), gathering each on its
own costs one collective per parameter twice a step (its forward use, and again when the backward
unpacks it: `regather.py`), each paying the collective's latency. Here the `GatherCopy` nodes of
one layer that gather the same way (an even `Shard(0)` -> `Replicate` over one mesh axis, the
other axes as stored, one dtype) become one `LayerGather`:

* forward: the members' local shards are copied into one flat buffer and all-gathered with one
  all-gather (`compat.all_gather_single`) over that axis; the result ([rank][member] chunks) is copied out member
  by member into one buffer holding each member's gathered tensor, contiguous (FSDP2's copy-in /
  copy-out, `torch.split_with_sizes_copy`); the graph's ops get views of it (plain local tensors
  where the consumer is a `LocalOp`, as trim_wrappers.py's parameter edges; DTensors else). The buffer is
  registered in the `GatheredCopies` registry as one copy, so the saved-tensor hooks (memory.py)
  drop every saved view of it and keep a `RegatheredCopy` of the layer's `LayerCopy` instead; the
  buffer is freed when the forward's last view of it goes;
* prefetch: the gather of the next layer (in program order, the same on every rank) is launched
  asynchronously by a `LaunchGather` node placed before this layer's ops, and waited by its
  `LayerGather` at its first use: one layer's gather travels while the layer before computes;
* backward: the first saved view unpacked gathers the layer again (one collective), and launches
  the previous layer's backward gather (the next the backward needs); the buffer is held until the
  `LayerGather`'s own backward, which runs once every op of the layer using these parameters has
  run its backward (autograd's order), then released. Its backward hands each member's gradient to
  the gradient buckets (grad_sync.py) as the `Reshard` would, one after the other.

Parameters of a layer that cannot join its flat gather (another kind of gather) are gathered one by
one (`GatherCopy`), and logged. A layer whose activations are offloaded gathers flat as any other: its
region's saved-tensor router finds a saved view of the flat buffer in the registry first and keeps its
`RegatheredCopy`. A recomputed layer too (FSDP2 with activation checkpointing): its `LayerGather` runs
before its checkpointed region (`_anchors`), whose inputs the gathered views are; checkpoint saves its
inputs through the saved-tensor hooks around it, which keep a `RegatheredCopy` (`RegatheredDTensor`),
so the buffer is freed after the forward and the recomputation unpacks the backward's flat re-gather
(prefetched as any layer's): one flat gather per pass, none in the recomputation of its own.
Parameters outside the layers group by their run between two layers (the embeddings;
the final norm and head).

Why our own and not FSDP2's `FSDPParamGroup`: FSDP2 owns the module's parameters (it replaces them
with its own DTensors and drives its collectives from module hooks); here the parameters are the
plan's DTensor shards, used by the ops of a rewritten graph, over any mesh axis of an N-D mesh.
The collectives themselves are c10d's (`compat.all_gather_single`, async work handles).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.tensor import DTensor

from ..compat import all_gather_single, at_backward_end, dtensor_from
from ..cost_model.comm import flat_gather_axis
from ..passes.layers import layer_key, module_path
from ..placement import layout_str
from .direct_reshard import issue
from .faults import watched
from .trim_wrappers import tensor_args
from .ops import LocalOp
from .regather import GatherCopy, GatheredCopies
from .regions import node_layers
from .reshard import reduce_grad, reduce_local_grad

log = logging.getLogger("autopar")


class FlatGather:
    """The collective of one `LayerGather`: members' local shards -> one buffer of their gathered
    tensors, each contiguous, in member order."""

    def __init__(self, mesh, axis: int, local_shapes: Sequence[torch.Size], what: str):
        self.mesh, self.n, self.group = mesh, mesh.size(axis), mesh.get_group(axis)
        self.numels = [math.prod(s) for s in local_shapes]
        self.total = sum(self.numels)
        self.what = what

    def launch(self, locals_: Sequence[torch.Tensor]) -> Pending:
        # named in profiles (and counted by the tests): "autopar flat all-gather of <layer> (<k> tensors)"
        with torch.no_grad(), torch.profiler.record_function(f"autopar {self.what}"):
            send = torch.cat([t.reshape(-1) for t in locals_])
            if self.n == 1:         # an axis of one device: the shards are the gathered tensors
                return Pending(self, send, None)
            recv = send.new_empty(self.n * self.total)
            with watched(self.mesh, self.what):
                work = issue(all_gather_single, (recv, send), self.group, async_op=True)
        return Pending(self, recv, work)


@dataclass(slots=True)
class Pending:
    """A launched flat gather; `wait()` -> the members' gathered tensors in one buffer."""
    flat: FlatGather
    recv: torch.Tensor
    work: object

    def wait(self) -> torch.Tensor:
        f = self.flat
        if self.work is None:
            return self.recv
        with watched(f.mesh, f.what):
            self.work.wait()
        out = torch.empty_like(self.recv)
        parts = [v.view(f.n, k) for v, k in zip(out.split([f.n * k for k in f.numels]), f.numels)]
        with torch.no_grad():
            torch.split_with_sizes_copy(self.recv.view(f.n, f.total), f.numels, dim=1, out=parts)
        return out


class LayerCopy:
    """A layer's freed gathered buffer, gathered again when the backward first needs it and held
    until `release()` (see module docstring). `prev`: the layer gathered before it in the forward,
    whose backward comes next: its gather is launched as soon as this one's is waited."""

    def __init__(self, flat: FlatGather, shards: list[torch.Tensor], prev: LayerCopy | None):
        self.flat, self.shards, self.prev = flat, shards, prev
        self.held: torch.Tensor | None = None
        self.pending: Pending | None = None

    def prefetch(self) -> None:
        if self.held is None and self.pending is None:
            self.pending = self.flat.launch(self.shards)
            at_backward_end(self.release)

    def load(self) -> torch.Tensor:
        if self.held is None:
            self.prefetch()
            self.held, self.pending = self.pending.wait(), None
            if self.prev is not None:
                self.prev.prefetch()
        return self.held

    def release(self) -> None:
        """Drop the held buffer; a prefetch never used is waited first (its buffer is being written)."""
        if self.pending is not None and self.pending.work is not None:
            self.pending.work.wait()
        self.held = self.pending = None


class LaunchGather(torch.nn.Module):
    """Graph op: `pending = self.launch_x(p_a, p_b, ...)`: launch the flat gather of a `LayerGather`
    (its `target`), one layer ahead of it."""

    def __init__(self, target: LayerGather):
        super().__init__()
        self._target = [target]          # in a list: not a submodule

    def forward(self, *shards: DTensor) -> Pending:
        return self._target[0].launch(shards)

    def extra_repr(self) -> str:
        return f"for {self._target[0].key}"


class LayerGather(torch.nn.Module):
    """Graph op: `ws = self.gather_x(pending, p_a, p_b, ...)`, then `w_a = ws[0]`, ...: the
    members' gathered tensors (in their `layouts`), from one flat all-gather over mesh axis `axis`
    (see module docstring); `syncs`: each member's link to the gradient buckets, or None. A member
    whose one consumer is a `LocalOp` is handed on as its local tensor (no DTensor made, forward or
    backward, and the consumer can be a direct call: trim_wrappers.py)."""

    def __init__(self, key: str, axis: int, layouts: Sequence[tuple], members: Sequence[str],
                 syncs: Sequence, local: Sequence[tuple | None], copies: GatheredCopies, chain: list):
        super().__init__()
        self.key, self.axis, self.layouts, self.members = key, axis, tuple(layouts), tuple(members)
        self.syncs = tuple(syncs)
        # per member: its one consumer's gradient layout where it is handed on as a plain local tensor
        # (a `LocalOp`'s input, as trim_wrappers.ParamEdge), else None (a DTensor)
        self.local = tuple(local)
        self.meta: list | None = None    # per member: (mesh, global shape, stride), from the first call
        self._copies = [copies]
        self._chain = chain              # this forward's LayerCopy of each LayerGather, in order (shared)
        self.first = False               # the program's first LayerGather: starts a new chain
        self._flat: FlatGather | None = None

    def flat(self, shards: Sequence[DTensor]) -> FlatGather:
        if self._flat is None:
            self._flat = FlatGather(shards[0].device_mesh, self.axis, [s.to_local().shape for s in shards],
                                    f"flat all-gather of {self.key} ({len(shards)} tensors)")
        return self._flat

    def launch(self, shards: Sequence[DTensor]) -> Pending:
        return self.flat(shards).launch([s.to_local() for s in shards])

    def forward(self, pending: Pending, *shards: DTensor) -> tuple[DTensor, ...]:
        return _LayerGather.apply(self, pending, *shards)

    def extra_repr(self) -> str:
        return f"{self.key}: {len(self.members)} tensors over axis {self.axis} -> " + \
            "; ".join(f"{m} {', '.join(layout_str(lay))}" for m, lay in zip(self.members, self.layouts))


class _LayerGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op: LayerGather, pending: Pending, *shards: DTensor):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        ctx.op, ctx.src = op, [tuple(s.placements) for s in shards]
        if op.meta is None:
            op.meta = [(s.device_mesh, s.shape, s.stride()) for s in shards]
        buf = pending.wait()
        if op.first:
            op._chain.clear()
        locals_ = [s.to_local().detach() for s in shards]
        ctx.copy = LayerCopy(op.flat(shards), locals_, op._chain[-1] if op._chain else None)
        op._chain.append(ctx.copy)
        op._copies[0].add_layer(buf, ctx.copy)
        out, off = [], 0
        for s, lay, k, local, plain in zip(shards, op.layouts, op._flat.numels, locals_, op.local):
            whole = buf[off:off + op._flat.n * k].view(op._flat.n * local.shape[0], *local.shape[1:])
            out.append(whole if plain is not None else
                       dtensor_from(whole, s.device_mesh, lay, shape=s.shape, stride=s.stride()))
            off += op._flat.n * k
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        ctx.copy.release()
        op = ctx.op
        return (None, None, *(None if g is None else reduce_grad(g, src, sync) if plain is None
                              else reduce_local_grad(g, plain, src, sync, meta)
                              for g, src, sync, plain, meta in zip(grads, ctx.src, op.syncs, op.local, op.meta)))


def flatten_gathers(gm: fx.GraphModule, param_of: dict[str, str], stored_of, mesh_shape,
                    copies: GatheredCopies) -> int:
    """Replace the "regather" `GatherCopy` nodes of `gm` taking a parameter placeholder by one
    `LayerGather` per (layer, mesh axis, dtype) (module docstring), each launched one group ahead.
    Parameters outside the layers group by their run between layers. `stored_of(fqn)`: the stored
    layout. Returns how
    many `LayerGather`s were made."""
    groups = _groups(gm, param_of, stored_of, mesh_shape)
    made = _layer_gathers(gm, groups, copies)
    _wire(gm, made)
    if made:
        gm.delete_all_unused_submodules()
        gm.recompile()
    return len(made)


def _groups(gm: fx.GraphModule, param_of: dict[str, str], stored_of, mesh_shape) -> dict[tuple, list[fx.Node]]:
    """The "regather" `GatherCopy` nodes of parameter placeholders by (layer, or run between layers;
    mesh axis; dtype), in graph order; those gathered one by one are logged."""
    groups: dict[tuple, list[fx.Node]] = {}
    alone: list[str] = []
    segment, last = 0, None          # runs of layers passed: parameters outside the layers group by it
    for node in gm.graph.nodes:
        mod = gm.get_submodule(node.target) if node.op == "call_module" else None
        if not isinstance(mod, GatherCopy):
            here = layer_key(module_path(node)) if node.op in ("call_module", "call_function") else None
            if here is not None and here != last:
                segment, last = segment + 1, here
            continue
        src = node.args[0]
        fqn = param_of.get(getattr(src, "name", None))
        if mod.residency != "regather" or fqn is None or src.op != "placeholder":
            continue
        val = src.meta.get("val")
        layer = layer_key(fqn)
        axis = flat_gather_axis(stored_of(fqn), mod.layout, tuple(val.shape) if val is not None else (), mesh_shape)
        if axis is None:
            alone.append(f"{fqn} (not an even dim-0 gather)")
            continue
        where = layer if layer is not None else f"@{segment}"
        groups.setdefault((where, axis, val.dtype), []).append(node)
    if alone:
        log.info("re-gathered one by one, not in their layer's flat gather: %s", "; ".join(alone))
    return groups


def _layer_gathers(gm: fx.GraphModule, groups: dict[tuple, list[fx.Node]],
                   copies: GatheredCopies) -> list[tuple[list[fx.Node], str]]:
    """One `LayerGather` and its `LaunchGather` added to `gm` per group; -> (the group's nodes, the
    modules' name) in the order of their first node."""
    chain: list = []
    made: list[tuple[list[fx.Node], str]] = []
    for (where, axis, _), nodes in groups.items():
        mods = [gm.get_submodule(n.target) for n in nodes]
        op = LayerGather(where, axis, [m.layout for m in mods], [m.key for m in mods], [m.sync for m in mods],
                         [local_consumer(gm, n) for n in nodes], copies, chain)
        name = f"{where.replace('.', '_').replace('@', 'at')}_{axis}"
        gm.add_submodule("gather_" + name, op)
        gm.add_submodule("launch_" + name, LaunchGather(op))
        made.append((nodes, name))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    made.sort(key=lambda m: order[m[0][0]])
    return made


def _wire(gm: fx.GraphModule, made: list[tuple[list[fx.Node], str]]) -> None:
    """Each group's `GatherCopy` nodes replaced by its gather's items, the gather launched as the
    group before is waited (the first: where it is used). A layer's gather waits before the layer's
    first op (`_anchors`)."""
    prev = None
    for i, ((nodes, name), anchor) in enumerate(zip(made, _anchors(gm, made))):
        shards = tuple(n.args[0] for n in nodes)
        # launched as the group before is waited (the first: where it is used)
        with gm.graph.inserting_after(prev) if prev is not None else gm.graph.inserting_before(anchor):
            pending = gm.graph.call_module("launch_" + name, shards)
        with gm.graph.inserting_before(anchor):
            prev = gm.graph.call_module("gather_" + name, (pending, *shards))
        op = gm.get_submodule("gather_" + name)
        op.first = i == 0
        for k, n in enumerate(nodes):
            with gm.graph.inserting_before(anchor):
                item = gm.graph.call_function(_item, (prev, k))
            item.meta = dict(n.meta)
            item.meta["autopar_local"] = op.local[k] is not None
            n.replace_all_uses_with(item)
        for n in nodes:
            gm.graph.erase_node(n)


def _anchors(gm: fx.GraphModule, made: list[tuple[list[fx.Node], str]]) -> list[fx.Node]:
    """Per group, the node its gather goes before: the first node of its layer (`regions.node_layers`),
    so that the gather does not cut the layer's ops in two regions (a recomputed layer would then keep
    the activations between them: regions.py), else its first use; never before the group before's."""
    first: dict[str, fx.Node] = {}
    for node, layer in node_layers(gm).items():
        if layer is not None:
            first[layer] = node               # node_layers goes from the graph's end: the last one is first
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    out: list[fx.Node] = []
    for nodes, name in made:
        at = min((nodes[0], first.get(gm.get_submodule("gather_" + name).key, nodes[0])), key=order.__getitem__)
        out.append(at if not out or order[at] >= order[out[-1]] else out[-1])
    return out


def local_consumer(gm: fx.GraphModule, node: fx.Node) -> tuple | None:
    """The gradient layout `node`'s one consumer sends back for it, where that consumer is a
    `LocalOp` taking it once (it then takes a local tensor as well as a DTensor); else None."""
    if len(node.users) != 1:
        return None
    user = next(iter(node.users))
    op = gm.get_submodule(user.target) if user.op == "call_module" else None
    slots = [k for k, a in enumerate(tensor_args(user)) if a is node]
    return op.grad_layouts[slots[0]] if type(op) is LocalOp and len(slots) == 1 else None


def _item(ws: tuple, k: int):
    return ws[k]
