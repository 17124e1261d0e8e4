"""The Hopper forward (``templates/sm_90/fwd.cu.j2``; FlashAttention-3, Shah et al. 2024):
TMA loads into a K/V ring, wgmma for both GEMMs, a producer warpgroup and two ping-ponging
consumer warpgroups, optionally persistent (a tile scheduler, :data:`PERSISTENT_SCHEDULERS`).
:func:`plan` lowers a spec; :class:`Options` holds its knobs; :meth:`Context.grid` is its
launch geometry."""

from __future__ import annotations

from dataclasses import dataclass

from flashgen.analysis import masktiles
from flashgen.codegen.abi import KernelArg, TmaArg, needs_block_table
from flashgen.codegen.dtypes import DTYPES, dtype
from flashgen.codegen.plan import KernelPlan, TileConfig
from flashgen.families import tiles as tile_tables
from flashgen.families.common import (
    EXP2_POLY_SIXTEENTHS,
    FAMILIES,
    HEAD_GROUP_L2_BYTES,
    HOPPER_SMEM_LIMIT,
    PERSISTENT_SCHEDULERS,
    ForwardContext,
    causal_tiles_context,
    exp2_poly_tiles,
    forward_context,
    grouped_grid,
    head_group,
    tile_coord,
    tile_group_expr,
)
from flashgen.families.fields import check_fields
from flashgen.families.tiles import HOPPER_HEAD_DIMS
from flashgen.frontend.ir import FP8_DESCALE_BLOCK, Spec

#: The template this family renders.
TEMPLATE = "sm_90/fwd.cu.j2"

#: Hopper kernel: K/V ring depth and the registers per thread given to the producer and
#: to the consumer warpgroups by ``setmaxnreg`` (128 * (56 + 2 * 224) <= 64K).  The
#: producer walks the live key blocks with the mask's tile classifier (double-precision
#: interval math, divisions for chunked masks): 24 registers spill there, 56 do not.
HOPPER_STAGES = 2
HOPPER_REGS = (56, 224)
#: The same for the persistent kernel (``plan_hopper_forward(persistent=True)``): its producer
#: warp carries the tile loop's state over the classifier walk: chunked_local's producer with
#: the warp-wide walk (``warp_walk``) spills 28 bytes at 56, none at 64 (with ``prev_live``
#: none at 40, since the classifier divides as ints); at 72 / 216 no shipped spec spills
#: anywhere (128 * (72 + 2 * 216) = 64K, what ``__launch_bounds__(384, 1)`` gives the CTA:
#: the decrement must free what the increments take).
HOPPER_PERSISTENT_REGS = (72, 216)
#: Values of :attr:`Options.fp8_transpose`: the fp8 forward's V transposer
#: (``templates/common/fp8.cuh``): ``lds32`` (``fg::fp8::VTranspose``: 4 LDS.32, 8 PRMT,
#: 4 STS.32 per lane and 16 bytes) or ``ldsm`` (``fg::fp8::VTransposeLdsm``: one ldmatrix.x4,
#: 4 PRMT, one stmatrix.x4.trans per lane and 16 bytes).  Both write the same sVt bytes.
FP8_TRANSPOSES = ("lds32", "ldsm")


