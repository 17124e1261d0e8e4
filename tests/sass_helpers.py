"""The SASS of a unit, for the tests that check which instructions a kernel holds (wgmma, TMA
loads, setmaxnreg, ...): ``cuobjdump -sass`` of the cubin the kernel cache holds for it.  The
compile tests (tests/unit/test_compile.py, test_persistent.py, test_hopper_bwd.py) build the
same units through the session's cache, so this costs no second front-end run (an ``nvcc
-ptx`` of each unit used to take about a CPU-second) and checks what ptxas kept.

The PTX the tests used to read and the SASS that ptxas 13 makes of it (checked equal, feature
by feature, on every unit of those tests):

=====================================  =================================================
PTX                                    SASS
=====================================  =================================================
``wgmma.mma_async`` (``m64nNk16``)     ``HGMMA.64xNx16`` (fp16 / bf16), ``QGMMA`` (fp8)
``cp.async.bulk.tensor.4d`` (a load)   ``UTMALDG.4D``
``cp.reduce.async.bulk.tensor.4d``     ``UTMAREDG.4D``
``setmaxnreg.dec ... 24``              ``USETMAXREG.DEALLOC.CTAPOOL 0x18``
``setmaxnreg.inc ... 240``             ``USETMAXREG.TRY_ALLOC.CTAPOOL ..., 0xf0``
``mbarrier.try_wait.parity``           ``SYNCS.PHASECHK.TRANS64.TRYWAIT``
``red.global.add.v2.f32``              ``REDG.E.ADD.F32x2``
``trap;``                              ``BPT.TRAP``
=====================================  =================================================
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

_GMMA = re.compile(r"\b[A-Z]GMMA\.(\d+x\d+x\d+)")
#: ``cuobjdump -sass`` listings by cubin path (a cache entry's path names its content): the
#: tests that read one unit's SASS more than once in a process disassemble it once (about a
#: CPU-second each).
_LISTINGS: dict[str, str] = {}


def cuobjdump() -> str | None:
    """cuobjdump: the ``nvidia-cuda-cuobjdump`` wheel's (the ``test`` extra), on ``PATH``, or
    beside nvcc (a CUDA toolkit); None without one."""
    from flashgen.build.compile import NvccNotFoundError, find_nvcc, wheel_tool

    found = wheel_tool("cuobjdump") or shutil.which("cuobjdump")
    if found:
        return found
    try:
        beside = Path(find_nvcc()).resolve().parent / "cuobjdump"
    except NvccNotFoundError:
        return None
    return str(beside) if beside.is_file() else None


def sass(plan) -> str:
    """``cuobjdump -sass`` of ``plan``'s cubin (a :class:`~flashgen.codegen.plan.KernelPlan`
    or a backward ``unit``), built through the kernel cache (a hit where a compile test built
    it); skips the test without cuobjdump (``pip install nvidia-cuda-cuobjdump``)."""
    from flashgen.build import cache
    from flashgen.build.render import render

    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (pip install nvidia-cuda-cuobjdump)")
    cubin, _ = cache.get_or_build(render(plan), plan)
    if str(cubin) not in _LISTINGS:
        done = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        _LISTINGS[str(cubin)] = done.stdout
    return _LISTINGS[str(cubin)]


def wgmmas(text: str, shape: str | None = None) -> int:
    """How many wgmma instructions (``HGMMA``, ``QGMMA``, ...) ``text`` holds; with ``shape``
    (``"64x128x16"``) only those of that shape."""
    return sum(1 for m in _GMMA.finditer(text) if shape is None or m.group(1) == shape)


def setmaxnreg(text: str, kind: str, regs: int) -> bool:
    """Whether ``text`` holds a ``setmaxnreg`` of ``kind`` ``"dec"`` or ``"inc"`` to ``regs``."""
    op = {"dec": "DEALLOC", "inc": "TRY_ALLOC"}[kind]
    return re.search(rf"USETMAXREG\.{op}\.CTAPOOL [^;]*\b{regs:#x} ?;", text) is not None
