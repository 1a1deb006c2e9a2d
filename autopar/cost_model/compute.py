"""Roofline time of one op on one device.

    time = max(flops / (peak(dtype) * efficiency), bytes / (memory_bandwidth * memory_efficiency))
           + kernel_overhead                                      (0 when the op moves and computes nothing)

Matmuls run at the peak for their dtype with an efficiency that falls for small problems
(too few output tiles to fill the device), a v1 heuristic to be calibrated:

    efficiency(flops) = matmul_efficiency * flops / (flops + half),
    half = matmul_ramp_time * peak(dtype) * matmul_efficiency

i.e. a matmul takes its ideal time plus a fixed ramp-up `matmul_ramp_time`. The ramp is a profile
figure in seconds rather than FLOPs so that slower dtypes (fp32) get the same ramp, not a longer one.
Other ops (pointwise, reductions, softmax) run on the vector units at the fp32 rate (they
compute in fp32 internally), times POINTWISE_EFFICIENCY; nearly always their memory term binds.
"""
from __future__ import annotations

import torch

from .profiles import DeviceProfile

__all__ = ["compute_time", "backward_time", "matmul_efficiency_at", "POINTWISE_EFFICIENCY",
           "BACKWARD_FLOPS_FACTOR_MATMUL", "BACKWARD_FLOPS_FACTOR_OTHER"]

# Pointwise and reduction kernels mix non-FMA work (exp, div, compares, index math) and reach
# about half the vector FMA peak at best. v1 guess; it seldom matters since they are memory-bound.
POINTWISE_EFFICIENCY = 0.5
# Y = X W: the backward computes dX = dY W^T and dW = X^T dY, each a matmul of the forward's size.
BACKWARD_FLOPS_FACTOR_MATMUL = 2.0
# A pointwise/normalisation backward reads the saved input and the output gradient and writes one
# gradient: about the forward's traffic (it is memory-bound), hence about its time.
BACKWARD_FLOPS_FACTOR_OTHER = 1.0


def matmul_efficiency_at(flops: float, dtype: torch.dtype, profile: DeviceProfile) -> float:
    """Fraction of peak a matmul of `flops` reaches; increases with size towards matmul_efficiency."""
    half = profile.matmul_ramp_time * profile.flops_for(dtype) * profile.matmul_efficiency
    return profile.matmul_efficiency * flops / (flops + half)


def compute_time(flops: float, bytes_moved: float, dtype: torch.dtype, profile: DeviceProfile, *,
                 is_matmul: bool) -> float:
    """Seconds for one op on one device: roofline of its FLOPs and memory traffic, plus launch cost."""
    if flops <= 0 and bytes_moved <= 0:
        return 0.0  # views and metadata ops launch no kernel
    if is_matmul:
        rate = profile.flops_for(dtype) * matmul_efficiency_at(flops, dtype, profile)
    else:
        rate = profile.peak_flops["float32"] * POINTWISE_EFFICIENCY
    t_flops = flops / rate if flops > 0 else 0.0
    t_memory = bytes_moved / (profile.memory_bandwidth * profile.memory_efficiency)
    return max(t_flops, t_memory) + profile.kernel_overhead


def backward_time(fwd_time: float, is_matmul: bool) -> float:
    """Seconds of the op's backward, scaled from its forward time."""
    return fwd_time * (BACKWARD_FLOPS_FACTOR_MATMUL if is_matmul else BACKWARD_FLOPS_FACTOR_OTHER)
