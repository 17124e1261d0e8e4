"""Symbolic differentiation of DSL expressions with respect to ``score``.

The backward pass needs d score_mod / d score at every (q_idx, kv_idx) to chain the
softmax gradient through the score_mod (FlexAttention's score_mod backward).  This
module derives it from the typed IR, so the CUDA lowering and the PyTorch reference
get the same derivative.  Pure Python; no torch.

Rules: constants, index variables, params and tensor reads have derivative 0 (they do
not depend on ``score``); sum, product, quotient and chain rules; ``c ? a : b`` ->
``c ? a' : b'``; ``abs(a)' = (a < 0 ? -1 : 1) a'``; ``min/max`` follow the selected
argument; ``fmod(a, b)' = a' - trunc(a / b) b'``.  The result is typed (f32) and
folded where a factor is 0 or 1.  It refers to ``e``'s own sub-expression objects at every
rule (a DAG of O(size) distinct nodes whose tree is O(size x depth));
:func:`flashgen.codegen.cuda_expr.cuda_expr` renders each shared node once.
"""

from __future__ import annotations

from flashgen.frontend.ir import Binary, Call, Causal, Cond, Const, Expr, Index, Ty, Unary, Var

ZERO = Const(0.0, ty=Ty.F32)
ONE = Const(1.0, ty=Ty.F32)


def _is(e: Expr, v: float) -> bool:
    return isinstance(e, Const) and e.ty != Ty.BOOL and float(e.value) == v


def _f(e: Expr) -> Expr:
    """``e`` as an f32 expression (int constants become float constants)."""
    if isinstance(e, Const) and e.ty == Ty.I32:
        return Const(float(e.value), ty=Ty.F32)
    return e


def add(a: Expr, b: Expr) -> Expr:
    if _is(a, 0):
        return _f(b)
    if _is(b, 0):
        return _f(a)
    return Binary("+", a, b, ty=Ty.F32)


def sub(a: Expr, b: Expr) -> Expr:
    if _is(b, 0):
        return _f(a)
    if _is(a, 0):
        return neg(b)
    return Binary("-", a, b, ty=Ty.F32)


def mul(a: Expr, b: Expr) -> Expr:
    if _is(a, 0) or _is(b, 0):
        return ZERO
    if _is(a, 1):
        return _f(b)
    if _is(b, 1):
        return _f(a)
    return Binary("*", a, b, ty=Ty.F32)


def div(a: Expr, b: Expr) -> Expr:
    if _is(a, 0):
        return ZERO
    if _is(b, 1):
        return _f(a)
    return Binary("/", a, b, ty=Ty.F32)


def neg(a: Expr) -> Expr:
    if _is(a, 0):
        return ZERO
    return Unary("-", a, ty=Ty.F32)


def cond(c: Expr, a: Expr, b: Expr) -> Expr:
    if a == b:
        return a
    return Cond(c, _f(a), _f(b), ty=Ty.F32)


def depends_on_score(e: Expr) -> bool:
    """True if ``score`` occurs in ``e``."""
    from flashgen.frontend.ir import walk

    return any(isinstance(n, Var) and n.name == "score" for n in walk(e))


def d_dscore(e: Expr) -> Expr:
    """Typed f32 expression for d e / d score (``e`` typed by the checker)."""
    if not depends_on_score(e):
        return ZERO
    if isinstance(e, Var):  # only `score` reaches here
        return ONE
    if isinstance(e, (Const, Causal, Index)):
        return ZERO
    if isinstance(e, Unary):
        return neg(d_dscore(e.arg)) if e.op == "-" else ZERO
    if isinstance(e, Binary):
        a, b = e.lhs, e.rhs
        da, db = d_dscore(a), d_dscore(b)
        if e.op == "+":
            return add(da, db)
        if e.op == "-":
            return sub(da, db)
        if e.op == "*":
            return add(mul(da, b), mul(a, db))
        if e.op == "/":
            # (a/b)' = a'/b - a b' / b^2
            return sub(div(da, b), div(mul(a, db), mul(b, b)))
        if e.op == "%":
            trunc = Binary("/", a, b, ty=Ty.F32)
            q = Call("trunc", (trunc,), ty=Ty.F32)
            return sub(da, mul(q, db))
        return ZERO  # comparisons and logic: piecewise constant
    if isinstance(e, Cond):
        return cond(e.cond, d_dscore(e.then), d_dscore(e.other))
    if isinstance(e, Call):
        a = e.args[0]
        da = d_dscore(a)
        if e.fn == "exp":
            return mul(e, da)
        if e.fn == "log":
            return div(da, a)
        if e.fn == "tanh":
            return mul(sub(ONE, mul(e, e)), da)
        if e.fn == "sqrt":
            return div(da, mul(Const(2.0, ty=Ty.F32), e))
        if e.fn == "abs":
            sign = Cond(
                Binary("<", a, Const(0, ty=Ty.I32), ty=Ty.BOOL),
                Const(-1.0, ty=Ty.F32),
                ONE,
                ty=Ty.F32,
            )
            return mul(sign, da)
        if e.fn in ("min", "max"):
            b = e.args[1]
            db = d_dscore(b)
            pick_a = Binary("<=" if e.fn == "min" else ">=", a, b, ty=Ty.BOOL)
            return cond(pick_a, da, db)
    raise TypeError(f"cannot differentiate {e!r}")
