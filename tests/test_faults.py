"""A dead or hung rank: with `collective_timeout`, the others raise CollectiveError naming it and
the collective, within the timeout (not gloo's message, not a hang).

These jobs lose a rank, so they run in their own forked gloo job (not the shared rank pool)."""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import autopar  # noqa: E402
from dist_checks import LAYOUTS_ONLY, shard_happy_profile  # noqa: E402
from models import MLP  # noqa: E402

WORLD, TIMEOUT = 3, 4.0


def _rank(rank, init_file, fault, conn):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = MLP(d_in=12, hidden=24, d_out=12, depth=1)
    x = torch.randn(6, 12, generator=torch.Generator().manual_seed(0))
    mesh = autopar.Mesh((WORLD,), ("tp",), device=shard_happy_profile())
    dmodel = autopar.autoparallelize(model, mesh, (x,), collective_timeout=TIMEOUT, **LAYOUTS_ONLY)
    (dmodel(x) ** 2).sum().backward()          # a step every rank takes
    if rank == WORLD - 1:
        if fault == "killed":
            os._exit(1)
        time.sleep(3 * TIMEOUT)                # hangs past the others' timeout
        os._exit(0)
    t0 = time.monotonic()
    try:
        (dmodel(x) ** 2).sum().backward()
        conn.send(("no error", time.monotonic() - t0))
    except autopar.AutoparError as e:
        conn.send((f"{type(e).__name__}: {e}", time.monotonic() - t0))
    os._exit(0)                                # the job is broken: leave without tearing down


def _job(target, *args) -> list:
    """Run target(rank, init_file, *args, conn) on WORLD forked ranks; the replies of those that answer."""
    ctx = mp.get_context("fork")
    init_file = os.path.join(tempfile.mkdtemp(prefix="autopar_faults_"), "store")
    pipes = [ctx.Pipe(duplex=False) for _ in range(WORLD)]
    procs = [ctx.Process(target=target, args=(r, init_file, *args, pipes[r][1]), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    replies = []
    try:
        for r in range(WORLD):
            if pipes[r][0].poll(120 if r < WORLD - 1 else 1):
                replies.append(pipes[r][0].recv())
    finally:
        for p in procs:                         # a hung rank is still asleep: end it
            p.join(1)
            if p.is_alive():
                p.kill()
                p.join()
    return replies


@pytest.mark.parametrize("fault", ["hung", "killed"])
def test_dead_or_hung_rank_is_named_within_the_timeout(fault):
    replies = _job(_rank, fault)
    assert len(replies) == WORLD - 1
    for msg, seconds in replies:
        assert msg.startswith("CollectiveError"), msg
        assert f"rank {WORLD - 1} (entered" in msg and "reshard over tp" in msg and "died or hangs" in msg, msg
        assert seconds < TIMEOUT + 3, (seconds, msg)


def _model_and_batch():
    torch.manual_seed(0)
    return MLP(d_in=12, hidden=24, d_out=12, depth=1), torch.randn(6, 12, generator=torch.Generator().manual_seed(0))


def _train(rank, init_file, ckpt, resume, conn):
    """Steps 1-2 then a checkpoint and a crash (rank 2 dies), or (resume) load it and take steps 3-4."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    model, x = _model_and_batch()
    mesh = autopar.Mesh((WORLD,), ("tp",), device=shard_happy_profile())
    dmodel = autopar.autoparallelize(model, mesh, (x,), collective_timeout=TIMEOUT, **LAYOUTS_ONLY)
    opt = torch.optim.AdamW(dmodel.parameters(), lr=1e-2)
    losses = []

    def step():
        loss = (dmodel(x) ** 2).mean()
        loss.backward()
        opt.step(), opt.zero_grad()
        losses.append(float(loss))

    if resume:
        state = {"model": dmodel.state_dict(), "optim": get_state_dict(dmodel, opt)[1]}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(dmodel, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step(), step()
        conn.send(losses)
    else:
        step(), step()
        model_sd, optim_sd = get_state_dict(dmodel, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
        if rank == WORLD - 1:
            os._exit(1)                         # the crash
        try:
            step()
            conn.send("no error")
        except autopar.CollectiveError as e:
            conn.send(str(e))
    os._exit(0)


def test_restarted_job_resumes_from_a_dcp_checkpoint(tmp_path):
    """Train, checkpoint with torch.distributed.checkpoint, lose a rank; a new job loads the checkpoint
    and its next losses are those of an uninterrupted single-process run."""
    model, x = _model_and_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expect = []
    for _ in range(4):
        loss = (model(x) ** 2).mean()
        loss.backward()
        opt.step(), opt.zero_grad()
        expect.append(float(loss))
    ckpt = str(tmp_path / "ckpt")
    crashed = _job(_train, ckpt, False)
    assert len(crashed) == WORLD - 1 and all(f"rank {WORLD - 1} (entered" in m for m in crashed), crashed
    resumed = _job(_train, ckpt, True)
    assert len(resumed) == WORLD
    for losses in resumed:
        assert losses == resumed[0]
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, expect[2:])), (losses, expect)
