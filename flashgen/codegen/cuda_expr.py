"""DSL expressions -> CUDA C++ (:func:`cuda_expr`), kernel-invariant hoisting
(:class:`Invariants`), tensor-param reads, and the small IR helpers every kernel family's
planning shares (:func:`split_causal`, :func:`side_terms`).  Pure Python."""

from __future__ import annotations

import math
from collections.abc import Mapping

from flashgen.analysis import affine, rowcol
from flashgen.analysis.maskinfo import Range, evaluate, static_env
from flashgen.frontend import ir
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

_C_BINOPS = {"+", "-", "*", "/", "%", "<", "<=", ">", ">=", "==", "!=", "&&", "||"}
_F_CALLS = {
    "abs": "fabsf",
    "min": "fminf",
    "max": "fmaxf",
    "exp": "expf",
    "log": "logf",
    "tanh": "fg::tanh_approx",  # tanh.approx.f32: one MUFU op, rel. error ~2^-11 (as FA3's softcap)
    "sqrt": "sqrtf",
    "trunc": "truncf",  # only in derived (backward) expressions
}
_I_CALLS = {"abs": "abs", "min": "min", "max": "max"}
#: IEEE single operations nvcc never contracts into an FMA (used below comparisons).
_ROUNDED = {"+": "__fadd_rn", "-": "__fsub_rn", "*": "__fmul_rn"}
_C_TYPE = {Ty.I32: "int", Ty.F32: "float", Ty.BOOL: "bool"}


def _cast(code: str, frm: Ty | None, to: Ty) -> str:
    if frm == to:
        return code
    return f"(({_C_TYPE[to]})({code}))"


#: Float twins of the per-element index variables, which every kernel that renders DSL
#: expressions defines next to them (cheaply: a per-tile base plus a compile-time offset).
INDEX_F = {"q_idx": "q_idx_f", "kv_idx": "kv_idx_f"}


def _affine_int(e: Expr) -> bool:
    """An integer expression of only +, - (binary and unary), constants and names."""
    if isinstance(e, (Const, Var)):
        return e.ty == Ty.I32
    if isinstance(e, Unary):
        return e.op == "-" and _affine_int(e.arg)
    if isinstance(e, Binary):
        return e.op in ("+", "-") and _affine_int(e.lhs) and _affine_int(e.rhs)
    return False


def _signed_terms(e: Expr, sign: int = 1) -> list[tuple[int, Expr]]:
    """The constants and names of an :func:`_affine_int` ``e`` with their signs."""
    if isinstance(e, (Const, Var)):
        return [(sign, e)]
    if isinstance(e, Unary):
        return _signed_terms(e.arg, -sign)
    assert isinstance(e, Binary)
    return _signed_terms(e.lhs, sign) + _signed_terms(e.rhs, sign if e.op == "+" else -sign)


def _float_affine(e: Expr, spec: Spec) -> str | None:
    """``(float)(e)`` for an :func:`_affine_int` ``e`` that reads ``q_idx`` or ``kv_idx``,
    computed from the index variables' float twins: no int-to-float conversion per element
    (a conversion issues at a quarter of the FMA rate on sm_80/sm_90, as MUFU does).  The
    other terms are summed in int first and converted once (kernel- or row-invariant, so
    hoisted), then the twins are added in order: ALiBi's ``q_idx + seqlen_k - seqlen_q -
    kv_idx`` is ``(q_idx_f + (float)(seqlen_k - seqlen_q)) - kv_idx_f``, one FADD per element.
    Exact while the index variables, the int sum and each partial sum stay under 2^24 in
    magnitude (large params that cancel, as in ``q_idx + p - p``, stay exact).  ``None``
    without an index variable (a plain cast, hoisted by the compiler)."""
    terms = _signed_terms(e)
    idx = [(sg, n) for sg, n in terms if isinstance(n, Var) and n.name in INDEX_F]
    if not idx:
        return None
    rest = [(sg, n) for sg, n in terms if not (isinstance(n, Var) and n.name in INDEX_F)]
    idx.sort(key=lambda t: t[0] < 0)  # a positive twin first, if any
    sg, n = idx[0]
    out = INDEX_F[n.name] if sg > 0 else f"(-{INDEX_F[n.name]})"
    if rest:
        code = ""
        for i, (rs, rn) in enumerate(rest):
            term = _cuda_expr(rn, spec, None, False)
            code += (("-" if rs < 0 else "") if i == 0 else (" - " if rs < 0 else " + ")) + term
        out = f"({out} + ((float)({code})))"
    for sg, n in idx[1:]:
        out = f"({out} {'+' if sg > 0 else '-'} {INDEX_F[n.name]})"
    return out


