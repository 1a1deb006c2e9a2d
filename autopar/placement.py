"""DTensor's placement vocabulary, with the short notation used in plans and reports.

`"R"` = Replicate(), `"S(1)"` = Shard(1), `"P"` = Partial("sum"), `"P(avg)"` = Partial("avg").
A tensor's layout over an N-D mesh is one placement per mesh axis, e.g. ("S(0)", "R").
"""
from __future__ import annotations

import re
from collections.abc import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__ = ["Placement", "Replicate", "Shard", "Partial", "to_str", "from_str", "layout_str", "parse_layout",
           "parse_pin", "local_shape", "gathers", "R", "P"]

R = Replicate()
P = Partial()
_SHARD_RE = re.compile(r"^S\((-?\d+)\)$")
# a strategy label ("ring", "ulysses", "column", ...): lower case, so never a placement
_LABEL_RE = re.compile(r"^[a-z][a-z0-9_]*$")


def to_str(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    if isinstance(p, Replicate):
        return "R"
    raise TypeError(f"unknown placement {p!r}")


def from_str(s: str | Placement) -> Placement:
    if isinstance(s, Placement):
        return s
    if not isinstance(s, str):
        raise ValueError(f"cannot parse placement {s!r}: use 'R', 'S(d)', 'P' or 'P(avg)'")
    s = s.strip()
    if s == "R":
        return R
    if s == "P":
        return P
    if s.startswith("P(") and s.endswith(")"):
        return Partial(s[2:-1])
    m = _SHARD_RE.match(s)
    if m:
        return Shard(int(m.group(1)))
    raise ValueError(f"cannot parse placement {s!r}: use 'R', 'S(d)', 'P' or 'P(avg)'")


def layout_str(layout: Sequence[Placement]) -> tuple[str, ...]:
    return tuple(to_str(p) for p in layout)


def parse_layout(layout: Sequence[str | Placement]) -> tuple[Placement, ...]:
    return tuple(from_str(p) for p in layout)


def parse_pin(entries: Sequence[str | Placement]) -> tuple[Placement | str, ...]:
    """A pin: per mesh axis a placement ("S(1)") or a strategy label ("ring"); ValueError otherwise."""
    out = []
    for e in entries:
        if isinstance(e, str) and _LABEL_RE.match(e.strip()):
            out.append(e.strip())
            continue
        try:
            out.append(from_str(e))
        except ValueError:
            raise ValueError(f"cannot parse placement {e!r}: give a placement ('R', 'S(d)', 'P', 'P(avg)') or a "
                             f"strategy label ('ring', 'ulysses', 'allgather_kv', 'expert_parallel', 'batch', "
                             f"'heads', ...) per mesh axis") from None
    return tuple(out)


def local_shape(shape: Sequence[int], layout: Sequence[Placement], axis_sizes: Sequence[int]) -> tuple[int, ...]:
    """Per-device shape under an even split (the planner only proposes even splits)."""
    out = list(shape)
    for p, n in zip(layout, axis_sizes):
        if isinstance(p, Shard):
            out[p.dim] //= n
    return tuple(out)


def block_index(layout: Sequence[Placement], dim: int, coord: Sequence[int], axis_sizes: Sequence[int]) -> int:
    """Which block of tensor dim `dim` the device at mesh coordinate `coord` holds under `layout`:
    mixed radix of its coordinates on the axes that split that dim, in mesh order (as DTensor
    chunks a dim over several axes)."""
    block = 0
    for p, c, n in zip(layout, coord, axis_sizes):
        if isinstance(p, Shard) and p.dim == dim:
            block = block * n + c
    return block


def gathers(src: Sequence[Placement], dst: Sequence[Placement]) -> bool:
    """Does moving from src to dst make a sharded axis whole (an all-gather over some axis)?"""
    return any(isinstance(s, Shard) and isinstance(d, Replicate) for s, d in zip(src, dst))


def over_one_device(mesh_shape: Sequence[int], cur: Sequence, layout: Sequence) -> bool:
    """Does the move change the layout over axes of one device alone (or not at all)? There every
    layout holds the same local tensor (a whole shard, a one-term sum): a relabelling, no collective."""
    return all(n == 1 for n, c, t in zip(mesh_shape, cur, layout) if c != t)
