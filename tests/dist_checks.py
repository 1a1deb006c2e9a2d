"""Rank functions for the numerics tests: train distributed and single-process, compare.

Each runs on every rank of a pooled gloo job (see rank_pool.py) and returns the worst
relative differences it saw, so the test asserts in the parent.
"""
from __future__ import annotations

import copy
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import autopar  # noqa: E402
from autopar.runtime.reshard import Reshard  # noqa: E402
from models import GPT, MLP, Llama, gpt_inputs  # noqa: E402

STEPS = 2   # the second step runs from the first's optimizer state: the state is compared too
WELL_POSED = 1e-3   # |grad| above this fraction of the tensor's largest: see train_and_compare
ZERO_GRAD = 1e-6    # a gradient below this fraction of the model's largest is zero up to rounding
LR = 1e-3   # a typical AdamW rate; Adam normalises steps, so float reordering differences scale with it


def build_any(name: str):
    """(model, args, kwargs, loss_fn): "zoo:llama" is examples/zoo.py's model ("zoo:llama@1": with one
    layer, the same ops and shapes per layer at half the capture, planning and training), others as `build`."""
    if name.startswith("zoo:"):
        import zoo
        zoo_name, _, layers = name[len("zoo:"):].partition("@")
        return zoo.build(zoo_name, layers=int(layers) if layers else None)
    model, inputs, loss_fn = build(name)
    return model, inputs, {}, loss_fn


def build(name: str):
    torch.manual_seed(0)
    if name == "mlp":
        model = MLP(d_in=16, hidden=32, d_out=8, depth=2)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        return model, (x,), lambda out: (out ** 2).sum()
    if name == "gpt":
        model = GPT(vocab=64, seq=16, hidden=32, heads=4, layers=2)
        return model, gpt_inputs(batch=4, seq=16, vocab=64), lambda out: out
    if name == "gpt-b2":   # a sample per data-parallel rank of a (2, 2) mesh: its loss view keeps the split
        model = GPT(vocab=64, seq=16, hidden=32, heads=4, layers=2)
        return model, gpt_inputs(batch=2, seq=16, vocab=64), lambda out: out
    if name == "gpt-nll":   # its loss as log_softmax + nll_loss; the last position ignored (-100)
        model = GPTNll(vocab=64, seq=16, hidden=32, heads=4, layers=1)
        idx, tgt = gpt_inputs(batch=4, seq=16, vocab=64)
        return model, (idx, tgt.index_fill(1, torch.tensor([15]), -100)), lambda out: out
    if name == "gpt-nll3d":   # log_softmax over the classes of the 3-D logits, then nll_loss on them flattened
        model = GPTNll3d(vocab=64, seq=16, hidden=32, heads=4, layers=1)
        return model, gpt_inputs(batch=4, seq=16, vocab=64), lambda out: out
    if name == "llama":
        model = Llama(vocab=64, hidden=32, heads=4, kv_heads=2, ffn=64, layers=2, seq=16)
        return model, gpt_inputs(batch=4, seq=16, vocab=64), lambda out: out
    raise ValueError(name)


class GPTNll(GPT):
    """The GPT with its loss written as log_softmax and nll_loss (as many classifiers write it)."""

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        logp = torch.nn.functional.log_softmax(logits.view(-1, logits.size(-1)), dim=-1)
        return torch.nn.functional.nll_loss(logp, targets.view(-1))


class GPTNll3d(GPT):
    """The GPT with log_softmax over the last dim of its (batch, seq, vocab) logits, then nll_loss."""

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logp = torch.nn.functional.log_softmax(self.lm_head(self.ln_f(x)), dim=-1)
        return torch.nn.functional.nll_loss(logp.view(-1, logp.size(-1)), targets.view(-1))


def shard_happy_profile():
    """A device whose compute is slow and links free: the solver then splits everything it can,
    so the solver-chosen plans of these small models exercise real sharding, not replication."""
    from dataclasses import replace

    from autopar.cost_model import Link, load_profile
    base = load_profile("cpu")
    free = Link(1e15, 0.0)
    return replace(base, name="test-shard-happy", peak_flops={k: 1e6 for k in base.peak_flops},
                   memory_bandwidth=1e6, intra_node=free, inter_node=free, kernel_overhead=0.0, collective_overhead=0.0)


