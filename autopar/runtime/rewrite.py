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
from ..passes.captured import Captured
from ..passes.parameter_side import parameter_side
from ..passes.reshard_edges import output_modules, reshards_edge
from ..passes.shape_prop import tensor_meta
from ..placement import over_one_device, parse_layout
from ..plan import Plan
from ..plan_records import ACTIVATIONS
from ..strategies.gradients import input_grad_layouts, output_grad_layout
from .async_output import AsyncOutput
from .attention import context_executor
from .early_reshard import LocalCollective
from .local_reshard import LocalReshard, local_reshard_steps
from .ops import LocalOp, ReplicateOp, ToLocal, mesh_device
from .reshard import LocalSplit, Reshard, carries_grad, collective_move, split_axes

_EXECUTORS = {"local": LocalOp, "replicate": ReplicateOp, "context": context_executor}


def passes_local(node: fx.Node, planned: dict, mesh_shape: tuple[int, ...], side: dict[str, tuple] | None = None,
                 whole_outputs: bool = True, local_reshards: bool = False) -> bool:
    """Can `node`'s LocalOp hand its consumers its local result as a plain tensor? Only where wrapping
    it in a DTensor and unwrapping it again would do nothing, forward or backward: a tensor output
    (or a split's parts, each through its getitem) with no partial average over more than one
    device (its gradient is scaled on the way back), every consumer a LocalOp taking it in that very
    layout (no Reshard on the edge) and sending its gradient back in it too (unless no gradient can
    flow: an integer or boolean result), "that very layout" up to axes of one device
    (`reshards_edge`), or the program's output where that is whole already (`output_modules`;
    `whole_outputs`: outputs are made whole) or made whole by an `AsyncOutput` (which all-reduces
    the plain local tensor); a consumer's edge may also be a `LocalSplit` or `LocalCollective` (a
    tensor no gradient flows through: this rank's block, or one collective of the plain tensor), or,
    where `local_reshards`, a `LocalReshard` (`local_reshard_edge`: a move and its gradient's on the
    plain tensor).
    Saves the two autograd nodes and the DTensor wrapper per op on the hot path (data parallel:
    almost every op). `side`: the parameter-side nodes' axes (`parameter_side_ops`)."""
    side = side or {}
    np = planned.get(node.name)
    val = node.meta.get("val")
    if np is None or np.executor != "local" or any(p.startswith("P(") and n > 1 for p, n in zip(np.output, mesh_shape)):
        return False
    if isinstance(val, (tuple, list)):      # split, chunk, unbind: each part taken by its getitems' consumers
        return bool(node.users) and all(
            user.target is operator.getitem and isinstance(val[user.args[1]], torch.Tensor)
            and _taken_local(user, val[user.args[1]], np, planned, mesh_shape, side, whole_outputs, local_reshards)
            for user in node.users)
    return isinstance(val, torch.Tensor) and _taken_local(node, val, np, planned, mesh_shape, side, whole_outputs,
                                                          local_reshards)


def _taken_local(node: fx.Node, val: torch.Tensor, np, planned: dict, mesh_shape, side: dict,
                 whole_outputs: bool, local_reshards: bool) -> bool:
    """Does every consumer of `node` (a tensor in the layout of `np`, the plan of the op making it)
    take it as the local tensor it is (`passes_local`)?"""
    grad_flows = carries_grad(val.dtype)
    arrives = output_grad_layout(parse_layout(np.output), side.get(np.name, ()))
    for user in node.users:
        if user.op == "output" and whole_outputs and (not output_modules(False, np.output, mesh_shape)
                                                      or _async_output(np.output, mesh_shape) is not None):
            continue          # whole already, or all-reduced as it is (`AsyncOutput`)
        up = planned.get(user.name)
        if up is None or up.executor != "local" or user.target is operator.getitem:
            return False
        slots = [k for k, a in enumerate(a for a in pytree.tree_leaves((user.args, user.kwargs))
                                         if isinstance(a, fx.Node) and tensor_meta(a.meta.get("val"))) if a is node]
        grads = input_grad_layouts([parse_layout(i) for i in up.inputs], parse_layout(up.output), side.get(user.name, ()))
        if not slots or not all(_slot_local(np, up, k, val, grads[k], arrives, mesh_shape, side, local_reshards)
                                for k in slots):
            return False
    return True


