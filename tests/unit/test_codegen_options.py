"""Template code-generation switches (FORWARD_OPTIONS / BACKWARD_OPTIONS) and the
variant list of tools/perf_sweep.py.  CPU only: planning and rendering, no nvcc."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest
from plan_helpers import choose_tiles, plan_backward, plan_forward

from flashgen.build.render import render
from flashgen.codegen.plan import TileConfig
from flashgen.families import fa2_fwd
from flashgen.families.fa2_bwd import BACKWARD_OPTIONS
from flashgen.families.fa2_fwd import FORWARD_OPTIONS, uses_load_chain
from flashgen.families.tiles import DEFAULT_TILES, HOPPER_TILES, MASK_TILES, default_tiles
from flashgen.frontend.spec import loads_spec
from flashgen.ops.varlen import varlen_spec

REPO = Path(__file__).resolve().parents[2]


def _spec(mask="causal", score_mod=None, d=128):
    text = f"name: opt_t\nhead_dim: {d}\ndtype: bf16\nmask: {mask}\n"
    if score_mod:
        text += f"score_mod: {score_mod}\n"
    return loads_spec(text)


def test_unknown_option_is_refused():
    with pytest.raises(ValueError, match="unknown forward option 'nope'"):
        plan_forward(_spec(), "sm_80", options={"nope": True})
    with pytest.raises(ValueError, match="unknown backward option 'nope'"):
        plan_backward(_spec(), "sm_80", options={"nope": True})


@pytest.mark.parametrize("key", sorted(FORWARD_OPTIONS))
def test_each_forward_switch_changes_the_source(key):
    spec = _spec()
    on = render(plan_forward(spec, "sm_90", options={key: True}, family="fa2"))
    off = render(plan_forward(spec, "sm_90", options={key: False}, family="fa2"))
    assert on != off


DOC_MASK = """name: opt_doc
head_dim: 128
dtype: bf16
mask: causal && doc[q_idx] == doc[kv_idx]
params:
  doc: {type: i32, shape: [seqlen_q]}
