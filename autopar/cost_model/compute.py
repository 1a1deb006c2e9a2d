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

`op_times` prices one op's forward and backward together, per op: attention (SDPA, flash) runs
on the matrix units like a matmul, and each backward is its forward time times the factor of
BACKWARD_FACTORS, the ratio of the work (FLOPs for matmuls, bytes for memory-bound kernels) the
backward kernels do to the forward's; the table says where each factor comes from.
`backward_time` keeps the two-factor v1 rule the planner uses.
"""
from __future__ import annotations

import torch

from .profiles import DeviceProfile

__all__ = ["compute_time", "backward_time", "op_times", "backward_factor", "BACKWARD_FACTORS", "TENSOR_CORE_FAMILIES",
           "matmul_efficiency_at", "optimizer_step_time", "POINTWISE_EFFICIENCY",
           "OPTIMIZER_STEP_BYTES",
           "BACKWARD_FLOPS_FACTOR_MATMUL", "BACKWARD_FLOPS_FACTOR_OTHER"]

# Pointwise and reduction kernels mix non-FMA work (exp, div, compares, index math) and reach
# about half the vector FMA peak at best. v1 guess; it seldom matters since they are memory-bound.
POINTWISE_EFFICIENCY = 0.5
# Y = X W: the backward computes dX = dY W^T and dW = X^T dY, each a matmul of the forward's size.
BACKWARD_FLOPS_FACTOR_MATMUL = 2.0
# A pointwise/normalisation backward reads the saved input and the output gradient and writes one
# gradient: about the forward's traffic (it is memory-bound), hence about its time.
BACKWARD_FLOPS_FACTOR_OTHER = 1.0


# Families whose FLOPs run on the matrix units (tensor cores) at the matmul rate and curve.
TENSOR_CORE_FAMILIES = ("matmul", "attention")

# Backward time / forward time, per op (aten name) or family, from the work each backward does.
# Memory-bound kernels in units of tensors of the forward output's size moved (forward: read x,
# write y = 2; a dropout mask counts 1/2 in fp16).
BACKWARD_FACTORS: dict[str, float] = {
    # matmul: dX = dY W^T and dW = X^T dY, two products of the forward's size
    "matmul": 2.0,
    # SDPA / flash attention: the backward recomputes the scores and runs 5 products to the
    # forward's 2 (Dao 2023, FlashAttention-2, section 3.2: backward = 2.5x forward FLOPs)
    "attention": 2.5,
    # layer norm: dx (read x, dy; write dx) plus the dgamma/dbeta reduction (read x, dy again):
    # 5 tensor passes to the forward's 2, as PyTorch's and apex's kernels run it
    "norm": 2.5,
    # softmax: read y and dy, write dx: 3 passes to 2
    "softmax": 1.5,
    # element-wise with a saved input (gelu, silu, tanh, exp, ...): read x and dy, write dx: 3 to 2
    "pointwise": 1.5,
    # add/sub: the gradient passes through to both inputs, no kernel
    "aten.add": 0.0, "aten.sub": 0.0,
    # neg, multiply by a constant, casts, dropout: read dy (and the 1-byte mask), write dx: as forward
    "aten.neg": 1.0, "aten.mul": 1.0, "aten._to_copy": 1.0, "aten.to": 1.0, "aten.type_as": 1.0,
    "aten.native_dropout": 1.0, "aten.dropout": 1.0,
    # cross-entropy: log-softmax backward (read log-probs and dy, write dlogits) and the nll
    # scatter: ~ 2 passes over the logits to the forward's 2 (read, write log-probs)
    "loss": 1.0,
    # embedding: scatter-add dy into the weight gradient, reading dy once and writing as much
    "embedding": 1.0,
}
_DEFAULT_BACKWARD = 1.0


def backward_factor(op: str | None, family: str | None) -> float:
    """Backward/forward time ratio for an op (its aten name, e.g. "aten.gelu") of a rule family."""
    if op is not None and op in BACKWARD_FACTORS:
        return BACKWARD_FACTORS[op]
    return BACKWARD_FACTORS.get(family or "", _DEFAULT_BACKWARD)


def op_times(flops: float, bytes_moved: float, dtype: torch.dtype, profile: DeviceProfile, *,
             family: str | None, op: str | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of one op's share of work on one device."""
    fwd = compute_time(flops, bytes_moved, dtype, profile, is_matmul=family in TENSOR_CORE_FAMILIES)
    return fwd, fwd * backward_factor(op, family)


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


# Bytes an AdamW step moves per parameter element (a fused / foreach kernel, memory-bound):
# fp32: read param, grad, exp_avg, exp_avg_sq (16), write param, exp_avg, exp_avg_sq (12) = 28;
# mixed: read the 16-bit grad (2) and the fp32 master, exp_avg, exp_avg_sq (12), write those three
# (12) and the 16-bit parameter copy (2) = 28 as well. SGD: read param and grad, write param = 12.
OPTIMIZER_STEP_BYTES = {"adamw": 28.0, "adam": 28.0, "sgd": 12.0}


def optimizer_step_time(local_elements: float, profile: DeviceProfile, optimizer: str = "adamw") -> float:
    """Seconds of the optimizer step over `local_elements` parameter elements on one device."""
    if local_elements <= 0:
        return 0.0
    nbytes = local_elements * OPTIMIZER_STEP_BYTES[optimizer]
    return nbytes / (profile.memory_bandwidth * profile.memory_efficiency) + profile.kernel_overhead
