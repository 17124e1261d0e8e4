"""The decode family: FlashDecoding split-KV attention over a dense or paged KV cache, with
GQA packing (no torch, no CuPy: planning only).

One compile unit per (spec, target) holds two kernels (``templates/sm_80/decode.cu.j2``):

* ``<kernel>_attn``: grid (query row blocks x splits, kv heads, batch).  A CTA's query rows
  are the ``Hq / Hkv`` query heads of one kv head times the ``Sq_new`` new queries, packed
  ``row = s * group + g`` (FlashAttention-3's pack_gqa), 16 rows per CTA (one mma.sync
  m16n8k16 row tile); each warp takes a quarter of every key block's columns, so one
  ``BLOCK_N``-key block of K and V is read once per kv head group, through a ``stages``-deep
  cp.async ring.  The key blocks a split reads are its share of the request's live blocks
  (:func:`split_range`, also ``fg::dec::split_range`` on the device); blocks the mask's
  interval classifier (:mod:`flashgen.analysis.masktiles`) proves EMPTY are skipped unread.
  A mask that reads tensors (:func:`tensor_mask`) also votes, before the loads, on the
  blocks the classifier leaves PARTIAL (a block no (query, key) pair keeps is never read),
  and its splits take every ``eff_splits``-th block (:func:`strided_split`).
  A request uses :func:`effective_splits` of the ``num_splits`` (the other CTAs return at
  once).  With one split the kernel writes ``o`` / ``lse``, else fp32 partial ``o`` and
  ``lse`` to a workspace, and the last CTA of the splits of a (row block, kv head, request)
  to finish (an atomic counter per tile, reset by that CTA) merges them: the exact LSE
  merge (FlashAttention's flash_fwd_combine: ``lse = m + log(sum exp(lse_i - m))``, ``o =
  sum exp(lse_i - lse) o_i``) in split order, so bitwise reproducible for a fixed
  ``num_splits`` whichever CTA is last.  Fused rather than a second kernel: at B1 the
  combine's launch and drain were a visible share of a 64k call.
* ``<kernel>_append``: writes ``k_new`` / ``v_new`` into the cache at ``cache_seqlens[b]``
  through the block table (rows past the request's pages are dropped).

FP8 KV cache (``plan(..., cache_dtype="fp8_e4m3")``, units ``flashgen_<spec>_decode_kv8_*``):
the cache holds e4m3 bytes (:data:`flashgen.codegen.dtypes.DTYPES`' record: 1 byte), q and
o stay in the spec's fp16 / bf16.  The ring holds the 1-byte rows as loaded (half the bytes
of a 2-byte cache per key); a warp converts its K / V fragments to the MMA type in
registers (``templates/common/decode_fp8.cuh``: bit moves and one exact multiply per pair,
no table, no shared-memory round trip).  A 32-bit word of four e4m3 from ``ldmatrix``
becomes the pairs (byte 0, byte 2) and (byte 1, byte 3): for K that fixes the order of the
head dim inside each 16-wide k step, so the Q tile is stored with its columns permuted to
match (:func:`fp8_k_order`); for V (``ldmatrix.trans`` of byte pairs) the two pairs are the
even and odd output columns of one 16-column chunk, two MMAs.  Per (request, kv head)
descales (FlashAttention-3's ``[B, Hkv]``: true K = ``k_descale[b, h_kv] * K_fp8``) fold into
the softmax scale (k) and the output normalization (v).

Attention sink (``Options.fused_sink`` on a spec with ``sink:``; the math is
:mod:`flashgen.ops.sink`'s, the device code ``templates/common/decode_sink.cuh``): the
attention kernel takes a float32 logit per (request, query head), ``sink[b * sink_sb + h *
sink_sh]`` (null: the keys alone), and scales each row's output by ``sigmoid(lse - sink)`` in
fp32 where it is stored: the one split's epilogue, or the merge, each split's weight times
that factor.  The partials and the lse stay the keys' alone, so the op's results merge as
before (:func:`flashgen.merge_attention`, ring attention).  The unit keeps its kernel names;
the option is in its cache key.

Hopper MLA unit (:attr:`Options.mla_unit` ``"wgmma"``, or ``"auto"`` where a call's shape
fills it, target ``sm_90``, a ``v_from_k`` spec: ``templates/sm_90/decode_mla.cu.j2``, units
``flashgen_<spec>_decode_[ragged_]wgmma_sm_90_*``): the same two kernels and arguments, for
MLA's one latent cache.  A CTA's rows are
:data:`MLA_BLOCK_M` packed query rows (the M of a wgmma; the grid is :func:`geometry`'s with
that block), each :data:`MLA_BLOCK_N`-key block of 576-column rows is read once per CTA, by
cp.async through the block table, into a two-stage ring, and three warpgroups share it: the
first computes S = Q K^T (wgmma from shared memory), the mask and the online softmax and hands
P and the rows' rescale factors to the two others through shared memory (mbarriers), which own
256 output columns each (O = alpha O + P V, wgmma, V the rows' first 512 columns).  Splits,
the fused combine (the same template code), masks, score_mods and sinks are as above; a mask
that reads tensors is evaluated per element, without the vote.  :func:`mla_wgmma_support` says
where it does not apply (an e4m3 cache among them), and the mma.sync unit is planned there.
Which of the two MLA units a call runs is a per-shape choice (:func:`mla_unit_for_call`, the
rule :func:`mla_auto_unit`): :func:`plan` itself takes the unit its options name, ``"auto"``
without a call's shape giving the mma.sync unit (``flashgen show`` / ``build`` / ``generate``).

Semantics (as the padded op on the gathered cache): request ``b`` has ``L = cache_seqlens[b]
(+ Sq_new with k_new)`` live keys; the spec's mask and score_mod see ``q_idx`` in
``[0, Sq_new)``, ``kv_idx`` in ``[0, L)``, ``seqlen_q = Sq_new``, ``seqlen_k = L``, so a query's
absolute position is ``q_idx + seqlen_k - seqlen_q`` (bottom-right, as the prefill's causal).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, replace

from flashgen.analysis import masktiles
from flashgen.codegen.abi import KernelArg, sink_args
from flashgen.codegen.cuda_expr import Invariants, cuda_expr, split_causal
from flashgen.codegen.dtypes import CTYPE, DType, dtype
from flashgen.codegen.plan import KernelPlan, TemplateContext
from flashgen.families.fields import check_fields
from flashgen.frontend import ir
from flashgen.frontend.ir import Spec, Ty

#: Query rows per CTA: one m16n8k16 row tile (the packed GQA group times Sq_new is split
#: into blocks of this many rows).
BLOCK_M = 16
#: Warps along a key block's columns; each takes BLOCK_N / NUM_WARPS of them.  Heads of
#: Dv >= 192 double the warps, each pair splitting the output's columns (DV_SPLIT): the
#: accumulators of 16 rows x 256 columns in one warp leave ptxas too few registers.
NUM_WARPS = 4
DV_SPLIT_FROM = 192
#: Threads of the append kernel's CTA (one new row of K and V per CTA).
APPEND_THREADS = 32
#: FlashAttention-3's cap on the number of splits.
MAX_SPLITS = 128
#: Leading pointer arguments of the attention kernel that change per call (q, k_cache,
#: v_cache, o, lse, cache_seqlens, block_table) and of the append kernel (k_new, v_new,
#: k_cache, v_cache, cache_seqlens, block_table).
CALL_POINTERS = 7
APPEND_CALL_POINTERS = 6
#: The FP8-cache unit's attention kernel also takes ``k_descale`` and ``v_descale`` among its
#: per-call pointers (after the seven above).
CALL_POINTERS_KV8 = 9
#: Cache element types a decode unit can read besides the spec's own dtype (by
#: :mod:`flashgen.codegen.dtypes` name), and the spec dtypes each may serve.
CACHE_DTYPES = {"fp8_e4m3": ("fp16", "bf16")}
#: Fewest key blocks per split (``fg::dec::MIN_SPLIT_BLOCKS``): see :func:`effective_splits`.
MIN_SPLIT_BLOCKS = 2
#: Deepest cp.async ring ``Options.stages`` may ask for (a single-request call streams a short
#: cache fastest with many blocks in flight per CTA: 7 key blocks of 64 bf16 d128 rows are
#: 224 KiB of K and V ahead, one CTA per H100 / H200 SM; what fits is checked at plan time).
MAX_STAGES = 8
#: Split partials a merge thread loads per step (``Options.merge_unroll``, the unroll of the
#: fused combine's split loop): 4 as before, or more L2 loads in flight per thread.
MERGE_UNROLLS = (4, 8, 16)
#: ``Options.balance_waves``: the fill of the last wave it aims for, and the most splits it
#: tries (each split adds one fp32 partial per row to the merge).
BALANCE_FILL = 0.9
BALANCE_MAX_SPLITS = 4
#: Shared memory a CTA may use on each target (sm_80: A100's 163 KiB; the kernel is
#: planned against it on both targets, so one plan fits both).
SMEM_LIMIT = {"sm_80": 166912, "sm_90": 166912}
#: What explicit ``Options`` may use on sm_90 (H100/H200: 227 KiB per CTA); the defaults
#: stay within :data:`SMEM_LIMIT`.
SMEM_LIMIT_EXPLICIT = {"sm_80": 166912, "sm_90": 232448}
TARGETS = ("sm_80", "sm_90")
#: Key blocks of a split whose keys a mask that reads tensors votes on before loading them (a byte
#: of shared memory each; blocks past them are read unvoted): 64k keys at 64 per block.
VOTE_BLOCKS = 1024
#: The Hopper MLA unit (:attr:`Options.mla_unit`, ``templates/sm_90/decode_mla.cu.j2``): 64 packed
#: query rows per CTA (query heads x new tokens: the M of a wgmma), 64-key blocks in a ring of two
#: stages (each a block's 576-column rows, read once for K and V), three warpgroups (the scores and
#: softmax; output columns 0..255; 256..511), one CTA per SM.
MLA_BLOCK_M = 64
MLA_BLOCK_N = 64
MLA_STAGES = 2
MLA_WARPS = 12
#: The head dims the Hopper MLA unit is written for (its panels and warpgroup split).
MLA_HEAD_DIMS = (576, 512)
#: Values of :attr:`Options.mla_unit`: ``auto`` (opt-in: per call shape, :func:`mla_auto_unit`),
#: the mma.sync unit (``templates/sm_80/decode.cu.j2``, the default) or the Hopper wgmma unit.
MLA_UNITS = ("auto", "mma_sync", "wgmma")
#: ``mla_unit="auto"`` runs the wgmma unit where one of its CTAs replaces at least this many
#: key-block loads of the mma.sync unit (:attr:`MlaWork.work`: the blocks it streams under the
#: split heuristic times the 16-row mma.sync CTAs its 64 rows take; :func:`mla_auto_unit` has
#: the H100 table it comes from).
MLA_AUTO_MIN_WORK = 24


def tensor_mask(spec: Spec) -> bool:
    """Whether ``spec``'s mask reads tensor params (its units vote on their blocks: the
    template's ``s_keep``, :data:`VOTE_BLOCKS`)."""
    return spec.mask is not None and any(isinstance(n, ir.Index) for n in ir.walk(spec.mask))


