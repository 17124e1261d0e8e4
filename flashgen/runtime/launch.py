"""Load cubins with CuPy and launch them on PyTorch's current CUDA stream.

The only module that touches CuPy, and only lazily (inside functions), so importing
flashgen on a machine without a GPU driver works.  A loaded kernel is cached per
(cubin path, device index) for the life of the process: a warm launch only builds the
argument tuple and calls the driver.
"""

from __future__ import annotations

import ctypes
import operator
import struct
import threading
import warnings
from dataclasses import dataclass, field
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

    plan: object  # flashgen.codegen.plan.KernelPlan
    module: object  # cupy.RawModule (kept alive with the function)
    function: object  # cupy.RawKernel
    device_index: int
    #: the prepared argument block of a TMA kernel (built on its first launch)
    _tma_launch: object = field(default=None, repr=False, compare=False)

    def launch(self, grid: tuple[int, int, int], values: dict, stream_ptr: int) -> None:
        """Launch with ``grid`` on the raw CUDA stream ``stream_ptr``.

        ``values`` maps every name of ``plan.args`` to a tensor (pointer arguments) or a
        Python number; see :func:`kernel_args`.
        """
        cupy = _cupy()
        if getattr(self.plan, "tma", ()):
            if cupy.cuda.runtime.getDevice() == self.device_index:  # what Device() checks
                _launch_with_tensor_maps(self, grid, values, stream_ptr)
            else:
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

    The argument block is laid out once per kernel and thread (:class:`_TmaLaunch`); a
    call packs the values into it with one ``struct.pack_into`` and takes the descriptors
    from :data:`flashgen.runtime.tma.descriptors`.  The driver copies the parameters when the launch
    is enqueued (or captured into a CUDA graph), so the block is free again on return.
    """
    launcher = kern._tma_launch
    if launcher is None:
        launcher = _TmaLaunch(kern.plan, kern.device_index, _function_ptr(kern.function))
        kern._tma_launch = launcher
    launcher.launch(grid, values, stream_ptr)


def _getter(names: list):
    """``values -> list`` of ``values[name]`` for ``names``, in one C call."""
    if not names:
        return lambda values: []
    get = operator.itemgetter(*names)
    if len(names) == 1:
        return lambda values: [get(values)]
    return get


#: struct format code and size of each scalar C type of a kernel argument.
_STRUCT_CODE = {"int64_t": ("q", 8), "int": ("i", 4), "float": ("f", 4)}
#: the numpy type :func:`kernel_args` converts each scalar C type to.
_NUMPY = {"int64_t": np.int64, "int": np.int32, "float": np.float32}


class _TmaLaunch:
    """The prepared ``cuLaunchKernel`` argument block of one TMA kernel on one device.

    One byte buffer holds every argument at a fixed offset (descriptors first, 128 bytes
    each at 64-byte alignment, then pointers as uint64, then the scalars at their C sizes
    and alignments), described by one ``struct.Struct``; ``params`` is the array of their
    addresses, in ABI order, that ``cuLaunchKernel`` reads.  A call fetches the values with
    two ``operator.itemgetter`` calls and writes them with one ``pack_into``.  Each
    thread gets its own buffer, so concurrent launches do not share one.

    Each ``plan.tma`` entry names the tensor argument its descriptor maps and the box's
    rows; a tensor TMA cannot read in place (see :func:`flashgen.runtime.tma.needs_copy`) is
    mapped through a contiguous copy, kept alive until the launch is enqueued (the caching
    allocator reuses it only in stream order).  A descriptor cache hit implies the tensor
    needed no copy: only tensors TMA reads in place are ever encoded.
    """

    def __init__(self, plan, device_index: int, function_ptr: int):
        self.plan = plan
        self.device_index = device_index
        self.function_ptr = function_ptr
        self.dtype = plan.context["dtype"]
        maps = {m.name: m for m in plan.tma}
        groups = {"m": [], "p": [], "s": []}  # (arg index, name, format code, size)
        for i, a in enumerate(plan.args):
            if a.ctype == "CUtensorMap":
                groups["m"].append((i, a.name, "128s", 128))
            elif a.ctype.endswith("*"):
                groups["p"].append((i, a.name, "Q", 8))
            elif a.ctype in _STRUCT_CODE:
                groups["s"].append((i, a.name, *_STRUCT_CODE[a.ctype]))
            else:
                raise TypeError(f"kernel argument {a.name!r} has unsupported ctype {a.ctype!r}")
        fmt, offsets, off = ["="], [0] * len(plan.args), 0
        for i, _, code, size in [*groups["m"], *groups["p"], *groups["s"]]:
            pad = -off % min(size, 64)
            fmt.append(f"{pad}x{code}" if pad else code)
            offsets[i] = off = off + pad
            off += size
        self.struct = struct.Struct("".join(fmt))
        self.offsets = tuple(offsets)
        #: the TmaArg of each descriptor, in block order
        self.maps = [maps[name] for _, name, _, _ in groups["m"]]
        self.pointer_names = [name for _, name, _, _ in groups["p"]]
        self.scalar_names = [name for _, name, _, _ in groups["s"]]
        self._scalar_index = [i for i, _, _, _ in groups["s"]]
        self._pointers = _getter(self.pointer_names)
        self._scalars = _getter(self.scalar_names)
        self._tls = threading.local()

    def _block(self):
        blk = getattr(self._tls, "block", None)
        if blk is None:
            buf = ctypes.create_string_buffer(self.struct.size + 64)
            base = ctypes.addressof(buf)
            shift = -base % 64  # 64-byte aligned start, like the device-side CUtensorMap
            params = (ctypes.c_void_p * len(self.offsets))(
                *[base + shift + o for o in self.offsets]
            )
            blk = self._tls.block = (buf, shift, params)
        return blk

    def values(self, values: dict) -> tuple[list, list]:
        """Argument values in block order (descriptors as bytes, pointers as ints, then the
        scalars) and the contiguous copies made for TMA, to keep alive until the launch is
        enqueued.  ``KeyError`` names a missing argument."""
        from flashgen.runtime import tma

        try:
            ptrs = self._pointers(values)
            scalars = self._scalars(values)
        except KeyError:
            kernel_args(self.plan, values)  # raises the KeyError that names the argument
            raise
        cache, dev = tma.descriptors, self.device_index
        out, keep = [], []
        for m in self.maps:
            dtype = m.dtype or self.dtype
            elem = tma.ELEM_BYTES[dtype]
            t = values[m.tensor]
            swz = tma.SWIZZLE[m.swizzle]
            ptr, shape, strides = t.data_ptr(), t.shape, t.stride()
            desc = cache.lookup((dev, ptr, shape, strides, dtype, m.box_rows, swz))
            if desc is None:  # a hit was encoded from this very geometry: no copy needed
                if tma.needs_copy(shape, strides, elem, ptr):
                    # a fresh (aligned, contiguous) allocation: .contiguous() of a contiguous
                    # view at an unaligned offset would be the view itself
                    t = t.new_empty(shape).copy_(t)
                    keep.append(t)
                    ptr, shape, strides = t.data_ptr(), t.shape, t.stride()
                desc = cache.get(dev, ptr, shape, strides, dtype, m.box_rows, name=m.tensor,
                                 swizzle=swz)  # fmt: skip
            out.append(desc)
        out += [p if isinstance(p, int) else p.data_ptr() for p in ptrs]
        out += scalars
        return out, keep

    def pack(self, vals: list):
        """Write ``vals`` into this thread's block; returns the ``params`` array."""
        buf, shift, params = self._block()
        try:
            self.struct.pack_into(buf, shift, *vals)
        except (struct.error, TypeError, OverflowError):
            # a numpy scalar, a float for an int ...: convert as kernel_args does (numpy)
            n = len(self.maps) + len(self.pointer_names)
            ctypes_ = [self.plan.args[i].ctype for i in self._scalar_index]
            conv = [_NUMPY[c](v).item() for c, v in zip(ctypes_, vals[n:], strict=True)]
            self.struct.pack_into(buf, shift, *vals[:n], *conv)
        return params

    def launch(self, grid, values: dict, stream_ptr: int) -> None:
        """Pack ``values`` (see :meth:`values`) and enqueue the kernel on ``stream_ptr``;
        ``RuntimeError`` naming the CUresult if the driver refuses."""
        from flashgen.runtime import tma

        vals, keep = self.values(values)
        params = self.pack(vals)
        plan = self.plan
        rc = tma.driver().cuLaunchKernel(
            self.function_ptr, *grid, plan.threads, 1, 1, plan.smem_bytes, stream_ptr,
            params, None,
        )  # fmt: skip
        del keep  # the copies' memory is reused only in stream order, after this launch
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernel({plan.kernel_name}) failed: CUresult {rc}")


