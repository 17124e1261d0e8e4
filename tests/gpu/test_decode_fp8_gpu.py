"""The FP8 (e4m3) KV cache of op.with_kvcache on the device (the decode family's kv8 units)
against the float64 reference on the dequantized cache
(``python -m pytest -q tests/gpu/test_decode_fp8_gpu.py``).

Bound (tests/gpu/test_decode_gpu.py's rule, on the dequantized inputs): max|ours - ref64| <=
2 * max|ref in bf16/fp16 - ref64| + 1e-3 for o; lse within 1e-2 relative where finite, -inf
(with o == 0) exactly where the reference's is.  Outputs poisoned (NaN) before launch; unused
cache slots hold the e4m3 NaN code.  Descales are random per (request, kv head), never 1.
Also: every e4m3 code at every head-dim column read exactly (one-hot q, one key), num_splits
1..128, packing off bitwise equal, appends of e4m3 rows in place, an e4m3 q, ragged Sq_new,
the planned fast path and a CUDA graph, and the kv8 unit faster than the bf16 one at the same
shape (half the bytes).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen.ops.decode.op import decode_op, decode_reference  # noqa: E402
from flashgen.ops.op import poison_outputs  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
E4M3 = getattr(torch, "float8_e4m3fn", None)
SPECS = ["llama3_gqa", "mistral_swa", "gemma2_softcap", "alibi", "gpt2_d64"]


def op_of(name):
    return flashgen.load(REPO / "specs" / f"{name}.yaml")


@pytest.fixture(scope="module", autouse=True)
def _prebuild():
    """Build the kv8 units of the specs used here for this device at once (parallel nvcc)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda", torch.cuda.current_device())
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        dops = [decode_op(op_of(n)) for n in SPECS]
        jobs = [(d, r) for d in dops for r in (False, True)]
        list(pool.map(lambda j: j[0].kernels(dev, ragged=j[1], cache_dtype="fp8_e4m3"), jobs))


def params_of(name, hq, dev):
    if name == "alibi":
        return {"slopes": torch.tensor([2.0 ** (-8 * (i + 1) / hq) for i in range(hq)], device=dev)}
    if name == "mistral_swa":
        return {"window": 37}
    return {}


def e4m3(*shape, g, scale=64.0):
    """Random e4m3 codes (about N(0, scale^2) rounded; |x| <= 448)."""
    x = torch.randn(*shape, generator=g, device="cuda") * scale
    return x.clamp(-448, 448).to(E4M3)


def make_cache(lens, *, ps, hkv, d, dv, layout="paged", cap=None, extra_pages=5, seed=0):
    """An e4m3 cache (paged vLLM layout or dense) with random codes at the live slots, the
    NaN code elsewhere, and random descales in [0.005, 0.03] per (request, kv head):
    ``(k_cache, v_cache, block_table or None, k_descale, v_descale)``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch = len(lens)
    cap = cap or max(max(lens), 1)
    kd = torch.rand(batch, hkv, generator=g, device="cuda") * 0.025 + 0.005
    vd = torch.rand(batch, hkv, generator=g, device="cuda") * 0.025 + 0.005
    if layout == "dense":
        kc = torch.full((batch, hkv, cap, d), float("nan"), device="cuda").to(E4M3)
        vc = torch.full((batch, hkv, cap, dv), float("nan"), device="cuda").to(E4M3)
        for b, n in enumerate(lens):
            kc[b, :, :n], vc[b, :, :n] = e4m3(hkv, n, d, g=g), e4m3(hkv, n, dv, g=g)
        return kc, vc, None, kd, vd
    max_pages = -(-cap // ps)
    num_pages = batch * max_pages + extra_pages
    perm = torch.randperm(num_pages, generator=g, device="cuda")
    table = perm[: batch * max_pages].view(batch, max_pages).int().contiguous()
    kc = torch.full((num_pages, ps, hkv, d), float("nan"), device="cuda").to(E4M3)
    vc = torch.full((num_pages, ps, hkv, dv), float("nan"), device="cuda").to(E4M3)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        pos = torch.arange(n, device="cuda")
        pages = table[b].long()[pos // ps]
        kc[pages, pos % ps] = e4m3(n, hkv, d, g=g)
        vc[pages, pos % ps] = e4m3(n, hkv, dv, g=g)
    return kc, vc, table, kd, vd


def check(spec, q, kc, vc, table, live, params, o, lse, kd, vd, q64=None):
    """The accuracy rule against decode_reference on the dequantized cache in float64 (and
    ``q64``, a dequantized e4m3 q) and in the spec's dtype."""
    lens = torch.as_tensor(live)
    r64o, r64l = decode_reference(spec, q if q64 is None else q64, kc, vc, lens, table,
                                  params=params, k_descale=kd, v_descale=vd)  # fmt: skip
    rlo, _ = decode_reference(spec, q, kc, vc, lens, table, params=params, compute_dtype=q.dtype,
                              k_descale=kd, v_descale=vd)  # fmt: skip
    assert not torch.isnan(o).any(), "NaN in o (a row left unwritten, or garbage read)"
    bound = 2 * (rlo.double() - r64o).abs().max().item() + 1e-3
    err = (o.double() - r64o).abs().max().item()
    assert err <= bound, f"o error {err:.3g} > bound {bound:.3g}"
    fin = torch.isfinite(r64l)
    assert torch.equal(torch.isfinite(lse), fin)
    assert bool((lse[~fin] == -math.inf).all()) and bool((o[~fin] == 0).all())
    if fin.any():
        rel = ((lse.double() - r64l).abs() / r64l.abs().clamp_min(1.0))[fin].max().item()
        assert rel <= 1e-2


