"""The FA2-class forward with ``fwd_split_o`` (warp pairs splitting S's keys and O's columns)
and ``fwd_q_regs`` (Q's fragments in registers), as tuning-table entries select them at
head_dim 256 (needs a GPU: ``pytest -m gpu``).

Each case writes a temporary table (``$FLASHGEN_TUNING_TABLE``) with the device's key, so
the op plans the entry's tiles and switches itself (``lower.plan_forward`` with the GPU
name), then compares with the float64 reference (tests/gpu/test_forward.py's ``check``):
lengths that end mid-tile and on a tile boundary (a pair's key half wholly past seqlen_k,
rows with nothing to attend to under causal Sq > Sk), Sq != Sk, GQA, (B, S, H, D) views,
the mask / score_mod kinds the split touches (residual mask, block table with row and
column terms, soft-capping), and packed varlen sequences (the table's key has no varlen
field: an entry applies to a spec's varlen form too).  The entries cover one row tile per
warp pair (MT = 1) and two (MT = 2), BLOCK_N 64 and 32 (sP rows of 128 and 64 bytes: both
swizzle forms), and tile loads with and without a whole number of rows per thread pass.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_forward import check, shipped, variant  # noqa: E402
from test_varlen_gpu import MIXED, bound, make_inputs  # noqa: E402

from flashgen import lower, select, tuning  # noqa: E402
from flashgen.lower import TileConfig, split_causal  # noqa: E402
from flashgen.op import build_op, poison_outputs, target_for_device  # noqa: E402
from flashgen.reference import attention_reference_varlen  # noqa: E402
from flashgen.spec import loads_spec  # noqa: E402

pytestmark = pytest.mark.gpu

SPLIT = {"fwd_split_o": True, "fwd_even_loads": True}
SPLIT_Q = {**SPLIT, "fwd_q_regs": True}
#: name -> (tiles, switches) of a table entry (threads: 64 per warp of the tiles).
ENTRIES = {
    "split": (TileConfig(64, 64, 4), SPLIT),
    "split_q": (TileConfig(64, 64, 4), SPLIT_Q),
    "split48": (TileConfig(48, 64, 3), SPLIT),  # 192 threads: the generic K/V load loop
    "split32_q": (TileConfig(32, 32, 2), SPLIT_Q),  # sP rows of 64 bytes
    "split_mt2": (TileConfig(64, 32, 2), SPLIT),  # 32 rows per pair
}

DOC = """name: split_doc256
head_dim: 256
dtype: bf16
mask: causal && doc_q[b, q_idx] == doc_kv[b, kv_idx]
params:
  doc_q: {type: i32, shape: [batch, seqlen_q]}
  doc_kv: {type: i32, shape: [batch, seqlen_k]}
