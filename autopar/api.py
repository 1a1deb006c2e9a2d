"""The public entry points: `plan` (inspect, no cluster needed) and `autoparallelize` (run)."""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from .cluster import Cluster
from .errors import AutoparError, MeshError, PlanFileError, PlanMismatchError, PlanOptionError
from .mesh import Mesh
from .passes.capture import capture
from .plan import Plan, Scaling
from .progress import PhaseProgress
from .planner.pipeline_search import search_pipeline
from .passes.stages import microbatch
from .planner.solve import PlanOptions, fingerprint, make_plan, plan_captured
from .runtime.layout_fit import layout_misfits
from .runtime.weights import Weights


def _as_tuple(example_inputs) -> tuple:
    return example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)


def plan(model: torch.nn.Module, example_inputs, mesh: Mesh | Cluster, *, example_kwargs: dict | None = None,
         memory_budget: float | None = None, pins: Mapping[str, Sequence[str]] | None = None,
         batch_axes: Sequence[str] | None = None, sharded_outputs: bool = False, optimizer: str = "adamw",
         time_limit: float | None = 60.0, progress: bool | None = None, cache_dir: str | None = None,
         symbolic: bool = True, recompute: str = "auto", residency: str = "auto", offload: str = "auto",
         precision: str = "auto", pipeline: Mapping | bool | None = None,
         moe_capacity_factor: float | None = None) -> Plan:
    """Choose how to parallelize `model` over `mesh`; nothing runs, nothing is allocated.

    mesh: a `Mesh`, or a `Cluster`: the planner then chooses the mesh as well (`autopar/planner/mesh_search.py`;
        `plan.mesh` records it, `plan.mesh_search` the meshes weighed; `time_limit` bounds the whole search;
        `pipeline=None` or `{}` lets it choose pipelines, `False` forbids them).

    example_inputs: the global batch (real or meta tensors; the model may be on meta too).
    memory_budget: bytes per device (default: the device profile's `memory_budget`, its capacity less a reserve).
    pins: {"param.fqn or glob": ("S(0)", "R"), "node_name": (...)} fixes those layouts.
    batch_axes: mesh axes over which inputs arrive already split on dim 0 (a DistributedSampler).
    sharded_outputs: return outputs as DTensors in their planned layout instead of whole.
    time_limit: seconds for the whole call, the capture aside (every solve and the pipeline search share
        them); at the limit the best plan found so far is returned, its status saying so
        ("best found at the time limit", with the gap where the solver proved one, and the pipeline
        candidates left unsearched by name). The solver's first plans are found whatever the limit.
    progress: say on stderr which phase runs once planning takes over 2 s, and a line every 5 s of
        solving (default: when stderr is a terminal).
    cache_dir: keep solved plans there (or set AUTOPAR_CACHE_DIR); an unchanged model re-plans instantly.
    symbolic: also price the plan as a function of batch size and sequence length (`plan.estimate_at`,
        `plan.largest_batch`, the report's scaling table, `plan.scaling`): one more trace of the model,
        made when first asked for (or when the plan is saved), not inside this call.
    recompute: activation recomputation per layer: "auto" (the solver chooses), "none", "selective"
        (keep matmul outputs, recompute the rest) or "full" (`plan.recompute`).
    residency: a gathered copy is kept to the backward or freed and gathered again: "auto", "keep" or
        "regather" (`plan.residency`): a parameter's (FSDP / ZeRO-3), or an activation's all-gathered
        for a product that saves it (Megatron sequence parallelism: the saved input stays a sequence shard).
    offload: saved activations and optimizer state (step on the host) on "device", "host" or "disk":
        "auto", "none", "host", "disk" (`plan.offload`; tier sizes: `Mesh(host_memory=, disk=)`).
    precision: optimizer state bytes per parameter: "auto" (fp32 master weights and moments for
        16-bit parameters), "same" (all in the parameter dtype) or "mixed".
    pipeline: pipeline stages over one mesh axis (`plan.pipeline`). None (the default) or `{}`: the planner
        chooses, "no pipeline" among its choices (`planner/pipeline_search.py`: one ILP per pipeline axis
        and microbatch count in the order of their lower bounds, a candidate whose bound cannot beat the
        best plan found left unsolved); a dict fixes the keys it gives (axis, stages, virtual_stages, microbatches,
        schedule), the planner chooses the rest; False: no pipeline. Axis names are hints (an axis named
        "pp" is searched first, before the plan without one), never requirements.
    moe_capacity_factor: mixture-of-experts layers drop the token-slots past each expert's capacity,
        ceil(factor x tokens x top_k / experts) over the global batch (GShard, Switch Transformer; the rule:
        `autopar/runtime/experts.py`, one process: `autopar.moe_capacity`); None: dropless.
    """
    show = sys.stderr.isatty() if progress is None else progress
    with PhaseProgress() if show else contextlib.nullcontext() as phases:
        opts = PlanOptions(memory_budget, dict(pins) if pins else None, tuple(batch_axes) if batch_axes else None,
                           sharded_outputs, optimizer, time_limit, show, cache_dir=cache_dir, symbolic=symbolic,
                           on_phase=phases, recompute=recompute, residency=residency, offload=offload,
                           precision=precision, pipeline=pipeline, moe_capacity_factor=moe_capacity_factor)
        args = _as_tuple(example_inputs)
        if isinstance(mesh, Cluster):
            from .planner.mesh_search import search_mesh
            return search_mesh(model, args, example_kwargs, mesh, opts)
        chosen = _pipeline_keys(pipeline)
        if chosen is not None:
            return search_pipeline(model, args, example_kwargs, mesh, opts, chosen)
        return make_plan(model, args, example_kwargs, mesh, opts)


