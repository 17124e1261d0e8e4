"""Every shipped spec built as fp8 (``dtype: fp8_e4m3``; a test matrix, not files in specs/)
plans the fp8 Hopper forward, compiles for sm_90a with zero spills and no serialized wgmma
(nvcc for real), and its code has FP8 wgmma (``wgmma.mma_async ... k32.f32.e4m3.e4m3``, both
GEMMs) in the PTX; fp8 has no other kernel: sm_80, varlen, the backward and the FA2-class
family are refused with errors that say so."""

from __future__ import annotations

import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from shipped_specs import distinct_code

from flashgen.build.compile import compile_source, find_nvcc, nvcc_command
from flashgen.build.render import render
from flashgen.families import registry
from flashgen.frontend.spec import load_spec
from flashgen.options import DEFAULT

SPECS = sorted(
    p for p in (Path(__file__).resolve().parents[2] / "specs").glob("*.yaml")
    if "fp8" not in p.stem and not load_spec(p).v_from_k  # (MLA: decode only, no forward)
)  # fmt: skip


def fp8(path: Path):
    return replace(load_spec(path), dtype="fp8_e4m3")


@pytest.mark.parametrize("path", distinct_code(SPECS), ids=lambda p: p.stem)  # (not llama3_gqa)
def test_every_shipped_spec_as_fp8_compiles_without_spills(path, tmp_path, requires_nvcc):
    spec = fp8(path)
    units = registry.compile_units(spec, "sm_90")
    assert list(units) == ["fwd"]  # no backward, no sparse variant
    plan = units["fwd"]
    assert plan.context["fp8"] and not plan.context["persistent"]
    src = render(plan)
    # both GEMMs are e4m3 wgmma with k = 32: Q K^T from shared memory, P V with P in registers
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", src)
    report = compile_source(src, plan, tmp_path / "k.cubin")
    (k,) = report.kernels
    assert (k.spill_stores, k.spill_loads, k.wgmma_serialized) == (0, 0, ""), k


