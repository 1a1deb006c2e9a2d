"""Expert parallelism (issue 18): Mixtral-8x7B planned on 64 H100, and the experts' three strategies;
the FLOPs expert parallelism executes against one process (issue 35).

    python benchmarks/bench_moe.py [--layers N] [--time-limit S]
    python benchmarks/bench_moe.py --flops

`--flops`: a Qwen3-MoE-style model (Hugging Face Qwen3MoeForCausalLM, 2 layers, hidden 64, 8 experts of
32, top-2, batch 8 x 32) trained one step on 2 gloo ranks, its experts op pinned to expert_parallel and
the batch split over both ranks, against the same model in one process (transformers' own experts,
grouped_mm). torch.utils.flop_counter.FlopCounterMode counts each rank's forward+backward (matmuls,
attention and grouped_mm: autopar registers grouped_mm's count, torch has none) and the one process's;
the row gives each rank's FLOPs, their sum and twice the busiest rank's over the one process's, and
how far loss, gradients and parameters after one SGD step are from one process's. On a GPU one would
time instead: the experts op at size (bf16, e.g. Qwen3-30B-A3B's 128 experts of 768, top-8) against one
grouped_mm of the same routed tokens over the same experts without the sort, gather and scatter.

Hugging Face Mixtral-8x7B (MixtralForCausalLM from its published config: 32 layers, hidden 4096,
8 experts of 14336, top-2, vocabulary 32,000; bf16, AdamW) at global batch 64 x 4096 on
`Mesh((8, 8), ("dp", "ep"), device="h100")`, inputs split on the batch over both axes, planned on
the meta device. Four plans: the solver's own choice, then the experts op pinned to each of its
strategies on "ep" (tokens split over "dp" in all three): expert_parallel (all-to-all dispatch),
experts (every token on every device of the axis, outputs summed) and tokens (every expert on every
device). A fifth on the same 64 GPUs as `Mesh((8, 4, 2), ("dp", "ep", "tp"))` (ep x tp: one node
of 8): expert_parallel on "ep" and tensor parallelism inside every expert on "tp" (expert_tp),
inputs split over dp and ep. A sixth: expert_parallel on (dp=8, ep=8) with `moe_capacity_factor=1.0`
(slots past capacity dropped; priced at the capped load, below the profile's imbalance of 1.2).
One JSON line per plan: predicted step time, tokens/s per GPU, peak memory, the experts' strategy
per axis and the all-to-all axes, planning time.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import autopar  # noqa: E402
from autopar.views.report import expert_placement  # noqa: E402
from zoo import build  # noqa: E402

BATCH, SEQ = 64, 4096
DP_EP = ((8, 8), ("dp", "ep"))
# label -> (the experts op's strategy per axis or None: the solver's choice, mesh shape and axis names,
# moe_capacity_factor)
CHOICES = {"solver": (None, *DP_EP, None), "expert_parallel": (("tokens", "expert_parallel"), *DP_EP, None),
           "experts": (("tokens", "experts"), *DP_EP, None), "tokens": (("tokens", "tokens"), *DP_EP, None),
           "expert_parallel+expert_tp": (("tokens", "expert_parallel", "expert_tp"), (8, 4, 2), ("dp", "ep", "tp"),
                                         None),
           "expert_parallel capacity 1.0": (("tokens", "expert_parallel"), *DP_EP, 1.0)}


def one(label: str, layers: int, time_limit: float) -> dict:
    model, args, kwargs, _ = build("mixtral", full=True, layers=layers, batch=BATCH, seq=SEQ)
    model = model.to(torch.bfloat16)
    strategy, shape, names, capacity = CHOICES[label]
    mesh = autopar.Mesh(shape, axis_names=names, device="h100")
    pins = {"moe_experts*": strategy} if strategy else None
    t0 = time.perf_counter()
    where = ", ".join(f"{a}={n}" for a, n in zip(names, shape))
    row = {"bench": f"mixtral-8x7b ({layers} layers) bf16 AdamW {BATCH}x{SEQ} on ({where}) H100", "experts": label}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = autopar.plan(model, args, mesh, example_kwargs=kwargs, batch_axes=names[:2], pins=pins,
                                symbolic=False, time_limit=time_limit, moe_capacity_factor=capacity)
    except autopar.InfeasibleError as e:
        return {**row, "feasible": False, "min_memory_gib": round(e.min_memory_bytes / 2**30, 1),
                "plan_s": round(time.perf_counter() - t0, 1)}
    est = plan.estimate
    layer = next(iter(expert_placement(plan).values()))
    a2a = sorted({c.kind for n in plan.nodes if n.op == "autopar.moe_experts" for c in n.collectives
                  if c.tensor == n.name})      # the op's own dispatch/combine, not reshards on its way in
    return {**row, "feasible": True, "plan_s": round(time.perf_counter() - t0, 1),
            "step_time_s": round(est.step_time_s, 3), "tokens_per_s_per_gpu": round(BATCH * SEQ / est.step_time_s / 64),
            "compute_s": round(est.compute_s, 3), "comm_s": round(est.comm_s, 3),
            "peak_memory_gib": round(est.peak_memory_bytes / 2**30, 1), "family_s": est.family_s,
            "experts_strategy": layer["strategy"], "all_to_all": a2a, "experts_stored": layer["stored"],
            "solver": f"{plan.solver.solver} {plan.solver.status} gap {plan.solver.gap:.3g}",
            "solve_s": round(plan.timings.solve_s, 1)}


# Qwen3-MoE at small width: every layer sparse, 8 experts, top-2, the top-k weights renormalised
QWEN3_MOE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                 num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
FLOPS_BATCH, FLOPS_SEQ, FLOPS_RANKS, SGD_LR = 8, 32, 2, 0.1


def qwen3_moe():
    import transformers as T
    torch.manual_seed(0)
    model = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**QWEN3_MOE)).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, QWEN3_MOE["vocab_size"], (FLOPS_BATCH, FLOPS_SEQ), generator=g)
    return model, {"input_ids": ids, "labels": ids}


def counted(step):
    """(step's result, FLOPs it executed, FLOPs per ATen op)."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as fc:
        out = step()
    return out, fc.get_total_flops(), {str(k): v for k, v in fc.get_flop_counts().get("Global", {}).items()}


def flops_rank(rank, world_size):
    """One SGD step of the Qwen3-MoE-style model, expert parallel over this job's ranks, and in one process."""
    from dist_checks import rel
    model, kwargs = qwen3_moe()
    ref = copy.deepcopy(model)
    mesh = autopar.Mesh((world_size,), ("ep",), device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dmodel = autopar.autoparallelize(model, mesh, (), example_kwargs=kwargs,
                                         pins={"moe_experts*": ("expert_parallel",)}, batch_axes=("ep",),
                                         symbolic=False, recompute="none", offload="none", residency="keep")
    local = dict(zip(kwargs, mesh.local_batch(tuple(kwargs.values()), ("ep",))))

    def step():
        loss = dmodel(**local).loss
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        loss.backward()
        return loss.detach()

    def ref_step():
        loss = ref(**kwargs).loss
        loss.backward()
        return loss.detach()
    loss, flops, by_op = counted(step)
    ref_loss, ref_flops, ref_by_op = counted(ref_step)
    params = dict(dmodel.named_parameters())
    grad = max(rel(params[k].grad.full_tensor(), p.grad) for k, p in ref.named_parameters())
    for opt in (torch.optim.SGD(dmodel.parameters(), lr=SGD_LR), torch.optim.SGD(ref.parameters(), lr=SGD_LR)):
        opt.step()
    param = max(rel(params[k].detach().full_tensor(), p.detach()) for k, p in ref.named_parameters())
    labels = sorted({lab for n in dmodel.plan.nodes if n.op == "autopar.moe_experts" for lab in n.labels})
    return {"flops": flops, "by_op": by_op, "ref_flops": ref_flops, "ref_by_op": ref_by_op, "labels": labels,
            "loss": rel(loss, ref_loss), "grad": grad, "param": param}


def flops_row() -> dict:
    from rank_pool import get_pool, shutdown_all
    try:
        results = get_pool(FLOPS_RANKS).run(flops_rank, timeout=600)
    finally:
        shutdown_all()
    ref = results[0]["ref_flops"]
    per_rank = [r["flops"] for r in results]
    return {"bench": f"qwen3-moe-style (8 experts, top-2) {FLOPS_BATCH}x{FLOPS_SEQ} expert_parallel on "
                     f"{FLOPS_RANKS} CPU ranks vs one process", "experts": results[0]["labels"],
            "one_process_flops": ref, "per_rank_flops": per_rank, "sum_over_one_process": round(sum(per_rank) / ref, 4),
            "busiest_x_ranks_over_one_process": round(FLOPS_RANKS * max(per_rank) / ref, 4),
            "rank_flops_by_op": [r["by_op"] for r in results], "one_process_flops_by_op": results[0]["ref_by_op"],
            "loss_rel": max(r["loss"] for r in results), "grad_rel": max(r["grad"] for r in results),
            "param_rel_after_sgd": max(r["param"] for r in results)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--only", choices=tuple(CHOICES), default=None)
    ap.add_argument("--flops", action="store_true", help="expert parallelism's executed FLOPs against one process")
    a = ap.parse_args(argv)
    if a.flops:
        print(json.dumps(flops_row()), flush=True)
        return
    for label in ([a.only] if a.only else CHOICES):
        print(json.dumps(one(label, a.layers, a.time_limit)), flush=True)


if __name__ == "__main__":
    main()
