"""Lowering: a checked :class:`~flashgen.frontend.ir.Spec` -> a :class:`KernelPlan` for one target.

Pure Python (no torch, no cupy).  The plan holds everything the renderer, the
compiler and the launcher need: the template to render and its context, the
tile configuration, the launch geometry and the kernel's argument list.

Kernel ABI (every forward kernel, every target), in this order:

    q, k, v            const T*     element (b, h, s, d) at b*sb + h*sh + s*ss + d
    o                  T*           same indexing with o's strides
    lse                float*       contiguous [batch, heads_q, seqlen_q], natural log
    q_sb q_sh q_ss  k_sb k_sh k_ss  v_sb v_sh v_ss  o_sb o_sh o_ss   int64_t element strides
    batch heads_q heads_kv seqlen_q seqlen_k                          int
    softmax_scale                                                     float
    p_<name>  for each scalar param, in spec order                    int | float
    t_<name>  for each tensor param, in spec order                    const int* | const float*
              (contiguous, shape as declared)
    blk_tab blk_sb blk_sh   only when the mask reads a tensor param   const unsigned char*,
              int64_t, int64_t: the per-tile class table of :func:`plan_block_table`
              (uint8 [tab_b, tab_h, ceil(seqlen_q/BLOCK_M), ceil(seqlen_k/BLOCK_N)],
              0 = EMPTY, 1 = PARTIAL, 2 = FULL) and its batch / head strides (0 when
              the mask does not depend on b / h)

varlen specs (``spec.varlen``) differ: ``cu_seqlens_q, cu_seqlens_k`` (const int*,
[batch + 1]) follow the strides, and the sizes are ``batch heads_q heads_kv
max_seqlen_q max_seqlen_k total_q``.  q/k/v/o are packed [total, heads, d], passed with
``x_sb = 0``, ``x_sh`` = the head stride and ``x_ss`` = the token stride (the kernel
adds the sequence's start row times ``x_ss`` itself); lse is contiguous [heads_q, total_q].  The
backward's pre and convert kernels keep the plain ABI (called with batch 1 and
seqlen_q = total_q over the packed tensors).

``KernelPlan.args`` lists these as (name, ctype) pairs, so a launcher only maps
names to values.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from flashgen.analysis import affine, colbound, masktiles, rowcol
from flashgen.analysis.maskinfo import Range, evaluate, static_env
from flashgen.envflags import flag
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

#: CUDA element type per spec dtype.
CTYPE = {"fp16": "__half", "bf16": "__nv_bfloat16"}
#: nvcc/NVRTC code generation per target.
GENCODE = {
    "sm_80": "-gencode=arch=compute_80,code=sm_80",
    "sm_90": "-gencode=arch=compute_90a,code=sm_90a",
}
ARCH = {"sm_80": "sm_80", "sm_90": "sm_90a"}


@dataclass(frozen=True)
class TileConfig:
    """BLOCK_M query rows x BLOCK_N key columns per CTA step, with ``num_warps`` warps.

    Each warp owns BLOCK_M / num_warps query rows (a multiple of 16, one mma row tile).
    """

    block_m: int
    block_n: int
    num_warps: int

    @property
    def threads(self) -> int:
        return 32 * self.num_warps


#: Default tile table for the FA2-class kernel: (head_dim, has score_mod) -> tiles (see
#: :func:`default_tiles`, which also consults :data:`MASK_TILES` and :data:`VARLEN_TILES`).
#: Picked from sweeps on the H200 (bf16, seqlen 16k; see docs/perf-notes.md); every entry
#: compiles with zero spills for the specs it serves.  A score_mod needs registers for its
#: math, so it halves BLOCK_N at head_dims 128 (alibi spills at 128x64) and 256.  To adopt
#: a ``tools/perf_sweep.py`` winner, edit its entry here (and, for template switches,
#: :data:`FORWARD_OPTIONS`).  ``flashgen tune`` measures per GPU, dtype and causal and
#: writes :mod:`flashgen.tuning`'s table, which :func:`choose_tiles` prefers when it has a key.
#: head_dim 32, 96, 160 and 192 (keyed, like every entry, by max(head_dim, head_dim_v)) are
#: not measured on a GPU yet: chosen by ptxas register counts (tools/tile_spills.py), two
#: 16-row mma tiles per warp where they fit without spills (32, 96), else the D=256 shape.
#: A score_mod at 96 takes BLOCK_N 32 (ALiBi reaches 255 registers at 128x64).
#: d64 and d256 take FlashAttention-2's own tiles (128x128x4; 128x64x8 with lazy rescaling),
#: measured on the H200 (tools/perf_sweep.py --candidates, 2026-11-30): d64 1.04-1.08x FA2
#: (the old 128x64x4: 0.93-0.97x), d256 0.86-1.03x (64x64x4: 0.81-0.93x).
DEFAULT_TILES: dict[tuple[int, bool], TileConfig] = {
    (32, False): TileConfig(128, 64, 4),
    (64, False): TileConfig(128, 128, 4),
    (64, True): TileConfig(128, 32, 4),  # t5_bias (a table read per element) spills at 128x64x4
    (96, False): TileConfig(128, 64, 4),
    (96, True): TileConfig(128, 32, 4),
    (128, False): TileConfig(128, 64, 4),
    (128, True): TileConfig(128, 32, 4),
    (160, False): TileConfig(64, 64, 4),
    (192, False): TileConfig(64, 64, 4),
    (256, False): TileConfig(128, 64, 8),
    (256, True): TileConfig(64, 32, 4),
}
#: head_dim -> tiles for a mask beyond causal without a score_mod, where the
#: (head_dim, False) entry has no registers left for the mask's per-element math
#: (mistral_swa spills 80-232 bytes at d128's 128x64x4).  The d64 and d256 rows are the
#: plain entries' tiles today; they keep masks there if FA2's tiles (d64 128x128x4, d256
#: 128x64x8, timed by ``tools/perf_sweep.py``) become the plain entries: at 128x128x4
#: mistral_swa / prefix_lm / chunked_local at d64 spill 56-488 bytes, and chunked_local at
#: d256 spills 40 bytes on sm_90a at 128x64x8.
MASK_TILES: dict[int, TileConfig] = {
    64: TileConfig(128, 64, 4),
    128: TileConfig(128, 32, 4),
    256: TileConfig(64, 64, 4),
}
#: Varlen specs' entries that differ from :data:`DEFAULT_TILES` (see :func:`default_tiles`).
#: (64, False) is the plain entry's tile today, kept for varlen if 128x128x4 becomes the
#: plain entry: gpt2_d64's varlen form spills 136-240 bytes there (its per-sequence
#: lengths and offsets take the registers the padded form has left).
VARLEN_TILES: dict[tuple[int, bool], TileConfig] = {
    (64, False): TileConfig(128, 64, 4),  # varlen gpt2_d64 spills at 128x128x4
    (128, False): TileConfig(128, 32, 4),
}


#: Code-generation switches of the FA2-class forward template (``templates/sm_80/fwd.cu.j2``);
#: each changes only how the same algorithm is emitted, and ``tools/perf_sweep.py`` times
#: every combination against the others.  ``fwd_unrolled_loads``: tile loads with a
#: compile-time trip count and one pointer per thread (the generic loop compiled to a
#: runtime loop with a remainder inside the main loop).  ``fwd_hoisted_swizzle``:
#: ldmatrix addresses as a per-lane offset XORed with constants (as CuTe's swizzled
#: layouts do).  ``fwd_fold_scale``: without a score_mod, S stays raw and log2(e) *
#: softmax_scale is folded into exp2's FFMA (FA2's ``scale_apply_exp2``).
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
#: warps it costs registers (spills at 128x64x4), so it is off by default and the H200 table
#: turns it on at d256 (64x64x4: 1.01-1.05x FA2 non-causal, 1.04-1.11x causal; without it
#: those tiles sit at 255 registers, and with ``fwd_even_loads`` instead spill non-causal).
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
#: wins): lets a ``tools/perf_sweep.py`` ``+lazy`` winner at one head dim be adopted without
#: the others.  d256: +1-4% over the same tiles without it (H200, 2026-11-30); d64 mixed.
LAZY_RESCALE_HEAD_DIMS: frozenset[int] = frozenset({256})
#: Head dims (max(head_dim, head_dim_v)) whose FA2-class forward takes its CTAs in head groups
#: (:func:`tile_group_expr`) by default.  The grouped order's CTA coordinates cannot be
#: recomputed from ``blockIdx.x`` in one instruction, so they hold a register or two over the
#: key loop: the 255-register d96 kernels spill 12-28 bytes with them; d64 / d128 / d256 do
#: not, and measured 1.03-1.10x faster causal with them (H200, docs/perf-notes.md, session 8).
HEAD_GROUP_FA2_HEAD_DIMS: frozenset[int] = frozenset({64, 128, 256})


#: Tiles of the Hopper kernel (``templates/sm_90/fwd.cu.j2``): BLOCK_M = 128 query rows
#: (two consumer warpgroups of 64) x BLOCK_N, 12 warps (one producer warpgroup).  The
#: shared-memory budget (Q + a two-stage K/V ring) and the consumers' 240 registers
#: (a 64 x HEAD_DIM fp32 O accumulator, S, and P as 16-bit fragments) bound BLOCK_N.
#: Picked by ``tools/hopper_sweep.py`` on the H200 (bf16, seqlen 16k; docs/perf-notes.md):
#: wider steps amortize each step's barrier waits and row reductions.
#: A score_mod's math needs registers too: at head_dim 64 it gets 96-wide steps (192 spilled
#: for a bias-table score_mod while its reads were clamped 64-bit offsets; with the reads of
#: :func:`_tensor_read` t5_bias compiles without spills at 96, 128, 160 and 192: to be timed
#: with ``tools/t5_tiles.py``).  Keyed like DEFAULT_TILES: (head_dim, has score_mod);
#: a key without a ``True`` entry uses the plain one.
HOPPER_TILES: dict[tuple[int, bool], TileConfig] = {
    (64, False): TileConfig(128, 192, 12),
    (128, False): TileConfig(128, 160, 12),
    (256, False): TileConfig(128, 80, 12),
    (64, True): TileConfig(128, 96, 12),
}
#: Head dims the Hopper kernel supports (head_dim == head_dim_v).
HOPPER_HEAD_DIMS = tuple(sorted({d for d, _ in HOPPER_TILES}))
#: Hopper tiles of a spec whose mask reads tensors (a block table: document masking), by
#: head_dim, where they differ from :data:`HOPPER_TILES`.  Short documents make many short
#: rows of PARTIAL tiles, and a narrower step wastes fewer masked columns: document_mask at
#: the gallery's shape (B=2, S=8192, documents of mean length 1024) ran 0.274 ms at 128 x
#: 128 against 0.285 ms at 128 x 160 (H200, ``tools/mask_tiles.py``, alternating rounds);
#: prefix_lm, chunked_local and mistral_swa were as fast or faster at 160.
HOPPER_TABLE_TILES: dict[int, TileConfig] = {128: TileConfig(128, 128, 12)}


#: The Hopper forward's tiles for a call whose mask keeps few keys per query row, per head_dim:
#: narrower key blocks waste less of the tiles at a window's or a chunk's edges and leave fewer
#: of them.  Session 11 (H200, bf16, S = 1k-16k, same process): 128 x 128 took 0.91-0.99x the
#: time of 128 x 160 at 4-14 live key blocks of 160 per query block (windows 512-2048, chunks
#: 2048-4096, causal at 1k-4k), 0.85x for window 256 and chunk 1024 at 16k, 1.015x at 24
#: (window 4096), 1.07x for causal at 16k.
HOPPER_SPARSE_TILES: dict[int, TileConfig] = {128: TileConfig(128, 128, 12)}
#: A call whose mask keeps fewer keys per query row than this on average (16 key blocks of
#: 160; :mod:`flashgen.ops.density`) runs :data:`HOPPER_SPARSE_TILES` (:func:`sparse_tiles`).
SPARSE_KEYS_PER_ROW = 2560
#: ``FLASHGEN_SPARSE_TILES=0``: the forward op always runs its dense tiles.
SPARSE_TILES_ENV = "FLASHGEN_SPARSE_TILES"


def sparse_tiles(spec: Spec, tiles: TileConfig) -> TileConfig | None:
    """The tiles the forward op runs in place of ``tiles`` (the chosen ones) for a call that
    keeps fewer than :data:`SPARSE_KEYS_PER_ROW` keys per query row, or None where it keeps
    ``tiles``: no mask, a mask that reads tensors (its block table has its own tiles), tiles
    pinned by the spec, a kernel other than the Hopper one, or no entry in
    :data:`HOPPER_SPARSE_TILES` for the head_dim."""
    o = spec.tiles
    if spec.mask is None or needs_block_table(spec) or o.block_m or o.block_n or o.num_warps:
        return None
    alt = HOPPER_SPARSE_TILES.get(spec.head_dim)
    if not is_hopper_tiles(tiles) or alt is None or alt == tiles:
        return None
    return alt


#: ``FLASHGEN_SPARSE_PERSISTENT``: the persistent tile scheduler of the kernel the op runs for
#: sparse calls (:func:`sparse_persistent`): ``dynamic`` (the default), ``0`` none, ``1``
#: ``static``, or another name in :data:`PERSISTENT_SCHEDULERS`.
SPARSE_PERSISTENT_ENV = "FLASHGEN_SPARSE_PERSISTENT"


def sparse_persistent() -> str | bool:
    """The persistent scheduler of the kernel the op runs (at :func:`sparse_tiles`' tiles) for
    calls that keep few keys per row, from ``FLASHGEN_SPARSE_PERSISTENT`` (read at every
    call; default ``dynamic``; ``0``: the non-persistent kernel).

    Measured on the H200 (docs/perf-notes.md, sessions 12-13; CUDA-graph device time, S * B =
    16k, H=16, against the non-persistent kernel): ``dynamic`` 0.81-0.84x at window 256,
    0.91-0.95x at window 1024 (1.03x in one session-13 run), 0.93-0.95x at window 2048,
    0.83-0.93x for causal at 1k-4k, 0.89x at chunk 1024, 0.95x at chunk 2048; ``static`` 0.84x
    at window 256 but 1.03-1.13x for causal at 2k-4k, prefix 512 and window 2048 (its round
    robin packs the uneven rows badly).  A query block of such a call visits a few key blocks,
    and the non-persistent kernel's fixed cost per CTA (decode, Q and the first K landing, the
    epilogue: ~7.5K of 16.5K cycles at window 256) is much of its time; a persistent CTA loads
    the next tile's Q and first key block during the current one.  (Chunked masks ran 1.35-1.37x
    slower while the persistent producer walked one classifier call at a time; it walks
    warp-wide since session 13, ``warp_walk`` of :func:`plan_hopper_forward`.)  The dynamic
    scheduler's tile counter is the stream's for eager calls and the call's own inside a
    CUDA-graph capture (``flashgen.ops.op``), so graphs replayed on several streams at once never
    share one.
    ``ValueError`` for another value.
    """
    return scheduler_from_env(SPARSE_PERSISTENT_ENV, default="dynamic")


def hopper_tiles(spec: Spec) -> TileConfig:
    """The :data:`HOPPER_TILES` entry for ``spec`` (head_dim, with or without score_mod),
    or its :data:`HOPPER_TABLE_TILES` entry if its mask reads tensors and it has one."""
    d = spec.head_dim
    if d in HOPPER_TABLE_TILES and spec.score_mod is None and needs_block_table(spec):
        return HOPPER_TABLE_TILES[d]
    return HOPPER_TILES.get((d, spec.score_mod is not None)) or HOPPER_TILES[(d, False)]


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
#: Shared memory a CTA may use on sm_90 (227 KiB).
HOPPER_SMEM_LIMIT = 232448
#: Dynamic shared memory a CTA may opt into, per target: A100's 163 KiB for sm_80, H100's
#: 227 KiB for sm_90 (cudaFuncSetAttribute refuses more; a launch would fail on the GPU).
SMEM_LIMIT = {"sm_80": 166912, "sm_90": HOPPER_SMEM_LIMIT}


def is_hopper_tiles(tiles: TileConfig) -> bool:
    """True for a warp-specialized Hopper tile config (a producer warpgroup plus consumer
    warpgroups of 64 query rows each)."""
    return tiles.num_warps % 4 == 0 and tiles.block_m == 64 * (tiles.num_warps // 4 - 1)


#: Kernel families: "fa3" is the Hopper kernel where :func:`hopper_eligible`, else the
#: FA2-class one ("auto" means the same); "fa2" is always the FA2-class kernel.
FAMILIES = ("auto", "fa3", "fa2")


def kernel_family() -> str:
    """``FLASHGEN_KERNEL_FAMILY`` (default ``auto``); see :data:`flashgen.lower.FAMILIES`.
    Raises ``ValueError`` for an unknown value."""
    family = os.environ.get("FLASHGEN_KERNEL_FAMILY", "auto") or "auto"
    if family not in FAMILIES:
        raise ValueError(
            f"FLASHGEN_KERNEL_FAMILY={family!r}: expected one of {', '.join(FAMILIES)}"
        )
    return family


#: Tile schedulers of the persistent Hopper forward (:func:`plan_hopper_forward`):
#: ``static``: CTA c takes tiles c, c + gridDim.x, ... in the non-persistent kernel's
#: head-major order; ``m_major``: the same in query-block-major order (every head's
#: heaviest causal block first: balanced, less K/V reuse in L2); ``dynamic``: the head-major
#: order handed out by a global atomic counter (balanced and head-major; the op passes a
#: counter the kernel's last CTA resets: the stream's for eager calls, its own per captured
#: call).
PERSISTENT_SCHEDULERS = ("static", "m_major", "dynamic")


def persistent_forward(spec: Spec | None = None) -> str | bool:
    """``FLASHGEN_PERSISTENT``: ``0`` off, ``1`` the ``static`` scheduler, or a name in
    :data:`PERSISTENT_SCHEDULERS`: what the op passes :func:`plan_forward` as ``persistent``
    (False or a scheduler) for ``spec``'s forward.  Read at every call, like
    :func:`kernel_family`.  Unset: ``dynamic`` where ``spec``'s mask reads tensors (a block
    table, :func:`needs_block_table`), else off.  Raises ``ValueError`` for another value.

    Block-table masks (document masking) gain from the persistent kernel at every density
    measured (session 13, H200, document_mask, ``do_bench`` / CUDA-graph time against the
    non-persistent kernel): 0.96x / 0.96x at S=8k with documents of mean length 1024, 0.95x /
    0.94x at 16k, 0.85x / 0.83x at 16k with documents of 256, 0.95x / 0.95x at 4k with
    documents of 2048.  Masks the tile classifier reads keep the non-persistent dense kernel
    (mixed at the gallery shape: 0.97-1.03x, docs/perf-notes.md) and run their sparse calls on
    the persistent one (:func:`sparse_persistent`)."""
    default = "dynamic" if spec is not None and needs_block_table(spec) else "0"
    return scheduler_from_env("FLASHGEN_PERSISTENT", default=default)


def scheduler_from_env(name: str, default: str = "0") -> str | bool:
    """The persistent scheduler environment variable ``name`` names: False for ``0``,
    ``static`` for ``1``, else a name in :data:`PERSISTENT_SCHEDULERS`; unset or empty reads
    as ``default`` (``ValueError`` naming the variable and the accepted values otherwise)."""
    value = os.environ.get(name, "").strip() or default
    if value == "0":
        return False
    value = "static" if value == "1" else value
    if value not in PERSISTENT_SCHEDULERS:
        raise ValueError(
            f"{name}={value!r}: expected 0, 1 or one of {', '.join(PERSISTENT_SCHEDULERS)}"
        )
    return value


def hopper_eligible(spec: Spec, target: str, family: str = "auto") -> bool:
    """Whether ``spec`` gets the TMA + wgmma kernel on ``target``: sm_90, head_dim ==
    head_dim_v in :data:`HOPPER_HEAD_DIMS`, not varlen, no FA2-style ``tiles:`` pinned by the
    spec, and ``family`` not ``"fa2"``.  A mask that reads tensors is fine: the Hopper kernel
    walks a block table built for its own tiles (:func:`plan_block_table`)."""
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


@dataclass(frozen=True)
class KernelArg:
    name: str
    ctype: str  # "const __nv_bfloat16*", "float*", "int64_t", "int", "float", "const int*" ...

    @property
    def is_pointer(self) -> bool:
        return self.ctype.endswith("*")


@dataclass(frozen=True)
class TmaArg:
    """A ``CUtensorMap`` kernel argument ``name`` mapping tensor argument ``tensor``
    (``[B, H, S, D]``) in boxes of 64 columns x ``box_rows`` rows (see
    :mod:`flashgen.runtime.tma`)."""

    name: str
    tensor: str
    box_rows: int


@dataclass(frozen=True)
class KernelPlan:
    """Everything needed to render, compile and launch one forward kernel."""

    spec_name: str
    target: str  # "sm_80" | "sm_90"
    template: str  # path under templates/, e.g. "sm_80/fwd.cu.j2"
    kernel_name: str  # extern "C" symbol
    tiles: TileConfig
    smem_bytes: int  # dynamic shared memory per CTA
    args: tuple[KernelArg, ...]
    context: dict = field(compare=False, hash=False)
    #: CUtensorMap arguments (Hopper kernels): built at launch from the named tensors.
    tma: tuple[TmaArg, ...] = ()

    @property
    def threads(self) -> int:
        return self.tiles.threads

    @property
    def gencode(self) -> str:
        """nvcc flag selecting the target, e.g. ``-gencode=arch=compute_90a,code=sm_90a``."""
        return GENCODE[self.target]

    @property
    def arch(self) -> str:
        """NVRTC ``--gpu-architecture`` value (``sm_80`` or ``sm_90a``)."""
        return ARCH[self.target]

    def num_m_blocks(self, seqlen_q: int) -> int:
        return (seqlen_q + self.tiles.block_m - 1) // self.tiles.block_m

    def grid(
        self,
        batch: int,
        heads_q: int,
        seqlen_q: int,
        num_sms: int | None = None,
        *,
        heads_kv: int | None = None,
        seqlen_k: int | None = None,
    ) -> tuple[int, int, int]:
        """The launch grid over the ``ceil(seqlen_q/BLOCK_M) * batch * heads_q`` work tiles
        (query block, batch*head).  Usually 1-D, one tile per CTA.  A plan whose CTAs take
        their head groups from the grid (``context["grid_groups"]``: the Hopper forward's
        causal and masked kernels) gets :func:`grouped_grid`'s 2-D grid, which needs
        ``heads_kv`` and ``seqlen_k`` (the group size: :func:`head_group` for the L2 budget
        ``context["grid_l2_bytes"]``, :data:`HEAD_GROUP_L2_BYTES` when planned).  A persistent
        plan (``context["persistent"]``) launches ``min(tiles, num_sms)`` CTAs that loop over
        the tiles (:func:`persistent_tile_order`; ``num_sms``: the device's SM count).
        ``ValueError`` if an argument the plan needs is missing."""
        tiles = self.num_m_blocks(seqlen_q) * batch * heads_q
        if self.context.get("persistent"):
            if not num_sms or num_sms < 1:
                raise ValueError(f"{self.kernel_name} is persistent: grid() needs num_sms >= 1")
            return (min(tiles, num_sms), 1, 1)
        groups = self.context.get("grid_groups")
        if groups:
            num_bh = batch * heads_q
            if groups == "all":
                group = num_bh
            else:
                if heads_kv is None or seqlen_k is None:
                    raise ValueError(
                        f"{self.kernel_name} takes its head groups from the grid: grid() "
                        "needs heads_kv and seqlen_k"
                    )
                kv_row_bytes = (self.context["head_dim"] + self.context["head_dim_v"]) * 2
                group = head_group(
                    seqlen_k, kv_row_bytes, heads_q // heads_kv, num_bh,
                    l2_bytes=self.context["grid_l2_bytes"],
                )  # fmt: skip
            return grouped_grid(self.num_m_blocks(seqlen_q), num_bh, group)
        return (tiles, 1, 1)

    def config(self) -> dict:
        """JSON-able summary for manifests and ``flashgen show``."""
        return {
            "target": self.target,
            "template": self.template,
            "kernel": self.kernel_name,
            "block_m": self.tiles.block_m,
            "block_n": self.tiles.block_n,
            "num_warps": self.tiles.num_warps,
            "threads": self.threads,
            "smem_bytes": self.smem_bytes,
            "causal": self.context["causal"],
            "has_mask": self.context["mask_expr"] is not None,
            "has_score_mod": self.context["score_mod_expr"] is not None,
            "block_table": self.context["block_table"],
        }


# ----------------------------------------------------------------------------- expressions -> CUDA
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
    (:func:`_nonneg_by_positive`)."""

    def __init__(self, raw_score: str | None = None, nonneg_div: bool = False) -> None:
        self.decls: list[str] = []
        self._names: dict[tuple[str, str], str] = {}
        self.raw_score = raw_score
        # an int x / d with x >= 0, d >= 1 proven lowers to fg::Divisor::div_nn
        # (_nonneg_by_positive; the Hopper forward only: the FA2-class one spilled with it)
        self.nonneg_div = nonneg_div

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


def cuda_expr(e: Expr, spec: Spec, inv: Invariants | None = None) -> str:
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
    """
    return _cuda_expr(e, spec, inv, False)


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
    def cuda_expr(x: Expr, spec: Spec) -> str:  # recursion keeps the collector
        below = compared or _exact_operands(e)
        return _cuda_expr(x, spec, inv, below)

    def as_float(x: Expr, code: str) -> str:
        twins = _float_affine(x, spec) if x.ty == Ty.I32 and _affine_int(x) else None
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
        return _tensor_read(e, spec, lambda ix: cuda_expr(ix, spec))
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


#: ``FLASHGEN_NONNEG_DIV=0``: an integer ``x / d`` (``x % d``) by a kernel-invariant ``d``
#: uses the signed ``fg::Divisor::div`` even where ``x >= 0`` and ``d >= 1`` are proven.
NONNEG_DIV_ENV = "FLASHGEN_NONNEG_DIV"


def _nonneg_by_positive(e: Binary, spec: Spec) -> bool:
    """Whether the int division ``e`` provably has ``lhs >= 0`` and ``rhs >= 1`` at every
    call (:func:`flashgen.analysis.maskinfo.evaluate` over :func:`_static_env`): then
    ``fg::Divisor::div_nn`` (a multiply-high and a shift: ``kv_idx / chunk``) replaces the
    signed ``div`` (about 7 instructions).  ``FLASHGEN_NONNEG_DIV=0``: never."""
    if not flag(NONNEG_DIV_ENV, True):
        return False
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


def _tensor_read(e: Index, spec: Spec, render) -> str:
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
    the base too: one add less per element."""
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
        inside = index_in_bounds(ix, dim, spec)
        if not inside:
            code = f"fg::clamp_index({code}, {_shape_extent(dim)})"
        codes.append(code)
        rest = p.shape[i + 1 :]
        if _tile_invariant(ix, spec):
            stride = "".join(f" * (int64_t)({_shape_extent(d)})" for d in rest)
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
            offset = (
                term if i == 0 else f"({offset}) * (int64_t)({_shape_extent(p.shape[i])}) + {term}"
            )
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


def _shape_extent(dim) -> str:
    """CUDA expression for one declared tensor-param extent."""
    if isinstance(dim, int):
        return str(dim)
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


# ----------------------------------------------------------------------------- plan
def default_tiles(spec: Spec) -> TileConfig:
    """``spec``'s default tiles for the FA2-class kernel: the :data:`DEFAULT_TILES` entry for
    (head_dim, has score_mod), falling back to (head_dim, False); without a score_mod, a
    mask beyond plain causal takes :data:`MASK_TILES` where it has the head_dim.

    Varlen specs take :data:`VARLEN_TILES` first (no mask rule): their per-sequence lengths
    and offsets take registers the widest tiles need (causal_d128's varlen form spills 40
    bytes at d128's 128x64x4, so it keeps 128x32x4)."""
    d = max(spec.head_dim, spec.head_dim_v)
    key = (d, spec.score_mod is not None)
    if spec.varlen and key in VARLEN_TILES:
        return VARLEN_TILES[key]
    if not spec.varlen and not key[1] and d in MASK_TILES:
        if split_causal(spec.mask)[1] is not None:
            return MASK_TILES[d]
    return DEFAULT_TILES.get(key) or DEFAULT_TILES[(d, False)]


def choose_tiles(
    spec: Spec, target: str, gpu: str | None = None, family: str = "auto"
) -> TileConfig:
    """Tile config of ``spec``'s forward kernel for ``target``.

    Precedence: the spec's ``tiles:`` fields, then the tuning table entry measured on
    ``gpu`` (the CUDA device name, e.g. ``"NVIDIA H200"``; see :mod:`flashgen.tuning`,
    written by ``flashgen tune``), then ``DEFAULT_TILES``.  Without a GPU name (offline
    builds, ``generated/``) the table is not consulted.
    """
    from flashgen.tuning import lookup

    d = max(spec.head_dim, spec.head_dim_v)
    has_mod = spec.score_mod is not None
    tuned = lookup(gpu, target, d, spec.dtype, split_causal(spec.mask)[0], has_mod)
    if hopper_eligible(spec, target, family):
        if tuned is not None and is_hopper_tiles(TileConfig(*tuned)):
            return TileConfig(*tuned)
        return hopper_tiles(spec)
    if tuned is not None and is_hopper_tiles(TileConfig(*tuned)):
        tuned = None  # a Hopper kernel's entry, and this is the FA2-class kernel
    base = TileConfig(*tuned) if tuned is not None else default_tiles(spec)
    o = spec.tiles
    return TileConfig(
        o.block_m or base.block_m, o.block_n or base.block_n, o.num_warps or base.num_warps
    )


def _dim_args(spec: Spec) -> list[KernelArg]:
    """The problem-size arguments: per-batch lengths, or for varlen the grid's maxima and
    the packed query count (lse and dsum are ``[heads_q, total_q]`` there)."""
    if spec.varlen:
        names = ("batch", "heads_q", "heads_kv", "max_seqlen_q", "max_seqlen_k", "total_q")
    else:
        names = ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k")
    return [KernelArg(n, "int") for n in names]


def _varlen_args(spec: Spec) -> list[KernelArg]:
    """``cu_seqlens_q``, ``cu_seqlens_k`` (int32 [batch + 1]) for a varlen spec, else none."""
    if not spec.varlen:
        return []
    return [KernelArg("cu_seqlens_q", "const int*"), KernelArg("cu_seqlens_k", "const int*")]


#: Bytes of shared memory that stage a query block's row of the block table (key blocks;
#: a longer row is read from global memory).
TABLE_ROW_SMEM = 2048


def needs_block_table(spec: Spec) -> bool:
    """Whether ``spec``'s mask reads a tensor param (e.g. document masking
    ``doc_q[q_idx] == doc_kv[kv_idx]``): its tiles cannot be classified from indices alone,
    so a generated pre-pass (:func:`plan_block_table`) writes a per-tile class table that
    the forward kernel reads to skip EMPTY tiles and drop the mask on FULL ones."""
    return _per_spec(
        spec,
        "needs_block_table",
        lambda: spec.mask is not None and any(isinstance(n, Index) for n in ir.walk(spec.mask)),
    )


def block_table_dims(spec: Spec) -> tuple[bool, bool]:
    """``(per_batch, per_head)``: whether the block table needs a batch / head axis
    (the mask reads ``b`` / ``h`` or ``h_kv``, directly or inside a tensor index; a mask
    reading ``h_kv`` gets the per-query-head table, as one reading ``h``); else that axis
    has extent 1 and the kernel reads it with stride 0."""

    def dims() -> tuple[bool, bool]:
        per_h = _uses_index_var(spec.mask, "h") or _uses_index_var(spec.mask, "h_kv")
        return _uses_index_var(spec.mask, "b"), per_h

    return _per_spec(spec, "block_table_dims", dims)


def _per_spec(spec: Spec, what: str, compute):
    """``compute()``, remembered on ``spec`` itself: facts the op reads on every call (IR
    walks cost ~40 us per call on document_mask's block-table path).  Kept in the frozen
    dataclass's ``__dict__`` (not a field: equality, hashing and ``replace`` ignore it), so
    they live and die with the spec."""
    facts = spec.__dict__.setdefault("_lower_facts", {})
    if what not in facts:
        facts[what] = compute()
    return facts[what]


def _uses_index_var(e: Expr | None, name: str) -> bool:
    return e is not None and any(
        isinstance(n, Var) and n.name == name and n.name in ir.INDEX_VARS for n in ir.walk(e)
    )


def kernel_args(spec: Spec) -> tuple[KernelArg, ...]:
    t = CTYPE[spec.dtype]
    args = [
        KernelArg("q", f"const {t}*"),
        KernelArg("k", f"const {t}*"),
        KernelArg("v", f"const {t}*"),
        KernelArg("o", f"{t}*"),
        KernelArg("lse", "float*"),
    ]
    for x in "qkvo":
        args += [
            KernelArg(f"{x}_sb", "int64_t"),
            KernelArg(f"{x}_sh", "int64_t"),
            KernelArg(f"{x}_ss", "int64_t"),
        ]
    args += _varlen_args(spec)
    args += _dim_args(spec)
    args.append(KernelArg("softmax_scale", "float"))
    for p in spec.scalar_params:
        args.append(KernelArg(f"p_{p.name}", "int" if p.ty == Ty.I32 else "float"))
    for p in spec.tensor_params:
        args.append(KernelArg(f"t_{p.name}", "const int*" if p.ty == Ty.I32 else "const float*"))
    if needs_block_table(spec):
        args += [
            KernelArg("blk_tab", "const unsigned char*"),
            KernelArg("blk_sb", "int64_t"),
            KernelArg("blk_sh", "int64_t"),
        ]
    return tuple(args)


def plan_forward(
    spec: Spec,
    target: str,
    gpu: str | None = None,
    tiles: TileConfig | None = None,
    options: dict[str, bool] | None = None,
    family: str = "auto",
    persistent: bool | str = False,
    side_terms: bool = True,
    affine: bool = True,
    mask_tiles: bool = True,
    head_groups: bool = True,
    warp_walk: bool = True,
) -> KernelPlan:
    """Lower ``spec`` to the forward kernel plan for ``target`` (``sm_80`` or ``sm_90``).

    ``gpu`` (the CUDA device name, optional) selects tuned tiles from the tuning table; see
    :func:`choose_tiles`.  ``tiles`` replaces that choice (the spill fallback of
    :mod:`flashgen.select` passes its candidates here).  ``options`` overrides entries of
    :data:`FORWARD_OPTIONS` (template code-generation switches of the FA2-class kernel;
    unknown keys raise ``ValueError``; the Hopper kernel has none and ignores them); with
    ``gpu``, a tuning-table entry's ``options`` (:mod:`flashgen.tuning`) come with its tiles
    (chosen or passed as ``tiles``), under the explicit ``options``.
    ``side_terms``: both kernels read the mask's one-sided tensor reads once per query row
    (per CTA) and once per key column of a masked tile (:mod:`flashgen.analysis.rowcol`); False
    keeps them per element (the spill fallback of :mod:`flashgen.select` tries that before
    narrower tiles).  ``affine``: both kernels split an affine score_mod on FULL tiles
    (:func:`affine_context`; False never does, the spill fallback of :mod:`flashgen.select`).
    ``mask_tiles``: the Hopper kernel's masked-tile reductions (``causal_tiles``,
    ``col_limit``, ``nonneg_div`` of :func:`plan_hopper_forward`; False: none, the spill
    fallback).  ``head_groups``: both kernels take their CTAs in L2 head groups
    (:func:`tile_group_expr`; the FA2-class one at :data:`HEAD_GROUP_FA2_HEAD_DIMS`; False:
    head-major, the spill fallback).  ``warp_walk``: the persistent Hopper kernel's producer
    walks the key blocks warp-wide (:func:`plan_hopper_forward`; False: ``fg::iv::prev_live``,
    fewer producer registers, the spill fallback).

    ``sm_80`` renders the FA2-class template (``templates/sm_80/fwd.cu.j2``, Dao 2023,
    Algorithm 1).  ``sm_90`` renders the FA3-class template (``templates/sm_90/fwd.cu.j2``,
    TMA + wgmma + warp specialization, Shah et al. 2024) for the specs
    :func:`hopper_eligible` accepts and whenever ``tiles`` are warp-specialized
    (:func:`is_hopper_tiles`); otherwise (or with ``family="fa2"``) it compiles the
    FA2-class template for ``sm_90a``.  ``persistent`` selects the Hopper kernel's
    persistent tile scheduler (:func:`plan_hopper_forward`); the FA2-class kernel ignores it.

    Raises ``ValueError`` for a target or dtype this version cannot lower.
    """
    if target not in GENCODE:
        raise ValueError(f"unknown target {target!r}; supported: {', '.join(GENCODE)}")
    if spec.dtype not in CTYPE:
        raise ValueError(f"dtype {spec.dtype!r} is not supported yet by the kernels")
    opts = dict(FORWARD_OPTIONS)
    if max(spec.head_dim, spec.head_dim_v) in LAZY_RESCALE_HEAD_DIMS:
        opts["fwd_lazy_rescale"] = True
    for key, value in (options or {}).items():
        if key not in opts:
            raise ValueError(f"unknown forward option {key!r}; known: {', '.join(opts)}")
        opts[key] = bool(value)
    if spec.varlen and needs_block_table(spec):
        raise ValueError(
            "a varlen spec's mask cannot read tensor params (the block table is per padded "
            "batch); varlen already separates the sequences"
        )
    tiles = tiles or choose_tiles(spec, target, gpu, family)
    # A tuning-table entry's switches come with its tiles (explicit ``options`` win); the
    # spill fallback of flashgen.select passes the table's tiles explicitly, so compare.
    for key, value in _table_options(spec, target, gpu, tiles).items():
        if key in opts and key not in (options or {}):
            opts[key] = value
    if is_hopper_tiles(tiles):
        return plan_hopper_forward(
            spec,
            target,
            tiles,
            persistent=persistent,
            side_terms=side_terms,
            affine=affine,
            causal_tiles=mask_tiles,
            col_limit=mask_tiles,
            col_bound=mask_tiles,
            nonneg_div=mask_tiles,
            warp_walk=warp_walk,
            head_groups=head_groups,
        )
    d, dv = spec.head_dim, spec.head_dim_v
    if tiles.block_m % (16 * tiles.num_warps):
        raise ValueError(f"BLOCK_M={tiles.block_m} must be a multiple of 16*num_warps")
    if tiles.block_n % 16:
        raise ValueError(f"BLOCK_N={tiles.block_n} must be a multiple of 16")
    elt = 2
    # sQ (also stages the [BLOCK_M x Dv] output, so max(d, dv) wide), sK, sV: the kernel's
    # SQ_BYTES + SK_BYTES + BLOCK_N * Dv * 2
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
    ctx = _forward_context(
        spec,
        target,
        tiles,
        side_terms=side_terms and not spec.varlen,
        affine=affine,
        head_groups=head_groups and max(d, dv) in HEAD_GROUP_FA2_HEAD_DIMS,
    )
    ctx["smem_bytes"] = smem  # the template static_asserts its layout against this
    ctx["table_smem"] = table_smem
    ctx.update(
        opts,
        fold_scale=opts["fwd_fold_scale"] and spec.score_mod is None,
        load_chain=uses_load_chain(spec, tiles),
    )
    return KernelPlan(
        spec_name=spec.name,
        target=target,
        template="sm_80/fwd.cu.j2",
        kernel_name=ctx["kernel_name"],
        tiles=tiles,
        smem_bytes=smem,
        args=ctx["args"],
        context=ctx,
    )


def _table_options(spec: Spec, target: str, gpu: str | None, tiles: TileConfig) -> dict[str, bool]:
    """The FA2-class template switches the tuning table recorded with its entry's tiles
    (``options``; see :mod:`flashgen.tuning`) when ``tiles`` are those tiles: none when the
    spec pins tiles or the tiles are the Hopper kernel's."""
    from flashgen.tuning import lookup, lookup_options

    o = spec.tiles
    if not gpu or is_hopper_tiles(tiles) or o.block_m or o.block_n or o.num_warps:
        return {}
    key = (gpu, target, max(spec.head_dim, spec.head_dim_v), spec.dtype)
    key += (split_causal(spec.mask)[0], spec.score_mod is not None)
    tuned = lookup(*key)
    if tuned is None or TileConfig(*tuned) != tiles:
        return {}
    return lookup_options(*key)


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


def _side_terms(terms: tuple[rowcol.Term, ...], spec: Spec, inv: Invariants | None) -> list[dict]:
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


#: ``FLASHGEN_AFFINE=0`` turns the affine score_mod decomposition off (:func:`affine_context`).
AFFINE_ENV = "FLASHGEN_AFFINE"
#: ``FLASHGEN_CAUSAL_TILES=0`` turns off the Hopper forward's CAUSAL_ONLY / NO_CAUSAL tiles
#: (:func:`causal_tiles_context`): every PARTIAL tile evaluates the whole mask.
CAUSAL_TILES_ENV = "FLASHGEN_CAUSAL_TILES"
#: ``FLASHGEN_COL_LIMIT=0``: the Hopper forward's masked tiles test bounds and causal per element
#: as before, not as one comparison with a per-row column limit (:func:`plan_hopper_forward`).
COL_LIMIT_ENV = "FLASHGEN_COL_LIMIT"
#: ``FLASHGEN_COL_BOUND=0``: the Hopper forward's masked tiles evaluate a residual conjunct that
#: is a column bound (``q_idx + seqlen_k - seqlen_q - kv_idx < window``) per element, not as a
#: per-row column range (:mod:`flashgen.analysis.colbound`, :func:`plan_hopper_forward`).
COL_BOUND_ENV = "FLASHGEN_COL_BOUND"
#: ``FLASHGEN_SINGLE_WALK=0``: every warp of the Hopper forward walks the tile classifier for the
#: first live key block, not warp 0 alone (:func:`plan_hopper_forward`).
SINGLE_WALK_ENV = "FLASHGEN_SINGLE_WALK"
#: ``FLASHGEN_WALK_FROM_DIAGONAL=0``: the Hopper forward's key-block walk starts at the last
#: key block, not at the causal diagonal's (:func:`plan_hopper_forward`).
WALK_FROM_DIAGONAL_ENV = "FLASHGEN_WALK_FROM_DIAGONAL"
#: ``FLASHGEN_PERSISTENT_WARP_WALK=0``: the persistent Hopper forward's producer walks a tile's
#: key blocks with ``fg::iv::prev_live`` (one classifier call per step), not the warp-wide
#: ``fg::iv::WarpWalk`` (:func:`plan_hopper_forward`, ``warp_walk``).
PERSISTENT_WARP_WALK_ENV = "FLASHGEN_PERSISTENT_WARP_WALK"
#: ``FLASHGEN_HEAD_GROUPS=0``: the forward kernels take (batch, head, query block) tiles
#: head-major (a group of one head), not in L2-sized head groups (:func:`tile_group_expr`).
HEAD_GROUPS_ENV = "FLASHGEN_HEAD_GROUPS"
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
    * 2`` bytes) within ``l2_bytes``, at least one, times the ``q_per_kv`` query heads that
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
    rows from being left for last (head-major order's idle tail: ~5% at B=2, S=8k);
    otherwise, and with ``FLASHGEN_HEAD_GROUPS=0``, ``1`` (head-major: CTAs of one head are
    alike, and they share its K/V in L2 best).  ``backward``: the Hopper backward's units
    are (batch, KV head) pairs, each reading the Q and dO rows of its query heads."""
    if m_major:
        return "batch * heads_q"
    if spec.mask is None or spec.varlen or not flag(HEAD_GROUPS_ENV, True):
        return "1"
    kv_row_bytes = (spec.head_dim + spec.head_dim_v) * 2
    if backward:
        return (
            f"fg::head_group({HEAD_GROUP_L2_BYTES}LL, seqlen_q, {kv_row_bytes} * (heads_q / "
            "heads_kv), 1, batch * heads_kv)"
        )
    return (
        f"fg::head_group({HEAD_GROUP_L2_BYTES}LL, seqlen_k, {kv_row_bytes}, heads_q / heads_kv, "
        "batch * heads_q)"
    )


def _causal_as_true(e: Expr) -> Expr:
    """``e`` with every ``causal`` replaced by the constant true."""
    if isinstance(e, Causal):
        return Const(True, ty=Ty.BOOL)
    kids = ir.children(e)
    if not kids:
        return e
    return rowcol._with_children(e, tuple(_causal_as_true(k) for k in kids))


def causal_tiles_context(spec: Spec, ctx: dict) -> dict:
    """Template entries for the Hopper forward's causal tile flags (``fg::iv::CAUSAL_ONLY`` /
    ``NO_CAUSAL``, :func:`flashgen.analysis.masktiles.classifier_source` with ``causal_bits``),
    given
    the forward context ``ctx`` (:func:`_forward_context`; it has ``mask_expr_nc``).

    ``causal_tiles``: whether the classifier sets the flags (a mask with ``causal`` and more,
    classified by the kernel, not a block table; ``FLASHGEN_CAUSAL_TILES`` not 0).  Then a
    PARTIAL tile whose mask is ``causal`` there runs causal_d128's masked loop (bounds and the
    causal test), and one where ``causal`` holds everywhere evaluates ``mask_expr_nc``: the
    residual mask with ``causal`` replaced by true (``IS_CAUSAL`` off).  The same
    ``row_terms`` / ``col_terms`` serve both residual forms."""
    on = (
        flag(CAUSAL_TILES_ENV, True)
        and not ctx["block_table"]
        and ctx["mask_expr"] is not None
        and masktiles.has_causal_bits(spec)
    )
    out: dict = {"causal_tiles": on}
    if on:
        out["tile_classifier"] = masktiles.classifier_source(spec, causal_bits=True)
    return out


def affine_context(spec: Spec, inv: Invariants | None) -> dict | None:
    """The affine decomposition of ``spec``'s score_mod (:mod:`flashgen.analysis.affine`) as CUDA
    float expressions, or None (no affine form, or ``FLASHGEN_AFFINE=0``).

    ``offset``: L, to evaluate where ``q_idx``/``q_idx_f`` are a row's clamped query index
    and ``kv_idx``/``kv_idx_f`` the tile's first key ``n0``; ``kv_coef``: beta, the
    coefficient of ``kv_idx`` (CTA-invariant; it may read ``h``, ``b``, tensor params).
    The kernel computes ``x' = score + beta * (kv_idx - n0)`` per element and adds L(q, n0)
    to the row max and the exp2's addend (FULL tiles only)."""
    if not flag(AFFINE_ENV, True):
        return None
    form = affine.decompose(spec.score_mod, spec)
    if form is None:
        return None

    def as_float(e: Expr) -> str:
        code = cuda_expr(e, spec, inv)
        if e.ty == Ty.I32:
            twins = _float_affine(e, spec) if _affine_int(e) else None
            return twins if twins is not None else _cast(code, Ty.I32, Ty.F32)
        return code

    return {"offset": as_float(form.offset), "kv_coef": as_float(form.kv_coef)}


