"""The device side of ``flashgen ab`` (:mod:`flashgen.bench.ab` parses and checks the
arguments): build each variant's op, run it once and compare its outputs with the baseline's,
check it against the float64 reference, time the variants and peers in alternating rounds,
print and save the results.  Times in ms; needs a CUDA device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from flashgen.bench.options import format_value, variant_label, with_options
from flashgen.bench.timing import (
    alternate,
    capture_graph,
    do_bench_ms,
    environment,
    graph_replay_ms,
    median_or_none,
)

#: Backward FLOPs relative to the forward's, per timed direction (the papers' convention).
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
#: Names of the compared outputs, in the order a call returns them.
FWD_OUTS = ("o", "lse")
GRAD_OUTS = ("dq", "dk", "dv")


@dataclasses.dataclass
class Candidate:
    """One timed thing: a variant (``options`` set) or a peer implementation.

    ``call`` is what the timers run (None once it failed); ``outputs`` its checked call's
    tensors by name; ``samples`` / ``ms`` / ``ratio`` per timer (ratio: ms over the
    baseline's); ``bitwise`` / ``max_diff`` against the baseline's outputs; ``rule`` the
    float64 reference check (``max_err``, ``bound``, ``ok``); ``kernels`` what the checked
    call launched, ``same_kernels`` whether that is exactly the baseline's.
    """

    name: str
    kind: str  # "variant" | "peer"
    options: dict = dataclasses.field(default_factory=dict)
    call: Callable[[], object] | None = None
    outputs: dict = dataclasses.field(default_factory=dict, repr=False)
    status: str = "ok"  # ok | error | unsupported
    note: str = ""
    kernels: list = dataclasses.field(default_factory=list)
    kernel_ids: tuple = ()
    same_kernels: bool | None = None
    bitwise: bool | None = None
    max_diff: float | None = None
    rule: dict | None = None
    samples: dict = dataclasses.field(default_factory=dict)
    ms: dict = dataclasses.field(default_factory=dict)
    ratio: dict = dataclasses.field(default_factory=dict)
    tflops: float | None = None

    def fail(self, status: str, e: BaseException | str) -> None:
        text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
        self.status, self.note, self.call = status, _short(text), None

    def to_dict(self) -> dict:
        """The JSON row (no tensors, no callables: ``asdict`` would deep-copy the outputs)."""
        skip = ("call", "outputs", "kernel_ids")
        out = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip
        }
        out["options"] = {k: format_value(v) for k, v in self.options.items()}
        return out


def _short(text: str, n: int = 300) -> str:
    text = text.strip().replace("\n", " ")
    return text if len(text) <= n else text[: n - 3] + "..."


# ----------------------------------------------------------------------------- timing
def time_candidates(
    cands: list[Candidate],
    timers: tuple[str, ...],
    rounds: int,
    *,
    warmup_ms: int = 25,
    rep_ms: int = 100,
    graph_calls: int = 10,
    replays: int = 5,
) -> None:
    """Time every candidate that has a ``call``, one timer after the other, each in
    ``rounds`` alternating rounds (:func:`~flashgen.bench.timing.alternate`); fill ``samples``,
    ``ms`` (median over the rounds) and ``ratio`` (to ``cands[0]``, the baseline).

    ``graph``: every candidate's calls captured first (:func:`capture_graph`, ``graph_calls``
    calls per graph), then each round replays each graph ``replays`` times
    (:func:`graph_replay_ms`); a candidate whose capture fails gets no graph time (noted).
    ``do_bench``: :func:`do_bench_ms` per candidate per round.  A candidate that raises while
    timed sits out the later rounds of that timer (noted)."""
    if rounds < 1:
        return
    for timer in timers:
        live = [c for c in cands if c.call is not None]
        if timer == "graph":
            graphs: dict[int, object] = {}
            for c in live:
                try:
                    graphs[id(c)] = capture_graph(c.call, graph_calls)
                except Exception as e:  # noqa: BLE001 - that candidate has no graph time
                    _note(c, f"graph capture failed: {type(e).__name__}: {e}")
            live = [c for c in live if id(c) in graphs]

            def measure(i: int, live=live, graphs=graphs) -> float:
                return graph_replay_ms(graphs[id(live[i])], graph_calls, replays)
        else:

            def measure(i: int, live=live) -> float:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    return do_bench_ms(live[i].call, warmup_ms, rep_ms)

        samples, failed = alternate(measure, len(live), rounds)
        for i, c in enumerate(live):
            c.samples[timer] = samples[i]
            c.ms[timer] = median_or_none(samples[i])
            if i in failed:
                e = failed[i]
                _note(c, f"{timer} failed: {type(e).__name__}: {e}")
        graphs = None  # noqa: F841 - free the graphs' memory pools before the next timer
    base = cands[0].ms if cands else {}
    for c in cands:
        c.ratio = {t: (c.ms[t] / base[t] if c.ms.get(t) and base.get(t) else None) for t in c.ms}


def _note(c: Candidate, text: str) -> None:
    c.note = f"{c.note}; {_short(text, 200)}" if c.note else _short(text, 200)


# ----------------------------------------------------------------------------- checks
def compare(outs: dict, base: dict) -> tuple[bool | None, float | None]:
    """(bitwise equal, max |difference|) over the outputs both have (None, None: none).

    Elements infinite in both with the same sign (an empty row's lse) count as equal; a
    NaN or an infinity on one side only makes the difference ``inf``."""
    import torch

    names = [n for n in outs if n in base]
    if not names:
        return None, None
    bitwise, worst = True, 0.0
    for n in names:
        a, b = outs[n], base[n]
        if a.shape != b.shape:
            return False, math.inf
        bitwise &= bool(torch.equal(a, b))
        a, b = a.float(), b.float()
        both = torch.isfinite(a) & torch.isfinite(b)
        same_inf = (a == b) & ~both
        if not bool((both | same_inf).all()):
            worst = math.inf
            continue
        if both.any():
            worst = max(worst, (a[both] - b[both]).abs().max().item())
    return bitwise, worst


@contextlib.contextmanager
def launched_kernels():
    """Within the block, every kernel launched through :mod:`flashgen.runtime.launch` is
    appended to the list this yields (its ``LoadedKernel``); empty where the runtime has
    no ``LoadedKernel.launch`` to watch."""
    from flashgen.runtime import launch

    seen: list = []
    cls = getattr(launch, "LoadedKernel", None)
    orig = getattr(cls, "launch", None)
    if orig is None:
        yield seen
        return

    def spy(self, *args, **kwargs):
        seen.append(self)
        return orig(self, *args, **kwargs)

    cls.launch = spy
    try:
        yield seen
    finally:
        cls.launch = orig


def _poisoned():
    try:
        from flashgen.ops.op import poison_outputs
    except ImportError:
        return contextlib.nullcontext()
    return poison_outputs()


def _needs_block_table(spec) -> bool:
    from flashgen.codegen.abi import needs_block_table

    return needs_block_table(spec)


# ----------------------------------------------------------------------------- one problem
@dataclasses.dataclass
class Problem:
    """The inputs of one (spec, shape, direction): q, k, v (and dO), params, FLOPs."""

    spec: object
    batch: int
    heads: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    direction: str
    params: dict
    q: object
    k: object
    v: object
    do: object = None
    flops: float | None = None
    trained: tuple = ()  # the params whose gradients a backward computes (--param-grads)

    def describe(self) -> dict:
        return {
            "spec": self.spec.name,
            "batch": self.batch,
            "heads": self.heads,
            "heads_kv": self.heads_kv,
            "seqlen_q": self.seqlen_q,
            "seqlen_k": self.seqlen_k,
            "direction": self.direction,
            "scalar_params": {k: v for k, v in self.params.items() if not hasattr(v, "shape")},
            "flops": self.flops,
            "param_grads": list(self.trained),
        }


def _calls(
    pb: Problem, forward: Callable, leaves: dict | None = None
) -> tuple[Callable[[], dict], Callable[[], object]]:
    """(the checked call returning its outputs by name, the call to time) of ``forward``
    (``f(q, k, v) -> o`` or ``(o, lse)``) in ``pb.direction``.  ``leaves``: more tensors the
    backward differentiates (``--param-grads``: the trained params, by name, which ``forward``
    reads), their gradients ``d<name>`` after dq, dk, dv."""
    import torch

    leaves = leaves or {}
    grad_outs = GRAD_OUTS + tuple(f"d{n}" for n in leaves)

    def named(res, grads=()):  # a peer returns o alone, flashgen (o, lse)
        res = res if isinstance(res, tuple) else (res,)
        out = dict(zip(FWD_OUTS[: len(res)], res, strict=True))
        out.update(zip(grad_outs[: len(grads)], grads, strict=True))
        return out

    if pb.direction == "fwd":

        def run():
            with torch.no_grad():
                return forward(pb.q, pb.k, pb.v)

        return (lambda: named(run())), run
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (pb.q, pb.k, pb.v))
    wrt = (qg, kg, vg, *leaves.values())

    def first(res):
        return res[0] if isinstance(res, tuple) else res

    def checked():
        res = forward(qg, kg, vg)
        grads = torch.autograd.grad(first(res), wrt, pb.do)
        return named(tuple(t.detach() for t in (res if isinstance(res, tuple) else (res,))), grads)

    if pb.direction == "fwd_bwd":

        def step():
            return torch.autograd.grad(first(forward(qg, kg, vg)), wrt, pb.do)

        return checked, step
    kept: list = []

    def bwd():  # the backward alone, of a forward run once (its graph kept)
        if not kept:
            kept.append(first(forward(qg, kg, vg)))
        return torch.autograd.grad(kept[0], wrt, pb.do, retain_graph=True)

    return checked, bwd


def prepare_variant(c: Candidate, op, pb: Problem, deterministic: bool | None) -> None:
    """Run variant ``c`` (its ``op``) once on ``pb``, outputs poisoned first; set its
    ``outputs``, ``kernels`` and the ``call`` to time.  A failure marks ``c`` an error."""
    import torch

    from flashgen.bench.verify import call_padded

    try:
        kw = dict(pb.params)
        if deterministic is not None:
            kw["deterministic"] = deterministic
        if _needs_block_table(pb.spec):
            kw["block_mask"] = op.block_mask(
                pb.seqlen_q, pb.seqlen_k, batch=pb.batch, num_heads=pb.heads,
                num_heads_kv=pb.heads_kv, **pb.params,
            )  # fmt: skip
        leaves = {}
        if pb.direction != "fwd":  # --param-grads: this variant's own leaves of the params
            leaves = {n: pb.params[n].detach().clone().requires_grad_() for n in pb.trained}
            kw.update(leaves)
        checked, call = _calls(pb, lambda q, k, v: call_padded(op, q, k, v, kw), leaves)
        with launched_kernels() as seen, _poisoned():
            c.outputs = checked()
        torch.cuda.synchronize()
        c.kernels = list(dict.fromkeys(getattr(k.plan, "kernel_name", "?") for k in seen))
        c.kernel_ids = tuple(dict.fromkeys(id(k) for k in seen))
        c.call = call
    except Exception as e:  # noqa: BLE001 - recorded, the other variants go on
        c.fail("error", e)


def prepare_peer(c: Candidate, pb: Problem, device) -> None:
    """Peer ``c.name`` (:func:`flashgen.bench.peers.make_forward`) on ``pb``: run once,
    ``outputs`` (o, and the gradients when a backward runs), the ``call`` to time."""
    import torch

    from flashgen.bench.peers import Unsupported, make_forward

    try:
        f = make_forward(c.name, pb.spec, pb.seqlen_q, pb.seqlen_k, pb.params, device)
        checked, call = _calls(pb, f)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            c.outputs = checked()
        torch.cuda.synchronize()
        c.call = call
    except Unsupported as e:
        c.fail("unsupported", str(e))
    except Exception as e:  # noqa: BLE001 - an SDPA backend refusing a config, say
        c.fail("unsupported" if isinstance(e, RuntimeError) else "error", e)


def reference_check(spec, runs: list[tuple], shape, device) -> list[dict | str]:
    """Each ``(op, deterministic)``'s forward at ``shape`` (:class:`~flashgen.bench.ab.Shape`)
    against the float64 reference with the tests' rule
    (:func:`flashgen.bench.verify.error_bound`): ``{"max_err", "bound", "ok", "shape"}`` per
    run, or the error text of one that raised (``not built`` for an op that is None)."""
    import torch

    from flashgen.bench.verify import call_padded, error_bound, random_inputs

    b, h, hkv, sq, sk = shape.resolve(spec.head_dim)
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v, params = random_inputs(spec, b, h, hkv, sq, sk, device, gen)
    ref_o, _, bound = error_bound(spec, q, k, v, params)
    out: list[dict | str] = []
    for op, det in runs:
        kw = dict(params) | ({"deterministic": det} if det is not None else {})
        if op is None:
            out.append("not built")
            continue
        try:
            with _poisoned():
                o, _ = call_padded(op, q, k, v, kw)
            e = (o.double() - ref_o).abs().max().item() if o.numel() else 0.0
            ok = math.isfinite(e) and e <= bound
            out.append({"max_err": e, "bound": bound, "ok": ok, "shape": shape.text()})
        except Exception as e:  # noqa: BLE001 - reported for that variant
            out.append(_short(f"{type(e).__name__}: {e}"))
    return out


# ----------------------------------------------------------------------------- reports
def table(cands: list[Candidate], timers: tuple[str, ...]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of one problem's results, for :func:`text_table` / :func:`md_table`."""
    head = ["candidate"]
    for t in timers:
        head += [f"{t} ms", "ratio"]
    head += ["TFLOP/s", "vs baseline", "reference", "kernels"]
    rows = []
    for i, c in enumerate(cands):
        name = c.name + (" (baseline)" if i == 0 and c.kind == "variant" else "")
        row = [name]
        for t in timers:
            ms, r = c.ms.get(t), c.ratio.get(t)
            row += [f"{ms:.4f}" if ms else "-", f"{r:.3f}" if r else "-"]
        row.append(f"{c.tflops:.1f}" if c.tflops else "-")
        if c.status != "ok":
            vs = c.status
        elif i == 0 or c.bitwise is None:
            vs = "-"
        else:
            vs = "bitwise" if c.bitwise else f"max|d| {c.max_diff:.2e}"
        row.append(vs)
        rule = c.rule
        row.append(
            "-"
            if not rule
            else f"{'ok' if rule['ok'] else 'FAIL'} {rule['max_err']:.1e}/{rule['bound']:.1e}"
        )
        kern = ", ".join(c.kernels) if c.kernels else "-"
        if c.same_kernels and i > 0:
            kern = "same kernels as the baseline"
        row.append(kern)
        rows.append(row)
    return head, rows


def text_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [head, *rows]
    )


