"""Options by dotted name: set fields of a nested frozen dataclass from command-line text.

``flashgen ab --option hopper_fwd.col_bound=0,1`` names a field of :class:`flashgen.Options`
(a frozen dataclass whose per-family fields are frozen dataclasses too) by its dotted path;
this module lists the settable names (:func:`option_fields`), parses values by each field's
type (:func:`parse_value`), makes the variants (:func:`combinations`) and builds the options
of one variant (:func:`with_options`, ``dataclasses.replace`` level by level).  Nothing here
knows the fields of ``Options``: it walks ``dataclasses.fields``.  Errors are
:class:`OptionError` with the option's name, what it accepts and what it got.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import itertools
import operator
import types
import typing
from collections.abc import Iterable, Mapping


class OptionError(ValueError):
    """A bad ``--option`` (unknown name, bad value) or other ``flashgen ab`` argument."""


_BOOL = {"0": False, "1": True, "false": False, "true": True}
_NONE = ("none", "null")


def _hints(cls: type) -> dict[str, object]:
    """Field name -> resolved type of dataclass ``cls`` (string annotations evaluated)."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - a local class's forward references: take them as written
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _split_none(tp) -> tuple[object, bool]:
    """``(T, True)`` for ``T | None`` / ``Optional[T]``, ``(tp, False)`` otherwise."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            return functools.reduce(operator.or_, args), True
    return tp, False


def _group(tp) -> type | None:
    """The dataclass a field holds (also behind ``| None``), else None."""
    tp, _ = _split_none(tp)
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def option_fields(cls: type, prefix: str = "") -> dict[str, object]:
    """Every settable option of dataclass ``cls``: dotted name -> type, nested dataclass
    fields expanded (``hopper_fwd.affine``), in declaration order."""
    out: dict[str, object] = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints.get(f.name, f.type)
        sub = _group(tp)
        if sub is not None:
            out.update(option_fields(sub, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = tp
    return out


def _groups(cls: type, prefix: str = "") -> list[str]:
    out = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        sub = _group(hints.get(f.name, f.type))
        if sub is not None:
            out += [prefix + f.name, *_groups(sub, f"{prefix}{f.name}.")]
    return out


def describe_type(tp) -> str:
    """How a value of type ``tp`` is written on the command line (for help and errors)."""
    tp, none = _split_none(tp)
    if tp is bool:
        text = "bool (0, 1, true, false)"
    elif typing.get_origin(tp) is typing.Literal:
        text = "one of " + ", ".join(
            format_value(a) if not isinstance(a, str) else a for a in typing.get_args(tp)
        )
    elif typing.get_origin(tp) is tuple:
        text = "integers joined by x (e.g. 128x64)"
    else:
        text = getattr(tp, "__name__", str(tp))
    return text + (", or none" if none else "")


def _or_none(tp, none: bool):
    return typing.Optional[tp] if none else tp  # noqa: UP045 - tp is a runtime object


def parse_value(name: str, text: str, tp):
    """``text`` as a value of the option ``name`` of type ``tp``.

    Accepts: bool ``0/1/true/false`` (any case); ``int`` / ``float``; ``str``; a ``Literal``'s
    members (by their text); ``none`` / ``null`` where the type allows None; ``tuple[int, ...]``
    written ``AxB``.  Raises :class:`OptionError` naming the option, the expected form and
    ``text``.
    """
    raw = text.strip()
    tp, none = _split_none(tp)
    if none and raw.lower() in _NONE:
        return None
    bad = OptionError(f"option {name}: expected {describe_type(_or_none(tp, none))}, got {text!r}")
    if tp is bool:
        if raw.lower() in _BOOL:
            return _BOOL[raw.lower()]
        raise bad
    if typing.get_origin(tp) is typing.Literal:
        for member in typing.get_args(tp):
            if isinstance(member, bool):
                if raw.lower() in _BOOL and _BOOL[raw.lower()] is member:
                    return member
            elif str(member) == raw:
                return member
        raise bad
    if typing.get_origin(tp) is tuple:
        try:
            return tuple(int(x) for x in raw.lower().split("x"))
        except ValueError:
            raise bad from None
    if tp in (int, float):
        try:
            return tp(raw)
        except ValueError:
            raise bad from None
    if tp is str:
        return raw
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        for member in tp:
            if raw in (member.name, str(member.value)):
                return member
        raise OptionError(
            f"option {name}: expected one of {', '.join(m.name for m in tp)}, got {text!r}"
        )
    raise OptionError(f"option {name}: its type {tp!r} cannot be set from the command line")


def format_value(value) -> str:
    """A value as the command line writes it (``1``/``0`` for bools, ``none``, ``128x64``)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    if hasattr(value, "name") and hasattr(value, "value"):  # an Enum member
        return value.name
    return str(value)


