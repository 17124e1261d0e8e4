#!/usr/bin/env python3
"""A/B sweep of flashgen's FA2-class kernels against FlashAttention-2 and cuDNN, one command.

For head_dim 64/128/256, causal on and off, bf16 (``--dtypes bf16 fp16`` for both
everywhere; ``--fp16`` adds fp16 at d128 causal only),
seqlen 4096 and 16384 (B*S = 16384 tokens, hidden 2048, so H = 2048 / D, as in the
FlashAttention papers), this builds several variants of the FA2-class forward kernel
(``templates/sm_80/fwd.cu.j2``: tile configs from ``DEFAULT_TILES`` and others, and
the template switches of ``FORWARD_OPTIONS``) and of the backward (deterministic and
atomic-dQ paths, tile tables and wider key blocks), then

1. checks every variant once against the float64 reference (flashgen.ops.reference) on one
   odd-size GQA case (B=2, Hq=4, Hkv=2, Sq=777, Sk=1037) with the tests' bound: 2x the
   error of the same reference in the input dtype + 1e-3.  The checks run in a child
   process, one variant at a time, so a kernel that faults marks itself ``CRASH`` and the
   sweep goes on without it;
2. times each variant that passed with ``triton.testing.do_bench`` (median; inputs rotated
   over enough buffers to exceed twice the L2), next to PyTorch SDPA's FLASH_ATTENTION
   (FlashAttention-2) and CUDNN_ATTENTION backends in the same process;
3. prints one line per config with every implementation's TFLOP/s, then a compact final
   table: FA2, cuDNN, the Hopper kernel, ``base`` and ``default`` (for the backward
   ``det-base`` and ``det``) with ``default``'s ratio to FA2, and the best spill-free
   FA2-class variant; ``--json`` gets every row (registers, spills, checks included).
   Configs are timed longest sequence first, and none is started after ``--budget``
   seconds (default 270), so the whole run stays under 5 minutes.

On sm_90 (H100/H200) flashgen's default forward is the Hopper kernel
(``templates/sm_90/fwd.cu.j2``); every forward variant here is planned with
``family="fa2"`` (and the process runs with ``FLASHGEN_KERNEL_FAMILY=fa2``), so the FA2-class
kernel is what is timed, and each plan's template is checked.  One extra forward row,
``fa3-default``, is the Hopper kernel with its default tiles, for reference (sm_90 only).

Variants (``base`` is the code and tiles shipped before this sweep; ``default`` is what
``flashgen.families`` picks now for the FA2 family; the rest flip one thing):

    fwd  base        FORWARD_OPTIONS all off, session-1 tiles (d64 128x64x4, d128 128x32x4,
                     d256 64x64x4)
    fwd  default     FORWARD_OPTIONS + DEFAULT_TILES
    fwd  -unroll / -hoist / -fold / +lazy   default with one switch flipped
    fwd  t<M>x<N>x<W>                       default switches, other tiles (ALT_TILES)
    fwd  t<M>x<N>x<W>+lazy                  the same with fwd_lazy_rescale (ALT_LAZY)
    fwd  fa3-default                        the Hopper kernel as shipped (sm_90 only)
    bwd  det / atomic                       BACKWARD_TILES / ATOMIC_BACKWARD_TILES
    bwd  det-base                           deterministic, BACKWARD_OPTIONS all off (as shipped)
    bwd  atomic-n128 / det-n128             128 key rows per CTA with 8 warps (FA2's shape)
    bwd  det-wide                           deterministic with wider steps (WIDE_DET_TILES, d128)

FLOPs: forward 4*B*H*Sq*Sk*D, backward 2.5x that, both halved for causal.  Backward
variants time the backward kernels alone (the forward output is computed once); SDPA's
backward is timed as ``torch.autograd.grad`` on a retained graph.

    python3 tools/perf_sweep.py --json /tmp/perf_sweep.json      # the full sweep, < 5 min
    python3 tools/perf_sweep.py --quick                           # S=4096 only, no ablations
    python3 tools/perf_sweep.py --dims 128 --seqlens 16384 --no-bwd
    # FA2's d64 / d256 tiles vs the defaults, bf16 and fp16, causal and not, 4k and 16k:
    python3 tools/perf_sweep.py --candidates --dims 64 256 --dtypes bf16 fp16 --no-fa3
    # the same variants' registers and spills, no GPU needed:
    python3 tools/perf_sweep.py --candidates --dims 64 256 --dtypes bf16 fp16 --build-only sm_90
    # d256 tile candidates, each also with a switch flipped, at 4k/8k/16k; the fastest
    # checked spill-free variant per (causal, dtype) goes into the tuning table (issue 4):
    python3 tools/perf_sweep.py --candidates --dims 256 --dtypes bf16 fp16 \
        --seqlens 4096 8192 16384 --no-fa3 --tiles 64x64x4 64x48x4 128x48x8 128x32x8 \
        --flip fwd_even_loads fwd_unrolled_loads --write-table --budget 170

To adopt a winner: edit ``DEFAULT_TILES`` / ``FORWARD_OPTIONS`` (forward) or
``ATOMIC_BACKWARD_TILES`` / ``BACKWARD_TILES`` (backward) in ``flashgen/families/tiles.py``; or,
per GPU, ``--write-table`` records the forward winners (tiles and flipped switches) in
``flashgen/tuning/table.json``, which the op reads with the device name.
Needs a CUDA GPU, torch, triton, CuPy and nvcc.  Exit status 0 when every variant that ran
passed its check, 1 otherwise, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


from flashgen.codegen.plan import TileConfig  # noqa: E402
from flashgen.families import fa2_bwd, fa2_fwd  # noqa: E402
from flashgen.families.fa2_bwd import BACKWARD_OPTIONS  # noqa: E402
from flashgen.families.fa2_fwd import FORWARD_OPTIONS  # noqa: E402
from flashgen.families.registry import plan_backward, plan_forward  # noqa: E402
from flashgen.families.tiles import (  # noqa: E402
    BackwardTiles,  # noqa: E402
    default_tiles,
)
from flashgen.options import Options  # noqa: E402

#: Tiles the forward shipped with before this sweep (docs/perf-notes.md, 2026-11-29).
BASE_TILES = {64: TileConfig(128, 64, 4), 128: TileConfig(128, 32, 4), 256: TileConfig(64, 64, 4)}
#: Other forward tiles timed with the default switches, per head_dim: FA2's own forward
#: tiles at d64 (128x128x4, spill-free since the pointer-chain loads,
#: ``uses_load_chain``) and d256 (128x64x8), and d128's runner-up of the 2026-11-29
#: tile sweep (docs/perf-notes.md); its clear losers (d64 64x64x4, d128 128x128x8,
#: d256 64x32x4) are left out for time.
ALT_TILES = {
    64: [TileConfig(128, 128, 4)],
    128: [TileConfig(128, 32, 4)],
    256: [TileConfig(128, 64, 8)],
}
#: ALT_TILES entries also timed with ``fwd_lazy_rescale`` on (name suffix ``+lazy``): at
#: d64 the softmax is a large part of each step, and 128-wide steps move the row max less.
ALT_LAZY = {64: [TileConfig(128, 128, 4)], 256: [TileConfig(128, 64, 8)]}
#: The FA2-class template (what every variant but ``fa3-default`` must render).
FA2_TEMPLATE = "sm_80/fwd.cu.j2"
#: Backward with 128 key rows per CTA and 8 warps (FA2's dK/dV shape); zero spills on
#: sm_90a for the plain specs (checked offline).
N128_TILES = {
    64: BackwardTiles(128, 64, 8, 1, 64, 64, 4),
    128: BackwardTiles(128, 32, 8, 1, 64, 32, 4),
    256: BackwardTiles(128, 32, 8, 2, 64, 32, 4),
}
#: Deterministic backward with wider steps that fit once the backward's addresses were
#: hoisted: d128 dq over 64-key steps (zero spills on sm_90a, plain specs).  d64 dK/dV over
#: 128 keys x 128 queries with 8 warps and d256 dK/dV over 64-query steps fitted before the
#: merge with masks (live-block walks), and spill 92-236 bytes after it: left out.
WIDE_DET_TILES = {
    128: BackwardTiles(64, 32, 4, 1, 64, 64, 4),
}
CHECK_SHAPE = (2, 4, 2, 777, 1037)  # B, Hq, Hkv, Sq, Sk


@dataclass(frozen=True)
class Variant:
    """One kernel build: ``kind`` "fwd" or "bwd"; ``tiles`` None = the table's choice;
    ``family`` the forward kernel family (:data:`flashgen.FAMILIES`): "fa2" for every
    variant but ``fa3-default`` ("auto": the Hopper kernel on sm_90)."""

    kind: str
    name: str
    d: int
    causal: bool
    dtype: str
    tiles: TileConfig | BackwardTiles | None = None
    options: tuple = ()  # ((key, bool), ...)
    atomic: bool = False
    family: str = "fa2"

    @property
    def key(self) -> str:
        c = "causal" if self.causal else "full"
        return f"{self.kind}/{self.name}/d{self.d}/{c}/{self.dtype}"


@dataclass
class Built:
    variant: Variant
    plan: object
    cubin: str
    registers: int
    spill_bytes: int
    tiles: str
    template: str = ""
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- variants
def spec_for(d: int, causal: bool, dtype: str):
    from flashgen.frontend.spec import loads_spec

    name = f"sweep_d{d}_{'causal' if causal else 'full'}_{dtype}"
    mask = "causal" if causal else "null"
    return loads_spec(f"name: {name}\nhead_dim: {d}\ndtype: {dtype}\nmask: {mask}\n", "sweep.yaml")


def tile_name(t: TileConfig) -> str:
    return f"t{t.block_m}x{t.block_n}x{t.num_warps}"


def candidate_variants(d: int, causal: bool, dtype: str) -> list[Variant]:
    """``default``, ``+lazy`` and the ALT_TILES / ALT_LAZY tiles: what ``--candidates``
    times (and what the full sweep includes among its ablations)."""
    lazy = (("fwd_lazy_rescale", True),)
    out = [Variant("fwd", "default", d, causal, dtype)]
    if not FORWARD_OPTIONS["fwd_lazy_rescale"]:
        out.append(Variant("fwd", "+lazy", d, causal, dtype, None, lazy))
    out += [Variant("fwd", tile_name(t), d, causal, dtype, t) for t in ALT_TILES.get(d, [])]
    for t in ALT_LAZY.get(d, []):
        out.append(Variant("fwd", tile_name(t) + "+lazy", d, causal, dtype, t, lazy))
    return out


#: Short names of the forward switches in variant names (``-unroll``: unrolled loads off).
SWITCH_LABELS = {
    "fwd_unrolled_loads": "unroll",
    "fwd_hoisted_swizzle": "hoist",
    "fwd_fold_scale": "fold",
    "fwd_lazy_rescale": "lazy",
    "fwd_even_loads": "even",
    "fwd_row_chunks": "rows",
}


def parse_tiles(text: str) -> TileConfig:
    """``"64x64x4"`` (BLOCK_M x BLOCK_N x warps) -> TileConfig; ``ValueError`` otherwise."""
    try:
        m, n, w = (int(x) for x in text.lower().removeprefix("t").split("x"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad tiles {text!r}; expected e.g. 64x64x4") from e
    return TileConfig(m, n, w)


def parse_flip(text: str) -> tuple[str, ...]:
    """``"fwd_lazy_rescale+fwd_even_loads"`` -> the FORWARD_OPTIONS keys flipped together."""
    keys = tuple(dict.fromkeys(text.split("+")))
    bad = [k for k in keys if k not in FORWARD_OPTIONS]
    if bad or not keys:
        raise argparse.ArgumentTypeError(
            f"bad --flip {text!r}: {', '.join(bad) or 'empty'} not in "
            f"{', '.join(sorted(FORWARD_OPTIONS))} (join keys with '+')"
        )
    return keys


def switch_suffix(key: str) -> str:
    """``-unroll`` / ``+even``: the variant-name suffix of flipping ``key`` from its default."""
    return ("-" if FORWARD_OPTIONS[key] else "+") + SWITCH_LABELS.get(key, key)


def tile_variants(
    d: int,
    causal: bool,
    dtype: str,
    tiles: list[TileConfig],
    flips: list,
    flip_only: bool = False,
) -> list[Variant]:
    """``--tiles``: ``default`` and each listed tile config (one equal to the default's is
    left out), each also with each ``--flip`` flipped from FORWARD_OPTIONS (a key, or
    a tuple of keys flipped together; name suffix :func:`switch_suffix` per key).
    ``flip_only``: the listed tiles only with their flips
    (``default`` stays, with its flips)."""
    dflt = default_tiles(spec_for(d, causal, dtype))
    out = []
    for t in [None, *dict.fromkeys(t for t in tiles if t != dflt)]:
        name = "default" if t is None else tile_name(t)
        if t is None or not flip_only:
            out.append(Variant("fwd", name, d, causal, dtype, t))
        for combo in dict.fromkeys((f,) if isinstance(f, str) else tuple(f) for f in flips):
            flipped = tuple((key, not FORWARD_OPTIONS[key]) for key in combo)
            suffix = "".join(switch_suffix(key) for key in combo)
            out.append(Variant("fwd", (name + suffix), d, causal, dtype, t, flipped))
    return out


def fwd_variants(
    d: int, causal: bool, dtype: str, ablations: bool, hopper: bool = True
) -> list[Variant]:
    off = tuple((k, False) for k in FORWARD_OPTIONS)
    out = [
        Variant("fwd", "base", d, causal, dtype, BASE_TILES[d], off),
        Variant("fwd", "default", d, causal, dtype),
    ]
    if ablations:
        for key, label in (
            ("fwd_unrolled_loads", "unroll"),
            ("fwd_hoisted_swizzle", "hoist"),
            ("fwd_fold_scale", "fold"),
            ("fwd_lazy_rescale", "lazy"),
        ):
            now = FORWARD_OPTIONS[key]
            name = ("-" if now else "+") + label
            out.append(Variant("fwd", name, d, causal, dtype, None, ((key, not now),)))
        names = {v.name for v in out}
        out += [v for v in candidate_variants(d, causal, dtype) if v.name not in names]
    if hopper:
        out.append(Variant("fwd", "fa3-default", d, causal, dtype, family="auto"))
    return out


def bwd_variants(d: int, causal: bool, dtype: str, ablations: bool) -> list[Variant]:
    out = [
        Variant("bwd", "det", d, causal, dtype),
        Variant("bwd", "atomic", d, causal, dtype, atomic=True),
        Variant("bwd", "atomic-n128", d, causal, dtype, N128_TILES[d], atomic=True),
    ]
    if ablations:
        off = tuple((k, False) for k in BACKWARD_OPTIONS)
        out.append(Variant("bwd", "det-base", d, causal, dtype, None, off))
        out.append(Variant("bwd", "det-n128", d, causal, dtype, N128_TILES[d]))
        if d in WIDE_DET_TILES:
            out.append(Variant("bwd", "det-wide", d, causal, dtype, WIDE_DET_TILES[d]))
    return out


def config_dtypes(args, d: int, causal: bool) -> list[str]:
    """The dtypes timed at (d, causal): ``--dtypes`` (bf16 by default), plus fp16 at d128
    causal with ``--fp16``."""
    extra = ["fp16"] if (d == 128 and causal and args.fp16) else []
    return list(dict.fromkeys(list(args.dtypes) + extra))


def all_variants(args) -> list[Variant]:
    """Every variant of the run; ``args.hopper`` (the target is sm_90) adds ``fa3-default``;
    ``args.candidates``: only :func:`candidate_variants` (and ``fa3-default``), no backward."""
    out = []
    for d in args.dims:
        for causal in (False, True):
            for dtype in config_dtypes(args, d, causal):
                if args.candidates:
                    if args.tiles:
                        out += tile_variants(
                            d, causal, dtype, args.tiles, args.flip, args.flip_only
                        )
                    else:
                        out += candidate_variants(d, causal, dtype)
                    if args.hopper:
                        out.append(Variant("fwd", "fa3-default", d, causal, dtype, family="auto"))
                    continue
                out += fwd_variants(d, causal, dtype, args.ablations, args.hopper)
                if args.bwd:
                    out += bwd_variants(d, causal, dtype, args.ablations and dtype == "bf16")
    return out


# ----------------------------------------------------------------------------- build
def build(v: Variant, target: str) -> Built:
    """Plan, render and compile ``v`` through flashgen's cache (nvcc; no GPU needed)."""
    from flashgen.build import cache
    from flashgen.build.render import render

    spec = spec_for(v.d, v.causal, v.dtype)
    opts = dict(v.options)
    if v.kind == "fwd":
        o = Options(family=v.family, fa2_fwd=fa2_fwd.Options(**opts))
        plan = plan_forward(spec, target, o, tiles=v.tiles, persistent=False)
        if v.family == "fa2" and plan.template != FA2_TEMPLATE:
            raise RuntimeError(f"{v.key}: planned {plan.template}, not the FA2-class kernel")
        cubin, rep = cache.get_or_build(render(plan), plan)
        t = plan.tiles
        tiles = f"{t.block_m}x{t.block_n}x{t.num_warps}"
    else:
        o = Options(fa2_bwd=fa2_bwd.Options(**opts))
        plan = plan_backward(spec, target, o, atomic_dq=v.atomic, tiles=v.tiles)
        cubin, rep = cache.get_or_build(render(plan.unit), plan.unit)
        t = plan.tiles
        tiles = f"n{t.dkdv_block_n}m{t.dkdv_block_m}w{t.dkdv_warps}s{t.dkdv_dsplit}"
    main = max(rep.kernels, key=lambda k: k.registers)
    template = plan.template if v.kind == "fwd" else plan.unit.template
    return Built(v, plan, str(cubin), main.registers, rep.spill_bytes, tiles, template)


