"""Issue 37 on the GPU: trainable params and attention sinks through the CUDA op, against the
float64 reference built from the same IR (CPU-side: tests/unit/test_param_grads.py and
tests/unit/test_sinks.py).  Hq = 8 over Hkv = 2, lengths that are not tile multiples, Sq != Sk,
(B, S, H, D) storage viewed as [B, H, S, D].

dparam on CUDA is accumulated by the backward kernels (templates/common/dparam.j2: fp32,
reduced across the CTA, one atomic add per element and CTA; under deterministic=True per-CTA
rows summed in a fixed order): every index form (tests/dparam_cases.py) and the shipped
trainable specs, on the Hopper backward (sm_90, deterministic=False, per-CTA and per-key
forms; relative-position tables at head_dim 64 and 256 with hopper_bwd.dparam_diagonal, and with
hopper_bwd.dparam_const_tiles their constant tiles), the
FA2-class deterministic kernels (deterministic=True; also deterministic=False with atomic adds
where the Hopper kernel does not take the form) and the FA2-class atomic-dQ kernels
(Options(family="fa2", atomic_dq=True)), against the float64 reference's autograd on
fresh random inputs (dO bf16-representable, as the kernels receive it), with a gradient of lse
too.  Tolerance: dq, dk, dv max |got - ref64| <= 2e-2 x the largest reference element; a
dparam by the project's rule, at most 2x PyTorch's bf16 math on the same inputs + 1e-3 of
the largest element, never tighter than 2e-2 of it (a dparam's terms can cancel by orders
of magnitude: :func:`_close_dparam`).  Sinks are joined in the forward kernel's epilogue by
default (``fa2_fwd.fused_sink`` / ``hopper_fwd.fused_sink``; tests/gpu/test_prefill_sink_gpu.py
says more); the sink test runs that path and, with both options False, the op's epilogue over
the kernels' keys-only result (flashgen/ops/sink.py).

    python3 -m pytest tests/gpu/test_param_grads_sinks_gpu.py -q
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from dparam_cases import CONST_TILE_CASES, FORMS, diagonal_spec, form_spec  # noqa: E402

import flashgen  # noqa: E402
from flashgen.frontend.spec import load_spec  # noqa: E402
from flashgen.ops.cpu.reference import attention_reference, attention_reference_varlen  # noqa: E402
from flashgen.ops.op import build_op  # noqa: E402
from flashgen.options import Options  # noqa: E402

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


#: The prefill sink paths: joined in the forward kernel (the default), by torch ops after it.
SINK_PATHS = {
    "fused": Options(),
    "torch_ops": Options().with_values(
        {"fa2_fwd.fused_sink": False, "hopper_fwd.fused_sink": False}
    ),
}


@pytest.mark.parametrize("path", sorted(SINK_PATHS))
@pytest.mark.parametrize("sq,sk", [(1, 17), (127, 1000), (1000, 127)])
def test_sink_forward_and_backward_on_cuda_match_the_float64_reference(sq, sk, path):
    op = flashgen.load(REPO / "specs" / "gpt_oss_sink.yaml", options=SINK_PATHS[path])
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


def test_gpt_oss_training_step_on_cuda_matches_float64():
    """A tiny gpt-oss (sinks, a sliding-window and a full layer, GQA) from a config, bf16 on the
    GPU: one training step's loss and every gradient with flashgen's attention (the spec's
    sink) against a float64 eager step from the same weights, by the project's rule (at most
    2x the error of eager attention in bf16, never tighter than 2e-2 of the largest element).
    Every token takes both experts (top-2 of 2), so a rounding difference cannot flip a
    routing decision."""
    transformers = pytest.importorskip("transformers")
    from flashgen.integrations import transformers as fg_hf

    fg_hf.register()
    losses, grads = {}, {}
    #: (attention, dtype, device): the float64 eager run on the CPU is the reference, from
    #: the same bf16-rounded weights; eager in bf16 is PyTorch's own low-precision math
    runs = {"float64": ("eager", torch.float64, "cpu"), "eager": ("eager", BF16, "cuda"),
            "flashgen": ("flashgen", BF16, "cuda")}  # fmt: skip
    for run, (impl, dtype, device) in runs.items():
        torch.manual_seed(3)
        cfg = transformers.GptOssConfig(
            vocab_size=96, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=2,
            num_experts_per_tok=2, sliding_window=16, max_position_embeddings=256,
            layer_types=["sliding_attention", "full_attention"],
            experts_implementation="eager",  # grouped_mm has no float64
        )  # fmt: skip
        cfg._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(BF16).to(device, dtype)
        model.train()
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "sinks"):
                    m.sinks.copy_(torch.linspace(-2, 2, m.sinks.numel()))
        model.set_attn_implementation(impl)
        ids = torch.randint(0, 96, (2, 77), generator=torch.Generator().manual_seed(4))
        loss = model(input_ids=ids.to(device), labels=ids.to(device)).loss
        loss.backward()
        losses[run] = loss.detach().double().cpu()
        grads[run] = {n: p.grad.double().cpu() for n, p in model.named_parameters()
                      if p.grad is not None}  # fmt: skip
    torch.testing.assert_close(losses["flashgen"], losses["float64"], rtol=2e-2, atol=2e-2)
    assert any(n.endswith("sinks") for n in grads["float64"])
    assert grads["flashgen"].keys() == grads["float64"].keys()
    for n, want in grads["float64"].items():
        _close_dparam(grads["flashgen"][n], want, grads["eager"][n], f"d{n}")


# ----------------------------------------------------------------------------- kernel dparam
#: Kernel sets a backward with param gradients runs: the op's default (sm_90: the Hopper
#: backward for per-CTA / per-key forms and, at head_dim 64 / 256, relative-position tables
#: (``hopper_bwd.dparam_diagonal``, on by default), else the FA2-class kernels with
#: atomic adds; sm_80:
#: the FA2-class deterministic kernels with atomic adds), the FA2-class deterministic kernels
#: with the ordered per-CTA rows (deterministic=True), the FA2-class atomic-dQ kernels.
PATHS = {
    "default": (Options(), False),
    "deterministic": (Options(), True),
    "fa2_atomic": (Options(family="fa2", atomic_dq=True), False),
}
#: (Sq, Sk): a single row, odd lengths, several key / query blocks either way, equal lengths
LENGTHS = [(1, 17), (17, 1), (127, 1000), (1000, 127), (1000, 1000)]
SHIPPED_GRADS = ["alibi", "alibi_learned", "t5_bias", "gemma2_softcap"]


def _params(spec, b, hq, hkv, sq, sk, seed):
    """Fresh random values for every param of ``spec`` (tensors on the GPU, f32 scalars as CPU
    0-d tensors), those the backward differentiates requiring grad."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    sym = {"batch": b, "num_heads": hq, "num_heads_kv": hkv, "seqlen_q": sq, "seqlen_k": sk}
    out = {}
    for p in spec.params:
        if p.kind == "tensor":
            shape = [d if isinstance(d, int) else sym[d] for d in p.shape]
            if p.ty.value == "f32":
                val = torch.rand(shape, device="cuda", generator=g) * 0.5 + 0.1
                out[p.name] = val.requires_grad_()
            else:
                out[p.name] = torch.zeros(shape, dtype=torch.int32, device="cuda")
        elif p.ty.value == "f32":
            val = float(p.default if p.default is not None else 0.5) + 0.3
            if p.name == "softcap":  # near the logits' size: at gemma2's 50 the gradient is
                val = 2.5  # a cancellation that tanh.approx's 2^-11 error dominates (14%)
            out[p.name] = torch.tensor(val).requires_grad_()
    return out


