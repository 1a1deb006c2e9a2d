"""autopar demo: a small GPT planned and trained on 4 CPU processes (gloo) over a 2x2 mesh.

    make demo                      # or: torchrun --nproc-per-node 4 examples/demo_gpt.py

Rank 0 plans and prints the report; every rank trains with the plan; rank 0 also trains a
single-process copy and prints both loss curves, which must agree.
"""
from __future__ import annotations

import copy
import logging
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import autopar  # noqa: E402
from models import GPT, gpt_inputs  # noqa: E402

STEPS = 5


def main() -> None:
    # DTensor notes every multi-axis gather it splits in two; the plan already prices that
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(vocab=512, seq=128, hidden=256, heads=8, layers=2)
    reference = copy.deepcopy(model)
    batches = [gpt_inputs(batch=16, seq=128, vocab=512, seed=s) for s in range(STEPS)]
    mesh = autopar.Mesh((2, 2), axis_names=("dp", "tp"), device="cpu")

    plan = autopar.plan(model, batches[0], mesh)
    if rank == 0:
        print(plan.report(), "\n", flush=True)
    dmodel = autopar.autoparallelize(model, mesh, batches[0], plan=plan)
    opt = torch.optim.AdamW(dmodel.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    if rank == 0:
        print(f"{'step':>4} {'autopar (4 ranks)':>18} {'single process':>15} {'rel. diff':>11}")
    worst = 0.0
    for step, batch in enumerate(batches):
        loss = dmodel(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = reference(*batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        diff = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        worst = max(worst, diff)
        if rank == 0:
            print(f"{step:>4} {loss.item():>18.6f} {ref_loss.item():>15.6f} {diff:>11.2e}", flush=True)
    if rank == 0:
        print(f"\nlosses agree with the single-process run to {worst:.1e} ({'OK' if worst < 1e-5 else 'MISMATCH'})")
    dist.destroy_process_group()
    if worst >= 1e-5:
        sys.exit(1)


if __name__ == "__main__":
    if "RANK" not in os.environ:     # started directly: launch 4 local ranks with torchrun
        from torch.distributed.run import main as torchrun
        sys.exit(torchrun(["--standalone", "--nproc-per-node", "4", __file__]))
    main()
