"""Issue 37 on the GPU: trainable params and attention sinks through the CUDA op, against the
float64 reference built from the same IR (CPU-side: tests/unit/test_param_grads.py and
tests/unit/test_sinks.py).  Hq = 8 over Hkv = 2, lengths that are not tile multiples, Sq != Sk,
(B, S, H, D) storage viewed as [B, H, S, D].

dparam on CUDA runs the blocked torch backward on the GPU for now (ParamGradFallbackWarning,
fp32 accumulation: atol 2e-2 relative to the largest gradient element); sinks run as the op's
epilogue over the kernels' keys-only result (flashgen/ops/sink.py).

    python3 -m pytest tests/gpu/test_param_grads_sinks_gpu.py -q
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen.ops.cpu.reference import attention_reference, attention_reference_varlen  # noqa: E402

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
BF16 = torch.bfloat16


def _qkv(b, hq, hkv, sq, sk, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, hq, d, device="cuda", generator=g).to(BF16).transpose(1, 2)
    k = torch.randn(b, sk, hkv, d, device="cuda", generator=g).to(BF16).transpose(1, 2)
    v = torch.randn(b, sk, hkv, d, device="cuda", generator=g).to(BF16).transpose(1, 2)
    return (t.requires_grad_() for t in (q, k, v))


def _close(got, want, what):
    scale = max(want.abs().max().item(), 1e-6)
    err = (got.double() - want).abs().max().item() / scale
    assert err < 2e-2, f"{what}: max error {err:.3g} of the largest element {scale:.3g}"


def _ref_grads(spec, q, k, v, params, do, grad_names):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    p64 = {n: (t.detach().double().requires_grad_() if n in grad_names else t)
           for n, t in params.items()}  # fmt: skip
    o, _ = attention_reference(spec, q64, k64, v64, params=p64)
    (o * do.double()).sum().backward()
    return o, {"q": q64.grad, "k": k64.grad, "v": v64.grad,
               **{n: p64[n].grad for n in grad_names}}  # fmt: skip


@pytest.mark.parametrize("name,param", [("alibi", "slopes"), ("t5_bias", "bias"),
                                        ("alibi_learned", "slopes")])  # fmt: skip
@pytest.mark.parametrize("sq,sk", [(1, 17), (127, 1000), (1000, 127)])
def test_param_gradient_on_cuda_matches_the_float64_reference(name, param, sq, sk):
    op = flashgen.load(REPO / "specs" / f"{name}.yaml")
    q, k, v = _qkv(2, 8, 2, sq, sk, op.spec.head_dim)
    g = torch.Generator(device="cuda").manual_seed(1)
    shape = (8,) if param == "slopes" else (8, 257)
    p = (torch.rand(shape, device="cuda", generator=g) * 0.5).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o, _ = op.attention(q, k, v, **{param: p})
    do = torch.randn_like(o)
    (o.float() * do.float()).sum().backward()
    ro, want = _ref_grads(op.spec, q, k, v, {param: p}, do, {param})
    _close(o, ro, "o")
    for n, t in (("q", q), ("k", k), ("v", v), (param, p)):
        _close(t.grad, want[n], f"d{n}")


def test_param_gradient_on_cuda_is_reproducible_under_deterministic():
    op = flashgen.load(REPO / "specs" / "t5_bias.yaml")
    grads = []
    for _ in range(2):
        q, k, v = _qkv(1, 8, 2, 300, 777, 64)
        bias = torch.linspace(-1, 1, 8 * 257, device="cuda").view(8, 257).requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            o, _ = op.attention(q, k, v, bias=bias, deterministic=True)
        o.float().sum().backward()
        grads.append((q.grad, k.grad, v.grad, bias.grad))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_varlen_param_gradient_on_cuda():
    op = flashgen.load(REPO / "specs" / "alibi.yaml")
    lens = [17, 1, 300]
    cu = torch.tensor([0, 17, 18, 318], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(318, 8, 128, device="cuda", generator=g).to(BF16).requires_grad_()
    k = torch.randn(318, 2, 128, device="cuda", generator=g).to(BF16).requires_grad_()
    v = torch.randn(318, 2, 128, device="cuda", generator=g).to(BF16).requires_grad_()
    slopes = torch.linspace(0.01, 0.5, 8, device="cuda").requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o, _ = op.varlen(q, k, v, cu, cu, max(lens), max(lens), slopes=slopes)
    o.float().sum().backward()
    s64 = slopes.detach().double().requires_grad_()
    ro, _ = attention_reference_varlen(op.spec, q.detach(), k.detach(), v.detach(), cu, cu,
                                       params={"slopes": s64})  # fmt: skip
    ro.sum().backward()
    _close(slopes.grad, s64.grad, "dslopes")


@pytest.mark.parametrize("sq,sk", [(1, 17), (127, 1000), (1000, 127)])
def test_sink_forward_and_backward_on_cuda_match_the_float64_reference(sq, sk):
    op = flashgen.load(REPO / "specs" / "gpt_oss_sink.yaml")
    q, k, v = _qkv(2, 8, 2, sq, sk, 64)
    sinks = torch.linspace(-2, 3, 8, device="cuda").requires_grad_()
    o, lse = op.attention(q, k, v, sinks=sinks)
    do = torch.randn_like(o)
    (o.float() * do.float()).sum().backward()
    ro, want = _ref_grads(op.spec, q, k, v, {"sinks": sinks}, do, {"sinks"})
    _close(o, ro, "o")
    for n, t in (("q", q), ("k", k), ("v", v), ("sinks", sinks)):
        _close(t.grad, want[n], f"d{n}")


def test_sink_in_decode_with_splits_matches_the_padded_op():
    op = flashgen.load(REPO / "specs" / "gpt_oss_sink.yaml")
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = torch.tensor([0, 5, 1000, 4097], dtype=torch.int32, device="cuda")
    kc = torch.randn(4, 2, 4100, 64, device="cuda", generator=g).to(BF16)
    vc = torch.randn(4, 2, 4100, 64, device="cuda", generator=g).to(BF16)
    q = torch.randn(4, 8, 1, 64, device="cuda", generator=g).to(BF16)
    sinks = torch.linspace(-2, 3, 8, device="cuda")
    for splits in (1, 8):
        o, lse = op.with_kvcache(q, kc, vc, lens, num_splits=splits, sinks=sinks)
        for b, n in enumerate(lens.tolist()):
            if n == 0:
                assert bool((o[b] == 0).all())
                continue
            po, pl = op.attention(q[b : b + 1], kc[b : b + 1, :, :n], vc[b : b + 1, :, :n],
                                  sinks=sinks)  # fmt: skip
            torch.testing.assert_close(o[b : b + 1], po, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(lse[b : b + 1], pl, atol=1e-3, rtol=1e-4)


def test_gpt_oss_training_step_on_cuda_matches_eager():
    """A tiny gpt-oss (sinks, a sliding-window and a full layer, GQA) from a config, bf16 on the
    GPU: one training step's loss and gradients with flashgen's attention (the spec's sink)
    against eager's, to bf16 accuracy.  Every token takes both experts (top-2 of 2), so a
    rounding difference cannot flip a routing decision."""
    transformers = pytest.importorskip("transformers")
    from flashgen.integrations import transformers as fg_hf

    fg_hf.register()
    losses, grads = {}, {}
    for impl in ("eager", "flashgen"):
        torch.manual_seed(3)
        cfg = transformers.GptOssConfig(
            vocab_size=96, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=2,
            num_experts_per_tok=2, sliding_window=16, max_position_embeddings=256,
            layer_types=["sliding_attention", "full_attention"],
        )  # fmt: skip
        cfg._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(cfg).to("cuda", BF16).train()
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "sinks"):
                    m.sinks.copy_(torch.linspace(-2, 2, m.sinks.numel()))
        model.set_attn_implementation(impl)
        ids = torch.randint(0, 96, (2, 77), generator=torch.Generator().manual_seed(4)).cuda()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses[impl] = loss.detach().float()
        grads[impl] = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(losses["flashgen"], losses["eager"], rtol=2e-2, atol=2e-2)
    assert any(n.endswith("sinks") for n in grads["eager"])
    for n, g in grads["eager"].items():
        _close(grads["flashgen"][n], g.double(), f"d{n}")
