#!/usr/bin/env python3
"""Where the Hopper forward's time goes when the card runs at its power limit: the kernel with
one part of its work patched out at a time, timed next to the unpatched one.

    flashgen bench --ablation causal_d128   # B=2 H=16 S=8k (gallery shape)
    flashgen bench --ablation mistral_swa --shape 1 16 16384 \\
        --variants base no_kv_loads

Variants: ``base``; ``no_softmax`` (the softmax lambda returns at once: P is
S); ``no_pv_gemm`` / ``no_s_gemm`` (the P V / Q K^T wgmmas left out); ``no_o_rescale`` (O is
not multiplied by alpha); ``vote_o_rescale`` (the multiplies skipped when no row of the warp
changed its max: a warp vote, the result exact); ``no_kv_loads`` (the producer arrives on
``k_full`` / ``v_full`` without loading K and V: the consumers read whatever the ring holds);
``half_kv_loads`` (only the first 64 columns of each K and V row are loaded: half the bytes
from L2, an upper bound for what sharing each K/V tile between two CTAs could save).
The outputs are wrong by design (but ``vote_o_rescale``'s).  Each variant renders probe points
of ``templates/sm_90/fwd.cu.j2`` (``flashgen.build.render.PROBES``: they render to nothing by
default; ``tests/unit/test_bench_ablation.py`` checks every point and compiles every variant on
CPU), built through ``flashgen.families.build`` under its own spec name.

Printed per variant: the median ms of ``--rounds`` alternating rounds (``do_bench``, 250 ms
warm-up so each variant reaches its steady clock), its ratio to ``base``, and the power and SM
clock ``nvidia-smi dmon`` reads while it runs back to back.  On the H200 these kernels run at
~690 W (docs/perf-notes.md): a variant that saves time at a higher clock saved
energy; one that saves time at the same clock saved cycles of waiting.  Needs an sm_90 GPU,
torch, CuPy and nvidia-smi.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import subprocess
import sys
import time

from flashgen.bench import helptext

#: variant -> the probe points of ``templates/sm_90/fwd.cu.j2`` it renders
#: (:data:`flashgen.build.render.PROBES`); ``base`` renders none.
VARIANTS: dict[str, frozenset[str]] = {
    "base": frozenset(),
    **{
        name: frozenset({name})
        for name in (
            "no_softmax",
            "no_pv_gemm",
            "no_s_gemm",
            "no_o_rescale",
            "vote_o_rescale",
            "no_kv_loads",
            "half_kv_loads",
        )
    },
}


def variant_source(plan, variant: str) -> str:
    """The CUDA of ``plan`` (a Hopper forward) with ``variant``'s probe points rendered.
    ``KeyError`` for an unknown variant."""
    from flashgen.build.render import render

    return render(plan, probes=VARIANTS[variant])


def _dmon(fn, seconds: float) -> tuple[list[int], list[int]]:
    """Power (W) and SM clock (MHz) samples while ``fn`` runs back to back for ``seconds``."""
    import torch

    mon = subprocess.Popen(
        ["nvidia-smi", "dmon", "-s", "pc", "-d", "1", "-c", str(int(seconds))],
        stdout=subprocess.PIPE,
        text=True,
    )
    t = time.time()
    while time.time() - t < seconds + 0.3:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    rows = [r.split() for r in mon.communicate()[0].splitlines() if r.strip() and r[0] != "#"]
    return [int(r[1]) for r in rows[1:]], [int(r[5]) for r in rows[1:]]


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(
        prog=prog, description=helptext.plain(__doc__), formatter_class=helptext.HelpFormatter
    )
    ap.add_argument("specs", nargs="+", help="spec files or shipped spec names (no block table)")
    ap.add_argument("--shape", nargs=3, type=int, metavar=("B", "H", "S"), default=(2, 16, 8192))
    ap.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
        metavar="VARIANT", help=f"the variants to time (default: all): {', '.join(VARIANTS)}",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dmon-s", type=float, default=3.0, help="seconds of nvidia-smi per variant")
    args = ap.parse_args(argv)
    variants = ["base"] + [v for v in args.variants if v != "base"]

    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("flashgen bench --ablation needs an sm_90 GPU", file=sys.stderr)
        return 2
    # the probes are of the non-persistent kernel: calls that keep few keys per row (short
    # lengths) run it too, not the persistent one they default to (Options.sparse_persistent)
    import flashgen.families.build as family_build
    from flashgen.options import Options

    options = Options(sparse_persistent="off")
    from flashgen.bench import runner as bench
    from flashgen.build.render import render
    from flashgen.frontend.spec import load_spec
    from flashgen.ops.op import build_op

    def probed(plan):
        name = plan.context.get("spec_name", "")
        for v in VARIANTS:
            if name.endswith(f"_abl_{v}") and plan.template == "sm_90/fwd.cu.j2":
                return render(plan, probes=VARIANTS[v])
        return render(plan)

    family_build.render = probed
    b, h, s = args.shape
    dev = torch.device("cuda")
    for name in args.specs:
        spec = load_spec(name)
        params = bench.spec_params(spec, h, b, s, s, dev)
        for p in spec.scalar_params:
            params.setdefault(p.name, p.default)
        q = torch.randn(b, h, s, spec.head_dim, device=dev, dtype=torch.bfloat16)
        k = torch.randn_like(q)
        v = torch.randn(b, h, s, spec.head_dim_v, device=dev, dtype=torch.bfloat16)
        calls = {}
        for var in variants:
            op = build_op(dataclasses.replace(spec, name=f"{spec.name}_abl_{var}"), options)
            calls[var] = functools.partial(op.attention, q, k, v, **params)
            calls[var]()
        torch.cuda.synchronize()
        times: dict[str, list[float]] = {var: [] for var in variants}
        for r in range(args.rounds):
            for var in variants if r % 2 == 0 else variants[::-1]:
                times[var].append(bench.do_bench_ms(calls[var], 250, 200))
        base = sorted(times["base"])[len(times["base"]) // 2]
        print(f"{name} B={b} H={h} S={s}")
        for var in variants:
            ms = sorted(times[var])[len(times[var]) // 2]
            pw, clk = _dmon(calls[var], args.dmon_s)
            rounds = "/".join(f"{x:.3f}" for x in times[var])
            watts, mhz = f"{min(pw)}-{max(pw)} W", f"{min(clk)}-{max(clk)} MHz"
            print(f"  {var:13} {ms:7.3f} ms ({rounds})  {ms / base:.3f}x base  power {watts}  "
                  f"SM clock {mhz}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
