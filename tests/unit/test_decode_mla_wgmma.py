"""The Hopper MLA decode unit (issue 40 part 3; ``Options.decode.mla_unit="wgmma"``,
templates/sm_90/decode_mla.cu.j2, flashgen.families.decode.plan): which plan the registry
gives with ``wgmma``, ``mma_sync`` and ``auto`` without a call shape (sm_90 only, v_from_k
only, 16-bit caches only: an e4m3 cache falls back to the mma.sync unit's kv8 form; the
option itself and ``auto``'s per-shape rule: test_decode_mla_auto.py), the launch geometry
of 64 packed rows per CTA, the shared memory of the unit, the index maps of
templates/common/mla_decode.cuh run on the host against brute force (the 128-byte swizzle of
the panels, which rows and chunks each loading thread copies, where a key lives in a dense or
paged cache of any page size, the GQA head packing, the wgmma accumulator fragment), the
rendered unit, and (with nvcc) its kernels compiled for sm_90a: no spills, no serialized
wgmma."""

from __future__ import annotations

import dataclasses
import random
import subprocess
from pathlib import Path

import covering
import pytest
from covering import pairwise, uncovered_pairs
from host_cxx import preamble

from flashgen.build.render import render
from flashgen.families import decode as family
from flashgen.families import registry
from flashgen.frontend.spec import load_spec, loads_spec
from flashgen.options import DEFAULT, Options

ROOT = Path(__file__).resolve().parents[2]
SPEC = load_spec(ROOT / "specs" / "mla_decode.yaml")
HEADER = ROOT / "templates" / "common" / "mla_decode.cuh"
ON = Options().replace_path("decode.mla_unit", "wgmma")
#: ``auto`` is opt-in (the default, :data:`DEFAULT`, is ``mma_sync``).
AUTO = Options().replace_path("decode.mla_unit", "auto")
BASE = "name: m\nhead_dim: 576\nhead_dim_v: 512\nv_from_k: true\n"


def _plan(spec=SPEC, target="sm_90", options=ON, **kw):
    return registry.plan_decode(spec, target, options, **kw)


# ----------------------------------------------------------------------------- the option
def test_wgmma_is_a_unit_knob():
    # the op's loaded kernels and the kernel cache key tell the two units apart, and the
    # default options' key is what it was before the option
    assert family.Options(mla_unit="wgmma").unit_key() != family.Options().unit_key()
    assert family.Options().unit_key() == (None, None, None, family.MIN_SPLIT_BLOCKS, True, 4)
    assert ON.family_key("decode") != DEFAULT.family_key("decode")
    assert _plan().options_key != _plan(options=DEFAULT).options_key


def test_with_the_option_on_sm_90_plans_the_hopper_unit():
    for ragged in (False, True):
        p = _plan(ragged=ragged)
        assert p.template == "sm_90/decode_mla.cu.j2"
        assert (p.tiles.block_m, p.tiles.block_n, p.tiles.stages) == (64, 64, 2)
        assert p.tiles.threads == 384 and p.context["mla_wgmma"]
        assert "wgmma" in p.kernel_name and p.kernel_name.endswith("_attn")
        assert ("ragged" in p.kernel_name) == ragged
        assert p.smem_bytes == family.mla_smem_bytes() <= family.SMEM_LIMIT_EXPLICIT["sm_90"]
        assert family.ctas_per_sm(p) == 1
        # the attention kernel takes the mma.sync unit's arguments (the op launches it unchanged)
        assert p.args == _plan(options=DEFAULT, ragged=ragged).args
        assert p.kernel("append").kernel_name == p.kernel_name.replace("_attn", "_append")
        old = _plan(options=DEFAULT, ragged=ragged)
        assert p.kernel("append").args == old.kernel("append").args


