"""Typed intermediate representation of a flashgen spec.

Everything here is plain frozen dataclasses: no torch, no cupy, no lark.  The
front end (``flashgen.frontend.spec``) builds these from YAML + the DSL, the checker
(``flashgen.frontend.check``) fills in expression types, and the lowering passes
(``flashgen.codegen``, ``flashgen.ops.cpu.reference``) read them.

Expression nodes carry a :class:`Span` (file, 1-based line/column) so any later
error can point at the source text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property


class Ty(str, Enum):
    """Scalar types of the DSL."""

    I32 = "i32"
    F32 = "f32"
    BOOL = "bool"


@dataclass(frozen=True)
class Span:
    """Source location, 1-based line and column, in the spec file."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


NO_SPAN = Span("<builtin>", 0, 0)

#: Index variables every expression may read, with their types.
INDEX_VARS: dict[str, Ty] = {
    "b": Ty.I32,  # batch index
    "h": Ty.I32,  # query head index
    # the KV head query head h reads: h / (num_heads / num_heads_kv) (h itself without GQA)
    "h_kv": Ty.I32,
    "q_idx": Ty.I32,  # query position, 0 <= q_idx < seqlen_q
    "kv_idx": Ty.I32,  # key/value position, 0 <= kv_idx < seqlen_k
    "seqlen_q": Ty.I32,
    "seqlen_k": Ty.I32,
}
#: Only visible inside ``score_mod``: the scaled logit ``softmax_scale * q.k``.
SCORE_VAR = "score"
#: The index variables a ``sink`` expression may read: one sink logit per (batch, head).
SINK_VARS = ("b", "h", "h_kv")
#: Functions of the DSL: name -> number of arguments.
FUNCTIONS: dict[str, int] = {
    "abs": 1,
    "min": 2,
    "max": 2,
    "exp": 1,
    "log": 1,
    "tanh": 1,
    "sqrt": 1,
}
#: Symbols a tensor param's declared shape may use (besides integer literals).
SHAPE_SYMBOLS = ("batch", "num_heads", "num_heads_kv", "seqlen_q", "seqlen_k")

DTYPES = ("fp16", "bf16", "fp8_e4m3")
TARGETS = ("sm_80", "sm_90")
#: FP8 dtypes: FlashAttention-3's FP8 forward (Shah et al. 2024, section 3.3) runs on Hopper
#: tensor cores only (Ampere has none for FP8), so their ``targets`` default to and must stay
#: within :data:`FP8_TARGETS`; their one kernel is the Hopper forward, hence its head dims
#: (head_dim == head_dim_v), no varlen form, no pinned ``tiles:`` and no backward.
FP8_DTYPES = ("fp8_e4m3",)
FP8_TARGETS = ("sm_90",)
FP8_HEAD_DIMS = (64, 128, 256)
#: Rows of q, k and v per descale in the per-block form of an fp8 op's descales
#: (``flashgen.fp8.quantize(block_rows=128)``): the fp8 Hopper forward's query tile (BLOCK_M)
#: and a multiple of its key tile (BLOCK_N 64 or 128), so a tile reads one descale of each.
FP8_DESCALE_BLOCK = 128
SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 256)
#: (head_dim, head_dim_v) of a ``v_from_k`` spec (decode only, one latent cache whose first
#: head_dim_v columns are the values): DeepSeek-V2/V3's MLA, 512 latent + 64 rope columns.
V_FROM_K_HEAD_DIMS = ((576, 512),)


# ----------------------------------------------------------------------------- expressions
@dataclass(frozen=True)
class Const:
    value: int | float | bool
    span: Span = field(default=NO_SPAN, compare=False)
    ty: Ty | None = None


@dataclass(frozen=True)
class Var:
    """An index variable, ``score``, or a scalar param."""

    name: str
    span: Span = field(default=NO_SPAN, compare=False)
    ty: Ty | None = None


@dataclass(frozen=True)
class Causal:
    """The word ``causal``: bottom-right aligned, ``q_idx + seqlen_k - seqlen_q >= kv_idx``."""

    span: Span = field(default=NO_SPAN, compare=False)
    ty: Ty | None = Ty.BOOL


@dataclass(frozen=True)
class Index:
    """A tensor param read, e.g. ``slopes[h]``."""

    name: str
    indices: tuple[Expr, ...]
    span: Span = field(default=NO_SPAN, compare=False)
    ty: Ty | None = None


@dataclass(frozen=True)
class Unary:
    op: str  # "-" | "!"
    arg: Expr
    span: Span = field(default=NO_SPAN, compare=False)
    ty: Ty | None = None


@dataclass(frozen=True)
class Binary:
    op: str  # + - * / % < <= > >= == != && ||
    lhs: Expr
    rhs: Expr
    span: Span = field(default=NO_SPAN, compare=False)
    ty: Ty | None = None


@dataclass(frozen=True)
class Cond:
    cond: Expr
    then: Expr
    other: Expr
    span: Span = field(default=NO_SPAN, compare=False)
    ty: Ty | None = None


