"""Decode benchmark: bytes of K and V read per second by ``op.with_kvcache`` (split-KV, paged
cache, GQA packing) against SDPA's flash and cuDNN backends and FlexAttention on the dense
cache, in one run (``python -m flashgen.bench.decode`` or ``flashgen bench --decode``).

"KV read" is the unique cache bytes a call needs: ``2 x B x Hkv x live keys x D x element
size`` (whatever a peer does with GQA).  Every call is timed inside a CUDA graph of
back-to-back calls (``--calls`` at most, fewer for long calls so a replay takes about 2 ms:
no launch gaps, no host time), each method once per round, rounds alternating between the
methods; the figure is the median over rounds.  The default set is B 1, 16 and 64 by cache
4k, 16k, 64k and 128k, each dense, paged 16 and paged 1 (about 4 minutes on an H200);
``--quick`` is B1 and B16 at 64k with page 256 too.  FlexAttention (compiled per shape) runs
at the ``--flex-cache`` lengths only.  Sq_new = 1,
bf16, head_dim 128, Hq/Hkv 32/8 by default.  Extra rows: GQA packing off (B1/64k), sliding
window (mistral_swa, window 4096, whose time should follow the window's bytes), and the host
time of a planned call (``host_us``, the stream kept busy by the queued kernels).
``--fp8`` adds, for every flashgen layout, the same call on an e4m3 cache of the same shape
(``flashgen_<layout>_fp8``: the kv8 unit, per (request, kv head) descale tensors): its KV
read is half the bytes (1-byte elements), and its row carries ``speedup_vs_bf16`` (the bf16
call's time over its own, the figure the FP8 cache is for: > 1 means faster).
Writes ``--out`` (JSON), prints a table and, where matplotlib is importable, writes the
plot (TB/s against cache length, one panel per batch) next to the JSON;
``--plot JSON`` redraws the plot of an earlier run (each method keeps one color and marker
across panels: :data:`STYLES`).

``--option decode.NAME=A,B`` (repeatable; :class:`flashgen.families.decode.Options` fields,
the dotted names of ``flashgen ab --list-options``) times every flashgen layout once per
variant (``--combine``: product, zip or each, as ``flashgen ab``), in the same alternating
rounds as the peers: rows ``flashgen_<layout>@<name=value,...>`` (the first variant, the
baseline, too), each with its ``num_splits`` and ``options``.  E.g. ``--option
decode.stages=2,6 --option decode.merge_unroll=4,16 --combine zip``.

``--mla`` times MLA decode (specs/mla_decode.yaml: one latent cache of 576-column rows, the
values its first 512 columns) with ``decode.mla_unit`` ``mma_sync`` (16 query heads per CTA),
``wgmma`` (the Hopper unit, 64 per CTA) and ``auto`` (opt-in, not the default yet: the unit
:func:`flashgen.families.decode.mla_auto_unit` picks for the shape, whose row says which and
the rule's work), in alternating rounds in CUDA graphs, at the ``--mla-heads`` query heads
and ``--mla-sq`` new tokens (defaults :data:`MLA_DEFAULTS`), next to the device-copy and
bf16-matmul ceilings measured in the same run: each row has the latent cache's bytes read
per second (:func:`mla_bytes`, and its share of the copy ceiling) and the matmul rate
(:func:`mla_flops`, and its share of the matmul ceiling), the figures of the MLA targets (85%
of the copy ceiling at 16 heads, 65% of the matmul ceiling at 128), and whether ``auto``
picked the faster unit at each point (:func:`mla_auto_check`); ``<out stem>_mla.json``.

``--sweep`` picks the decode defaults in one GPU call: it times the grid of
:class:`flashgen.families.decode.Options` in :data:`SWEEP_UNITS` (block_n, stages,
min_split_blocks; variants that spill or do not fit are skipped) times :data:`SWEEP_WAVES`
split waves at the latency-bound shapes of :data:`SWEEP_SHAPES` (B1 64k / 16k / 4k paged 16
and a 4096-key window in a 64k cache), alternating rounds in CUDA graphs, and prints every
point and the best per shape (``<out stem>_sweep.json``).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

from flashgen.bench import helptext
from flashgen.bench.argtypes import positive_int, positive_ints

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- arguments
def layouts(text: str) -> list[str]:
    """An argparse ``type`` for ``--layouts``: comma-separated ``dense`` or ``pagedN`` (a
    paged cache of N-key pages, N >= 1), each once."""
    parts = [p.strip() for p in text.split(",")]
    ok = all(p == "dense" or (re.fullmatch(r"paged[0-9]+", p) and int(p[5:]) >= 1)
             for p in parts)  # fmt: skip
    if not ok or len(set(parts)) != len(parts):
        raise argparse.ArgumentTypeError(
            f"layouts: expected comma-separated dense or pagedN (N >= 1: keys per page), each "
            f"once, got {text!r}"
        )
    return parts


def page_size(layout: str) -> int | None:
    """The page size of a :func:`layouts` entry (None: dense)."""
    return None if layout == "dense" else int(layout.removeprefix("paged"))


def check_heads(heads_q: int, heads_kv: int) -> str | None:
    """Why ``heads_q`` query heads cannot share ``heads_kv`` kv heads (GQA), or None."""
    if heads_q % heads_kv:
        return (
            f"heads: expected heads_q a multiple of heads_kv (GQA groups), got {heads_q} / "
            f"{heads_kv}"
        )
    return None


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


def alternating_medians(timers: dict, rounds: int) -> dict:
    """``{name: median ms}`` of ``rounds`` rounds, each timing every ``timers[name]()`` (a
    replay timer of :func:`_graph_time`) once, in order: alternating rounds."""
    times: dict = {name: [] for name in timers}
    for _ in range(rounds):
        for name, t in timers.items():
            times[name].append(t())
    return {name: statistics.median(ts) for name, ts in times.items()}


def _peers(q, k, v, flex: bool = True):
    """name -> zero-arg callable on the dense cache k, v ``[B, Hkv, L, D]`` (FlexAttention
    when ``flex``)."""
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
    if flex:
        try:
            from flashgen.bench.peers import flex_compiled

            fx = flex_compiled()
            out["flex"] = lambda: fx(q, k, v, enable_gqa=True)
        except Exception:  # noqa: BLE001 - no Triton: no FlexAttention row
            pass
    del torch
    return out


def option_variants(texts, combine: str = "product") -> list[tuple[str, object]]:
    """``--option decode.NAME=A,B`` texts -> ``[(label, decode Options or None)]``, the
    baseline first (:func:`flashgen.bench.options.combinations`); the label joins the
    varying ``name=value`` pairs with commas (empty with no ``--option``: the op's own
    options, ``None``).  Raises :class:`flashgen.bench.options.OptionError` (a
    ``ValueError``) for a bad name or value, or a field outside ``decode.``."""
    from flashgen.bench import options as opt
    from flashgen.options import DEFAULT

    values = opt.parse_options(texts)
    other = [n for n in values if not n.startswith("decode.")]
    if other:
        raise opt.OptionError(
            f"--option {', '.join(other)}: only decode.* options shape decode calls"
        )
    if not values:
        return [("", None)]
    return [(opt.variant_label(a, values).replace(" ", ","),
             opt.with_options(DEFAULT, a).decode)
            for a in opt.combinations(values, combine)]  # fmt: skip


def run(args) -> list[dict]:
    import torch

    import flashgen

    dev = torch.device("cuda")
    op = flashgen.load(REPO / "specs" / "llama3_gqa.yaml")
    swa = flashgen.load(REPO / "specs" / "mistral_swa.yaml")
    hq, hkv, d = args.heads_q, args.heads_kv, 128
    rows: list[dict] = []
    layouts = list(args.layouts)
    for batch in args.batch:
        for cache in args.cache:
            live = cache
            kv_bytes = 2 * batch * hkv * live * d * 2
            q = torch.randn(batch, hq, 1, d, device=dev, dtype=torch.bfloat16)
            lens = torch.full((batch,), live, dtype=torch.int32, device=dev)
            free = torch.cuda.mem_get_info()[0]
            fits = len(layouts) * kv_bytes * (1.5 if args.fp8 else 1.0) < 0.7 * free
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
                    flex = cache in args.flex_cache
                    for name, fn in _peers(q, kc, vc, flex).items():
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
                for label, opts in args.variants:
                    plan = op.plan_decode(batch=batch, num_heads=hq, num_heads_kv=hkv,
                                          seqlen_q=1, cache_capacity=live, page_size=ps,
                                          num_pages=npages, options=opts)  # fmt: skip

                    def ours(kc=kc, vc=vc, table=table, plan=plan):
                        return op.with_kvcache(q, kc, vc, lens, block_table=table, plan=plan)

                    name = f"flashgen_{lay}" + (f"@{label}" if label else "")
                    methods[name] = ours
                    methods[name].splits = plan.num_splits
                    methods[name].options = label
                if args.fp8:  # the same shape on an e4m3 cache (half the bytes)
                    f8 = torch.float8_e4m3fn
                    k8, v8 = kc.to(f8), vc.to(f8)
                    ds = torch.full((batch, hkv), 0.01, device=dev)
                    tensors.append((k8, v8, ds))
                    plan8 = op.plan_decode(batch=batch, num_heads=hq, num_heads_kv=hkv,
                                           seqlen_q=1, cache_capacity=live, page_size=ps,
                                           num_pages=npages, cache_dtype=f8)  # fmt: skip

                    def ours8(k8=k8, v8=v8, table=table, plan=plan8, ds=ds):
                        return op.with_kvcache(q, k8, v8, lens, block_table=table, plan=plan,
                                               k_descale=ds, v_descale=ds)  # fmt: skip

                    methods[f"flashgen_{lay}_fp8"] = ours8
                    methods[f"flashgen_{lay}_fp8"].splits = plan8.num_splits
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
            # calls per graph: a replay of about 2 ms (at 4 TB/s), 3 at least
            calls = max(3, min(args.calls, int(2e-3 * 4e12 / max(kv_bytes, 1))))
            for name, fn in methods.items():
                try:
                    timers[name] = _graph_time(fn, calls)
                except Exception as e:  # noqa: BLE001 - a peer that cannot run here
                    print(f"  {name} B{batch} {cache}: skipped ({type(e).__name__}: {e})"[:200],
                          file=sys.stderr)  # fmt: skip
            medians = alternating_medians(timers, args.rounds)
            for name, ms in medians.items():
                fp8 = name.endswith("_fp8")
                nbytes = kv_bytes // 2 if fp8 else kv_bytes  # 1-byte elements
                if name.endswith("_swa4096"):
                    nbytes = 2 * batch * hkv * min(live, 4096) * d * 2
                row = {"method": name, "batch": batch, "cache": cache, "heads_q": hq,
                       "heads_kv": hkv, "head_dim": d, "dtype": "fp8_e4m3" if fp8 else "bf16",
                       "ms": ms, "kv_bytes": nbytes,
                       "tb_per_s": nbytes / (ms * 1e-3) / 1e12}  # fmt: skip
                if hasattr(methods[name], "splits"):
                    row["num_splits"] = methods[name].splits
                if getattr(methods[name], "options", None):
                    row["options"] = methods[name].options
                extra = ""
                bf16 = medians.get(name.removesuffix("_fp8")) if fp8 else None
                if bf16 is not None:
                    row["speedup_vs_bf16"] = bf16 / ms
                    extra = f"  {bf16 / ms:5.2f}x the bf16 cache's speed"
                rows.append(row)
                print(f"B{batch:<3} {cache:>7} {name:<40} {ms * 1e3:9.1f} us "
                      f"{row['tb_per_s']:6.2f} TB/s{extra}", flush=True)  # fmt: skip
            # host time of a planned call, the stream kept busy by the queued kernels
            base = args.variants[0][0]
            fn = methods.get(f"flashgen_{layouts[-1]}" + (f"@{base}" if base else ""))
            if (
                fn is not None
                and batch == args.batch[0]
                and cache == args.cache[0]
                and layouts[-1] == args.layouts[-1]
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


#: The --sweep grid: unit variants (block_n, stages, min_split_blocks; the other knobs as
#: the defaults) and the split waves each is timed at.
SWEEP_UNITS = (
    dict(),
    dict(block_n=64, stages=4),
    dict(block_n=64, stages=2),
    dict(block_n=128, stages=2),
    dict(block_n=128, stages=3),
    dict(min_split_blocks=2),
    dict(block_n=64, stages=2, min_split_blocks=2),
    dict(merge_unroll=16),
    dict(block_n=64, stages=6),
    dict(block_n=64, stages=6, merge_unroll=16),
)
SWEEP_WAVES = (0.5, 1.0, 2.0)
#: The --sweep shapes: (label, spec, cache length, window or None); B1, Hq/Hkv 32/8, paged 16.
SWEEP_SHAPES = (
    ("B1 64k paged16", "llama3_gqa", 65536, None),
    ("B1 16k paged16", "llama3_gqa", 16384, None),
    ("B1 8k paged16", "llama3_gqa", 8192, None),
    ("B1 4k paged16", "llama3_gqa", 4096, None),
    ("B1 64k paged16 swa4096", "mistral_swa", 65536, 4096),
)


def _sweep_units(ops: dict, dev) -> list:
    """The :data:`SWEEP_UNITS` that plan and compile spill-free for every sweep spec on
    ``dev`` (built in parallel through the cache), as Options; the others are reported and
    left out."""
    from concurrent.futures import ThreadPoolExecutor

    from flashgen.build import cache
    from flashgen.build.render import render
    from flashgen.families import decode as family
    from flashgen.ops.op import target_for_device

    def build(job):
        name, knobs = job
        spec = ops[name].spec
        try:
            p = family.plan(spec, target_for_device(spec, dev), family.Options(**knobs))
            _, report = cache.get_or_build(render(p), p)
        except Exception as e:  # noqa: BLE001 - a variant that does not fit or build
            return job, f"{type(e).__name__}: {e}"[:160]
        spills = [f"{k.name}: {k.spill_bytes} B spilled" for k in report.kernels if k.spill_bytes]
        regs = max(k.registers for k in report.kernels)
        return job, "; ".join(spills) or f"ok ({regs} registers, {p.smem_bytes} B smem)"

    jobs = [(n, k) for k in SWEEP_UNITS for n in ops]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(build, jobs))
    bad = set()
    for (name, knobs), what in results:
        print(f"  unit {name} {knobs or 'defaults'}: {what}", flush=True)
        if not what.startswith("ok"):
            bad.add(tuple(sorted(knobs.items())))
    return [family.Options(**k) for k in SWEEP_UNITS if tuple(sorted(k.items())) not in bad]


def sweep(args) -> list[dict]:
    """Time the :data:`SWEEP_UNITS` x :data:`SWEEP_WAVES` grid of decode options at the
    :data:`SWEEP_SHAPES` (B1, paged 16: the latency-bound calls) in one run: CUDA graphs,
    alternating rounds, medians; prints every point and the best per shape against the
    defaults, and returns the rows.  Variants that spill or do not fit are skipped."""
    import torch

    import flashgen

    dev = torch.device("cuda", torch.cuda.current_device())
    hq, hkv, d, ps = args.heads_q, args.heads_kv, 128, 16
    ops = {n: flashgen.load(REPO / "specs" / f"{n}.yaml") for n in {s[1] for s in SWEEP_SHAPES}}
    t0 = time.perf_counter()
    units = _sweep_units(ops, dev)
    print(f"sweep: {len(units)} unit variants built in {time.perf_counter() - t0:.0f} s",
          flush=True)  # fmt: skip
    cap = max(s[2] for s in SWEEP_SHAPES)
    pages = cap // ps
    kc = torch.randn(pages, ps, hkv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table_full = torch.randperm(pages, device=dev).int().view(1, pages).contiguous()
    q = torch.randn(1, hq, 1, d, device=dev, dtype=torch.bfloat16)
    from flashgen.families import decode as family

    timers, meta = {}, {}
    for label, name, cache, window in SWEEP_SHAPES:
        op = ops[name]
        table = table_full[:, : cache // ps]
        lens = torch.full((1,), cache, dtype=torch.int32, device=dev)
        kv_bytes = 2 * hkv * (min(cache, window) if window else cache) * d * 2
        calls = max(3, min(args.calls, int(2e-3 * 4e12 / kv_bytes)))
        params = {"window": window} if window else {}
        for opts in units:
            seen = set()
            for w in SWEEP_WAVES:
                o = family.Options(**{**opts.__dict__, "split_waves": w})
                plan = op.plan_decode(batch=1, num_heads=hq, num_heads_kv=hkv, seqlen_q=1,
                                      cache_capacity=cache, page_size=ps, num_pages=pages,
                                      device=dev, options=o, **params)  # fmt: skip
                if plan.num_splits in seen:
                    continue
                seen.add(plan.num_splits)

                def fn(op=op, plan=plan, table=table, lens=lens, params=params):
                    return op.with_kvcache(q, kc, vc, lens, block_table=table, plan=plan,
                                           **params)  # fmt: skip

                key = (label, opts.block_n, opts.stages, opts.min_split_blocks,
                       opts.merge_unroll, w)  # fmt: skip
                try:
                    timers[key] = _graph_time(fn, calls)
                except Exception as e:  # noqa: BLE001
                    print(f"  {key}: skipped ({type(e).__name__}: {e})"[:200], file=sys.stderr)
                    continue
                unit = plan.kernels["attn"].plan
                meta[key] = dict(shape=label, spec=name, cache=cache, window=window,
                                 block_n=unit.tiles.block_n, stages=unit.tiles.stages,
                                 min_split_blocks=opts.min_split_blocks,
                                 merge_unroll=opts.merge_unroll, split_waves=w,
                                 num_splits=plan.num_splits, grid=list(plan.geometry.grid),
                                 ctas_per_sm=family.ctas_per_sm(unit), kv_bytes=kv_bytes,
                                 default=opts == family.Options() and w == 1.0)  # fmt: skip
    rows = []
    for k, ms in alternating_medians(timers, args.rounds).items():
        m = meta[k]
        rows.append({**m, "method": "sweep", "us": ms * 1e3,
                     "tb_per_s": m["kv_bytes"] / (ms * 1e-3) / 1e12})  # fmt: skip
    print(f"{'shape':<24} {'block_n':>7} {'stages':>6} {'msb':>3} {'merge':>5} {'waves':>5} "
          f"{'splits':>6} {'grid':>14} {'us':>8} {'TB/s':>6}")  # fmt: skip
    for r in sorted(rows, key=lambda r: (r["shape"], r["us"])):
        print(f"{r['shape']:<24} {r['block_n']:>7} {r['stages']:>6} {r['min_split_blocks']:>3} "
              f"{r['merge_unroll']:>5} {r['split_waves']:>5} {r['num_splits']:>6} "
              f"{str(tuple(r['grid'])):>14} "
              f"{r['us']:8.1f} {r['tb_per_s']:6.2f}"
              f"{'  (default)' if r['default'] else ''}")  # fmt: skip
    print("best per shape:")
    for label, *_ in SWEEP_SHAPES:
        mine = [r for r in rows if r["shape"] == label]
        if not mine:
            continue
        best = min(mine, key=lambda r: r["us"])
        dflt = next((r for r in mine if r["default"]), None)
        gain = f", {dflt['us'] / best['us']:.2f}x the default's {dflt['us']:.1f} us" if dflt else ""
        print(f"  {label}: block_n {best['block_n']} stages {best['stages']} min_split_blocks "
              f"{best['min_split_blocks']} merge_unroll {best['merge_unroll']} split_waves "
              f"{best['split_waves']} (splits "
              f"{best['num_splits']}): {best['us']:.1f} us, {best['tb_per_s']:.2f} TB/s"
              f"{gain}")  # fmt: skip
    win = [r for r in rows if r["window"]]
    dense4k = [r for r in rows if r["shape"] == "B1 4k paged16"]
    if win and dense4k:
        bw, bd = min(win, key=lambda r: r["us"]), min(dense4k, key=lambda r: r["us"])
        print(f"  window / 4k cache (best of each): {bw['us'] / bd['us']:.2f}x (target <= 1.2x)")
    return rows


# ----------------------------------------------------------------------------- --mla
#: What ``--mla`` times where ``--batch``, ``--cache``, ``--layouts``, ``--mla-heads`` and
#: ``--mla-sq`` are not given.
MLA_DEFAULTS = {"batch": [1, 64], "cache": [4096, 32768], "layouts": ["paged64"],
                "mla_heads": [16, 64, 128], "mla_sq": [1]}  # fmt: skip
#: The ``--mla`` variants, by ``decode.mla_unit``: the mma.sync unit (the default), the Hopper
#: unit, and ``auto``'s per-shape choice between them (opt-in).
MLA_VARIANTS = ("mma_sync", "wgmma", "auto")
#: Flags ``--mla`` does not read.
MLA_IGNORES = ("option", "combine", "fp8", "flex_cache", "quick", "sweep")
MLA_HEAD_DIMS = (576, 512)


def mla_bytes(batch: int, cache: int) -> int:
    """The latent-cache bytes an MLA call reads at least (each row once, for K and V):
    ``batch x cache x 576 x 2`` (bf16)."""
    return batch * cache * MLA_HEAD_DIMS[0] * 2


def mla_flops(batch: int, heads: int, sq: int, cache: int) -> int:
    """The matmul FLOPs of an MLA call: ``2 x batch x heads x sq x cache x (576 + 512)`` (Q K^T
    and P V; the keys the causal mask drops among the new tokens, fewer than ``sq`` per row,
    counted too)."""
    return 2 * batch * heads * sq * cache * sum(MLA_HEAD_DIMS)


def run_mla(args) -> tuple[list[dict], dict]:
    """Time the :data:`MLA_VARIANTS` at every (batch, cache, layout, heads, sq) point; the
    rows and the ceilings (:func:`flashgen.bench.timing.measure_ceilings`)."""
    import torch

    import flashgen
    from flashgen.bench.timing import measure_ceilings
    from flashgen.families import decode as family

    dev = torch.device("cuda")
    spec = REPO / "specs" / "mla_decode.yaml"
    ops = {name: flashgen.load(spec, options=flashgen.Options(decode=family.Options(mla_unit=name)))
           for name in MLA_VARIANTS}  # fmt: skip
    ceil = measure_ceilings(dev)
    copy_tbs, matmul = ceil["copy_gbps"] / 1e3, ceil["matmul_bf16_tflops"]
    print(f"ceilings: device copy {copy_tbs:.2f} TB/s (read + write), bf16 matmul "
          f"{matmul:.0f} TFLOP/s", flush=True)  # fmt: skip
    rows: list[dict] = []
    d = MLA_HEAD_DIMS[0]
    for batch in args.batch:
        for cache in args.cache:
            for lay in args.layouts:
                ps = page_size(lay)
                lens = torch.full((batch,), cache, dtype=torch.int32, device=dev)
                if ps is None:
                    kc = torch.randn(batch, 1, cache, d, device=dev, dtype=torch.bfloat16)
                    table, npages = None, None
                else:
                    pages = -(-cache // ps)
                    npages = batch * pages
                    kc = torch.randn(npages, ps, 1, d, device=dev, dtype=torch.bfloat16)
                    table = torch.randperm(npages, device=dev).int().view(batch, pages)
                    table = table.contiguous()
                for hq in args.mla_heads:
                    for sq in args.mla_sq:
                        rows += _time_mla(args, ops, kc, table, lens, lay, ps, npages, hq, sq,
                                          copy_tbs, matmul)  # fmt: skip
                del kc, table
                torch.cuda.empty_cache()
    return rows, ceil


def _time_mla(args, ops, kc, table, lens, lay, ps, npages, hq, sq, copy_tbs, matmul):
    import torch

    batch, cache = lens.shape[0], int(lens[0])
    q = torch.randn(batch, hq, sq, MLA_HEAD_DIMS[0], device=kc.device, dtype=torch.bfloat16)
    methods = {}
    for name, op in ops.items():
        plan = op.plan_decode(batch=batch, num_heads=hq, num_heads_kv=1, seqlen_q=sq,
                              cache_capacity=cache, page_size=ps, num_pages=npages)  # fmt: skip
        methods[name] = (lambda op=op, plan=plan: op.with_kvcache(q, kc, None, lens,
                                                                  block_table=table, plan=plan),
                         plan)  # fmt: skip
    nbytes, flops = mla_bytes(batch, cache), mla_flops(batch, hq, sq, cache)
    calls = max(3, min(args.calls, int(2e-3 * 3e12 / max(nbytes, 1))))
    timers = {name: _graph_time(fn, calls) for name, (fn, _) in methods.items()}
    out = []
    for name, ms in alternating_medians(timers, args.rounds).items():
        plan = methods[name][1]
        tbs, tflops = nbytes / (ms * 1e-3) / 1e12, flops / (ms * 1e-3) / 1e12
        row = {"method": f"mla_{lay}_{name}", "unit": plan.kernels["attn"].plan.template,
               "mla_unit": plan.mla_unit, "batch": batch, "cache": cache, "heads_q": hq,
               "seqlen_q": sq, "ms": ms, "kv_bytes": nbytes, "tb_per_s": tbs,
               "copy_fraction": tbs / copy_tbs, "tflops": tflops,
               "matmul_fraction": tflops / matmul, "num_splits": plan.num_splits}  # fmt: skip
        picked = ""
        if name == "auto":
            row["auto_work"] = _auto_work(ops[name], plan, batch, hq, sq, cache)
            picked = f" -> {plan.mla_unit} (work {row['auto_work']:.1f})"
        out.append(row)
        print(f"B{batch:<3} {cache:>6} {lay:<8} h{hq:<3} sq{sq} {name:<8} {ms * 1e3:9.1f} us "
              f"{tbs:5.2f} TB/s ({tbs / copy_tbs:4.0%} of copy) {tflops:6.1f} TFLOP/s "
              f"({tflops / matmul:4.0%} of matmul) splits {plan.num_splits}{picked}",
              flush=True)  # fmt: skip
    return out


def _auto_work(op, plan, batch: int, hq: int, sq: int, cache: int) -> float:
    """The ``auto`` rule's work at this point (:attr:`flashgen.families.decode.MlaWork.work`)
    on the plan's device."""
    import dataclasses

    from flashgen.families import decode as family
    from flashgen.ops.calls import _sm_count

    spec = op.spec
    wg = family.plan(spec, "sm_90", dataclasses.replace(op.options.decode, mla_unit="wgmma"))
    return family.mla_auto_work(wg, batch=batch, heads_q=hq, heads_kv=1, seqlen_q=sq,
                                capacity=cache, num_sms=_sm_count(plan.device.index or 0)).work


