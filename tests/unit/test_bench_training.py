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


@pytest.fixture
def no_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cuda_without_a_gpu_is_one_clean_error(no_cuda, capsys):
    """``flashgen bench --training`` (``--device cuda``, the default) without a GPU failed
    inside torch with a traceback: one line saying so and what runs instead, exit 2."""
    assert main(["bench", "--training"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: flashgen bench --training needs a CUDA GPU")
    assert "--device cpu" in err[0]


@pytest.mark.parametrize("flag", ["--batch", "--heads", "--seqlen", "--rounds"])
def test_sizes_and_rounds_below_one_are_argument_errors(flag, capsys):
    """``--batch 0`` (or ``--heads 0``, ``--seqlen 0``, ``--rounds 0``) failed deep inside the
    calls or timed nothing: an argparse error naming the flag (exit 2)."""
    with pytest.raises(SystemExit) as e:
        main(["bench", "--training", "--device", "cpu", flag, "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert f"argument {flag}: {flag[2:]}: expected an int >= 1, got '0'" in err, err


def test_a_cpu_run_marks_the_gpu_only_candidates_and_writes_nothing_without_out(
    tmp_path, monkeypatch, capsys
):
    """On the CPU ``bias trained dparam_diagonal``, ``bias trained dparam_const_tiles`` and
    ``sink by torch ops`` timed calls their option does not change there (noise as ratios):
    they are left out and marked "n/a on cpu".  Without ``--out`` nothing is written, as the
    help says."""
    from flashgen.bench.training import GPU_ONLY

    monkeypatch.chdir(tmp_path)
    argv = ["bench", "--training", "--device", "cpu", "--seqlen", "16", "--batch", "1",
            "--heads", "2", "--rounds", "1"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    assert ("(bias trained dparam_diagonal, bias trained dparam_const_tiles: n/a on cpu)"
            in lines["t5_bias fwd+bwd"])  # fmt: skip
    for row in ("gpt_oss_sink fwd", "gpt_oss_sink fwd+bwd", "gpt_oss_sink decode"):
        assert "(sink by torch ops: n/a on cpu)" in lines[row]
    assert "ratios" not in out and "wrote" not in out
    assert not any(f"{name} " in line.split("(")[0] for name in GPU_ONLY for line in lines.values())
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit):
        main(["bench", "--training", "--help"])
    assert "write DIR/results.json (default: none" in " ".join(capsys.readouterr().out.split())


def test_the_alibi_row_times_the_affine_slopes_on_the_gpu_only(tmp_path, capsys):
    """The alibi row's third call, trained slopes with ``hopper_bwd.dparam_affine``, shapes the
    Hopper backward only: a CPU run leaves it out and says so (results.json: ``omitted``), its
    two other calls timed as before."""
    from flashgen.bench.training import GPU_ONLY

    assert "hopper_bwd.dparam_affine" in GPU_ONLY["slopes trained dparam_affine"]
    argv = ["bench", "--training", "--device", "cpu", "--seqlen", "16", "--batch", "1",
            "--heads", "2", "--rounds", "1", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    assert "(slopes trained dparam_affine: n/a on cpu)" in capsys.readouterr().out
    rows = {r["row"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    alibi = rows["alibi fwd+bwd"]
    assert list(alibi["candidates"]) == ["slopes detached", "slopes trained"]
    assert list(alibi["omitted"]) == ["slopes trained dparam_affine"]
