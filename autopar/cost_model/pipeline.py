"""Pipeline parallelism: the step time of a synchronous (flushing) schedule from per-device costs.

p devices in a pipeline each hold `virtual` model chunks (v = 1: GPipe or 1F1B, which take the
same time and differ in memory; v > 1: the interleaved 1F1B schedule of Narayanan et al. 2021,
section 2.2.2). For one microbatch, device d spends f_d in forward and b_d in backward
(recomputation included), and sends its activations forward and receives gradients back once
per chunk boundary (c_d). With m microbatches per step:

    t_d = f_d + b_d + c_d,       c_d = v * (p2p_forward + p2p_backward)   (0 when p == 1)
    T   = m * max_d t_d  +  (sum_d t_d - max_d t_d) / v

For equal devices T = (m + (p - 1) / v) * t: the pipeline bubble (p - 1) / (v m) of the paper.
For v = 1 it is Alpa's formula sum_d t_d + (m - 1) max_d t_d: the first microbatch fills the
pipeline, the slowest device paces the other m - 1, the last one drains it. Transfers sit on the
critical path (Megatron's schedules wait on their send/recv pairs), which is why interleaving,
with v times more boundaries, pays v times more point-to-point time.

Zero bubble (ZB-1P; Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): the backward is split
into the input gradient B and the weight gradient W, and the Ws fill the bubbles of the drain. The
paper's handcrafted schedule ZB-H1 keeps 1F1B's memory and shrinks the bubble from
(p - 1)(F + B + W) to (p - 1)(F + B - W); its automatic ZB-1P at 1F1B's memory is at least as good,
so we price it by ZB-H1's bubble: with w_d the weight-gradient seconds of device d,

    T = m * max_d t_d  +  sum_d (t_d - 2 w_d) - max_d (t_d - 2 w_d)

The zero-bubble weight pass reduces each parameter's gradient per microbatch (runtime/pipeline.py):
those reductions are priced inside w_d (solver/evaluate.py), m of them per step.

In-flight microbatches (activation memory): 1F1B keeps p - d forward passes in flight on device d,
GPipe all m; interleaved 1F1B keeps (p - d - 1) * 2 + (v - 1) * p + 1 chunk-forwards of 1/v of
the device's activations each (Megatron's warm-up count), at most m * v; zb (torch's
ScheduleInterleavedZeroBubble, ZB-H1's memory bound) warms up one chunk-forward per hop instead of
two: (p - d - 1) + (v - 1) * p + 1, at most m * v, which is 1F1B's p - d at v = 1.

Which schedules take virtual stages (`check_schedule`): "interleaved" and "zb"; the planner, the
estimate and the runtime all ask this one rule.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Pipeline", "PipelineTime", "pipeline_time", "step_floor", "in_flight_microbatches", "check_schedule", "SCHEDULES"]

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb")
VIRTUAL_SCHEDULES = ("interleaved", "zb")     # schedules running several chunks per device


def check_schedule(schedule: str, virtual_stages: int) -> str | None:
    """Why `schedule` cannot run `virtual_stages` chunks per device (None: it can)."""
    if schedule not in SCHEDULES:
        return f"unknown pipeline schedule {schedule!r}: use one of {', '.join(SCHEDULES)}"
    if virtual_stages > 1 and schedule not in VIRTUAL_SCHEDULES:
        return (f"virtual_stages={virtual_stages} needs schedule 'interleaved' or 'zb'; {schedule!r} runs one "
                f"chunk per stage")
    return None


@dataclass(frozen=True, slots=True)
class Pipeline:
    """How a model is pipelined: `stages` devices along mesh axis `axis`, `microbatches` per step.

    schedule: "1f1b" (PipeDream-flush, Megatron's default), "gpipe", "zb" (zero bubble, ZB-1P), or
    "interleaved"; "interleaved" and "zb" take `virtual_stages` chunks per device (`autopar.estimate` takes it as the
    planner's `pipeline=` dict).
    """
    stages: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    axis: str | None = "pp"

    def __post_init__(self) -> None:
        if self.stages < 1 or self.microbatches < 1 or self.virtual_stages < 1:
            raise ValueError(f"{self!r}: stages, microbatches and virtual_stages must be >= 1")
        why = check_schedule(self.schedule, self.virtual_stages)
        if why is not None:
            raise ValueError(why)
        if self.stages > 1 and self.axis is None:
            raise ValueError("a pipeline of several stages needs the mesh axis it runs along (axis=...)")


@dataclass(frozen=True, slots=True)
class PipelineTime:
    total_s: float                 # T
    busy_s: float                  # m * max_d t_d (the pace-setting device's own work)
    bubble_s: float                # T - busy_s: fill and drain
    p2p_s: float                   # point-to-point time on the critical path (inside busy and bubble)
    per_device_s: tuple[float, ...]  # t_d, one microbatch

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_s / self.busy_s if self.busy_s else 0.0


def pipeline_time(fwd: Sequence[float], bwd: Sequence[float], microbatches: int, *, virtual_stages: int = 1,
                  p2p_forward: float = 0.0, p2p_backward: float = 0.0,
                  weight_grad: Sequence[float] | None = None) -> PipelineTime:
    """Step time of m microbatches through devices with per-microbatch times fwd[d], bwd[d];
    `weight_grad[d]` (the weight-gradient part of bwd[d]): the zero-bubble schedule's fill and drain."""
    p = len(fwd)
    if p < 1 or len(bwd) != p:
        raise ValueError("pipeline_time: fwd and bwd need one entry per device (at least one)")
    v, m = virtual_stages, microbatches
    c = v * (p2p_forward + p2p_backward) if p > 1 else 0.0
    t = [f + b + c for f, b in zip(fwd, bwd)]
    t_max = max(t)
    fill = t if weight_grad is None else [x - 2.0 * w for x, w in zip(t, weight_grad)]
    total = m * t_max + (sum(fill) - max(fill)) / v
    busy = m * t_max
    p2p = c * (m + (p - 1) / v)
    return PipelineTime(total, busy, total - busy, p2p, tuple(t))


def step_floor(work_s: float, kernels_s: float, stages: int, microbatches: int, schedule: str = "1f1b",
               virtual_stages: int = 1) -> float:
    """A lower bound on `pipeline_time`'s T for any per-device costs: `work_s`, a floor on one
    device's share of the whole step's work (the step's FLOPs over the devices at their best rate),
    and `kernels_s`, a floor on the seconds of one microbatch summed over the pipeline's devices (its
    kernels' fixed costs). T = m t_max + (sum t - t_max) / v is least, for a given sum, at equal
    devices: T >= (m + (p - 1) / v) t with m t >= work_s and p t >= kernels_s; the zero-bubble
    schedule's fill can vanish (T >= m t). Without a pipeline: max(work_s, kernels_s)."""
    p, m, v = stages, microbatches, virtual_stages
    t = max(work_s / m, kernels_s / p)
    return (m + (0.0 if schedule == "zb" else (p - 1) / v)) * t


def in_flight_microbatches(device: int, stages: int, microbatches: int, schedule: str = "1f1b",
                           virtual_stages: int = 1) -> float:
    """Microbatches' worth of forward activations device `device` holds at its peak."""
    p, m, v, d = stages, microbatches, virtual_stages, device
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved" and v > 1:
        chunks = min((p - d - 1) * 2 + (v - 1) * p + 1, m * v)
        return chunks / v
    if schedule == "zb":
        return min((p - d - 1) + (v - 1) * p + 1, m * v) / v
    return float(min(p - d, m))