LAYOUTS = [("paged", 1), ("paged", 16), ("paged", 256), ("dense", 0)]
CASES = [(n, lay, ps, sq, heads) for n in ("llama3_gqa", "mistral_swa") for lay, ps in LAYOUTS
         for sq in (1, 4) for heads in ((32, 8), (8, 1))]  # fmt: skip
CASES += [(n, "paged", 16, sq, (32, 8)) for n in ("gemma2_softcap", "alibi", "gpt2_d64")
          for sq in (1, 4)]  # fmt: skip


@pytest.mark.parametrize("name,layout,ps,sq,heads", CASES, ids=str)
def test_matrix_against_float64(name, layout, ps, sq, heads):
    op = op_of(name)
    spec = op.spec
    hq, hkv = heads
    lens = [1, 17, 1000, 4097]
    append = sq == 4  # Sq_new 4 appends e4m3 k_new / v_new; 1 attends to the cache only
    cap = max(lens) + (sq if append else 0)
    kc, vc, table, kd, vd = make_cache(lens, ps=max(ps, 1), hkv=hkv, d=spec.head_dim,
                                       dv=spec.head_dim_v, layout=layout, cap=cap)  # fmt: skip
    dt = torch.bfloat16 if spec.dtype == "bf16" else torch.float16
    q = torch.randn(len(lens), hq, sq, spec.head_dim, device="cuda").to(dt)
    params = params_of(name, hq, q.device)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kw = {}
    if append:
        g = torch.Generator(device="cuda").manual_seed(7)
        kw["k_new"] = e4m3(len(lens), hkv, sq, spec.head_dim, g=g)
        kw["v_new"] = e4m3(len(lens), hkv, sq, spec.head_dim_v, g=g)
    with poison_outputs():
        o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, k_descale=kd,
                                 v_descale=vd, **kw, **params)  # fmt: skip
    torch.cuda.synchronize()
    assert o.dtype == dt
    live = [n + (sq if append else 0) for n in lens]
    check(spec, q, kc, vc, table, live, params, o, lse, kd, vd)


@pytest.mark.parametrize("name", ["llama3_gqa", "gpt2_d64"])
def test_every_code_at_every_column_reads_exactly(name):
    """One live key per request, q one-hot at column h for query head h: lse[b, h] is
    k_descale * K[b, h] * softmax_scale (the e4m3 conversion and the Q column order), and o[b,
    h] is v_descale * V[b] rounded once (P = 1).  Request b holds code (b + j) % 256 at column
    j of K and (b + 3j) % 256 of V (NaN codes as 0), so every code meets every column."""
    op = op_of(name)
    d = op.spec.head_dim
    dt = torch.bfloat16 if op.spec.dtype == "bf16" else torch.float16
    b_ = 256
    codes = torch.arange(256, device="cuda")
    cols = torch.arange(d, device="cuda")
    kcode = (codes[:, None] + cols[None, :]) % 256
    vcode = (codes[:, None] + 3 * cols[None, :]) % 256
    kcode[(kcode == 0x7F) | (kcode == 0xFF)] = 0
    vcode[(vcode == 0x7F) | (vcode == 0xFF)] = 0
    kc = kcode.to(torch.uint8).view(E4M3).view(b_, 1, 1, d).contiguous()
    vc = vcode.to(torch.uint8).view(E4M3).view(b_, 1, 1, d).contiguous()
    kd = torch.full((b_, 1), 0.0078125, device="cuda")  # 2^-7: K * kd exact in float32
    vd = torch.rand(b_, 1, device="cuda") + 0.5
    q = torch.eye(d, device="cuda").to(dt).expand(b_, d, d).reshape(b_, d, 1, d).contiguous()
    lens = torch.ones(b_, dtype=torch.int32, device="cuda")
    scale = 1.0
    o, lse = op.with_kvcache(q, kc, vc, lens, k_descale=kd, v_descale=vd, softmax_scale=scale)
    torch.cuda.synchronize()
    want_lse = kc.view(b_, d).float() * kd
    assert torch.allclose(lse.view(b_, d), want_lse, rtol=2e-6, atol=1e-6)
    want_o = (vc.view(b_, 1, d).float() * vd[:, :, None]).to(dt).expand(b_, d, d)
    assert torch.equal(o.view(b_, d, d), want_o)


