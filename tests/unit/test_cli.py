"""The flashgen command line: build, show, list, errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flashgen.cli.commands import format_expr, main
from flashgen.frontend.spec import load_spec, loads_spec

REPO = Path(__file__).resolve().parents[2]
CAUSAL = str(REPO / "specs" / "causal_d128.yaml")
ALIBI = str(REPO / "specs" / "alibi.yaml")


def test_build_writes_generated_and_prints_table(tmp_path, capsys, requires_nvcc):
    out = tmp_path / "gen"
    rc = main(["build", CAUSAL, ALIBI, "--out", str(out), "--no-verify", "--jobs", "2"])
    text = capsys.readouterr().out
    assert rc == 0, text
    for name in ("causal_d128", "alibi"):
        assert name in text
        assert (out / name / f"{name}_sm_80.cu").exists()
        assert (out / name / f"{name}_sm_90.cu").exists()
        man = json.loads((out / name / "manifest.json").read_text())
        assert man["targets"]["sm_80"]["resources"]["spill_stores"] == 0
    assert "regs" in text and "sm_90" in text
    assert (out / "__init__.py").exists()


def test_build_json_and_target_filter(tmp_path, capsys, requires_nvcc):
    rc = main(
        ["build", CAUSAL, "--target", "sm_80", "--out", str(tmp_path), "--json", "--no-verify"]
    )
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["ok"]
    assert [(k["spec"], k["target"], k["unit"]) for k in doc["kernels"]] == [
        ("causal_d128", "sm_80", "fwd"),
        ("causal_d128", "sm_80", "bwd"),
        ("causal_d128", "sm_80", "bwd_atomic"),
        ("causal_d128", "sm_80", "decode"),
        ("causal_d128", "sm_80", "decode_ragged"),
    ]
    k = doc["kernels"][0]
    assert k["spill_stores"] == 0 and k["spill_loads"] == 0 and k["registers"] > 0
    assert k["smem_dynamic"] > 0
    assert sorted(p.name for p in (tmp_path / "causal_d128").glob("*.cu")) == [
        "causal_d128_sm_80.cu",
        "causal_d128_sm_80_bwd.cu",
    ]


def test_bad_spec_exits_1_with_location(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nhead_dim: 128\ndtype: bf16\nmask: q_idx <\n")
    rc = main(["build", str(bad), "--out", str(tmp_path / "gen"), "--no-verify"])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"{bad}:4:" in err and "^" in err
    assert not (tmp_path / "gen").exists()


def test_long_spec_error_is_not_wrapped(tmp_path, capsys):
    """The caret stays under the offending column however long the line (no console wrap)."""
    bad = tmp_path / "long.yaml"
    expr = " + ".join(["score"] * 30) + " + nope"
    bad.write_text(f"name: long\nhead_dim: 128\ndtype: bf16\nscore_mod: {expr}\n")
    assert main(["show", str(bad)]) == 1
    lines = capsys.readouterr().err.splitlines()
    src = next(i for i, line in enumerate(lines) if line.endswith("+ nope"))
    assert lines[src].lstrip().startswith("...")  # clipped to a window around the column
    assert len(lines[src]) < 140 and lines[src + 1].strip() == "^"
    assert lines[src + 1].index("^") == lines[src].index("nope")


def test_missing_nvcc_is_explained(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLASHGEN_NVCC", "/nonexistent/nvcc")
    rc = main(["build", CAUSAL, "--out", str(tmp_path), "--no-verify"])
    assert rc == 1
    assert "nvcc" in capsys.readouterr().err


def test_show_prints_ir_and_source(capsys):
    assert main(["show", ALIBI, "--target", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert "score - slopes[h] * (q_idx + seqlen_k - seqlen_q - kv_idx)" in out
    assert "slopes: tensor [num_heads] f32" in out
    assert "flashgen_alibi_fwd_sm_90" in out and 'extern "C"' in out
    assert "flashgen_alibi_fwd_sm_80" not in out


def test_show_prints_exclusive_bounds_as_declared(tmp_path, capsys):
    """``above: 0`` is held as the least float32 above 0 (the bound the op enforces), and
    ``flashgen show`` printed that: ``(min 1.401298464324817e-45)``.  It prints the bound as
    declared, for f32 and i32 params, ``above`` and ``below``; ``min`` / ``max`` as before."""
    assert main(["show", str(REPO / "specs" / "gemma2_softcap.yaml"), "--target", "sm_80"]) == 0
    out = capsys.readouterr().out
    assert "    softcap: f32 = 50.0   (above 0.0)\n" in out and "e-45" not in out
    spec = tmp_path / "bounds.yaml"
    spec.write_text(
        "name: bounds\nhead_dim: 64\ndtype: bf16\nmask: kv_idx < n && kv_idx >= m\n"
        "score_mod: score * c + d\nparams:\n"
        "  n: {type: i32, default: 4, above: 0, below: 100}\n"
        "  m: {type: i32, default: 0, min: 0, max: 8}\n"
        "  c: {type: f32, default: 1.0, above: -0.5, below: 2.5}\n"
        "  d: {type: f32, default: 0.0, min: -1.0}\n"
    )
    assert main(["show", str(spec), "--target", "sm_80"]) == 0
    out = capsys.readouterr().out
    assert "    n: i32 = 4   (above 0, below 100)\n" in out
    assert "    m: i32 = 0   (min 0, max 8)\n" in out
    assert "    c: f32 = 1.0   (above -0.5, below 2.5)\n" in out
    assert "    d: f32 = 0.0   (min -1.0)\n" in out


def test_show_prints_the_sink(capsys):
    assert main(["show", str(REPO / "specs" / "gpt_oss_sink.yaml"), "--target", "sm_80"]) == 0
    out = capsys.readouterr().out
    assert "sink           sinks[h]" in out
    assert main(["show", ALIBI, "--target", "sm_80"]) == 0
    assert "  sink " not in capsys.readouterr().out


def test_show_lists_the_options_in_effect_and_which_the_shown_unit_does_not_use(capsys):
    """``flashgen show SPEC --option X=Y`` printed the same plan line with or without the
    option: the plan section lists the non-default options, and one that concerns a unit
    show does not print (a decode option beside the forward) says so."""

    def options_lines(*argv):
        argv = argv if argv[0].endswith(".yaml") else (CAUSAL, *argv)
        assert main(["show", *argv]) == 0
        return [x for x in capsys.readouterr().out.splitlines() if x.startswith("// ---- opt")]

    assert options_lines("--target", "sm_80") == []
    assert options_lines("--target", "sm_80", "--option", "fa2_fwd.affine=0") == [
        "// ---- options [sm_80]: fa2_fwd.affine=False"
    ]
    (line,) = options_lines("--target", "sm_80", "--option", "decode.fused_sink=0",
                            "--option", "fa2_fwd.fwd_even_loads=1")  # fmt: skip
    assert line.startswith("// ---- options [sm_80]: fa2_fwd.fwd_even_loads=True; "
                           "decode.fused_sink=False (not in the unit shown: ")  # fmt: skip
    assert "decode" in line.split("not in the unit shown")[1]
    (line,) = options_lines("--target", "sm_90", "--option", "fa2_fwd.affine=0")
    assert "fa2_fwd.affine=False (not in the unit shown: " in line and "FA2-class" in line
    (line,) = options_lines("--target", "sm_90", "--option", "family=fa2",
                            "--option", "fa2_fwd.affine=0")  # fmt: skip
    assert line == "// ---- options [sm_90]: family=fa2; fa2_fwd.affine=False"
    mla = str(REPO / "specs" / "mla_decode.yaml")
    assert options_lines(mla, "--target", "sm_90", "--option", "decode.num_splits=4") == [
        "// ---- options [sm_90]: decode.num_splits=4"
    ]
    from flashgen.cli.show import _OPTION_UNITS
    from flashgen.options import Options

    assert {p.partition(".")[0] for p in Options.paths()} <= set(_OPTION_UNITS)


def test_show_says_the_effective_exp2_poly_share_and_refuses_it_with_exact_softmax(capsys):
    """``--option hopper_fwd.exp2_poly=1`` at BLOCK_N 80 (bidir_d256) put no tile on the FMA
    pipe while show listed it as in effect, and with ``exact_softmax`` it was dropped in
    silence: show now says the tiles per row it moves (the source the default one where that
    is 0) and refuses the pair (exit 1, one line)."""

    def show(*argv):
        rc = main(["show", "bidir_d256", "--target", "sm_90", *argv])
        return rc, capsys.readouterr()

    _, default = show()
    rc, one = show("--option", "hopper_fwd.exp2_poly=1")
    assert rc == 0
    assert "// ---- options [sm_90]: hopper_fwd.exp2_poly=1: 0 of 10 tiles per row on the " \
           "FMA pipe" in one.out.splitlines()  # fmt: skip
    src = [x for x in one.out.splitlines() if not x.startswith("// ---- options")]
    assert src == default.out.splitlines()
    rc, three = show("--option", "hopper_fwd.exp2_poly=3")
    assert rc == 0 and "hopper_fwd.exp2_poly=3: 1 of 10 tiles per row on the FMA pipe" in three.out
    rc, both = show("--option", "exact_softmax=true", "--option", "hopper_fwd.exp2_poly=3")
    lines = both.err.strip().splitlines()
    assert rc == 1 and both.out == "" and len(lines) == 1, both
    assert lines[0].startswith("error: Options.hopper_fwd.exp2_poly=3 with Options.exact_softmax")


def test_list_shows_every_spec(capsys):
    assert main(["list", str(REPO / "specs")]) == 0
    out = capsys.readouterr().out
    for p in (REPO / "specs").glob("*.yaml"):
        assert load_spec(p).name in out
    assert "softcap * tanh(score / softcap)" in out


@pytest.mark.parametrize("columns", [30, 60, 100])
def test_list_fits_the_terminal_width(columns, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["list", str(REPO / "specs")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= columns
    assert not [line for line in lines if line != line.rstrip()]  # no padding to the width
    assert any(line.startswith("gemma2_softcap ") for line in lines)
    if columns >= 60:  # every word of a description is there, wrapped
        text = " ".join(" ".join(lines).split())
        assert "ALiBi attention (BLOOM, MPT): causal, with a per-head linear" in text


@pytest.mark.parametrize("command", ["build", "show", "list", "cache", "bench", "tune", "ab"])
def test_each_command_help_shows_its_whole_description(command, monkeypatch, capsys):
    """``flashgen COMMAND --help`` prints the command's description whole (every word, ending
    with its last sentence), filled to the terminal's width."""
    from flashgen.cli.commands import parser

    monkeypatch.setenv("COLUMNS", "72")
    sub = next(a for a in parser()._actions if a.dest == "command")
    description = sub.choices[command].description
    assert description and len(description.split()) >= 10
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert " ".join(description.split()) in " ".join(out.split())
    assert max(len(line) for line in out.splitlines() if not line.startswith("usage")) <= 100


