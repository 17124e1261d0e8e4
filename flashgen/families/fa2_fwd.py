"""The FA2-class forward (``templates/sm_80/fwd.cu.j2``; Dao 2023, Algorithm 1): every
target, every head dim, varlen, block tables.  :func:`plan` lowers a spec to its
:class:`~flashgen.codegen.plan.KernelPlan`; :class:`Options` holds its knobs."""

from __future__ import annotations

from dataclasses import dataclass

from flashgen.codegen.abi import TABLE_ROW_SMEM, check_target, needs_block_table
from flashgen.codegen.cuda_expr import split_causal
from flashgen.codegen.plan import KernelPlan, TileConfig
from flashgen.families import tiles as tile_tables
from flashgen.families.common import SMEM_LIMIT, ForwardContext, forward_context, mma16_dtype
from flashgen.families.fields import check_fields
from flashgen.frontend.ir import Spec

#: The template this family renders.
TEMPLATE = "sm_80/fwd.cu.j2"

#: Code-generation switches of the FA2-class forward template (``templates/sm_80/fwd.cu.j2``);
#: each changes only how the same algorithm is emitted, and ``flashgen ab`` times them
#: against each other (``--option fa2_fwd.<name>=...``).  ``fwd_unrolled_loads``: tile loads with a
#: compile-time trip count and one pointer per thread (the generic loop compiled to a
#: runtime loop with a remainder inside the main loop).  ``fwd_hoisted_swizzle``:
#: ldmatrix addresses as a per-lane offset XORed with constants (as CuTe's swizzled
#: layouts do).  ``fwd_fold_scale``: without a score_mod, S stays raw (its row max taken raw)
#: and log2(e) * softmax_scale is folded into P's exponent (FA2's ``scale_apply_exp2`` FFMA;
#: at logits near 1e11 its residual overflows P; ``Options.exact_softmax`` rounds the scaled
#: score first instead).
#: ``fwd_lazy_rescale``: O is rescaled only when a row max of the warp moved (a warp vote
#: around the multiplies; off until measured).  ``fwd_even_loads``: with unrolled loads, a
#: tile wholly inside the sequence is loaded without per-row checks and selects (FA2's
#: ``Is_even_MN``); at d256 128x64x8 it frees 7-13 registers and ptxas then issues each
#: ldmatrix further ahead of its mma (docs/perf-notes.md); off until measured (a tuning-table
#: entry's ``options`` may turn it on per GPU, see :mod:`flashgen.tuning`).
#: ``fwd_row_chunks``: with unrolled loads, FA2's copy layout: 8 threads per row, each taking
#: 16-byte chunks 128 bytes apart, so one swizzled shared base and one global pointer per row
#: serve all of a thread's chunks (the default layout recomputes the swizzle per chunk when
#: a thread's rows are not 8 apart, e.g. d256 with 4 warps).  Each tile takes it where its
#: width is a multiple of 64 elements, the warp count is even and its rows a multiple of
#: 4 * warps (else the default layout: e.g. the 48-row K/V tiles of 128x48x8); at d128 on 4
#: warps it costs registers (spills at 128x64x4), so it is off by default and a tuning-table
#: entry turns it on at d256 on 64x64x4, where it was worth it (without it those tiles sit at
#: the register limit, and with ``fwd_even_loads`` instead spill non-causal; see
#: docs/perf-notes.md).
FORWARD_OPTIONS: dict[str, bool] = {
    "fwd_unrolled_loads": True,
    "fwd_hoisted_swizzle": True,
    "fwd_fold_scale": True,
    "fwd_lazy_rescale": False,
    "fwd_even_loads": False,
    "fwd_row_chunks": False,
}
#: Head dims (max(head_dim, head_dim_v)) whose FA2-class forward takes ``fwd_lazy_rescale``
#: even where :data:`FORWARD_OPTIONS` has it off (an explicit ``options=`` entry still
#: wins): lets a head dim where lazy rescaling won (a ``flashgen ab`` run over
#: ``fa2_fwd.fwd_lazy_rescale``) adopt it without the others.  At d256 the rescale of the
#: wide accumulator is costly enough that skipping it pays; at d64 it did not clearly (see
#: docs/perf-notes.md).
LAZY_RESCALE_HEAD_DIMS: frozenset[int] = frozenset({256})
#: Head dims (max(head_dim, head_dim_v)) whose FA2-class forward takes its CTAs in head groups
#: (:func:`tile_group_expr`) by default.  The grouped order's CTA coordinates cannot be
#: recomputed from ``blockIdx.x`` in one instruction, so they hold a register or two over the
#: key loop: the d96 kernels, already at the register limit, spill with them; d64 / d128 /
#: d256 do not, and gain from the better L2 reuse of K/V on causal problems
#: (docs/perf-notes.md).
HEAD_GROUP_FA2_HEAD_DIMS: frozenset[int] = frozenset({64, 128, 256})


