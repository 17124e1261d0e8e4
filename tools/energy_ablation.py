#!/usr/bin/env python3
"""Where the Hopper forward's time goes when the card runs at its power limit: the kernel with
one part of its work patched out at a time, timed next to the unpatched one.

    python3 tools/energy_ablation.py causal_d128                 # gallery shape, B=2 H=16 S=8k
    python3 tools/energy_ablation.py mistral_swa --shape 1 16 16384 --variants base no_kv_loads

Variants (:data:`VARIANTS`): ``base``; ``no_softmax`` (the softmax lambda returns at once: P is
S); ``no_pv_gemm`` / ``no_s_gemm`` (the P V / Q K^T wgmmas left out); ``no_o_rescale`` (O is
not multiplied by alpha); ``vote_o_rescale`` (the multiplies skipped when no row of the warp
changed its max: a warp vote, the result exact); ``no_kv_loads`` (the producer arrives on
``k_full`` / ``v_full`` without loading K and V: the consumers read whatever the ring holds);
``half_kv_loads`` (only the first 64 columns of each K and V row are loaded: half the bytes
from L2, an upper bound for what sharing each K/V tile between two CTAs could save).
The outputs are wrong by design (but ``vote_o_rescale``'s).  Each variant is a text patch of
the rendered non-persistent Hopper forward (:func:`patch` raises ``ValueError`` naming a
pattern it cannot find; ``tests/unit/test_energy_ablation.py`` compiles every variant on
CPU), built through ``flashgen.families.build`` under its own spec name.

Printed per variant: the median ms of ``--rounds`` alternating rounds (``do_bench``, 250 ms
warm-up so each variant reaches its steady clock), its ratio to ``base``, and the power and SM
clock ``nvidia-smi dmon`` reads while it runs back to back.  On the H200 these kernels run at
~690 W (docs/perf-notes.md, session 9): a variant that saves time at a higher clock saved
energy; one that saves time at the same clock saved cycles of waiting.  Needs an sm_90 GPU,
torch, CuPy and nvidia-smi.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_S_GEMM = re.compile(r"\n[ \t]*fg::wgmma_ss_n\d+\(acc_s, da, db, kk > 0\);\n")
_PV_GEMM = re.compile(r"\n[ \t]*fg::wgmma_rs_n\d+\(acc_o, frag_p\[kk\], [^\n]*\);\n")
_K_LOAD = re.compile(r"\n([ \t]*fg::tma_load_4d\(sK \+ s \* SKV_BYTES[^\n]*\);)\n")
_V_LOAD = re.compile(r"\n([ \t]*fg::tma_load_4d\(sV \+ s \* SKV_BYTES[^\n]*\);)\n")
_K_TX = re.compile(r"fg::mbar_arrive_expect_tx\(k_full\(s\), SKV_BYTES\);")
_V_TX = re.compile(r"fg::mbar_arrive_expect_tx\(v_full\(s\), SKV_BYTES\);")
# the first key block, loaded in the prologue (k_full(0) told its bytes, arrived on later)
_K0_LOAD = re.compile(r"\n([ \t]*fg::tma_load_4d\(sK \+ c \* BLOCK_N \* 128[^\n]*\);)\n")
_V0_LOAD = re.compile(r"\n([ \t]*fg::tma_load_4d\(sV \+ c \* BLOCK_N \* 128[^\n]*\);)\n")
_K0_TX = re.compile(r"fg::mbar_expect_tx\(k_full\(0\), SKV_BYTES\);")
_V0_TX = re.compile(r"fg::mbar_arrive_expect_tx\(v_full\(0\), SKV_BYTES\);")
_SOFTMAX = re.compile(r"auto softmax = \[&\]\(int n0, int tile_cls\) \{\n")
_RESCALE = re.compile(r"acc_o\[4 \* j \+ i\] \*= alpha\[i / 2\];")
_RESCALE_LOOP = re.compile(
    r"(\n[ \t]*#pragma unroll\n[ \t]*for \(int j = 0; j < NO; \+\+j\)\n[ \t]*#pragma unroll\n"
    r"[ \t]*for \(int i = 0; i < 4; \+\+i\) acc_o\[4 \* j \+ i\] \*= alpha\[i / 2\];\n)"
)

#: variant -> [(pattern, replacement)]; every pattern must match at least once.
VARIANTS: dict[str, list[tuple[re.Pattern, str]]] = {
    "base": [],
    "no_softmax": [(_SOFTMAX, "auto softmax = [&](int n0, int tile_cls) {\n        return;\n")],
    "no_pv_gemm": [(_PV_GEMM, "\n;\n")],
    "no_s_gemm": [(_S_GEMM, "\n;\n")],
    "no_o_rescale": [(_RESCALE, ";")],
    "vote_o_rescale": [
        (_RESCALE_LOOP, "\nif (__any_sync(~0u, alpha[0] != 1.f || alpha[1] != 1.f)) {\\1}\n")
    ],
    "no_kv_loads": [
        (_K_TX, "fg::mbar_arrive(k_full(s));"),
        (_V_TX, "fg::mbar_arrive(v_full(s));"),
        (_K_LOAD, "\n;\n"),
        (_V_LOAD, "\n;\n"),
        (_K0_TX, ";"),  # its arrival comes after stage_info[0], as before
        (_V0_TX, "fg::mbar_arrive(v_full(0));"),
        (_K0_LOAD, "\n;\n"),
        (_V0_LOAD, "\n;\n"),
    ],
    "half_kv_loads": [
        (_K_TX, "fg::mbar_arrive_expect_tx(k_full(s), SKV_BYTES / DCB);"),
        (_V_TX, "fg::mbar_arrive_expect_tx(v_full(s), SKV_BYTES / DCB);"),
        (_K_LOAD, "\nif (c == 0)\\1\n"),
        (_V_LOAD, "\nif (c == 0)\\1\n"),
        (_K0_TX, "fg::mbar_expect_tx(k_full(0), SKV_BYTES / DCB);"),
        (_V0_TX, "fg::mbar_arrive_expect_tx(v_full(0), SKV_BYTES / DCB);"),
        (_K0_LOAD, "\nif (c == 0)\\1\n"),
        (_V0_LOAD, "\nif (c == 0)\\1\n"),
    ],
}


def patch(src: str, variant: str) -> str:
    """``src`` (a rendered non-persistent Hopper forward) with ``variant``'s work left out.
    Raises ``ValueError`` naming the first pattern that does not match, ``KeyError`` for an
    unknown variant."""
    for pat, repl in VARIANTS[variant]:
        src, n = pat.subn(repl, src)
        if n == 0:
            raise ValueError(f"energy_ablation: {variant}: {pat.pattern!r} not in the source")
    return src


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("specs", nargs="+", help="shipped spec names (no block table)")
    ap.add_argument("--shape", nargs=3, type=int, metavar=("B", "H", "S"), default=(2, 16, 8192))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dmon-s", type=float, default=3.0, help="seconds of nvidia-smi per variant")
    args = ap.parse_args(argv)
    variants = ["base"] + [v for v in args.variants if v != "base"]

    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("energy_ablation needs an sm_90 GPU", file=sys.stderr)
        return 2
    # the patches are of the non-persistent kernel: calls that keep few keys per row (short
    # lengths) run it too, not the persistent one they default to (Options.sparse_persistent)
    import flashgen.families.build as family_build
    from flashgen.options import Options

    options = Options(sparse_persistent="off")
    from flashgen.bench import runner as bench
    from flashgen.frontend.spec import load_spec
    from flashgen.ops.op import build_op

    render = family_build.render

    def patched(plan):
        src = render(plan)
        name = plan.context.get("spec_name", "")
        for v in VARIANTS:
            if name.endswith(f"_abl_{v}") and plan.template == "sm_90/fwd.cu.j2":
                return patch(src, v)
        return src

    family_build.render = patched
    root = Path(__file__).resolve().parent.parent
    b, h, s = args.shape
    dev = torch.device("cuda")
    for name in args.specs:
        spec = load_spec(root / "specs" / f"{name}.yaml")
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
