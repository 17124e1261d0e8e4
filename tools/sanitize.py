#!/usr/bin/env python3
"""Run compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over flashgen kernels.

For every spec (default: all of ``specs/*.yaml``) and every tool, a fresh Python process
runs the spec's op, forward and backward (``--fwd-only``: forward), under
``compute-sanitizer --tool <tool>`` on small odd-sized problems (GQA, Sq > Sk, Sq < Sk,
length 1), with the sanitizer restricted to flashgen's kernels.
The tool's summary is parsed ("ERROR SUMMARY: N errors", racecheck's "N hazards"),
a table is printed, and the exit status is 1 if any run reported anything, crashed, or
did not finish; 0 if every run is clean.

    python3 tools/sanitize.py                       # everything
    python3 tools/sanitize.py --specs causal_d128 --tools memcheck racecheck
    python3 tools/sanitize.py --json report.json    # also write the results
    python3 tools/sanitize.py --option hopper_bwd.ordered_dq=1   # under a kernel option

Kernels are compiled once beforehand (outside the sanitizer) into ``$FLASHGEN_CACHE_DIR``
(a temporary directory unless set).  Needs a CUDA GPU, torch, CuPy, nvcc and
compute-sanitizer on PATH.  initcheck runs without output poisoning, so it also catches
a kernel reading ``o``/``lse`` before writing them.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flashgen.bench.options import OptionError, parse_options, with_options  # noqa: E402
from flashgen.options import DEFAULT  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
#: (B, Hq, Hkv, Sq, Sk): odd lengths, GQA, both Sq > Sk and Sq < Sk, a length-1 case.
SIZES = ((2, 4, 2, 37, 53), (1, 4, 1, 53, 37), (1, 2, 2, 1, 129), (1, 2, 1, 130, 1))

DRIVER = r"""
import json, sys, torch, flashgen
from flashgen.bench.verify import random_inputs
from flashgen.families.registry import has_backward
from flashgen.options import DEFAULT
op = flashgen.load(sys.argv[1], options=DEFAULT.with_values(json.loads(sys.argv[3])))
backward = sys.argv[2] == "fwd+bwd" and has_backward(op.spec)  # fp8 specs: forward only
sizes = [tuple(map(int, s.split(","))) for s in sys.argv[4:]]
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)
for b, hq, hkv, sq, sk in sizes:
    q, k, v, params = random_inputs(op.spec, b, hq, hkv, sq, sk, dev, gen)
    if "window" in op.param_names:
        params["window"] = 7
    if backward:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o, lse = op.attention(q, k, v, **params)
    torch.cuda.synchronize()
    assert not o.isnan().any() and not lse.isnan().any(), "NaN in output"
    if backward:  # the backward's kernels (preprocess, dK/dV, dQ, convert) under the tool too
        o.backward(torch.randn(o.shape, device=dev, dtype=o.dtype, generator=gen))
        torch.cuda.synchronize()
        for t in (q, k, v):
            assert t.grad is not None and torch.isfinite(t.grad).all(), "bad gradient"
if backward:  # which backward kernel set ran (flashgen.ops.prefill.backward.backward_path)
    print("FLASHGEN BACKWARD PATHS", sorted({key[1] for key in op.backward._kernels}), flush=True)
