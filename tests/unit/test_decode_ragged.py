"""Ragged Sq_new (op.with_kvcache with cu_seqlens_q) on CPU: request b's queries are rows
cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q [total_q, Hq, D]; the result must equal one padded
call per request (bitwise: the CPU path runs them) and the float64 reference; empty requests,
Sq_b 1 / 4 / 64 mixed, per-request appends, GQA; bad cu_seqlens_q raise OpInputError.  Plus the
debug check of appends that would run past a request's pages (which the kernels drop)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import flashgen
from flashgen.frontend.errors import OpInputError
from flashgen.ops.decode import decode_reference

ROOT = Path(__file__).resolve().parents[2]


def _op(name):
    return flashgen.load(ROOT / "specs" / f"{name}.yaml")


def _params(name, hq):
    if name == "alibi":
        return {"slopes": torch.tensor([2.0 ** (-8 * (i + 1) / hq) for i in range(hq)])}
    if name == "mistral_swa":
        return {"window": 5}
    return {}


def _cache(lens, *, ps, hkv, d, dv, dtype, dense, cap, seed=0):
    """Random keys in every slot (the live ones matter); paged: shuffled pages."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lens)
    if dense:
        kc = torch.randn(batch, hkv, cap, d, generator=g).to(dtype)
        vc = torch.randn(batch, hkv, cap, dv, generator=g).to(dtype)
        return kc, vc, None
    max_pages = -(-cap // ps)
    num_pages = batch * max_pages + 2
    table = torch.randperm(num_pages, generator=g)[: batch * max_pages]
    table = table.view(batch, max_pages).to(torch.int32).contiguous()
    kc = torch.randn(num_pages, ps, hkv, d, generator=g).to(dtype)
    vc = torch.randn(num_pages, ps, hkv, dv, generator=g).to(dtype)
    return kc, vc, table


def _dtype(spec):
    return torch.bfloat16 if spec.dtype == "bf16" else torch.float16


def _case(name, sqs, lens, *, hq, hkv, ps, dense, append, seed=0):
    op = _op(name)
    spec = op.spec
    dt = _dtype(spec)
    g = torch.Generator().manual_seed(seed + 1)
    cap = max(n + s for n, s in zip(lens, sqs, strict=True)) + 2
    kc, vc, table = _cache(lens, ps=ps, hkv=hkv, d=spec.head_dim, dv=spec.head_dim_v, dtype=dt,
                           dense=dense, cap=cap, seed=seed)  # fmt: skip
    cu = torch.tensor([0, *torch.tensor(sqs).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    q = torch.randn(total, hq, spec.head_dim, generator=g).to(dt)
    kn = vn = None
    if append:
        kn = torch.randn(total, hkv, spec.head_dim, generator=g).to(dt)
        vn = torch.randn(total, hkv, spec.head_dim_v, generator=g).to(dt)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return op, q, kc, vc, lens_t, table, kn, vn, cu


def _padded(op, q, kc, vc, lens_t, table, kn, vn, cu, params):
    """One padded call per request (request b alone: batch 1, its own Sq_b)."""
    outs = []
    for b in range(len(lens_t)):
        q0, q1 = int(cu[b]), int(cu[b + 1])
        kw = {}
        if kn is not None:
            kw = {"k_new": kn[q0:q1].permute(1, 0, 2)[None],
                  "v_new": vn[q0:q1].permute(1, 0, 2)[None]}  # fmt: skip
        if table is None:
            c = (kc[b : b + 1], vc[b : b + 1], lens_t[b : b + 1])
            o, lse = op.with_kvcache(q[q0:q1].permute(1, 0, 2)[None], *c, **kw, **params)
        else:
            o, lse = op.with_kvcache(q[q0:q1].permute(1, 0, 2)[None], kc, vc, lens_t[b : b + 1],
                                     block_table=table[b : b + 1], **kw, **params)  # fmt: skip
        outs.append((o[0].permute(1, 0, 2), lse[0]))
    return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs], dim=1)


CASES = [
    ("mistral_swa", (1, 4, 0, 64), (9, 0, 5, 70), (8, 2), 3, False, False),
    ("alibi", (4, 1, 64, 0), (3, 17, 1, 0), (4, 4), 16, False, True),
    ("llama3_gqa", (0, 64, 1, 4), (0, 5, 40, 3), (32, 8), 1, False, True),
    ("llama3_gqa", (4, 0, 1), (6, 2, 0), (8, 1), 0, True, True),
    ("gemma2_softcap", (1, 64, 4), (30, 0, 2), (8, 2), 0, True, False),
]


@pytest.mark.parametrize("name,sqs,lens,heads,ps,dense,append", CASES, ids=str)
def test_ragged_equals_per_request_padded_calls(name, sqs, lens, heads, ps, dense, append):
    hq, hkv = heads
    args = _case(name, sqs, lens, hq=hq, hkv=hkv, ps=ps, dense=dense, append=append)
    op, q, kc, vc, lens_t, table, kn, vn, cu = args
    params = _params(name, hq)
    kc0, vc0 = kc.clone(), vc.clone()
    kw = {"k_new": kn, "v_new": vn} if append else {}
    o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, cu_seqlens_q=cu, **kw,
                             **params)  # fmt: skip
    assert o.shape == (q.shape[0], hq, op.spec.head_dim_v) and lse.shape == (hq, q.shape[0])
    k_after, v_after = kc.clone(), vc.clone()
    ro, rl = _padded(op, q, kc0, vc0, lens_t, table, kn, vn, cu, params)
    assert torch.equal(o, ro) and torch.equal(lse, rl)
    assert torch.equal(k_after, kc0) and torch.equal(v_after, vc0)  # same appends, same slots
    # Against the float64 reference, request by request (seqlen_q = Sq_b).
    for b in range(len(lens)):
        q0, q1 = int(cu[b]), int(cu[b + 1])
        live = torch.tensor([lens[b] + (sqs[b] if append else 0)])
        tb = None if table is None else table[b : b + 1]
        kcb, vcb = (k_after, v_after) if tb is not None else (k_after[b:b + 1], v_after[b:b + 1])
        r64o, r64l = decode_reference(op.spec, q[q0:q1].permute(1, 0, 2)[None], kcb, vcb, live,
                                      tb, params=params)  # fmt: skip
        ob, lb = o[q0:q1].permute(1, 0, 2).double(), lse[:, q0:q1].double()
        err = (ob - r64o[0]).abs().max().item() if ob.numel() else 0.0
        assert err <= 2e-2, (b, err)
        fin = torch.isfinite(r64l[0])
        assert torch.equal(torch.isfinite(lb), fin)
        if fin.any():
            assert (lb - r64l[0])[fin].abs().max().item() <= 1e-2


