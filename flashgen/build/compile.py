"""Compile rendered CUDA source to a cubin with ``nvcc`` and read ptxas' resource report.

One code path for offline builds (``flashgen build``, CI) and JIT builds on the GPU
machine.  No torch, no cupy.  The exact command is::

    nvcc <-cubin|-fatbin> -std=c++17 -O3 <plan.gencode> -Xptxas -v -lineinfo -o OUT SRC.cu

``-fatbin`` where the gencode embeds PTX besides the SASS (sm_80:
``code=[sm_80,compute_80]``, so the FA2-class units JIT on newer GPUs; nvcc refuses
``-cubin`` for two code instances), ``-cubin`` otherwise (sm_90a).  The file is called
``kernel.cubin`` either way; the driver loads both kinds.  There is no ``--use_fast_math``:
arithmetic stays IEEE except where the kernel asks for an intrinsic itself (``exp2f`` etc.).
:data:`NVCC_FLAGS`, the gencode and the toolkit version all go into the cache key
(:mod:`flashgen.build.cache`).

The nvcc binary is the one :data:`flashgen.env.NVCC` names if set, else ``nvcc`` on ``PATH``, else
``$CUDA_HOME/bin/nvcc`` (``/usr/local/cuda`` by default).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

#: Flags every build uses besides the output kind (:func:`output_flag`) and the target's
#: ``-gencode`` (part of the cache key).
NVCC_FLAGS: tuple[str, ...] = ("-std=c++17", "-O3", "-Xptxas", "-v", "-lineinfo")
#: Seconds one nvcc run may take before it is killed.
NVCC_TIMEOUT_S = 900


class CompileError(RuntimeError):
    """nvcc failed (or is missing).  ``output`` holds nvcc's combined stdout/stderr."""

    def __init__(self, message: str, output: str = "", command: list[str] | None = None):
        self.output = output
        self.command = list(command or [])
        super().__init__(f"{message}\n{output}".rstrip())


class NvccNotFoundError(CompileError):
    """No nvcc binary could be found (see the module docstring for the search order)."""


@dataclass(frozen=True)
class KernelResources:
    """ptxas' report for one ``__global__`` function (all sizes in bytes)."""

    name: str
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    smem: int = 0  # static shared memory; the dynamic part is plan.smem_bytes
    stack_frame: int = 0
    barriers: int = 0
    #: ptxas' reason when it serialized the kernel's wgmma instructions (each one waited for
    #: before the next: C7510-C7520 "Potential Performance Loss"), "" when it did not
    wgmma_serialized: str = ""

    @property
    def spill_bytes(self) -> int:
        return self.spill_stores + self.spill_loads


@dataclass(frozen=True)
class CompileReport:
    """Outcome of one successful nvcc run.

    ``kernels`` has one entry per entry function ptxas reported; ``seconds`` is the
    wall time of the nvcc run (0 and ``from_cache=True`` when the cache served it);
    ``log`` is nvcc's full output.
    """

    target: str
    arch: str
    kernels: tuple[KernelResources, ...]
    seconds: float
    nvcc_version: str
    command: tuple[str, ...] = ()
    log: str = field(default="", repr=False)
    from_cache: bool = False

    def kernel(self, name: str) -> KernelResources:
        """Resources of kernel ``name``; ``KeyError`` if ptxas did not report it."""
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(name)

    @property
    def registers(self) -> int:
        return max((k.registers for k in self.kernels), default=0)

    @property
    def spill_stores(self) -> int:
        return sum(k.spill_stores for k in self.kernels)

    @property
    def spill_loads(self) -> int:
        return sum(k.spill_loads for k in self.kernels)

    @property
    def spill_bytes(self) -> int:
        return self.spill_stores + self.spill_loads

    @property
    def wgmma_serialized(self) -> tuple[str, ...]:
        """Names of the kernels whose wgmma instructions ptxas serialized (a performance
        defect like a spill: each wgmma waits for the previous one)."""
        return tuple(k.name for k in self.kernels if k.wgmma_serialized)

    @property
    def smem(self) -> int:
        return max((k.smem for k in self.kernels), default=0)

    @property
    def stack_frame(self) -> int:
        return max((k.stack_frame for k in self.kernels), default=0)

    def to_dict(self) -> dict:
        """JSON-able form (round-trips through :meth:`from_dict`)."""
        d = asdict(self)
        d["kernels"] = [asdict(k) for k in self.kernels]
        d["command"] = list(self.command)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CompileReport:
        """Inverse of :meth:`to_dict`; ``KeyError``/``TypeError`` on malformed input."""
        log = d.get("log", "")
        # reports cached before the field existed: ptxas' lines are in the log
        serialized = {m.group(2): m.group(1) for m in _SERIALIZED.finditer(log)}
        kernels = tuple(
            KernelResources(**{"wgmma_serialized": serialized.get(k["name"], ""), **k})
            for k in d["kernels"]
        )
        return cls(
            target=d["target"],
            arch=d["arch"],
            kernels=kernels,
            seconds=float(d["seconds"]),
            nvcc_version=d["nvcc_version"],
            command=tuple(d.get("command", ())),
            log=log,
            from_cache=bool(d.get("from_cache", False)),
        )

    def resources(self) -> dict:
        """Compact summary for manifests and tables (no timing, no log)."""
        return {
            "registers": self.registers,
            "spill_stores": self.spill_stores,
            "spill_loads": self.spill_loads,
            "smem_static": self.smem,
            "stack_frame": self.stack_frame,
            "nvcc_version": self.nvcc_version,
        }