def _kernel_vs_reference(op, spec, b, hq, hkv, sq, sk, deterministic, seed=0):
    """dq, dk, dv and every param's gradient of one CUDA backward (o and lse both carry a
    gradient) against the float64 reference's autograd on the same bf16 inputs."""
    q, k, v = _qkv(b, hq, hkv, sq, sk, spec.head_dim, seed=seed)
    params = _params(spec, b, hq, hkv, sq, sk, seed + 1)
    trainable = {n: t for n, t in params.items() if t.requires_grad}
    o, lse = op.attention(q, k, v, deterministic=deterministic, **params)
    g = torch.Generator(device="cuda").manual_seed(seed + 2)
    # dO bf16-representable: o is bf16, so the kernels receive its gradient rounded to bf16;
    # a float64 reference fed the unrounded dO computes another quantity, which a cancelling
    # dparam amplifies (dg of tanh(score / temp) at 1000 x 127: up to 9% in a CPU emulation
    # of the kernels' fp32 math, 0.0001% with dO rounded as here)
    do = torch.randn(o.shape, device="cuda", generator=g).to(BF16).float()
    dl = torch.randn(lse.shape, device="cuda", generator=g)
    live = torch.isfinite(lse)
    loss = (o.float() * do).sum() + torch.where(live, lse * dl, 0.0).sum()
    loss.backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    p64 = {n: (t.detach().to("cuda").double().requires_grad_() if n in trainable else t)
           for n, t in params.items()}  # fmt: skip
    ro, rl = attention_reference(spec, q64, k64, v64, params=p64)
    # The kernels' dsum is rowsum(dO * O) of the bf16 O they return (as FlashAttention's); the
    # float64 O's differs by O's rounding, which a dparam whose terms nearly cancel amplifies
    # (dg of tanh(score / temp): 13%).  dsum enters dS as P * (D_ref - D_kernel) per row, the
    # gradient of lse times that difference: the reference loss takes it, so the comparison is
    # of the same quantity, not of O's rounding.
    d_fix = ((do.double() * ro).sum(-1) - (do.double() * o.detach().double()).sum(-1)).detach()
    ref_loss = (ro * do.double()).sum() + torch.where(live, rl * (dl.double() + d_fix), 0.0).sum()
    ref_loss.backward()
    _close(o, ro, "o")
    for n, t, r in (("q", q, q64), ("k", k, k64), ("v", v, v64)):
        _close(t.grad, r.grad, f"d{n}")
    low = _low_precision_param_grads(spec, q, k, v, params, trainable, do, dl, live)
    for n, t in trainable.items():
        assert t.grad is not None, f"d{n}: no gradient"
        assert t.grad.shape == t.shape and t.grad.dtype == t.dtype
        assert bool(torch.isfinite(t.grad).all()), f"d{n}: not finite"
        _close_dparam(t.grad.to("cuda"), p64[n].grad, low[n], f"d{n} ({spec.name}, {sq}x{sk})")
    return {n: t.grad.clone() for n, t in trainable.items()}


