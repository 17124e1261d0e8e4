"""Reports of ``flashgen bench`` results: Markdown tables, PNG plots, the terminal summary.

Works from the JSON document :mod:`flashgen.bench.runner` writes (``results.json``), so reports
can be rebuilt (and several runs merged) on a machine without a GPU:
``flashgen bench --from-json a/results.json b/results.json --out merged/``.
Units: ms, TFLOP/s, GB/s, GiB.  Plots need matplotlib (the ``bench`` extra); without it
only the Markdown is written.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from flashgen.bench.protocol import DIRECTIONS, FP8_PEER, IMPLS

#: Display order and colors of the implementations.
COLORS = {
    "flashgen": "tab:red",
    FP8_PEER: "tab:brown",
    "sdpa_flash": "tab:blue",
    "sdpa_cudnn": "tab:green",
    "sdpa_efficient": "tab:purple",
    "flex": "tab:orange",
    "standard": "tab:gray",
}
STATUS_TEXT = {"unsupported": "unsup", "oom": "OOM", "n/a": "n/a", "error": "err", "skipped": "-"}


def merge(docs: list[dict]) -> dict:
    """One document from several runs: the first run's env and ceilings, all rows (a later
    run's successful row replaces an earlier one of the same implementation and problem)."""
    if not docs:
        raise ValueError("nothing to merge")
    out = dict(docs[0])
    rows: dict[tuple, dict] = {}
    for d in docs:
        for r in d.get("rows", []):
            key = tuple(
                r.get(k)
                for k in ("section", "impl", "spec", "dtype", "head_dim", "causal", "direction")
            ) + (r.get("seqlen"),)
            if key not in rows or r.get("status") == "ok":
                rows[key] = r
        for k, v in d.get("ceilings", {}).items():
            out.setdefault("ceilings", {}).setdefault(k, v)
    out["rows"] = list(rows.values())
    out["merged_from"] = len(docs)
    return out


def load(paths: list[str | Path]) -> dict:
    """Read and :func:`merge` results.json files."""
    return merge([json.loads(Path(p).read_text()) for p in paths])


def _cell(r: dict | None, key: str = "tflops", fmt: str = "{:.1f}") -> str:
    if r is None:
        return ""
    if r.get("status") == "ok" and r.get(key) is not None:
        return fmt.format(r[key])
    return STATUS_TEXT.get(r.get("status"), r.get("status", "?"))


def _impls_present(rows: list[dict]) -> list[str]:
    seen = {r["impl"] for r in rows}
    order = (IMPLS[0], FP8_PEER, *IMPLS[1:])
    return [i for i in order if i in seen] + sorted(seen - set(order))


def fp8_speedups(rows: list[dict]) -> list[dict]:
    """For each timed fp8 row of flashgen (``dtype`` fp8_e4m3) that has its ``flashgen_bf16``
    row (the bf16 build of the same spec, same problem, same run): ``spec``, ``section``,
    ``head_dim``, ``causal``, ``direction``, ``seqlen``, ``fp8_tflops``, ``bf16_tflops`` and
    ``speedup`` = bf16 ms / fp8 ms (above 1: fp8 is faster), ordered by spec and seqlen."""
    def key(r: dict) -> tuple:
        return (r["section"], r["spec"], r["head_dim"], r["causal"], r["direction"], r["seqlen"])

    ok = [r for r in rows if r.get("status") == "ok" and r.get("ms") and
          str(r.get("dtype", "")).startswith("fp8")]  # fmt: skip
    peer = {key(r): r for r in ok if r["impl"] == FP8_PEER}
    out = []
    for r in ok:
        b = peer.get(key(r)) if r["impl"] == "flashgen" else None
        if b is None:
            continue
        out.append({
            "spec": r["spec"], "section": r["section"], "head_dim": r["head_dim"],
            "causal": r["causal"], "direction": r["direction"], "seqlen": r["seqlen"],
            "fp8_tflops": r.get("tflops"), "bf16_tflops": b.get("tflops"),
            "speedup": b["ms"] / r["ms"],
        })  # fmt: skip
    return sorted(out, key=lambda x: (x["section"], x["spec"], x["direction"], x["seqlen"]))


