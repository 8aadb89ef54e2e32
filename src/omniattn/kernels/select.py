"""Top-k row thresholds on the GPU: for every (batch, head, query row), the threshold pair of
predicate.RowThresholds that keeps the `topk` visible keys of largest score (ties to the lower
key index), with no (Sq, Sk) temporary.

Two kernels, by the scores' form:
- radix select (`_radix_select_kernel`): a program holds BLOCK_M rows and walks their visible
  key tiles once per RADIX_BITS-bit digit of the uint32 order keys, most significant first,
  counting per row the keys at or above each candidate digit; a last walk finds the tie bound
  where ties at the threshold are cut. Any scores and masks: causal / window / per-row lengths /
  packed sequences are applied in-kernel, attn_mask and a block mask are read. The keys have
  KEY_BITS bits: 32, or 16 for 16-bit scores (their own bits ordered: `half_order_keys`, one to
  one with the float32 keys, so half the digits give the same pairs). Work: the visible
  elements times (KEY_BITS / RADIX_BITS + 1).
  Split (`_slice_digit_counts_kernel`, `_slice_tie_bound_kernel`) where the row tiles are too
  few to fill the GPU (decoding: one row per (batch, head)): each row tile's key tiles are cut
  into slices, a program each. Per digit, one launch: every slice counts its keys in the
  bucket the earlier digits chose, by next digit, and adds them to the rows' counts (int32
  atomics into (rows, KEY_BITS / RADIX_BITS, 2^RADIX_BITS)); each program replays the earlier
  digits' choices from those sums. Then one launch for the pairs: the last digit's counts,
  kept per slice too, give each slice's ties at the threshold, so only the slice holding a
  row's last kept tie walks its keys again. The same pairs; work: the visible elements times
  KEY_BITS / RADIX_BITS, plus a slice; memory: (rows x (KEY_BITS / RADIX_BITS + slices) x
  2^RADIX_BITS)
  int32, the rows padded to whole row tiles.
- range select (kernels/select_ranges.py): per-key scores (one row for every query) whose rows
  see contiguous key ranges (causal, window, lengths, packed sequences, a per-key mask): a
  wavelet matrix over the keys' ranks answers each row in O(log Sk), where rescanning every
  causal prefix would be O(Sq x Sk).

The launcher `threshold_pairs` (`row_thresholds`: as RowThresholds) picks one;
`reference.topk_thresholds` is the plain PyTorch twin.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..predicate import EVERY_TIE, FULL, KEEP_ALL, PARTIAL, RowThresholds, selection_heads
from ..runtime.launch import launch
from ..runtime.switches import interpreting, sm_count
from .common import (implicit_kv_range, load_pair_tile, sequence_bounds, signed_order_keys,
                     used_keys, visible_elements)
from .elementwise import Elementwise
from .schedule import BlockBits, KernelArgs
from .select_ranges import range_thresholds
from .sequences import PackedSequences, broadcast_strides, packed_operands, placeholder
from .sizes import cdiv, next_power_of_2

_FULL, _PARTIAL = tl.constexpr(FULL), tl.constexpr(PARTIAL)
_KEEP_ALL, _EVERY_TIE = tl.constexpr(KEEP_ALL), tl.constexpr(EVERY_TIE)

# untuned: rows per program, keys per step, digit width (16 candidates per row and step)
RADIX_BLOCK_M, RADIX_BLOCK_N, RADIX_BITS, RADIX_NUM_WARPS = 16, 64, 4, 4
INTERPRETER_BLOCK_M, INTERPRETER_BLOCK_N, INTERPRETER_RADIX_BITS = 16, 16, 8
# per-key scores take the range select only with more rows than one radix row tile
# (row_thresholds says why)
RANGE_SELECT_ROWS = RADIX_BLOCK_M
# untuned: the split select's slices walk at least this many key tiles (each program replays
# the levels' counts before its walk)
MIN_SLICE_TILES = 4
# SMs the interpreter's split rule assumes (it has none): few-row tests take the split select
INTERPRETER_SM_COUNT = 4


@triton.jit
def order_keys(x):
    """uint32 order keys of float scores: predicate.order_keys ^ 0x80000000, so that unsigned
    order is the scores' order (-0 = +0, NaN above +inf)."""
    return signed_order_keys(x).to(tl.uint32, bitcast=True) ^ 0x80000000


@triton.jit
def half_order_keys(x):
    """uint32 order keys in [0, 2^16) of 16-bit float scores, from their own bits as order_keys
    takes float32's (-0 = +0, NaN above +inf): fp16 / bf16 widen to float32 exactly and in
    order, so these are one to one with their order_keys, in the same order."""
    bits = tl.where(x == 0, 0, x.to(tl.int16, bitcast=True).to(tl.int32))  # sign-extended
    keys = bits ^ ((bits >> 31) & 0x7FFF)
    return (tl.where(x != x, 0x7FFF, keys) + 0x8000).to(tl.uint32)


@triton.jit
def select_keys(x, KEY_BITS: tl.constexpr):
    """The radix select's uint32 keys of scores x: order_keys, or half_order_keys (KEY_BITS
    16, for 16-bit scores)."""
    if KEY_BITS == 16:
        keys = half_order_keys(x)
    else:
        keys = order_keys(x)
    return keys


