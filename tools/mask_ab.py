#!/usr/bin/env python3
"""A/B of the Hopper forward's masked-tile reductions (session 7, issue 6) on a GPU: each
spec's forward with the reductions (default) and without them (``old``: the five switches
below at 0 while that op plans and runs its kernel), timed in the same process on the same inputs,
next to dense causal (causal_d128, also A/B: its diagonal tiles take the column limit), with
the largest difference between the two outputs.

    python3 tools/mask_ab.py                         # gallery shape, about 1.5 minutes
    python3 tools/mask_ab.py --each                  # also one switch off at a time
    python3 tools/mask_ab.py --specs chunked_local:chunk=1024 mistral_swa:window=1024
    python3 tools/mask_ab.py --switches FLASHGEN_HEAD_GROUPS    # another switch instead
    python3 tools/mask_ab.py --switches FLASHGEN_SPARSE_PERSISTENT=dynamic   # new: dynamic, old: 0

The switches (``flashgen/lower.py``, read when a kernel is planned):

- ``FLASHGEN_CAUSAL_TILES``: the classifier flags PARTIAL tiles where the mask is just
  ``causal`` (CAUSAL_ONLY: chunked_local's and mistral_swa's diagonal tiles, prefix_lm's past
  the prefix) or where ``causal`` holds on the whole tile (NO_CAUSAL: window edges, chunk
  boundaries below the diagonal); those run causal_d128's masked loop or the mask without
  its causal test.
- ``FLASHGEN_COL_LIMIT``: a masked tile's bounds and causal tests are one comparison per
  element of the column offset with a per-row limit.
- ``FLASHGEN_WALK_FROM_DIAGONAL``: a causal mask's key-block walk starts at the diagonal's
  block, not at the last key block (fewer classifier calls before the first load).
- ``FLASHGEN_NONNEG_DIV``: ``kv_idx / chunk`` (an int division with ``x >= 0``, ``d >= 1``
  proven) is a multiply-high and a shift, not the signed ``fg::Divisor::div``.
- ``FLASHGEN_SINGLE_WALK``: warp 0 alone classifies for the first live key block (the other
  eleven warps wait at the barrier instead of classifying too).

Shape as tools/gallery.py: batch * seqlen = 16384 tokens, heads * head_dim = 2048, bf16,
Sq = Sk = 8192; document ids of mean length 1024; a mask that reads tensors runs with a
block table built once (``op.block_mask``).  TFLOP/s count kept pairs (``2 * (D + Dv) *
kept``).  Times are medians over ``--rounds`` interleaved rounds of ``do_bench`` (what
tools/gallery.py reports: the op's host time shows where it exceeds the queue ahead of
the kernel); ``graph`` columns replay 10 calls captured in a CUDA graph (kernel time only,
no host work, no L2 flush).  ``t/causal`` compares the new kernel's time per head with
causal_d128's new one (same head_dim), next to ``FLOPs/causal``, the kept-pair ratio.
``spec:param=value`` overrides a scalar param (the row gets its own name).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_SPECS = ["causal_d128", "prefix_lm", "chunked_local", "mistral_swa", "document_mask"]
DEFAULT_SPECS += ["alibi", "chunked_local:chunk=1024", "mistral_swa:window=1024"]


def switches() -> tuple[str, ...]:
    from flashgen.MISSING import (
        CAUSAL_TILES_ENV,
        COL_LIMIT_ENV,
        NONNEG_DIV_ENV,
        SINGLE_WALK_ENV,
        WALK_FROM_DIAGONAL_ENV,
    )

    return (
        CAUSAL_TILES_ENV,
        COL_LIMIT_ENV,
        WALK_FROM_DIAGONAL_ENV,
        NONNEG_DIV_ENV,
        SINGLE_WALK_ENV,
    )


def modes(each: bool, names: tuple[str, ...] | None = None) -> dict[str, dict[str, str]]:
    """Mode name -> environment while the op plans its kernel (``names``: the switches to
    flip, default :func:`switches`; ``NAME=VALUE`` sets ``VALUE`` for new, not ``1``)."""
    on = dict(n.partition("=")[::2] for n in names or switches())
    on = {n: v or "1" for n, v in on.items()}
    out = {"new": dict(on), "old": {n: "0" for n in on}}
    if each:
        for n in on:
            key = "no_" + n.removeprefix("FLASHGEN_").lower()
            out[key] = {m: "0" if m == n else v for m, v in on.items()}
    return out


def _under(env: dict[str, str], fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with ``env`` set (the switches read at every call, e.g.
    ``FLASHGEN_SPARSE_PERSISTENT``, take the mode's value when timed too)."""
    from flashgen.envflags import scoped_env

    with scoped_env(env):
        return fn(*args, **kwargs)


