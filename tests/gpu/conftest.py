"""GPU tests' setup.

* Each test gives its cached device memory back when it ends, so the xdist workers sharing
  the GPU leave room for the memory-hungry tests.
* ``@pytest.mark.device_memory(gib)``: the test runs inside
  :func:`gpu_memory.exclusive` (alone among the marked tests, once ``gib`` GiB are free).
"""

from __future__ import annotations

import contextlib

import pytest


@pytest.fixture(autouse=True)
def _device_memory(request):
    marker = request.node.get_closest_marker("device_memory")
    if marker is None:
        hold = contextlib.nullcontext()
    else:
        import gpu_memory

        hold = gpu_memory.exclusive(*marker.args)
    with hold:
        yield
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
