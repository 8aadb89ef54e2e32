"""BlockMask builders. Each lists a block FULL only when its predicate holds on every element of
it, PARTIAL when it holds on some, and leaves the rest out. Memory is O(blocks + distinct
element bitmaps); element predicates are evaluated only inside blocks that may be PARTIAL."""
from __future__ import annotations

import torch

from ..predicate import FULL, HIDDEN, PARTIAL, RelativePredicate, check_window
from .block_mask import BlockMask
from .evaluate import predicate_blocks


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _pair(block_size) -> tuple[int, int]:
    """(BQ, BK) from an int or a pair; BlockMask checks that they are multiples of 16."""
    pair = (block_size, block_size) if _is_int(block_size) else block_size
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(_is_int(b) for b in pair):
        raise TypeError(f"block_size must be an int or a pair of ints (BQ, BK), got "
                        f"{type(block_size).__name__}")
    for i, size in enumerate(pair):
        if size <= 0 or size % 16:
            raise ValueError(f"block_size[{i}] must be a positive multiple of 16, got {size}")
    return tuple(pair)


def _relative_block_mask(seqlen_q, seqlen_k, block_size, causal, window, device) -> BlockMask:
    block_q, block_k = _pair(block_size)
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
    check_window(window)
    return _relative_block_mask(seqlen_q, seqlen_k, block_size, causal, tuple(window), device)


