"""Every private torch (and Hugging Face) API autopar uses, in one place (torch 2.11 - 2.13).

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
  `to_local()` may hand out a fresh view each call), to tell when a parameter's storage was replaced;
  `held_locals(tensors)`: that of each of them at once (None for a plain tensor).
* `dtensor_from(local, mesh, placements, shape, stride)`: `DTensor.from_local(..., run_check=False)` where
  no autograd graph is recorded (inside an autograd Function, or grad mode off): the spec built and the
  DTensor made directly (DTensor's `_dtensor_spec`, `_utils.compute_global_tensor_info` for a global
  shape not given), without from_local's autograd Function: 1 us against 55-60 us a call on CPU,
  paid several times per step on the runtime's hot path.
* `storage_users(t)`: how many tensors share `t`'s storage (c10's use count of its StorageImpl), to tell
  whether a gradient buffer handed out last step is still held by anything but autopar's own views.
* `GROUPED_MM`: aten._grouped_mm, the op `torch.nn.functional.grouped_mm` runs (torch's FLOP counter
  has no formula for it: passes/lowering.py registers one under this name).
* `fake_tensor_cache(enabled)`: turn FakeTensorMode's dispatch cache on or off while tracing
  (torch._dynamo.config.fake_tensor_cache_enabled): with symbolic sizes, building and reading its
  entries costs more than the ops it saves (`passes/capture.py`).
* `lazy_graph_modules()`: graph modules made or recompiled inside write their Python code only when first
  run or read (torch.fx's `_LazyGraphModule`, as torch.compile makes its graphs): capture recompiles its
  graph after every pass, and the planner never runs it (Gemma-2-9B's capture: 36 code generations).
* `wrapper_tensor(cls, like)`: a storage-less tensor subclass shaped like `like`
  (Tensor._make_wrapper_subclass), for a value an asynchronous collective is still writing.
* `op_packet_name(packet)`: "aten::linear" for an op packet (its `_qualified_op_name`).
* `has_module_hooks(m)`: whether a module has hooks of its own (its private hook dicts).
* `parameter_table(m)`, `buffer_table(m)`, `child_table(m)`: nn.Module's own dicts of its direct
  parameters, buffers and children (`_parameters`, `_buffers`, `_modules`), read and written in place.
* `hf_default_gate(experts)`, `hf_init_weights(model)`: Hugging Face's private `_apply_gate` (is it
  transformers' default?) and `_init_weights` (a model's per-module initialiser).
* `SafeDcpReader(path)`: torch.distributed.checkpoint's `FileSystemReader` whose `.metadata` file is
  unpickled with only the metadata's own classes allowed (torch's reader unpickles it with plain
  `pickle.load`, which would run any code a file names); the allowed names include DCP's private
  `_StorageInfo` and `torch.serialization._get_layout` (a name -> torch.layout table lookup).
"""
from __future__ import annotations

import importlib
import itertools
import operator
import pickle

import sympy
import torch
import torch.utils._pytree as pytree  # noqa: F401 - re-exported
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol  # noqa: F401 - re-exported
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["pytree", "funcol", "OpOverload", "OpOverloadPacket", "HigherOrderOperator", "is_mutable", "sym_expr",
           "sym_hint", "TorchDispatchMode", "tensor_version", "default_store", "set_group_timeout",
           "at_backward_end", "fake_tensor_cache", "GROUPED_MM", "attention_block", "attention_block_backward",
           "SafeDcpReader", "tracing", "compile_graph", "dynamo_user_input", "wrapper_tensor", "op_packet_name",
           "has_module_hooks", "parameter_table", "buffer_table", "child_table", "hf_default_gate", "hf_init_weights",
           "lazy_graph_modules"]

GROUPED_MM = torch.ops.aten._grouped_mm


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


def lazy_graph_modules():
    from torch.fx._lazy_graph_module import _use_lazy_graph_module
    return _use_lazy_graph_module(True)


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


# c10d's all-gather and reduce-scatter into one flat tensor: torch 2.13 names them `all_gather_single` and
# `reduce_scatter_single` (same arguments) and deprecates the old names with a warning per call;
# older torch (the GPU machine's 2.11) may have only the old ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# local_tensor(dt): the local tensor object held by DTensor `dt` (no view made). An attribute getter
# (C), not a Python function: it runs per parameter and step (leaves fed, the optimizer's lending).
local_tensor = operator.attrgetter("_local_tensor")


def held_locals(tensors: list) -> list:
    """`local_tensor` of each of `tensors`, None for a plain tensor: one pass in C (`map` of `getattr`
    with a default), no Python frame per tensor (a forward checks every parameter this way)."""
    return list(map(getattr, tensors, itertools.repeat("_local_tensor"), itertools.repeat(None)))