@dataclass(frozen=True)
class Options:
    """Knobs of the FA2-class forward.  The template switches (``fwd_*``, see
    :data:`FORWARD_OPTIONS`) are ``None`` for their default (:data:`FORWARD_OPTIONS`, the
    head-dim rule :data:`LAZY_RESCALE_HEAD_DIMS`, then a tuning-table entry's ``options``
    with its tiles), or a bool that wins over those.  ``head_groups``: the CTAs take their
    tiles in L2 head groups (at :data:`HEAD_GROUP_FA2_HEAD_DIMS`; False: head-major).
    ``affine``: FULL tiles split an affine score_mod
    (:func:`flashgen.families.common.affine_context`).  ``fused_sink`` (on by default): for
    a spec with a sink (``sink:``), the kernel joins it to each row's denominator in its
    epilogue, ``o = o_keys * sigmoid(lse - sink)`` in fp32 before the store, from a float32
    logit per (batch, query head) it takes per call (``sink``, ``sink_sb``, ``sink_sh``:
    :func:`flashgen.codegen.abi.sink_args`; per sequence for varlen; null: the keys alone);
    lse stays the keys' alone.  False: the kernel takes no sink and the op applies it after
    the kernel with torch ops (:func:`flashgen.ops.sink.apply_sink`).  No effect on a spec
    without a sink (its unit renders unchanged)."""

    fwd_unrolled_loads: bool | None = None
    fwd_hoisted_swizzle: bool | None = None
    fwd_fold_scale: bool | None = None
    fwd_lazy_rescale: bool | None = None
    fwd_even_loads: bool | None = None
    fwd_row_chunks: bool | None = None
    head_groups: bool = True
    affine: bool = True
    fused_sink: bool = True

    def __post_init__(self) -> None:
        check_fields(self, "Options.fa2_fwd")

    def switches(self) -> dict[str, bool]:
        """The template switches set explicitly (not None)."""
        return {k: getattr(self, k) for k in FORWARD_OPTIONS if getattr(self, k) is not None}


@dataclass(frozen=True)
class Context(ForwardContext):
    """The template context of the FA2-class forward: :class:`ForwardContext` plus its
    shared-memory layout and code-generation switches."""

    smem_bytes: int
    table_smem: int
    fwd_unrolled_loads: bool
    fwd_hoisted_swizzle: bool
    fwd_fold_scale: bool
    fwd_lazy_rescale: bool
    fwd_even_loads: bool
    fwd_row_chunks: bool
    fold_scale: bool
    load_chain: bool


def tiles(spec: Spec, target: str, gpu: str | None = None) -> TileConfig:
    """This family's tiles for ``spec`` (:func:`flashgen.families.tiles.fa2_tiles`)."""
    return tile_tables.fa2_tiles(spec, target, gpu)