#: Integer calls :func:`_float_int_call` computes on float twins, and their float forms.
_FLOAT_INT_CALLS = {"abs": "fabsf", "min": "fminf", "max": "fmaxf"}


def _float_int_call(e: Expr, spec: Spec) -> str | None:
    """``(float)(e)`` for an integer ``abs`` / ``min`` / ``max`` (``e``) of :func:`_affine_int`
    arguments, at least one reading ``q_idx`` or ``kv_idx``: the float call of the arguments'
    float forms (:func:`_float_affine`; an argument without an index variable is cast, a
    kernel- or row-invariant the compiler hoists).  ALiBi's ``abs(q_idx - kv_idx)`` becomes
    ``fabsf(q_idx_f - kv_idx_f)``: one FADD, the absolute value an operand modifier of the
    FFMA that uses it, instead of an IABS and an int-to-float conversion per element.
    Exact under the same bound as :func:`_float_affine` (every value under 2^24 in
    magnitude: the twins, their sums and the call's result are then integers a float holds
    exactly, and abs / min / max of exact values are exact).  ``None`` for anything else."""
    if not (isinstance(e, Call) and e.ty == Ty.I32 and e.fn in _FLOAT_INT_CALLS):
        return None
    if not all(_affine_int(a) for a in e.args):
        return None
    forms = [_float_affine(a, spec) for a in e.args]
    if all(f is None for f in forms):
        return None
    args = [
        f if f is not None else _cast(_cuda_expr(a, spec, None, False), Ty.I32, Ty.F32)
        for a, f in zip(e.args, forms, strict=True)
    ]
    return f"{_FLOAT_INT_CALLS[e.fn]}({', '.join(args)})"


class Invariants:
    """Kernel-invariant values that :func:`cuda_expr` hoists out of the per-element code: a
    divisor built only from constants and scalar params is computed once in the kernel's
    prologue (``decls``, rendered by the templates before their main loop), so a float
    ``x / d`` becomes ``x * (1 / d)`` (within an ulp of the division) and an integer one a
    multiply-high by ``fg::Divisor`` (exact).

    ``raw_score``: the name of the unscaled logit (q . k) in the kernel, where the template
    has one; then ``score * c`` and ``score / d`` (c, d invariant) become ``raw * (scale * c)``
    and ``raw * (scale / d)``: one multiply per element instead of two (softmax_scale folded
    into the invariant; within an ulp of the two roundings, and never where the value
    reaches a comparison, a float ``%`` or a ``trunc``).  ``nonneg_div``: an integer
    division whose operands are proven ``x >= 0``, ``d >= 1`` uses ``fg::Divisor::div_nn``
    (:func:`_nonneg_by_positive`).  ``float_calls``: an integer ``abs`` / ``min`` / ``max`` of
    affine index expressions in a float context is computed on the index variables' float
    twins (:func:`_float_int_call`) instead of converted per element."""

    def __init__(
        self, raw_score: str | None = None, nonneg_div: bool = False, float_calls: bool = False
    ) -> None:
        self.decls: list[str] = []
        self._names: dict[tuple[str, str], str] = {}
        self.raw_score = raw_score
        # an int x / d with x >= 0, d >= 1 proven lowers to fg::Divisor::div_nn
        # (_nonneg_by_positive; the Hopper forward only: the FA2-class one spilled with it)
        self.nonneg_div = nonneg_div
        self.float_calls = float_calls

    def add(self, ctype: str, init: str) -> str:
        """The name of a ``const ctype name(init);`` prologue value, declared once."""
        key = (ctype, init)
        if key not in self._names:
            self._names[key] = name = f"fg_inv{len(self._names)}"
            self.decls.append(f"const {ctype} {name}({init});")
        return self._names[key]

    @property
    def prologue(self) -> str:
        return "\n".join(self.decls)


