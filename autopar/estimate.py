"""`autopar.estimate`: price a whole training step for any plan, autopar's or one you wrote.

    est = autopar.estimate(model, batch, mesh,                       # mesh axes ("pp", "dp", "tp")
                           {"*.qkv.weight": ("R", "S(0)"), ...},     # layouts over the other axes
                           batch_axes=("dp",), recompute=True,
                           pipeline=Pipeline(stages=4, microbatches=16, schedule="interleaved",
                                             virtual_stages=2))
    print(est.report()); est.step_time_s; est.tflops_per_device

`plan` is an autopar `Plan`, a dict of pins (parameter names or globs, or node names -> one
placement per non-pipeline mesh axis; the ops in between take the fastest layouts consistent
with them, as the planner would choose), or None (autopar chooses).

How a step is composed, from the planner's own per-op and per-edge prices (the planning
problem's tables, `solver/problem.py`); an autopar `Plan` is priced by the planner's evaluator
itself (`solver/evaluate.py`), equal to `plan.estimate`:

* The model is captured at one microbatch (`example_inputs` is the global batch of a step; with
  m microbatches each is 1/m of it). Every op node lands in a *segment*: `pre` (before the layer
  stack: embeddings), one per layer of the stack (the `ModuleList` of repeated blocks, e.g.
  `blocks.3`), and `post` (final norm, head, loss).
* Per segment and microbatch: forward and backward compute (`cost_model.compute.op_times`: per-op
  backward factors, attention on the matrix units); forward resharding (tensor-parallel all-reduces, weight gathers) and backward
  resharding of activation gradients, all on the critical path (no overlap). With
  `recompute=True` every layer runs its forward (compute and collectives) once more before its
  backward: full activation recomputation as Megatron-LM ran it.
* `num_layers` prices a stack of that many copies of the captured layers (their mean), so a
  model captured with ONE layer prices the full-depth model: costs per layer are exact copies
  for identical layers, and nothing but the layer count differs.
* Layers are dealt to `stages * virtual_stages` chunks in order, chunk j on device j mod stages;
  `pre` runs on the first device, `post` on the last. `cost_model.pipeline` turns per-device
  times into the step time (bubble included); stage-boundary activations go point-to-point over
  the pipeline axis's link.
* Gradient synchronisation (the backward legs of parameter edges: data-parallel all-reduces or
  reduce-scatters) runs once per step, bucketed (`bucket_bytes`); `grad_overlap` in [0, 1] is
  the fraction of the last microbatch's backward it may hide behind (0: after the backward, as
  Megatron's local DDP; 1: fully behind it but the last bucket, as PyTorch DDP). A parameter
  used on the first and the last stage (tied embeddings) is also all-reduced between them.
* The optimizer step: `cost_model.compute.optimizer_seconds`, as the planner prices it.
* Memory per device: parameter state (`precision`: "mixed" = 16-bit params and grads with fp32
  master and moments; "same" = all in the parameter dtype), plus activations saved for the
  backward times the microbatches in flight (`cost_model.pipeline.in_flight_microbatches`);
  with recompute, a layer keeps only its input, and one layer's activations live during its
  recomputation.
"""
from __future__ import annotations

import math
import operator
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from .compat import pytree
from .cost_model.autograd import gradient_sums_time
from .cost_model.comm import bucketed_time, collective_bytes_on_wire
from .cost_model.compute import grad_accumulation_time, optimizer_seconds
from .cost_model.memory import state_bytes_per_element
from .cost_model.pipeline import Pipeline, in_flight_microbatches, pipeline_time
from .cost_model.profiles import DDP_BUCKET_BYTES
from .errors import PlanMismatchError
from .mesh import Mesh
from .passes.capture import capture
from .passes.rewrite import output_modules, reshards_edge
from .passes.shape_prop import annotate, tensor_meta
from .placement import layout_str
from .plan import Plan
from .cost_model.recompute import saved_under_selective
from .planner import PlanOptions, communication, plan_assignment, planning_problem
from .solver.decisions.stages import node_chunks
from .solver.evaluate import Staging, evaluate
from .solver.ilp import solve
from .solver.problem import build_problem, chosen_edges, grad_layout_in, grad_layout_out, op_cost_args
from .strategies.strategy import shard_count

