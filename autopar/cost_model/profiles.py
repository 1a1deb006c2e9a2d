"""Device profiles: the hardware figures every cost is computed from, one JSON file per device.

A profile is data, per device: peak FLOP/s per dtype, memory bandwidth and capacity, three
links (host PCIe, intra-node NVLink-class, inter-node InfiniBand-class per device), and the
efficiencies that turn peaks into achieved rates. The shipped files (`profiles/*.json`) cite
where each figure comes from in their `_notes`; `autopar calibrate` will write measured ones
in the same format, and `load_profile` reads either.

    >>> load_profile("h100").flops_for(torch.bfloat16)
    989000000000000.0
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

__all__ = ["Link", "HierarchicalLink", "DeviceProfile", "load_profile", "save_profile", "known_profiles", "PROFILE_DIR"]

PROFILE_DIR = Path(__file__).with_name("profiles")
# torch DistributedDataParallel's default bucket_cap_mb=25: the default gradient bucket
DDP_BUCKET_BYTES = 25 * 2**20
# torch DistributedDataParallel's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB): small,
# so that the reduction of the last layers' gradients starts early in the backward
DDP_FIRST_BUCKET_BYTES = 2**20
PEAK_KEYS = ("float32", "tf32", "bfloat16", "float16")
# float32 maps to "float32", not "tf32": PyTorch leaves TF32 matmuls off by default
# (torch.backends.cuda.matmul.allow_tf32 = False), so an fp32 matmul runs at the fp32 rate.
_DTYPE_KEYS = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True, slots=True)
class Link:
    bandwidth: float   # bytes/s per device, one direction (what a ring collective's per-step transfer sees)
    latency: float     # seconds per message (alpha), charged once per ring step
    # a reduce_scatter's bytes take this many times the ring's time: 1 for NCCL's ring; gloo's is measured
    # by `autopar calibrate` (2 ranks, 8 MiB: 12.2 ms against 4.6 for the all_gather the ring formula
    # equates it with; about an all_reduce's time)
    reduce_scatter_factor: float = 1.0

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or not self.latency >= 0 or not self.reduce_scatter_factor > 0:
            raise ValueError(f"{self!r}: bandwidth and reduce_scatter_factor must be > 0 and latency >= 0")


@dataclass(frozen=True, slots=True)
class HierarchicalLink:
    """The links of a mesh axis of `size` devices spread over nodes, `local` of them per node.

    Collectives over such an axis run in two levels, as NCCL's rings over the NIC rails and
    hierarchical all-reduces do: inside each node over `intra` (NVLink), and between the
    `size // local` nodes over `inter`, where each of the `local` devices of a node drives its own
    NIC on 1/local of the data (`comm.collective_time` has the formulas). `bandwidth` and `latency`
    are those of a flat ring with the same large-message all-gather time, for code that only
    needs one number (ordering, reports).
    """
    intra: Link
    inter: Link
    local: int        # devices of the axis inside one node (>= 2)
    size: int         # devices on the axis (a multiple of local, > local)

    def __post_init__(self) -> None:
        if not (2 <= self.local < self.size and self.size % self.local == 0):
            raise ValueError(f"{self!r}: need 2 <= local < size and size divisible by local")

    @property
    def bandwidth(self) -> float:
        k, n = self.local, self.size
        m = n // k
        per_byte = (k - 1) / k / self.intra.bandwidth + (m - 1) / m / (k * self.inter.bandwidth)
        return (n - 1) / n / per_byte

    @property
    def latency(self) -> float:
        return self.inter.latency


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    name: str
    device_type: str                  # "cuda" or "cpu"
    backend: str                      # "nccl" or "gloo"
    # dtype key -> dense FLOP/s; hash=False because a mapping is unhashable (equality still compares it)
    peak_flops: Mapping[str, float] = field(hash=False)
    memory_bandwidth: float           # bytes/s
    memory_capacity: float            # bytes
    host_link: Link                   # PCIe to host memory (offload)
    intra_node: Link                  # NVLink-class
    inter_node: Link                  # InfiniBand-class, per device
    devices_per_node: int
    matmul_efficiency: float          # fraction of peak a large well-shaped matmul reaches
    memory_efficiency: float          # fraction of memory bandwidth a streaming kernel reaches
    matmul_ramp_time: float           # seconds a matmul loses to filling the device (small-matmul curve)
    kernel_overhead: float            # seconds of fixed cost per kernel (dispatch + launch)
    source: str                       # where the figures come from
    # Costs of autopar's own eager runtime and of collectives as a training step issues them
    # (measured by `autopar calibrate`; 0 in the shipped GPU profiles, where kernels, not Python, set
    # the pace of the small graphs they would matter for):
    runtime_op_overhead: float = 0.0       # seconds per node of the rank's graph (LocalOp or Reshard) per
                                           # training step, forward + backward, beyond eager PyTorch's own
    collective_overhead: float = 0.0       # seconds per collective beyond the ring alpha-beta terms
                                           # (DTensor redistribute, waiting for the peers to be scheduled)
    optimizer_param_overhead: float = 0.0  # seconds per parameter tensor per optimizer step (the per-tensor
                                           # loop of torch.optim on DTensor parameters)
    optimizer_element_time: float = 0.0    # seconds per local parameter element per optimizer step, measured
                                           # (0: the memory-bound fused-kernel figure of cost_model.compute)
    rng_element_time: float = 0.0          # seconds per random number an op draws (dropout's mask) beyond its
                                           # memory traffic (0: generated under the memory traffic)
    attention_efficiency: float = 1.0      # fraction of the matmul rate fused attention (SDPA) reaches, forward
                                           # and backward together (measured by `autopar calibrate`; a CPU's
                                           # flash kernel runs at about half of torch.mm's rate; 1: as fast)
    grad_bucket_bytes: float = DDP_BUCKET_BYTES  # gradient bucket of the runtime's gradient sync (and its price)
    grad_sync_overlap: float = 0.0         # fraction of the gradient sync's transfer time hidden behind the
                                           # backward (measured by `autopar calibrate`; 0: none assumed)
    # Offload tiers, per device (0 capacity: the tier is not there; `Mesh(host_memory=, disk=)` overrides):
    host_memory_capacity: float = 0.0      # bytes of host memory this device may fill (its share of the node's)
    disk_capacity: float = 0.0             # bytes of local disk (NVMe) this device may fill
    disk_link: Link = Link(1e9, 100e-6)    # device <-> disk, bytes/s one direction and seconds per request
    host_optimizer_element_time: float = 0.0   # seconds per parameter element of an optimizer step run on the
                                               # host (ZeRO-Offload's CPU Adam), this device's share of its cores
    # Mixture of experts: the busiest device's routed token-slots over the mean when experts are split
    # over devices (top-k routing is data-dependent; the busiest device sets the pace of the layer and
    # of its all-to-alls). 1.2 is an assumption, not a measurement: routers trained with an auxiliary
    # load-balancing loss (Switch Transformer, Mixtral, Qwen-MoE) keep experts near, not at, uniform
    # load. Set it from the model's routing statistics where they are known.
    moe_load_imbalance: float = 1.2
    # Memory a run needs beside its tensors, taken from `memory_capacity` for the default budget
    # (`memory_budget`); each profile's `_notes` say where its figures come from (0: none, as on a CPU):
    context_memory: float = 0.0            # bytes: CUDA context (kernel images, driver state) and the math
                                           # libraries' workspaces (cuBLAS / cuBLASLt)
    communicator_memory: float = 0.0       # bytes: the collective library's buffers (NCCL channels, NVLS)
    fragmentation: float = 0.0             # fraction of memory_capacity the caching allocator holds reserved
                                           # but unallocated at the peak (memory_stats: reserved - allocated)

    def __post_init__(self) -> None:
        peaks = MappingProxyType(dict(self.peak_flops))  # a read-only copy: the profile is frozen
        object.__setattr__(self, "peak_flops", peaks)
        if "float32" not in peaks or any(not v > 0 for v in peaks.values()):
            raise ValueError(f"profile {self.name!r}: peak_flops needs a positive 'float32' entry, got {dict(peaks)}")
        for f in ("memory_bandwidth", "memory_capacity", "devices_per_node"):
            if not getattr(self, f) > 0:
                raise ValueError(f"profile {self.name!r}: {f} must be > 0")
        if not self.grad_bucket_bytes > 0 or not 0 <= self.grad_sync_overlap <= 1:
            raise ValueError(f"profile {self.name!r}: grad_bucket_bytes must be > 0, grad_sync_overlap in [0, 1]")
        if not 0 <= self.fragmentation < 1:
            raise ValueError(f"profile {self.name!r}: fragmentation must be in [0, 1) (a fraction of memory_capacity)")
        if not self.memory_budget > 0:
            raise ValueError(f"profile {self.name!r}: context_memory + communicator_memory + fragmentation leave "
                             f"no memory of memory_capacity {self.memory_capacity:.0f} bytes")
        if not self.moe_load_imbalance >= 1:
            raise ValueError(f"profile {self.name!r}: moe_load_imbalance must be >= 1 (busiest over mean)")
        for f in ("matmul_efficiency", "memory_efficiency", "attention_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ValueError(f"profile {self.name!r}: {f} must be in (0, 1]")
        for f in ("matmul_ramp_time", "kernel_overhead", "runtime_op_overhead", "collective_overhead",
                  "optimizer_param_overhead", "optimizer_element_time", "rng_element_time", "host_memory_capacity",
                  "disk_capacity", "host_optimizer_element_time", "context_memory", "communicator_memory"):
            if getattr(self, f) < 0:
                raise ValueError(f"profile {self.name!r}: {f} must be >= 0")

    def __reduce__(self):  # a mappingproxy does not pickle; rebuild from plain data (pickle, deepcopy)
        return _from_dict, (_to_dict(self),)

    @property
    def memory_reserve(self) -> float:
        """Bytes of a device a run needs beside its tensors: context, communicators, fragmentation."""
        return self.context_memory + self.communicator_memory + self.fragmentation * self.memory_capacity

    @property
    def memory_budget(self) -> float:
        """The planner's default memory budget per device: the capacity less `memory_reserve`."""
        return self.memory_capacity - self.memory_reserve

    def flops_for(self, dtype: torch.dtype) -> float:
        """Dense peak FLOP/s for `dtype`; dtypes without an entry (float64, integers) use the float32 rate."""
        return self.peak_flops.get(_DTYPE_KEYS.get(dtype, "float32"), self.peak_flops["float32"])


