"""On/off switches read from the environment (``FLASHGEN_ATOMIC_DQ``, ``FLASHGEN_NO_TMA_CACHE``
...): one parser, so ``FLASHGEN_ATOMIC_DQ=yes`` means what it says and ``=maybe`` is an
error naming the variable, not a silent "off"."""

from __future__ import annotations

import contextlib
import os

#: Set to ``0``: the kernels keep the mask's tensor reads per element (no row / column terms;
#: :mod:`flashgen.select`).
SIDE_TERMS_ENV = "FLASHGEN_SIDE_TERMS"
#: Set to ``1``: the CUDA op fills o and lse with NaN before each launch
#: (:func:`flashgen.ops.op.poison_outputs`).
POISON_ENV = "FLASHGEN_POISON_OUTPUTS"

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def flag(name: str, default: bool | None = False) -> bool | None:
    """The switch ``name``: True for ``1/true/yes/on``, False for ``0/false/no/off`` (any
    case, surrounding blanks ignored), ``default`` when unset or empty.  Read on every call.

    Raises ``ValueError`` naming the variable, its value and the accepted ones otherwise.
    """
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(
        f"{name}={os.environ[name]!r}: expected one of {', '.join(_ON + _OFF)} (or unset)"
    )


@contextlib.contextmanager
def scoped_env(env: dict[str, str]):
    """``os.environ`` updated with ``env`` inside the ``with`` block, each variable restored
    (or removed) after it, also when the block raises.  For tools that A/B switches read at
    plan or call time (``tools/mask_ab.py``, ``tools/sparse_walk_ab.py``)."""
    old = {n: os.environ.get(n) for n in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for n, v in old.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v
