"""Parse one DSL expression into an untyped :mod:`flashgen.frontend.ir` tree.

The grammar lives in ``dsl.lark`` next to this module (loaded through
``importlib.resources``, so it works from an installed wheel).  The LALR parser
is built once and builds IR nodes directly while parsing (no recursion, so deep
input cannot overflow the stack); a depth limit then keeps later passes safe.
"""

from __future__ import annotations

import contextvars
from functools import lru_cache
from importlib import resources

import lark
from lark import Lark, Token, Transformer

from flashgen.frontend import ir
from flashgen.frontend.errors import SpecError

#: Deepest expression tree accepted; later passes recurse over the tree.
MAX_DEPTH = 100
#: Longest integer literal (in digits) accepted by the parser; the checker
#: enforces the int32 range.
_MAX_INT_DIGITS = 32

# (file, line, col, text) of the expression being parsed, read by the builder.
_where: contextvars.ContextVar[tuple[str, int, int, str]] = contextvars.ContextVar("where")

_TOKEN_WORDS = {
    "NAME": "identifier",
    "INT": "number",
    "FLOAT": "number",
    "TRUE": "'true'",
    "FALSE": "'false'",
    "CAUSAL": "'causal'",
}
_CHAR_HINTS = {"&": "&&", "|": "||", "=": "=="}


def _span_of(tok: Token) -> ir.Span:
    """Map a token's position inside the expression to a position in the file."""
    file, line, col, _ = _where.get()
    if tok.line == 1:
        return ir.Span(file, line, col + tok.column - 1)
    return ir.Span(file, line + tok.line - 1, tok.column)


def _offset_span(offset: int) -> ir.Span:
    """File position of character ``offset`` of the expression text."""
    file, line, col, text = _where.get()
    before = text[:offset]
    nl = before.count("\n")
    if nl == 0:
        return ir.Span(file, line, col + offset)
    return ir.Span(file, line + nl, offset - before.rfind("\n"))


def _error(span: ir.Span, message: str) -> SpecError:
    file, line, col, text = _where.get()
    src = _source.get()
    if src is not None:
        return SpecError.at(span, message, src)
    # no file text: show the expression itself, indented to its column
    lines = text.split("\n")
    k = span.line - line
    shown = (" " * (col - 1) + lines[0]) if k == 0 else lines[k] if 0 <= k < len(lines) else ""
    return SpecError(message, file=span.file, line=span.line, col=span.col, source_line=shown)


_source: contextvars.ContextVar[str | None] = contextvars.ContextVar("source", default=None)


class _Build(Transformer):
    """Inline LALR callbacks: parse-tree rules -> IR nodes with spans."""

    def int_lit(self, c):
        (tok,) = c
        if len(tok) > _MAX_INT_DIGITS:
            raise _error(_span_of(tok), f"integer literal {tok[:12]}... is too large")
        return ir.Const(int(tok), _span_of(tok), ir.Ty.I32)

    def float_lit(self, c):
        (tok,) = c
        return ir.Const(float(tok), _span_of(tok), ir.Ty.F32)

    def bool_lit(self, c):
        (tok,) = c
        return ir.Const(tok == "true", _span_of(tok), ir.Ty.BOOL)

    def causal(self, c):
        return ir.Causal(_span_of(c[0]))

    def var(self, c):
        return ir.Var(str(c[0]), _span_of(c[0]))

    def arglist(self, c):
        return tuple(c)

    def index(self, c):
        name, args = c
        return ir.Index(str(name), args, _span_of(name))

    def call(self, c):
        name, args = c
        return ir.Call(str(name), args or (), _span_of(name))

    def unary(self, c):
        op, arg = c
        return ir.Unary(str(op), arg, _span_of(op))

    def binary(self, c):
        lhs, op, rhs = c
        return ir.Binary(str(op), lhs, rhs, _span_of(op))

    def cond(self, c):
        cond, q, then, other = c
        return ir.Cond(cond, then, other, _span_of(q))


@lru_cache(maxsize=1)
def _parser() -> Lark:
    grammar = (resources.files("flashgen.frontend") / "dsl.lark").read_text(encoding="utf-8")
    return Lark(
        grammar,
        parser="lalr",
        lexer="contextual",
        transformer=_Build(),
        maybe_placeholders=True,
    )


