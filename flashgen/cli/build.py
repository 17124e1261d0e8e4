"""``flashgen build``: check specs, compile every unit through the kernel cache, print the
resource table, write ``generated/<name>/``, and on a GPU machine verify and time each op.

torch is imported only for verification on a GPU machine (and not at all where the
machine has no NVIDIA device nodes).
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

from flashgen.cli.common import _consoles, _fail_json, _load_specs, _options
from flashgen.frontend import ir
from flashgen.frontend.errors import terminal_safe
from flashgen.version import __version__


# ----------------------------------------------------------------------------- build
@dataclass
class BuildResult:
    """Outcome of compiling one (spec, target)."""

    spec: ir.Spec
    target: str
    # a unit of registry.compile_units ("fwd", "fwd_sparse", "bwd", "bwd_atomic", "bwd_wgmma",
    # "bwd_dparam", "bwd_atomic_dparam", "bwd_wgmma_dparam"), or of serving_units ("decode",
    # "decode_ragged", and MLA's Hopper units "decode_wgmma", "decode_ragged_wgmma")
    unit: str = "fwd"
    plan: object | None = None  # the KernelPlan / BackwardPlan compiled (families.build)
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


def _compile_one(spec: ir.Spec, target: str, unit: str, options=None) -> BuildResult:
    """Compile ``unit`` of ``spec`` for ``target`` under ``options`` (default
    ``Options()``) through the kernel cache; failures land in the result's ``error``."""
    from flashgen.build.cache import CacheLockTimeout, UnsafeCacheError
    from flashgen.build.compile import CompileError
    from flashgen.families import registry
    from flashgen.families.build import build_forward
    from flashgen.families.decode import DecodeTilesError
    from flashgen.options import DEFAULT

    options = options or DEFAULT
    res = BuildResult(spec, target, unit)
    try:
        if unit.startswith("decode"):  # serving units (families.decode): attn, append
            import dataclasses

            from flashgen.build import cache
            from flashgen.build.render import render

            if unit.endswith("_wgmma"):  # MLA's Hopper unit, which auto picks per call shape
                options = dataclasses.replace(
                    options, decode=dataclasses.replace(options.decode, mla_unit="wgmma")
                )
            ragged = unit.startswith("decode_ragged")
            res.plan = registry.plan_decode(spec, target, options, ragged=ragged)
            path, res.report = cache.get_or_build(render(res.plan), res.plan)
            res.smem_dynamic = res.plan.smem_bytes
        elif unit in ("fwd", "fwd_sparse"):
            sparse = unit == "fwd_sparse"  # as the op: its own scheduler (sparse_persistent)
            sp = options.sparse_persistent
            res.plan, path, res.report = build_forward(
                spec, target, options=options, sparse=sparse,
                persistent=(False if sp == "off" else sp) if sparse
                else registry.persistent_scheduler(spec, options),
            )  # fmt: skip
            res.smem_dynamic = res.plan.smem_bytes
        else:
            res.plan, path, res.report = _build_backward_unit(spec, target, unit, options)
            res.smem_dynamic = max(k.smem_bytes for k in res.plan.kernels)
            res.note = _backward_note(spec, target, unit, options, res.plan)
        res.cubin = str(path)
        if res.report.spill_bytes:
            res.error = (
                f"kernel spills: {res.report.spill_stores} bytes stores, "
                f"{res.report.spill_loads} bytes loads"
            )
        elif res.report.wgmma_serialized:
            k = res.report.kernel(res.report.wgmma_serialized[0])
            res.error = f"ptxas serialized the wgmma instructions of {k.name}: {k.wgmma_serialized}"
    except (CompileError, UnsafeCacheError, CacheLockTimeout) as e:
        res.error = str(e)
    except DecodeTilesError as e:  # the decode options fit another target: say how to build it
        fits = " or ".join(f"--target {t}" for t in e.fits)
        res.error = str(e) + (f" (build for it alone: {fits})" if fits else "")
    except (ValueError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


#: The backward units of :func:`flashgen.families.registry.compile_units`: unit -> (the
#: atomic-dQ path, the Hopper (wgmma) kernel, every trainable param's gradient accumulated,
#: the sink form: the backward of a forward that joined the spec's sink, which a sink spec's
#: training runs by default, ``Options.fa2_fwd`` / ``hopper_fwd.fused_sink``).
#: ``None``: the atomic path as the op takes it for that unit (its Hopper path falls back to
#: the atomic FA2-class kernels only where ``Options.atomic_dq`` is True).
BACKWARD_UNITS = {
    "bwd": (False, False, False, False),
    "bwd_atomic": (True, False, False, False),
    "bwd_wgmma": (None, True, False, False),
    "bwd_dparam": (False, False, True, False),
    "bwd_atomic_dparam": (True, False, True, False),
    "bwd_wgmma_dparam": (None, True, True, False),
    "bwd_sink": (False, False, False, True),
    "bwd_atomic_sink": (True, False, False, True),
    "bwd_wgmma_sink": (None, True, False, True),
}


def _build_backward_unit(spec: ir.Spec, target: str, unit: str, options):
    """``(plan, cubin path, report)`` of backward ``unit`` as the op builds it
    (:func:`flashgen.families.build.build_backward`, its fallbacks included)."""
    from flashgen.families.build import build_backward
    from flashgen.families.registry import grad_params

    atomic, hopper, dparam, sink = BACKWARD_UNITS[unit]
    return build_backward(
        spec, target, atomic_dq=options.atomic_dq is True if atomic is None else atomic,
        hopper=hopper, options=options, param_grads=grad_params(spec) if dparam else (),
        sink=sink,
    )  # fmt: skip


def _backward_note(spec: ir.Spec, target: str, unit: str, options, plan) -> str | None:
    """What the op runs in place of backward ``unit``'s first choice, where
    :func:`_build_backward_unit` fell back (its row shows what the op runs), else None."""
    from flashgen.build import cache
    from flashgen.build.render import render
    from flashgen.families import registry

    atomic, hopper, dparam, sink = BACKWARD_UNITS[unit]
    grads = registry.grad_params(spec) if dparam else ()
    if hopper and not plan.wgmma:
        return (
            "the Hopper (wgmma) backward spills (its consumers have 240 registers); the op "
            f"falls back to the FA2-class kernels ({plan.dkdv.template}), whose numbers this "
            "row shows"
        )
    if hopper and plan.dkdv.options_key != options.family_key("hopper_bwd"):
        first = registry.plan_hopper_backward(
            spec, target, options, param_grads=grads, sink=sink
        )
        _, report = cache.get_or_build(render(first.unit), first.unit)
        spilled = [k for k in report.kernels if k.spill_bytes or k.wgmma_serialized]
        what = ", ".join(
            f"{k.name} spills {k.spill_bytes} B"
            if k.spill_bytes
            else f"ptxas serialized the wgmma instructions of {k.name}"
            for k in spilled
        ) or "it spills"
        given = set(options.family_key("hopper_bwd").split(";"))
        now = "; ".join(x for x in plan.dkdv.options_key.split(";") if x and x not in given)
        return (
            f"the Hopper backward under the options given does not build cleanly ({what}); the "
            f"op falls back to {now}, whose numbers this row shows"
        )
    if atomic and dparam and not plan.atomic_dq:  # build_backward's last resort
        return (
            "every atomic-dQ form of this unit spills; the op runs the deterministic kernels "
            "(with the same parameter-gradient code) in its place, whose numbers this row shows"
        )
    return None


#: The table's order of the prefill units: by group, each group over the (spec, target) pairs.
_UNIT_GROUPS = (
    ("fwd", "bwd", "bwd_atomic"),
    ("bwd_wgmma",),
    ("bwd_dparam", "bwd_atomic_dparam", "bwd_wgmma_dparam"),
    ("bwd_sink", "bwd_atomic_sink", "bwd_wgmma_sink"),
    ("fwd_sparse",),
)


def serving_units(spec: ir.Spec, target: str, options) -> tuple[str, ...]:
    """The decode units ``flashgen build`` compiles for ``spec`` on ``target``: ``decode`` and
    ``decode_ragged`` (the units a registry plan without a call shape gives), and for a
    ``v_from_k`` spec whose ``decode.mla_unit`` is ``auto`` (opt-in; the default
    ``mma_sync`` builds the two alone) on a target the Hopper MLA unit serves, that unit's too
    (``decode_wgmma``, ``decode_ragged_wgmma``), which ``auto`` runs at the shapes that fill
    it; none for a spec decode does not support."""
    from flashgen.families import decode as family

    if family.unsupported_reason(spec):
        return ()
    units = ("decode", "decode_ragged")
    if (spec.v_from_k and options.decode.mla_unit == "auto"
            and family.mla_wgmma_support(spec, target) is None):  # fmt: skip
        units += ("decode_wgmma", "decode_ragged_wgmma")
    return units


def _prefill_units(spec: ir.Spec, target: str, options) -> list[str]:
    """The names of :func:`flashgen.families.registry.compile_units` for ``spec`` on
    ``target`` (the forward alone where it cannot plan them: :func:`_compile_one` reports
    why)."""
    from flashgen.families.registry import compile_units

    try:
        return list(compile_units(spec, target, options))
    except ValueError:
        return [] if spec.v_from_k else ["fwd"]


def cmd_build(args) -> int:
    from rich.table import Table

    from flashgen.build.compile import CompileError, find_compiler
    from flashgen.build.generate import write_generated

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
    offsets = getattr(args, "offsets", False)
    if offsets:  # ring attention's form of each spec: compiled and reported, not written
        from flashgen.frontend.offsets import offsets_spec

        specs = [offsets_spec(s) for s in specs]
    from flashgen.frontend.ir import FP8_DTYPES

    fp8_fa2 = [s.name for s in specs if s.dtype in FP8_DTYPES and family == "fa2"]
    if fp8_fa2:  # build_op refuses the same pair (flashgen.load)
        msg = (
            f"spec {', '.join(fp8_fa2)}: dtype fp8_e4m3 runs on the Hopper kernel only; "
            f"--option family=fa2 picks the FA2-class kernels, which have no FP8 form"
        )
        err.print(f"error: {msg}", markup=False)
        return _fail_json(args, msg)
    pairs = []
    for spec in specs:
        for t in dict.fromkeys(args.target or spec.targets):
            if t in spec.targets:
                pairs.append((spec, t))
            else:
                err.print(f"note: {spec.name} does not list target {t}; skipped", markup=False)
    if offsets:  # a decode-only spec has no prefill units, so no offsets form
        from flashgen.frontend.offsets import SUFFIX

        for spec in specs:
            if spec.v_from_k:
                err.print(f"note: {spec.name.removesuffix(SUFFIX)}: nothing built: --offsets "
                          "builds the prefill units that ring attention and q_offset= / "
                          "kv_offset= calls run, and a decode-only spec (v_from_k) has none",
                          markup=False)  # fmt: skip
        pairs = [(s, t) for s, t in pairs if not s.v_from_k]
    try:
        toolkit = find_compiler().key  # nvcc's version, or NVRTC's key where there is no nvcc
    except CompileError as e:
        err.print(f"error: {e}", markup=False)
        err.print("flashgen build needs nvcc (or NVRTC) to compile kernels.", markup=False)
        return _fail_json(args, str(e))

    results: list[BuildResult] = []
    jobs = max(1, args.jobs or os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        # every unit of registry.compile_units, grouped as the table lists them
        units = [(s, t, _prefill_units(s, t, options)) for s, t in pairs]
        futures = [
            pool.submit(_compile_one, s, t, u, options)
            for group in _UNIT_GROUPS
            for s, t, names in units
            for u in names
            if u in group
        ]
        futures += [  # the decode (serving) units, padded and ragged Sq_new, where supported
            pool.submit(_compile_one, s, t, unit, options)
            for s, t in pairs
            if not offsets
            for unit in serving_units(s, t, options)
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
        if not mine or offsets:
            continue
        if not all(r.ok for r in mine):  # a failed build leaves generated/ as it was
            unwritten.append(spec.name)
            continue
        if spec.v_from_k:  # decode only: its padded decode unit is the generated source
            keyed = {(r.target, "fwd"): r for r in mine if r.unit == "decode"}
        else:  # the decode units are compiled and reported, not written to generated/
            serving = ("decode", "decode_ragged")
            keyed = {(r.target, r.unit): r for r in mine if r.unit not in serving}
        reports = {k: r.report for k, r in keyed.items() if r.report is not None}
        targets = tuple(dict.fromkeys(t for t, _ in keyed))
        try:
            plans = {k: r.plan for k, r in keyed.items() if r.plan is not None}
            generated.append(
                str(
                    write_generated(
                        spec, args.out, reports, targets=targets, plans=plans, options=options
                    )
                )
            )
        except (ValueError, OSError) as e:
            err.print(f"error: writing {spec.name}: {terminal_safe(str(e))}", markup=False)
            return _fail_json(args, f"writing {spec.name}: {e}")

    verify = []
    if not args.no_verify and not offsets and _cuda_available():
        verify = [
            _verify_safely(spec, options)
            for spec in specs
            if all(r.ok for r in results if r.spec is spec) and not spec.v_from_k
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
    if results:  # none: the notes above say why
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
    elif not args.no_verify and not args.json and not offsets:
        built = sum(r.report is not None for r in results)
        if built == len(results):
            err.print("note: no CUDA GPU here: kernels compiled, not run or verified", markup=False)
        elif built:
            err.print(f"note: no CUDA GPU here: {built} of {len(results)} units compiled, none "
                      "run or verified", markup=False)  # fmt: skip
    for v in verify:
        if v.get("error"):
            err.print(f"error: verifying {v['spec']}: {v['error']}", markup=False)
    for g in generated:
        out.print(f"wrote {g}/", markup=False)
    for name in unwritten:
        err.print(f"note: {name} not written to {args.out}/ (its build failed)", markup=False)
    return 0 if ok else 1


# ----------------------------------------------------------------------------- verify (GPU)
#: Device nodes the NVIDIA driver creates on Linux: without any, there is no CUDA GPU, and
#: `flashgen build` need not spend a second importing torch to learn it.
_NVIDIA_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")  # dxg: WSL


def _cuda_available() -> bool:
    """Whether torch sees a CUDA device; False without importing torch on a Linux machine
    with no NVIDIA device node."""
    if sys.platform.startswith("linux") and not any(map(os.path.exists, _NVIDIA_NODES)):
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _verify_safely(spec: ir.Spec, options=None) -> dict:
    """:func:`verify_spec` (the op under ``options``), with any failure (CUDA error, bad
    kernel) turned into a result."""
    from flashgen.bench.verify import verify_spec

    try:
        return verify_spec(spec, options)
    except Exception as e:  # report it; do not crash the build summary
        return {"spec": spec.name, "ok": False, "cases": [], "error": f"{type(e).__name__}: {e}"}
