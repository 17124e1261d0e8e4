#!/usr/bin/env python3
"""Run compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over flashgen kernels.

For every spec (default: all of ``specs/*.yaml``) and every tool, a fresh Python process
runs the spec's op, forward and backward (``--fwd-only``: forward), under
``compute-sanitizer --tool <tool>`` on small odd-sized problems (GQA, Sq > Sk, Sq < Sk,
length 1), with the sanitizer restricted to flashgen's kernels.
The tool's summary is parsed ("ERROR SUMMARY: N errors", racecheck's "N hazards"),
a table is printed, and the exit status is 1 if any run reported anything, crashed, or
did not finish; 0 if every run is clean.

The backward the driver runs is the op's default one (``deterministic=False``, no param
gradients) unless asked otherwise: ``--deterministic`` passes ``deterministic=True`` to the
op's calls (on sm_90 the Hopper ``hopper_ordered`` units where eligible, else the FA2-class
deterministic ones; the driver fails if another path ran), and ``--param-grads`` makes every
f32 tensor param the op differentiates (:func:`flashgen.bench.protocol.trained_params`, as
``flashgen ab --param-grads`` picks them) require grad, so the param-gradient units run, and
checks each gets a finite gradient.  A spec with no such param (or, under either flag, no
backward) is skipped, not failed: ``skip`` in the table, ``skipped`` (the reason) in the
JSON.  The table's header and every JSON record say which calls ran (flags, options), and
the last column / ``paths``, ``param_units`` which backward kernel sets did.

    python3 tools/sanitize.py                       # everything
    python3 tools/sanitize.py --specs causal_d128 --tools memcheck racecheck
    python3 tools/sanitize.py --json report.json    # also write the results
    python3 tools/sanitize.py --option hopper_bwd.ordered_dq=1   # under a kernel option
    python3 tools/sanitize.py --specs bidir_d256 gemma2_softcap --deterministic
    python3 tools/sanitize.py --specs t5_bias --param-grads \
        --option hopper_bwd.dparam_diagonal=1 --option hopper_bwd.dparam_const_tiles=1

Kernels are compiled once beforehand (outside the sanitizer) into ``$FLASHGEN_CACHE_DIR``
(a temporary directory unless set).  Needs a CUDA GPU, torch, CuPy, nvcc and
compute-sanitizer on PATH.  initcheck runs without output poisoning, so it also catches
a kernel reading ``o``/``lse`` before writing them.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures as cf
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flashgen.bench.options import (  # noqa: E402
    OptionError,
    format_value,
    parse_options,
    with_options,
)
from flashgen.bench.protocol import trained_params  # noqa: E402
from flashgen.families.registry import has_backward  # noqa: E402
from flashgen.frontend.spec import load_spec  # noqa: E402
from flashgen.options import DEFAULT  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
#: (B, Hq, Hkv, Sq, Sk): odd lengths, GQA, both Sq > Sk and Sq < Sk, a length-1 case.
SIZES = ((2, 4, 2, 37, 53), (1, 4, 1, 53, 37), (1, 2, 2, 1, 129), (1, 2, 1, 130, 1))

#: Shared by :data:`DRIVER` and :func:`prebuild`: the op's keyword arguments for one call
#: under the run's flags (``cfg``: ``{"deterministic": bool, "param_grads": bool}``).
CALL = r"""
import json, sys, torch, flashgen
from flashgen.bench.protocol import trained_params
from flashgen.bench.verify import random_inputs
from flashgen.families.registry import has_backward
from flashgen.options import DEFAULT


def call_kwargs(op, params, cfg):
    # (kwargs, trained): params with those trained_params names (the f32 tensor params the
    # op differentiates, as flashgen ab --param-grads picks them) as leaves requiring grad,
    # and deterministic=True if asked (left out otherwise: the op's default)
    trained = trained_params(op.spec) if cfg["param_grads"] else ()
    kw = dict(params)
    for n in trained:
        kw[n] = kw[n].detach().clone().requires_grad_()
    if cfg["deterministic"]:
        kw["deterministic"] = True
    return kw, trained
