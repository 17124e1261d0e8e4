"""Specs are untrusted input: no field can inject CUDA, C++ or Python, or escape generated/.

Every injection attempt through a typed field (name, param names, types, defaults,
shapes, expressions, tiles, targets, dtype, head_dim, YAML tags) must be a SpecError
with a location.  The one free-text field, ``description``, is accepted but must come
out inert: the generated ``__init__.py`` still compiles, its docstring is exactly the
description, its code is the fixed template, and the rendered CUDA does not contain it.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest
from plan_helpers import plan_forward

from flashgen import SpecError, loads_spec
from flashgen.build.generate import module_source, write_generated
from flashgen.build.render import render

REPO = Path(__file__).resolve().parents[2]
MARK = "PWNED"  # every payload carries it; it must never reach generated code
PAYLOADS = [
    f'q_idx); system("{MARK}"',
    f'0); }} __global__ void {MARK}() {{ asm("trap;"); }} //',
    f'*/ #include "/etc/{MARK}" /*',
    f'"""; import os; os.system("{MARK}"); """',
    f"\\\n{MARK}",
    f"1;\n#define {MARK} 1\n",
    f"__import__('os').system('{MARK}')",
    f"../../{MARK}",
]
BASE = {
    "name": "victim",
    "head_dim": 64,
    "dtype": "fp16",
    "mask": "causal && q_idx - kv_idx < window",
    "score_mod": "score * scale",
    "params": {
        "window": {"type": "i32", "default": 8},
        "scale": {"type": "f32", "default": 1.0},
        "bias": {"type": "f32", "shape": ["num_heads"]},
    },
}


def spec_text(**fields) -> str:
    """A spec as YAML text (JSON is YAML): BASE with ``fields`` replaced (None drops one)."""
    doc = {**BASE, **fields}
    doc = {k: v for k, v in doc.items() if v is not None}
    return json.dumps(doc, indent=1, ensure_ascii=False)


def artifacts(spec) -> dict[str, str]:
    """Every generated text of ``spec``: rendered CUDA per target and the module source."""
    out = {f"cuda_{t}": render(plan_forward(spec, t)) for t in spec.targets}
    out["module"] = module_source(spec)
    return out


def assert_inert(spec, payload_text: str = MARK) -> None:
    arts = artifacts(spec)
    for what, text in arts.items():
        if what.startswith("cuda"):
            assert payload_text not in text, f"payload reached {what}"
    src = arts["module"]
    tree = compile(src, "<generated __init__>", "exec", ast.PyCF_ONLY_AST)
    code = compile(src, "<generated __init__>", "exec")  # noqa: F841 - must compile
    doc = ast.get_docstring(tree, clean=False)
    assert doc is not None and spec.description.strip() in doc
    # the code after the docstring is the fixed template, whatever the description
    body = [ast.dump(n) for n in tree.body[1:]]
    ref = ast.parse(module_source(dataclasses.replace(spec, description="plain")))
    assert body == [ast.dump(n) for n in ref.body[1:]]
    assert payload_text not in "".join(body)


def test_base_spec_is_valid_and_inert():
    assert_inert(loads_spec(spec_text()))


# ----------------------------------------------------------------------------- typed fields
def _with_param(name=None, **decl):
    params = dict(BASE["params"])
    if name is not None:
        params[name] = {"type": "f32", "default": 1.0, **decl}
    return params


def _field_injections():
    for p in PAYLOADS:
        yield "name", {"name": p}
        yield "name_suffix", {"name": "victim" + p}
        yield "param_name", {"params": _with_param(p), "mask": None, "score_mod": None}
        yield "param_type", {"params": {"x": {"type": f"f32 {p}", "default": 1}}}
        yield "param_default", {"params": {"x": {"type": "f32", "default": p}}}
        yield "param_min", {"params": {"x": {"type": "f32", "default": 1.0, "min": p}}}
        yield "param_shape", {"params": {"x": {"type": "f32", "shape": [p]}}}
        yield "mask", {"mask": p}
        yield "mask_suffix", {"mask": f"q_idx >= kv_idx {p}"}
        yield "score_mod", {"score_mod": p}
        yield "score_mod_call", {"score_mod": f"tanh(score) + {p}(score)"}
        yield "tile", {"tiles": {"block_m": p}}
        yield "target", {"targets": [p]}
        yield "dtype", {"dtype": p}
        yield "head_dim", {"head_dim": p}
        yield "softmax_scale", {"softmax_scale": p}


INJECTIONS = list(_field_injections())


@pytest.mark.parametrize(
    "field, fields",
    INJECTIONS,
    ids=[f"{f}-{i % len(PAYLOADS)}" for i, (f, _) in enumerate(INJECTIONS)],
)
def test_injection_through_typed_fields_is_a_spec_error(field, fields):
    with pytest.raises(SpecError) as info:
        loads_spec(spec_text(**fields), "evil.yaml")
    err = info.value
    assert err.file == "evil.yaml" and err.line >= 1 and err.col >= 1


@pytest.mark.parametrize(
    "expr",
    [
        "q_idx < kv_idx /* x */",
        "q_idx < kv_idx // x",
        "q_idx < kv_idx; x",
        "q_idx < kv_idx # x",
        "q_idx < 'kv_idx'",
        'q_idx < "kv_idx"',
        "q_idx < kv_idx\\",
        "printf(q_idx) > 0",
        "system(1) > 0",
        "__syncthreads() > 0",
        "threadIdx.x < 3",
        "acc_s > 0",  # a kernel local that is not in the DSL's table
        "p_window > 0",  # the lowered name of a param is not a DSL name
        "INFINITY > score",
        "q_idx < 0x10",
        "q_idx < 1e",
        "q_idx < 99999999999",
        "score < 1.0e39",  # beyond float32
        "q_idx / 0 > 1",
        "q_idx % (-0) > 1",
        "bias[h] > 0 && bias[h, h] > 0",
        "bias > 0",
        "`ls` > 0",
        "q_idx <\x00 kv_idx",
    ],
)
def test_expression_injection_is_a_spec_error(expr):
    with pytest.raises(SpecError):
        loads_spec(spec_text(mask=expr, score_mod=None))


@pytest.mark.parametrize(
    "text",
    [
        "name: !!python/object/apply:os.system ['echo PWNED']\nhead_dim: 64\ndtype: fp16\n",
        "name: x\nhead_dim: !!python/name:os.system\ndtype: fp16\n",
        "name: x\nhead_dim: 64\ndtype: fp16\nmask: !!python/object/new:os.system [x]\n",
        "name: x\nhead_dim: 64\ndtype: fp16\nmask: !!python/object/apply:os.system 'x'\n",
        "name: x\nhead_dim: 64\ndtype: fp16\ndescription: !!python/object/apply:os.system x\n",
        "name: x\nhead_dim: 64\ndtype: fp16\nparams: !!python/object:os.system {}\n",
        "name: x\nhead_dim: 64\ndtype: fp16\nmask: !custom q_idx\n",
        "name: &a x\nhead_dim: 64\ndtype: fp16\ndescription: *a\ntiles: {block_m: *a}\n",
        "name: x\nhead_dim: 64\ndtype: fp16\n<<: {mask: causal}\n",
    ],
)
def test_yaml_tags_never_construct_objects(text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError):
        loads_spec(text)


def test_only_safe_yaml_loading_in_the_package():
    """Static check: flashgen never calls an unsafe PyYAML loader."""
    unsafe = re.compile(
        r"yaml\.(load|load_all|unsafe_load|full_load|full_load_all)\s*\(|"
        r"Loader\s*=\s*yaml\.(Loader|FullLoader|UnsafeLoader)|yaml\.(Loader|UnsafeLoader|FullLoader)\b"
    )
    for path in (REPO / "flashgen").rglob("*.py"):
        text = path.read_text()
        assert not unsafe.search(text), f"{path.name} uses an unsafe YAML loader"
        for call in re.findall(r"yaml\.\w+\([^)]*\)", text):
            if "compose" in call or "load" in call:
                assert "SafeLoader" in call, f"{path.name}: {call}"


# ----------------------------------------------------------------------------- description
DESCRIPTIONS = [
    '"""; import os; os.system("PWNED"); """',
    'ends with a quote"',
    '""""""',
    "a backslash at the end \\",
    "\\N{BULLET} \\x41 \\u0041 \\ \\' \\\" and \\\\",
    "*/ PWNED /* // PWNED",
    'line one\nline two\n\n    indented: """PWNED"""',
    "nul \x00 bell \x07 cr \r form feed \x0c vt \x0b esc \x1b",
    "unicode: \u2028 line sep \u2029 para sep \ufeff bom \u202e rtl override \U0001f600",
    "{name} {version} {0} %s %(x)s {{ jinja }} {% raw %}",
    "x" * 4000,  # MAX_DESCRIPTION: a longer one is a spec error (test_spec_trust.py)
]


@pytest.mark.parametrize("desc", DESCRIPTIONS, ids=range(len(DESCRIPTIONS)))
def test_description_cannot_break_out(desc, tmp_path):
    spec = loads_spec(spec_text(description=desc))
    # YAML folds its own line breaks (U+2028 ...), otherwise the text arrives verbatim
    assert spec.description.replace(" ", "")[:8] == desc.replace(" ", "")[:8]
    assert_inert(spec)
    # the docstring's value is the description itself (lossless escaping)
    doc = ast.get_docstring(ast.parse(module_source(spec)), clean=False)
    assert spec.description.strip() in doc
    # and writing the folder works and stays inside tmp_path
    out = write_generated(spec, tmp_path / "generated")
    assert out == tmp_path / "generated" / "victim"
    compile((out / "__init__.py").read_text(), str(out / "__init__.py"), "exec")
    assert json.loads((out / "manifest.json").read_text())["name"] == "victim"


def test_lone_surrogates_in_description_are_escaped(tmp_path):
    """YAML "\\ud83d" gives a lone surrogate, which UTF-8 cannot encode: still no crash."""
    spec = loads_spec('name: victim\nhead_dim: 64\ndtype: fp16\ndescription: "a \\ud83d b"\n')
    assert "\ud83d" in spec.description
    assert_inert(spec)
    out = write_generated(spec, tmp_path / "generated")
    compile((out / "__init__.py").read_text(), "x", "exec")


def test_description_never_reaches_cuda():
    spec = loads_spec(spec_text(description="UNIQUE_DESCRIPTION_TEXT"))
    for t in spec.targets:
        assert "UNIQUE_DESCRIPTION_TEXT" not in render(plan_forward(spec, t))


# ----------------------------------------------------------------------------- paths
@pytest.mark.parametrize(
    "name",
    ["../evil", "..", ".", "a/b", "a\\b", "/abs", "~root", "evil\x00", "Evil", "e.vil", "é", ""],
)
def test_path_traversal_through_the_name_is_a_spec_error(name):
    with pytest.raises(SpecError, match="name"):
        loads_spec(spec_text(name=name))


@pytest.mark.parametrize("name", ["../escaped", "../../escaped", "/tmp/escaped", "a/../../escaped"])
def test_write_generated_refuses_unchecked_names(tmp_path, name):
    """A Spec built by hand (bypassing the checker) still cannot write outside out_dir."""
    spec = dataclasses.replace(loads_spec(spec_text()), name=name)
    out = tmp_path / "root" / "generated"
    with pytest.raises(ValueError, match="name"):
        write_generated(spec, out)
    assert not any(p.name == "escaped" for p in tmp_path.rglob("*"))


# ----------------------------------------------------------------------------- numbers
@pytest.mark.parametrize(
    "fields",
    [
        {"softmax_scale": int("9" * 400)},
        {"softmax_scale": 1e39},
        {"softmax_scale": 0},
        {"softmax_scale": -1.0},
        {"softmax_scale": 1e-45},
        {"params": {"x": {"type": "f32", "default": int("9" * 400)}}},
        {"params": {"x": {"type": "f32", "default": 1e39}}},
        {"params": {"x": {"type": "i32", "default": 2**31}}},
        {"params": {"x": {"type": "i32", "default": 1.5}}},
        {"params": {"x": {"type": "i32", "default": True}}},
        {"params": {"x": {"type": "i32", "default": 5, "min": 6}}},
        {"params": {"x": {"type": "i32", "default": 5, "min": 3, "max": 2}}},
        {"params": {"x": {"type": "f32", "shape": [0]}}},
        {"params": {"x": {"type": "f32", "shape": [2**31]}}},
        {"params": {"x": {"type": "f32", "shape": [-1]}}},
        {"tiles": {"block_m": 48}},
        {"tiles": {"num_warps": 3}},
        {"head_dim": 80},
        {"head_dim": 224},
        {"head_dim": int("9" * 400)},
    ],
)
def test_numeric_fields_are_range_checked(fields):
    text = spec_text(**fields)
    if "softmax_scale" in fields and isinstance(fields["softmax_scale"], float):
        text = text.replace(json.dumps(fields["softmax_scale"]), repr(fields["softmax_scale"]))
    with pytest.raises(SpecError):
        loads_spec(text.replace("1e+39", "1.0e+39"))


def test_yaml_special_floats_are_rejected():
    for val in (".nan", ".inf", "-.inf"):
        text = f"name: x\nhead_dim: 64\ndtype: fp16\nsoftmax_scale: {val}\n"
        with pytest.raises(SpecError, match="softmax_scale"):
            loads_spec(text)
        text = (
            "name: x\nhead_dim: 64\ndtype: fp16\nscore_mod: score * c\n"
            f"params:\n  c: {{type: f32, default: {val}}}\n"
        )
        with pytest.raises(SpecError, match="default"):
            loads_spec(text)
