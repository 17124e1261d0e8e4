#!/usr/bin/env python3
"""Validate and time flashgen's backward paths on a GPU, in one command.

1. tests: ``pytest -m gpu tests/gpu/test_backward_kernels.py tests/gpu/test_hopper_bwd_gpu.py``
   with ``FLASHGEN_ATOMIC_DQ=1``, so every accuracy test runs on the deterministic and the
   non-deterministic path (on sm_90 the Hopper wgmma kernels where a spec takes them);
2. sanitizer: ``compute-sanitizer`` memcheck and racecheck over a small backward of a few
   specs on the non-deterministic path (skipped when compute-sanitizer is not on PATH);
3. timing: forward, backward alone and forward+backward, bf16, B=1, H=2048/D, seqlen 16384
   (``--seqlen``), causal and not, D = 64, 128, 256, for flashgen deterministic, flashgen
   "atomic" (``deterministic=False``: the Hopper wgmma backward on sm_90 for D 64/128/256, the
   FA2-class atomic-dQ kernels otherwise; the path is printed), and PyTorch SDPA's
   FLASH_ATTENTION and CUDNN_ATTENTION backends;
   ``triton.testing.do_bench`` medians, printed as TFLOP/s.  FLOPs: forward 4*B*H*S^2*D,
   backward 2.5x forward, causal halves both.  The atomic dQ is also compared with the
   deterministic one at the timed size.

    python3 tools/bwd_bench.py                    # all three steps
    python3 tools/bwd_bench.py --skip-tests --skip-sanitizer --dims 128
    python3 tools/bwd_bench.py --atomic-tiles 128:128,32,8,1 --skip-tests --skip-sanitizer
    python3 tools/bwd_bench.py --json out.json

``--atomic-tiles D:KV_N,KV_M,WARPS,DSPLIT`` (repeatable) overrides
``flashgen.ATOMIC_BACKWARD_TILES`` for head dim D in this process (both score_mod
keys), to try tiles without editing the table.  Needs a CUDA GPU, torch, triton, CuPy,
nvcc and flashgen's dependencies (lark: ``pip install .whl/lark-*.whl`` where there is no
index).  Exit status: 0 if every step that ran passed, 1 otherwise, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
ENV = "FLASHGEN_ATOMIC_DQ"

SANITIZER_DRIVER = r"""
import sys, torch, flashgen
from flashgen.cli.commands import random_inputs
op = flashgen.load(sys.argv[1])
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)
for b, hq, hkv, sq, sk in ((1, 4, 2, 77, 141), (1, 2, 1, 130, 33), (1, 2, 2, 1, 65)):
    q, k, v, params = random_inputs(op.spec, b, hq, hkv, sq, sk, dev, gen)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, _ = op.attention(q, k, v, deterministic=False, **params)
    o.backward(torch.randn_like(o))
    torch.cuda.synchronize()
    assert not any(t.grad.isnan().any() for t in (q, k, v)), "NaN in gradients"