"""

DRIVER = CALL + r"""
op = flashgen.load(sys.argv[1], options=DEFAULT.with_values(json.loads(sys.argv[3])))
backward = sys.argv[2] == "fwd+bwd" and has_backward(op.spec)  # fp8 specs: forward only
cfg = json.loads(sys.argv[4]) if backward else {"deterministic": False, "param_grads": False}
sizes = [tuple(map(int, s.split(","))) for s in sys.argv[5:]]
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)
for b, hq, hkv, sq, sk in sizes:
    q, k, v, params = random_inputs(op.spec, b, hq, hkv, sq, sk, dev, gen)
    if "window" in op.param_names:
        params["window"] = 7
    kw, trained = call_kwargs(op, params, cfg)
    if backward:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o, lse = op.attention(q, k, v, **kw)
    torch.cuda.synchronize()
    assert not o.isnan().any() and not lse.isnan().any(), "NaN in output"
    if backward:  # the backward's kernels (preprocess, dK/dV, dQ, convert) under the tool too
        o.backward(torch.randn(o.shape, device=dev, dtype=o.dtype, generator=gen))
        torch.cuda.synchronize()
        for t in (q, k, v):
            assert t.grad is not None and torch.isfinite(t.grad).all(), "bad gradient"
        for n in trained:
            g = kw[n].grad
            assert g is not None and torch.isfinite(g).all(), f"bad gradient of param {n}"
if backward:  # which backward kernel set ran (flashgen.ops.prefill.backward.backward_path);
    # keys (device, path[, param names][, "sink"]): a param-gradient unit's third field names
    # the params whose gradients it accumulates
    keys = set(op.backward._kernels)
    paths = sorted({key[1] for key in keys})
    units = sorted([k[1], list(k[2])] for k in keys if len(k) > 2 and isinstance(k[2], tuple))
    print("FLASHGEN BACKWARD PATHS", paths, flush=True)
    print("FLASHGEN PARAM GRAD UNITS", json.dumps(units), flush=True)
    if cfg["deterministic"]:
        assert set(paths) <= {"deterministic", "hopper_ordered"}, f"deterministic ran {paths}"
    if trained:
        assert [u for u in units if u[1] == list(trained)], "no param-gradient unit ran"
print("FLASHGEN DRIVER OK", flush=True)
"""

#: :func:`prebuild`'s program: a tiny forward + backward of each spec given, with the
#: driver's flags (``sys.argv[2]``), builds every kernel the driver launches.
PREBUILD = CALL + r"""
opts = DEFAULT.with_values(json.loads(sys.argv[1]))
cfg = json.loads(sys.argv[2])
dev = torch.device("cuda", torch.cuda.current_device())
for p in sys.argv[3:]:
    op = flashgen.load(p, options=opts)
    q, k, v, params = random_inputs(op.spec, 1, 2, 1, 17, 17, dev, None)
    if not has_backward(op.spec):  # fp8 specs: forward only
        op.attention(q, k, v, **params)
        continue
    kw, _ = call_kwargs(op, params, cfg)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    op.attention(q, k, v, **kw)[0].sum().backward()