def _all_help_texts(monkeypatch, capsys, columns: int) -> dict[str, str]:
    """``flashgen --help``, each command's and each ``flashgen bench --MODE --help`` at a
    terminal ``columns`` wide, by the command line that printed it."""
    from flashgen.cli.commands import BENCH_MODES, parser

    monkeypatch.setenv("COLUMNS", str(columns))
    sub = next(a for a in parser()._actions if a.dest == "command")
    argvs = [[], *([c] for c in sub.choices), *(["bench", f"--{m}"] for m in BENCH_MODES)]
    texts = {}
    for argv in argvs:
        with pytest.raises(SystemExit) as e:
            main([*argv, "--help"])
        assert e.value.code == 0, argv
        texts[" ".join(["flashgen", *argv, "--help"])] = capsys.readouterr().out
    return texts


def test_help_texts_are_plain_text_about_the_command_and_fit_80_columns(monkeypatch, capsys):
    """The help of every command and bench mode describes what it does: no development
    history ("issue 28's table", "session 9"), no reST markup (``flashgen ab``'s opened with
    double backticks, the bench modes printed their module docstrings), and at 80 columns no
    line is wider (the main help's example line was 84, a bench mode's usage 237)."""
    texts = _all_help_texts(monkeypatch, capsys, 80)
    assert len(texts) == 1 + 7 + 7
    history = re.compile(r"\bissue \d|\bsession\b", re.I)
    rst = re.compile(r"``|:(?:func|data|mod|class|meth|attr):`")
    bad = [f"{cmd}: {line!r}" for cmd, text in texts.items() for line in text.splitlines()
           if history.search(line) or rst.search(line) or len(line) > 80]  # fmt: skip
    assert not bad, "\n".join(bad)
    ab = " ".join(texts["flashgen ab --help"].split())
    assert ab.count("a spec's op under each combination") == 1


