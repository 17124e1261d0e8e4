"""Command line: ``flashgen build | show | list | bench | tune`` (also ``python -m flashgen``).

    flashgen build SPEC... [--target sm_80|sm_90]... [--out generated] [--json] [--jobs N]
                           [--no-verify]
        check each spec, render and compile every (spec, target) with nvcc in parallel
        (through the kernel cache), print registers / spills / shared memory / compile
        time, write <out>/<name>/.  With a CUDA GPU (and without --no-verify) also check
        each op against the float64 reference and time it.
        Exit 0 on success; 1 for a bad spec, a failed compile, a kernel that spills, a
        failed verification or missing nvcc (a spec whose compile failed or spilled is not
        written).
    flashgen show SPEC [--target T]    the checked IR, the kernel plan and the CUDA source
    flashgen list [DIR]                the specs in DIR (default specs/)
    flashgen bench [SPEC...] [--quick] [--out DIR] [--fwd-only] [--from-json RESULTS...]
        benchmark against PyTorch SDPA backends, FlexAttention and standard attention
        (flashgen/bench/runner.py); exit 2 without a CUDA GPU
    flashgen tune [SPEC...] [--all-shipped] [--quick] [--out DIR] [--compile-only]
        time candidate tile configs, record winners in flashgen/tuning/table.json
        (flashgen/bench/autotune.py); exit 2 without a CUDA GPU

torch is imported only for verification on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from flashgen import __version__
from flashgen.frontend import ir
from flashgen.frontend.errors import SpecError

# ----------------------------------------------------------------------------- IR printing
_PREC = {
    "||": 1,
    "&&": 2,
    "==": 3,
    "!=": 3,
    "<": 4,
    "<=": 4,
    ">": 4,
    ">=": 4,
    "+": 5,
    "-": 5,
    "*": 6,
    "/": 6,
    "%": 6,
}


def _prec(e: ir.Expr) -> int:
    if isinstance(e, ir.Cond):
        return 0
    if isinstance(e, ir.Binary):
        return _PREC[e.op]
    return 9


def format_expr(e: ir.Expr | None) -> str:
    """DSL text of an expression tree, with only the parentheses precedence needs."""
    if e is None:
        return "-"
    if isinstance(e, ir.Const):
        if isinstance(e.value, bool):
            return "true" if e.value else "false"
        text = repr(e.value)
        if isinstance(e.value, float) and "." not in text and "e" in text:
            text = text.replace("e", ".0e", 1)  # the DSL's floats need a dot: 1e-05 -> 1.0e-05
        return text
    if isinstance(e, ir.Var):
        return e.name
    if isinstance(e, ir.Causal):
        return "causal"
    if isinstance(e, ir.Index):
        return f"{e.name}[{', '.join(format_expr(i) for i in e.indices)}]"
    if isinstance(e, ir.Call):
        return f"{e.fn}({', '.join(format_expr(a) for a in e.args)})"
    if isinstance(e, ir.Unary):
        arg = format_expr(e.arg)
        return f"{e.op}({arg})" if _prec(e.arg) < 9 else f"{e.op}{arg}"
    if isinstance(e, ir.Binary):
        p = _PREC[e.op]
        lhs, rhs = format_expr(e.lhs), format_expr(e.rhs)
        if _prec(e.lhs) < p:
            lhs = f"({lhs})"
        if _prec(e.rhs) <= p:
            rhs = f"({rhs})"
        return f"{lhs} {e.op} {rhs}"
    if isinstance(e, ir.Cond):
        c, a, b = format_expr(e.cond), format_expr(e.then), format_expr(e.other)
        c = f"({c})" if _prec(e.cond) == 0 else c
        return f"{c} ? {a} : {b}"
    return repr(e)


def format_spec(spec: ir.Spec) -> str:
    """A readable, multi-line rendering of a checked spec."""
    lines = [
        f"spec {spec.name}   ({spec.path})",
        f"  dtype          {spec.dtype}",
        f"  head_dim       {spec.head_dim} (v: {spec.head_dim_v})",
        f"  targets        {', '.join(spec.targets)}",
        f"  mask           {format_expr(spec.mask)}"
        + (f"   : {spec.mask.ty.value}" if spec.mask is not None and spec.mask.ty else ""),
        f"  score_mod      {format_expr(spec.score_mod)}"
        + (
            f"   : {spec.score_mod.ty.value}"
            if spec.score_mod is not None and spec.score_mod.ty
            else ""
        ),
        "  softmax_scale  "
        + ("auto (1/sqrt(head_dim))" if spec.softmax_scale is None else repr(spec.softmax_scale)),
    ]
    if spec.params:
        lines.append("  params")
        for p in spec.params:
            if p.kind == "tensor":
                lines.append(f"    {p.name}: tensor [{', '.join(map(str, p.shape))}] {p.ty.value}")
            else:
                lines.append(f"    {p.name}: {p.ty.value} = {p.default!r}")
    t = spec.tiles
    if any(x is not None for x in (t.block_m, t.block_n, t.num_warps)):
        lines.append(
            f"  tiles          block_m={t.block_m} block_n={t.block_n} num_warps={t.num_warps}"
        )
    if spec.varlen:
        lines.append("  varlen         true (packed sequences: cu_seqlens_q/k, max_seqlen_q/k)")
    if spec.description:
        lines.append(f"  description    {spec.description}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- build
@dataclass
class BuildResult:
    """Outcome of compiling one (spec, target)."""

    spec: ir.Spec
    target: str
    unit: str = "fwd"  # "fwd", "fwd_sparse", "bwd", "bwd_atomic", "bwd_wgmma": lower.compile_units
    plan: object | None = None  # the KernelPlan / BackwardPlan compiled (flashgen.select)
    report: object | None = None  # CompileReport
    cubin: str | None = None
    smem_dynamic: int = 0
    error: str | None = None
    note: str | None = None  # e.g. the Hopper backward fell back to the FA2-class kernels

    @property
    def ok(self) -> bool:
        r = self.report
        return self.error is None and r is not None and not r.spill_bytes and not r.wgmma_serialized

    def to_dict(self) -> dict:
        r = self.report
        return {
            "spec": self.spec.name,
            "target": self.target,
            "unit": self.unit,
            "ok": self.ok,
            "error": self.error,
            "registers": r.registers if r else None,
            "spill_stores": r.spill_stores if r else None,
            "spill_loads": r.spill_loads if r else None,
            "smem_static": r.smem if r else None,
            "smem_dynamic": self.smem_dynamic,
            "stack_frame": r.stack_frame if r else None,
            "wgmma_serialized": list(r.wgmma_serialized) if r else None,
            "compile_seconds": round(r.seconds, 3) if r else None,
            "cached": r.from_cache if r else None,
            "cubin": self.cubin,
            "note": self.note,
        }


def _options(args):
    """The :class:`flashgen.options.Options` of ``--option NAME=VALUE`` flags (dotted names,
    :meth:`~flashgen.options.Options.replace_path`)."""
    from flashgen.options import DEFAULT

    out = DEFAULT
    for item in getattr(args, "option", None) or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--option {item!r}: expected NAME=VALUE")
        out = out.replace_path(name.strip(), value)
    return out


def _compile_one(spec: ir.Spec, target: str, unit: str, options=None) -> BuildResult:
    from flashgen.build.compile import CompileError
    from flashgen.families.build import build_backward, build_forward
    from flashgen.families.registry import persistent_scheduler
    from flashgen.options import DEFAULT

    options = options or DEFAULT

    res = BuildResult(spec, target, unit)
    try:
        if unit in ("fwd", "fwd_sparse"):
            sparse = unit == "fwd_sparse"  # as the op: its own scheduler (sparse_persistent)
            sp = options.sparse_persistent
            res.plan, path, res.report = build_forward(
                spec, target, options=options, sparse=sparse,
                persistent=(False if sp == "off" else sp) if sparse
                else persistent_scheduler(spec, options),
            )  # fmt: skip
            res.smem_dynamic = res.plan.smem_bytes
        else:
            res.plan, path, res.report = build_backward(
                spec, target, atomic_dq=unit == "bwd_atomic", hopper=unit == "bwd_wgmma",
                options=options,
            )  # fmt: skip
            res.smem_dynamic = max(k.smem_bytes for k in res.plan.kernels)
            if unit == "bwd_wgmma" and not res.plan.wgmma:
                res.note = (
                    "the Hopper (wgmma) backward spills in every dQ variant; the op falls back "
                    f"to the FA2-class kernels ({res.plan.dkdv.template}), whose numbers this "
                    "row shows"
                )
        res.cubin = str(path)
        if res.report.spill_bytes:
            res.error = (
                f"kernel spills: {res.report.spill_stores} bytes stores, "
                f"{res.report.spill_loads} bytes loads"
            )
        elif res.report.wgmma_serialized:
            k = res.report.kernel(res.report.wgmma_serialized[0])
            res.error = f"ptxas serialized the wgmma instructions of {k.name}: {k.wgmma_serialized}"
    except CompileError as e:
        res.error = str(e)
    except (ValueError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _load_specs(paths: list[str], err, errors: list | None = None) -> list[ir.Spec] | None:
    """The specs at ``paths``, or None after printing every error to ``err`` (and
    appending ``{file, line, col, message}`` to ``errors`` for ``--json``)."""
    from flashgen.frontend.spec import load_spec

    def note(file, message, line=None, col=None):
        if errors is not None:
            errors.append({"file": str(file), "line": line, "col": col, "message": message})

    specs, bad = [], False
    by_name: dict[str, str] = {}
    for p in dict.fromkeys(paths):  # a file named twice is built once
        try:
            spec = load_spec(p)
            if spec.name in by_name:  # one generated/<name>/ folder, one torch op name
                msg = (
                    f"spec name '{spec.name}' is also the name of {by_name[spec.name]}; both "
                    f"would write {spec.name}/ and register torch.ops.flashgen.{spec.name}: "
                    "rename one"
                )
                err.print(f"{p}: error: {msg}", markup=False)
                note(p, msg)
                bad = True
                continue
            by_name[spec.name] = p
            specs.append(spec)
        except SpecError as e:
            err.print(str(e), markup=False, highlight=False)
            note(e.file, e.message, e.line, e.col)
            bad = True
        except OSError as e:
            err.print(f"{p}: error: cannot read spec: {e.strerror or e}", markup=False)
            note(p, f"cannot read spec: {e.strerror or e}")
            bad = True
    return None if bad else specs


def _consoles():
    from rich.console import Console

    # a pipe or file gets wide tables rather than rich's 80-column default
    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160
    out = Console(file=sys.stdout, soft_wrap=False, highlight=False, width=width, emoji=False)
    # errors are not wrapped: a spec error's caret must stay under its column
    err = Console(file=sys.stderr, soft_wrap=True, highlight=False, emoji=False)
    return out, err


def _fail_json(args, message: str, errors: list | None = None) -> int:
    """Exit status 1, printing ``{"ok": false, "error": ...}`` first in ``--json`` mode
    (with ``"errors"``, the spec errors' locations, where there are any)."""
    if args.json:
        doc = {"flashgen_version": __version__, "ok": False, "error": message}
        if errors:
            doc["errors"] = errors
        print(json.dumps(doc))
    return 1


def cmd_build(args) -> int:
    from rich.table import Table

    from flashgen.build.compile import CompileError, find_nvcc, nvcc_version
    from flashgen.build.generate import write_generated
    from flashgen.families.hopper_bwd import eligible as hopper_bwd_eligible
    from flashgen.families.registry import choose_tiles, persistent_scheduler, sparse_tiles

    out, err = _consoles()
    try:
        options = _options(args)
        family = options.family
    except (KeyError, ValueError) as e:
        err.print(f"error: {e}", markup=False)
        return _fail_json(args, str(e))
    spec_errors: list = []
    specs = _load_specs(args.specs, err, spec_errors)
    if specs is None:
        return _fail_json(args, "spec errors (see stderr)", spec_errors)
    pairs = []
    for spec in specs:
        for t in dict.fromkeys(args.target or spec.targets):
            if t in spec.targets:
                pairs.append((spec, t))
            else:
                err.print(f"note: {spec.name} does not list target {t}; skipped", markup=False)
    try:
        find_nvcc()
        toolkit = nvcc_version()
    except CompileError as e:
        err.print(f"error: {e}", markup=False)
        err.print("flashgen build needs the CUDA toolkit's nvcc to compile kernels.", markup=False)
        return _fail_json(args, str(e))

    results: list[BuildResult] = []
    jobs = max(1, args.jobs or os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        units = ("fwd", "bwd", "bwd_atomic")  # every unit of registry.compile_units
        futures = [pool.submit(_compile_one, s, t, u, options) for s, t in pairs for u in units]
        futures += [  # the Hopper backward unit, where the spec takes it
            pool.submit(_compile_one, s, t, "bwd_wgmma", options)
            for s, t in pairs
            if hopper_bwd_eligible(s, t, family)
        ]
        futures += [  # the forward for calls whose mask keeps few keys per row, where it differs
            pool.submit(_compile_one, s, t, "fwd_sparse", options)
            for s, t in pairs
            if not persistent_scheduler(s, options)
            and sparse_tiles(s, choose_tiles(s, t, None, options), options) is not None
        ]
        if len(futures) > 1 and not args.json and err.is_terminal:
            from rich.progress import Progress

            with Progress(console=err, transient=True) as progress:
                task = progress.add_task(f"compiling {len(futures)} kernels", total=len(futures))
                for _ in as_completed(futures):
                    progress.advance(task)
        results = [f.result() for f in futures]

    generated, unwritten = [], []
    for spec in specs:
        mine = [r for r in results if r.spec is spec]
        if not mine:
            continue
        if not all(r.ok for r in mine):  # a failed build leaves generated/ as it was
            unwritten.append(spec.name)
            continue
        reports = {(r.target, r.unit): r.report for r in mine if r.report is not None}
        targets = tuple(dict.fromkeys(r.target for r in mine))
        try:
            plans = {(r.target, r.unit): r.plan for r in mine if r.plan is not None}
            generated.append(
                str(write_generated(spec, args.out, reports, targets=targets, plans=plans))
            )
        except (ValueError, OSError) as e:
            err.print(f"error: writing {spec.name}: {e}", markup=False)
            return 1

    verify = []
    if not args.no_verify and _cuda_available():
        verify = [
            _verify_safely(spec) for spec in specs if all(r.ok for r in results if r.spec is spec)
        ]

    ok = all(r.ok for r in results) and all(v["ok"] for v in verify)
    if args.json:
        doc = {
            "flashgen_version": __version__,
            "nvcc_version": toolkit,
            "ok": ok,
            "kernels": [r.to_dict() for r in results],
            "generated": generated,
            "verify": verify,
        }
        print(json.dumps(doc, indent=2))
        return 0 if ok else 1

    table = Table(title=f"flashgen {__version__} build (nvcc {toolkit})")
    for col in ("spec", "target", "kernel", "regs", "spills st/ld (B)", "smem (B)", "compile (s)"):
        table.add_column(col, justify="left" if col in ("spec", "target", "kernel") else "right")
    for r in results:
        rep = r.report
        if rep is None:
            table.add_row(r.spec.name, r.target, r.unit, "-", "-", "-", "[red]FAILED[/red]")
            continue
        spill = f"{rep.spill_stores}/{rep.spill_loads}"
        table.add_row(
            r.spec.name,
            r.target,
            f"{r.unit} (fallback)" if r.note else r.unit,
            str(rep.registers),
            spill if not rep.spill_bytes else f"[red]{spill}[/red]",
            str(r.smem_dynamic + rep.smem),
            "cached" if rep.from_cache else f"{rep.seconds:.1f}",
        )
    out.print(table)
    for r in results:
        if r.note:
            err.print(f"note: {r.spec.name} [{r.target} {r.unit}]: {r.note}", markup=False)
        if r.error:
            err.print(f"error: {r.spec.name} [{r.target} {r.unit}]: {r.error}", markup=False)
    if verify:
        vt = Table(title="verification against the float64 reference")
        for col in ("spec", "case", "max |err|", "bound", "result", "TFLOP/s"):
            vt.add_column(col)
        for v in verify:
            for c in v["cases"]:
                vt.add_row(
                    v["spec"],
                    c["case"],
                    f"{c['max_err']:.2e}",
                    f"{c['bound']:.2e}",
                    "pass" if c["ok"] else "[red]FAIL[/red]",
                    "",
                )
            if v.get("error"):
                vt.add_row(v["spec"], "-", "", "", "[red]ERROR[/red]", "")
            if v.get("tflops") is not None:
                vt.add_row(v["spec"], v["bench_case"], "", "", "", f"{v['tflops']:.1f}")
        out.print(vt)
    elif not args.no_verify and not args.json:
        err.print("note: no CUDA GPU here: kernels compiled, not run or verified", markup=False)
    for v in verify:
        if v.get("error"):
            err.print(f"error: verifying {v['spec']}: {v['error']}", markup=False)
    for g in generated:
        out.print(f"wrote {g}/", markup=False)
    for name in unwritten:
        err.print(f"note: {name} not written to {args.out}/ (its build failed)", markup=False)
    return 0 if ok else 1


# ----------------------------------------------------------------------------- verify (GPU)
def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def random_inputs(
    spec: ir.Spec, b: int, hq: int, hkv: int, sq: int, sk: int, device, generator=None
) -> tuple:
    """Random q, k, v (spec dtype, ``torch.randn``) and tensor params for one problem
    (see :func:`random_tensor_params`)."""
    import torch

    from flashgen.ops.op import TORCH_DTYPE

    dt = TORCH_DTYPE[spec.dtype]

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=generator).to(dt)

    q = randn(b, hq, sq, spec.head_dim)
    k = randn(b, hkv, sk, spec.head_dim)
    v = randn(b, hkv, sk, spec.head_dim_v)
    sym = {"batch": b, "num_heads": hq, "num_heads_kv": hkv, "seqlen_q": sq, "seqlen_k": sk}
    return q, k, v, random_tensor_params(spec, sym, device, generator)


def random_tensor_params(spec: ir.Spec, sizes: dict, device, generator=None) -> dict:
    """Random values of ``spec``'s tensor params, shaped by ``sizes`` (shape symbol -> int).

    Float params are uniform in [0, 1).  Int params whose last axis is ``seqlen_q`` or
    ``seqlen_k`` are document ids: uniform in [0, 4), sorted along that axis (packed
    documents, so a block table has EMPTY, FULL and PARTIAL tiles); other int params are
    uniform in [0, 16).
    """
    import torch

    from flashgen.ops.op import PARAM_DTYPE

    params = {}
    for p in spec.tensor_params:
        shape = [d if isinstance(d, int) else sizes[d] for d in p.shape]
        if p.ty == ir.Ty.F32:
            params[p.name] = torch.rand(shape, device=device, generator=generator)
            continue
        doc = p.shape[-1] in ("seqlen_q", "seqlen_k")
        t = torch.randint(
            0, 4 if doc else 16, shape, device=device, generator=generator, dtype=PARAM_DTYPE[p.ty]
        )
        params[p.name] = t.sort(dim=-1).values if doc else t
    return params


def error_bound(spec: ir.Spec, q, k, v, params: dict) -> tuple:
    """(fp64 reference o, fp64 reference lse, bound on max |o - ref|).

    The bound is 2x the error of the same reference computed in the input dtype (what
    plain PyTorch low-precision math achieves) plus 1e-3.
    """
    import torch

    from flashgen.ops.reference import attention_reference

    ref_o, ref_lse = attention_reference(spec, q, k, v, params=params, compute_dtype=torch.float64)
    low_o, _ = attention_reference(spec, q, k, v, params=params, compute_dtype=q.dtype)
    torch_err = (low_o.double() - ref_o).abs().max().item() if ref_o.numel() else 0.0
    return ref_o, ref_lse, 2 * torch_err + 1e-3


def _verify_safely(spec: ir.Spec) -> dict:
    """:func:`verify_spec`, with any failure (CUDA error, bad kernel) turned into a result."""
    try:
        return verify_spec(spec)
    except Exception as e:  # report it; do not crash the build summary
        return {"spec": spec.name, "ok": False, "cases": [], "error": f"{type(e).__name__}: {e}"}


def call_padded(op, q, k, v, params):
    """``op.attention(q, k, v, **params)`` on padded ``[B, H, S, D]`` inputs; a varlen op
    gets them packed as B sequences of equal length, and its o, lse come back in the
    padded layout (``[B, Hq, Sq, Dv]``, ``[B, Hq, Sq]``)."""
    if not op.spec.varlen:
        return op.attention(q, k, v, **params)
    import torch

    b, hq, sq, _ = q.shape
    sk = k.shape[2]

    def pack(t):
        return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])

    def cu(s):
        return torch.arange(b + 1, dtype=torch.int32, device=q.device) * s

    o, lse = op.attention(pack(q), pack(k), pack(v), cu(sq), cu(sk), sq, sk, **params)
    return o.view(b, sq, hq, -1).transpose(1, 2), lse.view(hq, b, sq).transpose(0, 1)


