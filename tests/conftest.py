"""Shared test setup.

* ``gpu`` marker: tests that need a CUDA device; skipped where ``torch.cuda.is_available()``
  is false (``python -m pytest -m gpu`` selects only them).
* Every test session compiles into its own temporary ``FLASHGEN_CACHE_DIR``.
* ``error_bound`` fixture: the accuracy bound used against the float64 reference.
* ``host_exe`` fixture: a host program built with nvcc from the kernels' headers (once per
  source and process).
* ``cxx_exe`` fixture: a host program built with the system C++ compiler (lowered
  expressions evaluated on the CPU).
* GPU tests give their cached device memory back when they end, so the xdist workers sharing
  the GPU leave room for the memory-hungry tests; ``@pytest.mark.device_memory(gib)``: the
  test runs inside :func:`gpu_memory.exclusive` (``tests/gpu/gpu_memory.py``: alone among the
  marked tests, once ``gib`` GiB are free).

Test modules import helpers by module name (``plan_helpers``, ``gpu_memory``), never from
``conftest``: which of the ``conftest`` modules that name finds depends on the order a worker
collected them in.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SPEC_DIR = REPO / "specs"
SPEC_PATHS = sorted(SPEC_DIR.glob("*.yaml"))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption(
        "--full-product", action="store_true",
        help="nvcc sweeps build their parameters' full product, not a pairwise covering "
        "(tests/covering.py)",
    )  # fmt: skip


def pytest_configure(config):
    _share_cores_among_workers()
    import covering

    covering.FULL_PRODUCT = config.getoption("--full-product")
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped where none is present)")
    config.addinivalue_line(
        "markers",
        "device_memory(gib): a GPU test that runs alone among the marked ones, once gib GiB "
        "of device memory are free (tests/gpu/gpu_memory.py)",
    )
    # the CLI's tables follow COLUMNS (pytest-xdist's workers get 80): tests that check the
    # width set it themselves
    os.environ.pop("COLUMNS", None)


def _share_cores_among_workers() -> None:
    """Each pytest-xdist worker takes its share of the cores for torch's intra-op threads
    (and OMP_NUM_THREADS for the processes it spawns): with torch's default of one thread per
    core in every worker, the workers' thread pools oversubscribe the cores, and on 2 cores the
    many small CPU-op matmuls of the tests waited on each other for half the suite's CPU time."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not os.environ.get("PYTEST_XDIST_WORKER") or workers < 1:
        return
    share = max(1, (os.cpu_count() or 1) // workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(share))
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(share)


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _device_memory(request):
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    marker = request.node.get_closest_marker("device_memory")
    if marker is None:
        hold = contextlib.nullcontext()
    else:
        import gpu_memory  # tests/gpu, on sys.path once a test there is collected

        hold = gpu_memory.exclusive(*marker.args)
    with hold:
        yield
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture(scope="session", autouse=True)
def _session_cache_dir(tmp_path_factory):
    """Point the kernel cache at a fresh directory for the whole run: one directory all
    pytest-xdist workers share (the cache locks each entry), so a unit that tests in two
    workers build compiles once."""
    old = os.environ.get("FLASHGEN_CACHE_DIR")
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' common folder
        base = base.parent
    cache = base / "flashgen-cache"
    cache.mkdir(exist_ok=True)
    os.environ["FLASHGEN_CACHE_DIR"] = str(cache)
    yield
    if old is None:
        os.environ.pop("FLASHGEN_CACHE_DIR", None)
    else:
        os.environ["FLASHGEN_CACHE_DIR"] = old


#: host programs built by :func:`host_exe` in this process, by (source, optimization flag)
_HOST_EXES: dict[tuple[str, str], Path] = {}


@pytest.fixture
def host_exe(tmp_path, requires_nvcc):
    """``build(source, name="prog", opt="-O1")``: compile CUDA C++ ``source`` into a host
    executable with nvcc (the kernels' headers, ``__host__ __device__`` code run on the CPU)
    and return its path; the test fails with nvcc's output if it does not build.  A source
    built before in this process (with the same ``opt``) returns that build's executable (an
    nvcc host build takes 2 to 4 CPU-seconds)."""
    import subprocess

    from flashgen.build.compile import find_nvcc

    def build(source: str, name: str = "prog", opt: str = "-O1") -> Path:
        done_before = _HOST_EXES.get((source, opt))
        if done_before is not None and done_before.is_file():
            return done_before
        src, exe = tmp_path / f"{name}.cu", tmp_path / name
        src.write_text(source)
        cmd = [find_nvcc(), "-std=c++17", opt, "-x", "cu", str(src), "-o", str(exe)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode:
            pytest.fail(f"nvcc failed:\n{done.stdout}{done.stderr}")
        _HOST_EXES[(source, opt)] = exe
        return exe

    return build


@pytest.fixture(scope="session")
def cxx_exe(tmp_path_factory):
    """``build(source, name="prog", opt="-O1")``: compile plain C++17 ``source`` with g++ (or
    c++) into a host executable and return its path (``opt``: flags, space-separated, e.g.
    ``"-O2 -mfma -ffp-contract=fast"``); skips where there is no host C++ compiler, fails with
    the compiler's output if it does not build."""
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("c++")

    def build(source: str, name: str = "prog", opt: str = "-O1") -> Path:
        if cxx is None:
            pytest.skip("needs a host C++ compiler")
        where = tmp_path_factory.mktemp(name)
        src, exe = where / f"{name}.cpp", where / name
        src.write_text(source)
        cmd = [cxx, "-std=c++17", *opt.split(), "-o", str(exe), str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode:
            pytest.fail(f"{cxx} failed:\n{done.stdout}{done.stderr}\n{source}")
        return exe

    return build


@pytest.fixture
def requires_nvcc():
    """Skip unless nvcc is available (it is on the project's CI machines)."""
    from flashgen.build.compile import NvccNotFoundError, find_nvcc

    try:
        find_nvcc()
    except NvccNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture
def error_bound():
    """``error_bound(spec, q, k, v, params) -> (ref_o fp64, ref_lse, bound)``.

    ``bound`` = 2 * max|reference in the input dtype - fp64 reference| + 1e-3: what plain
    PyTorch low-precision attention achieves, with a factor 2 of slack.
    """
    from flashgen.bench.verify import error_bound as bound

    return bound
