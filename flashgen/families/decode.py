"""The decode family: FlashDecoding split-KV attention over a dense or paged KV cache, with
GQA packing (no torch, no CuPy: planning only).

One compile unit per (spec, target) holds three kernels (``templates/sm_80/decode.cu.j2``):

* ``<kernel>_attn``: grid (query row blocks x splits, kv heads, batch).  A CTA's query rows
  are the ``Hq / Hkv`` query heads of one kv head times the ``Sq_new`` new queries, packed
  ``row = s * group + g`` (FlashAttention-3's pack_gqa), 16 rows per CTA (one mma.sync
  m16n8k16 row tile); each warp takes a quarter of every key block's columns, so one
  ``BLOCK_N``-key block of K and V is read once per kv head group, through a ``stages``-deep
  cp.async ring.  The key blocks a split reads are its share of the request's live blocks
  (:func:`split_range`, also ``fg::dec::split_range`` on the device); blocks the mask's
  interval classifier (:mod:`flashgen.analysis.masktiles`) proves EMPTY are skipped unread.
  With one split the kernel writes ``o`` / ``lse``, else fp32 partial ``o`` and ``lse`` to a
  workspace.
* ``<kernel>_combine``: the exact LSE merge of the splits (FlashAttention's
  flash_fwd_combine: ``lse = m + log(sum exp(lse_i - m))``, ``o = sum exp(lse_i - lse) o_i``,
  in a fixed order: bitwise reproducible for a fixed ``num_splits``).
* ``<kernel>_append``: writes ``k_new`` / ``v_new`` into the cache at ``cache_seqlens[b]``
  through the block table (rows past the request's pages are dropped).

Semantics (as the padded op on the gathered cache): request ``b`` has ``L = cache_seqlens[b]
(+ Sq_new with k_new)`` live keys; the spec's mask and score_mod see ``q_idx`` in
``[0, Sq_new)``, ``kv_idx`` in ``[0, L)``, ``seqlen_q = Sq_new``, ``seqlen_k = L``, so a query's
absolute position is ``q_idx + seqlen_k - seqlen_q`` (bottom-right, as the prefill's causal).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from flashgen.analysis import masktiles
from flashgen.codegen.abi import KernelArg
from flashgen.codegen.cuda_expr import Invariants, cuda_expr, split_causal
from flashgen.codegen.dtypes import CTYPE, dtype
from flashgen.codegen.plan import KernelPlan, TemplateContext
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
#: Threads of the combine kernel's CTA.
COMBINE_THREADS = 128
#: Threads of the append kernel's CTA (one new row of K and V per CTA).
APPEND_THREADS = 32
#: FlashAttention-3's cap on the number of splits.
MAX_SPLITS = 128
#: Shared memory a CTA may use on each target (sm_80: A100's 163 KiB; the kernel is
#: planned against it on both targets, so one plan fits both).
SMEM_LIMIT = {"sm_80": 166912, "sm_90": 166912}
TARGETS = ("sm_80", "sm_90")


@dataclass(frozen=True)
class Options:
    """Typed knobs of the decode family (all optional; defaults by head dim).

    ``block_n``: keys per pipeline stage (a multiple of ``16 * NUM_WARPS``); ``stages``:
    depth of the cp.async ring (2..4); ``num_splits``: a fixed split count (1..128), or
    None for :func:`num_splits_heuristic` per call; ``pack_gqa``: pack the query heads of a
    kv head into one CTA's rows (False: one query head per CTA, each K/V block read once per
    query head; kept to measure what packing buys)."""

    block_n: int | None = None
    stages: int | None = None
    num_splits: int | None = None
    pack_gqa: bool = True

    def __post_init__(self) -> None:
        if self.block_n is not None and (self.block_n <= 0 or self.block_n % (16 * NUM_WARPS)):
            raise ValueError(f"block_n must be a positive multiple of {16 * NUM_WARPS}")
        if self.stages is not None and not 2 <= self.stages <= 4:
            raise ValueError("stages must be 2, 3 or 4")
        if self.num_splits is not None and not 1 <= self.num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}]")
        if not isinstance(self.pack_gqa, bool):
            raise ValueError("pack_gqa must be a bool")


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
    """What ``templates/sm_80/decode.cu.j2`` reads (one unit: attention, combine, append
    kernels).  ``args`` / ``append_args`` / ``combine_args``: each kernel's
    :class:`~flashgen.codegen.abi.KernelArg` tuple; ``mask_expr`` / ``score_mod_expr``: the
    spec's DSL as CUDA (None without), ``prologue`` their hoisted invariants;
    ``tile_classifier``: the mask's interval classifier source."""

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
    args: tuple
    append_args: tuple
    combine_args: tuple


