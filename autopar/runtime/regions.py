"""Layer regions: the rank graph's ops of one layer, gathered into one submodule.

Recomputation and activation offload are decided per layer (`Plan.recompute`, `Plan.offload`'s
"activations:<layer>"), so the runtime needs each layer's ops as one callable. A node's layer is
`passes.layers.layer_key` of the module it came from; a node the rewrite added (a `Reshard`, which
has no module of its own) belongs to its consumer's layer, so the gathers feeding a layer's ops are
inside the layer and are recomputed with it. Each maximal run of consecutive nodes of a chosen
layer becomes a `LayerRegion` called from the outer graph:

    layer_blocks_0 = self.layer_blocks_0(add, p_blocks_0_ln1_weight, ...)
    getitem_9 = layer_blocks_0[0]

(a layer whose ops are interleaved with other nodes makes several regions, each run alike).
"""
from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from ..passes.layers import layer_key, module_path
from .checkpoint import run_recomputed
from .param_offload import FetchParam
from .regather import GatherCopy
from .reshard import Reshard


def node_layers(gm: fx.GraphModule) -> dict[fx.Node, str | None]:
    """Each call node of the rank graph -> its layer (see module docstring)."""
    out: dict[fx.Node, str | None] = {}
    for node in reversed(gm.graph.nodes):
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), (Reshard, GatherCopy, FetchParam)):
            consumers = {out.get(u) for u in node.users}
            out[node] = consumers.pop() if len(consumers) == 1 else None
        else:
            out[node] = layer_key(module_path(node))
    return out


class LayerRegion(torch.nn.Module):
    """One layer's ops, run under its recompute mode, its saved tensors routed by `saved` (a
    context manager factory: the layer's saved-tensor hooks) when it is not recomputed."""

    def __init__(self, layer: str, body: fx.GraphModule, recompute: str,
                 saved: Callable[[], contextlib.AbstractContextManager] | None):
        super().__init__()
        self.layer, self.body, self.recompute = layer, body, recompute
        self._saved = saved

    def forward(self, *args):
        if self.recompute != "none":
            return run_recomputed(self.body, args, self.recompute)
        with self._saved() if self._saved is not None else contextlib.nullcontext():
            return self.body(*args)

    def extra_repr(self) -> str:
        return f"{self.layer}: recompute={self.recompute}"


def group_layers(gm: fx.GraphModule, make_region: Callable[[str, fx.GraphModule], LayerRegion]) -> fx.GraphModule:
    """gm with each run of consecutive nodes of a layer for which make_region gives a region
    replaced by that region (make_region returns None for layers left inline)."""
    layers = node_layers(gm)
    runs: list[tuple[str, list[fx.Node]]] = []
    for node in gm.graph.nodes:
        key = layers.get(node)
        if key is not None and runs and runs[-1][0] == key and runs[-1][1][-1].next is node:
            runs[-1][1].append(node)
        elif key is not None:
            runs.append((key, [node]))
    names: set[str] = set()
    for key, nodes in runs:
        body = _extract(gm, nodes)
        region = make_region(key, body.module)
        if region is None:
            continue
        name = _fresh(f"layer_{key.replace('.', '_')}", names)
        gm.add_submodule(name, region)
        _replace(gm.graph, nodes, name, body)
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm


class _Body:
    """A run of nodes as a GraphModule, with the outer nodes it reads and the ones it returns."""

    def __init__(self, module: fx.GraphModule, inputs: list[fx.Node], outputs: list[fx.Node]):
        self.module, self.inputs, self.outputs = module, inputs, outputs


def _extract(gm: fx.GraphModule, nodes: list[fx.Node]) -> _Body:
    inside = set(nodes)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []

    def arg(n: fx.Node) -> fx.Node:
        if n not in env:
            inputs.append(n)
            env[n] = g.placeholder(n.name)
        return env[n]

    for n in nodes:
        env[n] = g.node_copy(n, arg)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    g.output(tuple(env[n] for n in outputs))
    root = torch.nn.Module()
    for n in nodes:
        if n.op == "call_module":
            root.add_module(n.target, gm.get_submodule(n.target))
    return _Body(fx.GraphModule(root, g, class_name="AutoparLayer"), inputs, outputs)


def _replace(g: fx.Graph, nodes: list[fx.Node], name: str, body: _Body) -> None:
    inside = set(nodes)
    with g.inserting_before(nodes[0]):
        call = g.call_module(name, tuple(body.inputs))
        for i, out in enumerate(body.outputs):
            item = g.call_function(operator.getitem, (call, i))
            item.meta = dict(out.meta)
            out.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
    for n in reversed(nodes):
        g.erase_node(n)


def _fresh(base: str, taken: set[str]) -> str:
    name, k = base, 1
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name
