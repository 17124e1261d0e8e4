"""Split a mask's tensor reads into per-row and per-column terms.

A mask such as document masking, ``doc_q[b, q_idx] == doc_kv[b, kv_idx]``, reads one tensor
per query row and one per key column, but evaluated element by element it issues two
global loads for every (q, kv) pair of a masked tile, each behind the ``&&`` that keeps
its registers low: 160 dependent loads per thread per 128 x 160 tile on the Hopper
forward, more time than the tile's two GEMMs.  :func:`split` finds the maximal
sub-expressions that read a tensor and depend on one side only, and replaces each by a
kernel local:

- a **row term** reads only ``b``, ``h``, ``h_kv``, ``q_idx``, ``seqlen_q``/``seqlen_k``, constants
  and params: the kernel evaluates it once per query row it owns (two per thread), before
  its key loop;
- a **column term** reads ``kv_idx`` instead of ``q_idx``: on each masked tile every lane
  evaluates it at ``BLOCK_N / 32`` columns (coalesced loads), and the elements fetch their
  columns' values with warp shuffles.

The residual expression compares registers.  Terms that read both ``q_idx`` and
``kv_idx``, or ``score``, stay per element there.

:func:`split_diagonal` does the same for a score_mod's **diagonal terms**: the maximal
sub-expressions that read ``q_idx`` and ``kv_idx`` only through their difference
(:func:`flashgen.analysis.affine.through_difference`) and are not affine in them (T5's
relative table ``bias[h, min(max(kv_idx - q_idx, -128), 128) + 128]``, a log-bucketed
distance).  A warp's 16 query rows and BLOCK_N keys span BLOCK_N + 15 diagonals, so the
kernel (``hopper_fwd.diag_terms``) evaluates each once per tile into shared memory, where
the elements read it at an offset known at compile time, instead of once per element.
Evaluating a term where the element loop would not (the ``&&`` short-circuit skipped it)
is safe: every tensor index is clamped into its declared shape (:func:`flashgen.codegen.
cuda_expr.cuda_expr`), and every DSL expression is defined everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from flashgen.analysis.affine import linear, through_difference
from flashgen.frontend import ir
from flashgen.frontend.ir import Binary, Call, Causal, Cond, Expr, Index, Spec, Ty, Unary, Var

#: Index variables of the query side and of the key side (``b``, ``h``, ``h_kv`` and the lengths
#: are the same for the whole tile, so either side may read them).
ROW_VARS = frozenset({"b", "h", "h_kv", "q_idx", "seqlen_q", "seqlen_k"})
COL_VARS = frozenset({"b", "h", "h_kv", "kv_idx", "seqlen_q", "seqlen_k"})


@dataclass(frozen=True)
class Term:
    """One hoisted sub-expression: the kernel local ``name`` (type ``ty``) stands for ``expr``
    in the residual expression."""

    name: str
    expr: Expr
    ty: Ty


@dataclass(frozen=True)
class Split:
    """``expr`` with its one-sided tensor reads replaced by the locals of ``rows`` / ``cols``."""

    expr: Expr
    rows: tuple[Term, ...]
    cols: tuple[Term, ...]


def _free_vars(e: Expr, spec: Spec) -> set[str] | None:
    """Index variables ``e`` reads (params excluded); None if it reads ``score``."""
    out: set[str] = set()
    for n in ir.walk(e):
        if isinstance(n, Causal):
            out |= {"q_idx", "kv_idx", "seqlen_q", "seqlen_k"}
        elif isinstance(n, Var) and spec.param(n.name) is None:
            if n.name == ir.SCORE_VAR:
                return None
            out.add(n.name)
    return out


def _reads_tensor(e: Expr) -> bool:
    return any(isinstance(n, Index) for n in ir.walk(e))


def _with_children(e: Expr, kids: tuple[Expr, ...]) -> Expr:
    if isinstance(e, Index):
        return replace(e, indices=kids)
    if isinstance(e, Unary):
        return replace(e, arg=kids[0])
    if isinstance(e, Binary):
        return replace(e, lhs=kids[0], rhs=kids[1])
    if isinstance(e, Cond):
        return replace(e, cond=kids[0], then=kids[1], other=kids[2])
    if isinstance(e, Call):
        return replace(e, args=kids)
    return e


def split(e: Expr, spec: Spec, prefix: str = "fg_") -> Split:
    """Replace the maximal one-sided tensor-reading sub-expressions of ``e`` (a typed IR
    expression of ``spec``) by locals ``{prefix}row{i}`` / ``{prefix}col{i}``; equal
    sub-expressions share one local.  A sub-expression that reads no index variable at all
    (``slopes[h]``) counts as a row term.  ``e`` is returned unchanged, with no terms, when
    it reads no tensor."""
    rows: dict[Expr, Term] = {}
    cols: dict[Expr, Term] = {}

    def visit(x: Expr) -> Expr:
        if not _reads_tensor(x):
            return x
        free = _free_vars(x, spec)
        if free is not None and free <= ROW_VARS:
            side, kind = rows, "row"
        elif free is not None and free <= COL_VARS:
            side, kind = cols, "col"
        else:
            return _with_children(x, tuple(visit(c) for c in ir.children(x)))
        if x not in side:
            side[x] = Term(f"{prefix}{kind}{len(side)}", x, x.ty)
        return Var(side[x].name, span=x.span, ty=x.ty)

    out = visit(e)
    return Split(out, tuple(rows.values()), tuple(cols.values()))


#: Types a diagonal term may have (it is staged as one 32-bit word per diagonal).
DIAG_TYPES = frozenset({Ty.F32, Ty.I32})


@dataclass(frozen=True)
class DiagSplit:
    """``expr`` with its diagonal terms replaced by the locals of ``terms``."""

    expr: Expr
    terms: tuple[Term, ...]


def _contractible(x: Expr) -> bool:
    """Whether float ``x``'s value is a product (``*``, or a ``/`` the lowering may turn into
    a multiply by a hoisted reciprocal), possibly under unary minus or a conditional's
    branches: the element code may fuse it into its consumer's add (FFMA)."""
    if x.ty != Ty.F32:
        return False
    if isinstance(x, Unary) and x.op == "-":
        return _contractible(x.arg)
    if isinstance(x, Binary):
        return x.op in ("*", "/")
    if isinstance(x, Cond):
        return _contractible(x.then) or _contractible(x.other)
    return False


