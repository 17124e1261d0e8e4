"""``flashgen ab`` without a GPU: its option arguments over flashgen.Options' dotted names,
argument errors, the variants, the alternating rounds (timers replaced by scripts), the
output comparison and the report."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from flashgen.bench import ab, abrun, options
from flashgen.bench.options import (
    OptionError,
    combinations,
    parse_option_arg,
    parse_options,
    parse_value,
    variant_label,
    with_options,
)
from flashgen.cli.commands import main
from flashgen.options import Options


# ----------------------------------------------------------------------------- option arguments
def test_with_options_sets_several_through_options_and_reports_its_checks():
    base = Options()
    values = {"family": "fa2", "hopper_fwd.fp8_transpose": "lds32", "side_terms": False}
    got = with_options(base, values)
    assert (got.family, got.hopper_fwd.fp8_transpose, got.side_terms) == ("fa2", "lds32", False)
    assert got == base.replace_path("family", "fa2").replace_path(
        "hopper_fwd.fp8_transpose", "lds32"
    ).replace_path("side_terms", False)
    assert base == Options() and got.hopper_bwd is base.hopper_bwd  # frozen, groups shared
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.atomic_dq = True  # type: ignore[misc]
    with pytest.raises(OptionError, match="^persistent_ctas: expected an int >= 1, got 0$"):
        with_options(Options(), {"persistent_ctas": 0})


@pytest.mark.parametrize(
    "name, text, want",
    [
        ("atomic_dq", "1", True),
        ("atomic_dq", "0", False),
        ("atomic_dq", "TRUE", True),
        ("atomic_dq", " false ", False),
        ("atomic_dq", "none", None),
        ("family", "fa2", "fa2"),
        ("persistent", "dynamic", "dynamic"),
        ("persistent_ctas", "128", 128),
        ("persistent_ctas", "none", None),
        ("decode.num_splits", "4", 4),
        ("hopper_fwd.col_bound", "0", False),
    ],
)
def test_values_parse_by_the_fields_type(name, text, want):
    got = parse_value(name, text)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("side_terms", "maybe", "side_terms: expected a bool (true, false, 1, 0), got 'maybe'"),
        ("family", "fa4", "family: expected one of auto, fa3, fa2, got 'fa4'"),
        ("persistent", "on", "expected one of auto, off, static, m_major, dynamic, got 'on'"),
        ("persistent_ctas", "1e3", "expected an int >= 1, or none, got '1e3'"),
        ("hopper_fwd.fp8_transpose", "tma", "expected one of lds32, ldsm, got 'tma'"),
    ],
)  # fmt: skip
def test_bad_values_name_the_option_the_form_and_the_text(name, text, message):
    with pytest.raises(OptionError) as e:
        parse_value(name, text)
    assert message in str(e.value)


@pytest.mark.parametrize("path", ["hopper_bwd.d256_ps_buffers", "hopper_bwd.desc_offsets"])
def test_a_deleted_option_argument_says_it_was_removed(path):
    """``flashgen ab --option hopper_bwd.d256_ps_buffers=1,2`` suggested three unrelated
    options (desc_offsets, head_groups, d64_block_m); a deleted option says it was removed."""
    with pytest.raises(OptionError) as e:
        parse_option_arg(f"{path}=1,0")
    text = str(e.value)
    assert f"option {path!r} was removed (" in text and "drop it" in text
    assert "did you mean" not in text and "--list-options" in text


def test_option_arguments():
    assert parse_option_arg("hopper_fwd.affine=1,0") == ("hopper_fwd.affine", [True, False])
    assert parse_option_arg(" persistent =off,static") == ("persistent", ["off", "static"])
    for text in ("atomic_dq", "=1", "atomic_dq=", "atomic_dq= "):
        with pytest.raises(OptionError, match="--option expects NAME=VALUE"):
            parse_option_arg(text)
    with pytest.raises(OptionError) as e:
        parse_option_arg("hoper_fwd.affine=1")
    assert "unknown option 'hoper_fwd.affine'; did you mean hopper_fwd.affine" in str(e.value)
    assert "--list-options" in str(e.value)
    with pytest.raises(OptionError, match="'hopper_bwd' is a group of options; set one of its "
                       "fields: hopper_bwd.head_groups"):  # fmt: skip
        parse_option_arg("hopper_bwd=1")
    with pytest.raises(OptionError, match="option atomic_dq lists the value 1 twice"):
        parse_option_arg("atomic_dq=1,true")
    with pytest.raises(OptionError, match="option family is given twice"):
        parse_options(["family=fa2", "family=fa3"])


def test_variants_product_and_zip():
    values = parse_options(["atomic_dq=0,1", "family=fa2,fa3", "side_terms=0"])
    prod = combinations(values)
    assert [(v["atomic_dq"], v["family"]) for v in prod] == [
        (False, "fa2"), (False, "fa3"), (True, "fa2"), (True, "fa3"),
    ]  # fmt: skip
    assert all(v["side_terms"] is False for v in prod)  # one value: held fixed
    assert variant_label(prod[1], values) == "atomic_dq=0 family=fa3"
    zipped = combinations(values, "zip")
    assert [(v["atomic_dq"], v["family"]) for v in zipped] == [(False, "fa2"), (True, "fa3")]
    uneven = parse_options(["atomic_dq=0,1", "persistent=static,dynamic,m_major"])
    with pytest.raises(OptionError, match="same number of values"):
        combinations(uneven, "zip")
    assert combinations({}) == [{}] and variant_label({}, {}) == "default"


def test_variants_one_option_at_a_time():
    """``--combine each``: the baseline, then each option alone at its other values."""
    values = parse_options(["hopper_fwd.col_bound=1,0", "side_terms=1,0", "family=auto,fa2,fa3"])
    got = combinations(values, "each")
    base = {"hopper_fwd.col_bound": True, "side_terms": True, "family": "auto"}
    assert got == [
        base,
        base | {"hopper_fwd.col_bound": False},
        base | {"side_terms": False},
        base | {"family": "fa2"},
        base | {"family": "fa3"},
    ]
    with pytest.raises(OptionError, match="expected product, zip or each"):
        combinations(values, "all")


def test_list_options_shows_names_values_and_defaults():
    text = options.list_options()
    lines = text.splitlines()
    assert lines[0].split() == ["option", "values", "default"]
    assert [line.split()[0] for line in lines[1:]] == Options.paths()
    row = next(line for line in lines if line.startswith("persistent "))
    assert "one of auto, off, static, m_major, dynamic" in row and row.endswith("auto")
    assert next(line for line in lines if line.startswith("hopper_fwd.affine")).endswith(" true")
    assert next(line for line in lines if line.startswith("atomic_dq")).endswith(" none")


def test_list_options_shows_int_ranges_and_bool_defaults_as_true_false():
    """``--list-options`` said ``int`` for ``decode.stages`` (2..8) and showed a bool's
    default as 1 / 0 beside values written true / false."""
    rows = {line.split()[0]: line.split(None, 1)[1] for line in
            options.list_options().splitlines()[1:]}  # fmt: skip
    assert rows["decode.stages"].split() == ["int", "in", "2..8,", "or", "none", "none"]
    assert rows["hopper_bwd.d64_block_m"].split() == ["one", "of", "64,", "128", "128"]
    assert rows["decode.merge_unroll"].split()[-1] == "4" and "one of 4, 8, 16" in rows[
        "decode.merge_unroll"]  # fmt: skip
    assert rows["exact_softmax"].endswith(" false") and rows["side_terms"].endswith(" true")


# ----------------------------------------------------------------------------- the command
@pytest.fixture
def no_cuda(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _err(capsys) -> str:
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err
    return cap.err


def test_without_a_gpu_it_exits_with_the_no_gpu_message(no_cuda, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["ab", "causal_d128", "--option", "atomic_dq=0,1", "--peers", "--out", str(out)])
    err = _err(capsys)
    assert rc == 2
    assert "flashgen ab needs a CUDA GPU" in err and "torch.cuda.is_available() is false" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["causal_d128", "--option", "side_terms=maybe"], "side_terms: expected a bool"),
        (["causal_d128", "--option", "decode.stages=9"],
         "decode.stages: expected an int in 2..8, got 9"),
        (["causal_d128", "--option", "famly=fa2"], "unknown option 'famly'; did you mean family"),
        (["causal_d128", "--option", "hopper_fwd.fp8_transpose=ldsm,tma"],
         "hopper_fwd.fp8_transpose: expected one of lds32, ldsm, got 'tma'"),
        (["no_such_spec"], "spec 'no_such_spec': no such file, nor a shipped spec"),
        (["causal_d128:window=3"], "spec 'causal_d128:window=3': causal_d128 has no scalar "
         "param window (its scalar params: none)"),
        (["mistral_swa:window=x"], "spec 'mistral_swa:window=x': expected SPEC or "
         "SPEC:param=value,... with numeric values"),
        ([], "give at least one SPEC"),
    ],
)  # fmt: skip
def test_bad_arguments_are_errors_before_the_gpu(argv, message, no_cuda, capsys):
    assert main(["ab", *argv]) == 2
    assert f"error: {message}" in _err(capsys)


def test_without_options_only_peers_run(no_cuda, capsys):
    assert main(["ab", "causal_d128", "--peers"]) == 2  # no options needed: the GPU is missing
    assert "needs a CUDA GPU" in _err(capsys)


def test_list_options_needs_no_gpu(no_cuda, capsys):
    assert main(["ab", "--list-options"]) == 0
    assert "hopper_bwd.head_groups" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--shapes", "2x3", "expected S, BxHxS or BxHQ/HKVxSQxSK"),
        ("--shapes", "1x6/4x128", "query heads 6 are not a multiple of kv heads 4"),
        ("--shapes", "0", "positive integers"),
        ("--peers", "sdpa_flash,fa3", "unknown peer fa3; known: sdpa_flash"),
        ("--direction", "bwd,back", "unknown direction back"),
        ("--timer", "events", "unknown timer events"),
        ("--rounds", "-1", "expected an integer >= 0"),
    ],
)
def test_argument_types_are_checked_by_the_parser(flag, value, message, capsys):
    with pytest.raises(SystemExit):
        main(["ab", "causal_d128", flag, value])
    assert message in capsys.readouterr().err


def test_parsed_arguments():
    from flashgen.cli.commands import parser

    a = parser().parse_args(["ab", "prefix_lm", "alibi", "--peers", "--shapes", "16384",
                             "2x32/8x1024x2048", "--direction", "fwd,bwd"])  # fmt: skip
    assert a.specs == ["prefix_lm", "alibi"]
    assert a.peers == ab.DEFAULT_PEERS and a.direction == ("fwd", "bwd")
    assert a.timer == ("graph", "do_bench") and a.rounds == 5 and a.combine == "product"
    s = a.shapes[1]
    assert (s.batch, s.heads, s.heads_kv, s.seqlen_q, s.seqlen_k) == (2, 32, 8, 1024, 2048)
    assert a.shapes[0].resolve(128) == (1, 16, 16, 16384, 16384)  # the protocol's B and H
    assert s.resolve(128) == (2, 32, 8, 1024, 2048) and s.text() == "2x32/8x1024x2048"
    assert parser().parse_args(["ab", "x", "--peers", "flex"]).peers == ("flex",)
    assert parser().parse_args(["ab", "x"]).peers == ()


def test_spec_items_resolve_files_and_shipped_names(tmp_path):
    path, over = ab.resolve_spec("mistral_swa:window=256")
    assert path.name == "mistral_swa.yaml" and over == {"window": 256}
    f = tmp_path / "mine.yaml"
    f.write_text("name: mine\nhead_dim: 64\ndtype: fp16\n")
    assert ab.resolve_spec(str(f)) == (f, {})
    assert ab.resolve_spec(f"{f}:x=1.5") == (f, {"x": 1.5})


# ----------------------------------------------------------------------------- rounds (faked)
def _cands(*names):
    return [abrun.Candidate(n, "variant" if i < 2 else "peer") for i, n in enumerate(names)]


def test_rounds_alternate_per_timer_and_report_medians_and_ratios(monkeypatch):
    events = []
    graph_script = {"a": [9.0, 1.0, 3.0, 2.0], "b": [2.0, 2.5, 1.5], "c": [4.0, 4.0, 4.0]}
    bench_script = {"a": [8.0, 2.0, 2.0, 2.0], "b": [1.0, 1.0, 1.0], "c": [5.0, 6.0, 7.0]}

    def capture(call, reps):
        events.append(("capture", call.name, reps))
        return SimpleNamespace(name=call.name)

    def replay(g, reps, iters):
        events.append(("graph", g.name))
        return graph_script[g.name].pop(0)

    def do_bench(fn, warmup, rep):
        events.append(("do_bench", fn.name))
        return bench_script[fn.name].pop(0)

    monkeypatch.setattr(abrun, "capture_graph", capture)
    monkeypatch.setattr(abrun, "graph_replay_ms", replay)
    monkeypatch.setattr(abrun, "do_bench_ms", do_bench)
    cands = _cands("a", "b", "c")
    for c in cands:
        c.call = SimpleNamespace(name=c.name)
    abrun.time_candidates(cands, ("graph", "do_bench"), 3, graph_calls=7)
    order = [(kind, name) for kind, name, *_ in events]
    assert order[:3] == [("capture", "a"), ("capture", "b"), ("capture", "c")]
    assert events[0][2] == 7
    # a settle run of the first candidate, then A B C, C B A, A B C; per timer
    rounds = ["a", "a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert [n for k, n in order[3:13]] == rounds and {k for k, _ in order[3:13]} == {"graph"}
    assert [n for k, n in order[13:]] == rounds and {k for k, _ in order[13:]} == {"do_bench"}
    a, b, c = cands
    assert a.samples == {"graph": [1.0, 3.0, 2.0], "do_bench": [2.0, 2.0, 2.0]}
    assert (a.ms["graph"], b.ms["graph"], c.ms["graph"]) == (2.0, 2.0, 4.0)
    assert (a.ms["do_bench"], b.ms["do_bench"], c.ms["do_bench"]) == (2.0, 1.0, 6.0)
    assert a.ratio == {"graph": 1.0, "do_bench": 1.0}
    assert b.ratio == {"graph": 1.0, "do_bench": 0.5} and c.ratio["do_bench"] == 3.0


def test_a_failed_capture_or_timing_drops_only_that_candidate(monkeypatch):
    def capture(call, reps):
        if call.name == "b":
            raise RuntimeError("operation not permitted when stream is capturing")
        return SimpleNamespace(name=call.name)

    calls = []

    def do_bench(fn, warmup, rep):
        calls.append(fn.name)
        if fn.name == "c" and calls.count("c") == 2:
            raise RuntimeError("CUDA error: out of memory")
        return 1.0

    monkeypatch.setattr(abrun, "capture_graph", capture)
    monkeypatch.setattr(abrun, "graph_replay_ms", lambda g, reps, iters: 3.0)
    monkeypatch.setattr(abrun, "do_bench_ms", do_bench)
    cands = _cands("a", "b", "c")
    for c in cands:
        c.call = SimpleNamespace(name=c.name)
    abrun.time_candidates(cands, ("graph", "do_bench"), 3)
    a, b, c = cands
    assert "graph" not in b.ms and "graph capture failed: RuntimeError" in b.note
    assert b.ms["do_bench"] == 1.0 and a.ms["graph"] == 3.0
    assert calls.count("c") == 2 and c.samples["do_bench"] == [1.0]  # out after its failure
    assert "do_bench failed: RuntimeError: CUDA error: out of memory" in c.note


def test_no_rounds_times_nothing_and_failed_candidates_are_not_timed(monkeypatch):
    def boom(*a):
        raise AssertionError("timed")

    monkeypatch.setattr(abrun, "do_bench_ms", boom)
    monkeypatch.setattr(abrun, "capture_graph", boom)
    cands = _cands("a", "b")
    cands[0].call = SimpleNamespace(name="a")
    abrun.time_candidates(cands, ("graph", "do_bench"), 0)
    assert cands[0].ms == {}
    cands[0].fail("error", RuntimeError("nvcc failed"))
    assert cands[0].call is None and cands[0].status == "error"
    abrun.time_candidates(cands, ("graph", "do_bench"), 3)  # nothing left to time
    assert "RuntimeError: nvcc failed" in cands[0].note


# ----------------------------------------------------------------------------- checks, report
def test_compare_is_bitwise_or_the_max_difference():
    torch = pytest.importorskip("torch")
    o = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    lse = torch.tensor([0.5, -torch.inf])  # an empty row: -inf on both sides is equal
    base = {"o": o, "lse": lse}
    assert abrun.compare({"o": o.clone(), "lse": lse.clone()}, base) == (True, 0.0)
    bitwise, diff = abrun.compare({"o": o + 0.25, "lse": lse.clone()}, base)
    assert bitwise is False and diff == 0.25
    assert abrun.compare({"o": o}, base) == (True, 0.0)  # a peer: o only
    nan = o.clone()
    nan[0, 0] = torch.nan  # an element the kernel did not write (poisoned)
    assert abrun.compare({"o": nan}, base) == (False, float("inf"))
    assert abrun.compare({"o": o[:1]}, base) == (False, float("inf"))
    assert abrun.compare({"dq": o}, base) == (None, None)


@pytest.mark.parametrize("direction", ["fwd", "fwd_bwd", "bwd"])
def test_calls_return_the_outputs_and_the_backward_runs(direction):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 3, 4, generator=g) for _ in range(4))
    forwards = []

    def forward(q, k, v):
        forwards.append(1)
        o = (q @ k.transpose(-1, -2)).softmax(-1) @ v
        return o, o.sum(-1)

    pb = abrun.Problem(None, 1, 2, 2, 3, 3, direction, {}, q, k, v, do)
    checked, call = abrun._calls(pb, forward)
    outs = checked()
    assert set(outs) == ({"o", "lse"} if direction == "fwd" else {"o", "lse", "dq", "dk", "dv"})
    n = len(forwards)
    first, second = call(), call()
    if direction == "fwd":
        assert torch.equal(first[0], outs["o"]) and len(forwards) == n + 2
    else:
        assert torch.equal(first[0], outs["dq"]) and torch.equal(second[2], outs["dv"])
        # the backward alone re-runs no forward after the first call
        assert len(forwards) == n + (1 if direction == "bwd" else 2)


@pytest.mark.parametrize("direction", ["fwd_bwd", "bwd"])
def test_param_grads_are_outputs_of_the_backward(direction):
    """``--param-grads``: the trained params' leaves are differentiated with q, k, v; their
    gradients are outputs ``d<name>`` after dq, dk, dv, and the timed call computes them."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 3, 4, generator=g) for _ in range(4))
    bias = torch.randn(3, 3, generator=g).requires_grad_()

    def forward(q, k, v):
        o = ((q @ k.transpose(-1, -2)) + bias).softmax(-1) @ v
        return o, o.sum(-1)

    spec = SimpleNamespace(name="toy", dtype="fp32")
    pb = abrun.Problem(spec, 1, 2, 2, 3, 3, direction, {"bias": bias}, q, k, v, do,
                       trained=("bias",))  # fmt: skip
    checked, call = abrun._calls(pb, forward, {"bias": bias})
    outs = checked()
    assert set(outs) == {"o", "lse", "dq", "dk", "dv", "dbias"}
    want = torch.autograd.grad((forward(q, k, v)[0] * do).sum(), bias)[0]
    torch.testing.assert_close(outs["dbias"], want)
    assert torch.equal(call()[3], outs["dbias"]) and len(call()) == 4
    assert "+dbias" in abrun._title(pb, "x")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["causal_d128", "--param-grads", "--direction", "bwd"],
         "spec 'causal_d128': --param-grads: causal_d128 has no f32 tensor param the score_mod "
         "differentiates"),
        (["t5_bias", "--param-grads"], "--param-grads needs a backward: --direction bwd or "
         "fwd_bwd"),
        (["t5_bias", "--param-grads", "--direction", "bwd", "--peers"],
         "--param-grads: the peers compute no param gradients"),
    ],
)  # fmt: skip
def test_param_grads_argument_errors(argv, message, no_cuda, capsys):
    assert main(["ab", *argv]) == 2
    assert f"error: {message}" in _err(capsys)