def block_mask_from_blocks(blocks: torch.Tensor, block_size: int | tuple[int, int] = 128,
                           seq_lengths: tuple[int, int] | None = None) -> BlockMask:
    """From a bool (B|1, H|1, n_q_blocks, n_k_blocks) picture: True blocks are fully visible
    (FULL), the others hidden. seq_lengths (Sq, Sk) defaults to the blocks times the block size;
    it must need exactly the picture's n_q_blocks x n_k_blocks blocks."""
    if not isinstance(blocks, torch.Tensor):
        raise TypeError(f"blocks must be a bool torch.Tensor (B|1, H|1, n_q_blocks, n_k_blocks), "
                        f"got {type(blocks).__name__}")
    if blocks.dtype != torch.bool:
        raise TypeError(f"blocks must be a bool tensor (True = visible block), got dtype "
                        f"{blocks.dtype}")
    if blocks.dim() != 4:
        raise ValueError(f"blocks must be 4-D (B|1, H|1, n_q_blocks, n_k_blocks), got shape "
                         f"{tuple(blocks.shape)}")
    block_q, block_k = _pair(block_size)
    grid = tuple(blocks.shape[2:])
    if seq_lengths is None:
        seq_lengths = (grid[0] * block_q, grid[1] * block_k)
    if not isinstance(seq_lengths, (tuple, list)) or len(seq_lengths) != 2 \
            or not all(_is_int(n) for n in seq_lengths):
        raise TypeError(f"seq_lengths must be a pair of ints (Sq, Sk), got "
                        f"{type(seq_lengths).__name__}")
    needed = (-(-seq_lengths[0] // block_q), -(-seq_lengths[1] // block_k))
    if needed != grid:
        raise ValueError(f"seq_lengths = {tuple(seq_lengths)} needs {needed} blocks of "
                         f"{(block_q, block_k)}, but blocks has {grid} (its last two dims)")
    states = blocks.to(torch.int8) * FULL
    return BlockMask.from_states(states, (block_q, block_k), seq_lengths)


def block_mask_from_predicate(mask_mod, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                              block_size: int | tuple[int, int] = 128, device=None,
                              block_states: torch.Tensor | None = None,
                              chunk_elements: int = 1 << 22) -> BlockMask:
    """BlockMask of an element predicate, like FlexAttention's create_block_mask.

    mask_mod(b, h, q_idx, kv_idx) takes broadcastable int32 tensors and returns a bool tensor
    (True = visible). batch / heads may be 1 to share the mask over that dim (mask_mod then sees
    index 0). Each block becomes FULL (all visible), hidden (none) or PARTIAL with an element
    bitmap; identical bitmaps are stored once. Work is done in chunks of at most
    `chunk_elements` elements: memory is O(blocks + distinct bitmaps), never O(Sq x Sk).
    block_states: optional int8 (B|1, H|1, n_q_blocks, n_k_blocks) HIDDEN/PARTIAL/FULL picture
    that is exact on its FULL and hidden blocks; mask_mod is then evaluated only inside its
    PARTIAL blocks (O(partial blocks x block area) instead of O(B x H x Sq x Sk) work)."""
    block_q, block_k = _pair(block_size)
    states, bitmaps, slots = predicate_blocks(mask_mod, batch, heads, seqlen_q, seqlen_k,
                                              (block_q, block_k), device, block_states,
                                              chunk_elements)
    return BlockMask.from_states(states, (block_q, block_k), (seqlen_q, seqlen_k),
                                 element_bits=bitmaps, element_slots=slots)


def _key_prefix_states(n_q: int, seqlen_k: int, block_k: int, prefix: int, device) -> torch.Tensor:
    """int8 (n_q, n_k) states of "key < prefix" (the same for every query block)."""
    first_k = torch.arange(-(-seqlen_k // block_k), device=device) * block_k
    last_k = torch.clamp(first_k + block_k, max=seqlen_k) - 1
    state = torch.where(last_k < prefix, FULL, torch.where(first_k < prefix, PARTIAL, HIDDEN))
    return state.to(torch.int8).expand(n_q, -1)


def prefix_lm_block_mask(seqlen_q: int, seqlen_k: int, prefix_len: int,
                         block_size: int | tuple[int, int] = 128, device=None) -> BlockMask:
    """Prefix LM: key j visible to query i iff j < prefix_len (the bidirectional prefix) or
    j <= i + Sk - Sq (bottom-right causal). Element-exact for any prefix_len."""
    block_q, block_k = _pair(block_size)
    causal = RelativePredicate.make(True).classify(seqlen_q, seqlen_k, block_q, block_k,
                                                   device=device)
    prefix = _key_prefix_states(causal.shape[0], seqlen_k, block_k, prefix_len, device)
    offset = seqlen_k - seqlen_q

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_len) | (kv_idx <= q_idx + offset)

    return block_mask_from_predicate(mask_mod, 1, 1, seqlen_q, seqlen_k, (block_q, block_k),
                                     device, block_states=torch.maximum(causal, prefix))  # OR


def document_block_mask(cu_seqlens: torch.Tensor, block_size: int | tuple[int, int] = 128,
                        causal: bool = False) -> BlockMask:
    """Documents packed in one sequence: query i sees key j iff both lie in the same document
    [cu_seqlens[d], cu_seqlens[d + 1]) (and j <= i with causal). cu_seqlens: int (D + 1,) from 0
    to the total length S, non-decreasing; the mask is (1, 1, S, S), on cu_seqlens' device.
    Blocks inside one document are FULL, blocks across documents hidden, the rest PARTIAL."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a 1-D integer tensor (documents + 1,) of offsets "
                        f"from 0, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex \
            or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must have an integer dtype, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor (documents + 1,) of offsets "
                         f"from 0, got shape {tuple(cu_seqlens.shape)}")
    block_q, block_k = _pair(block_size)
    device = cu_seqlens.device
    bounds = cu_seqlens.long()
    total = int(bounds[-1])
    if int(bounds[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0 and never decrease; cu_seqlens[0] = "
                         f"{int(bounds[0])}")
    decreasing = bounds[1:] < bounds[:-1]
    if bool(decreasing.any()):
        at = int(decreasing.nonzero()[0]) + 1
        raise ValueError(f"cu_seqlens must start at 0 and never decrease; cu_seqlens[{at}] = "
                         f"{int(bounds[at])} is below cu_seqlens[{at - 1}] = {int(bounds[at - 1])}")
    document = torch.bucketize(torch.arange(total, device=device), bounds[1:], right=True)

    def block_documents(block: int) -> tuple[torch.Tensor, torch.Tensor]:
        first = torch.arange(0, total, block, device=device)
        return document[first], document[torch.clamp(first + block, max=total) - 1]

    q_first, q_last = block_documents(block_q)
    k_first, k_last = block_documents(block_k)
    hidden = (q_last[:, None] < k_first[None, :]) | (k_last[None, :] < q_first[:, None])
    full = (q_first == q_last)[:, None] & (k_first == k_last)[None, :] \
        & (q_first[:, None] == k_first[None, :])
    states = torch.where(hidden, HIDDEN, torch.where(full, FULL, PARTIAL)).to(torch.int8)
    if causal:
        states = torch.minimum(states, RelativePredicate.make(True).classify(
            total, total, block_q, block_k, device=device))

    def mask_mod(b, h, q_idx, kv_idx):
        same = document[q_idx] == document[kv_idx]
        return same & (kv_idx <= q_idx) if causal else same

    return block_mask_from_predicate(mask_mod, 1, 1, total, total, (block_q, block_k), device,
                                     block_states=states[None, None])


def streaming_block_mask(seqlen_q: int, seqlen_k: int, sink: int, local: int,
                         block_size: int | tuple[int, int] = 128, in_tokens: bool = False,
                         device=None) -> BlockMask:
    """Streaming (attention-sink) attention, causal (bottom-right aligned): each query sees the
    first `sink` and the last `local` keys up to its diagonal.

    in_tokens=False: sink / local count key blocks: query block r sees key blocks c < sink and
    d - local < c <= d, with d the key block of the diagonal of r's last row, causal inside.
    in_tokens=True: element-exact, key j visible to query i iff j <= i + Sk - Sq and
    (j < sink or j > i + Sk - Sq - local)."""
    if sink < 0 or local < 0:
        raise ValueError(f"sink and local must be >= 0, got {sink} and {local}")
    block_q, block_k = _pair(block_size)
    causal = RelativePredicate.make(True).classify(seqlen_q, seqlen_k, block_q, block_k,
                                                   device=device)
    n_q, n_k = causal.shape
    offset = seqlen_k - seqlen_q
    if not in_tokens:
        last_row = torch.clamp(torch.arange(1, n_q + 1, device=device) * block_q, max=seqlen_q) - 1
        # floor division, also for a diagonal left of key 0 (then no local block)
        diagonal = torch.div(last_row + offset, block_k, rounding_mode="floor")[:, None]
        column = torch.arange(n_k, device=device)[None, :]
        listed = (column < sink) | ((column > diagonal - local) & (column <= diagonal))
        states = torch.minimum(torch.where(listed, FULL, HIDDEN).to(torch.int8), causal)
        return BlockMask.from_states(states[None, None], (block_q, block_k),
                                     (seqlen_q, seqlen_k), causal=True)
    sinks = torch.minimum(_key_prefix_states(n_q, seqlen_k, block_k, sink, device), causal)
    band = RelativePredicate(local - 1, 0).classify(seqlen_q, seqlen_k, block_q, block_k,
                                                    device=device) if local > 0 \
        else torch.zeros_like(causal)

    def mask_mod(b, h, q_idx, kv_idx):
        rel = kv_idx - q_idx - offset
        return (rel <= 0) & ((kv_idx < sink) | (rel > -local))

    return block_mask_from_predicate(mask_mod, 1, 1, seqlen_q, seqlen_k, (block_q, block_k),
                                     device, block_states=torch.maximum(sinks, band)[None, None])
