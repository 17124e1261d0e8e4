"""Prepared ``cuLaunchKernel`` argument blocks for launches whose host time matters (the
planned decode call): the block is laid out once, a call rewrites only the fields that
changed with one ``struct.pack_into`` and enqueues the kernel through the driver directly
(no CuPy, no per-argument conversion).

The driver copies the parameters when the launch is enqueued (or captured into a CUDA
graph), so a block may be rewritten as soon as the launch call returns.  A block is not
thread-safe: each thread keeps its own (:meth:`ArgLayout.new_block`).
"""

from __future__ import annotations

import ctypes
import functools
import struct

#: struct format code and size of each argument C type (pointers as uint64).
_CODE = {"int64_t": ("q", 8), "int": ("i", 4), "float": ("f", 4)}


def _code(ctype: str) -> tuple[str, int]:
    if ctype.endswith("*"):
        return "Q", 8
    try:
        return _CODE[ctype]
    except KeyError:
        raise TypeError(f"unsupported kernel argument ctype {ctype!r}") from None


class ArgLayout:
    """The layout of a kernel's arguments (``args``: :class:`flashgen.codegen.abi.KernelArg` in ABI
    order) in one byte block, each at its C alignment: ``offsets[i]``; ``struct`` packs every
    argument; :meth:`head` packs the first ``n`` (the fields a call changes, when the ABI
    puts them first); :meth:`setter` writes one."""

    def __init__(self, args):
        self.names = [a.name for a in args]
        self.index = {n: i for i, n in enumerate(self.names)}
        fmt, offsets, off = ["="], [], 0
        self.codes = []
        for a in args:
            code, size = _code(a.ctype)
            pad = -off % size
            fmt.append(f"{pad}x{code}" if pad else code)
            offsets.append(off + pad)
            off += pad + size
            self.codes.append(code)
        self.size = max(off, 8)
        self.offsets = tuple(offsets)
        self.struct = struct.Struct("".join(fmt))
        self._heads: dict[int, struct.Struct] = {}
        self._fields = [struct.Struct("=" + c) for c in self.codes]

    def head(self, n: int) -> struct.Struct:
        """A ``struct.Struct`` packing the first ``n`` arguments at offset 0 (they must be
        laid out without padding: pointers)."""
        s = self._heads.get(n)
        if s is None:
            if any(c != "Q" for c in self.codes[:n]):
                raise ValueError("head(): the leading arguments must be pointers")
            s = self._heads[n] = struct.Struct("=" + "Q" * n)
        return s

    def new_block(self):
        """``(buffer, params)``: a zeroed argument block and the array of its arguments'
        addresses that ``cuLaunchKernel`` takes as ``kernelParams``."""
        buf = ctypes.create_string_buffer(self.size)
        base = ctypes.addressof(buf)
        params = (ctypes.c_void_p * len(self.offsets))(*[base + o for o in self.offsets])
        return buf, params

    def pack(self, buf, values: dict) -> None:
        """Write every argument from ``values`` (name -> int address, tensor or number).
        ``KeyError`` names a missing argument."""
        vals = []
        for name, code in zip(self.names, self.codes, strict=True):
            try:
                v = values[name]
            except KeyError:
                raise KeyError(f"kernel argument {name!r} has no value") from None
            if code == "Q":
                v = v if isinstance(v, int) else v.data_ptr()
            elif code in ("q", "i"):
                v = int(v)
            else:
                v = float(v)
            vals.append(v)
        self.struct.pack_into(buf, 0, *vals)

    def setter(self, buf, name: str):
        """``set(value)``: writes argument ``name`` of ``buf`` alone (its offset and format
        looked up once); None when the kernel has no argument ``name``."""
        i = self.index.get(name)
        if i is None:
            return None
        return functools.partial(self._fields[i].pack_into, buf, self.offsets[i])


def raw_launcher(launch):
    """``(call, handle)`` for a ``cuLaunchKernel`` entry point with :func:`flashgen.runtime.
    tma.driver`'s prototype: ``call``, the same C function with no argument types (ctypes
    then converts nothing per call but what it is passed: the prototype's conversion of the
    eleven arguments costs more than the rest of the call to ctypes), to be passed the
    function and stream handles as ``handle(int)`` (a ``c_void_p``), the grid, block and
    shared-memory sizes as ints below 2**32 (C ints, read as the unsigned they are), the
    argument block's address array (:meth:`ArgLayout.new_block`) and None.  A Python stand-in
    for the driver (tests) is returned as is, with ``int`` for ``handle``."""
    if not isinstance(launch, ctypes._CFuncPtr):
        return launch, int
    address = ctypes.cast(launch, ctypes.c_void_p).value
    return ctypes.CFUNCTYPE(ctypes.c_int)(address), ctypes.c_void_p
