"""The Hopper backward (``templates/sm_90/bwd.cu.j2``): the atomic-dQ scheme with a dK/dV
kernel on wgmma and TMA.  :func:`plan` lowers a spec; :class:`Options` holds its knobs."""

from __future__ import annotations

from dataclasses import dataclass

from flashgen.codegen.abi import KernelArg, TmaArg, needs_block_table
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
from flashgen.families.common import FAMILIES, MMA16_DTYPES, tile_group_expr
from flashgen.families.tiles import HOPPER_BWD_HEAD_DIMS, HOPPER_BWD_TILES, HOPPER_BWD_TILES_SPLIT_D
from flashgen.frontend.ir import Spec

#: The template this family renders.
TEMPLATE = HOPPER_BWD_TEMPLATE
#: How the dQ = dS K GEMM gets its A operand (dS, stored transposed in shared memory):
#: ``"smem"`` reads it there through an M-major (transposed) wgmma descriptor; ``"ldmatrix"``
#: loads it into registers with ldmatrix.trans and runs the register-A form (as P in the
#: forward's P V).  Default "smem" (:attr:`Options.dq_a`).
HOPPER_BWD_DQ_A = ("smem", "ldmatrix")
#: How the dK/dV kernel's warps share the work (:attr:`Options.schedule`): ``"inline"``, two
#: warpgroups that all compute, thread 0 issuing the TMA loads between steps and every thread
#: adding its dQ into ``dq_accum`` with vector reductions; ``"ws"``, warp-specialized as
#: FlashAttention-3's backward: a producer warpgroup (its registers given to the consumers with
#: ``setmaxnreg``) whose first warp loads Q, dO, lse and dsum into a :data:`WS_STAGES`-deep
#: mbarrier pipeline and whose second warp adds each step's dQ tile, staged in shared memory by
#: the consumers, into ``dq_accum`` with TMA reductions (``cp.reduce.async.bulk.tensor``;
#: head dims 64 and 128: at 256 the staging tiles do not fit and the consumers add their dQ
#: with vector reductions, as ``"inline"``).
HOPPER_BWD_SCHEDULES = ("inline", "ws")
#: Stages of the ``"ws"`` schedule's Q / dO / lse / dsum pipeline.
WS_STAGES = 2
#: Registers per thread of the ``"ws"`` schedule's producer and consumer warpgroups
#: (``setmaxnreg``; 32 x 128 + 240 x 256 = 65536, what ``__launch_bounds__(384, 1)`` gives the CTA).
WS_PRODUCER_REGS = 24
WS_CONSUMER_REGS = 240


@dataclass(frozen=True)
class Options:
    """Knobs of the Hopper backward: ``dq_a`` (:data:`HOPPER_BWD_DQ_A`), ``head_groups``
    (the CTAs take (batch, KV head) pairs in L2 head groups; False: in order) and
    ``schedule`` (:data:`HOPPER_BWD_SCHEDULES`; ``"ws"`` takes ``dq_a="smem"`` only)."""

    dq_a: str = "smem"
    head_groups: bool = True
    schedule: str = "inline"


@dataclass(frozen=True)
class Context(BackwardContext):
    """The template context of the Hopper backward unit."""

    block_m: int
    block_n: int
    threads: int
    mma_t: str
    wgmma_ns: list
    dq_ldmatrix: bool
    split_d: bool
    dkv_n: int
    tt_ns: list
    bwd_tile_group: str
    ws: bool
    stages: int
    producer_regs: int
    consumer_regs: int


def dkdv_smem_bytes(d: int, elt: int, block_m: int, block_n: int, split_d: bool, ws: bool) -> int:
    """Dynamic shared memory of the dK/dV kernel (the template's layout, which checks it):
    1 KiB alignment slack, K and V, two stages of Q and dO, dS^T (two buffers under
    ``ws`` outside ``split_d``; P^T beside it when ``split_d``), ``ws``'s dQ staging tiles
    (two warpgroups x 64 rows x 64 fp32) outside ``split_d``, lse and dsum (two stages,
    fp32), the mbarriers (K/V full; per stage full, and empty under ``ws``)."""
    stages = WS_STAGES if ws else 2
    smem = 1024 + 2 * block_n * d * elt + 2 * stages * block_m * d * elt
    smem += (2 if split_d or ws else 1) * block_n * block_m * elt
    if ws and not split_d:
        smem += 2 * 64 * 64 * 4
    smem += 2 * stages * block_m * 4 + 8 * (1 + stages * (2 if ws else 1))
    return smem


