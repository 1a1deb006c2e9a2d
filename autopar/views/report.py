"""`plan.report()`: what was sharded how, what it costs, and what the solver did."""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from ..strategies.attention import CONTEXT_LABELS


def _gib(b: float) -> str:
    return f"{b / 2**30:.3f} GiB" if b >= 2**27 else f"{b / 2**20:.2f} MiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def _lay(layout) -> str:
    return "(" + ", ".join(layout) + ")"


_INDEX = re.compile(r"(?<=\.)(\d+)(?=\.|$)")      # a layer index inside a dotted path: "layers.12.fc"


def collapse(rows: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Rows (name, rest) with names differing in one layer index only and the same rest, as one row
    whose name lists the indices: ("layers.3.fc.weight", "(R, S(0))") for layers 0-31 becomes
    ("layers.{0-31}.fc.weight", "(R, S(0))"). Order: each group where its first row was."""
    groups: dict[tuple[str, str], list[int]] = {}
    for name, rest in rows:
        m = _INDEX.search(name)
        key = (name if m is None else name[:m.start()] + "{}" + name[m.end():], rest)
        groups.setdefault(key, []).append(-1 if m is None else int(m.group(1)))
    out = []
    for (pattern, rest), idx in groups.items():
        name = pattern if idx == [-1] else pattern.replace("{}", str(idx[0]) if len(idx) == 1 else "{" + index_ranges(idx) + "}", 1)
        out.append((name, rest))
    return out


def index_ranges(idx: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(parts)


def _groups(plan):
    """Op nodes grouped by module path, in order of first appearance (graph outputs last)."""
    groups: dict[str, list] = {}
    for n in plan.nodes:
        if n.executor in ("param", "input"):
            continue
        key = "(graph outputs)" if n.executor == "output" else (n.module or "(top level)")
        groups.setdefault(key, []).append(n)
    return groups.items()


def render_report(plan, *, detail: bool = False, symbolic: bool = True) -> str:
    """The plan for a person. detail: one row per op; symbolic=False: without the table of step time
    and memory over batch sizes (priced from `plan.scaling`)."""
    lines = _summary_lines(plan)
    lines += _mesh_search_lines(plan)
    lines += _pipeline_lines(plan)
    lines += [f"Parallelism: {tensor_parallel_family(plan).describe()}", ""]
    lines += _parameter_lines(plan)
    lines += _layer_lines(plan)
    lines += _op_lines(plan) if detail else []
    lines.append("")
    lines += _collective_lines(plan)
    lines += _memory_lines(plan)
    lines += _output_lines(plan)
    lines += _batch_norm_lines(plan)
    lines += _expert_lines(plan)
    lines += _scaling_lines(plan) if symbolic else []
    lines += _replicated_lines(plan)
    return "\n".join(lines)


def _summary_lines(plan) -> list[str]:
    """Step time, peak memory, traffic per axis, the solver and the capture, then a blank line."""
    m, est, sol = plan.mesh, plan.estimate, plan.solver
    axes = ", ".join(f"{n}={s}" for n, s in zip(m["axis_names"], m["shape"]))
    lines = [f"autopar plan for {plan.model} on mesh ({axes}) of {m['device']}",
             f"  estimated step: {_ms(est.step_time_s)} = compute {_ms(est.compute_s)} + communication "
             f"{_ms(est.comm_s)} (of it gradient sync {_ms(est.grad_sync_s)}; forward + backward, no overlap "
             f"assumed)" + "".join(f" + {k} {_ms(v)}" for k, v in est.family_s.items() if v)
             + f" + optimizer step {_ms(est.optimizer_s)} + runtime {_ms(est.runtime_s)}",
             f"  peak memory per device: {_gib(est.peak_memory_bytes)} = parameters/grads/optimizer "
             f"{_gib(est.param_state_bytes)} + activations {_gib(est.activation_bytes)}"
             + "".join(f"; {k} frees {_gib(v)}" for k, v in est.freed_bytes.items() if v)
             + "".join(f"; {_gib(v)} on {k}" for k, v in est.tier_bytes.items() if v),
             "  communication per device per step: " + ", ".join(
                 f"{ax} {_gib(b)}" for ax, b in est.comm_bytes_per_axis.items()),
             f"  solver: {sol.status} ({sol.solver} in {plan.timings.solve_s:.2f} s; {sol.n_variables} variables, "
             f"{sol.n_constraints} constraints; {sol.n_decisions} decisions for {sol.n_nodes} nodes, "
             f"{sol.n_shared} of them sharing a repeated layer's variables); "
             f"planning took {plan.timings.total_s:.2f} s"]
    lines += [f"  capture: {sol.capture}"] if sol.capture else []
    return lines + [""]


def _parameter_lines(plan) -> list[str]:
    lines = ["Parameters (placement per mesh axis " + _lay(plan.mesh["axis_names"]) + "; repeated layers alike "
             "in one row):"]
    lines += [f"  {fqn:<48} {lay}" for fqn, lay in collapse([(f, _lay(v)) for f, v in plan.placements.items()])]
    return lines + [""]


def _layer_lines(plan) -> list[str]:
    lines = ["Layers (ops grouped by the module they come from; layout of the group's output; strategy "
             "per mesh axis of its heaviest op; collectives on the way in, forward + backward; repeated layers "
             "alike in one row, figures per layer):",
             f"  {'module':<26} {'ops':>4} {'compute':>10}  {'output':<16} {'strategy':<22} collectives"]
    rows = []
    for module, group in _groups(plan):
        heavy = max(group, key=lambda n: n.compute_s)
        coll: dict[str, float] = defaultdict(float)
        for n in group:
            for c in n.collectives:
                coll[c.kind] += c.seconds
        colls = ", ".join(f"{k} {_ms(v)}" for k, v in coll.items())
        tag = " [replicated: no rule]" if any(n.fallback for n in group) else ""
        rows.append((module, f"{len(group):>4} {_ms(sum(n.compute_s for n in group)):>10}  "
                             f"{_lay(group[-1].output):<16} {'/'.join(heavy.labels)[:22]:<22} {colls}{tag}"))
    return lines + [f"  {module[:26]:<26} {rest}" for module, rest in collapse(rows)]


def _op_lines(plan) -> list[str]:
    lines = ["", "Ops (layout of output; strategy per axis; collectives on the way in):",
             f"  {'node':<28} {'op':<26} {'output':<16} {'strategy':<24} collectives"]
    for n in plan.nodes:
        if n.executor in ("param", "input"):
            continue
        coll = "; ".join(f"{c.phase[:3]} {c.kind} {_ms(c.seconds)} ({c.tensor})" for c in n.collectives)
        tag = " [replicated: no rule]" if n.fallback else ""
        lines.append(f"  {n.name:<28} {n.op:<26} {_lay(n.output):<16} {'/'.join(n.labels):<24} {coll}{tag}")
    return lines


def _collective_lines(plan) -> list[str]:
    totals: dict[str, float] = defaultdict(float)
    for n in plan.nodes:
        for c in n.collectives:
            totals[f"{c.phase} {c.kind.split('@')[0]} over {c.kind.split('@')[-1]}"] += c.seconds
    if not totals:
        return []
    lines = ["Communication by collective:"]
    lines += [f"  {k:<44} {_ms(v)}" for k, v in sorted(totals.items(), key=lambda kv: -kv[1])]
    return lines + [""]


def _replicated_lines(plan) -> list[str]:
    """Parameters no dim of which divides, and ops no rule knows: both run replicated."""
    lines = []
    if plan.indivisible:
        lines.append(f"Parameters replicated over an axis because no dim of theirs divides by its size "
                     f"({len(plan.indivisible)}; choose sizes divisible by the axis to split them): "
                     + ", ".join(a + b for a, b in collapse([(f[:f.find(" ")], f[f.find(" "):]) if " " in f
                                                            else (f, "") for f in plan.indivisible])))
    if plan.fallbacks:
        lines.append(f"Ops with no sharding rule, run replicated ({len(plan.fallbacks)}): " + ", ".join(plan.fallbacks))
    else:
        lines.append("Ops with no sharding rule: none")
    return lines


MESH_ROWS = 12      # meshes the report lists (the chosen one, the planned ones first)


def _mesh_search_lines(plan) -> list[str]:
    """The meshes a Cluster's search weighed (`plan.mesh_search`): the chosen one and why, the runners-up
    with the evaluator's step and peak memory, and those not planned with the reason."""
    rows = plan.mesh_search
    if not rows:
        return []
    m = plan.mesh
    planned = sum(r.status in ("chosen", "planned") for r in rows)
    lines = [f"Mesh search: {m.get('nodes')} nodes x {m.get('devices_per_node')} devices, {len(rows)} meshes weighed, "
             f"{planned} planned ({m.get('device_order')} over ranks: the last axes inside a node)",
             f"  {'mesh':<30} {'status':<12} {'step':>11} {'peak memory':>12} {'screen':>10}  note"]
    for r in rows[:MESH_ROWS]:
        label = "(" + ", ".join(f"{n}={s}" for n, s in zip(r.axis_names, r.shape)) + ")"
        step = "-" if r.step_time_s is None else _ms(r.step_time_s)
        peak = "-" if r.peak_memory_bytes is None else _gib(r.peak_memory_bytes)
        lines.append(f"  {label:<30} {r.status:<12} {step:>11} {peak:>12} {_ms(r.screen_s):>10}  {r.note}")
    if len(rows) > MESH_ROWS:
        lines.append(f"  ... {len(rows) - MESH_ROWS} more (plan.mesh_search)")
    lines.append("")
    return lines


TIMELINE_COLUMNS = 96      # characters of the widest timeline row


def _pipeline_lines(plan) -> list[str]:
    """The stages (where each starts, its layers, memory and times per rank) and a timeline of one step."""
    pp, est = plan.pipeline, plan.estimate
    if pp.stages <= 1:
        return []
    sched = pp.schedule + (f" x {pp.virtual_stages} virtual stages" if pp.virtual_stages > 1 else "")
    lines = [f"Pipeline: {pp.stages} stages over mesh axis {pp.axis!r}, {pp.microbatches} microbatches, {sched}; "
             f"bubble {_ms(est.bubble_s)}, point-to-point {_ms(est.p2p_s)}",
             f"  {'rank':>4}  {'chunks start at':<36} {'peak memory':>12} {'fwd/microbatch':>15} {'bwd/microbatch':>15}"]
    for r in range(pp.stages):
        starts = ", ".join(pp.boundaries[c] or "(first node)" for c in range(r, pp.chunks, pp.stages))
        lines.append(f"  {r:>4}  {starts[:36]:<36} {_gib(est.stage_memory_bytes.get(str(r), 0.0)):>12} "
                     f"{_ms(est.stage_fwd_s.get(str(r), 0.0)):>15} {_ms(est.stage_bwd_s.get(str(r), 0.0)):>15}")
    f = [est.stage_fwd_s.get(str(r), 0.0) for r in range(pp.stages)]
    b = [est.stage_bwd_s.get(str(r), 0.0) for r in range(pp.stages)]
    if all(x > 0 for x in f + b):
        rows, unit = timeline(f, b, pp.microbatches, pp.schedule)
        note = "" if pp.schedule in ("1f1b", "gpipe") else f" (drawn in 1F1B order; {pp.schedule} priced by its own bubble)"
        lines.append(f"  timeline of one step, one column = {_ms(unit)}: digit n = forward of microbatch n (mod 10), "
                     f"letter = its backward (a = 0, b = 1, ...), '.' = idle{note}")
        lines += [f"  {r:>4}  {row}" for r, row in enumerate(rows)]
    lines.append("")
    return lines


def timeline(fwd: list[float], bwd: list[float], m: int, schedule: str) -> tuple[list[str], float]:
    """One text row per pipeline rank of a step of m microbatches (GPipe: all forwards then all
    backwards; otherwise 1F1B: p - r - 1 warm-up forwards, then one forward one backward), each op
    starting when its rank is free and its input (forward from the rank before, backward from the
    rank after) is done. Returns the rows and the seconds per column."""
    p = len(fwd)
    orders = []
    for r in range(p):
        if schedule == "gpipe":
            orders.append([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            continue
        warm = min(p - r - 1, m)
        order = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            order += [("F", warm + i), ("B", i)]
        order += [("B", i) for i in range(m - warm, m)]
        orders.append(order)
    done: dict[tuple[str, int, int], float] = {}
    spans: list[list[tuple[float, float, str]]] = [[] for _ in range(p)]
    free, pos = [0.0] * p, [0] * p
    while any(pos[r] < len(orders[r]) for r in range(p)):
        for r in range(p):
            if pos[r] >= len(orders[r]):
                continue
            kind, i = orders[r][pos[r]]
            need = ("F", r - 1, i) if kind == "F" and r > 0 else ("B", r + 1, i) if kind == "B" and r < p - 1 else None
            if need is not None and need not in done:
                continue
            start = max(free[r], done.get(need, 0.0))
            end = start + (fwd[r] if kind == "F" else bwd[r])
            done[(kind, r, i)] = free[r] = end
            spans[r].append((start, end, str(i % 10) if kind == "F" else chr(ord("a") + i % 26)))
            pos[r] += 1
    unit = max(free) / TIMELINE_COLUMNS
    rows = []
    for r in range(p):
        row = ["."] * TIMELINE_COLUMNS
        for start, end, ch in spans[r]:
            for k in range(int(start / unit + 0.5), max(int(end / unit + 0.5), int(start / unit + 0.5) + 1)):
                row[min(k, TIMELINE_COLUMNS - 1)] = ch
        rows.append("".join(row))
    return rows, unit


BATCH_STATS_OP = "autopar.batch_stat_mean"   # BatchNorm's statistics (passes/lowering.py)


def batch_norm_decisions(plan) -> dict[str, tuple[str, ...]]:
    """Per BatchNorm layer (module path), per mesh axis, how the planner computes its batch statistics:
    "synchronized" (batch split, local means all-reduced: SyncBatchNorm), "channels split" (each device
    normalizes its channels) or "whole" (the axis holds the whole batch: statistics as on one device)."""
    out: dict[str, tuple[str, ...]] = {}
    for n in plan.nodes:
        if n.op != BATCH_STATS_OP or (n.module or n.name) in out:
            continue
        out[n.module or n.name] = tuple(
            "synchronized" if lab == "sync-stats" else "channels split" if lab == "split" else "whole"
            for lab in n.labels)
    return out


MOE_OP = "autopar.moe_experts"     # a MoE layer's experts (passes/lowering.py, strategies/moe.py)


def expert_placement(plan) -> dict[str, dict[str, object]]:
    """Per MoE layer (the experts' module path): its strategy per mesh axis, the axes that split its
    experts, those it dispatches tokens over by all-to-all, and how its expert weights are stored."""
    out: dict[str, dict[str, object]] = {}
    axes = plan.mesh["axis_names"]
    for n in plan.nodes:
        if n.op != MOE_OP or (n.module or n.name) in out:
            continue
        split = tuple(ax for ax, p in zip(axes, n.inputs[3]) if p == "S(0)")
        out[n.module or n.name] = {
            "strategy": n.labels, "experts_split_over": split,
            "all_to_all_over": tuple(ax for ax, lab in zip(axes, n.labels) if lab == "expert_parallel"),
            "matrices_split_over": tuple(ax for ax, lab in zip(axes, n.labels) if lab == "expert_tp"),
            "stored": plan.placements.get(f"{n.module}.gate_up_proj")}
    return out


def _expert_lines(plan) -> list[str]:
    layers = expert_placement(plan)
    if not layers:
        return []
    axes = plan.mesh["axis_names"]
    lines = [f"Experts ({len(layers)} MoE layers; strategy per mesh axis {_lay(axes)}: expert_parallel = tokens and "
             f"experts split, token-slots dispatched and combined by all-to-all; experts = experts split, every "
             f"token on every device, outputs summed; tokens = tokens split, every expert on every device; "
             f"expert_tp = every expert's matrices split, gate/up by columns and down by rows, outputs summed):"]
    factor = plan.options.get("moe_capacity_factor")
    lines.append("  dropless routing: every token-slot computed" if factor is None else
                 f"  capacity factor {factor:g}: each expert takes at most ceil({factor:g} x tokens x top_k / experts) "
                 f"token-slots of the global batch, the rest dropped (their tokens carried by the residual)")
    for module, e in layers.items():
        stored = _lay(e["stored"]) if e["stored"] else "-"
        lines.append(f"  {module:<40} {_lay(e['strategy']):<28} experts split over "
                     f"{', '.join(e['experts_split_over']) or 'none'}; all-to-all over "
                     f"{', '.join(e['all_to_all_over']) or 'none'}; matrices split over "
                     f"{', '.join(e['matrices_split_over']) or 'none'}; gate_up stored {stored}")
    return lines + [""]


OUTPUT_SHARE = 0.05     # outputs gathered whole for this share of the step or more are pointed out


def _output_lines(plan) -> list[str]:
    """Where returning the outputs whole is a real share of the step (a causal LM's logits beside its
    loss: 0.32 of Llama-3-8B's 0.99 s on (8, 8) at 64 x 4096), what it costs and the option that
    avoids it."""
    if plan.options.get("sharded_outputs", False):
        return []
    secs = sum(c.seconds for n in plan.nodes if n.executor == "output" for c in n.collectives if c.phase == "forward")
    step = plan.estimate.step_time_s
    if step <= 0 or secs < OUTPUT_SHARE * step:
        return []
    return [f"Outputs returned whole: gathered on every device at the end of the forward, {_ms(secs)} of the "
            f"{_ms(step)} step ({secs / step:.0%}). If the caller uses only the loss, sharded_outputs=True leaves "
            f"them in their planned layout.", ""]


def _memory_lines(plan) -> list[str]:
    """The memory decisions that differ from the defaults, grouped by option."""
    lines = []
    for family, chosen, default in (("Recomputation", plan.recompute, "none"),
                                    ("Residency of gathered copies", plan.residency, "keep"),
                                    ("Offload", plan.offload, "device")):
        by: dict[str, list[str]] = defaultdict(list)
        for key, option in chosen.items():
            if option != default:
                by[option].append(key)
        if by:
            lines.append(f"{family} ({len(chosen) - sum(map(len, by.values()))} of {len(chosen)} at {default}):")
            lines += [f"  {option:<10} {', '.join(keys)}" for option, keys in sorted(by.items())]
    return lines + [""] if lines else []


def _batch_norm_lines(plan) -> list[str]:
    decisions = batch_norm_decisions(plan)
    if not decisions:
        return []
    axes = plan.mesh["axis_names"]
    lines = [f"BatchNorm statistics ({len(decisions)} layers; per mesh axis {_lay(axes)}: synchronized = batch "
             f"split and the local means all-reduced, as SyncBatchNorm; whole = statistics of the whole batch, "
             f"as on one device; channels split = each device normalizes its own channels):"]
    for module, how in decisions.items():
        lines.append(f"  {module:<48} {_lay(how)}")
    return lines + [""]


def _scaling_lines(plan) -> list[str]:
    """How step time and memory scale with the batch (this plan's layouts, its symbolic costs)."""
    from ..errors import PlanMismatchError
    from .scaling import scaling_rows
    sc = plan.scaling
    if sc.unavailable:
        return [f"Scaling: not available ({sc.unavailable})", ""]
    seq = f", sequence {sc.seq}" if sc.seq else ""
    lines = [f"Scaling with the global batch (these layouts{seq}; planned at batch {sc.batch}):",
             f"  {'batch':>8} {'step':>12} {'samples/s':>12} {'peak memory':>14}  fits {_gib(sc.memory_budget)}"]
    for b, e in scaling_rows(sc):
        lines.append(f"  {b:>8} {_ms(e.step_time_s):>12} {b / e.step_time_s:>12.1f} {_gib(e.peak_memory_bytes):>14}  "
                     f"{'yes' if e.peak_memory_bytes <= sc.memory_budget else 'no'}")
    try:
        lines.append(f"  largest batch that fits: {plan.largest_batch()}")
    except PlanMismatchError as e:
        lines.append(f"  largest batch that fits: unknown ({e})")
    if sc.seq and "seq" not in sc.fixed:
        cells = []
        for f in (0.5, 2, 4):
            s = max(1, int(sc.seq * f))
            try:
                e = plan.estimate_at(seq=s)
                cells.append(f"seq {s}: {_ms(e.step_time_s)}, {_gib(e.peak_memory_bytes)}")
            except PlanMismatchError:
                continue
        if cells:
            lines.append(f"  at batch {sc.batch}: " + "; ".join(cells))
    if sc.fixed:
        lines.append(f"  fixed by the model: {', '.join(sc.fixed)}")
    return lines + [""]


# Weight matrices' products (`strategies/matmul.py` labels): which label of an axis splits what
WEIGHT_PRODUCTS = ("aten.linear", "aten.addmm", "aten.mm")
COLUMN_LABELS = ("column",)                 # the weight's output features split
ROW_LABELS = ("row", "contract")            # the contraction split: a partial output
NORM_OPS = ("aten.layer_norm", "aten.rms_norm")
NORM_MODULE_SUFFIX = ("norm", "ln_1", "ln_2", "ln_f")   # a norm written out in ops (HF Llama's RMSNorm), by module
SEQUENCE_SPLIT = "S(1)"                     # [batch, sequence, hidden] activations split on the sequence
FAMILY_RANK = ("none", "1D", "2D", "2.5D", "3D")
ULYSSES_NOTE = ": the sequence split outside attention, heads inside"


@dataclass(frozen=True, slots=True)
class TensorParallelism:
    """The tensor-parallel family a plan's layouts form, in the seed's (Colossal-AI's) vocabulary:

    * "1D" (Megatron-LM): weight products split column- or row-wise over one axis;
    * "2D" (Optimus / SUMMA's weight grid): a weight product split column-wise over one axis and
      row-wise over another (the weight split on both dims);
    * "2.5D" (Tesseract): 2D over two axes of equal size q plus a depth axis, not a batch axis, that
      splits the product's rows (batch or sequence) with the weight replicated over it;
    * "3D": 2D plus a third axis splitting the rows with the weight stored split over it too
      (gathered for use);
    * `sequence`: axes of a 1D family over which most layer norms' ops are split on the sequence, as
      the residual stream between them (Megatron-SP, Korthikanti et al. 2022: all-gather before the column product,
      reduce-scatter after the row product);
    * `context`: axis -> context-parallel attention ("ring", "ulysses", "allgather_kv") over it, as at
      least half the attention ops run it; also
      "ulysses" where attention splits heads over an axis that is not a tensor-parallel one while most
      layer norms are split on the sequence over it: the sequence split outside attention, moved to
      heads and back around it by the plan's own all-to-alls (DeepSpeed-Ulysses, as edges).
    `tensor_parallel_family` says how a plan's products are counted."""
    family: str = "none"
    axes: tuple[str, ...] = ()
    depth: tuple[str, ...] = ()
    sequence: tuple[str, ...] = ()
    context: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        names = {"1D": "1D tensor parallelism (Megatron)", "2D": "2D tensor parallelism", "2.5D":
                 "2.5D tensor parallelism (Tesseract)", "3D": "3D tensor parallelism"}
        parts = [] if self.family == "none" else [f"{names[self.family]} over {', '.join(self.axes)}"
                                                  + (f", depth {', '.join(self.depth)}" if self.depth else "")]
        if self.sequence:
            parts.append(f"sequence parallelism (Megatron-SP) over {', '.join(self.sequence)}")
        parts += [f"context parallelism ({how}{ULYSSES_NOTE if how == 'ulysses' else ''}) over {ax}"
                  for ax, how in self.context.items()]
        return "; ".join(parts) or "no tensor, sequence or context parallelism"


def tensor_parallel_family(plan) -> TensorParallelism:
    """The `TensorParallelism` of `plan`, from its nodes' strategy labels and layouts per mesh axis: the
    family most of its tensor-parallel weight products form, over the axes at least half of those
    split (an odd one out, such as a vocabulary-parallel head over another axis, does not name the plan)."""
    axes, sizes = plan.mesh["axis_names"], plan.mesh["shape"]
    batch = set(plan.options.get("batch_axes") or ())
    params = {n.name for n in plan.nodes if n.executor == "param"}
    attention = [n for n in plan.nodes if "scaled_dot_product" in n.op]
    uses = Counter((a, lab) for n in attention for a, lab in enumerate(n.labels) if lab in CONTEXT_LABELS)
    # an axis's context-parallel attention as most attention ops run it (an odd layer does not name the plan)
    context = {axes[a]: lab for (a, lab), k in sorted(uses.items()) if 2 * k >= len(attention)}
    found: list[tuple[str, frozenset, frozenset]] = []       # per product: (family, its axes, its depth axes)
    for n in plan.nodes:
        if n.op not in WEIGHT_PRODUCTS:
            continue
        cols = {a for a, lab in enumerate(n.labels) if lab in COLUMN_LABELS}
        rows = {a for a, lab in enumerate(n.labels) if lab in ROW_LABELS}
        if not cols and not rows:
            continue
        mine, third = "1D", set()
        if cols and rows and cols != rows:
            mine = "2D"
            split = {a for a, lab in enumerate(n.labels)
                     if a not in cols | rows and lab not in ("replicate", "-") and axes[a] not in batch
                     and axes[a] not in context}
            gathered = {a for c in n.collectives if c.phase == "forward" and c.tensor in params
                        for a, ax in enumerate(axes) if c.kind.endswith(f"@{ax}")}
            if split & gathered:
                mine, third = "3D", split & gathered
            elif split and len({sizes[a] for a in cols | rows}) == 1:
                mine, third = "2.5D", split
        found.append((mine, frozenset(cols | rows), frozenset(third)))
    norms = [n for n in plan.nodes if n.op in NORM_OPS or n.module.rsplit(".", 1)[-1].endswith(NORM_MODULE_SUFFIX)]
    on_sequence = {a for a in range(len(axes)) if 2 * sum(n.output[a] == SEQUENCE_SPLIT for n in norms) > len(norms) > 0}
    if not found:
        return TensorParallelism(context={**context, **_ulysses_by_edges(plan, on_sequence, set(), context)})
    counts = {f: sum(1 for g, _, _ in found if g == f) for f in FAMILY_RANK}
    family = max(FAMILY_RANK, key=lambda f: (counts[f], FAMILY_RANK.index(f)))
    mine = [(a, d) for f, a, d in found if f == family]
    tp_axes = [x for x in range(len(axes)) if 2 * sum(x in a for a, _ in mine) >= len(mine)]
    depth = [x for x in range(len(axes)) if 2 * sum(x in d for _, d in mine) >= len(mine)]
    sequence = () if family != "1D" else tuple(axes[a] for a in tp_axes if axes[a] not in context and a in on_sequence)
    context = {**context, **_ulysses_by_edges(plan, on_sequence, set(tp_axes), context)}
    return TensorParallelism(family, tuple(axes[a] for a in tp_axes), tuple(axes[a] for a in depth), sequence,
                             context)


def _ulysses_by_edges(plan, on_sequence: set[int], tensor: set[int], context: dict[str, str]) -> dict[str, str]:
    """Axis name -> "ulysses" for the axes outside `tensor` (the tensor-parallel axes) and `context` over which
    most norms split the sequence (`on_sequence`) and attention splits heads: context parallelism whose
    all-to-alls are the plan's edges into and out of attention (`TensorParallelism.context`)."""
    axes = plan.mesh["axis_names"]
    heads = {a for n in plan.nodes if "scaled_dot_product" in n.op for a, lab in enumerate(n.labels) if lab == "heads"}
    return {axes[a]: "ulysses" for a in sorted((on_sequence & heads) - tensor) if axes[a] not in context}
