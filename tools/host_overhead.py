#!/usr/bin/env python3
"""Host cost of one flashgen forward call on the present GPU, with and without the
CUtensorMap descriptor cache, in one command (CUDA graphs off).

For ``causal_d128`` (bf16) at B=1, H=16 and each --seqlens, measures:

* host us/call: ``op.attention(q, k, v)`` called N times in a row while the stream is held
  busy by ``torch.cuda._sleep``, so every launch only queues and the wall time of the loop
  is the Python + driver work alone (checked: the stream is still busy after the loop);
* launch us/call: the same for ``kern.launch`` alone (runtime: descriptors + argument block
  + cuLaunchKernel), the rest of the call being validation, outputs and kernel_values;
* device us/call: CUDA events around N kernels queued back to back behind a sleep;
* eager us/call: N calls back to back with one sync at the end, what a benchmark loop sees
  (about max(host, device)); TFLOP/s = 4*B*H*S^2*D/2 over it, and over the device time.

Rows come for the descriptor cache on and off (``tma.descriptors.enabled``; the same as
``flashgen.runtime.tma.set_cache_enabled(False)``).  ``--baseline DIR`` runs the same measurement in
a child process with the flashgen package of another checkout (e.g. one at the commit before the
host-path work), so the before/after includes everything, not only the cache.

    python3 tools/host_overhead.py                     # ~30 s on an H200 once compiled
    python3 tools/host_overhead.py --baseline /path/to/old/checkout --json out.json
    python3 tools/host_overhead.py --cpu --baseline /path/to/old/checkout   # no GPU
    python3 tools/host_overhead.py --decode            # planned op.with_kvcache calls
    python3 tools/host_overhead.py --decode --cpu      # the same on CPU, driver faked

``--decode``: the host time of ``op.with_kvcache(..., plan=p)`` (llama3_gqa, bf16, Hq/Hkv
32/8, d128, Sq_new 1, B in --batch, a 64k paged-16 cache and a dense one; with k_new
appended too), measured as above with the stream held busy (GPU), or on CPU with the
driver, the device and the current stream faked (the planned fast path of
flashgen.ops.decode runs whole; its cuLaunchKernel is a C stub that returns 0, called
through ctypes with the driver's prototypes where there is a C compiler; ``--py-driver``: a
Python function, which leaves out ctypes' conversions).  Issue 23's target is 20 us
per call on the H200 machine's CPU.

``--decode --sink``: gpt_oss_sink's decode as ``flashgen bench --training`` times it (its
"gpt_oss_sink decode" row: B=8, Hq/Hkv 16/8, a dense 4096-key cache, d64, one query), with
the sink and with ``apply_sink=False``, planned (``plan=``) and unplanned; per call the host
us and the launches: the driver's (on CPU the faked one's count; on the GPU the profiler's
kernels) and the torch ops that would launch one.

    python3 tools/host_overhead.py --decode --sink --cpu   # no GPU

``--training``: the host time of one training step (``op.attention`` on bf16 q, k, v that
require grad, then ``torch.autograd.grad`` of o for them) with the spec's param detached and
requiring grad: alibi's slopes, t5_bias's bias table, gpt_oss_sink's sinks (``--specs``), at
``flashgen bench --training``'s B=2, H=16, S=4096 on the GPU (steps queued behind a sleep,
as above, and ``eager us``: a step's wall time back to back), or on CPU with the GPU faked
(``--cpu``: the driver, CuPy, device 0 as sm_90 and its stream; the operators' CPU kernels
are their CUDA ones, so a call that goes through the dispatcher launches as on the GPU; the
kernels planned, not compiled; S=128).  Per step also the launches and the autograd node of o
(the path the call took); ``--baseline DIR`` runs the same steps with another checkout.  On a
GPU whose kernel cache is empty the first step of each spec and case builds its kernels.

    python3 tools/host_overhead.py --training                        # GPU
    python3 tools/host_overhead.py --training --cpu --baseline /path/to/old/checkout
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _import_flashgen(root: Path):
    sys.path.insert(0, str(root))
    import flashgen

    got = Path(flashgen.__file__).resolve().parent.parent
    if got != root.resolve():
        raise SystemExit(f"imported flashgen from {got}, expected {root}")
    return flashgen


def _sleep_cycles(torch, ms: float) -> int:
    """``torch.cuda._sleep`` cycles for about ``ms`` milliseconds (calibrated once)."""
    n = 10_000_000
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(n)  # warm
    a.record()
    torch.cuda._sleep(n)
    b.record()
    torch.cuda.synchronize()
    return int(n * ms / max(a.elapsed_time(b), 1e-3))


def _queued_us(torch, fn, cycles: int, n: int, reps: int) -> tuple[list[float], bool]:
    """Wall us per call of ``n`` calls of ``fn`` queued behind a ``cycles`` sleep, one value
    per rep, and whether the sleep outlasted every loop (nothing waited on the device)."""
    out, busy = [], True
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        ev = torch.cuda.Event()
        ev.record()
        busy &= not ev.query()  # the sleep outlasted the loop: nothing waited
        out.append((t1 - t0) / n * 1e6)
    torch.cuda.synchronize()
    return out, busy


def _ops_module(name: str, flat: str):
    """``flashgen.ops.<name>``, or ``flashgen.ops.<flat>`` in a ``--baseline`` checkout from
    before ``flashgen/ops/`` was split into subpackages."""
    import importlib

    try:
        return importlib.import_module(f"flashgen.ops.{name}")
    except ModuleNotFoundError:
        return importlib.import_module(f"flashgen.ops.{flat}")


def measure(root: Path, seqlens, n: int, reps: int) -> list[dict]:
    """Rows of this process's flashgen (imported from ``root``)."""
    flashgen = _import_flashgen(root)
    import torch
    import torch.nn.functional as F

    from flashgen.ops import op as op_mod
    from flashgen.runtime import tma

    op = flashgen.load(root / "specs" / "causal_d128.yaml")
    dev = torch.device("cuda", torch.cuda.current_device())
    b, h, d = 1, 16, op.spec.head_dim
    cycles = _sleep_cycles(torch, 40.0)
    modes = ["cache on", "cache off"] if hasattr(tma, "descriptors") else ["baseline"]
    rows = []
    for s in seqlens:
        q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        o, _ = op.attention(q, k, v)  # build, load, warm
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        err = (o.float() - ref).abs().max().item()
        kern = op.kernel(dev)
        dims = op_mod.validate(op.spec, q, k, v, {})
        o, lse = op._empty_outputs(q, dims)
        scale = op_mod.default_softmax_scale(op.spec)
        values = op_mod.kernel_values(
            op.spec, {"q": q, "k": k, "v": v, "o": o, "lse": lse}, dims, scale, [], {}
        )
        grid = kern.plan.grid(b, h, s, heads_kv=h, seqlen_k=s)
        stream = torch.cuda.current_stream(dev).cuda_stream
        flops = 4.0 * b * h * s * s * d / 2
        for mode in modes:
            if mode != "baseline":
                tma.descriptors.enabled = mode == "cache on"

            def queued_us(fn):
                """Median over reps of the wall time per call of n calls behind a sleep."""
                out, busy = _queued_us(torch, fn, cycles, n, reps)
                return statistics.median(out), busy

            call = functools.partial(op.attention, q, k, v)
            launch = functools.partial(kern.launch, grid, values, stream)
            for _ in range(20):
                call()
                launch()
            host, busy1 = queued_us(call)
            launch_us, busy2 = queued_us(launch)
            # device: kernels back to back behind a sleep
            dev_us = []
            for _ in range(reps):
                torch.cuda.synchronize()
                torch.cuda._sleep(cycles)
                a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(n):
                    launch()
                z.record()
                torch.cuda.synchronize()
                dev_us.append(a.elapsed_time(z) * 1e3 / n)
            device = statistics.median(dev_us)
            # eager loop as a benchmark sees it
            eager = []
            for _ in range(reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(n):
                    call()
                torch.cuda.synchronize()
                eager.append((time.perf_counter() - t0) / n * 1e6)
            wall = statistics.median(eager)
            rows.append(
                dict(seqlen=s, mode=mode, host_us=host, launch_us=launch_us, device_us=device,
                     eager_us=wall, tflops_eager=flops / wall / 1e6,
                     tflops_device=flops / device / 1e6, host_only=busy1 and busy2,
                     max_err=err, flashgen=str(root))
            )  # fmt: skip
        if "cache on" in modes:
            tma.descriptors.enabled = True
    return rows


def measure_cpu(root: Path, seqlens, n: int, reps: int) -> list[dict]:
    """Rows of the Python host path alone, on a machine without a GPU: CPU tensors, the
    op's CUDA impl called directly, the driver (``cuTensorMapEncodeTiled`` writes nothing,
    ``cuLaunchKernel`` returns 0), CuPy and the current stream faked.  The fake encoder
    costs about nothing, so "cache off" understates what a real driver call adds."""
    import timeit
    import types

    flashgen = _import_flashgen(root)
    import torch

    from flashgen.families.registry import plan_forward
    from flashgen.ops import op as op_mod
    from flashgen.runtime import launch as runtime
    from flashgen.runtime import tma

    class Driver:
        @staticmethod
        def cuTensorMapEncodeTiled(*args):
            return 0

        @staticmethod
        def cuLaunchKernel(*args):
            return 0

    tma.driver = lambda: Driver
    cuda = types.SimpleNamespace(
        Device=lambda i: contextlib.nullcontext(),
        runtime=types.SimpleNamespace(getDevice=lambda: 0),
    )
    sys.modules["cupy"] = types.SimpleNamespace(cuda=cuda)
    torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(cuda_stream=0)
    op = flashgen.load(root / "specs" / "causal_d128.yaml")
    kern = runtime.LoadedKernel(
        plan=plan_forward(op.spec, "sm_90", op.options, persistent=False), module=None,
        function=types.SimpleNamespace(ptr=1), device_index=0,
    )  # fmt: skip

    class Loaded(dict):  # every kernel key finds `kern`: op.kernel's own lookup is measured
        def get(self, key, default=None):
            return kern

    op._kernels = Loaded()
    torch.cuda.current_device = lambda: 0
    modes = ["cache on", "cache off"] if hasattr(tma, "descriptors") else ["baseline"]
    b, h, d, rows = 1, 16, op.spec.head_dim, []
    for s in seqlens:
        q, k, v = (torch.randn(b, h, s, d, dtype=torch.bfloat16) for _ in range(3))
        dims = op_mod.validate(op.spec, q, k, v, {})
        o, lse = op._empty_outputs(q, dims)
        values = op_mod.kernel_values(
            op.spec, {"q": q, "k": k, "v": v, "o": o, "lse": lse}, dims, 0.088, [], {}
        )
        grid = kern.plan.grid(b, h, s, heads_kv=h, seqlen_k=s)
        for mode in modes:
            if mode != "baseline":
                tma.descriptors.enabled = mode == "cache on"

            def us(fn):
                fn()
                return min(timeit.repeat(fn, number=n, repeat=reps)) / n * 1e6

            rows.append(dict(
                seqlen=s, mode=mode, flashgen=str(root),
                cuda_impl_us=us(functools.partial(op._cuda_impl, q, k, v, 0.088)),
                launch_us=us(functools.partial(kern.launch, grid, values, 0)),
                validate_us=us(functools.partial(op_mod.validate, op.spec, q, k, v, {},
                                                 softmax_scale=0.088, scalars=[])),
                kernel_values_us=us(functools.partial(
                    op_mod.kernel_values, op.spec,
                    {"q": q, "k": k, "v": v, "o": o, "lse": lse}, dims, 0.088, [], {})),
            ))  # fmt: skip
        if "cache on" in modes:
            tma.descriptors.enabled = True
    return rows


def _decode_cases(torch, dev, batch: int):
    """(name, kwargs) of planned decode calls on ``dev``: paged 16 and dense, 64k keys, with
    and without an append, and with ``out=`` buffers (the cache is allocated small: host time
    does not depend on it)."""
    hq, hkv, d, cap = 32, 8, 128, 65536
    q = torch.randn(batch, hq, 1, d, device=dev, dtype=torch.bfloat16)
    lens = torch.full((batch,), 1000, dtype=torch.int32, device=dev)
    ps, pages = 16, 64
    kc = torch.zeros(pages, ps, hkv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    table = torch.zeros(batch, cap // ps, dtype=torch.int32, device=dev)
    dk = torch.zeros(batch, hkv, 2048, d, device=dev, dtype=torch.bfloat16)
    dv = torch.zeros_like(dk)
    kn = torch.zeros(batch, hkv, 1, d, device=dev, dtype=torch.bfloat16)
    vn = torch.zeros_like(kn)
    out = (torch.empty(batch, hq, 1, d, device=dev, dtype=torch.bfloat16),
           torch.empty(batch, hq, 1, device=dev, dtype=torch.float32))  # fmt: skip
    return [
        ("paged16", dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=lens, block_table=table),
         dict(cache_capacity=cap, page_size=ps, num_pages=pages)),
        ("paged16 out=", dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=lens, block_table=table,
                              out=out),
         dict(cache_capacity=cap, page_size=ps, num_pages=pages)),
        ("paged16+append", dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=lens,
                                block_table=table, k_new=kn, v_new=vn),
         dict(cache_capacity=cap, page_size=ps, num_pages=pages, append=True)),
        ("dense", dict(q=q, k_cache=dk, v_cache=dv, cache_seqlens=lens),
         dict(cache_capacity=2048)),
    ]  # fmt: skip


