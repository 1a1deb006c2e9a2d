"""Capture a deep stack of identical blocks by tracing three of them, once proven alike.

Tracing costs about the same for every block (a 32-layer 8B model: ~0.2 s a block of the 6.5 s
export). A model whose blocks are alike (a ModuleList of 4+ blocks of one class, with the same
parameter shapes and the same attributes but their index, no hooks, no buffers) is traced with
its first two blocks and its last one (in block 2's place); the graph of the last traced block is
then copied for each block not traced, its parameters swapped for that block's and its input taken
from the block before, and what came after the stack reads the last block's results. The copy is
exact when a block's computation depends only on its own attributes, parameters and inputs (not on
its position in the stack). That is proven, not assumed, before copying:

* code: every module of a block is of the same class, an object attribute (a method of its own, an
  instance `forward`) is the same object in every block, and block 1 and the deepest block give the
  same graph section (ops, shapes, constant arguments, wiring);
* constants: every attribute is equal across the blocks, but those holding the block's index
  (`layer_idx`; Hugging Face's per-layer kinds, `attention_type`, `sliding_window`, are compared);
  the index is swapped, in the traced blocks, for a watched index that records any use (a
  comparison, arithmetic, hashing, indexing, formatting; not a transformers KV cache finding the
  layer's slot, `UNRECORDED`). A block whose code reads its index, and
  so may branch on it for some middle blocks only (`if 10 <= self.layer_idx < 20`), is traced
  whole; so is one whose index reaches a torch op (the watched index is no int there: the short
  trace fails).

Blocks of a few kinds in a fixed order (Gemma-2's sliding-window and global layers alternate) are
alike every p blocks: the stack is traced as its first two periods and its last (3p blocks, p dividing
the stack), checked period against period, and block j copied from the traced block of the last
period at j's place in its period.

What was used is `Captured.trace` ("short: ..." or "whole: <why>"), shown in the plan's report.

Node names follow fx's namespace as the copies are made (`linear_7` of block 1 becomes the next
free `linear_N`), so they differ from a whole trace's; every caller of `capture` gets the same
graph, names included.
"""
from __future__ import annotations

import contextlib
import functools
import re
import sys
import types
from collections.abc import Callable

import torch
import torch.fx as fx

from ..compat import has_module_hooks
from .captured import Captured
from .layers import layer_of, module_path

TRACED = 3      # periods traced: the first (its input differs), and two to check that periods repeat


def deep_stack(model: torch.nn.Module) -> tuple[str, int] | None:
    """(path, period) of the model's one ModuleList of more than `TRACED` periods of alike blocks
    (None: none, or several)."""
    found = {name: period for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) > TRACED and (period := _period(list(m)))}
    outer = [p for p in found if not any(p.startswith(q + ".") for q in found if q != p)]
    return (outer[0], found[outer[0]]) if len(outer) == 1 else None


