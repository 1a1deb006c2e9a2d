"""docs/cli.md runs as written: each command exits as the page says, and makes what it says."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import autopar  # noqa: E402
from autopar.cli import main  # noqa: E402

DOC = ROOT / "docs" / "cli.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Run every command of the page's sh blocks in a copy of examples/: (command, exit status) each."""
    d = tmp_path_factory.mktemp("docs_cli")
    for name in ("my_models.py", "models.py"):
        shutil.copy(ROOT / "examples" / name, d)
    shutil.copytree(ROOT / "examples" / "configs", d / "configs")
    mp = pytest.MonkeyPatch()
    mp.chdir(d)
    mp.syspath_prepend(str(d))
    results = []
    try:
        for block in _blocks("sh"):
            for line in block.splitlines():
                argv = shlex.split(line, comments=True)
                assert argv[0] == "autopar", line
                results.append((line, main(argv[1:])))
    finally:
        mp.undo()
    return d, results


def test_every_command_exits_as_the_page_says(ran):
    _, results = ran
    assert len(results) == 11
    for line, rc in results:
        assert rc == (1 if "exits 1" in line else 0), line


def test_the_page_shows_the_example_models_code():
    assert _blocks("python")[0] in (ROOT / "examples" / "my_models.py").read_text()


def test_the_commands_make_a_plan_and_its_page(ran):
    d, _ = ran
    plan = autopar.Plan.load(d / "p.json")
    assert plan.model == "GPT" and plan.mesh["shape"] == [2, 2]
    assert (d / "again.html").read_text() == (d / "r.html").read_text() == plan.to_html()
    assert autopar.Plan.load(d / "pinned.json").placements["blocks.1.fc.weight"] == ("R", "S(0)")


def test_the_hf_config_command_plans_llama3_8b_sliced(ran):
    """configs/llama3_8b.json with --layers 2: Llama-3-8B's widths, vocabulary and grouped KV heads."""
    d, _ = ran
    plan = autopar.Plan.load(d / "llama.json")
    cfg = json.loads((ROOT / "examples" / "configs" / "llama3_8b.json").read_text())
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv_dim = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    layer = 2 * h * h + 2 * h * kv_dim + 3 * h * f + 2 * h
    n_params = 2 * v * h + 2 * layer + h                    # embeddings and head untied, final norm
    assert plan.model == "LlamaForCausalLM" and len(plan.placements) == 2 * 9 + 3
    total_state = n_params * 2 * 4           # bf16: parameter, gradient, two AdamW moments
    assert total_state / 64 <= plan.estimate.param_state_bytes <= total_state
    assert plan.estimate.peak_memory_bytes <= autopar.Mesh((8, 8), device="h100").profile.memory_budget


def test_a_calibrated_profile_plans_from_the_shell(ran):
    """`calibrate` writes a profile of this machine that `plan --device` takes."""
    d, _ = ran
    profile = json.loads((d / "me.json").read_text())
    assert profile["device_type"] == "cpu" and profile["_measured"]["launch"]["ranks"] == 2
    plan = autopar.Plan.load(d / "mine.json")
    assert plan.mesh["device"] == profile["name"] and plan.mesh["shape"] == [2]
