"""Dropout over shards: the semantics of Megatron's RNG tracker, on any device.

A dropout runs on this device's local shard. Its mask must be

* the same on every replica: devices holding the same piece of a tensor (they differ only in
  coordinates on axes the tensor is replicated over) draw the same mask, or the replicas of a
  "replicated" tensor would silently diverge;
* different on different shards: devices holding different pieces of it draw independent masks
  (the same mask repeated on every shard would correlate the noise across the tensor);
* deterministic for a seed: the same seed and calls give the same masks, run after run.

So each dropout draws from its own generator, seeded from (the step's seed, the forward calls
since that seed was set, the op's node name, this device's coordinates on the axes that shard the
op's output): replicas share every input of that seed, shards differ in the last. The step's seed
is torch's (`torch.initial_seed()`, what `torch.manual_seed` set) moved by a per-rank offset agreed
when the module is built (rank 0's seed minus this rank's), so ranks seeded alike, or seeded
`s + rank` for their data, draw as rank 0 does; `torch.manual_seed(s)` before a forward fixes its
masks (a re-run, or a recomputation in the backward, draws the same ones), and
`DistributedModule.manual_seed(s)` fixes the module's seed whatever torch's. The result is
`native_dropout`'s: (input * mask / (1 - p), mask).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Shard

__all__ = ["RngState", "DROPOUT_OPS", "dropout", "attach"]

aten = torch.ops.aten
DROPOUT_OPS = (aten.native_dropout.default,)


@dataclass(slots=True)
class RngState:
    """How this rank seeds the dropouts of one module (see the module docstring)."""
    offset: int = 0                   # rank 0's torch seed minus this rank's, when the module was built
    fixed: int | None = None          # DistributedModule.manual_seed's, overriding torch's
    seed: int | None = None           # the seed of the current forward
    calls: int = 0                    # forward calls since `seed` was set

    @classmethod
    def agreed(cls) -> RngState:
        """The offset to rank 0's seed (one broadcast; the module is built collectively)."""
        import torch.distributed as dist
        seed = [torch.initial_seed()]
        if dist.is_initialized():
            dist.broadcast_object_list(seed, src=0)
        return cls(offset=int(seed[0]) - torch.initial_seed())

    def next_call(self) -> None:
        """A forward starts: its seed, and its count since that seed was set."""
        seed = self.fixed if self.fixed is not None else torch.initial_seed() + self.offset
        if seed != self.seed:
            self.seed, self.calls = seed, 0
        self.calls += 1


def _generator(state: RngState, node: str, coords: tuple[int, ...], device: torch.device) -> torch.Generator:
    key = repr((state.seed, state.calls, node, coords)).encode()
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)
    return torch.Generator(device=device).manual_seed(seed)


def dropout(op, x: torch.Tensor, p: float, train: bool | None):
    """`native_dropout` on the local shard `x` of the LocalOp `op` (see the module docstring)."""
    if not train or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    coords = op.mesh.get_coordinate()
    sharded = tuple(c for c, pl in zip(coords, op.output) if isinstance(pl, Shard))
    g = _generator(op.rng, op.node, sharded, x.device)
    mask = torch.rand(x.shape, generator=g, device=x.device) >= p
    return x * mask * (0.0 if p >= 1 else 1.0 / (1.0 - p)), mask


def attach(graph: torch.nn.Module, state: RngState) -> None:
    """Give every dropout of a per-rank graph the module's RNG state and its node's name."""
    from .ops import LocalOp
    for name, mod in graph.named_children():
        if isinstance(mod, LocalOp) and mod.target in DROPOUT_OPS:
            mod.rng, mod.node = state, name
