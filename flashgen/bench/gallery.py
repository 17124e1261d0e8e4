"""Write ``docs/gallery.md``: each variant spec next to its measured TFLOP/s and
FlexAttention's, forward and forward+backward, timed in the same run.

    flashgen bench --gallery                  # on a GPU, in the checkout
    flashgen bench --gallery --direction fwd  # the forward alone
    flashgen bench --gallery --dry-run        # anywhere: specs, densities

For each gallery spec among the shipped specs (a missing one is listed as such): the spec
text; the density (kept (q, kv) pairs / all pairs, from the mask IR on the same inputs);
flashgen's median time and TFLOP/s (a spec whose mask reads tensors runs with a BlockMask
built once by ``op.block_mask``; its forward is also timed with the pre-pass in every call);
FlexAttention's (``torch.compile``'d ``flex_attention`` with the spec's mask_mod / score_mod
from :mod:`flashgen.bench.flexmods` and a ``create_block_mask`` built once, as
:func:`flashgen.bench.peers.make_forward` does); the ratio; and, against flashgen's dense
causal kernel at the same shape, the time ratio next to the FLOP ratio (a sparse mask should
save time in proportion to the FLOPs it skips).

Directions (``--direction``, default ``fwd,fwd_bwd``): ``fwd`` times ``o = attention(q, k,
v)``; ``fwd_bwd`` times that and ``torch.autograd.grad(o, (q, k, v), do)``, with one ``do``
for every implementation and tensor params as plain inputs (no param gradient).  Each
implementation's first call builds and compiles, outside the timing (FlexAttention's
forward+backward is compiled once per spec; the seconds are in the JSON).

The dense causal baseline (causal_d128 at the same shape) is also timed against SDPA's
cuDNN backend (``--no-cudnn``: not), in the same rounds and directions, as is any plain spec
(no mask beyond causal, no score_mod, no params) named in ``--specs``.

TFLOP/s count only kept pairs: forward ``2 * (D + Dv) * kept``, forward+backward 3.5x that
(the backward 2.5x the forward, the FlashAttention papers' count that ``flashgen bench``
uses).  Shape (the FlashAttention protocol): batch * seqlen = 16384 tokens, heads * head_dim
= 2048, bf16, Sq = Sk = ``--seqlen`` (default 8192).  Times are ``do_bench`` medians
(:func:`flashgen.bench.timing.do_bench_ms`).  Document ids: each batch row is cut into
documents of random lengths (mean ``--doc-len`` tokens).  Each spec's implementations and
directions are timed in ``--rounds`` alternating rounds (:func:`flashgen.bench.timing.alternate`:
A B C, C B A, ...; default 3) and each reports its median, so drift of the GPU's clocks over
the run reaches all alike.  The forward alone finished in about 3-4 minutes on an H200, much
of it torch.compile of FlexAttention; forward+backward adds each spec's backward build and
FlexAttention's backward compile.  ``--budget`` (s) skips the specs left after it.
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

from flashgen.bench import argtypes, helptext
from flashgen.bench.protocol import BWD_FACTOR, DIRECTIONS
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
#: What a direction adds to a result's key (``flashgen_ms``, ``flashgen_fwd_bwd_ms``,
#: ``speedup``, ``speedup_fwd_bwd``, ...).
SUFFIX = {"fwd": "", "fwd_bwd": "_fwd_bwd"}
#: The implementations a row can hold, by key prefix: flashgen, FlexAttention, SDPA's cuDNN.
IMPLS = ("flashgen", "flex", "sdpa_cudnn")
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


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:200]}"


def error_key(key: str) -> str:
    """The row key under which an error of result ``key`` is recorded: ``<impl>_error`` for a
    forward result (the pre-pass keys are flashgen's), ``<impl>_fwd_bwd_error`` for a
    forward+backward one (``impl`` one of :data:`IMPLS`)."""
    impl = next((i for i in IMPLS[1:] if key.startswith(i)), "flashgen")
    return f"{impl}{SUFFIX['fwd_bwd'] if '_fwd_bwd' in key else ''}_error"


def measure(spec, batch, heads, seqlen, params, device, args) -> dict:
    """Times (ms) of one spec on q, k ``[batch, heads, seqlen, head_dim]`` and v ``[..,
    head_dim_v]`` (randn in the spec's dtype, the same for every implementation), for each
    direction of ``args.direction`` (a tuple of :data:`~flashgen.bench.protocol.DIRECTIONS`;
    absent: ``("fwd",)``).

    Result keys ``<impl><suffix>_ms`` (:data:`IMPLS`, :data:`SUFFIX`): flashgen (with a
    BlockMask built once when the mask reads tensors; its forward also with the pre-pass in
    every call, ``flashgen_prepass_ms``, and the pre-pass alone, ``prepass_ms``),
    FlexAttention (unless ``args.no_flex``) and SDPA's cuDNN backend (where it computes the
    spec, :func:`flashgen.bench.peers.expressible`, unless ``args.no_cudnn``).  fwd_bwd
    times ``o = f(q, k, v)`` and ``torch.autograd.grad(o, (q, k, v), do)``: q, k, v as leaves
    that require grad, one ``do`` ``[batch, heads, seqlen, head_dim_v]`` for every
    implementation, tensor params detached (plain inputs, no param gradient).

    Each callable runs once first (builds, compiles, probes; seconds in ``first_call_s``,
    FlexAttention's also ``flex_compile_s`` / ``flex_fwd_bwd_compile_s``), then all are timed
    in ``args.rounds`` alternating rounds (:func:`flashgen.bench.timing.alternate`) of
    ``do_bench`` windows of ``args.warmup`` / ``args.rep`` ms; each key holds the median of
    its rounds and ``<impl><suffix>_rounds_ms`` the rounds.  Errors are recorded under
    :func:`error_key`, not raised; an implementation that fails sits out the later rounds.
    """
    import torch

    from flashgen.bench import peers, timing
    from flashgen.codegen.abi import needs_block_table
    from flashgen.ops.op import TORCH_DTYPE, build_op

    directions = tuple(getattr(args, "direction", None) or ("fwd",))
    fwd, bwd = "fwd" in directions, "fwd_bwd" in directions
    dt = TORCH_DTYPE[spec.dtype]
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, heads, seqlen, spec.head_dim, device=device, generator=g).to(dt)
    k = torch.randn(batch, heads, seqlen, spec.head_dim, device=device, generator=g).to(dt)
    v = torch.randn(batch, heads, seqlen, spec.head_dim_v, device=device, generator=g).to(dt)
    do = None
    if bwd:
        do = torch.randn(batch, heads, seqlen, spec.head_dim_v, device=device, generator=g)
        do = do.to(dt)
    # forward+backward: the same values as leaves that require grad (q, k, v stay plain, so
    # the forward records no graph); tensor params as plain inputs
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    plain = {n: x.detach() if isinstance(x, torch.Tensor) else x for n, x in params.items()}

    def fwd_bwd(f):
        def call():
            o = f(qg, kg, vg)
            return torch.autograd.grad(o, (qg, kg, vg), do)

        return call

    out: dict = {}
    # result key -> callable, in the order the rounds take them (forward, then fwd+bwd)
    fwd_fns: dict = {}
    bwd_fns: dict = {}
    try:
        op = build_op(spec)
        table: dict = {}
        if needs_block_table(spec):
            bm = op.block_mask(seqlen, seqlen, batch=batch, num_heads=heads, **params)
            out["tiles"] = bm.counts()
            table = {"block_mask": bm}
        if fwd:
            fwd_fns["flashgen_ms"] = lambda: op.attention(q, k, v, **table, **params)
            if table:
                fwd_fns["flashgen_prepass_ms"] = lambda: op.attention(q, k, v, **params)
                fwd_fns["prepass_ms"] = lambda: op.block_mask(
                    seqlen, seqlen, batch=batch, num_heads=heads, **params
                )
        if bwd:
            bwd_fns["flashgen_fwd_bwd_ms"] = fwd_bwd(
                lambda q, k, v: op.attention(q, k, v, **table, **plain)[0]
            )
    except Exception as e:  # record, keep going
        for d in directions:
            out[error_key("flashgen" + SUFFIX[d])] = _error(e)
    flex_fns: dict = {}  # "flex" / "flex_fwd_bwd" -> its FlexAttention callable
    if not getattr(args, "no_flex", False):
        try:  # a callable per direction: its own kernel options, should it need smaller blocks
            if fwd:
                flex = flex_fns["flex"] = peers.make_forward(
                    "flex", spec, seqlen, seqlen, params, device
                )
                fwd_fns["flex_ms"] = lambda: flex(q, k, v)
            if bwd:
                flexb = flex_fns["flex_fwd_bwd"] = peers.make_forward(
                    "flex", spec, seqlen, seqlen, plain, device
                )
                bwd_fns["flex_fwd_bwd_ms"] = fwd_bwd(flexb)
        except Exception as e:  # peers.Unsupported: no FlexAttention in this torch
            for d in directions:
                out.setdefault(error_key("flex" + SUFFIX[d]), _error(e))
    if not getattr(args, "no_cudnn", False) and peers.expressible("sdpa_cudnn", spec):
        try:
            sdpa = peers.make_forward("sdpa_cudnn", spec, seqlen, seqlen, params, device)
            if fwd:
                fwd_fns["sdpa_cudnn_ms"] = lambda: sdpa(q, k, v)
            if bwd:
                bwd_fns["sdpa_cudnn_fwd_bwd_ms"] = fwd_bwd(sdpa)
        except Exception as e:  # peers.Unsupported
            for d in directions:
                out.setdefault(error_key("sdpa_cudnn" + SUFFIX[d]), _error(e))
    fns = {**fwd_fns, **bwd_fns}
    # the first calls: build, compile (FlexAttention's torch.compile), probe; not timed
    out["first_call_s"] = {}
    for key, fn in list(fns.items()):
        t0 = time.perf_counter()
        try:
            fn()
            if q.is_cuda:
                torch.cuda.synchronize()
        except Exception as e:  # record, keep going
            out.setdefault(error_key(key), _error(e))
            del fns[key]
            continue
        out["first_call_s"][key] = time.perf_counter() - t0
        if key.startswith("flex"):  # torch.compile of this direction
            out[key.removesuffix("_ms") + "_compile_s"] = out["first_call_s"][key]
    for name, f in flex_fns.items():
        if getattr(f, "kernel_options", None):  # its default configs did not fit in shared
            out[f"{name}_kernel_options"] = dict(f.kernel_options)  # memory
    # alternate the implementations and directions round by round (A B C, C B A, ...), so
    # clock and thermal drift over the run reach all alike; report each one's median over
    # the rounds (an error while timed is recorded like one in the first call, under
    # error_key; that callable's rounds stop)
    keys = list(fns)
    samples, failed = timing.alternate(
        lambda i: timing.do_bench_ms(fns[keys[i]], args.warmup, args.rep),
        len(keys),
        max(1, args.rounds),
    )
    for i, e in failed.items():
        out.setdefault(error_key(keys[i]), _error(e))
    for i, key in enumerate(keys):
        if i not in failed and samples[i]:
            out[key] = statistics.median(samples[i])
            out[key.removesuffix("_ms") + "_rounds_ms"] = samples[i]
    return out


def figures(row: dict, directions, base: dict | None = None) -> None:
    """Add the derived figures to ``row`` (a spec's facts with ``head_dim``, ``heads``,
    ``flops`` (its forward FLOPs over the kept pairs) and :func:`measure`'s times), for each
    direction in ``directions`` (key suffix :data:`SUFFIX`): ``flops<suffix>`` (forward:
    ``flops``; fwd_bwd: ``flops * (1 + BWD_FACTOR)``), ``<impl><suffix>_tflops`` (TFLOP/s of
    each :data:`IMPLS` timed; else None), ``speedup<suffix>`` (Flex ms / flashgen ms) and
    ``cudnn_speedup<suffix>`` (cuDNN ms / flashgen ms) where both were timed; with ``base``
    (the dense causal baseline's row, figures added) and a head_dim-128 ``row``:
    ``time_vs_causal<suffix>`` (flashgen's ms per head over the baseline's) and
    ``flops_vs_causal`` (kept pairs per head over the baseline's)."""
    for d in directions:
        sfx = SUFFIX[d]
        flops = row["flops"] * (1 + BWD_FACTOR if d == "fwd_bwd" else 1)
        row[f"flops{sfx}"] = flops
        for impl in IMPLS:
            ms = row.get(f"{impl}{sfx}_ms")
            if ms or impl != "sdpa_cudnn":
                row[f"{impl}{sfx}_tflops"] = flops / (ms * 1e-3) / 1e12 if ms else None
        ms = row.get(f"flashgen{sfx}_ms")
        if ms and row.get(f"flex{sfx}_ms"):
            row[f"speedup{sfx}"] = row[f"flex{sfx}_ms"] / ms
        if ms and row.get(f"sdpa_cudnn{sfx}_ms"):
            row[f"cudnn_speedup{sfx}"] = row[f"sdpa_cudnn{sfx}_ms"] / ms
        base_ms = (base or {}).get(f"flashgen{sfx}_ms")
        if ms and base_ms and row["head_dim"] == 128:
            row[f"time_vs_causal{sfx}"] = ms / row["heads"] / (base_ms / base["heads"])
            row["flops_vs_causal"] = (
                row["kept_pairs"] / row["heads"] / (base["kept_pairs"] / base["heads"])
            )


def fmt(x, spec=".2f") -> str:
    return "—" if x is None else format(x, spec)


def _ratio(x) -> str:
    return f"{fmt(x, '.2f')}{'x' if x else ''}"


def table(rows: list[dict], direction: str) -> list[str]:
    """The page's table of ``direction`` (markdown lines): one line per row, a missing spec
    as such."""
    sfx = SUFFIX[direction]
    if direction == "fwd":
        head = (
            "| spec | head_dim | density | flashgen ms | flashgen TFLOP/s | with pre-pass ms "
            "| Flex ms | Flex TFLOP/s | flashgen / Flex | time / causal | FLOPs / causal |"
        )
    else:
        head = (
            "| spec | head_dim | density | flashgen ms | flashgen TFLOP/s "
            "| Flex ms | Flex TFLOP/s | flashgen / Flex | time / causal | FLOPs / causal |"
        )
    cols = head.count("|") - 1
    lines = [head, "| --- |" + " ---: |" * (cols - 1)]
    for r in rows:
        if r.get("missing"):
            lines.append(
                f"| {r['name']} | — | — | not in specs/ on this branch |" + " |" * (cols - 4)
            )
            continue
        cells = [
            r["name"],
            str(r["head_dim"]),
            fmt(r["density"], ".3f"),
            fmt(r.get(f"flashgen{sfx}_ms"), ".3f"),
            fmt(r.get(f"flashgen{sfx}_tflops"), ".0f"),
        ]
        if direction == "fwd":
            cells.append(fmt(r.get("flashgen_prepass_ms"), ".3f"))
        cells += [
            fmt(r.get(f"flex{sfx}_ms"), ".3f"),
            fmt(r.get(f"flex{sfx}_tflops"), ".0f"),
            _ratio(r.get(f"speedup{sfx}")),
            fmt(r.get(f"time_vs_causal{sfx}"), ".2f"),
            fmt(r.get("flops_vs_causal"), ".2f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def baseline_section(base: dict, directions) -> list[str]:
    """The dense causal baseline against SDPA's cuDNN backend, one line per direction."""
    lines = [
        "## Dense causal baseline against cuDNN",
        "",
        f"{base['name']} (head_dim {base['head_dim']}, the same shape) and SDPA's cuDNN "
        "backend (`scaled_dot_product_attention(..., is_causal=True)` under "
        "`sdpa_kernel(SDPBackend.CUDNN_ATTENTION)`) in the same alternating rounds; TFLOP/s "
        "over the kept pairs, as above.",
        "",
        "| direction | flashgen ms | flashgen TFLOP/s | cuDNN ms | cuDNN TFLOP/s "
        "| flashgen / cuDNN |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for d in directions:
        sfx = SUFFIX[d]
        lines.append(
            f"| {'forward' if d == 'fwd' else 'forward+backward'} "
            f"| {fmt(base.get(f'flashgen{sfx}_ms'), '.3f')} "
            f"| {fmt(base.get(f'flashgen{sfx}_tflops'), '.0f')} "
            f"| {fmt(base.get(f'sdpa_cudnn{sfx}_ms'), '.3f')} "
            f"| {fmt(base.get(f'sdpa_cudnn{sfx}_tflops'), '.0f')} "
            f"| {_ratio(base.get(f'cudnn_speedup{sfx}'))} |"
        )
    lines.append("")
    errors = [f"{k.replace('_', ' ')}: `{base[k]}`" for k in _error_keys(base)]
    if errors:
        lines += ["; ".join(errors) + ".", ""]
    return lines


def _error_keys(row: dict) -> list[str]:
    keys = [f"{impl}{sfx}_error" for impl in IMPLS for sfx in SUFFIX.values()]
    return [k for k in keys if row.get(k)]


def _flex_facts(r: dict, sfx: str) -> str:
    options = r.get(f"flex{sfx}_kernel_options")
    return (
        f"FlexAttention {fmt(r[f'flex{sfx}_ms'], '.3f')} ms = "
        f"{fmt(r.get(f'flex{sfx}_tflops'), '.0f')} TFLOP/s (compile "
        f"{fmt(r.get(f'flex{sfx}_compile_s'), '.0f')} s"
        + (
            f"; its default Triton configs did not fit in shared memory, run with "
            f"kernel_options {options}"
            if options
            else ""
        )
        + ")"
    )


def spec_facts(r: dict, directions) -> str:
    """The sentence under a spec's text: density, each direction's times and ratio, the
    block table, errors."""
    facts = [f"density {fmt(r['density'], '.3f')}"]
    for d in directions:
        sfx = SUFFIX[d]
        lead = "" if d == "fwd" else "forward+backward: "
        if r.get(f"flashgen{sfx}_ms") is not None:
            facts.append(
                f"{lead}flashgen {fmt(r[f'flashgen{sfx}_ms'], '.3f')} ms = "
                f"{fmt(r.get(f'flashgen{sfx}_tflops'), '.0f')} TFLOP/s"
            )
            lead = ""
        if r.get(f"flex{sfx}_ms") is not None:
            facts.append(lead + _flex_facts(r, sfx))
            lead = ""
        if r.get(f"speedup{sfx}") is not None:
            facts.append(f"{lead}flashgen / Flex {r[f'speedup{sfx}']:.2f}x")
    if r.get("tiles"):
        t = r["tiles"]
        facts.append(
            f"block table {t['empty']} empty / {t['partial']} partial / {t['full']} full "
            f"tiles, built in {fmt(r.get('prepass_ms'), '.3f')} ms"
        )
    for key in _error_keys(r):
        facts.append(f"{key.replace('_', ' ')}: `{r[key]}`")
    return "; ".join(facts) + "."


def write_page(rows: list[dict], meta: dict, path: Path) -> None:
    """Write the page to ``path``: ``rows`` (:func:`main`'s, figures added) and ``meta``
    (``where``, ``batch``, ``seqlen``, ``specs``: the specs folder; ``directions``, default
    both; ``baseline``: the dense causal row, or None)."""
    directions = tuple(meta.get("directions") or DIRECTIONS)
    lines = [
        "# Gallery: attention variants as specs, and how fast they run",
        "",
        "Generated by `flashgen bench --gallery` (do not edit by hand; rerun it). " + meta["where"],
        "",
        f"Shape: batch {meta['batch']}, seqlen_q = seqlen_k = {meta['seqlen']}, "
        "heads * head_dim = 2048, bf16.  TFLOP/s count only the (q, kv) pairs "
        "the mask keeps (`2 * (D + Dv) * kept`"
        + (
            ", 3.5x that for forward+backward: the backward 2.5x the forward, the "
            "FlashAttention papers' count"
            if "fwd_bwd" in directions
            else ""
        )
        + "); density = kept / all pairs.  flashgen and FlexAttention "
        "(`torch.compile(flex_attention)`, mask_mod / score_mod from "
        "`flashgen/bench/flexmods.py`, `create_block_mask` built once) run in the same process "
        "on the same inputs, in the same alternating rounds; a spec whose mask reads tensors "
        "runs with a BlockMask built once by `op.block_mask` (FlexAttention's equivalent), and "
        "the column 'with pre-pass' times flashgen building its block table in every call.  "
        "'time / causal' is the time relative to flashgen's dense causal kernel at the "
        "same shape, next to 'FLOPs / causal', the kept-pair ratio: a sparse mask should "
        "save time in proportion to the FLOPs it skips.",
        "",
    ]
    if "fwd" in directions:
        lines += ["## Forward", "", "`o = attention(q, k, v)`.", ""]
        lines += table(rows, "fwd")
    if "fwd_bwd" in directions:
        lines += [
            "## Forward+backward",
            "",
            "`o = attention(q, k, v)` and `torch.autograd.grad(o, (q, k, v), dO)`, one dO "
            "for both implementations; tensor params are plain inputs (no param gradient).  "
            "FlexAttention's forward+backward is compiled once per spec, outside the timing.",
            "",
        ]
        lines += table(rows, "fwd_bwd")
    if meta.get("baseline"):
        lines += baseline_section(meta["baseline"], directions)
    for r in rows:
        if r.get("missing"):
            continue
        lines += [f"## {r['name']}", "", "```yaml", r["text"].rstrip(), "```", ""]
        lines += [spec_facts(r, directions), ""]
    lines += serving_section(meta["specs"])
    path.write_text("\n".join(lines))


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(
        prog=prog, description=helptext.plain(__doc__), formatter_class=helptext.HelpFormatter
    )
    ap.add_argument("--seqlen", type=argtypes.positive_int("seqlen"), default=8192)
    ap.add_argument("--doc-len", type=argtypes.positive_int("doc-len"), default=1024,
                    help="mean document length")  # fmt: skip
    ap.add_argument("--specs", nargs="*", default=list(GALLERY))
    ap.add_argument(
        "--direction",
        type=argtypes.choices("direction", DIRECTIONS),
        default=DIRECTIONS,
        metavar="DIRS",
        help="fwd (the forward), fwd_bwd (forward and the gradients of q, k, v); "
        "comma-separated (default fwd,fwd_bwd)",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="default docs/gallery.md of the current directory (run it from the checkout's "
        "root); a --dry-run without --out prints the page instead (it would replace the "
        "measured page with dashes)",
    )
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ap.add_argument("--warmup", type=argtypes.nonnegative_int("warmup"), default=25,
                    help="do_bench warm-up, ms")  # fmt: skip
    ap.add_argument("--rep", type=argtypes.positive_int("rep"), default=100,
                    help="do_bench window, ms")  # fmt: skip
    ap.add_argument(
        "--rounds",
        type=argtypes.positive_int("rounds"),
        default=3,
        help="timing rounds, the implementations and directions alternating (median reported)",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=420.0,
        help="seconds (default 420); the specs left after it are listed untimed",
    )
    ap.add_argument("--no-flex", action="store_true", help="time no FlexAttention")
    ap.add_argument(
        "--no-cudnn",
        action="store_true",
        help="time no SDPA cuDNN (the dense causal baseline and plain specs)",
    )
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
    base = None
    batch, _ = protocol.problem(args.seqlen, 128)

    def spec_row(name: str, spec, text: str, params: dict) -> dict:
        b, heads = protocol.problem(args.seqlen, spec.head_dim)
        kept = protocol.kept_pairs(spec, b, heads, args.seqlen, params, device)
        return {
            "name": name,
            "text": text,
            "head_dim": spec.head_dim,
            "batch": b,
            "heads": heads,
            "density": kept / (b * heads * args.seqlen**2),
            "kept_pairs": kept,
            "flops": 2 * (spec.head_dim + spec.head_dim_v) * kept,
        }

    if gpu:  # flashgen's dense causal kernel, and cuDNN's, at the same shape (no Flex)
        base_path = specs_dir / f"{BASELINE}.yaml"
        if base_path.exists():
            base_spec, text = load_spec(base_path), base_path.read_text()
        else:
            base_spec = protocol.template_spec(128, "bf16", True)
            text = base_spec.source or ""
        base = spec_row(BASELINE, base_spec, text, {})
        base.update(measure(base_spec, base["batch"], base["heads"], args.seqlen, {}, device,
                            argparse.Namespace(**{**vars(args), "no_flex": True})))  # fmt: skip
        figures(base, args.direction)
    for name in args.specs:
        path = specs_dir / f"{name}.yaml"
        if not path.exists():
            rows.append({"name": name, "missing": True})
            print(f"{name}: not in specs/, skipped", file=sys.stderr)
            continue
        spec = load_spec(path)
        b, heads = protocol.problem(args.seqlen, spec.head_dim)
        params = gallery_params(spec, b, heads, args.seqlen, device, args.doc_len)
        row = spec_row(name, spec, path.read_text(), params)
        if gpu and time.perf_counter() - t_start < args.budget:
            row.update(measure(spec, b, heads, args.seqlen, params, device, args))
        elif gpu:
            for d in args.direction:
                row[error_key("flashgen" + SUFFIX[d])] = "skipped: over --budget"
        figures(row, args.direction, base)
        rows.append(row)
        print(progress_line(row, args.direction), file=sys.stderr, flush=True)
    if gpu:
        base_ms = " / ".join(
            f"{fmt(base.get(f'flashgen{SUFFIX[d]}_ms'), '.3f')} ms "
            + ("forward" if d == "fwd" else "forward+backward")
            for d in args.direction
        )
        where = (
            f"Measured on {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
            f"{time.strftime('%Y-%m-%d', time.gmtime())}; dense causal baseline "
            f"({BASELINE}, head_dim 128) {base_ms}."
        )
    else:
        where = (
            "Dry run (no GPU): densities only; run `flashgen bench --gallery` on a GPU for "
            "the timings."
        )
    meta = {"where": where, "batch": batch, "seqlen": args.seqlen, "host": platform.node(),
            "specs": specs_dir, "directions": list(args.direction), "bwd_factor": BWD_FACTOR,
            "rounds": args.rounds, "baseline": base}  # fmt: skip
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


def progress_line(row: dict, directions) -> str:
    """One spec's line on stderr: density, and per direction the times, TFLOP/s, ratio."""
    parts = [f"{row['name']}: density {row['density']:.3f}"]
    for d in directions:
        sfx = SUFFIX[d]
        parts.append(
            f"{d} flashgen {fmt(row.get(f'flashgen{sfx}_ms'), '.3f')} ms "
            f"({fmt(row.get(f'flashgen{sfx}_tflops'), '.0f')} TFLOP/s) flex "
            f"{fmt(row.get(f'flex{sfx}_ms'), '.3f')} ms "
            f"({fmt(row.get(f'flex{sfx}_tflops'), '.0f')} TFLOP/s) speedup "
            f"{fmt(row.get(f'speedup{sfx}'), '.2f')}"
        )
    return "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
