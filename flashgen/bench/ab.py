"""``flashgen ab``: a spec's op under each combination of option values, timed side by side.

    flashgen ab SPEC[:p=v,...]... --option NAME=A,B[,...] [--option ...] [--combine zip]
                [--peers [sdpa_flash,sdpa_cudnn,flex]] [--shapes S | BxHxS | BxHQ/HKVxSQxSK ...]
                [--direction fwd,bwd,fwd_bwd] [--timer graph,do_bench] [--rounds N]
                [--out DIR] [--require-bitwise] [--list-options]

Each ``--option`` names a field of :class:`flashgen.Options` by its dotted path
(``persistent``, ``hopper_fwd.col_bound``: fields of the nested per-family dataclasses) and
the values to try; the variants are every combination (``--combine product``, the default),
the i-th values of every option together (``--combine zip``, e.g. several switches all on
against all off), or the first values and then each option changed alone (``--combine
each``).  A value is parsed and checked by :meth:`flashgen.Options.replace_path`:
``0/1/true/false`` for a bool, an integer, one of a field's choices, ``none`` where the field
may be None.  The first variant is the baseline.

Per (spec, shape, direction) every variant's op (``flashgen.load(spec, options=...)``, built
once per spec) runs once on the same inputs with its outputs poisoned first: the outputs
(o, lse; dq, dk, dv when a backward runs) are compared with the baseline's, bitwise or as the
max |difference|, and the kernels each call launched are recorded (a variant that launched
the baseline's very kernels shows ``same kernels``: the option changes nothing there).  Each
variant is also checked against the float64 reference at a small shape (``--check-shape``)
with the tests' accuracy rule (:func:`flashgen.bench.verify.error_bound`).  Then the variants
and the ``--peers`` (:mod:`flashgen.bench.peers`) are timed in ``--rounds`` alternating rounds
(:func:`flashgen.bench.timing.alternate`) with each ``--timer``: ``graph`` (device time per
call from CUDA-graph replays, no host work, no L2 flush) and ``do_bench`` (the
``triton.testing.do_bench`` median, host time included, L2 flushed); each reports its median
over the rounds and its ratio to the baseline's (below 1: faster).

Shapes follow the benchmark protocol (:mod:`flashgen.bench.protocol`): ``S`` alone is
``batch = 16384 / S``, ``heads = 2048 / head_dim``; ``BxHxS`` and ``BxHQ/HKVxSQxSK`` give them.
TFLOP/s count the pairs the mask keeps (``2 * (D + Dv)`` FLOPs each forward, 2.5x that
backward).  A mask that reads tensors runs with a block table built once per variant.
Prints a table per problem and writes ``ab.json`` and ``ab.md`` into ``--out`` (rewritten after
every problem).  Exit status 0; 1 when a variant fails to build or run, fails the accuracy
rule, or (``--require-bitwise``) differs from the baseline; 2 without a CUDA GPU or for bad
arguments.  ``flashgen ab --list-options`` prints the option names, their values and defaults.
Write the SPECs before ``--peers`` (whose list is optional).  For example:

    flashgen ab document_mask --option persistent=none,static,dynamic --peers flex
    flashgen ab mistral_swa:window=256 chunked_local:chunk=1024 --shapes 1x16x16384 \
        --option sparse_persistent=none,dynamic --timer graph --rounds 7
    flashgen ab causal_d128 --option atomic_dq=0,1 --direction bwd,fwd_bwd --peers
    flashgen ab prefix_lm --option hopper_fwd.col_bound=1,0 --option side_terms=1,0 --combine zip
    flashgen ab t5_bias --param-grads --direction fwd_bwd --option hopper_bwd.dparam_diagonal=1 \
        --option hopper_bwd.dparam_const_tiles=0,1

``--param-grads`` trains the spec's f32 tensor params
(:func:`flashgen.bench.protocol.trained_params`): each variant's
backward computes their gradients too (``d<name>``, compared with the baseline's like dq, dk,
dv, and timed with them); without it the params are constants and a backward computes none.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from flashgen.bench import helptext
from flashgen.bench.options import (
    OptionError,
    combinations,
    list_options,
    parse_options,
    with_options,
)
from flashgen.bench.protocol import IMPLS, parse_spec_item, trained_params

#: Peers ``--peers`` takes without a list.
DEFAULT_PEERS = ("sdpa_flash", "sdpa_cudnn", "flex")
PEERS = tuple(i for i in IMPLS if i != "flashgen")
DIRECTIONS = ("fwd", "bwd", "fwd_bwd")
TIMERS = ("graph", "do_bench")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One problem size: ``batch``/``heads`` None = the protocol's for the spec's head dim."""

    seqlen_q: int
    seqlen_k: int
    batch: int | None = None
    heads: int | None = None
    heads_kv: int | None = None

    def resolve(self, head_dim: int) -> tuple[int, int, int, int, int]:
        """``(batch, heads, heads_kv, seqlen_q, seqlen_k)`` for a spec of ``head_dim``."""
        from flashgen.bench.protocol import problem

        b, h = problem(self.seqlen_q, head_dim)
        b = self.batch if self.batch is not None else b
        h = self.heads if self.heads is not None else h
        return b, h, self.heads_kv or h, self.seqlen_q, self.seqlen_k

    def text(self) -> str:
        if self.batch is None:
            return str(self.seqlen_q)
        hk = f"/{self.heads_kv}" if self.heads_kv and self.heads_kv != self.heads else ""
        sk = f"x{self.seqlen_k}" if self.seqlen_k != self.seqlen_q else ""
        return f"{self.batch}x{self.heads}{hk}x{self.seqlen_q}{sk}"


