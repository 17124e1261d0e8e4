"""MLA decode's unit as a per-shape choice (issue 40, serving; ``Options.decode.mla_unit``,
flashgen.families.decode.mla_unit_for_call / mla_auto_unit), on the CPU through the real
planning code (the Hopper unit's plan, geometry and split heuristic; no mocks): ``auto``
picks the faster unit at every shape of the H100 table it comes from (read from the
benchmark log itself, whose wgmma split counts the planner reproduces), the rule's edges
(the capacities where it turns, Sq_new > 1, a window's live blocks, the SM count, empty
calls), what ``auto`` gives where the Hopper unit cannot run (sm_80, an e4m3 cache, a spec
without ``v_from_k``) and what the forced values give, the option's validation (the error
names the option, what it takes and what it got; the removed ``decode.mla_wgmma`` says what
replaced it), the keys a choice is part of, the CPU's plans, and ``flashgen show``.  The
default is ``mma_sync`` until ``auto`` has run on a GPU with compute-sanitizer over the wgmma
unit, so these tests ask for ``auto`` explicitly (:data:`AUTO`, :data:`AUTO_OPTIONS`)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from flashgen.build.render import render
from flashgen.families import decode as family
from flashgen.families import registry
from flashgen.frontend.spec import load_spec, loads_spec
from flashgen.options import DEFAULT, Options, UnknownOptionError

ROOT = Path(__file__).resolve().parents[2]
SPEC = load_spec(ROOT / "specs" / "mla_decode.yaml")
LOG = ROOT / "benchmarks" / "results" / "h100-2026-12-07-s29" / "bench_decode_mla.log"
H100_SMS = 132
WGMMA = family.plan(SPEC, "sm_90", family.Options(mla_unit="wgmma"))
#: ``auto`` is opt-in (the default is ``mma_sync``): the family's options and the full options
#: that ask for it.
AUTO = family.Options(mla_unit="auto")
AUTO_OPTIONS = Options().replace_path("decode.mla_unit", "auto")


def unit(batch, heads, cache, *, sq=1, target="sm_90", options=AUTO, cache_dtype=None,
         sms=H100_SMS, spec=SPEC, live_blocks=None):  # fmt: skip
    return family.mla_unit_for_call(
        spec, target, options, cache_dtype, batch=batch, heads_q=heads, heads_kv=1,
        seqlen_q=sq, capacity=cache, num_sms=sms, live_blocks=live_blocks,
    )  # fmt: skip


def work(batch, heads, cache, *, sq=1, sms=H100_SMS, live_blocks=None):
    return family.mla_auto_work(WGMMA, batch=batch, heads_q=heads, heads_kv=1, seqlen_q=sq,
                                capacity=cache, num_sms=sms, live_blocks=live_blocks)  # fmt: skip


def h100_table() -> dict:
    """``{(batch, cache, heads): {unit: (us, splits)}}`` from the s29 H100 log (paged 64,
    Sq_new 1)."""
    line = re.compile(r"^B(\d+)\s+(\d+) paged64\s+h(\d+)\s+sq1 (mma_sync|wgmma)\s+([\d.]+) us"
                      r".* splits (\d+)$")  # fmt: skip
    out: dict = {}
    for text in LOG.read_text().splitlines():
        m = line.match(text)
        if m:
            b, c, h, name, us, splits = m.groups()
            out.setdefault((int(b), int(c), int(h)), {})[name] = (float(us), int(splits))
    return out


TABLE = h100_table()


# ----------------------------------------------------------------------------- the rule
def test_the_table_is_the_briefs_twelve_shapes():
    assert sorted(TABLE) == [(b, c, h) for b in (1, 64) for c in (4096, 32768)
                             for h in (16, 64, 128)]  # fmt: skip
    assert TABLE[(1, 4096, 16)] == {"mma_sync": (31.5, 32), "wgmma": (44.6, 32)}
    assert TABLE[(64, 32768, 128)] == {"mma_sync": (8317.6, 1), "wgmma": (1428.3, 1)}


@pytest.mark.parametrize("batch,cache,heads", sorted(TABLE), ids=str)
def test_auto_picks_the_faster_unit_at_every_shape_of_the_h100_table(batch, cache, heads):
    times = TABLE[(batch, cache, heads)]
    faster = min(times, key=lambda name: times[name][0])
    assert unit(batch, heads, cache) == faster
    # the rule reads the split count the wgmma unit ran with in that benchmark
    w = work(batch, heads, cache)
    assert w.splits == times["wgmma"][1]
    assert w.picks_wgmma == (faster == "wgmma")


def test_the_rules_work_at_the_table_and_its_margin():
    """Losses at a work of 16 or less, wins from 31: the threshold 24 lies between."""
    got = {k: round(work(k[0], k[2], k[1]).work, 1) for k in TABLE}
    assert got == {
        (1, 4096, 16): 2.0, (1, 4096, 64): 8.0, (1, 4096, 128): 8.0,
        (1, 32768, 16): 4.0, (1, 32768, 64): 16.0, (1, 32768, 128): 31.0,
        (64, 4096, 16): 32.0, (64, 4096, 64): 128.0, (64, 4096, 128): 256.0,
        (64, 32768, 16): 256.0, (64, 32768, 64): 1024.0, (64, 32768, 128): 2048.0,
    }  # fmt: skip
    lost = [got[k] for k, t in TABLE.items() if t["wgmma"][0] > t["mma_sync"][0]]
    won = [got[k] for k, t in TABLE.items() if t["wgmma"][0] < t["mma_sync"][0]]
    assert max(lost) == 16.0 < family.MLA_AUTO_MIN_WORK == 24 < min(won) == 31.0


@pytest.mark.parametrize(
    "batch,heads,cache,want",
    [
        # one request, 128 heads: 66 splits from 132 key blocks on; 396 blocks turn it
        (1, 128, 395 * 64, "mma_sync"),
        (1, 128, 395 * 64 + 1, "wgmma"),
        # 64 requests, 16 heads: 2 splits; 48 key blocks (a work of 24) turn it
        (64, 16, 47 * 64, "mma_sync"),
        (64, 16, 47 * 64 + 1, "wgmma"),
        # one request, 16 heads: 128 splits and one mma.sync CTA per wgmma CTA: 192k keys
        (1, 16, 3071 * 64, "mma_sync"),
        (1, 16, 3072 * 64, "wgmma"),
        # one request, 64 heads: 128 splits, four mma.sync CTAs per wgmma CTA: 48k keys
        (1, 64, 767 * 64, "mma_sync"),
        (1, 64, 768 * 64, "wgmma"),
        # many requests fill the SMs: no split, a work of blocks x 4 at 128 heads
        (132, 128, 5 * 64, "mma_sync"),
        (132, 128, 6 * 64, "wgmma"),
        # empty calls
        (0, 128, 32768, "mma_sync"),
        (64, 128, 0, "mma_sync"),
    ],
    ids=str,
)
def test_the_rules_edges(batch, heads, cache, want):
    assert unit(batch, heads, cache) == want


def test_new_tokens_are_query_rows_too():
    """Sq_new packs with the heads (row = s * group + g): 16 heads x 4 new tokens fill a wgmma
    CTA as 64 heads do; 128 heads x 2 take four wgmma CTAs and sixteen mma.sync ones."""
    assert work(1, 16, 32768, sq=4) == work(1, 64, 32768) and unit(1, 16, 32768, sq=4) == "mma_sync"
    w = work(1, 128, 32768, sq=2)
    assert (w.wgmma_row_blocks, w.mma_row_blocks, w.splits) == (4, 16, 33)
    assert unit(1, 128, 32768, sq=2) == "wgmma"


def test_a_window_counts_its_live_blocks_not_the_capacity():
    spec = loads_spec(
        "name: m\nhead_dim: 576\nhead_dim_v: 512\nv_from_k: true\ndtype: bf16\n"
        "mask: causal && q_idx + seqlen_k - seqlen_q - kv_idx < w\n"
        "params:\n  w: {type: i32, default: 128, min: 1}\n", "m.yaml",
    )  # fmt: skip
    live = family.live_key_blocks(spec, capacity=32768, seqlen_q=1, block_n=family.MLA_BLOCK_N)
    assert live is not None and live <= 3
    assert unit(64, 128, 32768, spec=spec) == "wgmma"  # without the window's bound
    assert unit(64, 128, 32768, spec=spec, live_blocks=live) == "mma_sync"


def test_the_sm_count_sizes_the_splits_the_rule_reads():
    """B1 32k at 128 heads: 66 splits on 132 SMs (a work of 31); twice the SMs, 128 splits
    (16)."""
    assert work(1, 128, 32768, sms=264).splits == 128
    assert unit(1, 128, 32768, sms=264) == "mma_sync"
    assert unit(1, 128, 32768, sms=114) == "wgmma"  # an H100 PCIe: 57 splits, a work of 36


def test_the_split_options_enter_as_they_size_the_splits():
    """B1 8k at 128 heads: 64 splits (a work of 8); a quarter wave, 16 (32)."""
    fewer = dataclasses.replace(AUTO, split_waves=0.25)
    assert unit(1, 128, 8192) == "mma_sync"
    assert unit(1, 128, 8192, options=fewer) == "wgmma"


# ----------------------------------------------------------------------------- where it applies
def test_auto_is_the_mma_sync_unit_where_the_hopper_unit_cannot_run():
    big = dict(batch=64, heads=128, cache=32768)
    assert unit(**big) == "wgmma"
    assert unit(**big, target="sm_80") == "mma_sync"
    assert unit(**big, cache_dtype="fp8_e4m3") == "mma_sync"
    llama = load_spec(ROOT / "specs" / "llama3_gqa.yaml")
    assert unit(**big, spec=llama) == "mma_sync"
    # auto says nothing where it picks the mma.sync unit; a forced wgmma warns
    assert family.mla_wgmma_fallback(SPEC, "sm_80", AUTO) is None
    assert family.mla_wgmma_fallback(SPEC, "sm_80", family.Options(mla_unit="wgmma"))


def test_a_forced_unit_is_taken_at_every_shape():
    wg, mma = family.Options(mla_unit="wgmma"), family.Options(mla_unit="mma_sync")
    for batch, cache, heads in TABLE:
        assert unit(batch, heads, cache, options=wg) == "wgmma"
        assert unit(batch, heads, cache, options=mma) == "mma_sync"
    assert unit(1, 16, 4096, options=wg, target="sm_80") == "mma_sync"  # the fallback


def test_the_rule_takes_the_plan_given_or_plans_the_hopper_unit_itself():
    args = dict(batch=1, heads_q=128, heads_kv=1, seqlen_q=1, capacity=32768, num_sms=H100_SMS)
    assert family.mla_unit_for_call(SPEC, "sm_90", AUTO, wgmma=WGMMA, **args) == "wgmma"
    assert family.mla_unit_for_call(SPEC, "sm_90", AUTO, **args) == "wgmma"
    assert family.mla_auto_unit(WGMMA, batch=1, heads_q=16, heads_kv=1, seqlen_q=1,
                                capacity=4096, num_sms=H100_SMS) == "mma_sync"  # fmt: skip


# ----------------------------------------------------------------------------- the option
def test_the_option_is_a_typed_choice_mma_sync_by_default():
    """``mma_sync`` (the unit before the option) stays the default until ``auto`` has run on a
    GPU with compute-sanitizer over the wgmma unit; ``auto`` is opt-in."""
    assert family.MLA_UNITS == ("auto", "mma_sync", "wgmma")
    assert family.Options().mla_unit == "mma_sync" and DEFAULT.decode.mla_unit == "mma_sync"
    assert AUTO.mla_unit == "auto" and AUTO_OPTIONS.decode.mla_unit == "auto"
    assert "decode.mla_unit" in Options.paths() and "decode.mla_wgmma" not in Options.paths()
    assert Options.describe("decode.mla_unit") == "one of auto, mma_sync, wgmma"
    for value in family.MLA_UNITS:
        assert Options().replace_path("decode.mla_unit", value).decode.mla_unit == value
        assert family.Options(mla_unit=value).mla_unit == value


@pytest.mark.parametrize("bad", ["fast", "WGMMA", "", True, 1, None])
def test_a_bad_value_names_the_option_the_choices_and_the_value(bad):
    with pytest.raises(ValueError) as e:
        family.Options(mla_unit=bad)
    assert str(e.value) == (
        f"Options.decode.mla_unit={bad!r}: expected one of 'auto', 'mma_sync', 'wgmma', "
        f"got {bad!r}"
    )
    with pytest.raises(ValueError) as e:
        Options().replace_path("decode.mla_unit", bad)
    text = str(e.value)
    assert "decode.mla_unit" in text and "auto, " in text.replace("'", "") and repr(bad) in text


def test_a_bad_string_from_the_command_line_says_what_it_takes():
    with pytest.raises(ValueError) as e:
        Options().replace_path("decode.mla_unit", "wgmm")
    assert str(e.value) == "decode.mla_unit: expected one of auto, mma_sync, wgmma, got 'wgmm'"


def test_the_removed_boolean_says_what_replaced_it():
    for call in (lambda: Options().replace_path("decode.mla_wgmma", "true"),
                 lambda: Options().get_path("decode.mla_wgmma"),
                 lambda: Options.describe("decode.mla_wgmma")):  # fmt: skip
        with pytest.raises(UnknownOptionError) as e:
            call()
        text = str(e.value)
        assert text.startswith("option 'decode.mla_wgmma' was removed (replaced by "
                               "decode.mla_unit: ")  # fmt: skip
        assert "mma_sync is what false was, wgmma what true was" in text
        assert "mma_sync is the default, auto (opt-in) picks MLA's unit per call shape" in text
    with pytest.raises(TypeError, match="mla_wgmma"):
        family.Options(mla_wgmma=True)


# ----------------------------------------------------------------------------- keys
def test_the_unit_a_call_runs_is_in_its_keys():
    """The op's loaded units (``unit_key``) and the cubin (``options_key``, source and kernel
    name) tell the Hopper unit apart; ``auto`` (shape-less) and ``mma_sync`` (the default) are
    one unit and key (one cached cubin); the op's own key (its registered ops' names) keeps
    every non-default value (``auto``'s)."""
    auto, mma, wg = (family.Options(mla_unit=u) for u in family.MLA_UNITS)
    assert auto.unit_key() == mma.unit_key() != wg.unit_key()
    full = {u: Options().replace_path("decode.mla_unit", u) for u in family.MLA_UNITS}
    assert full["auto"].family_key("decode") == full["mma_sync"].family_key("decode") == ""
    assert full["wgmma"].family_key("decode") == "decode.mla_unit='wgmma'"
    assert full["mma_sync"].key() == DEFAULT.key() == ""
    assert full["auto"].key() == AUTO_OPTIONS.key() == "decode.mla_unit='auto'"
    plans = {u: registry.plan_decode(SPEC, "sm_90", o) for u, o in full.items()}
    assert plans["auto"].options_key == plans["mma_sync"].options_key == ""
    assert render(plans["auto"]) == render(plans["mma_sync"])
    assert plans["wgmma"].options_key == "decode.mla_unit='wgmma'"
    assert plans["wgmma"].kernel_name != plans["auto"].kernel_name
    assert plans["wgmma"].config()["mla_unit"] == "wgmma"
    assert "mla_unit" not in plans["auto"].config()


# ----------------------------------------------------------------------------- the op
def test_a_plan_on_the_cpu_records_its_unit():
    """The CPU runs the reference and plans for sm_80: ``auto`` resolves to the mma.sync unit
    there (``plan.mla_unit``, the plan's options), as the default ``mma_sync`` is; a spec
    without ``v_from_k`` has none."""
    import flashgen
    from flashgen.ops.decode.op import decode_op

    sizes = dict(batch=64, num_heads=128, num_heads_kv=1, seqlen_q=1, cache_capacity=32768,
                 page_size=64, num_pages=64 * 512, device="cpu")  # fmt: skip
    op = flashgen.load(ROOT / "specs" / "mla_decode.yaml", options=AUTO_OPTIONS)
    assert op.options.decode.mla_unit == "auto"
    p = op.plan_decode(**sizes)
    assert p.mla_unit == "mma_sync" and p.options.mla_unit == "mma_sync"
    assert decode_op(op)._mla == {}  # no device: nothing to memoize
    default = flashgen.load(ROOT / "specs" / "mla_decode.yaml").plan_decode(**sizes)
    assert default.mla_unit == "mma_sync" and default.options.mla_unit == "mma_sync"
    llama = flashgen.load(ROOT / "specs" / "llama3_gqa.yaml", options=AUTO_OPTIONS)
    q = llama.plan_decode(batch=2, num_heads=32, num_heads_kv=8, seqlen_q=1, cache_capacity=256,
                          device="cpu")  # fmt: skip
    assert q.mla_unit is None and q.options.mla_unit == "auto"


def test_show_says_how_the_unit_is_picked(capsys):
    from flashgen.cli.commands import main

    def lines(*argv):
        assert main(["show", *argv]) == 0
        return [x for x in capsys.readouterr().out.splitlines() if x.startswith("// ---- mla")]

    mla = str(ROOT / "specs" / "mla_decode.yaml")
    auto = ("--option", "decode.mla_unit=auto")
    (line,) = lines(mla, "--target", "sm_90", *auto)
    assert line.startswith("// ---- mla unit [sm_90]: decode.mla_unit=auto: calls and "
                           "op.plan_decode pick per shape: the wgmma unit")  # fmt: skip
    assert "at least 24 key-block loads" in line
    (line,) = lines(mla, "--target", "sm_80", *auto)
    assert line.startswith("// ---- mla unit [sm_80]: decode.mla_unit=auto: the mma_sync unit")
    (line,) = lines(mla, "--target", "sm_90")  # the default
    assert line == "// ---- mla unit [sm_90]: decode.mla_unit=mma_sync: the mma_sync unit shown"
    (line,) = lines(mla, "--target", "sm_90", "--option", "decode.mla_unit=wgmma")
    assert line == "// ---- mla unit [sm_90]: decode.mla_unit=wgmma: the wgmma unit shown"
    assert lines(str(ROOT / "specs" / "llama3_gqa.yaml"), "--target", "sm_90") == []
    assert main(["show", mla, "--option", "decode.mla_unit=fast"]) == 1
    err = capsys.readouterr().err
    assert "decode.mla_unit: expected one of auto, mma_sync, wgmma, got 'fast'" in err


def test_build_compiles_the_units_auto_may_pick():
    """``flashgen build`` compiles a ``v_from_k`` spec's Hopper units too where ``auto`` may pick
    them (sm_90), so a prebuilt cache serves both; a forced unit (the default ``mma_sync``
    among them) or sm_80 builds one."""
    from flashgen.cli.build import serving_units

    both = ("decode", "decode_ragged", "decode_wgmma", "decode_ragged_wgmma")
    assert serving_units(SPEC, "sm_90", AUTO_OPTIONS) == both
    assert serving_units(SPEC, "sm_80", AUTO_OPTIONS) == both[:2]
    for forced in ("mma_sync", "wgmma"):
        opts = Options().replace_path("decode.mla_unit", forced)
        assert serving_units(SPEC, "sm_90", opts) == both[:2]
    assert serving_units(SPEC, "sm_90", DEFAULT) == both[:2]
    llama = load_spec(ROOT / "specs" / "llama3_gqa.yaml")
    for opts in (AUTO_OPTIONS, DEFAULT):
        assert serving_units(llama, "sm_90", opts) == both[:2]


def test_build_plans_the_hopper_unit_for_its_unit_names(requires_nvcc):
    from flashgen.cli.build import _compile_one

    for name, ragged in (("decode_wgmma", False), ("decode_ragged_wgmma", True)):
        res = _compile_one(SPEC, "sm_90", name, AUTO_OPTIONS)
        assert res.ok, res.error
        assert res.plan.template == "sm_90/decode_mla.cu.j2"
        assert res.plan.context["ragged"] == ragged
        assert res.plan.options_key == "decode.mla_unit='wgmma'"
