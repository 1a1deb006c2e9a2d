"""The `autopar` command line.

    autopar calibrate [--out my.json] [--world-size 4] [--mesh 2,2] [--base cpu] [--quick]

`calibrate` measures this machine and writes a device profile that `Mesh(device="my.json")`
accepts. It starts `world-size` ranks (forked, gloo on CPU, nccl on GPU) that measure at the
same time, so every figure is what one rank gets while the others run too (on CPU, ranks share
the cores):

Each figure is the median of several repeats, then the median over ranks.

* matmul throughput per dtype (torch.mm of square matrices; the median over ranks) -> peak_flops,
  with matmul_efficiency = 1 (the figures are achieved rates); the time a small matmul loses
  beyond its ideal time -> matmul_ramp_time;
* memory bandwidth (y.copy_(x), read + write bytes) -> memory_bandwidth, memory_efficiency = 1;
* per-op overhead (a 16-element add) -> kernel_overhead;
* per mesh axis, all_reduce and all_gather at a small and a large message, fitted to the ring
  alpha-beta model of `cost_model.comm` (B from the large message, alpha from the small one)
  -> intra_node (the slowest axis; one machine is one node), inter_node (the same unless the
  base profile's is slower), and the per-axis fits under `_measured`.

Figures not measured (memory capacity, host link on GPU, devices per node) come from `--base`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main", "calibrate"]


# -- measurements (run inside each rank) -----------------------------------------------------
def _timeit(fn, reps: int, sync) -> float:
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


def _measure_compute(device: str, quick: bool) -> dict:
    import torch
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    n = (512 if quick else 1536) if device == "cpu" else (4096 if quick else 8192)
    reps = 3 if quick else 7
    out: dict = {"matmul_flops": {}, "matmul_n": n}
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    for key, dt in dtypes.items():
        a = torch.randn(n, n, device=device).to(dt)
        b = torch.randn(n, n, device=device).to(dt)
        c = torch.empty(n, n, device=device, dtype=dt)
        # a dtype without a fast kernel (fp16 on most CPUs) would take minutes at full size
        probe = _timeit(lambda: torch.mm(a[:128, :128], b[:128, :128]), 1, sync)
        m = n if 2 * 128 ** 3 / probe > 2e10 or device == "cuda" else 256
        a2, b2, c2 = a[:m, :m].contiguous(), b[:m, :m].contiguous(), c[:m, :m].contiguous()
        t = _timeit(lambda: torch.mm(a2, b2, out=c2), reps, sync)
        out["matmul_flops"][key] = 2 * m ** 3 / t
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        a = torch.randn(n, n, device=device)
        t = _timeit(lambda: torch.mm(a, a), reps, sync)
        out["matmul_flops"]["tf32"] = 2 * n ** 3 / t
        torch.backends.cuda.matmul.allow_tf32 = False
    tiny = torch.randn(16, device=device)
    out["kernel_overhead"] = _timeit(lambda: tiny + 1.0, 200 if quick else 1000, sync)
    # ramp: a small fp32 matmul's time beyond its ideal time and the per-op overhead
    s = 64
    x = torch.randn(s, s, device=device)
    y = torch.empty(s, s, device=device)
    t_small = _timeit(lambda: torch.mm(x, x, out=y), 200 if quick else 1000, sync)
    out["matmul_ramp_time"] = max(t_small - 2 * s ** 3 / out["matmul_flops"]["float32"] - out["kernel_overhead"], 0.0)
    nbytes = (16 if quick else 256) * 2 ** 20
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = _timeit(lambda: dst.copy_(src), reps, sync)
    out["memory_bandwidth"] = 2 * nbytes / t
    if device == "cuda":
        host = torch.empty(nbytes // 4, pin_memory=True)
        t = _timeit(lambda: src.copy_(host, non_blocking=True), reps, sync)
        out["host_bandwidth"] = nbytes / t
    return out


def _fit_ring(kind: str, n: int, small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """(bandwidth, latency) of a Link such that the ring formula gives the measured times."""
    from .cost_model.comm import _ring
    fraction, steps = _ring(kind, n)
    (s0, t0), (s1, t1) = small, large
    per_byte = max((t1 - t0) / (s1 - s0), 1e-15)
    bandwidth = fraction / per_byte
    latency = max(t0 - fraction * s0 / bandwidth, 0.0) / steps
    return bandwidth, latency


def _measure_axes(rank: int, world: int, mesh_shape, names, device: str, quick: bool) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dm = init_device_mesh(device, mesh_shape, mesh_dim_names=names)
    sizes = (4096, (1 if quick else 8) * 2 ** 20)
    reps = 5 if quick else 15
    out = {}
    for name in names:
        group = dm.get_group(name)
        n = dist.get_world_size(group)
        if n == 1:
            continue
        res = {}
        for kind in ("all_reduce", "all_gather"):
            pts = []
            for nbytes in sizes:
                full = torch.zeros(nbytes // 4, device=device)
                part = torch.zeros(nbytes // 4 // n, device=device)
                if kind == "all_reduce":
                    fn = lambda: dist.all_reduce(full, group=group)  # noqa: E731
                else:
                    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
                    fn = lambda: gather(full[: part.numel() * n], part, group=group)  # noqa: E731
                dist.barrier()
                pts.append((float(part.numel() * n * 4), _timeit(fn, reps, sync)))
            res[kind] = pts
        out[name] = {"size": n, "points": res}
    return out


def _rank_main(rank: int, world: int, init_file: str, mesh_shape, names, device: str, quick: bool, queue) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        dist.barrier()
        compute = _measure_compute(device, quick)      # every rank at once: shared cores, as in training
        dist.barrier()
        axes = _measure_axes(rank, world, mesh_shape, names, device, quick)
        queue.put((rank, compute, axes))
    finally:
        dist.destroy_process_group()


def calibrate(out: str | Path, *, world_size: int = 2, mesh: tuple[int, ...] | None = None,
              base: str = "cpu", name: str | None = None, quick: bool = False, device: str | None = None) -> Path:
    """Measure this machine with `world_size` ranks and write a profile JSON to `out`."""
    import multiprocessing as mp

    import torch

    from .cost_model.profiles import Link, load_profile, save_profile
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    mesh = tuple(mesh) if mesh else (world_size,)
    if math.prod(mesh) != world_size:
        raise SystemExit(f"autopar calibrate: mesh {mesh} has {math.prod(mesh)} devices, not --world-size {world_size}")
    names = tuple(f"axis{i}" for i in range(len(mesh)))
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="autopar_calibrate_") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, init_file, mesh, names, device, quick, queue))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results = []
        try:
            for _ in procs:
                results.append(queue.get(timeout=600))
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()
        if any(p.exitcode not in (0, None) for p in procs):
            raise SystemExit("autopar calibrate: a measuring rank failed (see its traceback above)")
    results.sort(key=lambda r: r[0])
    comp = [r[1] for r in results]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    flops = {k: med([c["matmul_flops"][k] for c in comp]) for k in comp[0]["matmul_flops"]}
    bw = med([c["memory_bandwidth"] for c in comp])
    base_p = load_profile(base)
    axes_fit, links = {}, []
    for ax_name, info in results[0][2].items():
        n = info["size"]
        fits = {kind: _fit_ring(kind, n, *pts) for kind, pts in info["points"].items()}
        bandwidth = min(b for b, _ in fits.values())
        latency = max(l for _, l in fits.values())
        axes_fit[ax_name] = {"size": n, "bandwidth": bandwidth, "latency": latency,
                             "fits": {k: {"bandwidth": b, "latency": l} for k, (b, l) in fits.items()},
                             "points_s": info["points"]}
        links.append(Link(bandwidth, latency))
    intra = min(links, key=lambda l: l.bandwidth) if links else base_p.intra_node
    inter = intra if base_p.inter_node.bandwidth >= intra.bandwidth or device == "cpu" else base_p.inter_node
    host = (Link(bw / 2, base_p.host_link.latency) if device == "cpu"
            else Link(med([c["host_bandwidth"] for c in comp]), base_p.host_link.latency))
    profile = dataclasses.replace(
        base_p, name=name or f"calibrated-{device}", device_type=device,
        backend="nccl" if device == "cuda" else "gloo", peak_flops=flops, memory_bandwidth=bw, host_link=host,
        intra_node=intra, inter_node=inter, matmul_efficiency=1.0, memory_efficiency=1.0,
        matmul_ramp_time=med([c["matmul_ramp_time"] for c in comp]),
        kernel_overhead=med([c["kernel_overhead"] for c in comp]),
        devices_per_node=max(base_p.devices_per_node, world_size) if device == "cpu" else base_p.devices_per_node,
        source=f"autopar calibrate on {os.uname().nodename}, {world_size} ranks measuring at once, mesh {mesh}, "
               f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    path = save_profile(profile, out)
    d = json.loads(path.read_text())
    d["_notes"] = {
        "peak_flops": f"torch.mm of square matrices (n={comp[0]['matmul_n']}, smaller for dtypes without a fast "
                      "kernel), median over ranks: achieved rates, hence matmul_efficiency = 1",
        "memory_bandwidth": "y.copy_(x), read + write bytes, median over ranks",
        "links": "ring alpha-beta fits of all_reduce and all_gather per mesh axis (see _measured); intra_node is "
                 "the slowest axis; not measured figures come from the base profile " + base_p.name,
    }
    d["_measured"] = {"axes": axes_fit, "per_rank": comp}
    path.write_text(json.dumps(d, indent=2) + "\n")
    return path


# -- command line ----------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="autopar", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("calibrate", help="measure this machine and write a device profile JSON")
    c.add_argument("--out", default="calibrated.json", help="profile file to write (default calibrated.json)")
    c.add_argument("--world-size", type=int, default=2, help="ranks measuring at once (default 2)")
    c.add_argument("--mesh", default=None, help="mesh shape whose axes to measure, e.g. 2,2 (default: one axis)")
    c.add_argument("--base", default="cpu", help="profile for figures not measured (default cpu)")
    c.add_argument("--name", default=None, help="profile name (default calibrated-<device>)")
    c.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda if available")
    c.add_argument("--quick", action="store_true", help="small sizes and few repeats (seconds, rough)")
    a = ap.parse_args(argv)
    if a.command == "calibrate":
        mesh = tuple(int(x) for x in a.mesh.split(",")) if a.mesh else None
        path = calibrate(a.out, world_size=a.world_size, mesh=mesh, base=a.base, name=a.name, quick=a.quick,
                         device=a.device)
        from .cost_model.profiles import load_profile
        p = load_profile(path)
        print(f"wrote {path}: fp32 {p.peak_flops['float32'] / 1e9:.1f} GFLOP/s, bf16 "
              f"{p.peak_flops.get('bfloat16', 0) / 1e9:.1f} GFLOP/s, memory {p.memory_bandwidth / 1e9:.1f} GB/s, "
              f"link {p.intra_node.bandwidth / 1e9:.2f} GB/s + {p.intra_node.latency * 1e6:.0f} us per step, "
              f"op overhead {p.kernel_overhead * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
