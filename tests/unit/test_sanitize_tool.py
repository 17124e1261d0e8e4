"""tools/sanitize.py's compute-sanitizer log parsing (runs without a GPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("fg_sanitize", REPO / "tools" / "sanitize.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_summary_parsing():
    """Runs anywhere: the parser finds errors and racecheck hazards, absent summaries are None."""
    t = _tool()
    assert t.parse_summary("========= ERROR SUMMARY: 0 errors\n") == (0, 0)
    assert t.parse_summary("========= ERROR SUMMARY: 3 errors\n") == (3, 0)
    log = "RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\nERROR SUMMARY: 1 error"
    assert t.parse_summary(log) == (1, 2)
    assert t.parse_summary("Segmentation fault") == (None, 0)
    r = t.Result("x", "memcheck", 0, 0, 0, True, 1.0, "")
    assert r.clean
    assert not t.Result("x", "memcheck", 0, 0, 0, False, 1.0, "").clean  # driver died
    assert not t.Result("x", "racecheck", 0, 1, 0, True, 1.0, "").clean  # a hazard
