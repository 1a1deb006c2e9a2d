"""Lowering at capture: ops whose shape in torch's graph hides how they may be sharded.

* BatchNorm in training mode (`_native_batch_norm_legit_functional`, one op with five outputs
  of two ranks) becomes its statistics and its normalization, written with ordinary ops plus
  `autopar::batch_stat_mean` (a mean over the batch and spatial dims, marked so the report can
  name it). Sharding then follows from the ordinary rules: a batch-split input gives each
  device the mean of its samples, a partial average, which the planner all-reduces before
  use; that is SyncBatchNorm, and it is the solver's choice against gathering the input
  whole or splitting channels (`views/report.py` says which it took per layer). Two passes (mean,
  then the mean of squared deviations) keep the variance as accurate as one device's.
  Eval-mode BatchNorm becomes the per-channel affine map it is.
* A Hugging Face MoE experts module (`@use_experts_implementation`: Mixtral, Qwen-MoE, ...)
  is captured as one op, `autopar::moe_experts`, instead of its data-dependent dispatch (sort
  by expert, gather, grouped matmul, scatter back), which no per-op rule can split exactly.
  Its rule splits tokens, or experts (each device runs its experts on every token routed to
  them and the results are partial sums), or both (strategies/moe.py). It runs as `moe_grouped`:
  the token-slots sorted by expert through two `torch.nn.functional.grouped_mm` calls, their
  backward autograd's (dX and dW grouped GEMMs; nothing recomputed).
* Assertions that output nothing (`_assert_tensor_metadata`, ...) are dropped, and so are dropouts
  that drop nothing (probability 0 or not training: eager attention's `attention_dropout=0.0`),
  which would otherwise force a decomposition pass and run as a copy.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils.flop_counter import flop_registry, register_flop_formula

from ..compat import GROUPED_MM, hf_default_gate

aten = torch.ops.aten
_log = logging.getLogger("autopar")


# -- autopar::batch_stat_mean -------------------------------------------------------------------

@torch.library.custom_op("autopar::batch_stat_mean", mutates_args=())
def batch_stat_mean(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """Mean over `dims`, kept as size-1 dims: the statistics of a BatchNorm."""
    return x.mean(dims, keepdim=True)


@batch_stat_mean.register_fake
def _batch_stat_mean_fake(x, dims):
    return x.mean(dims, keepdim=True)


def _batch_stat_mean_setup(ctx, inputs, output):
    x, dims = inputs
    ctx.shape = x.shape
    ctx.count = math.prod(x.shape[d] for d in dims)


def _batch_stat_mean_backward(ctx, grad):
    return grad.expand(ctx.shape) / ctx.count, None


batch_stat_mean.register_autograd(_batch_stat_mean_backward, setup_context=_batch_stat_mean_setup)


def _channel(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.view([1, -1] + [1] * (ndim - 2))


def _bn_train(x, weight, bias, running_mean, running_var, momentum, eps):
    dims = [0] + list(range(2, x.ndim))
    n = x.numel() // x.shape[1]
    mean = torch.ops.autopar.batch_stat_mean(x, dims)
    centered = x - mean
    var = torch.ops.autopar.batch_stat_mean(centered * centered, dims)
    rstd = torch.rsqrt(var + eps)
    y = centered * rstd
    if weight is not None:
        y = y * _channel(weight, x.ndim)
    if bias is not None:
        y = y + _channel(bias, x.ndim)
    stats = (mean.detach().view(-1), var.detach().view(-1))
    if running_mean is None:
        return y, mean.view(-1), rstd.view(-1), stats
    new_mean = running_mean * (1 - momentum) + stats[0] * momentum
    new_var = running_var * (1 - momentum) + stats[1] * (n / max(n - 1, 1)) * momentum
    return y, mean.view(-1), rstd.view(-1), (new_mean, new_var)


def _bn_functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if not training:
        return _bn_eval(x, weight, bias, running_mean, running_var, momentum, eps) + (running_mean, running_var)
    y, mean, rstd, (new_mean, new_var) = _bn_train(x, weight, bias, running_mean, running_var, momentum, eps)
    return y, mean, rstd, new_mean, new_var


def _bn_no_stats(x, weight, bias, training, momentum, eps):
    y, mean, rstd, _ = _bn_train(x, weight, bias, None, None, momentum, eps)
    return y, mean, rstd


def _bn_eval(x, weight, bias, running_mean, running_var, momentum, eps):
    y = (x - _channel(running_mean, x.ndim)) * _channel(torch.rsqrt(running_var + eps), x.ndim)
    if weight is not None:
        y = y * _channel(weight, x.ndim)
    if bias is not None:
        y = y + _channel(bias, x.ndim)
    empty = x.new_zeros((0,))
    return y, empty, empty


def _copy(dst, src, non_blocking=False):
    """The functional form of `dst.copy_(src)` (a slice filled in place, as DeepSeek-V3's attention fills
    its keys) has no derivative in torch: written as the values it takes, `src` in dst's dtype and shape."""
    return src.to(dst.dtype).expand(dst.shape).clone()


