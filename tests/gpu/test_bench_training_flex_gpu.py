"""``flashgen bench --training``'s FlexAttention peers on CUDA (issue 37's target: trained
forward+backward at least 2x FlexAttention's; CPU side: tests/unit/test_bench_training.py).

The alibi and t5_bias rows time ``torch.compile(flex_attention)`` with the spec's score_mod
capturing the slopes / bias table that requires grad, after checking once that its gradients
(the captured tensor's, dq, dk, dv) match flashgen's; the check must also refuse unequal work.

    python3 -m pytest tests/gpu/test_bench_training_flex_gpu.py -q
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from flashgen.cli.commands import main  # noqa: E402

pytestmark = pytest.mark.gpu

SMALL = ["--seqlen", "256", "--batch", "1", "--heads", "2", "--rounds", "1",
         "--warmup-ms", "1", "--rep-ms", "5"]  # fmt: skip
FLEX_ROWS = {
    "alibi fwd+bwd": ("slopes trained flex", "slopes",
                      ["slopes trained", "slopes trained dparam_affine"]),
    "t5_bias fwd+bwd": ("bias trained flex", "bias",
                        ["bias trained", "bias trained dparam_const_tiles=0",
                         "bias trained dparam_diagonal=0"]),
}  # fmt: skip


def test_the_trained_rows_time_flex_after_its_gradients_match(tmp_path, capsys):
    assert main(["bench", "--training", *SMALL, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    rows = {r["row"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    for row, (flex, param, trained) in FLEX_ROWS.items():
        r = rows[row]
        vs = r["vs_flex"]
        check = vs["grad_check"]
        assert check["ok"] and check["error"] is None, vs
        assert set(check["max_rel_err"]) == {"dq", "dk", "dv", f"d{param}"}
        assert max(check["max_rel_err"].values()) <= check["tolerance"] == 2e-2
        assert r["candidates"][flex]["ms"] > 0 and r["candidates"][flex]["error"] is None
        assert vs["flex"] == flex and vs["target"] == 2.0 and "n/a" not in vs
        speed = vs["speed_flashgen_over_flex"]
        assert list(speed) == trained
        for name, s in speed.items():
            assert s == pytest.approx(r["candidates"][flex]["ms"] / r["candidates"][name]["ms"])
        assert flex not in r["ratios"]  # flashgen's own costs against its detached call
        assert f"flashgen/Flex speed (target >= 2x): {trained[0]} " in lines[row]
        assert "grads match (max rel err" in lines[row]


def test_the_check_refuses_flex_on_other_values():
    """Flex capturing other values than flashgen's (the slopes doubled) fails the check: the
    row would then time unequal work."""
    import flashgen
    from flashgen.bench.training import FlexPeer, vs_flex

    op = flashgen.load("alibi")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 256, 128, device="cuda", generator=g).to(torch.bfloat16)
                   for _ in range(4))  # fmt: skip
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    slopes = torch.linspace(0.01, 0.5, 2, device="cuda")
    peer = FlexPeer(op, "slopes", slopes, q, k, v, do, versus=["slopes trained"])
    assert peer.check()["ok"]
    with torch.no_grad():
        peer.param.mul_(2)
    check = peer.check()
    assert not check["ok"] and "dslopes differs by" in check["error"], check
    entry, text = vs_flex(peer, {"slopes trained": 1.0}, check, None)
    assert "speed_flashgen_over_flex" not in entry
    assert text.startswith("flashgen/Flex speed (target >= 2x) n/a: Flex not timed: ")
    assert "dslopes differs by" in text