def verify_spec(spec: ir.Spec) -> dict:
    """Check the CUDA op against the fp64 reference and time it (needs a CUDA GPU)."""
    import torch

    from flashgen.bench.runner import do_bench_ms
    from flashgen.codegen.cuda_expr import split_causal
    from flashgen.ops.op import build_op

    op = build_op(spec)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    cases = []
    for sq, sk in ((257, 257), (100, 257)):
        q, k, v, params = random_inputs(spec, 2, 4, 2, sq, sk, dev, gen)
        o, lse = call_padded(op, q, k, v, params)
        ref_o, ref_lse, bound = error_bound(spec, q, k, v, params)
        e = (o.double() - ref_o).abs().max().item()
        ok = math.isfinite(e) and e <= bound
        cases.append({"case": f"B=2 H=4/2 Sq={sq} Sk={sk}", "max_err": e, "bound": bound, "ok": ok})
    s = 8192 if max(spec.head_dim, spec.head_dim_v) > 128 else 16384
    q, k, v, params = random_inputs(spec, 1, 16, 16, s, s, dev, gen)
    ms = do_bench_ms(lambda: call_padded(op, q, k, v, params), warmup_ms=25, rep_ms=100)

    d_sum = spec.head_dim + spec.head_dim_v  # Q K^T costs 2·S²·D, P V costs 2·S²·Dv
    flops = 2 * s * s * 16 * d_sum * (0.5 if split_causal(spec.mask)[0] else 1.0)
    return {
        "spec": spec.name,
        "ok": all(c["ok"] for c in cases),
        "cases": cases,
        "bench_case": f"B=1 H=16 S={s}",
        "ms": ms,
        "tflops": flops / (ms * 1e-3) / 1e12,
    }


