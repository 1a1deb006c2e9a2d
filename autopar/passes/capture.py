"""Capture: a model and example inputs become one torch.fx graph of the forward.

We use `torch.export` (non-strict), which traces on fake tensors, so a model whose
parameters live on the meta device is captured without materialising a weight, and
Python shape arithmetic (`B, T = x.shape`) is specialised to the example's sizes.

The captured graph is ATen-level but keeps composite ops whole (`aten.linear`,
`aten.layer_norm`, `aten.scaled_dot_product_attention`), which is the granularity a
sharding decision is made at. It is functional: in-place ops (`x[..., 1:] = y`, BatchNorm's
running statistics) become out-of-place ones, and buffer updates become graph outputs
(`Captured.outputs`), written back after each step. Regions traced under `torch.no_grad()`
are inlined with their results detached. Parameters, buffers and user inputs are placeholders;
`Captured.inputs` says which is which. Tied parameters (one tensor, two names) are folded
onto one placeholder so the planner gives them one placement.

Hugging Face models run unchanged: a KV cache a forward returns (a transformers `Cache`, as
`past_key_values`) is returned as None, since a training step has no use for it and a cache
object is not a graph output.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
import logging
import operator
import os
import sys
import warnings
from typing import Any

import torch
import torch.fx as fx

from ..compat import (HigherOrderOperator, OpOverload, fake_tensor_cache, is_mutable, lazy_graph_modules, pytree,
                      sym_hint)
from ..errors import CaptureError
from .causal_mask import causal_masks_as_flags
from .captured import Captured, InputSlot
from .lowering import DECOMPOSITIONS, drop_assertions, drop_identity_dropouts, exact_mean_losses, experts_as_one_op
from .repeated_blocks import TRACED, deep_stack, expand, traced_blocks

_log = logging.getLogger("autopar")

_TORCH_DIR = os.path.dirname(torch.__file__)
_AUTOPAR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def flatten_inputs(args: tuple, kwargs: dict | None) -> list[Any]:
    return pytree.tree_leaves((tuple(args), dict(kwargs or {})))


def capture(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *, dynamic_shapes=None) -> Captured:
    """`dynamic_shapes` (torch.export's argument) leaves marked sizes symbolic: see symbolic_shapes.py.
    A deep stack of alike blocks is traced three blocks deep and copied (repeated_blocks.py). The graph's
    Python code is written when it is first run or read, not after each pass (`lazy_graph_modules`: a
    tenth of Gemma-2-9B's capture went to 36 code generations that nothing read)."""
    with lazy_graph_modules():
        return _capture(model, args, kwargs, dynamic_shapes)


def _capture(model: torch.nn.Module, args: tuple, kwargs: dict | None, dynamic_shapes) -> Captured:
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"autopar needs a torch.nn.Module, got {type(model).__name__}")
    args = args if isinstance(args, tuple) else (args,)
    if any(p.is_meta for p in model.parameters()):
        # real inputs next to meta weights would meet on two devices (`arange(T, device=idx.device)` + an
        # embedding); devices in the graph are the mesh's at run time (rewrite.py), so trace on meta alone
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    stack = deep_stack(model) if dynamic_shapes is None else None
    if stack is None:
        return _trace(model, args, kwargs, dynamic_shapes)
    path, period = stack
    depth = len(model.get_submodule(path))
    try:
        with traced_blocks(model, path, period) as (depth, uses):
            cap = _trace(model, args, kwargs, None)
    except CaptureError as e:
        why = f"the short model does not trace ({str(e).splitlines()[0][:200]})"
    else:
        cap.param_names = _param_names(model)
        why = (f"the blocks read their index ({', '.join(sorted(set(uses)))}), so they may differ" if uses
               else expand(cap, path, depth, lambda fqn: cap.param_names.get(fqn) == fqn, period))
        if why is None:
            kind = "alike" if period == 1 else f"alike every {period} blocks"
            cap.trace = f"short: {path}, {depth} blocks proven {kind}, {TRACED * period} traced and the rest copied"
            return cap
    _log.info("capture: tracing all %d blocks of %s.%s: %s", depth, type(model).__name__, path, why)
    cap = _trace(model, args, kwargs, None)
    cap.trace = f"whole: all {depth} blocks of {path} traced ({why})"
    return cap


def _param_names(model: torch.nn.Module) -> dict[str, str]:
    """Every parameter name (aliases too) -> the first name of its tensor."""
    canonical, names = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), name)
        names[name] = canonical[id(p)]
    return names


