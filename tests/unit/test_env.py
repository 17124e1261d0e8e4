"""flashgen.env: the one module that reads the environment (paths and debugging only); the
removed kernel switches raise naming the option that replaced them."""

from __future__ import annotations

import pytest

from flashgen import env


@pytest.mark.parametrize("value", ["1", "true", "TRUE", " yes ", "on"])
def test_flag_true_values(monkeypatch, value):
    monkeypatch.setenv(env.POISON_OUTPUTS, value)
    assert env.flag(env.POISON_OUTPUTS) is True


@pytest.mark.parametrize("value", ["0", "false", "No", "off"])
def test_flag_false_values(monkeypatch, value):
    monkeypatch.setenv(env.POISON_OUTPUTS, value)
    assert env.flag(env.POISON_OUTPUTS, default=True) is False


def test_flag_unset_or_empty_is_the_default(monkeypatch):
    monkeypatch.delenv(env.VARLEN_CHECK, raising=False)
    assert env.flag(env.VARLEN_CHECK) is False and env.flag(env.VARLEN_CHECK, None) is None
    monkeypatch.setenv(env.VARLEN_CHECK, "")
    assert env.flag(env.VARLEN_CHECK, True) is True


def test_flag_refuses_typos(monkeypatch):
    monkeypatch.setenv(env.POISON_OUTPUTS, "maybe")
    with pytest.raises(ValueError, match=r"FLASHGEN_POISON_OUTPUTS='maybe': expected one of 1"):
        env.flag(env.POISON_OUTPUTS)


def test_only_the_listed_names_are_read(monkeypatch):
    """At most five names, paths and debugging only; any other name is a programming error."""
    assert len(env.READ) <= 5 and not set(env.READ) & set(env.REMOVED)
    monkeypatch.setenv(env.CACHE_DIR, "/tmp/x")
    assert env.get(env.CACHE_DIR) == "/tmp/x"
    with pytest.raises(ValueError, match="flashgen reads no environment variable"):
        env.get("FLASHGEN_KERNEL_FAMILY")


def test_removed_switches_raise_naming_their_option(monkeypatch):
    for name in env.REMOVED:
        monkeypatch.delenv(name, raising=False)
    env.check_removed()  # none set: nothing to say
    monkeypatch.setenv("FLASHGEN_PERSISTENT", "dynamic")
    monkeypatch.setenv("FLASHGEN_HEAD_GROUPS", "")  # set, even empty, is refused
    with pytest.raises(env.RemovedVariableError) as e:
        env.check_removed()
    text = str(e.value)
    assert "FLASHGEN_PERSISTENT: use flashgen.load(spec, options=Options(...))" in text
    assert "persistent='off'|'static'|'m_major'|'dynamic'" in text
    assert "FLASHGEN_HEAD_GROUPS: use Options().replace_path('hopper_fwd.head_groups'" in text


def test_every_removed_switch_names_a_real_option():
    """Each replacement that names a dotted option names one flashgen.Options has."""
    import re

    from flashgen.options import Options

    for name, text in env.REMOVED.items():
        for path in re.findall(r"replace_path\('([\w.]+)'", text):
            assert path in Options.paths(), (name, path)
        for field in re.findall(r"with (\w+)=", text):
            assert field in Options.paths(), (name, field)


def test_load_refuses_a_removed_switch(monkeypatch, tmp_path):
    import flashgen

    monkeypatch.setenv("FLASHGEN_SIDE_TERMS", "0")
    with pytest.raises(env.RemovedVariableError, match="side_terms=False"):
        flashgen.load(tmp_path / "never_read.yaml")


def test_the_tma_cache_switch_is_a_function():
    from flashgen.runtime import tma

    try:
        tma.set_cache_enabled(False)
        assert not tma.DescriptorCache().enabled
    finally:
        tma.set_cache_enabled(True)
    assert tma.DescriptorCache().enabled