def _period(blocks: list[torch.nn.Module]) -> int | None:
    """The smallest p such that block i is alike block i + p (one structure, attributes equal but for
    those that hold the block's index): 1 where all blocks are alike, 2 for Gemma-2's alternating
    sliding-window and global layers. A period above 1 must divide the stack (the model's own loop
    may pick a block's inputs by its position, `config.layer_types[i]`: the deepest period, traced in
    the place of the third, then sits where blocks of its kinds sit) and repeat more than `TRACED`
    times. None: no such period."""
    described = [_description(b) for b in blocks]
    if any(d is None for d in described):
        return None
    index = _index_attributes(described)
    kinds = [(d[0], {k: v for k, v in d[1].items() if k not in index}) for d in described]
    n = len(blocks)
    for p in range(1, (n - 1) // TRACED + 1):
        if (p == 1 or n % p == 0) and all(kinds[i] == kinds[i - p] for i in range(p, n)):
            return p
    return None


def _index_attributes(described: list) -> set[tuple[str, str]]:
    """(module, attribute) of the attributes that hold each block's own index."""
    return {k for k, v in described[0][1].items()
            if all(type(d[1].get(k)) is int and d[1][k] == i for i, d in enumerate(described))}


def _description(block: torch.nn.Module) -> tuple[tuple, dict] | None:
    """A block's structure (module types, parameter shapes) and its attributes by (module, name):
    everything of a block its graph can depend on but its input (None: a block with buffers or
    hooks, which are not copied)."""
    if any(True for _ in block.buffers()):
        return None
    structure, attrs = [], {}
    for name, m in block.named_modules():
        if has_module_hooks(m):
            return None
        for k, v in vars(m).items():
            if not k.startswith("_"):
                attrs[(name, k)] = _value(v, m)
        params = tuple((k, tuple(p.shape), p.dtype, p.requires_grad) for k, p in m.named_parameters(recurse=False))
        structure.append((name, type(m), params))
    return tuple(structure), attrs


def _value(v, owner: torch.nn.Module):
    """An attribute as compared across blocks: a plain value itself; a `functools.partial` by its
    function and arguments, a method bound to its own module by its function (transformers' GELUTanh
    makes one of either per block); any other object by identity."""
    if isinstance(v, (int, float, str, bool, type(None), tuple)):
        return v
    if isinstance(v, functools.partial):
        return ("partial", _value(v.func, owner), tuple(_value(a, owner) for a in v.args),
                tuple(sorted((k, _value(a, owner)) for k, a in v.keywords.items())))
    if isinstance(v, types.MethodType) and v.__self__ is owner:
        return ("method", id(v.__func__))
    return id(v)


class WatchedIndex:
    """A block's index attribute during the short trace: the int it stands for, every use recorded in
    `uses`. Deliberately not an int: handed to a torch op it fails the short trace (traced whole)."""
    __slots__ = ("value", "uses", "where")

    def __init__(self, value: int, uses: list, where: str):
        self.value, self.uses, self.where = value, uses, where


# code whose reads of a layer's index do not shape the graph: a transformers KV cache finding the
# layer's slot (the cache is dropped from a training step; each layer stores into it alike)
UNRECORDED = ("transformers.cache_utils",)


def _watched(method: str):
    def use(self, *args):
        if sys._getframe(1).f_globals.get("__name__") not in UNRECORDED:
            self.uses.append(f"{self.where} ({method})")
        return getattr(self.value, method)(*(a.value if isinstance(a, WatchedIndex) else a for a in args))
    return use


for _m in ("__index__", "__int__", "__float__", "__bool__", "__hash__", "__eq__", "__ne__", "__lt__", "__le__",
           "__gt__", "__ge__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__",
           "__rfloordiv__", "__truediv__", "__rtruediv__", "__mod__", "__rmod__", "__divmod__", "__pow__", "__neg__",
           "__pos__", "__abs__", "__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__lshift__",
           "__rshift__", "__invert__", "__format__", "__str__", "__repr__", "__round__", "__trunc__"):
    setattr(WatchedIndex, _m, _watched(_m))


@contextlib.contextmanager
def traced_blocks(model: torch.nn.Module, path: str, period: int = 1):
    """The model with its stack cut to its first `TRACED - 1` periods and its last (restored after);
    the last runs in the place of period `TRACED - 1` (its parameters named so in the trace). Yields
    (the stack's depth, the uses of the traced blocks' index attributes, filled as the trace runs)."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    full = getattr(parent, name)
    blocks = list(full)
    index = sorted(_index_attributes([_description(b) for b in blocks]))
    traced = list(range((TRACED - 1) * period)) + list(range(len(blocks) - period, len(blocks)))
    uses: list[str] = []
    swapped = [(blocks[i].get_submodule(mod), attr) for i in traced for mod, attr in index]
    # the last traced one is the stack's deepest block: what it computes, checked equal to block 1's,
    # stands for every block between once no block reads its index
    setattr(parent, name, torch.nn.ModuleList([blocks[i] for i in traced]))
    for m, attr in swapped:
        object.__setattr__(m, attr, WatchedIndex(getattr(m, attr), uses, f"{type(m).__name__}.{attr}"))
    try:
        yield len(full), uses
    finally:
        for m, attr in swapped:
            object.__setattr__(m, attr, getattr(m, attr).value)
        setattr(parent, name, full)


def expand(cap: Captured, path: str, depth: int, is_param: Callable[[str], bool], period: int = 1) -> str | None:
    """Copy the last traced period of stack `path` until it is `depth` blocks deep, in place (block j
    a copy of the traced block of the last period at j's place in its period; `cap.inputs` gains the
    new parameters). Returns why it cannot (nothing changed), or None."""
    gm, inputs = cap.gm, cap.inputs
    sections, params = _sections(cap, path, TRACED * period)
    why = _check(sections, params, inputs, gm, period)
    if why is not None:
        return why
    first = (TRACED - 1) * period        # block j is a copy of block `first + j % period`
    last = TRACED * period - 1
    if not all(is_param(_renumber(inputs[p.name].target, path, first + j % period, j)) for j in range(last + 1, depth)
               for p in params[first + j % period] if inputs[p.name].kind == "param"):
        return "the blocks not traced do not hold parameters of their own named like the traced ones"
    tail = {n: i for i, n in enumerate(sections[last])}
    made: set[fx.Node] = set()
    block = sections[last]
    anchors = {inputs[p.name].kind: p for p in params[last]}     # the last placeholder of each kind
    for j in range(last + 1, depth):
        t = first + j % period
        own = {}
        for p in params[t]:
            kind = inputs[p.name].kind
            anchors[kind] = own[p] = _new_input(cap, anchors[kind], p, path, t, j)
        block = _copy_block(gm.graph, sections[t], block, sections[t - 1], own, path, t, j)
        made.update(block)
    for n in sections[last]:      # what comes after the stack reads the deepest block (a copy of `last`)
        for u in [u for u in n.users if u not in tail and u not in made]:
            u.replace_input_with(n, block[tail[n]])
    # `cap.inputs` in the graph's placeholder order, as capture gives it (callers feed the program
    # positionally in that order)
    order = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    slots = {k: inputs[k] for k in order}
    inputs.clear()
    inputs.update(slots)
    gm.recompile()
    return None


def _new_input(cap: Captured, after: fx.Node, p: fx.Node, path: str, t: int, j: int) -> fx.Node:
    """Block j's placeholder for traced block t's parameter or constant placeholder p, after `after`."""
    with cap.gm.graph.inserting_after(after):
        q = cap.gm.graph.placeholder(_renumber(p.name, path, t, j, sep="_"))
    q.meta = dict(p.meta)
    slot = cap.inputs[p.name]
    cap.inputs[q.name] = type(slot)(slot.kind, _renumber(slot.target, path, t, j))
    if slot.kind == "constant":
        cap.constants[cap.inputs[q.name].target] = cap.constants[slot.target]
    return q


def _copy_block(g: fx.Graph, model_block: list[fx.Node], previous: list[fx.Node], model_prev: list[fx.Node],
                own: dict, path: str, t: int, j: int) -> list[fx.Node]:
    """Block j: `model_block`'s (traced block t's) nodes copied after `previous` (block j - 1),
    reading it where `model_block` reads `model_prev`, and block j's parameters `own`."""
    inside = {n: i for i, n in enumerate(model_block)}
    before = {n: i for i, n in enumerate(model_prev)}
    made: list[fx.Node] = []

    def arg(a: fx.Node) -> fx.Node:
        if a in inside:
            return made[inside[a]]
        return previous[before[a]] if a in before else own.get(a, a)

    at = previous[-1]
    for n in model_block:
        with g.inserting_after(at):
            at = g.node_copy(n, arg)
        at.meta = _renumbered_meta(n.meta, path, t, j)
        made.append(at)
    return made


