"""Per-device memory: training state of parameters, and activations by liveness.

Parameter state (bytes per element of a stored shard), training with AdamW in one dtype:
the parameter, its gradient, and AdamW's two moments (exp_avg, exp_avg_sq) in the same
dtype = 4 copies (`param_state_bytes`, what the planner charges). `state_bytes_per_element`
also knows mixed precision: bf16/fp16 parameter and gradient, fp32 master weight and fp32
moments = 2 + 2 + 4 + 4 + 4 = 16 bytes (the "16 bytes per parameter" of ZeRO, Rajbhandari et
al. 2020, section 3.1, and of Megatron-LM's fp16 training).

Activations: forward position t holds every tensor defined at or before t that is still
needed: by a later forward op, or by the backward (an input an op saves for its gradient).
Memory only rises at definitions and only falls at frees, so its local maxima sit just
before frees: those positions, plus the end of the forward (where every saved activation is
live at once, the usual peak), are the only points a memory constraint must be checked at.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch.fx as fx

ADAMW_STATE_COPIES = 4     # param + grad + exp_avg + exp_avg_sq
SGD_STATE_COPIES = 2       # param + grad
OPTIMIZER_STATE_COPIES = {"adamw": ADAMW_STATE_COPIES, "adam": ADAMW_STATE_COPIES, "sgd": SGD_STATE_COPIES}


def param_state_bytes(local_param_bytes: float, optimizer: str = "adamw") -> float:
    return local_param_bytes * OPTIMIZER_STATE_COPIES[optimizer]


PRECISIONS = ("same", "mixed")


def state_bytes_per_element(param_itemsize: int, optimizer: str = "adamw", precision: str = "same") -> float:
    """Bytes of training state per parameter element.

    same:  every copy (param, grad, optimizer moments) in the parameter's dtype.
    mixed: param and grad in their (16-bit) dtype, plus an fp32 master copy and fp32 moments.
    """
    if optimizer not in OPTIMIZER_STATE_COPIES:
        raise ValueError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZER_STATE_COPIES)}")
    if precision == "same":
        return float(param_itemsize * OPTIMIZER_STATE_COPIES[optimizer])
    if precision == "mixed":
        return float(2 * param_itemsize + 4 * (OPTIMIZER_STATE_COPIES[optimizer] - 1))
    raise ValueError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")


@dataclass(frozen=True, slots=True)
class Liveness:
    owners: tuple[str, ...]                     # nodes that allocate their output (views excluded)
    points: tuple[tuple[str, ...], ...]         # live owners at each checked position
    point_names: tuple[str, ...]                # the node at which each point is taken
    positions: tuple[int, ...]                  # forward position of each point (index into `nodes`)


def liveness(nodes: list[fx.Node], is_view: Mapping[str, bool], saves_inputs: Mapping[str, bool],
             tensor_nodes: Iterable[str]) -> Liveness:
    """Live-set of activations at each candidate peak of the forward pass.

    nodes: topological order; is_view[n]: n's output aliases its first input; saves_inputs[n]:
    n keeps its inputs for the backward; tensor_nodes: call_function nodes producing tensors.
    """
    tensor_nodes = set(tensor_nodes)
    pos = {n.name: i for i, n in enumerate(nodes)}
    owner: dict[str, str] = {}
    for n in nodes:
        if n.name not in tensor_nodes:
            continue
        if is_view.get(n.name) and n.all_input_nodes and n.all_input_nodes[0].name in owner:
            owner[n.name] = owner[n.all_input_nodes[0].name]
        else:
            owner[n.name] = n.name
    end = {o: pos[o] for o in set(owner.values())}
    saved: set[str] = set()
    for n in nodes:
        for a in n.all_input_nodes:
            o = owner.get(a.name)
            if o is None:
                continue
            end[o] = max(end[o], pos[n.name])
            if saves_inputs.get(n.name, True) and n.op == "call_function":
                saved.add(o)
    last = len(nodes)
    for o in saved:
        end[o] = last
    owners = tuple(sorted(end, key=lambda o: pos[o]))
    frees = sorted({end[o] for o in owners if end[o] < last})
    checks = frees + [last]
    points, names, where = [], [], []
    for t in checks:
        live = tuple(o for o in owners if pos[o] <= t <= end[o])
        if live:
            points.append(live)
            names.append(nodes[min(t, last - 1)].name)
            where.append(t)
    return Liveness(owners, tuple(points), tuple(names), tuple(where))
