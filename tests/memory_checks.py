"""Rank functions for the memory executor tests and benchmark: a plan's memory decisions, trained
on real gloo ranks against one process, with what each step did to memory measured.

`run_variants(rank, world, model, mesh_shape, axes, pins, variants)` plans once (rank 0, shipped
as JSON as a saved plan would be), then for each variant `{"recompute": {...}, "residency":
{...}, "offload": {...}}` sets those dicts on the plan (`dataclasses.replace`), trains STEPS
AdamW steps with `dmodel.optimizer(...)` next to the single-process model, and returns per variant
the worst relative differences (loss, gradients, parameters) and the measurements of the last step.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import autopar  # noqa: E402
from autopar.runtime.memory_meter import MemoryMeter  # noqa: E402
from dist_checks import LR, STEPS, ZERO_GRAD, rel, shard_happy_profile, well_posed_elements  # noqa: E402
from models import GPT, gpt_inputs  # noqa: E402

# Megatron tensor parallelism on a 1-axis "tp" mesh: column qkv/fc, row proj/fc2 (ops left partial)
TP_PINS = {"blocks.*.attn.qkv.*": ("S(0)",), "blocks.*.fc.*": ("S(0)",), "blocks.*.attn.proj.weight": ("S(1)",),
           "blocks.*.fc2.weight": ("S(1)",), "linear_1": ("P",), "linear_3": ("P",), "linear_5": ("P",),
           "linear_7": ("P",),
           # the column products too: with the test profile's free links, gathering the weight instead
           # prices the same, and which of the tied plans the solver returns is not part of the test
           "linear": ("S(2)",), "linear_2": ("S(2)",), "linear_4": ("S(2)",), "linear_6": ("S(2)",)}
# Megatron sequence parallelism (Korthikanti et al. 2022) on top: the residual stream and layer norms of
# the blocks split on the sequence (S(1)) over "tp", so each column matmul all-gathers its input and
# each row matmul's partial output is reduce-scattered into the residual add
SP_PINS = {**TP_PINS, "scaled_dot_product_attention*": ("heads",),
           **{f"add{s}": ("S(1)",) for s in ("", "_1", "_2", "_3", "_4")},
           **{f"layer_norm{s}": ("S(1)",) for s in ("", "_1", "_2", "_3")}}
# ZeRO-3 on a 1-axis "dp" mesh: block weights stored split over dp, every linear batch-split (so it
# gathers its weight)
ZERO3_PINS = {"blocks.*.weight": ("S(0)",), **{f"linear{s}": ("S(0)",) for s in ["", *(f"_{i}" for i in range(1, 8))]}}


NO_MEMORY_DECISIONS = {"recompute": {}, "residency": {}, "offload": {}}


def gpt(dropout: float = 0.0, hidden: int = 32, seq: int = 16, batch: int = 4, layers: int = 2):
    torch.manual_seed(0)
    model = GPT(vocab=64, seq=seq, hidden=hidden, heads=4, layers=layers, dropout=dropout)
    return model, gpt_inputs(batch=batch, seq=seq, vocab=64)


# the planner's own memory decisions are planned under this fraction of the peak of the plan made
# without a budget: the memory the device has would hold the tiny GPT many times over, so it chooses none
PLANNER_BUDGET = 0.8


def saved_plan(model, inputs, mesh, pins, untight=None):
    """Rank 0 plans; every rank gets the same Plan (as a saved plan file would give it). untight: the plan
    made without a budget; then planned under PLANNER_BUDGET of its peak, so that the planner frees memory."""
    def make():
        budget = None if untight is None else PLANNER_BUDGET * untight.estimate.peak_memory_bytes
        # no pipeline: these check the memory decisions' executors, and a pipeline would fit the budget instead
        return autopar.plan(model, inputs, mesh, pins=pins, symbolic=False, memory_budget=budget,
                            pipeline=False).to_json()
    text = [make() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(text, src=0)
    return autopar.Plan.from_json(text[0])


def run_variants(rank, world, mesh_shape, axes, pins, variants, dropout=0.0, model_kw=None, compare=True,
                 bucket_bytes=None, predict=True):
    """bucket_bytes: the profile's `grad_bucket_bytes` (the runtime's gradient buckets and their price);
    predict: the planner's prices of each variant too (`predictions`: a capture and an estimate each), or of
    the variants it names."""
    model, inputs = gpt(dropout, **(model_kw or {}))
    profile = shard_happy_profile()
    if bucket_bytes is not None:
        profile = dataclasses.replace(profile, grad_bucket_bytes=float(bucket_bytes))
    mesh = autopar.Mesh(mesh_shape, axes, device=profile)
    plan = saved_plan(model, inputs, mesh, pins)
    tight = saved_plan(model, inputs, mesh, pins, untight=plan) if None in variants.values() else None
    problems = {}       # the variants share a model, inputs and mesh: one planning problem per plan options
    # only the variant's decisions (the planner's own memory choices cleared); None: the planner's own,
    # made under a budget the plan without decisions exceeds
    return {name: train_variant(copy.deepcopy(model), inputs, mesh,
                                tight if dec is None else dataclasses.replace(plan, **{**NO_MEMORY_DECISIONS, **dec}),
                                compare, problems if predict is True or name in (predict or ()) else None)
            for name, dec in variants.items()}


def unpriced_variants(rank, world, *args):
    """`run_variants` without the planner's prices (`predictions`): for tests that read none of them."""
    return run_variants(rank, world, *args, predict=False)


