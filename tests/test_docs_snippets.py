"""Every ```python snippet of README.md and docs/*.md runs as written.

A snippet uses names the prose around it defines (`model`, `example_inputs`, `plan`, ...): each
document gets a small context binding them, and the snippets of a document run in order in one
namespace on 4 real ranks where it runs something on them (the README's applies a plan), else on one
(planning and pricing run alike on every rank: 4 would do it 4 times), in a scratch directory.
docs/usage.md continues the README's example: its snippets run after the README's, in the README's
namespace (one context, one plan, one distributed module for both). Its shell commands are docs/cli.md's, which
tests/test_docs_cli.py runs."""
from __future__ import annotations

import ast
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
USAGE = ROOT / "docs" / "usage.md"
CONTINUES = {USAGE: ROOT / "README.md"}           # a document -> the one whose namespace it runs on in
# what a document's distributed or compiled module must compute: the user's model's loss
CALLED = {"README.md": ("dmodel",), "usage.md": ("compiled",)}
_SNIPPET = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_SHELL = re.compile(r"^```sh\n(.*?)^```", re.S | re.M)
# what runs on the ranks: a document calling none of these runs on one (a call it misses, on one rank,
# raises: the mesh's world size is not the job's)
_DISTRIBUTED = re.compile(r"autoparallelize|autopar\.compile|torch\.distributed|device_mesh")


def snippets(path: Path) -> list[str]:
    return _SNIPPET.findall(path.read_text())


def chains() -> list[list[Path]]:
    """Each document that continues none, with those that continue it, in the order they run."""
    return [[p, *(q for q, of in CONTINUES.items() if of == p)] for p in DOCS if p not in CONTINUES]


def reads_before_binding(codes: list[str], name: str) -> bool:
    """Whether snippets run in order read `name` before any binds it (statement by statement)."""
    for code in codes:
        for stmt in ast.parse(code).body:
            ctxs = {type(n.ctx) for n in ast.walk(stmt) if isinstance(n, ast.Name) and n.id == name}
            if ast.Load in ctxs:
                return True
            if ast.Store in ctxs:
                return False
    return False


def _context(codes: list[str]) -> dict:
    """The names the documents' prose stands for: a small GPT, its global batch, a plan of it (made
    only where a snippet reads it before making its own: planning is most of a context's cost)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import torch

    import autopar
    from models import GPT, gpt_inputs
    torch.manual_seed(0)
    model = GPT(vocab=64, seq=16, hidden=32, heads=4, layers=2)
    example_inputs = gpt_inputs(batch=32, seq=16, vocab=64)
    mesh = autopar.Mesh((4, 2), ("pp", "dp"), device="h100")
    ns = {"autopar": autopar, "torch": torch, "model": model, "example_inputs": example_inputs, "batch": example_inputs,
          "mesh": mesh, "pins_or_plan": {"blocks.*.fc.weight": ("R",)}}
    if reads_before_binding(codes, "plan"):
        ns["plan"] = autopar.plan(model, example_inputs, autopar.Mesh((2, 2), ("dp", "tp")), batch_axes=("dp",))
    return ns


def _run_documents(rank, world_size, paths: list[str]):
    import torch.distributed as dist
    docs = [(Path(p), snippets(Path(p))) for p in paths]
    ns = _context([code for _, codes in docs for code in codes])
    here = os.getcwd()
    shared = [tempfile.mkdtemp(prefix="autopar_docs_") if rank == 0 else None]
    dist.broadcast_object_list(shared)      # `checkpoint_dir`: a directory every rank sees, as on shared storage
    ns["checkpoint_dir"] = shared[0]
    called = {}
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)
        try:
            for path, codes in docs:
                for i, code in enumerate(codes):
                    exec(compile(code, f"{path} snippet {i}", "exec"), ns)   # our own documentation
                called.update(_called(ns, CALLED.get(path.name, ())))      # before a later document moves it on
        finally:
            os.chdir(here)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(shared[0], ignore_errors=True)
    names = sorted(k for k in ns if not k.startswith("__"))
    return names, called


def _called(ns: dict, names) -> dict:
    """What a document's distributed model and compiled model give on its inputs, against the user's
    model on one process (they must run, not just be built)."""
    out = {}
    want = ns["model"](*ns["example_inputs"])
    for name in names:
        if name in ns:
            got = ns[name](*ns["example_inputs"])
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            out[name] = float((got.detach() - want.detach()).abs() / want.detach().abs())
    return out


def test_documents_have_snippets():
    assert sum(len(snippets(p)) for p in DOCS) >= 3
    assert len(snippets(USAGE)) >= 5


def test_usage_shell_commands_are_the_cli_pages():
    """usage.md shows slow tasks as shell commands; each is a line of docs/cli.md's, run by test_docs_cli.py."""
    def lines(path):
        return {ln.strip() for block in _SHELL.findall(path.read_text()) for ln in block.splitlines() if ln.strip()}
    shown = lines(USAGE)
    assert shown and shown <= lines(ROOT / "docs" / "cli.md"), shown - lines(ROOT / "docs" / "cli.md")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_links_reach_docs_and_their_headings():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[\w.]+)(?:#([\w-]+))?\)", readme)
    assert len({a for _, a in links if a}) >= 10
    for page, anchor in links:
        assert (ROOT / page).exists(), page
        if anchor:
            headings = re.findall(r"^#+ (.*)$", (ROOT / page).read_text(), re.M)
            assert anchor in {_anchor(h) for h in headings}, (page, anchor)
    usage = re.search(r"^## Usage\n(.*?)^## ", readme, re.S | re.M).group(1)
    assert len(usage.splitlines()) <= 100                # two screens
    assert all(f"docs/{p.name}" in readme for p in DOCS if p.parent.name == "docs")


@pytest.mark.parametrize("paths", [c for c in chains() if any(snippets(p) for p in c)],
                         ids=lambda c: "+".join(p.name for p in c))
def test_every_snippet_runs(rank_pool, paths):
    ranks = 4 if any(_DISTRIBUTED.search(code) for p in paths for code in snippets(p)) else 1
    names, called = rank_pool(ranks).run(_run_documents, [str(p) for p in paths], timeout=600)[0]
    assert names
    if paths[0].name == "README.md":    # the distributed module and the compiled model compute the loss
        assert set(called) == {"dmodel", "compiled"} and all(gap < 1e-5 for gap in called.values()), called