"""


@pytest.fixture(autouse=True)
def fa2_family(monkeypatch):
    monkeypatch.setenv("FLASHGEN_KERNEL_FAMILY", "fa2")


def tabled(entry: str, tmp_path, monkeypatch, *, spec=None, dtype=None, causal=None):
    """``spec`` (default bidir_d256; renamed per entry) with a table that gives its key
    ``ENTRIES[entry]``."""
    spec = variant(spec or shipped("bidir_d256"), dtype=dtype, causal=causal)
    spec = dataclasses.replace(spec, name=f"{spec.name}_tab_{entry}")
    tiles, opts = ENTRIES[entry]
    dev = torch.device("cuda")
    gpu, target = torch.cuda.get_device_name(dev), target_for_device(spec, dev)
    d = max(spec.head_dim, spec.head_dim_v)
    key = tuning.table_key(
        gpu, target, d, spec.dtype, split_causal(spec.mask)[0], spec.score_mod is not None
    )
    path = tmp_path / "table.json"
    tuning.update_table(
        key,
        {"block_m": tiles.block_m, "block_n": tiles.block_n, "num_warps": tiles.num_warps,
         "options": opts},
        path,
    )  # fmt: skip
    monkeypatch.setenv(tuning.ENV, str(path))
    plan = lower.plan_forward(spec, target, gpu=gpu, family="fa2")
    assert plan.tiles == tiles and plan.template == "sm_80/fwd.cu.j2"
    assert all(plan.context[k] == v for k, v in opts.items())
    assert plan.threads == 2 * tiles.threads
    return spec


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_entry_compiles_spill_free(entry, tmp_path, monkeypatch):
    spec = tabled(entry, tmp_path, monkeypatch)
    dev = torch.device("cuda")
    plan, _, report = select.build_forward(
        spec, target_for_device(spec, dev), gpu=torch.cuda.get_device_name(dev), family="fa2"
    )
    tiles, opts = ENTRIES[entry]
    assert plan.tiles == tiles and all(plan.context[k] == v for k, v in opts.items())
    assert report.spill_bytes == 0, f"{entry}: {plan.tiles} spills {report.spill_bytes} B"


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [True, False])
def test_dtype_and_causal(entry, dtype, causal, tmp_path, monkeypatch, error_bound):
    spec = tabled(entry, tmp_path, monkeypatch, dtype=dtype, causal=causal)
    check(spec, 2, 4, 2, 1000, 1000, error_bound)


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize(
    "sq, sk", [(1, 1), (17, 1000), (1000, 17), (128, 256), (127, 4097), (4097, 127), (40, 33)]
)
def test_lengths_and_gqa(entry, sq, sk, tmp_path, monkeypatch, error_bound):
    spec = tabled(entry, tmp_path, monkeypatch, causal=sq % 2 == 1 or sq > sk)
    check(spec, 1, 8, 2, sq, sk, error_bound, seed=sq + sk)


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_bshd_views(entry, tmp_path, monkeypatch, error_bound):
    check(tabled(entry, tmp_path, monkeypatch), 2, 4, 4, 333, 640, error_bound, bshd=True)


@pytest.mark.parametrize("entry", ["split", "split_q", "split32_q"])
@pytest.mark.parametrize("kind", ["window", "doc", "softcap"])
def test_masks_and_score_mods(entry, kind, tmp_path, monkeypatch, error_bound):
    """Masked tiles (kv_idx of this warp's key half), the block table with row / column
    terms, and a score_mod (gemma2_softcap) under the split."""
    if kind == "window":
        base = loads_spec(
            "name: split_swa256\nhead_dim: 256\ndtype: bf16\nmask: causal && q_idx - kv_idx < 300\n"
        )
    elif kind == "doc":
        base = loads_spec(DOC)
    else:
        base = shipped("gemma2_softcap")
    spec = tabled(entry, tmp_path, monkeypatch, spec=base)
    check(spec, 2, 4, 2, 777, 1037, error_bound, seed=7)
    check(spec, 1, 4, 4, 1037, 777, error_bound, seed=8)


@pytest.mark.parametrize("entry", ["split", "split_q", "split48"])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen(entry, causal, tmp_path, monkeypatch):
    """The varlen form of a tabled spec (per-sequence lengths 0..1000, Sq != Sk) against the
    per-sequence float64 reference, as tests/gpu/test_varlen_gpu.py checks it."""
    op = build_op(tabled(entry, tmp_path, monkeypatch, causal=causal)).varlen
    spec = op.spec
    q, k, v, cq, ck, params = make_inputs(spec, MIXED, 4, 2, seed=5)
    mq, mk = max(a for a, _ in MIXED), max(b for _, b in MIXED)
    with poison_outputs():
        o, lse = op(q, k, v, cq, ck, mq, mk, **params)
    torch.cuda.synchronize()
    assert not o.isnan().any() and not lse.isnan().any(), "an element was not written"
    ref_o, ref_lse = attention_reference_varlen(spec, q, k, v, cq, ck, params=params)
    low_o, _ = attention_reference_varlen(
        spec, q, k, v, cq, ck, params=params, compute_dtype=q.dtype
    )
    err = (o.double() - ref_o).abs().max().item()
    b = bound((low_o.double() - ref_o).abs().max().item())
    assert err <= b, f"{spec.name}: o error {err:.3e} > {b:.3e}"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "rows with nothing to attend to differ"
    fin = ~empty
    lse_err = ((lse[fin] - ref_lse[fin]).abs() / (1 + ref_lse[fin].abs())).max().item()
    assert lse_err <= 1e-2, f"lse off by {lse_err:.3e} (relative)"