"""

_ERRORS = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+error")
_HAZARDS = re.compile(r"RACECHECK SUMMARY:\s*(\d+)\s+hazard")
#: racecheck has no ERROR SUMMARY: "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
_RACE_ERRORS = re.compile(r"RACECHECK SUMMARY:[^(]*\((\d+)\s+error")
_PATHS = re.compile(r"^FLASHGEN BACKWARD PATHS (\[.*\])\s*$", re.M)
_UNITS = re.compile(r"^FLASHGEN PARAM GRAD UNITS (\[.*\])\s*$", re.M)


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
    #: the calls: deterministic=True passed (--deterministic); param gradients asked for
    #: (--param-grads) and the params trained; the kernel options (dotted name -> value)
    deterministic: bool = False
    param_grads: bool = False
    trained: list[str] = field(default_factory=list)
    options: dict = field(default_factory=dict)
    #: why the spec did not run under this configuration ("": it ran)
    skipped: str = ""
    #: the backward paths that ran, and the param-gradient units as "path[name,...]"
    paths: list[str] = field(default_factory=list)
    param_units: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """It ran, and nothing was reported."""
        return self.errors == 0 and self.hazards == 0 and self.exit_code == 0 and self.driver_ok

    @property
    def failed(self) -> bool:
        """It ran and was not clean (a skipped run is neither clean nor failed)."""
        return not self.skipped and not self.clean


def parse_summary(log: str) -> tuple[int | None, int]:
    """(errors, racecheck hazards) from a compute-sanitizer log; errors None if absent."""
    errs = [int(m) for m in _ERRORS.findall(log)] or [int(m) for m in _RACE_ERRORS.findall(log)]
    hazards = [int(m) for m in _HAZARDS.findall(log)]
    return (sum(errs) if errs else None), sum(hazards)


def parse_paths(log: str) -> tuple[list[str], list[str]]:
    """(backward paths, param-gradient units as "path[name,...]") the driver printed; empty
    lists where it printed none (a forward-only run, or it died first)."""
    paths: set[str] = set()
    units: set[str] = set()
    for m in _PATHS.findall(log):
        try:
            paths.update(ast.literal_eval(m))
        except (ValueError, SyntaxError):
            pass
    for m in _UNITS.findall(log):
        try:
            units.update(f"{p}[{','.join(names)}]" for p, names in json.loads(m))
        except (ValueError, TypeError):
            pass
    return sorted(paths), sorted(units)


def skip_reason(spec: Path, deterministic: bool, param_grads: bool) -> tuple[str, list[str]]:
    """(why ``spec`` does not run under the flags, "" if it does; the params
    ``--param-grads`` trains: :func:`flashgen.bench.protocol.trained_params`)."""
    if not (deterministic or param_grads):
        return "", []
    s = load_spec(spec)
    if not has_backward(s):
        return "no backward kernels", []
    trained = list(trained_params(s)) if param_grads else []
    if param_grads and not trained:
        return "no f32 tensor param the op differentiates", []
    return "", trained


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
    deterministic: bool = False,
    param_grads: bool = False,
    trained: list[str] | None = None,
) -> Result:
    """Run the driver for ``spec`` under ``tool`` (forward, and the backward unless
    ``backward`` is false) with the kernel ``options`` (dotted name -> value), passing
    ``deterministic=True`` to the op if ``deterministic``, and with ``param_grads`` the
    params the op differentiates requiring grad (``trained``: their names, for the record);
    never raises."""
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
        json.dumps({"deterministic": deterministic, "param_grads": param_grads}),
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
    paths, units = parse_paths(log)
    return Result(
        spec=spec.stem,
        tool=tool,
        errors=errors,
        hazards=hazards,
        exit_code=code,
        driver_ok="FLASHGEN DRIVER OK" in log,
        seconds=time.perf_counter() - t0,
        log_tail=log[-3000:],
        deterministic=deterministic,
        param_grads=param_grads,
        trained=list(trained or []),
        options=dict(options or {}),
        paths=paths,
        param_units=units,
    )


def prebuild(
    specs: list[Path],
    options: dict | None = None,
    deterministic: bool = False,
    param_grads: bool = False,
) -> None:
    """Compile every spec's kernels once, outside the sanitizer (fills the cache): those a
    backward with the driver's flags launches."""
    cfg = {"deterministic": deterministic, "param_grads": param_grads}
    subprocess.run(
        [sys.executable, "-c", PREBUILD, json.dumps(options or {}), json.dumps(cfg),
         *map(str, specs)],
        check=True,
        cwd=REPO,
    )  # fmt: skip


def header(backward: bool, deterministic: bool, param_grads: bool, options: dict | None) -> str:
    """One line saying which calls the runs made (the table's first line)."""
    opts = " ".join(f"{n}={format_value(v)}" for n, v in (options or {}).items())
    return (
        f"calls: {'forward+backward' if backward else 'forward only'}"
        f"  deterministic={int(deterministic)}  param_grads={int(param_grads)}"
        f"  options: {opts or 'defaults'}"
    )