def _gib(x) -> float:
    return x / 2**30


# ----------------------------------------------------------------------------- markdown
def markdown(doc: dict) -> str:
    """The Markdown report: environment, ceilings, sweep, memory and variant tables."""
    env = doc.get("env", {})
    smi = env.get("nvidia_smi") or {}
    ceil = doc.get("ceilings", {})
    lines = ["# flashgen bench", ""]
    lines.append(
        f"GPU **{env.get('gpu', '?')}** (cc {env.get('capability', '?')}, "
        f"{env.get('sm_count', '?')} SMs); SM clock {smi.get('clocks.sm', '?')} / max "
        f"{smi.get('clocks.max.sm', '?')} MHz, memory clock {smi.get('clocks.mem', '?')} MHz, "
        f"driver {smi.get('driver_version', '?')}."
    )
    lines.append(
        f"torch {env.get('torch')} (CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}), "
        f"triton {env.get('triton')}, cupy {env.get('cupy')}, nvcc {env.get('nvcc')}, "
        f"flashgen {env.get('flashgen')} (kernel family {env.get('kernel_family', 'auto')}); "
        f"{env.get('date', '')}."
    )
    if ceil:
        lines.append(
            f"Ceilings in the same run: bf16 matmul 8192^3 "
            f"**{ceil.get('matmul_bf16_tflops', float('nan')):.0f} TFLOP/s**, device copy "
            f"**{ceil.get('copy_gbps', float('nan')):.0f} GB/s** (read + write)."
        )
    lines += [
        "",
        "TFLOP/s, medians of `triton.testing.do_bench`; batch x seqlen = 16384, hidden 2048 "
        "(heads = 2048 / head_dim); FLOPs 4·B·H·S²·D, halved for causal, x3.5 for fwd+bwd. "
        "unsup = the backend rejects the config, OOM = out of memory, n/a = no backward, "
        "err = failure (see notes), - = skipped (time budget).",
        "",
    ]
    rows = doc.get("rows", [])
    sweep = [r for r in rows if r["section"] == "sweep"]
    if sweep:
        impls = _impls_present(sweep)
        by = {
            (r["dtype"], r["direction"], r["head_dim"], r["causal"], r["seqlen"], r["impl"]): r
            for r in sweep
        }
        groups = sorted({(r["dtype"], r["direction"]) for r in sweep}, key=_group_order)
        for dtype, direction in groups:
            lines += [f"## {dtype}, {_dir_text(direction)}", ""]
            lines.append("| head_dim | causal | seqlen | " + " | ".join(impls) + " |")
            lines.append("|---|---|---|" + "---|" * len(impls))
            keys = sorted(
                {
                    (r["head_dim"], r["causal"], r["seqlen"])
                    for r in sweep
                    if (r["dtype"], r["direction"]) == (dtype, direction)
                }
            )
            for d, c, s in keys:
                cells = [_cell(by.get((dtype, direction, d, c, s, i))) for i in impls]
                lines.append(f"| {d} | {'yes' if c else 'no'} | {s} | " + " | ".join(cells) + " |")
            lines.append("")
    mem = [r for r in rows if r["section"] == "memory"]
    if mem:
        lines += [
            "## Memory: peak `torch.cuda.max_memory_allocated` (GiB, inputs included)",
            "",
            "B=1, H=16, D=128, bf16, not causal.",
            "",
        ]
        cols = sorted({(r["impl"], r["direction"]) for r in mem}, key=lambda x: (x[1], x[0]))
        lines.append("| seqlen | " + " | ".join(f"{i} {_dir_text(d)}" for i, d in cols) + " |")
        lines.append("|---|" + "---|" * len(cols))
        by = {(r["seqlen"], r["impl"], r["direction"]): r for r in mem}
        for s in sorted({r["seqlen"] for r in mem}):
            cells = []
            for i, d in cols:
                r = by.get((s, i, d))
                if r is not None and r.get("status") == "ok" and r.get("peak_bytes") is not None:
                    cells.append(f"{_gib(r['peak_bytes']):.2f}")
                else:
                    cells.append(_cell(r))
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        lines.append("")
    var = [r for r in rows if r["section"] == "variant"]
    if var:
        impls = _impls_present(var)
        lines += [
            "## Variants (shipped specs): TFLOP/s",
            "",
            "FLOPs counted as dense attention (halved when the mask contains `causal`); masks "
            "that skip more (sliding window) are credited with the causal count.",
            "",
            "| spec | dtype | head_dim | direction | seqlen | " + " | ".join(impls) + " |",
            "|---|---|---|---|---|" + "---|" * len(impls),
        ]
        by = {(r["spec"], r["direction"], r["seqlen"], r["impl"]): r for r in var}
        keys = sorted(
            {(r["spec"], r["dtype"], r["head_dim"], r["direction"], r["seqlen"]) for r in var}
        )
        for sp, dt, d, direction, s in keys:
            cells = [_cell(by.get((sp, direction, s, i))) for i in impls]
            lines.append(
                f"| {sp} | {dt} | {d} | {_dir_text(direction)} | {s} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    fp8 = fp8_speedups(rows)
    if fp8:
        lines += [
            "## FP8 against bf16 (the same spec, the same run)",
            "",
            f"No torch implementation runs FP8 attention: each fp8 spec is timed next to "
            f"`{FP8_PEER}`, the bf16 build of the same spec.  speedup = bf16 time / fp8 time.",
            "",
            "| spec | head_dim | causal | direction | seqlen | fp8 TFLOP/s | bf16 TFLOP/s "
            "| speedup |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for x in fp8:
            lines.append(
                f"| {x['spec']} | {x['head_dim']} | {'yes' if x['causal'] else 'no'} | "
                f"{_dir_text(x['direction'])} | {x['seqlen']} | {x['fp8_tflops']:.1f} | "
                f"{x['bf16_tflops']:.1f} | {x['speedup']:.2f}x |"
            )
        lines.append("")
    kernels = doc.get("kernels") or {}
    if kernels:
        lines += [
            "## flashgen kernels in this run",
            "",
            "| spec | tiles (BLOCK_M x BLOCK_N, warps) | regs fwd | spills fwd (B) "
            "| regs bwd | spills bwd (B) |",
            "|---|---|---|---|---|---|",
        ]
        for name, k in sorted(kernels.items()):
            t = k.get("tiles")
            tiles = f"{t[0]}x{t[1]}, {t[2]}" if t else "-"
            lines.append(
                f"| {name} | {tiles} | {k.get('registers', '-')} | {k.get('spill_bytes', '-')} "
                f"| {k.get('bwd_registers', '-')} | {k.get('bwd_spill_bytes', '-')} |"
            )
        lines.append("")
    notes = _notes(rows)
    if notes or doc.get("compile_errors"):
        lines += ["## Notes", ""]
        for name, err in (doc.get("compile_errors") or {}).items():
            lines.append(f"- compile error, {name}: {err}")
        lines += [f"- {n}" for n in notes]
        lines.append("")
    return "\n".join(lines)


def _dir_text(direction: str) -> str:
    return {"fwd": "forward", "fwd_bwd": "forward+backward"}.get(direction, direction)


def _group_order(g: tuple[str, str]) -> tuple:
    dtype, direction = g
    return (dtype != "bf16", DIRECTIONS.index(direction) if direction in DIRECTIONS else 9)


def _notes(rows: list[dict], limit: int = 40) -> list[str]:
    """Distinct (impl, status, note) of the rows that did not run, with their count."""
    seen: dict[tuple, int] = defaultdict(int)
    for r in rows:
        if r.get("status") in ("unsupported", "error", "n/a") and r.get("note"):
            seen[(r["impl"], r["status"], r["note"][:200])] += 1
    out = [f"{impl} {status} ({n}x): {note}" for (impl, status, note), n in seen.items()]
    return out[:limit]


# ----------------------------------------------------------------------------- summary
def summary(doc: dict) -> str:
    """A short plain-text table: per sweep config, at its largest seqlen, flashgen's
    TFLOP/s, the fastest peer's and the ratio; then the ceilings."""
    rows = [r for r in doc.get("rows", []) if r["section"] in ("sweep", "variant")]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["section"], r["spec"], r["dtype"], r["direction"])].append(r)
    out = [
        f"{'config':34} {'seqlen':>6} {'flashgen':>9} {'best peer':>24} {'ratio':>6}",
    ]
    for (section, spec, _dtype, direction), rs in sorted(groups.items(), key=lambda x: x[0]):
        ok = [r for r in rs if r.get("status") == "ok" and r.get("tflops")]
        if not ok:
            continue
        s = max(r["seqlen"] for r in ok)
        at = [r for r in rs if r["seqlen"] == s]
        fg = next((r for r in at if r["impl"] == "flashgen"), None)
        peers = [r for r in at if r["impl"] != "flashgen" and r.get("status") == "ok"]
        best = max(peers, key=lambda r: r["tflops"], default=None)
        fg_txt = _cell(fg) if fg else ""
        best_txt = f"{best['impl']} {best['tflops']:.1f}" if best else "-"
        ratio = (
            f"{fg['tflops'] / best['tflops']:.2f}"
            if fg and best and fg.get("status") == "ok" and fg.get("tflops")
            else ""
        )
        name = f"{spec} {'fwd+bwd' if direction == 'fwd_bwd' else 'fwd'}"
        if section == "variant":
            name = "variant " + name
        out.append(f"{name:34} {s:>6} {fg_txt:>9} {best_txt:>24} {ratio:>6}")
    for x in fp8_speedups(doc.get("rows", [])):
        out.append(
            f"fp8 {x['spec']} {'fwd+bwd' if x['direction'] == 'fwd_bwd' else 'fwd'} "
            f"S={x['seqlen']}: {x['fp8_tflops']:.1f} TFLOP/s, bf16 build {x['bf16_tflops']:.1f}: "
            f"{x['speedup']:.2f}x"
        )
    ceil = doc.get("ceilings", {})
    if ceil:
        out.append(
            f"ceilings: matmul bf16 {ceil.get('matmul_bf16_tflops', float('nan')):.0f} TFLOP/s, "
            f"copy {ceil.get('copy_gbps', float('nan')):.0f} GB/s"
        )
    mem = [r for r in doc.get("rows", []) if r["section"] == "memory"]
    if mem:
        oom = sorted({r["seqlen"] for r in mem if r["impl"] == "standard" and r["status"] == "oom"})
        fg_max = max(
            (r["seqlen"] for r in mem if r["impl"] == "flashgen" and r["status"] == "ok"),
            default=None,
        )
        out.append(
            "memory: standard attention OOM at seqlen "
            + (", ".join(map(str, oom)) if oom else "none measured")
            + f"; flashgen ran up to {fg_max}"
        )
    return "\n".join(out)


