"""Plan helpers for tests: the planning calls with keyword knobs (``affine=False``,
``family="fa2"``, a dict of FA2-class template switches) built into
:class:`flashgen.options.Options` and passed to :mod:`flashgen.families.registry`.  Library
code and tools call the registry with ``Options`` directly; these keep the many tests that
turn one feature off short.  ``persistent`` defaults to False (no persistent scheduler), not
to the route's."""

from __future__ import annotations

from dataclasses import replace

from flashgen.codegen.plan import KernelPlan, TileConfig
from flashgen.families import registry
from flashgen.families.build import _forward_variant
from flashgen.families.fa2_bwd import BACKWARD_OPTIONS
from flashgen.families.fa2_fwd import FORWARD_OPTIONS
from flashgen.options import DEFAULT, Options


def _opts(
    family: str = "auto", fwd_switches: dict | None = None, values: dict | None = None, **knobs
) -> Options:
    """Options for the keyword knobs (False turns a feature off); ``values``: more options
    by dotted name (:meth:`flashgen.options.Options.with_values`)."""
    o = replace(DEFAULT, family=family).with_values(values or {})
    if fwd_switches:
        unknown = sorted(set(fwd_switches) - set(FORWARD_OPTIONS))
        if unknown:
            raise ValueError(
                f"unknown forward option {unknown[0]!r}; known: {', '.join(FORWARD_OPTIONS)}"
            )
        o = replace(o, fa2_fwd=replace(o.fa2_fwd, **{k: bool(v) for k, v in fwd_switches.items()}))
    return _forward_variant(
        o, knobs.get("affine", True), knobs.get("mask_tiles", True),
        knobs.get("head_groups", True), knobs.get("warp_walk", True),
    )  # fmt: skip


def plan_forward(
    spec, target, gpu=None, tiles=None, options=None, family="auto", persistent=False,
    side_terms=True, affine=True, mask_tiles=True, head_groups=True, warp_walk=True,
    values=None,
) -> KernelPlan:  # fmt: skip
    """Keyword form of :func:`flashgen.families.registry.plan_forward` (``options``: a dict of
    FA2-class template switches; ``values``: options by dotted name, e.g.
    ``{"hopper_fwd.col_bound": False}``)."""
    o = _opts(family, options, values, affine=affine, mask_tiles=mask_tiles,
              head_groups=head_groups, warp_walk=warp_walk)  # fmt: skip
    return registry.plan_forward(
        spec, target, o, gpu=gpu, tiles=tiles, persistent=persistent, side_terms=side_terms
    )


def plan_hopper_forward(spec, target, tiles, *, persistent=False, side_terms=True, **knobs):
    """Keyword form of :func:`flashgen.families.hopper_fwd.plan` (knobs: its Options fields,
    ``stages``, ``m_major``)."""
    from flashgen.families import hopper_fwd

    extra = {k: knobs.pop(k) for k in ("stages", "m_major") if k in knobs}
    return hopper_fwd.plan(
        spec, target, hopper_fwd.Options(**knobs), tiles=tiles, persistent=persistent,
        side_terms=side_terms, **extra,
    )  # fmt: skip


def plan_backward(spec, target, *, atomic_dq=False, tiles=None, options=None, side_terms=True):
    """Keyword form of :func:`flashgen.families.registry.plan_backward` (``options``: a dict
    of FA2-class backward template switches)."""
    from flashgen.families import fa2_bwd

    o = DEFAULT
    if options:
        unknown = sorted(set(options) - set(BACKWARD_OPTIONS))
        if unknown:
            raise ValueError(
                f"unknown backward option {unknown[0]!r}; known: {', '.join(BACKWARD_OPTIONS)}"
            )
        o = replace(o, fa2_bwd=fa2_bwd.Options(**{k: bool(v) for k, v in options.items()}))
    return registry.plan_backward(
        spec, target, o, atomic_dq=atomic_dq, tiles=tiles, side_terms=side_terms
    )


def plan_hopper_backward(spec, target):
    """:func:`flashgen.families.registry.plan_hopper_backward` with the default options."""
    return registry.plan_hopper_backward(spec, target, DEFAULT)


def choose_tiles(spec, target, gpu=None, family="auto") -> TileConfig:
    """Keyword form of :func:`flashgen.families.registry.choose_tiles`."""
    return registry.choose_tiles(spec, target, gpu, replace(DEFAULT, family=family))


def forward_tile_candidates(spec, target, gpu=None, family="auto") -> list[TileConfig]:
    """Keyword form of :func:`flashgen.families.registry.forward_tile_candidates`."""
    return registry.forward_tile_candidates(spec, target, gpu, replace(DEFAULT, family=family))
