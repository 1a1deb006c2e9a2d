"""The planner's pipelines against Megatron-LM's published configurations, both priced by the one evaluator.

    python benchmarks/bench_pipeline.py gpt3 [--pipeline '{"axis": "pp"}']
    python benchmarks/bench_pipeline.py table1 [--rows 0,1] [--pipeline '{}'] [--only autopar|megatron]

* gpt3: GPT-3 175B (96 layers, hidden 12,288, 96 heads, vocabulary 51,200, sequence 2,048, bf16,
  AdamW) at global batch 1,536 on `Mesh((16, 8, 8), ("dp", "pp", "tp"), "h100")`. The planner plans
  it with `pipeline=` (by default the pipeline axis is given and everything else, microbatches,
  schedule, virtual stages, layouts, recompute, residency, offload, chosen); Megatron-LM's
  configuration (TP 8 over "tp", PP 8 over "pp", DP 16, interleaved 1F1B, micro-batch 1, selective
  recomputation) is the same planner with those fixed: tensor-parallel weight layouts pinned
  (`bench_megatron.MEGATRON_PINS`), the pipeline given in full, recompute="selective". Sequence
  parallelism is not pinned: the ILP may split the layer norms, dropouts and residual adds over
  "tp" on the sequence (S(1)) where today's strategies allow it, which is Megatron-SP's layout; what
  is missing is Megatron-SP's fused all-gather/reduce-scatter pairs around each GEMM as one
  decision (issue 13). Prints both step times, memory per device, planning wall time and peak RSS.
* table1: each row of Megatron's Table 1 (DESIGN.md section 4, A100) as a mesh (dp, pp, tp) or
  (dp, tp) of that row's sizes: Megatron's (TP, PP, DP) with its pipeline and full recomputation
  (2021's runs, `examples/sc21/run_table_1.sh`), and the planner's choice
  with `pipeline=`, both priced by the evaluator. Full-depth models: slow on a 2-core machine.

The model is bench_megatron's MegatronGPT (Megatron's layer: fused head-interleaved QKV, explicit
attention, GeLU MLP, tied head, loss on fp32 logits). One JSON line per configuration.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's autopar
import autopar  # noqa: E402
from bench_megatron import MEGATRON_PINS, ROWS, SEQ, VOCAB, MegatronGPT, megatron_flops  # noqa: E402

GPT3 = dict(hidden=12288, heads=96, layers=96, batch=1536)
MEGATRON_VIRTUAL = 2      # Table 1's 145.6B row (PP 8) runs 2 virtual stages (run_table_1.sh)


def _model(hidden, heads, layers, batch):
    with torch.device("meta"):
        model = MegatronGPT(VOCAB, SEQ, hidden, heads, layers=layers, dropout=0.0).to(torch.bfloat16)
        idx = torch.zeros(batch, SEQ, dtype=torch.long)
    return model, (idx, idx.clone())


def _pins(mesh: autopar.Mesh) -> dict:
    """MEGATRON_PINS (over ("dp", "tp")) on this mesh: "R" on every other axis."""
    names = mesh.axis_names
    return {k: tuple(v[1] if a == "tp" else "R" for a in names) for k, v in MEGATRON_PINS.items()}


def _row(label, plan, wall, flops, devices) -> dict:
    e, pp = plan.estimate, plan.pipeline
    return {"config": label, "pipeline": {"axis": pp.axis, "stages": pp.stages, "microbatches": pp.microbatches,
                                          "schedule": pp.schedule, "virtual_stages": pp.virtual_stages},
            "step_s": round(e.step_time_s, 3), "tflops_per_device": round(flops / (e.step_time_s * devices) / 1e12, 1),
            "bubble_s": round(e.bubble_s, 3), "p2p_s": round(e.p2p_s, 3), "comm_s": round(e.comm_s, 3),
            "peak_memory_gib": round(e.peak_memory_bytes / 2**30, 1),
            "recompute": sorted(set(plan.recompute.values())), "residency": sorted(set(plan.residency.values())),
            "layouts": {k: list(v) for k, v in plan.placements.items() if k.startswith("layers.0.")},
            "plan_wall_s": round(wall, 1), "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def _plan(model, inputs, mesh, **kw):
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, inputs, mesh, batch_axes=("dp",), symbolic=False, progress=False, **kw)
    return plan, time.perf_counter() - t0


def compare(hidden, heads, layers, batch, mesh, megatron_pipe, chosen_pipe, label, recompute,
            sides=("autopar", "megatron")) -> list[dict]:
    """recompute: Megatron's ("selective" in the 2022 GPT-3 runs, "full" in 2021's Table 1); sides: which
    of the two to price (the ratio is printed when both are)."""
    model, inputs = _model(hidden, heads, layers, batch)
    flops = megatron_flops(batch, SEQ, layers, hidden, VOCAB)
    fixed = dict(pipeline=megatron_pipe) if megatron_pipe else dict(pipeline=False)
    out = [_priced(f"{label} autopar", flops, mesh, model, inputs, pipeline=chosen_pipe) if "autopar" in sides
           else {},
           _priced(f"{label} Megatron-LM", flops, mesh, model, inputs, pins=_pins(mesh), recompute=recompute,
                   residency="keep", offload="none", **fixed) if "megatron" in sides else {}]
    steps = [r.get("step_s") for r in out]
    print(json.dumps({"benchmark": f"pipeline {label}", "autopar_step_s": steps[0], "megatron_step_s": steps[1],
                      "autopar_over_megatron": round(steps[0] / steps[1], 3) if all(steps) else None}), flush=True)
    return out


def _priced(label, flops, mesh, model, inputs, **kw) -> dict:
    """One configuration's row, or what it needs where nothing fits the device (printed either way)."""
    try:
        plan, wall = _plan(model, inputs, mesh, **kw)
        row = _row(label, plan, wall, flops, mesh.size)
    except autopar.InfeasibleError as e:
        need = e.min_memory_bytes
        row = {"config": label, "infeasible": str(e), "needs_gib": None if need is None else round(need / 2**30, 2)}
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("gpt3", "table1"))
    ap.add_argument("--rows", default="0", help="table1: comma-separated row indices")
    ap.add_argument("--pipeline", default=None, help="the planner's pipeline= (JSON); default: the pp axis given")
    ap.add_argument("--only", choices=("autopar", "megatron"), default=None, help="price one side only")
    a = ap.parse_args(argv)
    sides = (a.only,) if a.only else ("autopar", "megatron")
    if a.what == "gpt3":
        mesh = autopar.Mesh((16, 8, 8), ("dp", "pp", "tp"), device="h100")
        chosen = json.loads(a.pipeline) if a.pipeline else {"axis": "pp"}
        megatron = dict(axis="pp", stages=8, microbatches=GPT3["batch"] // 16, schedule="interleaved",
                        virtual_stages=MEGATRON_VIRTUAL)
        return compare(GPT3["hidden"], GPT3["heads"], GPT3["layers"], GPT3["batch"], mesh, megatron, chosen, "gpt3-175b",
                       "selective", sides)
    out = []
    for i in (int(x) for x in a.rows.split(",")):
        params_b, heads, hidden, layers, tp, pp, gpus, batch, _published, mbs, virtual, _ddp = ROWS[i]
        dp = gpus // (tp * pp)
        if pp > 1:
            mesh = autopar.Mesh((dp, pp, tp), ("dp", "pp", "tp"), device="a100")
            megatron = dict(axis="pp", stages=pp, microbatches=batch // (dp * mbs),
                            schedule="interleaved" if virtual > 1 else "1f1b", virtual_stages=virtual)
            chosen = json.loads(a.pipeline) if a.pipeline else {"axis": "pp"}
        else:
            mesh = autopar.Mesh((dp, tp), ("dp", "tp"), device="a100")
            megatron, chosen = None, json.loads(a.pipeline) if a.pipeline else {}
        out += compare(hidden, heads, layers, batch, mesh, megatron, chosen, f"table1 {params_b}B TP{tp} PP{pp} DP{dp}",
                       "full", sides)
    return out


if __name__ == "__main__":
    main()
