"""Memory decisions at the sizes users train (issue 11), planned on the meta device.

    python benchmarks/bench_memory_plans.py [--only llama|offload] [--time-limit S]

1. Hugging Face Llama-3-8B (LlamaForCausalLM from its config: 32 layers, hidden 4096, 8 KV heads,
   vocabulary 128,256; bf16, AdamW) on one node of 8 H100, `Mesh((8,), ("dp",))`, global batch
   8 x 8192: the plan, its memory decisions, predicted tokens/s per GPU, and the same with each
   memory family forbidden (`recompute="none"`, `residency="keep"`) to show what made it fit.
2. One H100 with its host memory: the largest GPT (hidden 4096, 32 heads, sequence 2048, batch 1,
   bf16, AdamW; layers searched by bisection) that plans with `offload="none"` and with
   `offload="auto"`, and the ratio of their parameter counts.
One JSON line per result.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))      # this checkout's autopar, not the installed one
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import autopar  # noqa: E402
from models import GPT  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)


def _summary(plan) -> dict:
    def count(d):
        out: dict[str, int] = {}
        for v in d.values():
            out[v] = out.get(v, 0) + 1
        return out
    return {"recompute": count(plan.recompute), "residency": count(plan.residency), "offload": count(plan.offload),
            "placements_sample": {k: v for k, v in plan.placements.items() if ".layers.1." in k}}


def llama3_8b(time_limit: float) -> None:
    import transformers
    cfg = transformers.LlamaConfig(**LLAMA3_8B)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        ids = torch.zeros(8, 8192, dtype=torch.long)
    mesh = autopar.Mesh((8,), ("dp",), device="h100")
    tokens = ids.numel()
    for label, kw in (("auto", {}), ("recompute=none", {"recompute": "none"}),
                      ("residency=keep", {"residency": "keep"})):
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = autopar.plan(model, (ids,), mesh, example_kwargs={"labels": ids}, batch_axes=("dp",),
                                    time_limit=time_limit, symbolic=False, **kw)
        except autopar.InfeasibleError as e:
            print(json.dumps({"bench": "llama3-8b 8xH100 8x8192", "families": label, "feasible": False,
                              "min_memory_gib": round(e.min_memory_bytes / 2**30, 1), "error": str(e)[:300]}))
            continue
        est = plan.estimate
        print(json.dumps({
            "bench": "llama3-8b 8xH100 8x8192", "families": label, "feasible": True,
            "plan_s": round(time.perf_counter() - t0, 1),
            "step_time_s": round(est.step_time_s, 3), "tokens_per_s_per_gpu": round(tokens / est.step_time_s / 8),
            "peak_memory_gib": round(est.peak_memory_bytes / 2**30, 1),
            "state_gib": round(est.param_state_bytes / 2**30, 1), "family_s": est.family_s,
            "freed_gib": {k: round(v / 2**30, 1) for k, v in est.freed_bytes.items()},
            "tier_gib": {k: round(v / 2**30, 1) for k, v in est.tier_bytes.items()}, **_summary(plan)}))


def _gpt_fits(layers: int, offload: str, time_limit: float):
    with torch.device("meta"):
        model = GPT(vocab=51200, seq=2048, hidden=4096, heads=32, layers=layers).to(torch.bfloat16)
        idx = torch.zeros(1, 2048, dtype=torch.long)
    params = sum(p.numel() for p in model.parameters())
    try:
        plan = autopar.plan(model, (idx, idx), autopar.Mesh((1,), ("dp",), device="h100"), offload=offload,
                            time_limit=time_limit, symbolic=False)
    except autopar.InfeasibleError:
        return params, None
    return params, plan


def largest(offload: str, time_limit: float, hi: int) -> tuple[int, int, object]:
    """The most layers that plan (bisection; planning is monotone in depth)."""
    lo, best = 0, (0, 0, None)
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        params, plan = _gpt_fits(mid, offload, time_limit)
        if plan is None:
            hi = mid
        else:
            lo, best = mid, (mid, params, plan)
    return best


def offload_sizes(time_limit: float) -> None:
    t0 = time.perf_counter()
    n0, p0, plan0 = largest("none", time_limit, hi=64)
    n1, p1, plan1 = largest("auto", time_limit, hi=256)
    _, _, none_at_big = (n1, *_gpt_fits(n1, "none", time_limit))
    print(json.dumps({
        "bench": "one H100 + host memory: largest GPT (hidden 4096, seq 2048, batch 1, bf16, AdamW)",
        "without_offload": {"layers": n0, "params_b": round(p0 / 1e9, 2),
                            "peak_gib": round(plan0.estimate.peak_memory_bytes / 2**30, 1), **_summary(plan0)},
        "with_offload": {"layers": n1, "params_b": round(p1 / 1e9, 2),
                         "peak_gib": round(plan1.estimate.peak_memory_bytes / 2**30, 1),
                         "host_gib": round(plan1.estimate.tier_bytes.get("host", 0) / 2**30, 1),
                         "step_time_s": round(plan1.estimate.step_time_s, 2), **_summary(plan1)},
        "ratio": round(p1 / p0, 2), "offload_none_at_largest_feasible": none_at_big is not None,
        "wall_s": round(time.perf_counter() - t0, 1)}))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=("llama", "offload"), default=None)
    ap.add_argument("--time-limit", type=float, default=120.0)
    a = ap.parse_args(argv)
    if a.only in (None, "llama"):
        llama3_8b(a.time_limit)
    if a.only in (None, "offload"):
        offload_sizes(a.time_limit)


if __name__ == "__main__":
    main()
