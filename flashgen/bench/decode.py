"""Decode benchmark: bytes of K and V read per second by ``op.with_kvcache`` (split-KV, paged
cache, GQA packing) against SDPA's flash and cuDNN backends and FlexAttention on the dense
cache, in one run (``python -m flashgen.bench.decode`` or ``flashgen bench --decode``).

"KV read" is the unique cache bytes a call needs: ``2 x B x Hkv x live keys x D x element
size`` (whatever a peer does with GQA).  Every call is timed inside a CUDA graph of
``--calls`` back-to-back calls (no launch gaps, no host time), each method once per round,
rounds alternating between the methods; the figure is the median over rounds.  Sq_new = 1,
bf16, head_dim 128, Hq/Hkv 32/8 by default.  Extra rows: GQA packing off (B1/64k), sliding
window (mistral_swa, window 4096, whose time should follow the window's bytes), and the host
time of a planned call (``host_us``, the stream kept busy by the queued kernels).
Writes ``--out`` (JSON) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _graph_time(fn, calls: int):
    """A CUDA graph of ``calls`` calls of ``fn`` and a function timing one replay (ms per call)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run() -> float:
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls

    run()
    return run


def _peers(q, k, v):
    """name -> zero-arg callable on the dense cache k, v ``[B, Hkv, L, D]``."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                     ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):  # fmt: skip

        def call(be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        out[name] = call
    try:
        from flashgen.bench.runner import flex_compiled

        flex = flex_compiled()
        out["flex"] = lambda: flex(q, k, v, enable_gqa=True)
    except Exception:  # noqa: BLE001 - no Triton: no FlexAttention row
        pass
    del torch
    return out


def run(args) -> list[dict]:
    import torch

    import flashgen

    dev = torch.device("cuda")
    op = flashgen.load(REPO / "specs" / "llama3_gqa.yaml")
    swa = flashgen.load(REPO / "specs" / "mistral_swa.yaml")
    hq, hkv, d = args.heads_q, args.heads_kv, 128
    rows: list[dict] = []
    layouts = [x for x in args.layouts.split(",") if x]
    for batch in args.batch:
        for cache in args.cache:
            live = cache
            kv_bytes = 2 * batch * hkv * live * d * 2
            q = torch.randn(batch, hq, 1, d, device=dev, dtype=torch.bfloat16)
            lens = torch.full((batch,), live, dtype=torch.int32, device=dev)
            free = torch.cuda.mem_get_info()[0]
            fits = len(layouts) * kv_bytes < 0.7 * free
            groups = [layouts] if fits else [[lay] for lay in layouts]
            for group in groups:
                self_rows = _time_group(args, op, swa, q, lens, batch, cache, hq, hkv, d, group,
                                        kv_bytes)  # fmt: skip
                rows.extend(self_rows)
                torch.cuda.empty_cache()
    return rows


def _time_group(args, op, swa, q, lens, batch, cache, hq, hkv, d, layouts, kv_bytes):
    """Allocate the caches of ``layouts``, time every method on them (alternating rounds)."""
    import torch

    dev = q.device
    live = cache
    rows: list[dict] = []
    if True:
        if True:
            methods: dict = {}
            tensors = []
            for lay in layouts:
                if lay == "dense":
                    kc = torch.randn(batch, hkv, live, d, device=dev, dtype=torch.bfloat16)
                    vc = torch.randn_like(kc)
                    table, ps, npages = None, None, None
                    for name, fn in _peers(q.transpose(1, 2).transpose(1, 2), kc, vc).items():
                        methods[name] = fn
                else:
                    ps = int(lay.removeprefix("paged"))
                    pages = -(-live // ps)
                    npages = batch * pages
                    kc = torch.randn(npages, ps, hkv, d, device=dev, dtype=torch.bfloat16)
                    vc = torch.randn_like(kc)
                    perm = torch.randperm(npages, device=dev).int()
                    table = perm.view(batch, pages).contiguous()
                tensors.append((kc, vc, table))
                plan = op.plan_decode(
                    batch=batch,
                    num_heads=hq,
                    num_heads_kv=hkv,
                    seqlen_q=1,
                    cache_capacity=live,
                    page_size=ps,
                    num_pages=npages,
                )

                def ours(kc=kc, vc=vc, table=table, plan=plan):
                    return op.with_kvcache(q, kc, vc, lens, block_table=table, plan=plan)

                methods[f"flashgen_{lay}"] = ours
                methods[f"flashgen_{lay}"].splits = plan.num_splits
                if lay == layouts[0] and batch == 1 and cache >= 65536:
                    nopack = op.plan_decode(batch=batch, num_heads=hq, num_heads_kv=hkv,
                                            seqlen_q=1, cache_capacity=live, page_size=ps,
                                            num_pages=npages, pack_gqa=False)  # fmt: skip
                    methods[f"flashgen_{lay}_nopack"] = (
                        lambda kc=kc, vc=vc, table=table, p=nopack: op.with_kvcache(
                            q, kc, vc, lens, block_table=table, plan=p))  # fmt: skip
                    splan = swa.plan_decode(
                        batch=batch,
                        num_heads=hq,
                        num_heads_kv=hkv,
                        seqlen_q=1,
                        cache_capacity=live,
                        page_size=ps,
                        num_pages=npages,
                    )
                    methods[f"flashgen_{lay}_swa4096"] = (
                        lambda kc=kc, vc=vc, table=table, p=splan: swa.with_kvcache(
                            q, kc, vc, lens, block_table=table, plan=p, window=4096))  # fmt: skip
            timers = {}
            for name, fn in methods.items():
                try:
                    timers[name] = _graph_time(fn, args.calls)
                except Exception as e:  # noqa: BLE001 - a peer that cannot run here
                    print(f"  {name} B{batch} {cache}: skipped ({type(e).__name__}: {e})"[:200],
                          file=sys.stderr)  # fmt: skip
            times: dict = {n: [] for n in timers}
            for _ in range(args.rounds):
                for name, t in timers.items():
                    times[name].append(t())
            for name, ts in times.items():
                ms = statistics.median(ts)
                nbytes = kv_bytes
                if name.endswith("_swa4096"):
                    nbytes = 2 * batch * hkv * min(live, 4096) * d * 2
                row = {"method": name, "batch": batch, "cache": cache, "heads_q": hq,
                       "heads_kv": hkv, "head_dim": d, "dtype": "bf16", "ms": ms,
                       "kv_bytes": nbytes, "tb_per_s": nbytes / (ms * 1e-3) / 1e12}  # fmt: skip
                if hasattr(methods[name], "splits"):
                    row["num_splits"] = methods[name].splits
                rows.append(row)
                print(f"B{batch:<3} {cache:>7} {name:<26} {ms * 1e3:9.1f} us "
                      f"{row['tb_per_s']:6.2f} TB/s", flush=True)  # fmt: skip
            # host time of a planned call, the stream kept busy by the queued kernels
            fn = methods.get(f"flashgen_{layouts[-1]}")
            if (
                fn is not None
                and batch == args.batch[0]
                and cache == args.cache[0]
                and (layouts[-1] == args.layouts.split(",")[-1])
            ):
                for _ in range(20):
                    fn()
                n = 200
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                host_us = (time.perf_counter() - t0) / n * 1e6
                torch.cuda.synchronize()
                rows.append({"method": "host_us_planned_call", "batch": batch, "cache": cache,
                             "host_us": host_us})  # fmt: skip
                print(f"host time of a planned call: {host_us:.1f} us", flush=True)
            del methods, timers, tensors
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashgen.bench.decode", description=__doc__)
    ap.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    ap.add_argument("--cache", type=lambda s: [int(x) for x in s.split(",")],
                    default=[4096, 16384, 65536, 131072])  # fmt: skip
    ap.add_argument("--layouts", default="dense,paged16,paged1,paged256")
    ap.add_argument("--heads-q", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds (median)")
    ap.add_argument("--quick", action="store_true", help="B1 and B16 at 64k only")
    ap.add_argument("--out", default="benchmarks/results/decode.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.cache = [1, 16], [65536]
    import torch

    if not torch.cuda.is_available():
        print("flashgen bench --decode needs a CUDA device", file=sys.stderr)
        return 1
    rows = run(args)
    doc = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
