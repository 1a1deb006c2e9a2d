"""Megatron-LM's published weak-scaling runs (Narayanan et al. 2021, Table 1), priced by autopar.

    python benchmarks/bench_megatron.py [--rows 0,1,2] [--json]

For each row, Megatron's own configuration is written down as autopar pins (tensor parallelism
over "tp", data parallelism over "dp") plus pipeline settings, on a ("pp", "dp", "tp") mesh of
A100-80GB (row-major: tp inside a node, dp next, pp outermost, as Megatron orders its ranks), and
priced with `autopar.estimate`. The configuration of each row, beyond the table's columns, is
that of Megatron-LM's script for this table (examples/sc21/run_table_1.sh): microbatch size,
virtual pipeline stages (interleaved 1F1B), and the data-parallel implementation (PyTorch DDP,
which overlaps the bucketed gradient all-reduce with the backward, for the four smallest models;
Megatron's local DDP, one all-reduce of a contiguous buffer after the backward, for the others).
Every row runs with full activation recomputation and fp16 mixed precision.

Predicted TFLOP/s per GPU = Megatron's own FLOP count per iteration,
F = 96 B s l h^2 (1 + s / 6h + V / 16lh), over the predicted iteration time and the GPU count,
so prediction and publication use the same numerator.

The model is built at its depth on the meta device (nothing allocated) and priced by
`autopar.estimate`, which makes Megatron's configuration a Plan (the pins, the pipeline, full
recomputation fixed) and prices it with the planner's evaluator: the same price `autopar.plan`
would give these layouts. Repeated layers share their decisions, so planning the deep models
costs seconds to minutes, most of it capture. PyTorch DDP's overlap is the profile's
`grad_sync_overlap` = 1 (the gradient transfer hidden behind the backward, its buckets' launches
not); Megatron's local DDP is one bucket after the backward.

The layer is Megatron's GPT layer in plain PyTorch: pre-LayerNorm, fused QKV projection viewed as
(heads, 3 x head_dim) so that column parallelism splits heads, explicit attention (QK^T, softmax,
dropout, PV; no flash attention in 2021), GeLU MLP, dropout and residual adds, learned position
embeddings, tied output layer, and the loss on fp32 logits. Differences from Megatron's kernels:
the causal mask, fused into Megatron's softmax kernel, is left out (a fused masked softmax moves
the bytes of a softmax); the 1/sqrt(d) scale multiplies q (Megatron folds it into the GEMM);
bias-dropout-add runs as separate ops (Megatron fuses it); the embedding and head are
token-parallel over tp rather than vocabulary-parallel (autopar has no vocabulary-parallel rule;
same FLOPs per device).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import autopar  # noqa: E402
from autopar.cost_model.pipeline import Pipeline  # noqa: E402
from autopar.estimate import DDP_BUCKET_BYTES, estimate  # noqa: E402

VOCAB, SEQ = 51200, 2048

# Table 1 of Narayanan et al. 2021 (DESIGN.md section 4), with the microbatch size, virtual stages
# and DDP implementation of Megatron-LM's examples/sc21/run_table_1.sh for the same row.
#   params(B) heads hidden layers TP PP GPUs batch published-TFLOP/s  MBS  virtual  DDP
ROWS = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1, "torch"),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1, "torch"),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1, "torch"),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1, "torch"),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1, "local"),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3, "local"),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2, "local"),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2, "local"),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3, "local"),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1, "local"),
]


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        d = h // self.heads
        # Megatron's layout: [q k v] interleaved per head, so a column split of qkv splits heads
        q, k, v = self.qkv(x).view(b, s, self.heads, 3 * d).split(d, dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))            # (b, heads, s, d)
        scores = torch.matmul(q * d ** -0.5, k.transpose(-2, -1))  # (b, heads, s, s)
        probs = F.dropout(torch.softmax(scores, dim=-1), self.dropout, self.training)
        y = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, h)
        return self.proj(y)


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float = 0.1):
        super().__init__()
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, dropout)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        x = x + F.dropout(self.attn(self.ln1(x)), self.dropout, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc(self.ln2(x)))), self.dropout, self.training)


class MegatronGPT(nn.Module):
    def __init__(self, vocab: int, seq: int, hidden: int, heads: int, layers: int, dropout: float = 0.1):
        super().__init__()
        self.dropout = dropout
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(Layer(hidden, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)

    def forward(self, idx, targets):
        b, s = idx.shape
        x = F.dropout(self.wte(idx) + self.wpe(torch.arange(s, device=idx.device)), self.dropout, self.training)
        for layer in self.layers:
            x = layer(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)       # output layer tied to the embedding
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


# Megatron's tensor parallelism over ("dp", "tp"): column-parallel qkv and fc, row-parallel proj
# and fc2 (their biases added once, after the all-reduce), everything else whole; replicated over dp.
MEGATRON_PINS = {
    "layers.*.attn.qkv.weight": ("R", "S(0)"), "layers.*.attn.qkv.bias": ("R", "S(0)"),
    "layers.*.attn.proj.weight": ("R", "S(1)"), "layers.*.attn.proj.bias": ("R", "R"),
    "layers.*.fc.weight": ("R", "S(0)"), "layers.*.fc.bias": ("R", "S(0)"),
    "layers.*.fc2.weight": ("R", "S(1)"), "layers.*.fc2.bias": ("R", "R"),
    "layers.*.ln*": ("R", "R"), "ln_f.*": ("R", "R"), "wpe.weight": ("R", "R"),
    "wte.weight": ("R", "S(0)"),     # VocabParallelEmbedding; the tied output layer and the loss vocab-parallel too
}


def residual_stream_pins(layers: int = 1) -> dict[str, tuple[str, str]]:
    """Megatron (2021) keeps the residual stream whole on every tensor-parallel rank: layer norms,
    hidden dropouts and residual adds run replicated over tp (sequence parallelism came in 2022).
    Pin those ops by node name; names do not depend on sizes, so a tiny copy of the model (with as
    many layers) finds them."""
    from autopar.passes.capture import capture
    model = MegatronGPT(64, 8, 16, 2, layers=layers)
    idx = torch.zeros(2, 8, dtype=torch.long)
    cap = capture(model, (idx, idx.clone()))
    pins = {}
    for n in cap.gm.graph.nodes:
        if n.op != "call_function":
            continue
        path = list((n.meta.get("nn_module_stack") or {"": ("", None)}).values())[-1][0]
        op = getattr(n.target, "__name__", str(n.target)).split(".")[0]
        if op in ("layer_norm", "native_layer_norm", "add", "native_dropout", "dropout") and ".attn" not in path:
            pins[n.name] = ("S(0)", "R")
    return pins


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs per iteration as Narayanan et al. 2021 count them (with activation recomputation)."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def price_row(row, device: str = "a100") -> dict:
    params_b, heads, hidden, layers, tp, pp, gpus, batch, published, mbs, virtual, ddp = row
    dp = gpus // (tp * pp)
    micro = batch // (dp * mbs)
    with torch.device("meta"):
        model = MegatronGPT(VOCAB, SEQ, hidden, heads, layers=layers).half()
        idx = torch.zeros(batch, SEQ, dtype=torch.long)
    mesh = autopar.Mesh((pp, dp, tp), ("pp", "dp", "tp"), device=device)
    # the planner runs several microbatches only through a pipeline: a row without one (18.4B: 4
    # microbatches of 8) is priced as one pass of the replica's batch (same FLOPs and per-step sync)
    pipe = (Pipeline(stages=pp, microbatches=micro, axis="pp", schedule="interleaved" if virtual > 1 else "1f1b",
                     virtual_stages=virtual) if pp > 1 else None)
    pins = {**MEGATRON_PINS, **residual_stream_pins(layers)}
    t0 = time.perf_counter()
    est = estimate(model, (idx, idx.clone()), mesh, {k: ("R", *v) for k, v in pins.items()}, batch_axes=("dp",),
                   pipeline=pipe, recompute="full", precision="mixed",
                   grad_overlap=1.0 if ddp == "torch" else 0.0,
                   bucket_bytes=DDP_BUCKET_BYTES if ddp == "torch" else math.inf)
    seconds = time.perf_counter() - t0
    flops = megatron_flops(batch, SEQ, layers, hidden, VOCAB)
    predicted = flops / (est.step_time_s * gpus) / 1e12
    return {"params_b": params_b, "tp": tp, "pp": pp, "dp": dp, "gpus": gpus, "batch": batch, "mbs": mbs,
            "microbatches": micro, "virtual": virtual, "ddp": ddp, "published_tflops": published,
            "predicted_tflops": round(predicted, 1), "error": round(predicted / published - 1, 4),
            "step_s": round(est.step_time_s, 3), "bubble_s": round(est.bubble_s, 3),
            "p2p_s": round(est.p2p_s, 3), "comm_s": round(est.comm_s, 3), "compute_s": round(est.compute_s, 3),
            "grad_sync_exposed_s": round(est.grad_sync_exposed_s, 3), "optimizer_s": round(est.optimizer_s, 4),
            "graph_flops_ratio": round(est.hardware_flops / flops, 4),
            "peak_memory_gib": round(est.peak_memory_bytes / 2**30, 1), "estimate_s": round(seconds, 2)}


def table(results: list[dict]) -> str:
    lines = ["| params (B) | TP | PP | DP | GPUs | batch | microbatches | predicted TFLOP/s | published | error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['params_b']} | {r['tp']} | {r['pp']} | {r['dp']} | {r['gpus']} | {r['batch']} | "
                     f"{r['microbatches']} | {r['predicted_tflops']:.1f} | {r['published_tflops']} | "
                     f"{r['error'] * 100:+.1f}% |")
    errs = [abs(r["error"]) for r in results]
    lines.append(f"\nmedian |error| {statistics.median(errs) * 100:.1f}%, max |error| {max(errs) * 100:.1f}%")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=None, help="comma-separated row indices (default: all)")
    ap.add_argument("--json", action="store_true", help="one JSON line per row instead of the table")
    a = ap.parse_args(argv)
    rows = ROWS if a.rows is None else [ROWS[int(i)] for i in a.rows.split(",")]
    results = []
    for row in rows:
        r = price_row(row)
        results.append(r)
        if a.json:
            print(json.dumps(r), flush=True)
    if not a.json:
        print(table(results))
    errs = [abs(r["error"]) for r in results]
    print(json.dumps({"benchmark": "megatron_table1", "rows": len(results),
                      "median_abs_error": round(statistics.median(errs), 4), "max_abs_error": round(max(errs), 4),
                      "within_15pct": all(e <= 0.15 for e in errs)}))
    return results


if __name__ == "__main__":
    main()
