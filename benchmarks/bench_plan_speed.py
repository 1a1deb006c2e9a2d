"""Planning time per phase on the models users plan (issue 14), built on the meta device.

    python benchmarks/bench_plan_speed.py --model llama3-8b|gpt3-175b [--time-limit S] [--no-symbolic]

* llama3-8b: Hugging Face LlamaForCausalLM from the Llama-3-8B config (32 layers, hidden 4096,
  ffn 14336, 32 heads, 8 KV heads, vocabulary 128,256), bf16, batch 64 x 4096,
  `Mesh((8, 8), ("dp", "tp"), "h100")`; target: 5 s end to end, symbolic scaling included.
* gpt3-175b: GPT-3 175B (96 layers, hidden 12288, 96 heads; examples/models.py), bf16, global
  batch 1,536 x 2048 on `Mesh((16, 8, 8), ("dp", "pp", "tp"), "h100")`, without pipeline
  decisions (issue 12); target (with them): 30 s and 4 GiB RSS.
Memory families are on ("auto"). Prints one JSON line: wall seconds per phase (capture,
strategies, solve, scaling: the planner's `on_phase` marks), end to end, peak RSS, ILP size,
solver status and the plan's step time.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import autopar  # noqa: E402
from autopar.planner import PlanOptions, make_plan  # noqa: E402
from models import GPT  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)


def llama3_8b():
    import transformers
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA3_8B)).to(torch.bfloat16)
        ids = torch.zeros(64, 4096, dtype=torch.long)
    return model, (ids,), {"labels": ids}, autopar.Mesh((8, 8), ("dp", "tp"), device="h100")


def gpt3_175b():
    with torch.device("meta"):
        model = GPT(vocab=51200, seq=2048, hidden=12288, heads=96, layers=96).to(torch.bfloat16)
        idx = torch.zeros(1536, 2048, dtype=torch.long)
    return model, (idx, idx), {}, autopar.Mesh((16, 8, 8), ("dp", "pp", "tp"), device="h100")


MODELS = {"llama3-8b": llama3_8b, "gpt3-175b": gpt3_175b}


class Phases:
    """The planner's `on_phase` callback: wall seconds of each phase."""

    def __init__(self):
        self.t, self.name, self.seconds = time.perf_counter(), None, {}

    def __call__(self, name: str, note: str = "") -> None:
        now = time.perf_counter()
        if self.name is not None:
            self.seconds[self.name] = round(now - self.t, 2)
        self.t, self.name = now, name


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--no-symbolic", action="store_true")
    a = ap.parse_args(argv)
    model, args, kwargs, mesh = MODELS[a.model]()
    phases = Phases()
    opts = PlanOptions(time_limit=a.time_limit, progress=False, symbolic=not a.no_symbolic, on_phase=phases)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(model, args, kwargs, mesh, opts)
    wall = time.perf_counter() - t0
    out = {"bench": f"plan speed {a.model}", "mesh": mesh.shape, "wall_s": round(wall, 2), "phases_s": phases.seconds,
           "solve_s": round(plan.timings.solve_s, 2), "scaling": plan.scaling.unavailable or "available",
           "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
           "ilp_variables": plan.solver.n_variables, "ilp_constraints": plan.solver.n_constraints,
           "solver": plan.solver.solver, "status": plan.solver.status,
           "step_time_s": round(plan.estimate.step_time_s, 4),
           "peak_memory_gib": round(plan.estimate.peak_memory_bytes / 2**30, 2),
           "memory_decisions": sorted({v for d in (plan.recompute, plan.residency, plan.offload) for v in d.values()})}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
