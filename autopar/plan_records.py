"""The records a `Plan` is made of (`autopar/plan.py`), and the words its dicts use.

Pure data, importing nothing of autopar: every layer reads them (the solver's decision families
name their modes with `RECOMPUTE_MODES`, `TIERS`, ...; the views render `NodePlan`, `Estimate`,
`Scaling`; `plan_file.py` checks them field by field).
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
    capture: str = ""             # how a deep stack of blocks was traced (passes/repeated_blocks.py); "" if none


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
    Built by `autopar.planner.scaling`; `unavailable` says why a plan has none."""
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
    """A mesh the mesh search (`autopar/planner/mesh_search.py`, a `Cluster` given) looked at: the chosen one
    first, then the others planned by predicted step, then those left unplanned and why (`note`)."""
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    status: str                               # MESH_CANDIDATE_STATUS
    step_time_s: float | None = None          # the evaluator's price of its best plan (None: not planned)
    peak_memory_bytes: float | None = None
    screen_s: float = 0.0                     # the screen's quick account that ordered the search (not a price)
    note: str = ""
