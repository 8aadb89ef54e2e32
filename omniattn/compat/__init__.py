"""Drop-in façades for the systems omniattn replaces: thin wrappers over `omniattn.attention`."""
from .omni import (BlockMaskType, create_causal_block_mask, create_full_block_mask,
                   create_hybrid_block_mask, create_omni_block_mask, omni_attention_forward)

__all__ = ["BlockMaskType", "create_causal_block_mask", "create_full_block_mask",
           "create_hybrid_block_mask", "create_omni_block_mask", "omni_attention_forward"]