def _slot_local(np, up, k: int, val: torch.Tensor, grad: tuple, arrives: tuple, mesh_shape, side: dict,
                local_reshards: bool) -> bool:
    """Does input `k` of `up` take the output of `np` (a tensor `val`; its gradient sent back in `grad`
    and taken in `arrives`) as the plain local tensor (`passes_local`)?"""
    if over_one_device(mesh_shape, parse_layout(up.inputs[k]), parse_layout(np.output)):
        return not carries_grad(val.dtype) or over_one_device(mesh_shape, grad, arrives)
    if (local_split_edge(np.output, up.inputs[k], val, mesh_shape) is not None
            or local_collective_edge(np.output, up.inputs[k], val, mesh_shape) is not None):
        return True                 # no gradient flows through these
    return local_reshards and local_reshard_edge(np, up, k, val, mesh_shape, side) is not None


def local_split_edge(src: tuple[str, ...], want: tuple[str, ...], val, mesh_shape) -> tuple | None:
    """The (mesh axis, dim) splits of an edge into a `LocalOp` that runs as a `LocalSplit` (this rank's
    block of a plain local tensor): a tensor no gradient flows through (`carries_grad`), split evenly over
    whole axes (`reshard.split_axes`); None for any other edge."""
    if not isinstance(val, torch.Tensor) or carries_grad(val.dtype):
        return None
    return split_axes(parse_layout(src), parse_layout(want), tuple(val.shape), mesh_shape)


def local_collective_edge(src: tuple[str, ...], want: tuple[str, ...], val, mesh_shape) -> tuple | None:
    """(mesh axis, gathered) of an edge into a `LocalOp` that runs as a `LocalCollective` (the one c10d
    collective of a plain local tensor): a tensor no gradient flows through (`carries_grad`) whose move
    is one all-gather or all-reduce (`reshard.collective_move`); None for any other edge."""
    if not isinstance(val, torch.Tensor) or carries_grad(val.dtype):
        return None
    return collective_move(parse_layout(src), parse_layout(want), tuple(val.shape), mesh_shape)


def local_reshard_edge(src, up, k: int, val, mesh_shape, side: dict) -> tuple | None:
    """(forward steps, backward steps) of the edge from the output of `src` into input `k` of `up` (both
    planned ops) where it runs as a `LocalReshard` (runtime/local_reshard.py): both run as `LocalOp`s,
    a gradient can flow through the tensor `val`, and its move and the gradient's are each steps the
    runtime issues on the local tensor (`local_reshard_steps`); None for any other edge."""
    if (not isinstance(val, torch.Tensor) or not carries_grad(val.dtype) or src.executor != "local"
            or up.executor != "local" or any(p.startswith("P(") for p in src.output)):
        return None
    out = parse_layout(src.output)
    grads = input_grad_layouts([parse_layout(i) for i in up.inputs], parse_layout(up.output), side.get(up.name, ()))
    return local_reshard_steps(tuple(val.shape), out, parse_layout(up.inputs[k]), grads[k],
                               output_grad_layout(out, side.get(src.name, ())), mesh_shape)


def parameter_side_ops(cap: Captured, plan: Plan, planned: dict) -> dict[str, tuple[bool, ...]]:
    """The parameter-side nodes (passes/parameter_side.py) that run as `LocalOp`s, each with the mesh
    axes on which their gradients stay partial sums where replicated, as the planner priced them
    (solver/problem.py): all but a pipeline's axis (the planner prices a stage without it)."""
    names = plan.mesh["axis_names"]
    pp = plan.pipeline.axis if plan.pipeline.stages > 1 else None
    axes = tuple(name != pp for name in names)
    return {n: axes for n in parameter_side(cap.gm, cap.inputs) if n in planned and planned[n].executor == "local"}


