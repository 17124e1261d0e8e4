"""``flashgen bench``: flashgen's kernels against PyTorch's attention implementations.

Protocol (the FlashAttention papers'): batch x seqlen = 16384 tokens, hidden 2048, so
``heads = 2048 / head_dim`` and ``batch = 16384 / seqlen``; seqlen 512 .. 16384, head_dim
64/128/256, causal and not, fp16 and bf16, forward and forward+backward.  Every
implementation is timed in the same process and run:

    flashgen        the generated op (specs built on the fly from a template spec text)
    sdpa_flash      torch SDPA, SDPBackend.FLASH_ATTENTION forced
    sdpa_cudnn      torch SDPA, SDPBackend.CUDNN_ATTENTION forced
    sdpa_efficient  torch SDPA, SDPBackend.EFFICIENT_ATTENTION forced
    flex            FlexAttention under torch.compile (mask/score_mod from flashgen.bench.flexmods)
    standard        eager matmul -> softmax -> matmul (materializes the seqlen^2 scores)

Times are medians of ``triton.testing.do_bench(..., return_mode="median")`` in **ms**;
inputs rotate among ``max(2, ceil(2 * 60 MB / bytes_per_set))`` buffer sets so the L2
cache never holds them.  Throughput in **TFLOP/s** by the papers' count: forward
``4 * B * H * Sq * Sk * D`` (halved when causal), backward 2.5x forward, so
forward+backward is 3.5x.  A backend that rejects a config is recorded ``unsupported``,
an out-of-memory ``oom``, a flashgen op without backward ``n/a``; nothing aborts the run.

Also measured: the matmul ceiling (bf16 8192^3 ``torch.matmul``, TFLOP/s) and the copy
ceiling (a 2 GiB device copy, **GB/s** counting read + write) for the roofline, and a
memory experiment (peak ``torch.cuda.max_memory_allocated`` in bytes vs seqlen 1k..64k,
B=1, H=16, D=128) for standard attention against flashgen.

Outputs in ``--out``: ``results.json`` (rewritten after every config, so a run cut short
still leaves its rows), ``results.md``, ``tflops.png``, ``memory.png``, ``roofline.png``,
``variants.png`` (see :mod:`flashgen.bench.report`).  Needs torch with CUDA; triton is
used for timing when present (CUDA events otherwise).
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flashgen import __version__
from flashgen.frontend import ir

#: Tokens per batch (batch * seqlen) and model width of the papers' protocol.
TOKENS = 16384
HIDDEN = 2048
#: L2 size assumed when sizing the input rotation, in bytes (H200: 60 MB).
L2_BYTES = 60 * 10**6
#: Every implementation, in table order.
IMPLS = ("flashgen", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex", "standard")
DIRECTIONS = ("fwd", "fwd_bwd")
#: Backward FLOPs relative to forward (papers' convention).
BWD_FACTOR = 2.5

SPEC_TEMPLATE = """\
name: {name}
description: bench template ({mask_desc}, head_dim {head_dim}, {dtype})
head_dim: {head_dim}
dtype: {dtype}
mask: {mask}
softmax_scale: auto
"""


# ----------------------------------------------------------------------------- configuration
@dataclass
class BenchConfig:
    """What one ``flashgen bench`` run measures.

    ``warmup_ms``/``rep_ms`` go to ``do_bench``; ``budget_s`` (0 = none) is a soft wall
    clock limit in seconds: once exceeded, remaining measurements are recorded as
    ``skipped`` and the outputs are still written.  ``rounds`` > 1 times the
    implementations of one problem in that many alternating rounds (A B C, C B A, ...) on
    the same inputs and reports each one's median over the rounds, so that a slow drift of
    the GPU's clock (it runs at its power limit) reaches every implementation alike.
    """

    dtypes: tuple[str, ...] = ("bf16", "fp16")
    head_dims: tuple[int, ...] = (64, 128, 256)
    seqlens: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)
    causal: tuple[bool, ...] = (False, True)
    directions: tuple[str, ...] = DIRECTIONS
    impls: tuple[str, ...] = IMPLS
    warmup_ms: int = 25
    rep_ms: int = 100
    memory: bool = True
    memory_seqlens: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
    variants: bool = True
    variant_specs: tuple[str, ...] = ()  # spec files; empty = the shipped specs/
    variant_seqlens: tuple[int, ...] = (1024, 4096, 16384)
    variant_directions: tuple[str, ...] = DIRECTIONS
    ceilings: bool = True
    budget_s: float = 540.0
    quick: bool = False
    rounds: int = 1

    @classmethod
    def quick_config(cls) -> BenchConfig:
        """The ``--quick`` subset (about two minutes on an H200): bf16, seqlen 1k/4k/16k,
        d64/128/256, causal and not, no EFFICIENT/flex, short timing windows, forward-only
        variants at 4k/16k."""
        return cls(
            dtypes=("bf16",),
            seqlens=(1024, 4096, 16384),
            impls=("flashgen", "sdpa_flash", "sdpa_cudnn", "standard"),
            warmup_ms=10,
            rep_ms=30,
            variant_seqlens=(4096, 16384),
            variant_directions=("fwd",),
            budget_s=300.0,
            quick=True,
        )


# ----------------------------------------------------------------------------- FLOPs, bytes
def attention_flops(
    batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool, direction
) -> float:
    """Papers' FLOP count: ``4*B*H*Sq*Sk*D``, halved for causal, x3.5 for forward+backward."""
    f = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    if causal:
        f *= 0.5
    return f * (1.0 + BWD_FACTOR) if direction == "fwd_bwd" else f