def eligible(spec: Spec, target: str, family: str = "auto") -> bool:
    """Whether ``spec``'s non-deterministic backward on ``target`` runs the wgmma dK/dV
    kernel (:func:`plan`): sm_90, ``family`` not ``"fa2"``, head_dim ==
    head_dim_v in :data:`HOPPER_BWD_HEAD_DIMS`, fp16/bf16, no varlen, and a mask that reads
    no tensor (no block table; causal, none, or an index-only mask walked with the tile
    classifier).  A score_mod is fine (its derivative comes from :mod:`flashgen.analysis.derive`).
    Everything else keeps the FA2-class kernels."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; known: {', '.join(FAMILIES)}")
    return (
        family != "fa2"
        and target == "sm_90"
        and spec.dtype in MMA16_DTYPES
        and not spec.varlen
        and spec.head_dim == spec.head_dim_v
        and spec.head_dim in HOPPER_BWD_HEAD_DIMS
        and not needs_block_table(spec)
    )


def plan(
    spec: Spec,
    target: str,
    options: Options = Options(),
    *,
    causal_bits: bool = False,
    options_key: str = "",
) -> BackwardPlan:
    """The Hopper backward (``templates/sm_90/bwd.cu.j2``): an atomic-dQ :class:`BackwardPlan`
    whose dK/dV kernel runs its five GEMMs on wgmma (FlashAttention-3's backward, Shah et al.
    2024, without warp specialization), Q/dO/K/V by TMA.  ``pre`` and ``convert`` are the
    FA2-class path's (the same macros, templates/common/bwd_rowops.j2, and the same ABI,
    :func:`~flashgen.families.bwd_common.backward_abi`), rendered in this unit.

    The dkdv ABI is the atomic path's plus four ``CUtensorMap`` arguments (``tma_q``,
    ``tma_k``, ``tma_v``, ``tma_do``, built at launch from the named tensors).  head_dim
    256 takes the split layout (:data:`~flashgen.families.tiles.HOPPER_BWD_TILES_SPLIT_D`,
    context ``split_d``): 64-key CTAs whose warpgroups split dK, dV, dQ by head-dim columns.
    ``options.dq_a``: one of :data:`HOPPER_BWD_DQ_A`.  ``causal_bits``: see
    :func:`~flashgen.families.bwd_common.tile_classifier`.  Raises ``ValueError`` unless
    :func:`eligible` (family "auto"), or for an unknown ``dq_a``.
    """
    dq_a = options.dq_a
    if dq_a not in HOPPER_BWD_DQ_A:
        raise ValueError(
            f"dQ A operand {dq_a!r} (hopper_bwd.dq_a): expected one of "
            f"{', '.join(HOPPER_BWD_DQ_A)}"
        )
    if options.schedule not in HOPPER_BWD_SCHEDULES:
        raise ValueError(
            f"schedule {options.schedule!r} (hopper_bwd.schedule): expected one of "
            f"{', '.join(HOPPER_BWD_SCHEDULES)}"
        )
    ws = options.schedule == "ws"
    if ws and dq_a != "smem":
        raise ValueError(
            f"hopper_bwd.schedule='ws' reads dS from shared memory for dQ: dq_a must be "
            f"'smem', got {dq_a!r}"
        )
    if not eligible(spec, target):
        raise ValueError(
            f"spec {spec.name!r} on {target}: the Hopper backward needs sm_90, head_dim == "
            f"head_dim_v in {list(HOPPER_BWD_HEAD_DIMS)}, no varlen, and a mask that reads no "
            "tensor"
        )
    d = spec.head_dim
    rec = dtype(spec.dtype)
    elt = rec.elem_bytes
    split_d = d > 128  # see HOPPER_BWD_TILES_SPLIT_D
    t = HOPPER_BWD_TILES_SPLIT_D if split_d else HOPPER_BWD_TILES
    abi = backward_abi(spec, atomic_dq=True)
    block_m, block_n = t.dkdv_block_m, t.dkdv_block_n
    warps = t.dkdv_warps + (4 if ws else 0)  # "ws": a producer warpgroup after the consumers
    threads = 32 * warps
    tma = (TmaArg("tma_q", "q", block_m), TmaArg("tma_k", "k", block_n),
           TmaArg("tma_v", "v", block_n), TmaArg("tma_do", "dout", block_m))  # fmt: skip
    if ws and not split_d:  # the dQ writer's reductions: fp32 boxes of 32 columns x 64 rows
        tma += (TmaArg("tma_dq", "dq_accum", 64, box_cols=32, dtype="fp32"),)
    dkdv_args = abi["dkdv_args"] + tuple(KernelArg(m.name, "CUtensorMap") for m in tma)
    smem = dkdv_smem_bytes(d, elt, block_m, block_n, split_d, ws)
    base = f"flashgen_{spec.name}_bwd_{target}_wgmma"
    ctx = base_fields(spec, causal_bits)
    ctx.update(
        atomic_dq=True,
        pre_args=abi["pre_args"],
        convert_args=abi["convert_args"],
        convert_threads=CONVERT_THREADS,
        pre_warps=PRE_WARPS,
        block_m=block_m,
        block_n=block_n,
        threads=threads,
        kernel_pre=f"{base}_pre",
        kernel_dkdv=f"{base}_dkdv",
        kernel_convert=f"{base}_convert",
        dkdv_args=dkdv_args,
        dkdv_smem_bytes=smem,
        mma_t=rec.mma_t,
        wgmma_ns=sorted({block_m // 2, d // 2}) if split_d else sorted({block_m, d}),
        dq_ldmatrix=dq_a == "ldmatrix",
        split_d=split_d,
        dkv_n=d // 2 if split_d else d,  # N of the dV, dK (and dQ) wgmmas of one warpgroup
        tt_ns=[d // 2] if split_d else [64],  # N of the transposed-A dQ wgmma
        # CTA order: (batch, KV head) pairs in L2-sized groups (common/tile_order.cuh)
        bwd_tile_group=tile_group_expr(spec, backward=True) if options.head_groups else "1",
        ws=ws,
        stages=WS_STAGES if ws else 2,
        producer_regs=WS_PRODUCER_REGS,
        consumer_regs=WS_CONSUMER_REGS,
    )
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
