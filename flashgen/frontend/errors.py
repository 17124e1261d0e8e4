"""Error types of flashgen.

:class:`SpecError` is raised by the front end (YAML loading, DSL parsing, checking)
and always names a file, a 1-based line and column, and shows the offending line
with a caret under the column.
"""

from __future__ import annotations

import difflib
import re
import unicodedata

from flashgen.frontend.ir import Span

#: Line breaks as PyYAML counts them (its marks use the same numbering).
_LINE_BREAK = re.compile("\r\n|[\r\n\x85\u2028\u2029]")


def source_line(source: str, line: int) -> str:
    """Line ``line`` (1-based) of ``source``, or ``""`` when out of range."""
    lines = _LINE_BREAK.split(source)
    return lines[line - 1] if 1 <= line <= len(lines) else ""


#: Longest source line shown under an error; a longer one is clipped around the column.
MAX_SHOWN_LINE = 120


def terminal_safe(text: str, *, newlines: bool = False) -> str:
    r"""``text`` with every character that could act on a terminal escaped.

    Spec text is untrusted: an escape sequence in a description, a key or a name (OSC 52
    writes the clipboard, CSI moves the cursor, U+202E reverses the line) must reach the
    terminal inert.  Control, format, separator, surrogate and unassigned characters other
    than space and tab (and newline where ``newlines``) become ``\xNN`` / ``\uNNNN`` /
    ``\UNNNNNNNN``.  Printable text is returned unchanged.
    """
    if text.isprintable():
        return text
    out = []
    for c in text:
        if c in " \t" or (c == "\n" and newlines) or unicodedata.category(c)[0] not in "CZ":
            out.append(c)
        elif ord(c) < 0x100:
            out.append(f"\\x{ord(c):02x}")
        elif ord(c) < 0x10000:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(f"\\U{ord(c):08x}")
    return "".join(out)


def clip(text: str, limit: int = 60) -> str:
    """``text`` cut to ``limit`` characters, ending in ``...`` when cut (to echo user input)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
        file, message = terminal_safe(str(self.file)), terminal_safe(self.message)
        head = f"{file}:{self.line}:{self.col}: error: {message}"
        if not self.source_line:
            return head
        text = self.source_line.rstrip("\r\n")
        col = max(self.col - 1, 0)
        before, after = text[:col], text[col:]
        half = MAX_SHOWN_LINE // 2  # a long line is clipped to a window around the column
        if len(text) > MAX_SHOWN_LINE and len(before) > half:
            before = "..." + before[-(half - 3) :]
        if len(text) > MAX_SHOWN_LINE and len(after) > half:
            after = after[: half - 3] + "..."
        before, after = terminal_safe(before), terminal_safe(after)
        # keep tabs so the caret lines up under tab-indented text
        pad = "".join(c if c == "\t" else " " for c in before)
        return f"{head}\n    {before}{after}\n    {pad}^"

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


class ParamIndexError(OpInputError, IndexError):
    """A tensor param indexed outside its declared shape at a pair the mask keeps (the CPU
    op and the float64 reference; the CUDA kernels clamp).  An :class:`OpInputError`, and
    an ``IndexError`` for code that catches that."""


class SpecWarning(UserWarning):
    """A spec that checks but is probably not what its author meant (e.g. a param that can
    be the zero divisor of a float expression); the message starts ``file:line:col:``."""