def dtensor_from(local: torch.Tensor, mesh, placements, shape=None, stride=None) -> torch.Tensor:
    """A DTensor holding `local` in `placements` over `mesh` (global `shape` and `stride`, computed as
    from_local does where not given); recorded by autograd only through `DTensor.from_local` (grad mode on
    and `local` requiring grad)."""
    from torch.distributed.tensor import DTensor
    if torch.is_grad_enabled() and local.requires_grad:
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_global_tensor_info
    placements = tuple(placements)
    if shape is None:
        shape, stride = compute_global_tensor_info(local, mesh, placements)
    spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return DTensor.__new__(DTensor, local.view_as(local), spec, requires_grad=local.requires_grad)   # as from_local


def storage_users(t: torch.Tensor) -> int:
    """How many tensors (views included) hold `t`'s storage; no public API counts them."""
    storage = t.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) - 1      # less the storage object made here


def tensor_users(t: torch.Tensor) -> int:
    """How many references the tensor `t` (not its storage) has: its Python object's, its views', and a
    collective's that holds it; no public API counts them."""
    return t._use_count()


def wrapper_tensor(cls: type, like: torch.Tensor) -> torch.Tensor:
    """A tensor of subclass `cls` holding no data, with `like`'s size, strides, dtype and device: every
    op on it reaches `cls.__torch_dispatch__` (a value still being written waits there first). No
    public constructor makes a storage-less tensor subclass (`as_subclass` shares `like`'s storage, so
    an op could read it before it is written); DTensor and FakeTensor are made this way."""
    return torch.Tensor._make_wrapper_subclass(cls, like.size(), strides=like.stride(), dtype=like.dtype,
                                               device=like.device, requires_grad=False)


def op_packet_name(packet: OpOverloadPacket) -> str:
    """"aten::linear" for `torch.ops.aten.linear`: an op packet's namespace and name (an OpOverload has
    `.namespace` and `.overloadpacket`; a packet has no public attribute naming its namespace)."""
    return packet._qualified_op_name


def has_module_hooks(m: torch.nn.Module) -> bool:
    """Has `m` forward, forward-pre, backward or backward-pre hooks of its own registered? nn.Module
    has no public query of its hooks: they are kept in its private dicts."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


# nn.Module's own tables of its direct parameters, buffers and children, read and written in place. The
# public ways in go through nn.Module.__getattr__/__setattr__ and register_*: a Python call searching
# all three tables per access (the per-step feed reads each parameter's current object), and, on
# writing, the global registration hooks (`register_module_parameter_registration_hook`), which a
# temporary swap and its exact undo (materialise.py) must not fire.
def parameter_table(m: torch.nn.Module) -> dict[str, torch.nn.Parameter | None]:
    return m._parameters


def buffer_table(m: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return m._buffers


def child_table(m: torch.nn.Module) -> dict[str, torch.nn.Module | None]:
    return m._modules


def hf_default_gate(experts: torch.nn.Module) -> bool:
    """Does a Hugging Face experts module's class combine its gate and up projections with
    transformers' default `_apply_gate` (gate rows first, `act(gate) * up`)? transformers exposes no
    public flag for it: the private method, overridden by models with another gating, is what says."""
    gate = getattr(type(experts), "_apply_gate", None)
    return hasattr(experts, "_apply_gate") and getattr(gate, "__name__", None) == "_default_apply_gate"


def hf_init_weights(model: torch.nn.Module):
    """A Hugging Face model's per-module initialiser (`PreTrainedModel._init_weights(module)`), or None.
    Its public `init_weights()` initialises the whole model: here one module's buffers are computed."""
    return getattr(model, "_init_weights", None)


# the efficient (cutlass) CUDA kernel reads an additive mask with its rows aligned to this many elements,
# and pads its queries' log-sum-exp to a multiple of this many (xformers' kAlignLSE)
_EFFICIENT_ALIGN, _EFFICIENT_LSE_ALIGN = 16, 32


def _cuda_kernel(q, bias) -> str:
    """Which CUDA kernel runs a block: flash where it applies (16-bit, no mask), else efficient."""
    return "flash" if bias is None and q.dtype in (torch.float16, torch.bfloat16) else "efficient"


def _efficient_bias(bias, q, k):
    """An additive mask as the efficient kernel takes it: (B, H, Sq, Sk), rows 16-aligned in memory."""
    if bias is None:
        return None
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    cols = -(-shape[-1] // _EFFICIENT_ALIGN) * _EFFICIENT_ALIGN
    out = torch.empty((*shape[:-1], cols), dtype=q.dtype, device=q.device)[..., :shape[-1]]
    return out.copy_(bias.expand(shape))


def _gqa(q, k, v):
    """K/V heads repeated for grouped-query attention (the CUDA kernels want as many as q's)."""
    g = q.shape[1] // k.shape[1]
    return (k, v) if g == 1 else (k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))