"""


def test_every_forward_switch_combination_renders():
    keys = sorted(FORWARD_OPTIONS)
    for spec in (
        _spec(),
        _spec(mask="null", score_mod="score * 0.5"),
        _spec("causal && q_idx - kv_idx < 64"),
        varlen_spec(_spec("causal && q_idx - kv_idx < 64")),
        loads_spec(DOC_MASK),  # block table
    ):
        for values in itertools.product((False, True), repeat=len(keys)):
            opts = dict(zip(keys, values, strict=True))
            plan = plan_forward(spec, "sm_90", options=opts, family="fa2")
            src = render(plan)
            assert plan.template == "sm_80/fwd.cu.j2" and "__global__" in src


@pytest.mark.parametrize(
    "spec",
    [_spec(), varlen_spec(_spec()), loads_spec(DOC_MASK)],
    ids=["causal", "varlen", "block_table"],
)
def test_fold_scale_reaches_both_paths_of_the_scores_macro(spec):
    """masks' scores(masked) macro is expanded twice (PARTIAL and FULL tiles); the folded
    scale must be in both, and the exp2 FFMA must take it."""
    src = render(plan_forward(spec, "sm_80"))
    assert src.count("float x = acc_s[mt][nt][i];  // raw q.k") == 2
    assert "fmaf(acc_s[mt][nt][2 * r + j], scale_log2, -base)" in src
    off = render(plan_forward(spec, "sm_80", options={"fwd_fold_scale": False}))
    assert off.count("float x = acc_s[mt][nt][i] * scale_log2;") == 2


def test_fold_scale_only_without_score_mod():
    plain = plan_forward(_spec(), "sm_80")
    modded = plan_forward(_spec(score_mod="score * 0.5"), "sm_80")
    assert plain.context["fold_scale"] is FORWARD_OPTIONS["fwd_fold_scale"]
    assert modded.context["fold_scale"] is False
    assert "fmaf(acc_s" not in render(modded)


@pytest.mark.parametrize("key", sorted(BACKWARD_OPTIONS))
def test_each_backward_switch_changes_the_source(key):
    on = render(plan_backward(_spec(), "sm_90", options={key: True}).unit)
    off = render(plan_backward(_spec(), "sm_90", options={key: False}).unit)
    assert on != off


def test_async_stats_only_without_score_mod():
    src = render(plan_backward(_spec(score_mod="score * 0.5"), "sm_90").unit)
    assert "cp_async_4(" not in src.split("__global__", 1)[1]


def test_default_tiles_mask_rule():
    assert (
        default_tiles(_spec()) == DEFAULT_TILES[(128, False)] == TileConfig(128, 64, 4)
    )
    # a mask beyond causal takes MASK_TILES where it has the head dim (d128: narrower; d64
    # and d256: today's plain tiles, kept for masks if FA2's tiles become the plain entries);
    # other head dims keep their entry
    swa = "causal && q_idx - kv_idx < 64"
    assert default_tiles(_spec(swa)) == MASK_TILES[128] == TileConfig(128, 32, 4)
    assert default_tiles(_spec(swa, d=64)) == MASK_TILES[64] == TileConfig(128, 64, 4)
    assert default_tiles(_spec(swa, d=256)) == MASK_TILES[256] == TileConfig(64, 64, 4)
    assert default_tiles(_spec(swa, d=96)) == DEFAULT_TILES[(96, False)]
    # a score_mod keys the table as before
    modded = _spec(score_mod="score * 0.5")
    assert default_tiles(modded) == DEFAULT_TILES[(128, True)]
    assert (
        default_tiles(_spec(d=64, score_mod="score * 0.5"))
        == DEFAULT_TILES[(64, True)]
        == TileConfig(128, 32, 4)
    )
    # a head dim without a score_mod entry falls back to its plain entry
    assert (
        default_tiles(_spec(d=32, score_mod="score * 0.5"))
        == DEFAULT_TILES[(32, False)]
    )


def test_varlen_and_hopper_keep_their_tiles():
    # varlen keeps the pre-128x64x4 d128 tile and keys on score_mod only
    assert default_tiles(varlen_spec(_spec())) == TileConfig(128, 32, 4)
    swa = varlen_spec(_spec("causal && q_idx - kv_idx < 64"))
    assert default_tiles(swa) == TileConfig(128, 32, 4)
    assert default_tiles(varlen_spec(_spec(d=256))) == DEFAULT_TILES[(256, False)]
    assert default_tiles(varlen_spec(_spec(d=64))) == TileConfig(128, 64, 4)
    # sm_90 picks the Hopper kernel by default; family="fa2" gets this branch's default tiles
    assert choose_tiles(_spec(), "sm_90") == HOPPER_TILES[(128, False)]
    assert choose_tiles(_spec(), "sm_90", family="fa2") == TileConfig(128, 64, 4)
    assert choose_tiles(_spec(), "sm_80") == TileConfig(128, 64, 4)


def test_load_chain_rule():
    """Pointer-chain tile loads: DSL math, or plain head_dim <= 64 with 128-row key blocks
    (FA2's d64 tile); the offsets form everywhere else (plain d128 needs it)."""
    t64, t128 = TileConfig(128, 64, 4), TileConfig(128, 128, 4)
    assert uses_load_chain(_spec(d=64), t128)
    assert not uses_load_chain(_spec(d=64), t64)
    assert not uses_load_chain(_spec(), t64)
    assert not uses_load_chain(_spec(d=256), TileConfig(128, 64, 8))
    assert uses_load_chain(_spec(score_mod="score * 0.5"), t64)
    assert uses_load_chain(_spec("causal && q_idx - kv_idx < 64"), t64)
    plan = plan_forward(_spec(d=64), "sm_90", tiles=t128, family="fa2")
    assert plan.context["load_chain"] and "g += step" in render(plan)
    plan = plan_forward(_spec(d=64), "sm_90", tiles=t64, family="fa2")
    assert not plan.context["load_chain"] and "g += step" not in render(plan)


def test_lazy_rescale_head_dims(monkeypatch):
    """LAZY_RESCALE_HEAD_DIMS turns fwd_lazy_rescale on per head dim; options= still wins."""
    monkeypatch.setattr(fa2_fwd, "LAZY_RESCALE_HEAD_DIMS", frozenset({64}))
    assert plan_forward(_spec(d=64), "sm_80").context["fwd_lazy_rescale"] is True
    assert plan_forward(_spec(d=128), "sm_80").context["fwd_lazy_rescale"] is False
    off = plan_forward(_spec(d=64), "sm_80", options={"fwd_lazy_rescale": False})
    assert off.context["fwd_lazy_rescale"] is False


def _perf_sweep():
    path = REPO / "tools" / "perf_sweep.py"
    mod_spec = importlib.util.spec_from_file_location("perf_sweep", path)
    mod = importlib.util.module_from_spec(mod_spec)
    sys.modules.setdefault("perf_sweep", mod)  # dataclasses look their module up there
    mod_spec.loader.exec_module(sys.modules["perf_sweep"])
    return sys.modules["perf_sweep"]


def test_perf_sweep_variants_plan_and_render():
    ps = _perf_sweep()
    args = ps.parse([])
    variants = ps.all_variants(args)
    keys = [v.key for v in variants]
    assert len(keys) == len(set(keys))
    for d in (64, 128, 256):
        for causal in (False, True):
            names = {v.name for v in variants if (v.d, v.causal, v.kind) == (d, causal, "fwd")}
            assert {"base", "default"} <= names
            names = {v.name for v in variants if (v.d, v.causal, v.kind) == (d, causal, "bwd")}
            assert {"det", "atomic"} <= names
    for v in variants:
        spec = ps.spec_for(v.d, v.causal, v.dtype)
        opts = dict(v.options)
        if v.kind == "fwd":
            plan = plan_forward(spec, "sm_90", tiles=v.tiles, options=opts, family=v.family)
            # on sm_90 every variant but the reference row times the FA2-class kernel
            want = "sm_90/fwd.cu.j2" if v.name == "fa3-default" else ps.FA2_TEMPLATE
            assert plan.template == want, v.key
            render(plan)
        else:
            render(
                plan_backward(spec, "sm_90", atomic_dq=v.atomic, tiles=v.tiles, options=opts).unit
            )
    assert sum(v.name == "fa3-default" for v in variants) == 6  # one per forward config
    quick = ps.all_variants(ps.parse(["--quick"]))
    assert {v.name for v in quick} == {
        "base",
        "default",
        "fa3-default",
        "det",
        "atomic",
        "atomic-n128",
    }
    assert not any(v.name == "fa3-default" for v in ps.all_variants(ps.parse(["--no-fa3"])))
    # the full sweep times FA2's d64 / d256 tiles too
    names = {(v.d, v.name) for v in variants}
    assert {(64, "t128x128x4"), (64, "t128x128x4+lazy"), (256, "t128x64x8")} <= names


def test_perf_sweep_candidates():
    """--candidates: default, +lazy and FA2's tiles per config, bf16 and fp16, no backward."""
    ps = _perf_sweep()
    argv = ["--candidates", "--dims", "64", "256", "--dtypes", "bf16", "fp16", "--no-fa3"]
    args = ps.parse(argv)
    assert not args.bwd
    variants = ps.all_variants(args)
    assert {v.kind for v in variants} == {"fwd"}
    assert len({v.key for v in variants}) == len(variants)
    for d, tile in ((64, TileConfig(128, 128, 4)), (256, TileConfig(128, 64, 8))):
        for causal in (False, True):
            for dtype in ("bf16", "fp16"):
                got = {
                    v.name: v for v in variants if (v.d, v.causal, v.dtype) == (d, causal, dtype)
                }
                name = ps.tile_name(tile)
                assert {"default", "+lazy", name, name + "+lazy"} == set(got)
                assert got[name].tiles == tile and got[name + "+lazy"].options
    for v in variants:
        plan = plan_forward(ps.spec_for(v.d, v.causal, v.dtype), "sm_80", tiles=v.tiles,
                            options=dict(v.options), family=v.family)  # fmt: skip
        assert plan.template == ps.FA2_TEMPLATE
        assert plan.context["load_chain"] == (plan.tiles == TileConfig(128, 128, 4))
    with_fa3 = ps.all_variants(ps.parse(argv[:-1]))
    assert sum(v.name == "fa3-default" for v in with_fa3) == 8


def test_perf_sweep_reports(capsys):
    ps = _perf_sweep()
    cfg = {"d": 128, "causal": True, "dtype": "bf16", "seqlen": 16384, "direction": "fwd"}
    rows = [
        {**cfg, "impl": "sdpa-flash", "tflops": 320.0},
        {**cfg, "impl": "sdpa-cudnn", "tflops": 570.0},
        {**cfg, "impl": "fg:fa3-default", "tflops": 610.0, "spill_bytes": 0, "tiles": "128x160x12"},
        {**cfg, "impl": "fg:base", "tflops": 260.0, "spill_bytes": 0, "tiles": "128x32x4"},
        {**cfg, "impl": "fg:default", "tflops": 300.0, "spill_bytes": 0, "tiles": "128x64x4"},
        {**cfg, "impl": "fg:t128x32x4", "tflops": 400.0, "spill_bytes": 8, "tiles": "128x32x4"},
        {**cfg, "impl": "fg:-fold", "error": "check failed"},
    ]
    ps.print_table(rows)
    ps.summary(rows)
    out = capsys.readouterr().out
    assert "t128x32x4 400*" in out and "-fold !" in out
    last = out.strip().splitlines()[-1]
    # best spill-free FA2-class variant: default (fa3 and the spilling tile do not count)
    assert "fwd d128 causal" in last and "default 128x64x4 300" in last and "0.94" in last


def test_perf_sweep_ratio_table(capsys):
    ps = _perf_sweep()
    cfg = {"d": 64, "causal": False, "dtype": "fp16", "seqlen": 4096, "direction": "fwd"}
    rows = [
        {**cfg, "impl": "sdpa-flash", "tflops": 300.0},
        {**cfg, "impl": "sdpa-cudnn", "tflops": 450.0},
        {**cfg, "impl": "fg:default", "tflops": 285.0, "spill_bytes": 0},
        {**cfg, "impl": "fg:t128x128x4", "tflops": 315.0, "spill_bytes": 0},
        {**cfg, "impl": "fg:t128x128x4+lazy", "error": "check failed"},
    ]
    ps.ratio_table(rows)
    out = capsys.readouterr().out.strip().splitlines()
    assert "t128x128x4+lazy" in out[-2]
    assert "fwd d64  full   fp16" in out[-1]
    assert out[-1].split()[-3:] == ["0.950", "1.050", "!"]


def test_perf_sweep_flops():
    ps = _perf_sweep()
    # B*S = 16384 tokens, H = 2048 / D: 4 * B * H * S^2 * D
    assert ps.flops(128, False, 16384, "fwd") == 4 * 1 * 16 * 16384**2 * 128
    assert ps.flops(128, True, 4096, "fwd") == 4 * 4 * 16 * 4096**2 * 128 / 2
    assert ps.flops(64, False, 4096, "bwd") == 2.5 * 4 * 4 * 32 * 4096**2 * 64


def test_perf_sweep_tiles_and_flips():
    """--tiles/--flip: default and each listed tile config but the default's, each also with
    each flipped switch; every variant plans the FA2-class kernel."""
    ps = _perf_sweep()
    argv = ["--candidates", "--dims", "256", "--no-fa3", "--flip", "fwd_unrolled_loads"]
    args = ps.parse([*argv, "--tiles", "64x64x4", "128x64x8", "t128x48x8", "64x64x4"])
    assert args.tiles[0] == TileConfig(64, 64, 4)
    variants = ps.all_variants(args)
    assert len({v.key for v in variants}) == len(variants) == 2 * 6
    names = {v.name for v in variants if not v.causal}
    assert names == {"default", "default-unroll", "t64x64x4", "t64x64x4-unroll", "t128x48x8",
                     "t128x48x8-unroll"}  # fmt: skip
    for v in variants:
        plan = plan_forward(ps.spec_for(v.d, v.causal, v.dtype), "sm_90", tiles=v.tiles,
                            options=dict(v.options), family=v.family)  # fmt: skip
        assert plan.template == ps.FA2_TEMPLATE
        assert plan.context["fwd_unrolled_loads"] == (not v.name.endswith("-unroll"))
        assert plan.context["fwd_lazy_rescale"]  # d256 (LAZY_RESCALE_HEAD_DIMS)
    with pytest.raises(SystemExit):
        ps.parse([*argv, "--tiles", "64x64"])
    two = ps.parse([*argv, "fwd_even_loads", "--tiles", "64x48x4"])
    got = {v.name: dict(v.options) for v in ps.all_variants(two) if v.causal}
    assert got == {
        "default": {},
        "default-unroll": {"fwd_unrolled_loads": False},
        "default+even": {"fwd_even_loads": True},
        "t64x48x4": {},
        "t64x48x4-unroll": {"fwd_unrolled_loads": False},
        "t64x48x4+even": {"fwd_even_loads": True},
    }


def test_perf_sweep_write_table(tmp_path, capsys):
    """--write-table: per config the fastest checked spill-free FA2-class variant over every
    seqlen FA2 ran at goes into the table, with its flipped switches as ``options``."""
    from flashgen import tuning

    ps = _perf_sweep()
    ok = {"ok": True}

    def row(impl, s, tf, causal=False, **kw):
        return {"d": 256, "causal": causal, "dtype": "bf16", "seqlen": s, "direction": "fwd",
                "impl": impl, "tflops": tf, **kw}  # fmt: skip

    fg = {"spill_bytes": 0, "check": ok, "registers": 241}
    rows = [
        row("sdpa-flash", 4096, 300.0), row("sdpa-flash", 16384, 320.0),
        row("fg:fa3-default", 4096, 900.0, tiles="128x80x12", **fg),
        row("fg:fa3-default", 16384, 900.0, tiles="128x80x12", **fg),
        row("fg:default", 4096, 280.0, tiles="128x64x8", options={}, **fg),
        row("fg:default", 16384, 300.0, tiles="128x64x8", options={}, **fg),
        row("fg:t64x64x4-unroll", 4096, 310.0, tiles="64x64x4",
            options={"fwd_unrolled_loads": False}, **fg),
        row("fg:t64x64x4-unroll", 16384, 330.0, tiles="64x64x4",
            options={"fwd_unrolled_loads": False}, **fg),
        row("fg:t64x48x4", 16384, 999.0, tiles="64x48x4", options={}, **fg),  # not at 4096
        row("fg:t128x48x8", 4096, 999.0, tiles="128x48x8", spill_bytes=8, check=ok),
        row("fg:t128x48x8", 16384, 999.0, tiles="128x48x8", spill_bytes=8, check=ok),
        row("sdpa-flash", 4096, 290.0, True),
        row("fg:default", 4096, 295.0, True, tiles="128x64x8", options={}, **fg),
        row("fg:t64x64x4", 4096, 999.0, True, tiles="64x64x4", options={}, spill_bytes=0,
            check={"ok": False}),
    ]  # fmt: skip
    winners = ps.table_winners(rows)
    assert winners[(256, False, "bf16")]["impl"] == "fg:t64x64x4-unroll"
    assert winners[(256, False, "bf16")]["tflops"] == 320.0
    assert winners[(256, True, "bf16")]["impl"] == "fg:default"
    path = tmp_path / "table.json"
    ps.write_table(winners, "NVIDIA H200", "sm_90", path)
    assert "NVIDIA H200|sm_90|256|bf16|noncausal|none" in capsys.readouterr().out
    entries = tuning.load_table(path)
    full = entries["NVIDIA H200|sm_90|256|bf16|noncausal|none"]
    assert (full["block_m"], full["block_n"], full["num_warps"]) == (64, 64, 4)
    assert full["options"] == {"fwd_unrolled_loads": False}
    assert full["vs_fa2"] == {"4096": 1.033, "16384": 1.031}
    causal = entries["NVIDIA H200|sm_90|256|bf16|causal|none"]
    assert (causal["block_m"], causal["num_warps"]) == (128, 8) and "options" not in causal
    assert tuning.lookup_options("NVIDIA H200", "sm_90", 256, "bf16", False, False, path) == {
        "fwd_unrolled_loads": False
    }
