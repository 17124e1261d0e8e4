#!/usr/bin/env python3
"""Time the Hopper kernels of two flashgen source trees against each other on one GPU: the
non-persistent and the persistent (``dynamic``) forward and the Hopper backward
(``deterministic=False``) of each shipped spec, in alternating rounds, each tree in its own
process; and compare their outputs.

    python3 tools/branch_ab.py ab/a ab/b                        # every spec, B=2 H=16 S=8192
    python3 tools/branch_ab.py ab/a ab/b --spec causal_d128 --kinds fwd fwd_persistent --rounds 5

A tree is a checkout or a ``git archive`` of a revision (``tools/sass_identity.py
--list-changed`` names the units whose CUDA differs between two revisions).  Round r runs tree A
then B (even r) or B then A (odd r); each run builds the ops (a kernel whose source differs
gets its own cache entry), times every case with ``do_bench`` (``--warmup-ms``, ``--rep-ms``; L2
flushed between calls) and saves its outputs.  Printed per case: each tree's median ms over the
rounds, the ratio B / A, and whether the outputs are bitwise equal (else the largest absolute
difference per tensor: the backward's dQ adds with atomics in any order, so it may differ in its
last bits).  ``--json`` writes the rows.

Cases: ``fwd`` (the op loaded with ``Options(persistent="off", sparse_persistent="off")``),
``fwd_persistent`` (both ``"dynamic"``), ``bwd`` (dQ, dK, dV of ``deterministic=False``, the Hopper
backward where the spec takes it; no persistent forward), inputs in the spec's dtype from a fixed
seed (an fp8 spec: e4m3 inputs, default descales, the ``fwd`` case only), the spec's scalar params
at their defaults and its tensor params from :func:`flashgen.bench.runner.spec_params`.  Needs
an sm_90 GPU, torch, triton, CuPy, nvcc (and lark, as every flashgen run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

KINDS = ("fwd", "fwd_persistent", "bwd")

_WORKER = r"""
import json, os, sys
tree, out, cfg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path.insert(0, tree)
import torch
import flashgen
from flashgen.bench import runner as bench
from flashgen.options import Options

dev = torch.device("cuda")
b, h, s = cfg["shape"]
times = {}
# fwd and bwd: no persistent scheduler; fwd_persistent: dynamic (both for the dense and the
# sparse-call kernels).  Options, not the removed FLASHGEN_PERSISTENT switches.
OPTIONS = {
    "fwd": Options(persistent="off", sparse_persistent="off"),
    "fwd_persistent": Options(persistent="dynamic", sparse_persistent="dynamic"),
    "bwd": Options(persistent="off", sparse_persistent="off"),
}
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}
for name in cfg["specs"]:
    path = os.path.join(tree, "specs", name + ".yaml")
    for kind in cfg["kinds"]:
        op = flashgen.load(path, options=OPTIONS[kind])
        spec = op.spec
        fp8 = spec.dtype == "fp8_e4m3"
        if fp8 and kind != "fwd":
            continue  # fp8: forward only, never persistent
        gen = torch.Generator(device="cuda").manual_seed(0)
        dt = DT[spec.dtype]
        # e4m3 inputs from float32 randn (randn has no float8 kernel); descales default to 1
        rnd = lambda d: torch.randn((b, h, s, d), device=dev, generator=gen,
                                    dtype=torch.float32 if fp8 else dt).to(dt)
        q, k, v = rnd(spec.head_dim), rnd(spec.head_dim), rnd(spec.head_dim_v)
        params = bench.spec_params(spec, h, b, s, s, dev)
        for p in spec.scalar_params:
            params.setdefault(p.name, p.default)
        if kind == "bwd":
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            o, lse = op.attention(qq, kk, vv, deterministic=False, **params)
            do = torch.randn(o.shape, device=dev, dtype=o.dtype, generator=gen)
            fn = lambda: torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True)
            outs = list(fn())
        else:
            fn = lambda: op.attention(q, k, v, **params)
            outs = list(fn())
        torch.cuda.synchronize()
        times[name + "/" + kind] = bench.do_bench_ms(fn, cfg["warmup_ms"], cfg["rep_ms"])
        torch.save([t.detach().cpu() for t in outs], os.path.join(out, name + "_" + kind + ".pt"))
json.dump(times, open(os.path.join(out, "times.json"), "w"))
"""


def _run(tree: Path, out: Path, cfg: dict) -> dict[str, float]:
    out.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    run = subprocess.run(
        [sys.executable, "-c", _WORKER, str(tree), str(out), json.dumps(cfg)], cwd=tree, env=env
    )
    if run.returncode != 0:
        raise RuntimeError(f"branch_ab: the run in {tree} failed (exit {run.returncode})")
    return json.loads((out / "times.json").read_text())


def _compare(a: Path, b: Path) -> str:
    """"bitwise equal" or the largest absolute difference of each output tensor."""
    import torch

    ta, tb = torch.load(a), torch.load(b)
    if all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True)):
        return "bitwise equal"
    diffs = []
    for x, y in zip(ta, tb, strict=True):
        d = (x.float() - y.float()).abs()
        d = d[torch.isfinite(d)]
        diffs.append(f"{d.max().item():.3g}" if d.numel() else "nan/inf")
    return "max |diff| " + " ".join(diffs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("a", type=Path, help="tree A (the baseline)")
    ap.add_argument("b", type=Path, help="tree B")
    ap.add_argument("--spec", action="append", default=[], help="shipped spec (default: all)")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--shape", nargs=3, type=int, metavar=("B", "H", "S"), default=(2, 16, 8192))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-ms", type=int, default=100)
    ap.add_argument("--rep-ms", type=int, default=200)
    ap.add_argument("--out", type=Path, help="outputs and times (default: a temp dir)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    a, b = args.a.resolve(), args.b.resolve()
    specs = args.spec or sorted(
        p.stem for p in (a / "specs").glob("*.yaml") if "v_from_k: true" not in p.read_text()
    )  # (a v_from_k spec is decode only: no forward or backward to compare)
    cfg = {
        "specs": specs,
        "kinds": args.kinds,
        "shape": args.shape,
        "warmup_ms": args.warmup_ms,
        "rep_ms": args.rep_ms,
    }
    out = args.out or Path(tempfile.mkdtemp(prefix="branch-ab-"))
    times: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    for r in range(args.rounds):
        for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
            got = _run(a if side == "A" else b, out / side, cfg)
            for key, ms in got.items():
                times[side].setdefault(key, []).append(ms)
            print(f"round {r} {side}: {len(got)} cases", flush=True)
    rows = []
    for key in sorted(times["A"]):
        ma = sorted(times["A"][key])[len(times["A"][key]) // 2]
        mb = sorted(times["B"][key])[len(times["B"][key]) // 2]
        f = key.replace("/", "_") + ".pt"
        same = _compare(out / "A" / f, out / "B" / f)
        rows.append({"case": key, "a_ms": ma, "b_ms": mb, "ratio": mb / ma, "outputs": same,
                     "a_rounds": times["A"][key], "b_rounds": times["B"][key]})  # fmt: skip
        print(f"{key:36s} A {ma:8.3f} ms  B {mb:8.3f} ms  B/A {mb / ma:6.3f}  {same}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
