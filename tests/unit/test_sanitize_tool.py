"""tools/sanitize.py's compute-sanitizer log parsing (runs without a GPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from patched_kernels import load_tool

REPO = Path(__file__).resolve().parents[2]


def _tool():
    """tools/sanitize.py as a module."""
    return load_tool("sanitize")


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


def _fake_sanitizer(tmp_path) -> Path:
    """A stand-in compute-sanitizer that records its arguments and reports no error."""
    fake = tmp_path / "fake-sanitizer"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$0.args"\necho "ERROR SUMMARY: 0 errors"\n')
    fake.chmod(0o755)
    return fake


def test_driver_gets_the_deterministic_and_param_grad_flags(tmp_path):
    """``run_one`` passes ``{"deterministic", "param_grads"}`` as JSON after the options and
    before the sizes, and records the flags, the trained params and the options."""
    t = _tool()
    assert "sys.argv[5:]" in t.DRIVER and "json.loads(sys.argv[4])" in t.DRIVER
    fake = _fake_sanitizer(tmp_path)
    spec = REPO / "specs" / "t5_bias.yaml"
    sizes = [",".join(map(str, s)) for s in t.SIZES]
    opts = {"hopper_bwd.dparam_diagonal": True}
    for det, pg in ((False, False), (True, False), (False, True), (True, True)):
        r = t.run_one(spec, "memcheck", str(fake), [], 30, options=opts, deterministic=det,
                      param_grads=pg, trained=["bias"] if pg else None)  # fmt: skip
        args = (tmp_path / "fake-sanitizer.args").read_text().splitlines()
        i = args.index(str(spec))
        assert args[i + 1] == "fwd+bwd" and json.loads(args[i + 2]) == opts
        assert json.loads(args[i + 3]) == {"deterministic": det, "param_grads": pg}
        assert args[i + 4 :] == sizes
        assert (r.deterministic, r.param_grads, r.trained) == (det, pg, ["bias"] if pg else [])
        assert r.options == opts and not r.skipped and r.paths == [] and r.param_units == []


def test_call_kwargs_trains_the_params_the_op_differentiates():
    """The driver's (and :data:`PREBUILD`'s) ``call_kwargs`` makes exactly
    :func:`flashgen.bench.protocol.trained_params`' params leaves requiring grad (copies:
    the caller's tensors stay as they were), adds ``deterministic=True`` only when asked;
    run on the CPU op, each trained param gets a finite gradient."""
    import torch

    import flashgen
    from flashgen.bench.protocol import trained_params
    from flashgen.bench.verify import random_inputs

    t = _tool()
    ns: dict = {}
    exec(compile(t.CALL, "call", "exec"), ns)
    compile(t.PREBUILD, "prebuild", "exec")
    cpu = torch.device("cpu")
    for name in ("t5_bias", "alibi_learned", "causal_d128"):
        op = flashgen.load(REPO / "specs" / f"{name}.yaml")
        q, k, v, params = random_inputs(op.spec, 1, 2, 1, 5, 7, cpu)
        kw, trained = ns["call_kwargs"](op, params, {"deterministic": False, "param_grads": False})
        assert trained == () and kw == params  # the defaults: nothing changes
        kw, trained = ns["call_kwargs"](op, params, {"deterministic": True, "param_grads": True})
        assert trained == trained_params(op.spec)
        assert (name == "causal_d128") == (trained == ())
        assert kw.pop("deterministic") is True
        for n, val in kw.items():
            assert kw[n].requires_grad == (n in trained) and not params[n].requires_grad
            assert torch.equal(val.detach(), params[n])
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        o, _ = op.attention(q, k, v, deterministic=True, **kw)
        o.backward(torch.randn_like(o))
        for n in trained:
            assert kw[n].grad is not None and torch.isfinite(kw[n].grad).all(), (name, n)


def test_parse_paths():
    """The paths and the param-gradient units the driver printed; none where it printed none."""
    t = _tool()
    log = (
        "FLASHGEN BACKWARD PATHS ['hopper']\n"
        'FLASHGEN PARAM GRAD UNITS [["hopper", ["bias"]]]\n'
        "FLASHGEN DRIVER OK\n========= ERROR SUMMARY: 0 errors\n"
    )
    assert t.parse_paths(log) == (["hopper"], ["hopper[bias]"])
    log = (
        "FLASHGEN BACKWARD PATHS ['deterministic', 'hopper_ordered']\n"
        "FLASHGEN PARAM GRAD UNITS []\n"
    )
    assert t.parse_paths(log) == (["deterministic", "hopper_ordered"], [])
    assert t.parse_paths("Segmentation fault") == ([], [])
    assert t.parse_paths("FLASHGEN BACKWARD PATHS ['hop") == ([], [])  # cut off: nothing


def test_skip_reason():
    """Which specs run under the flags: every one without them; under ``--param-grads``
    those with a param :func:`flashgen.bench.protocol.trained_params` names (and it names
    them); under either flag only those with backward kernels."""
    t = _tool()
    specs = REPO / "specs"
    for name in ("causal_d128", "llama3_fp8", "t5_bias"):
        assert t.skip_reason(specs / f"{name}.yaml", False, False) == ("", [])
    assert t.skip_reason(specs / "t5_bias.yaml", False, True) == ("", ["bias"])
    assert t.skip_reason(specs / "alibi.yaml", True, True) == ("", ["slopes"])
    assert t.skip_reason(specs / "causal_d128.yaml", True, False) == ("", [])
    why, trained = t.skip_reason(specs / "causal_d128.yaml", False, True)
    assert "no f32 tensor param" in why and trained == []
    assert t.skip_reason(specs / "llama3_fp8.yaml", True, False)[0] == "no backward kernels"


def test_table_header_says_which_calls_ran():
    """The header line names the flags and options; a skipped run is "skip" with its reason
    in the paths column, neither clean nor failed; a run's paths and dparam units show."""
    t = _tool()
    head = t.header(True, True, True, {"hopper_bwd.dparam_diagonal": True, "x.y": 3})
    assert "deterministic=1" in head and "param_grads=1" in head
    assert "hopper_bwd.dparam_diagonal=1 x.y=3" in head
    assert "deterministic=0  param_grads=0  options: defaults" in t.header(True, False, False, {})
    ran = t.Result("t5_bias", "memcheck", 0, 0, 0, True, 1.0, "", param_grads=True,
                   trained=["bias"], paths=["hopper"], param_units=["hopper[bias]"])  # fmt: skip
    skip = t.Result("causal_d128", "memcheck", None, 0, 0, False, 0.0, "", param_grads=True,
                    skipped="no f32 tensor param the op differentiates")  # fmt: skip
    assert ran.clean and not ran.failed and not skip.clean and not skip.failed
    text = t.table([ran, skip], ["memcheck"], head)
    lines = text.splitlines()
    assert lines[0] == head and lines[1].split()[-2:] == ["backward", "paths"]
    assert lines[2].split()[:2] == ["causal_d128", "skip"]
    assert "skipped: no f32 tensor param" in lines[2]
    assert lines[3].split() == ["t5_bias", "ok", "hopper", "(dparam", "hopper[bias])"]


