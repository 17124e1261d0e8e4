"""Mask analysis: classify (query tile, key tile) pairs as empty, full or partial.

Interval arithmetic over the typed mask IR (Cousot & Cousot's abstract interpretation
with the interval domain): every integer/float sub-expression is evaluated to a range
``[lo, hi]`` that contains all its values over the tile, every boolean to the pair
(can be true, can be false).  A tile whose mask cannot be true is EMPTY (the kernel need
not load it), one whose mask cannot be false is FULL (no mask needs evaluating), the rest
are PARTIAL.  The analysis is sound: EMPTY and FULL are only claimed when they hold for
every element; imprecision only ever turns a tile PARTIAL.

Inside a tile the index variables range over the tile (``q_idx`` in ``[q0, q1]``,
``kv_idx`` in ``[k0, k1]``); ``b``, ``h``, ``h_kv``, ``seqlen_q``, ``seqlen_k`` and scalar params
are exact.  Tensor reads are unknown (any value), so masks that read tensors (document
masking) classify as PARTIAL here and need a data-dependent pre-pass instead.

This is the host-side, pure-Python form (for tests, FLOP counting and block tables);
the kernels evaluate the same rules per tile through the C++ classifier that
:mod:`flashgen.analysis.masktiles` emits.  No torch, no GPU.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from enum import IntEnum

from flashgen.frontend.ir import (
    SCORE_VAR,
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

INF = math.inf


class TileClass(IntEnum):
    EMPTY = 0
    PARTIAL = 1
    FULL = 2


@dataclass(frozen=True)
class Range:
    """All values lie in [lo, hi] (may be infinite)."""

    lo: float
    hi: float

    @staticmethod
    def exact(v) -> Range:
        return Range(v, v)

    @property
    def is_exact(self) -> bool:
        return self.lo == self.hi


ANY = Range(-INF, INF)


@dataclass(frozen=True)
class Truth:
    """What a boolean expression can evaluate to over the tile."""

    can_true: bool
    can_false: bool


MAYBE = Truth(True, True)


def _i32(r: Range, is_int: bool) -> Range:
    """An integer result that may leave int32 is unknown: the kernels compute in C int,
    where it would wrap (or worse), so no bound on it is sound."""
    if is_int and (r.lo < -(2**31) or r.hi > 2**31 - 1):
        return ANY
    return r


#: float32 rounding: the kernels evaluate a mask's f32 math in float, this analysis in double.
#: A float result's range is widened by these fractions of its magnitude (plus a subnormal
#: step), so the float the kernel computes lies inside and no comparison claims EMPTY or
#: FULL on a rounding (``kv_idx * 1.1 + 0.6 <= q_idx`` did at (q 335, kv 304)).  Basic ops
#: and sqrt: 2 ulps (an FMA, a hoisted reciprocal); expf/logf: 4; tanh.approx.f32: 2^-10.
F32_REL = 2.0**-22
F32_REL_EXPLOG = 2.0**-21
F32_REL_TANH = 2.0**-10
_TINY = 1e-37


def _fl(r: Range, rel: float = F32_REL) -> Range:
    """``r`` widened to hold its float32 evaluation (``fg::iv::fl``)."""
    if math.isnan(r.lo) or math.isnan(r.hi):
        return ANY
    lo = r.lo if math.isinf(r.lo) else r.lo - abs(r.lo) * rel - _TINY
    hi = r.hi if math.isinf(r.hi) else r.hi + abs(r.hi) * rel + _TINY
    return Range(lo, hi)


def _fl_int(r: Range) -> Range:
    """An int range converted to float (``fg::iv::fl_int``): exact up to 2^24."""
    return r if abs(r.lo) <= 2.0**24 and abs(r.hi) <= 2.0**24 else _fl(r)


def f32_exact(v: float) -> bool:
    """Whether the float literal ``v`` is a float32 value (0.5 is, 0.1 is not)."""
    return struct.unpack("f", struct.pack("f", v))[0] == v


def _corners(op, a: Range, b: Range) -> Range:
    vals = []
    for x in (a.lo, a.hi):
        for y in (b.lo, b.hi):
            try:
                v = op(x, y)
            except (ZeroDivisionError, OverflowError, ValueError):
                return ANY
            if isinstance(v, float) and math.isnan(v):
                return ANY
            vals.append(v)
    return Range(min(vals), max(vals))


def _mul(x, y):
    if x == 0 or y == 0:  # 0 * inf counts as 0: the finite factor is exactly 0
        return 0
    return x * y


def _trunc_div(x, y):
    if math.isinf(x) or math.isinf(y):
        return x / y
    q = abs(x) // abs(y)
    return q if (x >= 0) == (y > 0) else -q


def _mod(a: Range, b: Range, is_int: bool) -> Range:
    """C fmod / % (sign of the dividend)."""
    if not b.is_exact or b.lo == 0 or math.isinf(b.lo):
        return ANY
    c = abs(b.lo)
    if is_int and a.lo >= 0 and not math.isinf(a.hi) and a.lo // c == a.hi // c:
        return Range(a.lo % c, a.hi % c)
    if is_int and a.hi <= 0 and not math.isinf(a.lo) and (-a.hi) // c == (-a.lo) // c:
        return Range(-((-a.lo) % c), -((-a.hi) % c))
    edge = c - 1 if is_int else c
    lo = 0 if a.lo >= 0 else -edge
    hi = 0 if a.hi <= 0 else edge
    return Range(lo, hi)


def _monotone(fn, a: Range, domain_lo: float = -INF) -> Range:
    if a.lo < domain_lo:
        return ANY
    try:
        return Range(fn(a.lo), fn(a.hi))
    except (OverflowError, ValueError):
        return ANY


def _exp(x):
    return math.exp(x) if x < 700 else INF


def _log(x):
    return -INF if x == 0 else math.log(x)


def evaluate(e: Expr, env: dict) -> Range | Truth:
    """Abstract value of a typed expression; ``env`` maps names to Range (numbers)."""
    if isinstance(e, Const):
        if e.ty == Ty.BOOL:
            return Truth(bool(e.value), not bool(e.value))
        if e.ty == Ty.F32 and not f32_exact(float(e.value)):
            return _fl(Range.exact(e.value))  # 0.1 is 0.1f in the kernels
        return Range.exact(e.value)
    if isinstance(e, Causal):
        lhs = evaluate(
            Binary(
                "-",
                Binary("+", Var("q_idx", ty=Ty.I32), Var("seqlen_k", ty=Ty.I32), ty=Ty.I32),
                Var("seqlen_q", ty=Ty.I32),
                ty=Ty.I32,
            ),
            env,
        )
        return _compare(">=", lhs, env["kv_idx"])
    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, Index):
        return MAYBE if e.ty == Ty.BOOL else ANY
    if isinstance(e, Unary):
        a = evaluate(e.arg, env)
        if e.op == "!":
            return Truth(a.can_false, a.can_true)
        return _i32(Range(-a.hi, -a.lo), e.ty == Ty.I32)
    if isinstance(e, Binary):
        a, b = evaluate(e.lhs, env), evaluate(e.rhs, env)
        if e.op == "&&":
            return Truth(a.can_true and b.can_true, a.can_false or b.can_false)
        if e.op == "||":
            return Truth(a.can_true or b.can_true, a.can_false and b.can_false)
        if Ty.F32 in (e.lhs.ty, e.rhs.ty):  # the int side is converted to float
            a = _fl_int(a) if e.lhs.ty == Ty.I32 else a
            b = _fl_int(b) if e.rhs.ty == Ty.I32 else b
        if e.op in ("<", "<=", ">", ">=", "==", "!="):
            return _compare(e.op, a, b)
        is_int = e.lhs.ty == Ty.I32 and e.rhs.ty == Ty.I32
        rnd = (lambda r: r) if is_int else _fl  # a float op rounds its result
        if e.op == "+":
            return _i32(rnd(Range(a.lo + b.lo, a.hi + b.hi)), is_int)
        if e.op == "-":
            return _i32(rnd(Range(a.lo - b.hi, a.hi - b.lo)), is_int)
        if e.op == "*":
            return _i32(rnd(_corners(_mul, a, b)), is_int)
        if e.op == "/":
            if b.lo <= 0 <= b.hi:
                return ANY
            # INT_MIN / -1 wraps (to INT_MIN in the kernels and the reference)
            return _i32(rnd(_corners(_trunc_div if is_int else (lambda x, y: x / y), a, b)), is_int)
        if e.op == "%":
            return _mod(a, b, is_int)  # fmodf is exact
    if isinstance(e, Cond):
        c = evaluate(e.cond, env)
        t = evaluate(e.then, env) if c.can_true else None
        o = evaluate(e.other, env) if c.can_false else None
        if e.ty == Ty.F32:  # an int branch is converted to float
            t = _fl_int(t) if t is not None and e.then.ty == Ty.I32 else t
            o = _fl_int(o) if o is not None and e.other.ty == Ty.I32 else o
        if t is None:
            return o
        if o is None:
            return t
        if isinstance(t, Truth):
            return Truth(t.can_true or o.can_true, t.can_false or o.can_false)
        return Range(min(t.lo, o.lo), max(t.hi, o.hi))
    if isinstance(e, Call):
        args = [evaluate(x, env) for x in e.args]
        if e.ty == Ty.F32:  # int arguments are converted to float
            args = [_fl_int(r) if x.ty == Ty.I32 else r for r, x in zip(args, e.args, strict=True)]
        a = args[0]
        if e.fn == "abs":  # abs(INT_MIN) wraps to INT_MIN
            if a.lo >= 0:
                return a
            if a.hi <= 0:
                return _i32(Range(-a.hi, -a.lo), e.ty == Ty.I32)
            return _i32(Range(0, max(-a.lo, a.hi)), e.ty == Ty.I32)
        if e.fn == "min":
            return Range(min(a.lo, args[1].lo), min(a.hi, args[1].hi))
        if e.fn == "max":
            return Range(max(a.lo, args[1].lo), max(a.hi, args[1].hi))
        if e.fn == "exp":
            return _fl(_monotone(_exp, a), F32_REL_EXPLOG)
        if e.fn == "log":
            return _fl(_monotone(_log, a, 0.0), F32_REL_EXPLOG)
        if e.fn == "sqrt":
            return _fl(_monotone(math.sqrt, a, 0.0))
        if e.fn == "tanh":
            return _fl(_monotone(math.tanh, a), F32_REL_TANH)
        if e.fn == "trunc":
            return _monotone(math.trunc, a) if not math.isinf(a.lo + a.hi) else ANY
    raise TypeError(f"cannot analyse {e!r}")


def _compare(op: str, a: Range | Truth, b: Range | Truth) -> Truth:
    if isinstance(a, Truth):  # bool == bool, bool != bool
        eq = Truth(
            (a.can_true and b.can_true) or (a.can_false and b.can_false),
            (a.can_true and b.can_false) or (a.can_false and b.can_true),
        )
        return eq if op == "==" else Truth(eq.can_false, eq.can_true)
    if op == "<":
        return Truth(a.lo < b.hi, a.hi >= b.lo)
    if op == "<=":
        return Truth(a.lo <= b.hi, a.hi > b.lo)
    if op == ">":
        return Truth(a.hi > b.lo, a.lo <= b.hi)
    if op == ">=":
        return Truth(a.hi >= b.lo, a.lo < b.hi)
    overlap = a.lo <= b.hi and b.lo <= a.hi
    same = a.is_exact and b.is_exact and a.lo == b.lo
    if op == "==":
        return Truth(overlap, not same)
    return Truth(not same, overlap)


#: The largest int32: sizes (``seqlen_q``, ``batch``, ...) are int32, indices lie below them.
I32_MAX = 2**31 - 1


def static_env(spec: Spec) -> dict:
    """Interval environment of every call (:func:`evaluate`): the index variables as the
    kernels define them (clamped: ``0 <= q_idx < seqlen_q``, ``0 <= h < heads_q``, ...; any
    int32 size), scalar params within their declared ``min`` / ``max`` (``above`` /
    ``below`` are stored as those; the op refuses other values,
    :func:`flashgen.ops.validation.check_scalar`) or else their whole type, ``score`` any.
    An f32 param's bound is widened to its float32 rounding where it is no float32 value
    (:func:`f32_bound`): the op checks the value in double, the kernel receives it rounded."""
    below = Range(0, I32_MAX - 1)  # an index below an int32 extent
    env = {n: below for n in ("b", "h", "h_kv", "q_idx", "kv_idx")}
    env["seqlen_q"] = env["seqlen_k"] = Range(0, I32_MAX)
    env[SCORE_VAR] = Range(-INF, INF)
    for p in spec.scalar_params:
        if p.ty == Ty.I32:
            # int() truncates toward zero: never tighter than the integers the bound admits
            lo = -(2**31) if p.minimum is None else int(p.minimum)
            hi = I32_MAX if p.maximum is None else int(p.maximum)
            env[p.name] = Range(lo, hi)
        else:
            lo = -INF if p.minimum is None else f32_bound(float(p.minimum), lower=True)
            hi = INF if p.maximum is None else f32_bound(float(p.maximum), lower=False)
            env[p.name] = Range(lo, hi)
    return env


#: The largest finite float32.
F32_MAX = float.fromhex("0x1.fffffep+127")


def f32_bound(v: float, *, lower: bool) -> float:
    """A declared f32 param bound ``v`` (a double) as a bound of the values a kernel may
    receive: rounding to float32 is monotone, so a value ``x >= v`` arrives as
    ``f32(x) >= f32(v)``, which may lie half an ulp below ``v`` (``min: 0.7``: 0.699999988);
    the lower bound is the smaller of ``v`` and ``f32(v)``, the upper one the larger (the
    reference computes with ``x`` itself).  Beyond the float32 range: unbounded."""
    if not abs(v) <= F32_MAX:
        return -INF if lower else INF
    r = struct.unpack("f", struct.pack("f", v))[0]
    return min(v, r) if lower else max(v, r)


def tile_env(
    spec: Spec,
    q_range,
    kv_range,
    *,
    b: int,
    h: int,
    seqlen_q: int,
    seqlen_k: int,
    params: dict | None = None,
    h_kv: int | None = None,
) -> dict:
    """The abstract environment of one tile: ranges of the index variables and params
    (``h_kv``: the KV head query head ``h`` reads, ``h // (num_heads // num_heads_kv)``;
    None means ``h``, no GQA)."""
    env = {
        "q_idx": Range(*q_range),
        "kv_idx": Range(*kv_range),
        "b": Range.exact(b),
        "h": Range.exact(h),
        "h_kv": Range.exact(h if h_kv is None else h_kv),
        "seqlen_q": Range.exact(seqlen_q),
        "seqlen_k": Range.exact(seqlen_k),
    }
    params = params or {}
    for p in spec.scalar_params:
        env[p.name] = Range.exact(params.get(p.name, p.default))
    return env


def classify(spec: Spec, q_range, kv_range, **kw) -> TileClass:
    """Class of the tile ``q_idx in q_range``, ``kv_idx in kv_range`` (inclusive bounds).

    ``kw``: ``b``, ``h``, ``seqlen_q``, ``seqlen_k``, ``params`` (scalar param values;
    defaults from the spec) and optionally ``h_kv`` (default ``h``: no GQA).  No mask means FULL.
    """
    if spec.mask is None:
        return TileClass.FULL
    t = evaluate(spec.mask, tile_env(spec, q_range, kv_range, **kw))
    if not t.can_true:
        return TileClass.EMPTY
    return TileClass.PARTIAL if t.can_false else TileClass.FULL


def constant_over(spec: Spec, exprs, q_range, kv_range, **kw) -> bool:
    """Whether each int expression of ``exprs`` (a param read's subscripts) takes one value
    over the tile ``q_idx in q_range``, ``kv_idx in kv_range`` (inclusive bounds): its range is
    a single point.  ``kw`` as :func:`classify`'s.  Sound (true only where it holds on every
    pair); the host form of :func:`flashgen.analysis.masktiles.constant_source`."""
    env = tile_env(spec, q_range, kv_range, **kw)
    return all(evaluate(e, env).is_exact for e in exprs)


def tile_classes(
    spec: Spec,
    seqlen_q: int,
    seqlen_k: int,
    block_m: int,
    block_n: int,
    *,
    b: int = 0,
    h: int = 0,
    params: dict | None = None,
    h_kv: int | None = None,
) -> list[list[TileClass]]:
    """Classes of every (query block, key block) of one (batch, head): rows are query
    blocks of ``block_m``, columns key blocks of ``block_n`` (the last ones ragged)."""
    out = []
    for q0 in range(0, seqlen_q, block_m):
        row = []
        q1 = min(q0 + block_m, seqlen_q) - 1
        for k0 in range(0, seqlen_k, block_n):
            k1 = min(k0 + block_n, seqlen_k) - 1
            row.append(
                classify(
                    spec,
                    (q0, q1),
                    (k0, k1),
                    b=b,
                    h=h,
                    h_kv=h_kv,
                    seqlen_q=seqlen_q,
                    seqlen_k=seqlen_k,
                    params=params,
                )
            )
        out.append(row)
    return out


def density(
    spec: Spec, seqlen_q: int, seqlen_k: int, block_m: int = 128, block_n: int = 64, **kw
) -> tuple[float, float]:
    """(fraction of tiles that are not EMPTY, fraction that are FULL) for one (b, h)."""
    classes = [
        c for row in tile_classes(spec, seqlen_q, seqlen_k, block_m, block_n, **kw) for c in row
    ]
    n = max(len(classes), 1)
    return (
        sum(c != TileClass.EMPTY for c in classes) / n,
        sum(c == TileClass.FULL for c in classes) / n,
    )
