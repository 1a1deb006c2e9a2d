"""Per-device memory: training state of parameters, and activations by liveness.

Parameter state, bytes per element of a stored shard (`state_bytes`, the one definition the
planner and `estimate()` use), split into what always stays with the parameter (the parameter
and its gradient) and the optimizer's part (its moments and, in mixed precision, the fp32
master weight), which the offload family may move to the host:

* "same" precision (every copy in the parameter's dtype): AdamW keeps param, grad, exp_avg,
  exp_avg_sq = 4 copies, 16 bytes per fp32 parameter; SGD param + grad = 2 copies;
* "mixed" (16-bit parameter and gradient, fp32 master weight and fp32 moments):
  2 + 2 + 4 + 4 + 4 = 16 bytes for AdamW (the "16 bytes per parameter" of ZeRO, Rajbhandari et
  al. 2020, section 3.1, and of Megatron-LM's fp16 training); SGD 2 + 2 + 4 = 8.
* "auto": mixed for 16-bit parameters (what bf16 training with torch.amp, FSDP's
  MixedPrecisionPolicy or Megatron does), same otherwise.

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


PRECISIONS = ("auto", "same", "mixed")


def is_mixed(param_itemsize: int, precision: str = "auto") -> bool:
    """Is a parameter of this size trained in mixed precision (fp32 master weights)?"""
    return precision == "mixed" or (precision == "auto" and param_itemsize == 2)


def state_bytes(param_itemsize: int, optimizer: str = "adamw", precision: str = "auto") -> tuple[float, float]:
    """(bytes per element kept with the parameter: itself and its gradient, bytes per element of
    optimizer state: moments and the fp32 master weight in mixed precision)."""
    if optimizer not in OPTIMIZER_STATE_COPIES:
        raise ValueError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZER_STATE_COPIES)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    copies = OPTIMIZER_STATE_COPIES[optimizer]
    if not is_mixed(param_itemsize, precision):
        return 2.0 * param_itemsize, float((copies - 2) * param_itemsize)
    return 2.0 * param_itemsize, 4.0 * (copies - 1)


def state_bytes_per_element(param_itemsize: int, optimizer: str = "adamw", precision: str = "auto") -> float:
    """Bytes of training state per parameter element (`state_bytes`' two parts together)."""
    kept, opt = state_bytes(param_itemsize, optimizer, precision)
    return kept + opt


@dataclass(frozen=True, slots=True)
class Liveness:
    owners: tuple[str, ...]                     # nodes that allocate their output (views excluded)
    points: tuple[tuple[str, ...], ...]         # live owners at each checked position
    point_names: tuple[str, ...]                # the node at which each point is taken
    positions: tuple[int, ...]                  # forward position of each point (index into `nodes`)
    defined: Mapping[str, int]                  # owner -> position of its op
    fwd_end: Mapping[str, int]                  # owner -> its last use in the forward
    end: Mapping[str, int]                      # owner -> where it is freed (`last` if saved)
    savers: Mapping[str, tuple[str, ...]]       # owner -> the ops that save it for their backward
    last: int                                   # the end of the forward (the backward's start)


def liveness(nodes: list[fx.Node], is_view: Mapping[str, bool], saves_inputs: Mapping[str, bool],
             tensor_nodes: Iterable[str], saved_frees: bool = True) -> Liveness:
    """Live-set of activations at each candidate peak of the forward pass.

    nodes: topological order; is_view[n]: n's output aliases its first input; saves_inputs[n]:
    n keeps its inputs for the backward; tensor_nodes: call_function nodes producing tensors.
    With `saved_frees`, the points also include the last forward use of every saved tensor: where
    memory falls when a decision (recomputation, offload) stops saving it.
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
    fwd_end = {o: pos[o] for o in set(owner.values())}
    savers: dict[str, list[str]] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            o = owner.get(a.name)
            if o is None:
                continue
            fwd_end[o] = max(fwd_end[o], pos[n.name])
            if saves_inputs.get(n.name, True) and n.op == "call_function" and n.name not in savers.get(o, ()):
                savers.setdefault(o, []).append(n.name)
    last = len(nodes)
    end = {o: (last if o in savers else e) for o, e in fwd_end.items()}
    owners = tuple(sorted(end, key=lambda o: pos[o]))
    frees = {end[o] for o in owners if end[o] < last} | {fwd_end[o] for o in savers if fwd_end[o] < last and saved_frees}
    checks = sorted(frees) + [last]
    points, names, where = [], [], []
    for t in checks:
        live = tuple(o for o in owners if pos[o] <= t <= end[o])
        if live:
            points.append(live)
            names.append(nodes[min(t, last - 1)].name)
            where.append(t)
    return Liveness(owners, tuple(points), tuple(names), tuple(where), {o: pos[o] for o in owners}, fwd_end, end,
                    {o: tuple(v) for o, v in savers.items()}, last)
