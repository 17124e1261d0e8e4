"""Template code-generation switches (lower.FORWARD_OPTIONS / BACKWARD_OPTIONS) and the
variant list of tools/perf_sweep.py.  CPU only: planning and rendering, no nvcc."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest

from flashgen import lower
from flashgen.lower import plan_backward, plan_forward
from flashgen.render import render
from flashgen.spec import loads_spec

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


@pytest.mark.parametrize("key", sorted(lower.FORWARD_OPTIONS))
def test_each_forward_switch_changes_the_source(key):
    spec = _spec()
    on = render(plan_forward(spec, "sm_90", options={key: True}))
    off = render(plan_forward(spec, "sm_90", options={key: False}))
    assert on != off


def test_every_forward_switch_combination_renders():
    keys = sorted(lower.FORWARD_OPTIONS)
    for spec in (
        _spec(),
        _spec(mask="null", score_mod="score * 0.5"),
        _spec("causal && q_idx - kv_idx < 64"),
    ):
        for values in itertools.product((False, True), repeat=len(keys)):
            src = render(plan_forward(spec, "sm_80", options=dict(zip(keys, values, strict=True))))
            assert "__global__" in src


def test_fold_scale_only_without_score_mod():
    plain = plan_forward(_spec(), "sm_80")
    modded = plan_forward(_spec(score_mod="score * 0.5"), "sm_80")
    assert plain.context["fold_scale"] is lower.FORWARD_OPTIONS["fwd_fold_scale"]
    assert modded.context["fold_scale"] is False
    assert "fmaf(acc_s" not in render(modded)


@pytest.mark.parametrize("key", sorted(lower.BACKWARD_OPTIONS))
def test_each_backward_switch_changes_the_source(key):
    on = render(plan_backward(_spec(), "sm_90", options={key: True}).unit)
    off = render(plan_backward(_spec(), "sm_90", options={key: False}).unit)
    assert on != off


def test_async_stats_only_without_score_mod():
    src = render(plan_backward(_spec(score_mod="score * 0.5"), "sm_90").unit)
    assert "cp_async_4(" not in src.split("__global__", 1)[1]


def test_default_tiles_key_counts_residual_masks():
    assert lower.default_tiles(_spec()) == lower.DEFAULT_TILES[(128, False)]
    swa = _spec("causal && q_idx - kv_idx < 64")
    assert lower.default_tiles(swa) == lower.DEFAULT_TILES[(128, True)]
    assert (
        lower.default_tiles(_spec(d=64, score_mod="score * 0.5"))
        == lower.DEFAULT_TILES[(64, False)]
    )


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
            render(plan_forward(spec, "sm_90", tiles=v.tiles, options=opts))
        else:
            render(
                plan_backward(spec, "sm_90", atomic_dq=v.atomic, tiles=v.tiles, options=opts).unit
            )
    quick = ps.all_variants(ps.parse(["--quick"]))
    assert {v.name for v in quick} == {"base", "default", "det", "atomic", "atomic-n128"}


def test_perf_sweep_flops():
    ps = _perf_sweep()
    # B*S = 16384 tokens, H = 2048 / D: 4 * B * H * S^2 * D
    assert ps.flops(128, False, 16384, "fwd") == 4 * 1 * 16 * 16384**2 * 128
    assert ps.flops(128, True, 4096, "fwd") == 4 * 4 * 16 * 4096**2 * 128 / 2
    assert ps.flops(64, False, 4096, "bwd") == 2.5 * 4 * 4 * 32 * 4096**2 * 64
