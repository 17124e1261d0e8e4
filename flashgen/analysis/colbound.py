"""Column bounds: mask conjuncts that keep a contiguous range of key columns per query row.

A sliding window, ``q_idx + seqlen_k - seqlen_q - kv_idx < window``, keeps exactly the keys
``kv_idx >= q_idx + seqlen_k - seqlen_q - window + 1`` of a row.  Evaluated per element it
costs an add, a compare and a select for every (q, kv) pair of a masked tile; as a bound,
once per row per tile, it is one compare of the column offset with a per-row limit (the
Hopper forward's ``col_limit`` already does this for ``kv_idx < seqlen_k`` and causal; FA3's
``Mask`` applies its local window the same way).

:func:`extract` finds the top-level ``&&`` conjuncts of a residual mask that are integer
comparisons (``<``, ``<=``, ``>``, ``>=``, ``==``, optionally under ``!``) whose two sides
differ by ``+-kv_idx`` plus a **row expression**: one that reads only ``q_idx``,
``seqlen_q``, ``seqlen_k``, ``b``, ``h``, ``h_kv``, integer literals and i32 scalar params
(no ``kv_idx``, ``causal``, tensor read, float or kernel local), through any integer
operations.  Sums and differences around ``kv_idx`` are decomposed (:func:`_linear`):
``A - kv_idx < B`` becomes ``kv_idx >= A - B + 1``, ``kv_idx < A`` becomes ``kv_idx <= A - 1``.

Integer semantics: each row expression is evaluated exactly as the kernel evaluates it in
the mask today (C ``int``, :func:`flashgen.codegen.cuda_expr.cuda_expr`), and only the linear
combination around ``kv_idx`` (the terms, the comparison's constant) is moved, in 64-bit
arithmetic: the bound keeps the same pairs as the DSL's semantics (the reference,
:mod:`flashgen.ops.reference`, computes in int64), and as the int32 expression wherever that
does not overflow (``|A - kv_idx| < 2^31``; every shipped spec's sizes).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashgen.frontend import ir
from flashgen.frontend.ir import Binary, Call, Causal, Cond, Const, Expr, Spec, Ty, Unary, Var

#: Index variables a row expression may read.
ROW_VARS = frozenset({"b", "h", "h_kv", "q_idx", "seqlen_q", "seqlen_k"})

_NEGATE = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}


@dataclass(frozen=True)
class Linear:
    """``sum(sign * term) + const`` over row expressions (``sign`` +1 or -1), in int64."""

    terms: tuple[tuple[int, Expr], ...]
    const: int

    def __neg__(self) -> Linear:
        return Linear(tuple((-s, t) for s, t in self.terms), -self.const)

    def __add__(self, other: Linear) -> Linear:
        return Linear(self.terms + other.terms, self.const + other.const)

    def plus(self, k: int) -> Linear:
        return Linear(self.terms, self.const + k)


@dataclass(frozen=True)
class ColBound:
    """A row keeps ``kv_idx`` iff ``max(lo) <= kv_idx <= min(hi)`` and ``rest`` holds
    (``lo``/``hi`` empty: no bound that side; ``rest`` None: true)."""

    lo: tuple[Linear, ...]
    hi: tuple[Linear, ...]
    rest: Expr | None


def _row_expr(e: Expr, spec: Spec) -> bool:
    """Whether ``e`` is an i32 expression of the row side only (see the module doc)."""
    if e.ty != Ty.I32:
        return False
    for n in ir.walk(e):
        if n.ty not in (Ty.I32, Ty.BOOL) or isinstance(n, (Causal, ir.Index)):
            return False
        if isinstance(n, Var):
            p = spec.param(n.name)
            if p is None and n.name not in ROW_VARS:
                return False
            if p is not None and (p.kind != "scalar" or p.ty != Ty.I32):
                return False
        elif not isinstance(n, (Const, Unary, Binary, Cond, Call)):
            return False
    return True


def _linear(e: Expr, spec: Spec) -> tuple[int, Linear] | None:
    """``e`` as ``c * kv_idx + L`` (``c`` an integer, ``L`` :class:`Linear`), or None where
    ``kv_idx`` sits under anything but ``+``, ``-`` and negation."""
    if isinstance(e, Var) and e.name == "kv_idx":
        return 1, Linear((), 0)
    if _row_expr(e, spec):
        if isinstance(e, Const):
            return 0, Linear((), int(e.value))
        return 0, Linear(((1, e),), 0)
    if e.ty != Ty.I32:
        return None
    if isinstance(e, Unary) and e.op == "-":
        inner = _linear(e.arg, spec)
        return None if inner is None else (-inner[0], -inner[1])
    if isinstance(e, Binary) and e.op in ("+", "-"):
        a, b = _linear(e.lhs, spec), _linear(e.rhs, spec)
        if a is None or b is None:
            return None
        if e.op == "-":
            b = (-b[0], -b[1])
        return a[0] + b[0], a[1] + b[1]
    return None


def bound_of(e: Expr, spec: Spec) -> tuple[tuple[Linear, ...], tuple[Linear, ...]] | None:
    """``(lo, hi)`` with ``e`` true iff ``max(lo) <= kv_idx <= min(hi)`` (each tuple holds at
    most one entry), or None where ``e`` is not a column bound."""
    neg = False
    while isinstance(e, Unary) and e.op == "!":
        neg, e = not neg, e.arg
    if not isinstance(e, Binary) or e.op not in _NEGATE:
        return None
    if e.lhs.ty != Ty.I32 or e.rhs.ty != Ty.I32:
        return None
    op = _NEGATE[e.op] if neg else e.op
    lhs, rhs = e.lhs, e.rhs
    if op in (">", ">="):  # a > b is b < a
        op, lhs, rhs = {">": "<", ">=": "<="}[op], rhs, lhs
    if op == "!=":
        return None
    a, b = _linear(lhs, spec), _linear(rhs, spec)
    if a is None or b is None:
        return None
    c, k = a[0] - b[0], a[1] + -b[1]  # lhs - rhs = c * kv_idx + k
    if c not in (1, -1):
        return None
    if op == "<":  # c * kv + k < 0  <=>  c * kv + k + 1 <= 0
        k, op = k.plus(1), "<="
    # c * kv + k <= 0 (or == 0): c = 1: kv <= -k; c = -1: kv >= k
    v = -k if c == 1 else k
    if op == "==":
        return (v,), (v,)
    return ((), (v,)) if c == 1 else ((v,), ())


def _conjuncts(e: Expr) -> list[Expr]:
    if isinstance(e, Binary) and e.op == "&&":
        return _conjuncts(e.lhs) + _conjuncts(e.rhs)
    return [e]


def extract(residual: Expr | None, spec: Spec) -> ColBound | None:
    """Split ``residual`` (a typed boolean mask without its top-level ``causal``) into the
    column bounds of its top-level ``&&`` conjuncts and the ``rest`` (the other conjuncts,
    in order); None when no conjunct is a bound.  Pure IR; no side effects."""
    if residual is None:
        return None
    lo: list[Linear] = []
    hi: list[Linear] = []
    rest: Expr | None = None
    for c in _conjuncts(residual):
        b = bound_of(c, spec)
        if b is None:
            rest = c if rest is None else Binary("&&", rest, c, ty=Ty.BOOL)
        else:
            lo += b[0]
            hi += b[1]
    if not lo and not hi:
        return None
    return ColBound(tuple(lo), tuple(hi), rest)


def linear_code(v: Linear, code) -> str:
    """``v`` as a CUDA ``long long`` expression; ``code(expr)`` renders a row expression (as
    the mask renders it, :func:`flashgen.codegen.cuda_expr.cuda_expr`)."""
    parts = []
    for sign, t in v.terms:
        parts.append(f"{'-' if sign < 0 else '+'} (long long)({code(t)})")
    if v.const or not parts:
        parts.append(f"{'-' if v.const < 0 else '+'} {abs(v.const)}LL")
    text = " ".join(parts)
    return "(" + (text[2:] if text.startswith("+ ") else text) + ")"


def bound_code(vs: tuple[Linear, ...], code, pick: str) -> str | None:
    """The ``pick`` (``max`` or ``min``) of ``vs`` as a CUDA ``long long`` expression, or
    None when ``vs`` is empty."""
    if not vs:
        return None
    out = linear_code(vs[0], code)
    for v in vs[1:]:
        out = f"{pick}({out}, {linear_code(v, code)})"
    return out
