"""Launch trace of planned decode calls, from the planner alone (no torch, no GPU).

For each case (batch, cache length, dense / paged layout) it prints what a planned
``op.with_kvcache`` call (``plan_decode``; Sq_new 1, no append) launches: the attention kernel's
grid, CTAs, split count, key blocks and KV bytes per CTA (the longest split), CTA slots per SM
and waves on ``--sms`` SMs, and the unit's registers, spills and shared memory from nvcc
(``--compile``: the unit built through the cache for ``sm_90``, i.e. ``sm_90a``, as a
planned call on an H100 / H200 loads it).  A planned call launches that kernel only (the
append kernel first when the call passes ``k_new``); the split counts are chosen as
``plan_decode`` chooses them (the capacity, the mask's live blocks at its params' defaults,
GQA packing as ``decode.pack_gqa`` says); the split counters are allocated zeroed once with
the plan and reset by the last CTA of each tile, so no memset runs per call.  A paged layout
plans for its whole pages (capacity: the cache rounded up to ``pagedN``'s pages) and its rows
say how many pages (block-table entries) a key block spans.

    python tools/decode_trace.py --compile
    python tools/decode_trace.py --option decode.stages=2,6 --option decode.split_waves=0.34
    python tools/decode_trace.py --spec mla_decode --heads 128/1 --layouts paged64

``--option NAME=A,B``: a ``decode.*`` field of :class:`flashgen.Options` and its values, as
``flashgen ab`` and ``flashgen bench --decode`` take it (repeatable; ``--combine`` product,
zip or each: one table per variant).  ``--spec``: a spec file or a shipped spec's name
(default llama3_gqa: bf16 d128); Hq/Hkv ``--heads`` (default 32/8).  Argument errors exit 2.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashgen.bench import decode as bench_decode  # noqa: E402
from flashgen.codegen.dtypes import dtype  # noqa: E402
from flashgen.families import decode as family  # noqa: E402

TARGET = "sm_90"


def trace(spec, options: family.Options, *, batch: int, cache: int, page_size: int | None,
          heads_q: int, heads_kv: int, num_sms: int) -> dict:  # fmt: skip
    """What the planned call of these sizes launches (see the module doc): a dict of the
    split count, grid, CTAs, CTA slots per SM, waves, key blocks, block-table pages and KV
    bytes per CTA.  Raises ``ValueError`` for sizes or a spec decode does not take."""
    for name, v in (("batch", batch), ("cache", cache), ("heads_q", heads_q),
                    ("heads_kv", heads_kv), ("num_sms", num_sms),
                    ("page_size", 1 if page_size is None else page_size)):  # fmt: skip
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    why = bench_decode.check_heads(heads_q, heads_kv)
    if why:
        raise ValueError(why)
    unit = family.plan(spec, TARGET, options)
    bn = unit.tiles.block_n
    pack = options.pack_gqa
    # plan_decode's capacity: a paged request holds whole pages
    capacity = cache if page_size is None else -(-cache // page_size) * page_size
    geo1 = family.geometry(unit, batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=1,
                           num_splits=1, pack_gqa=pack)  # fmt: skip
    live_blocks = family.live_key_blocks(spec, capacity=capacity, seqlen_q=1, block_n=bn)
    splits = options.num_splits or family.choose_num_splits(
        unit, batch=batch, heads_kv_ctas=heads_kv if pack else heads_q, m_blocks=geo1.m_blocks,
        max_seqlen_k=capacity, num_sms=num_sms, live_blocks=live_blocks,
        split_waves=options.split_waves, balance_waves=options.balance_waves,
    )  # fmt: skip
    geo = family.geometry(unit, batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=1,
                          num_splits=splits, pack_gqa=pack)  # fmt: skip
    n_blocks = -(-cache // bn)  # the request's keys: the cache is full
    if live_blocks is not None:
        n_blocks = max(1, min(n_blocks, live_blocks))
    eff = family.effective_splits(0, n_blocks, splits, options.min_split_blocks)
    longest = max(e - b for b, e in (family.split_range(0, n_blocks, eff, s) for s in range(eff)))
    # a key row's bytes: K and V, or K alone where V is its first head_dim_v columns (MLA)
    elem = dtype(spec.dtype).elem_bytes
    row_bytes = (spec.head_dim + (0 if spec.v_from_k else spec.head_dim_v)) * elem
    ctas = geo.grid[0] * geo.grid[1] * geo.grid[2]
    working = geo.m_blocks * eff * geo.grid[1] * geo.grid[2]
    slots = family.ctas_per_sm(unit)
    # block-table entries a key block's rows read, at most: a block starts at a multiple of
    # block_n, so its offset in a page is a multiple of g = gcd(block_n, page_size)
    g = math.gcd(bn, page_size or 1)
    pages = 0 if page_size is None else (page_size - g + bn - 1) // page_size + 1
    return {
        "layout": "dense" if page_size is None else f"paged{page_size}",
        "batch": batch, "cache": cache, "capacity": capacity, "block_n": bn,
        "stages": unit.tiles.stages, "smem": unit.smem_bytes, "ctas_per_sm": slots,
        "num_splits": splits, "eff_splits": eff, "grid": geo.grid, "ctas": ctas,
        "working_ctas": working, "waves": working / (num_sms * slots),
        "sm_fill": min(working, num_sms) / num_sms,
        "blocks_per_cta": longest, "kib_per_cta": longest * bn * row_bytes / 1024,
        "pages_per_block": pages,
        "kib_in_flight_per_sm": min(slots, -(-working // num_sms))
        * min(unit.tiles.stages - 1, longest) * bn * row_bytes / 1024,
        "merge_partials": eff if eff > 1 else 0,
        "launches": "attn" + (f" (last of {eff} CTAs per tile merges)" if eff > 1 else ""),
    }  # fmt: skip


def compile_report(spec, options: family.Options) -> str:
    """Registers, spills and shared memory of the unit's kernels for sm_90a (nvcc through the
    build cache)."""
    from flashgen.build import cache
    from flashgen.build.render import render

    p = family.plan(spec, TARGET, options)
    _, report = cache.get_or_build(render(p), p)
    return "; ".join(f"{k.name.rsplit('_', 1)[-1]}: {k.registers} regs, {k.spill_bytes} B spilled"
                     for k in report.kernels) + f"; {p.smem_bytes} B dynamic smem"  # fmt: skip


def _heads(text: str) -> tuple[int, int]:
    """``--heads HQ/HKV``: two ints >= 1, HQ a multiple of HKV."""
    hq, sep, hkv = text.partition("/")
    try:
        pair = (bench_decode.positive_int("heads")(hq), bench_decode.positive_int("heads")(hkv))
    except argparse.ArgumentTypeError:
        pair = None
    if not sep or pair is None:
        raise argparse.ArgumentTypeError(
            f"heads: expected HQ/HKV, two ints >= 1 (query heads / kv heads), got {text!r}"
        )
    why = bench_decode.check_heads(*pair)
    if why:
        raise argparse.ArgumentTypeError(why)
    return pair


def _load(ap: argparse.ArgumentParser, text: str):
    """The spec ``--spec`` names (a file or a shipped spec's name), checked for decode; an
    argparse error (exit 2) otherwise."""
    from flashgen.frontend.errors import SpecError
    from flashgen.frontend.shipped import resolve_spec_path
    from flashgen.frontend.spec import load_spec

    try:
        spec = load_spec(resolve_spec_path(text))
    except FileNotFoundError as e:
        ap.error(f"--spec {text!r}: {e.strerror}")
    except SpecError as e:
        ap.error(f"--spec {text!r}: {e}")
    except OSError as e:
        ap.error(f"--spec {text!r}: cannot read it: {e.strerror or e}")
    why = family.unsupported_reason(spec)
    if why:
        ap.error(f"--spec {text!r}: no decode kernels: {why}")
    return spec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/decode_trace.py",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--spec", default="llama3_gqa", help="a spec file or a shipped spec's name")
    ap.add_argument("--batch", type=bench_decode.positive_int("batch"), default=1)
    ap.add_argument("--cache", type=bench_decode.positive_ints("cache"),
                    default=[2048, 8192, 16384, 65536], help="cache lengths (keys)")  # fmt: skip
    ap.add_argument("--layouts", type=bench_decode.layouts, default=["dense", "paged16"],
                    help="dense and/or pagedN (N keys per page)")  # fmt: skip
    ap.add_argument("--heads", type=_heads, default=(32, 8), help="HQ/HKV (default 32/8)")
    ap.add_argument("--sms", type=bench_decode.positive_int("sms"), default=132,
                    help="SMs (H100 SXM and H200: 132)")  # fmt: skip
    ap.add_argument("--option", action="append", default=[], metavar="NAME=A,B",
                    help="a decode.* field of flashgen.Options and its values (repeatable)")
    ap.add_argument("--combine", default="product", choices=("product", "zip", "each"),
                    help="how --option values combine into variants (as flashgen ab)")
    ap.add_argument("--compile", action="store_true", help="nvcc the unit (sm_90a)")
    args = ap.parse_args(argv)
    spec = _load(ap, args.spec)
    try:
        variants = bench_decode.option_variants(args.option, args.combine)
    except ValueError as e:
        ap.error(str(e))
    hq, hkv = args.heads
    runs = []
    for _, options in variants:  # every variant planned before anything is printed
        options = options or family.Options()
        label = bench_decode.describe_options(options)
        try:
            family.plan(spec, TARGET, options)
        except ValueError as e:
            ap.error(f"{label}: {e}")
        runs.append((label, options))
    head = (f"{'layout':<9} {'cache':>6} {'cap':>6} {'bn':>3} {'st':>2} {'smem':>6} {'cta/SM':>6} "
            f"{'splits':>6} {'grid':>12} {'CTAs':>5} {'waves':>5} {'SMfill':>6} {'blk/CTA':>7} "
            f"{'KiB/CTA':>7} {'pg/blk':>6} {'KiB fly/SM':>10} {'merge':>5}")  # fmt: skip
    for label, options in runs:
        print(f"{spec.name} {spec.dtype} d{spec.head_dim}"
              f"{'' if spec.head_dim == spec.head_dim_v else f'/{spec.head_dim_v}'} "
              f"Hq/Hkv {hq}/{hkv} B{args.batch} {label}")  # fmt: skip
        if args.compile:
            print("unit (sm_90a):", compile_report(spec, options))
        print(head)
        for lay in args.layouts:
            for cache in args.cache:
                t = trace(spec, options, batch=args.batch, cache=cache,
                          page_size=bench_decode.page_size(lay), heads_q=hq, heads_kv=hkv,
                          num_sms=args.sms)  # fmt: skip
                print(f"{t['layout']:<9} {cache:>6} {t['capacity']:>6} {t['block_n']:>3} "
                      f"{t['stages']:>2} {t['smem']:>6} {t['ctas_per_sm']:>6} {t['num_splits']:>6} "
                      f"{str(t['grid']):>12} {t['ctas']:>5} {t['waves']:>5.2f} "
                      f"{t['sm_fill']:>6.2f} {t['blocks_per_cta']:>7} {t['kib_per_cta']:>7.0f} "
                      f"{t['pages_per_block'] or '-':>6} {t['kib_in_flight_per_sm']:>10.0f} "
                      f"{t['merge_partials']:>5}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
