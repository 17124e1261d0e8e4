"""The tuning table: measured best tile configs per GPU, written by ``flashgen tune``.

``flashgen/tuning/table.json`` (shipped as package data) maps a key

    "<GPU name>|<target>|<head_dim>|<dtype>|<causal|noncausal>|<score_mod|none>"

e.g. ``"NVIDIA H200|sm_90|128|bf16|causal|none"``, to an entry

    {"block_m": 128, "block_n": 64, "num_warps": 4, "tflops": 312.4, "date": "2026-11-30", ...}

(``tflops``: the winner's mean forward TFLOP/s over the tuning sequence lengths; other fields are
informational, except ``options``: an optional ``{name: bool}`` of FA2-class template switches
(``flashgen.families.fa2_fwd.FORWARD_OPTIONS`` keys, e.g. ``{"fwd_unrolled_loads": false}``) that
:func:`flashgen.families.registry.plan_forward` applies with the entry's tiles, written where a
variant with a switch flipped won, e.g. in a ``flashgen ab --option fa2_fwd.<switch>=...`` run).
``head_dim`` is ``max(head_dim, head_dim_v)``; ``score_mod`` says whether the spec has one at all
(its registers change what fits), not which.

:func:`flashgen.families.registry.choose_tiles` reads it through :func:`lookup`
when it is given the GPU name; the spec's ``tiles:`` override wins over the table and the
table over ``flashgen.families.tiles.DEFAULT_TILES``.  :data:`flashgen.env.TUNING_TABLE` points at
another file (tests, experiments).  Pure Python: no torch, no cupy.
"""

from __future__ import annotations

import json
import os
import threading
from functools import lru_cache
from pathlib import Path

from flashgen import env as _env

#: Environment variable naming an alternative table file (:data:`flashgen.env.TUNING_TABLE`).
ENV = _env.TUNING_TABLE

_write_lock = threading.Lock()


def default_path() -> Path:
    """``flashgen/tuning/table.json`` next to this module (in a checkout or a wheel)."""
    return Path(__file__).resolve().parent / "table.json"


def table_path() -> Path:
    """The file :data:`flashgen.env.TUNING_TABLE` names if set, else :func:`default_path`
    (read on every call)."""
    env = _env.get(ENV)
    return Path(env).expanduser() if env else default_path()


def table_key(
    gpu: str, target: str, head_dim: int, dtype: str, causal: bool, has_score_mod: bool
) -> str:
    """The table key, e.g. ``"NVIDIA H200|sm_90|128|bf16|causal|none"``."""
    return "|".join(
        (
            gpu.strip(),
            target,
            str(int(head_dim)),
            dtype,
            "causal" if causal else "noncausal",
            "score_mod" if has_score_mod else "none",
        )
    )


def valid_entry(entry) -> bool:
    """Whether ``entry`` holds a usable tile config: block_m, block_n, num_warps positive
    ints, block_n a multiple of 16, and block_m a multiple of 16 * num_warps (FA2-class
    kernel) or 64 per consumer warpgroup (the Hopper kernel: num_warps a multiple of 4,
    one producer warpgroup).
    """
    if not isinstance(entry, dict):
        return False
    try:
        bm, bn, nw = entry["block_m"], entry["block_n"], entry["num_warps"]
    except KeyError:
        return False
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (bm, bn, nw)):
        return False
    from flashgen.codegen.plan import TileConfig, is_hopper_tiles

    opts = entry.get("options", {})
    if not isinstance(opts, dict) or not all(
        isinstance(k, str) and isinstance(v, bool) for k, v in opts.items()
    ):
        return False
    return (bm % (16 * nw) == 0 or is_hopper_tiles(TileConfig(bm, bn, nw))) and bn % 16 == 0


@lru_cache(maxsize=8)
def _read(path: str, mtime_ns: int, size: int) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    entries = data.get("entries", data)
    if not isinstance(entries, dict):
        return {}
    return {k: v for k, v in entries.items() if isinstance(k, str) and valid_entry(v)}


def load_table(path: str | os.PathLike | None = None) -> dict[str, dict]:
    """Valid entries of the table at ``path`` (default :func:`table_path`), key -> entry.

    A missing or unreadable file is an empty table; malformed entries are dropped.
    Re-read whenever the file's mtime or size changes.
    """
    p = Path(path) if path is not None else table_path()
    try:
        st = p.stat()
    except OSError:
        return {}
    return _read(str(p), st.st_mtime_ns, st.st_size)


def lookup(
    gpu: str | None,
    target: str,
    head_dim: int,
    dtype: str,
    causal: bool,
    has_score_mod: bool,
    path: str | os.PathLike | None = None,
) -> tuple[int, int, int] | None:
    """``(block_m, block_n, num_warps)`` tuned for this key, or None (no GPU name or untuned)."""
    entry = _entry(gpu, target, head_dim, dtype, causal, has_score_mod, path)
    if entry is None:
        return None
    return entry["block_m"], entry["block_n"], entry["num_warps"]


def lookup_options(
    gpu: str | None,
    target: str,
    head_dim: int,
    dtype: str,
    causal: bool,
    has_score_mod: bool,
    path: str | os.PathLike | None = None,
) -> dict[str, bool]:
    """The entry's ``options`` (template switches measured with its tiles), ``{}`` if none."""
    entry = _entry(gpu, target, head_dim, dtype, causal, has_score_mod, path)
    return dict(entry.get("options", {})) if entry is not None else {}


def _entry(gpu, target, head_dim, dtype, causal, has_score_mod, path) -> dict | None:
    """The table's entry for this key (None without a GPU name or when untuned)."""
    if not gpu:
        return None
    return load_table(path).get(table_key(gpu, target, head_dim, dtype, causal, has_score_mod))


def update_table(key: str, entry: dict, path: str | os.PathLike | None = None) -> Path:
    """Set ``key`` -> ``entry`` in the table file (created if missing); returns its path.

    The file is rewritten atomically with sorted keys, so diffs of the committed table stay
    small.  Raises ``ValueError`` for an entry :func:`valid_entry` rejects.
    """
    if not valid_entry(entry):
        raise ValueError(f"not a valid tile entry: {entry!r}")
    p = Path(path) if path is not None else table_path()
    with _write_lock:
        try:
            doc = json.loads(p.read_text())
            if not isinstance(doc, dict):
                doc = {}
        except (OSError, ValueError):
            doc = {}
        entries = doc.get("entries") if isinstance(doc.get("entries"), dict) else {}
        entries[key] = entry
        doc = {
            "comment": doc.get("comment", _COMMENT),
            "entries": dict(sorted(entries.items())),
        }
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, p)
    return p


_COMMENT = (
    "Tile configs measured by `flashgen tune`; key GPU|target|head_dim|dtype|causal|score_mod. "
    "See flashgen/tuning/__init__.py."
)
