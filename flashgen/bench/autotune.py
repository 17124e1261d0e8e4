"""``flashgen tune``: measure candidate tile configs on the present GPU, record the winner.

For each spec (or, with ``--all-shipped``, each key that matters: head_dim 64/128/256 x
causal/not x bf16/fp16, plus the shipped specs that have a score_mod):

1. every candidate ``BLOCK_M in {64, 128}`` x ``BLOCK_N in {32, 48, 64, 128}`` x
   ``num_warps in {4, 8}`` with ``BLOCK_M % (16 * num_warps) == 0`` (12 of them) is
   rendered and compiled, all specs' candidates at once in a thread pool (through the
   kernel cache); a candidate that fails to compile or spills registers is dropped;
2. each survivor is checked against the float64 reference on a small random GQA problem
   (B=2, H=4/2, Sq=Sk=257 and Sq=100/Sk=257), a failure drops it;
3. survivors are timed at seqlen 8192 and 16384 in the benchmark protocol
   (:mod:`flashgen.bench.protocol`: batch = 16384 / seqlen, heads = 2048 / head_dim), in ms, and
   scored by mean TFLOP/s;
4. the winner goes into the tuning table (:mod:`flashgen.tuning`) under
   ``"<GPU>|<target>|<head_dim>|<dtype>|<causal>|<score_mod>"``.

The table is written after every key, so a run cut short keeps what it finished.
``--compile-only`` does step 1 without a GPU (for a target given with ``--target``) and
prints registers and spills per candidate.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from flashgen import tuning
from flashgen.codegen.cuda_expr import split_causal
from flashgen.codegen.plan import TileConfig
from flashgen.families.tiles import default_tiles as lower_default_tiles
from flashgen.frontend import ir

BLOCK_M = (64, 128)
BLOCK_N = (32, 48, 64, 128)
NUM_WARPS = (4, 8)
#: Sequence lengths the winner is chosen at (full run; ``--quick`` uses 8192 only).
SEQLENS = (8192, 16384)


#: BLOCK_N of the Hopper kernel's candidates (BLOCK_M 128, 12 warps); the plan refuses
#: those over the shared-memory budget at a head dim, and they are dropped as invalid.
HOPPER_BLOCK_N = (64, 80, 96, 128, 160, 176, 192)


def candidates(target: str = "sm_80") -> list[TileConfig]:
    """Every candidate tile config: the FA2-class kernel's (BLOCK_M % (16 * num_warps)
    == 0, 12 in all), and on ``sm_90`` also the Hopper kernel's (:data:`HOPPER_BLOCK_N`)."""
    fa2 = [
        TileConfig(bm, bn, nw)
        for bm in BLOCK_M
        for bn in BLOCK_N
        for nw in NUM_WARPS
        if bm % (16 * nw) == 0
    ]
    if target != "sm_90":
        return fa2
    return fa2 + [TileConfig(128, bn, 12) for bn in HOPPER_BLOCK_N]


def default_tiles(spec: ir.Spec) -> TileConfig:
    """What :func:`~flashgen.families.registry.choose_tiles` picks without a table
    (DEFAULT_TILES)."""
    return lower_default_tiles(spec)


def spec_key(spec: ir.Spec, gpu: str, target: str) -> str:
    """The tuning-table key of ``spec`` on ``gpu``/``target``."""
    return tuning.table_key(
        gpu,
        target,
        max(spec.head_dim, spec.head_dim_v),
        spec.dtype,
        split_causal(spec.mask)[0],
        spec.score_mod is not None,
    )


def candidate_spec(spec: ir.Spec, t: TileConfig) -> ir.Spec:
    """``spec`` renamed per candidate (its own op and kernel) with ``tiles:`` forced to ``t``."""
    return replace(
        spec,
        name=f"tune_{spec.name}_m{t.block_m}n{t.block_n}w{t.num_warps}",
        tiles=ir.TileOverride(t.block_m, t.block_n, t.num_warps),
        description="",
    )


def shipped_tuning_specs() -> list[ir.Spec]:
    """Specs whose keys matter: plain d64/128/256 x causal/not x bf16/fp16 (bench template
    specs), then each shipped spec whose key is not covered yet (those with a score_mod)."""
    from flashgen.bench.protocol import shipped_spec_paths, template_spec
    from flashgen.frontend.spec import load_spec

    specs = [
        template_spec(d, dt, c)
        for dt in ("bf16", "fp16")
        for d in (64, 128, 256)
        for c in (False, True)
    ]
    seen = {spec_key(s, "", "") for s in specs}
    for p in shipped_spec_paths():
        s = load_spec(p)
        if spec_key(s, "", "") not in seen:
            seen.add(spec_key(s, "", ""))
            specs.append(s)
    return specs


