"""Repeated layers: the copies of a block share one set of decision variables.

A transformer's 96 blocks are the same computation on the same shapes. Their decisions are
tied: block i's k-th decision uses block 1's variables (blocks 0 and 95, whose neighbours
differ, stay free), so the ILP is about three blocks' size whatever the depth, while every copy's compute, communication and memory still enter the
objective and the memory rows (their coefficients add up on the shared variables).

Layers are found from module paths (`blocks.7.attn.qkv` is layer 7 of container `blocks`);
two layers are tied only if their node sequences match exactly: op, path inside the layer,
input/output shapes and dtypes, constant arguments and which in-layer node feeds which.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch.fx as fx

from ..passes.capture import Captured
from ..passes.layers import layer_of, module_path
from ..passes.shape_prop import tensor_meta
from ..strategies import op_name


def _signature(node: fx.Node, rest: str, index: dict[str, int]) -> tuple:
    def arg(a):
        if isinstance(a, fx.Node):
            return ("in", index.get(a.name, -1)) if a.name in index else ("ext", tuple(
                (m.shape, str(m.dtype)) for m in tensor_meta(a.meta.get("val"))))
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        return repr(a)
    metas = tuple((m.shape, str(m.dtype)) for m in tensor_meta(node.meta.get("val"))) if node.op != "output" else ()
    target = op_name(node.target) if node.op == "call_function" else node.op
    return (target, rest, metas, arg(tuple(node.args)), arg(tuple(sorted(node.kwargs.items()))))


def repeated_layers(cap: Captured, leaders: Mapping[str, str]) -> dict[str, str]:
    """leader name -> the leader of the first congruent layer whose variables it shares."""
    layers: dict[tuple[str, int], list[tuple[fx.Node, str]]] = {}
    for node in cap.gm.graph.nodes:
        if node.name not in leaders:
            continue
        where = layer_of(module_path(node, cap))
        if where is not None:
            layers.setdefault(where[:2], []).append((node, where[2]))
    sigs = {}
    for key, members in layers.items():
        index = {n.name: i for i, (n, _) in enumerate(members)}
        sigs[key] = tuple(_signature(n, rest, index) for n, rest in members)
    rep: dict[str, str] = {}
    classes: dict[tuple, list[tuple[str, int]]] = {}
    for key in sorted(layers, key=lambda k: (k[0], k[1])):
        classes.setdefault((key[0], sigs[key]), []).append(key)
    for members in classes.values():
        # the first and last copies stay free: their neighbours (embedding, final norm) differ, and
        # the optimum may treat them differently; the interior copies share the second's variables
        interior = members[1:-1]
        for key in interior[1:]:
            _tie(layers[key], layers[interior[0]], leaders, rep)
    return rep


def _tie(layer, canon, leaders, rep) -> None:
    for (n, _), (m, _) in zip(layer, canon):
        if (leaders[n.name] == n.name) != (leaders[m.name] == m.name):
            return
    for (n, _), (m, _) in zip(layer, canon):
        if leaders[n.name] == n.name:
            rep[n.name] = m.name
