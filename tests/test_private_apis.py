"""Private torch and Hugging Face APIs are reached only through autopar/compat.py (the house rule: a
torch upgrade that moves one breaks that file alone): no other module reads a private attribute of
torch's modules, tensors, DTensors or ops, or of a transformers model, nor imports a private torch
module."""
from __future__ import annotations

import ast
import pathlib

import torch
from torch.distributed.tensor import DTensor

import autopar

ROOT = pathlib.Path(autopar.__file__).parent


def _private_names() -> set[str]:
    from transformers import PreTrainedModel
    owners = (torch.nn.Module(), torch.Tensor, DTensor, torch.ops.aten.linear, torch.ops.aten.linear.default,
              PreTrainedModel)
    return {k for o in owners for k in dir(o) if k.startswith("_") and not k.startswith("__")}


def _uses(tree: ast.AST, private: set[str]):
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and (n.attr in private or (
                isinstance(n.value, ast.Name) and n.value.id == "torch" and n.attr.startswith("_")
                and not n.attr.startswith("__"))):
            yield n.lineno, f"{ast.unparse(n.value)}.{n.attr}"
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr", "setattr")
              and len(n.args) > 1 and isinstance(n.args[1], ast.Constant) and n.args[1].value in private):
            yield n.lineno, f"{n.func.id}(..., {n.args[1].value!r})"
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names = [n.module or ""] if isinstance(n, ast.ImportFrom) else [a.name for a in n.names]
            yield from ((n.lineno, f"import {m}") for m in names
                        if m.split(".")[0] == "torch" and any(p.startswith("_") for p in m.split(".")))


def _own(trees) -> set[str]:
    """Attributes autopar sets on its own objects (`self._device_mesh = ...`): its names, not torch's."""
    return {t.attr for tree in trees for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Attribute)}


def test_private_torch_and_hf_apis_are_used_only_in_compat():
    trees = {f: ast.parse(f.read_text()) for f in sorted(ROOT.rglob("*.py")) if f != ROOT / "compat.py"}
    private = _private_names() - _own(trees.values())
    found = [f"{f.relative_to(ROOT.parent)}:{line}: {what}" for f, tree in trees.items()
             for line, what in _uses(tree, private)]
    assert not found, "private APIs outside autopar/compat.py:\n" + "\n".join(found)
