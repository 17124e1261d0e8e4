"""Mask analysis lowered to CUDA: a ``__host__ __device__`` tile classifier per spec.

:func:`classifier_source` turns the mask IR into straight-line C++ over the interval
helpers of ``templates/common/masktiles.cuh`` (namespace ``fg::iv``), one helper per rule
of :mod:`flashgen.analysis.maskinfo`, so the kernel classifies a tile exactly as the host analysis
does (same rules, double-precision bounds; sound: imprecision only ever gives PARTIAL)::

    int fg_tile_class(int q0, int q1, int k0, int k1, int b, int h, int h_kv,
                      int seqlen_q, int seqlen_k, <p_x for each scalar param>)
        -> fg::iv::EMPTY (0) | PARTIAL (1) | FULL (2)

for ``q_idx`` in ``[q0, q1]`` and ``kv_idx`` in ``[k0, k1]`` (inclusive, already clipped
to the sequence lengths); ``b``, ``h``, ``h_kv`` (the KV head ``h`` reads), the lengths
and scalar params are exact.  No mask:
the function returns FULL and the kernels' block searches fold away.

Tensor reads (``doc[q_idx]``) are unknown values here, so a mask that depends on them is
PARTIAL wherever the rest of the mask does not decide it.  Hook for a data-dependent
pre-pass (per-tile block tables built on the GPU): pass ``index_range`` to
:func:`classifier_source`, a function from an :class:`~flashgen.frontend.ir.Index` node to the C++
expression of its ``fg::iv::R`` range (or ``fg::iv::T`` truth) over the tile; the default
is ``fg::iv::any()``.  Alternatively intersect this function's result with a table's class
in the template (EMPTY wins, FULL needs both).

The host mirror is :func:`flashgen.analysis.maskinfo.classify`; tests compile this source for the
host with nvcc and compare it with that on grids.  No torch, no GPU.

``causal_bits=True`` (the Hopper forward) adds two flags to a PARTIAL class, for a mask
that contains ``causal``: ``fg::iv::CAUSAL_ONLY`` (4) when the mask equals ``causal`` on
every pair of the tile (the mask with ``causal`` replaced by true is FULL there and with
``causal`` replaced by false EMPTY: ``causal && r`` with ``r`` FULL, ``kv_idx < p ||
causal`` with ``kv_idx < p`` EMPTY), so the kernel evaluates the causal test alone, and
``fg::iv::NO_CAUSAL`` (8) when ``causal`` holds on every pair of the tile, so the kernel
evaluates the mask with ``causal`` replaced by true.  The subexpressions without
``causal`` are emitted once and shared by the three evaluations.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from flashgen.analysis.maskinfo import (
    F32_REL,
    F32_REL_EXPLOG,
    F32_REL_TANH,
    I32_MAX,
    Range,
    evaluate,
    f32_exact,
    static_env,
)
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

#: Name of the emitted function.
FUNCTION = "fg_tile_class"

_CMP = {"<": "lt", "<=": "le", ">": "gt", ">=": "ge", "==": "eq", "!=": "ne"}
_CALL = {
    "abs": "fabs_",
    "min": "min_",
    "max": "max_",
    "exp": "exp_",
    "log": "log_",
    "sqrt": "sqrt_",
    "tanh": "tanh_",
}
_IDX_VARS = {"b", "h", "h_kv", "seqlen_q", "seqlen_k"}
#: float32 rounding slack of a float result (maskinfo.F32_REL and friends, as C++ hex literals)
_REL = F32_REL.hex()
_CALL_REL = {
    "exp": F32_REL_EXPLOG.hex(),
    "log": F32_REL_EXPLOG.hex(),
    "sqrt": F32_REL.hex(),
    "tanh": F32_REL_TANH.hex(),
}


def classifier_params(spec: Spec) -> list[tuple[str, str]]:
    """(ctype, name) of the classifier's parameters, in order."""
    names = ("q0", "q1", "k0", "k1", "b", "h", "h_kv", "seqlen_q", "seqlen_k")
    out = [("int", n) for n in names]
    out += [("int" if p.ty == Ty.I32 else "float", f"p_{p.name}") for p in spec.scalar_params]
    return out


