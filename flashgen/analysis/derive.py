"""Symbolic differentiation of DSL expressions with respect to ``score`` and to params.

The backward pass needs d score_mod / d score at every (q_idx, kv_idx) to chain the
softmax gradient through the score_mod (FlexAttention's score_mod backward), and, for a
param that requires grad, d score_mod / d param[idx] to accumulate ``dparam[idx] = sum
over (b, h, q_idx, kv_idx) of dS * d score_mod / d param[idx]``
(:func:`param_grad_terms`).  This module derives both from the typed IR, so the CUDA
lowering and the PyTorch ops get the same derivatives.  Pure Python; no torch.

Rules: constants, index variables and every leaf other than the variable have
derivative 0; sum, product, quotient and chain rules; ``c ? a : b`` ->
``c ? a' : b'``; ``abs(a)' = (a < 0 ? -1 : 1) a'``; ``min/max`` follow the selected
argument; ``fmod(a, b)' = a' - trunc(a / b) b'``.  The result is typed (f32) and
folded where a factor is 0 or 1.  It refers to ``e``'s own sub-expression objects at every
rule (a DAG of O(size) distinct nodes whose tree is O(size x depth));
:func:`flashgen.codegen.cuda_expr.cuda_expr` renders each shared node once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flashgen.frontend.ir import (
    Binary,
    Call,
    Causal,
    Cond,
    Const,
    Expr,
    Index,
    Spec,
    Ty,
    Unary,
    Var,
    walk,
)

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


def _is_score(e: Expr) -> bool:
    return isinstance(e, Var) and e.name == "score"


def depends_on_score(e: Expr) -> bool:
    """True if ``score`` occurs in ``e``."""
    return any(_is_score(n) for n in walk(e))


def d_dscore(e: Expr) -> Expr:
    """Typed f32 expression for d e / d score (``e`` typed by the checker)."""
    return derivative(e, _is_score)


def derivative(e: Expr, is_var: Callable[[Expr], bool]) -> Expr:
    """Typed f32 expression for d e / d x, where x is the leaf (a :class:`Var` or an
    :class:`Index` read) for which ``is_var`` is true: every such node is the same
    variable, every other leaf is constant.  Comparisons and conditions are piecewise
    constant (derivative 0 almost everywhere).  An integer-typed factor may remain
    (``slopes[h] * (q_idx - kv_idx)`` gives ``q_idx - kv_idx``): evaluate it as f32."""
    if not any(is_var(n) for n in walk(e)):
        return ZERO
    if isinstance(e, (Var, Index)):
        return ONE if is_var(e) else ZERO
    if isinstance(e, (Const, Causal)):
        return ZERO
    d = lambda x: derivative(x, is_var)  # noqa: E731
    if isinstance(e, Unary):
        return neg(d(e.arg)) if e.op == "-" else ZERO
    if isinstance(e, Binary):
        a, b = e.lhs, e.rhs
        da, db = d(a), d(b)
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
        return cond(e.cond, d(e.then), d(e.other))
    if isinstance(e, Call):
        a = e.args[0]
        da = d(a)
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
            db = d(b)
            pick_a = Binary("<=" if e.fn == "min" else ">=", a, b, ty=Ty.BOOL)
            return cond(pick_a, da, db)
    raise TypeError(f"cannot differentiate {e!r}")


# ----------------------------------------------------------------------------- params
@dataclass(frozen=True)
class ParamGradTerm:
    """One read of a param and the derivative of an expression with respect to it.

    ``indices``: the read's subscripts (i32 expressions of the index variables; ``()`` for
    a scalar param); ``partial``: d expr / d ``param[indices]`` (f32, may read ``score``
    and the index variables).  The gradient of the param is the sum over the terms of
    ``dS * partial`` scattered to ``param[indices]``, over every (b, h, q_idx, kv_idx)
    pair (a sink's terms: over every (b, h) row, see :func:`sink_grad_terms`)."""

    param: str
    indices: tuple[Expr, ...]
    partial: Expr


def param_grad_terms(e: Expr | None, name: str) -> tuple[ParamGradTerm, ...]:
    """The :class:`ParamGradTerm` of each distinct read of param ``name`` in ``e`` (reads
    with equal subscripts are one element, so one term); ``()`` when ``e`` is None or does
    not read ``name``."""
    if e is None:
        return ()
    reads: list[Expr] = []
    for n in walk(e):
        if isinstance(n, (Var, Index)) and n.name == name and n not in reads:
            reads.append(n)
    terms = []
    for r in reads:
        partial = derivative(e, lambda n, r=r: isinstance(n, (Var, Index)) and n == r)
        if not _is(partial, 0):
            terms.append(ParamGradTerm(name, r.indices if isinstance(r, Index) else (), partial))
    return tuple(terms)


def reads_param(e: Expr | None, name: str) -> bool:
    """True if ``e`` reads param ``name`` (as a scalar or as a tensor)."""
    return e is not None and any(
        isinstance(n, (Var, Index)) and n.name == name for n in walk(e)
    )


def grad_refusal(spec: Spec, name: str) -> str | None:
    """Why param ``name`` of ``spec`` has no gradient (a sentence naming it), or None when
    it has one: an f32 param that the score_mod or the sink reads.  An i32 param and a
    param only the mask reads (a mask is piecewise constant) have none."""
    p = spec.param(name)
    if p is None:
        raise KeyError(name)
    if p.ty != Ty.F32:
        return f"param '{name}' is {p.ty.value} (integer): it has no gradient"
    if reads_param(spec.score_mod, name) or reads_param(getattr(spec, "sink", None), name):
        return None
    if reads_param(spec.mask, name):
        return (
            f"param '{name}' is read only by the mask, which keeps or drops pairs (piecewise "
            f"constant): it has no gradient"
        )
    return f"param '{name}' is read by neither the score_mod nor the sink: it has no gradient"


def differentiable_params(spec: Spec) -> tuple[str, ...]:
    """Names of the params of ``spec`` that have a gradient (:func:`grad_refusal`), in
    spec order."""
    return tuple(p.name for p in spec.params if grad_refusal(spec, p.name) is None)
