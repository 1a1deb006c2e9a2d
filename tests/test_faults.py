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
from dist_checks import shard_happy_profile  # noqa: E402
from models import MLP  # noqa: E402

WORLD, TIMEOUT = 3, 4.0


def _rank(rank, init_file, fault, conn):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = MLP(d_in=12, hidden=24, d_out=12, depth=1)
    x = torch.randn(6, 12, generator=torch.Generator().manual_seed(0))
    mesh = autopar.Mesh((WORLD,), ("tp",), device=shard_happy_profile())
    dmodel = autopar.autoparallelize(model, mesh, (x,), collective_timeout=TIMEOUT)
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


@pytest.mark.parametrize("fault", ["hung", "killed"])
def test_dead_or_hung_rank_is_named_within_the_timeout(fault):
    ctx = mp.get_context("fork")
    init_file = os.path.join(tempfile.mkdtemp(prefix="autopar_faults_"), "store")
    pipes = [ctx.Pipe(duplex=False) for _ in range(WORLD)]
    procs = [ctx.Process(target=_rank, args=(r, init_file, fault, pipes[r][1]), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        replies = []
        for r in range(WORLD - 1):
            assert pipes[r][0].poll(120), f"rank {r} did not answer"
            replies.append(pipes[r][0].recv())
    finally:
        for p in procs:                         # the hung rank is still asleep: end it
            p.join(1)
            if p.is_alive():
                p.kill()
                p.join()
    for msg, seconds in replies:
        assert msg.startswith("CollectiveError"), msg
        assert f"rank {WORLD - 1} (entered" in msg and "reshard over tp" in msg and "died or hangs" in msg, msg
        assert seconds < TIMEOUT + 3, (seconds, msg)
