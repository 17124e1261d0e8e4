"""Type checking of mask/score_mod expressions and field ranges (check_spec)."""

from __future__ import annotations

import dataclasses

import pytest

from flashgen.frontend import ir
from flashgen.frontend.check import check_spec
from flashgen.frontend.errors import SpecError
from flashgen.frontend.ir import Ty
from flashgen.frontend.parse import parse_expr
from flashgen.frontend.spec import loads_spec

PARAMS = """\
params:
  window: {type: i32, default: 16}
  cap: {type: f32, default: 30.0}
  slopes: {type: f32, shape: [num_heads]}
  table: {type: i32, shape: [num_heads, 8]}
"""


def spec_text(mask: str | None = None, score_mod: str | None = None) -> str:
    text = "name: demo\nhead_dim: 128\ndtype: bf16\n"
    if mask is not None:
        text += f'mask: "{mask}"\n'
    if score_mod is not None:
        text += f'score_mod: "{score_mod}"\n'
    return text + PARAMS


def typed(expr: str, field: str = "score_mod") -> ir.Expr:
    s = loads_spec(spec_text(**{field: expr}), "c.yaml")
    root = getattr(s, field)
    assert all(n.ty is not None for n in ir.walk(root)), root
    return root


def bad(expr: str, field: str = "score_mod") -> SpecError:
    with pytest.raises(SpecError) as info:
        loads_spec(spec_text(**{field: expr}), "c.yaml")
    e = info.value
    assert e.file == "c.yaml"
    return e


# The expression starts at column 13 (score_mod: ") or 8 (mask: "), on line 4.
def col_in(e: SpecError, expr: str, field: str = "score_mod") -> int:
    assert e.line == 4
    return e.col - (13 if field == "score_mod" else 8)


@pytest.mark.parametrize(
    "expr, ty",
    [
        ("score", Ty.F32),
        ("1", Ty.I32),
        ("q_idx - kv_idx", Ty.I32),
        ("q_idx / 2", Ty.I32),
        ("q_idx % 3", Ty.I32),
        ("q_idx / 2.0", Ty.F32),
        ("score + 1", Ty.F32),
        ("window * 2", Ty.I32),
        ("cap * tanh(score / cap)", Ty.F32),
        ("exp(1)", Ty.F32),
        ("log(q_idx)", Ty.F32),
        ("sqrt(2)", Ty.F32),
        ("abs(q_idx - kv_idx)", Ty.I32),
        ("abs(score)", Ty.F32),
        ("min(q_idx, kv_idx)", Ty.I32),
        ("max(q_idx, 1.5)", Ty.F32),
        ("-q_idx", Ty.I32),
        ("-score", Ty.F32),
        ("slopes[h]", Ty.F32),
        ("table[h, kv_idx % 8]", Ty.I32),
        ("score - slopes[h] * (q_idx + seqlen_k - seqlen_q - kv_idx)", Ty.F32),
        ("q_idx > kv_idx ? score : 0", Ty.F32),
        ("causal ? 1 : 0", Ty.I32),
        ("b + h + seqlen_q", Ty.I32),
    ],
)
def test_score_mod_types(expr, ty):
    assert typed(expr).ty == ty


@pytest.mark.parametrize(
    "expr",
    [
        "causal",
        "true",
        "q_idx >= kv_idx",
        "causal && q_idx - kv_idx < window",
        "q_idx + seqlen_k - seqlen_q - kv_idx < window || false",
        "!causal",
        "(q_idx < 4) == (kv_idx < 4)",
        "q_idx != kv_idx",
        "q_idx < 2.5",
        "slopes[h] > 0.0",
        "table[h, 0] == kv_idx",
        "q_idx > 0 ? causal : true",
    ],
)
def test_mask_types(expr):
    assert typed(expr, "mask").ty == Ty.BOOL


def test_typing_builds_new_trees_and_keeps_spans():
    src = spec_text(score_mod="cap * tanh(score / cap)")
    s = loads_spec(src, "c.yaml")
    e = s.score_mod
    assert isinstance(e, ir.Binary) and e.op == "*"
    assert e.lhs == ir.Var("cap", ty=Ty.F32)
    assert (e.lhs.span.line, e.lhs.span.col) == (4, 13)
    call = e.rhs
    assert isinstance(call, ir.Call) and call.ty == Ty.F32
    assert call.args[0].ty == Ty.F32


def test_check_spec_on_hand_built_spec():
    mask = parse_expr("q_idx >= kv_idx", file="m", line=1, col=1)
    raw = ir.Spec("hand", 64, 64, "fp16", ("sm_80",), mask, None)
    checked = check_spec(raw)
    assert checked.mask.ty == Ty.BOOL and checked.mask.lhs.ty == Ty.I32
    assert raw.mask.lhs.ty is None  # the input is not modified
    with pytest.raises(SpecError, match="head_dim 80"):
        check_spec(dataclasses.replace(raw, head_dim=80))


