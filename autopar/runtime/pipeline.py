"""`PipelinedModule`: a pipelined plan (`plan.pipeline.stages > 1`) run by torch's pipelining.

The rank graph is the plan's (`runtime/rewrite.py`) over the whole mesh: every layout is "R" on
the pipeline axis, and DTensor never communicates over an axis whose placement stays Replicate,
so each stage's ops and reshards run on the groups of the other axes, i.e. on the stage's
sub-mesh. `passes/stages.py` cuts that graph into the plan's chunks; this rank runs chunks
c with c % stages == its pipeline coordinate, each wrapped in torch's `PipelineStage` over the
pipeline axis's process group and driven by torch's schedule:

    "gpipe" -> ScheduleGPipe, "1f1b" -> Schedule1F1B, "interleaved" -> ScheduleInterleaved1F1B,
    "zb" -> ScheduleInterleavedZeroBubble (ZB-1P; its chunk order is the plan's, ZBV's V is not)

* Values crossing chunks travel as this rank's local shards (torch sends plain tensors); the
  receiving chunk re-applies the planned layout (same mesh coordinates on the other axes, so
  the shard is the one it needs), and gradients return the same way.
* The model returns its loss, a mean over the batch. Each microbatch's loss is divided by the
  number of microbatches m inside the schedule's loss function (`scale_grads=False`): the step's
  loss is the sum of those, the mean of the microbatch means, which is the batch mean since the
  microbatches are equal, and the gradients are those of one process. Dividing the loss rather
  than the gradients after the step (torch's default) leaves gradients accumulated by earlier
  calls untouched.
* A call runs forward and backward of every microbatch (`loss = dmodel(x, y)`); the loss it
  returns, on every rank, has a backward that does nothing, so `loss.backward()` completes the
  step as usual. Under `torch.no_grad()` only the forwards run.
* Parameters: a rank holds those its chunks read. A parameter read on several pipeline ranks
  (a tied embedding and head) is held by each; after the step its gradient is summed over the
  pipeline axis (ranks that do not hold it add zeros), as Megatron-LM does for embeddings.
* Memory decisions (recompute, residency, activation offload) run per chunk: each chunk graph
  gets the plan's decisions for its own layers and parameters. Optimizer offload is
  `dmodel.optimizer(...)` as for any plan.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ..compat import pytree
from ..cost_model.profiles import DDP_BUCKET_BYTES
from ..errors import AutoparError
from ..passes.capture import Captured, flatten_inputs
from ..passes.layers import layer_key
from .rewrite import rewrite
from ..passes.stages import Chunk, chunk_of, cut, microbatch
from ..passes.shape_prop import tensor_meta
from ..placement import local_shape, parse_layout
from ..plan import Plan
from . import rng
from .grad_sync import GradSync, attach
from .memory import MemoryRuntime, activation_keys, apply_memory_plan
from .ops import mesh_device as _device
from .module import _set_path, _storage, input_value, shard_parameters
from .offload import HostPool
from .ops import _ToLocal
from .optimizer import PlannedOptimizer
from .regions import node_layers
from .reshard import grad_layout, to_layout
from .respecialize import input_shapes, input_shapes_of, user_inputs

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
             "zb": ScheduleInterleavedZeroBubble}
_SINGLE = ("gpipe", "1f1b")      # torch's schedules of one stage per rank


class _Arrive(torch.autograd.Function):
    """A received local shard -> the DTensor of the planned layout; its gradient leaves as the local
    shard of the gradient's layout (the sender's `_ToLocal` rebuilds it there)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, mesh, layout: tuple):  # type: ignore[override]
        ctx.layout = layout
        return DTensor.from_local(t, mesh, layout, run_check=False)

    @staticmethod
    def backward(ctx, grad: DTensor):  # type: ignore[override]
        return to_layout(grad, grad_layout(ctx.layout)).to_local().contiguous(), None, None


