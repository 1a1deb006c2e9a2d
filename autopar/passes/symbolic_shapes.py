"""Symbolic shapes: every node's output shapes as expressions in batch `B` and sequence `S`.

The planner's graph is captured at the example's sizes (`capture`), so its shapes are numbers.
To price a plan at other sizes without tracing again, the model is captured once more by the
same code path with the batch and sequence dims of the inputs marked dynamic (torch.export
`Dim.AUTO`); that graph has the same nodes in the same order, and its fake tensors' sizes are
sympy expressions (`B*S`, `S - 1`, ...), which we map onto the planner's nodes.

Which input dims are which: dim 0 of every tensor input of the example's batch size is `B`;
dim 1 of every input (of 2+ dims) as long as the first integer input's dim 1 (token ids, masks,
labels) is `S`; without integer inputs, dim 1 of 3-D float inputs is `S` (embeddings). A model
whose code fixes a marked size (a position table sliced to a constant, `view(4, ...)`) keeps that
size a number, and `fixed` says so.

FLOPs of an op are a polynomial in its sizes (degree <= 2 in each: attention is quadratic in S),
found exactly by counting them (torch's FlopCounterMode, as for the planner) at 9 small sizes
and checked at a 10th.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from ..compat import pytree, sym_expr, sym_hint
from ..symbolic import BATCH, SEQ, SymbolicUnavailable
from ..errors import CaptureError
from .layers import layer_of, module_path
from .capture import Captured, capture
from .shape_prop import NodeInfo, TensorMeta, count_flops_at

__all__ = ["SymbolicGraph", "SymbolicUnavailable", "symbolic_graph"]

_log = logging.getLogger("autopar")


@dataclass(slots=True)
class SymbolicGraph:
    infos: dict[str, NodeInfo]          # node name -> shapes, FLOPs, bytes as expressions in B, S
    batch: int                          # the captured sizes
    seq: int | None
    fixed: tuple[str, ...] = ()         # "batch"/"seq" when the model's code fixes that size


def _marked_dims(args: tuple, kwargs: dict):
    """(dynamic_shapes spec for torch.export, {(input leaf index, dim): BATCH or SEQ}, batch, seq)."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.ndim >= 1]
    if not tensors:
        raise SymbolicUnavailable("the model takes no tensor inputs")
    batch = tensors[0].shape[0]
    tokens = [t for t in tensors if t.ndim >= 2 and not t.is_floating_point()]
    seq = tokens[0].shape[1] if tokens else next((t.shape[1] for t in tensors if t.ndim == 3), None)
    specs, marks = [], {}
    for i, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor) or t.ndim == 0:
            specs.append(None)
            continue
        d = {}
        if t.shape[0] == batch:
            d[0], marks[(i, 0)] = torch.export.Dim.AUTO, BATCH
        if seq is not None and t.ndim >= 2 and t.shape[1] == seq and (tokens or t.ndim == 3):
            d[1], marks[(i, 1)] = torch.export.Dim.AUTO, SEQ
        specs.append(d or None)
    a, k = pytree.tree_unflatten(specs, spec)
    return tuple(a) + tuple(k.values()), marks, int(batch), (int(seq) if seq is not None else None)


def _tensor_nodes(cap: Captured) -> list[fx.Node]:
    """Nodes that produce tensors, in order: the ones both captures share. Lifted tensor constants are
    left out: how many a trace lifts depends on the path its code takes (a sliding-window mask lifts
    more at variable sizes), and their sizes are constants (`_constant_metas`)."""
    out = []
    for n in cap.gm.graph.nodes:
        if n.op == "placeholder" and cap.inputs[n.name].kind == "constant":
            continue
        vals = pytree.tree_leaves(n.meta.get("val")) if n.op != "output" else []
        if any(isinstance(v, torch.Tensor) for v in vals):
            out.append(n)
    return out


def _identity_of(n: fx.Node) -> fx.Node | None:
    """The input a node merely passes on: its output has its first tensor input's shape at the
    captured sizes (a full slice, an alias, an expand to the same size). One trace may keep such
    a node where the other drops it."""
    ins = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    val = n.meta.get("val")
    if (ins and isinstance(val, torch.Tensor) and val.ndim == ins[0].meta["val"].ndim
            and all(sym_hint(x) == sym_hint(y) for x, y in zip(val.shape, ins[0].meta["val"].shape))):
        return ins[0]
    return None


def _align(static: list[fx.Node], dynamic: list[fx.Node]):
    """Pair each node of the static graph with its twin in the variable-size graph: the same ops
    in the same order, except ops that were identities at the captured sizes (`_identity_of`)."""
    def key(n):   # placeholders are named after their parameter: match them by position
        return "placeholder" if n.op == "placeholder" else n.target

    j = 0
    twin: dict[str, fx.Node] = {}
    for s in static:
        while j < len(dynamic) and key(dynamic[j]) != key(s) and _identity_of(dynamic[j]) is not None:
            j += 1
        src = _identity_of(s)
        if j < len(dynamic) and key(dynamic[j]) == key(s):
            twin[s.name] = dynamic[j]
            j += 1
        elif src is not None and src.name in twin:   # an identity only the static trace has
            twin[s.name] = twin[src.name]
        else:
            raise SymbolicUnavailable(f"tracing with variable sizes gave a different graph at node {s.name} "
                                      f"(the model's code branches on a size)")
        yield s, twin[s.name]


