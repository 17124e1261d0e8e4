"""The persistent Hopper forward (``plan_hopper_forward(persistent=True)``): plan and grid,
the work-tile order, rendering, and (with nvcc) every shipped spec compiling to TMA + wgmma
code with zero spills.  Numerics on the GPU: tests/gpu/test_persistent_gpu.py."""

from __future__ import annotations

import concurrent.futures as cf
import itertools
from pathlib import Path

import pytest
from plan_helpers import plan_forward, plan_hopper_forward
from sass_helpers import sass, wgmmas
from shipped_specs import distinct_code

from flashgen.build.render import render
from flashgen.families.common import (
    GRID_GROUPS_MAX,
    HOPPER_SMEM_LIMIT,
    PERSISTENT_SCHEDULERS,
    grid_tile_coord,
    grouped_grid,
    head_group,
    tile_coord,
)
from flashgen.families.hopper_fwd import (
    HOPPER_PERSISTENT_REGS,
    HOPPER_REGS,
    persistent_tile_order,
)
from flashgen.frontend.spec import load_spec, loads_spec

REPO = Path(__file__).resolve().parents[2]
# (fp8 specs have no persistent kernel: tests/unit/test_fp8_compile.py covers them)
# (v_from_k specs are decode only: no prefill kernel)
SPECS = sorted(
    p for p in (REPO / "specs").glob("*.yaml")
    if "fp8" not in load_spec(p).dtype and not load_spec(p).v_from_k
)  # fmt: skip
#: those the nvcc tests compile: one spec per kernel code (tests/shipped_specs.py)
COMPILED = distinct_code(SPECS)


def _variant(name: str, head_dim: int):
    text = (REPO / "specs" / f"{name}.yaml").read_text()
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    return loads_spec(
        text.replace(f"head_dim: {spec.head_dim}", f"head_dim: {head_dim}"), f"{name}.yaml"
    )


#: Specs the spill test compiles: the shipped ones plus head-dim variants that take other
#: tiles (document_mask's block table at d64 / d256, a score_mod at d64, causal d256).
VARIANTS = [("document_mask", 64), ("document_mask", 256), ("alibi", 64), ("causal_d128", 256)]


def _all_specs():
    return [load_spec(p) for p in COMPILED] + [_variant(n, d) for n, d in VARIANTS]


# ----------------------------------------------------------------------------- plan, grid
@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_persistent_plan(path):
    spec = load_spec(path)
    off = plan_forward(spec, "sm_90")
    on = plan_forward(spec, "sm_90", persistent=True)
    assert not off.context["persistent"] and on.context["persistent"]
    assert on.tiles == off.tiles and on.args == off.args and on.tma == off.tma
    assert on.smem_bytes <= HOPPER_SMEM_LIMIT
    # the epilogue gets its own staging buffer where it fits (not at head_dim 256)
    assert on.context["separate_o"] == (spec.head_dim < 256)
    assert (on.context["producer_regs"], on.context["consumer_regs"]) == HOPPER_PERSISTENT_REGS
    assert (off.context["producer_regs"], off.context["consumer_regs"]) == HOPPER_REGS
    p, c = HOPPER_PERSISTENT_REGS
    assert 128 * (p + 2 * c) <= 65536 and 128 * (168 - p) >= 256 * (c - 168)
    # the FA2-class kernel has no persistent form: the flag is ignored there
    assert plan_forward(spec, "sm_80", persistent=True).template == "sm_80/fwd.cu.j2"


def test_persistent_grid():
    spec = load_spec(REPO / "specs" / "causal_d128.yaml")
    off = plan_forward(spec, "sm_90")
    on = plan_forward(spec, "sm_90", persistent=True)
    # causal: the non-persistent kernel takes its L2 head groups from the grid
    assert off.context["grid_groups"] == "l2"
    assert off.grid(2, 16, 8192, heads_kv=16, seqlen_k=8192) == (8 * 64, 4, 1)
    assert off.grid(2, 16, 8192, 132, heads_kv=16, seqlen_k=8192) == (8 * 64, 4, 1)
    with pytest.raises(ValueError, match="heads_kv and seqlen_k"):
        off.grid(2, 16, 8192)
    plain = plan_forward(spec, "sm_90", head_groups=False)
    assert plain.context["grid_groups"] is None
    assert plain.grid(2, 16, 8192) == (64 * 32, 1, 1)
    full = plan_forward(load_spec(REPO / "specs" / "bidir_d256.yaml"), "sm_90")
    assert full.context["grid_groups"] is None and full.grid(2, 8, 4096) == (32 * 16, 1, 1)
    assert on.context["grid_groups"] is None
    assert on.grid(2, 16, 8192, num_sms=132) == (132, 1, 1)
    assert on.grid(1, 1, 1000, num_sms=132) == (8, 1, 1)  # fewer tiles than SMs: one each
    with pytest.raises(ValueError, match="num_sms"):
        on.grid(2, 16, 8192)


