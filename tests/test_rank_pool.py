import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from rank_pool import RankError, get_pool


# Task functions live at module level: the ranks unpickle them by reference.
def _all_reduce(rank, world_size):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t.item()


def _dtensor_roundtrip(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2, 2))
    original = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    dt = distribute_tensor(original, mesh, [Shard(0), Shard(1), Replicate()])
    return tuple(dt.to_local().shape), torch.equal(dt.full_tensor(), original)


def _raise_on_rank_2(rank, world_size):
    if rank == 2:
        raise ValueError("rank two says no")
    return rank


def _raise_then_others_hang(rank, world_size):
    if rank == 0:
        raise ValueError("rank zero left early")
    dist.all_reduce(torch.ones(1))  # never completes: rank 0 is gone


def _pid(rank, world_size):
    return os.getpid()


def test_all_reduce_4_ranks(rank_pool):
    assert rank_pool(4).run(_all_reduce) == [10.0] * 4


def test_dtensor_8_ranks_2x2x2(rank_pool):
    assert rank_pool(8).run(_dtensor_roundtrip) == [((4, 4), True)] * 8


def test_raising_rank_reports_its_traceback_and_pool_survives(rank_pool):
    pool = rank_pool(4)
    with pytest.raises(RankError) as err:
        pool.run(_raise_on_rank_2)
    msg = str(err.value)
    assert "1 of 4 ranks raised" in msg and "--- rank 2 ---" in msg
    assert "ValueError: rank two says no" in msg and "--- rank 0 ---" not in msg
    assert rank_pool(4) is pool and pool.run(_all_reduce) == [10.0] * 4


def test_hung_ranks_kill_the_pool_and_a_fresh_one_follows(rank_pool):
    pool = rank_pool(4)
    with pytest.raises(RankError) as err:
        pool.run(_raise_then_others_hang, grace=2)
    assert "rank zero left early" in str(err.value) and "ranks [1, 2, 3] did not answer" in str(err.value)
    assert not pool.alive
    fresh = rank_pool(4)
    assert fresh is not pool and not set(fresh.pids) & set(pool.pids)
    assert fresh.run(_all_reduce) == [10.0] * 4


def test_consecutive_runs_reuse_the_same_ranks(rank_pool):
    pool = rank_pool(4)
    first = pool.run(_pid)
    assert first == pool.run(_pid) == pool.pids
    assert len(set(first)) == 4 and os.getpid() not in first
