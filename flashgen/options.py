"""Kernel options: the data that picks which kernels an op runs, in place of the
environment switches of earlier versions (:data:`flashgen.env.REMOVED` maps each to its
option; a removed switch that is still set raises).

:class:`Options` bundles the routing choices (kernel family, atomic dQ, the persistent
schedulers, sparse-call tiles, row / column terms, persistent CTAs), the exact softmax (a
code-generation choice of every family but the block-table pre-pass) and one frozen options
record per kernel family (``fa2_fwd``, ``hopper_fwd``, ``fa2_bwd``, ``hopper_bwd``,
``blocktable``, ``decode``).  Every field has a dotted name (``"hopper_fwd.affine"``, ``"family"``):
:meth:`Options.paths` lists them, :meth:`Options.get_path` reads one and
:meth:`Options.replace_path` returns a copy with one set (from a value or its string form,
as ``flashgen ab SPEC --option hopper_fwd.affine=true,false`` passes it).  :meth:`Options.key`
is a stable string of the non-default fields: part of the op's kernel key and of the kernel
cache key.  Pure Python.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field

from flashgen.families import blocktable, decode, fa2_bwd, fa2_fwd, hopper_bwd, hopper_fwd
from flashgen.families.common import FAMILIES, PERSISTENT_SCHEDULERS
from flashgen.families.fields import check_fields
from flashgen.frontend.errors import did_you_mean


class UnknownOptionError(KeyError):
    """An option name :class:`Options` does not have (:meth:`Options.get_path`,
    :meth:`Options.replace_path`, ``--option NAME=VALUE``).  A ``KeyError`` whose ``str`` is
    its message: a plain KeyError's is the repr of its argument, quotes and all."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


#: Options that were deleted, by dotted name: why, in a few words.  Setting or reading one
#: raises :class:`UnknownOptionError` saying so (a near miss would name an unrelated option).
REMOVED_OPTIONS = {
    "hopper_bwd.d64_pt_other_buffer": "head_dim 64 with 128-query steps keeps P^T in "
    "registers now, not in a dS^T buffer",
    "hopper_bwd.d256_ps_buffers": "its value 2 failed to launch (shared memory over the "
    "limit); two P^T / dS^T buffers with room (d256_ps_double) lost to d256_sdp_warpgroups",
    "hopper_bwd.d256_ps_double": "two P^T / dS^T buffers at head_dim 256 gained under 1% "
    "beside d256_sdp_warpgroups (on by default), for 16 KiB of shared memory",
    "hopper_bwd.ds_waits_dv": "dS^T reads the packed P^T while dV runs; waiting for dV "
    "first was slower",
    "hopper_bwd.d256_dq_frag": "head_dim 256 always adds dQ in the accumulator's fragment "
    "order (16-byte reductions into 64-row tiles of dq_accum)",
    "hopper_fwd.exp2_fma_every": "hopper_fwd.exp2_poly sets the share of P on the FMA pipe, "
    "in sixteenths of each row's tiles (every N-th tile put 1/N at best)",
    "hopper_bwd.desc_offsets": "the Hopper backward always builds its wgmma descriptors as "
    "base + offset, takes a warp-uniform warpgroup index, loads dsum in pairs and "
    "stores P^T and dS^T by stmatrix",
    "decode.mla_wgmma": "replaced by decode.mla_unit: mma_sync is what false was, wgmma what "
    "true was; mma_sync is the default, auto (opt-in) picks MLA's unit per call shape",
}


def removed_option_message(path: str) -> str | None:
    """The error text for a deleted option ``path`` (:data:`REMOVED_OPTIONS`), else None."""
    why = REMOVED_OPTIONS.get(path)
    return None if why is None else f"option {path!r} was removed ({why}): drop it"


#: Values of :attr:`Options.persistent` (``auto``: ``dynamic`` for a mask that reads tensors,
#: else ``off``) and of :attr:`Options.sparse_persistent`.
PERSISTENT_CHOICES = ("auto", "off", *PERSISTENT_SCHEDULERS)
#: The per-family option records, by field name of :class:`Options`.
FAMILY_OPTIONS = {
    "fa2_fwd": fa2_fwd.Options,
    "hopper_fwd": hopper_fwd.Options,
    "fa2_bwd": fa2_bwd.Options,
    "hopper_bwd": hopper_bwd.Options,
    "blocktable": blocktable.Options,
    "decode": decode.Options,
}


