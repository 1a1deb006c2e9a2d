"""Models built on the meta device: `autoparallelize(..., init=FN)` equals one process initialising the
whole model, bitwise, on any mesh; `checkpoint=DIR` loads a Hugging Face safetensors directory (several
files) or a torch.distributed.checkpoint directory shard by shard and trains like `from_pretrained`;
a bad checkpoint is a `CheckpointError` on every rank; `save_pretrained` round-trips bit-exactly."""
from __future__ import annotations

import os
import shutil
import sys
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
    config = zoo.with_layers(zoo.hf_config(name), 1)       # one layer: the cheapest capture
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


_PLANS: dict = {}      # (model, mesh shape) -> Plan, kept in the rank processes: each is planned once


def _parallel(meta, name, shape, inputs, **kw):
    dmodel = autopar.autoparallelize(meta, _mesh(shape), (), example_kwargs=inputs, symbolic=False,
                                     plan=_PLANS.get((name, shape)), **kw)
    _PLANS[(name, shape)] = dmodel.plan
    return dmodel


def _tensors(m) -> dict:
    return dict([*m.named_parameters(remove_duplicate=False), *m.named_buffers(remove_duplicate=False)])


def _init_rank(rank, world, name, shape):
    """Full values of `init=model._init_weights` on a meta model over `shape`, and the one-process reference."""
    warnings.simplefilter("ignore")
    meta, inputs = _hf(name, meta=True), _inputs(name)
    torch.manual_seed(7)
    dmodel = _parallel(meta, name, shape, inputs, init=meta._init_weights)
    got = {k: _full(v) for k, v in _tensors(dmodel).items()}
    ref = _hf(name, meta=True)
    ref.to_empty(device="cpu")      # makes new Parameters (meta -> cpu): ties undone ...
    ref.tie_weights()               # ... and made again, as from_pretrained does
    torch.manual_seed(7)
    ref.apply(ref._init_weights)
    want = _tensors(ref)
    placements = sorted(set(map(tuple, dmodel.plan.placements.values())))
    return sorted(k for k in want if not torch.equal(got[k], want[k].detach())), len(want), placements


@pytest.mark.parametrize("name, shape", [("llama", (2, 2)), ("gpt2", (4,))])
def test_init_on_meta_equals_one_process_bitwise(rank_pool, name, shape):
    """Llama (rotary buffers) on (2, 2); GPT-2 (a tied embedding; its _init_weights re-draws its submodules'
    c_proj) on (4,)."""
    for differ, n, placements in rank_pool(4).run(_init_rank, name, shape):
        assert n > 10 and differ == [], (name, differ)
        assert any("S(0)" in p or "S(1)" in p for p in placements), placements     # really sharded


def _train(model, inputs, params, steps=2):
    opt = torch.optim.SGD(params, lr=LR)
    losses = []
    for _ in range(steps):
        loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _load_rank(rank, world, root):
    """Llama saved by from_pretrained's save_pretrained in several files, loaded on meta over (2, 2), trained
    2 SGD steps next to from_pretrained; saved again and reopened; saved by DCP and loaded over (4,)."""
    import torch.distributed.checkpoint as dcp
    import transformers as T
    warnings.simplefilter("ignore")
    inputs, src = _inputs("llama"), os.path.join(root, "hf")
    if rank == 0:
        _hf("llama", meta=False).save_pretrained(src, max_shard_size="16KB")
    dist.barrier()
    out = {"files": sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))}
    dmodel = _parallel(_hf("llama", meta=True), "llama", (2, 2), inputs, checkpoint=src)
    out["placements"] = sorted(set(map(tuple, dmodel.plan.placements.values())))
    ref = T.LlamaForCausalLM.from_pretrained(src)
    ref.train()
    out["losses"] = (_train(dmodel, inputs, dmodel.parameters()), _train(ref, inputs, ref.parameters()))
    want = _tensors(ref)
    out["param_rel"] = max(_rel(_full(t), want[k].detach()) for k, t in _tensors(dmodel).items())
    trained = {k: _full(t) for k, t in _tensors(dmodel).items()}
    dmodel.save_pretrained(os.path.join(root, "saved"), max_shard_size="16KB")
    if rank == 0:
        back = _tensors(T.LlamaForCausalLM.from_pretrained(os.path.join(root, "saved")))
        out["saved_differ"] = sorted(k for k, t in back.items() if not torch.equal(t.detach(), trained[k]))
    dcp.save(dmodel.state_dict(), checkpoint_id=os.path.join(root, "dcp"))
    again = _parallel(_hf("llama", meta=True), "llama", (4,), inputs, checkpoint=os.path.join(root, "dcp"))
    out["dcp_differ"] = sorted(k for k, t in _tensors(again).items() if not torch.equal(_full(t), trained[k]))
    return out


