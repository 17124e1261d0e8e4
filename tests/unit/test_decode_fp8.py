"""The FP8 (e4m3) KV cache of op.with_kvcache on CPU (flashgen.ops.decode.fp8, the decode
family's kv8 units): the op against the float64 reference on the dequantized inputs (dense and
paged caches, GQA, Sq_new 1 / 4, window / softcap / ALiBi specs, appends, an e4m3 q, ragged
Sq_new), bad inputs (OpInputError naming the argument), the torch ops' schemas, the kv8 units'
arguments and launch values, the planned fast path's packing, the index maps and the e4m3
conversion of templates/common/decode_fp8.cuh run on the host against torch and a numpy model
of the mma.sync m16n8k16 / ldmatrix fragments, and the kv8 units compiled for sm_80 and
sm_90a without spills (10 nvcc runs)."""

from __future__ import annotations

import math
import os
import random
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

import flashgen
from flashgen.build import cache
from flashgen.build.render import render
from flashgen.families import decode as family
from flashgen.frontend.errors import OpInputError
from flashgen.frontend.spec import load_spec
from flashgen.ops.decode.op import decode_op, decode_reference

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "templates" / "common" / "decode_fp8.cuh"
E4M3 = torch.float8_e4m3fn


def _op(name):
    return flashgen.load(ROOT / "specs" / f"{name}.yaml")


def _params(name, hq):
    if name == "alibi":
        return {"slopes": torch.tensor([2.0 ** (-8 * (i + 1) / hq) for i in range(hq)])}
    if name == "mistral_swa":
        return {"window": 5}
    return {}