def classifier_call(spec: Spec, q0: str, q1: str, k0: str, k1: str) -> str:
    """C++ call of the classifier with the given tile bounds; the other arguments are the
    kernel's own names (``b``, ``h``, ``h_kv``, ``seqlen_q``, ``seqlen_k``, ``p_<name>``)."""
    rest = [name for _, name in classifier_params(spec)[4:]]
    return f"{FUNCTION}({', '.join([q0, q1, k0, k1, *rest])})"


def _double(v) -> str:
    v = float(v)
    if math.isinf(v):
        return "(-INFINITY)" if v < 0 else "INFINITY"
    return repr(v)


class _Emitter:
    def __init__(
        self,
        spec: Spec,
        index_range: Callable[[Index], str] | None,
        integer: bool = False,
        int32: bool = False,
    ):
        self.spec = spec
        self.index_range = index_range
        #: the namespace of ranges (R) and their rules, and the cast of an int into one
        self.ns, self.cast = ("fg::ivi", "(long long)") if integer else ("fg::iv", "(double)")
        if int32:
            self.ns, self.cast = "fg::iv32", "(int)"
        self.lines: list[str] = []
        self.n = 0
        # the truth a ``causal`` node takes (None: its interval test); subexpressions without
        # ``causal`` are memoized (by node identity) and shared across substitutions
        self.causal_as: str | None = None
        self.memo: dict[int, str] = {}
        self.static = static_env(spec)

    def may_be(self, e: Expr, value: int) -> bool:
        """Whether int ``e`` may take ``value`` at some call (its range over every call,
        :func:`flashgen.analysis.maskinfo.static_env`; True where that is unknown)."""
        try:
            r = evaluate(e, self.static)
        except (TypeError, KeyError, ValueError):
            return True
        return not isinstance(r, Range) or r.lo <= value <= r.hi

    def let(self, ty: str, code: str) -> str:
        name = f"e{self.n}"
        self.n += 1
        self.lines.append(f"    const {self.ns if ty == 'R' else 'fg::iv'}::{ty} {name} = {code};")
        return name

    def emit(self, e: Expr) -> str:
        """Name of a local holding ``e``'s range (R) or truth (T)."""
        name = self.memo.get(id(e))
        if name is None:
            name = self._emit(e)
            if not _has_causal(e):
                self.memo[id(e)] = name
        return name

    def _emit(self, e: Expr) -> str:
        if isinstance(e, Const):
            if e.ty == Ty.BOOL:
                return self.let("T", f"fg::iv::truth({'true' if e.value else 'false'})")
            if e.ty == Ty.F32 and not f32_exact(float(e.value)):  # 0.1 is 0.1f in the kernels
                return self.let("R", f"fg::iv::fl(fg::iv::exact({_double(e.value)}), {_REL})")
            if self.ns == "fg::ivi":
                return self.let("R", f"fg::ivi::exact({int(e.value)}ll)")
            if self.ns == "fg::iv32":
                return self.let("R", f"fg::iv32::exact({int(e.value)})")
            return self.let("R", f"fg::iv::exact({_double(e.value)})")
        ns, cast = self.ns, self.cast
        if isinstance(e, Causal):
            if self.causal_as is not None:
                return self.causal_as
            lhs = self.let("R", f"{ns}::exact({cast}seqlen_k - {cast}seqlen_q)")
            lhs = self.let("R", f"{ns}::add(q_r, {lhs})")
            return self.let("T", f"{ns}::ge({lhs}, kv_r)")
        if isinstance(e, Var):
            if e.name == "q_idx":
                return "q_r"
            if e.name == "kv_idx":
                return "kv_r"
            if e.name in _IDX_VARS:
                return self.let("R", f"{ns}::exact({cast}{e.name})")
            p = self.spec.param(e.name)
            if p is None or p.kind != "scalar":
                raise TypeError(f"cannot classify a mask reading {e.name!r}")
            return self.let("R", f"{ns}::exact({cast}p_{e.name})")
        if isinstance(e, Index):
            ty = "T" if e.ty == Ty.BOOL else "R"
            if self.index_range is not None:
                return self.let(ty, self.index_range(e))
            return self.let(ty, "fg::iv::maybe()" if ty == "T" else "fg::iv::any()")
        if isinstance(e, Unary):
            a = self.emit(e.arg)
            if e.op == "!":
                return self.let("T", f"fg::iv::lnot({a})")
            neg = f"{ns}::neg({a})"
            return self.let("R", f"{ns}::i32({neg})" if e.ty == Ty.I32 else neg)
        if isinstance(e, Binary):
            a, b = self.emit(e.lhs), self.emit(e.rhs)
            if e.op == "&&":
                return self.let("T", f"fg::iv::land({a}, {b})")
            if e.op == "||":
                return self.let("T", f"fg::iv::lor({a}, {b})")
            if Ty.F32 in (e.lhs.ty, e.rhs.ty):  # the int side is converted to float
                a = self.let("R", f"fg::iv::fl_int({a})") if e.lhs.ty == Ty.I32 else a
                b = self.let("R", f"fg::iv::fl_int({b})") if e.rhs.ty == Ty.I32 else b
            if e.op in _CMP:
                rule = "fg::iv" if e.lhs.ty == Ty.BOOL else ns  # bool == bool: truths
                return self.let("T", f"{rule}::{_CMP[e.op]}({a}, {b})")
            is_int = "true" if (e.lhs.ty == Ty.I32 and e.rhs.ty == Ty.I32) else "false"
            if e.op in ("+", "-", "*"):
                fn = {"+": "add", "-": "sub", "*": "mul"}[e.op]
                code = f"{ns}::{fn}({a}, {b})"
                if is_int == "true":
                    return self.let("R", f"{ns}::i32({code})")
                return self.let("R", f"fg::iv::fl({code}, {_REL})")  # a float op rounds
            if e.op == "/":
                code = f"{ns}::div({a}, {b}, {is_int})"
                if is_int == "false":
                    return self.let("R", f"fg::iv::fl({code}, {_REL})")
                # INT_MIN / -1 wraps (to INT_MIN in the kernels and the reference)
                wraps = self.may_be(e.lhs, -I32_MAX - 1) and self.may_be(e.rhs, -1)
                return self.let("R", f"{ns}::i32({code})" if wraps else code)
            if e.op == "%":
                return self.let("R", f"{ns}::mod({a}, {b}, {is_int})")
        if isinstance(e, Cond):
            c, t, o = self.emit(e.cond), self.emit(e.then), self.emit(e.other)
            if e.ty == Ty.F32:  # an int branch is converted to float
                t = self.let("R", f"fg::iv::fl_int({t})") if e.then.ty == Ty.I32 else t
                o = self.let("R", f"fg::iv::fl_int({o})") if e.other.ty == Ty.I32 else o
            if e.ty == Ty.BOOL:
                return self.let("T", f"fg::iv::cond({c}, {t}, {o})")
            return self.let("R", f"{ns}::cond({c}, {t}, {o})")
        if isinstance(e, Call) and e.fn in _CALL:
            names = [self.emit(a) for a in e.args]
            if e.ty == Ty.F32:  # int arguments are converted to float
                names = [
                    self.let("R", f"fg::iv::fl_int({n})") if a.ty == Ty.I32 else n
                    for n, a in zip(names, e.args, strict=True)
                ]
            code = f"{ns}::{_CALL[e.fn]}({', '.join(names)})"
            if e.ty == Ty.I32 and e.fn == "abs" and self.may_be(e.args[0], -I32_MAX - 1):
                # abs(INT_MIN) wraps to INT_MIN
                code = f"{ns}::i32({code})"
            rel = _CALL_REL.get(e.fn) if e.ty == Ty.F32 else None
            return self.let("R", code if rel is None else f"fg::iv::fl({code}, {rel})")
        raise TypeError(f"cannot classify {e!r}")


