"""omniattn: fast trainable attention for every mask, on one Triton kernel core."""
from . import compat, distributed, masks, nn, reference
from .api import attention, explain
from .masks import (BlockMask, block_mask_from_blocks, block_mask_from_predicate,
                    causal_block_mask, document_block_mask, prefix_lm_block_mask,
                    prepare_dynamic_mask, streaming_block_mask, topk_block_mask, topk_mask,
                    window_block_mask)

__all__ = ["BlockMask", "attention", "explain", "block_mask_from_blocks", "block_mask_from_predicate",
           "causal_block_mask", "compat", "distributed", "document_block_mask", "masks", "nn",
           "prefix_lm_block_mask", "prepare_dynamic_mask", "reference", "streaming_block_mask",
           "topk_block_mask", "topk_mask", "window_block_mask"]
__version__ = "0.1.0"
