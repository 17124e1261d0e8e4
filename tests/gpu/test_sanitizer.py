"""compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over one spec's kernel."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from patched_kernels import load_tool

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


def _tool():
    """tools/sanitize.py as a module."""
    return load_tool("sanitize")


#: (spec, options, deterministic, param_grads): the paths the flags select
PATH_CASES = [
    ("causal_d128", {}, True, False),
    ("t5_bias", {"hopper_bwd.dparam_diagonal": True, "hopper_bwd.dparam_const_tiles": True},
     False, True),
    ("alibi_learned", {}, True, True),
]  # fmt: skip


@pytest.mark.device_memory(4)
@pytest.mark.gpu
@pytest.mark.parametrize("name,options,det,pg", PATH_CASES, ids=[c[0] for c in PATH_CASES])
def test_driver_runs_the_backward_path_the_flags_select(name, options, det, pg):
    """tools/sanitize.py's driver, run without the sanitizer: ``--deterministic`` /
    ``--param-grads`` reach the op (the backward path and param-gradient unit it reports are
    :func:`flashgen.ops.prefill.backward.backward_path`'s for those flags), and every
    trained param gets a finite gradient (the driver asserts it)."""
    import json

    import torch

    from flashgen.bench.protocol import trained_params
    from flashgen.frontend.spec import load_spec
    from flashgen.ops.prefill.backward import backward_path
    from flashgen.ops.validation import target_for_device
    from flashgen.options import DEFAULT

    t = _tool()
    path = REPO / "specs" / f"{name}.yaml"
    cfg = {"deterministic": det, "param_grads": pg}
    out = subprocess.run(
        [sys.executable, "-c", t.DRIVER, str(path), "fwd+bwd", json.dumps(options),
         json.dumps(cfg), *(",".join(map(str, s)) for s in t.SIZES)],
        capture_output=True, text=True, timeout=1800, cwd=REPO,
    )  # fmt: skip
    log = out.stdout + out.stderr
    assert out.returncode == 0 and "FLASHGEN DRIVER OK" in log, log[-6000:]
    spec = load_spec(path)
    trained = trained_params(spec) if pg else ()
    assert not pg or trained, name
    target = target_for_device(spec, torch.device("cuda", torch.cuda.current_device()))
    want = backward_path(spec, target, det, DEFAULT.with_values(options), param_grads=trained)
    paths, units = t.parse_paths(log)
    assert paths == [want], log[-3000:]
    assert units == ([f"{want}[{','.join(trained)}]"] if trained else []), log[-3000:]


@pytest.mark.device_memory(8)
@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="no compute-sanitizer")
def test_sanitizer_runs_the_deterministic_and_param_grad_paths(tmp_path):
    """memcheck over t5_bias's param-gradient units (the Hopper dparam options on) under
    ``--deterministic --param-grads`` and with ``--param-grads`` alone, causal_d128 skipped
    (no param): clean, and the JSON records which paths ran."""
    import json

    for flags in (["--deterministic", "--param-grads"], ["--param-grads"]):
        report = tmp_path / "r.json"
        out = subprocess.run(
            [sys.executable, str(REPO / "tools" / "sanitize.py"), "--specs", "t5_bias",
             "causal_d128", "--tools", "memcheck", *flags,
             "--option", "hopper_bwd.dparam_diagonal=1",
             "--option", "hopper_bwd.dparam_const_tiles=1", "--json", str(report)],
            capture_output=True, text=True, timeout=3000, cwd=REPO,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
        assert "1/1 clean, 1 skipped" in out.stdout
        assert f"deterministic={int('--deterministic' in flags)}  param_grads=1" in out.stdout
        records = {r["spec"]: r for r in json.loads(report.read_text())}
        assert records["causal_d128"]["skipped"]
        t5 = records["t5_bias"]
        assert not t5["skipped"] and t5["trained"] == ["bias"]
        assert [u.split("[")[1] for u in t5["param_units"]] == ["bias]"], t5
        if "--deterministic" in flags:
            assert set(t5["paths"]) <= {"deterministic", "hopper_ordered"}, t5
