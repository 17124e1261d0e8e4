#!/usr/bin/env python3
"""Do block-sparse masks run faster than dense causal in proportion to the FLOPs they skip?

For sliding window (windows 256, 1024, 4096; ``specs/mistral_swa.yaml``), Llama 4 chunked
attention (chunk 1024; ``specs/chunked_local.yaml``) and prefix-LM (``--prefix``, default
1024; ``specs/prefix_lm.yaml``), against dense causal (``specs/causal_d128.yaml``), all
head_dim 128 bf16, B=1, H=16, Sq = Sk = 16384 (``--seqlen``, ``--heads``), prints per mask
and pass (forward; backward alone):

    density     fraction of the Sq x Sk (q, kv) pairs the mask keeps (exact count)
    live, full  fraction of the forward kernel's (query block, key block) tiles that are
                live / FULL (brute force, at the kernel's tiles)
    ms          median time (``flashgen.bench.runner.do_bench_ms``: triton do_bench, ``--rep-ms``);
                the forward runs on inputs that do not require grad (the backward row
                times ``torch.autograd.grad`` of a forward that does)
    causal_ms   the dense causal kernel, same pass and shape
    t/t_causal  time ratio;  d/d_causal  density ratio;  eff = (t/t_causal) / (d/d_causal):
                1.0 = time in proportion to the kept pairs, > 1 = slower than proportional
    dev_ms      forward only: device time per kernel, ``--calls`` forwards queued back to
                back behind a ``torch.cuda._sleep`` between two CUDA events (no host time
                in it; no L2 flush between calls)
    mem_ms      forward only: the least time to read q, k, v and write o, lse once at the
                measured copy ceiling (``--copy-tbs``, 4.27 TB/s on the H200): a mask that
                keeps few pairs cannot go faster than this, whatever FLOPs it skips
    floor_ms    max(causal dev_ms * d/d_causal, mem_ms);  dev_eff = dev_ms / floor_ms

    python3 tools/mask_speed.py                     # about a minute on an H200
    python3 tools/mask_speed.py --seqlen 32768 --json out.json

Needs a CUDA GPU, torch, CuPy and nvcc.  Exit status 0, or 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def mask_stats(spec, s: int, params: dict, bm: int, bn: int, dev) -> tuple[float, float, float]:
    """(fraction of kept pairs, of live tiles, of FULL tiles) of the s x s mask at (b, h) =
    (0, 0), evaluated exactly in chunks of query rows; tiles are bm x bn (the last ones
    ragged, as in the kernels)."""
    import torch

    from flashgen.ops.reference import eval_expr

    kept = live = full = 0
    rows = bm * max(1, 1024 // bm)
    nb = -(-s // bn)
    for r0 in range(0, s, rows):
        r1 = min(s, r0 + rows)
        if spec.mask is None:
            keep = torch.ones(r1 - r0, s, dtype=torch.bool, device=dev)
        else:
            env = {
                "b": torch.tensor(0, device=dev),
                "h": torch.tensor(0, device=dev),
                "q_idx": torch.arange(r0, r1, device=dev).view(-1, 1),
                "kv_idx": torch.arange(s, device=dev).view(1, -1),
                "seqlen_q": torch.tensor(s, device=dev),
                "seqlen_k": torch.tensor(s, device=dev),
                "__float__": torch.float32,
                "__device__": dev,
            }
            for p in spec.scalar_params:
                env[p.name] = torch.tensor(params.get(p.name, p.default), device=dev)
            keep = eval_expr(spec.mask, env).expand(r1 - r0, s)
        kept += int(keep.sum().item())
        for t0 in range(0, r1 - r0, bm):
            blk = keep[t0 : t0 + bm]
            pad = torch.zeros(blk.shape[0], nb * bn - s, dtype=torch.int32, device=dev)
            cnt = torch.cat([blk.to(torch.int32), pad], 1).view(blk.shape[0], nb, bn).sum((0, 2))
            widths = torch.full((nb,), bn, device=dev)
            widths[-1] = s - (nb - 1) * bn
            live += int((cnt > 0).sum().item())
            full += int((cnt == widths * blk.shape[0]).sum().item())
    tiles = -(-s // bm) * nb
    return kept / (s * s), live / tiles, full / tiles


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition time, ms")
    ap.add_argument("--fwd-only", action="store_true", help="skip the backward timings")
    ap.add_argument("--calls", type=int, default=20, help="forwards per device-time sample")
    ap.add_argument("--copy-tbs", type=float, default=4.27, help="device copy ceiling, TB/s")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("mask_speed needs a CUDA GPU", file=sys.stderr)
        return 2

    from flashgen.bench.runner import do_bench_ms
    from flashgen.families.registry import plan_forward
    from flashgen.frontend.spec import load_spec
    from flashgen.ops.op import build_op, target_for_device

    dev = torch.device("cuda")
    s, h = args.seqlen, args.heads
    cases = [
        ("causal", "causal_d128", {}),
        ("window 256", "mistral_swa", {"window": 256}),
        ("window 1024", "mistral_swa", {"window": 1024}),
        ("window 4096", "mistral_swa", {"window": 4096}),
        ("chunked 1024", "chunked_local", {"chunk": 1024}),
        (f"prefix {args.prefix}", "prefix_lm", {"prefix": args.prefix}),
    ]
    print(f"{torch.cuda.get_device_name()}  B=1 H={h} S={s} d128 bf16", flush=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (
        torch.randn(1, h, s, 128, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_()
        for _ in range(3)
    )
    do = torch.randn(1, h, s, 128, device=dev, generator=gen, dtype=torch.bfloat16)
    q0, k0, v0 = q.detach(), k.detach(), v.detach()
    # bytes a forward must move: q, k, v read, o written (bf16), lse written (fp32)
    mem_ms = (4 * h * s * 128 * 2 + h * s * 4) / (args.copy_tbs * 1e12) * 1e3

    def device_ms(fn, calls: int) -> float:
        """Median device ms per call of ``calls`` calls queued behind a sleep (5 samples)."""
        fn()
        samples = []
        for _ in range(5):
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)  # ~25 ms: the host queues every call meanwhile
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(calls):
                fn()
            b.record()
            torch.cuda.synchronize()
            samples.append(a.elapsed_time(b) / calls)
        samples.sort()
        return samples[len(samples) // 2]

    rows = []
    for label, name, params in cases:
        spec = load_spec(REPO / "specs" / f"{name}.yaml")
        op = build_op(spec)
        tiles = plan_forward(
            spec, target_for_device(spec, dev), gpu=torch.cuda.get_device_name(), persistent=False
        ).tiles
        dens, live, full = mask_stats(spec, s, params, tiles.block_m, tiles.block_n, dev)

        def fwd(op=op, params=params):
            return op.attention(q0, k0, v0, **params)

        t_f = do_bench_ms(fwd, 25, args.rep_ms)
        dev_f = device_ms(fwd, args.calls)
        o, _ = op.attention(q, k, v, **params)
        t_b = None  # --fwd-only: no backward row
        if not args.fwd_only:
            t_b = do_bench_ms(
                lambda o=o: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
                25,
                args.rep_ms,
            )
        del o
        rows.append(
            {
                "mask": label,
                "spec": name,
                "params": params,
                "density": dens,
                "tiles_live": live,
                "tiles_full": full,
                "fwd_ms": t_f,
                "fwd_dev_ms": dev_f,
                "bwd_ms": t_b,
            }
        )
        torch.cuda.empty_cache()

    base = rows[0]
    print(
        f"\n{'mask':14s} {'pass':4s} {'density':>8s} {'live':>6s} {'full':>6s} {'ms':>8s} "
        f"{'causal_ms':>9s} {'t/t_causal':>10s} {'d/d_causal':>10s} {'eff':>6s}"
    )
    for r in rows:
        d_ratio = r["density"] / base["density"]
        for pas in ("fwd", "bwd") if not args.fwd_only else ("fwd",):
            t, tc = r[f"{pas}_ms"], base[f"{pas}_ms"]
            r[f"{pas}_ratio"] = t / tc
            r[f"{pas}_eff"] = (t / tc) / d_ratio
            print(
                f"{r['mask']:14s} {pas:4s} {r['density']:8.4f} {r['tiles_live']:6.3f} "
                f"{r['tiles_full']:6.3f} {t:8.3f} {tc:9.3f} {t / tc:10.3f} {d_ratio:10.3f} "
                f"{(t / tc) / d_ratio:6.2f}"
            )
    print(f"\n{'mask':14s} {'dev_ms':>8s} {'mem_ms':>8s} {'floor_ms':>8s} {'dev_eff':>7s}")
    for r in rows:
        d_ratio = r["density"] / base["density"]
        r["mem_ms"] = mem_ms
        r["floor_ms"] = max(base["fwd_dev_ms"] * d_ratio, mem_ms)
        r["fwd_dev_eff"] = r["fwd_dev_ms"] / r["floor_ms"]
        print(
            f"{r['mask']:14s} {r['fwd_dev_ms']:8.3f} {mem_ms:8.3f} {r['floor_ms']:8.3f} "
            f"{r['fwd_dev_eff']:7.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