__all__ = ["estimate", "StepEstimate", "Pipeline", "DDP_BUCKET_BYTES"]

PRE, POST = "pre", "post"


@dataclass(slots=True)
class _Seg:
    """Costs of one segment for one microbatch (seconds; bytes per device)."""
    fwd_compute: float = 0.0
    bwd_compute: float = 0.0
    fwd_comm: float = 0.0
    bwd_comm: float = 0.0
    flops: float = 0.0               # forward FLOPs, global
    train_flops: float = 0.0         # forward + backward FLOPs, global
    saved_bytes: float = 0.0         # activations kept for the backward, per device
    input_bytes: float = 0.0         # the largest activation entering the segment, per device
    runtime: float = 0.0             # autopar runtime's per-node cost (profile.runtime_op_overhead), fwd + bwd
    params: set = field(default_factory=set)

    def add(self, other: _Seg, k: float = 1.0) -> None:
        for f in ("fwd_compute", "bwd_compute", "fwd_comm", "bwd_comm", "flops", "train_flops", "saved_bytes",
                  "input_bytes", "runtime"):
            setattr(self, f, getattr(self, f) + k * getattr(other, f))


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


# -- helpers ---------------------------------------------------------------------------------
def _stage_mesh(mesh: Mesh, axis: str | None) -> Mesh:
    return mesh.stage_mesh(axis)


def _microbatch(example_inputs, microbatches: int):
    """The first 1/m of every tensor whose dim 0 is the batch (the first tensor input's dim 0)."""
    leaves, spec = pytree.tree_flatten(example_inputs)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.ndim >= 1]
    if microbatches == 1 or not tensors:
        return example_inputs
    batch = tensors[0].shape[0]
    if batch % microbatches:
        raise ValueError(f"the batch of {batch} does not split into {microbatches} microbatches")
    cut = lambda t: t[: batch // microbatches] if isinstance(t, torch.Tensor) and t.ndim >= 1 and \
        t.shape[0] == batch else t  # noqa: E731
    return pytree.tree_unflatten([cut(t) for t in leaves], spec)


def _layer_of(node) -> tuple[str, int] | None:
    """(stack, index) of the repeated block a node belongs to: `blocks.3.attn` -> ("blocks", 3)."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in stack.values():
        parts = path.replace("L['self'].", "").replace("L__self___", "").split(".")
        for j, part in enumerate(parts):
            if part.isdigit() and j > 0:
                return ".".join(parts[:j]), int(part)
    return None


def _segments(nodes, layers: str | None) -> tuple[dict[str, str], list[str]]:
    """Node name -> segment ("pre", "layer:<i>", "post"); and the layer segments in order.

    Ops before the first layer are `pre`, ops after the last layer's last op are `post`, and ops
    between two layers (functional code in the model's forward) go with the layer before them."""
    found = {n.name: _layer_of(n) for n in nodes if n.op == "call_function"}
    if layers is None:
        counts = Counter(v[0] for v in found.values() if v is not None)
        layers = counts.most_common(1)[0][0] if counts else None
    seg, order, current, last = {}, [], PRE, -1
    for i, n in enumerate(nodes):
        if n.op != "call_function":
            continue
        f = found[n.name]
        if f is not None and f[0] == layers:
            current, last = f"layer:{f[1]}", i
            if current not in order:
                order.append(current)
        seg[n.name] = current
    for i, n in enumerate(nodes):
        if i > last >= 0 and n.name in seg:
            seg[n.name] = POST
    return seg, order


def _grad_sync_once_per_step(problem, by_name, weight: float) -> None:
    """Reprice parameter edges for the solver: a parameter's gradient is synchronised once per step,
    not once per microbatch, so its leg weighs `weight` = 1/m against per-microbatch costs (the
    planner's tables price one pass of the graph). Tables are rebuilt, never edited in place (the
    planner shares them between identical edges), and only where our rebuild of the table with
    weight 1 reproduces the planner's own (else the planner's table is kept)."""
    mesh = problem.mesh
    for e in problem.edges:
        src = problem.decisions[e.src]
        if src.kind != "param" or e.dst == "output":
            continue
        dst = problem.decisions[e.dst]
        meta = tensor_meta(by_name[e.src].meta.get("val"))[0]
        a_keys = list(dict.fromkeys(s.output for s in src.strategies))
        b_keys = list(dict.fromkeys((t.inputs[e.slot], grad_layout_in(t, e.slot)) for t in dst.strategies))
        if (len(a_keys), len(b_keys)) != (len(e.cost), len(e.cost[0])):
            continue

        def table(w):
            return [[mesh.reshard_cost(meta.shape, meta.dtype.itemsize, a, b).seconds
                     + w * mesh.reshard_cost(meta.shape, meta.dtype.itemsize, gb, grad_layout_out(a)).seconds
                     for (b, gb) in b_keys] for a in a_keys]
        same = table(1.0)
        if all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-15) for r1, r2 in zip(same, e.cost) for x, y in zip(r1, r2)):
            e.cost = table(weight)