def _paths_cell(results: list[Result]) -> str:
    """One spec's backward paths over its runs (the param-gradient units after "dparam")."""
    skipped = {r.skipped for r in results if r.skipped}
    if skipped:
        return "skipped: " + "; ".join(sorted(skipped))
    paths = sorted({p for r in results for p in r.paths})
    units = sorted({u for r in results for u in r.param_units})
    cell = ",".join(paths) or "-"
    return cell + (f" (dparam {','.join(units)})" if units else "")


def table(results: list[Result], tools: list[str], head: str = "") -> str:
    """A spec x tool table of outcomes, the backward paths that ran last, ``head`` (a
    :func:`header` line) above it."""
    specs = sorted({r.spec for r in results})
    by = {(r.spec, r.tool): r for r in results}
    width = max([len(s) for s in specs] + [4])
    lines = [head] if head else []
    lines.append(f"{'spec':<{width}}  " + "  ".join(f"{t:<12}" for t in tools) + "  backward paths")
    for s in specs:
        cells = []
        for t in tools:
            r = by.get((s, t))
            if r is None:
                cells.append("-")
            elif r.skipped:
                cells.append("skip")
            elif r.clean:
                cells.append("ok")
            elif r.errors is None:
                cells.append(f"FAIL(exit {r.exit_code})")
            else:
                cells.append(f"FAIL({r.errors}e/{r.hazards}h)")
        paths = _paths_cell([r for r in results if r.spec == s])
        lines.append(f"{s:<{width}}  " + "  ".join(f"{c:<12}" for c in cells) + f"  {paths}")
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
        "--deterministic", action="store_true",
        help="pass deterministic=True to the op (its deterministic backward kernels)",
    )  # fmt: skip
    ap.add_argument(
        "--param-grads", action="store_true",
        help="make the f32 tensor params the op differentiates require grad (the "
        "param-gradient kernels) and check their gradients; specs without one are skipped",
    )  # fmt: skip
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
    if args.fwd_only and (args.deterministic or args.param_grads):
        flag = "--deterministic" if args.deterministic else "--param-grads"
        print(f"{flag} selects backward kernels; drop --fwd-only", file=sys.stderr)
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
    flags = {"deterministic": args.deterministic, "param_grads": args.param_grads}
    try:
        plan = {s: skip_reason(s, **flags) for s in specs}
    except (OSError, ValueError) as e:  # an unreadable or invalid spec
        print(f"--specs: {e}", file=sys.stderr)
        return 2
    ran = [s for s in specs if not plan[s][0]]
    os.environ.setdefault("FLASHGEN_CACHE_DIR", tempfile.mkdtemp(prefix="flashgen-sanitize-"))
    if ran:
        prebuild(ran, options, **flags)
    filt = kernel_filter_args(sanitizer) if ran else []

    def one(spec: Path, tool: str) -> Result:
        why, trained = plan[spec]
        if why:
            return Result(
                spec.stem, tool, None, 0, 0, False, 0.0, "", **flags, options=dict(options),
                skipped=why,
            )  # fmt: skip
        return run_one(
            spec, tool, sanitizer, filt, args.timeout, backward=not args.fwd_only,
            options=options, trained=trained, **flags,
        )  # fmt: skip

    jobs = [(s, t) for s in specs for t in args.tools]
    with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda st: one(*st), jobs))
    print(table(results, args.tools, header(not args.fwd_only, options=options, **flags)))
    bad = [r for r in results if r.failed]
    for r in bad:
        print(f"\n--- {r.spec} / {r.tool}: errors={r.errors} hazards={r.hazards} "
              f"exit={r.exit_code} driver_ok={r.driver_ok}\n{r.log_tail}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    skipped = [r for r in results if r.skipped]
    done = len(results) - len(skipped)
    print(f"\n{done - len(bad)}/{done} clean" + (f", {len(skipped)} skipped" if skipped else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
