"""Mesh: N-D descriptions, links per axis from where the axis's devices sit."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cost_model import load_profile
from autopar.mesh import profile_for


def test_axes_inside_and_across_nodes():
    # 8 GPUs per node, row-major ranks: the last axis varies fastest
    mesh = autopar.Mesh((16, 8, 8), ("dp", "pp", "tp"), device="h100")
    prof = load_profile("h100")
    scopes = [a.scope for a in mesh.axes]
    assert scopes == ["inter-node", "inter-node", "intra-node"]
    assert mesh.axes[2].link == prof.intra_node and mesh.axes[0].link == prof.inter_node
    assert mesh.size == 1024 and mesh.ndim == 3


def test_hierarchical_axis():
    # an axis of 4 with stride 4 spans two nodes of 8: partly NVLink, bounded by the network
    mesh = autopar.Mesh((4, 4), ("a", "b"), device="a100")
    assert [a.scope for a in mesh.axes] == ["hierarchical", "intra-node"]


def test_mesh_round_trip_and_lookup():
    mesh = autopar.Mesh((2, 2, 2), ("dp", "tp", "sp"), device="cpu")
    assert mesh.to_dict() == {"shape": [2, 2, 2], "axis_names": ["dp", "tp", "sp"], "device": "cpu"}
    assert mesh.axis_index("sp") == 2
    with pytest.raises(autopar.MeshError, match="no mesh axis named 'ep'"):
        mesh.axis_index("ep")
    assert "dp=2" in mesh.describe()


def test_reshard_cost_on_mesh_counts_launches():
    mesh = autopar.Mesh((8,), ("tp",), device="h100")
    from torch.distributed.tensor import Partial, Replicate, Shard
    ar = mesh.reshard_cost((1024, 1024), 4, (Partial(),), (Replicate(),))
    rs = mesh.reshard_cost((1024, 1024), 4, (Partial(),), (Shard(0),))
    ag = mesh.reshard_cost((1024, 1024), 4, (Shard(0),), (Replicate(),))
    assert ar.collectives == ("all_reduce@tp",)
    # same bytes and ring steps, one more kernel launch; the all-reduce clones its 4 MiB input
    # (torch's functional all_reduce is out of place), a copy read and written at memory bandwidth
    clone = 2 * 1024 * 1024 * 4 / (mesh.profile.memory_bandwidth * mesh.profile.memory_efficiency)
    assert rs.seconds + ag.seconds == pytest.approx(ar.seconds - clone + mesh.profile.kernel_overhead)



def test_reshard_cost_charges_the_concatenation_of_a_gather_or_scatter_off_dim_0():
    """torch's all_gather on a dim other than 0 concatenates the chunks it receives stacked on dim 0
    (a view where every dim before it is 1 long); its reduce_scatter on such a dim concatenates the
    input's chunks on dim 0 first: a copy of the whole buffer, read and written."""
    mesh = autopar.Mesh((8,), ("tp",), device="h100")
    from torch.distributed.tensor import Partial, Replicate, Shard
    copy = 2 * 1024 * 1024 * 4 / (mesh.profile.memory_bandwidth * mesh.profile.memory_efficiency)
    cost = lambda shape, src, dst: mesh.reshard_cost(shape, 4, (src,), (dst,)).seconds  # noqa: E731
    assert cost((1024, 1024), Shard(1), Replicate()) == pytest.approx(cost((1024, 1024), Shard(0), Replicate()) + copy)
    assert cost((1, 1024, 1024), Shard(1), Replicate()) == pytest.approx(cost((1024, 1024), Shard(0), Replicate()))
    assert cost((1024, 1024), Partial(), Shard(1)) == pytest.approx(cost((1024, 1024), Partial(), Shard(0)) + copy)

def _from_device_mesh(rank, world_size):
    import dataclasses

    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from autopar.cost_model.profiles import load_profile
    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh = autopar.Mesh.from_device_mesh(dm)
    two_a_node = dataclasses.replace(load_profile("h100"), devices_per_node=2)     # nodes {0, 1} and {2, 3}
    scopes = [tuple(a.scope for a in autopar.Mesh.from_device_mesh(d, two_a_node).axes)
              for d in (dm, DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("dp", "tp")))]
    return mesh.shape, mesh.axis_names, mesh.profile.name, mesh.device_mesh() is dm, scopes


def test_from_device_mesh_reads_the_rank_order(rank_pool):
    for shape, names, prof, same, scopes in rank_pool(4).run(_from_device_mesh):
        assert shape == (2, 2) and names == ("dp", "tp") and prof == "cpu" and same
        # row-major, tp pairs ranks {0, 1}: one node; built column-major, dp does
        assert scopes == [("inter-node", "intra-node"), ("intra-node", "inter-node")]


def test_the_device_name_picks_the_profile(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for name, profile in (("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                          ("NVIDIA A100-SXM4-80GB", "a100")):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i, name=name: name)
        assert profile_for("cuda") == profile
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA L4")
    with pytest.raises(autopar.AutoparError, match="'NVIDIA L4', which no shipped profile"):
        profile_for("cuda")
    with pytest.raises(autopar.AutoparError, match="each global rank"):
        autopar.Mesh((2, 2), ranks=[[0, 1], [1, 3]])
