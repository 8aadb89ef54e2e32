"""BlockMask: a block-level schedule in FlexAttention's BCSR layout plus the element predicate its
PARTIAL blocks apply.

Blocks are (BQ, BK) = `block_size`, any multiples of 16, independent of the kernel's tiles: the
kernels run it through `kernel_states`, which maps user blocks onto kernel tiles.
A block is FULL (every element visible, no predicate: FlexAttention's semantics), PARTIAL (the
predicate decides each element) or absent (hidden, never loaded). The predicate is relative to the
bottom-right aligned diagonal, like `attention`'s own: `causal` and/or `window=(left, right)`.
`attention(causal=, window=)` ANDs its own predicate with all of it.
"""
from __future__ import annotations

from functools import cached_property

import torch

from ..kernels.schedule import (FULL, HIDDEN, PARTIAL, RelativePredicate, Schedule,
                                blocks_from_lists, lists_from_blocks, transposed_lists)


class BlockMask:
    """Block-sparse schedule.

    kv_num_blocks (B|1, H|1, n_q_blocks) int32 and kv_indices (B|1, H|1, n_q_blocks, C) int32 list
    the PARTIAL key blocks of each query block; full_kv_num_blocks / full_kv_indices the FULL ones
    (FlexAttention's fields). `block_size` = (BQ, BK), multiples of 16; `seq_lengths` = (Sq, Sk).
    PARTIAL blocks apply `causal` / `window` (see the module docstring).
    The transposed lists (q_num_blocks, q_indices, ...) are built once, on first use.
    """

    def __init__(self, kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor,
                 full_kv_num_blocks: torch.Tensor | None = None,
                 full_kv_indices: torch.Tensor | None = None, *,
                 block_size: int | tuple[int, int] = 128,
                 seq_lengths: tuple[int, int] | None = None,
                 causal: bool = False, window: tuple[int, int] | None = None):
        block_q, block_k = (block_size, block_size) if isinstance(block_size, int) else block_size
        for name, size in (("block_size[0]", block_q), ("block_size[1]", block_k)):
            if not isinstance(size, int) or size <= 0 or size % 16:
                raise ValueError(f"{name} must be a positive multiple of 16, got {size!r}; the "
                                 f"kernels map any such block onto their own tiles")
        _check_lists("kv_num_blocks", kv_num_blocks, "kv_indices", kv_indices)
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise ValueError("full_kv_num_blocks and full_kv_indices must be given together")
        if full_kv_num_blocks is None:
            full_kv_num_blocks = torch.zeros_like(kv_num_blocks)
            full_kv_indices = torch.zeros_like(kv_indices[..., :1])
        _check_lists("full_kv_num_blocks", full_kv_num_blocks, "full_kv_indices", full_kv_indices)
        if full_kv_num_blocks.shape != kv_num_blocks.shape:
            raise ValueError(f"full_kv_num_blocks has shape {tuple(full_kv_num_blocks.shape)}, "
                             f"kv_num_blocks {tuple(kv_num_blocks.shape)}: they must match")
        n_q_blocks = kv_num_blocks.shape[-1]
        if seq_lengths is None:
            seq_lengths = (n_q_blocks * block_q, kv_indices.shape[-1] * block_k)
        seqlen_q, seqlen_k = seq_lengths
        if -(-seqlen_q // block_q) != n_q_blocks:
            raise ValueError(f"seq_lengths[0] = {seqlen_q} needs {-(-seqlen_q // block_q)} query "
                             f"blocks of {block_q}, but kv_num_blocks has {n_q_blocks}")
        self.kv_num_blocks = kv_num_blocks.to(torch.int32)
        self.kv_indices = kv_indices.to(torch.int32).contiguous()
        self.full_kv_num_blocks = full_kv_num_blocks.to(torch.int32)
        self.full_kv_indices = full_kv_indices.to(torch.int32).contiguous()
        self.block_size = (block_q, block_k)
        self.seq_lengths = (int(seqlen_q), int(seqlen_k))
        self.predicate = RelativePredicate.make(causal, window)
        self._check_indices()
        self._kernel_states: dict[tuple, torch.Tensor] = {}
        self._kernel_schedules: dict[tuple, Schedule] = {}

    @classmethod
    def from_states(cls, states: torch.Tensor, block_size, seq_lengths,
                    causal: bool = False, window=None) -> "BlockMask":
        """From an int8 (B|1, H|1, n_q_blocks, n_k_blocks) picture of HIDDEN/PARTIAL/FULL."""
        kv_num, kv_idx = lists_from_blocks(states == PARTIAL)
        full_num, full_idx = lists_from_blocks(states == FULL)
        return cls(kv_num, kv_idx, full_num, full_idx, block_size=block_size,
                   seq_lengths=seq_lengths, causal=causal, window=window)

    @property
    def n_blocks(self) -> tuple[int, int]:
        block_q, block_k = self.block_size
        return -(-self.seq_lengths[0] // block_q), -(-self.seq_lengths[1] // block_k)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B|1, H|1, Sq, Sk) this mask describes."""
        return (*self.kv_num_blocks.shape[:2], *self.seq_lengths)

    @cached_property
    def states(self) -> torch.Tensor:
        """int8 (B|1, H|1, n_q_blocks, n_k_blocks): 0 hidden, 1 PARTIAL, 2 FULL (O(blocks)); the
        dense block picture for debugging and for the conversions below."""
        n_k = self.n_blocks[1]
        partial = blocks_from_lists(self.kv_num_blocks, self.kv_indices, n_k)
        full = blocks_from_lists(self.full_kv_num_blocks, self.full_kv_indices, n_k)
        return partial.to(torch.int8) * PARTIAL + full.to(torch.int8) * FULL

    def to_string(self, batch: int = 0, head: int = 0) -> str:
        """Block picture of one (batch, head): '#' FULL, '+' PARTIAL, '.' hidden."""
        states = self.states
        states = states[min(batch, states.shape[0] - 1), min(head, states.shape[1] - 1)]
        return "\n".join("".join(".+#"[s] for s in row.tolist()) for row in states)

    @property
    def density(self) -> float:
        """Listed blocks over all blocks (averaged over batch and heads)."""
        listed = self.kv_num_blocks.sum() + self.full_kv_num_blocks.sum()
        total = self.kv_num_blocks.numel() * self.n_blocks[1]
        return float(listed) / total if total else 0.0

    def __repr__(self) -> str:
        left, right = self.predicate.left, self.predicate.right
        predicate = "" if self.predicate.unbounded else ", partial blocks apply " + (
            "causal" if (left, right) == (-1, 0) else f"window=({left}, {right})")
        return (f"BlockMask(shape={self.shape}, block_size={self.block_size}, "
                f"density={self.density:.3f}{predicate})")

    @cached_property
    def transposed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_num_blocks, q_indices, full_q_num_blocks, full_q_indices): per key block, which query
        blocks see it. Built once, for the backward pass."""
        return transposed_lists(self.states == PARTIAL, self.states == FULL)

    def _check_indices(self) -> None:
        n_k = self.n_blocks[1]
        for num, idx, name in ((self.kv_num_blocks, self.kv_indices, "kv_indices"),
                               (self.full_kv_num_blocks, self.full_kv_indices, "full_kv_indices")):
            if (num < 0).any() or (num > idx.shape[-1]).any():
                raise ValueError(f"block counts must lie in [0, {idx.shape[-1]}] (the columns of "
                                 f"{name})")
            listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
            if ((idx < 0) | (idx >= n_k))[listed].any():
                raise ValueError(f"{name} lists a key block outside [0, {n_k}) for "
                                 f"Sk = {self.seq_lengths[1]} and block size {self.block_size[1]}")

    def element_states(self, q_idx: torch.Tensor, seqlen_k: int) -> torch.Tensor:
        """int8 (B|1, H|1, len(q_idx), Sk) block state of each element of rows q_idx: what the
        reference needs, one chunk of rows at a time (never all Sq x Sk)."""
        block_q, block_k = self.block_size
        states = self.states[:, :, q_idx // block_q]
        return states[..., torch.arange(seqlen_k, device=states.device) // block_k]

    def kernel_states(self, block_m: int, block_n: int, predicate: RelativePredicate,
                      element_states: torch.Tensor | None = None) -> torch.Tensor:
        """int8 (B|1, H|1, n_q_tiles, n_k_tiles) states at kernel tiles (block_m, block_n) that
        divide the user blocks, for attention's own `predicate` (and element-mask tile states,
        broadcastable) ANDed with this mask's. A tile is FULL when its user block is FULL and the
        outer terms hold on the whole tile, or its user block is PARTIAL and everything holds on
        it; HIDDEN when anything hides it; PARTIAL otherwise. Without element states the result
        is cached: a mask reused across steps (and by the backward pass) is converted once."""
        key = (block_m, block_n, predicate)
        if element_states is None and key in self._kernel_states:
            return self._kernel_states[key]
        block_q, block_k = self.block_size
        if block_q % block_m or block_k % block_n:
            raise ValueError(f"kernel tiles ({block_m}, {block_n}) must divide the mask's "
                             f"blocks {self.block_size}")
        device = self.kv_indices.device
        user = self.states
        user = user.repeat_interleave(block_q // block_m, dim=2)
        user = user.repeat_interleave(block_k // block_n, dim=3)
        n_m, n_n = -(-self.seq_lengths[0] // block_m), -(-self.seq_lengths[1] // block_n)
        user = user[..., :n_m, :n_n]
        outer = predicate.classify(*self.seq_lengths, block_m, block_n, device=device)
        merged = (predicate & self.predicate).classify(*self.seq_lengths, block_m, block_n,
                                                       device=device)
        if element_states is not None:
            outer = torch.minimum(outer, element_states)
            merged = torch.minimum(merged, element_states)
        # the kernels apply one predicate (the merged one) in PARTIAL tiles: a FULL block that
        # the outer terms cut must not be cut by the mask's own predicate as well
        if not self.predicate.unbounded:
            own = self.predicate.classify(*self.seq_lengths, block_m, block_n, device=device)
            if ((user == FULL) & (outer == PARTIAL) & (own != FULL)).any():
                raise NotImplementedError(
                    "this BlockMask has FULL blocks that its own causal/window predicate would "
                    "cut, and attention's causal/window or attn_mask cuts them too; the kernels "
                    "apply one predicate per tile. Build the mask with the combined predicate "
                    "instead of passing both")
        state = torch.where(user == FULL, outer, torch.where(user == PARTIAL, merged, HIDDEN))
        state = state.to(torch.int8)
        if element_states is None:
            self._kernel_states[key] = state
        return state

    def kernel_schedule(self, forward_tile: tuple[int, int], dq_tile: tuple[int, int],
                        dkdv_tile: tuple[int, int], predicate: RelativePredicate,
                        num_heads: int) -> Schedule:
        """The kernels' schedule (every pass at its own tiles) for attention's `predicate`;
        cached, so a mask reused across steps is converted once."""
        key = (forward_tile, dq_tile, dkdv_tile, predicate, num_heads)
        if key not in self._kernel_schedules:
            self._kernel_schedules[key] = Schedule.build(
                lambda m, n: self.kernel_states(m, n, predicate), forward_tile, dq_tile,
                dkdv_tile, num_heads)
        return self._kernel_schedules[key]

    def to_flex(self):
        """torch.nn.attention.flex_attention.BlockMask with the same blocks. Its PARTIAL blocks
        get a mask_mod implementing this mask's causal/window predicate."""
        from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask

        seqlen_q, seqlen_k = self.seq_lengths
        left, right = self.predicate.left, self.predicate.right
        offset = seqlen_k - seqlen_q

        # an unbounded side becomes a bound no (query, key) pair can reach
        unreachable = seqlen_q + seqlen_k
        upper = right if right >= 0 else unreachable
        lower = -left if left >= 0 else -unreachable

        def mask_mod(b, h, q_idx, kv_idx):
            rel = kv_idx - q_idx - offset
            return (rel <= upper) & (rel >= lower)

        return FlexBlockMask.from_kv_blocks(
            self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices,
            BLOCK_SIZE=self.block_size, mask_mod=mask_mod, seq_lengths=self.seq_lengths)

    @classmethod
    def from_flex(cls, flex_mask, causal: bool = False, window=None) -> "BlockMask":
        """From a FlexAttention BlockMask. Its mask_mod cannot run in the kernels: state the
        predicate its PARTIAL blocks apply with `causal` / `window`."""
        return cls(flex_mask.kv_num_blocks, flex_mask.kv_indices, flex_mask.full_kv_num_blocks,
                   flex_mask.full_kv_indices, block_size=tuple(flex_mask.BLOCK_SIZE),
                   seq_lengths=tuple(flex_mask.seq_lengths), causal=causal, window=window)


def _check_lists(num_name: str, num: torch.Tensor, idx_name: str, idx: torch.Tensor) -> None:
    for name, t in ((num_name, num), (idx_name, idx)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 (or int64), got {t.dtype}")
    if num.dim() != 3 or idx.dim() != 4 or idx.shape[:3] != num.shape:
        raise ValueError(f"{num_name} must be (B|1, H|1, n_q_blocks) and {idx_name} "
                         f"(B|1, H|1, n_q_blocks, C), got {tuple(num.shape)} and {tuple(idx.shape)}")
