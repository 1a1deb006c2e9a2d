"""`autopar.estimate`: price a whole training step for any plan, autopar's or one you wrote.

    est = autopar.estimate(model, batch, mesh,                       # mesh axes ("pp", "dp", "tp")
                           {"*.qkv.weight": ("R", "S(0)"), ...},     # layouts over the other axes
                           batch_axes=("dp",), recompute="full",
                           pipeline=Pipeline(stages=4, microbatches=16, schedule="interleaved",
                                             virtual_stages=2))
    print(est.report()); est.step_time_s; est.tflops_per_device

`plan` is an autopar `Plan`, a dict of pins (parameter names or globs, or node names -> one
placement per mesh axis, or per non-pipeline axis when a pipeline is given), or None (autopar
chooses the layouts).

This module prices nothing itself. A hand-written configuration is turned into the Plan it
describes: the planner (`autopar.plan`) with every family fixed as written (the pins; the
pipeline given in full as `pipeline=dict(axis=, stages=, microbatches=, schedule=, virtual_stages=)`;
`recompute`, `residency`, `offload` as given; no memory budget, so that a configuration that does
not fit is priced, not refused), the ops between pins taking the fastest layouts consistent with
them. A Plan, given or made, is then priced by the planner's one evaluator (`solver/evaluate.py`,
per pipeline rank when pipelined), so `estimate(...)` of pins equals `plan.estimate` of the Plan
they describe. What the evaluator reads from the device profile can be set per call:
`grad_overlap` is the profile's `grad_sync_overlap` (the share of the gradient sync's transfer the
backward hides) and `bucket_bytes` its `grad_bucket_bytes` (math.inf: one bucket).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from .cost_model.compute import step_flops
from .cost_model.pipeline import Pipeline
from .cost_model.profiles import DDP_BUCKET_BYTES
from .cost_model.recompute import saved_under_selective
from .errors import PlanMismatchError, PlanOptionError
from .cluster import Cluster
from .mesh import Mesh
from .passes.capture import capture
from .passes.shape_prop import annotate
from .passes.stages import microbatch
from .plan import Plan
from .planner.pipeline import stage_options
from .planner.pipeline_search import search_pipeline
from .planner.solve import PlanOptions, communication, plan_assignment, plan_captured, planning_problem
from .solver.decisions.stages import node_chunks
from .solver.evaluate import Staging, evaluate

__all__ = ["estimate", "StepEstimate", "Pipeline", "DDP_BUCKET_BYTES"]

# Arguments of the earlier estimate() that priced hand-written steps its own way, and what to do now.
_REMOVED = {
    "num_layers": "build the model at its depth (on the meta device that allocates nothing): the evaluator "
                  "prices the graph that runs, layer by layer",
    "layers": "the repeated layers are found by the planner (passes/layers.py)",
    "grad_sync_algorithm": "gradient sync is priced as the runtime runs it (bucketed ring collectives)",
}


@dataclass(frozen=True, slots=True)
class StepEstimate:
    """One training step, per device. Times in seconds, memory in bytes."""
    step_time_s: float
    pipeline_s: float                 # forward + backward of every microbatch, bubble included
    compute_s: float                  # compute on the slowest device, all microbatches (recompute included)
    comm_s: float                     # resharding collectives on the critical path, all microbatches
    p2p_s: float                      # pipeline point-to-point transfers on the critical path
    bubble_s: float                   # pipeline fill and drain
    grad_sync_s: float                # gradient synchronisation, total
    grad_sync_exposed_s: float        # ... not hidden behind the backward
    optimizer_s: float
    peak_memory_bytes: float          # on the most loaded device
    param_state_bytes: float
    activation_bytes: float
    model_flops: float                # forward + backward FLOPs of the step, all devices
    hardware_flops: float             # model_flops + recomputation
    devices: int
    microbatches: int
    stages: int
    virtual_stages: int
    layers: int
    recompute: bool
    grad_overlap: float
    per_device_s: tuple[float, ...]   # per pipeline device: one microbatch's forward + backward + p2p
    comm_bytes_per_axis: dict[str, float] = field(default_factory=dict)   # per device per step
    layout_summary: dict[str, tuple[str, ...]] = field(default_factory=dict)   # parameter -> layout
    runtime_s: float = 0.0            # autopar runtime's per-node cost on the slowest device (in pipeline_s)
    graph_nodes: int = 0              # nodes of the rank's graph (LocalOp + Reshard), one microbatch

    @property
    def tflops_per_device(self) -> float:
        """Achieved TFLOP/s per device counting recomputation (Megatron-LM's measure)."""
        return self.hardware_flops / (self.step_time_s * self.devices) / 1e12

    @property
    def model_tflops_per_device(self) -> float:
        return self.model_flops / (self.step_time_s * self.devices) / 1e12

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tflops_per_device"] = self.tflops_per_device
        return d

    def report(self) -> str:
        ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
        gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
        pp = (f"{self.stages} stages x {self.virtual_stages} chunks, " if self.stages > 1 else "")
        lines = [
            f"estimated training step: {ms(self.step_time_s)} on {self.devices} devices "
            f"({pp}{self.microbatches} microbatches, {self.layers} layers"
            f"{', full recomputation' if self.recompute else ''})",
            f"  forward+backward {ms(self.pipeline_s)}: compute {ms(self.compute_s)}, runtime overhead "
            f"{ms(self.runtime_s)} ({self.graph_nodes} graph nodes), collectives {ms(self.comm_s)}, "
            f"pipeline p2p {ms(self.p2p_s)}, bubble {ms(self.bubble_s)}",
            f"  gradient sync {ms(self.grad_sync_s)} ({ms(self.grad_sync_exposed_s)} exposed, overlap "
            f"{self.grad_overlap:g}), optimizer {ms(self.optimizer_s)}",
            f"  {self.tflops_per_device:.1f} TFLOP/s per device ({self.model_tflops_per_device:.1f} without "
            f"recomputation)",
            f"  peak memory per device {gib(self.peak_memory_bytes)} = state {gib(self.param_state_bytes)} + "
            f"activations {gib(self.activation_bytes)}",
            "  communication per device per step: " + ", ".join(
                f"{a} {gib(b)}" for a, b in self.comm_bytes_per_axis.items()),
        ]
        return "\n".join(lines)


def estimate(model: torch.nn.Module, example_inputs, mesh: Mesh | Cluster, plan: Plan | Mapping | None = None, *,
             example_kwargs: dict | None = None, batch_axes: Sequence[str] | None = None,
             sharded_outputs: bool = False, pipeline: Pipeline | Mapping | None = None,
             recompute: bool | str | None = None,
             residency: str | None = None, offload: str | None = None, grad_overlap: float | None = None,
             bucket_bytes: float | None = None, optimizer: str = "adamw", precision: str = "auto",
             time_limit: float | None = 60.0, **removed) -> StepEstimate:
    """Price one training step of `model` on `mesh` under `plan` (see the module docstring).

    example_inputs: the global batch of one step (meta tensors are fine).
    mesh: every axis, the pipeline axis (`pipeline.axis`) included; or a `Cluster`: the mesh a given Plan
      records, or, with no plan, the mesh and plan the planner chooses (`autopar/planner/mesh_search.py`).
    plan: a `Plan` (priced as planned: give none of pipeline=, recompute=, residency=, offload=), a dict
      of pins, or None (autopar chooses the layouts; the other families are fixed as given).
    batch_axes: mesh axes over which inputs arrive split on dim 0 (data parallelism).
    sharded_outputs: outputs stay in their planned layout (as `autopar.plan`'s option) instead of
      gathered whole on every device: a model that returns its logits beside its loss (Hugging Face's
      causal LMs) and whose caller uses only the loss, as torchtitan's training loop does.
    pipeline: `Pipeline(...)` or the planner's dict (axis, stages, microbatches, schedule, virtual_stages;
      keys left out are chosen by the planner).
    recompute: "none" (default; False), "selective", or "full" (True) for every layer.
    residency: "keep" (default) or "regather" for every gathered parameter; offload: "none" (default),
      "host" or "disk".
    grad_overlap: the profile's `grad_sync_overlap` for this estimate (default: the profile's).
    bucket_bytes: the profile's `grad_bucket_bytes` for this estimate (default: the profile's; math.inf:
      one bucket, as Megatron's local DDP syncs one contiguous buffer).
    """
    if removed:
        name = sorted(removed)[0]
        raise PlanOptionError(f"estimate() no longer takes {name}=: " + _REMOVED.get(
            name, "it is not an argument of estimate()"))
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if isinstance(mesh, Cluster):
        mesh, plan = _on_cluster(model, args, example_kwargs, mesh, plan, optimizer, precision, time_limit,
                                 (batch_axes, pipeline, recompute, residency, offload))
    mesh = _priced_on(mesh, grad_overlap, bucket_bytes)
    if isinstance(plan, Plan):
        if (pipeline is not None or recompute is not None or residency is not None or offload is not None
                or sharded_outputs):
            raise ValueError("an autopar Plan decides its own recomputation, memory, outputs and pipeline: "
                             "estimate it as planned (no pipeline=, recompute=, residency=, offload=, "
                             "sharded_outputs=), or pass pins for a hand-written configuration")
        cap = capture(model, *microbatch(args, example_kwargs, plan.pipeline.microbatches))
        infos = annotate(cap.gm)
    else:
        plan, cap, infos = _written_plan(model, args, example_kwargs, mesh, plan, batch_axes, sharded_outputs,
                                         pipeline, recompute, residency, offload, optimizer, precision, time_limit)
    pp = plan.pipeline
    return _estimate_plan(cap, infos, mesh, mesh.stage_mesh(pp.axis if pp.stages > 1 else None), plan)


def _on_cluster(model, args, kwargs, cluster: Cluster, plan, optimizer: str, precision: str, time_limit, fixed):
    """(the mesh, the plan) to price on a `Cluster`: a Plan's recorded mesh, or the mesh search's plan
    (`autopar/planner/mesh_search.py`) where none is given."""
    if isinstance(plan, Plan):
        return cluster.mesh_of(plan.mesh), plan
    if plan is not None or any(x is not None for x in fixed):
        raise PlanOptionError("pins, batch_axes, pipeline=, recompute=, residency= and offload= describe a plan on a "
                              "mesh: with a Cluster give a Plan (or none of them: the planner chooses the mesh and "
                              "the plan), or give a Mesh")
    from .planner.mesh_search import search_mesh
    found = search_mesh(model, args, kwargs, cluster, PlanOptions(optimizer=optimizer, precision=precision,
                                                                  time_limit=time_limit, progress=False))
    return cluster.mesh_of(found.mesh), found


def _priced_on(mesh: Mesh, grad_overlap: float | None, bucket_bytes: float | None) -> Mesh:
    """`mesh` with its profile's gradient-sync figures set as asked (the evaluator reads them there)."""
    if grad_overlap is not None and not 0.0 <= grad_overlap <= 1.0:
        raise ValueError(f"grad_overlap must be in [0, 1], got {grad_overlap}")
    if bucket_bytes is not None and not bucket_bytes > 0:
        raise ValueError(f"bucket_bytes must be > 0 (math.inf: one bucket), got {bucket_bytes}")
    prof = mesh.profile
    want = dict(grad_sync_overlap=prof.grad_sync_overlap if grad_overlap is None else float(grad_overlap),
                grad_bucket_bytes=prof.grad_bucket_bytes if bucket_bytes is None else float(bucket_bytes))
    if all(getattr(prof, k) == v for k, v in want.items()):
        return mesh
    return Mesh(mesh.shape, mesh.axis_names, dataclasses.replace(prof, **want))


def _written_plan(model, args, kwargs, mesh: Mesh, pins, batch_axes, sharded_outputs, pipeline, recompute,
                  residency, offload, optimizer, precision, time_limit):
    """The Plan a hand-written configuration describes (the planner with every family fixed, as
    `autopar.plan` with these options makes it), and the capture of one microbatch it was made on."""
    pipe = _pipeline_option(pipeline)
    if pins and pipe:
        k = mesh.axis_index(pipe["axis"])
        pins = {n: (tuple(p[:k]) + ("R",) + tuple(p[k:]) if len(p) == mesh.ndim - 1 else tuple(p))
                for n, p in pins.items()}
    modes = {None: "none", False: "none", True: "full"}
    opts = PlanOptions(math.inf, dict(pins) if pins else None, tuple(batch_axes) if batch_axes else None,
                       sharded_outputs=sharded_outputs, optimizer=optimizer, time_limit=time_limit, progress=False,
                       symbolic=False,
                       recompute=modes.get(recompute, recompute), residency=residency or "keep",
                       offload=offload or "none", precision=precision, pipeline=pipe)
    m = pipe.get("microbatches") if pipe else 1
    captured = {}                  # captured once per microbatch count: planned and priced on it
    if m:
        cap = capture(model, *microbatch(args, kwargs, m))
        captured[m] = (cap, annotate(cap.gm))
    if pipe:       # a pipeline given in part: the planner chooses the keys not given
        plan = search_pipeline(model, args, kwargs, mesh, opts, pipe, captured=captured)
    else:
        plan = plan_captured(captured[1][0], mesh, opts, source=(model, args, kwargs))
    return (plan, *captured[plan.pipeline.microbatches])


def _pipeline_option(pipeline: Pipeline | Mapping | None) -> dict | None:
    """The planner's `pipeline=` dict for a pipeline given in full (None: no pipeline)."""
    if pipeline is None or isinstance(pipeline, Mapping):
        return dict(pipeline) if pipeline else None
    if pipeline.stages == 1 and pipeline.microbatches == 1:
        return None
    return dict(axis=pipeline.axis, stages=pipeline.stages, microbatches=pipeline.microbatches,
                schedule=pipeline.schedule, virtual_stages=pipeline.virtual_stages)


def _estimate_plan(cap, infos, mesh: Mesh, smesh: Mesh, plan: Plan):
    """An autopar plan's step, as the planner priced it: its layouts and memory decisions read back on
    its own planning problem (one microbatch on the mesh without the pipeline axis) and priced by the
    one evaluator (`solver.evaluate`, per pipeline rank when it is pipelined), so it equals
    `plan.estimate` exactly."""
    if list(plan.mesh["shape"]) != list(mesh.shape):
        raise PlanMismatchError(f"the plan was made for mesh {plan.mesh['shape']}, not {mesh.shape}")
    pp = plan.pipeline
    staged = pp.stages > 1
    opts = PlanOptions.from_dict(plan.options)
    problem = planning_problem(cap, infos, smesh, stage_options(opts, mesh, mesh.axis_index(pp.axis)) if staged
                               else opts)
    choice, options = plan_assignment(problem, stage_view(plan, mesh.axis_index(pp.axis)) if staged else plan)
    staging = (Staging(pp, node_chunks(problem, cap.gm.graph, pp), mesh.axes[mesh.axis_index(pp.axis)].link)
               if staged else None)
    ev = evaluate(problem, choice, options, staging)
    _, per_axis = communication(problem, choice, cap)
    ng = problem.needs_grad
    model_flops = sum(step_flops(infos[n].flops, bool(ng.get(n))) for n, d in problem.decisions.items()
                      if d.kind == "op")
    modes = {**dict.fromkeys(problem.layer.values(), "none"), **plan.recompute}
    again = sum(infos[n].flops for n, d in problem.decisions.items() if d.kind == "op" and (
        modes.get(problem.layer.get(n)) == "full" or (modes.get(problem.layer.get(n)) == "selective"
                                                      and not saved_under_selective(d.facts.op))))
    m = pp.microbatches
    price = ev.pipeline
    fwd_bwd = price.pipeline_s if price else ev.step_s - ev.grad_sync_s - ev.optimizer_s
    return StepEstimate(
        step_time_s=ev.step_s, pipeline_s=fwd_bwd, compute_s=ev.compute_s + ev.family_s.get("recompute", 0.0),
        comm_s=ev.comm_s - (ev.grad_sync_s - ev.grad_buckets_s), p2p_s=price.p2p_s if price else 0.0,
        bubble_s=price.bubble_s if price else 0.0, grad_sync_s=ev.grad_sync_s,
        grad_sync_exposed_s=ev.grad_sync_s, optimizer_s=ev.optimizer_s, peak_memory_bytes=ev.peak_bytes,
        param_state_bytes=ev.state_bytes, activation_bytes=ev.peak_bytes - ev.state_bytes,
        model_flops=m * model_flops, hardware_flops=m * (model_flops + again),
        devices=mesh.size, microbatches=m, stages=pp.stages, virtual_stages=pp.virtual_stages,
        layers=len(set(problem.layer.values())), recompute=any(v != "none" for v in plan.recompute.values()),
        grad_overlap=mesh.profile.grad_sync_overlap, per_device_s=tuple(s.fwd_s + s.bwd_s for s in price.stages) if price else (fwd_bwd,),
        comm_bytes_per_axis={a: per_axis.get(a, 0.0) for a in mesh.axis_names}, layout_summary=dict(plan.placements), runtime_s=ev.runtime_s,
        graph_nodes=ev.graph_nodes)


def stage_view(plan: Plan, k: int) -> Plan:
    """A pipelined plan's layouts without their placement on the pipeline axis k (what one stage runs
    on the mesh without it)."""
    cut = lambda lay: tuple(x for i, x in enumerate(lay) if i != k) or ("R",)  # noqa: E731
    nodes = [replace(n, inputs=tuple(cut(i) for i in n.inputs), output=cut(n.output) if n.output else n.output,
                     labels=cut(n.labels) if n.labels else n.labels) for n in plan.nodes]
    return replace(plan, nodes=nodes, placements={f: cut(p) for f, p in plan.placements.items()})
