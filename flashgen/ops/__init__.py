"""The torch stage: flashgen's ops, by job.  Dependencies run one way, down this list:

- :mod:`.op`: ``build_op`` (what ``flashgen.load`` returns) and the torch.library
  registration of every op form;
- :mod:`.prefill`: :class:`~flashgen.ops.prefill.attention.AttentionOp` (attention,
  varlen, the backward, block masks, the kernel choice); its ``with_kvcache`` calls
  :mod:`.decode`;
- :mod:`.decode`: serving, attention against a KV cache (``op.with_kvcache``, plan/run);
- shared by both: :mod:`.validation` (input checks, dtypes, params), :mod:`.calls` (call
  helpers: streams, alignment, kernel values), :mod:`.out_arg` (``out=``), :mod:`.sink`
  (the attention-sink epilogue);
- :mod:`.cpu`: the CPU op (blocked attention and its backward) and the float64 reference,
  which import no other ops module.

``tests/unit/test_import_graph.py`` checks this order and that no import cycle exists."""