def mla_summary(rows: list[dict]) -> list[str]:
    """The MLA targets' two figures from ``--mla`` rows, per variant: the best share of the copy
    ceiling at 16 query heads (target 85%) and of the matmul ceiling at 128 (target 65%)."""
    lines = []
    for name in MLA_VARIANTS:
        mine = [r for r in rows if r["method"].endswith(f"_{name}")]
        h16 = [r["copy_fraction"] for r in mine if r["heads_q"] == 16]
        h128 = [r["matmul_fraction"] for r in mine if r["heads_q"] == 128]
        lines.append(
            f"{name}: 16 heads {max(h16):.0%} of the copy ceiling (target 85%)"
            if h16 else f"{name}: no 16-head row"
        )
        lines.append(
            f"{name}: 128 heads {max(h128):.0%} of the matmul ceiling (target 65%)"
            if h128 else f"{name}: no 128-head row"
        )
    return lines + mla_auto_check(rows)


def mla_auto_check(rows: list[dict]) -> list[str]:
    """Whether ``auto`` picked the faster of ``mma_sync`` and ``wgmma`` at each point of the
    ``--mla`` rows (same layout, batch, cache, heads, Sq_new): one line with the count, and
    one per point where the unit it picked was more than 5% slower than the other (the
    ratio of the times of the two units, from their own rows)."""
    units: dict = {}
    for r in rows:
        name = next((n for n in MLA_VARIANTS if r["method"].endswith(f"_{n}")), None)
        if name is None:
            continue
        lay = r["method"].removesuffix(f"_{name}")
        key = (lay, *(r.get(k) for k in ("batch", "cache", "heads_q", "seqlen_q")))
        units.setdefault(key, {})[name] = r
    good, bad = 0, []
    for (lay, b, c, h, sq), by in units.items():
        if not {"mma_sync", "wgmma", "auto"} <= set(by) or by["auto"].get("mla_unit") is None:
            continue
        picked = by["auto"]["mla_unit"]
        other = "wgmma" if picked == "mma_sync" else "mma_sync"
        ratio = by[picked]["ms"] / by[other]["ms"]
        if ratio <= 1.05:
            good += 1
        else:
            bad.append(f"auto: {lay.removeprefix('mla_')} B{b} {c} h{h} sq{sq} picked {picked}, "
                       f"{ratio:.2f}x the {other} unit's time")  # fmt: skip
    if not good and not bad:
        return []
    return [f"auto: the faster unit (within 5%) at {good} of {good + len(bad)} points", *bad]


