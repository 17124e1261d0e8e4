"""A new user's and a hostile reviewer's inputs to session 16's changes (the options key
computed once per instance, the ops split into mixins, the ldsm fp8 transposer default):
each once silently wrong; now right or a clear error.  CPU only, no nvcc."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest

from flashgen.families import decode, hopper_fwd
from flashgen.options import Options

ROOT = Path(__file__).resolve().parents[2]


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


def test_copies_and_pickles_do_not_carry_the_options_key_cache():
    """``changed()``'s cache (``_changed`` in the instance dict) went into pickles and copies:
    a pickle's bytes depended on whether ``key()`` had been asked, and one unpickled where the
    defaults differ (as ``hopper_fwd.fp8_transpose``'s did this session) kept the old
    defaults' key."""
    fresh = Options().with_values({"hopper_fwd.fp8_transpose": "lds32"})
    asked = Options().with_values({"hopper_fwd.fp8_transpose": "lds32"})
    assert asked.key() == "hopper_fwd.fp8_transpose='lds32'"
    assert pickle.dumps(asked) == pickle.dumps(fresh)
    for c in (copy.copy(asked), copy.deepcopy(asked), pickle.loads(pickle.dumps(asked))):
        assert "_changed" not in vars(c)  # computed again where it is used
        assert c == asked and hash(c) == hash(asked) and c.key() == asked.key()


def test_an_unpickled_options_key_follows_the_defaults_where_it_is_loaded(monkeypatch):
    """Pickled where lds32 was the default transposer (its key ``""``), loaded where ldsm is:
    the key must name lds32, or the options key of plans and ``registered_name`` call it
    the defaults."""
    defaults = hopper_fwd.Options.__init__.__defaults__
    names = [f for f in hopper_fwd.Options.__dataclass_fields__]
    old = list(defaults)
    old[names.index("fp8_transpose")] = "lds32"
    with monkeypatch.context() as m:  # an earlier version's defaults
        m.setattr(hopper_fwd.Options.__init__, "__defaults__", tuple(old))
        o = Options(hopper_fwd=hopper_fwd.Options(fp8_transpose="lds32"))
        assert o.key() == ""
        blob = pickle.dumps(o)
    assert pickle.loads(blob).key() == "hopper_fwd.fp8_transpose='lds32'"


# ----------------------------------------------------------------------------- load
@pytest.mark.parametrize("bad", [{"family": "fa2"}, "fa2"])
def test_load_and_with_options_name_a_bad_options_argument(bad):
    """``flashgen.load(path, options={"family": "fa2"})`` raised "unhashable type: 'dict'"
    from the load cache's key, and ``options="fa2"`` (or ``op.with_options("fa2")``) an
    AttributeError about ``key`` from inside the registration."""
    import flashgen

    path = ROOT / "specs" / "causal_d128.yaml"
    with pytest.raises(TypeError, match=r"options: expected a flashgen.Options.*got (dict|str)"):
        flashgen.load(path, options=bad)
    with pytest.raises(TypeError, match=r"options: expected a flashgen.Options.*got (dict|str)"):
        flashgen.load(path).with_options(bad)