def train_variant(model, inputs, mesh, plan, compare=True, problems=None):
    """problems: {plan options: planning problem} shared by calls on the same model, inputs and mesh
    (`predicted_tier`); None: the planner's prices (`predictions`) are left out."""
    ref = copy.deepcopy(model)
    dmodel = autopar.autoparallelize(model, mesh, inputs, plan=plan)
    opt = dmodel.optimizer(torch.optim.AdamW, lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0, "losses": []}
    masks = {}                                  # per parameter: elements whose gradient is signal
    for step in range(STEPS):
        torch.manual_seed(100 + step)           # the same dropout masks in every variant
        # the same collection points on every rank: garbage of earlier steps collected, none during this one
        gc.collect()
        gc.disable()
        meter = MemoryMeter()
        for k, p in dmodel.named_parameters():
            tier = dmodel.memory.params_off_device.get(k, "device")
            if tier != "disk":                       # files are not memory
                meter.track(p, host=tier == "host")
        for tier, t in opt.state_tensors():
            if tier != "disk":                       # files are not memory
                meter.track(t, host=tier == "host")
        with meter:
            loss = dmodel(*inputs)
            seen = {"fwd_device": meter.device_bytes, "fwd_host": meter.host_bytes,
                    "pool_after_fwd": dmodel.memory.pool.bytes, "files_after_fwd": _files(dmodel)}
            loss.backward()
            seen.update(peak_fwd_bwd=meter.peak_device_bytes, pool_after_bwd=dmodel.memory.pool.bytes,
                        files_after_bwd=_files(dmodel), peak_host_fwd_bwd=meter.peak_host_bytes)
            meter.reset_peak()
            before_step = meter.device_bytes
            opt.step()
            seen.update(opt_step_device=meter.peak_device_bytes - before_step, before_step=before_step,
                        pool_after_step=dmodel.memory.pool.bytes, device_after_step=meter.device_bytes,
                        peak_device=max(seen["peak_fwd_bwd"], meter.peak_device_bytes),
                        peak_host=max(seen["peak_host_fwd_bwd"], meter.peak_host_bytes))
        gc.enable()
        worst["losses"].append(float(loss.detach()))
        if compare:
            torch.manual_seed(100 + step)
            ref_loss = ref(*inputs)
            ref_loss.backward()
            worst["loss"] = max(worst["loss"], rel(loss.detach(), ref_loss.detach()))
            params = dict(dmodel.named_parameters())
            scale = max(float(p.grad.abs().max()) for p in ref.parameters())
            for k, p in ref.named_parameters():
                mine = _grad(dmodel, k, params[k])
                if p.grad.abs().max() <= ZERO_GRAD * scale:    # analytically zero: rounding noise (dist_checks)
                    worst["grad"] = max(worst["grad"], float((mine - p.grad).abs().max()) / scale)
                    masks.setdefault(k, torch.zeros_like(p.grad, dtype=torch.bool))
                else:
                    worst["grad"] = max(worst["grad"], rel(mine, p.grad))
                    masks.setdefault(k, well_posed_elements(p.grad))
            ref_opt.step()
            ref_opt.zero_grad()
        else:
            worst["grads"] = {k: _grad(dmodel, k, p) for k, p in dmodel.named_parameters()}
        opt.zero_grad()
    params = dict(dmodel.named_parameters())
    if compare:
        for k, p in ref.named_parameters():
            if masks[k].any():
                worst["param"] = max(worst["param"], rel(params[k].detach().full_tensor()[masks[k]], p.detach()[masks[k]]))
    worst["params"] = {k: p.detach().full_tensor() for k, p in params.items()} if not compare else {}
    worst["decisions"] = sorted(f"{k}={v}" for fam in (plan.recompute, plan.residency, plan.offload)
                                for k, v in fam.items() if v not in ("none", "keep", "device"))
    worst.update(seen, **({} if problems is None else predictions(ref, inputs, mesh, plan, problems)),
                 decisions={"recompute": plan.recompute, "residency": plan.residency, "offload": plan.offload},
                 notes=list(dmodel.memory.notes), tiers={k: opt.tier_of(k) for k in params},
                 local_numel={k: p.to_local().numel() for k, p in params.items()},
                 gathers=sum(1 for m in dmodel.graph_module.modules() if type(m).__name__ == "GatherCopy"
                             and not m.key.startswith("activations:"))
                 + sum(len(m.members) for m in dmodel.graph_module.modules() if type(m).__name__ == "LayerGather"),
                 layer_gathers=sorted(m.key for m in dmodel.graph_module.modules() if type(m).__name__ == "LayerGather"),
                 act_gathers=sum(1 for m in dmodel.graph_module.modules() if type(m).__name__ == "GatherCopy"
                                 and m.key.startswith("activations:")),
                 regions=sorted(m.layer for m in dmodel.graph_module.modules() if type(m).__name__ == "LayerRegion"))
    return worst


