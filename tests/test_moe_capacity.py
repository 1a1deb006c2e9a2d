"""A capacity factor for mixture-of-experts layers (issue 18): `moe_capacity_factor` drops the
token-slots past each expert's capacity, ceil(factor x tokens x top_k / experts) over the global
batch, slots queued choice-major (runtime/experts.py). One process (`autopar.moe_capacity`) drops
the same slots as any plan on any mesh; the plan records the option and prices the capped load."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

import autopar
from autopar.runtime.experts import drop_over_capacity, expert_capacity, routing_counts
from dist_checks import train_and_compare

E, K = 4, 2


def _routing(tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])


def _queued_by_hand(idx: torch.Tensor, factor: float) -> torch.Tensor:
    """The rule written out: every first choice in token order, then every second choice; an expert
    past ceil(factor * T * k / E) slots takes no more."""
    cap, seen, out = expert_capacity(idx.shape[0], K, E, factor), [0] * E, idx.clone()
    for s in range(K):
        for t in range(idx.shape[0]):
            e = int(idx[t, s])
            out[t, s] = e if seen[e] < cap else -1
            seen[e] += 1
    return out


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25, 4.0])
def test_capacity_rule_in_one_process_and_in_token_blocks(factor):
    idx = _routing(24)
    whole = drop_over_capacity(idx, E, factor, routing_counts(idx, E)[None])
    assert torch.equal(whole, _queued_by_hand(idx, factor))
    assert bool((whole < 0).any()) == (factor < 2)      # 4.0: every expert can take every slot
    # devices holding blocks of the global tokens (uneven) drop exactly the same slots
    blocks = idx.split([5, 11, 8])
    counts = torch.stack([routing_counts(b, E) for b in blocks])
    assert torch.equal(torch.cat([drop_over_capacity(b, E, factor, counts, i) for i, b in enumerate(blocks)]), whole)


def _plan(**options):
    from zoo import build
    model, args, kwargs, _ = build("mixtral", layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, args, autopar.Mesh((4,), ("ep",), device="h100"), example_kwargs=kwargs,
                            pins={"moe_experts*": ("expert_parallel",)}, batch_axes=("ep",), symbolic=False,
                            **options)


def _exchange_s(plan) -> float:
    return sum(c.seconds for n in plan.nodes if n.op == "autopar.moe_experts" for c in n.collectives
               if c.tensor == n.name)


def test_option_recorded_validated_and_priced():
    dropless, capped, loose = _plan(), _plan(moe_capacity_factor=1.0), _plan(moe_capacity_factor=4.0)
    assert dropless.options["moe_capacity_factor"] is None and capped.options["moe_capacity_factor"] == 1.0
    back = autopar.Plan.from_json(capped.to_json())
    assert back.options["moe_capacity_factor"] == 1.0
    # the busiest device routes at most factor x the mean: 1.0 under the profile's 1.2, 4.0 above it
    assert _exchange_s(capped) < _exchange_s(dropless) == pytest.approx(_exchange_s(loose))
    assert capped.estimate.step_time_s < dropless.estimate.step_time_s
    assert "capacity factor 1: each expert takes at most" in capped.report()
    assert "dropless routing" in dropless.report()
    for bad in (0, -1.0, float("nan"), "1.25", True):
        with pytest.raises(autopar.AutoparError, match="moe_capacity_factor"):
            _plan(moe_capacity_factor=bad)
    d = json.loads(capped.to_json())
    d["options"]["moe_capacity_factor"] = 0
    with pytest.raises(autopar.PlanFileError, match="options.moe_capacity_factor"):
        autopar.Plan.from_json(json.dumps(d))


def test_one_process_reference_drops_and_changes_the_loss():
    from zoo import build
    model, args, kwargs, loss_fn = build("mixtral")
    dropless = loss_fn(model(*args, **kwargs))
    with autopar.moe_capacity(model, 1.0) as dropped:
        capped = loss_fn(model(*args, **kwargs))
    assert sum(dropped.values()) > 0 and set(dropped) == {f"model.layers.{i}.mlp.experts" for i in range(2)}
    assert not torch.allclose(capped, dropless)
    with autopar.moe_capacity(model, 100.0) as dropped:       # room for every slot: the model's own result
        assert torch.allclose(loss_fn(model(*args, **kwargs)), dropless, rtol=1e-5)
    assert sum(dropped.values()) == 0


# beside data parallelism (Qwen2-MoE, tokens split over both axes: the counts are gathered over two
# axes, of which a gather over one, expert parallelism alone, is the special case; dropless expert
# parallelism alone and beside an experts-only axis train in tests/test_expert_parallel.py); beside an
# axis that splits experts only (tokens whole on it)
CASES = [("qwen2_moe", (2, 2), ("dp", "ep"), ("tokens", "expert_parallel")),
         ("mixtral", (2, 2), ("dp", "ep"), ("experts", "expert_parallel"))]


@pytest.mark.parametrize("name,shape,axes,pin", CASES, ids=[f"{c[0]}-{'-'.join(c[3])}" for c in CASES])
def test_capacity_trains_like_one_process_with_the_same_rule(rank_pool, name, shape, axes, pin):
    results = rank_pool(4).run(train_and_compare, f"zoo:{name}", shape, axes, {"moe_experts*": pin}, axes,
                               1.0, timeout=300)
    r = results[0]
    for key in ("loss", "grad", "param"):
        assert max(x[key] for x in results) < 1e-4, (key, {k: r[k] for k in ("loss", "grad", "param")})
    assert sum(r["dropped"].values()) > 0, r["dropped"]      # the reference really dropped slots
    assert "autopar.moe_experts all_to_all@ep" in r["collectives"], r["collectives"]