def graph_ms(call, reps: int = 10, iters: int = 5) -> float:
    """Median ms per call of ``reps`` calls captured in one CUDA graph (nan if capture fails)."""
    from flashgen.bench.runner import capture_graph, graph_replay_ms

    try:
        g = capture_graph(call, reps)
        ms = graph_replay_ms(g, reps, iters)
        del g
        return ms
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"  (graph capture failed: {type(e).__name__}: {str(e)[:120]})", file=sys.stderr)
        return float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--specs", nargs="*", default=DEFAULT_SPECS)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--doc-len", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--each", action="store_true", help="also one switch off at a time")
    ap.add_argument("--switches", nargs="*", metavar="ENV",
                    help="flip these switches instead (e.g. FLASHGEN_HEAD_GROUPS)")  # fmt: skip
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timing")
    args = ap.parse_args(argv)

    import torch

    from flashgen.bench import runner as bench
    from flashgen.codegen.abi import needs_block_table
    from flashgen.frontend.spec import load_spec
    from flashgen.ops.op import TORCH_DTYPE, build_op

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    s = args.seqlen
    names = tuple(args.switches or switches())
    mode_env = modes(args.each, names)
    new = mode_env["new"]
    on = "all 1" if set(new.values()) == {"1"} else ", ".join(f"{n}={v}" for n, v in new.items())
    print(f"switches: {', '.join(new)}; old = all 0, new = {on}; S = {s}, bf16")
    cols = "".join(f" {m + ' ms':>14}" for m in mode_env)
    if not args.no_graph:
        cols += "".join(f" {'graph ' + m:>14}" for m in mode_env)
    print(f"{'spec':34}{cols} {'new/old':>8} {'TFLOP/s':>8} {'t/causal':>9} {'gt/causal':>9} "
          f"{'FLOPs/causal':>12} {'max|do|':>9} {'max|dlse|':>9}")  # fmt: skip
    causal_new_per_head = causal_kept_per_head = causal_graph_per_head = None
    for item in args.specs:
        name, over = bench.parse_spec_item(item)
        spec = load_spec(REPO / "specs" / f"{name}.yaml")
        b, h = bench.problem(s, spec.head_dim)
        params = bench.spec_params(spec, h, b, s, s, dev, doc_len=args.doc_len)
        for p in spec.scalar_params:
            params.setdefault(p.name, p.default)
        params.update(over)
        kept = bench.kept_pairs(spec, b, h, s, params, dev)
        dt = TORCH_DTYPE[spec.dtype]
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(b, h, s, spec.head_dim, device=dev, generator=g).to(dt)
        k = torch.randn(b, h, s, spec.head_dim, device=dev, generator=g).to(dt)
        v = torch.randn(b, h, s, spec.head_dim_v, device=dev, generator=g).to(dt)
        calls, outs = {}, {}
        for mode, env in mode_env.items():
            op = build_op(dataclasses.replace(spec, name=f"{spec.name}_ab_{mode}"))
            kw = dict(params)
            if needs_block_table(spec):
                kw["block_mask"] = _under(env, op.block_mask, s, s, batch=b, num_heads=h, **params)
            outs[mode] = _under(env, op.attention, q, k, v, **kw)  # plans and builds under them
            torch.cuda.synchronize()
            calls[mode] = functools.partial(_under, env, op.attention, q, k, v, **kw)
        times: dict[str, list[float]] = {m: [] for m in mode_env}
        for _ in range(args.rounds):  # interleaved: drift (clocks, heat) hits both modes alike
            for mode, call in calls.items():
                times[mode].append(bench.do_bench_ms(call, args.warmup, args.rep))
        ms = {m: statistics.median(t) for m, t in times.items()}
        gms = {m: graph_ms(c) for m, c in calls.items()} if not args.no_graph else {}
        flops = 2 * (spec.head_dim + spec.head_dim_v) * kept
        tflops = flops / (ms["new"] * 1e-3) / 1e12
        if name == "causal_d128" and not over:
            causal_new_per_head, causal_kept_per_head = ms["new"] / h, kept / h
            causal_graph_per_head = gms.get("new", float("nan")) / h
        t_rel = g_rel = f_rel = float("nan")
        if causal_new_per_head and spec.head_dim == 128:
            t_rel = ms["new"] / h / causal_new_per_head
            g_rel = gms.get("new", float("nan")) / h / causal_graph_per_head
            f_rel = kept / h / causal_kept_per_head
        do = (outs["new"][0].float() - outs["old"][0].float()).abs().max().item()
        fin = torch.isfinite(outs["old"][1])
        dl = (outs["new"][1][fin] - outs["old"][1][fin]).abs().max().item() if fin.any() else 0.0
        cols = "".join(f" {ms[m]:14.3f}" for m in mode_env)
        cols += "".join(f" {gms[m]:14.3f}" for m in gms)
        print(f"{item:34}{cols} {ms['old'] / ms['new']:7.3f}x {tflops:8.1f} {t_rel:9.3f} "
              f"{g_rel:9.3f} {f_rel:12.3f} {do:9.2e} {dl:9.2e}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