def symbolic_graph(model: torch.nn.Module, args: tuple, kwargs: dict | None, cap: Captured,
                   static_infos: dict[str, NodeInfo]) -> SymbolicGraph:
    """Shapes, FLOPs and bytes of `cap`'s nodes as expressions in B and S (raises SymbolicUnavailable).

    A deep stack of identical layers (a ModuleList of 4+ blocks whose graph sections match) is
    traced with its first two blocks only, and the others take the second block's shapes
    (tracing with variable sizes is ~2.5x slower than `capture`; a 32-layer 8B model would add
    8 s). A model the short stack does not fit is traced whole."""
    args = args if isinstance(args, tuple) else (args,)
    kwargs = dict(kwargs or {})
    dyn, marks, batch, seq = _marked_dims(args, kwargs)
    static = _tensor_nodes(cap)
    stacks = _stacks(model, cap, static)
    if stacks:
        try:
            with _short_stacks(model, stacks):
                dcap = capture(model, args, kwargs, dynamic_shapes=dyn)
            return _build(cap, static_infos, dcap, marks, batch, seq, _short_pairs(cap, static, dcap, stacks))
        except (SymbolicUnavailable, CaptureError) as e:
            _log.warning("symbolic sizes: the short trace of %s (%d blocks of %s) did not fit (%s); tracing "
                         "every layer, which is slower", type(model).__name__, _KEEP, ", ".join(stacks),
                         str(e).splitlines()[0][:200])
    try:
        dcap = capture(model, args, kwargs, dynamic_shapes=dyn)
    except CaptureError as e:    # a model that only traces at fixed sizes has no scaling
        raise SymbolicUnavailable(f"the model does not trace with a variable batch/sequence size: "
                                  f"{str(e).splitlines()[0][:200]}") from e
    return _build(cap, static_infos, dcap, marks, batch, seq, list(_align(static, _tensor_nodes(dcap))))


_KEEP = 2     # blocks traced of a long stack: the first, and one that stands for all the others


def _stacks(model: torch.nn.Module, cap: Captured, static: list[fx.Node]) -> dict[str, int]:
    """ModuleList path -> length, for stacks of 4+ blocks whose graph sections are alike."""
    counts: dict[str, dict[int, int]] = {}
    for n in static:
        where = layer_of(module_path(n, cap))
        if where is not None:
            counts.setdefault(where[0], {}).setdefault(where[1], 0)
            counts[where[0]][where[1]] += 1
    out = {}
    for path, per in counts.items():
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            continue
        if (isinstance(mod, torch.nn.ModuleList) and len(mod) > _KEEP + 1 and sorted(per) == list(range(len(mod)))
                and len(set(per.values())) == 1):
            out[path] = len(mod)
    return out


@contextlib.contextmanager
def _short_stacks(model: torch.nn.Module, stacks: dict[str, int]):
    """Temporarily keep the first `_KEEP` blocks of each stack (the user's model is restored)."""
    saved = []
    try:
        for path in stacks:
            parent_path, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            full = getattr(parent, name)
            saved.append((parent, name, full))
            setattr(parent, name, torch.nn.ModuleList(list(full)[:_KEEP]))
        yield
    finally:
        for parent, name, full in reversed(saved):
            setattr(parent, name, full)


def _short_pairs(cap: Captured, static: list[fx.Node], dcap: Captured, stacks: dict[str, int]):
    """(static node, node of the short trace) for every static node: blocks 0 and 1 pair with the
    short trace's blocks 0 and 1, the other blocks with block 1's nodes (their sections match)."""
    def block(n):
        where = layer_of(module_path(n, cap))
        return (where[0], where[1]) if where is not None and where[0] in stacks else None

    kept, inner = [], {}
    for n in static:
        b = block(n)
        if b is None or b[1] < _KEEP:
            kept.append(n)
        inner.setdefault(b, []).append(n)
    pairs = list(_align(kept, _tensor_nodes(dcap)))
    twin = {s.name: d for s, d in pairs}
    for b, nodes in inner.items():
        if b is None or b[1] < _KEEP:
            continue
        for n, m in zip(nodes, inner[(b[0], 1)]):
            pairs.append((n, twin[m.name]))
    return pairs


