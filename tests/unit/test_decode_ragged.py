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
from flashgen.ops.decode.op import decode_reference

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
        ({"cu_seqlens_q": torch.tensor([0, 4], dtype=torch.int32)}, "expected shape [3] (batch"),
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
    from flashgen.ops.decode.op import decode_op, validate_decode_ragged

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


# ----------------------------------------------------------------------------- the same API
def test_uniform_ragged_equals_the_padded_op_and_the_mask_sees_b(tmp_path):
    """Every Sq_b equal: the ragged call is the padded op on the same rows, bitwise, also for
    a spec whose score_mod reads the request index ``b`` (a [batch, heads] tensor param):
    request b's rows see b, as the kernel's blockIdx.z."""
    path = tmp_path / "ragged_bbias.yaml"
    path.write_text(
        "name: ragged_bbias\nhead_dim: 64\ndtype: fp16\ntargets: [sm_80, sm_90]\nmask: causal\n"
        "score_mod: score + bias[b, h] * kv_idx\n"
        "params:\n  bias: {type: f32, shape: [batch, num_heads]}\nsoftmax_scale: auto\n"
    )
    hq, hkv, sq, lens = 4, 2, 3, (5, 0, 9)
    for name in ("ragged_bbias", "alibi"):
        if name == "alibi":
            op, q, kc, vc, lens_t, table, kn, vn, cu = _case(
                "alibi", (sq,) * 3, lens, hq=hq, hkv=hkv, ps=4, dense=False, append=True, seed=3
            )
            params = _params("alibi", hq)
        else:
            op, dt = flashgen.load(path), torch.float16
            kc, vc, table = _cache(lens, ps=4, hkv=hkv, d=64, dv=64, dtype=dt, dense=False,
                                   cap=16)  # fmt: skip
            g = torch.Generator().manual_seed(5)
            q = torch.randn(3 * sq, hq, 64, generator=g).to(dt)
            kn = torch.randn(3 * sq, hkv, 64, generator=g).to(dt)
            vn = torch.randn(3 * sq, hkv, 64, generator=g).to(dt)
            lens_t = torch.tensor(lens, dtype=torch.int32)
            cu = torch.arange(0, 3 * sq + 1, sq, dtype=torch.int32)
            params = {"bias": torch.randn(3, hq, generator=g)}
        spec = op.spec
        kc2, vc2 = kc.clone(), vc.clone()
        o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, k_new=kn, v_new=vn,
                                 cu_seqlens_q=cu, **params)  # fmt: skip

        def pad(t, sq=sq):  # [B * Sq, H, D] -> [B, H, Sq, D]
            return t.view(3, sq, *t.shape[1:]).permute(0, 2, 1, 3)

        po, pl = op.with_kvcache(pad(q), kc2, vc2, lens_t, block_table=table, k_new=pad(kn),
                                 v_new=pad(vn), **params)  # fmt: skip
        assert torch.equal(o, po.permute(0, 2, 1, 3).reshape(o.shape)), spec.name
        assert torch.equal(lse, pl.permute(1, 0, 2).reshape(lse.shape)), spec.name
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.parametrize("append", [False, True])
def test_opcheck_ragged_and_padded_schemas(append):
    """torch.library.opcheck (schema, autograd registration, fake tensor, AOT dispatch with
    dynamic shapes) of the ragged op and the padded op, with and without the append (the
    appending ops declare that they mutate k_cache / v_cache)."""
    from flashgen.ops.decode.op import decode_op

    op = _op("mistral_swa")
    dop = decode_op(op)
    op, q, kc, vc, lens_t, table, kn, vn, cu = _case(
        "mistral_swa", (1, 3), (2, 4), hq=4, hkv=2, ps=4, dense=False, append=True
    )
    new = [kn, vn] if append else []
    torch.library.opcheck(dop.torch_op(append, True),
                          (q, kc, vc, lens_t, table, cu, *new, 3, 0.1, 0, 4096))  # fmt: skip
    q4 = q[:2].view(2, 4, 1, 128)
    new = [kn[:2].view(2, 2, 1, 128), vn[:2].view(2, 2, 1, 128)] if append else []
    torch.library.opcheck(dop.torch_op(append), (q4, kc, vc, lens_t, table, *new, 0.1, 0, 4096))