class _StepDone(torch.autograd.Function):
    """The step's loss, whose backward does nothing: the schedule ran the backward already."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, value: torch.Tensor):  # type: ignore[override]
        return value.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return None, None


class _Microbatch(torch.autograd.Function):
    """A copy of a chunk's outputs whose backward sets the microbatch its dropouts draw for
    (`rng.RngState.microbatch`): a recomputed region replays its forward inside the backward, after
    other microbatches' forwards have run. A copy, not a view of the shard: the schedules free a sent
    output's graph by detaching it in place."""

    @staticmethod
    def forward(ctx, state: rng.RngState, index: int, *outs: torch.Tensor):  # type: ignore[override]
        ctx.state, ctx.index = state, index
        return tuple(o.clone() for o in outs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        ctx.state.microbatch = ctx.index
        return (None, None, *grads)


class _ChunkModule(torch.nn.Module):
    """One chunk as a pipeline stage's module: `forward(*received shards, mb=index)` -> the shards it
    sends on (or, for the last chunk, the loss of microbatch `mb` as a plain tensor)."""

    def __init__(self, owner: PipelinedModule, chunk: Chunk, program: fx.GraphModule, layouts: list[tuple],
                 last: bool):
        super().__init__()
        self.program, self.chunk, self.layouts, self.last = program, chunk, layouts, last
        self._owner = [owner]        # not a submodule: the owner holds the parameters
        self.params = torch.nn.ParameterList(     # for the schedule's weight-gradient pass (zb)
            dict.fromkeys(owner.get_parameter(owner.slot(p).target) for p in chunk.placeholders
                          if owner.slot(p).kind == "param"))

    def forward(self, *received, mb: torch.Tensor):
        owner = self._owner[0]
        mesh = owner._autopar["mesh"]
        index = int(mb.reshape(-1)[0])
        leaves = owner._micro[index]
        owner._rng.microbatch = index
        values = [_Arrive.apply(t, mesh, lay) for t, lay in zip(received, self.layouts)]
        values += [input_value(owner, owner._autopar["cap"], owner.slot(p), leaves, owner._input_layout)
                   for p in self.chunk.placeholders]
        mem = owner.memory
        with mem.outer.hooks() if mem.outer is not None else contextlib.nullcontext():
            out = self.program(*values)
        if self.last:
            return _Microbatch.apply(owner._rng, index, pytree.tree_leaves(out)[0])[0]
        return _Microbatch.apply(owner._rng, index, *(_ToLocal.apply(v, grad_layout(v.placements)) for v in out))


class PipelinedModule(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, cap: Captured, plan: Plan, device_mesh, offload_dir: str | None = None,
                 grad_bucket_bytes: float = DDP_BUCKET_BYTES):
        super().__init__()
        pipe = plan.pipeline
        _check_model(cap)
        self._autopar = {"cap": cap, "plan": plan, "mesh": device_mesh, "model": model}
        k = list(device_mesh.mesh_dim_names).index(pipe.axis)
        self._group = device_mesh.get_group(pipe.axis)
        self._pp_rank = device_mesh.get_coordinate()[k]
        self._slots = cap.inputs
        self._planned = {n.name: n for n in plan.nodes}
        self._memory = MemoryRuntime(pool=HostPool(pin=device_mesh.device_type == "cuda"), offload_dir=offload_dir)
        self._rng = rng.RngState.agreed()
        batch_axes = plan.options.get("batch_axes") or []
        self._input_layout = tuple(Shard(0) if n in batch_axes else Replicate() for n in plan.mesh["axis_names"])
        self._n_batch = math.prod(n for n, ax in zip(device_mesh.shape, plan.mesh["axis_names"]) if ax in batch_axes)
        self._planned_shapes = input_shapes_of(cap)
        graph = rewrite(cap, plan, device_mesh, pass_local=False)     # chunk outputs cross as DTensors
        param_of = {name: cap.param_names.get(str(s.target), str(s.target)) for name, s in cap.inputs.items()
                    if s.kind == "param"}
        # gradients summed over the microbatches and reduced once per step, after the schedule (zb's
        # weight pass asks autograd for the parameters' gradients itself: reduced per microbatch there)
        self._grad_sync = GradSync(self, device_mesh, grad_bucket_bytes, deferred=True)
        if pipe.schedule != "zb":
            attach(graph, self._grad_sync, param_of)
        chunks = cut(graph, chunk_of(graph.graph, pipe), pipe.chunks)
        mine = [c for c in chunks if c.index % pipe.stages == self._pp_rank]
        readers: dict[str, set[int]] = {}
        for c in chunks:
            for p in c.placeholders:
                if p in param_of:
                    readers.setdefault(param_of[p], set()).add(c.index % pipe.stages)
        held = {fqn for fqn, ranks in readers.items() if self._pp_rank in ranks}
        for fqn, param in shard_parameters(model, cap, plan, device_mesh, keep=held.__contains__,
                                           distribute=self._stage_distribute(k)).items():
            _set_path(self, fqn, param, "param")
        for fqn, buf in model.named_buffers():
            _set_path(self, fqn, buf.detach().clone().to(_device(device_mesh)), "buffer")
        self._shared = sorted(fqn for fqn, ranks in readers.items() if len(ranks) > 1)
        metas = {param_of[n.name]: tensor_meta(n.meta.get("val"))[0] for n in cap.gm.graph.nodes if n.name in param_of}
        self._shared_meta = {fqn: (local_shape(metas[fqn].shape, parse_layout(plan.placements[fqn]), device_mesh.shape),
                                   metas[fqn].dtype) for fqn in self._shared}
        self._sync_shared(values=True)
        self._chunks = [self._stage_module(c, plan, param_of, graph, last=c.index == pipe.chunks - 1) for c in mine]
        self._micro: list = []
        self._schedule = self._make_schedule(pipe, chunks, graph)

    # -- construction ----------------------------------------------------------------------
    def slot(self, placeholder: str):
        return self._slots[placeholder]

    def _stage_distribute(self, k: int):
        """Shards made on the stage's sub-mesh (its rank 0's values, as distribute_tensor sends), then
        seen on the whole mesh with "R" on the pipeline axis: only the stage's ranks take part."""
        mesh = self._autopar["mesh"]
        names = [n for i, n in enumerate(mesh.mesh_dim_names) if i != k]

        def distribute(t, layout):
            local = t
            if names:
                sub = distribute_tensor(t, mesh[tuple(names)], [p for i, p in enumerate(layout) if i != k])
                local = sub.to_local()
            return DTensor.from_local(local, mesh, layout, run_check=False, shape=t.shape, stride=t.stride())
        return distribute

    def _stage_module(self, chunk: Chunk, plan: Plan, param_of: dict[str, str], graph: fx.GraphModule,
                      last: bool) -> _ChunkModule:
        program = chunk.module
        rng.attach(program, self._rng)
        layers = set(node_layers(program).values()) - {None}
        params = {p: param_of[p] for p in chunk.placeholders if p in param_of}
        own = replace(plan, recompute={k: v for k, v in plan.recompute.items() if k in layers},
                      offload={k: v for k, v in plan.offload.items()
                               if not k.startswith("activations:") or k.split(":", 1)[1] in layers},
                      residency={k: v for k, v in plan.residency.items()
                                 if k in params.values() or k in activation_keys(program)})
        program = apply_memory_plan(program, own, params, self._memory)
        by_name = {n.name: n for n in graph.graph.nodes}
        layouts = [self._layout_of(by_name[r]) for r in chunk.received]
        return _ChunkModule(self, chunk, program, layouts, last)

    def _layout_of(self, node: fx.Node) -> tuple:
        """The planned layout of a value crossing chunks: its captured node's output."""
        planned = self._planned.get(node.meta.get("autopar_node"))
        if planned is None or not planned.output:
            raise AutoparError(f"node {node.name} crosses pipeline chunks but has no planned layout; please report it")
        return parse_layout(planned.output)

    def _make_schedule(self, pipe, chunks: list[Chunk], graph: fx.GraphModule):
        mesh = self._autopar["mesh"]
        device = _device(mesh)
        by_name = {n.name: n for n in graph.graph.nodes}
        stages = []
        for mod in self._chunks:
            c = mod.chunk
            ins = tuple(self._example(by_name[r], mod.layouts[i], mesh) for i, r in enumerate(c.received))
            if mod.last:
                outs = (torch.empty((), dtype=self._loss_dtype(), device=device, requires_grad=True),)
            else:
                nxt = chunks[c.index + 1]
                nxt_layouts = [self._layout_of(by_name[r]) for r in nxt.received]
                outs = tuple(self._example(by_name[r], lay, mesh) for r, lay in zip(nxt.received, nxt_layouts))
            stages.append(PipelineStage(mod, c.index, pipe.chunks, device, input_args=ins, output_args=outs,
                                        group=self._group))
        m = pipe.microbatches
        cls = SCHEDULES[pipe.schedule]
        kwargs = dict(n_microbatches=m, loss_fn=lambda out, _target: out / m, scale_grads=False)
        return cls(stages[0], **kwargs) if pipe.schedule in _SINGLE else cls(stages, **kwargs)

    @staticmethod
    def _example(node: fx.Node, layout: tuple, mesh) -> torch.Tensor:
        metas = tensor_meta(node.meta.get("val"))
        if len(metas) != 1:
            raise AutoparError(f"node {node.name} crosses pipeline chunks but is not one tensor; please report it")
        meta = metas[0]
        return torch.empty(local_shape(meta.shape, layout, mesh.shape), dtype=meta.dtype, device=_device(mesh),
                           requires_grad=meta.dtype.is_floating_point)

    def _loss_dtype(self) -> torch.dtype:
        out = next(n for n in self._autopar["cap"].gm.graph.nodes if n.op == "output")
        return tensor_meta(pytree.tree_leaves(out.args[0])[0].meta.get("val"))[0].dtype

    # -- running ---------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        return self._autopar["plan"]

    @property
    def memory(self) -> MemoryRuntime:
        return self._memory

    @property
    def stage_modules(self) -> list[torch.nn.Module]:
        """This rank's chunks, in chunk order (each a graph module: print `.program.code`)."""
        return list(self._chunks)

    def manual_seed(self, seed: int) -> None:
        self._rng.fixed, self._rng.seed = int(seed), None

    @property
    def optimizer_offload(self) -> dict[str, str]:
        """The plan's "optimizer:..." offload decisions for the parameters this rank holds."""
        held = {n for n, _ in self.named_parameters(remove_duplicate=False)}
        layers = {layer_key(n) for n in held} - {None}
        return {k: v for k, v in self.plan.offload.items()
                if not k.startswith("optimizer:") or k.split(":", 1)[1] in held | layers}

    def optimizer(self, cls: type[torch.optim.Optimizer], **kwargs) -> PlannedOptimizer:
        """`cls(**kwargs)` over this rank's parameters, honouring the plan's optimizer offload
        (`runtime/optimizer.py`)."""
        return PlannedOptimizer(self, cls, **kwargs)

    def forward(self, *args, **kwargs):
        pipe = self.plan.pipeline
        m = pipe.microbatches
        self._rng.next_call()
        self._micro = [flatten_inputs(*microbatch(args, kwargs, m, i)) for i in range(m)]
        shapes = input_shapes(user_inputs(self._autopar["cap"]), self._micro[0], self._n_batch)
        if shapes != self._planned_shapes:
            raise AutoparError(f"a pipelined plan runs at the input sizes it was planned for: microbatches of "
                               f"{self._planned_shapes}, not {shapes}; re-plan for these sizes (pipelined plans "
                               f"are not re-specialised to other sizes)")
        mem = self._memory
        mem.resident = frozenset(_storage(t) for t in (*self.parameters(), *self.buffers()))
        ids = torch.arange(m, device=_device(self._autopar["mesh"]))
        losses: list[torch.Tensor] = []
        training = torch.is_grad_enabled()
        before = self._shared_grads() if training else None
        run = self._schedule.step if training else self._schedule.eval
        self._grad_sync.reset()
        run(mb=ids, target=ids, losses=losses, return_outputs=False)
        if training:
            self._grad_sync.finish()
        self._micro = []
        last_rank = (pipe.chunks - 1) % pipe.stages
        value = (torch.stack([x.detach() for x in losses]).sum() if losses
                 else torch.zeros((), dtype=self._loss_dtype(), device=ids.device))
        dist.broadcast(value, group=self._group, group_src=last_rank)
        if not training:
            return value
        self._sync_shared(before=before)
        return _StepDone.apply(torch.zeros((), requires_grad=True), value)

    def _shared_grads(self) -> dict[str, torch.Tensor | None]:
        out = {}
        for fqn in self._shared:
            p = self._param_or_none(fqn)
            out[fqn] = None if p is None or p.grad is None else p.grad.to_local().clone()
        return out

    def _param_or_none(self, fqn: str):
        try:
            return self.get_parameter(fqn)
        except AttributeError:
            return None

    def _sync_shared(self, values: bool = False, before: dict | None = None) -> None:
        """Parameters read on several pipeline ranks: their values averaged over the ranks holding them
        (at build), or this step's gradient summed over them (after a step). A rank that does not
        hold one adds zeros."""
        device = _device(self._autopar["mesh"])
        with torch.no_grad():
            for fqn in self._shared:
                p = self._param_or_none(fqn)
                shape, dtype = self._shared_meta[fqn]
                if values:
                    t = p.to_local().clone() if p is not None else torch.zeros(shape, dtype=dtype, device=device)
                    held = torch.tensor(float(p is not None), device=device)
                    dist.all_reduce(held, group=self._group)
                    dist.all_reduce(t, group=self._group)
                    if p is not None:
                        p.to_local().copy_(t / held)
                    continue
                grad = p.grad.to_local() if p is not None and p.grad is not None else None
                prior = before.get(fqn) if before else None
                delta = (torch.zeros(shape, dtype=dtype, device=device) if grad is None
                         else grad - prior if prior is not None else grad.clone())
                dist.all_reduce(delta, group=self._group)
                if grad is not None:
                    grad.copy_(delta + prior if prior is not None else delta)


def _check_model(cap: Captured) -> None:
    """A pipelined plan trains a model whose output is its loss (a scalar) and that updates no buffer."""
    out = next(n for n in cap.gm.graph.nodes if n.op == "output")
    leaves = pytree.tree_leaves(out.args[0])
    metas = tensor_meta(leaves[0].meta.get("val")) if len(leaves) == 1 and isinstance(leaves[0], fx.Node) else ()
    if any(kind == "buffer" for kind, _ in cap.outputs):
        raise AutoparError("a pipelined plan cannot run a model that updates buffers in its forward (BatchNorm's "
                           "running statistics): plan with pipeline=False, or use LayerNorm")
    if len(metas) != 1 or metas[0].shape != () or not metas[0].dtype.is_floating_point:
        raise AutoparError("a pipelined plan needs the model to return its loss, one scalar (a mean over the batch): "
                           "compute the loss inside forward (`return F.cross_entropy(logits, targets)`), or plan "
                           "with pipeline=False")
