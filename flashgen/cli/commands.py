"""Command line: ``flashgen build | show | list | cache | bench | tune | ab`` (``python -m
flashgen``).

    flashgen build SPEC... [--target sm_80|sm_90]... [--out generated] [--json] [--jobs N]
                           [--no-verify] [--offsets] [--option NAME=VALUE]...
        check each spec, render and compile every (spec, target) with nvcc in parallel
        (through the kernel cache), print registers / spills / shared memory / compile
        time, write <out>/<name>/.  With a CUDA GPU (and without --no-verify) also check
        each op against the float64 reference and time it.
        Exit 0 on success; 1 for a bad spec, a failed compile, a kernel that spills, a
        failed verification or missing nvcc (a spec whose compile failed or spilled is not
        written).
    flashgen show SPEC [--target T] [--option NAME=VALUE]...
                                       the checked IR, the kernel plan and the CUDA source
    flashgen list [DIR]                the specs in DIR (default ./specs, else the shipped ones)
    flashgen cache [--prune [--older-than DAYS]]   kernel cache size; prune it
    flashgen bench [SPEC...] [--quick] [--out DIR] [--fwd-only] [--from-json RESULTS...]
        benchmark against PyTorch SDPA backends, FlexAttention and standard attention
        (flashgen/bench/runner.py); exit 2 without a CUDA GPU
    flashgen bench --decode | --gallery | --training | --cpu | --ring | --timeline
                   | --ablation [ARG...]
        the other benchmarks (:data:`BENCH_MODES`), each with its own options after its flag
    flashgen tune [SPEC...] [--all-shipped] [--quick] [--out DIR] [--compile-only]
        time candidate tile configs, record winners in flashgen/tuning/table.json
        (flashgen/bench/autotune.py); exit 2 without a CUDA GPU
    flashgen ab SPEC... --option NAME=A,B [--option ...] [--peers] [--shapes ...]
        the op under each combination of option values (flashgen.Options), outputs compared
        and timed in alternating rounds (flashgen/bench/ab.py); exit 2 without a CUDA GPU

torch is imported only for verification on a GPU machine.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from flashgen.bench import ab
from flashgen.bench.verify import NO_GPU_EXIT  # noqa: F401
from flashgen.bench.verify import require_cuda as _require_cuda
from flashgen.cli.build import (  # noqa: F401  (re-exported: tests and tools import them here)
    BuildResult,
    _compile_one,
    _cuda_available,
    _verify_safely,
    cmd_build,
)
from flashgen.cli.cache import cmd_cache
from flashgen.cli.common import (  # noqa: F401
    HelpFormatter,
    _consoles,
    _fail_json,
    _load_specs,
    plain_warnings,
)
from flashgen.cli.show import _prec, cmd_list, cmd_show, format_expr, format_spec  # noqa: F401
from flashgen.frontend import ir
from flashgen.frontend.errors import SpecError
from flashgen.version import __version__


# ----------------------------------------------------------------------------- bench / tune
def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from e
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse


def _csv(kind):
    def parse(text: str):
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list: {e}") from e

    return parse


#: ``flashgen bench --MODE [ARG ...]``: the benchmarks beside the main one, flag -> (module of
#: flashgen.bench with ``main(argv, prog)``, help); the rest of the line is the mode's own
#: options (``flashgen bench --gallery --help``)
BENCH_MODES = {
    "decode": ("flashgen.bench.decode",
               "serving: op.with_kvcache's KV-cache read rate against SDPA and FlexAttention "
               "(dense and paged caches, GQA, splits; --sweep picks the decode defaults)"),
    "gallery": ("flashgen.bench.gallery",
                "the variant gallery: each shipped variant's forward and forward+backward "
                "next to FlexAttention's (--direction), written to docs/gallery.md "
                "(--dry-run: densities only, no GPU)"),
    "training": ("flashgen.bench.training",
                 "trainable params (ALiBi slopes, a T5 bias) and attention sinks against the "
                 "same calls without them (--device cpu runs anywhere)"),
    "cpu": ("flashgen.bench.cpu", "the CPU op against torch SDPA on the CPU (no GPU)"),
    "ring": ("flashgen.bench.ring",
             "ring attention (flashgen.distributed) over the GPUs of one host against one GPU "
             "doing the whole sequence"),
    "timeline": ("flashgen.bench.timeline",
                 "where a CTA of the Hopper forward spends its cycles (clock64 probe points; "
                 "sm_90)"),
    "ablation": ("flashgen.bench.ablation",
                 "the Hopper forward with one part of its work patched out at a time, timed "
                 "with its power and clock (sm_90)"),
}  # fmt: skip


def _bench_mode(args) -> int | None:
    """Run the ``--MODE`` benchmark ``args`` names (its module's ``main``); None: none."""
    mode = next((m for m in BENCH_MODES if getattr(args, m, None) is not None), None)
    if mode is None:
        return None
    rest = list(getattr(args, mode))
    if args.specs:
        print(f"error: --{mode} takes its arguments after the flag (flashgen bench --{mode} "
              f"--help): {' '.join(args.specs)}", file=sys.stderr)  # fmt: skip
        return 2
    if mode == "decode":  # as before: bench's --out DIR and --quick, given before --decode
        if "--out" not in rest and "--plot" not in rest:
            rest = ["--out", str(Path(args.out) / "decode.json"), *rest]
        if args.quick and "--quick" not in rest:
            rest.append("--quick")
    module = importlib.import_module(BENCH_MODES[mode][0])
    return module.main(rest, prog=f"flashgen bench --{mode}")


def cmd_bench(args) -> int:
    rc = _bench_mode(args)
    if rc is not None:
        return rc
    from flashgen.bench import report as benchreport
    from flashgen.bench.runner import BenchConfig, run_bench

    out_dir = Path(args.out)
    if args.from_json:
        try:
            doc = benchreport.load(args.from_json)
        except (OSError, ValueError, KeyError) as e:
            print(f"error: cannot read results: {e}", file=sys.stderr)
            return 1
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "results.json").write_text(json.dumps(doc, indent=1))
        for p in benchreport.write_reports(doc, out_dir):
            print(f"wrote {p}", file=sys.stderr)
        print(benchreport.summary(doc))
        return 0
    problem = _require_cuda("bench")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return NO_GPU_EXIT
    cfg = BenchConfig.quick_config() if args.quick else BenchConfig()
    if args.specs:
        cfg.variant_specs = tuple(args.specs)
    if args.dtype:
        cfg.dtypes = args.dtype
    if args.head_dim:
        cfg.head_dims = args.head_dim
    if args.seqlen:
        cfg.seqlens = args.seqlen
    if args.impl:
        cfg.impls = args.impl
    if args.fwd_only:
        cfg.directions = cfg.variant_directions = ("fwd",)
    if args.no_memory:
        cfg.memory = False
    if args.no_variants:
        cfg.variants = False
    if args.no_sweep:
        cfg.dtypes = ()
    if args.budget_s is not None:
        cfg.budget_s = args.budget_s
    if args.rounds is not None:
        cfg.rounds = args.rounds
    if args.warmup_ms is not None:
        cfg.warmup_ms = args.warmup_ms
    doc = run_bench(cfg, out_dir)
    print(benchreport.summary(doc))
    return 0


