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