@dataclass
class Candidate:
    """One candidate's outcome.  ``ms``/``tflops`` per seqlen; ``score`` mean TFLOP/s."""

    block_m: int
    block_n: int
    num_warps: int
    status: str = "pending"  # ok | compile_error | spills | invalid | wrong | error | skipped
    registers: int | None = None
    spill_bytes: int | None = None
    compile_s: float | None = None
    max_err: float | None = None
    ms: dict = field(default_factory=dict)
    tflops: dict = field(default_factory=dict)
    score: float | None = None
    note: str = ""

    @property
    def tiles(self) -> TileConfig:
        return TileConfig(self.block_m, self.block_n, self.num_warps)


@dataclass
class TuneResult:
    """Outcome for one spec/key: every candidate and the winner (None if none survived)."""

    spec: str
    key: str
    candidates: list[Candidate]
    winner: Candidate | None = None
    baseline: Candidate | None = None  # the DEFAULT_TILES candidate
    written: bool = False

    def to_dict(self) -> dict:
        return {
            "spec": self.spec,
            "key": self.key,
            "winner": asdict(self.winner) if self.winner else None,
            "baseline": asdict(self.baseline) if self.baseline else None,
            "written": self.written,
            "candidates": [asdict(c) for c in self.candidates],
        }


def compile_candidates(
    specs: list[ir.Spec], target: str, gpu: str | None, jobs: int | None = None
) -> dict[str, list[Candidate]]:
    """Compile every candidate of every spec in parallel; spec name -> candidates.

    Candidates that fail planning (``invalid``), nvcc (``compile_error``) or spill
    (``spills``) are marked; the others stay ``pending``.  No GPU needed.
    """
    from flashgen.build import cache
    from flashgen.build.render import render
    from flashgen.families.registry import plan_forward

    out = {
        s.name: [Candidate(t.block_m, t.block_n, t.num_warps) for t in candidates(target)]
        for s in specs
    }
    by_name = {s.name: s for s in specs}

    def build(item):
        name, c = item
        cs = candidate_spec(by_name[name], c.tiles)
        try:
            plan = plan_forward(cs, target, gpu=gpu, persistent=False)
        except ValueError as e:
            c.status, c.note = "invalid", str(e)
            return
        try:
            t0 = time.perf_counter()
            _, report = cache.get_or_build(render(plan), plan)
            c.compile_s = round(time.perf_counter() - t0, 2)
        except Exception as e:  # noqa: BLE001 - a failed candidate is only dropped
            c.status, c.note = "compile_error", str(e).splitlines()[0][:200]
            return
        c.registers = report.registers
        c.spill_bytes = report.spill_bytes
        if report.spill_bytes:
            c.status = "spills"

    items = [(name, c) for name, cs in out.items() for c in cs]
    with ThreadPoolExecutor(max(1, jobs or os.cpu_count() or 4)) as pool:
        list(pool.map(build, items))
    return out


def verify_candidate(spec: ir.Spec, device) -> float:
    """Max |o - ref| over the checks; raises AssertionError when above the bound."""
    import math

    import torch

    from flashgen.bench.verify import error_bound, random_inputs
    from flashgen.ops.op import build_op

    op = build_op(spec)
    gen = torch.Generator(device=device).manual_seed(0)
    worst = 0.0
    for sq, sk in ((257, 257), (100, 257)):
        q, k, v, params = random_inputs(spec, 2, 4, 2, sq, sk, device, gen)
        o, _ = op.attention(q, k, v, **params)
        ref_o, _, bound = error_bound(spec, q, k, v, params)
        e = (o.double() - ref_o).abs().max().item()
        if not math.isfinite(e) or e > bound:
            raise AssertionError(f"max |err| {e:.3g} > bound {bound:.3g} at Sq={sq} Sk={sk}")
        worst = max(worst, e)
    return worst