def cmd_tune(args) -> int:
    from flashgen.bench import autotune
    from flashgen.frontend.spec import load_spec

    specs = []
    for path in args.specs:  # plain stderr: tune must not need rich on the GPU machine
        try:
            specs.append(load_spec(path))
        except SpecError as e:
            print(str(e), file=sys.stderr)
            return 1
        except OSError as e:
            print(f"{path}: error: cannot read spec: {e.strerror or e}", file=sys.stderr)
            return 1
    if args.all_shipped:
        specs += autotune.shipped_tuning_specs()
    if not specs:
        print("error: give SPEC files or --all-shipped", file=sys.stderr)
        return 1
    if args.compile_only:
        compiled = autotune.compile_candidates(specs, args.target or "sm_90", None, args.jobs)
        autotune.print_compile_only(compiled)
        return 0
    problem = _require_cuda("tune")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return NO_GPU_EXIT
    if args.child_out:  # one key's candidates, run by a parent `flashgen tune`
        tags = [t for t in (args.candidates or "").split(",") if t]
        return autotune.run_child(specs[0], tags, args.seqlen, args.quick, args.child_out)
    results = autotune.tune(
        specs,
        quick=args.quick,
        seqlens=args.seqlen,
        table=args.table,
        write=not args.no_write,
        jobs=args.jobs,
        budget_s=args.budget_s,
        isolate=not args.no_isolate,
        log=lambda m: print(m, file=sys.stderr, flush=True),
    )
    if args.out:
        for p in autotune.write_outputs(results, args.out, args.table):
            print(f"wrote {p}", file=sys.stderr)
    print(autotune.report_markdown(results).split("\n## Candidates")[0])
    return 0 if all(r.winner is not None for r in results) else 1


