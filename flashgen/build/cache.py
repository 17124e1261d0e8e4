"""On-disk cache of compiled kernels.

Layout::

    <cache root> (flashgen.env.CACHE_DIR, default ~/.cache/flashgen)
      /<flashgen version>/<arch>/<uri>/kernel.cubin
                                      /meta.json     {uri, kernel_name, cubin_sha256, report}
      /<flashgen version>/<arch>/<uri>.lock

``uri`` is the sha256 of (source, arch, the full nvcc argv less paths (gencode and
flags), nvcc version, kernel name): a pure function of what goes into nvcc (with NVRTC, the
compiler's options and :attr:`~flashgen.build.compile.Compiler.key` in their place).
:func:`get_or_build` follows the sequence
*try load -> file lock -> try load again -> compile to a temp file -> atomic rename
-> load*, so concurrent builders (threads or processes) of one uri compile once, and a
reader never sees a half-written cubin.  ``meta.json`` is written last and carries the
cubin's sha256: an entry whose json is unreadable or whose checksum does not match is
rebuilt.  No torch, no cupy.

A cache directory that cannot be written (read-only mount, no permission, a file in the
way) is not fatal: entries already there are still served, and misses are built in a
per-user temporary cache (:func:`fallback_root`) with a :class:`CacheWarning`.

Trust: a cubin is code that runs on the GPU in the user's process, and its checksum in
``meta.json`` beside it catches corruption, not tampering.  So, as ssh does for keys, the
cache root, every directory under it and every entry file must be owned by the current user
and not writable by group or others (and nothing below the root may be a link); anything
else raises :class:`UnsafeCacheError` naming the path and the fix.  Directories are created
0700, files through ``mkstemp`` (``O_EXCL``, never through a planted link) and
``os.replace``.  The fallback is created 0700 and verified after creation.  A build lock
held by another process past :data:`LOCK_TIMEOUT_S` raises :class:`CacheLockTimeout`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import stat
import tempfile
import threading
import time
import warnings
from pathlib import Path

from filelock import FileLock, Timeout

from flashgen import env as _env
from flashgen.build import compile as _compile
from flashgen.build.compile import CompileReport, compile_source, nvcc_version
from flashgen.version import __version__

CUBIN = "kernel.cubin"
META = "meta.json"

_stats_lock = threading.Lock()
#: Number of nvcc runs done by :func:`get_or_build` in this process (tests read it).
builds = 0
#: Cache roots found unwritable in this process (warned about once each).
_warned_roots: set[str] = set()
#: A kernel name must be a C identifier: it names files and the extern "C" symbol.
_KERNEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Seconds to wait for another process's build lock on one entry: longer than the nvcc
#: run it may be doing (:data:`flashgen.build.compile.NVCC_TIMEOUT_S`).
LOCK_TIMEOUT_S = _compile.NVCC_TIMEOUT_S + 120


class UnsafeCacheError(PermissionError):
    """A cache directory or entry that another user could have written: refused."""


class CacheLockTimeout(TimeoutError):
    """Another process held an entry's build lock longer than :data:`LOCK_TIMEOUT_S`."""


class CacheWarning(RuntimeWarning):
    """A notice about the kernel cache (e.g. the unwritable-root fallback)."""


def _owner_check() -> bool:
    return hasattr(os, "getuid")


