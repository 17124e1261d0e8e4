"""The Hopper backward (``templates/sm_90/bwd.cu.j2``): the atomic-dQ scheme with a
warp-specialized dK/dV kernel on wgmma and TMA.  :func:`plan` lowers a spec; :class:`Options`
holds its knobs.

The consumers build a step's wgmma descriptors as one base descriptor plus each tile's offset
and take the warpgroup index from a shuffle, which the compiler knows is warp-uniform (the
descriptor arithmetic runs on the uniform datapath, with no register-to-uniform moves before
each wgmma); they read dsum as column pairs and store P^T and dS^T by stmatrix."""

from __future__ import annotations

from dataclasses import dataclass, replace

from flashgen.analysis import rowcol
from flashgen.analysis.paramgrad import grad_plan
from flashgen.codegen import dparam
from flashgen.codegen.abi import KernelArg, TmaArg, needs_block_table
from flashgen.codegen.cuda_expr import cuda_expr, side_terms, split_causal
from flashgen.codegen.dtypes import dtype
from flashgen.codegen.plan import KernelPlan, TileConfig
from flashgen.families.bwd_common import (
    CONVERT_THREADS,
    HOPPER_BWD_TEMPLATE,
    PRE_WARPS,
    BackwardContext,
    BackwardPlan,
    backward_abi,
    base_fields,
)
from flashgen.families.common import (
    EXP2_POLY_SIXTEENTHS,
    FAMILIES,
    HOPPER_SMEM_LIMIT,
    MMA16_DTYPES,
    exp2_poly_tiles,
    tile_group_expr,
)
from flashgen.families.fields import check_fields
from flashgen.families.tiles import HOPPER_BWD_HEAD_DIMS, HOPPER_BWD_TILES, HOPPER_BWD_TILES_SPLIT_D
from flashgen.frontend.ir import Causal, Index, Spec, walk

#: The template this family renders.
TEMPLATE = HOPPER_BWD_TEMPLATE
#: Stages of the Q / dO / lse / dsum pipeline the producer warp fills.
STAGES = 2
#: Registers per thread of the producer and the two consumer warpgroups (``setmaxnreg``):
#: 24 x 128 + 240 x 256 = 168 x 384, what ``__launch_bounds__(384, 1)`` gives the CTA.
PRODUCER_REGS = 24
CONSUMER_REGS = 240
#: Query rows per step the head-dim-64 layout takes (``Options.d64_block_m``).
D64_BLOCK_MS = (64, 128)
#: Query rows per step the head-dim-128 layout takes (``Options.d128_block_m``).
D128_BLOCK_MS = (64, 80)
#: Consumer warps of the dK/dV kernel (two warpgroups).
MMA_WARPS = 8