# ----------------------------------------------------------------------------- main
#: each command's ``--help`` text, shown whole (:class:`HelpFormatter`: paragraphs filled
#: to the terminal's width)
DESCRIPTIONS = {
    "build": """\
Check each spec, render and compile every kernel of every (spec, target) with nvcc in
parallel (through the on-disk kernel cache; NVRTC where there is no nvcc), print registers,
spills, shared memory and compile time per kernel, and write <out>/<name>/ (the CUDA sources
and a manifest).  A kernel that spills, or whose wgmma instructions ptxas serialized, fails
the build and leaves <out>/<name>/ as it was.  With a CUDA GPU (and without --no-verify) it
also checks each op against the float64 reference and times it.

Exit 0 on success; 1 for a bad spec, a failed compile, a kernel that spills, a failed
verification or no CUDA compiler.""",
    "show": """\
Print a spec as flashgen checked it (dtype, head dims, the mask and score_mod with their
types, params and their bounds), then for each target the kernel plan (tiles, threads,
shared memory), the --option values in effect (each marked that shapes another unit than
the one shown) and the rendered CUDA source of its forward (the decode unit for a
decode-only spec).  Needs no GPU and no CUDA compiler.""",
    "list": """\
List the specs in DIR, one block per spec: name, dtype and head dims, the mask, the
score_mod and the description, wrapped to the terminal's width.  Without DIR: ./specs if
there is one, else the specs shipped with flashgen.  A spec that does not check is listed
with its error (exit 1).""",
    "cache": """\
Show where the kernel cache is ($FLASHGEN_CACHE_DIR, default ~/.cache/flashgen) and its
size per flashgen version and GPU architecture.  --prune deletes other flashgen versions'
kernels and broken entries, and with --older-than DAYS also kernels not used for that long
(0: every kernel).
Deleting the directory is always safe: kernels are rebuilt on first use.""",
    "tune": """\
Time candidate tile configs (block sizes, warps) of each spec's forward on this GPU and
record the fastest per (GPU, target, head_dim, dtype, causal, score_mod) in the tuning
table (flashgen/tuning/table.json), which the op reads from then on.  Each key runs in its
own child process, so a faulting candidate cannot poison the others.  --compile-only needs
no GPU: it compiles the candidates and prints their registers and spills.  Needs a CUDA GPU
otherwise (exit 2 without one).""",
}

DESCRIPTION = """\
Compile short YAML attention specs into CUDA kernels and PyTorch ops.

A SPEC is a spec file or the name of a shipped spec (`flashgen list` prints them), e.g.
`flashgen show gpt2_d64`; a file that exists wins.  build and show work without a GPU
(build needs a CUDA compiler); bench, tune and ab need a CUDA GPU, except bench --cpu,
tune --compile-only and ab --list-options."""

