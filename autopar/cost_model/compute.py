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

Matmuls whose caller gives the bytes they read (`in_bytes`) and write (`out_bytes`) are priced with
the output store after the main loop (`matmul_time`): a GEMM kernel computes each output tile over the
whole K loop, then writes it (its epilogue), so the store adds to the time rather than hiding under it:

    time = max(flops / rate, in_bytes / bandwidth) + out_bytes / bandwidth

Per output element that is 2K FLOPs plus `itemsize` bytes: the efficiency falls as K / (K + K0) with
K0 = rate * itemsize / (2 * bandwidth) (136 for fp16 on the A100 profile), which is what sinks the
attention score product QK^T (K = head_dim, an s x s output). Its backward is priced per product
(`matmul_backward_time`). Without in/out bytes (callers with FLOPs only), the roofline above.

`op_times` prices one op's forward and backward together, per op: attention (SDPA, flash) runs
on the matrix units like a matmul, and each backward is its forward time times the factor of
BACKWARD_FACTORS, the ratio of the work (FLOPs for matmuls, bytes for memory-bound kernels) the
backward kernels do to the forward's; the table says where each factor comes from.
The planner and `autopar.estimate` both price ops with it (through `ops.op_cost`).
"""
from __future__ import annotations

import torch

from .profiles import DeviceProfile
from ..symbolic import is_zero, smax

__all__ = ["compute_time", "op_times", "backward_factor", "BACKWARD_FACTORS", "HIDDEN_OUTPUT_PASSES", "TENSOR_CORE_FAMILIES",
           "RANDOM_OPS", "random_time", "TRAINING_FLOPS_FACTOR", "step_flops",
           "matmul_efficiency_at", "matmul_time", "matmul_backward_time", "optimizer_step_time", "POINTWISE_EFFICIENCY",
           "OPTIMIZER_STEP_BYTES", "MIXED_PRECISION_STEP_EXTRA_BYTES",
           "GRAD_ACCUMULATION_PASSES", "grad_accumulation_time", "optimizer_seconds"]

# Pointwise and reduction kernels mix non-FMA work (exp, div, compares, index math) and reach
# about half the vector FMA peak at best. v1 guess; it seldom matters since they are memory-bound.
POINTWISE_EFFICIENCY = 0.5


# Families whose FLOPs run on the matrix units (tensor cores) at the matmul rate and curve.
# A MoE experts op (`autopar::moe_experts`) is grouped matmuls: every routed token-slot through its
# expert's gate/up and down projections, run as one grouped GEMM over the local experts (as
# torch._grouped_mm, Megablocks and Megatron's GroupedMLP do), priced as one matmul of its FLOPs.
TENSOR_CORE_FAMILIES = ("matmul", "attention", "moe")

# Backward time / forward time, per op (aten name) or family, from the work each backward does.
# Memory-bound kernels in units of tensors of the forward output's size moved (forward: read x,
# write y = 2; a dropout mask counts 1/2 in fp16).
BACKWARD_FACTORS: dict[str, float] = {
    # matmul: dX = dY W^T and dW = X^T dY, two products of the forward's size
    "matmul": 2.0,
    # MoE experts (grouped matmuls): dX and dW per expert, twice the forward's products
    "moe": 2.0,
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
    # clone (a copy): the gradient passes through, no kernel
    "aten.clone": 0.0, "aten.lift_fresh_copy": 0.0,
    # neg, multiply by a constant, casts, dropout: read dy (and the 1-byte mask), write dx: as forward
    # (a product with more than one input needing a gradient runs more kernels: cost_model/autograd.py)
    "aten.neg": 1.0, "aten.mul": 1.0, "aten._to_copy": 1.0, "aten.to": 1.0, "aten.type_as": 1.0,
    "aten.native_dropout": 1.0, "aten.dropout": 1.0,
    # cross-entropy = log_softmax + nll_loss. Forward: read the logits, write the log-probs (2 passes;
    # the log-probs are an intermediate the graph does not show: HIDDEN_OUTPUT_PASSES). Backward:
    # nll_loss_backward writes a logits-sized gradient (zeros, then the scatter: 1 pass) and
    # log_softmax_backward reads it and the log-probs and writes dlogits (3): 4 passes to 2
    "aten.cross_entropy_loss": 2.0,
    # mse/l1/smooth-l1: forward reads input and target (2 passes), backward reads both and writes
    # the gradient (3)
    "aten.mse_loss": 1.5, "aten.l1_loss": 1.5, "aten.smooth_l1_loss": 1.5,
    # nll_loss on log-probs: backward writes the input-sized gradient, as much as the forward reads
    "loss": 1.0,
    # embedding: scatter-add dy into the weight gradient, reading dy once and writing as much
    "embedding": 1.0,
}
_DEFAULT_BACKWARD = 1.0

# Ops that draw a random number per output element (dropout's mask): besides their memory traffic
# they pay profile.rng_element_time per element, measured by `autopar calibrate` (Philox on GPU runs
# mostly under the memory traffic; a CPU's generator is ~60x slower than a copy of the same bytes).
RANDOM_OPS = ("aten.native_dropout", "aten.dropout", "aten.bernoulli", "aten.rand_like", "aten.randn_like",
              "aten.rand", "aten.randn", "aten.randint")


def random_time(elements: float, profile: DeviceProfile) -> float:
    """Seconds to draw `elements` random numbers beyond moving their bytes."""
    return elements * profile.rng_element_time if profile.rng_element_time else 0.0


# Ops that write an input-sized intermediate of their own besides their outputs (passes over what
# they read): cross-entropy's log-probabilities, kept for its backward.
HIDDEN_OUTPUT_PASSES: dict[str, float] = {"aten.cross_entropy_loss": 1.0}


# Model FLOPs of an op in a training step (Megatron-LM's and PaLM's count, 6 N per token for a dense model):
# its forward, and where its output needs a gradient a backward of twice the forward's (dX and dW)
TRAINING_FLOPS_FACTOR = 3.0


def step_flops(flops: float, needs_grad: bool) -> float:
    """Model FLOPs of an op of `flops` forward FLOPs in a training step (TRAINING_FLOPS_FACTOR)."""
    return flops * (TRAINING_FLOPS_FACTOR if needs_grad else 1.0)


def backward_factor(op: str | None, family: str | None) -> float:
    """Backward/forward time ratio for an op (its aten name, e.g. "aten.gelu") of a rule family."""
    if op is not None and op in BACKWARD_FACTORS:
        return BACKWARD_FACTORS[op]
    return BACKWARD_FACTORS.get(family or "", _DEFAULT_BACKWARD)


def op_times(flops: float, bytes_moved: float, dtype: torch.dtype, profile: DeviceProfile, *,
             family: str | None, op: str | None = None, in_bytes: float | None = None,
             out_bytes: float | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of one op's share of work on one device. `in_bytes`/`out_bytes`:
    what the op reads and writes on this device; with them a matmul is priced with its output store
    after the main loop (`matmul_time`), forward and backward."""
    if family == "matmul" and in_bytes is not None and out_bytes is not None and not is_zero(flops):
        return (matmul_time(flops, in_bytes, out_bytes, dtype, profile),
                matmul_backward_time(flops, in_bytes, out_bytes, dtype, profile))
    if op in HIDDEN_OUTPUT_PASSES and in_bytes is not None:
        bytes_moved = bytes_moved + HIDDEN_OUTPUT_PASSES[op] * in_bytes
    fwd = compute_time(flops, bytes_moved, dtype, profile, is_matmul=family in TENSOR_CORE_FAMILIES,
                       efficiency=profile.attention_efficiency if family == "attention" else 1.0)
    return fwd, fwd * backward_factor(op, family)


