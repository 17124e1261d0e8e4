"""The Hopper (sm_90a) forward kernel: plan selection, tensor-map geometry, and (with nvcc)
every shipped spec compiling to TMA + wgmma code with zero spills.  The numerics run in
tests/gpu/test_forward.py (both kernel families)."""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import replace
from pathlib import Path

import pytest
from plan_helpers import forward_tile_candidates, plan_forward, plan_hopper_forward
from sass_helpers import sass, wgmmas
from shipped_specs import distinct_code

from flashgen.build import cache
from flashgen.build.render import render
from flashgen.codegen.plan import TileConfig, is_hopper_tiles
from flashgen.families.blocktable import block_table_shape
from flashgen.families.hopper_fwd import eligible as hopper_eligible
from flashgen.families.registry import plan_block_table
from flashgen.families.tiles import HOPPER_TABLE_TILES, HOPPER_TILES, hopper_tiles
from flashgen.frontend.spec import load_spec, loads_spec
from flashgen.ops.prefill.varlen import varlen_spec
from flashgen.runtime import tma
from flashgen.runtime.launch import kernel_args

REPO = Path(__file__).resolve().parents[2]
#: the shipped specs with a prefill (v_from_k specs are decode only: tests/unit/test_decode_mla.py)
SPECS = [p for p in sorted((REPO / "specs").glob("*.yaml")) if not load_spec(p).v_from_k]


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_sm90_selects_the_hopper_kernel(path):
    spec = load_spec(path)
    plan = plan_forward(spec, "sm_90")
    assert plan.template == "sm_90/fwd.cu.j2" and is_hopper_tiles(plan.tiles)
    assert plan.tiles == hopper_tiles(spec) and plan.threads == 384
    assert [a.name for a in plan.args[-3:]] == ["tma_q", "tma_k", "tma_v"]
    assert plan.smem_bytes <= 232448
    if spec.dtype == "fp8_e4m3":  # the Hopper kernel or nothing
        for target, family in (("sm_80", "auto"), ("sm_90", "fa2")):
            with pytest.raises(ValueError, match="Hopper forward only"):
                plan_forward(spec, target, family=family)
        return
    assert plan_forward(spec, "sm_80").template == "sm_80/fwd.cu.j2"
    assert plan_forward(spec, "sm_90", family="fa2").template == "sm_80/fwd.cu.j2"


def test_pinned_fa2_tiles_and_other_head_dims_take_the_fa2_kernel():
    spec = loads_spec(
        "name: t\nhead_dim: 128\ndtype: bf16\ntiles: {block_m: 64, block_n: 64, num_warps: 4}\n"
    )
    assert plan_forward(spec, "sm_90").template == "sm_80/fwd.cu.j2"
    with pytest.raises(ValueError, match="need target sm_90"):
        plan_forward(
            loads_spec("name: t\nhead_dim: 128\ndtype: bf16\n"),
            "sm_80",
            tiles=TileConfig(128, 128, 12),
        )
    with pytest.raises(ValueError, match="Options.family=.fa4.: expected one of"):
        plan_forward(loads_spec("name: t\nhead_dim: 128\ndtype: bf16\n"), "sm_90", family="fa4")


def test_spill_fallback_goes_narrower_then_to_fa2():
    spec = loads_spec("name: t\nhead_dim: 128\ndtype: bf16\n")
    cands = forward_tile_candidates(spec, "sm_90")
    assert cands[0] == HOPPER_TILES[(128, False)] and is_hopper_tiles(cands[1])
    assert cands[1].block_n == HOPPER_TILES[(128, False)].block_n // 2
    assert not is_hopper_tiles(cands[2]) and len(set(cands)) == len(cands)


def test_shared_memory_limit_is_checked():
    spec = loads_spec("name: t\nhead_dim: 256\ndtype: bf16\n")
    with pytest.raises(ValueError, match="shared memory"):
        plan_hopper_forward(spec, "sm_90", TileConfig(128, 128, 12))