# ----------------------------------------------------------------------------- nvcc
def find_nvcc() -> str:
    """Path of the nvcc binary; raises :class:`NvccNotFoundError` if there is none."""
    from flashgen import env as _env

    env = _env.get(_env.NVCC)
    if env:
        if shutil.which(env):
            return shutil.which(env)  # type: ignore[return-value]
        raise NvccNotFoundError(f"{_env.NVCC}={env!r} is not an executable")
    found = shutil.which("nvcc")
    if found:
        return found
    cuda_home = _env.foreign("CUDA_HOME") or _env.foreign("CUDA_PATH") or "/usr/local/cuda"
    cand = Path(cuda_home) / "bin" / "nvcc"
    if cand.is_file() and os.access(cand, os.X_OK):
        return str(cand)
    raise NvccNotFoundError(
        "nvcc (the CUDA toolkit compiler) was not found: put it on PATH, or set "
        f"{_env.NVCC} or CUDA_HOME"
    )


@cache
def _nvcc_version(nvcc: str) -> str:
    try:
        out = subprocess.run(
            [nvcc, "--version"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise CompileError(f"could not run {nvcc} --version: {e}") from e
    m = re.search(r"V(\d+\.\d+\.\d+)", out) or re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]


def nvcc_version() -> str:
    """Toolkit version of the nvcc in use, e.g. ``"13.0.88"`` (cached per binary)."""
    return _nvcc_version(find_nvcc())


def embeds_ptx(gencode: str) -> bool:
    """Whether ``gencode`` asks for PTX besides SASS (``code=[sm_80,compute_80]``)."""
    return any("compute_" in m for m in re.findall(r",code=(\[[^\]]*\]|[^,\s]*)", gencode))


def output_flag(gencode: str) -> str:
    """nvcc's output kind for ``gencode``: ``-fatbin`` where it embeds PTX (nvcc refuses
    ``-cubin`` for two code instances), else ``-cubin``."""
    return "-fatbin" if embeds_ptx(gencode) else "-cubin"


def nvcc_command(plan, src: str | Path, out: str | Path, nvcc: str | None = None) -> list[str]:
    """The nvcc argv that compiles ``src`` to ``out`` for ``plan.target``."""
    return [
        nvcc or find_nvcc(),
        output_flag(plan.gencode),
        *NVCC_FLAGS[:2],
        plan.gencode,
        *NVCC_FLAGS[2:],
        "-o",
        str(out),
        str(src),
    ]


# ----------------------------------------------------------------------------- ptxas -v
_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SERIALIZED = re.compile(
    r"wgmma\.mma_async instructions are serialized due to (.+?) in the function '([^']+)'"
)


def parse_ptxas(log: str) -> tuple[KernelResources, ...]:
    """Per-kernel resources from ``ptxas -v`` output (entry functions only, in order)."""
    kernels: dict[str, dict] = {}
    current: str | None = None
    props_for: str | None = None
    for line in log.splitlines():
        if m := _SERIALIZED.search(line):  # printed before the function's entry line
            kernels.setdefault(m.group(2), {"name": m.group(2)})["wgmma_serialized"] = m.group(1)
            continue
        if m := _ENTRY.search(line):
            current = m.group(1)
            kernels.setdefault(current, {"name": current})
            props_for = None
            continue
        if m := _PROPS.search(line):
            props_for = m.group(1)
            continue
        if m := _FRAME.search(line):
            name = props_for or current
            if name in kernels:
                k = kernels[name]
                k["stack_frame"], k["spill_stores"], k["spill_loads"] = map(int, m.groups())
            continue
        if (m := _USED.search(line)) and current in kernels:
            k = kernels[current]
            k["registers"] = int(m.group(1))
            if s := _SMEM.search(line):
                k["smem"] = int(s.group(1))
            if b := _BARRIERS.search(line):
                k["barriers"] = int(b.group(1))
    return tuple(KernelResources(**k) for k in kernels.values())


# ----------------------------------------------------------------------------- compile
def run_group(cmd: list[str], timeout: float, cwd: str | None = None):
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a new session (process
    group), killing the whole group when ``timeout`` seconds pass: nvcc's children (cicc,
    ptxas) die with it instead of running on.  Also on KeyboardInterrupt.  Raises
    ``subprocess.TimeoutExpired`` (with the output so far) after the kill."""
    posix = os.name == "posix"
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        start_new_session=posix,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        try:
            if posix:
                os.killpg(proc.pid, signal.SIGKILL)
            else:  # pragma: no cover
                proc.kill()
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def compile_source(source: str, plan, out_path: str | Path) -> CompileReport:
    """Compile ``source`` (one translation unit) for ``plan.target`` into ``out_path``.

    ``plan`` is a :class:`~flashgen.codegen.plan.KernelPlan` (``gencode``, ``arch``, ``target``,
    ``kernel_name`` are read).  The source is written to a temporary directory as
    ``<kernel_name>.cu`` so diagnostics name the kernel.  ``ValueError`` if
    ``kernel_name`` is not a C identifier (it names a file).

    Raises :class:`NvccNotFoundError` without nvcc, :class:`CompileError` (with nvcc's
    output) when nvcc fails, times out, or reports no entry function.
    """
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(plan.kernel_name)):
        raise ValueError(f"kernel name {plan.kernel_name!r} is not a C identifier")
    nvcc = find_nvcc()
    version = _nvcc_version(nvcc)
    out_path = Path(out_path)
    with tempfile.TemporaryDirectory(prefix="flashgen-nvcc-") as tmp:
        src = Path(tmp) / f"{plan.kernel_name}.cu"
        src.write_text(source)
        cmd = nvcc_command(plan, src, out_path, nvcc)
        t0 = time.perf_counter()
        try:
            proc = run_group(cmd, timeout=NVCC_TIMEOUT_S, cwd=tmp)
        except subprocess.TimeoutExpired as e:
            raise CompileError(
                f"nvcc timed out after {NVCC_TIMEOUT_S} s (NVCC_TIMEOUT_S) compiling "
                f"{plan.kernel_name}; nvcc and its children (cicc, ptxas) were killed",
                str(e.stdout or "") + str(e.stderr or ""),
                cmd,
            ) from e
        seconds = time.perf_counter() - t0
    log = (proc.stdout or "") + (proc.stderr or "")
    if proc.returncode != 0:
        raise CompileError(
            f"nvcc failed (exit {proc.returncode}) compiling {plan.kernel_name} "
            f"for {plan.target}:\n  {' '.join(cmd)}",
            log,
            cmd,
        )
    kernels = parse_ptxas(log)
    if not any(k.name == plan.kernel_name for k in kernels):
        raise CompileError(
            f'ptxas reported no entry function {plan.kernel_name!r}; is it extern "C" __global__?',
            log,
            cmd,
        )
    return CompileReport(
        target=plan.target,
        arch=plan.arch,
        kernels=kernels,
        seconds=seconds,
        nvcc_version=version,
        command=tuple(cmd),
        log=log,
    )
