"""Extreme but finite magnitudes on the GPU under ``Options(exact_softmax=True)`` (issue 38,
item 15): both kernel families, head dims 64 / 128 / 256, forward, backward and decode,
against the float64 reference (needs a GPU: ``pytest -m gpu``).

bf16 q = k filled with 133120 at head_dim 64 gives logits near 1.4e11, all equal; the default
CUDA forward returned NaN at seqlen 1 on an H100.  An ulp of the log2-domain row max is 2^14
there, so the folded ``exp2(fma(s, scale_log2, -max))`` leaves a residual of up to +-2^13
whose exp2 overflows (P = inf, o NaN) or flushes the max's P to 0; the backward's ``P =
exp2(x - lse)`` overflows the same way (lse rounded through the natural log); decode's split
merge weighs each split ``exp(lse_i - lse)`` with ``log(sum)`` lost in lse's rounding (equal
splits: o times their count).  The option computes P's exponent from scores rounded as the
row max was, caps the backward's exponent at 0 and normalizes the merge by its sum
(docs/reliability.md).

Inputs: q = c, k = +-c (all logits equal, positive or negative), c = 133120 in bf16 and 30720
(~3e4, c^2 has 8 significant bits: every partial sum of q.k is exact) in fp16; GQA 4/2;
lengths 1, 17, 1000 and 17 x 1000; causal, no mask, and ALiBi (an affine score_mod).

- Forward: ``o`` against the float64 reference (the bound of a bf16 / fp16 rounding of o),
  lse within 1e-6 relative.  Without a score_mod V is random: every P is exactly 1, so o is
  the mean of V over the kept keys (a rescale that lost an earlier key block fails).  With
  ALiBi the fp64 reference resolves the bias (|bias| <= 500, an fp32 ulp of the logits is
  2^14), fp32 cannot, so V is constant along the keys (random across heads and columns):
  any convex combination of its rows is the row itself.
- Backward (``deterministic`` True: the FA2-class deterministic kernels; False: the Hopper
  backward where it applies, else the FA2-class atomic-dQ kernels, ``atomic_dq=True``): V
  constant along the keys with small integer values, dO small integers, so dP = rowsum(dO *
  O) exactly and the reference's dS = P (dP - D), dQ and dK are 0: ours must be too (an
  uncapped P = inf made dS = inf * 0 = NaN).  dV = P^T dO cannot match the reference here: a
  single fp32 lse cannot carry log(n) below its ulp (2^14), so a row's maximal keys get P = 1
  or 0 where the reference has 1/n; dV is checked finite and within the bound P <= 1 gives,
  sum_i |dO_i| over the rows that see the key.
- Decode (dense and paged caches, an append, 1 / 2 / 5 splits): cache lengths 0, 16 and 999
  plus the appended key, so 1, 17 and 1000 live keys; V constant along the keys; o and lse
  against the float64 reference on the gathered keys.
- Ordinary random inputs under the option (the shipped specs' forward and backward, the
  bounds of tests/gpu/test_forward.py and test_backward_kernels.py): the exact paths change
  nothing else.
"""

from __future__ import annotations

import sys
import zlib
from collections import OrderedDict
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_options  # noqa: E402
from head_dim_cases import hdim_spec  # noqa: E402
from test_backward_kernels import check_grads  # noqa: E402
from test_forward import check  # noqa: E402

from flashgen.families import hopper_bwd  # noqa: E402
from flashgen.frontend.spec import load_spec  # noqa: E402
from flashgen.ops.cpu.reference import attention_reference  # noqa: E402
from flashgen.ops.op import build_op, target_for_device  # noqa: E402
from flashgen.ops.prefill.backward import backward_path  # noqa: E402
from flashgen.options import Options  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
#: The magnitude in each dtype (exact in it): logits ~ sqrt(head_dim) * c^2.
C = {"bf16": 133120.0, "fp16": 30720.0}
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}
HEAD_DIMS = (64, 128, 256)
#: (dtype, score_mod, causal)
CASES = [("bf16", "none", True), ("bf16", "none", False), ("bf16", "alibi", True),
         ("fp16", "none", True), ("fp16", "alibi", True)]  # fmt: skip
