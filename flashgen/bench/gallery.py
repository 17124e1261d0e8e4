"""Write ``docs/gallery.md``: each variant spec next to its measured forward TFLOP/s and
FlexAttention's, timed in the same run.

    flashgen bench --gallery             # on a GPU, in the checkout
    flashgen bench --gallery --dry-run   # anywhere: specs and densities only

For each gallery spec among the shipped specs (a missing one is listed as such): the spec
text; the density (kept (q, kv) pairs / all pairs, from the mask IR on the same inputs);
flashgen's forward median time and TFLOP/s (a spec whose mask reads tensors runs with a
BlockMask built once by ``op.block_mask``, and is also timed with the pre-pass in every
call); FlexAttention's (``torch.compile``'d ``flex_attention`` with the spec's mask_mod /
score_mod from :mod:`flashgen.bench.flexmods` and a ``create_block_mask`` built once, as
:func:`flashgen.bench.peers.make_forward` does); the ratio; and, against flashgen's dense causal
kernel at the same shape, the time ratio next to the FLOP ratio (a sparse mask should
save time in proportion to the FLOPs it skips).

TFLOP/s count only kept pairs: ``2 * (D + Dv) * kept``.  Shape (the FlashAttention
protocol): batch * seqlen = 16384 tokens, heads * head_dim = 2048, bf16, Sq = Sk =
``--seqlen`` (default 8192).  Times are ``do_bench`` medians
(:func:`flashgen.bench.timing.do_bench_ms`).  Document ids: each batch row is cut into
documents of random lengths (mean ``--doc-len`` tokens).  Each spec's implementations are
timed in ``--rounds`` alternating rounds (flashgen, FlexAttention, flashgen, ...; default 3)
and each reports its median, so drift of the GPU's clocks over the run reaches both
alike.  Finishes in about 3-4 minutes on an H200, much of it torch.compile of
FlexAttention; ``--budget`` (s) skips what is left after it.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from flashgen.bench import helptext
from flashgen.frontend.shipped import shipped_specs_dir

#: the page ``--out`` writes by default, relative to the current directory (the checkout's root)
PAGE = Path("docs") / "gallery.md"

GALLERY = (
    "prefix_lm",
    "document_mask",
    "chunked_local",
    "t5_bias",
    "alibi",
    "gemma2_softcap",
    "mistral_swa",
    "alibi_learned",
    "gpt_oss_sink",
)
BASELINE = "causal_d128"
#: Serving specs: listed after the measured ones with their spec text and what their decode
#: does (docs/serving.md), untimed here (``python -m flashgen.bench.decode`` times decode).
SERVING = {
    "spec_tree": "speculative-decoding tree masks in `op.with_kvcache`: the new tokens of a "
    "request see its cache and their ancestors in the draft tree (the ancestor matrix "
    "`[B, Sq_new, Sq_new]` is a per-call tensor); also a prefill op",
    "mla_decode": "DeepSeek MLA decode: one latent cache of 576 columns whose first 512 are "
    "the values (`v_from_k: true`), `num_heads_kv` 1; decode only (no prefill, no backward)",
}


def serving_section(specs_dir: Path) -> list[str]:
    """The page's closing section: each :data:`SERVING` spec found in ``specs_dir``, its text
    and what it is for (no timing)."""
    names = [n for n in SERVING if (specs_dir / f"{n}.yaml").is_file()]
    if not names:
        return []
    lines = [
        "## Serving specs (decode)",
        "",
        "Specs for `op.with_kvcache` (see `docs/serving.md`); not timed on this page "
        "(`python -m flashgen.bench.decode` times decode).",
        "",
    ]
    for n in names:
        text = (specs_dir / f"{n}.yaml").read_text().rstrip()
        lines += [f"### {n}", "", "```yaml", text, "```", "", SERVING[n] + ".", ""]
    return lines


def gallery_params(spec, batch: int, heads: int, seqlen: int, device, mean_len: int) -> dict:
    """Param values: scalar defaults and the benchmark's tensor values (document ids of mean
    length ``mean_len`` for int tensors along a sequence axis,
    :func:`flashgen.bench.protocol.spec_params`)."""
    from flashgen.bench import protocol

    params = protocol.spec_params(spec, heads, batch, seqlen, seqlen, device, doc_len=mean_len)
    for p in spec.scalar_params:
        params.setdefault(p.name, p.default)
    return params


def measure(spec, batch, heads, seqlen, params, device, args) -> dict:
    """Times (ms) of flashgen (with a reused BlockMask, and with the per-call pre-pass)
    and of FlexAttention for one spec; errors are recorded, not raised."""
    import torch

    from flashgen.bench import peers, timing
    from flashgen.codegen.abi import needs_block_table
    from flashgen.ops.op import TORCH_DTYPE, build_op

    dt = TORCH_DTYPE[spec.dtype]
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, heads, seqlen, spec.head_dim, device=device, generator=g).to(dt)
    k = torch.randn(batch, heads, seqlen, spec.head_dim, device=device, generator=g).to(dt)
    v = torch.randn(batch, heads, seqlen, spec.head_dim_v, device=device, generator=g).to(dt)
    out: dict = {}
    op = build_op(spec)
    fns = {}  # result key -> callable, timed in alternating rounds below
    try:
        if needs_block_table(spec):
            bm = op.block_mask(seqlen, seqlen, batch=batch, num_heads=heads, **params)
            out["tiles"] = bm.counts()
            fns["flashgen_prepass_ms"] = lambda: op.attention(q, k, v, **params)
            fns["prepass_ms"] = lambda: op.block_mask(
                seqlen, seqlen, batch=batch, num_heads=heads, **params
            )
            fns["flashgen_ms"] = lambda: op.attention(q, k, v, block_mask=bm, **params)
        else:
            fns["flashgen_ms"] = lambda: op.attention(q, k, v, **params)
        for fn in list(fns.values()):
            fn()
    except Exception as e:  # record, keep going
        out["flashgen_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        fns.clear()
    if not args.no_flex:
        try:
            t0 = time.perf_counter()
            flex = peers.make_forward("flex", spec, seqlen, seqlen, params, device)
            flex(q, k, v)
            torch.cuda.synchronize()
            out["flex_compile_s"] = time.perf_counter() - t0
            fns["flex_ms"] = lambda: flex(q, k, v)
            if getattr(flex, "kernel_options", None):  # its default configs did not fit
                out["flex_kernel_options"] = dict(flex.kernel_options)
        except Exception as e:
            out["flex_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    # alternate the implementations round by round, so clock and thermal drift over the
    # run reach both alike; report each one's median over the rounds
    # (an error while timed is recorded like one in the first call: flex_error for
    # FlexAttention, flashgen_error for the rest; that implementation's rounds stop)
    times: dict[str, list] = {key: [] for key in fns}
    for _ in range(max(1, args.rounds)):
        for key, fn in list(fns.items()):
            try:
                times[key].append(timing.do_bench_ms(fn, args.warmup, args.rep))
            except Exception as e:  # record, keep going
                impl = "flex" if key.startswith("flex") else "flashgen"
                out.setdefault(f"{impl}_error", f"{type(e).__name__}: {str(e)[:200]}")
                del fns[key], times[key]
    for key, ts in times.items():
        out[key] = statistics.median(ts)
        out[key.removesuffix("_ms") + "_rounds_ms"] = ts
    return out


def fmt(x, spec=".2f") -> str:
    return "—" if x is None else format(x, spec)


def write_page(rows: list[dict], meta: dict, path: Path) -> None:
    lines = [
        "# Gallery: attention variants as specs, and how fast they run",
        "",
        "Generated by `flashgen bench --gallery` (do not edit by hand; rerun it). " + meta["where"],
        "",
        f"Shape: batch {meta['batch']}, seqlen_q = seqlen_k = {meta['seqlen']}, "
        "heads * head_dim = 2048, bf16, forward.  TFLOP/s count only the (q, kv) pairs "
        "the mask keeps (`2 * (D + Dv) * kept`); density = kept / all pairs.  flashgen "
        "and FlexAttention (`torch.compile(flex_attention)`, mask_mod / score_mod from "
        "`flashgen/bench/flexmods.py`, `create_block_mask` built once) run in the same process "
        "on the same inputs; a spec whose mask reads tensors runs with a BlockMask built "
        "once by `op.block_mask` (FlexAttention's equivalent), and the column "
        "'with pre-pass' times flashgen building its block table in every call.  "
        "'time / causal' is the time relative to flashgen's dense causal kernel at the "
        "same shape, next to 'FLOPs / causal', the kept-pair ratio: a sparse mask should "
        "save time in proportion to the FLOPs it skips.",
        "",
        "| spec | head_dim | density | flashgen ms | flashgen TFLOP/s | with pre-pass ms "
        "| Flex ms | Flex TFLOP/s | flashgen / Flex | time / causal | FLOPs / causal |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if r.get("missing"):
            lines.append(f"| {r['name']} | — | — | not in specs/ on this branch |" + " |" * 7)
            continue
        lines.append(
            f"| {r['name']} | {r['head_dim']} | {fmt(r['density'], '.3f')} "
            f"| {fmt(r.get('flashgen_ms'), '.3f')} | {fmt(r.get('flashgen_tflops'), '.0f')} "
            f"| {fmt(r.get('flashgen_prepass_ms'), '.3f')} "
            f"| {fmt(r.get('flex_ms'), '.3f')} | {fmt(r.get('flex_tflops'), '.0f')} "
            f"| {fmt(r.get('speedup'), '.2f')}{'x' if r.get('speedup') else ''} "
            f"| {fmt(r.get('time_vs_causal'), '.2f')} | {fmt(r.get('flops_vs_causal'), '.2f')} |"
        )
    lines.append("")
    for r in rows:
        if r.get("missing"):
            continue
        lines += [f"## {r['name']}", "", "```yaml", r["text"].rstrip(), "```", ""]
        facts = [f"density {fmt(r['density'], '.3f')}"]
        if r.get("flashgen_ms") is not None:
            facts.append(
                f"flashgen {fmt(r['flashgen_ms'], '.3f')} ms = "
                f"{fmt(r['flashgen_tflops'], '.0f')} TFLOP/s"
            )
        if r.get("flex_ms") is not None:
            facts.append(
                f"FlexAttention {fmt(r['flex_ms'], '.3f')} ms = {fmt(r['flex_tflops'], '.0f')}"
                f" TFLOP/s (compile {fmt(r.get('flex_compile_s'), '.0f')} s"
                + (
                    f"; its default Triton configs did not fit in shared memory, run with "
                    f"kernel_options {r['flex_kernel_options']}"
                    if r.get("flex_kernel_options")
                    else ""
                )
                + ")"
            )
        if r.get("speedup") is not None:
            facts.append(f"flashgen / Flex {r['speedup']:.2f}x")
        if r.get("tiles"):
            t = r["tiles"]
            facts.append(
                f"block table {t['empty']} empty / {t['partial']} partial / {t['full']} full "
                f"tiles, built in {fmt(r.get('prepass_ms'), '.3f')} ms"
            )
        for key in ("flashgen_error", "flex_error"):
            if r.get(key):
                facts.append(f"{key.replace('_', ' ')}: `{r[key]}`")
        lines += ["; ".join(facts) + ".", ""]
    lines += serving_section(meta["specs"])
    path.write_text("\n".join(lines))


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(
        prog=prog, description=helptext.plain(__doc__), formatter_class=helptext.HelpFormatter
    )
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--doc-len", type=int, default=1024, help="mean document length")
    ap.add_argument("--specs", nargs="*", default=list(GALLERY))
    ap.add_argument(
        "--out",
        default=None,
        help="default docs/gallery.md of the current directory (run it from the checkout's "
        "root); a --dry-run without --out prints the page instead (it would replace the "
        "measured page with dashes)",
    )
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="timing rounds, flashgen and FlexAttention alternating (median reported)",
    )
    ap.add_argument("--budget", type=float, default=220.0, help="seconds; then skip the rest")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: spec texts and densities")
    args = ap.parse_args(argv)

    import torch

    from flashgen.bench import protocol
    from flashgen.frontend.spec import load_spec

    t_start = time.perf_counter()
    specs_dir = shipped_specs_dir() or Path("specs")
    gpu = torch.cuda.is_available() and not args.dry_run
    if not gpu and not args.dry_run:
        print("no CUDA device: run with --dry-run for densities only", file=sys.stderr)
        return 2
    device = torch.device("cuda" if gpu else "cpu")
    rows: list[dict] = []
    base_ms = base_kept = base_ms_per_head = None
    batch, _ = protocol.problem(args.seqlen, 128)
    if gpu:
        base_path = specs_dir / f"{BASELINE}.yaml"
        if base_path.exists():
            base = load_spec(base_path)
        else:
            base = protocol.template_spec(128, "bf16", True)
        _, heads = protocol.problem(args.seqlen, base.head_dim)
        base_kept = protocol.kept_pairs(base, batch, heads, args.seqlen, {}, device) / heads
        base_ms = measure(base, batch, heads, args.seqlen, {}, device, argparse.Namespace(
            **{**vars(args), "no_flex": True})).get("flashgen_ms")  # fmt: skip
        base_ms_per_head = base_ms / heads if base_ms else None
    for name in args.specs:
        path = specs_dir / f"{name}.yaml"
        if not path.exists():
            rows.append({"name": name, "missing": True})
            print(f"{name}: not in specs/, skipped", file=sys.stderr)
            continue
        spec = load_spec(path)
        b, heads = protocol.problem(args.seqlen, spec.head_dim)
        params = gallery_params(spec, b, heads, args.seqlen, device, args.doc_len)
        kept = protocol.kept_pairs(spec, b, heads, args.seqlen, params, device)
        row = {
            "name": name,
            "text": path.read_text(),
            "head_dim": spec.head_dim,
            "batch": b,
            "heads": heads,
            "density": kept / (b * heads * args.seqlen**2),
            "kept_pairs": kept,
        }
        if gpu and time.perf_counter() - t_start < args.budget:
            row.update(measure(spec, b, heads, args.seqlen, params, device, args))
            flops = 2 * (spec.head_dim + spec.head_dim_v) * kept
            for impl in ("flashgen", "flex"):
                ms = row.get(f"{impl}_ms")
                row[f"{impl}_tflops"] = flops / (ms * 1e-3) / 1e12 if ms else None
            if row.get("flashgen_ms") and row.get("flex_ms"):
                row["speedup"] = row["flex_ms"] / row["flashgen_ms"]
            if row.get("flashgen_ms") and spec.head_dim == 128 and base_ms:
                row["time_vs_causal"] = row["flashgen_ms"] / heads / base_ms_per_head
                row["flops_vs_causal"] = kept / heads / base_kept
        elif gpu:
            row["flashgen_error"] = "skipped: over --budget"
        rows.append(row)
        print(
            f"{name}: density {row['density']:.3f} flashgen {fmt(row.get('flashgen_ms'), '.3f')}"
            f" ms ({fmt(row.get('flashgen_tflops'), '.0f')} TFLOP/s) flex "
            f"{fmt(row.get('flex_ms'), '.3f')} ms ({fmt(row.get('flex_tflops'), '.0f')} "
            f"TFLOP/s) speedup {fmt(row.get('speedup'), '.2f')}",
            file=sys.stderr,
            flush=True,
        )
    if gpu:
        where = (
            f"Measured on {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
            f"{time.strftime('%Y-%m-%d', time.gmtime())}; dense causal baseline "
            f"({BASELINE}, head_dim 128) {fmt(base_ms, '.3f')} ms."
        )
    else:
        where = (
            "Dry run (no GPU): densities only; run `flashgen bench --gallery` on a GPU for "
            "the timings."
        )
    meta = {"where": where, "batch": batch, "seqlen": args.seqlen, "host": platform.node(),
            "specs": specs_dir}  # fmt: skip
    if args.out is None and args.dry_run:  # keep the committed, measured page
        with tempfile.TemporaryDirectory() as tmp:
            write_page(rows, meta, Path(tmp) / "gallery.md")
            print((Path(tmp) / "gallery.md").read_text())
        out = "stdout"
    else:
        out = args.out or str(PAGE)
        write_page(rows, meta, Path(out))
    if args.json:
        doc = {"meta": {**meta, "specs": str(specs_dir)}, "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    print(f"wrote {out} in {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    ok = all(r.get("missing") or math.isfinite(r["density"]) for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
