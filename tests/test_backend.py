"""torch.compile(model, backend=autopar.compile_backend(mesh)) runs the planned distributed program."""
from __future__ import annotations

import pytest

from dist_checks import compile_and_compare


@pytest.mark.parametrize("name,shape,axes", [("mlp", (2, 2), ("dp", "tp")), ("gpt", (4,), ("dp",))])
def test_compiled_model_matches_single_process(rank_pool, name, shape, axes):
    results = rank_pool(4).run(compile_and_compare, name, shape, axes)
    r = results[0]
    assert r["plans"] == 1, r                 # one graph, planned once, reused for every step
    assert r["sharded_nodes"] > 0, r
    for key in ("loss", "grad", "param"):
        assert max(x[key] for x in results) < 1e-5, (key, r)


def _compile_hf_with_defaults(rank, world_size, name):
    """A Hugging Face causal LM called as its users call it (use_cache on: lifted constants in the
    graph, a DynamicCache in the output), compiled with autopar's backend, against eager."""
    import copy

    import torch
    import torch._dynamo
    import zoo

    import autopar
    from dist_checks import LR, rel, shard_happy_profile, well_posed_elements
    torch._dynamo.reset()
    model, args, kwargs, loss_fn = zoo.build(name)
    assert model.config.use_cache
    ref = copy.deepcopy(model)
    backend = autopar.compile_backend(autopar.Mesh((2,), ("tp",), device=shard_happy_profile()))
    compiled = torch.compile(model, backend=backend)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=LR), torch.optim.AdamW(ref.parameters(), lr=LR)
    worst = {"loss": 0.0, "grad": 0.0, "cache": 0.0, "param": 0.0}
    well_posed: dict = {}
    for _ in range(2):
        out, expect = compiled(*args, **kwargs), ref(*args, **kwargs)
        worst["cache_type"] = type(out.past_key_values).__name__
        for mine, theirs in zip(out.past_key_values.layers, expect.past_key_values.layers, strict=True):
            worst["cache"] = max(worst["cache"], rel(mine.keys.detach(), theirs.keys.detach()),
                                 rel(mine.values.detach(), theirs.values.detach()))
        loss_fn(out).backward(), loss_fn(expect).backward()
        worst["loss"] = max(worst["loss"], rel(out.loss.detach(), expect.loss.detach()))
        mine = dict(model.named_parameters())
        worst["grad"] = max([worst["grad"]] + [rel(mine[k].grad, p.grad) for k, p in ref.named_parameters()])
        # AdamW turns rounding noise in zero gradients into full steps: compare where gradients are signal
        well_posed = {k: well_posed_elements(p.grad) & well_posed.get(k, True) for k, p in ref.named_parameters()}
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    mine = dict(model.named_parameters())
    worst["param"] = max(rel(mine[k].detach()[well_posed[k]], p.detach()[well_posed[k]])
                         for k, p in ref.named_parameters() if well_posed[k].any())
    worst["sharded_nodes"] = sum(1 for plan in backend.plans for n in plan.nodes
                                 if n.executor not in ("param", "input", "output") and any(p != "R" for p in n.output))
    return worst


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_models_compiled_with_their_defaults(rank_pool, name):
    results = rank_pool(2).run(_compile_hf_with_defaults, name)
    for r in results:
        assert r["cache_type"] == "DynamicCache" and r["sharded_nodes"] > 0, r
        for key in ("loss", "grad", "cache", "param"):
            assert r[key] < 1e-4, (key, r)
