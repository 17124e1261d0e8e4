"""Single-request decode knobs (issue 40, part 1): the deeper cp.async ring
(``Options.decode.stages`` up to :data:`~flashgen.families.decode.MAX_STAGES`) and the fused
combine's loads in flight (``Options.decode.merge_unroll``): their checks, plans, split
counts, rendered units and cache keys, the ring's wait counts emulated on the host, the
launch trace of ``tools/decode_trace.py`` and ``flashgen bench --decode --option``.  CPU only
(the nvcc test skips without nvcc); the GPU checks against float64 are
tests/gpu/test_decode_gpu.py's ``test_sweep_options_are_correct``."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from flashgen.build.render import render
from flashgen.families import decode as family
from flashgen.frontend.spec import load_spec
from flashgen.options import Options

ROOT = Path(__file__).resolve().parents[2]


def _spec(name="llama3_gqa"):
    return load_spec(ROOT / "specs" / f"{name}.yaml")


def _trace_tool():
    spec = importlib.util.spec_from_file_location(
        "decode_trace", ROOT / "tools" / "decode_trace.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stages_and_merge_unroll_are_typed_and_range_checked():
    for st in range(2, family.MAX_STAGES + 1):
        assert family.Options(stages=st).stages == st
    for mu in family.MERGE_UNROLLS:
        assert family.Options(merge_unroll=mu).merge_unroll == mu
    bad = [dict(stages=1), dict(stages=family.MAX_STAGES + 1), dict(stages=4.0),
           dict(stages=True), dict(merge_unroll=2), dict(merge_unroll=32),
           dict(merge_unroll=8.0), dict(merge_unroll=True), dict(merge_unroll=None)]  # fmt: skip
    for kw in bad:
        with pytest.raises(ValueError, match=f"Options.decode.{next(iter(kw))}"):
            family.Options(**kw)
    # the dotted setter (flashgen ab, flashgen bench --decode --option) parses and checks them
    o = Options().replace_path("decode.merge_unroll", "16").replace_path("decode.stages", "6")
    assert (o.decode.merge_unroll, o.decode.stages) == (16, 6)
    with pytest.raises(ValueError):
        Options().replace_path("decode.merge_unroll", "5")


def test_new_knobs_are_unit_knobs_and_in_the_cache_key():
    spec = _spec()
    base = family.Options()
    assert base.unit_key()[-1] == 4
    keys = {family.Options(merge_unroll=m, stages=s).unit_key()
            for m in family.MERGE_UNROLLS for s in (None, 6)}  # fmt: skip
    assert len(keys) == 6
    # the defaults keep their options key (hence their cached units); a changed knob has its own
    assert Options().family_key("decode") == ""
    assert "merge_unroll=16" in Options().with_values({"decode.merge_unroll": 16}).family_key(
        "decode"
    )
    p4 = family.plan(spec, "sm_90", family.Options(merge_unroll=4))
    assert render(p4) == render(family.plan(spec, "sm_90"))  # the default unit, unchanged
    src4 = render(p4).splitlines()
    src16 = render(family.plan(spec, "sm_90", family.Options(merge_unroll=16))).splitlines()
    diff = [(a, b) for a, b in zip(src4, src16, strict=True) if a != b]
    assert len(diff) == 2 and diff[1] == ("    #pragma unroll 4", "    #pragma unroll 16")


def test_deep_ring_plans_where_it_fits():
    spec = _spec()
    p = family.plan(spec, "sm_90", family.Options(block_n=64, stages=6))
    # Q tile + 6 stages of 64 K and V rows of 256 B + the ring's row bytes
    assert p.smem_bytes == 16 * 128 * 2 + 6 * 64 * 256 * 2 + 6 * 64 == 201088
    assert p.tiles.stages == 6 and family.ctas_per_sm(p) == 1
    src = render(p)
    assert "constexpr int STAGES = 6;" in src and "== 201088" in src
    for target, stages in (("sm_80", 6), ("sm_90", 7), ("sm_80", 5)):
        with pytest.raises(ValueError, match="shared memory"):
            family.plan(spec, target, family.Options(block_n=64, stages=stages))
    # a d64 spec's rows are half as wide: the deepest ring, 8 stages of 64 keys, fits sm_80
    d64 = family.plan(_spec("gpt2_d64"), "sm_80", family.Options(block_n=64, stages=8))
    assert d64.smem_bytes == 16 * 64 * 2 + 8 * 64 * 128 * 2 + 8 * 64 == 133632


def test_a_ring_that_does_not_fit_names_the_target_and_what_fits():
    """``decode.stages=6`` on sm_80 said "need 201088 B ... (limit 166912): pick a smaller
    block_n or fewer stages" with no target named and no number to pick.  The error names the
    target, the deepest stages that fit at this block_n (or, where not even 2 do, the block_n
    / stages pairs that fit) and the targets that take the tiles; each suggestion plans."""
    spec = _spec()
    for stages in (5, 6):
        with pytest.raises(family.DecodeTilesError) as e:
            family.plan(spec, "sm_80", family.Options(block_n=64, stages=stages))
        msg = str(e.value)
        assert " on sm_80 " in msg and "(limit 166912 B)" in msg, msg
        assert "at block_n 64, sm_80 fits decode.stages up to 4" in msg, msg
        assert msg.endswith("; sm_90 takes these tiles") and e.value.fits == ("sm_90",), msg
    family.plan(spec, "sm_80", family.Options(block_n=64, stages=4))  # the advice holds
    with pytest.raises(family.DecodeTilesError) as e:
        family.plan(spec, "sm_90", family.Options(block_n=64, stages=7))
    assert "at block_n 64, sm_90 fits decode.stages up to 6" in str(e.value)
    assert e.value.fits == () and "takes these tiles" not in str(e.value)
    for target in ("sm_80", "sm_90"):
        with pytest.raises(family.DecodeTilesError) as e:
            family.plan(spec, target, family.Options(block_n=256))
        msg = str(e.value)
        assert f"not even 2 stages (the fewest) fit {target}; what fits: block_n " in msg, msg
        pairs = [tuple(map(int, m)) for m in
                 re.findall(r"block_n (\d+) \(stages up to (\d+)\)", msg)]
        assert pairs and all(bn >= 64 and st >= 2 for bn, st in pairs), msg
        for bn, st in pairs:  # every pair named plans, and one stage more does not
            family.plan(spec, target, family.Options(block_n=bn, stages=st))
            if st < family.MAX_STAGES:
                with pytest.raises(family.DecodeTilesError):
                    family.plan(spec, target, family.Options(block_n=bn, stages=st + 1))


def test_a_cpu_plan_that_does_not_fit_says_it_plans_for_sm_80():
    """``op.plan_decode`` on the CPU plans the sm_80 unit: its refusal of stages 5 / 6 now
    says so (an OpInputError naming ``options``)."""
    import flashgen
    from flashgen.frontend.errors import OpInputError

    op = flashgen.load("llama3_gqa")
    with pytest.raises(OpInputError) as e:
        op.plan_decode(batch=1, num_heads=32, num_heads_kv=8, cache_capacity=4096,
                       device="cpu", options=family.Options(stages=6))  # fmt: skip
    msg = str(e.value)
    assert msg.startswith("options: decode tiles block_n=64 x 6 stages need 201088 B"), msg
    assert "on sm_80" in msg and "fits decode.stages up to 4" in msg and "on the CPU" in msg


def test_plan_decode_takes_a_full_options_by_its_decode_part():
    """``op.plan_decode(..., options=flashgen.Options(...))`` said "expected
    flashgen.families.decode.Options, got Options": a full Options is taken by its
    ``.decode``; one whose exact_softmax differs from the op's (its kernels) is refused,
    saying to pass ``options.decode``; anything else names both forms."""
    import flashgen
    from flashgen.frontend.errors import OpInputError

    op = flashgen.load("llama3_gqa")
    kw = dict(batch=1, num_heads=32, num_heads_kv=8, cache_capacity=8192, device="cpu")
    full = Options().with_values({"decode.num_splits": 5, "decode.merge_unroll": 16})
    plan = op.plan_decode(options=full, **kw)
    assert plan.num_splits == 5 and plan.options == full.decode
    assert op.plan_decode(options=full.decode, **kw).num_splits == 5
    with pytest.raises(OpInputError, match=r"^options: exact_softmax=True differs from the "
                       r"op's \(False\).*pass options.decode$"):  # fmt: skip
        op.plan_decode(options=Options(exact_softmax=True), **kw)
    with pytest.raises(OpInputError, match=r"^options: expected flashgen.families.decode.Options "
                       r"\(or a flashgen.Options, whose .decode is used\), got dict$"):  # fmt: skip
        op.plan_decode(options={"decode.stages": 4}, **kw)


def test_build_says_which_target_takes_a_deep_ring():
    """``flashgen build llama3_gqa --option decode.stages=6`` failed the sm_80 decode units
    with the plan's bare text: they now say to build for sm_90 alone."""
    import flashgen.cli.build as cli

    options = Options().replace_path("decode.stages", 6)
    for unit in ("decode", "decode_ragged"):
        res = cli._compile_one(_spec(), "sm_80", unit, options)
        assert not res.ok and "on sm_80" in res.error, res.error
        assert res.error.endswith("sm_90 takes these tiles (build for it alone: --target sm_90)")