def _trace(model: torch.nn.Module, args: tuple, kwargs: dict | None, dynamic_shapes) -> Captured:
    was_training = model.training
    had_forward = "forward" in model.__dict__
    own_forward = model.__dict__.get("forward")
    model.forward = _without_caches(model.forward)
    try:
        # FakeTensorMode's dispatch cache pays at fixed sizes (0.5 s against 0.65 s without, a 2-block
        # Llama-3-8B) and is left as it is there; at symbolic sizes making and reading its entries costs
        # more than the ops it saves (1.3 s against 1.75 s; 1.65 s against 2.9 s as the process's first)
        no_cache = fake_tensor_cache(False) if dynamic_shapes is not None else contextlib.nullcontext()
        args, kwargs = _distinct_inputs(args, kwargs or {})
        with experts_as_one_op(model), _no_partial_graph_dump(), no_cache:
            ep = torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes)
        _inline_no_grad_regions(ep.graph_module)
        _functional_detach(ep)
        drop_identity_dropouts(ep.graph_module)
        with warnings.catch_warnings():   # torch's own deepcopy of its tree specs warns about itself
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            # functional (mutations out, no-grad regions inlined), composites kept, BatchNorm lowered;
            # a graph that needs none of that skips the re-trace (3 s of an 8B model's capture)
            if _needs_decomposition(ep.graph_module):
                ep = ep.run_decompositions(dict(DECOMPOSITIONS))
        drop_assertions(ep.graph_module)
        exact_mean_losses(ep.graph_module)
        causal_masks_as_flags(ep.graph_module)
    except Exception as e:  # noqa: BLE001 - every capture failure becomes one actionable error
        raise _capture_error(model, e) from e
    finally:
        if had_forward:
            model.forward = own_forward
        else:
            del model.forward
        model.train(was_training)
    _refuse_data_dependent_sizes(model, ep.graph_module)
    return _from_exported(model, ep)