@dataclass(frozen=True)
class Options:
    """Knobs of the Hopper backward: ``head_groups`` (the CTAs take (batch, KV head) pairs in
    L2 head groups; False: in order); ``ordered_dq`` (a ``deterministic=True`` backward of a
    spec :func:`ordered_eligible` accepts runs this kernel with dQ added in a fixed order,
    :func:`plan`'s ``ordered_dq``, instead of the FA2-class deterministic kernels);
    ``d64_block_m`` (query rows per step at head_dim 64, one of :data:`D64_BLOCK_MS`: 128
    gives S^T and dP^T m64n128 wgmmas and each warpgroup its own 64 dQ rows,
    FlashAttention-3's 128 x 128 tile for hdim 64; a spec that spills with it is built with
    64, :func:`flashgen.families.build.build_backward`);
    ``d128_block_m`` (query rows per step at head_dim 128, one of :data:`D128_BLOCK_MS`; 80
    by default, FlashAttention-3's non-causal hdim-128 tile, for a spec with no mask or a
    causal one, without param gradients and not ordered: S^T, dP^T m64n80, dQ^T = K^T dS^T
    (dS stored transposed by stmatrix) so that no wgmma has M = 80; the other specs and 64
    take 64-query steps); ``d256_sdp_warpgroups`` (on by default: at head_dim 256 warpgroup
    0 computes the step's whole S^T = K Q^T and warpgroup 1 its whole dP^T = V dO^T, m64n64
    each, so every element of K, V, Q and dO is read by one wgmma per step; warpgroup 0
    stores P^T (and, with a score_mod whose derivative is not 1, P^T * d score_mod / d score
    in 8 KiB more), warpgroup 1 reads it back by ldmatrix for dS^T; off, and in a unit with
    param gradients, each warpgroup computes both GEMMs on half the step's queries);
    ``dparam_diagonal`` (on by default: param gradients of a relative-position table, such
    as T5's bias, accumulated in this kernel at head_dim 64 and 256: each warp sums its slice
    per diagonal by shuffles into its own shared slots, the CTA's tile is summed per diagonal
    from them; the shared-atomic sums it replaced were correct on a GPU but hardly faster;
    off, such a backward runs the FA2-class kernels);
    ``dparam_const_tiles`` (on by default; with ``dparam_diagonal``, which it needs): a
    step whose whole tile (BLOCK_N keys x BLOCK_M queries, within the sequences) reads one
    element of a diagonal term's table, every subscript one value over it (tested each step
    by the tile classifier's interval rules, :func:`flashgen.codegen.dparam.const_tile_fields`:
    T5's clamp away from the diagonal), skips the per-diagonal sums: each thread adds its
    step's diagonal registers into one running sum of that element, which each warp adds into
    ``dp_<name>`` (shuffles, one atomic) only when the element changes and at the CTA's last
    step; the other steps keep the per-diagonal sums.  Atomic mode only: with a row stride
    (``deterministic=True``'s ordered per-CTA rows, which never take this kernel with param
    gradients) every step takes the per-diagonal sums;
    ``diag_terms`` (on by default; head dims 64 and 128): as
    :class:`flashgen.families.hopper_fwd.Options`' ``diag_terms``, the score_mod's functions of
    ``kv_idx - q_idx`` are evaluated once per diagonal of each consumer warp's 16 keys x
    BLOCK_M queries of a step that is not an edge, into a static shared array (``sDiag``), while
    S^T and dP^T run; P^T (and d score_mod / d score) read them at compile-time offsets.
    Where the slots do not fit (head_dim 128's 80-query steps: 3 KiB against 720 bytes left),
    the unit renders as with the option off (``d128_block_m=64`` takes them).

    ``exp2_poly`` (an int in [0, 16], default 0: every exponential on the SFU): as
    :class:`flashgen.families.hopper_fwd.Options`' ``exp2_poly``, that many sixteenths of each
    thread's ``QN / 8`` 8-column tiles of P^T (query columns) in the steps that are not edges
    take ``fg::exp2_poly``, FlashAttention-4's exp2 emulation on the FMA pipe
    (``templates/common/exp2_poly.cuh``), the others ``ex2.approx``; edge steps keep the SFU for
    every element (their masked pairs' exponents may be inf or NaN before the selection).  Not
    with ``exact_softmax`` (:class:`flashgen.options.Options` refuses the pair).

    ``masked_80`` (on by default; False: such specs take 64): ``d128_block_m=80`` takes a spec
    with a residual mask too (index-only, or with ``tensor_masks`` one that reads tensors):
    80-query steps whose 40 keep bits per thread and hull search use the same classifier; a
    unit that spills with them (document_mask: 8 B; chunked_local and mistral_swa without
    ``int_classifier``: 32 B) is built with 64
    (:func:`flashgen.families.build.build_backward`).  ``tensor_masks`` (on by default): a
    mask that reads tensor params one-sidedly (``document_mask``: :func:`one_sided_reads`)
    takes this backward too, its tiles classified by a block table the op builds for the
    backward's BLOCK_M x BLOCK_N tiles with the forward's pre-pass
    (``templates/sm_80/blockmask.cu.j2``): exact hulls of live query blocks per key block
    and FULL steps without the mask; an edge step's keep bits read the mask's one-sided
    tensor reads once per key row and query column (:func:`keep_terms`).  Off, such a
    spec's backward runs the FA2-class kernels.  ``two_sided_masks`` (on by default):
    with ``tensor_masks``, a mask with a two-sided read (spec_tree's
    ``ancestors[b, q_idx, kv_idx - ...]``) too, its edge pairs reading the tensor each.

    ``int_classifier`` (off by default: slower on mistral_swa and prefix_lm, docs/perf-notes.md):
    the tile classifier of a mask that computes only int32 numbers
    (:func:`flashgen.analysis.masktiles.integer_only`: mistral_swa, chunked_local, prefix_lm;
    not one that reads tensors) bounds it on 64-bit integer ranges
    (``templates/common/masktiles_int.cuh``) instead of double ones: the same classes, half the
    registers; chunked_local and mistral_swa then build their 80-query steps spill-free
    (``masked_80``).

    ``dparam_affine`` (off by default, until run on a GPU): a unit with param gradients whose
    every term is per CTA with d score_mod / d param affine in ``q_idx`` and ``kv_idx`` and
    d score_mod / d score 1 (:func:`flashgen.codegen.dparam.affine_fields`: ALiBi's
    ``slopes[h]``, ``bias[b, h]``) keeps the steps of the unit without them (head_dim 128's
    80-query steps with ``d128_block_m=80``; the P^T pass overlapping dP^T) and takes its
    gradient in the dS^T pass, from the dS^T the kernel computes for dK and dQ: per thread and
    step the fp32 sums of dS, of dS times the query's offset and of dS on the second key from
    the thread's first pair (four FP instructions per query column's two keys, no index
    arithmetic), combined with the partial at that pair once per step, then into per-warp
    slots in dynamic shared memory (:func:`affine_slots`), flushed as the per-CTA form's sums
    (templates/common/dparam_affine.j2).  Other terms, and the option off, keep the per-pair
    form in the P^T pass; a unit that spills with it is built without it
    (:func:`flashgen.families.build.build_backward`).

    ``ds_split_barrier`` (off by default, until run on a GPU): where both consumer warpgroups
    read each other's dS^T rows for dQ (head_dim 128, and 64 with 128-query steps), each
    warpgroup signals its rows with ``bar.arrive`` on a barrier of its own (alternating with
    the step's parity), issues dK += dS^T Q from its own dS^T registers, and only then waits
    for the other warpgroup's rows and issues dQ, waiting for both before dQ goes to sDQ;
    off, both warpgroups meet on one barrier after storing dS^T, dQ is issued before dK and
    acc_dq goes to sDQ while dK runs.  No effect on head_dim 256 (its warpgroups split the
    head dim) or on head_dim 64's 64-query steps (each warpgroup reads only its own rows).

    ``stagger_steps`` (off by default, until run on a GPU): each CTA walks its hull of query
    blocks (per query head of its group) starting at position ``n_block % per_head`` and
    wrapping around (``fg::staggered``, templates/common/sm90_bwd.cuh), instead of from the
    hull's first block: with no mask every key block's CTA of a head otherwise loads the same
    Q / dO tile and reduces into the same dq_accum tile at the same time (a causal mask
    staggers them by its diagonal already).  Not with ``ordered_dq`` (its writers take their
    turns in key-block order per query block) nor with param gradients (their flushes follow
    the step order).

    ``ordered_descending`` (off by default, until run on a GPU): the ordered form adds into
    each query block from the last key block that sees it down to the first (FlashAttention-3's
    shortest-processing-time order for its deterministic backward), and the CTAs launch in
    descending key-block order so that no CTA waits for one launched after it.  A CTA walks its
    query blocks upwards from its first; under causal (or a band mask) the later key blocks
    reach a query block earlier in their own walks, so a turn is usually ready when asked for,
    where in ascending order key block n waits about n steps for key block 0 to get there
    (perf-notes row 125: a host model of the turns).  Every form of the ordered dQ: the prefix
    form's turn is ``fg::last_key_block(m0) - n_block`` (templates/common/sm90_bwd.cuh), the
    hull form counts the later key blocks whose published hull holds the block, head_dim 256's
    consumers wait for two counts per later key block.

    ``ordered_80`` (off by default, until run on a GPU): the ordered form at head_dim 128
    takes ``d128_block_m``'s 80-query steps too (its dQ writer waits its turn per 80-row
    query block; the semaphores count 80-row blocks), instead of 64-query ones.
    ``ordered_masks`` (off by default, until run on a GPU): the ordered form for a residual
    mask (head_dim 64, 128), whose key blocks adding into a query block are no prefix: each
    CTA's dQ writer publishes its hull of query blocks (``dq_hull`` uint64 [B, Hkv,
    ceil(Sk / BLOCK_N)], all ones until published, its first block in the high word, its end
    in the low one) and, per step, waits for the count of earlier key blocks whose hull holds
    the step's query block.
    ``ordered_d256`` (off by default, until run on a GPU): ``ordered_dq`` at head_dim 256 too,
    so ``deterministic=True`` there takes this kernel instead of the FA2-class deterministic
    ones: each consumer warpgroup waits on the query block's semaphore for both warpgroups of
    every earlier key block's CTA, adds its 128 dQ columns, and counts itself in with a
    release add after a fence.

    Where dS^T is computed from the packed P^T (head_dim 64's 128-query and 128's 80-query
    steps) it reads that fragment while dV, whose A operand it is, may still run."""

    head_groups: bool = True
    ordered_dq: bool = True
    d64_block_m: int = 128
    d128_block_m: int = 80
    d256_sdp_warpgroups: bool = True
    dparam_diagonal: bool = True
    dparam_const_tiles: bool = True
    diag_terms: bool = True
    exp2_poly: int = 0
    tensor_masks: bool = True
    two_sided_masks: bool = True
    masked_80: bool = True
    int_classifier: bool = False
    dparam_affine: bool = False
    ordered_d256: bool = False
    ordered_80: bool = False
    ordered_masks: bool = False
    ds_split_barrier: bool = False
    stagger_steps: bool = False
    ordered_descending: bool = False

    def __post_init__(self) -> None:
        check_fields(self, "Options.hopper_bwd")
        if not 0 <= self.exp2_poly <= EXP2_POLY_SIXTEENTHS:
            raise ValueError(
                f"Options.hopper_bwd.exp2_poly={self.exp2_poly!r}: expected an int in "
                f"[0, {EXP2_POLY_SIXTEENTHS}] (sixteenths of P^T's tiles on the FMA pipe)"
            )
        if self.d64_block_m not in D64_BLOCK_MS:
            raise ValueError(
                f"Options.hopper_bwd.d64_block_m={self.d64_block_m!r}: expected one of "
                f"{list(D64_BLOCK_MS)}"
            )
        if self.d128_block_m not in D128_BLOCK_MS:
            raise ValueError(
                f"Options.hopper_bwd.d128_block_m={self.d128_block_m!r}: expected one of "
                f"{list(D128_BLOCK_MS)}"
            )


