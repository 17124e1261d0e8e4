"""Load cubins with CuPy and launch them on PyTorch's current CUDA stream.

The only module that touches CuPy, and only lazily (inside functions), so importing
flashgen on a machine without a GPU driver works.  A loaded kernel is cached per
(cubin path, device index) for the life of the process: a warm launch only builds the
argument tuple and calls the driver.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Default dynamic shared memory limit of a CTA; above it the kernel must opt in.
DEFAULT_SMEM_LIMIT = 48 * 1024

_lock = threading.Lock()
_loaded: dict[tuple[str, str, int], LoadedKernel] = {}
_streams: dict[tuple[int, int], object] = {}


def _cupy():
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise RuntimeError(
            "flashgen needs CuPy to launch CUDA kernels: pip install cupy-cuda13x "
            "(or the build matching your CUDA driver)"
        ) from e
    return cupy


@dataclass
class LoadedKernel:
    """A kernel function loaded on one device, with the plan that describes its ABI."""

    plan: object  # flashgen.lower.KernelPlan
    module: object  # cupy.RawModule (kept alive with the function)
    function: object  # cupy.RawKernel
    device_index: int

    def launch(self, grid: tuple[int, int, int], values: dict, stream_ptr: int) -> None:
        """Launch with ``grid`` on the raw CUDA stream ``stream_ptr``.

        ``values`` maps every name of ``plan.args`` to a tensor (pointer arguments) or a
        Python number; see :func:`kernel_args`.
        """
        cupy = _cupy()
        if getattr(self.plan, "tma", ()):
            with cupy.cuda.Device(self.device_index):
                _launch_with_tensor_maps(self, grid, values, stream_ptr)
            return
        args = kernel_args(self.plan, values)
        with cupy.cuda.Device(self.device_index):
            with _external_stream(cupy, stream_ptr, self.device_index):
                self.function(
                    grid, (self.plan.threads, 1, 1), args, shared_mem=self.plan.smem_bytes
                )


def _function_ptr(function) -> int:
    """The CUfunction handle behind a CuPy RawKernel."""
    inner = getattr(function, "kernel", function)
    return int(inner.ptr)


def _launch_with_tensor_maps(kern: LoadedKernel, grid, values: dict, stream_ptr: int) -> None:
    """Launch a kernel that takes CUtensorMap parameters (the Hopper TMA kernels) through
    ``cuLaunchKernel``, each argument passed by address with its exact C type (the
    descriptors as 128-byte buffers).  This is the path validated on the H200; CuPy's
    launcher can also pass a 128-byte ``np.void`` by value, not tried here yet.

    Each ``plan.tma`` entry names the tensor argument its descriptor maps and the box's
    rows; a tensor TMA cannot read in place (see :func:`flashgen.tma.needs_copy`) is
    mapped through a contiguous copy, kept alive until the launch is enqueued (the caching
    allocator reuses it only in stream order).
    """
    from . import tma

    plan = kern.plan
    keep = []
    maps = {}
    for m in plan.tma:
        t = values[m.tensor]
        if tma.needs_copy(t.shape, t.stride(), 2, t.data_ptr()):
            t = t.contiguous()
            keep.append(t)
        maps[m.name] = tma.encode(t.data_ptr(), t.shape, t.stride(), plan.context["dtype"],
                                  m.box_rows, name=m.tensor)  # fmt: skip
    objs = []
    for a, v in zip(plan.args, kernel_args(plan, {**values, **maps}), strict=True):
        if a.ctype == "CUtensorMap":
            objs.append((ctypes.c_uint8 * 128).from_buffer_copy(v))
        elif isinstance(v, np.uint64):
            objs.append(ctypes.c_uint64(int(v)))
        elif isinstance(v, np.int64):
            objs.append(ctypes.c_int64(int(v)))
        elif isinstance(v, np.int32):
            objs.append(ctypes.c_int32(int(v)))
        else:
            objs.append(ctypes.c_float(float(v)))
    params = (ctypes.c_void_p * len(objs))(*[ctypes.addressof(o) for o in objs])
    rc = tma.driver().cuLaunchKernel(
        _function_ptr(kern.function), *grid, plan.threads, 1, 1, plan.smem_bytes,
        stream_ptr, params, None,
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernel({plan.kernel_name}) failed: CUresult {rc}")


def _external_stream(cupy, ptr: int, device_index: int):
    """A CuPy view of the raw stream ``ptr`` (cached: a warm launch creates nothing)."""
    key = (ptr, device_index)
    s = _streams.get(key)
    if s is None:
        with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; it still works
            warnings.simplefilter("ignore", DeprecationWarning)
            s = cupy.cuda.ExternalStream(ptr, device_index)
        _streams[key] = s
    return s


def kernel_args(plan, values: dict) -> tuple:
    """Kernel arguments in ABI order from a name -> value map.

    Pointers (ctype ending in ``*``) take a tensor (``data_ptr()`` is passed as
    ``np.uint64``) or an int address; ``int64_t`` -> ``np.int64``; ``int`` ->
    ``np.int32``; ``float`` -> ``np.float32``.  Raises ``KeyError`` naming a missing
    argument and ``TypeError`` for an unknown ctype.
    """
    out = []
    for a in plan.args:
        try:
            v = values[a.name]
        except KeyError:
            raise KeyError(f"kernel argument {a.name!r} ({a.ctype}) has no value") from None
        if a.ctype.endswith("*"):
            out.append(np.uint64(v if isinstance(v, int) else v.data_ptr()))
        elif a.ctype == "int64_t":
            out.append(np.int64(v))
        elif a.ctype == "int":
            out.append(np.int32(v))
        elif a.ctype == "float":
            out.append(np.float32(v))
        elif a.ctype == "CUtensorMap":
            out.append(bytes(v))
        else:
            raise TypeError(f"kernel argument {a.name!r} has unsupported ctype {a.ctype!r}")
    return tuple(out)


def load(cubin_path: str | Path, plan, device_index: int) -> LoadedKernel:
    """Load ``plan.kernel_name`` from ``cubin_path`` on device ``device_index`` (cached per
    cubin, kernel name and device: one cubin may hold several kernels).

    Opts in to ``plan.smem_bytes`` of dynamic shared memory when it exceeds 48 KiB.
    Raises CuPy's ``CUDADriverError`` if the cubin does not match the device.
    """
    key = (str(cubin_path), plan.kernel_name, device_index)
    hit = _loaded.get(key)
    if hit is not None:
        return hit
    cupy = _cupy()
    with _lock:
        hit = _loaded.get(key)
        if hit is not None:
            return hit
        with cupy.cuda.Device(device_index):
            module = cupy.RawModule(path=str(cubin_path))
            fn = module.get_function(plan.kernel_name)
            if plan.smem_bytes > DEFAULT_SMEM_LIMIT:
                fn.max_dynamic_shared_size_bytes = plan.smem_bytes
        kern = LoadedKernel(plan=plan, module=module, function=fn, device_index=device_index)
        _loaded[key] = kern
        return kern
