"""Cost model: seconds and bytes per device, from shapes, placements, mesh and device profile.

profiles  hardware figures (`load_profile("h100")`), one JSON file per device
compute   roofline time of one op, forward and backward
comm      alpha-beta ring collectives per mesh axis, and the cost of resharding between layouts
memory    per-device memory of parameter state and live activations
"""
from .comm import (ReshardCost, all_gather_time, all_reduce_time, all_to_all_time, collective_bytes_on_wire,
                   collective_time, reduce_scatter_time, reshard_cost)
from .compute import backward_time, compute_time, matmul_efficiency_at
from .profiles import DeviceProfile, Link, known_profiles, load_profile, save_profile

__all__ = ["Link", "DeviceProfile", "load_profile", "save_profile", "known_profiles", "compute_time",
           "backward_time", "matmul_efficiency_at", "ReshardCost", "reshard_cost", "collective_time",
           "collective_bytes_on_wire", "all_reduce_time", "all_gather_time", "reduce_scatter_time",
           "all_to_all_time"]
