"""Bytes at each liveness point of the step under a layout choice, in one sweep over the timeline.

Neighbouring points share most of what they hold, so every sum here is carried from the point
before: only the tensors that appear or go, and the freed items whose window opens or closes,
change it (summing each point afresh was quadratic: Llama-3-8B has 2,249 points holding a
million tensors between them and 6,100 freed items). Bytes are whole numbers, so the carried sums
equal the fresh ones exactly. The values may be numbers or `autopar.symbolic.Poly2` (the plan
priced in B and S, `autopar.planner.scaling`).
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Mapping, Sequence

from ..cost_model.memory import buckets_in_flight_bytes
from ..symbolic import ssum
from .problem import Problem, picked_edges


def memory_points(p: Problem, choice: Mapping[str, int]):
    """(training state bytes, total bytes at each liveness point of the step) under a layout
    choice, before any family frees anything (`cost_model.memory`: forward and backward points).
    No gradient exists before the backward (the optimizer's zero_grad sets them to None): the
    forward's points count the state less them, a backward point the parameter gradients made so
    far, the activation gradients in flight and, from the first gradient a bucket can take on
    (`Problem.buckets_from`), the gradient buckets' buffers (`bucket_buffers`); the state in full is the memory
    after the backward."""
    live = p.live
    picked = sorted(((e.dst_pos, e.saved[a][b], e.temp[a][b] if e.temp else 0.0) for e, a, b in picked_edges(p, choice)),
                    key=lambda x: x[0])
    state = ssum(d.state_bytes[choice[d.leader]] for d in p.decisions.values())
    grads = sorted(((p.grad_since(n), d.grad_bytes[choice[d.leader]]) for n, d in p.decisions.items()
                    if d.grad_bytes), key=lambda x: x[0])
    fwd_state = state - ssum(b for _, b in grads)
    copies, copy_at = prefix_sums([b for _, b, _ in picked]), [pos for pos, _, _ in picked]
    made, made_at = prefix_sums([b for _, b in grads]), [since for since, _ in grads]
    temps: dict = {}
    for pos, _, t in picked:
        temps[pos] = temps.get(pos, 0.0) + t
    size = lambda n: act_bytes(p, n, choice)  # noqa: E731
    buckets, since = bucket_buffers(p, choice), p.buckets_from
    acts = member_sums(live.point_changes, size)
    flight = member_sums(live.grad_changes, size) if live.grads else [0.0] * len(live.points)
    back = [0.0] * len(live.points)
    for t, _, nbytes in backward_temps(p, choice):
        back[t] += nbytes
    points = []
    for t, (owned, moving, where) in enumerate(zip(acts, flight, live.positions)):
        total = fwd_state + (owned + moving) + copies[bisect_right(copy_at, live.mirror(where))] + temps.get(where, 0.0)
        points.append(total + made[bisect_right(made_at, where)] + back[t] + (buckets if where >= since else 0.0)
                      if where > live.last else total)
    return state, points


def backward_temps(p: Problem, choice: Mapping[str, int]) -> list[tuple]:
    """(point index, the node that holds it, bytes) of every backward temporary
    (`cost_model.memory`): an op's own (`Decision.bwd_temp`) at its backward's point, and a
    parameter's gradient as its consumer makes it (`EdgeTable.grad_temp`) at that consumer's
    backward (the next backward point where the consumer has none: a view passing it on)."""
    live = p.live
    out = []
    for t, (name, where) in enumerate(zip(live.point_names, live.positions)):
        d = p.decisions.get(name) if where > live.last else None
        if d is not None and d.bwd_temp and d.bwd_temp[choice[d.leader]]:
            out.append((t, name, d.bwd_temp[choice[d.leader]]))
    for e, a, b in picked_edges(p, choice):
        if e.grad_temp is not None and e.grad_temp[a][b]:
            t = backward_point_at(live, live.backward_of(e.dst_pos))
            if t is not None:
                out.append((t, e.dst, e.grad_temp[a][b]))
    return out


def backward_point_at(live, where: int) -> int | None:
    """The index of the first backward point at or after timeline position `where` (None: none); the
    points' positions increase along the step."""
    k = bisect_left(live.positions, max(where, live.last + 1))
    return k if k < len(live.positions) else None


def bucket_buffers(p: Problem, choice: Mapping[str, int]) -> float:
    """Bytes the gradient buckets hold at the backward's points beyond the gradients made
    (`cost_model.memory.buckets_in_flight_bytes` of the gradients the chosen layouts bucket)."""
    bucketed = sum(e.sync[a][b][1] for e, a, b in picked_edges(p, choice)
                   if e.sync is not None and e.sync[a][b] is not None)
    return buckets_in_flight_bytes(bucketed, p.mesh.profile.grad_bucket_bytes)


def member_sums(changes: Sequence[tuple[Sequence[str], Sequence[str]]], value: Callable[[str], object]) -> list:
    """Per point: the sum of `value` over its members (each member once), carried from the point
    before through its `changes` (`cost_model.memory.changes`: members that leave subtracted, those
    that join added, in the points' own order)."""
    return grouped_member_sums(changes, value, lambda n: 0, 1)[0]


def grouped_member_sums(changes: Sequence[tuple[Sequence[str], Sequence[str]]], value: Callable[[str], object],
                        group: Callable[[str], int], groups: int) -> list[list]:
    """`member_sums` per group of members (`group(name)` in range(groups)): one list per group."""
    out = [[] for _ in range(groups)]
    now: list = [0.0] * groups
    for left, joined in changes:
        for n in left:
            k = group(n)
            now[k] = now[k] - value(n)
        for n in joined:
            k = group(n)
            now[k] = now[k] + value(n)
        for k in range(groups):
            out[k].append(now[k])
    return out


def window_sums(positions: Sequence[int], items) -> list:
    """Per point (at increasing timeline `positions`): the sum of the values of `items`, each
    (after, until, value), whose window holds the point (after < position <= until)."""
    change: dict[int, list] = {}        # point -> the values starting (+) and ending (-) there, in order
    for after, until, v in items:
        lo, hi = bisect_right(positions, after), bisect_right(positions, until)
        if lo < hi:
            change.setdefault(lo, []).append(v)
            change.setdefault(hi, []).append(-v)
    out, now = [], 0.0
    for t in range(len(positions)):
        for v in change.get(t, ()):
            now = now + v
        out.append(now)
    return out


def prefix_sums(values) -> list:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def act_bytes(p: Problem, name: str, choice: Mapping[str, int]):
    d = p.decisions[name]
    return d.act_bytes[choice[d.leader]]
