"""Which compiler builds the kernels (:func:`flashgen.build.compile.find_compiler`): nvcc from
FLASHGEN_NVCC, PATH, CUDA_HOME, the ``nvidia-cuda-nvcc`` wheel under site-packages/nvidia, the
default toolkit; NVRTC (through ctypes) when there is no nvcc; a clear error naming what to
install when neither is there.  The compiler is part of the kernel cache key."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from flashgen import env
from flashgen.build import cache
from flashgen.build import compile as fcompile
from flashgen.build.compile import (
    NVRTC_SHIM,
    CompileError,
    NvccNotFoundError,
    compile_source,
    find_compiler,
    find_nvcc,
    find_nvrtc,
    parse_ptxas,
)

REPO = Path(__file__).resolve().parents[2]
PROBE = 'extern "C" __global__ void fg_search_probe(float* x) { x[threadIdx.x] *= 2.0f; }\n'


def _script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture
def bare(monkeypatch, tmp_path):
    """No FLASHGEN_NVCC, an empty PATH, no CUDA_HOME / CUDA_PATH (all through flashgen.env, the
    one reader of the environment), no default toolkit: only what a test adds."""
    monkeypatch.delenv(env.NVCC, raising=False)
    real = env.foreign
    monkeypatch.setattr(
        env, "foreign", lambda name: "" if name == "PATH" else None if name != "COLUMNS"
        else real(name)
    )  # fmt: skip
    monkeypatch.setattr(fcompile, "DEFAULT_CUDA_HOME", str(tmp_path / "no-toolkit"))
    return tmp_path


def _wheel(monkeypatch, site: Path) -> Path:
    """``site`` on sys.path: its ``nvidia/`` joins the namespace package's search path."""
    monkeypatch.syspath_prepend(str(site))
    return site / "nvidia"


def test_nvcc_from_the_wheel_when_path_has_none(bare, monkeypatch):
    nvidia = _wheel(monkeypatch, bare / "site")
    nvcc = _script(nvidia / "cu13" / "bin" / "nvcc", "echo 'release 13.0, V13.0.88'\n")
    assert nvidia in fcompile.nvidia_wheel_roots()
    assert find_nvcc() == str(nvcc)
    assert fcompile.wheel_tool("nvcc") == str(nvcc)
    comp = find_compiler()
    assert (comp.kind, comp.path, comp.key) == ("nvcc", str(nvcc), "13.0.88")
    # CUDA 12's layout: one folder per component
    (nvidia / "cu13" / "bin" / "nvcc").unlink()
    cu12 = _script(nvidia / "cuda_nvcc" / "bin" / "nvcc", "echo 'release 12.8, V12.8.93'\n")
    assert find_nvcc() == str(cu12)
    # PATH still comes first
    on_path = _script(bare / "path" / "nvcc", "echo 'release 13.0, V13.0.1'\n")
    path_dir = str(on_path.parent)
    monkeypatch.setattr(env, "foreign", lambda name: path_dir if name == "PATH" else None)
    assert find_nvcc() == str(on_path)


def test_a_wheel_layout_nvcc_compiles(bare, monkeypatch, tmp_path):
    """A real toolkit laid out as the wheels lay it (``nvidia/cu13/{bin,nvvm,include,lib}``)
    and found there with PATH empty builds a unit, and the command names that nvcc."""
    homes = [Path(p) for p in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if p]
    home = next((h for h in homes if (h / "nvvm" / "bin" / "cicc").is_file()), None)
    if home is None:
        pytest.skip("no CUDA toolkit with nvvm/bin/cicc to lay out as a wheel")
    cu13 = _wheel(monkeypatch, tmp_path / "site") / "cu13"
    cu13.mkdir(parents=True)
    for d in ("bin", "nvvm", "include", "lib"):
        (cu13 / d).symlink_to((home / d).resolve())
    plan = SimpleNamespace(target="sm_80", arch="sm_80", kernel_name="fg_search_probe",
                           gencode="-gencode=arch=compute_80,code=sm_80")  # fmt: skip
    report = compile_source(PROBE, plan, tmp_path / "probe.cubin")
    assert report.command[0] == str(cu13 / "bin" / "nvcc")
    assert report.kernel("fg_search_probe").registers > 0


def test_no_compiler_names_what_to_install(bare, monkeypatch):
    monkeypatch.setattr(fcompile, "nvidia_wheel_roots", lambda: [])
    monkeypatch.setattr(fcompile, "_nvrtc_candidates", lambda: [])
    with pytest.raises(NvccNotFoundError) as ei:
        find_compiler()
    msg = str(ei.value)
    assert "pip install flashgen[gpu]" in msg and "nvidia-cuda-nvcc" in msg
    assert "nvidia-cuda-nvrtc" in msg
    plan = SimpleNamespace(target="sm_80", arch="sm_80", kernel_name="k", gencode="")
    with pytest.raises(NvccNotFoundError):
        compile_source(PROBE, plan, bare / "x.cubin")


def test_a_named_nvcc_that_is_missing_is_not_replaced_by_nvrtc(bare, monkeypatch):
    monkeypatch.setenv(env.NVCC, "/nonexistent/nvcc")
    with pytest.raises(NvccNotFoundError, match="FLASHGEN_NVCC"):
        find_compiler()


def test_nvrtc_without_headers_names_them(bare, monkeypatch):
    monkeypatch.setattr(fcompile, "find_nvrtc", lambda: ("/x/lib/libnvrtc.so.13", "13.0"))
    monkeypatch.setattr(fcompile, "nvidia_wheel_roots", lambda: [])
    with pytest.raises(NvccNotFoundError, match="cuda_fp16.h.*pip install nvidia-cuda-runtime"):
        find_compiler()


