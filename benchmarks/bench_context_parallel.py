"""Context parallelism at long context (issues 13, 35): ring attention's memory as it runs, and
plans on the meta device.

    python benchmarks/bench_context_parallel.py [--only memory|plans] [--layers N] [--time-limit S]

Memory (issue 35), on 2 CPU ranks (gloo) over `Mesh((2,), ("cp",))`: one causal attention layer
(q/k/v projection, scaled_dot_product_attention with is_causal, output projection, mean square as
the loss; batch 1, 8 heads of 64, 8,192 tokens, fp32), its input pinned split on the sequence and its
attention pinned "ring" (then "allgather_kv"). Per rank, the growth of resident memory over one
forward and backward (the peak, VmHWM, reset just before, less the resident memory then: glibc's
malloc keeps freed blocks, so it is above the live bytes), the peak of live tensor bytes
(`MemoryMeter`, parameters and gradients included) against the plan's predicted peak (SGD: parameters
and gradients as state), and the worst relative difference of the loss and the input and weight
gradients from one process.

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
import copy
import gc
import json
import os
import re
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import autopar  # noqa: E402
from autopar.runtime.memory_meter import MemoryMeter  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0)
SEQ, BATCH = 131072, 8
SEQ_SPLIT = ("S(0)", "S(1)")
ALTERNATIVES = (None, "ring", "ulysses", "allgather_kv", "heads")
MEMORY_POLICY = dict(recompute="selective", offload="none", residency="keep")


# the memory run's layer and mesh (the size)
MEM_SEQ, MEM_HEADS, MEM_HEAD_DIM, MEM_RANKS = 8192, 8, 64, 2


class AttentionLayer(torch.nn.Module):
    """One causal self-attention layer whose output's mean square is the loss."""

    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        self.heads, width = heads, heads * head_dim
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1)).square().mean()


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read()).group(1))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def ring_memory_rank(rank, world_size, label: str) -> dict:
    """On each rank: resident memory growth over one forward+backward of the layer with attention
    pinned to `label`, and its difference from one process (module docstring)."""
    torch.manual_seed(0)
    model = AttentionLayer(MEM_HEADS, MEM_HEAD_DIM)
    x = torch.randn(1, MEM_SEQ, MEM_HEADS * MEM_HEAD_DIM)
    mesh = autopar.Mesh((world_size,), ("cp",), device="cpu")
    dmodel = autopar.autoparallelize(model, mesh, (x,), pins={"x": ("S(1)",), "scaled_dot_product_attention*": (label,)},
                                     symbolic=False, recompute="none", offload="none", residency="keep",
                                     optimizer="sgd")
    labels = sorted({lab for n in dmodel.plan.nodes if n.op == "aten.scaled_dot_product_attention" for lab in n.labels})
    xd = x.clone().requires_grad_()
    meter = MemoryMeter("cpu")
    meter.track(*dmodel.parameters())
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")       # resets VmHWM to the resident memory now
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    with meter:
        loss = dmodel(xd)
        loss.backward()
    seconds = time.perf_counter() - t0
    growth = _status_kib("VmHWM") - before
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    grads = {k: p.grad.full_tensor() for k, p in dmodel.named_parameters()}
    ref, xr = copy.deepcopy(model), x.clone().requires_grad_()
    ref_loss = ref(xr)
    ref_loss.backward()
    # the input is split on the sequence: each rank's `xd.grad` holds its own part's gradient (zeros
    # elsewhere), so their sum over the ranks is the whole input's
    x_grad = xd.grad.clone()
    torch.distributed.all_reduce(x_grad)
    worst = max([_rel(loss.detach(), ref_loss.detach()), _rel(x_grad, xr.grad)]
                + [_rel(grads[k], p.grad) for k, p in ref.named_parameters()])
    return {"growth_mib": round(growth / 1024, 1), "fwd_bwd_s": round(seconds, 2), "worst_rel_diff": worst,
            "labels": labels, "live_peak_mib": round(meter.peak_device_bytes / 2**20, 1),
            "predicted_peak_mib": round(dmodel.plan.estimate.peak_memory_bytes / 2**20, 1)}


def ring_memory() -> None:
    from rank_pool import get_pool, shutdown_all
    try:
        for label in ("ring", "allgather_kv"):
            results = get_pool(MEM_RANKS).run(ring_memory_rank, label, timeout=1200)
            print(json.dumps({"bench": f"context-parallel attention memory, {MEM_RANKS} CPU ranks, causal, batch 1, "
                                       f"{MEM_HEADS} heads of {MEM_HEAD_DIM}, {MEM_SEQ} tokens, fp32",
                              "attention": label, "chosen": results[0]["labels"],
                              "largest_rank_growth_mib": max(r["growth_mib"] for r in results),
                              "per_rank_growth_mib": [r["growth_mib"] for r in results],
                              "live_tensor_peak_mib": max(r["live_peak_mib"] for r in results),
                              "predicted_peak_mib": results[0]["predicted_peak_mib"],
                              "fwd_bwd_s": max(r["fwd_bwd_s"] for r in results),
                              "worst_rel_diff": max(r["worst_rel_diff"] for r in results)}), flush=True)
    finally:
        shutdown_all()


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
    ap.add_argument("--only", choices=("memory", "plans"))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--time-limit", type=float, default=120.0)
    a = ap.parse_args()
    if a.only != "plans":
        ring_memory()
    if a.only != "memory":
        llama3_8b_long(a.layers, a.time_limit)


if __name__ == "__main__":
    main()
