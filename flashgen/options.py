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
import re
import types
import typing
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
    (``hopper_fwd.exp2_poly`` above 0 with ``exact_softmax``, whose exp2s stay on the SFU).
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
        if self.exact_softmax and self.hopper_fwd.exp2_poly:  # fields that exclude each other
            raise ValueError(
                f"Options.hopper_fwd.exp2_poly={self.hopper_fwd.exp2_poly!r} with "
                "Options.exact_softmax=True: expected exp2_poly 0 with the exact softmax (its "
                "exp2s stay on the SFU; the polynomial would be dropped): set one of them"
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
        ``flashgen ab --list-options``), e.g. ``"one of auto, fa3, fa2"``, ``"bool"``,
        ``"int, or none"``.  ``KeyError`` for an unknown name."""
        if path not in cls.paths():
            raise KeyError(f"unknown option {path!r}; known: {', '.join(cls.paths())}")
        if path in _CHOICES:
            return "one of " + ", ".join(_CHOICES[path])
        head, _, rest = path.partition(".")
        hint = _field_type(FAMILY_OPTIONS[head], rest) if rest else _field_type(cls, head)
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        names = [a.__name__ for a in args if a is not type(None)]
        text = " or ".join("bool (true, false, 1, 0)" if n == "bool" else n for n in names)
        return text + (", or none" if type(None) in args else "")

    def get_path(self, path: str):
        """The value of dotted name ``path``; :class:`UnknownOptionError` (a ``KeyError``)
        naming it, the closest name and every known one otherwise (a deleted option,
        :data:`REMOVED_OPTIONS`: that it was removed, and why)."""
        head, _, rest = path.partition(".")
        if path in REMOVED_OPTIONS:
            raise UnknownOptionError(removed_option_message(path))
        if path not in _paths():
            raise UnknownOptionError(
                f"unknown option {path!r}{did_you_mean(path, _paths())}; known: "
                f"{', '.join(self.paths())}"
            )
        return getattr(getattr(self, head), rest) if rest else getattr(self, head)

    def replace_path(self, path: str, value) -> Options:
        """A copy with dotted name ``path`` set to ``value``; a ``str`` value is parsed for
        the field's type (``true/false/1/0/yes/no/on/off`` for bools, ``none`` for an
        optional one, digits for ints).  :class:`UnknownOptionError` (a ``KeyError``) for an
        unknown name, ``ValueError`` for a value the field does not take."""
        self.get_path(path)  # validates the name
        head, _, rest = path.partition(".")
        try:
            if rest:
                sub = getattr(self, head)
                hint = _field_type(type(sub), rest)
                sub = dataclasses.replace(sub, **{rest: _parse(path, value, hint)})
                return dataclasses.replace(self, **{head: sub})
            hint = _field_type(Options, head)
            return dataclasses.replace(self, **{head: _parse(path, value, hint)})
        except ValueError as e:  # the record's own check: say which dotted option it was
            if f"option {path}=" in str(e) or f"Options.{path}=" in str(e):
                raise
            raise ValueError(f"option {path}={value!r}: {e}") from None

    def with_values(self, assignments: dict[str, object]) -> Options:
        """:meth:`replace_path` for each ``{dotted name: value}``, in order."""
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
        shape its kernels (what a plan of that family records as ``options_key``)."""
        keep = {
            "fa2_fwd": ("fa2_fwd.", "side_terms", "exact_softmax"),
            "hopper_fwd": ("hopper_fwd.", "side_terms", "exact_softmax"),
            "fa2_bwd": ("fa2_bwd.", "side_terms", "exact_softmax"),
            "hopper_bwd": ("hopper_bwd.", "exact_softmax"),
            "blocktable": ("blocktable.",),
            "decode": ("decode.", "exact_softmax"),
        }[name]
        return ";".join(
            f"{p}={v!r}" for p, v in self.changed().items() if p.startswith(keep)
        )


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


#: The dotted names whose values are one of a few strings, with those strings.
_CHOICES = {
    "family": FAMILIES,
    "persistent": PERSISTENT_CHOICES,
    "sparse_persistent": PERSISTENT_CHOICES[1:],
    "hopper_fwd.fp8_transpose": hopper_fwd.FP8_TRANSPOSES,
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


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _parse(path: str, value, hint):
    """``value`` for a field of type ``hint`` (``value`` as is unless a ``str``)."""
    if not isinstance(value, str):
        return value
    v = value.strip()
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if type(None) in args and v.lower() in ("none", ""):
        return None
    if bool in args:
        if v.lower() in _TRUE:
            return True
        if v.lower() in _FALSE:
            return False
        raise ValueError(f"option {path}={value!r}: expected one of {', '.join(_TRUE + _FALSE)}")
    if int in args:  # a sign too: the field's own check says its range (-3 is no typo)
        if not re.fullmatch(r"[+-]?[0-9]+", v):
            raise ValueError(f"option {path}={value!r}: expected an integer")
        return int(v)
    if float in args:
        try:
            return float(v)
        except ValueError:
            raise ValueError(f"option {path}={value!r}: expected a number") from None
    return v
