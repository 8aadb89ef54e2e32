"""omniattn: fast trainable attention for every mask, on one Triton kernel core."""
from . import compat, masks, nn, reference
from .api import attention
from .masks import (BlockMask, block_mask_from_blocks, causal_block_mask, prepare_dynamic_mask,
                    topk_mask, window_block_mask)

__all__ = ["BlockMask", "attention", "block_mask_from_blocks", "causal_block_mask", "compat",
           "masks", "nn", "prepare_dynamic_mask", "reference", "topk_mask", "window_block_mask"]
__version__ = "0.1.0"
