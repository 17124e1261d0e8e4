"""Serving (op.with_kvcache, flashgen.ops.decode.op) on CPU: the op gathers pages and runs the
reference; it must equal the padded op on the gathered cache (float64 here), for page sizes
1, 3, 16, 256, cache lengths 0, 1, page-1, page, page+1 (4097 once), Sq_new 1, 4, 64, GQA
32/8 and 8/1, sliding-window / softcap / ALiBi specs; garbage in unused slots changes
nothing; k_new lands in the right pages; merge_attention of two halves is the whole; bad
inputs raise OpInputError.  Plus the pure host pieces of flashgen.families.decode."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from fast_plan import launched_args

import flashgen
from flashgen.families import decode as family
from flashgen.frontend.errors import OpInputError
from flashgen.ops.cpu.reference import attention_reference
from flashgen.ops.decode.op import (
    DecodeDims,
    decode_reference,
    merge_attention,
    unchecked_key_mask,
)

ROOT = Path(__file__).resolve().parents[2]
SPECS = {
    n: ROOT / "specs" / f"{n}.yaml"
    for n in ("mistral_swa", "gemma2_softcap", "alibi", "llama3_gqa")
}


def _op(name):
    return flashgen.load(SPECS[name])


def _params(name, hq):
    if name == "alibi":
        return {"slopes": torch.tensor([2.0 ** (-8 * (i + 1) / hq) for i in range(hq)])}
    if name == "mistral_swa":
        return {"window": 5}
    return {}


def make_cache(lens, *, page_size, hkv, d, dv, dtype, extra_pages=3, fill=0.0, seed=0, dense=False):
    """A paged cache holding random keys at every live slot of each request (pages assigned in
    a shuffled order), ``fill`` everywhere else; or the dense equivalent."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lens)
    cap = max(max(lens), 1)
    if dense:
        kc = torch.full((batch, hkv, cap, d), fill, dtype=dtype)
        vc = torch.full((batch, hkv, cap, dv), fill, dtype=dtype)
        for b, n in enumerate(lens):
            kc[b, :, :n] = torch.randn(hkv, n, d, generator=g).to(dtype)
            vc[b, :, :n] = torch.randn(hkv, n, dv, generator=g).to(dtype)
        return kc, vc, None
    max_pages = -(-cap // page_size)
    num_pages = batch * max_pages + extra_pages
    perm = torch.randperm(num_pages, generator=g)
    table = perm[: batch * max_pages].view(batch, max_pages).to(torch.int32).contiguous()
    kc = torch.full((num_pages, page_size, hkv, d), fill, dtype=dtype)
    vc = torch.full((num_pages, page_size, hkv, dv), fill, dtype=dtype)
    for b, n in enumerate(lens):
        for pos in range(n):
            pg, slot = int(table[b, pos // page_size]), pos % page_size
            kc[pg, slot] = torch.randn(hkv, d, generator=g).to(dtype)
            vc[pg, slot] = torch.randn(hkv, dv, generator=g).to(dtype)
    return kc, vc, table


def gathered(kc, vc, table, b, n):
    """Request b's first n keys [Hkv, n, D], gathered slot by slot (independent of the op)."""
    if table is None:
        return kc[b, :, :n], vc[b, :, :n]
    ps = kc.shape[1]
    rows_k = [kc[int(table[b, p // ps]), p % ps] for p in range(n)]
    rows_v = [vc[int(table[b, p // ps]), p % ps] for p in range(n)]
    if not rows_k:
        return kc.new_zeros(kc.shape[2], 0, kc.shape[3]), vc.new_zeros(vc.shape[2], 0, vc.shape[3])
    return torch.stack(rows_k, 1), torch.stack(rows_v, 1)


def expected(spec, q, kc, vc, table, live, params, scale=None):
    """Per request: attention_reference (float64) of q[b] over its gathered live keys."""
    batch, hq, sq, _ = q.shape
    o = torch.zeros(batch, hq, sq, vc.shape[-1], dtype=torch.float64)
    lse = torch.full((batch, hq, sq), -math.inf, dtype=torch.float64)
    for b in range(batch):
        if live[b] == 0:
            continue
        k, v = gathered(kc, vc, table, b, live[b])
        ob, lb = attention_reference(
            spec,
            q[b : b + 1],
            k[None],
            v[None],
            softmax_scale=scale,
            params=params,
            compute_dtype=torch.float64,
            batch_offset=b,
        )
        o[b], lse[b] = ob[0], lb[0]
    return o, lse


def _close(a, b, tol):
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin) or bool((a[~fin] == b[~fin]).all())
    assert torch.allclose(a[fin].double(), b[fin].double(), atol=tol, rtol=tol), (
        (a[fin].double() - b[fin].double()).abs().max()
    )


# ----------------------------------------------------------------------------- host pieces
def test_num_splits_heuristic():
    h = family.num_splits_heuristic
    assert h(132, 132, 1000) == 1  # a full wave already: no splits
    assert h(106, 132, 1000) == 1  # >= 80% of a wave
    s = h(8, 132, 1024)  # B1 x 8 kv heads, 64k keys: many splits
    assert 8 <= s <= 128 and 8 * s <= 2 * 132
    assert h(8, 264, 1024) == 33  # two CTAs per SM on 132 SMs: exactly one full wave
    assert h(128, 264, 1024) == 2  # B16: 256 of 264
    assert h(512, 264, 1024) == 1  # B64: already two waves
    assert h(8, 264, 64) == 32  # a 4k cache: splits of at least MIN_SPLIT_BLOCKS (2) blocks
    assert h(8, 132, 3) <= 3  # never more splits than blocks
    assert h(8, 132, 1) == 1
    assert h(0, 132, 100) == 1
    for total in (1, 8, 16, 64):
        for n in (2, 7, 64, 4096):
            s = h(total, 132, n)
            assert 1 <= s <= min(128, n)


def test_split_range_partitions_the_blocks():
    for lo, hi in ((0, 0), (0, 1), (3, 17), (0, 100), (5, 5)):
        for splits in (1, 2, 3, 7, 128):
            got = [family.split_range(lo, hi, splits, s) for s in range(splits)]
            covered = [j for b, e in got for j in range(b, e)]
            assert covered == list(range(lo, hi))
            assert all(b <= e for b, e in got)
            sizes = [e - b for b, e in got]
            assert max(sizes) - min(sizes) <= 1  # balanced: no short tail split


def test_effective_splits():
    e = family.effective_splits
    assert e(0, 0, 8) == 1 and e(0, 3, 8) == 1  # no or few blocks: one split, written directly
    assert e(0, 64, 33) == 32  # a 4096-key window in a 64k plan: 32 splits of 2 blocks
    assert e(0, 1024, 33) == 33
    assert e(10, 18, 128) == 4  # 8 blocks, at least MIN_SPLIT_BLOCKS (2) each
    for cnt in range(0, 300, 7):
        for n in (1, 2, 5, 33, 128):
            k = e(0, cnt, n)
            assert 1 <= k <= n and (k == 1 or cnt // k >= family.MIN_SPLIT_BLOCKS)


def test_plan_shapes_fit_and_refusals():
    from flashgen.frontend.spec import load_spec

    for path in sorted((ROOT / "specs").glob("*.yaml")):
        spec = load_spec(path)
        if spec.dtype == "fp8_e4m3":
            continue  # decode of fp8 specs: the FP8 KV cache (issue 24), not this table
        assert family.unsupported_reason(spec) is None  # tensor masks too (issue 40)
        for t in ("sm_80", "sm_90"):
            p = family.plan(spec, t)
            assert p.smem_bytes <= family.SMEM_LIMIT["sm_80"]


# ----------------------------------------------------------------------------- the matrix
CASES = [
    # spec, page size, Sq_new, (Hq, Hkv)
    ("mistral_swa", 1, 1, (32, 8)),
    ("mistral_swa", 3, 4, (8, 1)),
    ("mistral_swa", 16, 64, (8, 1)),
    ("gemma2_softcap", 3, 1, (8, 1)),
    ("gemma2_softcap", 256, 4, (32, 8)),
    ("alibi", 16, 1, (32, 8)),
    ("alibi", 1, 4, (8, 1)),
    ("alibi", 256, 64, (8, 1)),
    ("llama3_gqa", 16, 4, (32, 8)),
]


@pytest.mark.parametrize("name,ps,sq,heads", CASES, ids=lambda x: str(x))
def test_paged_matches_the_padded_op_on_the_gathered_cache(name, ps, sq, heads):
    op = _op(name)
    spec = op.spec
    hq, hkv = heads
    lens = [0, 1, max(ps - 1, 0), ps, ps + 1]
    kc, vc, table = make_cache(
        lens,
        page_size=ps,
        hkv=hkv,
        d=spec.head_dim,
        dv=spec.head_dim_v,
        dtype=torch.bfloat16,
        fill=float("nan"),
    )
    q = torch.randn(len(lens), hq, sq, spec.head_dim).to(torch.bfloat16)
    params = _params(name, hq)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, **params)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # float64: the op's own reference path against an independent gather
    ro, rl = decode_reference(spec, q, kc, vc, lens_t, table, params=params)
    eo, el = expected(spec, q, kc, vc, table, lens, params)
    _close(ro, eo, 1e-9)
    _close(rl, el, 1e-9)
    # the op (bf16) equals the padded op on the gathered cache, request by request
    for b, n in enumerate(lens):
        if n == 0:
            assert bool((o[b] == 0).all()) and bool((lse[b] == -math.inf).all())
            continue
        k, v = gathered(kc, vc, table, b, n)
        po, pl = op.attention(q[b : b + 1], k[None].contiguous(), v[None].contiguous(), **params)
        torch.testing.assert_close(o[b : b + 1], po, atol=0, rtol=0, equal_nan=True)
        torch.testing.assert_close(lse[b : b + 1], pl, atol=0, rtol=0, equal_nan=True)


def test_long_cache_4097_dense_and_paged():
    op = _op("mistral_swa")
    spec = op.spec
    lens = [4097, 3]
    q = torch.randn(2, 8, 4, 128).to(torch.bfloat16)
    for dense, ps in ((True, 0), (False, 16)):
        kc, vc, table = make_cache(
            lens, page_size=ps, hkv=1, d=128, dv=128, dtype=torch.bfloat16, dense=dense
        )
        lens_t = torch.tensor(lens, dtype=torch.int32)
        ro, rl = decode_reference(spec, q, kc, vc, lens_t, table, params={"window": 4096})
        eo, el = expected(spec, q, kc, vc, table, lens, {"window": 4096})
        _close(ro, eo, 1e-9)
        _close(rl, el, 1e-9)
        o, _ = op.with_kvcache(q, kc, vc, lens_t, block_table=table, window=4096)
        _close(o.double(), eo, 2e-2)


def test_garbage_in_unused_slots_changes_nothing():
    op = _op("gemma2_softcap")
    lens = [5, 16, 17]
    q = torch.randn(3, 8, 2, 256).to(torch.bfloat16)
    outs = []
    for fill in (0.0, 1e4, float("nan"), float("inf")):
        kc, vc, table = make_cache(
            lens, page_size=16, hkv=2, d=256, dv=256, dtype=torch.bfloat16, fill=fill, seed=3
        )
        outs.append(
            op.with_kvcache(q, kc, vc, torch.tensor(lens, dtype=torch.int32), block_table=table)
        )
    for o, lse in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(lse, outs[0][1])


@pytest.mark.parametrize("dense", [False, True])
def test_append_lands_in_the_right_pages(dense):
    op = _op("mistral_swa")
    lens = [0, 2, 3, 15]
    ps, sq = 3, 4
    cap = max(lens) + sq
    kc, vc, table = make_cache(
        [cap] * len(lens),
        page_size=ps,
        hkv=2,
        d=128,
        dv=128,
        dtype=torch.bfloat16,
        seed=5,
        dense=dense,
    )
    kc0, vc0 = kc.clone(), vc.clone()
    q = torch.randn(4, 4, sq, 128).to(torch.bfloat16)
    kn = torch.randn(4, 2, sq, 128).to(torch.bfloat16)
    vn = torch.randn(4, 2, sq, 128).to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, k_new=kn, v_new=vn, window=3)
    touched = torch.zeros(
        kc.shape[:2] if not dense else (kc.shape[0], kc.shape[2]), dtype=torch.bool
    )
    for b, n in enumerate(lens):
        for s in range(sq):
            pos = n + s
            if dense:
                assert torch.equal(kc[b, :, pos], kn[b, :, s]) and torch.equal(
                    vc[b, :, pos], vn[b, :, s]
                )
                touched[b, pos] = True
            else:
                pg = int(table[b, pos // ps])
                assert torch.equal(kc[pg, pos % ps], kn[b, :, s]) and torch.equal(
                    vc[pg, pos % ps], vn[b, :, s]
                )
                touched[pg, pos % ps] = True
    if dense:
        assert torch.equal(kc.transpose(1, 2)[~touched], kc0.transpose(1, 2)[~touched])
    else:
        assert torch.equal(kc[~touched], kc0[~touched]) and torch.equal(vc[~touched], vc0[~touched])
    live = [n + sq for n in lens]
    eo, el = expected(op.spec, q, kc, vc, table, live, {"window": 3})
    _close(o.double(), eo, 2e-2)
    _close(lse.double(), el, 1e-4)


def test_merge_attention_of_two_halves_is_the_whole():
    op = _op("alibi")
    spec = op.spec
    params = _params("alibi", 8)
    q = torch.randn(1, 8, 3, 128, dtype=torch.float64)
    k = torch.randn(1, 2, 40, 128, dtype=torch.float64)
    v = torch.randn(1, 2, 40, 128, dtype=torch.float64)
    from flashgen.frontend.spec import load_spec

    plain = load_spec(ROOT / "specs" / "bidir_d256.yaml")
    del spec, plain
    # a mask-free reference split in key halves: merge == whole
    nomask = flashgen.load(ROOT / "specs" / "llama3_gqa.yaml").spec
    from dataclasses import replace

    full_spec = replace(nomask, mask=None, name="decode_merge_test")
    o, lse = attention_reference(full_spec, q, k, v, compute_dtype=torch.float64)
    oa, la = attention_reference(
        full_spec, q, k[:, :, :17], v[:, :, :17], compute_dtype=torch.float64
    )
    ob, lb = attention_reference(
        full_spec, q, k[:, :, 17:], v[:, :, 17:], compute_dtype=torch.float64
    )
    mo, ml = merge_attention(oa.float(), la.float(), ob.float(), lb.float())
    assert mo.dtype == torch.float32
    torch.testing.assert_close(mo.double(), o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ml.double(), lse, atol=1e-5, rtol=1e-5)
    # low-precision o comes back in o_a's dtype; an empty side (lse -inf) has weight 0
    empty = torch.full_like(la.float(), -math.inf)
    mo2, ml2 = flashgen.merge_attention(
        oa.bfloat16(), la.float(), torch.zeros_like(ob).bfloat16(), empty
    )
    assert mo2.dtype == torch.bfloat16
    torch.testing.assert_close(mo2, oa.bfloat16())
    torch.testing.assert_close(ml2, la.float())
    mo3, ml3 = merge_attention(
        torch.zeros_like(oa).float(), empty, torch.zeros_like(ob).float(), empty
    )
    assert bool((mo3 == 0).all()) and bool((ml3 == -math.inf).all())
    with pytest.raises(OpInputError, match="lse_a"):
        merge_attention(oa.float(), la.double(), ob.float(), lb.float())
    del params


def test_plan_decode_on_cpu_and_num_splits_are_accepted():
    op = _op("llama3_gqa")
    lens = [3, 9]
    kc, vc, table = make_cache(lens, page_size=4, hkv=2, d=128, dv=128, dtype=torch.bfloat16)
    q = torch.randn(2, 8, 1, 128).to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    p = op.plan_decode(
        batch=2,
        num_heads=8,
        num_heads_kv=2,
        seqlen_q=1,
        cache_capacity=table.shape[1] * 4,
        page_size=4,
        num_pages=kc.shape[0],
        device="cpu",
        num_splits=3,
    )
    assert p.num_splits == 3
    o1, _ = op.with_kvcache(q, kc, vc, lens_t, block_table=table, plan=p)
    o2, _ = op.with_kvcache(q, kc, vc, lens_t, block_table=table, num_splits=7)
    assert torch.equal(o1, o2)
    with pytest.raises(OpInputError, match="plan"):
        op.with_kvcache(q[:1], kc, vc, lens_t[:1], block_table=table[:1], plan=p)


def test_plan_decode_defaults_to_where_the_op_runs():
    """No ``device``: the current CUDA device if there is one, else the CPU (a CPU user never
    passes 'cuda' and must not be told about it)."""
    op = _op("llama3_gqa")
    sizes = dict(batch=2, num_heads=32, seqlen_q=1, cache_capacity=4096)
    with pytest.raises(OpInputError, match=r"^num_heads_kv: expected >= 1, got 0$"):
        op.plan_decode(num_heads_kv=0, **sizes)
    p = op.plan_decode(num_heads_kv=8, **sizes)
    want = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else (
        torch.device("cpu"))  # fmt: skip
    assert p.device == want
    if not torch.cuda.is_available():
        with pytest.raises(OpInputError, match=r"device: expected 'cpu' or a CUDA device"):
            op.plan_decode(num_heads_kv=8, device="cuda", **sizes)


@pytest.mark.parametrize("ragged", [False, True])
def test_with_kvcache_takes_float32_on_the_cpu_like_attention(ragged):
    """A float32 q, cache and k_new on the CPU run in float32 (as ``op.attention`` does) and
    give what attention over the live keys gives; out= takes float32 buffers; a bf16 q with
    float32 caches is refused, naming both dtypes."""
    op = _op("mistral_swa")
    g = torch.Generator().manual_seed(3)
    b, hq, hkv, d, cap = 2, 8, 2, 128, 40
    kc, vc = torch.randn(b, hkv, cap, d, generator=g), torch.randn(b, hkv, cap, d, generator=g)
    lens = torch.tensor([7, 33], dtype=torch.int32)
    q = torch.randn(b, hq, 1, d, generator=g)
    kn, vn = torch.randn(b, hkv, 1, d, generator=g), torch.randn(b, hkv, 1, d, generator=g)
    args = dict(k_new=kn, v_new=vn)
    if ragged:
        cu = torch.tensor([0, 1, 2], dtype=torch.int32)
        qr = q[:, :, 0].contiguous()
        args = dict(k_new=kn[:, :, 0].contiguous(), v_new=vn[:, :, 0].contiguous(),
                    cu_seqlens_q=cu, max_seqlen_q=1)  # fmt: skip
        o, lse = op.with_kvcache(qr, kc, vc, lens, **args)
        o = o.unsqueeze(2)
    else:
        o, lse = op.with_kvcache(q, kc, vc, lens, **args)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    for i, n in enumerate(lens.tolist()):
        assert torch.equal(kc[i, :, n], kn[i, :, 0])  # appended in place
        ref, _ = op.attention(q[i : i + 1], kc[i : i + 1, :, : n + 1], vc[i : i + 1, :, : n + 1])
        torch.testing.assert_close(o[i : i + 1], ref, atol=1e-5, rtol=1e-5)
    if not ragged:
        out = (torch.empty(b, hq, 1, d), torch.empty(b, hq, 1))
        op.with_kvcache(q, kc, vc, lens, out=out)
        with pytest.raises(OpInputError, match=r"^q: expected .*; float32 also on the CPU"):
            op.with_kvcache(q.half(), kc, vc, lens)
        with pytest.raises(OpInputError, match=r"^k_cache: expected dtype torch.float32 \(q's"):
            op.with_kvcache(q, kc.bfloat16(), vc.bfloat16(), lens)


def test_opcheck_both_schemas():
    op = _op("mistral_swa")
    d = op.with_kvcache  # registers
    del d
    lens = [2, 5]
    kc, vc, table = make_cache([8, 8], page_size=4, hkv=2, d=128, dv=128, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 1, 128).to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    from flashgen.ops.decode.op import decode_op

    dop = decode_op(op)
    torch.library.opcheck(
        dop.torch_op(False),
        (q, kc, vc, lens_t, table, 0.1, 0, 4096),
        test_utils=("test_schema", "test_faketensor"),
    )
    kn = torch.randn(2, 2, 1, 128).to(torch.bfloat16)
    torch.library.opcheck(
        dop.torch_op(True),
        (q, kc, vc, lens_t, table, kn, kn.clone(), 0.1, 0, 4096),
        test_utils=("test_schema", "test_faketensor"),
    )


# ----------------------------------------------------------------------------- bad inputs
def _base():
    op = _op("mistral_swa")
    kc, vc, table = make_cache([6, 6], page_size=4, hkv=2, d=128, dv=128, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 1, 128).to(torch.bfloat16)
    return op, q, kc, vc, table, torch.tensor([3, 6], dtype=torch.int32)


def test_bad_inputs_raise_op_input_error():
    op, q, kc, vc, table, lens = _base()
    call = op.with_kvcache
    with pytest.raises(OpInputError, match="block_table: too short"):
        call(q, kc, vc, torch.tensor([3, 9], dtype=torch.int32), block_table=table)
    bad = table.clone()
    bad[1, 1] = kc.shape[0]
    with pytest.raises(OpInputError, match=r"block_table: expected page indices in \[0,"):
        call(q, kc, vc, lens, block_table=bad)
    bad[1, 1] = -1
    with pytest.raises(OpInputError, match="block_table: expected page indices"):
        call(q, kc, vc, lens, block_table=bad)
    with pytest.raises(OpInputError, match="cache_seqlens: expected values >= 0"):
        call(q, kc, vc, torch.tensor([-1, 2], dtype=torch.int32), block_table=table)
    with pytest.raises(OpInputError, match="cache_seqlens: expected dtype torch.int32"):
        call(q, kc, vc, lens.long(), block_table=table)
    with pytest.raises(OpInputError, match="block_table: expected dtype torch.int32"):
        call(q, kc, vc, lens, block_table=table.long())
    with pytest.raises(OpInputError, match="q: expected dtype"):
        call(q.half(), kc, vc, lens, block_table=table)
    with pytest.raises(OpInputError, match="k_cache: expected dtype"):
        call(q, kc.half(), vc, lens, block_table=table)
    with pytest.raises(OpInputError, match="k_cache: expected a 4-D"):
        call(q, kc[0], vc, lens, block_table=table)
    with pytest.raises(OpInputError, match="k_cache: expected stride"):
        call(q, kc.transpose(2, 3).contiguous().transpose(2, 3), vc, lens, block_table=table)
    with pytest.raises(OpInputError, match="v_cache: expected the leading dims"):
        call(q, kc, vc[:-1], lens, block_table=table)
    with pytest.raises(OpInputError, match="block_table: expected 2 rows"):
        call(q, kc, vc, lens, block_table=table[:1])
    with pytest.raises(OpInputError, match="cache_seqlens: expected shape"):
        call(q, kc, vc, lens[:1], block_table=table)
    with pytest.raises(OpInputError, match="q: expected num_heads"):
        call(q[:, :3], kc, vc, lens, block_table=table)
    with pytest.raises(OpInputError, match="k_new, v_new"):
        call(
            q,
            kc,
            vc,
            lens,
            block_table=table,
            k_new=torch.zeros(2, 2, 1, 128, dtype=torch.bfloat16),
        )
    with pytest.raises(OpInputError, match="k_new: expected shape"):
        z = torch.zeros(2, 2, 2, 128, dtype=torch.bfloat16)
        call(q, kc, vc, lens, block_table=table, k_new=z, v_new=z)
    with pytest.raises(OpInputError, match="num_splits"):
        call(q, kc, vc, lens, block_table=table, num_splits=0)
    with pytest.raises(OpInputError, match="num_splits"):
        call(q, kc, vc, lens, block_table=table, num_splits=129)
    with pytest.raises(OpInputError, match="cu_seqlens_q"):
        call(q, kc, vc, lens, block_table=table, cu_seqlens_q=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(OpInputError, match="k_cache: expected batch"):
        call(q, kc, vc, lens)  # a paged cache without its block table
    with pytest.raises(OpInputError, match="window"):
        call(q, kc, vc, lens, block_table=table, window=0)
    with pytest.raises(OpInputError, match="cache_seqlens: request 0 needs"):
        dk = torch.zeros(2, 2, 4, 128, dtype=torch.bfloat16)
        call(q, dk, dk, torch.tensor([5, 1], dtype=torch.int32))
    if torch.cuda.is_available():  # pragma: no cover - device-dependent
        return
    meta = torch.zeros(2, 2, 4, 128, dtype=torch.bfloat16, device="meta")
    with pytest.raises(OpInputError, match="expected device"):
        call(q, meta, meta, lens)


def test_block_table_with_a_dense_cache_names_the_paged_layout():
    """A dense cache [B, Hkv, S_cache, D] passed with a block_table was read as a paged one
    (heads_kv = S_cache) and refused as "q: expected num_heads to be a multiple of the cache's
    num_heads_kv 8": the message names block_table, the paged layout it needs and the shape
    it got, padded and ragged."""
    op = _op("llama3_gqa")
    d = op.spec.head_dim
    q = torch.randn(2, 4, 1, d).to(torch.bfloat16)
    kc = torch.randn(2, 2, 8, d).to(torch.bfloat16)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    table = torch.zeros(2, 2, dtype=torch.int32)
    msg = (rf"^block_table: needs a paged cache, k_cache \[num_pages, page_size, heads_kv, "
           rf"head_dim\], got k_cache of shape \[2, 2, 8, {d}\] \(num_heads_kv 8 does not divide "
           rf"q's 4 heads\); it looks like a dense cache \[batch, heads_kv, seqlen_cache, "
           rf"head_dim\], which takes block_table=None")  # fmt: skip
    with pytest.raises(OpInputError, match=msg):
        op.with_kvcache(q, kc, kc.clone(), lens, block_table=table)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(OpInputError, match=msg):
        op.with_kvcache(q[:, :, 0], kc, kc.clone(), lens, block_table=table, cu_seqlens_q=cu,
                        max_seqlen_q=1)  # fmt: skip
    o, _ = op.with_kvcache(q, kc, kc.clone(), lens)  # the same cache without the table
    assert o.shape == (2, 4, 1, op.spec.head_dim_v)


def test_a_ragged_call_on_meta_tensors_needs_max_seqlen_q():
    """Without max_seqlen_q a ragged call reads it from cu_seqlens_q's values, which a meta
    tensor has none of: it raised torch's NotImplementedError ("Cannot copy out of meta
    tensor"); now an OpInputError naming max_seqlen_q.  With it, the call gives meta o and lse
    of the right shapes."""
    op = _op("llama3_gqa")
    d = op.spec.head_dim
    q = torch.empty(3, 4, d, device="meta", dtype=torch.bfloat16)
    kc = torch.empty(2, 2, 8, d, device="meta", dtype=torch.bfloat16)
    lens = torch.zeros(2, dtype=torch.int32, device="meta")
    cu = torch.zeros(3, dtype=torch.int32, device="meta")
    with pytest.raises(OpInputError, match="^max_seqlen_q: required with a meta cu_seqlens_q"):
        op.with_kvcache(q, kc, kc, lens, cu_seqlens_q=cu)
    o, lse = op.with_kvcache(q, kc, kc, lens, cu_seqlens_q=cu, max_seqlen_q=2)
    assert o.device.type == "meta" and o.shape == (3, 4, op.spec.head_dim_v)
    assert lse.shape == (4, 3)


def test_unchecked_values_clamp_and_empty_pages():
    """The kernels' semantics for values the debug check refuses (host mirror): the length is
    clamped to the request's pages, a page index outside [0, num_pages) is empty, the rest of
    the request is attended; negative lengths are empty; dense clamps to S_cache."""
    dims = DecodeDims(batch=3, heads_q=4, heads_kv=2, seqlen_q=1, head_dim_v=128, paged=True,
                      num_pages=7, page_size=16, max_pages=3, append=False)  # fmt: skip
    table = torch.tensor([[0, 10**6, 2], [-5, 3, 4], [5, 6, 1]], dtype=torch.int32)
    lens = torch.tensor([40, 10**6, -3], dtype=torch.int32)
    live, mask = unchecked_key_mask(dims, lens, table)
    assert live.tolist() == [40, 48, 0]
    assert mask[0].nonzero().flatten().tolist() == [*range(16), *range(32, 40)]
    assert mask[1].nonzero().flatten().tolist() == list(range(16, 48))
    assert not mask[2].any()
    app = DecodeDims(2, 4, 2, 4, 128, False, 2, 10, 1, True)  # dense S_cache 10, 4 appended
    live, mask = unchecked_key_mask(app, torch.tensor([3, 8], dtype=torch.int32))
    assert live.tolist() == [7, 10] and mask.sum(1).tolist() == [7, 10]


def test_merge_attention_propagates_nan():
    """A NaN partial poisons the merge (the combine kernel's rule), an empty one does not."""
    o = torch.randn(2, 8)
    lse_a = torch.tensor([math.nan, 1.0])
    lse_b = torch.tensor([0.5, -math.inf])
    mo, ml = merge_attention(o, lse_a, o, lse_b)
    assert math.isnan(ml[0]) and torch.isnan(mo[0]).all()
    assert ml[1] == 1.0 and torch.equal(mo[1], o[1])


def test_planned_fast_path_packs_the_general_paths_arguments(monkeypatch):
    """The planned fast path (CPU tensors standing in for CUDA ones, the driver faked): its
    argument blocks hold exactly what the general path passes (every attention and append
    argument, by name), it enqueues the append then the attention kernel with the plan's
    grids, a second call with the same layout skips validation, and a new layout
    re-validates (a bad one raises OpInputError)."""
    import types

    from flashgen.ops import calls as calls_mod
    from flashgen.ops.decode import fast as dfast
    from flashgen.ops.decode import op as dmod
    from flashgen.runtime import launch as runtime
    from flashgen.runtime import tma

    launches = []

    class Driver:
        @staticmethod
        def cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            launches.append((fn, (gx, gy, gz), bx, smem, params))
            return 0

    monkeypatch.setattr(tma, "driver", lambda: Driver)
    monkeypatch.setattr(dfast, "_eager_cuda", lambda q, k, v: True)
    monkeypatch.setattr(dfast, "_GET_DEVICE", lambda: None)
    monkeypatch.setattr(calls_mod, "_RAW_STREAM", lambda index: 7)
    op = _op("mistral_swa")
    dop = dmod.decode_op(op)
    unit = family.plan(op.spec, "sm_90")
    kern = {r: runtime.LoadedKernel(plan=unit.kernel(r), module=None,
                                    function=types.SimpleNamespace(ptr=11 + i), device_index=0)
            for i, r in enumerate(("attn", "append"))}  # fmt: skip
    cpu = torch.device("cpu")
    b, hq, hkv, ps, pages = 2, 8, 2, 16, 40
    dims = DecodeDims(b, hq, hkv, 1, 128, True, pages, ps, 16, True)
    plan = dop.plan_for(dims, cpu, 4)
    plan.kernels = kern
    plan.o_part, plan.lse_part, plan.counters = dfast._workspace(dims, plan.geometry, 4, cpu)
    plan.fast = dfast._FastPath(dop, plan)
    q = torch.randn(b, hq, 1, 128).to(torch.bfloat16)
    kc = torch.zeros(pages, ps, hkv, 128, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    lens = torch.tensor([5, 100], dtype=torch.int32)
    table = torch.arange(b * 16, dtype=torch.int32).view(b, 16) % pages
    kn = torch.randn(b, hkv, 1, 128).to(torch.bfloat16)
    vn = torch.randn_like(kn)
    o, lse = op.with_kvcache(q, kc, vc, lens, block_table=table, k_new=kn, v_new=vn,
                             plan=plan, window=9)  # fmt: skip
    assert o.shape == (b, hq, 1, 128) and lse.shape == (b, hq, 1)
    assert [x[0] for x in launches] == [12, 11]  # append, then attention
    assert launches[1][1] == plan.geometry.grid and launches[0][1] == plan.geometry.append_grid
    assert launches[1][3] == kern["attn"].plan.smem_bytes
    scale = 1 / math.sqrt(128)
    values = dop.launch_values(plan, q, kc, vc, lens, table, o, lse, scale, [9], {})

    def as_c(layout, name, v):
        code = layout.codes[layout.index[name]]
        if code == "Q":
            return v if isinstance(v, int) else v.data_ptr()
        return float(torch.tensor(v, dtype=torch.float32)) if code == "f" else int(v)

    fast = plan.fast
    got = launched_args(fast.attn_layout, launches[1][4])
    want = {n: as_c(fast.attn_layout, n, values[n]) for n in fast.attn_layout.names}
    assert got == want
    got = launched_args(fast.app_layout, launches[0][4])
    av = dop.append_values(values, kn, vn)
    assert got == {n: as_c(fast.app_layout, n, av[n]) for n in fast.app_layout.names}
    # same layout: no validation (a wrong-device plan check would raise if it ran)
    calls = []
    monkeypatch.setattr(fast, "_prepare", lambda *a: calls.append(1) or False)
    op.with_kvcache(q, kc, vc, lens, block_table=table, k_new=kn, v_new=vn, plan=plan,
                    window=9)  # fmt: skip
    assert calls == [] and len(launches) == 4
    monkeypatch.undo()
    monkeypatch.setattr(tma, "driver", lambda: Driver)
    monkeypatch.setattr(dfast, "_eager_cuda", lambda q, k, v: True)
    monkeypatch.setattr(dfast, "_GET_DEVICE", lambda: None)
    monkeypatch.setattr(calls_mod, "_RAW_STREAM", lambda index: 7)
    with pytest.raises(OpInputError, match="q: expected dtype"):
        op.with_kvcache(q.half(), kc, vc, lens, block_table=table, k_new=kn, v_new=vn,
                        plan=plan, window=9)  # fmt: skip
    # the layout holds cache_seqlens' strides; a missing v_new is the general path's to name
    strided = torch.tensor([5, 0, 100, 0], dtype=torch.int32)[::2]
    with pytest.raises(OpInputError, match="cache_seqlens: expected a contiguous tensor"):
        op.with_kvcache(q, kc, vc, strided, block_table=table, k_new=kn, v_new=vn, plan=plan,
                        window=9)  # fmt: skip
    with pytest.raises(OpInputError, match="v_new"):
        op.with_kvcache(q, kc, vc, lens, block_table=table, k_new=kn, plan=plan, window=9)


def test_options_schedule_knobs():
    o = family.Options(ctas_per_sm=3, split_waves=0.5, min_split_blocks=2)
    assert o.unit_key() == (None, None, 3, 2, True, 4)
    for bad in (dict(ctas_per_sm=5), dict(ctas_per_sm=True), dict(split_waves=8),
                dict(min_split_blocks=0), dict(min_split_blocks=17)):  # fmt: skip
        with pytest.raises(ValueError):
            family.Options(**bad)
    spec = _op("llama3_gqa").spec
    p = family.plan(spec, "sm_90", family.Options(block_n=128, stages=3))  # sm_90 only
    assert p.smem_bytes > family.SMEM_LIMIT["sm_90"] and family.ctas_per_sm(p) == 1
    with pytest.raises(ValueError, match="shared memory"):
        family.plan(spec, "sm_80", family.Options(block_n=128, stages=3))
    d = family.plan(spec, "sm_90")
    assert family.ctas_per_sm(d) == 3 and d.context["min_split_blocks"] == 2  # d128: 2 stages
    assert family.ctas_per_sm(family.plan(spec, "sm_90", family.Options(ctas_per_sm=1))) == 1
    # a wave of 396 CTAs for 8: 49 splits; half a wave 24; min_split_blocks caps a 4k cache
    kw = dict(batch=1, heads_kv_ctas=8, m_blocks=1, num_sms=132)
    assert family.choose_num_splits(d, max_seqlen_k=65536, **kw) == 49
    assert family.choose_num_splits(d, max_seqlen_k=65536, split_waves=0.5, **kw) == 24
    assert family.choose_num_splits(d, max_seqlen_k=4096, **kw) == 32
    d4 = family.plan(spec, "sm_90", family.Options(min_split_blocks=4))
    assert family.choose_num_splits(d4, max_seqlen_k=4096, **kw) == 16
    assert family.effective_splits(0, 64, 33, 4) == 16 and family.effective_splits(0, 64, 33) == 32


def test_window_sizes_the_splits_by_its_blocks():
    swa, llama = _op("mistral_swa").spec, _op("llama3_gqa").spec
    kw = dict(capacity=65536, seqlen_q=1, block_n=64)
    assert family.live_key_blocks(swa, **kw) == 64  # the default window, 4096 keys
    assert family.live_key_blocks(swa, params={"window": 100}, **kw) == 2
    assert family.live_key_blocks(swa, capacity=65536, seqlen_q=4, block_n=64,
                                  params={"window": 4096}) in (64, 65)  # fmt: skip
    assert family.live_key_blocks(llama, **kw) == 1024  # causal: all of them
    p = family.plan(swa, "sm_90")
    wave = dict(batch=1, heads_kv_ctas=8, m_blocks=1, max_seqlen_k=65536, num_sms=132)
    assert family.choose_num_splits(p, live_blocks=64, **wave) == 32  # a 4k cache's
    assert family.choose_num_splits(p, **wave) == 49
    op = _op("mistral_swa")
    plan = dict(batch=1, num_heads=32, num_heads_kv=8, cache_capacity=65536, page_size=16,
                num_pages=4096, device="cpu")  # fmt: skip
    small = op.plan_decode(window=512, **plan)
    assert small.live_blocks == 8 and small.num_splits == 4
    assert op.plan_decode(**plan).live_blocks == 64
    with pytest.raises(OpInputError, match="not a scalar param"):
        op.plan_decode(windw=512, **plan)
    with pytest.raises(OpInputError, match="window"):
        op.plan_decode(window=0, **plan)


def test_out_buffers():
    op = _op("llama3_gqa")
    lens = [3, 9]
    kc, vc, table = make_cache(lens, page_size=4, hkv=2, d=128, dv=128, dtype=torch.bfloat16)
    q = torch.randn(2, 8, 1, 128).to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table)
    out = (torch.empty_like(o), torch.empty_like(lse))
    got = op.with_kvcache(q, kc, vc, lens_t, block_table=table, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    assert torch.equal(out[0], o) and torch.equal(out[1], lse)
    with pytest.raises(OpInputError, match=r"out\[1\]: expected shape"):
        op.with_kvcache(q, kc, vc, lens_t, block_table=table, out=(out[0], out[1][:1]))
    with pytest.raises(OpInputError, match=r"out\[0\]: expected a contiguous"):
        bad = torch.empty(2, 8, 1, 256, dtype=torch.bfloat16)[..., ::2]
        op.with_kvcache(q, kc, vc, lens_t, block_table=table, out=(bad, out[1]))
    with pytest.raises(OpInputError, match="out: expected a pair"):
        op.with_kvcache(q, kc, vc, lens_t, block_table=table, out=out[0])


def test_planned_fast_path_writes_out_buffers(monkeypatch):
    """With ``out=``, the fast path packs the caller's o / lse addresses, allocates nothing
    and returns ``out``; a bad out is refused with the general path's error."""
    import ctypes
    import types

    from flashgen.ops import calls as calls_mod
    from flashgen.ops.decode import fast as dfast
    from flashgen.ops.decode import op as dmod
    from flashgen.runtime import launch as runtime
    from flashgen.runtime import tma

    launches = []

    class Driver:
        @staticmethod
        def cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            launches.append(params)
            return 0

    monkeypatch.setattr(tma, "driver", lambda: Driver)
    monkeypatch.setattr(dfast, "_eager_cuda", dfast._plain_eager_fast)
    monkeypatch.setattr(dfast, "_GET_DEVICE", lambda: None)
    monkeypatch.setattr(calls_mod, "_RAW_STREAM", lambda index: 7)
    op = _op("llama3_gqa")
    dop = dmod.decode_op(op)
    unit = family.plan(op.spec, "sm_90")
    kern = {r: runtime.LoadedKernel(plan=unit.kernel(r), module=None,
                                    function=types.SimpleNamespace(ptr=1), device_index=0)
            for r in ("attn", "append")}  # fmt: skip
    cpu = torch.device("cpu")
    dims = DecodeDims(1, 8, 2, 1, 128, True, 8, 16, 4, False)
    plan = dop.plan_for(dims, cpu, 1)
    plan.kernels = kern
    plan.fast = dfast._FastPath(dop, plan)
    q = torch.randn(1, 8, 1, 128).to(torch.bfloat16)
    kc = torch.zeros(8, 16, 2, 128, dtype=torch.bfloat16)
    lens = torch.tensor([20], dtype=torch.int32)
    table = torch.arange(4, dtype=torch.int32).view(1, 4)
    out = (torch.empty(1, 8, 1, 128, dtype=torch.bfloat16), torch.empty(1, 8, 1))
    got = op.with_kvcache(q, kc, kc, lens, block_table=table, plan=plan, out=out)
    assert got is out and len(launches) == 1
    base = ctypes.cast(launches[0], ctypes.POINTER(ctypes.c_void_p))[0]
    ptrs = ctypes.cast(base, ctypes.POINTER(ctypes.c_uint64))
    assert (ptrs[3], ptrs[4]) == (out[0].data_ptr(), out[1].data_ptr())
    with pytest.raises(OpInputError, match=r"out\[1\]: expected shape"):
        op.with_kvcache(q, kc, kc, lens, block_table=table, plan=plan,
                        out=(out[0], torch.empty(1, 8)))  # fmt: skip
    out[1].requires_grad_()  # the layout of a call that passed: refused all the same
    with pytest.raises(OpInputError, match=r"out\[1\]: expected a tensor that does not require"):
        op.with_kvcache(q, kc, kc, lens, block_table=table, plan=plan, out=out)
    assert len(launches) == 1


def test_plot_styles_are_stable_per_method():
    from flashgen.bench.decode import method_styles

    a = method_styles(["flashgen_dense", "sdpa_cudnn", "sdpa_flash", "flex"])
    b = method_styles(["sdpa_cudnn", "flashgen_paged1"])
    assert a["sdpa_cudnn"] == b["sdpa_cudnn"]
    assert len({a[m] for m in a}) == len(a)
