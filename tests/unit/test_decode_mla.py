"""MLA-shaped caches (issue 40 part 3): a ``v_from_k: true`` spec (specs/mla_decode.yaml,
head_dim 576 / head_dim_v 512) is decode only, reads one latent cache whose first 512 columns
are the values, num_heads_kv 1.  On CPU: the spec rules (SpecError at file:line:col), the
refusals of its prefill / varlen / backward, the op against a float64 reference with V sliced
from K (dense and paged caches of page sizes 1, 16, 64, lengths 1, 17, 127, 1000, 16 and 128
query heads, Sq_new 1 and 4 appended, ragged Sq_new, an e4m3 cache with k_descale), plan=,
out=, torch.compile, bad arguments (OpInputError naming argument, expected and received), the
registered ops' schemas, and the decode unit (no V stage in the ring)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import flashgen
from flashgen.build.render import render
from flashgen.families import decode as family
from flashgen.families import registry
from flashgen.frontend.errors import OpInputError, SpecError
from flashgen.frontend.spec import load_spec, loads_spec
from flashgen.ops.decode.op import decode_op

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "specs" / "mla_decode.yaml"
E4M3 = getattr(torch, "float8_e4m3fn", None)
D, DV = 576, 512


def _op():
    return flashgen.load(SPEC)


def latent_cache(lens, *, ps, dense, dtype=torch.bfloat16, seed=0, cap=None):
    """A latent cache ``[B, 1, cap, 576]`` (dense) or ``[pages, ps, 1, 576]`` through a shuffled
    table, random everywhere (a read past the live keys would change the result)."""
    g = torch.Generator().manual_seed(seed)
    cap = cap or max(lens) + 5

    def rnd(*shape):
        x = torch.randn(*shape, generator=g)
        return (x * 40).to(dtype) if dtype == E4M3 else x.to(dtype)

    if dense:
        return rnd(len(lens), 1, cap, D), None
    max_pages = -(-cap // ps)
    num_pages = len(lens) * max_pages + 2
    table = torch.randperm(num_pages, generator=g)[: len(lens) * max_pages]
    return rnd(num_pages, ps, 1, D), table.view(len(lens), max_pages).int().contiguous()


def rows_of(kc, table, b, n):
    """Request b's first n latent rows, float64 ``[n, 576]``, slot by slot."""
    if table is None:
        return kc[b, 0, :n].double()
    ps = kc.shape[1]
    return torch.stack([kc[int(table[b, p // ps]), p % ps, 0].double() for p in range(n)])


def mla_reference(qs, kc, table, live, scale, kd=None):
    """float64 MLA per request: ``qs[b]`` ``[Hq, n, 576]``; keys the latent rows, values their
    first 512 columns (descaled by ``kd[b, 0]``), causal among the n new tokens (the last n
    of the live keys).  Lists of o ``[Hq, n, 512]`` and lse ``[Hq, n]``."""
    outs, lses = [], []
    for b, qb in enumerate(qs):
        n, L = qb.shape[1], live[b]
        k = rows_of(kc, table, b, L)
        if kd is not None:
            k = k * float(kd[b, 0])
        s = qb.double() @ k.T * scale
        causal = torch.arange(L).view(1, -1) <= torch.arange(n).view(-1, 1) + L - n
        s = s.masked_fill(~causal, -math.inf)
        lse = torch.logsumexp(s, -1)
        outs.append(torch.exp(s - lse[..., None]) @ k[:, :DV])
        lses.append(lse)
    return outs, lses


SCALE = load_spec(SPEC).softmax_scale


def _check(o, lse, eo, el, atol=2e-2):
    err = (o.double() - eo).abs().amax(dim=None) if o.numel() else 0.0
    assert torch.allclose(o.double(), eo, atol=atol, rtol=2e-2), err
    assert torch.allclose(lse.double(), el, atol=1e-3, rtol=1e-4)


# ----------------------------------------------------------------------------- the spec
def test_the_shipped_spec_is_v_from_k_576_512():
    s = load_spec(SPEC)
    assert (s.head_dim, s.head_dim_v, s.v_from_k) == (576, 512, True)
    assert not registry.has_backward(s) and registry.compile_units(s, "sm_90") == {}
    assert family.unsupported_reason(s) is None


BASE = "name: m\ndtype: bf16\nhead_dim: 576\nhead_dim_v: 512\nv_from_k: true\n"


@pytest.mark.parametrize(
    "text,line,col,msg",
    [
        ("name: m\ndtype: bf16\nhead_dim: 576\nhead_dim_v: 512\n", 3, 11,
         r"head_dim 576 is not supported \(supported: .*\); 576/512 is MLA's decode-only "
         "form, with v_from_k: true"),
        ("name: m\ndtype: bf16\nhead_dim: 128\nv_from_k: true\n", 3, 11,
         "v_from_k: true supports head_dim/head_dim_v 576/512"),
        ("name: m\ndtype: bf16\nhead_dim: 576\nhead_dim_v: 448\nv_from_k: true\n", 4, 13,
         "v_from_k: true supports .*got 576/448"),
        (BASE.replace("bf16", "fp8_e4m3"), 2, 8, "v_from_k: true needs dtype fp16 or bf16"),
        (BASE + "varlen: true\n", 6, 9, "v_from_k: true is decode only: it has no varlen form"),
        (BASE + "tiles: {block_n: 64}\n", 6, 18, "tiles pin the prefill kernel"),
        (BASE.replace("v_from_k: true", "v_from_k: 1"), 5, 11, "v_from_k must be true or false"),
    ],
    ids=["needs_v_from_k", "head_dim", "head_dim_v", "dtype", "varlen", "tiles", "not_bool"],
)  # fmt: skip
def test_spec_rules_at_file_line_column(text, line, col, msg):
    with pytest.raises(SpecError, match=msg) as e:
        loads_spec(text, "mla.yaml")
    assert f"mla.yaml:{line}:{col}:" in str(e.value)


def test_prefill_varlen_and_backward_refuse():
    op = _op()
    q = torch.randn(1, 2, 3, D).bfloat16()
    with pytest.raises(OpInputError, match="v_from_k: true .*decode only"):
        op.attention(q, q[:, :1], q[:, :1, :, :DV])
    with pytest.raises(OpInputError, match="decode only"):
        op.torch_op(q, q[:, :1], q[:, :1, :, :DV], 0.1)
    with pytest.raises(SpecError, match=r"mla_decode.yaml:\d+:1: .*no varlen form"):
        op.varlen  # noqa: B018
    for fn in (registry.plan_forward, registry.plan_backward):
        with pytest.raises(ValueError, match="decode only"):
            fn(op.spec, "sm_90")


# ----------------------------------------------------------------------------- the op
CASES = [  # (lens, Sq_new (appended when > 1), Hq, page size (0: dense))
    ([1, 17, 127], 1, 16, 16),
    ([1000, 5], 1, 128, 64),
    ([17, 127], 4, 16, 1),
    ([127, 1], 4, 16, 0),
]


@pytest.mark.parametrize("lens,sq,hq,ps", CASES, ids=str)
def test_mla_matches_the_float64_reference_with_v_sliced_from_k(lens, sq, hq, ps):
    op = _op()
    append = sq > 1
    live = [n + sq if append else n for n in lens]
    kc, table = latent_cache(lens, ps=ps or 1, dense=ps == 0, cap=max(live) + 3)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(len(lens), hq, sq, D, generator=g).bfloat16()
    kw = dict(block_table=table)
    if append:
        kw["k_new"] = torch.randn(len(lens), 1, sq, D, generator=g).bfloat16()
    o, lse = op.with_kvcache(q, kc, None, torch.tensor(lens, dtype=torch.int32), **kw)
    assert o.shape == (len(lens), hq, sq, DV) and o.dtype == torch.bfloat16
    eo, el = mla_reference(q, kc, table, live, SCALE)
    for b in range(len(lens)):
        _check(o[b], lse[b], eo[b], el[b])


def test_ragged_mla():
    op = _op()
    sqs, lens = [2, 0, 1, 3], [17, 4, 1, 127]
    live = [n + s for n, s in zip(lens, sqs, strict=True)]
    kc, table = latent_cache(lens, ps=16, dense=False, cap=max(live) + 1)
    cu = torch.tensor([0, *torch.tensor(sqs).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(int(cu[-1]), 16, D, generator=g).bfloat16()
    kn = torch.randn(int(cu[-1]), 1, D, generator=g).bfloat16()
    o, lse = op.with_kvcache(q, kc, None, torch.tensor(lens, dtype=torch.int32),
                             block_table=table, k_new=kn, cu_seqlens_q=cu)  # fmt: skip
    qs = [q[cu[b] : cu[b + 1]].transpose(0, 1) for b in range(4)]
    eo, el = mla_reference(qs, kc, table, live, SCALE)
    for b in range(4):
        q0, q1 = int(cu[b]), int(cu[b + 1])
        _check(o[q0:q1].transpose(0, 1), lse[:, q0:q1], eo[b], el[b])


@pytest.mark.skipif(E4M3 is None, reason="torch without float8_e4m3fn")
@pytest.mark.parametrize("ps", [0, 1, 64])
def test_e4m3_latent_cache_with_one_descale(ps):
    """An e4m3 latent cache: k_descale ``[B, 1]`` scales keys and values alike (v_descale
    stays None); an appended e4m3 row lands in the cache."""
    op = _op()
    lens = [17, 127]
    kc, table = latent_cache(lens, ps=ps or 1, dense=ps == 0, dtype=E4M3, cap=140)
    g = torch.Generator().manual_seed(3)
    kd = torch.rand(2, 1, generator=g) * 0.05 + 0.01
    q = torch.randn(2, 16, 2, D, generator=g).bfloat16()
    kn = (torch.randn(2, 1, 2, D, generator=g) * 40).to(E4M3)
    o, lse = op.with_kvcache(q, kc, None, torch.tensor(lens, dtype=torch.int32),
                             block_table=table, k_new=kn, k_descale=kd)  # fmt: skip
    live = [n + 2 for n in lens]
    eo, el = mla_reference(q, kc, table, live, SCALE, kd)
    for b in range(2):
        _check(o[b], lse[b], eo[b], el[b], atol=3e-2)
        assert torch.equal(rows_of(kc, table, b, live[b])[-2:], kn[b, 0].double())


def test_mla_plan_out_and_torch_compile():
    op = _op()
    lens = [17, 100]
    kc, table = latent_cache(lens, ps=16, dense=False, cap=112)
    q = torch.randn(2, 16, 1, D).bfloat16()
    lens_t = torch.tensor(lens, dtype=torch.int32)
    want = op.with_kvcache(q, kc, None, lens_t, block_table=table)
    p = op.plan_decode(batch=2, num_heads=16, num_heads_kv=1, seqlen_q=1, cache_capacity=112,
                       page_size=16, num_pages=kc.shape[0], device="cpu")  # fmt: skip
    out = (torch.empty_like(want[0]), torch.empty_like(want[1]))
    got = op.with_kvcache(q, kc, None, lens_t, block_table=table, plan=p, out=out)
    assert got is out and torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    kn = torch.randn(2, 1, 1, D).bfloat16()
    k1, k2 = kc.clone(), kc.clone()

    def call(q, kc, lens):
        return op.with_kvcache(q, kc, None, lens, block_table=table, k_new=kn)

    got = torch.compile(call, fullgraph=True, backend="aot_eager")(q, k1, lens_t)
    want = call(q, k2, lens_t)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(k1, k2) and not torch.equal(k1, kc)


def test_registered_ops_take_no_v_cache_and_pass_opcheck():
    op = _op()
    dop = decode_op(op)
    assert "v_cache" not in dop.schema(False) and "v_new" not in dop.schema(True, True)
    assert "Tensor(a!) k_cache, Tensor cache_seqlens" in dop.schema(True)
    kc, table = latent_cache([9, 3], ps=4, dense=False, cap=12)
    q = torch.randn(2, 16, 1, D).bfloat16()
    lens = torch.tensor([9, 3], dtype=torch.int32)
    torch.library.opcheck(dop.torch_op(False), (q, kc, lens, table, SCALE, 0),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip
    kn = torch.randn(2, 1, 1, D).bfloat16()
    torch.library.opcheck(dop.torch_op(True), (q, kc.clone(), lens, table, kn, SCALE, 0),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip


@pytest.mark.parametrize(
    "change,msg",
    [
        (dict(v_cache="k"), r"v_cache: expected None \(spec 'mla_decode' has v_from_k: true: "
                            r"the values are the first 512 columns of k_cache\), got shape"),
        (dict(v_new=True), r"v_new: expected None .* got shape \[2, 1, 1, 576\]"),
        (dict(k_descale=0.5, v_descale=0.5), "v_descale: expected None .*scaled by k_descale"),
        (dict(heads_kv=2), r"k_cache: expected num_heads_kv 1 .*shape\[2\]\), got 2"),
        (dict(width=512), r"k_cache: expected head_dim 576 \(shape\[-1\]\), got 512"),
        (dict(q_width=512), r"q: expected head_dim 576 \(shape\[-1\]\), got 512"),
    ],
    ids=["v_cache", "v_new", "v_descale", "heads_kv", "k_width", "q_width"],
)  # fmt: skip
def test_bad_mla_arguments_raise(change, msg):
    op = _op()
    hkv, width = change.pop("heads_kv", 1), change.pop("width", D)
    kc = torch.randn(8, 4, hkv, width).bfloat16()
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    q = torch.randn(2, 16, 1, change.pop("q_width", D)).bfloat16()
    kw = dict(block_table=table)
    v_cache = kc[..., :DV] if change.pop("v_cache", None) else None
    if change.pop("v_new", None):
        kn = torch.randn(2, 1, 1, D).bfloat16()
        kw.update(k_new=kn, v_new=kn.clone())
    kw.update(change)
    before = kc.clone()
    with pytest.raises(OpInputError, match=msg):
        op.with_kvcache(q, kc, v_cache, torch.tensor([3, 5], dtype=torch.int32), **kw)
    assert torch.equal(kc, before)  # nothing written


# ----------------------------------------------------------------------------- the unit
@pytest.mark.parametrize("cache_dtype", [None, "fp8_e4m3"])
def test_the_decode_unit_holds_k_only_and_reads_v_from_it(cache_dtype):
    spec = load_spec(SPEC)
    p = family.plan(spec, "sm_80", cache_dtype=cache_dtype)
    kv_bytes = 1 if cache_dtype else 2
    ring = p.tiles.stages * p.tiles.block_n * D * kv_bytes
    assert p.smem_bytes == 16 * D * 2 + ring + p.tiles.stages * p.tiles.block_n
    assert p.smem_bytes <= family.SMEM_LIMIT["sm_80"] and p.tiles.num_warps == 8
    src = render(p)
    assert "SV_BYTES = 0;" in src and "dV + " not in src and "sV = sK;" in src
    assert "vd[c] = vs[c]" not in src
    # an ordinary spec's unit is unchanged: it stages V
    other = render(family.plan(load_spec(ROOT / "specs" / "llama3_gqa.yaml"), "sm_80"))
    assert "dV + " in other and "vd[c] = vs[c]" in other


def test_show_and_build_take_the_decode_unit(tmp_path, capsys, requires_nvcc):
    """`flashgen show` prints a v_from_k spec's decode unit; `flashgen build` compiles its
    decode units only and writes the padded one as its generated source (no backward)."""
    from flashgen.cli.commands import main

    assert main(["show", str(SPEC), "--target", "sm_80"]) == 0
    shown = capsys.readouterr().out
    assert "flashgen_mla_decode_decode_sm_80_attn" in shown and "v_from_k       true" in shown
    out = tmp_path / "gen"
    assert main(["build", str(SPEC), "--no-verify", "--out", str(out), "--jobs", "2"]) == 0
    names = sorted(p.name for p in (out / "mla_decode").iterdir())
    assert names == ["__init__.py", "manifest.json", "mla_decode_sm_80.cu", "mla_decode_sm_90.cu",
                     "spec.yaml"]  # fmt: skip
    src = (out / "mla_decode" / "mla_decode_sm_80.cu").read_text()
    assert src == render(family.plan(load_spec(SPEC), "sm_80"))
    assert "op = _op" in (out / "mla_decode" / "__init__.py").read_text()