def parse_shape(text: str) -> Shape:
    """``S``, ``BxHxS`` or ``BxHxSQxSK``, ``H`` optionally ``HQ/HKV`` (GQA); positive ints,
    ``HQ`` a multiple of ``HKV``.  Raises ``argparse.ArgumentTypeError`` naming the text."""
    bad = argparse.ArgumentTypeError(
        f"expected S, BxHxS or BxHQ/HKVxSQxSK (positive integers), got {text!r}"
    )
    parts = text.strip().lower().split("x")
    try:
        if len(parts) == 1:
            s = int(parts[0])
            shape = Shape(s, s)
        elif len(parts) in (3, 4):
            hq, _, hkv = parts[1].partition("/")
            sq = int(parts[2])
            sk = int(parts[3]) if len(parts) == 4 else sq
            shape = Shape(sq, sk, int(parts[0]), int(hq), int(hkv) if hkv else None)
        else:
            raise bad
    except ValueError:
        raise bad from None
    sizes = [shape.seqlen_q, shape.seqlen_k, shape.batch or 1, shape.heads or 1]
    if min(sizes + [shape.heads_kv or 1]) < 1:
        raise bad
    if shape.heads_kv and shape.heads % shape.heads_kv:
        raise argparse.ArgumentTypeError(
            f"{text!r}: query heads {shape.heads} are not a multiple of kv heads {shape.heads_kv}"
        )
    return shape


def _choices(kind: str, allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"unknown {kind} {', '.join(bad) or repr(text)}; known: {', '.join(allowed)}"
            )
        return tuple(dict.fromkeys(items))

    return parse


def _deterministic(text: str) -> tuple[bool, ...]:
    """``0``, ``1``, ``0,1`` or ``1,0`` -> the ``deterministic=`` values to call the op with."""
    return tuple(v == "1" for v in _choices("deterministic value", ("0", "1"))(text))


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse


