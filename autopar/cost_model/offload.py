"""Moving bytes to the host or disk and back, and the optimizer step the host runs (`Plan.offload`).

The runtime copies synchronously (no copy stream overlapping compute yet: `runtime/offload.py`,
`runtime/param_offload.py`, `runtime/grad_offload.py`), so `copies` copies of b bytes over a link of
bandwidth B and latency alpha take

    copies * b / B + copies * alpha

which the offload family (`solver/decisions/offload.py`) states as linear terms of the bytes its
choices move (`transfer_terms`: seconds per byte, seconds per tensor). The host's optimizer step
(ZeRO-Offload) moves the gradient out and the parameter back and steps each element at the profile's
`host_optimizer_element_time` (`host_step_seconds`, its latency one `transfer_terms` term).
"""
from __future__ import annotations

from .profiles import DeviceProfile


def transfer_terms(link, copies: float) -> tuple[float, float]:
    """(seconds per byte, seconds per tensor) of `copies` synchronous copies over `link`."""
    return copies / link.bandwidth, copies * link.latency


def host_step_seconds(moved_bytes: float, elements: float, profile: DeviceProfile) -> float:
    """Seconds of one parameter's host optimizer step beyond its copies' latency: its gradient and
    parameter (`moved_bytes`) over the host link, its `elements` stepped on the host."""
    return moved_bytes / profile.host_link.bandwidth + elements * profile.host_optimizer_element_time