@dataclass(frozen=True)
class Options:
    """Typed knobs of the decode family (all optional; defaults by head dim).

    ``block_n``: keys per pipeline stage (a multiple of ``16 * NUM_WARPS``); ``stages``:
    depth of the cp.async ring (2..:data:`MAX_STAGES`: ``stages - 1`` blocks in flight per
    CTA; beyond 4 only where the ring fits the target's shared memory, e.g. block_n 64 at
    d128 on sm_90 up to 6 stages); ``num_splits``: a fixed split count (1..128), or
    None for :func:`num_splits_heuristic` per call; ``pack_gqa``: pack the query heads of a
    kv head into one CTA's rows (False: one query head per CTA, each K/V block read once per
    query head; kept to measure what packing buys).

    Schedule knobs (the ``flashgen.bench.decode --sweep`` grid): ``ctas_per_sm``: CTAs an SM
    is planned to hold (1..4; None: as many as shared memory allows, at most 4), which sizes
    the heuristic's wave and is the kernel's ``__launch_bounds__`` minimum (so registers
    leave room for them); ``split_waves``: the heuristic fills this many waves (0.25..4;
    1: one CTA per resident slot); ``min_split_blocks``: fewest key blocks per split (1..16,
    ``fg::dec::effective_splits``; fewer lets a short cache use more CTAs, more keeps the
    merge's partials few).  The split combine is always fused (the last CTA merges);
    ``merge_unroll`` (4, 8 or 16, :data:`MERGE_UNROLLS`) is the unroll of its loop over the
    splits' fp32 partials, i.e. the L2 loads each merge thread has in flight (the sum's order,
    hence the result, is the same for every value; the last CTA's merge is the tail of every
    split call, its loads one L2 round trip per step).

    ``balance_waves`` (off by default; a host schedule knob; not with a fixed ``num_splits``,
    which it would not change: ``ValueError``): where the CTAs without splitting
    already fill 80% of a wave (no split otherwise), split each request in the fewest parts
    (up to :data:`BALANCE_MAX_SPLITS`) whose CTAs fill their last wave to at least
    :data:`BALANCE_FILL` (:func:`balanced_splits`): B64 8k at 3 CTAs per SM is 512 CTAs on
    396 slots, a second wave 29% full, and 3 splits make it 1536 CTAs, 97% of 4 waves.

    ``fused_sink`` (on by default): for a spec with a sink (``sink:``), the attention kernel
    joins it to each row's denominator in its epilogue, ``o = o_keys * sigmoid(lse - sink)``
    in fp32 (the one split's store, or the merge's weights), from a float32 ``[B, Hq]`` it
    takes per call (lse stays the keys' alone); off, ``op.with_kvcache`` applies the sink
    with torch ops after the kernel (:func:`flashgen.ops.sink.apply_sink`), as it always does
    for calls through the registered torch ops (CPU, ``torch.compile``).  No effect on a spec
    without a sink (its unit renders unchanged).

    ``mla_unit`` (one of :data:`MLA_UNITS`; ``"mma_sync"`` by default until ``"auto"`` has run
    on a GPU, with compute-sanitizer over the wgmma unit it switches to): which unit a
    ``v_from_k`` spec (MLA's one latent cache) runs.  ``"wgmma"``: on ``sm_90`` the Hopper unit
    ``templates/sm_90/decode_mla.cu.j2`` (:func:`plan`): 64 packed query rows per CTA, wgmma
    for Q K^T and P V, each 64-key block of the latent cache read once per CTA for both K and
    V (see :data:`MLA_BLOCK_M`); where it does not apply (:func:`mla_wgmma_support`: another
    target, an e4m3 cache) the family plans the mma.sync unit and the op warns
    (:func:`mla_wgmma_fallback`).  ``"mma_sync"``: always the mma.sync unit (16 rows per CTA).
    ``"auto"`` (opt-in): per call shape, where the shape is known (``op.plan_decode`` for its
    plan, else each call: :func:`mla_unit_for_call`): on ``sm_90`` the wgmma unit where the
    call's rows fill enough work per CTA (:func:`mla_auto_unit`), else, and always on
    ``sm_80`` or with an e4m3 cache, the mma.sync unit; :func:`plan` without a call's shape
    takes the mma.sync unit.
    No effect on a spec without ``v_from_k``.  ``block_n``, ``stages`` and ``ctas_per_sm`` do
    not shape the Hopper unit."""

    block_n: int | None = None
    stages: int | None = None
    num_splits: int | None = None
    pack_gqa: bool = True
    ctas_per_sm: int | None = None
    split_waves: float = 1.0
    min_split_blocks: int = MIN_SPLIT_BLOCKS
    fused_sink: bool = True
    merge_unroll: int = 4
    balance_waves: bool = False
    mla_unit: str = "mma_sync"

    def __post_init__(self) -> None:
        if not isinstance(self.mla_unit, str) or self.mla_unit not in MLA_UNITS:  # its values
            raise ValueError(
                f"Options.decode.mla_unit={self.mla_unit!r}: expected one of "
                f"{', '.join(map(repr, MLA_UNITS))}, got {self.mla_unit!r}"
            )
        check_fields(self, "Options.decode")
        if self.block_n is not None and (self.block_n <= 0 or self.block_n % (16 * NUM_WARPS)):
            raise ValueError(
                f"Options.decode.block_n={self.block_n!r}: block_n must be a positive multiple "
                f"of {16 * NUM_WARPS}"
            )
        if self.stages is not None and not 2 <= self.stages <= MAX_STAGES:
            raise ValueError(
                f"Options.decode.stages={self.stages!r}: stages must be an int in [2, {MAX_STAGES}]"
            )
        if self.num_splits is not None and not 1 <= self.num_splits <= MAX_SPLITS:
            raise ValueError(
                f"Options.decode.num_splits={self.num_splits!r}: num_splits must be in "
                f"[1, {MAX_SPLITS}]"
            )
        if not isinstance(self.pack_gqa, bool):
            raise ValueError("pack_gqa must be a bool")
        if self.ctas_per_sm is not None and (
            isinstance(self.ctas_per_sm, bool) or self.ctas_per_sm not in (1, 2, 3, 4)
        ):
            raise ValueError(
                f"Options.decode.ctas_per_sm={self.ctas_per_sm!r}: ctas_per_sm must be None or 1..4"
            )
        if (
            isinstance(self.split_waves, bool)
            or not isinstance(self.split_waves, numbers.Real)
            or not 0.25 <= self.split_waves <= 4
        ):
            raise ValueError(
                f"Options.decode.split_waves={self.split_waves!r}: split_waves must be a number "
                "in [0.25, 4]"
            )
        if isinstance(self.min_split_blocks, bool) or self.min_split_blocks not in range(1, 17):
            raise ValueError(
                f"Options.decode.min_split_blocks={self.min_split_blocks!r}: min_split_blocks "
                "must be an int in [1, 16]"
            )
        if self.balance_waves is True and self.num_splits is not None:
            raise ValueError(
                f"Options.decode.balance_waves=True with Options.decode.num_splits="
                f"{self.num_splits!r}: expected num_splits None with balance_waves (it picks "
                "the split count; a fixed one leaves it nothing to do): set one of them"
            )
        if self.merge_unroll not in MERGE_UNROLLS:
            raise ValueError(
                f"Options.decode.merge_unroll={self.merge_unroll!r}: merge_unroll must be one of "
                f"{', '.join(map(str, MERGE_UNROLLS))}"
            )

    def unit_key(self) -> tuple:
        """The fields that change the compiled unit (the rest are host schedule knobs);
        ``mla_unit`` only as ``"wgmma"``, the one value whose unit differs (``"auto"`` is
        resolved per call before units are loaded, :func:`mla_unit_for_call`; the key of the
        default options is as before the option)."""
        key = (self.block_n, self.stages, self.ctas_per_sm, self.min_split_blocks,
               self.fused_sink, self.merge_unroll)  # fmt: skip
        return key + (("mla_wgmma",) if self.mla_unit == "wgmma" else ())