def test_tensor_map_geometry():
    # contiguous [B, H, S, D] bf16: dims innermost first, byte strides of S, H, B
    dims, strides = tma.map_geometry((2, 3, 5, 64), (3 * 5 * 64, 5 * 64, 64, 1), 2)
    assert dims == [64, 5, 3, 2] and strides == [128, 640, 1920]
    # extent-1 dims get a legal stride whatever torch reports
    dims, strides = tma.map_geometry((1, 1, 1, 128), (7, 3, 1, 1), 2)
    assert all(s > 0 and s % 16 == 0 for s in strides)
    # a (B, S, H, D) view is fine; a stride that is not a multiple of 16 bytes, an
    # expanded (stride 0) dim, an unaligned base or a non-unit inner stride are not
    assert not tma.needs_copy((2, 4, 9, 64), (9 * 4 * 64, 64, 4 * 64, 1), 2, 1 << 20)
    assert tma.needs_copy((2, 4, 9, 60), (9 * 4 * 60, 60, 4 * 60 + 4, 1), 2, 1 << 20)
    assert tma.needs_copy((2, 4, 9, 64), (9 * 64, 0, 64, 1), 2, 1 << 20)
    assert tma.needs_copy((2, 4, 9, 64), (9 * 4 * 64, 9 * 64, 64, 1), 2, (1 << 20) + 2)
    assert tma.needs_copy((2, 4, 9, 64), (9 * 4 * 64, 9 * 64, 64, 2), 2, 1 << 20)


def test_kernel_args_pack_tensor_maps():
    spec = loads_spec("name: t\nhead_dim: 64\ndtype: bf16\n")
    plan = plan_forward(spec, "sm_90")
    values = {a.name: 0 for a in plan.args}
    values.update({m.name: bytes(range(128)) for m in plan.tma})
    packed = kernel_args(plan, values)
    assert packed[-1] == bytes(range(128)) and len(packed) == len(plan.args)


def _sass(path: Path) -> tuple[str, str | None]:
    spec = load_spec(path)
    plan = plan_forward(spec, "sm_90")
    if plan.template != "sm_90/fwd.cu.j2":
        return spec.name, None
    return spec.name, sass(plan)


def test_every_shipped_spec_emits_tma_and_wgmma(requires_nvcc):
    """The SASS of each shipped spec's sm_90 forward (the unit the compile sweep,
    tests/unit/test_compile.py, builds and checks for spills; one spec per kernel code)
    holds wgmma, TMA loads and setmaxnreg."""
    with cf.ThreadPoolExecutor(2) as ex:
        for name, code in ex.map(_sass, distinct_code(SPECS)):
            assert code is not None, f"{name}: not the Hopper kernel on sm_90"
            assert wgmmas(code), name
            assert "UTMALDG" in code, name
            assert "USETMAXREG" in code, name