DECOMPOSITIONS = {
    aten.copy.default: _copy,
    aten._native_batch_norm_legit_functional.default: _bn_functional,
    aten._native_batch_norm_legit.no_stats: _bn_no_stats,
    aten._native_batch_norm_legit_no_training.default: _bn_eval,
}


# -- autopar::moe_experts -----------------------------------------------------------------------

_ACTS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
         "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
         "gelu_new": functools.partial(F.gelu, approximate="tanh")}
# the dtypes torch.nn.functional.grouped_mm takes (torch 2.11-2.13, CPU and CUDA; on CUDA bfloat16 runs
# its grouped kernel on SM90+, the others torch's own per-group loop), and the alignment its kernels
# need of every row stride (bytes)
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GROUPED_MM_ALIGN = 16


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [S, in], its rows sorted by group (group g: rows offs[g-1]:offs[g]); weight [G, out, in]:
    each group's rows times its weight transposed, one grouped GEMM (autograd: two in the backward,
    dX and dW, nothing run again). What grouped_mm cannot take (float64; a width whose rows are not
    16-byte aligned) runs a product per group after reading the offsets once, as torch's own CUDA
    fallback does."""
    if x.dtype in GROUPED_MM_DTYPES and all(d * x.element_size() % GROUPED_MM_ALIGN == 0 for d in weight.shape[1:]):
        return F.grouped_mm(x, weight.transpose(1, 2), offs=offs)
    _log_per_group(x.dtype, tuple(weight.shape))
    ends = offs.tolist()
    return torch.cat([F.linear(x[a:b], weight[g]) for g, (a, b) in enumerate(zip([0] + ends, ends))])


@functools.cache
def _log_per_group(dtype, shape) -> None:
    _log.warning("experts of %s weight %s: not a grouped_mm shape or dtype (float32, bfloat16 or float16 with rows "
                 "of a multiple of %d bytes); run one product per expert after one host sync", dtype, shape,
                 GROUPED_MM_ALIGN)


def expert_mlp(x: torch.Tensor, offs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str):
    """Rows x [S, H] sorted by local expert (offs: int32 end of each expert's rows) through their
    experts' gated MLP: gate_up [E, 2I, H] (gate rows first), down [E, H, I]."""
    gate, up = _grouped_linear(x, gate_up, offs).chunk(2, dim=-1)
    return _grouped_linear(_ACTS[act](gate) * up, down, offs)


def _offsets(local: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.bincount(local, minlength=experts + 1)[:experts].cumsum(0).to(torch.int32)


def experts_in_order(rows: torch.Tensor, local: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                     act: str) -> torch.Tensor:
    """rows [S, H], each for local expert local[s] (all on this device): their outputs in the same
    order (sorted by expert on the device, no host sync)."""
    order = torch.argsort(local, stable=True)
    y = expert_mlp(rows.index_select(0, order), _offsets(local, gate_up.shape[0]), gate_up, down, act)
    return y.index_select(0, inverse_permutation(order))


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """p with p[order[i]] = i. Rows put back in order by gathering with it keep only it for their
    backward (index_copy would keep the rows too)."""
    return torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))


