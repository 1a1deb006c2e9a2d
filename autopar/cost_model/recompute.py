"""What selective recomputation keeps: the one definition the planner prices and the runtime runs.

Selective recomputation (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models") keeps the outputs of the matrix multiplications, whose recomputation is
expensive, and recomputes the attention core and the cheap element-wise ops (norms,
activations, dropout, residual adds), whose saved tensors are large. Names are ATen op names as
`strategies.op_name` gives them (graph nodes) and as the runtime's checkpoint policy sees them
(`aten.mm` when a `linear` dispatches).
"""
from __future__ import annotations

SELECTIVE_SAVED_OPS = frozenset({
    "aten.linear", "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.matmul",
})


def saved_under_selective(op: str) -> bool:
    """Does selective recomputation keep this op's output (instead of recomputing it)?"""
    return op in SELECTIVE_SAVED_OPS
