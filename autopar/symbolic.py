"""Costs as sympy expressions in the batch size `B` and sequence length `S`.

The cost functions (`cost_model/compute.py`, `comm.py`, `memory.py`, the planner's tables) are written once
and take either numbers or sympy expressions: a tensor whose shape is `(B, S, 4096)` costs
`max(2*4096*4096*B*S / rate + ramp, bytes / bandwidth)` seconds, as an expression, through the
same code that prices the captured sizes. These helpers are the few places where numbers and
expressions need different handling (`max`, `min`, zero tests, ceiling division).

Symbolic sizes assume shards split evenly (the planner only splits evenly at the captured sizes;
`Plan.estimate_at` checks that a new size still divides, see `Scaling.divisible`).
"""
from __future__ import annotations

from numbers import Number

import numpy as np
import sympy

__all__ = ["SymbolicUnavailable", "BATCH", "SEQ", "is_symbolic", "smax", "smin", "ssum", "is_zero", "ceil_div", "to_float", "Poly2"]

# Positive integers: lets sympy decide e.g. Max(2*B*S, B*S) = 2*B*S and drop dominated terms.
BATCH = sympy.Symbol("B", positive=True, integer=True)
SEQ = sympy.Symbol("S", positive=True, integer=True)


class SymbolicUnavailable(Exception):
    """A model or plan that cannot be priced at other sizes (the reason in the message)."""


_NUMBERS = frozenset({float, int, np.float64})


def is_symbolic(x) -> bool:
    # plain numbers first: the pricing asks this of millions of them (a 3-axis mesh's edge tables)
    return type(x) not in _NUMBERS and isinstance(x, sympy.Basic) and not x.is_number


def smax(*xs):
    """max() of numbers, or sympy.Max when any argument is an expression."""
    return sympy.Max(*xs) if any(is_symbolic(x) for x in xs) else max(xs)


def ssum(xs):
    """sum() of numbers; one sympy.Add of expressions (adding them one by one is quadratic); one
    array sum of `Poly2`s (a liveness point of an 8B model adds ~200 of them, 6,700 points)."""
    xs = list(xs)
    kinds = set(map(type, xs))
    if kinds <= _NUMBERS:
        return sum(xs)
    if Poly2 in kinds:
        return Poly2.total(xs)
    return sympy.Add(*xs) if any(is_symbolic(x) for x in xs) else sum(xs)


def smin(*xs):
    return sympy.Min(*xs) if any(is_symbolic(x) for x in xs) else min(xs)


def is_zero(x) -> bool:
    """x <= 0 for numbers; for an expression, whether it is identically zero (sizes are positive)."""
    if is_symbolic(x):
        return bool(x.is_zero)
    return x <= 0


def ceil_div(a, n: int):
    """ceil(a / n): exact division for an expression (even splits, see module docstring)."""
    if is_symbolic(a):
        return a / n
    return -(-a // n)


def to_float(x):
    """float() of a number; an expression stays an expression."""
    return x if is_symbolic(x) else float(x)


def as_number(x) -> bool:
    return isinstance(x, Number) or (isinstance(x, sympy.Basic) and x.is_number)


class Poly2:
    """A polynomial in B and S of degree <= 2 in each, as a 3x3 array of coefficients of B^i S^j.

    Memory is such a polynomial (bytes of tensors whose dims are B, S or constants; attention
    scores are B*S^2): summing thousands of them per liveness point is array arithmetic, and
    `p <= q` for every B, S > 0 whenever every coefficient of q - p is >= 0 (`dominated_by`)."""
    __slots__ = ("c",)
    DEGREE = 2

    def __init__(self, c: np.ndarray):
        self.c = c

    @classmethod
    def of(cls, x) -> Poly2:
        c = np.zeros((cls.DEGREE + 1, cls.DEGREE + 1))
        if not is_symbolic(x):
            c[0, 0] = float(x)
            return cls(c)
        for (i, j), v in sympy.Poly(x, BATCH, SEQ).terms():
            if i > cls.DEGREE or j > cls.DEGREE:
                raise SymbolicUnavailable(f"a memory term {x} has degree above {cls.DEGREE} in B or S")
            c[i, j] = float(v)
        return cls(c)

    @classmethod
    def total(cls, xs) -> Poly2:
        """The sum of Poly2s and numbers (the numbers add to the constant term)."""
        polys = [x.c for x in xs if isinstance(x, Poly2)]
        c = np.add.reduce(polys) if polys else np.zeros((cls.DEGREE + 1, cls.DEGREE + 1))
        c[0, 0] += float(sum(x for x in xs if not isinstance(x, Poly2)))
        return cls(c)

    def __add__(self, other):
        if isinstance(other, Poly2):
            return Poly2(self.c + other.c)
        out = self.c.copy()
        out[0, 0] += float(other)
        return Poly2(out)

    __radd__ = __add__

    def __neg__(self) -> Poly2:
        return Poly2(-self.c)

    def __mul__(self, k) -> Poly2:        # by a number
        return Poly2(self.c * float(k))

    __rmul__ = __mul__

    def __sub__(self, other):
        return self + (-other)

    def __rsub__(self, other):
        return (-self) + other

    def at(self, b: float, s: float) -> float:
        return float(np.array([1, b, b * b]) @ self.c @ np.array([1, s, s * s]))

    def dominated_by(self, other: Poly2) -> bool:
        return bool(np.all(self.c <= other.c))

    def to_expr(self) -> sympy.Expr:
        return sympy.Add(*[sympy.Float(v) * BATCH ** i * SEQ ** j if v != int(v) else int(v) * BATCH ** i * SEQ ** j
                           for (i, j), v in np.ndenumerate(self.c) if v])