def matmul_time(flops: float, in_bytes: float, out_bytes: float, dtype: torch.dtype,
                profile: DeviceProfile) -> float:
    """Seconds of one matmul (Y = X W, or a batch of them): the main loop, bound by the tensor cores or
    by reading the operands, then the store of the output tiles (module docstring)."""
    rate, bw = _matmul_rates(flops, dtype, profile)
    return smax(flops / rate, in_bytes / bw) + out_bytes / bw + profile.kernel_overhead


def matmul_backward_time(flops: float, in_bytes: float, out_bytes: float, dtype: torch.dtype,
                         profile: DeviceProfile) -> float:
    """Seconds of a matmul's backward: dX = dY W^T and dW = X^T dY, each as many FLOPs as the forward,
    reading dY twice and X, W once; their outputs are the forward's inputs, stored after the loop."""
    rate, bw = _matmul_rates(flops, dtype, profile)
    return (smax(2 * flops / rate, (in_bytes + 2 * out_bytes) / bw) + in_bytes / bw
            + 2 * profile.kernel_overhead)


def _matmul_rates(flops: float, dtype: torch.dtype, profile: DeviceProfile) -> tuple[float, float]:
    """(FLOP/s a matmul of `flops` reaches, achieved memory bandwidth) on one device."""
    return (profile.flops_for(dtype) * matmul_efficiency_at(flops, dtype, profile),
            profile.memory_bandwidth * profile.memory_efficiency)


