"""Kernel families, one module each (:mod:`.fa2_fwd`, :mod:`.hopper_fwd`, :mod:`.fa2_bwd`,
:mod:`.hopper_bwd`, :mod:`.blocktable`, :mod:`.decode`): typed ``Options``, a ``plan(...)``
with a typed template context, its template and launch geometry (planning only: no torch, no
CuPy).  Families import the shared modules (:mod:`.common`, :mod:`.tiles`,
:mod:`.bwd_common`), never each other: :mod:`.registry` chooses which one runs
(:func:`flashgen.families.registry.select`), and :mod:`.build` compiles a choice through the
kernel cache with the spill fallback."""