def measure_decode(root: Path, batches, n: int, reps: int) -> list[dict]:
    """Host us per planned ``with_kvcache`` call on the GPU, the stream held busy."""
    flashgen = _import_flashgen(root)
    import torch

    op = flashgen.load(root / "specs" / "llama3_gqa.yaml")
    dev = torch.device("cuda", torch.cuda.current_device())
    cycles = _sleep_cycles(torch, 40.0)
    rows = []
    for batch in batches:
        for name, kw, pk in _decode_cases(torch, dev, batch):
            plan = op.plan_decode(batch=batch, num_heads=32, num_heads_kv=8, device=dev, **pk)
            call = functools.partial(op.with_kvcache, plan=plan, **kw)
            for _ in range(20):
                call()
            out, busy = _queued_us(torch, call, cycles, n, reps)
            rows.append(dict(case=name, batch=batch, host_us=statistics.median(out),
                             host_only=busy, num_splits=plan.num_splits))  # fmt: skip
            if name == "paged16" and batch == batches[0]:
                _decode_parts(torch, plan, kw, cycles, n, rows, batch)
    return rows


def _decode_parts(torch, plan, kw, cycles: int, n: int, rows: list, batch: int) -> None:
    """Where a planned call's host time goes on this machine (stream held busy): the two
    output allocations alone (as the fast path allocates them), the attention kernel's bare
    ``cuLaunchKernel`` with the plan's packed block, and a cProfile of the planned calls
    (top entries, printed)."""
    import cProfile
    import io
    import pstats

    fast = plan.fast
    st = fast._state()
    q = kw["q"]
    # the packed block then points at buffers that stay alive (the bare launches write them)
    keep = (torch.empty(fast.o_shape, dtype=fast.o_dtype, device=q.device),
            torch.empty(fast.lse_shape, dtype=torch.float32, device=q.device))  # fmt: skip
    fast.dop.op.with_kvcache(plan=plan, out=keep, **kw)

    def empties():
        fast._alloc(st.o_shape, st.o_stride, fast.o_dtype)
        fast._alloc(st.lse_shape, st.lse_stride, torch.float32)

    stream = torch.cuda.current_stream().cuda_stream

    stream = getattr(fast, "_handle", int)(stream)  # as the fast path passes it

    def launch():
        fast._cu_launch(fast.attn_fn, *fast.attn_launch, stream, st.attn_params, None)

    for part, fn in (("2x alloc (o, lse)", empties), ("bare cuLaunchKernel", launch)):
        ts = []
        for _ in range(3):
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            ts.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
        rows.append(dict(case=f"part: {part}", batch=batch, host_us=statistics.median(ts),
                         host_only=True, num_splits=plan.num_splits))  # fmt: skip
    dmod = _ops_module("decode.op", "decode")

    op = fast.dop.op
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    prof.enable()
    for _ in range(n):
        op.with_kvcache(plan=plan, **kw)
    prof.disable()
    torch.cuda.synchronize()
    del keep
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
    print(f"cProfile of {n} planned paged16 calls (B{batch}; {dmod.__name__}):")
    print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[-2500:])


