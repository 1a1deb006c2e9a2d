"""Cost model: seconds and bytes per device, from shapes, placements, mesh and device profile.

profiles  hardware figures (`load_profile("h100")`), one JSON file per device
compute   roofline time of one op, forward and backward (`op_times`)
comm      alpha-beta collectives per mesh axis (ring, tree, hierarchical), point-to-point,
          bucketed gradient sync, and the cost of resharding between layouts
memory    per-device memory of parameter state (same dtype or mixed precision) and live activations
pipeline  step time of a pipeline schedule (1F1B, GPipe, interleaved) from per-device costs

`autopar.estimate` composes them into a training step; docs/cost_model.md has the validation.
"""
from .comm import (ReshardCost, all_gather_time, all_reduce_time, all_to_all_time, broadcast_time, bucketed_time,
                   collective_bytes_on_wire, collective_time, p2p_time, reduce_scatter_time, reshard_cost)
from .compute import compute_time, matmul_efficiency_at, op_times, optimizer_step_time
from .pipeline import Pipeline, PipelineTime, in_flight_microbatches, pipeline_time
from .profiles import DeviceProfile, HierarchicalLink, Link, known_profiles, load_profile, save_profile

__all__ = ["Link", "HierarchicalLink", "DeviceProfile", "load_profile", "save_profile", "known_profiles",
           "compute_time", "op_times", "optimizer_step_time", "matmul_efficiency_at",
           "ReshardCost", "reshard_cost", "collective_time", "collective_bytes_on_wire", "all_reduce_time",
           "all_gather_time", "reduce_scatter_time", "all_to_all_time", "broadcast_time", "p2p_time",
           "bucketed_time", "Pipeline", "PipelineTime", "pipeline_time", "in_flight_microbatches"]