# ----------------------------------------------------------------------------- plots
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_tflops(doc: dict, path: Path) -> Path | None:
    """One PNG, a subplot per (dtype, direction) row x (head_dim, causal) column: TFLOP/s vs
    seqlen with a line per implementation."""
    sweep = [r for r in doc.get("rows", []) if r["section"] == "sweep"]
    if not sweep:
        return None
    plt = _plt()
    row_keys = sorted({(r["dtype"], r["direction"]) for r in sweep}, key=_group_order)
    col_keys = sorted({(r["head_dim"], r["causal"]) for r in sweep})
    fig, axes = plt.subplots(
        len(row_keys),
        len(col_keys),
        figsize=(3.4 * len(col_keys), 2.8 * len(row_keys)),
        squeeze=False,
        sharex=True,
    )
    impls = _impls_present(sweep)
    for i, (dtype, direction) in enumerate(row_keys):
        for j, (d, causal) in enumerate(col_keys):
            ax = axes[i][j]
            for impl in impls:
                pts = sorted(
                    (r["seqlen"], r["tflops"])
                    for r in sweep
                    if (r["dtype"], r["direction"], r["head_dim"], r["causal"], r["impl"])
                    == (dtype, direction, d, causal, impl)
                    and r.get("status") == "ok"
                    and r.get("tflops")
                )
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(
                        xs,
                        ys,
                        marker="o",
                        ms=3,
                        label=impl,
                        color=COLORS.get(impl),
                        lw=2.2 if impl == "flashgen" else 1.2,
                    )
            ax.set_xscale("log", base=2)
            ax.set_title(
                f"{dtype} {'fwd+bwd' if direction == 'fwd_bwd' else 'fwd'} "
                f"d{d} {'causal' if causal else 'full'}",
                fontsize=9,
            )
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
            if j == 0:
                ax.set_ylabel("TFLOP/s")
            if i == len(row_keys) - 1:
                ax.set_xlabel("seqlen")
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.suptitle(_title(doc, "attention TFLOP/s (16k tokens, hidden 2048)"), fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_memory(doc: dict, path: Path) -> Path | None:
    """Peak memory (GiB, log) vs seqlen per (impl, direction); OOM marked with an x."""
    mem = [r for r in doc.get("rows", []) if r["section"] == "memory"]
    if not mem:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    top = max((_gib(r["peak_bytes"]) for r in mem if r.get("peak_bytes")), default=1.0)
    cap = (doc.get("env") or {}).get("gpu_memory_bytes")
    for impl in _impls_present(mem):
        for direction in DIRECTIONS:
            rs = sorted(
                (r for r in mem if r["impl"] == impl and r["direction"] == direction),
                key=lambda r: r["seqlen"],
            )
            if not rs:
                continue
            pts = [(r["seqlen"], _gib(r["peak_bytes"])) for r in rs if r.get("peak_bytes")]
            style = "-" if direction == "fwd" else "--"
            label = f"{impl} {'fwd+bwd' if direction == 'fwd_bwd' else 'fwd'}"
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, style, marker="o", ms=4, color=COLORS.get(impl), label=label)
            oom = [r["seqlen"] for r in rs if r["status"] == "oom"]
            if oom:
                y = _gib(cap) if cap else top * 1.5
                ax.scatter(oom, [y] * len(oom), marker="x", s=60, color=COLORS.get(impl))
                for s in oom:
                    ax.annotate(
                        f"OOM ({label})",
                        (s, y),
                        textcoords="offset points",
                        xytext=(0, -12 if direction == "fwd" else -22),
                        fontsize=7,
                        ha="center",
                        color=COLORS.get(impl),
                    )
    if cap:
        ax.axhline(_gib(cap), color="k", lw=0.8, ls=":", label=f"GPU memory {_gib(cap):.0f} GiB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("seqlen (B=1, H=16, D=128, bf16)")
    ax.set_ylabel("peak allocated (GiB)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(_title(doc, "memory vs sequence length"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_roofline(doc: dict, path: Path) -> Path | None:
    """Roofline: TFLOP/s vs arithmetic intensity (FLOP/byte, estimated DRAM bytes), with
    the measured matmul and copy ceilings; one point per sweep row."""
    ceil = doc.get("ceilings", {})
    rows = [
        r
        for r in doc.get("rows", [])
        if r["section"] in ("sweep", "variant") and r.get("status") == "ok" and r.get("tflops")
    ]
    if not rows or not ceil.get("matmul_bf16_tflops") or not ceil.get("copy_gbps"):
        return None
    plt = _plt()
    peak, bw = ceil["matmul_bf16_tflops"], ceil["copy_gbps"] / 1e3  # TFLOP/s, TB/s
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ai = [r["flops"] / r["bytes"] for r in rows if r.get("bytes")]
    lo, hi = min(ai + [1.0]) / 2, max(ai + [peak / bw]) * 2
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(xs, [min(peak, x * bw) for x in xs], "k-", lw=1.2, label="roofline (measured)")
    ax.axvline(peak / bw, color="k", lw=0.5, ls=":")
    for impl in _impls_present(rows):
        for direction, marker in (("fwd", "o"), ("fwd_bwd", "^")):
            pts = [
                (r["flops"] / r["bytes"], r["tflops"])
                for r in rows
                if r["impl"] == impl and r["direction"] == direction and r.get("bytes")
            ]
            if pts:
                x, y = zip(*pts, strict=True)
                ax.scatter(
                    x,
                    y,
                    s=14,
                    marker=marker,
                    color=COLORS.get(impl),
                    alpha=0.75,
                    label=f"{impl} {'fwd+bwd' if direction == 'fwd_bwd' else 'fwd'}",
                )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / estimated DRAM byte)")
    ax.set_ylabel("TFLOP/s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(
        _title(doc, f"roofline: matmul {peak:.0f} TFLOP/s, copy {bw * 1e3:.0f} GB/s"),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_variants(doc: dict, path: Path) -> Path | None:
    """A subplot per variant spec: TFLOP/s vs seqlen per implementation (solid forward,
    dashed forward+backward)."""
    var = [r for r in doc.get("rows", []) if r["section"] == "variant"]
    if not var:
        return None
    plt = _plt()
    specs = sorted({r["spec"] for r in var})
    ncol = min(4, len(specs))
    nrow = math.ceil(len(specs) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.6 * ncol, 2.9 * nrow), squeeze=False)
    for ax, sp in zip(axes.flat, specs, strict=False):
        rs = [r for r in var if r["spec"] == sp]
        for impl in _impls_present(rs):
            for direction in DIRECTIONS:
                pts = sorted(
                    (r["seqlen"], r["tflops"])
                    for r in rs
                    if r["impl"] == impl
                    and r["direction"] == direction
                    and r.get("status") == "ok"
                    and r.get("tflops")
                )
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(
                        xs,
                        ys,
                        "-" if direction == "fwd" else "--",
                        marker="o",
                        ms=3,
                        color=COLORS.get(impl),
                        label=f"{impl}{' fwd+bwd' if direction == 'fwd_bwd' else ''}",
                    )
        r0 = rs[0]
        ax.set_title(f"{sp} ({r0['dtype']} d{r0['head_dim']})", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(specs) :]:
        ax.axis("off")
    fig.suptitle(_title(doc, "shipped variants, TFLOP/s vs seqlen"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _title(doc: dict, what: str) -> str:
    env = doc.get("env", {})
    return f"{env.get('gpu', '?')}, torch {env.get('torch', '?')}: {what}"


def write_reports(doc: dict, out_dir: str | Path) -> list[Path]:
    """Write results.md and the PNGs (when matplotlib is importable) into ``out_dir``.

    ``results.json`` itself is written by the bench run (or by ``--from-json``).  Returns
    the paths written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    md = out / "results.md"
    md.write_text(markdown(doc) + "\n")
    written.append(md)
    try:
        _plt()
    except ImportError:
        return written
    for fn, name in (
        (plot_tflops, "tflops.png"),
        (plot_memory, "memory.png"),
        (plot_roofline, "roofline.png"),
        (plot_variants, "variants.png"),
    ):
        p = fn(doc, out / name)
        if p is not None:
            written.append(p)
    return written