def _has_causal(e: Expr) -> bool:
    return any(isinstance(n, Causal) for n in walk(e))


def has_causal_bits(spec: Spec) -> bool:
    """Whether ``classifier_source(spec, causal_bits=True)`` can set CAUSAL_ONLY / NO_CAUSAL:
    the mask contains ``causal`` and something else."""
    return spec.mask is not None and _has_causal(spec.mask) and not isinstance(spec.mask, Causal)


def integer_only(spec: Spec) -> bool:
    """Whether every number ``spec``'s mask computes is an int32: no float, no tensor read,
    no call but ``abs`` / ``min`` / ``max`` (the classifier can then bound it on 64-bit
    integer ranges, :func:`classifier_source`'s ``integer``)."""
    return spec.mask is not None and _integer_expr(spec.mask)


def _integer_expr(e: Expr) -> bool:
    """Whether every number ``e`` computes is an int32 (:func:`integer_only`'s test)."""
    return all(
        n.ty != Ty.F32
        and not isinstance(n, Index)
        and (not isinstance(n, Call) or n.fn in ("abs", "min", "max"))
        for n in walk(e)
    )


def classifier_source(
    spec: Spec,
    *,
    index_range: Callable[[Index], str] | None = None,
    name: str = FUNCTION,
    causal_bits: bool = False,
    integer: bool = False,
) -> str:
    """C++ source of ``spec``'s tile classifier (needs ``masktiles.cuh`` before it).

    ``index_range``: see the module docstring (the pre-pass hook).  ``name``: the
    function's name (tests put several in one file).  ``causal_bits``: PARTIAL may carry
    ``CAUSAL_ONLY`` / ``NO_CAUSAL`` (module docstring; only where :func:`has_causal_bits`).
    ``integer``: where :func:`integer_only`, the ranges are 64-bit integers (``fg::ivi``:
    the same rules and classes, half the registers of the double ones); elsewhere it
    changes nothing.  Raises ``TypeError`` for an expression node the analysis does not
    know.
    """
    sig = ", ".join(f"{t} {n}" for t, n in classifier_params(spec))
    head = [
        f"// Tile class of spec {spec.name}'s mask (flashgen/analysis/masktiles.py; "
        "rules of maskinfo.py).",
        f"__host__ __device__ __forceinline__ int {name}({sig}) {{",
    ]
    if spec.mask is None:
        body = [
            "    (void)q0; (void)q1; (void)k0; (void)k1; (void)b; (void)h;",
            "    (void)seqlen_q; (void)seqlen_k;",
        ]
        body += [f"    (void)p_{p.name};" for p in spec.scalar_params]
        return "\n".join([*head, *body, "    return fg::iv::FULL;", "}", ""])
    em = _Emitter(spec, index_range, integer and integer_only(spec))
    ns, cast = em.ns, em.cast
    em.lines += [
        "    (void)b; (void)h; (void)seqlen_q; (void)seqlen_k;",
        *(f"    (void)p_{p.name};" for p in spec.scalar_params),
        f"    const {ns}::R q_r = {ns}::range({cast}q0, {cast}q1);",
        f"    const {ns}::R kv_r = {ns}::range({cast}k0, {cast}k1);",
        "    (void)q_r; (void)kv_r;",
    ]
    keep = em.emit(spec.mask)
    if not (causal_bits and has_causal_bits(spec)):
        return "\n".join([*head, *em.lines, f"    return fg::iv::tile_class({keep});", "}", ""])
    causal = em.emit(Causal())
    em.causal_as = em.let("T", "fg::iv::truth(true)")
    keep_t = em.emit(spec.mask)
    em.causal_as = em.let("T", "fg::iv::truth(false)")
    keep_f = em.emit(spec.mask)
    cls = f"fg::iv::tile_class({keep})"
    tail = [f"    return fg::iv::causal_bits({cls}, {causal}, {keep_t}, {keep_f});", "}", ""]
    return "\n".join([*head, *em.lines, *tail])


