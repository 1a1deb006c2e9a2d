"""What planning a pipelined model needs for one pipeline (axis, stages, virtual stages, microbatches,
schedule): the checked settings (`fixed_pipeline`), the options of the stage mesh (`stage_options`) and
the stage plan lifted to the whole mesh (`lifted`). The search (`planner/pipeline_search.py`) uses them per
candidate.

The layouts are solved on the stage mesh, the mesh without the pipeline axis (each of its other
axes keeps the links it has in the whole mesh), for one microbatch: that is what every stage runs.
Solving there, rather than pinning "R" on the pipeline axis of every node, leaves the solver a
problem the size of the stage's (a layout has one placement per axis, so every op's options
multiply by the axis's), and a non-pipelined plan of the same microbatch on the same stage mesh
is the same problem: the plan cache serves both. The stage plan is then lifted to the whole mesh:
every layout gets "R" on the pipeline axis (plan.py's rule for pipelined plans), and
`plan.pipeline` says how the layers are cut (`passes/stages.even_boundaries`).

The stage plan alone does not price the bubble, the sends between stages or memory per stage: the
search prices the lifted plan with the evaluator (`solver/evaluate.py`, `Staging`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ..cost_model.pipeline import check_schedule
from ..errors import PlanOptionError
from ..mesh import Mesh
from ..plan import PIPELINE_KEYS, PIPELINE_SCHEDULES, PipelinePlan, Plan, Scaling
from .solve import PlanOptions

STAGE_LABEL = "stage"     # a node's label on the pipeline axis: stages own disjoint nodes


def fixed_pipeline(spec: Mapping, mesh: Mesh) -> PipelinePlan:
    """The pipeline `spec` (the `pipeline=` option, a dict) gives, checked against `mesh`; its
    boundaries are left empty (the search fills them). A PlanOptionError names the key."""
    unknown = sorted(set(spec) - set(PIPELINE_KEYS))
    if unknown:
        raise PlanOptionError(f"pipeline: unknown key(s) {unknown}; the keys are {', '.join(PIPELINE_KEYS)}")
    missing = [k for k in ("axis", "stages", "microbatches", "schedule") if k not in spec]
    if missing:
        raise PlanOptionError(f"pipeline: give {', '.join(missing)} (the planner does not choose pipeline "
                              f"settings yet)")
    axis = spec["axis"]
    if axis not in mesh.axis_names:
        raise PlanOptionError(f"pipeline.axis = {axis!r} is not an axis of the mesh {mesh.axis_names}")
    for key in ("stages", "virtual_stages", "microbatches"):
        v = spec.get(key, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PlanOptionError(f"pipeline.{key} = {v!r}: give a positive int")
    size = mesh.shape[mesh.axis_index(axis)]
    if spec["stages"] != size:
        raise PlanOptionError(f"pipeline.stages = {spec['stages']} must equal the size of mesh axis {axis!r} "
                              f"({size}): one stage per device along it")
    schedule = spec["schedule"]
    if schedule not in PIPELINE_SCHEDULES:
        raise PlanOptionError(f"pipeline.schedule = {schedule!r} is not one of {', '.join(PIPELINE_SCHEDULES)}")
    virtual = spec.get("virtual_stages", 1)
    why = check_schedule(schedule, virtual)
    if why is not None:
        raise PlanOptionError(f"pipeline.virtual_stages = {virtual}: {why}")
    if spec["microbatches"] < size and schedule in ("1f1b", "interleaved", "zb"):
        raise PlanOptionError(f"pipeline.microbatches = {spec['microbatches']} is fewer than the {size} stages: "
                              f"schedule {schedule!r} needs at least one microbatch per stage")
    rounds = max(1, spec["microbatches"] // size)
    if schedule in ("interleaved", "zb") and spec["microbatches"] % rounds:
        raise PlanOptionError(f"pipeline.microbatches = {spec['microbatches']}: schedule {schedule!r} runs rounds of "
                              f"{size} microbatches (one per stage), so give a multiple of {size} (or fewer than "
                              f"{2 * size})")
    return PipelinePlan(axis, size, virtual, spec["microbatches"], schedule)


def stage_options(opts: PlanOptions, mesh: Mesh, k: int) -> PlanOptions:
    """The options for the stage mesh: pins without their pipeline-axis placement (which must be
    "R"), no pipeline, marked as a stage's (`PlanOptions.stage`: no gradient offload)."""
    axis = mesh.axis_names[k]
    pins = {}
    for name, layout in (opts.pins or {}).items():
        if str(layout[k]).strip() != "R":
            raise PlanOptionError(f"pin {name!r}: {tuple(layout)} places {layout[k]!r} on the pipeline axis {axis!r}; "
                                  f"a pipelined plan replicates every tensor of a stage over it: give 'R' there")
        pins[name] = tuple(p for i, p in enumerate(layout) if i != k) or ("R",)
    if axis in (opts.batch_axes or ()):
        raise PlanOptionError(f"batch_axes names the pipeline axis {axis!r}: the stages along it share one batch, "
                              f"split into microbatches; drop it from batch_axes")
    return replace(opts, pins=pins or None, pipeline=False, stage=True, symbolic=False)


def lifted(stage: Plan, mesh: Mesh, k: int, opts: PlanOptions, pipe: PipelinePlan) -> Plan:
    """`stage` (a plan on the stage mesh) as a plan on `mesh`: "R" inserted at axis k everywhere."""
    alone = mesh.ndim == 1       # the stage mesh was one device standing for no axis

    def lay(layout):
        rest = () if alone else tuple(layout)
        return rest[:k] + ("R",) + rest[k:]

    def labels(ls):
        rest = () if alone else tuple(ls)
        return rest[:k] + (STAGE_LABEL,) + rest[k:] if ls else ls
    nodes = [replace(n, inputs=tuple(lay(i) for i in n.inputs), output=lay(n.output) if n.output else n.output,
                     labels=labels(n.labels)) for n in stage.nodes]
    per_axis = dict(stage.estimate.comm_bytes_per_axis)
    per_axis[mesh.axis_names[k]] = 0.0
    estimate = replace(stage.estimate, comm_bytes_per_axis={a: per_axis.get(a, 0.0) for a in mesh.axis_names})
    return replace(stage, mesh=mesh.to_dict(), options=opts.to_dict(), nodes=nodes,
                   placements={f: lay(p) for f, p in stage.placements.items()}, estimate=estimate, pipeline=pipe,
                   scaling=Scaling(unavailable="pipelined plans are not priced at other sizes yet"),
                   indivisible=list(stage.indivisible))


__all__ = ["fixed_pipeline", "stage_options", "lifted"]