def _build(cap: Captured, static_infos, dcap: Captured, marks, batch: int, seq: int | None, pairs) -> SymbolicGraph:
    # which export symbol stands for B or S: read off the user-input placeholders
    subs: dict[sympy.Symbol, sympy.Expr] = {}
    for n in dcap.gm.graph.nodes:
        if n.op != "placeholder" or dcap.inputs[n.name].kind != "input":
            continue
        val = n.meta.get("val")
        for dim in (0, 1):
            want = marks.get((dcap.inputs[n.name].target, dim))
            if want is not None and isinstance(val.shape[dim], torch.SymInt):
                e = sym_expr(val.shape[dim])
                if isinstance(e, sympy.Symbol):
                    subs.setdefault(e, want)
    fixed = tuple(name for name, sym in (("batch", BATCH), ("seq", SEQ))
                  if (sym is SEQ and seq is None) or sym not in subs.values())
    sizes = {BATCH: sympy.Integer(batch), SEQ: sympy.Integer(seq if seq is not None else 1)}
    metas: dict[str, tuple[TensorMeta, ...]] = {}
    converted: dict = {}
    for s, d in pairs:
        if d.name not in converted:
            converted[d.name] = _metas(d, subs)
        out = converted[d.name]
        got = tuple(tuple(int(x.xreplace(sizes)) for x in m.shape) for m in out)
        want = tuple(m.shape for m in static_infos[s.name].out)
        if got != want:
            raise SymbolicUnavailable(f"node {s.name}: symbolic shape {[m.shape for m in out]} does not give the "
                                      f"captured {want}")
        metas[s.name] = out
    metas.update(_constant_metas(cap, static_infos))
    infos: dict[str, NodeInfo] = {}
    cache: dict = {}
    for n in cap.gm.graph.nodes:
        info = static_infos[n.name]
        out = metas.get(n.name, ())
        ins = {a.name: metas[a.name] for a in info.ins if a.name in metas}
        nbytes = sum(m.nbytes for m in out) + (sum(metas[a.name][0].nbytes for a in info.ins if a.name in metas)
                                                if n.op == "call_function" else 0)
        flops = _flops(n, ins, cache) if info.flops else sympy.Integer(0)
        infos[n.name] = NodeInfo(n.name, out, info.ins, flops, nbytes)
    return SymbolicGraph(infos, batch, seq, fixed)


def _constant_metas(cap: Captured, static_infos) -> dict[str, tuple[TensorMeta, ...]]:
    """The lifted tensor constants' metas: their captured sizes, which no input size changes."""
    return {n.name: tuple(TensorMeta(tuple(sympy.Integer(x) for x in m.shape), m.dtype)
                          for m in static_infos[n.name].out)
            for n in cap.gm.graph.nodes if n.op == "placeholder" and cap.inputs[n.name].kind == "constant"}


def _metas(d: fx.Node, subs) -> tuple[TensorMeta, ...]:
    out = []
    for t in pytree.tree_leaves(d.meta.get("val")):
        if not isinstance(t, torch.Tensor):
            continue
        shape = tuple(sympy.expand(sym_expr(x).xreplace(subs)) for x in t.shape)
        unknown = set().union(*(x.free_symbols for x in shape)) - {BATCH, SEQ}
        if unknown:
            raise SymbolicUnavailable(f"node {d.name}: a size depends on data or on another input "
                                      f"({', '.join(map(str, unknown))})")
        out.append(TensorMeta(shape, t.dtype))
    return tuple(out)


# sizes at which FLOPs are counted to fit a polynomial of degree <= 2 in B and in S, and a check
_FIT = (2, 3, 5)
_CHECK = (7, 11)
_MONOMIALS = [BATCH ** i * SEQ ** j for i in range(3) for j in range(3)]


def _flops(node: fx.Node, ins: dict[str, tuple[TensorMeta, ...]], cache: dict) -> sympy.Expr:
    """FLOPs of an op as a polynomial in B and S, exact (counted at 9 sizes, checked at a 10th)."""
    key = (node.target, tuple(ins.values()), str(pytree.tree_map(lambda a: None if isinstance(a, fx.Node) else a,
                                                                 (node.args, node.kwargs))))
    if key in cache:
        return cache[key]

    def at(b: int, s: int) -> int:
        env = {BATCH: b, SEQ: s}
        shapes = {k: tuple(tuple(int(x.subs(env)) for x in m.shape) for m in v) for k, v in ins.items()}
        return round(count_flops_at(node, shapes))

    points = list(itertools.product(_FIT, _FIT))
    rows = sympy.Matrix([[m.subs({BATCH: b, SEQ: s}) for m in _MONOMIALS] for b, s in points])
    coef = rows.LUsolve(sympy.Matrix([at(b, s) for b, s in points]))
    poly = sympy.expand(sum(c * m for c, m in zip(coef, _MONOMIALS)))
    if poly.subs({BATCH: _CHECK[0], SEQ: _CHECK[1]}) != at(*_CHECK):
        raise SymbolicUnavailable(f"node {node.name}: FLOPs are not a polynomial of degree <= 2 in the sizes")
    cache[key] = poly
    return poly
