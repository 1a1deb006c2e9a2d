"""What every measurement on a calibrating rank uses: its timers (alone, or every rank at once), its
device's sync, and the mesh it measures on."""
from __future__ import annotations

import statistics
import time


def timeit(fn, reps: int, sync) -> float:
    """The median of `reps` runs after a warm-up (typical, not best, conditions: ranks that share
    cores and links slow each other down in training too)."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timeit_together(fn, reps: int, sync) -> float:
    """The time of one run of `fn` while every rank runs it: `reps` runs back to back between two
    barriers, the group's wall time over `reps` (one rank alone: `timeit`). With more ranks than
    cores a single short run is often timed while the rank sharing its core waits, so a median of
    single runs reports an unshared rate, or not, by chance (4 ranks on 2 cores, fp32 512^3 matmuls:
    32-93 GFLOP/s per rank from medians of single runs, 39-44 from the group's time); a training
    step, timed barrier to barrier on the slowest rank, gets the shared one."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return timeit(fn, reps, sync)
    fn()
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    dist.barrier()
    return (time.perf_counter() - t0) / reps


def device_sync(device: str):
    """Waits for the device's queued work (nothing to wait for on CPU)."""
    import torch
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def measuring_mesh(mesh_shape, names, device: str, **changes):
    """The autopar Mesh a measurement runs on: the ranks as `mesh_shape`, the shipped profile of the
    device's kind (the CPU's, or the H100's on GPU) with `changes` replaced in it."""
    import dataclasses

    from ..cost_model.profiles import load_profile
    from ..mesh import Mesh
    profile = load_profile("cpu" if device == "cpu" else "h100")
    return Mesh(tuple(mesh_shape), tuple(names), device=dataclasses.replace(profile, **changes))
