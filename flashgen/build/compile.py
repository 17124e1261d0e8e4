"""Compile rendered CUDA source to a cubin with ``nvcc`` (or NVRTC) and read ptxas' resource
report.

One code path for offline builds (``flashgen build``, CI) and JIT builds on the GPU
machine.  No torch, no cupy.  The exact command is::

    nvcc <-cubin|-fatbin> -std=c++17 -O3 <plan.gencode> -Xptxas -v -lineinfo -o OUT SRC.cu

``-fatbin`` where the gencode embeds PTX besides the SASS (sm_80:
``code=[sm_80,compute_80]``, so the FA2-class units JIT on newer GPUs; nvcc refuses
``-cubin`` for two code instances), ``-cubin`` otherwise (sm_90a).  The file is called
``kernel.cubin`` either way; the driver loads both kinds.  There is no ``--use_fast_math``:
arithmetic stays IEEE except where the kernel asks for an intrinsic itself (``exp2f`` etc.).
:data:`NVCC_FLAGS`, the gencode and the compiler (:attr:`Compiler.key`) all go into the
cache key (:mod:`flashgen.build.cache`).

Which compiler (:func:`find_compiler`): nvcc, searched as :func:`find_nvcc` says
(:data:`flashgen.env.NVCC`, ``PATH``, ``$CUDA_HOME`` / ``$CUDA_PATH``, the PyPI wheel
``nvidia-cuda-nvcc`` of the ``gpu`` extra, ``/usr/local/cuda``); without any nvcc, NVRTC
(``libnvrtc`` from the ``nvidia-cuda-nvrtc`` wheel that torch's CUDA builds install, or a
toolkit: :func:`find_nvrtc`), called through ctypes with the CUDA headers of the
``nvidia-cuda-runtime`` wheel or a toolkit and small stand-ins for the C headers NVRTC lacks
(:data:`NVRTC_SHIM`).  NVRTC's cubin is ptxas' output for the same arch (same resource
report); where the gencode embeds PTX, NVRTC's PTX is put beside it in a fatbin through
``libnvfatbin`` (wheel ``nvidia-nvfatbin``) when that is installed, else the unit has SASS
only (the report's log says so).
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

#: Flags every build uses besides the output kind (:func:`output_flag`) and the target's
#: ``-gencode`` (part of the cache key).
NVCC_FLAGS: tuple[str, ...] = ("-std=c++17", "-O3", "-Xptxas", "-v", "-lineinfo")
#: The toolkit location searched last (after ``$CUDA_HOME`` / ``$CUDA_PATH`` and the wheels).
DEFAULT_CUDA_HOME = "/usr/local/cuda"
#: Seconds one nvcc run may take before it is killed.
NVCC_TIMEOUT_S = 900


class CompileError(RuntimeError):
    """nvcc failed (or is missing).  ``output`` holds nvcc's combined stdout/stderr."""

    def __init__(self, message: str, output: str = "", command: list[str] | None = None):
        self.output = output
        self.command = list(command or [])
        super().__init__(f"{message}\n{output}".rstrip())


class NvccNotFoundError(CompileError):
    """No nvcc binary could be found (see the module docstring for the search order); raised
    by :func:`find_compiler` when NVRTC cannot be used either, naming what to install."""


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


