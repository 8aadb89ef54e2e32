"""Drop-in façades for the systems omniattn replaces: thin wrappers over `omniattn.attention`."""
from .flash_attn import flash_attn_func, flash_attn_varlen_func
from .flash_dmattn import flash_dmattn_func, prepare_dynamic_mask
from .omni import (BlockMaskType, create_causal_block_mask, create_full_block_mask,
                   create_hybrid_block_mask, create_omni_block_mask, omni_attention_forward)

__all__ = ["BlockMaskType", "create_causal_block_mask", "create_full_block_mask",
           "create_hybrid_block_mask", "create_omni_block_mask", "flash_attn_func",
           "flash_attn_varlen_func", "flash_dmattn_func",
           "omni_attention_forward", "prepare_dynamic_mask"]
