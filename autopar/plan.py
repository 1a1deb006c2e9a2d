"""`Plan`: the planner's answer, as data.

A plan says, for every node of the captured graph, the layout (one DTensor placement per
mesh axis) of each tensor input and of the output, plus what it costs. It serializes to
JSON, loads back, diffs against another plan, prints a report, and is applied by
`autoparallelize(..., plan=...)` without solving again.

Besides layouts, a plan says what happens to memory (one dict per decision family, keyed so a
person can read them):

* `recompute`: layer path ("blocks.3", "model.layers.0") -> "none" | "selective" | "full":
  what the layer's forward keeps for its backward (`RECOMPUTE_MODES`);
* `residency`: parameter FQN, or "activations:<layer>" ("activations:<node>" outside the layers)
  -> "keep" | "regather": whether a parameter gathered for use (or an activation all-gathered for
  an op that saves it) keeps its gathered copy from the forward to the backward, or frees it after
  the forward and gathers it again in the backward (FSDP's `reshard_after_forward`, ZeRO-3;
  Megatron sequence parallelism's sequence-sharded saved input of a column-parallel product);
* `offload`: "activations:<layer>" (tensors the layer saves for the backward),
  "optimizer:<layer or parameter FQN>" (optimizer state, fp32 master weights and the optimizer
  step) -> "device" | "host" | "disk" (`TIERS`), or "gradients:<layer or parameter FQN>" (the
  gradients, moved out as they are made) -> "device" | "host", or "parameters:<layer or parameter
  FQN>" (the stored local shards, brought to the device for each use; CPU meshes) -> "device" |
  "host" | "disk".
A layer or parameter missing from a dict takes the first mode ("none", "keep", "device").

`pipeline` (`PipelinePlan`) says how the layer sequence is cut into pipeline stages over one mesh
axis, with how many microbatches and which schedule; `stages == 1` is no pipeline. In a pipelined
plan every layout still has one placement per mesh axis; on the pipeline axis it is "R" (stages
own disjoint nodes, which is not a placement), and each stage runs the layouts on the sub-mesh of
the other axes.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .plan_file import load_plan, parse_plan_json, read_plan
from .plan_records import (ACTIVATIONS, MESH_CANDIDATE_STATUS, OFFLOAD_CLASSES, PIPELINE_KEYS,  # noqa: F401 (re-exported)
                           PIPELINE_SCHEDULES, PLAN_FORMAT_VERSION, RECOMPUTE_MODES, RESIDENCY_MODES, TIERS,
                           Collective, Estimate, MeshCandidate, NodePlan, PipelinePlan, Scaling, SolverInfo, Timings)


@dataclass(slots=True)
class Plan:
    model: str
    fingerprint: str                  # identifies the captured graph (ops and shapes)
    mesh: dict[str, Any]
    options: dict[str, Any]
    nodes: list[NodePlan]
    placements: dict[str, tuple[str, ...]]      # parameter FQN -> layout, e.g. ("S(0)", "R")
    estimate: Estimate
    solver: SolverInfo
    fallbacks: list[str] = field(default_factory=list)   # "node (op)" replicated because no rule knows the op
    indivisible: list[str] = field(default_factory=list)  # "param [shape]: no dim divisible by tp=4": replicated
    version: int = PLAN_FORMAT_VERSION
    scaling: Scaling = field(default_factory=lambda: Scaling(unavailable="not computed"))
    timings: Timings = field(default_factory=Timings, compare=False)
    recompute: dict[str, str] = field(default_factory=dict)     # layer path -> RECOMPUTE_MODES
    residency: dict[str, str] = field(default_factory=dict)     # FQN or "activations:<layer>" -> RESIDENCY_MODES
    offload: dict[str, str] = field(default_factory=dict)       # "<class>:<layer or FQN>" -> TIERS
    pipeline: PipelinePlan = field(default_factory=PipelinePlan)
    # the planner's way to price `scaling` once first read (`planner.lazy_scaling`): a trace at
    # symbolic sizes that can take longer than the solve, so `plan()` leaves it to the first reader
    pending_scaling: Callable[[], Scaling] | None = field(default=None, compare=False, repr=False)
    mesh_search: list[MeshCandidate] = field(default_factory=list)   # the meshes a Cluster's search weighed

    # -- lookups -------------------------------------------------------------------------
    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r} in this plan")

    def estimate_at(self, batch: int | None = None, seq: int | None = None) -> Estimate:
        """This plan's step time and memory per device at another batch size / sequence length,
        from its symbolic costs (no tracing, no solving). The layouts stay as planned."""
        from .views.scaling import estimate_at
        return estimate_at(self.scaling, batch, seq)

    def largest_batch(self, seq: int | None = None, memory_budget: float | None = None) -> int:
        """The largest global batch whose peak memory fits (default: the budget it was planned for)."""
        from .views.scaling import largest_batch
        return largest_batch(self.scaling, seq, memory_budget)

    def report(self, *, detail: bool = False, symbolic: bool = True) -> str:
        """A readable report; detail=True: one row per op; symbolic=False: without the scaling table."""
        from .views.report import render_report
        return render_report(self, detail=detail, symbolic=symbolic)

    def to_html(self) -> str:
        """The plan as one self-contained HTML page with charts (`autopar/views/html.py`)."""
        from .views.html import render_html
        return render_html(self)

    def diff(self, other: Plan) -> list[str]:
        """Human-readable differences in parameter placements and node layouts."""
        out = []
        for k in sorted(set(self.placements) | set(other.placements)):
            a, b = self.placements.get(k), other.placements.get(k)
            if a != b:
                out.append(f"param {k}: {_lay(a)} -> {_lay(b)}")
        theirs = {n.name: n for n in other.nodes}
        for n in self.nodes:
            m = theirs.get(n.name)
            if m is not None and (n.inputs, n.output) != (m.inputs, m.output):
                out.append(f"node {n.name} ({n.op}): {_lay(n.output)} -> {_lay(m.output)}")
        if self.estimate.step_time_s != other.estimate.step_time_s:
            out.append(f"step time: {self.estimate.step_time_s * 1e3:.3f} ms -> {other.estimate.step_time_s * 1e3:.3f} ms")
        return out

    # -- serialization -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)        # reads `scaling` first: a pending one is priced (and saved) now
        d.pop("timings")
        d.pop("pending_scaling")
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "plan dict") -> Plan:
        """The plan `d` describes, every field checked (`autopar.plan_file`); `PlanFileError` naming
        `source` and the field otherwise. Nothing in `d` is evaluated."""
        return read_plan(cls, d, source)

    @classmethod
    def from_json(cls, text: str, source: str = "plan JSON") -> Plan:
        return parse_plan_json(cls, text, source)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return load_plan(cls, path)


_SCALING_SLOT = Plan.scaling     # the slot `Plan.scaling` reads through the property below


def _scaling(plan: Plan) -> Scaling:
    """`plan.scaling`, priced first where it is pending (the time it took goes to `timings.scaling_s`)."""
    pending = plan.pending_scaling
    if pending is not None:
        t0 = time.perf_counter()
        _SCALING_SLOT.__set__(plan, pending())
        plan.pending_scaling = None
        plan.timings = replace(plan.timings, scaling_s=time.perf_counter() - t0)
    return _SCALING_SLOT.__get__(plan, Plan)


def _set_scaling(plan: Plan, value: Scaling) -> None:
    _SCALING_SLOT.__set__(plan, value)
    plan.pending_scaling = None


Plan.scaling = property(_scaling, _set_scaling, doc="The plan's costs in batch size and sequence length "
                        "(`Scaling`), priced when first read where the planner left them pending.")


def _lay(layout) -> str:
    return "-" if layout is None else "(" + ", ".join(layout) + ")"
