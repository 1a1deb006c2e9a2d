"""`DistributedModule`: the user's model, parallelized by a plan, as an nn.Module.

Parameters keep the user's qualified names (so optimizers, state_dict and
torch.distributed.checkpoint see `blocks.0.attn.qkv.weight`), but each is a DTensor holding
only this rank's shard in its planned layout. Tied parameters stay one Parameter.
Buffers are plain per-rank tensors, entered into the graph as whole DTensors. Parameters and
buffers are copies: training this module never changes the user's model.

A call at other input sizes than planned runs the same plan re-specialised to them
(`respecialize.py`); dropouts draw their masks as `rng.py` says.
"""
from __future__ import annotations

import contextlib
import math
import operator

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ..compat import child_table, dtensor_from, held_locals, parameter_table, pytree
from ..cost_model.profiles import DDP_BUCKET_BYTES
from ..errors import AutoparError
from ..passes.capture import Captured, flatten_inputs
from ..placement import parse_layout
from ..plan import Plan
from .rewrite import rewrite
from . import rng
from .grad_offload import GradOffload
from .early_reshard import early_reshards
from .trim_wrappers import LeafParams, direct_calls, fuse_param_edges, local_inputs
from .param_offload import offloaded_parameters
from .grad_sync import GradSync, attach
from .memory import MemoryRuntime, apply_memory_plan
from .offload import HostPool
from .ops import mesh_device as _device
from .optimizer import PlannedOptimizer
from .reshard import to_layout
from .respecialize import input_shapes, input_shapes_of, respecialize, user_inputs
from .weights import Weights, save_pretrained, unmaterialised


# Programs kept per module, one per input shapes seen (each a graph module of the model's size):
# enough for bucketed batch sizes and sequence lengths; beyond, the oldest is captured again.
MAX_PROGRAMS = 16


def _set_path(root: torch.nn.Module, fqn: str, value, kind: str) -> None:
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if part not in child_table(mod):
            mod.add_module(part, torch.nn.Module())
        mod = child_table(mod)[part]
    if kind == "param":
        mod.register_parameter(leaf, value)
    else:
        mod.register_buffer(leaf, value)


def shard_parameters(model: torch.nn.Module, cap: Captured, plan: Plan, device_mesh, keep=None,
                     distribute=None, values: dict[str, torch.Tensor] | None = None) -> dict[str, torch.nn.Parameter]:
    """Every parameter FQN (aliases too: tied parameters stay one Parameter) -> a Parameter holding
    a copy of this rank's shard in its planned layout; `keep(canonical FQN)` says which to make
    (default: all), `distribute(tensor, layout)` how (default: `distribute_tensor` over the mesh).
    `values[canonical FQN]`: this rank's local shard already made (weights.py: `init=`, `checkpoint=`),
    taken as it is, without communication; popped, so that the caller holds no second reference."""
    params = dict(model.named_parameters(remove_duplicate=False))
    made: dict[str, torch.nn.Parameter] = {}
    out = {}
    for fqn, canon in cap.param_names.items():
        if keep is not None and not keep(canon):
            continue
        if canon not in made:
            src = params[canon]
            layout = parse_layout(plan.placements.get(canon, tuple("R" for _ in device_mesh.shape)))
            if values is not None and canon in values:
                dt = DTensor.from_local(values.pop(canon), device_mesh, layout, run_check=False, shape=src.shape,
                                        stride=src.stride())
            elif src.is_meta:
                raise unmaterialised(model)
            else:
                # a copy: a replicated shard must not alias the user's parameter, which the optimizer would write
                local = src.detach().to(_device(device_mesh), copy=True)
                dt = (distribute or (lambda t, lay: distribute_tensor(t, device_mesh, lay)))(local, layout)
            made[canon] = torch.nn.Parameter(dt, requires_grad=src.requires_grad)
        out[fqn] = made[canon]
    return out