def time_candidate(
    spec: ir.Spec, seqlen: int, device, warmup_ms: int, rep_ms: int
) -> tuple[float, float]:
    """(median ms, TFLOP/s) of ``spec``'s op at ``seqlen`` in the bench protocol."""
    import torch

    from flashgen.bench.protocol import (
        Rotation,
        attention_flops,
        problem,
        rotation_sets,
        spec_params,
    )
    from flashgen.bench.timing import do_bench_ms
    from flashgen.ops.op import TORCH_DTYPE, build_op

    op = build_op(spec)
    d = spec.head_dim
    b, h = problem(seqlen, d)
    dt = TORCH_DTYPE[spec.dtype]
    params = spec_params(spec, h, b, seqlen, seqlen, device)

    def make():
        return tuple(
            torch.randn(b, h, seqlen, x, device=device, dtype=dt) for x in (d, d, spec.head_dim_v)
        )

    rot = Rotation(make, rotation_sets(b * h * seqlen * (2 * d + spec.head_dim_v) * 2))

    def fn():
        q, k, v = rot.next()
        return op.attention(q, k, v, **params)

    fn()
    torch.cuda.synchronize()
    ms = do_bench_ms(fn, warmup_ms, rep_ms)
    causal = split_causal(spec.mask)[0]
    return ms, attention_flops(b, h, seqlen, seqlen, d, causal, "fwd") / (ms * 1e-3) / 1e12


def tag(t) -> str:
    """``"128x64w4"``: a candidate's name on the ``--candidates`` command line."""
    return f"{t.block_m}x{t.block_n}w{t.num_warps}"


def parse_tag(text: str) -> TileConfig:
    """Inverse of :func:`tag`; ``ValueError`` for anything else."""
    try:
        m, rest = text.strip().split("x")
        n, w = rest.split("w")
        return TileConfig(int(m), int(n), int(w))
    except ValueError as e:
        raise ValueError(f"bad candidate {text!r}; expected e.g. 128x64w4") from e


def _context_ok() -> bool:
    """Whether the CUDA context still works (a faulting kernel poisons it for the process)."""
    import torch

    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").add_(1).item() == 2.0
    except Exception:  # noqa: BLE001
        return False


def measure_candidates(
    spec: ir.Spec,
    cands: list[Candidate],
    device,
    seqlens: tuple[int, ...],
    warmup_ms: int,
    rep_ms: int,
    on_done=None,
) -> bool:
    """Verify and time every ``pending`` candidate of ``spec`` in place.

    A wrong result marks it ``wrong``, an exception ``error``; if the exception left the
    CUDA context unusable the candidate becomes ``cuda_error`` and this returns False at
    once (later candidates stay ``pending``).  ``on_done(c)`` is called after each one.
    """
    import torch

    for c in cands:
        if c.status != "pending":
            continue
        cs = candidate_spec(spec, c.tiles)
        try:
            c.max_err = verify_candidate(cs, device)
            for s in seqlens:
                ms, tf = time_candidate(cs, s, device, warmup_ms, rep_ms)
                c.ms[str(s)], c.tflops[str(s)] = round(ms, 4), round(tf, 2)
            c.score = round(sum(c.tflops.values()) / len(c.tflops), 2)
            c.status = "ok"
        except AssertionError as e:
            c.status, c.note = "wrong", str(e)
        except Exception as e:  # noqa: BLE001 - the candidate is dropped, tuning goes on
            c.status, c.note = "error", f"{type(e).__name__}: {e}"[:300]
            if device.type == "cuda" and not _context_ok():
                c.status = "cuda_error"
        if on_done is not None:
            on_done(c)
        if c.status == "cuda_error":
            return False
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return True


def _spec_text(spec: ir.Spec) -> str:
    if spec.source:
        return spec.source
    return Path(spec.path).read_text()


