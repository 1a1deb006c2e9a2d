"""Every private torch API autopar uses, in one place (torch 2.11 - 2.13).

Anything reached through a leading underscore, or through an object's internals, is imported or
wrapped here and nowhere else, so a torch upgrade that moves one breaks this file only.

* `pytree`: torch.utils._pytree, torch's tree utilities (no public equivalent; torch.export and
  DTensor use it, and its registered node types - tuples, dicts, dataclasses, HF outputs - are
  the ones a forward returns).
* `OpOverload`, `OpOverloadPacket`, `HigherOrderOperator`: the types of graph call targets
  (torch._ops), to tell an ATen op from a Python function or a higher-order region.
* `is_mutable(op)`: whether an ATen op writes an input (its schema, torch._ops internals).
* `TorchDispatchMode`: torch.utils._python_dispatch's base class for seeing every ATen op (the
  memory meter counts allocations with it; torch's FlopCounterMode and checkpoint use it too).
* `tensor_version(t)`: the in-place version counter of a tensor (Tensor._version), which tells a
  tensor saved twice unchanged from one written in between.
* `sym_expr(size)`, `sym_hint(size)`: the sympy expression and the example value behind a
  symbolic size of a traced tensor (torch.SymInt's node).
* `funcol`: torch.distributed._functional_collectives, torch's asynchronous, traceable collectives
  (all_to_all_single, permute_tensor, all_gather_single, reduce_scatter_single); the context-parallel
  attention executor overlaps its ring hops with them, as torch's own ring attention does.
* `tracing()`: whether ops are being traced into a graph rather than run (Dynamo, make_fx, fake
  tensors: funcol's own test, `_are_we_tracing`); a collective issued then must be a functional one
  (c10d's in-place collectives and their work handles do not trace), so the runtime's direct c10d
  shortcuts step aside (`runtime/reshard.py`).
* `compile_graph(gm, example_inputs, compiler)`: an fx graph compiled through aot_autograd, by
  inductor (`torch._inductor.compile_fx.compile_fx`, what torch.compile's default backend calls) or
  with no code generation (`torch._dynamo.backends.debugging.aot_eager`), or by a given
  torch.compile backend; the result is called with the inputs as positional arguments.
* `dynamo_user_input(node)`: whether a placeholder of a graph Dynamo hands a backend holds an
  argument of the compiled call (a local of the compiled frame other than `self`), not a parameter,
  buffer or global: its `grapharg` source (Dynamo's metadata on the node).
* `default_store()`: the job's rendezvous key-value store (torch.distributed's c10d internals);
  `set_group_timeout(group, seconds)`: how long a process group's collectives wait for peers.
* `at_backward_end(fn)`: run fn when the current backward pass ends (autograd engine's
  queue_callback, as DDP and FSDP2 wait for their gradient reductions).
* `dtensor_like(local, like)`: a DTensor holding `local` with the spec (mesh, placements, global
  shape and stride) of `like`, without `DTensor.from_local`'s autograd node and spec building: a
  reduced gradient becomes its parameter's `.grad` this way every step (DTensor's own constructor
  and `_spec`); `local_tensor(dt)`: the local tensor object a DTensor holds (`_local_tensor`; its
  `to_local()` may hand out a fresh view each call), to tell when a parameter's storage was replaced.
* `fake_tensor_cache(enabled)`: turn FakeTensorMode's dispatch cache on or off while tracing
  (torch._dynamo.config.fake_tensor_cache_enabled): with symbolic sizes, building and reading its
  entries costs more than the ops it saves (`passes/capture.py`).
"""
from __future__ import annotations

import sympy
import torch
import torch.utils._pytree as pytree  # noqa: F401 - re-exported
import torch.distributed._functional_collectives as funcol  # noqa: F401 - re-exported
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["pytree", "funcol", "OpOverload", "OpOverloadPacket", "HigherOrderOperator", "is_mutable", "sym_expr",
           "sym_hint", "TorchDispatchMode", "tensor_version", "default_store", "set_group_timeout",
           "at_backward_end", "fake_tensor_cache", "tracing", "compile_graph",
           "dynamo_user_input"]


