"""autopar under `torch.compile`: a backend for replicated parameters, `autopar.compile` for sharded ones.

`torch.compile(model, backend=autopar.compile_backend(mesh))`: Dynamo hands the backend the
model's graph with parameters lifted to inputs (the user's own `nn.Parameter`s). The backend plans
that graph as `autopar.plan` would, with every parameter replicated (the user's optimizer steps the
user's whole parameters, so each rank must end the step with the whole gradient: data parallelism's
all-reduce, which the plan prices), rewrites it into the per-rank program, and compiles that
program through aot_autograd and inductor (`compiled.py`): one graph of plain tensors and
functional collectives per Dynamo graph, kernels fused, gradients all-reduced inside the compiled
backward. A parameter enters as the tensor it is (no copy, no reshard). Graph breaks give one
graph each, planned and compiled alone.

`batch_axes=("dp",)`: each rank calls the compiled model with its own slice of the batch (dim 0 of
every tensor argument of the call with a dim 0), as under DDP; the plan sees the global batch.

`autopar.compile(model, mesh, example_inputs, **options)`: `autoparallelize`'s module (each rank
stores its parameter shards as DTensors, any plan), its forward replaced by the same compiled
per-rank program: a sharded parameter's shard goes in as it is stored and its gradient comes back
in that layout (reduce-scattered in the compiled backward, as the plan prices), accumulated into
the parameter's `.grad` as a DTensor shard.

Re-capturing Dynamo's graph lifts its tensor constants (and any buffers it holds) to inputs
that are not among Dynamo's arguments: each call feeds them from the capture, and feeds Dynamo's
arguments by their index. Non-tensor results (a Hugging Face `DynamicCache`) stay Dynamo's:
the graph returns the cache's tensors and Dynamo rebuilds the object around them.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math

import torch
from torch.distributed.tensor import Replicate, Shard

from .api import autoparallelize, planned_on_rank0
from .compat import dynamo_user_input, pytree, sym_expr, sym_hint
from .compiled import check_compiler, compile_program, per_rank_program, untraceable, without_memory_decisions
from .errors import PlanOptionError
from .mesh import Mesh
from .passes.capture import InputSlot, capture, flatten_inputs
from .runtime.rewrite import rewrite
from .placement import parse_layout
from .plan import Plan
from .planner.solve import PlanOptions, plan_captured
from .runtime import rng
from .runtime.module import split_outputs


class ShapeError(PlanOptionError):
    """A compiled graph called at other per-rank sizes than it was planned for."""


class _Sized(torch.nn.Module):
    """Dynamo's graph with its symbolic-size arguments bound to values: called with its tensors alone."""

    def __init__(self, gm: torch.fx.GraphModule, tensors: list[int], sizes: dict[int, int]):
        super().__init__()
        self.gm, self.tensors, self.sizes = gm, tensors, sizes

    def forward(self, *tensors):
        args = dict(self.sizes)
        args.update(zip(self.tensors, tensors))
        return self.gm(*(args[i] for i in range(len(args))))


def _batch_inputs(placeholders: list, example_inputs, n_batch: int) -> tuple[set[int], dict[int, int]]:
    """(the arguments each rank feeds its slice of: tensor arguments of the call with a dim 0, the
    value of every symbolic size Dynamo passes: the batch's times n_batch, others as traced)."""
    split, batch_syms = set(), set()
    for i, (node, x) in enumerate(zip(placeholders, example_inputs)):
        if isinstance(x, torch.Tensor) and n_batch > 1 and x.ndim and not isinstance(x, torch.nn.Parameter) \
                and dynamo_user_input(node):
            split.add(i)
            batch_syms.add(sym_expr(node.meta["example_value"].shape[0]))
    sizes = {}
    for i, (node, x) in enumerate(zip(placeholders, example_inputs)):
        if isinstance(x, torch.Tensor):
            continue
        if not isinstance(x, (int, torch.SymInt)):
            raise TypeError(f"autopar's compile backend: input {i} of the graph is {type(x).__name__}, not a "
                            f"tensor or a size")
        sym = sym_expr(node.meta["example_value"]) if isinstance(node.meta.get("example_value"), torch.SymInt) \
            else None
        sizes[i] = int(sym_hint(x)) * (n_batch if sym in batch_syms else 1)
    if split and any(not s.free_symbols for s in batch_syms):
        raise PlanOptionError("compile_backend(batch_axes=...): Dynamo traced this graph at the per-rank batch size "
                              "as a constant, so it cannot be planned at the global batch: compile with "
                              "torch.compile(model, backend=..., dynamic=True) (or torch._dynamo.mark_dynamic(x, 0) "
                              "on each input)")
    return split, sizes