@pytest.mark.parametrize(
    "expr, field, col, fragment",
    [
        ("windw > 0", "mask", 0, "unknown identifier 'windw' (did you mean 'window'?)"),
        ("q_idx - kv_idx < windw", "mask", 17, "did you mean 'window'"),
        ("scroe * 2", "score_mod", 0, "did you mean 'score'"),
        ("score > 0", "mask", 0, "'score' is only available in score_mod"),
        ("q_idx + 1", "mask", 0, "mask must be a bool"),
        ("q_idx > 0", "score_mod", 0, "score_mod must be a number"),
        ("causal + 1", "mask", 7, "arithmetic on bool"),
        ("score * (q_idx > 1)", "score_mod", 6, "arithmetic on bool"),
        ("causal < 1", "mask", 7, "needs numbers"),
        ("q_idx && causal", "mask", 6, "'&&' needs bools"),
        ("causal || 1", "mask", 7, "'||' needs bools"),
        ("!q_idx", "mask", 0, "'!' needs a bool"),
        ("-causal", "mask", 0, "unary '-' needs a number"),
        ("causal == 1", "mask", 7, "needs numbers"),
        ("q_idx ? score : 0", "score_mod", 0, "condition of '?:' must be bool"),
        ("causal ? score : true", "score_mod", 7, "incompatible types"),
        ("window[h] > 0", "mask", 0, "cannot index 'window'"),
        ("q_idx[0] > 0", "mask", 0, "cannot index 'q_idx'"),
        ("slopez[h]", "score_mod", 0, "did you mean 'slopes'"),
        ("slopes + score", "score_mod", 0, "'slopes' is a tensor param; index it"),
        ("slopes[h, b]", "score_mod", 0, "1 dimension(s)"),
        ("table[h]", "score_mod", 0, "2 dimension(s)"),
        ("slopes[1.5]", "score_mod", 7, "index must be i32"),
        ("slopes[q_idx > 0]", "score_mod", 7, "index must be i32"),
        ("tanhh(score)", "score_mod", 0, "unknown function 'tanhh' (did you mean 'tanh'?)"),
        ("tanh(score, 1)", "score_mod", 0, "tanh() takes 1 argument, got 2"),
        ("min(score)", "score_mod", 0, "min() takes 2 arguments, got 1"),
        ("exp(causal)", "score_mod", 4, "exp() needs a number"),
        ("tanh", "score_mod", 0, "'tanh' is a function"),
        ("2147483648 + score", "score_mod", 0, "does not fit in int32"),
        ("1e400 * score", "score_mod", 0, "not finite"),
    ],
)
def test_type_errors_point_at_the_right_place(expr, field, col, fragment):
    e = bad(expr, field)
    assert fragment in e.message
    assert col_in(e, expr, field) == col
    assert e.source_line.startswith(f'{field}: "{expr}"')


@pytest.mark.parametrize(
    "param, message",
    [
        ("{type: f32, default: 0.0, above: 0}",
         "default 0.0 of param 'c' is not above 0.0 (declared above)"),
        ("{type: f32, default: 7, below: 5}",
         "default 7.0 of param 'c' is not below 5.0 (declared below)"),
        ("{type: f32, default: 3, above: 5, below: 5}",
         "param 'c' has above 5.0 and below 5.0: no f32 value lies between them"),
        ("{type: i32, default: 0, above: 0}",
         "default 0 of param 'c' is not above 0 (declared above)"),
        ("{type: f32, default: 7, max: 5}", "default 7.0 of param 'c' is above its max 5.0"),
        ("{type: f32, default: 3, min: 5, max: 4}",
         "param 'c' has min 5.0 greater than max 4.0"),
    ],
)  # fmt: skip
def test_bound_errors_name_exclusive_bounds_as_declared(param, message):
    """``above: 0`` is held as the least float32 above 0: a default of 0 was refused as
    "below its min 1.401298464324817e-45".  The errors name the bounds as declared."""
    text = f"name: t\nhead_dim: 64\ndtype: bf16\nmask: c == c\nparams:\n  c: {param}\n"
    with pytest.raises(SpecError) as e:
        loads_spec(text, "t.yaml")
    assert e.value.message == message


def test_int32_max_literal_is_fine():
    assert typed("score + 2147483647").ty == Ty.F32


def test_error_string_format():
    e = bad("q_idx - kv_idx < windw", "mask")
    assert str(e) == (
        "c.yaml:4:25: error: unknown identifier 'windw' (did you mean 'window'?)\n"
        '    mask: "q_idx - kv_idx < windw"\n'
        "                            ^"
    )


