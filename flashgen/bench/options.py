"""``flashgen ab``'s option arguments, over :class:`flashgen.Options`' dotted names.

``flashgen ab --option hopper_fwd.col_bound=0,1`` names a field of :class:`flashgen.Options`
by its dotted path (:meth:`~flashgen.options.Options.paths`) and the values to try; each value
is parsed and checked by :meth:`~flashgen.options.Options.replace_path` (the one dotted-name
setter).  What this module adds is what only ``ab`` needs: the ``NAME=A,B`` lists
(:func:`parse_options`), the variants (:func:`combinations`), their labels and the
``--list-options`` table.  Errors are :class:`OptionError` with the option's name, what it
accepts and what it got.
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Iterable, Mapping

from flashgen.options import DEFAULT, FAMILY_OPTIONS, Options, removed_option_message


class OptionError(ValueError):
    """A bad ``--option`` (unknown name, bad value) or other ``flashgen ab`` argument."""


def format_value(value) -> str:
    """A value as the command line writes it (``1``/``0`` for bools, ``none``)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def parse_value(name: str, text: str):
    """``text`` as a value of option ``name`` (:meth:`Options.replace_path` parses and checks
    it).  Raises :class:`OptionError` with its message, which leads with the option, what it
    takes and what it got (``decode.stages: expected an int in 2..8, got 9``)."""
    try:
        return DEFAULT.replace_path(name, text).get_path(name)
    except (ValueError, TypeError) as e:
        raise OptionError(str(e)) from None


def _check_name(name: str) -> None:
    if name in Options.paths():
        return
    removed = removed_option_message(name)
    if removed is not None:
        raise OptionError(f"{removed} (`flashgen ab --list-options` lists the options)")
    if name in FAMILY_OPTIONS:
        inside = [n for n in Options.paths() if n.startswith(name + ".")]
        raise OptionError(
            f"{name!r} is a group of options; set one of its fields: {', '.join(inside)}"
        )
    close = difflib.get_close_matches(name, Options.paths(), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    raise OptionError(
        f"unknown option {name!r}{hint} (`flashgen ab --list-options` lists them with their "
        "values)"
    )


def parse_option_arg(text: str) -> tuple[str, list]:
    """``NAME=A,B,...`` -> ``(NAME, [A, B, ...])``, values parsed by :func:`parse_value`.

    Raises :class:`OptionError` for a missing ``=`` or value, an unknown name (with the
    closest known ones), a group's name, a bad value or a value listed twice.
    """
    name, eq, values = text.partition("=")
    name = name.strip()
    if not eq or not name or not values.strip():
        raise OptionError(f"--option expects NAME=VALUE[,VALUE...], got {text!r}")
    _check_name(name)
    parsed = [parse_value(name, v) for v in values.split(",")]
    for i, v in enumerate(parsed):
        if any(v == w and type(v) is type(w) for w in parsed[:i]):
            raise OptionError(f"option {name} lists the value {format_value(v)} twice")
    return name, parsed


def parse_options(texts: Iterable[str]) -> dict[str, list]:
    """Every ``--option`` text parsed (:func:`parse_option_arg`); a name given twice is an
    :class:`OptionError`."""
    out: dict[str, list] = {}
    for text in texts:
        name, values = parse_option_arg(text)
        if name in out:
            raise OptionError(f"option {name} is given twice; list its values in one --option")
        out[name] = values
    return out


def with_options(base: Options, assignments: Mapping[str, object]) -> Options:
    """``base`` with every ``dotted name -> value`` of ``assignments`` set
    (:meth:`Options.with_values`); a ``ValueError`` from the options' own checks becomes an
    :class:`OptionError` naming the assignments (as it is where it leads with the option)."""
    try:
        return base.with_values(dict(assignments))
    except (ValueError, KeyError) as e:
        if any(str(e).startswith(f"{n}: ") for n in assignments):  # it names the option
            raise OptionError(str(e)) from e
        what = " ".join(f"{n}={format_value(v)}" for n, v in assignments.items())
        raise OptionError(f"options {what}: {e}") from e


def combinations(values: Mapping[str, list], combine: str = "product") -> list[dict]:
    """The variants, the first of them the baseline; no options: one variant, none set.

    ``product``: every combination of the options' values (the first option's values vary
    slowest).  ``zip``: the i-th values of every option together (every option lists the same
    number of values, or one value: held fixed).  ``each``: the baseline (every option at its
    first value), then one option at a time at each of its other values, the others at
    their first (which option costs what, one change at a time).
    """
    if not values:
        return [{}]
    names = list(values)
    if combine == "product":
        return [dict(zip(names, vs, strict=True)) for vs in itertools.product(*values.values())]
    if combine == "each":
        base = {k: v[0] for k, v in values.items()}
        return [base] + [base | {k: x} for k, vs in values.items() for x in vs[1:]]
    if combine != "zip":
        raise OptionError(f"--combine: expected product, zip or each, got {combine!r}")
    n = max(len(v) for v in values.values())
    uneven = [f"{k} ({len(v)})" for k, v in values.items() if len(v) not in (1, n)]
    if uneven:
        raise OptionError(
            f"--combine zip needs the same number of values ({n}) for every option that "
            f"varies, or one value; {', '.join(uneven)} differ"
        )
    return [{k: v[i] if len(v) > 1 else v[0] for k, v in values.items()} for i in range(n)]


def variant_label(assign: Mapping[str, object], values: Mapping[str, list]) -> str:
    """A variant's name: the options that vary across the variants, ``name=value`` joined
    by spaces (``default`` when none varies)."""
    vary = [n for n, vs in values.items() if len(vs) > 1]
    return " ".join(f"{n}={format_value(assign[n])}" for n in vary) or "default"


def list_options() -> str:
    """One line per option of :class:`flashgen.Options`: dotted name, how its values are
    written (:meth:`Options.describe`: an int's range or values too), its default (a bool's
    as ``true`` / ``false``)."""

    def default(name: str) -> str:
        value = DEFAULT.get_path(name)
        return ("true" if value else "false") if isinstance(value, bool) else format_value(value)

    rows = [(n, Options.describe(n), default(n)) for n in Options.paths()]
    w0 = max([len(r[0]) for r in rows] + [6])
    w1 = max([len(r[1]) for r in rows] + [6])
    lines = [f"{'option':{w0}}  {'values':{w1}}  default"]
    lines += [f"{a:{w0}}  {b:{w1}}  {c}" for a, b, c in rows]
    return "\n".join(lines)