@dataclass(frozen=True)
class Options:
    """Which kernels an op runs and how they are generated (frozen; compare and hash by value).

    - ``family``: ``"auto"`` / ``"fa3"`` (the Hopper kernels on sm_90 where they apply) or
      ``"fa2"`` (always the FA2-class kernels).
    - ``atomic_dq``: the backward of ``deterministic=False`` calls.  ``None`` (default): the
      Hopper backward where it applies, else the deterministic kernels; ``True``: also the
      FA2-class atomic-dQ kernels elsewhere; ``False``: never atomic (the deterministic
      kernels for every call).  ``deterministic=True`` on a call always runs the
      deterministic kernels.
    - ``persistent``: the Hopper forward's persistent scheduler (:data:`PERSISTENT_CHOICES`;
      ``auto``: ``dynamic`` for masks that read tensors, else ``off``).
    - ``sparse_persistent``: the scheduler of the kernel for calls that keep few keys per row
      (``off`` or a scheduler; default ``dynamic``).
    - ``sparse_tiles``: such calls may run the narrower sparse tiles.
    - ``side_terms``: kernels may read a mask's one-sided tensor reads once per row / column
      (False: per element).
    - ``persistent_ctas``: CTAs of a persistent launch (None: the SM count; a debugging knob).
    - ``exact_softmax``: the softmax of the forward, backward and decode kernels stays finite
      at huge finite logits (1e11: an ulp of the row max is 2^14 there): the forwards compute
      P's exponent from scores rounded as the row max was (P <= 1, the max's P exactly 1),
      the backwards cap P's exponent at 0, decode's split merge normalizes its weights by
      their sum (docs/reliability.md).  Off by default.
    - ``fa2_fwd``, ``hopper_fwd``, ``fa2_bwd``, ``hopper_bwd``, ``blocktable``, ``decode``:
      each family's ``Options`` (see its module; ``decode``: the tiles and split count of
      ``op.with_kvcache``, and ``fused_sink``: a spec's attention sink joined inside its
      kernels).

    Every field has its declared type (:func:`flashgen.families.fields.check_fields`: a
    bool is ``True`` / ``False``, an int is no float and no bool); raises ``ValueError``
    naming the dotted field (``Options.decode.stages``) for a value of another type or
    outside its choices or range, and for fields that exclude each other
    (``hopper_fwd.exp2_poly`` or ``hopper_bwd.exp2_poly`` above 0 with ``exact_softmax``, whose
    exp2s stay on the SFU).
    """

    family: str = "auto"
    atomic_dq: bool | None = None
    persistent: str = "auto"
    sparse_persistent: str = "dynamic"
    sparse_tiles: bool = True
    side_terms: bool = True
    persistent_ctas: int | None = None
    exact_softmax: bool = False
    fa2_fwd: fa2_fwd.Options = field(default_factory=fa2_fwd.Options)
    hopper_fwd: hopper_fwd.Options = field(default_factory=hopper_fwd.Options)
    fa2_bwd: fa2_bwd.Options = field(default_factory=fa2_bwd.Options)
    hopper_bwd: hopper_bwd.Options = field(default_factory=hopper_bwd.Options)
    blocktable: blocktable.Options = field(default_factory=blocktable.Options)
    decode: decode.Options = field(default_factory=decode.Options)

    def __post_init__(self) -> None:
        for name, cls in FAMILY_OPTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"Options.{name}: expected a {cls.__module__}.Options")
        check_fields(self, "Options")
        for name in FAMILY_OPTIONS:  # the records check themselves; hopper_bwd's is checked here
            check_fields(getattr(self, name), f"Options.{name}")
        if self.family not in FAMILIES:
            raise ValueError(f"Options.family={self.family!r}: expected one of {FAMILIES}")
        if self.persistent not in PERSISTENT_CHOICES:
            raise ValueError(
                f"Options.persistent={self.persistent!r}: expected one of {PERSISTENT_CHOICES}"
            )
        if self.sparse_persistent not in PERSISTENT_CHOICES[1:]:
            raise ValueError(
                f"Options.sparse_persistent={self.sparse_persistent!r}: expected one of "
                f"{PERSISTENT_CHOICES[1:]}"
            )
        for fam in ("hopper_fwd", "hopper_bwd"):  # fields that exclude each other
            poly = getattr(self, fam).exp2_poly
            if self.exact_softmax and poly:
                raise ValueError(
                    f"Options.{fam}.exp2_poly={poly!r} with Options.exact_softmax=True: expected "
                    "exp2_poly 0 with the exact softmax (its exp2s stay on the SFU; the "
                    "polynomial would be dropped): set one of them"
                )
        if self.persistent_ctas is not None and (
            not isinstance(self.persistent_ctas, int) or self.persistent_ctas < 1
        ):
            raise ValueError(
                f"Options.persistent_ctas={self.persistent_ctas!r}: expected an int >= 1 or None"
            )

    # ------------------------------------------------------------------ dotted names
    @classmethod
    def paths(cls) -> list[str]:
        """Every settable dotted name, e.g. ``["family", ..., "hopper_fwd.affine", ...]``."""
        return list(_paths())

    @classmethod
    def describe(cls, path: str) -> str:
        """How the values of dotted name ``path`` are written (for ``--option`` help and
        ``flashgen ab --list-options``), e.g. ``"one of auto, fa3, fa2"``, ``"bool (true,
        false, 1, 0)"``, ``"int in 2..8, or none"`` (an int's range or values:
        :data:`VALUE_RANGES`).  :class:`UnknownOptionError` (a ``KeyError``) for an unknown
        name (a deleted one: that it was removed, and why)."""
        _check_path(path)
        if path in _CHOICES:
            return "one of " + ", ".join(_CHOICES[path])
        args = _hint_args(path)
        rng = VALUE_RANGES.get(path)
        names = []
        for a in args:
            if a is bool:
                names.append("bool (true, false, 1, 0)")
            elif a in (int, float) and rng is not None:
                names.append(_range_text(a, rng))
            elif a is float:
                names.append("number")
            elif a is not type(None):
                names.append(a.__name__)
        return " or ".join(names) + (", or none" if type(None) in args else "")

    def get_path(self, path: str):
        """The value of dotted name ``path``; :class:`UnknownOptionError` (a ``KeyError``)
        naming it, the closest name and every known one otherwise (a deleted option,
        :data:`REMOVED_OPTIONS`: that it was removed, and why)."""
        _check_path(path)
        head, _, rest = path.partition(".")
        return getattr(getattr(self, head), rest) if rest else getattr(self, head)

    def replace_path(self, path: str, value) -> Options:
        """A copy with dotted name ``path`` set to ``value``: a value of the field's type (a
        bool is ``True`` / ``False``), or its string form as ``--option`` passes it (bools
        ``true`` / ``false`` / ``1`` / ``0``, any case; ``none`` for an optional field; ints
        as digits with an optional sign; what :meth:`describe` says).
        :class:`UnknownOptionError` (a ``KeyError``) for an unknown name; ``ValueError`` for
        a value the field does not take, led by the option and what it takes
        (``decode.stages: expected an int in 2..8, got 9``)."""
        self.get_path(path)  # validates the name
        head, _, rest = path.partition(".")
        parsed = _parse(path, value)
        why = _out_of_range(path, parsed)
        if why is not None:
            raise ValueError(why)
        try:
            if rest:
                sub = dataclasses.replace(getattr(self, head), **{rest: parsed})
                return dataclasses.replace(self, **{head: sub})
            return dataclasses.replace(self, **{head: parsed})
        except ValueError as e:  # the record's own check: say which dotted option it was
            if f"option {path}=" in str(e) or f"Options.{path}=" in str(e):
                raise
            raise ValueError(f"option {path}={value!r}: {e}") from None

    def with_values(self, assignments: Mapping[str, object]) -> Options:
        """:meth:`replace_path` for each ``{dotted name: value}`` of the mapping
        ``assignments``, in order; ``TypeError`` for anything but a mapping."""
        if not isinstance(assignments, Mapping):
            raise TypeError(
                f"assignments: expected a mapping {{dotted name: value}}, e.g. "
                f"{{'decode.stages': 4}}, got {type(assignments).__name__}"
            )
        out = self
        for path, value in assignments.items():
            out = out.replace_path(path, value)
        return out

    def changed(self) -> dict[str, object]:
        """``{dotted name: value}`` of the fields that differ from the defaults."""
        items = self.__dict__.get("_changed")
        if items is None:  # once per instance (the options are frozen; a cache beside them)
            default = Options()
            values = {p: self.get_path(p) for p in _paths()}
            items = tuple((p, v) for p, v in values.items() if v != default.get_path(p))
            object.__setattr__(self, "_changed", items)
        return dict(items)

    def __getstate__(self) -> dict:
        """The fields, without :meth:`changed`'s cache: a copy or an unpickled instance
        computes its own (against the defaults where it is used), and a pickle's bytes do
        not depend on whether :meth:`key` was asked."""
        state = dict(self.__dict__)
        state.pop("_changed", None)
        return state

    def key(self) -> str:
        """A stable string of the non-default fields, ``"name=value;..."`` in field order
        (``""`` for the defaults): part of kernel keys and of the kernel cache key (an op's
        every call asks for it: :meth:`changed` is computed once per instance)."""
        return ";".join(f"{p}={v!r}" for p, v in self.changed().items())

    def family_key(self, name: str) -> str:
        """:meth:`key` restricted to family ``name``'s options and the routing fields that
        shape its kernels (what a plan of that family records as ``options_key``).
        ``decode.mla_unit`` is in it only as ``'wgmma'``: ``auto`` (without a call's shape)
        and ``mma_sync`` plan the default options' mma.sync unit, whose cached kernels they
        share (a call's ``auto`` is resolved to the unit it runs before its unit is planned:
        :func:`flashgen.families.decode.mla_unit_for_call`)."""
        keep = {
            "fa2_fwd": ("fa2_fwd.", "side_terms", "exact_softmax"),
            "hopper_fwd": ("hopper_fwd.", "side_terms", "exact_softmax"),
            "fa2_bwd": ("fa2_bwd.", "side_terms", "exact_softmax"),
            "hopper_bwd": ("hopper_bwd.", "exact_softmax"),
            "blocktable": ("blocktable.",),
            "decode": ("decode.", "exact_softmax"),
        }[name]
        return ";".join(
            f"{p}={v!r}" for p, v in self.changed().items()
            if p.startswith(keep) and (p != "decode.mla_unit" or v == "wgmma")
        )  # fmt: skip


