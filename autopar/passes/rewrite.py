"""Rewrite: the captured graph + a Plan -> the per-rank graph that runs the plan.

Every reshard is an explicit `Reshard` node, every op runs on local shards (`LocalOp`), or
whole if no rule knows it (`ReplicateOp`), and (unless outputs stay sharded) outputs are gathered whole. For a row-parallel
linear the result reads

    reshard_linear_3_0 = self.reshard_linear_3_0(gelu)                    # -> (S(0), S(2))
    reshard_linear_3_1 = self.reshard_linear_3_1(p_fc2_weight)            # -> (R, S(1))
    linear_3 = self.op_linear_3(reshard_linear_3_0, reshard_linear_3_1, ...)  # -> (S(0), P)
    reshard_add_2_1 = self.reshard_add_2_1(linear_3)                      # all-reduce over tp
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..compat import pytree
from ..cost_model.comm import async_output_axis
from ..placement import parse_layout
from ..plan import Plan
from ..runtime.async_output import AsyncOutput
from ..runtime.attention import context_executor
from ..runtime.ops import LocalOp, ReplicateOp, ToLocal, mesh_device
from ..runtime.reshard import Reshard
from ..strategies.gradients import input_grad_layouts, output_grad_layout
from .capture import Captured
from .parameter_side import parameter_side
from .shape_prop import tensor_meta

_EXECUTORS = {"local": LocalOp, "replicate": ReplicateOp, "context": context_executor}


def reshards_edge(src_executor: str | None, src_layout, want) -> bool:
    """Does the rewrite put a Reshard between a producer and a consumer's input? Always after a
    parameter (its stored shard becomes a DTensor there) and after anything the plan does not know;
    otherwise where the layouts differ. (`autopar.estimate` counts runtime modules with this.)"""
    return src_executor in (None, "param") or src_layout != want


def passes_local(node: fx.Node, planned: dict, mesh_ndim: int, side: dict[str, tuple] | None = None) -> bool:
    """Can `node`'s LocalOp hand its consumers its local result as a plain tensor? Only where wrapping
    it in a DTensor and unwrapping it again would do nothing, forward or backward: a single tensor
    output with no Partial axis (so no gradient scaling, no reduction), every consumer a LocalOp
    taking it in that very layout (no Reshard on the edge) and sending its gradient back in it too.
    Saves the two autograd nodes and the DTensor wrapper per op on the hot path (data parallel:
    almost every op). `side`: the parameter-side nodes' axes (`parameter_side_ops`)."""
    side = side or {}
    np = planned.get(node.name)
    val = node.meta.get("val")
    if np is None or np.executor != "local" or not isinstance(val, torch.Tensor) or "P" in "".join(np.output):
        return False
    for user in node.users:
        up = planned.get(user.name)
        if up is None or up.executor != "local" or user.target is operator.getitem:
            return False
        slots = [k for k, a in enumerate(a for a in pytree.tree_leaves((user.args, user.kwargs))
                                         if isinstance(a, fx.Node) and tensor_meta(a.meta.get("val"))) if a is node]
        grads = input_grad_layouts([parse_layout(i) for i in up.inputs], parse_layout(up.output), side.get(user.name, ()))
        arrives = output_grad_layout(parse_layout(np.output), side.get(node.name, ()))
        if not slots or any(tuple(up.inputs[k]) != tuple(np.output) or grads[k] != arrives for k in slots):
            return False
    return True


def output_modules(sharded_outputs: bool) -> int:
    """Runtime modules the rewrite adds per tensor output: a Reshard to whole and a ToLocal, or none
    when outputs stay sharded."""
    return 0 if sharded_outputs else 2