@dataclass(frozen=True)
class Options:
    """Knobs of the Hopper forward (each True by default; False turns the feature off, for
    measurements and the spill fallback).  ``affine``: FULL tiles split an affine
    score_mod.  ``causal_tiles``: CAUSAL_ONLY / NO_CAUSAL masked tiles.  ``col_limit``: a
    masked tile's bounds and causal tests as one per-row column limit.  ``col_bound``: a
    residual column bound joins that limit.  ``single_walk``: warp 0 alone finds the first
    live key block.  ``walk_from_diagonal``: the key-block walk starts at the causal
    diagonal.  ``warp_walk`` (was ``PERSISTENT_WARP_WALK``): the persistent producer walks
    warp-wide.  ``head_groups``: L2 head groups in the CTA order.  ``nonneg_div``:
    ``fg::Divisor::div_nn`` where operands are proven non-negative.  :func:`plan` says more
    about each.  ``fp8_transpose`` (fp8 specs only; one of :data:`FP8_TRANSPOSES`, default
    ``"ldsm"``): the V transposer of the fp8 forward.  ``exp2_poly`` (an int in [0, 16], default 0:
    every exp2 on the SFU): that many sixteenths of the 8-column tiles of the softmax's P
    (:data:`EXP2_POLY_SIXTEENTHS`; ``BLOCK_N // 8 * exp2_poly // 16`` tiles per row
    (:func:`exp2_poly_tiles`: at BLOCK_N 80, 1 is none and 2 and 3 one tile), four
    exponentials of a thread each, spread evenly) are computed on the FMA pipe by a degree-3
    polynomial (FlashAttention-4's exp2 emulation, ``fg::exp2_poly`` in
    ``templates/common/exp2_poly.cuh``, relative error below 8.8e-5, exactly 0 at -inf)
    instead of the SFU's ``ex2.approx``; not with ``exact_softmax`` (its exp2s stay on the
    SFU: :class:`flashgen.options.Options` refuses the pair, and so does :func:`plan`).
    Raises ``ValueError`` for another value.  ``fused_sink`` (on by default): for a spec
    with a sink, the epilogue joins it to each row's denominator, ``o = o_keys *
    sigmoid(lse - sink)`` in fp32 before the store (every form: persistent, sparse tiles,
    fp8), from a float32 logit per (batch, query head) taken per call; lse stays the keys'
    alone (as :class:`flashgen.families.fa2_fwd.Options`' ``fused_sink``, which says more).
    False: the kernel takes no sink and the op applies it after the kernel with torch ops
    (:func:`flashgen.ops.sink.apply_sink`).
    ``diag_terms`` (on by default; False: per element): the score_mod's terms that are
    functions of ``kv_idx - q_idx`` (T5's relative table; :func:`flashgen.analysis.rowcol.
    split_diagonal`) are evaluated once per diagonal of each consumer warp's part of a FULL
    tile, into shared memory (``sDiag``: BLOCK_N + 16 words per warp and term), while the tile's
    GEMMs run; its elements read them at compile-time offsets instead of evaluating them (a
    tensor read each) per element.  Masked tiles keep the per-element form; the outputs are
    bitwise those of the option off.  A spec without such terms renders unchanged, and so does
    one whose tiles leave no room for the slots (head_dim 256; the persistent head_dim 128,
    whose own O staging buffer takes that room).  ``float_index_calls`` (on by default;
    False: the int forms): an integer ``abs`` / ``min`` / ``max`` of affine index expressions in
    a float context (alibi_learned's ``slopes[h] * abs(q_idx - kv_idx)``) is computed on the
    index variables' float twins, ``fabsf(q_idx_f - kv_idx_f)``, exact for indices under 2^24
    (:class:`flashgen.codegen.cuda_expr.Invariants`' ``float_calls``), instead of an int abs and
    an int-to-float conversion per element; a spec without such a call renders
    unchanged.  Register allocation moves with it: alibi_learned stays spill-free; a score_mod
    with several such calls at head_dim 128 / 256 can spill, and its unit is then built with the
    int forms (:func:`flashgen.families.build.build_forward`)."""

    affine: bool = True
    causal_tiles: bool = True
    col_limit: bool = True
    col_bound: bool = True
    single_walk: bool = True
    walk_from_diagonal: bool = True
    warp_walk: bool = True
    head_groups: bool = True
    nonneg_div: bool = True
    fp8_transpose: str = "ldsm"
    exp2_poly: int = 0
    fused_sink: bool = True
    diag_terms: bool = True
    float_index_calls: bool = True

    def __post_init__(self) -> None:
        check_fields(self, "Options.hopper_fwd")
        if not 0 <= self.exp2_poly <= EXP2_POLY_SIXTEENTHS:
            raise ValueError(
                f"Options.hopper_fwd.exp2_poly={self.exp2_poly!r}: exp2_poly (sixteenths of "
                f"P on the FMA pipe) must be an int in [0, {EXP2_POLY_SIXTEENTHS}]"
            )
        if self.fp8_transpose not in FP8_TRANSPOSES:
            raise ValueError(
                f"Options.hopper_fwd.fp8_transpose={self.fp8_transpose!r}: expected one of "
                f"{FP8_TRANSPOSES}"
            )