def _pipeline_keys(pipeline) -> Mapping | None:
    """The pipeline keys fixed by the `pipeline=` option (None: choose all of them; a dict: those it
    gives), or None where `False` forbids a pipeline."""
    if pipeline is None:
        return {}
    if isinstance(pipeline, Mapping):
        return pipeline
    if pipeline is not False:
        raise PlanOptionError(f"pipeline={pipeline!r}: give None (the planner chooses), False (no pipeline) or a "
                              f"dict such as dict(axis='pp') (fixes the keys it gives)")
    return None


def autoparallelize(model: torch.nn.Module, mesh: Mesh | Cluster, example_inputs, *, plan: Plan | None = None,
                    example_kwargs: dict | None = None, offload_dir: str | None = None,
                    collective_timeout: float | None = None, init=None, checkpoint: str | None = None,
                    checkpoint_prefix: str = "", key_map=None, **options):
    """Return a module that runs `model` over `mesh` on this rank (call on every rank).

    Plans unless `plan` is given (rank 0 plans and broadcasts, so all ranks agree); `options` are
    `plan`'s. The user's model is not modified; the returned module holds this rank's parameter shards.
    A `Cluster` for `mesh`: rank 0 chooses the mesh with the plan (`plan()`), and every rank builds
    the DeviceMesh it records (or `plan.mesh`'s, where a plan is given).
    A pipelined plan (the planner's choice, `pipeline=` given, or `plan.pipeline.stages > 1`) returns a
    `runtime.pipeline.PipelinedModule`: each call runs one training step through the schedule.
    offload_dir: where the disk tier writes its files (a fresh temporary directory inside it per
        module; default: the system's temporary directory).
    collective_timeout: seconds a collective waits for a peer; a dead or hung rank is then a
        `CollectiveError` naming it and the collective (`runtime/faults.py`).
    init, checkpoint: where the parameters' values come from instead of `model` (which may then be on the
        meta device; each rank makes only its own shards): `init=FN` or "reset" as one process running
        `model.to_empty(device="cpu"); model.apply(FN)` would, bitwise (`runtime/materialise.py`);
        `checkpoint=DIR` a Hugging Face safetensors or torch.distributed.checkpoint directory, its keys
        named `key_map(checkpoint_prefix + key)` in the model (`runtime/weights.py`; a bad checkpoint is a
        `CheckpointError` on every rank before anything is planned).
    """
    from .runtime.module import DistributedModule
    unknown = sorted(set(options) - set(PlanOptions.__dataclass_fields__))
    if unknown:
        raise TypeError(f"autoparallelize() got unknown option(s) {unknown}")
    weights = Weights.of(init, checkpoint, checkpoint_prefix, key_map)
    if weights is not None:
        weights.check(model)                  # the checkpoint's metadata against the model, before any collective
    if isinstance(mesh, Cluster):
        mesh, plan = _on_cluster(model, mesh, example_inputs, example_kwargs, plan, options)
    device_mesh = mesh.device_mesh()          # validates world size before anything else
    if collective_timeout is not None:
        from .runtime.faults import watch_mesh
        watch_mesh(device_mesh, collective_timeout)
    args, kwargs = _as_tuple(example_inputs), example_kwargs
    plan_opts = PlanOptions(**options) if plan is None else None
    keys = _pipeline_keys(plan_opts.pipeline) if plan is None else None
    captured: dict[int, tuple] = {}     # rank 0's search: microbatch count -> (its capture, annotations)
    if keys is not None:     # searched and priced as `plan()` does
        plan = planned_on_rank0(lambda: search_pipeline(model, args, kwargs, mesh, plan_opts, keys, captured))
    pipe = plan.pipeline if plan is not None and plan.pipeline.stages > 1 else None
    if pipe is not None:     # a pipelined plan runs on one microbatch
        args, kwargs = microbatch(args, kwargs, pipe.microbatches)
    m = pipe.microbatches if pipe is not None else 1
    cap = captured[m][0] if m in captured else capture(model, args, kwargs)   # the search's, where it made one
    if plan is None:
        plan = planned_on_rank0(lambda: plan_captured(cap, mesh, plan_opts, source=(model, args, kwargs)))
    else:
        check_plan(plan, cap, mesh)
    if pipe is not None:
        from .runtime.pipeline import PipelinedModule
        if weights is not None:
            raise PlanOptionError("init= and checkpoint= are not supported with a pipelined plan yet: materialise "
                                  "the model (or load it) before autoparallelize, or plan without a pipeline")
        return PipelinedModule(model, cap, plan, device_mesh, offload_dir=offload_dir,
                               grad_bucket_bytes=mesh.profile.grad_bucket_bytes)
    return DistributedModule(model, cap, plan, device_mesh, offload_dir=offload_dir,
                             grad_bucket_bytes=mesh.profile.grad_bucket_bytes, weights=weights)


