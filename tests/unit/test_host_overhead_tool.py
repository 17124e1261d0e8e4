"""tools/host_overhead.py --training: the host time of a forward + backward step with the
param detached and requiring grad (no GPU: its ``--cpu`` form, run in a child process, since
it fakes the GPU process-wide; the GPU form's steps and printing checked in this one)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from patched_kernels import load_tool  # noqa: E402

from flashgen.frontend.spec import load_spec  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "host_overhead.py"


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, check=False)  # fmt: skip


@pytest.fixture(scope="module")
def training_cpu(tmp_path_factory):
    """``(rows, stdout)`` of ``--training --cpu`` with this checkout as its ``--baseline``
    too (a few steps each)."""
    out = tmp_path_factory.mktemp("host_overhead") / "rows.json"
    res = _run("--training", "--cpu", "-n", "2", "--reps", "1", "--baseline", str(REPO),
               "--json", str(out))  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text()), res.stdout


def test_training_cpu_times_each_spec_detached_and_trained(training_cpu):
    """One row per spec and case, four launches a step (the forward and the backward's
    three kernels) whether or not the param requires grad, and each spec's ratio printed."""
    rows, stdout = training_cpu
    mine = [r for r in rows if not r.get("baseline")]
    assert [(r["spec"], r["case"]) for r in mine] == [
        (s, c) for s in ("alibi", "t5_bias", "gpt_oss_sink") for c in ("detached", "trained")
    ]
    for r in mine:
        assert r["host_us"] > 0 and r["median_us"] >= r["host_us"] and r["host_only"]
        assert r["launches"] == 4, r
    for spec in ("alibi", "t5_bias", "gpt_oss_sink"):
        assert f"{spec} trained / detached host time:" in stdout


def test_training_cpu_trained_calls_take_the_eager_fast_path(training_cpu):
    """With the driver faked the calls take the paths they take on the GPU: trained alibi
    slopes and T5 bias the eager fast path's node, gpt_oss_sink's sinks the fused sink's."""
    rows, _ = training_cpu
    nodes = {(r["spec"], r["case"]): r["node"] for r in rows if not r.get("baseline")}
    for spec in ("alibi", "t5_bias"):
        assert nodes[(spec, "detached")] == nodes[(spec, "trained")] == "_EagerAttentionBackward"
    assert nodes[("gpt_oss_sink", "trained")] == "FusedSinkAttentionBackward"


def test_training_baseline_runs_the_same_steps_with_the_other_checkout(training_cpu):
    rows, stdout = training_cpu
    base = [r for r in rows if r.get("baseline")]
    assert [(r["spec"], r["case"]) for r in base] == [
        (r["spec"], r["case"]) for r in rows if not r.get("baseline")
    ]
    assert {r["flashgen"] for r in base} == {str(REPO)}
    assert "baseline         alibi trained / detached host time" in stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_training_without_a_gpu_needs_cpu():
    res = _run("--training", timeout=120)
    assert res.returncode == 2 and "--training needs a CUDA GPU (or --cpu)" in res.stderr


def test_training_params_are_the_specs_tensor_params():
    """Each spec's param is one of its f32 tensor params, and the value the tool makes has
    the param's shape at the tool's heads (what the GPU run passes)."""
    tool = load_tool("host_overhead")
    h = tool.TRAIN_SHAPE["heads"]
    for name, (pname, make) in tool.TRAIN_SPECS.items():
        spec = load_spec(REPO / "specs" / f"{name}.yaml")
        (param,) = [p for p in spec.tensor_params if p.name == pname]
        shape = [h if d == "num_heads" else d for d in param.shape]
        assert list(make(torch, h, "cpu").shape) == shape, name


def test_training_rows_print_the_ratio_per_checkout(capsys):
    tool = load_tool("host_overhead")
    rows = [dict(spec="alibi", case=c, host_us=us, median_us=us, launches=4, seqlen=4096,
                 node="_EagerAttentionBackward", eager_us=1000.0, host_only=c == "detached")
            for c, us in (("detached", 200.0), ("trained", 220.0))]  # fmt: skip
    tool.print_training_rows(rows, "H100")
    out = capsys.readouterr().out
    assert "alibi trained / detached host time: 1.10x" in out
    assert "eager us" in out and "(queue drained: includes waits)" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--training", "--cpu", "-n", "0"), "-n: expected a positive int, got 0"),
        (("--cpu", "-n", "-3"), "-n: expected a positive int, got -3"),
        (("--training", "--cpu", "--reps", "0"), "--reps: expected a positive int, got 0"),
        (("--cpu", "--seqlens", "0"), "--seqlens: expected positive ints, got [0]"),
        (("--decode", "--cpu", "--batch", "4", "0"), "--batch: expected positive ints, got [4, 0]"),
        (("--cpu", "--specs", "alibi"), "--specs: only with --training"),
        (("--cpu", "--sink"), "--sink: only with --decode"),
        (("--training", "--decode", "--cpu"), "--training and --decode: expected one of them"),
        (("--training", "--cpu", "--baseline", "/nonexistent/checkout"),
         "--baseline: expected a flashgen checkout (a directory holding flashgen/__init__.py), "
         "got /nonexistent/checkout"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_naming_them_before_measuring(args, message):
    """A usage error (exit 2) naming the argument and the received value: -n 0 divided by
    zero, --reps 0 took min() of nothing, -n -3 printed negative times, and --specs /
    --sink without the mode they belong to, or a --baseline that is no checkout, were
    ignored (a run of something else, rc 0)."""
    res = _run(*args, timeout=120)
    assert res.returncode == 2, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    assert message in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_help_describes_the_tool_in_a_whole_sentence():
    """--help's description is the docstring's first paragraph, not its first line cut at
    'with and without the'."""
    res = _run("--help", timeout=120)
    assert res.returncode == 0
    assert "with and without the CUtensorMap descriptor cache" in " ".join(res.stdout.split())
