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

PLAN_FORMAT_VERSION = 3

RECOMPUTE_MODES = ("none", "selective", "full")
RESIDENCY_MODES = ("keep", "regather")
ACTIVATIONS = "activations:"     # residency keys of gathered activations: "activations:<layer or node>"
TIERS = ("device", "host", "disk")
OFFLOAD_CLASSES = ("activations", "optimizer", "gradients", "parameters")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
PIPELINE_KEYS = ("axis", "stages", "virtual_stages", "microbatches", "schedule")   # the `pipeline=` option's


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    """Pipeline stages of a plan. `stages` ranks along mesh axis `axis` each run `virtual_stages`
    model chunks; chunk c (0 <= c < stages * virtual_stages) runs on pipeline rank c % stages (the
    interleaved order of torch's schedules) and starts at module path `boundaries[c]`: the first
    chunk at the first node (its entry is ""), the others at a repeated layer ("blocks.4"). A node
    outside every repeated layer belongs to the chunk of the next layer after it, or to the last
    chunk when none follows (the head and the loss). `microbatches` split the batch of one step;
    `schedule` is one of PIPELINE_SCHEDULES ("interleaved" when virtual_stages > 1)."""
    axis: str | None = None
    stages: int = 1
    virtual_stages: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    boundaries: tuple[str, ...] = ()

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual_stages


@dataclass(frozen=True, slots=True)
class Estimate:
    step_time_s: float
    compute_s: float
    comm_s: float
    peak_memory_bytes: float
    param_state_bytes: float          # parameters + gradients + optimizer state, per device
    activation_bytes: float           # activations live at the peak, per device
    comm_bytes_per_axis: dict[str, float] = field(default_factory=dict)
    family_s: dict[str, float] = field(default_factory=dict)      # seconds added by recompute, residency, offload
    tier_bytes: dict[str, float] = field(default_factory=dict)    # bytes per device held in "host" and "disk"
    freed_bytes: dict[str, float] = field(default_factory=dict)   # bytes each family frees at the peak point
    grad_sync_s: float = 0.0          # gradient synchronisation (its transfers are part of comm_s, its buckets'
                                      # launches are not)
    optimizer_s: float = 0.0          # the optimizer step on the device
    runtime_s: float = 0.0            # autopar runtime's per-node cost
    bubble_s: float = 0.0             # pipeline fill and drain (0 without a pipeline)
    p2p_s: float = 0.0                # pipeline point-to-point sends on the slowest rank
    stage_memory_bytes: dict[str, float] = field(default_factory=dict)   # pipeline rank -> peak bytes
    stage_fwd_s: dict[str, float] = field(default_factory=dict)          # pipeline rank -> one microbatch's forward
    stage_bwd_s: dict[str, float] = field(default_factory=dict)          # ... and backward


@dataclass(frozen=True, slots=True)
class Collective:
    kind: str          # "all_reduce@tp", ...
    phase: str         # "forward" or "backward"
    tensor: str        # the producer node whose output is resharded
    seconds: float


@dataclass(frozen=True, slots=True)
class NodePlan:
    name: str
    op: str
    module: str                       # module path the node came from ("blocks.0.mlp")
    inputs: tuple[tuple[str, ...], ...]
    output: tuple[str, ...]
    labels: tuple[str, ...]           # per mesh axis: "batch", "column", "row", "replicate", ...
    executor: str                     # "local" | "context" (context-parallel attention) | "replicate" (fallback) | "input" | "param"
    compute_s: float = 0.0
    collectives: tuple[Collective, ...] = ()
    fallback: bool = False


@dataclass(frozen=True, slots=True)
class SolverInfo:
    solver: str
    status: str
    n_variables: int
    n_constraints: int
    objective_s: float
    n_decisions: int              # decisions in the graph
    n_nodes: int
    n_shared: int = 0             # decisions that share a repeated layer's variables
    gap: float = 0.0              # relative optimality gap at the stop (0: proven optimal)
    capture: str = ""             # how a deep stack of blocks was traced (passes/short_stack.py); "" if none


@dataclass(frozen=True, slots=True)
class Timings:
    """Wall seconds of this planning run: kept out of the JSON so that a plan is a pure function of
    model, mesh and options (byte-identical when re-planned)."""
    solve_s: float = 0.0
    total_s: float = 0.0
    scaling_s: float = 0.0        # pricing the plan symbolically (part of total_s)
    cached: bool = False          # taken from the plan cache, not solved


@dataclass(frozen=True, slots=True)
class Scaling:
    """The plan's costs as expressions in the batch size B and sequence length S (sympy text),
    so that it can be priced at other sizes without tracing again (`Plan.estimate_at`).
    Built by `autopar.scaling`; `unavailable` says why a plan has none."""
    batch: int = 0                                # the sizes the plan was made at
    seq: int | None = None
    fixed: tuple[str, ...] = ()                   # "batch"/"seq": sizes the model's code fixes
    compute_s: str = "0"
    comm_s: str = "0"
    other_s: str = "0"                            # the memory families' seconds, optimizer step, runtime
    state_bytes: str = "0"
    memory_points: tuple[str, ...] = ()           # bytes at each liveness point that can be the peak
    divisible: tuple[tuple[str, int], ...] = ()   # (size expression, n): a split dim must divide evenly
    comm_bytes_per_axis: dict[str, str] = field(default_factory=dict)   # mesh axis -> bytes sent per device
    memory_budget: float = 0.0                    # bytes per device the plan was made to fit
    unavailable: str = ""


MESH_CANDIDATE_STATUS = ("chosen", "planned", "infeasible", "pruned", "not planned")


@dataclass(frozen=True, slots=True)
class MeshCandidate:
    """A mesh the mesh search (`autopar/mesh_search.py`, a `Cluster` given) looked at: the chosen one
    first, then the others planned by predicted step, then those left unplanned and why (`note`)."""
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    status: str                               # MESH_CANDIDATE_STATUS
    step_time_s: float | None = None          # the evaluator's price of its best plan (None: not planned)
    peak_memory_bytes: float | None = None
    screen_s: float = 0.0                     # the screen's quick account that ordered the search (not a price)
    note: str = ""


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
        from .scaling import estimate_at
        return estimate_at(self.scaling, batch, seq)

    def largest_batch(self, seq: int | None = None, memory_budget: float | None = None) -> int:
        """The largest global batch whose peak memory fits (default: the budget it was planned for)."""
        from .scaling import largest_batch
        return largest_batch(self.scaling, seq, memory_budget)

    def report(self, *, detail: bool = False, symbolic: bool = True) -> str:
        """A readable report; detail=True: one row per op; symbolic=False: without the scaling table."""
        from .report import render_report
        return render_report(self, detail=detail, symbolic=symbolic)

    def to_html(self) -> str:
        """The plan as one self-contained HTML page with charts (`autopar/html_report.py`)."""
        from .html_report import render_html
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
        from .plan_file import read_plan
        return read_plan(d, source)

    @classmethod
    def from_json(cls, text: str, source: str = "plan JSON") -> Plan:
        from .plan_file import parse_plan_json
        return parse_plan_json(text, source)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        from .plan_file import load_plan
        return load_plan(path)


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
