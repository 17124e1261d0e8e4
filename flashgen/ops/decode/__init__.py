"""Serving: attention against a KV cache (``op.with_kvcache``, plan/run): :mod:`.op`
(``DecodeOp``: the user API, the registered ops, the launch), :mod:`.planning` (the
``plan_decode`` / ``plan_for`` mixin), :mod:`.fast` (the planned call and its fast host path),
:mod:`.fp8` (an e4m3 cache's descales), :mod:`.inputs` (checks from metadata) and
:mod:`.reference` (the CPU path and the float64 references).  Imports nothing of
:mod:`flashgen.ops.prefill`."""
