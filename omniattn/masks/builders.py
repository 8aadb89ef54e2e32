"""BlockMask builders. Each lists a block FULL only when its predicate holds on every element of
it, PARTIAL when it holds on some, and leaves the rest out. Work and memory are O(blocks)."""
from __future__ import annotations

import torch

from .block_mask import FULL, BlockMask, RelativePredicate


def _relative_block_mask(seqlen_q, seqlen_k, block_size, causal, window, device) -> BlockMask:
    block_q, block_k = (block_size, block_size) if isinstance(block_size, int) else block_size
    states = RelativePredicate.make(causal, window).classify(seqlen_q, seqlen_k, block_q, block_k,
                                                             device=device)
    return BlockMask.from_states(states[None, None], (block_q, block_k), (seqlen_q, seqlen_k),
                                 causal=causal, window=window)


def causal_block_mask(seqlen_q: int, seqlen_k: int, block_size: int | tuple[int, int] = 128,
                      device=None) -> BlockMask:
    """Bottom-right aligned causal: key j visible to query i iff j <= i + Sk - Sq. Shared by
    every batch and head (B = H = 1 in the lists, read with stride 0)."""
    return _relative_block_mask(seqlen_q, seqlen_k, block_size, True, None, device)


def window_block_mask(seqlen_q: int, seqlen_k: int, window: tuple[int, int], causal: bool = False,
                      block_size: int | tuple[int, int] = 128, device=None) -> BlockMask:
    """Sliding window (left, right) around the bottom-right aligned diagonal, -1 = unbounded,
    optionally ANDed with causal."""
    return _relative_block_mask(seqlen_q, seqlen_k, block_size, causal, tuple(window), device)


def block_mask_from_blocks(blocks: torch.Tensor, block_size: int | tuple[int, int] = 128,
                           seq_lengths: tuple[int, int] | None = None) -> BlockMask:
    """From a bool (B|1, H|1, n_q_blocks, n_k_blocks) picture: True blocks are fully visible
    (FULL), the others hidden. seq_lengths defaults to the blocks times the block size."""
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.bool or blocks.dim() != 4:
        got = f"{blocks.dtype} tensor of shape {tuple(blocks.shape)}" \
            if isinstance(blocks, torch.Tensor) else type(blocks).__name__
        raise TypeError(f"blocks must be a bool tensor (B|1, H|1, n_q_blocks, n_k_blocks), got {got}")
    block_q, block_k = (block_size, block_size) if isinstance(block_size, int) else block_size
    if seq_lengths is None:
        seq_lengths = (blocks.shape[2] * block_q, blocks.shape[3] * block_k)
    states = blocks.to(torch.int8) * FULL
    return BlockMask.from_states(states, (block_q, block_k), seq_lengths)
