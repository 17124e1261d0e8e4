"""tools/sanitize.py's compute-sanitizer log parsing (runs without a GPU)."""

from __future__ import annotations

import importlib.util
import json
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


def test_driver_runs_the_backward_unless_fwd_only(tmp_path):
    """The sanitized driver takes "fwd+bwd" (default) or "fwd" before the sizes, and
    its code compiles; checked with a stand-in sanitizer that records its arguments."""
    t = _tool()
    compile(t.DRIVER, "driver", "exec")
    assert "o.backward(" in t.DRIVER and 'sys.argv[2] == "fwd+bwd"' in t.DRIVER
    fake = tmp_path / "fake-sanitizer"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$0.args"\necho "ERROR SUMMARY: 0 errors"\n')
    fake.chmod(0o755)
    spec = REPO / "specs" / "causal_d128.yaml"
    for backward, mode in ((True, "fwd+bwd"), (False, "fwd")):
        r = t.run_one(spec, "memcheck", str(fake), [], 30, backward=backward)
        args = (tmp_path / "fake-sanitizer.args").read_text().splitlines()
        assert args[args.index(str(spec)) + 1] == mode
        assert args[args.index(str(spec)) + 2] == "{}"  # no options: the defaults
        assert r.errors == 0 and not r.driver_ok  # the stand-in never runs the driver
    opts = {"hopper_bwd.ordered_dq": True, "hopper_bwd.d64_block_m": 128}
    t.run_one(spec, "memcheck", str(fake), [], 30, options=opts)
    args = (tmp_path / "fake-sanitizer.args").read_text().splitlines()
    assert json.loads(args[args.index(str(spec)) + 2]) == opts


def test_bad_option_is_a_setup_error(capsys):
    """``--option`` names a real option with a valid value, or the tool exits 2 naming it
    before compiling anything."""
    t = _tool()
    assert t.main(["--option", "hopper_bwd.d64_block_m=96", "--specs", "causal_d128"]) == 2
    assert "d64_block_m" in capsys.readouterr().err
