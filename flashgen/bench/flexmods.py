"""flashgen IR -> FlexAttention ``score_mod`` / ``mask_mod`` functions (for benchmarks).

:func:`flex_mods` turns a spec's ``score_mod`` and ``mask`` into the two Python callables
``torch.nn.attention.flex_attention`` takes (``h`` is the query head; the DSL's ``h_kv`` is
``h // group``, :func:`flex_mods`' argument)::

    score_mod(score, b, h, q_idx, kv_idx) -> float tensor     (score: the scaled logit)
    mask_mod(b, h, q_idx, kv_idx) -> bool tensor               (True = keep the pair)

Semantics are the flashgen (= FlexAttention) ones: ``score_mod`` rewrites the logit
after scaling, ``mask`` removes pairs, ``causal`` is bottom-right aligned, integer
``/`` and ``%`` truncate toward zero as in C.  ``seqlen_q``/``seqlen_k`` and scalar params
are baked in as Python numbers; tensor params are captured tensors indexed with the
index arguments (FlexAttention supports captured buffers).  Constants stay Python
scalars so the functions trace under ``torch.compile`` without creating tensors; the
same functions also work on broadcasting index tensors (tests compare them with
:mod:`flashgen.ops.cpu.reference`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

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
)

Env = dict
Fn = Callable[[Env], object]


def _is_t(x) -> bool:
    return isinstance(x, torch.Tensor)


def _float(x):
    if _is_t(x):
        return x if x.is_floating_point() else x.to(torch.float32)
    return float(x)


def _logical(op: str, a, b):
    if not _is_t(a) and not _is_t(b):
        return (a and b) if op == "&&" else (a or b)
    if not _is_t(a):  # python bool with a tensor: short-circuit algebra
        a, b = b, a
    if not _is_t(b):
        if op == "&&":
            return a if b else torch.zeros_like(a, dtype=torch.bool)
        return torch.ones_like(a, dtype=torch.bool) if b else a
    return (a & b) if op == "&&" else (a | b)


def _trunc_div(a, b):
    if _is_t(a) or _is_t(b):
        if not _is_t(a):
            a = torch.full_like(b, a)
        return torch.div(a, b, rounding_mode="trunc")
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _fmod(a, b):
    if _is_t(a):
        return torch.fmod(a, b)
    if _is_t(b):
        return torch.fmod(torch.full_like(b, a), b)
    return math.fmod(a, b) if isinstance(a, float) or isinstance(b, float) else int(math.fmod(a, b))


def _minmax(fn: str, a, b):
    if not _is_t(a) and not _is_t(b):
        return min(a, b) if fn == "min" else max(a, b)
    if not _is_t(a):
        a, b = b, a
    if not _is_t(b):
        return torch.clamp(a, max=b) if fn == "min" else torch.clamp(a, min=b)
    if a.dtype != b.dtype:
        a, b = _float(a), _float(b)
    return torch.minimum(a, b) if fn == "min" else torch.maximum(a, b)


_UNARY_F = {"exp": (torch.exp, math.exp), "log": (torch.log, math.log)}
_UNARY_F.update(tanh=(torch.tanh, math.tanh), sqrt=(torch.sqrt, math.sqrt))


def _compile(e: Expr, spec: Spec) -> Fn:
    """A closure evaluating ``e`` given env (index args, ``score``, seqlens, params)."""
    if isinstance(e, Const):
        cast = {Ty.BOOL: bool, Ty.F32: float}.get(e.ty, int)
        val = cast(e.value)
        return lambda env: val
    if isinstance(e, Causal):
        return lambda env: env["q_idx"] + (env["seqlen_k"] - env["seqlen_q"]) >= env["kv_idx"]
    if isinstance(e, Var):
        name = e.name
        return lambda env: env[name]
    if isinstance(e, Index):
        name = e.name
        idx = [_compile(i, spec) for i in e.indices]
        return lambda env: env[name][tuple(i(env) for i in idx)]
    if isinstance(e, Unary):
        arg = _compile(e.arg, spec)
        if e.op == "!":
            return lambda env: torch.logical_not(a) if _is_t(a := arg(env)) else not a
        return lambda env: -arg(env)
    if isinstance(e, Binary):
        lhs, rhs, op = _compile(e.lhs, spec), _compile(e.rhs, spec), e.op
        if op in ("&&", "||"):
            return lambda env: _logical(op, lhs(env), rhs(env))
        floaty = Ty.F32 in (e.lhs.ty, e.rhs.ty)
        if floaty:
            l0, r0 = lhs, rhs
            lhs = lambda env: _float(l0(env))  # noqa: E731
            rhs = lambda env: _float(r0(env))  # noqa: E731
        if op == "/":
            if floaty:
                return lambda env: lhs(env) / rhs(env)
            return lambda env: _trunc_div(lhs(env), rhs(env))
        if op == "%":
            return lambda env: _fmod(lhs(env), rhs(env))
        fn = {
            "+": lambda a, b: a + b,
            "-": lambda a, b: a - b,
            "*": lambda a, b: a * b,
            "<": lambda a, b: a < b,
            "<=": lambda a, b: a <= b,
            ">": lambda a, b: a > b,
            ">=": lambda a, b: a >= b,
            "==": lambda a, b: a == b,
            "!=": lambda a, b: a != b,
        }[op]
        return lambda env: fn(lhs(env), rhs(env))
    if isinstance(e, Cond):
        c, t, o = _compile(e.cond, spec), _compile(e.then, spec), _compile(e.other, spec)
        floaty = e.ty == Ty.F32

        def cond(env):
            cv, tv, ov = c(env), t(env), o(env)
            if floaty:
                tv, ov = _float(tv), _float(ov)
            if not _is_t(cv):
                return tv if cv else ov
            if not _is_t(tv) and not _is_t(ov):
                ref = cv.to(torch.float32 if floaty else torch.int64)
                tv, ov = torch.full_like(ref, tv), torch.full_like(ref, ov)
            return torch.where(cv, tv, ov)

        return cond
    if isinstance(e, Call):
        args = [_compile(a, spec) for a in e.args]
        fn_name = e.fn
        if fn_name in ("min", "max"):
            if e.ty == Ty.F32:
                return lambda env: _minmax(fn_name, _float(args[0](env)), _float(args[1](env)))
            return lambda env: _minmax(fn_name, args[0](env), args[1](env))
        if fn_name == "abs":
            if e.ty == Ty.F32:
                return lambda env: torch.abs(x) if _is_t(x := _float(args[0](env))) else abs(x)
            return lambda env: torch.abs(x) if _is_t(x := args[0](env)) else abs(x)
        t_fn, m_fn = _UNARY_F[fn_name]
        return lambda env: t_fn(x) if _is_t(x := _float(args[0](env))) else m_fn(x)
    raise TypeError(f"cannot translate {e!r} to a FlexAttention function")


def flex_mods(
    spec: Spec, seqlen_q: int, seqlen_k: int, params: dict | None = None, group: int = 1
) -> tuple[Callable | None, Callable | None]:
    """``(score_mod, mask_mod)`` for ``spec`` at fixed sequence lengths (None where absent).

    ``params`` maps the spec's param names to values: scalars default to the declared
    value; tensor params (required) are float32/int64 tensors on the device of q.
    ``group``: query heads per KV head (``num_heads // num_heads_kv``; FlexAttention hands
    the mods the query head ``h``, and the DSL's ``h_kv`` is ``h // group``).
    A spec's ``sink`` is no mod (FlexAttention's softmax has no extra logit): join it to
    ``flex_attention(..., return_lse=True)``'s output with :func:`flashgen.apply_sink`.
    Raises ``ValueError`` for a missing tensor param or a ``group`` below 1.
    """
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(
            f"group: expected a positive int (num_heads // num_heads_kv), got {group!r}"
        )
    base: dict = {"seqlen_q": int(seqlen_q), "seqlen_k": int(seqlen_k)}
    params = dict(params or {})
    for p in spec.params:
        val = params.get(p.name, p.default)
        if p.kind == "tensor":
            if val is None:
                raise ValueError(f"tensor param '{p.name}' is required")
            val = val.to(torch.float32 if p.ty == Ty.F32 else torch.int64)
        elif p.ty == Ty.I32:
            val = int(val)
        else:
            val = float(val)
        base[p.name] = val

    score_mod = mask_mod = None
    if spec.score_mod is not None:
        f = _compile(spec.score_mod, spec)

        def score_mod(score, b, h, q_idx, kv_idx):
            env = dict(
                base,
                score=score,
                b=b,
                h=h,
                h_kv=h if group == 1 else h // group,
                q_idx=q_idx,
                kv_idx=kv_idx,
            )
            out = f(env)
            return out if _is_t(out) else torch.full_like(score, out)

    if spec.mask is not None:
        g = _compile(spec.mask, spec)

        def mask_mod(b, h, q_idx, kv_idx):
            out = g(
                dict(
                    base, b=b, h=h, h_kv=h if group == 1 else h // group, q_idx=q_idx, kv_idx=kv_idx
                )
            )
            if _is_t(out):
                return out
            return torch.full_like(q_idx + kv_idx, bool(out), dtype=torch.bool)

    return score_mod, mask_mod


def mask_uses_batch_or_head(spec: Spec) -> bool:
    """Whether the mask reads ``b``, ``h``, ``h_kv`` or a tensor param (the block mask then
    needs B, H)."""
    from flashgen.frontend.ir import walk

    if spec.mask is None:
        return False
    return any(
        (isinstance(n, Var) and n.name in ("b", "h", "h_kv")) or isinstance(n, Index)
        for n in walk(spec.mask)
    )