#: The defaults, for :func:`eligible` called without options.
_DEFAULT_OPTIONS = Options()


@dataclass(frozen=True)
class Context(BackwardContext):
    """The template context of the Hopper backward unit."""

    block_m: int
    block_n: int
    threads: int
    mma_t: str
    wgmma_ns: list
    split_d: bool
    sdp_wg: bool
    coords_dynamic: bool
    dkv_n: int
    tt_ns: list
    bwd_tile_group: str
    ordered_dq: bool
    # ordered_dq under a residual mask (ordered_masks): turns counted over published hulls
    ordered_hull: bool
    # ordered_dq from the last key block down, the last key block's CTA launched first
    # (ordered_descending)
    ordered_desc: bool
    exp2_poly: int  # sixteenths of P^T's query tiles by fg::exp2_poly (0: none), the fewest
    dq_rows_split: bool
    pg_frag: bool
    dq_swap: bool
    ts_ns: list
    ds_from_frag: bool
    dq_frag: bool
    # dparam_affine: the affine per-CTA terms summed in the dS^T pass (dparam.affine_fields),
    # each with its warps' slots in dynamic shared memory (byte offset "slots", "shift":
    # affine_slots); [] otherwise
    dparam_affine: list
    # ds_split_barrier: the dS^T hand-off by arrive / wait per warpgroup, dK issued before dQ
    ds_split_barrier: bool
    # stagger_steps: each CTA's walk over its hull starts at a position set by its key block
    stagger_steps: bool
    stages: int
    producer_regs: int
    consumer_regs: int
    # a mask's one-sided tensor reads (flashgen/analysis/rowcol.py, split): the keep bits of
    # an edge step read each of the thread's key rows' and query columns' terms once
    keep_expr: str | None
    keep_rows: list
    keep_cols: list
    block_table: bool  # tile classes from a block table for these tiles (tensor_masks)
    # dparam_const_tiles: the diagonal terms' constant-tile tests (dparam.const_tile_fields)
    dparam_const_source: str | None
    dparam_const_headers: list
    dparam_const_args: str