@pytest.mark.parametrize("stages", range(2, family.MAX_STAGES + 1))
@pytest.mark.parametrize("blocks", [0, 1, 2, 3, 7, 8, 21])
def test_ring_wait_counts_hold_for_every_depth(stages, blocks):
    """The template's ring (decode.cu.j2) on the host: STAGES - 1 blocks issued ahead, one
    commit group per stage slot, ``cp.async.wait_group STAGES - 2`` at the top of each step.
    At every step the block read has landed, the slot refilled is not the slot read and
    holds no block still to be read (the slot read last step, freed by the barrier)."""
    groups: list[tuple[int, int] | None] = []  # (block, slot) per commit group, None: empty
    slot_of: dict[int, int] = {}
    ld_j = 0
    for st in range(stages - 1):
        groups.append((ld_j, st) if ld_j < blocks else None)
        if ld_j < blocks:
            slot_of[ld_j] = st
            ld_j += 1
    stage, landed = 0, set()
    for j in range(blocks):
        # wait_group N: all but the newest N groups are complete
        for g in groups[: len(groups) - (stages - 2)]:
            if g is not None:
                landed.add(g[0])
        assert j in landed and slot_of[j] == stage
        st = stage - 1 if stage + stages - 1 >= stages else stage + stages - 1
        assert st != stage and st == (stage + stages - 1) % stages
        in_ring = {b for b, s in slot_of.items() if b > j and s == st}
        assert not in_ring  # no block still to be read lives in the slot refilled
        groups.append((ld_j, st) if ld_j < blocks else None)
        if ld_j < blocks:
            slot_of[ld_j] = st
            ld_j += 1
        stage = stage + 1 if stage + 1 < stages else 0
    assert ld_j == blocks