@dataclass(frozen=True)
class DecodePlan(KernelPlan):
    """Everything needed to render, compile and launch one decode unit: a
    :class:`flashgen.codegen.plan.KernelPlan` (so :mod:`flashgen.build` and
    :mod:`flashgen.runtime.launch` take it) whose ``context`` is a dict and whose
    ``kernel_name`` is the attention kernel; :meth:`kernel` gives the plan of each of the
    unit's kernels (``attn``, ``combine``, ``append``, its ``role``) to load from the same
    cubin."""

    role: str = "attn"

    @property
    def base_name(self) -> str:
        return self.context["base_name"]

    def kernel(self, role: str) -> DecodePlan:
        """The plan of kernel ``role`` (``attn``, ``combine``, ``append``) of this unit: same
        source and cubin, its own symbol, threads, dynamic shared memory and arguments."""
        if role == "attn":
            return self
        if role == "combine":
            tiles = DecodeTiles(1, 1, COMBINE_THREADS // 32, 1)
            return replace(
                self, kernel_name=f"{self.base_name}_combine", tiles=tiles, smem_bytes=0,
                args=combine_args(self.context["elem_t"]), role=role,
            )  # fmt: skip
        if role == "append":
            tiles = DecodeTiles(1, 1, APPEND_THREADS // 32, 1)
            return replace(
                self, kernel_name=f"{self.base_name}_append", tiles=tiles, smem_bytes=0,
                args=append_args(self.context["elem_t"]), role=role,
            )  # fmt: skip
        raise ValueError(f"unknown decode kernel role {role!r}")

    def config(self) -> dict:
        """JSON-able summary for manifests and ``flashgen show``."""
        return {
            **self.base_config(),
            "stages": self.tiles.stages,
            "pack_gqa": self.context["pack_gqa"],
        }


# ----------------------------------------------------------------------------- support
def unsupported_reason(spec: Spec) -> str | None:
    """Why ``spec`` has no decode kernels, or None: a mask that reads tensor params (its
    tiles need a block table per padded problem), a tensor param shaped by ``seqlen_q`` /
    ``seqlen_k`` (each request has its own length), a dtype other than fp16 / bf16, or a
    varlen spec (decode takes the padded spec's op)."""
    if spec.varlen:
        return f"spec {spec.name!r} is a varlen spec; call with_kvcache on the padded spec's op"
    if spec.dtype not in ("fp16", "bf16"):
        return f"decode supports fp16 and bf16, spec {spec.name!r} has dtype {spec.dtype}"
    if spec.mask is not None and any(isinstance(n, ir.Index) for n in ir.walk(spec.mask)):
        return (
            f"spec {spec.name!r}: its mask reads tensor params, which decode does not support "
            "(use the prefill op on the gathered cache)"
        )
    for p in spec.tensor_params:
        if any(d in ("seqlen_q", "seqlen_k") for d in p.shape):
            return (
                f"spec {spec.name!r}: tensor param {p.name!r} is shaped by seqlen_q/seqlen_k, "
                "but each decode request has its own length"
            )
    return None


def default_tiles(spec: Spec, options: Options | None = None) -> DecodeTiles:
    """Block and ring depth by head dim: 64 keys per block up to d256 (16 per warp, one
    m16n8k16 K step of P V), 128 at d <= 64; three stages where they fit sm_80's shared
    memory, else two; ``options`` override."""
    o = options or Options()
    d = max(spec.head_dim, spec.head_dim_v)
    block_n = o.block_n or (128 if d <= 64 else 64)
    stages = o.stages
    if stages is None:
        stages = 3
        while stages > 2 and smem_bytes(spec, block_n, stages) > SMEM_LIMIT["sm_80"]:
            stages -= 1
    return DecodeTiles(BLOCK_M, block_n, NUM_WARPS * dv_split(spec), stages)


def dv_split(spec: Spec) -> int:
    """Warps along the output's columns: 2 for Dv >= :data:`DV_SPLIT_FROM`, else 1."""
    return 2 if spec.head_dim_v >= DV_SPLIT_FROM else 1


def smem_bytes(spec: Spec, block_n: int, stages: int) -> int:
    """Dynamic shared memory of the attention kernel: the Q tile, ``stages`` K and V blocks
    and their per-row validity bytes, and the warps' merge area (which reuses the ring)."""
    d, dv = spec.head_dim, spec.head_dim_v
    elem = dtype(spec.dtype).elem_bytes
    q = BLOCK_M * d * elem
    ring = stages * block_n * (d + dv) * elem
    merge = NUM_WARPS * BLOCK_M * dv * 4 + 2 * NUM_WARPS * BLOCK_M * 4
    return q + max(ring, merge) + stages * block_n


# ----------------------------------------------------------------------------- heuristic
def num_splits_heuristic(
    total_ctas: int, num_sms: int, num_n_blocks: int, max_splits: int = MAX_SPLITS
) -> int:
    """Splits of each request's key blocks (FlashAttention-3's ``num_splits_heuristic``,
    hopper/heuristics.h, rewritten): none when ``total_ctas`` (CTAs without splitting)
    already fill 80% of a wave of ``num_sms``; else the smallest split count whose wave
    efficiency is within 85% of the best, over the counts that leave each split at least
    a few blocks (counts giving the same blocks per split as a smaller one are skipped).

    ``num_n_blocks``: key blocks of the longest request.  Returns an int in ``[1,
    min(max_splits, num_sms, num_n_blocks)]``.  Pure: a host function with no device
    state, tested in tests/unit/test_decode.py."""
    if total_ctas <= 0 or num_n_blocks <= 1 or num_sms <= 0:
        return 1
    if total_ctas >= 0.8 * num_sms:
        return 1
    # at least 4 blocks per split where there are enough blocks (FA3 keeps splits long
    # enough to amortize the combine)
    cap = min(max_splits, num_sms, max(1, num_n_blocks // 4) if num_n_blocks >= 8 else 2)
    cap = max(1, min(cap, num_n_blocks))

    def ceildiv(a: int, b: int) -> int:
        return (a + b - 1) // b

    def eligible(s: int) -> bool:
        return s == 1 or ceildiv(num_n_blocks, s) != ceildiv(num_n_blocks, s - 1)

    eff = []
    for s in range(1, cap + 1):
        if not eligible(s):
            eff.append(0.0)
            continue
        waves = total_ctas * s / num_sms
        eff.append(waves / math_ceil(waves))
    best = max(eff)
    for s in range(1, cap + 1):
        if eligible(s) and eff[s - 1] >= 0.85 * best:
            return s
    return 1


def math_ceil(x: float) -> int:
    i = int(x)
    return i if i == x else i + 1


def split_range(n_lo: int, n_hi: int, num_splits: int, split: int) -> tuple[int, int]:
    """Key blocks ``[begin, end)`` of split ``split`` of the live blocks ``[n_lo, n_hi)``:
    ``ceil(count / num_splits)`` per split in order (trailing splits may be empty).  The
    same arithmetic as ``fg::dec::split_range`` (templates/common/decode.cuh)."""
    cnt = max(n_hi - n_lo, 0)
    per = (cnt + num_splits - 1) // num_splits
    begin = min(n_lo + split * per, max(n_hi, n_lo))
    end = min(begin + per, max(n_hi, n_lo))
    return begin, end


# ----------------------------------------------------------------------------- kernel ABI
def _ctype(spec: Spec) -> str:
    return CTYPE[spec.dtype]


def attn_args(spec: Spec) -> tuple:
    """The attention kernel's arguments (:class:`flashgen.codegen.abi.KernelArg`), in order."""
    t = _ctype(spec)
    a = [
        KernelArg("q", f"const {t}*"),
        KernelArg("k_cache", f"const {t}*"),
        KernelArg("v_cache", f"const {t}*"),
        KernelArg("o", f"{t}*"),
        KernelArg("lse", "float*"),
        KernelArg("o_part", "float*"),
        KernelArg("lse_part", "float*"),
        KernelArg("cache_seqlens", "const int*"),
        KernelArg("block_table", "const int*"),
    ]
    for n in ("q_sb", "q_sh", "q_ss", "k_sp", "k_ss", "k_sh", "v_sp", "v_ss", "v_sh", "bt_sb"):
        a.append(KernelArg(n, "int64_t"))
    for n in ("max_pages", "num_pages", "page_size", "batch", "heads_q", "heads_kv"):
        a.append(KernelArg(n, "int"))
    for n in ("seqlen_q", "num_splits", "new_keys", "group"):
        a.append(KernelArg(n, "int"))
    a.append(KernelArg("softmax_scale", "float"))
    for p in spec.scalar_params:
        a.append(KernelArg(f"p_{p.name}", "int" if p.ty == Ty.I32 else "float"))
    for p in spec.tensor_params:
        a.append(KernelArg(f"t_{p.name}", "const int*" if p.ty == Ty.I32 else "const float*"))
    return tuple(a)


def combine_args(elem_t: str) -> tuple:
    """The combine kernel's arguments: partials ``[num_splits, rows, Dv]`` / ``[num_splits,
    rows]`` fp32 -> ``o [rows, Dv]`` (elem_t), ``lse [rows]``."""
    return (
        KernelArg("o_part", "const float*"),
        KernelArg("lse_part", "const float*"),
        KernelArg("o", f"{elem_t}*"),
        KernelArg("lse", "float*"),
        KernelArg("rows", "int"),
        KernelArg("num_splits", "int"),
    )


def append_args(elem_t: str) -> tuple:
    """The append kernel's arguments: ``k_new``/``v_new`` ``[B, Hkv, Sq_new, D]`` (strides)
    into the cache (the attention kernel's layout arguments)."""
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
    for n in ("max_pages", "num_pages", "page_size", "heads_kv", "seqlen_q"):
        a.append(KernelArg(n, "int"))
    return tuple(a)


# ----------------------------------------------------------------------------- plan
def plan(
    spec: Spec, target: str, options: Options | None = None, *, options_key: str = ""
) -> DecodePlan:
    """Lower ``spec`` to its decode unit for ``target`` (``sm_80``: mma.sync, also what
    ``sm_90`` compiles for sm_90a); ``options_key`` (the registry's
    :meth:`flashgen.options.Options.family_key`) goes into the plan's cache key.  Raises
    ``ValueError`` for a spec decode does not support (:func:`unsupported_reason`), an
    unknown target or tiles that do not fit."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; supported: {', '.join(TARGETS)}")
    why = unsupported_reason(spec)
    if why is not None:
        raise ValueError(why)
    options = options or Options()
    tiles = default_tiles(spec, options)
    smem = smem_bytes(spec, tiles.block_n, tiles.stages)
    if smem > SMEM_LIMIT[target]:
        raise ValueError(
            f"decode tiles block_n={tiles.block_n} x {tiles.stages} stages need {smem} B of "
            f"shared memory at head_dim {spec.head_dim}/{spec.head_dim_v} (limit "
            f"{SMEM_LIMIT[target]}): pick a smaller block_n or fewer stages"
        )
    causal, residual = split_causal(spec.mask)
    inv = Invariants(raw_score="score_raw")
    mask_expr = cuda_expr(residual, spec, inv) if residual is not None else None
    score_mod_expr = cuda_expr(spec.score_mod, spec, inv) if spec.score_mod is not None else None
    reads_h = spec.mask is not None and any(
        isinstance(n, ir.Var) and n.name == "h" for n in ir.walk(spec.mask)
    )
    base = f"flashgen_{spec.name}_decode_{target}"
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
        args=attn_args(spec),
        append_args=append_args(CTYPE[spec.dtype]),
        combine_args=combine_args(CTYPE[spec.dtype]),
    )
    return DecodePlan(
        spec_name=spec.name,
        target=target,
        template="sm_80/decode.cu.j2",
        kernel_name=ctx.kernel_name,
        tiles=tiles,
        smem_bytes=smem,
        args=ctx.args,
        context=ctx,
        options_key=options_key,
    )


@dataclass(frozen=True)
class Geometry:
    """Launch geometry of one decode call (host values only)."""

    group: int  # query heads per CTA row group: Hq / Hkv packed, 1 unpacked
    rows: int  # packed query rows per kv head (group * Sq_new)
    m_blocks: int  # CTAs along the rows
    num_splits: int
    grid: tuple[int, int, int]  # (m_blocks * num_splits, kv heads (or Hq unpacked), batch)
    combine_grid: tuple[int, int, int]
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
    m_blocks = (rows + BLOCK_M - 1) // BLOCK_M
    out_rows = batch * heads_q * seqlen_q
    rpc = COMBINE_THREADS // (p.context["head_dim_v"] // 4)
    return Geometry(
        group=group,
        rows=rows,
        m_blocks=m_blocks,
        num_splits=num_splits,
        grid=(m_blocks * num_splits, heads, batch),
        combine_grid=((out_rows + rpc - 1) // rpc, 1, 1),
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
) -> int:
    """:func:`num_splits_heuristic` for a call: ``batch * heads_kv_ctas * m_blocks`` CTAs
    without splitting, the key blocks of ``max_seqlen_k`` keys (the cache's capacity: the
    host never reads the lengths), a wave of ``num_sms`` times :func:`ctas_per_sm` CTAs."""
    n_blocks = (max_seqlen_k + p.tiles.block_n - 1) // p.tiles.block_n
    wave = num_sms * ctas_per_sm(p)
    return num_splits_heuristic(batch * heads_kv_ctas * m_blocks, wave, n_blocks)


#: Shared memory per SM (bytes a CTA may take, summed): A100 164 KiB, H100/H200 228 KiB.
SM_SMEM = {"sm_80": 167936, "sm_90": 233472}


def ctas_per_sm(p: DecodePlan) -> int:
    """Attention CTAs resident per SM by shared memory (1 KiB reserved per CTA), 1 to 4."""
    return max(1, min(4, SM_SMEM[p.target] // (p.smem_bytes + 1024)))
