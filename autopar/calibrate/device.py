"""What a calibrating rank measures on its own device, every rank at once (`launch.py` runs it):
the matmul rate per dtype and fused attention's time (`measure_rates`, in rounds spread over the
calibration), per-op overhead, a small matmul's ramp, memory bandwidth, the dropout's random
numbers, the host link (GPU), the disk tier and the optimizer step on the host."""
from __future__ import annotations

import os
import statistics
import tempfile

from .rank import device_sync, timeit, timeit_together


# compute rates (matmul, fused attention) are measured this many times, spread over the calibration
# (before and after each phase), and their median kept: on a shared machine one round can catch a
# passing slowdown (CPU, 4 ranks: one round 34 GFLOP/s, the rounds on either side 49-52)
RATE_ROUNDS = 3


def measure_rates(device: str, quick: bool, sync) -> dict:
    """One round of the compute rates: `matmul_flops` per dtype and fused attention's time."""
    import torch
    n = (512 if quick else 1536) if device == "cpu" else (4096 if quick else 8192)
    reps = 3 if quick else 7
    out: dict = {"matmul_flops": {}, "matmul_n": n}
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    for key, dt in dtypes.items():
        a = torch.randn(n, n, device=device).to(dt)
        b = torch.randn(n, n, device=device).to(dt)
        c = torch.empty(n, n, device=device, dtype=dt)
        # a dtype without a fast kernel (fp16 on most CPUs) would take minutes at full size; the ranks
        # agree on the size (the fastest probe decides: a rank whose probe was slowed by a neighbour
        # must not time a smaller product while the others' larger ones hold the barrier)
        probe = timeit(lambda: torch.mm(a[:128, :128], b[:128, :128]), 1, sync)
        m = n if device == "cuda" or _fastest(2 * 128 ** 3 / probe) > 2e10 else 256
        a2, b2, c2 = a[:m, :m].contiguous(), b[:m, :m].contiguous(), c[:m, :m].contiguous()
        t = timeit_together(lambda: torch.mm(a2, b2, out=c2), reps, sync)
        out["matmul_flops"][key] = 2 * m ** 3 / t
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        a = torch.randn(n, n, device=device)
        t = timeit_together(lambda: torch.mm(a, a), reps, sync)
        out["matmul_flops"]["tf32"] = 2 * n ** 3 / t
        torch.backends.cuda.matmul.allow_tf32 = False
    out["attention"] = _measure_attention(device, reps, sync)
    return out


def _fastest(rate: float) -> float:
    """The highest of the ranks' `rate` (this rank's alone without a process group)."""
    import torch
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return rate
    t = torch.tensor([rate], dtype=torch.float64)
    dist.all_reduce(t, dist.ReduceOp.MAX)      # a CPU tensor: gloo (GPUs never probe)
    return float(t)


def median_rates(rounds: list[dict]) -> dict:
    """The rounds of `measure_rates` as one: each rate's median over the rounds (`rounds`: them all)."""
    med = statistics.median
    att = rounds[0]["attention"]
    return {"matmul_flops": {k: med(r["matmul_flops"][k] for r in rounds) for k in rounds[0]["matmul_flops"]},
            "matmul_n": rounds[0]["matmul_n"],
            "attention": {**att, "seconds": med(r["attention"]["seconds"] for r in rounds)}, "rounds": rounds}


