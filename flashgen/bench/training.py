"""What trainable params and attention sinks cost, timed in one process: each call against
the same call without them, next to the ratio it should stay within.

    flashgen bench --training --out benchmarks/results/<dir>   # on the GPU
    flashgen bench --training --device cpu --seqlen 64 --batch 1 --heads 2 \\
        --rounds 1

Rows (forward + backward unless named, bf16, (B, S, H, D) as flags say; medians of alternating
rounds, :func:`flashgen.bench.timing.alternate`):

- ``alibi``: slopes detached vs slopes requiring grad (target: at most 1.1x), and requiring
  grad with ``hopper_bwd.dparam_affine`` (the slopes' sums in the dS^T pass, the detached
  unit's steps);
- ``t5_bias``: the bias table detached vs requiring grad (target: at most 1.3x), and requiring
  grad with ``hopper_bwd.dparam_diagonal`` (the table's gradient in the Hopper backward), then
  with ``hopper_bwd.dparam_const_tiles`` too (its steps away from the diagonal read one
  element of the table: one running sum instead of per-diagonal sums);
- ``gpt_oss_sink``: forward, forward + backward and decode (``with_kvcache``, one query per
  request) with the sink vs the same op with ``apply_sink=False`` (target: within 5%); by
  default the kernels join the sink (the prefill forward in its epilogue, whose backward takes
  the sink in its pre kernel; decode inside its attention kernel); each row also with the sink
  applied by torch ops after the kernels (``sink by torch ops``: ``fa2_fwd.fused_sink``,
  ``hopper_fwd.fused_sink`` and ``decode.fused_sink`` False).

With ``--device cpu`` (a smoke run of the same calls) the candidates of options that shape GPU
kernels only (:data:`GPU_ONLY`: ``hopper_bwd.dparam_diagonal``, ``dparam_const_tiles``, the
``fused_sink`` options) are
left out, and said so, rather than timed as copies of their row's other calls.  ``--device cuda``
(the default) needs a CUDA GPU (exit 2 without one).

Prints one line per row; with ``--out DIR`` also writes ``DIR/results.json`` (rows, ratios,
:func:`flashgen.bench.timing.environment`), without it nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from flashgen.bench import helptext
from flashgen.bench.argtypes import positive_int

#: Candidates whose option shapes GPU kernels only, by name: why a CPU run leaves them out.
GPU_ONLY = {
    "slopes trained dparam_affine": "hopper_bwd.dparam_affine shapes the Hopper backward only",
    "bias trained dparam_diagonal": "hopper_bwd.dparam_diagonal shapes the Hopper backward only",
    "bias trained dparam_const_tiles": "hopper_bwd.dparam_const_tiles shapes the Hopper backward "
    "only",
    "sink by torch ops": "fa2_fwd.fused_sink, hopper_fwd.fused_sink and decode.fused_sink shape "
    "the GPU kernels only (the CPU op always applies the sink by torch ops)",
}


def _timer(device: str, warmup_ms: int, rep_ms: int):
    """``time(fn) -> ms``: :func:`flashgen.bench.timing.do_bench_ms` on CUDA, a wall-clock
    median of 3 calls on CPU (a smoke run)."""
    if device == "cuda":
        from flashgen.bench.timing import do_bench_ms

        return lambda fn: do_bench_ms(fn, warmup_ms, rep_ms)

    def wall(fn):
        fn()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    return wall


def _cases(args):
    """``[(row, [(candidate, fn), ...])]``: each row's candidates, the first the baseline."""
    import torch

    import flashgen
    from flashgen.options import Options

    dev, dt = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    b, h, s = args.batch, args.heads, args.seqlen
    g = torch.Generator(device=dev).manual_seed(0)

    def qkv(d):
        return [torch.randn(b, h, s, d, device=dev, dtype=dt, generator=g).requires_grad_()
                for _ in range(3)]  # fmt: skip

    def train(op, q, k, v, **kw):
        def step():
            o, _ = op.attention(q, k, v, **kw)
            o.backward(torch.ones_like(o))

        return step

    rows = []
    op = flashgen.load("alibi")
    q, k, v = qkv(128)
    slopes = torch.linspace(0.01, 0.5, h, device=dev)
    affine = flashgen.load(
        "alibi", options=Options().replace_path("hopper_bwd.dparam_affine", True)
    )
    rows.append(("alibi fwd+bwd", [
        ("slopes detached", train(op, q, k, v, slopes=slopes)),
        ("slopes trained", train(op, q, k, v, slopes=slopes.clone().requires_grad_())),
        ("slopes trained dparam_affine",
         train(affine, q, k, v, slopes=slopes.clone().requires_grad_())),
    ]))  # fmt: skip
    op = flashgen.load("t5_bias")
    q, k, v = qkv(64)
    bias = torch.rand(h, 257, device=dev, generator=g)
    diag_options = Options().replace_path("hopper_bwd.dparam_diagonal", True)
    diag = flashgen.load("t5_bias", options=diag_options)
    const = flashgen.load(
        "t5_bias", options=diag_options.replace_path("hopper_bwd.dparam_const_tiles", True)
    )
    rows.append(("t5_bias fwd+bwd", [
        ("bias detached", train(op, q, k, v, bias=bias)),
        ("bias trained", train(op, q, k, v, bias=bias.clone().requires_grad_())),
        ("bias trained dparam_diagonal", train(diag, q, k, v, bias=bias.clone().requires_grad_())),
        ("bias trained dparam_const_tiles",
         train(const, q, k, v, bias=bias.clone().requires_grad_())),
    ]))  # fmt: skip
    op = flashgen.load("gpt_oss_sink")
    q, k, v = qkv(64)
    sinks = torch.linspace(-1, 2, h, device=dev).requires_grad_()
    by_torch = flashgen.load("gpt_oss_sink", options=Options().with_values(
        {"fa2_fwd.fused_sink": False, "hopper_fwd.fused_sink": False,
         "decode.fused_sink": False}))  # fmt: skip

    def fwd(fop=op, **kw):
        def call():
            with torch.no_grad():
                fop.attention(q, k, v, sinks=sinks, **kw)

        return call

    rows.append(("gpt_oss_sink fwd", [("no sink", fwd(apply_sink=False)), ("sink", fwd()),
                                      ("sink by torch ops", fwd(by_torch))]))  # fmt: skip
    rows.append(("gpt_oss_sink fwd+bwd", [
        ("no sink", train(op, q, k, v, sinks=sinks, apply_sink=False)),
        ("sink", train(op, q, k, v, sinks=sinks)),
        ("sink by torch ops", train(by_torch, q, k, v, sinks=sinks)),
    ]))  # fmt: skip
    bf16 = torch.bfloat16  # decode takes the spec's dtype on CPU too
    kc = torch.randn(b * 4, h // 2 or 1, s, 64, device=dev, generator=g).to(bf16)
    vc = torch.randn_like(kc)
    qd = torch.randn(b * 4, h, 1, 64, device=dev, generator=g).to(bf16)
    lens = torch.full((b * 4,), s, dtype=torch.int32, device=dev)

    def decode(dop=op, **kw):
        def call():
            dop.with_kvcache(qd, kc, vc, lens, sinks=sinks.detach(), **kw)

        return call

    rows.append(("gpt_oss_sink decode", [("no sink", decode(apply_sink=False)),
                                         ("sink", decode()),
                                         ("sink by torch ops", decode(by_torch))]))  # fmt: skip
    return rows


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(
        prog=prog, description=helptext.plain(__doc__), formatter_class=helptext.HelpFormatter
    )
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cuda (default; needs a GPU) or cpu (a smoke run)")  # fmt: skip
    ap.add_argument("--batch", type=positive_int("batch"), default=2)
    ap.add_argument("--heads", type=positive_int("heads"), default=16)
    ap.add_argument("--seqlen", type=positive_int("seqlen"), default=4096)
    ap.add_argument("--rounds", type=positive_int("rounds"), default=5)
    ap.add_argument("--warmup-ms", type=positive_int("warmup-ms"), default=100)
    ap.add_argument("--rep-ms", type=positive_int("rep-ms"), default=500)
    ap.add_argument("--out", type=Path, default=None, metavar="DIR",
                    help="write DIR/results.json (default: none; the rows are printed)")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        import sys

        from flashgen.bench.verify import NO_GPU_EXIT, require_cuda

        problem = require_cuda("bench --training")
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return NO_GPU_EXIT
    from flashgen.bench.timing import alternate, environment

    time_ms = _timer(args.device, args.warmup_ms, args.rep_ms)
    results = []
    for row, cands in _cases(args):
        if args.device == "cpu":
            omitted = {n: f"n/a on cpu: {GPU_ONLY[n]}" for n, _ in cands if n in GPU_ONLY}
            cands = [c for c in cands if c[0] not in GPU_ONLY]
        else:
            omitted = {}
        samples, failed = alternate(lambda i, c=cands: time_ms(c[i][1]), len(cands), args.rounds)
        meds = [statistics.median(x) if x else None for x in samples]
        entry = {"row": row, "candidates": {}}
        for i, ((name, _), med) in enumerate(zip(cands, meds, strict=True)):
            error = repr(failed[i]) if i in failed else None
            entry["candidates"][name] = {"ms": med, "error": error}
        if len(cands) > 1 and meds[0] and meds[1]:
            entry["ratio"] = meds[1] / meds[0]
        if len(cands) > 2 and meds[0]:  # every candidate against the first
            entry["ratios"] = {n: m / meds[0] for (n, _), m in zip(cands, meds, strict=True) if m}
        if omitted:
            entry["omitted"] = omitted
        results.append(entry)
        shown = ", ".join(f"{n} {m:.3f} ms" if m else f"{n} failed" for (n, _), m in
                          zip(cands, meds, strict=True))  # fmt: skip
        ratio = f"  ratio {entry['ratio']:.3f}" if "ratio" in entry else ""
        if "ratios" in entry:
            ratio = "  ratios " + ", ".join(f"{n} {r:.3f}" for n, r in entry["ratios"].items())
        left = f"  ({', '.join(omitted)}: n/a on cpu)" if omitted else ""
        print(f"{row:24s} {shown}{ratio}{left}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        env = environment() if args.device == "cuda" else {"device": "cpu"}
        doc = {"args": {k: str(v) for k, v in vars(args).items()}, "env": env, "rows": results}
        (args.out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
