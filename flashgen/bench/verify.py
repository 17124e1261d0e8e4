"""Checks of a spec's op against the float64 reference, and the inputs they run on.

Shared by ``flashgen build`` (its GPU verification), ``flashgen tune`` (each candidate is
checked before it is timed), ``flashgen ab`` (the accuracy rule), tools/sanitize.py and the
tests: :func:`random_inputs` / :func:`random_tensor_params` (random q, k, v and tensor
params of a spec), :func:`error_bound` (the accuracy rule: max |o - ref64| <= 2 x the error
of the same reference in the input dtype + 1e-3; fp8 specs: :func:`fp8_error_bound`),
:func:`outlier_normal` and :func:`rmse` (FlashAttention-3's Table 3 inputs and measure),
:func:`call_padded` (a varlen op called on padded inputs), :func:`verify_spec` (a GPU
check and timing of one op), and
:func:`require_cuda` (why a GPU command cannot run here; exit status :data:`NO_GPU_EXIT`).
torch is imported inside the functions.
"""

from __future__ import annotations

import math

from flashgen.frontend import ir

#: Exit status of the GPU commands (``flashgen bench``, ``tune``, ``ab``) without a CUDA GPU.
NO_GPU_EXIT = 2

#: What each GPU command can still do without a GPU (appended to :func:`require_cuda`'s text).
NO_GPU_HINTS = {
    "bench": "`flashgen bench --from-json` rebuilds reports from saved results without one",
    "tune": "`flashgen tune --compile-only` checks the candidates without one",
    "bench --training": "`--device cpu` runs the same calls on the CPU (a smoke run)",
}


def require_cuda(what: str) -> str | None:
    """None if torch sees a CUDA device, else the message saying why ``flashgen <what>``
    cannot run here (torch missing, or no device: torch's version and CUDA build named)."""
    try:
        import torch
    except ImportError:
        return f"flashgen {what} needs PyTorch with CUDA: torch is not installed."
    if not torch.cuda.is_available():
        hint = NO_GPU_HINTS.get(what)
        return (
            f"flashgen {what} needs a CUDA GPU, and torch.cuda.is_available() is false here "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}). "
            "Run it on a machine with a compute capability 8.x/9.x GPU"
            + (f"; {hint}." if hint else ".")
        )
    return None


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def random_inputs(
    spec: ir.Spec, b: int, hq: int, hkv: int, sq: int, sk: int, device, generator=None
) -> tuple:
    """Random q, k, v (spec dtype, ``torch.randn``) and tensor params for one problem
    (see :func:`random_tensor_params`)."""
    import torch

    from flashgen.ops.op import TORCH_DTYPE

    dt = TORCH_DTYPE[spec.dtype]

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=generator).to(dt)

    q = randn(b, hq, sq, spec.head_dim)
    k = randn(b, hkv, sk, spec.head_dim)
    v = randn(b, hkv, sk, spec.head_dim_v)
    sym = {"batch": b, "num_heads": hq, "num_heads_kv": hkv, "seqlen_q": sq, "seqlen_k": sk}
    return q, k, v, random_tensor_params(spec, sym, device, generator)


def random_tensor_params(spec: ir.Spec, sizes: dict, device, generator=None) -> dict:
    """Random values of ``spec``'s tensor params, shaped by ``sizes`` (shape symbol -> int).

    Float params are uniform in [0, 1).  Int params whose last axis is ``seqlen_q`` or
    ``seqlen_k`` are document ids: uniform in [0, 4), sorted along that axis (packed
    documents, so a block table has EMPTY, FULL and PARTIAL tiles); other int params are
    uniform in [0, 16).
    """
    import torch

    from flashgen.ops.op import PARAM_DTYPE

    params = {}
    for p in spec.tensor_params:
        shape = [d if isinstance(d, int) else sizes[d] for d in p.shape]
        if p.ty == ir.Ty.F32:
            params[p.name] = torch.rand(shape, device=device, generator=generator)
            continue
        doc = p.shape[-1] in ("seqlen_q", "seqlen_k")
        t = torch.randint(
            0, 4 if doc else 16, shape, device=device, generator=generator, dtype=PARAM_DTYPE[p.ty]
        )
        params[p.name] = t.sort(dim=-1).values if doc else t
    return params


def error_bound(spec: ir.Spec, q, k, v, params: dict, descales=None) -> tuple:
    """(fp64 reference o, fp64 reference lse, bound on max |o - ref|).

    The bound is 2x the error of the same reference computed in the input dtype (what
    plain PyTorch low-precision math achieves) plus 1e-3.  fp8 specs:
    :func:`fp8_error_bound` (``descales``: their ``(q_descale, k_descale, v_descale)``,
    None for 1.0).
    """
    import torch

    from flashgen.ops.cpu.reference import attention_reference

    if spec.dtype in ir.FP8_DTYPES:
        return fp8_error_bound(spec, q, k, v, params, descales)

    ref_o, ref_lse = attention_reference(spec, q, k, v, params=params, compute_dtype=torch.float64)
    low_o, _ = attention_reference(spec, q, k, v, params=params, compute_dtype=q.dtype)
    torch_err = (low_o.double() - ref_o).abs().max().item() if ref_o.numel() else 0.0
    return ref_o, ref_lse, 2 * torch_err + 1e-3