def test_persistent_option():
    from flashgen.families.registry import persistent_scheduler
    from flashgen.options import DEFAULT

    spec = load_spec(REPO / "specs" / "causal_d128.yaml")
    assert persistent_scheduler(spec) is False  # auto: off for a mask without a block table
    assert persistent_scheduler(spec, DEFAULT.replace_path("persistent", "off")) is False
    for name in PERSISTENT_SCHEDULERS:
        assert persistent_scheduler(spec, DEFAULT.replace_path("persistent", name)) == name
    with pytest.raises(ValueError, match="^persistent: expected one of .*, got 'yes'$"):
        DEFAULT.replace_path("persistent", "yes")


def test_block_table_masks_default_to_the_dynamic_scheduler():
    """``Options.persistent`` ``auto`` (the default) means ``dynamic`` for a mask that reads
    tensors (a block table: document_mask) and off for the others; a scheduler named holds for
    every spec.  The CI compile unit (registry.compile_units' ``fwd``) follows it."""
    from flashgen.families.registry import compile_units, persistent_scheduler
    from flashgen.options import DEFAULT

    doc = load_spec(REPO / "specs" / "document_mask.yaml")
    swa = load_spec(REPO / "specs" / "mistral_swa.yaml")
    assert persistent_scheduler(doc) == "dynamic" and persistent_scheduler(swa) is False
    fwd = compile_units(doc, "sm_90")["fwd"]
    assert fwd.context["scheduler"] == "dynamic" and fwd.context["block_table"]
    assert fwd.context["persistent"] and "tile_counter" in [a.name for a in fwd.args]
    assert compile_units(swa, "sm_90")["fwd"].context["scheduler"] is None
    assert not compile_units(doc, "sm_80")["fwd"].context.get("persistent")  # FA2-class
    off = DEFAULT.replace_path("persistent", "off")
    assert persistent_scheduler(doc, off) is False
    assert compile_units(doc, "sm_90", off)["fwd"].context["scheduler"] is None
    static = DEFAULT.replace_path("persistent", "static")
    assert persistent_scheduler(doc, static) == "static"
    assert persistent_scheduler(swa, static) == "static"


def test_persistent_smem_layout():
    """q_empty (8 bytes) and the double-buffered tile info (8 ints) after the stage info, and
    at head_dim 64 / 128 a BLOCK_M x HEAD_DIM staging buffer; no warp_last (the producer
    warp scans the block table itself) and no first_slot (the producer warp walks alone)."""
    doc = load_spec(REPO / "specs" / "document_mask.yaml")
    plain = load_spec(REPO / "specs" / "causal_d128.yaml")
    for spec in (doc, plain):
        off = plan_forward(spec, "sm_90")
        on = plan_forward(spec, "sm_90", persistent=True)
        warp_last = 4 * off.tiles.num_warps if off.context["block_table"] else 0
        warp_last += 8 if off.context["single_walk"] else 0  # first_slot (single_walk)
        staging = off.tiles.block_m * spec.head_dim * 2
        assert on.smem_bytes == off.smem_bytes - warp_last + 40 + staging
    with pytest.raises(ValueError, match="shared memory"):
        plan_hopper_forward(plain, "sm_90", plan_forward(plain, "sm_90").tiles, stages=3,
                            persistent=True)  # fmt: skip


def test_schedulers():
    """static and m_major differ in the tile numbering only; dynamic takes a tile counter
    (before the tensor maps) and draws tiles with atomicAdd; unknown names are refused."""
    spec = load_spec(REPO / "specs" / "causal_d128.yaml")
    tiles = plan_forward(spec, "sm_90").tiles
    static = plan_forward(spec, "sm_90", persistent=True)
    assert static.context["scheduler"] == "static" and not static.context["m_major"]
    m_major = plan_forward(spec, "sm_90", persistent="m_major")
    assert m_major.context["m_major"] and m_major.args == static.args
    assert "const int group = batch * heads_q;" in render(m_major)
    dynamic = plan_forward(spec, "sm_90", persistent="dynamic")
    names = [a.name for a in dynamic.args]
    assert names[-4:] == ["tile_counter", "tma_q", "tma_k", "tma_v"]
    assert dynamic.args[-4].ctype == "int*" and dynamic.context["dynamic"]
    src = render(dynamic)
    assert "atomicAdd(tile_counter, 1)" in src and "atomicAdd(tile_counter + 1, 1)" in src
    assert "atomicAdd" not in render(static)
    assert dynamic.grid(2, 16, 8192, num_sms=132) == (132, 1, 1)
    with pytest.raises(ValueError, match="unknown persistent scheduler"):
        plan_hopper_forward(spec, "sm_90", tiles, persistent="lpt")