def _describe(tok: Token) -> str:
    if tok.type == "$END":
        return "end of expression"
    word = _TOKEN_WORDS.get(tok.type)
    if word in ("identifier", "number"):
        return f"{word} '{tok}'"
    return word or f"'{tok}'"


def _expected(names) -> str:
    if {"NAME", "INT"} <= set(names):
        return " (expected a value)"
    parser = _parser()
    shown = []
    for name in sorted(names):
        if name in _TOKEN_WORDS:
            word = _TOKEN_WORDS[name]
        else:
            try:
                word = f"'{parser.get_terminal(name).pattern.value}'"
            except (KeyError, AttributeError):
                word = name.lower()
            if name in ("EQ_OP", "REL_OP", "MUL_OP"):
                word = "an operator"
        if word not in shown:
            shown.append(word)
    if not shown or len(shown) > 6:
        return ""
    return " (expected " + ", ".join(shown) + ")"


def _end_span() -> ir.Span:
    text = _where.get()[3]
    return _offset_span(len(text.rstrip()))


def _syntax_error(exc: lark.exceptions.UnexpectedInput) -> SpecError:
    if isinstance(exc, lark.exceptions.UnexpectedCharacters):
        text = _where.get()[3]
        ch = text[exc.pos_in_stream] if exc.pos_in_stream < len(text) else ""
        shown = repr(ch) if not ch.isprintable() or ch in "'" else f"'{ch}'"
        msg = f"unexpected character {shown}"
        if ch in _CHAR_HINTS:
            msg += f" (did you mean '{_CHAR_HINTS[ch]}'?)"
        return _error(_offset_span(exc.pos_in_stream), msg)
    if isinstance(exc, lark.exceptions.UnexpectedToken) and exc.token.type != "$END":
        tok = exc.token
        return _error(_span_of(tok), f"unexpected {_describe(tok)}{_expected(exc.expected)}")
    expected = getattr(exc, "expected", None) or ()
    return _error(_end_span(), f"expression ends early{_expected(expected)}")


def _depth(e: ir.Expr) -> int:
    """Tree depth, computed without recursion."""
    best, stack = 0, [(e, 1)]
    while stack:
        node, d = stack.pop()
        best = max(best, d)
        stack.extend((c, d + 1) for c in ir.children(node))
    return best


def parse_expr(
    text: str,
    *,
    file: str = "<expr>",
    line: int = 1,
    col: int = 1,
    source: str | None = None,
) -> ir.Expr:
    """Parse one DSL expression whose first character is at ``line``:``col`` of ``file``.

    Returns an untyped IR tree (``ty=None`` except literals, which carry their literal
    type, and ``causal``, which is bool); every node's span is its first character
    (binary operators and unary operators: the operator; ``?:``: the ``?``).
    ``source`` is the whole file's text, used to show the offending line in errors;
    without it the expression itself is shown.

    Raises :class:`~flashgen.frontend.errors.SpecError` on any syntax error, an empty
    expression, an oversized integer literal or nesting deeper than ``MAX_DEPTH``.
    """
    t1 = _where.set((file, line, col, text))
    t2 = _source.set(source)
    try:
        if not text.strip():
            raise _error(ir.Span(file, line, col), "empty expression")
        try:
            tree = _parser().parse(text)
        except lark.exceptions.UnexpectedInput as exc:
            raise _syntax_error(exc) from None
        except lark.exceptions.VisitError as exc:  # a builder callback raised
            if isinstance(exc.orig_exc, SpecError):
                raise exc.orig_exc from None
            raise
        depth = _depth(tree)
        if depth > MAX_DEPTH:
            raise _error(
                ir.Span(file, line, col),
                f"expression is nested too deeply: {depth} levels, and the limit (MAX_DEPTH) is "
                f"{MAX_DEPTH}. "
                "Depth is the longest path of nested operators and calls, and a chain such as "
                "a + b + c nests one level per term: a sum of more than 100 terms is too deep; "
                "group it, e.g. (a + b) + (c + d)",
            )
        return tree
    finally:
        _source.reset(t2)
        _where.reset(t1)
