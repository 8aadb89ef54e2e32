"""The element mask and the bias as the kernels read them (stride-0 broadcasts, never expanded),
and the pre-pass that turns the mask into tile states for the schedule."""
from __future__ import annotations

from dataclasses import dataclass
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..predicate import FULL, HIDDEN, PARTIAL, order_keys
from ..runtime.launch import launch
from .common import implicit_kv_range, implicit_q_range, sequence_bounds
from .schedule import KernelArgs, Schedule, TileLists
from .sequences import PackedSequences, broadcast_strides, packed_operands, placeholder
from .sizes import cdiv, next_power_of_2

_HIDDEN, _PARTIAL, _FULL = tl.constexpr(HIDDEN), tl.constexpr(PARTIAL), tl.constexpr(FULL)


@dataclass(frozen=True)
class Elementwise:
    """A (B|1, Hm, Sq|1, Sk|1) mask or bias, Hm in {1, Hk, H}: query head h reads head
    h // head_div; size-1 dims have stride 0 (rows_shared: one row for every query, cols_shared:
    one column for every key). Packed (varlen) ones, (total_q|1, Hm, max_seqlen_k|1), are held
    as the view (1, Hm, total_q|1, max_seqlen_k|1): the kernels offset rows by each sequence's
    first row, and columns count from its first key."""

    tensor: torch.Tensor
    strides: tuple[int, int, int, int]
    head_div: int
    packed: bool = False

    @staticmethod
    def of(t: torch.Tensor, num_heads: int) -> "Elementwise":
        packed = t.dim() == 3
        if packed:
            t = t.permute(1, 0, 2).unsqueeze(0)
        if t.dtype == torch.bool:
            t = t.view(torch.uint8)  # same bytes; the kernels test != 0
        return Elementwise(t, broadcast_strides(t), num_heads // t.shape[1], packed)

    def unpacked(self, grad: torch.Tensor) -> torch.Tensor:
        """A (1, Hm, rows, cols) gradient in the caller's layout: packed ones back to
        (rows, Hm, cols)."""
        return grad[0].permute(1, 0, 2).contiguous() if self.packed else grad

    @property
    def rows_shared(self) -> bool:
        return self.tensor.shape[2] == 1

    @property
    def cols_shared(self) -> bool:
        return self.tensor.shape[3] == 1

    @property
    def spans_queries_and_keys(self) -> bool:
        return not (self.rows_shared or self.cols_shared)

    @staticmethod
    def spans_both(t: torch.Tensor) -> bool:
        """`spans_queries_and_keys` of a caller's mask or bias, without building it."""
        rows = t.shape[0] if t.dim() == 3 else t.shape[2]
        return rows != 1 and t.shape[-1] != 1

    def operands(self) -> tuple:
        return (self.tensor, *self.strides, self.head_div)

    @staticmethod
    def placeholder_operands(device: torch.device) -> tuple:
        return (placeholder(device, torch.float32), 0, 0, 0, 0, 1)

    @staticmethod
    def form(e: "Elementwise | None") -> tuple[bool, bool, bool]:
        """(given, rows shared, columns shared): the Triton kernels' MASK_FORM / BIAS_FORM."""
        return (e is not None, e is not None and e.rows_shared, e is not None and e.cols_shared)

    @staticmethod
    def kernel_flags(mask: "Elementwise | None", bias: "Elementwise | None") -> dict:
        """The attention kernels' constexprs for an optional mask and bias."""
        return dict(HAS_MASK=mask is not None,
                    MASK_ROWS_SHARED=mask is not None and mask.rows_shared,
                    MASK_COLS_SHARED=mask is not None and mask.cols_shared,
                    HAS_BIAS=bias is not None,
                    BIAS_ROWS_SHARED=bias is not None and bias.rows_shared,
                    BIAS_COLS_SHARED=bias is not None and bias.cols_shared)


@dataclass(frozen=True)
class TopkTerm:
    """The top-k term of a call's predicate as the kernels read it: the scores the rows select by
    (laid out like a bias) and the rows' threshold pairs (predicate.RowThresholds), int32
    (2, B, Hs, Sq|1) (packed: (2, 1, Hs, total_q)): [0] thresholds, [1] last ties; query head h
    reads pair head h // (H / Hs)."""

    scores: Elementwise
    pairs: torch.Tensor

    def operands(self, num_heads: int) -> tuple:
        """scores, pairs, then one tuple: the scores' (batch, head, row, column) strides and head
        divisor, the pairs' (pair, batch, head, row) strides (broadcasts 0) and head divisor."""
        return (self.scores.tensor, self.pairs, (*self.scores.strides, self.scores.head_div,
                                                 *broadcast_strides(self.pairs),
                                                 num_heads // self.pairs.shape[2]))

    @staticmethod
    def placeholder_operands(device: torch.device) -> tuple:
        return (placeholder(device, torch.float32), placeholder(device), (0, 0, 0, 0, 1) * 2)

    @staticmethod
    def form(term: "TopkTerm | None") -> tuple[bool, bool, bool]:
        """(given, scores' rows shared, scores' columns shared): the Triton kernels' TOPK_FORM."""
        return Elementwise.form(term.scores if term is not None else None)


@triton.jit
def _tile_states(
    Mask, States, stride_mb, stride_mh, stride_mm, stride_mn,
    stride_sb, stride_sh, stride_sm, seqlen_q, seqlen_k, mask_rows, mask_cols, n_cols, num_heads,
    diag_offset, window_left, window_right, CuSeqlensQ, CuSeqlensK, tile_group, bh, tile_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, ROWS_SHARED: tl.constexpr, COLS_SHARED: tl.constexpr,
    VARLEN: tl.constexpr, TILES_PER_PROGRAM: tl.constexpr, EVEN: tl.constexpr,
    CHUNK_M: tl.constexpr,
):
    """States of TILES_PER_PROGRAM neighbouring tiles of one (mask batch, mask head, query
    tile): HIDDEN if no element is kept, FULL if all in-bounds ones are, else PARTIAL. Tiles
    that causal/window hide are HIDDEN without a read. The program reads CHUNK_M rows of all its
    tiles at a time (one load of CHUNK_M x TILES_PER_PROGRAM * BLOCK_N elements), and a tile only
    until it has shown a kept and a dropped element: PARTIAL is then certain (a top-k mask
    keeping a quarter of the keys shows both in its first chunk; HIDDEN and FULL tiles are read
    whole). VARLEN: batch = packed sequence, tiles count from its first row and key, elements
    past its lengths are out of bounds. EVEN: every tile lies inside the mask. The program is
    the tile_group-th group of tiles of query tile tile_m of mask batch x head bh."""
    off_b = bh // num_heads
    off_h = bh % num_heads
    first_q, seqlen_q, _, seqlen_k = sequence_bounds(CuSeqlensQ, CuSeqlensK, off_b, seqlen_q,
                                                     seqlen_k, VARLEN)
    if VARLEN:
        diag_offset = seqlen_k - seqlen_q
        if not ROWS_SHARED:
            mask_rows = seqlen_q
        if not COLS_SHARED:
            mask_cols = tl.minimum(mask_cols, seqlen_k)
    start_m = tile_m * BLOCK_M
    lo = 0
    hi = n_cols
    if not ROWS_SHARED and not COLS_SHARED:
        lo, _, _, hi = implicit_kv_range(start_m, seqlen_q, seqlen_k, diag_offset, window_left,
                                         window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    tiles = tile_group * TILES_PER_PROGRAM + tl.arange(0, TILES_PER_PROGRAM)  # [T]
    in_range = (tiles >= lo) & (tiles < hi) & (tiles < n_cols)
    cols = tiles[None, :, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, None, :]  # [1, T, BN]
    col_ptrs = Mask + off_b.to(tl.int64) * stride_mb + off_h.to(tl.int64) * stride_mh \
        + (first_q + start_m).to(tl.int64) * stride_mm + cols.to(tl.int64) * stride_mn
    tile_rows = tl.minimum(mask_rows - start_m, BLOCK_M)
    offs_m = tl.arange(0, CHUNK_M)
    n_kept = tl.zeros([TILES_PER_PROGRAM], tl.int32)
    n_inside = tl.zeros([TILES_PER_PROGRAM], tl.int32)
    undecided = in_range  # every element read so far kept, or none
    chunk = 0
    while (chunk < tile_rows) & (tl.max(undecided.to(tl.int32), 0) > 0):
        rows = chunk + offs_m[:, None, None]  # [CM, 1, 1]
        read = undecided[None, :, None]  # [1, T, 1]
        if EVEN:
            keep = tl.load(col_ptrs + rows.to(tl.int64) * stride_mm, mask=read, other=0) != 0
            n_inside += CHUNK_M * BLOCK_N
        else:
            inside = (rows < tile_rows) & (cols < mask_cols)  # [CM, T, BN]
            keep = tl.load(col_ptrs + rows.to(tl.int64) * stride_mm, mask=read & inside,
                           other=0) != 0
            n_inside += tl.sum(tl.sum(inside.to(tl.int32), 2), 0)
        n_kept += tl.sum(tl.sum(keep.to(tl.int32), 2), 0)
        # a decided tile stays PARTIAL: its count of kept elements stops, that of inside ones not
        undecided = in_range & ((n_kept == 0) | (n_kept == n_inside))
        chunk += CHUNK_M
    state = tl.where(n_kept == 0, _HIDDEN, tl.where(n_kept == n_inside, _FULL, _PARTIAL))
    state = tl.where(in_range, state, _HIDDEN)
    tl.store(States + off_b * stride_sb + off_h * stride_sh + tile_m * stride_sm + tiles,
             state.to(tl.int8), mask=tiles < n_cols)


@triton.jit
def _mask_states_kernel(
    Mask, States, stride_mb, stride_mh, stride_mm, stride_mn,
    stride_sb, stride_sh, stride_sm, seqlen_q, seqlen_k, mask_rows, mask_cols, n_cols, num_heads,
    diag_offset, window_left, window_right, CuSeqlensQ, CuSeqlensK,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, ROWS_SHARED: tl.constexpr, COLS_SHARED: tl.constexpr,
    VARLEN: tl.constexpr, TILES_PER_PROGRAM: tl.constexpr, EVEN: tl.constexpr,
    CHUNK_M: tl.constexpr,
):
    """`_tile_states` of program (tile group, mask batch x head, query tile)."""
    _tile_states(Mask, States, stride_mb, stride_mh, stride_mm, stride_mn, stride_sb, stride_sh,
                 stride_sm, seqlen_q, seqlen_k, mask_rows, mask_cols, n_cols, num_heads,
                 diag_offset, window_left, window_right, CuSeqlensQ, CuSeqlensK,
                 tl.program_id(0), tl.program_id(1), tl.program_id(2), BLOCK_M, BLOCK_N,
                 HAS_LEFT, HAS_RIGHT, ROWS_SHARED, COLS_SHARED, VARLEN, TILES_PER_PROGRAM, EVEN,
                 CHUNK_M)


# The pre-pass reads MASK_CHUNK_M rows of MASK_ROW_ELEMENTS keys (neighbouring tiles) per load
# (H100, B2 H16 4k top-k mask: 0.030 ms against 0.078 for a 32-row tile at a time;
# docs/perf/masks-and-bias.md, "The mask pre-pass's reads").
MASK_CHUNK_M = 4
MASK_ROW_ELEMENTS = 256
MASK_NUM_WARPS = 2


def _states_launch(mask: Elementwise, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int,
                   args: KernelArgs, packed: PackedSequences | None):
    """(states, grid, operands, constexprs) of the pre-pass over `mask` at (block_m, block_n)
    tiles (see mask_tile_states)."""
    t = mask.tensor
    batch, heads, rows, cols = t.shape
    if packed is not None:
        batch = packed.batch
        rows = 1 if mask.rows_shared else seqlen_q
    n_m, n_n = cdiv(rows, block_m), cdiv(cols, block_n)
    states = torch.empty((batch, heads, n_m, n_n), dtype=torch.int8, device=t.device)
    tiles_per_program = min(max(1, MASK_ROW_ELEMENTS // block_n), next_power_of_2(n_n))
    # query tiles in launch order: a mask's long reads (FULL / HIDDEN tiles, read whole) often
    # sit in its first rows (top-k: those that see fewer keys than it keeps), started first so
    # they do not trail the launch
    grid = (cdiv(n_n, tiles_per_program), batch * heads, n_m)
    operands = (t, states, *mask.strides, *states.stride()[:3], seqlen_q, seqlen_k, rows, cols,
                n_n, heads, seqlen_k - seqlen_q, args.window_left, args.window_right,
                *packed_operands(packed, t.device))
    flags = dict(
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_LEFT=args.has_left, HAS_RIGHT=args.has_right,
        ROWS_SHARED=mask.rows_shared, COLS_SHARED=mask.cols_shared, VARLEN=packed is not None,
        TILES_PER_PROGRAM=tiles_per_program,
        EVEN=packed is None and rows % block_m == 0 and cols % block_n == 0 and
        not mask.rows_shared and not mask.cols_shared,
        CHUNK_M=min(MASK_CHUNK_M, block_m) if rows > 1 else 1)
    return states, grid, operands, flags


def mask_tile_states(mask: Elementwise, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int,
                     args: KernelArgs, packed: PackedSequences | None = None) -> torch.Tensor:
    """int8 (B|1, Hm, n_q_tiles | 1, n_k_tiles | 1) states of the mask at (block_m, block_n)
    tiles: one read of the mask, skipping the tiles causal/window already hide (when the mask
    spans both Sq and Sk). A dim the mask broadcasts keeps size 1. Packed: one state map per
    sequence (B = sequences, tiles of the longest), (Sq, Sk) the longest lengths."""
    states, grid, operands, flags = _states_launch(mask, seqlen_q, seqlen_k, block_m, block_n,
                                                   args, packed)
    launch(_mask_states_kernel, grid, *operands, **flags, num_warps=MASK_NUM_WARPS)
    return states


@triton.jit
def _list_row(fine, stride_fm, stride_fn, n_fine_m, n_fine_n, lists, offset, n_rows, n_cols,
              row, bh, batch_heads, CuSeqlensQ, CuSeqlensK, off_b, seqlen_q, seqlen_k,
              diag_offset, window_left, window_right,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FACTOR_M: tl.constexpr,
              FACTOR_N: tl.constexpr, TRANSPOSED: tl.constexpr, HAS_LEFT: tl.constexpr,
              HAS_RIGHT: tl.constexpr, VARLEN: tl.constexpr, BLOCK_C: tl.constexpr):
    """The BCSR lists of one row of (BLOCK_M, BLOCK_N) tiles: a query tile (key tiles listed)
    or, TRANSPOSED, a key tile (query tiles listed), into the pass's part of `lists` at
    `offset`: counts (2, B, Hl, n_rows) of PARTIAL then FULL tiles, indices
    (2, B, Hl, n_rows, n_cols), bh the row's batch x list head. A tile's state is the AND (min)
    of the causal / window state and the mask state, coarsened from the pre-pass's FACTOR_M x FACTOR_N finer tiles. Tiles
    outside the causal / window range are not looked at. Listed in increasing order.
    VARLEN: (Sq, Sk) are those of the row's sequence."""
    _, seqlen_q, _, seqlen_k = sequence_bounds(CuSeqlensQ, CuSeqlensK, off_b, seqlen_q, seqlen_k,
                                               VARLEN)
    if VARLEN:
        diag_offset = seqlen_k - seqlen_q
    if TRANSPOSED:
        lo, full_lo, full_hi, hi = implicit_q_range(row * BLOCK_N, seqlen_q, seqlen_k, diag_offset,
                                                    window_left, window_right, BLOCK_M, BLOCK_N,
                                                    HAS_LEFT, HAS_RIGHT)
    else:
        lo, full_lo, full_hi, hi = implicit_kv_range(row * BLOCK_M, seqlen_q, seqlen_k,
                                                     diag_offset, window_left, window_right,
                                                     BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    slot = bh * n_rows + row  # of this row in (B, Hl, n_rows)
    num = lists + offset + slot
    full_num = num + batch_heads * n_rows
    idx = lists + offset + 2 * batch_heads * n_rows + slot.to(tl.int64) * n_cols
    full_idx = idx + batch_heads.to(tl.int64) * n_rows * n_cols
    n_partial = 0
    n_full = 0
    if VARLEN:
        # rows past this sequence's end list nothing
        if TRANSPOSED:
            hi = tl.where(row * BLOCK_N < seqlen_k, hi, lo)
        else:
            hi = tl.where(row * BLOCK_M < seqlen_q, hi, lo)
    for start in range(lo, hi, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        valid = cols < hi
        by_predicate = tl.where((cols >= full_lo) & (cols < full_hi), _FULL, _PARTIAL)
        lowest = tl.full([BLOCK_C], _FULL, tl.int32)
        highest = tl.full([BLOCK_C], _HIDDEN, tl.int32)
        for i in tl.static_range(FACTOR_M):
            for j in tl.static_range(FACTOR_N):
                if TRANSPOSED:
                    fine_m = cols * FACTOR_M + i
                    fine_n = row * FACTOR_N + j
                else:
                    fine_m = row * FACTOR_M + i
                    fine_n = cols * FACTOR_N + j
                inside = valid & (fine_m < n_fine_m) & (fine_n < n_fine_n)
                # from L2 (.cg), never a stale L1 line: _mask_forward_lists_kernel reads
                # states other programs wrote
                sub = tl.load(fine + fine_m * stride_fm + fine_n * stride_fn, mask=inside,
                              other=0, cache_modifier=".cg").to(tl.int32)
                lowest = tl.where(inside, tl.minimum(lowest, sub), lowest)
                highest = tl.where(inside, tl.maximum(highest, sub), highest)
        by_mask = tl.where(highest == _HIDDEN, _HIDDEN, tl.where(lowest == _FULL, _FULL, _PARTIAL))
        state = tl.minimum(by_predicate, by_mask)
        is_partial = valid & (state == _PARTIAL)
        is_full = valid & (state == _FULL)
        # stream compaction: the k-th listed tile of this chunk goes to slot count + k
        tl.store(idx + n_partial + tl.cumsum(is_partial.to(tl.int32), 0) - 1, cols, mask=is_partial)
        tl.store(full_idx + n_full + tl.cumsum(is_full.to(tl.int32), 0) - 1, cols, mask=is_full)
        n_partial += tl.sum(is_partial.to(tl.int32), 0)
        n_full += tl.sum(is_full.to(tl.int32), 0)
    tl.store(num, n_partial)
    tl.store(full_num, n_full)


@triton.jit
def _mask_lists_kernel(
    Fine, stride_fb, stride_fh, stride_fm, stride_fn, n_fine_m, n_fine_n, Lists, list_heads,
    CuSeqlensQ, CuSeqlensK, seqlen_q, seqlen_k, diag_offset, window_left, window_right,
    offset_0, n_rows_0, n_cols_0, offset_1, n_rows_1, n_cols_1, offset_2, n_rows_2, n_cols_2,
    BLOCK_M_0: tl.constexpr, BLOCK_N_0: tl.constexpr, TRANSPOSED_0: tl.constexpr,
    BLOCK_C_0: tl.constexpr, BLOCK_M_1: tl.constexpr, BLOCK_N_1: tl.constexpr,
    TRANSPOSED_1: tl.constexpr, BLOCK_C_1: tl.constexpr, BLOCK_M_2: tl.constexpr,
    BLOCK_N_2: tl.constexpr, TRANSPOSED_2: tl.constexpr, BLOCK_C_2: tl.constexpr,
    FINE_M: tl.constexpr, FINE_N: tl.constexpr, NUM_PASSES: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, VARLEN: tl.constexpr,
):
    """The lists of up to three passes (each its own tile and orientation) in one launch:
    program rows [0, n_rows_0) build pass 0's, the next n_rows_1 pass 1's, then pass 2's; list
    head h from states head h."""
    row = tl.program_id(0)
    bh = tl.program_id(1)
    batch_heads = tl.num_programs(1)
    off_b = bh // list_heads
    fine = Fine + off_b * stride_fb + (bh % list_heads) * stride_fh
    if row < n_rows_0:
        _list_row(fine, stride_fm, stride_fn, n_fine_m, n_fine_n, Lists, offset_0, n_rows_0,
                  n_cols_0, row, bh, batch_heads, CuSeqlensQ, CuSeqlensK, off_b, seqlen_q,
                  seqlen_k, diag_offset, window_left, window_right, BLOCK_M_0, BLOCK_N_0,
                  BLOCK_M_0 // FINE_M, BLOCK_N_0 // FINE_N, TRANSPOSED_0, HAS_LEFT, HAS_RIGHT,
                  VARLEN, BLOCK_C_0)
    elif NUM_PASSES > 1:
        row -= n_rows_0
        if row < n_rows_1:
            _list_row(fine, stride_fm, stride_fn, n_fine_m, n_fine_n, Lists, offset_1, n_rows_1,
                      n_cols_1, row, bh, batch_heads, CuSeqlensQ, CuSeqlensK, off_b, seqlen_q,
                      seqlen_k, diag_offset, window_left, window_right, BLOCK_M_1, BLOCK_N_1,
                      BLOCK_M_1 // FINE_M, BLOCK_N_1 // FINE_N, TRANSPOSED_1, HAS_LEFT,
                      HAS_RIGHT, VARLEN, BLOCK_C_1)
        elif NUM_PASSES > 2:
            _list_row(fine, stride_fm, stride_fn, n_fine_m, n_fine_n, Lists, offset_2, n_rows_2,
                      n_cols_2, row - n_rows_1, bh, batch_heads, CuSeqlensQ, CuSeqlensK, off_b,
                      seqlen_q, seqlen_k, diag_offset, window_left, window_right, BLOCK_M_2,
                      BLOCK_N_2, BLOCK_M_2 // FINE_M, BLOCK_N_2 // FINE_N, TRANSPOSED_2,
                      HAS_LEFT, HAS_RIGHT, VARLEN, BLOCK_C_2)


@triton.jit
def _mask_forward_lists_kernel(
    Mask, States, stride_mb, stride_mh, stride_mm, stride_mn,
    stride_sb, stride_sh, stride_sm, seqlen_q, seqlen_k, mask_rows, mask_cols, n_cols, num_heads,
    diag_offset, window_left, window_right, CuSeqlensQ, CuSeqlensK,
    Lists, Arrivals, n_list_rows, n_list_cols,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, ROWS_SHARED: tl.constexpr, COLS_SHARED: tl.constexpr,
    VARLEN: tl.constexpr, TILES_PER_PROGRAM: tl.constexpr, EVEN: tl.constexpr,
    CHUNK_M: tl.constexpr, LIST_M: tl.constexpr, LIST_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """The pre-pass (`_tile_states` at the fine tile BLOCK_M x BLOCK_N) of a mask spanning
    (Sq, Sk) and the forward's lists at (LIST_M, LIST_N) in one launch: a program counts its
    arrival (states stored) at the list row holding its query tile; the last of that row's
    LIST_M // BLOCK_M fine rows x tile groups to arrive builds the row, of this mask head's lists
    (the lists keep the mask's heads). No program waits for another."""
    tile_group = tl.program_id(0)
    bh_mask = tl.program_id(1)
    tile_m = tl.program_id(2)
    _tile_states(Mask, States, stride_mb, stride_mh, stride_mm, stride_mn, stride_sb, stride_sh,
                 stride_sm, seqlen_q, seqlen_k, mask_rows, mask_cols, n_cols, num_heads,
                 diag_offset, window_left, window_right, CuSeqlensQ, CuSeqlensK, tile_group,
                 bh_mask, tile_m, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, ROWS_SHARED,
                 COLS_SHARED, VARLEN, TILES_PER_PROGRAM, EVEN, CHUNK_M)
    tl.debug_barrier()  # every thread's states stored before the count
    n_fine_m = tl.num_programs(2)
    row = tile_m // (LIST_M // BLOCK_M)
    expected = tl.minimum(LIST_M // BLOCK_M, n_fine_m - row * (LIST_M // BLOCK_M)) \
        * tl.num_programs(0)
    # release: the program's states come before its count; acquire: the last one to count
    # sees every other program's (read past L1 by _list_row)
    arrived = tl.atomic_add(Arrivals + bh_mask * n_list_rows + row, 1, sem="acq_rel",
                            scope="gpu")
    if arrived == expected - 1:
        off_b = bh_mask // num_heads
        fine = States + off_b * stride_sb + (bh_mask % num_heads) * stride_sh
        _list_row(fine, stride_sm, 1, n_fine_m, n_cols, Lists, 0, n_list_rows, n_list_cols, row,
                  bh_mask, tl.num_programs(1), CuSeqlensQ, CuSeqlensK, off_b, seqlen_q,
                  seqlen_k, diag_offset, window_left, window_right, LIST_M, LIST_N,
                  LIST_M // BLOCK_M, LIST_N // BLOCK_N, False, HAS_LEFT, HAS_RIGHT, VARLEN,
                  BLOCK_C)


Pass = tuple[tuple[int, int], bool]  # (tile, transposed) of a pass's lists


def _list_chunk(n_cols: int) -> int:
    """Tiles a list row's builder looks at per step."""
    return min(128, next_power_of_2(n_cols))


def _lists_layout(passes: list[Pass], batch: int, list_heads: int, seqlen_q: int,
                  seqlen_k: int) -> tuple[list[tuple[int, int]], list[int], int]:
    """(n_rows, n_cols) of each pass's lists, their offsets in one int32 buffer, its size: per
    pass, counts (2, B, Hl, n_rows) of PARTIAL then FULL tiles, then indices
    (2, B, Hl, n_rows, n_cols)."""
    shapes, offsets, total = [], [], 0
    for (block_m, block_n), transposed in passes:
        n_m, n_n = cdiv(seqlen_q, block_m), cdiv(seqlen_k, block_n)
        n_rows, n_cols = (n_n, n_m) if transposed else (n_m, n_n)
        shapes.append((n_rows, n_cols))
        offsets.append(total)
        total += 2 * batch * list_heads * n_rows * (1 + n_cols)
    return shapes, offsets, total


def _list_views(lists: torch.Tensor, passes: list[Pass], shapes: list[tuple[int, int]],
                offsets: list[int], batch: int, list_heads: int) -> list[TileLists]:
    """Each pass's TileLists as views of the buffer `_lists_layout` describes."""
    result = []
    for ((block_m, block_n), _), (n_rows, n_cols), offset in zip(passes, shapes, offsets):
        counts = batch * list_heads * n_rows
        # one as_strided per tensor (slicing and viewing took three torch ops)
        num_of = [lists.as_strided((batch, list_heads, n_rows), (list_heads * n_rows, n_rows, 1),
                                   offset + part * counts) for part in (0, 1)]
        idx_of = [lists.as_strided((batch, list_heads, n_rows, n_cols),
                                   (list_heads * n_rows * n_cols, n_rows * n_cols, n_cols, 1),
                                   offset + 2 * counts + part * counts * n_cols)
                  for part in (0, 1)]
        result.append(TileLists(block_m, block_n, num_of[0], idx_of[0], num_of[1], idx_of[1]))
    return result


def _mask_lists(fine: torch.Tensor, fine_tile: tuple[int, int], passes: list[Pass],
                seqlen_q: int, seqlen_k: int, args: KernelArgs,
                packed: PackedSequences | None = None) -> list[TileLists]:
    """Lists of each pass (tile, transposed), one to three, from the pre-pass states `fine`
    (B|1, Hs, n|1, n|1) at `fine_tile`, in one launch and one allocation (a launch per pass
    took 40-49 us of host time on an H100 host, four allocations more). The lists keep the
    states' heads Hs (1, Hk, H or another divisor of H): query head h walks list head
    h // (H / Hs) (TileLists), so states per KV head make lists per KV head, not one copy per
    query head. Packed sequences: (Sq, Sk) are the longest, each batch's lists stop at its own
    lengths."""
    batch, list_heads, n_fine_m, n_fine_n = fine.shape
    stride_fb = fine.stride(0)
    if packed is not None and batch != packed.batch:  # one state map for every sequence
        batch, stride_fb = packed.batch, 0
    shapes, offsets, total = _lists_layout(passes, batch, list_heads, seqlen_q, seqlen_k)
    lists = torch.empty(total, dtype=torch.int32, device=fine.device)
    operands, flags = [], {}
    for i in range(3):  # the kernel's unused pass slots repeat the last pass (never run)
        ((block_m, block_n), transposed), (n_rows, n_cols), offset = (
            passes[i], shapes[i], offsets[i]) if i < len(passes) else (passes[-1], (0, 1), 0)
        operands += [offset, n_rows, n_cols]
        flags.update({f"BLOCK_M_{i}": block_m, f"BLOCK_N_{i}": block_n,
                      f"TRANSPOSED_{i}": transposed,
                      f"BLOCK_C_{i}": _list_chunk(n_cols)})
    # a dim the mask broadcasts has one pre-pass state for every tile: stride 0, never out of range
    stride_fm, stride_fn = broadcast_strides(fine)[2:]
    launch(_mask_lists_kernel, (sum(rows for rows, _ in shapes), batch * list_heads),
        fine, stride_fb, fine.stride(1), stride_fm, stride_fn,
        n_fine_m if stride_fm else 2 ** 30, n_fine_n if stride_fn else 2 ** 30,
        lists, list_heads, *packed_operands(packed, fine.device),
        seqlen_q, seqlen_k, seqlen_k - seqlen_q, args.window_left, args.window_right,
        *operands, **flags,
        FINE_M=fine_tile[0], FINE_N=fine_tile[1], NUM_PASSES=len(passes),
        HAS_LEFT=args.has_left, HAS_RIGHT=args.has_right, VARLEN=packed is not None,
    )
    return _list_views(lists, passes, shapes, offsets, batch, list_heads)


def fine_tile_of(*tiles: tuple[int, int]) -> tuple[int, int]:
    """The finest tile every pass's tile is a multiple of: where tile states are computed."""
    return math.gcd(*(m for m, _ in tiles)), math.gcd(*(n for _, n in tiles))


def states_schedule(fine: torch.Tensor, fine_tile: tuple[int, int], seqlen_q: int, seqlen_k: int,
                    args: KernelArgs, forward_tile: tuple[int, int],
                    dq_tile: tuple[int, int], dkdv_tile: tuple[int, int],
                    packed: PackedSequences | None = None, backward: bool = True) -> Schedule:
    """Each pass's lists from element-exact tile states `fine` (B|1, Hs, n|1, n|1) at
    `fine_tile`, ANDed with causal / window: one list-builder launch for every pass (dQ shares
    the forward's lists when their tiles match), with the states' heads. backward=False: the
    forward's lists only (Schedule.forward_only)."""
    passes = [(forward_tile, False)]
    if backward:
        passes += ([] if dq_tile == forward_tile else [(dq_tile, False)]) + [(dkdv_tile, True)]
    built = _mask_lists(fine, fine_tile, passes, seqlen_q, seqlen_k, args, packed)
    if not backward:
        return Schedule.forward_only(built[0])
    return Schedule(built[0], built[-2], built[-1])


def mask_forward_schedule(mask: Elementwise, fine_tile: tuple[int, int], seqlen_q: int,
                          seqlen_k: int, args: KernelArgs, forward_tile: tuple[int, int],
                          packed: PackedSequences | None = None) -> Schedule:
    """`states_schedule(mask_tile_states(mask, ...), ..., backward=False)` in one launch, for a
    mask spanning (Sq, Sk): the pre-pass programs build the forward's lists as their rows
    complete: the list builder's launch costs 32 us of host time alone on an H100 host. Calls
    that also build the backward's lists keep two launches: built by the last programs, the
    dK/dV column lists (which need every row) made one launch 55-66 us of GPU time against 31 +
    ~5 (docs/perf/host-overhead.md)."""
    states, grid, operands, flags = _states_launch(mask, seqlen_q, seqlen_k, *fine_tile, args,
                                                   packed)
    batch, mask_heads = states.shape[:2]
    passes = [(forward_tile, False)]
    shapes, offsets, total = _lists_layout(passes, batch, mask_heads, seqlen_q, seqlen_k)
    (n_rows, n_cols), = shapes
    lists = torch.empty(total, dtype=torch.int32, device=states.device)
    arrivals = torch.zeros(batch * mask_heads * n_rows, dtype=torch.int32, device=states.device)
    launch(_mask_forward_lists_kernel, grid,
        *operands, lists, arrivals, n_rows, n_cols, **flags,
        LIST_M=forward_tile[0], LIST_N=forward_tile[1], BLOCK_C=_list_chunk(n_cols),
        num_warps=MASK_NUM_WARPS)
    return Schedule.forward_only(_list_views(lists, passes, shapes, offsets, batch,
                                             mask_heads)[0])


def row_length_states(row_lens: torch.Tensor, seqlen_q: int, seqlen_k: int, block_m: int,
                      block_n: int, packed: PackedSequences | None = None) -> torch.Tensor:
    """int8 (B, 1, n_q_tiles, n_k_tiles) states of per-row key lengths (B, Sq), or (total_q,)
    packed: a tile is FULL when its shortest row covers it, HIDDEN when its longest row ends
    before it. O(B * Sq + tiles) device work, no host sync."""
    device = row_lens.device
    if packed is not None:
        lens_q, lens_k = packed.seqlens()
        local = torch.arange(seqlen_q, device=device)
        valid = local[None, :] < lens_q[:, None]  # (B, max Sq)
        rows = (packed.cu_seqlens_q[:-1, None] + local[None, :]).clamp(max=row_lens.numel() - 1)
        lens = row_lens[rows.long()]
        key_count = lens_k[:, None]  # (B, 1)
    else:
        lens = row_lens
        valid = torch.ones_like(lens, dtype=torch.bool)
        key_count = torch.full((1, 1), seqlen_k, device=device, dtype=torch.int32)
    lens = torch.minimum(lens, key_count)
    n_m, n_n = cdiv(seqlen_q, block_m), cdiv(seqlen_k, block_n)
    pad = n_m * block_m - seqlen_q
    shortest = torch.nn.functional.pad(torch.where(valid, lens, seqlen_k), (0, pad),
                                       value=seqlen_k).view(-1, n_m, block_m).amin(-1)
    longest = torch.nn.functional.pad(torch.where(valid, lens, -1), (0, pad),
                                      value=-1).view(-1, n_m, block_m).amax(-1)
    first_k = torch.arange(n_n, device=device) * block_n
    end_k = torch.minimum(first_k[None, :] + block_n, key_count)  # (B|1, n_n)
    hidden = first_k[None, None, :] >= longest[..., None]  # (B, n_m, n_n)
    full = end_k[:, None, :] <= shortest[..., None]
    states = torch.where(hidden, HIDDEN, torch.where(full, FULL, PARTIAL)).to(torch.int8)
    return states.unsqueeze(1)


def _tile_extremes(values: torch.Tensor, length: int,
                   block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lowest, highest) int32 of each block of `block` along the last dim of values
    (..., length): (..., cdiv(length, block)), a last block's padding ignored."""
    lowest, highest = torch.iinfo(torch.int32).min, torch.iinfo(torch.int32).max
    count = cdiv(length, block)
    pad = count * block - length
    tiles = (*values.shape[:-1], count, block)
    return (F.pad(values, (0, pad), value=highest).view(tiles).amin(-1),
            F.pad(values, (0, pad), value=lowest).view(tiles).amax(-1))


def topk_tile_states(term: TopkTerm, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int,
                     packed: PackedSequences | None = None) -> torch.Tensor:
    """int8 states of the top-k term at (block_m, block_n) tiles, (B, Hs, n_q_tiles|1, n_k_tiles):
    HIDDEN where every key of the tile scores below every row's threshold (no row keeps one),
    FULL where every key scores above every row's threshold (every row keeps them all, ties
    aside), else PARTIAL. Tiles are told apart for per-key scores (one row for every query) of
    padded batches, from each key tile's lowest and highest order key and each query tile's
    lowest and highest threshold: O(B * Hs * (Sq + Sk)) work beside the states. Other calls get
    one PARTIAL state for every tile ((1, 1, 1, 1)): the kernels apply the term in each."""
    scores, thresholds = term.scores, term.pairs[0]  # thresholds (B, Hs, Sq|1)
    if packed is not None or not scores.rows_shared or scores.cols_shared:
        return torch.full((1, 1, 1, 1), PARTIAL, dtype=torch.int8, device=thresholds.device)
    keys = order_keys(scores.tensor[:, :, 0, :seqlen_k])  # (B|1, Hm, Sk)
    heads = thresholds.shape[1]
    if keys.shape[1] not in (1, heads):  # a pair head j selects by score head j // (Hs / Hm)
        keys = keys.repeat_interleave(heads // keys.shape[1], dim=1)
    key_lo, key_hi = (t[..., None, :] for t in _tile_extremes(keys, seqlen_k, block_n))
    if thresholds.shape[-1] == 1:
        row_lo = row_hi = thresholds[..., None]  # (B, Hs, 1, 1)
    else:
        row_lo, row_hi = (t[..., None] for t in _tile_extremes(thresholds, seqlen_q, block_m))
    # int8 from the start: torch.where on Python ints would make int64 maps (8x the memory)
    states = torch.full(torch.broadcast_shapes(key_hi.shape, row_lo.shape), PARTIAL,
                        dtype=torch.int8, device=keys.device)
    states.masked_fill_(key_hi < row_lo, HIDDEN)
    return states.masked_fill_(key_lo > row_hi, FULL)