def moe_grouped(hidden, top_k_index, top_k_weights, gate_up, down, act: str, first_expert: int,
                every_slot_local: bool = False) -> torch.Tensor:
    """Experts [first_expert, first_expert + E_local) applied to the tokens routed to them.

    hidden [T, H]; top_k_index/top_k_weights [T, k]; gate_up [E_local, 2I, H] (gate rows first);
    down [E_local, H, I]. The token-slots are sorted by expert (stable), run through two grouped
    GEMMs, weighted and added into their tokens in expert order (as Hugging Face's loop adds them).
    Slots routed elsewhere contribute zero, so summing the results of devices holding disjoint
    experts gives the whole layer; so does a slot whose index is -1 (dropped over its expert's
    capacity, runtime/experts.py). Unless `every_slot_local` (every expert here, none dropped), the
    number of slots run here is read once (the layer's one host sync)."""
    k, experts = top_k_index.shape[1], gate_up.shape[0]
    local = top_k_index.reshape(-1) - first_expert
    if not every_slot_local:            # elsewhere or dropped: after the last expert's slots
        local = torch.where((local >= 0) & (local < experts), local, experts)
    order = torch.argsort(local, stable=True)
    offs = _offsets(local, experts)
    if not every_slot_local:
        order = order[:int(offs[-1])].clone()       # the backward keeps these slots' indices, not all
    token = torch.div(order, k, rounding_mode="floor")
    y = expert_mlp(hidden.index_select(0, token), offs, gate_up, down, act)
    y = y * top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    return add_into_tokens(hidden, token, y)


