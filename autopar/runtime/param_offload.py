"""Parameters off the device: `plan.offload["parameters:<layer or parameter FQN>"]` is "host" or "disk".

The parameter's stored local shard lives in the module's `HostPool` ("host": ZeRO-Infinity's / FSDP's
CPU offload of the sharded parameters) or in a writable memory-mapped file of its `DiskStore`
("disk": ZeRO-Infinity's parameters on NVMe). Each use brings it to the device and lets it go again:

* forward: a `FetchParam` graph op after the parameter's placeholder copies the shard to the device
  (`to(copy=True)`: differentiable, so the gradient flows back to the host parameter and is
  accumulated there, in the host pool's storage);
* the device copy is recorded in the `GatheredCopies` registry as "regather" with the host shard
  as its source, so the saved-tensor router (memory.py) keeps only the host shard for the backward
  and brings a device copy back when the backward unpacks it (`RegatheredCopy.load`); the forward's
  copy is freed once the forward no longer uses it;
* a parameter the plan also gathers (a `GatherCopy` after the fetch) is re-gathered in the backward
  from the host shard, the same collective as in the forward.

Why our own graph op and not FSDP2's `CPUOffloadPolicy`: that policy runs only inside
`fully_shard`'s parameter groups (its all-gather copies the host shards in) and steps the
optimizer on the host for every offloaded parameter; here the fetch is one more op of the rank
graph, the residency and optimizer tier stay separate decisions, and the copies are tracked by the
same saved-tensor machinery as re-gathered copies. The optimizer step updates the host shard (or
the mapped file) in place (`dmodel.optimizer`); on a CPU mesh host and device are the same RAM and
the pool is what tells them apart (offload.py).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from .offload import DiskStore, HostPool
from .optimizer import offloaded
from .regather import GatheredCopies


def offloaded_parameters(module: torch.nn.Module, offload: dict[str, str], pool: HostPool,
                         disk: Callable[[], DiskStore]) -> dict[str, tuple[torch.nn.Parameter, str]]:
    """FQN (every alias) -> (a parameter whose local shard is a `pool` copy of the module's, or a mapped
    file of `disk()`, its tier), for the parameters the plan puts on the host or on disk; the caller
    registers them in place of the old ones."""
    moved: dict[str, tuple[torch.nn.Parameter, str]] = {}
    for names, p, tier in offloaded(module, offload, "parameters", ("host", "disk")):
        local = p.to_local() if isinstance(p, DTensor) else p
        with torch.no_grad():
            if tier == "host":
                stored = pool.put(local)
            else:
                stored = disk().mapped(tuple(local.shape), local.dtype)
                stored.copy_(local)
            if isinstance(p, DTensor):
                stored = DTensor.from_local(stored, p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
        q = torch.nn.Parameter(stored, requires_grad=p.requires_grad)
        moved.update({n: (q, tier) for n in names})
    return moved


class FetchParam(torch.nn.Module):
    """Graph op: `w = self.fetch_w(p_w)`: a device copy of a host parameter (see module docstring)."""

    def __init__(self, key: str, device: torch.device, copies: GatheredCopies):
        super().__init__()
        self.key, self.device = key, device
        self._copies = [copies]          # in a list: not a submodule

    def forward(self, p: DTensor) -> DTensor:
        local = p.to_local().to(self.device, copy=True)
        y = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        self._copies[0].add(y, p, tuple(p.placements), "regather")
        return y

    def extra_repr(self) -> str:
        return f"{self.key} from off the device"


def insert_fetches(gm: fx.GraphModule, param_of: dict[str, str], off_device: frozenset[str], device: torch.device,
                   copies: GatheredCopies) -> bool:
    """A `FetchParam` before the first use of each placeholder of a parameter off the device, feeding all its
    users; any inserted?"""
    done = False
    for node in list(gm.graph.nodes):
        fqn = param_of.get(node.name) if node.op == "placeholder" else None
        if fqn not in off_device:
            continue
        target = f"fetch_{node.name}"
        gm.add_submodule(target, FetchParam(fqn, device, copies))
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        first = min(node.users, key=order.__getitem__)
        # just before its first use, so that the forward's device copy lives only while it is used
        with gm.graph.inserting_before(first):
            fetch = gm.graph.call_module(target, (node,))
        node.replace_all_uses_with(fetch, delete_user_cb=lambda u: u is not fetch)
        done = True
    if done:
        gm.recompile()
    return done
