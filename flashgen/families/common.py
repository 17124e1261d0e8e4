"""Planning pieces the kernel families share: the forward template context every forward
(and, through it, backward) kernel starts from (:func:`forward_context`), the CTA order's L2
head groups and the grouped launch grid that carries them, and per-spec helpers.  Families
import this module, never each other.  Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from flashgen.analysis import affine, colbound, masktiles, rowcol
from flashgen.codegen.abi import KernelArg, kernel_args, needs_block_table
from flashgen.codegen.cuda_expr import (
    Invariants,
    _uses,
    causal_as_true,
    cuda_expr,
    float_expr,
    split_causal,
)
from flashgen.codegen.cuda_expr import side_terms as side_terms_entries
from flashgen.codegen.dtypes import DType, dtype
from flashgen.codegen.plan import TemplateContext, TileConfig
from flashgen.frontend import ir
from flashgen.frontend.ir import Expr, Index, Spec

#: Kernel families a caller may ask for (:attr:`flashgen.options.Options.family`): "fa3" is
#: the Hopper kernel where it applies, else the FA2-class one ("auto" means the same); "fa2"
#: is always the FA2-class kernel.
FAMILIES = ("auto", "fa3", "fa2")
#: Tile schedulers of the persistent Hopper forward: ``static``: CTA c takes tiles c,
#: c + gridDim.x, ... in the non-persistent kernel's head-major order; ``m_major``: the same in
#: query-block-major order (every head's heaviest causal block first: balanced, less K/V reuse
#: in L2); ``dynamic``: the head-major order handed out by a global atomic counter (balanced
#: and head-major; the op passes a counter the kernel's last CTA resets: the stream's for
#: eager calls, its own per captured call).
PERSISTENT_SCHEDULERS = ("static", "m_major", "dynamic")
#: Dynamic shared memory a CTA may opt into, per target: A100's 163 KiB for sm_80, H100's
#: 227 KiB for sm_90 (cudaFuncSetAttribute refuses more; a launch would fail on the GPU).
HOPPER_SMEM_LIMIT = 232448
SMEM_LIMIT = {"sm_80": 166912, "sm_90": HOPPER_SMEM_LIMIT}
#: Spec dtypes of the 16-bit tensor-core kernels (mma.sync m16n8k16 and ldmatrix .b16, the
#: Hopper backward's wgmma k16 forms): the FA2-class families and the Hopper backward.
MMA16_DTYPES = ("fp16", "bf16")


def mma16_dtype(spec: Spec, family: str) -> DType:
    """The dtype record (:mod:`flashgen.codegen.dtypes`) of ``spec`` for ``family``, a family
    of 16-bit tensor-core kernels (:data:`MMA16_DTYPES`).  ``ValueError`` naming the family
    and the dtypes it takes for any other dtype (e.g. ``fp8_e4m3``, whose kernels need e4m3
    operands)."""
    rec = dtype(spec.dtype)
    if rec.name not in MMA16_DTYPES:
        raise ValueError(
            f"dtype {rec.name!r}: {family} takes {', '.join(MMA16_DTYPES)} only "
            "(16-bit tensor-core operands)"
        )
    return rec


@dataclass(frozen=True)
class ForwardContext(TemplateContext):
    """The template context every forward family starts from (:func:`forward_context` fills
    it): names, sizes and tiles, the causal flag, the residual mask and score_mod as CUDA
    expressions (per masked tile kind: ``tile_mask_expr``), their row / column terms, the
    affine score_mod split, the prologue of hoisted invariants, the ABI and the tile
    classifier; ``sink``: the epilogue joins the spec's sink (the fused sink).  Each family's
    ``Context`` adds its own fields."""

    spec_name: str
    kernel_name: str
    dtype: str
    elem_t: str
    head_dim: int
    head_dim_v: int
    block_m: int
    block_n: int
    num_warps: int
    threads: int
    causal: bool
    mask_expr: str | None
    mask_expr_nc: str | None
    tile_mask_expr: dict
    col_bound: dict | None
    score_mod_expr: str | None
    diag_terms: list
    score_mod_expr_diag: str | None
    affine: dict | None
    row_terms: list
    col_terms: list
    mask_reads_memory: bool
    prologue: str
    varlen: bool
    args: tuple[KernelArg, ...]
    block_table: bool
    tile_classifier: str
    tile_class_args: str
    tile_group: str
    needs_bh: bool
    exact_softmax: bool
    sink: bool


#: The K and V bytes a head group of the forward's CTA order keeps in L2 together (H100 / H200
#: have 50 MiB, A100 40 MiB): :func:`head_group`.
HEAD_GROUP_L2_BYTES = 32 << 20


def head_group(
    seqlen_k: int, kv_row_bytes: int, q_per_kv: int, num_bh: int,
    l2_bytes: int = HEAD_GROUP_L2_BYTES,
) -> int:  # fmt: skip
    """At most how many (batch, head) pairs the forward's CTA order groups together
    (``fg::head_group`` in ``templates/common/tile_order.cuh``, which this mirrors): as many
    K/V heads as have their ``seqlen_k`` rows of ``kv_row_bytes`` (``(head_dim + head_dim_v)
    * elem_bytes`` bytes) within ``l2_bytes``, at least one, times the ``q_per_kv`` query heads that
    share each, at most ``num_bh``.  Pure integer arithmetic."""
    kv_head_bytes = max(seqlen_k, 1) * kv_row_bytes
    return min(max(l2_bytes // kv_head_bytes, 1) * q_per_kv, max(num_bh, 1))


def tile_coord(t: int, num_m_blocks: int, num_bh: int, group: int) -> tuple[int, int]:
    """``(m_rev, bh)`` of tile ``t`` in the forward's CTA order (``fg::tile_coord``, which
    this mirrors): the ``num_bh`` (batch, head) pairs in ``ceil(num_bh / group)`` groups of
    as equal sizes as can be (the first ``num_bh % n`` one larger), query-block major within
    a group (``group`` 1: head-major; ``num_bh``: query-block major over all heads).
    ``m_rev`` is reversed afterwards for causal-like masks, so each group's heaviest blocks
    come first."""
    n = (num_bh - 1) // group + 1
    q, rem = divmod(num_bh, n)
    big_heads = q * rem + rem  # the heads of the groups of q + 1
    big = big_heads * num_m_blocks  # and their tiles
    size = q + 1 if t < big else q
    g, r = divmod(t if t < big else t - big, size * num_m_blocks)
    start = g * size if t < big else big_heads + g * size
    return r // size, start + r % size


#: The most head groups a grid of :func:`grouped_grid` may hold (CUDA's gridDim.y limit).
GRID_GROUPS_MAX = 65535


def grouped_grid(num_m_blocks: int, num_bh: int, group: int) -> tuple[int, int, int]:
    """The launch grid that carries :func:`tile_coord`'s order (``fg::grid_tile_coord`` in
    ``templates/common/tile_order.cuh`` decodes it): ``(size * num_m_blocks, n, 1)`` for the
    ``num_bh`` (batch, head) pairs in ``n = ceil(num_bh / group)`` groups of as equal sizes
    as can be, ``size`` the larger groups' head count.  ``blockIdx.y`` is the group,
    ``blockIdx.x = m_rev * size + head``; in a smaller group (one head fewer) the CTAs of
    head ``size - 1`` are holes that exit at once.  CUDA numbers CTAs x-fastest, so the order
    is :func:`tile_coord`'s with the holes in between, and a CTA finds its tile with two
    divisions by run-time values where ``tile_coord`` and ``head_group`` take five, all on
    the path to its first TMA load.  ``group`` is raised where ``n`` would pass
    :data:`GRID_GROUPS_MAX` (larger groups: the same tiles, less L2 reuse; unreachable below
    ~1 TB of K and V).  An empty problem gives ``(0, 1, 1)``."""
    if num_m_blocks * num_bh == 0:
        return (0, 1, 1)
    group = max(group, -(-num_bh // GRID_GROUPS_MAX))
    n = (num_bh - 1) // group + 1
    size = (num_bh - 1) // n + 1
    return (size * num_m_blocks, n, 1)


def grid_tile_coord(x: int, y: int, num_bh: int, n: int) -> tuple[int, int] | None:
    """``(m_rev, bh)`` of the CTA at ``blockIdx = (x, y)`` of :func:`grouped_grid`'s grid with
    ``n`` groups (``fg::grid_tile_coord``, which this mirrors), or None for a hole."""
    q, rem = divmod(num_bh, n)
    m_rev, head = divmod(x, q + 1 if rem else q)
    if head >= q + (1 if y < rem else 0):
        return None
    return m_rev, y * q + min(y, rem) + head


def tile_group_expr(spec: Spec, *, m_major: bool = False, backward: bool = False) -> str:
    """The head-group size of a kernel's CTA order as a CUDA expression of the kernel
    arguments (``tile_group`` in both forward templates, ``bwd_tile_group`` in the Hopper
    backward): ``batch * heads_q`` for ``m_major``; for a causal or masked spec (uneven
    CTAs, heaviest first) :func:`head_group`'s L2 groups, which keep every head's longest
    rows from being left for last (head-major order leaves an idle tail of SMs);
    otherwise ``1`` (head-major: CTAs of one head are
    alike, and they share its K/V in L2 best).  ``backward``: the Hopper backward's units
    are (batch, KV head) pairs, each reading the Q and dO rows of its query heads."""
    if m_major:
        return "batch * heads_q"
    if spec.mask is None or spec.varlen:
        return "1"
    kv_row_bytes = (spec.head_dim + spec.head_dim_v) * dtype(spec.dtype).elem_bytes
    if backward:
        return (
            f"fg::head_group({HEAD_GROUP_L2_BYTES}LL, seqlen_q, {kv_row_bytes} * (heads_q / "
            "heads_kv), 1, batch * heads_kv)"
        )
    return (
        f"fg::head_group({HEAD_GROUP_L2_BYTES}LL, seqlen_k, {kv_row_bytes}, heads_q / heads_kv, "
        "batch * heads_q)"
    )


def causal_tiles_context(spec: Spec, ctx: dict) -> dict:
    """Template entries for the Hopper forward's causal tile flags (``fg::iv::CAUSAL_ONLY`` /
    ``NO_CAUSAL``, :func:`flashgen.analysis.masktiles.classifier_source` with ``causal_bits``),
    given
    the forward context ``ctx`` (:func:`_forward_context`; it has ``mask_expr_nc``).

    ``causal_tiles``: whether the classifier sets the flags (a mask with ``causal`` and more,
    classified by the kernel, not a block table).  Called only where the Hopper forward's
    ``causal_tiles`` option is on.  Then a
    PARTIAL tile whose mask is ``causal`` there runs causal_d128's masked loop (bounds and the
    causal test), and one where ``causal`` holds everywhere evaluates ``mask_expr_nc``: the
    residual mask with ``causal`` replaced by true (``IS_CAUSAL`` off).  The same
    ``row_terms`` / ``col_terms`` serve both residual forms."""
    on = (
        not ctx["block_table"]
        and ctx["mask_expr"] is not None
        and masktiles.has_causal_bits(spec)
    )
    out: dict = {"causal_tiles": on}
    if on:
        out["tile_classifier"] = masktiles.classifier_source(spec, causal_bits=True)
    return out


def affine_context(spec: Spec, inv: Invariants | None) -> dict | None:
    """The affine decomposition of ``spec``'s score_mod (:mod:`flashgen.analysis.affine`) as CUDA
    float expressions, or None (no affine form).

    ``offset``: L, to evaluate where ``q_idx``/``q_idx_f`` are a row's clamped query index
    and ``kv_idx``/``kv_idx_f`` the tile's first key ``n0``; ``kv_coef``: beta, the
    coefficient of ``kv_idx`` (CTA-invariant; it may read ``h``, ``b``, tensor params).
    The kernel computes ``x' = score + beta * (kv_idx - n0)`` per element and adds L(q, n0)
    to the row max and the exp2's addend (FULL tiles only)."""
    form = affine.decompose(spec.score_mod, spec)
    if form is None:
        return None

    return {
        "offset": float_expr(form.offset, spec, inv),
        "kv_coef": float_expr(form.kv_coef, spec, inv),
    }