def test_param_grads_train_the_tensor_params():
    from flashgen.frontend.spec import load_spec

    specs = Path(__file__).resolve().parents[2] / "specs"
    from flashgen.bench.protocol import trained_params

    assert trained_params(load_spec(specs / "t5_bias.yaml")) == ("bias",)
    assert trained_params(load_spec(specs / "alibi_learned.yaml")) == ("slopes",)
    assert trained_params(load_spec(specs / "causal_d128.yaml")) == ()


def test_table_marks_the_baseline_equal_outputs_and_same_kernels():
    base = abrun.Candidate("atomic_dq=0", "variant", ms={"graph": 2.0}, ratio={"graph": 1.0},
                           kernels=["fwd_sm_90"], tflops=512.0,
                           rule={"max_err": 1e-3, "bound": 4e-3, "ok": True})  # fmt: skip
    same = abrun.Candidate("atomic_dq=1", "variant", ms={"graph": 1.0}, ratio={"graph": 0.5},
                           bitwise=True, same_kernels=True, kernels=["fwd_sm_90"])  # fmt: skip
    peer = abrun.Candidate("sdpa_cudnn", "peer", bitwise=False, max_diff=3e-3)
    bad = abrun.Candidate("flex", "peer")
    bad.fail("unsupported", "no FlexAttention")
    head, rows = abrun.table([base, same, peer, bad], ("graph",))
    assert head[:3] == ["candidate", "graph ms", "ratio"]
    assert rows[0][:4] == ["atomic_dq=0 (baseline)", "2.0000", "1.000", "512.0"]
    assert rows[0][5] == "ok 1.0e-03/4.0e-03" and rows[0][6] == "fwd_sm_90"
    assert rows[1][4] == "bitwise" and rows[1][6] == "same kernels as the baseline"
    assert rows[2][4] == "max|d| 3.00e-03" and rows[3][4] == "unsupported"
    text = abrun.text_table(head, rows)
    assert text.splitlines()[1].startswith("atomic_dq=0 (baseline)")
    assert abrun.md_table(head, rows).splitlines()[1] == "|---|---|---|---|---|---|---|"
    same.outputs = {"o": object()}  # not copied into the JSON row
    same.call = object()
    d = same.to_dict()
    assert "call" not in d and "outputs" not in d and "kernel_ids" not in d
    assert d["name"] == "atomic_dq=1" and d["ms"] == {"graph": 1.0}
    assert d["options"] == {} and d["bitwise"] is True
    import json

    json.dumps(d)