def test_fp8_ptx_has_e4m3_wgmma(tmp_path, requires_nvcc):
    spec = fp8(SPECS[0].with_name("causal_d128.yaml"))
    plan = registry.plan_forward(spec, "sm_90")
    (tmp_path / "k.cu").write_text(render(plan))
    cmd = [a for a in nvcc_command(plan, tmp_path / "k.cu", tmp_path / "k.ptx") if a != "-cubin"]
    cmd = [find_nvcc(), "-ptx", *[a for a in cmd[1:] if a not in ("-Xptxas", "-v")]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    ptx = (tmp_path / "k.ptx").read_text()
    ss = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.e4m3\.e4m3", ptx)
    assert {"128"} <= set(ss), ss  # S (n = BLOCK_N) and O (n = head_dim), both 128 here
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # P packed to e4m3 in registers


@pytest.mark.parametrize(
    "change, target, words",
    [
        ({}, "sm_80", ["Hopper forward only", "sm_80"]),
        ({"varlen": True}, "sm_90", ["varlen True"]),
        ({"head_dim": 96, "head_dim_v": 96}, "sm_90", ["head_dim 96/96"]),
    ],
)
def test_fp8_without_the_hopper_kernel_is_refused(change, target, words):
    spec = replace(fp8(SPECS[0].with_name("causal_d128.yaml")), **change)
    with pytest.raises(ValueError) as e:
        registry.plan_forward(spec, target)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_fp8_has_no_backward_and_no_fa2_family():
    spec = fp8(SPECS[0].with_name("causal_d128.yaml"))
    with pytest.raises(ValueError, match="no backward"):
        registry.select(spec, "sm_90", "bwd", deterministic=False)
    with pytest.raises(ValueError, match="family fa2"):
        registry.plan_forward(spec, "sm_90", replace(DEFAULT, family="fa2"))


@pytest.mark.parametrize("name", ["causal_d128", "gpt2_d64", "bidir_d256"])
def test_fp8_lds32_transposer_compiles_without_spills(name, tmp_path, requires_nvcc):
    """The default ``hopper_fwd.fp8_transpose="ldsm"`` renders ``fg::fp8::VTransposeLdsm``
    (ldmatrix.x4 / stmatrix.x4.trans, common/fp8_ldsm.cuh; compiled for every shipped spec
    above); ``"lds32"`` renders ``fg::fp8::VTranspose`` instead, without the header, and
    compiles for sm_90a with zero spills."""
    spec = fp8(SPECS[0].with_name(f"{name}.yaml"))
    default = render(registry.plan_forward(spec, "sm_90"))
    assert "using VT = fg::fp8::VTransposeLdsm<" in default
    assert "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in default
    opts = DEFAULT.replace_path("hopper_fwd.fp8_transpose", "lds32")
    plan = registry.plan_forward(spec, "sm_90", opts)
    src = render(plan)
    assert "VTransposeLdsm" not in src and "fg::fp8::VTranspose<" in src
    report = compile_source(src, plan, tmp_path / "k.cubin")
    (k,) = report.kernels
    assert (k.spill_stores, k.spill_loads, k.wgmma_serialized) == (0, 0, ""), k


def test_fp8_transpose_option_values():
    assert DEFAULT.hopper_fwd.fp8_transpose == "ldsm"
    with pytest.raises(ValueError, match="fp8_transpose: expected one of lds32, ldsm, got 'lds64'"):
        DEFAULT.replace_path("hopper_fwd.fp8_transpose", "lds64")


# ----------------------------------------------------------------------------- per-block descales
@pytest.mark.parametrize("path", distinct_code(SPECS), ids=lambda p: p.stem)  # (not llama3_gqa)
def test_every_shipped_spec_as_fp8_with_block_descales_compiles_without_spills(
    path, tmp_path, requires_nvcc
):
    """Issue 41: the fp8 forward that reads per-block descales (``block_descale``, picked per
    call by the op: ``flashgen.fp8.quantize(block_rows=128)``) compiles for sm_90a with zero
    spills and no serialized wgmma for every shipped spec, masks and score_mods included."""
    spec = fp8(path)
    plan = registry.plan_forward(spec, "sm_90", block_descale=True)
    assert plan.kernel_name.endswith("_fwd_sm_90_bd") and plan.context.fp8_block_descale == 128
    src = render(plan)
    # o in the last block's v units, rescaled by vd_prev in the epilogue (with the fused sink,
    # the default for a sink spec, times the sink's share)
    share = "vd_prev * fg::dec::sink_share(row_lse, sink_logit) / sum"
    epilogue = share if spec.sink else "vd_prev / sum"
    assert "read_descales(info_n0);" in src and epilogue in src
    report = compile_source(src, plan, tmp_path / "k.cubin")
    (k,) = report.kernels
    assert (k.spill_stores, k.spill_loads, k.wgmma_serialized) == (0, 0, ""), k


@pytest.mark.parametrize("name", ["gpt2_d64", "llama3_fp8", "bidir_d256", "gemma2_softcap"])
def test_block_descales_with_exact_softmax_compile_without_spills(name, tmp_path, requires_nvcc):
    """With ``Options(exact_softmax=True)`` the per-block kernel multiplies S by k's descale
    (the exact softmax's roundings assume one scale for the row) and stays spill-free."""
    spec = fp8(SPECS[0].with_name(f"{name}.yaml"))
    plan = registry.plan_forward(spec, "sm_90", replace(DEFAULT, exact_softmax=True),
                                 block_descale=True)  # fmt: skip
    src = render(plan)
    assert "acc_s[i] *= blk_kd;" in src and "c_blk" not in src
    report = compile_source(src, plan, tmp_path / "k.cubin")
    (k,) = report.kernels
    assert (k.spill_stores, k.spill_loads, k.wgmma_serialized) == (0, 0, ""), k


@pytest.mark.parametrize("name", ["gpt2_d64", "causal_d128", "gemma2_softcap", "alibi"])
def test_block_descales_render_apart_from_the_default(name):
    """The [B, Hkv] kernel renders none of the per-block code (its source, and so its SASS,
    is the one before issue 41: test_unit_hashes.py); the per-block one reads q's descale per
    query block and k's, v's per key block.  Without a score_mod k's descale folds into the
    block max and the exp2's FFMA (no instruction per element); with one S is scaled first."""
    spec = fp8(SPECS[0].with_name(f"{name}.yaml"))
    default = render(registry.plan_forward(spec, "sm_90"))
    for piece in ("blk_kd", "vd_prev", "DESCALE_ROWS", "read_descales"):
        assert piece not in default
    assert "softmax_scale *= q_descale[b * heads_kv + h_kv] * k_descale[b * heads_kv + h_kv];" \
        in default
    src = render(registry.plan_forward(spec, "sm_90", block_descale=True))
    assert "softmax_scale *= q_descale[(int64_t)bh * num_m_blocks + m_block];" in src
    assert "constexpr int DESCALE_ROWS = 128;" in src
    assert src.count("alpha[r] *= blk_vr;") == 1
    if spec.score_mod is None:
        assert "fmaf(acc_s[4 * j + 2 * r + e], c_blk, -base)" in src
        assert "acc_s[i] *= blk_kd;" not in src
    else:
        assert "acc_s[i] *= blk_kd;" in src and "c_blk" not in src


def test_block_descale_plans_need_fp8_and_its_tiles():
    spec = replace(load_spec(SPECS[0].with_name("causal_d128.yaml")), dtype="bf16")
    with pytest.raises(ValueError, match="per-block descales are an input of fp8 specs only"):
        registry.plan_forward(spec, "sm_90", block_descale=True)
    from flashgen.codegen.plan import TileConfig
    from flashgen.families import hopper_fwd

    f8 = fp8(SPECS[0].with_name("causal_d128.yaml"))
    with pytest.raises(ValueError, match="fp8 Hopper forward needs BLOCK_M 128"):
        hopper_fwd.plan(f8, "sm_90", tiles=TileConfig(64, 128, 8), block_descale=True)
