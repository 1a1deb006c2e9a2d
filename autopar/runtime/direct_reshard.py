"""A reshard issued step by step as c10d collectives on the local tensor, not through DTensor's redistribute.

DTensor's redistribute runs a greedy plan of single-axis steps (torch 2.13,
`_redistribute.generate_greedy_transform_infos`) and issues each step through its functional-collective
layer: per step a transform-info plan, a DTensorSpec per intermediate layout, the functional
collective's custom-op dispatch and its `AsyncCollectiveTensor` wrap. Here the same steps, read from
the cost model (`comm.redistribute_steps`, which prices exactly these), run on the local tensor:
  P(sum) -> R     all-reduce of a clone (the functional all-reduce is out of place too)
  P(sum) -> S(d)  reduce-scatter (`reduce_scatter`); for d > 0 the chunks along d are first laid out
                  one after another (one copy, as DTensor's `_chunk_or_narrow_cat`)
  S(d) -> R       all-gather into chunks stacked on dim 0; for d > 0 moved onto d (one copy unless
                  every dim before d is 1 long, as DTensor's `_maybe_view_chunk_cat`)
  R -> S(d)       this rank's slice, no communication
with the same collectives on the same axes in the same order, the same copies, and so the same price
(`comm.local_copy_bytes`). Only even shards (every split dim divisible by the axes splitting it) and
plain placements are taken; anything else (uneven shards, a shard moved to another dim, a partial
average, DTensor's placement subclasses) goes to DTensor's redistribute as before.

On gloo the reduce-scatter is an all-to-all of the chunks and a local sum of the n received (`reduce_scatter`):
gloo's own (`ProcessGroupGloo::reduce_scatter_tensor_coalesced`, torch 2.13) clones the whole input,
all-reduces it (two ring steps, twice the bytes each rank sends) and copies this rank's chunk out.
Measured (4 gloo ranks on 2 cores, a (2, 2) mesh, back to back on one axis, mean of the 4 ranks,
2026-11-28, load ~4): a 2 MiB input 5.75 ms and 2.15 ms of CPU against 1.70 ms and 0.67 ms as an
all-to-all (an all-gather of the same bytes: 2.68 ms, 0.93 ms of CPU); in the burst cycle of
`calibrate.collectives` (the methods alternated, load ~6) 1.52 against 0.86 ms of CPU a call at 2 MiB,
0.77 against 0.53 at 512 KiB. One exchange, as the ring reduce-scatter `cost_model.comm` prices.

Measured (rank 0 of a (2, 2) fake process group alone, CPU time per call, 2026-11-28): the demo GPT's
tensor-parallel moves through DTensor took 250-850 us each (two gathers of a 256x256 weight on dim 1:
850 us), against 60-280 us for the moves already on the runtime's own path (`reshard.one_collective`).
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..compat import all_gather_single, dtensor_from, reduce_scatter_single, tensor_users
from ..cost_model.comm import layout_code, redistribute_steps

_R, _S, _P = 0, 1, 2          # comm's placement codes: (_R,), (_S, dim), (_P, reduce op)


def local_collective(local: torch.Tensor, mesh, axis: int, gathered: bool, async_op: bool = False) -> tuple:
    """(a new tensor, the work handle: None unless `async_op`) holding `local` all-gathered on dim 0
    (`gathered`) or all-reduced over mesh `axis` (`reshard.collective_move`)."""
    group = mesh.get_group(axis)
    if gathered:
        out = local.new_empty((local.shape[0] * mesh.size(axis), *local.shape[1:]))
        return out, issue(all_gather_single, (out, local.contiguous()), group, async_op)
    out = local.clone(memory_format=torch.contiguous_format)
    return out, issue(dist.all_reduce, (out,), group, async_op)


def issue(collective, tensors: tuple, group, async_op: bool = False, then=None):
    """`collective(*tensors, group=group)` (c10d's: the tensors positional, `async_op` taken): waited
    here and None, or where `async_op` a handle to wait on. On gloo the collective takes views of its
    own of `tensors`, and a wait returns once gloo's worker thread has dropped them and `then()` (gloo
    only) has run (`Released`)."""
    if dist.get_backend(group) != "gloo":
        return collective(*tensors, group=group, async_op=async_op)
    mine = tuple(t.view(t.shape) for t in tensors)
    work = Released(collective(*mine, group=group, async_op=True), mine, then)
    if async_op:
        return work
    work.wait()
    return None


def reduce_scatter(out: torch.Tensor, send: torch.Tensor, group, async_op: bool = False):
    """Reduce-scatter (sum) of the contiguous `send` into `out` (its 1/n, n the size of `group`): the
    runtime's one reduce-scatter, c10d's own, on gloo an all-to-all of the n chunks and their sum
    (module docstring). Returns the work handle where `async_op` (`out` is valid after its `wait`),
    else None."""
    if dist.get_backend(group) != "gloo":
        return reduce_scatter_single(out, send, group=group, async_op=async_op)
    n = dist.get_world_size(group)
    recv = torch.empty_like(send)
    return issue(dist.all_to_all_single, (recv, send), group, async_op,
                 then=lambda: torch.sum(recv.view(n, -1), 0, out=out.view(-1)))


# A bound on waiting for gloo's worker thread to drop a finished collective's tensors (`Released`):
# it drops them a few instructions after it marks the work done, but the waiter it wakes may take its
# core first; one yield almost always suffices. Past the bound they are freed when it drops them.
RELEASE_YIELDS = 1000


class Released:
    """A gloo collective's work (`issue`): `wait` waits for it, then until gloo's worker thread holds
    none of `mine` (the collective's own views of its tensors), then runs `then`. Gloo's worker drops
    a finished work's tensors a moment after it wakes the waiter; a tensor whose last other reference
    went meanwhile (a temporary, a buffer its owner freed after the wait) was then freed on the
    worker's thread at some later moment (a rank's memory read after a backward was over by them,
    timing-dependent: tests/test_reshard_pricing.py)."""

    def __init__(self, work, mine: tuple, then=None):
        self.work, self.mine, self.then = work, mine, then

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
            for _ in range(RELEASE_YIELDS):
                if all(tensor_users(t) == 1 for t in self.mine):
                    break
                os.sched_yield()
            self.mine = ()
            if self.then is not None:
                self.then()
                self.then = None
        return True


def local_block(local: torch.Tensor, axes: Sequence[tuple[int, int]], coord: Sequence[int],
                mesh_shape: Sequence[int]) -> torch.Tensor:
    """This rank's block of `local` split along `axes` ((mesh axis, dim): `reshard.split_axes`), in mesh order
    as DTensor's chunks."""
    for a, d in axes:
        k = local.shape[d] // mesh_shape[a]
        local = local.narrow(d, coord[a] * k, k)
    return local


