"""Grammar and parser tests: every construct, precedence, spans, syntax errors."""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashgen.frontend import ir
from flashgen.frontend.errors import SpecError
from flashgen.frontend.ir import Binary, Call, Causal, Cond, Const, Index, Ty, Unary, Var
from flashgen.frontend.parse import MAX_DEPTH, parse_expr


def p(text: str) -> ir.Expr:
    return parse_expr(text, file="t.yaml", line=1, col=1)


def shape(e: ir.Expr) -> str:
    """S-expression of a tree, for compact structural assertions."""
    if isinstance(e, Const):
        return repr(e.value)
    if isinstance(e, Var):
        return e.name
    if isinstance(e, Causal):
        return "causal"
    if isinstance(e, Index):
        return f"{e.name}[{', '.join(shape(i) for i in e.indices)}]"
    if isinstance(e, Call):
        return f"{e.fn}({', '.join(shape(a) for a in e.args)})"
    if isinstance(e, Unary):
        return f"({e.op}{shape(e.arg)})"
    if isinstance(e, Binary):
        return f"({shape(e.lhs)} {e.op} {shape(e.rhs)})"
    if isinstance(e, Cond):
        return f"({shape(e.cond)} ? {shape(e.then)} : {shape(e.other)})"
    raise AssertionError(e)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a + b * c", "(a + (b * c))"),
        ("a * b + c", "((a * b) + c)"),
        ("a - b - c", "((a - b) - c)"),
        ("a / b % c", "((a / b) % c)"),
        ("(a + b) * c", "((a + b) * c)"),
        ("a < b == c > d", "((a < b) == (c > d))"),
        ("a <= b != c >= d", "((a <= b) != (c >= d))"),
        ("a || b && c", "(a || (b && c))"),
        ("a && b || c", "((a && b) || c)"),
        ("a == b && c != d", "((a == b) && (c != d))"),
        ("a + 1 < b * 2", "((a + 1) < (b * 2))"),
        ("a ? b : c ? d : e", "(a ? b : (c ? d : e))"),
        ("a ? b ? c : d : e", "(a ? (b ? c : d) : e)"),
        ("a || b ? c + 1 : d", "((a || b) ? (c + 1) : d)"),
        ("-a * b", "((-a) * b)"),
        ("- -a", "(-(-a))"),
        ("!a && b", "((!a) && b)"),
        ("!(a && b)", "(!(a && b))"),
        ("-x[h]", "(-x[h])"),
        ("slopes[h]", "slopes[h]"),
        ("t[b, h + 1]", "t[b, (h + 1)]"),
        ("min(a, b)", "min(a, b)"),
        ("tanh(score / 2.0)", "tanh((score / 2.0))"),
        ("f()", "f()"),
        ("causal && q_idx - kv_idx < window", "(causal && ((q_idx - kv_idx) < window))"),
        ("true", "True"),
        ("false || true", "(False || True)"),
        ("42", "42"),
        ("1.5e3", "1500.0"),
        (".5", "0.5"),
        ("2.", "2.0"),
        ("1e-2", "0.01"),
        ("trueish + causal_x", "(trueish + causal_x)"),
        ("  a\t+\nb  ", "(a + b)"),
    ],
)
def test_tree_shape(text, expected):
    assert shape(p(text)) == expected


def test_literal_types_and_untyped_nodes():
    e = p("1 + 2.0 < x && true && causal")
    kinds = {type(n).__name__: n.ty for n in ir.walk(e) if isinstance(n, (Const, Causal))}
    assert kinds["Causal"] == Ty.BOOL
    consts = [n for n in ir.walk(e) if isinstance(n, Const)]
    assert [c.ty for c in consts] == [Ty.I32, Ty.F32, Ty.BOOL]
    assert all(n.ty is None for n in ir.walk(e) if isinstance(n, (Var, Binary)))