def _grad(dmodel, fqn, p):
    """A parameter's whole gradient, from the host where the plan moved it there (grad_offload.py)."""
    host = dmodel.memory.grads.grad(fqn) if dmodel.memory.grads is not None else None
    if host is None:
        return p.grad.full_tensor()
    return DTensor.from_local(host, p.device_mesh, p.placements, run_check=False).full_tensor()


def predictions(model, inputs, mesh, plan, problems: dict) -> dict:
    """The planner's price of the plan's decisions: the same on every rank, so worked out on rank 0 and shared."""
    out = [None]
    if dist.get_rank() == 0:
        predicted = autopar.estimate(model, inputs, mesh, plan)
        out = [dict(predicted_peak=predicted.peak_memory_bytes, predicted_state=predicted.param_state_bytes,
                    predicted_host=predicted_tier(model, inputs, mesh, plan, problems))]
    dist.broadcast_object_list(out, src=0)
    return out[0]


def predicted_tier(model, inputs, mesh, plan, problems: dict) -> float:
    """Bytes the plan's decisions put in the host tier, as the planner prices them; `problems`: the planning
    problems made so far for this model, inputs and mesh, by plan options (filled here)."""
    from autopar.passes.capture import capture
    from autopar.passes.shape_prop import annotate
    from autopar.planner.solve import PlanOptions, plan_assignment, planning_problem
    from autopar.solver.evaluate import evaluate
    key = json.dumps(plan.options, sort_keys=True)
    if key not in problems:
        cap = capture(model, inputs)
        problems[key] = planning_problem(cap, annotate(cap.gm), mesh, PlanOptions.from_dict(plan.options))
    problem = problems[key]
    return evaluate(problem, *plan_assignment(problem, plan)).tiers.get("host", 0.0)


def _files(dmodel) -> int:
    disk = dmodel.memory.disk
    return len(disk.files()) if disk is not None else 0


