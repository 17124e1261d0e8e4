"""Error types of flashgen.

:class:`SpecError` is raised by the front end (YAML loading, DSL parsing, checking)
and always names a file, a 1-based line and column, and shows the offending line
with a caret under the column.
"""

from __future__ import annotations

import difflib
import re

from flashgen.frontend.ir import Span

#: Line breaks as PyYAML counts them (its marks use the same numbering).
_LINE_BREAK = re.compile("\r\n|[\r\n\x85\u2028\u2029]")


def source_line(source: str, line: int) -> str:
    """Line ``line`` (1-based) of ``source``, or ``""`` when out of range."""
    lines = _LINE_BREAK.split(source)
    return lines[line - 1] if 1 <= line <= len(lines) else ""


def did_you_mean(word: str, choices) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or ``""`` if none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


class SpecError(ValueError):
    """A problem in a spec file, with its location.

    Attributes: ``file``, ``line`` and ``col`` (1-based), ``message`` (one line, no
    location) and ``source_line`` (the text of the offending line, may be empty).
    ``str(err)`` is ``file:line:col: error: message`` followed by the source line and
    a caret under the column.
    """

    def __init__(self, message: str, *, file: str, line: int, col: int, source_line: str = ""):
        self.file = file
        self.line = line
        self.col = col
        self.message = message
        self.source_line = source_line
        super().__init__(self._render())

    @classmethod
    def at(cls, span: Span, message: str, source: str = "") -> SpecError:
        """A SpecError at ``span``, taking the source line from the full file text ``source``."""
        return cls(
            message,
            file=span.file,
            line=span.line,
            col=span.col,
            source_line=source_line(source, span.line),
        )

    @property
    def span(self) -> Span:
        """The error's location as a :class:`~flashgen.frontend.ir.Span`."""
        return Span(self.file, self.line, self.col)

    def _render(self) -> str:
        head = f"{self.file}:{self.line}:{self.col}: error: {self.message}"
        if not self.source_line:
            return head
        text = self.source_line.rstrip("\r\n")
        # keep tabs so the caret lines up under tab-indented text
        pad = "".join(c if c == "\t" else " " for c in text[: max(self.col - 1, 0)])
        return f"{head}\n    {text}\n    {pad}^"

    def __str__(self) -> str:
        return self._render()

    def __reduce__(self):  # picklable despite keyword-only __init__
        return (
            _rebuild_spec_error,
            (self.message, self.file, self.line, self.col, self.source_line),
        )


def _rebuild_spec_error(message, file, line, col, source_line):
    return SpecError(message, file=file, line=line, col=col, source_line=source_line)


class OpInputError(ValueError):
    """A tensor or argument passed to a generated op is unusable.

    Raised by the op layer for wrong shapes, dtypes, devices, strides or missing
    params; the message names the argument and what was expected.
    """