def set_option(obj, name: str, value):
    """A copy of the (frozen, possibly nested) dataclass ``obj`` with the field at dotted
    path ``name`` set to ``value`` (``dataclasses.replace`` at every level; a group that is
    None is made from its class's defaults first).  Raises :class:`OptionError` for a name
    that is not a field."""
    head, _, rest = name.partition(".")
    names = {f.name for f in dataclasses.fields(obj)}
    if head not in names:
        raise OptionError(f"{type(obj).__name__} has no field {head!r}")
    if not rest:
        return dataclasses.replace(obj, **{head: value})
    sub = getattr(obj, head)
    if sub is None:
        cls = _group(_hints(type(obj)).get(head))
        if cls is None:
            raise OptionError(f"{type(obj).__name__}.{head} is not a group of options")
        sub = cls()
    if not dataclasses.is_dataclass(sub):
        raise OptionError(f"{type(obj).__name__}.{head} is not a group of options")
    return dataclasses.replace(obj, **{head: set_option(sub, rest, value)})


def with_options(base, assignments: Mapping[str, object]):
    """``base`` with every ``dotted name -> value`` of ``assignments`` set (:func:`set_option`).
    A ``ValueError`` / ``TypeError`` from the dataclass's own checks (``__post_init__``) becomes
    an :class:`OptionError` naming the assignments."""
    out = base
    try:
        for name, value in assignments.items():
            out = set_option(out, name, value)
    except OptionError:
        raise
    except (ValueError, TypeError) as e:
        what = " ".join(f"{n}={format_value(v)}" for n, v in assignments.items())
        raise OptionError(f"options {what}: {e}") from e
    return out


def get_option(obj, name: str):
    """The value at dotted path ``name`` of ``obj`` (None inside a group that is None)."""
    for part in name.split("."):
        if obj is None:
            return None
        obj = getattr(obj, part)
    return obj


def parse_option_arg(text: str, cls: type) -> tuple[str, list]:
    """``NAME=A,B,...`` -> ``(NAME, [A, B, ...])``, values parsed by the field's type.

    Raises :class:`OptionError` for a missing ``=`` or value, an unknown name (with the
    closest known ones), a group's name, a bad value or a value listed twice.
    """
    name, eq, values = text.partition("=")
    name = name.strip()
    if not eq or not name or not values.strip():
        raise OptionError(f"--option expects NAME=VALUE[,VALUE...], got {text!r}")
    fields = option_fields(cls)
    if name not in fields:
        groups = _groups(cls)
        if name in groups:
            inside = [n for n in fields if n.startswith(name + ".")]
            raise OptionError(
                f"{name!r} is a group of options; set one of its fields: {', '.join(inside)}"
            )
        close = difflib.get_close_matches(name, list(fields), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise OptionError(
            f"unknown option {name!r}{hint} (known: {', '.join(fields)}; "
            "`flashgen ab --list-options` shows their types)"
        )
    parsed = [parse_value(name, v, fields[name]) for v in values.split(",")]
    for i, v in enumerate(parsed):
        if any(v == w and type(v) is type(w) for w in parsed[:i]):
            raise OptionError(f"option {name} lists the value {format_value(v)} twice")
    return name, parsed


def parse_options(texts: Iterable[str], cls: type) -> dict[str, list]:
    """Every ``--option`` text parsed (:func:`parse_option_arg`); a name given twice is an
    :class:`OptionError`."""
    out: dict[str, list] = {}
    for text in texts:
        name, values = parse_option_arg(text, cls)
        if name in out:
            raise OptionError(f"option {name} is given twice; list its values in one --option")
        out[name] = values
    return out


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


def options_class() -> type:
    """:class:`flashgen.Options` (imported here, at run time).  Raises :class:`OptionError`
    where this flashgen has none."""
    import flashgen

    cls = getattr(flashgen, "Options", None)
    if cls is None or not dataclasses.is_dataclass(cls):
        raise OptionError(
            "this flashgen has no flashgen.Options: --option and --list-options need it "
            "(`flashgen ab SPEC --peers` still times the op against its peers)"
        )
    return cls


def list_options(cls: type) -> str:
    """One line per option: dotted name, how its values are written, its default."""
    base = cls()
    fields = option_fields(cls).items()
    rows = [(n, describe_type(tp), format_value(get_option(base, n))) for n, tp in fields]
    w0 = max([len(r[0]) for r in rows] + [6])
    w1 = max([len(r[1]) for r in rows] + [6])
    lines = [f"{'option':{w0}}  {'values':{w1}}  default"]
    lines += [f"{a:{w0}}  {b:{w1}}  {c}" for a, b, c in rows]
    return "\n".join(lines)