def test_block_table_specs_take_the_hopper_kernel_and_its_table():
    """A mask that reads tensors (document_mask) runs the Hopper kernel on sm_90; the block
    table (pre-pass, op.block_mask) is built for that kernel's tiles, so its row for a query
    block has one entry per BLOCK_N key block; FLASHGEN_KERNEL_FAMILY=fa2 keeps the
    FA2-class kernel with its own tiles and table; varlen stays excluded."""
    spec = load_spec(REPO / "specs" / "document_mask.yaml")
    assert hopper_eligible(spec, "sm_90") and not hopper_eligible(spec, "sm_90", "fa2")
    plan = plan_forward(spec, "sm_90")
    assert plan.template == "sm_90/fwd.cu.j2" and plan.tiles == hopper_tiles(spec)
    names = [a.name for a in plan.args]
    assert names[-6:] == ["blk_tab", "blk_sb", "blk_sh", "tma_q", "tma_k", "tma_v"]
    pre = plan_block_table(spec, "sm_90", plan.tiles)
    assert (pre.context["block_m"], pre.context["block_n"]) == (128, plan.tiles.block_n)
    n_blocks = -(-8000 // plan.tiles.block_n)
    assert block_table_shape(spec, plan.tiles, 2, 4, 1000, 8000)[2:] == (8, n_blocks)
    src = render(plan)
    assert "tab_row[j]" in src and "__reduce_max_sync" in src and "fg_tile_class" not in src
    assert "const int n_next = prev_live(n_block - 1, c);" in src
    fa2 = plan_forward(spec, "sm_90", family="fa2")
    assert fa2.template == "sm_80/fwd.cu.j2" and not is_hopper_tiles(fa2.tiles)
    assert fa2.tiles != plan.tiles and "s_tab[j] = tab_row[j]" in render(fa2)
    # the classifier path is unchanged for index-only masks
    swa = render(plan_forward(load_spec(REPO / "specs" / "mistral_swa.yaml"), "sm_90"))
    assert "walk.prev_live(j, c, kv_class)" in swa and "tab_row" not in swa
    # the smem layout reserves warp_last (one int per warp) only with a table (without one,
    # single_walk's first_slot: 8 bytes)
    plain = plan_hopper_forward(
        replace(spec, mask=None, params=()), "sm_90", plan.tiles, single_walk=False
    )
    assert plan.smem_bytes == plain.smem_bytes + 4 * 12
    with pytest.raises(ValueError, match="no varlen"):
        plan_hopper_forward(varlen_spec(load_spec(REPO / "specs" / "causal_d128.yaml")),
                            "sm_90", plan.tiles)  # fmt: skip


@pytest.mark.parametrize("d", [64, 128, 256])
def test_hopper_block_table_kernel_compiles_without_spills(requires_nvcc, d):
    """document_mask at every Hopper head dim, at its planned tiles (no fallback)."""
    text = (REPO / "specs" / "document_mask.yaml").read_text()
    spec = loads_spec(text.replace("head_dim: 128", f"head_dim: {d}"), "doc.yaml")
    plan = plan_forward(spec, "sm_90")
    assert plan.template == "sm_90/fwd.cu.j2"
    _, report = cache.get_or_build(render(plan), plan)
    assert report.spill_bytes == 0, report
    pre = plan_block_table(spec, "sm_90", plan.tiles)
    _, report = cache.get_or_build(render(pre), pre)
    assert report.spill_bytes == 0, report


def test_a_block_table_mask_takes_its_own_hopper_tile():
    """document masking (a mask that reads tensors) runs 128 x 128 steps at head_dim 128
    (HOPPER_TABLE_TILES); index-only masks keep HOPPER_TILES' 128 x 160."""
    doc = load_spec(REPO / "specs" / "document_mask.yaml")
    prefix = load_spec(REPO / "specs" / "prefix_lm.yaml")
    assert hopper_tiles(doc) == HOPPER_TABLE_TILES[128] == TileConfig(128, 128, 12)
    assert plan_forward(doc, "sm_90").tiles == HOPPER_TABLE_TILES[128]
    assert hopper_tiles(prefix) == HOPPER_TILES[(128, False)]


def test_float_index_calls_take_alibi_learneds_distance_off_the_integer_pipe(requires_nvcc):
    """``hopper_fwd.float_index_calls``: alibi_learned's ``slopes[h] * abs(q_idx - kv_idx)``
    lowers to ``fabsf(q_idx_f - kv_idx_f)``, spill-free, without the per-element IABS and
    int-to-float conversion (the unit with the option off has about one of each per score);
    a spec without such a call renders the same source.  On by default."""
    off = {"hopper_fwd.float_index_calls": False}
    spec = load_spec(REPO / "specs" / "alibi_learned.yaml")
    codes = []
    for values in (off, None):
        plan = plan_forward(spec, "sm_90", values=values)
        src = render(plan)
        assert ("fabsf((q_idx_f - kv_idx_f))" in src) == (values is None)
        _, report = cache.get_or_build(src, plan)
        assert report.spill_bytes == 0 and not report.wgmma_serialized, report
        codes.append(sass(plan))
    (iabs0, i2f0), (iabs1, i2f1) = ((c.count("IABS"), c.count("I2FP")) for c in codes)
    assert iabs1 < iabs0 // 10 and i2f1 < i2f0 // 2, (iabs0, i2f0, iabs1, i2f1)
    plain = load_spec(REPO / "specs" / "alibi.yaml")
    assert render(plan_forward(plain, "sm_90", values=off)) == render(plan_forward(plain, "sm_90"))


def test_a_unit_that_spills_with_float_index_calls_is_built_with_the_int_forms(requires_nvcc):
    """Three integer index calls in a head-dim-128 score_mod spill 120 B on the float twins:
    ``build_forward`` builds the int forms (spill-free), its first fallback."""
    from flashgen.families.build import build_forward

    text = "name: three_calls\nhead_dim: 128\ndtype: bf16\nmask: causal\n"
    text += "score_mod: score - s[h] * abs(q_idx - kv_idx) - t[h] * min(q_idx, kv_idx)"
    text += " + u[h] * max(q_idx - 7, kv_idx)\nparams:\n"
    text += "".join(f"  {p}: {{type: f32, shape: [num_heads]}}\n" for p in "stu")
    spec = loads_spec(text, "<three_calls>")
    first = plan_forward(spec, "sm_90")
    assert "fabsf((q_idx_f - kv_idx_f))" in render(first)
    assert cache.get_or_build(render(first), first)[1].spill_bytes > 0
    plan, _, report = build_forward(spec, "sm_90")
    assert report.spill_bytes == 0 and not report.wgmma_serialized, report
    assert "fabsf((q_idx_f" not in render(plan)
    assert plan.tiles == first.tiles