def test_variants_are_loaded_once_each_with_their_options(monkeypatch, tmp_path):
    import flashgen

    loaded = []

    def load(path, options=None):
        loaded.append(options)
        if options is not None and options.family == "fa3":
            raise RuntimeError("no Hopper kernel for this spec")
        return SimpleNamespace(options=options)

    monkeypatch.setattr(flashgen, "load", load)
    values = parse_options(["family=fa2,fa3", "hopper_fwd.affine=0"])
    variants = combinations(values)
    got = abrun.load_variants(tmp_path / "s.yaml", Options, variants, values, (True, False))
    assert [g[0] for g in got] == [
        "family=fa2 deterministic=1", "family=fa2 deterministic=0",
        "family=fa3 deterministic=1", "family=fa3 deterministic=0",
    ]  # fmt: skip
    assert len(loaded) == 2
    assert loaded[0] == Options().with_values({"family": "fa2", "hopper_fwd.affine": False})
    assert got[0][2] is got[1][2] and got[0][2].options is loaded[0]  # one op, both calls
    assert got[2][2] is None and got[2][3] == "RuntimeError: no Hopper kernel for this spec"
    assert [g[4] for g in got] == [True, False, True, False]
    plain = abrun.load_variants(tmp_path / "s.yaml", None, [{}], {}, (None,))
    assert plain[0][0] == "default" and plain[0][3] is None and loaded[2] is None
    from flashgen.cli.commands import parser

    assert parser().parse_args(["ab", "x", "--deterministic", "1,0"]).deterministic == (
        True,
        False,
    )


def test_ab_takes_the_fp8_transposer_option_on_an_fp8_spec():
    """``flashgen ab llama3_fp8 --option hopper_fwd.fp8_transpose=lds32,ldsm``: the arguments
    check (no GPU needed) gives one variant per transposer on the shipped fp8 spec."""
    from flashgen.cli.commands import parser

    a = parser().parse_args(["ab", "llama3_fp8", "--option", "hopper_fwd.fp8_transpose=lds32,ldsm"])
    cls, values, variants, specs = ab.check_args(a)
    assert cls is Options and [s[0] for s in specs] == ["llama3_fp8"]
    assert [v["hopper_fwd.fp8_transpose"] for v in variants] == ["lds32", "ldsm"]
    bad = parser().parse_args(["ab", "llama3_fp8", "--option", "hopper_fwd.fp8_transpose=x"])
    with pytest.raises(options.OptionError, match="lds32, ldsm"):
        ab.check_args(bad)