def build_all(variants: list[Variant], target: str, workers: int) -> dict[str, Built]:
    """Every variant that builds, keyed and ordered like ``variants``."""
    out = {}
    with cf.ThreadPoolExecutor(workers) as pool:
        futs = {pool.submit(build, v, target): v for v in variants}
        for f in cf.as_completed(futs):
            v = futs[f]
            try:
                out[v.key] = f.result()
            except Exception as e:  # noqa: BLE001 - a variant that does not build is one row
                print(f"   BUILD FAILED {v.key}: {str(e).splitlines()[0][:200]}", flush=True)
    return {v.key: out[v.key] for v in variants if v.key in out}


# ----------------------------------------------------------------------------- launch
class Forward:
    """``(o, lse) = f(q, k, v)`` through one built forward kernel."""

    def __init__(self, b: Built, device_index: int):
        from flashgen.runtime import launch as runtime

        self.b = b
        self.kern = runtime.load(b.cubin, b.plan, device_index)
        self.spec = spec_for(b.variant.d, b.variant.causal, b.variant.dtype)

    def __call__(self, q, k, v):
        import torch

        from flashgen.ops.op import default_softmax_scale, kernel_values, validate

        dims = validate(self.spec, q, k, v, {})
        o = torch.empty((*q.shape[:3], v.shape[-1]), dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        scale = default_softmax_scale(self.spec)
        values = kernel_values(self.spec, {"q": q, "k": k, "v": v, "o": o, "lse": lse}, dims,
                               scale, (), {})  # fmt: skip
        stream = torch.cuda.current_stream(q.device).cuda_stream
        self.kern.launch(
            self.b.plan.grid(
                dims.batch,
                dims.heads_q,
                dims.seqlen_q,
                heads_kv=dims.heads_kv,
                seqlen_k=dims.seqlen_k,
            ),
            values,
            stream,
        )
        return o, lse


class Backward:
    """``(dq, dk, dv) = f(q, k, v, o, lse, do)`` through one built backward unit (the launch
    sequence of ``flashgen.ops.backward.Backward.cuda``)."""

    def __init__(self, b: Built, device_index: int):
        from flashgen.runtime import launch as runtime

        self.b = b
        self.spec = spec_for(b.variant.d, b.variant.causal, b.variant.dtype)
        self.kerns = [runtime.load(b.cubin, kp, device_index) for kp in b.plan.kernels]

    def __call__(self, q, k, v, o, lse, do):
        import torch

        from flashgen.ops.op import default_softmax_scale, kernel_values, validate

        dims = validate(self.spec, q, k, v, {})
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dsum = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
        atomic = self.b.variant.atomic
        acc = torch.empty(q.shape, dtype=torch.float32, device=q.device) if atomic else None
        tensors = {"q": q, "k": k, "v": v, "o": o, "dout": do, "lse": lse, "dsum": dsum,
                   "dq": dq, "dk": dk, "dv": dv, "dq_accum": acc}  # fmt: skip
        scale = default_softmax_scale(self.spec)
        values = kernel_values(self.spec, tensors, dims, scale, (), {})
        plan = self.b.plan
        grids = plan.grids(dims.batch, dims.heads_q, dims.heads_kv, dims.seqlen_q, dims.seqlen_k)
        stream = torch.cuda.current_stream(q.device).cuda_stream
        pre, dkdv, last = self.kerns
        pre.launch(grids["pre"], values, stream)
        dkdv.launch(grids["dkdv"], values, stream)
        last.launch(grids["convert" if atomic else "dq"], values, stream)
        return dq, dk, dv


# ----------------------------------------------------------------------------- check
def check(b: Built, device) -> dict:
    """Max error vs the fp64 reference and the bound, on CHECK_SHAPE."""
    import torch

    from flashgen.ops.reference import attention_reference

    v = b.variant
    spec = spec_for(v.d, v.causal, v.dtype)
    bsz, hq, hkv, sq, sk = CHECK_SHAPE
    gen = torch.Generator(device=device).manual_seed(v.d * 2 + v.causal)
    dt = torch.bfloat16 if v.dtype == "bf16" else torch.float16

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen).to(dt)

    q, k, val = rnd(bsz, hq, sq, v.d), rnd(bsz, hkv, sk, v.d), rnd(bsz, hkv, sk, v.d)

    def ref(dtype, grads_of=None):
        qr, kr, vr = (
            t.detach().to(dtype).requires_grad_(grads_of is not None) for t in (q, k, val)
        )
        o, lse = attention_reference(spec, qr, kr, vr, compute_dtype=dtype)
        if grads_of is None:
            return o, lse
        o.backward(grads_of.to(dtype))
        return qr.grad, kr.grad, vr.grad

    out: dict = {}
    if v.kind == "fwd":
        o, lse = Forward(b, device.index or 0)(q, k, val)
        torch.cuda.synchronize()
        r64, lse64 = ref(torch.float64)
        low, _ = ref(dt)
        err = (o.double() - r64).abs().max().item()
        bound = 2 * (low.double() - r64).abs().max().item() + 1e-3
        fin = ~torch.isneginf(lse64)
        lse_err = ((lse[fin] - lse64[fin]).abs() / (1 + lse64[fin].abs())).max().item()
        out.update(err_o=err, bound_o=bound, err_lse=lse_err)
        out["ok"] = bool(err <= bound and lse_err <= 1e-2 and not o.isnan().any())
    else:
        o, lse = ref(torch.float32)
        o, lse = o.to(dt), lse.float()
        do = rnd(*o.shape)
        grads = Backward(b, device.index or 0)(q, k, val, o, lse, do)
        torch.cuda.synchronize()
        g64 = ref(torch.float64, do)
        glow = ref(dt, do)
        ok = True
        for name, ours, r64, rlow in zip("qkv", grads, g64, glow, strict=True):
            err = (ours.double() - r64).abs().max().item()
            bound = 2 * (rlow.double() - r64).abs().max().item() + 1e-3
            out[f"err_d{name}"], out[f"bound_d{name}"] = err, bound
            ok &= err <= bound and not ours.isnan().any().item()
        out["ok"] = bool(ok)
    return out


