"""What trainable params and attention sinks cost, timed in one process: each call against
the same call without them, next to the ratio it should stay within; the trained-param calls
also against FlexAttention's with the same tensor requiring grad.

    flashgen bench --training --out benchmarks/results/<dir>   # on the GPU
    flashgen bench --training --device cpu --seqlen 64 --batch 1 --heads 2 \\
        --rounds 1

Rows (forward + backward unless named, bf16, (B, S, H, D) as flags say; medians of alternating
rounds, :func:`flashgen.bench.timing.alternate`; a forward + backward is ``o = f(q, k, v)``
then ``o.backward(dO)``, one random dO per row for every candidate):

- ``alibi``: slopes detached vs slopes requiring grad (target: at most 1.1x), and requiring
  grad with ``hopper_bwd.dparam_affine`` (the slopes' sums in the dS^T pass, the detached
  unit's steps);
- ``t5_bias``: the bias table detached vs requiring grad (target: at most 1.3x; by default
  the table's gradient in the Hopper backward, ``hopper_bwd.dparam_diagonal``, with
  ``hopper_bwd.dparam_const_tiles``: its steps away from the diagonal read one element of the
  table, one running sum instead of per-diagonal sums), and requiring grad with
  ``dparam_const_tiles`` off (the per-diagonal sums on every step), then with
  ``dparam_diagonal`` off too (the FA2-class kernels);
- in both, FlexAttention with the same tensor requiring grad (``slopes trained flex``, ``bias
  trained flex``, :class:`FlexPeer`): ``torch.compile(flex_attention)`` with the spec's
  score_mod capturing the slopes / table (built as ``bench --gallery`` builds Flex,
  :func:`flashgen.bench.peers.make_forward`), forward + backward on the same q, k, v and dO.
  The target: flashgen's trained call at least 2x as fast (:data:`FLEX_TARGET`); the
  line's ``flashgen/Flex speed (target >= 2x)`` and results.json's ``vs_flex`` give Flex's ms
  over each flashgen trained call's (``speed_flashgen_over_flex``).  Before timing, once, as
  ``flashgen ab`` compares variants, Flex's gradients (the captured tensor's, dq, dk, dv)
  are checked against flashgen's default build's on the same inputs (:func:`compare_grads`:
  within :data:`FLEX_TOL` of each one's largest element; ``vs_flex.grad_check``); should they
  differ, or Flex not give the captured tensor's gradient in this torch (or fail), Flex is not
  timed and the row says why (``n/a``); the ``ratios`` stay flashgen's candidates against the
  detached call;
- ``gpt_oss_sink``: forward, forward + backward and decode (``with_kvcache``, one query per
  request; unplanned, and planned as a serving loop calls it: ``gpt_oss_sink decode planned``)
  with the sink vs the same op with ``apply_sink=False`` (target: within 5%); by
  default the kernels join the sink (the prefill forward in its epilogue, whose backward takes
  the sink in its pre kernel; decode inside its attention kernel); each row also with the sink
  applied by torch ops after the kernels (``sink by torch ops``: ``fa2_fwd.fused_sink``,
  ``hopper_fwd.fused_sink`` and ``decode.fused_sink`` False).

With ``--device cpu`` (a smoke run of the same calls) the candidates of options that shape GPU
kernels only (:data:`GPU_ONLY`: ``hopper_bwd.dparam_affine``, ``dparam_diagonal``,
``dparam_const_tiles``, the ``fused_sink`` options) are left out, and said so, rather than
timed as copies of their row's other calls; so are the FlexAttention calls (:data:`FLEX_CPU`:
torch's FlexAttention has no backward on CPU), the flashgen/Flex speed then ``n/a on cpu``.
``--device cuda`` (the default) needs a CUDA GPU (exit 2 without one).

Prints one line per row; with ``--out DIR`` also writes ``DIR/results.json`` (rows, ratios,
:func:`flashgen.bench.timing.environment`), without it nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from flashgen.bench import helptext
from flashgen.bench.argtypes import positive_int

#: Candidates whose option shapes GPU kernels only, by name: why a CPU run leaves them out.
GPU_ONLY = {
    "slopes trained dparam_affine": "hopper_bwd.dparam_affine shapes the Hopper backward only",
    "bias trained dparam_const_tiles=0": "hopper_bwd.dparam_const_tiles shapes the Hopper "
    "backward only",
    "bias trained dparam_diagonal=0": "hopper_bwd.dparam_diagonal shapes the Hopper backward only",
    "sink by torch ops": "fa2_fwd.fused_sink, hopper_fwd.fused_sink and decode.fused_sink shape "
    "the GPU kernels only (the CPU op always applies the sink by torch ops)",
}
#: Why a CPU run leaves the FlexAttention candidates out: torch's FlexAttention raises
#: ``NotImplementedError`` ("FlexAttention does not support backward on CPU") for inputs that
#: require grad on the CPU (tests/unit/test_bench_training.py checks this torch still does).
FLEX_CPU = "FlexAttention has no backward on CPU (torch raises NotImplementedError)"
#: The FlexAttention candidates, by name (``<param> trained flex``), and the param they train.
FLEX_CANDIDATES = {"slopes trained flex": "slopes", "bias trained flex": "bias"}
#: Every candidate a CPU run leaves out, by name: why.
NOT_ON_CPU = {**GPU_ONLY, **dict.fromkeys(FLEX_CANDIDATES, FLEX_CPU)}
#: Issue 37's target against FlexAttention: flashgen's trained forward+backward at least this
#: many times as fast as FlexAttention's with the same captured tensor requiring grad (the
#: speed ratio is Flex's ms over flashgen's).
FLEX_TARGET = 2.0
#: The check of Flex's gradients against flashgen's before timing: max |Flex - flashgen| of
#: each gradient (dq, dk, dv in bf16; the param's in fp32, a sum over every (b, h, q, k) pair of
#: bf16-rounded terms) at most this fraction of its largest element, as the GPU tests hold
#: flashgen's to the float64 reference (tests/gpu/test_param_grads_sinks_gpu.py).
FLEX_TOL = 2e-2


@dataclasses.dataclass
class Row:
    """One printed row: its candidates ``[(name, fn)]`` (the first the baseline) and, for the
    trained-param rows, the FlexAttention peer among them."""

    name: str
    cands: list
    flex: FlexPeer | None = None


def _step(f: Callable, q, k, v, do) -> Callable[[], None]:
    """A training step of ``f(q, k, v) -> o``: forward, then ``o.backward(do)`` (the leaves'
    gradients accumulate in ``.grad``, as in training)."""

    def step():
        f(q, k, v).backward(do)

    return step


def _grads(f: Callable, q, k, v, param, name: str, do) -> dict:
    """``{dq, dk, dv, d<name>}`` of one call of ``f(q, k, v) -> o`` with upstream ``do``
    (``torch.autograd.grad``, ``.grad`` untouched; a gradient the call does not give: None)."""
    import torch

    o = f(q, k, v)
    grads = torch.autograd.grad(o, (q, k, v, param), do, allow_unused=True)
    return dict(zip(("dq", "dk", "dv", f"d{name}"), grads, strict=True))


def compare_grads(got: dict, want: dict, tol: float = FLEX_TOL) -> dict:
    """``got`` (Flex's gradients by name) against ``want`` (flashgen's): ``max_rel_err``, each
    one's max |difference| (:func:`flashgen.bench.abrun.compare`: NaN or infinity on one side
    only, or another shape, is ``inf``) over the largest finite element of the two; ``ok``
    when every one is at most ``tol``; ``error`` says which are not, or which Flex did not
    give (None, its gradient missing), else None."""
    from flashgen.bench.abrun import compare

    errs: dict = {}
    problems = []
    for n, w in want.items():
        g = got.get(n)
        if g is None:
            problems.append(f"FlexAttention gave no {n}")
            continue
        _, diff = compare({n: g}, {n: w})
        scale = max(float(t.detach().float().abs().nan_to_num(0, 0, 0).max()) for t in (g, w))
        rel = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
        errs[n] = rel
        if not rel <= tol:
            problems.append(f"{n} differs by {rel:.3g} of its largest element")
    return {"ok": not problems, "max_rel_err": errs, "tolerance": tol,
            "error": "; ".join(problems) or None}  # fmt: skip


class FlexPeer:
    """FlexAttention's training step on a row's q, k, v and dO: ``torch.compile``'d
    ``flex_attention`` with the spec's score_mod capturing a copy of ``value`` that requires
    grad (built as ``bench --gallery`` builds Flex, :func:`flashgen.bench.peers.make_forward`:
    :func:`flashgen.bench.flexmods.flex_mods`, the compiled ``flex_attention`` created once, a
    causal spec's block mask built once), so its backward computes that tensor's gradient as
    flashgen's trained candidates do.  Built at the first call (a CPU run makes none);
    :meth:`check` compares its gradients with flashgen's once, before timing.  ``versus``:
    flashgen's trained candidates, each timed against it."""

    def __init__(self, op, pname: str, value, q, k, v, do, versus: list[str]):
        self.op, self.pname, self.value = op, pname, value
        self.q, self.k, self.v, self.do = q, k, v, do
        self.name = f"{pname} trained flex"
        if FLEX_CANDIDATES.get(self.name) != pname:  # the CPU run leaves it out by this name
            raise ValueError(f"{self.name!r} is not in FLEX_CANDIDATES")
        self.versus = versus
        self.param = value.detach().clone().requires_grad_()
        self._flex = None
        self.step = _step(self.forward, q, k, v, do)

    def forward(self, q, k, v):
        if self._flex is None:
            from flashgen.bench.peers import make_forward

            self._flex = make_forward("flex", self.op.spec, q.shape[-2], k.shape[-2],
                                      {self.pname: self.param}, q.device)  # fmt: skip
        return self._flex(q, k, v)

    def check(self) -> dict:
        """Once, before timing: Flex's dq, dk, dv and d<param> against flashgen's (the row's
        op, default options) on the same inputs, :func:`compare_grads`; ``check_s`` its
        seconds (Flex's torch.compile included).  Where Flex's call fails (no gradient of a
        captured tensor in this torch, say), ``ok`` False and ``error`` says so; nothing is
        raised."""
        import torch

        t0 = time.perf_counter()
        mine = self.value.detach().clone().requires_grad_()
        qkv = (self.q, self.k, self.v)
        try:
            want = _grads(lambda q, k, v: self.op.attention(q, k, v, **{self.pname: mine})[0],
                          *qkv, mine, self.pname, self.do)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the row says so; its timing fails too
            return {"ok": False, "error": f"flashgen's trained call failed: {_error(e)}"}
        try:
            got = _grads(self.forward, *qkv, self.param, self.pname, self.do)
        except Exception as e:  # noqa: BLE001 - no FlexAttention, no captured-buffer grads
            return {"ok": False, "error": (
                f"FlexAttention's forward+backward with the captured {self.pname} requiring "
                f"grad failed in torch {torch.__version__}: {_error(e)}")}  # fmt: skip
        if got[f"d{self.pname}"] is None:
            return {"ok": False, "error": (
                f"FlexAttention gives no gradient of the captured {self.pname} in torch "
                f"{torch.__version__}")}  # fmt: skip
        if self.q.is_cuda:
            torch.cuda.synchronize()
        return {**compare_grads(got, want), "check_s": time.perf_counter() - t0}


def _error(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


def vs_flex(peer: FlexPeer, ms: dict, check: dict | None, left_out: str | None) -> tuple[dict, str]:
    """A trained row's comparison with FlexAttention: (its ``vs_flex`` entry in results.json,
    its part of the printed line).  ``ms``: each timed candidate's median (None: failed);
    ``check``: :meth:`FlexPeer.check`'s result (None: not run); ``left_out``: why it was not
    run (a CPU run).  The entry: ``flex`` (the Flex candidate), ``target``
    (:data:`FLEX_TARGET`), ``speed_flashgen_over_flex`` (each of ``peer.versus`` timed: Flex's
    ms / its ms; absent where Flex was not timed), ``grad_check`` and ``n/a`` (why there is no
    speed ratio)."""
    head = f"flashgen/Flex speed (target >= {FLEX_TARGET:g}x)"
    entry: dict = {"flex": peer.name, "target": FLEX_TARGET}
    if check is not None:
        entry["grad_check"] = check
    flex_ms = ms.get(peer.name)
    if left_out:
        entry["n/a"] = left_out
        return entry, f"{head} n/a on cpu: {left_out}"
    if check is not None and not check["ok"]:
        entry["n/a"] = f"Flex not timed: {check['error']}"
        return entry, f"{head} n/a: {entry['n/a']}"
    if not flex_ms:
        entry["n/a"] = "Flex's timing failed"
        return entry, f"{head} n/a: {entry['n/a']}"
    speed = {n: flex_ms / ms[n] for n in peer.versus if ms.get(n)}
    entry["speed_flashgen_over_flex"] = speed
    shown = ", ".join(f"{n} {r:.2f}x" for n, r in speed.items()) or "n/a (flashgen failed)"
    worst = max((check or {}).get("max_rel_err", {}).values(), default=None)
    checked = "" if worst is None else f"; grads match (max rel err {worst:.1e} <= {FLEX_TOL:g})"
    return entry, f"{head}: {shown}{checked}"


def _timer(device: str, warmup_ms: int, rep_ms: int):
    """``time(fn) -> ms``: :func:`flashgen.bench.timing.do_bench_ms` on CUDA, a wall-clock
    median of 3 calls on CPU (a smoke run)."""
    if device == "cuda":
        from flashgen.bench.timing import do_bench_ms

        return lambda fn: do_bench_ms(fn, warmup_ms, rep_ms)

    def wall(fn):
        fn()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    return wall


def _cases(args) -> list[Row]:
    """Each row's candidates (the first the baseline) and FlexAttention peer."""
    import torch

    import flashgen
    from flashgen.options import Options

    dev, dt = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    b, h, s = args.batch, args.heads, args.seqlen
    g = torch.Generator(device=dev).manual_seed(0)

    def qkv(d):
        return [torch.randn(b, h, s, d, device=dev, dtype=dt, generator=g).requires_grad_()
                for _ in range(3)]  # fmt: skip

    def grad_out(d):  # one dO per row, the same for every candidate
        return torch.randn(b, h, s, d, device=dev, dtype=dt, generator=g)

    def train(op, q, k, v, do, **kw):
        return _step(lambda q, k, v: op.attention(q, k, v, **kw)[0], q, k, v, do)

    def with_flex(row, cands, op, pname, value, q, k, v, do):
        """The row with FlexAttention's trained call last (:class:`FlexPeer`; a CPU run
        leaves it out, :data:`NOT_ON_CPU`)."""
        peer = FlexPeer(op, pname, value, q, k, v, do,
                        versus=[n for n, _ in cands if " trained" in n])  # fmt: skip
        rows.append(Row(row, [*cands, (peer.name, peer.step)], peer))

    rows: list[Row] = []
    op = flashgen.load("alibi")
    q, k, v = qkv(128)
    do = grad_out(128)
    slopes = torch.linspace(0.01, 0.5, h, device=dev)
    affine = flashgen.load(
        "alibi", options=Options().replace_path("hopper_bwd.dparam_affine", True)
    )
    with_flex("alibi fwd+bwd", [
        ("slopes detached", train(op, q, k, v, do, slopes=slopes)),
        ("slopes trained", train(op, q, k, v, do, slopes=slopes.clone().requires_grad_())),
        ("slopes trained dparam_affine",
         train(affine, q, k, v, do, slopes=slopes.clone().requires_grad_())),
    ], op, "slopes", slopes, q, k, v, do)  # fmt: skip
    op = flashgen.load("t5_bias")
    q, k, v = qkv(64)
    do = grad_out(64)
    bias = torch.rand(h, 257, device=dev, generator=g)
    diag_options = Options().replace_path("hopper_bwd.dparam_const_tiles", False)
    diag = flashgen.load("t5_bias", options=diag_options)
    fa2 = flashgen.load(
        "t5_bias", options=diag_options.replace_path("hopper_bwd.dparam_diagonal", False)
    )
    with_flex("t5_bias fwd+bwd", [
        ("bias detached", train(op, q, k, v, do, bias=bias)),
        ("bias trained", train(op, q, k, v, do, bias=bias.clone().requires_grad_())),
        ("bias trained dparam_const_tiles=0",
         train(diag, q, k, v, do, bias=bias.clone().requires_grad_())),
        ("bias trained dparam_diagonal=0",
         train(fa2, q, k, v, do, bias=bias.clone().requires_grad_())),
    ], op, "bias", bias, q, k, v, do)  # fmt: skip
    op = flashgen.load("gpt_oss_sink")
    q, k, v = qkv(64)
    do = grad_out(64)
    sinks = torch.linspace(-1, 2, h, device=dev).requires_grad_()
    by_torch = flashgen.load("gpt_oss_sink", options=Options().with_values(
        {"fa2_fwd.fused_sink": False, "hopper_fwd.fused_sink": False,
         "decode.fused_sink": False}))  # fmt: skip

    def fwd(fop=op, **kw):
        def call():
            with torch.no_grad():
                fop.attention(q, k, v, sinks=sinks, **kw)

        return call

    rows.append(Row("gpt_oss_sink fwd", [("no sink", fwd(apply_sink=False)), ("sink", fwd()),
                                         ("sink by torch ops", fwd(by_torch))]))  # fmt: skip
    rows.append(Row("gpt_oss_sink fwd+bwd", [
        ("no sink", train(op, q, k, v, do, sinks=sinks, apply_sink=False)),
        ("sink", train(op, q, k, v, do, sinks=sinks)),
        ("sink by torch ops", train(by_torch, q, k, v, do, sinks=sinks)),
    ]))  # fmt: skip
    bf16 = torch.bfloat16  # decode takes the spec's dtype on CPU too
    kc = torch.randn(b * 4, h // 2 or 1, s, 64, device=dev, generator=g).to(bf16)
    vc = torch.randn_like(kc)
    qd = torch.randn(b * 4, h, 1, 64, device=dev, generator=g).to(bf16)
    lens = torch.full((b * 4,), s, dtype=torch.int32, device=dev)

    def decode(dop=op, **kw):
        def call():
            dop.with_kvcache(qd, kc, vc, lens, sinks=sinks.detach(), **kw)

        return call

    rows.append(Row("gpt_oss_sink decode", [("no sink", decode(apply_sink=False)),
                                            ("sink", decode()),
                                            ("sink by torch ops", decode(by_torch))]))  # fmt: skip
    # a serving loop's call: planned once (no host planning, no workspace allocation), so the
    # row compares the kernels and the fast path, not the general path's host time
    plan = op.plan_decode(batch=b * 4, num_heads=h, num_heads_kv=h // 2 or 1, seqlen_q=1,
                          cache_capacity=s, device=torch.device(dev))  # fmt: skip
    rows.append(Row("gpt_oss_sink decode planned", [
        ("no sink", decode(apply_sink=False, plan=plan)), ("sink", decode(plan=plan))]))
    return rows


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(
        prog=prog, description=helptext.plain(__doc__), formatter_class=helptext.HelpFormatter
    )
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cuda (default; needs a GPU) or cpu (a smoke run)")  # fmt: skip
    ap.add_argument("--batch", type=positive_int("batch"), default=2)
    ap.add_argument("--heads", type=positive_int("heads"), default=16)
    ap.add_argument("--seqlen", type=positive_int("seqlen"), default=4096)
    ap.add_argument("--rounds", type=positive_int("rounds"), default=5)
    ap.add_argument("--warmup-ms", type=positive_int("warmup-ms"), default=100)
    ap.add_argument("--rep-ms", type=positive_int("rep-ms"), default=500)
    ap.add_argument("--out", type=Path, default=None, metavar="DIR",
                    help="write DIR/results.json (default: none; the rows are printed)")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        import sys

        from flashgen.bench.verify import NO_GPU_EXIT, require_cuda

        problem = require_cuda("bench --training")
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return NO_GPU_EXIT
    from flashgen.bench.timing import alternate, environment

    time_ms = _timer(args.device, args.warmup_ms, args.rep_ms)
    results = []
    for r in _cases(args):
        row, cands, peer = r.name, r.cands, r.flex
        if args.device == "cpu":
            omitted = {n: f"n/a on cpu: {NOT_ON_CPU[n]}" for n, _ in cands if n in NOT_ON_CPU}
            cands = [c for c in cands if c[0] not in NOT_ON_CPU]
        else:
            omitted = {}
        check = None
        if peer is not None and peer.name not in omitted:
            check = peer.check()  # once, before timing: no timing of unequal work
            if not check["ok"]:
                cands = [c for c in cands if c[0] != peer.name]
        samples, failed = alternate(lambda i, c=cands: time_ms(c[i][1]), len(cands), args.rounds)
        meds = [statistics.median(x) if x else None for x in samples]
        entry = {"row": row, "candidates": {}}
        for i, ((name, _), med) in enumerate(zip(cands, meds, strict=True)):
            error = repr(failed[i]) if i in failed else None
            entry["candidates"][name] = {"ms": med, "error": error}
        if check is not None and not check["ok"]:
            entry["candidates"][peer.name] = {"ms": None, "error": check["error"]}
        if len(cands) > 1 and meds[0] and meds[1]:
            entry["ratio"] = meds[1] / meds[0]
        mine = [(n, m) for (n, _), m in zip(cands, meds, strict=True) if n not in FLEX_CANDIDATES]
        if len(mine) > 2 and meds[0]:  # every flashgen candidate against the first
            entry["ratios"] = {n: m / meds[0] for n, m in mine if m}
        if omitted:
            entry["omitted"] = omitted
        against = ""
        if peer is not None:
            ms = {n: m for (n, _), m in zip(cands, meds, strict=True)}
            why = NOT_ON_CPU[peer.name] if peer.name in omitted else None
            entry["vs_flex"], against = vs_flex(peer, ms, check, why)
            against = f"  {against}"
        results.append(entry)
        shown = ", ".join(f"{n} {m:.3f} ms" if m else f"{n} failed" for (n, _), m in
                          zip(cands, meds, strict=True))  # fmt: skip
        ratio = f"  ratio {entry['ratio']:.3f}" if "ratio" in entry else ""
        if "ratios" in entry:
            ratio = "  ratios " + ", ".join(f"{n} {r:.3f}" for n, r in entry["ratios"].items())
        left = f"  ({', '.join(omitted)}: n/a on cpu)" if omitted else ""
        print(f"{row:24s} {shown}{ratio}{against}{left}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        env = environment() if args.device == "cuda" else {"device": "cpu"}
        doc = {"args": {k: str(v) for k, v in vars(args).items()}, "env": env, "rows": results}
        (args.out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
