"""Launch trace of planned decode calls, from the planner alone (no torch, no GPU).

For each case (batch, cache length, dense / paged layout) it prints what a planned
``op.with_kvcache`` call (``plan_decode``; Sq_new 1, no append) launches: the attention kernel's
grid, CTAs, split count, key blocks and KV bytes per CTA (the longest split), CTA slots per SM
and waves on ``--sms`` SMs, and the unit's registers, spills and shared memory from nvcc
(``--compile``: the unit built through the cache for ``sm_90``, i.e. ``sm_90a``, as a
planned call on an H100 / H200 loads it).  A planned call launches that kernel only (the
append kernel first when the call passes ``k_new``); the split counters are allocated zeroed
once with the plan and reset by the last CTA of each tile, so no memset runs per call.

    python tools/decode_trace.py --compile
    python tools/decode_trace.py --option stages=6 --option split_waves=0.34

``--option NAME=VALUE``: a :class:`flashgen.families.decode.Options` field for every case
(repeatable).  Sizes: Hq/Hkv ``--heads`` (default 32/8), head_dim and dtype the spec's
(``--spec``, default llama3_gqa: bf16 d128).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashgen.families import decode as family  # noqa: E402
from flashgen.frontend.spec import load_spec  # noqa: E402


def trace(spec, options: family.Options, *, batch: int, cache: int, page_size: int | None,
          heads_q: int, heads_kv: int, num_sms: int) -> dict:  # fmt: skip
    """What the planned call of these sizes launches (see the module doc): a dict of the
    split count, grid, CTAs, CTA slots per SM, waves, key blocks and KV bytes per CTA."""
    unit = family.plan(spec, "sm_90", options)
    geo1 = family.geometry(unit, batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=1,
                           num_splits=1)  # fmt: skip
    splits = options.num_splits or family.choose_num_splits(
        unit, batch=batch, heads_kv_ctas=heads_kv, m_blocks=geo1.m_blocks, max_seqlen_k=cache,
        num_sms=num_sms, split_waves=options.split_waves, balance_waves=options.balance_waves,
    )  # fmt: skip
    geo = family.geometry(unit, batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=1,
                          num_splits=splits)  # fmt: skip
    n_blocks = -(-cache // unit.tiles.block_n)
    eff = family.effective_splits(0, n_blocks, splits, options.min_split_blocks)
    longest = max(e - b for b, e in (family.split_range(0, n_blocks, eff, s) for s in range(eff)))
    elem = 2
    row_bytes = (spec.head_dim + spec.head_dim_v) * elem
    ctas = geo.grid[0] * geo.grid[1] * geo.grid[2]
    working = geo.m_blocks * eff * geo.grid[1] * geo.grid[2]
    slots = family.ctas_per_sm(unit)
    return {
        "layout": "dense" if page_size is None else f"paged{page_size}",
        "batch": batch, "cache": cache, "block_n": unit.tiles.block_n,
        "stages": unit.tiles.stages, "smem": unit.smem_bytes, "ctas_per_sm": slots,
        "num_splits": splits, "eff_splits": eff, "grid": geo.grid, "ctas": ctas,
        "working_ctas": working, "waves": working / (num_sms * slots),
        "sm_fill": min(working, num_sms) / num_sms,
        "blocks_per_cta": longest, "kib_per_cta": longest * unit.tiles.block_n * row_bytes / 1024,
        "kib_in_flight_per_sm": min(slots, -(-working // num_sms))
        * min(unit.tiles.stages - 1, longest) * unit.tiles.block_n * row_bytes / 1024,
        "merge_partials": eff if eff > 1 else 0,
        "launches": "attn" + (f" (last of {eff} CTAs per tile merges)" if eff > 1 else ""),
    }  # fmt: skip


def compile_report(spec, options: family.Options) -> str:
    """Registers, spills and shared memory of the unit's kernels for sm_90a (nvcc through the
    build cache)."""
    from flashgen.build import cache
    from flashgen.build.render import render

    p = family.plan(spec, "sm_90", options)
    _, report = cache.get_or_build(render(p), p)
    return "; ".join(f"{k.name.rsplit('_', 1)[-1]}: {k.registers} regs, {k.spill_bytes} B spilled"
                     for k in report.kernels) + f"; {p.smem_bytes} B dynamic smem"  # fmt: skip


def _option(text: str) -> tuple[str, object]:
    name, _, value = text.partition("=")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="llama3_gqa")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--cache", default="2048,8192,16384,65536")
    ap.add_argument("--layouts", default="dense,paged16")
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--sms", type=int, default=132, help="SMs (H100 SXM and H200: 132)")
    ap.add_argument("--option", action="append", default=[], type=_option)
    ap.add_argument("--compile", action="store_true", help="nvcc the unit (sm_90a)")
    args = ap.parse_args(argv)
    spec = load_spec(ROOT / "specs" / f"{args.spec}.yaml")
    options = family.Options(**dict(args.option))
    hq, hkv = (int(x) for x in args.heads.split("/"))
    print(f"{spec.name} {spec.dtype} d{spec.head_dim} Hq/Hkv {hq}/{hkv} B{args.batch} "
          f"{options}")  # fmt: skip
    if args.compile:
        print("unit (sm_90a):", compile_report(spec, options))
    head = (f"{'layout':<8} {'cache':>6} {'bn':>3} {'st':>2} {'smem':>6} {'cta/SM':>6} "
            f"{'splits':>6} {'grid':>12} {'CTAs':>5} {'waves':>5} {'SMfill':>6} {'blk/CTA':>7} "
            f"{'KiB/CTA':>7} {'KiB fly/SM':>10} {'merge':>5}")  # fmt: skip
    print(head)
    for lay in args.layouts.split(","):
        ps = None if lay == "dense" else int(lay.removeprefix("paged"))
        for cache in (int(c) for c in args.cache.split(",")):
            t = trace(spec, options, batch=args.batch, cache=cache, page_size=ps, heads_q=hq,
                      heads_kv=hkv, num_sms=args.sms)  # fmt: skip
            print(f"{t['layout']:<8} {cache:>6} {t['block_n']:>3} {t['stages']:>2} "
                  f"{t['smem']:>6} {t['ctas_per_sm']:>6} {t['num_splits']:>6} "
                  f"{str(t['grid']):>12} {t['ctas']:>5} {t['waves']:>5.2f} {t['sm_fill']:>6.2f} "
                  f"{t['blocks_per_cta']:>7} {t['kib_per_cta']:>7.0f} "
                  f"{t['kib_in_flight_per_sm']:>10.0f} {t['merge_partials']:>5}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
