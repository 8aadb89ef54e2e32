"""Evaluating an element predicate block by block: the states and element bitmaps of a block
mask, in O(blocks + distinct bitmaps) memory, never O(Sq x Sk)."""
from __future__ import annotations

import torch

from ..predicate import FULL, HIDDEN, PARTIAL


def _evaluate_blocks(mask_mod, blocks: torch.Tensor, block_q: int, block_k: int, seqlen_q: int,
                     seqlen_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mask_mod on the elements of blocks (n, 4) = (b, h, q block, k block): (n, BQ, BK) values,
    and per block whether every / some element inside (Sq, Sk) is visible. Indices are int32
    (half the bytes of mask_mod's temporaries); those past the sequences are clamped for the call
    and ignored after it."""
    b, h, q_block, k_block = (blocks[:, i, None, None].to(torch.int32) for i in range(4))
    rows = torch.arange(block_q, device=blocks.device, dtype=torch.int32)[:, None]
    cols = torch.arange(block_k, device=blocks.device, dtype=torch.int32)[None, :]
    q_idx, kv_idx = q_block * block_q + rows, k_block * block_k + cols
    inside = (q_idx < seqlen_q) & (kv_idx < seqlen_k)  # (n, BQ, BK)
    values = mask_mod(b, h, q_idx.clamp(max=seqlen_q - 1), kv_idx.clamp(max=seqlen_k - 1))
    values = torch.as_tensor(values, device=blocks.device).to(torch.bool).expand(inside.shape)
    return values, (values | ~inside).flatten(1).all(1), (values & inside).flatten(1).any(1)


def _packed_words(bitmaps: torch.Tensor) -> torch.Tensor:
    """bool (n, BQ, BK) -> int64 (n, ceil(BQ * BK / 64)): 64 elements per word, and no
    temporary wider than the bitmaps themselves."""
    count = bitmaps.shape[0]
    flat = bitmaps.reshape(count, -1)
    flat = torch.nn.functional.pad(flat, (0, -flat.shape[1] % 64)).view(count, -1, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=flat.device)
    packed = (flat.view(torch.uint8) * weights).sum(-1, dtype=torch.uint8)
    return packed.view(count, -1, 8).view(torch.int64).view(count, -1)


def _first_of_each(inverse: torch.Tensor) -> torch.Tensor:
    """Index of the first input of each group of `inverse`."""
    count = inverse.shape[0]
    first = torch.full((int(inverse.max()) + 1,), count, device=inverse.device, dtype=torch.long)
    return first.scatter_reduce_(0, inverse, torch.arange(count, device=inverse.device), "amin")


def _distinct_bitmaps(bitmaps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool (n, BQ, BK) -> (distinct bitmaps (m, BQ, BK), index of each input among them)."""
    words = _packed_words(bitmaps)
    # a multiply-add hash of the words groups the bitmaps with a 1-D unique (row-wise unique is
    # far slower); the groups are verified word by word, and a collision falls back to it
    multipliers = torch.randint(1, 2 ** 62, (words.shape[1],),
                                generator=torch.Generator().manual_seed(0)) * 2 + 1
    hashes = (words * multipliers.to(words.device)).sum(-1)  # wraps: fine for a hash
    _, inverse = torch.unique(hashes, return_inverse=True)
    first = _first_of_each(inverse)
    if not torch.equal(words, words[first][inverse]):
        _, inverse = torch.unique(words, dim=0, return_inverse=True)
        first = _first_of_each(inverse)
    return bitmaps[first], inverse


def predicate_blocks(mask_mod, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                     block_size: tuple[int, int], device=None,
                     block_states: torch.Tensor | None = None, chunk_elements: int = 1 << 22
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(states int8 (B|1, H|1, n_q_blocks, n_k_blocks), distinct element bitmaps bool
    (m, BQ, BK) or None, each block's bitmap slot int32 like states (-1: none) or None) of
    mask_mod(b, h, q_idx, kv_idx) (see `block_mask_from_predicate`), evaluated in chunks of at
    most chunk_elements elements, only inside the PARTIAL blocks of block_states if given."""
    block_q, block_k = block_size
    n_q, n_k = -(-seqlen_q // block_q), -(-seqlen_k // block_k)
    if block_states is None:
        states = torch.full((batch, heads, n_q, n_k), PARTIAL, dtype=torch.int8, device=device)
    else:
        states = block_states.to(device=device, dtype=torch.int8).expand(
            batch, heads, n_q, n_k).clone()
    candidates = (states == PARTIAL).nonzero()  # (n, 4): b, h, q block, k block
    blocks_per_chunk = max(1, chunk_elements // (block_q * block_k))
    bitmaps, owners = [], []
    for start in range(0, candidates.shape[0], blocks_per_chunk):
        blocks = candidates[start:start + blocks_per_chunk]
        values, every, some = _evaluate_blocks(mask_mod, blocks, block_q, block_k, seqlen_q,
                                               seqlen_k)
        b, h, q_block, k_block = blocks.unbind(1)
        states[b, h, q_block, k_block] = torch.where(
            every, FULL, torch.where(some, PARTIAL, HIDDEN)).to(torch.int8)
        partial = some & ~every
        if partial.any():
            distinct, inverse = _distinct_bitmaps(values[partial])
            bitmaps.append(distinct)
            owners.append((blocks[partial], inverse))
    if not bitmaps:
        return states, None, None
    distinct, inverse = _distinct_bitmaps(torch.cat(bitmaps))
    slots = torch.full(states.shape, -1, dtype=torch.int32, device=states.device)
    offset = 0
    for (blocks, chunk_inverse), chunk in zip(owners, bitmaps):
        b, h, q_block, k_block = blocks.unbind(1)
        slots[b, h, q_block, k_block] = inverse[offset + chunk_inverse].to(torch.int32)
        offset += chunk.shape[0]
    return states, distinct, slots
