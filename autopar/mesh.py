"""`Mesh`: a description of the devices a model is parallelized over.

A Mesh is data: a shape with one name per axis and a device profile. Planning needs no
process group; `device_mesh()` builds torch.distributed's DeviceMesh when the plan runs.

Axes are laid out row-major over global ranks (the last axis varies fastest), as
`init_device_mesh` does, unless the ranks are given (`ranks=`, what `from_device_mesh` reads from a
DeviceMesh built in another order). Global rank r sits on node r // devices_per_node. An axis stays
inside a node when each of its groups (the devices that differ only along it) is on one node,
crosses nodes when each device of a group is on its own node, and is hierarchical in between
(collectives run inside each node, then across nodes: `cost_model.profiles.HierarchicalLink`).
Row-major, an axis connects devices `prod(shape[i+1:])` ranks apart.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Shard

from .cost_model.comm import (GradBucket, ReshardCost, async_output_axis, bucketed_reduction, coded_reshard_cost,
                              layout_code, transfer_time)
from .cost_model.profiles import DeviceProfile, HierarchicalLink, Link, known_profiles, load_profile
from .errors import MeshError


@dataclass(frozen=True, slots=True)
class AxisInfo:
    name: str
    size: int
    link: Link | HierarchicalLink
    scope: str  # "intra-node", "inter-node" or "hierarchical"


class Mesh:
    def __init__(self, shape: Sequence[int] | int, axis_names: Sequence[str] | None = None,
                 device: str | DeviceProfile = "h100", *, host_memory: float | None = None,
                 disk: float | None = None, ranks=None):
        """host_memory / disk: bytes per device of the offload tiers, overriding the profile's
        (0 takes a tier away). ranks: the global rank at each mesh coordinate (nested lists or an
        integer tensor of the mesh's shape; default row-major)."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if not shape or any((not isinstance(s, int)) or s < 1 for s in shape):
            raise MeshError(f"mesh shape {shape!r} must be a non-empty tuple of positive ints, e.g. (2, 4)")
        if axis_names is None:
            axis_names = tuple(f"axis{i}" for i in range(len(shape)))
        axis_names = tuple(axis_names)
        if len(axis_names) != len(shape):
            raise MeshError(f"mesh shape {shape} has {len(shape)} axes but {len(axis_names)} axis names "
                            f"{axis_names}: give one name per axis")
        if len(set(axis_names)) != len(axis_names):
            raise MeshError(f"mesh axis names {axis_names} repeat a name: names must be unique")
        try:
            self.profile = load_profile(device)
        except ValueError as e:
            raise MeshError(str(e)) from None
        for what, value, field_name in (("host_memory", host_memory, "host_memory_capacity"),
                                        ("disk", disk, "disk_capacity")):
            if value is not None:
                if not value >= 0:
                    raise MeshError(f"{what}={value!r}: give bytes per device, >= 0")
                self.profile = dataclasses.replace(self.profile, **{field_name: float(value)})
        self.shape: tuple[int, ...] = shape
        self.axis_names: tuple[str, ...] = axis_names
        order = torch.arange(math.prod(shape)) if ranks is None else torch.as_tensor(ranks)
        if tuple(order.shape) not in (shape, (math.prod(shape),)) or order.is_floating_point() or \
                sorted(order.flatten().tolist()) != list(range(math.prod(shape))):
            raise MeshError(f"ranks {order.tolist()} must hold each global rank 0..{math.prod(shape) - 1} once, "
                            f"in the mesh's shape {shape}")
        self.axes: tuple[AxisInfo, ...] = tuple(self._axis_info(i, order.reshape(shape)) for i in range(len(shape)))

    def _axis_info(self, i: int, ranks) -> AxisInfo:
        n, per_node = self.shape[i], self.profile.devices_per_node
        # each group's devices' nodes, sorted: a group spans 1 + (changes along the row) nodes
        nodes_of = (ranks.movedim(i, -1).reshape(-1, n) // per_node).sort(dim=1).values
        spans = 1 + (nodes_of[:, 1:] != nodes_of[:, :-1]).sum(dim=1)
        nodes = int(spans.max())
        if nodes == 1:
            link, scope = self.profile.intra_node, "intra-node"
        elif nodes == n:
            link, scope = self.profile.inter_node, "inter-node"
        else:   # some of the axis's devices share a node: intra-node then inter-node (cost_model.comm)
            local = n // nodes
            blocks = nodes_of.reshape(-1, nodes, local) if n % nodes == 0 else None     # `local` a node, each
            even = (blocks is not None and local >= 2 and bool((spans == nodes).all())
                    and bool((blocks == blocks[..., :1]).all()))
            link = HierarchicalLink(self.profile.intra_node, self.profile.inter_node, local, n) if even \
                else self.profile.inter_node
            scope = "hierarchical"
        return AxisInfo(self.axis_names[i], n, link, scope)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def links(self) -> tuple[Link, ...]:
        return tuple(a.link for a in self.axes)

    def axis_index(self, name_or_index: str | int) -> int:
        if isinstance(name_or_index, int):
            if not 0 <= name_or_index < self.ndim:
                raise MeshError(f"mesh axis {name_or_index} out of range for a {self.ndim}-axis mesh")
            return name_or_index
        if name_or_index not in self.axis_names:
            raise MeshError(f"no mesh axis named {name_or_index!r}; axes are {self.axis_names}")
        return self.axis_names.index(name_or_index)

    def reshard_cost(self, shape, itemsize: int, src, dst):
        """Seconds and bytes to move a tensor between layouts on this mesh (see cost_model.comm)."""
        return self.coded_reshard_cost(shape, itemsize, layout_code(src), layout_code(dst))

    def output_reshard_cost(self, shape, itemsize: int, src, dst) -> ReshardCost:
        """`reshard_cost` of a program output made whole: its launch alone where the runtime issues it
        asynchronously, waited at the caller's first use (`comm.async_output_axis`)."""
        rc = self.reshard_cost(shape, itemsize, src, dst)
        if async_output_axis(src, dst) is None:
            return rc
        launch = self.profile.kernel_overhead + self.profile.collective_overhead
        return ReshardCost(launch * len(rc.collectives), rc.bytes_per_axis, rc.collectives)

    def coded_reshard_cost(self, shape, itemsize: int, src, dst):
        """`reshard_cost` of layouts given as `comm.layout_code`s."""
        prof = self.profile
        return coded_reshard_cost(shape, itemsize, src, dst, self.shape, self.links, self.axis_names,
                                  launch_overhead=prof.kernel_overhead + prof.collective_overhead,
                                  copy_bandwidth=prof.memory_bandwidth * prof.memory_efficiency)

    def stage_mesh(self, axis: str | None) -> Mesh:
        """This mesh without the pipeline axis `axis` (what one pipeline stage runs on); every other
        axis keeps the links it has here. A mesh of the pipeline axis alone leaves one device."""
        if axis is None or axis not in self.axis_names:
            return self
        keep = [i for i, n in enumerate(self.axis_names) if n != axis]
        if not keep:
            return Mesh((1,), ("_stage",), self.profile)
        sub = Mesh(tuple(self.shape[i] for i in keep), tuple(self.axis_names[i] for i in keep), self.profile)
        sub.axes = tuple(self.axes[i] for i in keep)
        return sub

    def grad_sync_leg(self, shape, itemsize: int, src, dst) -> tuple[float, GradBucket, float] | None:
        """A parameter gradient's way from layout `src` to the stored `dst` when the runtime reduces it
        in a bucket (cost_model.comm.bucketed_reduction; None otherwise): (its own seconds, the bucket
        kind, its bytes). Its own seconds are its transfer less the share the backward hides
        (`profile.grad_sync_overlap`); each bucket's latency and launch are per step
        (`bucket_launch_time`, solver/evaluate.py)."""
        red = bucketed_reduction(src, dst, shape, self.shape)
        if red is None:
            return None
        axes, dim = red
        nbytes = math.prod(shape) * itemsize
        for p, n in zip(src, self.shape):
            if isinstance(p, Shard):
                nbytes /= n
        link = min((self.axes[a].link for a in axes), key=lambda lk: lk.bandwidth)
        bucket = GradBucket("all_reduce" if dim is None else "reduce_scatter", math.prod(self.shape[a] for a in axes),
                            link)
        own = (1.0 - self.profile.grad_sync_overlap) * transfer_time(bucket.collective, nbytes, bucket.n, link)
        return own, bucket, nbytes

    # -- serialization -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "axis_names": list(self.axis_names), "device": self.profile.name}

    def describe(self) -> str:
        axes = ", ".join(f"{a.name}={a.size} ({a.scope}, {a.link.bandwidth / 1e9:.0f} GB/s)" for a in self.axes)
        return f"Mesh[{axes}] of {self.size} x {self.profile.name}"

    def __repr__(self) -> str:
        return f"Mesh({self.shape}, axis_names={self.axis_names}, device={self.profile.name!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and (self.shape, self.axis_names, self.profile) == (
            other.shape, other.axis_names, other.profile)

    def __hash__(self) -> int:
        return hash((self.shape, self.axis_names, self.profile.name))

    # -- torch.distributed ---------------------------------------------------------------
    @classmethod
    def from_device_mesh(cls, device_mesh, device: str | DeviceProfile | None = None) -> Mesh:
        """Describe an existing torch DeviceMesh: its shape, names and rank order (`device_mesh.mesh`),
        and, unless `device` is given, the shipped profile its device's name names ("NVIDIA H100 80GB
        HBM3" -> "h100"; "cpu" for a CPU mesh); a device no profile names is a MeshError."""
        names = device_mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(device_mesh.ndim))
        if device is None:
            device = profile_for(device_mesh.device_type)
        m = cls(tuple(device_mesh.shape), names, device, ranks=device_mesh.mesh.cpu())
        m._device_mesh = device_mesh
        return m

    def local_batch(self, tensors, batch_axes):
        """This rank's slice of global-batch `tensors`, split on dim 0 over `batch_axes` in the order
        the runtime reads inputs planned with `batch_axes=` (row-major over those axes), i.e. what a
        DistributedSampler over those axes would hand this rank."""
        coord = self.device_mesh().get_coordinate()
        n, idx = 1, 0
        for ax in batch_axes:
            i = self.axis_index(ax)
            idx, n = idx * self.shape[i] + coord[i], n * self.shape[i]
        return tuple(t.chunk(n)[idx] for t in tensors)

    def device_mesh(self):
        """torch.distributed's DeviceMesh for this mesh (process groups are created once, then cached)."""
        dm = getattr(self, "_device_mesh", None)
        if dm is not None:
            return dm
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        if not dist.is_available() or not dist.is_initialized():
            raise MeshError("torch.distributed is not initialized: launch with torchrun (or call "
                            "torch.distributed.init_process_group) before running a plan; planning needs none")
        world = dist.get_world_size()
        if world != self.size:
            raise MeshError(f"mesh {self.shape} has {self.size} devices but the job has world size {world}: "
                            f"launch {self.size} processes (torchrun --nproc-per-node ...) or change the mesh shape")
        device_type = "cpu" if dist.get_backend() == "gloo" else self.profile.device_type
        # one DeviceMesh (and its process groups) per shape per job: creating groups is collective
        # and costly, and plans for the same mesh should share them
        key = (id(dist.group.WORLD), device_type, self.shape, self.axis_names)
        if key not in _DEVICE_MESHES:
            _DEVICE_MESHES[key] = init_device_mesh(device_type, self.shape, mesh_dim_names=self.axis_names)
        self._device_mesh = _DEVICE_MESHES[key]
        return self._device_mesh


_DEVICE_MESHES: dict = {}


def profile_for(device_type: str) -> str:
    """The shipped profile named by this process's device of `device_type` (its name as torch reports
    it: `torch.cuda.get_device_name`); MeshError when none is."""
    if device_type == "cpu":
        return "cpu"
    module = getattr(torch, device_type, None)
    name = module.get_device_name(module.current_device()) if hasattr(module, "get_device_name") else device_type
    words = set(re.split(r"[^a-z0-9]+", name.lower()))
    found = [p for p in known_profiles() if p != "cpu" and p in words]
    if len(found) != 1:
        raise MeshError(f"the DeviceMesh's device is {name!r}, which no shipped profile ({', '.join(known_profiles())}) "
                        f"names: pass device= (a profile name, or the JSON `autopar calibrate` writes)")
    return found[0]
