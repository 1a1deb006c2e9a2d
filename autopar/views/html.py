"""`plan.to_html()`: the plan as one self-contained HTML page (inline CSS and SVG, no script, no network).

Sections, each read from the plan alone (a saved plan renders the same page):

* summary: step time, peak memory, solver status and gap; ops with no sharding rule in red;
* memory per device stacked by kind (parameters, gradients, optimizer state, activations) at the
  planned batch and at other batch sizes (`Plan.estimate_at`), with the budget as a dashed line.
  Parameters, gradients and optimizer state split the plan's `param_state_bytes` by the optimizer's
  copies (`cost_model.memory.OPTIMIZER_STATE_COPIES`); activations are everything else live at the
  peak (resharded copies and collective buffers included: the plan does not keep them apart);
* communication per mesh axis, stacked by collective kind (seconds per step, bytes in the label);
* step time against the batch size (compute, communication) from the plan's symbolic costs;
* parameter layouts as a grid (one cell per mesh axis); repeated layers with equal layouts share
  a row (`model.layers.[1-30].mlp.up_proj.weight`); parameters replicated on every axis in red;
* one row per layer (`passes.layers.layer_key`): ops, compute, communication, layouts, and the
  memory decisions (recompute, residency, offload) when the plan carries any;
* every op (collapsed): layouts, strategy, collectives; fallbacks red, wholly replicated ops amber.
"""
from __future__ import annotations

import re
from collections import defaultdict
from html import escape

from ..cost_model.memory import OPTIMIZER_STATE_COPIES
from ..errors import PlanMismatchError
from ..passes.layers import layer_key, layer_of
from ..plan_records import NodePlan
from .report import index_ranges
from .svg import layout_grid, line_chart, stacked_bars

MEMORY_KINDS = ("parameters", "gradients", "optimizer state", "activations")

CSS = """body{font-family:sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ccc}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:3px 6px;text-align:left}
th{background:#f4f4f4}td.num{text-align:right}tr.fallback td{background:#fbd0d0}
tr.replicated td{background:#fff2cc}.alert{background:#fbd0d0;padding:8px;border-left:4px solid #d62728}
.note{color:#555;font-size:13px}dl{display:grid;grid-template-columns:max-content auto;gap:2px 16px}
dt{font-weight:bold}svg{max-width:100%;height:auto;display:block;margin:8px 0}code{font-size:12px}"""


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**27 else f"{b / 2**20:.1f} MiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def _lay(layout) -> str:
    return "(" + ", ".join(layout) + ")" if layout else "-"


def render_html(plan) -> str:
    m = plan.mesh
    axes = ", ".join(f"{n}={s}" for n, s in zip(m["axis_names"], m["shape"]))
    title = f"autopar plan: {plan.model} on ({axes}) x {m['device']}"
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
             f"<style>{CSS}</style></head><body><h1>{escape(title)}</h1>",
             _summary(plan), _memory(plan), _communication(plan), _scaling(plan), _parameters(plan), _layers(plan),
             _ops(plan), "</body></html>"]
    return "\n".join(parts)


def _summary(plan) -> str:
    est, sol = plan.estimate, plan.solver
    gap = f", gap {sol.gap:.2%}" if sol.gap else ""
    rows = [("step time", f"{_ms(est.step_time_s)} = compute {_ms(est.compute_s)} + communication "
                          f"{_ms(est.comm_s)} (no overlap assumed)"),
            ("peak memory per device", _gib(est.peak_memory_bytes)),
            ("solver", f"{sol.solver} {sol.status}{gap}; {sol.n_decisions} decisions for {sol.n_nodes} nodes"),
            ("graph", f"fingerprint {plan.fingerprint}; plan format {plan.version}")]
    out = ["<dl>"] + [f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in rows] + ["</dl>"]
    if plan.fallbacks:
        out.append(f'<p class="alert">{len(plan.fallbacks)} ops have no sharding rule and run replicated on every '
                   f"device: {escape(', '.join(plan.fallbacks))}</p>")
    return "\n".join(out)


def _budget(plan) -> float | None:
    return plan.scaling.memory_budget or plan.options.get("memory_budget") or None


def _memory_segments(plan, est) -> list[tuple[str, float]]:
    copies = OPTIMIZER_STATE_COPIES.get(plan.options.get("optimizer", "adamw"), 4)
    one = est.param_state_bytes / copies
    return list(zip(MEMORY_KINDS, (one, one, est.param_state_bytes - 2 * one, est.activation_bytes)))


