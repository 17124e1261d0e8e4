"""Serving: attention against a KV cache (``op.with_kvcache``, plan/run).  Its modules depend
one way, down this list: :mod:`.op` (``DecodeOp``: the user API, the registered ops, the
launch) -> :mod:`.planning` (the ``plan_decode`` / ``plan_for`` mixin of ``DecodeOp``) ->
:mod:`.fast` (the planned call and its fast host path, which reaches the op through the
:class:`~flashgen.ops.decode.fast.PlanOwner` protocol) -> :mod:`.fp8` (an e4m3 cache's
descales) -> :mod:`.inputs` (checks from metadata); :mod:`.reference` (the CPU path and the
float64 references) imports :mod:`.inputs` only.  Nothing here imports
:mod:`flashgen.ops.prefill`."""