def _batch_layout(axis_names: tuple, batch_axes) -> tuple:
    return tuple(Shard(0) if n in (batch_axes or ()) else Replicate() for n in axis_names)


def _replicated_pins(opts: PlanOptions, params: list[str], ndim: int) -> dict:
    """The plan's pins with every parameter (Dynamo's placeholder names) replicated; a user's pin sharding
    one is an error."""
    whole = ("R",) * ndim
    for pat, layout in (opts.pins or {}).items():
        if any(p != "R" for p in layout) and any(fnmatch.fnmatchcase(name, pat) for name in params):
            raise PlanOptionError(f"compile_backend: pin {pat!r} -> {tuple(layout)} shards a parameter, but "
                                  f"under this backend parameters stay the user's whole tensors: use "
                                  f"autopar.compile(model, mesh, example_inputs, pins=...) for sharded parameters")
    return {**(opts.pins or {}), **{p: whole for p in params}}


def compile_backend(mesh: Mesh, *, compiler: str = "inductor", **options):
    """A torch.compile backend planning each graph over `mesh` with replicated parameters (module
    docstring); `compiler`: "inductor", "aot_eager" (the traced per-rank graph, no code generation)
    or "eager" (the DTensor program); `options` are `autopar.plan`'s."""
    check_compiler(compiler)
    opts = PlanOptions(**without_memory_decisions(options, "compile_backend"))
    if opts.pipeline:
        raise PlanOptionError("compile_backend: pipeline= is not supported under torch.compile (a compiled graph "
                              "is one step's forward); use autopar.autoparallelize for a pipelined plan")
    plans: list[Plan] = []
    n_batch = math.prod(n for n, a in zip(mesh.shape, mesh.axis_names) if a in (opts.batch_axes or ()))

    def backend(gm: torch.fx.GraphModule, example_inputs):
        return _compiled_graph(gm, example_inputs, mesh, opts, n_batch, compiler, plans)

    backend.plans = plans      # one per compiled graph, for inspection (`backend.plans[0].report()`)
    return backend


def _compiled_graph(gm: torch.fx.GraphModule, example_inputs, mesh: Mesh, opts: PlanOptions, n_batch: int,
                    compiler: str, plans: list[Plan]):
    """One graph Dynamo hands the backend: planned (on rank 0, sent to all), rewritten, compiled;
    the callable Dynamo runs in its place. `plans` gets its plan."""
    cap, arg_of, split, tensors = _graph_capture(gm, example_inputs, n_batch)
    params = [name for name, slot in cap.inputs.items() if slot.kind == "param"]
    opts_here = dataclasses.replace(opts, pins=_replicated_pins(opts, params, len(mesh.shape)))
    plan = planned_on_rank0(lambda: plan_captured(cap, mesh, opts_here))
    device_mesh = mesh.device_mesh()
    program = rewrite(cap, plan, device_mesh)
    state = rng.RngState.agreed()
    rng.attach(program, state)
    arrives = {name: _batch_layout(tuple(mesh.axis_names), opts.batch_axes) for name, i in arg_of.items()
               if i in split}
    fn = per_rank_program(cap, plan, program, device_mesh, arrives)

    def feeds(args) -> list:
        values = []
        for name, slot in cap.inputs.items():
            if name in arg_of:
                values.append(args[arg_of[name]])
            elif slot.kind == "constant":
                values.append(cap.constants[slot.target] if slot.target in cap.constants
                              else getattr(cap.gm, slot.target))
            else:           # a buffer `gm` holds
                values.append(gm.get_buffer(slot.target))
        return values

    compiled = compile_program(fn, feeds(example_inputs), len(cap.outputs), compiler, device_mesh, untraceable(cap))

    # Dynamo may reuse this graph at other sizes (dynamic=True): the program is compiled at these
    shapes = {i: tuple(example_inputs[i].shape) for i in tensors}

    def run(*args):
        for i, shape in shapes.items():
            if tuple(args[i].shape) != shape:
                raise ShapeError(f"compile_backend: this graph was planned and compiled for input {i} of shape "
                                 f"{list(shape)} on each rank, called with {list(args[i].shape)}: keep the "
                                 f"sizes of every call (drop_last=True), or use a new torch.compile for others")
        state.next_call()
        return tuple(pytree.tree_leaves(split_outputs(cap, compiled(*feeds(args)), buffers=gm)))

    plans.append(plan)
    return run


