"""Template code-generation switches (FORWARD_OPTIONS / BACKWARD_OPTIONS).  CPU only:
planning and rendering, no nvcc."""

from __future__ import annotations

import itertools

import pytest
from plan_helpers import choose_tiles, plan_backward, plan_forward

from flashgen.build.render import render
from flashgen.codegen.plan import TileConfig
from flashgen.families import fa2_fwd
from flashgen.families.fa2_bwd import BACKWARD_OPTIONS
from flashgen.families.fa2_fwd import FORWARD_OPTIONS, uses_load_chain
from flashgen.families.tiles import DEFAULT_TILES, HOPPER_TILES, MASK_TILES, default_tiles
from flashgen.frontend.spec import loads_spec
from flashgen.ops.prefill.varlen import varlen_spec


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
