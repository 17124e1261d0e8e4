"""argparse ``type`` functions the benchmarks and tools share: each error names the argument,
what it takes and the text received (``batch: expected comma-separated positive ints, got
'x'``), which argparse prints after ``argument --batch:`` (exit 2)."""

from __future__ import annotations

import argparse
import re


def positive_ints(name: str):
    """An argparse ``type`` for ``--NAME A,B,...``: a list of ints >= 1, else an error
    ``NAME: expected comma-separated positive ints, got 'TEXT'``."""

    def parse(text: str) -> list[int]:
        parts = [p.strip() for p in text.split(",")]
        if not all(re.fullmatch(r"\+?[0-9]+", p) and int(p) >= 1 for p in parts):
            raise argparse.ArgumentTypeError(
                f"{name}: expected comma-separated positive ints, got {text!r}"
            )
        return [int(p) for p in parts]

    parse.__name__ = name  # argparse names a failed type by it
    return parse


def positive_int(name: str):
    """An argparse ``type``: one int >= 1, else ``NAME: expected an int >= 1, got 'TEXT'``."""

    def parse(text: str) -> int:
        t = text.strip()
        if not re.fullmatch(r"\+?[0-9]+", t) or int(t) < 1:
            raise argparse.ArgumentTypeError(f"{name}: expected an int >= 1, got {text!r}")
        return int(t)

    parse.__name__ = name
    return parse


def nonnegative_int(name: str):
    """An argparse ``type``: one int >= 0, else ``NAME: expected an int >= 0, got 'TEXT'``."""

    def parse(text: str) -> int:
        t = text.strip()
        if not re.fullmatch(r"\+?[0-9]+", t):
            raise argparse.ArgumentTypeError(f"{name}: expected an int >= 0, got {text!r}")
        return int(t)

    parse.__name__ = name
    return parse


def choices(name: str, allowed: tuple[str, ...]):
    """An argparse ``type`` for ``--NAME A,B,...``: a tuple of values from ``allowed``, each
    once, in the order given; else an error ``NAME: expected comma-separated values from
    a, b, got 'TEXT'``."""

    def parse(text: str) -> tuple[str, ...]:
        items = [p.strip() for p in text.split(",")]
        if not all(items) or any(p not in allowed for p in items):
            raise argparse.ArgumentTypeError(
                f"{name}: expected comma-separated values from {', '.join(allowed)}, got {text!r}"
            )
        return tuple(dict.fromkeys(items))

    parse.__name__ = name
    return parse