def add_into_tokens(hidden: torch.Tensor, token: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Zeros like hidden with each row of y (cast to hidden's dtype) added into row token[s], in order.
    index_put accumulates deterministically and keeps only the indices for its backward (index_add
    would keep y as well)."""
    return hidden.new_zeros(hidden.shape).index_put((token,), y.to(hidden.dtype), accumulate=True)


@torch.library.custom_op("autopar::moe_experts", mutates_args=())
def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: str, first_expert: int) -> torch.Tensor:
    """The experts as one graph op (what the planner splits). Only traced and run without gradients:
    a plan runs `moe_grouped` on its local shards (runtime/experts.py), whose autograd goes through
    grouped_mm, nothing run twice."""
    return moe_grouped(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act, first_expert)


@moe_experts.register_fake
def _moe_experts_fake(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act, first_expert):
    return torch.empty_like(hidden)


def _moe_flops(hidden_shape, index_shape, weights_shape, gate_up_shape, down_shape, *args, **kwargs) -> int:
    routed = index_shape[0] * index_shape[1]
    return 2 * routed * (gate_up_shape[1] * gate_up_shape[2] + down_shape[1] * down_shape[2])


register_flop_formula(torch.ops.autopar.moe_experts)(_moe_flops)


def _grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
    """2 x the products' multiply-adds: a [M, K] x b [G, K, N] (forward, dX), a [K, M] x b [M, N] (dW,
    groups along M), batched 3-D operands likewise."""
    if len(a_shape) == 2 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    if len(a_shape) == 3 and len(b_shape) == 2:
        return 2 * a_shape[1] * a_shape[2] * b_shape[1]
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]


if GROUPED_MM.default not in flop_registry:     # torch's counter has none (2.11-2.13)
    register_flop_formula(GROUPED_MM)(_grouped_mm_flops)


def _moe_act(module) -> str | None:
    config = getattr(module, "config", None)
    act = getattr(config, "hidden_act", None)
    return act if act in _ACTS else None


def _is_plain_hf_experts(module: torch.nn.Module) -> bool:
    """Experts in transformers' standard layout: gate_up_proj [E, 2I, H] (gate rows first),
    down_proj [E, H, I], no bias, no post-norm, a known activation."""
    return (type(module).__name__.endswith("Experts") and hf_default_gate(module)
            and getattr(module, "has_gate", False) and not getattr(module, "has_bias", True)
            and not getattr(module, "is_transposed", True) and getattr(module, "is_concatenated", False)
            and not getattr(module, "has_post_expert_norm", True)
            and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
            and isinstance(getattr(module, "down_proj", None), torch.Tensor)
            and module.gate_up_proj.ndim == 3 and module.down_proj.ndim == 3 and _moe_act(module) is not None)


@contextlib.contextmanager
def experts_as_one_op(model: torch.nn.Module, route=None, run=None):
    """While tracing, run each standard HF experts module as `autopar::moe_experts` (the model's
    own modules are restored afterwards; nothing else changes). `route(top_k_index, num_experts,
    module)`, if given, rewrites each layer's routing first (a capacity's drops: runtime/experts.py);
    `run`, if given, is called instead of the op (eager: `moe_grouped`, differentiable)."""
    run = run or torch.ops.autopar.moe_experts
    patched = []
    for m in model.modules():
        if _is_plain_hf_experts(m) and "forward" not in m.__dict__:
            act = _moe_act(m)

            def forward(hidden_states, top_k_index, top_k_weights, _m=m, _act=act):
                if route is not None:
                    top_k_index = route(top_k_index, _m.gate_up_proj.shape[0], _m)
                return run(hidden_states, top_k_index, top_k_weights, _m.gate_up_proj, _m.down_proj, _act, 0)
            m.forward = forward
            patched.append(m)
    try:
        yield patched
    finally:
        for m in patched:
            del m.forward


# -- mean losses ---------------------------------------------------------------------------------

_MEAN_LOSSES = (aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default,
                aten.nll_loss2d.default)
_LOSS_ARGS = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")


def exact_mean_losses(gm: fx.GraphModule) -> None:
    """A mean over counted targets (`ignore_index` excluded) as sum / count.

    Each device's mean over its slice of the batch is only a partial average of the whole when
    every slice counts as many targets; padded or masked labels (-100: a causal LM's last token,
    a masked LM's unmasked ones) break that. The sum and the count are exact partial sums under
    any split, reduced before the division."""
    g = gm.graph
    for node in list(g.nodes):
        if node.op != "call_function" or node.target not in _MEAN_LOSSES:
            continue
        a = dict(zip(_LOSS_ARGS, node.args))
        a.update(node.kwargs)
        if a.get("weight") is not None or a.get("reduction", 1) != 1:
            continue
        ignore = a.get("ignore_index", -100)
        target = a["target"]
        fake = node.meta["val"]
        with g.inserting_before(node):
            new_args = list(node.args) + [None] * max(0, 4 - len(node.args))
            new_args[2], new_args[3] = a.get("weight"), 2          # reduction="sum"
            total = g.call_function(node.target, tuple(new_args[:max(4, len(node.args))]),
                                    {k: v for k, v in node.kwargs.items() if k not in ("reduction", "weight")})
            valid = g.call_function(aten.ne.Scalar, (target, ignore))
            count = g.call_function(aten.sum.default, (valid,))
            mean = g.call_function(aten.div.Tensor, (total, count))
        with fake.fake_mode:
            tval = target.meta["val"]
            vals = (fake, torch.empty(tval.shape, dtype=torch.bool), torch.empty((), dtype=torch.int64), fake)
        for n, v in zip((total, valid, count, mean), vals):
            n.meta = {k: node.meta[k] for k in ("nn_module_stack", "stack_trace", "source_fn_stack")
                      if k in node.meta}
            n.meta["val"] = v
        node.replace_all_uses_with(mean)
        g.erase_node(node)
    gm.recompile()


# -- assertion ops ------------------------------------------------------------------------------

_ASSERTS = tuple(getattr(aten, n).default for n in ("_assert_tensor_metadata", "_assert_async", "_assert_scalar",
                                                     "sym_constrain_range_for_size", "sym_constrain_range")
                 if hasattr(aten, n) and hasattr(getattr(aten, n), "default"))


def drop_assertions(gm: fx.GraphModule) -> None:
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in _ASSERTS and not n.users:
            gm.graph.erase_node(n)


def drop_identity_dropouts(gm: fx.GraphModule) -> None:
    """`aten.dropout(x, p, train)` with p == 0 or train False is x: its uses read x."""
    for n in list(gm.graph.nodes):
        if (n.op == "call_function" and n.target is aten.dropout.default and len(n.args) == 3
                and (n.args[1] == 0 or not n.args[2])):
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
