"""On-disk cache of compiled kernels.

Layout::

    $FLASHGEN_CACHE_DIR (default ~/.cache/flashgen)
      /<flashgen version>/<arch>/<uri>/kernel.cubin
                                      /meta.json     {uri, kernel_name, cubin_sha256, report}
      /<flashgen version>/<arch>/<uri>.lock

``uri`` is the sha256 of (source, arch, the full nvcc argv less paths (gencode and
flags), nvcc version, kernel name): a pure function of what goes into nvcc.
:func:`get_or_build` follows the sequence
*try load -> file lock -> try load again -> compile to a temp file -> atomic rename
-> load*, so concurrent builders (threads or processes) of one uri compile once, and a
reader never sees a half-written cubin.  ``meta.json`` is written last and carries the
cubin's sha256: an entry whose json is unreadable or whose checksum does not match is
rebuilt.  No torch, no cupy.

A cache directory that cannot be written (read-only mount, no permission, a file in the
way) is not fatal: entries already there are still served, and misses are built in a
per-user temporary cache (:func:`fallback_root`) with a ``RuntimeWarning``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path

from filelock import FileLock

from flashgen import __version__
from flashgen.build import compile as _compile
from flashgen.build.compile import CompileReport, compile_source, nvcc_version

CUBIN = "kernel.cubin"
META = "meta.json"

_stats_lock = threading.Lock()
#: Number of nvcc runs done by :func:`get_or_build` in this process (tests read it).
builds = 0
#: Cache roots found unwritable in this process (warned about once each).
_warned_roots: set[str] = set()
#: A kernel name must be a C identifier: it names files and the extern "C" symbol.
_KERNEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def cache_root() -> Path:
    """``$FLASHGEN_CACHE_DIR`` or ``~/.cache/flashgen`` (read on every call)."""
    from flashgen import env as _env

    env = _env.get(_env.CACHE_DIR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "flashgen"


def fallback_root() -> Path:
    """Per-user temporary cache used when :func:`cache_root` cannot be written."""
    uid = os.getuid() if hasattr(os, "getuid") else os.getpid()
    return Path(tempfile.gettempdir()) / f"flashgen-cache-{uid}"


def cache_key(source: str, plan) -> str:
    """The uri: sha256 hex of everything that determines the cubin.

    That is the CUDA source, the target arch, the nvcc argv without its file paths
    (``-gencode`` and every flag, read from :func:`flashgen.build.compile.nvcc_command`, so
    a change to the flags changes the key), the toolkit version and the kernel name, and
    the plan's non-default options (``plan.options_key``; absent for the defaults, so their
    keys are those of earlier versions).
    """
    argv = _compile.nvcc_command(plan, "SRC", "OUT", nvcc="nvcc")[1:]
    h = hashlib.sha256()
    for part in (
        source,
        plan.arch,
        plan.gencode,
        " ".join(argv),
        nvcc_version(),
        plan.kernel_name,
    ):
        h.update(part.encode())
        h.update(b"\0")
    options_key = getattr(plan, "options_key", "")
    if options_key:
        h.update(f"options:{options_key}".encode())
    return h.hexdigest()


def entry_dir(uri: str, plan, root: Path | None = None) -> Path:
    """Directory of cache entry ``uri`` for ``plan.arch`` under ``root`` (default
    :func:`cache_root`)."""
    return (cache_root() if root is None else root) / __version__ / plan.arch / uri


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
        if info.get("uri", entry.name) != entry.name:  # an entry copied under another key
            return None
        if _sha256_file(cubin) != info["cubin_sha256"]:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return cubin, dataclasses.replace(report, from_cache=True, seconds=0.0)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _prepare(entry: Path) -> FileLock:
    """Create ``entry``'s parent and return its (unacquired) lock; ``OSError`` if the
    directory cannot be created or written."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    probe = entry.parent / f".write-probe.{os.getpid()}.{threading.get_ident()}"
    probe.write_bytes(b"")
    probe.unlink()
    return FileLock(str(entry.parent / f"{entry.name}.lock"))


def get_or_build(source: str, plan) -> tuple[Path, CompileReport]:
    """Path of the cubin for (``source``, ``plan``), compiling it on a miss.

    Returns ``(cubin_path, report)``; ``report.from_cache`` tells whether nvcc ran.
    Raises :class:`~flashgen.build.compile.CompileError` (or ``NvccNotFoundError``) on a miss
    that fails to compile; nothing is cached then.  If the cache directory cannot be
    written, the entry is built under :func:`fallback_root` with a ``RuntimeWarning``.
    Raises ``ValueError`` for a ``plan.kernel_name`` that is not a C identifier.
    """
    if not _KERNEL_NAME.match(str(plan.kernel_name)):
        raise ValueError(f"kernel name {plan.kernel_name!r} is not a C identifier")
    uri = cache_key(source, plan)
    entry = entry_dir(uri, plan)
    hit = try_load(entry)
    if hit is not None:
        return hit
    try:
        lock = _prepare(entry)
    except OSError as e:
        root = cache_root()
        fallback = fallback_root()
        if str(root) not in _warned_roots:
            _warned_roots.add(str(root))
            warnings.warn(
                f"flashgen kernel cache {root} is not writable ({e.strerror or e}); "
                f"building in {fallback} instead (set FLASHGEN_CACHE_DIR to a writable "
                "directory to keep kernels across runs)",
                RuntimeWarning,
                stacklevel=2,
            )
        entry = entry_dir(uri, plan, fallback)
        hit = try_load(entry)
        if hit is not None:
            return hit
        lock = _prepare(entry)  # an unwritable temp dir is a real error
    return _build_locked(source, plan, uri, entry, lock)


def _build_locked(
    source: str, plan, uri: str, entry: Path, lock: FileLock
) -> tuple[Path, CompileReport]:
    """Under ``lock``: load ``entry`` if another builder finished it, else compile it."""
    global builds
    with lock:
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