@dataclass(frozen=True)
class DecodeTiles:
    """Tile shape of a decode unit (``num_warps`` gives the launcher its thread count)."""

    block_m: int
    block_n: int
    num_warps: int
    stages: int

    @property
    def threads(self) -> int:
        return self.num_warps * 32


@dataclass(frozen=True)
class DecodeContext(TemplateContext):
    """What ``templates/sm_80/decode.cu.j2`` reads (one unit: the attention kernel, whose last
    CTA of a tile merges the splits, and the append kernel).  ``args`` / ``append_args``: each
    kernel's :class:`~flashgen.codegen.abi.KernelArg` tuple; ``mask_expr`` /
    ``score_mod_expr``: the spec's DSL as CUDA (None without), ``prologue`` their hoisted
    invariants; ``tile_classifier``: the mask's interval classifier source.  ``ragged``:
    the ragged-Sq_new unit (q ``[total_q, Hq, D]`` with ``cu_seqlens_q``; False renders the
    padded unit unchanged).  ``kv_fp8``: the cache holds e4m3 (``kv_t`` its C type; False
    renders the spec-dtype unit unchanged).  ``v_from_k``: MLA's one latent cache (the
    spec's ``v_from_k``): the ring holds K only, P V reads the first ``head_dim_v`` columns of
    its rows, the append writes K rows only.  ``exact_softmax``
    (:attr:`flashgen.options.Options.exact_softmax`): the scaled scores rounded as written
    (``__fmul_rn``: never contracted into P's exponent) and the split merge's weights
    normalized by their sum (``fg::dec::merge_stats``, ``fg::dec::normalized_weight``).
    ``sink`` (:attr:`Options.fused_sink` on a spec with a sink): the attention kernel takes
    ``sink`` / ``sink_sb`` / ``sink_sh`` (:func:`attn_args`) and scales each row's output by
    ``sigmoid(lse - sink)`` (``fg::dec::sink_share``, templates/common/decode_sink.cuh).
    ``merge_unroll`` (:attr:`Options.merge_unroll`): the unroll of the fused combine's loop
    over the splits.  ``mla_wgmma``: the context of the Hopper MLA unit
    (``templates/sm_90/decode_mla.cu.j2``, which also reads ``mma_t``, the wgmma operand type;
    False renders today's units unchanged)."""

    spec_name: str
    base_name: str
    kernel_name: str
    dtype: str
    elem_t: str
    head_dim: int
    head_dim_v: int
    block_m: int
    block_n: int
    num_warps: int
    dv_split: int
    stages: int
    smem_bytes: int
    causal: bool
    mask_expr: str | None
    score_mod_expr: str | None
    prologue: str
    tile_classifier: str
    tile_class_args: str
    mask_reads_h: bool
    pack_gqa: bool
    min_split_blocks: int
    ctas_per_sm: int
    args: tuple
    append_args: tuple
    ragged: bool = False
    kv_fp8: bool = False
    kv_t: str = ""
    v_from_k: bool = False
    tensor_mask: bool = False
    vote_blocks: int = VOTE_BLOCKS
    exact_softmax: bool = False
    sink: bool = False
    merge_unroll: int = 4
    mma_t: str = ""
    mla_wgmma: bool = False