#: The block table's kernel arguments (:func:`flashgen.codegen.abi.kernel_args`' names).
BLOCK_TABLE_ARGS = (
    ("blk_tab", "const unsigned char*"),
    ("blk_sb", "int64_t"),
    ("blk_sh", "int64_t"),
)


def table_classifier(spec: Spec, block_m: int, block_n: int) -> dict:
    """``tile_classifier`` / ``tile_class_args`` of a unit whose tile classes come from a
    block table built for its ``block_m`` x ``block_n`` tiles (``tensor_masks``): the class of
    a range of whole tiles (the hull search asks for runs of query blocks, a step for one
    tile or a warpgroup's part of one) combines its tiles' exact classes
    (``fg::table_class``, templates/common/table_class.cuh)."""
    src = (
        f"// Tile class of spec {spec.name}'s mask: its block table, built for the "
        f"{block_m} x {block_n} tiles (common/table_class.cuh).\n"
        "__host__ __device__ __forceinline__ int fg_tile_class(int q0, int q1, int k0, int k1, "
        "const unsigned char* tab, int64_t sb, int64_t sh, int b, int h, int seqlen_k) {\n"
        f"    return fg::table_class(tab + b * sb + h * sh, (seqlen_k + {block_n - 1}) / "
        f"{block_n}, q0 / {block_m}, q1 / {block_m}, k0 / {block_n}, k1 / {block_n});\n"
        "}\n"
    )
    return {"tile_classifier": src, "tile_class_args": "blk_tab, blk_sb, blk_sh, b, h, seqlen_k"}


def keep_terms(spec: Spec) -> dict:
    """The keep bits' form for a mask that reads tensors: ``keep_expr`` (the residual mask
    with its one-sided tensor reads as locals, :func:`flashgen.analysis.rowcol.split`) and
    the ``keep_rows`` / ``keep_cols`` entries (:func:`flashgen.codegen.cuda_expr.side_terms`)
    that load them, each once per query column / key row of the thread; ``None`` and none
    for a mask without such reads (the keep bits evaluate the mask per pair)."""
    parts = _residual_split(spec)
    if parts is None or not (parts.rows or parts.cols):
        return {"keep_expr": None, "keep_rows": [], "keep_cols": []}
    return {
        "keep_expr": cuda_expr(parts.expr, spec),
        "keep_rows": side_terms(parts.rows, spec, None),
        "keep_cols": side_terms(parts.cols, spec, None),
    }


