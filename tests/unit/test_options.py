"""Kernel options (:mod:`flashgen.options` and the families' ``Options`` records): every
field's value has its declared type, and errors name the dotted option (issue 38, item 8).
Pure Python."""

from __future__ import annotations

import re

import pytest

from flashgen.families import decode, fa2_bwd, fa2_fwd, hopper_bwd, hopper_fwd
from flashgen.options import Options


@pytest.mark.parametrize(
    "make, dotted",
    [
        (lambda: Options(atomic_dq="false"), "Options.atomic_dq"),  # routed to the atomic kernels
        (lambda: Options(sparse_tiles="no"), "Options.sparse_tiles"),
        (lambda: Options(side_terms=1), "Options.side_terms"),
        (lambda: Options(persistent_ctas=True), "Options.persistent_ctas"),
        (lambda: Options(persistent_ctas=8.0), "Options.persistent_ctas"),
        (lambda: fa2_fwd.Options(affine="no"), "Options.fa2_fwd.affine"),
        (lambda: fa2_fwd.Options(fwd_even_loads=0), "Options.fa2_fwd.fwd_even_loads"),
        (lambda: fa2_bwd.Options(bwd_async_stats="yes"), "Options.fa2_bwd.bwd_async_stats"),
        (lambda: hopper_fwd.Options(affine="no"), "Options.hopper_fwd.affine"),
        (lambda: Options(hopper_bwd=hopper_bwd.Options(head_groups="no")),
         "Options.hopper_bwd.head_groups"),
        (lambda: decode.Options(stages=2.5), "Options.decode.stages"),  # rendered STAGES = 2.5
        (lambda: decode.Options(block_n=64.0), "Options.decode.block_n"),
        (lambda: decode.Options(num_splits=2.5), "Options.decode.num_splits"),
        (lambda: decode.Options(ctas_per_sm=2.0), "Options.decode.ctas_per_sm"),
        (lambda: decode.Options(pack_gqa=1), "Options.decode.pack_gqa"),
        (lambda: decode.Options(split_waves=float("inf")), "Options.decode.split_waves"),
    ],
)
def test_option_values_have_their_declared_type(make, dotted):
    """Issue 38, item 8: option values were not type-checked (``"false"`` is truthy, so
    ``atomic_dq="false"`` routed to the atomic backward; ``stages=2.5`` reached nvcc)."""
    with pytest.raises(ValueError, match=re.escape(dotted) + "="):
        make()


def test_option_errors_name_the_dotted_option():
    """``--option`` values go through :meth:`Options.replace_path`: every refusal names the
    dotted option, what it takes and what it got (a range leads: ``decode.stages: expected an
    int in 2..8, got 9``), including those of a family record's own checks."""
    for path, value in [("decode.stages", "9"), ("decode.stages", 9), ("decode.block_n", "48"),
                        ("persistent_ctas", "0"), ("hopper_bwd.head_groups", 3),
                        ("fa2_fwd.affine", "maybe"), ("decode.split_waves", "nan")]:  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(path) + "[=:]"):
            Options().replace_path(path, value)
    with pytest.raises(ValueError, match=r"^decode\.stages: expected an int in 2\.\.8, got 9$"):
        Options().replace_path("decode.stages", "9")
    assert Options().replace_path("decode.stages", "3").decode.stages == 3
    assert Options().replace_path("fa2_fwd.affine", "0").fa2_fwd.affine is False
    assert Options(persistent_ctas=132).persistent_ctas == 132
    assert decode.Options(split_waves=2).split_waves == 2  # an int is a number


def test_an_unknown_option_is_a_key_error_whose_text_is_its_message():
    """``str()`` of a plain KeyError is the repr of its argument, so ``flashgen show --option
    nope=1`` printed the message in quotes; the error's text is the message itself, with a
    "did you mean" for a near miss."""
    with pytest.raises(KeyError) as e:
        Options().replace_path("famly", "fa2")
    text = str(e.value)
    assert text.startswith("unknown option 'famly' (did you mean 'family'?); known: family, ")
    assert "decode.stages" in text and "\n" not in text
    with pytest.raises(KeyError) as e:
        Options().get_path("nope")
    assert str(e.value).startswith("unknown option 'nope'; known: family, ")


