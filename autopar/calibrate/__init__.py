"""`autopar calibrate` (autopar/cli.py): measure this machine, write a device profile.

    autopar calibrate [--out my.json] [--world-size 4] [--mesh 2,2] [--base cpu] [--quick]

`calibrate` measures this machine and writes a device profile that `Mesh(device="my.json")`
accepts. It starts `world-size` ranks (forked with gloo on CPU, spawned with nccl on GPU) that
measure at the same time, so every figure is what one rank gets while the others run too (on CPU,
ranks share the cores):

Each compute and runtime figure is the group's time over several repeats run back to back by
every rank at once (barrier to barrier: the rate a rank gets while the others run, as in a step),
the collectives' the mean time they add to a burst of compute over several repeats, mean over
ranks; any other figure's median over ranks.

* matmul throughput per dtype (torch.mm of square matrices; the median over ranks) -> peak_flops,
  with matmul_efficiency = 1 (the figures are achieved rates); the time a small matmul loses
  beyond its ideal time -> matmul_ramp_time;
* memory bandwidth (y.copy_(x), read + write bytes) -> memory_bandwidth, memory_efficiency = 1;
* a dropout's time beyond its bytes, per element -> rng_element_time (random numbers);
* per-op overhead (a 16-element add) -> kernel_overhead;
* causal SDPA forward + backward at a layer's shape, against the planner's price of it at the matmul
  rate -> attention_efficiency;
* all_reduce and all_gather as a training step issues them (a compute burst, then the runtime's
  DTensor redistribute, all ranks at once, cycling over the mesh axes; what each adds to the
  bursts' time when every rank bursts alone) at 4 KiB, 512 KiB and 2 MiB, and per mesh axis
  isolated back-to-back raw collectives, fitted to the ring alpha-beta model of `cost_model.comm`
  plus a per-collective cost (`fit.fit_links`) -> intra_node (the slowest axis; one machine is one
  node), inter_node (the same unless the base profile's is slower), collective_overhead, and the
  fits under `_measured`;
* autopar's runtime against eager PyTorch on a 2-block transformer of width 16 (all replicated)
  -> runtime_op_overhead per node of the rank's graph (as the evaluator counts them); AdamW's step
  through `dmodel.optimizer` ->
  optimizer_param_overhead, and on one 2^20-element parameter -> optimizer_element_time;
* a data-parallel step's gradient buckets against the same compute with nothing to reduce and
  against the buckets alone -> grad_sync_overlap (the share of the early buckets' transfer the
  backward hides; `runtime_costs.measure_overlap`).

`_measured.launch` records ranks, mesh, cores, the load average before and after, and whether the
CPU ranks' malloc kept freed memory (`runtime/cpu_allocator.py`, set on every CPU rank): the figures
hold for that launch (with 4 ranks on 2 cores every rate is a shared one).

Figures not measured (memory capacity, host link on GPU, devices per node) come from `--base`.

The package: `launch.py` starts the ranks and runs each measurement in turn; `rank.py` holds
their timers; `device.py`, `collectives.py` and `runtime_costs.py` what they measure; `fit.py`
the profile fitted from the measurements; `notes.py` its `_notes`; `calibrate` (here) writes it.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from .fit import fitted_profile
from .launch import run_ranks
from .notes import notes

__all__ = ["calibrate"]


def calibrate(out: str | Path, *, world_size: int = 2, mesh: tuple[int, ...] | None = None,
              base: str = "cpu", name: str | None = None, quick: bool = False, device: str | None = None) -> Path:
    """Measure this machine with `world_size` ranks and write a profile JSON to `out`."""
    import torch

    from ..cost_model.profiles import load_profile, save_profile
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    mesh = tuple(mesh) if mesh else (world_size,)
    if math.prod(mesh) != world_size:
        raise SystemExit(f"autopar calibrate: mesh {mesh} has {math.prod(mesh)} devices, not --world-size {world_size}")
    names = tuple(f"axis{i}" for i in range(len(mesh)))
    load_before = os.getloadavg()
    results = run_ranks(world_size, mesh, names, device, quick)
    # the figures hold for this launch: with more ranks than cores, each rank gets a share of a core
    launch = {"ranks": world_size, "mesh": list(mesh), "cores": os.cpu_count(), "ranks_per_core":
              world_size / (os.cpu_count() or 1), "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    comp = [r[1] for r in results]
    launch["keeps_freed_memory"] = all(c["keeps_freed_memory"] for c in comp)
    base_p = load_profile(base)
    profile, axes_fit, collectives = fitted_profile(results, base_p, device, world_size, mesh, name)
    path = save_profile(profile, out)
    d = json.loads(path.read_text())
    d["_notes"] = notes(comp, base_p.name)
    d["_measured"] = {"launch": launch, "axes": axes_fit, "collectives": collectives, "per_rank": comp}
    path.write_text(json.dumps(d, indent=2) + "\n")
    return path