@dataclass(frozen=True)
class Context(ForwardContext):
    """The template context of the Hopper forward: :class:`ForwardContext` plus the walk and
    masked-tile switches, the ring, the warp roles' registers and the scheduler."""

    smem_bytes: int
    nonneg_div: bool
    single_walk: bool
    warp_walk: bool
    causal_tiles: bool
    col_limit: bool
    walk_from_diagonal: bool
    num_consumers: int
    stages: int
    m_major: bool
    grid_groups: str | None
    grid_l2_bytes: int
    persistent: bool
    scheduler: str | None
    dynamic: bool
    separate_o: bool
    tile_class_scalars: list
    o_stage: str
    producer_regs: int
    consumer_regs: int
    mma_t: str
    wgmma_ns: list
    fp8: bool
    fp8_transpose: str
    exp2_poly: int  # sixteenths of P's tiles by fg::exp2_poly (0: none), the fewest that give
    exp2_poly_tiles: int  # this many of a row's BLOCK_N / 8 tiles (exp2_poly_tiles())
    fp8_block_descale: int  # rows per descale of the per-block form, 0: [B, Hkv] descales
    elem_bytes: int
    mma_k: int
    row_bytes: int
    panel_cols: int
    desc_fn: str
    pv_full: str
    pv_empty: str

    def grid(self, plan, batch, heads_q, seqlen_q, num_sms=None, *, heads_kv=None, seqlen_k=None):
        """A persistent plan launches ``min(tiles, num_sms)`` CTAs that loop over the tiles
        (:func:`persistent_tile_order`; ``num_sms``: the device's SM count).  A plan whose
        CTAs take their head groups from the grid (``grid_groups``: the causal and masked
        kernels) gets :func:`~flashgen.families.common.grouped_grid`'s 2-D grid, which needs
        ``heads_kv`` and ``seqlen_k`` (the group size: :func:`~flashgen.families.common.
        head_group` for the L2 budget ``grid_l2_bytes``).  Else 1-D.  ``ValueError`` if an
        argument the plan needs is missing."""
        tiles = plan.num_m_blocks(seqlen_q) * batch * heads_q
        if self.persistent:
            if not num_sms or num_sms < 1:
                raise ValueError(f"{plan.kernel_name} is persistent: grid() needs num_sms >= 1")
            return (min(tiles, num_sms), 1, 1)
        groups = self.grid_groups
        if not groups:
            return (tiles, 1, 1)
        num_bh = batch * heads_q
        if groups == "all":
            group = num_bh
        else:
            if heads_kv is None or seqlen_k is None:
                raise ValueError(
                    f"{plan.kernel_name} takes its head groups from the grid: grid() "
                    "needs heads_kv and seqlen_k"
                )
            kv_row_bytes = (self.head_dim + self.head_dim_v) * DTYPES[self.dtype].elem_bytes
            group = head_group(
                seqlen_k, kv_row_bytes, heads_q // heads_kv, num_bh, l2_bytes=self.grid_l2_bytes
            )
        return grouped_grid(plan.num_m_blocks(seqlen_q), num_bh, group)


def tiles(spec: Spec, target: str, gpu: str | None = None) -> TileConfig:
    """This family's tiles for ``spec`` (:func:`flashgen.families.tiles.hopper_fwd_tiles`)."""
    return tile_tables.hopper_fwd_tiles(spec, target, gpu)