def test_hf_checkpoint_loads_shard_by_shard_trains_like_from_pretrained_and_saves_back(rank_pool, tmp_path):
    for r in rank_pool(4).run(_load_rank, str(tmp_path)):
        assert len(r["files"]) >= 3, r["files"]
        assert any("S(0)" in p or "S(1)" in p for p in r["placements"]), r["placements"]
        (mine, ref) = r["losses"]
        assert all(abs(a - b) <= TOL * abs(b) for a, b in zip(mine, ref)), r["losses"]
        assert mine[1] < mine[0] and r["param_rel"] < TOL, r
        assert r["dcp_differ"] == []
    assert r["saved_differ"] == [] if "saved_differ" in r else True


def _broken_checkpoints(root: str) -> dict[str, str]:
    """Rank 0 writes a good Llama directory and broken copies; -> {case: directory}."""
    from safetensors.torch import load_file, save_file
    good = os.path.join(root, "good")
    _hf("llama", meta=False).save_pretrained(good, max_shard_size="16KB")
    cases = {}
    for case in ("removed", "removed_no_index", "truncated"):
        cases[case] = os.path.join(root, case)
        shutil.copytree(good, cases[case])
    first = sorted(f for f in os.listdir(good) if f.endswith(".safetensors"))[0]
    for case in ("removed", "removed_no_index"):
        tensors = load_file(os.path.join(good, first))
        del tensors[sorted(tensors)[0]]
        save_file(tensors, os.path.join(cases[case], first), metadata={"format": "pt"})
    os.remove(os.path.join(cases["removed_no_index"], "model.safetensors.index.json"))
    with open(os.path.join(cases["truncated"], first), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(good, first)) - 16)
    cases["other_model"] = os.path.join(root, "gpt2")
    _hf("gpt2", meta=False).save_pretrained(cases["other_model"])
    return cases


def _refused_rank(rank, world, root):
    warnings.simplefilter("ignore")
    cases = [_broken_checkpoints(root) if rank == 0 else None]
    dist.broadcast_object_list(cases)
    out = {}
    for case, path in cases[0].items():
        try:
            autopar.autoparallelize(_hf("llama", meta=True), _mesh((4,)), (), example_kwargs=_inputs("llama"),
                                    checkpoint=path, symbolic=False)
            out[case] = None
        except autopar.CheckpointError as e:
            out[case] = str(e)
    return out


def test_a_checkpoint_that_does_not_fit_is_refused_on_every_rank(rank_pool, tmp_path):
    """A tensor removed (with and without the index), a truncated file, another model's checkpoint: a
    CheckpointError naming the file and the key, on every rank, before anything is planned."""
    for r in rank_pool(4).run(_refused_rank, str(tmp_path)):
        assert "model.safetensors.index.json lists tensor" in r["removed"] and "model-00001-of" in r["removed"]
        assert "no tensor for parameter" in r["removed_no_index"]
        assert "model-00001-of-" in r["truncated"] and ".safetensors: tensor" in r["truncated"]
        assert "the file is truncated" in r["truncated"]
        assert "gpt2" in r["other_model"] and "is not a parameter or buffer of this model" in r["other_model"]