#: Calls that make a diagonal term worth its slot even without a tensor read.
COSTLY_CALLS = frozenset({"exp", "log", "tanh", "sqrt"})


def _costly(x: Expr) -> bool:
    """Whether ``x`` reads a tensor or calls one of :data:`COSTLY_CALLS`: a term the element
    code would spend a load or an SFU op on.  An integer distance such as ``abs(q_idx -
    kv_idx)`` costs the element a few ALU ops, no more than reading its slot."""
    return any(
        isinstance(n, Index) or (isinstance(n, Call) and n.fn in COSTLY_CALLS) for n in ir.walk(x)
    )


def split_diagonal(
    e: Expr, spec: Spec, prefix: str = "fg_", *, terms: dict[Expr, Term] | None = None
) -> DiagSplit:
    """Replace the maximal diagonal sub-expressions of ``e`` (a typed score_mod of ``spec``, or
    its derivative; module docstring) by locals ``{prefix}diag{i}``; equal sub-expressions
    share one local, across calls that pass the same ``terms`` (the backward splits the
    score_mod and d score_mod / d score into one set of locals; ``DiagSplit.terms`` is then
    all of them so far).
    A diagonal term reads both ``q_idx`` and ``kv_idx``, only through ``c * (q_idx -
    kv_idx)``, neither ``score`` nor ``causal``, is not affine in them (the affine form,
    :mod:`flashgen.analysis.affine`, is cheaper still) and has a type of
    :data:`DIAG_TYPES`.  ``e`` comes back unchanged, with no terms, when it has none.

    A term reads a tensor or calls exp, log, tanh or sqrt (:func:`_costly`).  A float
    product is never a term (:func:`_contractible`): its operands are looked into
    instead (``slopes[h] * log(1.0 + abs(q_idx - kv_idx))`` stages the log).  Per element,
    nvcc may fuse the product into the add or subtract that takes it (one FFMA, one rounding:
    ``max(score, c) - slopes[h] * d`` is ``fma(-slopes[h], d, max(score, c))``), which a staged,
    rounded product cannot reproduce; with its operands staged the element code keeps the
    same product, and the same fusion."""
    terms = {} if terms is None else terms

    def diagonal(x: Expr) -> bool:
        free = _free_vars(x, spec)
        return (
            free is not None
            and {"q_idx", "kv_idx"} <= free
            and free <= ROW_VARS | COL_VARS
            and x.ty in DIAG_TYPES
            and not _contractible(x)
            and _costly(x)
            and linear(x, spec) is None
            and through_difference(x, spec)
        )

    def visit(x: Expr) -> Expr:
        if diagonal(x):
            if x not in terms:
                terms[x] = Term(f"{prefix}diag{len(terms)}", x, x.ty)
            return Var(terms[x].name, span=x.span, ty=x.ty)
        return _with_children(x, tuple(visit(c) for c in ir.children(x)))

    out = visit(e)
    return DiagSplit(out, tuple(terms.values()))