def dkdv_smem_bytes(
    d: int,
    elt: int,
    block_m: int,
    block_n: int,
    split_d: bool,
    dq_swap: bool = False,
    pg_bufs: int = 0,
    sum_slots: int = 0,
) -> int:
    """Dynamic shared memory of the dK/dV kernel (the template's layout, which checks it):
    1 KiB alignment slack, K and V, :data:`STAGES` stages of Q and dO, two dS^T buffers
    (``split_d``: one of dS^T and one of P^T, then ``pg_bufs`` of P^T * d score_mod / d
    score for ``d256_sdp_warpgroups``), the dQ staging tiles (two
    warpgroups x 64 rows, ``dq_swap``: block_m rows, x 64 fp32; none when ``split_d``), lse
    and dsum (fp32, per stage), the mbarriers (K/V full; per stage full) and, in the layouts
    that need all 227 KiB (``dq_swap``: :func:`coords_dynamic`), the CTA's
    coordinates (six ints in the last 24 bytes; the others keep them in a static array, which
    ptxas counts as 1 KiB but whose address takes no register); ``sum_slots`` floats before
    them (``dparam_affine``: the warps' sums of each term at a flush)."""
    smem = 1024 + 2 * block_n * d * elt + 2 * STAGES * block_m * d * elt
    smem += (2 + pg_bufs) * block_n * block_m * elt
    if not split_d:
        smem += 2 * (block_m if dq_swap else 64) * 64 * 4
    smem += 2 * STAGES * block_m * 4 + 8 * (1 + STAGES) + 4 * sum_slots
    return smem + (6 * 4 if coords_dynamic(dq_swap) else 0)


def affine_slots(terms: int, free_bytes: int) -> int:
    """``dparam_affine``'s shuffles per step, ``shift``: each consumer warp keeps ``32 >> shift``
    fp32 slots per term in dynamic shared memory, lane ``l`` (``l % 2^shift == 0``) adding the
    step sum of lanes ``l .. l + 2^shift - 1`` (``shift`` butterfly shuffles) to slot ``l >>
    shift``: the fewest shuffles whose slots fit ``free_bytes`` (0 at 64-query steps, 1 in
    head_dim 128's 80-query layout with one term; 5 where nothing smaller fits)."""
    return next((k for k in range(6) if terms * MMA_WARPS * 4 * (32 >> k) <= free_bytes), 5)


def coords_dynamic(dq_swap: bool) -> bool:
    """Whether the dK/dV kernel keeps the CTA's coordinates in its dynamic shared memory: in
    the layout a static array's 1 KiB would push over the limit (80-query steps); elsewhere
    in a static array (its address is a constant: in dynamic memory the register-tightest
    dparam units spill)."""
    return dq_swap


def eligible(spec: Spec, target: str, family: str = "auto", options: Options | None = None) -> bool:
    """Whether ``spec``'s non-deterministic backward on ``target`` runs the wgmma dK/dV
    kernel (:func:`plan`): sm_90, ``family`` not ``"fa2"``, head_dim ==
    head_dim_v in :data:`HOPPER_BWD_HEAD_DIMS`, fp16/bf16, no varlen, and a mask that reads
    no tensor (no block table; causal, none, or an index-only mask walked with the tile
    classifier) unless ``options`` (default: the defaults) has ``tensor_masks`` (a block
    table built for the backward's tiles) and the mask's tensor reads are one-sided
    (:func:`one_sided_reads`) or ``two_sided_masks``.  A score_mod is fine (its derivative
    comes from :mod:`flashgen.analysis.derive`).  Everything else keeps the FA2-class
    kernels."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; known: {', '.join(FAMILIES)}")
    o = options or _DEFAULT_OPTIONS
    return (
        family != "fa2"
        and target == "sm_90"
        and spec.dtype in MMA16_DTYPES
        and not spec.varlen
        and spec.head_dim == spec.head_dim_v
        and spec.head_dim in HOPPER_BWD_HEAD_DIMS
        and (
            not needs_block_table(spec)
            or (o.tensor_masks and (o.two_sided_masks or one_sided_reads(spec)))
        )
    )


def one_sided_reads(spec: Spec) -> bool:
    """Whether every tensor read of ``spec``'s mask is one-sided (indexed by the query or
    by the key side alone: ``doc_q[b, q_idx] == doc_kv[b, kv_idx]``), so the Hopper
    backward's keep bits load each once per query column and key row (:func:`keep_terms`);
    spec_tree's ``ancestors[b, q_idx, kv_idx - ...]`` is two-sided."""
    if split_causal(spec.mask)[1] is None:
        return True
    parts = _residual_split(spec)
    return parts is not None and not any(isinstance(n, Index) for n in walk(parts.expr))


def _residual_split(spec: Spec):
    """:func:`flashgen.analysis.rowcol.split` of the mask's residual (its part besides
    ``causal``), or None where there is none."""
    residual = split_causal(spec.mask)[1]
    return rowcol.split(residual, spec) if residual is not None else None


def ordered_eligible(
    spec: Spec, target: str, family: str = "auto", options: Options = _DEFAULT_OPTIONS
) -> bool:
    """Whether ``spec``'s backward on ``target`` can add dQ in a fixed order (``ordered_dq``):
    :func:`eligible`, head_dim 64 or 128 (the dQ writer waits its turn) or 256 with
    ``options.ordered_d256`` (the consumer warpgroups wait for theirs before their reductions),
    and no mask or causal, so the key blocks that add into a query block are a prefix 0 .. n
    of them; or, with ``options.ordered_masks`` at head_dim 64 or 128, any mask the kernel
    takes: the writer counts the earlier key blocks whose published hull holds the block."""
    prefix = spec.mask is None or spec.mask == Causal()
    return (
        eligible(spec, target, family, options)
        and (spec.head_dim <= 128 or (options.ordered_d256 and prefix))
        and (prefix or options.ordered_masks)
    )