class _Program:
    """The per-rank program while `rewrite` builds it: its graph, its modules, and the captured
    node -> its node map."""

    def __init__(self, plan: Plan, planned: dict, side: dict, device_mesh, pass_local: bool):
        self.root, self.g = torch.nn.Module(), fx.Graph()
        self.pass_local = pass_local     # ops may hand on plain local tensors (and integer splits run local)
        # reshard edges between such ops may run on the plain tensor (`LocalReshard`), unless the plan
        # re-gathers activations (runtime/memory.py swaps a gathering Reshard for its GatherCopy)
        self.local_reshards = pass_local and not any(
            k.startswith(ACTIVATIONS) and v == "regather" for k, v in plan.residency.items())
        self.env: dict[fx.Node, fx.Node] = {}
        self.planned, self.side, self.mesh = planned, side, device_mesh
        self.sharded = plan.options.get("sharded_outputs", False)
        self.device = mesh_device(device_mesh)      # where the program runs: not the capture's device (cpu, meta)

    def add_module(self, name: str, mod: torch.nn.Module, *args, **kwargs) -> fx.Node:
        self.root.add_module(name, mod)
        return self.g.call_module(name, args, kwargs)


def _is_tensor(a) -> bool:
    return isinstance(a, fx.Node) and bool(tensor_meta(a.meta.get("val")))


def rewrite(cap: Captured, plan: Plan, device_mesh, pass_local: bool = True) -> fx.GraphModule:
    """The per-rank program of `plan` over `cap`. pass_local=False: every op hands on DTensors (a
    pipeline cuts the program into chunks whose outputs must carry their layout)."""
    planned = {n.name: n for n in plan.nodes}
    prog = _Program(plan, planned, parameter_side_ops(cap, plan, planned), device_mesh, pass_local)
    env, g = prog.env, prog.g
    for node in cap.gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = g.placeholder(node.name)
            env[node].meta["val"] = node.meta.get("val")       # global shape and dtype (runtime/layer_gather.py)
            continue
        if node.op == "output":
            g.output(_outputs(prog, node))
            continue
        np = planned.get(node.name)
        args, kwargs = _inputs(prog, node, np)
        if np is None or node.target is operator.getitem or np.executor not in _EXECUTORS:
            env[node] = g.call_function(node.target, args, kwargs)
        else:
            mod = _executor(prog, node, np, plan, pass_local)
            env[node] = prog.add_module(f"op_{node.name}", mod, *args, **kwargs)
        env[node].meta = dict(node.meta, autopar_node=node.name)   # the captured node it runs (stages.py)
    return fx.GraphModule(prog.root, g, class_name="AutoparRankGraph")


def _outputs(prog: _Program, node: fx.Node):
    """The program's outputs: each tensor made whole and local (unless outputs stay sharded or its op
    hands it on whole already), an all-reduce left pending for the caller where one suffices."""
    whole = tuple("R" for _ in prog.mesh.shape)
    leaves, spec = pytree.tree_flatten(node.args[0])
    outs = []
    for k, a in enumerate(leaves):
        v = prog.env[a] if isinstance(a, fx.Node) else a
        src = prog.planned.get(a.name) if isinstance(a, fx.Node) else None
        handed_whole = (src is not None and v.op == "call_module"      # its op's local result is whole
                        and getattr(prog.root.get_submodule(v.target), "local_out", False)
                        and not output_modules(False, src.output, prog.mesh.shape))
        if _is_tensor(a) and not prog.sharded and not handed_whole:
            axis = None if src is None else _async_output(src.output, prog.mesh.shape)
            v = prog.add_module(f"reshard_output_{k}", Reshard(parse_layout(whole)) if axis is None
                                else AsyncOutput(axis, parse_layout(src.output), prog.mesh), v)
            v = prog.add_module(f"to_local_output_{k}", ToLocal(), v)
        outs.append(v)
    return pytree.tree_unflatten(outs, spec)


def _async_output(src: tuple[str, ...], mesh_shape) -> int | None:
    """The axis an output in layout `src` is made whole over by an `AsyncOutput`, else None."""
    return async_output_axis(parse_layout(src), parse_layout(tuple("R" for _ in mesh_shape)))