paths = {p for (_, p) in op.backward._kernels}
assert paths & {"atomic", "hopper"}, f"no atomic backward ran: {paths}"
print("FLASHGEN BACKWARD PATHS", sorted(paths), flush=True)
print("FLASHGEN DRIVER OK", flush=True)
"""


def spec_text(d: int, causal: bool) -> str:
    name = f"bwdbench_d{d}_{'causal' if causal else 'full'}"
    mask = "causal" if causal else "null"
    return f"name: {name}\nhead_dim: {d}\ndtype: bf16\nmask: {mask}\n"


def run_tests() -> bool:
    print("== step 1: GPU backward tests, both paths", flush=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu/test_backward_kernels.py",
           "tests/gpu/test_hopper_bwd_gpu.py"]  # fmt: skip
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env={**os.environ, ENV: "1"})
    print(f"   pytest exit {r.returncode} in {time.perf_counter() - t0:.0f}s", flush=True)
    return r.returncode == 0


def run_sanitizer(specs: list[str]) -> bool:
    print("== step 2: compute-sanitizer on the non-deterministic backward", flush=True)
    san = shutil.which("compute-sanitizer")
    if san is None:
        print("   compute-sanitizer not on PATH: skipped", flush=True)
        return True
    ok = True
    for name in specs:
        for tool in ("memcheck", "racecheck"):
            cmd = [san, "--tool", tool, sys.executable, "-c", SANITIZER_DRIVER]
            cmd.append(str(REPO / "specs" / f"{name}.yaml"))
            t0 = time.perf_counter()
            r = subprocess.run(
                cmd, cwd=REPO, env={**os.environ, ENV: "1"}, capture_output=True, text=True
            )
            log = r.stdout + r.stderr
            summary = (
                "RACECHECK SUMMARY: 0 hazards" if tool == "racecheck" else "ERROR SUMMARY: 0 errors"
            )
            clean = r.returncode == 0 and "FLASHGEN DRIVER OK" in log and summary in log
            ok &= clean
            status = "clean" if clean else "REPORTED / FAILED"
            dt = time.perf_counter() - t0
            print(f"   {name:14s} {tool:10s} {status} ({dt:.0f}s)", flush=True)
            if not clean:
                print("   " + "\n   ".join(log.strip().splitlines()[-25:]), flush=True)
    return ok


def apply_tile_overrides(items: list[str]) -> None:
    from flashgen.families.tiles import ATOMIC_BACKWARD_TILES, BackwardTiles

    for item in items:
        d, cfg = item.split(":")
        n, m, w, s = (int(x) for x in cfg.split(","))
        base = ATOMIC_BACKWARD_TILES[(int(d), False)]
        t = BackwardTiles(n, m, w, s, base.dq_block_m, base.dq_block_n, base.dq_warps)
        ATOMIC_BACKWARD_TILES[(int(d), False)] = t
        ATOMIC_BACKWARD_TILES[(int(d), True)] = t
        print(f"   atomic tiles for D={d}: {t}", flush=True)


def precompile(ops, device) -> dict:
    """Build every kernel the timing uses, in parallel; registers/spills per kernel."""
    import torch

    from flashgen.build import cache
    from flashgen.build.render import render
    from flashgen.families.registry import plan_backward, plan_forward, plan_hopper_backward
    from flashgen.ops.backward import backward_path
    from flashgen.ops.op import target_for_device

    gpu = torch.cuda.get_device_name(device)

    def build(job):
        op, unit = job
        target = target_for_device(op.spec, device)
        if unit == "fwd":
            plan = plan_forward(op.spec, target, gpu=gpu, persistent=False)
        elif unit == "atomic" and backward_path(op.spec, target, False) == "hopper":
            plan = plan_hopper_backward(op.spec, target).unit
        else:
            plan = plan_backward(op.spec, target, atomic_dq=unit == "atomic").unit
        _, rep = cache.get_or_build(render(plan), plan)
        return op.spec.name, unit, [(k.name, k.registers, k.spill_bytes) for k in rep.kernels]

    jobs = [(op, u) for op in ops for u in ("fwd", "det", "atomic")]
    out: dict = {}
    with cf.ThreadPoolExecutor(8) as pool:
        for name, unit, kernels in pool.map(build, jobs):
            out.setdefault(name, {})[unit] = kernels
            for kname, regs, spill in kernels:
                short = kname.replace(f"flashgen_{name}_", "")
                print(f"   {name:22s} {short:24s} {regs:3d} regs  {spill} B spilled", flush=True)
    return out


def time_all(args) -> tuple[list[dict], bool]:
    import torch
    import torch.nn.functional as F
    import triton.testing as tt
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashgen.frontend.spec import loads_spec
    from flashgen.ops.backward import backward_path
    from flashgen.ops.op import build_op, target_for_device

    print("== step 3: timing", flush=True)
    os.environ[ENV] = "1"  # read per backward call: deterministic=False -> an atomic-dQ path
    dev = torch.device("cuda")
    cases = [(d, c) for d in args.dims for c in (False, True)]
    ops = {case: build_op(loads_spec(spec_text(*case), "bwd_bench.yaml")) for case in cases}
    kernels = precompile(list(ops.values()), dev)
    rows: list[dict] = []
    ok = True

    def bench(fn) -> float:
        return tt.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")

    for d, causal in cases:
        h = 2048 // d
        s = args.seqlen
        gen = torch.Generator(device=dev).manual_seed(d + causal)

        def rnd(*shape, gen=gen):
            return torch.randn(*shape, device=dev, generator=gen, dtype=torch.bfloat16)

        q, k, v = (rnd(1, h, s, d).requires_grad_() for _ in range(3))
        do = rnd(1, h, s, d)
        fl_f = 4 * h * s * s * d / (2 if causal else 1)
        fl_b = 2.5 * fl_f
        op = ops[(d, causal)]
        path = backward_path(op.spec, target_for_device(op.spec, dev), False)
        print(f"   D={d} causal={causal}: flashgen-atomic runs the {path} backward", flush=True)
        impls = {
            "flashgen-det": (
                lambda q, k, v, op=op: op.attention(q, k, v, deterministic=True)[0],
                None,
            ),
            "flashgen-atomic": (
                lambda q, k, v, op=op: op.attention(q, k, v, deterministic=False)[0],
                None,
            ),
        }
        for label, backend in (
            ("sdpa-flash", "FLASH_ATTENTION"),
            ("sdpa-cudnn", "CUDNN_ATTENTION"),
        ):
            impls[label] = (
                lambda q, k, v, c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c),
                getattr(SDPBackend, backend),
            )
        # the atomic dQ against the deterministic one at this size
        grads = {}
        for label in ("flashgen-det", "flashgen-atomic"):
            o = impls[label][0](q, k, v)
            grads[label] = torch.autograd.grad(o, (q, k, v), do)
        agree = []
        for name, a, b in zip("qkv", grads["flashgen-atomic"], grads["flashgen-det"], strict=True):
            rel = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            agree.append(f"d{name} {rel:.1e}")
            ok &= rel < 2e-2
        print(
            f"   D={d} causal={causal}: atomic vs deterministic max rel diff: " + ", ".join(agree),
            flush=True,
        )
        del grads
        for label, (fwd, backend) in impls.items():
            ctx = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
            row = {"d": d, "causal": causal, "impl": label, "seqlen": s, "heads": h}
            if label == "flashgen-atomic":
                row["path"] = path
            try:
                with ctx:
                    t_f, t_b, t_fb = time_impl(fwd, q, k, v, do, bench)
                row.update(
                    fwd_ms=t_f,
                    bwd_ms=t_b,
                    fwd_bwd_ms=t_fb,
                    fwd_tflops=fl_f / t_f * 1e-9,
                    bwd_tflops=fl_b / t_b * 1e-9,
                    fwd_bwd_tflops=(fl_f + fl_b) / t_fb * 1e-9,
                )
            except Exception as e:  # noqa: BLE001 - an unsupported backend is one row, not a crash
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            rows.append(row)
            torch.cuda.empty_cache()
    print_table(rows)
    return [{"kernels": kernels}, *rows], ok


def time_impl(fwd, q, k, v, do, bench) -> tuple[float, float, float]:
    """(forward, backward alone, forward+backward) medians in ms for ``o = fwd(q, k, v)``."""
    import torch

    t_f = bench(lambda: fwd(q, k, v))
    o = fwd(q, k, v)
    t_b = bench(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
    t_fb = bench(lambda: torch.autograd.grad(fwd(q, k, v), (q, k, v), do))
    return t_f, t_b, t_fb


def print_table(rows: list[dict]) -> None:
    print()
    print(
        f"{'D':>4} {'causal':>6} {'impl':16s} {'fwd':>7} {'bwd':>7} {'fwd+bwd':>8} "
        f"{'bwd/flash':>9}   (TFLOP/s)"
    )
    flash = {(r["d"], r["causal"]): r.get("bwd_tflops") for r in rows if r["impl"] == "sdpa-flash"}
    for r in rows:
        if "error" in r:
            print(f"{r['d']:>4} {str(r['causal']):>6} {r['impl']:16s} {r['error']}")
            continue
        ref = flash.get((r["d"], r["causal"]))
        ratio = f"{r['bwd_tflops'] / ref:9.2f}" if ref else f"{'-':>9}"
        print(
            f"{r['d']:>4} {str(r['causal']):>6} {r['impl']:16s} {r['fwd_tflops']:7.1f} "
            f"{r['bwd_tflops']:7.1f} {r['fwd_bwd_tflops']:8.1f} {ratio}"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=int, default=200, help="do_bench repetition time, ms")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-sanitizer", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument(
        "--sanitize-specs", nargs="+", default=["causal_d128", "llama3_gqa", "bidir_d256"]
    )
    ap.add_argument("--atomic-tiles", action="append", default=[], metavar="D:N,M,W,S")
    ap.add_argument("--json", type=Path, help="write the timing rows here")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("bwd_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    ok = True
    if not args.skip_tests:
        ok &= run_tests()
    if not args.skip_sanitizer:
        ok &= run_sanitizer(args.sanitize_specs)
    if not args.skip_timing:
        apply_tile_overrides(args.atomic_tiles)
        rows, timing_ok = time_all(args)
        ok &= timing_ok
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
    print("\nOK" if ok else "\nFAILED (see above)", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