def test_torch_compile_fullgraph_padded_and_ragged():
    """op.with_kvcache traces with torch.compile(fullgraph=True) on CPU, padded and ragged,
    with the append (the cache mutation is replayed on the caller's cache); the ragged call
    needs max_seqlen_q (or a plan) there: reading it from cu_seqlens_q would break the
    graph, refused with the OpInputError's message."""
    op, q, kc, vc, lens_t, table, kn, vn, cu = _case(
        "llama3_gqa", (1, 4, 0), (3, 7, 2), hq=8, hkv=2, ps=4, dense=False, append=True
    )
    kw = dict(block_table=table, k_new=kn, v_new=vn)
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()

    def ragged(q, kc, vc, lens, cu):
        return op.with_kvcache(q, kc, vc, lens, cu_seqlens_q=cu, max_seqlen_q=4, **kw)

    got = torch.compile(ragged, fullgraph=True, backend="aot_eager")(q, k1, v1, lens_t, cu)
    want = op.with_kvcache(q, k2, v2, lens_t, cu_seqlens_q=cu, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(k1, k2) and torch.equal(v1, v2) and not torch.equal(k1, kc)

    q4 = torch.randn(3, 8, 2, 128).to(torch.bfloat16)
    kn4 = torch.randn(3, 2, 2, 128).to(torch.bfloat16)
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()

    def padded(q, kc, vc, lens):
        return op.with_kvcache(q, kc, vc, lens, block_table=table, k_new=kn4, v_new=kn4)

    got = torch.compile(padded, fullgraph=True, backend="aot_eager")(q4, k1, v1, lens_t)
    want = padded(q4, k2, v2, lens_t)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(k1, k2) and torch.equal(v1, v2)

    p = op.plan_decode(batch=3, num_heads=8, num_heads_kv=2, seqlen_q=4, total_q=8,
                       cache_capacity=16, page_size=4, num_pages=kc.shape[0], append=True,
                       device="cpu")  # fmt: skip
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()

    def planned(q, kc, vc, lens, cu):  # max_seqlen_q: the plan's
        return op.with_kvcache(q, kc, vc, lens, cu_seqlens_q=cu, plan=p, **kw)

    got = torch.compile(planned, fullgraph=True, backend="aot_eager")(q, k1, v1, lens_t, cu)
    want = op.with_kvcache(q, k2, v2, lens_t, cu_seqlens_q=cu, num_splits=p.num_splits, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(k1, k2)

    def no_max(q, kc, vc, lens, cu):
        return op.with_kvcache(q, kc, vc, lens, block_table=table, cu_seqlens_q=cu)

    with pytest.raises(Exception, match="max_seqlen_q: required with cu_seqlens_q"):
        torch.compile(no_max, fullgraph=True, backend="aot_eager")(q, kc, vc, lens_t, cu)


@pytest.mark.parametrize("form", ["padded", "ragged", "padded_append", "ragged_append",
                                  "ragged_kv8"])  # fmt: skip
def test_torch_compile_of_cuda_calls_reads_no_address(form):
    """The H200 failure of tests/gpu/test_decode_gpu.py::test_ragged_torch_compile_fullgraph
    ("Failed to trace builtin operator mod ... DataPtrVariable": the cache alignment check's
    ``data_ptr() % 16`` under Dynamo) reproduced on CPU with fake CUDA tensors:
    torch.compile(fullgraph=True) traces with_kvcache's CUDA path, padded and ragged, with
    and without the append, and an e4m3 cache, reading no address (the registered op's CUDA
    kernel checks alignment when the compiled call runs); the fake kernel (run on the fake
    inputs) reads none either.  Backend eager: AOT's replay of the appends' cache mutation
    on a fake CUDA tensor would need a CUDA build of torch."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashgen.ops.decode.inputs import _addresses_readable

    op, q, kc, vc, lens_t, table, kn, vn, cu = _case(
        "llama3_gqa", (1, 4, 0), (3, 7, 2), hq=8, hkv=2, ps=4, dense=False, append=True
    )
    mode = FakeTensorMode()

    def fake(t, dtype=None):
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=dtype or t.dtype, device="cuda")

    kv8 = form.endswith("kv8")
    cdt = torch.float8_e4m3fn if kv8 else None
    q, lens_t, table, cu = fake(q), fake(lens_t), fake(table), fake(cu)
    kc, vc, kn, vn = fake(kc, cdt), fake(vc, cdt), fake(kn, cdt), fake(vn, cdt)
    kw = {"block_table": table, "num_splits": 2}
    if form.startswith("ragged"):
        kw.update(cu_seqlens_q=cu, max_seqlen_q=4)
    else:
        q = fake(torch.empty(3, 8, 2, 128), q.dtype)
        kn, vn = (fake(torch.empty(3, 2, 2, 128), t.dtype) for t in (kn, vn))
    if kv8:
        kw.update(k_descale=fake(torch.empty(3, 2)), v_descale=fake(torch.empty(1)))

    def call(q, kc, vc, lens, kn, vn):
        new = {"k_new": kn, "v_new": vn} if "append" in form else {}
        return op.with_kvcache(q, kc, vc, lens, **kw, **new)

    with warnings.catch_warnings():  # FakeTensor.data_ptr() warns (and returns 0)
        warnings.filterwarnings("error", message=".*data pointer of FakeTensor")
        o, lse = torch.compile(call, fullgraph=True, backend="eager")(q, kc, vc, lens_t, kn, vn)
    assert o.device.type == "cuda" and o.shape[:-1] == q.shape[:-1]
    # eager calls (and the CUDA kernel of the compiled call) on real tensors keep the check
    assert _addresses_readable(torch.empty(1)) and not _addresses_readable(kc)


def _plan(op, *, total_q, batch=3, seqlen_q=4, append=True, splits=2, **kw):
    base = dict(batch=batch, num_heads=8, num_heads_kv=2, seqlen_q=seqlen_q,
                cache_capacity=16, page_size=4, num_pages=14, append=append, device="cpu",
                num_splits=splits)  # fmt: skip
    base.update(kw)
    return op.plan_decode(total_q=total_q, **base)


def test_ragged_plan_runs_and_refuses_other_calls():
    """plan_decode(total_q=...) plans ragged calls: a call with at most total_q rows and
    max_seqlen_q (None: the plan's) runs as the unplanned call with the plan's num_splits;
    a plan made for other calls raises OpInputError naming what differs."""
    op, q, kc, vc, lens_t, table, kn, vn, cu = _case(
        "llama3_gqa", (1, 4, 0), (3, 7, 2), hq=8, hkv=2, ps=4, dense=False, append=True
    )
    assert table.shape == (3, 4) and kc.shape[0] == 14
    p = _plan(op, total_q=8)
    assert p.dims.ragged and p.dims.total_q == 8 and p.num_splits == 2
    kw = dict(block_table=table, k_new=kn, v_new=vn, cu_seqlens_q=cu)
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    a = op.with_kvcache(q, k1, v1, lens_t, plan=p, **kw)
    b = op.with_kvcache(q, k2, v2, lens_t, num_splits=2, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(k1, k2)
    a = op.with_kvcache(q, kc.clone(), vc.clone(), lens_t, plan=p, max_seqlen_q=4, **kw)
    assert torch.equal(a[0], b[0])

    def refused(plan, msg, **over):
        args = dict(kw, plan=plan)
        args.update(over)
        qq = args.pop("q", q)
        with pytest.raises(OpInputError, match=msg):
            op.with_kvcache(qq, kc.clone(), vc.clone(), args.pop("lens", lens_t), **args)

    refused(_plan(op, total_q=4), r"plan: planned for total_q at most 4 \(this call's q rows: 5\)")
    refused(_plan(op, total_q=8, seqlen_q=2), r"max_seqlen_q at most 2 \(this call: 4\)",
            max_seqlen_q=4)  # fmt: skip
    refused(_plan(op, total_q=8, append=False), r"append False \(this call: True\)")
    refused(_plan(op, total_q=8, batch=2), r"batch 2 \(this call: 3\)")
    refused(_plan(op, total_q=8, num_heads=16, num_heads_kv=4),
            r"num_heads 16 \(this call: 8\); num_heads_kv 4 \(this call: 2\)")  # fmt: skip
    refused(_plan(op, total_q=8, page_size=2, cache_capacity=8), "page_size 2")
    padded_plan = op.plan_decode(batch=3, num_heads=8, num_heads_kv=2, seqlen_q=4,
                                 cache_capacity=16, page_size=4, num_pages=14, append=True,
                                 device="cpu")  # fmt: skip
    refused(padded_plan, r"plan: planned for padded calls .* this call is one of ragged")
    refused(p, "num_splits: the plan fixes 2", num_splits=3)
    with pytest.raises(OpInputError, match="plan: planned for ragged calls .* padded"):
        q4 = torch.randn(3, 8, 4, 128).to(torch.bfloat16)
        kn4 = torch.randn(3, 2, 4, 128).to(torch.bfloat16)
        op.with_kvcache(q4, kc, vc, lens_t, block_table=table, k_new=kn4, v_new=kn4, plan=p)
    with pytest.raises(OpInputError, match="total_q: expected a non-negative int"):
        _plan(op, total_q=-1)
    with pytest.raises(OpInputError, match=r"seqlen_q: expected >= 1 \(the ragged calls'"):
        _plan(op, total_q=4, seqlen_q=0)


def test_ragged_out_buffers_and_contiguous_offsets():
    """out= of a ragged call: o [total_q, Hq, Dv], lse [Hq, total_q] written and returned;
    checked as the inputs are (shape, dtype, device, contiguity).  cu_seqlens_q and
    cache_seqlens must be contiguous (the kernels index them)."""
    op, q, kc, vc, lens_t, table, _, _, cu = _case(
        "alibi", (2, 0, 3), (4, 1, 6), hq=8, hkv=2, ps=4, dense=False, append=False
    )
    prm = _params("alibi", 8)
    kw = dict(block_table=table, cu_seqlens_q=cu, **prm)
    o, lse = op.with_kvcache(q, kc, vc, lens_t, **kw)
    out = (torch.full_like(o, math.nan), torch.full_like(lse, math.nan))
    got = op.with_kvcache(q, kc, vc, lens_t, out=out, **kw)
    assert got is out and torch.equal(out[0], o) and torch.equal(out[1], lse)
    p = _plan(op, total_q=5, append=False, splits=1)
    got = op.with_kvcache(q, kc, vc, lens_t, out=out, plan=p, **kw)
    assert got is out and torch.equal(out[0], o)
    bad = [
        ((out[0], out[1].t().contiguous()), r"out\[1\]: expected shape \[8, 5\]"),
        ((out[0][:4], out[1]), r"out\[0\]: expected shape \[5, 8, 128\]"),
        ((out[0].float(), out[1]), r"out\[0\]: expected shape \[5, 8, 128\] and dtype"),
        ((out[0].transpose(0, 1).contiguous().transpose(0, 1), out[1]), "out[0]: expected a "
         "contiguous"),
        (out[0], "out: expected a pair"),
    ]  # fmt: skip
    for o_bad, msg in bad:
        with pytest.raises(OpInputError) as e:
            op.with_kvcache(q, kc, vc, lens_t, out=o_bad, **kw)
        assert msg.replace("\\", "") in str(e.value) or pytest.fail(f"{msg}: {e.value}")
    with pytest.raises(OpInputError, match="cu_seqlens_q: expected a contiguous tensor"):
        cu2 = torch.stack([cu, cu], 1)[:, 0]
        op.with_kvcache(q, kc, vc, lens_t, **dict(kw, cu_seqlens_q=cu2))
    with pytest.raises(OpInputError, match="cache_seqlens: expected a contiguous tensor"):
        op.with_kvcache(q, kc, vc, torch.stack([lens_t, lens_t], 1)[:, 0], **kw)


def test_ragged_planned_fast_path_packs_the_general_paths_arguments(monkeypatch):
    """A ragged plan's fast path (CPU tensors for CUDA ones, the driver faked): its blocks
    hold what the general path passes, cu_seqlens_q included, for the append and attention
    kernels of the ragged unit; o / lse follow the call's q rows (fewer than the plan's
    total_q re-validates and packs again); a padded call with that plan is refused."""
    import ctypes
    import types

    from flashgen.families import decode as family
    from flashgen.ops import calls as calls_mod
    from flashgen.ops.decode import fast as dfast
    from flashgen.ops.decode import op as dmod
    from flashgen.runtime import launch as runtime
    from flashgen.runtime import tma

    launches = []

    class Driver:
        @staticmethod
        def cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            launches.append((fn, (gx, gy, gz), params))
            return 0

    monkeypatch.setattr(tma, "driver", lambda: Driver)
    monkeypatch.setattr(dfast, "_eager_cuda", lambda q, k, v: True)
    monkeypatch.setattr(dfast, "_GET_DEVICE", lambda: None)
    monkeypatch.setattr(calls_mod, "_RAW_STREAM", lambda index: 7)
    op, q, kc, vc, lens_t, table, kn, vn, cu = _case(
        "mistral_swa", (1, 4, 0), (3, 7, 2), hq=8, hkv=2, ps=4, dense=False, append=True
    )
    dop = dmod.decode_op(op)
    unit = family.plan(op.spec, "sm_90", ragged=True)
    kern = {r: runtime.LoadedKernel(plan=unit.kernel(r), module=None,
                                    function=types.SimpleNamespace(ptr=11 + i), device_index=0)
            for i, r in enumerate(("attn", "append"))}  # fmt: skip
    cpu = torch.device("cpu")
    dims = dmod.DecodeDims(3, 8, 2, 4, 128, True, kc.shape[0], 4, 4, True, total_q=8)
    plan = dop.plan_for(dims, cpu, 3)
    plan.kernels = kern
    plan.o_part, plan.lse_part, plan.counters = dfast._workspace(dims, plan.geometry, 3, cpu)
    plan.fast = dfast._FastPath(dop, plan)
    fast = plan.fast

    def unpack(layout, params):
        base = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))[0]
        raw = ctypes.string_at(base, layout.size)
        return dict(zip(layout.names, layout.struct.unpack_from(raw, 0), strict=True))

    def as_c(layout, name, v):
        code = layout.codes[layout.index[name]]
        if code == "Q":
            return v if isinstance(v, int) else v.data_ptr()
        return float(torch.tensor(v, dtype=torch.float32)) if code == "f" else int(v)

    for rows in (5, 3):  # the second call: fewer rows, a new layout
        launches.clear()
        qq, kk, vv = q[:rows].clone(), kn[:rows].clone(), vn[:rows].clone()
        cc = cu.clamp(max=rows).contiguous()
        o, lse = op.with_kvcache(qq, kc, vc, lens_t, block_table=table, k_new=kk, v_new=vv,
                                 cu_seqlens_q=cc, plan=plan, window=9)  # fmt: skip
        assert o.shape == (rows, 8, 128) and lse.shape == (8, rows)
        assert [x[0] for x in launches] == [12, 11]
        assert launches[1][1] == plan.geometry.grid
        assert launches[0][1] == plan.geometry.append_grid == (3 * 2 * 4, 1, 1)
        values = dop.launch_values(plan, qq, kc, vc, lens_t, table, o, lse,
                                   1 / math.sqrt(128), [9], {})  # fmt: skip
        values["cu_seqlens_q"] = cc
        assert values["max_seqlen_q"] == 4 and values["q_ss"] == qq.stride(0)
        got = unpack(fast.attn_layout, launches[1][2])
        assert got == {n: as_c(fast.attn_layout, n, values[n]) for n in fast.attn_layout.names}
        av = dop.append_values(values, kk, vv)
        got = unpack(fast.app_layout, launches[0][2])
        assert got == {n: as_c(fast.app_layout, n, av[n]) for n in fast.app_layout.names}
        assert got["cu_seqlens_q"] == cc.data_ptr()
    q4 = torch.randn(3, 8, 1, 128).to(torch.bfloat16)
    with pytest.raises(OpInputError, match="plan: planned for ragged calls"):
        op.with_kvcache(q4, kc, vc, lens_t, block_table=table, k_new=kn[:3].view(3, 2, 1, 128),
                        v_new=vn[:3].view(3, 2, 1, 128), plan=plan, window=9)  # fmt: skip