def test_path_flags_need_the_backward(capsys):
    """``--deterministic`` / ``--param-grads`` with ``--fwd-only`` is a setup error."""
    t = _tool()
    for flag in ("--deterministic", "--param-grads"):
        assert t.main([flag, "--fwd-only", "--specs", "causal_d128"]) == 2
        assert flag in capsys.readouterr().err


def test_param_grads_skips_a_spec_without_params(tmp_path, monkeypatch, capsys):
    """``--param-grads`` on a spec with no param to differentiate runs nothing (no compile,
    no sanitizer run), exits 0, and says so in the table and the JSON."""
    t = _tool()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _fake_sanitizer(bindir).rename(bindir / "compute-sanitizer")
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "r.json"
    argv = ["--param-grads", "--specs", "causal_d128", "--tools", "memcheck", "racecheck",
            "--option", "hopper_bwd.dparam_diagonal=1", "--json", str(out)]  # fmt: skip
    assert t.main(argv) == 0
    text = capsys.readouterr().out
    assert "param_grads=1" in text and "hopper_bwd.dparam_diagonal=1" in text
    assert "0/0 clean, 2 skipped" in text and "skipped: no f32 tensor param" in text
    assert not (bindir / "compute-sanitizer.args").exists()  # never run on a spec
    records = json.loads(out.read_text())
    assert [r["tool"] for r in records] == ["memcheck", "racecheck"]
    for r in records:
        assert r["skipped"].startswith("no f32 tensor param") and r["param_grads"] is True
        assert r["deterministic"] is False and r["trained"] == []
        assert r["options"] == {"hopper_bwd.dparam_diagonal": True}
