"""A pool of real CPU ranks (gloo) shared by the whole test session.

Forking from a parent that has already imported torch and torch.distributed.tensor
makes a rank cost a fork instead of a 3-7 s torchrun import; keeping the ranks
alive between tests makes a multi-process test cost one round trip.

    def _sum(rank, world_size, x):          # module level: pickled by reference
        t = torch.tensor([x * (rank + 1.0)])
        dist.all_reduce(t)
        return t.item()

    get_pool(4).run(_sum, 1.0)              # -> [10.0, 10.0, 10.0, 10.0]
"""

import atexit
import gc
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from multiprocessing.connection import wait

import torch
import torch._dynamo  # noqa: F401  DTensor's first op imports it lazily: 3 s in every rank
import torch.distributed as dist
import torch.distributed.tensor  # noqa: F401  imported before fork so ranks need not

_STOP = b"stop"
# Called once in this process before its first pool forks (conftest.py adds autopar's): whatever they
# leave warm (lazy imports, torch.export's and the solver's first-call setup) every rank inherits
# instead of paying it itself.
before_first_fork = []


class RankError(RuntimeError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


def _worker(rank, world_size, init_file, conn, parent_pid):
    # Ctrl-C belongs to pytest, which then stops the pool through shutdown_all().
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    conn.send(("ready", os.getpid()))
    while True:
        # Poll so an orphaned rank exits when pytest dies without stopping it.
        if not conn.poll(1.0):
            if os.getppid() != parent_pid:
                break
            continue
        try:
            msg = conn.recv_bytes()
        except EOFError:
            break
        if msg == _STOP:
            break
        try:
            fn, args = pickle.loads(msg)
            # Plain pickle (not multiprocessing's tensor-in-shared-memory reducers):
            # results are copied, so nothing ties them to this process. Process groups made by
            # a task stay: autopar caches one DeviceMesh per mesh shape, so they are reused.
            reply = ("ok", pickle.dumps(fn(rank, world_size, *args)))
        except BaseException:
            reply = ("error", traceback.format_exc())
        conn.send(reply)
    dist.destroy_process_group()
    conn.close()


class RankPool:
    """`world_size` forked ranks in one gloo process group, running tasks on demand."""

    def __init__(self, world_size, startup_timeout=60):
        self.world_size = world_size
        self.alive = False
        while before_first_fork:
            before_first_fork.pop(0)()
        self._tmpdir = tempfile.mkdtemp(prefix="autopar_rank_pool_")
        init_file = os.path.join(self._tmpdir, "store")  # must not exist yet: a fresh FileStore
        # what the parent holds (torch, transformers, its warm caches) is never garbage in a rank: frozen,
        # a rank's collections skip it instead of walking it (and copying its pages, written by the walk);
        # the parent's garbage is collected first, so that none is kept frozen
        gc.collect()
        gc.freeze()
        ctx = mp.get_context("fork")
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world_size, init_file, child_end, os.getpid()),
                               name=f"rank{rank}/{world_size}", daemon=True)
            proc.start()
            child_end.close()
            self._conns.append(parent_end)
            self._procs.append(proc)
        # the ranks keep theirs frozen; this process thaws its own, as it was before the fork: frozen, its
        # planning would never thaw what the planner freezes (planner/solve.py frozen_gc: nothing is
        # thawed where something was frozen before) and would walk the whole frozen heap to learn that
        # (gc.get_freeze_count: 0.07 s a plan)
        gc.unfreeze()
        self.alive = True
        replies = self._collect(startup_timeout, what="start")
        self.pids = [pid for _, pid in replies]

    def run(self, fn, *args, timeout=120, grace=10):
        """Call fn(rank, world_size, *args) on every rank; return the results ordered by rank.

        Raises RankError if any rank raised. If a rank hangs (for instance in a collective
        that a failed rank never joined) for `grace` seconds after another failed, or past
        `timeout`, the pool is killed: the next get_pool() call starts a fresh one.
        """
        if not self.alive:
            raise RuntimeError(f"rank pool of {self.world_size} is dead; use get_pool()")
        task = pickle.dumps((fn, args))
        try:
            for conn in self._conns:
                conn.send_bytes(task)
            replies = self._collect(timeout, grace=grace, what=getattr(fn, "__name__", repr(fn)))
        except (OSError, KeyboardInterrupt):
            self.kill()  # a rank is gone or the task was interrupted: state unknown
            raise
        errors = [f"--- rank {r} ---\n{p}" for r, (s, p) in enumerate(replies) if s == "error"]
        if errors:
            raise RankError(f"{len(errors)} of {self.world_size} ranks raised:\n" + "\n".join(errors))
        return [pickle.loads(p) for _, p in replies]

    def _collect(self, timeout, grace=None, what="task"):
        """One reply per rank; kills the pool on a dead rank, a timeout or an expired grace."""
        replies = [None] * self.world_size
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self._conns))
        problem = None
        while pending and problem is None:
            left = deadline - time.monotonic()
            # Only the rank holds its pipe's other end, so a dead rank reads as EOF here.
            ready = wait(list(pending.values()), timeout=max(0.0, left))
            if not ready:
                problem = (f"hung {grace} s after a rank raised" if any(p and p[0] == "error" for p in replies)
                           else f"timed out after {timeout} s")
            for conn in ready:
                rank = self._conns.index(conn)
                try:
                    replies[rank] = conn.recv()
                except (EOFError, OSError):
                    self._procs[rank].join(1)
                    problem = f"rank {rank} died (exit code {self._procs[rank].exitcode})"
                    break
                del pending[rank]
                if grace is not None and replies[rank][0] == "error":
                    deadline = min(deadline, time.monotonic() + grace)
        if problem:
            self.kill()
            done = [f"--- rank {r} ---\n{p[1]}" for r, p in enumerate(replies) if p and p[0] == "error"]
            msg = (f"rank pool of {self.world_size}: {what}: {problem}; ranks {sorted(pending)} "
                   f"did not answer; pool killed.\n" + "\n".join(done))
            raise (RankError if done else TimeoutError)(msg)
        return replies

    def shutdown(self, timeout=10):
        """Stop the ranks cleanly (they destroy their process group), then kill stragglers."""
        if self.alive:
            for conn in self._conns:
                try:
                    conn.send_bytes(_STOP)
                except OSError:
                    pass
            deadline = time.monotonic() + timeout
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self):
        self.alive = False
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        shutil.rmtree(self._tmpdir, ignore_errors=True)


_pools = {}


def get_pool(world_size):
    """The session's pool of `world_size` ranks, started (or restarted, if dead) on demand."""
    pool = _pools.get(world_size)
    if pool is None or not pool.alive:
        pool = _pools[world_size] = RankPool(world_size)
    return pool


def shutdown_all():
    while _pools:
        _pools.popitem()[1].shutdown()


atexit.register(shutdown_all)