#: The ranges :func:`constant_source` computes on, by :func:`constant_ranges`, and the header
#: (under ``templates/common/``) that holds their rules besides ``masktiles.cuh``.
RANGE_HEADERS = {"int32": "masktiles_i32.cuh", "int64": "masktiles_int.cuh", "double": None}
#: The bound of an ``int32`` range: the int32 values whose negation is one too.
_I32_BOUND = 2**31 - 1


def constant_ranges(spec: Spec, exprs) -> str:
    """The ranges :func:`constant_source` bounds ``exprs`` on: ``"int32"`` (``fg::iv32``,
    ``masktiles_i32.cuh``: plain int arithmetic) where every number they compute is an int32
    (:func:`integer_only`'s test), no ``causal`` is among them and every int node's range over
    every call (:func:`flashgen.analysis.maskinfo.static_env`) lies in [-(2^31 - 1), 2^31 - 1]
    (the rules are inclusion-monotone: what they compute on a tile lies inside); else
    ``"int64"`` (``fg::ivi``) where every number is an int32; else ``"double"``."""
    if not all(_integer_expr(e) for e in exprs):
        return "double"
    env = static_env(spec)
    for e in exprs:
        for n in walk(e):
            if isinstance(n, Causal):
                return "int64"
            if n.ty != Ty.I32:
                continue
            try:
                r = evaluate(n, env)
            except (TypeError, KeyError, ValueError):
                return "int64"
            if not (isinstance(r, Range) and -_I32_BOUND <= r.lo and r.hi <= _I32_BOUND):
                return "int64"
    return "int32"


