"""Per-block descales of fp8 ops (issue 41): ``flashgen.fp8.quantize(block_rows=128)`` (one
descale per 128 rows of each head of q, k and v: shapes, round trip, errors), ``dequantize``
of that form, the op's validation and CPU path with per-block descales against float64
attention on the dequantized inputs (the broadcast of the other forms into it, the
registered operator and its fake implementation), the kernel the op picks for them (without a
GPU), and FlashAttention-3's Table 3 RMSE at head_dim 64 without Hadamard in the torch
emulation of the kernel's arithmetic.  The kernel's compile checks are in
test_fp8_compile.py, its GPU tests in tests/gpu/test_fp8_gpu.py."""

from __future__ import annotations

import math

import pytest
import torch

from flashgen import OpInputError, fp8
from flashgen.bench.verify import fp8_error_bound, outlier_normal
from flashgen.frontend.spec import loads_spec
from flashgen.ops.cpu.reference import attention_reference
from flashgen.ops.op import build_op

E4M3 = torch.float8_e4m3fn
ROWS = fp8.BLOCK_ROWS

SPEC = """\
name: {name}
head_dim: {d}
dtype: fp8_e4m3
mask: {mask}
"""


def spec_of(name="fp8_block", d=64, mask="causal", extra=""):
    return loads_spec(SPEC.format(name=name, d=d, mask=mask) + extra, f"{name}.yaml")


@pytest.fixture(scope="module")
def op():
    return build_op(spec_of("fp8_block_d64"))


def blocky(b, h, s, d, g, spread=3.0):
    """N(0, 1) rows whose 128-row blocks are scaled by 10^U(-spread, spread): per-block
    descales that differ by orders of magnitude within a head."""
    x = torch.randn(b, h, s, d, generator=g)
    n = fp8.block_count(s)
    scale = 10.0 ** ((torch.rand(b, h, n, generator=g) * 2 - 1) * spread)
    return x * scale.repeat_interleave(ROWS, dim=2)[:, :, :s, None]


def deq64(q8, k8, v8, qd, kd, vd):
    return tuple(fp8.dequantize(x, s, torch.float64) for x, s in ((q8, qd), (k8, kd), (v8, vd)))