def known_profiles() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in PROFILE_DIR.glob("*.json")))


def _from_dict(d: Mapping[str, Any], origin: str = "<dict>") -> DeviceProfile:
    # Keys starting with "_" are documentation (the shipped files cite their figures there).
    d = {k: v for k, v in d.items() if not k.startswith("_")}
    names = {f.name for f in fields(DeviceProfile)}
    optional = {f.name for f in fields(DeviceProfile) if f.default is not MISSING}
    unknown, missing = set(d) - names, names - set(d) - optional
    if unknown or missing:
        raise ValueError(f"profile {origin}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}")
    for k in ("host_link", "intra_node", "inter_node", "disk_link"):
        if k in d:
            d[k] = Link(**d[k])
    return DeviceProfile(**d)


def _to_dict(p: DeviceProfile) -> dict[str, Any]:
    d = {f.name: getattr(p, f.name) for f in fields(DeviceProfile)}
    d["peak_flops"] = dict(p.peak_flops)
    for k in ("host_link", "intra_node", "inter_node", "disk_link"):
        link = d[k]
        d[k] = {"bandwidth": link.bandwidth, "latency": link.latency}
        if link.reduce_scatter_factor != 1.0:       # the shipped files leave the ring's 1 out
            d[k]["reduce_scatter_factor"] = link.reduce_scatter_factor
    return d


def load_profile(name_or_path: str | Path | DeviceProfile) -> DeviceProfile:
    """A shipped profile by name ("a100", "h100", "h200", "cpu"; any case), a JSON file, or a profile as is."""
    if isinstance(name_or_path, DeviceProfile):
        return name_or_path
    if isinstance(name_or_path, str) and name_or_path.lower() in known_profiles():
        path = PROFILE_DIR / f"{name_or_path.lower()}.json"
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"unknown device profile {str(name_or_path)!r}: use one of "
                             f"{', '.join(known_profiles())} or the path of a profile JSON file")
    return _from_dict(json.loads(path.read_text()), str(path))


def save_profile(profile: DeviceProfile, path: str | Path) -> Path:
    """Write `profile` as JSON that `load_profile(path)` reads back equal."""
    path = Path(path)
    path.write_text(json.dumps(_to_dict(profile), indent=2) + "\n")
    return path
