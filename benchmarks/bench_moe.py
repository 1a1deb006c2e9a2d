"""Expert parallelism (issue 18): Mixtral-8x7B planned on 64 H100, and the experts' three strategies.

    python benchmarks/bench_moe.py [--layers N] [--time-limit S]

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
import json
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import autopar  # noqa: E402
from autopar.report import expert_placement  # noqa: E402
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--only", choices=tuple(CHOICES), default=None)
    a = ap.parse_args(argv)
    for label in ([a.only] if a.only else CHOICES):
        print(json.dumps(one(label, a.layers, a.time_limit)), flush=True)


if __name__ == "__main__":
    main()
