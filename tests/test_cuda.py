"""A plan runs on a CUDA device under NCCL as it does on CPU: trained as one process on the same GPU.
Skipped where no GPU is (CI); run on one with `pytest tests/test_cuda.py`.

The model makes its position ids with `torch.arange(..., device=idx.device)`: captured on CPU, that
factory call names the CPU; the program must make them on the rank's GPU."""
from __future__ import annotations

import copy
import multiprocessing as mp
import os

import pytest
import torch

import autopar
from dist_checks import rel
from models import GPT, gpt_inputs

TOL = 1e-4     # three SGD steps; TF32 is off on both sides

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _train(residency: str, port: int, out) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = GPT(vocab=64, seq=16, hidden=128, heads=4, layers=2)
        inputs = gpt_inputs(batch=8, seq=16, vocab=64)
        ref = copy.deepcopy(model).cuda()
        mesh = autopar.Mesh((1,), ("dp",), device="h100")
        pins = {n: ("S(0)",) for n, _ in model.named_parameters()}
        plan = autopar.plan(model, inputs, mesh, pins=pins, batch_axes=("dp",), residency=residency,
                            memory_budget=float("inf"))
        dmodel = autopar.autoparallelize(model, mesh, inputs, plan=plan)
        opt, ref_opt = dmodel.optimizer(torch.optim.SGD, lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
        cuda_inputs = tuple(t.cuda() for t in inputs)
        worst = 0.0
        for _ in range(3):
            loss, ref_loss = dmodel(*cuda_inputs), ref(*cuda_inputs)
            loss.backward(), ref_loss.backward()
            worst = max(worst, rel(torch.as_tensor(float(loss)), ref_loss.detach().cpu()))
            params = dict(dmodel.named_parameters())
            worst = max(worst, *(rel(params[n].grad.full_tensor().cpu(), p.grad.cpu())
                                 for n, p in ref.named_parameters()))
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        params = dict(dmodel.named_parameters())
        devices = {str(p.device) for p in params.values()}
        worst = max(worst, *(rel(params[n].full_tensor().cpu(), p.cpu()) for n, p in ref.named_parameters()))
        out.put((worst, sorted(devices)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("residency", ["keep", "regather"])
def test_plan_trains_on_a_gpu_as_one_process(residency):
    ctx = mp.get_context("spawn")          # CUDA in a fresh process: the test process stays CUDA-free
    out = ctx.Queue()
    proc = ctx.Process(target=_train, args=(residency, 29531 + (residency == "regather"), out))
    proc.start()
    proc.join(300)
    assert proc.exitcode == 0, f"the rank exited with {proc.exitcode}"
    worst, devices = out.get(timeout=10)
    assert devices == ["cuda:0"], devices
    assert worst < TOL, worst
