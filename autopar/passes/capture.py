"""Capture: a model and example inputs become one torch.fx graph of the forward.

We use `torch.export` (non-strict), which traces on fake tensors, so a model whose
parameters live on the meta device is captured without materialising a weight, and
Python shape arithmetic (`B, T = x.shape`) is specialised to the example's sizes.

The captured graph is ATen-level but keeps composite ops whole (`aten.linear`,
`aten.layer_norm`, `aten.scaled_dot_product_attention`), which is the granularity a
sharding decision is made at. Parameters, buffers and user inputs are placeholders;
`Captured.inputs` says which is which. Tied parameters (one tensor, two names) are
folded onto one placeholder so the planner gives them one placement.
"""
from __future__ import annotations

import linecache
import os
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..errors import CaptureError

_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclass(frozen=True, slots=True)
class InputSlot:
    """What feeds one placeholder: a parameter/buffer/constant by qualified name, or user input i."""
    kind: str            # "param" | "buffer" | "constant" | "input"
    target: str | int    # qualified name, or index into the flattened (args, kwargs)


@dataclass(slots=True)
class Captured:
    gm: fx.GraphModule
    inputs: dict[str, InputSlot]                 # placeholder name -> what feeds it
    outputs: list[tuple[str, str | None]]        # per graph output: ("user", None) or ("buffer", fqn)
    in_spec: Any
    out_spec: Any
    param_names: dict[str, str] = field(default_factory=dict)   # every param FQN (aliases too) -> canonical FQN
    model_name: str = ""


def flatten_inputs(args: tuple, kwargs: dict | None) -> list[Any]:
    return pytree.tree_leaves((tuple(args), dict(kwargs or {})))


def capture(model: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> Captured:
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"autopar needs a torch.nn.Module, got {type(model).__name__}")
    args = args if isinstance(args, tuple) else (args,)
    was_training = model.training
    try:
        ep = torch.export.export(model, args, kwargs or {}, strict=False)
    except Exception as e:  # noqa: BLE001 - every capture failure becomes one actionable error
        raise _capture_error(model, e) from e
    finally:
        model.train(was_training)
    return _from_exported(model, ep)


def _from_exported(model: torch.nn.Module, ep) -> Captured:
    gm = ep.graph_module
    sig = ep.graph_signature
    canonical = {}   # id(param) -> canonical FQN
    param_names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), name)
        param_names[name] = canonical[id(p)]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs: dict[str, InputSlot] = {}
    user_i = 0
    canon_node: dict[str, fx.Node] = {}
    for node, spec in zip(placeholders, sig.input_specs):
        kind = spec.kind.name
        if kind == "PARAMETER":
            fqn = param_names.get(spec.target, spec.target)
            if fqn in canon_node:   # tied weight: route every use to the first placeholder
                node.replace_all_uses_with(canon_node[fqn])
            else:
                canon_node[fqn] = node
            inputs[node.name] = InputSlot("param", fqn)
        elif kind == "BUFFER":
            inputs[node.name] = InputSlot("buffer", spec.target)
        elif kind in ("CONSTANT_TENSOR", "CUSTOM_OBJ"):
            inputs[node.name] = InputSlot("constant", spec.target)
        else:
            inputs[node.name] = InputSlot("input", user_i)
            user_i += 1
    outputs = []
    for spec in sig.output_specs:
        kind = spec.kind.name
        if kind == "USER_OUTPUT":
            outputs.append(("user", None))
        elif kind == "BUFFER_MUTATION":
            outputs.append(("buffer", spec.target))
        else:
            outputs.append((kind.lower(), spec.target))
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return Captured(gm=gm, inputs=inputs, outputs=outputs, in_spec=ep.call_spec.in_spec,
                    out_spec=ep.call_spec.out_spec, param_names=param_names, model_name=type(model).__name__)


def _capture_error(model: torch.nn.Module, e: Exception) -> CaptureError:
    """Name the line of the user's model that broke tracing, and what to do about it."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(_TORCH_DIR)
              and "/autopar/" not in f.filename]
    where = ""
    if frames:
        f = frames[-1]
        code = (f.line or linecache.getline(f.filename, f.lineno)).strip()
        where = f"\n  failing line of your model: {f.filename}:{f.lineno} in {f.name}: `{code}`"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return CaptureError(
        f"could not capture {type(model).__name__} as a graph: {type(e).__name__}: {first}{where}\n"
        "  what to do: make that code traceable (no data-dependent Python control flow or .item()/.tolist() "
        "on tensors), or move it out of forward; your model was not modified")
