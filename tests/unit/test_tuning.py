"""The tuning table (flashgen/tuning) and its use by lower.choose_tiles."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from plan_helpers import choose_tiles, plan_forward

from flashgen import tuning
from flashgen.codegen.plan import TileConfig
from flashgen.families.tiles import DEFAULT_TILES, HOPPER_TILES, default_tiles
from flashgen.frontend.ir import TileOverride
from flashgen.frontend.spec import loads_spec

GPU = "NVIDIA H200"

SPEC = """
name: tt_causal
head_dim: 128
dtype: bf16
mask: causal
"""


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A fresh table file selected through $FLASHGEN_TUNING_TABLE."""
    path = tmp_path / "table.json"
    monkeypatch.setenv(tuning.ENV, str(path))
    return path


def _entry(bm, bn, nw):
    return {"block_m": bm, "block_n": bn, "num_warps": nw, "tflops": 300.0, "date": "2026-11-30"}


def test_key_format():
    key = tuning.table_key(GPU, "sm_90", 128, "bf16", True, False)
    assert key == "NVIDIA H200|sm_90|128|bf16|causal|none"
    assert tuning.table_key(GPU, "sm_80", 256, "fp16", False, True).endswith(
        "|sm_80|256|fp16|noncausal|score_mod"
    )


def test_shipped_table_is_valid_json():
    doc = json.loads(tuning.default_path().read_text())
    entries = doc.get("entries", doc)
    assert isinstance(entries, dict)
    for key, entry in entries.items():
        assert len(key.split("|")) == 6, key
        assert tuning.valid_entry(entry), (key, entry)


def test_untuned_key_falls_back_to_default(table):
    spec = loads_spec(SPEC)
    # sm_90's default family is the Hopper kernel; an FA2-shaped entry does not replace it
    assert choose_tiles(spec, "sm_90", GPU) == HOPPER_TILES[(128, False)]
    assert choose_tiles(spec, "sm_90", GPU, family="fa2") == DEFAULT_TILES[(128, False)]
    assert choose_tiles(spec, "sm_90", family="fa2") == DEFAULT_TILES[(128, False)]


def test_tuned_key_is_used_only_for_its_gpu_and_key(table):
    spec = loads_spec(SPEC)
    tuning.update_table(tuning.table_key(GPU, "sm_90", 128, "bf16", True, False), _entry(64, 64, 4))
    assert choose_tiles(spec, "sm_90", GPU, family="fa2") == TileConfig(64, 64, 4)
    # no GPU name (offline build), another GPU, another target: defaults
    assert choose_tiles(spec, "sm_90", family="fa2") == DEFAULT_TILES[(128, False)]
    assert (
        choose_tiles(spec, "sm_90", "NVIDIA A100-SXM4-80GB", family="fa2")
        == DEFAULT_TILES[(128, False)]
    )
    assert choose_tiles(spec, "sm_80", GPU) == DEFAULT_TILES[(128, False)]
    # the key distinguishes dtype, causal and score_mod
    for other in (
        replace(spec, dtype="fp16"),
        replace(spec, mask=None),
        loads_spec(SPEC + "score_mod: score * 2.0\n"),
    ):
        assert choose_tiles(other, "sm_90", GPU, family="fa2") == default_tiles(other)


def test_causal_conjunct_counts_as_causal(table):
    tuning.update_table(tuning.table_key(GPU, "sm_90", 128, "bf16", True, False), _entry(64, 32, 4))
    swa = loads_spec(
        "name: tt_swa\nhead_dim: 128\ndtype: bf16\nmask: causal && q_idx - kv_idx < 256\n"
    )
    assert choose_tiles(swa, "sm_90", GPU, family="fa2") == TileConfig(64, 32, 4)


def test_spec_override_wins_over_table(table):
    tuning.update_table(tuning.table_key(GPU, "sm_90", 128, "bf16", True, False), _entry(64, 64, 4))
    spec = replace(loads_spec(SPEC), tiles=TileOverride(block_n=32))
    assert choose_tiles(spec, "sm_90", GPU, family="fa2") == TileConfig(64, 32, 4)
    spec = replace(loads_spec(SPEC), tiles=TileOverride(128, 128, 8))
    assert choose_tiles(spec, "sm_90", GPU, family="fa2") == TileConfig(128, 128, 8)


def test_plan_and_source_follow_the_table(table):
    spec = loads_spec(SPEC)
    before = plan_forward(spec, "sm_90", gpu=GPU, family="fa2")
    tuning.update_table(tuning.table_key(GPU, "sm_90", 128, "bf16", True, False), _entry(64, 64, 4))
    after = plan_forward(spec, "sm_90", gpu=GPU, family="fa2")
    assert (after.tiles.block_m, after.tiles.block_n) == (64, 64)
    assert after.context["block_n"] == 64 and after.tiles != before.tiles
    from flashgen.build.render import render

    # tiles are rendered into the source, so the kernel cache key changes with the table
    assert "BLOCK_N = 64;" in render(after) and render(after) != render(before)


def test_invalid_and_missing_tables_are_ignored(table):
    spec = loads_spec(SPEC)
    table.write_text("{not json")
    assert tuning.load_table() == {}
    assert choose_tiles(spec, "sm_90", GPU, family="fa2") == DEFAULT_TILES[(128, False)]
    key = tuning.table_key(GPU, "sm_90", 128, "bf16", True, False)
    table.write_text(json.dumps({"entries": {key: {"block_m": 96, "block_n": 64, "num_warps": 4}}}))
    assert (
        choose_tiles(spec, "sm_90", GPU, family="fa2") == DEFAULT_TILES[(128, False)]
    )  # 96 % 64 != 0
    table.write_text(json.dumps({key: _entry(64, 48, 4)}))  # flat form is read too
    assert choose_tiles(spec, "sm_90", GPU, family="fa2") == TileConfig(64, 48, 4)


