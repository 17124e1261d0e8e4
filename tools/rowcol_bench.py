#!/usr/bin/env python3
"""Time document_mask's Hopper forward with the mask's tensor reads per element
(``FLASHGEN_SIDE_TERMS=0``) and as row / column terms (:mod:`flashgen.analysis.rowcol`), next to
FlexAttention, at the gallery's shape, in one process; also the block-table pre-pass.

    python3 tools/rowcol_bench.py                 # on an H200: about a minute
    python3 tools/rowcol_bench.py --json out.json

Both kernels run on the same inputs with one BlockMask; their outputs must agree bitwise
(same mask decisions, same arithmetic).  Times: ``do_bench`` medians (ms), TFLOP/s over
kept pairs (:func:`flashgen.bench.runner.kept_pairs`), as tools/gallery.py counts them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _gallery():
    spec = importlib.util.spec_from_file_location("gallery", REPO / "tools" / "gallery.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--doc-len", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch
    from flashgen.MISSING import SIDE_TERMS_ENV

    from flashgen.bench import runner as bench
    from flashgen.frontend.spec import load_spec
    from flashgen.ops.op import TORCH_DTYPE, build_op

    if not torch.cuda.is_available():
        print("rowcol_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    gallery = _gallery()
    dev = torch.device("cuda")
    spec = load_spec(REPO / "specs" / "document_mask.yaml")
    heads, batch = 2048 // spec.head_dim, 16384 // args.seqlen
    params = gallery.gallery_params(spec, batch, heads, args.seqlen, dev, args.doc_len)
    kept = bench.kept_pairs(spec, batch, heads, args.seqlen, params, dev)
    flops = 2 * (spec.head_dim + spec.head_dim_v) * kept
    rows, outs = [], {}
    for label, env, s in (
        ("per element", "0", dataclasses.replace(spec, name="document_mask_per_element")),
        ("row/col terms", "1", spec),
    ):
        os.environ[SIDE_TERMS_ENV] = env
        op = build_op(s)
        plan = op.kernel(dev).plan
        r = gallery.measure(s, batch, heads, args.seqlen, params, dev, argparse.Namespace(
            warmup=args.warmup, rep=args.rep, no_flex=args.no_flex or env == "0"))  # fmt: skip
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (
            torch.randn(batch, heads, args.seqlen, spec.head_dim, device=dev, generator=g).to(
                TORCH_DTYPE[spec.dtype]
            )
            for _ in range(3)
        )
        outs[label] = op.attention(q, k, v, **params)
        r.update(label=label, terms=bool(plan.context.get("col_terms")), tiles=str(plan.tiles))
        for key in ("flashgen_ms", "flex_ms"):
            if r.get(key):
                r[key.replace("_ms", "_tflops")] = flops / r[key] / 1e9
        rows.append(r)
    os.environ.pop(SIDE_TERMS_ENV, None)
    a, b = outs.values()
    same = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    diff = (a[0].float() - b[0].float()).abs().max().item()
    density = kept / (batch * heads * args.seqlen**2)
    print(f"document_mask B={batch} H={heads} S={args.seqlen} density {density:.3f}")
    print("| kernel | terms | flashgen ms | TFLOP/s | pre-pass ms | Flex ms | Flex TFLOP/s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        nan = float("nan")
        print(
            f"| {r['label']} | {r['terms']} | {r.get('flashgen_ms', nan):.3f} "
            f"| {r.get('flashgen_tflops', nan):.0f} | {r.get('prepass_ms', nan):.3f} "
            f"| {r.get('flex_ms', nan):.3f} | {r.get('flex_tflops', nan):.0f} |"
        )
        for key in ("flashgen_error", "flex_error"):
            if r.get(key):
                print(f"  {r['label']}: {key}: {r[key]}")
    print(f"outputs bitwise equal: {same} (max |diff| {diff:.3e})")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "bitwise_equal": same}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