def eligible(spec: Spec, target: str, family: str = "auto") -> bool:
    """Whether ``spec`` gets the TMA + wgmma kernel on ``target``: sm_90, head_dim ==
    head_dim_v in :data:`HOPPER_HEAD_DIMS`, not varlen, no FA2-style ``tiles:`` pinned by the
    spec, and ``family`` not ``"fa2"``.  A mask that reads tensors is fine: the Hopper kernel
    walks a block table built for its own tiles (:mod:`flashgen.families.blocktable`)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; known: {', '.join(FAMILIES)}")
    o = spec.tiles
    return (
        family != "fa2"
        and not spec.varlen
        and target == "sm_90"
        and spec.head_dim == spec.head_dim_v
        and spec.head_dim in HOPPER_HEAD_DIMS
        and not (o.block_m or o.block_n or o.num_warps)
    )


def plan(
    spec: Spec,
    target: str,
    options: Options = Options(),
    *,
    gpu: str | None = None,
    tiles: TileConfig | None = None,
    stages: int | None = None,
    m_major: bool | None = None,
    persistent: bool | str = False,
    side_terms: bool = True,
    exact_softmax: bool = False,
    options_key: str = "",
    block_descale: bool = False,
) -> KernelPlan:
    """The FA3-class plan (``templates/sm_90/fwd.cu.j2``): TMA + wgmma + warp specialization.

    Same ABI as the FA2-class kernel plus three ``CUtensorMap`` arguments (``tma_q``,
    ``tma_k``, ``tma_v``) appended; :class:`TmaArg` tells the launcher how to build them.
    A mask that reads tensors takes ``blk_tab`` as there, built by :func:`plan_block_table`
    for these ``tiles``: the producer walks its row instead of the tile classifier.
    ``stages``: K/V ring depth (default :data:`HOPPER_STAGES`).  ``m_major``: CTA order
    query-block-major over all (batch, head) pairs, so every head's heaviest causal block
    runs first; the default (False) is head-major (each head's query blocks together,
    heaviest first for causal: best L2 reuse of K/V, the faster order for causal and
    non-causal alike, docs/perf-notes.md).

    ``persistent`` (default off): a grid of at most one CTA per SM (:meth:`KernelPlan.grid`
    with ``num_sms``), each CTA looping over the work tiles of
    :func:`persistent_tile_order` (same numbering, so the same order per CTA).  The producer
    warp loads the next tile's first K/V block and Q while the consumers finish the current
    tile; the K/V ring's stage and phase run on across tiles.  Where shared memory allows
    (``separate_o``: head_dim 64 and 128) the epilogue stages O apart from sQ, so the next
    Q lands during it; otherwise (head_dim 256) the next Q waits for the epilogue.
    ``persistent`` may name the tile scheduler (:data:`PERSISTENT_SCHEDULERS`; True is
    ``static``): ``m_major`` sets ``m_major``; ``dynamic`` adds an ``int* tile_counter``
    argument (two zeroed ints, reset by the kernel's last CTA: one per stream for eager calls,
    one per captured call, ``flashgen.ops.prefill.attention._tile_counter``).
    The knobs below are :class:`Options` fields except ``side_terms`` (a plan argument the
    spill fallback varies).  ``side_terms``: the mask's one-sided tensor reads are read once
    per query row and once per key column of a masked tile, not per element
    (:mod:`flashgen.analysis.rowcol`).  ``affine``:
    FULL tiles split an affine score_mod (:func:`~flashgen.families.common.affine_context`).
    ``causal_tiles``: PARTIAL tiles where the mask is just ``causal`` (or ``causal`` holds
    everywhere) run a cheaper masked loop
    (:func:`~flashgen.families.common.causal_tiles_context`).  ``walk_from_diagonal``: with a
    top-level ``causal``, the
    walk of the live key blocks (last to first) starts at the block of the query block's last
    row's diagonal, not at the last key block: the blocks past it are EMPTY, and the first
    classifier calls of every CTA (before any load is issued) find the first block at once
    .  ``col_limit``: a masked tile tests
    ``kv_idx < seqlen_k`` and the causal test (and, with a score_mod, ``q_idx < seqlen_q``)
    per element as one comparison of the column offset with a per-row limit (FA3's
    ``col_limit``), not two or three comparisons of indices.  ``col_bound`` (with
    ``col_limit``): a residual conjunct that
    keeps a column range per row (``q_idx + seqlen_k - seqlen_q - kv_idx < window``,
    :mod:`flashgen.analysis.colbound`) joins that limit as a per-row range, two comparisons per
    element, instead of being evaluated .
    ``nonneg_div``: ``kv_idx / chunk`` and other integer
    divisions by a kernel-invariant divisor with ``x >= 0`` and ``d >= 1`` proven take
    ``fg::Divisor::div_nn`` (:class:`~flashgen.codegen.cuda_expr.Invariants`).
    ``single_walk`` (non-persistent, no block table): warp 0 alone runs the classifier for the
    first live key block and hands it to the other warps through shared memory (4 bytes),
    instead of all twelve warps classifying at once before the barrier.
    ``warp_walk`` (persistent, no block table): the producer
    walks each tile's live key blocks warp-wide (``fg::iv::WarpWalk``, a fresh window per
    tile: one classifier call per lane for 32 blocks, then a ballot per step), as the
    non-persistent kernel does, not with ``fg::iv::prev_live`` (one classifier call per step,
    the 32 lanes computing the same).
    ``head_groups``: the CTAs take their tiles in L2 head groups
    (:func:`~flashgen.families.common.tile_group_expr`; False: head-major).
    ``exact_softmax`` (:attr:`flashgen.options.Options.exact_softmax`, a plan argument like
    ``side_terms``): a row whose scaled max reaches 2^24 in magnitude computes P = exp2(x -
    max) with x rounded exactly as the max was (an FMUL and an FADD per element in place of
    the FFMA, in a branch; smaller maxima keep the FFMA, whose residual is at most half an ulp
    there), and the rescale factor of the running output from the old max rounded the same
    way, so no P or factor exceeds 1 at huge logits.

    ``block_descale`` (fp8 specs, a plan argument: the op picks it per call from the
    descales' shape): the kernel reads per-block descales (``flashgen.fp8.quantize(
    block_rows=128)``; :data:`~flashgen.frontend.ir.FP8_DESCALE_BLOCK` rows each): float32
    ``q_descale [B, Hq, ceil(Sq / 128)]`` (one per CTA: BLOCK_M is 128; folded into the
    softmax scale), ``k_descale`` and ``v_descale [B, Hkv, ceil(Sk / 128)]``, read by the
    consumers per key block (BLOCK_N divides 128).  k's scales S in the softmax: without a
    score_mod it folds into the block's max (``max * k_descale``, exact: descales are
    positive) and into the exp2's FFMA, no instruction per element; with a score_mod (or
    ``exact_softmax``) S is multiplied by it first.  v's folds into the running output's
    rescale: O is kept in units of the last added block's v descale, so a block's factor is
    ``alpha * v_descale[previous block] / v_descale[this block]`` (one division per block;
    P stays in [0, 1] for its e4m3 rounding, as in the ``[B, Hkv]`` kernel, and no second
    accumulator is needed), and the epilogue multiplies by the last block's.  Its kernel is
    ``flashgen_<spec>_fwd_sm_90_bd``.
    """
    o = options
    single_walk, warp_walk = o.single_walk, o.warp_walk
    tiles = tiles or tile_tables.hopper_fwd_tiles(spec, target, gpu)
    if persistent is True:
        persistent = "static"
    if persistent and persistent not in PERSISTENT_SCHEDULERS:
        known = ", ".join(PERSISTENT_SCHEDULERS)
        raise ValueError(f"unknown persistent scheduler {persistent!r}; known: {known}")
    if persistent == "m_major":
        m_major = True
    dynamic = persistent == "dynamic"
    dt = dtype(spec.dtype)
    fp8 = dt.elem_bytes == 1
    if fp8 and persistent:
        raise ValueError(f"the fp8 Hopper forward has no persistent form (got {persistent!r})")
    if block_descale and not fp8:
        raise ValueError(f"per-block descales are an input of fp8 specs only, not {spec.dtype}")
    if exact_softmax and o.exp2_poly:
        raise ValueError(
            f"hopper_fwd.exp2_poly={o.exp2_poly}: expected 0 with exact_softmax (the exact "
            "softmax keeps its exp2s on the SFU)"
        )
    stages = stages or HOPPER_STAGES
    regs = HOPPER_PERSISTENT_REGS if persistent else HOPPER_REGS
    if target != "sm_90":
        raise ValueError(f"the warp-specialized tiles {tiles} need target sm_90, not {target}")
    if spec.head_dim != spec.head_dim_v or spec.head_dim not in HOPPER_HEAD_DIMS or spec.varlen:
        raise ValueError(
            "the Hopper kernel needs head_dim == head_dim_v in "
            f"{list(HOPPER_HEAD_DIMS)} and no varlen; got {spec.head_dim}/{spec.head_dim_v}"
        )
    if tiles.block_n % 16 or not 16 <= tiles.block_n <= 256:
        raise ValueError(f"BLOCK_N={tiles.block_n} must be a multiple of 16 in [16, 256]")
    if fp8 and (tiles.block_n not in (64, 128) or tiles.block_m != 128 or tiles.num_warps != 12):
        raise ValueError(
            f"the fp8 Hopper forward needs BLOCK_M 128, BLOCK_N 64 or 128, 12 warps; got {tiles}"
        )
    if fp8 and 2 * tiles.block_m > tiles.block_m + stages * tiles.block_n:
        raise ValueError(f"{tiles}: bf16 O does not fit over the fp8 Q tile and the K ring")
    d = spec.head_dim
    consumers = tiles.num_warps // 4 - 1
    elt = dt.elem_bytes
    tile_bytes = (tiles.block_m + 2 * stages * tiles.block_n) * d * elt
    smem = 1024 + tile_bytes + 8 * (1 + 5 * stages)  # 1 KiB alignment slack, mbarriers, stage info
    if fp8:  # the V^T ring, its two barriers and the last-V flag per stage
        smem += stages * tiles.block_n * d + stages * (16 + 4)
    separate_o = False
    if persistent:
        smem += 40  # q_empty (8 bytes), tile_info (2 x 4 ints)
        # the epilogue's own staging buffer (BLOCK_M x HEAD_DIM) where it fits
        separate_o = smem + tiles.block_m * d * elt <= HOPPER_SMEM_LIMIT
        smem += tiles.block_m * d * elt if separate_o else 0
    elif needs_block_table(spec):
        smem += 4 * tiles.num_warps  # warp_last: each warp's last live key block of the table row
    else:
        smem += 8 if single_walk else 0  # first_slot: warp 0's first live key block
    if smem > HOPPER_SMEM_LIMIT:
        raise ValueError(f"{tiles} with {stages} stages needs {smem} B of shared memory")
    # (not at head_dim 256 with a score_mod: gemma2_softcap spilled 4 bytes there)
    col_limit = bool(o.col_limit and not (spec.score_mod is not None and d >= 256))

    def context(diag_terms: bool) -> dict:
        return forward_context(
            spec,
            target,
            tiles,
            side_terms=side_terms,
            affine=o.affine,
            nonneg_div=o.nonneg_div,
            head_groups=o.head_groups,
            col_bound=bool(col_limit and o.col_bound),
            exact_softmax=exact_softmax,
            sink=o.fused_sink,
            diag_terms=diag_terms,
            float_calls=o.float_index_calls,
        )

    ctx = context(o.diag_terms)
    # sDiag: per consumer warp BLOCK_N + 16 words per diagonal term; where they do not fit
    # (head_dim 256, the persistent head_dim 128 with its own O staging), the per-element form
    diag_bytes = 16 * consumers * len(ctx["diag_terms"]) * (tiles.block_n + 16)
    if diag_bytes and smem + diag_bytes > HOPPER_SMEM_LIMIT:
        ctx = context(False)
        diag_bytes = 0
    smem += diag_bytes
    ctx["smem_bytes"] = smem
    ctx["nonneg_div"] = o.nonneg_div
    ctx["single_walk"] = bool(single_walk and not persistent and not ctx["block_table"])
    ctx["warp_walk"] = bool(warp_walk and persistent and not ctx["block_table"])
    if not o.causal_tiles:
        ctx["causal_tiles"] = False
    else:
        ctx.update(causal_tiles_context(spec, ctx))
    ctx["col_limit"] = col_limit
    ctx["walk_from_diagonal"] = bool(o.walk_from_diagonal and ctx["causal"])
    if m_major is None:
        m_major = False
    # Q, K, V tiles as panels of 128-byte rows (64 bytes: an fp8 head_dim 64), the swizzle of
    # the same span
    row_bytes = min(128, d * elt)
    tma = tuple(
        TmaArg(f"tma_{x}", x, rows, box_cols=row_bytes // elt, swizzle=row_bytes)
        for x, rows in (("q", tiles.block_m), ("k", tiles.block_n), ("v", tiles.block_n))
    )
    if dynamic:  # the work-tile counter: [next tile - gridDim.x, CTAs done]
        ctx["args"] = ctx["args"] + (KernelArg("tile_counter", "int*"),)
    ctx["args"] = ctx["args"] + tuple(KernelArg(m.name, "CUtensorMap") for m in tma)
    # non-persistent: the head groups come from the launch grid (KernelPlan.grid)
    grid_groups = None
    if not persistent and (m_major or ctx["tile_group"] != "1"):
        grid_groups = "all" if m_major else "l2"
    ctx.update(
        num_consumers=consumers,
        stages=stages,
        m_major=m_major,
        tile_group=tile_group_expr(spec, m_major=True) if m_major else ctx["tile_group"],
        grid_groups=grid_groups,
        grid_l2_bytes=HEAD_GROUP_L2_BYTES,
        persistent=bool(persistent),
        scheduler=persistent or None,
        dynamic=dynamic,
        separate_o=separate_o,
        # the tile classifier's arguments after (q0, q1, k0, k1, b, h, h_kv): seqlen_q,
        # seqlen_k, params
        tile_class_scalars=masktiles.classifier_params(spec)[7:],
        o_stage="sO" if persistent else "sQ",
        producer_regs=regs[0],
        consumer_regs=regs[1],
        mma_t=dt.mma_t,
        wgmma_ns=sorted({tiles.block_n, d}),
        fp8=fp8,
        fp8_transpose=o.fp8_transpose,
        exp2_poly=exp2_poly_tiles(tiles.block_n, o.exp2_poly)[1],
        exp2_poly_tiles=exp2_poly_tiles(tiles.block_n, o.exp2_poly)[0],
        fp8_block_descale=FP8_DESCALE_BLOCK if block_descale else 0,
        elem_bytes=elt,
        mma_k=32 // elt,
        row_bytes=row_bytes,
        panel_cols=row_bytes // elt,
        desc_fn="gmma_desc" if row_bytes == 128 else "gmma_desc64",
        # the P V GEMM's V stage: fp8 reads the transposed copy (sVt)
        pv_full="vt_full" if fp8 else "v_full",
        pv_empty="vt_empty" if fp8 else "v_empty",
    )
    if block_descale:
        if tiles.block_m != FP8_DESCALE_BLOCK or FP8_DESCALE_BLOCK % tiles.block_n:
            raise ValueError(
                f"per-block descales ({FP8_DESCALE_BLOCK} rows) need BLOCK_M "
                f"{FP8_DESCALE_BLOCK} and a BLOCK_N dividing it; got {tiles}"
            )
        ctx["kernel_name"] = ctx["kernel_name"] + "_bd"
    context = Context(**ctx)
    return KernelPlan.of(spec.name, target, TEMPLATE, tiles, smem, context, options_key, tma=tma)


def persistent_tile_order(
    num_m_blocks: int,
    batch_heads: int,
    grid: int,
    *,
    reverse_m: bool,
    m_major: bool = False,
    group: int = 1,
) -> list[list[tuple[int, int]]]:
    """The work tiles each CTA of a persistent Hopper forward computes, in order: entry c
    lists CTA c's ``(batch * heads_q + head, m_block)`` pairs.  Mirrors the kernel: tile
    numbers ``c, c + grid, c + 2 * grid, ...`` below ``num_m_blocks * batch_heads``, tile
    ``t`` decoded by :func:`~flashgen.families.common.tile_coord` with ``group`` heads per
    group (1: head-major;
    ``m_major``: all of them), its query block reversed (``reverse_m``: causal or a residual
    mask) so each group's longest rows come first.  Pure Python; the unit tests check every
    tile is computed exactly once and the heaviest-first order."""
    if num_m_blocks < 0 or batch_heads < 0 or grid < 1 or group < 1:
        raise ValueError(f"bad tile grid: {num_m_blocks=} {batch_heads=} {grid=} {group=}")
    group = batch_heads if m_major else min(group, max(batch_heads, 1))
    total = num_m_blocks * batch_heads
    order: list[list[tuple[int, int]]] = []
    for c in range(grid):
        mine = []
        for t in range(c, total, grid):
            m_rev, bh = tile_coord(t, num_m_blocks, batch_heads, group)
            mine.append((bh, num_m_blocks - 1 - m_rev if reverse_m else m_rev))
        order.append(mine)
    return order

