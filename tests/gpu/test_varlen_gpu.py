"""Varlen kernels (packed sequences with cu_seqlens) against the per-sequence float64
reference (``pytest -m gpu``; run alone: ``python3 -m pytest tests/gpu/test_varlen_gpu.py -q``).

Reference: :func:`flashgen.ops.cpu.reference.attention_reference_varlen`, the padded reference
called on each sequence.  Bound (the rule of tests/gpu/test_forward.py): max|ours - ref64|
<= 2 * max|reference in the input dtype - ref64| + 1e-3, for o and for each gradient; lse
within 1e-2 relative where finite and exactly -inf (with o == 0) where the reference's is.
Outputs are poisoned (NaN) before launch, so a row the kernels forget fails.  Fresh
random inputs per case; lengths include empty sequences (q, k, both), a length-1 sequence,
a sequence with queries but no keys (o = 0, lse = -inf), odd lengths, Sq != Sk, GQA, and
max_seqlen passed far larger than the longest sequence.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import gpu_options  # noqa: E402

from flashgen.frontend.errors import OpInputError  # noqa: E402
from flashgen.frontend.spec import load_spec  # noqa: E402
from flashgen.ops.cpu.reference import attention_reference_varlen  # noqa: E402
from flashgen.ops.op import poison_outputs  # noqa: E402
from flashgen.ops.prefill.backward import uses_atomic_dq  # noqa: E402
from flashgen.ops.prefill.varlen import CHECK_ENV  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]

# (seqlen_q, seqlen_k) per sequence.
MIXED = [(5, 7), (0, 4), (1, 0), (17, 17), (3, 1), (0, 0), (1, 1), (127, 1000), (1000, 127),
         (300, 513), (64, 64), (129, 65)]  # fmt: skip
SAME = [(1, 1), (17, 17), (0, 0), (127, 127), (1000, 1000), (4097, 4097), (33, 33)]

PATHS = [pytest.param(True, id="deterministic"), pytest.param(False, id="atomic_dq")]


@pytest.fixture(params=PATHS)
def bwd_path(request, monkeypatch) -> bool:
    """The ``deterministic`` flag of the calls; False runs the FA2-class atomic-dQ kernels of
    an op bound to ``Options(atomic_dq=True)`` (:mod:`gpu_options`)."""
    if not request.param:
        gpu_options.use(monkeypatch, atomic_dq=True)
    return request.param


def padded_op(name: str):
    """The op of shipped spec ``name`` under the running test's options."""
    return gpu_options.build(load_spec(REPO / "specs" / f"{name}.yaml"))


def cu(lens) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device="cuda")


