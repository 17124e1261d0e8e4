"""The specs shipped with flashgen, and spec arguments that name one.

Every place that takes a spec file (``flashgen.load``, ``load_spec``, ``flashgen show | build
| bench | ab``) also takes a shipped spec's name (``gpt2_d64``): a path that exists wins;
otherwise a name without a directory part (``.yaml`` optional) is looked up among the shipped
specs, from any working directory.
"""

from __future__ import annotations

import difflib
import errno
import os
from pathlib import Path


def shipped_specs_dir() -> Path | None:
    """The shipped specs: ``flashgen/specs/``, where a wheel installs them (pyproject's
    ``flashgen.specs`` package data), else ``specs/`` of the source checkout flashgen runs
    from; None if neither is there."""
    package = Path(__file__).resolve().parents[1]
    if (package / "specs").is_dir():
        return package / "specs"
    checkout = package.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "specs").is_dir():
        return checkout / "specs"
    return None


def shipped_spec_paths() -> list[Path]:
    """The shipped ``*.yaml`` specs, sorted by name (empty if none are found)."""
    root = shipped_specs_dir()
    return sorted(root.glob("*.yaml")) if root is not None else []


def resolve_spec_path(spec: str | os.PathLike) -> Path:
    """The file ``spec`` names: ``spec`` itself when it exists, else the shipped spec of that
    name (``gpt2_d64`` or ``gpt2_d64.yaml``).  Raises ``FileNotFoundError`` listing the
    shipped specs, with a "did you mean" for a near miss, when it is neither (or empty: ``""``
    is no spec, not the working directory); ``TypeError`` naming ``spec`` for anything but a
    ``str`` or ``os.PathLike``."""
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(
            f"spec: expected a spec file path or a shipped spec's name (str or os.PathLike), "
            f"got {type(spec).__name__}"
        )
    if os.fspath(spec) == "":
        raise FileNotFoundError(
            errno.ENOENT, "expected a spec file or a shipped spec's name, got an empty string", ""
        )
    p = Path(spec)
    if p.exists() or p.is_symlink():
        return p
    text = os.fspath(spec)
    shipped = {q.stem: q for q in shipped_spec_paths()}
    if os.sep not in text and "/" not in text:
        name = text[:-5] if text.endswith(".yaml") else text
        if name in shipped:
            return shipped[name]
    hint = ""
    close = difflib.get_close_matches(p.stem, list(shipped), n=1)
    if close:
        hint = f"; did you mean {close[0]!r}?"
    names = ", ".join(shipped) or "none found"
    raise FileNotFoundError(
        errno.ENOENT,
        f"no such file, nor a shipped spec{hint} (shipped specs: {names})",
        text,
    )