def _inputs(prog: _Program, node: fx.Node, np) -> tuple:
    """(args, kwargs) of `node` in the program: each tensor input through a `Reshard` to the layout
    `np` (its plan) takes it in, where the edge needs one (`reshards_edge`)."""
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    new_leaves, slot = [], 0
    for a in leaves:
        if not isinstance(a, fx.Node):
            new_leaves.append(prog.device if isinstance(a, torch.device) else a)   # arange(..., device=x.device)
            continue
        v = prog.env[a]
        if _is_tensor(a) and np is not None and node.target is not operator.getitem:
            want = np.inputs[slot]
            src = prog.planned.get(a.name)
            if reshards_edge(src.executor if src else None, src.output if src else None, want, prog.mesh.shape):
                side = prog.side
                grad_to = output_grad_layout(parse_layout(src.output), side[a.name]) if a.name in side else None
                edge = _edge_module(prog, src, want, grad_to, a, np, slot)
                v = prog.add_module(f"reshard_{node.name}_{slot}", edge, v)
            slot += 1
        new_leaves.append(v)
    return pytree.tree_unflatten(new_leaves, spec)


def _edge_module(prog: _Program, src, want: tuple[str, ...], grad_to, a: fx.Node, np, slot: int) -> torch.nn.Module:
    """The module on an edge that needs a move from `src`'s output to `want` (input `slot` of `np`): a
    `LocalSplit` or `LocalCollective` where the tensor can carry no gradient and the consumer is a
    `LocalOp`, a `LocalReshard` where it can and its producer hands it on local, else a `Reshard`."""
    if prog.pass_local and src is not None and np.executor == "local":
        mesh_shape, val = tuple(prog.mesh.shape), a.meta.get("val")
        split = local_split_edge(src.output, want, val, mesh_shape)
        if split is not None:
            return LocalSplit(parse_layout(want), parse_layout(src.output), split, prog.mesh)
        move = local_collective_edge(src.output, want, val, mesh_shape)
        if move is not None:
            return LocalCollective(parse_layout(want), parse_layout(src.output), move, prog.mesh)
        steps = local_reshard_edge(src, np, slot, val, mesh_shape, prog.side) if prog.local_reshards else None
        if steps is not None and _hands_local(prog, prog.env[a]):
            out = parse_layout(src.output)
            grads = input_grad_layouts([parse_layout(i) for i in np.inputs], parse_layout(np.output),
                                       prog.side.get(np.name, ()))
            return LocalReshard(parse_layout(want), out, grads[slot], output_grad_layout(out, prog.side.get(src.name, ())),
                                steps, prog.mesh)
    return Reshard(parse_layout(want), grad_to)


def _hands_local(prog: _Program, v: fx.Node) -> bool:
    """Does program node `v` (an op's result, or a part of it through a getitem) run as a plain tensor?"""
    if v.op == "call_function" and v.target is operator.getitem and isinstance(v.args[0], fx.Node):
        v = v.args[0]
    return v.op == "call_module" and getattr(prog.root.get_submodule(v.target), "local_out", False)


def _executor(prog: _Program, node: fx.Node, np, plan: Plan, pass_local: bool) -> torch.nn.Module:
    """The module running `node` as its plan `np` says (`_EXECUTORS`)."""
    metas = tensor_meta(node.meta.get("val"))
    extra = ({"labels": tuple(np.labels)} if np.executor == "context" else
             {"side_axes": prog.side.get(node.name, ())} if np.executor == "local" else {})
    mod = _EXECUTORS[np.executor](node.target, [parse_layout(i) for i in np.inputs], parse_layout(np.output),
                                  prog.mesh, metas[0].shape if metas else None, **extra)
    mod.local_out = pass_local and passes_local(node, prog.planned, tuple(prog.mesh.shape), prog.side,
                                                not prog.sharded, prog.local_reshards)
    mod.capacity_factor = plan.options.get("moe_capacity_factor")
    return mod
