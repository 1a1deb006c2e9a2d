"""Annotate every node with what the cost model needs: output shapes/dtypes, FLOPs, bytes moved.

Shapes come from the fake tensors torch.export left in `node.meta["val"]`. FLOPs come from
torch's own `FlopCounterMode`, run on meta tensors of the node's global shapes (so nothing is
allocated), with our formula for ops its registry lacks (CPU flash attention).

    >>> info = annotate(captured.gm)
    >>> info["linear"].flops          # 2 * B*T * in * out
"""
from __future__ import annotations

import logging

import math
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode

from ..compat import OpOverload, pytree

_log = logging.getLogger("autopar")

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(slots=True)
class NodeInfo:
    name: str
    out: tuple[TensorMeta, ...]          # one entry per tensor output (a single tensor: length 1)
    ins: tuple[fx.Node, ...]             # tensor-valued input nodes, in pytree order of (args, kwargs)
    flops: float
    bytes_moved: float                   # inputs read + outputs written, at global size

    @property
    def main(self) -> TensorMeta | None:
        return self.out[0] if self.out else None


def tensor_meta(val) -> tuple[TensorMeta, ...]:
    leaves = pytree.tree_leaves(val)
    return tuple(TensorMeta(tuple(int(s) for s in t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor))


def tensor_inputs(node: fx.Node) -> tuple[fx.Node, ...]:
    """Tensor-producing input nodes in the order a strategy lists its input placements."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return tuple(a for a in leaves if isinstance(a, fx.Node) and tensor_meta(a.meta.get("val")))


def _sdpa_flops(q: TensorMeta, k: TensorMeta, v: TensorMeta, is_causal: bool = False) -> float:
    # QK^T and PV: two batched matmuls of (..., Sq, D) x (..., D, Sk); softmax is negligible. Under
    # is_causal the fused kernels compute only the (query, key) pairs the mask keeps: query i sees keys
    # 0..i (torch's top-left aligned causal mask), sum of min(i + 1, Sk) over the Sq queries
    batch = math.prod(q.shape[:-2])
    sq, sk = q.shape[-2], k.shape[-2]
    pairs = sq * sk if not is_causal else min(sq, sk) * (min(sq, sk) + 1) // 2 + max(sq - sk, 0) * sk
    return 2.0 * batch * pairs * (q.shape[-1] + v.shape[-1])


def _to_meta(x, shapes=None):
    if isinstance(x, fx.Node):
        val = x.meta.get("val")
        if shapes is not None and x.name in shapes:   # the same tensors at other sizes
            sizes = iter(shapes[x.name])
            return pytree.tree_map(
                lambda t: torch.empty(next(sizes), dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor)
                else t, val)
        return pytree.tree_map(
            lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t, val)
    return x


def count_flops(node: fx.Node) -> float:
    return count_flops_at(node, None)


def count_flops_at(node: fx.Node, shapes: dict[str, tuple[tuple[int, ...], ...]] | None) -> float:
    """FLOPs of a node, its tensor inputs at their captured shapes or at `shapes` (name -> shapes)."""
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return 0.0
    args, kwargs = pytree.tree_map(lambda x: _to_meta(x, shapes), (node.args, node.kwargs))
    if node.target is aten.scaled_dot_product_attention.default:
        q, k, v = (TensorMeta(tuple(t.shape), t.dtype) for t in args[:3])
        return _sdpa_flops(q, k, v, bool(node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False)))
    try:
        with FlopCounterMode(display=False) as fc:
            node.target(*args, **kwargs)
        return float(fc.get_total_flops())
    except Exception as e:  # noqa: BLE001 - any op's meta kernel may fail; the op is then priced by bytes only
        _log.warning("FLOPs of %s (%s) not counted, its meta kernel failed (%s: %s): priced by bytes moved",
                     node.name, node.target, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        return 0.0


def annotate(gm: fx.GraphModule) -> dict[str, NodeInfo]:
    flops: dict = {}     # op signature -> FLOPs: a model's repeated layers count each op once
    metas: dict = {}     # node -> `tensor_meta` of its value: worked out once, read by the node and its users
    return {node.name: annotate_node(node, flops, metas) for node in gm.graph.nodes}


def annotate_node(node: fx.Node, flops: dict, metas: dict) -> NodeInfo:
    """A node's shapes, FLOPs and bytes; `flops` caches FLOPs by op signature, `metas` nodes' tensor metas."""
    def meta(a: fx.Node) -> tuple[TensorMeta, ...]:
        if a not in metas:
            metas[a] = tensor_meta(a.meta.get("val"))
        return metas[a]
    out = meta(node) if node.op != "output" else ()
    ins = tuple(a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node) and meta(a))
    nbytes = sum(m.nbytes for m in out) + sum(meta(a)[0].nbytes for a in ins if node.op == "call_function")
    if node.op != "call_function":
        return NodeInfo(node.name, out, ins, 0.0, float(nbytes))
    key = _signature(node, meta)
    if key not in flops:
        flops[key] = count_flops(node)
    return NodeInfo(node.name, out, ins, flops[key], float(nbytes))


def _signature(node: fx.Node, meta) -> tuple:
    """What an op's FLOPs depend on: the op, its arguments with each tensor as its shapes and
    dtypes (`meta`: a node's `tensor_meta`), any other value a node gives as itself (FlopCounterMode
    counts from these alone)."""
    def arg(a):
        if not isinstance(a, fx.Node):
            return a
        return ("tensors", metas) if (metas := meta(a)) else ("value", repr(a.meta.get("val")))
    return node.target, repr(pytree.tree_map(arg, (node.args, node.kwargs)))
