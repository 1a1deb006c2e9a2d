"""Single kernels, predicted vs measured: the compute model checked op by op on this machine's device.

    python benchmarks/bench_kernels.py [--device cuda|cpu] [--profile h100|calibrated.json] [--repeat 20]

Each case is one op of a transformer layer at the sizes of Korthikanti et al.'s 22B layer on one of
8 tensor-parallel GPUs (microbatch 4, 8 heads of 96, sequence 2,048, hidden 6,144; a quarter of
that on CPU): the attention core (QK^T, softmax, dropout, PV), a copy of the same size as the
reference for memory-bound kernels, a layer norm, GeLU and the QKV GEMM. The op's inputs are
parameters, so autopar prices its backward as well; the prediction is autopar's own
(`op_cost` of the planner, on a 1-device mesh of the profile), the measurement the median over
`--repeat` runs (CUDA events on GPU) of the forward and, separately, of the backward
(`torch.autograd.grad`, so nothing accumulates). One JSON line per case, then a table.

What it is for: the residual of docs/cost_model.md (is PyTorch's dropout slower than a copy of
its bytes? how far below the roofline are short-K products?) is a question for a GPU; this is
the measurement to run when one is at hand.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import autopar  # noqa: E402
from autopar.passes.capture import capture  # noqa: E402
from autopar.passes.shape_prop import annotate  # noqa: E402
from autopar.solver.problem import build_problem  # noqa: E402


class OneOp(nn.Module):
    """fn applied to parameters of the given shapes (parameters, so that the backward is priced)."""

    def __init__(self, fn, *shapes, dtype):
        super().__init__()
        self.fn = fn
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(s, dtype=dtype) * 0.1) for s in shapes)

    def forward(self):
        return self.fn(*self.ps)


def cases(gpu: bool):
    bh, s, d, h = (32, 2048, 96, 6144) if gpu else (8, 512, 64, 1024)
    rows = 4 * s if gpu else s
    att = (bh, s, s)
    return {
        "copy (reference)": (lambda x: x.clone(), [att]),
        "QK^T (K = head dim)": (lambda q, k: torch.matmul(q, k.transpose(1, 2)), [(bh, s, d), (bh, s, d)]),
        "softmax": (lambda x: torch.softmax(x, dim=-1), [att]),
        "dropout": (lambda x: F.dropout(x, 0.1, True), [att]),
        "PV (K = sequence)": (lambda p, v: torch.matmul(p, v), [att, (bh, s, d)]),
        "layer norm": (lambda x, w, b: F.layer_norm(x, (h,), w, b), [(rows, h), (h,), (h,)]),
        "gelu": (lambda x: F.gelu(x), [(rows, 4 * h // 8 if gpu else h)]),
        "QKV GEMM": (lambda x, w: F.linear(x, w), [(rows, h), (3 * h // 8 if gpu else h, h)]),
    }


def predict(fn, shapes, dtype, profile) -> tuple[float, float]:
    """autopar's (forward, backward) seconds for the op, as the planner prices it."""
    with torch.device("meta"):
        m = OneOp(fn, *shapes, dtype=dtype)
    cap = capture(m, ())
    infos = annotate(cap.gm)
    mesh = autopar.Mesh((1,), ("x",), device=profile)
    problem = build_problem(cap, infos, mesh)
    fwd = bwd = 0.0
    for name, dec in problem.decisions.items():
        if dec.kind != "op":
            continue
        fwd += dec.fwd_s[0]                       # op_cost's, as the planner priced it (cost_model/ops.py)
        bwd += dec.compute_s[0] - dec.fwd_s[0]    # its backward where the op needs a gradient
    return fwd, bwd


def measure(fn, shapes, dtype, device: str, repeat: int) -> tuple[float, float]:
    """Median seconds of the forward and of the backward of fn on real tensors."""
    ps = [torch.randn(sh, dtype=dtype, device=device, requires_grad=True) for sh in shapes]
    cuda = device == "cuda"

    def timed(run) -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        run()
        return time.perf_counter() - t0

    fwd, bwd = [], []
    for i in range(repeat + 2):             # two warm-up runs
        out = None

        def forward():
            nonlocal out
            out = fn(*ps)
        t_f = timed(forward)
        grad = torch.ones_like(out)
        t_b = timed(lambda: torch.autograd.grad(out, ps, grad))
        if i >= 2:
            fwd.append(t_f)
            bwd.append(t_b)
    return statistics.median(fwd), statistics.median(bwd)


def _shipped_profile(device_name: str) -> str:
    for name in ("h200", "h100", "a100"):
        if name in device_name.lower():
            return name
    raise SystemExit(f"no shipped profile for {device_name!r}: pass --profile (autopar calibrate writes one)")


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile", default=None, help="device profile to predict with (default: the shipped "
                    "profile named in the GPU's name, a100/h100/h200, or cpu; or a calibrated JSON)")
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args(argv)
    gpu = a.device == "cuda"
    profile = a.profile or (_shipped_profile(torch.cuda.get_device_name()) if gpu else "cpu")
    dtype = torch.float16 if gpu else torch.float32
    results = []
    for name, (fn, shapes) in cases(gpu).items():
        pf, pb = predict(fn, shapes, dtype, profile)
        mf, mb = measure(fn, shapes, dtype, a.device, a.repeat)
        r = {"kernel": name, "shapes": shapes, "dtype": str(dtype).split(".")[-1], "device": a.device,
             "profile": profile, "predicted_fwd_ms": round(pf * 1e3, 4), "measured_fwd_ms": round(mf * 1e3, 4),
             "predicted_bwd_ms": round(pb * 1e3, 4), "measured_bwd_ms": round(mb * 1e3, 4)}
        results.append(r)
        print(json.dumps(r), flush=True)
    print("| kernel | fwd predicted | fwd measured | ratio | bwd predicted | bwd measured | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        rf = r["measured_fwd_ms"] / r["predicted_fwd_ms"] if r["predicted_fwd_ms"] else float("nan")
        rb = r["measured_bwd_ms"] / r["predicted_bwd_ms"] if r["predicted_bwd_ms"] else float("nan")
        print(f"| {r['kernel']} | {r['predicted_fwd_ms']:.3f} ms | {r['measured_fwd_ms']:.3f} ms | {rf:.2f} | "
              f"{r['predicted_bwd_ms']:.3f} ms | {r['measured_bwd_ms']:.3f} ms | {rb:.2f} |")
    return results


if __name__ == "__main__":
    main()
