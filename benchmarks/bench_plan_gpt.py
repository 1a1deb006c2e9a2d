"""Planning time and peak memory of `autopar.plan` for a model built on the meta device.

    python benchmarks/bench_plan_gpt.py [--model gpt|llama] [--layers 24] [--hidden 2048] [--mesh 8,8]

GPT: token+position embedding, LayerNorm, MHA, GELU MLP, tied head (examples/models.py).
Llama: RoPE, RMSNorm, GQA (--kv-heads), SwiGLU (--ffn), untied head.

Prints one JSON line: wall time split into capture / strategies+costs / solve, peak RSS, ILP size,
and the plan's estimate.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))      # this checkout's autopar, not the installed one
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import autopar  # noqa: E402
from models import GPT, Llama  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=51200)
    ap.add_argument("--mesh", default="8,8")
    ap.add_argument("--device", default="h100")
    ap.add_argument("--time-limit", type=float, default=600)
    ap.add_argument("--memory-budget", type=float, default=None,
                    help="bytes per device (default: the profile's capacity; 'inf' for none)")
    a = ap.parse_args(argv)
    shape = tuple(int(s) for s in a.mesh.split(","))
    names = ("dp", "tp", "pp", "sp")[:len(shape)]
    t0 = time.perf_counter()
    with torch.device("meta"):
        if a.model == "gpt":
            model = GPT(vocab=a.vocab, seq=a.seq, hidden=a.hidden, heads=a.heads, layers=a.layers)
        else:
            model = Llama(vocab=a.vocab, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads, ffn=a.ffn,
                          layers=a.layers, seq=a.seq)
        idx = torch.zeros(a.batch, a.seq, dtype=torch.long)
    n_params = sum(p.numel() for p in model.parameters())
    plan = autopar.plan(model, (idx, idx), autopar.Mesh(shape, names, device=a.device), time_limit=a.time_limit,
                        memory_budget=a.memory_budget)
    wall = time.perf_counter() - t0
    out = {"model": f"{a.model} {n_params / 1e9:.2f}B ({a.layers} layers, hidden {a.hidden})", "mesh": shape,
           "device": a.device, "wall_s": round(wall, 2), "solve_s": round(plan.timings.solve_s, 2),
           "plan_s": round(plan.timings.total_s, 2), "scaling_s": round(plan.timings.scaling_s, 2),
           "scaling": plan.scaling.unavailable or "available", "shared_decisions": plan.solver.n_shared,
           "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
           "ilp_variables": plan.solver.n_variables, "ilp_constraints": plan.solver.n_constraints,
           "decisions": plan.solver.n_decisions, "nodes": plan.solver.n_nodes, "status": plan.solver.status,
           "fallbacks": len(plan.fallbacks), "step_time_ms": round(plan.estimate.step_time_s * 1e3, 2),
           "peak_memory_gib": round(plan.estimate.peak_memory_bytes / 2**30, 2),
           "placements_sample": {k: v for k, v in list(plan.placements.items())[2:8]}}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
