"""Helpers every ``flashgen`` command shares: reading specs with located errors, the
``--option`` flags, the rich consoles, ``--json`` failure documents, and terminal-safe
printing of warnings."""

from __future__ import annotations

import contextlib
import json
import sys
import warnings

from flashgen import env
from flashgen.bench.helptext import HelpFormatter  # noqa: F401  (the commands' formatter)
from flashgen.frontend import ir
from flashgen.frontend.errors import SpecError, SpecWarning, terminal_safe
from flashgen.version import __version__


def _load_specs(paths: list[str], err, errors: list | None = None) -> list[ir.Spec] | None:
    """The specs at ``paths``, or None after printing every error to ``err`` (and
    appending ``{file, line, col, message}`` to ``errors`` for ``--json``)."""
    from flashgen.frontend.spec import load_spec

    def note(file, message, line=None, col=None):
        if errors is not None:
            errors.append({"file": str(file), "line": line, "col": col, "message": message})

    specs, bad = [], False
    by_name: dict[str, str] = {}
    for p in dict.fromkeys(paths):  # a file named twice is built once
        try:
            spec = load_spec(p)
            if spec.name in by_name:  # one generated/<name>/ folder, one torch op name
                msg = (
                    f"spec name '{spec.name}' is also the name of {by_name[spec.name]}; both "
                    f"would write {spec.name}/ and register torch.ops.flashgen.{spec.name}: "
                    "rename one"
                )
                err.print(terminal_safe(f"{p}: error: {msg}"), markup=False)
                note(p, msg)
                bad = True
                continue
            by_name[spec.name] = p
            specs.append(spec)
        except SpecError as e:
            err.print(str(e), markup=False, highlight=False)
            note(e.file, e.message, e.line, e.col)
            bad = True
        except OSError as e:
            err.print(f"{terminal_safe(str(p))}: error: cannot read spec: {e.strerror or e}",
                      markup=False)  # fmt: skip
            note(p, f"cannot read spec: {e.strerror or e}")
            bad = True
    return None if bad else specs


def _options(args):
    """The :class:`flashgen.options.Options` of ``--option NAME=VALUE`` flags (dotted names,
    :meth:`~flashgen.options.Options.replace_path`).  ``ValueError`` for a flag without
    ``=``, a value the option does not take or an option given twice, ``KeyError`` for an
    unknown name."""
    from flashgen.options import DEFAULT

    out = DEFAULT
    given: dict[str, str] = {}
    for item in getattr(args, "option", None) or []:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"--option {item!r}: expected NAME=VALUE")
        if name in given:  # the last one would win without a word
            raise ValueError(
                f"--option {name} is given twice ({name}={given[name]}, {name}={value}): "
                "expected it once"
            )
        given[name] = value
        out = out.replace_path(name, value)
    return out


def _consoles():
    from rich.console import Console

    # a pipe or file gets wide tables rather than rich's 80-column default
    width = None if sys.stdout.isatty() or env.foreign("COLUMNS") else 160
    out = Console(file=sys.stdout, soft_wrap=False, highlight=False, width=width, emoji=False)
    # errors are not wrapped: a spec error's caret must stay under its column
    err = Console(file=sys.stderr, soft_wrap=True, highlight=False, emoji=False)
    return out, err


def _fail_json(args, message: str, errors: list | None = None) -> int:
    """Exit status 1, printing ``{"ok": false, "error": ...}`` first in ``--json`` mode
    (with ``"errors"``, the spec errors' locations, where there are any)."""
    if args.json:
        doc = {"flashgen_version": __version__, "ok": False, "error": message}
        if errors:
            doc["errors"] = errors
        print(json.dumps(doc))
    return 1


@contextlib.contextmanager
def plain_warnings():
    """Inside the block, flashgen's own notices (:class:`SpecWarning`, the kernel cache's
    ``CacheWarning``) print as one escaped ``warning: ...`` line on stderr, without
    Python's category name and source line; other warnings print as usual."""
    from flashgen.build.cache import CacheWarning

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, (SpecWarning, CacheWarning)):
            text = str(message)
            text = text if " warning: " in text[:300] else f"warning: {text}"
            print(terminal_safe(text), file=sys.stderr)
            return
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown
