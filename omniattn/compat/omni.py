"""Omni-Attention façade: typed block masks (MASKED / CAUSAL / FULL) in BCSR form, forward AND
backward (the original is forward-only), over omniattn's BlockMask.

Layout as in the original: q (B, Sq, H, D), k/v (B, Sk, Hk, D) (Hk may divide H here: GQA);
kv_num_blocks (B, H, n_q_blocks), kv_indices and block_mask_types (B, H, n_q_blocks, max_blocks),
int32; blocks are BLOCK_M x BLOCK_N (any multiples of 16). Differences from the original:
- CAUSAL blocks use omniattn's bottom-right aligned causal (key j visible iff j <= i + Sk - Sq),
  identical to the original's `q_idx >= kv_idx` when Sq == Sk; with Sq != Sk the original's
  top-left alignment hides the last Sk - Sq keys from every query, which is never what a KV
  cache wants.
- lse is (B, H, Sq), not padded to a multiple of BLOCK_M.
- pattern callables are evaluated once on whole index grids when they accept tensors, and block
  by block only when they do not.
"""
from __future__ import annotations

from enum import IntEnum

import torch

from ..api import attention
from ..predicate import FULL, HIDDEN, PARTIAL, blocks_from_lists, lists_from_blocks
from ..masks.block_mask import BlockMask


class BlockMaskType(IntEnum):
    MASKED = 0
    CAUSAL = 1
    FULL = 2


def _types_to_states(kv_num_blocks, kv_indices, block_mask_types, n_k_blocks) -> torch.Tensor:
    """int8 (B, H, n_q_blocks, n_k_blocks) block states: CAUSAL -> PARTIAL (causal predicate)."""
    state_of_type = torch.tensor([HIDDEN, PARTIAL, FULL], dtype=torch.int8,
                                 device=kv_indices.device)
    return blocks_from_lists(kv_num_blocks, kv_indices, n_k_blocks,
                             values=state_of_type[block_mask_types.long()])


