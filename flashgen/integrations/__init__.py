"""flashgen where users already are: HuggingFace transformers (:mod:`.transformers`),
FlashAttention's call shapes (:mod:`.flash_attn`, also ``flashgen.flash_attn``) and PyTorch
SDPA's flash backend (:mod:`.sdpa`).  Importing this package imports none of them."""