def _forward_context(
    spec: Spec,
    target: str,
    tiles: TileConfig,
    *,
    side_terms: bool = False,
    affine: bool = False,
    nonneg_div: bool = False,
    head_groups: bool = True,
    col_bound: bool = False,
) -> dict:
    """Template context shared by the forward kernels: sizes, tiles, the causal flag, the
    residual mask and score_mod as CUDA expressions, the ABI argument list.

    ``side_terms``: the mask's one-sided tensor reads become ``row_terms`` (evaluated once
    per query row) and ``col_terms`` (once per key column of a masked tile), see
    :mod:`flashgen.analysis.rowcol`; otherwise both lists are empty.  ``mask_reads_memory``: whether
    the rendered ``mask_expr`` still reads a tensor (the template then short-circuits it
    behind the cheap bounds and causal tests).  ``affine``: an affine score_mod's split
    (``affine``, :func:`affine_context`) for the FULL tiles; otherwise ``affine`` is None.
    ``nonneg_div``: see :class:`Invariants`.  ``head_groups``: the CTA order's
    ``tile_group`` (:func:`tile_group_expr`; False: head-major).

    ``tile_mask_expr``: the expression a masked tile of each kind (``mask``, ``nc``, ``causal``:
    see :func:`causal_tiles_context`) evaluates per element, besides the bounds and causal
    tests.  ``col_bound`` (the Hopper forward with ``col_limit``): the residual's conjuncts
    that are column bounds (:func:`flashgen.analysis.colbound.extract`) leave it, and ``col_bound``
    holds ``lo`` / ``hi``, CUDA ``long long`` expressions of a row's ``q_idx`` (None: no bound
    that side) that the masked tiles of kinds ``mask`` and ``nc`` fold into their per-row
    column range; otherwise ``col_bound`` is None.  With a score_mod only a residual that is
    all bounds qualifies (the score_mod loop tests a rest per element, the column range after
    the loop)."""
    d, dv = spec.head_dim, spec.head_dim_v
    causal, residual = split_causal(spec.mask)
    score_mod = spec.score_mod
    # both forward templates define score_raw = q.k
    inv = Invariants(raw_score="score_raw", nonneg_div=nonneg_div)
    parts = rowcol.Split(residual, (), ())
    if side_terms and residual is not None:
        parts = rowcol.split(residual, spec)
    residual = parts.expr
    mask_expr = cuda_expr(residual, spec, inv) if residual is not None else None
    mask_expr_nc = None
    if residual is not None:
        mask_expr_nc = cuda_expr(_causal_as_true(residual), spec, inv)
    tile_mask_expr = {"mask": mask_expr, "nc": mask_expr_nc, "causal": None}
    bound = colbound.extract(residual, spec) if col_bound else None
    if bound is not None and score_mod is not None and bound.rest is not None:
        bound = None
    col_bound_ctx = None
    if bound is not None:
        rest = bound.rest
        tile_mask_expr = {
            "mask": cuda_expr(rest, spec, inv) if rest is not None else None,
            "nc": cuda_expr(_causal_as_true(rest), spec, inv) if rest is not None else None,
            "causal": None,
        }

        def row_code(e: Expr) -> str:
            return cuda_expr(e, spec)

        col_bound_ctx = {
            "lo": colbound.bound_code(bound.lo, row_code, "max"),
            "hi": colbound.bound_code(bound.hi, row_code, "min"),
        }
    score_mod_expr = cuda_expr(score_mod, spec, inv) if score_mod is not None else None
    affine_ctx = affine_context(spec, inv) if affine and score_mod is not None else None
    return {
        "spec_name": spec.name,
        "kernel_name": f"flashgen_{spec.name}_fwd_{target}",
        "dtype": spec.dtype,
        "elem_t": CTYPE[spec.dtype],
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
        # score_mod = score + L, L affine in q_idx, kv_idx (FULL tiles: one FFMA per element)
        "affine": affine_ctx,
        "row_terms": _side_terms(parts.rows, spec, inv),
        "col_terms": _side_terms(parts.cols, spec, inv),
        "mask_reads_memory": residual is not None
        and any(isinstance(n, Index) for n in ir.walk(residual)),
        "prologue": inv.prologue,
        "varlen": spec.varlen,
        "args": kernel_args(spec),
        "block_table": needs_block_table(spec),
        # block sparsity: the mask's tile classifier and its arguments after the tile bounds
        "tile_classifier": masktiles.classifier_source(spec),
        "tile_class_args": ", ".join(n for _, n in masktiles.classifier_params(spec)[4:]),
        # CTA order: heads in L2-sized groups, query-block major within one (tile_order.cuh)
        "tile_group": tile_group_expr(spec) if head_groups else "1",
        "needs_bh": _uses(residual, {"b", "h", "h_kv"})
        or _uses(score_mod, {"b", "h", "h_kv"})
        or bool(spec.tensor_params),
    }