def matmul_efficiency_at(flops: float, dtype: torch.dtype, profile: DeviceProfile) -> float:
    """Fraction of peak a matmul of `flops` reaches; increases with size towards matmul_efficiency."""
    half = profile.matmul_ramp_time * profile.flops_for(dtype) * profile.matmul_efficiency
    return profile.matmul_efficiency * flops / (flops + half)


def compute_time(flops: float, bytes_moved: float, dtype: torch.dtype, profile: DeviceProfile, *,
                 is_matmul: bool, efficiency: float = 1.0) -> float:
    """Seconds for one op on one device: roofline of its FLOPs and memory traffic, plus launch cost.
    `efficiency`: the fraction of the matmul rate the op's kernel reaches (fused attention's)."""
    if is_zero(flops) and is_zero(bytes_moved):
        return 0.0  # views and metadata ops launch no kernel
    if is_matmul:
        rate = profile.flops_for(dtype) * matmul_efficiency_at(flops, dtype, profile) * efficiency
    else:
        rate = profile.peak_flops["float32"] * POINTWISE_EFFICIENCY
    t_flops = 0.0 if is_zero(flops) else flops / rate
    t_memory = bytes_moved / (profile.memory_bandwidth * profile.memory_efficiency)
    return smax(t_flops, t_memory) + profile.kernel_overhead


# Bytes an AdamW step moves per parameter element (a fused / foreach kernel, memory-bound):
# fp32: read param, grad, exp_avg, exp_avg_sq (16), write param, exp_avg, exp_avg_sq (12) = 28;
# mixed: read the 16-bit grad (2) and the fp32 master, exp_avg, exp_avg_sq (12), write those three
# (12) and the 16-bit parameter copy (2) = 28 as well. SGD: read param and grad, write param = 12.
OPTIMIZER_STEP_BYTES = {"adamw": 28.0, "adam": 28.0, "sgd": 12.0}
# fp16 mixed precision with loss scaling and gradient clipping, as Megatron-LM's
# Float16OptimizerWithFloat16Params runs it (megatron/optimizer/optimizer.py, 2021): besides the
# fp32 Adam kernel above (28), separate passes per element: 16-bit model grad -> fp32 main grad
# (read 2, write 4), unscale by the loss scale with the inf/nan check (read 4, write 4), the
# gradient's L2 norm for clipping (read 4), fp32 main param -> 16-bit model param (read 4, write 2).
MIXED_PRECISION_STEP_EXTRA_BYTES = 6.0 + 8.0 + 4.0 + 6.0
# Accumulating a parameter's gradient over microbatches: every microbatch after the first adds its
# gradient into the accumulated one in the parameter's dtype (read both, write the sum): PyTorch's
# AccumulateGrad (`grad += new_grad`), Megatron-LM's local DDP hook (`main_grad.add_(grad)`).
GRAD_ACCUMULATION_PASSES = 3.0


def optimizer_step_time(local_elements: float, profile: DeviceProfile, optimizer: str = "adamw", *,
                        extra_bytes_per_element: float = 0.0) -> float:
    """Seconds of the optimizer step over `local_elements` parameter elements on one device
    (`extra_bytes_per_element`: further passes, e.g. MIXED_PRECISION_STEP_EXTRA_BYTES)."""
    if local_elements <= 0:
        return 0.0
    nbytes = local_elements * (OPTIMIZER_STEP_BYTES[optimizer] + extra_bytes_per_element)
    return nbytes / (profile.memory_bandwidth * profile.memory_efficiency) + profile.kernel_overhead


def optimizer_seconds(local_elements: float, tensors: float, profile: DeviceProfile, optimizer: str = "adamw",
                      mixed: bool = False) -> float:
    """Seconds of one optimizer step on a device holding `local_elements` elements in `tensors`
    parameter tensors: the profile's measured rate per element where it has one, else the
    memory-bound fused kernel (mixed precision: the master-weight passes too), plus the
    optimizer's per-tensor cost. The one price of the step (planner and `autopar.estimate`)."""
    extra = MIXED_PRECISION_STEP_EXTRA_BYTES if mixed else 0.0
    step = (local_elements * profile.optimizer_element_time if profile.optimizer_element_time > 0
            else optimizer_step_time(local_elements, profile, optimizer, extra_bytes_per_element=extra))
    return step + tensors * profile.optimizer_param_overhead


def grad_accumulation_time(grad_bytes: float, tensors: float, profile: DeviceProfile) -> float:
    """Seconds to add one microbatch's parameter gradients (`grad_bytes` in `tensors` tensors, one
    kernel each) into the accumulated gradients on one device."""
    if grad_bytes <= 0:
        return 0.0
    return (GRAD_ACCUMULATION_PASSES * grad_bytes / (profile.memory_bandwidth * profile.memory_efficiency)
            + tensors * profile.kernel_overhead)
