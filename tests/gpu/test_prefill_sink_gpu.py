"""The attention sink inside the prefill forward kernels (``Options.fa2_fwd.fused_sink`` /
``hopper_fwd.fused_sink``, issue 37) on the device::

    python -m pytest -q tests/gpu/test_prefill_sink_gpu.py

Every op here is bound to both options on (their default, named: :mod:`gpu_options`), with the
default kernel family (on an H100 / H200 the Hopper kernel) and with ``family="fa2"`` (the
FA2-class kernel; on an sm_80 GPU both are the FA2-class one).  Each case checks that the fused
path ran (the op joins the sink on this device, the loaded forward unit takes the logits, the
gradients come from :mod:`flashgen.ops.prefill.fused_sink`'s nodes), then, on fresh random
inputs (bf16, GQA 8 / 2, (B, S, H, D) storage viewed as [B, H, S, D]: non-contiguous q, k, v),
against the float64 reference built from the same IR
(:func:`~flashgen.ops.cpu.reference.attention_reference`, the sink included) with a random dO:

- o: max|ours - ref64| <= 2 * max|reference in bf16 - ref64| + 1e-3 (the rule of
  tests/gpu/test_forward.py);
- dq, dk, dv: that rule, never held tighter than 2e-2 of the largest element (the tolerance of
  tests/gpu/test_param_grads_sinks_gpu.py's sink test).  The fused backward takes the row term
  rowsum(dO * O) from the once-rounded bf16 O = o_keys * sigmoid(lse - sink), as
  FlashAttention's backward would with the sink as a key of value 0; in a row with one key the
  unfused path's o_keys is that key's v, exact in bf16, so its row term cancels exactly and
  PyTorch's bf16 math is nearly exact there, which would hold the fused gradients to a bound
  their one rounding of O does not meet (Sk = 1, the first row under causal);
- d sinks (a sum over every row): 2x PyTorch's bf16 error + 1e-3 of the largest element, never
  tighter than 2e-2 of it (tests/gpu/test_param_grads_sinks_gpu.py's rule for a param);
- lse: the keys' alone, bitwise the unfused op's (the same kernel arithmetic), -inf with
  o == 0 exactly on rows with no key (Sq > Sk under the bottom-right causal mask);
- ``apply_sink=False`` (a null sink pointer): o bitwise the unfused op's keys-only o.

The backward without a gradient of lse runs the backward op's sink form
(``<name>__backward_sink``: the pre kernel joins the sink, :mod:`flashgen.ops.prefill.backward`;
spied on, one call per backward), with a gradient of lse the torch inputs and the plain op; the
gradients also match the unfused op's (each within its bound of the float64 reference, so within
twice it of each other), and under ``deterministic=True`` a second run is bitwise the first (d
sinks summed in a fixed order).

Matrix: lengths 1, 17, 127, 1000, 4097 with Sq != Sk both ways, per-head (``sinks[h]``, a strided
view of a tensor too) and per-(batch, head) (``sinks[b, h]``) sinks, a sliding window at d128,
``deterministic`` True and False, a gradient of lse too; varlen (an empty sequence, lengths
1 to 1000, per-sequence sinks); fp8 (sm_90, forward only).  Speed is a benchmark, not a test.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_options  # noqa: E402

from flashgen.bench.verify import error_bound  # noqa: E402
from flashgen.frontend.spec import load_spec, loads_spec  # noqa: E402
from flashgen.ops.cpu.reference import (  # noqa: E402
    attention_reference,
    attention_reference_varlen,
)
from flashgen.ops.op import poison_outputs  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
BF16 = torch.bfloat16
FUSED = {"fa2_fwd.fused_sink": True, "hopper_fwd.fused_sink": True}  # the default, named
DEV = torch.device("cuda")


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(autouse=True, params=["auto", "fa2"])
def family(request, monkeypatch):
    """Both options on, the default family and the FA2-class one (the same on sm_80)."""
    if request.param == "fa2" and not _sm90():
        pytest.skip("family=fa2 runs the default kernel off sm_90")
    gpu_options.use(monkeypatch, FUSED, family=request.param)
    return request.param


def _unfused():
    """The running test's options with ``fused_sink=False``: the sink on the torch epilogue
    (same family)."""
    return gpu_options.CURRENT.with_values(dict.fromkeys(FUSED, False))


def _spec(name, sink, params, mask="causal", head_dim=64, dtype="bf16"):
    return loads_spec(
        f"name: {name}\nhead_dim: {head_dim}\ndtype: {dtype}\nmask: {mask}\nsink: {sink}\n"
        f"params:\n{params}\n",
        f"{name}.yaml",
    )


SPECS = {
    "gpt_oss_sink": lambda: load_spec(REPO / "specs" / "gpt_oss_sink.yaml"),
    "per_batch_head": lambda: _spec("gsink_bh", "sinks[b, h]",
                                    "  sinks: {type: f32, shape: [batch, num_heads]}"),
    "swa_d128": lambda: _spec("gsink_swa_d128", "sinks[h]",
                              "  sinks: {type: f32, shape: [num_heads]}\n"
                              "  window: {type: i32, default: 100}",
                              mask="causal && q_idx + seqlen_k - seqlen_q - kv_idx < window",
                              head_dim=128),
}  # fmt: skip


def _sinks(spec, b, hq, gen, strided=False):
    shape = (b, hq) if "batch" in spec.param("sinks").shape else (hq,)
    if strided:  # every other element of a larger tensor: sink_sh 2
        return (torch.randn(*shape[:-1], 2 * hq, device=DEV, generator=gen) * 2)[..., ::2]
    return torch.randn(*shape, device=DEV, generator=gen) * 2


def _bshd(*shape, gen):
    """bf16 (B, S, H, D) storage viewed as [B, H, S, D] (not contiguous)."""
    b, h, s, d = shape
    return torch.randn(b, s, h, d, device=DEV, generator=gen).to(BF16).transpose(1, 2)


def _assert_fused(op, o, node: str):
    """The call ran the fused path: the op joins the sink here, its loaded forward unit takes
    the logits, and ``o``'s gradient comes from ``node``."""
    assert op._joins_sink(DEV)
    assert op.kernel(DEV).plan.context["sink"]
    assert type(o.grad_fn).__name__ == node, type(o.grad_fn).__name__


