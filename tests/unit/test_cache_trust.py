"""Issue 22, items 1, 2, 5 (nvcc) and 13: a hostile checkout or another local user cannot
make flashgen overwrite files through planted links, run kernels they planted in the cache,
or hang a build; an nvcc timeout kills nvcc's children too; a one-target build keeps the
other targets' committed sources."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashgen.build import cache
from flashgen.build import compile as fcompile
from flashgen.build.generate import write_generated
from flashgen.frontend.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "specs" / "gpt2_d64.yaml"
PROBE = 'extern "C" __global__ void fg_trust_probe(float* x) { x[threadIdx.x] *= 2.0f; }\n'


class Plan:
    target, arch, kernel_name = "sm_80", "sm_80", "fg_trust_probe"
    gencode = "-gencode=arch=compute_80,code=sm_80"


# ----------------------------------------------------------------------------- item 1
def test_planted_links_in_generated_are_never_followed(tmp_path):
    spec = load_spec(SPEC)
    victim = tmp_path / "bashrc"
    victim.write_text("original\n")
    dest = tmp_path / "generated" / spec.name
    dest.mkdir(parents=True)
    names = ["spec.yaml", "manifest.json", "__init__.py", f"{spec.name}_sm_80.cu"]
    for name in names:  # every predictable temporary name of this process, and the files
        (dest / f".{name}.{os.getpid()}.tmp").symlink_to(victim)
    (dest / "spec.yaml").symlink_to(victim)
    write_generated(spec, tmp_path / "generated", targets=("sm_80",))
    assert victim.read_text() == "original\n"
    assert not (dest / "spec.yaml").is_symlink()
    assert (dest / "spec.yaml").read_text() == spec.source


def test_generated_folder_that_is_a_link_is_refused(tmp_path):
    spec = load_spec(SPEC)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "generated").mkdir()
    (tmp_path / "generated" / spec.name).symlink_to(elsewhere)
    with pytest.raises(ValueError, match="link|outside"):
        write_generated(spec, tmp_path / "generated", targets=("sm_80",))
    assert not list(elsewhere.iterdir())


def test_output_root_that_is_a_link_is_refused(tmp_path):
    """Issue 38, item 1: ``generated`` itself a link (a checkout that commits it so) was
    written through (``<link target>/__init__.py`` and ``<link target>/<name>/``)."""
    spec = load_spec(SPEC)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "generated").symlink_to(elsewhere)
    with pytest.raises(ValueError, match="symbolic link"):
        write_generated(spec, tmp_path / "generated", targets=("sm_80",))
    assert not list(elsewhere.iterdir())
    (tmp_path / "real").mkdir()  # a link further up the path as given is refused too
    (tmp_path / "up").symlink_to(tmp_path / "real")
    with pytest.raises(ValueError, match="symbolic link"):
        write_generated(spec, tmp_path / "up" / "generated", targets=("sm_80",))
    assert not list((tmp_path / "real").iterdir())


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_manifest_that_is_a_fifo_does_not_hang_the_build(tmp_path):
    """Issue 38, item 7: a FIFO as ``manifest.json`` blocked the read of the previous
    manifest (the open waits for a writer); it is now skipped by type and replaced."""
    spec = load_spec(SPEC)
    dest = tmp_path / "generated" / spec.name
    dest.mkdir(parents=True)
    os.mkfifo(dest / "manifest.json")
    code = (
        "import sys; from flashgen.build.generate import write_generated; "
        "from flashgen.frontend.spec import load_spec; "
        "write_generated(load_spec(sys.argv[1]), sys.argv[2], targets=('sm_80',))"
    )
    subprocess.run([sys.executable, "-c", code, str(SPEC), str(tmp_path / "generated")],
                   check=True, timeout=30, cwd=REPO)  # fmt: skip
    assert stat.S_ISREG((dest / "manifest.json").lstat().st_mode)
    assert json.loads((dest / "manifest.json").read_text())["targets"]


# ----------------------------------------------------------------------------- item 13
def test_one_target_build_keeps_the_same_specs_other_targets(tmp_path):
    spec = load_spec(SPEC)
    out = write_generated(spec, tmp_path)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    write_generated(spec, tmp_path, targets=("sm_80",))  # `flashgen build --target sm_80`
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


# ----------------------------------------------------------------------------- item 2
@pytest.fixture
def cache_dir(tmp_path, monkeypatch, requires_nvcc):
    root = tmp_path / "cache"
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(root))
    return root


def _planted_entry(root: Path) -> Path:
    """A self-consistent entry (cubin + meta with its sha256) as another user would plant."""
    uri = cache.cache_key(PROBE, Plan)
    entry = cache.entry_dir(uri, Plan, root)
    entry.mkdir(parents=True)
    (entry / cache.CUBIN).write_bytes(b"\x7fELF planted")
    rep = {"target": "sm_80", "arch": "sm_80", "kernels": [], "seconds": 0.0,
           "nvcc_version": "x"}  # fmt: skip
    meta = {"uri": uri, "cubin_sha256": cache._sha256_file(entry / cache.CUBIN), "report": rep}
    (entry / cache.META).write_text(json.dumps(meta))
    return entry


def test_cache_owned_by_someone_else_is_refused(cache_dir, monkeypatch):
    entry = _planted_entry(cache_dir)
    assert cache.try_load(entry) is not None  # our own: served
    monkeypatch.setattr(os, "getuid", lambda: os.geteuid() + 1)  # now it is someone else's
    with pytest.raises(cache.UnsafeCacheError, match="owned by uid .* not by you"):
        cache.get_or_build(PROBE, Plan)


@pytest.mark.parametrize("what", ["root", "entry", "cubin", "meta"])
def test_group_writable_cache_is_refused(cache_dir, what):
    entry = _planted_entry(cache_dir)
    path = {"root": cache_dir, "entry": entry, "cubin": entry / cache.CUBIN,
            "meta": entry / cache.META}[what]  # fmt: skip
    path.chmod(path.stat().st_mode | stat.S_IWGRP | stat.S_IWOTH)
    with pytest.raises(cache.UnsafeCacheError, match="chmod go-w"):
        cache.get_or_build(PROBE, Plan)


def test_link_inside_the_cache_is_refused(cache_dir, tmp_path):
    entry = _planted_entry(cache_dir)
    elsewhere = tmp_path / "planted.cubin"
    (entry / cache.CUBIN).rename(elsewhere)
    (entry / cache.CUBIN).symlink_to(elsewhere)
    with pytest.raises(cache.UnsafeCacheError, match="symbolic link"):
        cache.try_load(entry)


def test_fallback_is_created_private_and_verified(cache_dir, tmp_path, monkeypatch):
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    cache_dir.write_text("a file in the way")  # the root cannot be used
    fallback = tmp_path / "fallback"
    monkeypatch.setattr(cache, "fallback_root", lambda: fallback)
    monkeypatch.setattr(cache, "_warned_roots", set())
    fallback.mkdir(mode=0o755)  # planted ahead, readable by others
    fallback.chmod(0o755)
    with pytest.warns(cache.CacheWarning), pytest.raises(cache.UnsafeCacheError, match="go-rwx"):
        cache.get_or_build(PROBE, Plan)
    fallback.rmdir()
    monkeypatch.setattr(cache, "_build_locked", lambda src, plan, uri, entry, lock: entry)
    entry = cache.get_or_build(PROBE, Plan)
    assert entry.is_relative_to(fallback)
    assert stat.S_IMODE(fallback.stat().st_mode) == 0o700


_HOLD = """
import sys, time
from filelock import FileLock
lock = FileLock(sys.argv[1]); lock.acquire(); print("held", flush=True); time.sleep(60)
"""


def test_lock_held_elsewhere_times_out_with_a_clear_error(cache_dir, monkeypatch):
    uri = cache.cache_key(PROBE, Plan)
    entry = cache.entry_dir(uri, Plan)
    cache._prepare(entry)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(entry.parent / f"{entry.name}.lock")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(cache, "LOCK_TIMEOUT_S", 0.3)
        t0 = time.monotonic()
        with pytest.raises(cache.CacheLockTimeout, match="LOCK_TIMEOUT_S"):
            cache.get_or_build(PROBE, Plan)
        assert time.monotonic() - t0 < 30
    finally:
        holder.kill()
        holder.wait()


def test_prune_removes_other_versions_and_broken_entries(cache_dir):
    entry = _planted_entry(cache_dir)
    old = cache_dir / "0.0.1" / "sm_80" / ("a" * 64)
    old.mkdir(parents=True)
    (old / cache.CUBIN).write_bytes(b"x" * 100)
    broken = entry.parent / ("b" * 64)
    broken.mkdir()
    rows = cache.usage(cache_dir)
    assert {(r["version"], r["entries"]) for r in rows} == {("0.0.1", 1), (cache.__version__, 2)}
    removed = cache.prune(cache_dir)
    assert removed["entries"] == 2 and removed["bytes"] >= 100
    assert not old.exists() and not broken.exists() and entry.exists()
    os.utime(entry / cache.META, (0, 0))
    cache.prune(cache_dir, older_than_days=1)
    assert not entry.exists()


# ----------------------------------------------------------------------------- item 5 (nvcc)
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_nvcc_timeout_kills_its_children(tmp_path, monkeypatch):
    pidfile = tmp_path / "child.pid"
    fake = tmp_path / "nvcc"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo "Cuda compilation tools, release 13.0, V13.0.88";'
        " exit 0; fi\n"
        f"sleep 60 & echo $! > {pidfile}\nwait\n"
    )  # fmt: skip
    fake.chmod(0o755)
    monkeypatch.setenv("FLASHGEN_NVCC", str(fake))
    monkeypatch.setattr(fcompile, "NVCC_TIMEOUT_S", 1)
    with pytest.raises(fcompile.CompileError, match="timed out"):
        fcompile.compile_source(PROBE, Plan, tmp_path / "out.cubin")
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(child)
    if alive:
        os.kill(child, 9)
    assert not alive, "nvcc's child (cicc) kept running after the timeout"
