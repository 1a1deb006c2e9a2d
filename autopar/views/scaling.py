"""Reading a plan's `Scaling` (`autopar/planner/scaling.py` builds it): the plan's step time and memory
at another batch size or sequence length (`estimate_at`), the largest batch that fits
(`largest_batch`) and the report's table (`scaling_rows`). The expressions are the plan's own text,
compiled by `expr.compile_expr` (never evaluated as code)."""
from __future__ import annotations

import math

from ..errors import PlanMismatchError
from ..expr import compile_expr
from ..plan_records import Estimate, Scaling

__all__ = ["estimate_at", "largest_batch", "scaling_rows"]


def _sizes(sc: Scaling, batch: int | None, seq: int | None) -> tuple[int, int]:
    if sc.unavailable:
        raise PlanMismatchError(f"this plan has no symbolic costs ({sc.unavailable}): re-plan at the sizes you "
                                f"want instead")
    for name, value in (("batch", batch), ("seq", seq)):
        if value is not None and name in sc.fixed:
            raise PlanMismatchError(f"the model fixes its {name} size at capture (a size in its code is a "
                                    f"constant, or it has no {name} dim): plan at {name}={value} instead")
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    b = sc.batch if batch is None else batch
    s = (sc.seq or 1) if seq is None else seq
    for i, (expr, n) in enumerate(sc.divisible):
        v = compile_expr(expr, f"scaling.divisible[{i}]")(b, s)
        if round(v) % n:
            raise PlanMismatchError(f"at batch={b}, seq={s} a dim of size {expr} = {round(v)} that this plan splits "
                                    f"{n} ways does not divide evenly: choose sizes that keep {expr} a multiple "
                                    f"of {n}, or re-plan at those sizes")
    return b, s


def estimate_at(sc: Scaling, batch: int | None = None, seq: int | None = None) -> Estimate:
    b, s = _sizes(sc, batch, seq)
    compute = compile_expr(sc.compute_s, "scaling.compute_s")(b, s)
    comm = compile_expr(sc.comm_s, "scaling.comm_s")(b, s)
    other = compile_expr(sc.other_s, "scaling.other_s")(b, s)
    state = compile_expr(sc.state_bytes, "scaling.state_bytes")(b, s)
    peak = max([state] + [compile_expr(p, f"scaling.memory_points[{i}]")(b, s) for i, p in enumerate(sc.memory_points)])
    per_axis = {ax: compile_expr(e, f"scaling.comm_bytes_per_axis.{ax}")(b, s)
                for ax, e in sc.comm_bytes_per_axis.items()}
    return Estimate(compute + comm + other, compute, comm, peak, state, max(peak - state, 0.0), per_axis)


def _batch_step(sc: Scaling, seq: int) -> int:
    """The smallest batch that keeps every split even at this sequence length; its multiples do too
    (a split dim's size is B times something: 8*B, B*S)."""
    conds = [(compile_expr(e, f"scaling.divisible[{i}]"), n) for i, (e, n) in enumerate(sc.divisible)]
    limit = math.lcm(*[n for _, n in conds]) if conds else 1
    for b in range(1, limit + 1):
        if all(round(f(b, seq)) % n == 0 for f, n in conds):
            return b
    raise PlanMismatchError(f"no batch size splits evenly under this plan at seq={seq}: its splits need "
                            + ", ".join(f"{e} divisible by {n}" for e, n in sc.divisible))


def largest_batch(sc: Scaling, seq: int | None = None, memory_budget: float | None = None) -> int:
    """Largest batch (a multiple of the split step) whose peak fits; 0 if none does."""
    budget = sc.memory_budget if memory_budget is None else memory_budget
    s = (sc.seq or 1) if seq is None else seq
    if "batch" in sc.fixed:
        raise PlanMismatchError("the model fixes its batch size at capture: its memory does not scale with a batch")
    step = _batch_step(sc, s)

    def fits(k: int) -> bool:
        return estimate_at(sc, k * step, seq).peak_memory_bytes <= budget

    if not fits(1):
        return 0
    hi = 1
    while fits(hi * 2) and hi < 2 ** 40:
        hi *= 2
    lo, hi = hi, hi * 2          # fits(lo), not fits(hi): memory grows with the batch
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step


def scaling_rows(sc: Scaling, seq: int | None = None):
    """(batch, Estimate) at 1/4x .. 8x the planned batch (sizes that split evenly), for the report."""
    s = (sc.seq or 1) if seq is None else seq
    step = _batch_step(sc, s)
    seen, rows = set(), []
    for f in (0.25, 0.5, 1, 2, 4, 8):
        b = max(step, round(sc.batch * f / step) * step)
        if b in seen:
            continue
        seen.add(b)
        try:
            rows.append((b, estimate_at(sc, b, seq)))
        except PlanMismatchError:
            continue
    return rows
