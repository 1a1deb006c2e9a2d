"""`plan.to_html()`: one self-contained page of charts and tables; rendered by Chromium without errors;
and `autopar.explain`: the chosen layout against the alternatives, priced by the solver's tables."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import autopar  # noqa: E402
from autopar.views.html import collapse_layers  # noqa: E402
from models import GPT  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")
SVG = re.compile(r"<svg\b.*?</svg>", re.S)


@pytest.fixture(scope="module")
def gpt_plan():
    torch.manual_seed(0)
    model = GPT(vocab=512, seq=64, hidden=256, heads=8, layers=2)
    inputs = (torch.randint(0, 512, (16, 64)), torch.randint(0, 512, (16, 64)))
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), "h100")
    return model, inputs, mesh, autopar.plan(model, inputs, mesh, progress=False)


def _svgs(html: str) -> dict[str, ET.Element]:
    """Each chart by its title, parsed as XML (so each is well-formed)."""
    out = {}
    for text in SVG.findall(html):
        el = ET.fromstring(text)
        out[el.find("title").text] = el
    return out


def _texts(el: ET.Element) -> list[str]:
    return [t.text for t in el.iter("text")]


def test_page_is_self_contained_and_charts_name_what_they_show(gpt_plan):
    _, _, _, plan = gpt_plan
    html = plan.to_html()
    assert "<script" not in html and "http" not in html and " src=" not in html and "href" not in html
    charts = _svgs(html)
    assert set(charts) == {"memory per device at the peak of a training step, by kind",
                           "communication seconds per step by mesh axis and collective",
                           "step time against the global batch", "peak memory per device against the global batch",
                           "parameter layouts per mesh axis"}
    memory = _texts(charts["memory per device at the peak of a training step, by kind"])
    assert {"parameters", "gradients", "optimizer state", "activations"} <= set(memory)
    assert f"batch {plan.scaling.batch} (planned)" in memory
    assert f"budget {plan.scaling.memory_budget / 2**30:.2f} GiB: off this scale" in memory
    grid = _texts(charts["parameter layouts per mesh axis"])
    assert [n for n, _ in collapse_layers(plan.placements)] == [t for t in grid if "weight" in t or "bias" in t]
    assert {ax for ax in plan.estimate.comm_bytes_per_axis} == {
        t.split(" ")[0] for t in _texts(charts["communication seconds per step by mesh axis and collective"])
        if "/step)" in t}
    assert autopar.Plan.from_json(plan.to_json()).to_html() == html          # from the plan alone, deterministic


def test_collapse_layers_keeps_every_parameter():
    placements = {"wte.weight": ("R", "S(0)"), **{f"h.{i}.w": ("S(0)", "R") for i in range(4)},
                  "h.4.w": ("R", "R"), **{f"h.{i}.b": ("R", "R") for i in (0, 2, 3)}}
    assert collapse_layers(placements) == [("wte.weight", ("R", "S(0)")), ("h.[0-3].w", ("S(0)", "R")),
                                           ("h.4.w", ("R", "R")), ("h.[0,2-3].b", ("R", "R"))]


def test_memory_decisions_and_fallbacks_are_shown(gpt_plan):
    _, _, _, plan = gpt_plan
    html = plan.to_html()
    assert "<th>recompute</th>" not in html and 'class="alert"' not in html
    first = next(n for n in plan.nodes if n.executor == "local")
    nodes = [dataclasses.replace(n, fallback=True) if n is first else n for n in plan.nodes]
    marked = dataclasses.replace(plan, nodes=nodes, fallbacks=[f"{first.name} ({first.op})"],
                                 recompute={"blocks.0": "full"}, residency={"blocks.0.fc.weight": "regather"},
                                 offload={"activations:blocks.0": "host", "optimizer:blocks.0.fc.weight": "disk"})
    html = marked.to_html()
    row = re.search(r"<tr[^>]*><td>blocks\.0</td>.*?</tr>", html).group(0)
    cells = re.findall(r"<td>(.*?)</td>", row)
    assert cells[6:9] == ["full", "1 of 12 regathered", "activations host; optimizer device/disk"]
    assert '<p class="alert">1 ops have no sharding rule' in html and first.name in html
    assert re.search(rf'<tr class="fallback"><td>{first.name}</td>', html)


def _chromium(page: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                           "--v=0", *extra, page.as_uri()], capture_output=True, text=True, timeout=120)


def _script_errors(r: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in r.stderr.splitlines() if ":CONSOLE" in ln or "Uncaught" in ln]


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Chromium is not installed at /usr/bin/chromium (Debian: "
                                                   "apt-get install chromium); the HTML report is not rendered")
def test_chromium_renders_the_report_without_errors(gpt_plan, tmp_path):
    _, _, _, plan = gpt_plan
    page = tmp_path / "report.html"
    page.write_text(plan.to_html())
    r = _chromium(page, "--dump-dom")
    assert r.returncode == 0 and _script_errors(r) == []
    dom = r.stdout        # the page as Chromium parsed it: five charts, the parameters named in one
    assert dom.count("<svg") == 5 and dom.count("</svg>") == 5
    assert all(f">{name}</text>" in dom for name, _ in collapse_layers(plan.placements))
    broken = tmp_path / "broken.html"      # the check can fail: a page with a script error is caught
    broken.write_text("<!DOCTYPE html><html><body><script>no_such_function();</script></body></html>")
    assert any("no_such_function is not defined" in ln for ln in _script_errors(_chromium(broken, "--dump-dom")))


def test_explain_prices_the_chosen_layout_as_the_plan_does(gpt_plan):
    model, inputs, mesh, plan = gpt_plan
    scaling = plan.scaling
    plan.pending_scaling = lambda: pytest.fail("explain() priced the plan at symbolic sizes (a trace it does not need)")
    try:
        e = autopar.explain(model, inputs, mesh, plan, "blocks.0.fc.weight")
    finally:
        plan.scaling = scaling
    assert e.node == "p_blocks_0_fc_weight" and e.chosen.output == plan.placements["blocks.0.fc.weight"]
    assert e.chosen.step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-9)
    assert e.chosen.peak_memory_bytes == pytest.approx(plan.estimate.peak_memory_bytes, rel=1e-9)
    assert e.n_options == 9 and len(e.alternatives) == 5
    # the solver proved this plan optimal and no layer is tied in a 2-layer GPT: no single change is faster
    assert all(a.step_time_s >= e.chosen.step_time_s - 1e-12 for a in e.alternatives if a.fits)
    assert [a.step_time_s for a in e.alternatives] == sorted(a.step_time_s for a in e.alternatives)
    text = str(e)
    assert text.startswith(f"blocks.0.fc.weight (node p_blocks_0_fc_weight): chosen "
                           f"({', '.join(e.chosen.output)})")
    assert f"{(e.alternatives[0].step_time_s - e.chosen.step_time_s) * 1e3:+.3f} ms" in text
    op = next(n for n in plan.nodes if n.op == "aten.linear")
    e_op = autopar.explain(model, inputs, mesh, plan, op.name)
    assert e_op.chosen.output == op.output and e_op.chosen.labels == op.labels
    with pytest.raises(autopar.AutoparError, match="'blocks.0.nope' is neither a node nor a parameter"):
        autopar.explain(model, inputs, mesh, plan, "blocks.0.nope")
