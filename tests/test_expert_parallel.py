"""Expert parallelism (issue 18): a Hugging Face MoE model's experts op pinned ("expert_parallel",)
on 4 CPU ranks, inputs split on the batch, trains like one process (loss, gradients, parameters
after 2 AdamW steps within 1e-4) with its token-slots dispatched and combined by all-to-all."""
from __future__ import annotations

import pytest

from dist_checks import train_and_compare

MOE_TOL = 1e-4
EP_PINS = {"moe_experts*": ("expert_parallel",)}


# (model, mesh, strategy of the experts op per axis): expert parallelism alone; beside an axis that splits
# experts only (its outputs partial sums), so a device's experts are a block of both axes' coordinates.
# Inside data parallelism (Qwen2-MoE on (2, 2), tokens over dp: shared expert and auxiliary loss too)
# trains in tests/test_moe_capacity.py with its capacity factor (the same model, mesh and pins; slots
# dropped on top of the all-to-all run here without them)
CASES = [("mixtral", (4,), ("ep",), ("expert_parallel",)),
         ("mixtral", (2, 2), ("dp", "ep"), ("experts", "expert_parallel"))]


@pytest.mark.parametrize("name,shape,axes,pin", CASES, ids=[f"{c[0]}-{'-'.join(c[3])}" for c in CASES])
def test_expert_parallel_trains_like_one_process(rank_pool, name, shape, axes, pin):
    results = rank_pool(4).run(train_and_compare, f"zoo:{name}@1", shape, axes, {"moe_experts*": pin}, axes,
                               timeout=300)
    r = results[0]
    for key in ("loss", "grad", "param"):
        assert max(x[key] for x in results) < MOE_TOL, (key, {k: r[k] for k in ("loss", "grad", "param")})
    assert "expert_parallel" in r["labels"], r["labels"]
    assert "autopar.moe_experts all_to_all@ep" in r["collectives"], r["collectives"]
    assert all(r["placements"][k] != ("R",) for k in r["placements"] if ".experts." in k), r["placements"]


def _plan(pins, mesh_shape=(4,), names=("ep",)):
    import warnings

    import autopar
    from zoo import build
    model, args, kwargs, _ = build("mixtral")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, args, autopar.Mesh(mesh_shape, names, device="h100"), example_kwargs=kwargs,
                            pins=pins, batch_axes=names[:1], symbolic=False)


def test_plan_lists_all_to_all_and_report_shows_expert_placement():
    plan = _plan(EP_PINS)
    moe = [n for n in plan.nodes if n.op == "autopar.moe_experts"]
    assert len(moe) == 2 and all(n.labels == ("expert_parallel",) for n in moe)
    for n in moe:
        own = [c for c in n.collectives if c.tensor == n.name]
        assert [(c.kind, c.phase) for c in own] == [("all_to_all@ep", "forward"), ("all_to_all@ep", "backward")]
        assert all(c.seconds > 0 for c in own)
    report = plan.report()
    assert "Experts (2 MoE layers" in report
    assert "model.layers.1.mlp.experts" in report and "all-to-all over ep" in report


@pytest.mark.parametrize("pin,why", [(("expert_paralel",), "expert_paralel"), (("S(x",), "S(x"),
                                     (("expert_parallel", "R"), "2 entries")])
def test_bad_label_pin_is_a_sharding_error_naming_it(pin, why):
    import autopar
    with pytest.raises(autopar.ShardingError) as e:
        _plan({"moe_experts*": pin})
    assert "moe_experts" in str(e.value) and why in str(e.value), str(e.value)


def test_label_pin_on_a_parameter_is_refused():
    import autopar
    with pytest.raises(autopar.ShardingError, match="gate_up_proj"):
        _plan({"model.layers.0.mlp.experts.gate_up_proj": ("expert_parallel",)})


def test_all_to_all_price():
    """Dispatch + combine: two all-to-alls of the routed rows (the busiest device's share) and one of
    the counts, forward; the two reversed, backward; nothing on one device."""
    from autopar.cost_model import Link
    from autopar.cost_model.comm import collective_time, expert_exchange_times
    link = Link(100e9, 1e-6)
    rows = 64e6
    fwd, bwd = expert_exchange_times(rows, 8, link, imbalance=1.5)
    a2a = 7 / 8 * rows * 1.5 / 100e9 + 7 * 1e-6
    assert bwd == pytest.approx(2 * a2a)
    assert fwd == pytest.approx(2 * a2a + collective_time("all_to_all", 8 * 8 * 8, 8, link))
    assert expert_exchange_times(rows, 1, link) == (0.0, 0.0)