def measure_isolated(
    spec: ir.Spec,
    cands: list[Candidate],
    seqlens: tuple[int, ...],
    quick: bool,
    workdir: Path,
    log=print,
    attempts: int = 4,
) -> None:
    """:func:`measure_candidates` in child processes (``flashgen tune --child-out``).

    A kernel that faults poisons only its child; the parent marks it ``cuda_error`` and
    starts a new child for the candidates still pending (at most ``attempts`` children).
    """
    import subprocess

    spec_file = workdir / f"{spec.name}.yaml"
    spec_file.write_text(_spec_text(spec))
    by_tag = {tag(c): c for c in cands}
    for attempt in range(attempts):
        pending = [c for c in cands if c.status == "pending"]
        if not pending:
            return
        out = workdir / f"{spec.name}.{attempt}.json"
        cmd = [
            sys.executable,
            "-m",
            "flashgen",
            "tune",
            str(spec_file),
            "--child-out",
            str(out),
            "--candidates",
            ",".join(tag(c) for c in pending),
            "--seqlen",
            ",".join(map(str, seqlens)),
            "--no-write",
            *(["--quick"] if quick else []),
        ]
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        done = json.loads(out.read_text()) if out.exists() else []
        for d in done:
            c = by_tag.get(tag(TileConfig(d["block_m"], d["block_n"], d["num_warps"])))
            if c is not None and d["status"] != "pending":
                for k in ("status", "max_err", "ms", "tflops", "score", "note"):
                    setattr(c, k, d[k])
        still = [c for c in cands if c.status == "pending"]
        if proc.returncode not in (0, 3) and still:
            # the child died without reporting the candidate it was on: blame that one
            still[0].status = "error"
            still[0].note = f"child exited {proc.returncode}: " + (proc.stderr or "")[-200:]
            log(f"{spec.name}: child process failed on {tag(still[0])} (exit {proc.returncode})")
    for c in cands:
        if c.status == "pending":
            c.status, c.note = "skipped", "too many failing child processes"


def tune(
    specs: list[ir.Spec],
    *,
    quick: bool = False,
    seqlens: tuple[int, ...] | None = None,
    table: str | Path | None = None,
    write: bool = True,
    jobs: int | None = None,
    budget_s: float = 450.0,
    isolate: bool = True,
    log=print,
    device=None,
) -> list[TuneResult]:
    """Tune ``specs`` on the current CUDA device; returns one :class:`TuneResult` per key.

    Specs that share a key are tuned once (the first).  ``write``: record winners in
    ``table`` (default :func:`flashgen.tuning.table_path`) after each key.  ``budget_s``
    (0 = none) is a soft limit in seconds: keys not started by then are skipped.
    ``isolate``: measure each key in a child process (see :func:`measure_isolated`), so
    a faulting candidate kernel cannot take the other keys down with it.  ``device``
    defaults to the current CUDA device.
    """
    import tempfile

    import torch

    from flashgen.ops.op import target_for_device

    t_start = time.perf_counter()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    gpu = torch.cuda.get_device_name(device)
    seqlens = tuple(seqlens or ((8192,) if quick else SEQLENS))
    warmup_ms, rep_ms = (10, 40) if quick else (25, 100)

    uniq: dict[str, ir.Spec] = {}
    for s in specs:
        key = spec_key(s, gpu, target_for_device(s, device))
        uniq.setdefault(key, s)
    n_cands = len(candidates(target_for_device(specs[0], device))) if specs else 0
    log(f"tuning {len(uniq)} key(s) on {gpu}: {n_cands} candidates each, seqlens {seqlens}")
    by_target: dict[str, list[ir.Spec]] = {}
    for s in uniq.values():
        by_target.setdefault(target_for_device(s, device), []).append(s)
    compiled: dict[str, list[Candidate]] = {}
    t0 = time.perf_counter()
    for target, ss in by_target.items():
        compiled.update(compile_candidates(ss, target, gpu, jobs))
    n_ok = sum(c.status == "pending" for cs in compiled.values() for c in cs)
    n_all = sum(map(len, compiled.values()))
    log(f"compiled {n_all} candidates in {time.perf_counter() - t0:.1f}s, {n_ok} usable")

    results = []
    context_lost = False
    with tempfile.TemporaryDirectory(prefix="flashgen-tune-") as workdir:
        for key, spec in uniq.items():
            cands = compiled[spec.name]
            res = TuneResult(spec.name, key, cands)
            results.append(res)
            res.baseline = next((c for c in cands if c.tiles == default_tiles(spec)), None)
            late = budget_s and time.perf_counter() - t_start > budget_s
            if late or context_lost:
                for c in cands:
                    if c.status == "pending":
                        c.status = "skipped"
                        c.note = "time budget exhausted" if late else "CUDA context lost"
                log(f"{key}: skipped ({'time budget' if late else 'CUDA context lost'})")
                continue
            if isolate:
                measure_isolated(spec, cands, seqlens, quick, Path(workdir), log)
            else:
                context_lost = not measure_candidates(
                    spec, cands, device, seqlens, warmup_ms, rep_ms
                )
            ok = [c for c in cands if c.status == "ok"]
            if not ok:
                log(f"{key}: no candidate survived")
                continue
            res.winner = max(ok, key=lambda c: c.score)
            w, base = res.winner, res.baseline
            entry = {
                "block_m": w.block_m,
                "block_n": w.block_n,
                "num_warps": w.num_warps,
                "tflops": w.score,
                "date": time.strftime("%Y-%m-%d"),
                "seqlens": list(seqlens),
                "baseline_tflops": base.score if base and base.status == "ok" else None,
                "registers": w.registers,
            }
            if write:
                tuning.update_table(key, entry, table)
                res.written = True
            gain = f" (default {base.score:.1f})" if base and base.score else ""
            log(f"{key}: {w.block_m}x{w.block_n} w{w.num_warps} {w.score:.1f} TFLOP/s{gain}")
    return results