def test_num_splits_and_packing():
    op = op_of("llama3_gqa")
    lens = [65537, 3]
    kc, vc, table, kd, vd = make_cache(lens, ps=16, hkv=8, d=128, dv=128)
    q = torch.randn(2, 32, 1, 128, device="cuda").to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for splits in (None, 1, 2, 3, 7, 16, 64, 128):
        with poison_outputs():
            o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, num_splits=splits,
                                     k_descale=kd, v_descale=vd)  # fmt: skip
        check(op.spec, q, kc, vc, table, lens, {}, o, lse, kd, vd)
    res = []
    for pack in (True, False):
        p = op.plan_decode(batch=2, num_heads=32, num_heads_kv=8, seqlen_q=1,
                           cache_capacity=table.shape[1] * 16, page_size=16, num_pages=kc.shape[0],
                           num_splits=4, pack_gqa=pack, cache_dtype=E4M3)  # fmt: skip
        res.append(op.with_kvcache(q, kc, vc, lens_t, block_table=table, plan=p, k_descale=kd,
                                   v_descale=vd))  # fmt: skip
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])


def test_append_in_place_and_e4m3_q():
    op = op_of("alibi")
    lens = [0, 15, 16, 31]
    kc, vc, table, kd, vd = make_cache([40] * 4, ps=16, hkv=2, d=128, dv=128)
    kc0, vc0 = kc.clone(), vc.clone()
    g = torch.Generator(device="cuda").manual_seed(3)
    kn, vn = e4m3(4, 2, 4, 128, g=g), e4m3(4, 2, 4, 128, g=g)
    q8 = e4m3(4, 8, 4, 128, g=g, scale=32.0)
    qd = torch.rand(4, 2, device="cuda") * 0.05 + 0.01
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    prm = params_of("alibi", 8, q8.device)
    o, lse = op.with_kvcache(q8, kc, vc, lens_t, block_table=table, k_new=kn, v_new=vn,
                             k_descale=kd, v_descale=vd, q_descale=qd, **prm)  # fmt: skip
    from flashgen.ops.decode.op import append_reference

    append_reference(kc0, vc0, lens_t.cpu(), kn, vn, table.cpu())
    u8 = torch.uint8
    assert torch.equal(kc.view(u8), kc0.view(u8)) and torch.equal(vc.view(u8), vc0.view(u8))
    q64 = q8.double() * qd.double().repeat_interleave(4, 1)[:, :, None, None]
    check(op.spec, q64.to(torch.bfloat16), kc, vc, table, [n + 4 for n in lens], prm, o, lse, kd,
          vd, q64=q64)  # fmt: skip