def test_help_describes_specs_by_name_and_what_needs_a_gpu(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # paragraphs filled to the terminal
    assert "the name of a shipped spec" in out and "need a CUDA GPU" in out
    assert "flashgen COMMAND --help" in out


def test_help_and_readme_name_what_of_bench_tune_and_ab_runs_without_a_gpu(capsys):
    """``flashgen --help`` and the README said "bench, tune and ab need a (CUDA) GPU" while
    ``bench --cpu``, ``tune --compile-only`` and ``ab --list-options`` run on a CPU machine
    (the help's own examples list ``flashgen bench --cpu``)."""
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    readme = " ".join((REPO / "README.md").read_text().split())
    for text in (help_text, readme):
        for exception in ("bench --cpu", "tune --compile-only", "ab --list-options"):
            assert exception in text.split("need a")[-1], exception
    assert main(["ab", "--list-options"]) == 0  # no GPU asked
    assert "hopper_bwd.exp2_poly" in capsys.readouterr().out


def test_format_expr_round_trips():
    params = "params:\n  window: {type: i32, default: 3}\n  w: {type: f32, default: 1.0}\n"
    for field, text in (
        ("mask", "causal && q_idx + seqlen_k - seqlen_q - kv_idx < window"),
        ("mask", "(b + 1) * 2 - -h > 3 || !(q_idx == kv_idx)"),
        ("mask", "q_idx - (kv_idx - 1) >= 0 ? true : false"),
        ("score_mod", "max(abs(score), 1.5) / (2.0 * w) - (window - 1)"),
    ):
        src = f'name: t\nhead_dim: 64\ndtype: fp16\n{field}: "{text}"\n{params}'
        spec = loads_spec(src)
        printed = format_expr(getattr(spec, field))
        again = loads_spec(src.replace(text, printed))
        assert getattr(again, field) == getattr(spec, field), printed


def test_python_dash_m(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "flashgen", "list", str(REPO / "specs")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "causal_d128" in out.stdout


def test_build_says_when_the_hopper_backward_falls_back(monkeypatch):
    """A spec whose Hopper backward spills in both dQ variants builds the FA2-class unit
    in its place (family_build.build_backward): the bwd_wgmma row must say so, not pass off the
    fallback's registers as the wgmma kernel's."""
    from plan_helpers import plan_backward, plan_hopper_backward

    import flashgen.cli.commands as cli
    from flashgen.build.compile import CompileReport, KernelResources
    from flashgen.families import build as family_build

    spec = load_spec(CAUSAL)
    fallback = plan_backward(spec, "sm_90")
    report = CompileReport("sm_90", "sm_90a", (KernelResources("k", registers=239),), 0.0, "13.0")

    def fake(spec, target, *, atomic_dq=False, hopper=False, options=None, param_grads=(),
             sink=False):
        return fallback, Path("unit.cubin"), report

    monkeypatch.setattr(family_build, "build_backward", fake)
    res = cli._compile_one(spec, "sm_90", "bwd_wgmma")
    assert res.ok and res.note and "falls back" in res.note and "sm_80/bwd.cu.j2" in res.note
    assert res.to_dict()["note"] == res.note
    for unit in ("bwd", "bwd_atomic"):
        assert cli._compile_one(spec, "sm_90", unit).note is None
    hopper = plan_hopper_backward(spec, "sm_90")
    monkeypatch.setattr(family_build, "build_backward", lambda *a, **k: (hopper, Path("u"), report))
    assert cli._compile_one(spec, "sm_90", "bwd_wgmma").note is None


def test_build_compiles_every_unit_of_compile_units_the_param_gradient_ones_too(
    monkeypatch, tmp_path, capsys
):
    """``flashgen build specs/t5_bias.yaml --option hopper_bwd.dparam_diagonal=true`` compiled
    fwd, bwd, bwd_atomic, bwd_wgmma and never the units that accumulate the param's gradient
    (``bwd_dparam``, ``bwd_atomic_dparam``, ``bwd_wgmma_dparam``): the option was a silent
    no-op.  Every unit :func:`registry.compile_units` lists is compiled now; a spec without
    trainable params (the README's causal_d128) builds the same units as before."""
    import flashgen.build.compile as compile_mod
    import flashgen.cli.build as clibuild
    from flashgen.build.compile import CompileReport
    from flashgen.families.registry import compile_units
    from flashgen.options import DEFAULT

    seen = []

    def one(spec, target, unit, options=None):
        seen.append((spec.name, target, unit))
        res = clibuild.BuildResult(spec, target, unit)
        res.report = CompileReport(target, target, (), 0.0, "13.0")
        return res

    monkeypatch.setattr(clibuild, "_compile_one", one)
    monkeypatch.setattr(compile_mod, "find_compiler", lambda: type("C", (), {"key": "13.0"})())
    t5 = str(REPO / "specs" / "t5_bias.yaml")
    diag = ["--option", "hopper_bwd.dparam_diagonal=true"]
    argv = ["build", t5, "--target", "sm_90", *diag, "--out", str(tmp_path), "--no-verify"]
    assert main(argv) == 0
    options = DEFAULT.replace_path("hopper_bwd.dparam_diagonal", True)
    want = list(compile_units(load_spec(t5), "sm_90", options))
    assert {"bwd_dparam", "bwd_atomic_dparam", "bwd_wgmma_dparam"} <= set(want)
    assert [u for _, _, u in seen] == [
        "fwd", "bwd", "bwd_atomic", "bwd_wgmma", "bwd_dparam", "bwd_atomic_dparam",
        "bwd_wgmma_dparam", "decode", "decode_ragged",
    ]  # fmt: skip
    assert "bwd_wgmma_dparam" in capsys.readouterr().out
    seen.clear()
    assert main(["build", CAUSAL, "--out", str(tmp_path), "--no-verify"]) == 0
    assert seen == [
        ("causal_d128", "sm_80", "fwd"), ("causal_d128", "sm_80", "bwd"),
        ("causal_d128", "sm_80", "bwd_atomic"), ("causal_d128", "sm_90", "fwd"),
        ("causal_d128", "sm_90", "bwd"), ("causal_d128", "sm_90", "bwd_atomic"),
        ("causal_d128", "sm_90", "bwd_wgmma"), ("causal_d128", "sm_90", "fwd_sparse"),
        ("causal_d128", "sm_80", "decode"), ("causal_d128", "sm_80", "decode_ragged"),
        ("causal_d128", "sm_90", "decode"), ("causal_d128", "sm_90", "decode_ragged"),
    ]  # fmt: skip


def test_build_reports_the_param_gradient_units_and_what_the_op_falls_back_to(
    tmp_path, requires_nvcc
):
    """The Hopper dparam unit of t5_bias with 128-query steps spills (320 B on nvcc 13.0);
    the op falls back to ``hopper_bwd.d64_block_m=64``.  Build compiles it as the op does
    (no failure) and its row's note names the spill and the fallback."""
    done = subprocess.run(
        [sys.executable, "-m", "flashgen", "build", "t5_bias", "--target", "sm_90", "--option",
         "hopper_bwd.dparam_diagonal=true", "--no-verify", "--json", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    doc = json.loads(done.stdout)
    rows = {k["unit"]: k for k in doc["kernels"]}
    assert done.returncode == 0 and doc["ok"], done.stderr
    for unit in ("bwd_dparam", "bwd_atomic_dparam", "bwd_wgmma_dparam"):
        assert rows[unit]["ok"] and rows[unit]["spill_stores"] == 0, rows[unit]
    note = rows["bwd_wgmma_dparam"]["note"]
    assert re.search(r"wgmma_dkdv_dparam spills \d+ B", note), note
    assert "falls back to hopper_bwd.d64_block_m=64" in note, note


def test_bad_kernel_family_is_an_error_not_a_traceback(tmp_path, capsys):
    rc = main(["build", CAUSAL, "--out", str(tmp_path), "--no-verify", "--option", "family=fa4"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "error: family: expected one of auto, fa3, fa2, got 'fa4'" in err
    assert not (tmp_path / "causal_d128").exists()
    assert main(["show", CAUSAL, "--option", "famly=fa2"]) == 1
    assert "unknown option 'famly'" in capsys.readouterr().err


def test_an_unknown_option_is_one_plain_line_naming_it_and_the_known_ones(tmp_path):
    """``flashgen show SPEC --option nope=1`` printed ``error: "unknown option 'nope'; ..."``
    (the repr of a KeyError, in quotes); so did ``build`` and its ``--json`` error.  Now one
    line, no quotes, no traceback, exit 1, with a "did you mean" for a near miss."""
    for argv in (["show", ALIBI, "--option", "nope=1"],
                 ["build", ALIBI, "--out", str(tmp_path), "--option", "nope=1"]):  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "flashgen", *argv], cwd=REPO,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 1, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
        assert lines[0].startswith("error: unknown option 'nope'; known: family, atomic_dq, ")
        assert "decode.stages" in lines[0]
    done = subprocess.run([sys.executable, "-m", "flashgen", "build", ALIBI, "--json", "--out",
                           str(tmp_path), "--option", "famly=fa2"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    doc = json.loads(done.stdout)
    assert done.returncode == 1 and doc["ok"] is False
    assert doc["error"].startswith("unknown option 'famly' (did you mean 'family'?); known: ")


def test_an_option_given_twice_is_an_error_in_show_and_build(tmp_path, capsys):
    """``flashgen show SPEC --option decode.stages=3 --option decode.stages=4`` kept the last
    in silence: one line naming the option and both values, exit 1, nothing built."""
    twice = ["--option", "decode.stages=3", "--option", "decode.stages=4"]
    for argv in (["show", CAUSAL, *twice],
                 ["build", CAUSAL, "--out", str(tmp_path), "--no-verify", *twice]):  # fmt: skip
        assert main(argv) == 1
        cap = capsys.readouterr()
        lines = cap.err.strip().splitlines()
        assert lines == ["error: --option decode.stages is given twice (decode.stages=3, "
                         "decode.stages=4): expected it once"], cap.err  # fmt: skip
    assert not (tmp_path / "causal_d128").exists()


@pytest.mark.parametrize("path", ["hopper_bwd.d256_ps_buffers", "hopper_bwd.desc_offsets"])
def test_show_with_a_deleted_option_says_it_was_removed(capsys, path):
    """``flashgen show SPEC --option hopper_bwd.d256_ps_buffers=2`` answered "did you mean
    'hopper_bwd.desc_offsets'?" (another knob): one line saying the option was removed."""
    assert main(["show", "gpt_oss_sink", "--option", f"{path}=1"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: option {path!r} was removed ("), lines
    assert "did you mean" not in lines[0]


def test_a_removed_switch_is_an_error_naming_its_option(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLASHGEN_KERNEL_FAMILY", "fa2")
    rc = main(["build", CAUSAL, "--out", str(tmp_path), "--no-verify"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "FLASHGEN_KERNEL_FAMILY: use flashgen.load(spec, options=Options(...))" in err
    assert "family=" in err and not (tmp_path / "causal_d128").exists()


def test_a_failed_build_writes_nothing(tmp_path, capsys, monkeypatch):
    """A unit that spills (or fails to compile) fails the build: its spec's generated/
    folder is not written (it printed 'error: ... kernel spills' and then 'wrote ...')."""
    import flashgen.cli.build as cli

    good = cli._compile_one

    def spilling(spec, target, unit, options=None):
        res = good(spec, target, unit, options)
        if unit == "bwd_atomic":
            res.error = "kernel spills: 60 bytes stores, 88 bytes loads"
        return res

    monkeypatch.setattr(cli, "_compile_one", spilling)
    out = tmp_path / "gen"
    rc = main(["build", CAUSAL, "--target", "sm_80", "--out", str(out), "--no-verify"])
    cap = capsys.readouterr()
    assert rc == 1
    assert "kernel spills" in cap.err and "causal_d128 not written" in cap.err
    assert "wrote" not in cap.out
    assert not (out / "causal_d128").exists()


def test_list_reports_an_unreadable_spec_instead_of_a_traceback(tmp_path, capsys):
    (tmp_path / "ok.yaml").write_text("name: ok\nhead_dim: 64\ndtype: fp16\nmask: causal\n")
    (tmp_path / "adir.yaml").mkdir()
    (tmp_path / "gone.yaml").symlink_to(tmp_path / "nowhere")
    rc = main(["list", str(tmp_path)])
    text = capsys.readouterr().out
    assert rc == 1
    assert "adir" in text and "is a directory" in text
    assert "gone" in text and "ERROR cannot read spec: No such file or directory" in text
    assert "ok" in text and "causal" in text


def test_list_shows_the_good_specs_and_each_bad_one_with_its_location_only(
    tmp_path, capsys, monkeypatch
):
    """``flashgen list DIR`` with an unparsable spec lists the others and the bad one with its
    error at file:line:col (exit 1); a spec that did not load has no mask to show (it was
    listed with "mask: none (every pair kept)", the line of a spec that keeps every pair)."""
    (tmp_path / "ok.yaml").write_text("name: ok\nhead_dim: 64\ndtype: fp16\nmask: causal\n")
    (tmp_path / "all.yaml").write_text("name: all\nhead_dim: 64\ndtype: fp16\n")
    bad = tmp_path / "broken.yaml"
    bad.write_text("name: broken\nhead_dim: 64\ndtype: bf16\nmask: q_idx >= kv_idx &&& 1\n")
    (tmp_path / "unreadable.yaml").symlink_to(tmp_path / "nowhere")
    monkeypatch.delenv("COLUMNS", raising=False)  # 160 columns: the error lines unwrapped
    rc = main(["list", str(tmp_path)])
    blocks = {b.split()[0]: b for b in capsys.readouterr().out.strip().split("\n\n")}
    assert rc == 1 and sorted(blocks) == ["all", "broken", "ok", "unreadable"]
    assert "causal" in blocks["ok"]
    assert "mask: none (every pair kept)" in blocks["all"]
    assert f"ERROR {bad}:4:25: unexpected character '&'" in blocks["broken"]
    assert "ERROR cannot read spec" in blocks["unreadable"]
    for name in ("broken", "unreadable"):
        assert "mask" not in blocks[name], blocks[name]


def test_two_specs_with_one_name_are_refused(tmp_path, capsys):
    """Both were built and written to the same generated/<name>/ ('wrote' twice, the
    second silently replacing the first); the same file named twice builds once."""
    other = tmp_path / "alibi.yaml"
    other.write_text(Path(ALIBI).read_text().replace("head_dim: 128", "head_dim: 64"))
    out = tmp_path / "gen"
    rc = main(["build", ALIBI, str(other), "--out", str(out), "--no-verify"])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"{other}: error: spec name 'alibi' is also the name of {ALIBI}" in err
    assert not out.exists()
    rc = main(["show", ALIBI])
    assert rc == 0


def test_build_json_lists_spec_errors_with_locations(tmp_path, capsys):
    """--json on spec errors said only "spec errors (see stderr)"."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nhead_dim: 80\ndtype: bf16\n")
    rc = main(["build", str(bad), str(tmp_path / "missing.yaml"), "--json", "--no-verify"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 1 and doc["ok"] is False
    first, second = doc["errors"]
    assert (first["file"], first["line"], first["col"]) == (str(bad), 2, 11)
    assert "head_dim 80 is not supported" in first["message"]
    assert second["file"].endswith("missing.yaml") and "cannot read spec" in second["message"]


# ---------------------------------------------------------------------- build: fp8 under family=fa2
def test_cli_build_fp8_with_family_fa2_is_an_error(capsys):
    """A ValueError traceback from the registry before."""
    from flashgen.cli.commands import main

    rc = main(["build", "--option", "family=fa2", "--json", "llama3_fp8"])
    assert rc != 0
    assert "no FP8 form" in capsys.readouterr().out


def test_build_compiles_the_sink_backward_units_a_sink_spec_trains_with(tmp_path, requires_nvcc):
    """With the fused sink (the default), a sink spec's training runs the backward's sink form
    (its pre kernel joins the sink): build compiles and reports those units too, spill-free,
    as the op builds them; with ``fused_sink`` off it has none."""
    def build(*opts):
        done = subprocess.run(
            [sys.executable, "-m", "flashgen", "build", "gpt_oss_sink", "--target", "sm_90",
             *opts, "--no-verify", "--json", "--out", str(tmp_path)],
            cwd=REPO, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        doc = json.loads(done.stdout)
        assert done.returncode == 0 and doc["ok"], done.stderr
        return {k["unit"]: k for k in doc["kernels"]}

    rows = build()
    for unit in ("bwd_sink", "bwd_atomic_sink", "bwd_wgmma_sink"):
        assert rows[unit]["ok"] and rows[unit]["spill_stores"] == 0, rows[unit]
        assert rows[unit]["note"] is None, rows[unit]
    from flashgen.cli.build import _build_backward_unit
    from flashgen.options import DEFAULT

    spec = load_spec(REPO / "specs" / "gpt_oss_sink.yaml")
    plan, _, _ = _build_backward_unit(spec, "sm_90", "bwd_wgmma_sink", DEFAULT)
    assert plan.wgmma and plan.pre.kernel_name.endswith("_pre_sink")
    off = ("--option", "fa2_fwd.fused_sink=0", "--option", "hopper_fwd.fused_sink=0")
    assert not {u for u in build(*off) if u.endswith("_sink")}
