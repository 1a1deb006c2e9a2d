"""Quick accounts that order and prune the planner's searches; neither is a plan's price (the
evaluator, `solver/evaluate.py`, prices every plan a search returns or reports).

* `pipeline_floor`: a lower bound on a pipeline candidate's step (`pipeline.step_floor`) from the
  whole batch's graph; the pipeline search (`planner/pipeline_search.py`) does not solve a candidate
  whose floor is above a plan found.
* `mesh_bound` and `screen_step`: the mesh screen's (`planner/mesh_screen.py`) lower bound on any plan
  of a mesh, and its Megatron-style account of one step (Narayanan et al. 2021; Korthikanti et al.
  2022) that orders the meshes the mesh search plans.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..strategies import op_name, rule_for
from .comm import collective_time, p2p_time
from .compute import POINTWISE_EFFICIENCY, TENSOR_CORE_FAMILIES, backward_factor
from .memory import state_bytes_per_element
from .ops import op_facts
from .pipeline import step_floor

ROLES = ("dp", "pp", "cp", "ep", "tp")      # the mesh screen's axis roles, outermost first
ACTIVATION_FACTOR = 17.0     # bytes a transformer layer saves for its backward over its output's bytes: 34sbh of
                             # Korthikanti et al. 2022 (fused attention: no s^2 term) over the 2sbh output
TP_COLLECTIVES = 4           # all-reduces of a layer's output per layer under 1D tensor parallelism (2 forward,
                             # 2 backward: attention and MLP, Megatron-LM)
CP_EXCHANGES = 2             # K/V all-gathered in the forward, their gradients reduce-scattered in the backward
EP_ALL_TO_ALLS = 4           # dispatch and combine, forward and backward
RECOMPUTE_FACTOR = 4.0 / 3.0  # full recomputation runs the forward twice: (1 + 1 + 2) / (1 + 2)
BACKWARD_FLOPS = 2.0          # a matmul's backward is two products (dX, dW) of the forward's FLOPs



def pipeline_floor(graph, infos, mesh):
    """Candidate -> a lower bound on its step (`cost_model.pipeline.step_floor`) from the whole batch's
    graph. Each device's time is at least its share of the FLOPs at the profile's best rate (a
    tensor-core op's backward at its FLOP ratio where its output needs a gradient) plus the fixed costs
    of the kernels it runs, per microbatch: every op that does work launches a kernel
    (`compute.compute_time`: at least `kernel_overhead`; a tensor-core op with FLOPs also loses the
    `matmul_ramp_time` of its efficiency curve), and where its output needs a gradient (floating point
    from a parameter: `solver/nodes.needs_grad`'s rule) its backward costs at least its factor times that
    (`compute.op_times`; a matmul's is two such kernels), plus one launch per kernel of autograd's work
    beyond it (`autograd.grad_work`); every chunk but the first receives its input (a send's latency,
    forward and backward). Summed over the devices and averaged, per pipeline rank and microbatch:
    t >= work / m + fixed / p, and the step T >= (m + (p - 1) / v) t (`step_floor`)."""
    prof = mesh.profile
    rate = max(prof.peak_flops.values()) * max(prof.matmul_efficiency, POINTWISE_EFFICIENCY)
    grad: dict[str, bool] = {}
    flops, fixed = 0.0, 0.0
    for n in graph.nodes:
        v = n.meta.get("val")
        floating = isinstance(v, torch.Tensor) and v.dtype.is_floating_point
        grad[n.name] = floating and ((n.op == "placeholder" and v.requires_grad) or any(
            grad.get(a.name, False) for a in n.all_input_nodes))
        if n.op != "call_function" or n.name not in infos:
            continue
        rule = rule_for(n.target)
        info = infos[n.name]
        if rule is not None and rule.is_view or (info.flops <= 0 and info.bytes_moved <= 0):
            continue
        family = rule.family if rule is not None else None
        tensor_core = family in TENSOR_CORE_FAMILIES and info.flops > 0
        kernel = prof.kernel_overhead + (prof.matmul_ramp_time if tensor_core else 0.0)
        back = backward_factor(op_name(n.target), family) if grad[n.name] else 0.0
        work = op_facts(n, infos, grad).work if grad[n.name] else None
        fixed += kernel * (1.0 + back) + (work.kernels + work.sums if work else 0) * prof.kernel_overhead
        flops += info.flops * (1.0 + (back if tensor_core else 0.0))
    work_s = flops / (mesh.size * rate)

    def floor(c: Candidate) -> float:
        sends = 0.0     # every chunk but the first receives its input (priced in its forward and backward)
        if c.stages > 1:
            sends = 2 * (c.stages * c.virtual_stages - 1) * p2p_time(1.0, mesh.axes[mesh.axis_index(c.axis)].link)
        per_rank = work_s + (fixed + sends) * c.microbatches / c.stages     # m t: the rank's work of a step
        return step_floor(per_rank, 0.0, c.stages, c.microbatches, c.schedule, c.virtual_stages)
    return floor


def mesh_bound(mesh, flops: float, pp: int, microbatches: int, virtual_stages: int) -> float:
    """A lower bound on any plan's step on `mesh`: the forward and backward FLOPs (`flops` forward)
    spread evenly over the devices at the dense peak times the matmul efficiency (the cost model runs
    no op faster), stretched by the bubble of `pp` stages at their most virtual stages."""
    prof = mesh.profile
    floor = flops * (1 + BACKWARD_FLOPS) / (mesh.size * max(prof.peak_flops.values()) * prof.matmul_efficiency)
    return floor * (1 + (pp - 1) / (microbatches * virtual_stages))


def _link(mesh, role: str):
    return mesh.axes[mesh.axis_names.index(role)].link if role in mesh.axis_names else None


def screen_step(mesh, facts, d: Mapping[str, int], m: int, v: int, budget: float, optimizer: str,
              precision: str) -> tuple[float, bool]:
    """(seconds of one step by the screen's account, whether its memory fits `budget`)."""
    prof = mesh.profile
    dtype_peak = max(prof.peak_flops.values()) if facts.param_itemsize == 2 else prof.peak_flops["float32"]
    compute = facts.flops * (1 + BACKWARD_FLOPS) / (mesh.size * dtype_peak * prof.matmul_efficiency)
    tokens_split = d["dp"] * d["cp"] * d["ep"] * m
    out = facts.layer_out_bytes / tokens_split           # one layer's output for one microbatch on one device
    per_rank_layers = facts.layers / d["pp"]
    compute *= math.ceil(facts.layers / (d["pp"] * v)) * v / max(per_rank_layers, 1e-9) if d["pp"] > 1 else 1.0
    elems = facts.dense_elements / (d["tp"] * d["pp"]) + facts.expert_elements / (d["tp"] * d["pp"] * d["ep"])
    state = elems * state_bytes_per_element(facts.param_itemsize, optimizer, precision) / (d["dp"] * d["cp"])
    in_flight = min(m, d["pp"]) if d["pp"] > 1 else 1
    saved = per_rank_layers * in_flight * out / (d["tp"] * d["cp"])
    fits = state + saved * ACTIVATION_FACTOR <= budget
    if not fits:                      # full recomputation: a layer's input kept, one layer's activations live
        compute *= RECOMPUTE_FACTOR
        fits = state + saved + ACTIVATION_FACTOR * out / d["tp"] <= budget
    comm = 0.0
    layer_runs = per_rank_layers * m
    if d["tp"] > 1:
        comm += layer_runs * TP_COLLECTIVES * collective_time("all_reduce", out, d["tp"], _link(mesh, "tp"))
    if d["cp"] > 1:
        comm += layer_runs * CP_EXCHANGES * collective_time("all_gather", out * d["cp"], d["cp"], _link(mesh, "cp"))
    if d["ep"] > 1:
        comm += layer_runs * EP_ALL_TO_ALLS * collective_time("all_to_all", out * max(facts.top_k, 1), d["ep"],
                                                              _link(mesh, "ep"))
    if d["pp"] > 1:
        comm += 2 * m * v * p2p_time(out / d["tp"], _link(mesh, "pp"))
    data = d["dp"] * d["cp"]
    if data > 1:
        outer = next(r for r in ROLES if d[r] > 1 and r in ("dp", "cp"))
        grads = elems * facts.param_itemsize
        comm += (1 - prof.grad_sync_overlap) * collective_time("all_reduce", grads, d[outer], _link(mesh, outer))
    bubble = compute * (d["pp"] - 1) / (m * v)
    return compute + bubble + comm, fits