def attention_bytes(
    batch: int,
    heads: int,
    seqlen: int,
    head_dim: int,
    elt: int,
    direction: str,
    impl: str,
    causal: bool = False,
) -> float:
    """Estimated DRAM traffic in bytes, for the roofline's arithmetic intensity.

    Fused kernels: the compulsory traffic (forward reads q, k, v and writes o and the
    fp32 lse; backward also reads o, dO, lse and writes dq, dk, dv).  ``standard``
    additionally writes and reads the ``seqlen^2`` score and probability matrices
    (forward: 4 passes of ``elt`` bytes per element, plus the mask pass when causal;
    backward about twice the forward's).
    """
    t = batch * heads * seqlen * head_dim * elt
    lse = batch * heads * seqlen * 4
    b = 4 * t + lse
    if direction == "fwd_bwd":
        b += 8 * t + lse
    if impl == "standard":
        sq = batch * heads * seqlen * seqlen
        fwd = sq * elt * 4 + (sq * (2 * elt + 1) if causal else 0)
        b += fwd * (3 if direction == "fwd_bwd" else 1)
    return float(b)


def problem(seqlen: int, head_dim: int) -> tuple[int, int]:
    """``(batch, heads)`` of the protocol: ``16384 / seqlen`` and ``2048 / head_dim``."""
    return max(1, TOKENS // seqlen), max(1, HIDDEN // head_dim)


def template_spec(head_dim: int, dtype: str, causal: bool) -> ir.Spec:
    """The plain (causal or unmasked) spec the sweep builds flashgen's kernels from."""
    from flashgen.frontend.spec import loads_spec

    kind = "causal" if causal else "full"
    text = SPEC_TEMPLATE.format(
        name=f"bench_{kind}_d{head_dim}_{dtype}",
        mask_desc=kind,
        mask="causal" if causal else "null",
        head_dim=head_dim,
        dtype=dtype,
    )
    return loads_spec(text, path=f"<bench {kind} d{head_dim} {dtype}>")


def shipped_spec_paths() -> list[Path]:
    """The ``specs/*.yaml`` of the checkout (empty in an installed wheel)."""
    root = Path(__file__).resolve().parents[2] / "specs"
    return sorted(root.glob("*.yaml"))


# ----------------------------------------------------------------------------- environment
def nvidia_smi() -> dict:
    """GPU facts from ``nvidia-smi --query-gpu`` (clocks in MHz, power in W); {} if absent."""
    fields = (
        "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,"
        "power.limit,temperature.gpu,memory.total"
    )
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    line = out.strip().splitlines()[0] if out.strip() else ""
    vals = [v.strip() for v in line.split(",")]
    names = fields.split(",")
    return dict(zip(names, vals, strict=False)) if len(vals) == len(names) else {}


def environment() -> dict:
    """Versions and device facts recorded in ``results.json``."""
    import torch

    env = {
        "flashgen": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        # which flashgen kernel family the rows time (Options.family of the loaded ops: on
        # sm_90, auto = the Hopper kernel where eligible, fa2 = the FA2-class kernel everywhere)
        "kernel_family": "auto",
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import cupy

        env["cupy"] = cupy.__version__
    except ImportError:
        env["cupy"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = torch.cuda.get_device_name(0)
        env["capability"] = f"{p.major}.{p.minor}"
        env["sm_count"] = p.multi_processor_count
        env["gpu_memory_bytes"] = p.total_memory
    env["nvidia_smi"] = nvidia_smi()
    try:
        from flashgen.build.compile import nvcc_version

        env["nvcc"] = nvcc_version()
    except Exception:  # noqa: BLE001 - informational only
        env["nvcc"] = None
    return env


# ----------------------------------------------------------------------------- timing
def do_bench_ms(fn: Callable[[], object], warmup_ms: int, rep_ms: int) -> float:
    """Median milliseconds of ``fn``: ``triton.testing.do_bench`` (which also flushes L2
    between calls), or CUDA events around each call when triton is missing."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = max(1e-3, (time.perf_counter() - t0) * 1e3)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    times = []
    for _ in range(max(3, int(rep_ms / est))):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def capture_graph(call: Callable[[], object], reps: int = 10):
    """A ``torch.cuda.CUDAGraph`` of ``reps`` calls of ``call``, warmed up (3 calls) on the
    capture stream first and replayed once.  Raises what capture raises."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on the capture stream
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for _ in range(reps):
            call()
    g.replay()
    torch.cuda.synchronize()
    return g


def graph_replay_ms(g, reps: int = 10, iters: int = 5) -> float:
    """Device time per call (ms): the median over ``iters`` replays of ``g`` (a graph of
    ``reps`` calls, :func:`capture_graph`), CUDA events around each replay (no host work, no
    L2 flush between calls)."""
    import torch

    out = []
    for _ in range(iters):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        g.replay()
        t1.record()
        torch.cuda.synchronize()
        out.append(t0.elapsed_time(t1) / reps)
    return statistics.median(out)


def parse_spec_item(item: str) -> tuple[str, dict]:
    """``spec`` or ``spec:p=v,q=w`` (a shipped spec's name and scalar param overrides, as the
    A/B tools take them) -> ``(name, {p: v, ...})``; a value with a ``.`` is a float, else
    an int."""
    name, _, rest = item.partition(":")
    over = {}
    for kv in filter(None, rest.split(",")):
        k, _, v = kv.partition("=")
        over[k] = float(v) if "." in v else int(v)
    return name, over


def rotation_sets(bytes_per_set: int, l2_bytes: int = L2_BYTES) -> int:
    """Input sets to rotate: ``max(2, ceil(2 * l2_bytes / bytes_per_set))``."""
    return max(2, math.ceil(2 * l2_bytes / max(1, bytes_per_set)))


class Rotation:
    """Cycles through ``n`` input sets made by ``make()``; ``next()`` returns the next one."""

    def __init__(self, make: Callable[[], tuple], n: int):
        self.sets = [make() for _ in range(n)]
        self.i = 0

    def next(self) -> tuple:
        s = self.sets[self.i]
        self.i = (self.i + 1) % len(self.sets)
        return s


def _is_oom(e: BaseException) -> bool:
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    return "out of memory" in str(e).lower()


def _short(e: BaseException, n: int = 300) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text if len(text) <= n else text[: n - 3] + "..."


def _failed(row, e: BaseException) -> None:
    """Record exception ``e`` of a measurement in ``row`` (status and note)."""
    if isinstance(e, Unsupported):
        row.status, row.note = "unsupported", str(e)
    elif isinstance(e, NotImplementedError):
        row.status, row.note = "n/a", _short(e, 160)
    elif _is_oom(e):
        row.status, row.note = "oom", ""
    elif row.impl in _SDPA_BACKENDS and isinstance(e, RuntimeError):
        row.status, row.note = "unsupported", _short(e, 200)
    else:
        row.status, row.note = "error", _short(e)


def _free() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- implementations
class Unsupported(Exception):
    """An implementation cannot run this config (recorded, not raised to the user)."""


def standard_attention(q, k, v, causal: bool, scale: float, mask=None):
    """Eager PyTorch attention: ``softmax(q k^T * scale) v``, materializing the scores.

    ``mask`` is an optional precomputed bool ``[Sq, Sk]`` tensor, True where masked (the
    causal mask is cached by the caller so building it is not timed).
    """
    import torch

    s = torch.matmul(q * scale, k.transpose(-2, -1))
    if causal:
        if mask is None:
            sq, sk = q.shape[-2], k.shape[-2]
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
        s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v)


_FLEX = None


#: FlexAttention kernel options tried when its default Triton configs do not fit in shared
#: memory (seen on the H200 for t5_bias: "No valid triton configs ... out of resource").
FLEX_SMALL_BLOCKS = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1}


def flex_retrying_smaller_blocks(flex):
    """``flex`` (a compiled ``flex_attention``) that, when a call fails because no Triton
    config fits the GPU's shared memory, retries once with :data:`FLEX_SMALL_BLOCKS` and
    keeps those options for later calls (FlexAttention measured at a config it can run,
    rather than not at all).  Other errors propagate."""
    options: dict = {}

    def call(*args, **kwargs):
        if options:
            return flex(*args, kernel_options=dict(options), **kwargs)
        try:
            return flex(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - Inductor wraps the Triton error
            text = str(e)
            if "out of resource" not in text and "No valid triton configs" not in text:
                raise
        options.update(FLEX_SMALL_BLOCKS)
        return flex(*args, kernel_options=dict(options), **kwargs)

    call.kernel_options = options
    return call


def flex_compiled():
    """``torch.compile(flex_attention, dynamic=False)``, created once, recompile limits raised."""
    global _FLEX
    if _FLEX is None:
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        cfg = torch._dynamo.config
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), 4096))
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


