"""The fp8 (e4m3) Hopper forward kernel launched directly (plan -> nvcc -> launch), against a
float64 attention on the dequantized inputs (needs an sm_90 GPU: ``pytest -m gpu``).

The kernel computes with e4m3 q, k, v, descales folded into the softmax scale and the output,
and P rounded to e4m3 before P V (FlashAttention-3, section 3.3).  Accuracy rule (issue: FP8):
max|o - ref64| <= 2 * (max|ref32 - ref64| + max|refP8 - ref64|) + 2e-3, where ref64 / ref32 run
the spec's reference in float64 / float32 on the dequantized inputs and refP8 is ref64 with the
unnormalized probabilities rounded to e4m3 before P V (the kernel's one extra rounding).  lse
(natural log, of the dequantized logits) within 1e-3 relative + 1e-3.  Outputs are poisoned
(NaN) before each launch; inputs are fresh N(0, 1) draws, lengths not tile multiples, Sq != Sk,
GQA, (B, S, H, D) views and per-[B, Hkv] descales != 1.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from flashgen.families.build import build_forward  # noqa: E402
from flashgen.frontend.spec import load_spec  # noqa: E402
from flashgen.ops.calls import current_stream_ptr, kernel_values  # noqa: E402
from flashgen.ops.cpu.reference import attention_reference  # noqa: E402
from flashgen.ops.validation import Dims  # noqa: E402

pytestmark = pytest.mark.gpu

SPECS = Path(__file__).resolve().parents[2] / "specs"
E4M3 = getattr(torch, "float8_e4m3fn", None)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(autouse=True)
def _needs_hopper():
    if not _hopper():
        pytest.skip("the fp8 forward runs on sm_90 only")


_KERNELS: dict = {}


def fp8_spec(name: str, head_dim: int | None = None):
    spec = replace(load_spec(SPECS / f"{name}.yaml"), dtype="fp8_e4m3")
    if head_dim:
        spec = replace(spec, head_dim=head_dim, head_dim_v=head_dim)
    return spec


def kernel(spec, probes=frozenset(), stages=None):
    """The loaded fp8 kernel of ``spec`` (``probes``: :data:`flashgen.build.render.PROBES`
    names, ``stages``: the ring depth, for tools that time variants)."""
    from flashgen.build.compile import compile_source
    from flashgen.build.render import render
    from flashgen.families import hopper_fwd
    from flashgen.runtime import launch

    key = (spec.name, spec.head_dim, probes, stages)
    if key not in _KERNELS:
        plan, cubin, _ = build_forward(spec, "sm_90", gpu=torch.cuda.get_device_name())
        if probes or stages:
            if stages:
                plan = hopper_fwd.plan(spec, "sm_90", stages=stages)
            cubin = Path(f"{cubin}.{'-'.join(sorted(probes))}.{stages}")
            compile_source(render(plan, probes=probes), plan, cubin)
        _KERNELS[key] = launch.load(cubin, plan, torch.cuda.current_device())
    return _KERNELS[key]


def run_fp8(spec, q8, k8, v8, qd, kd, vd, scale, params, sync=True, probes=frozenset(),
            stages=None):
    """o (bf16), lse (float32) of the fp8 kernel; outputs poisoned first."""
    b, hq, sq, _ = q8.shape
    hkv, sk = k8.shape[1], k8.shape[2]
    o = torch.full((b, hq, sq, spec.head_dim_v), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((b, hq, sq), float("nan"), device="cuda", dtype=torch.float32)
    dims = Dims(b, hq, hkv, sq, sk, spec.head_dim_v)
    scalars = [params.get(p.name, p.default) for p in spec.scalar_params]
    values = kernel_values(spec, {"q": q8, "k": k8, "v": v8, "o": o, "lse": lse}, dims, scale,
                           scalars, {})  # fmt: skip
    values.update(q_descale=qd.contiguous(), k_descale=kd.contiguous(), v_descale=vd.contiguous())
    kern = kernel(spec, probes, stages)
    grid = kern.plan.grid(b, hq, sq, heads_kv=hkv, seqlen_k=sk)
    kern.launch(grid, values, current_stream_ptr(q8.device))
    if sync:
        torch.cuda.synchronize()
    return o, lse


def quantize(x, descale_shape, group):
    """e4m3 x and its per-[B, Hkv] descale (amax / 448 over each kv head's group of heads)."""
    b, h = x.shape[:2]
    amax = x.abs().reshape(b, h // group, -1).amax(-1).clamp_min(1e-6)
    d = (amax / 448.0).float()
    xs = x / d.repeat_interleave(group, 1)[..., None, None]
    return xs.to(E4M3), d.reshape(descale_shape)


def dequant(x8, d, group):
    return x8.double() * d.double().repeat_interleave(group, 1)[..., None, None]


def p8_reference(spec, q, k, v, scale, params):
    """ref64 with the unnormalized probabilities exp(x - rowmax) rounded to e4m3 before P V."""
    b, hq, sq, _ = q.shape
    sk = k.shape[2]
    eye = torch.eye(sk, dtype=torch.float64, device=q.device).expand(b, k.shape[1], sk, sk)
    p, _ = attention_reference(spec, q, k, eye, softmax_scale=scale, params=params)  # o = P
    top = p.amax(-1, keepdim=True)
    e = torch.where(top > 0, p / top.clamp_min(1e-300), torch.zeros_like(p))
    e8 = e.to(E4M3).double()
    denom = e.sum(-1, keepdim=True)
    vv = v.repeat_interleave(hq // v.shape[1], 1)
    return torch.where(denom > 0, (e8 @ vv) / denom.clamp_min(1e-300), torch.zeros_like(denom))


#: Scalar params that make the mask bite at the test lengths.
OVERRIDES = {
    "mistral_swa": {"window": 300}, "chunked_local": {"chunk": 256}, "prefix_lm": {"prefix": 300},
}

CASES = [
    # spec, head_dim, B, Hq, Hkv, Sq, Sk
    ("causal_d128", None, 2, 4, 2, 1000, 1000),
    ("causal_d128", None, 1, 8, 2, 127, 4097),
    ("causal_d128", None, 1, 2, 1, 1, 17),
    ("causal_d128", 64, 2, 4, 4, 1000, 1000),
    ("causal_d128", 256, 1, 4, 2, 1000, 1000),
    ("bidir_d256", None, 1, 2, 1, 17, 4097),
    ("gpt2_d64", None, 1, 4, 4, 4097, 127),
    ("llama3_gqa", None, 1, 8, 2, 1000, 1000),
    ("mistral_swa", None, 1, 4, 2, 1000, 4097),
    ("alibi", None, 1, 4, 4, 1000, 1000),
    ("gemma2_softcap", None, 1, 4, 2, 1000, 1000),
    ("chunked_local", None, 1, 2, 2, 1000, 1000),
    ("prefix_lm", None, 1, 2, 2, 1000, 1000),
    ("t5_bias", None, 1, 2, 2, 127, 1000),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c if x))
def test_fp8_forward_matches_dequantized_reference(case):
    name, hd, b, hq, hkv, sq, sk = case
    spec = fp8_spec(name, hd)
    if spec.tensor_params:
        pytest.skip("tensor params: covered through the op")
    d = spec.head_dim
    g = torch.Generator(device="cuda").manual_seed(hash(case) % 2**31)
    # (B, S, H, D) views: the kernel reads through strides
    q = torch.randn(b, sq, hq, d, device="cuda", generator=g).transpose(1, 2)
    k = torch.randn(b, sk, hkv, d, device="cuda", generator=g).transpose(1, 2)
    v = torch.randn(b, sk, hkv, d, device="cuda", generator=g).transpose(1, 2)
    group = hq // hkv
    q8, qd = quantize(q, (b, hkv), group)
    k8, kd = quantize(k, (b, hkv), 1)
    v8, vd = quantize(v, (b, hkv), 1)
    qx, kx, vx = dequant(q8, qd, group), dequant(k8, kd, 1), dequant(v8, vd, 1)
    scale = spec.softmax_scale or 1.0 / math.sqrt(d)
    params = {p.name: p.default for p in spec.scalar_params} | OVERRIDES.get(name, {})
    o, lse = run_fp8(spec, q8, k8, v8, qd, kd, vd, scale, params)
    ref64, lse64 = attention_reference(spec, qx, kx, vx, softmax_scale=scale, params=params)
    ref32, _ = attention_reference(spec, qx.float(), kx.float(), vx.float(), softmax_scale=scale,
                                   params=params, compute_dtype=torch.float32)  # fmt: skip
    refp8 = p8_reference(spec, qx, kx, vx, scale, params)
    err = (o.double() - ref64).abs().max().item()
    bound = 2 * ((ref32.double() - ref64).abs().max().item()
                 + (refp8 - ref64).abs().max().item()) + 2e-3  # fmt: skip
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert err <= bound, f"max err {err:.3e} > bound {bound:.3e}"
    live = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse), live)
    lerr = (lse.double()[live] - lse64[live]).abs()
    assert (lerr <= 1e-3 * lse64[live].abs() + 1e-3).all(), lerr.max().item()
