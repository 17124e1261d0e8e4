#!/usr/bin/env python3
"""Time the Hopper forward with its persistent tile scheduler off and on, next to
FlexAttention (document_mask) and cuDNN (plain causal / non-causal), in one process.

    python3 tools/persistent_bench.py                   # on an H200: about 1-2 minutes
    python3 tools/persistent_bench.py --json out.json   # also write the rows as JSON
    python3 tools/persistent_bench.py --no-flex         # skip FlexAttention (its compile)

Cases: document_mask at the gallery's shape (batch 2, seqlen 8192, 16 heads, d128, bf16,
documents of mean length 1024: :func:`flashgen.bench.spec_params`), timed with a BlockMask
built once (as tools/gallery.py does); plain causal and non-causal attention at seqlen
16384 (batch 1, heads * head_dim = 2048) at d64, d128 and d256.  Each flashgen kernel runs
with ``FLASHGEN_PERSISTENT=0`` and ``=1`` (the op builds both; the env var is read at every
call).  For every case the script also checks the persistent output against the
non-persistent one (bitwise equality expected: same per-tile arithmetic; the max abs
difference is printed otherwise) and that it has no NaN (outputs poisoned first).

TFLOP/s count kept pairs only: ``4 * B * H * D * kept`` (for document_mask ``kept`` comes
from the mask IR, :func:`flashgen.bench.kept_pairs`; causal: half the square).  Times are
``do_bench`` medians (:func:`flashgen.bench.do_bench_ms`, L2 flushed between calls).
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


def _time_flashgen(op, q, k, v, params, persistent: bool, args) -> tuple[float, object]:
    """(median ms, output) of ``op`` with the persistent scheduler ``persistent``."""
    import torch

    from flashgen import bench
    from flashgen.op import poison_outputs

    os.environ["FLASHGEN_PERSISTENT"] = "1" if persistent else "0"
    try:
        with poison_outputs():
            o, lse = op.attention(q, k, v, **params)
        torch.cuda.synchronize()
        plan = op.kernel(q.device).plan
        if bool(plan.context.get("persistent")) != persistent:
            raise RuntimeError(f"expected persistent={persistent}, got plan {plan.kernel_name}")
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

    from flashgen import bench
    from flashgen.op import TORCH_DTYPE, build_op

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
        row["off_ms"], out_off = _time_flashgen(op, q, k, v, call_params, False, args)
        row["on_ms"], out_on = _time_flashgen(op, q, k, v, call_params, True, args)
        row["flashgen_s"] = round(time.perf_counter() - t0, 1)
        row.update(_compare(out_off, out_on))
        row["speedup_on_vs_off"] = row["off_ms"] / row["on_ms"]
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
    for key in ("off_ms", "on_ms", f"{baseline}_ms"):
        if row.get(key):
            row[key.replace("_ms", "_tflops")] = flops / (row[key] * 1e-3) / 1e12
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=16384, help="plain causal / non-causal")
    ap.add_argument("--doc-seqlen", type=int, default=8192, help="document_mask (gallery)")
    ap.add_argument("--doc-len", type=int, default=1024, help="mean document length")
    ap.add_argument("--dims", type=int, nargs="*", default=[64, 128, 256])
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    from flashgen import bench
    from flashgen.spec import load_spec

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 GPU (the persistent scheduler is the Hopper kernel's)")
        return 2
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}", flush=True)
    rows = []
    t_start = time.perf_counter()

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
    bad = [r["case"] for r in rows if r.get("error") or r.get("nan")]
    if bad:
        print(f"FAILED: {', '.join(bad)}")
    return 1 if bad else 0


def _f(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def _line(r: dict) -> str:
    base = "flex" if "flex_ms" in r or "flex_error" in r else "sdpa_cudnn"
    return (
        f"{r['case']:>14}: off {_f(r.get('off_tflops'))} / on {_f(r.get('on_tflops'))} TFLOP/s "
        f"({_f(r.get('speedup_on_vs_off'), '.3f')}x), {base} {_f(r.get(base + '_tflops'))}; "
        f"bitwise {r.get('bitwise')}, max|diff| {_f(r.get('max_abs_diff'), '.2e')}"
        + (f"; ERROR {r['error']}" if r.get("error") else "")
        + (f"; {base} error {r[base + '_error']}" if r.get(base + "_error") else "")
    )


def _table(rows: list[dict]) -> str:
    out = [
        "| case | off TFLOP/s | on TFLOP/s | on / off | baseline | baseline TFLOP/s "
        "| on / baseline | bitwise |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | --- |",
    ]
    for r in rows:
        base = "flex" if "flex_ms" in r or "flex_error" in r else "sdpa_cudnn"
        bt = r.get(base + "_tflops")
        ratio = r["on_tflops"] / bt if bt and r.get("on_tflops") else None
        out.append(
            f"| {r['case']} | {_f(r.get('off_tflops'))} | {_f(r.get('on_tflops'))} "
            f"| {_f(r.get('speedup_on_vs_off'), '.3f')} | {base} | {_f(bt)} "
            f"| {_f(ratio, '.2f')} | {r.get('bitwise')} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