_SDPA_BACKENDS = {
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
}


def make_forward(impl: str, spec: ir.Spec, seqlen_q: int, seqlen_k: int, params: dict, device):
    """``f(q, k, v) -> o`` for ``impl`` on problems of ``spec``'s semantics.

    ``params`` holds the spec's param values (tensors on ``device``).  Raises
    :class:`Unsupported` when ``impl`` cannot express the spec (e.g. SDPA with a
    score_mod) or the backend is unavailable.
    """
    import torch

    from flashgen.codegen.cuda_expr import split_causal
    from flashgen.ops.op import build_op, default_softmax_scale

    scale = default_softmax_scale(spec)
    causal, residual = split_causal(spec.mask)
    plain = residual is None and spec.score_mod is None and not spec.params
    if impl == "flashgen":
        op = build_op(spec)
        return lambda q, k, v: op.attention(q, k, v, **params)[0]
    if impl in _SDPA_BACKENDS:
        if not plain:
            raise Unsupported("SDPA has no equivalent of this mask/score_mod")
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, _SDPA_BACKENDS[impl])
        F = torch.nn.functional

        def sdpa(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
                )

        if causal and seqlen_q != seqlen_k:
            raise Unsupported("SDPA's is_causal is top-left aligned; flashgen's bottom-right")
        return sdpa
    if impl == "flex":
        try:
            from torch.nn.attention.flex_attention import create_block_mask
        except ImportError as e:
            raise Unsupported(f"no FlexAttention in this torch: {e}") from e
        from flashgen.bench.flexmods import flex_mods, mask_uses_batch_or_head

        flex = flex_retrying_smaller_blocks(flex_compiled())
        block_masks: dict = {}
        mods: dict = {}  # group (num_heads // num_heads_kv: the DSL's h_kv) -> the mods

        def run_flex(q, k, v):
            group = q.shape[1] // k.shape[1]
            if group not in mods:
                mods[group] = flex_mods(spec, seqlen_q, seqlen_k, params, group=group)
            score_mod, mask_mod = mods[group]
            key = (q.shape[0], q.shape[1], group)
            if mask_mod is not None and key not in block_masks:
                bh = mask_uses_batch_or_head(spec)
                block_masks[key] = create_block_mask(
                    mask_mod,
                    q.shape[0] if bh else None,
                    q.shape[1] if bh else None,
                    seqlen_q,
                    seqlen_k,
                    device=q.device,
                )
            return flex(
                q,
                k,
                v,
                score_mod=score_mod,
                block_mask=block_masks.get(key),
                scale=scale,
                enable_gqa=k.shape[1] != q.shape[1],
            )

        run_flex.kernel_options = flex.kernel_options  # non-empty once the retry happened
        return run_flex
    if impl == "standard":
        if plain:
            mask = None
            if causal:
                mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device).triu(
                    seqlen_k - seqlen_q + 1
                )
            return lambda q, k, v: standard_attention(q, k, v, causal, scale, mask)
        from flashgen.ops.reference import attention_reference

        def ref(q, k, v):
            return attention_reference(spec, q, k, v, params=params, compute_dtype=q.dtype)[0]

        return ref
    raise ValueError(f"unknown implementation {impl!r}; known: {', '.join(IMPLS)}")


