"""`Cluster`: the devices a model may run on, before anyone has chosen a mesh for them.

    autopar.plan(model, inputs, autopar.Cluster(nodes=128, devices_per_node=8, device="h100"))

A Cluster is data: `nodes` nodes of `devices_per_node` devices of one profile. Wherever a `Mesh`
is accepted (`plan`, `autoparallelize`, `estimate`, the CLI's `--cluster 128x8`) a Cluster may be
given instead: the planner then chooses the mesh too (`autopar/planner/mesh_search.py`): its shape, the role
of each axis (named "dp", "pp", "cp", "ep", "tp") and their order on the devices, and records it in
`plan.mesh`. Ranks are numbered node by node (ranks 0..devices_per_node-1 on node 0, as torchrun
numbers them), and a mesh's axes are laid row-major over them (`Mesh`): the last axes stay inside a
node and use its links, the first ones cross nodes.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from .cost_model.profiles import DeviceProfile, load_profile
from .errors import MeshError
from .mesh import Mesh

from .plan_file import DEVICE_ORDER   # how a chosen mesh's axes map to ranks (`Mesh` lays out row-major)


class Cluster:
    def __init__(self, nodes: int, devices_per_node: int = 8, device: str | DeviceProfile = "h100"):
        """nodes x devices_per_node devices of profile `device` (a profile name, a profile JSON path or a
        `DeviceProfile`, as `Mesh` takes); `devices_per_node` replaces the profile's own figure."""
        for what, v in (("nodes", nodes), ("devices_per_node", devices_per_node)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise MeshError(f"Cluster({what}={v!r}): give a positive int, e.g. Cluster(nodes=2, devices_per_node=8)")
        try:
            profile = load_profile(device)
        except ValueError as e:
            raise MeshError(str(e)) from None
        self.nodes, self.devices_per_node = nodes, devices_per_node
        self.profile = dataclasses.replace(profile, devices_per_node=devices_per_node)

    @property
    def size(self) -> int:
        return self.nodes * self.devices_per_node

    def mesh(self, shape: Sequence[int], axis_names: Sequence[str]) -> Mesh:
        """A mesh of this cluster's devices (its intra- and inter-node links as `Mesh` assigns them)."""
        m = Mesh(tuple(shape), tuple(axis_names), self.profile)
        if m.size != self.size:
            raise MeshError(f"mesh {m.shape} has {m.size} devices but the cluster has {self.nodes} x "
                            f"{self.devices_per_node} = {self.size}")
        return m

    def mesh_of(self, recorded: Mapping[str, Any]) -> Mesh:
        """The mesh a plan records (`plan.mesh`), on this cluster."""
        return self.mesh(recorded["shape"], recorded["axis_names"])

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "devices_per_node": self.devices_per_node, "device": self.profile.name}

    def __repr__(self) -> str:
        return f"Cluster(nodes={self.nodes}, devices_per_node={self.devices_per_node}, device={self.profile.name!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Cluster) and (self.nodes, self.profile) == (other.nodes, other.profile)

    def __hash__(self) -> int:
        return hash((self.nodes, self.devices_per_node, self.profile.name))

    @classmethod
    def parse(cls, text: str, device: str | DeviceProfile = "h100") -> Cluster:
        """`"128x8"`: 128 nodes of 8 devices (the CLI's --cluster)."""
        parts = text.lower().replace(",", "x").split("x")
        try:
            nodes, per = (int(p) for p in parts)
        except ValueError:
            raise MeshError(f"--cluster {text!r} is not NODESxDEVICES_PER_NODE such as 128x8") from None
        return cls(nodes, per, device)


__all__ = ["Cluster", "DEVICE_ORDER"]
