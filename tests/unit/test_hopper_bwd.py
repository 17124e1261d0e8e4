"""The Hopper (sm_90a) backward: which specs and calls take it (hopper_bwd.eligible,
backward.backward_path), its plan (TMA maps, shared memory, kernels), the rendered unit
(StrictUndefined) and, with nvcc, zero spills and wgmma in the SASS.  The index math of the
kernel's loops (live query blocks, tiles that skip the mask, the dQ reduction lanes, the
swizzled dS^T stores; at head_dim 256 the split layout's P^T/dS^T stores and its
warpgroups' shares of dK, dV, dQ) is replayed in Python below.  The numerics run on a GPU
in tests/gpu/test_hopper_bwd_gpu.py."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
from plan_helpers import plan_hopper_backward
from sass_helpers import sass, setmaxnreg, wgmmas
from shipped_specs import DISTINCT

from flashgen.build import cache
from flashgen.build.render import render
from flashgen.families.common import HOPPER_SMEM_LIMIT
from flashgen.families.hopper_bwd import Options as HopperBwdOptions
from flashgen.families.hopper_bwd import eligible as hopper_bwd_eligible
from flashgen.families.registry import compile_units
from flashgen.families.tiles import HOPPER_BWD_TILES, HOPPER_BWD_TILES_SPLIT_D
from flashgen.frontend import ir
from flashgen.frontend.spec import load_spec, loads_spec
from flashgen.ops.prefill.backward import backward_path
from flashgen.ops.prefill.varlen import varlen_spec
from flashgen.options import DEFAULT

REPO = Path(__file__).resolve().parents[2]
#: Shipped specs the Hopper backward takes: d64/d128/d256, masks that read no tensor, any
#: score_mod.
ELIGIBLE = ("alibi", "alibi_learned", "bidir_d256", "causal_d128", "chunked_local",
            "document_mask", "gemma2_softcap", "gpt2_d64", "gpt_oss_sink", "llama3_gqa",
            "mistral_swa", "prefix_lm", "spec_tree", "t5_bias")  # fmt: skip


def shipped(name: str) -> ir.Spec:
    return load_spec(REPO / "specs" / f"{name}.yaml")


def small(d: int, dtype: str, causal: bool) -> ir.Spec:
    text = f"name: hb_d{d}_{dtype}\nhead_dim: {d}\ndtype: {dtype}\n"
    return loads_spec(text + f"mask: {'causal' if causal else 'null'}\n", "<hb>")


def at_d256(name: str) -> ir.Spec:
    """Shipped spec ``name`` at head_dim 256 (its mask and score_mod, a new name)."""
    text = (REPO / "specs" / f"{name}.yaml").read_text()
    lines = [
        "head_dim: 256"
        if ln.startswith("head_dim:")
        else f"name: {name}_d256"
        if ln.startswith("name:")
        else ln
        for ln in text.splitlines()
    ]
    return loads_spec("\n".join(lines) + "\n", f"<{name}_d256>")


@pytest.mark.parametrize("path", sorted((REPO / "specs").glob("*.yaml")), ids=lambda p: p.stem)
def test_eligibility_of_shipped_specs(path):
    spec = load_spec(path)
    assert hopper_bwd_eligible(spec, "sm_90") == (spec.name in ELIGIBLE)
    assert not hopper_bwd_eligible(spec, "sm_80")
    assert not hopper_bwd_eligible(spec, "sm_90", "fa2")
    assert ("bwd_wgmma" in compile_units(spec, "sm_90")) == (spec.name in ELIGIBLE)


def test_ineligible_specs():
    base = small(128, "bf16", True)
    assert hopper_bwd_eligible(base, "sm_90")
    assert not hopper_bwd_eligible(varlen_spec(base), "sm_90")
    assert not hopper_bwd_eligible(dataclasses.replace(base, head_dim_v=64), "sm_90")
    assert hopper_bwd_eligible(small(256, "bf16", True), "sm_90")
    for d in (32, 96, 160, 192):  # no layout for these yet
        assert not hopper_bwd_eligible(small(d, "bf16", True), "sm_90")
    assert not hopper_bwd_eligible(
        dataclasses.replace(small(256, "bf16", True), head_dim_v=128), "sm_90"
    )
    assert hopper_bwd_eligible(shipped("document_mask"), "sm_90")  # a block table at its tiles
    no_tables = HopperBwdOptions(tensor_masks=False)
    assert not hopper_bwd_eligible(shipped("document_mask"), "sm_90", options=no_tables)
    # a two-sided tensor read: only with two_sided_masks (on by default)
    assert hopper_bwd_eligible(shipped("spec_tree"), "sm_90")
    assert not hopper_bwd_eligible(shipped("spec_tree"), "sm_90", options=HopperBwdOptions(
        two_sided_masks=False))
    with pytest.raises(ValueError, match="the Hopper backward needs"):
        plan_hopper_backward(small(192, "bf16", False), "sm_90")
    with pytest.raises(ValueError, match="unknown kernel family"):
        hopper_bwd_eligible(base, "sm_90", "fa9")


def test_backward_path_selection():
    yes, no = shipped("causal_d128"), shipped("document_mask")
    det = "hopper_ordered" if DEFAULT.hopper_bwd.ordered_dq else "deterministic"
    assert backward_path(yes, "sm_90", True) == det
    assert backward_path(yes, "sm_90", False) == "hopper"
    assert backward_path(yes, "sm_80", False) == "deterministic"
    assert backward_path(no, "sm_90", True) == "deterministic"  # a mask's hull: no fixed order
    no_tables = DEFAULT.replace_path("hopper_bwd.tensor_masks", False)
    assert backward_path(no, "sm_90", False, no_tables) == "deterministic"
    atomic = DEFAULT.replace_path("atomic_dq", True)
    assert backward_path(yes, "sm_90", False, atomic) == "hopper"
    assert backward_path(yes, "sm_90", True, atomic) == det
    assert backward_path(yes, "sm_80", False, atomic) == "atomic"
    assert backward_path(no, "sm_90", False, atomic) == "hopper"
    atomic_no_tables = atomic.replace_path("hopper_bwd.tensor_masks", False)
    assert backward_path(no, "sm_90", False, atomic_no_tables) == "atomic"
    fa2 = atomic.replace_path("family", "fa2")  # the FA2-class atomic kernel on sm_90
    assert backward_path(yes, "sm_90", False, fa2) == "atomic"
    never = DEFAULT.replace_path("atomic_dq", False)  # opt out of every atomic path
    assert backward_path(yes, "sm_90", False, never) == "deterministic"


@pytest.mark.parametrize("d", [64, 128])
def test_plan(d):
    spec = small(d, "bf16", True)
    plan = plan_hopper_backward(spec, "sm_90")
    bm = DEFAULT.hopper_bwd.d64_block_m if d == 64 else DEFAULT.hopper_bwd.d128_block_m
    m80 = d == 128 and bm == 80  # dQ^T into an 80-row sDQ, the coordinates in dynamic memory
    tiles = dataclasses.replace(HOPPER_BWD_TILES, dkdv_block_m=bm)
    assert plan.atomic_dq and plan.dq is None and plan.tiles == tiles
    assert not plan.dkdv.context["split_d"]
    assert plan.unit is plan.dkdv
    assert {k.template for k in plan.kernels} == {"sm_90/bwd.cu.j2"}
    assert [k.kernel_name for k in plan.kernels] == [
        f"flashgen_{spec.name}_bwd_sm_90_wgmma_{r}" for r in ("pre", "dkdv", "convert")
    ]
    assert plan.dkdv.threads == 384 and plan.dkdv.gencode.endswith("sm_90a")
    assert [(m.name, m.tensor, m.box_rows, m.dtype) for m in plan.dkdv.tma] == [
        ("tma_q", "q", bm, None), ("tma_k", "k", 128, None), ("tma_v", "v", 128, None),
        ("tma_do", "dout", bm, None), ("tma_dq", "dq_accum", 80 if m80 else 64, "fp32"),
    ]  # fmt: skip
    assert plan.dkdv.tma[-1].box_cols == 32  # one 128-byte swizzle row of fp32
    names = ["tma_q", "tma_k", "tma_v", "tma_do", "tma_dq"]
    assert [a.name for a in plan.dkdv.args[-5:]] == names
    assert "dq_accum" in [a.name for a in plan.dkdv.args]
    assert plan.pre.tma == () and plan.convert.tma == ()
    # K, V; two stages of Q, dO; two dS^T buffers; the dQ staging tiles; lse, dsum; mbarriers
    smem = 1024 + 2 * 128 * d * 2 + 4 * bm * d * 2 + 2 * 128 * bm * 2
    smem += 2 * (80 if m80 else 64) * 64 * 4 + 4 * bm * 4 + 24 + (24 if m80 else 0)
    assert plan.dkdv.smem_bytes == smem <= HOPPER_SMEM_LIMIT
    grids = plan.grids(2, 8, 2, 1000, 4097)
    assert grids["dkdv"] == (2 * 2 * 33, 1, 1) and "convert" in grids
    assert plan.config()["deterministic"] is False


def test_plan_d256_split_layout():
    """64 keys per CTA (TMA boxes of 64 rows for k and v), P^T and dS^T in shared memory
    (two 64 x 64 tiles): 215064 bytes, no dQ staging tiles (the consumers reduce dQ
    themselves); the wgmma N extents of the split (64: S^T on warpgroup 0, dP^T on 1; 128:
    dK, dV, dQ per warpgroup)."""
    spec = small(256, "bf16", True)
    plan = plan_hopper_backward(spec, "sm_90")
    assert plan.atomic_dq and plan.dq is None and plan.tiles == HOPPER_BWD_TILES_SPLIT_D
    ctx = plan.dkdv.context
    assert ctx["split_d"] and ctx["dkv_n"] == 128 and ctx["tt_ns"] == [128]
    assert ctx["wgmma_ns"] == [64, 128] and (ctx["block_n"], ctx["block_m"]) == (64, 64)
    assert plan.dkdv.threads == 384 and plan.dkdv.gencode.endswith("sm_90a")
    assert [(m.name, m.tensor, m.box_rows) for m in plan.dkdv.tma] == [
        ("tma_q", "q", 64), ("tma_k", "k", 64), ("tma_v", "v", 64), ("tma_do", "dout", 64),
    ]  # fmt: skip
    smem = 1024 + 2 * 64 * 256 * 2 + 4 * 64 * 256 * 2 + 2 * 64 * 64 * 2 + 4 * 64 * 4 + 24
    assert plan.dkdv.smem_bytes == smem == 215064 <= HOPPER_SMEM_LIMIT
    grids = plan.grids(2, 8, 2, 1000, 4097)
    assert grids["dkdv"] == (2 * 2 * 65, 1, 1)
    # dq_accum in 64-row tiles (fragment order): 1000 query rows padded to 1024
    assert grids["convert"] == (-(-(2 * 8 * 1024 * 64) // 256), 1, 1)



def test_d256_sdp_warpgroups_splits_s_and_dp_between_the_warpgroups():
    """``d256_sdp_warpgroups`` (on by default): warpgroup 0 computes the whole S^T, warpgroup
    1 the whole dP^T (one m64n64 loop whose operands are K, Q or V, dO by warpgroup),
    warpgroup 1 issues after warpgroup 0 (BAR_SDP) and reads P^T back by ldmatrix for dS^T.
    A score_mod whose derivative is not 1 (softcap) takes an 8 KiB sPG for P^T * d score_mod
    / d score; units with param gradients, the option off, and head dims 64 and 128 keep
    their layouts."""
    from flashgen.families import hopper_bwd

    off = hopper_bwd.Options(d256_sdp_warpgroups=False)
    spec = small(256, "bf16", True)
    wg, split = hopper_bwd.plan(spec, "sm_90").dkdv, hopper_bwd.plan(spec, "sm_90", off).dkdv
    assert wg.context.sdp_wg and not split.context.sdp_wg
    assert wg.smem_bytes == split.smem_bytes and not wg.context.pg_frag
    src = render(wg)
    assert "constexpr int QW = BLOCK_M;" in src and "constexpr int BAR_SDP = 1;" in src
    assert "gdesc(sK + cg * (sV - sK) + col * BLOCK_N + sub, 16, 1024)" in src
    assert "gdesc(sQ + cg * (sDO - sQ) + col * BLOCK_M + sub, 16, 1024)" in src
    assert "fg::ldsm_frag_swizzled(sPi, warp * 16, 0, frag_p, lane);" in src
    assert "ldsm_frag_swizzled" not in render(split) and "int BAR_SDP" not in render(split)
    soft = hopper_bwd.plan(shipped("gemma2_softcap"), "sm_90").dkdv
    assert soft.context.pg_frag and soft.smem_bytes == split.smem_bytes + 64 * 64 * 2
    assert soft.smem_bytes + 1024 <= HOPPER_SMEM_LIMIT
    assert "fg::ldsm_frag_swizzled(sPGi, warp * 16, 0, frag_pg, lane);" in render(soft)
    learned = at_d256("alibi_learned")
    dp = hopper_bwd.plan(learned, "sm_90", param_grads=("slopes",)).dkdv
    assert not dp.context.sdp_wg
    for d in (64, 128):
        s = small(d, "bf16", True)
        same = render(hopper_bwd.plan(s, "sm_90").dkdv)
        assert render(hopper_bwd.plan(s, "sm_90", off).dkdv) == same


@pytest.mark.parametrize("name", ["hb_causal", "bidir_d256", "gemma2_softcap", "d256:mistral_swa"])
def test_d256_sdp_warpgroups_compiles_without_spills(requires_nvcc, name):
    """One m64n64 loop of 16 k-steps serves S^T and dP^T; dV, dK, dQ: 4 m64n128 each."""
    from flashgen.families import hopper_bwd

    if name == "hb_causal":
        spec = small(256, "bf16", True)
    else:
        spec = at_d256(name[5:]) if name.startswith("d256:") else shipped(name)
    plan = hopper_bwd.plan(spec, "sm_90")
    _, report = cache.get_or_build(render(plan.unit), plan.unit)
    assert report.spill_bytes == 0 and not report.wgmma_serialized, report
    code = sass(plan.unit)
    assert wgmmas(code, "64x64x16") == 16 and wgmmas(code, "64x128x16") == 12
    assert not wgmmas(code, "64x32x16")

@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False])
def test_render(d, dtype, causal):
    """StrictUndefined (render's environment) catches any name the template reads and the
    plan lacks; the three kernels, the wgmma forms and the roles are there."""
    plan = plan_hopper_backward(small(d, dtype, causal), "sm_90")
    src = render(plan.unit)
    m80 = d == 128  # d128_block_m's default 80-query steps (no mask or causal)
    dq_n = 128 if d == 256 else 64  # N of a warpgroup's dQ wgmma (80-query steps: dQ^T's)
    assert ("fg::wgmma_ts_n80(acc_dq" if m80 else f"fg::wgmma_tt_n{dq_n}(acc_dq") in src
    for k in plan.kernels:
        assert 'extern "C" __global__ void __launch_bounds__' in src and k.kernel_name in src
    t = "bf16" if dtype == "bf16" else "f16"
    rows_split = d == 64 and DEFAULT.hopper_bwd.d64_block_m == 128  # 128-query steps
    s_n, dkv_n = (64, 128) if d == 256 else (128 if rows_split else 80 if m80 else 64, d)
    assert f"m64n{s_n}k16.f32.{t}.{t}" in src and f"m64n{dkv_n}k16.f32.{t}.{t}" in src
    assert f"constexpr bool IS_CAUSAL = {'true' if causal else 'false'};" in src
    assert "fence.proxy.async.shared::cta" in src
    assert ("fg::red_add_dq_frag<" in src) == (d == 256)  # else the dQ writer's TMA reductions
    assert ("fg::tma_reduce_add_4d(&tma_dq" in src) == (d != 256)
    assert "fg::setmaxnreg_dec<24>();" in src and "fg::setmaxnreg_inc<240>();" in src
    bar = "fg::named_barrier_sync(BAR_MMA, MMA_THREADS);  // both warpgroups'"
    assert (f"{bar} dS^T rows" in src) == (d == 128 or rows_split)  # dQ over all 128 keys
    sync = "fg::named_barrier_sync(BAR_MMA, MMA_THREADS);  // "
    assert (f"{sync}P^T is in sPi" in src) == (d == 256)  # S^T and dP^T by warpgroup
    assert (f"{sync}dS^T is in sDSi" in src) == (d == 256)
    assert ("fg::wgmma_st_n128(acc_dv" in src) == (d == 256)
    assert "fg::wgmma_st_n64(acc_dv" not in src  # d64: P^T in registers at either block_m
    assert ("fg::wgmma_rs_n64(acc_dv, frag_p[kk]" in src) == (d == 64)
    assert "fg_tile_class" not in src  # causal or none: the live range in closed form


def plan_block_m(spec) -> int:
    return plan_hopper_backward(spec, "sm_90").dkdv.context["block_m"]


@pytest.mark.parametrize("d256", [False, True], ids=["shipped", "d256"])
@pytest.mark.parametrize("name", ["alibi", "t5_bias", "mistral_swa", "chunked_local", "prefix_lm"])
def test_render_masks_and_score_mods(name, d256):
    """A residual mask walks the classifier's hull and classifies each step's tiles; a
    score_mod's derivative multiplies P^T for dS^T."""
    spec = at_d256(name) if d256 else shipped(name)
    src = render(plan_hopper_backward(spec, "sm_90").unit)
    masked = spec.mask is not None and spec.mask != ir.Causal()
    assert ("fg::iv::next_live(0, m_blocks, c, full_hi, head_class)" in src) == masked
    assert ("!= fg::iv::FULL" in src) == masked
    assert ("acc_s[i] = pe[e] * (float)(" in src) == (spec.score_mod is not None)
    bm = plan_block_m(spec)
    # NQ * 4 keep bits, NQ = query rows / 8 (d256: warpgroup 0's whole 64-query step)
    keep_t = "uint64_t" if bm > 64 else "uint32_t"
    assert f"keep_bits |= ({keep_t})keep << i;" in src


def test_register_budget_of_the_roles():
    """setmaxnreg moves registers between the roles inside what ``__launch_bounds__(384, 1)``
    gives the CTA (168 x 384): more and the consumers' increase never completes."""
    ctx = plan_hopper_backward(small(128, "bf16", True), "sm_90").dkdv.context
    assert 128 * ctx["producer_regs"] + 256 * ctx["consumer_regs"] <= 168 * 384
    assert ctx["stages"] == 2


def test_dq_stores_land_in_tma_boxes():
    """acc_dq to sDQ: acc_dq[4 j + 2 r + e] of (warp w, lane l) is dQ element (row
    16 w + l / 4 + 8 r, column 8 j + 2 (l % 4) + e) of the warpgroup's 64 x 64 tile; the
    kernel's address must be that element in box j / 4 (32 fp32 columns, 128-byte rows, TMA's
    128-byte swizzle: 16-byte chunk c of row r at chunk c ^ (r % 8)), every element once; each
    half-warp's 8-byte stores (rows l / 4 of 4, two chunks each) meet at most 2 to a bank."""
    box_bytes = 64 * 128
    seen = set()
    for w in range(4):
        for j in range(8):
            for r in range(2):
                banks: dict[int, list] = {0: [], 1: []}
                for lane in range(32):
                    cb = 8 * (j % 4) + 2 * (lane % 4)
                    base = (w * 16 + lane // 4) * 128
                    addr = base + (j // 4) * box_bytes + 8 * r * 128
                    addr += (((cb // 4) ^ (lane // 4)) << 4) + (cb % 4) * 4
                    row, col = 16 * w + lane // 4 + 8 * r, 8 * j + 2 * (lane % 4)
                    box, c = divmod(col, 32)
                    want = box * box_bytes + row * 128 + (((c // 4) ^ (row % 8)) << 4) + (c % 4) * 4
                    assert addr == want
                    for e in range(2):
                        seen.add(addr + 4 * e)
                        banks[lane // 16].append(((addr + 4 * e) // 4) % 32)
                assert all(max(b.count(x) for x in b) <= 2 for b in banks.values())
    assert len(seen) == 64 * 64  # every fp32 element of the tile written once


def test_ordered_dq_routes_deterministic_calls_under_its_option():
    """``hopper_bwd.ordered_dq``: ``deterministic=True`` takes the Hopper kernel
    with dQ in a fixed order (path "hopper_ordered") for head_dim 64/128 with no mask or
    causal; masks with a hull, head_dim 256 and the option off keep the FA2-class
    deterministic kernels."""
    on = DEFAULT.replace_path("hopper_bwd.ordered_dq", True)
    off = DEFAULT.replace_path("hopper_bwd.ordered_dq", False)
    assert backward_path(shipped("causal_d128"), "sm_90", True, on) == "hopper_ordered"
    assert backward_path(shipped("gpt2_d64"), "sm_90", True, on) == "hopper_ordered"
    assert backward_path(small(128, "fp16", False), "sm_90", True, on) == "hopper_ordered"
    assert backward_path(shipped("causal_d128"), "sm_90", False, on) == "hopper"
    assert backward_path(shipped("causal_d128"), "sm_90", True, off) == "deterministic"
    for name in ("mistral_swa", "bidir_d256"):
        assert backward_path(shipped(name), "sm_90", True, on) == "deterministic"
    assert backward_path(shipped("causal_d128"), "sm_80", True, on) == "deterministic"


def test_ordered_dq_plan_and_render():
    """The ordered form: its own kernel names, a ``dq_sem`` argument before the tensor maps,
    the writer waiting on the semaphore with acquire and counting in with release after its
    reductions completed; refused where the key blocks of a query block are no prefix."""
    from flashgen.families import hopper_bwd
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    plan = reg_plan(shipped("causal_d128"), "sm_90", DEFAULT, ordered_dq=True)
    assert plan.dkdv.kernel_name.endswith("_wgmma_ordered_dkdv")
    names = [a.name for a in plan.dkdv.args]
    assert names[names.index("dq_sem") + 1] == "tma_q"
    src = render(plan.unit)
    assert "fg::ld_acquire_gpu(sem) != n0 / BLOCK_N" in src
    assert "fg::st_release_gpu(sem, n0 / BLOCK_N + 1);" in src
    assert "if (c == 1 || !DQ_ALL_KEYS) fg::bulk_wait_group<0>();" in src
    assert "dq_sem" not in render(plan_hopper_backward(shipped("causal_d128"), "sm_90").unit)
    for spec in (shipped("mistral_swa"), shipped("bidir_d256")):
        assert not hopper_bwd.ordered_eligible(spec, "sm_90")
        with pytest.raises(ValueError, match="fixed order needs head_dim 64 or 128"):
            reg_plan(spec, "sm_90", DEFAULT, ordered_dq=True)


#: ``hopper_bwd.ordered_d256``: head_dim 256's ordered form (off by default)
ORDERED_D256 = DEFAULT.replace_path("hopper_bwd.ordered_d256", True)


def test_ordered_d256_routes_and_renders_the_consumers_turn():
    """With ``ordered_d256``, ``deterministic=True`` at head_dim 256 (no mask, causal, a
    score_mod) takes the Hopper kernel's ordered form; each consumer warpgroup waits for two
    counts per earlier key block, adds its dQ columns, fences, meets its warpgroup and counts
    itself in with a release add.  A residual mask stays on the FA2-class kernels."""
    from flashgen.families import hopper_bwd
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    for name in ("bidir_d256", "gemma2_softcap"):
        assert backward_path(shipped(name), "sm_90", True) == "deterministic"
        assert backward_path(shipped(name), "sm_90", True, ORDERED_D256) == "hopper_ordered"
        assert backward_path(shipped(name), "sm_90", False, ORDERED_D256) == "hopper"
    assert backward_path(small(256, "fp16", True), "sm_90", True, ORDERED_D256) == "hopper_ordered"
    mistral = at_d256("mistral_swa")
    assert not hopper_bwd.ordered_eligible(mistral, "sm_90", options=ORDERED_D256.hopper_bwd)
    assert backward_path(mistral, "sm_90", True, ORDERED_D256) == "deterministic"
    plan = reg_plan(shipped("bidir_d256"), "sm_90", ORDERED_D256, ordered_dq=True)
    assert plan.dkdv.context["split_d"] and plan.dkdv.kernel_name.endswith("_wgmma_ordered_dkdv")
    assert "dq_sem" in [a.name for a in plan.dkdv.args]
    src = render(plan.unit)
    wait = src.index("while (fg::ld_acquire_gpu(sem) < 2 * (n0 / BLOCK_N)) {}")
    red = src.index("fg::red_add_dq_frag<DW / 8>", wait)
    fence = src.index("fg::fence_acq_rel_gpu();", red)
    meet = src.index("fg::named_barrier_sync(BAR_DQ_ORDER + cg, 128);", fence)
    assert src.index("fg::red_release_gpu_add(sem, 1);", meet) > meet
    unordered = render(reg_plan(shipped("bidir_d256"), "sm_90", ORDERED_D256).unit)
    assert "dq_sem" not in unordered and "red_release_gpu_add" not in unordered


#: ``hopper_bwd.ordered_masks``: the ordered form under a residual mask (off by default)
ORDERED_MASKS = DEFAULT.replace_path("hopper_bwd.ordered_masks", True)


def test_ordered_masks_route_and_render_turns_over_published_hulls():
    """With ``ordered_masks``, ``deterministic=True`` under a residual mask (windows, prefix,
    a tensor-reading mask's block table) takes the ordered Hopper form at head_dim 64 / 128:
    the writer publishes its CTA's hull with a release store before its steps and counts, per
    step, the earlier key blocks whose hull holds the step's query block; the prefix form
    (no mask, causal) keeps its closed-form turn and no hull argument."""
    from flashgen.families import hopper_bwd
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    for name in ("mistral_swa", "prefix_lm", "document_mask", "spec_tree", "alibi_learned"):
        spec = shipped(name)
        assert backward_path(spec, "sm_90", True, ORDERED_MASKS) == "hopper_ordered", name
        assert backward_path(spec, "sm_90", False, ORDERED_MASKS) == "hopper", name
    assert backward_path(shipped("mistral_swa"), "sm_90", True) == "deterministic"
    d256 = at_d256("mistral_swa")
    assert not hopper_bwd.ordered_eligible(d256, "sm_90", options=ORDERED_MASKS.hopper_bwd)
    plan = reg_plan(shipped("mistral_swa"), "sm_90", ORDERED_MASKS, ordered_dq=True)
    assert plan.dkdv.context.ordered_hull
    args = [(a.name, a.ctype) for a in plan.dkdv.args]
    assert ("dq_hull", "uint64_t*") in args and ("dq_sem", "int*") in args
    src = render(plan.unit)
    publish = src.index("fg::st_release_gpu_u64(dq_hull + hull_row + cta_vinfo[2] / BLOCK_N,")
    loop = src.index("for (int i = 0; i < steps; ++i) {", publish)
    holds = src.index(
        "holds = (int)(hull >> 32) <= m0 / BLOCK_M && m0 / BLOCK_M < (int)(uint32_t)hull;", loop
    )
    wait = src.index("while (fg::ld_acquire_gpu(sem) != turn) {}", holds)
    assert src.index("fg::st_release_gpu(sem, turn + 1);", wait) > wait
    prefix = render(reg_plan(shipped("causal_d128"), "sm_90", ORDERED_MASKS, ordered_dq=True).unit)
    assert "fg::ld_acquire_gpu(sem) != n0 / BLOCK_N" in prefix and "dq_hull" not in prefix


def _simulate_turns(hulls: list[tuple[int, int]], heads: int, seed: int) -> dict:
    """The ordered dQ's protocol as the writers run it: key block n's CTA walks (head, query
    block m) for m in its hull [lo, hi), waiting until the (head, m) semaphore equals its turn,
    the count of earlier key blocks whose hull holds m (the template's formula), then adds and
    stores turn + 1.  CTAs advance in a random interleaving; returns each (head, m)'s adders
    in order, or raises on a deadlock."""
    import random

    rng = random.Random(seed)
    steps = [[(h, m) for h in range(heads) for m in range(lo, hi)] for lo, hi in hulls]
    pos = [0] * len(hulls)
    sem: dict = {}
    adds: dict = {}
    while any(p < len(st) for p, st in zip(pos, steps, strict=True)):
        ready = []
        for n, st in enumerate(steps):
            if pos[n] < len(st):
                h, m = st[pos[n]]
                turn = sum(lo <= m < hi for lo, hi in hulls[:n])
                if sem.get((h, m), 0) == turn:
                    ready.append((n, h, m, turn))
        assert ready, "deadlock"
        n, h, m, turn = rng.choice(ready)
        adds.setdefault((h, m), []).append(n)
        sem[(h, m)] = turn + 1
        pos[n] += 1
    return adds


@pytest.mark.parametrize("seed", range(6))
def test_ordered_turns_over_hulls_add_in_key_block_order(seed):
    """Whatever the hulls (windows, a prefix seen by every block, empty hulls, hulls that
    shrink and grow again), every key block whose hull holds a query block adds into it once,
    the adds in key-block order, under any interleaving of the CTAs, without a deadlock."""
    import random

    rng = random.Random(100 + seed)
    m_blocks = 12
    hulls = []
    for _ in range(10):
        lo = rng.randrange(m_blocks + 1)
        hulls.append((lo, lo if rng.random() < 0.15 else rng.randrange(lo, m_blocks + 1)))
    hulls[0] = (0, m_blocks)  # a global prefix block (prefix_lm's keys below the prefix)
    adds = _simulate_turns(hulls, heads=2, seed=seed)
    for h in range(2):
        for m in range(m_blocks):
            want = [n for n, (lo, hi) in enumerate(hulls) if lo <= m < hi]
            assert adds.get((h, m), []) == want


@pytest.mark.parametrize(
    "name, options",
    [("causal_d128", DEFAULT), ("gpt2_d64", DEFAULT), ("alibi", DEFAULT),
     ("bidir_d256", ORDERED_D256), ("gemma2_softcap", ORDERED_D256),
     ("causal_d128", DEFAULT.replace_path("hopper_bwd.ordered_80", True)),
     ("alibi", DEFAULT.replace_path("hopper_bwd.ordered_80", True)),
     ("mistral_swa", ORDERED_MASKS), ("document_mask", ORDERED_MASKS),
     ("prefix_lm", ORDERED_MASKS.replace_path("hopper_bwd.ordered_80", True)),
     ("spec_tree", ORDERED_MASKS.replace_path("hopper_bwd.ordered_80", True))],
)  # fmt: skip
def test_ordered_dq_compiles_without_spills(requires_nvcc, name, options):
    """(llama3_gqa: causal_d128's code; head_dim 256 under ``ordered_d256``; head_dim 128's
    80-query steps under ``ordered_80``; residual masks under ``ordered_masks``.)"""
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    plan = reg_plan(shipped(name), "sm_90", options, ordered_dq=True)
    _, report = cache.get_or_build(render(plan.unit), plan.unit)
    assert report.spill_bytes == 0 and not report.wgmma_serialized, report


D256 = ("alibi", "mistral_swa", "chunked_local", "prefix_lm")  # shipped masks and mods at d256


#: the eligible specs, one per kernel code (tests/shipped_specs.py: llama3_gqa is causal_d128)
ELIGIBLE_CODE = [n for n in ELIGIBLE if REPO / "specs" / f"{n}.yaml" in DISTINCT]


@pytest.mark.parametrize("name", ELIGIBLE_CODE + [f"d256:{n}" for n in D256])
def test_compiles_without_spills_with_wgmma(requires_nvcc, name):
    """About 1-2 s per unit on 2 idle cores.  The consumers run at 240 registers
    (setmaxnreg): ptxas allocates each role to its own count only when no trap sits in the
    consumers' region and little is live across the role branch (the template keeps both
    so); a template change that adds registers to the loop may tip a masked or score_mod'ed
    spec into spills (then family_build.build_backward falls back to the FA2-class kernels
    for it)."""
    from flashgen.families import build as family_build

    spec = at_d256(name.removeprefix("d256:")) if name.startswith("d256:") else shipped(name)
    plan, _, report = family_build.build_backward(spec, "sm_90", atomic_dq=True, hopper=True)
    assert plan.dkdv.template == "sm_90/bwd.cu.j2", "fell back to the FA2-class kernels"
    assert report.spill_bytes == 0, report
    assert not report.wgmma_serialized
    code = sass(plan.unit)  # the cubin just built (tests/sass_helpers.py: PTX -> SASS names)
    # S^T, dP^T: D/16 each (d256 with S^T and dP^T by warpgroup: one loop for both); dV, dK:
    # BLOCK_M/16 each; dQ: 8 (d128; d64 with 128-query steps), 4 (d64 with 64: its own 64
    # keys; d256: 64 keys)
    ctx = plan.dkdv.context
    d, bm = ctx["head_dim"], ctx["block_m"]
    dq = 8 if d == 128 or bm == 128 else 4
    sdp = (1 if ctx["sdp_wg"] else 2) * (d // 16)
    assert wgmmas(code) == sdp + 2 * (bm // 16) + dq
    if d == 256:
        assert wgmmas(code, "64x64x16" if ctx["sdp_wg"] else "64x32x16")
        assert wgmmas(code, "64x128x16") and not wgmmas(code, "64x256x16")
    assert "UTMALDG.4D" in code
    assert setmaxnreg(code, "dec", 24) and setmaxnreg(code, "inc", 240)
    assert ("UTMAREDG.4D" in code) == (d != 256)  # cp.reduce.async.bulk.tensor.4d
    assert ("REDG.E.ADD.F32x4" in code) == (d == 256)  # red.global.add.v4.f32
    assert "BPT.TRAP" not in code


# ----------------------------------------------------------------------------- index math
def _steps(sq: int, sk: int, n_block: int, causal: bool) -> list[int]:
    """The query blocks the kernel visits for key block n_block (one head)."""
    m_blocks = -(-sq // 64)
    m_first = max(0, n_block * 128 - (sk - sq)) // 64 if causal else 0
    return list(range(m_first, m_blocks))


def _edge(sq: int, sk: int, kw0: int, m0: int, causal: bool) -> bool:
    return kw0 + 64 > sk or m0 + 64 > sq or (causal and kw0 + 63 > m0 + sk - sq)


@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 1), (1, 17), (127, 1000), (1000, 127), (300, 100),
                                    (4097, 4097), (64, 128), (128, 64), (200, 333)])  # fmt: skip
@pytest.mark.parametrize("causal", [True, False])
def test_visited_steps_cover_every_kept_pair_and_skip_only_full_tiles(sq, sk, causal):
    """Every (q, kv) pair the mask keeps lies in a visited step; a step the kernel treats as
    not an edge (no mask evaluated) has every pair of its warpgroup's 64 x 64 tile kept."""
    import numpy as np

    qi = np.arange(sq)[:, None]
    ki = np.arange(sk)[None, :]
    keep = (ki <= qi + sk - sq) if causal else np.ones((sq, sk), bool)
    covered = np.zeros((sq, sk), bool)
    for n_block in range(-(-sk // 128)):
        for mb in _steps(sq, sk, n_block, causal):
            m0 = mb * 64
            for cg in range(2):
                kw0 = n_block * 128 + cg * 64
                covered[m0 : m0 + 64, kw0 : kw0 + 64] = True
                if not _edge(sq, sk, kw0, m0, causal):
                    assert m0 + 64 <= sq and kw0 + 64 <= sk
                    assert keep[m0 : m0 + 64, kw0 : kw0 + 64].all(), (n_block, mb, cg)
    assert not (keep & ~covered).any()


def test_dq_frag_order_holds_each_accumulator_element_once(cxx_exe):
    """The d256 dQ reductions in fragment order: thread t of warpgroup c adds acc[4j .. 4j + 3]
    as float4 c * 2048 + j * 128 + t of the 64-row tile (``fg::red_add_dq_frag``); the convert
    kernel reads float4 f back at ``fg::dq_frag_coords<256>(f)`` (compiled from the kernels' header
    for the host).  Those coordinates are where the m64n128 accumulator layout holds the four
    values, and the tile's 64 x 256 elements are each held once."""
    header = (REPO / "templates" / "common" / "sm90_bwd.cuh").read_text()
    start = header.index("struct DqFragCoords")
    end = header.index("\n}", header.index("dq_frag_coords(int f)")) + 2
    program = (
        "#include <cstdio>\n#define __device__\n#define __forceinline__ inline\n"
        f"namespace fg {{\n{header[start:end]}\n}}\n"
        "int main() {\n    for (int f = 0; f < 4096; ++f) {\n"
        "        const fg::DqFragCoords rc = fg::dq_frag_coords<256>(f);\n"
        '        printf("%d %d\\n", rc.row, rc.col);\n    }\n}\n'
    )
    import subprocess

    out = subprocess.run([str(cxx_exe(program, "dq_frag"))], capture_output=True, text=True,
                         timeout=60).stdout.split()  # fmt: skip
    coords = [(int(out[2 * f]), int(out[2 * f + 1])) for f in range(4096)]
    held = {}
    for c in range(2):
        for t in range(128):
            warp, lane = t // 32, t % 32
            for j in range(16):
                # m64n128 accumulator: acc[4j + 2r + e] at
                # (16 warp + lane/4 + 8r, 8j + 2(lane%4) + e)
                row, col = 16 * warp + lane // 4, 128 * c + 8 * j + 2 * (lane % 4)
                assert coords[c * 2048 + j * 128 + t] == (row, col)
                for r in range(2):
                    for e in range(2):
                        held[(row + 8 * r, col + e)] = held.get((row + 8 * r, col + e), 0) + 1
    assert held == {(r, c): 1 for r in range(64) for c in range(256)}


def test_d256_plan_pads_dq_accum_to_tiles():
    """Only head_dim 256 (param gradients or not) adds dQ in fragment order: dq_accum's rows
    per (batch, query head) round up to 64 and the convert kernel's grid covers the padded
    tiles; the removed option says so."""
    from flashgen.families import hopper_bwd
    from flashgen.options import UnknownOptionError

    plan = hopper_bwd.plan(small(256, "bf16", True), "sm_90")
    assert plan.dkdv.context["dq_frag"]
    assert [plan.dq_accum_seqlen(n) for n in (1, 64, 65, 1000)] == [64, 64, 128, 1024]
    assert plan.grids(2, 3, 1, 65, 100)["convert"][0] * 256 >= 2 * 3 * 128 * 256 // 4
    for d in (64, 128):
        other = hopper_bwd.plan(small(d, "bf16", True), "sm_90")
        assert other.dq_accum_seqlen(65) == 65 and not other.dkdv.context["dq_frag"]
    assert "fg::red_add_dq_frag<" in render(plan.unit)
    dp = hopper_bwd.plan(at_d256("alibi_learned"), "sm_90", param_grads=("slopes",))
    assert dp.dkdv.context["dq_frag"] and dp.dq_accum_seqlen(65) == 128
    assert "fg::red_add_dq_frag<" in render(dp.unit)
    with pytest.raises(UnknownOptionError, match="fragment"):
        DEFAULT.with_values({"hopper_bwd.d256_dq_frag": True})


@pytest.mark.parametrize("name", ["hb_causal", "gemma2_softcap"])
def test_d256_dq_reductions_are_16_bytes_without_spills(requires_nvcc, name):
    """16 16-byte reductions per thread and step (REDG ... F32x4), none of 8 bytes."""
    from flashgen.families import hopper_bwd

    spec = small(256, "bf16", True) if name == "hb_causal" else shipped(name)
    plan = hopper_bwd.plan(spec, "sm_90")
    _, report = cache.get_or_build(render(plan.unit), plan.unit)
    assert report.spill_bytes == 0 and not report.wgmma_serialized, report
    code = sass(plan.unit)
    assert code.count("REDG.E.ADD.F32x4") == 16 and "F32x2" not in code


def test_ds_stores_land_in_the_swizzled_layout():
    """dS^T to sDS: ds_frag[kk][t] of (warpgroup cg, warp w, lane l) holds elements (key row,
    query columns 16 kk + 8 (t / 2) + 2 (l % 4) + {0, 1}) of row 64 cg + 16 w + l / 4 + 8 (t % 2);
    the kernel's address must be TMA's 128-byte swizzle of that element: 16-byte chunk c of
    row r at chunk c ^ (r % 8)."""
    seen = set()
    for cg in range(2):
        for w in range(4):
            for lane in range(32):
                for kk in range(4):
                    for t in range(4):
                        row = cg * 64 + w * 16 + lane // 4
                        addr = (row + 8 * (t % 2)) * 128 + (((2 * kk + t // 2) ^ (lane // 4)) << 4)
                        addr += (lane % 4) * 4
                        r = row + 8 * (t % 2)
                        col = 16 * kk + 8 * (t // 2) + 2 * (lane % 4)
                        want = r * 128 + (((col // 8) ^ (r % 8)) << 4) + (col % 8) * 2
                        assert addr == want
                        seen.add(addr)
    assert len(seen) == 128 * 64 // 2  # every bf16 pair of the 128 x 64 tile written once


# ---------------------------------------------------- index math of the split layout (d256)
def _steps_split(sq: int, sk: int, n_block: int, causal: bool) -> list[int]:
    """The query blocks the split kernel visits for its 64-key block n_block (one head)."""
    m_first = max(0, n_block * 64 - (sk - sq)) // 64 if causal else 0
    return list(range(m_first, -(-sq // 64)))


def _edge_split(sq: int, sk: int, kw0: int, qw0: int, causal: bool) -> bool:
    """The split kernel's edge test for warpgroup tile (64 keys kw0 .., 32 queries qw0 ..)."""
    return kw0 + 64 > sk or qw0 + 32 > sq or (causal and kw0 + 63 > qw0 + sk - sq)


@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 1), (1, 17), (127, 1000), (1000, 127), (300, 100),
                                    (4097, 4097), (64, 128), (128, 64), (200, 333)])  # fmt: skip
@pytest.mark.parametrize("causal", [True, False])
def test_split_steps_cover_every_kept_pair_and_skip_only_full_tiles(sq, sk, causal):
    """Head dim 256: 64-key CTAs, each warpgroup's S^T tile is 64 keys x 32 queries
    (queries m0 + 32 cg ..); kept pairs all visited, non-edge tiles all kept."""
    import numpy as np

    qi = np.arange(sq)[:, None]
    ki = np.arange(sk)[None, :]
    keep = (ki <= qi + sk - sq) if causal else np.ones((sq, sk), bool)
    covered = np.zeros((sq, sk), bool)
    for n_block in range(-(-sk // 64)):
        n0 = n_block * 64
        for mb in _steps_split(sq, sk, n_block, causal):
            for cg in range(2):
                qw0 = mb * 64 + 32 * cg
                covered[qw0 : qw0 + 32, n0 : n0 + 64] = True
                if not _edge_split(sq, sk, n0, qw0, causal):
                    assert qw0 + 32 <= sq and n0 + 64 <= sk
                    assert keep[qw0 : qw0 + 32, n0 : n0 + 64].all(), (n_block, mb, cg)
        if causal:  # the skipped query blocks see none of the keys
            first = _steps_split(sq, sk, n_block, causal)
            m_first = first[0] if first else -(-sq // 64)
            assert not keep[: m_first * 64, n0 : n0 + 64].any()
    assert not (keep & ~covered).any()


def _swizzled(row: int, col: int) -> int:
    """Byte of element (row, col) of a 64-column elem_t tile in TMA's 128-byte swizzle."""
    return row * 128 + (((col // 8) ^ (row % 8)) << 4) + (col % 8) * 2


def test_split_p_and_ds_fragments_and_stores():
    """p_tile packs acc_s[4j + 2r + e] into p_frag[j / 2][2 (j % 2) + r] and dS^T packs
    acc_dp[8 kk + 2 t + e] into ds_frag[kk][t]: the same element; the kernel stores
    frag[kk][t] of (warpgroup cg, warp w, lane l) at (row 16 w + l / 4 + 8 (t % 2), chunk
    cg * 4 + 2 kk + t / 2); that must be element (key, query 32 cg + 8 j + 2 (l % 4)) of
    P^T / dS^T in the swizzled layout, both warpgroups' halves filling the 64 x 64 tile."""
    for j in range(4):
        for r in range(2):
            kk, t = j // 2, 2 * (j % 2) + r
            assert 8 * kk + 2 * t == 4 * j + 2 * r  # ds_frag[kk][t] holds acc_dp[4j + 2r (+1)]
    seen = set()
    for cg in range(2):
        for w in range(4):
            for lane in range(32):
                for kk in range(2):
                    for t in range(4):
                        row = w * 16 + lane // 4
                        chunk = cg * 4 + 2 * kk + t // 2
                        off = (
                            (row + 8 * (t % 2)) * 128
                            + ((chunk ^ (lane // 4)) << 4)
                            + (lane % 4) * 4
                        )
                        j, r = 2 * kk + t // 2, t % 2
                        key, q = w * 16 + lane // 4 + 8 * r, 32 * cg + 8 * j + 2 * (lane % 4)
                        assert off == _swizzled(key, q), (cg, w, lane, kk, t)
                        assert off not in seen
                        seen.add(off)
    assert len(seen) == 64 * 64 // 2


def test_split_outputs_have_one_owner():
    """dq_accum reductions (4 columns each, 16-byte aligned) and the dK/dV stores (2 columns)
    of the two warpgroups cover the 64 x 256 tile exactly once: warpgroup cg owns columns
    128 cg .. 128 cg + 127."""
    dq, dkv = {}, {}
    for cg in range(2):
        for w in range(4):
            for lane in range(32):
                for j in range(16):
                    row = w * 16 + lane // 4 + (lane & 1) * 8
                    col0 = cg * 128 + (lane % 4 // 2) * 4 + 8 * j
                    assert col0 % 4 == 0 and cg * 128 <= col0 < cg * 128 + 128
                    for c in range(4):
                        dq[(row, col0 + c)] = dq.get((row, col0 + c), 0) + 1
                    for r in range(2):
                        key = w * 16 + lane // 4 + 8 * r
                        for e in range(2):
                            col = cg * 128 + 8 * j + 2 * (lane % 4) + e
                            dkv[(key, col)] = dkv.get((key, col), 0) + 1
    full = {(r, c): 1 for r in range(64) for c in range(256)}
    assert dq == full and dkv == full


def fake_builds(monkeypatch, spill_bytes, serialized=lambda plan: ()):
    """Replace the compiler under families/build.py: each unit \"compiles\" to a report of
    ``spill_bytes(plan)`` spilled bytes and ``serialized(plan)`` serialized kernels; returns
    the list of the plans tried, in order."""
    import types

    from flashgen.families import build as family_build

    tried = []

    def fake_build(src, plan):
        tried.append(plan)
        report = types.SimpleNamespace(spill_bytes=spill_bytes(plan),
                                       wgmma_serialized=serialized(plan))  # fmt: skip
        return "x.cubin", report

    monkeypatch.setattr(family_build.cache, "get_or_build", fake_build)
    return tried


def test_spilling_hopper_units_fall_back_to_the_fa2_kernels(monkeypatch):
    """family_build.build_backward(hopper=True): the Hopper unit, then (it spilling) the
    FA2-class unit that ``atomic_dq`` selects."""
    from flashgen.families import build as family_build

    plans = fake_builds(monkeypatch, lambda p: 8 if p.template == "sm_90/bwd.cu.j2" else 0)
    plan, _, report = family_build.build_backward(shipped("causal_d128"), "sm_90", hopper=True)
    tried = [p.template for p in plans]
    # the 80-query unit, then the 64-query one (families/build.py's candidates), then FA2-class
    assert tried[:3] == ["sm_90/bwd.cu.j2", "sm_90/bwd.cu.j2", "sm_80/bwd.cu.j2"]
    assert plan.dkdv.template == "sm_80/bwd.cu.j2" and not plan.atomic_dq
    assert report.spill_bytes == 0
    plan, _, _ = family_build.build_backward(
        shipped("causal_d128"), "sm_90", atomic_dq=True, hopper=True
    )
    assert plan.dkdv.template == "sm_80/bwd.cu.j2" and plan.atomic_dq


def test_serialized_hopper_units_fall_back_like_spilling_ones(monkeypatch):
    """family_build.build_backward(hopper=True) treats ptxas' wgmma serialization like a spill (as
    build_forward does; ``flashgen build`` fails such a unit): the FA2-class unit runs."""
    from flashgen.families import build as family_build

    plans = fake_builds(
        monkeypatch, lambda p: 0,
        lambda p: (p.kernel_name,) if p.template == "sm_90/bwd.cu.j2" else (),
    )  # fmt: skip
    plan, _, report = family_build.build_backward(shipped("causal_d128"), "sm_90", hopper=True)
    tried = [p.template for p in plans]
    assert tried[:3] == ["sm_90/bwd.cu.j2", "sm_90/bwd.cu.j2", "sm_80/bwd.cu.j2"]
    assert plan.dkdv.template == "sm_80/bwd.cu.j2"
    assert not report.wgmma_serialized


@pytest.mark.parametrize("spills", [True, False])
def test_hopper_path_that_falls_back_warns(monkeypatch, spills):
    """backward.kernels on the "hopper" path: when family_build.build_backward returns the
    FA2-class unit (every Hopper variant spilled), one RuntimeWarning names the spec and
    what runs instead; a Hopper unit warns nothing.  Fakes for the GPU and the compiler."""
    import warnings

    import torch
    from plan_helpers import plan_backward

    from flashgen.families import build as family_build
    from flashgen.ops.op import build_op
    from flashgen.ops.prefill import backward as op_mod
    from flashgen.runtime import launch as runtime

    spec = dataclasses.replace(shipped("causal_d128"), name=f"hb_fallback_{spills}".lower())
    plan = plan_backward(spec, "sm_90") if spills else plan_hopper_backward(spec, "sm_90")
    monkeypatch.setattr(family_build, "build_backward", lambda *a, **k: (plan, "unit.cubin", None))
    monkeypatch.setattr(runtime, "load", lambda cubin, kp, index: kp.kernel_name)
    monkeypatch.setattr(op_mod, "target_for_device", lambda spec, device: "sm_90")
    bwd = build_op(spec).backward
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hit = bwd.kernels(torch.device("cuda", 0), path="hopper")
        assert bwd.kernels(torch.device("cuda", 0), path="hopper") is hit  # cached: once
    assert hit[0] is plan
    msgs = [str(w.message) for w in caught if w.category is RuntimeWarning]
    if spills:
        assert len(msgs) == 1 and f"'{spec.name}'" in msgs[0] and "FA2-class" in msgs[0]
        assert "deterministic" in msgs[0]
    else:
        assert msgs == []


# ------------------------------------------ head dim 64 with 128-query steps (d64_block_m)
D64_128 = DEFAULT.replace_path("hopper_bwd.d64_block_m", 128)


def at_d64(name: str) -> ir.Spec:
    """Shipped spec ``name`` at head_dim 64 (itself when it is one)."""
    text = (REPO / "specs" / f"{name}.yaml").read_text()
    if "head_dim: 64" in text:
        return shipped(name)
    lines = [
        "head_dim: 64" if ln.startswith("head_dim:") else f"name: {name}_d64"
        if ln.startswith("name:") else ln
        for ln in text.splitlines()
    ]  # fmt: skip
    return loads_spec("\n".join(lines) + "\n", f"<{name}_d64>")


@pytest.mark.parametrize("value", [32, 96, 256, 128.0, True, "128"])
def test_d64_block_m_takes_64_or_128(value):
    from flashgen.families.hopper_bwd import Options

    with pytest.raises(ValueError, match=r"Options.hopper_bwd.d64_block_m="):
        Options(d64_block_m=value)


def test_d64_block_m128_plan():
    """128-query steps at head_dim 64: the Q / dO boxes, the tiles the host sizes dq_sem with
    and the shared memory follow; head_dim 128 and 256 ignore the option."""
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    plan = reg_plan(small(64, "bf16", True), "sm_90", D64_128)
    ctx = plan.dkdv.context
    assert ctx["block_m"] == 128 and ctx["block_n"] == 128 and ctx["dq_rows_split"]
    assert plan.tiles.dkdv_block_m == 128 and plan.tiles.dkdv_block_n == 128
    assert [m.box_rows for m in plan.dkdv.tma] == [128, 128, 128, 128, 64]
    smem = 1024 + 2 * 128 * 64 * 2 + 4 * 128 * 64 * 2 + 2 * 128 * 128 * 2 + 2 * 64 * 64 * 4
    smem += 4 * 128 * 4 + 24
    assert plan.dkdv.smem_bytes == smem <= HOPPER_SMEM_LIMIT
    assert "DQ_SPLIT_ROWS = true" in render(plan.unit)
    for d, bm in ((128, DEFAULT.hopper_bwd.d128_block_m), (256, 64)):
        other = reg_plan(small(d, "bf16", True), "sm_90", D64_128)
        assert other.dkdv.context["block_m"] == bm and not other.dkdv.context["dq_rows_split"]
    d64_64 = DEFAULT.replace_path("hopper_bwd.d64_block_m", 64)
    assert reg_plan(small(64, "bf16", True), "sm_90", d64_64).dkdv.context["block_m"] == 64
    d64_128 = DEFAULT.replace_path("hopper_bwd.d64_block_m", 128)
    assert reg_plan(small(64, "bf16", True), "sm_90", d64_128).dkdv.context["block_m"] == 128


D64_SPECS = ("gpt2_d64", "alibi_learned", "gpt_oss_sink", "mistral_swa", "chunked_local",
             "prefix_lm", "gemma2_softcap")  # fmt: skip


@pytest.mark.parametrize("name", D64_SPECS)
def test_d64_block_m128_compiles_without_spills(requires_nvcc, name):
    """The consumers hold S^T and dP^T of 128 queries (64 + 64 fp32) beside dK, dV (32 + 32):
    P^T is packed into frag_p (32) as acc_s dies, and dS^T reads it back, so masks (64 keep
    bits) and score_mods fit in 240 registers; five GEMMs of 8 k-steps each but S^T, dP^T (4)."""
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    plan = reg_plan(at_d64(name), "sm_90", D64_128)
    _, report = cache.get_or_build(render(plan.unit), plan.unit)
    assert report.spill_bytes == 0 and not report.wgmma_serialized, report
    code = sass(plan.unit)
    assert wgmmas(code) == 2 * 4 + 3 * 8
    assert wgmmas(code, "64x128x16") == 8 and "BPT.TRAP" not in code


def test_d64_block_m128_computes_ds_from_the_packed_p():
    """128-query steps keep P^T in registers as dV's A operand (frag_p), and dS^T reads it back
    from there: acc_s (64 fp32) dies in the P^T pass.  A score_mod whose derivative is not 1
    packs P^T * d score_mod / d score too (frag_pg); one whose derivative is 1 does not; a
    dparam unit computes dS^T in the P^T pass; 64-query steps and head_dim 128 keep acc_s."""
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    def src(spec, opts=D64_128, **kw):
        return render(reg_plan(spec, "sm_90", opts, **kw).unit)

    plain = src(small(64, "bf16", True))
    assert "fg::unpack16(frag_p[j / 2][2 * (j % 2) + r], e) * (acc_dp[i] - ds)" in plain
    assert "frag_pg" not in plain and "sPTi" not in plain and "wgmma_st_n" not in plain
    capped = src(at_d64("gemma2_softcap"))
    assert "fg::unpack16(frag_pg[j / 2][2 * (j % 2) + r], e) * (acc_dp[i] - ds)" in capped
    assert "frag_pg[j / 2][2 * (j % 2) + r] = Mma::pack(acc_s[4 * j + 2 * r]" in capped
    assert "frag_pg" not in src(at_d64("alibi_learned"))
    dparam = src(at_d64("alibi_learned"), param_grads=("slopes",))
    assert "fg::unpack16(" not in dparam and "frag_pg" not in dparam
    d64_64 = DEFAULT.replace_path("hopper_bwd.d64_block_m", 64)
    d128_64 = DEFAULT.replace_path("hopper_bwd.d128_block_m", 64)
    for other in (src(small(64, "bf16", True), d64_64), src(small(128, "bf16", True), d128_64)):
        assert "unpack16" not in other and "acc_dp[i] = acc_s[i] * (acc_dp[i] - ds);" in other


def test_specs_that_spill_at_128_query_steps(requires_nvcc):
    """The GPU tests' SPILL_AT_128 (tests/gpu/test_hopper_bwd_gpu.py): t5_bias's table read per
    element (``hopper_bwd.diag_terms=False``) spills with 128-query steps, so such an op runs 64
    (the next test); staged per diagonal (the default) it does not
    (tests/unit/test_diag_terms.py)."""
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    per_element = D64_128.replace_path("hopper_bwd.diag_terms", False)
    plan = reg_plan(shipped("t5_bias"), "sm_90", per_element)
    _, report = cache.get_or_build(render(plan.unit), plan.unit)
    assert report.spill_bytes > 0


def test_d64_block_m128_that_spills_falls_back_to_64_query_steps(monkeypatch):
    """family_build.build_backward(hopper=True) with d64_block_m=128: a spilling unit (t5_bias's
    table read spills at 128) is rebuilt with 64-query steps before the FA2-class kernels."""
    from flashgen.families import build as family_build

    plans = fake_builds(monkeypatch, lambda p: 8 if p.context["block_m"] == 128 else 0)
    plan, _, _ = family_build.build_backward(
        shipped("t5_bias"), "sm_90", hopper=True, options=D64_128
    )
    tried = [(p.template, p.context["block_m"]) for p in plans]
    assert tried == [("sm_90/bwd.cu.j2", 128), ("sm_90/bwd.cu.j2", 64)]
    assert plan.dkdv.template == "sm_90/bwd.cu.j2" and plan.dkdv.context["block_m"] == 64


def test_d128_80_query_unit_that_spills_falls_back_to_64_query_steps(monkeypatch):
    """family_build.build_backward(hopper=True) at head_dim 128: a unit that spills with the
    default 80-query steps (a table-reading score_mod with no mask, such as t5_bias at 128) is
    rebuilt with 64-query steps before the FA2-class kernels."""
    from flashgen.families import build as family_build

    plans = fake_builds(monkeypatch, lambda p: 36 if p.context["block_m"] == 80 else 0)
    t5_128 = loads_spec(
        (REPO / "specs" / "t5_bias.yaml").read_text().replace("head_dim: 64", "head_dim: 128")
        .replace("name: t5_bias", "name: t5_bias_d128"), "<t5_bias_d128>",
    )  # fmt: skip
    plan, _, _ = family_build.build_backward(t5_128, "sm_90", hopper=True)
    tried = [(p.template, p.context["block_m"]) for p in plans]
    assert tried == [("sm_90/bwd.cu.j2", 80), ("sm_90/bwd.cu.j2", 64)]
    assert plan.dkdv.template == "sm_90/bwd.cu.j2" and plan.dkdv.context["block_m"] == 64


def test_d64_block_m128_ds_stores_land_in_two_query_boxes():
    """dS^T (stsm_frag_swizzled: ds_frag[kk][t]) of warpgroup cg, warp w, lane l into sDS of
    128 key rows x 128 queries: query column c lives in box c // 64 (SDS_BOX_BYTES = 128 rows
    x 128 bytes apart), row r at 128 r, its 16-byte chunk swizzled (chunk ^ r % 8).  The
    stmatrix stores put every element at that address, each bf16 pair once.  (P^T stays in
    registers.)"""
    box = 128 * 128

    def want(r, c):
        return (c // 64) * box + r * 128 + ((((c % 64) // 8) ^ (r % 8)) << 4) + (c % 8) * 2

    def stmatrix(row0, kk, t, lane):  # stsm_frag_swizzled(..., chunk0 = 0, box_bytes = box)
        def row_addr(ln):  # the address lane ln hands stmatrix
            tt, r = ln // 8, ln % 8
            chunk = 2 * kk + tt // 2
            return (row0 + 8 * (tt % 2) + r) * 128 + (chunk // 8) * box + (((chunk % 8) ^ r) << 4)

        return row_addr(8 * t + lane // 4) + 4 * (lane % 4)

    ds_seen = set()
    for cg in range(2):
        for w in range(4):
            for lane in range(32):
                row0 = cg * 64 + w * 16
                for kk in range(8):
                    for t in range(4):
                        a = stmatrix(row0, kk, t, lane)
                        col = 16 * kk + 8 * (t // 2) + 2 * (lane % 4)
                        assert a == want(row0 + lane // 4 + 8 * (t % 2), col)
                        ds_seen.add(a)
    assert len(ds_seen) == 128 * 128 // 2


def test_kernels_doc_says_d64_128_query_steps_keep_p_in_registers():
    """docs/kernels.md's bullet on head_dim 64 with 128-query steps said P^T goes to sDS
    (``fg::st_pair_swizzled`` from p_tile) and dS^T overwrites it once dV has landed, the
    layout before P^T stayed in frag_p; the render has no P^T store and no such wait."""
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    src = render(reg_plan(small(64, "bf16", True), "sm_90", D64_128).unit)
    assert "st_pair_swizzled<ELEM_BYTES>(sPTi" not in src and "wgmma_st_n64(acc_dv" not in src
    doc = (REPO / "docs" / "kernels.md").read_text()
    start = doc.index("- d64 with 128-query steps (`dq_rows_split`)")
    bullet = doc[start : doc.index("\n- ", start + 1)]
    assert "frag_p" in bullet, bullet
    for stale in ("st_pair_swizzled", "overwrites the same rows", "reads it as a K-major A"):
        assert stale not in bullet, stale


def test_wgmma_descriptors_are_base_plus_offset():
    """The consumers build every wgmma descriptor with gdesc (sK's masked start-address field
    plus the tile's offset), take the warpgroup index from a shuffle, read dsum as column
    pairs (lse by element) and store P^T / dS^T by stmatrix, at every head dim (128: 80-query
    steps too, whose dS goes out transposed by stsm_x4_trans)."""
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    m64 = DEFAULT.replace_path("hopper_bwd.d128_block_m", 64)
    m80 = DEFAULT.replace_path("hopper_bwd.d128_block_m", 80)
    for d, opts in ((64, DEFAULT), (128, m64), (128, m80), (256, DEFAULT)):
        src = render(reg_plan(small(d, "bf16", True), "sm_90", opts).unit)
        loop = src.split("auto gdesc = [desc_base, sK]")[1]
        assert "fg::gmma_desc(" not in loop and "gdesc(" in loop
        assert "const int cg = __shfl_sync(0xffffffffu, (int)threadIdx.x / 128, 0);" in loop
        assert "lse_s[qc] * LOG2E" in loop and "fg::ld_shared_pair(dsum_s + " in loop
        assert "st_frag_swizzled" not in src and "st_pair_swizzled" not in src
        if opts is not m80:
            assert "fg::stsm_frag_swizzled(sDSi" in loop


def test_d128_block_m80_plans_only_for_unmasked_or_causal_unordered_specs():
    """``hopper_bwd.d128_block_m=80``: a spec with no mask or a causal one at head_dim 128 gets
    80-query steps, an 80-row dQ box and its transposed-dS code within the 227 KiB a block may
    take; without ``masked_80``, another mask, param gradients, the ordered kernel or another
    head dim keep 64."""
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    m80 = DEFAULT.with_values({"hopper_bwd.d128_block_m": 80, "hopper_bwd.masked_80": False})
    plan = reg_plan(small(128, "bf16", False), "sm_90", m80)
    ctx = plan.dkdv.context
    assert (ctx.block_m, ctx.dq_swap, ctx.ds_from_frag) == (80, True, True)
    assert plan.dkdv.smem_bytes <= HOPPER_SMEM_LIMIT
    assert [m.box_rows for m in plan.dkdv.tma if m.name == "tma_dq"] == [80]
    src = render(plan.unit)
    assert src.count("fg::stsm_x4_trans(") == 1 and "fg::wgmma_ts_n80(acc_dq" in src
    assert "static_assert(BLOCK_N == 128 && BLOCK_M == 80" in src
    assert reg_plan(small(128, "bf16", True), "sm_90", m80).dkdv.context.dq_swap  # causal
    for spec, kw in ((shipped("mistral_swa"), {}), (small(64, "bf16", False), {}),
                     (small(128, "bf16", False), {"ordered_dq": True})):  # fmt: skip
        assert not reg_plan(spec, "sm_90", m80, **kw).dkdv.context.dq_swap
    m64 = DEFAULT.replace_path("hopper_bwd.d128_block_m", 64)
    assert "stsm_x4_trans" not in render(reg_plan(small(128, "bf16", False), "sm_90", m64).unit)
    # hopper_bwd.ordered_80: the ordered kernel with 80-query steps, its semaphores per 80 rows
    o80 = m80.replace_path("hopper_bwd.ordered_80", True)
    ordered = reg_plan(small(128, "bf16", True), "sm_90", o80, ordered_dq=True)
    assert (ordered.dkdv.context.block_m, ordered.dkdv.context.dq_swap) == (80, True)
    src = render(ordered.unit)
    assert "((seqlen_q + BLOCK_M - 1) / BLOCK_M) + m0 / BLOCK_M" in src
    assert "fg::st_release_gpu(sem, n0 / BLOCK_N + 1);" in src


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_d128_block_m80_compiles_without_spills(requires_nvcc, dtype):
    """Five GEMMs: S^T, dP^T and dQ^T m64n80 (8 k-steps each), dV and dK m64n128 (5)."""
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    m80 = DEFAULT.replace_path("hopper_bwd.d128_block_m", 80)
    plan = reg_plan(small(128, dtype, False), "sm_90", m80)
    _, report = cache.get_or_build(render(plan.unit), plan.unit)
    assert report.spill_bytes == 0 and not report.wgmma_serialized, report
    code = sass(plan.unit)
    assert wgmmas(code, "64x80x16") == 24 and wgmmas(code, "64x128x16") == 10



def test_d128_block_m80_ds_and_dq_stores_land_where_the_wgmmas_read():
    """Host emulation of the 80-query layout's two stores (templates/sm_90/bwd.cu.j2, DQ_SWAP),
    against the 128-byte swizzle's logical positions:
    - ``fg::stsm_x4_trans`` of ds_frag: register t of lane l holds dS^T at key
      64 cg + 16 w + l / 4 + 8 (t % 2), queries 8 (2 kk + t / 2) + 2 (l % 4) + {0, 1}; the
      transposed 8x8 matrix t stores source column c at the row lane 8 t + c addresses, source
      row l / 4 at byte 2 (l / 4) of it.  Every element of sDS (2 key boxes x 80 query rows x
      64 keys) is written once, at (box cg, row q, column key % 64): where dQ^T's K-major B
      and nothing else reads it.
    - dQ^T's fragment (head-dim row warp * 16 + l / 4 + 8 r, query column 8 j + 2 (l % 4) + e)
      to sDQ: once each, at (box d / 32, row q, column d % 32) of the warpgroup's two 80-row
      boxes, the tma_dq box the writer reduces."""
    rows, sds_box, sdq_box = 80, 80 * 128, 80 * 128

    def swz(box, row, col_bytes):  # the 128-byte swizzle: 16-byte chunk ^ (row % 8)
        return box + row * 128 + ((((col_bytes // 16) ^ (row % 8)) & 7) << 4) + col_bytes % 16

    ds_seen = {}
    for cg in range(2):
        for w in range(4):
            addr = {}
            for lane in range(32):  # the template's address expression, per lane
                t, q = lane // 8, None
                for kk in range(rows // 16):
                    q = 16 * kk + 8 * (t // 2) + lane % 8
                    addr[(kk, lane)] = cg * sds_box + q * 128 + (((2 * w + t % 2) ^ (q % 8)) << 4)
            for kk in range(rows // 16):
                for t in range(4):
                    for lane in range(32):
                        for e in range(2):
                            key = 64 * cg + 16 * w + lane // 4 + 8 * (t % 2)
                            q = 8 * (2 * kk + t // 2) + 2 * (lane % 4) + e
                            src_row, src_col = lane // 4, 2 * (lane % 4) + e
                            a = addr[(kk, 8 * t + src_col)] + 2 * src_row
                            assert a == swz(cg * sds_box, q, 2 * (key % 64)), (cg, w, kk, t)
                            assert a not in ds_seen
                            ds_seen[a] = (key, q)
    assert len(ds_seen) == 2 * rows * 64

    dq_seen = set()
    for w in range(4):
        for lane in range(32):
            for r in range(2):
                dl = w * 16 + lane // 4 + 8 * r
                col = (dl // 32) * sdq_box + (dl % 4) * 4
                for j in range(rows // 8):
                    for e in range(2):
                        q = 8 * j + 2 * (lane % 4) + e
                        a = col + q * 128 + ((((dl % 32) // 4) ^ (q % 8)) << 4)
                        assert a == swz((dl // 32) * sdq_box, q, 4 * (dl % 32))
                        assert a not in dq_seen
                        dq_seen.add(a)
    assert len(dq_seen) == 2 * rows * 32


@pytest.mark.parametrize(
    ("kk_n", "chunk0", "box_bytes"),
    [(4, 0, 0), (8, 0, 128 * 128), (2, 0, 0), (2, 4, 0)],
    ids=["d128", "d64_128_queries", "d256_cg0", "d256_cg1"],
)
def test_stmatrix_fragment_stores_match_the_per_register_stores(kk_n, chunk0, box_bytes):
    """Host emulation of templates/common/sm90_bwd.cuh: ``stsm_frag_swizzled`` (one stmatrix
    .x4 per k step; lane 8 t + r gives row r of matrix t, and register t of lane l holds that
    matrix's row l / 4, bytes 4 (l % 4) + {0..3}) puts every element of a warp's P^T / dS^T
    fragment where the fragment layout says (register t of lane l: row row0 + l / 4 + 8 (t %
    2), the swizzled chunk chunk0 + 2 kk + t / 2, bytes 4 (l % 4) in it), for each layout's k
    steps, chunk offset (the d256 split: 4 per warpgroup) and box continuation (64 key rows x
    128 queries at head_dim 64)."""
    row0 = 16 * 3  # warp 3's first row (a multiple of 8)

    def per_register(kk, t, lane):
        c = 2 * kk + t // 2
        row = row0 + lane // 4 + 8 * (t % 2)
        box, chunk = (c // 8) * box_bytes, chunk0 + c % 8
        return box + row * 128 + ((chunk ^ (lane // 4)) << 4) + (lane % 4) * 4

    def stmatrix(kk, t, lane):
        def row_addr(ln):  # the address lane ln hands stmatrix
            tt, r = ln // 8, ln % 8
            chunk = chunk0 + 2 * kk + tt // 2
            row = row0 + 8 * (tt % 2) + r
            return row * 128 + (chunk // 8) * box_bytes + (((chunk % 8) ^ r) << 4)

        return row_addr(8 * t + lane // 4) + 4 * (lane % 4)

    seen = set()
    for kk in range(kk_n):
        for t in range(4):
            for lane in range(32):
                a = stmatrix(kk, t, lane)
                assert a == per_register(kk, t, lane), (kk, t, lane)
                seen.add(a)
    assert len(seen) == kk_n * 4 * 32



def test_ldmatrix_reads_back_what_stmatrix_stored():
    """Host emulation of ``fg::ldsm_frag_swizzled`` (templates/common/sm90_bwd.cuh; ldmatrix
    .x4: lane 8 t + r gives row r of matrix t, and register t of lane l gets that matrix's row
    l / 4, bytes 4 (l % 4) + {0..3}): register t of frag[kk] of lane l comes from where
    ``stsm_frag_swizzled`` put that register (the fragment layout's row 16 w + l / 4 + 8 (t %
    2), swizzled chunk 2 kk + t / 2), so warpgroup 1's thread gets the P^T element its dP^T
    accumulator holds (d256_sdp_warpgroups: both warpgroups' m64n64 tiles have one layout)."""
    row0 = 16 * 2

    def fragment(kk, t, lane):
        row = row0 + lane // 4 + 8 * (t % 2)
        return row * 128 + (((2 * kk + t // 2) ^ (lane // 4)) << 4) + (lane % 4) * 4

    def ldmatrix(kk, t, lane):
        def row_addr(ln):  # the address lane ln hands ldmatrix (as ldsm_frag_swizzled computes it)
            tt, r = ln // 8, ln % 8
            chunk = 2 * kk + tt // 2
            return (row0 + 8 * (tt % 2) + r) * 128 + (((chunk % 8) ^ r) << 4)

        return row_addr(8 * t + lane // 4) + 4 * (lane % 4)

    for kk in range(4):  # 64 query columns: four k16 steps
        for t in range(4):
            for lane in range(32):
                assert ldmatrix(kk, t, lane) == fragment(kk, t, lane), (kk, t, lane)
    src = (REPO / "templates" / "common" / "sm90_bwd.cuh").read_text()
    ld = src.split("void ldsm_frag_swizzled(")[1].split("\n}\n")[0]
    assert "const uint32_t row_addr = base + (row0 + 8 * (t % 2) + r) * 128;" in ld
    assert "const int chunk = chunk0 + 2 * kk + t / 2;" in ld
    assert '"r"(row_addr + (((chunk % 8) ^ r) << 4))' in ld


def test_shared_memory_over_the_limit_is_refused_at_plan_time(monkeypatch):
    """The plan counts the static cta_info array as ptxas does (1 KiB) beside the dynamic
    layout: the deleted d256_ps_buffers=2 was 24 bytes over 227 KiB that way and failed to
    launch with CUDA_ERROR_INVALID_VALUE.  The 80-query layout keeps the coordinates in the
    dynamic memory, so it counts none."""
    from flashgen.families import hopper_bwd

    spec, m80 = small(128, "bf16", False), hopper_bwd.Options(d128_block_m=80)
    m64 = hopper_bwd.Options(d128_block_m=64)
    dyn = hopper_bwd.plan(spec, "sm_90", m64).dkdv.smem_bytes
    dyn80 = hopper_bwd.plan(spec, "sm_90", m80).dkdv.smem_bytes
    monkeypatch.setattr(hopper_bwd, "HOPPER_SMEM_LIMIT", dyn + 1023)
    with pytest.raises(ValueError, match=r"bytes of shared memory \(static included\)"):
        hopper_bwd.plan(spec, "sm_90", m64)
    monkeypatch.setattr(hopper_bwd, "HOPPER_SMEM_LIMIT", dyn80)
    assert hopper_bwd.plan(spec, "sm_90", m80).dkdv.context.dq_swap


# ---------------------------------------- part of P^T's exponentials on the FMA pipe (exp2_poly)
@pytest.mark.parametrize("value", [-1, 17, 4.0, True, "4"])
def test_exp2_poly_takes_sixteenths_only(value):
    from flashgen.families.hopper_bwd import Options

    assert Options().exp2_poly == 0 and Options(exp2_poly=16).exp2_poly == 16
    with pytest.raises(ValueError, match=r"Options.hopper_bwd.exp2_poly="):
        Options(exp2_poly=value)
    with pytest.raises(ValueError, match=r"hopper_bwd.exp2_poly=4 with Options.exact_softmax"):
        DEFAULT.with_values({"hopper_bwd.exp2_poly": 4, "exact_softmax": True})


def test_exp2_poly_puts_its_share_of_full_steps_on_the_fma_pipe():
    """Sixteenths of each thread's QN / 8 query tiles, canonicalised as the forward's (values
    of one count render one source, a count of 0 the default one); the split exponential
    appears in the P^T pass of the steps that are not edges only (an edge's masked pairs may
    reach the exponential as inf or NaN before their selection)."""
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    default = render(reg_plan(small(64, "bf16", True), "sm_90", DEFAULT).unit)
    assert "exp2_poly" not in default and "EXP2_POLY" not in default
    for d, qn, value, canonical in ((64, 128, 4, 4), (64, 128, 5, 5), (128, 80, 4, 4),
                                    (128, 80, 1, 0), (256, 64, 3, 2)):  # fmt: skip
        opts = DEFAULT.replace_path("hopper_bwd.exp2_poly", value)
        plan = reg_plan(small(d, "bf16", True), "sm_90", opts)
        ctx = plan.dkdv.context
        assert (ctx["exp2_poly"], qn // 8 * value // 16) == (canonical, qn // 8 * canonical // 16)
        code = render(plan.unit)
        if not canonical:
            assert code == render(reg_plan(small(d, "bf16", True), "sm_90", DEFAULT).unit)
            continue
        assert f"constexpr int EXP2_POLY = {canonical};" in code
        split = code.count("fg::softmax_exp2_split<EXP2_POLY>(")
        approx = code.count("fg::exp2_approx(fmaf(acc_s[i], scale_log2, -lse_l2))")
        assert split == 1 and approx == 1, (split, approx)  # FULL steps' pass, edges' pass


@pytest.mark.parametrize("d", [64, 128])
def test_exp2_poly_compiles_without_spills(requires_nvcc, d):
    """A quarter of P^T's tiles by the polynomial (eight FMA-pipe instructions each) fit the
    consumers' 240 registers at head_dim 64 (128-query steps) and 128 (80-query steps), and
    take that share off the SFU."""
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    opts = DEFAULT.replace_path("hopper_bwd.exp2_poly", 4)
    plan = reg_plan(small(d, "bf16", False), "sm_90", opts)
    _, report = cache.get_or_build(render(plan.unit), plan.unit)
    assert report.spill_bytes == 0 and not report.wgmma_serialized, report
    base = reg_plan(small(d, "bf16", False), "sm_90", DEFAULT)
    ex2 = [sass(p.unit).count("MUFU.EX2") for p in (base, plan)]
    qn = plan.dkdv.context["block_m"]
    assert ex2[0] - ex2[1] == qn // 8 * 4 // 16 * 4, ex2  # per thread: 4 exponentials a tile


# ------------------------------------------- masks that read tensors (hopper_bwd.tensor_masks)
TENSOR_MASKS = DEFAULT.with_values(
    {"hopper_bwd.tensor_masks": True, "hopper_bwd.masked_80": False}
)  # 64-query steps at head_dim 128 (masked_80: test_masked_80_...)


def doc_mask(d: int) -> ir.Spec:
    """document_mask at head_dim ``d``."""
    text = (REPO / "specs" / "document_mask.yaml").read_text()
    text = text.replace("head_dim: 128", f"head_dim: {d}").replace(
        "name: document_mask", f"name: document_mask_d{d}"
    )
    return loads_spec(text, f"<document_mask_d{d}>")


def test_tensor_masks_is_an_option_on_by_default():
    """On (the default), a mask that reads tensors takes the Hopper backward with the
    block-table arguments; off, it keeps the FA2-class backward, and the plain specs' units
    do not change."""
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    spec = shipped("document_mask")
    off = DEFAULT.replace_path("hopper_bwd.tensor_masks", False)
    assert DEFAULT.hopper_bwd.tensor_masks
    assert backward_path(spec, "sm_90", False) == "hopper"
    assert backward_path(spec, "sm_90", False, off) == "deterministic"
    with pytest.raises(ValueError, match="hopper_bwd.tensor_masks"):
        reg_plan(spec, "sm_90", off)
    plan = reg_plan(spec, "sm_90", TENSOR_MASKS)
    ctx = plan.dkdv.context
    assert ctx["block_table"] and ctx["keep_expr"] == "(fg_row0 == fg_col0)"
    assert [a.name for a in plan.dkdv.args if a.name.startswith("blk_")] == [
        "blk_tab", "blk_sb", "blk_sh"
    ]  # fmt: skip
    src = render(plan.unit)
    assert "blk_tab, blk_sb, blk_sh, b, h, seqlen_k" in src
    # the hull: warp 0 scans the key block's table column (test_table_tile_classes_... below)
    assert "fg::table_hull_lane(blk_tab, blk_sb, blk_sh, b, h_kv * group, group, n_block" in src
    assert "m_first = __reduce_min_sync(0xffffffffu, hull.x)" in src
    plain = shipped("causal_d128")
    assert render(reg_plan(plain, "sm_90", TENSOR_MASKS).unit) == render(
        reg_plan(plain, "sm_90").unit
    )


@pytest.mark.parametrize("d", [64, 128, 256])
def test_tensor_mask_units_compile_without_spills(requires_nvcc, d):
    """The keep bits read doc_q / doc_kv once per query column and key row (reading them per
    pair, the 64-query head-dim-128 unit spilled 64 B; a loop not unrolled serialized its
    wgmmas)."""
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    plan = reg_plan(doc_mask(d), "sm_90", TENSOR_MASKS)
    _, report = cache.get_or_build(render(plan.unit), plan.unit)
    assert report.spill_bytes == 0 and not report.wgmma_serialized, report


TABLE_HULL_MAIN = r"""
#include <cstdio>
#include <vector>
int main() {
    int sq, sk;
    while (scanf("%d %d", &sq, &sk) == 2) {
        const int m_blocks = (sq + BM - 1) / BM, n_blocks = (sk + BN - 1) / BN;
        std::vector<unsigned char> tab(m_blocks * n_blocks);
        for (auto& c : tab) { int v; scanf("%d", &v); c = (unsigned char)v; }
        const unsigned char* blk_tab = tab.data();
        const long long blk_sb = 0, blk_sh = 0;
        const int b = 0, h = 0, seqlen_k = sk;
        for (int n_block = 0; n_block < n_blocks; ++n_block) {
            const int n0 = n_block * BN;
            // the kernel's hull: warp 0's lanes read the key block's table column, 32 query
            // blocks a step, then the warp's min / max (lanes run one after the other here)
            int m_first = m_blocks, m_end = 0;
            for (int lane = 0; lane < 32; ++lane) {
                const int2 part = fg::table_hull_lane(blk_tab, blk_sb, blk_sh, b, h, 1, n_block,
                                                      n_blocks, m_blocks, lane);
                m_first = part.x < m_first ? part.x : m_first;
                m_end = part.y > m_end ? part.y : m_end;
            }
            printf("%d %d", m_first, m_end);
            for (int m = m_first; m < m_end; ++m)  // each warpgroup's step tile (KW keys)
                for (int k0 = n0; k0 < n0 + BN; k0 += KW)
                    printf(" %d", fg_tile_class(m * BM, m * BM + BM - 1, k0, k0 + KW - 1,
                                                TILE_CLASS_ARGS));
            printf("\n");
        }
    }
    return 0;
}
"""


@pytest.mark.parametrize("d, m80", [(64, False), (128, False), (128, True), (256, False)])
def test_table_tile_classes_give_exact_hulls_and_full_steps(host_exe, d, m80):
    """The unit's tile classes over a block table built for its tiles (the brute-force table
    of the CPU path, as the pre-pass builds it on the GPU), on random documents: the hull (the
    kernel's warp scan of the key block's table column) is exactly the first and last query
    block with a kept pair per key block, and a step tile fg_tile_class calls FULL keeps every
    pair, EMPTY none."""
    import random

    import numpy as np
    import torch

    from flashgen.codegen.plan import TileConfig
    from flashgen.families.registry import plan_hopper_backward as reg_plan
    from flashgen.ops.prefill.blockmask import block_table_reference

    spec = doc_mask(d)
    options = TENSOR_MASKS.replace_path("hopper_bwd.masked_80", m80)
    ctx = reg_plan(spec, "sm_90", options).dkdv.context
    bm, bn = ctx["block_m"], ctx["block_n"]
    assert bm == (80 if m80 else {64: 128, 128: 64, 256: 64}[d])
    kw = 64  # a warpgroup's keys (head_dim 256: all of the CTA's 64)
    src = (REPO / "templates" / "common" / "masktiles.cuh").read_text()
    src += (REPO / "templates" / "common" / "table_class.cuh").read_text()
    src += ctx["tile_classifier"].replace("int64_t sb, int64_t sh", "long long sb, long long sh")
    src += f"#define BM {bm}\n#define BN {bn}\n#define KW {kw}\n"
    src += f"#define TILE_CLASS_ARGS {ctx['tile_class_args']}\n" + TABLE_HULL_MAIN
    exe = host_exe(src, f"table_hull_{d}_{bm}")
    rng = random.Random(d)
    cases, lines = [], []
    for sq, sk in ((1, 1), (17, 300), (300, 17), (1000, 1000), (777, 1290), (4097, 1000)):
        doc_q = sorted(rng.randrange(6) for _ in range(sq))
        doc_kv = sorted(rng.randrange(6) for _ in range(sk))
        params = {"doc_q": torch.tensor([doc_q], dtype=torch.int32),
                  "doc_kv": torch.tensor([doc_kv], dtype=torch.int32)}  # fmt: skip
        tab = block_table_reference(spec, TileConfig(bm, bn, 4), batch=1, heads_q=1,
                                    seqlen_q=sq, seqlen_k=sk, params=params)  # fmt: skip
        qi, ki = np.arange(sq)[:, None], np.arange(sk)[None, :]
        keep = (ki <= qi + sk - sq) & (np.array(doc_q)[:, None] == np.array(doc_kv)[None, :])
        cases.append((sq, sk, keep))
        lines.append(f"{sq} {sk} " + " ".join(str(int(c)) for c in tab[0, 0].flatten()))
    out = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True,
                         text=True, check=True).stdout.splitlines()  # fmt: skip
    rows = iter(out)
    for sq, sk, keep in cases:
        for n0 in range(0, sk, bn):
            m_first, m_end, *classes = map(int, next(rows).split())
            blocks = range(-(-sq // bm))
            live = [m for m in blocks if keep[m * bm : m * bm + bm, n0 : n0 + bn].any()]
            assert (m_first, m_end) == ((live[0], live[-1] + 1) if live else (-(-sq // bm), 0))
            tiles = [(m, k0) for m in range(m_first, m_end) for k0 in range(n0, n0 + bn, kw)]
            for (m, k0), c in zip(tiles, classes, strict=True):
                pairs = keep[m * bm : m * bm + bm, k0 : k0 + kw]  # (the in-range pairs)
                if c == 2:  # FULL: every pair kept (the kernel's edge test adds the bounds)
                    assert pairs.all(), (sq, sk, m, k0)
                if c == 0:
                    assert not pairs.any(), (sq, sk, m, k0)


# ---------------------------------------- 80-query steps for masked specs (masked_80)
#: (the window masks' step classifier on double ranges here: int_classifier's tests below)
MASKED_80 = DEFAULT.with_values(
    {"hopper_bwd.masked_80": True, "hopper_bwd.tensor_masks": True,
     "hopper_bwd.two_sided_masks": True, "hopper_bwd.int_classifier": False}
)  # fmt: skip


def test_masked_80_gives_masked_specs_80_query_steps_where_they_compile_clean(requires_nvcc):
    """``hopper_bwd.masked_80``: prefix_lm builds its head-dim-128 backward with 80-query steps
    spill-free (40 keep bits a thread, uint64); with the step classifier on double ranges
    chunked_local and mistral_swa (32 B), and document_mask with tensor_masks (8 B), spill
    with them and are built with 64, as the op does (build_backward's fallback); off, every
    masked spec takes 64."""
    from flashgen.families.build import build_backward
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    assert DEFAULT.hopper_bwd.masked_80
    off = MASKED_80.replace_path("hopper_bwd.masked_80", False)
    for name, want in (("prefix_lm", 80), ("document_mask", 64), ("chunked_local", 64),
                       ("mistral_swa", 64), ("spec_tree", 80)):  # fmt: skip
        spec = shipped(name)
        assert reg_plan(spec, "sm_90", off).dkdv.context["block_m"] == 64
        plan, _, report = build_backward(spec, "sm_90", hopper=True, options=MASKED_80)
        assert plan.wgmma and plan.dkdv.context["block_m"] == want, name
        assert report.spill_bytes == 0 and not report.wgmma_serialized, (name, report)
        if want == 80:
            assert "uint64_t keep_bits" in render(plan.unit)


# ------------------------- the tile classifier on 64-bit integer ranges (int_classifier)
def test_int_classifier_gives_the_window_masks_spill_free_80_query_steps(requires_nvcc):
    """``hopper_bwd.int_classifier`` (off by default) with ``masked_80``: chunked_local and
    mistral_swa, whose double-range step classifier spilled 32 B at 80-query steps, build
    them spill-free; a mask that reads tensors (document_mask) keeps the double ranges, and
    the option off renders units without ``masktiles_int.cuh``."""
    from flashgen.families.build import build_backward
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    assert not DEFAULT.hopper_bwd.int_classifier and DEFAULT.hopper_bwd.masked_80
    on = DEFAULT.replace_path("hopper_bwd.int_classifier", True)
    off = DEFAULT
    for name in ("chunked_local", "mistral_swa"):
        spec = shipped(name)
        assert "fg::ivi" not in render(reg_plan(spec, "sm_90", off).unit)
        plan, _, report = build_backward(spec, "sm_90", hopper=True, options=on)
        assert plan.dkdv.context["int_classifier"] and "fg::ivi::range(" in render(plan.unit)
        assert plan.dkdv.context["block_m"] == 80, name
        assert report.spill_bytes == 0 and not report.wgmma_serialized, (name, report)
    doc = reg_plan(shipped("document_mask"), "sm_90", on)
    assert not doc.dkdv.context["int_classifier"] and "fg::ivi" not in render(doc.unit)


# ------------------------- the edge keep bits of a tensor mask, on the host (tensor_masks)
#: Masks that read tensors (name, mask, params, GQA group): one-sided reads by b, by h (a
#: column term and a row term), by h_kv, and with a residual that reads both indices (an
#: index difference, or a causal that is not split off).
KEEP_MASKS = [
    ("kb_doc", "causal && doc_q[b, q_idx] == doc_kv[b, kv_idx]",
     "doc_q: {type: i32, shape: [batch, seqlen_q]}, doc_kv: {type: i32, shape: [batch, seqlen_k]}",
     1),
    ("kb_sink", "doc_q[b, q_idx] == doc_kv[b, kv_idx] && kv_idx >= sink[h]",
     "doc_q: {type: i32, shape: [batch, seqlen_q]}, doc_kv: {type: i32, shape: [batch, seqlen_k]}, "
     "sink: {type: i32, shape: [num_heads]}", 1),
    ("kb_head", "causal && colm[h, kv_idx] > 0 && rowm[h, q_idx] > 0",
     "colm: {type: i32, shape: [num_heads, seqlen_k]}, "
     "rowm: {type: i32, shape: [num_heads, seqlen_q]}", 1),
    ("kb_kvhead", "causal && keep[h_kv, kv_idx] > 0",
     "keep: {type: i32, shape: [num_heads_kv, seqlen_k]}", 2),
    ("kb_win", "doc_q[b, q_idx] == doc_kv[b, kv_idx] && q_idx - kv_idx < w",
     "doc_q: {type: i32, shape: [batch, seqlen_q]}, doc_kv: {type: i32, shape: [batch, seqlen_k]}, "
     "w: {type: i32, default: 40}", 1),
    ("kb_win_f", "causal && doc_q[b, q_idx] == doc_kv[b, kv_idx] && (q_idx - kv_idx) * 0.5 < f",
     "doc_q: {type: i32, shape: [batch, seqlen_q]}, doc_kv: {type: i32, shape: [batch, seqlen_k]}, "
     "f: {type: f32, default: 9.5}", 1),
    ("kb_or", "kv_idx < sink[h] || causal && doc_q[b, q_idx] == doc_kv[b, kv_idx]",
     "doc_q: {type: i32, shape: [batch, seqlen_q]}, doc_kv: {type: i32, shape: [batch, seqlen_k]}, "
     "sink: {type: i32, shape: [num_heads]}", 1),
]  # fmt: skip


def _keep_bits_block(src: str) -> str:
    """The edge step's keep-bits code of a rendered Hopper backward unit (``keep_bits = 0u;``
    through its pair loop)."""
    start = src.index("            keep_bits = 0u;\n")
    end = src.index("            }\n", src.index("keep_bits |=", start)) + len("            }\n")
    return src[start:end]


@pytest.mark.parametrize("d, m80", [(64, False), (128, False), (128, True), (256, False)])
def test_tensor_mask_keep_bits_match_the_mask_pair_by_pair(cxx_exe, d, m80):
    """The edge steps' keep bits of a mask that reads tensors (its one-sided reads loaded once
    per key row and query column, the residual per pair; ``keep_terms``), run on the host
    verbatim from the rendered unit for every warpgroup step tile, warp and lane of random
    problems (sequence ends inside tiles, GQA), against the reference mask: bit i is set
    exactly where acc_s[i]'s (query, key) pair is in range and kept.  A residual that reads
    ``q_idx`` and ``kv_idx`` themselves (``q_idx - kv_idx < w``) needs them in scope there."""
    import random

    import torch
    from host_cxx import preamble

    from flashgen.families.registry import plan_hopper_backward as reg_plan
    from flashgen.ops.cpu.reference import eval_mask

    options = TENSOR_MASKS.replace_path("hopper_bwd.masked_80", m80)
    rng = random.Random(d * 2 + m80)
    gen = torch.Generator().manual_seed(d * 2 + m80)
    batch, heads_q, sq, sk = 2, 4, 150, 203
    funcs, calls, cases = [], [], []
    for name, mask, params, group in KEEP_MASKS:
        spec = loads_spec(
            f"name: {name}_{d}\nhead_dim: {d}\ndtype: bf16\nmask: '{mask}'\nparams: {{{params}}}\n"
        )
        plan = reg_plan(spec, "sm_90", options)
        ctx = plan.dkdv.context
        assert ctx["block_table"] and ctx["keep_expr"] is not None, name
        block = _keep_bits_block(render(plan.unit))
        q_half = ctx["split_d"] and not ctx["sdp_wg"]
        qn = ctx["block_m"] // 2 if q_half else ctx["block_m"]
        assert qn == (80 if m80 else {64: 128, 128: 64, 256: 64}[d])
        keep_t = "uint64_t" if qn // 2 > 32 else "uint32_t"
        heads_kv = heads_q // group
        sizes = {"batch": batch, "num_heads": heads_q, "num_heads_kv": heads_kv,
                 "seqlen_q": sq, "seqlen_k": sk}  # fmt: skip
        values, decl, args, arrays = {}, "", "", ""
        for p in spec.params:
            if p.shape:
                shape = [sizes[s] if isinstance(s, str) else s for s in p.shape]
                if p.name.startswith("doc"):  # nondecreasing document ids
                    t = torch.randint(0, 5, shape, generator=gen).sort(-1).values
                elif p.name == "sink":
                    t = torch.tensor([rng.randrange(-5, sk + 5) for _ in range(shape[0])])
                else:
                    t = (torch.rand(shape, generator=gen) < 0.7).int()
                values[p.name] = t.to(torch.int32)
                flat = ", ".join(str(int(x)) for x in t.flatten().tolist())
                arrays += f"static const int a_{name}_{p.name}[] = {{{flat}}};\n"
                decl += f", const int* t_{p.name}"
                args += f", a_{name}_{p.name}"
            else:
                values[p.name] = p.default
                is_int = p.ty == ir.Ty.I32
                decl += f", {'int' if is_int else 'float'} p_{p.name}"
                args += f", {int(p.default) if is_int else repr(float(p.default)) + 'f'}"
        funcs.append(
            arrays
            + f"static {keep_t} keep_{name}(int b, int h, int h_kv, int qw0, int key_raw, "
            f"int lane, int seqlen_q, int seqlen_k{decl}) {{\n"
            f"    constexpr int NQ = {qn // 8};\n"
            f"    constexpr bool IS_CAUSAL = {'true' if ctx['causal'] else 'false'};\n"
            f"    {keep_t} keep_bits;\n{block}    return keep_bits;\n}}\n"
            f"static void run_{name}() {{\n"
            f"    for (int b = 0; b < {batch}; ++b)\n"
            f"    for (int h = 0; h < {heads_q}; ++h)\n"
            f"    for (int qw0 = 0; qw0 < {sq}; qw0 += {qn})\n"
            f"    for (int kw0 = 0; kw0 < {sk}; kw0 += 64)\n"
            "    for (int t = 0; t < 128; ++t) {\n"
            "        const int lane = t % 32, key_raw = kw0 + t / 32 * 16 + lane / 4;\n"
            f"        printf(\"%llx\\n\", (unsigned long long)keep_{name}(b, h, h / {group}, "
            f"qw0, key_raw, lane, {sq}, {sk}{args}));\n"
            "    }\n}\n"
        )
        calls.append(f"    run_{name}();\n")
        want = eval_mask(spec, batch=batch, heads_q=heads_q, seqlen_q=sq, seqlen_k=sk,
                         params=values, heads_kv=heads_kv)  # fmt: skip
        cases.append((name, qn, want.tolist()))  # nested lists: indexed per pair below
    src = preamble() + "".join(funcs) + "int main() {\n" + "".join(calls) + "}\n"
    exe = cxx_exe(src, f"keep_bits_{d}_{int(m80)}")
    out = iter(subprocess.run([str(exe)], capture_output=True, text=True, timeout=120,
                              check=True).stdout.split())  # fmt: skip
    for name, qn, want in cases:
        for b in range(batch):
            for h in range(heads_q):
                for qw0 in range(0, sq, qn):
                    for kw0 in range(0, sk, 64):
                        for t in range(128):
                            lane, got = t % 32, int(next(out), 16)
                            key_raw = kw0 + t // 32 * 16 + lane // 4
                            bits = 0
                            for i in range(qn // 8 * 4):
                                q = qw0 + (i // 4) * 8 + (lane % 4) * 2 + i % 2
                                kv = key_raw + 8 * ((i // 2) % 2)
                                if q < sq and kv < sk and want[b][h][q][kv]:
                                    bits |= 1 << i
                            assert got == bits, (name, b, h, qw0, key_raw, lane, hex(got ^ bits))


# ------------------------- the dS^T hand-off by arrive / wait (hopper_bwd.ds_split_barrier)
DS_SPLIT = DEFAULT.replace_path("hopper_bwd.ds_split_barrier", True)


def test_ds_split_barrier_is_off_by_default_and_applies_where_dq_reads_both_warpgroups():
    """On where dQ reads both warpgroups' dS^T rows: head_dim 128 (64- and 80-query steps) and
    64 with 128-query steps; not head_dim 64's 64-query steps nor the split layout at 256."""
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    assert HopperBwdOptions().ds_split_barrier is False
    with pytest.raises(ValueError, match=r"ds_split_barrier=1: expected a bool"):
        DEFAULT.replace_path("hopper_bwd.ds_split_barrier", 1)
    d64_64 = DS_SPLIT.replace_path("hopper_bwd.d64_block_m", 64)
    d128_64 = DS_SPLIT.replace_path("hopper_bwd.d128_block_m", 64)
    for spec, options, want in [
        (small(128, "bf16", True), DS_SPLIT, True), (small(128, "fp16", False), d128_64, True),
        (small(64, "bf16", False), DS_SPLIT, True), (small(64, "bf16", True), d64_64, False),
        (small(256, "bf16", True), DS_SPLIT, False), (small(128, "bf16", True), DEFAULT, False),
    ]:  # fmt: skip
        ctx = reg_plan(spec, "sm_90", options).dkdv.context
        assert ctx.ds_split_barrier is want, (spec.name, ctx.block_m)


@pytest.mark.parametrize("d", [64, 128])
def test_ds_split_barrier_signals_issues_dk_then_waits_for_the_other_rows_before_dq(d):
    """The step's order with the option: dS^T stored, fenced, this warpgroup's barrier arrived
    on; dK's wgmmas issued; the other warpgroup's barrier waited on; dQ issued; both waited
    for before dQ goes to sDQ.  Without it: one barrier of both warpgroups, dQ before dK."""
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    spec = small(d, "bf16", True)
    src = render(reg_plan(spec, "sm_90", DS_SPLIT).unit)
    loop = src[src.index("for (int it = 0; it < steps(); ++it)"):]
    order = ["fg::fence_proxy_async_smem();",
             "fg::named_barrier_arrive(BAR_DS + 2 * (it % 2) + cg, MMA_THREADS);",
             f"fg::wgmma_rs_n{d}(acc_dk, ds_frag[kk]",
             "fg::named_barrier_sync(BAR_DS + 2 * (it % 2) + 1 - cg, MMA_THREADS);",
             "(acc_dq, gdesc(", "fg::wgmma_wait<0>();  // dV, dK and dQ have landed",
             "fg::named_barrier_sync(BAR_DQ_EMPTY + cg, DQ_BAR_THREADS);"]  # fmt: skip
    at = [loop.index(s) for s in order]
    assert at == sorted(at), list(zip(order, at, strict=True))
    assert "both warpgroups' dS^T rows are in sDSi" not in loop
    assert "constexpr int BAR_DS = BAR_STAGE_EMPTY + STAGES;" in src
    off = render(reg_plan(spec, "sm_90").unit)
    assert "BAR_DS" not in off and "both warpgroups' dS^T rows are in sDSi" in off
    off_loop = off[off.index("for (int it = 0; it < steps(); ++it)"):]
    assert off_loop.index("(acc_dq, gdesc(") < off_loop.index(f"wgmma_rs_n{d}(acc_dk")


def _simulate_handoff(steps: int, parity: bool, seed: int) -> None:
    """Two consumer warpgroups running the option's hand-off under a random interleaving, on a
    model of named barriers as the hardware counts them (``bar.arrive`` adds 128 arrivals;
    ``bar.sync`` adds 128 and blocks until the barrier's 256 have come, which completes the
    phase and resets it).  Per step a warpgroup writes its half of sDS[it % 2], arrives on its
    barrier, waits on the other's, reads both halves (dQ) and is done with them at the step's
    end.  Raises AssertionError on a read of a half the other has not written this step, a
    write into a half the other still reads, or a deadlock."""
    import random

    rng = random.Random(seed)
    count: dict = {}  # barrier id -> arrivals in its current phase
    phase: dict = {}  # barrier id -> completed phases
    half = {}  # (buffer, warpgroup) -> the step whose dS^T rows it holds
    reading = {0: None, 1: None}  # warpgroup -> the buffer its dQ reads (until its step ends)
    state = [[0, 0, None] for _ in range(2)]  # per warpgroup: step, position, awaited phase

    def bar(it: int, c: int) -> int:
        return (2 * (it % 2) if parity else 0) + c

    def arrive(b: int) -> int:
        count[b] = count.get(b, 0) + 128
        if count[b] == 256:
            count[b] = 0
            phase[b] = phase.get(b, 0) + 1
            return phase[b]
        return phase.get(b, 0) + 1  # the phase this arrival belongs to

    while any(st[0] < steps for st in state):
        live = [c for c in (0, 1) if state[c][0] < steps]
        runnable = [c for c in live if state[c][1] != 3
                    or phase.get(bar(state[c][0], 1 - c), 0) >= state[c][2]]  # fmt: skip
        assert runnable, "deadlock"
        c = rng.choice(runnable)
        it, pos, _ = state[c]
        buf = it % 2
        if pos == 0:  # store this warpgroup's dS^T rows
            assert reading[1 - c] != buf, "a write into the half the other warpgroup reads"
            half[(buf, c)] = it
            state[c][1] = 1
        elif pos == 1:  # bar.arrive on its own barrier
            arrive(bar(it, c))
            state[c][1] = 2
        elif pos == 2:  # (dK issued) bar.sync on the other's: counts in, then blocks
            state[c][2] = arrive(bar(it, 1 - c))
            state[c][1] = 3
        elif pos == 3:  # the wait is over: dQ reads both halves
            assert half.get((buf, 1 - c)) == it, "dQ read the other warpgroup's stale rows"
            reading[c] = buf
            state[c][1] = 4
        else:  # wgmma_wait<0>: done with the buffer; next step
            reading[c] = None
            state[c] = [it + 1, 0, None]


@pytest.mark.parametrize("seed", range(8))
def test_ds_handoff_by_parity_barriers_orders_every_interleaving(seed):
    """The option's protocol (a barrier per warpgroup and step parity, two sDS buffers) under
    random interleavings: each dQ reads the other warpgroup's rows of its own step, no half is
    overwritten while read, no deadlock.  With one barrier per warpgroup instead of two, a
    warpgroup a step ahead arrives into a phase the other has not waited on, which the model
    catches for some interleaving."""
    _simulate_handoff(40, parity=True, seed=seed)
    broken = 0
    for s in range(200):
        try:
            _simulate_handoff(40, parity=False, seed=1000 * seed + s)
        except AssertionError:
            broken += 1
    assert broken > 0


@pytest.mark.parametrize("name, options", [
    ("causal_d128", DS_SPLIT), ("gpt2_d64", DS_SPLIT),
    ("document_mask", DS_SPLIT.replace_path("hopper_bwd.masked_80", False)),
])  # fmt: skip
def test_ds_split_barrier_compiles_without_spills(requires_nvcc, name, options):
    """80-query steps (causal_d128), 128-query steps at head_dim 64, 64-query steps under a
    block table: spill-free, one ``BAR.ARV`` more than the unit without the option."""
    import re

    from flashgen.families.registry import plan_hopper_backward as reg_plan

    plan = reg_plan(shipped(name), "sm_90", options)
    assert plan.dkdv.context.ds_split_barrier
    _, report = cache.get_or_build(render(plan.unit), plan.unit)
    assert report.spill_bytes == 0 and not report.wgmma_serialized, report
    base = reg_plan(shipped(name), "sm_90", options.replace_path("hopper_bwd.ds_split_barrier",
                                                                 False))  # fmt: skip
    cache.get_or_build(render(base.unit), base.unit)

    def arrivals(p) -> int:
        code = sass(p.unit)
        code = code[code.index(f"Function : {p.dkdv.kernel_name}"):]
        return len(re.findall(r"\bBAR\.ARV\b", code.split("Function :")[1]))

    assert arrivals(plan) == arrivals(base) + 1


# ------------------------- steps staggered by key block (hopper_bwd.stagger_steps)
STAGGER = DEFAULT.replace_path("hopper_bwd.stagger_steps", True)


def test_stagger_steps_is_off_by_default_and_not_taken_by_ordered_or_param_grad_units():
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    assert HopperBwdOptions().stagger_steps is False
    with pytest.raises(ValueError, match=r"stagger_steps=1: expected a bool"):
        DEFAULT.replace_path("hopper_bwd.stagger_steps", 1)
    for d in (64, 128, 256):
        assert reg_plan(small(d, "bf16", False), "sm_90", STAGGER).dkdv.context.stagger_steps
        assert not reg_plan(small(d, "bf16", False), "sm_90").dkdv.context.stagger_steps
    ordered = reg_plan(small(128, "bf16", True), "sm_90", STAGGER, ordered_dq=True)
    trained = reg_plan(shipped("alibi"), "sm_90", STAGGER, param_grads=("slopes",))
    assert not ordered.dkdv.context.stagger_steps and not trained.dkdv.context.stagger_steps


def test_a_staggered_ordered_unit_does_not_compile():
    """The template's own guard behind the plan's exclusion: a context with stagger_steps and
    the ordered form (or param gradients, whose flushes follow the hull's order) renders an
    ``#error``."""
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    plan = reg_plan(small(128, "bf16", True), "sm_90", ordered_dq=True)
    unit = plan.unit
    bad = dataclasses.replace(unit, context=dataclasses.replace(unit.context, stagger_steps=True))
    assert '#error "stagger_steps with param-gradient or ordered steps' in render(bad)
    assert "#error" not in render(unit)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_stagger_steps_rotates_the_producer_writer_and_consumer_blocks_alike(d):
    """Every role computes step i's query block with the same rotated formula (the producer's
    loads, the dQ writer's reductions and the consumers' tiles must agree)."""
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    src = render(reg_plan(small(d, "bf16", False), "sm_90", STAGGER).unit)
    want = "(m_first + fg::staggered({} % per_head, n0 / BLOCK_N, per_head)) * BLOCK_M"
    assert src.count(want.format("i")) == (1 if d == 256 else 2)  # producer (+ the dQ writer)
    assert src.count(want.format("it")) == 1  # the consumers
    assert "% per_head) * BLOCK_M" not in src.replace(want.format("i"), "").replace(
        want.format("it"), "")
    assert "__device__ __forceinline__ int staggered(" in src
    assert "staggered" not in render(reg_plan(small(d, "bf16", False), "sm_90").unit)


def test_staggered_steps_visit_each_block_of_the_hull_once_per_head(cxx_exe):
    """``fg::staggered`` as rendered, run on the host over hulls of 1 to 300 blocks and key
    blocks 0 to 600: each CTA's steps visit every block of its hull once per query head, and
    at any step the CTAs of consecutive key blocks are at different blocks."""
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    src = render(reg_plan(small(128, "bf16", False), "sm_90", STAGGER).unit)
    start = src.index("__device__ __forceinline__ int staggered(")
    helper = src[start:src.index("\n}\n", start) + 3]
    program = (
        "#include <cstdio>\n#include <vector>\n#define __device__\n#define __forceinline__ inline\n"
        f"namespace fg {{\n{helper}}}\n"
        """int main() {
    long checked = 0;
    for (int per_head = 1; per_head <= 300; per_head += (per_head < 40 ? 1 : 37))
        for (int n = 0; n <= 600; ++n) {
            std::vector<int> seen(per_head, 0);
            for (int j = 0; j < per_head; ++j) {
                const int r = fg::staggered(j, n, per_head);
                if (r < 0 || r >= per_head || seen[r]++) {
                    std::printf("bad %d %d %d\\n", per_head, n, j);
                    return 1;
                }
                // at step j, the CTAs of key blocks n and n + 1 are at different blocks
                if (per_head > 1 && fg::staggered(j, n + 1, per_head) == r) {
                    std::printf("same %d %d %d\\n", per_head, n, j);
                    return 1;
                }
                ++checked;
            }
        }
    std::printf("checked %ld\\n", checked);
    return 0;
}
"""
    )
    out = subprocess.run([str(cxx_exe(program, "staggered"))], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout
    assert int(out.stdout.split()[1]) > 10_000


@pytest.mark.parametrize("name", ["causal_d128", "gpt2_d64", "bidir_d256", "prefix_lm"])
def test_stagger_steps_compiles_without_spills(requires_nvcc, name):
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    plan = reg_plan(shipped(name), "sm_90", STAGGER)
    assert plan.dkdv.context.stagger_steps
    _, report = cache.get_or_build(render(plan.unit), plan.unit)
    assert report.spill_bytes == 0 and not report.wgmma_serialized, report


# ------------------------- ordered dQ from the last key block down (hopper_bwd.ordered_descending)
def _simulate_descending(hulls, heads: int, slots: int, seed: int, turns_descending: bool = True):
    """The ordered dQ's writers with at most ``slots`` CTAs resident, launched in the order the
    kernel's coordinates give them (ordered_descending: the last key block first): key block n
    walks (head, query block m) for m in its hull, waiting until the (head, m) semaphore equals
    its turn (the count of later key blocks whose hull holds m, or with ``turns_descending``
    False the earlier ones'), then adds; a CTA leaves its slot after its last add.  Returns
    each (head, m)'s adders in order; raises AssertionError on a deadlock."""
    import random

    rng = random.Random(seed)
    n_blocks = len(hulls)
    order = list(range(n_blocks - 1, -1, -1))
    steps = {n: [(h, m) for h in range(heads) for m in range(*hulls[n])] for n in range(n_blocks)}
    pos = dict.fromkeys(range(n_blocks), 0)
    resident, launched = [], 0
    sem: dict = {}
    adds: dict = {}

    def turn(n, m):
        others = range(n + 1, n_blocks) if turns_descending else range(n)
        return sum(hulls[j][0] <= m < hulls[j][1] for j in others)

    while launched < n_blocks or resident:
        while len(resident) < slots and launched < n_blocks:
            resident.append(order[launched])
            launched += 1
        done = [n for n in resident if pos[n] == len(steps[n])]
        for n in done:
            resident.remove(n)
        if done:
            continue
        ready = [n for n in resident
                 if sem.get(steps[n][pos[n]], 0) == turn(n, steps[n][pos[n]][1])]  # fmt: skip
        assert ready, "deadlock"
        n = rng.choice(ready)
        key = steps[n][pos[n]]
        adds.setdefault(key, []).append(n)
        sem[key] = sem.get(key, 0) + 1
        pos[n] += 1
    return adds


@pytest.mark.parametrize("seed", range(4))
def test_descending_turns_add_from_the_last_key_block_without_deadlock(seed):
    """Causal hulls (key block n sees query blocks n ..), band hulls (a window) and random ones,
    with fewer resident CTAs than key blocks: each query block's adders come in descending
    key-block order, each once, and no interleaving deadlocks, because a CTA waits only for
    key blocks launched before it.  Ascending turns under the descending launch deadlock once
    the key blocks outnumber the slots (the launch order is part of the protocol)."""
    import random

    rng = random.Random(200 + seed)
    nb = 24
    causal = [(n, nb) for n in range(nb)]
    band = [(n, min(nb, n + 5)) for n in range(nb)]
    rand = []
    for _ in range(nb):
        lo = rng.randrange(nb + 1)
        rand.append((lo, lo if rng.random() < 0.15 else rng.randrange(lo, nb + 1)))
    for hulls in (causal, band, rand):
        adds = _simulate_descending(hulls, heads=2, slots=7, seed=seed)
        for h in range(2):
            for m in range(nb):
                want = [n for n in range(nb - 1, -1, -1) if hulls[n][0] <= m < hulls[n][1]]
                assert adds.get((h, m), []) == want
    with pytest.raises(AssertionError, match="deadlock"):
        _simulate_descending(causal, heads=1, slots=7, seed=seed, turns_descending=False)


def test_ordered_descending_renders_the_reversed_launch_and_turns():
    """The prefix form's writer waits for ``last_key_block(m0) - n_block``, the CTAs take key
    block ``n_blocks - 1 - n_rank``, head_dim 256's consumers wait for two counts per later key
    block, and the hull form counts the later key blocks' hulls; off, the units are unchanged."""
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    desc = DEFAULT.replace_path("hopper_bwd.ordered_descending", True)
    turn = ("(fg::last_key_block<BLOCK_M, BLOCK_N, IS_CAUSAL>(m0, seqlen_q, seqlen_k)"
            " - n0 / BLOCK_N)")
    src = render(reg_plan(small(128, "bf16", True), "sm_90", desc, ordered_dq=True).unit)
    assert "const int n_block = n_blocks - 1 - n_rank;" in src
    assert f"while (fg::ld_acquire_gpu(sem) != {turn}) {{}}" in src
    assert f"fg::st_release_gpu(sem, {turn} + 1);" in src
    d256 = desc.replace_path("hopper_bwd.ordered_d256", True)
    src = render(reg_plan(small(256, "bf16", True), "sm_90", d256, ordered_dq=True).unit)
    assert f"while (fg::ld_acquire_gpu(sem) < 2 * {turn}) {{}}" in src
    masks = desc.replace_path("hopper_bwd.ordered_masks", True)
    src = render(reg_plan(shipped("mistral_swa"), "sm_90", masks, ordered_dq=True).unit)
    assert ("for (int j0 = n0 / BLOCK_N + 1; j0 < (seqlen_k + BLOCK_N - 1) / BLOCK_N; j0 += 32) {"
            in src)
    assert "last_key_block" not in src
    plain = reg_plan(small(128, "bf16", True), "sm_90", ordered_dq=True)
    assert not plain.dkdv.context.ordered_desc and "n_rank" not in render(plain.unit)
    assert not reg_plan(small(128, "bf16", True), "sm_90", desc).dkdv.context.ordered_desc


@pytest.mark.parametrize("name, extra", [
    ("causal_d128", {"hopper_bwd.ordered_80": True}), ("gpt2_d64", {}),
    ("bidir_d256", {"hopper_bwd.ordered_d256": True}),
    ("mistral_swa", {"hopper_bwd.ordered_masks": True, "hopper_bwd.ordered_80": False}),
])  # fmt: skip
def test_ordered_descending_compiles_without_spills(requires_nvcc, name, extra):
    """(mistral_swa's 80-query steps spill without ``int_classifier`` and are built with 64.)"""
    from flashgen.families.registry import plan_hopper_backward as reg_plan

    options = DEFAULT.replace_path("hopper_bwd.ordered_descending", True)
    for path, value in extra.items():
        options = options.replace_path(path, value)
    plan = reg_plan(shipped(name), "sm_90", options, ordered_dq=True)
    assert plan.dkdv.context.ordered_desc
    _, report = cache.get_or_build(render(plan.unit), plan.unit)
    assert report.spill_bytes == 0 and not report.wgmma_serialized, report