def expressible(impl: str, spec: ir.Spec) -> bool:
    """Whether ``impl`` can compute ``spec``: SDPA only plain causal/unmasked attention."""
    from flashgen.codegen.cuda_expr import split_causal

    if impl in _SDPA_BACKENDS:
        causal, residual = split_causal(spec.mask)
        return residual is None and spec.score_mod is None and not spec.params
    return True


def flashgen_has_backward(op) -> bool | None:
    """The op's backward capability flag if it has one (``supports_backward`` /
    ``has_backward``), else None: the caller then tries ``backward`` and catches
    ``NotImplementedError``."""
    for name in ("supports_backward", "has_backward"):
        flag = getattr(op, name, None)
        if isinstance(flag, bool):
            return flag
    return None


def kept_pairs(
    spec, batch: int, heads: int, seqlen: int, params: dict, device, heads_kv: int | None = None
) -> int:
    """Number of (b, h, q, kv) pairs ``spec``'s mask keeps at ``seqlen_q = seqlen_k =
    seqlen`` with ``params``, evaluated from the mask IR (:func:`flashgen.ops.reference.eval_mask`)
    over the batch rows / heads it reads, one batch row at a time (``seqlen^2`` bytes per head
    of memory on ``device``; row ``b0`` sees ``b = b0`` and the whole params, so a mask that
    reads ``b`` directly or through a param of any shape counts each row's own pairs).
    ``batch * heads * seqlen^2`` without a mask.  ``heads_kv``: the KV heads a mask reading
    ``h_kv`` sees (default ``heads``, no GQA)."""
    from flashgen.codegen.abi import block_table_dims
    from flashgen.ops.reference import eval_mask

    if spec.mask is None:
        return batch * heads * seqlen * seqlen
    per_b, per_h = block_table_dims(spec)
    tb, th = (batch if per_b else 1), (heads if per_h else 1)
    total = 0
    for b0 in range(tb):  # one batch row at a time keeps memory at seqlen^2 bytes per head
        keep = eval_mask(
            spec, batch=1, heads_q=th, seqlen_q=seqlen, seqlen_k=seqlen, params=params,
            device=device, batch_offset=b0, heads_kv=heads_kv if per_h and heads_kv else th,
        )  # fmt: skip
        total += int(keep.sum())
    return total * (batch // tb) * (heads // th)


#: Mean document length (tokens) of the document ids the benchmark gives an int tensor param
#: along a sequence axis (document_mask's doc_q / doc_kv).
DOC_LEN = 1024


def doc_ids(batch: int, seqlen: int, mean_len: int, gen):
    """int32 ``[batch, seqlen]``: each row cut into documents of random lengths (uniform in
    [1, 2 * mean_len]), ids 0, 1, 2, ... in order (packed sequences, as document masking
    sees them).  ``gen``: a CPU ``torch.Generator``."""
    import torch

    rows = []
    for _ in range(batch):
        ids, pos, d = torch.empty(seqlen, dtype=torch.int32), 0, 0
        while pos < seqlen:
            n = int(torch.randint(1, 2 * mean_len + 1, (1,), generator=gen))
            ids[pos : pos + n] = d
            pos, d = pos + n, d + 1
        rows.append(ids)
    return torch.stack(rows)


def spec_params(
    spec: ir.Spec,
    heads: int,
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    device,
    doc_len: int = DOC_LEN,
):
    """Values for a spec's params in the benchmark: scalar defaults; ``slopes`` the ALiBi
    slopes ``2^(-8 (h+1) / H)``; other f32 tensors uniform [0, 1); i32 tensors along a
    sequence axis (``[batch, seqlen_*]`` or ``[seqlen_*]``) document ids of mean length
    ``doc_len`` (:func:`doc_ids`, one set shared by every such param, so ``doc_q`` and
    ``doc_kv`` agree where ``seqlen_q == seqlen_k``); other i32 tensors uniform [0, 16)."""
    import torch

    out: dict = {}
    sym = {
        "batch": batch,
        "num_heads": heads,
        "num_heads_kv": heads,
        "seqlen_q": seqlen_q,
        "seqlen_k": seqlen_k,
    }
    g = torch.Generator(device="cpu").manual_seed(0)
    docs = None
    for p in spec.tensor_params:
        shape = [d if isinstance(d, int) else sym[d] for d in p.shape]
        if p.ty == ir.Ty.F32:
            if p.name == "slopes" and len(shape) == 1:
                n = shape[0]
                t = torch.tensor([2.0 ** (-8.0 * (i + 1) / n) for i in range(n)])
            else:
                t = torch.rand(shape, generator=g)
        elif p.shape[-1] in ("seqlen_q", "seqlen_k") and (
            len(p.shape) == 1 or (len(p.shape) == 2 and p.shape[0] == "batch")
        ):
            if docs is None:
                docs = doc_ids(batch, max(seqlen_q, seqlen_k), doc_len, g)
            t = docs[:, : shape[-1]] if len(shape) == 2 else docs[0, : shape[-1]]
        else:
            t = torch.randint(0, 16, shape, generator=g, dtype=torch.int32)
        out[p.name] = t.contiguous().to(device)
    return out


# ----------------------------------------------------------------------------- the runner
@dataclass
class Row:
    """One measurement.  ``ms`` median milliseconds, ``tflops`` TFLOP/s, ``bytes`` the
    estimated DRAM traffic (roofline), memory rows: ``peak_bytes``/``extra_bytes``."""

    section: str  # "sweep" | "variant" | "memory"
    impl: str
    spec: str
    dtype: str
    head_dim: int
    causal: bool
    direction: str
    batch: int
    heads: int
    seqlen: int
    status: str = "ok"  # ok | unsupported | oom | n/a | error | skipped
    ms: float | None = None
    tflops: float | None = None
    flops: float | None = None
    bytes: float | None = None
    peak_bytes: int | None = None
    extra_bytes: int | None = None
    note: str = ""


@dataclass
class Progress:
    """Progress reporting: a rich bar on a terminal, one line per step otherwise."""

    total: int
    label: str = "bench"
    done: int = 0
    t0: float = field(default_factory=time.perf_counter)
    _bar: object = None
    _task: object = None

    def __enter__(self):
        if sys.stderr.isatty():
            try:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                )

                self._bar = Progress(
                    TextColumn("{task.description}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                    transient=False,
                )
                self._bar.__enter__()
                self._task = self._bar.add_task(self.label, total=self.total)
            except ImportError:
                self._bar = None
        return self

    def step(self, desc: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=f"{self.label}: {desc}")
        else:
            el = time.perf_counter() - self.t0
            print(f"[{self.done}/{self.total} {el:5.0f}s] {desc}", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)


class Bench:
    """Runs a :class:`BenchConfig` on the current CUDA device and collects :class:`Row` s."""

    def __init__(self, cfg: BenchConfig, out_dir: str | Path | None = None):
        import torch

        self.cfg = cfg
        self.out = Path(out_dir) if out_dir else None
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.rows: list[Row] = []
        self.ceilings: dict = {}
        self.compile_errors: dict[str, str] = {}
        self.kernels: dict[str, dict] = {}
        self._kept: dict[tuple, int] = {}
        self.env = environment()
        self.t0 = time.perf_counter()

    # ----------------------------------------------------------------- bookkeeping
    def over_budget(self) -> bool:
        b = self.cfg.budget_s
        return bool(b) and time.perf_counter() - self.t0 > b

    def results(self) -> dict:
        """The JSON document: environment, config, ceilings, every row."""
        return {
            "schema": "flashgen-bench/1",
            "env": self.env,
            "config": asdict(self.cfg),
            "ceilings": self.ceilings,
            "compile_errors": self.compile_errors,
            "kernels": self.kernels,
            "elapsed_s": round(time.perf_counter() - self.t0, 1),
            "rows": [asdict(r) for r in self.rows],
        }

    def save(self) -> None:
        """(Re)write ``results.json`` in the output directory (atomic)."""
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / ".results.json.tmp"
        tmp.write_text(json.dumps(self.results(), indent=1))
        os.replace(tmp, self.out / "results.json")

    # ----------------------------------------------------------------- ceilings
    def measure_ceilings(self) -> dict:
        """bf16 8192^3 matmul TFLOP/s and device-copy GB/s (read + write bytes)."""
        import torch

        n = 8192
        a = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        ms = do_bench_ms(lambda: torch.matmul(a, b), 25, 200)
        self.ceilings["matmul_bf16_tflops"] = 2 * n**3 / (ms * 1e-3) / 1e12
        self.ceilings["matmul_ms"] = ms
        a = b = None
        nbytes = 2 * 2**30
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device).fill_(1)
        dst = torch.empty_like(src)
        ms = do_bench_ms(lambda: dst.copy_(src), 25, 200)
        self.ceilings["copy_gbps"] = 2 * nbytes / (ms * 1e-3) / 1e9
        self.ceilings["copy_bytes"] = nbytes
        src = dst = None
        _free()
        return self.ceilings

    # ----------------------------------------------------------------- precompile
    def precompile(
        self, specs: list[ir.Spec], backward: set[str] = frozenset(), jobs: int | None = None
    ) -> None:
        """Compile every flashgen kernel the run needs, in parallel, before any timing.

        Forward kernels and, for the spec names in ``backward`` (when
        :func:`flashgen.families.registry.plan_backward`), the backward kernels, through the
        on-disk cache (``cache.get_or_build`` takes a per-uri file lock, so threads and
        processes compile each kernel once and the op's own build later is a cache hit).
        Tiles, registers and spills land in ``kernels``; failures in ``compile_errors``
        (the spec's flashgen rows become ``error`` rows; a failed backward only affects
        forward+backward rows, which then fail on their own).
        """
        import torch

        from flashgen.build import cache
        from flashgen.build.render import render
        from flashgen.families.registry import plan_backward, plan_forward
        from flashgen.ops.op import target_for_device

        gpu = torch.cuda.get_device_name(self.device)

        def build(job):
            spec, kind = job
            target = target_for_device(spec, self.device)
            try:
                if kind == "fwd":
                    plan = plan_forward(spec, target, gpu=gpu, persistent=False)
                    _, report = cache.get_or_build(render(plan), plan)
                    info = {
                        "tiles": [plan.tiles.block_m, plan.tiles.block_n, plan.tiles.num_warps],
                        "registers": report.registers,
                        "spill_bytes": report.spill_bytes,
                    }
                else:
                    plan = plan_backward(spec, target)
                    _, report = cache.get_or_build(render(plan.dq), plan.dq)
                    info = {
                        "bwd_registers": report.registers,
                        "bwd_spill_bytes": report.spill_bytes,
                    }
                return spec.name, kind, info, None
            except Exception as e:  # noqa: BLE001 - reported per spec
                return spec.name, kind, {}, _short(e)

        uniq = {s.name: s for s in specs}
        jobs_list = [(s, "fwd") for s in uniq.values()]
        jobs_list += [(s, "bwd") for s in uniq.values() if s.name in backward]
        workers = max(1, min(len(jobs_list), jobs or os.cpu_count() or 4))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            for name, kind, info, err in pool.map(build, jobs_list):
                self.kernels.setdefault(name, {}).update(info)
                if err and kind == "fwd":
                    self.compile_errors[name] = err
                elif err:
                    self.kernels[name]["bwd_error"] = err
        print(
            f"compiled {len(jobs_list)} flashgen kernel sources in "
            f"{time.perf_counter() - t0:.1f}s"
            + (f" ({len(self.compile_errors)} failed)" if self.compile_errors else ""),
            file=sys.stderr,
            flush=True,
        )

    def kept(self, spec: ir.Spec, batch: int, heads: int, seqlen: int, params: dict) -> int:
        """:func:`kept_pairs`, computed once per (spec, shape)."""
        key = (spec.name, batch, heads, seqlen)
        if key not in self._kept:
            self._kept[key] = kept_pairs(spec, batch, heads, seqlen, params, self.device)
        return self._kept[key]

    # ----------------------------------------------------------------- one measurement
    def prepare(
        self,
        section: str,
        impl: str,
        spec: ir.Spec,
        batch: int,
        heads: int,
        seqlen: int,
        direction: str,
        label: str | None = None,
    ) -> tuple[Row, Callable[[], object] | None]:
        """The row of one measurement and the callable to time (inputs rotated over enough
        buffers to exceed the L2), already run once (compiles, probes support); the
        callable is ``None`` when the row is final (skipped, unsupported, error, ...)."""
        import torch

        from flashgen.codegen.cuda_expr import split_causal
        from flashgen.ops.op import TORCH_DTYPE

        causal = split_causal(spec.mask)[0]
        d = spec.head_dim
        row = Row(
            section,
            impl,
            label or spec.name,
            spec.dtype,
            d,
            causal,
            direction,
            batch,
            heads,
            seqlen,
        )
        row.flops = attention_flops(batch, heads, seqlen, seqlen, d, causal, direction)
        row.bytes = attention_bytes(batch, heads, seqlen, d, 2, direction, impl, causal)
        if self.over_budget():
            row.status, row.note = "skipped", "time budget exhausted"
            return row, None
        if impl == "flashgen" and spec.name in self.compile_errors:
            row.status, row.note = "error", "compile: " + self.compile_errors[spec.name]
            return row, None
        dt = TORCH_DTYPE[spec.dtype]
        bwd = direction == "fwd_bwd"
        per_set = 3 * batch * heads * seqlen * d * 2 * (2 if bwd else 1)
        try:
            params = spec_params(spec, heads, batch, seqlen, seqlen, self.device)
            if section == "variant" and spec.mask is not None and split_causal(spec.mask)[1]:
                # a mask beyond causal: FLOPs of the kept (q, kv) pairs only
                kept = self.kept(spec, batch, heads, seqlen, params)
                row.flops = 2.0 * (d + spec.head_dim_v) * kept * (1 + BWD_FACTOR if bwd else 1)
                row.note = f"kept-pair FLOPs (density {kept / (batch * heads * seqlen**2):.3f})"
            f = make_forward(impl, spec, seqlen, seqlen, params, self.device)
            if impl == "flashgen" and bwd:
                from flashgen.ops.op import build_op

                if flashgen_has_backward(build_op(spec)) is False:
                    row.status, row.note = "n/a", "flashgen op has no backward"
                    return row, None

            def make():
                g = lambda *s: torch.randn(*s, device=self.device, dtype=dt)  # noqa: E731
                q = g(batch, heads, seqlen, d).requires_grad_(bwd)
                k = g(batch, heads, seqlen, d).requires_grad_(bwd)
                v = g(batch, heads, seqlen, d).requires_grad_(bwd)
                return (q, k, v, g(batch, heads, seqlen, d) if bwd else None)

            rot = Rotation(make, rotation_sets(per_set))
            if bwd:

                def fn():
                    q, k, v, do = rot.next()
                    o = f(q, k, v)
                    return torch.autograd.grad(o, (q, k, v), do)
            else:

                def fn():
                    q, k, v, _ = rot.next()
                    with torch.no_grad():
                        return f(q, k, v)

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fn()  # probe: compiles (flex), raises for unsupported configs
                torch.cuda.synchronize()
            return row, fn
        except Exception as e:  # noqa: BLE001 - every failure becomes a row
            _failed(row, e)
            rot = None  # noqa: F841 - drop the buffers before the next config
            _free()
            return row, None

    def time_rows(self, items: list[tuple[Row, Callable[[], object]]], rounds: int) -> None:
        """Time each prepared ``(row, fn)``: ``rounds`` alternating rounds (forward, then
        backward order, ...), ``row.ms`` the median of its rounds' ``do_bench`` medians
        (each round's ms in ``row.note``).  With more than one round, the first item runs
        once untimed before them."""
        samples: list[list[float]] = [[] for _ in items]
        live = [True] * len(items)
        if rounds > 1 and items:
            # settle: a GPU that idled while the inputs were made boosts its clock for the
            # first ~100 ms of load (it runs at its power limit after), which would favour
            # whichever implementation came first
            try:
                do_bench_ms(items[0][1], self.cfg.warmup_ms, self.cfg.rep_ms)
            except Exception:  # noqa: BLE001, S110 - its own round reports the failure
                pass
        for r in range(rounds):
            order = range(len(items)) if r % 2 == 0 else reversed(range(len(items)))
            for i in order:
                row, fn = items[i]
                if not live[i]:
                    continue
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        samples[i].append(do_bench_ms(fn, self.cfg.warmup_ms, self.cfg.rep_ms))
                except Exception as e:  # noqa: BLE001 - every failure becomes a row
                    _failed(row, e)
                    live[i] = False
        for (row, _), ms, ok in zip(items, samples, live, strict=True):
            if ok and ms:
                row.ms = statistics.median(ms)
                row.tflops = row.flops / (row.ms * 1e-3) / 1e12
                if rounds > 1:
                    note = f"median of rounds {'/'.join(f'{x:.3f}' for x in ms)} ms"
                    row.note = f"{row.note}; {note}" if row.note else note

    # ----------------------------------------------------------------- memory
    def measure_memory(self, impl: str, spec: ir.Spec, seqlen: int, direction: str) -> Row:
        """Peak ``max_memory_allocated`` (bytes) of one call at B=1, H=16 (inputs included;
        ``extra_bytes`` excludes what was allocated before the call)."""
        import torch

        from flashgen.ops.op import TORCH_DTYPE

        batch, heads, d = 1, 16, spec.head_dim
        row = Row("memory", impl, spec.name, spec.dtype, d, False, direction, batch, heads, seqlen)
        if self.over_budget():
            row.status, row.note = "skipped", "time budget exhausted"
            return row
        bwd = direction == "fwd_bwd"
        dt = TORCH_DTYPE[spec.dtype]
        q = k = v = do = None
        try:
            f = make_forward(impl, spec, seqlen, seqlen, {}, self.device)
            _free()
            g = lambda: torch.randn(batch, heads, seqlen, d, device=self.device, dtype=dt)  # noqa: E731
            q, k, v = (g().requires_grad_(bwd) for _ in range(3))
            do = g() if bwd else None
            if impl == "flashgen":  # load the kernel outside the measured window
                with torch.no_grad():
                    f(*(t[:, :, :16].detach() for t in (q, k, v)))
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if bwd:
                    o = f(q, k, v)
                    grads = torch.autograd.grad(o, (q, k, v), do)
                    del o, grads
                else:
                    with torch.no_grad():
                        f(q, k, v)
            torch.cuda.synchronize()
            row.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            row.extra_bytes = row.peak_bytes - int(base)
        except NotImplementedError as e:
            row.status, row.note = "n/a", _short(e, 160)
        except Exception as e:  # noqa: BLE001
            if _is_oom(e):
                row.status = "oom"
            else:
                row.status, row.note = "error", _short(e)
        finally:
            q = k = v = do = None
            _free()
        return row

    # ----------------------------------------------------------------- plans
    def plan(self) -> list[tuple]:
        """Every measurement of the run, as ``(kind, args)`` tuples, in execution order."""
        c = self.cfg
        work: list[tuple] = []
        for dtype in c.dtypes:
            for d in c.head_dims:
                for causal in c.causal:
                    spec = template_spec(d, dtype, causal)
                    for s in c.seqlens:
                        b, h = problem(s, d)
                        for direction in c.directions:
                            for impl in c.impls:
                                work.append(("sweep", (impl, spec, b, h, s, direction)))
        if c.memory:
            mspec = template_spec(128, "bf16", False)
            for s in c.memory_seqlens:
                for direction in c.directions:
                    for impl in ("standard", "flashgen"):
                        work.append(("memory", (impl, mspec, s, direction)))
        if c.variants:
            for spec in self.variant_specs():
                for s in c.variant_seqlens:
                    b, h = problem(s, spec.head_dim)
                    for direction in c.variant_directions:
                        for impl in c.impls:
                            if expressible(impl, spec):
                                work.append(("variant", (impl, spec, b, h, s, direction)))
        return work

    def variant_specs(self) -> list[ir.Spec]:
        """The checked specs of the variant benchmark (``variant_specs`` or specs/)."""
        from flashgen.frontend.spec import load_spec

        paths = [Path(p) for p in self.cfg.variant_specs] or shipped_spec_paths()
        return [load_spec(p) for p in paths]

    def run(self) -> dict:
        """Measure everything, saving ``results.json`` as it goes; returns the document."""
        work = self.plan()
        fg = [a for k, a in work if a[0] == "flashgen"]
        need_bwd = {a[1].name for a in fg if a[-1] == "fwd_bwd"}
        self.precompile([a[1] for a in fg], need_bwd)
        if self.cfg.ceilings:
            self.measure_ceilings()
            print(
                f"ceilings: matmul bf16 {self.ceilings['matmul_bf16_tflops']:.0f} TFLOP/s, "
                f"copy {self.ceilings['copy_gbps']:.0f} GB/s",
                file=sys.stderr,
                flush=True,
            )
        self.save()
        last_group = None
        # one round: each item probed, timed and freed before the next (the protocol of
        # before --rounds); more: a problem's implementations prepared, then timed together
        batches = self.problems(work) if self.cfg.rounds > 1 else [[item] for item in work]
        with Progress(len(work), "bench") as prog:
            for batch in batches:
                kind = batch[0][0]
                if kind == "memory":
                    rows = [self.measure_memory(*args) for _, args in batch]
                else:
                    prepared = [self.prepare(kind, *args) for _, args in batch]
                    self.time_rows([p for p in prepared if p[1] is not None], self.cfg.rounds)
                    rows = [row for row, _ in prepared]
                    prepared = None
                    _free()
                for (_, args), row in zip(batch, rows, strict=True):
                    self.rows.append(row)
                    impl, spec, s, direction = args[0], args[1], args[-2], args[-1]
                    desc = f"{kind} {impl if kind == 'memory' else spec.name} S={s} {direction}"
                    desc += f" {impl}" if kind != "memory" else ""
                    val = (
                        f"{row.tflops:.1f} TFLOP/s"
                        if row.tflops
                        else (f"{row.peak_bytes / 2**30:.2f} GiB" if row.peak_bytes else row.status)
                    )
                    prog.step(f"{desc}: {val}")
                group = (kind, batch[0][1][1].name if kind != "memory" else "memory")
                if group != last_group:
                    self.save()
                    last_group = group
        self.save()
        return self.results()

    def problems(self, work: list[tuple]) -> list[list[tuple]]:
        """``work`` cut into runs of consecutive items that time one problem (same kind, spec,
        shape and direction; each memory item alone): the implementations :meth:`run` times
        together in alternating rounds when ``rounds`` > 1 (all of them prepared first, so
        their input rotations are held at once)."""

        def problem(item: tuple) -> tuple:
            kind, args = item
            return (kind, id(item)) if kind == "memory" else (kind, args[1].name, *args[2:])

        return [list(items) for _, items in itertools.groupby(work, key=problem)]


def run_bench(cfg: BenchConfig, out_dir: str | Path) -> dict:
    """Run ``cfg``, write results.json, results.md and the plots into ``out_dir``.

    Returns the results document.  Needs a CUDA device.
    """
    from flashgen.bench import report as benchreport

    bench = Bench(cfg, out_dir)
    try:
        doc = bench.run()
    except KeyboardInterrupt:
        bench.save()
        raise
    written = benchreport.write_reports(doc, out_dir)
    for p in written:
        print(f"wrote {p}", file=sys.stderr)
    return doc