print("FLASHGEN DRIVER OK", flush=True)
"""

_ERRORS = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+error")
_HAZARDS = re.compile(r"RACECHECK SUMMARY:\s*(\d+)\s+hazard")
#: racecheck has no ERROR SUMMARY: "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
_RACE_ERRORS = re.compile(r"RACECHECK SUMMARY:[^(]*\((\d+)\s+error")


@dataclass
class Result:
    """Outcome of one (spec, tool) run."""

    spec: str
    tool: str
    errors: int | None  # None: no summary found
    hazards: int
    exit_code: int
    driver_ok: bool
    seconds: float
    log_tail: str

    @property
    def clean(self) -> bool:
        return self.errors == 0 and self.hazards == 0 and self.exit_code == 0 and self.driver_ok


def parse_summary(log: str) -> tuple[int | None, int]:
    """(errors, racecheck hazards) from a compute-sanitizer log; errors None if absent."""
    errs = [int(m) for m in _ERRORS.findall(log)] or [int(m) for m in _RACE_ERRORS.findall(log)]
    hazards = [int(m) for m in _HAZARDS.findall(log)]
    return (sum(errs) if errs else None), sum(hazards)


def kernel_filter_args(sanitizer: str) -> list[str]:
    """Arguments restricting checks to flashgen's kernels (option name differs by version)."""
    try:
        helptext = subprocess.run(
            [sanitizer, "--help"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        helptext = ""
    if "--kernel-name" in helptext:
        return ["--kernel-name", "kns=flashgen"]
    if "--filter" in helptext:
        return ["--filter", "kns=flashgen"]
    return []


def run_one(
    spec: Path,
    tool: str,
    sanitizer: str,
    filt: list[str],
    timeout: int,
    backward: bool = True,
    options: dict | None = None,
) -> Result:
    """Run the driver for ``spec`` under ``tool`` (forward, and the backward unless
    ``backward`` is false) with the kernel ``options`` (dotted name -> value); never
    raises."""
    # initcheck must watch every kernel: with a kernel filter, the writes of the
    # unfiltered kernels (torch.randn, .to()) go unrecorded and every read of our inputs is
    # reported as uninitialized (seen on the H200: 4576 false reports filtered, 0 unfiltered).
    cmd = [
        sanitizer,
        "--tool",
        tool,
        *(filt if tool != "initcheck" else []),
        "--print-limit",
        "20",
        sys.executable,
        "-c",
        DRIVER,
        str(spec),
        "fwd+bwd" if backward else "fwd",
        json.dumps(options or {}),
        *(",".join(map(str, s)) for s in SIZES),
    ]
    if tool == "racecheck":
        cmd[3:3] = ["--racecheck-report", "all"]
    t0 = time.perf_counter()
    env = {**os.environ, "FLASHGEN_POISON_OUTPUTS": "0"}
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env
        )
        log, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        log = f"{e.stdout or ''}{e.stderr or ''}\nTIMEOUT after {timeout}s"
        code = -1
    errors, hazards = parse_summary(log)
    return Result(
        spec=spec.stem,
        tool=tool,
        errors=errors,
        hazards=hazards,
        exit_code=code,
        driver_ok="FLASHGEN DRIVER OK" in log,
        seconds=time.perf_counter() - t0,
        log_tail=log[-3000:],
    )


def prebuild(specs: list[Path], options: dict | None = None) -> None:
    """Compile every spec's kernel once, outside the sanitizer (fills the cache)."""
    code = (  # a tiny forward + backward builds every kernel the driver launches
        "import json, sys, torch, flashgen\n"
        "from flashgen.bench.verify import random_inputs\n"
        "from flashgen.families.registry import has_backward\n"
        "from flashgen.options import DEFAULT\n"
        "opts = DEFAULT.with_values(json.loads(sys.argv[1]))\n"
        "dev = torch.device('cuda', torch.cuda.current_device())\n"
        "for p in sys.argv[2:]:\n"
        "    op = flashgen.load(p, options=opts)\n"
        "    q, k, v, params = random_inputs(op.spec, 1, 2, 1, 17, 17, dev, None)\n"
        "    if not has_backward(op.spec):  # fp8 specs: forward only\n"
        "        op.attention(q, k, v, **params)\n"
        "        continue\n"
        "    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))\n"
        "    op.attention(q, k, v, **params)[0].sum().backward()\n"
    )
    subprocess.run(
        [sys.executable, "-c", code, json.dumps(options or {}), *map(str, specs)],
        check=True,
        cwd=REPO,
    )


def table(results: list[Result], tools: list[str]) -> str:
    """A spec x tool table of outcomes."""
    specs = sorted({r.spec for r in results})
    by = {(r.spec, r.tool): r for r in results}
    width = max([len(s) for s in specs] + [4])
    lines = [f"{'spec':<{width}}  " + "  ".join(f"{t:<12}" for t in tools)]
    for s in specs:
        cells = []
        for t in tools:
            r = by.get((s, t))
            if r is None:
                cells.append("-")
            elif r.clean:
                cells.append("ok")
            elif r.errors is None:
                cells.append(f"FAIL(exit {r.exit_code})")
            else:
                cells.append(f"FAIL({r.errors}e/{r.hazards}h)")
        lines.append(f"{s:<{width}}  " + "  ".join(f"{c:<12}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0 clean, 1 reports, 2 setup)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", nargs="*", help="spec names or paths (default: specs/*.yaml)")
    ap.add_argument("--tools", nargs="*", default=list(TOOLS), choices=TOOLS)
    ap.add_argument("--jobs", type=int, default=4, help="sanitizer runs in parallel")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per run")
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--fwd-only", action="store_true", help="skip the backward kernels")
    ap.add_argument(
        "--option", action="append", default=[], metavar="NAME=VALUE",
        help="a kernel option by dotted name (flashgen.options.Options), e.g. "
        "hopper_bwd.ordered_dq=1; repeatable",
    )  # fmt: skip
    args = ap.parse_args(argv)
    try:
        options = {n: vs[0] for n, vs in parse_options(args.option).items()}
        with_options(DEFAULT, options)
    except OptionError as e:
        print(f"--option: {e}", file=sys.stderr)
        return 2

    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        print("compute-sanitizer is not on PATH", file=sys.stderr)
        return 2
    if args.specs:
        specs = [
            Path(s) if s.endswith(".yaml") else REPO / "specs" / f"{s}.yaml" for s in args.specs
        ]
    else:
        specs = sorted((REPO / "specs").glob("*.yaml"))
        specs = [p for p in specs if "v_from_k: true" not in p.read_text()]  # decode only
    os.environ.setdefault("FLASHGEN_CACHE_DIR", tempfile.mkdtemp(prefix="flashgen-sanitize-"))
    prebuild(specs, options)
    filt = kernel_filter_args(sanitizer)
    jobs = [(s, t) for s in specs for t in args.tools]
    with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(
            pool.map(
                lambda st: run_one(
                    st[0], st[1], sanitizer, filt, args.timeout,
                    backward=not args.fwd_only, options=options,
                ),  # fmt: skip
                jobs,
            )
        )
    print(table(results, args.tools))
    bad = [r for r in results if not r.clean]
    for r in bad:
        print(f"\n--- {r.spec} / {r.tool}: errors={r.errors} hazards={r.hazards} "
              f"exit={r.exit_code} driver_ok={r.driver_ok}\n{r.log_tail}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(f"\n{len(results) - len(bad)}/{len(results)} clean")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
