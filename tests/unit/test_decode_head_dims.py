"""Decode for every head dim the prefill supports (issue 23): the head-dim matrix's new
pairs (tests/head_dim_cases.py: 32, 96, 160, 192, (192, 128), (128, 256)) plan and compile
spill-free for sm_80 and sm_90a, padded and ragged units (a covering: 12 nvcc runs, in
parallel), and the CPU op, padded and ragged with an append, equals the float64 reference at
each of them."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import covering  # noqa: E402
from head_dim_cases import NEW_HEAD_DIMS, dims_id, hdim_spec  # noqa: E402

from flashgen.build import cache  # noqa: E402
from flashgen.build.render import render  # noqa: E402
from flashgen.families import decode as family  # noqa: E402
from flashgen.ops.decode.op import decode_reference, decode_reference_ragged  # noqa: E402
from flashgen.ops.op import build_op  # noqa: E402

IDS = [dims_id(d, dv) for d, dv in NEW_HEAD_DIMS]


def _compile(job):
    d, dv, target, ragged = job
    plan = family.plan(hdim_spec(d, dv, "bf16"), target, ragged=ragged)
    _, report = cache.get_or_build(render(plan), plan)
    return job, report


TARGETS = ("sm_80", "sm_90")


def _jobs() -> list[tuple[int, int, str, bool]]:
    """(d, dv, target, ragged) of the nvcc sweep below: pair p's padded (r = 0) and ragged
    (r = 1) units, for target (p + r) % 2, so every head-dim pair builds for both targets and
    each unit form for both (a pairwise covering, 12 nvcc runs, not 24); under ``pytest
    --full-product`` (tests/covering.py) every pair's both units for both targets."""
    if covering.FULL_PRODUCT:
        return [(d, dv, t, r) for d, dv in NEW_HEAD_DIMS for t in TARGETS for r in (False, True)]
    return [(d, dv, TARGETS[(p + r) % 2], bool(r)) for p, (d, dv) in enumerate(NEW_HEAD_DIMS)
            for r in (0, 1)]  # fmt: skip


@pytest.mark.parametrize("full", [False, True], ids=["covering", "full_product"])
def test_the_sweep_takes_every_pair_target_and_unit_or_the_full_product(monkeypatch, full):
    monkeypatch.setattr(covering, "FULL_PRODUCT", full)
    jobs = _jobs()
    assert len(jobs) == len(set(jobs)) == len(NEW_HEAD_DIMS) * (4 if full else 2)
    for d, dv in NEW_HEAD_DIMS:
        mine = [(t, r) for jd, jdv, t, r in jobs if (jd, jdv) == (d, dv)]
        assert {t for t, _ in mine} == set(TARGETS) and {r for _, r in mine} == {False, True}
    assert {(t, r) for *_, t, r in jobs} == {(t, r) for t in TARGETS for r in (False, True)}


def test_decode_units_of_every_head_dim_compile_without_spills(requires_nvcc):
    """The units of :func:`_jobs`.  A decode unit renders the same CUDA for sm_80 and sm_90
    but for the kernels' names; ptxas allocates registers per arch, so in the covering a
    pair's other target is covered by its other unit, not proven for this one (the shipped
    specs build every decode unit for both targets: tests/unit/test_decode_compile.py)."""
    jobs = _jobs()
    workers = int(os.environ.get("FLASHGEN_TEST_JOBS", (os.cpu_count() or 1) + 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(_compile, jobs))
    problems = [f"{job}: {k}" for job, report in results for k in report.kernels
                if k.spill_bytes or not 0 < k.registers <= 255]  # fmt: skip
    assert not problems, "decode kernels spill:\n" + "\n".join(problems)


@pytest.mark.parametrize("d, dv", NEW_HEAD_DIMS, ids=IDS)
def test_cpu_decode_every_head_dim(d, dv):
    """Paged cache (page size 3), GQA 4/2, Sq_new 4 appended (padded) and Sq_b 1 / 0 / 5
    appended (ragged), fp16 and bf16, against the float64 reference."""
    for dtype in ("bf16", "fp16"):
        op = build_op(hdim_spec(d, dv, dtype))
        dt = torch.bfloat16 if dtype == "bf16" else torch.float16
        g = torch.Generator().manual_seed(d + dv)
        lens = torch.tensor([0, 7, 20], dtype=torch.int32)
        kc = torch.randn(30, 3, 2, d, generator=g).to(dt)
        vc = torch.randn(30, 3, 2, dv, generator=g).to(dt)
        table = torch.randperm(30, generator=g)[:27].view(3, 9).to(torch.int32).contiguous()
        q = torch.randn(3, 4, 4, d, generator=g).to(dt)
        kn = torch.randn(3, 2, 4, d, generator=g).to(dt)
        vn = torch.randn(3, 2, 4, dv, generator=g).to(dt)
        k1, v1 = kc.clone(), vc.clone()
        o, lse = op.with_kvcache(q, k1, v1, lens, block_table=table, k_new=kn, v_new=vn)
        assert o.shape == (3, 4, 4, dv)
        ro, rl = decode_reference(op.spec, q, k1, v1, lens + 4, table)
        assert (o.double() - ro).abs().max() <= 2e-2
        fin = torch.isfinite(rl)
        assert torch.equal(torch.isfinite(lse), fin)
        assert (lse.double() - rl)[fin].abs().max() <= 1e-2

        cu = torch.tensor([0, 1, 1, 6], dtype=torch.int32)
        qr = torch.randn(6, 4, d, generator=g).to(dt)
        knr = torch.randn(6, 2, d, generator=g).to(dt)
        vnr = torch.randn(6, 2, dv, generator=g).to(dt)
        k2, v2 = kc.clone(), vc.clone()
        o, lse = op.with_kvcache(qr, k2, v2, lens, block_table=table, k_new=knr, v_new=vnr,
                                 cu_seqlens_q=cu)  # fmt: skip
        assert o.shape == (6, 4, dv) and lse.shape == (4, 6)
        ro, rl = decode_reference_ragged(op.spec, qr, k2, v2, lens + torch.tensor([1, 0, 5]),
                                         cu, table)  # fmt: skip
        assert (o.double() - ro).abs().max() <= 2e-2
        assert (lse.double() - rl).abs().max() <= 1e-2
