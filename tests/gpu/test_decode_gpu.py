"""Serving kernels (op.with_kvcache: split-KV, paged cache, GQA packing) on the device against
the float64 reference on the gathered cache (``python -m pytest -q tests/gpu/test_decode_gpu.py``).

Bound (the rule of tests/gpu/test_forward.py): max|ours - ref64| <= 2 * max|ref in bf16/fp16 -
ref64| + 1e-3 for o; lse within 1e-2 relative where finite, -inf (with o == 0) exactly where the
reference's is.  Outputs are poisoned (NaN) before launch; unused cache slots hold NaN (and 1e4)
so a read past the live keys fails.  Also: results bitwise independent of the allocated cache
size and of the other requests in the batch for a fixed num_splits, num_splits 1..128 within
the rule, packing on/off bitwise equal, k_new appended in place, CUDA-graph capture with a plan.
Ragged Sq_new (``-k ragged``: cu_seqlens_q, Sq_b 0 / 1..64 per request, dense and paged, GQA,
appends, a sliding window; planned calls with the fast path and out=, graph capture with a
ragged plan, torch.compile).
"""

from __future__ import annotations

import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen.families import decode as family  # noqa: E402
from flashgen.ops.decode.op import decode_op, decode_reference  # noqa: E402
from flashgen.ops.op import poison_outputs  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from head_dim_cases import NEW_HEAD_DIMS, dims_id, hdim_spec  # noqa: E402

ALL = ["alibi", "bidir_d256", "causal_d128", "chunked_local", "gemma2_softcap", "gpt2_d64",
       "llama3_gqa", "mistral_swa", "prefix_lm", "t5_bias"]  # fmt: skip
FULL = ["mistral_swa", "gemma2_softcap", "alibi", "llama3_gqa"]


def op_of(name):
    return flashgen.load(REPO / "specs" / f"{name}.yaml")


@pytest.fixture(scope="module", autouse=True)
def _prebuild():
    """Build every decode unit for this device at once (parallel nvcc)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda", torch.cuda.current_device())
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        dops = [decode_op(op_of(n)) for n in ALL]  # registration: one thread
        jobs = [(d, ragged) for d in dops for ragged in (False, True)]  # padded, ragged units
        list(pool.map(lambda j: j[0].kernels(dev, ragged=j[1]), jobs))


def params_of(name, hq, dev):
    if name == "alibi":
        return {"slopes": torch.tensor([2.0 ** (-8 * (i + 1) / hq) for i in range(hq)], device=dev)}
    if name == "t5_bias":
        return {"bias": torch.randn(hq, 257, device=dev)}
    if name == "mistral_swa":
        return {"window": 37}
    if name == "chunked_local":
        return {"chunk": 50}
    if name == "prefix_lm":
        return {"prefix": 9}
    return {}


def make_cache(lens, *, ps, hkv, d, dv, dtype, layout="paged", fill=float("nan"), cap=None,
               extra_pages=5, seed=0):  # fmt: skip
    """A cache whose unused slots hold ``fill``; ``layout``: paged (vLLM), flashinfer
    ([P, Hkv, ps, D] viewed through strides), dense, bshd (dense [B, S, Hkv, D] viewed)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch = len(lens)
    cap = cap or max(max(lens), 1)
    if layout in ("dense", "bshd"):
        shape = (batch, cap, hkv) if layout == "bshd" else (batch, hkv, cap)
        kc = torch.full((*shape, d), fill, dtype=dtype, device="cuda")
        vc = torch.full((*shape, dv), fill, dtype=dtype, device="cuda")
        if layout == "bshd":
            kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
        for b, n in enumerate(lens):
            kc[b, :, :n] = torch.randn(hkv, n, d, generator=g, device="cuda").to(dtype)
            vc[b, :, :n] = torch.randn(hkv, n, dv, generator=g, device="cuda").to(dtype)
        return kc, vc, None
    max_pages = -(-cap // ps)
    num_pages = batch * max_pages + extra_pages
    perm = torch.randperm(num_pages, generator=g, device="cuda")
    table = perm[: batch * max_pages].view(batch, max_pages).int().contiguous()
    shape = (num_pages, hkv, ps) if layout == "flashinfer" else (num_pages, ps, hkv)
    kc = torch.full((*shape, d), fill, dtype=dtype, device="cuda")
    vc = torch.full((*shape, dv), fill, dtype=dtype, device="cuda")
    if layout == "flashinfer":
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        k = torch.randn(n, hkv, d, generator=g, device="cuda").to(dtype)
        v = torch.randn(n, hkv, dv, generator=g, device="cuda").to(dtype)
        pos = torch.arange(n, device="cuda")
        pages = table[b].long()[pos // ps]
        kc[pages, pos % ps] = k
        vc[pages, pos % ps] = v
    return kc, vc, table


def check(spec, q, kc, vc, table, live, params, o, lse):
    """The accuracy rule against decode_reference in float64 and in the input dtype."""
    lens = torch.as_tensor(live)
    r64o, r64l = decode_reference(spec, q, kc, vc, lens, table, params=params)
    rlo, _ = decode_reference(spec, q, kc, vc, lens, table, params=params, compute_dtype=q.dtype)
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


LAYOUTS = [("paged", 1), ("paged", 3), ("paged", 16), ("paged", 256), ("dense", 0)]
CASES = [(n, lay, ps, sq, heads) for n in FULL for lay, ps in LAYOUTS for sq in (1, 4, 64)
         for heads in ((32, 8), (8, 1))]  # fmt: skip
CASES += [(n, "paged", 16, sq, (32, 8)) for n in ALL if n not in FULL for sq in (1, 4)]
CASES += [("llama3_gqa", "flashinfer", 16, 1, (32, 8)), ("mistral_swa", "bshd", 0, 4, (8, 1))]


@pytest.mark.parametrize("name,layout,ps,sq,heads", CASES, ids=str)
def test_matrix_against_float64(name, layout, ps, sq, heads):
    op = op_of(name)
    spec = op.spec
    hq, hkv = heads
    p = max(ps, 1) if layout != "dense" else 64
    lens = [0, 1, max(p - 1, 0), p, p + 1, 4097]
    append = sq == 4  # Sq_new 4 appends k_new / v_new; 1 and 64 attend to the cache only
    cap = max(lens) + (sq if append else 0)
    kc, vc, table = make_cache(lens, ps=max(ps, 1), hkv=hkv, d=spec.head_dim, dv=spec.head_dim_v,
                               dtype=torch.bfloat16 if spec.dtype == "bf16" else torch.float16,
                               layout=layout, cap=cap)  # fmt: skip
    dt = kc.dtype
    q = torch.randn(len(lens), hq, sq, spec.head_dim, device="cuda").to(dt)
    params = params_of(name, hq, q.device)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kw = {}
    if append:
        kw["k_new"] = torch.randn(len(lens), hkv, sq, spec.head_dim, device="cuda").to(dt)
        kw["v_new"] = torch.randn(len(lens), hkv, sq, spec.head_dim_v, device="cuda").to(dt)
    with poison_outputs():
        o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, **kw, **params)
    torch.cuda.synchronize()
    live = [n + (sq if append else 0) for n in lens]
    check(spec, q, kc, vc, table, live, params, o, lse)


def test_long_cache_65537_and_every_num_splits():
    op = op_of("llama3_gqa")
    lens = [65537, 3]
    kc, vc, table = make_cache(lens, ps=16, hkv=8, d=128, dv=128, dtype=torch.bfloat16)
    q = torch.randn(2, 32, 1, 128, device="cuda").to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for splits in (None, 1, 2, 3, 7, 16, 64, 128):
        with poison_outputs():
            o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, num_splits=splits)
        check(op.spec, q, kc, vc, table, lens, {}, o, lse)


