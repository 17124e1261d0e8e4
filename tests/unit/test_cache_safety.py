"""Kernel cache safety: concurrent processes, corrupt entries, unwritable dirs, the key.

* 8 ``spawn`` processes building the same spec at once run nvcc once (counted by a
  ``FLASHGEN_NVCC`` wrapper script that logs every compile) and all get a verified entry.
* A truncated, bit-flipped or mismatched entry fails its checksum and is rebuilt.
* An unwritable cache directory falls back to a temporary one, with a warning.
* The key changes with the toolkit version, the target and every nvcc flag.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from flashgen.build import cache
from flashgen.build import compile as fcompile
from flashgen.build.compile import find_nvcc

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "specs" / "gpt2_d64.yaml"
PROBE = 'extern "C" __global__ void fg_safety_probe(float* x) { x[threadIdx.x] *= %s; }\n'


def probe_plan(name: str = "fg_safety_probe", target: str = "sm_80"):
    arch = {"sm_80": "sm_80", "sm_90": "sm_90a"}[target]
    gencode = {
        "sm_80": "-gencode=arch=compute_80,code=sm_80",
        "sm_90": "-gencode=arch=compute_90a,code=sm_90a",
    }[target]
    return SimpleNamespace(target=target, arch=arch, kernel_name=name, gencode=gencode)


@pytest.fixture
def nvcc_log(tmp_path, monkeypatch, requires_nvcc):
    """FLASHGEN_NVCC -> a wrapper that appends one line per compile to a log, then runs nvcc."""
    real = find_nvcc()
    log = tmp_path / "nvcc.log"
    wrapper = tmp_path / "nvcc-wrapper.sh"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'case " $* " in *" -cubin "*|*" -fatbin "*) echo "$$ $*" >> "{log}";; esac\n'
        f'exec "{real}" "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC | stat.S_IXGRP | stat.S_IXOTH)
    monkeypatch.setenv("FLASHGEN_NVCC", str(wrapper))
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    return log


def _compiles(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def _build_spec_worker(spec_path: str, barrier, queue) -> None:
    """Child process: wait for all, then build the spec's sm_80 kernel through the cache."""
    from plan_helpers import plan_forward

    from flashgen.build import cache as c
    from flashgen.build.render import render
    from flashgen.frontend.spec import load_spec

    try:
        plan = plan_forward(load_spec(spec_path), "sm_80")
        src = render(plan)
        barrier.wait(timeout=120)
        path, report = c.get_or_build(src, plan)
        loaded = c.try_load(path.parent)
        queue.put(("ok", str(path), report.from_cache, loaded is not None))
    except BaseException as e:  # report everything to the parent
        queue.put(("error", f"{type(e).__name__}: {e}", None, None))


