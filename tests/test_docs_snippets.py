"""Every ```python snippet of README.md and docs/*.md runs as written.

A snippet uses names the prose around it defines (`model`, `example_inputs`, `plan`, ...): each
document gets a small context binding them, and the snippets of a document run in order in one
namespace on 4 real ranks (the README's applies a plan), in a scratch directory."""
from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_SNIPPET = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets(path: Path) -> list[str]:
    return _SNIPPET.findall(path.read_text())


def _context() -> dict:
    """The names the documents' prose stands for: a small GPT, its global batch, a plan of it."""
    sys.path.insert(0, str(ROOT / "examples"))
    import torch

    import autopar
    from models import GPT, gpt_inputs
    torch.manual_seed(0)
    model = GPT(vocab=64, seq=16, hidden=32, heads=4, layers=2)
    example_inputs = gpt_inputs(batch=32, seq=16, vocab=64)
    mesh = autopar.Mesh((4, 2), ("pp", "dp"), device="h100")
    return {"autopar": autopar, "torch": torch, "model": model, "example_inputs": example_inputs, "batch": example_inputs, "mesh": mesh,
            "pins_or_plan": {"blocks.*.fc.weight": ("R",)},
            "plan": autopar.plan(model, example_inputs, autopar.Mesh((2, 2), ("dp", "tp")), batch_axes=("dp",))}


def _run_document(rank, world_size, path: str):
    import torch.distributed as dist
    ns = _context()
    here = os.getcwd()
    shared = [tempfile.mkdtemp(prefix="autopar_docs_") if rank == 0 else None]
    dist.broadcast_object_list(shared)      # `checkpoint_dir`: a directory every rank sees, as on shared storage
    ns["checkpoint_dir"] = shared[0]
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)
        try:
            for i, code in enumerate(snippets(Path(path))):
                exec(compile(code, f"{path} snippet {i}", "exec"), ns)   # our own documentation
        finally:
            os.chdir(here)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(shared[0], ignore_errors=True)
    names = sorted(k for k in ns if not k.startswith("__"))
    return names, (_called(ns) if Path(path).name == "README.md" else {})


def _called(ns: dict) -> dict:
    """What a document's distributed model and compiled model give on its inputs, against the user's
    model on one process (they must run, not just be built)."""
    out = {}
    want = ns["model"](*ns["example_inputs"])
    for name in ("dmodel", "compiled"):
        if name in ns:
            got = ns[name](*ns["example_inputs"])
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            out[name] = float((got.detach() - want.detach()).abs() / want.detach().abs())
    return out


def test_documents_have_snippets():
    assert sum(len(snippets(p)) for p in DOCS) >= 3


@pytest.mark.parametrize("path", [p for p in DOCS if snippets(p)], ids=lambda p: p.name)
def test_every_snippet_runs(rank_pool, path):
    names, called = rank_pool(4).run(_run_document, str(path), timeout=600)[0]
    assert names
    if path.name == "README.md":        # the distributed module and the compiled model compute the loss
        assert set(called) == {"dmodel", "compiled"} and all(gap < 1e-5 for gap in called.values()), called
