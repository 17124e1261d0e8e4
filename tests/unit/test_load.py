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


# ----------------------------------------------------------------------- load: the path argument
@pytest.mark.parametrize("bad", [None, 3, b"gpt2_d64"])
def test_load_names_a_path_argument_that_is_not_a_path(bad):
    """``flashgen.load(None)`` raised pathlib's "expected str, bytes or os.PathLike object,
    not NoneType" from inside ``Path()``, naming no argument."""
    with pytest.raises(TypeError, match=r"spec: expected a spec file path or a shipped spec's "
                       r"name \(str or os.PathLike\), got (NoneType|int|bytes)"):
        flashgen.load(bad)


def test_load_of_an_empty_name_says_no_spec_not_that_the_cwd_is_a_directory():
    """``flashgen.load("")`` read ``Path("")``, the working directory, and raised "a spec must
    be a regular file; . is a directory"."""
    want = r"expected a spec file or a shipped spec.s name, got an empty string"
    with pytest.raises(FileNotFoundError, match=want):
        flashgen.load("")
