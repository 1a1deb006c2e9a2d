"""The fits that turn the calibrating ranks' measurements into a device profile (`fitted_profile`):
medians over ranks of the device's figures, the links and the per-collective cost from the
collectives (`fit_links`: ring alpha-beta fits of `cost_model.comm`), fused attention's efficiency
against the planner's own price. Pure arithmetic over the measurements: the same measurements give
the same profile."""
from __future__ import annotations

import dataclasses
import os
import statistics
import time

from ..cost_model.comm import collective_bytes_on_wire, collective_time, latency_steps


def fitted_profile(results: list, base_p, device: str, world_size: int, mesh: tuple[int, ...], name: str | None):
    """(the profile the ranks' measurements give, over `base_p` for what is not measured; the axes'
    ring fits; the collectives measured as a step issues them)."""
    import torch

    from ..cost_model.profiles import Link
    comp = [r[1] for r in results]
    med = statistics.median
    flops = {k: med([c["matmul_flops"][k] for c in comp]) for k in comp[0]["matmul_flops"]}
    bw = med([c["memory_bandwidth"] for c in comp])
    kernel_overhead = med([c["kernel_overhead"] for c in comp])
    axes_fit, collectives, links, collective_overhead = fit_links(comp, _isolated(results), kernel_overhead)
    rt = [c["runtime"] for c in comp]
    intra = _priced_link(links) if links else base_p.intra_node
    inter = intra if base_p.inter_node.bandwidth >= intra.bandwidth or device == "cpu" else base_p.inter_node
    host = (Link(bw / 2, base_p.host_link.latency) if device == "cpu"
            else Link(med([c["host_bandwidth"] for c in comp]), base_p.host_link.latency))
    profile = dataclasses.replace(
        base_p, name=name or f"calibrated-{device}", device_type=device,
        backend="nccl" if device == "cuda" else "gloo", peak_flops=flops, memory_bandwidth=bw, host_link=host,
        intra_node=intra, inter_node=inter, matmul_efficiency=1.0, memory_efficiency=1.0,
        matmul_ramp_time=med([c["matmul_ramp_time"] for c in comp]),
        kernel_overhead=kernel_overhead, collective_overhead=collective_overhead,
        runtime_op_overhead=med([r["runtime_op_overhead"] for r in rt]),
        optimizer_param_overhead=med([r["optimizer_param_overhead"] for r in rt]),
        optimizer_element_time=med([r["optimizer_element_time"] for r in rt]),
        rng_element_time=med([c["rng_element_time"] for c in comp]),
        disk_link=Link(med([c["disk_bandwidth"] for c in comp]), med([c["disk_latency"] for c in comp])),
        host_optimizer_element_time=med([c["host_optimizer_element_time"] for c in comp]),
        grad_sync_overlap=(med([c["overlap"]["overlap"] for c in comp]) if comp[0]["overlap"]
                           else base_p.grad_sync_overlap),
        devices_per_node=max(base_p.devices_per_node, world_size) if device == "cpu" else base_p.devices_per_node,
        source=f"autopar calibrate on {os.uname().nodename}, {world_size} ranks measuring at once, mesh {mesh}, "
               f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    profile = dataclasses.replace(profile, attention_efficiency=_attention_efficiency(comp, profile))
    return profile, axes_fit, collectives


def _isolated(results: list) -> dict:
    """Per axis, isolated collectives (back to back, raw torch.distributed): the transport's own
    latency per ring step, and a bound on the bandwidth (rank 0's measurements)."""
    isolated = {}
    for ax_name, info in results[0][2].items():
        n = info["size"]
        fits = {kind: _fit_ring(kind, n, *pts) for kind, pts in info["points"].items()}
        isolated[ax_name] = {"size": n, "fits": {k: {"bandwidth": b, "latency": l} for k, (b, l) in fits.items()},
                             "points_s": info["points"]}
    return isolated


def _fit_ring(kind: str, n: int, small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """(bandwidth, latency) of a Link such that the ring formula gives the measured times."""
    fraction, steps = collective_bytes_on_wire(kind, 1.0, n), latency_steps(kind, n)
    (s0, t0), (s1, t1) = small, large
    per_byte = max((t1 - t0) / (s1 - s0), 1e-15)
    bandwidth = fraction / per_byte
    latency = max(t0 - fraction * s0 / bandwidth, 0.0) / steps
    return bandwidth, latency


def fit_links(comp: list[dict], isolated: dict, kernel_overhead: float) -> tuple[dict, dict, list, float]:
    """(per-axis fits, the fit's record, a Link per axis, collective_overhead) from the ranks'
    `measure_step_collectives` (mean over ranks: in lockstep each rank's cycle takes as long) and
    the isolated fits.

    Per kind, a least-squares line of seconds against bytes over the cycled points. An axis's
    bandwidth: the line's slope, bounded by the isolated collectives' (a step cannot move bytes
    faster than back-to-back collectives do; the slope can be lost in scheduling noise). Its
    latency per ring step: the isolated collectives' (the transport's). What the intercepts hold
    beyond the ring steps of the link the profile prices every axis with (`_priced_link`) is a
    per-collective cost, the same for every kind and axis as `Mesh.reshard_cost` charges it; an
    all_reduce over every axis at once gives one more estimate. So a collective that moves nothing
    is priced at what the cycle measured, whatever an axis's own isolated latency read (one axis's
    read 2.8 ms per ring step where the other's read 0.37: taken off the intercepts, it left no
    per-collective cost at all, and the profile then priced the other axis's 0.37 ms). Splitting
    the intercepts into latency and per-collective cost by fitting both instead gave 0-3.2 ms per
    ring step from one calibration to the next."""
    steps = comp[0]["step_collectives"]
    if not steps["points"]:
        return {}, {}, [], 0.0
    pts = {kind: [(sz, _mean([c["step_collectives"]["points"][kind][j][1] for c in comp]))
                  for j, (sz, _) in enumerate(p)] for kind, p in steps["points"].items()}
    lines = {kind: _line(p) for kind, p in pts.items()}
    axes_fit, links = _axis_fits(steps["cycle"], isolated, lines)
    overheads, all_axes = _per_collective(comp, lines, axes_fit, _priced_link(links))
    record = {"cycle": steps["cycle"], "burst_repeats": steps["burst_repeats"], "points_s": pts,
              "lines": {k: {"intercept_s": a, "slope_s_per_byte": b} for k, (a, b) in lines.items()},
              "per_collective": dict(zip([*pts, "all_axes_all_reduce"], overheads)), "all_axes_all_reduce": all_axes}
    # Mesh.reshard_cost charges kernel_overhead + collective_overhead per collective
    return axes_fit, record, links, max(_mean(overheads) - kernel_overhead, 0.0)


def _axis_fits(cycle: list[str], isolated: dict, lines: dict) -> tuple[dict, list]:
    """Per axis of `cycle`, its fit (`fit_links`: bandwidth from the kinds' `lines`, bounded by the
    isolated fits'; latency the isolated one) and its Link, in the cycle's order."""
    from ..cost_model.profiles import Link
    axes_fit, links = {}, []
    for ax_name in cycle:
        iso = isolated[ax_name]
        n = iso["size"]
        bandwidth = min(min(collective_bytes_on_wire(kind, 1.0, n) / max(lines[kind][1], 1e-15),
                            iso["fits"][kind]["bandwidth"]) for kind in lines)
        latency = _mean([iso["fits"][kind]["latency"] for kind in lines])
        # a reduce_scatter moves its bytes this many times slower than an all_gather (the ring formula
        # equates them); measured as the runtime issues it (on gloo an all-to-all and a sum: gloo's own
        # took about an all_reduce's time, runtime/direct_reshard.py)
        rs = iso["fits"].get("reduce_scatter")
        factor = iso["fits"]["all_gather"]["bandwidth"] / rs["bandwidth"] if rs else 1.0
        axes_fit[ax_name] = {"size": n, "bandwidth": bandwidth, "latency": latency, "reduce_scatter_factor": factor,
                             "isolated": iso}
        links.append(Link(bandwidth, latency, factor))
    return axes_fit, links


def _per_collective(comp: list[dict], lines: dict, axes_fit: dict, link) -> tuple[list, dict | None]:
    """(per kind, what its line's intercept holds beyond `link`'s ring latency, then, where measured,
    what the all_reduce over every axis at once took beyond its ring time, per collective; that
    all_reduce's record, mean over ranks, or None)."""
    ring_latency = {kind: _mean([latency_steps(kind, f["size"]) * link.latency for f in axes_fit.values()])
                    for kind in lines}
    overheads = [max(lines[kind][0] - ring_latency[kind], 0.0) for kind in lines]
    both, all_axes = [c["step_collectives"].get("all_axes_all_reduce") for c in comp], None
    if both[0] is not None:
        all_axes = {**both[0], "seconds": _mean([x["seconds"] for x in both])}
        ring = sum(collective_time("all_reduce", all_axes["nbytes"], f["size"], link) for f in axes_fit.values())
        overheads.append(max(all_axes["seconds"] - ring, 0.0) / all_axes["collectives"])
    return overheads, all_axes


def _priced_link(links: list):
    """The one Link a calibrated profile prices every axis with (`intra_node`; one machine is one
    node): the slowest axis's."""
    return min(links, key=lambda l: l.bandwidth)


def _line(points) -> tuple[float, float]:
    """Least-squares (intercept, slope) of seconds against bytes."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def _mean(xs) -> float:
    return sum(xs) / len(xs)


# the lowest attention_efficiency written (a profile needs > 0): 100x below the matmul rate, far under
# what was measured (0.38-0.69 on a CPU's flash kernel, 0.87 on an H200), so it only guards a broken timing
MIN_ATTENTION_EFFICIENCY = 0.01


def _attention_efficiency(comp: list[dict], profile) -> float:
    """The fraction of the matmul rate that makes the planner's price of the measured attention (forward
    and backward, `compute.op_times` at efficiency 1) equal to its median time over ranks."""
    import torch

    from ..cost_model.compute import op_times
    a = comp[0]["attention"]
    at_full = dataclasses.replace(profile, attention_efficiency=1.0)
    fwd, bwd = op_times(a["flops"], a["bytes"], getattr(torch, a["dtype"]), at_full, family="attention",
                        op="aten.scaled_dot_product_attention")
    ratio = (fwd + bwd) / statistics.median(c["attention"]["seconds"] for c in comp)
    return min(max(ratio, MIN_ATTENTION_EFFICIENCY), 1.0)
