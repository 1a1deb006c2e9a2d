"""Recomputation: a layer whose plan says "full" or "selective" runs under `torch.utils.checkpoint`.

The layer's ops (one `LayerRegion`, see regions.py) run inside non-reentrant checkpointing:

* "full": nothing the layer's ops save is kept; the backward runs the layer's forward again
  (its reshards and collectives too, in the same order on every rank, since every rank
  recomputes the same region at the same point of its backward);
* "selective": torch's selective checkpoint policy keeps the outputs of the ops in
  `cost_model.recompute.SELECTIVE_SAVED_OPS` (the matmuls) and recomputes everything else (the
  attention core, element-wise ops, collectives), as Korthikanti et al. 2022.

Random ops replay exactly: `preserve_rng_state=True` restores the RNG state the forward saw
before recomputing, so dropout draws the same mask twice.
"""
from __future__ import annotations

import functools

from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..cost_model.recompute import saved_under_selective


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep matmul outputs, recompute the rest (see `SELECTIVE_SAVED_OPS`). At dispatch a `linear`
    arrives as `aten.mm` / `aten.addmm`, named here as the planner names graph ops ("aten.mm")."""
    return (CheckpointPolicy.MUST_SAVE if saved_under_selective(str(op.overloadpacket))
            else CheckpointPolicy.PREFER_RECOMPUTE)


_SELECTIVE = functools.partial(create_selective_checkpoint_contexts, selective_policy)


def run_recomputed(fn, args: tuple, mode: str):
    """fn(*args) with its saved tensors dropped ("full") or thinned ("selective") and recomputed
    in the backward."""
    if mode == "full":
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
    if mode == "selective":
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_SELECTIVE)
    raise ValueError(f"recompute mode {mode!r} runs without checkpointing")
