"""The GPU checks of issue 35, in one run on one GPU (a lent H100/H200; CPU with `--small` to try the code):

    python benchmarks/bench_gpu.py [--small] [--only reserve,ring,experts,train]

* reserve: what a run needs beside its tensors, for the profiles' `context_memory`,
  `communicator_memory` and `fragmentation` (cost_model/profiles/*.json): the device memory in use
  (`torch.cuda.mem_get_info`) less what torch's allocator reserved, after CUDA's initialisation,
  after the first cuBLAS product, and after an NCCL communicator's first collectives.
* ring: one block of context-parallel attention through the executor (`runtime/attention.py` on a
  one-device context axis: the fused kernel with its log-sum-exp, the online fp32 merge, the
  blockwise backward) against one fused SDPA call of the same shape (flash), forward + backward, at
  32k tokens in bf16; causal (the diagonal block) and not (every other block). Checked against SDPA.
* experts: the grouped experts executor (`passes/lowering.moe_grouped`: sort by expert, two
  grouped GEMMs, weights, scatter-add into the tokens) against the two grouped GEMMs alone on the same
  token-slots already sorted in equal groups (the dense grouped GEMM), forward + backward, at the
  expert shapes of Qwen3-30B-A3B and Mixtral-8x7B.
* train: a Hugging Face Llama (bf16, AdamW) trained for a few steps: the allocator's reserved less
  allocated at the peak (fragmentation), plainly and with activation checkpointing; then planned and
  run by autopar on a one-device mesh: predicted against measured peak memory and step time.
Medians of CUDA-event times after warm-up; one JSON line per measurement, a table at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import autopar  # noqa: E402

MiB = 2**20
ROWS: list[dict] = []


def emit(**row) -> None:
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def dev() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeat: int, warmup: int = 2) -> float:
    """Median seconds of fn() (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(repeat):
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def used_beside_torch() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def init_group() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)


