"""Where the command line gets a model to plan: a Python function, or a Hugging Face config file.

    load_function("my_models:small")        # my_models.small() -> (model, example_inputs)
    load_hf_config("config.json", batch=8, seq=1024)

A function returns `(model, example_inputs)`; the inputs are a tensor, a tuple of positional
arguments, or a dict of keyword arguments (`(model, args, kwargs)` is accepted too). The module
is imported from the current directory first, as `python -m` does.

A Hugging Face config becomes its causal LM (`AutoModelForCausalLM.from_config`) built on the
meta device in bfloat16: no weights are allocated or downloaded, planning needs only shapes.
Its inputs are `input_ids` and `labels` of shape (batch, seq) on meta, so the model returns a
loss and the plan covers a training step.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import AutoparError


class ModelSourceError(AutoparError):
    """The model the command line was pointed at cannot be loaded (module, function or config file)."""


@dataclass(slots=True)
class ModelSource:
    model: torch.nn.Module
    args: tuple
    kwargs: dict = field(default_factory=dict)
    name: str = ""                 # how the user named it ("my_models:small", "config.json")


def load_function(spec: str) -> ModelSource:
    """`MODULE:FUNCTION` -> the model and inputs FUNCTION() returns."""
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise ModelSourceError(f"model {spec!r} is not MODULE:FUNCTION (e.g. my_models:small, where "
                               f"my_models.small() returns (model, example_inputs))")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name.split(".")[0] and e.name != module_name:
            raise     # the module exists but imports something missing: its own traceback says what
        raise ModelSourceError(f"no module {module_name!r} (from {spec!r}) in {os.getcwd()} or on PYTHONPATH: "
                               f"run from the directory that holds {module_name.replace('.', '/')}.py") from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ModelSourceError(f"module {module_name!r} ({module.__file__}) has no function {func_name!r}")
    return _unpack(fn(), spec)


def _unpack(out, spec: str) -> ModelSource:
    if not isinstance(out, tuple) or len(out) not in (2, 3) or not isinstance(out[0], torch.nn.Module):
        raise ModelSourceError(f"{spec}() must return (model, example_inputs) with model an nn.Module, "
                               f"got {type(out).__name__}")
    model, inputs = out[0], out[1]
    if len(out) == 3:
        return ModelSource(model, tuple(inputs), dict(out[2]), spec)
    if isinstance(inputs, dict):
        return ModelSource(model, (), dict(inputs), spec)
    if isinstance(inputs, torch.Tensor):
        return ModelSource(model, (inputs,), {}, spec)
    return ModelSource(model, tuple(inputs), {}, spec)


def load_hf_config(path: str, batch: int, seq: int, layers: int | None = None) -> ModelSource:
    """The causal LM of a Hugging Face config.json on meta in bf16, with (batch, seq) token inputs;
    `layers` overrides the config's depth (a quick look at a slice of a deep model)."""
    try:
        cfg = json.loads(Path(path).read_text())
    except OSError as e:
        raise ModelSourceError(f"cannot read config file {path!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ModelSourceError(f"config file {path!r} is not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise ModelSourceError(f"config file {path!r} has no \"model_type\": give a Hugging Face config.json")
    if batch < 1 or seq < 1:
        raise ModelSourceError(f"--batch and --seq must be positive, got {batch} and {seq}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")      # a config file only: never the network
    import transformers
    try:
        config = transformers.AutoConfig.for_model(**cfg)
    except (ValueError, KeyError) as e:
        raise ModelSourceError(f"config file {path!r}: transformers {transformers.__version__} does not know "
                               f"it ({e})") from None
    if layers is not None:
        config.num_hidden_layers = layers
    if seq > getattr(config, "max_position_embeddings", seq):
        raise ModelSourceError(f"--seq {seq} exceeds the config's max_position_embeddings "
                               f"{config.max_position_embeddings}")
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    except ValueError as e:
        raise ModelSourceError(f"config file {path!r} (model_type {cfg['model_type']!r}) has no causal LM in "
                               f"transformers: {str(e).splitlines()[0]}") from None
    model.train()
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return ModelSource(model, (), {"input_ids": tokens, "labels": tokens.clone()}, Path(path).name)