# ----------------------------------------------------------------------------- finding tools
def nvidia_wheel_roots() -> list[Path]:
    """The ``site-packages/nvidia`` folders of installed NVIDIA wheels (the search path of the
    ``nvidia`` namespace package; nothing is imported).  CUDA 13 wheels put every component
    under ``nvidia/cu13`` (``bin/nvcc``, ``lib/libnvrtc.so.13``, ``include``); CUDA 12 wheels
    one folder per component (``nvidia/cuda_nvcc/bin/nvcc``, ``nvidia/cuda_nvrtc/lib``)."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def _executable(path: Path) -> str | None:
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def wheel_tool(name: str) -> str | None:
    """Executable ``name`` (``nvcc``, ``cuobjdump``, ...) from an NVIDIA wheel
    (``nvidia/cu13/bin``, or CUDA 12's ``nvidia/cuda_<name>/bin``), or None."""
    for root in nvidia_wheel_roots():
        for sub in ("cu13/bin", f"cuda_{name}/bin"):
            if found := _executable(root / sub / name):
                return found
    return None


def _cuda_homes(default: bool = True) -> list[Path]:
    from flashgen import env as _env

    homes = [_env.foreign("CUDA_HOME"), _env.foreign("CUDA_PATH")]
    return [Path(h) for h in homes if h] + ([Path(DEFAULT_CUDA_HOME)] if default else [])


def find_nvcc() -> str:
    """Path of the nvcc binary: the one :data:`flashgen.env.NVCC` names if set (an error if it
    is not an executable), else ``nvcc`` on ``PATH`` (read through :mod:`flashgen.env`), else
    ``$CUDA_HOME/bin/nvcc`` or ``$CUDA_PATH/bin/nvcc``, else the ``nvidia-cuda-nvcc`` wheel's
    (:func:`wheel_tool`), else :data:`DEFAULT_CUDA_HOME`'s.  Raises
    :class:`NvccNotFoundError` if there is none."""
    from flashgen import env as _env

    env = _env.get(_env.NVCC)
    if env:
        if shutil.which(env):
            return shutil.which(env)  # type: ignore[return-value]
        raise NvccNotFoundError(f"{_env.NVCC}={env!r} is not an executable")
    found = shutil.which("nvcc", path=_env.foreign("PATH"))
    if found:
        return found
    for home in _cuda_homes(default=False):
        if found := _executable(home / "bin" / "nvcc"):
            return found
    if found := wheel_tool("nvcc") or _executable(Path(DEFAULT_CUDA_HOME) / "bin" / "nvcc"):
        return found
    raise NvccNotFoundError(
        "nvcc (the CUDA compiler) was not found: `pip install flashgen[gpu]` (or "
        "`pip install nvidia-cuda-nvcc nvidia-cuda-cccl`) installs it, or put it on PATH, or set "
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


# ----------------------------------------------------------------------------- NVRTC
#: What NVRTC compiles every unit with, the arch and include path aside (part of the cache
#: key of NVRTC builds): nvcc's flags in NVRTC's spelling (ptxas -v for the resource report).
NVRTC_FLAGS: tuple[str, ...] = (
    "-std=c++17", "-lineinfo", "--ptxas-options=-v", "--pre-include=flashgen_nvrtc.h",
)  # fmt: skip
#: NVRTC has no C library headers: the templates' ``<stdint.h>`` and ``<math.h>`` (and the
#: ``INFINITY``, ``NAN``, ``INT_MAX`` that nvcc's host headers bring along) come from this
#: header, pre-included, with ``stdint.h`` / ``math.h`` / ``limits.h`` mapped to it.  The
#: types are glibc's on LP64 (``int64_t`` is ``long``), the values those of nvcc's headers.
NVRTC_SHIM = """#pragma once
typedef signed char int8_t; typedef short int16_t; typedef int int32_t; typedef long int64_t;
typedef unsigned char uint8_t; typedef unsigned short uint16_t; typedef unsigned int uint32_t;
typedef unsigned long uint64_t; typedef long intptr_t; typedef unsigned long uintptr_t;
#define INT8_MIN (-128)
#define INT8_MAX 127
#define UINT8_MAX 255
#define INT16_MIN (-32767 - 1)
#define INT16_MAX 32767
#define UINT16_MAX 65535
#define INT32_MIN (-2147483647 - 1)
#define INT32_MAX 2147483647
#define UINT32_MAX 4294967295u
#define INT64_MIN (-9223372036854775807L - 1)
#define INT64_MAX 9223372036854775807L
#define UINT64_MAX 18446744073709551615ul
#define INT_MIN (-2147483647 - 1)
#define INT_MAX 2147483647
#define UINT_MAX 4294967295u
#define INFINITY (__int_as_float(0x7f800000))
#define NAN (__int_as_float(0x7fc00000))
"""
_NVRTC_HEADERS = {
    "flashgen_nvrtc.h": NVRTC_SHIM,
    **{h: "#include <flashgen_nvrtc.h>\n" for h in ("stdint.h", "math.h", "limits.h")},
}
#: The CUDA headers the templates include, which NVRTC needs from a folder.
NVRTC_NEEDS = ("cuda_fp16.h", "cuda_bf16.h")
_NVRTC_LOCK = threading.Lock()


def _nvrtc_candidates() -> list[str]:
    out = []
    for root in nvidia_wheel_roots():
        out += [str(root / "cu13/lib/libnvrtc.so.13")]
        out += sorted(glob.glob(str(root / "cuda_nvrtc/lib/libnvrtc.so.1*")))
    for home in _cuda_homes():
        for lib in ("lib64", "lib"):
            out += sorted(glob.glob(str(home / lib / "libnvrtc.so.1*")), reverse=True)
    return [p for p in out if os.path.isfile(p)] + ["libnvrtc.so.13", "libnvrtc.so.12"]


@cache
def _load_nvrtc(path: str):
    """``ctypes.CDLL`` of libnvrtc at ``path`` (a file, or a soname for the dynamic loader),
    its ``libnvrtc-builtins`` from the same folder loaded first (libnvrtc looks for it by
    name on the loader's path, which a wheel's folder is not on); ``OSError`` if it fails."""
    folder = os.path.dirname(path)
    if folder:
        builtins = [b for b in glob.glob(os.path.join(folder, "libnvrtc-builtins.so.*"))
                    if ".alt." not in b]  # fmt: skip
        for b in sorted(builtins):
            ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(path)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def find_nvrtc() -> tuple[str, str] | None:
    """``(libnvrtc path, version)`` of the first NVRTC that loads: the CUDA 13 / 12 wheels'
    (``nvidia-cuda-nvrtc``, a dependency of torch's CUDA builds), ``$CUDA_HOME`` /
    ``$CUDA_PATH`` / :data:`DEFAULT_CUDA_HOME`'s ``lib64``, the dynamic loader's; None when
    none does."""
    for path in _nvrtc_candidates():
        try:
            lib = _load_nvrtc(path)
        except OSError:
            continue
        major, minor = ctypes.c_int(), ctypes.c_int()
        if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) == 0:
            return path, f"{major.value}.{minor.value}"
    return None


def find_cuda_include(extra: tuple[str, ...] = ()) -> str | None:
    """A folder with :data:`NVRTC_NEEDS` (``cuda_fp16.h``, ``cuda_bf16.h``): ``extra`` folders
    first, then the wheels' (``nvidia-cuda-runtime``: ``nvidia/cu13/include``, CUDA 12's
    ``nvidia/cuda_runtime/include``), then the toolkits' (``$CUDA_HOME/include`` ...); None."""
    dirs = [Path(d) for d in extra]
    for root in nvidia_wheel_roots():
        dirs += [root / "cu13/include", root / "cuda_runtime/include"]
    dirs += [home / "include" for home in _cuda_homes()]
    for d in dirs:
        if all((d / h).is_file() for h in NVRTC_NEEDS):
            return str(d)
    return None


def _find_nvfatbin(nvrtc_path: str):
    """``ctypes.CDLL`` of libnvfatbin (wheel ``nvidia-nvfatbin``, or beside libnvrtc), or
    None."""
    cands = [os.path.join(os.path.dirname(nvrtc_path), "libnvfatbin.so.13")]
    for root in nvidia_wheel_roots():
        cands += [str(root / "cu13/lib/libnvfatbin.so.13")]
        cands += sorted(glob.glob(str(root / "nvfatbin/lib/libnvfatbin.so.1*")))
    for c in cands:
        if os.path.isfile(c):
            try:
                return ctypes.CDLL(c)
            except OSError:
                continue
    return None


@dataclass(frozen=True)
class Compiler:
    """The compiler :func:`find_compiler` chose: ``kind`` ``"nvcc"`` or ``"nvrtc"``, ``path``
    (the nvcc binary or libnvrtc), ``version`` and, for NVRTC, the CUDA ``include`` folder
    and whether libnvfatbin is there to embed PTX (``fatbin``)."""

    kind: str
    path: str
    version: str
    include: str = ""
    fatbin: bool = False

    @property
    def key(self) -> str:
        """What names this compiler in the kernel cache key and in reports: the nvcc version
        (``"13.0.88"``, as before NVRTC existed), or ``"nvrtc 13.0"`` with a digest of the
        headers it compiles against and ``+fatbin`` when it embeds PTX."""
        if self.kind == "nvcc":
            return self.version
        digest = _headers_digest(self.include)
        return f"nvrtc {self.version} headers {digest}" + (" +fatbin" if self.fatbin else "")


@cache
def _headers_digest(include: str) -> str:
    h = hashlib.sha256()
    for name in NVRTC_NEEDS:
        h.update((Path(include) / name).read_bytes())
    return h.hexdigest()[:12]


def find_compiler() -> Compiler:
    """nvcc (:func:`find_nvcc`) if there is one, else NVRTC (:func:`find_nvrtc`, with the
    headers of :func:`find_cuda_include`).  Raises :class:`NvccNotFoundError` naming what to
    install when neither can compile: no nvcc and no NVRTC, or NVRTC without the CUDA
    headers."""
    try:
        nvcc = find_nvcc()
    except NvccNotFoundError as e:
        from flashgen import env as _env

        if _env.get(_env.NVCC):
            raise  # a named binary that is missing is an error, not a reason to switch
        nvrtc = find_nvrtc()
        if nvrtc is None:
            raise NvccNotFoundError(
                f"{e}; NVRTC (libnvrtc: `pip install nvidia-cuda-nvrtc`) was not found either"
            ) from None
        path, version = nvrtc
        include = find_cuda_include((os.path.join(os.path.dirname(path), "..", "include"),))
        if include is None:
            raise NvccNotFoundError(
                f"{e}; NVRTC {version} ({path}) was found, but not the CUDA headers the "
                f"kernels include ({', '.join(NVRTC_NEEDS)}): `pip install "
                "nvidia-cuda-runtime` installs them"
            ) from None
        return Compiler("nvrtc", path, version, include, _find_nvfatbin(path) is not None)
    return Compiler("nvcc", nvcc, _nvcc_version(nvcc))


def nvrtc_options(plan, include: str | None) -> list[str]:
    """NVRTC's options for ``plan``: ``--gpu-architecture=<plan.arch>`` (SASS: ``sm_80``,
    ``sm_90a``), :data:`NVRTC_FLAGS`, and ``-I<include>`` unless None (the cache key leaves
    the folder out: :attr:`Compiler.key` digests the headers)."""
    opts = [f"--gpu-architecture={plan.arch}", *NVRTC_FLAGS]
    return opts + ([f"-I{include}"] if include is not None else [])


def _nvrtc_check(lib, result: int, what: str) -> None:
    if result != 0:
        raise CompileError(f"NVRTC: {what} failed: {lib.nvrtcGetErrorString(result).decode()}")


def _nvrtc_bytes(lib, prog, size_fn: str, get_fn: str) -> bytes:
    n = ctypes.c_size_t()
    _nvrtc_check(lib, getattr(lib, size_fn)(prog, ctypes.byref(n)), size_fn)
    buf = ctypes.create_string_buffer(n.value)
    _nvrtc_check(lib, getattr(lib, get_fn)(prog, buf), get_fn)
    return buf.raw


def _fatbin(nvrtc_path: str, cubin: bytes, ptx: bytes, arch: str, name: str) -> bytes:
    """The fatbin of ``cubin`` (SASS for ``arch``, e.g. ``"80"``) and ``ptx`` through
    libnvfatbin."""
    lib = _find_nvfatbin(nvrtc_path)
    handle = ctypes.c_void_p()

    def check(result, what):
        if result != 0:
            raise CompileError(f"nvFatbin: {what} failed (error {result})")

    check(lib.nvFatbinCreate(ctypes.byref(handle), None, ctypes.c_size_t(0)), "nvFatbinCreate")
    try:
        check(lib.nvFatbinAddCubin(handle, cubin, ctypes.c_size_t(len(cubin)), arch.encode(),
                                   name.encode()), "nvFatbinAddCubin")  # fmt: skip
        check(lib.nvFatbinAddPTX(handle, ptx, ctypes.c_size_t(len(ptx)), arch.encode(),
                                 name.encode(), b""), "nvFatbinAddPTX")  # fmt: skip
        size = ctypes.c_size_t()
        check(lib.nvFatbinSize(handle, ctypes.byref(size)), "nvFatbinSize")
        buf = ctypes.create_string_buffer(size.value)
        check(lib.nvFatbinGet(handle, buf), "nvFatbinGet")
        return buf.raw
    finally:
        lib.nvFatbinDestroy(ctypes.byref(handle))


def compile_nvrtc(source: str, plan, out_path: str | Path, comp: Compiler):
    """Compile ``source`` for ``plan.arch`` with NVRTC (``comp``) into ``out_path``: the cubin,
    or where ``plan.gencode`` embeds PTX and ``comp.fatbin``, a fatbin of the cubin and the
    PTX.  Returns ``(options, log)``: NVRTC's options and its log (ptxas -v's report, and a
    note when PTX was asked for but libnvfatbin is missing).  Raises :class:`CompileError`
    with the log when NVRTC fails.  One compile at a time per process."""
    lib = _load_nvrtc(comp.path)
    opts = nvrtc_options(plan, comp.include)
    names = list(_NVRTC_HEADERS)
    headers = (ctypes.c_char_p * len(names))(*(_NVRTC_HEADERS[n].encode() for n in names))
    include_names = (ctypes.c_char_p * len(names))(*(n.encode() for n in names))
    argv = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
    prog = ctypes.c_void_p()
    with _NVRTC_LOCK:
        _nvrtc_check(lib, lib.nvrtcCreateProgram(
            ctypes.byref(prog), source.encode(), f"{plan.kernel_name}.cu".encode(), len(names),
            headers, include_names), "nvrtcCreateProgram")  # fmt: skip
        try:
            result = lib.nvrtcCompileProgram(prog, len(opts), argv)
            log = _nvrtc_bytes(lib, prog, "nvrtcGetProgramLogSize", "nvrtcGetProgramLog")
            log = log.rstrip(b"\0").decode(errors="replace")
            if result != 0:
                raise CompileError(
                    f"NVRTC {comp.version} failed compiling {plan.kernel_name} for "
                    f"{plan.target} ({lib.nvrtcGetErrorString(result).decode()}):\n  "
                    f"{' '.join(opts)}",
                    log,
                    ["nvrtc", *opts],
                )
            code = _nvrtc_bytes(lib, prog, "nvrtcGetCUBINSize", "nvrtcGetCUBIN")
            if embeds_ptx(plan.gencode):
                if comp.fatbin:
                    ptx = _nvrtc_bytes(lib, prog, "nvrtcGetPTXSize", "nvrtcGetPTX")
                    arch = plan.arch.removeprefix("sm_")
                    code = _fatbin(comp.path, code, ptx, arch, plan.kernel_name)
                else:
                    log += (
                        "\nflashgen: no PTX embedded (libnvfatbin not found: `pip install "
                        "nvidia-nvfatbin`); this unit runs on its SASS arch only\n"
                    )
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))
    Path(out_path).write_bytes(code)
    return opts, log


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

    The compiler is :func:`find_compiler`'s: nvcc, else NVRTC (:func:`compile_nvrtc`).
    Raises :class:`NvccNotFoundError` without either (naming what to install),
    :class:`CompileError` (with the compiler's output) when it fails, times out (nvcc), or
    reports no entry function.
    """
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(plan.kernel_name)):
        raise ValueError(f"kernel name {plan.kernel_name!r} is not a C identifier")
    comp = find_compiler()
    if comp.kind == "nvrtc":
        t0 = time.perf_counter()
        opts, log = compile_nvrtc(source, plan, out_path, comp)
        return _report(plan, log, time.perf_counter() - t0, comp.key, ["nvrtc", *opts])
    nvcc, version = comp.path, comp.version
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
    return _report(plan, log, seconds, version, cmd)


def _report(plan, log: str, seconds: float, version: str, cmd: list[str]) -> CompileReport:
    """The :class:`CompileReport` of a successful compile whose ptxas -v output is ``log``;
    :class:`CompileError` when ptxas reported no entry function ``plan.kernel_name``."""
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
