"""Models built on the meta device: `autoparallelize(..., init=FN)` equals one process initialising the
whole model, bitwise, on any mesh; `checkpoint=DIR` loads a Hugging Face safetensors directory (several
files) or a torch.distributed.checkpoint directory shard by shard and trains like `from_pretrained`;
a bad checkpoint is a `CheckpointError` on every rank; `save_pretrained` round-trips bit-exactly."""
from __future__ import annotations

import os
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import autopar  # noqa: E402
from dist_checks import shard_happy_profile  # noqa: E402
import zoo  # noqa: E402

TOL = 1e-5
LR = 0.1


def _hf(name: str, meta: bool):
    import transformers as T
    config = zoo.hf_config(name)
    cls = getattr(T, zoo._HF_CLASSES[name])
    if meta:
        with torch.device("meta"):
            return cls(config)
    torch.manual_seed(0)
    return cls(config)


def _inputs(name: str):
    _, _, kwargs, _ = zoo.build(name)
    return kwargs


def _mesh(shape):
    names = ("dp", "tp")[:len(shape)] if len(shape) == 2 else ("dp",)
    return autopar.Mesh(shape, names, device=shard_happy_profile())


def _full(t):
    return t.detach().full_tensor() if hasattr(t, "full_tensor") else t.detach()


def _tensors(m) -> dict:
    return dict([*m.named_parameters(remove_duplicate=False), *m.named_buffers(remove_duplicate=False)])


def _init_rank(rank, world, name, shape):
    """Full values of `init=model._init_weights` on a meta model over `shape`, and the one-process reference."""
    warnings.simplefilter("ignore")
    meta, inputs = _hf(name, meta=True), _inputs(name)
    torch.manual_seed(7)
    t0 = time.perf_counter()
    dmodel = autopar.autoparallelize(meta, _mesh(shape), (), example_kwargs=inputs, init=meta._init_weights,
                                     symbolic=False)
    print("autoparallelize", time.perf_counter() - t0, flush=True)
    got = {k: _full(v) for k, v in _tensors(dmodel).items()}
    ref = _hf(name, meta=True)
    ref.to_empty(device="cpu")      # makes new Parameters (meta -> cpu): ties undone ...
    ref.tie_weights()               # ... and made again, as from_pretrained does
    torch.manual_seed(7)
    ref.apply(ref._init_weights)
    want = _tensors(ref)
    placements = sorted(set(map(tuple, dmodel.plan.placements.values())))
    return sorted(k for k in want if not torch.equal(got[k], want[k].detach())), len(want), placements


@pytest.mark.parametrize("shape", [(4,), (2, 2)])
def test_init_on_meta_equals_one_process_bitwise(rank_pool, shape):
    """GPT-2 (tied embedding, its _init_weights re-drawing submodules' c_proj) and Llama (rotary buffers)."""
    for name in ("gpt2", "llama"):
        for differ, n, placements in rank_pool(4).run(_init_rank, name, shape):
            assert n > 10 and differ == [], (name, differ)
            assert any("S(0)" in p or "S(1)" in p for p in placements), placements     # really sharded
