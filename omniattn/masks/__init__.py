"""Masks: the BlockMask schedule and its builders."""
from .block_mask import BlockMask
from .builders import block_mask_from_blocks, causal_block_mask, window_block_mask

__all__ = ["BlockMask", "block_mask_from_blocks", "causal_block_mask", "window_block_mask"]