# ----------------------------------------------------------------------------- show / list
def cmd_show(args) -> int:
    from flashgen.build.render import render
    from flashgen.families.registry import plan_forward

    _, err = _consoles()
    specs = _load_specs([args.spec], err)
    if specs is None:
        return 1
    spec = specs[0]
    print(format_spec(spec))
    targets = args.target or list(spec.targets)
    for t in targets:
        try:
            plan = plan_forward(spec, t, _options(args))
        except ValueError as e:
            err.print(f"error: {spec.name} [{t}]: {e}", markup=False)
            return 1
        print(f"\n// ---- plan [{t}]: {json.dumps(plan.config())}")
        print(f"// ---- source [{t}]: kernel {plan.kernel_name}, {plan.gencode}")
        sys.stdout.write(render(plan))
    return 0


def cmd_list(args) -> int:
    from flashgen.frontend.spec import load_spec

    root = Path(args.dir)
    if not root.is_dir():
        print(f"error: {root} is not a directory", file=sys.stderr)
        return 1
    rows = [("name", "dtype", "head_dim", "mask", "score_mod", "description")]
    bad = False
    for f in sorted(root.glob("*.yaml")) + sorted(root.glob("*.yml")):
        try:
            s = load_spec(f)
        except SpecError as e:
            rows.append(
                (f.stem, "-", "-", "-", "-", f"ERROR {e.file}:{e.line}:{e.col}: {e.message}")
            )
            bad = True
            continue
        except OSError as e:  # a directory named *.yaml, a dangling link, no permission
            rows.append((f.stem, "-", "-", "-", "-", f"ERROR cannot read spec: {e.strerror or e}"))
            bad = True
            continue
        hd = str(s.head_dim) if s.head_dim == s.head_dim_v else f"{s.head_dim}/{s.head_dim_v}"
        rows.append(
            (s.name, s.dtype, hd, format_expr(s.mask), format_expr(s.score_mod), s.description)
        )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True)) + "  " + r[5])
    return 1 if bad else 0


