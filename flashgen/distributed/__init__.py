"""Context parallelism over ``torch.distributed``: :func:`ring_attention` runs any flashgen op
on a sequence split across the ranks of a process group (see :mod:`flashgen.distributed.ring`).
"""

from flashgen.distributed.ring import gather_sequence, ring_attention, segments, shard_sequence

__all__ = ["ring_attention", "shard_sequence", "gather_sequence", "segments"]
