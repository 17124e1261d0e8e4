"""``flashgen bench`` of fp8 specs, on CPU: the work plan (fp8 specs timed forward only, next
to ``flashgen_bf16``, the bf16 build of the same spec), that build, the callables the runner
times (on CPU tensors), and the reports' fp8 / bf16 ratio from saved results."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from flashgen.bench import peers, protocol, report
from flashgen.bench import runner as bench
from flashgen.bench.protocol import FP8_PEER
from flashgen.cli.commands import main
from flashgen.frontend.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
FP8 = REPO / "specs" / "llama3_fp8.yaml"


def _plan(cfg):
    b = bench.Bench.__new__(bench.Bench)  # no device needed to list the work
    b.cfg = cfg
    return b.plan()


def test_fp8_variant_is_timed_forward_next_to_its_bf16_build():
    cfg = bench.BenchConfig(
        variant_specs=(str(FP8), str(REPO / "specs" / "causal_d128.yaml")), memory=False,
        dtypes=(), variant_seqlens=(1024, 4096),
    )  # fmt: skip
    work = [a for k, a in _plan(cfg) if k == "variant"]
    fp8 = [a for a in work if a[1].name == "llama3_fp8"]
    assert {(a[0], a[5]) for a in fp8} == {("flashgen", "fwd"), (FP8_PEER, "fwd")}
    assert len(fp8) == 2 * 2  # two implementations x two seqlens, forward only
    bf = [a for a in work if a[1].name == "causal_d128"]
    assert FP8_PEER not in {a[0] for a in bf} and {a[5] for a in bf} == {"fwd", "fwd_bwd"}
    assert {a[0] for a in bf} >= {"flashgen", "sdpa_flash", "standard"}
    # one alternating-rounds problem per (spec, shape, direction): the pair is timed together
    groups = bench.Bench.problems(None, [("variant", a) for a in fp8])
    assert all({a[0] for _, a in g} == {"flashgen", FP8_PEER} for g in groups)


def test_fp8_sweep_dtype():
    cfg = bench.BenchConfig(dtypes=("fp8_e4m3",), head_dims=(128,), seqlens=(1024,),
                            memory=False, variants=False)  # fmt: skip
    work = [a for k, a in _plan(cfg) if k == "sweep"]
    assert {(a[0], a[1].dtype, a[5]) for a in work} == {
        ("flashgen", "fp8_e4m3", "fwd"), (FP8_PEER, "fp8_e4m3", "fwd")
    }
    assert len(work) == 2 * 2  # causal and not
    only_peers = dataclasses.replace(cfg, impls=("sdpa_flash", "flex"))
    assert not [a for k, a in _plan(only_peers) if k == "sweep"]


def test_bf16_twin():
    spec = load_spec(FP8)
    twin = protocol.bf16_twin(spec)
    assert (twin.name, twin.dtype, twin.targets) == ("llama3_fp8_bf16", "bf16", spec.targets)
    assert (twin.mask, twin.head_dim, twin.params) == (spec.mask, spec.head_dim, spec.params)
    assert protocol.bf16_twin(spec) is twin  # cached: one op, one kernel
    swa = dataclasses.replace(
        load_spec(REPO / "specs" / "mistral_swa.yaml"), dtype="fp8_e4m3", source="", name="s"
    )
    hand = protocol.bf16_twin(swa)
    assert (hand.name, hand.dtype, hand.params, hand.mask) == ("s_bf16", "bf16", swa.params,
                                                                swa.mask)  # fmt: skip
    assert protocol.spec_impls(spec, protocol.IMPLS) == ("flashgen", FP8_PEER)
    assert protocol.spec_impls(twin, (*protocol.IMPLS, FP8_PEER)) == protocol.IMPLS
    assert protocol.spec_directions(spec, ("fwd", "fwd_bwd")) == ("fwd",)
    assert not peers.expressible("flex", spec) and peers.expressible(FP8_PEER, spec)
    assert not peers.expressible(FP8_PEER, twin) and peers.expressible("flex", twin)


def test_the_timed_callables_on_cpu():
    spec = load_spec(FP8)
    q, k, v = (torch.randn(1, h, 17, 128).to(torch.float8_e4m3fn) for h in (4, 2, 2))
    o8 = peers.make_forward("flashgen", spec, 17, 17, {}, "cpu")(q, k, v)
    assert o8.dtype == torch.bfloat16 and o8.shape == (1, 4, 17, 128)
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    ob = peers.make_forward(FP8_PEER, spec, 17, 17, {}, "cpu")(qb, kb, vb)
    assert ob.dtype == torch.bfloat16
    torch.testing.assert_close(o8, ob)  # same values (descales 1), same attention
    for impl in ("sdpa_flash", "flex", "standard"):
        with pytest.raises(peers.Unsupported, match="no FP8 attention"):
            peers.make_forward(impl, spec, 17, 17, {}, "cpu")
    with pytest.raises(peers.Unsupported, match="bf16 build of an fp8 spec"):
        peers.make_forward(FP8_PEER, protocol.bf16_twin(spec), 17, 17, {}, "cpu")


def _doc():
    rows = []
    for s, fp8_ms, bf_ms in ((1024, 1.0, 1.5), (4096, 10.0, 16.0)):
        for impl, ms in (("flashgen", fp8_ms), (FP8_PEER, bf_ms)):
            r = bench.Row("variant", impl, "llama3_fp8", "fp8_e4m3", 128, True, "fwd", 16, 16, s)
            r.flops = protocol.attention_flops(16, 16, s, s, 128, True, "fwd")
            r.ms, r.tflops = ms, r.flops / (ms * 1e-3) / 1e12
            rows.append(asdict(r))
    r = bench.Row("variant", "flashgen", "alibi", "bf16", 128, True, "fwd", 4, 16, 4096)
    r.flops, r.tflops, r.ms = 1e12, 100.0, 10.0
    rows.append(asdict(r))
    return {"env": {"gpu": "NVIDIA Test"}, "rows": rows}


def test_reports_give_the_fp8_to_bf16_ratio(tmp_path, capsys):
    doc = _doc()
    ratios = report.fp8_speedups(doc["rows"])
    assert [(x["seqlen"], round(x["speedup"], 2)) for x in ratios] == [(1024, 1.5), (4096, 1.6)]
    md = report.markdown(doc)
    assert "## FP8 against bf16 (the same spec, the same run)" in md
    assert "| llama3_fp8 | 128 | yes | forward | 4096 |" in md and "| 1.60x |" in md
    assert "| spec | dtype | head_dim | direction | seqlen | flashgen | flashgen_bf16 |" in md
    text = report.summary(doc)
    assert "fp8 llama3_fp8 fwd S=4096" in text and "1.60x" in text
    (tmp_path / "r.json").write_text(json.dumps(doc))
    assert main(["bench", "--from-json", str(tmp_path / "r.json"), "--out",
                 str(tmp_path / "out")]) == 0  # fmt: skip
    assert "1.60x" in (tmp_path / "out" / "results.md").read_text()
    capsys.readouterr()
