"""Bad input gets an error that names the cause, and the user's model is left as it was."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import autopar  # noqa: E402
from models import MLP  # noqa: E402


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum().item() > 0:   # data-dependent Python branch: not capturable
            return y * 2
        return y


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(model, snap):
    return all(torch.equal(snap[k], v) for k, v in model.state_dict().items())


def test_uncapturable_model_names_the_line():
    model = DataDependent()
    snap = _snapshot(model)
    with pytest.raises(autopar.CaptureError) as e:
        autopar.plan(model, (torch.randn(2, 4),), autopar.Mesh((2,), ("dp",)))
    msg = str(e.value)
    assert "DataDependent" in msg and "test_errors.py" in msg and "y.sum().item() > 0" in msg
    assert _same(model, snap)


def test_dimension_that_cannot_be_split():
    model = MLP(d_in=6, hidden=6, d_out=6, depth=1)
    snap = _snapshot(model)
    with pytest.raises(autopar.ShardingError) as e:
        autopar.plan(model, (torch.randn(4, 6),), autopar.Mesh((4,), ("tp",)),
                     pins={"layers.0.weight": ("S(0)",)})
    msg = str(e.value)
    assert "layers.0.weight" in msg and "'tp'" in msg and "size 6" in msg
    assert _same(model, snap)


def test_pin_that_matches_nothing():
    with pytest.raises(autopar.ShardingError, match="no_such.weight"):
        autopar.plan(MLP(), (torch.randn(4, 16),), autopar.Mesh((2,), ("dp",)), pins={"no_such.weight": ("R",)})


def test_bad_mesh_descriptions():
    with pytest.raises(autopar.MeshError, match="axis names"):
        autopar.Mesh((2, 2), ("dp",))
    with pytest.raises(autopar.MeshError, match="unknown|known"):
        autopar.Mesh((2,), ("dp",), device="tpu-v9")


def _world_mismatch(rank, world_size):
    model = MLP()
    try:
        autopar.autoparallelize(model, autopar.Mesh((2, 4), ("dp", "tp"), device="cpu"), (torch.randn(8, 16),))
    except autopar.MeshError as e:
        return str(e)
    return "no error"


def test_mesh_size_not_world_size(rank_pool):
    msgs = rank_pool(4).run(_world_mismatch)
    assert all("8 devices" in m and "world size 4" in m for m in msgs), msgs


class ClampIfLarge(nn.Module):
    """A user's activation that branches on a tensor's value, placed inside a Hugging Face model."""

    def forward(self, x):
        if x.abs().max() > 10:   # data-dependent Python branch: not capturable
            x = x.clamp(-10, 10)
        return torch.nn.functional.gelu(x)


def test_capture_failure_inside_a_hugging_face_model_names_the_users_line(capsys):
    from zoo import build
    model, args, kwargs, _ = build("gpt2")
    model.transformer.h[0].mlp.act = ClampIfLarge()
    snap = _snapshot(model)
    with pytest.raises(autopar.CaptureError) as e:
        autopar.plan(model, args, autopar.Mesh((2,), ("dp",)), example_kwargs=kwargs)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and "test_errors.py" in msg and "if x.abs().max() > 10:" in msg
    assert "in submodule: transformer.h.0.mlp.act (ClampIfLarge)" in msg
    assert "what to do:" in msg and "torch.where" in msg
    assert "def forward(self" not in capsys.readouterr().err      # no dump of torch's partial graph
    assert _same(model, snap) and "forward" not in model.__dict__


class MaskIndexing(nn.Module):
    """Boolean-mask indexing: the result's size depends on the values."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y[y > 0].sum()


def test_boolean_mask_indexing_is_a_capture_error_naming_the_line():
    model = MaskIndexing()
    snap = _snapshot(model)
    with pytest.raises(autopar.CaptureError) as e:
        autopar.plan(model, (torch.randn(8, 4),), autopar.Mesh((2,), ("dp",)))
    msg = str(e.value)
    assert "depends on the data" in msg and "y[y > 0].sum()" in msg and "torch.where" in msg, msg
    assert _same(model, snap)


@pytest.mark.parametrize("layout,why", [(("Shard(0)",), "Shard(0)"), ("S(0)", "is not a layout"),
                                        ((0,), "cannot parse placement 0")])
def test_unparseable_pin_is_a_sharding_error_naming_it(layout, why):
    with pytest.raises(autopar.ShardingError) as e:
        autopar.plan(MLP(), (torch.randn(4, 16),), autopar.Mesh((2,), ("dp",)), pins={"layers.0.weight": layout})
    assert "layers.0.weight" in str(e.value) and why in str(e.value), str(e.value)
