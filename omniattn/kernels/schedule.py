"""Schedules: which key tiles each query tile visits (and, transposed, which query tiles each key
tile visits), split into PARTIAL tiles (predicate applied) and FULL tiles (no predicate).

Dense, causal and sliding-window schedules are implicit: the kernels derive tile ranges from
(Sq, Sk, window) and read no metadata. Every other mask becomes an explicit BCSR `Schedule`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


HIDDEN, PARTIAL, FULL = 0, 1, 2  # tile / block states


@dataclass(frozen=True)
class RelativePredicate:
    """Key j visible to query i iff -left <= j - i - (Sk - Sq) <= right; -1 = unbounded."""

    left: int = -1
    right: int = -1

    @staticmethod
    def make(causal: bool = False, window: tuple[int, int] | None = None) -> "RelativePredicate":
        left, right = window if window is not None else (-1, -1)
        if causal:
            right = 0 if right < 0 else min(right, 0)
        return RelativePredicate(left, right)

    def __and__(self, other: "RelativePredicate") -> "RelativePredicate":
        def tighter(a, b):
            return b if a < 0 else a if b < 0 else min(a, b)
        return RelativePredicate(tighter(self.left, other.left), tighter(self.right, other.right))

    def visible(self, q_idx: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor | None:
        """Bool [len(q_idx), Sk]: which keys rows q_idx may see; None when all of them."""
        if self.unbounded:
            return None
        k_idx = torch.arange(seqlen_k, device=q_idx.device)
        rel = k_idx[None, :] - q_idx[:, None] - (seqlen_k - seqlen_q)
        visible = torch.ones_like(rel, dtype=torch.bool)
        if self.right >= 0:
            visible &= rel <= self.right
        if self.left >= 0:
            visible &= rel >= -self.left
        return visible

    @property
    def unbounded(self) -> bool:
        return self.left < 0 and self.right < 0

    def classify(self, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int,
                 device=None) -> torch.Tensor:
        """int8 (n_q_blocks, n_k_blocks): HIDDEN / PARTIAL / FULL of each block under this
        predicate, blocks clipped to (Sq, Sk). O(blocks) work and memory."""
        n_m, n_n = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
        first_q = torch.arange(n_m, device=device) * block_m
        last_q = torch.clamp(first_q + block_m, max=seqlen_q) - 1
        first_k = torch.arange(n_n, device=device) * block_n
        last_k = torch.clamp(first_k + block_n, max=seqlen_k) - 1
        offset = seqlen_k - seqlen_q
        # extreme offsets from the diagonal inside each block: [n_m, n_n]
        rel_min = first_k[None, :] - last_q[:, None] - offset
        rel_max = last_k[None, :] - first_q[:, None] - offset
        full = torch.ones(n_m, n_n, dtype=torch.bool, device=device)
        hidden = torch.zeros(n_m, n_n, dtype=torch.bool, device=device)
        if self.right >= 0:
            full &= rel_max <= self.right
            hidden |= rel_min > self.right
        if self.left >= 0:
            full &= rel_min >= -self.left
            hidden |= rel_max < -self.left
        state = torch.full((n_m, n_n), PARTIAL, dtype=torch.int8, device=device)
        state[full] = FULL
        state[hidden] = HIDDEN
        return state


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


def blocks_from_lists(num_blocks: torch.Tensor, indices: torch.Tensor, n_cols: int,
                      values: torch.Tensor | None = None) -> torch.Tensor:
    """(..., R) counts + (..., R, C) indices -> dense (..., R, n_cols) block picture: bool (True
    where listed), or `values` (..., R, C) scattered to the listed columns (0 elsewhere)."""
    listed = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None].long()
    # unlisted slots scatter into a spare column that is dropped
    target = torch.where(listed, indices.long(), n_cols)
    dtype = torch.bool if values is None else values.dtype
    blocks = torch.zeros(*num_blocks.shape, n_cols + 1, dtype=dtype, device=indices.device)
    if values is None:
        blocks.scatter_(-1, target, True)
    else:
        blocks.scatter_(-1, target, values.expand_as(target))
    return blocks[..., :n_cols]


def lists_from_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dense bool (..., R, C) -> int32 counts (..., R) and indices (..., R, C), listed ones first."""
    num_blocks = blocks.sum(-1, dtype=torch.int32)
    # stable sort of "not listed" puts the listed columns first, in increasing order
    indices = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num_blocks, indices.contiguous()