def plan(
    spec: Spec,
    target: str,
    options: Options = Options(),
    *,
    gpu: str | None = None,
    tiles: TileConfig | None = None,
    side_terms: bool = True,
    exact_softmax: bool = False,
    options_key: str = "",
) -> KernelPlan:
    """Lower ``spec`` to the FA2-class forward for ``target`` (``sm_80``, or ``sm_90`` compiled
    for ``sm_90a``).  ``gpu`` (the CUDA device name, optional) selects tuned tiles and their
    template switches from the tuning table (:mod:`flashgen.tuning`); ``tiles`` replaces the
    choice (the spill fallback passes its candidates).  ``side_terms``: the kernel reads the
    mask's one-sided tensor reads once per query row and once per key column of a masked
    tile (:mod:`flashgen.analysis.rowcol`; never for varlen); False keeps them per element.
    ``exact_softmax`` (:attr:`flashgen.options.Options.exact_softmax`): P = exp2(x - max)
    with x rounded exactly as the row max was (one FMUL per element more than FA2's FFMA
    where the scale is folded), so the max's P is 1 and none exceeds 1 at huge logits.
    ``options_key``: recorded on the plan (the kernel cache key).

    Raises ``ValueError`` for a target or dtype this version cannot lower, tiles that are
    not legal, or a varlen spec whose mask reads tensors."""
    check_target(target)
    elt = mma16_dtype(spec, "the FA2-class forward").elem_bytes
    explicit = options.switches()
    opts = dict(FORWARD_OPTIONS)
    if max(spec.head_dim, spec.head_dim_v) in LAZY_RESCALE_HEAD_DIMS:
        opts["fwd_lazy_rescale"] = True
    opts.update(explicit)
    if spec.varlen and needs_block_table(spec):
        raise ValueError(
            "a varlen spec's mask cannot read tensor params (the block table is per padded "
            "batch); varlen already separates the sequences"
        )
    tiles = tiles or tile_tables.fa2_tiles(spec, target, gpu)
    # A tuning-table entry's switches come with its tiles (explicit options win); the spill
    # fallback passes the table's tiles explicitly, so compare.
    for key, value in tile_tables.table_options(spec, target, gpu, tiles).items():
        if key in opts and key not in explicit:
            opts[key] = value
    d, dv = spec.head_dim, spec.head_dim_v
    if tiles.block_m % (16 * tiles.num_warps):
        raise ValueError(f"BLOCK_M={tiles.block_m} must be a multiple of 16*num_warps")
    if tiles.block_n % 16:
        raise ValueError(f"BLOCK_N={tiles.block_n} must be a multiple of 16")
    # sQ (also stages the [BLOCK_M x Dv] output, so max(d, dv) wide), sK, sV: the kernel's
    # SQ_BYTES + SK_BYTES + BLOCK_N * Dv * elem_bytes
    smem = (tiles.block_m * max(d, dv) + tiles.block_n * d + tiles.block_n * dv) * elt
    table_smem = TABLE_ROW_SMEM if needs_block_table(spec) else 0
    smem += table_smem
    if smem > SMEM_LIMIT[target]:
        raise ValueError(
            f"tiles {tiles.block_m}x{tiles.block_n} need {smem} B of shared memory at head_dim "
            f"{d}/{dv}, more than a CTA may use on {target} ({SMEM_LIMIT[target]} B): pick a "
            "smaller tiles.block_m or tiles.block_n"
        )
    # Varlen specs never get here with a tensor-reading mask (refused above): no terms.
    ctx = forward_context(
        spec,
        target,
        tiles,
        side_terms=side_terms and not spec.varlen,
        affine=options.affine,
        head_groups=options.head_groups and max(d, dv) in HEAD_GROUP_FA2_HEAD_DIMS,
        exact_softmax=exact_softmax,
        sink=options.fused_sink,
    )
    ctx["smem_bytes"] = smem  # the template static_asserts its layout against this
    ctx["table_smem"] = table_smem
    ctx.update(
        opts,
        fold_scale=opts["fwd_fold_scale"] and spec.score_mod is None,
        load_chain=uses_load_chain(spec, tiles),
    )
    context = Context(**ctx)
    return KernelPlan.of(spec.name, target, TEMPLATE, tiles, smem, context, options_key)


def uses_load_chain(spec: Spec, tiles: TileConfig) -> bool:
    """Whether the FA2-class forward emits its unrolled tile loads as a pointer chain
    (``g += ROW_STEP * stride`` per row) instead of ``base + it * ROW_STEP * stride``
    offsets.  Chosen by ptxas register counts (docs/perf-notes.md): the chain keeps specs
    with per-element DSL math (score_mod, residual mask) spill-free, and plain head_dim
    <= 64 with 128-row key blocks (FA2's d64 tile 128x128x4): there ptxas hoists the eight
    64-bit row offsets of the K and V loads out of the main loop and spills them (24-96
    bytes).  The offsets keep plain d128 at 128x64x4 spill-free."""
    if spec.score_mod is not None or split_causal(spec.mask)[1] is not None:
        return True
    return max(spec.head_dim, spec.head_dim_v) <= 64 and tiles.block_n >= 128

