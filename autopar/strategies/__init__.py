"""Sharding strategies: per-op rules (one mesh axis) and their N-D combination."""
from . import attention, conv, indexing, matmul, moe, nn_ops, pointwise, views  # noqa: F401  (registers the rules)
from .registry import RULES, AxisOption, OpRule, op_name, register, rule_for
from .strategy import Layout, Strategy, node_strategies

__all__ = ["RULES", "AxisOption", "OpRule", "register", "rule_for", "op_name", "Layout", "Strategy",
           "node_strategies"]