LENGTHS = [(1, 1), (17, 17), (1000, 1000), (17, 1000)]
SIGNS = {"pos": 1.0, "neg": -1.0}
HQ, HKV = 4, 2
#: o's bound: a rounding of o to bf16 (8 significant bits) or fp16 (11), with room to spare
O_RTOL = {"bf16": 2.0**-7, "fp16": 2.0**-9}
LSE_RTOL = 1e-6


def exact_options(family: str) -> Options:
    """The options under test: ``atomic_dq=True``, so ``deterministic=False`` runs the Hopper
    backward where it applies (family auto on sm_90) and the FA2-class atomic-dQ kernels
    elsewhere."""
    return Options(family=family, atomic_dq=True, exact_softmax=True)


def case_id(case) -> str:
    dtype, mod, causal = case
    return f"{dtype}-{mod}-{'causal' if causal else 'nomask'}"


@pytest.fixture(scope="module", autouse=True)
def _prebuilt():
    """Every unit the module's huge-logit tests run (forward, the three backward units,
    decode), compiled in parallel into the kernel cache first (for the op's own spec: an op
    bound to non-default options names its kernels after its registered name)."""
    if not torch.cuda.is_available():
        return
    import os
    from concurrent.futures import ThreadPoolExecutor

    from flashgen.build import cache
    from flashgen.build.render import render
    from flashgen.families import registry
    from flashgen.families.build import build_backward, build_forward

    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name(dev)
    jobs = []
    for d in HEAD_DIMS:
        for dtype, mod, causal in CASES:
            base = hdim_spec(d, d, dtype, mod, causal)
            t = target_for_device(base, dev)
            for family in ("auto", "fa2"):
                o = exact_options(family)
                s = build_op(base, o).spec
                jobs.append(lambda s=s, t=t, o=o: build_forward(s, t, gpu=gpu, options=o))
                jobs.append(lambda s=s, t=t, o=o: build_backward(s, t, options=o))
                jobs.append(lambda s=s, t=t, o=o: build_backward(s, t, atomic_dq=True, options=o))
                if family == "auto" and hopper_bwd.eligible(s, t):
                    jobs.append(
                        lambda s=s, t=t, o=o: build_backward(
                            s, t, atomic_dq=True, hopper=True, options=o
                        )
                    )
            if causal and mod == "none":
                o = Options(exact_softmax=True)
                p = registry.plan_decode(build_op(base, o).spec, t, o)
                jobs.append(lambda p=p: cache.get_or_build(render(p), p))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
        list(pool.map(lambda job: job(), jobs))


# ----------------------------------------------------------------------------- inputs
def _gen(*key) -> torch.Generator:
    """A CPU generator seeded from ``key`` (the same in every process)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def qk(dtype: str, d: int, sign: float, sq: int, sk: int, b: int = 1):
    """q = c, k = sign * c (CPU)."""
    c, t = C[dtype], DTYPE[dtype]
    q = torch.full((b, HQ, sq, d), c, dtype=t)
    k = torch.full((b, HKV, sk, d), sign * c, dtype=t)
    return q, k


def keywise_constant_v(dtype: str, d: int, sk: int, gen, b: int = 1):
    """V whose rows are equal along the keys: small random integers per (batch, head, column)."""
    w = torch.randint(-8, 9, (b, HKV, 1, d), generator=gen).to(DTYPE[dtype])
    return w.expand(b, HKV, sk, d).contiguous()


def spec_params(spec, device) -> dict:
    """ALiBi's slopes (float32 on ``device``)."""
    names = {p.name for p in spec.params}
    return {"slopes": torch.linspace(0.01, 0.5, HQ).to(device)} if "slopes" in names else {}


_REFS: OrderedDict = OrderedDict()


