"""The element mask and the bias as the kernels read them (stride-0 broadcasts, never expanded),
and the pre-pass that turns the mask into tile states for the schedule."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import implicit_kv_range
from .schedule import FULL, HIDDEN, PARTIAL, KernelArgs

_HIDDEN, _PARTIAL, _FULL = tl.constexpr(HIDDEN), tl.constexpr(PARTIAL), tl.constexpr(FULL)


@dataclass(frozen=True)
class Elementwise:
    """A (B|1, Hm, Sq|1, Sk|1) mask or bias, Hm in {1, Hk, H}: query head h reads head
    h // head_div; size-1 dims have stride 0 (rows_shared: one row for every query, cols_shared:
    one column for every key)."""

    tensor: torch.Tensor
    strides: tuple[int, int, int, int]
    head_div: int

    @staticmethod
    def of(t: torch.Tensor, num_heads: int) -> "Elementwise":
        if t.dtype == torch.bool:
            t = t.view(torch.uint8)  # same bytes; the kernels test != 0
        strides = tuple(0 if size == 1 else stride for size, stride in zip(t.shape, t.stride()))
        return Elementwise(t, strides, num_heads // t.shape[1])

    @property
    def rows_shared(self) -> bool:
        return self.tensor.shape[2] == 1

    @property
    def cols_shared(self) -> bool:
        return self.tensor.shape[3] == 1

    def operands(self) -> tuple:
        return (self.tensor, *self.strides, self.head_div)

    @staticmethod
    def placeholder_operands(device: torch.device) -> tuple:
        return (torch.zeros(1, dtype=torch.float32, device=device), 0, 0, 0, 0, 1)


@triton.jit
def _mask_states_kernel(
    Mask, States, stride_mb, stride_mh, stride_mm, stride_mn,
    stride_sb, stride_sh, stride_sm, seqlen_q, seqlen_k, mask_rows, mask_cols, num_heads,
    diag_offset, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, ROWS_SHARED: tl.constexpr, COLS_SHARED: tl.constexpr,
):
    """State of one (mask batch, mask head, query tile, key tile): HIDDEN if no element is kept,
    FULL if all in-bounds ones are, else PARTIAL. Tiles the predicate hides are not read."""
    tile_n = tl.program_id(0)
    tile_m = tl.program_id(1)
    off_b = tl.program_id(2) // num_heads
    off_h = tl.program_id(2) % num_heads
    start_m = tile_m * BLOCK_M
    start_n = tile_n * BLOCK_N
    state_ptr = States + off_b * stride_sb + off_h * stride_sh + tile_m * stride_sm + tile_n
    if not ROWS_SHARED and not COLS_SHARED:
        lo, _, _, hi = implicit_kv_range(start_m, seqlen_q, seqlen_k, diag_offset, window_left,
                                         window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        if (tile_n < lo) | (tile_n >= hi):
            tl.store(state_ptr, _HIDDEN)
            return
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    base = Mask + off_b.to(tl.int64) * stride_mb + off_h.to(tl.int64) * stride_mh \
        + start_m.to(tl.int64) * stride_mm + start_n.to(tl.int64) * stride_mn
    rows_left = mask_rows - start_m
    cols_left = mask_cols - start_n
    inside = (offs_m[:, None] < rows_left) & (offs_n[None, :] < cols_left)  # [BM, BN]
    keep = tl.load(base + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn, mask=inside,
                   other=0) != 0
    n_kept = tl.sum(tl.sum(keep.to(tl.int32), 1), 0)
    n_inside = tl.sum(tl.sum(inside.to(tl.int32), 1), 0)
    state = tl.where(n_kept == 0, _HIDDEN, tl.where(n_kept == n_inside, _FULL, _PARTIAL))
    tl.store(state_ptr, state.to(tl.int8))


def mask_tile_states(mask: Elementwise, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int,
                     args: KernelArgs) -> torch.Tensor:
    """int8 (B|1, Hm, n_q_tiles | 1, n_k_tiles | 1) states of the mask at (block_m, block_n)
    tiles: one read of the mask, skipping the tiles causal/window already hide (when the mask
    spans both Sq and Sk). A dim the mask broadcasts keeps size 1."""
    t = mask.tensor
    batch, heads, rows, cols = t.shape
    n_m, n_n = triton.cdiv(rows, block_m), triton.cdiv(cols, block_n)
    states = torch.empty((batch, heads, n_m, n_n), dtype=torch.int8, device=t.device)
    _mask_states_kernel[(n_n, n_m, batch * heads)](
        t, states, *mask.strides, *states.stride()[:3], seqlen_q, seqlen_k, rows, cols, heads,
        seqlen_k - seqlen_q, args.window_left, args.window_right,
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_LEFT=args.has_left, HAS_RIGHT=args.has_right,
        ROWS_SHARED=mask.rows_shared, COLS_SHARED=mask.cols_shared,
    )
    return states
