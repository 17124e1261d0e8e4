"""Affine score_mods: ``score + L`` with L affine in ``q_idx`` and ``kv_idx``.

A score_mod whose top-level sum is ``score`` (coefficient exactly +1, e.g. ``score + L``,
``L + score``, ``score - L``, ``score - L1 + L2``) plus terms that do not read ``score``,
where those terms together are ``L = alpha * q_idx + beta * kv_idx + gamma`` with alpha,
beta, gamma CTA-invariant (constants, scalar params, ``seqlen_q``, ``seqlen_k``, ``b``,
``h``, ``h_kv``, and tensor params indexed only by those), decomposes per key tile at n0:

    x = score + L(q_idx, kv_idx) = x' + d,   x' = score + beta * (kv_idx - n0),
                                             d  = L(q_idx, n0)   (one per row and tile)

so the forward kernel computes ``x'`` with one FFMA per element (``beta * (kv_idx - n0)``
is the same for every row of the tile) and folds ``d`` into the row max and the exp2's
FFMA (ALiBi: ``score - slopes[h] * (q_idx + seqlen_k - seqlen_q - kv_idx)``, beta =
``slopes[h]``).  Pure IR analysis (no CUDA text): :func:`decompose` returns the typed
expressions L and beta; :mod:`flashgen.codegen` renders them.

``L`` is rebuilt from the score-free terms of the sum (each kept whole), so it evaluates
as the score_mod does up to float rounding order.  Integer ``/`` and ``%``, calls and
conditionals are affine only where they read no index variable (then they are part of a
coefficient); a product needs one CTA-invariant factor; a float ``/`` a CTA-invariant
divisor.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashgen.frontend.ir import Binary, Causal, Const, Expr, Spec, Ty, Unary, Var, children, walk

#: Index variables that are constant over one CTA (one batch, head and query block).
CTA_VARS = frozenset({"b", "h", "h_kv", "seqlen_q", "seqlen_k"})
#: The per-element index variables an affine L may read linearly.
LINEAR_VARS = ("q_idx", "kv_idx")


@dataclass(frozen=True)
class Affine:
    """``score_mod == score + offset`` (up to rounding order), with ``offset`` affine:
    ``offset(q_idx, kv_idx) == offset(q_idx, n0) + kv_coef * (kv_idx - n0)``.

    ``offset``: the score-free terms of the score_mod's sum, rebuilt as one typed expression
    (I32 or F32).  ``kv_coef``: the coefficient of ``kv_idx`` (typed, CTA-invariant; ``0``
    where L does not read ``kv_idx``).  ``q_coef``: the coefficient of ``q_idx`` (tests)."""

    offset: Expr
    kv_coef: Expr
    q_coef: Expr


def is_score(e: Expr, spec: Spec) -> bool:
    """Whether ``e`` is the ``score`` variable (not a param of that name)."""
    return isinstance(e, Var) and e.name == "score" and spec.param(e.name) is None


def _reads_score(e: Expr, spec: Spec) -> bool:
    return any(is_score(n, spec) for n in walk(e))


def cta_invariant(e: Expr, spec: Spec) -> bool:
    """Whether ``e`` is constant over a CTA: constants, scalar params, :data:`CTA_VARS` and
    tensor params indexed by those (no ``q_idx``, ``kv_idx``, ``score`` or ``causal``)."""
    for n in walk(e):
        if isinstance(n, Causal):
            return False
        if isinstance(n, Var) and n.name not in CTA_VARS:
            p = spec.param(n.name)
            if p is None or p.kind != "scalar":
                return False
    return True


# ----------------------------------------------------------------------------- typed builders
def _ty(*es: Expr) -> Ty:
    return Ty.F32 if any(e.ty == Ty.F32 for e in es) else Ty.I32


def _const(v, ty: Ty) -> Const:
    return Const(float(v) if ty == Ty.F32 else int(v), ty=ty)


def _is_const(e: Expr | None, v) -> bool:
    return isinstance(e, Const) and e.ty != Ty.BOOL and e.value == v


def _neg(e: Expr | None) -> Expr | None:
    if e is None:
        return None
    if isinstance(e, Const):
        return _const(-e.value, e.ty)
    if isinstance(e, Unary) and e.op == "-":
        return e.arg
    return Unary("-", e, ty=e.ty)


def _to_f32(e: Expr) -> Expr:
    """An I32 ``e`` converted to float (``e * 1.0``: the IR has no cast node; the lowering
    converts the int operand and the compiler folds the exact ``* 1.0f``)."""
    if isinstance(e, Const):
        return _const(e.value, Ty.F32)
    return Binary("*", e, _const(1.0, Ty.F32), ty=Ty.F32)


def _promote(a: Expr | None, b: Expr | None, ty: Ty) -> tuple[Expr | None, Expr | None]:
    """``(a, b)`` with ``b`` converted to float where the source operation is F32 but both
    coefficients are I32 (the source combined them in float: in int they could wrap)."""
    if ty == Ty.F32 and a is not None and b is not None and a.ty == b.ty == Ty.I32:
        return a, _to_f32(b)
    return a, b


def _add(a: Expr | None, b: Expr | None, op: str = "+") -> Expr | None:
    if b is None:
        return a
    if a is None:
        return b if op == "+" else _neg(b)
    return Binary(op, a, b, ty=_ty(a, b))


def _mul(a: Expr, b: Expr | None, op: str = "*") -> Expr | None:
    """``a * b`` (or ``b / a`` for op "/": b's coefficient divided by the invariant a)."""
    if b is None:
        return None
    if op == "/":
        # a float division (the source's ``/`` is F32): an int coefficient (``kv_idx``'s 1)
        # over an int divisor would otherwise lower and evaluate as integer division
        if b.ty == Ty.I32 and a.ty == Ty.I32:
            b = _to_f32(b)
        return Binary("/", b, a, ty=Ty.F32)
    if isinstance(a, Const) and isinstance(b, Const):
        return _const(a.value * b.value, _ty(a, b))
    ty = _ty(a, b)
    for x, y in ((a, b), (b, a)):
        if y.ty == ty and _is_const(x, 1):
            return y
        if y.ty == ty and _is_const(x, -1):
            return _neg(y)
    return Binary("*", a, b, ty=_ty(a, b))


# ----------------------------------------------------------------------------- analysis
Linear = dict[str, Expr | None]  # "q_idx", "kv_idx", "1" -> coefficient (None: 0)


def linear(e: Expr, spec: Spec) -> Linear | None:
    """``e`` as ``{"q_idx": alpha, "kv_idx": beta, "1": gamma}`` with CTA-invariant typed
    coefficients (None for 0), or None where ``e`` is not affine in q_idx, kv_idx."""
    if cta_invariant(e, spec):
        return {"q_idx": None, "kv_idx": None, "1": e}
    if isinstance(e, Var) and e.name in LINEAR_VARS:
        out: Linear = {"q_idx": None, "kv_idx": None, "1": None}
        out[e.name] = _const(1, Ty.I32)
        return out
    if isinstance(e, Unary) and e.op == "-":
        inner = linear(e.arg, spec)
        return None if inner is None else {k: _neg(v) for k, v in inner.items()}
    if not isinstance(e, Binary):
        return None
    if e.op in ("+", "-"):
        lhs, rhs = linear(e.lhs, spec), linear(e.rhs, spec)
        if lhs is None or rhs is None:
            return None
        return {k: _add(*_promote(lhs[k], rhs[k], e.ty), e.op) for k in lhs}
    if e.op == "*":
        for inv, other in ((e.lhs, e.rhs), (e.rhs, e.lhs)):
            if cta_invariant(inv, spec):
                lin = linear(other, spec)
                if lin is None:
                    return None
                return {k: _mul(*_promote(inv, v, e.ty)) for k, v in lin.items()}
        return None
    if e.op == "/" and e.ty == Ty.F32 and cta_invariant(e.rhs, spec):
        lin = linear(e.lhs, spec)
        return None if lin is None else {k: _mul(e.rhs, v, "/") for k, v in lin.items()}
    return None


def through_difference(e: Expr, spec: Spec) -> bool:
    """Whether ``e`` reads ``q_idx`` and ``kv_idx`` only inside subtrees equal to
    ``c * (q_idx - kv_idx) + (CTA-invariant)`` for a nonzero constant ``c``: then, for one
    batch and head, ``e`` is a function of the diagonal ``kv_idx - q_idx`` alone (T5's
    relative table ``bias[h, min(max(kv_idx - q_idx, -128), 128) + 128]``).  A ``causal``
    node reads both positions outside any difference.

    Only an **integer** such subtree counts (int arithmetic wraps, a ring: ``3 * q_idx - 3 *
    kv_idx`` is ``3 * (q_idx - kv_idx)`` bit for bit).  A float one is not evaluated as a
    function of the difference: ``q_idx * 0.1 - kv_idx * 0.1`` rounds each product apart, and
    ``(q_idx + 0.1) - (kv_idx + 0.1)`` each sum, so two pairs on one diagonal differ in the
    last bits; it is looked into instead (``(q_idx - kv_idx) * 0.1`` holds: the int difference
    first, exact as a float below 2^24)."""
    if any(isinstance(n, Causal) for n in walk(e)):
        return False
    if not ({n.name for n in walk(e) if isinstance(n, Var)} & set(LINEAR_VARS)):
        return True
    lin = linear(e, spec) if e.ty == Ty.I32 else None
    if lin is not None:
        a, b = lin["q_idx"], lin["kv_idx"]
        return (isinstance(a, Const) and isinstance(b, Const) and a.value != 0
                and a.value == -b.value)  # fmt: skip
    if isinstance(e, Var):  # q_idx or kv_idx alone
        return False
    return all(through_difference(c, spec) for c in children(e))


def _additive_terms(e: Expr, spec: Spec, sign: int = 1) -> list[tuple[int, Expr]] | None:
    """The signed terms of ``e``'s top-level sum, descending only into the +, - and unary -
    nodes that read ``score``; None where ``score`` sits anywhere else."""
    if is_score(e, spec):
        return [(sign, e)]
    if not _reads_score(e, spec):
        return [(sign, e)]
    if isinstance(e, Unary) and e.op == "-":
        return _additive_terms(e.arg, spec, -sign)
    if isinstance(e, Binary) and e.op in ("+", "-"):
        lhs = _additive_terms(e.lhs, spec, sign)
        rhs = _additive_terms(e.rhs, spec, sign if e.op == "+" else -sign)
        return None if lhs is None or rhs is None else lhs + rhs
    return None


def decompose(score_mod: Expr | None, spec: Spec) -> Affine | None:
    """The :class:`Affine` form of ``score_mod``, or None where it has none (``score``'s
    coefficient is not exactly +1, ``score`` appears inside another operation, or the
    other terms are not affine in q_idx, kv_idx with CTA-invariant coefficients)."""
    if score_mod is None or score_mod.ty != Ty.F32:
        return None
    terms = _additive_terms(score_mod, spec)
    if terms is None:
        return None
    scores = [(s, t) for s, t in terms if is_score(t, spec)]
    rest = [(s, t) for s, t in terms if not is_score(t, spec)]
    if len(scores) != 1 or scores[0][0] != 1 or not rest:
        return None
    offset: Expr | None = None
    for s, t in rest:
        # the score_mod adds each term to a float (score's sum): two int terms are not summed
        # in int, where they could wrap (q_idx * 1000000 + kv_idx * 500000)
        if offset is not None and offset.ty == Ty.I32 and t.ty == Ty.I32:
            t = _to_f32(t)
        offset = _add(offset, t, "+" if s > 0 else "-")
    lin = linear(offset, spec)
    if lin is None:
        return None
    zero = _const(0, Ty.I32)
    return Affine(offset=offset, kv_coef=lin["kv_idx"] or zero, q_coef=lin["q_idx"] or zero)