def omni_attention_forward(q, k, v, kv_num_blocks, kv_indices, block_mask_types,
                           softmax_scale=None, BLOCK_M: int = 128, BLOCK_N: int = 128):
    """Typed block-sparse attention; returns (output (B, Sq, H, D), lse (B, H, Sq)). Both are
    differentiable (q, k, v get gradients through autograd)."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    n_k_blocks = -(-seqlen_k // BLOCK_N)
    for name, t in (("kv_num_blocks", kv_num_blocks), ("kv_indices", kv_indices),
                    ("block_mask_types", block_mask_types)):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an int32 tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if block_mask_types.shape != kv_indices.shape:
        raise ValueError(f"block_mask_types has shape {tuple(block_mask_types.shape)}, kv_indices "
                         f"{tuple(kv_indices.shape)}: they must match")
    if ((block_mask_types < 0) | (block_mask_types > 2)).any():
        raise ValueError("block_mask_types values must be BlockMaskType: 0 MASKED, 1 CAUSAL, 2 FULL")
    states = _types_to_states(kv_num_blocks, kv_indices, block_mask_types, n_k_blocks)
    mask = BlockMask.from_states(states, (BLOCK_M, BLOCK_N), (seqlen_q, seqlen_k), causal=True)
    return attention(q, k, v, softmax_scale=softmax_scale, block_mask=mask, return_lse=True)


def _pattern_grid(block_mask_pattern, n_q_blocks: int, n_k_blocks: int, device) -> torch.Tensor:
    """(n_q_blocks, n_k_blocks) int tensor of BlockMaskType values from a tensor or a callable."""
    if isinstance(block_mask_pattern, torch.Tensor):
        if tuple(block_mask_pattern.shape) != (n_q_blocks, n_k_blocks):
            raise ValueError(f"block_mask_pattern has shape {tuple(block_mask_pattern.shape)}, "
                             f"expected ({n_q_blocks}, {n_k_blocks})")
        return block_mask_pattern.to(device=device, dtype=torch.int32)
    q_idx = torch.arange(n_q_blocks, device=device)[:, None]
    kv_idx = torch.arange(n_k_blocks, device=device)[None, :]
    try:
        grid = torch.as_tensor(block_mask_pattern(q_idx, kv_idx), device=device)
        return grid.to(torch.int32).expand(n_q_blocks, n_k_blocks)
    except (RuntimeError, TypeError):
        # a pattern with Python control flow on its arguments: evaluate block by block
        return torch.tensor([[int(block_mask_pattern(i, j)) for j in range(n_k_blocks)]
                             for i in range(n_q_blocks)], dtype=torch.int32, device=device)


def create_omni_block_mask(batch: int, nheads: int, seqlen_q: int, seqlen_k: int,
                           block_mask_pattern, BLOCK_M: int = 128, BLOCK_N: int = 128,
                           device=None):
    """(kv_num_blocks (B, H, nQ), kv_indices (B, H, nQ, C), block_mask_types (B, H, nQ, C)) from
    a (n_q_blocks, n_k_blocks) pattern tensor of BlockMaskType values, or a callable
    (q_block_idx, kv_block_idx) -> BlockMaskType. The batch/head dims are broadcast views."""
    n_q_blocks, n_k_blocks = -(-seqlen_q // BLOCK_M), -(-seqlen_k // BLOCK_N)
    pattern = _pattern_grid(block_mask_pattern, n_q_blocks, n_k_blocks, device)
    kv_num_blocks, kv_indices = lists_from_blocks(pattern != BlockMaskType.MASKED)
    width = max(int(kv_num_blocks.max()), 1) if kv_num_blocks.numel() else 1
    kv_indices = kv_indices[:, :width]
    block_mask_types = torch.gather(pattern, 1, kv_indices.long()).to(torch.int32)
    # slots past each row's count hold MASKED, as in the original
    slots = torch.arange(width, device=pattern.device)[None, :] < kv_num_blocks[:, None]
    block_mask_types = torch.where(slots, block_mask_types, int(BlockMaskType.MASKED))

    def per_head(t):
        return t.expand(batch, nheads, *t.shape)

    return per_head(kv_num_blocks), per_head(kv_indices), per_head(block_mask_types)


def create_causal_block_mask(batch: int, nheads: int, seqlen_q: int, seqlen_k: int,
                             BLOCK_M: int = 128, BLOCK_N: int = 128, device=None):
    """Blocks on or below the block diagonal are CAUSAL, the rest MASKED."""
    return create_omni_block_mask(
        batch, nheads, seqlen_q, seqlen_k,
        lambda q_idx, kv_idx: torch.where(kv_idx <= q_idx, int(BlockMaskType.CAUSAL),
                                          int(BlockMaskType.MASKED)),
        BLOCK_M, BLOCK_N, device)


def create_full_block_mask(batch: int, nheads: int, seqlen_q: int, seqlen_k: int,
                           BLOCK_M: int = 128, BLOCK_N: int = 128, device=None):
    """Every block FULL: dense attention."""
    n_q_blocks, n_k_blocks = -(-seqlen_q // BLOCK_M), -(-seqlen_k // BLOCK_N)
    pattern = torch.full((n_q_blocks, n_k_blocks), int(BlockMaskType.FULL), dtype=torch.int32,
                         device=device)
    return create_omni_block_mask(batch, nheads, seqlen_q, seqlen_k, pattern, BLOCK_M, BLOCK_N,
                                  device)


def create_hybrid_block_mask(batch: int, nheads: int, seqlen_q: int, seqlen_k: int,
                             prefix_len: int, BLOCK_M: int = 128, BLOCK_N: int = 128, device=None):
    """Prefix-LM at block granularity: blocks inside the prefix (both ways) are FULL, the rest
    causal (CAUSAL on or below the block diagonal, MASKED above), as in the original."""
    prefix_q_blocks = -(-prefix_len // BLOCK_M)
    prefix_k_blocks = -(-prefix_len // BLOCK_N)

    def hybrid(q_idx, kv_idx):
        in_prefix = (q_idx < prefix_q_blocks) & (kv_idx < prefix_k_blocks)
        causal = torch.where(kv_idx <= q_idx, int(BlockMaskType.CAUSAL), int(BlockMaskType.MASKED))
        return torch.where(in_prefix, int(BlockMaskType.FULL), causal)

    return create_omni_block_mask(batch, nheads, seqlen_q, seqlen_k, hybrid, BLOCK_M, BLOCK_N,
                                  device)