def mixed_precision_state(rank, world):
    """bf16 GPT on (2,) "dp": optimizer of blocks.0 on the host, blocks.1 on disk, the rest on the
    device. Returns master/parameter agreement and whether a state_dict reloaded into a fresh
    optimizer continues bit for bit."""
    model, inputs = gpt()
    model = model.to(torch.bfloat16)
    mesh = autopar.Mesh((2,), ("dp",), device=shard_happy_profile())
    plan = dataclasses.replace(saved_plan(model, inputs, mesh, None), **{
        **NO_MEMORY_DECISIONS, "offload": {"optimizer:blocks.0": "host", "optimizer:blocks.1": "disk"}})
    dmodel = autopar.autoparallelize(model, mesh, inputs, plan=plan)
    opt = dmodel.optimizer(torch.optim.AdamW, lr=LR)

    def step():
        dmodel(*inputs).float().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    saved = copy.deepcopy(opt.state_dict())
    params = {k: p.detach().to_local().clone() for k, p in dmodel.named_parameters()}
    step()
    after = {k: p.detach().to_local().clone() for k, p in dmodel.named_parameters()}
    with torch.no_grad():
        for k, p in dmodel.named_parameters():
            p.to_local().copy_(params[k])
    fresh = dmodel.optimizer(torch.optim.AdamW, lr=LR)
    fresh.load_state_dict(saved)
    opt = fresh
    step()
    named = dict(dmodel.named_parameters())
    masters = {k: fresh.master(k) for k in named}
    return {"tiers": {k: fresh.tier_of(k) for k in named},
            "master_dtypes": sorted({str(m.dtype) for m in masters.values()}),
            "param_dtypes": sorted({str(p.dtype) for p in named.values()}),
            "param_is_rounded_master": all(torch.equal(named[k].to_local(), m.to(torch.bfloat16))
                                           for k, m in masters.items()),
            "master_finer_than_param": any(not torch.equal(m, named[k].to_local().float()) for k, m in masters.items()),
            "reloaded_max_diff": max(float((named[k].detach().to_local().float() - after[k].float()).abs().max())
                                     for k in named),
            "pool_bytes": dmodel.memory.pool.bytes, "files": _files(dmodel)}


def optimizer_state_bytes(rank, world):
    """Per (parameter dtype, precision): this rank's optimizer state (master weights and AdamW's
    moments and step counters) measured after one step, and the bytes the plan's price gives it
    (rank 0 prices; a plan per dtype, its precision set as a plan file would set it)."""
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        model, inputs = gpt()
        model = model.to(dtype)
        mesh = autopar.Mesh((2,), ("dp",), device=shard_happy_profile())
        planned = saved_plan(model, inputs, mesh, None)
        for precision in ("same", "mixed"):
            plan = dataclasses.replace(planned, options={**planned.options, "precision": precision})
            predicted = [_optimizer_bytes(model, inputs, mesh, plan) if rank == 0 else None]
            dist.broadcast_object_list(predicted, src=0)
            dmodel = autopar.autoparallelize(copy.deepcopy(model), mesh, inputs, plan=plan)
            opt = dmodel.optimizer(torch.optim.AdamW, lr=LR)
            dmodel(*inputs).float().backward()
            opt.step()
            out[f"{str(dtype)[6:]}/{precision}"] = {
                "measured": sum(t.numel() * t.element_size() for _, t in opt.state_tensors()),
                "predicted": predicted[0], "local_elements": sum(p.to_local().numel() for p in dmodel.parameters()),
                "state_dtypes": sorted({str(t.dtype)[6:] for _, t in opt.state_tensors() if t.ndim})}
    return out


def _optimizer_bytes(model, inputs, mesh, plan) -> float:
    """This rank's optimizer state bytes (moments, master weights) as the planner prices the plan."""
    from autopar.passes.capture import capture
    from autopar.passes.shape_prop import annotate
    from autopar.planner.solve import PlanOptions, plan_assignment, planning_problem
    cap = capture(model, inputs)
    problem = planning_problem(cap, annotate(cap.gm), mesh, PlanOptions.from_dict(plan.options))
    choice, _ = plan_assignment(problem, plan)
    return sum(d.opt_bytes[choice[d.leader]] for d in problem.decisions.values() if d.kind == "param")


def bad_memory_plans(rank, world):
    """The errors a hand-edited plan naming no layer / parameter, or an unknown mode, gets."""
    from autopar.errors import AutoparError
    model, inputs = gpt()
    mesh = autopar.Mesh((2,), ("dp",), device=shard_happy_profile())
    plan = saved_plan(model, inputs, mesh, None)
    out = []
    # the layer and residency decisions' problems are all named in one error (runtime/memory.py)
    for dec in ({"recompute": {"blocks.9": "full", "blocks.0": "sometimes"},
                 "residency": {"blocks.0.nope.weight": "regather"}, "offload": {"activations:block.0": "host"}},
                {"offload": {"optimizer:blocks.7": "host"}}, {"offload": {"gradients:blocks.8": "host"}},
                {"offload": {"gradients:blocks.0": "disk"}}):
        try:
            dmodel = autopar.autoparallelize(model, mesh, inputs, plan=dataclasses.replace(plan, **dec))
            dmodel.optimizer(torch.optim.AdamW, lr=LR)
            out.append(None)
        except AutoparError as e:
            out.append(str(e))
    return out