def forward_context(
    spec: Spec,
    target: str,
    tiles: TileConfig,
    *,
    side_terms: bool = False,
    affine: bool = False,
    nonneg_div: bool = False,
    head_groups: bool = True,
    col_bound: bool = False,
    exact_softmax: bool = False,
    sink: bool = False,
    diag_terms: bool = False,
    float_calls: bool = False,
) -> dict:
    """The fields of :class:`ForwardContext` as a dict (the family adds its own, then builds
    its ``Context``): sizes, tiles, the causal flag, the residual mask and score_mod as
    CUDA expressions, the ABI argument list.

    ``side_terms``: the mask's one-sided tensor reads become ``row_terms`` (evaluated once
    per query row) and ``col_terms`` (once per key column of a masked tile), see
    :mod:`flashgen.analysis.rowcol`; otherwise both lists are empty.  ``mask_reads_memory``: whether
    the rendered ``mask_expr`` still reads a tensor (the template then short-circuits it
    behind the cheap bounds and causal tests).  ``affine``: an affine score_mod's split
    (``affine``, :func:`affine_context`) for the FULL tiles; otherwise ``affine`` is None.
    ``nonneg_div``, ``float_calls``: see :class:`Invariants`.  ``head_groups``: the CTA order's
    ``tile_group`` (:func:`tile_group_expr`; False: head-major).  ``exact_softmax``
    (:attr:`flashgen.options.Options.exact_softmax`): P's exponent from scores rounded as the
    row max was, so no P exceeds 1 at huge logits.

    ``tile_mask_expr``: the expression a masked tile of each kind (``mask``, ``nc``, ``causal``:
    see :func:`causal_tiles_context`) evaluates per element, besides the bounds and causal
    tests.  ``col_bound`` (the Hopper forward with ``col_limit``): the residual's conjuncts
    that are column bounds (:func:`flashgen.analysis.colbound.extract`) leave it, and ``col_bound``
    holds ``lo`` / ``hi``, CUDA ``long long`` expressions of a row's ``q_idx`` (None: no bound
    that side) that the masked tiles of kinds ``mask`` and ``nc`` fold into their per-row
    column range; otherwise ``col_bound`` is None.  With a score_mod only a residual that is
    all bounds qualifies (the score_mod loop tests a rest per element, the column range after
    the loop).  ``sink`` (a family's ``fused_sink`` option): for a spec with a sink, the
    kernel takes the sink logits (:func:`flashgen.codegen.abi.sink_args`) and its epilogue
    scales each row's output by ``sigmoid(lse - sink)`` (the context's ``sink``: False for a
    spec without one, whose unit renders unchanged).  ``diag_terms`` (the Hopper forward's
    option): the score_mod's diagonal terms (:func:`flashgen.analysis.rowcol.split_diagonal`)
    as ``diag_terms`` entries and ``score_mod_expr_diag``, the score_mod reading them as locals,
    which FULL tiles evaluate per element; otherwise ``[]`` and None."""
    d, dv = spec.head_dim, spec.head_dim_v
    sink = sink and spec.sink is not None
    causal, residual = split_causal(spec.mask)
    score_mod = spec.score_mod
    # both forward templates define score_raw = q.k
    inv = Invariants(raw_score="score_raw", nonneg_div=nonneg_div, float_calls=float_calls)
    parts = rowcol.Split(residual, (), ())
    if side_terms and residual is not None:
        parts = rowcol.split(residual, spec)
    residual = parts.expr
    mask_expr = cuda_expr(residual, spec, inv) if residual is not None else None
    mask_expr_nc = None
    if residual is not None:
        mask_expr_nc = cuda_expr(causal_as_true(residual), spec, inv)
    tile_mask_expr = {"mask": mask_expr, "nc": mask_expr_nc, "causal": None}
    bound = colbound.extract(residual, spec) if col_bound else None
    if bound is not None and score_mod is not None and bound.rest is not None:
        bound = None
    col_bound_ctx = None
    if bound is not None:
        rest = bound.rest
        tile_mask_expr = {
            "mask": cuda_expr(rest, spec, inv) if rest is not None else None,
            "nc": cuda_expr(causal_as_true(rest), spec, inv) if rest is not None else None,
            "causal": None,
        }

        def row_code(e: Expr) -> str:
            return cuda_expr(e, spec)

        col_bound_ctx = {
            "lo": colbound.bound_code(bound.lo, row_code, "max"),
            "hi": colbound.bound_code(bound.hi, row_code, "min"),
        }
    score_mod_expr = cuda_expr(score_mod, spec, inv) if score_mod is not None else None
    diag = rowcol.split_diagonal(score_mod, spec) if diag_terms and score_mod is not None else None
    if diag is not None and not diag.terms:
        diag = None
    affine_ctx = affine_context(spec, inv) if affine and score_mod is not None else None
    return {
        "spec_name": spec.name,
        "kernel_name": f"flashgen_{spec.name}_fwd_{target}",
        "dtype": spec.dtype,
        "elem_t": dtype(spec.dtype).ctype,
        "head_dim": d,
        "head_dim_v": dv,
        "block_m": tiles.block_m,
        "block_n": tiles.block_n,
        "num_warps": tiles.num_warps,
        "threads": tiles.threads,
        "causal": causal,
        "mask_expr": mask_expr,
        # mask_expr with causal replaced by true (the Hopper forward's NO_CAUSAL tiles)
        "mask_expr_nc": mask_expr_nc,
        # per masked tile kind, what it evaluates per element; the column bounds it folds
        "tile_mask_expr": tile_mask_expr,
        "col_bound": col_bound_ctx,
        "score_mod_expr": score_mod_expr,
        # score_mod's diagonal terms (functions of kv_idx - q_idx), staged per FULL tile
        "diag_terms": side_terms_entries(diag.terms, spec, inv) if diag else [],
        "score_mod_expr_diag": cuda_expr(diag.expr, spec, inv) if diag else None,
        # score_mod = score + L, L affine in q_idx, kv_idx (FULL tiles: one FFMA per element)
        "affine": affine_ctx,
        "row_terms": side_terms_entries(parts.rows, spec, inv),
        "col_terms": side_terms_entries(parts.cols, spec, inv),
        "mask_reads_memory": residual is not None
        and any(isinstance(n, Index) for n in ir.walk(residual)),
        "prologue": inv.prologue,
        "varlen": spec.varlen,
        "args": kernel_args(spec, sink),
        "block_table": needs_block_table(spec),
        # block sparsity: the mask's tile classifier and its arguments after the tile bounds
        "tile_classifier": masktiles.classifier_source(spec),
        "tile_class_args": ", ".join(n for _, n in masktiles.classifier_params(spec)[4:]),
        # CTA order: heads in L2-sized groups, query-block major within one (tile_order.cuh)
        "tile_group": tile_group_expr(spec) if head_groups else "1",
        "needs_bh": _uses(residual, {"b", "h", "h_kv"})
        or _uses(score_mod, {"b", "h", "h_kv"})
        or bool(spec.tensor_params),
        "exact_softmax": exact_softmax,
        # the fused sink: o scaled by sigmoid(lse - sink) in the epilogue
        "sink": sink,
    }


