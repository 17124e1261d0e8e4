"""Ops of one spec bound to different options (CPU): each registers its own operator
(``<name>__o<hash>`` with its own ``__backward`` and ``__varlen``), so ``torch.ops``,
``torch.compile`` and ``op.attention`` run that op's options, and each op's kernels are
the ones its options pick."""

from __future__ import annotations

import copy
import hashlib
import pickle
from pathlib import Path

import pytest

from flashgen.families import decode, hopper_fwd

torch = pytest.importorskip("torch")


from flashgen.families import registry  # noqa: E402
from flashgen.frontend.spec import load_spec  # noqa: E402
from flashgen.ops.op import build_op, registered_name  # noqa: E402
from flashgen.options import DEFAULT, Options  # noqa: E402

FA2 = Options(family="fa2")


SPEC_DIR = Path(__file__).resolve().parents[2] / "specs"


def _pair():
    spec = load_spec(SPEC_DIR / "causal_d128.yaml")
    return spec, build_op(spec), build_op(spec, FA2)


def test_options_register_their_own_operators():
    spec, default, fa2 = _pair()
    h = hashlib.sha256(FA2.key().encode()).hexdigest()[:8]
    assert default.name == spec.name == registered_name(spec.name, DEFAULT)
    assert fa2.name == f"{spec.name}__o{h}" == registered_name(spec.name, FA2)
    assert fa2.base_name == spec.name and fa2.options == FA2
    for op in (default, fa2):
        assert hasattr(torch.ops.flashgen, op.name)
        assert hasattr(torch.ops.flashgen, f"{op.name}__backward")
        assert op.torch_op is getattr(torch.ops.flashgen, op.name).default
        assert op.varlen.name == f"{op.name}__varlen" and op.varlen.options == op.options
        assert hasattr(torch.ops.flashgen, f"{op.name}__varlen__backward")
    assert default.torch_op is not fa2.torch_op
    # idempotent, and with_options goes to the same registered op
    assert build_op(spec, FA2) is fa2 and default.with_options(FA2) is fa2
    assert fa2.with_options(DEFAULT) is default


def test_each_op_runs_its_own_options_on_cpu():
    spec, default, fa2 = _pair()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 8, 128, generator=g).to(torch.bfloat16)
    k, v = q.clone(), q.clone()
    o1, lse1 = default.attention(q, k, v)
    o2, lse2 = getattr(torch.ops.flashgen, fa2.name)(q, k, v, 128**-0.5)
    o3, _ = torch.compile(fa2.attention, backend="eager")(q, k, v)
    torch.testing.assert_close(o1, o2)  # the CPU reference: the same numbers
    torch.testing.assert_close(o2, o3)
    assert lse1.shape == lse2.shape


def test_the_kernel_keys_and_plans_differ():
    """The CUDA path keys its kernels by ``options.key()`` and plans through the registry
    with the op's options: on sm_90 the default op runs the Hopper forward, the ``fa2`` op
    the FA2-class one."""
    _, default, fa2 = _pair()
    assert default.options.key() == "" and fa2.options.key() == "family='fa2'"
    plans = {
        op.name: registry.plan_forward(op.spec, "sm_90", op.options) for op in (default, fa2)
    }
    assert plans[default.name].template == "sm_90/fwd.cu.j2"
    assert plans[fa2.name].template == "sm_80/fwd.cu.j2"
    assert registry.select(fa2.spec, "sm_90", "fwd", fa2.options).family == "fa2_fwd"
    assert registry.select(default.spec, "sm_90", "fwd", default.options).family == "hopper_fwd"


def test_a_different_spec_under_a_registered_name_is_refused():
    spec, _, _ = _pair()
    from dataclasses import replace

    other = replace(spec, head_dim=64, head_dim_v=64)
    with pytest.raises(ValueError, match="already registered"):
        build_op(other, FA2)


def test_a_loaded_kernel_is_found_without_recomputing_the_options_key(monkeypatch):
    """op.kernel runs on every call: once its kernel is loaded, the lookup must not walk the
    options' fields again (``Options.key()`` did, ~1 ms per call on the H200, more than a
    4k-token causal forward takes)."""
    spec, default, fa2 = _pair()
    for op in (default, fa2):
        sentinel = object()
        persistent = registry.persistent_scheduler(spec, op.options)
        op._kernels[(0, op.options.key(), persistent)] = sentinel

        def boom(self, path):
            raise AssertionError("the options' fields walked again on a kernel-cache hit")

        with monkeypatch.context() as m:
            m.setattr(Options, "get_path", boom)
            assert op.kernel(torch.device("cuda", 0)) is sentinel
            assert op.kernel(torch.device("cuda", 0)) is sentinel


def test_options_key_is_computed_once_and_not_part_of_equality():
    a, b = Options(persistent="dynamic"), Options(persistent="dynamic")
    assert a.key() == "persistent='dynamic'" and a == b and hash(a) == hash(b)
    assert Options().key() == "" and b.key() == a.key()
    assert Options.paths()[0] == "family" and "hopper_fwd.fp8_transpose" in Options.paths()


# -------------------------------------------------------- Options: string forms, copies and pickles
def test_a_float_option_from_its_string_form_is_a_float():
    """``--option decode.split_waves=2`` (``replace_path`` of a str) stored the str "2": its
    key differed from ``split_waves=2.0``'s and the split heuristic's ``num_sms * ctas * "2"``
    repeated the string (an enormous wave: a silently wrong split count)."""
    o = Options().replace_path("decode.split_waves", "2")
    assert o.decode.split_waves == 2.0 and isinstance(o.decode.split_waves, float)
    assert o == Options().replace_path("decode.split_waves", 2.0)
    assert o.key() == Options().replace_path("decode.split_waves", 2.0).key()
    assert Options().replace_path("decode.split_waves", " 0.5 ").decode.split_waves == 0.5
    with pytest.raises(ValueError,
                       match=r"decode.split_waves: expected a number in 0.25..4, got 'abc'"):
        Options().replace_path("decode.split_waves", "abc")


@pytest.mark.parametrize("bad", ["2", None, True])
def test_decode_options_refuse_a_split_waves_that_is_not_a_number(bad):
    """``decode.Options(split_waves="2")`` passed its range check (``float("2")``) and kept
    the str."""
    with pytest.raises(ValueError, match="Options.decode.split_waves=.*number"):
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
