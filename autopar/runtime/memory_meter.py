"""Live tensor bytes on this rank, counted storage by storage (device and host apart).

    meter = MemoryMeter(device_type="cpu")
    meter.track(*dmodel.parameters())           # what is alive before the step, if it should count
    with meter:
        loss = dmodel(x, y); loss.backward(); opt.step(); opt.zero_grad()
    meter.peak_device_bytes, meter.peak_host_bytes

A `TorchDispatchMode` sees every ATen op of the step, forward, backward (autograd runs its ops
through the dispatcher on this thread) and optimizer. An output whose storage is not one of the
op's inputs' storages is an allocation: its storage's bytes are added, and a finalizer on the
storage subtracts them when it is freed (on whichever thread drops its last reference: it queues the
address, and the counts change when next read or added to, on the thread that reads them). Views and
in-place results share an input's storage and add nothing. Tensors made outside the dispatcher (a numpy array wrapped by `torch.from_numpy`, a
memory-mapped file) are not allocations of this rank's allocator and are not counted.

Host and device: on an accelerator mesh a storage is host memory when it is on the CPU; on a CPU
mesh, when it is allocated inside `offload.host_scope()` (the host pool, the host optimizer step),
so that the host tier is measured apart from the "device" though both are the same RAM.
The numbers are exact for what they count (allocator bytes of live storages); on CUDA,
`torch.cuda.max_memory_allocated` measures the same device column from the allocator itself.
"""
from __future__ import annotations

import queue
import weakref

import torch
from torch.distributed.tensor import DTensor

from ..compat import TorchDispatchMode, pytree
from .offload import in_host_scope


class MemoryMeter(TorchDispatchMode):
    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type
        self._live: dict[int, tuple[int, bool]] = {}     # storage address -> (bytes, is host)
        self._device = self._host = 0
        self.peak_device_bytes = self.peak_host_bytes = 0
        # storages freed, by address: a storage's last reference may go on a collective backend's
        # worker thread (gloo's drops a finished work's tensors there), so its finalizer only queues
        # the address and the counts change on the thread that reads them (module docstring)
        self._freed: queue.SimpleQueue[int] = queue.SimpleQueue()

    def track(self, *tensors: torch.Tensor, host: bool = False) -> None:
        """Count tensors that exist already (parameters, gradients, optimizer state) from now on."""
        for t in tensors:
            if _plain(t):
                self._add(_local(t).untyped_storage(), host)

    @property
    def device_bytes(self) -> int:
        self._drain()
        return self._device

    @property
    def host_bytes(self) -> int:
        self._drain()
        return self._host

    def reset_peak(self) -> None:
        self._drain()
        self.peak_device_bytes, self.peak_host_bytes = self._device, self._host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_local(t).untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if _plain(t)}
        for t in pytree.tree_leaves(out):
            if _plain(t):
                storage = _local(t).untyped_storage()
                if storage.data_ptr() not in inputs:
                    self._add(storage, in_host_scope() or (storage.device.type == "cpu" and self.device_type != "cpu"))
        return out

    def _add(self, storage: torch.UntypedStorage, host: bool) -> None:
        self._drain()                    # an address freed elsewhere may be this storage's now
        ptr, n = storage.data_ptr(), storage.nbytes()
        if ptr == 0 or ptr in self._live:
            return
        self._live[ptr] = (n, host)
        if host:
            self._host += n
            self.peak_host_bytes = max(self.peak_host_bytes, self._host)
        else:
            self._device += n
            self.peak_device_bytes = max(self.peak_device_bytes, self._device)
        weakref.finalize(storage, self._freed.put, ptr)

    def _drain(self) -> None:
        """Subtract the storages freed since the last call (on any thread)."""
        while True:
            try:
                ptr = self._freed.get_nowait()
            except queue.Empty:
                return
            n, host = self._live.pop(ptr)
            if host:
                self._host -= n
            else:
                self._device -= n


def _plain(t) -> bool:
    """A tensor with storage of its own: plain, a Parameter, or a DTensor (its local shard). Other
    subclasses (a functional collective's AsyncCollectiveTensor) wrap a tensor some op allocated."""
    return type(t) in (torch.Tensor, torch.nn.Parameter, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
