"""Shipped specs by name (flashgen/frontend/shipped.py): ``load_spec``, ``flashgen.load`` and
the ``show | build | bench | ab`` commands take ``gpt2_d64`` from any directory, a file that
exists wins, an unknown name lists the shipped ones, and an installed wheel carries them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import flashgen
from flashgen.cli.commands import main
from flashgen.frontend.shipped import resolve_spec_path, shipped_spec_paths
from flashgen.frontend.spec import load_spec

REPO = Path(__file__).resolve().parents[2]


def test_every_spec_in_specs_is_shipped():
    assert [p.name for p in shipped_spec_paths()] == sorted(
        p.name for p in (REPO / "specs").glob("*.yaml")
    )


def test_load_spec_takes_a_shipped_name_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_spec("gpt2_d64").name == "gpt2_d64"
    assert load_spec("gpt2_d64.yaml").name == "gpt2_d64"


def test_a_file_that_exists_wins_over_the_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = (REPO / "specs" / "causal_d128.yaml").read_text()
    Path("gpt2_d64").write_text(text)
    assert load_spec("gpt2_d64").name == "causal_d128"


def test_an_unknown_name_lists_the_shipped_specs_with_a_did_you_mean(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="did you mean 'gpt2_d64'") as e:
        resolve_spec_path("gpt2_d46")
    assert "causal_d128" in str(e.value) and "mistral_swa" in str(e.value)
    with pytest.raises(FileNotFoundError, match="nor a shipped spec"):
        resolve_spec_path("nested/gpt2_d64")  # a path, not a name: never looked up


def test_flashgen_load_takes_a_shipped_name(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    op = flashgen.load("gpt2_d64")
    assert op.spec.name == "gpt2_d64"


def test_show_takes_a_shipped_name_from_another_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["show", "gpt2_d64", "--target", "sm_80"]) == 0
    assert "spec gpt2_d64" in capsys.readouterr().out


def test_show_of_an_unknown_name_says_did_you_mean(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["show", "gpt2_d46"]) == 1
    err = capsys.readouterr().err
    assert "did you mean 'gpt2_d64'?" in err and "alibi" in err


def test_build_of_an_unknown_name_says_did_you_mean(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["build", "causal_d12", "--no-verify"]) == 1
    assert "did you mean 'causal_d128'?" in capsys.readouterr().err


def test_ab_takes_a_shipped_name():
    from flashgen.bench.ab import resolve_spec

    path, over = resolve_spec("gpt2_d64:window=64")
    assert path.name == "gpt2_d64.yaml" and over == {"window": 64}


def test_an_installed_wheel_finds_its_shipped_specs_from_any_directory(tmp_path):
    """Build the wheel, install it into a bare folder, run ``flashgen show gpt2_d64`` from
    another directory with only that folder on the path."""
    wheels, target, cwd = tmp_path / "wheels", tmp_path / "site", tmp_path / "cwd"
    cwd.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = pip + ["wheel", "--no-build-isolation", "--no-deps", str(REPO), "-w", str(wheels)]
    done = subprocess.run(build, capture_output=True, text=True, timeout=600)
    if done.returncode:
        pytest.skip(f"cannot build a wheel here: {done.stderr[-500:]}")
    (wheel,) = wheels.glob("flashgen-*.whl")
    install = pip + ["install", "--no-deps", "--no-index", "--target", str(target), str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=600)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(target)}
    show = subprocess.run(
        [sys.executable, "-m", "flashgen", "show", "gpt2_d64", "--target", "sm_80"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert show.returncode == 0, show.stderr
    assert f"({target / 'flashgen' / 'specs' / 'gpt2_d64.yaml'})" in show.stdout
