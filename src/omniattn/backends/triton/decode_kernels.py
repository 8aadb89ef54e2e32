"""Split-KV decoding kernels (decode.py launches them): a few query rows per sequence, each
(batch, KV head)'s keys split over programs, the partial results merged by their LSE.

Rows are packed by GQA group: packed row r of KV head hk is query row r // group of query head
hk * group + r % group, so one tile holds every query head that reads this KV head and each
K/V tile is loaded once per KV head, not once per query head. Keys are read from a contiguous
(B, Sk, Hk, D) cache or through a block table from pages (num_pages, page_size, Hk, D); a
sequence uses its first seqused_k[b] keys (all Sk without seqused_k), and causal / window
align to that count (bottom-right)."""
from __future__ import annotations

import triton
import triton.language as tl

from ...kernels.common import (LOG2E, row_pairs, scores_log2, topk_keep, used_keys,
                               visible_elements)


@triton.jit
def _key_rows(BlockTable, table_row, keys, in_keys, off_b, stride_batch_or_page, stride_n,
              PAGE_SIZE: tl.constexpr):
    """[BN] int64 offsets of keys' rows in a K or V cache: through the block table (a page per
    PAGE_SIZE keys) or at batch off_b of a contiguous cache (PAGE_SIZE 0)."""
    if PAGE_SIZE > 0:
        page = tl.load(BlockTable + table_row + keys // PAGE_SIZE, mask=in_keys, other=0)
        return page.to(tl.int64) * stride_batch_or_page + (keys % PAGE_SIZE).to(tl.int64) * stride_n
    return off_b.to(tl.int64) * stride_batch_or_page + keys.to(tl.int64) * stride_n


@triton.jit
def _keywise_rows(T, stride_b, stride_h, stride_m, head_div, off_b, first_head, heads, offs_m):
    """Pointers at key 0 of a (B|1, Hm, Sq|1, Sk|1) mask, bias or top-k scores for a tile of
    packed rows: (the row of batch off_b, head first_head // head_div and query row 0, the one
    `_keywise_tile` reads for the whole tile when every packed row reads it; [BM] each packed
    row's own, of its query head `heads` // head_div and query row offs_m)."""
    batch = T + off_b.to(tl.int64) * stride_b
    base = batch + (first_head // head_div).to(tl.int64) * stride_h
    rows = batch + (heads // head_div).to(tl.int64) * stride_h + offs_m.to(tl.int64) * stride_m
    return base, rows


@triton.jit
def _keywise_tile(base, rows_base, keys, stride_n, in_rows, in_keys, other,
                  ROW_SHARED: tl.constexpr):
    """[BM, BN] of a mask or bias read per key: one [BN] row for the whole tile where every
    packed row reads the same one (ROW_SHARED, at `base`), else each row's own (rows_base
    [BM] pointers; a size-1 key dim has stride_n 0)."""
    if ROW_SHARED:
        tile = tl.load(base + keys * stride_n, mask=in_keys, other=other)[None, :]
    else:
        tile = tl.load(rows_base[:, None] + keys[None, :] * stride_n,
                       mask=in_rows[:, None] & in_keys[None, :], other=other)
    return tile


@triton.jit
def decode_split_kernel(
    Q, K, V, Out, Lse, OutPart, LsePart, BlockTable, SeqUsed, RowLens, Mask, Bias,
    TopkScores, TopkPairs,
    q_strides, k_strides, v_strides, o_strides, lse_strides, part_strides, table_stride,
    row_lens_stride, mask_strides, bias_strides, topk_layout, shape, window, scores,
    FORM: tl.constexpr, MASK_FORM: tl.constexpr, BIAS_FORM: tl.constexpr,
    TOPK_FORM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program: packed rows [tile_m * BM, +BM) of (batch, KV head) over its split's share of
    the key tiles those rows see. Grid (B * Hk, row tiles, splits).

    Writes out / lse directly with one split (SPLIT False), else the split's normalised fp32
    output and its lse (log2 units, -inf where it saw no key) into OutPart (S, B, Hk, R, D) /
    LsePart (S, B, Hk, R) for decode_combine_kernel. Grouped arguments: *_strides of q / k / v /
    out (batch or page, row, head), lse (batch, head), part (out: split, batch, head, row; lse:
    split, batch, head), mask / bias (batch, head, row, key, head divisor); topk_layout
    (TopkTerm.operands' strides: the top-k scores' as a bias's, then the threshold pairs'
    (pair, batch, head, row) strides and head divisor); shape (Sq, Sk capacity, Hk, group,
    splits); window (left, right); scores (`scores_log2`'s terms). FORM: (causal-or-window
    right bound, left bound, softcap, seqused_k, per-row lengths, split); MASK_FORM /
    BIAS_FORM / TOPK_FORM: (given, one row for the whole tile; top-k: of its scores).

    Top-k: each packed row keeps the keys its own (batch, query head, query row) threshold pair
    selects (`topk_keep`), among those it sees; the pairs are computed over every key of the
    sequence, so each split applies them to its share alone."""
    stride_qb, stride_qm, stride_qh = q_strides
    stride_kb, stride_kn, stride_kh = k_strides
    stride_vb, stride_vn, stride_vh = v_strides
    stride_ob, stride_om, stride_oh = o_strides
    stride_lb, stride_lh = lse_strides
    stride_ps, stride_pb, stride_ph, stride_pr, stride_pls, stride_plb, stride_plh = part_strides
    stride_mb, stride_mh, stride_mm, stride_mn, mask_head_div = mask_strides
    stride_bb, stride_bh, stride_bm, stride_bn, bias_head_div = bias_strides
    (stride_tsb, stride_tsh, stride_tsm, stride_tsn, score_head_div,
     stride_tp, stride_tpb, stride_tph, stride_tpm, pair_head_div) = topk_layout
    seqlen_q, seqlen_k, num_heads_k, group, num_splits = shape
    window_left, window_right = window
    qk_scale_log2, softcap_inv_scaled, softcap_log2 = scores
    # a constexpr tuple's items stay constexpr when indexed (not when unpacked)
    HAS_RIGHT: tl.constexpr = FORM[0]
    HAS_LEFT: tl.constexpr = FORM[1]
    SOFTCAP: tl.constexpr = FORM[2]
    HAS_SEQUSED: tl.constexpr = FORM[3]
    HAS_ROW_LENS: tl.constexpr = FORM[4]
    SPLIT: tl.constexpr = FORM[5]
    HAS_MASK: tl.constexpr = MASK_FORM[0]
    MASK_ROW_SHARED: tl.constexpr = MASK_FORM[1]
    HAS_BIAS: tl.constexpr = BIAS_FORM[0]
    BIAS_ROW_SHARED: tl.constexpr = BIAS_FORM[1]
    HAS_TOPK: tl.constexpr = TOPK_FORM[0]
    TOPK_ROW_SHARED: tl.constexpr = TOPK_FORM[1]

    off_bh = tl.program_id(0)
    tile_m = tl.program_id(1)
    split = tl.program_id(2)
    off_b = off_bh // num_heads_k
    off_hk = off_bh % num_heads_k
    num_rows = seqlen_q * group
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # packed rows
    in_rows = rows < num_rows
    offs_m = rows // group  # query row
    heads = off_hk * group + rows % group  # query head
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < HEAD_DIM

    seqlen_k = used_keys(SeqUsed, off_b, seqlen_k, HAS_SEQUSED)
    diag_offset = seqlen_k - seqlen_q
    key_end = tl.zeros([BLOCK_M], tl.int32) + seqlen_k
    if HAS_ROW_LENS:
        lens = tl.load(RowLens + off_b.to(tl.int64) * row_lens_stride + offs_m, mask=in_rows,
                       other=0)
        key_end = tl.minimum(tl.maximum(lens, 0), seqlen_k)

    # the keys these rows see: the window's bounds for the tile's first and last query rows,
    # clamped to >= 0 before dividing (the interpreter floors negatives, the compiler truncates)
    first_m = (tile_m * BLOCK_M) // group
    last_m = (tl.minimum(tile_m * BLOCK_M + BLOCK_M, num_rows) - 1) // group
    key_lo = 0
    key_hi = tl.max(tl.where(in_rows, key_end, 0), 0)
    if HAS_LEFT:
        key_lo = tl.maximum(first_m + diag_offset - window_left, 0)
    if HAS_RIGHT:
        key_hi = tl.maximum(tl.minimum(key_hi, last_m + diag_offset + window_right + 1), 0)
    tile_lo = key_lo // BLOCK_N
    tile_hi = tl.maximum(tl.cdiv(key_hi, BLOCK_N), tile_lo)
    # this split's share: consecutive tiles, the same count for every split but the last ones
    per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
    first_tile = tl.minimum(tile_lo + split * per_split, tile_hi)
    last_tile = tl.minimum(first_tile + per_split, tile_hi)

    q_ptrs = Q + off_b.to(tl.int64) * stride_qb + offs_m[:, None].to(tl.int64) * stride_qm \
        + heads[:, None].to(tl.int64) * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=in_rows[:, None] & in_d[None, :], other=0.0)  # [BM, BD]
    k_head = K + off_hk.to(tl.int64) * stride_kh + offs_d[None, :]
    v_head = V + off_hk.to(tl.int64) * stride_vh + offs_d[None, :]
    table_row = off_b.to(tl.int64) * table_stride
    mask_base, mask_rows = _keywise_rows(Mask, stride_mb, stride_mh, stride_mm, mask_head_div,
                                         off_b, off_hk * group, heads, offs_m)
    bias_base, bias_rows = _keywise_rows(Bias, stride_bb, stride_bh, stride_bm, bias_head_div,
                                         off_b, off_hk * group, heads, offs_m)
    score_base, score_rows = _keywise_rows(TopkScores, stride_tsb, stride_tsh, stride_tsm,
                                           score_head_div, off_b, off_hk * group, heads, offs_m)
    # each packed row's own pair: its batch, query head and query row
    threshold, last_tie = row_pairs(
        TopkPairs + off_b.to(tl.int64) * stride_tpb
        + (heads // pair_head_div).to(tl.int64) * stride_tph, stride_tp, offs_m, seqlen_q,
        stride_tpm, HAS_TOPK)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for tile_n in range(first_tile, last_tile):
        keys = tile_n * BLOCK_N + offs_n
        in_keys = keys < seqlen_k
        k_rows = _key_rows(BlockTable, table_row, keys, in_keys, off_b, stride_kb, stride_kn,
                           PAGE_SIZE)
        k = tl.load(k_head + k_rows[:, None], mask=in_keys[:, None] & in_d[None, :],
                    other=0.0)  # [BN, BD]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BM, BN]
        s, _ = scores_log2(qk, qk_scale_log2, softcap_inv_scaled, softcap_log2, SOFTCAP)
        if HAS_BIAS:
            bias = _keywise_tile(bias_base, bias_rows, keys, stride_bn, in_rows, in_keys, 0.0,
                                 BIAS_ROW_SHARED)
            s += bias.to(tl.float32) * LOG2E
        visible = visible_elements(offs_m, keys, key_end, diag_offset, window_left,
                                   window_right, HAS_LEFT, HAS_RIGHT, True)
        if HAS_MASK:
            keep = _keywise_tile(mask_base, mask_rows, keys, stride_mn, in_rows, in_keys, 0,
                                 MASK_ROW_SHARED)
            visible = visible & (keep != 0)
        if HAS_TOPK:
            top_scores = _keywise_tile(score_base, score_rows, keys, stride_tsn, in_rows,
                                       in_keys, 0.0, TOPK_ROW_SHARED)
            visible = visible & topk_keep(top_scores, keys, threshold, last_tie, False)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with nothing visible yet keeps m = -inf; subtract 0 there: no inf - inf
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = _key_rows(BlockTable, table_row, keys, in_keys, off_b, stride_vb, stride_vn,
                           PAGE_SIZE)
        v = tl.load(v_head + v_rows[:, None], mask=in_keys[:, None] & in_d[None, :],
                    other=0.0)  # [BN, BD]
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    # a NaN score makes l NaN, not 0: the row's output and lse stay NaN
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    if SPLIT:
        part = off_b.to(tl.int64) * stride_pb + off_hk.to(tl.int64) * stride_ph
        tl.store(OutPart + split.to(tl.int64) * stride_ps + part + rows[:, None] * stride_pr
                 + offs_d[None, :], out, mask=in_rows[:, None] & in_d[None, :])
        tl.store(LsePart + split.to(tl.int64) * stride_pls + off_b.to(tl.int64) * stride_plb
                 + off_hk.to(tl.int64) * stride_plh + rows, lse, mask=in_rows)
    else:
        _store_rows(Out, Lse, out, lse / LOG2E, off_b, offs_m, heads, offs_d, in_rows, in_d,
                    stride_ob, stride_om, stride_oh, stride_lb, stride_lh)


@triton.jit
def _store_rows(Out, Lse, out, lse, off_b, offs_m, heads, offs_d, in_rows, in_d,
                stride_ob, stride_om, stride_oh, stride_lb, stride_lh):
    """Packed rows' outputs [BM, BD] and lse [BM] (natural log) to out (B, Sq, H, D) and lse
    (B, H, Sq)."""
    o_ptrs = Out + off_b.to(tl.int64) * stride_ob + offs_m[:, None].to(tl.int64) * stride_om \
        + heads[:, None].to(tl.int64) * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=in_rows[:, None] & in_d[None, :])
    tl.store(Lse + off_b.to(tl.int64) * stride_lb + heads.to(tl.int64) * stride_lh + offs_m,
             lse, mask=in_rows)


@triton.jit
def decode_combine_kernel(
    OutPart, LsePart, Out, Lse, part_strides, o_strides, lse_strides, shape,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """out = sum over splits of exp(lse_s - lse) * out_s, lse = log(sum of exp(lse_s)) for
    BLOCK_M packed rows of one (batch, KV head). Grid (B * Hk, row tiles). A row no split saw a
    key for gets 0 and -inf; a NaN in any split's lse reaches out and lse. Grouped arguments as
    decode_split_kernel's; shape (Sq, Hk, group, splits)."""
    stride_ps, stride_pb, stride_ph, stride_pr, stride_pls, stride_plb, stride_plh = part_strides
    stride_ob, stride_om, stride_oh = o_strides
    stride_lb, stride_lh = lse_strides
    seqlen_q, num_heads_k, group, num_splits = shape
    off_bh = tl.program_id(0)
    off_b = off_bh // num_heads_k
    off_hk = off_bh % num_heads_k
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < seqlen_q * group
    offs_d = tl.arange(0, BLOCK_D)
    in_d = offs_d < HEAD_DIM
    splits = tl.arange(0, BLOCK_S)
    lse_rows = LsePart + off_b.to(tl.int64) * stride_plb + off_hk.to(tl.int64) * stride_plh
    lse_parts = tl.load(lse_rows + splits[:, None].to(tl.int64) * stride_pls + rows[None, :],
                        mask=(splits[:, None] < num_splits) & in_rows[None, :],
                        other=float("-inf"))  # [BS, BM]
    m = tl.max(lse_parts, 0)
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(lse_parts - m_shift[None, :]), 0)
    empty = total == 0.0
    lse = tl.where(empty, float("-inf"), m_shift + tl.log2(tl.where(empty, 1.0, total)))
    lse_shift = tl.where(empty, 0.0, lse)
    out_rows = OutPart + off_b.to(tl.int64) * stride_pb + off_hk.to(tl.int64) * stride_ph \
        + rows[:, None] * stride_pr + offs_d[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for _ in range(num_splits):  # pointers step by a split: 64-bit offsets
        weight = tl.exp2(tl.load(lse_rows + rows, mask=in_rows, other=float("-inf")) - lse_shift)
        part = tl.load(out_rows, mask=in_rows[:, None] & in_d[None, :], other=0.0)
        acc += weight[:, None] * part
        lse_rows += stride_pls
        out_rows += stride_ps
    _store_rows(Out, Lse, acc, lse / LOG2E, off_b, rows // group, off_hk * group + rows % group,
                offs_d, in_rows, in_d, stride_ob, stride_om, stride_oh, stride_lb, stride_lh)