def _kernel_invariant(e: Expr, spec: Spec) -> bool:
    """Whether ``e`` reads only constants and scalar params (no index, score or tensor)."""
    for n in ir.walk(e):
        if isinstance(n, Index) or isinstance(n, Causal):
            return False
        if isinstance(n, Var) and spec.param(n.name) is None:
            return False
    return True


def cuda_expr(
    e: Expr, spec: Spec, inv: Invariants | None = None, extents: Mapping[str, str] | None = None
) -> str:
    """Render a typed DSL expression as a CUDA C++ expression.

    Names map to kernel locals: index variables keep their names, ``score`` is the
    scaled logit, a scalar param ``x`` is ``p_x``, a tensor param ``t[i, j]`` reads
    ``t_t[i * (shape[1]) + j]`` (row-major, contiguous).  Integer ``/`` and ``%``
    truncate toward zero as in C, and give 0 for a zero divisor (``fg::idiv``/``imod``);
    the reference does the same.  With ``inv``, a divisor of constants and scalar params
    is hoisted into ``inv``'s prologue (see :class:`Invariants`), except that a float
    division whose value reaches a comparison, a float ``%`` or a ``trunc`` stays a
    division: ``x * (1 / d)`` may differ from ``x / d`` by an ulp, and a comparison turns
    that ulp into a different decision (``q_idx / 7.0 <= kv_idx`` at ``q_idx = 21``:
    3.0000002 against 3), a ``%`` or ``trunc`` into a whole unit (``(kv_idx / 41.0) % 1.0``
    at ``kv_idx = 41``: 0.99999994 against 0).

    Size: ``e`` may share sub-expressions (one node object under several parents: the
    derivative of :func:`flashgen.analysis.derive.d_dscore` refers to the score_mod's own
    sub-trees at every rule, so its tree grows as size times depth).  Each node is rendered
    once; where inlining every use would more than double the node count
    (:data:`INLINE_GROWTH`, :func:`shared_nodes`), the shared sub-expressions become
    ``const auto`` temporaries of an immediately invoked lambda,
    ``([&]() { const auto fg_sub0 = ...; return ...; }())``, so the text stays linear in
    the number of distinct nodes.  A tree (every parsed spec expression) renders inline,
    as it always did.

    ``extents``: the kernel's name of a tensor param's shape symbol where it is not the
    symbol's own (:func:`_shape_extent`): the decode kernels' ``seqlen_k`` is the request's
    live keys, a ``seqlen_k`` extent their cache's ``capacity``.
    """
    return _Lowering(spec, inv, shared_nodes(e), extents).render(e)


#: Largest ratio of an expression's tree size (shared sub-expressions counted at every use)
#: to its number of distinct nodes that :func:`cuda_expr` still renders inline.
INLINE_GROWTH = 2


def shared_nodes(e: Expr) -> frozenset[int]:
    """``id()`` of the sub-expressions of ``e`` that :func:`cuda_expr` renders as
    temporaries: none where the tree size of ``e`` is at most :data:`INLINE_GROWTH` times
    its number of distinct node objects, otherwise every node with operands that has more
    than one parent edge.  Linear in the distinct nodes (no recursion)."""
    nodes: dict[int, Expr] = {id(e): e}
    uses: dict[int, int] = {}
    stack = [e]
    while stack:
        for c in ir.children(stack.pop()):
            uses[id(c)] = uses.get(id(c), 0) + 1
            if id(c) not in nodes:
                nodes[id(c)] = c
                stack.append(c)
    size: dict[int, int] = {}
    todo: list[tuple[Expr, bool]] = [(e, False)]
    while todo:
        n, ready = todo.pop()
        if id(n) in size:
            continue
        if ready:
            size[id(n)] = 1 + sum(size[id(c)] for c in ir.children(n))
        else:
            todo.append((n, True))
            todo.extend((c, False) for c in ir.children(n) if id(c) not in size)
    if size[id(e)] <= INLINE_GROWTH * len(nodes):
        return frozenset()
    return frozenset(i for i, n in nodes.items() if uses.get(i, 0) > 1 and ir.children(n))


