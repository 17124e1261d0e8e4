"""compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over one spec's kernel."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.device_memory(8)
@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="no compute-sanitizer")
def test_sanitizers_clean_on_one_spec(tmp_path):
    out = subprocess.run(
        [sys.executable, str(REPO / "tools" / "sanitize.py"), "--specs", "mistral_swa",
         "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=3000, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert "4/4 clean" in out.stdout
