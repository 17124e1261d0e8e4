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
                         "gpt_oss_sink fwd+bwd", "gpt_oss_sink decode",
                         "gpt_oss_sink decode planned"}  # fmt: skip
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
    """On the CPU ``bias trained dparam_const_tiles=0``, ``bias trained dparam_diagonal=0`` and
    ``sink by torch ops`` timed calls their option does not change there (noise as ratios):
    they are left out and marked "n/a on cpu", as is FlexAttention's trained call (no CPU
    backward).  Without ``--out`` nothing is written, as the help says."""
    from flashgen.bench.training import NOT_ON_CPU

    monkeypatch.chdir(tmp_path)
    argv = ["bench", "--training", "--device", "cpu", "--seqlen", "16", "--batch", "1",
            "--heads", "2", "--rounds", "1"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    assert ("(bias trained dparam_const_tiles=0, bias trained dparam_diagonal=0, bias trained "
            "flex: n/a on cpu)" in lines["t5_bias fwd+bwd"])  # fmt: skip
    for row in ("gpt_oss_sink fwd", "gpt_oss_sink fwd+bwd", "gpt_oss_sink decode"):
        assert "(sink by torch ops: n/a on cpu)" in lines[row]
    assert "ratios" not in out and "wrote" not in out
    timed = [line.split("(")[0] for line in lines.values()]  # a left-out name is in "(...)"
    assert not any(f"{name} " in t for name in NOT_ON_CPU for t in timed)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit):
        main(["bench", "--training", "--help"])
    assert "write DIR/results.json (default: none" in " ".join(capsys.readouterr().out.split())


