"""Cost expressions in plans, read back as data: a small whitelisted grammar, never `eval`.

A plan keeps its costs as functions of the batch size `B` and sequence length `S` as text
(`Plan.scaling`, written with sympy's `str()`). Plan files come from disk, caches and other
people, so reading them must not evaluate the text. The grammar is

    expr   := number | B | S | expr (+ - * / **) expr | -expr | +expr | (expr) | f(expr, ...)
    f      := Max | Min (one or more arguments), ceiling | floor (one argument)
              (lower-case max, min, ceil accepted too)

`ast.parse(text, mode="eval")` builds a syntax tree without running anything; `compile_expr`
walks it and accepts only the node types above (anything else: a name, an attribute, a call
of anything else, a subscript, a string, ... is an `ExprError` naming the field and what it found). The
result is a plain function f(B, S) -> float made of closures over `operator` functions.
Exponents are integer literals of magnitude at most `MAX_POWER`, so no expression can ask for
unbounded work (`9**9**9`).
"""
from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from functools import lru_cache

from .errors import PlanFileError

__all__ = ["ExprError", "compile_expr", "MAX_POWER"]

# Costs are polynomials of low degree in B and S (attention memory is B*S**2); 8 leaves room for
# any cost autopar writes while bounding what a crafted file can ask for.
MAX_POWER = 8

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_ANY = 1 << 30
# name -> (function of the list of argument values, least and most number of arguments)
_FUNCTIONS: dict[str, tuple[Callable[[list[float]], float], int, int]] = {
    "Max": (max, 1, _ANY), "max": (max, 1, _ANY), "Min": (min, 1, _ANY), "min": (min, 1, _ANY),
    "ceiling": (lambda v: math.ceil(v[0]), 1, 1), "ceil": (lambda v: math.ceil(v[0]), 1, 1),
    "floor": (lambda v: math.floor(v[0]), 1, 1)}
_SYMBOLS = ("B", "S")

Fn = Callable[[float, float], float]


class ExprError(PlanFileError):
    """Text outside the grammar, or that cannot be evaluated (the message says what and where)."""


class _Bad(ValueError):
    """What the walk found outside the grammar (becomes an ExprError naming the field)."""


def compile_expr(text: str, field: str = "expression") -> Fn:
    """f(B, S) -> float for a saved cost expression; ExprError naming `field` (where the text came
    from, e.g. "scaling.compute_s") if the text is outside the grammar or fails to evaluate."""
    if not isinstance(text, str):
        raise ExprError(f"{field}: expected an expression as text, got {type(text).__name__}")
    try:
        fn = _compiled(text)
    except _Bad as e:
        raise ExprError(f"{field}: {e} in {_clip(text)!r}") from None

    def evaluate(b: float, s: float) -> float:
        try:
            return float(fn(b, s))
        except (ZeroDivisionError, OverflowError, ValueError) as e:   # ValueError: a float too large to round
            raise ExprError(f"{field}: {_clip(text)!r} at B={b}, S={s}: {e}") from None

    return evaluate


@lru_cache(maxsize=1024)
def _compiled(text: str) -> Fn:
    try:
        return _walk(ast.parse(text.strip(), mode="eval").body)
    except SyntaxError as e:
        raise _Bad(f"not an expression ({e.msg})") from None
    except (RecursionError, MemoryError):
        raise _Bad("expression nested too deeply") from None
    except ValueError as e:      # _Bad, or a literal Python refuses (an int of 5,000 digits)
        raise _Bad(str(e)) from None


def _walk(node: ast.AST) -> Fn:
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):
            raise _Bad(f"constant {node.value!r} is not a number")
        value = float(node.value)
        return lambda b, s: value
    if isinstance(node, ast.Name):
        if node.id not in _SYMBOLS:
            raise _Bad(f"unknown name {node.id!r} (only B and S)")
        return (lambda b, s: b) if node.id == "B" else (lambda b, s: s)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        op, x = _UNARY[type(node.op)], _walk(node.operand)
        return lambda b, s: op(x(b, s))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        if isinstance(node.op, ast.Pow):
            _check_exponent(node.right)
        op, x, y = _BINARY[type(node.op)], _walk(node.left), _walk(node.right)
        return lambda b, s: op(x(b, s), y(b, s))
    if isinstance(node, ast.Call):
        return _call(node)
    raise _Bad(f"{type(node).__name__} is not allowed (numbers, B, S, + - * / **, Max, Min, ceiling, floor)")


def _call(node: ast.Call) -> Fn:
    name = node.func.id if isinstance(node.func, ast.Name) else None
    if name not in _FUNCTIONS:
        raise _Bad(f"call of {ast.unparse(node.func)[:40]!r} is not allowed (Max, Min, ceiling, floor)")
    if node.keywords:
        raise _Bad(f"{name}() takes no keyword arguments")
    fn, least, most = _FUNCTIONS[name]
    if not least <= len(node.args) <= most or any(isinstance(a, ast.Starred) for a in node.args):
        raise _Bad(f"{name}() takes {least}{'' if least == most else ' or more'} argument(s)")
    args = [_walk(a) for a in node.args]
    return lambda b, s: fn([a(b, s) for a in args])


def _check_exponent(node: ast.AST) -> None:
    literal = node.operand if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) else node
    if not (isinstance(literal, ast.Constant) and type(literal.value) is int and abs(literal.value) <= MAX_POWER):
        raise _Bad(f"exponent {ast.unparse(node)[:40]} is not an integer literal of magnitude <= {MAX_POWER}")


def _clip(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[:n] + "..."
