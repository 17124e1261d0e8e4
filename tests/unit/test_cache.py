"""The on-disk kernel cache: hits, corrupt entries, concurrent builders."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from flashgen import __version__
from flashgen.build import cache

REPO = Path(__file__).resolve().parents[2]
SOURCE = 'extern "C" __global__ void fg_cache_probe(float* x) { x[threadIdx.x] *= %s; }\n'


def plan(name: str = "fg_cache_probe"):
    return SimpleNamespace(
        target="sm_80",
        arch="sm_80",
        kernel_name=name,
        gencode="-gencode=arch=compute_80,code=sm_80",
    )


@pytest.fixture
def cache_dir(tmp_path, monkeypatch, requires_nvcc):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_layout_and_second_get_is_a_hit(cache_dir):
    src = SOURCE % "2.0f"
    before = cache.builds
    path, rep = cache.get_or_build(src, plan())
    assert not rep.from_cache and rep.seconds > 0
    assert path == cache_dir / __version__ / "sm_80" / cache.cache_key(src, plan()) / "kernel.cubin"
    meta = json.loads((path.parent / "meta.json").read_text())
    assert meta["kernel_name"] == "fg_cache_probe" and len(meta["cubin_sha256"]) == 64
    path2, rep2 = cache.get_or_build(src, plan())
    assert path2 == path and rep2.from_cache
    assert rep2.kernels == rep.kernels
    assert cache.builds == before + 1


def test_key_depends_on_source_and_target(requires_nvcc):
    p80, p90 = (
        plan(),
        SimpleNamespace(
            **{
                **vars(plan()),
                "arch": "sm_90a",
                "target": "sm_90",
                "gencode": "-gencode=arch=compute_90a,code=sm_90a",
            }
        ),
    )
    a, b = SOURCE % "2.0f", SOURCE % "3.0f"
    assert cache.cache_key(a, p80) != cache.cache_key(b, p80)
    assert cache.cache_key(a, p80) != cache.cache_key(a, p90)
    assert cache.cache_key(a, p80) == cache.cache_key(a, plan())


@pytest.mark.parametrize("damage", ["truncate_cubin", "flip_cubin", "garble_meta", "drop_meta"])
def test_corrupt_entry_is_rebuilt(cache_dir, damage):
    src = SOURCE % "4.0f"
    path, _ = cache.get_or_build(src, plan())
    good = path.read_bytes()
    meta = path.parent / "meta.json"
    if damage == "truncate_cubin":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "flip_cubin":
        path.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    elif damage == "garble_meta":
        meta.write_text("{not json")
    else:
        meta.unlink()
    assert cache.try_load(path.parent) is None
    before = cache.builds
    path2, rep = cache.get_or_build(src, plan())
    assert cache.builds == before + 1 and not rep.from_cache
    assert cache.try_load(path2.parent) is not None


def test_concurrent_threads_compile_once(cache_dir):
    src = SOURCE % "5.0f"
    start = threading.Barrier(6)
    results = []

    def worker():
        start.wait()
        results.append(cache.get_or_build(src, plan()))

    before = cache.builds
    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.builds == before + 1
    assert len({str(p) for p, _ in results}) == 1
    assert sum(not r.from_cache for _, r in results) == 1


def test_concurrent_processes_compile_once(cache_dir):
    script = (
        "import sys, time\n"
        "from types import SimpleNamespace\n"
        "from flashgen.build import cache\n"
        "p = SimpleNamespace(target='sm_80', arch='sm_80', kernel_name='fg_cache_probe',\n"
        "                    gencode='-gencode=arch=compute_80,code=sm_80')\n"
        "while time.time() < float(sys.argv[1]): time.sleep(0.005)\n"
        f"path, rep = cache.get_or_build({SOURCE % '6.0f'!r}, p)\n"
        "print('BUILT' if not rep.from_cache else 'HIT', path)\n"
    )
    import time

    go = str(time.time() + 2.0)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, go],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    lines = [o.strip() for o, _ in outs]
    assert sum(line.startswith("BUILT") for line in lines) == 1, lines
    assert len({line.split()[1] for line in lines}) == 1
