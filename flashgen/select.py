"""Compatibility name: the spill-fallback builds live in :mod:`flashgen.families.build`."""

from flashgen.families.build import build_backward, build_forward  # noqa: F401