def _bound(ours, r64, rlow, what):
    """o: 2x PyTorch's bf16 error + 1e-3 (module doc)."""
    err = (ours.double() - r64).abs().max().item()
    bound = 2 * (rlow.double() - r64).abs().max().item() + 1e-3
    assert err <= bound, f"{what}: max error {err:.3e} > bound {bound:.3e}"


def _bound_grad(ours, r64, rlow, what, eps=1e-3):
    """dq, dk, dv (``eps`` absolute) and d sinks (``eps`` of the largest element): 2x PyTorch's
    bf16 error + eps, never tighter than 2e-2 of the largest element (module doc)."""
    scale = max(r64.abs().max().item(), 1e-6)
    err = (ours.double() - r64).abs().max().item()
    low = (rlow.double() - r64).abs().max().item()
    bound = max(2 * low + eps, 2e-2 * scale)
    assert err <= bound, (
        f"{what}: max error {err:.3e} > bound {bound:.3e} (largest {scale:.3g}, PyTorch's bf16 "
        f"{low:.3e})"
    )


def _bound_param(ours, r64, rlow, what):
    scale = max(r64.abs().max().item(), 1e-6)
    _bound_grad(ours, r64, rlow, what, eps=1e-3 * scale)


def _reference(spec, q, k, v, sinks, do, dl, dtype, varlen=None):
    """o, lse and the gradients of q, k, v, sinks of the reference in ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    s = sinks.detach().double().requires_grad_()  # f32 param: float64 in both references
    if varlen is None:
        o, lse = attention_reference(spec, *leaves, params={"sinks": s}, compute_dtype=dtype)
    else:
        o, lse = attention_reference_varlen(spec, *leaves, *varlen, params={"sinks": s},
                                            compute_dtype=dtype)  # fmt: skip
    outs, grads = [o], [do.to(dtype)]
    if dl is not None:
        fin = torch.isfinite(lse)
        outs.append(torch.where(fin, lse, torch.zeros_like(lse)))
        grads.append(torch.where(fin, dl.to(lse.dtype), torch.zeros_like(dl, dtype=lse.dtype)))
    torch.autograd.backward(outs, grads)
    return o.detach(), lse.detach(), [t.grad for t in leaves] + [s.grad]


LENGTHS = [(1, 17), (17, 1), (127, 1000), (1000, 127), (1000, 1000), (4097, 1000), (1, 4097)]


def _spy_sink_form(monkeypatch, op) -> list:
    """Count the calls of ``torch.ops.flashgen.<op>__backward_sink`` (the fused node looks it
    up at call time)."""
    calls: list = []
    name = f"{op.name}__backward_sink"
    real = getattr(torch.ops.flashgen, name)

    def call(*args, **kwargs):
        calls.append(args[8])  # deterministic
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.ops.flashgen, name, call)
    return calls


def _grads(op, q, k, v, sinks, do, dl, deterministic):
    """dq, dk, dv, d sinks of one call of ``op`` with output gradients ``do`` (and ``dl``)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    o, lse = op.attention(*leaves[:3], sinks=leaves[3], deterministic=deterministic)
    outs = [(o, do)] + ([(lse, dl)] if dl is not None else [])
    torch.autograd.backward([t for t, _ in outs], [g for _, g in outs])
    return [t.grad for t in leaves]


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("sq,sk", LENGTHS, ids=[f"{a}x{b}" for a, b in LENGTHS])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_fused_forward_and_backward_match_the_float64_reference(name, sq, sk, deterministic,
                                                                monkeypatch):  # fmt: skip
    spec = SPECS[name]()
    op, plain = gpu_options.build(spec), gpu_options.build(spec, _unfused())
    sink_form = _spy_sink_form(monkeypatch, op)
    gen = torch.Generator(device=DEV).manual_seed(sq * 7 + sk)
    b, hq, hkv, d = 2, 8, 2, spec.head_dim
    q, k, v = (_bshd(b, h, s, d, gen=gen) for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
    sinks = _sinks(spec, b, hq, gen, strided=name == "gpt_oss_sink")
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    with poison_outputs():
        o, lse = op.attention(*leaves[:3], sinks=leaves[3], deterministic=deterministic)
    _assert_fused(op, o, "FusedSinkAttentionBackward")
    do = torch.randn(o.shape, device=DEV, generator=gen).to(BF16)
    dl = torch.randn(lse.shape, device=DEV, generator=gen) if sq == 127 else None
    outs = [(o, do)] + ([(lse, dl)] if dl is not None else [])
    torch.autograd.backward([t for t, _ in outs], [g for _, g in outs])
    assert sink_form == ([] if dl is not None else [deterministic]), sink_form
    r64 = _reference(spec, q, k, v, sinks, do, dl, torch.float64)
    rlo = _reference(spec, q, k, v, sinks, do, dl, BF16)
    assert not o.isnan().any(), "NaN in o (a row left unwritten?)"
    _bound(o, r64[0], rlo[0], "o")
    for what, ours, want, low in zip("qkv", (t.grad for t in leaves), r64[2], rlo[2], strict=False):
        assert not ours.isnan().any(), f"d{what} has NaN"
        _bound_grad(ours, want, low, f"d{what}")
    _bound_param(leaves[3].grad, r64[2][3], rlo[2][3], "dsinks")
    # against the unfused op (the keys' kernels, then the torch epilogue): each within its bound
    # of the float64 reference, so within twice that bound of each other
    theirs = _grads(plain, q, k, v, sinks, do, dl, deterministic)
    for what, ours, other, want, low in zip(("dq", "dk", "dv", "dsinks"),
                                            (t.grad for t in leaves), theirs, r64[2], rlo[2],
                                            strict=True):  # fmt: skip
        scale = max(want.abs().max().item(), 1e-6)
        eps = 1e-3 * scale if what == "dsinks" else 1e-3
        bound = 2 * max(2 * (low.double() - want).abs().max().item() + eps, 2e-2 * scale)
        err = (ours.double() - other.double()).abs().max().item()
        assert err <= bound, f"{what} fused vs unfused: {err:.3e} > {bound:.3e}"
    if deterministic:  # bitwise run to run, d sinks included
        again = _grads(op, q, k, v, sinks, do, dl, deterministic)
        for what, a, b in zip(("dq", "dk", "dv", "dsinks"), again, (t.grad for t in leaves),
                              strict=True):  # fmt: skip
            assert torch.equal(a, b), f"{what}: deterministic=True differs run to run"
    # lse: the keys' alone, the unfused kernel's; rows with no key: o = 0, lse = -inf
    with torch.no_grad():
        po, pl = plain.attention(q, k, v, sinks=sinks)
        ko, kl = op.attention(q, k, v, sinks=sinks, apply_sink=False)
        pko, _ = plain.attention(q, k, v, sinks=sinks, apply_sink=False)
    assert torch.equal(lse.detach(), pl) and torch.equal(kl, pl)
    assert torch.equal(ko, pko), "apply_sink=False: the keys-only o of the unfused kernel"
    empty = ~torch.isfinite(r64[1])
    assert torch.equal(~torch.isfinite(lse.detach()), empty)
    if sq > sk and name != "swa_d128":
        assert bool(empty.any())  # rows with no key under the bottom-right causal mask
    assert bool((o.detach()[empty] == 0).all()) and bool((lse.detach()[empty] == -math.inf).all())
    # fused (one bf16 rounding) against unfused (o_keys rounded, then o_keys x sigmoid): 2^-6
    diff = (o.detach().double() - po.double()).abs()
    tol = torch.maximum(o.detach().double().abs(), po.double().abs()) * 2.0**-6 + 1e-6
    assert bool((diff <= tol).all()), f"fused vs unfused: max excess {(diff - tol).max():.3g}"


def test_only_the_sink_param_requires_grad():
    """A frozen model's sinks training: the fused node gives d sinks (q, k, v need none)."""
    spec = SPECS["gpt_oss_sink"]()
    op = gpu_options.build(spec)
    gen = torch.Generator(device=DEV).manual_seed(11)
    q, k, v = (_bshd(1, h, 300, 64, gen=gen) for h in (8, 2, 2))
    sinks = _sinks(spec, 1, 8, gen).requires_grad_()
    o, _ = op.attention(q, k, v, sinks=sinks)
    _assert_fused(op, o, "FusedSinkAttentionBackward")
    do = torch.randn(o.shape, device=DEV, generator=gen).to(BF16)
    o.backward(do)
    r64 = _reference(spec, q, k, v, sinks, do, None, torch.float64)
    rlo = _reference(spec, q, k, v, sinks, do, None, BF16)
    _bound_param(sinks.grad, r64[2][3], rlo[2][3], "dsinks")


VARLEN_Q = [1, 0, 17, 127, 1000, 5]
VARLEN_K = [17, 0, 1, 1000, 127, 5]


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("name", ["gpt_oss_sink", "per_batch_head"])
def test_varlen_fused_forward_and_backward_match_the_float64_reference(name, deterministic):
    """Six sequences (an empty one, Sq > Sk and Sq < Sk, 1 to 1000 rows), a sink per (sequence,
    head) for ``sinks[b, h]``; a gradient of lse too."""
    spec = SPECS[name]()
    op = gpu_options.build(spec).varlen
    gen = torch.Generator(device=DEV).manual_seed(5)
    cq = torch.tensor([0, *torch.tensor(VARLEN_Q).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEV)  # fmt: skip
    ck = torch.tensor([0, *torch.tensor(VARLEN_K).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEV)  # fmt: skip
    tq, tk = sum(VARLEN_Q), sum(VARLEN_K)
    q = torch.randn(tq, 8, 64, device=DEV, generator=gen).to(BF16)
    k = torch.randn(tk, 2, 64, device=DEV, generator=gen).to(BF16)
    v = torch.randn(tk, 2, 64, device=DEV, generator=gen).to(BF16)
    sinks = _sinks(spec, len(VARLEN_Q), 8, gen)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    layout = (cq, ck, max(VARLEN_Q), max(VARLEN_K))
    with poison_outputs():
        o, lse = op.attention(*leaves[:3], *layout, sinks=leaves[3], deterministic=deterministic)
    _assert_fused(op, o, "FusedSinkVarlenBackward")
    do = torch.randn(o.shape, device=DEV, generator=gen).to(BF16)
    dl = torch.randn(lse.shape, device=DEV, generator=gen)
    torch.autograd.backward([o, lse], [do, dl])
    r64 = _reference(spec, q, k, v, sinks, do, dl, torch.float64, varlen=(cq, ck))
    rlo = _reference(spec, q, k, v, sinks, do, dl, BF16, varlen=(cq, ck))
    assert not o.isnan().any()
    _bound(o, r64[0], rlo[0], "o")
    for what, ours, want, low in zip("qkv", (t.grad for t in leaves), r64[2], rlo[2], strict=False):
        assert not ours.isnan().any(), f"d{what} has NaN"
        _bound_grad(ours, want, low, f"d{what}")
    _bound_param(leaves[3].grad, r64[2][3], rlo[2][3], "dsinks")
    empty = ~torch.isfinite(r64[1])
    assert bool(empty.any()) and torch.equal(~torch.isfinite(lse.detach()), empty)
    assert bool((o.detach().transpose(0, 1)[empty] == 0).all())


@pytest.mark.skipif(not _sm90(), reason="the fp8 forward runs on sm_90 only")
def test_fp8_fused_forward_matches_the_reference(family):
    """The fp8 Hopper forward (no backward) joins the sink in its epilogue: o within the fp8
    rule (:func:`flashgen.bench.verify.fp8_error_bound`), lse the unfused op's."""
    if family == "fa2":
        pytest.skip("fp8 specs run the Hopper kernel only")
    from flashgen.fp8 import quantize

    spec = _spec("gsink_fp8", "sinks[h]", "  sinks: {type: f32, shape: [num_heads]}",
                 head_dim=128, dtype="fp8_e4m3")  # fmt: skip
    op, plain = gpu_options.build(spec), gpu_options.build(spec, _unfused())
    gen = torch.Generator(device=DEV).manual_seed(2)
    x = [torch.randn(2, h, s, 128, device=DEV, generator=gen)
         for h, s in ((8, 1000), (2, 127), (2, 127))]  # fmt: skip
    q, k, v, qd, kd, vd = quantize(*x)
    sinks = _sinks(spec, 2, 8, gen)
    with torch.no_grad():
        o, lse = op.attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, sinks=sinks)
        _, pl = plain.attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, sinks=sinks)
    assert op._joins_sink(DEV) and op.kernel(DEV).plan.context["sink"]
    ref_o, _, bound = error_bound(spec, q, k, v, {"sinks": sinks}, (qd, kd, vd))
    err = (o.double() - ref_o).abs().max().item()
    assert err <= bound, f"o error {err:.3e} > bound {bound:.3e}"
    assert torch.equal(lse, pl)