# ----------------------------------------------------------------------------- quantize
@pytest.mark.parametrize("sq, sk", [(300, 257), (128, 1), (1, 129), (0, 5)])
def test_quantize_per_block_shapes_and_round_trip(sq, sk):
    g = torch.Generator().manual_seed(sq + sk)
    b, hq, hkv = 2, 4, 2
    q, k, v = blocky(b, hq, sq, 64, g), blocky(b, hkv, sk, 64, g), blocky(b, hkv, sk, 32, g)
    q8, k8, v8, qd, kd, vd = fp8.quantize(q, k, v, block_rows=128)
    want = {id(qd): [b, hq, -(-sq // 128)], id(kd): [b, hkv, -(-sk // 128)],
            id(vd): [b, hkv, -(-sk // 128)]}  # fmt: skip
    for x, x8, s in ((q, q8, qd), (k, k8, kd), (v, v8, vd)):
        assert x8.dtype == E4M3 and x8.shape == x.shape and x8.is_contiguous()
        assert s.dtype == torch.float32 and list(s.shape) == want[id(s)] and s.is_contiguous()
        if x.numel() == 0:
            continue
        back = fp8.dequantize(x8, s)
        step = s.repeat_interleave(ROWS, dim=2)[:, :, : x.shape[2], None] * 2.0**-9
        # e4m3: half an ulp is 2^-4 relative, the subnormal step 2^-9 (in descale units)
        assert ((back - x).abs() <= x.abs() * 2.0**-4 + step / 2 + 1e-30).all()
        # each block of each head on its own: its largest magnitude maps onto 448
        n = s.shape[2]
        pad = torch.nn.functional.pad(x.abs().amax(-1), (0, n * ROWS - x.shape[2]))
        amax = pad.view(*s.shape, ROWS).amax(-1)
        torch.testing.assert_close(s, amax / 448)
        top = torch.nn.functional.pad(x8.float().abs().amax(-1), (0, n * ROWS - x.shape[2]))
        assert torch.equal(top.view(*s.shape, ROWS).amax(-1), torch.full(s.shape, 448.0))


def test_quantize_per_block_scales_each_query_head_and_zero_blocks():
    """q's descales are per query head (not per kv head's group, as in the [B, Hkv] form);
    an all-zero block keeps descale 1 and zeros."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 256, 64, generator=g)
    k = torch.randn(1, 2, 256, 64, generator=g)
    v = torch.randn(1, 2, 256, 64, generator=g)
    q[:, 3, 128:] *= 100
    v[:, 1, :128] = 0
    _, _, v8, qd, _, vd = fp8.quantize(q, k, v, block_rows=128)
    assert qd[0, 3, 1] > 50 * qd[0, 2, 1] and qd[0, 3, 1] > 50 * qd[0, 3, 0]
    assert vd[0, 1, 0] == 1.0 and not v8[0, 1, :128].float().any()


def test_quantize_per_block_with_hadamard_keeps_qk():
    g = torch.Generator().manual_seed(2)
    q, k, v = (outlier_normal((1, 2, 200, 128), generator=g) for _ in range(3))
    q8, k8, v8, qd, kd, vd = fp8.quantize(q, k, v, hadamard=True, block_rows=128,
                                          generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert list(qd.shape) == [1, 2, 2] and list(kd.shape) == [1, 2, 2]
    qf, kf = fp8.dequantize(q8, qd, torch.float64), fp8.dequantize(k8, kd, torch.float64)
    qk, qk_rot = q.double() @ k.double().transpose(-1, -2), qf @ kf.transpose(-1, -2)
    assert (qk_rot - qk).abs().max() < 0.05 * qk.abs().max()


@pytest.mark.parametrize("bad", [64, 256, 0, -128, True, 128.0, "128"])
def test_quantize_block_rows_errors(bad):
    z, zk = torch.zeros(1, 2, 4, 64), torch.zeros(1, 1, 4, 64)
    with pytest.raises(OpInputError, match=r"^block_rows: expected None \(one descale per "
                       r"\[batch, kv head\]\) or 128 .*got " + repr(bad).replace(".", r"\.")):
        fp8.quantize(z, zk, zk, block_rows=bad)


@pytest.mark.parametrize(
    "descale, match",
    [
        (torch.ones(2, 4, 2), r"descale: expected the per-block shape \[batch, heads, "
                              r"ceil\(seqlen / 128\)\] = \[2, 4, 3\] \(x8's\), got \[2, 4, 2\]"),
        (torch.ones(2, 2, 3), r"per-block shape .* = \[2, 4, 3\] .*got \[2, 2, 3\]"),
        (torch.ones(2, 4, 3, 1), r"descale: expected shape \[batch, heads_kv\] .* or the "
                                 r"per-block \[batch, heads, ceil\(seqlen / 128\)\] = \[2, 4, 3\]"),
    ],
)  # fmt: skip
def test_dequantize_per_block_errors(descale, match):
    with pytest.raises(OpInputError, match=match):
        fp8.dequantize(torch.zeros(2, 4, 300, 64), descale)


def test_dequantize_per_block_is_row_block_scaling():
    x8 = torch.randn(1, 2, 260, 64).to(E4M3)
    d = torch.tensor([[[2.0, 3.0, 5.0], [7.0, 11.0, 13.0]]])
    got = fp8.dequantize(x8, d, torch.float64)
    rows = torch.arange(260) // 128
    want = x8.double() * d.double()[0][:, rows][None, :, :, None]
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------- the op on CPU
@pytest.mark.parametrize(
    "b, hq, hkv, sq, sk, mask",
    [(2, 4, 2, 300, 257, "causal"), (1, 2, 1, 1, 129, "causal"), (1, 3, 3, 129, 1, "null"),
     (2, 8, 1, 130, 400, "null")],
)  # fmt: skip
def test_cpu_op_with_per_block_descales_matches_float64(b, hq, hkv, sq, sk, mask):
    spec = spec_of(f"fp8_block_{mask}", mask=mask)
    op = build_op(spec)
    g = torch.Generator().manual_seed(sq * 3 + sk)
    # blocks 10^+-1 apart (logits up to ~1e4: float32's lse within 1e-5 relative)
    q, k, v = (blocky(b, h, s, 64, g, spread=1.0) for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
    q8, k8, v8, qd, kd, vd = fp8.quantize(q, k, v, block_rows=128)
    o, lse = op.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    ref, ref_lse = attention_reference(spec, *deq64(q8, k8, v8, qd, kd, vd))
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    scale = ref.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    assert ((o.double() - ref).abs() <= 2**-7 * scale + 1e-30).all()  # bf16 rounding of o
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert torch.allclose(lse.double()[fin], ref_lse[fin], rtol=1e-5, atol=1e-4)
    # fp8_error_bound (the GPU tests' rule) takes the per-block form too
    ref_o, _, bound = fp8_error_bound(spec, q8, k8, v8, {}, (qd, kd, vd))
    assert torch.equal(ref_o, ref) and (o.double() - ref).abs().max() <= bound


def test_other_forms_broadcast_into_the_per_block_form(op):
    """Once one descale is 3-D, a [B, Hkv] q descale (repeated over each kv head's query
    heads), a [B, Hkv] k descale, a float, a one-element tensor and None (1.0) join it."""
    g = torch.Generator().manual_seed(4)
    b, hq, hkv, sq, sk = 2, 4, 2, 200, 300
    q8, k8, v8, qd, kd, vd = fp8.quantize(blocky(b, hq, sq, 64, g), blocky(b, hkv, sk, 64, g),
                                          blocky(b, hkv, sk, 64, g), block_rows=128)  # fmt: skip
    qkv = torch.rand(b, hkv, generator=g) + 0.5
    cases = [
        (dict(q_descale=qkv, k_descale=kd, v_descale=vd),
         (qkv.repeat_interleave(2, 1)[..., None].expand(b, hq, 2), kd, vd)),
        (dict(q_descale=qd, k_descale=qkv, v_descale=0.25),
         (qd, qkv[..., None].expand(b, hkv, 3), torch.full((b, hkv, 3), 0.25))),
        (dict(q_descale=qd, k_descale=torch.tensor([0.5]), v_descale=None),
         (qd, torch.full((b, hkv, 3), 0.5), torch.ones(b, hkv, 3))),
    ]
    for given, full in cases:
        o, lse = op.attention(q8, k8, v8, **given)
        o2, lse2 = op.attention(q8, k8, v8, q_descale=full[0].contiguous(),
                                k_descale=full[1].contiguous(), v_descale=full[2].contiguous())
        assert torch.equal(o, o2) and torch.equal(lse, lse2)


def test_per_block_descales_equal_to_the_kv_form_give_its_result(op):
    """Per-block descales that repeat a [B, Hkv] descale are that descale (the CPU op
    dequantizes both the same way)."""
    g = torch.Generator().manual_seed(5)
    q8, k8, v8, qd, kd, vd = fp8.quantize(torch.randn(1, 4, 150, 64, generator=g),
                                          *(torch.randn(1, 2, 260, 64, generator=g)
                                            for _ in range(2)))  # fmt: skip
    o, lse = op.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    qb = qd.repeat_interleave(2, 1)[..., None].expand(1, 4, 2).contiguous()
    kb, vb = (x[..., None].expand(1, 2, 3).contiguous() for x in (kd, vd))
    ob, lseb = op.attention(q8, k8, v8, q_descale=qb, k_descale=kb, v_descale=vb)
    assert torch.equal(o, ob) and torch.equal(lse, lseb)


def test_the_registered_op_takes_the_per_block_form(op):
    """``torch.ops.flashgen.<name>`` takes all three per block (q_descale 3-D decides), refuses
    a mixture, and its fake implementation checks the shapes."""
    g = torch.Generator().manual_seed(6)
    q8, k8, v8, qd, kd, vd = fp8.quantize(torch.randn(2, 4, 9, 64, generator=g),
                                          *(torch.randn(2, 2, 140, 64, generator=g)
                                            for _ in range(2)), block_rows=128)  # fmt: skip
    o, lse = op.torch_op(q8, k8, v8, 0.125, qd, kd, vd)
    o2, lse2 = op.attention(q8, k8, v8, softmax_scale=0.125, q_descale=qd, k_descale=kd,
                            v_descale=vd)  # fmt: skip
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    with pytest.raises(OpInputError, match=r"k_descale: expected shape the per-block "
                       r"\[batch, heads_kv, ceil\(seqlen_k / 128\)\] = \[2, 2, 2\].*got \[2, 2\]"):
        op.torch_op(q8, k8, v8, 0.125, qd, kd[..., 0], vd)
    with pytest.raises(OpInputError, match=r"v_descale: expected shape \[batch, heads_kv\] "
                       r"= \[2, 2\] \(k's\), got \[2, 2, 2\]"):
        op.torch_op(q8, k8, v8, 0.125, torch.ones(2, 2), kd[..., 0].contiguous(), vd)
    with pytest.raises(OpInputError, match="v_descale: expected finite positive"):
        op.torch_op(q8, k8, v8, 0.125, qd, kd, -vd)
    meta = [t.to("meta") for t in (q8, k8, v8, qd, kd, vd)]
    o, lse = op.torch_op(*meta[:3], 0.125, *meta[3:])
    assert o.shape == (2, 4, 9, 64) and o.device.type == "meta"
    with pytest.raises(OpInputError, match=r"q_descale: expected shape the per-block"):
        op.torch_op(*meta[:3], 0.125, meta[3][:, :, :0], *meta[4:])


def test_cuda_calls_with_per_block_descales_ask_for_their_kernel(op, monkeypatch):
    """The op's CUDA forward asks :meth:`kernel` for the per-block kernel exactly when the
    descales are per block, and ``kernel(block_descale=True)`` builds that plan once per
    device (keyed apart from the [B, Hkv] kernel); no GPU needed."""
    from flashgen.families import build as family_build
    from flashgen.ops.prefill import attention_kernels
    from flashgen.runtime import launch

    built = []

    def fake_build(spec, target, gpu=None, options=None, persistent=False, sparse=False,
                   block_descale=False):  # fmt: skip
        from flashgen.families import registry

        plan = registry.plan_forward(spec, target, options, block_descale=block_descale)
        built.append(plan.kernel_name)
        return plan, "x.cubin", None

    monkeypatch.setattr(family_build, "build_forward", fake_build)
    monkeypatch.setattr(launch, "load", lambda cubin, plan, index: ("loaded", plan.kernel_name))
    monkeypatch.setattr(attention_kernels, "target_for_device", lambda spec, device: "sm_90")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    dev = torch.device("cuda", 0)
    op._kernels.clear()
    try:
        k_bd = op.kernel(dev, block_descale=True)
        assert k_bd == ("loaded", "flashgen_fp8_block_d64_fwd_sm_90_bd")
        assert op.kernel(dev, block_descale=True) is k_bd and len(built) == 1
        k = op.kernel(dev)
        assert k == ("loaded", "flashgen_fp8_block_d64_fwd_sm_90") and len(built) == 2
    finally:
        op._kernels.clear()
    asked = []
    monkeypatch.setattr(type(op), "kernel", lambda self, device, sparse=False,
                        block_descale=False: asked.append(block_descale) or 1 / 0)  # fmt: skip
    q8, k8, v8, qd, kd, vd = fp8.quantize(*(torch.randn(1, 2, 5, 64) for _ in range(3)),
                                          block_rows=128)  # fmt: skip
    from flashgen.ops.validation import resolve_descales, validate

    dims = validate(op.spec, q8, k8, v8, {})
    for given, want in (((qd, kd, vd), True), ((qd[..., 0], kd[..., 0], None), False)):
        ds = resolve_descales(op.spec, dict(zip(("q_descale", "k_descale", "v_descale"), given,
                                                strict=True)), dims, q8.device)  # fmt: skip
        with pytest.raises(ZeroDivisionError):
            op._forward(q8, k8, v8, dims, 0.125, [], {}, None, ds)
        assert asked[-1] is want


def test_plans_refuse_per_block_descales_outside_fp8():
    from flashgen.families import registry

    bf16 = loads_spec("name: b\nhead_dim: 64\ndtype: bf16\nmask: causal\n")
    with pytest.raises(ValueError, match="per-block descales are an input of fp8 specs only"):
        registry.plan_forward(bf16, "sm_90", block_descale=True)
    with pytest.raises(ValueError, match="fp8 Hopper forward only"):
        registry.plan_forward(bf16, "sm_80", block_descale=True)


# ----------------------------------------------------------------------------- Table 3
def table3_rmse(d, s, heads, seed, *, forms=(128,), hadamard=False):
    """FlashAttention-3's Table 3 protocol (Shah et al. 2024, section 4.3) in the torch
    emulation of the fp8 kernel (test_fp8.py's): q, k, v from N(0, 1) with 0.1% outliers of
    std 10, quantized, attention in float32 on the dequantized inputs with P rounded to e4m3
    before the P V product and o to bf16, RMSE against float64 attention on the unquantized
    inputs; one head at a time (memory), the RMSE over all of them, one per quantization
    form in ``forms`` (``block_rows`` values: 128 per block, None per [B, Hkv])."""
    spec = spec_of("t3", d=d, mask="null")
    g = torch.Generator().manual_seed(seed)
    sq_err = [0.0] * len(forms)
    for _ in range(heads):
        q, k, v = (outlier_normal((1, 1, s, d), generator=g) for _ in range(3))
        ref, _ = attention_reference(spec, q.double(), k.double(), v.double())
        for i, rows in enumerate(forms):  # the same rotation for every form
            signs = torch.Generator().manual_seed(seed)
            q8, k8, v8, qd, kd, vd = fp8.quantize(q, k, v, hadamard=hadamard, generator=signs,
                                                  block_rows=rows)  # fmt: skip
            deq = [fp8.dequantize(x, ds) for x, ds in ((q8, qd), (k8, kd), (v8, vd))]
            o, _ = attention_reference(spec, *deq, compute_dtype=torch.float32,
                                       round_p=fp8.round_e4m3)  # fmt: skip
            sq_err[i] += (o.bfloat16().double() - ref).pow(2).sum().item()
    return [math.sqrt(e / (heads * s * d)) for e in sq_err]


@pytest.mark.parametrize("d", [64, 128, 256])
def test_table3_rmse_per_block_without_hadamard(d):
    """Issue 41: at 4096 tokens (the GPU test's middle length, where the [B, Hkv] form
    measures 3.0-3.3e-2 on an H100 at head_dim 64) per-block descales bring the emulated
    RMSE without Hadamard under FlashAttention-3's 3e-2 at every head dim; at head_dim 64
    (3.05e-2 -> 2.49e-2 here; 3.08e-2 -> 2.37e-2 over 4 heads) well below the [B, Hkv]
    form's.  Two heads (independent draws) at every head dim: the RMSE over 4096 x 64 x 2
    elements moves by a few percent from 2 heads to 4."""
    s, heads = (4096, 2) if d == 64 else (2048, 2)
    per_block, per_head = table3_rmse(d, s, heads, seed=d, forms=(128, None))
    assert per_block <= 3e-2, (d, per_block, per_head)
    if d == 64:  # (at 128 and 256 the two are close: the block's outliers are fewer there)
        assert per_block < 0.9 * per_head, (d, per_block, per_head)


def test_table3_rmse_per_block_with_hadamard_d128():
    """With Hadamard the per-block form keeps issue 24's 1e-2 at head_dim 128."""
    (got,) = table3_rmse(128, 1024, 2, seed=7, hadamard=True)
    assert got <= 1e-2, got