EPILOG = """\
examples:
  flashgen list                  the shipped specs
  flashgen show mistral_swa      checked expressions, kernel plan, CUDA source
  flashgen build my_spec.yaml    compile for sm_80 and sm_90: registers, spills
  flashgen bench --cpu           the CPU op against SDPA on this machine
  flashgen COMMAND --help        a command's options"""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="flashgen", description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter,
    )  # fmt: skip
    ap.add_argument("--version", action="version", version=f"flashgen {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    raw = HelpFormatter

    b = sub.add_parser(
        "build", help="check, render and compile specs; write generated/",
        description=DESCRIPTIONS["build"], formatter_class=raw,
    )  # fmt: skip
    b.add_argument(
        "--option", action="append", metavar="NAME=VALUE",
        help="a kernel option by dotted name (flashgen.options.Options), e.g. family=fa2",
    )  # fmt: skip
    b.add_argument("specs", nargs="+", metavar="SPEC",
                   help="spec YAML files or shipped spec names")  # fmt: skip
    b.add_argument(
        "--target",
        action="append",
        choices=ir.TARGETS,
        help="target to build (repeatable; default: the spec's targets)",
    )
    b.add_argument("--out", default="generated", help="output directory (default: generated)")
    b.add_argument("--json", action="store_true", help="print one JSON document")
    b.add_argument(
        "--jobs",
        type=_int_at_least(1),
        default=None,
        help="parallel nvcc processes (default: CPU count)",
    )
    b.add_argument(
        "--no-verify", action="store_true", help="skip the GPU correctness check and benchmark"
    )
    b.add_argument(
        "--offsets", action="store_true",
        help="build each spec's offsets form instead (<name>__offsets: the op ring attention "
        "and q_offset= / kv_offset= calls run), to check that it compiles spill-free; nothing "
        "is written to --out or verified",
    )  # fmt: skip
    b.set_defaults(func=cmd_build)

    s = sub.add_parser(
        "show", help="print the checked IR, plan and CUDA source of a spec",
        description=DESCRIPTIONS["show"], formatter_class=raw,
    )  # fmt: skip
    s.add_argument(
        "--option", action="append", metavar="NAME=VALUE",
        help="a kernel option by dotted name (flashgen.options.Options), e.g. family=fa2",
    )  # fmt: skip
    s.add_argument("spec", metavar="SPEC", help="a spec YAML file or a shipped spec's name")
    s.add_argument(
        "--target",
        action="append",
        choices=ir.TARGETS,
        help="target to show (repeatable; default: the spec's targets)",
    )
    s.set_defaults(func=cmd_show)

    ls = sub.add_parser(
        "list", help="list the specs in a directory (default: the shipped ones)",
        description=DESCRIPTIONS["list"], formatter_class=raw,
    )  # fmt: skip
    ls.add_argument(
        "dir", nargs="?", default=None, metavar="DIR",
        help="default: ./specs, else the specs shipped with flashgen",
    )  # fmt: skip
    ls.set_defaults(func=cmd_list)

    ca = sub.add_parser(
        "cache", help="show the kernel cache's size; --prune it",
        description=DESCRIPTIONS["cache"], formatter_class=raw,
    )  # fmt: skip
    ca.add_argument(
        "--prune", action="store_true",
        help="delete other flashgen versions' kernels and broken entries",
    )  # fmt: skip
    ca.add_argument(
        "--older-than", type=float, default=None, metavar="DAYS",
        help="with --prune: also delete kernels not used for DAYS days (a number >= 0; "
        "0: every kernel)",
    )  # fmt: skip
    ca.set_defaults(func=cmd_cache)

    be = sub.add_parser(
        "bench",
        help="benchmark flashgen against SDPA backends, FlexAttention and standard attention",
        description="""\
Benchmark flashgen in the FlashAttention papers' protocol against PyTorch SDPA's flash and
cuDNN backends, FlexAttention and standard attention: forward and forward + backward over
head dims, sequence lengths and dtypes, the shipped variants and memory; write
results.json, results.md and PNG plots into --out.  Needs a CUDA GPU (exit 2 without one);
--from-json rebuilds the reports from saved results anywhere.

The other benchmarks are flags (--decode, --gallery, --training, --cpu, --ring, --timeline,
--ablation) that take the rest of the line as their own options: `flashgen bench --gallery
--help` lists the gallery's.""",
        formatter_class=raw,
    )
    be.add_argument(
        "specs", nargs="*", metavar="SPEC", help="variant specs to compare (default: specs/)"
    )
    be.add_argument("--quick", action="store_true", help="the ~2-minute subset")
    be.add_argument("--out", default="bench-results", help="output directory")
    be.add_argument("--fwd-only", action="store_true", help="skip forward+backward timings")
    be.add_argument("--dtype", type=_csv(str), help="e.g. bf16,fp16")
    be.add_argument("--head-dim", type=_csv(int), help="e.g. 64,128,256")
    be.add_argument("--seqlen", type=_csv(int), help="e.g. 512,1024,2048")
    be.add_argument("--impl", type=_csv(str), help="implementations to time (default: all)")
    be.add_argument("--no-memory", action="store_true", help="skip the memory experiment")
    be.add_argument("--no-variants", action="store_true", help="skip the shipped-variant sweep")
    be.add_argument("--no-sweep", action="store_true", help="skip the head_dim/causal sweep")
    be.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="soft time limit in s (default 540, --quick 300; 0 = none): later rows are skipped",
    )
    be.add_argument(
        "--rounds",
        type=_int_at_least(1),
        default=None,
        help="time each problem's implementations in N alternating rounds and report each "
        "one's median (default 1)",
    )
    be.add_argument(
        "--warmup-ms",
        type=_int_at_least(0),
        default=None,
        help="do_bench warm-up per timing in ms (default 25, --quick 10); a GPU at its power "
        "limit reaches its steady clock only after some 100 ms of load",
    )
    be.add_argument(
        "--from-json",
        nargs="+",
        metavar="RESULTS",
        help="no GPU: merge saved results.json files and rebuild the reports in --out",
    )
    modes = be.add_argument_group(
        "other benchmarks", "each flag takes the rest of the line as its own options "
        "(`flashgen bench --MODE --help`)",
    )  # fmt: skip
    for mode, (_, text) in BENCH_MODES.items():  # one at most: the first takes what follows
        modes.add_argument(f"--{mode}", nargs=argparse.REMAINDER, help=text)
    be.set_defaults(func=cmd_bench)

    tu = sub.add_parser(
        "tune",
        help="time candidate tile configs on this GPU and record the best in the tuning table",
        description=DESCRIPTIONS["tune"], formatter_class=raw,
    )  # fmt: skip
    tu.add_argument("specs", nargs="*", metavar="SPEC", help="spec YAML files")
    tu.add_argument(
        "--all-shipped",
        action="store_true",
        help="tune d64/128/256 x causal/not x bf16/fp16 and the shipped score_mod specs",
    )
    tu.add_argument("--quick", action="store_true", help="seqlen 8192 only, shorter timings")
    tu.add_argument("--seqlen", type=_csv(int), help="seqlens to time (default 8192,16384)")
    tu.add_argument("--table", default=None, help="table file (default flashgen/tuning/table.json)")
    tu.add_argument("--out", default=None, help="also write tune.json, tune.md, table.json here")
    tu.add_argument("--no-write", action="store_true", help="measure only; leave the table")
    tu.add_argument(
        "--jobs", type=_int_at_least(1), default=None, help="parallel nvcc processes"
    )
    tu.add_argument("--budget-s", type=float, default=450.0, help="soft time limit (0 = none)")
    tu.add_argument(
        "--compile-only",
        action="store_true",
        help="no GPU: compile the candidates and print registers/spills",
    )
    tu.add_argument("--target", choices=ir.TARGETS, help="target for --compile-only (sm_90)")
    tu.add_argument(
        "--no-isolate",
        action="store_true",
        help="measure in this process (default: one child process per key, so a faulting "
        "candidate kernel cannot poison the CUDA context of the others)",
    )
    tu.add_argument("--child-out", help=argparse.SUPPRESS)
    tu.add_argument("--candidates", help=argparse.SUPPRESS)
    tu.set_defaults(func=cmd_tune)

    ab.add_parser(sub)  # flashgen ab: flashgen/bench/ab.py
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flashgen`` script; returns the exit status."""
    from flashgen import env

    args = parser().parse_args(argv)
    try:
        env.check_removed()
    except env.RemovedVariableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        with plain_warnings():
            return args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `flashgen show ... | head`: the reader left; not an error
        sys.stderr.close()
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