def _sections(cap: Captured, path: str, traced: int):
    """Per traced block: its ops in order, and its placeholders."""
    sections: list[list[fx.Node]] = [[] for _ in range(traced)]
    params: list[list[fx.Node]] = [[] for _ in range(traced)]
    for n in cap.gm.graph.nodes:
        where = layer_of(module_path(n, cap))
        if where is None or where[0] != path:
            continue
        (params if n.op == "placeholder" else sections)[where[1]].append(n)
    return sections, params


def _check(sections, params, inputs: dict, gm: fx.GraphModule, period: int) -> str | None:
    """Why the last traced period cannot stand for the others (None: it can)."""
    if any(not s for s in sections) or any(not p for p in params):
        return "a traced block has no ops or no parameters"
    for ps in params[-period:]:
        kinds = [inputs[p.name].kind for p in ps]
        if kinds != sorted(kinds, reverse=True):
            return "a block's parameters and constants are not in that order"
    if any(inputs[p.name].kind not in ("param", "constant") for ps in params for p in ps):
        return "a block reads a buffer"
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    span = [order[n] for s in sections for n in s]
    if span != list(range(span[0], span[0] + len(span))):
        return "the blocks' ops are not one run of the graph, block after block"
    if any(n.op != "call_function" for s in sections for n in s):
        return "a block holds a node other than an op call"
    early = {n for s in sections[:-1] for n in s}
    if any(u not in early and order[u] > span[-1] for n in early for u in n.users):
        return "the ops after the stack read a block other than the last"
    sigs = [[_wiring(sections[i], sections[i - 1], params[i]) for i in range(k * period, (k + 1) * period)]
            for k in (TRACED - 2, TRACED - 1)]
    return None if sigs[0] == sigs[1] else "period 1 and the deepest period trace to different graphs"


def _wiring(section: list[fx.Node], prev: list[fx.Node], params: list[fx.Node]) -> tuple:
    """A block's graph with its own nodes, the block before's and its parameters by position; any
    other input (rotary tables, masks) by name: it must be the same node for every block."""
    own = {n: i for i, n in enumerate(section)}
    back = {n: i for i, n in enumerate(prev)}
    mine = {n: i for i, n in enumerate(params)}

    def arg(a):
        if isinstance(a, fx.Node):
            return ("own", own[a]) if a in own else ("prev", back[a]) if a in back else (
                ("param", mine[a]) if a in mine else ("ext", a.name))
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, arg(v)) for k, v in sorted(a.items()))
        return repr(a)

    def meta(n):
        vals = n.meta.get("val")
        vals = vals if isinstance(vals, (list, tuple)) else (vals,)
        return tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v) for v in vals)

    return tuple((n.target, arg(n.args), arg(n.kwargs), meta(n), len(n.users) > 0) for n in section)


def _renumber(text: str, path: str, old: int, new: int, sep: str = ".") -> str:
    """`model.layers.2.mlp` -> `model.layers.7.mlp` (sep "_": placeholder names, `p_model_layers_2_...`)."""
    stem = path.replace(".", sep)
    return re.sub(re.escape(f"{stem}{sep}{old}") + f"(?=$|{re.escape(sep)})", f"{stem}{sep}{new}", text)


def _renumbered_meta(meta: dict, path: str, old: int, new: int) -> dict:
    out = dict(meta)
    stack = meta.get("nn_module_stack")
    if stack:
        out["nn_module_stack"] = {_renumber(k, path, old, new): (_renumber(v[0], path, old, new), *v[1:])
                                  for k, v in stack.items()}
    return out
