"""FlashAttention's call shapes on flashgen ops: see :mod:`flashgen.integrations.flash_attn`.

    from flashgen.flash_attn import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)  # q, k, v (batch, seqlen, heads, head_dim)
"""

from flashgen.integrations.flash_attn import (  # noqa: F401
    flash_attn_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
)

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func"]
