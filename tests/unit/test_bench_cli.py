"""``flashgen bench`` / ``flashgen tune`` on a CPU-only machine, FLOP accounting, and the
reports built from saved results (no GPU needed for any of this)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from flashgen.bench import autotune, peers, protocol
from flashgen.bench import runner as bench
from flashgen.cli.commands import BENCH_MODES, main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_cuda(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("cmd", [["bench", "--quick"], ["bench"], ["tune", "--all-shipped"]])
def test_without_gpu_exits_2_with_a_message(cmd, no_cuda, tmp_path, capsys):
    rc = main([*cmd, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "needs a CUDA GPU" in err and "torch.cuda.is_available() is false" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_bench_subprocess_exit_code_without_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run(
        [sys.executable, "-m", "flashgen", "bench", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr


def test_flop_count_follows_the_papers():
    # forward 4*B*H*S^2*D, causal halves it, backward is 2.5x forward
    f = protocol.attention_flops(1, 16, 16384, 16384, 128, False, "fwd")
    assert f == 4 * 16 * 16384**2 * 128
    assert protocol.attention_flops(1, 16, 16384, 16384, 128, True, "fwd") == f / 2
    assert protocol.attention_flops(1, 16, 16384, 16384, 128, False, "fwd_bwd") == 3.5 * f
    assert protocol.problem(512, 64) == (32, 32)
    assert protocol.problem(16384, 256) == (1, 8)
    # standard attention moves the seqlen^2 matrices, fused kernels only q, k, v, o, lse
    fused = protocol.attention_bytes(1, 16, 4096, 128, 2, "fwd", "flashgen")
    assert fused == 4 * 16 * 4096 * 128 * 2 + 16 * 4096 * 4
    assert protocol.attention_bytes(1, 16, 4096, 128, 2, "fwd", "standard") > 10 * fused


def test_rotation_covers_twice_the_l2():
    assert protocol.rotation_sets(192 * 10**6) == 2  # a 16k-token q/k/v set: at least 2
    assert protocol.rotation_sets(10**6) == 120  # ceil(2 * 60 MB / 1 MB)
    rot = protocol.Rotation(lambda: object(), 3)
    seen = [rot.next() for _ in range(6)]
    assert seen[:3] == seen[3:] and len({id(x) for x in seen[:3]}) == 3


def _plan(cfg):
    b = bench.Bench.__new__(bench.Bench)  # no device needed to list the work
    b.cfg = cfg
    return b.plan()


def test_quick_plan_is_the_documented_subset():
    cfg = bench.BenchConfig.quick_config()
    work = _plan(cfg)
    sweep = [a for k, a in work if k == "sweep"]
    impls = {a[0] for a in sweep}
    assert impls == {"flashgen", "sdpa_flash", "sdpa_cudnn", "standard"}
    assert {a[1].dtype for a in sweep} == {"bf16"}
    assert {a[4] for a in sweep} == {1024, 4096, 16384}
    assert {a[1].head_dim for a in sweep} == {64, 128, 256}
    # 3 seqlens x 3 head dims x 2 masks x 2 directions x 4 implementations
    assert len(sweep) == 3 * 3 * 2 * 2 * 4
    variants = [a for k, a in work if k == "variant"]
    assert variants and all(a[5] == "fwd" for a in variants)
    # SDPA is only asked for what it can express (no ALiBi / softcap / windows)
    assert not any(a[0].startswith("sdpa") and a[1].name == "alibi" for a in variants)
    full = _plan(bench.BenchConfig())
    assert {a[0] for k, a in full if k == "sweep"} == set(protocol.IMPLS)


def test_template_specs_are_plain_causal_or_full():
    s = protocol.template_spec(128, "fp16", True)
    assert (s.head_dim, s.dtype, s.score_mod) == (128, "fp16", None)
    assert s.name == "bench_causal_d128_fp16"
    assert protocol.template_spec(64, "bf16", False).mask is None


def _doc():
    rows = []
    for direction in ("fwd", "fwd_bwd"):
        for d in (64, 128):
            for causal in (False, True):
                for s in (1024, 4096, 16384):
                    b, h = protocol.problem(s, d)
                    for impl, tf in (("flashgen", 250), ("sdpa_flash", 300), ("standard", 90)):
                        r = bench.Row(
                            "sweep", impl, f"bench_d{d}", "bf16", d, causal, direction, b, h, s
                        )
                        r.flops = protocol.attention_flops(b, h, s, s, d, causal, direction)
                        r.bytes = protocol.attention_bytes(b, h, s, d, 2, direction, impl, causal)
                        if impl == "flashgen" and direction == "fwd_bwd":
                            r.status, r.note = "n/a", "no backward"
                        elif impl == "standard" and s == 16384 and direction == "fwd_bwd":
                            r.status = "oom"
                        else:
                            r.tflops = tf + s / 1000
                            r.ms = r.flops / (r.tflops * 1e12) * 1e3
                        rows.append(asdict(r))
    for s in (1024, 65536):
        for impl in ("standard", "flashgen"):
            r = bench.Row("memory", impl, "m", "bf16", 128, False, "fwd", 1, 16, s)
            if impl == "standard" and s == 65536:
                r.status = "oom"
            else:
                r.peak_bytes = s * s * 32 if impl == "standard" else s * 16 * 128 * 8
                r.extra_bytes = r.peak_bytes // 2
            rows.append(asdict(r))
    for impl in ("flashgen", "flex", "standard"):
        r = bench.Row("variant", impl, "alibi", "bf16", 128, True, "fwd", 4, 16, 4096)
        r.flops, r.bytes, r.tflops, r.ms = 1e12, 1e9, 100.0, 10.0
        rows.append(asdict(r))
    return {
        "env": {"gpu": "NVIDIA Test", "torch": "2.x", "gpu_memory_bytes": 140 * 2**30},
        "ceilings": {"matmul_bf16_tflops": 780.0, "copy_gbps": 4200.0},
        "rows": rows,
    }


def test_reports_from_json_without_gpu(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    doc = _doc()
    a.write_text(json.dumps(doc))
    doc2 = dict(doc, rows=[r for r in doc["rows"] if r["section"] == "memory"])
    b.write_text(json.dumps(doc2))
    out = tmp_path / "report"
    rc = main(["bench", "--from-json", str(a), str(b), "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    for name in (
        "results.json",
        "results.md",
        "tflops.png",
        "memory.png",
        "roofline.png",
        "variants.png",
    ):
        assert (out / name).stat().st_size > 0, name
    md = (out / "results.md").read_text()
    assert "| head_dim | causal | seqlen | flashgen | sdpa_flash | standard |" in md
    assert "OOM" in md and "n/a" in md and "780 TFLOP/s" in md
    merged = json.loads((out / "results.json").read_text())
    assert len(merged["rows"]) == len(doc["rows"])
    assert "flashgen" in text and "best peer" in text and "OOM at seqlen 65536" in text


def test_tune_candidates_follow_the_rule():
    cands = autotune.candidates()
    assert len(cands) == 12
    assert all(c.block_m % (16 * c.num_warps) == 0 for c in cands)
    assert {(c.block_m, c.num_warps) for c in cands} == {(64, 4), (128, 4), (128, 8)}
    keys = {autotune.spec_key(s, "G", "sm_90") for s in autotune.shipped_tuning_specs()}
    assert len(keys) == len(autotune.shipped_tuning_specs())  # one spec per key
    assert "G|sm_90|256|bf16|causal|score_mod" in keys  # gemma2 softcap
    assert "G|sm_90|64|fp16|noncausal|none" in keys


def test_tune_compile_only(monkeypatch, capsys, requires_nvcc):
    monkeypatch.setattr(autotune, "BLOCK_N", (64,))
    monkeypatch.setattr(autotune, "NUM_WARPS", (4,))
    monkeypatch.setattr(autotune, "BLOCK_M", (64,))
    rc = main(["tune", str(REPO / "specs" / "gpt2_d64.yaml"), "--compile-only", "--jobs", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "gpt2_d64" in out and "64x64 w4" in out and " ok" in out


def test_kept_pairs_counts_the_mask_from_the_ir():
    """Variant rows of ``flashgen bench`` count only kept (q, kv) pairs: causal keeps
    S (S + 1) / 2 per head, a sliding window of w keeps fewer, no mask keeps S^2."""
    torch = pytest.importorskip("torch")
    from flashgen.frontend.spec import load_spec

    cpu = torch.device("cpu")
    causal = load_spec(REPO / "specs" / "causal_d128.yaml")
    assert protocol.kept_pairs(causal, 2, 3, 17, {}, cpu) == 2 * 3 * 17 * 18 // 2
    swa = load_spec(REPO / "specs" / "mistral_swa.yaml")
    w, s = 4, 17
    per_row = [min(q + 1, w) for q in range(s)]
    assert protocol.kept_pairs(swa, 1, 2, s, {"window": w}, cpu) == 2 * sum(per_row)
    t5 = load_spec(REPO / "specs" / "t5_bias.yaml")
    assert protocol.kept_pairs(t5, 2, 2, 5, {}, cpu) == 2 * 2 * 25


def test_flex_retries_with_smaller_blocks_only_for_resource_errors():
    calls = []

    def fake_flex(q, k, v, kernel_options=None, **kw):
        calls.append(kernel_options)
        if kernel_options is None:
            raise RuntimeError(
                "InductorError: No valid triton configs. OutOfMemoryError: out of resource"
            )
        return "ok"

    f = peers.flex_retrying_smaller_blocks(fake_flex)
    assert f(1, 2, 3, scale=0.5) == "ok" and f(1, 2, 3, scale=0.5) == "ok"
    assert calls == [None, peers.FLEX_SMALL_BLOCKS, peers.FLEX_SMALL_BLOCKS]
    assert f.kernel_options == peers.FLEX_SMALL_BLOCKS

    def broken(q, k, v, kernel_options=None, **kw):
        raise ValueError("a real bug")

    with pytest.raises(ValueError, match="a real bug"):
        peers.flex_retrying_smaller_blocks(broken)(1, 2, 3)


@pytest.mark.parametrize(
    "mask, params",
    [
        ("q_idx >= kv_idx || b > 0", "{}"),
        ("q_idx >= kv_idx || t[b] > 0", "{t: {type: i32, shape: [batch]}}"),
        ("q_idx >= kv_idx || t[b, h, q_idx] > 0", "{t: {type: i32, shape: [batch, 2, 5]}}"),
        ("doc[b, q_idx] == doc[b, kv_idx]", "{doc: {type: i32, shape: [batch, seqlen_q]}}"),
    ],
)
def test_kept_pairs_counts_each_batch_row(mask, params):
    """A mask that reads ``b`` (directly, or through a tensor param of any shape) keeps
    other pairs in each batch row: kept_pairs (one row at a time) equals the whole mask."""
    torch = pytest.importorskip("torch")
    from flashgen.frontend.spec import loads_spec
    from flashgen.ops.cpu.reference import eval_mask

    spec = loads_spec(f"name: t\nhead_dim: 64\ndtype: bf16\nmask: '{mask}'\nparams: {params}\n")
    gen = torch.Generator().manual_seed(0)
    values = {
        p.name: torch.randint(0, 2, [3 if d == "batch" else 5 for d in p.shape], generator=gen)
        for p in spec.tensor_params
    }
    values = {k: v.to(torch.int32) for k, v in values.items()}
    want = eval_mask(spec, batch=3, heads_q=2, seqlen_q=5, seqlen_k=5, params=values)
    assert protocol.kept_pairs(spec, 3, 2, 5, values, torch.device("cpu")) == int(want.sum())


@pytest.mark.parametrize("mode", sorted(BENCH_MODES))
def test_every_bench_mode_imports_and_prints_its_help(mode, capsys):
    """``flashgen bench --MODE --help``: the mode's module imports without a GPU (torch and
    CuPy only inside its functions) and its options are its own."""
    with pytest.raises(SystemExit) as e:
        main(["bench", f"--{mode}", "--help"])
    assert e.value.code == 0
    assert f"usage: flashgen bench --{mode}" in capsys.readouterr().out


def test_a_bench_mode_takes_its_arguments_after_the_flag(capsys):
    assert main(["bench", "causal_d128", "--gallery", "--dry-run"]) == 2
    assert "--gallery takes its arguments after the flag" in capsys.readouterr().err


def test_bench_cpu_times_the_cpu_op_against_sdpa(capsys):
    pytest.importorskip("torch")
    argv = ["bench", "--cpu", "--seqlen", "64", "--heads", "1", "--head-dim", "32", "--reps", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| float32 | none |" in out and "| float32 | causal |" in out


@pytest.mark.parametrize(
    "flag, value, want",
    [
        ("--seqlen", "0", "seqlen: expected an int >= 1, got '0'"),
        ("--heads", "-2", "heads: expected an int >= 1, got '-2'"),
        ("--reps", "0", "reps: expected an int >= 1, got '0'"),
        ("--chunk-elems", "0", "chunk-elems: expected an int >= 1, got '0'"),
        ("--head-dim", "65", "invalid choice: 65 (choose from 32, 64, 96, 128, 160, 192, 256)"),
    ],
)
def test_bench_cpu_refuses_a_bad_size_naming_the_flag(flag, value, want, capsys):
    """``flashgen bench --cpu --seqlen 0`` died in ``.max()`` of an empty tensor, ``--reps 0``
    in statistics.median, ``--head-dim 65`` with a SpecError traceback from the benchmark's
    own spec (and ``--chunk-elems 0`` was taken as no value): tracebacks for a typo."""
    pytest.importorskip("torch")
    argv = ["bench", "--cpu", "--seqlen", "64", "--heads", "1", "--head-dim", "32", "--reps", "1"]
    with pytest.raises(SystemExit) as e:
        main([*argv, flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and want in err and "Traceback" not in err


@pytest.mark.parametrize(
    "mode, flag, value, want",
    [
        ("ring", "--gpus", "0", "argument --gpus: gpus: expected an int >= 1, got '0'"),
        ("ring", "--tokens", "abc", "tokens: expected comma-separated positive ints, got 'abc'"),
        ("ring", "--layouts", "diag", "layouts: expected comma-separated values from zigzag"),
        ("ring", "--modes", "x", "modes: expected comma-separated values from ring, allgather"),
        ("ring", "--heads-kv", "5", "--heads-kv: expected a divisor of --heads 32, got 5"),
        ("ring", "--tokens", "33", "--tokens: layout zigzag splits each rank's tokens in two"),
        ("ring", "--warmup", "-1", "warmup: expected an int >= 0, got '-1'"),
        ("gallery", "--seqlen", "0", "argument --seqlen: seqlen: expected an int >= 1, got '0'"),
        ("gallery", "--doc-len", "0", "doc-len: expected an int >= 1, got '0'"),
        ("gallery", "--rounds", "0", "rounds: expected an int >= 1, got '0'"),
    ],
)
def test_bench_ring_and_gallery_refuse_bad_arguments_naming_the_flag(mode, flag, value, want,
                                                                     capsys):  # fmt: skip
    """``bench --ring --gpus 0`` spawned no worker and died reading its missing JSON
    (FileNotFoundError), ``--tokens abc`` in int(); bad layouts, modes or head counts
    reached the spawned workers; ``bench --gallery --dry-run --seqlen 0`` raised
    ZeroDivisionError.  Each is an argparse error naming the flag, before any GPU check."""
    extra = ["--dry-run"] if mode == "gallery" else []
    with pytest.raises(SystemExit) as e:
        main(["bench", f"--{mode}", *extra, flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert want in err and "Traceback" not in err


def test_bench_ring_names_the_distributed_layouts_and_modes():
    from flashgen.bench import ring as bench_ring
    from flashgen.distributed import ring

    assert (bench_ring.LAYOUTS, bench_ring.MODES) == (ring.LAYOUTS, ring.MODES)
