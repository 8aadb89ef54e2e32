"""Schedules: which key tiles each query tile visits (and, transposed, which query tiles each key
tile visits), split into PARTIAL tiles (predicate applied) and FULL tiles (no predicate).

Dense, causal and sliding-window schedules are implicit: the kernels derive tile ranges from
(Sq, Sk, window) and read no metadata. Every other mask becomes an explicit BCSR `Schedule`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..predicate import FULL, PARTIAL, RelativePredicate, lists_from_blocks
from .sequences import broadcast_strides, placeholder

@dataclass(frozen=True)
class KernelArgs:
    """Scalar arguments shared by every kernel launch of one attention call."""

    softmax_scale: float
    softcap: float
    window_left: int  # -1 = unbounded
    window_right: int  # -1 = unbounded; causal is 0

    @staticmethod
    def make(head_dim: int, causal: bool, window, softmax_scale, softcap) -> "KernelArgs":
        predicate = RelativePredicate.make(causal, window)
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        return KernelArgs(float(scale), float(softcap), int(predicate.left), int(predicate.right))

    @staticmethod
    def dot_precision(dtype: torch.dtype) -> str:
        # fp32 inputs get exact IEEE products; fp16/bf16 products are exact on tensor cores anyway
        return "ieee" if dtype == torch.float32 else "tf32"

    @property
    def has_left(self) -> bool:
        return self.window_left >= 0

    @property
    def has_right(self) -> bool:
        return self.window_right >= 0

    @property
    def later_rows_see_more(self) -> bool:
        """A right bound without a left one (causal): every row sees the keys of the row before
        it and more, so the last query tiles and the first key tiles of an implicit schedule
        carry the most work (the kernels launch those first)."""
        return self.has_right and not self.has_left

    @property
    def masked(self) -> bool:
        """Causal or windowed: some tiles are PARTIAL, which changes the best tile shape."""
        return self.has_left or self.has_right

    @property
    def qk_scale_log2(self) -> float:
        return self.softmax_scale * math.log2(math.e)

    @property
    def softcap_inv_scaled(self) -> float:
        return self.softmax_scale / self.softcap if self.softcap > 0 else 0.0

    @property
    def softcap_log2(self) -> float:
        return self.softcap * math.log2(math.e)


def list_head_div(num_heads: int, list_heads: int) -> int:
    """What a query head is divided by to give its list head: H / Hl, and 1 for one list head
    (stride 0 then): Triton compiles an integer argument of 1 as a constant, so calls whose
    lists have H heads or one keep the code they had before lists could have fewer."""
    if list_heads == 0 or num_heads % list_heads:
        raise ValueError(f"lists with {list_heads} heads for {num_heads} query heads: their "
                         f"head count must divide the query heads'")
    return 1 if list_heads == 1 else num_heads // list_heads


@dataclass
class TileLists:
    """BCSR lists at one tile size (block_m query rows x block_n keys): per row tile, the PARTIAL
    column tiles (num_blocks, indices) then the FULL ones. Rows are query tiles for the forward
    and dQ passes and key tiles (transposed lists) for dK/dV. Leading dims (B|1, Hl, n_rows), Hl
    the head count of the tile states they came from (1, Hk, H or another divisor of H): query
    head h walks list head h // (H / Hl), so the heads of a KV group may share one list.
    num_warps / num_stages: the launch the tiles were chosen with (0: the launcher's default)."""

    block_m: int
    block_n: int
    num_blocks: torch.Tensor
    indices: torch.Tensor
    full_num_blocks: torch.Tensor
    full_indices: torch.Tensor
    num_warps: int = 0
    num_stages: int = 0

    @staticmethod
    def from_states(states: torch.Tensor, block_m: int, block_n: int,
                    transposed: bool = False) -> "TileLists":
        """From int8 (B|1, H|1, n_q_tiles, n_k_tiles) HIDDEN/PARTIAL/FULL states."""
        if transposed:
            states = states.transpose(-1, -2)
        return TileLists(block_m, block_n, *lists_from_blocks(states == PARTIAL),
                         *lists_from_blocks(states == FULL))

    def tensors(self) -> list[torch.Tensor]:
        return [self.num_blocks, self.indices, self.full_num_blocks, self.full_indices]

    def operands(self, num_heads: int) -> tuple:
        """Kernel operands for a call of num_heads query heads: 4 tensors, then the (b, h, row)
        strides of each, broadcasts (batch or heads of size 1) as stride 0, then the list head
        divisor (`list_head_div`)."""
        return (self.num_blocks, self.indices, self.full_num_blocks, self.full_indices,
                *broadcast_strides(self.num_blocks), *broadcast_strides(self.indices)[:3],
                *broadcast_strides(self.full_num_blocks),
                *broadcast_strides(self.full_indices)[:3],
                list_head_div(num_heads, self.num_blocks.shape[1]))

    @staticmethod
    def placeholder_operands(device: torch.device) -> tuple:
        """Operands for implicit schedules: never read by the kernels."""
        dummy = placeholder(device)
        return (dummy, dummy, dummy, dummy) + (0,) * 12 + (1,)


@dataclass(frozen=True)
class BlockBits:
    """Element bitmaps of a block mask's PARTIAL blocks, ANDed into the predicate of PARTIAL
    tiles: bits uint8 (n_slots, block_q, block_k), nonzero = visible; slots int32
    (B|1, H|1, n_q_blocks, n_k_blocks), the bitmap of each user block (-1: none, all visible).
    Every kernel tile lies inside one user block, so a tile reads one slot."""

    bits: torch.Tensor
    slots: torch.Tensor
    block_q: int
    block_k: int

    def operands(self) -> tuple:
        """Kernel operands: slots, its (b, h, q block, k block) strides in one tuple (broadcasts
        0), bits."""
        return (self.slots, broadcast_strides(self.slots), self.bits)

    @staticmethod
    def placeholder_operands(device: torch.device) -> tuple:
        return (placeholder(device), (0, 0, 0, 0), placeholder(device, torch.uint8))

    @staticmethod
    def kernel_form(bits: "BlockBits | None") -> tuple[bool, int, int]:
        """The Triton kernels' BITS_FORM for optional bitmaps: (given, user block rows, columns),
        the user block 1x1 without."""
        return (bits is not None, bits.block_q if bits is not None else 1,
                bits.block_k if bits is not None else 1)


@dataclass
class Schedule:
    """Explicit schedule for one attention call: the lists each pass walks, at its own tiles.

    forward: key tiles per query tile at the forward tile; dq: the same at the dQ tile
    (block_m2, block_n2); dkdv: query tiles per key tile at the dK/dV tile (block_m1, block_n1).
    bits: element bitmaps of the block mask's PARTIAL blocks, if it has any.
    """

    forward: TileLists
    dq: TileLists
    dkdv: TileLists
    bits: BlockBits | None = None

    @staticmethod
    def build(states_at, forward_tile: tuple[int, int], dq_tile: tuple[int, int],
              dkdv_tile: tuple[int, int], bits: BlockBits | None = None) -> "Schedule":
        """states_at(block_m, block_n) -> int8 (B|1, Hs, n_q_tiles, n_k_tiles) with Hs dividing
        H, which the lists keep (TileLists); states of one tile size are computed once even if
        two passes share it."""
        cache: dict[tuple[int, int], torch.Tensor] = {}

        def states(tile):
            if tile not in cache:
                cache[tile] = states_at(*tile)
            return cache[tile]

        return Schedule(TileLists.from_states(states(forward_tile), *forward_tile),
                        TileLists.from_states(states(dq_tile), *dq_tile),
                        TileLists.from_states(states(dkdv_tile), *dkdv_tile, transposed=True),
                        bits)

    @staticmethod
    def forward_only(forward: TileLists, bits: BlockBits | None = None) -> "Schedule":
        """For a call no gradient flows through: the backward passes' lists are not built (two
        list-builder launches less per call); their slots hold the forward's, never walked."""
        return Schedule(forward, forward, forward, bits)

    @staticmethod
    def from_blocks(block_m: int, block_n: int, partial: torch.Tensor,
                    full: torch.Tensor | None = None) -> "Schedule":
        """One tile size for every pass, from dense bool block pictures (B|1, H|1, nQ, nK)."""
        states = partial.to(torch.int8) * PARTIAL
        if full is not None:
            states = torch.where(full, FULL, states).to(torch.int8)
        lists = TileLists.from_states(states, block_m, block_n)
        return Schedule(lists, lists, TileLists.from_states(states, block_m, block_n, True))

    def launched_with(self, forward: tuple[int, int], backward: tuple[int, int]) -> "Schedule":
        """The same lists with the (num_warps, num_stages) of the forward and backward launches."""
        def launch(lists: TileLists, config: tuple[int, int]) -> TileLists:
            # not dataclasses.replace: 10 us of host time each
            return TileLists(lists.block_m, lists.block_n, lists.num_blocks, lists.indices,
                             lists.full_num_blocks, lists.full_indices, *config)
        return Schedule(launch(self.forward, forward), launch(self.dq, backward),
                        launch(self.dkdv, backward), self.bits)

    def tensors(self) -> list[torch.Tensor]:
        bits = [self.bits.bits, self.bits.slots] if self.bits is not None else []
        return self.forward.tensors() + self.dq.tensors() + self.dkdv.tensors() + bits

    def tiles(self) -> list[int]:
        """(block_m, block_n, num_warps, num_stages) of each pass, flattened; then the user
        block of the bitmaps, if any."""
        bits = [self.bits.block_q, self.bits.block_k] if self.bits is not None else []
        return [n for lists in (self.forward, self.dq, self.dkdv)
                for n in (lists.block_m, lists.block_n, lists.num_warps, lists.num_stages)] + bits

    @staticmethod
    def from_parts(tensors: list[torch.Tensor], tiles: list[int]) -> "Schedule":
        """Inverse of (tensors(), tiles()): how a schedule crosses the custom-op boundary."""
        parts = [TileLists(*tiles[4 * i: 4 * i + 2], *tensors[4 * i: 4 * i + 4],
                           *tiles[4 * i + 2: 4 * i + 4]) for i in range(3)]
        bits = BlockBits(*tensors[12:14], *tiles[12:14]) if len(tensors) > 12 else None
        return Schedule(*parts, bits)
