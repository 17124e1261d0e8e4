"""Timing on the device, and the facts of the device the times come from.

:func:`do_bench_ms` (``triton.testing.do_bench`` median, L2 flushed between calls; CUDA
events without triton), :func:`capture_graph` / :func:`graph_replay_ms` (device time per
call from CUDA-graph replays: no host work, no L2 flush),
:func:`alternate` (the alternating rounds that ``flashgen bench --rounds`` and
``flashgen ab`` time their candidates in), :func:`environment` (versions, GPU, clocks).
Times are in milliseconds.  torch is imported inside the functions.
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence

from flashgen.version import __version__


def nvidia_smi() -> dict:
    """GPU facts from ``nvidia-smi --query-gpu`` (clocks in MHz, power in W); {} if absent."""
    fields = (
        "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,"
        "power.limit,temperature.gpu,memory.total"
    )
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    line = out.strip().splitlines()[0] if out.strip() else ""
    vals = [v.strip() for v in line.split(",")]
    names = fields.split(",")
    return dict(zip(names, vals, strict=False)) if len(vals) == len(names) else {}


def environment() -> dict:
    """Versions and device facts recorded in ``results.json``."""
    import torch

    env = {
        "flashgen": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        # which flashgen kernel family the rows time (Options.family of the loaded ops: on
        # sm_90, auto = the Hopper kernel where eligible, fa2 = the FA2-class kernel everywhere)
        "kernel_family": "auto",
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import cupy

        env["cupy"] = cupy.__version__
    except ImportError:
        env["cupy"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = torch.cuda.get_device_name(0)
        env["capability"] = f"{p.major}.{p.minor}"
        env["sm_count"] = p.multi_processor_count
        env["gpu_memory_bytes"] = p.total_memory
    env["nvidia_smi"] = nvidia_smi()
    try:
        from flashgen.build.compile import nvcc_version

        env["nvcc"] = nvcc_version()
    except Exception:  # noqa: BLE001 - informational only
        env["nvcc"] = None
    return env


def do_bench_ms(fn: Callable[[], object], warmup_ms: int, rep_ms: int) -> float:
    """Median milliseconds of ``fn``: ``triton.testing.do_bench`` (which also flushes L2
    between calls), or CUDA events around each call when triton is missing."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = max(1e-3, (time.perf_counter() - t0) * 1e3)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    times = []
    for _ in range(max(3, int(rep_ms / est))):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def capture_graph(call: Callable[[], object], reps: int = 10):
    """A ``torch.cuda.CUDAGraph`` of ``reps`` calls of ``call``, warmed up (3 calls) on the
    capture stream first and replayed once.  Raises what capture raises."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on the capture stream
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for _ in range(reps):
            call()
    g.replay()
    torch.cuda.synchronize()
    return g


def graph_replay_ms(g, reps: int = 10, iters: int = 5) -> float:
    """Device time per call (ms): the median over ``iters`` replays of ``g`` (a graph of
    ``reps`` calls, :func:`capture_graph`), CUDA events around each replay (no host work, no
    L2 flush between calls)."""
    import torch

    out = []
    for _ in range(iters):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        g.replay()
        t1.record()
        torch.cuda.synchronize()
        out.append(t0.elapsed_time(t1) / reps)
    return statistics.median(out)


def round_order(n: int, r: int) -> Sequence[int]:
    """Indices of ``n`` candidates in round ``r``: forward in even rounds, backward in odd
    ones (A B C, C B A, A B C, ...), so that each candidate's mean position is the same."""
    return range(n) if r % 2 == 0 else range(n - 1, -1, -1)


def alternate(
    measure: Callable[[int], float], n: int, rounds: int, settle: bool = True
) -> tuple[list[list[float]], dict[int, BaseException]]:
    """Measure ``n`` candidates in ``rounds`` alternating rounds (:func:`round_order`).

    ``measure(i)`` times candidate ``i`` once (ms).  Returns each candidate's samples, in
    round order, and the exception of each candidate that raised: it is skipped in later
    rounds, the others go on.  With ``settle`` and more than one round, candidate 0 is
    measured once untimed first: a GPU that idled while the inputs were made runs at a
    boosted clock for its first ~100 ms of load (then at its power limit), which would
    favour whichever candidate came first.  The caller takes the medians
    (``statistics.median``), so a slow drift of the clock reaches every candidate alike.
    """
    samples: list[list[float]] = [[] for _ in range(n)]
    failed: dict[int, BaseException] = {}
    if settle and rounds > 1 and n:
        try:
            measure(0)
        except Exception:  # noqa: BLE001, S110 - its own round reports the failure
            pass
    for r in range(rounds):
        for i in round_order(n, r):
            if i in failed:
                continue
            try:
                samples[i].append(measure(i))
            except Exception as e:  # noqa: BLE001 - recorded per candidate
                failed[i] = e
    return samples, failed


def median_or_none(xs: Sequence[float]) -> float | None:
    """The median of ``xs`` without its NaNs, or None when nothing is left."""
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else None


def measure_ceilings(device) -> dict:
    """The two ceilings a run is read against, on ``device``: ``matmul_bf16_tflops`` (a bf16
    8192^3 matmul, ``matmul_ms`` its time) and ``copy_gbps`` (a device-to-device copy of
    ``copy_bytes`` = 2 GiB, read + written bytes per second)."""
    import torch

    out = {}
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = do_bench_ms(lambda: torch.matmul(a, b), 25, 200)
    out["matmul_bf16_tflops"] = 2 * n**3 / (ms * 1e-3) / 1e12
    out["matmul_ms"] = ms
    a = b = None
    nbytes = 2 * 2**30
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = do_bench_ms(lambda: dst.copy_(src), 25, 200)
    out["copy_gbps"] = 2 * nbytes / (ms * 1e-3) / 1e9
    out["copy_bytes"] = nbytes
    return out