DEFAULT = Options()


def check_options(options) -> Options:
    """``options`` if it is an :class:`Options`, else ``TypeError`` naming the argument, what
    it takes and the type received (a ``{dotted name: value}`` dict goes through
    :meth:`Options.with_values`)."""
    if not isinstance(options, Options):
        raise TypeError(
            f"options: expected a flashgen.Options (Options().with_values({{name: value}}) "
            f"for dotted names), got {type(options).__name__}"
        )
    return options


#: The int and float fields' values, by dotted name: ``("range", low, high)`` (high None: no
#: bound), ``("choices", values)`` or ``("multiple", m)`` (positive multiples of m).
#: :meth:`Options.describe` shows them, :meth:`Options.replace_path` refuses a value outside
#: them by them; the records' own checks (the Python API's) agree (tests/unit/test_options.py).
VALUE_RANGES = {
    "persistent_ctas": ("range", 1, None),
    "hopper_fwd.exp2_poly": ("range", 0, hopper_fwd.EXP2_POLY_SIXTEENTHS),
    "hopper_bwd.d64_block_m": ("choices", hopper_bwd.D64_BLOCK_MS),
    "hopper_bwd.d128_block_m": ("choices", hopper_bwd.D128_BLOCK_MS),
    "hopper_bwd.exp2_poly": ("range", 0, hopper_bwd.EXP2_POLY_SIXTEENTHS),
    "decode.block_n": ("multiple", 16 * decode.NUM_WARPS),
    "decode.stages": ("range", 2, decode.MAX_STAGES),
    "decode.num_splits": ("range", 1, decode.MAX_SPLITS),
    "decode.ctas_per_sm": ("range", 1, 4),
    "decode.split_waves": ("range", 0.25, 4),
    "decode.min_split_blocks": ("range", 1, 16),
    "decode.merge_unroll": ("choices", decode.MERGE_UNROLLS),
}

