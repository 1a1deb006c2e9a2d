"""The `autopar` command: plan from the shell, read, compare and re-price plans; errors as a shell user expects."""
from __future__ import annotations

import io
import os
import shutil
import subprocess
from html import escape
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import autopar  # noqa: E402
from autopar import progress  # noqa: E402
from autopar.cli import main  # noqa: E402
from autopar.views.html import collapse_layers  # noqa: E402


TIME_LIMIT = 240     # under run_autopar's timeout


def run_autopar(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`autopar ARGS` as a shell user runs it (stderr a pipe, not a terminal)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "examples")]), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "autopar", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory holding my_models.py, and p.json / r.html planned from it by the command line."""
    d = tmp_path_factory.mktemp("cli")
    shutil.copy(ROOT / "examples" / "my_models.py", d)
    # a time limit no loaded machine reaches: the plan the API makes is the same only if neither is cut short
    r = run_autopar("plan", "my_models:small", "--mesh", "2x2", "--axes", "dp,tp", "--device", "h100",
                    "--html", "r.html", "--json", "p.json", "--time-limit", str(TIME_LIMIT), cwd=d)
    assert r.returncode == 0, r.stderr
    return d, r


def test_plan_command_writes_the_plan_the_api_makes(workdir):
    d, r = workdir
    assert "autopar plan for GPT on mesh (dp=2, tp=2) of h100" in r.stdout
    assert "autopar: capture" not in r.stderr        # no progress when stderr is not a terminal
    saved = autopar.Plan.load(d / "p.json")
    sys.path.insert(0, str(d))
    try:
        import my_models
        model, inputs = my_models.small()
    finally:
        sys.path.remove(str(d))
    direct = autopar.plan(model, inputs, autopar.Mesh((2, 2), ("dp", "tp"), "h100"), progress=False,
                          time_limit=TIME_LIMIT)
    assert saved.to_json() == direct.to_json()
    assert set(saved.placements) == {n for n, _ in model.named_parameters()}
    html = (d / "r.html").read_text()
    assert html.count("<svg") >= 4
    assert all(f">{escape(name)}</text>" in html for name, _ in collapse_layers(saved.placements))


def test_report_diff_and_estimate_read_saved_plans(workdir):
    d, _ = workdir
    plan = autopar.Plan.load(d / "p.json")
    other = autopar.Plan.from_dict({**plan.to_dict(), "placements": {**plan.to_dict()["placements"],
                                                                    "wte.weight": ["S(0)", "S(1)"]}})
    other.save(d / "q.json")
    out = io.StringIO()
    sys.stdout, saved = out, sys.stdout
    try:       # in this process: the shell's own entry point runs in the fixture and test_bad_input_from_the_shell
        assert main(["report", str(d / "p.json")]) == 0
        shown = out.getvalue()
        same, differ = main(["diff", str(d / "p.json"), str(d / "p.json")]), main(["diff", str(d / "p.json"),
                                                                                   str(d / "q.json")])
        assert main(["report", str(d / "p.json"), "--html", str(d / "again.html")]) == 0
        assert main(["estimate", "--plan", str(d / "p.json"), "--batch", "32"]) == 0
    finally:
        sys.stdout = saved
    assert shown.strip() == plan.report().strip()
    assert (same, differ) == (0, 1)
    text = out.getvalue()
    assert "the plans are the same" in text
    assert f"param wte.weight: ({', '.join(plan.placements['wte.weight'])}) -> (S(0), S(1))" in text
    assert (d / "again.html").read_text() == (d / "r.html").read_text()     # the page comes from the plan alone
    e = plan.estimate_at(batch=32)
    assert f"at batch 32: step {e.step_time_s * 1e3:.3f} ms" in text
    assert f"largest batch that fits: {plan.largest_batch()}" in text


def test_explain_command(workdir, capsys, monkeypatch):
    d, _ = workdir
    monkeypatch.chdir(d)
    monkeypatch.syspath_prepend(str(d))
    assert main(["explain", "my_models:small", "--plan", "p.json", "--name", "blocks.0.fc.weight"]) == 0
    out = capsys.readouterr().out
    chosen = autopar.Plan.load(d / "p.json").placements["blocks.0.fc.weight"]
    assert f"blocks.0.fc.weight (node p_blocks_0_fc_weight): chosen ({', '.join(chosen)})" in out
    assert "next best, the rest of the plan fixed:" in out


@pytest.mark.parametrize("argv, message", [
    (["plan", "my_models:nope", "--mesh", "2x2"], "module 'my_models' "),
    (["plan", "no_such_module:small", "--mesh", "2x2"], "no module 'no_such_module'"),
    (["plan", "my_models", "--mesh", "2x2"], "is not MODULE:FUNCTION"),
    (["plan", "my_models:small", "--mesh", "2xq"], "--mesh '2xq' is not a shape"),
    (["plan", "my_models:small", "--mesh", "2x2", "--axes", "dp"], "2 axes but 1 axis names"),
    (["plan", "my_models:small", "--mesh", "2x2", "--device", "tpu9"], "tpu9"),
    (["plan", "my_models:small", "--mesh", "2x2", "--pins", "wte.weight"], "is not NAME=LAYOUT"),
    (["plan", "my_models:small", "--mesh", "2x2", "--pins", "nothing.weight=R,R"], "nothing.weight"),
    (["plan", "--mesh", "2x2"], "no model: give MODULE:FUNCTION"),
    (["plan", "--hf-config", "missing.json", "--mesh", "2x2"], "cannot read config file 'missing.json'"),
    (["plan", "--hf-config", "my_models.py", "--mesh", "2x2"], "is not JSON"),
    (["report", "missing.json"], "cannot read plan 'missing.json'"),
    (["report", "my_models.py"], "is not a plan"),
    (["estimate", "--plan", "p.json", "--batch", "0"], "batch must be a positive integer"),
    (["explain", "my_models:small", "--plan", "p.json", "--name", "blocks.0.no_such"], "'blocks.0.no_such' is neither"),
])
def test_bad_input_exits_2_with_a_message(workdir, argv, message, capsys, monkeypatch):
    d, _ = workdir
    monkeypatch.chdir(d)
    monkeypatch.syspath_prepend(str(d))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"autopar {argv[0]}: error: " in err and message in err and "Traceback" not in err


def test_bad_input_from_the_shell(workdir, capsys):
    d, _ = workdir
    r = run_autopar("plan", "my_models:small", "--mesh", "4", "--axes", "dp", "--memory-budget", "0.001",
                    "--no-symbolic", cwd=d)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("autopar plan: error: no plan fits 0.001 GiB per device") and "Traceback" not in r.stderr
    with pytest.raises(SystemExit) as usage:
        main(["plan", "my_models:small", "--mesh", "2x2", "--bogus"])
    assert usage.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit) as help_:
        main(["--help"])
    out = capsys.readouterr().out
    assert help_.value.code == 0 and "examples:" in out and "autopar plan --hf-config" in out


def test_progress_names_the_phases_on_a_terminal(monkeypatch):
    from models import MLP
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    model, x, mesh = MLP(), torch.randn(8, 16), autopar.Mesh((2,), ("dp",), "cpu")
    monkeypatch.setattr(progress, "DELAY_S", 1e6)
    autopar.plan(model, x, mesh, progress=True)
    assert err.getvalue() == ""                     # quick plans say nothing
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    autopar.plan(model, x, mesh, progress=False)
    assert err.getvalue() == ""
    autopar.plan(model, x, mesh, progress=True)
    lines = [ln.split(" took ")[0].split(" ...")[0] for ln in err.getvalue().splitlines()]
    assert lines[:-1] == ["autopar: capture"] * 2 + ["autopar: strategies"] * 2 + ["autopar: solve"] * 2
    assert "(HiGHS: optimal)" in err.getvalue() and lines[-1].startswith("autopar: planned in")


def test_estimate_with_sharded_outputs_leaves_the_logits_split(tmp_path, capsys):
    """A Hugging Face causal LM returns its logits beside the loss: priced whole on every device unless
    `--sharded-outputs` leaves them in their planned layout (here split over the 8 data-parallel ranks: on
    fewer, the loss's backward, with its fp32 logits-sized gradients, is the peak either way)."""
    import json
    cfg = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=32768, max_position_embeddings=256)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    peaks, sent = [], []
    for extra in ([], ["--sharded-outputs"]):
        assert main(["estimate", "--hf-config", str(tmp_path / "config.json"), "--batch", "16", "--seq", "256",
                     "--mesh", "8", "--axes", "dp", "--batch-axes", "dp", "--device", "h100", *extra]) == 0
        out = capsys.readouterr().out
        peaks.append(float(out.split("peak memory per device")[1].split("GiB")[0]))
        sent.append(float(out.split("communication per device per step: dp")[1].split("GiB")[0]))
    logits = 16 * 256 * 32768 * 2 / 2**30       # bf16: 0.25 GiB whole, gathered from eighths
    assert sent[0] - sent[1] >= 0.5 * logits and peaks[0] - peaks[1] >= 0.25 * logits