def test_update_table_keeps_other_keys_and_rejects_bad_entries(table):
    k1 = tuning.table_key(GPU, "sm_90", 64, "bf16", False, False)
    k2 = tuning.table_key(GPU, "sm_90", 256, "fp16", True, True)
    tuning.update_table(k2, _entry(64, 32, 4))
    tuning.update_table(k1, _entry(128, 64, 4))
    doc = json.loads(table.read_text())
    assert list(doc["entries"]) == sorted([k1, k2])
    with pytest.raises(ValueError):
        tuning.update_table(k1, {"block_m": 64, "block_n": 40, "num_warps": 4})
    assert tuning.lookup(GPU, "sm_90", 64, "bf16", False, False) == (128, 64, 4)
    assert tuning.lookup(None, "sm_90", 64, "bf16", False, False) is None


def test_hopper_entries_are_tuned_and_used_only_by_the_hopper_kernel(table):
    from flashgen.bench import autotune

    hopper = [t for t in autotune.candidates("sm_90") if t.num_warps == 12]
    assert hopper and all(t.block_m == 128 for t in hopper)
    assert not [t for t in autotune.candidates("sm_80") if t.num_warps == 12]
    assert tuning.valid_entry(_entry(128, 80, 12)) and not tuning.valid_entry(_entry(96, 80, 12))
    spec = loads_spec(SPEC)
    tuning.update_table(
        tuning.table_key(GPU, "sm_90", 128, "bf16", True, False), _entry(128, 176, 12)
    )
    assert choose_tiles(spec, "sm_90", GPU) == TileConfig(128, 176, 12)
    assert plan_forward(spec, "sm_90", gpu=GPU).template == "sm_90/fwd.cu.j2"
    # the FA2-class kernel ignores a Hopper entry and keeps its default
    fa2 = choose_tiles(spec, "sm_90", GPU, family="fa2")
    assert (
        fa2.num_warps in (4, 8)
        and plan_forward(spec, "sm_90", gpu=GPU, family="fa2").template == "sm_80/fwd.cu.j2"
    )


def test_entry_options_come_with_the_entry_tiles(table):
    """An entry's ``options`` (template switches timed with its tiles) reach the FA2-class
    plan with those tiles only: explicit options, pinned tiles and the Hopper kernel win."""
    key = tuning.table_key(GPU, "sm_90", 128, "bf16", True, False)
    rolled = {**_entry(64, 64, 4), "options": {"fwd_unrolled_loads": False}}
    assert tuning.valid_entry(rolled)
    assert not tuning.valid_entry({**_entry(64, 64, 4), "options": {"fwd_unrolled_loads": 0}})
    assert not tuning.valid_entry({**_entry(64, 64, 4), "options": ["fwd_unrolled_loads"]})
    spec = loads_spec(SPEC)
    assert plan_forward(spec, "sm_90", gpu=GPU, family="fa2").context["fwd_unrolled_loads"]
    tuning.update_table(key, rolled)
    assert tuning.lookup_options(GPU, "sm_90", 128, "bf16", True, False) == {
        "fwd_unrolled_loads": False
    }
    assert tuning.lookup_options(None, "sm_90", 128, "bf16", True, False) == {}
    plan = plan_forward(spec, "sm_90", gpu=GPU, family="fa2")
    assert plan.tiles == TileConfig(64, 64, 4) and not plan.context["fwd_unrolled_loads"]
    # without the GPU name (offline builds) neither the tiles nor the options apply
    assert plan_forward(spec, "sm_90", family="fa2").context["fwd_unrolled_loads"]
    explicit = plan_forward(
        spec, "sm_90", gpu=GPU, family="fa2", options={"fwd_unrolled_loads": True}
    )
    assert explicit.context["fwd_unrolled_loads"]
    # the same tiles passed explicitly (family_build.build_forward's first candidate) keep them;
    # other tiles (a spill fallback) do not get them
    same = plan_forward(spec, "sm_90", gpu=GPU, family="fa2", tiles=TileConfig(64, 64, 4))
    assert not same.context["fwd_unrolled_loads"]
    other = plan_forward(spec, "sm_90", gpu=GPU, family="fa2", tiles=TileConfig(64, 32, 4))
    assert other.context["fwd_unrolled_loads"]
    from plan_helpers import forward_tile_candidates

    assert forward_tile_candidates(spec, "sm_90", GPU, "fa2")[0] == TileConfig(64, 64, 4)
    # family_build.build_forward plans its candidates with the default family: the tiles decide
    assert not plan_forward(spec, "sm_90", GPU, tiles=TileConfig(64, 64, 4)).context[
        "fwd_unrolled_loads"
    ]
    spec_pinned = replace(spec, tiles=TileOverride(block_n=32))
    assert plan_forward(spec_pinned, "sm_90", gpu=GPU, family="fa2").context["fwd_unrolled_loads"]
    assert plan_forward(spec, "sm_90", gpu=GPU).template == "sm_90/fwd.cu.j2"
    # a Hopper entry's options (none are defined) never reach the FA2-class kernel
    tuning.update_table(key, {**_entry(128, 176, 12), "options": {"fwd_unrolled_loads": False}})
    assert plan_forward(spec, "sm_90", gpu=GPU, family="fa2").context["fwd_unrolled_loads"]