#: Bytes of each slab :func:`device_zeros` carves its buffers from (one ``cudaMalloc`` each).
_SLAB_BYTES = 4096
_slabs: dict[int, list[int]] = {}  # device index -> [slab address, bytes handed out]
_slab_lock = threading.Lock()


def device_zeros(nbytes: int, device_index: int, stream_ptr: int) -> int:
    """The address of ``nbytes`` of device memory on ``device_index`` (16-byte aligned), zeroed
    by an async memset on the raw stream ``stream_ptr`` (so before that stream's later work),
    kept for the life of the process.

    Outside torch's caching allocator: never in a private pool (a CUDA graph's, a
    ``torch.cuda.MemPool``), whatever the thread's allocations are routed to when it is asked
    for (torch.compile's CUDA-graph trees route a warm-up's into theirs, and may hand that
    memory to graph tensors later), so nothing else is ever given this memory.  Carved from
    4 KiB slabs, one ``cudaMalloc`` per slab.  ``ValueError`` unless 0 < ``nbytes`` <= 4096.
    """
    size = -(-nbytes // 16) * 16
    if not 0 < size <= _SLAB_BYTES:
        raise ValueError(f"device_zeros: nbytes={nbytes}, expected 1 to {_SLAB_BYTES}")
    cupy = _cupy()
    with _slab_lock, cupy.cuda.Device(device_index):
        slab = _slabs.get(device_index)
        if slab is None or slab[1] + size > _SLAB_BYTES:
            slab = _slabs[device_index] = [int(cupy.cuda.runtime.malloc(_SLAB_BYTES)), 0]
        ptr = slab[0] + slab[1]
        slab[1] += size
        cupy.cuda.runtime.memsetAsync(ptr, 0, size, stream_ptr)
    return ptr


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
