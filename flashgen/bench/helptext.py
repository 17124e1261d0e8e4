"""Help text for the command line: :class:`HelpFormatter` (paragraphs filled to the
terminal) and :func:`plain` (a docstring's reST markup taken out), so a module docstring can
be its command's ``--help`` (``flashgen bench --gallery --help``).  Here rather than in
``flashgen.cli``: the benchmarks build their own parsers and ``cli`` imports ``bench``."""

from __future__ import annotations

import argparse
import re
import textwrap

#: ``:func:`~a.b.c``` / ``:data:`X``` (the tilde: the last name only) and ````x````
_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``", re.S)


def plain(text: str) -> str:
    """``text`` (reST, as docstrings write it) as plain text: ````x```` -> ``x``,
    ``:func:`a.b``` -> ``a.b``, ``:class:`~a.B``` -> ``B``."""
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), text)
    return _LITERAL.sub(r"\1", text)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter for texts written as paragraphs: each run of unindented lines of a
    description or epilog is filled to the terminal's width (argparse's, from ``COLUMNS``),
    a list item (``- ``, its continuation lines indented two spaces) is filled under its
    dash, blank lines and other indented lines (usage lines, examples) are kept as written.
    The stock formatter joins a whole description into one paragraph;
    ``RawDescriptionHelpFormatter`` keeps its lines but not the terminal's width."""

    def _fill_text(self, text, width, indent):
        out, run = [], []
        item = False  # the run is a list item

        def flush():
            if run:
                first = indent + ("- " if item else "")
                rest = indent + ("  " if item else "")
                text = " ".join(run)[2:] if item else " ".join(run)
                out.append(
                    textwrap.fill(
                        text,
                        width,
                        initial_indent=first,
                        subsequent_indent=rest,
                        break_on_hyphens=False,
                    )
                )
                run.clear()

        for line in text.strip("\n").splitlines():
            if line.startswith("- "):
                flush()
                item = True
                run.append(line.strip())
                continue
            if item and run and line.startswith("  ") and not line.startswith("   "):
                run.append(line.strip())
                continue
            if line.strip() and not line[0].isspace():
                if item:
                    flush()
                    item = False
                run.append(line.strip())
                continue
            flush()
            item = False
            out.append(indent + line if line.strip() else "")
        flush()
        return "\n".join(out)
