"""Planning real models at full size on the meta device (examples/zoo.py): Llama-2 7B, GPT-2 XL
1.5B, Mixtral 8x7B, T5 3B (and BERT-large, ViT-L), on an (8, 8) H100 mesh by default.

    python benchmarks/bench_models.py [--models llama,gpt2,mixtral,t5] [--mesh 8,8] [--device h100]
                                      [--layers N] [--batch B] [--seq S]

Prints one JSON line per model: planning wall time (capture + strategies + costs + solve), solve
time, graph and ILP size, ops left to the replicate fallback (none expected), the plan's estimate,
peak RSS, and the layouts chosen for a few representative weights.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))      # this checkout's autopar, not the installed one
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import autopar  # noqa: E402
from zoo import FULL, build  # noqa: E402

DEFAULT = ("llama", "gpt2", "mixtral", "t5")
_SAMPLE = (".0.", "layers.0.", "h.0.", "block.0.", "layer.0.")


def bench(name: str, mesh_shape, device: str, layers=None, batch=None, seq=None, time_limit=600.0) -> dict:
    t0 = time.perf_counter()
    model, args, kwargs, _ = build(name, full=True, layers=layers, batch=batch, seq=seq)
    n_params = sum(p.numel() for p in model.parameters())
    names = ("dp", "tp", "pp", "sp")[:len(mesh_shape)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, args, autopar.Mesh(mesh_shape, names, device=device), example_kwargs=kwargs,
                            time_limit=time_limit)
    wall = time.perf_counter() - t0
    shapes = {k: list(v.shape) for k, v in kwargs.items()}
    sample = {k: v for k, v in plan.placements.items() if any(s in k for s in _SAMPLE) and k.endswith("weight")
              or "experts" in k and ".0." in k}
    return {"model": f"{FULL[name]} ({n_params / 1e9:.2f}B params, {layers or 'all'} layers)", "inputs": shapes,
            "mesh": list(mesh_shape), "device": device, "wall_s": round(wall, 1),
            "plan_s": round(plan.timings.total_s, 1), "solve_s": round(plan.timings.solve_s, 1),
            "nodes": plan.solver.n_nodes, "decisions": plan.solver.n_decisions,
            "ilp_variables": plan.solver.n_variables, "status": plan.solver.status, "fallbacks": plan.fallbacks,
            "step_time_ms": round(plan.estimate.step_time_s * 1e3, 1),
            "peak_memory_gib": round(plan.estimate.peak_memory_bytes / 2**30, 2),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "placements_sample": dict(list(sample.items())[:8])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(DEFAULT))
    ap.add_argument("--mesh", default="8,8")
    ap.add_argument("--device", default="h100")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--time-limit", type=float, default=600)
    a = ap.parse_args(argv)
    shape = tuple(int(s) for s in a.mesh.split(","))
    rc = 0
    for name in a.models.split(","):
        out = bench(name, shape, a.device, a.layers, a.batch, a.seq, a.time_limit)
        print(json.dumps(out), flush=True)
        rc |= bool(out["fallbacks"])
    return rc


if __name__ == "__main__":
    sys.exit(main())