def plan(
    spec: Spec,
    target: str,
    options: Options = Options(),
    *,
    causal_bits: bool = False,
    options_key: str = "",
    ordered_dq: bool = False,
    exact_softmax: bool = False,
    param_grads: tuple[str, ...] = (),
    sink: bool = False,
) -> BackwardPlan:
    """The Hopper backward (``templates/sm_90/bwd.cu.j2``): an atomic-dQ :class:`BackwardPlan`
    whose dK/dV kernel is FlashAttention-3's warp-specialized backward (Shah et al. 2024,
    section 3 and appendix B): two consumer warpgroups run the five GEMMs on wgmma with
    dK and dV in registers, a producer warpgroup (its registers given to the consumers with
    ``setmaxnreg``, :data:`PRODUCER_REGS` / :data:`CONSUMER_REGS`) loads Q, dO, lse and dsum
    into a :data:`STAGES`-deep mbarrier pipeline, and its second warp adds each step's dQ
    tile, staged in shared memory by the consumers, into ``dq_accum`` with TMA reductions
    (``cp.reduce.async.bulk.tensor``).  ``pre`` and ``convert`` are the FA2-class path's (the
    same macros, templates/common/bwd_rowops.j2, and the same ABI,
    :func:`~flashgen.families.bwd_common.backward_abi`), rendered in this unit.

    The dkdv ABI is the atomic path's plus the ``CUtensorMap`` arguments ``tma_q``,
    ``tma_k``, ``tma_v``, ``tma_do`` and (head_dim 64, 128) ``tma_dq``, an fp32 map of
    ``dq_accum``, built at launch from the named tensors.  head_dim 256 takes the split
    layout (:data:`~flashgen.families.tiles.HOPPER_BWD_TILES_SPLIT_D`, context ``split_d``):
    64-key CTAs whose warpgroups split dK, dV, dQ by head-dim columns, and whose consumers
    add dQ with 16-byte reductions into ``dq_accum`` in 64-row tiles in their
    accumulator's fragment order (no room for the staging tiles; ``dq_frag``).  ``ordered_dq``: the
    deterministic form (``Options.ordered_dq``): the dQ writer adds its tiles into a query
    block only after the CTAs of every earlier key block have (a semaphore per (batch, query
    head, query block), ``dq_sem`` int32 [B, Hq, ceil(Sq / BLOCK_M)], zeroed by the caller), so dQ
    is bitwise reproducible; the kernels are named ``..._wgmma_ordered_*``.  ``causal_bits``:
    see :func:`~flashgen.families.bwd_common.tile_classifier`.  ``exact_softmax``: P's
    exponent capped at 0 (:func:`~flashgen.families.bwd_common.base_fields`).
    ``param_grads``: params whose gradients the dK/dV kernel (``..._dkdv_dparam``)
    accumulates, every term a form :func:`flashgen.codegen.dparam.hopper_forms_ok` accepts
    (per CTA, per key, per relative position; the consumers wait for dP^T before the P^T
    pass and compute dS^T there, templates/common/dparam.j2); not with ``ordered_dq``.
    ``sink``: the sink form, the backward of a fused-sink forward (the pre kernel, named
    ``..._pre_sink``, takes the sink and writes ``lse`` and ``dsink``:
    :func:`~flashgen.families.bwd_common.backward_abi`; a spec with a sink only).
    Raises ``ValueError`` unless :func:`eligible` (family "auto"), for ``ordered_dq`` unless
    :func:`ordered_eligible`, and for ``param_grads`` the kernel cannot accumulate.
    """
    if not eligible(spec, target, options=options):
        raise ValueError(
            f"spec {spec.name!r} on {target}: the Hopper backward needs sm_90, head_dim == "
            f"head_dim_v in {list(HOPPER_BWD_HEAD_DIMS)}, no varlen, and a mask that reads no "
            "tensor (or hopper_bwd.tensor_masks)"
        )
    if ordered_dq and not ordered_eligible(spec, target, options=options):
        raise ValueError(
            f"spec {spec.name!r} on {target}: dQ in a fixed order needs head_dim 64 or 128 (256 "
            "with hopper_bwd.ordered_d256) and no mask or causal (another mask: "
            "hopper_bwd.ordered_masks, head_dim 64 or 128)"
        )
    if param_grads and (
        ordered_dq or not dparam.hopper_forms_ok(spec, param_grads, options.dparam_diagonal)
    ):
        raise ValueError(
            f"spec {spec.name!r}: the Hopper backward accumulates param gradients of the per-CTA, "
            f"per-key and (head_dim 64, 256, hopper_bwd.dparam_diagonal) relative-position forms "
            "only, without ordered_dq; "
            f"{', '.join(param_grads)} need the FA2-class backward"
        )
    d = spec.head_dim
    rec = dtype(spec.dtype)
    elt = rec.elem_bytes
    split_d = d > 128  # see HOPPER_BWD_TILES_SPLIT_D
    t = HOPPER_BWD_TILES_SPLIT_D if split_d else HOPPER_BWD_TILES
    abi = backward_abi(spec, atomic_dq=True, sink=sink)
    if d == 64 and options.d64_block_m != t.dkdv_block_m:
        t = replace(t, dkdv_block_m=options.d64_block_m)
    # dparam_affine: the terms summed in the dS^T pass, the steps of a unit without them
    affine = (dparam.affine_fields(spec, param_grads) or []) if options.dparam_affine else []
    dq_swap = (
        d == 128 and options.d128_block_m == 80
        and (spec.mask is None or isinstance(spec.mask, Causal) or options.masked_80)
        and (not param_grads or bool(affine))
        and (not ordered_dq or options.ordered_80)
    )  # fmt: skip
    if dq_swap:
        t = replace(t, dkdv_block_m=80)
    block_m, block_n = t.dkdv_block_m, t.dkdv_block_n
    # S^T, dP^T too wide to keep acc_s for dS^T: it reads the packed P^T back (see p_tile); so
    # does dparam_affine's dS^T pass (its sums take the registers acc_s held)
    ds_from_frag = (d == 64 and block_m == 128) or dq_swap or bool(affine and not split_d)
    warps = t.dkdv_warps + 4  # the producer warpgroup after the consumers
    threads = 32 * warps
    tma = (TmaArg("tma_q", "q", block_m), TmaArg("tma_k", "k", block_n),
           TmaArg("tma_v", "v", block_n), TmaArg("tma_do", "dout", block_m))  # fmt: skip
    if not split_d:  # the dQ writer's reductions: fp32 boxes of 32 columns x 64 (dq_swap: 80) rows
        dq_rows = block_m if dq_swap else 64
        tma += (TmaArg("tma_dq", "dq_accum", dq_rows, box_cols=32, dtype="fp32"),)
    # a residual mask's ordered dQ: the key blocks' hulls, published by their CTAs (ordered_masks)
    ordered_hull = ordered_dq and not (spec.mask is None or spec.mask == Causal())
    dkdv_args = abi["dkdv_args"] + ((KernelArg("dq_sem", "int*"),) if ordered_dq else ())
    if ordered_hull:
        dkdv_args += (KernelArg("dq_hull", "uint64_t*"),)
    block_table = needs_block_table(spec)  # (tensor_masks) classes from a table for its tiles
    if block_table:
        dkdv_args += tuple(KernelArg(n, t) for n, t in BLOCK_TABLE_ARGS)
    dkdv_args += dparam.kernel_args(spec, param_grads)
    dkdv_args += tuple(KernelArg(m.name, "CUtensorMap") for m in tma)
    base = f"flashgen_{spec.name}_bwd_{target}_wgmma{'_ordered' if ordered_dq else ''}"
    ctx = base_fields(
        spec, causal_bits, exact_softmax, param_grads, sink, options.diag_terms and not split_d,
        options.int_classifier,
    )  # fmt: skip
    # d256_sdp_warpgroups: S^T on warpgroup 0, dP^T on 1; dS^T reads P^T (* d score_mod /
    # d score, in its own buffers where that is not 1) back from shared memory
    sdp_wg = split_d and options.d256_sdp_warpgroups and not param_grads
    pg_wg = sdp_wg and ctx["score_grad_expr"] not in (None, "1.0f")
    smem = dkdv_smem_bytes(d, elt, block_m, block_n, split_d, dq_swap, int(pg_wg))
    # static arrays, in whole KiB as ptxas counts them: the coordinates (:func:`coords_dynamic`)
    # and dparam's sums, with a diagonal term's slots (8 consumer warps x
    # dparam.warp_diag_slots(query columns / 8) floats each, templates/common/dparam_diag.cuh)
    qn = block_m if not split_d or sdp_wg else block_m // 2
    diag = sum(f == "diagonal" for _, fs in grad_plan(spec, param_grads) for f in fs)
    static = 0 if coords_dynamic(dq_swap) and (not param_grads or affine) else 1024
    static += -(-diag * 8 * dparam.warp_diag_slots(qn // 8) * 4 // 1024) * 1024
    # diag_terms: per consumer warp and diagonal term QN + 16 words (sDiag); where they do not
    # fit (head_dim 128's 80-query steps), the per-element form
    diag_static = -(-len(ctx["diag_terms"]) * 8 * (qn + 16) * 4 // 1024) * 1024
    if diag_static and smem + static + diag_static > HOPPER_SMEM_LIMIT:
        ctx = base_fields(
            spec, causal_bits, exact_softmax, param_grads, sink, False, options.int_classifier
        )
        diag_static = 0
    static += diag_static
    if affine:  # each term's slots per consumer warp (:func:`affine_slots`)
        shift = affine_slots(len(affine), HOPPER_SMEM_LIMIT - smem - static)
        slots = len(affine) * MMA_WARPS * (32 >> shift)
        smem = dkdv_smem_bytes(d, elt, block_m, block_n, split_d, dq_swap, int(pg_wg), slots)
        tail = smem - (6 * 4 if coords_dynamic(dq_swap) else 0) - 4 * slots
        affine = [{**t, "slots": tail + 4 * i * slots // len(affine), "shift": shift}
                  for i, t in enumerate(affine)]  # fmt: skip
    if smem + static > HOPPER_SMEM_LIMIT:
        raise ValueError(
            f"spec {spec.name!r}: the Hopper backward's dK/dV kernel would take {smem + static} "
            f"bytes of shared memory (static included), over the {HOPPER_SMEM_LIMIT} a block "
            "takes"
        )
    ctx.update(
        atomic_dq=True,
        pre_args=abi["pre_args"],
        convert_args=abi["convert_args"],
        convert_threads=CONVERT_THREADS,
        pre_warps=PRE_WARPS,
        block_m=block_m,
        block_n=block_n,
        threads=threads,
        kernel_pre=f"{base}_pre{'_sink' if sink else ''}",
        kernel_dkdv=f"{base}_dkdv{'_dparam' if param_grads else ''}",
        kernel_convert=f"{base}_convert",
        dkdv_args=dkdv_args,
        dkdv_smem_bytes=smem,
        mma_t=rec.mma_t,
        wgmma_ns=sorted({block_m if sdp_wg else block_m // 2, d // 2}) if split_d
        else sorted({block_m, d}),
        split_d=split_d,
        sdp_wg=sdp_wg,
        coords_dynamic=coords_dynamic(dq_swap),
        dkv_n=d // 2 if split_d else d,  # N of the dV, dK (and dQ) wgmmas of one warpgroup
        tt_ns=[d // 2] if split_d else [64],  # N of the transposed-A dQ wgmma
        # CTA order: (batch, KV head) pairs in L2-sized groups (common/tile_order.cuh)
        bwd_tile_group=tile_group_expr(spec, backward=True) if options.head_groups else "1",
        ordered_dq=ordered_dq,
        ordered_hull=ordered_hull,
        ordered_desc=ordered_dq and options.ordered_descending,
        dq_rows_split=d == 64 and block_m == 128,
        dq_swap=dq_swap,
        ts_ns=[block_m] if dq_swap else [],  # N of dQ^T's wgmma (A transposed, B not)
        ds_from_frag=ds_from_frag or sdp_wg,
        # and from a packed P^T * d score_mod / d score (frag_pg) where that derivative is not 1
        # (no dparam: it computes dS^T itself)
        pg_frag=(ds_from_frag and not param_grads and ctx["score_grad_expr"] not in (None, "1.0f"))
        or pg_wg,
        # head_dim 256: dQ added in the accumulator's fragment order (16-byte reductions,
        # dq_accum in 64-row tiles, fg::dq_frag_coords), as FlashAttention-3's hdim-256 does
        dq_frag=split_d,
        dparam_affine=affine,
        # both warpgroups read each other's dS^T rows for dQ at head_dim 128 and at 64's 128-query
        # steps (DQ_ALL_KEYS / DQ_SPLIT_ROWS)
        ds_split_barrier=options.ds_split_barrier and not split_d and (d == 128 or block_m == 128),
        stagger_steps=options.stagger_steps and not ordered_dq and not param_grads,
        stages=STAGES,
        producer_regs=PRODUCER_REGS,
        consumer_regs=CONSUMER_REGS,
        # that give as many (exp2_poly_tiles over QN query columns)
        exp2_poly=exp2_poly_tiles(qn, options.exp2_poly)[1],
        **keep_terms(spec),
        block_table=block_table,
        **(table_classifier(spec, block_m, block_n) if block_table else {}),
        **dparam.const_tile_fields(spec, param_grads if options.dparam_const_tiles else ()),
    )
    if affine:  # the per-pair code of the P^T pass is not rendered
        ctx["dparam_terms"] = []
    context = Context(**ctx)

    def kp(name: str, warps: int, smem_bytes: int, args, tma_args=()) -> KernelPlan:
        return KernelPlan(
            spec_name=spec.name,
            target=target,
            template=HOPPER_BWD_TEMPLATE,
            kernel_name=name,
            tiles=TileConfig(16 * warps, 16, warps),
            smem_bytes=smem_bytes,
            args=tuple(args),
            context=context,
            tma=tma_args,
            options_key=options_key,
        )

    pre = kp(context.kernel_pre, PRE_WARPS, 0, abi["pre_args"])
    dkdv = kp(context.kernel_dkdv, warps, smem, dkdv_args, tma)
    convert = kp(context.kernel_convert, CONVERT_THREADS // 32, 0, abi["convert_args"])
    return BackwardPlan(spec.name, target, t, pre, dkdv, None, convert, atomic_dq=True)