def fp8_cache(lens, *, page_size, hkv, d, dv, extra_pages=3, seed=0, dense=False, fill=0.0):
    """An e4m3 cache holding random keys at the live slots (pages in a shuffled order),
    ``fill`` (rounded to e4m3) elsewhere, and random per (request, kv head) descales:
    ``(k_cache, v_cache, block_table or None, k_descale, v_descale)``."""
    g = torch.Generator().manual_seed(seed)
    batch, cap = len(lens), max(max(lens), 1)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 40).to(E4M3)

    kd = torch.rand(batch, hkv, generator=g) * 0.05 + 0.01
    vd = torch.rand(batch, hkv, generator=g) * 0.05 + 0.01
    if dense:
        kc = torch.full((batch, hkv, cap, d), fill).to(E4M3)
        vc = torch.full((batch, hkv, cap, dv), fill).to(E4M3)
        for b, n in enumerate(lens):
            kc[b, :, :n], vc[b, :, :n] = rnd(hkv, n, d), rnd(hkv, n, dv)
        return kc, vc, None, kd, vd
    max_pages = -(-cap // page_size)
    num_pages = batch * max_pages + extra_pages
    perm = torch.randperm(num_pages, generator=g)
    table = perm[: batch * max_pages].view(batch, max_pages).to(torch.int32).contiguous()
    kc = torch.full((num_pages, page_size, hkv, d), fill).to(E4M3)
    vc = torch.full((num_pages, page_size, hkv, dv), fill).to(E4M3)
    for b, n in enumerate(lens):
        for pos in range(n):
            pg, slot = int(table[b, pos // page_size]), pos % page_size
            kc[pg, slot], vc[pg, slot] = rnd(hkv, d), rnd(hkv, dv)
    return kc, vc, table, kd, vd


def dequantized(kc, vc, kd, vd, table):
    """The cache in float64 with each request's descales applied: ``(k, v, table)`` as a
    dense ``[B, Hkv, cap, D]`` cache (paged: gathered through the table)."""
    if table is None:
        return (kc.double() * kd.double()[:, :, None, None],
                vc.double() * vd.double()[:, :, None, None], None)  # fmt: skip
    ps = kc.shape[1]
    ks, vs = [], []
    for b in range(table.shape[0]):
        pages = table[b].long()
        k = kc[pages].reshape(-1, *kc.shape[2:]).double().transpose(0, 1)  # [Hkv, cap, D]
        v = vc[pages].reshape(-1, *vc.shape[2:]).double().transpose(0, 1)
        ks.append(k * kd[b].double()[:, None, None])
        vs.append(v * vd[b].double()[:, None, None])
    del ps
    return torch.stack(ks), torch.stack(vs), None


def check_cpu(spec, q, o, lse, k64, v64, live, params, q64=None):
    """The CPU op's o / lse against the float64 reference on the dequantized cache (and
    ``q64``, the dequantized q, where q is e4m3: ``q`` is then its bf16 rounding): o within
    2x the bf16 / fp16 reference's error + 1e-3 (tests/gpu's rule), lse within 1e-4."""
    lens = torch.tensor(live)
    scale = None
    r64o, r64l = decode_reference(spec, q if q64 is None else q64, k64, v64, lens,
                                  softmax_scale=scale, params=params)  # fmt: skip
    rlo, _ = decode_reference(spec, q, k64, v64, lens, softmax_scale=scale, params=params,
                              compute_dtype=q.dtype)  # fmt: skip
    bound = 2 * (rlo.double() - r64o).abs().max().item() + 1e-3
    err = (o.double() - r64o).abs().max().item()
    assert err <= bound, f"o error {err:.3g} > bound {bound:.3g}"
    fin = torch.isfinite(r64l)
    assert torch.equal(torch.isfinite(lse), fin)
    if fin.any():
        err = (lse.double() - r64l)[fin].abs().max().item()
        assert err <= 1e-4 * max(1.0, r64l[fin].abs().max().item())


CASES = [
    ("llama3_gqa", 16, 1, (8, 2)),
    ("llama3_gqa", 1, 4, (8, 2)),
    ("llama3_gqa", 0, 1, (4, 4)),
    ("mistral_swa", 3, 4, (8, 1)),
    ("gemma2_softcap", 16, 1, (4, 2)),
    ("alibi", 0, 4, (8, 2)),
]


@pytest.mark.parametrize("name,ps,sq,heads", CASES, ids=str)
def test_cpu_op_against_float64_on_the_dequantized_cache(name, ps, sq, heads):
    op = _op(name)
    spec = op.spec
    hq, hkv = heads
    lens = [0, 1, 17, 40]
    dense = ps == 0
    kc, vc, table, kd, vd = fp8_cache(lens, page_size=max(ps, 1), hkv=hkv, d=spec.head_dim,
                                      dv=spec.head_dim_v, dense=dense, fill=448.0)  # fmt: skip
    q = torch.randn(len(lens), hq, sq, spec.head_dim).to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    params = _params(name, hq)
    o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, k_descale=kd, v_descale=vd,
                             **params)  # fmt: skip
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    k64, v64, _ = dequantized(kc, vc, kd, vd, table)
    check_cpu(spec, q, o, lse, k64, v64, lens, params)


def test_scalar_and_one_element_descales_broadcast():
    op = _op("llama3_gqa")
    lens = [9, 30]
    kc, vc, table, kd, vd = fp8_cache(lens, page_size=16, hkv=2, d=128, dv=128)
    q = torch.randn(2, 8, 1, 128).to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    a = op.with_kvcache(q, kc, vc, lens_t, block_table=table, k_descale=0.03, v_descale=0.02)
    full = dict(k_descale=torch.full((2, 2), 0.03), v_descale=torch.full((2, 2), 0.02))
    b = op.with_kvcache(q, kc, vc, lens_t, block_table=table, **full)
    one = dict(k_descale=torch.tensor(0.03), v_descale=torch.tensor([0.02]))
    c = op.with_kvcache(q, kc, vc, lens_t, block_table=table, **one)
    strided = dict(k_descale=torch.full((2, 4), 0.03)[:, ::2], v_descale=full["v_descale"].t())
    d = op.with_kvcache(q, kc, vc, lens_t, block_table=table, **strided)
    for x in (b, c, d):
        assert torch.equal(a[0], x[0]) and torch.equal(a[1], x[1])
    # default 1.0
    e = op.with_kvcache(q, kc, vc, lens_t, block_table=table)
    f = op.with_kvcache(q, kc, vc, lens_t, block_table=table, k_descale=1.0, v_descale=1)
    assert torch.equal(e[0], f[0]) and torch.equal(e[1], f[1])


def test_e4m3_q_with_q_descale():
    op = _op("mistral_swa")
    lens = [20, 3]
    kc, vc, table, kd, vd = fp8_cache(lens, page_size=4, hkv=2, d=128, dv=128)
    q8 = (torch.randn(2, 8, 4, 128) * 30).to(E4M3)
    qd = torch.rand(2, 2) * 0.05 + 0.01
    lens_t = torch.tensor(lens, dtype=torch.int32)
    o, lse = op.with_kvcache(q8, kc, vc, lens_t, block_table=table, k_descale=kd, v_descale=vd,
                             q_descale=qd, window=6)  # fmt: skip
    qdeq = q8.double() * qd.double().repeat_interleave(4, 1)[:, :, None, None]
    k64, v64, _ = dequantized(kc, vc, kd, vd, table)
    check_cpu(op.spec, qdeq.bfloat16(), o, lse, k64, v64, lens, {"window": 6}, q64=qdeq)
    # a Python q_descale and tensor k_descale fold the same way
    o2, _ = op.with_kvcache(q8, kc, vc, lens_t, block_table=table, k_descale=kd * 0.02,
                            v_descale=vd, q_descale=1.0, window=6)  # fmt: skip
    o3, _ = op.with_kvcache(q8, kc, vc, lens_t, block_table=table, k_descale=kd,
                            v_descale=vd, q_descale=0.02, window=6)  # fmt: skip
    assert (o2.float() - o3.float()).abs().max() <= 1e-2


@pytest.mark.parametrize("dense", [False, True])
def test_append_writes_e4m3_rows_in_place(dense):
    op = _op("alibi")
    lens = [0, 15, 16]
    kc, vc, table, kd, vd = fp8_cache([40] * 3, page_size=16, hkv=2, d=128, dv=128,
                                      dense=dense)  # fmt: skip
    kc0 = kc.clone()
    kn = (torch.randn(3, 2, 4, 128) * 40).to(E4M3)
    vn = (torch.randn(3, 2, 4, 128) * 40).to(E4M3)
    q = torch.randn(3, 8, 4, 128).to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    prm = _params("alibi", 8)
    o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, k_new=kn, v_new=vn,
                             k_descale=kd, v_descale=vd, **prm)  # fmt: skip
    for b, n in enumerate(lens):
        for s in range(4):
            pos = n + s
            if dense:
                got_k, got_v = kc[b, :, pos], vc[b, :, pos]
            else:
                pg = int(table[b, pos // 16])
                got_k, got_v = kc[pg, pos % 16], vc[pg, pos % 16]
            assert torch.equal(got_k.view(torch.uint8), kn[b, :, s].view(torch.uint8))
            assert torch.equal(got_v.view(torch.uint8), vn[b, :, s].view(torch.uint8))
    changed = (kc.view(torch.uint8) != kc0.view(torch.uint8)).sum().item()
    assert changed <= 3 * 4 * 2 * 128
    k64, v64, _ = dequantized(kc, vc, kd, vd, table)
    check_cpu(op.spec, q, o, lse, k64, v64, [n + 4 for n in lens], prm)


def test_ragged_sq_new_with_an_e4m3_cache():
    op = _op("llama3_gqa")
    lens, sqs = [5, 0, 30], [1, 3, 2]
    kc, vc, table, kd, vd = fp8_cache([n + s for n, s in zip(lens, sqs, strict=True)],
                                      page_size=8, hkv=2, d=128, dv=128)  # fmt: skip
    cu = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    q = torch.randn(6, 8, 128).to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, cu_seqlens_q=cu,
                             k_descale=kd, v_descale=vd)  # fmt: skip
    k64, v64, _ = dequantized(kc, vc, kd, vd, table)
    for b in range(3):
        q0, q1 = int(cu[b]), int(cu[b + 1])
        qb = q[q0:q1].permute(1, 0, 2)[None]
        check_cpu(op.spec, qb, o[q0:q1].permute(1, 0, 2)[None], lse[:, q0:q1][None],
                  k64[b : b + 1], v64[b : b + 1], [lens[b]], {})  # fmt: skip


def test_ragged_kv8_ops_append_and_match_the_padded_calls():
    """The ragged e4m3 form through its registered ops (``__with_kvcache_ragged_kv8[_append]``):
    a ragged append with descales equals each request's padded call on the same cache (o, lse
    and the written rows), an e4m3 q with ``q_descale`` is accepted, and the ops' schemas and
    fake kernels pass opcheck."""
    op = _op("mistral_swa")
    dop = decode_op(op)
    lens, sqs = [5, 0, 9], [2, 3, 1]
    kc, vc, table, kd, vd = fp8_cache([n + s for n, s in zip(lens, sqs, strict=True)],
                                      page_size=4, hkv=2, d=128, dv=128)  # fmt: skip
    cu = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    q = torch.randn(6, 4, 128).to(torch.bfloat16)
    kn = (torch.randn(6, 2, 128) * 10).to(E4M3)
    vn = (torch.randn(6, 2, 128) * 10).to(E4M3)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    kc2, vc2 = kc.clone(), vc.clone()
    o, lse = op.with_kvcache(q, kc, vc, lens_t, block_table=table, k_new=kn, v_new=vn,
                             cu_seqlens_q=cu, k_descale=kd, v_descale=vd, window=5)  # fmt: skip
    for b in range(3):
        q0, q1 = int(cu[b]), int(cu[b + 1])
        ob, lb = op.with_kvcache(
            q[q0:q1].permute(1, 0, 2)[None], kc2, vc2, lens_t[b : b + 1],
            block_table=table[b : b + 1], k_new=kn[q0:q1].permute(1, 0, 2)[None],
            v_new=vn[q0:q1].permute(1, 0, 2)[None], k_descale=kd[b : b + 1],
            v_descale=vd[b : b + 1], window=5,
        )  # fmt: skip
        assert torch.equal(o[q0:q1], ob[0].permute(1, 0, 2))
        assert torch.equal(lse[:, q0:q1], lb[0])
    assert torch.equal(kc.view(torch.uint8), kc2.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc2.view(torch.uint8))
    o8, _ = op.with_kvcache(q.to(E4M3), kc, vc, lens_t, block_table=table, cu_seqlens_q=cu,
                            max_seqlen_q=3, k_descale=kd, v_descale=vd, q_descale=0.5)  # fmt: skip
    assert o8.shape == (6, 4, 128) and o8.dtype == torch.bfloat16
    assert "Tensor k_descale, Tensor v_descale" in dop.schema(True, True, True)
    torch.library.opcheck(
        dop.torch_op(False, True, True), (q, kc, vc, lens_t, table, cu, 3, kd, vd, 0.1, 0, 5),
        test_utils=("test_faketensor",),
    )  # fmt: skip
    torch.library.opcheck(
        dop.torch_op(True, True, True),
        (q, kc, vc, lens_t, table, cu, kn, vn, 3, kd, vd, 0.1, 0, 5),
        test_utils=("test_faketensor",),
    )  # fmt: skip
    assert dop.op_name(True, True, True).endswith("__with_kvcache_ragged_kv8_append")


def test_opcheck_the_kv8_schemas():
    """The fake kernels (opcheck's test_faketensor) and the schemas: the append op declares
    that it mutates the caches (opcheck's test_schema compares inputs with a mul, which torch
    does not implement for float8_e4m3fn)."""
    op = _op("mistral_swa")
    dop = decode_op(op)
    assert dop.kv8
    kc, vc, table, kd, vd = fp8_cache([8, 8], page_size=4, hkv=2, d=128, dv=128)
    q = torch.randn(2, 4, 1, 128).to(torch.bfloat16)
    lens_t = torch.tensor([2, 5], dtype=torch.int32)
    torch.library.opcheck(
        dop.torch_op(False, kv8=True), (q, kc, vc, lens_t, table, kd, vd, 0.1, 0, 4096),
        test_utils=("test_faketensor",),
    )  # fmt: skip
    kn = (torch.randn(2, 2, 1, 128) * 10).to(E4M3)
    torch.library.opcheck(
        dop.torch_op(True, kv8=True),
        (q, kc, vc, lens_t, table, kn, kn.clone(), kd, vd, 0.1, 0, 4096),
        test_utils=("test_faketensor",),
    )  # fmt: skip
    assert "Tensor(a!) k_cache, Tensor(b!) v_cache" in dop.schema(True, kv8=True)
    assert "Tensor k_cache, Tensor v_cache" in dop.schema(False, kv8=True)
    assert "Tensor k_descale, Tensor v_descale" in dop.schema(True, kv8=True)
    assert "k_descale" not in dop.schema(False) and "k_descale" not in dop.schema(True)
    with pytest.raises(OpInputError, match="k_cache: this torch op"):
        dop.torch_op(False, kv8=True)(q, kc.bfloat16(), vc.bfloat16(), lens_t, table, kd, vd,
                                      0.1, 0, 4096)  # fmt: skip


# ----------------------------------------------------------------------------- bad inputs
def _base():
    op = _op("mistral_swa")
    kc, vc, table, kd, vd = fp8_cache([6, 6], page_size=4, hkv=2, d=128, dv=128)
    q = torch.randn(2, 4, 1, 128).to(torch.bfloat16)
    return op, q, kc, vc, table, torch.tensor([3, 6], dtype=torch.int32), kd, vd


BAD = [
    # (what the call changes, the message it must raise)
    (dict(k_descale=torch.ones(3, 2)),
     r"k_descale: expected shape \[batch, heads_kv\] = \[2, 2\] .or one element., got \[3, 2\]"),
    (dict(v_descale=torch.ones(2, 2, dtype=torch.float64)),
     "v_descale: expected dtype torch.float32, got torch.float64"),
    (dict(k_descale=torch.ones(2, 2, device="meta")),
     "k_descale: expected device cpu .q's device., got meta"),
    (dict(k_descale=torch.tensor([[1.0, 0.0], [1.0, 1.0]])),
     r"k_descale: expected finite descales > 0, got 0.0 at \[0, 1\]"),
    (dict(v_descale=torch.tensor([[1.0, 1.0], [float("inf"), 1.0]])),
     r"v_descale: expected finite descales > 0, got inf at \[1, 0\]"),
    (dict(v_descale=-2.0), "v_descale: expected a finite descale > 0, got -2.0"),
    (dict(k_descale=float("nan")), "k_descale: expected a finite descale > 0, got nan"),
    (dict(k_descale="1"), "k_descale: expected a float32 tensor .*got str"),
    (dict(q_descale=0.5),
     "q_descale: only for a torch.float8_e4m3fn q; q has dtype torch.bfloat16, so expected None"),
]  # fmt: skip


@pytest.mark.parametrize("change,msg", BAD, ids=lambda x: str(x)[:40])
def test_bad_descales_raise(change, msg):
    op, q, kc, vc, table, lens, kd, vd = _base()
    kw = dict(k_descale=kd, v_descale=vd, **{"block_table": table})
    kw.update(change)
    with pytest.raises(OpInputError, match=msg):
        op.with_kvcache(q, kc, vc, lens, **kw)


def test_bad_cache_dtypes_raise():
    op, q, kc, vc, table, lens, kd, vd = _base()
    msg = "v_cache: expected dtype torch.float8_e4m3fn .k_cache's dtype., got torch.bfloat16"
    with pytest.raises(OpInputError, match=msg):
        op.with_kvcache(q, kc, vc.to(torch.bfloat16), lens, block_table=table)
    msg = "v_cache: expected dtype torch.bfloat16 .k_cache's dtype., got torch.float8_e4m3fn"
    with pytest.raises(OpInputError, match=msg):
        op.with_kvcache(q, kc.to(torch.bfloat16), vc, lens, block_table=table)
    msg = "k_cache: expected dtype torch.bfloat16 .* or torch.float8_e4m3fn .*got torch.float32"
    with pytest.raises(OpInputError, match=msg):
        op.with_kvcache(q, kc.float(), vc.float(), lens, block_table=table)
    msg = "k_descale: descales go with a torch.float8_e4m3fn cache"
    with pytest.raises(OpInputError, match=msg):
        op.with_kvcache(q, kc.to(torch.bfloat16), vc.to(torch.bfloat16), lens, block_table=table,
                        k_descale=kd)  # fmt: skip
    with pytest.raises(OpInputError, match="q: expected dtype torch.bfloat16 .*got torch.float8"):
        op.with_kvcache(q.to(E4M3), kc.to(torch.bfloat16), vc.to(torch.bfloat16), lens,
                        block_table=table)  # fmt: skip
    kn = torch.randn(2, 2, 1, 128).to(torch.bfloat16)
    with pytest.raises(OpInputError, match="k_new: expected dtype torch.float8_e4m3fn .the cache"):
        op.with_kvcache(q, kc, vc, lens, block_table=table, k_new=kn, v_new=kn)
    with pytest.raises(OpInputError, match="k_cache: expected dtype torch.float16"):
        gpt2 = _op("gpt2_d64")  # fp16 d64: e4m3 caches work; a bf16 cache is refused
        gpt2.with_kvcache(torch.randn(1, 2, 1, 64).half(), torch.zeros(1, 2, 4, 64).bfloat16(),
                          torch.zeros(1, 2, 4, 64).bfloat16(), lens[:1])  # fmt: skip


def test_head_dims_not_multiples_of_64_refuse_an_e4m3_cache(tmp_path):
    text = (ROOT / "specs" / "causal_d128.yaml").read_text()
    path = tmp_path / "causal_d96.yaml"
    path.write_text(text.replace("head_dim: 128", "head_dim: 96").replace("causal_d128",
                                                                           "causal_d96"))
    op = flashgen.load(path)
    why = family.cache_dtype_reason(op.spec, "fp8_e4m3")
    assert why and "multiples of 64" in why
    with pytest.raises(ValueError, match="multiples of 64"):
        family.plan(op.spec, "sm_80", cache_dtype="fp8_e4m3")
    q = torch.randn(1, 2, 1, 96).to(torch.bfloat16)
    kc = torch.zeros(1, 2, 4, 96).to(E4M3)
    msg = "k_cache: expected dtype torch.bfloat16 .*multiples of 64.*got torch.float8_e4m3fn"
    with pytest.raises(OpInputError, match=msg):
        op.with_kvcache(q, kc, kc.clone(), torch.tensor([2], dtype=torch.int32))
    assert not decode_op(op).kv8


def test_plan_decode_takes_the_cache_dtype():
    op, q, kc, vc, table, lens, kd, vd = _base()
    kw = dict(batch=2, num_heads=4, num_heads_kv=2, seqlen_q=1, cache_capacity=table.shape[1] * 4,
              page_size=4, num_pages=kc.shape[0], device="cpu", num_splits=2)  # fmt: skip
    p8 = op.plan_decode(**kw, cache_dtype=E4M3)
    assert p8.dims.cache_dtype == "fp8_e4m3"
    a = op.with_kvcache(q, kc, vc, lens, block_table=table, plan=p8, k_descale=kd, v_descale=vd)
    b = op.with_kvcache(q, kc, vc, lens, block_table=table, k_descale=kd, v_descale=vd)
    assert torch.equal(a[0], b[0])
    p16 = op.plan_decode(**kw)
    with pytest.raises(OpInputError, match="plan: planned for a torch.bfloat16 cache"):
        op.with_kvcache(q, kc, vc, lens, block_table=table, plan=p16, k_descale=kd)
    with pytest.raises(OpInputError, match="plan: planned for a torch.float8_e4m3fn cache"):
        op.with_kvcache(q, kc.bfloat16(), vc.bfloat16(), lens, block_table=table, plan=p8)
    with pytest.raises(OpInputError, match="cache_dtype: expected None, torch.bfloat16 or"):
        op.plan_decode(**kw, cache_dtype=torch.float16)
    assert op.plan_decode(**kw, cache_dtype=torch.bfloat16).dims.cache_dtype is None


def test_a_plan_for_another_cache_dtype_names_the_calls_k_cache_dtype():
    """An e4m3 plan used by a float32 CPU call said "this call's cache is torch.bfloat16"
    (the spec's dtype, not the call's): the message names the plan's cache dtype and the
    dtype of the call's k_cache."""
    op, q, kc, vc, table, lens, kd, vd = _base()
    kw = dict(batch=2, num_heads=4, num_heads_kv=2, seqlen_q=1, cache_capacity=table.shape[1] * 4,
              page_size=4, num_pages=kc.shape[0], device="cpu")  # fmt: skip
    p8 = op.plan_decode(**kw, cache_dtype=E4M3)
    kf, vf = kc.float(), vc.float()
    msg = (r"^plan: planned for a torch.float8_e4m3fn cache \(plan_decode's cache_dtype\), "
           r"this call's k_cache has dtype torch.float32")  # fmt: skip
    with pytest.raises(OpInputError, match=msg):
        op.with_kvcache(q.float(), kf, vf, lens, block_table=table, plan=p8)
    p16 = op.plan_decode(**kw)
    msg = (r"^plan: planned for a torch.bfloat16 cache \(plan_decode's cache_dtype\), this "
           r"call's k_cache has dtype torch.float8_e4m3fn; .*cache_dtype=torch.float8_e4m3fn")
    with pytest.raises(OpInputError, match=msg):
        op.with_kvcache(q, kc, vc, lens, block_table=table, plan=p16, k_descale=kd, v_descale=vd)


# ----------------------------------------------------------------------------- the units
def _kv8_specs():
    out = []
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        spec = load_spec(path)
        if family.unsupported_reason(spec) is None:
            out.append(spec)
    return out


def test_kv8_units_differ_only_when_asked():
    """cache_dtype None or the spec's own renders the unit unchanged; fp8_e4m3 a unit with
    its own kernel names, e4m3 cache pointers, the descale arguments, twice the keys per
    block and half the ring bytes per key."""
    for spec in _kv8_specs():
        assert family.cache_dtype_reason(spec, "fp8_e4m3") is None
        base = family.plan(spec, "sm_80")
        assert render(base) == render(family.plan(spec, "sm_80", cache_dtype=spec.dtype))
        kv8 = family.plan(spec, "sm_80", cache_dtype="fp8_e4m3")
        src = render(kv8)
        assert "FG_DECODE_FP8_CUH" not in render(base) and "fg::kv8::E4m3" in src
        assert base.kernel_name == f"flashgen_{spec.name}_decode_sm_80_attn"
        assert kv8.kernel_name == f"flashgen_{spec.name}_decode_kv8_sm_80_attn"
        assert kv8.kv8 and not base.kv8 and kv8.call_pointers == family.CALL_POINTERS_KV8
        names = [a.name for a in kv8.args]
        assert names[:9] == ["q", "k_cache", "v_cache", "o", "lse", "cache_seqlens",
                             "block_table", "k_descale", "v_descale"]  # fmt: skip
        assert {"k_descale_mul", "v_descale_mul", "kds_sb", "kds_sh", "vds_sb", "vds_sh"} <= set(
            names
        )
        assert dict((a.name, a.ctype) for a in kv8.args)["k_cache"] == "const __nv_fp8_e4m3*"
        assert [a.ctype for a in kv8.kernel("append").args][:4] == [
            "const __nv_fp8_e4m3*", "const __nv_fp8_e4m3*", "__nv_fp8_e4m3*", "__nv_fp8_e4m3*"]
        assert kv8.tiles.block_n == 2 * base.tiles.block_n
        bn, st = kv8.tiles.block_n, kv8.tiles.stages  # the ring: 1 byte per element
        assert kv8.smem_bytes == family.smem_bytes(spec, bn, st, 1) < family.smem_bytes(
            spec, bn, st
        )
        ragged = family.plan(spec, "sm_80", cache_dtype="fp8_e4m3", ragged=True)
        assert "_decode_ragged_kv8_" in ragged.kernel_name
    assert family.plan(_kv8_specs()[0], "sm_80", cache_dtype="fp8_e4m3").config()[
        "cache_dtype"] == "fp8_e4m3"
    with pytest.raises(ValueError, match="not supported"):
        family.plan(_kv8_specs()[0], "sm_80", cache_dtype="fp8_e5m2")


def test_launch_values_cover_the_kv8_kernels_arguments():
    op, q, kc, vc, table, lens, kd, vd = _base()
    dop = decode_op(op)
    from flashgen.ops.decode.fp8 import resolve_scales
    from flashgen.ops.decode.op import validate_decode

    dims = validate_decode(op.spec, q, kc, vc, lens, table)
    _, scales = resolve_scales(op.spec, dims, q, kd[:, :1].expand(2, 2), 0.5, None)
    plan = dop.plan_for(dims, torch.device("cpu"), 3)
    o = torch.empty(2, 4, 1, 128, dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 1)
    values = dop.launch_values(plan, q, kc, vc, lens, table, o, lse, 0.1, [9], {}, scales)
    unit = family.plan(op.spec, "sm_80", cache_dtype="fp8_e4m3")
    assert set(values) >= {a.name for a in unit.args}
    assert values["k_descale"] is scales.k and values["kds_sb"] == kd.stride(0)
    assert values["kds_sh"] == 0 and values["v_descale"] == 0 and values["v_descale_mul"] == 0.5
    assert values["vds_sb"] == 0 and values["k_descale_mul"] == 1.0


def test_planned_fast_path_packs_the_descales(monkeypatch):
    """The kv8 plan's fast path (CPU tensors standing in for CUDA ones, the driver faked)
    packs what the general path passes, the descale tensors' addresses per call (a new
    tensor of the same layout: no re-validation) and a Python descale by value (a new value:
    a new layout)."""
    import ctypes
    import types

    from flashgen.ops import calls as calls_mod
    from flashgen.ops.decode import fast as dfast
    from flashgen.ops.decode.fp8 import KvScales
    from flashgen.ops.decode.op import DecodeDims
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
    dop = decode_op(op)
    unit = family.plan(op.spec, "sm_90", cache_dtype="fp8_e4m3")
    kern = {r: runtime.LoadedKernel(plan=unit.kernel(r), module=None,
                                    function=types.SimpleNamespace(ptr=11 + i), device_index=0)
            for i, r in enumerate(("attn", "append"))}  # fmt: skip
    cpu = torch.device("cpu")
    b, hq, hkv, ps = 2, 8, 2, 16
    kc, vc, table, kd, vd = fp8_cache([60, 100], page_size=ps, hkv=hkv, d=128, dv=128)
    pages = kc.shape[0]
    dims = DecodeDims(b, hq, hkv, 1, 128, True, pages, ps, table.shape[1], True,
                      cache_dtype="fp8_e4m3")  # fmt: skip
    plan = dop.plan_for(dims, cpu, 4)
    plan.kernels = kern
    plan.o_part, plan.lse_part, plan.counters = dfast._workspace(dims, plan.geometry, 4, cpu)
    plan.fast = dfast._FastPath(dop, plan)
    assert plan.fast.kv8
    q = torch.randn(b, hq, 1, 128).to(torch.bfloat16)
    lens = torch.tensor([5, 90], dtype=torch.int32)
    kn = (torch.randn(b, hkv, 1, 128) * 10).to(E4M3)
    vn = kn.clone()
    o, lse = op.with_kvcache(q, kc, vc, lens, block_table=table, k_new=kn, v_new=vn,
                             plan=plan, window=9, k_descale=kd, v_descale=0.25)  # fmt: skip
    assert [x[0] for x in launches] == [12, 11]

    def unpack(layout, params):
        base = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))[0]
        raw = ctypes.string_at(base, layout.size)
        return dict(zip(layout.names, layout.struct.unpack_from(raw, 0), strict=True))

    def as_c(layout, name, v):
        code = layout.codes[layout.index[name]]
        if code == "Q":
            return v if isinstance(v, int) else v.data_ptr()
        return float(torch.tensor(v, dtype=torch.float32)) if code == "f" else int(v)

    fast = plan.fast
    scales = KvScales(kd, 1.0, None, 0.25)
    scale = 1 / math.sqrt(128)
    values = dop.launch_values(plan, q, kc, vc, lens, table, o, lse, scale, [9], {}, scales)
    got = unpack(fast.attn_layout, launches[1][4])
    assert got == {n: as_c(fast.attn_layout, n, values[n]) for n in fast.attn_layout.names}
    assert got["k_descale"] == kd.data_ptr() and got["v_descale"] == 0
    assert got["v_descale_mul"] == 0.25
    calls = []
    real = fast._prepare
    monkeypatch.setattr(fast, "_prepare", lambda *a: calls.append(1) or real(*a))
    kd2 = kd.clone()
    op.with_kvcache(q, kc, vc, lens, block_table=table, k_new=kn, v_new=vn, plan=plan, window=9,
                    k_descale=kd2, v_descale=0.25)  # fmt: skip
    assert calls == [] and unpack(fast.attn_layout, launches[3][4])["k_descale"] == kd2.data_ptr()
    op.with_kvcache(q, kc, vc, lens, block_table=table, k_new=kn, v_new=vn, plan=plan, window=9,
                    k_descale=kd2, v_descale=0.5)  # fmt: skip
    assert calls == [1] and unpack(fast.attn_layout, launches[5][4])["v_descale_mul"] == 0.5
    with pytest.raises(OpInputError, match="v_descale: expected a finite descale > 0"):
        op.with_kvcache(q, kc, vc, lens, block_table=table, k_new=kn, v_new=vn, plan=plan,
                        window=9, k_descale=kd2, v_descale=0.0)  # fmt: skip


