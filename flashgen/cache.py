"""On-disk cache of compiled kernels.

Layout::

    $FLASHGEN_CACHE_DIR (default ~/.cache/flashgen)
      /<flashgen version>/<arch>/<uri>/kernel.cubin
                                      /meta.json     {uri, kernel_name, cubin_sha256, report}
      /<flashgen version>/<arch>/<uri>.lock

``uri`` is the sha256 of (source, arch, gencode, nvcc flags, nvcc version): a pure
function of what goes into nvcc.  :func:`get_or_build` follows the sequence
*try load -> file lock -> try load again -> compile to a temp file -> atomic rename
-> load*, so concurrent builders (threads or processes) of one uri compile once, and a
reader never sees a half-written cubin.  ``meta.json`` is written last and carries the
cubin's sha256: an entry whose json is unreadable or whose checksum does not match is
rebuilt.  No torch, no cupy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from pathlib import Path

from filelock import FileLock

from . import __version__
from .compile import NVCC_FLAGS, CompileReport, compile_source, nvcc_version

CUBIN = "kernel.cubin"
META = "meta.json"

_stats_lock = threading.Lock()
#: Number of nvcc runs done by :func:`get_or_build` in this process (tests read it).
builds = 0


def cache_root() -> Path:
    """``$FLASHGEN_CACHE_DIR`` or ``~/.cache/flashgen`` (read on every call)."""
    env = os.environ.get("FLASHGEN_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "flashgen"


def cache_key(source: str, plan) -> str:
    """The uri: sha256 hex of everything that determines the cubin."""
    h = hashlib.sha256()
    for part in (
        source,
        plan.arch,
        plan.gencode,
        " ".join(NVCC_FLAGS),
        nvcc_version(),
        plan.kernel_name,
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def entry_dir(uri: str, plan) -> Path:
    """Directory of cache entry ``uri`` for ``plan.arch``."""
    return cache_root() / __version__ / plan.arch / uri


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def try_load(entry: Path) -> tuple[Path, CompileReport] | None:
    """(cubin path, report) if ``entry`` is complete and its checksum matches, else None."""
    cubin, meta = entry / CUBIN, entry / META
    try:
        info = json.loads(meta.read_text())
        report = CompileReport.from_dict(info["report"])
        if _sha256_file(cubin) != info["cubin_sha256"]:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return cubin, dataclasses.replace(report, from_cache=True, seconds=0.0)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def get_or_build(source: str, plan) -> tuple[Path, CompileReport]:
    """Path of the cubin for (``source``, ``plan``), compiling it on a miss.

    Returns ``(cubin_path, report)``; ``report.from_cache`` tells whether nvcc ran.
    Raises :class:`~flashgen.compile.CompileError` (or ``NvccNotFoundError``) on a miss
    that fails to compile; nothing is cached then.
    """
    global builds
    uri = cache_key(source, plan)
    entry = entry_dir(uri, plan)
    hit = try_load(entry)
    if hit is not None:
        return hit
    entry.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(entry.parent / f"{uri}.lock")):
        hit = try_load(entry)
        if hit is not None:
            return hit
        entry.mkdir(parents=True, exist_ok=True)
        tmp = entry / f".{CUBIN}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            report = compile_source(source, plan, tmp)
            with _stats_lock:
                builds += 1
            digest = _sha256_file(tmp)
            (entry / META).unlink(missing_ok=True)  # never pair new meta with an old cubin
            os.replace(tmp, entry / CUBIN)
            meta = {
                "uri": uri,
                "kernel_name": plan.kernel_name,
                "target": plan.target,
                "cubin_sha256": digest,
                "report": report.to_dict(),
            }
            _atomic_write_text(entry / META, json.dumps(meta, indent=1))
        finally:
            tmp.unlink(missing_ok=True)
    return entry / CUBIN, report
