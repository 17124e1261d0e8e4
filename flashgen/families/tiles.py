"""Tile tables and tile choice, per kernel family, in one place: the measured tables
(:data:`DEFAULT_TILES`, :data:`HOPPER_TILES`, :data:`BACKWARD_TILES`, ...), the functions
that pick from them, and the candidates the spill fallback tries.  The tuning table
(:mod:`flashgen.tuning`) overrides the forward tables per GPU.  Sizes in bytes take the
element size from the dtype record (:mod:`flashgen.codegen.dtypes`).  Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, replace

from flashgen import tuning
from flashgen.codegen.abi import needs_block_table
from flashgen.codegen.cuda_expr import split_causal
from flashgen.codegen.dtypes import dtype
from flashgen.codegen.plan import TileConfig
from flashgen.frontend.ir import Spec

# ----------------------------------------------------------------------------- FA2-class forward
#: Default tile table for the FA2-class kernel: (head_dim, has score_mod) -> tiles (see
#: :func:`default_tiles`, which also consults :data:`MASK_TILES` and :data:`VARLEN_TILES`).
#: Picked from tile sweeps on a Hopper GPU (see docs/perf-notes.md); every entry
#: compiles with zero spills for the specs it serves.  A score_mod needs registers for its
#: math, so it halves BLOCK_N at head_dims 128 (alibi spills at 128x64) and 256.  To adopt
#: a winner of ``flashgen tune`` or ``flashgen ab``, edit its entry here (and, for template
#: switches, :data:`FORWARD_OPTIONS`).  ``flashgen tune`` measures per GPU, dtype and causal and
#: writes :mod:`flashgen.tuning`'s table, which :func:`choose_tiles` prefers when it has a key.
#: head_dim 32, 96, 160 and 192 (keyed, like every entry, by max(head_dim, head_dim_v)) are
#: not measured on a GPU yet: chosen by ptxas register counts (``flashgen build``), two
#: 16-row mma tiles per warp where they fit without spills (32, 96), else the D=256 shape.
#: A score_mod at 96 takes BLOCK_N 32 (ALiBi reaches 255 registers at 128x64).
#: d64 and d256 take FlashAttention-2's own tiles (128x128x4; 128x64x8 with lazy rescaling):
#: in the candidate sweep they beat the tiles they replaced at both head dims (the wider key
#: step halves the per-step overhead at d64; see docs/perf-notes.md).
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
#: 128x64x8) become the plain entries: at 128x128x4
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


def fa2_tiles(spec: Spec, target: str, gpu: str | None = None) -> TileConfig:
    """Tile config of ``spec``'s FA2-class forward on ``target``: the spec's ``tiles:`` fields,
    then the tuning-table entry measured on ``gpu`` (the CUDA device name, e.g. ``"NVIDIA
    H200"``; see :mod:`flashgen.tuning`, written by ``flashgen tune``; a Hopper kernel's entry
    does not apply), then :func:`default_tiles`.  Without a GPU name (offline builds,
    ``generated/``) the table is not consulted."""
    tuned = _tuned(spec, target, gpu)
    if tuned is not None and tuned.warp_specialized:
        tuned = None  # a Hopper kernel's entry, and this is the FA2-class kernel
    base = tuned if tuned is not None else default_tiles(spec)
    o = spec.tiles
    return TileConfig(
        o.block_m or base.block_m, o.block_n or base.block_n, o.num_warps or base.num_warps
    )


def hopper_fwd_tiles(spec: Spec, target: str, gpu: str | None = None) -> TileConfig:
    """Tile config of ``spec``'s Hopper forward: the tuning-table entry for ``gpu`` where it is
    a warp-specialized one, else :func:`hopper_tiles`."""
    tuned = _tuned(spec, target, gpu)
    if tuned is not None and tuned.warp_specialized:
        return tuned
    return hopper_tiles(spec)


def _tuned(spec: Spec, target: str, gpu: str | None) -> TileConfig | None:
    """The tuning table's tiles for ``spec`` on ``gpu`` (an override of the tables here)."""
    d = max(spec.head_dim, spec.head_dim_v)
    has_mod = spec.score_mod is not None
    tuned = tuning.lookup(gpu, target, d, spec.dtype, split_causal(spec.mask)[0], has_mod)
    return TileConfig(*tuned) if tuned is not None else None