def well_posed_elements(grad: torch.Tensor) -> torch.Tensor:
    """Elements whose gradient is signal, not float noise. Where the true gradient is zero (the
    attention key bias: softmax ignores it) any run gets rounding noise as gradient, and AdamW
    normalises that noise into a full +-lr step of random sign; parameters are compared elsewhere."""
    return grad.abs() > WELL_POSED * grad.abs().max()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / (b.abs().max() + 1e-12))


def grad_gap(dmodel, ref) -> float:
    """The largest relative gap of a parameter's whole gradient, distributed module against reference."""
    params = dict(dmodel.named_parameters())
    return max(rel(params[n].grad.full_tensor(), p.grad) for n, p in ref.named_parameters())


def param_gap(dmodel, ref) -> float:
    """The largest relative gap of a parameter's whole value, distributed module against reference."""
    params = dict(dmodel.named_parameters())
    return max(rel(params[n].full_tensor(), p) for n, p in ref.named_parameters())


def step_both(*optimizers) -> None:
    for o in optimizers:
        o.step()
        o.zero_grad()


# layout tests fix the memory families to their defaults (their executors have tests of their own)
LAYOUTS_ONLY = dict(recompute="none", offload="none", residency="keep")


def train_and_compare(rank, world_size, name, mesh_shape, axis_names, pins=None, batch_axes=None, capacity=None):
    """capacity: the plan's moe_capacity_factor; the one-process run drops the same token-slots."""
    import contextlib
    model, inputs, kwargs, loss_fn = build_any(name)
    ref = copy.deepcopy(model)
    mesh = autopar.Mesh(mesh_shape, axis_names, device=shard_happy_profile())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    local_inputs, local_kwargs = inputs, kwargs
    if batch_axes:   # this rank's slice of the batch (positional and keyword), as a DistributedSampler would give
        local_inputs = mesh.local_batch(inputs, batch_axes)
        local_kwargs = dict(zip(kwargs, mesh.local_batch(tuple(kwargs.values()), batch_axes)))
    if pins:
        # the saved-plan path: plan once (rank 0, as offline), ship the JSON, apply without solving
        import torch.distributed as dist
        saved = [autopar.plan(model, inputs, mesh, example_kwargs=kwargs, pins=pins, batch_axes=batch_axes,
                              symbolic=False, moe_capacity_factor=capacity, **LAYOUTS_ONLY).to_json()
                 if rank == 0 else None]
        dist.broadcast_object_list(saved, src=0)
        saved = saved[0]
        dmodel = autopar.autoparallelize(model, mesh, inputs, example_kwargs=kwargs,
                                         plan=autopar.Plan.from_json(saved))
    else:
        # priced at its own sizes only: pricing at other batch sizes and sequence lengths (a second trace,
        # most of a small model's planning time) is test_scaling's subject
        dmodel = autopar.autoparallelize(model, mesh, inputs, example_kwargs=kwargs, pins=pins, batch_axes=batch_axes,
                                         moe_capacity_factor=capacity, symbolic=False, **LAYOUTS_ONLY)

    opt = torch.optim.AdamW(dmodel.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    stack = contextlib.ExitStack()      # the reference drops what the plan drops (its own experts modules only)
    dropped = {} if capacity is None else stack.enter_context(autopar.moe_capacity(ref, capacity))
    for step in range(STEPS):
        out = dmodel(*local_inputs, **local_kwargs)
        if batch_axes:
            out = out.full_tensor() if hasattr(out, "full_tensor") else out
        loss = loss_fn(out)
        loss.backward()
        ref_loss = loss_fn(ref(*inputs, **kwargs))
        ref_loss.backward()
        worst["loss"] = max(worst["loss"], rel(loss.detach(), ref_loss.detach()))
        if step == 0:
            params = dict(dmodel.named_parameters())
            well_posed = {}
            scale = max(float(p.grad.abs().max()) for p in ref.parameters())
            for k, p in ref.named_parameters():
                mine = params[k].grad.full_tensor()
                if p.grad.abs().max() <= ZERO_GRAD * scale:
                    # analytically zero (a bias a normalization cancels): both runs hold rounding noise;
                    # measured against the model's gradient scale, and its parameters not compared
                    worst["grad"] = max(worst["grad"], float((mine - p.grad).abs().max()) / scale)
                    well_posed[k] = torch.zeros_like(p.grad, dtype=torch.bool)
                    continue
                worst["grad"] = max(worst["grad"], rel(mine, p.grad))
                well_posed[k] = well_posed_elements(p.grad)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    # the user's model is untouched by training the distributed one
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    params = dict(dmodel.named_parameters())
    for k, p in ref.named_parameters():
        local = params[k].to_local()
        assert local.numel() <= p.numel()
        mask = well_posed[k]
        if mask.any():
            worst["param"] = max(worst["param"], rel(params[k].detach().full_tensor()[mask], p.detach()[mask]))
        worst["ill_posed_elements"] = worst.get("ill_posed_elements", 0) + int((~mask).sum())
    # buffers (position ids, masks, BatchNorm running statistics) as in the single-process run
    buffers = dict(dmodel.named_buffers())
    worst["buffer"] = max([rel(buffers[k], b) if b.is_floating_point() else float(not torch.equal(buffers[k], b))
                           for k, b in ref.named_buffers()], default=0.0)
    worst["n_buffers"] = len(buffers)
    stack.close()
    worst["dropped"] = dict(dropped)
    worst["placements"] = dict(dmodel.plan.placements)
    worst["fallbacks"] = list(dmodel.plan.fallbacks)
    worst["labels"] = sorted({lab for n in dmodel.plan.nodes for lab in n.labels})
    worst["collectives"] = sorted({f"{n.op} {c.kind}" for n in dmodel.plan.nodes for c in n.collectives})
    # how the program's reshard edges run (runtime/reshard.py, local_reshard.py, trim_wrappers.py)
    worst["edges"] = sorted({type(m).__name__ for m in dmodel.graph_module.modules() if isinstance(m, Reshard)})
    worst["sharded_nodes"] = sum(1 for n in dmodel.plan.nodes if n.executor not in ("param", "input", "output")
                                 and any(p != "R" for p in n.output))
    return worst


def compile_and_compare(rank, world_size, name, mesh_shape, axis_names, compiler="inductor"):
    """torch.compile with autopar's backend trains like the single-process model."""
    import torch._dynamo
    torch._dynamo.reset()
    model, inputs, loss_fn = build(name)
    ref = copy.deepcopy(model)
    mesh = autopar.Mesh(mesh_shape, axis_names, device=shard_happy_profile())
    backend = autopar.compile_backend(mesh, compiler=compiler)
    compiled = torch.compile(model, backend=backend, dynamic=False, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(STEPS):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = loss_fn(compiled(*inputs))
        worst.setdefault("fallbacks", []).extend(str(w.message) for w in caught if "eager DTensor" in str(w.message))
        loss.backward()
        ref_loss = loss_fn(ref(*inputs))
        ref_loss.backward()
        worst["loss"] = max(worst["loss"], rel(loss.detach(), ref_loss.detach()))
        if step == 0:
            mine = dict(model.named_parameters())
            for k, p in ref.named_parameters():
                worst["grad"] = max(worst["grad"], rel(mine[k].grad, p.grad))
            well_posed = {k: well_posed_elements(p.grad) for k, p in ref.named_parameters()}
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    mine = dict(model.named_parameters())
    for k, p in ref.named_parameters():
        mask = well_posed[k]
        worst["param"] = max(worst["param"], rel(mine[k].detach()[mask], p.detach()[mask]))
    worst["plans"] = len(backend.plans)
    worst["replicated_params"] = all(set(layout) == {"R"} for plan in backend.plans for layout in plan.placements.values())
    worst["sharded_nodes"] = sum(1 for plan in backend.plans for n in plan.nodes
                                 if n.executor not in ("param", "input", "output") and any(p != "R" for p in n.output))
    return worst
