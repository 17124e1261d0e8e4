"""CUtensorMap descriptors for the Hopper kernels' TMA loads, built on the host.

``cuTensorMapEncodeTiled`` (CUDA driver API, through ctypes: no torch, no CuPy) encodes
one 128-byte descriptor per tensor and launch; the kernel receives it by value as a
``__grid_constant__`` parameter (CUDA Programming Guide, "Using TMA to transfer
multi-dimensional arrays").  Encoding is a host-only call of a few microseconds, so it is
legal inside CUDA graph capture (the descriptor is baked into the captured launch).

A descriptor holds only the global address and the geometry, so :data:`descriptors`
(a bounded LRU, :class:`DescriptorCache`) keeps the encoded bytes keyed by everything
that determines them: a warm launch on the same tensors calls no driver function to build
its maps.  A tensor freed and another allocated at the same address with the same
geometry maps to the same bytes, which is correct.  ``set_cache_enabled(False)`` (read at
import; or set ``descriptors.enabled``) encodes on every launch instead.

A q/k/v tensor ``[B, H, S, D]`` with element strides ``(sb, sh, ss, 1)`` becomes the 4-D
map ``{D, S, H, B}`` (innermost first) with byte strides ``{ss, sh, sb} * elem_bytes``,
box ``{cols, rows, 1, 1}`` and a swizzle of the box row's bytes: one box is one swizzle span
(128 bytes: 64 columns of a 16-bit type, 128 of fp8; 64 bytes for an fp8 head_dim 64) of
``rows`` consecutive sequence positions; rows past S read as zeros.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections import OrderedDict

#: CUtensorMapDataType for the kernels' element types (cuda.h; e4m3 maps as UINT8; fp32 for
#: the Hopper backward's dq_accum, which it reduces into).
DATA_TYPE = {"fp16": 6, "bf16": 9, "fp8_e4m3": 0, "fp32": 7}
#: Bytes per element of each.
ELEM_BYTES = {"fp16": 2, "bf16": 2, "fp8_e4m3": 1, "fp32": 4}
#: CUtensorMapSwizzle value of the kernels' 128-byte swizzle.
SWIZZLE_128B = 3
#: CUtensorMapSwizzle by swizzle span in bytes.
SWIZZLE = {128: SWIZZLE_128B, 64: 2}
_L2_PROMOTION_256B = 3
_INTERLEAVE_NONE = 0
_OOB_FILL_ZERO = 0
#: Columns per box: one 128-byte swizzle span of a 16-bit type.
BOX_COLS = 64


class TmaError(RuntimeError):
    """The driver refused a tensor map (names the tensor, its shape and strides)."""


@functools.lru_cache(maxsize=1)
def driver():
    """The CUDA driver library (ctypes), with the prototypes flashgen calls directly:
    ``cuTensorMapEncodeTiled`` here, ``cuLaunchKernel`` in :mod:`flashgen.runtime.launch`."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:  # pragma: no cover - depends on the machine
        raise TmaError("the Hopper kernels need the CUDA driver (libcuda.so.1)") from e
    return set_prototypes(lib)


def set_prototypes(lib):
    """Set the prototypes of :func:`driver` on ``lib`` (the driver, or a library standing in
    for it with the same entry points: tests, ``tools/host_overhead.py --cpu``); returns
    ``lib``."""
    lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
    lib.cuTensorMapEncodeTiled.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    lib.cuLaunchKernel.restype = ctypes.c_int
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
    return lib


def map_geometry(shape, strides, elem_bytes: int) -> tuple[list[int], list[int]]:
    """Dims (innermost first) and byte strides of dims 1..3 for a ``[B, H, S, D]`` tensor.

    A dim of extent 1 never moves the address, so its stride is replaced by a legal one
    (TMA wants multiples of 16 bytes); any other stride must already be a positive
    multiple of 16 bytes (:func:`needs_copy` says when it is not).
    """
    b, h, s, d = (int(x) for x in shape)
    sb, sh, ss, _ = (int(x) * elem_bytes for x in strides)
    if s == 1:
        ss = d * elem_bytes
    if h == 1:
        sh = ss * s
    if b == 1:
        sb = sh * h
    return [d, s, h, b], [ss, sh, sb]


def needs_copy(shape, strides, elem_bytes: int, data_ptr: int) -> bool:
    """True when TMA cannot read the tensor in place (unaligned base, a non-unit inner
    stride, or a batch/head/seq stride that is not a positive multiple of 16 bytes)."""
    if data_ptr % 16 or int(strides[3]) != 1:
        return True
    _, gstrides = map_geometry(shape, strides, elem_bytes)
    return any(st <= 0 or st % 16 or st >= 1 << 40 for st in gstrides)


_ELEM_STRIDES = (ctypes.c_uint32 * 4)(1, 1, 1, 1)


