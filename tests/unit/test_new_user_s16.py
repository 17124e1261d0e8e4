"""A new user's and a hostile reviewer's inputs to session 16's changes (the options key
computed once per instance, the ops split into mixins, the ldsm fp8 transposer default):
each once silently wrong; now right or a clear error.  CPU only, no nvcc."""

from __future__ import annotations

import pytest

from flashgen.families import decode
from flashgen.options import Options


# ----------------------------------------------------------------------------- options
def test_a_float_option_from_its_string_form_is_a_float():
    """``--option decode.split_waves=2`` (``replace_path`` of a str) stored the str "2": its
    key differed from ``split_waves=2.0``'s and the split heuristic's ``num_sms * ctas * "2"``
    repeated the string (an enormous wave: a silently wrong split count)."""
    o = Options().replace_path("decode.split_waves", "2")
    assert o.decode.split_waves == 2.0 and isinstance(o.decode.split_waves, float)
    assert o == Options().replace_path("decode.split_waves", 2.0)
    assert o.key() == Options().replace_path("decode.split_waves", 2.0).key()
    assert Options().replace_path("decode.split_waves", " 0.5 ").decode.split_waves == 0.5
    with pytest.raises(ValueError, match=r"decode.split_waves='abc': expected a number"):
        Options().replace_path("decode.split_waves", "abc")


@pytest.mark.parametrize("bad", ["2", None, True])
def test_decode_options_refuse_a_split_waves_that_is_not_a_number(bad):
    """``decode.Options(split_waves="2")`` passed its range check (``float("2")``) and kept
    the str."""
    with pytest.raises(ValueError, match="split_waves must be a number"):
        decode.Options(split_waves=bad)