_COMPARE = {"<", "<=", ">", ">=", "==", "!="}


def _exact_operands(e: Expr) -> bool:
    """Whether ``e`` turns an ulp of its operands into a different decision or a whole unit:
    a comparison, a float ``%`` (``fmodf(0.99999994, 1)`` against ``fmodf(1, 1)``) or a
    ``trunc``.  Float divisions below it stay divisions: neither ``x * (1 / d)`` nor the
    softmax_scale fold (``41 * (1 / 41.0f)`` is 0.99999994)."""
    if isinstance(e, Binary):
        return e.op in _COMPARE or (e.op == "%" and Ty.F32 in (e.lhs.ty, e.rhs.ty))
    return isinstance(e, Call) and e.fn == "trunc"


def _cuda_expr(e: Expr, spec: Spec, inv: Invariants | None, compared: bool) -> str:
    """``e`` lowered on its own (no temporaries), ``compared``: below a comparison."""
    return _Lowering(spec, inv, frozenset()).expr(e, compared)


class _Lowering:
    """One :func:`cuda_expr` call: each (node, context) is rendered once (``memo``; the
    context is whether the node's value reaches a comparison, :func:`_exact_operands`),
    and the nodes in ``shared`` (:func:`shared_nodes`) become temporaries (``temps``,
    in dependency order: a node's operands are rendered before it)."""

    def __init__(
        self,
        spec: Spec,
        inv: Invariants | None,
        shared: frozenset[int],
        extents: Mapping[str, str] | None = None,
    ) -> None:
        self.spec = spec
        self.extents = extents
        self.inv = inv
        self.shared = shared
        # (id(node), compared) -> (node, code); the node is kept so that its id stays its own
        self.memo: dict[tuple[int, bool], tuple[Expr, str]] = {}
        self.temps: list[str] = []
        self.names: dict[str, str] = {}  # a temporary's code -> its name

    def render(self, e: Expr) -> str:
        """The CUDA expression of ``e``: inline, or the temporaries and the result in an
        immediately invoked lambda (one line: the templates paste it into expressions)."""
        code = self.expr(e, False)
        if not self.temps:
            return code
        return f"([&]() {{ {' '.join(self.temps)} return {code}; }}())"

    def expr(self, e: Expr, compared: bool) -> str:
        """Code of ``e`` (a temporary's name where ``e`` is shared), rendered once."""
        key = (id(e), compared)
        hit = self.memo.get(key)
        if hit is not None:
            return hit[1]
        code = self._node(e, compared)
        if id(e) in self.shared:
            name = self.names.get(code)
            if name is None:  # the same code in both contexts: one temporary
                name = self.names[code] = f"fg_sub{len(self.temps)}"
                self.temps.append(f"const auto {name} = {code};")
            code = name
        self.memo[key] = (e, code)
        return code

    def _node(self, e: Expr, compared: bool) -> str:
        spec, inv = self.spec, self.inv

        def cuda_expr(x: Expr, spec: Spec) -> str:  # an operand of e, in e's context
            return self.expr(x, compared or _exact_operands(e))

        def as_float(x: Expr, code: str) -> str:
            twins = _float_affine(x, spec) if x.ty == Ty.I32 and _affine_int(x) else None
            if twins is None and inv is not None and inv.float_calls:
                twins = _float_int_call(x, spec)
            return twins if twins is not None else _cast(code, x.ty, Ty.F32)

        if isinstance(e, Const):
            if e.ty == Ty.BOOL:
                return "true" if e.value else "false"
            if e.ty == Ty.F32:
                v = float(e.value)
                if math.isinf(v):
                    return "(-INFINITY)" if v < 0 else "INFINITY"
                return f"{v!r}f"
            return f"{int(e.value)}"
        if isinstance(e, Causal):
            return "(q_idx + seqlen_k - seqlen_q >= kv_idx)"
        if isinstance(e, Var):
            p = spec.param(e.name)
            return f"p_{e.name}" if p is not None else e.name
        if isinstance(e, Index):
            return _tensor_read(e, spec, lambda ix: cuda_expr(ix, spec), self.extents)
        if isinstance(e, Unary):
            return f"({e.op}{cuda_expr(e.arg, spec)})"
        if isinstance(e, Binary):
            assert e.op in _C_BINOPS
            if inv is not None and inv.raw_score and not compared and e.op in ("*", "/"):
                folded = _fold_scale(e, spec, inv, lambda x: as_float(x, cuda_expr(x, spec)))
                if folded is not None:
                    return folded
            lt, rt = e.lhs.ty, e.rhs.ty
            lhs, rhs = cuda_expr(e.lhs, spec), cuda_expr(e.rhs, spec)
            if e.op in ("&&", "||"):
                # Both sides evaluated where neither reads memory (any DSL expression is safe to
                # evaluate: reads are clamped, division by zero is defined): no branch per element,
                # and common terms stay visible to CSE.  A side with a tensor read short-circuits
                # (its loads are skipped where the other side decides, and need fewer registers).
                if any(isinstance(n, Index) for side in (e.lhs, e.rhs) for n in ir.walk(side)):
                    return f"({lhs} {e.op} {rhs})"
                return f"({lhs} {'&' if e.op == '&&' else '|'} {rhs})"
            hoist = inv is not None and _kernel_invariant(e.rhs, spec)
            if Ty.F32 in (lt, rt):  # mixed arithmetic / comparison promotes to float
                lhs, rhs = as_float(e.lhs, lhs), as_float(e.rhs, rhs)
                if e.op == "%":
                    return f"fmodf({lhs}, {rhs})"
                if e.op == "/" and hoist and not compared:  # one reciprocal, a multiply per element
                    return f"({lhs} * {inv.add('float', f'1.0f / {rhs}')})"
                if compared and e.op in _ROUNDED:
                    # no FMA contraction where an ulp becomes a decision: nvcc fuses `a * b + c`
                    # into one rounding where the reference rounds twice (`kv_idx * 0.6 + 0.6 <=
                    # q_idx` at kv_idx 639: 384.00003 unfused, 384 fused)
                    return f"{_ROUNDED[e.op]}({lhs}, {rhs})"
            elif e.op in ("/", "%") and not (isinstance(e.rhs, Const) and e.rhs.value != 0):
                # integer division by a run-time value: x / 0 and x % 0 are 0 (defined, as in the
                # reference), not C's undefined behaviour
                if hoist:
                    fn = "div" if e.op == "/" else "mod"
                    if inv.nonneg_div and _nonneg_by_positive(e, spec):
                        fn += "_nn"
                    return f"{inv.add('fg::Divisor', rhs)}.{fn}({lhs})"
                return f"fg::{'idiv' if e.op == '/' else 'imod'}({lhs}, {rhs})"
            return f"({lhs} {e.op} {rhs})"
        if isinstance(e, Cond):
            then, other = cuda_expr(e.then, spec), cuda_expr(e.other, spec)
            if e.ty == Ty.F32:
                then, other = as_float(e.then, then), as_float(e.other, other)
            return f"({cuda_expr(e.cond, spec)} ? {then} : {other})"
        if isinstance(e, Call):
            if e.ty == Ty.I32:
                return f"{_I_CALLS[e.fn]}({', '.join(cuda_expr(a, spec) for a in e.args)})"
            args = ", ".join(as_float(a, cuda_expr(a, spec)) for a in e.args)
            return f"{_F_CALLS[e.fn]}({args})"
        raise TypeError(f"cannot lower {e!r}")


