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

Integer semantics: the kernels evaluate the mask in C ``int`` and the reference
(:mod:`flashgen.ops.cpu.reference`) wraps like int32, so the bound must keep exactly the pairs
the int32 comparison keeps.  Each row expression (a maximal ``kv_idx``-free sub-expression,
a term of :class:`Linear`) is evaluated exactly as the kernel evaluates it in the mask
(C ``int``, :func:`flashgen.codegen.cuda_expr.cuda_expr`), and only the linear combination around
``kv_idx`` (the terms, the comparison's constant) is moved, in 64-bit arithmetic (a sum of
a few int32 values: it cannot overflow).  The moved bound equals the int32 comparison
exactly where neither side of the comparison wraps: a side is a tree of ``+``, ``-`` and
negation over row expressions, ``kv_idx`` and literals, so its int32 value is its exact
value modulo 2^32 and equals it where the exact value lies in int32.  A conjunct is folded
only where that is proven (:func:`exact_in_int32`) for every row and column a kernel sees:
``0 <= q_idx < seqlen_q``, ``0 <= kv_idx < seqlen_k`` at any int32 sizes, ``b``, ``h``,
``h_kv`` below int32 sizes, i32 params within their declared ``min`` / ``max`` (``above`` /
``below``), any int32 otherwise.  The proof is interval arithmetic
(:func:`flashgen.analysis.maskinfo.evaluate` over
:func:`flashgen.analysis.maskinfo.static_env`) with one relation added, since plain intervals
cannot bound a sliding window's side: an index and its size vary together (``q_idx -
seqlen_q`` lies in ``[-seqlen_q, -1]``), so the pair ``a * q_idx + b * seqlen_q`` is bounded
at the corners of the triangle ``0 <= q_idx <= seqlen_q - 1 <= 2^31 - 2`` (likewise
``kv_idx`` and ``seqlen_k``).  A row expression that is itself such a sum enters the side
through its variables where its own exact value provably fits int32 (then its int32 value is
that value), else as an opaque int32 value.  So ``q_idx + seqlen_k - seqlen_q - kv_idx <
window`` folds for any ``window`` (the left side lies in ``[-2^31 + 2, 2^31 - 2]``),
``kv_idx <= q_idx + p`` for any ``p`` (a lone row expression never wraps relative to
itself), but ``w - kv_idx >= q_idx / 3 - p`` only where ``w``'s declared ``min`` is at
least -2: with ``w`` near -2^31, ``w - kv_idx`` wraps in the kernel, and that conjunct stays in
the per-element mask (``rest``), which computes exactly what the reference computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flashgen.analysis.maskinfo import Range, evaluate, static_env
from flashgen.frontend import ir
from flashgen.frontend.ir import Binary, Call, Causal, Cond, Const, Expr, Spec, Ty, Unary, Var

#: Index variables a row expression may read.
ROW_VARS = frozenset({"b", "h", "h_kv", "q_idx", "seqlen_q", "seqlen_k"})

I32_MIN, I32_MAX = -(2**31), 2**31 - 1

#: Index variables and the sizes they lie below: ``0 <= q_idx <= seqlen_q - 1``.
_PAIRS = (("q_idx", "seqlen_q"), ("kv_idx", "seqlen_k"))

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


@dataclass
class _Sum:
    """``sum(coef[v] * v) + sum(ranges) + const`` in exact integers: ``v`` index variables,
    sizes and params, ``ranges`` the ``(lo, hi)`` of opaque int32 values."""

    coef: dict[str, int] = field(default_factory=dict)
    ranges: list[tuple[int, int]] = field(default_factory=list)
    const: int = 0

    def add(self, other: _Sum, sign: int) -> None:
        for v, c in other.coef.items():
            self.coef[v] = self.coef.get(v, 0) + sign * c
        self.ranges += [(lo, hi) if sign > 0 else (-hi, -lo) for lo, hi in other.ranges]
        self.const += sign * other.const


def _opaque(e: Expr, env: dict) -> tuple[int, int]:
    """Bounds of the int32 value of ``e``: its interval where that lies inside int32 (no
    sub-expression can wrap: :func:`flashgen.analysis.maskinfo.evaluate` widens a result
    that may leave int32 to any value), else all of int32."""
    try:
        r = evaluate(e, env)
    except (TypeError, KeyError, ValueError):
        r = None
    if isinstance(r, Range) and I32_MIN <= r.lo and r.hi <= I32_MAX:
        return math.floor(r.lo), math.ceil(r.hi)
    return I32_MIN, I32_MAX