#: ``exp2_poly`` (:class:`flashgen.families.hopper_fwd.Options`, ``hopper_bwd.Options``) is in
#: sixteenths: of a thread's ``NS = BLOCK_N // 8`` 8-column tiles of P per row, ``NS * exp2_poly //
#: 16`` (spread evenly) take the polynomial (:func:`exp2_poly_tiles`; the plan renders the fewest
#: sixteenths that give as many, so values that give the same count render one source, and a count
#: of 0 the default one).  On Hopper (no packed FFMA2, as Blackwell has) ``fg::exp2_poly`` costs 8
#: issue slots per element against the SFU's 8 clocks per warp-wide ex2, so about 3/16 balances the
#: two pipes.
EXP2_POLY_SIXTEENTHS = 16


def exp2_poly_tiles(block_n: int, sixteenths: int) -> tuple[int, int]:
    """``(tiles, canonical)``: how many of a row's ``NS = block_n // 8`` 8-column tiles of P
    ``sixteenths`` (the families' ``exp2_poly`` option) puts on the FMA pipe, ``NS * sixteenths //
    16``, and the fewest sixteenths that put as many there (what the plans render:
    ``fg::softmax_exp2_split`` spreads any value's tiles over the row, so values of one count build
    the same kernel; 0 for none, the default source)."""
    ns = block_n // 8
    count = ns * sixteenths // EXP2_POLY_SIXTEENTHS
    canonical = min(k for k in range(EXP2_POLY_SIXTEENTHS + 1)
                    if ns * k // EXP2_POLY_SIXTEENTHS == count)  # fmt: skip
    return count, canonical
