"""The meshes a cluster could be cut into, and a quick screen that orders them before any is planned.

`mesh_candidates` enumerates the factorisations of a cluster's device count into axes with roles,
outermost first: "dp" (data; FSDP where the planner shards state over it), "pp" (pipeline stages),
"cp" (context: the sequence), "ep" (experts), "tp" (tensor). Only roles the model can use are
offered (`ModelFacts`): "pp" with at least two repeated layers, "ep" with mixture-of-experts ops
(its size dividing the expert count), "cp" with attention at a sequence of CONTEXT_MIN_SEQ tokens or
more; "tp" and "ep" together stay inside a node. Axes of size 1 are left out. The axes are laid
row-major over the ranks in that order (`Mesh`), so the inner ones ("tp", "ep") use the node's links
and the outer ones cross nodes where they must; `Mesh` prices each axis by where its devices sit.

`screen` gives each candidate two numbers, neither of them a plan's price (the planner's evaluator
prices every plan the search returns or reports):

* `bound_s`, a lower bound on any plan's step on that mesh: the forward and backward FLOPs spread
  evenly over the devices at the device's dense peak times its matmul efficiency (the cost model runs
  no op faster: matmuls and attention reach at most that fraction of their dtype's peak, the other
  ops run on the slower vector units), stretched by the pipeline bubble of the candidate's microbatch
  count at its most virtual stages (`cost_model.pipeline.pipeline_time`: m t_max + (sum t - t_max) / v
  is least with every stage equal). A candidate whose bound is above a plan found is not planned.
* `estimate_s`, the order in which candidates are planned: a Megatron-style account of one step
  (Narayanan et al. 2021; Korthikanti et al. 2022) from the model's FLOPs, parameters and the size of
  one layer's output, with the mesh's links: compute at the profile's matmul efficiency, bubble,
  the slowest stage's whole layers, tensor-parallel all-reduces, context-parallel K/V exchanges, expert all-to-alls, pipeline sends,
  gradient sync, and full recomputation where the activations do not fit. Both are computed in
  `cost_model/screen.py`, their constants named there; the account only decides which meshes the
  planner tries first.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from ..cost_model.screen import ROLES, mesh_bound, screen_step
from ..mesh import Mesh
from ..passes.layers import layer_key, module_path
from ..passes.shape_prop import tensor_meta
from ..passes.stages import layer_sequence
from ..solver.decisions.stages import candidates as pipeline_candidates
from ..strategies import op_name

# Context parallelism is offered from this sequence length on: below it, attention's activations
# at one sequence per device fit with sequence parallelism, and Megatron-LM's and torchtitan's
# guidance turns context parallelism on for long-context training (32k and up); 16k leaves a margin.
CONTEXT_MIN_SEQ = 16384
@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the screen knows of a model, from one capture of the whole batch."""
    batch: int
    seq: int | None              # dim 1 of the first tensor input with two dims or more
    layers: int                  # repeated layers (pipeline chunks need one each)
    flops: float                 # forward FLOPs of one step
    dense_elements: float        # parameter elements outside mixture-of-experts ops
    expert_elements: float       # parameter elements of experts
    param_itemsize: int
    layer_out_bytes: float       # one layer's output at the whole batch
    experts: int                 # experts per MoE layer (0: none)
    top_k: int
    attention: bool

    @classmethod
    def of(cls, cap, infos) -> ModelFacts:
        nodes = list(cap.gm.graph.nodes)
        params = {n.name: tensor_meta(n.meta.get("val")) for n in nodes
                  if n.op == "placeholder" and (s := cap.inputs.get(n.name)) is not None and s.kind == "param"}
        first = next((m[0] for n in nodes if n.op == "placeholder" and (s := cap.inputs.get(n.name)) is not None
                      and s.kind == "input" and (m := tensor_meta(n.meta.get("val"))) and m[0].shape), None)
        moe = [n for n in nodes if n.op == "call_function" and op_name(n.target) == "autopar.moe_experts"]
        expert_params = {a.name for n in moe for a in n.args[3:5]}
        elements = {k: math.prod(m[0].shape) for k, m in params.items() if m}
        layers = layer_sequence(cap.gm.graph)
        last_of_first = [n for n in nodes if n.op == "call_function" and layers
                         and layer_key(module_path(n)) == layers[0] and infos.get(n.name) and infos[n.name].out]
        itemsizes = sorted(m[0].dtype.itemsize for m in params.values() if m and m[0].dtype.is_floating_point)
        return cls(batch=first.shape[0] if first else 1, seq=first.shape[1] if first and len(first.shape) > 1 else None,
                   layers=len(layers), flops=sum(i.flops for i in infos.values()),
                   dense_elements=float(sum(v for k, v in elements.items() if k not in expert_params)),
                   expert_elements=float(sum(v for k, v in elements.items() if k in expert_params)),
                   param_itemsize=itemsizes[len(itemsizes) // 2] if itemsizes else 4,
                   layer_out_bytes=float(infos[last_of_first[-1].name].out[0].nbytes) if last_of_first else 0.0,
                   experts=tensor_meta(moe[0].args[3].meta["val"])[0].shape[0] if moe else 0,
                   top_k=tensor_meta(moe[0].args[1].meta["val"])[0].shape[1] if moe else 0,
                   attention=any(n.op == "call_function" and "scaled_dot_product" in op_name(n.target) for n in nodes))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_candidates(size: int, devices_per_node: int, facts: ModelFacts, pipeline: bool = True) -> list[dict[str, int]]:
    """Every role -> degree assignment (degrees multiplying to `size`) the model can use, in a fixed order
    (`pipeline=False`: none with pipeline stages)."""
    pps = [p for p in _divisors(size) if p == 1 or (pipeline and 2 <= p <= facts.layers)]
    cps = [c for c in _divisors(size) if c == 1 or (facts.attention and facts.seq and facts.seq >= CONTEXT_MIN_SEQ
                                                    and facts.seq % c == 0)]
    eps = [e for e in _divisors(size) if e == 1 or (facts.experts and facts.experts % e == 0)]
    tps = _divisors(devices_per_node)
    out = []
    for pp, cp, ep, tp in itertools.product(pps, cps, eps, tps):
        inner = pp * cp * ep * tp
        if size % inner or ep * tp > devices_per_node:
            continue
        dp = size // inner
        if facts.batch % dp:
            continue
        out.append({"dp": dp, "pp": pp, "cp": cp, "ep": ep, "tp": tp})
    return out


def build_mesh(cluster, degrees: Mapping[str, int]) -> Mesh:
    """The candidate as a `Mesh` of the cluster: the roles of size > 1 in ROLES order (one axis "dp"
    of size 1 where every role is 1: a single device)."""
    axes = [(r, degrees[r]) for r in ROLES if degrees.get(r, 1) > 1] or [("dp", 1)]
    return cluster.mesh([n for _, n in axes], [r for r, _ in axes])


@dataclass(frozen=True, slots=True)
class Screened:
    degrees: dict[str, int]
    mesh: Mesh
    microbatches: int        # the screen's pick (1 without a pipeline)
    bound_s: float
    estimate_s: float
    fits: bool               # the screen's memory account fits the budget (with full recomputation at worst)


def screen(cluster, facts: ModelFacts, degrees: Mapping[str, int], budget: float, optimizer: str,
           precision: str) -> Screened:
    mesh = build_mesh(cluster, degrees)
    pp = degrees["pp"]
    opts = [(c.microbatches, c.virtual_stages) for c in pipeline_candidates(mesh, facts.batch, None, facts.layers,
                                                                          {"axis": "pp"})] if pp > 1 else [(1, 1)]
    # the microbatches the data axis can split (the screen's account splits a microbatch over "dp")
    opts = [(m, v) for m, v in opts if (facts.batch // m) % degrees["dp"] == 0] or opts
    (est, fits), m = min(((screen_step(mesh, facts, degrees, m, v, budget, optimizer, precision), m) for m, v in opts),
                         key=lambda t: (t[0][0], t[1]), default=((math.inf, False), 1))
    v_most = max((v for mm, v in opts if mm == m), default=1)
    return Screened(dict(degrees), mesh, m, mesh_bound(mesh, facts.flops, pp, m, v_most), est, fits)


__all__ = ["ROLES", "ModelFacts", "Screened", "mesh_candidates", "build_mesh", "screen"]