JOBS = [("llama3_gqa", False, None), ("gpt2_d64", False, None), ("gemma2_softcap", False, None),
        ("t5_bias", False, None), ("mistral_swa", True, None)]  # fmt: skip


def _compile(job):
    (name, ragged, opts), target = job
    plan = family.plan(load_spec(ROOT / "specs" / f"{name}.yaml"), target, opts, ragged=ragged,
                       cache_dtype="fp8_e4m3")  # fmt: skip
    _, report = cache.get_or_build(render(plan), plan)
    return job, plan, report


def test_kv8_units_compile_without_spills(requires_nvcc):
    """Both kernels of the kv8 units of a d128 bf16 (GQA), a d64 fp16, a d256 softcap, a
    tensor-param (T5 bias) spec and a ragged sliding-window unit, and the 64-key block (two k
    steps per K ldmatrix) on sm_90a: 6 nvcc runs, in parallel, spill-free.  A kv8 unit
    renders the same CUDA for sm_80 and sm_90a but for the kernels' names, so the specs take
    the targets in turn (sm_80, sm_90a, ...): both targets build padded and 64-key units,
    the ragged one builds for sm_80; ptxas allocates registers per arch, so a spec's other
    target is covered by its neighbours, not proven for it."""
    jobs = [(j, ("sm_80", "sm_90")[i % 2]) for i, j in enumerate(JOBS)]
    jobs.append((("llama3_gqa", False, family.Options(block_n=64, ctas_per_sm=3)), "sm_90"))
    workers = int(os.environ.get("FLASHGEN_TEST_JOBS", (os.cpu_count() or 1) + 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(_compile, jobs))
    problems = []
    for (job, target), plan, report in results:
        names = {k.name for k in report.kernels}
        assert names == {plan.kernel("attn").kernel_name, plan.kernel("append").kernel_name}
        for k in report.kernels:
            assert 0 < k.registers <= 255
            if k.spill_bytes:
                problems.append(f"{job} {target}: {k}")
    assert not problems, "kv8 decode kernels spill:\n" + "\n".join(problems)


# ----------------------------------------------------------------------------- host checks
PROGRAM = r"""
#include "HEADER"
#include <cstdio>
int main() {
    char op;
    while (scanf(" %c", &op) == 1) {
        if (op == 'c') {  // four e4m3 bytes -> fp16 and bf16 pair bits
            unsigned x; scanf("%u", &x);
            uint32_t e, o, be, bo;
            fg::kv8::e4m3x4_f16_bits(x, e, o);
            fg::kv8::e4m3x4_bf16_bits(x, be, bo);
            printf("%u %u %u %u\n", e, o, be, bo);
        } else if (op == 'q') {
            unsigned x, y, z, w; scanf("%u %u %u %u", &x, &y, &z, &w);
            uint32_t lo[2], hi[2];
            fg::kv8::q_permute(x, y, z, w, lo, hi);
            printf("%u %u %u %u\n", lo[0], lo[1], hi[0], hi[1]);
        } else if (op == 'k') {
            int p; scanf("%d", &p);
            printf("%d\n", fg::kv8::k_order(p));
        } else if (op == 'o') {
            int t, odd, j; scanf("%d %d %d", &t, &odd, &j);
            printf("%d\n", fg::kv8::o_col(t, odd, j));
        }
    }
    return 0;
}
"""


class Host:
    """The header's functions, run by one host program per call of :meth:`run`."""

    def __init__(self, exe):
        self.exe = exe

    def run(self, lines: list[str]) -> list[list[int]]:
        done = subprocess.run([str(self.exe)], input="\n".join(lines) + "\n", capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return [[int(v) for v in ln.split()] for ln in done.stdout.splitlines()]


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """The host program, built once for the module (skips without nvcc)."""
    from flashgen.build.compile import NvccNotFoundError, find_nvcc

    try:
        find_nvcc()
    except NvccNotFoundError as e:
        pytest.skip(str(e))
    d = tmp_path_factory.mktemp("kv8host")
    src, exe = d / "kv8.cu", d / "kv8"
    src.write_text(PROGRAM.replace("HEADER", str(HEADER)))
    done = subprocess.run([find_nvcc(), "-std=c++17", "-O1", "-x", "cu", str(src), "-o", str(exe)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return Host(exe)


def _halves(bits: int, dtype) -> tuple[float, float]:
    a = np.array([bits & 0xFFFF, bits >> 16], dtype=np.uint16)
    if dtype == "f16":
        return tuple(float(x) for x in a.view(np.float16))
    t = torch.from_numpy(a.astype(np.int16)).view(torch.bfloat16)
    return float(t[0]), float(t[1])


def test_every_e4m3_code_converts_exactly(host):
    """All 256 codes in each byte position: (byte 0, byte 2) and (byte 1, byte 3) as fp16 bits
    of value * 2^-8 and bf16 bits of value * 2^-120, exact against torch's e4m3 (NaN codes
    read as +-480)."""
    vals = torch.arange(256, dtype=torch.uint8).view(E4M3).float().tolist()
    rng = random.Random(0)
    words = []
    for c in range(256):
        others = [rng.randrange(256) for _ in range(3)]
        for pos in range(4):
            b = others[:pos] + [c] + others[pos:]
            words.append(b)
    out = host.run([f"c {b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24}" for b in words])
    for b, (e, o, be, bo) in zip(words, out, strict=True):
        want = [vals[x] if not np.isnan(vals[x]) else (480.0 if x < 128 else -480.0) for x in b]
        fe, fo = _halves(e, "f16"), _halves(o, "f16")
        assert [fe[0] * 256, fo[0] * 256, fe[1] * 256, fo[1] * 256] == want
        he, ho = _halves(be, "bf16"), _halves(bo, "bf16")
        assert [x * 2.0**120 for x in (he[0], ho[0], he[1], ho[1])] == want


def test_k_order_and_o_col_maps(host):
    ks = [r[0] for r in host.run([f"k {p}" for p in range(16)])]
    assert ks == [family.fp8_k_order(p) for p in range(16)] and sorted(ks) == list(range(16))
    cols = host.run([f"o {t} {odd} {j}" for t in range(4) for odd in (0, 1) for j in (0, 1)])
    assert sorted(c[0] for c in cols) == list(range(16))


def _ldmatrix(mats, lane, trans=False):
    """The 32-bit register ``lane`` receives from each 8x8 b16 matrix of ``mats`` (uint16
    arrays): row lane/4, columns 2(lane%4), +1 (trans: rows 2(lane%4), +1 of column lane/4),
    the first in the low half (PTX ISA, ldmatrix)."""
    g, t = lane // 4, lane % 4
    out = []
    for m in mats:
        lo, hi = (m[2 * t, g], m[2 * t + 1, g]) if trans else (m[g, 2 * t], m[g, 2 * t + 1])
        out.append(int(lo) | int(hi) << 16)
    return out


def _pair(bits):
    return bits & 0xFFFF, bits >> 16


def test_fragment_model_qk_and_pv(host):
    """A numpy model of one warp's mma.sync m16n8k16 on one 16-wide k step: the Q tile stored
    by q_permute, K's e4m3 words from ldmatrix converted to (b0, b1) = (even, odd): S = Q K^T;
    P V with V's words from ldmatrix.trans of byte pairs, the even / odd column MMAs written
    to o_col: O = P V.  Exact (small integers)."""
    rs = np.random.RandomState(0)
    # Q [16, 16] fp16 integers; K [8 keys, 16] e4m3 integers (exact in e4m3)
    q = rs.randint(-4, 5, size=(16, 16)).astype(np.float16)
    k = rs.randint(-8, 9, size=(8, 16)).astype(np.float32)
    k8 = torch.from_numpy(k).to(E4M3).view(torch.uint8).numpy()
    qbits = q.view(np.uint16)
    lines = []
    for r in range(16):
        for h in range(2):
            w = [int(qbits[r, 8 * h + 2 * i]) | int(qbits[r, 8 * h + 2 * i + 1]) << 16
                 for i in range(4)]  # fmt: skip
            lines.append("q " + " ".join(map(str, w)))
    smem = np.zeros((16, 16), dtype=np.uint16)  # the stored Q tile: chunk 0 | chunk 1
    for i, (lo0, lo1, hi0, hi1) in enumerate(host.run(lines)):
        r, h = divmod(i, 2)
        for j, word in enumerate((lo0, lo1)):
            smem[r, 4 * h + 2 * j : 4 * h + 2 * j + 2] = _pair(word)
        for j, word in enumerate((hi0, hi1)):
            smem[r, 8 + 4 * h + 2 * j : 8 + 4 * h + 2 * j + 2] = _pair(word)
    a_log = smem.view(np.float16).astype(np.float64)  # A[row][k] as ldmatrix hands it out
    for p in range(16):
        assert np.array_equal(a_log[:, family.fp8_k_order(p)], q[:, p].astype(np.float64))
    # K: ldmatrix b16 on the e4m3 bytes; thread (g, t) gets bytes 4t .. 4t + 3 of key g
    kmat = (k8[:, 0::2].astype(np.uint16) | (k8[:, 1::2].astype(np.uint16) << 8))
    words = [_ldmatrix([kmat], lane)[0] for lane in range(32)]
    conv = host.run([f"c {w}" for w in words])
    b_log = np.zeros((16, 8))
    for lane, (e, o, _, _) in enumerate(conv):
        g, t = lane // 4, lane % 4
        ev, od = _halves(e, "f16"), _halves(o, "f16")
        b_log[2 * t, g], b_log[2 * t + 1, g] = ev[0] * 256, ev[1] * 256  # b0
        b_log[2 * t + 8, g], b_log[2 * t + 9, g] = od[0] * 256, od[1] * 256  # b1
    assert np.array_equal(a_log @ b_log, q.astype(np.float64) @ k.T.astype(np.float64))
    # P V: P [16 rows, 16 keys]; V [16 keys, 16 columns] e4m3; ldmatrix.trans of byte pairs
    pm = rs.randint(-3, 4, size=(16, 16)).astype(np.float64)
    v = rs.randint(-8, 9, size=(16, 16)).astype(np.float32)
    v8 = torch.from_numpy(v).to(E4M3).view(torch.uint8).numpy()
    vmat = v8[:, 0::2].astype(np.uint16) | (v8[:, 1::2].astype(np.uint16) << 8)  # [key, pair]
    regs = [_ldmatrix([vmat[0:8], vmat[8:16]], lane, trans=True) for lane in range(32)]
    conv = host.run([f"c {w}" for r in regs for w in r])
    b_even, b_odd = np.zeros((16, 8)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for m in range(2):  # matrix m: keys 8m .. 8m + 7 -> b0 (m = 0) / b1 (m = 1)
            e, o, _, _ = conv[2 * lane + m]
            for dst, bits in ((b_even, e), (b_odd, o)):
                lo, hi = _halves(bits, "f16")
                dst[8 * m + 2 * t, g], dst[8 * m + 2 * t + 1, g] = lo * 256, hi * 256
    c_even, c_odd = pm @ b_even, pm @ b_odd
    cols = {(t, odd, j): c[0] for (t, odd, j), c in zip(
        [(t, odd, j) for t in range(4) for odd in (0, 1) for j in (0, 1)],
        host.run([f"o {t} {odd} {j}" for t in range(4) for odd in (0, 1) for j in (0, 1)]),
        strict=True)}  # fmt: skip
    out = np.zeros((16, 16))
    for row in range(16):
        for t in range(4):
            for j in range(2):  # accumulator c_j of quad thread t: column 2t + j of the MMA
                out[row, cols[(t, 0, j)]] = c_even[row, 2 * t + j]
                out[row, cols[(t, 1, j)]] = c_odd[row, 2 * t + j]
    assert np.array_equal(out, pm @ v.astype(np.float64))


def test_decode_bench_takes_fp8(capsys):
    """``python -m flashgen.bench.decode --fp8`` parses (it needs a GPU to run: without one it
    says so and returns 1)."""
    from flashgen.bench.decode import main

    if torch.cuda.is_available():
        pytest.skip("would run the benchmark")
    assert main(["--fp8", "--quick"]) == 1
    assert "needs a CUDA device" in capsys.readouterr().err


# ------------------------------------------------- with_kvcache: fp8 descales, out=, ragged offsets
def _kv8_call(b=2, hq=4, hkv=2, d=128, cap=32):
    torch.manual_seed(0)
    q = torch.randn(b, hq, 1, d, dtype=torch.bfloat16)
    kc = (torch.randn(b, hkv, cap, d) * 40).to(E4M3)
    vc = (torch.randn(b, hkv, cap, d) * 40).to(E4M3)
    lens = torch.tensor([10, 32], dtype=torch.int32)
    return q, kc, vc, lens


@pytest.mark.parametrize("kd", [1e39, 1e-50])
def test_kvcache_float_descale_outside_float32(kd):
    """1e39 crashed in torch.full (overflow); 1e-50 was reported as '0.0 at [0, 0]'."""
    op = flashgen.load("causal_d128")
    q, kc, vc, lens = _kv8_call()
    with pytest.raises(OpInputError, match=r"k_descale: expected a finite descale > 0, got"):
        op.with_kvcache(q, kc, vc, lens, k_descale=kd, v_descale=0.01)


def test_kvcache_folded_q_k_descale_overflow():
    """An e4m3 q's q_descale folds into k's: 1e20 * 1e20 overflowed float32 inside torch."""
    op = flashgen.load("causal_d128")
    q, kc, vc, lens = _kv8_call()
    with pytest.raises(OpInputError, match=r"q_descale, k_descale: their product"):
        op.with_kvcache(q.to(E4M3), kc, vc, lens, q_descale=1e20, k_descale=1e20)
    with pytest.raises(OpInputError, match=r"q_descale \* k_descale: expected finite .* got inf"):
        op.with_kvcache(q.to(E4M3), kc, vc, lens, q_descale=torch.tensor(1e30),
                        k_descale=torch.tensor(1e30))  # fmt: skip


def test_kvcache_out_overlapping_an_input_refused():
    op = flashgen.load("causal_d128")
    q, kc, vc, lens = _kv8_call()
    lse = torch.empty(2, 4, 1)
    with pytest.raises(OpInputError, match=r"out\[0\]: expected memory that no input shares, "
                                           r"got a tensor overlapping q"):  # fmt: skip
        op.with_kvcache(q, kc, vc, lens, k_descale=0.01, v_descale=0.01, out=(q, lse))
    o = torch.empty(2, 4, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(OpInputError, match=r"out\[1\]: expected memory apart from out\[0\]"):
        op.with_kvcache(q, kc, vc, lens, k_descale=0.01, v_descale=0.01,
                        out=(o, o.view(-1).view(torch.float32)[:8].view(2, 4, 1)))  # fmt: skip
    with pytest.raises(OpInputError, match=r"out\[0\]: expected a tensor that does not require"):
        op.with_kvcache(q, kc, vc, lens, k_descale=0.01, v_descale=0.01,
                        out=(torch.zeros_like(o).requires_grad_(), lse))  # fmt: skip
    res = op.with_kvcache(q, kc, vc, lens, k_descale=0.01, v_descale=0.01, out=(o, lse))
    assert res[0] is o


def test_ragged_bad_last_offset_named_not_max_seqlen_q():
    """cu_seqlens_q whose last offset runs past q's rows: the error blamed a max_seqlen_q the
    caller never passed (derived from the bad offsets)."""
    op = flashgen.load("llama3_gqa")
    torch.manual_seed(0)
    kc = torch.randn(3, 2, 48, 128, dtype=torch.bfloat16)
    q = torch.randn(6, 4, 128, dtype=torch.bfloat16)
    lens = torch.tensor([5, 20, 48], dtype=torch.int32)
    cu = torch.tensor([0, 1, 4, 2**31 - 1], dtype=torch.int32)
    with pytest.raises(OpInputError, match=r"^cu_seqlens_q: expected cu_seqlens_q\[-1\] == 6"):
        op.with_kvcache(q, kc, kc, lens, cu_seqlens_q=cu)
