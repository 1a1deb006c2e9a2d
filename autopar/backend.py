"""`torch.compile(model, backend=autopar.compile_backend(mesh))`.

Dynamo hands us the model's graph with parameters lifted to inputs (real `nn.Parameter`s).
We plan that graph exactly as `autopar.plan` would (parameters are planned, not treated as
data), rewrite it into the same per-rank DTensor program, and return a callable that runs it.

The user's optimizer keeps stepping the user's own full parameters, so each call enters them
as whole DTensors and reshards them to their planned layouts; the reshard's backward gathers
the gradient whole again (all-reduce or all-gather per the plan), so `param.grad` on every
rank is the full gradient. Compute and activations are distributed as planned; parameter
memory is not saved in this mode (use `autoparallelize` for sharded parameter storage).

Re-capturing Dynamo's graph lifts its tensor constants (and any buffers it holds) to inputs
that are not among Dynamo's arguments: each call feeds them from the capture, and feeds Dynamo's
arguments by their index. Non-tensor results (a Hugging Face `DynamicCache`) stay Dynamo's:
the graph returns the cache's tensors and Dynamo rebuilds the object around them.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

from .api import planned_on_rank0
from .compat import pytree
from .errors import PlanOptionError
from .mesh import Mesh
from .passes.capture import InputSlot, capture
from .passes.rewrite import rewrite
from .placement import parse_layout
from .plan import Plan
from .planner import PlanOptions, plan_captured
from .runtime.module import split_outputs
from .runtime import rng
from .runtime.reshard import reshard


def compile_backend(mesh: Mesh, **options):
    opts = PlanOptions(**options)
    if opts.pipeline:
        raise PlanOptionError("compile_backend: pipeline= is not supported under torch.compile (a compiled graph "
                              "is one step's forward); use autopar.autoparallelize for a pipelined plan")
    plans: list[Plan] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        for i, x in enumerate(example_inputs):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"autopar's compile backend needs static shapes: input {i} is {type(x).__name__}; "
                                f"use torch.compile(..., dynamic=False)")
        cap = capture(gm, tuple(example_inputs))
        # placeholder -> Dynamo's argument; lifted constants and buffers of `gm` are not arguments
        arg_of = {name: slot.target for name, slot in cap.inputs.items() if slot.kind == "input"}
        for name, i in arg_of.items():
            if isinstance(example_inputs[i], torch.nn.Parameter):
                cap.inputs[name] = InputSlot("param", name)
                cap.param_names[name] = name
        plan = planned_on_rank0(lambda: plan_captured(cap, mesh, opts))
        device_mesh = mesh.device_mesh()
        program = rewrite(cap, plan, device_mesh)
        state = rng.RngState.agreed()
        rng.attach(program, state)
        whole = tuple(Replicate() for _ in device_mesh.shape)
        layouts = {name: parse_layout(plan.placements[cap.inputs[name].target]) for name in cap.inputs
                   if cap.inputs[name].kind == "param" and cap.inputs[name].target in plan.placements}

        def run(*args):
            state.next_call()
            values = []
            for name, slot in cap.inputs.items():
                if name in arg_of:
                    a = args[arg_of[name]]
                elif slot.kind == "constant":
                    a = cap.constants[slot.target] if slot.target in cap.constants else getattr(cap.gm, slot.target)
                else:           # a buffer `gm` holds
                    a = gm.get_buffer(slot.target)
                if isinstance(a, torch.Tensor) and not isinstance(a, DTensor):
                    a = DTensor.from_local(a, device_mesh, whole, run_check=False)
                    if name in layouts:
                        a = reshard(a, layouts[name])
                values.append(a)
            return tuple(pytree.tree_leaves(split_outputs(cap, program(*values), buffers=gm)))

        plans.append(plan)
        return run

    backend.plans = plans      # one per compiled graph, for inspection (`backend.plans[0].report()`)
    return backend