def check_trusted(path: Path, *, follow: bool = False, private: bool = False) -> None:
    """Raise :class:`UnsafeCacheError` unless ``path`` is owned by the current user and not
    writable by group or others (``private``: no group/other access at all); below the root
    (``follow=False``) a symbolic link is refused too.  ``OSError`` if it cannot be
    stat'ed.  No check where the platform has no user ids."""
    st = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeCacheError(
            f"kernel cache: {path} is a symbolic link; flashgen refuses links inside the "
            "cache (another user could point them at their own kernels)"
        )
    if not _owner_check():
        return
    uid = os.getuid()
    if st.st_uid != uid:
        raise UnsafeCacheError(
            f"kernel cache: {path} is owned by uid {st.st_uid}, not by you (uid {uid}); "
            f"flashgen only runs kernels from a cache you own: set {_env.CACHE_DIR} to a "
            "directory of your own"
        )
    bad = st.st_mode & (0o077 if private else 0o022)
    if bad:
        raise UnsafeCacheError(
            f"kernel cache: {path} has mode {stat.S_IMODE(st.st_mode):o}, "
            f"{'accessible' if private else 'writable'} by group or others, so another user "
            f"could plant kernels in it; run `chmod go-{'rwx' if private else 'w'} {path}` "
            f"(or point {_env.CACHE_DIR} elsewhere)"
        )