def test_garbage_1e4_and_nan_change_nothing():
    op = op_of("gemma2_softcap")
    lens = [5, 16, 17, 300]
    q = torch.randn(4, 8, 4, 256, device="cuda").to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    outs = []
    for fill in (0.0, 1e4, float("nan"), float("inf")):
        kc, vc, table = make_cache(
            lens, ps=16, hkv=2, d=256, dv=256, dtype=torch.bfloat16, fill=fill
        )
        outs.append(op.with_kvcache(q, kc, vc, lens_t, block_table=table, num_splits=3))
    for o, lse in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(lse, outs[0][1])


@pytest.mark.parametrize("splits", [1, 5])
def test_independent_of_cache_size_and_batch(splits):
    op = op_of("mistral_swa")
    lens = [1000, 37, 4097]
    q = torch.randn(3, 32, 4, 128, device="cuda").to(torch.bfloat16)
    kc, vc, table = make_cache(lens, ps=16, hkv=8, d=128, dv=128, dtype=torch.bfloat16, seed=1)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, num_splits=splits, window=300)
    # the same requests alone, and in a cache with more pages and longer table rows
    for b in range(3):
        big = torch.full(
            (kc.shape[0] + 40, *kc.shape[1:]), float("nan"), dtype=kc.dtype, device="cuda"
        )
        bigv = torch.full_like(big, float("nan"))
        big[: kc.shape[0]], bigv[: kc.shape[0]] = kc, vc
        tb = torch.full((1, table.shape[1] + 30), kc.shape[0] + 7, dtype=torch.int32, device="cuda")
        tb[0, : table.shape[1]] = table[b]
        ob, lb = op.with_kvcache(q[b : b + 1], big, bigv, lens_t[b : b + 1], block_table=tb,
                                 num_splits=splits, window=300)  # fmt: skip
        assert torch.equal(ob, o[b : b + 1]) and torch.equal(lb, lse[b : b + 1])
    # dense: a longer allocation changes nothing either
    kd, vd, _ = make_cache(
        lens, ps=1, hkv=8, d=128, dv=128, dtype=torch.bfloat16, layout="dense", seed=2
    )
    od, ld = op.with_kvcache(q, kd, vd, lens_t, num_splits=splits, window=300)
    kd2 = torch.full((3, 8, 6000, 128), float("nan"), dtype=kd.dtype, device="cuda")
    vd2 = torch.full_like(kd2, float("nan"))
    kd2[:, :, : kd.shape[2]], vd2[:, :, : kd.shape[2]] = kd, vd
    od2, ld2 = op.with_kvcache(q, kd2, vd2, lens_t, num_splits=splits, window=300)
    assert torch.equal(od, od2) and torch.equal(ld, ld2)