#: Fixed plot styles of the known implementations (color, marker, line style), so a method
#: keeps its look in every panel and every run; others take the remaining colors in order.
STYLES = {
    "flashgen_dense": ("tab:blue", "o", "-"),
    "flashgen_paged16": ("tab:orange", "o", "-"),
    "flashgen_paged1": ("tab:green", "o", "-"),
    "flashgen_paged256": ("tab:olive", "o", "-"),
    "sdpa_flash": ("tab:red", "s", "--"),
    "sdpa_cudnn": ("tab:purple", "^", "--"),
    "flex": ("tab:brown", "D", "--"),
    "flashinfer": ("tab:pink", "v", "--"),
}
_SPARE = ("tab:gray", "tab:cyan", "black", "gold", "navy", "teal")


def method_styles(methods) -> dict[str, tuple[str, str, str]]:
    """``method -> (color, marker, linestyle)``: :data:`STYLES` for the known methods, the
    spare colors in sorted order for the rest (flashgen rows solid, peers dashed)."""
    out, spare = {}, 0
    for m in sorted(methods):
        if m in STYLES:
            out[m] = STYLES[m]
        else:
            line = "-" if m.startswith("flashgen") else "--"
            out[m] = (_SPARE[spare % len(_SPARE)], "x", line)
            spare += 1
    return out