# ----------------------------------------------------------------------------- bench / tune
NO_GPU_EXIT = 2


def _require_cuda(what: str) -> str | None:
    """None if torch sees a CUDA device, else the message explaining why ``what`` cannot run."""
    try:
        import torch
    except ImportError:
        return f"flashgen {what} needs PyTorch with CUDA: torch is not installed."
    if not torch.cuda.is_available():
        return (
            f"flashgen {what} needs a CUDA GPU, and torch.cuda.is_available() is false here "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}). "
            "Run it on a machine with a compute capability 8.x/9.x GPU"
            + (
                "; `flashgen bench --from-json` rebuilds reports from saved results without one."
                if what == "bench"
                else "; `flashgen tune --compile-only` checks the candidates without one."
            )
        )
    return None


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


def cmd_bench(args) -> int:
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
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="flashgen", description=__doc__.split("\n")[0])
    ap.add_argument("--version", action="version", version=f"flashgen {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="check, render and compile specs; write generated/")
    b.add_argument(
        "--option", action="append", metavar="NAME=VALUE",
        help="a kernel option by dotted name (flashgen.options.Options), e.g. family=fa2",
    )  # fmt: skip
    b.add_argument("specs", nargs="+", metavar="SPEC", help="spec YAML files")
    b.add_argument(
        "--target",
        action="append",
        choices=ir.TARGETS,
        help="target to build (repeatable; default: the spec's targets)",
    )
    b.add_argument("--out", default="generated", help="output directory (default: generated)")
    b.add_argument("--json", action="store_true", help="print one JSON document")
    b.add_argument(
        "--jobs", type=int, default=None, help="parallel nvcc processes (default: CPU count)"
    )
    b.add_argument(
        "--no-verify", action="store_true", help="skip the GPU correctness check and benchmark"
    )
    b.set_defaults(func=cmd_build)

    s = sub.add_parser("show", help="print the checked IR, plan and CUDA source of a spec")
    s.add_argument(
        "--option", action="append", metavar="NAME=VALUE",
        help="a kernel option by dotted name (flashgen.options.Options), e.g. family=fa2",
    )  # fmt: skip
    s.add_argument("spec", metavar="SPEC")
    s.add_argument(
        "--target",
        action="append",
        choices=ir.TARGETS,
        help="target to show (repeatable; default: the spec's targets)",
    )
    s.set_defaults(func=cmd_show)

    ls = sub.add_parser("list", help="list the specs in a directory")
    ls.add_argument("dir", nargs="?", default="specs", metavar="DIR")
    ls.set_defaults(func=cmd_list)

    be = sub.add_parser(
        "bench",
        help="benchmark flashgen against SDPA backends, FlexAttention and standard attention",
        description="Benchmark in the FlashAttention papers' protocol and write results.json, "
        "results.md and PNG plots into --out (needs a CUDA GPU; exit 2 without one).",
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
    be.set_defaults(func=cmd_bench)

    tu = sub.add_parser(
        "tune",
        help="time candidate tile configs on this GPU and record the best in the tuning table",
    )
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
    tu.add_argument("--jobs", type=int, default=None, help="parallel nvcc processes")
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
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `flashgen show ... | head`: the reader left; not an error
        sys.stderr.close()
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
