"""tools/mask_ab.py without a GPU: the modes it times (which switches each sets)."""

from __future__ import annotations

from patched_kernels import load_tool


def _tool():
    return load_tool("mask_ab")


def test_modes_plain_and_valued_switches():
    modes = _tool().modes
    assert modes(False, ("FLASHGEN_SPARSE_PERSISTENT=dynamic",)) == {
        "new": {"FLASHGEN_SPARSE_PERSISTENT": "dynamic"},
        "old": {"FLASHGEN_SPARSE_PERSISTENT": "0"},
    }
    got = modes(True, ("FLASHGEN_A", "FLASHGEN_B=x"))
    assert got["new"] == {"FLASHGEN_A": "1", "FLASHGEN_B": "x"}
    assert got["old"] == {"FLASHGEN_A": "0", "FLASHGEN_B": "0"}
    assert got["no_a"] == {"FLASHGEN_A": "0", "FLASHGEN_B": "x"}
    assert got["no_b"] == {"FLASHGEN_A": "1", "FLASHGEN_B": "0"}


def test_under_sets_the_switches_only_during_the_call(monkeypatch):
    import os

    monkeypatch.delenv("FLASHGEN_T_SW", raising=False)
    seen = _tool()._under({"FLASHGEN_T_SW": "dynamic"}, os.environ.get, "FLASHGEN_T_SW")
    assert seen == "dynamic" and "FLASHGEN_T_SW" not in os.environ