def _low_precision_param_grads(spec, q, k, v, params, trainable, do, dl, live):
    """The params' gradients by PyTorch's own low-precision math on the same inputs and loss
    (the reference in bf16, expression math in fp32, autograd): the project's yardstick."""
    pl = {n: (t.detach().to("cuda").float().requires_grad_() if n in trainable else t)
          for n, t in params.items()}  # fmt: skip
    lo, ll = attention_reference(spec, q.detach(), k.detach(), v.detach(), params=pl,
                                 compute_dtype=BF16)  # fmt: skip
    loss = (lo.float() * do).sum() + torch.where(live, ll.float() * dl, 0.0).sum()
    names = list(trainable)
    grads = torch.autograd.grad(loss, [pl[n] for n in names])
    return dict(zip(names, grads, strict=True))


def _close_dparam(got, want, low, what):
    """A param gradient against the float64 reference by the project's rule: max error at most
    2x that of PyTorch's low-precision math on the same inputs (``low``) + 1e-3 of the largest
    element, and never held tighter than 2e-2 of it (the fp32-accumulation tolerance: one
    scalar's low-precision error can be near zero by chance).  A dparam is a sum over every
    (b, h, q, k) pair whose terms can cancel (two-scalar spec, dg at 1000 x 127: 300-500x on
    typical inputs, 4 orders of magnitude on some), so a bound relative to its own size
    alone fails a correct kernel."""
    scale = max(want.abs().max().item(), 1e-6)
    err = (got.double() - want).abs().max().item()
    err_low = (low.double() - want).abs().max().item()
    bound = max(2 * err_low + 1e-3 * scale, 2e-2 * scale)
    assert err <= bound, (
        f"{what}: max error {err:.3g} (of the largest element {scale:.3g}), bound {bound:.3g}: "
        f"PyTorch's bf16 math {err_low:.3g}"
    )


def _no_fallback_warning():
    """The CUDA backward has no torch fallback for param gradients any more."""
    from flashgen.ops.prefill import backward as bwd_mod

    assert not hasattr(bwd_mod, "cuda_param_backward")


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("sq,sk", LENGTHS)
@pytest.mark.parametrize("form", sorted(FORMS))
def test_kernel_dparam_of_every_index_form(form, sq, sk, path):
    """Every index form (per head, per (batch, head), per query, per key (by KV head and by
    query head), a relative-position table, a full [Sq, Sk] bias, two reads of one tensor,
    two scalars), causal, GQA 8 / 2, head_dim 128, on each kernel set."""
    _no_fallback_warning()
    options, deterministic = PATHS[path]
    spec = form_spec(form)
    if form == "full_bias" and sq * sk > 200_000 and path != "default":
        pytest.skip("the full-bias form at 1000 x 1000: the default path covers it")
    op = build_op(spec, options=options)
    _kernel_vs_reference(op, spec, 2, 8, 2, sq, sk, deterministic)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("sq,sk", LENGTHS)
