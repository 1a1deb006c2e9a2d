"""A plan's per-rank program as one graph of plain tensors and functional collectives, compiled.

`per_rank_program` is the rewritten program (`runtime/rewrite.py`) behind a function of this rank's
local tensors: each enters as a DTensor in the layout it arrives in (a parameter's stored shard,
a user input's batch slice, a whole constant), is moved to its planned layout if that differs,
and every output leaves as a local tensor. `compile_program` hands that function to
`aot_autograd` (through inductor's `compile_fx`, or with no code generation: "aot_eager"): it is
traced on fake tensors forward and backward at once, and what DTensor and the runtime's autograd
functions do while traced - local ops, and their redistributions as
`torch.distributed._functional_collectives` (all_reduce, all_gather_into_tensor, reduce_scatter,
all_to_all, each issued and waited in the graph) - is the joint graph inductor partitions, fuses
and schedules. Sharding propagation, the wrappers and the Python of the runtime run once, at
trace time; a step runs the generated kernels and the collectives alone.

What does not trace falls back to the eager DTensor program, and says so (a warning naming the
cause): dropout (its masks come from per-shard generators, `runtime/rng.py`), mixture-of-experts
layers (expert parallelism's all-to-alls are c10d calls with host-side counts, `runtime/experts.py`),
and anything else the tracer refuses, including a graph in which a c10d collective was traced
(`compat.compile_graph` refuses it: its in-place result would not flow).
"""
from __future__ import annotations

import logging
import operator
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Replicate

from . import compat
from .errors import PlanOptionError
from .passes.capture import Captured
from .placement import parse_layout
from .plan import Plan
from .runtime import rng
from .runtime.async_output import AsyncOutput
from .runtime.reshard import reshard, traced_coordinate

_log = logging.getLogger(__name__)

COMPILERS = ("inductor", "aot_eager", "eager")


# the compiled program runs the layout plan alone: no memory decision (recomputation regions, re-gathered
# parameters, offload) is wired into it, so none is planned (`autoparallelize` executes them)
NO_MEMORY_DECISIONS = {"recompute": "none", "residency": "keep", "offload": "none"}


def without_memory_decisions(options: dict, who: str) -> dict:
    """`options` with the memory families fixed off; a request for one is an error naming `who`."""
    for key, off in NO_MEMORY_DECISIONS.items():
        if options.get(key, off) not in (off, "auto"):
            raise PlanOptionError(f"{who}: {key}={options[key]!r} is a memory decision the compiled program does not "
                                  f"execute; use autopar.autoparallelize for it, or leave {key} out")
    return {**options, **NO_MEMORY_DECISIONS}


def check_compiler(compiler) -> None:
    if compiler not in COMPILERS and not callable(compiler):
        raise PlanOptionError(f"compiler={compiler!r}: give one of {COMPILERS} (inductor: generated kernels; "
                              f"aot_eager: the same traced per-rank graph run op by op; eager: the DTensor program) "
                              f"or a torch.compile backend, fn(graph_module, example_inputs) -> callable")


def per_rank_program(cap: Captured, plan: Plan, program: fx.GraphModule, device_mesh,
                     arrives: dict[str, tuple]) -> Callable:
    """fn(*local tensors, one per `cap.inputs` entry in order) -> the program's flat outputs as local
    tensors. `arrives`: placeholder name -> the layout its local tensor is in (default: whole)."""
    whole = tuple(Replicate() for _ in device_mesh.shape)
    planned = {n.name: parse_layout(n.output) for n in plan.nodes if n.executor in ("input", "param")}
    names = list(cap.inputs)
    # an output made whole by an all-reduce left pending (async_output.py) is a wrapper subclass
    # holding a c10d work handle: traced, the output is made whole by the plain reshard instead
    for mod in program.children():
        if isinstance(mod, AsyncOutput):
            mod.blocking = True

    def fn(*values):
        fed = []
        for name, v in zip(names, values):
            if isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
                layout = arrives.get(name, whole) if v.ndim else whole
                v = DTensor.from_local(v, device_mesh, layout, run_check=False)
                want = planned.get(name, layout)
                if v.ndim and want != layout:
                    v = reshard(v, want)
            fed.append(v)
        outs = program(*fed)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outs)

    return fn


def untraceable(cap: Captured) -> str | None:
    """Why the program of `cap` cannot be traced into one graph (None: it can)."""
    for node in cap.gm.graph.nodes:
        if node.target in rng.DROPOUT_OPS and node.args[1] != 0:
            return f"dropout {node.name} draws its masks from per-shard generators (runtime/rng.py)"
        if node.target is torch.ops.autopar.moe_experts.default:
            return f"experts {node.name} route tokens with c10d all-to-alls sized on the host (runtime/experts.py)"
    return None


def compile_program(fn: Callable, example_inputs: Sequence[torch.Tensor], n_outputs: int, compiler, device_mesh,
                    why_not: str | None = None) -> Callable:
    """`fn` (a `per_rank_program` over `device_mesh`) compiled by `compiler` for inputs like
    `example_inputs`; `fn` itself (logged) where the program does not trace (`why_not`, or the
    tracer's error). Every rank traces the same graph: what differs between ranks (which one keeps
    a value made a partial sum, `reshard.traced_coordinate`) is read from one more input, this rank's
    mesh coordinate, so the compiler partitions and orders every rank's collectives alike."""
    if compiler == "eager":
        return fn
    if why_not is not None:
        warnings.warn(f"autopar: running the eager DTensor program, not {compiler}: {why_not}", stacklevel=3)
        return fn
    coordinate = torch.tensor(device_mesh.get_coordinate())
    with traced_coordinate(device_mesh) as set_coordinate:
        def traced(*values):
            set_coordinate(values[-1])
            return fn(*values[:-1])
        g = fx.Graph()
        out = g.call_function(traced, tuple(g.placeholder(f"x{i}") for i in range(len(example_inputs) + 1)))
        g.output(tuple(g.call_function(operator.getitem, (out, k)) for k in range(n_outputs)))
        gm = fx.GraphModule(torch.nn.Module(), g, class_name="AutoparPerRank")
        try:
            compiled = compat.compile_graph(gm, [*example_inputs, coordinate], compiler)
        except Exception as e:   # noqa: BLE001 - any tracer refusal: run eager, logged
            warnings.warn(f"autopar: the per-rank program does not trace ({type(e).__name__}: {str(e)[:300]}); "
                          f"running the eager DTensor program instead of {compiler}", stacklevel=3)
            _log.info("autopar: trace failure", exc_info=True)
            return fn
    return lambda *values: compiled(*values, coordinate)