def test_b1_split_choice_of_the_deep_ring():
    """B1, Hq/Hkv 32/8 (one row block per kv head) on 132 SMs: the default unit fills 3 CTA
    slots per SM (49 splits, 392 CTAs: one wave); the 6-stage ring holds one CTA per SM, so
    the same heuristic gives 16 splits (128 CTAs, every SM but 4 busy once) with 5 blocks in
    flight per CTA."""
    spec = _spec()
    kw = dict(batch=1, heads_kv_ctas=8, m_blocks=1, num_sms=132)
    d = family.plan(spec, "sm_90")
    deep = family.plan(spec, "sm_90", family.Options(block_n=64, stages=6))
    for cache, want_default, want_deep in ((2048, 16, 16), (8192, 49, 16), (16384, 49, 16),
                                           (65536, 49, 16)):  # fmt: skip
        assert family.choose_num_splits(d, max_seqlen_k=cache, **kw) == want_default
        assert family.choose_num_splits(deep, max_seqlen_k=cache, **kw) == want_deep
    geo = family.geometry(deep, batch=1, heads_q=32, heads_kv=8, seqlen_q=1, num_splits=16)
    assert geo.grid == (16, 8, 1) and geo.rows == 4 and geo.m_blocks == 1
    # the same split count from the default unit: a third of its wave
    assert family.choose_num_splits(d, max_seqlen_k=8192, split_waves=0.34, **kw) == 16