def encode(
    data_ptr: int,
    shape,
    strides,
    dtype: str,
    box_rows: int,
    name: str = "tensor",
    swizzle: int = SWIZZLE_128B,
) -> bytes:
    """The 128-byte CUtensorMap for a ``[B, H, S, D]`` tensor (``dtype`` a key of
    :data:`DATA_TYPE`), box ``cols x box_rows`` with ``swizzle`` (a CUtensorMapSwizzle, default
    128-byte) and ``cols`` its span in elements, zero fill out of bounds.  Calls the driver
    every time; :data:`descriptors` caches the result.

    Raises :class:`TmaError` naming ``name``, its shape and strides if the driver refuses.
    """
    lib = driver()
    elem = ELEM_BYTES[dtype]
    cols = {SWIZZLE_128B: 128, SWIZZLE[64]: 64}[swizzle] // elem
    dims, gstrides = map_geometry(shape, strides, elem)
    out = (ctypes.c_uint8 * 128)()
    c_dims = (ctypes.c_uint64 * 4)(*dims)
    c_strides = (ctypes.c_uint64 * 3)(*gstrides)
    c_box = (ctypes.c_uint32 * 4)(cols, box_rows, 1, 1)
    rc = lib.cuTensorMapEncodeTiled(
        ctypes.addressof(out), DATA_TYPE[dtype], 4, ctypes.c_void_p(data_ptr),
        c_dims, c_strides, c_box, _ELEM_STRIDES,
        _INTERLEAVE_NONE, swizzle, _L2_PROMOTION_256B, _OOB_FILL_ZERO,
    )  # fmt: skip
    if rc != 0:
        raise TmaError(
            f"cuTensorMapEncodeTiled failed (CUresult {rc}) for {name}: shape {list(shape)}, "
            f"element strides {list(strides)}, box {cols} x {box_rows}"
        )
    return bytes(out)


#: Whether new descriptor caches cache (:func:`set_cache_enabled`).
_CACHE_ENABLED = True


def set_cache_enabled(enabled: bool) -> None:
    """Turn caching of encoded descriptors on or off for caches made after the call (a
    debugging knob: every launch then encodes its tensor maps)."""
    global _CACHE_ENABLED
    _CACHE_ENABLED = bool(enabled)


class DescriptorCache:
    """A bounded LRU of encoded descriptors (``maxsize`` entries, least recently used
    evicted first), thread-safe.

    The key is everything :func:`encode`'s bytes depend on: the device index, the base
    address, shape, element strides, dtype, box rows and swizzle.  ``encoder`` (default
    :func:`encode`, same signature) is what a miss calls; tests pass a fake.  ``enabled``
    False makes every lookup a miss that stores nothing.  ``hits`` / ``misses`` count
    lookups.
    """

    def __init__(self, maxsize: int = 256, encoder=None, enabled: bool | None = None):
        if maxsize < 1:
            raise ValueError(f"maxsize: expected >= 1, got {maxsize}")
        self.maxsize = maxsize
        self.encoder = encoder if encoder is not None else encode
        self.enabled = _CACHE_ENABLED if enabled is None else enabled
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every entry and zero the counters."""
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    @staticmethod
    def key(device: int, data_ptr: int, shape, strides, dtype: str, box_rows: int,
            swizzle: int = SWIZZLE_128B) -> tuple:  # fmt: skip
        """The cache key of one descriptor (shape and strides as tuples; a ``torch.Size``
        is one already)."""
        if not isinstance(shape, tuple):
            shape = tuple(shape)
        if not isinstance(strides, tuple):
            strides = tuple(strides)
        return (device, data_ptr, shape, strides, dtype, box_rows, swizzle)

    def lookup(self, key: tuple) -> bytes | None:
        """The cached descriptor of ``key`` (see :meth:`key`; counts a hit), or None
        (counts nothing: :meth:`get` counts the miss)."""
        if not self.enabled:
            return None
        with self._lock:
            desc = self._entries.get(key)
            if desc is not None:
                self._entries.move_to_end(key)
                self.hits += 1
        return desc

    def get(
        self,
        device: int,
        data_ptr: int,
        shape,
        strides,
        dtype: str,
        box_rows: int,
        name: str = "tensor",
        swizzle: int = SWIZZLE_128B,
    ) -> bytes:
        """The descriptor of this tensor geometry on ``device``: cached, else encoded
        and stored (``name`` only labels the :class:`TmaError` a refused encoding raises;
        a refusal stores nothing)."""
        key = self.key(device, data_ptr, shape, strides, dtype, box_rows, swizzle)
        desc = self.lookup(key)
        if desc is not None:
            return desc
        desc = self.encoder(data_ptr, shape, strides, dtype, box_rows, name=name, swizzle=swizzle)
        with self._lock:
            self.misses += 1
            if self.enabled:
                self._entries[key] = desc
                self._entries.move_to_end(key)
                while len(self._entries) > self.maxsize:
                    self._entries.popitem(last=False)
        return desc


#: The process-wide cache the launcher uses (:mod:`flashgen.runtime.launch`).
descriptors = DescriptorCache()
