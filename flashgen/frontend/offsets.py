"""Global positions: the spec transform behind ``op.attention(..., q_offset=, kv_offset=)``.

A call on a slice of a longer sequence (a ring-attention step, a chunk of a prefill)
must evaluate the mask and the score_mod at the positions the rows have in the whole
sequence.  :func:`offsets_spec` rewrites a spec into ``<name>__offsets``: the same variant
with four more i32 scalar params (:data:`OFFSET_PARAMS`, reserved words a user param
cannot take) and expressions in global positions::

    q_idx    -> (q_idx + q_offset)          kv_idx   -> (kv_idx + kv_offset)
    seqlen_q -> seqlen_q_global             seqlen_k -> seqlen_k_global
    causal   -> (q_idx + q_offset) + seqlen_k_global - seqlen_q_global >= kv_idx + kv_offset

(``causal`` keeps its bottom-right alignment, now over the global lengths).  A tensor-param
subscript at a dim declared ``seqlen_q`` or ``seqlen_k`` is left as it is: such a tensor
is passed sliced like q (``seqlen_q``) or like k / v (``seqlen_k``), so it is read at the
local row (``doc_q[b, q_idx]``); every other subscript sees global positions
(``bias[h, kv_idx - q_idx + 128]`` reads the global distance).

The transformed spec is an ordinary spec: its forward, backward, varlen form, CPU path and
reference need nothing new, the tile classifier (:mod:`flashgen.analysis.masktiles`, and
its host mirror :func:`flashgen.analysis.maskinfo.classify`) sees ``q_offset`` and
``kv_offset`` as exact runtime values, so key blocks the mask excludes at the call's
offsets are never loaded, and kernels of untransformed specs are untouched.  The price:
the kernels' ``causal`` fast path (block skipping by the diagonal without a classifier
call) becomes the general masked path, as for any mask beyond plain causal.

Pure IR: no torch.
"""

from __future__ import annotations

from dataclasses import replace

from flashgen.frontend import ir
from flashgen.frontend.ir import Binary, Call, Causal, Cond, Expr, Index, Ty, Unary, Var

#: The params the offsets form adds, in order (all i32, minimum 0; the global lengths have
#: no default: :meth:`flashgen.ops.op.AttentionOp.attention` fills them in).
OFFSET_PARAMS = ("q_offset", "kv_offset", "seqlen_q_global", "seqlen_k_global")
#: Name suffix of the offsets form of a spec.
SUFFIX = "__offsets"
_SEQ_DIMS = ("seqlen_q", "seqlen_k")


def is_offsets_spec(spec: ir.Spec) -> bool:
    """Whether ``spec`` is the output of :func:`offsets_spec` (it declares the reserved
    ``q_offset`` param, which no checked user spec can)."""
    p = spec.param("q_offset")
    return p is not None and p.kind == "scalar" and spec.name.endswith(SUFFIX)


def _i32(name: str) -> Var:
    return Var(name, ty=Ty.I32)


def _add(a: Expr, b: Expr, span=ir.NO_SPAN) -> Binary:
    return Binary("+", a, b, span=span, ty=Ty.I32)


def global_causal(span=ir.NO_SPAN) -> Expr:
    """``causal`` at global positions: ``(q_idx + q_offset) + seqlen_k_global -
    seqlen_q_global >= kv_idx + kv_offset``."""
    q = _add(_i32("q_idx"), _i32("q_offset"), span)
    lhs = Binary(
        "-", _add(q, _i32("seqlen_k_global"), span), _i32("seqlen_q_global"), span=span, ty=Ty.I32
    )
    kv = _add(_i32("kv_idx"), _i32("kv_offset"), span)
    return Binary(">=", lhs, kv, span=span, ty=Ty.BOOL)


def to_global(e: Expr | None, spec: ir.Spec) -> Expr | None:
    """``e`` with positions and lengths global (module docstring); subscripts of a
    tensor param at a ``seqlen_q`` / ``seqlen_k`` dim are kept local."""
    if e is None:
        return None
    if isinstance(e, Causal):
        return global_causal(e.span)
    if isinstance(e, Var):
        if e.name == "q_idx":
            return _add(e, _i32("q_offset"), e.span)
        if e.name == "kv_idx":
            return _add(e, _i32("kv_offset"), e.span)
        if e.name in _SEQ_DIMS:
            return Var(f"{e.name}_global", e.span, Ty.I32)
        return e
    if isinstance(e, Index):
        p = spec.param(e.name)
        shape = p.shape if p is not None else ()
        idx = tuple(
            i if (d < len(shape) and shape[d] in _SEQ_DIMS) else to_global(i, spec)
            for d, i in enumerate(e.indices)
        )
        return replace(e, indices=idx)
    if isinstance(e, Unary):
        return replace(e, arg=to_global(e.arg, spec))
    if isinstance(e, Binary):
        return replace(e, lhs=to_global(e.lhs, spec), rhs=to_global(e.rhs, spec))
    if isinstance(e, Cond):
        return replace(
            e,
            cond=to_global(e.cond, spec),
            then=to_global(e.then, spec),
            other=to_global(e.other, spec),
        )
    if isinstance(e, Call):
        return replace(e, args=tuple(to_global(a, spec) for a in e.args))
    return e  # Const


def offsets_spec(spec: ir.Spec) -> ir.Spec:
    """The global-position form of a checked spec (module docstring): named
    ``<name>__offsets``, with the i32 params :data:`OFFSET_PARAMS` (minimum 0; offsets
    default to 0, the global lengths have no default) after the spec's own.  Works for
    varlen specs too (positions are then per sequence).  An offsets spec is returned as
    is.  The params are added here, not through the spec checker, whose reserved-name rule
    refuses them in user specs."""
    if is_offsets_spec(spec):
        return spec
    added = tuple(
        ir.Param(n, "scalar", Ty.I32, default=0 if n.endswith("offset") else None, minimum=0)
        for n in OFFSET_PARAMS
    )
    return replace(
        spec,
        name=f"{spec.name}{SUFFIX}",
        mask=to_global(spec.mask, spec),
        score_mod=to_global(spec.score_mod, spec),
        params=spec.params + added,
    )


def kv_sharded_params(spec: ir.Spec) -> tuple[str, ...]:
    """Tensor params declared with a ``seqlen_k`` dim: sliced like k / v (in a ring they
    travel with K and V)."""
    return tuple(p.name for p in spec.tensor_params if "seqlen_k" in p.shape)


def q_sharded_params(spec: ir.Spec) -> tuple[str, ...]:
    """Tensor params declared with a ``seqlen_q`` dim: sliced like q."""
    return tuple(p.name for p in spec.tensor_params if "seqlen_q" in p.shape)