def table_options(spec: Spec, target: str, gpu: str | None, tiles: TileConfig) -> dict[str, bool]:
    """The FA2-class template switches the tuning table recorded with its entry's tiles
    (``options``; see :mod:`flashgen.tuning`) when ``tiles`` are those tiles: none when the
    spec pins tiles or the tiles are the Hopper kernel's."""
    o = spec.tiles
    if not gpu or tiles.warp_specialized or o.block_m or o.block_n or o.num_warps:
        return {}
    key = (gpu, target, max(spec.head_dim, spec.head_dim_v), spec.dtype)
    key += (split_causal(spec.mask)[0], spec.score_mod is not None)
    tuned = tuning.lookup(*key)
    if tuned is None or TileConfig(*tuned) != tiles:
        return {}
    return tuning.lookup_options(*key)


# ----------------------------------------------------------------------------- Hopper forward
#: Picked from a Hopper tile sweep (docs/perf-notes.md): wider steps amortize each step's
#: barrier waits and row reductions.
#: A score_mod's math needs registers too: at head_dim 64 it gets 96-wide steps (192 spilled
#: for a bias-table score_mod while its reads were clamped 64-bit offsets; with the reads of
#: :func:`_tensor_read` t5_bias compiles without spills at 96, 128, 160 and 192: to be timed
#: with ``flashgen ab``).  Keyed like DEFAULT_TILES: (head_dim, has score_mod);
#: a key without a ``True`` entry uses the plain one.
HOPPER_TILES: dict[tuple[int, bool], TileConfig] = {
    (64, False): TileConfig(128, 192, 12),
    (128, False): TileConfig(128, 160, 12),
    (256, False): TileConfig(128, 80, 12),
    (64, True): TileConfig(128, 96, 12),
}
#: Head dims the Hopper kernel supports (head_dim == head_dim_v).
HOPPER_HEAD_DIMS = tuple(sorted({d for d, _ in HOPPER_TILES}))
#: Tiles of the fp8 (e4m3) Hopper forward by head_dim: a row of the transposed V tile
#: (``templates/common/fp8.cuh``) is one swizzle span, 128 or 64 keys.  128 keys per step up
#: to head_dim 128 (FlashAttention-3's FP8 forward steps 128-224 there); 64 at 256, where the
#: 64 x 256 O accumulator leaves no registers for 128 (144 bytes spilled; FlashAttention-3
#: steps 80).
HOPPER_FP8_TILES: dict[int, TileConfig] = {
    64: TileConfig(128, 128, 12),
    128: TileConfig(128, 128, 12),
    256: TileConfig(128, 64, 12),
}
#: Hopper tiles of a spec whose mask reads tensors (a block table: document masking), by
#: head_dim, where they differ from :data:`HOPPER_TILES`.  Short documents make many short
#: rows of PARTIAL tiles, and a narrower step wastes fewer masked columns: document_mask at
#: the gallery's shape (documents much shorter than the sequence) ran faster at 128 x 128
#: than at 128 x 160, while prefix_lm, chunked_local and mistral_swa were as fast or faster
#: at 160 (docs/perf-notes.md).
HOPPER_TABLE_TILES: dict[int, TileConfig] = {128: TileConfig(128, 128, 12)}


#: The Hopper forward's tiles for a call whose mask keeps few keys per query row, per head_dim:
#: narrower key blocks waste less of the tiles at a window's or a chunk's edges and leave fewer
#: of them.  With few live key blocks per query block (short windows and chunks, causal at
#: short lengths) 128 x 128 is the faster step; with many (long windows, causal at long
#: lengths) 128 x 160 is, hence the per-call rule below (docs/perf-notes.md).
HOPPER_SPARSE_TILES: dict[int, TileConfig] = {128: TileConfig(128, 128, 12)}
#: A call whose mask keeps fewer keys per query row than this on average (16 key blocks of
#: 160; :mod:`flashgen.ops.prefill.density`) runs :data:`HOPPER_SPARSE_TILES`
#: (:func:`sparse_tiles`).
SPARSE_KEYS_PER_ROW = 2560


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
    if not tiles.warp_specialized or alt is None or alt == tiles:
        return None
    return alt



def hopper_tiles(spec: Spec) -> TileConfig:
    """The :data:`HOPPER_TILES` entry for ``spec`` (head_dim, with or without score_mod),
    or its :data:`HOPPER_TABLE_TILES` entry if its mask reads tensors and it has one."""
    d = spec.head_dim
    if dtype(spec.dtype).elem_bytes == 1:
        return HOPPER_FP8_TILES[d]
    if d in HOPPER_TABLE_TILES and spec.score_mod is None and needs_block_table(spec):
        return HOPPER_TABLE_TILES[d]
    return HOPPER_TILES.get((d, spec.score_mod is not None)) or HOPPER_TILES[(d, False)]



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


