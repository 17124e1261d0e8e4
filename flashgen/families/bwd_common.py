"""What the backward families share: the :class:`BackwardPlan` record (pre, dK/dV, dQ or
convert kernels of one translation unit), its ABI (:func:`backward_abi`), and the template
fields both backward templates read (:func:`base_fields`).  Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from flashgen.analysis import masktiles, rowcol
from flashgen.analysis.derive import d_dscore
from flashgen.codegen import dparam
from flashgen.codegen.abi import (
    KernelArg,
    dim_args,
    needs_block_table,
    param_args,
    sink_args,
    strides,
    varlen_args,
)
from flashgen.codegen.cuda_expr import cuda_expr, side_terms, split_causal
from flashgen.codegen.dtypes import dtype
from flashgen.codegen.plan import KernelPlan, TemplateContext
from flashgen.families.tiles import BackwardTiles
from flashgen.frontend.ir import Spec

#: The Hopper backward's template (its dK/dV kernel on wgmma).
HOPPER_BWD_TEMPLATE = "sm_90/bwd.cu.j2"
#: Warps (one row each) per CTA of the preprocess kernel D = rowsum(dO * O).
PRE_WARPS = 8
#: Threads per CTA of the atomic path's convert kernel (dq = scale * dq_accum, 4 columns each).
CONVERT_THREADS = 256


@dataclass(frozen=True)
class BackwardPlan:
    """The kernels of the backward pass, rendered from one source (``sm_80/bwd.cu.j2``).

    Deterministic path (``atomic_dq`` False; ``dq`` set, ``convert`` None): ``pre``,
    D = rowsum(dO * O) per query row (fp32); ``dkdv``, dK and dV with KV outer / Q inner,
    summed over the query heads of a GQA group in registers; ``dq``, dQ with Q outer /
    KV inner.  No atomics: every output element is written by one thread, so the gradients
    are bitwise reproducible run to run.

    Atomic-dQ path (``atomic_dq`` True; ``convert`` set, ``dq`` None): ``pre`` also zeroes
    the fp32 ``dq_accum`` [B, Hq, Sq, D] buffer; ``dkdv`` also adds dS K of every step into
    it with float atomics; ``convert`` writes dq = softmax_scale * dq_accum in the input
    dtype.  5 matmuls per (query block, key block) instead of 7; dQ is not bitwise
    reproducible (the order of the atomic adds varies).

    Sink form (:attr:`sink`, either path): the backward of a fused-sink forward; ``pre``
    also writes the sink-inclusive ``lse`` the other kernels read and the rows' terms of
    d sink (:func:`backward_abi`'s ``sink``).
    """

    spec_name: str
    target: str
    tiles: BackwardTiles
    pre: KernelPlan
    dkdv: KernelPlan
    dq: KernelPlan | None
    convert: KernelPlan | None = None
    atomic_dq: bool = False

    @property
    def unit(self) -> KernelPlan:
        """The plan that stands for the whole translation unit when compiling (all its
        kernels share one source, template and target): ``dq``, or ``dkdv`` on the
        atomic path."""
        return self.dkdv if self.atomic_dq else self.dq

    def dq_accum_seqlen(self, seqlen_q: int) -> int:
        """Rows per (batch, query head) of the fp32 ``dq_accum`` of the atomic path: ``seqlen_q``,
        or, where the dK/dV kernel adds dQ in fragment order (context ``dq_frag``: the Hopper
        backward at head_dim 256), ``seqlen_q`` rounded up to the 64-row tiles that order
        stores."""
        return -(-seqlen_q // 64) * 64 if self.dkdv.context.get("dq_frag") else seqlen_q

    @property
    def sink(self) -> bool:
        """Whether this is the sink form of the unit (its pre kernel takes the sink logits and
        writes ``lse`` and ``dsink``: :func:`backward_abi` with ``sink``)."""
        return bool(self.pre.context.get("sink"))

    @property
    def wgmma(self) -> bool:
        """Whether this is the Hopper unit (:func:`plan_hopper_backward`): a caller that
        asked for it gets the FA2-class unit instead when every Hopper variant spills."""
        return self.dkdv.template == HOPPER_BWD_TEMPLATE

    @property
    def kernels(self) -> tuple[KernelPlan, ...]:
        """Every kernel of the unit, in launch order: (pre, dkdv, dq) or (pre, dkdv, convert)."""
        last = self.convert if self.atomic_dq else self.dq
        return (self.pre, self.dkdv, last)

    def config(self) -> dict:
        """JSON-able summary for manifests."""
        t = self.tiles
        out = {
            "target": self.target,
            "template": self.dkdv.template,
            "kernels": [kp.kernel_name for kp in self.kernels],
            "dkdv": {
                "block_n": t.dkdv_block_n,
                "block_m": t.dkdv_block_m,
                "num_warps": t.dkdv_warps,
                "dsplit": t.dkdv_dsplit,
                "smem_bytes": self.dkdv.smem_bytes,
            },
        }
        if self.atomic_dq:
            out["convert"] = {"threads": CONVERT_THREADS}
        else:
            out["dq"] = {
                "block_m": t.dq_block_m,
                "block_n": t.dq_block_n,
                "num_warps": t.dq_warps,
                "smem_bytes": self.dq.smem_bytes,
            }
        out["deterministic"] = not self.atomic_dq  # False: the atomic-dQ kernels
        return out

    def grids(
        self, batch: int, heads_q: int, heads_kv: int, seqlen_q: int, seqlen_k: int
    ) -> dict[str, tuple[int, int, int]]:
        """1-D grids (gridDim.x only) by kernel role: ``pre``, ``dkdv`` and ``dq`` (or
        ``convert`` on the atomic path)."""
        t = self.tiles
        rows = batch * heads_q * seqlen_q
        out = {"pre": (-(-rows // PRE_WARPS), 1, 1)}
        n_blocks = -(-seqlen_k // t.dkdv_block_n)
        out["dkdv"] = (n_blocks * batch * heads_kv * t.dkdv_dsplit, 1, 1)
        if self.atomic_dq:
            padded = batch * heads_q * self.dq_accum_seqlen(seqlen_q)
            chunks = padded * (self.dkdv.context["head_dim"] // 4)
            out["convert"] = (-(-chunks // CONVERT_THREADS), 1, 1)
        else:
            m_blocks = -(-seqlen_q // t.dq_block_m)
            out["dq"] = (m_blocks * batch * heads_q, 1, 1)
        return out


@dataclass(frozen=True)
class BackwardContext(TemplateContext):
    """The fields both backward templates read: names, sizes, the ABI of the pre and convert
    kernels, the mask, score_mod and d score_mod / d score as CUDA, and the tile classifier;
    ``sink``: the pre kernel of the sink form (:func:`backward_abi`)."""

    spec_name: str
    dtype: str
    elem_t: str
    head_dim: int
    head_dim_v: int
    varlen: bool
    causal: bool
    atomic_dq: bool
    kernel_pre: str
    kernel_dkdv: str
    kernel_convert: str
    pre_args: tuple[KernelArg, ...]
    dkdv_args: tuple[KernelArg, ...]
    convert_args: tuple[KernelArg, ...]
    convert_threads: int
    pre_warps: int
    dkdv_smem_bytes: int
    mask_expr: str | None
    score_mod_expr: str | None
    score_grad_expr: str | None
    diag_terms: list
    score_mod_expr_diag: str | None
    score_grad_expr_diag: str | None
    tile_classifier: str
    int_classifier: bool
    tile_class_args: str
    exact_softmax: bool
    dparam: list
    dparam_terms: list
    sink: bool


def tile_classifier(spec: Spec, causal_bits: bool, integer: bool = False) -> str:
    """The tile classifier the backward units render: with the CAUSAL_ONLY / NO_CAUSAL bits
    (:func:`flashgen.analysis.masktiles.classifier_source`, ``causal_bits``) where
    ``causal_bits`` and the Hopper forward's classifier has them for this spec (a mask with
    ``causal`` and more that the kernel classifies); the backward kernels read only the
    class.  The registry passes ``causal_bits`` (the units stay those of the forward they
    were first planned beside).  ``integer``: on 64-bit integer ranges where the mask
    computes only int32 numbers (``classifier_source``'s ``integer``)."""
    residual = split_causal(spec.mask)[1]
    on = (
        causal_bits
        and not needs_block_table(spec)
        and residual is not None
        and rowcol.split(residual, spec).expr is not None
        and masktiles.has_causal_bits(spec)
    )
    return masktiles.classifier_source(spec, causal_bits=on, integer=integer)


def base_fields(
    spec: Spec,
    causal_bits: bool,
    exact_softmax: bool = False,
    param_grads=(),
    sink: bool = False,
    diag_terms: bool = False,
    int_classifier: bool = False,
) -> dict:
    """The spec-level fields of :class:`BackwardContext` (names, sizes, the mask, score_mod
    and its derivative as CUDA: the backward kernels run at the 255-register ceiling, so a
    hoisted divisor would hold a register through the loop; they divide in place, no
    :class:`~flashgen.codegen.cuda_expr.Invariants`).  ``exact_softmax``
    (:attr:`flashgen.options.Options.exact_softmax`): P = exp2(x - lse) with the exponent
    capped at 0 (``fg::capped_exponent``): lse's rounding can leave x above it, by 2^14 and
    more at logits near 1e11, where exp2 overflowed.  ``param_grads``: the dparam code of
    these params (:func:`flashgen.codegen.dparam.fields`; none: not compiled in).  ``sink``:
    the sink form's pre kernel (:func:`backward_abi`), for a padded spec with a sink only
    (``ValueError`` for one without, or a varlen spec: its pre kernel sees the packed rows as
    one batch, not the sequences the sink is per).  ``diag_terms`` (the Hopper backward's
    option): the score_mod's diagonal terms (:func:`flashgen.analysis.rowcol.split_diagonal`,
    one set of locals for the score_mod and its derivative) as ``diag_terms`` entries, with
    ``score_mod_expr_diag`` / ``score_grad_expr_diag`` reading them; otherwise ``[]``, None.
    ``int_classifier`` (the Hopper backward's option): the tile classifier on 64-bit integer
    ranges where the mask computes only int32 numbers (:func:`tile_classifier`); the field
    ``int_classifier`` says whether it is."""
    if sink and (spec.sink is None or spec.varlen):
        why = "is varlen" if spec.sink is not None else "has no sink"
        raise ValueError(f"spec {spec.name!r} {why}: its backward has no sink form")
    causal, residual = split_causal(spec.mask)
    score_grad = d_dscore(spec.score_mod) if spec.score_mod is not None else None
    terms: dict = {}
    diag = diag_grad = None
    if diag_terms and spec.score_mod is not None:
        diag = rowcol.split_diagonal(spec.score_mod, spec, terms=terms).expr
        diag_grad = rowcol.split_diagonal(score_grad, spec, terms=terms).expr
    return {
        "spec_name": spec.name,
        "dtype": spec.dtype,
        "elem_t": dtype(spec.dtype).ctype,
        "head_dim": spec.head_dim,
        "head_dim_v": spec.head_dim_v,
        "varlen": spec.varlen,
        "causal": causal,
        "mask_expr": cuda_expr(residual, spec) if residual is not None else None,
        "score_mod_expr": cuda_expr(spec.score_mod, spec) if spec.score_mod is not None else None,
        "score_grad_expr": cuda_expr(score_grad, spec) if score_grad is not None else None,
        # the score_mod's diagonal terms (functions of kv_idx - q_idx), staged per FULL tile
        "diag_terms": side_terms(tuple(terms.values()), spec, None),
        "score_mod_expr_diag": cuda_expr(diag, spec) if terms else None,
        "score_grad_expr_diag": cuda_expr(diag_grad, spec) if terms else None,
        "tile_classifier": tile_classifier(spec, causal_bits, int_classifier),
        "int_classifier": int_classifier and masktiles.integer_only(spec),
        "tile_class_args": ", ".join(n for _, n in masktiles.classifier_params(spec)[4:]),
        "exact_softmax": exact_softmax,
        **dparam.fields(spec, param_grads),
        "sink": sink,
    }


def backward_abi(
    spec: Spec, atomic_dq: bool, sink: bool = False
) -> dict[str, tuple[KernelArg, ...]]:
    """``{"pre_args", "dkdv_args", "dq_args", "convert_args"}``: the argument lists of the
    backward kernels (the dK/dV kernel of the atomic path also takes ``dq_accum``).

    ``sink`` (the backward of a fused-sink forward): the pre kernel also takes, after its
    sizes, ``lse_keys`` (const float*, the forward's lse of the keys alone, contiguous [B, Hq,
    Sq]), ``lse`` (float*, written: ``logaddexp(lse_keys, sink)`` per row, the buffer the
    dK/dV and dQ kernels then read as ``lse``; never the forward's), ``sink sink_sb sink_sh``
    (:func:`flashgen.codegen.abi.sink_args`: the float32 logit of (b, h) at ``b * sink_sb +
    h * sink_sh``, not null), ``dsink`` (float*) and ``dsink_rows`` (int): nonzero, ``dsink``
    is float32 [B, Hq, Sq] and each row stores its term ``-sigmoid(sink - lse_keys) *
    dsum`` (0 for a row with no key) there, for the caller to sum in a fixed order; 0,
    ``dsink`` is a zeroed float32 [B, Hq] and each row adds its term into its (b, h) with
    one atomic add."""
    et = dtype(spec.dtype).ctype
    dims = dim_args(spec)
    ins = [KernelArg(n, f"const {et}*") for n in ("q", "k", "v", "dout")]
    stats = [KernelArg("lse", "const float*"), KernelArg("dsum", "const float*")]
    stats += varlen_args(spec)
    tail = [*dims, KernelArg("softmax_scale", "float"), *param_args(spec)]
    accum = [KernelArg("dq_accum", "float*")] if atomic_dq else []
    pre_args = (
        KernelArg("o", f"const {et}*"),
        KernelArg("dout", f"const {et}*"),
        KernelArg("dsum", "float*"),
        *accum,
        *strides("o", "dout"),
        KernelArg("batch", "int"),
        KernelArg("heads_q", "int"),
        KernelArg("seqlen_q", "int"),
    )
    if sink:
        pre_args += (
            KernelArg("lse_keys", "const float*"),
            KernelArg("lse", "float*"),
            *sink_args(),
            KernelArg("dsink", "float*"),
            KernelArg("dsink_rows", "int"),
        )
    dkdv_args = (
        *ins,
        *stats,
        KernelArg("dk", f"{et}*"),
        KernelArg("dv", f"{et}*"),
        *accum,
        *strides("q", "k", "v", "dout", "dk", "dv"),
        *tail,
    )
    convert_args = (
        KernelArg("dq_accum", "const float*"),
        KernelArg("dq", f"{et}*"),
        *strides("dq"),
        KernelArg("batch", "int"),
        KernelArg("heads_q", "int"),
        KernelArg("seqlen_q", "int"),
        KernelArg("softmax_scale", "float"),
    )
    dq_args = (
        *ins,
        *stats,
        KernelArg("dq", f"{et}*"),
        *strides("q", "k", "v", "dout", "dq"),
        *tail,
    )
    return {
        "pre_args": pre_args,
        "dkdv_args": dkdv_args,
        "dq_args": dq_args,
        "convert_args": convert_args,
    }
