"""FA2-class forward switches that a tuning-table entry selects with its tiles (needs a GPU:
``pytest -m gpu``): ``fwd_even_loads`` (unpredicated loads of whole tiles), ``fwd_row_chunks``
(FA2's copy layout: 16-byte chunks 128 bytes apart in a row per thread) and
``fwd_unrolled_loads`` off, at head_dim 256 on tiles a tuning-table entry may hold
(128x64x8, 64x48x4, and FA2's own 64x64x4 on H100/H200).

Each case writes a temporary table (``$FLASHGEN_TUNING_TABLE``) with the device's key, so
the op plans the entry's tiles and switches itself (``plan_forward`` with the GPU
name), then compares with the float64 reference (tests/gpu/test_forward.py's ``check``):
lengths that end mid-tile and on a tile boundary, Sq != Sk, GQA, (B, S, H, D) views.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_options  # noqa: E402
from plan_helpers import plan_forward  # noqa: E402
from test_forward import check, shipped, variant  # noqa: E402

from flashgen import tuning  # noqa: E402
from flashgen.codegen.cuda_expr import split_causal  # noqa: E402
from flashgen.codegen.plan import TileConfig  # noqa: E402
from flashgen.families.build import build_forward  # noqa: E402
from flashgen.ops.op import target_for_device  # noqa: E402

pytestmark = pytest.mark.gpu

#: name -> (tiles, switches) of a table entry.
ENTRIES = {
    "even": (TileConfig(128, 64, 8), {"fwd_even_loads": True}),
    "even48": (TileConfig(64, 48, 4), {"fwd_even_loads": True}),
    "rolled": (TileConfig(64, 64, 4), {"fwd_unrolled_loads": False}),
    "rows": (TileConfig(64, 64, 4), {"fwd_row_chunks": True, "fwd_even_loads": False}),  # H200's
    "rows_even": (TileConfig(64, 64, 4), {"fwd_row_chunks": True, "fwd_even_loads": True}),
    "rows48": (TileConfig(64, 48, 4), {"fwd_row_chunks": True, "fwd_even_loads": False}),
    "rows8w": (TileConfig(128, 64, 8), {"fwd_row_chunks": True, "fwd_even_loads": False}),
}


@pytest.fixture(autouse=True)
def fa2_family(monkeypatch):
    """Ops bound to ``Options(family="fa2")`` (:mod:`gpu_options`)."""
    gpu_options.use(monkeypatch, family="fa2")


def tabled(entry: str, tmp_path, monkeypatch, *, dtype=None, causal=None):
    """bidir_d256 (renamed per entry) with a table that gives its key ``ENTRIES[entry]``."""
    spec = variant(shipped("bidir_d256"), dtype=dtype, causal=causal)
    spec = dataclasses.replace(spec, name=f"{spec.name}_tab_{entry}")
    tiles, opts = ENTRIES[entry]
    dev = torch.device("cuda")
    gpu, target = torch.cuda.get_device_name(dev), target_for_device(spec, dev)
    key = tuning.table_key(gpu, target, 256, spec.dtype, split_causal(spec.mask)[0], False)
    path = tmp_path / "table.json"
    tuning.update_table(
        key,
        {"block_m": tiles.block_m, "block_n": tiles.block_n, "num_warps": tiles.num_warps,
         "options": opts},
        path,
    )  # fmt: skip
    monkeypatch.setenv(tuning.ENV, str(path))
    plan = plan_forward(spec, target, gpu=gpu, family="fa2")
    assert plan.tiles == tiles and plan.template == "sm_80/fwd.cu.j2"
    assert all(plan.context[k] == v for k, v in opts.items())
    return spec


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_entry_compiles_spill_free(entry, tmp_path, monkeypatch):
    spec = tabled(entry, tmp_path, monkeypatch)
    dev = torch.device("cuda")
    plan, _, report = build_forward(
        spec, target_for_device(spec, dev), gpu=torch.cuda.get_device_name(dev),
        options=gpu_options.CURRENT,
    )  # fmt: skip
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
    "sq, sk", [(1, 1), (17, 1000), (1000, 17), (128, 256), (127, 4097), (4097, 127)]
)
def test_lengths_and_gqa(entry, sq, sk, tmp_path, monkeypatch, error_bound):
    spec = tabled(entry, tmp_path, monkeypatch, causal=sq % 2 == 1)
    check(spec, 1, 8, 2, sq, sk, error_bound, seed=sq + sk)


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_bshd_views(entry, tmp_path, monkeypatch, error_bound):
    check(tabled(entry, tmp_path, monkeypatch), 2, 4, 4, 333, 640, error_bound, bshd=True)
