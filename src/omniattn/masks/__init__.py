"""Masks: the BlockMask schedule, its builders, and dynamic top-k keep-window masks."""
from .block_mask import BlockMask
from .builders import (block_mask_from_blocks, block_mask_from_predicate, causal_block_mask,
                       document_block_mask, prefix_lm_block_mask, streaming_block_mask,
                       window_block_mask)
from .dynamic import prepare_dynamic_mask, topk_block_mask, topk_mask

__all__ = ["BlockMask", "block_mask_from_blocks", "block_mask_from_predicate",
           "causal_block_mask", "document_block_mask", "prefix_lm_block_mask",
           "prepare_dynamic_mask", "streaming_block_mask", "topk_block_mask", "topk_mask",
           "window_block_mask"]
