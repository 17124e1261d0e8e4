"""``flashgen bench``: flashgen's kernels against PyTorch's attention implementations.

Protocol (the FlashAttention papers'): batch x seqlen = 16384 tokens, hidden 2048, so
``heads = 2048 / head_dim`` and ``batch = 16384 / seqlen``; seqlen 512 .. 16384, head_dim
64/128/256, causal and not, fp16 and bf16, forward and forward+backward.  Every
implementation is timed in the same process and run:

    flashgen, sdpa_flash, sdpa_cudnn, sdpa_efficient, flex, standard
    (:mod:`flashgen.bench.peers`; flashgen's specs built on the fly from a template spec text)

An fp8 spec (``dtype: fp8_e4m3``, a variant spec or ``--dtype fp8_e4m3``) is timed forward
only, against ``flashgen_bf16``, the bf16 build of the same spec
(:func:`~flashgen.bench.protocol.bf16_twin`) in the same run, since no torch implementation
runs FP8 attention; the reports give the ratio (:func:`flashgen.bench.report.fp8_speedups`).

Times are medians of ``triton.testing.do_bench(..., return_mode="median")`` in **ms**;
inputs rotate among ``max(2, ceil(2 * 60 MB / bytes_per_set))`` buffer sets so the L2
cache never holds them.  Throughput in **TFLOP/s** by the papers' count: forward
``4 * B * H * Sq * Sk * D`` (halved when causal), backward 2.5x forward, so
forward+backward is 3.5x.  A backend that rejects a config is recorded ``unsupported``,
an out-of-memory ``oom``, a flashgen op without backward ``n/a``; nothing aborts the run.

Also measured: the matmul ceiling (bf16 8192^3 ``torch.matmul``, TFLOP/s) and the copy
ceiling (a 2 GiB device copy, **GB/s** counting read + write) for the roofline, and a
memory experiment (peak ``torch.cuda.max_memory_allocated`` in bytes vs seqlen 1k..64k,
B=1, H=16, D=128) for standard attention against flashgen.

Outputs in ``--out``: ``results.json`` (rewritten after every config, so a run cut short
still leaves its rows), ``results.md``, ``tflops.png``, ``memory.png``, ``roofline.png``,
``variants.png`` (see :mod:`flashgen.bench.report`).  Needs torch with CUDA; triton is
used for timing when present (CUDA events otherwise; :mod:`flashgen.bench.timing`).
The protocol's shapes, FLOPs and params: :mod:`flashgen.bench.protocol`.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flashgen.bench.peers import (
    SDPA_BACKENDS,
    Unsupported,
    expressible,
    flashgen_has_backward,
    make_forward,
)
from flashgen.bench.protocol import (
    BWD_FACTOR,
    DIRECTIONS,
    FP8_PEER,
    IMPLS,
    Rotation,
    attention_bytes,
    attention_flops,
    bf16_twin,
    is_fp8,
    kept_pairs,
    problem,
    rotation_sets,
    shipped_spec_paths,
    spec_directions,
    spec_impls,
    spec_params,
    template_spec,
)
from flashgen.bench.timing import alternate, do_bench_ms, environment, measure_ceilings
from flashgen.frontend import ir


# ----------------------------------------------------------------------------- configuration
@dataclass
class BenchConfig:
    """What one ``flashgen bench`` run measures.

    ``warmup_ms``/``rep_ms`` go to ``do_bench``; ``budget_s`` (0 = none) is a soft wall
    clock limit in seconds: once exceeded, remaining measurements are recorded as
    ``skipped`` and the outputs are still written.  ``rounds`` > 1 times the
    implementations of one problem in that many alternating rounds (A B C, C B A, ...) on
    the same inputs and reports each one's median over the rounds, so that a slow drift of
    the GPU's clock (it runs at its power limit) reaches every implementation alike.
    """

    dtypes: tuple[str, ...] = ("bf16", "fp16")
    head_dims: tuple[int, ...] = (64, 128, 256)
    seqlens: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)
    causal: tuple[bool, ...] = (False, True)
    directions: tuple[str, ...] = DIRECTIONS
    impls: tuple[str, ...] = IMPLS
    warmup_ms: int = 25
    rep_ms: int = 100
    memory: bool = True
    memory_seqlens: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
    variants: bool = True
    variant_specs: tuple[str, ...] = ()  # spec files; empty = the shipped specs/
    variant_seqlens: tuple[int, ...] = (1024, 4096, 16384)
    variant_directions: tuple[str, ...] = DIRECTIONS
    ceilings: bool = True
    budget_s: float = 540.0
    quick: bool = False
    rounds: int = 1

    @classmethod
    def quick_config(cls) -> BenchConfig:
        """The ``--quick`` subset (a few minutes on one GPU): bf16, seqlen 1k/4k/16k,
        d64/128/256, causal and not, no EFFICIENT/flex, short timing windows, forward-only
        variants at 4k/16k."""
        return cls(
            dtypes=("bf16",),
            seqlens=(1024, 4096, 16384),
            impls=("flashgen", "sdpa_flash", "sdpa_cudnn", "standard"),
            warmup_ms=10,
            rep_ms=30,
            variant_seqlens=(4096, 16384),
            variant_directions=("fwd",),
            budget_s=300.0,
            quick=True,
        )


def _is_oom(e: BaseException) -> bool:
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    return "out of memory" in str(e).lower()


def _short(e: BaseException, n: int = 300) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text if len(text) <= n else text[: n - 3] + "..."


def _failed(row, e: BaseException) -> None:
    """Record exception ``e`` of a measurement in ``row`` (status and note)."""
    if isinstance(e, Unsupported):
        row.status, row.note = "unsupported", str(e)
    elif isinstance(e, NotImplementedError):
        row.status, row.note = "n/a", _short(e, 160)
    elif _is_oom(e):
        row.status, row.note = "oom", ""
    elif row.impl in SDPA_BACKENDS and isinstance(e, RuntimeError):
        row.status, row.note = "unsupported", _short(e, 200)
    else:
        row.status, row.note = "error", _short(e)


def _free() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- the runner
@dataclass
class Row:
    """One measurement.  ``ms`` median milliseconds, ``tflops`` TFLOP/s, ``bytes`` the
    estimated DRAM traffic (roofline), memory rows: ``peak_bytes``/``extra_bytes``."""

    section: str  # "sweep" | "variant" | "memory"
    impl: str
    spec: str
    dtype: str
    head_dim: int
    causal: bool
    direction: str
    batch: int
    heads: int
    seqlen: int
    status: str = "ok"  # ok | unsupported | oom | n/a | error | skipped
    ms: float | None = None
    tflops: float | None = None
    flops: float | None = None
    bytes: float | None = None
    peak_bytes: int | None = None
    extra_bytes: int | None = None
    note: str = ""


@dataclass
class Progress:
    """Progress reporting: a rich bar on a terminal, one line per step otherwise."""

    total: int
    label: str = "bench"
    done: int = 0
    t0: float = field(default_factory=time.perf_counter)
    _bar: object = None
    _task: object = None

    def __enter__(self):
        if sys.stderr.isatty():
            try:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                )

                self._bar = Progress(
                    TextColumn("{task.description}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                    transient=False,
                )
                self._bar.__enter__()
                self._task = self._bar.add_task(self.label, total=self.total)
            except ImportError:
                self._bar = None
        return self

    def step(self, desc: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=f"{self.label}: {desc}")
        else:
            el = time.perf_counter() - self.t0
            print(f"[{self.done}/{self.total} {el:5.0f}s] {desc}", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)


class Bench:
    """Runs a :class:`BenchConfig` on the current CUDA device and collects :class:`Row` s."""

    def __init__(self, cfg: BenchConfig, out_dir: str | Path | None = None):
        import torch

        self.cfg = cfg
        self.out = Path(out_dir) if out_dir else None
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.rows: list[Row] = []
        self.ceilings: dict = {}
        self.compile_errors: dict[str, str] = {}
        self.kernels: dict[str, dict] = {}
        self._kept: dict[tuple, int] = {}
        self.env = environment()
        self.t0 = time.perf_counter()

    # ----------------------------------------------------------------- bookkeeping
    def over_budget(self) -> bool:
        b = self.cfg.budget_s
        return bool(b) and time.perf_counter() - self.t0 > b

    def results(self) -> dict:
        """The JSON document: environment, config, ceilings, every row."""
        return {
            "schema": "flashgen-bench/1",
            "env": self.env,
            "config": asdict(self.cfg),
            "ceilings": self.ceilings,
            "compile_errors": self.compile_errors,
            "kernels": self.kernels,
            "elapsed_s": round(time.perf_counter() - self.t0, 1),
            "rows": [asdict(r) for r in self.rows],
        }

    def save(self) -> None:
        """(Re)write ``results.json`` in the output directory (atomic)."""
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / ".results.json.tmp"
        tmp.write_text(json.dumps(self.results(), indent=1))
        os.replace(tmp, self.out / "results.json")

    # ----------------------------------------------------------------- ceilings
    def measure_ceilings(self) -> dict:
        """bf16 8192^3 matmul TFLOP/s and device-copy GB/s (read + write bytes):
        :func:`flashgen.bench.timing.measure_ceilings`."""
        self.ceilings.update(measure_ceilings(self.device))
        _free()
        return self.ceilings

    # ----------------------------------------------------------------- precompile
    def precompile(
        self, specs: list[ir.Spec], backward: set[str] = frozenset(), jobs: int | None = None
    ) -> None:
        """Compile every flashgen kernel the run needs, in parallel, before any timing.

        Forward kernels and, for the spec names in ``backward``
        (:func:`flashgen.families.registry.plan_backward`), the backward kernels, through the
        on-disk cache (``cache.get_or_build`` takes a per-uri file lock, so threads and
        processes compile each kernel once and the op's own build later is a cache hit).
        Tiles, registers and spills land in ``kernels``; failures in ``compile_errors``
        (the spec's flashgen rows become ``error`` rows; a failed backward only affects
        forward+backward rows, which then fail on their own).
        """
        import torch

        from flashgen.build import cache
        from flashgen.build.render import render
        from flashgen.families.registry import plan_backward, plan_forward
        from flashgen.ops.op import target_for_device

        gpu = torch.cuda.get_device_name(self.device)

        def build(job):
            spec, kind = job
            target = target_for_device(spec, self.device)
            try:
                if kind == "fwd":
                    plan = plan_forward(spec, target, gpu=gpu, persistent=False)
                    _, report = cache.get_or_build(render(plan), plan)
                    info = {
                        "tiles": [plan.tiles.block_m, plan.tiles.block_n, plan.tiles.num_warps],
                        "registers": report.registers,
                        "spill_bytes": report.spill_bytes,
                    }
                else:
                    plan = plan_backward(spec, target)
                    _, report = cache.get_or_build(render(plan.dq), plan.dq)
                    info = {
                        "bwd_registers": report.registers,
                        "bwd_spill_bytes": report.spill_bytes,
                    }
                return spec.name, kind, info, None
            except Exception as e:  # noqa: BLE001 - reported per spec
                return spec.name, kind, {}, _short(e)

        uniq = {s.name: s for s in specs}
        jobs_list = [(s, "fwd") for s in uniq.values()]
        jobs_list += [(s, "bwd") for s in uniq.values() if s.name in backward]
        workers = max(1, min(len(jobs_list), jobs or os.cpu_count() or 4))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            for name, kind, info, err in pool.map(build, jobs_list):
                self.kernels.setdefault(name, {}).update(info)
                if err and kind == "fwd":
                    self.compile_errors[name] = err
                elif err:
                    self.kernels[name]["bwd_error"] = err
        print(
            f"compiled {len(jobs_list)} flashgen kernel sources in "
            f"{time.perf_counter() - t0:.1f}s"
            + (f" ({len(self.compile_errors)} failed)" if self.compile_errors else ""),
            file=sys.stderr,
            flush=True,
        )

    def kept(self, spec: ir.Spec, batch: int, heads: int, seqlen: int, params: dict) -> int:
        """:func:`kept_pairs`, computed once per (spec, shape)."""
        key = (spec.name, batch, heads, seqlen)
        if key not in self._kept:
            self._kept[key] = kept_pairs(spec, batch, heads, seqlen, params, self.device)
        return self._kept[key]

    # ----------------------------------------------------------------- one measurement
    def prepare(
        self,
        section: str,
        impl: str,
        spec: ir.Spec,
        batch: int,
        heads: int,
        seqlen: int,
        direction: str,
        label: str | None = None,
    ) -> tuple[Row, Callable[[], object] | None]:
        """The row of one measurement and the callable to time (inputs rotated over enough
        buffers to exceed the L2), already run once (compiles, probes support); the
        callable is ``None`` when the row is final (skipped, unsupported, error, ...)."""
        import torch

        from flashgen.codegen.cuda_expr import split_causal
        from flashgen.ops.op import TORCH_DTYPE

        causal = split_causal(spec.mask)[0]
        d = spec.head_dim
        row = Row(
            section,
            impl,
            label or spec.name,
            spec.dtype,
            d,
            causal,
            direction,
            batch,
            heads,
            seqlen,
        )
        row.flops = attention_flops(batch, heads, seqlen, seqlen, d, causal, direction)
        row.bytes = attention_bytes(batch, heads, seqlen, d, 2, direction, impl, causal)
        if self.over_budget():
            row.status, row.note = "skipped", "time budget exhausted"
            return row, None
        if impl == FP8_PEER:
            row.note = f"bf16 build of {spec.name}"
        built = bf16_twin(spec) if impl == FP8_PEER else spec  # the spec flashgen's op runs
        if impl in ("flashgen", FP8_PEER) and built.name in self.compile_errors:
            row.status, row.note = "error", "compile: " + self.compile_errors[built.name]
            return row, None
        dt = TORCH_DTYPE[built.dtype]
        bwd = direction == "fwd_bwd"
        per_set = 3 * batch * heads * seqlen * d * 2 * (2 if bwd else 1)
        try:
            params = spec_params(spec, heads, batch, seqlen, seqlen, self.device)
            if section == "variant" and spec.mask is not None and split_causal(spec.mask)[1]:
                # a mask beyond causal: FLOPs of the kept (q, kv) pairs only
                kept = self.kept(spec, batch, heads, seqlen, params)
                row.flops = 2.0 * (d + spec.head_dim_v) * kept * (1 + BWD_FACTOR if bwd else 1)
                row.note = f"kept-pair FLOPs (density {kept / (batch * heads * seqlen**2):.3f})"
            f = make_forward(impl, spec, seqlen, seqlen, params, self.device)
            if impl == "flashgen" and bwd:
                from flashgen.ops.op import build_op

                if flashgen_has_backward(build_op(spec)) is False:
                    row.status, row.note = "n/a", "flashgen op has no backward"
                    return row, None

            def make():
                if is_fp8(built):  # e4m3 inputs (randn has no float8 kernel), descales 1.0
                    g = lambda *s: torch.randn(*s, device=self.device).to(dt)  # noqa: E731
                else:
                    g = lambda *s: torch.randn(*s, device=self.device, dtype=dt)  # noqa: E731
                q = g(batch, heads, seqlen, d).requires_grad_(bwd)
                k = g(batch, heads, seqlen, d).requires_grad_(bwd)
                v = g(batch, heads, seqlen, d).requires_grad_(bwd)
                return (q, k, v, g(batch, heads, seqlen, d) if bwd else None)

            rot = Rotation(make, rotation_sets(per_set))
            if bwd:

                def fn():
                    q, k, v, do = rot.next()
                    o = f(q, k, v)
                    return torch.autograd.grad(o, (q, k, v), do)
            else:

                def fn():
                    q, k, v, _ = rot.next()
                    with torch.no_grad():
                        return f(q, k, v)

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fn()  # probe: compiles (flex), raises for unsupported configs
                torch.cuda.synchronize()
            return row, fn
        except Exception as e:  # noqa: BLE001 - every failure becomes a row
            _failed(row, e)
            rot = None  # noqa: F841 - drop the buffers before the next config
            _free()
            return row, None

    def time_rows(self, items: list[tuple[Row, Callable[[], object]]], rounds: int) -> None:
        """Time each prepared ``(row, fn)``: ``rounds`` alternating rounds
        (:func:`~flashgen.bench.timing.alternate`: forward, then backward order, ..., the
        first item once untimed before them when there is more than one round), ``row.ms``
        the median of its rounds' ``do_bench`` medians (each round's ms in ``row.note``).
        An item that raises becomes a failed row and sits out the later rounds."""

        def measure(i: int) -> float:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return do_bench_ms(items[i][1], self.cfg.warmup_ms, self.cfg.rep_ms)

        samples, failed = alternate(measure, len(items), rounds)
        for i, e in failed.items():
            _failed(items[i][0], e)
        for i, ((row, _), ms) in enumerate(zip(items, samples, strict=True)):
            if i not in failed and ms:
                row.ms = statistics.median(ms)
                row.tflops = row.flops / (row.ms * 1e-3) / 1e12
                if rounds > 1:
                    note = f"median of rounds {'/'.join(f'{x:.3f}' for x in ms)} ms"
                    row.note = f"{row.note}; {note}" if row.note else note

    # ----------------------------------------------------------------- memory
    def measure_memory(self, impl: str, spec: ir.Spec, seqlen: int, direction: str) -> Row:
        """Peak ``max_memory_allocated`` (bytes) of one call at B=1, H=16 (inputs included;
        ``extra_bytes`` excludes what was allocated before the call)."""
        import torch

        from flashgen.ops.op import TORCH_DTYPE

        batch, heads, d = 1, 16, spec.head_dim
        row = Row("memory", impl, spec.name, spec.dtype, d, False, direction, batch, heads, seqlen)
        if self.over_budget():
            row.status, row.note = "skipped", "time budget exhausted"
            return row
        bwd = direction == "fwd_bwd"
        dt = TORCH_DTYPE[spec.dtype]
        q = k = v = do = None
        try:
            f = make_forward(impl, spec, seqlen, seqlen, {}, self.device)
            _free()
            g = lambda: torch.randn(batch, heads, seqlen, d, device=self.device, dtype=dt)  # noqa: E731
            q, k, v = (g().requires_grad_(bwd) for _ in range(3))
            do = g() if bwd else None
            if impl == "flashgen":  # load the kernel outside the measured window
                with torch.no_grad():
                    f(*(t[:, :, :16].detach() for t in (q, k, v)))
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if bwd:
                    o = f(q, k, v)
                    grads = torch.autograd.grad(o, (q, k, v), do)
                    del o, grads
                else:
                    with torch.no_grad():
                        f(q, k, v)
            torch.cuda.synchronize()
            row.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            row.extra_bytes = row.peak_bytes - int(base)
        except NotImplementedError as e:
            row.status, row.note = "n/a", _short(e, 160)
        except Exception as e:  # noqa: BLE001
            if _is_oom(e):
                row.status = "oom"
            else:
                row.status, row.note = "error", _short(e)
        finally:
            q = k = v = do = None
            _free()
        return row

    # ----------------------------------------------------------------- plans
    def plan(self) -> list[tuple]:
        """Every measurement of the run, as ``(kind, args)`` tuples, in execution order."""
        c = self.cfg
        work: list[tuple] = []
        for dtype in c.dtypes:
            for d in c.head_dims:
                for causal in c.causal:
                    spec = template_spec(d, dtype, causal)
                    for s in c.seqlens:
                        b, h = problem(s, d)
                        for direction in spec_directions(spec, c.directions):
                            for impl in spec_impls(spec, c.impls):
                                work.append(("sweep", (impl, spec, b, h, s, direction)))
        if c.memory:
            mspec = template_spec(128, "bf16", False)
            for s in c.memory_seqlens:
                for direction in c.directions:
                    for impl in ("standard", "flashgen"):
                        work.append(("memory", (impl, mspec, s, direction)))
        if c.variants:
            for spec in self.variant_specs():
                for s in c.variant_seqlens:
                    b, h = problem(s, spec.head_dim)
                    for direction in spec_directions(spec, c.variant_directions):
                        for impl in spec_impls(spec, c.impls):
                            if expressible(impl, spec):
                                work.append(("variant", (impl, spec, b, h, s, direction)))
        return work

    def variant_specs(self) -> list[ir.Spec]:
        """The checked specs of the variant benchmark (``variant_specs`` or specs/)."""
        from flashgen.frontend.spec import load_spec

        paths = [Path(p) for p in self.cfg.variant_specs] or shipped_spec_paths()
        return [load_spec(p) for p in paths]

    def run(self) -> dict:
        """Measure everything, saving ``results.json`` as it goes; returns the document."""
        work = self.plan()
        fg = [a for k, a in work if a[0] == "flashgen"]
        need_bwd = {a[1].name for a in fg if a[-1] == "fwd_bwd"}
        twins = [bf16_twin(a[1]) for k, a in work if a[0] == FP8_PEER]
        self.precompile([a[1] for a in fg] + twins, need_bwd)
        if self.cfg.ceilings:
            self.measure_ceilings()
            print(
                f"ceilings: matmul bf16 {self.ceilings['matmul_bf16_tflops']:.0f} TFLOP/s, "
                f"copy {self.ceilings['copy_gbps']:.0f} GB/s",
                file=sys.stderr,
                flush=True,
            )
        self.save()
        last_group = None
        # one round: each item probed, timed and freed before the next (the protocol of
        # before --rounds); more: a problem's implementations prepared, then timed together
        batches = self.problems(work) if self.cfg.rounds > 1 else [[item] for item in work]
        with Progress(len(work), "bench") as prog:
            for batch in batches:
                kind = batch[0][0]
                if kind == "memory":
                    rows = [self.measure_memory(*args) for _, args in batch]
                else:
                    prepared = [self.prepare(kind, *args) for _, args in batch]
                    self.time_rows([p for p in prepared if p[1] is not None], self.cfg.rounds)
                    rows = [row for row, _ in prepared]
                    prepared = None
                    _free()
                for (_, args), row in zip(batch, rows, strict=True):
                    self.rows.append(row)
                    impl, spec, s, direction = args[0], args[1], args[-2], args[-1]
                    desc = f"{kind} {impl if kind == 'memory' else spec.name} S={s} {direction}"
                    desc += f" {impl}" if kind != "memory" else ""
                    val = (
                        f"{row.tflops:.1f} TFLOP/s"
                        if row.tflops
                        else (f"{row.peak_bytes / 2**30:.2f} GiB" if row.peak_bytes else row.status)
                    )
                    prog.step(f"{desc}: {val}")
                group = (kind, batch[0][1][1].name if kind != "memory" else "memory")
                if group != last_group:
                    self.save()
                    last_group = group
        self.save()
        return self.results()

    def problems(self, work: list[tuple]) -> list[list[tuple]]:
        """``work`` cut into runs of consecutive items that time one problem (same kind, spec,
        shape and direction; each memory item alone): the implementations :meth:`run` times
        together in alternating rounds when ``rounds`` > 1 (all of them prepared first, so
        their input rotations are held at once)."""

        def problem(item: tuple) -> tuple:
            kind, args = item
            return (kind, id(item)) if kind == "memory" else (kind, args[1].name, *args[2:])

        return [list(items) for _, items in itertools.groupby(work, key=problem)]


def run_bench(cfg: BenchConfig, out_dir: str | Path) -> dict:
    """Run ``cfg``, write results.json, results.md and the plots into ``out_dir``.

    Returns the results document.  Needs a CUDA device.
    """
    from flashgen.bench import report as benchreport

    bench = Bench(cfg, out_dir)
    try:
        doc = bench.run()
    except KeyboardInterrupt:
        bench.save()
        raise
    written = benchreport.write_reports(doc, out_dir)
    for p in written:
        print(f"wrote {p}", file=sys.stderr)
    return doc
