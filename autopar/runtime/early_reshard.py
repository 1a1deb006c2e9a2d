"""Early reshards: a forward collective on the user's inputs alone runs at the start of the program.

A mean loss with ignored targets divides by the count of the targets it keeps, over the whole
batch: the plan gathers the targets' mask (or all-reduces a partial count) before the division at the
end of the forward, where every rank would wait for the slowest one's forward. That value depends on
the user's inputs alone, so its `Reshard`, with the ops it needs, moves to just after the
placeholders and issues its collective asynchronously (`EarlyReshard`); a `wait` node stands where
its result is first used. The ranks enter the step together (they left the last one at the gradient
buckets), so the collective is done long before the division needs it.

Only a reshard that is one c10d collective (`reshard.one_collective`) of a tensor that needs no
gradient is issued early; any other runs where it is, as planned. Where such a move's tensor can
carry no gradient at all (an integer or boolean: the targets' mask) and its consumer is a `LocalOp`,
the rewrite makes the edge a `LocalCollective` (`rewrite.local_collective_edge`): the collective on
the plain local tensor, its result handed on plain, so the ops before and after it run as plain
calls (no DTensor made, no autograd node: about a millisecond of CPU per step on a data-parallel
loss's tail); the collective and its timing are the same. Ops move only if they draw no
random numbers and mutate nothing, and only in the top-level program (not inside a region).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from ..compat import OpOverload, dtensor_from, is_mutable, tracing
from ..placement import layout_str
from . import rng
from .faults import watch_of
from .ops import LocalOp
from .direct_reshard import local_collective
from .reshard import Reshard, one_collective, to_layout


class EarlyReshard(Reshard):
    """Graph op: `y = self.reshard_x(x)` issued at the program's start, asynchronously; `y` is valid
    after `self.reshard_x.wait(y)` (module docstring)."""

    def __init__(self, layout):
        super().__init__(layout)
        self._work = None

    def forward(self, x):
        if not isinstance(x, DTensor):
            return x
        cur = tuple(x.placements)
        y = None
        if not x.requires_grad and cur != self.layout and watch_of(x.device_mesh) is None:
            y, self._work = one_collective(x, cur, self.layout, async_op=True) or (None, None)
        if y is not None:
            return y
        # no gradient flows back through it: the move alone (a local split: an input given whole), no autograd node
        return to_layout(x, self.layout) if not x.requires_grad else super().forward(x)

    def wait(self, y):
        if self._work is not None:
            self._work.wait()
            self._work = None
        return y

    def extra_repr(self) -> str:
        return super().extra_repr() + " (issued early, waited at first use)"


class LocalCollective(EarlyReshard):
    """Graph op: `y = self.reshard_x(x)` on an edge where a tensor no gradient flows through moves from
    `source` by one c10d collective (`reshard.collective_move`: `move` is its (axis, gathered)) to
    `layout`: the collective on the plain local tensor (`x` plain, or a DTensor in `source`), `y` the
    plain result. Issued early (`early`, set by `early_reshards`), `y` is valid after
    `self.reshard_x.wait(y)` (`EarlyReshard.wait`). Traced (the compile backend) it moves the DTensor
    as `Reshard` does, so that every rank traces the same graph."""

    def __init__(self, layout, source, move: tuple[int, bool], mesh):
        super().__init__(layout)
        self.source, self.move, self.mesh = tuple(source), tuple(move), mesh
        self.early = False

    def forward(self, x):
        if tracing() or watch_of(self.mesh) is not None:     # watched: the blocking, watched move
            if not isinstance(x, DTensor):
                x = dtensor_from(x, self.mesh, self.source)
            return to_layout(x, self.layout).to_local()
        local = x.to_local() if isinstance(x, DTensor) else x
        y, self._work = local_collective(local, self.mesh, *self.move, async_op=self.early)
        return y

    def extra_repr(self) -> str:
        src, dst = ", ".join(layout_str(self.source)), ", ".join(layout_str(self.layout))
        return f"{src} -> {dst} (local{', issued early, waited at first use' if self.early else ''})"


def early_reshards(gm: fx.GraphModule, inputs: frozenset[str]) -> int:
    """Every forward `Reshard` of `gm`'s top-level program whose value derives from the placeholders
    `inputs` (the user's inputs) alone, through pure ops: moved with those ops, in their order, to
    just after the placeholders, made an `EarlyReshard`, and waited before its first use. Returns how
    many."""
    from_inputs: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.name in inputs:
                from_inputs.add(node)
        elif node.op in ("call_function", "call_module") and _pure(gm, node) and all(
                a in from_inputs for a in node.all_input_nodes):
            from_inputs.add(node)
    early = [n for n in gm.graph.nodes if n in from_inputs and n.op == "call_module"
             and type(gm.get_submodule(n.target)) in (Reshard, LocalCollective) and n.users]
    if not early:
        return 0
    needed: set[fx.Node] = set()
    stack = list(early)
    while stack:
        n = stack.pop()
        if n.op != "placeholder" and n not in needed:
            needed.add(n)
            stack.extend(n.all_input_nodes)
    anchor = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    for node in [n for n in gm.graph.nodes if n in needed]:       # in program order
        anchor.append(node)
        anchor = node
    for node in early:
        old = gm.get_submodule(node.target)
        if type(old) is LocalCollective:
            old.early = True
        else:
            gm.add_submodule(node.target, EarlyReshard(old.layout))
        first = min(node.users, key=_position(gm.graph))
        with gm.graph.inserting_before(first):
            mod = gm.graph.get_attr(node.target)
            waited = gm.graph.call_method("wait", (mod, node))
        node.replace_all_uses_with(waited, delete_user_cb=lambda u: u is not waited)
    gm.recompile()
    return len(early)


def _position(graph: fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def _pure(gm: fx.GraphModule, node: fx.Node) -> bool:
    """An op that may run earlier than the program states: no random draw, no side effect."""
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if type(mod) in (Reshard, LocalCollective):
            return True
        if type(mod) is not LocalOp:
            return False
        target = mod.target
    else:
        target = node.target
    return (isinstance(target, OpOverload) and target not in rng.DROPOUT_OPS
            and torch.Tag.nondeterministic_seeded not in target.tags and not is_mutable(target))
