"""Pipeline stages: which model chunk each node of a graph runs in, and the graph cut into chunks.

A `PipelinePlan` names where each chunk starts (`boundaries[c]`: "" for the first chunk, a layer
such as "blocks.4" for the others; `passes/layers.py` says what a layer is). `chunk_of` is the one
partition: the planner prices a pipeline with it on the captured graph and the runtime cuts the
rank graph with it, whose nodes carry the same module paths.

* a node inside a layer runs in the chunk that layer falls in (the last boundary at or before it);
* a node outside every layer runs in the chunk of the next layer node after it in graph order
  (the embedding before `blocks.0`), or in the last chunk when no layer node follows (the head
  and the loss);
* a node never runs in an earlier chunk than a node it reads (a value flows forward only): a
  node the rules above would put earlier is moved to its latest input's chunk.
Placeholders (parameters, buffers, user inputs) belong to no chunk: every chunk reads the ones
it uses where it runs.

`cut` splits a graph by the partition. Chunk c receives every value made in an earlier chunk and
read in chunk c or later (values a later chunk needs are relayed through the chunks between), and
returns every value made so far that a later chunk reads; the last chunk returns the graph's
outputs.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..compat import pytree
from ..errors import PlanOptionError
from ..plan_records import PipelinePlan
from .layers import layer_key, module_path


def layer_sequence(graph: fx.Graph) -> list[str]:
    """The layers of a graph ("blocks.0", "blocks.1", ...) in the order their first node runs."""
    return _in_order(_layer_keys(_calls(graph)))


def _calls(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]


def _layer_keys(calls: Sequence[fx.Node]) -> list[str | None]:
    """Each call node's layer (None outside every layer)."""
    return [layer_key(module_path(n)) for n in calls]


def _in_order(keys: Sequence[str | None]) -> list[str]:
    return list(dict.fromkeys(k for k in keys if k is not None))


def even_boundaries(layers: Sequence[str], chunks: int) -> tuple[str, ...]:
    """Boundaries cutting `layers` into `chunks` runs of consecutive layers as even as can be; where
    they cannot be equal the earlier chunks take one more layer (the last chunk also runs the head
    and the loss). An error naming `pipeline.stages` when there are fewer layers than chunks."""
    if chunks < 1 or len(layers) < chunks:
        raise PlanOptionError(f"pipeline.stages x pipeline.virtual_stages = {chunks} chunks, but the model has "
                              f"{len(layers)} repeated layers ({', '.join(layers[:4]) or 'none'}"
                              f"{', ...' if len(layers) > 4 else ''}): a chunk needs at least one layer; "
                              f"use fewer stages or virtual stages")
    base, extra = divmod(len(layers), chunks)
    starts, at = [], 0
    for c in range(chunks):
        starts.append(at)
        at += base + (1 if c < extra else 0)
    return ("",) + tuple(layers[s] for s in starts[1:])


def chunk_of(graph: fx.Graph, pipeline: PipelinePlan) -> dict[fx.Node, int]:
    """Every call node of `graph` -> the chunk it runs in (see module docstring)."""
    calls = _calls(graph)
    keys = _layer_keys(calls)
    layers = _in_order(keys)        # `layer_sequence(graph)`, from the keys the loop below reads too
    position = {k: i for i, k in enumerate(layers)}
    starts = [0]
    for c, b in enumerate(pipeline.boundaries[1:], start=1):
        if b not in position:
            raise PlanOptionError(f"pipeline.boundaries[{c}] = {b!r} is not a layer of this model; layers: "
                                  f"{', '.join(layers[:6])}{', ...' if len(layers) > 6 else ''}")
        starts.append(position[b])
    if starts != sorted(starts) or len(set(starts)) != len(starts):
        raise PlanOptionError(f"pipeline.boundaries {list(pipeline.boundaries)} do not run in layer order")
    out: dict[fx.Node, int] = {}
    following = max(pipeline.chunks, 1) - 1
    for node, key in zip(reversed(calls), reversed(keys)):
        if key is not None:     # the last chunk starting at or before the layer (`starts` increase)
            following = bisect_right(starts, position[key]) - 1
        out[node] = following
    for node in calls:   # forward flow only
        out[node] = max([out[node]] + [out[a] for a in node.all_input_nodes if a in out])
    return out


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of a cut graph: `module(*received, *placeholders)` returns `sent` (a tuple), or
    the graph's outputs for the last chunk."""
    index: int
    module: fx.GraphModule
    received: tuple[str, ...]        # names of the values it receives from the chunk before it
    placeholders: tuple[str, ...]    # names of the graph's placeholders it reads
    sent: tuple[str, ...]            # names of the values it passes to the chunk after it