def make_inputs(spec, lens, hq, hkv, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = sum(a for a, _ in lens), sum(b for _, b in lens)
    dt = torch.bfloat16 if spec.dtype == "bf16" else torch.float16

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(dt)

    q, k = randn(tq, hq, spec.head_dim), randn(tk, hkv, spec.head_dim)
    v = randn(tk, hkv, spec.head_dim_v)
    params = {}
    if spec.param("slopes") is not None:
        params["slopes"] = torch.rand(hq, device="cuda", generator=gen)
    if spec.param("window") is not None:
        params["window"] = 37
    return q, k, v, cu([a for a, _ in lens]), cu([b for _, b in lens]), params


def bound(err_low: float) -> float:
    return 2 * err_low + 1e-3


def check_forward(name, lens, hq, hkv, *, seed=0, oversize=1, qkv=None):
    op = padded_op(name).varlen
    spec = op.spec
    q, k, v, cq, ck, params = make_inputs(spec, lens, hq, hkv, seed)
    if qkv is not None:
        q, k, v = qkv
    mq = max([a for a, _ in lens] + [1]) * oversize
    mk = max([b for _, b in lens] + [1]) * oversize
    with poison_outputs():
        o, lse = op(q, k, v, cq, ck, mq, mk, **params)
    torch.cuda.synchronize()
    assert o.shape == (q.shape[0], hq, spec.head_dim_v) and o.dtype == q.dtype
    assert lse.shape == (hq, q.shape[0]) and lse.dtype == torch.float32
    assert not o.isnan().any(), "o has NaN: a row was not written"
    assert not lse.isnan().any(), "lse has NaN: a row was not written"
    ref_o, ref_lse = attention_reference_varlen(spec, q, k, v, cq, ck, params=params)
    low_o, _ = attention_reference_varlen(
        spec, q, k, v, cq, ck, params=params, compute_dtype=q.dtype
    )
    if o.numel():
        err = (o.double() - ref_o).abs().max().item()
        b = bound((low_o.double() - ref_o).abs().max().item())
        assert err <= b, f"{name} H={hq}/{hkv} lens={lens}: o error {err:.3e} > {b:.3e}"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "rows with nothing to attend to differ"
    assert (o.transpose(0, 1)[empty] == 0).all()
    fin = ~empty
    if fin.any():
        lse_err = ((lse[fin] - ref_lse[fin]).abs() / (1 + ref_lse[fin].abs())).max().item()
        assert lse_err <= 1e-2, f"lse off by {lse_err:.3e} (relative)"
    return op, (q, k, v, cq, ck, mq, mk, params), (o, lse)


# ----------------------------------------------------------------------------- forward
@pytest.mark.parametrize(
    "name", ["causal_d128", "gpt2_d64", "bidir_d256", "mistral_swa", "alibi", "gemma2_softcap"]
)
def test_forward_mixed_lengths(name):
    check_forward(name, MIXED, 4, 2, seed=1)


@pytest.mark.parametrize("hq, hkv", [(32, 8), (8, 1)])
def test_forward_gqa(hq, hkv):
    check_forward("llama3_gqa", MIXED, hq, hkv, seed=hq)


def test_forward_long_and_odd_lengths():
    check_forward("causal_d128", SAME, 2, 1, seed=3)


def test_oversized_max_seqlen_gives_the_same_result():
    op, (q, k, v, cq, ck, mq, mk, params), (o, lse) = check_forward(
        "causal_d128", MIXED, 4, 2, seed=4, oversize=50
    )
    o2, lse2 = op(q, k, v, cq, ck, max(a for a, _ in MIXED), max(b for _, b in MIXED))
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


def test_same_bits_as_the_padded_kernel_per_sequence():
    """Each sequence of the varlen kernel equals the padded kernel run on it alone (same
    tiles, same arithmetic): offsets and per-sequence causal alignment are exact."""
    pop = padded_op("causal_d128")
    op, (q, k, v, cq, ck, mq, mk, _), (o, lse) = check_forward("causal_d128", MIXED, 4, 2)
    if op.kernel(q.device).plan.tiles != pop.kernel(q.device).plan.tiles:
        pytest.skip("the varlen and padded kernels were built with different tiles")
    for i in range(len(MIXED)):
        a, b, c, d = int(cq[i]), int(cq[i + 1]), int(ck[i]), int(ck[i + 1])
        if a == b:
            continue
        po, plse = pop(*(t.transpose(0, 1)[None] for t in (q[a:b], k[c:d], v[c:d])))
        assert torch.equal(o[a:b], po[0].transpose(0, 1)), f"sequence {i}"
        assert torch.equal(lse[:, a:b], plse[0]), f"sequence {i}"


def test_strided_views_of_a_packed_qkv():
    """q, k, v as views of one [total, 3, H, D] tensor (FA2's qkvpacked layout)."""
    lens = [(n, n) for n in (1, 17, 0, 300, 129)]
    total = sum(n for n, _ in lens)
    qkv = torch.randn(total, 3, 4, 128, device="cuda").to(torch.bfloat16)
    q, k, v = qkv.unbind(1)
    assert not q.is_contiguous()
    check_forward("causal_d128", lens, 4, 4, qkv=(q, k, v))


def test_all_sequences_without_keys():
    op = padded_op("causal_d128").varlen
    q = torch.randn(9, 2, 128, device="cuda").to(torch.bfloat16)
    k = torch.empty(0, 2, 128, device="cuda", dtype=torch.bfloat16)
    with poison_outputs():
        o, lse = op(q, k, k, cu([4, 5]), cu([0, 0]), 5, 0)
    assert (o == 0).all() and torch.isneginf(lse).all()


def test_debug_check_of_cu_seqlens_values(monkeypatch):
    op = padded_op("causal_d128").varlen
    q = torch.randn(10, 2, 128, device="cuda").to(torch.bfloat16)
    bad = torch.tensor([0, 6, 4, 10], dtype=torch.int32, device="cuda")
    monkeypatch.setenv(CHECK_ENV, "1")
    with pytest.raises(OpInputError, match="nondecreasing"):
        op(q, q, q, bad, bad, 10, 10)
    with pytest.raises(OpInputError, match="max_seqlen_q: expected at least"):
        op(q, q, q, cu([4, 6]), cu([4, 6]), 5, 6)


def test_opcheck_and_torch_compile():
    op = padded_op("alibi").varlen
    q, k, v, cq, ck, params = make_inputs(op.spec, MIXED[:5], 2, 1, seed=5)
    torch.library.opcheck(op.torch_op, (q, k, v, cq, ck, 17, 17, 0.1, params["slopes"]))
    f = torch.compile(lambda *a: op(*a, slopes=params["slopes"]), fullgraph=True)
    o, lse = f(q, k, v, cq, ck, 17, 17)
    o2, lse2 = op(q, k, v, cq, ck, 17, 17, slopes=params["slopes"])
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


# ----------------------------------------------------------------------------- backward
def ref_grads(spec, q, k, v, cq, ck, do, dlse, params, dtype):
    qr, kr, vr = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    o, lse = attention_reference_varlen(spec, qr, kr, vr, cq, ck, params=params,
                                        compute_dtype=dtype)  # fmt: skip
    lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    torch.autograd.backward([o, lse], [do.to(dtype), dlse.to(lse.dtype)])
    return qr.grad, kr.grad, vr.grad


def check_backward(name, lens, hq, hkv, *, deterministic, seed=0, oversize=1):
    op = padded_op(name).varlen
    spec = op.spec
    q, k, v, cq, ck, params = make_inputs(spec, lens, hq, hkv, seed)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mq = max([a for a, _ in lens] + [1]) * oversize
    mk = max([b for _, b in lens] + [1]) * oversize
    o, lse = op(q, k, v, cq, ck, mq, mk, deterministic=deterministic, **params)
    gen = torch.Generator(device="cuda").manual_seed(seed + 100)
    do = torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype)
    dlse = torch.randn(lse.shape, device="cuda", generator=gen)
    torch.autograd.backward([o, lse.masked_fill(torch.isneginf(lse), 0)], [do, dlse])
    atomic = uses_atomic_dq(deterministic, op.options)
    path = "atomic" if atomic else "deterministic"  # varlen never takes the Hopper backward
    assert (torch.cuda.current_device(), path) in op.backward._kernels  # the path ran
    r64 = ref_grads(spec, q, k, v, cq, ck, do, dlse, params, torch.float64)
    low = ref_grads(spec, q, k, v, cq, ck, do, dlse, params, q.dtype)
    for n, ours, r, lo in zip("qkv", (q.grad, k.grad, v.grad), r64, low, strict=True):
        assert ours.shape == r.shape and not ours.isnan().any(), f"d{n} has NaN"
        err = (ours.double() - r).abs().max().item()
        b = bound((lo.double() - r).abs().max().item())
        assert err <= b, f"{name} d{n} H={hq}/{hkv} atomic={atomic}: {err:.3e} > {b:.3e}"


@pytest.mark.parametrize("name", ["causal_d128", "gpt2_d64", "bidir_d256", "alibi"])
def test_backward_mixed_lengths(name, bwd_path):
    check_backward(name, MIXED, 4, 2, deterministic=bwd_path, seed=6)


def test_backward_gqa_and_oversized_max_seqlen(bwd_path):
    check_backward("llama3_gqa", MIXED, 8, 1, deterministic=bwd_path, seed=7, oversize=20)


def test_backward_long_and_odd_lengths(bwd_path):
    check_backward("causal_d128", SAME, 2, 1, deterministic=bwd_path, seed=8)


def test_deterministic_backward_is_bitwise_repeatable():
    op = padded_op("causal_d128").varlen
    q, k, v, cq, ck, _ = make_inputs(op.spec, MIXED, 4, 2, seed=9)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    grads = []
    for _ in range(3):
        o, _ = op(q, k, v, cq, ck, 1000, 1000, deterministic=True)
        g = torch.autograd.grad(o.float().sum(), (q, k, v))
        grads.append(g)
    for g in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(g, grads[0], strict=True))