#: The index variable the kernels keep inside each shape symbol: ``0 <= h < heads_q`` etc.
_OWN_INDEX = {
    "batch": "b",
    "num_heads": "h",
    "num_heads_kv": "h_kv",
    "seqlen_q": "q_idx",
    "seqlen_k": "kv_idx",
}
_I32_MAX = 2**31 - 1


#: Interval environment of every call (:func:`flashgen.analysis.maskinfo.static_env`).
_static_env = static_env


def _nonneg_by_positive(e: Binary, spec: Spec) -> bool:
    """Whether the int division ``e`` provably has ``lhs >= 0`` and ``rhs >= 1`` at every
    call (:func:`flashgen.analysis.maskinfo.evaluate` over :func:`_static_env`): then
    ``fg::Divisor::div_nn`` (a multiply-high and a shift: ``kv_idx / chunk``) replaces the
    signed ``div`` (about 7 instructions).  Used where :class:`Invariants` has
    ``nonneg_div`` (the Hopper forward's option of that name)."""
    env = _static_env(spec)
    try:
        a, b = evaluate(e.lhs, env), evaluate(e.rhs, env)
    except (TypeError, KeyError, ValueError):
        return False
    return isinstance(a, Range) and isinstance(b, Range) and a.lo >= 0 and b.lo >= 1


