"""Device memory for the GPU tests that need much of it, under ``pytest -n`` (xdist).

The workers share one GPU: a test that allocates tens of GiB, or runs a child process under
compute-sanitizer (whose allocations carry the tool's shadow memory), takes
:func:`exclusive` first.  It holds a lock file shared by every worker of the run (so two
such tests never overlap) and waits until the device has the memory free: the other
workers' caching allocators give theirs back after each test (the ``_device_memory``
fixture of ``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path

import filelock

GIB = 1 << 30
#: one lock for every worker of every run on this machine
LOCK = Path(tempfile.gettempdir()) / "flashgen-gpu-tests-memory.lock"


@contextlib.contextmanager
def exclusive(gib: float, wait_s: float = 600.0):
    """Run the block alone among the memory-hungry tests, once ``gib`` GiB are free.

    Raises ``AssertionError`` (a test failure naming the memory) if the device never has
    ``gib`` GiB free within ``wait_s`` seconds; never skips.
    """
    import torch

    with filelock.FileLock(str(LOCK), timeout=wait_s):
        deadline = time.monotonic() + wait_s
        while True:
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            if free >= gib * GIB:
                break
            assert time.monotonic() < deadline, (
                f"the test needs {gib} GiB of device memory free; {free / GIB:.1f} of "
                f"{total / GIB:.1f} GiB were free after {wait_s:.0f} s"
            )
            time.sleep(0.5)
        try:
            yield
        finally:
            torch.cuda.empty_cache()