def reserve(small: bool) -> None:
    if not torch.cuda.is_available():
        emit(check="reserve", skipped="no CUDA device")
        return
    torch.cuda.init()
    torch.empty(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    ctx = used_beside_torch()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    blas = used_beside_torch()
    init_group()
    x = torch.ones(64 * MiB // 4, device="cuda")
    dist.all_reduce(x)
    out = torch.empty_like(x)
    dist.all_gather_into_tensor(out, x)
    dist.reduce_scatter_tensor(x, out)
    sync()
    nccl = used_beside_torch()
    emit(check="reserve", device=torch.cuda.get_device_name(), total_mib=round(total / MiB),
         free_after_init_mib=round(free / MiB), context_mib=round(ctx / MiB),
         cublas_mib=round((blas - ctx) / MiB), nccl_one_rank_mib=round((nccl - blas) / MiB),
         torch=torch.__version__, cuda=torch.version.cuda)


def _ring_args(q, k, v, causal: bool) -> dict:
    return {"query": q, "key": k, "value": v, "attn_mask": None, "is_causal": causal, "scale": None}


def ring(small: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from autopar.runtime.attention import context_attention
    init_group()
    mesh = init_device_mesh(dev().type, (1,), mesh_dim_names=("cp",))
    B, H, S, D = (1, 4, 1024, 64) if small else (1, 32, 32768, 128)
    dtype = torch.float32 if small else torch.bfloat16
    repeat = 3 if small else 10
    for causal in (False, True):
        q, k, v = (torch.randn(B, H, S, D, device=dev(), dtype=dtype, requires_grad=True) for _ in range(3))
        dout = torch.randn(B, H, S, D, device=dev(), dtype=dtype)

        def executor():
            out = context_attention(_ring_args(q, k, v, causal), mesh, 0, "ring")
            return out, torch.autograd.grad(out, (q, k, v), dout)

        def sdpa():
            backends = [SDPBackend.FLASH_ATTENTION] if torch.cuda.is_available() and not small else \
                [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
            with sdpa_kernel(backends):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return out, torch.autograd.grad(out, (q, k, v), dout)
        got, want = executor(), sdpa()
        err = max(float((g.float() - w.float()).norm() / w.float().norm()) for g, w in zip((got[0], *got[1]),
                                                                                              (want[0], *want[1])))
        del got, want
        mem = {}
        for name, fn in (("executor", executor), ("sdpa", sdpa)):
            if torch.cuda.is_available():
                sync()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                r = fn()
                del r
                sync()
                mem[name] = round((torch.cuda.max_memory_allocated() - base) / MiB)
        t_exec, t_sdpa = timed(executor, repeat), timed(sdpa, repeat)
        flops = 4 * B * H * S * S * D * 3.5 / (2 if causal else 1)   # forward 4BHS^2D, backward 2.5x (recompute)
        emit(check="ring block", shape=[B, H, S, D], dtype=str(dtype).split(".")[-1], causal=causal,
             executor_ms=round(t_exec * 1e3, 2), sdpa_ms=round(t_sdpa * 1e3, 2), ratio=round(t_exec / t_sdpa, 3),
             executor_tflops=round(flops / t_exec / 1e12, 1), rel_err_vs_sdpa=float(f"{err:.2e}"),
             extra_mib_executor=mem.get("executor"), extra_mib_sdpa=mem.get("sdpa"))


EXPERT_SHAPES = {   # tokens per device, hidden, expert intermediate, experts, top-k (published configs)
    "qwen3-30b-a3b": (8192, 2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 4096, 14336, 8, 2),
}


def experts(small: bool) -> None:
    from autopar.passes.lowering import expert_mlp, moe_grouped
    dtype = torch.float32 if small else torch.bfloat16
    repeat = 3 if small else 10
    for name, (T, Hd, inter, E, k) in EXPERT_SHAPES.items():
        if small:
            T, Hd, inter = 256, 64, 32
        g = torch.Generator(device=dev()).manual_seed(0)
        hidden = torch.randn(T, Hd, device=dev(), dtype=dtype, requires_grad=True)
        logits = torch.randn(T, E, device=dev(), generator=g)
        w, idx = torch.topk(torch.softmax(logits, -1), k)
        w = w.to(dtype).requires_grad_()
        gate_up = (torch.randn(E, 2 * inter, Hd, device=dev(), dtype=dtype) * Hd ** -0.5).requires_grad_()
        down = (torch.randn(E, Hd, inter, device=dev(), dtype=dtype) * inter ** -0.5).requires_grad_()
        dout = torch.randn(T, Hd, device=dev(), dtype=dtype)
        slots = T * k
        rows = torch.randn(slots, Hd, device=dev(), dtype=dtype, requires_grad=True)
        offs = torch.arange(1, E + 1, device=dev(), dtype=torch.int32) * (slots // E)
        dy = torch.randn(slots // E * E, Hd, device=dev(), dtype=dtype)

        def executor():
            out = moe_grouped(hidden, idx, w, gate_up, down, "silu", 0, every_slot_local=True)
            return torch.autograd.grad(out, (hidden, w, gate_up, down), dout)

        def dense():
            y = expert_mlp(rows[:slots // E * E], offs, gate_up, down, "silu")
            return torch.autograd.grad(y, (rows, gate_up, down), dy)
        t_exec, t_dense = timed(executor, repeat), timed(dense, repeat)
        flops = 3 * 6 * slots * Hd * inter       # forward 6 S H I (gate, up, down), backward twice that
        emit(check="grouped experts", model=name, tokens=T, hidden=Hd, intermediate=inter, experts=E, top_k=k,
             dtype=str(dtype).split(".")[-1], executor_ms=round(t_exec * 1e3, 2), dense_ms=round(t_dense * 1e3, 2),
             ratio=round(t_exec / t_dense, 3), executor_tflops=round(flops / t_exec / 1e12, 1),
             dense_tflops=round(flops / t_dense / 1e12, 1))


def _llama(small: bool):
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=256 if small else 2048, intermediate_size=512 if small else 5632,
                                   num_hidden_layers=2 if small else 8, num_attention_heads=4 if small else 16,
                                   num_key_value_heads=2 if small else 4, vocab_size=1024 if small else 32000,
                                   max_position_embeddings=4096, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    batch, seq = (1, 128) if small else (2, 4096)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    return model, ids


def train(small: bool) -> None:
    steps = 2 if small else 4
    eager = {}
    for ckpt in (False, True):
        model, ids = _llama(small)
        model = model.to(dev())
        if ckpt:
            model.gradient_checkpointing_enable()
        ids = ids.to(dev())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        step()
        if torch.cuda.is_available():
            sync()
            torch.cuda.reset_peak_memory_stats()
        t = eager[ckpt] = timed(step, steps, warmup=0)
        if torch.cuda.is_available():
            st = torch.cuda.memory_stats()
            peak_a, peak_r = st["allocated_bytes.all.peak"], st["reserved_bytes.all.peak"]
            cap = torch.cuda.get_device_properties(0).total_memory
            emit(check="fragmentation", model="llama 8x2048 bf16 AdamW 2x4096", checkpointing=ckpt,
                 step_ms=round(t * 1e3, 1), peak_allocated_mib=round(peak_a / MiB),
                 peak_reserved_mib=round(peak_r / MiB), reserved_over_allocated_mib=round((peak_r - peak_a) / MiB),
                 of_capacity=round((peak_r - peak_a) / cap, 4), of_peak=round((peak_r - peak_a) / peak_a, 4))
        del model, opt
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    _autopar_run(small, steps, eager[False])


def _autopar_run(small: bool, steps: int, eager_s: float) -> None:
    """The same model planned and run by autopar on a one-device mesh, beside Hugging Face eager's step."""
    init_group()
    model, ids = _llama(small)
    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else "cpu"
    profile = "h200" if "h200" in name else "h100" if "h100" in name else "cpu"
    mesh = autopar.Mesh((1,), ("dp",), device=profile)
    t0 = time.perf_counter()
    # precision "same": bf16 AdamW state, as the eager run keeps it (the default, "auto", keeps fp32 masters)
    plan = autopar.plan(model, (ids,), mesh, example_kwargs={"labels": ids}, batch_axes=("dp",), symbolic=False,
                        time_limit=30, precision="same")
    plan_s = time.perf_counter() - t0
    dmodel = autopar.autoparallelize(model, mesh, (ids,), example_kwargs={"labels": ids}, plan=plan)
    opt = dmodel.optimizer(torch.optim.AdamW, lr=1e-4)
    cuda_ids = ids.to(dev())

    def step():
        out = dmodel(cuda_ids, labels=cuda_ids)
        loss = out if isinstance(out, torch.Tensor) else out["loss"] if isinstance(out, dict) else out.loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    step()
    if torch.cuda.is_available():
        sync()
        torch.cuda.reset_peak_memory_stats()
    t = timed(step, steps, warmup=0)
    est = plan.estimate
    row = dict(check="autopar one device", model="llama 8x2048 bf16 AdamW 2x4096", profile=profile,
               plan_s=round(plan_s, 1), predicted_step_ms=round(est.step_time_s * 1e3, 1), step_ms=round(t * 1e3, 1),
               eager_step_ms=round(eager_s * 1e3, 1), over_eager=round(t / eager_s, 3),
               predicted_peak_mib=round(est.peak_memory_bytes / MiB),
               recompute=sorted(set(plan.recompute.values())), residency=sorted(set(plan.residency.values())))
    if torch.cuda.is_available():
        row.update(peak_allocated_mib=round(torch.cuda.max_memory_allocated() / MiB),
                   peak_reserved_mib=round(torch.cuda.max_memory_reserved() / MiB))
    emit(**row)


CHECKS = {"reserve": reserve, "ring": ring, "experts": experts, "train": train}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny sizes (to try the code on a CPU)")
    ap.add_argument("--only", default=",".join(CHECKS))
    a = ap.parse_args(argv)
    failed = 0
    for name in a.only.split(","):
        t0 = time.perf_counter()
        try:
            CHECKS[name](a.small)
        except Exception:                # a benchmark: report the failure, go on with the next check
            failed += 1
            emit(check=name, failed=traceback.format_exc()[-1500:])
        print(f"# {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    for r in ROWS:
        print(" | ".join(f"{k}={v}" for k, v in r.items() if k != "failed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