FORWARD_FALLBACK_TILES = (
    TileConfig(128, 32, 4),
    TileConfig(64, 64, 4),
    TileConfig(64, 32, 4),
    TileConfig(64, 16, 4),
)


def forward_tile_candidates(spec: Spec, first: TileConfig) -> list[TileConfig]:
    """Tiles to try for ``spec``'s forward kernel: ``first`` (the chosen ones), then (unless
    the spec fixes any of its ``tiles:``) :data:`FORWARD_FALLBACK_TILES`; after Hopper tiles,
    a narrower Hopper step and then the FA2-class kernel's :func:`default_tiles` first."""
    o = spec.tiles
    if o.block_m or o.block_n or o.num_warps or dtype(spec.dtype).elem_bytes == 1:
        return [first]  # (fp8: the Hopper kernel at its one tile shape, or nothing)
    rest = list(FORWARD_FALLBACK_TILES)
    if first.warp_specialized:  # a narrower Hopper step first, then the FA2-class kernel
        half = first.block_n // 2 // 16 * 16  # d256's 80 -> 32: 40 is no legal BLOCK_N
        narrower = [replace(first, block_n=half)] if half >= 16 else []
        rest = [*narrower, default_tiles(spec), *rest]
    return [first, *(t for t in dict.fromkeys(rest) if t != first)]


def table_backward_tiles(spec: Spec, atomic_dq: bool, dparam: bool = False) -> BackwardTiles:
    """The tables' backward tiles for ``spec``.  On the atomic path, an elementwise mask
    beyond causal at head_dim 128 takes 16-row inner steps in dkdv (same key block, so the
    same number of atomics): its registers are gone at 32 rows (prefix_lm spills 76 bytes
    on sm_90a there); a mask that reads tensors (document masking) splits the dK/dV
    columns over two CTAs instead (one CTA spills 8-40 bytes at any step width).
    ``dparam`` (the unit accumulates param gradients, templates/common/dparam.j2): the
    atomic dK/dV kernel takes at most :data:`DPARAM_ATOMIC_BLOCK_M`-row steps (at 64 rows,
    head_dim 64, alibi_learned and t5_bias spill 40-96 bytes)."""
    table = ATOMIC_BACKWARD_TILES if atomic_dq else BACKWARD_TILES
    dmax = max(spec.head_dim, spec.head_dim_v)
    t = table.get((dmax, spec.score_mod is not None)) or table[(dmax, False)]
    if dparam and atomic_dq:
        t = replace(t, dkdv_block_m=min(t.dkdv_block_m, DPARAM_ATOMIC_BLOCK_M))
    if atomic_dq and dmax == 128 and split_causal(spec.mask)[1] is not None:
        t = replace(t, dkdv_block_m=min(t.dkdv_block_m, 16))
        if needs_block_table(spec):  # tensor reads in the mask: dK/dV columns over 2 CTAs
            t = replace(t, dkdv_block_n=64, dkdv_warps=4, dkdv_block_m=32, dkdv_dsplit=2)
    return t


#: Query rows per step of the atomic dK/dV kernel of a unit that accumulates param gradients.
DPARAM_ATOMIC_BLOCK_M = 32


def backward_tile_candidates(
    spec: Spec, *, atomic_dq: bool = False, dparam: bool = False
) -> list[BackwardTiles]:
    """Backward tiles to try: the table's, then the same with 16-row inner steps (the
    smallest score tiles), keeping the column split, then those narrow steps with the
    dK/dV columns split twice as many ways where the halves stay whole 16-column mma tiles
    (the dkdv kernel's accumulators halve: a head_dim 256 score_mod with a conditional mask
    spills 148 bytes in the atomic-dQ unit at dsplit 2, none at 4)."""
    first = table_backward_tiles(spec, atomic_dq, dparam)
    out = [first, replace(first, dkdv_block_m=16, dq_block_n=16)]
    split = 2 * first.dkdv_dsplit
    if spec.head_dim % (16 * split) == 0 and spec.head_dim_v % (16 * split) == 0:
        out.append(replace(out[1], dkdv_dsplit=split))
    return list(dict.fromkeys(out))