@pytest.mark.parametrize(
    "spec,target,cache,why",
    [
        (SPEC, "sm_80", None, "the Hopper MLA unit is sm_90"),
        (SPEC, "sm_90", "fp8_e4m3", "reads a bf16 cache, not fp8_e4m3"),
        (load_spec(ROOT / "specs" / "llama3_gqa.yaml"), "sm_90", None, "has no v_from_k"),
    ],
    ids=["sm_80", "e4m3_cache", "not_v_from_k"],
)  # fmt: skip
def test_where_it_does_not_apply_the_mma_sync_unit_is_planned(spec, target, cache, why):
    assert why in family.mla_wgmma_reason(spec, target, ON.decode, cache)
    on = _plan(spec, target, cache_dtype=cache)
    off = _plan(spec, target, DEFAULT, cache_dtype=cache)
    assert on.template == off.template == "sm_80/decode.cu.j2"
    assert render(on) == render(off)  # the unit itself is today's, byte for byte
    assert why in family.mla_wgmma_support(spec, target, cache)
    assert family.mla_wgmma_reason(SPEC, "sm_90", family.Options(mla_unit="mma_sync")) == (
        "Options.decode.mla_unit is 'mma_sync'"
    )
    assert family.mla_wgmma_reason(SPEC, "sm_90", DEFAULT.decode) == (
        "Options.decode.mla_unit is 'mma_sync'"
    )
    assert family.mla_wgmma_reason(SPEC, "sm_90", AUTO.decode).startswith(
        "Options.decode.mla_unit is 'auto' and no call shape is given"
    )
    assert family.mla_wgmma_reason(SPEC, "sm_90", ON.decode) is None


def test_mma_sync_and_auto_without_a_call_shape_plan_the_mma_sync_unit_unchanged():
    """``auto`` (opt-in) has no call shape in a plan of the registry (``flashgen show``,
    ``build``, ``generate``): the mma.sync unit, as the default was before the option, and
    ``mma_sync`` (forced, or the default) the same unit under the same cache key
    (``options_key``)."""
    forced = Options().replace_path("decode.mla_unit", "mma_sync")
    for target in family.TARGETS:
        for ragged in (False, True):
            off = _plan(target=target, options=AUTO, ragged=ragged)
            assert off.template == "sm_80/decode.cu.j2" and off.tiles.block_m == family.BLOCK_M
            assert not off.context["mla_wgmma"]
            mma = _plan(target=target, options=forced, ragged=ragged)
            assert render(mma) == render(off) and mma.options_key == off.options_key == ""
            default = _plan(target=target, options=DEFAULT, ragged=ragged)
            assert render(default) == render(off) and default.options_key == ""