# ----------------------------------------------------------------------------- tile order
@pytest.mark.parametrize(
    "num_m,bh,grid,m_major",
    [(64, 32, 132, False), (64, 32, 132, True), (8, 1, 132, False), (7, 3, 5, False),
     (7, 3, 5, True), (1, 1, 1, False), (33, 5, 17, True), (0, 4, 8, False)],
)  # fmt: skip
def test_tile_order_covers_every_tile_once(num_m, bh, grid, m_major):
    for reverse in (False, True):
        order = persistent_tile_order(num_m, bh, grid, reverse_m=reverse, m_major=m_major)
        assert len(order) == grid
        flat = [t for cta in order for t in cta]
        assert sorted(flat) == sorted(itertools.product(range(bh), range(num_m)))
        sizes = [len(cta) for cta in order]
        assert max(sizes) - min(sizes) <= 1  # static round robin: balanced tile counts


def test_tile_order_heaviest_first():
    """Causal (reverse_m): every CTA meets each head's query blocks longest first, and in
    m-major order every CTA's sequence of blocks is non-increasing (the heaviest anywhere
    come first); the first wave (tile i of every CTA) is the heaviest wave."""
    for num_m, bh, grid in [(64, 32, 132), (7, 3, 5), (128, 2, 132)]:
        order = persistent_tile_order(num_m, bh, grid, reverse_m=True)
        for cta in order:
            for head in range(bh):
                ms = [m for h, m in cta if h == head]
                assert ms == sorted(ms, reverse=True)
        order = persistent_tile_order(num_m, bh, grid, reverse_m=True, m_major=True)
        for cta in order:
            ms = [m for _, m in cta]
            assert ms == sorted(ms, reverse=True)
        # m-major: the first wave (each CTA's first tile) holds the heaviest blocks
        first = [cta[0][1] for cta in order if cta]
        later = [m for cta in order for _, m in cta[1:]]
        assert not later or min(first) >= max(later)
    # non-causal keeps the plain order
    assert persistent_tile_order(3, 1, 1, reverse_m=False) == [[(0, 0), (0, 1), (0, 2)]]
    with pytest.raises(ValueError):
        persistent_tile_order(4, 4, 0, reverse_m=False)


def test_tile_order_matches_the_kernels_numbering():
    """The kernel's decode (tile = blockIdx.x + ti * gridDim.x; fg::tile_coord with the
    plan's head group; m_block reversed for causal or a residual mask) is the one
    persistent_tile_order models; the non-persistent kernel numbers its CTAs the same way."""
    spec = load_spec(REPO / "specs" / "causal_d128.yaml")
    src = render(plan_forward(spec, "sm_90", persistent=True))
    assert "tile = blockIdx.x + ti * gridDim.x" in src
    assert "const int group = fg::head_group(33554432LL, seqlen_k, 512, heads_q / heads_kv, " in src
    assert "fg::tile_coord(tile, num_m_blocks, batch * heads_q, group);" in src
    assert "const int m_block = num_m_blocks - 1 - m_rev;" in src
    plain = render(plan_forward(load_spec(REPO / "specs" / "bidir_d256.yaml"), "sm_90",
                                persistent=True))  # fmt: skip
    assert "const int m_block = m_rev;" in plain and "const int group = 1;" in plain


# ----------------------------------------------------------------------------- head groups
@pytest.mark.parametrize("num_m", [0, 1, 3, 8])
def test_tile_coord_is_a_bijection(num_m):
    """Every (query block, head) once, for every group size from head-major to m-major."""
    for num_bh in range(1, 14):
        for group in range(1, num_bh + 1):
            got = [tile_coord(t, num_m, num_bh, group) for t in range(num_m * num_bh)]
            assert sorted(got) == sorted(itertools.product(range(num_m), range(num_bh)))


