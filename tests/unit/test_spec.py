"""Spec loading: fields, YAML errors, locations, and the shipped specs."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from flashgen.frontend import ir
from flashgen.frontend.errors import SpecError
from flashgen.frontend.spec import load_spec, loads_spec

SPECS = sorted((Path(__file__).resolve().parents[2] / "specs").glob("*.yaml"))

BASE = """\
name: demo
head_dim: 128
dtype: bf16
mask: causal
"""


def write(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "spec.yaml"
    f.write_text(text)
    return f


def fails(tmp_path: Path, text: str) -> SpecError:
    f = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_spec(f)
    e = info.value
    assert e.file == str(f)
    return e


def at(e: SpecError) -> tuple[int, int]:
    return e.line, e.col


# ----------------------------------------------------------------------------- shipped specs
def test_all_eleven_specs_ship():
    names = {p.stem for p in SPECS}
    assert names >= {
        "causal_d128",
        "chunked_local",
        "prefix_lm",
        "llama3_gqa",
        "gpt2_d64",
        "bidir_d256",
        "mistral_swa",
        "gemma2_softcap",
        "alibi",
        "document_mask",
        "t5_bias",
    }


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_shipped_spec_loads(path):
    s = load_spec(path)
    assert s.name == path.stem
    assert s.targets == (("sm_90",) if s.dtype == "fp8_e4m3" else ("sm_80", "sm_90"))
    assert s.description
    assert s.source == path.read_text()
    assert s.path == str(path)
    for root in (s.mask, s.score_mod):
        if root is not None:
            assert all(n.ty is not None for n in ir.walk(root))
    if s.mask is not None:
        assert s.mask.ty == ir.Ty.BOOL


def test_shipped_spec_details():
    by = {p.stem: load_spec(p) for p in SPECS}
    assert by["gpt2_d64"].dtype == "fp16" and by["gpt2_d64"].head_dim == 64
    assert by["bidir_d256"].mask is None and by["bidir_d256"].head_dim == 256
    assert "GQA" in by["llama3_gqa"].description
    w = by["mistral_swa"].param("window")
    assert (w.kind, w.ty, w.default) == ("scalar", ir.Ty.I32, 4096)
    sc = by["gemma2_softcap"].param("softcap")
    assert (sc.kind, sc.ty, sc.default) == ("scalar", ir.Ty.F32, 50.0)
    assert by["gemma2_softcap"].score_mod.ty == ir.Ty.F32
    sl = by["alibi"].param("slopes")
    assert (sl.kind, sl.ty, sl.shape) == ("tensor", ir.Ty.F32, ("num_heads",))


# ----------------------------------------------------------------------------- good specs
def test_defaults():
    s = loads_spec(BASE)
    assert s.head_dim_v == 128
    assert s.targets == ("sm_80", "sm_90")
    assert s.softmax_scale is None
    assert s.tiles == ir.TileOverride()
    assert s.score_mod is None
    assert s.description == ""
    assert s.path == "<string>" and s.source == BASE
    assert isinstance(s.mask, ir.Causal)


def test_all_fields():
    s = loads_spec(
        BASE
        + """\
head_dim_v: 64
targets: [sm_90]
score_mod: score * scale + bias[h, 0]
params:
  scale: {type: f32, default: 2}
  bias: {type: f32, shape: [num_heads, 4]}