def tracing() -> bool:
    return funcol._are_we_tracing()


# inductor's all-reduce bucketing: the gradients' all-reduces of the compiled backward, one per parameter
# as traced, merged into few large ones, as DDP's buckets merge them (each c10d call costs a fixed
# ~0.1-0.5 ms of CPU on gloo, paid per parameter per step otherwise)
INDUCTOR_CONFIG = {"bucket_all_reduces_fx": "all"}


def compile_graph(gm: torch.fx.GraphModule, example_inputs: list, compiler):
    from torch._guards import tracing
    # outside the tracing context of the Dynamo graph being compiled (its fake mode may hold symbolic
    # sizes): the per-rank program is traced afresh at the static sizes of `example_inputs`
    with tracing(None):
        if callable(compiler):
            return compiler(gm, example_inputs)
        if compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx, compile_fx_inner

            def inner(g, inputs, *args, **kwargs):
                _functional_collectives_only(g)
                return compile_fx_inner(g, inputs, *args, **kwargs)
            return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=INDUCTOR_CONFIG)
        from torch._dynamo.backends.common import aot_autograd

        def run_as_is(g, inputs):
            _functional_collectives_only(g)
            return g
        return aot_autograd(fw_compiler=run_as_is, bw_compiler=run_as_is)(gm, example_inputs)


def _functional_collectives_only(g: torch.fx.GraphModule) -> None:
    """A traced graph with a c10d collective in it (an in-place one, a work handle: traced as an effect,
    its result not flowing) would run wrong: refuse it (each of autopar's executors traces functionally)."""
    for node in g.graph.nodes:
        for target in (node.target, *(a for a in node.args if isinstance(a, OpOverload))):
            if isinstance(target, OpOverload) and target.namespace == "c10d":
                raise RuntimeError(f"{target} in the traced per-rank graph: not a functional collective")


def dynamo_user_input(node: torch.fx.Node) -> bool:
    arg = node.meta.get("grapharg")
    source = getattr(arg, "source", None)
    if source is None:
        return False
    name = source.name() if callable(source.name) else source.name
    return name.startswith("L[") and not name.startswith("L['self']")


def fake_tensor_cache(enabled: bool):
    """A context in which FakeTensorMode caches its dispatches (the default) or not."""
    import torch._dynamo.config as dynamo_config
    return dynamo_config.patch(fake_tensor_cache_enabled=enabled)


def is_mutable(op: OpOverload) -> bool:
    return bool(op._schema.is_mutable)


def tensor_version(t: torch.Tensor) -> int:
    return t._version


def sym_expr(size) -> sympy.Expr:
    """The expression of a size: a symbol or formula for a SymInt, an Integer for an int."""
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))


def sym_hint(size) -> int | None:
    """The example's value of a size (None for a size only known at run time)."""
    return size.node.hint if isinstance(size, torch.SymInt) else int(size)


def default_store():
    from torch.distributed import distributed_c10d
    return distributed_c10d._get_default_store()


def set_group_timeout(group, seconds: float) -> None:
    from datetime import timedelta

    from torch.distributed import distributed_c10d
    distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def at_backward_end(fn) -> None:
    """Call fn() once the backward pass now running finishes (call from inside a backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def dtensor_like(local: torch.Tensor, like) -> torch.Tensor:
    """A DTensor over `local` (same shape as `like`'s local tensor) with `like`'s spec; no autograd.
    Made by `__new__` alone: DTensor's `__init__` does nothing but costs microseconds of wrappers
    (dynamo's disable, export's marker), once per parameter gradient and step."""
    from torch.distributed.tensor import DTensor
    return DTensor.__new__(DTensor, local, like._spec, requires_grad=False)


def local_tensor(dt) -> torch.Tensor:
    """The local tensor object held by DTensor `dt` (no view made)."""
    return dt._local_tensor