def run_child(spec: ir.Spec, tags: list[str], seqlens, quick: bool, out: str | Path) -> int:
    """Body of ``flashgen tune --child-out``: measure the ``tags`` candidates of ``spec`` on
    the current GPU, rewriting ``out`` (a JSON list of candidates) after each one.
    Returns 0, or 3 when the CUDA context was lost."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    cands = []
    for t in tags:
        tc = parse_tag(t)
        cands.append(Candidate(tc.block_m, tc.block_n, tc.num_warps))
    seqlens = tuple(seqlens or ((8192,) if quick else SEQLENS))
    warmup_ms, rep_ms = (10, 40) if quick else (25, 100)
    out = Path(out)

    def save(_c=None):
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps([asdict(c) for c in cands]))
        os.replace(tmp, out)

    ok = measure_candidates(spec, cands, device, seqlens, warmup_ms, rep_ms, on_done=save)
    save()
    return 0 if ok else 3


def report_markdown(results: list[TuneResult], gpu: str = "") -> str:
    """A Markdown table of every key: winner, its TFLOP/s, the default's, and candidates."""
    lines = [
        f"# flashgen tune {gpu}".rstrip(),
        "",
        "| key | winner (BMxBN, warps) | TFLOP/s | default | gain | usable/12 |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        w, b = r.winner, r.baseline
        usable = sum(c.status == "ok" for c in r.candidates)
        gain = f"{w.score / b.score:.2f}x" if w and b and b.score else ""
        lines.append(
            f"| {r.key} | {f'{w.block_m}x{w.block_n}, {w.num_warps}' if w else '-'} | "
            f"{w.score if w else '-'} | {b.score if b and b.score else '-'} | {gain} | {usable} |"
        )
    lines += ["", "## Candidates", "", "| key | tiles | status | regs | TFLOP/s by seqlen | note |"]
    lines.append("|---|---|---|---|---|---|")
    for r in results:
        for c in r.candidates:
            tf = ", ".join(f"{s}: {v}" for s, v in c.tflops.items())
            lines.append(
                f"| {r.key} | {c.block_m}x{c.block_n} w{c.num_warps} | {c.status} | "
                f"{c.registers if c.registers is not None else ''} | {tf} | {c.note[:80]} |"
            )
    return "\n".join(lines) + "\n"


def write_outputs(
    results: list[TuneResult], out_dir: str | Path, table: str | Path | None
) -> list[Path]:
    """tune.json, tune.md and a copy of the table (table.json) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gpu = ""
    try:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    except ImportError:
        pass
    (out / "tune.json").write_text(json.dumps([r.to_dict() for r in results], indent=1))
    (out / "tune.md").write_text(report_markdown(results, gpu))
    src = Path(table) if table else tuning.table_path()
    paths = [out / "tune.json", out / "tune.md"]
    if src.exists():
        (out / "table.json").write_text(src.read_text())
        paths.append(out / "table.json")
    return paths


def print_compile_only(compiled: dict[str, list[Candidate]], stream=None) -> None:
    """The ``--compile-only`` table: registers / spills / status per candidate."""
    stream = stream or sys.stdout
    print(f"{'spec':28} {'tiles':14} {'regs':>5} {'spill B':>8} {'nvcc s':>7}  status", file=stream)
    for name, cs in compiled.items():
        for c in cs:
            status = "ok" if c.status == "pending" else c.status
            print(
                f"{name:28} {f'{c.block_m}x{c.block_n} w{c.num_warps}':14} "
                f"{c.registers if c.registers is not None else '-':>5} "
                f"{c.spill_bytes if c.spill_bytes is not None else '-':>8} "
                f"{c.compile_s if c.compile_s is not None else '-':>7}  {status} {c.note[:60]}",
                file=stream,
            )