def _on_cluster(model, cluster: Cluster, example_inputs, example_kwargs, given: Plan | None, options: dict):
    """(the Mesh to run on, its plan): `given`'s recorded mesh on `cluster`, or the mesh search's choice
    made on rank 0 and broadcast; the world size is checked first, on every rank, before any collective."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != cluster.size:
        raise MeshError(f"{cluster} has {cluster.size} devices but the job has world size {dist.get_world_size()}: "
                        f"launch {cluster.size} processes or describe the cluster the job runs on")
    if given is None:
        from .planner.mesh_search import search_mesh
        given = planned_on_rank0(lambda: search_mesh(model, _as_tuple(example_inputs), example_kwargs, cluster,
                                                     PlanOptions(**options)))
    return cluster.mesh_of(given.mesh), given


def planned_on_rank0(make) -> Plan:
    """`make()` on rank 0, its plan broadcast so that every rank runs the same one; an AutoparError
    it raises (a bad pin, no plan fits) is raised on every rank, not left for the others to hang on."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return make()
    chosen: list = [None]
    mine = None
    if dist.get_rank() == 0:
        try:
            mine = make()
            chosen = [_without_pending_scaling(mine)]
        except AutoparError as e:
            chosen = [e]
    dist.broadcast_object_list(chosen, src=0)
    if isinstance(chosen[0], AutoparError):
        raise chosen[0]
    return mine if mine is not None else chosen[0]


def _without_pending_scaling(plan: Plan) -> Plan:
    """What the other ranks receive: the plan whole, except a scaling table rank 0 has not priced yet
    (a trace of the model at symbolic sizes that no rank needs to run the plan); it stays pending on
    rank 0, where the plan was made."""
    if plan.pending_scaling is None:
        return plan
    return replace(plan, pending_scaling=None, scaling=Scaling(
        unavailable="priced on rank 0, where the plan was made: read plan.scaling there"))


def check_plan(plan: Plan, cap, mesh: Mesh) -> None:
    if plan.fingerprint != fingerprint(cap):
        raise PlanMismatchError(f"this plan was made for another graph (fingerprint {plan.fingerprint}, this model "
                                f"and inputs give {fingerprint(cap)}): re-plan, or pass the same model and input shapes")
    if list(plan.mesh["shape"]) != list(mesh.shape) or list(plan.mesh["axis_names"]) != list(mesh.axis_names):
        raise PlanMismatchError(f"this plan was made for mesh {plan.mesh['shape']} {plan.mesh['axis_names']}, "
                                f"not {mesh.shape} {mesh.axis_names}: re-plan for this mesh")
    misfits = layout_misfits(plan, cap)
    if misfits:
        raise PlanFileError(f"plan {misfits[0]}; re-plan the model" + (f" ({len(misfits) - 1} more such layouts)"
                                                                       if len(misfits) > 1 else ""))
