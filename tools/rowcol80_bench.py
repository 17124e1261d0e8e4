#!/usr/bin/env python3
"""Time document_mask's FA2-class kernels with the mask's tensor reads per element
(``FLASHGEN_SIDE_TERMS=0``) and as row / column terms (:mod:`flashgen.analysis.rowcol`): the forward
(``FLASHGEN_KERNEL_FAMILY=fa2``, one reused BlockMask) and the backward (deterministic, and
atomic-dQ with ``--atomic``), in one process, at the gallery's shape.

    python3 tools/rowcol80_bench.py             # on an H200: about a minute
    python3 tools/rowcol80_bench.py --atomic --json out.json

Both variants run on the same inputs; their outputs and gradients must agree bitwise (same
mask decisions, same arithmetic; the atomic path's dQ is compared with a tolerance, its
atomics add in a varying order).  Exit status 1 when they differ.  Times: ``do_bench``
medians (ms).
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
    ap.add_argument("--atomic", action="store_true", help="also the atomic-dQ backward")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch
    from flashgen.MISSING import SIDE_TERMS_ENV

    from flashgen.bench import runner as bench
    from flashgen.frontend.spec import load_spec
    from flashgen.ops.backward import ATOMIC_DQ_ENV
    from flashgen.ops.op import TORCH_DTYPE, build_op

    if not torch.cuda.is_available():
        print("rowcol80_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ["FLASHGEN_KERNEL_FAMILY"] = "fa2"
    dev = torch.device("cuda")
    spec = load_spec(REPO / "specs" / "document_mask.yaml")
    s = args.seqlen
    heads, batch = 2048 // spec.head_dim, 16384 // s
    params = _gallery().gallery_params(spec, batch, heads, s, dev, args.doc_len)
    dt = TORCH_DTYPE[spec.dtype]
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (
        torch.randn(batch, heads, s, spec.head_dim, device=dev, generator=g).to(dt)
        for _ in range(4)
    )
    paths = [("deterministic", True, "0")] + ([("atomic", False, "1")] if args.atomic else [])
    rows, outs = [], {}
    for label, env in (("per element", "0"), ("row/col terms", "1")):
        os.environ[SIDE_TERMS_ENV] = env
        sp = spec if env == "1" else dataclasses.replace(spec, name="document_mask_per_element")
        op = build_op(sp)
        bm = op.block_mask(s, s, batch=batch, num_heads=heads, **params)
        r = {"label": label}
        r["fwd_ms"] = bench.do_bench_ms(
            lambda op=op, bm=bm: op.attention(q, k, v, block_mask=bm, **params),
            args.warmup,
            args.rep,
        )
        plan = op.kernel(dev).plan
        r.update(fwd_template=plan.template, fwd_tiles=str(plan.tiles))
        r["fwd_terms"] = bool(plan.context.get("col_terms"))
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        got = {}
        for path, deterministic, atomic_env in paths:
            os.environ[ATOMIC_DQ_ENV] = atomic_env
            o, lse = op.attention(qg, kg, vg, block_mask=bm, deterministic=deterministic, **params)

            def bwd(o=o, ins=(qg, kg, vg)):
                return torch.autograd.grad(o, ins, do, retain_graph=True)

            got[path] = (o.detach(), lse.detach(), *bwd())
            r[f"bwd_{path}_ms"] = bench.do_bench_ms(bwd, args.warmup, args.rep)
            bplan = next(h[0] for key, h in op.backward._kernels.items())
            ctx = bplan.dkdv.context
            r[f"bwd_{path}_terms"] = {"dkdv": ctx["dkdv_side_terms"], "dq": ctx["dq_side_terms"]}
            op.backward._kernels.clear()  # the next path's plan is the one read above
        outs[label] = got
        rows.append(r)
    for key in (SIDE_TERMS_ENV, ATOMIC_DQ_ENV, "FLASHGEN_KERNEL_FAMILY"):
        os.environ.pop(key, None)
    a, b = outs.values()
    same = {}
    for path in a:
        names = ("o", "lse", "dq", "dk", "dv")
        for n, x, y in zip(names, a[path], b[path], strict=True):
            if path == "atomic" and n == "dq":
                same[f"{path}.{n}"] = torch.allclose(x.float(), y.float(), atol=2e-2, rtol=2e-2)
            else:
                same[f"{path}.{n}"] = torch.equal(x, y)
    print(f"document_mask FA2-class B={batch} H={heads} S={s} doc_len {args.doc_len}")
    cols = ["fwd_ms"] + [f"bwd_{p}_ms" for p, _, _ in paths]
    print("| kernels | " + " | ".join(cols) + " | terms |")
    print("| --- | " + " | ".join("---:" for _ in cols) + " | --- |")
    for r in rows:
        terms = {"fwd": r["fwd_terms"], **{p: r[f"bwd_{p}_terms"] for p, _, _ in paths}}
        print(f"| {r['label']} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + f" | {terms} |")
    print(f"outputs / gradients equal: {same}")
    ok = all(same.values())
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "equal": same}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