def index_in_bounds(ix: Expr, dim, spec: Spec) -> bool:
    """Whether tensor subscript ``ix`` provably lies in ``[0, extent)`` of its dimension
    ``dim`` (a declared extent: an int or a shape symbol) at every call, so the kernels
    need not clamp it: the index variable of that very dimension (``h`` into ``num_heads``,
    ``kv_idx`` into ``seqlen_k``, ...: the kernels keep those inside already), or, for a
    literal extent, an interval bound (:func:`flashgen.analysis.maskinfo.evaluate` over
    :func:`_static_env`) inside ``[0, extent - 1]`` (``min(max(kv_idx - q_idx, -128), 128)
    + 128`` into 257).  Sound, not complete: ``False`` keeps the clamp."""
    if ix.ty != Ty.I32:
        return False
    if isinstance(dim, str):
        own = _OWN_INDEX.get(dim)
        return isinstance(ix, Var) and ix.name == own and spec.param(ix.name) is None
    r = evaluate(ix, _static_env(spec))
    return isinstance(r, Range) and 0 <= r.lo and r.hi <= dim - 1


def _tile_invariant(e: Expr, spec: Spec) -> bool:
    """Whether ``e`` reads only b, h, h_kv, seqlen_q, seqlen_k, params and constants (a
    subscript of the read's hoisted base offset): :func:`flashgen.analysis.affine.cta_invariant`
    without nested tensor reads."""
    return affine.cta_invariant(e, spec) and not any(isinstance(n, Index) for n in ir.walk(e))


def _peel_constant(ix: Expr, spec: Spec) -> tuple[Expr, int] | None:
    """``(x, c)`` for an int subscript ``x + c``, ``c + x`` or ``x - c`` (c a literal)."""
    if not (isinstance(ix, Binary) and ix.op in ("+", "-")):
        return None
    if isinstance(ix.rhs, Const) and ix.rhs.ty == Ty.I32:
        return ix.lhs, int(ix.rhs.value) if ix.op == "+" else -int(ix.rhs.value)
    if ix.op == "+" and isinstance(ix.lhs, Const) and ix.lhs.ty == Ty.I32:
        return ix.rhs, int(ix.lhs.value)
    return None


