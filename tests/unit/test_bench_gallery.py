"""``flashgen bench --gallery`` (:mod:`flashgen.bench.gallery`) without a GPU: the dry run
writes the page (spec texts, densities, missing specs listed) and the document ids it uses are
well formed."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]


def _tool():
    from flashgen.bench import gallery

    return gallery


def test_doc_ids_are_sorted_documents():
    from flashgen.bench import protocol as bench

    ids = bench.doc_ids(3, 500, 40, torch.Generator().manual_seed(0))
    assert ids.shape == (3, 500) and ids.dtype == torch.int32
    assert (ids.diff(dim=-1) >= 0).all() and (ids[:, 0] == 0).all() and ids.max() > 3


def test_bench_gives_document_masks_packed_documents():
    """flashgen bench's document_mask inputs are packed documents (sorted ids, doc_q and
    doc_kv the same ids), not random ids: a realistic density and tile table."""
    from flashgen.bench import protocol as bench
    from flashgen.frontend.spec import load_spec

    spec = load_spec(REPO / "specs" / "document_mask.yaml")
    p = bench.spec_params(spec, 2, 3, 700, 700, torch.device("cpu"), doc_len=50)
    assert p["doc_q"].shape == (3, 700) and p["doc_q"].dtype == torch.int32
    assert torch.equal(p["doc_q"], p["doc_kv"])
    assert (p["doc_q"].diff(dim=-1) >= 0).all() and p["doc_q"].max() >= 5
    p = bench.spec_params(spec, 2, 3, 300, 700, torch.device("cpu"))  # Sq != Sk: prefixes
    assert p["doc_q"].shape == (3, 300) and torch.equal(p["doc_q"], p["doc_kv"][:, :300])


def test_dry_run_writes_the_page(tmp_path):
    out = tmp_path / "gallery.md"
    specs = ["document_mask", "t5_bias", "mistral_swa", "no_such_spec"]
    rc = _tool().main(["--dry-run", "--seqlen", "512", "--doc-len", "64", "--out", str(out),
                       "--specs", *specs])  # fmt: skip
    assert rc == 0
    page = out.read_text()
    assert "| no_such_spec | — | — | not in specs/ on this branch |" in page
    assert "mask: causal && doc_q[b, q_idx] == doc_kv[b, kv_idx]" in page
    assert "| t5_bias | 64 | 1.000 |" in page
    row = next(line for line in page.splitlines() if line.startswith("| document_mask"))
    density = float(row.split("|")[3])
    assert 0.0 < density < 0.5  # causal within ~8 documents


def test_dry_run_without_out_prints_and_keeps_the_measured_page(tmp_path, capsys, monkeypatch):
    """`--dry-run` (the README's CPU mode) replaced docs/gallery.md's measurements with
    dashes; without --out it prints the page now (through the command line, from a checkout
    whose docs/ holds the measured page)."""
    from flashgen.cli.commands import main

    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "gallery.md"
    page.write_text("measured\n")
    monkeypatch.chdir(tmp_path)
    rc = main(["bench", "--gallery", "--dry-run", "--seqlen", "256", "--specs", "mistral_swa"])
    assert rc == 0
    assert page.read_text() == "measured\n"
    assert "| mistral_swa | 128 |" in capsys.readouterr().out


def test_measure_records_a_timing_error_and_keeps_the_others(monkeypatch):
    """An implementation that fails while it is timed (in the alternating rounds, after its
    first call worked) is recorded as its error, not raised (measure's contract)."""
    import argparse

    from flashgen.bench import timing
    from flashgen.frontend.spec import load_spec

    gallery = _tool()
    calls = []

    def do_bench_ms(fn, warmup, rep):
        calls.append(fn)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: out of memory")
        return 1.0

    monkeypatch.setattr(timing, "do_bench_ms", do_bench_ms)
    spec = load_spec(REPO / "specs" / "causal_d128.yaml")
    args = argparse.Namespace(no_flex=True, rounds=3, warmup=1, rep=1)
    out = gallery.measure(spec, 1, 1, 8, {}, "cpu", args)
    assert "out of memory" in out["flashgen_error"]


def test_direction_argument_is_checked(capsys):
    """A bad ``--direction`` is refused before anything runs, the message naming the
    argument, what it takes and what it got; a good list keeps its order, each value once."""
    from flashgen.bench import argtypes
    from flashgen.bench.protocol import DIRECTIONS

    for bad in ("bwd", "fwd,", "", "fwd,back"):
        with pytest.raises(SystemExit) as e:
            _tool().main(["--dry-run", "--direction", bad, "--specs", "mistral_swa"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "argument --direction: direction: expected comma-separated values from " in err
        assert f"fwd, fwd_bwd, got {bad!r}" in err
    parse = argtypes.choices("direction", DIRECTIONS)
    assert parse("fwd_bwd,fwd,fwd_bwd") == ("fwd_bwd", "fwd")
    assert parse(" fwd ") == ("fwd",)


def test_dry_run_with_one_direction(tmp_path):
    """``--direction fwd_bwd``: the page has the forward+backward table alone, and the JSON
    names the direction and gives each row its forward+backward FLOPs (3.5x the forward's)."""
    import json

    out, js = tmp_path / "gallery.md", tmp_path / "gallery.json"
    rc = _tool().main(["--dry-run", "--seqlen", "256", "--direction", "fwd_bwd", "--out",
                       str(out), "--json", str(js), "--specs", "mistral_swa"])  # fmt: skip
    assert rc == 0
    page = out.read_text()
    assert "## Forward+backward" in page and "## Forward\n" not in page
    assert "with pre-pass ms" not in page  # the forward table's column
    assert "| mistral_swa | 128 |" in page
    doc = json.loads(js.read_text())
    assert doc["meta"]["directions"] == ["fwd_bwd"] and doc["meta"]["bwd_factor"] == 2.5
    (row,) = doc["rows"]
    assert row["flops_fwd_bwd"] == pytest.approx(3.5 * row["flops"])
    assert row["flops"] == 2 * (128 + 128) * row["kept_pairs"]


def _fake_rows():
    """A measured spec, its dense causal baseline and a missing spec, as ``main`` holds them
    before the figures (times in ms)."""
    base = {"name": "causal_d128", "head_dim": 128, "heads": 16, "kept_pairs": 1000,
            "flops": 1e12, "flashgen_ms": 2.0, "sdpa_cudnn_ms": 2.2,
            "flashgen_fwd_bwd_ms": 5.0, "sdpa_cudnn_fwd_bwd_ms": 6.0}  # fmt: skip
    row = {"name": "mistral_swa", "text": "name: mistral_swa\n", "head_dim": 128, "heads": 16,
           "density": 0.375, "kept_pairs": 750, "flops": 0.75e12, "flashgen_ms": 1.5,
           "flex_ms": 2.25, "flex_compile_s": 12.0, "flashgen_fwd_bwd_ms": 5.25,
           "flex_fwd_bwd_ms": 10.5, "flex_fwd_bwd_compile_s": 30.0,
           "flex_fwd_bwd_error": None}  # fmt: skip
    return base, row, {"name": "gone", "missing": True}


def test_figures_and_page_give_forward_backward_columns(tmp_path):
    """The figures of each direction (TFLOP/s over kept pairs, 3.5x for fwd+bwd, the ratio to
    FlexAttention and cuDNN, time against the dense causal baseline) and the page's tables."""
    gallery = _tool()
    base, row, gone = _fake_rows()
    gallery.figures(base, ("fwd", "fwd_bwd"))
    gallery.figures(row, ("fwd", "fwd_bwd"), base)
    assert base["flashgen_tflops"] == pytest.approx(500.0)  # 1e12 FLOPs in 2 ms
    assert base["flashgen_fwd_bwd_tflops"] == pytest.approx(700.0)  # 3.5e12 in 5 ms
    assert base["cudnn_speedup"] == pytest.approx(1.1)
    assert base["cudnn_speedup_fwd_bwd"] == pytest.approx(1.2)
    assert row["flops_fwd_bwd"] == pytest.approx(2.625e12)
    assert row["flashgen_fwd_bwd_tflops"] == pytest.approx(500.0)
    assert row["flex_fwd_bwd_tflops"] == pytest.approx(250.0)
    assert row["speedup"] == pytest.approx(1.5) and row["speedup_fwd_bwd"] == pytest.approx(2.0)
    assert row["time_vs_causal"] == pytest.approx(0.75)
    assert row["time_vs_causal_fwd_bwd"] == pytest.approx(1.05)
    assert row["flops_vs_causal"] == pytest.approx(0.75)
    assert "sdpa_cudnn_tflops" not in row  # not timed for this spec
    page = tmp_path / "gallery.md"
    meta = {"where": "Measured on a test.", "batch": 2, "seqlen": 8192, "specs": tmp_path,
            "directions": ["fwd", "fwd_bwd"], "baseline": base}  # fmt: skip
    gallery.write_page([row, gone], meta, page)
    text = page.read_text()
    fwd, bwd = text.index("## Forward\n"), text.index("## Forward+backward")
    assert fwd < bwd
    assert (
        "| mistral_swa | 128 | 0.375 | 1.500 | 500 | — | 2.250 | 333 | 1.50x | 0.75 | 0.75 |"
        in (text[fwd:bwd])
    )
    assert (
        "| mistral_swa | 128 | 0.375 | 5.250 | 500 | 10.500 | 250 | 2.00x | 1.05 | 0.75 |"
        in (text[bwd:])
    )
    assert "| gone | — | — | not in specs/ on this branch | | | | | | |\n" in text[bwd:]
    assert "| forward | 2.000 | 500 | 2.200 | 455 | 1.10x |" in text
    assert "| forward+backward | 5.000 | 700 | 6.000 | 583 | 1.20x |" in text
    assert (
        "forward+backward: flashgen 5.250 ms = 500 TFLOP/s; FlexAttention 10.500 ms = 250 "
        "TFLOP/s (compile 30 s); flashgen / Flex 2.00x." in text
    )
    # a forward-only page (as before): no forward+backward table or facts
    meta["directions"], meta["baseline"] = ["fwd"], None
    gallery.write_page([row], meta, page)
    text = page.read_text()
    assert "## Forward\n" in text and "Forward+backward" not in text
    assert "forward+backward" not in text.lower() and "cuDNN" not in text


def test_measure_times_forward_backward_with_one_do(monkeypatch):
    """fwd_bwd times ``o = f(q, k, v)`` and the gradients of q, k, v for flashgen and the
    peer alike: the same q, k, v and dO (so the same gradients, up to bf16), tensor params
    passed detached; errors of one direction stay under its own key."""
    import argparse

    from flashgen.bench import peers, timing
    from flashgen.frontend.spec import load_spec

    gallery = _tool()
    results, seen = [], []

    def do_bench_ms(fn, warmup, rep):
        results.append(fn())
        return 1.0

    def fake_flex(impl, spec, sq, sk, params, device):  # eager attention, differentiable
        assert impl == "flex"
        seen.append(params)
        return lambda q, k, v: peers.standard_attention(q, k, v, False, spec.head_dim**-0.5)

    monkeypatch.setattr(timing, "do_bench_ms", do_bench_ms)
    monkeypatch.setattr(peers, "make_forward", fake_flex)
    spec = load_spec(REPO / "specs" / "alibi_learned.yaml")
    slopes = torch.zeros(2, requires_grad=True)  # a learned param: detached for fwd_bwd
    args = argparse.Namespace(no_flex=False, no_cudnn=True, rounds=1, warmup=1, rep=1,
                              direction=("fwd", "fwd_bwd"))  # fmt: skip
    out = gallery.measure(spec, 1, 2, 16, {"slopes": slopes}, "cpu", args)
    assert set(out["first_call_s"]) == {"flashgen_ms", "flex_ms", "flashgen_fwd_bwd_ms",
                                        "flex_fwd_bwd_ms"}  # fmt: skip
    for key in ("flashgen_ms", "flex_ms", "flashgen_fwd_bwd_ms", "flex_fwd_bwd_ms"):
        assert out[key] == 1.0 and out[key.removesuffix("_ms") + "_rounds_ms"] == [1.0]
    assert out["flex_fwd_bwd_compile_s"] >= 0 and not any(k.endswith("_error") for k in out)
    assert seen[0]["slopes"] is slopes and not seen[1]["slopes"].requires_grad
    grads = [r for r in results if isinstance(r, tuple) and len(r) == 3]
    assert len(grads) == 2  # flashgen's dq, dk, dv, then the peer's (slopes 0: same math)
    for a, b in zip(*grads, strict=True):
        assert a.shape == b.shape and a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.05)
    assert slopes.grad is None

    def failing_grad(*a, **k):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(torch.autograd, "grad", failing_grad)
    out = gallery.measure(spec, 1, 2, 16, {"slopes": slopes}, "cpu", args)
    assert "out of memory" in out["flashgen_fwd_bwd_error"]
    assert "out of memory" in out["flex_fwd_bwd_error"]
    assert "flashgen_error" not in out and out["flashgen_ms"] == 1.0


def test_a_gpu_run_times_the_baseline_against_cudnn_and_writes_both_directions(
    tmp_path, monkeypatch
):
    """main's GPU path with the timing faked (no GPU here): the dense causal baseline is
    measured first without FlexAttention (cuDNN where it applies), each spec in the
    directions asked for, and the page and JSON carry the forward+backward figures."""
    import json

    from flashgen.bench import protocol

    gallery = _tool()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(protocol, "kept_pairs", lambda spec, b, h, s, *a, **k: b * h * s * s // 2)
    monkeypatch.setattr(gallery, "gallery_params", lambda *a: {})
    calls = []

    def measure(spec, batch, heads, seqlen, params, device, args):
        calls.append((spec.name, args.no_flex, args.direction))
        if spec.name == gallery.BASELINE:
            return {"flashgen_ms": 1.0, "sdpa_cudnn_ms": 1.1, "flashgen_fwd_bwd_ms": 3.0,
                    "sdpa_cudnn_fwd_bwd_ms": 3.3}  # fmt: skip
        return {"flashgen_ms": 1.0, "flex_ms": 1.5, "flashgen_fwd_bwd_ms": 3.0,
                "flex_fwd_bwd_ms": 6.0, "flex_fwd_bwd_compile_s": 20.0}  # fmt: skip

    monkeypatch.setattr(gallery, "measure", measure)
    page, js = tmp_path / "gallery.md", tmp_path / "gallery.json"
    rc = gallery.main(["--seqlen", "1024", "--out", str(page), "--json", str(js),
                       "--specs", "mistral_swa"])  # fmt: skip
    assert rc == 0
    assert calls == [("causal_d128", True, ("fwd", "fwd_bwd")),
                     ("mistral_swa", False, ("fwd", "fwd_bwd"))]  # fmt: skip
    text = page.read_text()
    assert "Measured on Fake GPU" in text
    assert "(causal_d128, head_dim 128) 1.000 ms forward / 3.000 ms forward+backward." in text
    assert "| forward+backward | 3.000 |" in text and "| 1.10x |" in text
    bwd = text[text.index("## Forward+backward") :]
    assert "| mistral_swa | 128 | 0.500 | 3.000 |" in bwd and "| 2.00x | 1.00 | 1.00 |" in bwd
    doc = json.loads(js.read_text())
    assert doc["meta"]["baseline"]["cudnn_speedup_fwd_bwd"] == pytest.approx(1.1)
    (row,) = doc["rows"]
    assert row["speedup_fwd_bwd"] == pytest.approx(2.0)
    assert row["flex_fwd_bwd_tflops"] == pytest.approx(row["flops_fwd_bwd"] / 6e-3 / 1e12)