def fp8_error_bound(spec: ir.Spec, q8, k8, v8, params: dict, descales=None) -> tuple:
    """The accuracy rule of fp8 specs: (fp64 reference o, fp64 reference lse, bound on
    max |o - ref|), the reference computed on the dequantized inputs
    (:func:`flashgen.fp8.dequantize`; ``descales`` ``(q_descale, k_descale, v_descale)``
    float32 [B, Hkv], None for 1.0).

    The bound is 2x the error of the kernel's arithmetic emulated in torch, plus 1e-3: a
    float32 attention on the same dequantized inputs whose unnormalized P (in [0, 1] after
    the row max is subtracted) is rounded to e4m3 before the P V product, as the FP8 kernel
    feeds P to its FP8 GEMM (FlashAttention-3, Shah et al. 2024, section 3.3), and whose o
    is rounded to bf16 (the kernel's output dtype).  So: 2x what a float32 attention on
    the dequantized inputs achieves, plus the rounding of P to e4m3 (issue 24's rule)."""
    import torch

    from flashgen.fp8 import dequantize, round_e4m3
    from flashgen.ops.cpu.reference import attention_reference

    if descales is None:
        ones = torch.ones((k8.shape[0], k8.shape[1]), dtype=torch.float32, device=k8.device)
        descales = (ones, ones, ones)
    ins = [(x, d) for x, d in zip((q8, k8, v8), descales, strict=True)]
    ref_o, ref_lse = attention_reference(
        spec, *(dequantize(x, d, torch.float64) for x, d in ins), params=params
    )
    emu_o, _ = attention_reference(
        spec, *(dequantize(x, d, torch.float32) for x, d in ins), params=params,
        compute_dtype=torch.float32, round_p=round_e4m3,
    )  # fmt: skip
    err = (emu_o.bfloat16().double() - ref_o).abs().max().item() if ref_o.numel() else 0.0
    return ref_o, ref_lse, 2 * err + 1e-3


def outlier_normal(shape, device=None, generator=None, *, frac: float = 1e-3, std: float = 10.0):
    """FlashAttention-3's Table 3 inputs (Shah et al. 2024, section 4.3): float32 entries
    from N(0, 1), plus N(0, ``std``^2) on a random ``frac`` of them (0.1% outliers with
    standard deviation 10), the distribution on which incoherent processing
    (:func:`flashgen.fp8.quantize` with ``hadamard=True``) pays off."""
    import torch

    x = torch.randn(shape, device=device, generator=generator)
    hit = torch.rand(shape, device=device, generator=generator) < frac
    return x + hit * torch.randn(shape, device=device, generator=generator) * std


def rmse(a, b) -> float:
    """Root-mean-square of ``a - b`` (in float64): the error measure of FlashAttention-3's
    Table 3."""
    return (a.double() - b.double()).pow(2).mean().sqrt().item()


def verify_safely(spec: ir.Spec) -> dict:
    """:func:`verify_spec`, with any failure (CUDA error, bad kernel) turned into a result."""
    try:
        return verify_spec(spec)
    except Exception as e:  # report it; do not crash the build summary
        return {"spec": spec.name, "ok": False, "cases": [], "error": f"{type(e).__name__}: {e}"}


def call_padded(op, q, k, v, params):
    """``op.attention(q, k, v, **params)`` on padded ``[B, H, S, D]`` inputs; a varlen op
    gets them packed as B sequences of equal length, and its o, lse come back in the
    padded layout (``[B, Hq, Sq, Dv]``, ``[B, Hq, Sq]``)."""
    if not op.spec.varlen:
        return op.attention(q, k, v, **params)
    import torch

    b, hq, sq, _ = q.shape
    sk = k.shape[2]

    def pack(t):
        return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])

    def cu(s):
        return torch.arange(b + 1, dtype=torch.int32, device=q.device) * s

    o, lse = op.attention(pack(q), pack(k), pack(v), cu(sq), cu(sk), sq, sk, **params)
    return o.view(b, sq, hq, -1).transpose(1, 2), lse.view(hq, b, sq).transpose(0, 1)


def verify_spec(spec: ir.Spec, options=None) -> dict:
    """Check the CUDA op (bound to ``options``, a :class:`flashgen.options.Options`; default
    the defaults) against the fp64 reference and time it (needs a CUDA GPU)."""
    import torch

    from flashgen.bench.timing import do_bench_ms
    from flashgen.codegen.cuda_expr import split_causal
    from flashgen.ops.op import build_op
    from flashgen.options import DEFAULT

    op = build_op(spec, options or DEFAULT)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    cases = []
    for sq, sk in ((257, 257), (100, 257)):
        q, k, v, params = random_inputs(spec, 2, 4, 2, sq, sk, dev, gen)
        o, lse = call_padded(op, q, k, v, params)
        ref_o, ref_lse, bound = error_bound(spec, q, k, v, params)
        e = (o.double() - ref_o).abs().max().item()
        ok = math.isfinite(e) and e <= bound
        cases.append({"case": f"B=2 H=4/2 Sq={sq} Sk={sk}", "max_err": e, "bound": bound, "ok": ok})
    s = 8192 if max(spec.head_dim, spec.head_dim_v) > 128 else 16384
    q, k, v, params = random_inputs(spec, 1, 16, 16, s, s, dev, gen)
    ms = do_bench_ms(lambda: call_padded(op, q, k, v, params), warmup_ms=25, rep_ms=100)

    d_sum = spec.head_dim + spec.head_dim_v  # Q K^T costs 2·S²·D, P V costs 2·S²·Dv
    flops = 2 * s * s * 16 * d_sum * (0.5 if split_causal(spec.mask)[0] else 1.0)
    return {
        "spec": spec.name,
        "ok": all(c["ok"] for c in cases),
        "cases": cases,
        "bench_case": f"B=1 H=16 S={s}",
        "ms": ms,
        "tflops": flops / (ms * 1e-3) / 1e12,
    }
