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
    dotted option, including those of a family record's own range checks."""
    for path, value in [("decode.stages", "9"), ("decode.stages", 9), ("decode.block_n", "48"),
                        ("persistent_ctas", "0"), ("hopper_bwd.head_groups", 3),
                        ("fa2_fwd.affine", "maybe"), ("decode.split_waves", "nan")]:  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(path) + "="):
            Options().replace_path(path, value)
    assert Options().replace_path("decode.stages", "3").decode.stages == 3
    assert Options().replace_path("fa2_fwd.affine", "no").fa2_fwd.affine is False
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
        ("persistent_ctas", "-3", "expected an int >= 1 or None"),
        ("decode.num_splits", "-1", "in [1, 128]"),
        ("decode.min_split_blocks", "-2", "in [1, 16]"),
        ("hopper_fwd.exp2_poly", "-3", "in [0, 16]"),
    ],
)
def test_a_negative_integer_option_is_refused_with_its_range(path, value, expected):
    """``--option persistent_ctas=-3`` said "expected an integer" (the parser took digits
    only): -3 is an integer; the refusal names the option, its range and the value."""
    with pytest.raises(ValueError) as e:
        Options().replace_path(path, value)
    text = str(e.value)
    assert f"Options.{path}={value}:" in text and expected in text, text
    assert "expected an integer" not in text
    assert Options().replace_path("persistent_ctas", "+8").persistent_ctas == 8
