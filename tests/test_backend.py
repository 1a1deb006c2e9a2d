"""autopar under torch.compile: `compile_backend` (replicated parameters) and `autopar.compile` (sharded),
their per-rank programs traced into one graph of plain tensors and functional collectives and compiled.

Most checks trace with compiler="aot_eager" (the per-rank graph inductor would get, run op by op):
inductor's code generation costs tens of seconds per graph on 2 cores; one check runs it."""
from __future__ import annotations

import pytest

from dist_checks import compile_and_compare


@pytest.mark.parametrize("name,shape,axes", [("mlp", (2, 2), ("dp", "tp")), ("gpt", (4,), ("dp",))])
def test_compiled_model_matches_single_process(rank_pool, name, shape, axes):
    results = rank_pool(4).run(compile_and_compare, name, shape, axes, "aot_eager")
    r = results[0]
    assert r["plans"] == 1, r                 # one graph, planned once, reused for every step
    assert r["sharded_nodes"] > 0, r
    assert r["replicated_params"], r          # the backend's contract: the user's whole parameters
    for key in ("loss", "grad", "param"):
        assert max(x[key] for x in results) < 1e-5, (key, r)


def _per_rank_graph(rank, world_size, batch_axes):
    """The backend's per-rank graph of a small GPT on a (2,) data-parallel mesh: plain ATen ops and
    functional collectives (no DTensor), the gradients all-reduced inside it; trained against one process
    with each rank fed the whole batch, or (batch_axes) its half."""
    import copy

    import torch
    import torch._dynamo

    import autopar
    from dist_checks import build, rel
    torch._dynamo.reset()
    model, (idx, tgt), _ = build("gpt")
    ref = copy.deepcopy(model)
    seen = []

    def inspect(gm, example_inputs):      # the joint graph aot_autograd hands its compilers
        seen.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm

    from torch._dynamo.backends.common import aot_autograd
    from autopar import compiled
    real = compiled.compat.compile_graph
    compiled.compat.compile_graph = lambda gm, inputs, c: aot_autograd(fw_compiler=inspect, bw_compiler=inspect)(
        gm, inputs)
    try:
        backend = autopar.compile_backend(autopar.Mesh((2,), ("dp",)), batch_axes=batch_axes)
        step = torch.compile(model, backend=backend, dynamic=bool(batch_axes), fullgraph=True)
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        mine = (idx.chunk(2)[rank], tgt.chunk(2)[rank]) if batch_axes else (idx, tgt)
        worst = {"loss": 0.0, "grad": 0.0}
        for _ in range(2):
            loss, expect = step(*mine), ref(idx, tgt)
            loss.backward(), expect.backward()
            worst["loss"] = max(worst["loss"], rel(loss.detach(), expect.detach()))
            params = dict(model.named_parameters())
            worst["grad"] = max([worst["grad"]] + [rel(params[k].grad, p.grad) for k, p in ref.named_parameters()])
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    finally:
        compiled.compat.compile_graph = real
    params = dict(model.named_parameters())
    worst["param"] = max(rel(params[k].detach(), p.detach()) for k, p in ref.named_parameters())
    worst["forward_ops"], worst["backward_ops"] = seen
    return worst


@pytest.mark.parametrize("batch_axes", [None, ("dp",)])
def test_backend_graph_is_plain_ops_and_functional_collectives(rank_pool, batch_axes):
    for r in rank_pool(2).run(_per_rank_graph, batch_axes):
        for key in ("loss", "grad", "param"):
            assert r[key] < 1e-5, (key, r)
        ops = r["forward_ops"] | r["backward_ops"]
        assert all(op.startswith(("aten.", "_c10d_functional.", "<built-in function getitem>")) for op in ops), ops
        assert "_c10d_functional.all_reduce.default" in r["backward_ops"]       # the gradients' all-reduce
        assert "_c10d_functional.all_gather_into_tensor.default" not in ops     # no parameter gathered


def _tensor_parallel(rank, world_size, compiler):
    """`autopar.compile` on a (2, 2) mesh with Megatron layouts pinned over "tp": each rank stores its
    shards, its gradients come back as shards, and training matches one process."""
    import copy

    import torch
    from torch.distributed.tensor import DTensor

    import autopar
    from dist_checks import build, rel, shard_happy_profile
    model, (idx, tgt), _ = build("gpt")
    ref = copy.deepcopy(model)
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device=shard_happy_profile())
    pins = {"blocks.*.attn.qkv.weight": ("R", "S(0)"), "blocks.*.mlp.0.weight": ("R", "S(0)"),
            "blocks.*.attn.proj.weight": ("R", "S(1)"), "blocks.*.mlp.2.weight": ("R", "S(1)")}
    dmodel = autopar.compile(model, mesh, (idx, tgt), compiler=compiler, pins=pins, batch_axes=("dp",))
    opt, ref_opt = torch.optim.SGD(dmodel.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    mine = (idx.chunk(2)[rank // 2], tgt.chunk(2)[rank // 2])
    worst = {"loss": 0.0, "grad": 0.0}
    for _ in range(2):
        loss, expect = dmodel(*mine), ref(idx, tgt)
        loss.backward(), expect.backward()
        worst["loss"] = max(worst["loss"], rel(loss.detach(), expect.detach()))
        params = dict(dmodel.named_parameters())
        worst["grad"] = max([worst["grad"]] + [rel(params[k].grad.full_tensor(), p.grad)
                                               for k, p in ref.named_parameters()])
        worst["grad_layouts_match"] = all(isinstance(p.grad, DTensor) and p.grad.placements == p.placements
                                          and p.grad.to_local().shape == p.to_local().shape
                                          for p in dmodel.parameters())
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    params = dict(dmodel.named_parameters())
    worst["param"] = max(rel(params[k].full_tensor(), p.detach()) for k, p in ref.named_parameters())
    local = sum(p.to_local().numel() * p.element_size() for p in dmodel.parameters())
    worst["param_bytes"], worst["whole_bytes"] = local, sum(p.numel() * p.element_size() for p in ref.parameters())
    worst["planned_bytes"] = dmodel.plan.estimate.param_bytes if hasattr(dmodel.plan.estimate, "param_bytes") else None
    return worst


@pytest.mark.parametrize("compiler", ["aot_eager"])
def test_compile_stores_shards_and_trains_exactly(rank_pool, compiler):
    for r in rank_pool(4).run(_tensor_parallel, compiler):
        for key in ("loss", "grad", "param"):
            assert r[key] < 1e-5, (key, r)
        assert r["grad_layouts_match"], r
        assert r["param_bytes"] < r["whole_bytes"], r