def md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _title(pb: Problem, item: str) -> str:
    gqa = f"/{pb.heads_kv}" if pb.heads_kv != pb.heads else ""
    sk = f" Sk={pb.seqlen_k}" if pb.seqlen_k != pb.seqlen_q else ""
    grads = "".join(f" +d{n}" for n in pb.trained) if pb.direction != "fwd" else ""
    return (
        f"{item} B={pb.batch} H={pb.heads}{gqa} S={pb.seqlen_q}{sk} {pb.spec.dtype} "
        f"{pb.direction}{grads}"
    )


def save(out: Path, doc: dict, markdown: list[str]) -> None:
    """(Re)write ``ab.json`` (atomically) and ``ab.md`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".ab.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, out / "ab.json")
    (out / "ab.md").write_text("\n\n".join(markdown) + "\n")


# ----------------------------------------------------------------------------- the run
def _inputs(spec, b, h, hkv, sq, sk, device, direction, seed: int = 0):
    import torch

    from flashgen.ops.op import TORCH_DTYPE

    dt = TORCH_DTYPE[spec.dtype]
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=g).to(dt)

    q = randn(b, h, sq, spec.head_dim)
    k = randn(b, hkv, sk, spec.head_dim)
    v = randn(b, hkv, sk, spec.head_dim_v)
    do = randn(b, h, sq, spec.head_dim_v) if direction != "fwd" else None
    return q, k, v, do


def load_variants(
    path: Path, cls, variants: list[dict], values: dict, dets: tuple = (None,)
) -> list[tuple]:
    """``(label, assignments, op or None, error text, deterministic)`` per variant and
    ``deterministic`` value: ``flashgen.load(path, options=...)`` (plain
    ``flashgen.load(path)`` without ``--option``), once per variant."""
    import flashgen

    out = []
    for assign in variants:
        label = variant_label(assign, values)
        op = err = None
        try:
            if cls is None:
                op = flashgen.load(path)
            else:
                op = flashgen.load(path, options=with_options(cls(), assign))
        except Exception as e:  # noqa: BLE001 - recorded per variant
            err = _short(f"{type(e).__name__}: {e}")
        for det in dets:
            name = label
            if len(dets) > 1:
                flag = f"deterministic={int(det)}"
                name = flag if label == "default" else f"{label} {flag}"
            out.append((name, assign, op, err, det))
    return out


def run(args, cls, values: dict, variants: list[dict], specs: list[tuple]) -> int:
    """Every (spec, shape, direction) of ``args`` (``specs``: ``(item, file, scalar param
    overrides)``; ``cls`` the options class, None without options; ``variants`` the options
    set per variant, ``values`` every option's values): prepare, check and time the variants
    and peers, print a table each, save ``ab.json`` / ``ab.md``.  Returns the exit status."""
    import torch

    from flashgen.bench.protocol import kept_pairs, spec_params, trained_params
    from flashgen.frontend.spec import load_spec

    device = torch.device("cuda", torch.cuda.current_device())
    dets = args.deterministic or (None,)
    out = Path(args.out)
    doc = {
        "schema": "flashgen-ab/1",
        "env": environment(),
        "argv": sys.argv[1:],
        "options": {k: [format_value(v) for v in vs] for k, vs in values.items()},
        "variants": [variant_label(a, values) for a in variants],
        "deterministic": [None if d is None else int(d) for d in dets],
        "problems": [],
    }
    markdown: list[str] = []
    status = 0
    t0 = time.perf_counter()
    for item, path, over in specs:
        spec = load_spec(path)
        built = load_variants(path, cls, variants, values, dets)
        rules = (
            [None] * len(built)
            if args.no_check
            else reference_check(spec, [(b[2], b[4]) for b in built], args.check_shape, device)
        )
        for shape in args.shapes:
            b, h, hkv, sq, sk = shape.resolve(spec.head_dim)
            params = spec_params(spec, h, b, sq, sk, device, heads_kv=hkv)
            params.update({p.name: p.default for p in spec.scalar_params} | over)
            kept = kept_pairs(spec, b, h, sq, params, device, heads_kv=hkv) if sq == sk else None
            for direction in args.direction:
                q, k, v, do = _inputs(spec, b, h, hkv, sq, sk, device, direction)
                pb = Problem(spec, b, h, hkv, sq, sk, direction, params, q, k, v, do)
                if getattr(args, "param_grads", False):
                    pb.trained = trained_params(spec)
                if kept is not None:
                    d = spec.head_dim + spec.head_dim_v
                    pb.flops = 2.0 * d * kept * FLOP_FACTOR[direction]
                cands = []
                for (label, assign, op, err, det), rule in zip(built, rules, strict=True):
                    c = Candidate(label, "variant", dict(assign))
                    if det is not None:
                        c.options["deterministic"] = det
                    if op is None:
                        c.fail("error", err)
                    else:
                        prepare_variant(c, op, pb, det)
                    if isinstance(rule, str) and c.status == "ok":
                        c.fail("error", f"reference check: {rule}")
                    elif rule is not None:
                        c.rule = rule
                    cands.append(c)
                for impl in args.peers:
                    c = Candidate(impl, "peer")
                    prepare_peer(c, pb, device)
                    cands.append(c)
                base = cands[0]
                for c in cands[1:]:
                    if base.outputs and c.outputs:
                        c.bitwise, c.max_diff = compare(c.outputs, base.outputs)
                    if c.kind == "variant" and base.kernel_ids and c.kernel_ids:
                        c.same_kernels = c.kernel_ids == base.kernel_ids
                time_candidates(
                    cands, args.timer, args.rounds, warmup_ms=args.warmup_ms,
                    rep_ms=args.rep_ms, graph_calls=args.graph_calls, replays=args.replays,
                )  # fmt: skip
                for c in cands:
                    first = next((c.ms[t] for t in args.timer if c.ms.get(t)), None)
                    if pb.flops and first:
                        c.tflops = pb.flops / (first * 1e-3) / 1e12
                    bad_rule = c.rule is not None and not c.rule["ok"]
                    differs = args.require_bitwise and c.bitwise is False
                    if c.kind == "variant" and (c.status != "ok" or bad_rule or differs):
                        status = 1
                title = _title(pb, item)
                head, rows = table(cands, args.timer)
                print(f"\n{title}\n{text_table(head, rows)}", flush=True)
                markdown.append(f"## {title}\n\n{md_table(head, rows)}")
                doc["problems"].append(
                    pb.describe() | {"item": item, "candidates": [c.to_dict() for c in cands]}
                )
                doc["elapsed_s"] = round(time.perf_counter() - t0, 1)
                save(out, doc, markdown)
                cands = pb = q = k = v = do = None
                gc.collect()
                torch.cuda.empty_cache()
    print(f"\nwrote {out / 'ab.json'} and {out / 'ab.md'}", file=sys.stderr)
    return status