#: The dotted names whose values are one of a few strings, with those strings.
_CHOICES = {
    "family": FAMILIES,
    "persistent": PERSISTENT_CHOICES,
    "sparse_persistent": PERSISTENT_CHOICES[1:],
    "hopper_fwd.fp8_transpose": hopper_fwd.FP8_TRANSPOSES,
    "decode.mla_unit": decode.MLA_UNITS,
}


@functools.cache
def _paths() -> tuple[str, ...]:
    """:meth:`Options.paths`, computed once (the fields are fixed)."""
    out: list[str] = []
    for f in dataclasses.fields(Options):
        if f.name in FAMILY_OPTIONS:
            out += [f"{f.name}.{g.name}" for g in dataclasses.fields(FAMILY_OPTIONS[f.name])]
        else:
            out.append(f.name)
    return tuple(out)


def _field_type(cls, name: str):
    return typing.get_type_hints(cls, vars(__import__(cls.__module__, fromlist=["_"])))[name]


#: The string forms of a bool option (any case): ``--option``'s, and what
#: :meth:`Options.describe` lists.  The Python API takes ``True`` / ``False`` only.
_TRUE = ("true", "1")
_FALSE = ("false", "0")


def _check_path(path: str) -> None:
    """:class:`UnknownOptionError` for a dotted name :class:`Options` does not have (a
    deleted one: that it was removed, and why; else the closest name and every known one)."""
    if path in REMOVED_OPTIONS:
        raise UnknownOptionError(removed_option_message(path))
    if path not in _paths():
        raise UnknownOptionError(
            f"unknown option {path!r}{did_you_mean(path, _paths())}; known: "
            f"{', '.join(_paths())}"
        )


