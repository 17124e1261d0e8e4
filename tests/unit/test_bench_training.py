"""``flashgen bench --training`` (:mod:`flashgen.bench.training`, issue 37's targets) runs
end to end on CPU and writes its rows."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from flashgen.cli.commands import main  # noqa: E402


def test_cpu_smoke_run_writes_every_row(tmp_path):
    argv = ["bench", "--training", "--device", "cpu", "--seqlen", "16", "--batch", "1",
            "--heads", "2", "--rounds", "1", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    rows = {r["row"]: r for r in doc["rows"]}
    assert set(rows) == {"alibi fwd+bwd", "t5_bias fwd+bwd", "gpt_oss_sink fwd",
                         "gpt_oss_sink fwd+bwd", "gpt_oss_sink decode"}  # fmt: skip
    for r in rows.values():
        assert all(c["error"] is None and c["ms"] > 0 for c in r["candidates"].values()), r
        assert r["ratio"] > 0
    # the printed line joins the candidates with ", ": a name must not hold one
    assert not [n for r in rows.values() for n in r["candidates"] if ", " in n]