def reference(spec, q, k, v, params, do=None):
    """The float64 reference's ``(o, lse, None)`` (CPU), with ``do`` ``(o, lse, (dq, dk,
    dv))``; the last few memoized (both families share one)."""
    key = repr((spec.name, q.dtype, tuple(q.shape), tuple(k.shape), float(k.flatten()[0]),
                v.sum().item(), v.flatten()[:64].tolist(), None if do is None else do.sum().item()))
    if key in _REFS:
        _REFS.move_to_end(key)
    else:
        while len(_REFS) >= 16:
            _REFS.popitem(last=False)
        p64 = {n: t.cpu().double() for n, t in params.items()}
        qr, kr, vr = (t.detach().cpu().double().requires_grad_(do is not None) for t in (q, k, v))
        o, lse = attention_reference(spec, qr, kr, vr, params=p64)
        grads = None
        if do is not None:
            o.backward(do.cpu().double())
            grads = (qr.grad, kr.grad, vr.grad)
        _REFS[key] = (o.detach(), lse.detach(), grads)
    return _REFS[key]


# ----------------------------------------------------------------------------- checks
def check_forward(o, lse, ref_o, ref_lse, dtype: str, what: str) -> None:
    """o finite and within a rounding of o of the float64 reference; lse finite and within
    :data:`LSE_RTOL` of it."""
    o, lse = o.detach().cpu().double(), lse.detach().cpu().double()
    assert torch.isfinite(o).all(), f"{what}: o has NaN / inf"
    assert torch.isfinite(lse).all(), f"{what}: lse has NaN / inf"
    torch.testing.assert_close(
        o, ref_o, rtol=O_RTOL[dtype], atol=1e-3, msg=lambda m: f"{what}: o: {m}"
    )
    rel = ((lse - ref_lse).abs() / ref_lse.abs()).max().item()
    assert rel <= LSE_RTOL, f"{what}: lse off by {rel:.3e} relative"


