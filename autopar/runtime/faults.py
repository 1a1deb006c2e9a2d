"""A dead or hung rank: an error naming it and the collective, within a set time.

`autoparallelize(..., collective_timeout=30.0)` watches every collective of the per-rank program
(each reshard, forward and backward, goes through `reshard.to_layout`):

* the mesh's process groups wait at most that long for a peer (gloo's and NCCL's own timeout);
* before each collective, a rank records in the job's rendezvous store how many collectives it
  has entered and what this one is ("all_gather over tp: (S(0),) -> (R,)");
* when a collective fails (a peer closed its connections: it died; the timeout passed: it
  hangs), the rank reads every rank's record and raises `CollectiveError` naming the ranks that
  never reached this collective and what it was, instead of gloo's or NCCL's message.

Without the option nothing is recorded (a store write per collective is a round trip to it).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch.distributed as dist

from ..compat import default_store, set_group_timeout
from ..errors import CollectiveError

__all__ = ["Watch", "watch_mesh", "watch_of", "watched"]

_KEY = "autopar/collectives/{}"
_WATCHES: dict[int, Watch] = {}       # id(DeviceMesh) -> its watch


@dataclass
class Watch:
    timeout_s: float
    rank: int
    world: int
    store: object
    entered: int = 0
    log: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def collective(self, what: str):
        self.entered += 1
        self.store.set(_KEY.format(self.rank), f"{self.entered}|{what}")
        try:
            yield
        except RuntimeError as e:      # gloo / NCCL: a peer closed its connection, or the timeout passed
            behind = self.behind()
            if not behind and not _is_comm_failure(e):
                raise                   # not a collective's failure (a bug elsewhere): as it is
            raise CollectiveError(self.diagnose(what, behind, e)) from e

    def diagnose(self, what: str, behind: list[str], e: Exception) -> str:
        who = ("; ".join(behind) + ": it died or hangs") if behind else \
            "every rank entered it: one died or hangs inside it"
        return (f"rank {self.rank}: collective #{self.entered} ({what}) failed within the {self.timeout_s:g} s "
                f"collective timeout: never reached by {who}. ({type(e).__name__}: {str(e).splitlines()[0][:200]})")

    def behind(self) -> list[str]:
        """The ranks that have not entered this rank's current collective, with what they did last."""
        out = []
        for r in range(self.world):
            key = _KEY.format(r)
            n, last = (0, "none") if not self.store.check([key]) else self._record(key)
            if r != self.rank and n < self.entered:
                out.append(f"rank {r} (entered {n}; its last: {last})")
        return out

    def _record(self, key: str) -> tuple[int, str]:
        n, _, last = self.store.get(key).decode().partition("|")
        return int(n), last


def _is_comm_failure(e: Exception) -> bool:
    text = str(e).lower()
    return isinstance(e, dist.DistBackendError) or any(w in text for w in ("gloo", "nccl", "timed out", "connection"))


def watch_mesh(device_mesh, timeout_s: float) -> Watch:
    """Watch `device_mesh`'s collectives (see the module docstring); its groups get the timeout."""
    for group in device_mesh.get_all_groups():
        set_group_timeout(group, timeout_s)
    w = _WATCHES.get(id(device_mesh))
    if w is None or w.timeout_s != timeout_s:
        w = _WATCHES[id(device_mesh)] = Watch(timeout_s, dist.get_rank(), dist.get_world_size(), default_store())
        w.store.set(_KEY.format(w.rank), "0|none")
    return w


def watch_of(device_mesh) -> Watch | None:
    return _WATCHES.get(id(device_mesh))


def watched(device_mesh, what):
    """A context around one collective on `device_mesh`: `Watch.collective` where the mesh is
    watched, else nothing. `what`: the collective's description, or a function making it (called
    only when watched: the unwatched hot path builds no string)."""
    watch = watch_of(device_mesh)
    if watch is None:
        return contextlib.nullcontext()
    return watch.collective(what() if callable(what) else what)
