"""A GPT of 1.2B parameters built on the meta device, run on 4 CPU ranks without any rank holding it whole.

    python benchmarks/bench_materialise.py [--hidden 2048] [--layers 24] [--vocab 8192] [--seq 32] [--batch 4]

The model (examples/models.py's GPT: tied embedding, pre-LN blocks) is built under
`torch.device("meta")`; rank 0 plans it for a (4,) "dp" CPU mesh with a memory budget below the
parameters and gradients of a replicated copy, so the plan stores them split (SGD: no optimizer state);
`autoparallelize(meta_model, ..., init="reset")` makes each rank's shards (equal to one process
initialising the whole model, bitwise: tests/test_large_models.py), one training step runs, the trained
module is written by `save_pretrained` (safetensors, from rank 0, one tensor at a time), freed, and loaded
again into a fresh meta model with `checkpoint=`.

Per rank it prints the peak resident memory growth (VmHWM after the phase minus VmRSS before the model
was made, the peak counter reset then: /proc/self/clear_refs; the load's from just before it, after the
first module was freed) against the limit `plan peak + largest parameter + 1 GiB`, and the seconds to
materialise (init), to train the step, to save and to load (`materialise`/`load`: making the shards alone;
`autoparallelize*`: the whole call, capture and planning included). Four full fp32 copies of the model and their gradients (39 GB) would not fit the
24 GiB machine this is measured on.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

WORLD = 4
GIB = 2 ** 30
# the allowance above the plan's predicted peak: one full parameter (made whole while
# initialising) plus 1 GiB (the allocator's and the libraries' slack)
SLACK_BYTES = GIB
# the budget as a fraction of a replicated copy's parameters + gradients: below 1, so the plan must split them
BUDGET_FRACTION = 0.6


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")            # resets VmHWM to the current RSS (Linux >= 4.0)
    return _status("VmRSS")


def _rank(rank, world, args, directory):
    import torch
    import autopar
    from autopar.runtime import weights as W
    from models import GPT, gpt_inputs
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(vocab=args.vocab, seq=args.seq, hidden=args.hidden, heads=args.heads, layers=args.layers)
    inputs = gpt_inputs(batch=args.batch, seq=args.seq, vocab=args.vocab)
    n_params = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    budget = BUDGET_FRACTION * 2 * 4 * n_params
    mesh = autopar.Mesh((world,), ("dp",), device="cpu")
    times = {}
    original = W.Weights.materialise

    def timed(self, *a, **kw):
        t = time.perf_counter()
        out = original(self, *a, **kw)
        times["load" if self.checkpoint else "materialise"] = time.perf_counter() - t
        return out
    W.Weights.materialise = timed
    gc.collect()
    base = _reset_peak()
    t = time.perf_counter()
    dmodel = autopar.autoparallelize(model, mesh, inputs, init="reset", memory_budget=budget,
                                     optimizer="sgd", symbolic=False, time_limit=60)
    times["autoparallelize"] = time.perf_counter() - t
    plan = dmodel.plan
    after_init = _status("VmHWM") - base
    opt = torch.optim.SGD(dmodel.parameters(), lr=1e-3)
    t = time.perf_counter()
    loss = dmodel(*inputs)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    times["step"] = time.perf_counter() - t
    after_step = _status("VmHWM") - base
    t = time.perf_counter()
    dmodel.save_pretrained(directory, max_shard_size="2GB")
    times["save"] = time.perf_counter() - t
    del dmodel, opt, loss
    gc.collect()
    before_load = _reset_peak()         # the load measured on its own, from what stays after the first module
    t = time.perf_counter()
    loaded = autopar.autoparallelize(model, mesh, inputs, plan=plan, checkpoint=directory)
    times["autoparallelize_checkpoint"] = time.perf_counter() - t
    after_load = _status("VmHWM") - before_load
    del loaded
    W.Weights.materialise = original
    stored = sorted(set(tuple(v) for v in plan.placements.values()))
    return {"rank": rank, "params": n_params, "largest_param_bytes": largest, "budget_bytes": budget,
            "plan_peak_bytes": plan.estimate.peak_memory_bytes, "stored_layouts": stored,
            "rss_growth_after_init": after_init, "rss_growth_after_step": after_step,
            "rss_growth_of_load": after_load, "rss_left_before_load": before_load - base,
            "limit_bytes": plan.estimate.peak_memory_bytes + largest + SLACK_BYTES,
            "seconds": {k: round(v, 2) for k, v in times.items()}}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args(argv)
    from rank_pool import RankPool
    pool = RankPool(WORLD)
    try:
        with tempfile.TemporaryDirectory(prefix="autopar_bench_materialise_") as directory:
            rows = pool.run(_rank, args, directory, timeout=3000)
    finally:
        pool.shutdown()
    for r in rows:
        r["within_limit"] = max(r["rss_growth_after_step"], r["rss_growth_of_load"]) <= r["limit_bytes"]
        print(json.dumps(r, sort_keys=True))
    g = lambda b: f"{b / GIB:6.2f}"    # noqa: E731
    print(f"\nGPT {rows[0]['params'] / 1e9:.2f}B params on {WORLD} CPU ranks (GiB per rank; limit = plan peak "
          f"{g(rows[0]['plan_peak_bytes'])} + largest param {g(rows[0]['largest_param_bytes'])} + 1)")
    print("rank  init   step   load  limit  within  materialise_s  step_s  save_s  load_s")
    for r in rows:
        s = r["seconds"]
        print(f"{r['rank']:4d} {g(r['rss_growth_after_init'])} {g(r['rss_growth_after_step'])} "
              f"{g(r['rss_growth_of_load'])} {g(r['limit_bytes'])}  {str(r['within_limit']):6s} "
              f"{s['materialise']:13.1f} {s['step']:7.1f} {s['save']:7.1f} {s['load']:7.1f}")
    return rows


if __name__ == "__main__":
    main()