def test_spans_are_offset_into_the_file():
    e = parse_expr("a + slopes[h]", file="s.yaml", line=7, col=12)
    assert isinstance(e, Binary)
    assert (e.lhs.span.line, e.lhs.span.col) == (7, 12)
    assert (e.span.line, e.span.col) == (7, 14)  # the operator
    assert (e.rhs.span.line, e.rhs.span.col) == (7, 16)
    assert e.rhs.indices[0].span.col == 23
    assert e.span.file == "s.yaml"


def test_spans_across_lines():
    e = parse_expr("a +\n  b", file="s.yaml", line=3, col=10)
    assert (e.rhs.span.line, e.rhs.span.col) == (4, 3)


def test_cond_span_is_question_mark():
    e = p("x ? 1 : 2")
    assert e.span.col == 3


def err(text: str, line: int = 2, col: int = 5) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_expr(text, file="s.yaml", line=line, col=col)
    return info.value


@pytest.mark.parametrize(
    "text, col, fragment",
    [
        ("a + )", 9, "unexpected ')'"),
        ("(a + b", 11, "expression ends early"),
        ("a +", 8, "expression ends early"),
        ("a & b", 7, "did you mean '&&'"),
        ("a | b", 7, "did you mean '||'"),
        ("a = b", 7, "did you mean '=='"),
        ("a b", 7, "unexpected identifier 'b'"),
        ("x[]", 7, "unexpected ']'"),
        ("a $ b", 7, "unexpected character '$'"),
        ("a ? b", 10, "expression ends early"),
        ("f(a,)", 9, "unexpected ')'"),
        ("", 5, "empty expression"),
        ("   ", 5, "empty expression"),
    ],
)
def test_syntax_errors(text, col, fragment):
    e = err(text)
    assert (e.file, e.line, e.col) == ("s.yaml", 2, col)
    assert fragment in e.message


def test_error_rendering_shows_line_and_caret():
    e = err("a + )")
    lines = str(e).splitlines()
    assert lines[0] == "s.yaml:2:9: error: unexpected ')' (expected a value)"
    assert lines[1] == "    " + " " * 4 + "a + )"
    assert lines[2] == "    " + " " * 8 + "^"


def test_error_uses_file_source_line():
    src = "name: x\nmask: a + )\n"
    with pytest.raises(SpecError) as info:
        parse_expr("a + )", file="f.yaml", line=2, col=7, source=src)
    assert info.value.source_line == "mask: a + )"
    assert str(info.value).splitlines()[2] == "    " + " " * 10 + "^"


def test_error_on_later_line():
    e = err("a +\n  b $", line=3, col=8)
    assert (e.line, e.col) == (4, 5)


def test_huge_int_literal_is_an_error():
    e = err("1" * 5000)
    assert "too large" in e.message


def test_nesting_limit():
    p("-" * (MAX_DEPTH - 1) + "x")
    with pytest.raises(SpecError, match="nested too deeply"):
        p("-" * (MAX_DEPTH + 5) + "x")
    with pytest.raises(SpecError, match="nested too deeply"):
        p("x" + " + 1" * 200)
    # parentheses add no tree depth, and the LALR parser does not recurse
    assert shape(p("(" * 3000 + "x" + ")" * 3000)) == "x"


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(alphabet=string.printable, max_size=60),
        st.text(alphabet=st.characters(min_codepoint=9, max_codepoint=0x2030), max_size=60),
    )
)
def test_random_text_raises_only_spec_error(text):
    try:
        e = parse_expr(text, file="r.yaml", line=1, col=1)
    except SpecError as exc:
        assert exc.line >= 1 and exc.col >= 1
        str(exc)
    else:
        assert e is not None


_TOKENS = [
    "a",
    "b",
    "1",
    "2.5",
    "true",
    "causal",
    "(",
    ")",
    "[",
    "]",
    ",",
    "+",
    "-",
    "*",
    "/",
    "%",
    "<",
    "<=",
    "==",
    "!=",
    "&&",
    "||",
    "!",
    "?",
    ":",
    "min",
    " ",
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_TOKENS), max_size=25))
def test_random_token_soup_raises_only_spec_error(tokens):
    try:
        parse_expr(" ".join(tokens), file="r.yaml", line=1, col=1)
    except SpecError:
        pass
