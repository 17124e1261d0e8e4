"""Attention over whole sequences: :mod:`.attention` (``AttentionOp``: the entry point, the
eager fast path, the forward launch) with :mod:`.attention_kernels` (kernel choice and
loading), :mod:`.density` (kept keys per row, for the sparse-tile choice),
:mod:`.attention_blockmask` (``op.block_mask``) and :mod:`.blockmask` (the block table);
:mod:`.backward` (autograd), :mod:`.varlen` (packed sequences), :mod:`.offsets` (the
q / kv offsets of ring attention's blocks).  Imports :mod:`flashgen.ops.decode` (for
``with_kvcache``), never the other way."""