DELETED = [
    "hopper_bwd.d64_pt_other_buffer",
    "hopper_bwd.d256_ps_buffers",
    "hopper_bwd.desc_offsets",
    "hopper_bwd.d256_ps_double",
    "hopper_bwd.ds_waits_dv",
]


@pytest.mark.parametrize("path", DELETED)
def test_a_deleted_option_says_it_was_removed_and_suggests_no_other(path):
    """A deleted experiment was an "unknown option" whose near miss was an unrelated option
    (``hopper_bwd.d256_ps_buffers=2``: "did you mean 'hopper_bwd.desc_offsets'?", a knob
    that does something else): it says it was removed, why, and to drop it; still a KeyError
    (:class:`UnknownOptionError`), one line."""
    from flashgen.options import UnknownOptionError

    for call in (lambda: Options().replace_path(path, "1"), lambda: Options().get_path(path)):
        with pytest.raises(UnknownOptionError) as e:
            call()
        text = str(e.value)
        assert text.startswith(f"option {path!r} was removed (") and "drop it" in text, text
        assert "did you mean" not in text and "\n" not in text


@pytest.mark.parametrize(
    "path, value, expected",
    [
        ("persistent_ctas", "-3", "an int >= 1"),
        ("decode.num_splits", "-1", "an int in 1..128"),
        ("decode.min_split_blocks", "-2", "an int in 1..16"),
        ("hopper_fwd.exp2_poly", "-3", "an int in 0..16"),
    ],
)
def test_a_negative_integer_option_is_refused_with_its_range(path, value, expected):
    """``--option persistent_ctas=-3`` said "expected an integer" (the parser took digits
    only): -3 is an integer; the refusal names the option, its range and the value."""
    with pytest.raises(ValueError) as e:
        Options().replace_path(path, value)
    text = str(e.value)
    assert text == f"{path}: expected {expected}, got {value}", text
    assert "expected an integer" not in text
    assert Options().replace_path("persistent_ctas", "+8").persistent_ctas == 8


def test_describe_of_a_removed_option_says_why_as_replace_path_does():
    """``Options.describe("hopper_fwd.exp2_fma_every")`` said "unknown option" with every
    name; it gives the removal reason, as ``replace_path`` does."""
    from flashgen.options import UnknownOptionError

    path = "hopper_fwd.exp2_fma_every"
    with pytest.raises(UnknownOptionError) as described:
        Options.describe(path)
    with pytest.raises(UnknownOptionError) as replaced:
        Options().replace_path(path, "4")
    assert str(described.value) == str(replaced.value)
    assert str(described.value).startswith(f"option {path!r} was removed (hopper_fwd.exp2_poly")
    with pytest.raises(UnknownOptionError, match=r"did you mean 'decode.stages'"):
        Options.describe("decode.stage")


def test_describe_shows_int_ranges_and_values():
    """``describe`` (and ``flashgen ab --list-options``) said ``int`` for ``decode.stages``
    and ``hopper_bwd.d64_block_m``: their ranges and values are shown."""
    assert Options.describe("decode.stages") == "int in 2..8, or none"
    assert Options.describe("hopper_bwd.d64_block_m") == "one of 64, 128"
    assert Options.describe("decode.merge_unroll") == "one of 4, 8, 16"
    assert Options.describe("decode.block_n") == "int, a positive multiple of 64, or none"
    assert Options.describe("decode.split_waves") == "number in 0.25..4"
    assert Options.describe("persistent_ctas") == "int >= 1, or none"
    assert Options.describe("hopper_fwd.exp2_poly") == "int in 0..16"


def _field(path, value):
    """The record of dotted ``path`` built with ``value`` (the Python API's own check)."""
    head, _, rest = path.partition(".")
    if not rest:
        return Options(**{head: value})
    from flashgen.options import FAMILY_OPTIONS

    return FAMILY_OPTIONS[head](**{rest: value})


