"""Vocab-parallel embedding and loss (issue 13), planned on the meta device.

    python benchmarks/bench_vocab_parallel.py [--layers N] [--time-limit S]

Hugging Face Llama-3-8B (LlamaForCausalLM from its config; vocabulary 128,256; bf16, AdamW) at
global batch 64 x 4096 on 64 H100 as `Mesh((8, 8), ("dp", "tp"))`, batch over "dp". The planner's
own choice, then the loss pinned to each layout on the "tp" axis: "vocab_parallel" (logits split on
the vocabulary from the head to the loss), "batch" (the logits moved to a row split first) and
"replicate" (the logits gathered whole); then the embedding pinned "vocab_parallel" and "batch".
Per plan: the labels of the embedding, the head and the loss, the collectives into the head and into
and inside the loss, the logits' bytes per device (the head's output and the fp32 copy Hugging Face's
loss makes), the predicted step time and peak memory per device. Every plan has the same memory
policy (selective recomputation, no offload, gathered weights kept), so that the layouts are what
differ. One JSON line per plan.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))      # this checkout's autopar, not the installed one
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import autopar  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
BATCH, SEQ = 64, 4096
LOSS, EMBEDDING = "cross_entropy_loss*", "embedding*"
ALTERNATIVES = (("planner's choice", {}),
                ("loss vocab_parallel", {LOSS: ("batch", "vocab_parallel")}),
                ("loss batch", {LOSS: ("batch", "batch")}),
                ("loss replicate", {LOSS: ("batch", "replicate")}),
                ("embedding vocab_parallel", {EMBEDDING: ("batch", "vocab_parallel")}),
                ("embedding batch", {EMBEDDING: ("batch", "batch")}))
MEMORY_POLICY = dict(recompute="selective", offload="none", residency="keep")


def _local_bytes(plan, name: str, model_shapes: dict) -> float:
    n = next(n for n in plan.nodes if n.name == name)
    split = math.prod(size for p, size in zip(n.output, plan.mesh["shape"]) if p.startswith("S"))
    return model_shapes[name] / split


def logits_summary(plan, nbytes: dict) -> dict:
    """Labels of the embedding and the loss, the logits' bytes per device, the loss's collectives."""
    nodes = {n.name: n for n in plan.nodes}
    loss = next(n for n in plan.nodes if n.op == "aten.cross_entropy_loss")
    emb = next(n for n in plan.nodes if n.op == "aten.embedding")
    head = next(nodes[name] for name in nbytes if name in nodes and nodes[name].op == "aten.linear")
    logits = sum(_local_bytes(plan, name, nbytes) for name in nbytes if name in nodes)
    colls = sorted({f"{c.kind} ({c.phase}, {c.tensor})" for c in loss.collectives})
    head_colls = sorted({f"{c.kind} ({c.phase}, {c.tensor})" for c in head.collectives})
    return {"embedding": "/".join(emb.labels), "head": "/".join(head.labels), "head_collectives": head_colls,
            "loss": "/".join(loss.labels),
            "logits_gib_per_device": round(logits / 2**30, 2), "loss_collectives": colls,
            "loss_comm_ms": round(1e3 * sum(c.seconds for c in loss.collectives), 2)}


def vocab_sized_outputs(model, ids) -> dict:
    """Node name -> global bytes of every vocab-wide float tensor the captured graph makes (the logits
    and their fp32 copy; views of them are not new memory; the names are the plan's)."""
    from autopar.passes.capture import capture
    from autopar.passes.shape_prop import tensor_meta
    from autopar.strategies import rule_for
    cap = capture(model, (), {"input_ids": ids, "labels": ids})
    out = {}
    for node in cap.gm.graph.nodes:
        rule = rule_for(node.target) if node.op == "call_function" else None
        metas = tensor_meta(node.meta.get("val")) if rule is not None and not rule.is_view else ()
        if (metas and metas[0].dtype.is_floating_point and len(metas[0].shape) > 1
                and metas[0].shape[-1] == LLAMA3_8B["vocab_size"]):
            out[node.name] = metas[0].nbytes
    return out


def llama3_8b(layers: int, time_limit: float) -> None:
    import transformers
    cfg = transformers.LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": layers})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    mesh = autopar.Mesh((8, 8), ("dp", "tp"), device="h100")
    nbytes = vocab_sized_outputs(model, ids)
    for name, pins in ALTERNATIVES:
        row = {"bench": f"llama3-8b {layers} layers 64xH100 (dp 8, tp 8) {BATCH}x{SEQ}", "plan": name}
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = autopar.plan(model, (), mesh, example_kwargs={"input_ids": ids, "labels": ids},
                                    batch_axes=("dp",), pins=pins, sharded_outputs=True, time_limit=time_limit,
                                    symbolic=False, **MEMORY_POLICY)
        except autopar.InfeasibleError as e:
            row.update(feasible=False, min_memory_gib=round((e.min_memory_bytes or 0) / 2**30, 1))
        else:
            est = plan.estimate
            row.update(feasible=True, **logits_summary(plan, nbytes), step_s=round(est.step_time_s, 4),
                       peak_gib=round(est.peak_memory_bytes / 2**30, 2), solver=plan.solver.status)
        row["plan_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--time-limit", type=float, default=120.0)
    a = ap.parse_args()
    llama3_8b(a.layers, a.time_limit)


if __name__ == "__main__":
    main()
