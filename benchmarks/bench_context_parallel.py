"""Context parallelism at long context (issue 13), planned on the meta device.

    python benchmarks/bench_context_parallel.py [--layers N] [--time-limit S]

Hugging Face Llama-3-8B (LlamaForCausalLM from its config; bf16, AdamW) at 131,072 tokens per
sequence, global batch 8, on 64 H100 as `Mesh((8, 8), ("dp", "cp"))`: batch over "dp", the sequence
over "cp" (inputs pinned ("S(0)", "S(1)"), outputs left sharded: the logits are never gathered).
The planner's own choice of attention strategy, then each alternative pinned on the "cp" axis
("ring", "ulysses", "allgather_kv", and "heads": attention split on heads, the sequence moved to
heads and back by reshards around it), each with its predicted step time, tokens/s per GPU and
peak memory per device. Every plan has the same memory policy, Megatron's selective recomputation
(the attention core recomputed), no offload, gathered weights kept, so that the attention strategy
and the layouts around it are what differ (and each solve is small enough to finish on a laptop).
One JSON line per plan.
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

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0)
SEQ, BATCH = 131072, 8
SEQ_SPLIT = ("S(0)", "S(1)")
ALTERNATIVES = (None, "ring", "ulysses", "allgather_kv", "heads")
MEMORY_POLICY = dict(recompute="selective", offload="none", residency="keep")


def attention_labels(plan) -> list[str]:
    return sorted({"/".join(n.labels) for n in plan.nodes if n.op == "aten.scaled_dot_product_attention"})


def llama3_8b_long(layers: int, time_limit: float) -> None:
    import transformers
    cfg = transformers.LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": layers})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        ids, labels = torch.zeros(BATCH, SEQ, dtype=torch.long), torch.zeros(BATCH, SEQ, dtype=torch.long)
    mesh = autopar.Mesh((8, 8), ("dp", "cp"), device="h100")
    for alt in ALTERNATIVES:
        pins = {"input_ids": SEQ_SPLIT, "labels": SEQ_SPLIT}
        if alt is not None:
            pins["scaled_dot_product_attention*"] = ("batch", alt)
        row = {"bench": f"llama3-8b {layers} layers 64xH100 (dp 8, cp 8) {BATCH}x{SEQ}",
               "attention": alt or "planner's choice"}
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = autopar.plan(model, (), mesh, example_kwargs={"input_ids": ids, "labels": labels},
                                    batch_axes=("dp",), pins=pins, sharded_outputs=True, time_limit=time_limit,
                                    symbolic=False, **MEMORY_POLICY)
        except autopar.InfeasibleError as e:
            row.update(feasible=False, min_memory_gib=round((e.min_memory_bytes or 0) / 2**30, 1))
        else:
            est = plan.estimate
            row.update(feasible=True, chosen=attention_labels(plan), step_s=round(est.step_time_s, 3),
                       tokens_per_s_per_gpu=round(BATCH * SEQ / est.step_time_s / mesh.size, 1),
                       peak_gib=round(est.peak_memory_bytes / 2**30, 1),
                       solver=plan.solver.status)
        row["plan_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--time-limit", type=float, default=120.0)
    a = ap.parse_args()
    llama3_8b_long(a.layers, a.time_limit)


if __name__ == "__main__":
    main()
