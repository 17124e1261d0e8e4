"""The attention sink inside the decode kernels (``Options.decode.fused_sink``, issue 37) on the
device (``python -m pytest -q tests/gpu/test_decode_sink_gpu.py``): specs/gpt_oss_sink.yaml
(d64, bf16, ``sink: sinks[h]``) loaded with the option (fused: the kernel joins the sink) and
without it (unfused: the kernel's keys-only o, then the torch epilogue), against the float64
reference with the sink (:func:`~flashgen.ops.decode.op.decode_reference`).

Matrix: dense (padded), paged (page size 16 and 1), ragged Sq_new (cu_seqlens_q, dense and
paged), a bf16 and an e4m3 cache (random descales per (request, kv head)), GQA 8/2 and 64/8,
num_splits 1 and 8, Sq_new 1 and 4, requests of 0, 1, 17, 1000 and 4097 live keys (one key
block to 33 at d64's 128-key blocks: one split and the merge).  Per case:

- fused o within the rule of tests/gpu/test_decode_gpu.py (max|o - ref64| <= 2 * max|ref in
  bf16 - ref64| + 1e-3), and within 2^-6 relative of the unfused o (which rounds o_keys to
  bf16 once more before the epilogue: three roundings of 2^-8 between them);
- lse (the keys' alone) bitwise the unfused kernel's, within 1e-2 relative of the reference's,
  -inf with o == 0 exactly where the reference has no key;
- ``apply_sink=False`` (a null sink pointer): o and lse bitwise the unfused kernel's.

Also: the sink's other forms (``sinks[b, h]``: a batch stride; ``s0 + sinks[h_kv]``: logits
computed per call; a strided view of a tensor), the planned fast path (bitwise the unplanned
call; a new sink tensor honoured) and CUDA-graph replays reading a sink updated in place,
and ``torch.compile``.  Speed is a benchmark (issue 37's 5% goal), not a test here.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen.ops.decode.op import decode_reference, decode_reference_ragged  # noqa: E402
from flashgen.ops.op import poison_outputs  # noqa: E402
from flashgen.options import Options  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
SINK_SPEC = REPO / "specs" / "gpt_oss_sink.yaml"
ON = Options().replace_path("decode.fused_sink", True)  # the default, named
OFF = Options().replace_path("decode.fused_sink", False)
BF16 = torch.bfloat16
E4M3 = getattr(torch, "float8_e4m3fn", None)
LENS = [0, 1, 17, 1000, 4097]
SQ_B = [1, 1, 3, 2, 4]  # a ragged call's queries per request


def _ops(path=SINK_SPEC):
    """(fused, unfused) ops of the spec at ``path``."""
    return flashgen.load(path, options=ON), flashgen.load(path, options=OFF)


def _spec_text(name: str, sink: str, params: str) -> str:
    text = SINK_SPEC.read_text()
    text = text.replace("name: gpt_oss_sink", f"name: {name}")
    text = text.replace("sink: sinks[h]", f"sink: {sink}")
    return text.replace("  sinks: {type: f32, shape: [num_heads]}", params)


def make_cache(lens, *, ps, hkv, d, cache="bf16", cap=None, seed=0):
    """A cache with random keys at the live slots and NaN (the e4m3 NaN code) elsewhere:
    ``(k_cache, v_cache, block_table or None, descales)``; ``ps`` 0: dense ``[B, Hkv, S, D]``,
    else paged ``[pages, ps, Hkv, D]`` (a shuffled table, spare pages); ``cache`` ``fp8``:
    e4m3 codes and random descales in [0.005, 0.03] per (request, kv head) (``{}`` for bf16)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch, cap = len(lens), cap or max(max(lens), 1)
    fp8 = cache == "fp8"

    def rows(*shape):
        x = torch.randn(*shape, generator=g, device="cuda")
        return (x * 64).clamp(-448, 448).to(E4M3) if fp8 else x.to(BF16)

    def empty(*shape):
        x = torch.full(shape, float("nan"), device="cuda")
        return x.to(E4M3) if fp8 else x.to(BF16)

    descales = {}
    if fp8:
        descales = {n: torch.rand(batch, hkv, generator=g, device="cuda") * 0.025 + 0.005
                    for n in ("k_descale", "v_descale")}  # fmt: skip
    if ps == 0:
        kc, vc = empty(batch, hkv, cap, d), empty(batch, hkv, cap, d)
        for b, n in enumerate(lens):
            kc[b, :, :n], vc[b, :, :n] = rows(hkv, n, d), rows(hkv, n, d)
        return kc, vc, None, descales
    max_pages = -(-cap // ps)
    pages = batch * max_pages + 3
    perm = torch.randperm(pages, generator=g, device="cuda")
    table = perm[: batch * max_pages].view(batch, max_pages).int().contiguous()
    kc, vc = empty(pages, ps, hkv, d), empty(pages, ps, hkv, d)
    for b, n in enumerate(lens):
        if n:
            pos = torch.arange(n, device="cuda")
            at = (table[b].long()[pos // ps], pos % ps)
            kc[at], vc[at] = rows(n, hkv, d), rows(n, hkv, d)
    return kc, vc, table, descales


def _reference(spec, q, kc, vc, lens, table, params, descales, cu=None, dtype=torch.float64):
    kw = dict(params=params, compute_dtype=dtype, **descales)
    if cu is None:
        return decode_reference(spec, q, kc, vc, torch.tensor(lens), table, **kw)
    return decode_reference_ragged(spec, q, kc, vc, torch.tensor(lens), cu, table, **kw)


def check(spec, q, kc, vc, lens, table, params, descales, o, lse, cu=None):
    """Fused ``(o, lse)`` against the float64 reference with the sink (the rule above)."""
    r64o, r64l = _reference(spec, q, kc, vc, lens, table, params, descales, cu)
    rlo, _ = _reference(spec, q, kc, vc, lens, table, params, descales, cu, dtype=q.dtype)
    assert not torch.isnan(o).any(), "NaN in o (a row left unwritten, or garbage read)"
    bound = 2 * (rlo.double() - r64o).abs().max().item() + 1e-3
    err = (o.double() - r64o).abs().max().item()
    assert err <= bound, f"o error {err:.3g} > bound {bound:.3g}"
    fin = torch.isfinite(r64l)
    assert torch.equal(torch.isfinite(lse), fin)
    rows_o = o if cu is None else o.transpose(0, 1)  # ragged: o [total_q, Hq], lse [Hq, total_q]
    assert bool((lse[~fin] == -math.inf).all()) and bool((rows_o[~fin] == 0).all())
    if fin.any():
        rel = ((lse.double() - r64l).abs() / r64l.abs().clamp_min(1.0))[fin].max().item()
        assert rel <= 1e-2


def _close_bf16(a, b):
    """Fused ``a`` against unfused ``b``: the unfused o is rounded to bf16 twice (o_keys, then
    o_keys x sigmoid), the fused once, each rounding within 2^-8 relative: |a - b| within
    four of them (2^-6) of the larger, and 1e-6 near zero."""
    diff = (a.double() - b.double()).abs()
    tol = torch.maximum(a.double().abs(), b.double().abs()) * 2.0**-6 + 1e-6
    assert bool((diff <= tol).all()), f"fused vs unfused: max excess {(diff - tol).max():.3g}"


LAYOUTS = [("dense", 0), ("paged", 16), ("paged", 1), ("ragged", 0), ("ragged", 16)]
CASES = [(lay, ps, cache, splits, heads, sq) for lay, ps in LAYOUTS for cache in ("bf16", "fp8")
         for splits in (1, 8) for heads in ((8, 2), (64, 8))
         for sq in ((1,) if lay == "ragged" else (1, 4))]  # fmt: skip


@pytest.mark.parametrize("layout,ps,cache,splits,heads,sq", CASES, ids=str)
def test_fused_and_unfused_against_float64(layout, ps, cache, splits, heads, sq):
    if cache == "fp8" and E4M3 is None:
        pytest.skip("torch without float8_e4m3fn")
    fused, plain = _ops()
    spec = plain.spec
    hq, hkv = heads
    kc, vc, table, descales = make_cache(LENS, ps=ps, hkv=hkv, d=64, cache=cache)
    g = torch.Generator(device="cuda").manual_seed(1)
    sinks = torch.randn(hq, generator=g, device="cuda") * 2
    lens_t = torch.tensor(LENS, dtype=torch.int32, device="cuda")
    kw = dict(block_table=table, num_splits=splits, sinks=sinks, **descales)
    cu = None
    if layout == "ragged":
        cu = torch.tensor([0, *torch.tensor(SQ_B).cumsum(0).tolist()], dtype=torch.int32,
                          device="cuda")  # fmt: skip
        q = torch.randn(sum(SQ_B), hq, 64, generator=g, device="cuda").to(BF16)
        kw.update(cu_seqlens_q=cu, max_seqlen_q=max(SQ_B))
    else:
        q = torch.randn(len(LENS), hq, sq, 64, generator=g, device="cuda").to(BF16)
    with poison_outputs():
        of, lf = fused.with_kvcache(q, kc, vc, lens_t, **kw)
        ou, lu = plain.with_kvcache(q, kc, vc, lens_t, **kw)
        ok, lk = fused.with_kvcache(q, kc, vc, lens_t, apply_sink=False, **kw)
        ok0, lk0 = plain.with_kvcache(q, kc, vc, lens_t, apply_sink=False, **kw)
    torch.cuda.synchronize()
    assert torch.equal(ok, ok0) and torch.equal(lk, lk0), "a null sink must be the keys alone"
    assert torch.equal(lf, lu), "lse must stay the keys' alone"
    _close_bf16(of, ou)
    assert not torch.equal(of, ok)  # the sink does change o
    check(spec, q, kc, vc, LENS, table, {"sinks": sinks}, descales, of, lf, cu)


FORMS = {
    "per_batch_head": ("sinks[b, h]", "  sinks: {type: f32, shape: [batch, num_heads]}"),
    "kv_head_and_scalar": ("s0 + sinks[h_kv]", "  sinks: {type: f32, shape: [num_heads_kv]}\n"
                           "  s0: {type: f32, default: 0.5}"),
}  # fmt: skip


@pytest.mark.parametrize("splits", [1, 8])
@pytest.mark.parametrize("form", [*FORMS, "strided_view"])
def test_other_sink_forms(form, splits, tmp_path):
    """``sinks[b, h]`` (the kernel's batch stride), ``s0 + sinks[h_kv]`` (logits computed per
    call, the scalar passed), and ``sinks[h]`` as a strided view: fused against the float64
    reference, paged cache, GQA 8/2, planned and unplanned calls alike."""
    hq, hkv, batch = 8, 2, len(LENS)
    g = torch.Generator(device="cuda").manual_seed(2)
    params = {}
    if form == "strided_view":
        fused, _ = _ops()
        params["sinks"] = (torch.randn(2 * hq, generator=g, device="cuda") * 2)[::2]
    else:
        path = tmp_path / f"gpt_oss_sink_{form}.yaml"
        path.write_text(_spec_text(f"gpt_oss_sink_{form}", *FORMS[form]))
        fused, _ = _ops(path)
        shape = (batch, hq) if form == "per_batch_head" else (hkv,)
        params["sinks"] = torch.randn(shape, generator=g, device="cuda") * 2
        if form == "kv_head_and_scalar":
            params["s0"] = -1.25
    kc, vc, table, _ = make_cache(LENS, ps=16, hkv=hkv, d=64)
    q = torch.randn(batch, hq, 1, 64, generator=g, device="cuda").to(BF16)
    lens_t = torch.tensor(LENS, dtype=torch.int32, device="cuda")
    with poison_outputs():
        o, lse = fused.with_kvcache(q, kc, vc, lens_t, block_table=table, num_splits=splits,
                                    **params)  # fmt: skip
    check(fused.spec, q, kc, vc, LENS, table, params, {}, o, lse)
    p = fused.plan_decode(batch=batch, num_heads=hq, num_heads_kv=hkv, seqlen_q=1,
                          cache_capacity=table.shape[1] * 16, page_size=16,
                          num_pages=kc.shape[0], num_splits=splits)  # fmt: skip
    assert p.fused_sink and p.fast is not None
    po, pl = fused.with_kvcache(q, kc, vc, lens_t, block_table=table, plan=p, **params)
    torch.cuda.synchronize()
    assert torch.equal(po, o) and torch.equal(pl, lse)


def test_planned_fast_path_and_graph_replays_read_the_sink():
    """The planned call (its kernel reads the sinks tensor itself) equals the unplanned one
    bitwise; a call with another sinks tensor uses it; a CUDA graph captured with a plan
    reads the sinks updated in place at each replay (as cache_seqlens)."""
    fused, plain = _ops()
    batch, hq, hkv, ps = 4, 64, 8, 16
    kc, vc, table, _ = make_cache([2000] * batch, ps=ps, hkv=hkv, d=64)
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(batch, hq, 1, 64, generator=g, device="cuda").to(BF16)
    lens_t = torch.tensor([10, 500, 1999, 0], dtype=torch.int32, device="cuda")
    sinks = torch.randn(hq, generator=g, device="cuda") * 2
    p = fused.plan_decode(batch=batch, num_heads=hq, num_heads_kv=hkv, seqlen_q=1,
                          cache_capacity=table.shape[1] * ps, page_size=ps,
                          num_pages=kc.shape[0])  # fmt: skip
    assert p.fused_sink and p.fast is not None
    a = fused.with_kvcache(q, kc, vc, lens_t, block_table=table, plan=p, sinks=sinks)
    b = fused.with_kvcache(q, kc, vc, lens_t, block_table=table, num_splits=p.num_splits,
                           sinks=sinks)  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    other = sinks.flip(0).contiguous()
    c = fused.with_kvcache(q, kc, vc, lens_t, block_table=table, plan=p, sinks=other)
    d = fused.with_kvcache(q, kc, vc, lens_t, block_table=table, num_splits=p.num_splits,
                           sinks=other)  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(c[0], d[0]) and not torch.equal(c[0], a[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        og, lg = fused.with_kvcache(q, kc, vc, lens_t, block_table=table, plan=p, sinks=sinks)
    for new_lens, scale in (([1, 2, 3, 4], 0.5), ([1999, 1000, 0, 64], -3.0)):
        lens_t.copy_(torch.tensor(new_lens, dtype=torch.int32))
        sinks.mul_(scale)
        graph.replay()
        torch.cuda.synchronize()
        check(fused.spec, q, kc, vc, new_lens, table, {"sinks": sinks}, {}, og, lg)
        want = plain.with_kvcache(q, kc, vc, lens_t, block_table=table,
                                  num_splits=p.num_splits, sinks=sinks)  # fmt: skip
        _close_bf16(og, want[0])


def test_torch_compile_takes_the_registered_op_and_the_epilogue():
    """Under ``torch.compile(fullgraph=True)`` the registered op runs the fused unit with a
    null sink (the keys alone) and the torch epilogue joins the sink: the unfused op's lse
    bitwise, its o within the bf16 rule (the same math, traced)."""
    fused, plain = _ops()
    kc, vc, table, _ = make_cache(LENS, ps=16, hkv=2, d=64)
    q = torch.randn(len(LENS), 8, 1, 64, device="cuda").to(BF16)
    lens_t = torch.tensor(LENS, dtype=torch.int32, device="cuda")
    sinks = torch.randn(8, device="cuda")

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(q, kc, vc, lens, table, sinks):
        return fused.with_kvcache(q, kc, vc, lens, block_table=table, num_splits=4, sinks=sinks)

    got = f(q, kc, vc, lens_t, table, sinks)
    want = plain.with_kvcache(q, kc, vc, lens_t, block_table=table, num_splits=4, sinks=sinks)
    torch.cuda.synchronize()
    assert torch.equal(got[1], want[1])
    _close_bf16(got[0], want[0])