def test_ragged_append_lands_per_request():
    """Request b's Sq_b new rows land at cache_seqlens[b] .. + Sq_b (its own count)."""
    op, q, kc, vc, lens_t, table, kn, vn, cu = _case(
        "llama3_gqa", (2, 0, 3), (4, 1, 0), hq=8, hkv=2, ps=3, dense=False, append=True
    )
    op.with_kvcache(q, kc, vc, lens_t, block_table=table, k_new=kn, v_new=vn, cu_seqlens_q=cu)
    for b, (n, s) in enumerate(zip((4, 1, 0), (2, 0, 3), strict=True)):
        for i in range(s):
            pos = n + i
            pg, slot = int(table[b, pos // 3]), pos % 3
            assert torch.equal(kc[pg, slot], kn[int(cu[b]) + i])
            assert torch.equal(vc[pg, slot], vn[int(cu[b]) + i])


def test_all_empty_and_max_seqlen_q():
    op, q, kc, vc, lens_t, table, *_, cu = _case(
        "llama3_gqa", (0, 0), (3, 0), hq=8, hkv=2, ps=4, dense=False, append=False
    )
    o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, cu_seqlens_q=cu)
    assert o.shape == (0, 8, 128) and lse.shape == (8, 0)
    op, q, kc, vc, lens_t, table, *_, cu = _case(
        "llama3_gqa", (1, 3), (3, 5), hq=8, hkv=2, ps=4, dense=False, append=False
    )
    a = op.with_kvcache(q, kc, vc, lens_t, block_table=table, cu_seqlens_q=cu)
    b = op.with_kvcache(q, kc, vc, lens_t, block_table=table, cu_seqlens_q=cu, max_seqlen_q=4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    no_key = op.with_kvcache(q, kc, vc, torch.zeros(2, dtype=torch.int32), block_table=table,
                             cu_seqlens_q=cu)  # fmt: skip
    assert bool((no_key[1] == -math.inf).all()) and bool((no_key[0] == 0).all())


def test_ragged_bad_inputs():
    op, q, kc, vc, lens_t, table, kn, vn, cu = _case(
        "llama3_gqa", (1, 3), (3, 5), hq=8, hkv=2, ps=4, dense=False, append=True
    )

    def call(**kw):
        base = dict(block_table=table, cu_seqlens_q=cu)
        base.update(kw)
        qq = base.pop("q", q)
        return op.with_kvcache(qq, kc, vc, lens_t, **base)

    bad = [
        ({"cu_seqlens_q": cu.long()}, "cu_seqlens_q: expected dtype torch.int32"),
        ({"cu_seqlens_q": torch.tensor([1, 1, 4], dtype=torch.int32)}, "cu_seqlens_q[0] == 0"),
        ({"cu_seqlens_q": torch.tensor([0, 3, 2], dtype=torch.int32)}, "nondecreasing"),
        ({"cu_seqlens_q": torch.tensor([0, 1, 3], dtype=torch.int32)}, "cu_seqlens_q[-1] == 4"),
        ({"cu_seqlens_q": torch.tensor([0, 4], dtype=torch.int32)}, "block_table: expected 1"),
        ({"max_seqlen_q": 2}, "max_seqlen_q: expected at least every request's Sq_b"),
        ({"max_seqlen_q": 9}, "max_seqlen_q: expected an int in [1, 4]"),
        ({"max_seqlen_q": 2.0}, "max_seqlen_q: expected a Python int"),
        ({"q": q[None]}, "q: expected a 3-D tensor"),
        ({"k_new": kn[:3], "v_new": vn[:3]}, "k_new: expected 4 rows"),
        ({"k_new": kn}, "k_new, v_new: expected both or neither"),
        ({"cu_seqlens_q": [0, 1, 4]}, "cu_seqlens_q: expected a torch.Tensor"),
    ]
    for kw, msg in bad:
        with pytest.raises(OpInputError) as e:
            call(**kw)
        assert msg in str(e.value), (kw, str(e.value))
    with pytest.raises(OpInputError, match="max_seqlen_q: only with cu_seqlens_q"):
        op.with_kvcache(q[None].permute(0, 2, 1, 3), kc, vc, lens_t[:1], block_table=table[:1],
                        max_seqlen_q=1)  # fmt: skip


@pytest.mark.parametrize("dense", [False, True])
def test_append_past_the_pages_is_flagged(dense):
    """An append the kernels would drop (past the request's pages or the dense cache) raises,
    naming the request (CPU always; CUDA under flashgen.env.VARLEN_CHECK): padded and ragged."""
    op = _op("llama3_gqa")
    dt = torch.bfloat16
    cap = 8
    kc, vc, table = _cache([0, 0], ps=4, hkv=2, d=128, dv=128, dtype=dt, dense=dense, cap=cap)
    lens = torch.tensor([2, 6], dtype=torch.int32)  # request 1: 6 + 3 > 8
    q = torch.randn(2, 8, 3, 128).to(dt)
    kn = torch.randn(2, 2, 3, 128).to(dt)
    kc0 = kc.clone()
    with pytest.raises(OpInputError, match=r"k_new: the append of request 1 would run past"):
        op.with_kvcache(q, kc, vc, lens, block_table=table, k_new=kn, v_new=kn.clone())
    assert torch.equal(kc, kc0)  # refused before any write
    # ragged: request 0 appends 3 (fits), request 1 appends 2 (6 + 2 = 8 fits), then 3 (no)
    for sq1, ok in ((2, True), (3, False)):
        cu = torch.tensor([0, 3, 3 + sq1], dtype=torch.int32)
        qr = torch.randn(3 + sq1, 8, 128).to(dt)
        knr = torch.randn(3 + sq1, 2, 128).to(dt)
        kw = dict(block_table=table, k_new=knr, v_new=knr.clone(), cu_seqlens_q=cu)
        if ok:
            op.with_kvcache(qr, kc, vc, lens, **kw)
        else:
            with pytest.raises(OpInputError, match=r"append of request 1 .* 6 \+ 3 new keys"):
                op.with_kvcache(qr, kc, vc, lens, **kw)


@pytest.mark.parametrize("splits", [1, 3])
def test_ragged_launch_values_cover_the_ragged_kernels_arguments(splits):
    """The CUDA path's arguments (built on CPU tensors, no launch): every argument of the
    ragged unit's attn and append kernels has a value, the workspace holds total_q x Hq rows,
    q / k_new pass their token stride as q_ss / kn_ss, new_keys is the append flag."""
    from flashgen.families import decode as family
    from flashgen.ops.decode import decode_op, validate_decode_ragged

    op, q, kc, vc, lens_t, table, kn, vn, cu = _case(
        "alibi", (1, 0, 5), (3, 4, 0), hq=8, hkv=2, ps=4, dense=False, append=True
    )
    dop = decode_op(op)
    dims = validate_decode_ragged(op.spec, q, kc, vc, lens_t, table, kn, vn, cu, 5)
    plan = dop.plan_for(dims, torch.device("cpu"), splits, own_workspace=False)
    o, lse = dop._outputs(q, dims)
    slopes = {"slopes": _params("alibi", 8)["slopes"]}
    values = dop.launch_values(plan, q, kc, vc, lens_t, table, o, lse, 0.1, [], slopes)
    values["cu_seqlens_q"] = cu
    unit = family.plan(op.spec, "sm_80", ragged=True)
    assert {a.name for a in unit.args} <= set(values)
    av = dop.append_values(values, kn, vn)
    assert {a.name for a in unit.kernel("append").args} <= set(av)
    assert (values["q_sb"], values["q_ss"], values["q_sh"]) == (0, q.stride(0), q.stride(1))
    assert (av["kn_sb"], av["kn_ss"], av["kn_sh"]) == (0, kn.stride(0), kn.stride(1))
    assert values["max_seqlen_q"] == 5 and values["new_keys"] == 1
    assert plan.geometry.grid == (plan.geometry.m_blocks * splits, 2, 3)
    if splits > 1:
        assert values["o_part"].shape == (splits, 6 * 8, op.spec.head_dim_v)
