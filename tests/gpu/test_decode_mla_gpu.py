"""MLA decode on the device (issue 40 part 3; ``python -m pytest -q
tests/gpu/test_decode_mla_gpu.py``): specs/mla_decode.yaml (head_dim 576, values the first 512
columns of the one latent cache, num_heads_kv 1) against a float64 reference with V sliced
from K: dense and paged (page sizes 1, 16, 64) bf16 and e4m3 caches, 16 and 128 query heads
(128: eight CTAs of 16 heads per request), lengths 1, 17, 127, 1000, 4097, Sq_new 1 and 2
appended (MTP), ragged Sq_new, num_splits 1 / 3 / heuristic; a planned call in a CUDA graph;
compute-sanitizer memcheck: the mma.sync unit, forced (``decode.mla_unit="mma_sync"``, the
default).  Ragged Sq_new, the graph and memcheck also with ``decode.mla_unit="wgmma"`` on an
sm_90 GPU (the Hopper unit; its own tests: tests/gpu/test_decode_mla_wgmma_gpu.py).
``decode.mla_unit="auto"`` (opt-in until it has run on a GPU with compute-sanitizer over the
wgmma unit), asked for explicitly: the unit it picks at a B1 and a B64 shape (planned,
unplanned, torch.compile, ``out=``) against the same reference.  The accuracy rule is
tests/gpu/test_decode_gpu.py's."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen.families import decode as family  # noqa: E402
from flashgen.ops.calls import _sm_count  # noqa: E402
from flashgen.ops.decode.op import decode_op, decode_reference  # noqa: E402
from flashgen.ops.op import poison_outputs  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "specs" / "mla_decode.yaml"
E4M3 = getattr(torch, "float8_e4m3fn", None)
D, DV = 576, 512


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _op(unit: str = "mma_sync"):
    """The MLA op with ``decode.mla_unit=unit``: ``mma_sync`` / ``wgmma`` force that unit (the
    Hopper unit: sm_90 only, else a skip; ``mma_sync`` is the default), ``auto`` (opt-in)
    picks per shape."""
    if unit == "wgmma" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper MLA unit runs on sm_90")
    return flashgen.load(SPEC, options=flashgen.Options(decode=family.Options(mla_unit=unit)))


def latent_cache(batch, cap, *, ps, dense, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        x = torch.randn(*shape, generator=g, device="cuda")
        return (x * 40).to(dtype) if dtype == E4M3 else x.to(dtype)

    if dense:
        return rnd(batch, 1, cap, D), None
    max_pages = -(-cap // ps)
    num_pages = batch * max_pages + 3
    table = torch.randperm(num_pages, generator=g, device="cuda")[: batch * max_pages]
    return rnd(num_pages, ps, 1, D), table.view(batch, max_pages).int().contiguous()


def check(op, q, kc, table, live, o, lse, kd=None):
    """o, lse against decode_reference in float64 on the cache with V = its first 512 columns
    (descaled by kd: the e4m3 cache's), the bound from the same reference in bf16."""
    vc = kc[..., :DV]
    lens = torch.as_tensor(live)
    kw = {}
    if kd is not None:
        kw = dict(k_descale=kd, v_descale=kd)
    r64o, r64l = decode_reference(op.spec, q, kc, vc, lens, table, **kw)
    rlo, _ = decode_reference(op.spec, q, kc, vc, lens, table, compute_dtype=q.dtype, **kw)
    assert not torch.isnan(o).any()
    bound = 2 * (rlo.double() - r64o).abs().max().item() + 1e-3
    err = (o.double() - r64o).abs().max().item()
    assert err <= bound, f"o error {err:.3g} > bound {bound:.3g}"
    fin = torch.isfinite(r64l)
    assert torch.equal(torch.isfinite(lse), fin)
    rel = ((lse.double() - r64l).abs() / r64l.abs().clamp_min(1.0))[fin].max().item()
    assert rel <= 1e-2


CASES = [  # (Hq, Sq_new (appended when > 1), page size (0: dense), num_splits, e4m3)
    (16, 1, 16, None, False),
    (128, 1, 64, None, False),
    (16, 2, 1, 3, False),
    (128, 2, 0, 1, False),
    (16, 1, 64, None, True),
    (128, 2, 16, 3, True),
]


@pytest.mark.parametrize("hq,sq,ps,splits,fp8", CASES, ids=str)
def test_mla_against_float64(hq, sq, ps, splits, fp8):
    if fp8 and E4M3 is None:
        pytest.skip("torch without float8_e4m3fn")
    op = _op("mma_sync")
    lens = [1, 17, 127, 1000, 4097]
    append = sq > 1
    live = [n + (sq if append else 0) for n in lens]
    dt = E4M3 if fp8 else torch.bfloat16
    kc, table = latent_cache(len(lens), max(live) + 5, ps=ps or 1, dense=ps == 0, dtype=dt)
    q = torch.randn(len(lens), hq, sq, D, device="cuda").bfloat16()
    kw = dict(block_table=table, num_splits=splits)
    kd = None
    if fp8:
        kd = torch.rand(len(lens), 1, device="cuda") * 0.05 + 0.01
        kw["k_descale"] = kd
    if append:
        kn = torch.randn(len(lens), 1, sq, D, device="cuda")
        kw["k_new"] = (kn * 40).to(dt) if fp8 else kn.to(dt)
    with poison_outputs():
        o, lse = op.with_kvcache(q, kc, None, torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                 **kw)  # fmt: skip
    torch.cuda.synchronize()
    check(op, q, kc, table, live, o, lse, kd)


@pytest.mark.parametrize("unit", ["mma_sync", "wgmma"])
def test_ragged_mla_against_float64(unit):
    """Ragged Sq_new (0 to 3 new tokens per request, appended), 128 heads; each unit forced
    (``decode.mla_unit``; the Hopper unit sm_90 only)."""
    op = _op(unit)
    sqs, lens = [2, 0, 1, 3], [17, 4, 1000, 127]
    live = [n + s for n, s in zip(lens, sqs, strict=True)]
    kc, table = latent_cache(4, max(live) + 1, ps=16, dense=False)
    cu = torch.tensor([0, *torch.tensor(sqs).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), 128, D, device="cuda").bfloat16()
    kn = torch.randn(int(cu[-1]), 1, D, device="cuda").bfloat16()
    with poison_outputs():
        o, lse = op.with_kvcache(q, kc, None, torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                 block_table=table, k_new=kn, cu_seqlens_q=cu.cuda())  # fmt: skip
    torch.cuda.synchronize()
    for b in range(4):
        q0, q1 = int(cu[b]), int(cu[b + 1])
        if q1 == q0:
            continue
        # request b alone, padded, through the reference
        one = q[q0:q1].transpose(0, 1)[None]
        tb = table[b : b + 1]
        check(op, one, kc, tb, [live[b]], o[q0:q1].transpose(0, 1)[None], lse[:, q0:q1][None])


@pytest.mark.parametrize("unit", ["mma_sync", "wgmma"])
def test_mla_plan_in_a_cuda_graph(unit):
    """A planned call captured and replayed, each unit forced (``decode.mla_unit``; the Hopper
    unit, sm_90 only, takes 128 heads in two 64-row CTAs)."""
    op = _op(unit)
    wgmma = unit == "wgmma"
    lens = [17, 4000]
    kc, table = latent_cache(2, 4096, ps=64, dense=False)
    q = torch.randn(2, 128, 1, D, device="cuda").bfloat16()
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    p = op.plan_decode(batch=2, num_heads=128, num_heads_kv=1, seqlen_q=1, cache_capacity=4096,
                       page_size=64, num_pages=kc.shape[0])  # fmt: skip
    assert p.geometry.m_blocks == (2 if wgmma else 8) and p.mla_unit == unit
    op.with_kvcache(q, kc, None, lens_t, block_table=table, plan=p)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = op.with_kvcache(q, kc, None, lens_t, block_table=table, plan=p)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    want = op.with_kvcache(q, kc, None, lens_t, block_table=table, num_splits=p.num_splits)
    assert torch.equal(o, want[0]) and torch.equal(lse, want[1])
    check(op, q, kc, table, lens, o, lse)


SANITIZE_DRIVER = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import flashgen
from pathlib import Path
from flashgen.families import decode as family
spec = Path(sys.argv[1]) / "specs" / "mla_decode.yaml"
def unit(name):
    return flashgen.load(spec, options=flashgen.Options(decode=family.Options(mla_unit=name)))
runs = [(unit("mma_sync"), (torch.bfloat16, torch.float8_e4m3fn))]
if torch.cuda.get_device_capability()[0] == 9:  # the Hopper unit: 16-bit caches
    runs.append((unit("wgmma"), (torch.bfloat16,)))
forms = ((1, 1, torch.bfloat16), (64, 3, torch.bfloat16), (16, 2, torch.float8_e4m3fn))
for op, ps, splits, dt in [(op, *f) for op, dts in runs for f in forms if f[2] in dts]:
    pp = -(-300 // ps)
    kc = torch.randn(2 * pp + 2, ps, 1, 576, device="cuda").to(dt)
    table = torch.randperm(2 * pp + 2, device="cuda")[: 2 * pp].view(2, pp).int().contiguous()
    lens = torch.tensor([5, 290], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 128, 2, 576, device="cuda").bfloat16()
    kn = torch.randn(2, 1, 2, 576, device="cuda").to(dt)
    kw = dict(k_descale=torch.full((2, 1), 0.5, device="cuda")) if dt != torch.bfloat16 else {}
    op.with_kvcache(q, kc, None, lens, block_table=table, k_new=kn, num_splits=splits, **kw)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device="cuda")
    op.with_kvcache(q[0, :, :1].transpose(0, 1).repeat(3, 1, 1).contiguous(), kc, None, lens,
                    block_table=table, cu_seqlens_q=cu, max_seqlen_q=2, num_splits=splits, **kw)
torch.cuda.synchronize()
print("FLASHGEN DRIVER OK", flush=True)
"""


@pytest.mark.device_memory(8)
def test_mla_decode_is_memcheck_clean():
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("no compute-sanitizer")
    cmd = [sanitizer, "--tool", "memcheck", "--print-limit", "20", sys.executable, "-c",
           SANITIZE_DRIVER, str(REPO)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=REPO)
    log = proc.stdout + proc.stderr
    assert "FLASHGEN DRIVER OK" in log and proc.returncode == 0, log[-6000:]
    assert "ERROR SUMMARY: 0 errors" in log, log[-6000:]


def test_mla_b64_8k_with_128_heads_runs_in_under_50_ms():
    """A smoke check of the split across CTAs (not the issue's speed target): B 64, 8k cache,
    128 heads, one call under 50 ms (the latent cache is 604 MB of bf16 here, read by eight
    CTAs of 16 heads each: about 5 GB through L2 and 0.6 GB from memory; the mma.sync unit,
    forced: ``auto`` picks the Hopper unit here on sm_90)."""
    op = _op("mma_sync")
    kc, table = latent_cache(64, 8192, ps=64, dense=False)
    q = torch.randn(64, 128, 1, D, device="cuda").bfloat16()
    lens = torch.full((64,), 8192, dtype=torch.int32, device="cuda")
    op.with_kvcache(q, kc, None, lens, block_table=table)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    op.with_kvcache(q, kc, None, lens, block_table=table)
    end.record()
    torch.cuda.synchronize()
    assert start.elapsed_time(end) < 50.0


AUTO_SHAPES = [  # (batch, heads, cache): two shapes of the H100 table mla_auto_unit comes from
    (1, 16, 4096),  # sm_90: the mma.sync unit (31.5 us against 44.6)
    (64, 128, 4096),  # sm_90: the Hopper unit (198.8 us against 1120.4)
]


@pytest.mark.device_memory(8)
@pytest.mark.parametrize("batch,hq,cache", AUTO_SHAPES, ids=lambda v: str(v))
def test_auto_picks_per_shape_and_matches_the_reference(batch, hq, cache):
    """``decode.mla_unit="auto"`` (opt-in, asked for here; the default is ``mma_sync``): the
    plan runs the unit :func:`flashgen.families.decode.mla_unit_for_call` gives on this device
    (sm_90 with 132 SMs: the table's faster unit; sm_80 or another SM count: what the rule
    says), a planned call, an unplanned one (picked at call time), one under ``torch.compile``
    and one with ``out=`` agree bitwise at the plan's split count, and match the float64
    reference."""
    op = _op("auto")
    assert op.options.decode.mla_unit == "auto"
    assert flashgen.load(SPEC).options.decode.mla_unit == "mma_sync"  # auto is not the default
    kc, table = latent_cache(batch, cache, ps=64, dense=False, seed=5)
    q = torch.randn(batch, hq, 1, D, device="cuda").bfloat16()
    lens_t = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
    dop = decode_op(op)
    before = set(dop._units)  # (the auto op may be shared with earlier tests)
    p = op.plan_decode(batch=batch, num_heads=hq, num_heads_kv=1, seqlen_q=1, cache_capacity=cache,
                       page_size=64, num_pages=kc.shape[0])  # fmt: skip
    index = torch.cuda.current_device()
    target = "sm_90" if torch.cuda.get_device_capability()[0] == 9 else "sm_80"
    want = family.mla_unit_for_call(
        op.spec, target, op.options.decode, batch=batch, heads_q=hq, heads_kv=1, seqlen_q=1,
        capacity=cache, num_sms=_sm_count(index),
    )  # fmt: skip
    assert p.mla_unit == want and p.options.mla_unit == want
    template = "sm_90/decode_mla.cu.j2" if want == "wgmma" else "sm_80/decode.cu.j2"
    assert p.kernels["attn"].plan.template == template
    if target == "sm_90" and _sm_count(index) == 132:  # the table's device
        assert want == ("mma_sync" if batch == 1 else "wgmma")
    o, lse = op.with_kvcache(q, kc, None, lens_t, block_table=table, plan=p)
    unplanned = op.with_kvcache(q, kc, None, lens_t, block_table=table)  # picks at call time

    def call(q, kc, lens):
        return op.with_kvcache(q, kc, None, lens, block_table=table, num_splits=p.num_splits)

    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")(q, kc, lens_t)
    out = (torch.empty_like(o), torch.empty_like(lse))
    got = op.with_kvcache(q, kc, None, lens_t, block_table=table, plan=p, out=out)
    torch.cuda.synchronize()
    assert got is out
    # the plan, the unplanned and the compiled calls loaded no other unit than the plan's
    assert {dop._units[k]["attn"].plan.template for k in set(dop._units) - before} <= {template}
    for r in (unplanned, compiled, out):
        assert torch.equal(r[0], o) and torch.equal(r[1], lse)
    check(op, q, kc, table, [cache] * batch, o, lse)