def test_tile_coord_groups():
    """group 1 is head-major, group num_bh query-block major; otherwise heads in equal
    groups (32 heads at most 6 per group: 6, 6, 5, 5, 5, 5), block-major inside each."""
    assert [tile_coord(t, 3, 2, 1) for t in range(6)] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (0, 1),
        (1, 1),
        (2, 1),
    ]
    assert [tile_coord(t, 3, 2, 2) for t in range(6)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
    ]
    heads = [tile_coord(t, 4, 32, 6)[1] for t in range(4 * 32)]
    sizes = [
        len(set(heads[a:b]))
        for a, b in [(0, 24), (24, 48), (48, 68), (68, 88), (88, 108), (108, 128)]
    ]
    assert sizes == [6, 6, 5, 5, 5, 5]
    assert [tile_coord(t, 4, 32, 6) for t in range(7)] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (0, 3),
        (0, 4),
        (0, 5),
        (1, 0),
    ]


@pytest.mark.parametrize("num_m", [1, 2, 5])
def test_grouped_grid_carries_tile_coords_order(num_m):
    """CUDA numbers a grid's CTAs x-fastest: :func:`grouped_grid`'s CTAs, holes skipped,
    give :func:`tile_coord`'s order, every tile once."""
    for num_bh in range(1, 26):
        for group in range(1, num_bh + 3):
            gx, gy, gz = grouped_grid(num_m, num_bh, group)
            assert gz == 1 and gy == -(-num_bh // group)
            got = [grid_tile_coord(x, y, num_bh, gy) for y in range(gy) for x in range(gx)]
            tiles = [c for c in got if c is not None]
            assert tiles == [tile_coord(t, num_m, num_bh, group) for t in range(num_m * num_bh)]
            # holes: each smaller group (one head fewer) has one per query block
            rem = num_bh % gy
            assert len(got) - len(tiles) == ((gy - rem) * num_m if rem else 0)


def test_grouped_grid_limits():
    assert grouped_grid(0, 32, 8) == (0, 1, 1) and grouped_grid(64, 0, 8) == (0, 1, 1)
    # more groups than gridDim.y allows: the groups grow, the order stays grouped
    gx, gy, _ = grouped_grid(2, 200_000, 1)
    assert gy <= GRID_GROUPS_MAX and gx == 2 * -(-200_000 // gy)
    assert grouped_grid(3, 7, 100) == (21, 1, 1)  # one group: query-block major over all heads


def test_head_group_fits_l2():
    """As many K/V heads as fit the L2 budget, times the query heads sharing each, within
    [1, num_bh]: causal_d128 at S=8k (4 MiB of K and V per head) groups 8 heads."""
    assert head_group(8192, 512, 1, 32) == 8
    assert head_group(8192, 512, 4, 32) == 32  # GQA: 8 K/V heads, 4 query heads each
    assert head_group(1 << 20, 512, 1, 32) == 1  # one head larger than the budget
    assert head_group(0, 512, 1, 5) == 5 and head_group(16, 512, 1, 0) == 1
    assert head_group(8192, 512, 1, 32, l2_bytes=0) == 1


def test_head_groups_balance_causal_tiles():
    """The point of the groups: list-scheduling causal query blocks (work m + 1, in CTA order,
    each on the first free SM) finishes within 1.5% of the ideal time at the benchmark shapes,
    where head-major order left the last heads' longest rows for the end (5-14% idle tail)."""
    import heapq

    def makespan(order, sms=132):
        free = [0.0] * sms
        for work in order:
            heapq.heappush(free, heapq.heappop(free) + work + 1)
        return max(free)

    for s, d, heads in [(4096, 128, 16), (8192, 128, 16), (8192, 256, 8), (16384, 128, 16)]:
        num_m, num_bh = s // 128, (16384 // s) * heads
        ideal = num_bh * (num_m * (num_m + 1) / 2 + num_m) / 132
        group = head_group(s, 4 * d, 1, num_bh)
        for g, bound in [(group, 1.015), (1, None)]:
            order = [num_m - tile_coord(t, num_m, num_bh, g)[0] for t in range(num_m * num_bh)]
            ratio = makespan(order) / ideal
            if bound:
                assert ratio < bound, (s, d, ratio)
            elif s < 16384:
                assert ratio > 1.05, (s, d, ratio)  # head-major's tail, for contrast


# ----------------------------------------------------------------------------- rendering
def test_persistent_render():
    off_swa = render(plan_forward(load_spec(REPO / "specs" / "mistral_swa.yaml"), "sm_90"))
    doc = load_spec(REPO / "specs" / "document_mask.yaml")
    off = render(plan_forward(doc, "sm_90"))
    on = render(plan_forward(doc, "sm_90", persistent=True))
    assert (
        "q_empty" not in off
        and "tile_info" not in off
        and "__forceinline__ int opaque(int x)" not in off
    )
    for needle in ("q_empty", "hand_over(-2, 0, 0, 0);", "__ballot_sync", "tile_at(0) - 1",
                   "const uint32_t sO = sV + STAGES * SKV_BYTES;", "fg::setmaxnreg_dec<72>",
                   "fg::setmaxnreg_inc<216>"):  # fmt: skip
        assert needle in on, needle
    assert "warp_last" not in on and "fg_tile_class" not in on
    # head_dim 256: the epilogue stages in sQ, so q_empty waits for it (and a proxy fence)
    d256 = render(plan_forward(load_spec(REPO / "specs" / "bidir_d256.yaml"), "sm_90",
                               persistent=True))  # fmt: skip
    assert "const uint32_t sO = sQ;" in d256 and "fence.proxy.async.shared::cta" in d256
    # the classifier path walks with per-tile opaque copies of its scalar arguments
    swa = render(plan_forward(load_spec(REPO / "specs" / "mistral_swa.yaml"), "sm_90",
                              persistent=True))  # fmt: skip
    assert "const int tile_p_window = opaque(p_window);" in swa
    # warp-wide, a fresh window per tile (inside the tile loop); hopper_fwd.warp_walk False:
    # prev_live, one classifier call per step
    assert "walk.prev_live(j, c, kv_class)" in swa and "fg::iv::prev_live(" not in swa
    tile_loop = swa.index("for (int tile = blockIdx.x")
    assert tile_loop < swa.index("fg::iv::WarpWalk walk;") < swa.index("hand_over(-2, 0, 0, 0);")
    swa_p = load_spec(REPO / "specs" / "mistral_swa.yaml")
    old = render(plan_hopper_forward(swa_p, "sm_90", plan_forward(swa_p, "sm_90").tiles,
                                     persistent=True, warp_walk=False))  # fmt: skip
    assert "fg::iv::prev_live(j, c, full, kv_class)" in old and "WarpWalk walk" not in old
    no_walk = plan_forward(swa_p, "sm_90", persistent=True, values={"hopper_fwd.warp_walk": False})
    assert render(no_walk) == old
    # the non-persistent kernel walks warp-wide either way (its source does not change)
    assert render(plan_forward(swa_p, "sm_90")) == off_swa


# ----------------------------------------------------------------------------- nvcc
def _build(job):
    from flashgen.families import build as family_build

    spec, scheduler = job
    plan, _, report = family_build.build_forward(spec, "sm_90", persistent=scheduler)
    assert plan.template == "sm_90/fwd.cu.j2" and plan.context["persistent"]
    assert plan.tiles == plan_forward(spec, "sm_90").tiles, (spec.name, plan.tiles)
    return spec.name, spec.head_dim, scheduler, report


def _scheduled() -> list:
    """(spec, scheduler) the nvcc tests build: each shipped spec (one per kernel code), then
    each head-dim variant, with one scheduler, static and dynamic alternating among the specs
    of a head dim (the two differ in two index expressions, the tile counter's; m_major is
    dynamic's), and both for a shipped spec whose op runs a persistent kernel by default
    (document_mask, spec_tree: test_compile builds their dynamic one)."""
    from flashgen.families.registry import persistent_scheduler

    jobs, seen, shipped = [], {}, {load_spec(p).name: load_spec(p).head_dim for p in COMPILED}
    for spec in _all_specs():
        i = seen[spec.head_dim] = seen.get(spec.head_dim, -1) + 1
        mine = {("static", "dynamic")[i % 2]}
        if shipped.get(spec.name) == spec.head_dim:
            mine.add(persistent_scheduler(spec))
        jobs += [(spec, s) for s in ("static", "dynamic") if s in mine]
    return jobs


def test_the_nvcc_tests_build_both_schedulers_at_every_head_dim():
    jobs = _scheduled()
    assert {s for _, s in jobs} == {"static", "dynamic"}
    assert {sp.name for sp, _ in jobs} == {sp.name for sp in _all_specs()}
    for d in (64, 128, 256):
        assert {s for sp, s in jobs if sp.head_dim == d} == {"static", "dynamic"}, d
    assert ("document_mask", 128, "dynamic") in {(sp.name, sp.head_dim, s) for sp, s in jobs}


def test_every_spec_compiles_persistent_without_spills(requires_nvcc):
    """Every shipped spec and head-dim variant with a persistent scheduler (:func:`_scheduled`:
    static or dynamic, both at every head dim).  At the planned tiles, through select's
    fallback (row / column terms of a tensor-reading mask, flashgen/analysis/rowcol.py, are
    dropped where they spill: document_mask at d256)."""
    jobs = _scheduled()
    with cf.ThreadPoolExecutor(2) as ex:
        for name, d, scheduler, report in ex.map(_build, jobs):
            assert report.spill_bytes == 0, (name, d, scheduler, report)


def _build_first(job):
    from flashgen.build import cache

    spec, scheduler, tiles = job
    plan = plan_forward(spec, "sm_90", tiles=tiles, persistent=scheduler)
    _, report = cache.get_or_build(render(plan), plan)
    return spec.name, spec.head_dim, scheduler, plan, report


def test_the_warp_wide_walk_fits_the_producer(requires_nvcc):
    """The persistent producer's warp-wide walk (``warp_walk``) at its planned tiles with
    every feature on (no fallback of family_build.build_forward): no spills, no serialized wgmma,
    for every spec and head-dim variant with its scheduler (:func:`_scheduled`, the units of
    the test above) and the sparse-call kernels (lower.sparse_tiles, dynamic; chunked_local's
    divides)."""
    from flashgen.families.tiles import sparse_tiles

    jobs = [(s, scheduler, None) for s, scheduler in _scheduled()]
    for p in COMPILED:
        spec = load_spec(p)
        alt = sparse_tiles(spec, plan_forward(spec, "sm_90").tiles)
        jobs += [(spec, "dynamic", alt)] if alt else []
    assert any(s.name == "chunked_local" and t for s, _, t in jobs)
    with cf.ThreadPoolExecutor(2) as ex:
        for name, d, scheduler, plan, report in ex.map(_build_first, jobs):
            assert plan.context["warp_walk"] != plan.context["block_table"], (name, d)
            assert report.spill_bytes == 0, (name, d, scheduler, plan.tiles, report)
            assert not report.wgmma_serialized, (name, d, scheduler, plan.tiles, report)


def _sass(job) -> tuple[str, str]:
    spec, scheduler = job
    return spec.name, sass(plan_forward(spec, "sm_90", persistent=scheduler))


def test_every_spec_emits_tma_and_wgmma_persistent(requires_nvcc):
    """The SASS of each shipped spec's persistent forward (its scheduler of :func:`_scheduled`
    at the planned tiles: the unit the compile tests above build; one spec per kernel code)
    holds wgmma, TMA loads, setmaxnreg and the mbarrier parity waits."""
    specs = [(sp, s) for sp, s in _scheduled() if sp.head_dim == load_spec(
        REPO / "specs" / f"{sp.name}.yaml").head_dim]  # the shipped specs' (not the variants)
    with cf.ThreadPoolExecutor(2) as ex:
        for name, code in ex.map(_sass, specs):
            assert wgmmas(code), name
            assert "UTMALDG" in code, name
            assert "USETMAXREG" in code, name
            assert "SYNCS.PHASECHK.TRANS64.TRYWAIT" in code, name


def test_persistent_ctas():
    """The op's persistent grid: the SM count, or ``Options.persistent_ctas`` (debugging)."""
    from flashgen.options import DEFAULT

    assert DEFAULT.persistent_ctas is None  # the SM count
    assert DEFAULT.replace_path("persistent_ctas", "3").persistent_ctas == 3
    for bad in ("0", "-1", "x"):
        with pytest.raises(ValueError, match="persistent_ctas"):
            DEFAULT.replace_path("persistent_ctas", bad)


def test_a_persistent_forward_has_no_sparse_compile_unit():
    """The op's sparse calls run the dense kernel where it is persistent
    (``attention_kernels.kernel``), and ``flashgen build`` compiled no ``fwd_sparse`` there;
    :func:`registry.compile_units` (the units build compiles) listed one anyway."""
    from flashgen.families.registry import compile_units
    from flashgen.options import DEFAULT

    causal = load_spec(REPO / "specs" / "causal_d128.yaml")
    assert "fwd_sparse" in compile_units(causal, "sm_90")
    for name in ("static", "m_major", "dynamic"):
        units = compile_units(causal, "sm_90", DEFAULT.replace_path("persistent", name))
        assert "fwd_sparse" not in units and units["fwd"].context["persistent"], name
