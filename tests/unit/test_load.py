"""``flashgen.load`` without PyTorch says what is missing (the package itself imports
without torch, so a `pip install -e .` without torch got a bare traceback from op.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import flashgen

SPEC = Path(__file__).resolve().parents[2] / "specs" / "gpt2_d64.yaml"


def test_load_without_torch_names_the_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "flashgen.ops.op", raising=False)
    monkeypatch.setattr(flashgen, "_loaded", {})
    with pytest.raises(ModuleNotFoundError, match="flashgen.load needs PyTorch") as info:
        flashgen.load(SPEC)
    assert info.value.name == "torch"


# ----------------------------------------------------------------------- load: the options argument
@pytest.mark.parametrize("bad", [{"family": "fa2"}, "fa2"])
def test_load_and_with_options_name_a_bad_options_argument(bad):
    """``flashgen.load(path, options={"family": "fa2"})`` raised "unhashable type: 'dict'"
    from the load cache's key, and ``options="fa2"`` (or ``op.with_options("fa2")``) an
    AttributeError about ``key`` from inside the registration."""
    import flashgen

    path = "causal_d128"
    with pytest.raises(TypeError, match=r"options: expected a flashgen.Options.*got (dict|str)"):
        flashgen.load(path, options=bad)
    with pytest.raises(TypeError, match=r"options: expected a flashgen.Options.*got (dict|str)"):
        flashgen.load(path).with_options(bad)