@pytest.mark.parametrize("name", SHIPPED_GRADS)
def test_kernel_dparam_of_the_shipped_trainable_specs(name, sq, sk, path):
    options, deterministic = PATHS[path]
    op = flashgen.load(REPO / "specs" / f"{name}.yaml", options=options)
    _kernel_vs_reference(op, op.spec, 2, 8, 2, sq, sk, deterministic)


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("form", ["per_head", "per_key_head", "relative_table"])
def test_kernel_dparam_at_head_dims_64_and_256(form, head_dim):
    """The Hopper backward's d64 layout and d256 query-split layout take every one of these
    forms (the relative table by its diagonal slots, ``hopper_bwd.dparam_diagonal``), MQA (8
    query heads on 1 KV head)."""
    spec = form_spec(form, head_dim)
    op = build_op(spec, options=Options().replace_path("hopper_bwd.dparam_diagonal", True))
    for deterministic in (False, True):
        _kernel_vs_reference(op, spec, 1, 8, 1, 300, 777, deterministic)
    key = (torch.cuda.current_device(), "hopper", registry_grads(spec))
    assert op.backward._kernels[key][0].wgmma  # deterministic=False ran the Hopper kernel


@pytest.mark.parametrize("form", ["scalars", "per_head", "per_key_head"])
def test_kernel_dparam_with_128_query_steps_at_head_dim_64(form):
    """``hopper_bwd.d64_block_m=128``: the two-scalar form's Hopper grad unit runs 128-query
    steps (P^T through sDS in the P^T pass, dQ split by rows); the others spill there and are
    built with 64-query steps (still the Hopper kernel).  GQA 8 / 2, odd lengths."""
    spec = form_spec(form, 64)
    op = build_op(spec, options=Options().replace_path("hopper_bwd.d64_block_m", 128))
    for sq, sk in ((300, 777), (1000, 127)):
        _kernel_vs_reference(op, spec, 2, 8, 2, sq, sk, False)
    key = (torch.cuda.current_device(), "hopper", registry_grads(spec))
    plan = op.backward._kernels[key][0]
    assert plan.wgmma and plan.dkdv.context.block_m == (128 if form == "scalars" else 64)


#: ``hopper_bwd.dparam_const_tiles`` (with ``dparam_diagonal``): the Hopper backward's steps whose
#: tile reads one element of a relative-position table add their dS into a running register
CONST_TILES = Options().with_values(
    {"hopper_bwd.dparam_diagonal": True, "hopper_bwd.dparam_const_tiles": True}
)


@pytest.mark.parametrize("sq,sk", [(1, 17), (17, 1), (127, 1000), (1000, 127), (1000, 1000),
                                   (300, 777)])  # fmt: skip
@pytest.mark.parametrize("form,head_dim,mask", CONST_TILE_CASES)
def test_kernel_dparam_with_constant_tiles(form, head_dim, mask, sq, sk):
    """``hopper_bwd.dparam_const_tiles``: the tables' gradients (T5's clamp at 128 and at 4,
    a scalar param's clamp, buckets by (batch, head), two-sided buckets, a read whose test takes
    int64 and one that takes double ranges, two reads of one table) on the Hopper kernel at
    head_dim 64 and 256, GQA 8 / 2, no mask and causal, lengths 1 to 1000 either way (at 1000
    most steps' tiles read one element; at 1 and 17 none): dbias against the float64 reference,
    as dq, dk, dv."""
    spec = diagonal_spec(form, head_dim, mask)
    op = build_op(spec, options=CONST_TILES)
    _kernel_vs_reference(op, spec, 2, 8, 2, sq, sk, False)
    key = (torch.cuda.current_device(), "hopper", registry_grads(spec))
    plan = op.backward._kernels[key][0]
    assert plan.wgmma and plan.dkdv.context.dparam_const_source


def test_kernel_dparam_with_constant_tiles_over_long_rows():
    """t5_bias at 2049 x 3000 queries x keys (MQA 4 / 1, one batch): each CTA walks its four
    heads' query blocks through constant tiles on both sides of the diagonal band, its element
    changing with the side and the head; the same gradient as without the option, each within
    the float64 reference's bound."""
    spec = load_spec(REPO / "specs" / "t5_bias.yaml")
    got = {}
    for name, options in (("const", CONST_TILES), ("diag", Options().replace_path(
            "hopper_bwd.dparam_diagonal", True))):  # fmt: skip
        op = build_op(spec, options=options)
        got[name] = _kernel_vs_reference(op, spec, 1, 4, 1, 2049, 3000, False, seed=3)["bias"]
    scale = got["diag"].abs().max().item()
    assert (got["const"] - got["diag"]).abs().max().item() <= 1e-3 * scale


def registry_grads(spec):
    from flashgen.families.registry import grad_params

    return grad_params(spec)