@triton.jit
def row_threshold(prefix, selects, Scores, KEY_BITS: tl.constexpr):
    """int32 thresholds (predicate.RowThresholds) of select_keys (uint32 [BM]) of Scores'
    dtype: the order key of the score a key stands for; KEEP_ALL for rows that keep every key
    they see."""
    if KEY_BITS == 16:
        signed = prefix.to(tl.int32) - 0x8000
        bits = (signed ^ ((signed >> 31) & 0x7FFF)).to(tl.int16)
        threshold = signed_order_keys(bits.to(Scores.dtype.element_ty, bitcast=True))
    else:
        threshold = (prefix ^ 0x80000000).to(tl.int32, bitcast=True)
    return tl.where(selects, threshold, _KEEP_ALL)


@triton.jit
def block_mask_keep(states, slots, bits, stride_sq, stride_sk, stride_lq, stride_lk, rows, cols,
                    seqlen_q, seqlen_k, diag_offset, block_q, block_k, left, right,
                    HAS_BITS: tl.constexpr):
    """[BM, BN] visibility under a block mask: FULL blocks, and PARTIAL blocks where its own
    relative predicate (left / right, -1 unbounded) and element bitmap hold. states / slots
    point at this (batch, head)'s dense int8 block states / int32 bitmap slots."""
    inside = (rows[:, None] < seqlen_q) & (cols[None, :] < seqlen_k)
    q_block = rows[:, None] // block_q
    k_block = cols[None, :] // block_k
    state = tl.load(states + q_block * stride_sq + k_block * stride_sk, mask=inside, other=0)
    # an unbounded side (-1) as a bound no offset reaches
    reach = seqlen_q + seqlen_k
    partial = visible_elements(rows, cols, 0, diag_offset, tl.where(left < 0, reach, left),
                               tl.where(right < 0, reach, right), True, True, False)
    if HAS_BITS:
        slot = tl.load(slots + q_block * stride_lq + k_block * stride_lk, mask=inside, other=-1)
        offset = tl.maximum(slot, 0).to(tl.int64) * (block_q * block_k) \
            + (rows[:, None] % block_q) * block_k + cols[None, :] % block_k
        bit = tl.load(bits + offset, mask=inside, other=1)
        partial = partial & ((slot < 0) | (bit != 0))
    return (state == _FULL) | ((state == _PARTIAL) & partial)


@triton.jit
def tile_keys(scores, mask, states, slots, bits, rows, start_n, key_end, rows_left, seqlen_q,
              seqlen_k, diag_offset, window_left, window_right, stride_sm, stride_sn,
              stride_mm, stride_mn, stride_bq, stride_bk, stride_lq, stride_lk,
              block_q, block_k, block_left, block_right,
              BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
              HAS_MASK: tl.constexpr, HAS_BLOCK_MASK: tl.constexpr, HAS_BITS: tl.constexpr,
              SCORES_ROWS_SHARED: tl.constexpr, SCORES_COLS_SHARED: tl.constexpr,
              MASK_ROWS_SHARED: tl.constexpr, MASK_COLS_SHARED: tl.constexpr,
              KEY_BITS: tl.constexpr):
    """(uint32 select_keys [BM, BN], visible [BM, BN]) of key tile start_n for `rows`
    (positions in the sequence; key_end [BM]: where each row's keys end, 0 past the last row).
    scores / mask point at the program's first row, key 0."""
    offs_n = tl.arange(0, BLOCK_N)
    cols = start_n + offs_n
    local_m = tl.arange(0, rows.shape[0])
    raw = load_pair_tile(scores + start_n.to(tl.int64) * stride_sn, local_m, offs_n, stride_sm,
                         stride_sn, rows_left, seqlen_k - start_n, SCORES_ROWS_SHARED,
                         SCORES_COLS_SHARED, False, False)
    keys = select_keys(raw, KEY_BITS) + tl.zeros([rows.shape[0], BLOCK_N], tl.uint32)
    visible = visible_elements(rows, cols, key_end, diag_offset, window_left, window_right,
                               HAS_LEFT, HAS_RIGHT, True)
    if HAS_MASK:
        kept = load_pair_tile(mask + start_n.to(tl.int64) * stride_mn, local_m, offs_n,
                              stride_mm, stride_mn, rows_left, seqlen_k - start_n,
                              MASK_ROWS_SHARED, MASK_COLS_SHARED, False, False)
        visible = visible & (kept != 0)
    if HAS_BLOCK_MASK:
        visible = visible & block_mask_keep(states, slots, bits, stride_bq, stride_bk,
                                            stride_lq, stride_lk, rows, cols, seqlen_q,
                                            seqlen_k, diag_offset, block_q, block_k,
                                            block_left, block_right, HAS_BITS)
    return keys, visible


# The radix select kernels take grouped arguments: score_layout / mask_layout (batch, head, row,
# key strides, head divisor); block_layout (the dense block states' (batch, head, q block,
# k block) strides and head divisor, the bitmap slots' four strides, block rows, block columns,
# the block mask's left / right bounds); shape (topk, Sq, Sk, output heads, window left,
# window right, row lengths' batch stride); out_layout (the pairs' batch, head strides); FORM:
# (HAS_LEFT, HAS_RIGHT, HAS_MASK, HAS_BLOCK_MASK, HAS_BITS, HAS_ROW_LENS, VARLEN, HAS_SEQUSED,
# SCORES_ROWS_SHARED, SCORES_COLS_SHARED, MASK_ROWS_SHARED, MASK_COLS_SHARED).