def parameter_side_ops(cap: Captured, plan: Plan, planned: dict) -> dict[str, tuple[bool, ...]]:
    """The parameter-side nodes (passes/parameter_side.py) that run as `LocalOp`s, each with the mesh
    axes on which their gradients stay partial sums where replicated, as the planner priced them
    (solver/problem.py): all but a pipeline's axis (the planner prices a stage without it)."""
    names = plan.mesh["axis_names"]
    pp = plan.pipeline.axis if plan.pipeline.stages > 1 else None
    axes = tuple(name != pp for name in names)
    return {n: axes for n in parameter_side(cap.gm, cap.inputs) if n in planned and planned[n].executor == "local"}


def rewrite(cap: Captured, plan: Plan, device_mesh, pass_local: bool = True) -> fx.GraphModule:
    """The per-rank program of `plan` over `cap`. pass_local=False: every op hands on DTensors (a
    pipeline cuts the program into chunks whose outputs must carry their layout)."""
    planned = {n.name: n for n in plan.nodes}
    side = parameter_side_ops(cap, plan, planned)
    root = torch.nn.Module()
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    whole = tuple("R" for _ in device_mesh.shape)
    device = mesh_device(device_mesh)      # where the program runs: not the capture's device (cpu, meta)

    def add_module(name: str, mod: torch.nn.Module, *args, **kwargs) -> fx.Node:
        root.add_module(name, mod)
        return g.call_module(name, args, kwargs)

    def is_tensor(a) -> bool:
        return isinstance(a, fx.Node) and bool(tensor_meta(a.meta.get("val")))

    for node in cap.gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = g.placeholder(node.name)
            env[node].meta["val"] = node.meta.get("val")       # global shape and dtype (runtime/layer_gather.py)
            continue
        if node.op == "output":
            leaves, spec = pytree.tree_flatten(node.args[0])
            outs = []
            for k, a in enumerate(leaves):
                v = env[a] if isinstance(a, fx.Node) else a
                if is_tensor(a) and output_modules(plan.options.get("sharded_outputs", False)):
                    src = planned.get(a.name)
                    axis = None if src is None else async_output_axis(parse_layout(src.output), parse_layout(whole))
                    v = add_module(f"reshard_output_{k}", Reshard(parse_layout(whole)) if axis is None
                                   else AsyncOutput(axis), v)
                    v = add_module(f"to_local_output_{k}", ToLocal(), v)
                outs.append(v)
            g.output(pytree.tree_unflatten(outs, spec))
            continue
        np = planned.get(node.name)
        leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
        new_leaves, slot = [], 0
        for a in leaves:
            if not isinstance(a, fx.Node):
                new_leaves.append(device if isinstance(a, torch.device) else a)   # arange(..., device=x.device)
                continue
            v = env[a]
            if is_tensor(a) and np is not None and node.target is not operator.getitem:
                want = np.inputs[slot]
                src = planned.get(a.name)
                if reshards_edge(src.executor if src else None, src.output if src else None, want):
                    grad_to = output_grad_layout(parse_layout(src.output), side[a.name]) if a.name in side else None
                    v = add_module(f"reshard_{node.name}_{slot}", Reshard(parse_layout(want), grad_to), v)
                slot += 1
            new_leaves.append(v)
        args, kwargs = pytree.tree_unflatten(new_leaves, spec)
        if np is None or node.target is operator.getitem or np.executor not in _EXECUTORS:
            env[node] = g.call_function(node.target, args, kwargs)
        else:
            metas = tensor_meta(node.meta.get("val"))
            extra = ({"labels": tuple(np.labels)} if np.executor == "context" else
                     {"side_axes": side.get(node.name, ())} if np.executor == "local" else {})
            mod = _EXECUTORS[np.executor](node.target, [parse_layout(i) for i in np.inputs], parse_layout(np.output),
                                          device_mesh, metas[0].shape if metas else None, **extra)
            mod.local_out = pass_local and passes_local(node, planned, len(whole), side)
            mod.capacity_factor = plan.options.get("moe_capacity_factor")
            env[node] = add_module(f"op_{node.name}", mod, *args, **kwargs)
        env[node].meta = dict(node.meta, autopar_node=node.name)   # the captured node it runs (stages.py)
    return fx.GraphModule(root, g, class_name="AutoparRankGraph")
