"""A planned decode call's fast path on CPU tensors standing in for CUDA ones, the driver
faked (:func:`faked_fast_plan`), and the reading back of a launch's argument block
(:func:`launched_args`), for the unit tests of :mod:`flashgen.ops.decode.fast`."""

from __future__ import annotations

import ctypes
import types

import torch


def faked_fast_plan(monkeypatch, op, dims, splits: int = 1, driver=None):
    """``(plan, launches)``: a plan for ``dims`` whose fast path runs on CPU tensors, its
    kernels faked (CUfunction handles 11 and 12, attention and append), the current stream
    7.  ``launches``: what each ``cuLaunchKernel`` got, ``(function, grid, stream,
    params)``; ``driver``: a library standing in for the driver instead (its launches are not
    recorded)."""
    from flashgen.families import decode as family
    from flashgen.ops import calls as calls_mod
    from flashgen.ops.decode import fast as dfast
    from flashgen.ops.decode import op as dmod
    from flashgen.runtime import launch as runtime
    from flashgen.runtime import tma

    launches = []

    class Driver:
        @staticmethod
        def cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            launches.append((fn, (gx, gy, gz), stream, params))
            return 0

    monkeypatch.setattr(tma, "driver", lambda: Driver if driver is None else driver)
    monkeypatch.setattr(dfast, "_eager_cuda", dfast._plain_eager_fast)
    monkeypatch.setattr(dfast, "_GET_DEVICE", lambda: None)
    monkeypatch.setattr(calls_mod, "_RAW_STREAM", lambda index: 7)
    dop = dmod.decode_op(op)
    unit = family.plan(op.spec, "sm_90")
    kern = {r: runtime.LoadedKernel(plan=unit.kernel(r), module=None,
                                    function=types.SimpleNamespace(ptr=11 + i), device_index=0)
            for i, r in enumerate(("attn", "append"))}  # fmt: skip
    cpu = torch.device("cpu")
    plan = dop.plan_for(dims, cpu, splits)
    plan.kernels = kern
    if splits > 1:
        plan.o_part, plan.lse_part, plan.counters = dfast._workspace(
            dims, plan.geometry, splits, cpu
        )
    plan.fast = dfast._FastPath(dop, plan)
    return plan, launches


def launched_args(layout, params) -> dict:
    """The arguments of a launch by name: the block behind ``params`` (the array of argument
    addresses passed to ``cuLaunchKernel``) unpacked with ``layout``
    (:class:`flashgen.runtime.packed.ArgLayout`)."""
    base = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))[0]
    raw = ctypes.string_at(base, layout.size)
    return dict(zip(layout.names, layout.struct.unpack_from(raw, 0), strict=True))
