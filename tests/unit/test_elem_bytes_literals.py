"""The element size is data: the templates whose byte constants follow the dtype record
(``ELEM_BYTES = sizeof(elem_t)``, ``CHUNK_ELEMS = 16 / ELEM_BYTES``, the Hopper backward's
``BOX_COLS`` and ``KSTEP_BYTES``) must not grow a bytes-per-element literal back, and the
families' planning must size shared memory from ``DType.elem_bytes``.

The rules below match the forms the element size 2 took in these templates (an element
count times 2 as bytes, chunk <-> element conversions by 8, the byte offset of a lane's
element pair, a k16 step as 32 bytes, a 128-byte row as 64 columns); each is checked on
sample lines so it neither misses the old form nor flags the mma fragment geometry
(``kk * 2`` chunks, ``(lane % 4) * 2`` columns), stage counts or fp32 sizes.  Comments are
not scanned."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: The templates whose byte constants are derived from the element type.
TEMPLATES = (
    "templates/sm_80/fwd.cu.j2",
    "templates/sm_80/bwd.cu.j2",
    "templates/sm_90/bwd.cu.j2",
    "templates/sm_80/blockmask.cu.j2",
    "templates/common/mma_sm80.cuh",
    "templates/common/sm90_bwd.cuh",
)

_COUNT = r"(?:HEAD_DIM(?:_V)?|COLS|ROWS|BLOCK_[MN]|KV_[MN]|DQ_[MN]|D[KV]_COLS|QW|DW)"

#: (name, pattern): each flags one way of writing "2 bytes per element" or "8 elements per
#: 16-byte chunk" as a literal.
RULES: tuple[tuple[str, re.Pattern], ...] = (
    ("element count * 2 as bytes", re.compile(rf"\b{_COUNT}\s*\*\s*2\b(?!\s*\*)")),
    ("2 * element count as bytes", re.compile(r"\b2\s*\*\s*(?:HEAD_DIM(?:_V)?|COLS)\b")),
    (
        "a byte constant scaled by 2",
        re.compile(r"constexpr\s+\w+\s+\w*BYTES\w*\s*=[^;]*(?:\*\s*2\b|\b2\s*\*)"),
    ),
    ("chunks * 8 as elements", re.compile(r"\bchunk\w*\s*\*\s*8\b")),
    ("elements / 8 as chunks", re.compile(r"\w*CHUNKS\w*\s*=[^;]*/\s*8\b")),
    (
        "columns / 8 as a chunk index",
        re.compile(r"\b(?:split|cg)\s*\*\s*\(\s*\w+\s*/\s*8\s*\)|\bcol0\s*/\s*8\b"),
    ),
    ("a lane's element pair as 4 bytes", re.compile(r"\((?:lane|ql)\s*%\s*4\)\s*\*\s*4\b")),
    ("a k16 step as 32 bytes", re.compile(r"\bkk(?:\s*%\s*\d+\))?\s*\*\s*32u?\b")),
    ("a 16-element step as 64 elements", re.compile(r"\bj\s*\*\s*64\b")),
    (
        "a 128-byte row as 64 columns",
        re.compile(r"\bc\s*\*\s*64\b|\b(?:HEAD_DIM|DW)\s*/\s*64\b"),
    ),
)

#: Lines of the templates before the element size became data: every rule flags one.
OLD_FORMS = (
    "constexpr int Q_ROW_BYTES = HEAD_DIM * 2;",
    "constexpr int SQ_BYTES = BLOCK_M * (HEAD_DIM > HEAD_DIM_V ? HEAD_DIM : HEAD_DIM_V) * 2;",
    "static_assert(SQ_BYTES + SK_BYTES + BLOCK_N * HEAD_DIM_V * 2 + TAB_BYTES == 5,",
    "constexpr uint32_t SDS_BYTES = BLOCK_N * BLOCK_M * 2;",
    "constexpr int DS_ROW_BYTES = KV_M * 2 + 16;",
    "constexpr int X_BYTES = {{ head_dim * 2 }};",
    "const uint32_t d0 = dst + fg::swz(row0, chunk0, COLS * 2);",
    "const elem_t* g = src + row0 * stride + chunk0 * 8;",
    "constexpr int CHUNKS_PER_ROW = COLS / 8;",
    "constexpr int O_CHUNKS_PER_ROW = HEAD_DIM_V / 8;",
    "gemm_pb<NT, DV_COLS / 8>(acc_dv, acc_s, sDO, split * (DV_COLS / 8), V_ROW_BYTES, lane);",
    "gemm_dq<AQ_ROWS / 16, AQ_COLS / 8>(acc_dq, sDS, wm * AQ_ROWS, sK, col0 / 8, ql);",
    "const int chunk = cg * (QW / 8) + 2 * kk + t / 2;",
    "const uint32_t addr = sQ + fg::swz(row, dt, V_ROW_BYTES) + (lane % 4) * 4;",
    "const uint32_t sds_lane = sDS + (warp * 16 + ql / 4) * DS_ROW_BYTES + (ql % 4) * 4;",
    "const uint32_t at = sds_lane + kk * 32;",
    "const uint32_t col = (kk / 4) * 128u, sub = (kk % 4) * 32u;",
    "fg::cp_async_16(d0 + it * ROW_STEP * ROW_BYTES + j * 128, g + j * 64, true);",
    "fg::tma_load_4d(sK + c * BLOCK_N * 128, &tma_k, c * 64, n0, h_kv, b, kv_full);",
    "constexpr int DCB = HEAD_DIM / 64;",
    "const uint32_t cb = cg * (DW / 64);",
)

#: Lines that stay: mma fragment geometry, stage counts, fp32 sizes, key counts.
KEPT_FORMS = (
    "fg::ldmatrix_x4(a[mt], sQ_lane + swz_at<Q_ROW_BYTES>(q_off, q_r, q_c, mt * 16, kk * 2));",
    "const int kv_raw = n0 + nt * 8 + (lane % 4) * 2 + (i % 2);",
    "constexpr int DT = HEAD_DIM_V / 8;",
    "gemm_pb<NT, DV_COLS / 8>(acc_dv, acc_s, sDO, split * (DV_COLS / CHUNK_ELEMS), V_ROW_BYTES);",
    "static_assert(KV_N * (QK_ROW_BYTES + V_ROW_BYTES) + 2 * STAGE_BYTES + 4 * KV_M * 4 == 1,",
    "fg::cp_async_4(sStats + ((t / BLOCK_M) * 2 * BLOCK_M + st * BLOCK_M + row) * 4, src, v);",
    "const float* sDsum = sLse + 2 * BLOCK_M;",
    "constexpr int QW = BLOCK_M / 2;",
    "const int col0 = cg * DW + (lane % 4 / 2) * 4;",
    "const int kw0 = n0 + cg * 64;",
    "const uint32_t at = sDS + (warp * 16 + ql / 4) * DS_ROW_BYTES + (ql % 4) * 2 * ELEM_BYTES;",
    "const int chunk = warp * 2 + (lane / 8) % 2;",
    "for (int c = lane * 2; c < HEAD_DIM_V; c += 64)",
    "fg::wgmma_rs_n64(acc_dq, ds_a[kk], fg::gmma_desc(sK_dq + (dq_key0 + kk * 16) * 128, 1, 2));",
)


def flagged(line: str) -> list[str]:
    """The names of the rules ``line`` breaks."""
    return [name for name, pat in RULES if pat.search(line)]


def code_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, code)`` of a template: Jinja comments and ``//`` comments blanked."""
    text = re.sub(r"\{#.*?#\}", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return [(i, line.split("//", 1)[0]) for i, line in enumerate(text.splitlines(), 1)]


@pytest.mark.parametrize("line", OLD_FORMS)
def test_rules_flag_the_old_forms(line):
    assert flagged(line), line


@pytest.mark.parametrize("line", KEPT_FORMS)
def test_rules_keep_fragment_geometry_and_counts(line):
    assert not flagged(line), (line, flagged(line))


@pytest.mark.parametrize("path", TEMPLATES)
def test_templates_have_no_bytes_per_element_literal(path):
    bad = [
        f"{path}:{n}: {', '.join(flagged(code))}: {code.strip()}"
        for n, code in code_lines((ROOT / path).read_text())
        if flagged(code)
    ]
    assert not bad, "element size as a literal (use ELEM_BYTES / CHUNK_ELEMS):\n" + "\n".join(bad)


def test_planned_shared_memory_follows_elem_bytes(monkeypatch):
    """Each family's shared memory is linear in the dtype record's ``elem_bytes`` (with the
    fp32 stats, barriers and alignment as the constant part): a 1-byte record gives exactly
    the elem-proportional part less than the 2-byte one, a 3-byte record as much more."""
    from flashgen.codegen import dtypes
    from flashgen.families import fa2_bwd, fa2_fwd, hopper_bwd
    from flashgen.frontend.spec import load_spec

    spec = load_spec(ROOT / "specs" / "causal_d128.yaml")
    rec = dtypes.DTYPES[spec.dtype]
    monkeypatch.setattr(hopper_bwd, "HOPPER_SMEM_LIMIT", 1 << 30)  # 3-byte elements do not fit

    def smem(elem_bytes: int) -> tuple[int, ...]:
        monkeypatch.setitem(dtypes.DTYPES, spec.dtype, replace(rec, elem_bytes=elem_bytes))
        tiles = fa2_fwd.plan(spec, "sm_80").tiles  # the same tiles at every size
        bwd = fa2_bwd.plan(spec, "sm_80")
        atomic = fa2_bwd.plan(spec, "sm_80", atomic_dq=True)
        return (
            fa2_fwd.plan(spec, "sm_80", tiles=tiles).smem_bytes,
            bwd.dkdv.smem_bytes,
            bwd.dq.smem_bytes,
            atomic.dkdv.smem_bytes,
            hopper_bwd.plan(spec, "sm_90").dkdv.smem_bytes,
        )

    one, two, three = smem(1), smem(2), smem(3)
    for a, b, c in zip(one, two, three, strict=True):
        assert a < b < c and b - a == c - b, (one, two, three)


def test_16bit_families_refuse_other_dtypes():
    """The FA2-class families and the Hopper backward take 16-bit dtypes only: an fp8 spec
    gets a ValueError naming the family at planning, not a kernel that fails to compile."""
    from flashgen.families import fa2_bwd, fa2_fwd, hopper_bwd
    from flashgen.frontend.spec import load_spec

    spec = replace(load_spec(ROOT / "specs" / "causal_d128.yaml"), dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="FA2-class forward takes fp16, bf16"):
        fa2_fwd.plan(spec, "sm_80")
    with pytest.raises(ValueError, match="FA2-class backward takes fp16, bf16"):
        fa2_bwd.plan(spec, "sm_90")
    assert not hopper_bwd.eligible(spec, "sm_90")
    assert hopper_bwd.eligible(replace(spec, dtype="fp16"), "sm_90")