def _tensor_read(e: Index, spec: Spec, render, extents: Mapping[str, str] | None = None) -> str:
    """``t_<name>[offset]`` for the tensor read ``e`` (row-major, contiguous); ``render``
    gives a subscript's CUDA code.

    A subscript is clamped into its extent (``fg::clamp_index``) unless
    :func:`index_in_bounds` proves it inside: a read is never out of bounds (the reference
    refuses out-of-range indices at kept pairs; dropped pairs may compute any).  The offset
    splits in two: the subscripts of only tile-invariant values (b, h, h_kv, params) give a
    64-bit base the compiler hoists out of the element loop; the others (q_idx, kv_idx, ...)
    an int offset from it when their literal strides keep it inside int32 (each subscript is
    inside its extent, clamped or proven), so an element's address is one 32x32+64 multiply-
    add (``__ldg(fg::base_ptr(t_bias + (int64_t)h * 257 + 128) + idx)``: the base through a
    copy NVVM cannot re-associate into each element's offset, see ``templates/common/
    mma_sm80.cuh``) instead of 64-bit arithmetic per element.  With a base, a literal added
    to a proven subscript (T5's ``min(max(kv_idx - q_idx, -128), 128) + 128``) moves into
    the base too: one add less per element.  ``extents``: as :func:`cuda_expr`'s."""
    p = spec.param(e.name)
    assert p is not None and p.kind == "tensor"
    base: list[str] = []  # int64 terms
    # int terms: (code, stride, lo, hi, shift): the subscript times its literal stride and
    # the bounds of that product; and, where a literal can be peeled off a proven subscript,
    # the same without it (shift: the literal times the stride, moved into the base)
    elem: list[tuple[tuple, tuple | None]] = []
    wide = False  # a varying subscript with a symbolic stride: one 64-bit offset
    codes: list[str] = []  # each subscript's code, clamped where not proven inside
    env = _static_env(spec)
    for i, ix in enumerate(e.indices):
        dim = p.shape[i]
        code = render(ix)
        # an index variable is inside its own extent only where the kernel's bound of it is
        # that extent (decode's kv_idx runs to the live keys, its seqlen_k extent is capacity)
        own = not isinstance(dim, str) or _shape_extent(dim, extents) == _shape_extent(dim)
        inside = own and index_in_bounds(ix, dim, spec)
        if not inside:
            code = f"fg::clamp_index({code}, {_shape_extent(dim, extents)})"
        codes.append(code)
        rest = p.shape[i + 1 :]
        if _tile_invariant(ix, spec):
            stride = "".join(f" * (int64_t)({_shape_extent(d, extents)})" for d in rest)
            base.append(f"(int64_t)({code}){stride}")
            continue
        if all(isinstance(d, int) for d in rest):
            stride = math.prod(rest)
            top = (dim - 1 if isinstance(dim, int) else _I32_MAX - 1) * stride
            peeled = None
            if inside and isinstance(dim, int) and (pc := _peel_constant(ix, spec)):
                r = evaluate(ix, env)
                x, c = pc
                lo, hi = (int(r.lo) - c) * stride, (int(r.hi) - c) * stride
                peeled = (render(x), stride, lo, hi, c * stride)
            elem.append(((code, stride, 0, top, 0), peeled))
            continue
        wide = True

    def fits(terms) -> bool:
        return -(2**31) <= sum(t[2] for t in terms) and sum(t[3] for t in terms) <= _I32_MAX

    def int32(terms) -> str:
        return " + ".join(c if k == 1 else f"{c} * {k}" for c, k, *_ in terms)

    whole = [w for w, _ in elem]
    if wide or not fits(whole) or not elem:  # one 64-bit offset, row-major (Horner)
        offset = ""
        for i, code in enumerate(codes):
            term = f"(int64_t)({code})"
            ext = _shape_extent(p.shape[i], extents)
            offset = term if i == 0 else f"({offset}) * (int64_t)({ext}) + {term}"
        return f"t_{e.name}[{offset or '0'}]"
    if not base:
        return f"t_{e.name}[{int32(whole)}]"
    terms = [pl or w for w, pl in elem]
    shift = sum(t[4] for t in terms)
    if not fits(terms) or shift == 0:
        terms, shift = whole, 0
    offset = " + ".join(base) + (f" + {shift}" if shift else "")
    small = int32(terms)
    # a row base computed once per tile (fg::base_ptr), read through the read-only path
    return f"__ldg(fg::base_ptr(t_{e.name} + ({offset})) + ({small}))"


