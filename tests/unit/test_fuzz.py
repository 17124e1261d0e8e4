"""Property tests over the spec grammar (hypothesis).

* Random text, as an expression or as a whole spec, never raises anything but
  SpecError, and every SpecError has a file, a line and a column.
* Random WELL-TYPED mask / score_mod expressions (``tests/dsl_strategies.py``) pass the
  checker with the expected type, lower to CUDA with only known identifiers, and render.
* A few of them compile with nvcc (``FLASHGEN_FUZZ_NVCC=N`` for N examples, default 3).
* Tame ones run through the CPU op and match the float64 reference.
"""

from __future__ import annotations

import os
import re
import string

import pytest
import torch
from dsl_strategies import PARAMS, expr, may_be_true, score_mods, spec_text, specs
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from plan_helpers import plan_forward

from flashgen import SpecError, loads_spec
from flashgen.build.render import render
from flashgen.codegen.cuda_expr import Invariants, cuda_expr
from flashgen.frontend.ir import Ty
from flashgen.frontend.parse import parse_expr

pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")

FAST = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ----------------------------------------------------------------------------- random text
DSL_CHARS = string.ascii_letters + string.digits + " _.+-*/%<>=!&|?:()[],'\"\\\t\n#;{}$@^~`"
DSL_WORDS = [
    "q_idx", "kv_idx", "b", "h", "h_kv", "seqlen_q", "seqlen_k", "score", "causal", "true", "false",
    "tanh", "exp", "log", "min", "max", "abs", "sqrt", "w", "c", "slopes", "kv_slopes", "ids",
    "&&", "||", "==", "!=", "<=", ">=", "?", ":", "(", ")", "[", "]", ",", "1", "2.5", "1e39",
    "9" * 40, "0", "-", "!",
]  # fmt: skip
dsl_soup = st.one_of(
    st.text(DSL_CHARS, max_size=60),
    st.lists(st.sampled_from(DSL_WORDS), max_size=25).map(" ".join),
    st.text(max_size=40),  # any unicode
)


def _located(err: SpecError) -> None:
    assert err.line >= 1 and err.col >= 1 and err.file
    assert str(err).startswith(f"{err.file}:{err.line}:{err.col}: error: ")


@FAST
@given(dsl_soup)
def test_random_expression_text_only_raises_spec_error(text):
    try:
        parse_expr(text, file="fuzz.yaml", line=3, col=7)
    except SpecError as e:
        _located(e)


@FAST
@given(dsl_soup, st.sampled_from(["mask", "score_mod"]))
def test_random_expression_in_a_spec_only_raises_spec_error(text, field):
    src = spec_text(None, None).replace(f'"{field}": null', f'"{field}": {_json(text)}')
    try:
        loads_spec(src, "fuzz.yaml")
    except SpecError as e:
        _located(e)


def _json(s: str) -> str:
    import json

    return json.dumps(s)


YAML_CHARS = string.printable + "\u00e9\u2028\x00\x85\ufeff"
yaml_soup = st.one_of(
    st.text(YAML_CHARS, max_size=200),
    st.text(max_size=100),
    # near-valid specs with one line replaced by noise
    st.tuples(st.integers(0, 12), st.text(YAML_CHARS, max_size=40)).map(
        lambda x: "\n".join(
            x[1] if i == x[0] else line
            for i, line in enumerate(spec_text("causal", None).split("\n"))
        )
    ),
)
json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=20),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = ["name", "description", "head_dim", "head_dim_v", "dtype", "targets", "mask",
          "score_mod", "params", "softmax_scale", "tiles", "bogus"]  # fmt: skip


@FAST
@given(yaml_soup)
def test_random_yaml_text_only_raises_spec_error(text):
    try:
        loads_spec(text, "fuzz.yaml")
    except SpecError as e:
        _located(e)


@FAST
@given(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6))
def test_random_field_values_only_raise_spec_error(fields):
    import json

    doc = {"name": "fz_fields", "head_dim": 64, "dtype": "fp16", **fields}
    try:
        text = json.dumps(doc)
    except ValueError:
        return
    try:
        loads_spec(text.replace("NaN", ".nan").replace("Infinity", ".inf"), "fuzz.yaml")
    except SpecError as e:
        _located(e)


# ----------------------------------------------------------------------------- well-typed
_CUDA_WORDS = {
    "b", "h", "h_kv", "q_idx", "kv_idx", "seqlen_q", "seqlen_k", "score", "true", "false", "int",
    "float", "bool", "int64_t", "INFINITY", "fabsf", "fminf", "fmaxf", "expf", "logf",
    "tanh_approx", "sqrtf", "fmodf", "abs", "min", "max", "heads_q", "heads_kv", "batch", "fg",
    "clamp_index", "idiv", "imod", "q_idx_f", "kv_idx_f", "div", "mod", "__fadd_rn", "__fsub_rn",
    "__fmul_rn", "__ldg", "base_ptr",
}  # fmt: skip
_CUDA_WORDS |= {f"p_{n}" for n in PARAMS} | {f"t_{n}" for n in PARAMS}


