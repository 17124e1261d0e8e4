"""flashgen.envflags: one parser for the FLASHGEN_* on/off switches."""

from __future__ import annotations

import os

import pytest
from flashgen.envflags import flag


@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_on_values(monkeypatch, value):
    monkeypatch.setenv("FLASHGEN_X", value)
    assert flag("FLASHGEN_X") is True


@pytest.mark.parametrize("value", ["0", "false", "No", "off"])
def test_off_values(monkeypatch, value):
    monkeypatch.setenv("FLASHGEN_X", value)
    assert flag("FLASHGEN_X", default=True) is False


def test_unset_and_empty_give_the_default(monkeypatch):
    monkeypatch.delenv("FLASHGEN_X", raising=False)
    assert flag("FLASHGEN_X") is False and flag("FLASHGEN_X", None) is None
    monkeypatch.setenv("FLASHGEN_X", "")
    assert flag("FLASHGEN_X", True) is True


def test_other_values_are_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("FLASHGEN_X", "maybe")
    with pytest.raises(ValueError, match=r"FLASHGEN_X='maybe': expected one of 1, true"):
        flag("FLASHGEN_X")


def test_atomic_dq_switch_reads_yes_and_refuses_typos(monkeypatch):
    """FLASHGEN_ATOMIC_DQ=yes used to be read as off (only "1" counted)."""
    from flashgen.ops.backward import atomic_dq_enabled

    monkeypatch.setenv("FLASHGEN_ATOMIC_DQ", "yes")
    assert atomic_dq_enabled()
    monkeypatch.setenv("FLASHGEN_ATOMIC_DQ", "ture")
    with pytest.raises(ValueError, match="FLASHGEN_ATOMIC_DQ"):
        atomic_dq_enabled()


def test_no_tma_cache_switch(monkeypatch):
    from flashgen.runtime.tma import DescriptorCache

    monkeypatch.setenv("FLASHGEN_NO_TMA_CACHE", "true")
    assert not DescriptorCache().enabled
    monkeypatch.setenv("FLASHGEN_NO_TMA_CACHE", "0")
    assert DescriptorCache().enabled


def test_scoped_env_sets_and_restores(monkeypatch):
    from flashgen.envflags import scoped_env

    monkeypatch.setenv("FLASHGEN_T_KEEP", "a")
    monkeypatch.delenv("FLASHGEN_T_NEW", raising=False)
    with scoped_env({"FLASHGEN_T_KEEP": "b", "FLASHGEN_T_NEW": "c"}):
        assert os.environ["FLASHGEN_T_KEEP"] == "b" and os.environ["FLASHGEN_T_NEW"] == "c"
    assert os.environ["FLASHGEN_T_KEEP"] == "a" and "FLASHGEN_T_NEW" not in os.environ
    with pytest.raises(RuntimeError), scoped_env({"FLASHGEN_T_NEW": "d"}):
        raise RuntimeError("inside")
    assert "FLASHGEN_T_NEW" not in os.environ  # restored when the block raises too
