"""The calibrating ranks: `run_ranks` starts them (forked on CPU, spawned on GPU) and collects what
each measured; each (`_rank_main`) runs every measurement in turn, all ranks at once, between
barriers: the device's figures, the collectives isolated and in a step's cycle, the runtime's
costs, and the compute rates' later rounds spread among them."""
from __future__ import annotations

import os
import tempfile
import time

from ..runtime.cpu_allocator import keep_freed_memory
from .collectives import measure_isolated, measure_step_collectives
from .device import RATE_ROUNDS, measure_device, measure_rates, median_rates
from .rank import device_sync
from .runtime_costs import measure_overlap, measure_runtime


def _rank_main(rank: int, world: int, init_file: str, mesh_shape, names, device: str, quick: bool, queue) -> None:
    """One rank of `world`: joins the group through `init_file`, measures, and puts (rank, its
    measurements, its axes' isolated collectives) on `queue`."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    # the CPU ranks' allocator, as the runs it prices have it (runtime/cpu_allocator.py)
    kept = device != "cuda" and keep_freed_memory()
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        sync = device_sync(device)
        dist.barrier()
        compute = measure_device(device, quick)      # every rank at once: shared cores, as in training
        compute["keeps_freed_memory"] = kept
        rounds = [{k: compute[k] for k in ("matmul_flops", "matmul_n", "attention")}]
        dist.barrier()
        axes = measure_isolated(mesh_shape, names, device, quick)
        dist.barrier()
        compute["step_collectives"] = measure_step_collectives(mesh_shape, names, device, quick)
        dist.barrier()
        rounds.append(measure_rates(device, quick, sync))
        dist.barrier()
        compute["runtime"] = measure_runtime(mesh_shape, names, device, quick)
        dist.barrier()
        compute["overlap"] = measure_overlap(mesh_shape, names, device, quick)
        dist.barrier()
        while len(rounds) < RATE_ROUNDS:
            rounds.append(measure_rates(device, quick, sync))
        compute.update(median_rates(rounds))
        queue.put((rank, compute, axes))
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, mesh: tuple[int, ...], names: tuple[str, ...], device: str, quick: bool) -> list:
    """Each rank's (rank, measurements, axes' isolated collectives), in rank order, measured by
    `world_size` processes at once (SystemExit if one fails or the 600 s pass)."""
    import multiprocessing as mp
    import queue as queue_mod

    # forked ranks on CPU (fast); spawned on GPU: CUDA cannot be used in a child forked from a process
    # that has touched it (torch.cuda.is_available() above may have)
    ctx = mp.get_context("spawn" if device == "cuda" else "fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="autopar_calibrate_") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, init_file, mesh, names, device, quick, queue))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results = []
        try:
            deadline = time.monotonic() + 600
            while len(results) < len(procs) and time.monotonic() < deadline:
                try:
                    results.append(queue.get(timeout=1.0))
                except queue_mod.Empty:
                    if any(p.exitcode not in (0, None) for p in procs):   # a rank died: do not wait for it
                        break
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()
        if any(p.exitcode not in (0, None) for p in procs) or len(results) < len(procs):
            raise SystemExit("autopar calibrate: a measuring rank failed (see its traceback above)")
    results.sort(key=lambda r: r[0])
    return results