def _scatter_layout(layout, shape, sizes):
    """`layout` with every replicated axis splitting a dim instead (the scatter half of
    scatter/gather), or None if no dim divides evenly."""
    out, split = list(layout), [1] * len(shape)
    for a, p in enumerate(layout):
        if isinstance(p, Shard):
            split[p.dim] *= sizes[a]
    changed = False
    for a, p in enumerate(layout):
        if isinstance(p, Replicate) and sizes[a] > 1:
            for d in reversed(range(len(shape))):
                if shape[d] % (split[d] * sizes[a]) == 0:
                    out[a], split[d], changed = Shard(d), split[d] * sizes[a], True
                    break
            else:
                return None
    return tuple(out) if changed else None


# -- the estimate ----------------------------------------------------------------------------
def estimate(model: torch.nn.Module, example_inputs, mesh: Mesh, plan: Plan | Mapping | None = None, *,
             example_kwargs: dict | None = None, batch_axes: Sequence[str] | None = None,
             pipeline: Pipeline | None = None, recompute: bool = False, grad_overlap: float = 0.0,
             num_layers: int | None = None, layers: str | None = None, optimizer: str = "adamw",
             precision: str = "auto", bucket_bytes: float | None = DDP_BUCKET_BYTES,
             grad_sync_algorithm: str = "ring",
             time_limit: float | None = 60.0) -> StepEstimate:
    """Price one training step of `model` on `mesh` under `plan` (see the module docstring).

    example_inputs: the global batch of one step (meta tensors are fine).
    mesh: every axis, the pipeline axis (`pipeline.axis`) included.
    plan: a `Plan` (pipeline and microbatches not supported: autopar plans have none yet), a dict
      of pins over the non-pipeline axes, or None (autopar chooses).
    batch_axes: mesh axes over which inputs arrive split on dim 0 (data parallelism).
    recompute: full activation recomputation of every layer (one more forward before its backward).
    grad_overlap: fraction of the last microbatch's backward that gradient sync may hide behind.
    num_layers: price the layer stack as this many copies of the captured layers.
    layers: name of the layer stack (`ModuleList`), e.g. "blocks"; found by itself if omitted.
    precision: "mixed", "same" or "auto" (mixed for 16-bit parameters).
    bucket_bytes: gradient bucket size (None: one bucket, as a contiguous gradient buffer; 0: one
      collective per parameter, as the planner prices them).
    """
    pipe = pipeline or Pipeline(stages=1, microbatches=1, axis=None)
    if not 0.0 <= grad_overlap <= 1.0:
        raise ValueError(f"grad_overlap must be in [0, 1], got {grad_overlap}")
    p, v, m = pipe.stages, pipe.virtual_stages, pipe.microbatches
    if p > 1 and pipe.axis not in mesh.axis_names:
        raise ValueError(f"the pipeline runs along mesh axis {pipe.axis!r}, which {mesh!r} does not have")
    if pipe.axis in mesh.axis_names and mesh.shape[mesh.axis_index(pipe.axis)] != p:
        raise ValueError(f"pipeline of {p} stages on axis {pipe.axis!r} of size "
                         f"{mesh.shape[mesh.axis_index(pipe.axis)]}: they must match")
    if isinstance(plan, Plan):
        if pipe.stages > 1 or pipe.microbatches > 1 or recompute or num_layers is not None or grad_overlap:
            raise ValueError("an autopar Plan decides its own recomputation and pipeline: estimate it as planned "
                             "(no pipeline=, recompute=, num_layers=, grad_overlap=), or pass pins for a "
                             "hand-written configuration")
        m = plan.pipeline.microbatches
        pipe = Pipeline(plan.pipeline.stages, m, axis=plan.pipeline.axis) if plan.pipeline.stages > 1 else pipe
    smesh = _stage_mesh(mesh, pipe.axis)
    micro = _microbatch(example_inputs if isinstance(example_inputs, tuple) else (example_inputs,), m)
    cap = capture(model, micro, example_kwargs)
    infos = annotate(cap.gm)
    if isinstance(plan, Plan):
        return _estimate_plan(cap, infos, mesh, smesh, plan)
    sharded_outputs = False
    problem = build_problem(cap, infos, smesh, pins=dict(plan) if plan else None, optimizer=optimizer,
                            batch_axes=batch_axes)
    if m > 1:
        _grad_sync_once_per_step(problem, by_name={n.name: n for n in cap.gm.graph.nodes}, weight=1.0 / m)
    choice = solve(problem, float("inf"), time_limit).choice
    chosen = {name: d.strategies[choice[d.leader]] for name, d in problem.decisions.items()}
    nodes = list(cap.gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    seg_of, layer_segs = _segments(nodes, layers)
    ng = problem.needs_grad
    profile, shape = smesh.profile, smesh.shape
    segs: dict[str, _Seg] = defaultdict(_Seg)
    n_nodes = 0

    def book_sums(name: str, seconds: float) -> None:
        """Gradients of a node's several consumers are added up where they arrive: book that with the
        first consumer's segment (a layer's input is summed in that layer, whichever captured it)."""
        first = next((u.name for u in by_name[name].users if ng.get(u.name)), None)
        segs[seg_of.get(first, seg_of.get(name, PRE))].bwd_compute += seconds

    # compute, per node
    for name, d in problem.decisions.items():
        if d.kind == "param" and d.facts.work:     # a parameter's cost is its gradient sums (tied weights)
            book_sums(name, d.compute_s[choice[d.leader]])
        if d.kind != "op":
            continue
        node, info = by_name[name], infos[name]
        s = chosen[name]
        seg = segs[seg_of[name]]
        seg.flops += info.flops
        seg.train_flops += info.flops * (3.0 if ng[name] else 1.0)
        if node.target is not operator.getitem:        # every other op, views included, runs as one LocalOp
            seg.runtime += profile.runtime_op_overhead
            n_nodes += 1
        i = choice[d.leader]                           # the planner's own prices of the op (its tables)
        fwd, bwd = d.fwd_s[i], d.compute_s[i] - d.fwd_s[i]
        seg.fwd_compute += fwd
        if ng[name]:
            sums = gradient_sums_time(d.facts.work, op_cost_args(info, s, shape, d.facts).out_b, profile)
            seg.bwd_compute += bwd - sums
            book_sums(name, sums)

    # resharding, per edge; gradient sync of parameters, per parameter and axis
    grad_wire: dict[str, dict[tuple[str, str], float]] = defaultdict(dict)   # param -> (axis, kind) -> bytes
    param_segs: dict[str, set] = defaultdict(set)
    per_axis_step = dict.fromkeys(mesh.axis_names, 0.0)
    per_axis_micro: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: dict.fromkeys(mesh.axis_names, 0.0))
    for c in chosen_edges(problem, choice, cap):
        e, meta, a = c.edge, c.meta, c.src
        src = problem.decisions[e.src]
        dst_seg = (POST if layer_segs else PRE) if e.dst == "output" else seg_of[e.dst]
        seg = segs[dst_seg]
        fwd = smesh.reshard_cost(meta.shape, meta.dtype.itemsize, a, c.dst)     # its bytes and collectives
        grad = ng.get(e.src, False) and meta.dtype.is_floating_point
        bwd = smesh.reshard_cost(meta.shape, meta.dtype.itemsize, c.grad_src, c.grad_dst) if grad else None
        ia = e.a_of[choice[src.leader]]                 # seconds: the planner's edge table
        ib = 0 if e.dst == "output" else e.b_of[choice[problem.decisions[e.dst].leader]]
        seg.fwd_comm += e.fwd[ia][ib]
        # the runtime modules the rewrite puts on this edge (passes/rewrite.py); a decision's kind
        # names its executor for parameters and inputs
        k = (output_modules(sharded_outputs) if e.dst == "output"
             else int(reshards_edge(src.kind, tuple(a), tuple(c.dst))))
        seg.runtime += k * profile.runtime_op_overhead
        n_nodes += k
        for ax, nb in zip(smesh.axis_names, fwd.bytes_per_axis):
            per_axis_micro[(dst_seg, "fwd")][ax] += nb
        if src.kind == "param":
            param_segs[src.fqn].add(dst_seg)
            if bwd is not None:
                for ax, nb in zip(smesh.axis_names, bwd.bytes_per_axis):
                    if nb > 0:
                        kind = next(c.split("@")[0] for c in bwd.collectives if c.endswith("@" + ax))
                        key = (ax, kind)
                        grad_wire[src.fqn][key] = max(grad_wire[src.fqn].get(key, 0.0), nb)
        else:
            if bwd is not None:
                seg.bwd_comm += e.cost[ia][ib] - e.fwd[ia][ib]
                for ax, nb in zip(smesh.axis_names, bwd.bytes_per_axis):
                    per_axis_micro[(dst_seg, "bwd")][ax] += nb
            if src.kind == "op" and seg_of.get(e.src) != dst_seg and dst_seg != POST:
                seg.input_bytes = max(seg.input_bytes, meta.nbytes / shard_count(a, shape))

    # activations saved for the backward (end of the forward), per segment
    if problem.live.end_index >= 0:
        for owner in problem.live.points[problem.live.end_index]:
            d = problem.decisions[owner]
            segs[seg_of.get(owner, PRE)].saved_bytes += d.act_bytes[choice[d.leader]]

    # parameters: state bytes and elements per segment
    state_elems: dict[str, float] = {}
    param_itemsize: dict[str, int] = {}
    for name, d in problem.decisions.items():
        if d.kind != "param":
            continue
        meta = tensor_meta(by_name[name].meta.get("val"))[0]
        state_elems[d.fqn] = math.prod(meta.shape) / shard_count(chosen[name].output, shape)
        param_itemsize[d.fqn] = meta.dtype.itemsize

    # the layer stack, scaled to num_layers copies of the mean captured layer
    k = len(layer_segs)
    n_layers = num_layers if num_layers is not None else k
    if n_layers and not k:
        raise ValueError("num_layers was given but the model has no stack of repeated layers (a ModuleList of "
                         "blocks): pass layers='<name of the ModuleList>'")
    layer = _Seg()
    for s_ in layer_segs:
        layer.add(segs[s_], 1.0 / k)
    pre, post = segs[PRE], segs[POST]

    # layers -> devices (chunk j on device j mod p)
    chunks = p * v
    if n_layers < chunks and p > 1:
        raise ValueError(f"{n_layers} layers cannot fill {p} stages x {v} chunks")
    per_chunk = [n_layers // chunks + (1 if j < n_layers % chunks else 0) for j in range(chunks)]
    n_dev = [sum(per_chunk[j] for j in range(d, chunks, p)) for d in range(p)]

    def dev_total(d: int, attr: str, layer_k: float = 1.0) -> float:
        x = n_dev[d] * layer_k * getattr(layer, attr)
        if d == 0:
            x += getattr(pre, attr)
        if d == p - 1:
            x += getattr(post, attr)
        return x

    fwd_d = [dev_total(d, "fwd_compute") + dev_total(d, "fwd_comm") + dev_total(d, "runtime") for d in range(p)]
    bwd_d = [dev_total(d, "bwd_compute") + dev_total(d, "bwd_comm") for d in range(p)]
    if recompute:
        bwd_d = [b + n_dev[d] * (layer.fwd_compute + layer.fwd_comm) for d, b in enumerate(bwd_d)]

    # point-to-point at stage boundaries: the activation entering a layer (its gradient comes back)
    p2p = 0.0
    if p > 1:
        p2p = _p2p_time(problem, chosen, by_name, seg_of, layer_segs, mesh, smesh, pipe)
    # gradient accumulation: microbatches 2..m add their parameter gradients into the accumulated
    # ones, on the device's critical path (spread over the m microbatches' backwards)
    if m > 1:
        for d in range(p):
            mults = [(_param_multiplicity(ss, layer_segs, n_dev[d], k, d, p), f) for f, ss in param_segs.items()]
            nbytes = sum(x * state_elems[f] * param_itemsize[f] for x, f in mults)
            bwd_d[d] += (m - 1) / m * grad_accumulation_time(nbytes, sum(x for x, _ in mults), profile)
    pt = pipeline_time(fwd_d, bwd_d, m, virtual_stages=v, p2p_forward=p2p, p2p_backward=p2p)

    # gradient sync per device, bucketed per (axis, collective)
    ax_index = {n: i for i, n in enumerate(smesh.axis_names)}
    pp_link = mesh.axes[mesh.axis_index(pipe.axis)].link if p > 1 else None
    sync_d, opt_d, state_d, buckets_d = [], [], [], []
    launch = profile.kernel_overhead + profile.collective_overhead     # per collective, as Mesh.reshard_cost
    first_last = {f for f, ss in param_segs.items() if p > 1 and PRE in ss and POST in ss}
    for d in range(p):
        wire: dict[tuple[str, str], float] = defaultdict(float)
        elems, state, tensors = 0.0, 0.0, 0.0
        for fqn, ss in param_segs.items():
            mult = _param_multiplicity(ss, layer_segs, n_dev[d], k, d, p)
            if not mult:
                continue
            tensors += mult
            for key, nb in grad_wire[fqn].items():
                wire[key] += mult * nb
            elems += mult * state_elems[fqn]
            prec = precision if precision != "auto" else ("mixed" if param_itemsize[fqn] == 2 else "same")
            state += mult * state_elems[fqn] * state_bytes_per_element(param_itemsize[fqn], optimizer, prec)
        t_sync, sync_bytes = 0.0, 0.0
        if bucket_bytes == 0:     # one collective per parameter, as the planner prices them
            for fqn, ss in param_segs.items():
                mult = _param_multiplicity(ss, layer_segs, n_dev[d], k, d, p)
                for (ax, kind), nb in grad_wire[fqn].items() if mult else ():
                    i = ax_index[ax]
                    n = smesh.shape[i]
                    full = nb / (collective_bytes_on_wire(kind, 1.0, n) or 1.0)
                    t_sync += mult * bucketed_time(kind, full, n, smesh.axes[i].link, None, launch)
        for (ax, kind), nb in (wire.items() if bucket_bytes != 0 else ()):
            i = ax_index[ax]
            n = smesh.shape[i]
            full = nb / (collective_bytes_on_wire(kind, 1.0, n) or 1.0)
            t_sync += bucketed_time(kind, full, n, smesh.axes[i].link, bucket_bytes, launch,
                                    grad_sync_algorithm)
            sync_bytes = max(sync_bytes, full)
            if d == 0:
                per_axis_step[ax] += nb
        buckets_d.append(1 if not bucket_bytes else max(1, math.ceil(sync_bytes / bucket_bytes)))
        if first_last and d in (0, p - 1):
            tied = sum(state_elems[f] * param_itemsize[f] for f in first_last)
            t_sync += bucketed_time("all_reduce", tied, 2, pp_link, None, launch)
        sync_d.append(t_sync)
        opt_d.append(optimizer_seconds(elems, tensors, profile, optimizer, mixed=precision == "mixed"))
        state_d.append(state)

    # exposed sync: hidden behind grad_overlap of the device's last backward, never the last bucket
    exposed = []
    for d in range(p):
        s = sync_d[d]
        if grad_overlap > 0 and s > 0:
            s = max(s - grad_overlap * bwd_d[d], s / buckets_d[d])
        exposed.append(s)
    tail = max(exposed[d] + opt_d[d] for d in range(p))
    step = pt.total_s + tail

    # activation memory per device
    act_d = []
    for d in range(p):
        per_micro = n_dev[d] * (layer.input_bytes if recompute else layer.saved_bytes)
        per_micro += (pre.saved_bytes if d == 0 else 0.0) + (post.saved_bytes if d == p - 1 else 0.0)
        flight = in_flight_microbatches(d, p, m, pipe.schedule, v)
        act_d.append(flight * per_micro + (layer.saved_bytes if recompute and n_dev[d] else 0.0))
    peak_dev = max(range(p), key=lambda d: state_d[d] + act_d[d])

    # FLOPs of the step (all devices): data-parallel replicas each run the microbatches shown
    fl_model = m * (pre.train_flops + n_layers * layer.train_flops + post.train_flops)
    fl_hw = fl_model + (m * n_layers * layer.flops if recompute else 0.0)
    per_axis = {ax: per_axis_step.get(ax, 0.0) for ax in mesh.axis_names}
    for (sname, leg), axes in per_axis_micro.items():
        is_layer = sname.startswith("layer:")
        mult = (n_layers / k if is_layer else 1.0) * (2.0 if recompute and is_layer and leg == "fwd" else 1.0)
        for ax, nb in axes.items():
            per_axis[ax] = per_axis.get(ax, 0.0) + m * mult * nb
    if p > 1:
        per_axis[pipe.axis] = per_axis.get(pipe.axis, 0.0) + 2 * m * v * layer.input_bytes
    slow = max(range(p), key=lambda d: pt.per_device_s[d])
    comp = m * (dev_total(slow, "fwd_compute") + dev_total(slow, "bwd_compute")
                + (n_dev[slow] * layer.fwd_compute if recompute else 0.0))
    comm = m * (dev_total(slow, "fwd_comm") + dev_total(slow, "bwd_comm")
                + (n_dev[slow] * layer.fwd_comm if recompute else 0.0))
    return StepEstimate(
        step_time_s=step, pipeline_s=pt.total_s, compute_s=comp, comm_s=comm, p2p_s=pt.p2p_s,
        bubble_s=pt.bubble_s, grad_sync_s=max(sync_d), grad_sync_exposed_s=max(exposed), optimizer_s=max(opt_d),
        peak_memory_bytes=state_d[peak_dev] + act_d[peak_dev], param_state_bytes=state_d[peak_dev],
        activation_bytes=act_d[peak_dev], model_flops=fl_model, hardware_flops=fl_hw, devices=mesh.size,
        microbatches=m, stages=p, virtual_stages=v, layers=n_layers, recompute=recompute,
        grad_overlap=grad_overlap, per_device_s=pt.per_device_s, comm_bytes_per_axis=per_axis,
        layout_summary={problem.decisions[n].fqn: layout_str(chosen[n].output) for n in problem.decisions
                        if problem.decisions[n].kind == "param"},
        runtime_s=m * dev_total(slow, "runtime"), graph_nodes=n_nodes)


def _estimate_plan(cap, infos, mesh: Mesh, smesh: Mesh, plan: Plan):
    """An autopar plan's step, as the planner priced it: its layouts and memory decisions read back on
    its own planning problem (one microbatch on the mesh without the pipeline axis) and priced by the
    one evaluator (`solver.evaluate`, per pipeline rank when it is pipelined), so it equals
    `plan.estimate` exactly."""
    if list(plan.mesh["shape"]) != list(mesh.shape):
        raise PlanMismatchError(f"the plan was made for mesh {plan.mesh['shape']}, not {mesh.shape}")
    pp = plan.pipeline
    staged = pp.stages > 1
    problem = planning_problem(cap, infos, smesh, PlanOptions.from_dict(plan.options))
    choice, options = plan_assignment(problem, stage_view(plan, mesh.axis_index(pp.axis)) if staged else plan)
    staging = (Staging(pp, node_chunks(problem, cap.gm.graph, pp), mesh.axes[mesh.axis_index(pp.axis)].link)
               if staged else None)
    ev = evaluate(problem, choice, options, staging)
    _, per_axis = communication(problem, choice, cap)
    ng = problem.needs_grad
    model_flops = sum(infos[n].flops * (3.0 if ng.get(n) else 1.0) for n, d in problem.decisions.items()
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
        grad_overlap=0.0, per_device_s=tuple(s.fwd_s + s.bwd_s for s in price.stages) if price else (fwd_bwd,),
        comm_bytes_per_axis=per_axis, layout_summary=dict(plan.placements), runtime_s=ev.runtime_s,
        graph_nodes=ev.graph_nodes)


def stage_view(plan: Plan, k: int) -> Plan:
    """A pipelined plan's layouts without their placement on the pipeline axis k (what one stage runs
    on the mesh without it)."""
    cut = lambda lay: tuple(x for i, x in enumerate(lay) if i != k) or ("R",)  # noqa: E731
    nodes = [replace(n, inputs=tuple(cut(i) for i in n.inputs), output=cut(n.output) if n.output else n.output,
                     labels=cut(n.labels) if n.labels else n.labels) for n in plan.nodes]
    return replace(plan, nodes=nodes, placements={f: cut(p) for f, p in plan.placements.items()})


def _param_multiplicity(segments: set, layer_segs: list[str], n_layers_here: int, k: int, d: int, p: int) -> float:
    """How many copies of a parameter device d holds: per layer for layer parameters (scaled from
    the k captured layers), 1 for a pre/post parameter on its device (both ends for tied ones)."""
    if segments & set(layer_segs):
        return n_layers_here / k if k else 0.0
    here = (PRE in segments and d == 0) or (POST in segments and d == p - 1)
    return 1.0 if here else 0.0


def _p2p_time(problem, chosen, by_name, seg_of, layer_segs, mesh, smesh, pipe) -> float:
    """Seconds to send one stage-boundary activation to the next stage (one direction)."""
    from .cost_model.comm import p2p_time
    link = mesh.axes[mesh.axis_index(pipe.axis)].link
    best = None
    for e in problem.edges:
        if e.dst == "output" or seg_of.get(e.dst) not in layer_segs or problem.decisions[e.src].kind != "op":
            continue
        if seg_of.get(e.src) == seg_of.get(e.dst):
            continue
        a = chosen[e.src].output
        meta = tensor_meta(by_name[e.src].meta.get("val"))[0]
        local = meta.nbytes / shard_count(a, smesh.shape)
        if best is None or local > best[0]:
            best = (local, meta, a)
    if best is None:
        return 0.0
    local, meta, a = best
    if pipe.scatter_gather and any(isinstance(x, (Replicate, Partial)) for x in a):
        scattered = _scatter_layout(tuple(Replicate() if isinstance(x, Partial) else x for x in a), meta.shape,
                                    smesh.shape)
        if scattered is not None:
            piece = meta.nbytes / shard_count(scattered, smesh.shape)
            gather = smesh.reshard_cost(meta.shape, meta.dtype.itemsize, scattered, a).seconds
            return p2p_time(piece, link) + gather
    return p2p_time(local, link)