#: ``flashgen ab --help``'s description
DESCRIPTION = """\
Run a spec's op under each combination of option values (--option NAME=A,B: a dotted field
of flashgen.Options and the values to try), compare every variant's outputs with the first
one's and with the float64 reference, and time them side by side in alternating rounds.
Needs a CUDA GPU (exit 2 without one)."""


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``flashgen ab`` on the ``argparse`` subparsers ``sub``."""
    ab = sub.add_parser(
        "ab",
        help="A/B: a spec's op under option values, timed in alternating rounds (GPU)",
        description=DESCRIPTION,
        formatter_class=helptext.HelpFormatter,
    )
    ab.add_argument(
        "specs",
        nargs="*",
        metavar="SPEC",
        help="spec file or shipped spec name, optionally :param=value,... (scalar params)",
    )
    ab.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=A,B",
        help="a flashgen.Options field (dotted path) and the values to try (repeatable)",
    )
    ab.add_argument(
        "--combine",
        choices=("product", "zip", "each"),
        default="product",
        help="variants: every combination (default), the i-th values together, or each "
        "option changed alone from the first values",
    )
    ab.add_argument(
        "--peers",
        nargs="?",
        const=DEFAULT_PEERS,
        default=(),
        type=_choices("peer", PEERS),
        help=f"also time these (default list: {','.join(DEFAULT_PEERS)}; known: {','.join(PEERS)})",
    )
    ab.add_argument(
        "--shapes",
        nargs="+",
        type=parse_shape,
        default=[Shape(8192, 8192)],
        metavar="SHAPE",
        help="S (batch 16384/S, heads 2048/head_dim), BxHxS or BxHQ/HKVxSQxSK (default 8192)",
    )
    ab.add_argument(
        "--direction",
        type=_choices("direction", DIRECTIONS),
        default=("fwd",),
        help="fwd, bwd (the backward alone), fwd_bwd; comma-separated (default fwd)",
    )
    ab.add_argument(
        "--timer",
        type=_choices("timer", TIMERS),
        default=TIMERS,
        help="graph (CUDA-graph device time), do_bench (host time included); default both",
    )
    ab.add_argument(
        "--rounds",
        type=_int_at_least(0),
        default=5,
        help="alternating rounds (median; default 5); 0: run each variant once, no timing "
        "(a target for ncu)",
    )
    ab.add_argument("--warmup-ms", type=_int_at_least(0), default=25, help="do_bench warm-up")
    ab.add_argument("--rep-ms", type=_int_at_least(1), default=100, help="do_bench window")
    ab.add_argument("--graph-calls", type=_int_at_least(1), default=10, help="calls per graph")
    ab.add_argument("--replays", type=_int_at_least(1), default=5, help="graph replays/round")
    ab.add_argument(
        "--deterministic",
        type=_deterministic,
        default=None,
        metavar="0,1",
        help="pass deterministic= to the op's calls; two values time each variant with "
        "both (default: the op's own)",
    )
    ab.add_argument(
        "--check-shape",
        type=parse_shape,
        default=Shape(777, 1037, 1, 4, 2),
        metavar="SHAPE",
        help="shape of the check against the float64 reference (default 1x4/2x777x1037)",
    )
    ab.add_argument("--no-check", action="store_true", help="skip the reference check")
    ab.add_argument(
        "--param-grads",
        action="store_true",
        help="the backward also computes the gradients of the spec's trainable tensor params "
        "(f32 tensors the score_mod reads: t5_bias's table), compared and timed with dq, dk, "
        "dv (a backward direction; no --peers)",
    )
    ab.add_argument(
        "--require-bitwise",
        action="store_true",
        help="exit 1 when a variant's outputs are not bitwise the baseline's",
    )
    ab.add_argument("--out", default="ab-results", help="where ab.json and ab.md go")
    ab.add_argument(
        "--list-options", action="store_true", help="print flashgen.Options' fields and exit"
    )
    ab.set_defaults(func=cmd_ab)
    return ab


def resolve_spec(item: str) -> tuple[Path, dict]:
    """``SPEC[:p=v,...]`` -> (spec file, scalar param overrides).  ``SPEC`` is a file or the
    name of a shipped spec (:func:`~flashgen.frontend.shipped.resolve_spec_path`).  Raises
    :class:`OptionError`."""
    from flashgen.frontend.shipped import resolve_spec_path

    if Path(item).is_file():
        return Path(item), {}
    name, over = _spec_item(item)
    try:
        return resolve_spec_path(name), over
    except FileNotFoundError as e:
        raise OptionError(f"spec {name!r}: {e.strerror}") from None


def _spec_item(item: str) -> tuple[str, dict]:
    try:
        return parse_spec_item(item)
    except ValueError:
        raise OptionError(
            f"spec {item!r}: expected SPEC or SPEC:param=value,... with numeric values"
        ) from None


def check_args(args) -> tuple[type | None, dict[str, list], list[dict], list[tuple]]:
    """The options class (:class:`flashgen.Options`; None without ``--option``), the parsed
    options, the variants and the specs as ``(item, file, scalar param overrides)``; raises
    :class:`OptionError` for any bad argument (before anything touches a GPU)."""
    from flashgen.options import Options

    cls = Options if args.option else None
    values = parse_options(args.option or ())
    variants = combinations(values, args.combine)
    if cls is not None:
        for assign in variants:
            with_options(cls(), assign)  # the options' own checks, per combination
    specs = []
    if not args.list_options:
        if not args.specs:
            raise OptionError("give at least one SPEC")
        specs = [(item, *resolve_spec(item)) for item in args.specs]
        for item, path, over in specs:
            _check_params(item, path, over, getattr(args, "param_grads", False))
        if getattr(args, "param_grads", False):
            if args.peers:
                raise OptionError("--param-grads: the peers compute no param gradients; drop "
                                  "--peers")  # fmt: skip
            if set(args.direction) == {"fwd"}:
                raise OptionError("--param-grads needs a backward: --direction bwd or fwd_bwd")
    return cls, values, variants, specs



def _check_params(item: str, path: Path, over: dict, param_grads: bool = False) -> None:
    """The spec at ``path`` parses and has every scalar param ``over`` sets (and, with
    ``param_grads``, a tensor param to train: :func:`trained_params`)."""
    from flashgen.frontend.errors import SpecError
    from flashgen.frontend.spec import load_spec

    try:
        spec = load_spec(path)
    except SpecError as e:
        raise OptionError(str(e)) from None
    known = [p.name for p in spec.scalar_params]
    unknown = sorted(set(over) - set(known))
    if unknown:
        raise OptionError(
            f"spec {item!r}: {spec.name} has no scalar param {', '.join(unknown)} "
            f"(its scalar params: {', '.join(known) or 'none'})"
        )
    if param_grads and not trained_params(spec):
        raise OptionError(
            f"spec {item!r}: --param-grads: {spec.name} has no f32 tensor param the score_mod "
            "differentiates"
        )


def cmd_ab(args) -> int:
    """``flashgen ab``: check the arguments, then (on a GPU) :func:`flashgen.bench.abrun.run`.
    Returns the exit status (2 for a bad argument, :data:`~flashgen.bench.verify.NO_GPU_EXIT`
    without a GPU)."""
    import sys

    from flashgen.bench.verify import NO_GPU_EXIT, require_cuda

    try:
        cls, values, variants, specs = check_args(args)
    except OptionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.list_options:
        print(list_options())
        return 0
    problem = require_cuda("ab")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return NO_GPU_EXIT
    from flashgen.bench.abrun import run

    return run(args, cls, values, variants, specs)