def _private_dir(path: Path, *, follow: bool = False, private: bool = False) -> None:
    """Create ``path`` (mode 0700) if missing, then :func:`check_trusted` it."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    check_trusted(path, follow=follow, private=private)


def cache_root() -> Path:
    """The directory :data:`flashgen.env.CACHE_DIR` names, or ``~/.cache/flashgen`` (read on
    every call)."""
    env = _env.get(_env.CACHE_DIR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "flashgen"


def fallback_root() -> Path:
    """Per-user temporary cache used when :func:`cache_root` cannot be written (created
    0700 by :func:`get_or_build`, which refuses it unless it is the user's own, 0700)."""
    uid = os.getuid() if hasattr(os, "getuid") else os.getpid()
    return Path(tempfile.gettempdir()) / f"flashgen-cache-{uid}"


def cache_key(source: str, plan) -> str:
    """The uri: sha256 hex of everything that determines the cubin.

    That is the CUDA source, the target arch, the nvcc argv without its file paths
    (``-gencode`` and every flag, read from :func:`flashgen.build.compile.nvcc_command`, so
    a change to the flags changes the key), the toolkit version and the kernel name, and
    the plan's non-default options (``plan.options_key``; absent for the defaults, so their
    keys are those of earlier versions).  The compiler is the one
    :func:`flashgen.build.compile.find_compiler` picks: for NVRTC its options
    (:func:`~flashgen.build.compile.nvrtc_options`) and its
    :attr:`~flashgen.build.compile.Compiler.key` replace the nvcc argv and version, so a
    kernel NVRTC built is never served to an nvcc build, or the reverse.
    """
    comp = _compile.find_compiler()
    if comp.kind == "nvcc":
        argv = _compile.nvcc_command(plan, "SRC", "OUT", nvcc="nvcc")[1:]
        version = nvcc_version()
    else:
        argv = ["nvrtc", *_compile.nvrtc_options(plan, None)]
        version = comp.key
    h = hashlib.sha256()
    for part in (
        source,
        plan.arch,
        plan.gencode,
        " ".join(argv),
        version,
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


def _trusted_tree(entry: Path) -> None:
    """:func:`check_trusted` for the cache root above ``entry`` and each directory from
    there down to ``entry`` (those that exist).  ``entry`` is ``root/version/arch/uri``."""
    root = entry.parents[2]
    for i, path in enumerate((root, entry.parents[1], entry.parent, entry)):
        try:
            check_trusted(path, follow=i == 0)
        except (FileNotFoundError, NotADirectoryError):
            return


def try_load(entry: Path) -> tuple[Path, CompileReport] | None:
    """(cubin path, report) if ``entry`` is complete and its checksum matches, else None.

    Raises :class:`UnsafeCacheError` for an entry (or a directory above it, up to the cache
    root) that is not the user's own or is writable by others: such a cubin is never
    loaded."""
    cubin, meta = entry / CUBIN, entry / META
    _trusted_tree(entry)
    try:
        for f in (cubin, meta):
            check_trusted(f)
            if not stat.S_ISREG(os.lstat(f).st_mode):
                return None
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        info = json.loads(meta.read_text())
        report = CompileReport.from_dict(info["report"])
        if info.get("uri", entry.name) != entry.name:  # an entry copied under another key
            return None
        if _sha256_file(cubin) != info["cubin_sha256"]:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:  # last use, for `flashgen cache --prune --older-than`
        os.utime(meta)
    except OSError:
        pass
    return cubin, dataclasses.replace(report, from_cache=True, seconds=0.0)


def _atomic_write_text(path: Path, text: str) -> None:
    """``text`` to ``path`` through ``mkstemp`` (``O_EXCL``, 0600) and ``os.replace``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _prepare(entry: Path) -> FileLock:
    """Create the directories down to ``entry``'s parent (0700, each checked with
    :func:`check_trusted`) and return its (unacquired) lock; ``OSError`` if a directory
    cannot be created or written, :class:`UnsafeCacheError` if one is not the user's."""
    root = entry.parents[2]
    if not root.exists():
        root.parent.mkdir(parents=True, exist_ok=True)
    _private_dir(root, follow=True)
    _private_dir(entry.parents[1])
    _private_dir(entry.parent)
    fd, probe = tempfile.mkstemp(dir=entry.parent, prefix=".write-probe.")
    os.close(fd)
    os.unlink(probe)
    return FileLock(str(entry.parent / f"{entry.name}.lock"), timeout=LOCK_TIMEOUT_S)


def get_or_build(source: str, plan) -> tuple[Path, CompileReport]:
    """Path of the cubin for (``source``, ``plan``), compiling it on a miss.

    Returns ``(cubin_path, report)``; ``report.from_cache`` tells whether nvcc ran.
    Raises :class:`~flashgen.build.compile.CompileError` (or ``NvccNotFoundError``) on a miss
    that fails to compile; nothing is cached then.  If the cache directory cannot be
    written, the entry is built under :func:`fallback_root` with a :class:`CacheWarning`.
    Raises ``ValueError`` for a ``plan.kernel_name`` that is not a C identifier,
    :class:`UnsafeCacheError` for a cache (root, directory or entry) another user could
    have written, :class:`CacheLockTimeout` when another process holds the entry's lock
    longer than :data:`LOCK_TIMEOUT_S`.
    """
    if not _KERNEL_NAME.fullmatch(str(plan.kernel_name)):
        raise ValueError(f"kernel name {plan.kernel_name!r} is not a C identifier")
    uri = cache_key(source, plan)
    entry = entry_dir(uri, plan)
    hit = try_load(entry)
    if hit is not None:
        return hit
    try:
        lock = _prepare(entry)
    except UnsafeCacheError:
        raise
    except OSError as e:
        root = cache_root()
        fallback = fallback_root()
        if str(root) not in _warned_roots:
            _warned_roots.add(str(root))
            warnings.warn(
                f"flashgen kernel cache {root} is not writable ({e.strerror or e}); "
                f"building in {fallback} instead (set {_env.CACHE_DIR} to a writable "
                "directory to keep kernels across runs)",
                CacheWarning,
                stacklevel=2,
            )
        fallback.parent.mkdir(parents=True, exist_ok=True)
        _private_dir(fallback, private=True)  # an unwritable temp dir is a real error
        entry = entry_dir(uri, plan, fallback)
        hit = try_load(entry)
        if hit is not None:
            return hit
        lock = _prepare(entry)
    return _build_locked(source, plan, uri, entry, lock)


def _build_locked(
    source: str, plan, uri: str, entry: Path, lock: FileLock
) -> tuple[Path, CompileReport]:
    """Under ``lock``: load ``entry`` if another builder finished it, else compile it."""
    global builds
    try:
        lock.acquire()
    except Timeout:
        raise CacheLockTimeout(
            f"kernel cache: the build lock {lock.lock_file} was held by another process for "
            f"more than {LOCK_TIMEOUT_S} s (LOCK_TIMEOUT_S); if no other flashgen build is "
            "running, delete that file"
        ) from None
    try:
        hit = try_load(entry)
        if hit is not None:
            return hit
        _private_dir(entry)
        tmpdir = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}."))
        tmp = tmpdir / CUBIN  # in a fresh 0700 directory: nvcc's -o cannot hit a planted link
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
            shutil.rmtree(tmpdir, ignore_errors=True)
    finally:
        lock.release()
    return entry / CUBIN, report


