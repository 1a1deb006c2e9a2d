"""Expert weights under the memory families (issue 18 with issue 6): on a (dp, ep) mesh the experts
are split over ep (expert_parallel) and stored split over dp as well (ZeRO-3 style), gathered over
dp for use. Re-gathered in the backward (residency "regather"), with their optimizer state and
master weights stepped on the host and the layers' saved activations offloaded, they train exactly
like one process."""
from __future__ import annotations

import copy
import warnings

import torch

import autopar
from dist_checks import LR, STEPS, rel, shard_happy_profile, well_posed_elements

EXPERTS = [f"model.layers.{i}.mlp.experts.{w}" for i in range(2) for w in ("gate_up_proj", "down_proj")]
PINS = {"moe_experts*": ("tokens", "expert_parallel"), "model.layers.*.mlp.experts.*": ("S(2)", "S(0)")}


def train_with_memory_families(rank, world_size):
    import zoo
    model, args, kwargs, loss_fn = zoo.build("mixtral")
    ref = copy.deepcopy(model)
    mesh = autopar.Mesh((2, 2), ("dp", "ep"), device=shard_happy_profile())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dmodel = autopar.autoparallelize(model, mesh, args, example_kwargs=kwargs, pins=PINS, batch_axes=("dp", "ep"),
                                         recompute="none", residency="regather", offload="host")
    local = dict(zip(kwargs, mesh.local_batch(tuple(kwargs.values()), ("dp", "ep"))))
    opt, ref_opt = dmodel.optimizer(torch.optim.AdamW, lr=LR), torch.optim.AdamW(ref.parameters(), lr=LR)
    worst = dict.fromkeys(("loss", "grad", "param"), 0.0)
    for step in range(STEPS):
        loss = loss_fn(dmodel(**local))
        loss.backward()
        ref_loss = loss_fn(ref(**kwargs))
        ref_loss.backward()
        worst["loss"] = max(worst["loss"], rel(loss.detach(), ref_loss.detach()))
        params = dict(dmodel.named_parameters())
        if step == 0:
            masks = {k: well_posed_elements(p.grad) for k, p in ref.named_parameters()}
            worst["grad"] = max(rel(params[k].grad.full_tensor()[m], p.grad[m])
                                for (k, p), m in zip(ref.named_parameters(), masks.values()) if m.any())
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    params = dict(dmodel.named_parameters())
    worst["param"] = max(rel(params[k].detach().full_tensor()[masks[k]], p.detach()[masks[k]])
                         for k, p in ref.named_parameters() if masks[k].any())
    plan = dmodel.plan
    return {**worst, "stored": {k: plan.placements[k] for k in EXPERTS},
            "residency": {k: plan.residency.get(k) for k in EXPERTS}, "tiers": {k: opt.tier_of(k) for k in EXPERTS},
            "regathered": sorted(m.key for m in dmodel.graph_module.modules()
                                 if type(m).__name__ == "GatherCopy" and m.residency == "regather"),
            "labels": sorted({lab for n in plan.nodes for lab in n.labels}), "notes": list(dmodel.memory.notes)}


def test_expert_weights_regathered_and_offloaded_train_like_one_process(rank_pool):
    results = rank_pool(4).run(train_with_memory_families, timeout=300)
    r = results[0]
    for key in ("loss", "grad", "param"):
        assert max(x[key] for x in results) < 1e-4, (key, {k: r[k] for k in ("loss", "grad", "param")})
    assert "expert_parallel" in r["labels"]
    assert all(v == ("S(2)", "S(0)") for v in r["stored"].values()), r["stored"]
    assert all(v == "regather" for v in r["residency"].values()) and set(EXPERTS) <= set(r["regathered"]), r
    assert all(t == "host" for t in r["tiers"].values()), r["tiers"]
