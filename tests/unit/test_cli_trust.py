"""Issue 22, command line: spec text cannot drive the terminal, odd files are reported and
skipped, --json always prints JSON, a build whose every unit failed does not claim kernels
compiled, --jobs is checked, notices are plain lines, no torch import without a GPU,
``flashgen cache`` and ``flashgen list`` outside the repository."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import flashgen.cli.build as clibuild
from flashgen.build.cache import CacheWarning
from flashgen.cli.commands import main
from flashgen.cli.common import plain_warnings

REPO = Path(__file__).resolve().parents[2]
CAUSAL = str(REPO / "specs" / "causal_d128.yaml")
OSC52 = "\x1b]52;c;cHduZWQ=\x07"
OSC52_YAML = "\\e]52;c;cHduZWQ=\\a"  # the same, as YAML double-quoted escapes


def test_spec_text_cannot_reach_the_terminal_raw(tmp_path, capsys):
    good = tmp_path / "a.yaml"
    good.write_text(f'name: a\nhead_dim: 64\ndtype: fp16\ndescription: "x{OSC52_YAML}\\u202e"\n')
    (tmp_path / "b.yaml").write_text(f'name: b\nhead_dim: 64\ndtype: fp16\n"k{OSC52_YAML}": 1\n')
    assert main(["list", str(tmp_path)]) == 1
    assert main(["show", str(good), "--target", "sm_80"]) == 0
    assert main(["show", str(tmp_path / "b.yaml")]) == 1
    cap = capsys.readouterr()
    for text in (cap.out, cap.err):
        assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert "\\x1b]52" in cap.out and "\\x1b]52" in cap.err


def test_odd_files_are_reported_and_skipped(tmp_path, capsys):
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")
    (tmp_path / "date.yaml").write_text("name: d\nhead_dim: 64\ndtype: fp16\nmask: 2001-13-45\n")
    (tmp_path / "ok.yaml").write_text("name: ok\nhead_dim: 64\ndtype: fp16\nmask: causal\n")
    assert main(["list", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "zero" in out and "regular file" in out
    assert "date" in out and "date.yaml:4:7" in out
    assert "ok" in out and "causal" in out
    assert main(["show", "/dev/zero"]) == 1
    assert "character device" in capsys.readouterr().err


def _fake_units(fail: bool):
    from flashgen.build.compile import CompileReport

    def one(spec, target, unit, options=None):
        res = clibuild.BuildResult(spec, target, unit)
        if fail:
            res.error = "nvcc failed"
        else:
            res.report = CompileReport(target, target, (), 0.0, "13.0")
        return res

    return one


def test_json_is_printed_when_writing_fails(tmp_path, capsys, monkeypatch):
    import flashgen.build.generate as gen

    monkeypatch.setattr(clibuild, "_compile_one", _fake_units(fail=False))

    def refuse(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gen, "write_generated", refuse)
    rc = main(["build", CAUSAL, "--target", "sm_80", "--out", str(tmp_path), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 1 and doc["ok"] is False and "No space left" in doc["error"]


def test_all_units_failed_does_not_claim_kernels_compiled(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(clibuild, "_compile_one", _fake_units(fail=True))
    monkeypatch.setattr(clibuild, "_cuda_available", lambda: False)
    rc = main(["build", CAUSAL, "--target", "sm_80", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1 and "FAILED" not in err  # the table goes to stdout
    assert "kernels compiled" not in err


@pytest.mark.parametrize("jobs", ["0", "-3"])
def test_jobs_must_be_positive(jobs, capsys):
    with pytest.raises(SystemExit) as info:
        main(["build", CAUSAL, "--jobs", jobs])
    assert info.value.code == 2 and "expected an integer >= 1" in capsys.readouterr().err


def test_notices_print_as_plain_lines(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with plain_warnings():
            warnings.warn(CacheWarning(f"cache is not writable{OSC52}"), stacklevel=1)
    err = capsys.readouterr().err
    assert err.startswith("warning: cache is not writable\\x1b]52")
    assert "RuntimeWarning" not in err and "warnings.warn" not in err


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="a GPU machine")
def test_no_gpu_is_known_without_importing_torch():
    code = (
        "import sys; from flashgen.cli.build import _cuda_available; "
        "print(_cuda_available(), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=120).stdout.split()  # fmt: skip
    assert out == ["False", "False"]


def test_cache_command_shows_and_prunes(tmp_path, capsys, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(root))
    old = root / "0.0.1" / "sm_80" / ("a" * 64)
    old.mkdir(parents=True)
    (old / "kernel.cubin").write_bytes(b"x" * 2048)
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert "0.0.1/sm_80: 1 entries, 2.0 KiB" in out and "--prune removes it" in out
    assert main(["cache", "--prune"]) == 0
    assert "pruned 1 entries" in capsys.readouterr().out and not old.exists()


@pytest.mark.parametrize("days", ["-1", "nan", "inf", "-inf"])
def test_cache_older_than_must_be_a_finite_number_of_days_at_least_0(days, tmp_path, capsys,
                                                                       monkeypatch):
    """``--older-than -1`` set the cutoff a day in the future and deleted kernels used
    seconds ago; nan and inf were taken too.  One line naming the flag, what it takes and the
    value; nothing deleted."""
    root = tmp_path / "cache"
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(root))
    entry = root / "0.0.1" / "sm_80" / ("a" * 64)
    entry.mkdir(parents=True)
    assert main(["cache", "--prune", f"--older-than={days}"]) == 2
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in cap.err and not cap.out, cap
    assert lines[0].startswith("error: --older-than: expected a finite number of days >= 0")
    assert lines[0].endswith(f"got {days}") and entry.exists()
    from flashgen.build import cache

    with pytest.raises(ValueError, match="older_than_days: expected a finite number >= 0"):
        cache.prune(root, float(days))


def test_cache_older_than_without_prune_is_an_error(tmp_path, capsys, monkeypatch):
    """``flashgen cache --older-than 3`` without --prune deleted nothing and said nothing."""
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["cache", "--older-than", "3"]) == 2
    cap = capsys.readouterr()
    assert cap.err.strip() == "error: --older-than needs --prune (flashgen cache --prune " \
        "--older-than 3)" and not cap.out
    assert main(["cache", "--prune", "--older-than", "0"]) == 0  # 0: every kernel


def test_list_outside_the_repository_shows_the_shipped_specs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["list"]) == 0
    assert "causal_d128" in capsys.readouterr().out