def dv_bound(do, causal: bool, sq: int, sk: int):
    """Per key and column, sum_i |dO_i| over the query rows (of the key's GQA group) that
    see the key: what dV = P^T dO can reach with 0 <= P <= 1."""
    a = do.detach().cpu().double().abs()  # [b, HQ, sq, d]
    if causal:  # bottom-right: query i sees keys j <= i + sk - sq
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        sees = (j <= i + sk - sq).double()  # [sq, sk]
    else:
        sees = torch.ones(sq, sk, dtype=torch.float64)
    per_head = torch.einsum("qk,bhqd->bhkd", sees, a)  # [b, HQ, sk, d]
    b, _, _, d = a.shape
    return per_head.view(b, HKV, HQ // HKV, sk, d).sum(2)


def run_forward_case(family, d, case, sign, lengths, dev) -> None:
    """The forward at huge logits on ``dev`` against the float64 reference."""
    dtype, mod, causal = case
    sq, sk = lengths
    spec = hdim_spec(d, d, dtype, mod, causal)
    op = build_op(spec, exact_options(family))
    gen = _gen("fwd", d, case, sign, lengths)
    q, k = qk(dtype, d, sign, sq, sk)
    if mod == "none":
        v = torch.randn((1, HKV, sk, d), generator=gen).to(DTYPE[dtype])
    else:
        v = keywise_constant_v(dtype, d, sk, gen)
    params = spec_params(spec, "cpu")
    ref_o, ref_lse, _ = reference(spec, q, k, v, params)
    with torch.no_grad():
        o, lse = op.attention(q.to(dev), k.to(dev), v.to(dev), **spec_params(spec, dev))
    what = f"forward {family} d{d} {case_id(case)} sign={sign} {sq}x{sk}"
    check_forward(o, lse, ref_o, ref_lse, dtype, what)


def run_backward_case(family, d, case, sign, lengths, dev) -> None:
    """The backward at huge logits on ``dev``, ``deterministic`` True and False: dQ and dK
    against the float64 reference (0 here), dV finite and within :func:`dv_bound`."""
    dtype, mod, causal = case
    sq, sk = lengths
    spec = hdim_spec(d, d, dtype, mod, causal)
    opts = exact_options(family)
    op = build_op(spec, opts)
    gen = _gen("bwd", d, case, sign, lengths)
    q, k = qk(dtype, d, sign, sq, sk)
    v = keywise_constant_v(dtype, d, sk, gen)
    do = torch.randint(-2, 3, (1, HQ, sq, d), generator=gen).to(DTYPE[dtype])
    params = spec_params(spec, "cpu")
    ref_o, ref_lse, (ref_dq, ref_dk, _) = reference(spec, q, k, v, params, do)
    bound = dv_bound(do, causal, sq, sk)
    # dS = P (dP - D) is 0 here; the scale of one key's term of dQ = scale * dS K (and of dK =
    # scale * dS^T Q): softmax_scale * c * max_i sum |dO_i| * max |v|
    row = do.double().abs().sum(-1).max().item()
    terms = C[dtype] / d**0.5 * row * v.double().abs().max().item()
    for det in (True, False):
        what = f"backward {family} d{d} {case_id(case)} sign={sign} {sq}x{sk} det={det}"
        qg, kg, vg = (t.to(dev, copy=True).requires_grad_(True) for t in (q, k, v))
        o, lse = op.attention(qg, kg, vg, deterministic=det, **spec_params(spec, dev))
        check_forward(o, lse, ref_o, ref_lse, dtype, what)
        o.backward(do.to(dev))
        if dev.type == "cuda":  # the kernels this case is about ran
            path = backward_path(spec, target_for_device(spec, dev), det, opts)
            assert (torch.cuda.current_device(), path) in op.backward._kernels, what
        for name, g in (("dq", qg.grad), ("dk", kg.grad), ("dv", vg.grad)):
            assert torch.isfinite(g.float()).all(), f"{what}: {name} has NaN / inf"
        for name, g, ref in (("dq", qg.grad, ref_dq), ("dk", kg.grad, ref_dk)):
            err = (g.detach().cpu().double() - ref).abs().max().item()
            assert err <= 2.0**-16 * terms + 1e-3, f"{what}: {name} off by {err:.3e} ({terms:.3e})"
        dv = vg.grad.detach().cpu().double().abs()
        over = (dv - (bound * (1 + 2.0**-7) + 1e-3)).max().item()
        assert over <= 0, f"{what}: |dv| exceeds the P <= 1 bound by {over:.3e}"


#: Decode: cache lengths before the append of one key per request
DECODE_LENS = (0, 16, 999)
DECODE_CAPACITY = 1024


def run_decode_case(d, dtype, sign, num_splits, paged, dev) -> None:
    """``with_kvcache`` at huge logits (an append of one key, 1 / 17 / 1000 live keys) on
    ``dev`` against the float64 reference on the gathered keys."""
    spec = hdim_spec(d, d, dtype, "none", True)
    op = build_op(spec, Options(exact_softmax=True))
    c, t = C[dtype], DTYPE[dtype]
    b, cap = len(DECODE_LENS), DECODE_CAPACITY
    gen = _gen("decode", d, dtype, sign)
    lens = torch.tensor(DECODE_LENS, dtype=torch.int32)
    w = torch.randint(-8, 9, (b, HKV, d), generator=gen).to(t)
    q = torch.full((b, HQ, 1, d), c, dtype=t)
    kn = torch.full((b, HKV, 1, d), sign * c, dtype=t)
    vn = w[:, :, None, :].clone()
    if paged:
        ps = 16
        per = cap // ps
        kc = torch.full((b * per, ps, HKV, d), sign * c, dtype=t)
        vc = w.repeat_interleave(per, dim=0)[:, None].expand(b * per, ps, HKV, d).contiguous()
        table = torch.arange(b * per, dtype=torch.int32).view(b, per)
    else:
        kc = torch.full((b, HKV, cap, d), sign * c, dtype=t)
        vc = w[:, :, None, :].expand(b, HKV, cap, d).contiguous()
        table = None
    with torch.no_grad():
        o, lse = op.with_kvcache(
            q.to(dev), kc.to(dev), vc.to(dev), lens.to(dev), k_new=kn.to(dev), v_new=vn.to(dev),
            block_table=None if table is None else table.to(dev), num_splits=num_splits,
        )  # fmt: skip
    what = f"decode d{d} {dtype} sign={sign} splits={num_splits} paged={paged}"
    for i, n in enumerate(int(x) + 1 for x in DECODE_LENS):  # the live keys of request i
        kk = torch.full((1, HKV, n, d), sign * c, dtype=t)
        vv = w[i : i + 1, :, None, :].expand(1, HKV, n, d)
        ref_o, ref_lse, _ = reference(spec, q[i : i + 1], kk, vv, {})
        check_forward(o[i : i + 1], lse[i : i + 1], ref_o, ref_lse, dtype, f"{what} request {i}")


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("family", ["auto", "fa2"])
@pytest.mark.parametrize("d", HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("sign", SIGNS.values(), ids=SIGNS.keys())
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_huge_logits_forward(family, d, case, sign, lengths):
    run_forward_case(family, d, case, sign, lengths, torch.device("cuda"))


@pytest.mark.parametrize("family", ["auto", "fa2"])
@pytest.mark.parametrize("d", HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("sign", SIGNS.values(), ids=SIGNS.keys())
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_huge_logits_backward(family, d, case, sign, lengths):
    run_backward_case(family, d, case, sign, lengths, torch.device("cuda"))


@pytest.mark.parametrize("d", HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("sign", SIGNS.values(), ids=SIGNS.keys())
@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_huge_logits_decode(d, dtype, sign, num_splits, paged):
    run_decode_case(d, dtype, sign, num_splits, paged, torch.device("cuda"))


#: Shipped specs for the ordinary-input control: no mask / causal at each head dim, an affine
#: score_mod (ALiBi), a non-affine one (Gemma 2's soft-capping), a sliding window.
ORDINARY = ["gpt2_d64", "causal_d128", "bidir_d256", "alibi", "gemma2_softcap", "mistral_swa"]


@pytest.mark.parametrize("family", ["auto", "fa2"])
@pytest.mark.parametrize("name", ORDINARY)
def test_ordinary_inputs_under_the_option(name, family, monkeypatch, error_bound):
    """Random inputs of ordinary magnitude, forward and both backward paths, under the
    option: the float64 reference's bounds of test_forward.py and test_backward_kernels.py."""
    gpu_options.use(monkeypatch, family=family, atomic_dq=True, exact_softmax=True)
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    extra = {"window": 37} if spec.param("window") is not None else {}
    check(spec, 2, 4, 2, 127, 1000, error_bound, seed=3, **extra)
    check(spec, 1, 4, 1, 1000, 17, error_bound, seed=4, **extra)
    for det in (True, False):
        check_grads(spec, 2, 4, 2, 127, 257, seed=5, deterministic=det)


def test_ordinary_decode_under_the_option():
    run_ordinary_decode(torch.device("cuda"))


def run_ordinary_decode(dev) -> None:
    """Random caches of ordinary magnitude under the option, several splits, on ``dev``: the
    float64 reference's bound (twice the bf16 reference's error, plus 1e-3)."""
    spec = load_spec(REPO / "specs" / "llama3_gqa.yaml")
    op = build_op(spec, Options(exact_softmax=True))
    g = torch.Generator().manual_seed(7)
    b, hq, hkv, d, cap = 2, 8, 2, spec.head_dim, 2048
    q = torch.randn((b, hq, 1, d), generator=g).to(torch.bfloat16)
    kc = torch.randn((b, hkv, cap, d), generator=g).to(torch.bfloat16)
    vc = torch.randn((b, hkv, cap, d), generator=g).to(torch.bfloat16)
    lens = torch.tensor([777, 2048], dtype=torch.int32)
    for splits in (1, 3, 8):
        with torch.no_grad():
            o, lse = op.with_kvcache(q.to(dev), kc.to(dev), vc.to(dev), lens.to(dev),
                                     num_splits=splits)  # fmt: skip
        for i, n in enumerate(lens.tolist()):
            args = (q[i : i + 1], kc[i : i + 1, :, :n], vc[i : i + 1, :, :n])
            ref_o, ref_lse = attention_reference(spec, *(a.double() for a in args))
            low, _ = attention_reference(spec, *args, compute_dtype=torch.bfloat16)
            bound = 2 * (low.double() - ref_o).abs().max().item() + 1e-3
            err = (o[i : i + 1].cpu().double() - ref_o).abs().max().item()
            assert err <= bound, f"splits={splits} request {i}: {err:.3e} > {bound:.3e}"
            torch.testing.assert_close(lse[i : i + 1].cpu().double(), ref_lse, rtol=1e-4, atol=1e-4)
