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
