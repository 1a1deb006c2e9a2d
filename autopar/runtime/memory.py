"""The plan's memory decisions, applied to the rank graph (one executor per family, wired here).

* residency (regather.py): each Reshard that gathers a parameter, and each activation gather the
  plan re-gathers ("activations:<layer>", Megatron sequence parallelism), becomes a `GatherCopy`;
  a layer's re-gathered parameters then become one flat gather per mesh axis and dtype
  (layer_gather.py), also in a layer whose activations are offloaded (its region routes what its ops
  save; a saved view of the flat buffer is gathered again as anywhere) and in a recomputed layer (its
  gather runs before its region, and checkpoint saves the gathered views, its inputs, through the
  router around the forward: the recomputation takes the backward's re-gather);
* recompute (checkpoint.py) and activation offload (offload.py): each layer with a decision
  becomes a `LayerRegion` (regions.py);
* every tensor an op saves for its backward passes one `SavedTensors` router, with the tier of
  the layer it is saved in ("device" outside offloaded layers):
    1. in a gathered copy (a parameter's, or an activation's the plan re-gathers) -> kept ("keep") or
       dropped and gathered again ("regather");
    2. a parameter's or buffer's own storage -> kept (it lives anyway);
    3. otherwise -> kept on "device", or moved to the host pool or a file ("host", "disk").
  A recomputed layer saves through checkpoint's own hooks, which take precedence inside it: it
  keeps (almost) nothing, and the gathers inside it (the copies residency keeps, activations' gathers)
  are run again by the recomputation itself, so neither residency nor offload has anything left to
  act on there but its re-gathered parameters (above).
Optimizer offload and master weights are the optimizer's (optimizer.py); gradients on the host are
grad_offload.py's (wired by the module, which owns the parameters).
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor
from torch.autograd.graph import saved_tensors_hooks

from ..compat import tensor_version
from ..errors import AutoparError
from ..passes.layers import layer_key, module_path
from ..placement import gathers, parse_layout
from ..plan import ACTIVATIONS, RECOMPUTE_MODES, RESIDENCY_MODES, TIERS, Plan
from .grad_offload import GradOffload
from .layer_gather import flatten_gathers
from .param_offload import FetchParam, insert_fetches
from .offload import DiskStore, HostPool, OffloadedTensor
from .regather import GatherCopy, GatheredCopies, RegatheredCopy, RegatheredDTensor
from .regions import LayerRegion, group_layers, node_layers
from .reshard import Reshard

log = logging.getLogger("autopar")


@dataclass(slots=True)
class MemoryRuntime:
    """Per DistributedModule: the stores the executors share."""
    copies: GatheredCopies = field(default_factory=GatheredCopies)
    pool: HostPool = field(default_factory=HostPool)
    offload_dir: str | None = None
    disk: DiskStore | None = None
    resident: frozenset[int] = frozenset()      # storages of parameters and buffers (this forward)
    regathers: bool = False                     # some copy is regathered: route the whole forward
    outer: SavedTensors | None = None           # the router around the whole forward, if any
    routes: bool = False                        # some saved-tensor router runs (outer, or a layer's)
    grads: GradOffload | None = None            # gradients moved to the host as they are made
    params_off_device: dict[str, str] = field(default_factory=dict)   # parameter FQN -> "host" | "disk"
                                                                      # (param_offload.py)
    device: torch.device | str = "cpu"          # where the fetched parameters go
    notes: list[str] = field(default_factory=list)

    def disk_store(self) -> DiskStore:
        if self.disk is None:
            self.disk = DiskStore(self.offload_dir)
        return self.disk


class SavedTensors:
    """Saved-tensor hooks for one tier (see module docstring). A tensor saved twice in one forward
    (the same storage, view and version) is moved once."""

    def __init__(self, rt: MemoryRuntime, tier: str):
        self.rt, self.tier = rt, tier
        self._moved: dict[tuple, tuple[weakref.ref, weakref.ref]] = {}

    def hooks(self):
        return saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        if isinstance(t, DTensor):      # checkpoint saving a recomputed region's inputs: alive anyway, but a
            return self.rt.copies.pack_dtensor(t)       # view of a layer's re-gathered parameters (gathered again)
        hit = self.rt.copies.pack(t)
        if hit is not None:
            return hit
        storage = t.untyped_storage()
        if self.tier == "device" or storage.data_ptr() in self.rt.resident:
            return t
        key = (storage.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, tensor_version(t))
        seen = self._moved.get(key)
        if seen is not None and seen[0]() is storage and seen[1]() is not None:
            return seen[1]()
        moved = OffloadedTensor(t, self.tier, self.rt.pool, self.rt.disk_store() if self.tier == "disk" else None)
        self._moved[key] = (weakref.ref(storage), weakref.ref(moved))
        weakref.finalize(moved, self._moved.pop, key, None)
        return moved

    @staticmethod
    def unpack(x):
        return x.load() if isinstance(x, (RegatheredCopy, RegatheredDTensor, OffloadedTensor)) else x


def apply_memory_plan(gm: fx.GraphModule, plan: Plan, param_of: dict[str, str], rt: MemoryRuntime) -> fx.GraphModule:
    """gm running plan's recompute / residency / activation offload decisions.
    param_of: placeholder name -> canonical parameter FQN."""
    activations = {k.split(":", 1)[1]: v for k, v in plan.offload.items() if k.startswith("activations:")}
    _check(plan, gm, param_of, activations)
    fetched = insert_fetches(gm, param_of, frozenset(rt.params_off_device), torch.device(rt.device), rt.copies)
    rt.regathers = "regather" in plan.residency.values() or fetched
    if rt.regathers or any(v != "device" for v in activations.values()):
        _gather_copies(gm, plan, param_of, rt)
    if rt.regathers:
        whole = ("R",) * len(plan.mesh["shape"])
        flatten_gathers(gm, param_of, lambda fqn: parse_layout(plan.placements.get(fqn, whole)),
                        tuple(plan.mesh["shape"]), rt.copies)
    routers = {tier: SavedTensors(rt, tier) for tier in TIERS}

    def make_region(layer: str, body: fx.GraphModule) -> LayerRegion | None:
        mode, tier = plan.recompute.get(layer, "none"), activations.get(layer, "device")
        if mode == "none" and tier == "device":
            return None
        if mode != "none" and tier != "device":
            note = (f"layer {layer}: recompute={mode} with activations on {tier}: the recomputed layer keeps "
                    f"nothing to offload, so only recomputation runs")
            if note not in rt.notes:
                rt.notes.append(note)
                log.warning(note)
        if mode == "none":
            rt.routes = True
        return LayerRegion(layer, body, mode, routers[tier].hooks if tier != "device" else None)

    gm = group_layers(gm, make_region)
    rt.outer = routers["device"] if rt.regathers else None
    rt.routes = rt.routes or rt.outer is not None
    return gm


def _gather_copies(gm: fx.GraphModule, plan: Plan, param_of: dict[str, str], rt: MemoryRuntime) -> None:
    """Each Reshard gathering a parameter -> a GatherCopy with the parameter's residency; each Reshard
    gathering an activation for an op whose activations the plan re-gathers (`activation_key`) -> a
    GatherCopy "regather"."""
    planned = {n.name: n for n in plan.nodes}
    for node in gm.graph.nodes:
        if node.op != "call_module" or not isinstance(gm.get_submodule(node.target), Reshard):
            continue
        src, mod = node.args[0], gm.get_submodule(node.target)
        if isinstance(src, fx.Node) and src.op == "call_module" and isinstance(gm.get_submodule(src.target), FetchParam):
            src = src.args[0]           # a host parameter's device copy: the parameter's residency decides
        fqn = param_of.get(getattr(src, "name", None))
        if fqn is not None and src.op == "placeholder":
            key, residency = fqn, plan.residency.get(fqn, "keep")
            stored = plan.placements.get(fqn, ("R",) * len(mod.layout))
        else:
            made = planned.get(src.meta.get("autopar_node")) if isinstance(src, fx.Node) else None
            if made is None or made.executor == "input" or len(node.users) != 1:
                continue
            key = activation_key(next(iter(node.users)))
            residency, stored = plan.residency.get(key, "keep"), made.output
            if residency != "regather":
                continue
        if gathers(parse_layout(stored), mod.layout):
            gather = GatherCopy(mod.layout, key, residency, rt.copies)
            gather.sync = mod.sync
            gm.add_submodule(node.target, gather)


def activation_key(consumer: fx.Node) -> str:
    """The residency key of the activations gathered for `consumer` (a rank-graph op):
    "activations:<its layer>", or "activations:<its captured node>" outside the layers."""
    return ACTIVATIONS + (layer_key(module_path(consumer)) or consumer.meta.get("autopar_node", consumer.name))


def activation_keys(gm: fx.GraphModule) -> set[str]:
    """The residency keys of activations gathered in this rank graph (`activation_key` of its ops)."""
    return {activation_key(n) for n in gm.graph.nodes if n.op == "call_module"}


def _check(plan: Plan, gm: fx.GraphModule, param_of: dict[str, str], activations: dict[str, str]) -> None:
    layers = sorted({k for k in node_layers(gm).values() if k is not None})
    params = set(param_of.values()) | activation_keys(gm)
    problems = []
    for field_, prefix, table, modes, known in (("recompute", "", plan.recompute, RECOMPUTE_MODES, layers),
                                                ("offload", "activations:", activations, TIERS, layers),
                                                ("residency", "", plan.residency, RESIDENCY_MODES, params)):
        for key, mode in table.items():
            where = f"plan.{field_}[{prefix + key!r}]"
            if key not in known:
                problems.append(f"{where}: no {'parameter or activations:<layer>' if known is params else 'layer'} "
                                f"{key!r} in this model")
            if mode not in modes:
                problems.append(f"{where} = {mode!r} is not one of {modes}")
    if problems:
        raise AutoparError("the plan's memory decisions do not fit this model: " + "; ".join(problems)
                           + f". Layers here: {', '.join(layers) or 'none'}")