def test_balance_waves_fills_the_last_wave():
    """Options.decode.balance_waves (host schedule only: not a unit knob): B64 at 8k is 512
    CTAs unsplit on 396 slots (a last wave 29% full); 3 splits fill 97% of 4 waves.  Calls
    the heuristic already splits, or that fill their waves, keep their count."""
    assert family.Options(balance_waves=True).unit_key() == family.Options().unit_key()
    for bad in (1, "1", None):
        with pytest.raises(ValueError, match="balance_waves"):
            family.Options(balance_waves=bad)
    assert family.balanced_splits(512, 396, 64) == 3
    assert family.balanced_splits(396, 396, 64) == 1  # exactly one wave
    assert family.balanced_splits(792, 396, 64) == 1  # two
    assert family.balanced_splits(512, 396, 1) == 1  # too few blocks to split
    assert family.balanced_splits(0, 396, 64) == 1
    # none of 1..BALANCE_MAX_SPLITS reaches the fill: the best, the fewest on a tie
    assert family.balanced_splits(401, 400, 64) == 4  # 1604 / 2000 beats 401 / 800
    spec = _spec()
    d = family.plan(spec, "sm_90")
    kw = dict(heads_kv_ctas=8, m_blocks=1, num_sms=132)
    assert family.choose_num_splits(d, batch=64, max_seqlen_k=8192, **kw) == 1
    assert family.choose_num_splits(d, batch=64, max_seqlen_k=8192, balance_waves=True,
                                    **kw) == 3  # fmt: skip
    assert family.choose_num_splits(d, batch=1, max_seqlen_k=8192, balance_waves=True,
                                    **kw) == 49  # B1: the heuristic's own split  # fmt: skip
    tool = _trace_tool()
    t = tool.trace(spec, family.Options(balance_waves=True), batch=64, cache=8192,
                   page_size=16, heads_q=32, heads_kv=8, num_sms=132)  # fmt: skip
    assert (t["num_splits"], t["ctas"]) == (3, 1536) and abs(t["waves"] - 1536 / 396) < 1e-9


def test_trace_tool_reports_the_planned_launch():
    tool = _trace_tool()
    spec = _spec()
    kw = dict(batch=1, page_size=None, heads_q=32, heads_kv=8, num_sms=132)
    t = tool.trace(spec, family.Options(), cache=8192, **kw)
    assert (t["num_splits"], t["grid"], t["ctas"], t["ctas_per_sm"]) == (49, (49, 8, 1), 392, 3)
    assert t["blocks_per_cta"] == 3 and t["kib_per_cta"] == 96 and t["merge_partials"] == 49
    assert abs(t["waves"] - 392 / 396) < 1e-9
    t = tool.trace(spec, family.Options(block_n=64, stages=6), cache=8192, **kw)
    assert (t["num_splits"], t["ctas"], t["blocks_per_cta"], t["kib_in_flight_per_sm"]) == (
        16, 128, 8, 160)  # fmt: skip
    t = tool.trace(spec, family.Options(), cache=2048, **kw)
    assert (t["num_splits"], t["eff_splits"], t["blocks_per_cta"]) == (16, 16, 2)


@pytest.mark.parametrize("argv, message", [
    (["--batch", "x"], "argument --batch: batch: expected an int >= 1, got 'x'"),
    (["--batch", "0"], "batch: expected an int >= 1, got '0'"),
    (["--cache", "4096,0"], "cache: expected comma-separated positive ints, got '4096,0'"),
    (["--heads", "32/5"], "heads: expected heads_q a multiple of heads_kv (GQA groups), got 32 "
                          "/ 5"),
    (["--heads", "32"], "heads: expected HQ/HKV, two ints >= 1"),
    (["--sms", "0"], "sms: expected an int >= 1, got '0'"),
    (["--layouts", "paged0"], "layouts: expected comma-separated dense or pagedN (N >= 1"),
    (["--layouts", "dense,pagd16"], "got 'dense,pagd16'"),
    (["--spec", "llama3_fp8"], "--spec 'llama3_fp8': no decode kernels: decode supports fp16 "
                               "and bf16"),
    (["--spec", "no_such_spec"], "--spec 'no_such_spec': no such file, nor a shipped spec"),
    (["--option", "stages=6"], "unknown option 'stages'; did you mean decode.stages?"),
    (["--option", "hopper_fwd.affine=0"], "only decode.* options shape decode calls"),
    (["--option", "decode.stages=7"], "decode.stages=7: decode tiles block_n=64 x 7 stages "
                                      "need 233920 B of shared memory on sm_90"),
])  # fmt: skip
def test_decode_trace_refuses_bad_arguments_with_a_message_and_exit_2(capsys, argv, message):
    """tools/decode_trace.py took ``--batch 0``, ``--heads 32/5`` and ``--layouts paged0``
    (a ZeroDivisionError or a trace of nothing), read ``--option stages=6`` with its own
    parser, and answered an fp8 spec or a misspelt name with a traceback: each is an argparse
    error now (exit 2, one line naming the argument), before anything is printed."""
    with pytest.raises(SystemExit) as e:
        _trace_tool().main(argv)
    cap = capsys.readouterr()
    assert e.value.code == 2 and cap.out == "", cap
    assert message in cap.err and "Traceback" not in cap.err, cap.err