def _distinct_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """One tensor passed twice (`model(input_ids=x, labels=x)`) as two tensors of the same value:
    torch.export keys its inputs by tensor identity and would route every use to the last name,
    leaving the first a placeholder with no use. Each name keeps its own placeholder, pinnable and
    fed from its own position at run time."""
    seen: set[int] = set()

    def distinct(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in seen:
            seen.add(id(x))
            return x
        return x.detach().clone().requires_grad_(x.requires_grad)

    return pytree.tree_map(distinct, (tuple(args), dict(kwargs)))


def _refuse_data_dependent_sizes(model: torch.nn.Module, gm: fx.GraphModule) -> None:
    """A tensor whose size depends on values (boolean-mask indexing `x[x > 0]`, `nonzero`, `unique`)
    traces with a size known only at run time; no layout can be planned for it."""
    for n in gm.graph.nodes:
        for t in pytree.tree_leaves(n.meta.get("val")):
            if isinstance(t, torch.Tensor) and any(sym_hint(s) is None for s in t.shape):
                trace = [ln.strip() for ln in (n.meta.get("stack_trace") or "").splitlines() if ln.strip()]
                line = f"\n  failing line of your model: {trace[-2]}: `{trace[-1]}`" if len(trace) >= 2 else ""
                raise CaptureError(
                    f"could not capture {type(model).__name__} as a graph: node {n.name} ({n.target}) has a "
                    f"size that depends on the data (shape {list(t.shape)}){line}\n  what to do: keep sizes "
                    f"fixed: instead of boolean-mask indexing `x[mask]`, nonzero or unique use "
                    f"`torch.where(mask, x, 0)` or a fixed-size `topk`; your model was not modified")


class _StderrFilter:
    """sys.stderr, minus the partial graph torch.export prints on a data-dependent failure (our
    CaptureError names the user's line instead of dumping hundreds of lines of ATen code)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        if "def forward(self" in text and "torch.ops." in text:
            return len(text)
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def _no_partial_graph_dump():
    stream = sys.stderr
    sys.stderr = _StderrFilter(stream)
    try:
        yield
    finally:
        sys.stderr = stream


def _is_cache(x) -> bool:
    """A transformers KV cache (by transformers' own rule: a `Cache` subclass or a `*Cache` class)."""
    return not isinstance(x, torch.Tensor) and any(
        c.__module__.startswith("transformers") and c.__name__.endswith("Cache")
        for c in type(x).__mro__)


def _without_caches(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        return pytree.tree_map(lambda x: None if _is_cache(x) else x, forward(*args, **kwargs))
    return run


def _needs_decomposition(gm: fx.GraphModule) -> bool:
    """In-place ops, higher-order regions, batch norms or dropouts (lowered to `native_dropout`,
    whose mask the cost model counts) present: `run_decompositions` must run."""
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        t = n.target
        if not isinstance(t, OpOverload):
            if isinstance(t, HigherOrderOperator):
                return True
            continue
        if is_mutable(t) or "batch_norm" in t.name() or "dropout" in t.name():
            return True
    return False


def _inline_no_grad_regions(gm: fx.GraphModule) -> None:
    """Inline each `torch.no_grad()` region (Hugging Face's rotary tables) into the graph, a detach
    on each result: its results carry no gradient. Decomposition would inline it too, but re-traces
    the whole graph to do so (5 s of an 8B model's capture). A region that reads attributes of its
    own is left to decomposition."""
    hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not hop or n.args[0] is not False:
            continue
        sub = getattr(gm, n.args[1].target)
        inner = list(sub.graph.nodes)
        if any(s.op == "get_attr" for s in inner):
            continue
        env = dict(zip([s for s in inner if s.op == "placeholder"], n.args[2:]))
        with g.inserting_before(n):
            for s in inner:
                if s.op == "output":
                    outs = s.args[0] if isinstance(s.args[0], (tuple, list)) else (s.args[0],)
                elif s.op != "placeholder":
                    env[s] = g.node_copy(s, lambda a: env[a])
            results = []
            for o in outs:
                d = g.call_function(torch.ops.aten.detach.default, (env[o],))
                d.meta = dict(env[o].meta)
                results.append(d)
        for u in list(n.users):
            if u.target is not operator.getitem:
                raise CaptureError(f"a no_grad region's result {n.name} is used whole by {u.name}")
            u.replace_all_uses_with(results[u.args[1]])
            g.erase_node(u)
        attr = n.args[1]
        g.erase_node(n)
        if not attr.users:
            g.erase_node(attr)
            delattr(gm, attr.target)
    gm.recompile()


def _functional_detach(ep) -> None:
    """`x.detach_()` on a constant or buffer (Hugging Face detaches lifted scalars), or on a tensor
    nothing else reads (`torch.tensor(...)`'s fresh copy: a transformers cache's sliding window), as
    `x.detach()`: they carry no gradient either way, and an in-place op would force decomposition
    (a second trace of the whole model: 8 of Mistral-7B's 15 CPU seconds of planning)."""
    still = {spec.arg.name for spec in ep.graph_signature.input_specs
             if spec.kind.name in ("CONSTANT_TENSOR", "BUFFER") and hasattr(spec.arg, "name")}
    g = ep.graph_module.graph
    for n in list(g.nodes):
        if (n.op == "call_function" and n.target is torch.ops.aten.detach_.default
                and isinstance(n.args[0], fx.Node) and (n.args[0].name in still or len(n.args[0].users) == 1)):
            with g.inserting_before(n):
                d = g.call_function(torch.ops.aten.detach.default, n.args)
            d.meta = dict(n.meta)
            n.replace_all_uses_with(d)
            g.erase_node(n)
    ep.graph_module.recompile()


def _from_exported(model: torch.nn.Module, ep) -> Captured:
    gm = ep.graph_module
    sig = ep.graph_signature
    param_names = _param_names(model)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs: dict[str, InputSlot] = {}
    user_i = 0
    canon_node: dict[str, fx.Node] = {}
    for node, spec in zip(placeholders, sig.input_specs):
        kind = spec.kind.name
        if kind == "PARAMETER":
            fqn = param_names.get(spec.target, spec.target)
            if fqn in canon_node:   # tied weight: route every use to the first placeholder
                node.replace_all_uses_with(canon_node[fqn])
            else:
                canon_node[fqn] = node
            inputs[node.name] = InputSlot("param", fqn)
        elif kind == "BUFFER":
            inputs[node.name] = InputSlot("buffer", spec.target)
        elif kind in ("CONSTANT_TENSOR", "CUSTOM_OBJ"):
            inputs[node.name] = InputSlot("constant", spec.target)
        else:
            inputs[node.name] = InputSlot("input", user_i)
            user_i += 1
    outputs = []
    for spec in sig.output_specs:
        kind = spec.kind.name
        if kind == "USER_OUTPUT":
            outputs.append(("user", None))
        elif kind == "BUFFER_MUTATION":
            outputs.append(("buffer", spec.target))
        else:
            outputs.append((kind.lower(), spec.target))
    gm.graph.eliminate_dead_code()
    gm.recompile()
    constants = {slot.target: ep.constants[slot.target] for slot in inputs.values()
                 if slot.kind == "constant" and slot.target in ep.constants}
    return Captured(gm=gm, inputs=inputs, outputs=outputs, in_spec=ep.call_spec.in_spec,
                    out_spec=ep.call_spec.out_spec, param_names=param_names, model_name=type(model).__name__,
                    constants=constants)


# -- errors -----------------------------------------------------------------------------------

def _model_files(model: torch.nn.Module) -> set[str]:
    """Source files of the model's own module classes (torch.nn's excluded)."""
    files = set()
    for m in model.modules():
        for cls in type(m).__mro__:
            if cls.__module__.startswith("torch."):
                continue
            try:
                files.add(os.path.abspath(inspect.getsourcefile(cls) or ""))
            except TypeError:
                pass
    return files - {""}


def _is_library(filename: str) -> bool:
    return (filename.startswith(_TORCH_DIR) or filename.startswith(_AUTOPAR_DIR) or filename.startswith("<")
            or f"{os.sep}transformers{os.sep}utils{os.sep}" in filename)


def _advice(e: Exception, first: str) -> str:
    kind = type(e).__name__
    if "DataDependent" in kind or "data-dependent" in first or "item()" in first:
        return ("that line uses the *value* of a tensor (a Python `if` on it, `.item()`, `.tolist()`, a size "
                "that depends on data): write it with tensor ops instead (`torch.where`, masks, fixed-size "
                "`topk`), state what holds with `torch._check(...)`, or compute it outside forward")
    if "not a known type" in first or "pytree" in first:
        return ("forward returns an object that is not a tensor container: return tensors (tuples, lists, dicts, "
                "dataclasses), or register its type with torch.utils._pytree.register_pytree_node")
    if "numpy" in first.lower():
        return "that line converts a tensor to NumPy or Python data: keep it a tensor during forward"
    return ("make that code traceable by torch.export (no data-dependent Python control flow, no "
            "`.item()`/`.tolist()`, no NumPy on tensors), or move it out of forward")


def _capture_error(model: torch.nn.Module, e: Exception) -> CaptureError:
    """Name the line of the user's model that broke tracing, the submodule running it, and what to do."""
    tb_frames = []
    tb = e.__traceback__
    while tb is not None:
        tb_frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    owned = _model_files(model)
    modules = {id(m): name for name, m in model.named_modules()}
    mine = [(f, ln) for f, ln in tb_frames if os.path.abspath(f.f_code.co_filename) in owned]
    if not mine:   # the model's own classes are torch.nn's (e.g. a Sequential): the closest non-library frame
        mine = [(f, ln) for f, ln in tb_frames if not _is_library(f.f_code.co_filename)]
    where = ""
    if mine:
        frame, lineno = mine[-1]
        fn = frame.f_code.co_filename
        code = linecache.getline(fn, lineno).strip()
        where = f"\n  failing line of your model: {fn}:{lineno} in {frame.f_code.co_name}: `{code}`"
        for f, _ in reversed(mine):
            owner = f.f_locals.get("self")
            if isinstance(owner, torch.nn.Module) and id(owner) in modules:
                path = modules[id(owner)] or "(the model itself)"
                where += f"\n  in submodule: {path} ({type(owner).__name__})"
                break
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return CaptureError(
        f"could not capture {type(model).__name__} as a graph: {type(e).__name__}: {first}{where}\n"
        f"  what to do: {_advice(e, first)}; your model was not modified")