softmax_scale: 0.125
tiles: {block_m: 64, block_n: 32, num_warps: 4}
description: demo spec
"""
    )
    assert s.head_dim_v == 64
    assert s.targets == ("sm_90",)
    assert s.param("scale").default == 2.0 and isinstance(s.param("scale").default, float)
    assert s.param("bias").shape == ("num_heads", 4)
    assert s.softmax_scale == 0.125
    assert s.tiles == ir.TileOverride(64, 32, 4)
    assert s.description == "demo spec"


def test_mask_bool_literal():
    s = loads_spec(BASE.replace("mask: causal", "mask: true"))
    assert s.mask == ir.Const(True, ty=ir.Ty.BOOL)
    with pytest.raises(SpecError, match="mask is never true"):  # every row would be empty
        loads_spec(BASE.replace("mask: causal", "mask: false"))


def test_mask_null_and_softmax_auto():
    s = loads_spec(BASE.replace("mask: causal", "mask: null\nsoftmax_scale: auto"))
    assert s.mask is None and s.softmax_scale is None


def test_expression_columns_for_scalar_styles():
    plain = loads_spec(BASE.replace("mask: causal", "mask: q_idx >= kv_idx"))
    assert (plain.mask.lhs.span.line, plain.mask.lhs.span.col) == (4, 7)
    dq = loads_spec(BASE.replace("mask: causal", 'mask: "q_idx >= kv_idx"'))
    assert dq.mask.lhs.span.col == 8
    sq = loads_spec(BASE.replace("mask: causal", "mask: 'q_idx >= kv_idx'"))
    assert sq.mask.lhs.span.col == 8
    block = loads_spec(BASE.replace("mask: causal", "mask: |\n  causal &&\n    q_idx >= kv_idx"))
    assert (block.mask.span.line, block.mask.span.col) == (5, 10)
    assert (block.mask.rhs.lhs.span.line, block.mask.rhs.lhs.span.col) == (6, 5)


# ----------------------------------------------------------------------------- bad specs
def test_unknown_identifier_has_line_col_and_suggestion(tmp_path):
    text = BASE.replace(
        "mask: causal",
        "mask: causal && q_idx - kv_idx < windw\nparams:\n  window: {type: i32, default: 8}",
    )
    e = fails(tmp_path, text)
    assert at(e) == (4, 34)
    assert e.message == "unknown identifier 'windw' (did you mean 'window'?)"
    assert e.source_line == "mask: causal && q_idx - kv_idx < windw"
    lines = str(e).splitlines()
    assert lines[0].endswith(
        "spec.yaml:4:34: error: unknown identifier 'windw' (did you mean 'window'?)"
    )
    assert lines[2].index("^") == 4 + 33


def test_mask_not_bool(tmp_path):
    e = fails(tmp_path, BASE.replace("mask: causal", "mask: q_idx + 1"))
    assert at(e) == (4, 7)
    assert "mask must be a bool" in e.message and "i32" in e.message


def test_bad_dtype(tmp_path):
    e = fails(tmp_path, BASE.replace("dtype: bf16", "dtype: bf61"))
    assert at(e) == (3, 8)
    assert "unknown dtype 'bf61'" in e.message and "did you mean 'bf16'" in e.message


FP8 = BASE.replace("dtype: bf16", "dtype: fp8_e4m3")


def test_fp8_spec_defaults_to_sm_90(tmp_path):
    spec = load_spec(write(tmp_path, FP8))
    assert spec.dtype == "fp8_e4m3" and spec.targets == ("sm_90",)
    assert load_spec(write(tmp_path, FP8 + "targets: [sm_90]\n")).targets == ("sm_90",)
    assert load_spec(write(tmp_path, BASE)).targets == ("sm_80", "sm_90")


@pytest.mark.parametrize(
    "targets, pos",
    [("targets: [sm_80, sm_90]\n", (5, 11)), ("targets: [sm_90, sm_80]\n", (5, 18)),
     ("targets:\n  - sm_80\n", (6, 5))],
)  # fmt: skip
def test_fp8_on_sm_80_is_refused_at_the_target(tmp_path, targets, pos):
    e = fails(tmp_path, FP8 + targets)
    assert at(e) == pos
    assert "target 'sm_80' cannot run dtype fp8_e4m3" in e.message
    assert "no FP8 tensor cores" in e.message and "sm_90 only" in e.message


@pytest.mark.parametrize(
    "change, pos, fragment",
    [
        (("head_dim: 128", "head_dim: 96"), (2, 11), "supports head_dim 64, 128, 256"),
        (("mask: causal", "mask: causal\nhead_dim_v: 64"), (5, 13), "head_dim_v == head_dim"),
        (("mask: causal", "mask: causal\nvarlen: true"), (5, 9), "no varlen form"),
        (("mask: causal", "mask: causal\ntiles: {block_m: 64}"), (5, 18), "cannot pin tiles"),
    ],
)
def test_fp8_limits_of_the_hopper_kernel(tmp_path, change, pos, fragment):
    e = fails(tmp_path, FP8.replace(*change))
    assert at(e) == pos
    assert fragment in e.message and "fp8_e4m3" in e.message


def test_fp8_spec_accepts_every_hopper_head_dim_and_params(tmp_path):
    for d in (64, 128, 256):
        text = FP8.replace("head_dim: 128", f"head_dim: {d}")
        text += "params:\n  window: {type: i32, default: 16}\n"
        assert load_spec(write(tmp_path, text)).head_dim == d


def test_unsupported_head_dim(tmp_path):
    e = fails(tmp_path, BASE.replace("head_dim: 128", "head_dim: 100"))
    assert at(e) == (2, 11)
    assert "head_dim 100 is not supported" in e.message
    assert "(supported: 32, 64, 96, 128, 160, 192, 256)" in e.message


@pytest.mark.parametrize("d", [16, 48, 80, 224, 512])
def test_other_head_dims_are_rejected_with_the_list(tmp_path, d):
    e = fails(tmp_path, BASE.replace("head_dim: 128", f"head_dim: {d}"))
    assert at(e) == (2, 11)
    assert f"head_dim {d} is not supported (supported: 32, 64, 96, 128, 160, 192, 256)" in str(e)


@pytest.mark.parametrize("d", [32, 64, 96, 128, 160, 192, 256])
def test_every_supported_head_dim_loads(d):
    s = loads_spec(BASE.replace("head_dim: 128", f"head_dim: {d}"))
    assert (s.head_dim, s.head_dim_v) == (d, d)


@pytest.mark.parametrize("d, dv", [(192, 128), (128, 256), (32, 96)])
def test_head_dim_v_differs(d, dv):
    s = loads_spec(BASE.replace("head_dim: 128", f"head_dim: {d}\nhead_dim_v: {dv}"))
    assert (s.head_dim, s.head_dim_v) == (d, dv)


def test_unsupported_head_dim_v(tmp_path):
    e = fails(tmp_path, BASE + "head_dim_v: 80\n")
    assert at(e) == (5, 13)
    assert "head_dim_v 80 is not supported (supported: 32, 64," in e.message


def test_head_dim_wrong_type(tmp_path):
    e = fails(tmp_path, BASE.replace("head_dim: 128", "head_dim: big"))
    assert at(e) == (2, 11)
    assert "head_dim must be an integer" in e.message


def test_missing_name(tmp_path):
    e = fails(tmp_path, BASE.replace("name: demo\n", ""))
    assert at(e) == (1, 1)
    assert "missing required field 'name'" in e.message


@pytest.mark.parametrize(
    "bad", ["../x", "a.b", "a/b", "Demo", "1x", "x" * 65, "class", "attention"]
)
def test_bad_names(tmp_path, bad):
    e = fails(tmp_path, BASE.replace("name: demo", f"name: '{bad}'"))
    assert at(e) == (1, 7)
    assert "name" in e.message


def test_name_must_be_string(tmp_path):
    e = fails(tmp_path, BASE.replace("name: demo", "name: 12"))
    assert at(e) == (1, 7)
    assert "name must be a string" in e.message


def test_unknown_field(tmp_path):
    e = fails(tmp_path, BASE + "score_mood: score\n")
    assert at(e) == (5, 1)
    assert "unknown field 'score_mood'" in e.message and "did you mean 'score_mod'" in e.message


def test_duplicate_field(tmp_path):
    e = fails(tmp_path, BASE + "dtype: fp16\n")
    assert at(e) == (5, 1)
    assert "duplicate key 'dtype'" in e.message


def test_yaml_syntax_error(tmp_path):
    e = fails(tmp_path, "name: demo\nhead_dim: [128\ndtype: bf16\n")
    assert e.message.startswith("invalid YAML")
    assert e.line == 3


def test_yaml_syntax_error_mapping_values(tmp_path):
    e = fails(tmp_path, BASE + "description: a: b\n")
    assert at(e) == (5, 15)


def test_empty_file(tmp_path):
    e = fails(tmp_path, "")
    assert at(e) == (1, 1) and "empty spec" in e.message


def test_top_level_not_mapping(tmp_path):
    e = fails(tmp_path, "- a\n- b\n")
    assert at(e) == (1, 1) and "must be a mapping" in e.message


def test_expression_syntax_error_position(tmp_path):
    e = fails(tmp_path, BASE.replace("mask: causal", 'mask: "causal && (q_idx > 1"'))
    assert at(e) == (4, 28) and "ends early" in e.message
    e = fails(tmp_path, BASE.replace("mask: causal", "mask: causal & q_idx > 1"))
    assert at(e) == (4, 14) and "did you mean '&&'" in e.message


def test_mask_must_be_scalar(tmp_path):
    e = fails(tmp_path, BASE.replace("mask: causal", "mask: [causal]"))
    assert at(e) == (4, 7) and "mask must be an expression" in e.message


def test_yaml_tag_in_expression(tmp_path):
    e = fails(tmp_path, BASE.replace("mask: causal", "mask: !causal"))
    assert at(e) == (4, 7) and "quote" in e.message


@pytest.mark.parametrize(
    "targets, pos, fragment",
    [
        ("[sm_86]", (5, 11), "unknown target 'sm_86'"),
        ("[sm_80, sm_80]", (5, 18), "listed twice"),
        ("[]", (5, 10), "at least one"),
        ("sm_80", (5, 10), "targets must be a list"),
    ],
)
def test_bad_targets(tmp_path, targets, pos, fragment):
    e = fails(tmp_path, BASE + f"targets: {targets}\n")
    assert at(e) == pos
    assert fragment in e.message


@pytest.mark.parametrize(
    "tiles, pos, fragment",
    [
        ("{block_m: 48}", (5, 18), "tiles.block_m must be one of"),
        ("{block_n: 256}", (5, 18), "tiles.block_n must be one of"),
        ("{num_warps: 3}", (5, 20), "tiles.num_warps must be one of"),
        ("{num_warp: 4}", (5, 9), "did you mean 'num_warps'"),
        ("{block_m: big}", (5, 18), "must be an integer"),
        # lowering refused this without a location: each warp owns 16 query rows
        ("{block_m: 16, block_n: 16, num_warps: 8}", (5, 18), "multiple of 16 * num_warps = 128"),
    ],
)
def test_bad_tiles(tmp_path, tiles, pos, fragment):
    e = fails(tmp_path, BASE + f"tiles: {tiles}\n")
    assert at(e) == pos
    assert fragment in e.message


@pytest.mark.parametrize("value", ["0", "-1.0", "fast", ".inf"])
def test_bad_softmax_scale(tmp_path, value):
    e = fails(tmp_path, BASE + f"softmax_scale: {value}\n")
    assert at(e) == (5, 16)


@pytest.mark.parametrize(
    "param, pos, fragment",
    [
        ("  w: {type: i64, default: 1}", (6, 13), "unknown param type 'i64'"),
        ("  w: {type: i32}", (6, 6), "needs a default"),
        ("  w: {default: 1}", (6, 6), "needs a type"),
        ("  w: {type: i32, default: 1.5}", (6, 27), "must be an integer"),
        ("  w: {type: i32, default: 3000000000}", (6, 27), "does not fit in int32"),
        ("  w: {type: f32, default: true}", (6, 27), "must be a number"),
        ("  w: {type: f32, default: 1, shape: [4]}", (6, 30), "both a default and a shape"),
        ("  w: {type: f32, shape: [num_head]}", (6, 26), "did you mean 'num_heads'"),
        ("  w: {type: f32, shape: [0]}", (6, 26), "positive integer"),
        ("  w: {type: f32, shape: []}", (6, 25), "non-empty shape"),
        ("  w: {type: f32, defualt: 1}", (6, 18), "did you mean 'default'"),
        ("  q_idx: {type: i32, default: 1}", (6, 3), "reserved"),
        ("  score: {type: f32, default: 1}", (6, 3), "reserved"),
        ("  tanh: {type: f32, default: 1}", (6, 3), "reserved"),
        ("  lambda: {type: f32, default: 1}", (6, 3), "reserved"),
        ("  Win: {type: f32, default: 1}", (6, 3), "invalid param name"),
        ("  w: 5", (6, 6), "must be a mapping"),
    ],
)
def test_bad_params(tmp_path, param, pos, fragment):
    e = fails(tmp_path, BASE + "params:\n" + param + "\n")
    assert fragment in e.message
    assert at(e) == pos


def test_spec_error_pickles():
    with pytest.raises(SpecError) as info:
        loads_spec(BASE.replace("dtype: bf16", "dtype: bf61"), "x.yaml")
    e = pickle.loads(pickle.dumps(info.value))
    assert (e.file, e.line, e.col, e.message) == ("x.yaml", 3, 8, info.value.message)
    assert str(e) == str(info.value)


def test_non_utf8_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_bytes(b"name: demo\nhead_dim: 128\xff\n")
    with pytest.raises(SpecError, match="UTF-8") as info:
        load_spec(f)
    assert at(info.value) == (2, 14)


def test_unquoted_ternary_gets_a_quoting_hint(tmp_path):
    e = fails(tmp_path, BASE + "score_mod: q_idx > 0 ? score : 0\n")
    assert at(e) == (5, 30)
    assert "quote an expression" in e.message
    ok = loads_spec(BASE + 'score_mod: "q_idx > 0 ? score : 0"\n')
    assert isinstance(ok.score_mod, ir.Cond) and ok.score_mod.ty == ir.Ty.F32


@pytest.mark.parametrize("key", ["off", "on", "yes", "no"])
def test_a_param_named_like_a_yaml_boolean_says_to_quote_it(tmp_path, key):
    """YAML 1.1 reads a bare off/on/yes/no as a boolean (an offset param called ``off``);
    the error says so and how to fix it, and the quoted name works."""
    text = BASE.replace("mask: causal", f"mask: q_idx - kv_idx < {key}") + (
        f"params:\n  {key}: {{type: i32, default: 4}}\n"
    )
    e = fails(tmp_path, text)
    assert f"got a boolean ({key}): YAML reads a bare {key} that way; quote it ('{key}')" in str(e)
    spec = loads_spec(text.replace(f"  {key}:", f"  '{key}':"))
    assert spec.param(key).default == 4


def test_exponent_floats_without_a_dot_are_numbers(tmp_path):
    """PyYAML (YAML 1.1) reads an unquoted 1e-3 as a string: 'default: 1e-3' of an f32
    param was refused as "must be a number, got the string '1e-3'".  The DSL takes 1e-3."""
    text = BASE.replace("mask: causal", "mask: causal\nscore_mod: score * w") + (
        "softmax_scale: 1e-1\nparams:\n  w: {type: f32, default: 1e-3, min: -1e2, max: 5E+3}\n"
    )
    s = loads_spec(text)
    assert s.softmax_scale == 0.1
    p = s.param("w")
    assert (p.default, p.minimum, p.maximum) == (0.001, -100.0, 5000.0)
    e = fails(tmp_path, text.replace("default: 1e-3", "default: 1e39"))
    assert "must be a finite float32 value, got 1e+39" in e.message
    e = fails(tmp_path, text.replace("default: 1e-3", "default: '1e-3'"))  # quoted: a string
    assert "must be a number, got the string '1e-3'" in e.message