def test_decode_trace_takes_spec_files_shipped_names_and_option_lists(capsys, tmp_path):
    """``--spec`` is a file or a shipped spec's name (it was a name joined to specs/), and
    ``--option`` the ``NAME=A,B`` of ``flashgen ab`` / ``bench --decode``: a table per
    variant."""
    tool = _trace_tool()
    copy = tmp_path / "mine.yaml"
    copy.write_text((ROOT / "specs" / "gpt2_d64.yaml").read_text())
    assert tool.main(["--spec", str(copy), "--cache", "4096", "--layouts", "dense"]) == 0
    assert capsys.readouterr().out.startswith("gpt2_d64 ")
    assert tool.main(["--option", "decode.stages=2,6", "--cache", "8192"]) == 0
    out = capsys.readouterr().out
    assert "B1 decode.stages=2\n" in out and "B1 decode.stages=6\n" in out


def test_decode_trace_page_size_shapes_the_trace():
    """The page size was only the row's label: a paged plan sizes its splits for whole pages
    (``plan_decode``'s capacity) and a key block reads one block-table entry per page it
    spans."""
    tool = _trace_tool()
    kw = dict(batch=16, heads_q=32, heads_kv=8, num_sms=132, cache=1000)
    dense = tool.trace(_spec(), family.Options(), page_size=None, **kw)
    p256 = tool.trace(_spec(), family.Options(), page_size=256, **kw)
    p1 = tool.trace(_spec(), family.Options(), page_size=1, **kw)
    p40 = tool.trace(_spec(), family.Options(), page_size=40, **kw)
    assert (dense["capacity"], p256["capacity"], p1["capacity"]) == (1000, 1024, 1000)
    pages = (dense["pages_per_block"], p256["pages_per_block"], p1["pages_per_block"])
    assert pages == (0, 1, 64)
    assert p40["pages_per_block"] == 3  # a 64-key block starting 32 keys into a page of 40
    assert max(len({(k0 + r) // 40 for r in range(64)}) for k0 in range(0, 64 * 40, 64)) == 3


def test_decode_trace_counts_an_mla_cache_row_once():
    """mla_decode (``v_from_k``: V is the first head_dim_v columns of K's rows) read K's row
    bytes once, not K's and V's."""
    tool = _trace_tool()
    spec = _spec("mla_decode")
    t = tool.trace(spec, family.Options(), batch=1, cache=4096, page_size=64, heads_q=128,
                   heads_kv=1, num_sms=132)  # fmt: skip
    assert t["kib_per_cta"] == t["blocks_per_cta"] * t["block_n"] * spec.head_dim * 2 / 1024


def test_decode_bench_option_variants():
    from flashgen.bench.decode import option_variants

    assert option_variants([]) == [("", None)]
    v = option_variants(["decode.stages=2,6", "decode.merge_unroll=4,16"], "zip")
    assert [label for label, _ in v] == ["decode.stages=2,decode.merge_unroll=4",
                                         "decode.stages=6,decode.merge_unroll=16"]  # fmt: skip
    assert v[1][1] == family.Options(stages=6, merge_unroll=16)
    assert len(option_variants(["decode.stages=2,6", "decode.merge_unroll=4,16"])) == 4
    for bad in (["hopper_fwd.affine=0,1"], ["decode.stages=9"], ["decode.merge_unroll=3"]):
        with pytest.raises(ValueError):
            option_variants(bad)


@pytest.fixture
def no_cuda(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("argv, message", [
    (["--batch", "x"], "argument --batch: batch: expected comma-separated positive ints, got 'x'"),
    (["--cache", "4096,-1"], "cache: expected comma-separated positive ints, got '4096,-1'"),
    (["--layouts", "dense,paged0"], "layouts: expected comma-separated dense or pagedN (N >= 1"),
    (["--layouts", "dense,pagd16"], "layouts: expected comma-separated dense or pagedN"),
    (["--heads-q", "32", "--heads-kv", "5"], "heads: expected heads_q a multiple of heads_kv"),
    (["--rounds", "0"], "rounds: expected an int >= 1, got '0'"),
    (["--option", "decode.stages=9"], "error: decode.stages: expected an int in 2..8, got 9"),
    (["--option", "decode.stages=2,7"], "error: decode.stages=7: decode tiles block_n=64 x 7 "
                                        "stages need 233920 B of shared memory on sm_90"),
    (["--option", "decode.balance_waves=1", "--option", "decode.num_splits=4"],
     "balance_waves=True with Options.decode.num_splits=4"),
    (["--sweep", "--option", "decode.stages=4"], "--sweep times its own grid and shapes; it "
                                                 "takes no --option"),
    (["--sweep", "--batch", "1", "--cache", "4096"], "it takes no --batch, --cache"),
    (["--sweep", "--layouts", "dense"], "it takes no --layouts"),
    (["--sweep", "--fp8"], "it takes no --fp8"),
    (["--quick", "--batch", "1"], "--quick sets the batch sizes, cache lengths and layouts; drop "
                                  "--batch"),
    (["--quick", "--cache", "4096", "--layouts", "dense"], "drop --cache, --layouts"),
])  # fmt: skip
def test_bench_decode_refuses_bad_arguments_before_the_cuda_check(no_cuda, capsys, argv, message):
    """``flashgen bench --decode`` said "needs a CUDA device" (or ran) for ``--layouts
    paged0``, ``--heads-kv 5``, ``--option decode.stages=7``; ``--sweep`` and ``--quick``
    dropped the flags they do not read in silence; ``--batch x`` named ``<lambda>``.  Each is
    an argparse error (exit 2) now, from the planner alone, before any CUDA check."""
    from flashgen.bench.decode import main

    with pytest.raises(SystemExit) as e:
        main(argv, prog="flashgen bench --decode")
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err
    assert "<lambda>" not in err and "needs a CUDA device" not in err


def test_bench_decode_quick_through_flashgen_bench_refuses_a_cache(no_cuda, capsys):
    """``flashgen bench --quick --decode --cache 4096`` (bench's --quick passed on) timed the
    quick set, not 4096."""
    from flashgen.cli.commands import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--quick", "--decode", "--cache", "4096"])
    assert e.value.code == 2 and "drop --cache" in capsys.readouterr().err
    assert main(["bench", "--decode", "--quick", "--option", "decode.stages=2,6"]) == 1
    assert "needs a CUDA device" in capsys.readouterr().err  # valid: on to the CUDA check


def test_deep_ring_and_wide_merge_compile_spill_free(requires_nvcc):
    """The new knobs' units for sm_90a (and the merge's for sm_80) build without spills."""
    from concurrent.futures import ThreadPoolExecutor

    from flashgen.build import cache

    spec = _spec()
    jobs = [("sm_90", family.Options(block_n=64, stages=6)),
            ("sm_90", family.Options(block_n=64, stages=6, merge_unroll=16)),
            ("sm_90", family.Options(merge_unroll=16)), ("sm_80", family.Options(merge_unroll=8)),
            ("sm_80", family.Options(block_n=64, stages=4, merge_unroll=16))]  # fmt: skip

    def build(job):
        p = family.plan(spec, *job)
        return job, cache.get_or_build(render(p), p)[1]

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        for job, report in pool.map(build, jobs):
            assert all(not k.spill_bytes for k in report.kernels), (job, report.kernels)