def test_the_value_ranges_agree_with_the_records_checks():
    """:data:`VALUE_RANGES` (what describe shows and replace_path refuses by) and each record's
    own ``__post_init__`` accept and refuse the same values at the edges; every int / float
    field has a range."""
    from flashgen.options import VALUE_RANGES, _hint_args

    numeric = [p for p in Options.paths() if {int, float} & set(_hint_args(p))]
    assert sorted(numeric) == sorted(VALUE_RANGES)
    for path, rng in VALUE_RANGES.items():
        kind = int if int in _hint_args(path) else float
        if rng[0] == "range":
            step = 1 if kind is int else 0.01
            good = [rng[1]] + ([rng[2]] if rng[2] is not None else [rng[1] + 1000])
            bad = [rng[1] - step] + ([rng[2] + step] if rng[2] is not None else [])
        elif rng[0] == "choices":
            good, bad = list(rng[1]), [min(rng[1]) - 1, max(rng[1]) + 1]
        else:
            good, bad = [rng[1], 3 * rng[1]], [0, rng[1] // 2, rng[1] + 1]
        for v in good:
            _field(path, v)
            assert Options().replace_path(path, v).get_path(path) == v
        for v in bad:
            with pytest.raises(ValueError):
                _field(path, v)
            with pytest.raises(ValueError, match=rf"^{re.escape(path)}: expected .*, got {v}$"):
                Options().replace_path(path, v)


def test_bool_options_take_true_false_1_0_as_strings_and_bools_from_python():
    """One rule, which ``describe`` states: the string forms (``--option``) are true / false /
    1 / 0 in any case ("yes" / "on" were taken too, unlisted); from Python a bool."""
    path = "fa2_fwd.affine"
    assert Options.describe(path) == "bool (true, false, 1, 0)"
    for text, want in (("true", True), ("FALSE", False), ("1", True), (" 0 ", False)):
        assert Options().replace_path(path, text).get_path(path) is want
    for text in ("yes", "no", "on", "off", ""):
        with pytest.raises(ValueError, match=rf"^{path}: expected a bool \(true, false, 1, 0\)"):
            Options().replace_path(path, text)
    assert Options().replace_path(path, False).get_path(path) is False
    for value in (1, 0, "maybe"):
        with pytest.raises(ValueError):
            Options().replace_path(path, value)


def test_an_empty_value_is_not_none():
    """``replace_path("decode.stages", "")`` set None (the default) in silence: only
    ``none`` means None."""
    with pytest.raises(ValueError, match=r"^decode.stages: expected an int in 2..8, or none, "
                       r"got ''$"):  # fmt: skip
        Options().replace_path("decode.stages", "")
    assert Options().replace_path("decode.stages", "None").decode.stages is None


def test_with_values_takes_a_mapping():
    """``Options().with_values([("decode.stages", 4)])`` failed inside on ``.items()``: a
    TypeError naming the argument and the mapping it takes."""
    for bad in ([("decode.stages", 4)], "decode.stages=4", None):
        with pytest.raises(TypeError, match=r"^assignments: expected a mapping \{dotted name: "
                           rf"value\}}.*, got {type(bad).__name__}$"):  # fmt: skip
            Options().with_values(bad)
    assert Options().with_values({"decode.stages": 4}).decode.stages == 4


def test_balance_waves_with_a_fixed_split_count_is_refused():
    """``decode.balance_waves`` picks the split count: with a fixed ``decode.num_splits`` it
    did nothing, in silence."""
    with pytest.raises(ValueError, match=r"^Options.decode.balance_waves=True with Options.decode."
                       r"num_splits=4: expected num_splits None"):  # fmt: skip
        decode.Options(balance_waves=True, num_splits=4)
    with pytest.raises(ValueError, match="balance_waves"):
        Options().with_values({"decode.num_splits": 4, "decode.balance_waves": "1"})
    assert decode.Options(balance_waves=True).num_splits is None
    assert decode.Options(num_splits=4).balance_waves is False
