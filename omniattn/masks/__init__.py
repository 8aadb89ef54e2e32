"""Masks: the BlockMask schedule, its builders, and dynamic top-k keep-window masks."""
from .block_mask import BlockMask
from .builders import block_mask_from_blocks, causal_block_mask, window_block_mask
from .dynamic import prepare_dynamic_mask, topk_mask

__all__ = ["BlockMask", "block_mask_from_blocks", "causal_block_mask", "prepare_dynamic_mask",
           "topk_mask", "window_block_mask"]
