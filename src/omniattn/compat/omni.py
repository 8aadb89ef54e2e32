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
    """What a listed block of `omni_attention_forward` computes, one value per slot of
    block_mask_types (B, H, n_q_blocks, max_blocks), int32:

    - MASKED (0): nothing; the block is skipped (K/V never loaded). The creators fill the slots
      past each row's kv_num_blocks with it, as the original does.
    - CAUSAL (1): the causal predicate inside the block, bottom-right aligned: key j is visible
      to query i iff j <= i + Sk - Sq (the original's q_idx >= kv_idx when Sq == Sk).
    - FULL (2): every element of the block is visible, no predicate.
    """
    MASKED = 0
    CAUSAL = 1
    FULL = 2


def _raise_at_first(name: str, values: torch.Tensor, bad: torch.Tensor, what: str) -> None:
    """ValueError naming the first entry of `values` where `bad` holds: its index and value."""
    if bool(bad.any()):
        position = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name}[{', '.join(str(i) for i in position)}] = "
                         f"{int(values[position])} {what}")


def _check_lists(q, k, kv_num_blocks, kv_indices, block_mask_types, block_m,
                 block_n) -> torch.Tensor:
    """Validates the lists against q / k and the block sizes before anything is built or
    launched; returns the bool (B|1, H|1, n_q_blocks, max_blocks) of listed slots (the first
    kv_num_blocks of each row: the only ones read, as in the original)."""
    for name, size in (("BLOCK_M", block_m), ("BLOCK_N", block_n)):
        if not isinstance(size, int) or isinstance(size, bool):
            raise TypeError(f"{name} must be an int, got {type(size).__name__}")
        if size <= 0 or size % 16:
            raise ValueError(f"{name} must be a positive multiple of 16, got {size}")
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a (B, S, H, D) tensor, got {got}")
    for name, t in (("kv_num_blocks", kv_num_blocks), ("kv_indices", kv_indices),
                    ("block_mask_types", block_mask_types)):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
            got = f"dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be an int32 (or int64) tensor, got {got}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    batch, seqlen_q, num_heads = q.shape[:3]
    seqlen_k = k.shape[1]
    n_q_blocks, n_k_blocks = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    if kv_num_blocks.dim() != 3 or kv_num_blocks.shape[2] != n_q_blocks:
        raise ValueError(f"kv_num_blocks has shape {tuple(kv_num_blocks.shape)}; expected (B|1, "
                         f"H|1, n_q_blocks = {n_q_blocks}) for Sq = {seqlen_q} in query blocks "
                         f"of BLOCK_M = {block_m}")
    if kv_num_blocks.shape[0] not in (1, batch) or kv_num_blocks.shape[1] not in (1, num_heads):
        raise ValueError(f"kv_num_blocks has batch/head dims {tuple(kv_num_blocks.shape[:2])}; "
                         f"expected (1 or B, 1 or H) with (B, H) = ({batch}, {num_heads})")
    if kv_indices.dim() != 4 or kv_indices.shape[:3] != kv_num_blocks.shape:
        raise ValueError(f"kv_indices has shape {tuple(kv_indices.shape)}; expected "
                         f"kv_num_blocks' {tuple(kv_num_blocks.shape)} plus a slot dim: (B|1, "
                         f"H|1, n_q_blocks, max_blocks)")
    if block_mask_types.shape != kv_indices.shape:
        raise ValueError(f"block_mask_types has shape {tuple(block_mask_types.shape)}, kv_indices "
                         f"{tuple(kv_indices.shape)}: they must match")
    slots = kv_indices.shape[-1]
    _raise_at_first("kv_num_blocks", kv_num_blocks, (kv_num_blocks < 0) | (kv_num_blocks > slots),
                    f"is outside [0, {slots}] (the {slots} slots of kv_indices)")
    listed = torch.arange(slots, device=q.device) < kv_num_blocks[..., None]
    _raise_at_first("kv_indices", kv_indices,
                    listed & ((kv_indices < 0) | (kv_indices >= n_k_blocks)),
                    f"is outside [0, {n_k_blocks}) (Sk = {seqlen_k} in key blocks of "
                    f"BLOCK_N = {block_n})")
    _raise_at_first("block_mask_types", block_mask_types,
                    listed & ((block_mask_types < 0) | (block_mask_types > 2)),
                    "is not a BlockMaskType (0 MASKED, 1 CAUSAL, 2 FULL)")
    return listed


def _types_to_states(kv_num_blocks, kv_indices, block_mask_types, listed,
                     n_k_blocks) -> torch.Tensor:
    """int8 (B, H, n_q_blocks, n_k_blocks) block states: CAUSAL -> PARTIAL (causal predicate)."""
    state_of_type = torch.tensor([HIDDEN, PARTIAL, FULL], dtype=torch.int8,
                                 device=kv_indices.device)
    types = torch.where(listed, block_mask_types, int(BlockMaskType.MASKED)).long()
    return blocks_from_lists(kv_num_blocks, kv_indices, n_k_blocks, values=state_of_type[types])


def omni_attention_forward(q, k, v, kv_num_blocks, kv_indices, block_mask_types,
                           softmax_scale=None, BLOCK_M: int = 128, BLOCK_N: int = 128):
    """Typed block-sparse attention; returns (output (B, Sq, H, D), lse (B, H, Sq)). Both are
    differentiable (q, k, v get gradients through autograd).

    kv_num_blocks (B|1, H|1, n_q_blocks) and kv_indices / block_mask_types (B|1, H|1,
    n_q_blocks, max_blocks), int32 (or int64), with n_q_blocks = ceil(Sq / BLOCK_M): query
    block r computes the key blocks kv_indices[..., r, :kv_num_blocks[..., r]] (each in
    [0, ceil(Sk / BLOCK_N))) as their BlockMaskType says. Slots past the count are not read.
    Out-of-range values raise a ValueError naming the entry (this reads the lists on the host)."""
    listed = _check_lists(q, k, kv_num_blocks, kv_indices, block_mask_types, BLOCK_M, BLOCK_N)
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    n_k_blocks = -(-seqlen_k // BLOCK_N)
    states = _types_to_states(kv_num_blocks, kv_indices, block_mask_types, listed, n_k_blocks)
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