def run_checks_child(keys: list[str], args) -> None:
    """Child process: check each variant in ``keys``, one JSON line per variant (flushed),
    preceded by a START line so the parent can tell which one crashed the process."""
    import torch

    from flashgen.ops.op import target_for_device

    dev = torch.device("cuda", 0)
    target = target_for_device(spec_for(64, False, "bf16"), dev)
    by_key = {v.key: v for v in all_variants(args)}
    for key in keys:
        print("START " + key, flush=True)
        try:
            res = check(build(by_key[key], target), dev)
        except Exception as e:  # noqa: BLE001
            res = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            if "CUDA" in str(e) or "illegal" in str(e).lower():
                print("RESULT " + json.dumps({"key": key, **res}), flush=True)
                sys.exit(3)  # the context may be poisoned: let the parent restart us
        print("RESULT " + json.dumps({"key": key, **res}), flush=True)


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def run_checks(keys: list[str], argv: list[str]) -> dict[str, dict]:
    """Run :func:`run_checks_child` in child processes until every key has a result."""
    results: dict[str, dict] = {}
    todo = list(keys)
    while todo:
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            *argv,
            "--_check-child",
            ",".join(todo),
        ]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
            out, errs, rc = p.stdout, p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:  # a hung kernel: blame the variant in progress
            out, errs, rc = _text(e.stdout), _text(e.stderr) + "\ntimed out (hang?)", "timeout"
        started = None
        for line in out.splitlines():
            if line.startswith("START "):
                started = line[6:]
            elif line.startswith("RESULT "):
                r = json.loads(line[7:])
                results[r.pop("key")] = r
                started = None
        if started is not None:  # died inside this variant
            tail = (errs.strip().splitlines() or ["(no stderr)"])[-1][:200]
            results[started] = {"ok": False, "error": f"CRASH (exit {rc}): {tail}"}
        left = [k for k in todo if k not in results]
        if len(left) == len(todo):  # no progress: give up on the rest
            print(out[-2000:], errs[-4000:], file=sys.stderr)
            for k in left:
                results[k] = {"ok": False, "error": f"check child exit {rc}, no result"}
            left = []
        todo = left
    return results


