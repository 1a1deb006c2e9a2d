"""A materialised causal mask handed to attention becomes `is_causal=True`.

Hugging Face models traced by torch.export build their causal mask as a tensor (under tracing
they cannot skip it, as they do in eager mode when no padding is given): `kv_idx <= q_idx` of two
`arange`s, broadcast to (B, 1, S, S), passed as `attn_mask` to every scaled_dot_product_attention.
Run as it is, that mask costs the fused kernels their causal skip (on an H200, cuDNN's attention of
a Llama layer at 4,096 tokens ran 3x slower forward and backward with the mask than with
`is_causal`), and context parallelism computes every K/V block whole under an additive copy of it.
The planner prices a causal kernel at the work it does (`shape_prop`), so the executor must run one.

What is rewritten: a boolean `attn_mask` that is a comparison of a key-position vector (varying
along the last dim) with a query-position vector (along the second last), through broadcasting
ops only, where both vectors depend on no input of the model (they are computed here, one value per
position: no S x S tensor is made) and the comparison gives exactly the lower triangle with its
diagonal for every query (key j visible to query i iff j <= i; queries and keys equal in number).
Anything else (a padding mask, a sliding window, a prefix, a float bias) is left as it is.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..compat import pytree, sym_hint

aten = torch.ops.aten

# ops that only broadcast or re-view a mask without changing which (query, key) pairs it allows
_BROADCASTS = {aten.expand.default, aten.unsqueeze.default, aten.view.default, aten.reshape.default,
               aten.alias.default, aten.clone.default, aten._to_copy.default}
# comparison -> (does it hold for equal positions, key on the left if it is "<"-like)
_COMPARISONS = {aten.le.Tensor: "le", aten.lt.Tensor: "lt", aten.ge.Tensor: "ge", aten.gt.Tensor: "gt"}
# a position vector longer than this is not evaluated (a mask of that many tokens per side)
_MAX_POSITIONS = 1 << 24


def causal_masks_as_flags(gm: fx.GraphModule) -> int:
    """Rewrite every attention whose mask is the plain causal one (module docstring); the number rewritten."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.scaled_dot_product_attention.default:
            done += _rewrite(node)
    if done:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return done


def _rewrite(node: fx.Node) -> bool:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    args = {**dict(zip(names, node.args)), **node.kwargs}
    mask = args.get("attn_mask")
    if not isinstance(mask, fx.Node) or args.get("is_causal") or not _is_causal(mask):
        return False
    q, k = (args[n].meta["val"] for n in ("query", "key"))
    if q.shape[-2] != k.shape[-2]:
        return False
    node.args = (args["query"], args["key"], args["value"])
    node.kwargs = {**{n: v for n, v in args.items() if n not in names[:4]}, "is_causal": True}
    return True


def _is_causal(mask: fx.Node) -> bool:
    val = mask.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != torch.bool or val.ndim < 2:
        return False
    while mask.op == "call_function" and mask.target in _BROADCASTS:
        inner = mask.args[0]
        if not isinstance(inner, fx.Node) or _last_two(inner) != _last_two(mask):   # (query, key) dims kept
            return False
        mask = inner
    if mask.op != "call_function" or mask.target not in _COMPARISONS:
        return False
    left, right = mask.args[:2]
    shapes = [getattr(a.meta.get("val"), "shape", None) if isinstance(a, fx.Node) else None for a in (left, right)]
    if None in shapes or len(shapes[0]) < 2 or len(shapes[1]) < 2:
        return False
    # which side holds the keys (varying along the last dim) and which the queries (the second last)
    along = [_only_dim(s) for s in shapes]
    op = _COMPARISONS[mask.target]
    if along == [-1, -2]:
        keys, queries, rel = left, right, op
    elif along == [-2, -1]:
        keys, queries, rel = right, left, {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt"}[op]
    else:
        return False
    if rel not in ("le", "lt"):
        return False
    kpos, qpos = _positions(keys), _positions(queries)
    if kpos is None or qpos is None or kpos.numel() != qpos.numel() or kpos.numel() < 2:
        return False
    if not bool((kpos[1:] > kpos[:-1]).all()):
        return False
    # keys visible to query i: a prefix of the increasing keys, of this length; causal iff it is i + 1
    visible = torch.searchsorted(kpos, qpos, right=rel == "le")
    return bool((visible == torch.arange(1, qpos.numel() + 1)).all())


def _last_two(node: fx.Node) -> tuple | None:
    shape = getattr(node.meta.get("val"), "shape", None)
    return tuple(shape[-2:]) if shape is not None and len(shape) >= 2 else None


def _only_dim(shape) -> int | None:
    """The one dim (-1 or -2) of `shape` longer than 1, every other of size 1; else None."""
    sizes = [sym_hint(s) if not isinstance(s, int) else s for s in shape]
    long = [d - len(sizes) for d, s in enumerate(sizes) if s != 1]
    return long[0] if len(long) == 1 and long[0] in (-1, -2) else None


def _positions(node: fx.Node) -> torch.Tensor | None:
    """The 1-D values of `node` if it is computed from constants alone (on the CPU); else None."""
    memo: dict[fx.Node, object] = {}

    def value(n):
        if not isinstance(n, fx.Node):
            return n
        if n in memo:
            return memo[n]
        val = n.meta.get("val")
        if val is not None and not isinstance(val, (torch.Tensor, list, tuple)):
            out = val if isinstance(val, (int, float, bool)) else sym_hint(val)     # a size
            if out is None:
                raise LookupError(n.name)
        elif n.op != "call_function" or not isinstance(val, torch.Tensor) or val.numel() > _MAX_POSITIONS:
            raise LookupError(n.name)
        else:
            args, kwargs = pytree.tree_map(value, (n.args, n.kwargs))
            kwargs = {**kwargs, "device": "cpu"} if "device" in kwargs else kwargs
            out = n.target(*args, **kwargs)
        memo[n] = out
        return out
    try:
        out = value(node)
    except LookupError:         # depends on an input, a parameter, or is too large: not a constant mask
        return None
    return out.reshape(-1) if isinstance(out, torch.Tensor) else None