def _one_head_dim(*tensors):
    """The tensors zero-padded on their last dim to the widest's: the fused kernels take one head dim
    for q, k and v, where multi-head latent attention's values are narrower than its queries and keys.
    Zero columns leave the scores, the log-sum-exp and the output's own columns as they were."""
    d = max(t.shape[-1] for t in tensors)
    return tuple(t if t.shape[-1] == d else torch.nn.functional.pad(t, (0, d - t.shape[-1])) for t in tensors)


def attention_block(q, k, v, bias, is_causal: bool, scale: float):
    """(output in q's dtype, log-sum-exp (B, H, Sq) in fp32, the kernel's state for its backward) of one
    fused attention kernel; `bias` an additive mask in q's dtype or None; k, v may have fewer heads (GQA),
    v another head dim (`_one_head_dim`)."""
    width = v.shape[-1]
    q, k, v = _one_head_dim(q, k, v)
    out, lse, state = _attention_kernel(q, k, v, bias, is_causal, scale)
    return out[..., :width], lse, state


def _attention_kernel(q, k, v, bias, is_causal: bool, scale: float):
    aten = torch.ops.aten
    if q.device.type != "cuda":     # the CPU kernel takes grouped K/V heads as they are
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=bias,
                                                                     scale=scale)
        return out, lse, ()
    k, v = _gqa(q, k, v)
    if _cuda_kernel(q, bias) == "flash":
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal, False, scale=scale)
        return out, lse, (cum_q, cum_k, seed, offset)
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
        q, k, v, _efficient_bias(bias, q, k), True, 0.0, is_causal, scale=scale)
    return out, lse[..., :q.shape[2]], (seed, offset)


def attention_block_backward(dout, q, k, v, out, lse, bias, is_causal: bool, scale: float, state: tuple):
    """(dq, dk, dv) of `attention_block(q, k, v, bias, is_causal, scale)` given the output and
    log-sum-exp of the whole attention these keys are one block of (that is how blocks' gradients add
    up: FlashAttention's backward); `state`: the forward kernel's (any of its calls: without dropout
    it holds no per-call randomness). dk, dv have k's heads, each gradient its tensor's head dim."""
    widths = (q.shape[-1], k.shape[-1], v.shape[-1])
    dout, q, k, v, out = _one_head_dim(dout, q, k, v, out)
    grads = _attention_kernel_backward(dout, q, k, v, out, lse, bias, is_causal, scale, state)
    return tuple(g[..., :w] for g, w in zip(grads, widths))


def _attention_kernel_backward(dout, q, k, v, out, lse, bias, is_causal: bool, scale: float, state: tuple):
    aten = torch.ops.aten
    if q.device.type != "cuda":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=bias, scale=scale)
    heads = k.shape[1]
    k, v = _gqa(q, k, v)
    if _cuda_kernel(q, bias) == "flash":
        cum_q, cum_k, seed, offset = state
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), cum_q, cum_k, q.shape[2], k.shape[2], 0.0, is_causal, seed, offset,
            scale=scale)
    else:
        seed, offset = state
        pad = -lse.shape[-1] % _EFFICIENT_LSE_ALIGN
        lse = torch.nn.functional.pad(lse, (0, pad)) if pad else lse.contiguous()
        # no mask: None, which torch.ops passes on as the undefined tensor the kernel reads as "no bias"
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, _efficient_bias(bias, q, k), out, lse, seed, offset, 0.0, [True, True, True, False],
            is_causal, scale=scale)
    if heads != q.shape[1]:
        dk, dv = (g.unflatten(1, (heads, -1)).sum(2) for g in (dk, dv))
    return dq, dk, dv
# the globals a DCP `.metadata` pickle names, beyond torch.distributed.checkpoint.metadata's classes and dtypes
_DCP_ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
                ("torch", "Size"), ("collections", "OrderedDict"), ("pathlib", "PosixPath"),
                ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}


class _DcpUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        allowed = (module, name) in _DCP_ALLOWED or module in ("torch", "torch.distributed.checkpoint.metadata")
        obj = getattr(importlib.import_module(module), name, None) if allowed else None
        if ((module, name) in _DCP_ALLOWED or (module == "torch" and isinstance(obj, torch.dtype))
                or (module == "torch.distributed.checkpoint.metadata" and isinstance(obj, type))):
            return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not part of checkpoint metadata")


def SafeDcpReader(path):  # noqa: N802 - a reader object, its class made on first use (DCP imported lazily)
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _DcpUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata
    return _Reader(path)