def constant_source(spec: Spec, exprs, name: str) -> str:
    """C++ source of a tile test by the classifier's interval rules (needs ``masktiles.cuh``
    before it, and the header of :func:`constant_ranges`' ranges, :data:`RANGE_HEADERS`)::

        bool name(int q0, int q1, int k0, int k1, int b, int h, int h_kv,
                  int seqlen_q, int seqlen_k, <p_x for each scalar param>)

    true when each int expression of ``exprs`` (a param read's subscripts) takes a single
    value for every ``q_idx`` in ``[q0, q1]`` and ``kv_idx`` in ``[k0, k1]`` (its range is one
    point; the other names exact, as :func:`classifier_source` takes them).  Sound, as the
    classes are: true only where every pair of the tile reads one element; imprecision (a
    tensor read, a rule that widens) only ever gives false.  On the ranges of
    :func:`constant_ranges`.  Expressions the rules do not know (a call
    the classifier has no rule for): false on every tile.  The host mirror is
    :func:`flashgen.analysis.maskinfo.constant_over`."""
    sig = ", ".join(f"{t} {n}" for t, n in classifier_params(spec))
    head = [
        f"// Whether every subscript of a param read of spec {spec.name} is one value over the "
        "tile (flashgen/analysis/masktiles.py, constant_source).",
        f"__host__ __device__ __forceinline__ bool {name}({sig}) {{",
    ]
    unused = [
        "    (void)b; (void)h; (void)h_kv; (void)seqlen_q; (void)seqlen_k;",
        *(f"    (void)p_{p.name};" for p in spec.scalar_params),
    ]
    ranges = constant_ranges(spec, exprs)
    em = _Emitter(spec, None, ranges == "int64", ranges == "int32")
    ns, cast = em.ns, em.cast
    em.lines += [
        *unused,
        f"    const {ns}::R q_r = {ns}::range({cast}q0, {cast}q1);",
        f"    const {ns}::R kv_r = {ns}::range({cast}k0, {cast}k1);",
        "    (void)q_r; (void)kv_r;",
    ]
    try:
        names = [em.emit(e) for e in exprs]
    except TypeError:
        body = [*unused, "    (void)q0; (void)q1; (void)k0; (void)k1;", "    return false;"]
    else:
        test = " && ".join(f"{n}.lo == {n}.hi" for n in names) or "true"
        body = [*em.lines, f"    return {test};"]
    return "\n".join([*head, *body, "}", ""])
