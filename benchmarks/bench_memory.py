"""Measured peak live memory per rank of a small GPT on 2 gloo ranks, one plan per memory family.

    python benchmarks/bench_memory.py [--hidden 128] [--seq 64] [--batch 8] [--layers 2]

Each plan is `autopar.plan`'s own for a (2,) "dp" mesh (or, for residency, one pinned to ZeRO-3:
block weights stored split over dp and gathered per use) with one family's decision set on every
block (`dataclasses.replace(plan, recompute=..., residency=..., offload=...)`):

  none           nothing recomputed or offloaded
  recompute      recompute "full" / "selective" (matmul outputs kept)
  keep/regather  ZeRO-3 weights whose gathered copies are kept to the backward / gathered again
  act-host       activations saved by the blocks moved to the host pool
  opt-host       the blocks' fp32 master weights and AdamW state in the host pool, stepped there
  grad-host      the blocks' gradients moved to the host pool as they are made, back for their update
  param-host     the blocks' stored parameter shards in the host pool, fetched per use
  param-disk     the same in memory-mapped files (files are not counted as memory)
  zero3-regather-param-host  ZeRO-3 regather with the stored shards on the host, gathered from there

Each trains 2 AdamW steps next to one process (`dist_checks.STEPS`; the worst relative difference of
loss, gradients and parameters is printed: the decisions must not change the numbers) and the last
step is measured with `MemoryMeter`: live tensor bytes per rank, counted per storage, device and host
apart; the baseline is the parameters and the optimizer state alive before the step.
Columns: peak device bytes over the step (forward, backward, optimizer) measured, and as the planner
predicts it for the same decisions (`autopar.estimate` of the plan: the one evaluator), device bytes alive
between forward and backward (what the forward keeps for the backward), peak host bytes measured
and predicted.
Prints one JSON line per plan and rank, then a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

BLOCKS = lambda n: [f"blocks.{i}" for i in range(n)]   # noqa: E731
LINEARS = ("attn.qkv", "attn.proj", "fc", "fc2")
# Gradient buckets as small against this model's 1.6 MB of gradients as DDP's 25 MiB is against a
# large model's (Llama-3-8B: 16 GB of bf16 gradients): the buckets' buffers (at most
# cost_model.memory.BUCKETS_IN_FLIGHT of them) are then a sliver of the peak here as there, not the
# whole of the gradients. `--bucket-kib 25600` runs DDP's size.
BUCKET_KIB = 64


def variants(layers: int) -> tuple[dict, dict]:
    blocks = BLOCKS(layers)
    dp = {"none": {}, "recompute-full": {"recompute": {b: "full" for b in blocks}},
          "recompute-selective": {"recompute": {b: "selective" for b in blocks}},
          "act-host": {"offload": {f"activations:{b}": "host" for b in blocks}},
          "opt-host": {"offload": {f"optimizer:{b}": "host" for b in blocks}},
          "grad-host": {"offload": {f"gradients:{b}": "host" for b in blocks}},
          "param-host": {"offload": {f"parameters:{b}": "host" for b in blocks}},
          "param-disk": {"offload": {f"parameters:{b}": "disk" for b in blocks}}}
    regather = {f"{b}.{w}.weight": "regather" for b in blocks for w in LINEARS}
    zero3 = {"zero3-keep": {}, "zero3-regather": {"residency": regather},
             "zero3-regather-param-host": {"residency": regather,
                                           "offload": {f"parameters:{b}": "host" for b in blocks}}}
    return dp, zero3


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--bucket-kib", type=float, default=BUCKET_KIB)
    args = ap.parse_args(argv)
    from memory_checks import ZERO3_PINS, run_variants
    from rank_pool import get_pool, shutdown_all
    model_kw = dict(hidden=args.hidden, seq=args.seq, batch=args.batch, layers=args.layers)
    dp, zero3 = variants(args.layers)
    pins = {**ZERO3_PINS, **{f"linear_{i}": ("S(0)",) for i in range(8, 4 * args.layers)}}
    rows = []
    try:
        pool = get_pool(2)
        for plan_pins, vs in ((None, dp), (pins, zero3)):
            for rank, result in enumerate(pool.run(run_variants, (2,), ("dp",), plan_pins, vs, 0.0, model_kw, True,
                                                   args.bucket_kib * 1024, timeout=600)):
                for name, r in result.items():
                    row = {"bench": "memory", "plan": name, "rank": rank, "model": model_kw,
                           "peak_device_bytes": r["peak_device"], "predicted_peak_bytes": r["predicted_peak"],
                           "error": r["predicted_peak"] / r["peak_device"] - 1,
                           "kept_for_backward_bytes": r["fwd_device"], "peak_forward_backward_bytes": r["peak_fwd_bwd"],
                           "peak_optimizer_step_bytes": r["before_step"] + r["opt_step_device"],
                           "peak_host_bytes": r["peak_host"],
                           "predicted_host_bytes": r["predicted_host"],
                           "worst_rel_diff": max(r["loss"], r["grad"], r["param"])}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        shutdown_all()
    print(f"\n{'plan':<22}{'rank':>5}{'peak device B':>15}{'predicted B':>14}{'error':>8}{'kept fwd->bwd B':>17}"
          f"{'peak host B':>13}{'predicted B':>13}{'max rel diff':>14}")
    for r in rows:
        print(f"{r['plan']:<22}{r['rank']:>5}{r['peak_device_bytes']:>15,}{r['predicted_peak_bytes']:>14,.0f}"
              f"{r['error']:>+8.1%}{r['kept_for_backward_bytes']:>17,}{r['peak_host_bytes']:>13,}"
              f"{r['predicted_host_bytes']:>13,.0f}{r['worst_rel_diff']:>14.1e}")
    return rows


if __name__ == "__main__":
    main()