_STUB_SOURCE = """
static long launches;
long fg_stub_launches(void) { return launches; }
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned smem, void *stream, void **params, void **extra) {
  launches++;
  return 0;
}
int cuTensorMapEncodeTiled(void *map, int dtype, unsigned rank, void *addr, void *dims,
                           void *strides, void *box, void *elem, int a, int b, int c, int d) {
  return 0;
}
"""


def _stub_driver(tma):
    """A C library standing in for the driver (its entry points return 0; ``cuLaunchKernel``
    counts its calls, read by ``fg_stub_launches()``), with the prototypes ``tma.driver``
    sets on the real one (that function run against the stub), so that a call pays ctypes'
    conversions as on the GPU machine; None (the Python stand-in then) without a C
    compiler."""
    import ctypes
    import shutil
    import tempfile

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print("no C compiler: cuLaunchKernel is a Python function", file=sys.stderr)
        return None
    where = Path(tempfile.mkdtemp(prefix="fg-stub-driver-"))
    (where / "stub.c").write_text(_STUB_SOURCE)
    lib = where / "libstub.so"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(lib), str(where / "stub.c")],
                   check=True)  # fmt: skip
    real, ctypes.CDLL = ctypes.CDLL, lambda name, *a, **k: real(str(lib), *a, **k)
    try:
        return tma.driver.__wrapped__()  # the prototypes it sets, on the stub
    finally:
        ctypes.CDLL = real


def measure_decode_cpu(root: Path, batches, n: int, reps: int,
                       py_driver: bool = False) -> list[dict]:  # fmt: skip
    """Host us per planned ``with_kvcache`` call on CPU: CPU tensors, the plan's kernels
    faked (a CUfunction handle of 1), ``cuLaunchKernel`` a C function of a stub library
    that returns 0 (:func:`_stub_driver`; ``py_driver``: a Python function), the CUDA
    checks (device, current stream) answered as for device 0.  Everything else of the
    planned fast path runs: the layout check, the pointer packing, the output allocations,
    the ctypes call."""
    import timeit
    import types

    flashgen = _import_flashgen(root)
    import torch

    from flashgen.families import decode as family
    from flashgen.ops import calls as calls_mod
    dmod = _ops_module("decode.op", "decode")
    dfast = _ops_module("decode.fast", "decode_fast")
    from flashgen.runtime import launch as runtime
    from flashgen.runtime import tma

    class Driver:
        @staticmethod
        def cuLaunchKernel(*args):
            return 0

    stub = None if py_driver else _stub_driver(tma)
    tma.driver = (lambda: stub) if stub is not None else (lambda: Driver)
    dfast._eager_cuda = dfast._plain_eager_fast  # CPU tensors stand in (no is_cuda)
    dfast._GET_DEVICE = lambda: None
    calls_mod._RAW_STREAM = lambda index: 0
    op = flashgen.load(root / "specs" / "llama3_gqa.yaml")
    dop = dmod.decode_op(op)
    unit = family.plan(op.spec, "sm_90")
    kern = {r: runtime.LoadedKernel(plan=unit.kernel(r), module=None,
                                    function=types.SimpleNamespace(ptr=1), device_index=0)
            for r in ("attn", "append")}  # fmt: skip
    cpu = torch.device("cpu")
    rows = []
    for batch in batches:
        for name, kw, pk in _decode_cases(torch, cpu, batch):
            paged = "page_size" in pk
            dims = dmod.DecodeDims(
                batch, 32, 8, 1, 128, paged, pk.get("num_pages", batch), pk.get("page_size")
                or pk["cache_capacity"], pk["cache_capacity"] // pk.get("page_size", 1)
                if paged else 1, pk.get("append", False),
            )  # fmt: skip
            plan = dop.plan_for(dims, cpu, None)
            plan.kernels = kern
            if plan.num_splits > 1:
                plan.o_part, plan.lse_part, plan.counters = dfast._workspace(
                    dims, plan.geometry, plan.num_splits, cpu
                )
            plan.fast = dfast._FastPath(dop, plan)
            call = functools.partial(op.with_kvcache, plan=plan, **kw)
            took = plan.fast(kw["q"], kw["k_cache"], kw["v_cache"], kw["cache_seqlens"],
                             kw.get("block_table"), kw.get("k_new"), kw.get("v_new"), None,
                             {}, kw.get("out"))  # fmt: skip
            assert took is not None, "the fast path did not take the call"
            call()
            per = min(timeit.repeat(call, number=n, repeat=reps)) / n * 1e6
            rows.append(dict(case=name, batch=batch, host_us=per, host_only=True,
                             num_splits=plan.num_splits))  # fmt: skip
    return rows


