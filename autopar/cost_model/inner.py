"""The price of what an op does inside itself: the facts its rule hands over (`strategies/inner.py`).

Each kind of fact has its price here, from the formulas of `comm.py`, `experts.py` and `context.py`:
seconds added to (or made of) the op's forward and backward kernel time, bytes it keeps for the
backward, bytes of its working buffers, and the collectives a plan lists on the op. Facts apply in the
order the hook gives them (a kernel-time transform first, then what adds to it). `load` is the busiest
device's share of routed work over the mean (`busiest_load`); `links` one per mesh axis.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from ..strategies.inner import (GroupedExperts, Imbalanced, RoutedExchange, RowReductions, SequenceSplit,
                                WeightTrade)
from .comm import (collective_bytes_on_wire, expert_exchange_times, expert_tp_exchange_times, moe_routed_load,
                   row_reduce_bytes_on_wire, row_reduce_times)
from .context import FP32_BYTES, ContextComm, context_saved_bytes, context_times, context_work_bytes
from .experts import expert_pass_times, expert_saved_bytes
from .profiles import DeviceProfile


def busiest_load(profile: DeviceProfile, capacity_factor: float | None) -> float:
    """The busiest device's routed work over the mean (`comm.moe_routed_load`) on `profile`."""
    return moe_routed_load(profile.moe_load_imbalance, capacity_factor)


class Listed(NamedTuple):
    """A collective an op runs inside itself, as a plan lists it: phase, kind, seconds, bytes one device sends."""
    phase: str
    kind: str
    seconds: float
    sent: float


class _Price(NamedTuple):
    """How one kind of fact is priced: (fwd, bwd, fact, links, load, profile) -> (fwd, bwd); bytes kept for
    the backward (fact, load); working bytes at the backward's largest (fact); listed collectives (fact,
    links, load, profile) -> [Listed]."""
    times: Callable
    saved: Callable | None = None
    work: Callable | None = None
    listed: Callable | None = None


def _launch(profile: DeviceProfile) -> float:
    return profile.kernel_overhead + profile.collective_overhead       # per collective, as Mesh.reshard_cost


def _scaled(fwd, bwd, f: Imbalanced, links, load, profile):
    return fwd * load, bwd * load


def _exchange_times(f: RoutedExchange, links, load, profile) -> tuple:
    return expert_exchange_times(f.row_bytes, f.size, links[f.axis], load, _launch(profile))


def _exchange_listed(f: RoutedExchange, links, load, profile) -> list[Listed]:
    xf, xb = _exchange_times(f, links, load, profile)
    sent = 2 * collective_bytes_on_wire("all_to_all", f.size * f.row_bytes, f.size)
    return [Listed("forward", "all_to_all", xf, sent), Listed("backward", "all_to_all", xb, sent)]


def _trade_times(f: WeightTrade, links, load, profile) -> tuple:
    return expert_tp_exchange_times(f.shard_bytes, f.size, links[f.axis], _launch(profile))


def _trade_listed(f: WeightTrade, links, load, profile) -> list[Listed]:
    xf, xb = _trade_times(f, links, load, profile)
    sent = collective_bytes_on_wire("all_to_all", f.size * f.shard_bytes, f.size)
    return [Listed("forward", "all_to_all", xf, sent), Listed("backward", "all_to_all", xb, sent)]


def _reduce_times(f: RowReductions, links, load, profile) -> tuple:
    return row_reduce_times(f.per_row, f.rows, f.size, links[f.axis], _launch(profile))


def _reduce_listed(f: RowReductions, links, load, profile) -> list[Listed]:
    times = _reduce_times(f, links, load, profile)
    return [Listed(phase, "all_reduce", t, sent) for phase, t, sent in
            zip(("forward", "backward"), times, row_reduce_bytes_on_wire(f.per_row, f.rows, f.size)) if sent]


def _added(times: Callable) -> Callable:
    """A fact's own (forward, backward) seconds, added to the op's."""
    def add(fwd, bwd, f, links, load, profile):
        xf, xb = times(f, links, load, profile)
        return fwd + xf, bwd + xb
    return add


def _experts_slots(f: GroupedExperts, load) -> tuple:
    """(slots the busiest device runs, slots added into one device's tokens)."""
    run = f.slots * (load if f.imbalanced else 1.0)
    return run, run if f.combined is None else f.combined


def _experts_times(f: GroupedExperts, links, load, profile) -> tuple:
    return expert_pass_times(_experts_slots(f, load)[0], f.hidden, f.inter, f.itemsize, f.exchange, profile)


def _experts_saved(f: GroupedExperts, load):
    run, combined = _experts_slots(f, load)
    return expert_saved_bytes(run, combined, f.hidden, f.inter, f.itemsize, f.experts)


def _context(f: SequenceSplit, link=None) -> ContextComm:
    """Its `ContextComm` (the link only where its transfers are priced)."""
    return ContextComm(f.label, f.size, link, f.q_b, f.kv_b, balanced=f.balanced,
                       fp32=FP32_BYTES / f.itemsize, head_dim=f.head_dim, value_dim=f.value_dim)


_PRICES: dict[type, _Price] = {
    Imbalanced: _Price(_scaled),
    RoutedExchange: _Price(_added(_exchange_times), listed=_exchange_listed),
    WeightTrade: _Price(_added(_trade_times), saved=lambda f, load: f.shard_bytes, listed=_trade_listed),
    RowReductions: _Price(_added(_reduce_times), listed=_reduce_listed),
    GroupedExperts: _Price(_added(_experts_times), saved=_experts_saved),
    SequenceSplit: _Price(lambda fwd, bwd, f, links, load, profile: context_times(fwd, bwd, _context(f, links[f.axis])),
                          saved=lambda f, load: context_saved_bytes(_context(f)),
                          work=lambda f: context_work_bytes(_context(f))),
}


def _price(f) -> _Price:
    price = _PRICES.get(type(f))
    if price is None:       # a rule's hook handed a kind of fact nothing prices: a bug in autopar, not input
        raise TypeError(f"no price for the fact {f!r} of an op's `inner` hook: give its kind a `_Price` in "
                        f"autopar/cost_model/inner.py")
    return price


def inner_times(facts: Sequence, fwd, bwd, links, load: float, profile: DeviceProfile) -> tuple:
    """(forward, backward) seconds of an op whose kernel takes (fwd, bwd), with what it does inside itself."""
    for f in facts:
        fwd, bwd = _price(f).times(fwd, bwd, f, links, load, profile)
    return fwd, bwd


def inner_saved_bytes(facts: Sequence, load: float):
    """Bytes the op keeps for its backward besides its inputs and output."""
    total = 0.0
    for f in facts:
        saved = _price(f).saved
        if saved is not None:
            total = total + saved(f, load)
    return total


def inner_work_bytes(facts: Sequence):
    """Bytes of the op's working buffers at their largest, in its backward."""
    total = 0.0
    for f in facts:
        work = _price(f).work
        if work is not None:
            total = total + work(f)
    return total


def inner_collectives(facts: Sequence, links, load: float, profile: DeviceProfile) -> list[tuple[Listed, int]]:
    """(`Listed`, mesh axis) of the collectives the op runs inside itself that a plan lists."""
    out = []
    for f in facts:
        listed = _price(f).listed
        if listed is not None:
            out += [(c, f.axis) for c in listed(f, links, load, profile)]
    return out