class DistributedModule(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, cap: Captured, plan: Plan, device_mesh, offload_dir: str | None = None,
                 grad_bucket_bytes: float = DDP_BUCKET_BYTES, weights: Weights | None = None):
        super().__init__()
        params_off = any(k.startswith("parameters:") and v != "device" for k, v in plan.offload.items())
        if params_off and device_mesh.device_type != "cpu":        # before any collective
            raise AutoparError(f"plan.offload puts parameters off the device on a {device_mesh.device_type} mesh; "
                               f"parameter offload runs on CPU meshes only (the planner offers it there only): set "
                               f"those 'parameters:...' entries to 'device'")
        # plain dict: not submodules. `model` is kept (never changed) to capture at other input sizes;
        # `programs`: global input shapes -> (capture, per-rank graph) at those shapes; `inputs`: where each
        # call's shapes are read (`user_inputs`)
        self._autopar = {"cap": cap, "plan": plan, "mesh": device_mesh, "model": model, "programs": {},
                         "inputs": user_inputs(cap)}
        # a model on the meta device, or values asked for: each rank makes only its local shards (weights.py)
        values, buffers = (weights.materialise(model, cap, plan, device_mesh, _device(device_mesh))
                           if weights is not None else (None, {}))
        for fqn, param in shard_parameters(model, cap, plan, device_mesh, values=values).items():
            _set_path(self, fqn, param, "param")
        for fqn, buf in model.named_buffers():
            if fqn not in buffers and buf.is_meta:
                raise unmaterialised(model)
            _set_path(self, fqn, buffers.pop(fqn) if fqn in buffers else buf.detach().clone().to(_device(device_mesh)),
                      "buffer")
        self._param_of = {name: cap.param_names.get(str(slot.target), str(slot.target))
                          for name, slot in cap.inputs.items() if slot.kind == "param"}
        self._memory = MemoryRuntime(pool=HostPool(pin=device_mesh.device_type == "cuda"), offload_dir=offload_dir)
        if params_off:
            moved = offloaded_parameters(self, plan.offload, self._memory.pool, self._memory.disk_store)
            for fqn, (param, _) in moved.items():
                _set_path(self, fqn, param, "param")
            self._memory.device = _device(device_mesh)
            self._memory.params_off_device = {fqn: tier for fqn, (_, tier) in moved.items()}
        self._rng = rng.RngState.agreed()
        self._grad_sync = GradSync(self, device_mesh, grad_bucket_bytes)
        if any(k.startswith("gradients:") and v != "device" for k, v in plan.offload.items()):
            self._memory.grads = GradOffload(self, plan.offload, self._memory.pool)
            self._grad_sync.alone = frozenset(self._memory.grads.aliases)
        self._leaves = LeafParams(self._grad_sync)
        batch_axes = plan.options.get("batch_axes") or []
        self._input_layout = tuple(Shard(0) if n in batch_axes else Replicate() for n in plan.mesh["axis_names"])
        # inputs the plan keeps in another layout than they arrive in (a pinned sequence split): each
        # rank takes its part of the input it was given (no communication)
        self._kept_as = {n.name: parse_layout(n.output) for n in plan.nodes if n.executor == "input"}
        self._n_batch = math.prod(n for n, ax in zip(device_mesh.shape, plan.mesh["axis_names"]) if ax in batch_axes)
        self._graph = self._build(cap)
        self._autopar["programs"][_key(input_shapes_of(cap))] = (cap, self._graph)

    @property
    def plan(self) -> Plan:
        return self._autopar["plan"]

    @property
    def graph_module(self):
        """The per-rank graph, with every reshard and collective explicit (print `.code`)."""
        return self._graph

    def _build(self, cap: Captured) -> torch.nn.Module:
        """The per-rank program of the plan over `cap`: rewritten, its dropouts given the module's RNG,
        its gradient reductions bucketed (grad_sync.py), its no-op wrappers trimmed (trim_wrappers.py), its
        memory decisions applied."""
        a = self._autopar
        graph = rewrite(cap, a["plan"], a["mesh"])
        rng.attach(graph, self._rng)
        attach(graph, self._grad_sync, self._param_of)
        leaves = fuse_param_edges(graph, cap, a["plan"], self._param_of, self._grad_sync.alone,
                                  frozenset(self._memory.params_off_device))
        graph = apply_memory_plan(graph, a["plan"], self._param_of, self._memory)
        arriving = self._arriving(cap)
        inputs = local_inputs(graph, cap, arriving)
        direct_calls(graph, frozenset(leaves) | inputs)
        early_reshards(graph, frozenset(n for n, slot in cap.inputs.items() if slot.kind == "input"))
        graph.local_params = leaves       # placeholders fed their parameter's local shard (trim_wrappers.py)
        graph.feeds = self._feeds(cap, leaves, {n: arriving[n] for n in inputs})
        return graph

    def _arriving(self, cap: Captured) -> dict[str, tuple]:
        """User-input placeholder -> the layout its tensor arrives in, for those the program keeps in
        it (not a pinned split taken on arrival: `_kept_as`)."""
        whole = tuple(Replicate() for _ in self._input_layout)
        out = {}
        for name, slot in cap.inputs.items():
            if slot.kind != "input":
                continue
            val = cap.gm.graph.find_nodes(op="placeholder", target=name)[0].meta.get("val")
            if isinstance(val, torch.Tensor):
                layout = self._input_layout if val.ndim else whole
                if self._kept_as.get(name) in (None, layout):
                    out[name] = layout
        return out

    def _feeds(self, cap: Captured, leaves_of: dict, local_in: dict):
        """`feed(leaves)` -> the program's placeholder values this call (`input_value`), with the
        lookups that are the same every call done once: a parameter is an entry of its owner's
        parameters; `leaves_of` are fed their local shard (`LeafParams`), `local_in` (user input ->
        its layout) the local tensor the caller gave (`local_input`). While every parameter and the
        local tensor it holds are the objects of the last call (the check `LeafParams.value` makes,
        here one pass over all of them in C: no Python per parameter), the parameters' values are
        the last call's."""
        slots, tables, attrs, others = [], [], [], []
        for k, (name, slot) in enumerate(cap.inputs.items()):
            if slot.kind == "param":
                path, _, attr = str(slot.target).rpartition(".")
                slots.append((k, leaves_of.get(name)))
                tables.append(parameter_table(self.get_submodule(path)))
                attrs.append(attr)
            elif name in local_in:
                others.append((k, lambda leaves, i=slot.target, layout=local_in[name]:
                               local_input(self._autopar["mesh"], leaves[i], layout)))
            else:
                others.append((k, lambda leaves, slot=slot, kept=self._kept_as.get(name), cap=cap:
                               input_value(self, cap, slot, leaves, self._input_layout, kept)))
        n, leaf_value = len(cap.inputs), self._leaves.value
        last = [(), (), [None] * n]     # the last call's parameters, the local tensors they held, its values

        def feed(leaves: list) -> list:
            params = list(map(operator.getitem, tables, attrs))
            held = held_locals(params)
            was, was_held, values = last
            if not (len(was) == len(params) and all(map(operator.is_, params, was))
                    and all(map(operator.is_, held, was_held))):
                values = [None] * n
                for (k, spec), p in zip(slots, params):
                    values[k] = p if spec is None else leaf_value(p, spec)
                last[:] = params, held, values
            values = list(values)
            for k, f in others:
                values[k] = f(leaves)
            return values
        return feed

    def _program(self, args, kwargs, leaves):
        """(capture, per-rank graph) for this call's input shapes: the planned ones, or the plan
        re-specialised to other sizes (`respecialize.py`; an error on every rank if they do not divide)."""
        a = self._autopar
        shapes = input_shapes(a["inputs"], leaves, self._n_batch)
        key = _key(shapes)
        if key not in a["programs"]:
            if len(a["programs"]) >= MAX_PROGRAMS:        # drop the oldest re-specialised one
                del a["programs"][next(k for k in a["programs"] if a["programs"][k][1] is not self._graph)]
            cap = respecialize(a["model"], a["cap"], a["plan"], args, kwargs, shapes)
            a["programs"][key] = (cap, self._build(cap))
        return a["programs"][key]

    def manual_seed(self, seed: int) -> None:
        """Seed this module's dropout masks (call with the same seed on every rank; `runtime/rng.py`)."""
        self._rng.fixed, self._rng.seed = int(seed), None

    def forward(self, *args, **kwargs):
        self._rng.next_call()
        self._grad_sync.reset()
        self._grad_sync.prepare()
        leaves = flatten_inputs(args, kwargs)
        cap, graph = self._program(args, kwargs, leaves)
        values = graph.feeds(leaves)
        mem = self._memory
        if mem.routes:       # saved-tensor routers run: they keep what lives anyway where it is
            mem.resident = frozenset(_storage(t) for t in (*self.parameters(), *self.buffers()))
        with mem.outer.hooks() if mem.outer is not None else contextlib.nullcontext():
            outs = graph(*values)
        self._grad_sync.watch(outs)
        return split_outputs(cap, outs, buffers=self)

    @property
    def memory(self) -> MemoryRuntime:
        """The stores behind the plan's memory decisions: `.pool` (host tier, its bytes), `.disk`
        (disk tier, its files), `.notes` (decisions that could not act, and why)."""
        return self._memory

    @property
    def optimizer_offload(self) -> dict[str, str]:
        """The plan's "optimizer:..." offload decisions for the parameters this rank holds."""
        return self.plan.offload

    def save_pretrained(self, directory: str, max_shard_size: int | str = "5GB") -> list[str]:
        """Write the parameters and persistent buffers as a Hugging Face safetensors directory (files of at
        most `max_shard_size`, an index when several; the model's config.json when it has a Hugging Face
        config) that `from_pretrained` opens, one tensor at a time from rank 0. Call on every rank."""
        return save_pretrained(self, directory, max_shard_size)

    def optimizer(self, cls: type[torch.optim.Optimizer], **kwargs) -> PlannedOptimizer:
        """`cls(**kwargs)` over this module's parameters, honouring the plan: optimizer state and fp32
        master weights in the tier `plan.offload["optimizer:<layer or parameter>"]` says (see
        runtime/optimizer.py)."""
        return PlannedOptimizer(self, cls, **kwargs)