@pytest.mark.parametrize("name", ["alibi", "t5_bias"])
def test_kernel_dparam_is_bitwise_reproducible_under_deterministic(name):
    """deterministic=True: dq, dk, dv and dparam bitwise equal over 5 backwards on fresh
    buffers (the per-CTA rows are added by one thread in a fixed order and summed by
    torch.sum)."""
    op = flashgen.load(REPO / "specs" / f"{name}.yaml")
    spec = op.spec
    q, k, v = _qkv(2, 8, 2, 300, 777, spec.head_dim, seed=5)
    params = _params(spec, 2, 8, 2, 300, 777, 6)
    (pname, p), = ((n, t) for n, t in params.items() if t.requires_grad)
    runs = []
    for _ in range(5):
        for t in (q, k, v, p):
            t.grad = None
        o, _ = op.attention(q, k, v, deterministic=True, **params)
        o.float().sum().backward()
        runs.append((q.grad.clone(), k.grad.clone(), v.grad.clone(), p.grad.clone()))
    for run in runs[1:]:
        for a, b in zip(runs[0], run, strict=True):
            assert torch.equal(a, b)
    assert runs[0][3].abs().max() > 0


def test_kernel_dparam_of_a_per_key_form_is_reproducible_under_deterministic():
    spec = form_spec("per_key_head")
    op = build_op(spec)
    grads = [_kernel_vs_reference(op, spec, 2, 8, 2, 127, 1000, True, seed=7)["kb"]
             for _ in range(3)]  # fmt: skip
    assert all(torch.equal(grads[0], g) for g in grads[1:])


def test_kernel_dparam_through_the_backward_op_schema():
    """torch.ops.flashgen.<name>__backward with param_grads on CUDA tensors returns the
    gradient from the kernels (float32, the param's shape); an empty problem gives zeros."""
    op = flashgen.load(REPO / "specs" / "alibi.yaml")
    q, k, v = _qkv(1, 8, 2, 65, 130, 128)
    slopes = torch.rand(8, device="cuda")
    o, lse = op.torch_op(q.detach(), k.detach(), v.detach(), 0.125, slopes)
    do = torch.randn_like(o)
    bwd = torch.ops.flashgen.alibi__backward
    *_, dps = bwd(do, q.detach(), k.detach(), v.detach(), o, lse, None, 0.125, False, slopes,
                  param_grads=[True])  # fmt: skip
    assert dps[0].shape == (8,) and dps[0].dtype == torch.float32 and dps[0].is_cuda
    e = torch.empty(1, 8, 0, 128, device="cuda", dtype=BF16)
    *_, dz = bwd(e, e, k.detach(), v.detach(), e, torch.empty(1, 8, 0, device="cuda"), None,
                 0.125, False, slopes, param_grads=[True])  # fmt: skip
    assert dz[0].shape == (8,) and not bool(dz[0].any())


def test_varlen_kernel_dparam_per_key_and_deterministic():
    """The varlen kernels accumulate dparam too (a per-(batch, head) bias read with kv_idx
    arithmetic: sequences of 17, 1, 0 and 300 keys), deterministic=True bitwise reproducible."""
    spec = loads_varlen_spec()
    op = build_op(spec).varlen
    cu = torch.tensor([0, 17, 18, 18, 318], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(318, 8, 64, device="cuda", generator=g).to(BF16).requires_grad_()
    k = torch.randn(318, 2, 64, device="cuda", generator=g).to(BF16).requires_grad_()
    v = torch.randn(318, 2, 64, device="cuda", generator=g).to(BF16).requires_grad_()
    got = []
    for deterministic in (False, True, True):
        bb = torch.linspace(0.01, 0.5, 4 * 8, device="cuda").view(4, 8).requires_grad_()
        o, _ = op(q, k, v, cu, cu, 300, 300, bb=bb, deterministic=deterministic)
        o.float().sum().backward()
        got.append(bb.grad.clone())
    b64 = bb.detach().double().requires_grad_()
    ro, _ = attention_reference_varlen(spec, q.detach(), k.detach(), v.detach(), cu, cu,
                                       params={"bb": b64})  # fmt: skip
    ro.sum().backward()
    for gr in got:
        _close(gr, b64.grad, "dbb")
    assert torch.equal(got[1], got[2])


def loads_varlen_spec():
    from flashgen.frontend.spec import loads_spec

    return loads_spec(
        "name: dp_varlen\nhead_dim: 64\ndtype: bf16\nmask: causal\n"
        'score_mod: "score + bb[b, h] * (q_idx - kv_idx)"\n'
        "params:\n  bb: {type: f32, shape: [batch, num_heads]}\n",
        "<dp_varlen>",
    )