def plan_hopper_forward(
    spec: Spec,
    target: str,
    tiles: TileConfig,
    *,
    stages: int | None = None,
    m_major: bool | None = None,
    persistent: bool | str = False,
    side_terms: bool = True,
    affine: bool = True,
    causal_tiles: bool = True,
    walk_from_diagonal: bool = True,
    col_limit: bool = True,
    col_bound: bool = True,
    nonneg_div: bool = True,
    single_walk: bool = True,
    warp_walk: bool = True,
    head_groups: bool = True,
) -> KernelPlan:
    """The FA3-class plan (``templates/sm_90/fwd.cu.j2``): TMA + wgmma + warp specialization.

    Same ABI as the FA2-class kernel plus three ``CUtensorMap`` arguments (``tma_q``,
    ``tma_k``, ``tma_v``) appended; :class:`TmaArg` tells the launcher how to build them.
    A mask that reads tensors takes ``blk_tab`` as there, built by :func:`plan_block_table`
    for these ``tiles``: the producer walks its row instead of the tile classifier.
    ``stages``: K/V ring depth (default :data:`HOPPER_STAGES`).  ``m_major``: CTA order
    query-block-major over all (batch, head) pairs, so every head's heaviest causal block
    runs first; the default (False) is head-major (each head's query blocks together,
    heaviest first for causal: best L2 reuse of K/V, and measured faster on the H200 for
    causal and non-causal alike).

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
    one per captured call, ``flashgen.ops.op._tile_counter``).
    ``side_terms``: the mask's one-sided tensor reads are read once per query row and once
    per key column of a masked tile, not per element (:mod:`flashgen.analysis.rowcol`).  ``affine``:
    FULL tiles split an affine score_mod (:func:`affine_context`).
    ``causal_tiles``: PARTIAL tiles where the mask is just ``causal`` (or ``causal`` holds
    everywhere) run a cheaper masked loop (:func:`causal_tiles_context`; also off with
    ``FLASHGEN_CAUSAL_TILES=0``).  ``walk_from_diagonal``: with a top-level ``causal``, the
    walk of the live key blocks (last to first) starts at the block of the query block's last
    row's diagonal, not at the last key block: the blocks past it are EMPTY, and the first
    classifier calls of every CTA (before any load is issued) find the first block at once
    (also off with ``FLASHGEN_WALK_FROM_DIAGONAL=0``).  ``col_limit``: a masked tile tests
    ``kv_idx < seqlen_k`` and the causal test (and, with a score_mod, ``q_idx < seqlen_q``)
    per element as one comparison of the column offset with a per-row limit (FA3's
    ``col_limit``), not two or three comparisons of indices (also off with
    ``FLASHGEN_COL_LIMIT=0``).  ``col_bound`` (with ``col_limit``): a residual conjunct that
    keeps a column range per row (``q_idx + seqlen_k - seqlen_q - kv_idx < window``,
    :mod:`flashgen.analysis.colbound`) joins that limit as a per-row range, two comparisons per
    element, instead of being evaluated (also off with ``FLASHGEN_COL_BOUND=0``).
    ``nonneg_div``: ``kv_idx / chunk`` and other integer
    divisions by a kernel-invariant divisor with ``x >= 0`` and ``d >= 1`` proven take
    ``fg::Divisor::div_nn`` (:class:`Invariants`; also off with ``FLASHGEN_NONNEG_DIV=0``).
    ``single_walk`` (non-persistent, no block table): warp 0 alone runs the classifier for the
    first live key block and hands it to the other warps through shared memory (4 bytes),
    instead of all twelve warps classifying at once before the barrier (also off with
    ``FLASHGEN_SINGLE_WALK=0``).  ``warp_walk`` (persistent, no block table): the producer
    walks each tile's live key blocks warp-wide (``fg::iv::WarpWalk``, a fresh window per
    tile: one classifier call per lane for 32 blocks, then a ballot per step), as the
    non-persistent kernel does, not with ``fg::iv::prev_live`` (one classifier call per step,
    the 32 lanes computing the same; also off with ``FLASHGEN_PERSISTENT_WARP_WALK=0``).
    ``head_groups``: see :func:`plan_forward`.
    """
    if persistent is True:
        persistent = "static"
    if persistent and persistent not in PERSISTENT_SCHEDULERS:
        known = ", ".join(PERSISTENT_SCHEDULERS)
        raise ValueError(f"unknown persistent scheduler {persistent!r}; known: {known}")
    if persistent == "m_major":
        m_major = True
    dynamic = persistent == "dynamic"
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
    d = spec.head_dim
    consumers = tiles.num_warps // 4 - 1
    tile_bytes = (tiles.block_m + 2 * stages * tiles.block_n) * d * 2
    smem = 1024 + tile_bytes + 8 * (1 + 5 * stages)  # 1 KiB alignment slack, mbarriers, stage info
    separate_o = False
    if persistent:
        smem += 40  # q_empty (8 bytes), tile_info (2 x 4 ints)
        # the epilogue's own staging buffer (BLOCK_M x HEAD_DIM) where it fits
        separate_o = smem + tiles.block_m * d * 2 <= HOPPER_SMEM_LIMIT
        smem += tiles.block_m * d * 2 if separate_o else 0
    elif needs_block_table(spec):
        smem += 4 * tiles.num_warps  # warp_last: each warp's last live key block of the table row
    else:
        single_walk = single_walk and flag(SINGLE_WALK_ENV, True)
        smem += 8 if single_walk else 0  # first_slot: warp 0's first live key block
    if smem > HOPPER_SMEM_LIMIT:
        raise ValueError(f"{tiles} with {stages} stages needs {smem} B of shared memory")
    # (not at head_dim 256 with a score_mod: gemma2_softcap spilled 4 bytes there)
    col_limit = bool(
        col_limit and flag(COL_LIMIT_ENV, True) and not (spec.score_mod is not None and d >= 256)
    )
    ctx = _forward_context(
        spec,
        target,
        tiles,
        side_terms=side_terms,
        affine=affine,
        nonneg_div=nonneg_div,
        head_groups=head_groups,
        col_bound=bool(col_limit and col_bound and flag(COL_BOUND_ENV, True)),
    )
    ctx["smem_bytes"] = smem
    ctx["nonneg_div"] = nonneg_div
    ctx["single_walk"] = bool(single_walk and not persistent and not ctx["block_table"])
    ctx["warp_walk"] = bool(
        warp_walk and persistent and not ctx["block_table"] and flag(PERSISTENT_WARP_WALK_ENV, True)
    )
    if not causal_tiles:
        ctx["causal_tiles"] = False
    else:
        ctx.update(causal_tiles_context(spec, ctx))
    ctx["col_limit"] = col_limit
    ctx["walk_from_diagonal"] = bool(
        walk_from_diagonal and ctx["causal"] and flag(WALK_FROM_DIAGONAL_ENV, True)
    )
    if m_major is None:
        m_major = False
    tma = (TmaArg("tma_q", "q", tiles.block_m), TmaArg("tma_k", "k", tiles.block_n),
           TmaArg("tma_v", "v", tiles.block_n))  # fmt: skip
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
        mma_t=spec.dtype.replace("fp", "f"),
        wgmma_ns=sorted({tiles.block_n, d}),
    )
    return KernelPlan(
        spec_name=spec.name,
        target=target,
        template="sm_90/fwd.cu.j2",
        kernel_name=ctx["kernel_name"],
        tiles=tiles,
        smem_bytes=smem,
        args=ctx["args"],
        context=ctx,
        tma=tma,
    )


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
    ``t`` decoded by :func:`tile_coord` with ``group`` heads per group (1: head-major;
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


#: Threads per CTA of the block-table pre-pass (one CTA per (slice, m block, n block) tile).
BLOCK_TABLE_THREADS = 128


def plan_block_table(spec: Spec, target: str, tiles: TileConfig) -> KernelPlan:
    """Lower the block-table pre-pass of ``spec`` (a mask that reads tensor params).

    The kernel (``templates/sm_80/blockmask.cu.j2``) evaluates the whole mask, causal
    included, from the same IR as the forward kernel over the in-range (q_idx, kv_idx) pairs
    of each (BLOCK_M x BLOCK_N) tile of ``tiles`` (the forward kernel's), and writes one
    byte per tile: 0 EMPTY (no pair kept), 2 FULL (every in-range pair kept), 1 PARTIAL.
    Tiles the interval analysis (:mod:`flashgen.analysis.masktiles`, tensor reads unknown) already
    calls EMPTY or FULL evaluate no pair; the others read the mask's one-sided tensor reads
    once per row and column (:mod:`flashgen.analysis.rowcol`) and stop, thread by thread, once a
    kept
    and a dropped pair are seen. This is FlexAttention's BlockMask idea (create_block_mask),
    built on the GPU in O(tiles) memory. One CTA per tile, a 1-D grid over tab_b * tab_h *
    m_blocks * n_blocks (see :meth:`BlockTablePlan.grid`).

    ABI: ``tab`` (unsigned char*, contiguous [tab_b, tab_h, m_blocks, n_blocks]);
    ``batch heads_q heads_kv seqlen_q seqlen_k tab_b tab_h`` (int); then the scalar and
    tensor params as in the forward ABI.  ``tab_b`` is ``batch`` when the mask reads ``b``
    else 1 (the kernel then evaluates at b = 0); ``tab_h`` likewise for ``h``.
    Raises ``ValueError`` when the mask reads no tensor param.
    """
    if not needs_block_table(spec):
        raise ValueError(f"spec {spec.name!r}: the mask reads no tensor param; no block table")
    if target not in GENCODE:
        raise ValueError(f"unknown target {target!r}; supported: {', '.join(GENCODE)}")
    dims = [KernelArg(n, "int") for n in ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k")]
    args = (
        KernelArg("tab", "unsigned char*"),
        *dims,
        KernelArg("tab_b", "int"),
        KernelArg("tab_h", "int"),
        *_param_args(spec),
    )
    per_b, per_h = block_table_dims(spec)
    name = f"flashgen_{spec.name}_blockmask_{target}_{tiles.block_m}x{tiles.block_n}"
    inv = Invariants()
    parts = rowcol.split(spec.mask, spec)
    ctx = {
        "spec_name": spec.name,
        "kernel_name": name,
        "block_m": tiles.block_m,
        "block_n": tiles.block_n,
        "threads": BLOCK_TABLE_THREADS,
        "mask_expr": cuda_expr(parts.expr, spec, inv),
        "row_terms": _side_terms(parts.rows, spec, inv),
        "col_terms": _side_terms(parts.cols, spec, inv),
        "tile_classifier": masktiles.classifier_source(spec),
        "tile_class_args": ", ".join(n for _, n in masktiles.classifier_params(spec)[4:]),
        "prologue": inv.prologue,
        "args": args,
        "per_batch": per_b,
        "per_head": per_h,
    }
    return KernelPlan(
        spec_name=spec.name,
        target=target,
        template="sm_80/blockmask.cu.j2",
        kernel_name=name,
        tiles=TileConfig(tiles.block_m, tiles.block_n, BLOCK_TABLE_THREADS // 32),
        smem_bytes=0,
        args=args,
        context=ctx,
    )


def block_table_shape(
    spec: Spec, tiles: TileConfig, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int
) -> tuple[int, int, int, int]:
    """``(tab_b, tab_h, m_blocks, n_blocks)``: the block table's shape for a problem."""
    per_b, per_h = block_table_dims(spec)
    return (
        batch if per_b else 1,
        heads_q if per_h else 1,
        -(-seqlen_q // tiles.block_m),
        -(-seqlen_k // tiles.block_n),
    )


# ----------------------------------------------------------------------------- backward
@dataclass(frozen=True)
class BackwardTiles:
    """Tiles of the backward kernels (FA2 backward, Dao 2023, Algorithm 2).

    dkdv: each CTA owns ``dkdv_block_n`` key rows (16 per warp) and walks the query rows of
    every head in its GQA group ``dkdv_block_m`` at a time; ``dkdv_dsplit`` > 1 splits the
    dK/dV columns over that many CTAs when the accumulators would not fit in registers.
    dq: each CTA owns ``dq_block_m`` query rows (16 per warp) and walks ``dq_block_n`` keys
    at a time (deterministic path only; the atomic-dQ path has no dq kernel and ignores
    these three fields).
    """

    dkdv_block_n: int
    dkdv_block_m: int
    dkdv_warps: int
    dkdv_dsplit: int
    dq_block_m: int
    dq_block_n: int
    dq_warps: int


#: (head_dim, has score_mod) -> tiles; every entry compiles with zero spills for the
#: shipped specs (a score_mod's math needs registers, so it gets narrower steps).
#: head_dim 32, 96, 160, 192 are chosen by ptxas register counts only (not timed yet),
#: checked spill-free with causal, causal + softcap and causal + ALiBi for both targets:
#: 160 without a score_mod keeps dsplit 1 (no recomputed S, dP) with 16-row query steps;
#: 160/192 with one, and 192 always, split the columns like 256.
BACKWARD_TILES: dict[tuple[int, bool], BackwardTiles] = {
    (32, False): BackwardTiles(64, 64, 4, 1, 64, 64, 4),
    (64, False): BackwardTiles(64, 64, 4, 1, 64, 64, 4),
    (96, False): BackwardTiles(64, 64, 4, 1, 64, 64, 4),
    (96, True): BackwardTiles(64, 32, 4, 1, 64, 32, 4),
    (128, False): BackwardTiles(64, 32, 4, 1, 64, 32, 4),
    (128, True): BackwardTiles(64, 16, 4, 1, 64, 32, 4),
    (160, False): BackwardTiles(64, 16, 4, 1, 64, 32, 4),
    (160, True): BackwardTiles(64, 32, 4, 2, 64, 32, 4),
    (192, False): BackwardTiles(64, 32, 4, 2, 64, 32, 4),
    (192, True): BackwardTiles(64, 64, 4, 2, 64, 16, 4),
    (256, False): BackwardTiles(64, 32, 4, 2, 64, 32, 4),
}
#: Tiles of the atomic-dQ path (:func:`plan_backward` with ``atomic_dq=True``), same keys.
#: Its dkdv kernel also holds a [dkdv_block_m x head_dim / dsplit / warps] dQ accumulator
#: during the dQ product (acc_s / acc_dp are dead by then) and KV_N x (KV_M + 8) elements of
#: shared memory for dS^T.  The number of float atomics is B*Hq*Sq*Sk*D / dkdv_block_n
#: (halved by causal), so a wider key block means fewer atomics.  Not tuned on a GPU yet:
#: the same tiles as the deterministic kernels, except a score_mod at head_dim 128, where
#: 64 key rows spill on sm_90a (alibi, 16-52 bytes) and 32 rows with 2 warps do not
#: (4x FA2's atomics; the other zero-spill option, dsplit 2, recomputes S and dP twice).
#: head_dim 160 splits its 160 columns in two 80-column halves (5 mma tiles: one column
#: group, so 4 row groups and 64-row query steps); 192 with a score_mod needs the same
#: 64-row steps to stay spill-free (157 KB of shared memory, one CTA per SM).
ATOMIC_BACKWARD_TILES: dict[tuple[int, bool], BackwardTiles] = {
    (32, False): BackwardTiles(64, 64, 4, 1, 64, 64, 4),
    (64, False): BackwardTiles(64, 64, 4, 1, 64, 64, 4),
    (96, False): BackwardTiles(64, 32, 4, 1, 64, 32, 4),
    (96, True): BackwardTiles(64, 32, 4, 1, 64, 32, 4),
    (128, False): BackwardTiles(64, 32, 4, 1, 64, 32, 4),
    (128, True): BackwardTiles(32, 16, 2, 1, 64, 32, 4),
    (160, False): BackwardTiles(64, 64, 4, 2, 64, 32, 4),
    (160, True): BackwardTiles(64, 64, 4, 2, 64, 32, 4),
    (192, False): BackwardTiles(64, 32, 4, 2, 64, 32, 4),
    (192, True): BackwardTiles(64, 64, 4, 2, 64, 16, 4),
    (256, False): BackwardTiles(64, 32, 4, 2, 64, 32, 4),
}
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
            chunks = rows * (self.dkdv.context["head_dim"] // 4)
            out["convert"] = (-(-chunks // CONVERT_THREADS), 1, 1)
        else:
            m_blocks = -(-seqlen_q // t.dq_block_m)
            out["dq"] = (m_blocks * batch * heads_q, 1, 1)
        return out


def _strides(*names: str) -> list[KernelArg]:
    return [KernelArg(f"{x}_{s}", "int64_t") for x in names for s in ("sb", "sh", "ss")]


def _param_args(spec: Spec) -> list[KernelArg]:
    args = [
        KernelArg(f"p_{p.name}", "int" if p.ty == Ty.I32 else "float") for p in spec.scalar_params
    ]
    args += [
        KernelArg(f"t_{p.name}", "const int*" if p.ty == Ty.I32 else "const float*")
        for p in spec.tensor_params
    ]
    return args


#: Code-generation switches of the backward template (``templates/sm_80/bwd.cu.j2``), like
#: :data:`FORWARD_OPTIONS`.  ``bwd_unrolled_loads``: tile loads with a compile-time trip
#: count (as the forward's ``fwd_unrolled_loads``).  ``bwd_async_stats``: the dK/dV kernel
#: fetches each step's lse and dsum with cp.async along with Q and dO (they were plain
#: global loads, a full memory latency inside every step); not with a score_mod, whose
#: math leaves no registers for it (alibi's dK/dV kernels spill 8-16 bytes).
#: ``bwd_hoisted_swizzle``: ldmatrix addresses as in the forward's ``fwd_hoisted_swizzle``.
BACKWARD_OPTIONS: dict[str, bool] = {
    "bwd_unrolled_loads": True,
    "bwd_async_stats": True,
    "bwd_hoisted_swizzle": True,
}


def atomic_dq_warp_grid(tiles: BackwardTiles, head_dim: int) -> tuple[int, int]:
    """``(AQ_WM, AQ_WN)``: how the atomic dkdv kernel's warps split the step's dQ tile
    [dkdv_block_m x head_dim / dkdv_dsplit] into AQ_WM row groups x AQ_WN column groups of
    whole 16 x 16 mma tiles, one warp each.

    The grid that keeps the most warps busy wins, then the one with the most column groups
    (each warp then reads a disjoint slice of K, the larger operand, once).  Head dims 64,
    128 and 256 with the table's tiles split min(warps, columns / 16) ways by columns, as
    before; 96 and 192 (6 and 12 column tiles over 4 warps) take 2 x 2.  When no grid uses
    every warp (e.g. 80 columns = 5 tiles and 2 row tiles over 4 warps) the remaining warps
    sit out the dQ product (the kernel skips it for warp >= AQ_WM * AQ_WN).
    """
    warps = tiles.dkdv_warps
    col_tiles = head_dim // tiles.dkdv_dsplit // 16
    row_tiles = tiles.dkdv_block_m // 16
    grids = [
        (wm, wn)
        for wn in range(1, warps + 1)
        for wm in range(1, warps // wn + 1)
        if col_tiles % wn == 0 and row_tiles % wm == 0
    ]
    return max(grids, key=lambda g: (g[0] * g[1], g[1]))


#: The backward kernels that can take row / column terms (``plan_backward``'s ``side_terms``):
#: the dK/dV kernel (deterministic or atomic) and the deterministic dQ kernel.
BACKWARD_SIDE_TERM_KERNELS = frozenset({"dkdv", "dq"})


def plan_backward(
    spec: Spec,
    target: str,
    *,
    atomic_dq: bool = False,
    tiles: BackwardTiles | None = None,
    options: dict[str, bool] | None = None,
    side_terms: bool | Iterable[str] = True,
) -> BackwardPlan:
    """Lower ``spec`` to its backward kernels for ``target`` (template ``sm_80/bwd.cu.j2``).

    ``atomic_dq`` False: the deterministic kernels (pre, dkdv, dq; tiles from
    ``BACKWARD_TILES``).  True: the atomic-dQ kernels (pre, dkdv with the dQ product and
    float atomics into ``dq_accum``, convert; tiles from ``ATOMIC_BACKWARD_TILES``); see
    :class:`BackwardPlan`.  The score_mod derivative d score_mod / d score comes from
    :func:`flashgen.analysis.derive.d_dscore`.  ``tiles`` replaces the table's choice (the spill
    fallback of :mod:`flashgen.select`).  ``options`` overrides entries of
    :data:`BACKWARD_OPTIONS`.  ``side_terms``: the kernels (of :data:`BACKWARD_SIDE_TERM_KERNELS`;
    True all, False none) that read the mask's one-sided tensor reads once per side of a
    masked tile instead of per element (:mod:`flashgen.analysis.rowcol`): the side the kernel holds
    per CTA (dkdv: its keys, dq: its query rows) two values per thread and step, the side
    it steps over coalesced by lanes and shuffled to the elements.  Raises ``ValueError``
    like :func:`plan_forward`.
    """
    from flashgen.analysis.derive import d_dscore

    opts = dict(BACKWARD_OPTIONS)
    for key, value in (options or {}).items():
        if key not in opts:
            raise ValueError(f"unknown backward option {key!r}; known: {', '.join(opts)}")
        opts[key] = bool(value)

    if side_terms is True or side_terms is False:
        term_kernels = BACKWARD_SIDE_TERM_KERNELS if side_terms else frozenset()
    else:
        term_kernels = frozenset(side_terms)
        unknown = sorted(term_kernels - BACKWARD_SIDE_TERM_KERNELS)
        if unknown:
            raise ValueError(
                f"side_terms names unknown kernels {unknown}; "
                f"known: {', '.join(sorted(BACKWARD_SIDE_TERM_KERNELS))}"
            )
    fwd = plan_forward(spec, target)  # validates target and dtype
    t = tiles or _table_backward_tiles(spec, atomic_dq)
    d, dv = spec.head_dim, spec.head_dim_v
    et = CTYPE[spec.dtype]
    dims = _dim_args(spec)
    ins = [KernelArg(n, f"const {et}*") for n in ("q", "k", "v", "dout")]
    stats = [KernelArg("lse", "const float*"), KernelArg("dsum", "const float*")]
    stats += _varlen_args(spec)
    tail = [*dims, KernelArg("softmax_scale", "float"), *_param_args(spec)]
    accum = [KernelArg("dq_accum", "float*")] if atomic_dq else []
    pre_args = (
        KernelArg("o", f"const {et}*"),
        KernelArg("dout", f"const {et}*"),
        KernelArg("dsum", "float*"),
        *accum,
        *_strides("o", "dout"),
        KernelArg("batch", "int"),
        KernelArg("heads_q", "int"),
        KernelArg("seqlen_q", "int"),
    )
    dkdv_args = (
        *ins,
        *stats,
        KernelArg("dk", f"{et}*"),
        KernelArg("dv", f"{et}*"),
        *accum,
        *_strides("q", "k", "v", "dout", "dk", "dv"),
        *tail,
    )
    convert_args = (
        KernelArg("dq_accum", "const float*"),
        KernelArg("dq", f"{et}*"),
        *_strides("dq"),
        KernelArg("batch", "int"),
        KernelArg("heads_q", "int"),
        KernelArg("seqlen_q", "int"),
        KernelArg("softmax_scale", "float"),
    )
    dq_args = (
        *ins,
        *stats,
        KernelArg("dq", f"{et}*"),
        *_strides("q", "k", "v", "dout", "dq"),
        *tail,
    )
    grid = atomic_dq_warp_grid(t, d) if atomic_dq else (0, 0)  # unused by the deterministic unit
    score_grad = d_dscore(spec.score_mod) if spec.score_mod is not None else None
    base = f"flashgen_{spec.name}_bwd_{target}"
    ctx = dict(fwd.context)
    ctx.update(
        **opts,
        async_stats=opts["bwd_async_stats"] and spec.score_mod is None,
        atomic_dq=atomic_dq,
        kernel_pre=f"{base}_pre",
        kernel_dkdv=f"{base}_dkdv_atomic" if atomic_dq else f"{base}_dkdv",
        kernel_dq=f"{base}_dq",
        kernel_convert=f"{base}_convert",
        pre_args=pre_args,
        dkdv_args=dkdv_args,
        dq_args=dq_args,
        convert_args=convert_args,
        convert_threads=CONVERT_THREADS,
        pre_warps=PRE_WARPS,
        dkdv_block_n=t.dkdv_block_n,
        dkdv_block_m=t.dkdv_block_m,
        dkdv_warps=t.dkdv_warps,
        dkdv_dsplit=t.dkdv_dsplit,
        dq_block_m=t.dq_block_m,
        dq_block_n=t.dq_block_n,
        dq_warps=t.dq_warps,
        aq_wm=grid[0],
        aq_wn=grid[1],
    )
    # The backward kernels run at the 255-register ceiling: a hoisted divisor would hold a
    # register through the whole loop (and spill), so they divide in place (no Invariants).
    residual = split_causal(spec.mask)[1]
    parts = rowcol.Split(residual, (), ())
    if term_kernels and residual is not None and not spec.varlen:
        parts = rowcol.split(residual, spec)
    has_terms = bool(parts.rows or parts.cols)
    ctx.update(
        mask_expr_split=cuda_expr(parts.expr, spec) if has_terms else None,
        row_terms=_side_terms(parts.rows, spec, None),
        col_terms=_side_terms(parts.cols, spec, None),
        dkdv_side_terms=has_terms and "dkdv" in term_kernels,
        dq_side_terms=has_terms and "dq" in term_kernels and not atomic_dq,
    )
    ctx.update(
        mask_expr=cuda_expr(residual, spec) if residual is not None else None,
        score_mod_expr=cuda_expr(spec.score_mod, spec) if spec.score_mod is not None else None,
        score_grad_expr=cuda_expr(score_grad, spec) if score_grad is not None else None,
    )
    del ctx["prologue"]
    dkdv_smem = (t.dkdv_block_n * (d + dv) + 2 * t.dkdv_block_m * (d + dv)) * 2
    dkdv_smem += 2 * 2 * t.dkdv_block_m * 4  # lse and dsum of both stages
    if atomic_dq:
        dkdv_smem += t.dkdv_block_n * (t.dkdv_block_m * 2 + 16)  # dS^T, padded rows
    dq_smem = (t.dq_block_m * (d + dv) + 2 * t.dq_block_n * (d + dv)) * 2
    ctx.update(dkdv_smem_bytes=dkdv_smem, dq_smem_bytes=dq_smem)  # static_asserted in the kernels

    def kp(name: str, warps: int, smem: int, args) -> KernelPlan:
        return KernelPlan(
            spec_name=spec.name,
            target=target,
            template="sm_80/bwd.cu.j2",
            kernel_name=name,
            tiles=TileConfig(16 * warps, 16, warps),
            smem_bytes=smem,
            args=tuple(args),
            context=ctx,
        )

    pre = kp(ctx["kernel_pre"], PRE_WARPS, 0, pre_args)
    dkdv = kp(ctx["kernel_dkdv"], t.dkdv_warps, dkdv_smem, dkdv_args)
    if atomic_dq:
        convert = kp(ctx["kernel_convert"], CONVERT_THREADS // 32, 0, convert_args)
        return BackwardPlan(spec.name, target, t, pre, dkdv, None, convert, atomic_dq=True)
    dq = kp(ctx["kernel_dq"], t.dq_warps, dq_smem, dq_args)
    return BackwardPlan(spec.name, target, t, pre, dkdv, dq)


#: Tiles of the Hopper backward (``templates/sm_90/bwd.cu.j2``, :func:`plan_hopper_backward`):
#: 128 keys per CTA (two consumer warpgroups of 64: wgmma M = 64), 64-query steps, 8 warps;
#: the deterministic-path fields (dq_*) are unused.  Registers per thread at head_dim 128:
#: dK and dV accumulators 2 x 64, S^T and dP^T 2 x 32 (dQ's 32 once those are dead).
HOPPER_BWD_TILES = BackwardTiles(128, 64, 8, 1, 64, 64, 4)
#: Tiles of the Hopper backward's split layout (head_dim 256, ``split_d`` in the template):
#: 64 keys per CTA, 64-query steps, 8 warps; warpgroup c owns head-dim columns
#: [128c, 128c + 128) of dK, dV and dQ and query columns [32c, 32c + 32) of S^T, dP^T (P^T and
#: dS^T meet in shared memory).  Registers per thread: dK and dV 2 x 64, dQ 64, S^T and dP^T
#: 2 x 16.  The plan is in the header of templates/sm_90/bwd.cu.j2.
HOPPER_BWD_TILES_SPLIT_D = BackwardTiles(64, 64, 8, 1, 64, 64, 4)
#: Head dims of the Hopper backward (head_dim == head_dim_v); those above 128 take
#: :data:`HOPPER_BWD_TILES_SPLIT_D`.
HOPPER_BWD_HEAD_DIMS = (64, 128, 256)
#: How the Hopper backward's dQ = dS K GEMM gets its A operand (dS, stored transposed in
#: shared memory): ``"smem"`` reads it there through an M-major (transposed) wgmma
#: descriptor; ``"ldmatrix"`` loads it into registers with ldmatrix.trans and runs the
#: register-A form (as P in the forward's P V).  Default "smem"; the environment variable
#: :data:`HOPPER_BWD_DQ_A_ENV` picks the other at plan time (an A/B switch while both are
#: validated on a GPU).
HOPPER_BWD_DQ_A = ("smem", "ldmatrix")
HOPPER_BWD_DQ_A_ENV = "FLASHGEN_HOPPER_BWD_DQ_A"


#: The Hopper backward's template (its dK/dV kernel on wgmma).
HOPPER_BWD_TEMPLATE = "sm_90/bwd.cu.j2"


def hopper_bwd_eligible(spec: Spec, target: str, family: str = "auto") -> bool:
    """Whether ``spec``'s non-deterministic backward on ``target`` runs the wgmma dK/dV
    kernel (:func:`plan_hopper_backward`): sm_90, ``family`` not ``"fa2"``, head_dim ==
    head_dim_v in :data:`HOPPER_BWD_HEAD_DIMS`, fp16/bf16, no varlen, and a mask that reads
    no tensor (no block table; causal, none, or an index-only mask walked with the tile
    classifier).  A score_mod is fine (its derivative comes from :mod:`flashgen.analysis.derive`).
    Everything else keeps the FA2-class kernels."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; known: {', '.join(FAMILIES)}")
    return (
        family != "fa2"
        and target == "sm_90"
        and spec.dtype in CTYPE
        and not spec.varlen
        and spec.head_dim == spec.head_dim_v
        and spec.head_dim in HOPPER_BWD_HEAD_DIMS
        and not needs_block_table(spec)
    )


def plan_hopper_backward(spec: Spec, target: str, *, dq_a: str | None = None) -> BackwardPlan:
    """The Hopper backward (``templates/sm_90/bwd.cu.j2``): an atomic-dQ :class:`BackwardPlan`
    whose dK/dV kernel runs its five GEMMs on wgmma (FlashAttention-3's backward, Shah et al.
    2024, without warp specialization), Q/dO/K/V by TMA.  ``pre`` and ``convert`` are the
    FA2-class path's (the same macros, templates/common/bwd_rowops.j2), rendered in this unit.

    The dkdv ABI is the atomic path's plus four ``CUtensorMap`` arguments (``tma_q``,
    ``tma_k``, ``tma_v``, ``tma_do``, built at launch from the named tensors).  head_dim
    256 takes the split layout (:data:`HOPPER_BWD_TILES_SPLIT_D`, context ``split_d``):
    64-key CTAs whose warpgroups split dK, dV, dQ by head-dim columns.  ``dq_a``:
    one of :data:`HOPPER_BWD_DQ_A` (default: ``$FLASHGEN_HOPPER_BWD_DQ_A``, else "smem").
    Raises ``ValueError`` unless :func:`hopper_bwd_eligible` (family "auto"), or for an
    unknown ``dq_a``.
    """
    dq_a = dq_a or os.environ.get(HOPPER_BWD_DQ_A_ENV) or "smem"
    if dq_a not in HOPPER_BWD_DQ_A:
        raise ValueError(
            f"dQ A operand {dq_a!r} (${HOPPER_BWD_DQ_A_ENV}): expected one of "
            f"{', '.join(HOPPER_BWD_DQ_A)}"
        )
    if not hopper_bwd_eligible(spec, target):
        raise ValueError(
            f"spec {spec.name!r} on {target}: the Hopper backward needs sm_90, head_dim == "
            f"head_dim_v in {list(HOPPER_BWD_HEAD_DIMS)}, no varlen, and a mask that reads no "
            "tensor"
        )
    d = spec.head_dim
    split_d = d > 128  # see HOPPER_BWD_TILES_SPLIT_D
    t = HOPPER_BWD_TILES_SPLIT_D if split_d else HOPPER_BWD_TILES
    atomic = plan_backward(spec, target, atomic_dq=True, tiles=t)  # ABI and shared context
    block_m, block_n, threads = t.dkdv_block_m, t.dkdv_block_n, 32 * t.dkdv_warps
    tma = (TmaArg("tma_q", "q", block_m), TmaArg("tma_k", "k", block_n),
           TmaArg("tma_v", "v", block_n), TmaArg("tma_do", "dout", block_m))  # fmt: skip
    dkdv_args = atomic.dkdv.args + tuple(KernelArg(m.name, "CUtensorMap") for m in tma)
    # 1 KiB alignment slack, K and V, two stages of Q and dO, dS^T (and P^T when split_d),
    # lse/dsum (2 stages), mbarriers
    smem = 1024 + 2 * block_n * d * 2 + 4 * block_m * d * 2
    smem += (2 if split_d else 1) * block_n * block_m * 2
    smem += 4 * block_m * 4 + 3 * 8
    base = f"flashgen_{spec.name}_bwd_{target}_wgmma"
    ctx = dict(atomic.dkdv.context)
    ctx.update(
        block_m=block_m,
        block_n=block_n,
        threads=threads,
        kernel_pre=f"{base}_pre",
        kernel_dkdv=f"{base}_dkdv",
        kernel_convert=f"{base}_convert",
        dkdv_args=dkdv_args,
        dkdv_smem_bytes=smem,
        mma_t=spec.dtype.replace("fp", "f"),
        wgmma_ns=sorted({block_m // 2, d // 2}) if split_d else sorted({block_m, d}),
        dq_ldmatrix=dq_a == "ldmatrix",
        split_d=split_d,
        dkv_n=d // 2 if split_d else d,  # N of the dV, dK (and dQ) wgmmas of one warpgroup
        tt_ns=[d // 2] if split_d else [64],  # N of the transposed-A dQ wgmma
        # CTA order: (batch, KV head) pairs in L2-sized groups (common/tile_order.cuh)
        bwd_tile_group=tile_group_expr(spec, backward=True),
    )

    def kp(name: str, warps: int, smem_bytes: int, args, tma_args=()) -> KernelPlan:
        return KernelPlan(
            spec_name=spec.name,
            target=target,
            template=HOPPER_BWD_TEMPLATE,
            kernel_name=name,
            tiles=TileConfig(16 * warps, 16, warps),
            smem_bytes=smem_bytes,
            args=tuple(args),
            context=ctx,
            tma=tma_args,
        )

    pre = kp(ctx["kernel_pre"], PRE_WARPS, 0, atomic.pre.args)
    dkdv = kp(ctx["kernel_dkdv"], t.dkdv_warps, smem, dkdv_args, tma)
    convert = kp(ctx["kernel_convert"], CONVERT_THREADS // 32, 0, atomic.convert.args)
    return BackwardPlan(spec.name, target, t, pre, dkdv, None, convert, atomic_dq=True)


def compile_units(spec: Spec, target: str) -> dict[str, KernelPlan]:
    """The translation units ``flashgen build`` compiles for ``spec`` on ``target``:
    ``{"fwd": forward plan, "bwd": deterministic backward unit, "bwd_atomic": atomic-dQ
    backward unit}`` (see :attr:`BackwardPlan.unit`), and where :func:`hopper_bwd_eligible`,
    ``"bwd_wgmma"``: the Hopper backward unit (:func:`plan_hopper_backward`), and where
    :func:`sparse_tiles` gives tiles, ``"fwd_sparse"``: the forward the op runs for calls
    whose mask keeps few keys per row."""
    fwd = plan_forward(spec, target, persistent=persistent_forward(spec))
    units = {
        "fwd": fwd,
        "bwd": plan_backward(spec, target).unit,
        "bwd_atomic": plan_backward(spec, target, atomic_dq=True).unit,
    }
    if hopper_bwd_eligible(spec, target):
        units["bwd_wgmma"] = plan_hopper_backward(spec, target).unit
    alt = sparse_tiles(spec, fwd.tiles)
    if alt is not None:
        units["fwd_sparse"] = plan_forward(spec, target, tiles=alt, persistent=sparse_persistent())
    return units


#: Forward tiles tried, in order, after the chosen ones spill (a user's score_mod or mask
#: can need more registers than the tables, measured on the shipped specs, leave free).
FORWARD_FALLBACK_TILES = (
    TileConfig(128, 32, 4),
    TileConfig(64, 64, 4),
    TileConfig(64, 32, 4),
    TileConfig(64, 16, 4),
)


def forward_tile_candidates(
    spec: Spec, target: str, gpu: str | None = None, family: str = "auto"
) -> list[TileConfig]:
    """Tiles to try for ``spec``'s forward kernel: the chosen ones, then (unless the spec
    fixes any of its ``tiles:``) :data:`FORWARD_FALLBACK_TILES`."""
    first = choose_tiles(spec, target, gpu, family)
    o = spec.tiles
    if o.block_m or o.block_n or o.num_warps:
        return [first]
    rest = list(FORWARD_FALLBACK_TILES)
    if is_hopper_tiles(first):  # a narrower Hopper step first, then the FA2-class kernel
        half = first.block_n // 2 // 16 * 16  # d256's 80 -> 32: 40 is no legal BLOCK_N
        narrower = [replace(first, block_n=half)] if half >= 16 else []
        rest = [*narrower, default_tiles(spec), *rest]
    return [first, *(t for t in dict.fromkeys(rest) if t != first)]


def _table_backward_tiles(spec: Spec, atomic_dq: bool) -> BackwardTiles:
    """The tables' backward tiles for ``spec``.  On the atomic path, an elementwise mask
    beyond causal at head_dim 128 takes 16-row inner steps in dkdv (same key block, so the
    same number of atomics): its registers are gone at 32 rows (prefix_lm spills 76 bytes
    on sm_90a there); a mask that reads tensors (document masking) splits the dK/dV
    columns over two CTAs instead (one CTA spills 8-40 bytes at any step width)."""
    table = ATOMIC_BACKWARD_TILES if atomic_dq else BACKWARD_TILES
    dmax = max(spec.head_dim, spec.head_dim_v)
    t = table.get((dmax, spec.score_mod is not None)) or table[(dmax, False)]
    if atomic_dq and dmax == 128 and split_causal(spec.mask)[1] is not None:
        t = replace(t, dkdv_block_m=min(t.dkdv_block_m, 16))
        if needs_block_table(spec):  # tensor reads in the mask: dK/dV columns over 2 CTAs
            t = replace(t, dkdv_block_n=64, dkdv_warps=4, dkdv_block_m=32, dkdv_dsplit=2)
    return t


def backward_tile_candidates(spec: Spec, *, atomic_dq: bool = False) -> list[BackwardTiles]:
    """Backward tiles to try: the table's, then the same with 16-row inner steps (the
    smallest score tiles), keeping the column split, then those narrow steps with the
    dK/dV columns split twice as many ways where the halves stay whole 16-column mma tiles
    (the dkdv kernel's accumulators halve: a head_dim 256 score_mod with a conditional mask
    spills 148 bytes in the atomic-dQ unit at dsplit 2, none at 4)."""
    first = _table_backward_tiles(spec, atomic_dq)
    out = [first, replace(first, dkdv_block_m=16, dq_block_n=16)]
    split = 2 * first.dkdv_dsplit
    if spec.head_dim % (16 * split) == 0 and spec.head_dim_v % (16 * split) == 0:
        out.append(replace(out[1], dkdv_dsplit=split))
    return list(dict.fromkeys(out))
