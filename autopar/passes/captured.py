"""What a capture yields: the forward's fx graph and what feeds each of its placeholders.

`capture.py` makes it; the passes that read or extend a capture (the short trace of repeated blocks,
layers, the runtime) import it from here, below the capture itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx


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
    constants: dict[str, torch.Tensor] = field(default_factory=dict)   # lifted constant tensors by name
    trace: str = ""     # a deep stack's capture: "short: ..." (copied, proven alike) or "whole: <why>"