def test_ragged_against_float64():
    op = op_of("mistral_swa")
    lens, sqs = [5, 300, 0, 4097, 17], [1, 0, 4, 64, 1]
    cap = max(n + s for n, s in zip(lens, sqs, strict=True))
    kc, vc, table, kd, vd = make_cache(lens, ps=16, hkv=8, d=128, dv=128, cap=cap)
    cu = torch.tensor([0, *torch.tensor(sqs).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total = sum(sqs)
    q = torch.randn(total, 32, 128, device="cuda").to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    with poison_outputs():
        o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, cu_seqlens_q=cu,
                                 max_seqlen_q=max(sqs), k_descale=kd, v_descale=vd,
                                 window=37)  # fmt: skip
    torch.cuda.synchronize()
    for b in range(len(lens)):
        q0, q1 = int(cu[b]), int(cu[b + 1])
        if q1 == q0:
            continue
        qb = q[q0:q1].permute(1, 0, 2)[None]
        check(op.spec, qb, kc, vc, table[b : b + 1], [lens[b]], {"window": 37},
              o[q0:q1].permute(1, 0, 2)[None], lse[:, q0:q1][None], kd[b : b + 1],
              vd[b : b + 1])  # fmt: skip


def test_planned_fast_path_and_graph_capture():
    """The planned call (prepacked arguments) equals the unplanned one bitwise, descale
    tensors replaced in place between graph replays are read on the device, and a Python
    descale works too."""
    op = op_of("mistral_swa")
    batch, ps = 4, 16
    kc, vc, table, kd, vd = make_cache([2000] * batch, ps=ps, hkv=8, d=128, dv=128)
    q = torch.randn(batch, 32, 1, 128, device="cuda").to(torch.bfloat16)
    lens_t = torch.tensor([10, 500, 1999, 0], dtype=torch.int32, device="cuda")
    p = op.plan_decode(batch=batch, num_heads=32, num_heads_kv=8, seqlen_q=1,
                       cache_capacity=table.shape[1] * ps, page_size=ps, num_pages=kc.shape[0],
                       cache_dtype=E4M3)  # fmt: skip
    assert p.fast is not None
    a = op.with_kvcache(q, kc, vc, lens_t, block_table=table, plan=p, k_descale=kd, v_descale=vd)
    b = op.with_kvcache(q, kc, vc, lens_t, block_table=table, num_splits=p.num_splits,
                        k_descale=kd, v_descale=vd)  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = op.with_kvcache(q, kc, vc, lens_t, block_table=table, plan=p, k_descale=0.01,
                        v_descale=vd)  # fmt: skip
    check(op.spec, q, kc, vc, table, lens_t.tolist(), {"window": 4096}, *c,
          torch.full_like(kd, 0.01), vd)  # fmt: skip
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        og, lg = op.with_kvcache(q, kc, vc, lens_t, block_table=table, plan=p, k_descale=kd,
                                 v_descale=vd)  # fmt: skip
    for new in ([1, 2, 3, 4], [1999, 1000, 0, 64]):
        lens_t.copy_(torch.tensor(new, dtype=torch.int32))
        kd.mul_(1.5)
        vd.mul_(0.5)
        graph.replay()
        torch.cuda.synchronize()
        check(op.spec, q, kc, vc, table, new, {"window": 4096}, og, lg, kd, vd)


def _graph_ms(fn, calls=20, rounds=5):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(rounds):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / calls)
    return sorted(times)[len(times) // 2]


@pytest.mark.parametrize("batch,cache", [(1, 65536), (16, 32768)])
def test_faster_than_the_bf16_cache_at_the_same_shape(batch, cache):
    """Half the bytes: the e4m3 cache's call takes less time than the bf16 cache's at the
    same shape (paged 16, d128, 32/8 heads, Sq_new 1; CUDA graphs, medians)."""
    op = op_of("llama3_gqa")
    hq, hkv, ps = 32, 8, 16
    pages = batch * cache // ps
    kb = torch.randn(pages, ps, hkv, 128, device="cuda").to(torch.bfloat16)
    vb = torch.randn_like(kb)
    k8, v8 = kb.to(E4M3), vb.to(E4M3)
    table = torch.randperm(pages, device="cuda").int().view(batch, -1).contiguous()
    q = torch.randn(batch, hq, 1, 128, device="cuda").to(torch.bfloat16)
    lens = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
    kd = torch.full((batch, hkv), 0.01, device="cuda")
    kw = dict(batch=batch, num_heads=hq, num_heads_kv=hkv, seqlen_q=1, cache_capacity=cache,
              page_size=ps, num_pages=pages)  # fmt: skip
    p16, p8 = op.plan_decode(**kw), op.plan_decode(**kw, cache_dtype=E4M3)
    t16 = _graph_ms(lambda: op.with_kvcache(q, kb, vb, lens, block_table=table, plan=p16))
    t8 = _graph_ms(lambda: op.with_kvcache(q, k8, v8, lens, block_table=table, plan=p8,
                                           k_descale=kd, v_descale=kd))  # fmt: skip
    assert t8 < t16, f"e4m3 {t8 * 1e3:.1f} us >= bf16 {t16 * 1e3:.1f} us"
