"""BlockMask: a block-level schedule in FlexAttention's BCSR layout plus the element predicate its
PARTIAL blocks apply.

Blocks are (BQ, BK) = `block_size`, any multiples of 16, independent of the kernel's tiles: the
kernels run it through `kernel_states`, which maps user blocks onto kernel tiles.
A block is FULL (every element visible, no predicate: FlexAttention's semantics), PARTIAL (the
predicate decides each element) or absent (hidden, never loaded). The predicate is relative to the
bottom-right aligned diagonal, like `attention`'s own: `causal` and/or `window=(left, right)`,
ANDed with an optional element bitmap per PARTIAL block (`element_bits`, what the predicate and
document / prefix / streaming builders produce). `attention(causal=, window=)` ANDs its own
predicate with all of it.
"""
from __future__ import annotations

from functools import cached_property

import torch

from ..kernels.schedule import BlockBits, Schedule
from ..predicate import (FULL, HIDDEN, PARTIAL, RelativePredicate, blocks_from_lists,
                         coarsen_states, common_heads, lists_from_blocks, transposed_lists)
from .evaluate import predicate_blocks


class BlockMask:
    """Block-sparse schedule.

    kv_num_blocks (B|1, H|1, n_q_blocks) int32 and kv_indices (B|1, H|1, n_q_blocks, C) int32 list
    the PARTIAL key blocks of each query block; full_kv_num_blocks / full_kv_indices the FULL ones
    (FlexAttention's fields). `block_size` = (BQ, BK), multiples of 16; `seq_lengths` = (Sq, Sk).
    PARTIAL blocks apply `causal` / `window` (see the module docstring) and, where
    `element_slots` (int32 (B|1, H|1, n_q_blocks, n_k_blocks)) names a slot s >= 0, the element
    bitmap `element_bits[s]` (bool (n_slots, BQ, BK), True = visible; rows / keys past Sq / Sk
    are ignored). Blocks may share a slot: builders store each distinct bitmap once.
    The transposed lists (q_num_blocks, q_indices, ...) are built once, on first use.
    """

    def __init__(self, kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor,
                 full_kv_num_blocks: torch.Tensor | None = None,
                 full_kv_indices: torch.Tensor | None = None, *,
                 block_size: int | tuple[int, int] = 128,
                 seq_lengths: tuple[int, int] | None = None,
                 causal: bool = False, window: tuple[int, int] | None = None,
                 element_bits: torch.Tensor | None = None,
                 element_slots: torch.Tensor | None = None):
        block_q, block_k = (block_size, block_size) if isinstance(block_size, int) else block_size
        for name, size in (("block_size[0]", block_q), ("block_size[1]", block_k)):
            if not isinstance(size, int) or size <= 0 or size % 16:
                got = size if isinstance(size, int) else type(size).__name__
                raise ValueError(f"{name} must be a positive multiple of 16, got {got}; the "
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
        self.element_bits, self.element_slots = self._checked_bits(element_bits, element_slots)
        self._kernel_states: dict[tuple, torch.Tensor] = {}
        self._kernel_schedules: dict[tuple, Schedule] = {}
        self._coarsened: dict[tuple[int, int], BlockMask] = {}

    @classmethod
    def from_states(cls, states: torch.Tensor, block_size, seq_lengths,
                    causal: bool = False, window=None, element_bits: torch.Tensor | None = None,
                    element_slots: torch.Tensor | None = None) -> "BlockMask":
        """From an int8 (B|1, H|1, n_q_blocks, n_k_blocks) picture of HIDDEN/PARTIAL/FULL."""
        kv_num, kv_idx = lists_from_blocks(states == PARTIAL)
        full_num, full_idx = lists_from_blocks(states == FULL)
        return cls(kv_num, kv_idx, full_num, full_idx, block_size=block_size,
                   seq_lengths=seq_lengths, causal=causal, window=window,
                   element_bits=element_bits, element_slots=element_slots)

    def _checked_bits(self, bits, slots):
        if bits is None and slots is None:
            return None, None
        if bits is None or slots is None:
            raise ValueError("element_bits and element_slots must be given together")
        block_q, block_k = self.block_size
        if not isinstance(bits, torch.Tensor) or bits.dim() != 3 or bits.shape[1:] != (
                block_q, block_k) or bits.shape[0] == 0:
            got = tuple(bits.shape) if isinstance(bits, torch.Tensor) else type(bits).__name__
            raise ValueError(f"element_bits must be (n_slots >= 1, {block_q}, {block_k}), got {got}")
        expected = (*self.kv_num_blocks.shape[:2], *self.n_blocks)
        if not isinstance(slots, torch.Tensor) or tuple(slots.shape) != expected:
            got = tuple(slots.shape) if isinstance(slots, torch.Tensor) else type(slots).__name__
            raise ValueError(f"element_slots must be {expected} (the lists' batch/head dims and "
                             f"the block grid), got {got}")
        bad_slot = (slots < -1) | (slots >= bits.shape[0])
        if bool(bad_slot.any()):
            at = tuple(int(i) for i in bad_slot.nonzero()[0])
            raise ValueError(f"element_slots must lie in [-1, {bits.shape[0]}) (-1: no bitmap); "
                             f"element_slots{list(at)} = {int(slots[at])}")
        # only PARTIAL blocks apply a bitmap: a FULL block cut by outer terms must not read one
        slots = torch.where(self.states == PARTIAL, slots.to(self.states.device), -1)
        return bits.to(torch.bool).contiguous(), slots.to(torch.int32).contiguous()

    @property
    def kernel_bits(self) -> BlockBits | None:
        """The element bitmaps as the kernels read them (None when there are none)."""
        if self.element_bits is None:
            return None
        return BlockBits(self.element_bits.view(torch.uint8), self.element_slots,
                         *self.block_size)

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

    @cached_property
    def has_partial_blocks(self) -> bool:
        """Whether any block is PARTIAL (what decides the kernels' tile shapes)."""
        return bool(self.kv_num_blocks.any())

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
        for num, idx, num_name, name in (
                (self.kv_num_blocks, self.kv_indices, "kv_num_blocks", "kv_indices"),
                (self.full_kv_num_blocks, self.full_kv_indices, "full_kv_num_blocks",
                 "full_kv_indices")):
            bad_count = (num < 0) | (num > idx.shape[-1])
            if bool(bad_count.any()):
                at = tuple(int(i) for i in bad_count.nonzero()[0])
                raise ValueError(f"{num_name}{list(at)} = {int(num[at])} is outside "
                                 f"[0, {idx.shape[-1]}] (the columns of {name})")
            listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
            bad_index = listed & ((idx < 0) | (idx >= n_k))
            if bool(bad_index.any()):
                at = tuple(int(i) for i in bad_index.nonzero()[0])
                raise ValueError(f"{name} lists a key block outside [0, {n_k}) for "
                                 f"Sk = {self.seq_lengths[1]} and block size "
                                 f"{self.block_size[1]}: {name}{list(at)} = {int(idx[at])}")

    def _partial_keep(self, b, h, q_idx, kv_idx) -> torch.Tensor:
        """What a PARTIAL block shows at these elements: the predicate AND its bitmap.
        Broadcastable int tensors; b / h are read at 0 where this mask broadcasts them."""
        keep = self.predicate.holds(q_idx, kv_idx, *self.seq_lengths)
        if self.element_bits is None:
            return keep
        block_q, block_k = self.block_size
        slots = self.element_slots
        slot = slots[b * (slots.shape[0] > 1), h * (slots.shape[1] > 1), q_idx // block_q,
                     kv_idx // block_k]
        bits = self.element_bits[slot.clamp(min=0), q_idx % block_q, kv_idx % block_k]
        return keep & ((slot < 0) | bits)

    def mask_mod(self, b, h, q_idx, kv_idx) -> torch.Tensor:
        """Element visibility as a FlexAttention-style mask_mod (broadcastable int tensors):
        FULL blocks, and PARTIAL blocks where the predicate and the bitmap hold."""
        block_q, block_k = self.block_size
        states = self.states
        state = states[b * (states.shape[0] > 1), h * (states.shape[1] > 1), q_idx // block_q,
                       kv_idx // block_k]
        return (state == FULL) | ((state == PARTIAL) & self._partial_keep(b, h, q_idx, kv_idx))

    def visible(self, q_idx: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
        """Bool (B|1, H|1, len(q_idx), Sk): which keys rows q_idx see under this mask. What the
        reference needs, one chunk of rows at a time (never all Sq x Sk)."""
        device = self.kv_indices.device
        batch, heads = self.kv_num_blocks.shape[:2]
        return self.mask_mod(torch.arange(batch, device=device)[:, None, None, None],
                             torch.arange(heads, device=device)[None, :, None, None],
                             q_idx.to(device)[:, None], torch.arange(seqlen_k, device=device))

    def coarsened(self, block_q: int, block_k: int) -> "BlockMask":
        """This mask at blocks (block_q, block_k), multiples of its own: a block mixing visible
        and hidden elements becomes PARTIAL with an element bitmap of what it shows (sub-blocks,
        predicate and bitmaps baked in). How kernel tiles larger than the user blocks get a
        block-granular predicate. Cached."""
        key = (block_q, block_k)
        if key not in self._coarsened:
            rows, cols = block_q // self.block_size[0], block_k // self.block_size[1]
            # exact where every sub-block is FULL or every one hidden; the rest is evaluated
            hint = coarsen_states(self.states, rows, cols)
            states, bitmaps, slots = predicate_blocks(
                self.mask_mod, *self.kv_num_blocks.shape[:2], *self.seq_lengths, key,
                self.kv_indices.device, block_states=hint)
            self._coarsened[key] = BlockMask.from_states(states, key, self.seq_lengths,
                                                         element_bits=bitmaps,
                                                         element_slots=slots)
        return self._coarsened[key]

    def sequence(self, batch: int, seqlen_q: int, seqlen_k: int) -> "BlockMask":
        """The mask of packed sequence `batch` on its own lengths (its first blocks): how the
        reference applies a varlen block mask one sequence at a time."""
        n_q, n_k = -(-seqlen_q // self.block_size[0]), -(-seqlen_k // self.block_size[1])
        b = min(batch, self.kv_num_blocks.shape[0] - 1)
        states = self.states[b:b + 1, :, :n_q, :n_k]
        slots = None if self.element_slots is None else self.element_slots[b:b + 1, :, :n_q, :n_k]
        left, right = self.predicate.left, self.predicate.right
        return BlockMask.from_states(states, self.block_size, (seqlen_q, seqlen_k),
                                     window=(left, right), element_bits=self.element_bits,
                                     element_slots=slots)

    def _bit_tile_states(self, block_m: int, block_n: int) -> torch.Tensor:
        """int8 (B|1, H|1, n_q_tiles, n_k_tiles) states of the element bitmaps at kernel tiles
        (block_m, block_n): FULL where a tile's bitmap is all True or its block has none."""
        block_q, block_k = self.block_size
        rows, cols = block_q // block_m, block_k // block_n
        tiles = self.element_bits.view(-1, rows, block_m, cols, block_n)
        every = tiles.all(4).all(2)
        some = tiles.any(4).any(2)
        per_slot = torch.where(every, FULL, torch.where(some, PARTIAL, HIDDEN)).to(torch.int8)
        slots = self.element_slots.repeat_interleave(rows, 2).repeat_interleave(cols, 3).long()
        tile_q = torch.arange(slots.shape[2], device=slots.device)[:, None] % rows
        tile_k = torch.arange(slots.shape[3], device=slots.device)[None, :] % cols
        by_bits = per_slot[slots.clamp(min=0), tile_q, tile_k]
        return torch.where(slots < 0, FULL, by_bits).to(torch.int8)

    def kernel_states(self, block_m: int, block_n: int, predicate: RelativePredicate,
                      element_states: torch.Tensor | None = None,
                      lengths: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """int8 (B|1, Hs, n_q_tiles, n_k_tiles) states at kernel tiles (block_m, block_n) that
        divide the user blocks, for attention's own `predicate` (and element tile states
        (B|1, He, ...), He dividing H) ANDed with this mask's; Hs: this mask's heads (1 or H), or
        He where it has one head. A tile is FULL when its user block is FULL and the
        outer terms hold on the whole tile, or its user block is PARTIAL and everything holds on
        it; HIDDEN when anything hides it; PARTIAL otherwise. Without element states the result
        is cached: a mask reused across steps (and by the backward pass) is converted once.
        lengths: (B,) query / key lengths of packed sequences, whose predicates are classified
        on each sequence's own diagonal (not cached)."""
        key = (block_m, block_n, predicate)
        cacheable = element_states is None and lengths is None
        if cacheable and key in self._kernel_states:
            return self._kernel_states[key]
        block_q, block_k = self.block_size
        if block_q % block_m or block_k % block_n:
            raise ValueError(f"kernel tiles ({block_m}, {block_n}) must divide the mask's "
                             f"blocks {self.block_size}")
        device = self.kv_indices.device
        user = self.states
        if element_states is not None:  # per KV head (Hk) against this mask's H heads
            user, element_states = common_heads(user, element_states)
        user = user.repeat_interleave(block_q // block_m, dim=2)
        user = user.repeat_interleave(block_k // block_n, dim=3)
        n_m, n_n = -(-self.seq_lengths[0] // block_m), -(-self.seq_lengths[1] // block_n)
        user = user[..., :n_m, :n_n]

        def classify(pred: RelativePredicate) -> torch.Tensor:
            state = pred.classify(*self.seq_lengths, block_m, block_n, device=device,
                                  lengths=lengths)
            return state if lengths is None else state[:, None]  # (B, 1, n_m, n_n)

        outer = classify(predicate)
        merged = classify(predicate & self.predicate)
        if self.element_bits is not None:
            merged = torch.minimum(merged, self._bit_tile_states(block_m, block_n)[..., :n_m, :n_n])
        if element_states is not None:
            outer = torch.minimum(outer, element_states)
            merged = torch.minimum(merged, element_states)
        # the kernels apply one predicate (the merged one) in PARTIAL tiles: a FULL block that
        # the outer terms cut must not be cut by the mask's own predicate as well
        if not self.predicate.unbounded:
            own = classify(self.predicate)
            if ((user == FULL) & (outer == PARTIAL) & (own != FULL)).any():
                raise NotImplementedError(
                    "this BlockMask has FULL blocks that its own causal/window predicate would "
                    "cut, and attention's causal/window or attn_mask cuts them too; the kernels "
                    "apply one predicate per tile. Build the mask with the combined predicate "
                    "instead of passing both")
        state = torch.where(user == FULL, outer, torch.where(user == PARTIAL, merged, HIDDEN))
        state = state.to(torch.int8)
        if cacheable:
            self._kernel_states[key] = state
        return state

    def kernel_schedule(self, forward_tile: tuple[int, int], dq_tile: tuple[int, int],
                        dkdv_tile: tuple[int, int], predicate: RelativePredicate) -> Schedule:
        """The kernels' schedule (every pass at its own tiles, lists at this mask's heads) for
        attention's `predicate`; cached, so a mask reused across steps is converted once."""
        key = (forward_tile, dq_tile, dkdv_tile, predicate)
        if key not in self._kernel_schedules:
            self._kernel_schedules[key] = Schedule.build(
                lambda m, n: self.kernel_states(m, n, predicate), forward_tile, dq_tile,
                dkdv_tile, self.kernel_bits)
        return self._kernel_schedules[key]

    def to_flex(self):
        """torch.nn.attention.flex_attention.BlockMask with the same blocks. Its PARTIAL blocks
        get a mask_mod implementing this mask's causal/window predicate and element bitmaps."""
        from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask

        return FlexBlockMask.from_kv_blocks(
            self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices,
            BLOCK_SIZE=self.block_size, mask_mod=self._partial_keep, seq_lengths=self.seq_lengths)

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