def measure_device(device: str, quick: bool) -> dict:
    """Everything measured on one device but the compute rates' later rounds (`launch._rank_main`)."""
    import torch
    sync = device_sync(device)
    reps = 3 if quick else 7
    out: dict = measure_rates(device, quick, sync)
    tiny = torch.randn(16, device=device)
    out["kernel_overhead"] = timeit_together(lambda: tiny + 1.0, 200 if quick else 1000, sync)
    # ramp: a small fp32 matmul's time beyond its ideal time and the per-op overhead
    s = 64
    x = torch.randn(s, s, device=device)
    y = torch.empty(s, s, device=device)
    t_small = timeit_together(lambda: torch.mm(x, x, out=y), 200 if quick else 1000, sync)
    out["matmul_ramp_time"] = max(t_small - 2 * s ** 3 / out["matmul_flops"]["float32"] - out["kernel_overhead"], 0.0)
    nbytes = (16 if quick else 256) * 2 ** 20
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = timeit_together(lambda: dst.copy_(src), 3 * reps, sync)
    out["memory_bandwidth"] = 2 * nbytes / t
    # random numbers: a dropout's time beyond the bytes it moves (read x, write y and a 1-byte mask);
    # a CPU's generator is slow, so a smaller tensor there
    n_el = (nbytes if device == "cuda" else min(nbytes, 16 * 2 ** 20)) // 4
    # at p = 0.1, the usual training rate: a CPU's sampling is branchy, so its cost depends on p
    # the runtime's dropout (a counter-based hash of each element's place, runtime/rng.py), as it runs
    from ..runtime.rng import draw
    x = src[:n_el]
    t = timeit_together(lambda: draw(x, 0.1, 1, (0,), (n_el,), 0), reps, sync)
    out["rng_element_time"] = max(t - 9 * n_el / out["memory_bandwidth"], 0.0) / n_el
    if device == "cuda":
        host = torch.empty(nbytes // 4, pin_memory=True)
        t = timeit(lambda: src.copy_(host, non_blocking=True), reps, sync)
        out["host_bandwidth"] = nbytes / t
    out.update(_measure_offload_tiers(quick))
    return out


# fused attention timed at a transformer layer's shape: (batch, heads, sequence, head dim), causal
ATTENTION_SHAPE = {"cpu": (4, 8, 128, 32), "cuda": (4, 16, 2048, 128)}


def _measure_attention(device: str, reps: int, sync) -> dict:
    """SDPA's forward + backward (causal; fp32 on CPU, bf16 on GPU) with the forward FLOPs and bytes as
    the planner counts them (FlopCounterMode; inputs read + output written): `calibrate` turns it
    into `attention_efficiency` with the planner's own price (`compute.op_times`)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = (torch.randn(ATTENTION_SHAPE[device], device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:    # on meta tensors, as passes/shape_prop counts
        F.scaled_dot_product_attention(*(t.to("meta") for t in (q, k, v)), is_causal=True)

    def step():
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad)
    return {"shape": list(q.shape), "dtype": str(dtype).removeprefix("torch."), "flops": fc.get_total_flops(),
            "bytes": 4 * q.numel() * q.element_size(), "seconds": timeit_together(step, reps, sync)}


def _measure_offload_tiers(quick: bool) -> dict:
    """The disk tier (a file written and synced, then read back memory-mapped, as the offload
    executor does) and the optimizer step on the host (AdamW over fp32 CPU tensors)."""
    import torch
    nbytes = (8 if quick else 64) * 2 ** 20
    data = torch.ones(nbytes // 4)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "probe.bin")

        def write(t: torch.Tensor) -> None:
            with open(path, "wb") as f:
                f.write(t.numpy().tobytes())
                f.flush()
                os.fsync(f.fileno())

        def read(n: int) -> None:
            torch.from_file(path, shared=False, size=n, dtype=torch.float32).sum()

        t_small = timeit(lambda: (write(data[:1024]), read(1024)), 5, lambda: None)
        t_big = timeit(lambda: (write(data), read(data.numel())), 2 if quick else 3, lambda: None)
    param = torch.nn.Parameter(torch.zeros(2 ** 18 if quick else 2 ** 20))
    param.grad = torch.ones_like(param)
    opt = torch.optim.AdamW([param], lr=1e-3)
    opt.step()
    t_opt = timeit(opt.step, 3 if quick else 5, lambda: None)
    return {"disk_bandwidth": 2 * nbytes / max(t_big - t_small, 1e-9), "disk_latency": t_small / 2,
            "host_optimizer_element_time": t_opt / param.numel()}
