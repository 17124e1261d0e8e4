"""``flashgen bench --rounds``: a problem's implementations are timed in alternating rounds and
each reports its median (no GPU: ``do_bench_ms`` is replaced by a script)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flashgen.bench import runner as bench


def _bench(rounds: int) -> bench.Bench:
    b = object.__new__(bench.Bench)  # no CUDA device needed for the timing logic
    b.cfg = bench.BenchConfig(rounds=rounds)
    return b


def _row(impl: str) -> bench.Row:
    r = bench.Row("sweep", impl, "s", "bf16", 128, False, "fwd", 1, 16, 4096)
    r.flops = 1e12
    return r


def test_rounds_alternate_and_report_medians(monkeypatch):
    calls = []
    script = {"a": [1.0, 3.0, 2.0], "b": [5.0, 4.0, 6.0], "c": [2.0, 2.0, 9.0]}

    def fake(fn, warmup, rep):
        calls.append(fn.name)
        return script[fn.name][sum(1 for c in calls if c == fn.name) - 1]

    monkeypatch.setattr(bench, "do_bench_ms", fake)
    items = [(_row(n), SimpleNamespace(name=n)) for n in "abc"]
    script["a"].insert(0, 0.5)  # the untimed settle run of the first item
    _bench(3).time_rows(items, rounds=3)
    assert calls == list("aabccbaabc")
    assert [r.ms for r, _ in items] == [2.0, 5.0, 2.0]
    assert items[0][0].tflops == pytest.approx(1e12 / 2e-3 / 1e12)
    assert items[1][0].note == "median of rounds 5.000/4.000/6.000 ms"


def test_one_round_is_one_do_bench_and_no_note(monkeypatch):
    monkeypatch.setattr(bench, "do_bench_ms", lambda fn, w, r: 4.0)
    row = _row("a")
    _bench(1).time_rows([(row, lambda: None)], rounds=1)
    assert row.ms == 4.0 and row.note == "" and row.status == "ok"


def test_a_failing_implementation_stops_and_the_others_go_on(monkeypatch):
    def fake(fn, warmup, rep):
        if fn.name == "b":
            raise RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")
        return 1.0

    monkeypatch.setattr(bench, "do_bench_ms", fake)
    items = [(_row(n), SimpleNamespace(name=n)) for n in "ab"]
    _bench(3).time_rows(items, rounds=3)
    assert items[0][0].ms == 1.0 and items[0][0].status == "ok"
    assert items[1][0].status == "oom" and items[1][0].ms is None


def test_problems_group_the_implementations_of_one_problem():
    s1, s2 = SimpleNamespace(name="x"), SimpleNamespace(name="y")
    work = [
        ("sweep", ("flashgen", s1, 1, 16, 4096, "fwd")),
        ("sweep", ("sdpa_flash", s1, 1, 16, 4096, "fwd")),
        ("sweep", ("flashgen", s1, 1, 16, 4096, "fwd_bwd")),
        ("sweep", ("flashgen", s2, 1, 16, 4096, "fwd")),
        ("memory", ("standard", s1, 1024, "fwd")),
        ("memory", ("flashgen", s1, 1024, "fwd")),
        ("variant", ("flashgen", s2, 1, 16, 4096, "fwd")),
        ("variant", ("flex", s2, 1, 16, 4096, "fwd")),
    ]
    groups = _bench(3).problems(work)
    assert [len(g) for g in groups] == [2, 1, 1, 1, 1, 2]
    assert [item for g in groups for item in g] == work


def _run(monkeypatch, rounds: int) -> list:
    """The order in which ``Bench.run`` prepares, times and frees two implementations of
    one problem (no GPU: the measurement steps are stand-ins that log themselves)."""
    events: list = []
    spec = SimpleNamespace(name="x")
    work = [
        ("sweep", ("flashgen", spec, 1, 16, 4096, "fwd")),
        ("sweep", ("sdpa_flash", spec, 1, 16, 4096, "fwd")),
    ]
    b = _bench(rounds)
    b.cfg.ceilings = False
    b.out, b.rows, b.env, b.ceilings, b.kernels, b.compile_errors = None, [], {}, {}, {}, {}
    b.t0 = 0.0
    b.plan = lambda: work
    b.precompile = lambda specs, need_bwd: None

    def prepare(kind, impl, *args):
        events.append(("prepare", impl))
        return _row(impl), SimpleNamespace(name=impl)

    b.prepare = prepare
    b.time_rows = lambda items, rounds: events.append(("time", [f.name for _, f in items]))
    monkeypatch.setattr(bench, "_free", lambda: events.append("free"))
    b.run()
    assert [r.impl for r in b.rows] == ["flashgen", "sdpa_flash"]
    return events


def test_one_round_times_each_implementation_right_after_its_own_probe(monkeypatch):
    # the default keeps the protocol of before --rounds: probe, time, free the inputs, next
    # (not every implementation's inputs held at once, nor timing long after the probe)
    assert _run(monkeypatch, 1) == [
        ("prepare", "flashgen"),
        ("time", ["flashgen"]),
        "free",
        ("prepare", "sdpa_flash"),
        ("time", ["sdpa_flash"]),
        "free",
    ]


def test_rounds_prepare_a_problem_then_time_it_together(monkeypatch):
    assert _run(monkeypatch, 3) == [
        ("prepare", "flashgen"),
        ("prepare", "sdpa_flash"),
        ("time", ["flashgen", "sdpa_flash"]),
        "free",
    ]


@pytest.mark.parametrize("flag", ["--rounds", "--warmup-ms"])
def test_rounds_and_warmup_are_checked_by_the_parser(flag, capsys):
    from flashgen.cli.commands import parser

    bad = "0" if flag == "--rounds" else "-1"
    with pytest.raises(SystemExit):
        parser().parse_args(["bench", flag, bad])
    assert flag in capsys.readouterr().err
    assert getattr(parser().parse_args(["bench", flag, "2"]), flag[2:].replace("-", "_")) == 2