def transposed_lists(partial: torch.Tensor, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(num, indices) of PARTIAL then of FULL blocks per key column: the lists dK/dV walk."""
    return (*lists_from_blocks(partial.transpose(-1, -2)),
            *lists_from_blocks(full.transpose(-1, -2)))


@dataclass
class Schedule:
    """Explicit BCSR schedule at the kernel's tile size (block_m, block_n).

    kv_num_blocks (B|1, H|1, n_q_tiles) int32 and kv_indices (B|1, H|1, n_q_tiles, C) int32 list
    the PARTIAL key tiles of each query tile; full_kv_* the FULL ones (FlexAttention's layout).
    q_* / full_q_* are the transposed lists (per key tile, which query tiles) used by dK/dV.
    """

    block_m: int
    block_n: int
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    q_num_blocks: torch.Tensor
    q_indices: torch.Tensor
    full_q_num_blocks: torch.Tensor
    full_q_indices: torch.Tensor

    @staticmethod
    def from_kv_lists(block_m: int, block_n: int, n_tiles_k: int, kv_num_blocks, kv_indices,
                      full_kv_num_blocks=None, full_kv_indices=None) -> "Schedule":
        """Build a schedule (with its transposed lists) from the query-side lists."""
        if full_kv_num_blocks is None:
            full_kv_num_blocks = torch.zeros_like(kv_num_blocks)
            full_kv_indices = torch.zeros_like(kv_indices[..., :1])
        partial = blocks_from_lists(kv_num_blocks, kv_indices, n_tiles_k)
        full = blocks_from_lists(full_kv_num_blocks, full_kv_indices, n_tiles_k)
        return Schedule(block_m, block_n, kv_num_blocks.int(), kv_indices.int().contiguous(),
                        full_kv_num_blocks.int(), full_kv_indices.int().contiguous(),
                        *transposed_lists(partial, full))

    @staticmethod
    def from_blocks(block_m: int, block_n: int, partial: torch.Tensor,
                    full: torch.Tensor | None = None) -> "Schedule":
        """Build from dense bool block pictures (B|1, H|1, n_q_tiles, n_k_tiles)."""
        if full is None:
            full = torch.zeros_like(partial)
        return Schedule(block_m, block_n, *lists_from_blocks(partial), *lists_from_blocks(full),
                        *transposed_lists(partial, full))

    @staticmethod
    def _operands(num_blocks, indices, batch, heads, n_rows):
        num = num_blocks.expand(batch, heads, n_rows)
        idx = indices.expand(batch, heads, n_rows, indices.shape[-1])
        return (num, idx), (*num.stride(), *idx.stride()[:3])

    def _pair(self, num_a, idx_a, num_b, idx_b, batch, heads, n_rows):
        (na, ia), sa = self._operands(num_a, idx_a, batch, heads, n_rows)
        (nb, ib), sb = self._operands(num_b, idx_b, batch, heads, n_rows)
        return (na, ia, nb, ib, *sa, *sb)

    def forward_operands(self, batch: int, heads: int, n_tiles_m: int) -> tuple:
        """Kernel operands: 4 tensors then the (b, h, row) strides of each, broadcasts as stride 0."""
        return self._pair(self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks,
                          self.full_kv_indices, batch, heads, n_tiles_m)

    def transposed_operands(self, batch: int, heads: int, n_tiles_n: int) -> tuple:
        return self._pair(self.q_num_blocks, self.q_indices, self.full_q_num_blocks,
                          self.full_q_indices, batch, heads, n_tiles_n)

    @staticmethod
    def placeholder_operands(device: torch.device) -> tuple:
        """Operands for implicit schedules: never read by the kernels."""
        dummy = torch.zeros(1, dtype=torch.int32, device=device)
        return (dummy, dummy, dummy, dummy) + (0,) * 12
