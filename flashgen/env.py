"""The one module that reads the environment: paths and debugging only.

Read here: ``FLASHGEN_CACHE_DIR`` (kernel cache root), ``FLASHGEN_NVCC`` (the nvcc binary),
``FLASHGEN_TUNING_TABLE`` (another tuning table file), ``FLASHGEN_POISON_OUTPUTS`` (fill o
and lse with NaN before each launch) and ``FLASHGEN_VARLEN_CHECK`` (check varlen offsets on
the host).  Kernel choices are options (:class:`flashgen.options.Options`), never
environment variables: :data:`REMOVED` maps each former switch to its replacement, and
:func:`check_removed` (called by ``flashgen.load`` and the CLI) raises naming it when one is
still set."""

from __future__ import annotations

import os

CACHE_DIR = "FLASHGEN_CACHE_DIR"
NVCC = "FLASHGEN_NVCC"
TUNING_TABLE = "FLASHGEN_TUNING_TABLE"
POISON_OUTPUTS = "FLASHGEN_POISON_OUTPUTS"
VARLEN_CHECK = "FLASHGEN_VARLEN_CHECK"
#: Every ``FLASHGEN_*`` name this package reads.
READ = (CACHE_DIR, NVCC, TUNING_TABLE, POISON_OUTPUTS, VARLEN_CHECK)

_LOAD = "flashgen.load(spec, options=Options(...))"
#: Former switches -> what replaces them.
REMOVED: dict[str, str] = {
    "FLASHGEN_KERNEL_FAMILY": f"{_LOAD} with family='auto'|'fa3'|'fa2'",
    "FLASHGEN_ATOMIC_DQ": f"op(..., deterministic=...) and {_LOAD} with atomic_dq=True|False",
    "FLASHGEN_PERSISTENT": f"{_LOAD} with persistent='off'|'static'|'m_major'|'dynamic'",
    "FLASHGEN_SPARSE_PERSISTENT": f"{_LOAD} with sparse_persistent=...",
    "FLASHGEN_SPARSE_TILES": f"{_LOAD} with sparse_tiles=False",
    "FLASHGEN_SIDE_TERMS": f"{_LOAD} with side_terms=False",
    "FLASHGEN_PERSISTENT_CTAS": f"{_LOAD} with persistent_ctas=N",
    "FLASHGEN_AFFINE": "Options().replace_path('hopper_fwd.affine', False) (and fa2_fwd.affine)",
    "FLASHGEN_CAUSAL_TILES": "Options().replace_path('hopper_fwd.causal_tiles', False)",
    "FLASHGEN_COL_LIMIT": "Options().replace_path('hopper_fwd.col_limit', False)",
    "FLASHGEN_COL_BOUND": "Options().replace_path('hopper_fwd.col_bound', False)",
    "FLASHGEN_SINGLE_WALK": "Options().replace_path('hopper_fwd.single_walk', False)",
    "FLASHGEN_WALK_FROM_DIAGONAL": "Options().replace_path('hopper_fwd.walk_from_diagonal', False)",
    "FLASHGEN_PERSISTENT_WARP_WALK": "Options().replace_path('hopper_fwd.warp_walk', False)",
    "FLASHGEN_HEAD_GROUPS": "Options().replace_path('hopper_fwd.head_groups', False) "
    "(and fa2_fwd.head_groups, hopper_bwd.head_groups)",
    "FLASHGEN_NONNEG_DIV": "Options().replace_path('hopper_fwd.nonneg_div', False)",
    "FLASHGEN_HOPPER_BWD_DQ_A": "nothing: the Hopper backward reads dS from shared memory",
    "FLASHGEN_NO_TMA_CACHE": "flashgen.runtime.tma.set_cache_enabled(False)",
}

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


class RemovedVariableError(RuntimeError):
    """A removed ``FLASHGEN_*`` switch is set; the message names its replacement."""


def check_removed() -> None:
    """Raise :class:`RemovedVariableError` if any variable of :data:`REMOVED` is set (to
    anything, even empty), naming each with its replacement: a switch that silently did
    nothing would mislead."""
    found = [n for n in REMOVED if n in os.environ]
    if found:
        lines = "\n".join(f"  {n}: use {REMOVED[n]}" for n in found)
        raise RemovedVariableError(
            "flashgen no longer reads these environment variables (unset them):\n" + lines
        )


#: Other programs' variables flashgen follows: the CUDA toolkit's location and the executable
#: search path (nvcc lookup) and the terminal width (tables).
FOREIGN = ("CUDA_HOME", "CUDA_PATH", "PATH", "COLUMNS")


def foreign(name: str) -> str | None:
    """The value of another program's variable ``name`` (one of :data:`FOREIGN`;
    ``ValueError`` for another)."""
    if name not in FOREIGN:
        raise ValueError(f"flashgen reads no environment variable {name!r}; read: {FOREIGN}")
    return os.environ.get(name)


def get(name: str) -> str | None:
    """The value of ``name`` (one of :data:`READ`; ``ValueError`` for another)."""
    if name not in READ:
        raise ValueError(f"flashgen reads no environment variable {name!r}; read: {READ}")
    return os.environ.get(name)


def flag(name: str, default: bool | None = False) -> bool | None:
    """The switch ``name`` (of :data:`READ`): True for ``1/true/yes/on``, False for
    ``0/false/no/off`` (any case, blanks ignored), ``default`` when unset or empty.  Read
    on every call.  ``ValueError`` naming the variable and the accepted values otherwise."""
    value = (get(name) or "").strip().lower()
    if not value:
        return default
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(
        f"{name}={os.environ[name]!r}: expected one of {', '.join(_ON + _OFF)} (or unset)"
    )


_RAW = getattr(os.environ, "_data", None)


def any_set_test(*names: str):
    """``test()``: whether any of ``names`` is set (to anything), for per-call checks on hot
    paths (the planned decode call), which then read the value with :func:`flag`.  Where the
    platform's ``os.environ`` allows it, the raw keys are encoded once (``os.environ``
    encodes the key on every access) and ``test`` is one set test against the live keys of
    its storage."""
    if _RAW is None:
        return lambda: any(n in os.environ for n in names)
    keys = frozenset(os.environ.encodekey(n) for n in names)
    live = _RAW.keys()
    return lambda: not live.isdisjoint(keys)