def _identifiers(code: str) -> set[str]:
    code = re.sub(r"\b\d+(\.\d*)?(e[+-]?\d+)?f?\b", " ", code)  # drop numeric literals
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code))


@FAST
@given(specs(wild=True))
def test_well_typed_expressions_check_lower_and_render(text):
    spec = loads_spec(text, "fuzz.yaml")
    if spec.mask is not None:
        assert spec.mask.ty == Ty.BOOL
    if spec.score_mod is not None:
        assert spec.score_mod.ty in (Ty.F32, Ty.I32)
    inv = Invariants()
    for e in (spec.mask, spec.score_mod):
        if e is None:
            continue
        for code in (cuda_expr(e, spec), cuda_expr(e, spec, inv)):
            hoisted = {f"fg_inv{i}" for i in range(len(inv.decls))} | {"Divisor"}
            unknown = _identifiers(code) - _CUDA_WORDS - hoisted
            assert not unknown, f"lowered CUDA uses unknown identifiers {unknown}: {code}"
            assert code.count("(") == code.count(")")
    for decl in inv.decls:  # the prologue reads only params and constants
        assert not _identifiers(decl) - _CUDA_WORDS - hoisted - {"const"}, decl
        assert not re.search(r"\b(q_idx|kv_idx|score|b|h)\b", decl.split("(", 1)[1]), decl
    src = render(plan_forward(spec, "sm_80"))
    assert f"flashgen_{spec.name}_fwd_sm_80" in src


@FAST
@given(expr("i32", 3, False, True), expr("f32", 3, True, True), expr("bool", 3, False, True))
def test_each_type_checks_to_its_type(i, f, b):
    assume(may_be_true(f"({i}) == 1 || {b}"))
    spec = loads_spec(spec_text(f"({i}) == 1 || {b}", f"{f} + 0.0"))
    assert spec.mask.ty == Ty.BOOL and spec.score_mod.ty == Ty.F32


@pytest.mark.usefixtures("requires_nvcc")
@settings(
    max_examples=int(os.environ.get("FLASHGEN_FUZZ_NVCC", "3")),
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
@given(specs(wild=True, dtypes=("fp16", "bf16")))
def test_random_specs_compile_with_nvcc(tmp_path_factory, text):
    """nvcc accepts what the lowering emits (``FLASHGEN_FUZZ_NVCC=50`` for a bigger run)."""
    from flashgen.build.compile import compile_source

    spec = loads_spec(text, "fuzz.yaml")
    plan = plan_forward(spec, "sm_80")
    out = tmp_path_factory.mktemp("fuzz-nvcc") / "k.cubin"
    report = compile_source(render(plan), plan, out)
    assert out.stat().st_size > 0 and report.kernel(plan.kernel_name).registers > 0


# ----------------------------------------------------------------------------- CPU op
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(specs(wild=False, dtypes=("fp16", "bf16")), st.integers(0, 2**16))
def test_cpu_op_matches_reference_on_random_specs(text, seed):
    from flashgen.bench.verify import error_bound, random_inputs
    from flashgen.ops.op import build_op

    spec = loads_spec(text, "fuzz.yaml")
    op = build_op(spec)
    gen = torch.Generator().manual_seed(seed)
    q, k, v, params = random_inputs(spec, 2, 4, 2, 13, 21, "cpu", gen)
    o, lse = op.attention(q, k, v, **params)
    assert o.shape == (2, 4, 13, 64) and lse.shape == (2, 4, 13)
    ref_o, ref_lse, bound = error_bound(spec, q, k, v, params)
    assert torch.isfinite(ref_o).all(), "tame expressions must keep the reference finite"
    assert not torch.isnan(lse).any()
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert (o.double() - ref_o).abs().max().item() <= bound


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(score_mods(wild=False))
def test_tame_score_mods_stay_finite(sm):
    """The GPU fuzz relies on this: tame score_mods of finite scores are finite."""
    from flashgen.ops.cpu.reference import eval_expr

    spec = loads_spec(spec_text(None, sm))
    g = torch.Generator().manual_seed(0)
    B, H, S = 2, 3, 17
    ar = lambda n: torch.arange(n, dtype=torch.int64)  # noqa: E731
    env = {
        "b": ar(B).view(B, 1, 1, 1),
        "h": ar(H).view(1, H, 1, 1),
        "h_kv": (ar(H) // H).view(1, H, 1, 1),  # one KV head
        "q_idx": ar(S).view(1, 1, S, 1),
        "kv_idx": ar(S).view(1, 1, 1, S),
        "seqlen_q": torch.tensor(S),
        "seqlen_k": torch.tensor(S),
        "score": torch.randn(B, H, S, S, generator=g, dtype=torch.float64) * 30,
        "w": torch.tensor(5),
        "c": torch.tensor(1.5, dtype=torch.float64),
        "slopes": torch.rand(H, generator=g, dtype=torch.float64),
        "kv_slopes": torch.rand(1, generator=g, dtype=torch.float64),
        "ids": torch.randint(0, 16, (B,), generator=g),
        "__float__": torch.float64,
        "__device__": torch.device("cpu"),
    }
    out = eval_expr(spec.score_mod, env)
    assert torch.isfinite(out).all() and out.abs().max() < 1e4
