"""Dropout over shards: the semantics of Megatron's RNG tracker, on any device.

A dropout runs on this device's local shard. Its mask must be

* the same on every replica: devices holding the same piece of a tensor (they differ only in
  coordinates on axes the tensor is replicated over) draw the same mask, or the replicas of a
  "replicated" tensor would silently diverge;
* different on different shards: devices holding different pieces of it draw independent masks
  (the same mask repeated on every shard would correlate the noise across the tensor);
* deterministic for a seed: the same seed and calls give the same masks, run after run.

So a dropout's mask is a function of (the step's seed, the forward calls since that seed was set,
the op's node name, the element's position in the whole tensor): a hash of the element's global
index, computed on this device for its own shard alone. Replicas hold the same positions and so the
same mask; shards hold others; no device draws what it does not hold. A pipelined step runs
microbatch i of m as the rows i*B/m.. of the batch: its elements are numbered from i times the
microbatch's size (`RngState.microbatch`), so each microbatch draws the mask the unpipelined plan
draws for its rows (exactly, where the batch is the tensor's first dimension, as after every
batch-major view; elsewhere still an independent mask). Torch's generators (mt19937 on CPU) cannot
skip to a position, hence the counter-based hash (splitmix64's, as Philox is counter-based on CUDA):
about ten element-wise integer ops over the shard where `native_dropout` draws one random number.
The step's seed is torch's (`torch.initial_seed()`, what `torch.manual_seed` set) moved by a per-rank
offset agreed when the module is built (rank 0's seed minus this rank's), so ranks seeded alike, or
seeded `s + rank` for their data, draw as rank 0 does; `torch.manual_seed(s)` before a forward fixes
its masks (a re-run, or a recomputation in the backward, draws the same ones), and
`DistributedModule.manual_seed(s)` fixes the module's seed whatever torch's. The result is
`native_dropout`'s: (input * mask / (1 - p), mask).
"""
from __future__ import annotations

import hashlib
import math
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
    microbatch: int = 0               # the microbatch running (pipelined steps; 0 otherwise)

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


# splitmix64 (Steele et al. 2014): element k of stream `key` is mix(key + k * GOLDEN); constants as
# two's-complement int64 (torch's integer products wrap)
_GOLDEN, _M1, _M2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
_UNIFORM_BITS = 24      # a float32's mantissa: the top 24 bits of the hash as a uniform in [0, 1)


def _key(state: RngState, node: str) -> int:
    digest = hashlib.blake2b(repr((state.seed, state.calls, node)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def uniform(key: int, shape, offsets, global_shape, first: int, device) -> torch.Tensor:
    """Uniforms in [0, 1) of the elements of a shard: `shape` at `offsets` in a tensor of `global_shape`,
    whose elements are numbered from `first` in row-major order. In place on two int64 buffers (each
    op of the hash a new tensor made it 4x slower at 4M elements, the bits the same)."""
    index = torch.full((), first, dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(shape))):
        pos = torch.arange(offsets[d], offsets[d] + shape[d], dtype=torch.int64, device=device) * stride
        index = index + pos.view(-1, *([1] * (len(shape) - 1 - d)))
        stride *= global_shape[d]
    x = index.expand(tuple(shape)) * _GOLDEN
    x.add_(key)
    shifted = torch.empty_like(x)
    for k, m in ((30, _M1), (27, _M2), (31, None)):         # x = (x ^ (x >>> k)) * m
        x.bitwise_xor_(_shr(x, k, shifted))
        if m is not None:
            x.mul_(m)
    return _shr(x, 64 - _UNIFORM_BITS, shifted).to(torch.float32).mul_(1.0 / (1 << _UNIFORM_BITS))


def _shr(x: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
    """Logical right shift of int64 into `out` (torch's >> is arithmetic)."""
    return torch.bitwise_right_shift(x, k, out=out).bitwise_and_((1 << (64 - k)) - 1)


def _placement(shape, output, mesh) -> tuple[list[int], list[int]]:
    """(global shape, this shard's offsets) of a local `shape` in the even layout `output`: shards of
    one dim nest in mesh-axis order, as DTensor's do."""
    coords, sizes = mesh.get_coordinate(), mesh.shape
    full = list(shape)
    for pl, n in zip(output, sizes):
        if isinstance(pl, Shard):
            full[pl.dim] *= n
    offsets, span = [0] * len(shape), list(full)
    for pl, c, n in zip(output, coords, sizes):
        if isinstance(pl, Shard):
            span[pl.dim] //= n
            offsets[pl.dim] += c * span[pl.dim]
    return full, offsets


def dropout(op, x: torch.Tensor, p: float, train: bool | None):
    """`native_dropout` on the local shard `x` of the LocalOp `op` (see the module docstring)."""
    if not train or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    full, offsets = _placement(x.shape, op.output, op.mesh)
    return draw(x, p, _key(op.rng, op.node), offsets, full, op.rng.microbatch * math.prod(full))


def draw(x: torch.Tensor, p: float, key: int, offsets, full, first: int):
    """(x * mask / (1 - p), mask) of a shard `x` at `offsets` in a tensor of shape `full` numbered
    from `first` (what runs, and what `autopar/calibrate/device.py` times as a dropout's random numbers)."""
    mask = uniform(key, x.shape, offsets, full, first, x.device) >= p
    return x * mask * (0.0 if p >= 1 else 1.0 / (1.0 - p)), mask


def attach(graph: torch.nn.Module, state: RngState) -> None:
    """Give every dropout of a per-rank graph the module's RNG state and its node's name: its op
    modules (`ops.LocalOp`, which imports this module) are known by the op they run and the `rng`
    slot they keep for it."""
    for name, mod in graph.named_children():
        if hasattr(mod, "rng") and getattr(mod, "target", None) in DROPOUT_OPS:
            mod.rng, mod.node = state, name
