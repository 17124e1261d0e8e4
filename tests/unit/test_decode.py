"""Serving (op.with_kvcache, flashgen.ops.decode) on CPU: the op gathers pages and runs the
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

import flashgen
from flashgen.families import decode as family
from flashgen.frontend.errors import OpInputError
from flashgen.ops.decode import decode_reference, merge_attention
from flashgen.ops.reference import attention_reference

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


def test_plan_shapes_fit_and_refusals():
    from flashgen.frontend.spec import load_spec

    for path in sorted((ROOT / "specs").glob("*.yaml")):
        spec = load_spec(path)
        if family.unsupported_reason(spec):
            assert spec.name == "document_mask"
            with pytest.raises(ValueError, match="reads tensor params"):
                family.plan(spec, "sm_80")
            continue
        for t in ("sm_80", "sm_90"):
            p = family.plan(spec, t)
            assert p.smem_bytes <= family.SMEM_LIMIT["sm_80"]
            assert p.kernel("combine").kernel_name.endswith("_combine")


def test_document_mask_refuses_decode():
    op = flashgen.load(ROOT / "specs" / "document_mask.yaml")
    q = torch.zeros(1, 1, 1, 128, dtype=torch.bfloat16)
    kc = torch.zeros(1, 1, 4, 128, dtype=torch.bfloat16)
    with pytest.raises(OpInputError, match="reads tensor params"):
        op.with_kvcache(q, kc, kc, torch.ones(1, dtype=torch.int32))


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


def test_opcheck_both_schemas():
    op = _op("mistral_swa")
    d = op.with_kvcache  # registers
    del d
    lens = [2, 5]
    kc, vc, table = make_cache([8, 8], page_size=4, hkv=2, d=128, dv=128, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 1, 128).to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    from flashgen.ops.decode import decode_op

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