@dataclass(frozen=True)
class DecodePlan(KernelPlan):
    """Everything needed to render, compile and launch one decode unit: a
    :class:`flashgen.codegen.plan.KernelPlan` (so :mod:`flashgen.build` and
    :mod:`flashgen.runtime.launch` take it) whose ``context`` is a :class:`DecodeContext` and whose
    ``kernel_name`` is the attention kernel; :meth:`kernel` gives the plan of each of the
    unit's kernels (``attn``, ``append``, its ``role``) to load from the same
    cubin."""

    role: str = "attn"

    @property
    def base_name(self) -> str:
        return self.context["base_name"]

    def kernel(self, role: str) -> DecodePlan:
        """The plan of kernel ``role`` (``attn``, ``append``) of this unit: same source and
        cubin, its own symbol, threads, dynamic shared memory and arguments."""
        if role == "attn":
            return self
        if role == "append":
            tiles = DecodeTiles(1, 1, APPEND_THREADS // 32, 1)
            elem_t = self.context.get("kv_t") or self.context["elem_t"]
            return replace(
                self, kernel_name=f"{self.base_name}_append", tiles=tiles, smem_bytes=0,
                args=append_args(elem_t, self.context.get("ragged", False)),
                role=role,
            )  # fmt: skip
        raise ValueError(f"unknown decode kernel role {role!r}")

    @property
    def kv8(self) -> bool:
        """Whether this unit reads an e4m3 cache (its attention kernel takes the descales)."""
        return bool(self.context.get("kv_fp8"))

    @property
    def fused_sink(self) -> bool:
        """Whether this unit's attention kernel joins the spec's sink (it takes the sink
        logits: :func:`attn_args`' ``sink``)."""
        return bool(self.context.get("sink"))

    @property
    def call_pointers(self) -> int:
        """Leading pointer arguments of the attention kernel that change per call."""
        return CALL_POINTERS_KV8 if self.kv8 else CALL_POINTERS

    def config(self) -> dict:
        """JSON-able summary for manifests and ``flashgen show``."""
        out = {
            **self.base_config(),
            "stages": self.tiles.stages,
            "pack_gqa": self.context["pack_gqa"],
        }
        if self.kv8:
            out["cache_dtype"] = "fp8_e4m3"
        if self.fused_sink:
            out["fused_sink"] = True
        if self.context.get("mla_wgmma"):
            out["mla_unit"] = "wgmma"
        return out


# ----------------------------------------------------------------------------- support
def unsupported_reason(spec: Spec) -> str | None:
    """Why ``spec`` has no decode kernels, or None: a dtype other than fp16 / bf16, or a
    varlen spec (decode takes the padded spec's op).  A mask or score_mod may read tensor
    params, shaped by :data:`TENSOR_EXTENTS`' symbols (in decode ``seqlen_q`` is the call's
    Sq_new, ragged its ``max_seqlen_q``, and ``seqlen_k`` the cache's capacity)."""
    if spec.varlen:
        return f"spec {spec.name!r} is a varlen spec; call with_kvcache on the padded spec's op"
    if spec.dtype not in ("fp16", "bf16"):
        return f"decode supports fp16 and bf16, spec {spec.name!r} has dtype {spec.dtype}"
    return None


#: What a tensor param's shape symbols mean in decode, as the kernels' names (padded /
#: ragged unit): ``seqlen_q`` is the new-token count (Sq_new; a ragged call's
#: ``max_seqlen_q``: request b's queries are rows ``q_idx < Sq_b`` of its slice), ``seqlen_k``
#: the keys a request can hold (``capacity``: S_cache dense, ``max_pages * page_size``
#: paged), so a per-request tensor ``[batch, seqlen_q, seqlen_q]`` or ``[batch, seqlen_k]``
#: is indexed by ``b``, ``q_idx`` and ``kv_idx`` whatever the request's own lengths (each at
#: most those extents).  The mask's own ``seqlen_q`` / ``seqlen_k`` stay the request's.
TENSOR_EXTENTS = {
    False: {"seqlen_q": "seqlen_q", "seqlen_k": "capacity"},
    True: {"seqlen_q": "params_seqlen_q", "seqlen_k": "capacity"},
}


def params_seqlen_q(spec: Spec) -> bool:
    """Whether a tensor param of ``spec`` has a ``seqlen_q`` extent: its ragged unit then
    takes ``params_seqlen_q``, the call's ``max_seqlen_q`` (a planned call's grid, and so the
    kernel's ``max_seqlen_q``, may be the plan's larger one)."""
    return any("seqlen_q" in p.shape for p in spec.tensor_params)


def cache_dtype_reason(spec: Spec, cache_dtype: str | None) -> str | None:
    """Why ``spec``'s decode cannot read a cache of ``cache_dtype`` (a
    :mod:`flashgen.codegen.dtypes` name; None: the spec's own), or None.  An e4m3 cache
    serves fp16 / bf16 specs whose head dims are multiples of 64 (its 1-byte rows are then
    whole 64-byte swizzle groups of ``fg::swz``)."""
    if cache_dtype is None or cache_dtype == spec.dtype:
        return None
    if cache_dtype not in CACHE_DTYPES:
        return (
            f"a {cache_dtype} cache is not supported; decode reads the spec's dtype "
            f"({spec.dtype}) or {', '.join(CACHE_DTYPES)}"
        )
    if spec.dtype not in CACHE_DTYPES[cache_dtype]:
        return f"a {cache_dtype} cache needs an fp16 or bf16 spec, {spec.name!r} is {spec.dtype}"
    if spec.head_dim % 64 or spec.head_dim_v % 64:
        return (
            f"a {cache_dtype} cache needs head dims that are multiples of 64, spec "
            f"{spec.name!r} has {spec.head_dim}/{spec.head_dim_v}"
        )
    return None


def mla_wgmma_support(spec: Spec, target: str, cache_dtype: str | None = None) -> str | None:
    """Why the Hopper MLA unit (``templates/sm_90/decode_mla.cu.j2``) cannot serve ``spec``'s
    calls on ``target`` with a cache of ``cache_dtype`` (None: the spec's), or None where it
    can: target ``sm_90``, a ``v_from_k`` spec of head dims 576/512 and a cache of the spec's
    dtype.  An e4m3 cache is refused here (its wgmma operands would need a dequantizing pass
    through shared memory, which the two-stage ring has no room for) and is served by the
    mma.sync unit's ``kv8`` form."""
    if target != "sm_90":
        return f"the Hopper MLA unit is sm_90 (wgmma), the target is {target}"
    if not spec.v_from_k:
        return f"the Hopper MLA unit reads one latent cache; spec {spec.name!r} has no v_from_k"
    if (spec.head_dim, spec.head_dim_v) != MLA_HEAD_DIMS:
        return (
            f"the Hopper MLA unit is written for head dims {MLA_HEAD_DIMS[0]}/{MLA_HEAD_DIMS[1]}, "
            f"spec {spec.name!r} has {spec.head_dim}/{spec.head_dim_v}"
        )
    if cache_dtype is not None and cache_dtype != spec.dtype:
        return (
            f"the Hopper MLA unit reads a {spec.dtype} cache, not {cache_dtype} (the mma.sync "
            "unit's kv8 form reads e4m3)"
        )
    return None


def mla_wgmma_reason(
    spec: Spec, target: str, options: Options | None = None, cache_dtype: str | None = None
) -> str | None:
    """Why :func:`plan` gives ``spec`` on ``target`` the mma.sync unit rather than the Hopper
    MLA unit, or None when it plans the Hopper unit: :attr:`Options.mla_unit` ``"wgmma"`` and
    :func:`mla_wgmma_support` None.  :func:`plan` has no call shape: ``"auto"`` is resolved
    before it by :func:`mla_unit_for_call` (a plan of ``"auto"`` itself is the mma.sync
    unit's)."""
    options = options or Options()
    if options.mla_unit == "mma_sync":
        return "Options.decode.mla_unit is 'mma_sync'"
    if options.mla_unit == "auto":
        return (
            "Options.decode.mla_unit is 'auto' and no call shape is given (calls and "
            "op.plan_decode pick per shape: flashgen.families.decode.mla_unit_for_call)"
        )
    return mla_wgmma_support(spec, target, cache_dtype)


def mla_wgmma_fallback(
    spec: Spec, target: str, options: Options | None = None, cache_dtype: str | None = None
) -> str | None:
    """The warning for a call that asked for the Hopper MLA unit and gets the mma.sync one:
    :attr:`Options.mla_unit` ``"wgmma"``, a ``v_from_k`` spec, and :func:`mla_wgmma_support`
    not None (an e4m3 cache, a target other than ``sm_90``); None otherwise (``"auto"``, which
    picks the mma.sync unit there in silence, ``"mma_sync"``, or a spec without ``v_from_k``,
    for which the option means nothing)."""
    options = options or Options()
    if options.mla_unit != "wgmma" or not spec.v_from_k:
        return None
    why = mla_wgmma_support(spec, target, cache_dtype)
    if why is None:
        return None
    return f"Options.decode.mla_unit='wgmma': {why}; these calls run the mma.sync decode unit"


@dataclass(frozen=True)
class MlaWork:
    """The work of one Hopper MLA CTA in a call (:func:`mla_auto_work`): ``blocks`` key blocks
    of a request (its capacity's, or the mask's live ones) in ``splits`` splits (the wgmma
    unit's split heuristic), and the CTAs each unit needs along a kv head's packed query rows:
    ``wgmma_row_blocks`` of :data:`MLA_BLOCK_M` rows, ``mma_row_blocks`` of :data:`BLOCK_M`
    (the mma.sync unit streams every key block once per such CTA)."""

    blocks: int
    splits: int
    wgmma_row_blocks: int
    mma_row_blocks: int

    @property
    def work(self) -> float:
        """The mma.sync unit's key-block loads that one wgmma CTA replaces: its share of the
        blocks, ``blocks / splits``, times the mma.sync CTAs its rows take, ``mma_row_blocks /
        wgmma_row_blocks``."""
        if self.splits <= 0 or self.wgmma_row_blocks <= 0:
            return 0.0
        return self.blocks * self.mma_row_blocks / (self.splits * self.wgmma_row_blocks)

    @property
    def picks_wgmma(self) -> bool:
        """``work >= MLA_AUTO_MIN_WORK``, in integers."""
        return self.wgmma_row_blocks > 0 and self.blocks * self.mma_row_blocks >= (
            MLA_AUTO_MIN_WORK * self.splits * self.wgmma_row_blocks
        )


def mla_auto_work(
    wgmma: DecodePlan,
    *,
    batch: int,
    heads_q: int,
    heads_kv: int,
    seqlen_q: int,
    capacity: int,
    num_sms: int,
    pack_gqa: bool = True,
    live_blocks: int | None = None,
    split_waves: float = 1.0,
    balance_waves: bool = False,
) -> MlaWork:
    """:class:`MlaWork` of a call of these sizes (``seqlen_q``: Sq_new, a ragged call's
    ``max_seqlen_q``; ``capacity``: the keys a request can hold; ``live_blocks``:
    :func:`live_key_blocks` where a mask bounds them) on a device of ``num_sms`` SMs, given
    ``wgmma``, the Hopper unit's plan: its CTAs are :func:`geometry`'s and its splits
    :func:`choose_num_splits`' (``split_waves`` / ``balance_waves``: the options'), as for a
    call without a fixed ``num_splits``.  All zero for an empty call."""
    geo = geometry(wgmma, batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen_q,
                   num_splits=1, pack_gqa=pack_gqa)  # fmt: skip
    if batch <= 0 or geo.rows <= 0 or capacity <= 0:
        return MlaWork(0, 0, 0, 0)
    splits = choose_num_splits(
        wgmma, batch=batch, heads_kv_ctas=geo.grid[1], m_blocks=geo.m_blocks,
        max_seqlen_k=capacity, num_sms=num_sms, live_blocks=live_blocks,
        split_waves=split_waves, balance_waves=balance_waves,
    )  # fmt: skip
    blocks = key_blocks(wgmma, capacity, live_blocks)
    return MlaWork(blocks, splits, geo.m_blocks, -(-geo.rows // BLOCK_M))


def mla_auto_unit(wgmma: DecodePlan, **sizes) -> str:
    """``"wgmma"`` or ``"mma_sync"``: the unit ``mla_unit="auto"`` runs on ``sm_90`` for a
    call of ``sizes`` (:func:`mla_auto_work`'s keywords; ``wgmma``: the Hopper unit's plan).
    The rule is the work of one wgmma CTA (:attr:`MlaWork.work`): the key blocks it streams
    (its request's blocks over the wgmma unit's heuristic split count) times the mma.sync
    CTAs its 64 rows would take (16 rows each, each streaming the same blocks): the wgmma
    unit where that is at least :data:`MLA_AUTO_MIN_WORK` (24), else the mma.sync unit.  A
    fixed ``num_splits`` (of the call, a plan or the options) does not enter: a call's unit
    depends on its shape only, so a plan and the calls of its shape under ``torch.compile``
    (which plan again, with the plan's split count) pick the same unit.

    Where it comes from (H100, benchmarks/results/h100-2026-12-07-s29/bench_decode_mla.log:
    paged 64, Sq_new 1, one latent head, 132 SMs, CUDA-graph medians; us, mma_sync vs wgmma;
    in brackets the work, key blocks per wgmma CTA x mma.sync CTAs per wgmma CTA):

    - B1 4k: h16 31.5 vs 44.6 [2 x 1]; h64 32.4 vs 62.0 [2 x 4]; h128 34.7 vs 65.0 [2 x 4]
    - B1 32k: h16 75.9 vs 127.5 [4 x 1]; h64 91.7 vs 182.4 [4 x 4]; h128 151.4 vs 124.1
      [7.8 x 4 = 31]
    - B64 4k: h16 151.5 vs 122.9 [32 x 1]; h64 561.8 vs 136.4 [32 x 4]; h128 1120.4 vs
      198.8 [64 x 4]
    - B64 32k: h16 1055.3 vs 840.5 [256 x 1]; h64 4357.1 vs 857.3 [256 x 4]; h128 8317.6
      vs 1428.3 [512 x 4]

    The wgmma unit loses at a work of 16 or less (a single request split 32 to 128 ways:
    the fixed cost of a 64-row CTA and of its many splits' merge is not paid back by a few
    key blocks) and wins from 31 (B1 32k at 128 heads, 1.22x) up (5.8x at 2048); 24 lies
    between the two, and every shape of the table picks its faster unit.  Counting the
    mma.sync unit's re-reads makes 16 heads (one mma.sync CTA per wgmma CTA: nothing to
    save but the wgmma unit's faster stream, 1.23x at B64) need four times the key blocks
    per CTA that 64 or 128 heads need: a single request at 16 heads stays on the mma.sync
    unit up to 192k keys (128 splits).  Shapes outside the table (other cache lengths and
    batches, Sq_new > 1, another SM count) follow the rule untested; ``flashgen bench
    --decode --mla`` times ``auto`` beside both units."""
    return "wgmma" if mla_auto_work(wgmma, **sizes).picks_wgmma else "mma_sync"


def mla_unit_for_call(
    spec: Spec,
    target: str,
    options: Options | None = None,
    cache_dtype: str | None = None,
    *,
    batch: int,
    heads_q: int,
    heads_kv: int,
    seqlen_q: int,
    capacity: int,
    num_sms: int,
    pack_gqa: bool = True,
    live_blocks: int | None = None,
    wgmma: DecodePlan | None = None,
) -> str:
    """The MLA unit (``"wgmma"`` / ``"mma_sync"``) a call of these sizes on ``target`` runs
    under ``options`` (a :class:`Options`): ``"mma_sync"`` for a spec without ``v_from_k``
    (its one unit); :attr:`Options.mla_unit` ``"mma_sync"``; ``"wgmma"`` where
    :func:`mla_wgmma_support` allows it, else ``"mma_sync"`` (:func:`mla_wgmma_fallback`
    warns); ``"auto"``: ``"mma_sync"`` where the Hopper unit cannot serve (``sm_80``, an
    e4m3 cache), else :func:`mla_auto_unit`.  ``wgmma``: the Hopper unit's plan if the caller
    has it (planned here otherwise; :class:`~flashgen.ops.decode.planning.DecodePlanning`
    keeps one per op)."""
    options = options or Options()
    if not spec.v_from_k or options.mla_unit == "mma_sync":
        return "mma_sync"
    if mla_wgmma_support(spec, target, cache_dtype) is not None:
        return "mma_sync"
    if options.mla_unit == "wgmma":
        return "wgmma"
    if wgmma is None:
        wgmma = plan(spec, target, replace(options, mla_unit="wgmma"))
    return mla_auto_unit(
        wgmma, batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen_q,
        capacity=capacity, num_sms=num_sms, pack_gqa=pack_gqa, live_blocks=live_blocks,
        split_waves=options.split_waves, balance_waves=options.balance_waves,
    )  # fmt: skip


def mla_unit_note(spec: Spec, target: str, options: Options | None = None) -> str | None:
    """What ``flashgen show`` says under a ``v_from_k`` spec's plan about the MLA unit of
    ``target`` (None for another spec): which unit the shown plan is and, for ``"auto"``, how
    calls pick theirs."""
    if not spec.v_from_k:
        return None
    options = options or Options()
    why = mla_wgmma_support(spec, target)
    if options.mla_unit == "auto" and why is None:
        return (
            "decode.mla_unit=auto: calls and op.plan_decode pick per shape: the wgmma unit "
            "(templates/sm_90/decode_mla.cu.j2) where one of its CTAs replaces at least "
            f"{MLA_AUTO_MIN_WORK} key-block loads of the mma_sync unit (its blocks under the "
            "split heuristic x the 16-row CTAs its 64 rows take: many requests, heads and new "
            "tokens), else the mma_sync unit shown; --option decode.mla_unit=wgmma shows the "
            "other"
        )
    if options.mla_unit == "auto":
        return f"decode.mla_unit=auto: the mma_sync unit shown ({why})"
    if options.mla_unit == "wgmma" and why is not None:
        return f"decode.mla_unit=wgmma: the mma_sync unit shown ({why})"
    return f"decode.mla_unit={options.mla_unit}: the {options.mla_unit} unit shown"


def mla_smem_bytes() -> int:
    """Dynamic shared memory of the Hopper MLA unit: 1 KiB of alignment slack (128-byte swizzle
    wants 1 KiB-aligned panels), the Q tile (64 rows x 576), two key-block stages (64 x 576 each),
    P (64 x 64), the rows' rescale factors, maxima and denominators, the combine's flag and the
    mbarriers (a full barrier per stage and warpgroup, P's full and empty)."""
    d = MLA_HEAD_DIMS[0]
    q = MLA_BLOCK_M * d * 2
    ring = MLA_STAGES * MLA_BLOCK_N * d * 2
    p = MLA_BLOCK_M * MLA_BLOCK_N * 2
    small = 3 * MLA_BLOCK_M * 4 + 16 + 8 * (3 * MLA_STAGES + 2)
    return 1024 + q + ring + p + small


def _kv(spec: Spec, cache_dtype: str | None) -> DType:
    return dtype(cache_dtype or spec.dtype)


def default_tiles(
    spec: Spec, options: Options | None = None, cache_dtype: str | None = None
) -> DecodeTiles:
    """Block and ring depth by head dim: 64 keys per block up to d256 (16 per warp, one
    m16n8k16 K step of P V), 128 at d <= 64; at d128 two stages (three CTAs fit an SM, which
    a short cache or a window fills faster: the H200 sweep of
    benchmarks/results/h200-2026-12-01-s14, decode_sweep_v3.log), elsewhere three stages
    where they fit sm_80's shared memory, else two; ``options`` override.  A 1-byte cache
    (``cache_dtype`` fp8_e4m3) takes twice the keys per block (the same bytes per stage as
    the 2-byte cache, half the loop trips per key; not yet tuned on a GPU)."""
    o = options or Options()
    d = max(spec.head_dim, spec.head_dim_v)
    block_n = o.block_n or (128 if d <= 64 else 64)
    kv_bytes = _kv(spec, cache_dtype).elem_bytes
    if o.block_n is None and kv_bytes == 1:
        block_n *= 2
    stages = o.stages
    if stages is None:
        stages = 2 if d == 128 else 3
        while stages > 2 and smem_bytes(spec, block_n, stages, kv_bytes) > SMEM_LIMIT["sm_80"]:
            stages -= 1
    return DecodeTiles(BLOCK_M, block_n, NUM_WARPS * dv_split(spec), stages)


def max_stages(spec: Spec, target: str, block_n: int, kv_bytes: int | None = None) -> int:
    """The deepest ring (at most :data:`MAX_STAGES`) of ``block_n``-key blocks whose attention
    kernel fits ``target``'s shared memory (:data:`SMEM_LIMIT_EXPLICIT`), 0 where not even the
    fewest stages (2) do."""
    fits = [s for s in range(2, MAX_STAGES + 1)
            if smem_bytes(spec, block_n, s, kv_bytes) <= SMEM_LIMIT_EXPLICIT[target]]  # fmt: skip
    return max(fits, default=0)


class DecodeTilesError(ValueError):
    """Decode tiles whose ring does not fit the target's shared memory (:func:`plan`).  The
    message names the target, the bytes and the limit, the deepest ``decode.stages`` that fits
    at this ``block_n`` (or the ``block_n`` values that fit, with their deepest rings) and the
    targets that take these tiles (``fits``)."""

    def __init__(self, spec: Spec, target: str, tiles: DecodeTiles, smem: int, kv_bytes: int):
        self.target = target
        self.fits = tuple(t for t in TARGETS if t != target and smem <= SMEM_LIMIT_EXPLICIT[t])
        bn, stages = tiles.block_n, tiles.stages
        deepest = max_stages(spec, target, bn, kv_bytes)
        if deepest:
            advice = f"at block_n {bn}, {target} fits decode.stages up to {deepest}"
        else:
            pairs = [(b, max_stages(spec, target, b, kv_bytes)) for b in range(bn, 0, -64)]
            pairs = [f"block_n {b} (stages up to {d})" for b, d in pairs if d]
            advice = (
                f"at block_n {bn} not even 2 stages (the fewest) fit {target}; "
                + (f"what fits: {', '.join(pairs)}" if pairs else "no decode tiles fit")
            )
        other = f"; {' and '.join(self.fits)} takes these tiles" if self.fits else ""
        super().__init__(
            f"decode tiles block_n={bn} x {stages} stages need {smem} B of shared memory on "
            f"{target} at head_dim {spec.head_dim}/{spec.head_dim_v} (limit "
            f"{SMEM_LIMIT_EXPLICIT[target]} B): {advice}{other}"
        )


def dv_split(spec: Spec) -> int:
    """Warps along the output's columns: 2 for Dv >= :data:`DV_SPLIT_FROM`, else 1."""
    return 2 if spec.head_dim_v >= DV_SPLIT_FROM else 1


def smem_bytes(spec: Spec, block_n: int, stages: int, kv_bytes: int | None = None) -> int:
    """Dynamic shared memory of the attention kernel: the Q tile, ``stages`` K and V blocks
    (``kv_bytes`` per element: the cache's; default the spec dtype's; a ``v_from_k`` spec's
    K blocks only) and their per-row validity bytes, the warps' merge area (which reuses
    the ring) and, for a mask that reads tensors, the vote bytes of its blocks."""
    d, dv = spec.head_dim, spec.head_dim_v
    elem = dtype(spec.dtype).elem_bytes
    q = BLOCK_M * d * elem
    ring = stages * block_n * (d + (0 if spec.v_from_k else dv)) * (kv_bytes or elem)
    merge = NUM_WARPS * BLOCK_M * dv * 4 + 2 * NUM_WARPS * BLOCK_M * 4
    return q + max(ring, merge) + stages * block_n + (VOTE_BLOCKS if tensor_mask(spec) else 0)


# ----------------------------------------------------------------------------- heuristic
def num_splits_heuristic(
    total_ctas: int,
    num_sms: int,
    num_n_blocks: int,
    max_splits: int = MAX_SPLITS,
    min_split_blocks: int = MIN_SPLIT_BLOCKS,
) -> int:
    """Splits of each request's key blocks, for bandwidth: decode streams K and V once, so
    the aim is every SM holding its full complement of CTAs (``num_sms`` here is the wave:
    SMs times the CTAs one SM holds) in a single wave, each with its ring of loads in
    flight.  None when ``total_ctas`` (CTAs without splitting) already fill 80% of a wave
    (FlashAttention-3's threshold, hopper/heuristics.h); else the most splits that keep
    ``total_ctas * splits`` within one wave (``num_sms // total_ctas``), at most
    ``num_n_blocks // min_split_blocks`` (splits of at least a few blocks: the merge reads
    one partial per split) and ``max_splits``.

    ``num_n_blocks``: key blocks of the longest request.  Returns an int in ``[1,
    max_splits]``.  Pure: a host function with no device state, tested in
    tests/unit/test_decode.py."""
    if total_ctas <= 0 or num_n_blocks <= 1 or num_sms <= 0:
        return 1
    if total_ctas >= 0.8 * num_sms:
        return 1
    return max(1, min(num_sms // total_ctas, num_n_blocks // min_split_blocks, max_splits))


def effective_splits(
    n_lo: int, n_hi: int, num_splits: int, min_split_blocks: int = MIN_SPLIT_BLOCKS
) -> int:
    """Splits a request with live key blocks ``[n_lo, n_hi)`` uses under ``num_splits``:
    ``min(num_splits, count // min_split_blocks)``, at least 1
    (``fg::dec::effective_splits``; the unit's ``Options.min_split_blocks``).  The other CTAs
    of its grid return at once: a short request or a sliding window costs no empty splits'
    work and its merge reads few partials."""
    cnt = max(n_hi - n_lo, 0)
    return max(1, min(num_splits, cnt // min_split_blocks))


def fp8_k_order(p: int) -> int:
    """The MMA k index (0..15) at which column ``p`` (0..15) of a 16-wide group of the head
    dim is multiplied in the e4m3-cache unit: ``ldmatrix`` gives thread ``t`` of a quad the
    bytes ``4t .. 4t + 3`` of a K row, whose pairs (0, 2) and (1, 3) are its B fragments
    ``b0`` (k = 2t, 2t + 1) and ``b1`` (k = 2t + 8, 2t + 9); so column ``4t + r`` is k ``2t
    + r // 2 + 8 * (r % 2)`` (``fg::kv8::k_order``; the Q tile is stored in this order).  Any
    permutation of k leaves Q K^T unchanged when Q and K share it."""
    t, r = divmod(p, 4)
    return 2 * t + r // 2 + 8 * (r % 2)


def strided_split(n_lo: int, n_hi: int, num_splits: int, split: int) -> range:
    """Key blocks of split ``split`` in a unit whose mask reads tensors (:func:`tensor_mask`):
    every ``num_splits``-th block of ``[n_lo, n_hi)`` from ``n_lo + split`` (the template's
    ``block_step``), so a run of blocks the mask's vote removes (another document's keys) is
    shared out evenly between the splits instead of idling the splits it would cover.  The
    splits partition the blocks; the merge takes their partials in split order, as ever."""
    return range(n_lo + split, n_hi, num_splits)


def split_range(n_lo: int, n_hi: int, num_splits: int, split: int) -> tuple[int, int]:
    """Key blocks ``[begin, end)`` of split ``split`` of the live blocks ``[n_lo, n_hi)``,
    balanced: ``[n_lo + count * split // num_splits, n_lo + count * (split + 1) //
    num_splits)`` (sizes differ by at most one block).  The same arithmetic as
    ``fg::dec::split_range`` (templates/common/decode.cuh)."""
    cnt = max(n_hi - n_lo, 0)
    return n_lo + cnt * split // num_splits, n_lo + cnt * (split + 1) // num_splits


# ----------------------------------------------------------------------------- kernel ABI
def _ctype(spec: Spec) -> str:
    return CTYPE[spec.dtype]


def attn_args(
    spec: Spec, ragged: bool = False, cache_dtype: str | None = None, sink: bool = False
) -> tuple:
    """The attention kernel's arguments (:class:`flashgen.codegen.abi.KernelArg`), in order:
    the pointers a call changes first (:data:`CALL_POINTERS` of them, packed per call by the
    planned fast path), then the plan's workspace, the layout and the params.  ``ragged``:
    ``seqlen_q`` is ``max_seqlen_q`` (the grid's), ``new_keys`` a 0/1 append flag (each
    request appends its own Sq_b), and ``cu_seqlens_q`` (int32 ``[B + 1]``) comes last.
    ``cache_dtype`` fp8_e4m3: the caches are e4m3 and :data:`CALL_POINTERS_KV8` pointers lead
    (``k_descale``, ``v_descale``: float32 read at ``b * x_sb + h_kv * x_sh``, or null for
    1), and after ``softmax_scale`` come ``k_descale_mul`` / ``v_descale_mul`` (factors of the
    descales: a Python float descale) and the descales' strides ``kds_sb kds_sh vds_sb
    vds_sh``.  ``sink`` (the fused sink, :attr:`Options.fused_sink`): then ``sink`` (float32
    logit of row (b, h) at ``b * sink_sb + h * sink_sh``, or null for the keys alone) and its
    strides."""
    t = _ctype(spec)
    kv = _kv(spec, cache_dtype)
    kt = kv.ctype
    a = [
        KernelArg("q", f"const {t}*"),
        KernelArg("k_cache", f"const {kt}*"),
        KernelArg("v_cache", f"const {kt}*"),
        KernelArg("o", f"{t}*"),
        KernelArg("lse", "float*"),
        KernelArg("cache_seqlens", "const int*"),
        KernelArg("block_table", "const int*"),
    ]
    if kv.elem_bytes == 1:
        a += [KernelArg("k_descale", "const float*"), KernelArg("v_descale", "const float*")]
    a += [
        KernelArg("o_part", "float*"),
        KernelArg("lse_part", "float*"),
        KernelArg("counters", "int*"),
    ]
    for n in ("q_sb", "q_sh", "q_ss", "k_sp", "k_ss", "k_sh", "v_sp", "v_ss", "v_sh", "bt_sb"):
        a.append(KernelArg(n, "int64_t"))
    for n in ("max_pages", "num_pages", "page_size", "batch", "heads_q", "heads_kv"):
        a.append(KernelArg(n, "int"))
    for n in ("max_seqlen_q" if ragged else "seqlen_q", "num_splits", "new_keys", "group"):
        a.append(KernelArg(n, "int"))
    a.append(KernelArg("softmax_scale", "float"))
    if kv.elem_bytes == 1:
        a += [KernelArg("k_descale_mul", "float"), KernelArg("v_descale_mul", "float")]
        a += [KernelArg(n, "int64_t") for n in ("kds_sb", "kds_sh", "vds_sb", "vds_sh")]
    if sink:
        a += sink_args()
    for p in spec.scalar_params:
        a.append(KernelArg(f"p_{p.name}", "int" if p.ty == Ty.I32 else "float"))
    for p in spec.tensor_params:
        a.append(KernelArg(f"t_{p.name}", "const int*" if p.ty == Ty.I32 else "const float*"))
    if ragged and params_seqlen_q(spec):
        a.append(KernelArg("params_seqlen_q", "int"))
    if ragged:
        a.append(KernelArg("cu_seqlens_q", "const int*"))
    return tuple(a)


def append_args(elem_t: str, ragged: bool = False) -> tuple:
    """The append kernel's arguments: ``k_new``/``v_new`` ``[B, Hkv, Sq_new, D]`` (strides)
    into the cache (the attention kernel's layout arguments).  ``ragged``: ``k_new``/``v_new``
    ``[total_q, Hkv, D]`` (the token stride passed as ``kn_ss``), ``max_seqlen_q`` for
    ``seqlen_q`` and ``cu_seqlens_q`` last."""
    a = [
        KernelArg("k_new", f"const {elem_t}*"),
        KernelArg("v_new", f"const {elem_t}*"),
        KernelArg("k_cache", f"{elem_t}*"),
        KernelArg("v_cache", f"{elem_t}*"),
        KernelArg("cache_seqlens", "const int*"),
        KernelArg("block_table", "const int*"),
    ]
    for n in ("kn_sb", "kn_sh", "kn_ss", "vn_sb", "vn_sh", "vn_ss"):
        a.append(KernelArg(n, "int64_t"))
    for n in ("k_sp", "k_ss", "k_sh", "v_sp", "v_ss", "v_sh", "bt_sb"):
        a.append(KernelArg(n, "int64_t"))
    for n in ("max_pages", "num_pages", "page_size", "heads_kv"):
        a.append(KernelArg(n, "int"))
    a.append(KernelArg("max_seqlen_q" if ragged else "seqlen_q", "int"))
    if ragged:
        a.append(KernelArg("cu_seqlens_q", "const int*"))
    return tuple(a)


# ----------------------------------------------------------------------------- plan
def plan(
    spec: Spec, target: str, options: Options | None = None, *, options_key: str = "",
    ragged: bool = False, cache_dtype: str | None = None, exact_softmax: bool = False,
) -> DecodePlan:
    """Lower ``spec`` to its decode unit for ``target`` (``sm_80``: mma.sync, also what
    ``sm_90`` compiles for sm_90a); ``options_key`` (the registry's
    :meth:`flashgen.options.Options.family_key`) goes into the plan's cache key.  ``ragged``:
    the ragged-Sq_new unit (kernels ``flashgen_<spec>_decode_ragged_<target>_*``; q
    ``[total_q, Hq, D]`` with ``cu_seqlens_q``, rows of a request past its Sq_b exit).
    ``cache_dtype``: the cache's element type (a :mod:`flashgen.codegen.dtypes` name; None
    or the spec's dtype: the spec-dtype unit, unchanged; ``fp8_e4m3``: the e4m3-cache unit,
    kernels ``flashgen_<spec>_decode_[ragged_]kv8_<target>_*``, see the module doc).
    ``exact_softmax``: the split merge normalized by the sum of its weights, ``exp(lse_i -
    m) / sum_j exp(lse_j - m)``, not ``exp(lse_i - lse)``: at huge logits (an ulp of lse
    2^14) ``log(sum)`` is lost in lse's rounding and equal splits weighed 1 each.  With
    ``options.mla_unit`` ``"wgmma"`` where :func:`mla_wgmma_reason` is None, the Hopper MLA unit
    (``templates/sm_90/decode_mla.cu.j2``, its tiles :data:`MLA_BLOCK_M` x
    :data:`MLA_BLOCK_N` x :data:`MLA_STAGES`, :func:`mla_smem_bytes`); ``"auto"`` (no call
    shape here: :func:`mla_unit_for_call` resolves it first) and ``"mma_sync"`` plan the
    mma.sync unit.  Raises
    ``ValueError`` for a spec decode does not support (:func:`unsupported_reason`,
    :func:`cache_dtype_reason`), an unknown target or tiles that do not fit."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; supported: {', '.join(TARGETS)}")
    why = unsupported_reason(spec) or cache_dtype_reason(spec, cache_dtype)
    if why is not None:
        raise ValueError(why)
    if cache_dtype == spec.dtype:
        cache_dtype = None
    kv = _kv(spec, cache_dtype)
    kv8 = kv.elem_bytes == 1
    options = options or Options()
    sink = options.fused_sink and spec.sink is not None
    wgmma = mla_wgmma_reason(spec, target, options, cache_dtype) is None
    if wgmma:
        tiles = DecodeTiles(MLA_BLOCK_M, MLA_BLOCK_N, MLA_WARPS, MLA_STAGES)
        smem = mla_smem_bytes()
    else:
        tiles = default_tiles(spec, options, cache_dtype)
        smem = smem_bytes(spec, tiles.block_n, tiles.stages, kv.elem_bytes)
        if smem > SMEM_LIMIT_EXPLICIT[target]:
            raise DecodeTilesError(spec, target, tiles, smem, kv.elem_bytes)
    causal, residual = split_causal(spec.mask)
    inv = Invariants(raw_score="score_raw")
    ext = TENSOR_EXTENTS[ragged]
    mask_expr = cuda_expr(residual, spec, inv, extents=ext) if residual is not None else None
    score_mod_expr = (
        cuda_expr(spec.score_mod, spec, inv, extents=ext) if spec.score_mod is not None else None
    )
    reads_h = spec.mask is not None and any(
        isinstance(n, ir.Var) and n.name == "h" for n in ir.walk(spec.mask)
    )
    kind = ("ragged_" if ragged else "") + ("kv8_" if kv8 else "") + ("wgmma_" if wgmma else "")
    base = f"flashgen_{spec.name}_decode_{kind}{target}"
    ctx = DecodeContext(
        spec_name=spec.name,
        base_name=base,
        kernel_name=f"{base}_attn",
        dtype=spec.dtype,
        elem_t=CTYPE[spec.dtype],
        head_dim=spec.head_dim,
        head_dim_v=spec.head_dim_v,
        block_m=tiles.block_m,
        block_n=tiles.block_n,
        num_warps=tiles.num_warps,
        dv_split=dv_split(spec),
        stages=tiles.stages,
        smem_bytes=smem,
        causal=causal,
        mask_expr=mask_expr,
        score_mod_expr=score_mod_expr,
        prologue=inv.prologue,
        tile_classifier=masktiles.classifier_source(spec),
        tile_class_args=", ".join(n for _, n in masktiles.classifier_params(spec)[4:]),
        mask_reads_h=reads_h,
        pack_gqa=options.pack_gqa,
        min_split_blocks=options.min_split_blocks,
        ctas_per_sm=1 if wgmma else options.ctas_per_sm or _smem_ctas(target, smem),
        args=attn_args(spec, ragged, cache_dtype, sink),
        append_args=append_args(kv.ctype, ragged),
        ragged=ragged,
        kv_fp8=kv8,
        kv_t=kv.ctype if kv8 else "",
        v_from_k=spec.v_from_k,
        tensor_mask=tensor_mask(spec),
        exact_softmax=exact_softmax,
        sink=sink,
        merge_unroll=options.merge_unroll,
        mma_t=dtype(spec.dtype).mma_t,
        mla_wgmma=wgmma,
    )
    template = "sm_90/decode_mla.cu.j2" if wgmma else "sm_80/decode.cu.j2"
    return DecodePlan.of(spec.name, target, template, tiles, smem, ctx, options_key)


@dataclass(frozen=True)
class Geometry:
    """Launch geometry of one decode call (host values only)."""

    group: int  # query heads per CTA row group: Hq / Hkv packed, 1 unpacked
    rows: int  # packed query rows per kv head (group * Sq_new)
    m_blocks: int  # CTAs along the rows
    num_splits: int
    grid: tuple[int, int, int]  # (m_blocks * num_splits, kv heads (or Hq unpacked), batch)
    append_grid: tuple[int, int, int]


def geometry(
    p: DecodePlan,
    *,
    batch: int,
    heads_q: int,
    heads_kv: int,
    seqlen_q: int,
    num_splits: int,
    pack_gqa: bool = True,
) -> Geometry:
    """The grids of a call with these sizes and ``num_splits`` (see the module doc).
    ``pack_gqa`` False: one query head per CTA (the kernel takes ``group`` at run time)."""
    g = heads_q // heads_kv
    if pack_gqa:
        group, heads = g, heads_kv
    else:
        group, heads = 1, heads_q
    rows = group * seqlen_q
    m_blocks = (rows + p.tiles.block_m - 1) // p.tiles.block_m
    return Geometry(
        group=group,
        rows=rows,
        m_blocks=m_blocks,
        num_splits=num_splits,
        grid=(m_blocks * num_splits, heads, batch),
        append_grid=(batch * heads_kv * seqlen_q, 1, 1),
    )


def choose_num_splits(
    p: DecodePlan,
    *,
    batch: int,
    heads_kv_ctas: int,
    m_blocks: int,
    max_seqlen_k: int,
    num_sms: int,
    live_blocks: int | None = None,
    split_waves: float = 1.0,
    balance_waves: bool = False,
) -> int:
    """:func:`num_splits_heuristic` for a call: ``batch * heads_kv_ctas * m_blocks`` CTAs
    without splitting, the key blocks of ``max_seqlen_k`` keys (the cache's capacity: the
    host never reads the lengths) or ``live_blocks`` when the mask bounds them
    (:func:`live_key_blocks`: a sliding window), a wave of ``split_waves * num_sms *``
    :func:`ctas_per_sm` CTAs, splits of at least the unit's ``min_split_blocks`` blocks;
    ``balance_waves``: :func:`balanced_splits` where the heuristic does not split."""
    n_blocks = key_blocks(p, max_seqlen_k, live_blocks)
    wave = max(1, int(num_sms * ctas_per_sm(p) * split_waves))
    msb = p.context.get("min_split_blocks", MIN_SPLIT_BLOCKS)
    total = batch * heads_kv_ctas * m_blocks
    splits = num_splits_heuristic(total, wave, n_blocks, MAX_SPLITS, msb)
    if balance_waves and splits == 1:
        splits = balanced_splits(total, wave, n_blocks // msb)
    return splits


def key_blocks(p: DecodePlan, max_seqlen_k: int, live_blocks: int | None = None) -> int:
    """Key blocks of unit ``p`` in ``max_seqlen_k`` keys, at most ``live_blocks`` (at least 1)
    where the mask bounds them (:func:`choose_num_splits`' count)."""
    n_blocks = (max_seqlen_k + p.tiles.block_n - 1) // p.tiles.block_n
    if live_blocks is not None:
        n_blocks = max(1, min(n_blocks, live_blocks))
    return n_blocks


def balanced_splits(total_ctas: int, wave: int, most: int) -> int:
    """The fewest splits ``s`` in ``[1, min(most, BALANCE_MAX_SPLITS)]`` whose ``total_ctas *
    s`` CTAs fill their last wave of ``wave`` CTAs to :data:`BALANCE_FILL` or more (CTAs
    over whole waves: ``n / (ceil(n / wave) * wave)``), else the best filled of them (the
    fewest on a tie); 1 for an empty call.  Pure host arithmetic (``Options.balance_waves``):
    equal requests' CTAs take equal time, so a last wave a third full costs nearly a whole
    wave at a third of the bandwidth."""
    if total_ctas <= 0 or wave <= 0:
        return 1
    best, best_fill = 1, 0.0
    for s in range(1, max(1, min(most, BALANCE_MAX_SPLITS)) + 1):
        n = total_ctas * s
        fill = n / (-(-n // wave) * wave)
        if fill >= BALANCE_FILL:
            return s
        if fill > best_fill:
            best, best_fill = s, fill
    return best


#: Shared memory per SM (bytes a CTA may take, summed): A100 164 KiB, H100/H200 228 KiB.
SM_SMEM = {"sm_80": 167936, "sm_90": 233472}


def _smem_ctas(target: str, smem: int) -> int:
    return max(1, min(4, SM_SMEM[target] // (smem + 1024)))


def ctas_per_sm(p: DecodePlan) -> int:
    """Attention CTAs planned per SM: ``Options.ctas_per_sm`` (the unit's launch bounds), at
    most what shared memory allows (1 KiB reserved per CTA), 1 to 4."""
    fit = _smem_ctas(p.target, p.smem_bytes)
    return max(1, min(fit, p.context.get("ctas_per_sm") or fit))


#: Most interval classifications :func:`live_key_blocks` spends before giving up (the
#: capacity's blocks are then the bound).
_LIVE_WALK_LIMIT = 256


def live_key_blocks(
    spec: Spec, *, capacity: int, seqlen_q: int, block_n: int, params: dict | None = None
) -> int | None:
    """Key blocks of ``block_n`` keys between the first and the last block the mask can
    keep for the queries ``[0, seqlen_q)`` of a request with ``capacity`` live keys
    (``seqlen_k = capacity``, ``b = h = 0``, the scalar ``params`` or their defaults), by
    the host's interval classifier (:func:`flashgen.analysis.maskinfo.classify`) over
    halving ranges (a bisection of the EMPTY runs at both ends: O(log blocks) calls for a
    sliding window).  None without a mask, or when the walk exceeds its budget.  Used only
    to size the split count (a heuristic: the kernel finds each request's live blocks
    itself), so a window in a large cache launches the window's CTAs, not the cache's."""
    from flashgen.analysis.maskinfo import TileClass, classify

    if spec.mask is None or capacity <= 0 or seqlen_q <= 0:
        return None
    n = (capacity + block_n - 1) // block_n
    calls = [0]

    def empty(j0: int, j1: int) -> bool:  # blocks j0..j1 inclusive
        calls[0] += 1
        k1 = min((j1 + 1) * block_n, capacity) - 1
        c = classify(spec, (0, seqlen_q - 1), (j0 * block_n, k1), b=0, h=0,
                     seqlen_q=seqlen_q, seqlen_k=capacity, params=params)  # fmt: skip
        return c == TileClass.EMPTY

    def first(j0: int, j1: int, rev: bool) -> int | None:
        """The first (``rev``: last) block of ``[j0, j1]`` that is not EMPTY."""
        if calls[0] > _LIVE_WALK_LIMIT or empty(j0, j1):
            return None
        if j0 == j1:
            return j0
        mid = (j0 + j1) // 2
        halves = ((mid + 1, j1), (j0, mid)) if rev else ((j0, mid), (mid + 1, j1))
        for a, b in halves:
            got = first(a, b, rev)
            if got is not None or calls[0] > _LIVE_WALK_LIMIT:
                return got
        return None

    lo = first(0, n - 1, False)
    if calls[0] > _LIVE_WALK_LIMIT:
        return None
    if lo is None:
        return 1
    hi = first(lo, n - 1, True)
    if hi is None or calls[0] > _LIVE_WALK_LIMIT:
        return None
    return hi - lo + 1
