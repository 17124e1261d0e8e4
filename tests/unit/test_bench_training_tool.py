"""tools/bench_training.py (issue 37's targets) runs end to end on CPU and writes its rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_training  # noqa: E402


def test_cpu_smoke_run_writes_every_row(tmp_path):
    argv = ["--device", "cpu", "--seqlen", "16", "--batch", "1", "--heads", "2", "--rounds", "1",
            "--out", str(tmp_path)]  # fmt: skip
    assert bench_training.main(argv) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    rows = {r["row"]: r for r in doc["rows"]}
    assert set(rows) == {"alibi fwd+bwd", "t5_bias fwd+bwd", "gpt_oss_sink fwd",
                         "gpt_oss_sink fwd+bwd", "gpt_oss_sink decode"}  # fmt: skip
    for r in rows.values():
        assert all(c["error"] is None and c["ms"] > 0 for c in r["candidates"].values()), r
        assert r["ratio"] > 0