def _hint_args(path: str) -> tuple:
    """The types a dotted field takes (``(int, NoneType)`` for ``int | None``)."""
    head, _, rest = path.partition(".")
    hint = _field_type(FAMILY_OPTIONS[head], rest) if rest else _field_type(Options, head)
    return typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)


def _range_text(kind, rng) -> str:
    """``int in 2..8``, ``int >= 1``, ``one of 4, 8, 16``, ``int, a positive multiple of
    64``."""
    word = "int" if kind is int else "number"
    if rng[0] == "range":
        lo, hi = rng[1], rng[2]
        return f"{word} >= {lo}" if hi is None else f"{word} in {lo}..{hi}"
    if rng[0] == "choices":
        return "one of " + ", ".join(map(str, rng[1]))
    return f"{word}, a positive multiple of {rng[1]}"


def _article(text: str) -> str:
    if text.startswith("one of"):
        return text
    return ("an " if text[0] in "aeiou" else "a ") + text


def _out_of_range(path: str, value) -> str | None:
    """Why an int or float ``value`` (of the field's type) is outside dotted field ``path``'s
    :data:`VALUE_RANGES`, e.g. ``decode.stages: expected an int in 2..8, got 9``; None if it
    is inside, has no range or is not a number."""
    rng = VALUE_RANGES.get(path)
    if rng is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    kind = int if int in _hint_args(path) else float
    if kind is int and not isinstance(value, int):
        return None  # the type check names it
    if rng[0] == "range":
        ok = value >= rng[1] and (rng[2] is None or value <= rng[2])
    elif rng[0] == "choices":
        ok = value in rng[1]
    else:
        ok = value >= rng[1] and value % rng[1] == 0
    return None if ok else f"{path}: expected {_article(_range_text(kind, rng))}, got {value}"


def _parse(path: str, value):
    """``value`` for dotted field ``path`` (``value`` as is unless a ``str``); ``ValueError``
    ``"PATH: expected WHAT, got 'TEXT'"`` for a string the field's type does not read."""
    if not isinstance(value, str):
        return value
    v = value.strip()
    args = _hint_args(path)

    def bad():
        return ValueError(f"{path}: expected {_article(Options.describe(path))}, got {value!r}")

    if type(None) in args and v.lower() == "none":
        return None
    if path in _CHOICES:
        if v not in _CHOICES[path]:
            raise bad()
        return v
    if bool in args:
        if v.lower() in _TRUE:
            return True
        if v.lower() in _FALSE:
            return False
        raise bad()
    if int in args:  # a sign too: the range check says why -3 is refused (it is no typo)
        if not re.fullmatch(r"[+-]?[0-9]+", v):
            raise bad()
        return int(v)
    if float in args:
        try:
            number = float(v)
        except ValueError:
            raise bad() from None
        if not math.isfinite(number):
            raise bad()
        return number
    return v