def test_pack_gqa_off_is_bitwise_equal():
    op = op_of("llama3_gqa")
    dop = decode_op(op)
    lens = [4097, 100]
    kc, vc, table = make_cache(lens, ps=16, hkv=8, d=128, dv=128, dtype=torch.bfloat16)
    q = torch.randn(2, 32, 1, 128, device="cuda").to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    res = []
    for pack in (True, False):
        p = op.plan_decode(batch=2, num_heads=32, num_heads_kv=8, seqlen_q=1,
                           cache_capacity=table.shape[1] * 16, page_size=16, num_pages=kc.shape[0],
                           num_splits=4, pack_gqa=pack)  # fmt: skip
        res.append(op.with_kvcache(q, kc, vc, lens_t, block_table=table, plan=p))
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])
    del dop


def test_append_in_place_matches_the_reference_cache():
    op = op_of("alibi")
    lens = [0, 15, 16, 31]
    kc, vc, table = make_cache([40] * 4, ps=16, hkv=2, d=128, dv=128, dtype=torch.bfloat16)
    kc0, vc0 = kc.clone(), vc.clone()
    kn = torch.randn(4, 2, 4, 128, device="cuda").to(torch.bfloat16)
    vn = torch.randn(4, 2, 4, 128, device="cuda").to(torch.bfloat16)
    q = torch.randn(4, 8, 4, 128, device="cuda").to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    prm = params_of("alibi", 8, q.device)
    op.with_kvcache(q, kc, vc, lens_t, block_table=table, k_new=kn, v_new=vn, **prm)
    from flashgen.ops.decode.op import append_reference

    append_reference(kc0, vc0, lens_t.cpu(), kn, vn, table.cpu())
    assert torch.equal(kc.isnan(), kc0.isnan())
    assert torch.equal(kc.nan_to_num(), kc0.nan_to_num()) and torch.equal(
        vc.nan_to_num(), vc0.nan_to_num()
    )