# ----------------------------------------------------------------------------- --sink
#: gpt_oss_sink's decode as ``flashgen bench --training`` times it ("gpt_oss_sink decode":
#: B=8 requests, Hq/Hkv 16/8, a dense cache of 4096 keys, d64, bf16, one query each)
SINK_SHAPE = dict(batch=8, heads_q=16, heads_kv=8, capacity=4096, head_dim=64)

#: aten ops that launch no kernel on a GPU (metadata, allocation; ``to`` / ``contiguous``
#: without a copy have no ``copy_`` below them): every other leaf op of a call would
_NO_KERNEL = frozenset(f"aten::{n}" for n in (
    "empty", "empty_strided", "empty_like", "view", "_unsafe_view", "reshape", "_reshape_alias",
    "expand", "as_strided", "detach", "alias", "lift_fresh", "unsqueeze", "squeeze", "t",
    "transpose", "permute", "slice", "select", "to", "contiguous", "resolve_conj",
    "resolve_neg", "set_", "resize_", "split", "chunk", "unbind", "narrow", "size", "stride",
))  # fmt: skip


def _torch_launches(torch, call) -> list[str]:
    """The torch ops of one ``call()`` (run under the profiler, CPU activity) that would launch
    a kernel on a GPU: the leaf aten ops outside :data:`_NO_KERNEL` (on CPU tensors, so
    ``copy_`` / ``fill_`` / arithmetic stand for their CUDA kernels)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    return [e.name for e in prof.events()
            if e.name.startswith("aten::") and not any(c.name.startswith("aten::")
                                                       for c in e.cpu_children)
            and e.name not in _NO_KERNEL]  # fmt: skip


def _sink_tensors(torch, dev):
    """q, k_cache, v_cache, cache_seqlens and the float32 ``sinks [Hq]`` of :data:`SINK_SHAPE`
    on ``dev`` (the cache as the bench's: full)."""
    b, hq, hkv, cap, d = (SINK_SHAPE[k] for k in ("batch", "heads_q", "heads_kv", "capacity",
                                                   "head_dim"))  # fmt: skip
    q = torch.randn(b, hq, 1, d, device=dev).to(torch.bfloat16)
    kc = torch.zeros(b, hkv, cap, d, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    lens = torch.full((b,), cap, dtype=torch.int32, device=dev)
    sinks = torch.linspace(-1, 2, hq, device=dev)
    return q, kc, vc, lens, sinks


def _sink_calls(op, plan, q, kc, vc, lens, sinks):
    """``(case, call)``: planned and unplanned ``with_kvcache``, with the sink and without
    (``apply_sink=False``; the sinks passed either way, as the bench's rows)."""
    calls = []
    for planned in (True, False):
        for sink in (False, True):
            kw = dict(sinks=sinks, apply_sink=sink, plan=plan if planned else None)
            name = f"{'planned' if planned else 'unplanned'} {'sink' if sink else 'no sink'}"
            calls.append((name, functools.partial(op.with_kvcache, q, kc, vc, lens, **kw)))
    return calls


def measure_sink_cpu(root: Path, n: int, reps: int, py_driver: bool = False,
                     clock=time.thread_time) -> list[dict]:  # fmt: skip
    """gpt_oss_sink's decode (:data:`SINK_SHAPE`) on CPU, the driver faked as in
    :func:`measure_decode_cpu`: host us per ``with_kvcache`` call with and without the sink,
    planned (the fast path) and unplanned (the general path's direct launch: its eager-CUDA
    test, ``flashgen.ops.decode.op._direct_cuda``, passed for CPU tensors; the unit's kernels
    faked in the op's unit cache for device 0, found by ``plan_for`` given ``cuda:0``; CuPy's
    launch a Python function; 132 SMs as an H100's), and the launches per call: the faked
    driver's and CuPy's (``launches``) and the torch ops that would launch a kernel on a GPU
    (``torch_ops``, :func:`_torch_launches`).  Interleaved rounds, the best of ``reps``, on
    ``clock``: by default the calling thread's CPU time (``time.thread_time``), which the
    other work of a loaded machine does not inflate (``time.perf_counter``: the wall time)."""
    import contextlib
    import timeit
    import types

    flashgen = _import_flashgen(root)
    import torch

    from flashgen.families import decode as family
    from flashgen.ops import calls as calls_mod
    from flashgen.ops.decode import fast as dfast
    from flashgen.ops.decode import op as dmod
    from flashgen.ops.decode import planning as dplan
    from flashgen.runtime import launch as runtime
    from flashgen.runtime import tma

    count = [0]

    class Driver:
        @staticmethod
        def cuLaunchKernel(*args):
            count[0] += 1
            return 0

    stub = None if py_driver else _stub_driver(tma)
    tma.driver = (lambda: stub) if stub is not None else (lambda: Driver)
    if stub is not None:
        import ctypes

        stub.fg_stub_launches.restype = ctypes.c_long

    def driver_launches() -> int:
        return count[0] + (stub.fg_stub_launches() if stub is not None else 0)

    def cupy_launch(*args, **kwargs):  # LoadedKernel.launch's CuPy call (kernels without TMA)
        count[0] += 1

    cupy_launch.ptr = 1
    cuda = types.SimpleNamespace(
        Device=lambda i: contextlib.nullcontext(),
        ExternalStream=lambda ptr, index: contextlib.nullcontext(),
        runtime=types.SimpleNamespace(getDevice=lambda: 0),
    )  # fmt: skip
    sys.modules["cupy"] = types.SimpleNamespace(cuda=cuda)
    dfast._eager_cuda = dfast._plain_eager_fast  # CPU tensors stand in (no is_cuda)
    dfast._GET_DEVICE = lambda: None
    calls_mod._RAW_STREAM = lambda index: 0
    dmod._direct_cuda = lambda q, kc, vc: calls_mod._plain_eager(q, kc, vc)
    dmod.current_stream_ptr = lambda device: 0
    dplan._sm_count = lambda index: 132
    op = flashgen.load(root / "specs" / "gpt_oss_sink.yaml")
    dop = dmod.decode_op(op)
    unit = family.plan(op.spec, "sm_90")
    kern = {r: runtime.LoadedKernel(plan=unit.kernel(r), module=None, function=cupy_launch,
                                    device_index=0)
            for r in ("attn", "append")}  # fmt: skip
    dop._units[(0, op.options.decode.unit_key())] = kern  # plan_for's lookup for cuda:0
    plan_for, gpu = dop.plan_for, torch.device("cuda", 0)
    dop.plan_for = lambda dims, device, *a, **k: plan_for(dims, gpu, *a, **k)
    cpu = torch.device("cpu")
    sh = SINK_SHAPE
    dims = dmod.DecodeDims(sh["batch"], sh["heads_q"], sh["heads_kv"], 1, sh["head_dim"], False,
                           sh["batch"], sh["capacity"], 1, False)  # fmt: skip
    plan = plan_for(dims, cpu, None)
    plan.kernels = kern
    if plan.num_splits > 1:
        plan.o_part, plan.lse_part, plan.counters = dfast._workspace(
            dims, plan.geometry, plan.num_splits, cpu
        )
    plan.fast = dfast._FastPath(dop, plan)
    q, kc, vc, lens, sinks = _sink_tensors(torch, cpu)
    calls = _sink_calls(op, plan, q, kc, vc, lens, sinks)
    rows = {}
    for name, call in calls:
        call()
        before = driver_launches()
        call()
        rows[name] = dict(case=name, launches=driver_launches() - before,
                          torch_ops=_torch_launches(torch, call), times=[])  # fmt: skip
        # the planned calls must take the fast path: the general one would refuse nothing
        # here but time something else
        if name.startswith("planned"):
            took = plan.fast(q, kc, vc, lens, None, None, None, None, {"sinks": sinks},
                             join_sink=name.endswith(" sink"))  # fmt: skip
            assert took is not None, f"{name}: the fast path did not take the call"
    for _ in range(reps):  # interleaved: a noisy machine slows every case alike
        for name, call in calls:
            rows[name]["times"].append(timeit.timeit(call, timer=clock, number=n) / n * 1e6)
    out = []
    for r in rows.values():
        times = r.pop("times")
        out.append(dict(r, host_us=min(times), median_us=statistics.median(times),
                        num_splits=plan.num_splits))  # fmt: skip
    return out


def measure_sink(root: Path, n: int, reps: int) -> list[dict]:
    """:func:`measure_sink_cpu`'s calls on the GPU: host us per call with the stream held
    busy (as :func:`measure_decode`), and the kernels per call as the profiler's CUDA
    activity sees them (``launches``; ``torch_ops`` as on CPU)."""
    flashgen = _import_flashgen(root)
    import torch
    from torch.profiler import ProfilerActivity, profile

    op = flashgen.load(root / "specs" / "gpt_oss_sink.yaml")
    dev = torch.device("cuda", torch.cuda.current_device())
    sh = SINK_SHAPE
    plan = op.plan_decode(batch=sh["batch"], num_heads=sh["heads_q"],
                          num_heads_kv=sh["heads_kv"], cache_capacity=sh["capacity"],
                          device=dev)  # fmt: skip
    q, kc, vc, lens, sinks = _sink_tensors(torch, dev)
    cycles = _sleep_cycles(torch, 40.0)
    rows = []
    for name, call in _sink_calls(op, plan, q, kc, vc, lens, sinks):
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        kernels = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
        times, busy = _queued_us(torch, call, cycles, n, reps)
        rows.append(dict(case=name, launches=kernels, torch_ops=_torch_launches(torch, call),
                         host_us=min(times), median_us=statistics.median(times),
                         host_only=busy, num_splits=plan.num_splits))  # fmt: skip
    return rows


# ----------------------------------------------------------------------------- --training
#: The trained-param rows of ``flashgen bench --training`` (its shape on the GPU: B=2, H=16,
#: S=4096): spec, the param that is detached in one case and requires grad in the other, and
#: how its value is made from the heads.
TRAIN_SPECS = {
    "alibi": ("slopes", lambda torch, h, dev: torch.linspace(0.01, 0.5, h, device=dev)),
    "t5_bias": ("bias", lambda torch, h, dev: torch.linspace(-1, 1, h * 257, device=dev)
                .view(h, 257)),
    "gpt_oss_sink": ("sinks", lambda torch, h, dev: torch.linspace(-1, 2, h, device=dev)),
}  # fmt: skip
TRAIN_SHAPE = dict(batch=2, heads=16, seqlen=4096)
#: The sequence length of a CPU run: the host path does not depend on it, but the torch ops
#: of a step (the backward's zeroed buffers, autograd's zero gradient of lse) compute on CPU.
TRAIN_CPU_SEQLEN = 128


def _training_steps(torch, flashgen, root: Path, dev, seqlen: int, specs) -> list:
    """``(spec, case, step)`` per spec of ``specs`` (keys of :data:`TRAIN_SPECS`) and case
    (``detached``: the param without grad; ``trained``: a copy that requires grad): one
    training step of ``op.attention`` on bf16 q, k, v that require grad, ``step()`` ->
    ``(o, gradients)``: the forward, then ``torch.autograd.grad`` of o (upstream dO) for q,
    k, v and, trained, the param (leaves' ``.grad`` untouched: no accumulation between
    steps)."""
    b, h = TRAIN_SHAPE["batch"], TRAIN_SHAPE["heads"]
    g = torch.Generator(device=dev).manual_seed(0)
    out = []
    for name in specs:
        pname, make = TRAIN_SPECS[name]
        op = flashgen.load(root / "specs" / f"{name}.yaml")
        d, dv = op.spec.head_dim, op.spec.head_dim_v
        q, k, v = (torch.randn(b, h, seqlen, x, device=dev, generator=g).to(torch.bfloat16)
                   .requires_grad_() for x in (d, d, dv))  # fmt: skip
        do = torch.randn(b, h, seqlen, dv, device=dev, generator=g).to(torch.bfloat16)
        value = make(torch, h, dev)
        for case, param in (("detached", value), ("trained", value.clone().requires_grad_())):
            leaves = (q, k, v, param) if param.requires_grad else (q, k, v)
            step = functools.partial(_train_step, torch, op, do, {pname: param}, leaves)
            out.append((name, case, step))
    return out


def _train_step(torch, op, do, kw: dict, leaves: tuple):
    """One step of :func:`_training_steps`: ``(o, gradients of leaves)``."""
    o = op.attention(*leaves[:3], **kw)[0]
    return o, torch.autograd.grad(o, leaves, do)


def _node(o) -> str:
    """The autograd node a step's o hangs from: which path the call took
    (``_EagerAttentionBackward``, ``FusedSinkAttentionBackward``: the eager fast path's;
    the operator's autograd otherwise)."""
    return type(o.grad_fn).__name__


def _fake_cuda_training(torch, count: list, py_driver: bool) -> None:
    """Fake the GPU for :func:`measure_training_cpu`, process-wide, before any op is loaded:
    the driver (:func:`_stub_driver`, or a Python ``cuLaunchKernel`` that counts into
    ``count``), CuPy, device 0 of compute capability 9.0 and its current stream; the
    operators' CPU kernels are their CUDA ones (so the dispatcher path launches as on a GPU),
    the eager fast path's device test passes CPU tensors, and the kernels are planned but not
    compiled (``build_forward`` / ``build_backward`` give the plan; ``runtime.load`` a kernel
    whose CuPy launch counts into ``count``); a persistent forward sees 132 SMs and gets its
    tile counter from a fake ``device_zeros``."""
    import types

    from flashgen.families import build as fbuild
    from flashgen.families import registry
    from flashgen.ops import calls as calls_mod
    from flashgen.ops.prefill import attention as amod
    from flashgen.ops.prefill import backward as bmod
    from flashgen.runtime import launch as runtime
    from flashgen.runtime import tma

    class Driver:
        @staticmethod
        def cuLaunchKernel(*args):
            count[0] += 1
            return 0

        @staticmethod
        def cuTensorMapEncodeTiled(*args):
            return 0

    stub = None if py_driver else _stub_driver(tma)
    if stub is not None:
        import ctypes

        stub.fg_stub_launches.restype = ctypes.c_long
        count.append(stub.fg_stub_launches)
    tma.driver = (lambda: stub) if stub is not None else (lambda: Driver)

    def cupy_launch(*args, **kwargs):  # LoadedKernel.launch's CuPy call (kernels without TMA)
        count[0] += 1

    cupy_launch.ptr = 1
    cuda = types.SimpleNamespace(
        Device=lambda i: contextlib.nullcontext(),
        ExternalStream=lambda ptr, index: contextlib.nullcontext(),
        runtime=types.SimpleNamespace(getDevice=lambda: 0),
    )  # fmt: skip
    sys.modules["cupy"] = types.SimpleNamespace(cuda=cuda)
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_name = lambda device=None: "NVIDIA H100 80GB HBM3"
    torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(cuda_stream=0)
    torch.cuda.device = lambda index: contextlib.nullcontext()  # the tile counter's
    torch.cuda.is_current_stream_capturing = lambda: False
    calls_mod._RAW_STREAM = lambda index: 0
    amod._sm_count = lambda index: 132  # an H100's SMs: a persistent kernel's grid
    runtime.device_zeros = lambda nbytes, index, stream: 256  # its tile counter
    amod._eager_cuda = lambda q, k, v: calls_mod._plain_eager(q, k, v)
    amod.AttentionOp._cpu_impl = amod.AttentionOp._cuda_impl
    bmod.Backward.cpu = bmod.Backward.cuda
    bmod.Backward.cpu_sink = bmod.Backward.cuda_sink

    def build_forward(spec, target, gpu=None, options=None, persistent=False, sparse=False,
                      block_descale=False):  # fmt: skip
        return registry.plan_forward(spec, target, options, gpu=gpu, persistent=persistent,
                                     block_descale=block_descale), None, None  # fmt: skip

    def build_backward(spec, target, *, atomic_dq=False, hopper=False, ordered_dq=False,
                       options=None, param_grads=(), sink=False):  # fmt: skip
        if hopper:
            plan = registry.plan_hopper_backward(spec, target, options, ordered_dq=ordered_dq,
                                                 param_grads=param_grads, sink=sink)  # fmt: skip
        else:
            plan = registry.plan_backward(spec, target, options, atomic_dq=atomic_dq,
                                          param_grads=param_grads, sink=sink)  # fmt: skip
        return plan, None, None

    fbuild.build_forward, fbuild.build_backward = build_forward, build_backward
    runtime.load = lambda cubin, plan, index: runtime.LoadedKernel(
        plan=plan, module=None, function=cupy_launch, device_index=index
    )


def _launches(count: list) -> int:
    """Launches so far: the Python ones and the C stub's."""
    return count[0] + sum(f() for f in count[1:])


def measure_training_cpu(
    root: Path, n: int, reps: int, specs=tuple(TRAIN_SPECS), py_driver: bool = False,
    clock=time.thread_time,
) -> list[dict]:  # fmt: skip
    """Host us per training step (:func:`_training_steps`, S = :data:`TRAIN_CPU_SEQLEN`) on
    CPU with the GPU faked (:func:`_fake_cuda_training`): every Python step of the forward,
    the autograd node and the backward runs (the eager fast path where the call takes it,
    else the dispatcher and the custom op's autograd), the kernels' launches are stubs.
    Per case the best of ``reps`` interleaved rounds of ``n`` steps on ``clock`` (the calling
    thread's CPU time by default; the CPU autograd engine runs the backward on it), the
    launches per step and the autograd node of o (:func:`_node`)."""
    import timeit

    flashgen = _import_flashgen(root)
    import torch

    count = [0]
    _fake_cuda_training(torch, count, py_driver)
    steps = _training_steps(torch, flashgen, root, torch.device("cpu"), TRAIN_CPU_SEQLEN, specs)
    rows = {}
    for name, case, step in steps:
        step()
        before = _launches(count)
        o, _ = step()
        rows[(name, case)] = dict(spec=name, case=case, launches=_launches(count) - before,
                                  node=_node(o), seqlen=TRAIN_CPU_SEQLEN, times=[])  # fmt: skip
    for _ in range(reps):  # interleaved: a noisy machine slows every case alike
        for name, case, step in steps:
            rows[(name, case)]["times"].append(timeit.timeit(step, timer=clock, number=n) / n
                                               * 1e6)  # fmt: skip
    out = []
    for r in rows.values():
        times = r.pop("times")
        out.append(dict(r, host_us=min(times), median_us=statistics.median(times),
                        host_only=True, flashgen=str(root)))  # fmt: skip
    return out


def measure_training(root: Path, n: int, reps: int, specs=tuple(TRAIN_SPECS)) -> list[dict]:
    """:func:`measure_training_cpu`'s steps on the GPU at :data:`TRAIN_SHAPE`: host us per step
    with the stream held busy (:func:`_queued_us`, a sleep of at least 5 ms per step; the
    CUDA autograd engine runs the backward on its device thread, whose time counts as the
    wait for it does), the kernels per step (the profiler's CUDA activity), the autograd node
    of o, and ``eager_us``: a step's wall time in ``n`` steps back to back then one sync (what
    ``flashgen bench --training`` sees, about max(host, device))."""
    flashgen = _import_flashgen(root)
    import torch
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda", torch.cuda.current_device())
    steps = _training_steps(torch, flashgen, root, dev, TRAIN_SHAPE["seqlen"], specs)
    cycles = _sleep_cycles(torch, max(40.0, 5.0 * n))
    rows = []
    for name, case, step in steps:
        for _ in range(3):  # build, load, warm
            o, _ = step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        kernels = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
        times, busy = _queued_us(torch, step, cycles, n, reps)
        eager = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            torch.cuda.synchronize()
            eager.append((time.perf_counter() - t0) / n * 1e6)
        rows.append(dict(spec=name, case=case, launches=kernels, node=_node(o),
                         seqlen=TRAIN_SHAPE["seqlen"], host_us=min(times),
                         median_us=statistics.median(times), host_only=busy,
                         eager_us=statistics.median(eager), flashgen=str(root)))  # fmt: skip
    return rows


def print_training_rows(rows: list[dict], where: str) -> None:
    """One line per (checkout, spec, case), then each checkout's trained/detached ratios."""
    sh = TRAIN_SHAPE
    s = rows[0]["seqlen"] if rows else sh["seqlen"]
    print(f"training step host time ({where}): op.attention + torch.autograd.grad, bf16 "
          f"B={sh['batch']} H={sh['heads']} S={s}")  # fmt: skip
    eager = any("eager_us" in r for r in rows)
    print(f"{'checkout':>9} {'spec':>13} {'case':>9} | {'host us/step':>12} {'median':>7} | "
          f"{'launches':>8}{' | eager us' if eager else ''} | node")  # fmt: skip
    ratios = {}
    for r in rows:
        tag = "baseline" if r.get("baseline") else "this"
        warn = "" if r.get("host_only", True) else "  (queue drained: includes waits)"
        wall = f" | {r['eager_us']:8.1f}" if eager else ""
        print(f"{tag:>9} {r['spec']:>13} {r['case']:>9} | {r['host_us']:12.1f} "
              f"{r['median_us']:7.1f} | {r['launches']:8d}{wall} | {r['node']}{warn}")  # fmt: skip
        ratios.setdefault((tag, r["spec"]), {})[r["case"]] = r["host_us"]
    for (tag, spec), by in ratios.items():
        if "detached" in by and "trained" in by:
            print(f"{tag:>9} {spec:>13} trained / detached host time: "
                  f"{by['trained'] / by['detached']:.2f}x")  # fmt: skip


def print_sink_rows(rows: list[dict], where: str) -> None:
    sh = SINK_SHAPE
    print(f"gpt_oss_sink op.with_kvcache host time ({where}): B={sh['batch']} Hq/Hkv "
          f"{sh['heads_q']}/{sh['heads_kv']} cache {sh['capacity']} d{sh['head_dim']} bf16, "
          f"one query; splits {rows[0]['num_splits']}")  # fmt: skip
    print(f"{'case':>17} | {'host us/call':>12} {'median':>7} | {'launches':>8} | torch ops "
          "that launch")  # fmt: skip
    for r in rows:
        warn = "" if r.get("host_only", True) else "  (queue drained: includes waits)"
        ops = ", ".join(r["torch_ops"]) or "-"
        print(f"{r['case']:>17} | {r['host_us']:12.1f} {r['median_us']:7.1f} | "
              f"{r['launches']:8d} | {ops}{warn}")  # fmt: skip


def print_decode_rows(rows: list[dict], where: str) -> None:
    print(f"planned op.with_kvcache host time ({where}), llama3_gqa bf16 Hq/Hkv 32/8 d128")
    print(f"{'case':>15} {'B':>4} {'splits':>6} | {'host us/call':>12}")
    for r in rows:
        warn = "" if r["host_only"] else "  (queue drained: includes waits)"
        print(f"{r['case']:>15} {r['batch']:4d} {r['num_splits']:6d} | {r['host_us']:12.1f}{warn}")


def print_cpu_rows(rows: list[dict]) -> None:
    print(f"{'checkout':>9} {'mode':>9} {'S':>5} | {'cuda impl us':>12} {'launch us':>9} "
          f"{'validate us':>11} {'kernel_values us':>16}")  # fmt: skip
    for r in rows:
        tag = "baseline" if r["mode"] == "baseline" or r.get("baseline") else "this"
        print(
            f"{tag:>9} {r['mode']:>9} {r['seqlen']:5d} | {r['cuda_impl_us']:12.1f} "
            f"{r['launch_us']:9.1f} {r['validate_us']:11.1f} {r['kernel_values_us']:16.1f}"
        )


def print_rows(rows: list[dict]) -> None:
    print(
        f"{'checkout':>9} {'mode':>9} {'S':>5} | {'host us':>8} {'launch us':>9} "
        f"{'device us':>9} {'eager us':>8} | {'TFLOP/s eager':>13} {'device':>7} | max err"
    )
    for r in rows:
        tag = "baseline" if r["mode"] == "baseline" or r.get("baseline") else "this"
        warn = "" if r["host_only"] else "  (queue drained: host times include waits)"
        print(
            f"{tag:>9} {r['mode']:>9} {r['seqlen']:5d} | {r['host_us']:8.1f} "
            f"{r['launch_us']:9.1f} {r['device_us']:9.1f} {r['eager_us']:8.1f} | "
            f"{r['tflops_eager']:13.1f} {r['tflops_device']:7.1f} | {r['max_err']:.1e}{warn}"
        )


def _main_training(args, torch) -> int:
    """``--training`` (``--baseline`` too: the same steps with another checkout's flashgen,
    in a child process)."""
    if not args.cpu and not torch.cuda.is_available():
        print("host_overhead.py --training needs a CUDA GPU (or --cpu)", file=sys.stderr)
        return 2
    rows = []
    if args.baseline is not None:
        cmd = [sys.executable, __file__, "--training", "--flashgen", str(args.baseline.resolve()),
               "--rows-only", "-n", str(args.n), "--reps", str(args.reps), "--specs",
               *args.specs, *(["--cpu"] if args.cpu else []),
               *(["--py-driver"] if args.py_driver else [])]  # fmt: skip
        rows += [{**r, "baseline": True} for r in _child_rows(cmd)]
    if args.cpu:
        rows += measure_training_cpu(args.flashgen, args.n, args.reps, args.specs,
                                     args.py_driver)  # fmt: skip
        where = "CPU, driver faked" + (" (Python)" if args.py_driver else "")
    else:
        rows += measure_training(args.flashgen, args.n, args.reps, args.specs)
        where = torch.cuda.get_device_name()
    if args.rows_only:
        print(json.dumps(rows))
        return 0
    print_training_rows(rows, where)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def _child_rows(cmd: list[str]) -> list[dict]:
    """The rows a ``--rows-only`` child prints last (``--baseline``), or none (and its error
    printed) if it failed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if res.returncode != 0:
        print(f"baseline run failed:\n{res.stderr[-3000:]}", file=sys.stderr)
        return []
    return json.loads(res.stdout.strip().splitlines()[-1])


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, by ``ap.error`` (exit 2, before torch is imported or anything is measured),
    arguments the run would not honour: an ``-n`` / ``--reps`` below 1 (a division by zero,
    ``min()`` of no times, negative times), a ``--seqlens`` / ``--batch`` value below 1,
    ``--specs`` without ``--training``, ``--sink`` without ``--decode``, ``--training`` with
    ``--decode``, and a ``--baseline`` that is no flashgen checkout (its child run failed and
    the table came without it).  Each message names the argument and the value received."""
    for name, value in (("-n", args.n), ("--reps", args.reps)):
        if value is not None and value < 1:
            ap.error(f"{name}: expected a positive int, got {value}")
    for name, values in (("--seqlens", args.seqlens), ("--batch", args.batch)):
        if any(x < 1 for x in values):
            ap.error(f"{name}: expected positive ints, got {values}")
    if args.training and args.decode:
        ap.error("--training and --decode: expected one of them, got both")
    if args.specs is not None and not args.training:
        ap.error(f"--specs: only with --training (the specs it times), got --specs "
                 f"{' '.join(args.specs)} without it")  # fmt: skip
    if args.sink and not args.decode:
        ap.error("--sink: only with --decode (gpt_oss_sink's decode), got --sink without it")
    if args.baseline is not None and not (args.baseline / "flashgen" / "__init__.py").is_file():
        ap.error(f"--baseline: expected a flashgen checkout (a directory holding "
                 f"flashgen/__init__.py), got {args.baseline}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("-n", type=int, default=None,
                    help="calls per timed loop (default 200; --training: 20 steps on the GPU, "
                    "50 with --cpu)")  # fmt: skip
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--baseline", type=Path, help="another checkout to measure the same way")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--flashgen", type=Path, default=REPO, help=argparse.SUPPRESS)
    ap.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="time the Python host path on CPU with a fake driver (no GPU needed)",
    )
    ap.add_argument("--decode", action="store_true",
                    help="planned op.with_kvcache calls instead of op.attention")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64],
                    help="--decode batch sizes")  # fmt: skip
    ap.add_argument("--py-driver", action="store_true",
                    help="--decode / --training with --cpu: a Python cuLaunchKernel (no C "
                    "stub)")  # fmt: skip
    ap.add_argument("--sink", action="store_true",
                    help="--decode: gpt_oss_sink's decode (the bench's row) with and without "
                    "the sink, planned and unplanned, and launches per call")  # fmt: skip
    ap.add_argument("--training", action="store_true",
                    help="one forward + backward step, the param detached vs requiring grad "
                    "(alibi, t5_bias, gpt_oss_sink)")  # fmt: skip
    ap.add_argument("--specs", nargs="+", choices=list(TRAIN_SPECS), default=None,
                    help="--training: the specs to measure (default: all)")  # fmt: skip
    args = ap.parse_args()
    _check_args(ap, args)
    if args.specs is None:
        args.specs = list(TRAIN_SPECS)
    if args.n is None:
        args.n = (50 if args.cpu else 20) if args.training else 200
    import torch

    if args.training:
        return _main_training(args, torch)

    if args.decode and args.sink:
        if not args.cpu and not torch.cuda.is_available():
            print("host_overhead.py --decode --sink needs a CUDA GPU (or --cpu)", file=sys.stderr)
            return 2
        if args.cpu:
            rows = measure_sink_cpu(args.flashgen, args.n, args.reps, args.py_driver)
            where = "CPU, driver faked" + (" (Python)" if args.py_driver else "")
        else:
            rows = measure_sink(args.flashgen, args.n, args.reps)
            where = torch.cuda.get_device_name()
        print_sink_rows(rows, where)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
    if args.decode:
        if not args.cpu and not torch.cuda.is_available():
            print("host_overhead.py --decode needs a CUDA GPU (or --cpu)", file=sys.stderr)
            return 2
        if args.cpu:
            rows = measure_decode_cpu(args.flashgen, args.batch, args.n, args.reps,
                                      args.py_driver)  # fmt: skip
            where = "CPU, driver faked" + (" (Python)" if args.py_driver else "")
        else:
            rows = measure_decode(args.flashgen, args.batch, args.n, args.reps)
            where = torch.cuda.get_device_name()
        print_decode_rows(rows, where)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0

    if not args.cpu and not torch.cuda.is_available():
        print("host_overhead.py needs a CUDA GPU (or --cpu)", file=sys.stderr)
        return 2
    rows = []
    if args.baseline is not None:
        cmd = [sys.executable, __file__, "--flashgen", str(args.baseline.resolve()),
               "--rows-only", "-n", str(args.n), "--reps", str(args.reps),
               "--seqlens", *map(str, args.seqlens), *(["--cpu"] if args.cpu else [])]  # fmt: skip
        rows += [{**r, "baseline": True} for r in _child_rows(cmd)]
    rows += (measure_cpu if args.cpu else measure)(args.flashgen, args.seqlens, args.n, args.reps)
    if args.rows_only:
        print(json.dumps(rows))
        return 0
    if args.cpu:
        print(f"CPU (fake driver), causal_d128 bf16, B=1 H=16, best of {args.reps} x {args.n}")
        print_cpu_rows(rows)
    else:
        print(f"{torch.cuda.get_device_name()}, causal_d128 bf16, B=1 H=16, n={args.n}")
        print_rows(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