def _scaling_rows(plan):
    """(batch, Estimate) over batch sizes around the planned one; [] when the plan has no symbolic costs."""
    from .scaling import scaling_rows
    if plan.scaling.unavailable:
        return []
    try:
        return scaling_rows(plan.scaling)
    except PlanMismatchError:
        return []


def _memory(plan) -> str:
    planned = plan.scaling.batch
    rows = [(f"batch {b}", _memory_segments(plan, e)) for b, e in _scaling_rows(plan) if b != planned]
    rows.append((f"batch {planned} (planned)" if planned else "as planned", _memory_segments(plan, plan.estimate)))
    rows.sort(key=lambda r: int(r[0].split()[1]) if r[0].startswith("batch") else 0)
    chart = stacked_bars(rows, MEMORY_KINDS, title="memory per device at the peak of a training step, by kind",
                         fmt=_gib, budget=_budget(plan), budget_label="budget")
    return ("<h2>Memory per device</h2>" + chart +
            '<p class="note">At the peak of one training step (the end of the forward, or a later liveness point). '
            "Activations include resharded copies and collective buffers live at the peak. Other batch sizes: "
            "these layouts re-priced from the plan's symbolic costs.</p>")


def _communication(plan) -> str:
    per_axis: dict[str, dict[str, float]] = {ax: defaultdict(float) for ax in plan.mesh["axis_names"]}
    for n in plan.nodes:
        for c in n.collectives:
            kind, _, ax = c.kind.partition("@")
            per_axis.setdefault(ax or "?", defaultdict(float))[kind] += c.seconds
    kinds = sorted({k for d in per_axis.values() for k in d})
    if not kinds:
        return "<h2>Communication</h2><p>No collectives: every tensor is already where it is needed.</p>"
    nbytes = plan.estimate.comm_bytes_per_axis
    rows = [(f"{ax} ({_gib(nbytes.get(ax, 0.0))}/step)", sorted(d.items())) for ax, d in per_axis.items()]
    chart = stacked_bars(rows, kinds, title="communication seconds per step by mesh axis and collective", fmt=_ms)
    return ("<h2>Communication per mesh axis</h2>" + chart +
            '<p class="note">Forward and backward, per device per step; bytes sent per device in the labels.</p>')


def _scaling(plan) -> str:
    sc = plan.scaling
    if sc.unavailable:
        return f"<h2>Scaling with the batch</h2><p class=\"note\">Not available: {escape(sc.unavailable)}</p>"
    rows = _scaling_rows(plan)
    if not rows:
        return "<h2>Scaling with the batch</h2><p class=\"note\">No batch size splits evenly under this plan.</p>"
    xs = [b for b, _ in rows]
    time_chart = line_chart(xs, [("step", [e.step_time_s for _, e in rows]),
                                 ("compute", [e.compute_s for _, e in rows]),
                                 ("communication", [e.comm_s for _, e in rows])],
                            title="step time against the global batch", x_label="global batch", fmt=_ms)
    mem_chart = line_chart(xs, [("peak memory", [e.peak_memory_bytes for _, e in rows])],
                           title="peak memory per device against the global batch", x_label="global batch",
                           fmt=_gib, limit=_budget(plan), limit_label="budget")
    try:
        largest = f"The largest global batch that fits: {plan.largest_batch()}."
    except PlanMismatchError as e:
        largest = f"Largest batch unknown: {e}"
    seq = f" at sequence length {sc.seq}" if sc.seq else ""
    return (f"<h2>Scaling with the batch</h2><p class=\"note\">These layouts{seq}, planned at batch {sc.batch}. "
            f"{escape(largest)}</p>" + time_chart + mem_chart)


_INDEX = re.compile(r"^(.*?)\.(\d+)\.(.*)$")


def collapse_layers(placements: dict[str, tuple[str, ...]]) -> list[tuple[str, tuple[str, ...]]]:
    """(name, layout) rows where parameters of repeated layers with equal layouts share one row:
    'model.layers.[0-31].mlp.up_proj.weight'."""
    groups: dict[tuple, list[int]] = {}
    for fqn, lay in placements.items():
        where = layer_of(fqn)
        key = (where[0], where[2], tuple(lay)) if where and where[2] else (fqn, None, tuple(lay))
        groups.setdefault(key, []).append(where[1] if where and where[2] else -1)
    rows = []
    for (head, rest, lay), idx in groups.items():
        rows.append((f"{head}.[{index_ranges(idx)}].{rest}" if rest is not None and len(idx) > 1 else
                     f"{head}.{idx[0]}.{rest}" if rest is not None else head, lay))
    return rows