def test_graph_capture_with_a_plan():
    op = op_of("mistral_swa")
    batch, ps = 4, 16
    kc, vc, table = make_cache([2000] * batch, ps=ps, hkv=8, d=128, dv=128, dtype=torch.bfloat16)
    q = torch.randn(batch, 32, 1, 128, device="cuda").to(torch.bfloat16)
    lens_t = torch.tensor([10, 500, 1999, 0], dtype=torch.int32, device="cuda")
    p = op.plan_decode(
        batch=batch,
        num_heads=32,
        num_heads_kv=8,
        seqlen_q=1,
        cache_capacity=table.shape[1] * ps,
        page_size=ps,
        num_pages=kc.shape[0],
    )
    o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, plan=p)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        og, lg = op.with_kvcache(q, kc, vc, lens_t, block_table=table, plan=p)
    for new in ([1, 2, 3, 4], [1999, 1000, 0, 64]):
        lens_t.copy_(torch.tensor(new, dtype=torch.int32))
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(q.dtype))
        table.copy_(table.flip(0))
        graph.replay()
        eo, el = op.with_kvcache(q, kc, vc, lens_t, block_table=table, plan=p)
        torch.cuda.synchronize()
        assert torch.equal(og, eo) and torch.equal(lg, el)
        check(op.spec, q, kc, vc, table, new, {"window": 4096}, og, lg)


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_bad_page_index_is_empty_not_a_crash(splits):
    """Unchecked values: request 0's page 1 and request 1's page 0 are out of range (empty),
    request 1's length 10**6 is clamped to its 3 pages (48 keys), whose slots all hold keys
    (so the clamped tail is real data, not the NaN fill).  The rest is attended: o equals the
    masked float64 softmax over exactly unchecked_key_mask's keys, for every num_splits."""
    from flashgen.ops.decode.op import unchecked_key_mask, validate_decode

    op = op_of("llama3_gqa")
    kc, vc, table = make_cache([40, 48], ps=16, hkv=2, d=128, dv=128, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 1, 128, device="cuda").to(torch.bfloat16)
    bad = table.clone()
    bad[0, 1] = 10**6
    bad[1, 0] = -5
    lens_t = torch.tensor([40, 10**6], dtype=torch.int32, device="cuda")
    o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=bad, num_splits=splits)
    torch.cuda.synchronize()
    dims = validate_decode(op.spec, q, kc, vc, lens_t, bad)
    live, mask = unchecked_key_mask(dims, lens_t, bad)
    assert live.tolist() == [40, 48] and mask.sum(1).tolist() == [24, 32]
    scale = 1 / math.sqrt(128)
    for b in range(2):
        keys = torch.nonzero(mask[b]).flatten().tolist()
        pos = torch.tensor(keys, device="cuda")
        pages = table[b].long()[pos // 16]  # the good table: where make_cache put the keys
        k = kc[pages, pos % 16].double()  # [n, Hkv, D]
        v = vc[pages, pos % 16].double()
        for h in range(4):  # causal, Sq_new = 1: every live key is visible
            s_ = (k[:, h // 2] @ q[b, h, 0].double()) * scale
            ref_l = torch.logsumexp(s_, 0)
            ref_o = torch.softmax(s_, 0) @ v[:, h // 2]
            assert abs(lse[b, h, 0].item() - ref_l.item()) <= 1e-2 * max(1.0, abs(ref_l.item()))
            assert (o[b, h, 0].double() - ref_o).abs().max().item() <= 2e-2


def test_nan_in_a_live_key_is_nan_for_every_num_splits():
    """A NaN inside the live keys is the request's data: o and lse are NaN whatever the split
    count (the combine once dropped a NaN split and returned o = 0, lse = -inf)."""
    op = op_of("llama3_gqa")
    kc, vc, table = make_cache([40, 600], ps=16, hkv=2, d=128, dv=128, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 1, 128, device="cuda").to(torch.bfloat16)
    lens_t = torch.tensor([40, 600], dtype=torch.int32, device="cuda")
    kc[table[1, 18].long(), 12:16] = float("nan")  # request 1, keys 300..303
    for splits in (1, 2, 3):
        o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, num_splits=splits)
        torch.cuda.synchronize()
        assert torch.isfinite(lse[0]).all() and not torch.isnan(o[0]).any()
        assert torch.isnan(lse[1]).all() and torch.isnan(o[1]).all(), splits


@pytest.mark.parametrize("append", [False, True])
def test_planned_fast_path_equals_the_general_path(append):
    """The planned call (prepacked arguments, cuLaunchKernel) is bitwise the unplanned one
    (CuPy launch) for the same num_splits, with and without an append, across a layout
    change (a second cache) and a block-table change between calls."""
    op = op_of("alibi")
    batch, ps = 3, 16
    kc, vc, table = make_cache([3000] * batch, ps=ps, hkv=2, d=128, dv=128, dtype=torch.bfloat16)
    q = torch.randn(batch, 8, 1, 128, device="cuda").to(torch.bfloat16)
    lens_t = torch.tensor([5, 1500, 2990], dtype=torch.int32, device="cuda")
    prm = params_of("alibi", 8, q.device)
    kn = torch.randn(batch, 2, 1, 128, device="cuda").to(torch.bfloat16) if append else None
    vn = torch.randn_like(kn) if append else None
    p = op.plan_decode(batch=batch, num_heads=8, num_heads_kv=2, seqlen_q=1,
                       cache_capacity=table.shape[1] * ps, page_size=ps, num_pages=kc.shape[0],
                       append=append)  # fmt: skip
    assert p.fast is not None
    for _ in range(2):
        k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        a = op.with_kvcache(q, k1, v1, lens_t, block_table=table, k_new=kn, v_new=vn, plan=p,
                            **prm)  # fmt: skip
        b = op.with_kvcache(q, k2, v2, lens_t, block_table=table, k_new=kn, v_new=vn,
                            num_splits=p.num_splits, **prm)  # fmt: skip
        torch.cuda.synchronize()
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert torch.equal(k1.isnan(), k2.isnan()) and torch.equal(k1.nan_to_num(), k2.nan_to_num())
        table = table.flip(0).contiguous()


def test_family_heuristic_on_this_device():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert family.num_splits_heuristic(8, sms, 1024) > 1
    assert family.num_splits_heuristic(64 * 8, sms, 1024) == 1


def _sweep_variants():
    from flashgen.bench.decode import SWEEP_UNITS

    return [dict(k) for k in SWEEP_UNITS] + [dict(block_n=64, stages=2, ctas_per_sm=3)]


@pytest.mark.parametrize("knobs", _sweep_variants(), ids=str)
def test_sweep_options_are_correct(knobs):
    """Every unit variant ``flashgen bench --decode --sweep`` may pick as the default
    (block_n, stages, min_split_blocks, launch bounds) against the float64 reference, a
    sliding window in a larger cache (the splits sized by the window) and planned calls
    writing ``out=`` buffers, at several split waves."""
    dev = torch.device("cuda", torch.cuda.current_device())
    for name, prm in (("llama3_gqa", {}), ("mistral_swa", {"window": 700})):
        op = op_of(name)
        lens = [5000, 1, 3000]
        kc, vc, table = make_cache(lens, ps=16, hkv=8, d=128, dv=128, dtype=torch.bfloat16)
        q = torch.randn(3, 32, 1, 128, device="cuda").to(torch.bfloat16)
        lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
        for waves in (0.5, 2.0):
            opts = family.Options(**knobs, split_waves=waves)
            p = op.plan_decode(batch=3, num_heads=32, num_heads_kv=8, seqlen_q=1,
                               cache_capacity=table.shape[1] * 16, page_size=16,
                               num_pages=kc.shape[0], device=dev, options=opts, **prm)  # fmt: skip
            assert p.fast is not None and not p.kernels["report"].kernels[0].spill_bytes
            out = (torch.full((3, 32, 1, 128), math.nan, device="cuda", dtype=torch.bfloat16),
                   torch.full((3, 32, 1), math.nan, device="cuda"))  # fmt: skip
            got = op.with_kvcache(q, kc, vc, lens_t, block_table=table, plan=p, out=out, **prm)
            assert got is out
            check(op.spec, q, kc, vc, table, lens, prm, *out)
            o2, l2 = op.with_kvcache(q, kc, vc, lens_t, block_table=table, plan=p, **prm)
            assert torch.equal(o2, out[0]) and torch.equal(l2, out[1])


@pytest.mark.parametrize("layout,ps", [("dense", 0), ("paged", 16)])
def test_b1_deep_ring_and_wide_merge(layout, ps):
    """One request, 8191 keys (issue 40's B1 shape, a partial last block): the 6-stage ring
    (Options.decode.stages, 16 splits of 8 blocks) and the fused combine's wider unroll
    (merge_unroll 8 / 16) against the float64 reference, planned calls; at a fixed split
    count every merge_unroll gives the same bits (the merge's order does not change)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    op = op_of("llama3_gqa")
    lens = [8191]
    kc, vc, table = make_cache(lens, ps=max(ps, 1), hkv=8, d=128, dv=128,
                               dtype=torch.bfloat16, layout=layout)  # fmt: skip
    q = torch.randn(1, 32, 1, 128, device="cuda").to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    if table is None:
        shape = dict(cache_capacity=kc.shape[2])
    else:
        shape = dict(cache_capacity=table.shape[1] * ps, page_size=ps, num_pages=kc.shape[0])
    by_splits = {}
    for knobs in (dict(), dict(merge_unroll=16), dict(block_n=64, stages=6),
                  dict(block_n=64, stages=6, merge_unroll=16), dict(num_splits=49, merge_unroll=8),
                  dict(num_splits=49, merge_unroll=16)):  # fmt: skip
        p = op.plan_decode(batch=1, num_heads=32, num_heads_kv=8, seqlen_q=1, device=dev,
                           options=family.Options(**knobs), **shape)  # fmt: skip
        assert p.fast is not None and not p.kernels["report"].kernels[0].spill_bytes
        if knobs.get("stages") == 6:
            assert p.num_splits == 16 and p.geometry.grid == (16, 8, 1)
        o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, plan=p)
        check(op.spec, q, kc, vc, table, lens, {}, o, lse)
        unit = (knobs.get("block_n"), knobs.get("stages"))
        seen = by_splits.setdefault((unit, p.num_splits), (o, lse))
        assert torch.equal(seen[0], o) and torch.equal(seen[1], lse), knobs


RAGGED = [("llama3_gqa", "paged", 16, (32, 8)), ("mistral_swa", "paged", 1, (8, 1)),
          ("alibi", "dense", 0, (32, 8)), ("gemma2_softcap", "paged", 3, (8, 1))]  # fmt: skip


def ragged_inputs(name, layout, ps, heads, lens, sqs, append, *, seed=0):
    """A ragged call's inputs for the spec ``name`` (or an op): the cache (unused slots NaN),
    q ``[total_q, Hq, D]``, cu_seqlens_q, cache_seqlens and (``append``) k_new / v_new
    ``[total_q, Hkv, D]``; the spec's params (:func:`params_of`)."""
    op = op_of(name) if isinstance(name, str) else name
    spec = op.spec
    name = spec.name
    hq, hkv = heads
    cap = max(n + s for n, s in zip(lens, sqs, strict=True))
    kc, vc, table = make_cache(lens, ps=max(ps, 1), hkv=hkv, d=spec.head_dim, dv=spec.head_dim_v,
                               dtype=torch.bfloat16 if spec.dtype == "bf16" else torch.float16,
                               layout=layout, cap=cap, seed=seed)  # fmt: skip
    dt = kc.dtype
    cu = torch.tensor([0, *torch.tensor(sqs).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total = sum(sqs)
    q = torch.randn(total, hq, spec.head_dim, device="cuda").to(dt)
    params = params_of(name, hq, q.device)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kw = {}
    if append:
        kw["k_new"] = torch.randn(total, hkv, spec.head_dim, device="cuda").to(dt)
        kw["v_new"] = torch.randn(total, hkv, spec.head_dim_v, device="cuda").to(dt)
    return op, q, kc, vc, table, cu, lens_t, kw, params


def check_ragged(spec, q, kc, vc, table, cu, lens, sqs, append, params, o, lse, kw):
    """Each request's rows of o / lse against the float64 reference of that request alone
    (seqlen_q = Sq_b), its appended rows at cache_seqlens[b] .. (through the gather)."""
    from flashgen.ops.decode.op import gather_cache

    total, hq = q.shape[0], q.shape[1]
    assert o.shape == (total, hq, spec.head_dim_v) and lse.shape == (hq, total)
    for b in range(len(lens)):
        q0, q1 = int(cu[b]), int(cu[b + 1])
        if q1 == q0:
            continue
        live = [lens[b] + (sqs[b] if append else 0)]
        if table is None:
            kcb, vcb, tb = kc[b : b + 1], vc[b : b + 1], None
        else:
            kcb, vcb, tb = kc, vc, table[b : b + 1]
        if append:
            kg, vg = gather_cache(kcb, vcb, 0, live[0], tb)
            assert torch.equal(kg[:, lens[b]:].transpose(0, 1), kw["k_new"][q0:q1])
            assert torch.equal(vg[:, lens[b]:].transpose(0, 1), kw["v_new"][q0:q1])
        qb = q[q0:q1].permute(1, 0, 2)[None]
        check(spec, qb, kcb, vcb, tb, live, params, o[q0:q1].permute(1, 0, 2)[None],
              lse[:, q0:q1][None])  # fmt: skip


@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("name,layout,ps,heads", RAGGED, ids=str)
def test_ragged_against_float64(name, layout, ps, heads, splits, append):
    """Ragged Sq_new (cu_seqlens_q; Sq_b 1 / 0 / 4 / 64 / 1 mixed): each request's rows
    against the float64 reference of that request alone (seqlen_q = Sq_b), outputs poisoned,
    unused slots NaN; appends land per request; rows of o / lse of empty requests: none."""
    lens, sqs = [5, 300, 0, 4097, 17], [1, 0, 4, 64, 1]
    op, q, kc, vc, table, cu, lens_t, kw, params = ragged_inputs(name, layout, ps, heads, lens,
                                                                 sqs, append)  # fmt: skip
    with poison_outputs():
        o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, cu_seqlens_q=cu,
                                 max_seqlen_q=max(sqs), num_splits=splits, **kw,
                                 **params)  # fmt: skip
    torch.cuda.synchronize()
    check_ragged(op.spec, q, kc, vc, table, cu, lens, sqs, append, params, o, lse, kw)


VARYING = [("llama3_gqa", "paged", 16, (32, 8)), ("llama3_gqa", "dense", 0, (8, 1)),
           ("mistral_swa", "paged", 1, (32, 8)), ("mistral_swa", "dense", 0, (8, 1))]  # fmt: skip


@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("name,layout,ps,heads", VARYING, ids=str)
def test_ragged_sq_1_to_64_per_request(name, layout, ps, heads, append):
    """Sq_b drawn from 1..64 per request (12 requests, cache lengths 0 to 5000), dense and
    paged (page size 1 and 16), GQA 32/8 and 8/1, a sliding window (mistral_swa, window 37:
    most of a long request's keys outside it), with and without the append; the heuristic's
    num_splits and 1 against the float64 reference, max_seqlen_q read from cu_seqlens_q."""
    g = torch.Generator().manual_seed(7)
    sqs = torch.randint(1, 65, (12,), generator=g).tolist()
    sqs[0], sqs[1] = 1, 64
    lens = torch.randint(0, 5001, (12,), generator=g).tolist()
    lens[2] = 0
    op, q, kc, vc, table, cu, lens_t, kw, params = ragged_inputs(name, layout, ps, heads, lens,
                                                                 sqs, append, seed=3)  # fmt: skip
    kc0, vc0 = kc.clone(), vc.clone()
    for splits in (None, 1):
        kc.copy_(kc0)
        vc.copy_(vc0)
        with poison_outputs():
            o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, cu_seqlens_q=cu,
                                     num_splits=splits, **kw, **params)  # fmt: skip
        torch.cuda.synchronize()
        check_ragged(op.spec, q, kc, vc, table, cu, lens, sqs, append, params, o, lse, kw)


@pytest.mark.parametrize("append", [False, True])
def test_ragged_planned_fast_path_equals_the_general_path(append):
    """plan_decode(total_q=...) on the device: the planned call (prepacked arguments,
    cu_seqlens_q packed per call, cuLaunchKernel) is bitwise the unplanned one for the same
    num_splits, with out= buffers, and for a call with fewer rows than planned (o / lse
    follow q's rows); against the float64 reference."""
    lens, sqs = [3000, 5, 1500, 0], [3, 1, 8, 2]
    op, q, kc, vc, table, cu, lens_t, kw, params = ragged_inputs(
        "alibi", "paged", 16, (8, 2), lens, sqs, append
    )
    p = op.plan_decode(batch=4, num_heads=8, num_heads_kv=2, seqlen_q=8, total_q=16,
                       cache_capacity=table.shape[1] * 16, page_size=16, num_pages=kc.shape[0],
                       append=append)  # fmt: skip
    assert p.fast is not None and p.dims.total_q == 16
    for _ in range(2):  # the second call: the packed layout reused
        k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        a = op.with_kvcache(q, k1, v1, lens_t, block_table=table, cu_seqlens_q=cu, plan=p,
                            **kw, **params)  # fmt: skip
        b = op.with_kvcache(q, k2, v2, lens_t, block_table=table, cu_seqlens_q=cu,
                            max_seqlen_q=8, num_splits=p.num_splits, **kw, **params)  # fmt: skip
        torch.cuda.synchronize()
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert torch.equal(k1.isnan(), k2.isnan()) and torch.equal(k1.nan_to_num(), k2.nan_to_num())
    check_ragged(op.spec, q, k1, v1, table, cu, lens, sqs, append, params, *a, kw)
    out = (torch.full_like(a[0], math.nan), torch.full_like(a[1], math.nan))
    k3, v3 = kc.clone(), vc.clone()
    got = op.with_kvcache(q, k3, v3, lens_t, block_table=table, cu_seqlens_q=cu, plan=p, out=out,
                          **kw, **params)  # fmt: skip
    torch.cuda.synchronize()
    assert got is out and torch.equal(out[0], a[0]) and torch.equal(out[1], a[1])
    # fewer rows than planned: requests 0 and 1 only (cu_seqlens_q [0, 3, 4, 4, 4])
    cu2 = torch.tensor([0, 3, 4, 4, 4], dtype=torch.int32, device="cuda")
    kw2 = {k: v[:4] for k, v in kw.items()}
    k4, v4 = kc.clone(), vc.clone()
    o2, l2 = op.with_kvcache(q[:4], k4, v4, lens_t, block_table=table, cu_seqlens_q=cu2, plan=p,
                             **kw2, **params)  # fmt: skip
    torch.cuda.synchronize()
    assert o2.shape == (4, 8, 128) and l2.shape == (8, 4)
    check_ragged(op.spec, q[:4], k4, v4, table, cu2, lens, [3, 1, 0, 0], append, params, o2, l2,
                 kw2)  # fmt: skip


def test_ragged_graph_capture_with_a_plan():
    """A ragged plan's call captured in a CUDA graph: replays with new cache lengths, new
    cu_seqlens_q (same total rows), new q and a permuted block table equal eager calls and
    the float64 reference."""
    sqs = [1, 4, 2, 1]
    op, q, kc, vc, table, cu, lens_t, kw, params = ragged_inputs(
        "mistral_swa", "paged", 16, (32, 8), [2000] * 4, sqs, False
    )  # every page live: the permuted table gives a request another's 2000 keys
    lens_t.copy_(torch.tensor([2000, 10, 500, 1999], dtype=torch.int32))
    p = op.plan_decode(batch=4, num_heads=32, num_heads_kv=8, seqlen_q=4, total_q=8,
                       cache_capacity=table.shape[1] * 16, page_size=16, num_pages=kc.shape[0],
                       window=37)  # fmt: skip
    op.with_kvcache(q, kc, vc, lens_t, block_table=table, cu_seqlens_q=cu, plan=p, **params)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        og, lg = op.with_kvcache(q, kc, vc, lens_t, block_table=table, cu_seqlens_q=cu, plan=p,
                                 **params)  # fmt: skip
    for new_lens, new_sqs in (([1, 2, 3, 4], [4, 1, 1, 2]), ([1999, 1000, 0, 64], [2, 2, 2, 2])):
        lens_t.copy_(torch.tensor(new_lens, dtype=torch.int32))
        cu.copy_(torch.tensor([0, *torch.tensor(new_sqs).cumsum(0).tolist()], dtype=torch.int32))
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(q.dtype))
        table.copy_(table.flip(0))
        graph.replay()
        eo, el = op.with_kvcache(q, kc, vc, lens_t, block_table=table, cu_seqlens_q=cu, plan=p,
                                 **params)  # fmt: skip
        torch.cuda.synchronize()
        assert torch.equal(og, eo) and torch.equal(lg, el)
        check_ragged(op.spec, q, kc, vc, table, cu, new_lens, new_sqs, False, params, og, lg, {})


def test_ragged_torch_compile_fullgraph():
    """torch.compile(fullgraph=True) of a ragged call with the append on the device (the
    registered op's CUDA kernel) equals the eager call, the caches included."""
    lens, sqs = [100, 7, 0], [5, 1, 3]
    op, q, kc, vc, table, cu, lens_t, kw, params = ragged_inputs(
        "llama3_gqa", "paged", 16, (32, 8), lens, sqs, True
    )
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()

    def f(q, kc, vc, lens, cu, kn, vn):
        return op.with_kvcache(q, kc, vc, lens, block_table=table, cu_seqlens_q=cu,
                               max_seqlen_q=5, k_new=kn, v_new=vn, num_splits=2)  # fmt: skip

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = compiled(q, k1, v1, lens_t, cu, kw["k_new"], kw["v_new"])
    want = f(q, k2, v2, lens_t, cu, kw["k_new"], kw["v_new"])
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(k1.nan_to_num(), k2.nan_to_num()) and torch.equal(v1.isnan(), v2.isnan())


SANITIZE_DRIVER = r"""
import sys, torch, flashgen
op = flashgen.load(sys.argv[1] + "/specs/mistral_swa.yaml")
bf, dev = torch.bfloat16, "cuda"
torch.manual_seed(0)
ps, hkv, hq, d, B, max_pages = 16, 2, 8, 128, 4, 20
num_pages = B * max_pages + 3
kc = torch.randn(num_pages, ps, hkv, d, device=dev).to(bf)
vc = torch.randn(num_pages, ps, hkv, d, device=dev).to(bf)
table = torch.randperm(num_pages, device=dev)[: B * max_pages].view(B, max_pages).int()
table[3, 5] = num_pages + 7  # a live page index out of range: empty, never read
lens = torch.tensor([0, 1, 17, 300], dtype=torch.int32, device=dev)
q = torch.randn(B, hq, 4, d, device=dev).to(bf)
kn = torch.randn(B, hkv, 4, d, device=dev).to(bf)
cu = torch.tensor([0, 1, 5, 5, 9], dtype=torch.int32, device=dev)
qr = torch.randn(9, hq, d, device=dev).to(bf)
knr = torch.randn(9, hkv, d, device=dev).to(bf)
kd = torch.randn(B, hkv, 320, d, device=dev).to(bf)
vd = torch.randn(B, hkv, 320, d, device=dev).to(bf)
for splits in (1, 3):
    op.with_kvcache(q, kc, vc, lens, block_table=table, num_splits=splits, window=37)
    op.with_kvcache(q, kc, vc, lens, block_table=table, k_new=kn, v_new=kn, num_splits=splits)
    op.with_kvcache(q, kd, vd, lens, k_new=kn, v_new=kn, num_splits=splits)
    op.with_kvcache(qr, kc, vc, lens, block_table=table, cu_seqlens_q=cu, k_new=knr, v_new=knr,
                    num_splits=splits, window=37)
    op.with_kvcache(qr, kd, vd, lens, cu_seqlens_q=cu, max_seqlen_q=4, num_splits=splits)
for total_q in (None, 9):
    p = op.plan_decode(batch=B, num_heads=hq, num_heads_kv=hkv, seqlen_q=4, total_q=total_q,
                       cache_capacity=max_pages * ps, page_size=ps, num_pages=num_pages,
                       append=True, num_splits=3)
    for _ in range(2):  # the fast path's first (packing) and second call
        if total_q is None:
            op.with_kvcache(q, kc, vc, lens, block_table=table, k_new=kn, v_new=kn, plan=p)
        else:
            op.with_kvcache(qr, kc, vc, lens, block_table=table, cu_seqlens_q=cu, k_new=knr,
                            v_new=knr, plan=p)
torch.cuda.synchronize()
print("FLASHGEN DRIVER OK", flush=True)
"""


@pytest.mark.device_memory(8)
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck", "initcheck"])
def test_decode_kernels_are_sanitizer_clean(tool):
    """compute-sanitizer over the decode kernels (attention with the fused combine, append),
    padded and ragged, dense and paged, 1 and 3 splits, a bad page index, planned calls on
    the fast path: no error, no hazard (tools/sanitize.py's parsing and kernel filter)."""
    import shutil
    import subprocess

    from patched_kernels import load_tool  # tests/ is on sys.path (above)

    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("no compute-sanitizer")
    # registered in sys.modules before it runs: its dataclasses look their module up there
    tools = load_tool("sanitize")
    filt = tools.kernel_filter_args(sanitizer) if tool != "initcheck" else []
    extra = ["--racecheck-report", "all"] if tool == "racecheck" else []
    cmd = [sanitizer, "--tool", tool, *extra, *filt, "--print-limit", "20", sys.executable,
           "-c", SANITIZE_DRIVER, str(REPO)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=REPO)
    log = proc.stdout + proc.stderr
    errors, hazards = tools.parse_summary(log)
    assert "FLASHGEN DRIVER OK" in log and proc.returncode == 0, log[-6000:]
    assert errors == 0 and hazards == 0, log[-6000:]


@pytest.fixture(scope="module")
def hdim_decode_ops():
    """The head-dim matrix's ops (bf16 causal, fp16 causal, bf16 softcap), their padded and
    ragged decode units built in parallel."""
    from flashgen.ops.op import build_op

    ops = {(d, dv, dt, mod): build_op(hdim_spec(d, dv, dt, mod)) for d, dv in NEW_HEAD_DIMS
           for dt, mod in (("bf16", "none"), ("fp16", "none"), ("bf16", "softcap"))}  # fmt: skip
    dev = torch.device("cuda", torch.cuda.current_device())
    jobs = [(decode_op(op), r) for op in ops.values() for r in (False, True)]
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(lambda j: j[0].kernels(dev, ragged=j[1]), jobs))
    return ops


@pytest.mark.parametrize("dims", NEW_HEAD_DIMS, ids=[dims_id(*x) for x in NEW_HEAD_DIMS])
def test_head_dims_against_float64(dims, hdim_decode_ops):
    """Every head dim the prefill supports beyond 64/128/256 (32, 96, 160, 192, (192, 128),
    (128, 256)), fp16 / bf16 and softcap: paged (page size 16, GQA 8/2, lengths 0 to 4097)
    with Sq_new 1 and 4 appended, dense, and ragged with appends, num_splits heuristic and 3,
    against the float64 reference."""
    d, dv = dims
    for (dd, ddv, dt, _), op in hdim_decode_ops.items():
        if (dd, ddv) != dims:
            continue
        spec = op.spec
        dtype = torch.bfloat16 if dt == "bf16" else torch.float16
        lens = [0, 1, 15, 17, 4097]
        for layout in ("paged", "dense"):
            kc, vc, table = make_cache(lens, ps=16, hkv=2, d=d, dv=dv, dtype=dtype, layout=layout,
                                       cap=4097 + 4)  # fmt: skip
            lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
            for sq, splits in ((1, None), (4, 3)):
                q = torch.randn(5, 8, sq, d, device="cuda").to(dtype)
                kw = {}
                if sq == 4:
                    kw = {"k_new": torch.randn(5, 2, sq, d, device="cuda").to(dtype),
                          "v_new": torch.randn(5, 2, sq, dv, device="cuda").to(dtype)}  # fmt: skip
                k1, v1 = kc.clone(), vc.clone()
                with poison_outputs():
                    o, lse = op.with_kvcache(q, k1, v1, lens_t, block_table=table,
                                             num_splits=splits, **kw)  # fmt: skip
                torch.cuda.synchronize()
                live = [n + (sq if kw else 0) for n in lens]
                check(spec, q, k1, v1, table, live, {}, o, lse)
        sqs = [1, 0, 4, 64, 2]
        for splits in (None, 3):
            _, q, kc, vc, table, cu, lens_t, kw, _ = ragged_inputs(op, "paged", 16, (8, 2), lens,
                                                                   sqs, True)  # fmt: skip
            with poison_outputs():
                o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, cu_seqlens_q=cu,
                                         num_splits=splits, **kw)  # fmt: skip
            torch.cuda.synchronize()
            check_ragged(spec, q, kc, vc, table, cu, lens, sqs, True, {}, o, lse, kw)