@triton.jit
def row_tile(Scores, Mask, States, Slots, Bits, RowLens, CuSeqlensQ, CuSeqlensK, SeqUsed,
             score_layout, mask_layout, block_layout, shape, tile_m, FORM: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row tile tile_m of (batch, output head) program_id(1): (off_b, off_h, first_q, seqlen_q,
    rows, lo, hi, view). rows [BM]: positions in the sequence (of seqlen_q rows, which starts at
    packed row first_q); key tiles [lo, hi) hold every key a row sees; view: what
    `visible_keys` reads them through. Output head h reads input head h // *_div; packed: Sq
    the longest sequence's, each sequence's from cu_seqlens; HAS_SEQUSED: batch b uses its first
    SeqUsed[b] keys (causal / window align to them)."""
    HAS_LEFT: tl.constexpr = FORM[0]
    HAS_RIGHT: tl.constexpr = FORM[1]
    HAS_ROW_LENS: tl.constexpr = FORM[5]
    VARLEN: tl.constexpr = FORM[6]
    HAS_SEQUSED: tl.constexpr = FORM[7]
    _, seqlen_q, seqlen_k, heads_out, window_left, window_right, stride_rb = shape
    stride_sb, stride_sh, stride_sm, _, scores_div = score_layout
    stride_mb, stride_mh, stride_mm, _, mask_div = mask_layout
    stride_bb, stride_bh, _, _, block_div, stride_lb, stride_lh = block_layout[:7]
    off_b = tl.program_id(1) // heads_out
    off_h = tl.program_id(1) % heads_out
    first_q, seqlen_q, _, seqlen_k = sequence_bounds(CuSeqlensQ, CuSeqlensK, off_b, seqlen_q,
                                                     seqlen_k, VARLEN)
    seqlen_k = used_keys(SeqUsed, off_b, seqlen_k, HAS_SEQUSED)
    diag_offset = seqlen_k - seqlen_q
    start_m = tile_m * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    key_end = tl.where(rows < seqlen_q, seqlen_k, 0)
    if HAS_ROW_LENS:
        lens = tl.load(RowLens + off_b * stride_rb + first_q + rows, mask=rows < seqlen_q, other=0)
        key_end = tl.minimum(key_end, lens)
    lo, _, _, hi = implicit_kv_range(start_m, seqlen_q, seqlen_k, diag_offset, window_left,
                                     window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    hi = tl.minimum(hi, tl.cdiv(tl.max(key_end, 0), BLOCK_N))
    row_off = (first_q + start_m).to(tl.int64)
    scores = Scores + off_b.to(tl.int64) * stride_sb + (off_h // scores_div).to(tl.int64) \
        * stride_sh + row_off * stride_sm
    mask = Mask + off_b.to(tl.int64) * stride_mb + (off_h // mask_div).to(tl.int64) * stride_mh \
        + row_off * stride_mm
    states = States + off_b * stride_bb + (off_h // block_div) * stride_bh
    slots = Slots + off_b * stride_lb + (off_h // block_div) * stride_lh
    view = (scores, mask, states, slots, Bits, rows, key_end, seqlen_q - start_m, seqlen_q,
            seqlen_k, diag_offset, window_left, window_right, score_layout, mask_layout,
            block_layout)
    return off_b, off_h, first_q, seqlen_q, rows, lo, hi, view


@triton.jit
def visible_keys(view, start_n, FORM: tl.constexpr, BLOCK_N: tl.constexpr,
                 KEY_BITS: tl.constexpr):
    """tile_keys of key tile start_n for the rows of a row_tile view."""
    (scores, mask, states, slots, bits, rows, key_end, rows_left, seqlen_q, seqlen_k,
     diag_offset, window_left, window_right, score_layout, mask_layout, block_layout) = view
    return tile_keys(scores, mask, states, slots, bits, rows, start_n, key_end, rows_left,
                     seqlen_q, seqlen_k, diag_offset, window_left, window_right, score_layout[2],
                     score_layout[3], mask_layout[2], mask_layout[3], block_layout[2],
                     block_layout[3], block_layout[7], block_layout[8], block_layout[9],
                     block_layout[10], block_layout[11], block_layout[12], BLOCK_N, FORM[0],
                     FORM[1], FORM[2], FORM[3], FORM[4], FORM[8], FORM[9], FORM[10], FORM[11],
                     KEY_BITS)


@triton.jit
def pair_offsets(out_layout, off_b, off_h, first_q, rows):
    """[BM] offsets of rows' threshold pairs in Threshold / LastTie."""
    return off_b.to(tl.int64) * out_layout[0] + off_h * out_layout[1] + first_q + rows


@triton.jit
def needed_tie(view, first, last, prefix, needed, seen, FORM: tl.constexpr,
               BLOCK_N: tl.constexpr, KEY_BITS: tl.constexpr):
    """[BM] the index of each row's needed-th visible key scoring its threshold (prefix, uint32
    [BM]), counting `seen` [BM] such keys before key tile `first` and walking tiles [first,
    last); -1 where it lies beyond."""
    found = tl.full(needed.shape, -1, tl.int32)
    for i in range(last - first):
        keys, visible = visible_keys(view, (first + i) * BLOCK_N, FORM, BLOCK_N, KEY_BITS)
        tied = (visible & (keys == prefix[:, None])).to(tl.int32)
        running = seen[:, None] + tl.cumsum(tied, 1)
        cols = (first + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        hit = (tied != 0) & (running == needed[:, None])
        found = tl.maximum(found, tl.max(tl.where(hit, cols[None, :], -1), 1))
        seen += tl.sum(tied, 1)
    return found


@triton.jit
def _radix_select_kernel(Scores, Mask, States, Slots, Bits, RowLens, CuSeqlensQ, CuSeqlensK,
                         SeqUsed, Threshold, LastTie, score_layout, mask_layout, block_layout,
                         out_layout, shape, FORM: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, RADIX: tl.constexpr, KEY_BITS: tl.constexpr):
    """Threshold pairs of BLOCK_M rows of one (batch, output head): program (row tile,
    batch x heads_out); it walks every key its rows see once per digit."""
    off_b, off_h, first_q, seqlen_q, rows, lo, hi, view = row_tile(
        Scores, Mask, States, Slots, Bits, RowLens, CuSeqlensQ, CuSeqlensK, SeqUsed,
        score_layout, mask_layout, block_layout, shape, tl.program_id(0), FORM, BLOCK_M, BLOCK_N)
    topk = shape[0]

    # digit by digit, most significant first: prefix holds the threshold's digits found so
    # far; counts[:, d] is how many visible keys are >= prefix with digit d next (absolute
    # counts, so no remainder is carried); above: how many lie above prefix's bucket
    NUM_DIGITS: tl.constexpr = 1 << RADIX
    digits = tl.arange(0, NUM_DIGITS).to(tl.uint32)
    prefix = tl.zeros([BLOCK_M], tl.uint32)
    above = tl.zeros([BLOCK_M], tl.int32)
    n_visible = tl.zeros([BLOCK_M], tl.int32)
    at_least = tl.zeros([BLOCK_M], tl.int32)
    shift = tl.full([], KEY_BITS - RADIX, tl.int32)
    while shift >= 0:
        candidates = prefix[:, None] | (digits[None, :] << shift.to(tl.uint32))  # [BM, ND]
        counts = tl.zeros([BLOCK_M, NUM_DIGITS], tl.int32)
        for i in range(hi - lo):
            keys, visible = visible_keys(view, (lo + i) * BLOCK_N, FORM, BLOCK_N, KEY_BITS)
            hits = (keys[:, :, None] >= candidates[:, None, :]) & visible[:, :, None]
            counts += tl.sum(hits.to(tl.int32), 1)
        if shift == KEY_BITS - RADIX:  # digit 0 of the first pass counts every visible key
            n_visible = tl.sum(tl.where(digits[None, :] == 0, counts, 0), 1)
        # the largest digit with topk keys at or above it (counts fall as digits rise)
        digit = tl.maximum(tl.sum((counts >= topk).to(tl.int32), 1) - 1, 0)
        at_least = tl.sum(tl.where(digits[None, :] == digit[:, None], counts, 0), 1)
        next_count = tl.sum(tl.where(digits[None, :] == digit[:, None] + 1, counts, 0), 1)
        above = tl.where(digit + 1 < NUM_DIGITS, next_count, above)
        prefix = prefix | (digit.to(tl.uint32) << shift.to(tl.uint32))
        # rows seeing at most topk keys keep them all: a tile of only those stops here
        shift = tl.where(tl.max(n_visible, 0) > topk, shift - RADIX, -1)
    selects = n_visible > topk

    # the tie bound: where the (topk - above)-th visible key scoring the threshold lies, for
    # rows whose ties at the threshold are cut
    needed = topk - above
    cut = selects & (at_least - above > needed)
    last_tie = tl.full([BLOCK_M], _EVERY_TIE, tl.int32)
    if tl.max(cut.to(tl.int32), 0) > 0:
        found = needed_tie(view, lo, hi, prefix, needed, tl.zeros([BLOCK_M], tl.int32), FORM,
                           BLOCK_N, KEY_BITS)
        last_tie = tl.where(cut, found, last_tie)
    out = pair_offsets(out_layout, off_b, off_h, first_q, rows)
    tl.store(Threshold + out, row_threshold(prefix, selects, Scores, KEY_BITS),
             mask=rows < seqlen_q)
    tl.store(LastTie + out, last_tie, mask=rows < seqlen_q)


@triton.jit
def level_descent(counts, num_levels, topk, RADIX: tl.constexpr, KEY_BITS: tl.constexpr):
    """The split select's digit choices over its first num_levels levels, replayed from their
    summed counts (counts [BM]: pointers at each row's Counts[row, 0, 0]; Counts[row, l, d]:
    the visible keys in the bucket of level l with digit d next). Each level takes the largest
    digit with topk keys at or above it, as _radix_select_kernel does. Returns (prefix uint32
    [BM]: the digits chosen; above [BM]: the keys above prefix's bucket; chosen [BM]: the keys
    with the last level's chosen digit; n_visible [BM]: level 0's keys, all a row sees)."""
    NUM_DIGITS: tl.constexpr = 1 << RADIX
    digits = tl.arange(0, NUM_DIGITS)
    prefix = tl.zeros(counts.shape, tl.uint32)
    above = tl.zeros(counts.shape, tl.int32)
    chosen = tl.zeros(counts.shape, tl.int32)
    n_visible = tl.zeros(counts.shape, tl.int32)
    shift = tl.full([], KEY_BITS - RADIX, tl.int32)
    for level in range(num_levels):
        bucket = tl.load(counts[:, None] + level * NUM_DIGITS + digits[None, :])
        n_visible = tl.where(level == 0, tl.sum(bucket, 1), n_visible)
        # keys at or above each digit: those above the bucket, then the bucket's from the top
        at_least = above[:, None] + tl.sum(bucket, 1)[:, None] - tl.cumsum(bucket, 1) + bucket
        digit = tl.maximum(tl.sum((at_least >= topk).to(tl.int32), 1) - 1, 0)
        chosen = tl.sum(tl.where(digits[None, :] == digit[:, None], bucket, 0), 1)
        above += tl.sum(tl.where(digits[None, :] > digit[:, None], bucket, 0), 1)
        prefix = prefix | (digit.to(tl.uint32) << shift.to(tl.uint32))
        shift -= RADIX
    return prefix, above, chosen, n_visible


@triton.jit
def key_slice_tiles(lo, hi, key_slice, num_splits):
    """[first, last) key tiles of slice key_slice of [lo, hi) cut into num_splits (empty past
    the end)."""
    per_slice = tl.cdiv(tl.maximum(hi - lo, 0), num_splits)
    first = lo + key_slice * per_slice
    return first, tl.maximum(tl.minimum(first + per_slice, hi), first)


@triton.jit
def _slice_program(Scores, Mask, States, Slots, Bits, RowLens, CuSeqlensQ, CuSeqlensK, SeqUsed,
                   score_layout, mask_layout, block_layout, shape, num_splits,
                   FORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A split program's key slice, its row tile (`row_tile`'s values) and its rows' int64
    index into the per-row count buffers (batch x heads_out, row tiles x BM)."""
    tile_m = tl.program_id(0) // num_splits
    tile = row_tile(Scores, Mask, States, Slots, Bits, RowLens, CuSeqlensQ, CuSeqlensK, SeqUsed,
                    score_layout, mask_layout, block_layout, shape, tile_m, FORM, BLOCK_M,
                    BLOCK_N)
    row_index = (tl.program_id(1) * (tl.num_programs(0) // num_splits) * BLOCK_M + tile[4]) \
        .to(tl.int64)
    return tl.program_id(0) % num_splits, tile, row_index


@triton.jit(do_not_specialize=["level"])
def _slice_digit_counts_kernel(Scores, Mask, States, Slots, Bits, RowLens, CuSeqlensQ,
                               CuSeqlensK, SeqUsed, Counts, SliceCounts, score_layout,
                               mask_layout, block_layout, shape, num_splits, level,
                               FORM: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, RADIX: tl.constexpr,
                               KEY_BITS: tl.constexpr):
    """Level `level` of the split radix select: program (row tile x key slice, batch x
    heads_out) counts, for each row, the visible keys of its slice in the bucket the earlier
    levels chose, by their next digit, and adds them to Counts (batch x heads_out, row tiles x
    BM, levels, digits), zeroed before level 0. The last level also stores each slice's own
    counts in SliceCounts (batch x heads_out, row tiles x BM, num_splits, digits): its
    ties at the threshold, which place the tie bound."""
    key_slice, tile, row_index = _slice_program(
        Scores, Mask, States, Slots, Bits, RowLens, CuSeqlensQ, CuSeqlensK, SeqUsed,
        score_layout, mask_layout, block_layout, shape, num_splits, FORM, BLOCK_M, BLOCK_N)
    _, _, _, _, rows, lo, hi, view = tile
    topk = shape[0]
    NUM_DIGITS: tl.constexpr = 1 << RADIX
    NUM_LEVELS: tl.constexpr = KEY_BITS // RADIX
    counts = Counts + row_index * NUM_LEVELS * NUM_DIGITS
    prefix, _, _, n_visible = level_descent(counts, level, topk, RADIX, KEY_BITS)
    # rows seeing at most topk keys keep them all: a tile of only those stops after level 0
    if (level == 0) | (tl.max(n_visible, 0) > topk):
        digits = tl.arange(0, NUM_DIGITS)
        shift = (tl.zeros([], tl.int32) + KEY_BITS - RADIX * (level + 1)).to(tl.uint32)
        bucket = (prefix >> shift)[:, None] | digits[None, :].to(tl.uint32)  # [BM, ND]
        level_counts = tl.zeros([BLOCK_M, NUM_DIGITS], tl.int32)
        first, last = key_slice_tiles(lo, hi, key_slice, num_splits)
        for i in range(last - first):
            keys, visible = visible_keys(view, (first + i) * BLOCK_N, FORM, BLOCK_N, KEY_BITS)
            hits = ((keys >> shift)[:, :, None] == bucket[:, None, :]) & visible[:, :, None]
            level_counts += tl.sum(hits.to(tl.int32), 1)
        # rows past the last add zeros (they see no key) to rows of their own: no mask
        tl.atomic_add(counts[:, None] + level * NUM_DIGITS + digits[None, :], level_counts,
                      sem="relaxed")
        if level == NUM_LEVELS - 1:
            slice_counts = SliceCounts + (row_index * num_splits + key_slice) * NUM_DIGITS
            tl.store(slice_counts[:, None] + digits[None, :], level_counts)


@triton.jit
def _slice_tie_bound_kernel(Scores, Mask, States, Slots, Bits, RowLens, CuSeqlensQ, CuSeqlensK,
                            SeqUsed, Counts, SliceCounts, Threshold, LastTie, score_layout,
                            mask_layout, block_layout, out_layout, shape, num_splits,
                            FORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            RADIX: tl.constexpr, KEY_BITS: tl.constexpr):
    """The split radix select's threshold pairs, from every level's counts: program (row tile
    x key slice, batch x heads_out). Slice 0 writes its rows' thresholds, and their tie bounds
    where no tie at the threshold is cut; the slice holding a cut row's last kept tie (the
    slices' own tie counts before it fall short of it) finds it among its keys."""
    key_slice, tile, row_index = _slice_program(
        Scores, Mask, States, Slots, Bits, RowLens, CuSeqlensQ, CuSeqlensK, SeqUsed,
        score_layout, mask_layout, block_layout, shape, num_splits, FORM, BLOCK_M, BLOCK_N)
    off_b, off_h, first_q, seqlen_q, rows, lo, hi, view = tile
    topk = shape[0]
    NUM_DIGITS: tl.constexpr = 1 << RADIX
    NUM_LEVELS: tl.constexpr = KEY_BITS // RADIX
    prefix, above, ties, n_visible = level_descent(Counts + row_index * NUM_LEVELS * NUM_DIGITS,
                                                   NUM_LEVELS, topk, RADIX, KEY_BITS)
    selects = n_visible > topk
    needed = topk - above
    cut = selects & (ties > needed)
    inside = rows < seqlen_q
    out = pair_offsets(out_layout, off_b, off_h, first_q, rows)
    if key_slice == 0:
        tl.store(Threshold + out, row_threshold(prefix, selects, Scores, KEY_BITS), mask=inside)
        tl.store(LastTie + out, tl.full([BLOCK_M], _EVERY_TIE, tl.int32), mask=inside & ~cut)
    if tl.max(cut.to(tl.int32), 0) > 0:
        # ties at the threshold in each slice: its count of the last level's chosen digit
        slice_ties = SliceCounts + row_index * num_splits * NUM_DIGITS \
            + (prefix & (NUM_DIGITS - 1)).to(tl.int64)
        before = tl.zeros([BLOCK_M], tl.int32)
        for other in range(key_slice):
            before += tl.load(slice_ties + other * NUM_DIGITS)
        own = tl.load(slice_ties + key_slice * NUM_DIGITS)
        holds = cut & (before < needed) & (needed <= before + own)
        if tl.max(holds.to(tl.int32), 0) > 0:
            first, last = key_slice_tiles(lo, hi, key_slice, num_splits)
            found = needed_tie(view, first, last, prefix, needed, before, FORM, BLOCK_N,
                               KEY_BITS)
            tl.store(LastTie + out, found, mask=inside & holds)


def _head_div(heads_out: int, t: torch.Tensor | None) -> int:
    """Output head h reads head h // div of a (B|1, Hm, ...) input (Hm divides heads_out)."""
    return heads_out if t is None else heads_out // t.shape[1]


def row_thresholds(*args, **kwargs) -> RowThresholds:
    """threshold_pairs(*args, **kwargs) as RowThresholds (views of its two halves)."""
    threshold, last_tie = threshold_pairs(*args, **kwargs)
    return RowThresholds(threshold, last_tie)


def threshold_pairs(topk: int, scores: Elementwise, args: KernelArgs, batch: int,
                    seqlen_q: int, seqlen_k: int, num_heads: int, num_heads_k: int,
                    mask: Elementwise | None = None, block_mask=None,
                    row_lens: torch.Tensor | None = None,
                    packed: PackedSequences | None = None, total_q: int | None = None,
                    seqused_k: torch.Tensor | None = None) -> torch.Tensor:
    """The threshold pairs of `reference.topk_thresholds` on the GPU (or the interpreter), in
    one tensor as the attention kernels read them (TopkTerm.pairs).

    scores / mask: (B|1, Hm, Sq|1, Sk|1) as the attention kernels read them (packed: the
    (1, Hm, total_q|1, max_k|1) view); args: the causal / window bounds; block_mask: an
    omniattn.BlockMask, read through its dense block states, predicate and bitmaps;
    row_lens: int32 (B, Sq) (packed: (total_q,)); packed: (Sq, Sk) are then the longest and
    total_q the packed rows; seqused_k: int32 (B,), not packed: sequence b selects among its
    first seqused_k[b] keys, causal / window aligned to them (split-KV decoding's paged or
    partly used caches; Sk is then what a sequence can hold). Returns int32 (2, B, Hs, Sq|1)
    (packed: (2, 1, Hs, total_q)), Hs the selection's heads: [0] the thresholds, [1] the last
    ties."""
    device = scores.tensor.device
    head_counts = [scores.tensor.shape[1]] + ([mask.tensor.shape[1]] if mask is not None else [])
    if block_mask is not None:
        head_counts.append(block_mask.kv_num_blocks.shape[1])
    heads = selection_heads(num_heads, num_heads_k, *head_counts)
    rows_differ = not (scores.rows_shared and (mask is None or mask.rows_shared)) \
        or args.masked or block_mask is not None or row_lens is not None
    num_rows = seqlen_q if rows_differ else 1
    out_shape = (1, heads, total_q) if packed is not None else (batch, heads, num_rows)
    pairs = torch.empty((2, *out_shape), dtype=torch.int32, device=device)
    threshold, last_tie = pairs
    selects = topk < seqlen_k and threshold.numel() > 0
    # per-key scores of more rows than a radix row tile holds take the range select; fewer
    # (decoding's) take the radix select, split over the GPU: it reads the keys once per digit
    # for all of them, where the range select would sort them and build a wavelet matrix's
    # log2(Sk) levels in one program per key array
    ranges = scores.rows_shared and (mask is None or mask.rows_shared) and block_mask is None \
        and (rows_differ or packed is not None) and seqlen_q > RANGE_SELECT_ROWS
    # the radix select writes every pair of padded rows: no fill kernels (or torch.full, which
    # call plans do not replay) where it runs
    if not selects or ranges or packed is not None:
        threshold.fill_(KEEP_ALL)
        last_tie.fill_(EVERY_TIE)
    if not selects:
        return pairs
    if ranges:
        range_thresholds(topk, scores, mask, args, batch, seqlen_q, seqlen_k, row_lens, packed,
                         threshold, last_tie, seqused_k)
        return pairs
    block_m, block_n, radix = radix_tiles(num_rows)
    unused = (placeholder(device, torch.float32), (0, 0, 0, 0, 1))
    if block_mask is not None:
        states = block_mask.states.to(device)
        bits = block_mask.kernel_bits
        slots, slot_strides, bitmaps = bits.operands() if bits is not None \
            else BlockBits.placeholder_operands(device)
        block_layout = (*broadcast_strides(states), _head_div(heads, states), *slot_strides,
                        *block_mask.block_size, block_mask.predicate.left,
                        block_mask.predicate.right)
    else:
        bits = None
        states = placeholder(device, torch.int8)
        slots, slot_strides, bitmaps = BlockBits.placeholder_operands(device)
        block_layout = (0, 0, 0, 0, 1, *slot_strides, 16, 16, -1, -1)
    score_tensor, *score_strides = scores.operands()[:-1]
    mask_tensor, mask_layout = unused if mask is None else (
        mask.tensor, (*mask.operands()[1:-1], _head_div(heads, mask.tensor)))
    row_lens_operands = (placeholder(device), 0) if row_lens is None else \
        (row_lens, row_lens.stride(0) if row_lens.dim() == 2 else 0)
    sources = (score_tensor, mask_tensor, states, slots, bitmaps, row_lens_operands[0],
               *packed_operands(packed, device),
               seqused_k if seqused_k is not None else placeholder(device))
    layouts = ((*score_strides, _head_div(heads, scores.tensor)), mask_layout, block_layout)
    shape = (topk, num_rows, seqlen_k, heads, args.window_left, args.window_right,
             row_lens_operands[1])
    form = (args.has_left, args.has_right, mask is not None, block_mask is not None,
            bits is not None, row_lens is not None, packed is not None, seqused_k is not None,
            scores.rows_shared, scores.cols_shared, mask is not None and mask.rows_shared,
            mask is not None and mask.cols_shared)
    out_layout = (0 if packed is not None else threshold.stride(0), threshold.stride(1))
    batch_heads = threshold.shape[0] * heads if packed is None else packed.batch * heads
    row_tiles = cdiv(num_rows, block_m)
    splits = key_splits(row_tiles * batch_heads, cdiv(seqlen_k, block_n),
                        INTERPRETER_SM_COUNT if interpreting() else sm_count(device))
    # 16-bit scores: 16-bit keys, half the digits (the split select's levels: half its launches)
    key_bits = 16 if score_tensor.element_size() == 2 else 32
    tiles = dict(FORM=form, BLOCK_M=block_m, BLOCK_N=block_n, RADIX=radix, KEY_BITS=key_bits,
                 num_warps=1 if interpreting() else RADIX_NUM_WARPS)
    if splits == 1:
        launch(_radix_select_kernel, (row_tiles, batch_heads), *sources, threshold, last_tie,
               *layouts, out_layout, shape, **tiles)
        return pairs
    # the split select: per level, each slice adds its counts to its rows'; then the pairs
    num_levels, num_digits = key_bits // radix, 1 << radix
    counts = torch.zeros(batch_heads, row_tiles * block_m, num_levels, num_digits,
                         dtype=torch.int32, device=device)
    slice_counts = torch.empty(batch_heads, row_tiles * block_m, splits, num_digits,
                               dtype=torch.int32, device=device)
    grid = (row_tiles * splits, batch_heads)
    for level in range(num_levels):
        launch(_slice_digit_counts_kernel, grid, *sources, counts, slice_counts, *layouts, shape,
               splits, level, **tiles)
    launch(_slice_tie_bound_kernel, grid, *sources, counts, slice_counts, threshold, last_tie,
           *layouts, out_layout, shape, splits, **tiles)
    return pairs


def radix_tiles(num_rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, digit bits) of the radix select: no more rows per program than the
    rows there are (one row per (batch, head), as a decode step's, left 15 of 16 idle), the
    keys per step making up the rest of the tile."""
    block_m, block_n, radix = (INTERPRETER_BLOCK_M, INTERPRETER_BLOCK_N, INTERPRETER_RADIX_BITS) \
        if interpreting() else (RADIX_BLOCK_M, RADIX_BLOCK_N, RADIX_BITS)
    rows = min(block_m, next_power_of_2(num_rows))
    return rows, block_m * block_n // rows, radix


def key_splits(row_programs: int, key_tiles: int, sms: int) -> int:
    """Slices each row tile's keys are cut into, a program each: where the row tiles alone
    leave SMs idle (fewer than two programs per SM: decoding's few rows, each walking all its
    keys serially), enough for two per SM, of at least MIN_SLICE_TILES key tiles; 1 (the
    single-program select) where they fill the GPU, as in prefill: splitting would add a
    launch per level and the counts' traffic for no more parallelism."""
    if row_programs >= 2 * sms:
        return 1
    return max(1, min(cdiv(2 * sms, row_programs), key_tiles // MIN_SLICE_TILES))


@triton.jit
def _keep_mask_kernel(
    Scores, stride_sb, stride_sh, stride_sm, stride_sn, scores_div,
    Mask, stride_mb, stride_mh, stride_mm, stride_mn, mask_div,
    Threshold, LastTie, stride_tb, stride_th, stride_tm, threshold_div,
    Keep, stride_kb, stride_kh, stride_km, seqlen_q, seqlen_k, heads_out, window_left,
    window_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, SCORES_ROWS_SHARED: tl.constexpr,
    SCORES_COLS_SHARED: tl.constexpr, MASK_ROWS_SHARED: tl.constexpr,
    MASK_COLS_SHARED: tl.constexpr,
):
    """The kept keys of a [BLOCK_M, BLOCK_N] tile, program (row tile, key tile, batch x
    heads_out): visible and at or above the row's threshold pair (predicate.topk_keep), as
    uint8 into Keep (B, heads_out, Sq, Sk)."""
    off_b = tl.program_id(2) // heads_out
    off_h = tl.program_id(2) % heads_out
    start_m = tl.program_id(0) * BLOCK_M
    start_n = tl.program_id(1) * BLOCK_N
    rows = start_m + tl.arange(0, BLOCK_M)
    cols = start_n + tl.arange(0, BLOCK_N)
    inside = rows < seqlen_q
    scores = Scores + off_b.to(tl.int64) * stride_sb + (off_h // scores_div).to(tl.int64) \
        * stride_sh + start_m.to(tl.int64) * stride_sm
    mask = Mask + off_b.to(tl.int64) * stride_mb + (off_h // mask_div).to(tl.int64) * stride_mh \
        + start_m.to(tl.int64) * stride_mm
    placeholder = Scores
    keys, visible = tile_keys(
        scores, mask, placeholder, placeholder, placeholder, rows, start_n,
        tl.where(inside, seqlen_k, 0), seqlen_q - start_m, seqlen_q, seqlen_k,
        seqlen_k - seqlen_q, window_left, window_right, stride_sm, stride_sn, stride_mm,
        stride_mn, 0, 0, 0, 0, 1, 1, -1, -1, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_MASK, False,
        False, SCORES_ROWS_SHARED, SCORES_COLS_SHARED, MASK_ROWS_SHARED, MASK_COLS_SHARED, 32)
    pairs = off_b.to(tl.int64) * stride_tb + (off_h // threshold_div) * stride_th \
        + rows * stride_tm
    threshold = tl.load(Threshold + pairs, mask=inside, other=0)
    last_tie = tl.load(LastTie + pairs, mask=inside, other=0)
    threshold = (threshold.to(tl.uint32, bitcast=True) ^ 0x80000000)[:, None]
    keep = visible & ((keys > threshold) | ((keys == threshold)
                                           & (cols[None, :] <= last_tie[:, None])))
    out = Keep + off_b.to(tl.int64) * stride_kb + off_h.to(tl.int64) * stride_kh \
        + rows[:, None].to(tl.int64) * stride_km + cols[None, :]
    tl.store(out, keep.to(tl.uint8), mask=inside[:, None] & (cols[None, :] < seqlen_k))


def keep_mask(pairs: RowThresholds, scores: Elementwise, args: KernelArgs, batch: int,
              seqlen_q: int, seqlen_k: int, heads: int,
              mask: Elementwise | None = None) -> torch.Tensor:
    """Bool (B, heads, Sq, Sk): the keys `pairs` (from row_thresholds on the same scores, mask
    and causal / window bounds; (B, Hs, Sq|1)) keep, the mask materialised. Integer
    comparisons of the same order keys: bit-identical to predicate.topk_keep."""
    device = scores.tensor.device
    keep = torch.empty((batch, heads, seqlen_q, seqlen_k), dtype=torch.bool, device=device)
    if keep.numel() == 0:
        return keep
    block_m, block_n = (INTERPRETER_BLOCK_M, INTERPRETER_BLOCK_N) if interpreting() else (32, 128)
    unused = (placeholder(device, torch.float32), 0, 0, 0, 0)
    threshold = pairs.threshold
    launch(_keep_mask_kernel, (cdiv(seqlen_q, block_m), cdiv(seqlen_k, block_n), batch * heads),
           *scores.operands()[:-1], _head_div(heads, scores.tensor),
           *(mask.operands()[:-1] if mask is not None else unused),
           _head_div(heads, mask.tensor if mask is not None else None),
           threshold, pairs.last_tie, *broadcast_strides(threshold), _head_div(heads, threshold),
           keep.view(torch.uint8), *keep.stride()[:3], seqlen_q, seqlen_k, heads,
           args.window_left, args.window_right, BLOCK_M=block_m, BLOCK_N=block_n,
           HAS_LEFT=args.has_left, HAS_RIGHT=args.has_right, HAS_MASK=mask is not None,
           SCORES_ROWS_SHARED=scores.rows_shared, SCORES_COLS_SHARED=scores.cols_shared,
           MASK_ROWS_SHARED=mask is not None and mask.rows_shared,
           MASK_COLS_SHARED=mask is not None and mask.cols_shared,
           num_warps=1 if interpreting() else 4)
    return keep
