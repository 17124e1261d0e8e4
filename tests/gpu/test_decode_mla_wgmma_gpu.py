"""The Hopper MLA decode unit on the device (issue 40 part 3; ``Options.decode.mla_unit=
"wgmma"``, templates/sm_90/decode_mla.cu.j2; ``python -m pytest -q
tests/gpu/test_decode_mla_wgmma_gpu.py``, an sm_90 GPU): specs/mla_decode.yaml with the unit
forced against the float64 reference with V sliced from K, at cache lengths 1, 17, 127, 1000
and 4097 in one batch, dense and paged (page sizes 1, 16, 64), 16, 64 and 128 query heads,
Sq_new 1 and 2 (appended), num_splits 1, 3 and the heuristic's; the mma.sync unit
(``mla_unit="mma_sync"``, forced) within the same bound; empty requests and bad pages (ragged
Sq_new, a planned call in a CUDA graph and ``auto``'s choice: test_decode_mla_gpu.py's tests).
Outputs are poisoned (NaN) before launch, and every cache slot a request does not own holds
NaN, so a read past the live keys or through a wrong page shows in o.  The accuracy rule is
tests/gpu/test_decode_gpu.py's (test_decode_mla_gpu.check: V is the first 512 columns of the
cache, whose NaN slots past the live keys the reference never reads)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_decode_mla_gpu import check  # noqa: E402  (the MLA accuracy rule)

import flashgen  # noqa: E402
from flashgen.families import decode as family  # noqa: E402
from flashgen.ops.decode.op import decode_op  # noqa: E402
from flashgen.ops.op import poison_outputs  # noqa: E402

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "specs" / "mla_decode.yaml"
D, DV = 576, 512
LENS = [1, 17, 127, 1000, 4097]


@pytest.fixture(autouse=True)
def _sm90():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper MLA unit runs on sm_90 (compute capability 9.x)")


def _ops():
    """The op with the Hopper unit and the op with the mma.sync unit (the default), each
    forced (``auto``, opt-in, picks per shape)."""
    return tuple(flashgen.load(SPEC, options=flashgen.Options(decode=family.Options(mla_unit=u)))
                 for u in ("wgmma", "mma_sync"))  # fmt: skip


def latent_cache(lens, cap, *, ps, dense, seed=0):
    """A bf16 latent cache ``[B, 1, cap, 576]`` (dense) or ``[pages, ps, 1, 576]`` through a
    shuffled table, random where a request's keys live and NaN everywhere else (past each
    request's length, and the pages no table entry names)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch = len(lens)
    if dense:
        kc = torch.randn(batch, 1, cap, D, generator=g, device="cuda").bfloat16()
        for b, n in enumerate(lens):
            kc[b, :, n:] = math.nan
        return kc, None
    max_pages = -(-cap // ps)
    num_pages = batch * max_pages + 3
    kc = torch.full((num_pages, ps, 1, D), math.nan, device="cuda").bfloat16()
    table = torch.randperm(num_pages, generator=g, device="cuda")[: batch * max_pages]
    table = table.view(batch, max_pages).int().contiguous()
    pages = torch.cat([table[b, torch.arange(n, device="cuda") // ps] for b, n in enumerate(lens)])
    slots = torch.cat([torch.arange(n, device="cuda") % ps for n in lens])
    kc[pages.long(), slots] = torch.randn(len(slots), 1, D, generator=g, device="cuda").bfloat16()
    return kc, table


def _runs_the_hopper_unit(op):
    dev = torch.device("cuda", torch.cuda.current_device())
    unit = decode_op(op).kernels(dev, op.options.decode)["attn"].plan
    assert unit.template == "sm_90/decode_mla.cu.j2", unit.template


@pytest.mark.parametrize("splits", [None, 1, 3], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("sq", [1, 2], ids=lambda s: f"sq{s}")
@pytest.mark.parametrize("hq", [16, 64, 128], ids=lambda h: f"h{h}")
@pytest.mark.parametrize("ps", [0, 1, 16, 64], ids=lambda p: "dense" if p == 0 else f"paged{p}")
def test_mla_wgmma_against_float64(ps, hq, sq, splits):
    op, _ = _ops()
    _runs_the_hopper_unit(op)
    append = sq > 1
    live = [n + (sq if append else 0) for n in LENS]
    kc, table = latent_cache(live if not append else LENS, max(live) + 5, ps=ps or 1,
                             dense=ps == 0)  # fmt: skip
    q = torch.randn(len(LENS), hq, sq, D, device="cuda").bfloat16()
    kw = dict(block_table=table, num_splits=splits)
    if append:
        kw["k_new"] = torch.randn(len(LENS), 1, sq, D, device="cuda").bfloat16()
    lens = torch.tensor(LENS, dtype=torch.int32, device="cuda")
    with poison_outputs():
        o, lse = op.with_kvcache(q, kc, None, lens, **kw)
    torch.cuda.synchronize()
    check(op, q, kc, table, live, o, lse)


def test_mla_wgmma_agrees_with_the_mma_sync_unit():
    on, off = _ops()
    kc, table = latent_cache(LENS, max(LENS) + 3, ps=16, dense=False, seed=1)
    q = torch.randn(len(LENS), 128, 1, D, device="cuda").bfloat16()
    lens = torch.tensor(LENS, dtype=torch.int32, device="cuda")
    o1, l1 = on.with_kvcache(q, kc, None, lens, block_table=table)
    o0, l0 = off.with_kvcache(q, kc, None, lens, block_table=table)
    torch.cuda.synchronize()
    check(on, q, kc, table, LENS, o1, l1)
    assert (o1.float() - o0.float()).abs().max().item() < 3e-2
    assert torch.allclose(l1, l0, rtol=1e-4, atol=1e-3)


def test_mla_wgmma_empty_and_bad_pages():
    """A request with no keys gives o 0 and lse -inf; table entries outside [0, num_pages)
    are never read (their keys are masked, as the mma.sync unit masks them)."""
    op, _ = _ops()
    lens = [0, 300]
    kc, table = latent_cache(lens, 320, ps=16, dense=False, seed=4)
    table[1, 3] = -1
    table[1, 7] = kc.shape[0] + 5
    q = torch.randn(2, 16, 1, D, device="cuda").bfloat16()
    with poison_outputs():
        o, lse = op.with_kvcache(q, kc, None, torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                 block_table=table, num_splits=2)  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isneginf(lse[0]).all()
    # request 1 without the keys of pages 3 and 7 (16 keys each): the reference on a copy whose
    # table points those pages at zero-length holes is the same as masking them
    keep = torch.ones(300, dtype=torch.bool)
    keep[48:64] = False
    keep[112:128] = False
    pages = [int(table[1, p]) for p in range(-(-300 // 16))]
    rows = torch.stack([kc[pages[k // 16], k % 16, 0] if keep[k] else kc.new_zeros(D)
                        for k in range(300)]).double()  # fmt: skip
    s = q[1, :, 0].double() @ rows.T * op.spec.softmax_scale
    s[:, ~keep] = -math.inf
    ref = torch.softmax(s, -1) @ rows[:, :DV]
    assert (o[1, :, 0].double() - ref).abs().max().item() < 2e-2
    assert torch.allclose(lse[1, :, 0].double(), torch.logsumexp(s, -1), rtol=1e-3, atol=1e-3)
