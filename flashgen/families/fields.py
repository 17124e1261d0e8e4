"""The typed-field check of the kernel options records (:class:`flashgen.options.Options`
and each family's ``Options``): every field's value has its declared type.  Pure Python.

A field annotated ``bool`` takes ``True`` / ``False`` only (not ``"false"``, not 0); ``int``
an int that is not a bool (not ``64.0``, not ``True``); ``float`` a finite int or float
that is not a bool; ``str`` a str; ``X | None`` also ``None``; a field whose type is a
dataclass (a family's record inside :class:`~flashgen.options.Options`) is checked by
that record itself.  Ranges stay with each record's ``__post_init__``."""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import types
import typing


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def _accepts(hint, value) -> bool:
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for a in args:
        if a is type(None) and value is None:
            return True
        if a is bool and isinstance(value, bool):
            return True
        if a is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if (
            a is float
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
        ):
            return True
        if a is str and isinstance(value, str):
            return True
        if isinstance(a, type) and dataclasses.is_dataclass(a) and isinstance(value, a):
            return True
    return False


def describe(hint) -> str:
    """How a value of type ``hint`` is written, e.g. ``"a bool"``, ``"an int or None"``."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    words = {bool: "a bool (True or False)", int: "an int", float: "a finite number",
             str: "a str", type(None): "None"}  # fmt: skip
    return " or ".join(words.get(a, getattr(a, "__name__", str(a))) for a in args)


def check_fields(record, path: str) -> None:
    """Raise ``ValueError`` naming the dotted field (``f"{path}.{field}"``, e.g.
    ``Options.decode.stages``), the expected type and the value received, for the first
    field of dataclass instance ``record`` whose value does not have its declared type."""
    for f in dataclasses.fields(record):
        hint = _hints(type(record))[f.name]
        value = getattr(record, f.name)
        if not _accepts(hint, value):
            raise ValueError(f"{path}.{f.name}={value!r}: expected {describe(hint)}")