def _graph_capture(gm: torch.fx.GraphModule, example_inputs, n_batch: int):
    """(capture of `gm` at the global batch, placeholder name -> Dynamo's argument index, the batch-split
    arguments, the tensor arguments' indices). Dynamo's parameters arrive as arguments: they become
    the capture's parameters."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    split, sizes = _batch_inputs(placeholders, example_inputs, n_batch)
    tensors = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)]
    # the plan sees the global batch: each rank's slice stands for n_batch of them, and the sizes
    # Dynamo left symbolic take their global values
    global_inputs = tuple(example_inputs[i].repeat(n_batch, *([1] * (example_inputs[i].ndim - 1)))
                          if i in split else example_inputs[i] for i in tensors)
    cap = capture(_Sized(gm, tensors, sizes), global_inputs)
    # placeholder -> Dynamo's argument; lifted constants and buffers of `gm` are not arguments
    arg_of = {name: tensors[slot.target] for name, slot in cap.inputs.items() if slot.kind == "input"}
    for name, i in arg_of.items():
        if isinstance(example_inputs[i], torch.nn.Parameter):
            cap.inputs[name] = InputSlot("param", name)
            cap.param_names[name] = name
    return cap, arg_of, split, tensors


def compile(model: torch.nn.Module, mesh: Mesh, example_inputs, *, example_kwargs: dict | None = None,  # noqa: A001
            compiler: str = "inductor", **options) -> torch.nn.Module:
    """`autoparallelize(model, mesh, example_inputs, **options)` (call on every rank), its per-rank
    program compiled by `compiler` (module docstring). Each rank stores its parameter shards only;
    train it with any optimizer over its parameters. Called at the example's input shapes (with
    `batch_axes`, each rank its slice of them)."""
    check_compiler(compiler)
    options = without_memory_decisions(options, "autopar.compile")
    dmodel = autoparallelize(model, mesh, example_inputs, example_kwargs=example_kwargs, **options)
    if not hasattr(dmodel, "_autopar") or dmodel.plan.pipeline.stages > 1:
        raise PlanOptionError("autopar.compile: a pipelined plan runs through its schedule; use autoparallelize")
    a = dmodel._autopar
    cap, plan, device_mesh = a["cap"], a["plan"], a["mesh"]
    program = rewrite(cap, plan, device_mesh)
    rng.attach(program, dmodel._rng)
    batch = _batch_layout(tuple(plan.mesh["axis_names"]), plan.options.get("batch_axes"))
    whole = ("R",) * device_mesh.ndim
    canon = {name: cap.param_names.get(str(slot.target), str(slot.target)) for name, slot in cap.inputs.items()
             if slot.kind == "param"}
    arrives = {name: (parse_layout(plan.placements.get(canon[name], whole)) if slot.kind == "param" else batch)
               for name, slot in cap.inputs.items() if slot.kind in ("param", "input")}
    fn = per_rank_program(cap, plan, program, device_mesh, arrives)

    def feeds(leaves) -> list:
        values = []
        for name, slot in cap.inputs.items():
            if slot.kind == "param":     # this rank's shard; its gradient returns to the DTensor as a shard
                values.append(dmodel.get_parameter(canon[name]).to_local())
            elif slot.kind == "buffer":
                values.append(dmodel.get_buffer(slot.target))
            elif slot.kind == "constant":
                values.append(cap.constants[slot.target] if slot.target in cap.constants
                              else getattr(cap.gm, slot.target))
            else:
                values.append(leaves[slot.target])
        return values

    n_batch = math.prod(n for n, p in zip(device_mesh.shape, batch) if isinstance(p, Shard))
    example = [x.chunk(n_batch)[0] if isinstance(x, torch.Tensor) and x.ndim and n_batch > 1 else x
               for x in flatten_inputs(example_inputs if isinstance(example_inputs, tuple) else (example_inputs,),
                                       example_kwargs)]
    compiled = compile_program(fn, feeds(example), len(cap.outputs), compiler, device_mesh, untraceable(cap))

    def forward(*args, **kwargs):
        dmodel._rng.next_call()
        return split_outputs(cap, compiled(*feeds(flatten_inputs(args, kwargs))), buffers=dmodel)

    dmodel.forward = forward
    return dmodel
