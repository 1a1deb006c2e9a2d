"""The planner choosing the mesh (issue 38): a `Cluster` in, the best mesh shape, axis roles and plan out.

    python benchmarks/bench_mesh_search.py gpt3|mixtral|llama-cp|llama-node|qwen3-cp [--time-limit S] [--baseline]

* gpt3: GPT-3 175B (examples/models.py GPT: 96 layers, hidden 12,288, 96 heads, vocabulary 51,200,
  sequence 2,048, bf16, AdamW) at global batch 1,536 on `Cluster(nodes=128, devices_per_node=8,
  device="h100")`, time_limit 120 s; --baseline also plans Megatron-LM's mesh (16, 8, 8) dp/pp/tp with
  `pipeline={}` (every family on auto; issue 37 measured 7.29 s);
* mixtral: Hugging Face Mixtral-8x7B (examples/zoo.py, bf16) at 8 x 4096 on 8 nodes of 8 H100;
* llama-cp: Hugging Face Llama-3-8B at 8 sequences of 131,072 tokens on 8 nodes of 8 H100
  (bench_context_parallel's sizes), outputs left sharded as there (`sharded_outputs=True`: the logits,
  256 GiB at that size, are never gathered whole on a device);
* llama-node: Llama-3-8B at 8 x 8192 on one node of 8 H100; --baseline also plans the (8,) FSDP-style
  mesh (one "dp" axis) for comparison;
* qwen3-cp: Hugging Face Qwen3-8B (bench_plan_speed's held-out configuration) at llama-cp's sizes, so that
  the long-context search is not tuned to Llama.
Prints one JSON line per search: the chosen mesh, its step and peak memory and why it won, the
runners-up (each mesh planned, with its predicted step and peak, or why no plan fits), how many meshes
were weighed by status and the first ones not planned with why, the search's wall and CPU seconds, and the
machine's load average (`os.getloadavg`) at the start and end: the machine is shared, so wall times
are inflated by the load and CPU seconds are the steadier measure.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections import Counter

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))      # this checkout's autopar, not the installed one
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import autopar  # noqa: E402
from autopar.views.report import tensor_parallel_family  # noqa: E402

GIB = 2**30
NOT_PLANNED_ROWS = 4     # the first meshes not planned printed with why (all of them are in plan.mesh_search)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0)


def gpt3():
    from models import GPT
    with torch.device("meta"):
        model = GPT(vocab=51200, seq=2048, hidden=12288, heads=96, layers=96).to(torch.bfloat16)
        idx = torch.zeros(1536, 2048, dtype=torch.long)
    return model, (idx, idx), {}, autopar.Cluster(nodes=128, devices_per_node=8, device="h100"), \
        autopar.Mesh((16, 8, 8), ("dp", "pp", "tp"), "h100"), dict(pipeline={}), {}


def _llama(batch, seq, nodes, fsdp_mesh=None, **opts):
    import transformers
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA3_8B, max_position_embeddings=seq))
        model = model.to(torch.bfloat16)
        ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, (ids,), {"labels": ids}, autopar.Cluster(nodes=nodes, devices_per_node=8, device="h100"), \
        fsdp_mesh, opts, opts


def qwen3_cp():
    import transformers
    from bench_plan_speed import HELD_OUT
    family, cfg = HELD_OUT["qwen3-8b"]
    config = getattr(transformers, f"{family}Config")(**{**cfg, "max_position_embeddings": 131072})
    with torch.device("meta"):
        model = getattr(transformers, f"{family}ForCausalLM")(config).to(torch.bfloat16)
        ids = torch.zeros(8, 131072, dtype=torch.long)
    opts = dict(sharded_outputs=True)
    return model, (ids,), {"labels": ids}, autopar.Cluster(nodes=8, devices_per_node=8, device="h100"), None, opts, opts


def mixtral():
    from zoo import build
    model, args, kwargs, _ = build("mixtral", full=True, batch=8, seq=4096)
    model = model.to(torch.bfloat16)
    return model, args, kwargs, autopar.Cluster(nodes=8, devices_per_node=8, device="h100"), None, {}, {}


CASES = {"gpt3": gpt3, "mixtral": mixtral, "llama-cp": lambda: _llama(8, 131072, 8, sharded_outputs=True),
         "llama-node": lambda: _llama(8, 8192, 1, autopar.Mesh((8,), ("dp",), "h100")), "qwen3-cp": qwen3_cp}


def _mesh(m) -> str:
    return "(" + ", ".join(f"{n}={s}" for n, s in zip(m["axis_names"], m["shape"])) + ")"


def _row(c) -> dict:
    return {"mesh": "(" + ", ".join(f"{n}={s}" for n, s in zip(c.axis_names, c.shape)) + ")", "status": c.status,
            "step_s": None if c.step_time_s is None else round(c.step_time_s, 3),
            "peak_gib": None if c.peak_memory_bytes is None else round(c.peak_memory_bytes / GIB, 1),
            "screen_s": round(c.screen_s, 3), "note": c.note}


def run(name: str, time_limit: float, baseline: bool) -> dict:
    model, args, kwargs, cluster, base_mesh, base_opts, opts = CASES[name]()
    load0 = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, args, cluster, example_kwargs=kwargs, time_limit=time_limit, progress=False,
                           **opts)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    e, pp = plan.estimate, plan.pipeline
    out = {"bench": f"mesh search {name}", "cluster": repr(cluster), "chosen": _mesh(plan.mesh),
           "step_s": round(e.step_time_s, 3), "peak_gib": round(e.peak_memory_bytes / GIB, 1),
           "tokens_per_s": round(_tokens(args, kwargs) / e.step_time_s),
           "pipeline": [pp.axis, pp.stages, pp.virtual_stages, pp.microbatches, pp.schedule],
           "parallelism": tensor_parallel_family(plan).describe(),
           "experts": sorted({"/".join(n.labels) for n in plan.nodes if n.op == "autopar.moe_experts"}),
           "attention": sorted({"/".join(n.labels) for n in plan.nodes if "scaled_dot_product" in n.op}),
           "search_wall_s": round(wall, 1), "search_cpu_s": round(cpu, 1), "time_limit_s": time_limit,
           "load_avg_start_end": [round(load0, 1), round(os.getloadavg()[0], 1)],
           "why": plan.mesh_search[0].note,
           "runners_up": [_row(c) for c in plan.mesh_search[1:] if c.status in ("planned", "infeasible")],
           "meshes_weighed": dict(Counter(c.status for c in plan.mesh_search)),
           "not_planned": [_row(c) for c in plan.mesh_search if c.status not in ("chosen", "planned", "infeasible")
                           ][:NOT_PLANNED_ROWS]}
    if baseline and base_mesh is not None:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = autopar.plan(model, args, base_mesh, example_kwargs=kwargs, progress=False, symbolic=False,
                               time_limit=600, **base_opts)
        out["baseline"] = {"mesh": _mesh(ref.mesh), "step_s": round(ref.estimate.step_time_s, 3),
                           "peak_gib": round(ref.estimate.peak_memory_bytes / GIB, 1),
                           "tokens_per_s": round(_tokens(args, kwargs) / ref.estimate.step_time_s),
                           "wall_s": round(time.perf_counter() - t0, 1)}
        out["chosen_over_baseline_step"] = round(e.step_time_s / ref.estimate.step_time_s, 3)
    print(json.dumps(out), flush=True)
    return out


def _tokens(args, kwargs) -> int:
    t = next(x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor))
    return t.shape[0] * (t.shape[1] if t.ndim > 1 else 1)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", default=list(CASES), help=f"any of {', '.join(CASES)} (default all)")
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--baseline", action="store_true", help="also plan the reference mesh (slow for gpt3)")
    a = ap.parse_args(argv)
    return [run(c, a.time_limit, a.baseline) for c in a.cases]


if __name__ == "__main__":
    main()
