"""What an op does inside itself beyond its kernel: the facts its rule hands to pricing.

Most ops run one kernel on their local shards; what moves between devices is on the graph's edges. A
few run more under some strategies: an expert-parallel MoE layer exchanges its token-slots by
all-to-all, a vocab-split loss all-reduces per-row statistics, context-parallel attention passes
K/V blocks round its axis. Their rules say so through one interface: `register(..., inner=fn)`
(`registry.py`), with

    fn(node, strategy, ins, outs, mesh_shape) -> tuple of facts, in the order they apply

`ins`/`outs` are the tensor metas the caller prices with (sympy sizes in `autopar.planner.scaling`). A fact
says WHAT happens (which collective on which mesh axis, over how many bytes or rows, forward and
backward; what is kept for the backward; how the kernel's work is shared), never what it costs:
`cost_model/inner.py` prices each kind of fact, and the problem builder (`solver/`) calls the hook
by registry lookup without knowing the op. A new op's pricing is a hook here and, for a new kind of
fact, its price in `cost_model/inner.py`; nothing in the solver.
"""
from __future__ import annotations

from typing import NamedTuple


class Imbalanced(NamedTuple):
    """The op's work is dealt to devices by data (routing): the busiest device sets the pace, its
    load over the mean the cost model's (`cost_model.inner.busiest_load`)."""


class RoutedExchange(NamedTuple):
    """Rows sent to the device that runs them and back over mesh `axis` (`size` devices): an all-to-all
    of one device's `row_bytes` each way in the forward, the reverse in the backward, after an
    exchange of the row counts; the busiest device's rows bound it (as `Imbalanced`)."""
    axis: int
    size: int
    row_bytes: float


class WeightTrade(NamedTuple):
    """One all-to-all of one device's `shard_bytes` of a weight over mesh `axis` (`size` devices) before
    the op runs, its reverse for the gradient in the backward; the traded shard is kept for the backward."""
    axis: int
    size: int
    shard_bytes: float


class RowReductions(NamedTuple):
    """All-reduces over mesh `axis` (`size` devices) of a few statistics per row, each its own launch:
    `per_row` = (forward, backward) bytes per row of each all-reduce; `rows` rows on one device."""
    axis: int
    size: int
    rows: float
    per_row: tuple[tuple[int, ...], tuple[int, ...]]


class GroupedExperts(NamedTuple):
    """The element-wise passes around a grouped-GEMM experts op and what it keeps for the backward, per
    token-slot (`cost_model/experts.py`): `slots` run on one device at the mean load (times the load
    where `imbalanced`), `combined` added into its tokens (None: the slots it runs), the hidden and
    intermediate widths, the element size, whether it exchanges its slots, its local experts."""
    slots: float
    imbalanced: bool
    combined: float | None
    hidden: float
    inter: float
    itemsize: int
    exchange: bool
    experts: float


class SequenceSplit(NamedTuple):
    """Attention with its sequence split over mesh `axis` (`size` devices) by method `label` ("ring",
    "allgather_kv", "ulysses": `strategies/attention.py`): one device's query bytes `q_b` and key and
    value bytes `kv_b`, whether its chunks go into the causal-balanced order and back, the keys'
    element size, the head dim of the queries and of the values (`cost_model/context.py` prices the
    kernel's share and transfers)."""
    label: str
    axis: int
    size: int
    q_b: float
    kv_b: float
    balanced: bool
    itemsize: int
    head_dim: int
    value_dim: int