def _fine(e: Expr, sign: int, acc: _Sum, env: dict) -> None:
    """Add ``sign * e`` (exact value) to ``acc``, through ``+``, ``-`` and negation down to
    variables, literals and opaque sub-expressions."""
    if isinstance(e, Binary) and e.op in ("+", "-") and e.ty == Ty.I32:
        _fine(e.lhs, sign, acc, env)
        _fine(e.rhs, sign if e.op == "+" else -sign, acc, env)
    elif isinstance(e, Unary) and e.op == "-" and e.ty == Ty.I32:
        _fine(e.arg, -sign, acc, env)
    elif isinstance(e, Const) and e.ty == Ty.I32:
        acc.const += sign * int(e.value)
    elif isinstance(e, Var):
        acc.coef[e.name] = acc.coef.get(e.name, 0) + sign
    else:
        lo, hi = _opaque(e, env)
        acc.ranges.append((lo, hi) if sign > 0 else (-hi, -lo))


def _span(acc: _Sum, env: dict) -> tuple[int, int]:
    """Bounds of ``acc``'s value over every row and column a kernel sees (module doc): an
    index and its size at the corners of ``0 <= idx <= size - 1 <= 2^31 - 2``, the other
    variables over their ``env`` intervals."""
    lo = hi = acc.const
    coef = dict(acc.coef)
    for idx, size in _PAIRS:
        a, b = coef.pop(idx, 0), coef.pop(size, 0)
        corners = (b, b * I32_MAX, a * (I32_MAX - 1) + b * I32_MAX)
        lo, hi = lo + min(corners), hi + max(corners)
    for name, c in coef.items():
        r = env[name]
        ends = (c * r.lo, c * r.hi)
        lo, hi = lo + min(ends), hi + max(ends)
    for rlo, rhi in acc.ranges:
        lo, hi = lo + rlo, hi + rhi
    return lo, hi


def _fits(span: tuple[float, float]) -> bool:
    return I32_MIN <= span[0] and span[1] <= I32_MAX


def _side(e: Expr, sign: int, acc: _Sum, spec: Spec, env: dict) -> None:
    """Add ``sign * e`` to ``acc`` for a comparison side ``e`` that :func:`_linear`
    decomposes: ``kv_idx``, literals, and each row expression through its variables where
    its exact value fits int32 (so its int32 value is that value), else as an opaque value."""
    if isinstance(e, Var) and e.name == "kv_idx":
        acc.coef["kv_idx"] = acc.coef.get("kv_idx", 0) + sign
    elif _row_expr(e, spec):
        sub = _Sum()
        _fine(e, 1, sub, env)
        if _fits(_span(sub, env)):
            acc.add(sub, sign)
        else:
            lo, hi = _opaque(e, env)
            acc.ranges.append((lo, hi) if sign > 0 else (-hi, -lo))
    elif isinstance(e, Unary):  # "-", as _linear checked
        _side(e.arg, -sign, acc, spec, env)
    else:  # Binary "+" or "-", as _linear checked
        _side(e.lhs, sign, acc, spec, env)
        _side(e.rhs, sign if e.op == "+" else -sign, acc, spec, env)


def exact_in_int32(e: Expr, spec: Spec, env: dict | None = None) -> bool:
    """Whether the int32 value of ``e`` (one side of a column-bound comparison: ``+``, ``-``
    and negation over ``kv_idx``, literals and row expressions, as :func:`_linear` accepts)
    provably equals its exact value, taking each row expression's int32 value as given, at
    every row and column a kernel sees (module doc).  ``env``: the interval environment
    (default :func:`flashgen.analysis.maskinfo.static_env` of ``spec``).  Sound, not
    complete: False where the proof fails."""
    env = static_env(spec) if env is None else env
    acc = _Sum()
    _side(e, 1, acc, spec, env)
    return _fits(_span(acc, env))


def bound_of(
    e: Expr, spec: Spec, env: dict | None = None
) -> tuple[tuple[Linear, ...], tuple[Linear, ...]] | None:
    """``(lo, hi)`` with ``e`` true iff ``max(lo) <= kv_idx <= min(hi)`` (each tuple holds at
    most one entry), or None where ``e`` is not a column bound or its sides are not proven
    free of int32 wrapping (:func:`exact_in_int32`; ``env`` as there)."""
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
    env = static_env(spec) if env is None else env
    if not (exact_in_int32(lhs, spec, env) and exact_in_int32(rhs, spec, env)):
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
    in order); None when no conjunct is a bound.  A conjunct is a bound only where the bound
    provably keeps exactly the pairs its int32 evaluation keeps (module doc); the others stay
    in ``rest``, evaluated per element.  Pure IR; no side effects."""
    if residual is None:
        return None
    env = static_env(spec)
    lo: list[Linear] = []
    hi: list[Linear] = []
    rest: Expr | None = None
    for c in _conjuncts(residual):
        b = bound_of(c, spec, env)
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
