#!/usr/bin/env python3
"""Time the Hopper forward with its persistent tile scheduler off and on (each scheduler),
next to FlexAttention (document_mask) and cuDNN (plain causal / non-causal), in one process.

    python3 tools/persistent_bench.py                   # on an H200: about 1-2 minutes
    python3 tools/persistent_bench.py --json out.json   # also write the rows as JSON
    python3 tools/persistent_bench.py --no-flex         # skip FlexAttention (its compile)

Cases: document_mask at the gallery's shape (batch 2, seqlen 8192, 16 heads, d128, bf16,
documents of mean length 1024: :func:`flashgen.bench.runner.spec_params`), timed with a BlockMask
built once (as tools/gallery.py does); plain causal and non-causal attention at seqlen
16384 (batch 1, heads * head_dim = 2048) at d64, d128 and d256.  Each flashgen kernel runs
with ``FLASHGEN_PERSISTENT=0`` and with each scheduler of ``--modes`` (default ``static
dynamic m_major``; the op builds each kernel, compiled in parallel up front; the env var is
read at every call).  For every case the script also checks each persistent output against
the non-persistent one (bitwise equality expected: same per-tile arithmetic; the max abs
difference is printed otherwise) and that it has no NaN (outputs poisoned first).

TFLOP/s count kept pairs only: ``4 * B * H * D * kept`` (for document_mask ``kept`` comes
from the mask IR, :func:`flashgen.bench.runner.kept_pairs`; causal: half the square).  Times are
``do_bench`` medians (:func:`flashgen.bench.runner.do_bench_ms`, L2 flushed between calls).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _time_flashgen(op, q, k, v, params, mode: str, args) -> tuple[float, object]:
    """(median ms, output) of ``op`` with ``FLASHGEN_PERSISTENT=mode`` (``0``: off)."""
    import torch

    from flashgen.bench import runner as bench
    from flashgen.ops.op import poison_outputs

    os.environ["FLASHGEN_PERSISTENT"] = mode
    try:
        with poison_outputs():
            o, lse = op.attention(q, k, v, **params)
        torch.cuda.synchronize()
        plan = op.kernel(q.device).plan
        if plan.context.get("scheduler") != (None if mode == "0" else mode):
            raise RuntimeError(f"expected scheduler {mode}, got {plan.context.get('scheduler')}")
        ms = bench.do_bench_ms(lambda: op.attention(q, k, v, **params), args.warmup, args.rep)
        return ms, (o, lse)
    finally:
        os.environ.pop("FLASHGEN_PERSISTENT", None)


def _compare(off, on) -> dict:
    import torch

    (o0, l0), (o1, l1) = off, on
    return {
        "nan": bool(o1.isnan().any() or l1.isnan().any()),
        "bitwise": bool(torch.equal(o0, o1) and torch.equal(l0, l1)),
        "max_abs_diff": float((o0.float() - o1.float()).abs().max()),
    }


def run_case(name, spec, batch, heads, seqlen, params, baseline, flops, device, args) -> dict:
    import torch

    from flashgen.bench import runner as bench
    from flashgen.ops.op import TORCH_DTYPE, build_op

    dt = TORCH_DTYPE[spec.dtype]
    g = torch.Generator(device=device).manual_seed(0)
    shape = (batch, heads, seqlen, spec.head_dim)
    q, k, v = (torch.randn(*shape, device=device, generator=g).to(dt) for _ in range(3))
    row = {"case": name, "batch": batch, "heads": heads, "seqlen": seqlen, "d": spec.head_dim}
    op = build_op(spec)
    call_params = dict(params)
    try:
        if spec.tensor_params:  # a BlockMask built once, as the gallery times it
            call_params["block_mask"] = op.block_mask(
                seqlen, seqlen, batch=batch, num_heads=heads, **params
            )
        t0 = time.perf_counter()
        row["off_ms"], out_off = _time_flashgen(op, q, k, v, call_params, "0", args)
        for mode in args.modes:
            try:
                row[f"{mode}_ms"], out = _time_flashgen(op, q, k, v, call_params, mode, args)
                row.update({f"{mode}_{key}": val for key, val in _compare(out_off, out).items()})
                row[f"{mode}_vs_off"] = row["off_ms"] / row[f"{mode}_ms"]
            except Exception as e:  # record, keep going
                row[f"{mode}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["flashgen_s"] = round(time.perf_counter() - t0, 1)
    except Exception as e:  # record, keep going
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if baseline is not None:
        try:
            t0 = time.perf_counter()
            fn = bench.make_forward(baseline, spec, seqlen, seqlen, params, device)
            fn(q, k, v)
            torch.cuda.synchronize()
            row[f"{baseline}_setup_s"] = round(time.perf_counter() - t0, 1)
            row[f"{baseline}_ms"] = bench.do_bench_ms(lambda: fn(q, k, v), args.warmup, args.rep)
        except Exception as e:
            row[f"{baseline}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    row["tflop"] = flops / 1e12
    for key in ["off_ms", f"{baseline}_ms"] + [f"{m}_ms" for m in args.modes]:
        if row.get(key):
            row[key.replace("_ms", "_tflops")] = flops / (row[key] * 1e-3) / 1e12
    return row


def prebuild(specs, modes) -> None:
    """Compile every forward kernel the run needs, in parallel (one nvcc per core)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from flashgen.build import cache
    from flashgen.build.render import render
    from flashgen.families.build import build_forward
    from flashgen.families.registry import plan_block_table

    gpu = torch.cuda.get_device_name()

    def build(job):
        spec, mode = job
        plan, _, _ = build_forward(spec, "sm_90", gpu=gpu, persistent=mode)
        if plan.context["block_table"]:
            pre = plan_block_table(spec, "sm_90", plan.tiles)
            cache.get_or_build(render(pre), pre)

    jobs = [(s, m) for s in specs for m in [False, *modes]]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
        list(pool.map(build, jobs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=16384, help="plain causal / non-causal")
    ap.add_argument("--doc-seqlen", type=int, default=8192, help="document_mask (gallery)")
    ap.add_argument("--doc-len", type=int, default=1024, help="mean document length")
    ap.add_argument("--dims", type=int, nargs="*", default=[64, 128, 256])
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--modes", nargs="*", default=["static", "dynamic", "m_major"],
                    help="persistent schedulers to time (FLASHGEN_PERSISTENT values)")  # fmt: skip
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.modes = ["static" if m == "1" else m for m in args.modes]

    import torch

    from flashgen.bench import runner as bench
    from flashgen.frontend.spec import load_spec

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 GPU (the persistent scheduler is the Hopper kernel's)")
        return 2
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    rows = []
    t_start = time.perf_counter()
    doc = load_spec(REPO / "specs" / "document_mask.yaml")
    plain = [bench.template_spec(d, "bf16", c) for d in args.dims for c in (True, False)]
    prebuild([doc, *plain], args.modes)
    print(f"built every kernel in {time.perf_counter() - t_start:.0f} s", flush=True)

    # document_mask at the gallery's shape
    spec = load_spec(REPO / "specs" / "document_mask.yaml")
    s = args.doc_seqlen
    batch, heads = bench.problem(s, spec.head_dim)
    params = bench.spec_params(spec, heads, batch, s, s, device, doc_len=args.doc_len)
    kept = bench.kept_pairs(spec, batch, heads, s, params, device)
    flops = 4.0 * spec.head_dim * kept
    rows.append(
        run_case(
            "document_mask",
            spec,
            batch,
            heads,
            s,
            params,
            None if args.no_flex else "flex",
            flops,
            device,
            args,
        )  # fmt: skip
    )
    rows[-1]["density"] = kept / (batch * heads * s * s)
    print(_line(rows[-1]), flush=True)

    # plain causal / non-causal at 16k, next to cuDNN
    for d in args.dims:
        for causal in (True, False):
            spec = bench.template_spec(d, "bf16", causal)
            batch, heads = bench.problem(args.seqlen, d)
            flops = bench.attention_flops(batch, heads, args.seqlen, args.seqlen, d, causal, "fwd")
            name = f"{'causal' if causal else 'full'}_d{d}"
            rows.append(
                run_case(
                    name, spec, batch, heads, args.seqlen, {}, "sdpa_cudnn", flops, device, args
                )  # fmt: skip
            )
            print(_line(rows[-1]), flush=True)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    print()
    print(_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.json}")
    bad = [
        r["case"]
        for r in rows
        if r.get("error") or any(r.get(f"{m}_nan") or r.get(f"{m}_error") for m in args.modes)
    ]
    if bad:
        print(f"FAILED: {', '.join(bad)}")
    return 1 if bad else 0


def _f(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def _base(r: dict) -> str:
    return "flex" if "flex_ms" in r or "flex_error" in r else "sdpa_cudnn"


def _modes(r: dict) -> list[str]:
    return [k[: -len("_vs_off")] for k in r if k.endswith("_vs_off")]


def _line(r: dict) -> str:
    base = _base(r)
    parts = [f"{r['case']:>14}: off {_f(r.get('off_tflops'))}"]
    for m in _modes(r):
        parts.append(
            f"{m} {_f(r.get(m + '_tflops'))} ({_f(r.get(m + '_vs_off'), '.3f')}x, bitwise "
            f"{r.get(m + '_bitwise')}, max|diff| {_f(r.get(m + '_max_abs_diff'), '.1e')})"
        )
    parts.append(f"{base} {_f(r.get(base + '_tflops'))} TFLOP/s")
    errors = [f"{k}: {v}" for k, v in r.items() if k.endswith("error")]
    return ", ".join(parts) + ("; " + "; ".join(errors) if errors else "")


def _table(rows: list[dict]) -> str:
    modes = list(dict.fromkeys(m for r in rows for m in _modes(r)))
    head = ["case", "off"] + modes + ["baseline", "baseline TFLOP/s"] + [f"{m} / baseline"
                                                                       for m in modes]  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        base = _base(r)
        bt = r.get(base + "_tflops")
        cells = [r["case"], _f(r.get("off_tflops"))]
        cells += [f"{_f(r.get(m + '_tflops'))} ({_f(r.get(m + '_vs_off'), '.2f')}x)" for m in modes]
        cells += [base, _f(bt)]
        cells += [_f(r[m + "_tflops"] / bt, ".2f") if bt and r.get(m + "_tflops") else "-"
                  for m in modes]  # fmt: skip
        out.append("| " + " | ".join(cells) + " |")
    return "TFLOP/s (x: vs persistent off)\n" + "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
