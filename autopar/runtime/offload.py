"""The host and disk tiers: where offloaded tensors live, and how they move there and back.

* `HostPool`: host memory, counted. On a CUDA mesh its buffers are pinned CPU tensors filled with
  non-blocking copies; on a CPU mesh "host" and "device" are the same RAM, so the pool is what
  tells them apart: a tensor moved to the host tier is really copied into a pool buffer (and the
  device copy freed), the pool counts its live bytes, and everything allocated on the host's
  behalf (pool buffers, the host optimizer step's temporaries) is allocated inside `host_scope()`
  so that a memory meter books it to the host, not the device.
* `DiskStore`: one temporary directory per module (under `offload_dir`); each tensor is written
  to its own real file and read back memory-mapped (numpy.memmap, copy-on-write), copied to the
  device, and the file is removed when the last reference to it goes.
* `OffloadedTensor`: what a saved-tensor hook keeps for an offloaded activation; `load()` brings
  a device copy back. Host buffers and files are released when the handle is freed, which for a
  saved tensor is when autograd releases it after its backward node ran.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass

import numpy as np
import torch

_HOST_SCOPE = [0]


@contextlib.contextmanager
def host_scope():
    """Allocations in this block are on the host's behalf (see module docstring)."""
    _HOST_SCOPE[0] += 1
    try:
        yield
    finally:
        _HOST_SCOPE[0] -= 1


def in_host_scope() -> bool:
    return _HOST_SCOPE[0] > 0


@dataclass(slots=True)
class HostPool:
    """Host memory for offloaded tensors; `bytes` live now, `peak_bytes` the most at once."""
    pin: bool = False                  # pinned buffers and non-blocking copies (a CUDA mesh)
    bytes: int = 0
    peak_bytes: int = 0

    def put(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of t, counted until it is freed."""
        with host_scope(), torch.no_grad():
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
            buf.copy_(t, non_blocking=self.pin)
        self.adopt(buf)
        return buf

    def adopt(self, buf: torch.Tensor) -> None:
        """Count a host tensor made elsewhere (in `host_scope`) as pool memory until it is freed."""
        storage = buf.untyped_storage()
        self.bytes += storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        weakref.finalize(storage, self._free, storage.nbytes())

    def _free(self, n: int) -> None:
        self.bytes -= n


class DiskStore:
    """Files in a private temporary directory (removed with the store)."""

    def __init__(self, directory: str | None = None):
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="autopar_offload_", dir=directory)
        self._n = 0
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)

    def files(self) -> list[str]:
        return sorted(os.listdir(self.dir)) if os.path.isdir(self.dir) else []

    def new_path(self, tag: str) -> str:
        self._n += 1
        return os.path.join(self.dir, f"{self._n:08d}.{tag}")

    def write(self, t: torch.Tensor) -> str:
        """t's bytes to a new file; returns its path."""
        path = self.new_path("bin")
        _as_bytes(t.detach()).numpy().tofile(path)
        return path

    @staticmethod
    def read(path: str, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A device copy of a file written by `write`, read memory-mapped."""
        n = os.path.getsize(path)
        mapped = np.memmap(path, dtype=np.uint8, mode="c", shape=(n,)) if n else np.zeros(0, np.uint8)
        return torch.from_numpy(mapped).view(dtype).view(shape).to(device, copy=True)

    def mapped(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new zeroed file-backed tensor, writable; its file is removed when the tensor is freed."""
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        path = self.new_path("map")
        mapped = np.memmap(path, dtype=np.uint8, mode="w+", shape=(max(n, 1),))
        t = torch.from_numpy(mapped)[:n].view(dtype).view(shape)
        weakref.finalize(t.untyped_storage(), _remove, path)
        return t


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _remove(path: str) -> None:
    if os.path.exists(path):
        os.remove(path)


class OffloadedTensor:
    """A saved activation moved to the host pool or to a file; `load()` returns a device copy."""
    __slots__ = ("device", "dtype", "shape", "host", "path", "__weakref__")

    def __init__(self, t: torch.Tensor, tier: str, pool: HostPool, disk: DiskStore | None):
        self.device, self.dtype, self.shape = t.device, t.dtype, tuple(t.shape)
        self.host = pool.put(t) if tier == "host" else None
        self.path = None
        if tier == "disk":
            if disk is None:
                raise ValueError("disk offload needs a DiskStore")
            self.path = disk.write(t)
            weakref.finalize(self, _remove, self.path)

    def load(self) -> torch.Tensor:
        if self.host is not None:
            return self.host.to(self.device, copy=True, non_blocking=self.host.is_pinned())
        return DiskStore.read(self.path, self.dtype, self.shape, self.device)