@dataclass(frozen=True)
class Call:
    fn: str  # one of FUNCTIONS
    args: tuple[Expr, ...]
    span: Span = field(default=NO_SPAN, compare=False)
    ty: Ty | None = None


Expr = Const | Var | Causal | Index | Unary | Binary | Cond | Call


# ----------------------------------------------------------------------------- spec
@dataclass(frozen=True)
class Param:
    """A name the expressions may use.

    ``kind == "scalar"``: an op keyword argument (i32 or f32) with a default.
    ``kind == "tensor"``: a runtime tensor argument of the op (f32 or i32 elements)
    whose shape is declared with integer literals and SHAPE_SYMBOLS.
    ``minimum`` / ``maximum``: optional inclusive bounds of a scalar's value (the op
    rejects a value outside them); ``None`` means unbounded.  ``above`` / ``below``: the
    exclusive bound as declared (``above: 0``) when ``minimum`` / ``maximum`` holds it as the
    next value of the type (the least float32 above 0); for messages and display only (no
    part of equality: the bound is ``minimum`` / ``maximum``).
    """

    name: str
    kind: str  # "scalar" | "tensor"
    ty: Ty  # element type: I32 or F32
    default: int | float | None = None  # scalars only
    shape: tuple[int | str, ...] = ()  # tensors only
    span: Span = field(default=NO_SPAN, compare=False)
    minimum: int | float | None = None  # scalars only, inclusive
    maximum: int | float | None = None  # scalars only, inclusive
    above: int | float | None = field(default=None, compare=False, repr=False)
    below: int | float | None = field(default=None, compare=False, repr=False)

    def bounds(self) -> list[tuple[str, int | float]]:
        """The declared bounds as ``(word, value)``, lower first: ``("min", 1)`` or
        ``("above", 0.0)``, then ``("max", ...)`` or ``("below", ...)``; none for an
        unbounded side."""
        out: list[tuple[str, int | float]] = []
        for word, excl, value in (("min", "above", self.minimum),
                                  ("max", "below", self.maximum)):  # fmt: skip
            if getattr(self, excl) is not None:
                out.append((excl, getattr(self, excl)))
            elif value is not None:
                out.append((word, value))
        return out


@dataclass(frozen=True)
class TileOverride:
    """Optional ``tiles:`` block of a spec; None fields fall back to the tuned table."""

    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None


@dataclass(frozen=True)
class Spec:
    """One attention variant, checked.

    ``mask`` and ``score_mod`` are typed expression trees (``None`` when absent);
    ``softmax_scale`` is ``None`` for ``auto`` (1/sqrt(head_dim)).
    ``source`` is the spec file's text, hashed into cache keys.
    ``varlen``: the op takes packed q/k/v ``[total, H, D]`` with ``cu_seqlens_q/k`` and
    ``max_seqlen_q/k`` (see :mod:`flashgen.ops.prefill.varlen`); index variables are per sequence.
    ``sink``: an attention sink logit per (batch, head) (f32, e.g. ``sinks[h]``; ``None``
    without one; gpt-oss): it joins every row's softmax denominator and nothing else,
    ``o = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink))``, in the units of the scaled
    logits; it reads only ``b``, ``h``, ``h_kv`` and params (:data:`SINK_VARS`).
    """

    name: str
    head_dim: int
    head_dim_v: int
    dtype: str
    targets: tuple[str, ...]
    mask: Expr | None
    score_mod: Expr | None
    params: tuple[Param, ...] = ()
    softmax_scale: float | None = None
    tiles: TileOverride = TileOverride()
    description: str = ""
    varlen: bool = False  # packed sequences with cu_seqlens (FlashAttention's varlen interface)
    #: the values are the first head_dim_v columns of the keys (MLA's one latent cache):
    #: decode only (op.with_kvcache), no prefill, varlen or backward; num_heads_kv 1
    v_from_k: bool = False
    sink: Expr | None = None  # a sink logit per (batch, head): joins each row's denominator
    path: str = "<string>"
    source: str = field(default="", compare=False)

    def param(self, name: str) -> Param | None:
        for p in self.params:
            if p.name == name:
                return p
        return None

    # computed once per spec (the op asks on every call); ``cached_property`` writes the
    # instance ``__dict__`` directly, so it works on a frozen dataclass and is no field:
    # equality, hashing and ``replace`` ignore it
    @cached_property
    def scalar_params(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.kind == "scalar")

    @cached_property
    def tensor_params(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.kind == "tensor")


def children(e: Expr) -> tuple[Expr, ...]:
    """Direct sub-expressions of ``e``."""
    if isinstance(e, Index):
        return e.indices
    if isinstance(e, Unary):
        return (e.arg,)
    if isinstance(e, Binary):
        return (e.lhs, e.rhs)
    if isinstance(e, Cond):
        return (e.cond, e.then, e.other)
    if isinstance(e, Call):
        return e.args
    return ()


def walk(e: Expr):
    """Yield ``e`` and every sub-expression, pre-order."""
    yield e
    for c in children(e):
        yield from walk(c)
