"""Tensor parallelism inside the experts (issue 18, "expert_tp"): every expert's gate/up split by
columns and down by rows over one mesh axis, outputs partial sums; Hugging Face's fused gate_up
shard traded into Megatron's gate/up pairing by one all-to-all (runtime/experts.py). Composes with
expert_parallel and data parallelism on the other axes of an N-D mesh; trains like one process."""
from __future__ import annotations

import warnings

import pytest

import autopar
from dist_checks import train_and_compare

# (model, mesh, strategy of the experts op per axis, batch axes): EP x TP; DP x TP (Qwen2-MoE: shared
# expert and auxiliary loss beside it)
CASES = [("mixtral", (2, 2), ("ep", "tp"), ("expert_parallel", "expert_tp"), ("ep",)),
         ("qwen2_moe", (2, 2), ("dp", "tp"), ("tokens", "expert_tp"), ("dp",))]


@pytest.mark.parametrize("name,shape,axes,pin,batch", CASES, ids=[f"{c[0]}-{'-'.join(c[3])}" for c in CASES])
def test_expert_tp_trains_like_one_process(rank_pool, name, shape, axes, pin, batch):
    results = rank_pool(4).run(train_and_compare, f"zoo:{name}", shape, axes, {"moe_experts*": pin}, batch,
                               timeout=300)
    r = results[0]
    for key in ("loss", "grad", "param"):
        assert max(x[key] for x in results) < 1e-4, (key, {k: r[k] for k in ("loss", "grad", "param")})
    assert "expert_tp" in r["labels"] and "autopar.moe_experts all_to_all@tp" in r["collectives"], r
    experts = {k: v for k, v in r["placements"].items() if ".experts." in k}
    assert experts and all(v[axes.index("tp")] != "R" for v in experts.values()), experts


def _plan(pin, shape=(2, 2), names=("ep", "tp")):
    from zoo import build
    model, args, kwargs, _ = build("mixtral", layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, args, autopar.Mesh(shape, names, device="h100"), example_kwargs=kwargs,
                            pins={"moe_experts*": pin}, batch_axes=names[:1], symbolic=False)


def test_expert_tp_is_planned_priced_and_reported():
    from autopar.cost_model.comm import expert_tp_exchange_times
    plan = _plan(("expert_parallel", "expert_tp"))
    mesh = autopar.Mesh((2, 2), ("ep", "tp"), device="h100")
    (n,) = [n for n in plan.nodes if n.op == "autopar.moe_experts"]
    assert n.inputs[3] == ("S(0)", "S(1)") and n.inputs[4] == ("S(0)", "S(2)") and n.output == ("S(0)", "P")
    own = {(c.kind, c.phase): c.seconds for c in n.collectives if c.tensor == n.name}
    assert set(own) == {(f"all_to_all@{a}", p) for a in ("ep", "tp") for p in ("forward", "backward")}
    shard = 4 * 128 * 32 * 4 / 4        # gate/up: 4 experts of [2 x 64, 32] float32 over ep and tp
    fwd, bwd = expert_tp_exchange_times(shard, 2, mesh.links[1], mesh.profile.kernel_overhead
                                        + mesh.profile.collective_overhead)
    assert own[("all_to_all@tp", "forward")] == pytest.approx(fwd) and fwd > 0
    assert own[("all_to_all@tp", "backward")] == pytest.approx(bwd)
    report = plan.report()
    assert "matrices split over tp" in report and "all-to-all over ep" in report


def test_strategies_on_an_nd_mesh_take_expert_tp_on_any_one_axis():
    import torch

    from autopar.passes.shape_prop import TensorMeta
    from autopar.strategies import rule_for
    from autopar.strategies.strategy import axis_options, node_strategies
    f32, i64 = torch.float32, torch.int64
    ins = [TensorMeta((64, 32), f32), TensorMeta((64, 2), i64), TensorMeta((64, 2), f32),
           TensorMeta((8, 128, 32), f32), TensorMeta((8, 32, 64), f32)]
    outs = [TensorMeta((64, 32), f32)]
    rule = rule_for(torch.ops.autopar.moe_experts.default)
    for shape in ((2, 2, 2), (2, 2, 2, 2)):
        labels = {s.labels for s in node_strategies(axis_options(rule, None, ins, outs), ins, outs, shape, rule)}
        assert all(sum(lab == "expert_tp" for lab in ls) <= 1 for ls in labels)
        for axis in range(len(shape)):       # on every axis, beside expert_parallel on every other
            for ep in set(range(len(shape))) - {axis}:
                assert any(ls[axis] == "expert_tp" and ls[ep] == "expert_parallel" for ls in labels), (shape, axis)


def test_expert_tp_takes_one_axis():
    with pytest.raises(autopar.ShardingError, match="moe_experts"):
        _plan(("expert_tp", "expert_tp"))
