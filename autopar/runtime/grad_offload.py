"""Gradients on the host: `plan.offload["gradients:<layer or parameter FQN>"] == "host"`.

A post-accumulate-grad hook on each such parameter copies its local gradient shard into the
module's `HostPool` as soon as autograd has accumulated it, and drops the device gradient
(`param.grad = None`), so the device never holds more than the gradients still being made. The
parameter's reduction over the data axes must be final by then: `GradSync` leaves these parameters
out of its buckets (their `Reshard` reduces them in the backward, `grad_sync.py`). A second backward
before the step adds into the host copy (gradient accumulation). `dmodel.optimizer(...)`
(`optimizer.py`) brings each gradient back to the device for its own update, one parameter at a
time, and `zero_grad` drops the host copies.

Why hooks of our own and not torch's CPU offload (FSDP2's `CPUOffloadPolicy`): that one keeps the
parameters on the host too and steps there; here only the gradient moves, by the plan's decision
per layer, and the optimizer's tier is another decision (`optimizer.py`).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .offload import HostPool, host_scope
from .optimizer import offloaded


class GradOffload:
    """The host copies of the offloaded gradients of one module (see module docstring)."""

    def __init__(self, module: torch.nn.Module, offload: dict[str, str], pool: HostPool):
        self.pool = pool
        moved = offloaded(module, offload, "gradients")
        self.params = {names[0]: p for names, p, _ in moved}
        self.aliases = {n for names, _, _ in moved for n in names}
        self.host: dict[str, torch.Tensor] = {}          # FQN -> the local gradient shard, on the host
        for fqn, p in self.params.items():
            p.register_post_accumulate_grad_hook(lambda p, fqn=fqn: self._out(fqn, p))

    @torch.no_grad()
    def _out(self, fqn: str, p: torch.nn.Parameter) -> None:
        local = _local(p.grad)
        if fqn in self.host:
            with host_scope():
                self.host[fqn].add_(local.to(self.host[fqn].device))
        else:
            self.host[fqn] = self.pool.put(local)
        p.grad = None

    def has(self, p: torch.nn.Parameter) -> bool:
        return any(q is p for q in self.params.values())

    def grad(self, fqn: str) -> torch.Tensor | None:
        """The host copy of a parameter's local gradient shard (None: none made since `clear`)."""
        return self.host.get(fqn)

    def back(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """A device copy of parameter p's gradient, in p's layout (None: no gradient)."""
        fqn = next(f for f, q in self.params.items() if q is p)
        host = self.host.get(fqn)
        if host is None:
            return None
        local = host.to(_local(p).device, copy=True, non_blocking=host.is_pinned())
        if isinstance(p, DTensor):
            return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        return local

    def clear(self) -> None:
        self.host.clear()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
