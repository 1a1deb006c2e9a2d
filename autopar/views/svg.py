"""Small static charts as inline SVG text (for the HTML report): no plotting library, no script.

    stacked_bars([("dp", [("all_reduce", 1.2e-3)])], kinds, fmt=ms, budget=None)   # horizontal
    line_chart([1, 2, 4], [("step", [0.1, 0.2, 0.4])], x_label="batch", fmt=ms)
    layout_grid(["wte.weight"], ["dp", "tp"], [("S(0)", "R")])

Every chart is one `<svg>` element with a `<title>` (read aloud, shown on hover) and text labels,
sized in user units so that it scales with the page. Colours come from one fixed palette in
order of first use, so a kind keeps its colour across the report's charts.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from html import escape

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac")
LABEL_W = 230           # user units left of a bar for its label
BAR_H, GAP = 22, 8      # bar height and gap between bars
WIDTH = 900
OFF_SCALE = 3.0         # a budget line this many times beyond the data is named, not drawn (it would flatten it)
FONT = 'font-family="sans-serif" font-size="12"'


def color_for(kind: str, kinds: Sequence[str]) -> str:
    return PALETTE[list(kinds).index(kind) % len(PALETTE)] if kind in kinds else "#999999"


def _svg(width: float, height: float, title: str, body: list[str], cls: str) -> str:
    return (f'<svg class="{cls}" viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" height="{height:.0f}" '
            f'role="img" {FONT}><title>{escape(title)}</title>' + "".join(body) + "</svg>")


def _text(x: float, y: float, s: str, anchor: str = "start", extra: str = "") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" {extra}>{escape(s)}</text>'


def _legend(kinds: Sequence[str], y: float) -> list[str]:
    out, x = [], LABEL_W
    for k in kinds:
        out.append(f'<rect x="{x:.1f}" y="{y - 10:.1f}" width="12" height="12" fill="{color_for(k, kinds)}"/>')
        out.append(_text(x + 16, y, k))
        x += 24 + 7 * len(k)
    return out


def stacked_bars(rows: Sequence[tuple[str, Sequence[tuple[str, float]]]], kinds: Sequence[str], *, title: str,
                 fmt: Callable[[float], str], budget: float | None = None, budget_label: str = "budget") -> str:
    """One horizontal bar per row, segments stacked in `kinds` order; a dashed line at `budget`."""
    totals = [sum(v for _, v in segs) for _, segs in rows]
    far = bool(budget) and budget > OFF_SCALE * max(totals + [0.0])
    top = max(totals + [0.0 if far else budget or 0.0]) or 1.0
    scale = (WIDTH - LABEL_W - 120) / top
    body = _legend(kinds, 14)
    y = 28
    for (label, segs), total in zip(rows, totals):
        body.append(_text(LABEL_W - 6, y + BAR_H * 0.7, label[:34], "end"))
        x = float(LABEL_W)
        for kind, v in sorted(segs, key=lambda kv: list(kinds).index(kv[0]) if kv[0] in kinds else len(kinds)):
            if v <= 0:
                continue
            w = v * scale
            body.append(f'<rect x="{x:.1f}" y="{y}" width="{max(w, 0.5):.1f}" height="{BAR_H}" '
                        f'fill="{color_for(kind, kinds)}"><title>{escape(f"{label}: {kind} {fmt(v)}")}</title></rect>')
            x += w
        body.append(_text(x + 6, y + BAR_H * 0.7, fmt(total)))
        y += BAR_H + GAP
    if far:
        body.append(_text(WIDTH - 4, y + 12, f"{budget_label} {fmt(budget)}: off this scale", "end",
                          'fill="#d62728"'))
        y += 14
    elif budget:
        bx = LABEL_W + budget * scale
        body.append(f'<line x1="{bx:.1f}" y1="22" x2="{bx:.1f}" y2="{y:.0f}" stroke="#d62728" stroke-width="2" '
                    f'stroke-dasharray="6 4"/>')
        body.append(_text(bx, y + 12, f"{budget_label} {fmt(budget)}", "middle", 'fill="#d62728"'))
        y += 14
    return _svg(WIDTH, y + 6, title, body, "chart bars")


def line_chart(xs: Sequence[float], series: Sequence[tuple[str, Sequence[float]]], *, title: str, x_label: str,
               fmt: Callable[[float], str], limit: float | None = None, limit_label: str = "") -> str:
    """Lines over the points xs (drawn evenly spaced, labelled with their values); a dashed `limit`."""
    kinds = [name for name, _ in series]
    h, left, right, top_pad, bottom = 260, 90, 30, 30, 40
    data_top = max([v for _, ys in series for v in ys] + [0.0])
    far = bool(limit) and limit > OFF_SCALE * data_top
    top = max(data_top, 0.0 if far else limit or 0.0) * 1.08 or 1.0
    step = (WIDTH - left - right) / max(len(xs) - 1, 1)

    def px(i: int) -> float:
        return left + i * step

    def py(v: float) -> float:
        return h - bottom - (h - bottom - top_pad) * v / top

    body = _legend(kinds, 14)
    body.append(f'<line x1="{left}" y1="{h - bottom}" x2="{WIDTH - right}" y2="{h - bottom}" stroke="#333"/>')
    body.append(f'<line x1="{left}" y1="{top_pad}" x2="{left}" y2="{h - bottom}" stroke="#333"/>')
    for frac in (0.0, 0.5, 1.0):
        body.append(_text(left - 6, py(top * frac / 1.08) + 4, fmt(top * frac / 1.08), "end"))
    for i, x in enumerate(xs):
        body.append(_text(px(i), h - bottom + 16, f"{x:g}", "middle"))
    body.append(_text((left + WIDTH - right) / 2, h - 6, x_label, "middle"))
    for name, ys in series:
        c = color_for(name, kinds)
        pts = " ".join(f"{px(i):.1f},{py(v):.1f}" for i, v in enumerate(ys))
        body.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="2"/>')
        for i, v in enumerate(ys):
            body.append(f'<circle cx="{px(i):.1f}" cy="{py(v):.1f}" r="3.5" fill="{c}">'
                        f'<title>{escape(f"{name} at {x_label} {xs[i]:g}: {fmt(v)}")}</title></circle>')
    if far:
        body.append(_text(WIDTH - right, top_pad - 4, f"{limit_label} {fmt(limit)}: off this scale", "end",
                          'fill="#d62728"'))
    elif limit:
        body.append(f'<line x1="{left}" y1="{py(limit):.1f}" x2="{WIDTH - right}" y2="{py(limit):.1f}" '
                    f'stroke="#d62728" stroke-width="2" stroke-dasharray="6 4"/>')
        body.append(_text(WIDTH - right, py(limit) - 4, f"{limit_label} {fmt(limit)}", "end", 'fill="#d62728"'))
    return _svg(WIDTH, h, title, body, "chart lines")


def placement_kind(p: str) -> str:
    """'S(1)' -> 'split dim 1', 'R' -> 'replicated', 'P' / 'P(sum)' -> 'partial sum'."""
    if p.startswith("S("):
        return f"split dim {p[2:-1]}"
    return "replicated" if p == "R" else "partial sum" if p.startswith("P") else p


def layout_grid(names: Sequence[str], axes: Sequence[str], layouts: Sequence[Sequence[str]], *, title: str,
                flagged: Sequence[bool] = ()) -> str:
    """One row per name, one cell per mesh axis coloured by its placement; flagged rows in red."""
    kinds = sorted({placement_kind(p) for lay in layouts for p in lay}, key=lambda k: (k != "replicated", k))
    cell_w, row_h, left = 90, 18, 420
    body = [_text(left + i * cell_w + cell_w / 2, 14, ax, "middle", 'font-weight="bold"') for i, ax in enumerate(axes)]
    legend_x = left + len(axes) * cell_w + 20
    for j, k in enumerate(kinds):
        body.append(f'<rect x="{legend_x}" y="{24 + j * 18}" width="12" height="12" fill="{color_for(k, kinds)}"/>')
        body.append(_text(legend_x + 16, 34 + j * 18, k))
    y = 22
    for i, (name, lay) in enumerate(zip(names, layouts)):
        bad = i < len(flagged) and flagged[i]
        body.append(_text(left - 6, y + 13, name[-60:], "end", 'fill="#d62728" font-weight="bold"' if bad else ""))
        for a, p in enumerate(lay):
            body.append(f'<rect x="{left + a * cell_w + 1}" y="{y}" width="{cell_w - 2}" height="{row_h - 2}" '
                        f'fill="{color_for(placement_kind(p), kinds)}"><title>{escape(f"{name} on {axes[a]}: {p}")}'
                        f'</title></rect>')
            body.append(_text(left + a * cell_w + cell_w / 2, y + 13, p, "middle", 'fill="#fff"'))
        y += row_h
    return _svg(max(legend_x + 160, 600), max(y + 6, 40 + 18 * len(kinds)), title, body, "chart grid")