def _in_graph_order(plan) -> dict[str, tuple[str, ...]]:
    """plan.placements in the order the model uses its parameters (a loaded plan's dict is sorted)."""
    order = [n.op.removeprefix("param ") for n in plan.nodes if n.executor == "param"]
    names = [f for f in order if f in plan.placements] + sorted(set(plan.placements) - set(order))
    return {f: plan.placements[f] for f in names}


def _parameters(plan) -> str:
    rows = collapse_layers(_in_graph_order(plan))
    if not rows:
        return ""
    whole = [all(p == "R" for p in lay) and any(s > 1 for s in plan.mesh["shape"]) for _, lay in rows]
    grid = layout_grid([n for n, _ in rows], plan.mesh["axis_names"], [lay for _, lay in rows],
                       title="parameter layouts per mesh axis", flagged=whole)
    note = (f" {sum(whole)} rows in red are replicated on every axis (each device holds them whole: too small to "
            f"pay for a split, or no dim divides evenly)." if any(whole) else "")
    return (f"<h2>Parameter layouts</h2><p class=\"note\">{len(plan.placements)} parameters; repeated layers with "
            f"equal layouts share a row.{note}</p>" + grid)


def _layer_groups(plan) -> dict[str, list[NodePlan]]:
    groups: dict[str, list[NodePlan]] = {}
    for n in plan.nodes:
        if n.executor in ("param", "input"):
            continue
        key = "(graph outputs)" if n.executor == "output" else layer_key(n.module) or n.module or "(top level)"
        groups.setdefault(key, []).append(n)
    return groups


def _decisions(plan, layer: str) -> list[str]:
    params = [f for f in plan.placements if layer_key(f) == layer or f.startswith(layer + ".")]
    regather = sum(plan.residency.get(f) == "regather" for f in params)
    act = plan.offload.get(f"activations:{layer}", "device")
    opt = {plan.offload.get(f"optimizer:{layer}", "device")} | {plan.offload[f"optimizer:{f}"] for f in params
                                                               if f"optimizer:{f}" in plan.offload}
    return [plan.recompute.get(layer, "none"), f"{regather} of {len(params)} regathered" if params else "-",
            f"activations {act}; optimizer {'/'.join(sorted(opt))}"]


def _layers(plan) -> str:
    memory = any(v not in ("none", "keep", "device")
                 for d in (plan.recompute, plan.residency, plan.offload) for v in d.values())
    head = ["layer", "ops", "compute", "communication", "output layout", "strategy of its heaviest op"]
    head += ["recompute", "residency", "offload"] if memory else []
    out = ["<h2>Layers</h2><table><tr>" + "".join(f"<th>{h}</th>" for h in head + ["fallbacks"]) + "</tr>"]
    for layer, group in _layer_groups(plan).items():
        heavy = max(group, key=lambda n: n.compute_s)
        bad = [n.name for n in group if n.fallback]
        cells = [escape(layer), str(len(group)), _ms(sum(n.compute_s for n in group)),
                 _ms(sum(c.seconds for n in group for c in n.collectives)), escape(_lay(group[-1].output)),
                 escape("/".join(heavy.labels))]
        cells += [escape(c) for c in _decisions(plan, layer)] if memory else []
        cls = ' class="fallback"' if bad else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{c}</td>" for c in cells) + f"<td>{escape(', '.join(bad))}</td></tr>")
    note = ("" if memory else '<p class="note">No memory decisions in this plan: every layer keeps its activations '
            "(no recompute), parameters keep their gathered copies, nothing is offloaded.</p>")
    return "\n".join(out) + "</table>" + note


def _ops(plan) -> str:
    out = ["<h2>Ops</h2><details><summary>every op: layouts, strategy, collectives (red: no sharding rule; "
           "amber: whole on every device)</summary><table><tr><th>node</th><th>op</th><th>module</th><th>inputs</th>"
           "<th>output</th><th>strategy</th><th>compute</th><th>collectives on the way in</th></tr>"]
    for n in plan.nodes:
        if n.executor in ("param", "input"):
            continue
        whole = bool(n.output) and all(p == "R" for p in n.output) and all(lab == "replicate" for lab in n.labels)
        cls = ' class="fallback"' if n.fallback else ' class="replicated"' if whole else ""
        coll = "; ".join(f"{c.phase} {c.kind} {_ms(c.seconds)} ({c.tensor})" for c in n.collectives)
        cells = [n.name, n.op, n.module, " ".join(_lay(i) for i in n.inputs), _lay(n.output),
                 "/".join(n.labels), _ms(n.compute_s), coll]
        out.append(f"<tr{cls}>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>")
    return "\n".join(out) + "</table></details>"