# ----------------------------------------------------------------------------- size, prune
def usage(root: Path | None = None) -> list[dict]:
    """One row per ``<version>/<arch>`` under ``root`` (default :func:`cache_root`):
    ``{"version", "arch", "entries", "bytes", "current"}`` (``current``: this flashgen's
    version).  Links are not followed; [] when there is no cache."""
    root = cache_root() if root is None else root
    rows = []
    if not root.is_dir():
        return rows
    for vdir in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink()):
        for adir in sorted(p for p in vdir.iterdir() if p.is_dir() and not p.is_symlink()):
            entries = [p for p in adir.iterdir() if p.is_dir() and not p.is_symlink()]
            size = sum(
                f.lstat().st_size for e in entries for f in e.rglob("*") if not f.is_symlink()
            )
            rows.append(
                {
                    "version": vdir.name,
                    "arch": adir.name,
                    "entries": len(entries),
                    "bytes": size,
                    "current": vdir.name == __version__,
                }
            )
    return rows


def prune(root: Path | None = None, older_than_days: float | None = None) -> dict:
    """Delete what the current flashgen cannot use: every other flashgen version's tree,
    incomplete or unverifiable entries, and (with ``older_than_days``) entries not used for
    that long (a hit refreshes ``meta.json``'s mtime).  Returns ``{"entries", "bytes"}``
    removed.  Only the user's own, trusted cache is touched (:class:`UnsafeCacheError`
    otherwise); removing an entry is always safe (it is rebuilt on demand).  ``0`` days:
    every entry; ``ValueError`` for a negative or non-finite number of days."""
    if older_than_days is not None and not (
        isinstance(older_than_days, (int, float)) and math.isfinite(older_than_days)
        and older_than_days >= 0
    ):  # a negative cutoff lies in the future: it would delete kernels used just now
        raise ValueError(
            f"older_than_days: expected a finite number >= 0 or None, got {older_than_days!r}"
        )
    root = cache_root() if root is None else root
    removed = {"entries": 0, "bytes": 0}
    if not root.is_dir():
        return removed
    check_trusted(root, follow=True)
    cutoff = None if older_than_days is None else time.time() - older_than_days * 86400

    def drop(path: Path) -> None:
        files = [f for f in path.rglob("*") if f.is_file() and not f.is_symlink()]
        removed["bytes"] += sum(f.lstat().st_size for f in files)
        removed["entries"] += sum(1 for f in files if f.name == META) or 1
        shutil.rmtree(path, ignore_errors=True)

    for vdir in [p for p in root.iterdir() if p.is_dir() and not p.is_symlink()]:
        check_trusted(vdir)
        if vdir.name != __version__:
            drop(vdir)
            continue
        for adir in [p for p in vdir.iterdir() if p.is_dir() and not p.is_symlink()]:
            check_trusted(adir)
            for entry in [p for p in adir.iterdir() if p.is_dir() and not p.is_symlink()]:
                if entry.name.startswith("."):  # a build's temporary directory
                    if time.time() - entry.lstat().st_mtime > LOCK_TIMEOUT_S:
                        drop(entry)
                    continue
                if try_load_quiet(entry) is None:
                    drop(entry)
                elif cutoff is not None and (entry / META).lstat().st_mtime < cutoff:
                    drop(entry)
    return removed


def try_load_quiet(entry: Path):
    """:func:`try_load` without touching the entry's mtime (None when it is refused)."""
    meta = entry / META
    try:
        st = meta.lstat()
    except OSError:
        st = None
    try:
        hit = try_load(entry)
    except UnsafeCacheError:
        return None
    if hit is not None and st is not None:
        os.utime(meta, ns=(st.st_atime_ns, st.st_mtime_ns))
    return hit
