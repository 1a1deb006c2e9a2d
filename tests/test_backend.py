"""autopar under torch.compile: `compile_backend` (replicated parameters) and `autopar.compile` (sharded),
their per-rank programs traced into one graph of plain tensors and functional collectives and compiled.

Most checks trace with compiler="aot_eager" (the per-rank graph inductor would get, run op by op):
inductor's code generation costs tens of seconds per graph on 2 cores; one check runs it."""
from __future__ import annotations

import math

import pytest

from dist_checks import compile_and_compare


@pytest.mark.parametrize("name,shape,axes,compiler", [("mlp", (2, 2), ("dp", "tp"), "aot_eager"),
                                                       ("gpt", (2,), ("dp",), "aot_eager"),
                                                       ("mlp", (2,), ("dp",), "inductor")])
def test_compiled_model_matches_single_process(rank_pool, name, shape, axes, compiler):
    results = rank_pool(math.prod(shape)).run(compile_and_compare, name, shape, axes, compiler, timeout=300)
    r = results[0]
    assert r["plans"] == 1, r                 # one graph, planned once, reused for every step
    assert r["sharded_nodes"] > 0, r
    assert r["replicated_params"], r          # the backend's contract: the user's whole parameters
    assert not r["fallbacks"], r              # compiled, not the eager program
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
    compiler = aot_autograd(fw_compiler=inspect, bw_compiler=inspect)
    backend = autopar.compile_backend(autopar.Mesh((2,), ("dp",)), compiler=compiler, batch_axes=batch_axes)
    # with batch_axes the batch size must stay symbolic in Dynamo's graph, to be planned at the global batch
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
    params = dict(model.named_parameters())
    worst["param"] = max(rel(params[k].detach(), p.detach()) for k, p in ref.named_parameters())
    worst["forward_ops"], worst["backward_ops"] = seen
    return worst


@pytest.mark.parametrize("batch_axes", [("dp",)])   # the whole batch in: compile_and_compare above
def test_backend_graph_is_plain_ops_and_functional_collectives(rank_pool, batch_axes):
    for r in rank_pool(2).run(_per_rank_graph, batch_axes, timeout=300):
        for key in ("loss", "grad", "param"):
            assert r[key] < 1e-5, (key, r)
        ops = r["forward_ops"] | r["backward_ops"]
        assert all(op.startswith(("aten.", "_c10d_functional.", "<built-in function getitem>")) for op in ops), ops
        assert "_c10d_functional.all_reduce.default" in r["backward_ops"]       # the gradients' all-reduce
        assert not any("all_gather" in op for op in r["backward_ops"])          # no gradient gathered


def _tensor_parallel(rank, world_size, compiler):
    """`autopar.compile` on a (2, 2) mesh with Megatron layouts pinned over "tp": each rank stores its
    shards, its gradients come back as shards, and training matches one process."""
    import copy
    import math

    import torch
    from torch.distributed.tensor import DTensor

    import autopar
    from autopar.placement import local_shape, parse_layout
    from dist_checks import rel, shard_happy_profile
    from models import GPT, gpt_inputs
    torch.manual_seed(0)
    model, (idx, tgt) = GPT(vocab=64, seq=16, hidden=32, heads=4, layers=1), gpt_inputs(batch=4, seq=16, vocab=64)
    ref = copy.deepcopy(model)     # one block: the pinned MLP's layouts are per block
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device=shard_happy_profile())
    pins = {"blocks.*.fc.weight": ("R", "S(0)"), "blocks.*.fc2.weight": ("R", "S(1)")}   # Megatron's MLP
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
        worst["grad_bytes_seen"] = sum(p.grad.to_local().numel() * p.grad.element_size() for p in dmodel.parameters())
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    params = dict(dmodel.named_parameters())
    worst["param"] = max(rel(params[k].full_tensor(), p.detach()) for k, p in ref.named_parameters())
    # bytes per rank: what the plan's layouts give each parameter, against what this rank holds
    mesh_shape = dmodel.plan.mesh["shape"]
    planned = sum(math.prod(local_shape(p.shape, parse_layout(dmodel.plan.placements[k]), mesh_shape)) * 4
                  for k, p in ref.named_parameters())
    worst["planned_bytes"] = planned
    worst["param_bytes"] = sum(p.to_local().numel() * p.element_size() for p in dmodel.parameters())
    worst["grad_bytes"] = worst.pop("grad_bytes_seen")
    worst["whole_bytes"] = sum(p.numel() * p.element_size() for p in ref.parameters())
    return worst


@pytest.mark.parametrize("compiler", ["aot_eager"])
def test_compile_stores_shards_and_trains_exactly(rank_pool, compiler):
    for r in rank_pool(4).run(_tensor_parallel, compiler, timeout=300):
        for key in ("loss", "grad", "param"):
            assert r[key] < 1e-5, (key, r)
        assert r["grad_layouts_match"], r
        assert r["param_bytes"] == r["grad_bytes"] == r["planned_bytes"] < r["whole_bytes"], r


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
    model, args, kwargs, loss_fn = zoo.build(name, layers=1)    # one layer: the same ops per layer
    assert model.config.use_cache
    ref = copy.deepcopy(model)
    backend = autopar.compile_backend(autopar.Mesh((2,), ("tp",), device=shard_happy_profile()), compiler="aot_eager")
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


def test_backend_refuses_what_its_program_would_not_run():
    """Errors before any collective: a memory decision the compiled program does not execute, a pin
    sharding a parameter the user's optimizer steps whole, an unknown compiler."""
    import torch
    import torch._dynamo

    import autopar
    from autopar.errors import PlanOptionError
    from dist_checks import build
    mesh = autopar.Mesh((2,), ("dp",))
    with pytest.raises(PlanOptionError, match="recompute='full'.*autoparallelize"):
        autopar.compile_backend(mesh, recompute="full")
    with pytest.raises(PlanOptionError, match="compiler='tvm'"):
        autopar.compile_backend(mesh, compiler="tvm")
    torch._dynamo.reset()
    model, inputs, _ = build("mlp")
    step = torch.compile(model, backend=autopar.compile_backend(mesh, pins={"*": ("S(0)",)}), dynamic=False)
    with pytest.raises(Exception, match="shards a parameter.*autopar.compile"):
        step(*inputs)