def write_plot(doc: dict, json_path: Path) -> Path | None:
    """TB/s of KV read against cache length (log scale), one panel per batch size, one line
    per method (the window and no-packing rows are single points, left out), into
    ``<json stem>.png`` next to ``json_path``.  None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in doc["rows"] if "tb_per_s" in r and not r["method"].endswith(
        ("_nopack", "_swa4096"))]  # fmt: skip
    batches = sorted({r["batch"] for r in rows})
    if not batches:
        return None
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    styles = method_styles(sorted({r["method"] for r in rows}))
    for ax, batch in zip(axes[0], batches, strict=True):
        methods = sorted({r["method"] for r in rows if r["batch"] == batch})
        for m in methods:
            pts = sorted((r["cache"], r["tb_per_s"]) for r in rows
                         if r["batch"] == batch and r["method"] == m)  # fmt: skip
            color, marker, line = styles[m]
            ax.plot([c for c, _ in pts], [t for _, t in pts], linestyle=line, marker=marker,
                    color=color, label=m, markersize=4)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cache length (keys)")
        ax.set_ylabel("KV read (TB/s)")
        ax.set_title(f"B={batch}")
        ax.axhline(4.3, color="gray", linewidth=0.8, linestyle=":")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"decode, {doc.get('device', '')}, bf16 d128 Hq/Hkv 32/8, Sq_new 1")
    fig.tight_layout()
    png = json_path.with_suffix(".png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


#: Flags ``--sweep`` does not read (its grid and shapes are :data:`SWEEP_UNITS`,
#: :data:`SWEEP_WAVES` and :data:`SWEEP_SHAPES`), and those ``--quick`` sets itself.
SWEEP_IGNORES = ("option", "combine", "batch", "cache", "layouts", "fp8", "flex_cache", "quick")
QUICK_SETS = ("batch", "cache", "layouts")
#: What the default run and ``--quick`` time.
DEFAULTS = {"batch": [1, 16, 64], "cache": [4096, 16384, 65536, 131072],
            "layouts": ["dense", "paged16", "paged1"]}  # fmt: skip
QUICK = {"batch": [1, 16], "cache": [65536], "layouts": ["dense", "paged16", "paged1", "paged256"]}


def _flex_cache(text: str) -> list[int]:
    """``--flex-cache``: comma-separated positive ints, or empty (no FlexAttention row)."""
    return positive_ints("flex-cache")(text) if text.strip() else []


def describe_options(opts) -> str:
    """``decode.stages=6 decode.merge_unroll=16``: the fields of decode options ``opts`` that
    are not the defaults (``default options`` for none or None)."""
    from flashgen.families import decode as family
    from flashgen.options import Options

    changed = Options(decode=opts or family.Options()).changed()
    return " ".join(f"{k}={v}" for k, v in changed.items()) or "default options"


def check_variants(variants, target: str = "sm_90") -> str | None:
    """Why a ``--option`` variant's decode unit (llama3_gqa's, the one they are timed on)
    cannot be planned for ``target`` (the pure-Python planner, no GPU), or None."""
    from flashgen.families import decode as family
    from flashgen.frontend.spec import load_spec

    spec = load_spec(REPO / "specs" / "llama3_gqa.yaml")
    for _, opts in variants:
        try:
            family.plan(spec, target, opts)
        except ValueError as e:
            return f"{describe_options(opts)}: {e}"
    return None


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(
        prog=prog or "python -m flashgen.bench.decode", description=helptext.plain(__doc__),
        formatter_class=helptext.HelpFormatter,
    )  # fmt: skip
    ap.add_argument("--batch", type=positive_ints("batch"),
                    help="batch sizes (default 1,16,64)")  # fmt: skip
    ap.add_argument("--cache", type=positive_ints("cache"),
                    help="cache lengths in keys (default 4096,16384,65536,131072)")
    ap.add_argument("--layouts", type=layouts,
                    help="dense and/or pagedN, N keys per page (default dense,paged16,paged1)")
    ap.add_argument("--heads-q", type=positive_int("heads-q"), default=32)
    ap.add_argument("--heads-kv", type=positive_int("heads-kv"), default=8)
    ap.add_argument("--calls", type=positive_int("calls"), default=20,
                    help="calls per CUDA graph")  # fmt: skip
    ap.add_argument("--rounds", type=positive_int("rounds"), default=5,
                    help="alternating rounds (median)")  # fmt: skip
    ap.add_argument("--flex-cache", type=_flex_cache,
                    help="cache lengths with a FlexAttention row (default 65536; empty: none)")
    ap.add_argument("--quick", action="store_true",
                    help="B1 and B16 at 64k, dense and paged 16, 1 and 256 (no --batch, "
                    "--cache or --layouts with it)")  # fmt: skip
    ap.add_argument("--fp8", action="store_true",
                    help="also time each flashgen layout on an e4m3 cache of the same shape "
                    "(half the bytes; rows flashgen_<layout>_fp8, speedup_vs_bf16)")  # fmt: skip
    ap.add_argument("--out", default="benchmarks/results/decode.json")
    ap.add_argument("--plot", metavar="JSON", help="only redraw the plot of an earlier run")
    ap.add_argument("--option", action="append", metavar="NAME=A,B",
                    help="a decode.* field of flashgen.Options and the values to time "
                    "(repeatable; rows flashgen_<layout>@<variant>)")  # fmt: skip
    ap.add_argument("--combine", choices=("product", "zip", "each"),
                    help="how --option values combine into variants (as flashgen ab; default "
                    "product)")  # fmt: skip
    ap.add_argument("--sweep", action="store_true",
                    help="time the decode options grid (SWEEP_UNITS x SWEEP_WAVES) at B1 "
                    "64k/16k/4k paged16 and the window case; best per shape (none of "
                    "--option, --batch, --cache, --layouts, --fp8, --flex-cache, --quick)")
    ap.add_argument("--mla", action="store_true",
                    help="time MLA decode (specs/mla_decode.yaml) with decode.mla_unit "
                    "mma_sync, wgmma and auto against the copy and matmul ceilings (defaults: "
                    "MLA_DEFAULTS; none of "
                    "--option, --fp8, --flex-cache, --quick, --sweep)")  # fmt: skip
    ap.add_argument("--mla-heads", type=positive_ints("mla-heads"),
                    help="--mla: query heads (default 16,64,128; one latent head)")
    ap.add_argument("--mla-sq", type=positive_ints("mla-sq"),
                    help="--mla: new tokens per request, Sq_new (default 1)")
    args = ap.parse_args(argv)
    given = {k for k, v in vars(args).items() if v not in (None, False)}
    if args.mla and given & set(MLA_IGNORES):
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in MLA_IGNORES if k in given)
        ap.error(f"--mla times its own three variants; it takes no {flags}")
    if not args.mla and given & {"mla_heads", "mla_sq"}:
        ap.error("--mla-heads and --mla-sq go with --mla")
    if args.mla:
        for k, v in MLA_DEFAULTS.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
    if args.sweep and given & set(SWEEP_IGNORES):
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in SWEEP_IGNORES if k in given)
        ap.error(f"--sweep times its own grid and shapes; it takes no {flags}")
    if args.quick and given & set(QUICK_SETS):
        flags = ", ".join(f"--{k}" for k in QUICK_SETS if k in given)
        ap.error(f"--quick sets the batch sizes, cache lengths and layouts; drop {flags} (or "
                 "--quick)")  # fmt: skip
    for k, v in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.flex_cache is None:
        args.flex_cache = [65536]
    why = check_heads(args.heads_q, args.heads_kv)
    if why:
        ap.error(why)
    if args.plot:
        path = write_plot(json.loads(Path(args.plot).read_text()), Path(args.plot))
        print(f"wrote {path}" if path else "no plot: matplotlib is not importable")
        return 0 if path else 1
    try:
        args.variants = option_variants(args.option or [], args.combine or "product")
    except ValueError as e:
        ap.error(str(e))
    why = check_variants(args.variants)  # the planner alone: before any CUDA check
    if why:
        ap.error(why)
    import torch

    if not torch.cuda.is_available():
        print("flashgen bench --decode needs a CUDA device", file=sys.stderr)
        return 1
    from flashgen.codegen.abi import target_for_capability

    target = target_for_capability(*torch.cuda.get_device_capability())
    why = check_variants(args.variants, target)
    if why:
        ap.error(why)
    if args.mla:
        rows, ceil = run_mla(args)
        doc = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "ceilings": ceil, "rows": rows}  # fmt: skip
        out = Path(args.out).with_name(Path(args.out).stem + "_mla.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1))
        for line in mla_summary(rows):
            print(line)
        print(f"wrote {out}")
        return 0
    if args.sweep:
        rows = sweep(args)
        doc = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}
        out = Path(args.out).with_name(Path(args.out).stem + "_sweep.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1))
        print(f"wrote {out}")
        return 0
    rows = run(args)
    doc = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    png = write_plot(doc, out)
    print(f"wrote {png}" if png else "no plot: matplotlib is not importable (--plot JSON later)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