# ----------------------------------------------------------------------------- timing
def flops(d: int, causal: bool, s: int, direction: str, tokens=16384, hidden=2048) -> float:
    h = hidden // d
    f = 4 * (tokens // s) * h * s * s * d / (2 if causal else 1)
    return f * (2.5 if direction == "bwd" else 1.0)


def time_config(d, causal, dtype, s, built: dict[str, Built], checks, args, dev) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashgen.bench.runner import L2_BYTES, rotation_sets

    bsz, h = max(1, args.tokens // s), args.hidden // d
    dt = torch.bfloat16 if dtype == "bf16" else torch.float16
    per_set = 4 * bsz * h * s * d * 2  # q, k, v, do
    n = rotation_sets(per_set, L2_BYTES) if args.rotate else 1
    gen = torch.Generator(device=dev).manual_seed(s + d)
    sets = [
        tuple(torch.randn(bsz, h, s, d, device=dev, generator=gen).to(dt) for _ in range(4))
        for _ in range(n)
    ]
    state = {"i": 0}

    def nxt():
        state["i"] = (state["i"] + 1) % n
        return sets[state["i"]]

    def bench(fn, rep=args.rep) -> float:
        import triton.testing as tt

        return float(tt.do_bench(fn, warmup=args.warmup, rep=rep, return_mode="median"))

    cfg = {"d": d, "causal": causal, "dtype": dtype, "seqlen": s, "batch": bsz, "heads": h}
    rows = []

    def row(impl, direction, ms=None, err=None, b: Built | None = None):
        r = {**cfg, "impl": impl, "direction": direction}
        if ms is not None:
            fl = flops(d, causal, s, direction, bsz * s, h * d)
            r.update(ms=ms, tflops=fl / ms * 1e-9)
        if err:
            r["error"] = err
        if b is not None:
            r.update(tiles=b.tiles, registers=b.registers, spill_bytes=b.spill_bytes)
            r["options"] = dict(b.variant.options)
            r["template"] = b.template
            r["check"] = checks.get(b.variant.key, {})
        rows.append(r)

    # peers
    def err(e: BaseException) -> str:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"

    for label, backend in (("sdpa-flash", "FLASH_ATTENTION"), ("sdpa-cudnn", "CUDNN_ATTENTION")):
        with sdpa_kernel(getattr(SDPBackend, backend)):
            try:
                row(label, "fwd", bench(lambda: F.scaled_dot_product_attention(
                    *nxt()[:3], is_causal=causal)))  # fmt: skip
            except Exception as e:  # noqa: BLE001 - an unavailable backend is a row, not a crash
                row(label, "fwd", err=err(e))
            if args.bwd and dtype in args.bwd_dtypes:
                try:
                    graphs = []
                    for q, k, v, do in sets:
                        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
                        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        graphs.append((o, (q, k, v), do))
                    gi = {"i": 0}

                    def sdpa_bwd(graphs=graphs, gi=gi):
                        gi["i"] = (gi["i"] + 1) % len(graphs)
                        o, inp, do = graphs[gi["i"]]
                        torch.autograd.grad(o, inp, do, retain_graph=True)

                    row(label, "bwd", bench(sdpa_bwd, args.bwd_rep))
                except Exception as e:  # noqa: BLE001
                    row(label, "bwd", err=err(e))
                graphs = None
        torch.cuda.empty_cache()

    # ours
    fwd_default = None
    for key, b in built.items():
        v = b.variant
        if (v.d, v.causal, v.dtype) != (d, causal, dtype) or v.kind != "fwd":
            continue
        label = f"fg:{v.name}"
        if not checks.get(key, {}).get("ok"):
            row(label, "fwd", err="check failed: " + json.dumps(checks.get(key)), b=b)
            continue
        f = Forward(b, dev.index or 0)
        if v.name == "default":
            fwd_default = f
        row(label, "fwd", bench(lambda f=f: f(*nxt()[:3])), b=b)
    if args.bwd and dtype in args.bwd_dtypes and fwd_default is not None:
        saved = [(q, k, v, *fwd_default(q, k, v), do) for q, k, v, do in sets]
        si = {"i": 0}
        for key, b in built.items():
            v = b.variant
            if (v.d, v.causal, v.dtype) != (d, causal, dtype) or v.kind != "bwd":
                continue
            label = f"fg:{v.name}"
            if not checks.get(key, {}).get("ok"):
                row(label, "bwd", err="check failed: " + json.dumps(checks.get(key)), b=b)
                continue
            f = Backward(b, dev.index or 0)

            def run_bwd(f=f):
                si["i"] = (si["i"] + 1) % len(saved)
                f(*saved[si["i"]])

            row(label, "bwd", bench(run_bwd, args.bwd_rep), b=b)
        del saved
    sets.clear()
    torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- report
#: Column labels of the reports.
SHORT = {"sdpa-flash": "FA2", "sdpa-cudnn": "cuDNN", "fg:fa3-default": "fa3"}


def _cfg(r: dict) -> tuple:
    return (r["direction"], r["d"], r["causal"], r["dtype"], r["seqlen"])


def _cfg_label(cfg: tuple) -> str:
    direction, d, causal, dtype, s = cfg
    return f"{direction} d{d:<3} {'causal' if causal else 'full  '} {dtype} S={s:<5}"


def _grouped(rows: list[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in sorted(rows, key=_cfg):
        out.setdefault(_cfg(r), []).append(r)
    return out


def print_table(rows: list[dict]) -> None:
    """One line per config: every implementation's TFLOP/s (``*`` spills, ``!`` no time)."""
    print("\nTFLOP/s per config (FA2, cuDNN: SDPA backends; fa3: flashgen's Hopper kernel; "
          "the rest: flashgen's FA2-class kernel; * spills, ! failed):")  # fmt: skip
    for cfg, group in _grouped(rows).items():
        parts = []
        for r in group:
            name = SHORT.get(r["impl"], r["impl"].removeprefix("fg:"))
            if "tflops" in r:
                parts.append(f"{name} {r['tflops']:.0f}{'*' if r.get('spill_bytes') else ''}")
            else:
                parts.append(f"{name} !")
        print(f"  {_cfg_label(cfg)}  " + "  ".join(parts))


def summary(rows: list[dict]) -> None:
    """The final table: peers, the Hopper kernel, ``base``, ``default`` and the best
    spill-free FA2-class variant per config, with ratios to FA2."""

    def tf(r: dict | None) -> str:
        return f"{r['tflops']:6.0f}" if r and "tflops" in r else f"{'-':>6}"

    print(f"\n{'config':31} {'FA2':>6} {'cuDNN':>6} {'fa3':>6} {'base':>6} {'default':>7} "
          f"{'xFA2':>5}  {'best FA2-class (no spills)':30} {'xFA2':>5}")  # fmt: skip
    for cfg, group in _grouped(rows).items():
        by = {r["impl"]: r for r in group}
        fa2 = by.get("sdpa-flash", {}).get("tflops")
        dflt = by.get("fg:default") or by.get("fg:det")
        base = by.get("fg:base") or by.get("fg:det-base")
        cands = [
            r
            for r in group
            if r["impl"].startswith("fg:")
            and r["impl"] != "fg:fa3-default"
            and "tflops" in r
            and not r.get("spill_bytes")
        ]
        best = max(cands, key=lambda r: r["tflops"], default=None)

        def ratio(r, fa2=fa2):
            return f"{r['tflops'] / fa2:5.2f}" if r and "tflops" in r and fa2 else f"{'-':>5}"

        best_s = f"{best['impl'][3:]} {best.get('tiles', '')} {best['tflops']:.0f}" if best else "-"
        print(f"{_cfg_label(cfg):31} {tf(by.get('sdpa-flash'))} {tf(by.get('sdpa-cudnn'))} "
              f"{tf(by.get('fg:fa3-default'))} {tf(base)} {tf(dflt):>7} {ratio(dflt)}  "
              f"{best_s:30} {ratio(best)}")  # fmt: skip


def ratio_table(rows: list[dict]) -> None:
    """Every FA2-class variant's TFLOP/s as a ratio to FA2 per config (``*`` spills,
    ``!`` no time): the ``--candidates`` report, one column per variant."""
    fwd = [r for r in rows if r["direction"] == "fwd"]
    names = list(dict.fromkeys(r["impl"] for r in fwd if r["impl"].startswith("fg:")))
    if not names:
        return
    width = max(8, *(len(n) - 3 for n in names))
    print("\nratio to FA2 (FA2 and cuDNN in TFLOP/s):")
    print(f"{'config':31} {'FA2':>5} {'cuDNN':>5} " + " ".join(f"{n[3:]:>{width}}" for n in names))
    for cfg, group in _grouped(fwd).items():
        by = {r["impl"]: r for r in group}
        fa2 = by.get("sdpa-flash", {}).get("tflops")
        cudnn = by.get("sdpa-cudnn", {}).get("tflops")
        cells = []
        for n in names:
            r = by.get(n)
            if r is None or "tflops" not in r or not fa2:
                cells.append(f"{'!' if r is not None else '-':>{width}}")
            else:
                star = "*" if r.get("spill_bytes") else ""
                cells.append(f"{r['tflops'] / fa2:.3f}{star}".rjust(width))
        fa2_s = f"{fa2:5.0f}" if fa2 else f"{'-':>5}"
        cudnn_s = f"{cudnn:5.0f}" if cudnn else f"{'-':>5}"
        print(f"{_cfg_label(cfg):31} {fa2_s} {cudnn_s} " + " ".join(cells))


def table_winners(rows: list[dict]) -> dict[tuple, dict]:
    """``(d, causal, dtype)`` -> the fastest FA2-class forward variant there: passed its
    check, no spills, timed at every seqlen FA2 was timed at for that config, best mean
    TFLOP/s over those seqlens.  Each value: ``impl``, ``tiles``, ``options``,
    ``registers``, ``tflops`` (mean), ``fa2`` (mean), ``by_seqlen`` ({S: (ours, FA2)})."""
    fwd = [r for r in rows if r["direction"] == "fwd"]
    out = {}
    for cfg in sorted({(r["d"], r["causal"], r["dtype"]) for r in fwd}):
        group = [r for r in fwd if (r["d"], r["causal"], r["dtype"]) == cfg]
        fa2 = {
            r["seqlen"]: r["tflops"] for r in group if r["impl"] == "sdpa-flash" and "tflops" in r
        }
        seqlens = sorted(fa2)
        best = None
        for impl in dict.fromkeys(r["impl"] for r in group):
            if not impl.startswith("fg:") or impl == "fg:fa3-default":
                continue
            mine = {r["seqlen"]: r for r in group if r["impl"] == impl and "tflops" in r}
            if not seqlens or any(s not in mine for s in seqlens):
                continue
            if any(mine[s].get("spill_bytes") or not mine[s].get("check", {}).get("ok")
                   for s in seqlens):  # fmt: skip
                continue
            mean = sum(mine[s]["tflops"] for s in seqlens) / len(seqlens)
            if best is None or mean > best["tflops"]:
                r0 = mine[seqlens[0]]
                best = {
                    "impl": impl,
                    "tiles": r0["tiles"],
                    "options": r0.get("options", {}),
                    "registers": r0.get("registers"),
                    "tflops": mean,
                    "fa2": sum(fa2.values()) / len(fa2),
                    "by_seqlen": {s: (mine[s]["tflops"], fa2[s]) for s in seqlens},
                }
        if best is not None:
            out[cfg] = best
    return out


def write_table(winners: dict[tuple, dict], gpu: str, target: str, path) -> None:
    """Record each winner in the tuning table (flashgen/tuning) under its key on ``gpu``:
    tiles, the flipped template switches as ``options`` (applied with the tiles by
    ``plan_forward``), and the measurements next to FA2's."""
    from flashgen import tuning

    print(f"\ntuning table ({path or tuning.table_path()}), FA2-class winners on {gpu}:")
    for (d, causal, dtype), w in winners.items():
        m, n, nw = (int(x) for x in w["tiles"].split("x"))
        entry = {
            "block_m": m,
            "block_n": n,
            "num_warps": nw,
            "tflops": round(w["tflops"], 2),
            "date": time.strftime("%Y-%m-%d"),
            "seqlens": sorted(w["by_seqlen"]),
            "fa2_tflops": round(w["fa2"], 2),
            "vs_fa2": {str(s): round(a / b, 3) for s, (a, b) in sorted(w["by_seqlen"].items())},
            "registers": w["registers"],
            "variant": w["impl"].removeprefix("fg:"),
            "source": "tools/perf_sweep.py --write-table",
        }
        if w["options"]:
            entry["options"] = dict(w["options"])
        key = tuning.table_key(gpu, target, d, dtype, causal, False)
        tuning.update_table(key, entry, path)
        ratios = " ".join(f"S={s}: {v}" for s, v in entry["vs_fa2"].items())
        opts = f", {w['options']}" if w["options"] else ""
        print(f"  {key}: {w['impl'][3:]} ({w['tiles']}{opts}) {entry['tflops']:.1f} TFLOP/s "
              f"vs FA2 {entry['fa2_tflops']:.1f}  [{ratios}]")  # fmt: skip


def write_json(args, checks: dict, rows: list[dict], t0: float) -> None:
    from flashgen.bench.runner import environment

    try:
        env = environment()
    except Exception as e:  # noqa: BLE001 - informational only
        env = {"error": str(e)}
    doc = {
        "env": env,
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "forward_options": FORWARD_OPTIONS,
        "backward_options": BACKWARD_OPTIONS,
        "checks": checks,
        "rows": rows,
        "seconds": time.perf_counter() - t0,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1, default=str))


# ----------------------------------------------------------------------------- main
def build_only(args) -> int:
    """``--build-only TARGET``: build the run's variants (no GPU), one line each."""
    args.hopper = args.hopper and args.build_only == "sm_90"
    variants = all_variants(args)
    built = build_all(variants, args.build_only, args.workers)
    for key, b in built.items():
        print(f"{key:40} {b.tiles:14} {b.registers:4d} regs {b.spill_bytes:4d} B spilled  "
              f"{b.template}")  # fmt: skip
    spilled = [k for k, b in built.items() if b.spill_bytes]
    failed = [v.key for v in variants if v.key not in built]
    print(f"{len(built)} built for {args.build_only}, {len(spilled)} spill, "
          f"{len(failed)} failed to build")  # fmt: skip
    return 1 if spilled or failed else 0


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write every row (and the environment) here")
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--tokens", type=int, default=16384, help="batch * seqlen")
    ap.add_argument("--hidden", type=int, default=2048, help="heads * head_dim")
    ap.add_argument("--no-bwd", dest="bwd", action="store_false", help="forward only")
    ap.add_argument("--bwd-seqlens", type=int, nargs="+", default=[16384],
                    help="seqlens at which the backward is timed (default 16384)")  # fmt: skip
    ap.add_argument("--fp16", action="store_true", help="also fp16 at d128 causal")
    ap.add_argument("--dtypes", nargs="+", default=["bf16"], choices=("bf16", "fp16"),
                    help="dtypes of every config (default bf16)")  # fmt: skip
    ap.add_argument("--candidates", action="store_true",
                    help="forward tile candidates only: default, +lazy, ALT_TILES, ALT_LAZY "
                    "(no base, no switch ablations, no backward)")  # fmt: skip
    ap.add_argument("--tiles", type=parse_tiles, nargs="+", default=None, metavar="MxNxW",
                    help="with --candidates: time default and these forward tiles (e.g. "
                    "64x64x4 128x48x8) instead of ALT_TILES / ALT_LAZY")  # fmt: skip
    ap.add_argument("--flip", nargs="+", default=[], type=parse_flip, metavar="KEY[+KEY...]",
                    help="with --tiles: also every tile config with each of these "
                    "FORWARD_OPTIONS switches flipped (one at a time; keys joined by "
                    "'+' flip together, e.g. fwd_lazy_rescale+fwd_even_loads)")  # fmt: skip
    ap.add_argument("--flip-only", action="store_true",
                    help="with --tiles and --flip: the listed tiles only with their flips "
                    "(default also as it is)")  # fmt: skip
    ap.add_argument("--write-table", nargs="?", const="", default=None, metavar="PATH",
                    help="record each config's fastest checked spill-free FA2-class variant "
                    "(mean TFLOP/s over the seqlens) in the tuning table (default: "
                    "flashgen/tuning/table.json, or $FLASHGEN_TUNING_TABLE)")  # fmt: skip
    ap.add_argument("--no-fa3", dest="hopper", action="store_false",
                    help="leave out the Hopper kernel's reference row (fa3-default)")  # fmt: skip
    ap.add_argument("--no-ablations", dest="ablations", action="store_false",
                    help="only base/default forward and det/atomic backward variants")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="S=4096 only, no ablations")
    ap.add_argument("--no-rotate", dest="rotate", action="store_false")
    ap.add_argument("--warmup", type=int, default=20, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=int, default=80, help="do_bench repetition time, ms")
    ap.add_argument("--bwd-rep", type=int, default=200, help="the same for the backward")
    ap.add_argument("--workers", type=int, default=max(2, (os.cpu_count() or 4)))
    ap.add_argument("--budget", type=float, default=270.0,
                    help="seconds: no new config is timed after this (default 270)")  # fmt: skip
    ap.add_argument("--build-only", metavar="TARGET", choices=("sm_80", "sm_90"),
                    help="no GPU: build every variant for TARGET, print registers and "
                    "spills, exit 1 if any spills")  # fmt: skip
    ap.add_argument("--_check-child", dest="check_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.seqlens, args.bwd_seqlens, args.ablations = [4096], [4096], False
    if args.candidates:
        args.bwd = False
    args.bwd_dtypes = ("bf16", "fp16")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    # The FA2-class kernel on sm_90 too, for anything that asks the op (the check children
    # inherit it); the builds below also pass family= explicitly.
    os.environ["FLASHGEN_KERNEL_FAMILY"] = "fa2"
    if args.build_only:
        return build_only(args)
    import torch

    if not torch.cuda.is_available():
        print("perf_sweep needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.check_child is not None:
        run_checks_child(args.check_child.split(","), args)
        return 0
    t0 = time.perf_counter()
    from flashgen.ops.op import target_for_device

    dev = torch.device("cuda", torch.cuda.current_device())
    target = target_for_device(spec_for(64, False, "bf16"), dev)
    print(f"{torch.cuda.get_device_name(dev)}  torch {torch.__version__}  target {target}",
          flush=True)  # fmt: skip
    args.hopper = args.hopper and target == "sm_90"  # fa3-default: the Hopper kernel only
    variants = all_variants(args)
    print(f"== build {len(variants)} variants ({args.workers} nvcc workers)", flush=True)
    built = build_all(variants, target, args.workers)
    print(f"   built in {time.perf_counter() - t0:.0f}s", flush=True)
    templates: dict[str, list[str]] = {}
    for b in built.values():
        if b.variant.kind == "fwd":
            templates.setdefault(b.template, []).append(b.variant.name)
    for tpl, names in sorted(templates.items()):
        print(f"   forward {tpl}: {len(names)} builds ({', '.join(sorted(set(names)))})")
    print("== check against the fp64 reference", flush=True)
    checks = run_checks(list(built), [a for a in argv if not a.startswith("--_check")])
    for key in built:
        c = checks.get(key, {})
        if not c.get("ok"):
            print(f"   FAIL {key}: {json.dumps(c)[:300]}", flush=True)
    ok_n = sum(1 for k in built if checks.get(k, {}).get("ok"))
    print(f"   {ok_n}/{len(built)} passed ({time.perf_counter() - t0:.0f}s)", flush=True)
    print("== timing", flush=True)
    rows: list[dict] = []
    skipped = []
    for s in sorted(args.seqlens, reverse=True):  # the long sequences first: they matter most
        for d in args.dims:
            for causal in (False, True):
                for dtype in config_dtypes(args, d, causal):
                    if time.perf_counter() - t0 > args.budget:
                        skipped.append(f"S={s} d{d} causal={causal} {dtype}")
                        continue
                    sub = argparse.Namespace(**vars(args))
                    sub.bwd = args.bwd and s in args.bwd_seqlens
                    rows += time_config(d, causal, dtype, s, built, checks, sub, dev)
                    if args.json:  # partial results survive a crash later on
                        write_json(args, checks, rows, t0)
                    print(f"   S={s} d{d} causal={causal} {dtype} "
                          f"({time.perf_counter() - t0:.0f}s)", flush=True)  # fmt: skip
    rows.sort(key=lambda r: (r["direction"], r["d"], r["causal"], r["dtype"], r["seqlen"]))
    print_table(rows)
    summary(rows)
    if args.candidates:
        ratio_table(rows)
    if args.write_table is not None:
        write_table(table_winners(rows), torch.cuda.get_device_name(dev), target,
                    args.write_table or None)  # fmt: skip
    if skipped:
        print(f"\nnot timed (past --budget {args.budget:.0f}s): {'; '.join(skipped)}")
    if args.json:
        write_json(args, checks, rows, t0)
        print(f"\nwrote {args.json}")
    failed = [k for k in built if not checks.get(k, {}).get("ok")]
    print(f"\n{'OK' if not failed else 'FAILED: ' + ', '.join(failed)} "
          f"in {time.perf_counter() - t0:.0f}s", flush=True)  # fmt: skip
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
