"""Drop-in façades for the systems omniattn replaces: thin wrappers over `omniattn.attention`."""
from .block_sparse import (block_sparse_attn_func, block_streaming_attn_func,
                           token_streaming_attn_func)
from .flash_attn import flash_attn_func, flash_attn_varlen_func
from .flash_dmattn import flash_dmattn_func, prepare_dynamic_mask
from .kvcache import flash_attn_with_kvcache
from .omni import (BlockMaskType, create_causal_block_mask, create_full_block_mask,
                   create_hybrid_block_mask, create_omni_block_mask, omni_attention_forward)

__all__ = ["BlockMaskType", "block_sparse_attn_func", "block_streaming_attn_func",
           "create_causal_block_mask", "create_full_block_mask",
           "create_hybrid_block_mask", "create_omni_block_mask", "flash_attn_func",
           "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_dmattn_func",
           "omni_attention_forward", "prepare_dynamic_mask", "token_streaming_attn_func"]