def input_value(module: torch.nn.Module, cap: Captured, slot, leaves, input_layout, kept_as=None):
    """What feeds one placeholder of the rank graph: the module's parameter or buffer (whole), a
    lifted constant (whole), or user input `leaves[i]` in `input_layout` (whole if 0-dim), moved to
    the layout the plan keeps it in (`kept_as`, a pinned input: each rank takes its part)."""
    if slot.kind == "param":
        return module.get_parameter(slot.target)
    mesh = module._autopar["mesh"]
    whole = tuple(Replicate() for _ in range(mesh.ndim))
    if slot.kind == "buffer":
        return dtensor_from(module.get_buffer(slot.target), mesh, whole)
    if slot.kind == "constant":
        const = cap.constants[slot.target] if slot.target in cap.constants else getattr(cap.gm, slot.target)
        if const.is_meta:      # a model on meta lifts the tensors its forward makes on meta: empty ones hold no value
            if const.numel():
                raise AutoparError(f"the model's forward makes tensor {slot.target!r} from meta values: build the "
                                   f"module that makes it off the meta device")
            const = torch.empty_like(const, device=_device(mesh))
        return dtensor_from(const.to(_device(mesh)), mesh, whole)
    x = leaves[slot.target]
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
        layout = input_layout if x.ndim else whole
        x = dtensor_from(x.to(_device(mesh)), mesh, layout)
        if x.ndim and kept_as is not None and kept_as != layout:
            x = to_layout(x, kept_as)
    return x


def local_input(mesh, x, layout: tuple):
    """A user input the program takes as its local tensor (`trim_wrappers.local_inputs`): the tensor this
    rank was given, on the mesh's device (a DTensor given instead: its local shard in `layout`)."""
    if isinstance(x, DTensor):
        return x.redistribute(mesh, layout).to_local()
    return x.to(_device(mesh)) if isinstance(x, torch.Tensor) else x


def split_outputs(cap: Captured, outs, buffers: torch.nn.Module | None):
    """The graph's flat outputs -> the user's output structure; buffer updates written back."""
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    user = []
    for (kind, target), val in zip(cap.outputs, outs):
        if kind == "buffer":
            if buffers is not None:
                with torch.no_grad():
                    buffers.get_buffer(target).copy_(val.full_tensor() if isinstance(val, DTensor) else val)
        else:
            user.append(val)
    return pytree.tree_unflatten(user, cap.out_spec)


def _storage(t: torch.Tensor) -> int:
    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()
def _key(shapes: dict[str, tuple[int, ...]]) -> tuple:
    return tuple(sorted(shapes.items()))