def cut(gm: fx.GraphModule, part: Mapping[fx.Node, int], chunks: int) -> list[Chunk]:
    """`gm` split into `chunks` GraphModules by the partition `part` (from `chunk_of`)."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    last_use: dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        for a in n.all_input_nodes:
            if a.op != "placeholder":
                use = chunks - 1 if n.op == "output" else part[n]
                last_use[a] = max(last_use.get(a, -1), use)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    made_before: list[fx.Node] = []
    result = []
    for c in range(chunks):
        received = [n for n in made_before if last_use.get(n, -1) >= c]
        mine = [n for n in nodes if part[n] == c]
        made_before = received + mine
        sent = [n for n in made_before if last_use.get(n, -1) > c] if c < chunks - 1 else []
        result.append(_chunk_module(gm, c, received, mine, sent, out_node if c == chunks - 1 else None))
    return result


def _chunk_module(gm: fx.GraphModule, c: int, received: list[fx.Node], mine: list[fx.Node],
                  sent: list[fx.Node], out_node: fx.Node | None) -> Chunk:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in received:
        env[n] = g.placeholder(n.name)
        env[n].meta = dict(n.meta)
    used = [p for p in gm.graph.nodes if p.op == "placeholder"
            and any(u in mine or u is out_node for u in p.users)]
    for p in used:
        env[p] = g.placeholder(p.name)
        env[p].meta = dict(p.meta)
    root = torch.nn.Module()
    for n in mine:
        env[n] = g.node_copy(n, lambda a: env[a])
        if n.op == "call_module":
            root.add_module(n.target, gm.get_submodule(n.target))
    if out_node is not None:
        g.output(fx.map_arg(out_node.args[0], lambda a: env[a]))
    else:
        g.output(tuple(env[n] for n in sent))
    return Chunk(c, fx.GraphModule(root, g, class_name=f"AutoparChunk{c}"), tuple(n.name for n in received),
                 tuple(p.name for p in used), tuple(n.name for n in sent))


def microbatch(args: tuple, kwargs: dict | None, microbatches: int, index: int = 0) -> tuple[tuple, dict]:
    """Microbatch `index` of one step's inputs: every tensor whose dim 0 is the batch (the first
    tensor input's dim 0) cut into `microbatches` equal slices; other inputs as they are. An error
    naming `pipeline.microbatches` when the batch does not divide."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.ndim >= 1]
    if microbatches == 1 or not tensors:
        return tuple(args), dict(kwargs or {})
    batch = tensors[0].shape[0]
    if batch % microbatches:
        raise PlanOptionError(f"pipeline.microbatches = {microbatches} does not divide the batch of {batch}: "
                              f"give a divisor of {batch}")
    size = batch // microbatches

    def cut_one(t):
        is_batch = isinstance(t, torch.Tensor) and t.ndim >= 1 and t.shape[0] == batch
        return t[index * size:(index + 1) * size] if is_batch else t
    return pytree.tree_unflatten([cut_one(t) for t in leaves], spec)


__all__ = ["layer_sequence", "even_boundaries", "chunk_of", "cut", "Chunk", "microbatch"]