def test_the_alibi_row_times_the_affine_slopes_on_the_gpu_only(tmp_path, capsys):
    """The alibi row's third call, trained slopes with ``hopper_bwd.dparam_affine``, shapes the
    Hopper backward only: a CPU run leaves it out and says so (results.json: ``omitted``), as
    it does FlexAttention's call, its two other calls timed as before."""
    from flashgen.bench.training import GPU_ONLY

    assert "hopper_bwd.dparam_affine" in GPU_ONLY["slopes trained dparam_affine"]
    argv = ["bench", "--training", "--device", "cpu", "--seqlen", "16", "--batch", "1",
            "--heads", "2", "--rounds", "1", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    assert "(slopes trained dparam_affine, slopes trained flex: n/a on cpu)" in (
        capsys.readouterr().out
    )
    rows = {r["row"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    alibi = rows["alibi fwd+bwd"]
    assert list(alibi["candidates"]) == ["slopes detached", "slopes trained"]
    assert list(alibi["omitted"]) == ["slopes trained dparam_affine", "slopes trained flex"]


def test_a_cpu_run_leaves_flex_out_and_says_so_with_the_target(tmp_path, capsys):
    """The alibi and t5_bias rows carry a FlexAttention candidate (its score_mod capturing the
    slopes / bias table requiring grad).  torch's FlexAttention has no backward on CPU, so a CPU
    run leaves it out like the GPU-only options, and the flashgen/Flex speed (target 2x) is
    n/a, saying why, in the printed line and in results.json."""
    from flashgen.bench.training import FLEX_CANDIDATES, FLEX_CPU, FLEX_TARGET, NOT_ON_CPU

    assert FLEX_TARGET == 2.0 and all(NOT_ON_CPU[n] == FLEX_CPU for n in FLEX_CANDIDATES)
    argv = ["bench", "--training", "--device", "cpu", "--seqlen", "16", "--batch", "1",
            "--heads", "2", "--rounds", "1", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    rows = {r["row"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    for row, flex in (("alibi fwd+bwd", "slopes trained flex"),
                      ("t5_bias fwd+bwd", "bias trained flex")):  # fmt: skip
        r = rows[row]
        assert flex not in r["candidates"] and r["omitted"][flex] == f"n/a on cpu: {FLEX_CPU}"
        assert r["vs_flex"] == {"flex": flex, "target": 2.0, "n/a": FLEX_CPU}
        assert f"flashgen/Flex speed (target >= 2x) n/a on cpu: {FLEX_CPU}" in lines[row]
        assert f"{flex}: n/a on cpu)" in lines[row]
    assert all("vs_flex" not in rows[r] for r in rows if r.startswith("gpt_oss_sink"))


def test_flex_still_has_no_cpu_backward_in_this_torch():
    """FLEX_CPU's claim, on the installed torch: flex_attention with inputs and a captured
    tensor that require grad raises NotImplementedError on the CPU.  Should a torch run it,
    this fails: the CPU run could then time the Flex candidates instead of leaving them out."""
    import torch

    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    bias = torch.zeros(2, requires_grad=True)
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        fa.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h]).sum().backward()


def test_the_flex_check_reports_a_flex_that_cannot_give_the_gradient():
    """:meth:`FlexPeer.check` on a Flex that fails (here the real CPU FlexAttention, which has
    no backward) is no crash: ``ok`` False, the error naming the captured tensor, the torch
    version and torch's message; the row's flashgen/Flex speed is then n/a and says why."""
    import torch

    import flashgen
    from flashgen.bench.training import FlexPeer, vs_flex

    op = flashgen.load("alibi")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 128, generator=g).requires_grad_() for _ in range(3))
    do = torch.randn(1, 2, 16, 128, generator=g)
    peer = FlexPeer(op, "slopes", torch.linspace(0.01, 0.5, 2), q, k, v, do,
                    versus=["slopes trained"])  # fmt: skip
    assert peer.name == "slopes trained flex"
    check = peer.check()
    assert check["ok"] is False, check
    assert check["error"].startswith(
        "FlexAttention's forward+backward with the captured slopes requiring grad failed in "
        f"torch {torch.__version__}: NotImplementedError: "
    )
    assert "backward on CPU" in check["error"]
    assert q.grad is None and peer.param.grad is None  # the check leaves .grad alone
    entry, text = vs_flex(peer, {"slopes trained": 2.0}, check, None)
    assert entry["grad_check"] is check and "speed_flashgen_over_flex" not in entry
    assert entry["n/a"] == f"Flex not timed: {check['error']}"
    assert text == f"flashgen/Flex speed (target >= 2x) n/a: Flex not timed: {check['error']}"


def test_compare_grads_holds_each_gradient_to_its_largest_element():
    """The check's rule: each gradient's max |Flex - flashgen| at most FLEX_TOL of its largest
    element; a gradient Flex does not give, or one with a NaN on one side, fails, named."""
    import torch

    from flashgen.bench.training import FLEX_TOL, compare_grads

    g = torch.Generator().manual_seed(0)
    want = {"dq": torch.randn(2, 8, generator=g).to(torch.bfloat16),
            "dslopes": torch.tensor([100.0, -3.0])}  # fmt: skip
    close = {"dq": want["dq"].float().mul(1.005).to(torch.bfloat16),
             "dslopes": torch.tensor([100.5, -3.5])}  # fmt: skip
    res = compare_grads(close, want)
    assert res["ok"] and res["error"] is None and res["tolerance"] == FLEX_TOL
    assert res["max_rel_err"]["dslopes"] == pytest.approx(0.5 / 100.5)
    off = dict(close, dslopes=torch.tensor([100.0, 0.0]))
    res = compare_grads(off, want)
    assert not res["ok"] and res["error"] == "dslopes differs by 0.03 of its largest element"
    nan = dict(close, dq=torch.full((2, 8), float("nan")))
    res = compare_grads(nan, want)
    assert not res["ok"] and res["max_rel_err"]["dq"] == float("inf")
    res = compare_grads({**close, "dslopes": None}, want)
    assert not res["ok"] and res["error"] == "FlexAttention gave no dslopes"