@pytest.mark.parametrize("name", ["self", "params", "cu_seqlens_q", "max_seqlen_k", "seqlen_q"])
def test_python_api_argument_names_are_reserved_params(name):
    """A param named like an argument of op.attention / op.varlen / op.block_mask would
    collide with it at call time ("got multiple values for argument")."""
    text = f"name: demo\nhead_dim: 128\ndtype: bf16\nparams:\n  {name}: {{type: i32, default: 1}}\n"
    with pytest.raises(SpecError, match="reserved"):
        loads_spec(text, "r.yaml")


def test_too_large_shape_entry_says_why():
    """An extent past int32 is refused with the limit named (not just 'a positive integer')."""
    text = "name: demo\nhead_dim: 128\ndtype: bf16\nscore_mod: score + t[q_idx]\n"
    text += "params:\n  t: {type: f32, shape: [3000000000]}\n"
    with pytest.raises(SpecError, match=r"at most 2147483647"):
        loads_spec(text)


def test_float_literal_that_underflows_float32_is_refused():
    """``score / 1e-50`` would divide by float32 zero in the kernels (the reference, in
    float64, by 1e-50): refused like a constant zero divisor; 1e-45 is still a float32."""
    with pytest.raises(SpecError, match=r"rounds to 0 in float32"):
        loads_spec(spec_text(score_mod="score / 1e-50"))
    loads_spec(spec_text(score_mod="score * 1e-45 + score"))


@pytest.mark.parametrize(
    "mask",
    [
        "false",
        "q_idx < 0",
        "causal && (kv_idx < -1 || false)",
        "q_idx + 0.5 < 0.0 || h < 0",
        "!(b >= 0)",
        "q_idx < w && kv_idx > 0",
        "seqlen_k <= 0",
        "w2 < 0.0 && true",
    ],
)
def test_a_mask_that_is_never_true_is_an_error(mask):
    """Proved by the interval analysis over every index, length and param value the op
    accepts (``w`` has ``max: 0``, ``w2`` ``min: 1.0``): an op that returns o = 0,
    lse = -inf on every row is a spec bug, not a kernel to build."""
    text = (
        "name: never\nhead_dim: 64\ndtype: fp16\n"
        f"mask: '{mask}'\n"
        "params: {w: {type: i32, default: -5, max: 0}, w2: {type: f32, default: 2.0, min: 1.0}}\n"
    )
    with pytest.raises(SpecError) as info:
        loads_spec(text, "never.yaml")
    e = info.value
    assert "mask is never true" in str(e) and "o = 0, lse = -inf" in str(e)
    assert (e.file, e.line, e.col) == ("never.yaml", 4, 8)  # after the quote


@pytest.mark.parametrize(
    "mask",
    [
        "q_idx < w",  # w's default may be 0, but a call may pass more
        "q_idx > kv_idx && kv_idx > q_idx",  # relational: beyond intervals, accepted
        "q_idx + 2147483000 < 0",  # int32 overflow: no claim
        "w2 > 0.0",
        "kv_idx * 0.1 == 0.3",
    ],
)
def test_masks_that_may_be_true_are_accepted(mask):
    text = (
        "name: maybe\nhead_dim: 64\ndtype: fp16\n"
        f"mask: '{mask}'\n"
        "params: {w: {type: i32, default: 0}, w2: {type: f32, default: -1.0}}\n"
    )
    assert loads_spec(text, "maybe.yaml").mask is not None


@pytest.mark.parametrize(
    "field, expr, op",
    [
        ("mask", "q_idx % (3 - 3) == 0", "%"),
        ("score_mod", "score / (1.0 - 1.0)", "/"),
        ("score_mod", "score / (2 * 0.0 + -0.0)", "/"),
    ],
)
def test_a_divisor_built_from_literals_that_is_zero_is_an_error(field, expr, op):
    """Only a literal 0 was refused; `% (3 - 3)` gave 0 per element and `/ (1.0 - 1.0)`
    inf or NaN, silently.  The caret is under the operator, as for a literal 0."""
    e = bad(expr, field)
    assert f"'{op}' by zero: the divisor is the constant 0" in e.message
    assert e.col == len(field) + len(': "') + expr.index(op) + 1
    typed("score / (3 - 2) + score % (1.0 - 0.5)")  # nonzero constants are fine


@pytest.mark.parametrize(
    "name", ["cache_dtype", "mode", "layout", "group", "op", "max_seqlen_q", "options", "plan"]
)
def test_params_named_like_a_keyword_of_plan_decode_or_ring_attention_are_reserved(name):
    """Issue 38 (also): a param named ``cache_dtype`` (plan_decode), ``mode``, ``layout``,
    ``group`` or ``op`` (ring_attention) was accepted but could never be passed (the call's
    own keyword takes the value)."""
    with pytest.raises(SpecError, match=rf"param name '{name}' is reserved \(an op keyword"):
        loads_spec(f"name: t\nhead_dim: 64\ndtype: fp16\nscore_mod: score + {name}\n"
                   f"params:\n  {name}: {{type: f32, default: 0.0}}\n")  # fmt: skip