def test_eight_spawned_processes_compile_once(nvcc_log):
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(8), ctx.Queue()
    procs = [
        ctx.Process(target=_build_spec_worker, args=(str(SPEC), barrier, queue)) for _ in range(8)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(r[0] == "ok" for r in results), results
    assert all(p.exitcode == 0 for p in procs)
    assert _compiles(nvcc_log) == 1, nvcc_log.read_text()
    assert len({r[1] for r in results}) == 1, "every process must get the same entry"
    assert sum(not r[2] for r in results) == 1, "exactly one process built it"
    assert all(r[3] for r in results), "every process must be able to load the entry"


@pytest.mark.parametrize(
    "damage", ["truncate_cubin", "empty_cubin", "flip_byte", "truncate_meta", "swap_entry"]
)
def test_corrupt_entry_detected_and_rebuilt(nvcc_log, damage):
    src = PROBE % "3.0f"
    path, rep = cache.get_or_build(src, probe_plan())
    assert not rep.from_cache and _compiles(nvcc_log) == 1
    good, meta = path.read_bytes(), path.parent / "meta.json"
    if damage == "truncate_cubin":
        path.write_bytes(good[: len(good) // 3])
    elif damage == "empty_cubin":
        path.write_bytes(b"")
    elif damage == "flip_byte":
        mid = len(good) // 2
        path.write_bytes(good[:mid] + bytes([good[mid] ^ 0x01]) + good[mid + 1 :])
    elif damage == "truncate_meta":
        meta.write_text(meta.read_text()[:40])
    else:  # a complete, self-consistent entry of another kernel copied under this key
        other, _ = cache.get_or_build(PROBE % "7.0f", probe_plan())
        shutil.rmtree(path.parent)
        shutil.copytree(other.parent, path.parent)
        assert json.loads(meta.read_text())["uri"] != path.parent.name
    before = _compiles(nvcc_log)
    assert cache.try_load(path.parent) is None, "damage must be detected"
    path2, rep2 = cache.get_or_build(src, probe_plan())
    assert not rep2.from_cache and _compiles(nvcc_log) == before + 1
    # (cubins are not byte-reproducible: line info records the temp dir and file mtime)
    assert path2 == path and cache.try_load(path.parent) is not None
    assert path2.read_bytes()[:4] == good[:4] == b"\x7fELF"
    _, rep3 = cache.get_or_build(src, probe_plan())
    assert rep3.from_cache and _compiles(nvcc_log) == before + 1


def _make_unwritable(root: Path, how: str) -> Path:
    if how == "file_in_the_way":  # works as root too
        root.parent.mkdir(parents=True, exist_ok=True)
        root.write_text("not a directory")
        return root / "cache"
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    root.mkdir(parents=True)
    root.chmod(0o555)
    return root


@pytest.mark.parametrize("how", ["read_only_dir", "file_in_the_way"])
def test_unwritable_cache_falls_back_to_temp_dir(nvcc_log, tmp_path, monkeypatch, how):
    cache_dir = _make_unwritable(tmp_path / "ro", how)
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(cache_dir))
    monkeypatch.setattr(cache, "fallback_root", lambda: tmp_path / "fallback")
    monkeypatch.setattr(cache, "_warned_roots", set())
    src = PROBE % "5.0f"
    try:
        with pytest.warns(RuntimeWarning, match="not writable.*building in"):
            path, rep = cache.get_or_build(src, probe_plan())
        assert not rep.from_cache
        assert path.is_relative_to(tmp_path / "fallback") and path.is_file()
        # second call: served from the fallback, no new compile, no second warning
        path2, rep2 = cache.get_or_build(src, probe_plan())
        assert path2 == path and rep2.from_cache and _compiles(nvcc_log) == 1
    finally:
        if how == "read_only_dir":
            cache_dir.chmod(0o755)


def test_read_only_cache_still_serves_existing_entries(nvcc_log, tmp_path, monkeypatch):
    src = PROBE % "6.0f"
    path, _ = cache.get_or_build(src, probe_plan())
    monkeypatch.setattr(cache, "_prepare", _fail_prepare)  # any write attempt would fail
    path2, rep = cache.get_or_build(src, probe_plan())
    assert path2 == path and rep.from_cache


def _fail_prepare(entry):
    raise AssertionError(f"a cache hit must not write ({entry})")


def test_bad_kernel_name_cannot_escape_the_cache(nvcc_log):
    with pytest.raises(ValueError, match="not a C identifier"):
        cache.get_or_build(PROBE % "1.0f", probe_plan(name="../../evil"))


def test_key_covers_toolkit_target_and_flags(requires_nvcc, monkeypatch):
    src = PROBE % "2.0f"
    base = cache.cache_key(src, probe_plan())
    assert cache.cache_key(src, probe_plan()) == base  # deterministic
    # target
    assert cache.cache_key(src, probe_plan(target="sm_90")) != base
    # toolkit version
    monkeypatch.setattr(cache, "nvcc_version", lambda: "99.9.999")
    assert cache.cache_key(src, probe_plan()) != base
    monkeypatch.undo()
    # every flag: dropping or changing any one of them changes the key
    flags = fcompile.NVCC_FLAGS
    for i in range(len(flags)):
        monkeypatch.setattr(fcompile, "NVCC_FLAGS", flags[:i] + flags[i + 1 :])
        assert cache.cache_key(src, probe_plan()) != base, f"dropping {flags[i]!r}"
    monkeypatch.setattr(fcompile, "NVCC_FLAGS", (*flags, "--use_fast_math"))
    assert cache.cache_key(src, probe_plan()) != base
    monkeypatch.undo()
    # the gencode and the kernel name
    p = probe_plan()
    p.gencode = "-gencode=arch=compute_86,code=sm_86"
    assert cache.cache_key(src, p) != base
    assert cache.cache_key(src, probe_plan(name="fg_other")) != base
    assert cache.cache_key(src, probe_plan()) == base


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