def test_the_compiler_is_part_of_the_cache_key(monkeypatch):
    plan = SimpleNamespace(target="sm_80", arch="sm_80", kernel_name="k",
                           gencode="-gencode=arch=compute_80,code=[sm_80,compute_80]")  # fmt: skip
    nvcc = fcompile.Compiler("nvcc", "/x/nvcc", "13.0.88")
    monkeypatch.setattr(fcompile, "find_compiler", lambda: nvcc)
    monkeypatch.setattr(cache, "nvcc_version", lambda: "13.0.88")
    keys = {cache.cache_key(PROBE, plan)}
    for comp in (
        fcompile.Compiler("nvrtc", "/x/libnvrtc.so.13", "13.0", str(REPO)),
        fcompile.Compiler("nvrtc", "/x/libnvrtc.so.13", "13.0", str(REPO), fatbin=True),
        fcompile.Compiler("nvrtc", "/x/libnvrtc.so.13", "13.1", str(REPO)),
    ):
        monkeypatch.setattr(fcompile, "_headers_digest", lambda include: "abc")
        monkeypatch.setattr(fcompile, "find_compiler", lambda comp=comp: comp)
        keys.add(cache.cache_key(PROBE, plan))
    assert len(keys) == 4


def test_nvrtc_shim_covers_what_the_templates_take_from_c_headers():
    """The names the templates use from <stdint.h> / <math.h> (and <limits.h> through them)
    are all defined by the shim NVRTC compiles with."""
    import re

    used = set()
    for path in (REPO / "templates").rglob("*"):
        if path.is_file():
            used |= set(re.findall(r"\b(INFINITY|NAN|U?INT(?:8|16|32|64)?_(?:MAX|MIN))\b",
                                   path.read_text()))  # fmt: skip
    used |= set(re.findall(r"\b(u?int(?:8|16|32|64)_t)\b", "".join(
        p.read_text() for p in (REPO / "templates").rglob("*") if p.is_file())))  # fmt: skip
    assert used, "the scan found nothing"
    missing = [n for n in sorted(used) if not re.search(rf"\b{n}\b", NVRTC_SHIM)]
    assert not missing, missing


@pytest.fixture
def nvrtc_only(bare, monkeypatch):
    """NVRTC as the compiler (no nvcc), skipped where no libnvrtc loads."""
    found = find_nvrtc()
    if found is None:
        pytest.skip("no NVRTC (pip install nvidia-cuda-nvrtc)")
    # the CUDA headers: the nvidia-cuda-runtime wheel's if installed, else a toolkit's
    homes = [Path(p) for p in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if p]
    toolkit = tuple(str(h / "include") for h in homes if (h / "include" / "cuda_fp16.h").is_file())
    search = fcompile.find_cuda_include
    monkeypatch.setattr(fcompile, "find_cuda_include", lambda extra=(): search(extra + toolkit))
    comp = find_compiler()
    if comp.kind != "nvrtc":
        pytest.skip(f"nvcc found at {comp.path} despite the bare environment")
    monkeypatch.setenv(env.CACHE_DIR, str(bare / "cache"))
    return comp


def test_nvrtc_compiles_a_real_unit_for_sm_80(nvrtc_only, tmp_path):
    """The forward of a shipped spec for sm_80 through NVRTC: ptxas' report (registers, no
    spills), the cubin (with the unit's compute_80 PTX in a fatbin where libnvfatbin is
    installed), and the cache keeps it apart from nvcc builds."""
    from flashgen.build.render import render
    from flashgen.families.registry import compile_units
    from flashgen.frontend.spec import load_spec

    plan = compile_units(load_spec(REPO / "specs" / "gpt2_d64.yaml"), "sm_80")["fwd"]
    path, report = cache.get_or_build(render(plan), plan)
    assert report.nvcc_version == nvrtc_only.key and report.nvcc_version.startswith("nvrtc ")
    assert report.command[:2] == ("nvrtc", "--gpu-architecture=sm_80")
    k = report.kernel(plan.kernel_name)
    assert 0 < k.registers <= 255 and k.spill_bytes == 0, report.log
    data = path.read_bytes()
    if nvrtc_only.fatbin:
        assert data[:4] == bytes.fromhex("50ed55ba"), "a fatbin"
        cuobjdump = fcompile.wheel_tool("cuobjdump")
        if cuobjdump:
            import subprocess

            listing = subprocess.run([cuobjdump, "--list-elf", "--list-ptx", str(path)],
                                     capture_output=True, text=True, check=True).stdout
            assert "sm_80.cubin" in listing and "sm_80.ptx" in listing, listing
    else:
        assert data[:4] == b"\x7fELF" and "no PTX embedded" in report.log


def test_nvrtc_errors_carry_the_log(nvrtc_only, tmp_path):
    plan = SimpleNamespace(target="sm_80", arch="sm_80", kernel_name="broken",
                           gencode="-gencode=arch=compute_80,code=sm_80")  # fmt: skip
    with pytest.raises(CompileError) as ei:
        compile_source('extern "C" __global__ void broken() { undeclared_thing(); }', plan,
                       tmp_path / "x.cubin")  # fmt: skip
    assert "undeclared_thing" in ei.value.output and "broken" in str(ei.value)
    assert not (tmp_path / "x.cubin").exists()
    assert parse_ptxas(ei.value.output) == ()