def _fold_scale(e: Binary, spec: Spec, inv: Invariants, as_float) -> str | None:
    """``score * c``, ``c * score`` or ``score / d`` with c, d invariant, as the raw logit
    times one hoisted value (softmax_scale folded in); None for any other product."""
    if affine.is_score(e.lhs, spec) and _kernel_invariant(e.rhs, spec):
        other = e.rhs
    elif e.op == "*" and affine.is_score(e.rhs, spec) and _kernel_invariant(e.lhs, spec):
        other = e.lhs
    else:
        return None
    op = "/" if e.op == "/" else "*"
    return f"({inv.raw_score} * {inv.add('float', f'softmax_scale {op} {as_float(other)}')})"


def _shape_extent(dim, extents: Mapping[str, str] | None = None) -> str:
    """CUDA expression for one declared tensor-param extent (``extents``: a kernel's own
    names for some shape symbols)."""
    if isinstance(dim, int):
        return str(dim)
    if extents and dim in extents:
        return extents[dim]
    return {
        "batch": "batch",
        "num_heads": "heads_q",
        "num_heads_kv": "heads_kv",
        "seqlen_q": "seqlen_q",
        "seqlen_k": "seqlen_k",
    }[dim]


def split_causal(mask: Expr | None) -> tuple[bool, Expr | None]:
    """Split ``mask`` into (causal, residual): ``causal`` if it is a top-level ``&&`` conjunct.

    The kernel turns the causal part into block skipping and evaluates only the residual
    elementwise.  ``mask: causal`` gives (True, None).
    """
    if mask is None:
        return False, None
    conj: list[Expr] = []

    def flatten(e: Expr) -> None:
        if isinstance(e, Binary) and e.op == "&&":
            flatten(e.lhs)
            flatten(e.rhs)
        else:
            conj.append(e)

    flatten(mask)
    causal = any(isinstance(c, Causal) for c in conj)
    rest = [c for c in conj if not isinstance(c, Causal)]
    residual: Expr | None = None
    for c in rest:
        residual = c if residual is None else Binary("&&", residual, c, ty=Ty.BOOL)
    return causal, residual


def _uses(e: Expr | None, names: set[str]) -> bool:
    if e is None:
        return False
    return any(isinstance(n, (Var, Index)) and n.name in names for n in ir.walk(e))



def side_terms(terms: tuple[rowcol.Term, ...], spec: Spec, inv: Invariants | None) -> list[dict]:
    """Template entries of :mod:`flashgen.analysis.rowcol` terms: the local's ``name`` and C type
    ``ctype``, ``store_t`` (the 32-bit type its values travel in: a bool as int, for warp
    shuffles) and ``code`` (in a scope that defines the side's index variable and its float
    twin)."""
    out = []
    for t in terms:
        ctype = _C_TYPE[t.ty]
        out.append(
            {
                "name": t.name,
                "ctype": ctype,
                "store_t": "int" if t.ty == Ty.BOOL else ctype,
                "code": cuda_expr(t.expr, spec, inv),
            }
        )
    return out


def causal_as_true(e: Expr) -> Expr:
    """``e`` with every ``causal`` replaced by the constant true."""
    if isinstance(e, Causal):
        return Const(True, ty=Ty.BOOL)
    kids = ir.children(e)
    if not kids:
        return e
    return rowcol._with_children(e, tuple(causal_as_true(k) for k in kids))


def float_expr(e: Expr, spec: Spec, inv: Invariants | None) -> str:
    """``e`` as a CUDA float expression: an int expression of +/- over index variables through
    their float twins (:data:`INDEX_F`), another int one cast, a float one as is."""
    code = cuda_expr(e, spec, inv)
    if e.ty == Ty.I32:
        twins = _float_affine(e, spec) if _affine_int(e) else None
        return twins if twins is not None else _cast(code, Ty.I32, Ty.F32)
    return code
