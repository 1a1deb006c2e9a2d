"""autopar: an auto-parallelization compiler for PyTorch.

    mesh = autopar.Mesh((2, 2), axis_names=("dp", "tp"), device="h100")
    plan = autopar.plan(model, example_inputs, mesh); print(plan.report())
    dmodel = autopar.autoparallelize(model, mesh, example_inputs)      # on every rank
"""
from torch.distributed.tensor import Partial, Replicate, Shard

from .api import autoparallelize, plan
from .cost_model.pipeline import Pipeline
from .errors import (AutoparError, CaptureError, CheckpointError, CollectiveError, InfeasibleError, MeshError,
                     PlanFileError, PlanMismatchError, ShardingError)
from .mesh import Mesh
from .cluster import Cluster
from .plan import Estimate, Plan
from .estimate import StepEstimate, estimate  # noqa: E402  (binds the function over the submodule's name)
from .explain import Explanation, explain  # noqa: E402  (likewise)
from .runtime.experts import moe_capacity


def compile_backend(mesh: Mesh, **options):
    """A `torch.compile` backend: each graph planned over `mesh` with replicated parameters, its per-rank
    program compiled by inductor (see autopar/backend.py)."""
    from .backend import compile_backend as _cb
    return _cb(mesh, **options)


def compile(model, mesh: Mesh, example_inputs, **options):  # noqa: A001
    """`autoparallelize`'s module with its per-rank program compiled by inductor (see autopar/backend.py)."""
    from .backend import compile as _compile
    return _compile(model, mesh, example_inputs, **options)


__all__ = ["Mesh", "Cluster", "Plan", "Estimate", "plan", "estimate", "StepEstimate", "explain", "Explanation", "Pipeline",
           "autoparallelize", "compile", "compile_backend", "moe_capacity", "AutoparError", "CaptureError",
           "CheckpointError", "CollectiveError",
           "InfeasibleError", "MeshError", "PlanFileError", "PlanMismatchError", "ShardingError", "Replicate", "Shard", "Partial"]