@pytest.mark.parametrize(
    "heads,sq,m_blocks",
    [(16, 1, 1), (16, 2, 1), (64, 1, 1), (64, 2, 2), (128, 1, 2), (128, 2, 4), (96, 1, 2)],
)
def test_geometry_packs_64_rows_per_cta(heads, sq, m_blocks):
    p = _plan()
    g = family.geometry(p, batch=3, heads_q=heads, heads_kv=1, seqlen_q=sq, num_splits=5)
    assert (g.group, g.rows, g.m_blocks) == (heads, heads * sq, m_blocks)
    assert g.grid == (m_blocks * 5, 1, 3) and g.append_grid == (3 * sq, 1, 1)
    old = family.geometry(_plan(options=DEFAULT), batch=3, heads_q=heads, heads_kv=1,
                          seqlen_q=sq, num_splits=5)  # fmt: skip
    assert old.m_blocks == -(-heads * sq // 16)  # the mma.sync unit: 16 rows per CTA


def test_split_count_sizes_a_wave_of_one_cta_per_sm():
    p = _plan()
    # B1, 128 heads: 2 CTAs without splitting on 132 SMs, so splits fill the wave
    n = family.choose_num_splits(p, batch=1, heads_kv_ctas=1, m_blocks=2, max_seqlen_k=65536,
                                 num_sms=132)  # fmt: skip
    assert n == 66
    # B128 at 16 heads already fills a wave: no split
    assert family.choose_num_splits(p, batch=128, heads_kv_ctas=1, m_blocks=1,
                                    max_seqlen_k=4096, num_sms=132) == 1  # fmt: skip


# ----------------------------------------------------------------------------- rendering
SPECS = {
    "shipped": SPEC,
    "fp16": loads_spec(BASE + "dtype: fp16\nmask: causal\n", "m.yaml"),
    "score_mod": loads_spec(
        BASE + "dtype: bf16\nmask: causal\nscore_mod: 30.0 * tanh(score / 30.0)\n", "m.yaml"
    ),
    "window": loads_spec(
        BASE + "dtype: bf16\nmask: causal && q_idx + seqlen_k - seqlen_q - kv_idx < w\n"
        "params:\n  w: {type: i32, default: 128, min: 1}\n", "m.yaml"),  # fmt: skip
    "sink": loads_spec(BASE + "dtype: bf16\nmask: causal\nsink: sinks[h]\nparams:\n"
                       "  sinks: {type: f32, shape: [num_heads]}\n", "m.yaml"),  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_unit_renders_with_the_decode_features(name):
    spec = SPECS[name]
    for ragged in (False, True):
        for exact in (False, True):
            p = registry.plan_decode(spec, "sm_90", dataclasses.replace(ON, exact_softmax=exact),
                                     ragged=ragged)  # fmt: skip
            src = render(p)
            assert f"{p.base_name}_attn(" in src and f"{p.base_name}_append(" in src
            assert "wgmma.mma_async.sync.aligned.m64n256k16" in src and "Mma::run(" not in src
            assert ("cu_seqlens_q" in src) == ragged
            assert ("fg::dec::merge_stats" in src) == exact
            assert ("fg::dec::sink_share" in src) == (spec.sink is not None)
            assert f"== {p.smem_bytes}," in src  # the template's static_assert of the plan's bytes


# ----------------------------------------------------------------------------- index maps
PROGRAM = r"""
PREAMBLE
#include "HEADER"
int main() {
    char what[16];
    while (scanf("%15s", what) == 1) {
        if (!strcmp(what, "panel")) {  // rows chunks
            int rows, chunks;
            scanf("%d %d", &rows, &chunks);
            for (int r = 0; r < rows; ++r)
                for (int c = 0; c < chunks; ++c) printf("%u\n", fg::mla::panel_offset(r, c, rows));
        } else if (!strcmp(what, "loads")) {  // g t i row chunk, row of the shuffle's source lane
            for (int g = 0; g < 3; ++g)
                for (int t = 0; t < 128; ++t) {
                    const int steps = g == 0 ? fg::mla::LOAD_STEPS_ROPE : fg::mla::LOAD_STEPS_V;
                    for (int i = 0; i < steps; ++i) {
                        const int r = fg::mla::load_row(g, t, i), w = t / 32;
                        printf("%d %d %d %d %d %d\n", g, t, i, r, fg::mla::load_chunk(g, t),
                               fg::mla::page_lane_row(w, r - 16 * w));
                    }
                }
        } else if (!strcmp(what, "keys")) {
            // paged b page_size live num_pages k_sp k_ss cap n_entries, then the entries
            int paged, b, ps, live, num_pages, cap, n;
            long long k_sp, k_ss;
            scanf("%d %d %d %d %d %lld %lld %d %d", &paged, &b, &ps, &live, &num_pages, &k_sp,
                  &k_ss, &cap, &n);
            int table[4096];
            for (int e = 0; e < n; ++e) scanf("%d", &table[e]);
            const fg::Divisor pdiv(ps);
            for (int kv = 0; kv < cap; ++kv) {  // the kernel's page_of, then key_row
                const int pg = paged ? (kv < live ? table[fg::mla::page_entry(kv, pdiv)] : -1) : b;
                const fg::mla::KeyRow k =
                    fg::mla::key_row(kv, live, pg, paged, pdiv, ps, num_pages, k_sp, k_ss);
                printf("%d %lld\n", (int)k.ok, k.off);
            }
        } else if (!strcmp(what, "heads")) {  // ragged group h0 rows b q_start Hq Sq q_sb q_sh q_ss
            int ragged, group, h0, rows, b, q_start, hq, sq;
            long long q_sb, q_sh, q_ss;
            scanf("%d %d %d %d %d %d %d %d %lld %lld %lld", &ragged, &group, &h0, &rows, &b,
                  &q_start, &hq, &sq, &q_sb, &q_sh, &q_ss);
            for (int prow = 0; prow < rows; ++prow) {
                const fg::mla::PackedRow r = fg::mla::packed_row(prow, group, h0);
                printf("%d %d %lld %lld\n", r.s, r.h,
                       fg::mla::q_offset(r, ragged, b, q_start, q_sb, q_sh, q_ss),
                       fg::mla::o_row(r, ragged, b, q_start, hq, sq));
            }
        } else if (!strcmp(what, "acc")) {  // w l j r e row col, m64n256
            for (int w = 0; w < 4; ++w)
                for (int l = 0; l < 32; ++l)
                    for (int j = 0; j < 32; ++j)
                        for (int r = 0; r < 2; ++r)
                            for (int e = 0; e < 2; ++e)
                                printf("%d %d %d %d %d %d %d\n", w, l, j, r, e,
                                       fg::mla::acc_row(w, l, r), fg::mla::acc_col(l, j, e));
        }
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def maps(cxx_exe):
    """``run(text) -> lines``: the index maps of templates/common/mla_decode.cuh, compiled for
    the host (tests/host_cxx.py's preamble: fg::Divisor as the kernels have it)."""
    src = PROGRAM.replace("PREAMBLE", preamble() + "#include <cstring>\n")
    src = src.replace("HEADER", str(HEADER))
    exe = cxx_exe(src, "mla_maps")

    def run(text: str) -> list[str]:
        done = subprocess.run([str(exe)], input=text, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()

    return run


def test_panels_are_the_128_byte_swizzle_that_wgmma_reads(maps):
    """Chunk c of row r of a tile of 64 rows x 72 chunks (a 576-column bf16 row) lands where
    CU_TENSOR_MAP_SWIZZLE_128B puts it: panel c // 8 of [64][128 B], the unswizzled address's
    bits 4..6 XOR its bits 7..9 (each panel 1 KiB aligned), every 16-byte slot once."""
    got = [int(x) for x in maps("panel 64 72\n")]
    want = []
    for r in range(64):
        for c in range(72):
            a = (c // 8) * 64 * 128 + r * 128 + (c % 8) * 16
            want.append(a ^ (((a >> 7) & 7) << 4))
    assert got == want
    assert sorted(got) == list(range(0, 9 * 64 * 128, 16))


def test_each_block_chunk_is_loaded_once_and_every_lane_finds_its_rows_page(maps):
    rows = [tuple(map(int, line.split())) for line in maps("loads\n")]
    seen = [(r, c) for _, _, _, r, c, _ in rows]
    assert sorted(seen) == [(r, c) for r in range(64) for c in range(72)]
    for g, t, _, r, c, src_row in rows:
        assert src_row == r  # the lane the row's page comes from looked up that very row
        assert (c >= 64) == (g == 0) and r // 16 == t // 32  # a warp loads its own 16 rows
        if g:
            assert 32 * (g - 1) <= c < 32 * g  # WG1 / WG2: the V panels they read themselves


def _table(rng, batch, max_pages, num_pages, bad):
    table = [rng.randrange(num_pages) for _ in range(batch * max_pages)]
    for _ in range(bad):  # page indices outside [0, num_pages) must never be read
        table[rng.randrange(len(table))] = rng.choice([-1, num_pages, num_pages + 7, -5])
    return table


@pytest.mark.parametrize("ps", [1, 3, 16, 64, 100])
def test_where_a_key_lives_in_a_paged_cache_of_any_page_size(maps, ps):
    rng = random.Random(ps)
    for trial in range(6):
        max_pages = rng.randrange(1, 40)
        cap = max_pages * ps
        live = rng.randrange(0, cap + 1)
        num_pages = max_pages + rng.randrange(0, 5)
        table = _table(rng, 1, max_pages, num_pages, bad=trial % 3)
        k_sp, k_ss = ps * 576 + rng.randrange(0, 64), 576  # page stride may be padded
        text = f"keys 1 0 {ps} {live} {num_pages} {k_sp} {k_ss} {cap} {len(table)} "
        got = [tuple(map(int, x.split())) for x in maps(text + " ".join(map(str, table)) + "\n")]
        for kv, (ok, off) in enumerate(got):
            page = table[kv // ps]
            want_ok = kv < live and 0 <= page < num_pages
            assert ok == want_ok, (kv, page, live)
            assert off == (page * k_sp + (kv % ps) * k_ss if want_ok else 0)


def test_where_a_key_lives_in_a_dense_cache(maps):
    # dense: the request's own row b of [B, 1, S, 576] (num_pages = batch), slot = kv
    got = [tuple(map(int, x.split())) for x in maps("keys 0 2 37 20 3 21312 576 37 0\n")]
    assert got == [(1, 2 * 21312 + kv * 576) if kv < 20 else (0, 0) for kv in range(37)]
    got = [tuple(map(int, x.split())) for x in maps("keys 0 3 8 8 3 4608 576 8 0\n")]
    assert all(ok == 0 for ok, _ in got)  # b outside [0, num_pages): nothing is read


@pytest.mark.parametrize("heads,sq", [(16, 1), (16, 2), (64, 2), (128, 1), (128, 2), (24, 3)])
def test_head_packing_covers_every_query_row_once(maps, heads, sq):
    """Every (request, query head, new token) is one packed row of one CTA (64 rows each),
    whose q offset and output row are the layout's, padded q [B, Hq, Sq, 576] (strided) and
    ragged q [total_q, Hq, 576]."""
    batch, hkv = 2, 1
    group = heads // hkv
    q_sb, q_sh, q_ss = heads * sq * 640, 640, heads * 640  # a strided view: [B, Sq, Hq, 640]
    m_blocks = -(-group * sq // family.MLA_BLOCK_M)
    seen = {}
    for b in range(batch):
        for m in range(m_blocks):
            rows = min(family.MLA_BLOCK_M, group * sq - m * family.MLA_BLOCK_M)
            text = f"heads 0 {group} 0 {group * sq} {b} 0 {heads} {sq} {q_sb} {q_sh} {q_ss}\n"
            lines = maps(text)[m * family.MLA_BLOCK_M : m * family.MLA_BLOCK_M + rows]
            for line in lines:
                s, h, qo, orow = map(int, line.split())
                assert qo == b * q_sb + h * q_sh + s * q_ss
                assert orow == (b * heads + h) * sq + s
                seen[(b, h, s)] = seen.get((b, h, s), 0) + 1
    assert seen == {(b, h, s): 1 for b in range(batch) for h in range(heads) for s in range(sq)}
    # ragged: request b's tokens start at q_start in q [total_q, Hq, 576]
    lines = maps(f"heads 1 {group} 0 {group * sq} 1 5 {heads} {sq} 0 576 {heads * 576}\n")
    for prow, line in enumerate(lines):
        s, h, qo, orow = map(int, line.split())
        assert (s, h) == (prow // group, prow % group)
        assert qo == (5 + s) * heads * 576 + h * 576 and orow == (5 + s) * heads + h


def test_the_accumulator_fragment_covers_the_tile_once(maps):
    got = [tuple(map(int, x.split())) for x in maps("acc\n")]
    cells = sorted((row, col) for *_, row, col in got)
    assert cells == [(r, c) for r in range(64) for c in range(256)]
    for w, lane, j, r, e, row, col in got:  # PTX ISA's wgmma D fragment, m64nNk16
        assert (row, col) == (16 * w + lane // 4 + 8 * r, 8 * j + 2 * (lane % 4) + e)


# ----------------------------------------------------------------------------- compiled
SOFTCAP = "30.0 * tanh(score / 30.0)"
WINDOW = "causal && q_idx + seqlen_k - seqlen_q - kv_idx < w"
#: what the nvcc test varies: dtype, score_mod, mask, ragged Sq_new
FACTORS = (("bf16", "fp16"), (None, SOFTCAP), ("causal", WINDOW), (False, True))


def _variant(dtype, score_mod, mask):
    """The shipped spec (bf16, causal, no score_mod) or one like it with ``dtype``,
    ``score_mod`` and ``mask`` (the window's width a param)."""
    if (dtype, score_mod, mask) == ("bf16", None, "causal"):
        return SPEC
    text = BASE + f"dtype: {dtype}\nmask: {mask}\n"
    if score_mod is not None:
        text += f"score_mod: {score_mod}\n"
    if mask == WINDOW:
        text += "params:\n  w: {type: i32, default: 128, min: 1}\n"
    return loads_spec(text, "m.yaml")


def _compile(job):
    from flashgen.build import cache

    *variant, ragged = job
    p = registry.plan_decode(_variant(*variant), "sm_90", ON, ragged=ragged)
    _, report = cache.get_or_build(render(p), p)
    return job, p, report


def test_the_nvcc_jobs_cover_every_pair_of_factor_values():
    jobs = pairwise(*FACTORS)
    assert not uncovered_pairs(jobs, *FACTORS)
    assert ("bf16", None, "causal", False) in jobs  # the shipped spec
    assert len(jobs) < 2 ** len(FACTORS) or covering.FULL_PRODUCT
    for dtype, score_mod, mask, _ in jobs:
        spec = _variant(dtype, score_mod, mask)
        assert (spec.dtype, spec.score_mod is not None) == (dtype, score_mod is not None)
        assert ([q.name for q in spec.params] == ["w"]) == (mask == WINDOW)


def test_the_unit_compiles_for_sm_90a_without_spills_or_serialized_wgmma(requires_nvcc):
    """Both kernels of the units of a pairwise covering (tests/covering.py) of dtype (bf16,
    fp16) x score_mod (none, softcap) x mask (causal, a window) x Sq_new (padded, ragged):
    6 units, not the 16 of the product (nor the 8 of the shipped spec and one variant per
    feature, each padded and ragged, before): every value of each and every pair of values
    of two (the shipped spec's padded unit among them; query heads and Sq_new are launch
    values: one cubin serves 16, 64 and 128 heads, Sq_new 1 and 2): no spill, and ptxas kept
    the wgmmas asynchronous."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_compile, pairwise(*FACTORS)))
    problems = []
    for job, p, report in results:
        assert {k.name for k in report.kernels} == {p.kernel_name, p.kernel("append").kernel_name}
        attn = report.kernel(p.kernel_name)
        assert 0 < attn.registers <= 168  # 384 threads, one CTA per SM
        for k in report.kernels:
            if k.spill_bytes or k.wgmma_serialized:
                problems.append(f"{job}: {k}")
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- the benchmark
@pytest.fixture
def no_cuda(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("argv, message", [
    (["--mla", "--fp8"], "--mla times its own three variants; it takes no --fp8"),
    (["--mla", "--option", "decode.stages=4"], "it takes no --option"),
    (["--mla", "--sweep"], "it takes no --sweep"),
    (["--mla-heads", "16"], "--mla-heads and --mla-sq go with --mla"),
    (["--mla", "--mla-heads", "0"], "mla-heads: expected comma-separated positive ints"),
])  # fmt: skip
def test_bench_mla_refuses_bad_arguments_before_the_cuda_check(no_cuda, capsys, argv, message):
    from flashgen.bench.decode import main

    with pytest.raises(SystemExit) as e:
        main(argv, prog="flashgen bench --decode")
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err


def test_bench_mla_parses_and_counts_bytes_and_flops(no_cuda, capsys):
    from flashgen.bench import decode as bench
    from flashgen.cli.commands import main

    argv = ["bench", "--decode", "--mla", "--mla-heads", "16,128", "--mla-sq", "1,2",
            "--layouts", "paged1,paged64", "--batch", "2", "--cache", "1000"]  # fmt: skip
    assert main(argv) == 1 and "needs a CUDA device" in capsys.readouterr().err
    assert bench.mla_bytes(2, 1000) == 2 * 1000 * 576 * 2
    assert bench.mla_flops(2, 128, 2, 1000) == 2 * 2 * 128 * 2 * 1000 * (576 + 512)
    rows = [{"method": f"mla_paged64_{v}", "heads_q": h, "copy_fraction": c, "matmul_fraction": m}
            for v, h, c, m in (("wgmma", 16, 0.9, 0.1), ("wgmma", 128, 0.5, 0.7),
                               ("mma_sync", 16, 0.4, 0.05))]  # fmt: skip
    text = "\n".join(bench.mla_summary(rows))
    assert "wgmma: 16 heads 90% of the copy ceiling (target 85%)" in text
    assert "wgmma: 128 heads 70% of the matmul ceiling (target 65%)" in text
    assert "mma_sync: no 128-head row" in text


def test_a_call_the_hopper_unit_cannot_serve_is_told_so():
    """With ``wgmma`` asked for, an e4m3 cache (or another target) runs the mma.sync unit, and
    the op warns once per unit it loads (``DecodeOp.kernels``) with this message; a spec
    without ``v_from_k``, ``auto`` (which picks the mma.sync unit there) or ``mma_sync`` says
    nothing."""
    why = family.mla_wgmma_fallback(SPEC, "sm_90", ON.decode, "fp8_e4m3")
    assert why.startswith("Options.decode.mla_unit='wgmma': the Hopper MLA unit reads a bf16 "
                          "cache")  # fmt: skip
    assert why.endswith("these calls run the mma.sync decode unit")
    on_sm80 = family.mla_wgmma_fallback(SPEC, "sm_80", ON.decode)
    assert "is sm_90 (wgmma), the target is sm_80" in on_sm80
    assert family.mla_wgmma_fallback(SPEC, "sm_90", ON.decode) is None
    assert family.mla_wgmma_fallback(SPEC, "sm_90", AUTO.decode, "fp8_e4m3") is None
    assert family.mla_wgmma_fallback(SPEC, "sm_80", AUTO.decode) is None  # auto: no warning
    assert family.mla_wgmma_fallback(SPEC, "sm_90", DEFAULT.decode, "fp8_e4m3") is None
    assert family.mla_wgmma_fallback(SPEC, "sm_80", DEFAULT.decode) is None  # the default
    llama = load_spec(ROOT / "specs" / "llama3_gqa.yaml")
    assert family.mla_wgmma_fallback(llama, "sm_90", ON.decode) is None
    assert _plan().config()["mla_unit"] == "wgmma"
    assert "mla_unit" not in _plan(options=DEFAULT).config()
    assert "mla_unit" not in _plan(options=AUTO).config()
