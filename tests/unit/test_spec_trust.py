"""Issue 22, front end: a hostile or careless spec gets a clear error at its line, never a
traceback, a hang, unbounded memory, raw terminal escapes or a spec that checks but cannot
register."""

from __future__ import annotations

import os
import warnings

import pytest

from flashgen import SpecError, load_spec, loads_spec
from flashgen.frontend import check
from flashgen.frontend import spec as specmod
from flashgen.frontend.errors import SpecWarning, terminal_safe
from flashgen.frontend.parse import MAX_DEPTH

HEAD = "name: t\nhead_dim: 64\ndtype: fp16\n"


def err(text: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        loads_spec(text, "t.yaml")
    return info.value


# ----------------------------------------------------------------------------- item 3
def test_terminal_escapes_in_errors_are_inert():
    osc52 = "\x1b]52;c;cHduZWQ=\x07"
    e = err(HEAD + f'"bad{osc52}key": 1\n')
    text = str(e)
    assert "\x1b" not in text and "\x07" not in text
    assert "\\x1b]52" in text
    assert terminal_safe("a\u202eb\tc") == "a\\u202eb\tc"
    assert terminal_safe("plain text") == "plain text"


# ----------------------------------------------------------------------------- item 4
def test_spec_must_be_a_regular_file(tmp_path):
    with pytest.raises(SpecError, match="character device"):
        load_spec("/dev/zero")
    link = tmp_path / "zero.yaml"
    link.symlink_to("/dev/zero")
    with pytest.raises(SpecError, match="regular file"):
        load_spec(link)
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    with pytest.raises(SpecError, match="FIFO"):  # opened without blocking: no hang
        load_spec(fifo)
    with pytest.raises(SpecError, match="a directory"):
        load_spec(tmp_path)


def test_spec_size_limits(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text(HEAD + "description: " + "x" * specmod.MAX_SPEC_BYTES + "\n")
    with pytest.raises(SpecError, match="MAX_SPEC_BYTES") as info:
        load_spec(big)
    assert info.value.file == str(big)
    e = err(HEAD + "description: " + "y" * (specmod.MAX_DESCRIPTION + 1) + "\n")
    assert "MAX_DESCRIPTION" in e.message and e.line == 4


# ----------------------------------------------------------------------------- item 5, 6
def test_expression_node_count_is_bounded():
    terms = " + ".join(["min(q_idx, 1)"] * 40)  # 160 nodes, 40 deep: within MAX_DEPTH
    deep = " + ".join(f"({terms})" for _ in range(check.MAX_NODES // 160 + 2))
    e = err(HEAD + f"mask: q_idx >= ({deep})\n")
    assert "MAX_NODES" in e.message and e.line == 4


def test_long_flat_sum_names_the_limit_and_clips_the_line():
    terms = " + ".join(f"kv_idx * {i}" for i in range(MAX_DEPTH + 1))
    e = err(HEAD + f"mask: q_idx >= {terms}\n")
    assert "MAX_DEPTH" in e.message and "terms" in e.message
    shown = str(e).splitlines()[1]
    assert len(shown) < 140 and "..." in shown


# ----------------------------------------------------------------------------- item 7
@pytest.mark.parametrize(
    "line",
    [
        "head_dim: " + "9" * 5000,
        "mask: 2001-13-45",
        "head_dim: !!int abc",
        "softmax_scale: !!float x",
        "varlen: !!bool maybe",
        "description: !!timestamp x",
    ],
)
def test_yaml_edge_cases_are_spec_errors_at_their_line(line):
    key = line.split(":")[0]
    text = "\n".join(x for x in HEAD.splitlines() if not x.startswith(key + ":"))
    e = err(text + "\n" + line + "\n")
    assert e.line == text.count("\n") + 2
    assert len(str(e)) < 1000


# ----------------------------------------------------------------------------- item 10
def test_exclusive_bounds_and_zero_divisor_warning():
    text = HEAD + "score_mod: score / c\nparams:\n  c: {type: f32, default: 0.5%s}\n"
    with pytest.warns(SpecWarning, match=r"t.yaml:4:18: warning: .*'c'.*can be 0"):
        loads_spec(text % "", "t.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec = loads_spec(text % ", above: 0", "t.yaml")
        assert 0 < spec.params[0].minimum < 1e-44  # the smallest float32 above 0
        spec = loads_spec(text % ", min: 0.25", "t.yaml")
    assert err(text % ", min: 0, above: 0").line == 6
    i = loads_spec(HEAD + "mask: q_idx < c\nparams:\n  c: {type: i32, default: 5, above: 0}\n")
    assert i.params[0].minimum == 1
    zero = err(text.replace("0.5", "0.0") % ", above: 0").message
    assert "is not above 0.0 (declared above)" in zero


def test_shipped_specs_check_without_warnings():
    from pathlib import Path

    specs = sorted((Path(__file__).resolve().parents[2] / "specs").glob("*.yaml"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpecWarning)
        for p in specs:
            load_spec(p)
    gemma = load_spec(specs[0].with_name("gemma2_softcap.yaml"))
    assert gemma.params[0].minimum > 0


# ----------------------------------------------------------------------------- item 11
@pytest.mark.parametrize(
    "name", ["foo__varlen", "foo__backward", "name", "a__b"]
)
def test_names_that_cannot_register_are_refused(name):
    e = err(f"name: {name}\nhead_dim: 64\ndtype: fp16\n")
    assert e.line == 1


def test_name_with_trailing_newline_is_refused():
    e = err('name: "nl\\n"\nhead_dim: 64\ndtype: fp16\n')
    assert e.line == 1 and "invalid name" in e.message


@pytest.mark.parametrize("param", sorted(check.OP_KEYWORDS | {"name"}))
def test_op_keywords_are_reserved(param):
    e = err(HEAD + f"params:\n  {param}: {{type: i32, default: 1}}\n")
    assert e.line == 5 and "reserved" in e.message


def test_param_count_is_bounded():
    n = check.MAX_PARAMS + 1
    params = "".join(f"  p{i}: {{type: i32, default: 1}}\n" for i in range(n))
    e = err(HEAD + "params:\n" + params)
    assert "MAX_PARAMS" in e.message and e.line == 5 + check.MAX_PARAMS


# ----------------------------------------------------------------------------- item 12
def test_oversized_tiles_are_a_spec_error_at_the_tiles_line():
    text = "name: t\nhead_dim: 256\ndtype: bf16\ntiles: {block_m: 128, block_n: 128}\n"
    e = err(text)
    assert e.line == 4 and "shared memory" in e.message and "sm_80" in e.message
    assert "ValueError" not in str(e)


def test_tile_budget_matches_the_lowering():
    """The checker's budget is the lowering's: every tile pair it accepts plans, every one
    it refuses raises in plan_forward."""
    from flashgen.codegen.abi import TABLE_ROW_SMEM
    from flashgen.codegen.plan import TileConfig
    from flashgen.families.common import SMEM_LIMIT
    from flashgen.families.registry import plan_forward

    assert check.SMEM_LIMIT == SMEM_LIMIT
    assert check.TABLE_ROW_SMEM == TABLE_ROW_SMEM
    for d in (64, 128, 256):
        for bm in (64, 128):
            for bn in (32, 64, 128):
                text = (
                    f"name: t\nhead_dim: {d}\ndtype: bf16\ntargets: [sm_80]\n"
                    f"tiles: {{block_m: {bm}, block_n: {bn}, num_warps: 4}}\n"
                )
                try:
                    spec = loads_spec(text)
                except SpecError:
                    with pytest.raises(ValueError, match="shared memory"):
                        plan_forward(loads_spec(text.replace("tiles", "#")), "sm_80",
                                     tiles=TileConfig(bm, bn, 4))  # fmt: skip
                    continue
                plan_forward(spec, "sm_80")