def direct_steps(x: DTensor, cur: tuple, layout: tuple) -> tuple | None:
    """(`x` moved from `cur` to `layout`, None) by `redistribute_steps`, each issued as above; None
    (nothing issued) where a step is not one of those four or a shard is uneven."""
    mesh = x.device_mesh
    steps = direct_plan(x.shape, layout_code(cur), layout_code(layout), tuple(mesh.shape))
    if steps is None:
        return None
    local = run_steps(x.to_local(), steps, mesh, mesh.get_coordinate())
    return dtensor_from(local, mesh, layout, shape=x.shape, stride=x.stride()), None


def direct_plan(shape, src: tuple, dst: tuple, sizes: tuple) -> tuple | None:
    """The steps (`redistribute_steps`) moving a tensor of global `shape` from layout code `src` to
    `dst` over a mesh of `sizes`, where each is one of the four above on even shards; None else (a
    move to a partial too: `reshard.to_layout` makes it from a whole value after the steps)."""
    if any(d[0] == _P and s != d and n > 1 for s, d, n in zip(src, dst, sizes)):
        return None
    steps = redistribute_steps(src, dst, sizes)
    return steps if _takes(shape, src, steps, sizes) else None


def run_steps(local: torch.Tensor, steps: tuple, mesh, coord) -> torch.Tensor:
    """`local` (this rank's at `coord` on `mesh`) after the `direct_plan` `steps` (none over axes of
    one device)."""
    for axis, a, b in steps:
        if mesh.size(axis) > 1:
            local = _step(local, a, b, mesh, axis, coord)
    return local


def _takes(shape, src: tuple, steps: tuple, sizes: tuple) -> bool:
    """Is every step one of the four, on plain placements, with every layout on the way splitting
    each dim evenly?"""
    cur = list(src)
    for axis, a, b in steps:
        if len(a) > 2 or len(b) > 2 or (a[0] == _P and a[1] != "sum") or b[0] == _P or (a[0] == _S and b[0] == _S):
            return False
        cur[axis] = b
        for d in range(len(shape)):
            if shape[d] % math.prod(n for c, n in zip(cur, sizes) if c[0] == _S and c[1] == d):
                return False
    return all(len(c) <= 2 for c in src)


def _step(local: torch.Tensor, a: tuple, b: tuple, mesh, axis: int, coord) -> torch.Tensor:
    """`local` after one step over mesh `axis` (this rank at `coord` on the mesh), on the runtime's
    own collectives and slices (`local_collective`, `local_block`)."""
    n = mesh.size(axis)
    if a[0] == _P and b[0] == _R:
        return local_collective(local, mesh, axis, gathered=False)[0]
    if a[0] == _P:
        d = b[1]
        k = local.shape[d] // n
        chunks = local.unflatten(d, (n, k)).movedim(d, 0).contiguous()
        out = local.new_empty((*local.shape[:d], k, *local.shape[d + 1:]))
        reduce_scatter(out.view(-1), chunks.view(-1), mesh.get_group(axis))
        return out
    if a[0] == _S:
        d = a[1]
        stacked = local_collective(local, mesh, axis, gathered=True)[0].view(n, *local.shape)
        return stacked.movedim(0, d).reshape(*local.shape[:d], n * local.shape[d], *local.shape[d + 1:])
    return local_block(local, ((axis, b[1]),), coord, mesh.shape)     # R -> S(d)
