"""The Triton backward's kernel (launched by backward.py): one launch whose first programs
compute dK/dV for a key tile and the rest dQ for a query tile (or dQ added by the dK/dV
programs with atomics). The small kernels around it are in backward_steps.py."""
from __future__ import annotations

import triton
import triton.language as tl

from ...kernels.common import (LOG2E, block_bits_keep, dropout_keep, implicit_kv_range,
                               implicit_q_range, length_kv_range, length_q_range, load_pair_tile,
                               load_rows, row_key_end, row_pairs, schedule_phase, schedule_rows,
                               scores_log2, sequence_bounds, store_pair_tile, topk_tile_keep,
                               visible_elements)


@triton.jit
def _dkdv_tiles(
    dk, dv, dbias_keys, k, v, q_tile, do_tile, lse_tile, delta_tile,
    tile_list, first_tile, num_tiles, offs_m, offs_n, offs_d, stride_qm, stride_dom,
    mask_view, bias_view, dbias_view, cols_left, row_lens, row_order, seqlen_q, seqlen_k,
    window, scores, rng, bits, dq_tile, stride_dqm, softmax_scale, topk_view,
    FROM_LIST: tl.constexpr, PARTIAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    MASK_FORM: tl.constexpr, BIAS_FORM: tl.constexpr, TOPK_FORM: tl.constexpr,
    HAS_ROW_LENS: tl.constexpr, DROPOUT: tl.constexpr, DBIAS: tl.constexpr,
    DBIAS_ACCUMULATE: tl.constexpr,
    HAS_BITS: tl.constexpr, USER_BQ: tl.constexpr, USER_BK: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, ROW_ORDER: tl.constexpr,
    WITH_DK: tl.constexpr, WITH_DV: tl.constexpr,
):
    """Accumulate dK, dV [BN, BD] (WITH_DK / WITH_DV: the ones asked for) of one key tile over
    `num_tiles` query tiles (transposed form: scores are [BN, BM]). Rows past Sq load q = dO = 0
    and lse = +inf, so they add nothing. mask_cols / bias_cols / dbias_cols point at this key
    tile's first key (query 0). With DBIAS the score gradient goes to dbias: stored per element,
    or summed over queries into dbias_keys [BN] when the bias has one row for every query. With
    ATOMIC_DQ this tile's share of dQ (ds^T k, scaled) is added into the fp32 dq_tile ([BM, BD]
    pointers at query 0), row r at the caller's row row_order[r] with ROW_ORDER (q, dO, lse and
    delta come in length order). Grouped arguments: mask_view / bias_view / dbias_view (pointer,
    stride along queries, stride along keys), window (diag_offset, left, right), scores (`scores_log2`'s
    scale and softcap terms), rng (seed, base, stride, dropout_p), bits (this key tile's bitmap
    column, its stride along query blocks, the bitmaps), topk_view (the top-k scores at this key
    tile's first key, their query and key strides, this head's threshold pairs at query 0, the
    pairs' pair and row strides); MASK_FORM / BIAS_FORM / TOPK_FORM (given, rows shared, columns
    shared)."""
    mask_cols, stride_mm, stride_mn = mask_view
    score_cols, stride_tm, stride_tn, pair_rows, stride_tp, stride_tpm = topk_view
    bias_cols, stride_bm, stride_bn = bias_view
    dbias_cols, stride_dbm, stride_dbn = dbias_view
    diag_offset, window_left, window_right = window
    qk_scale_log2, softcap_inv_scaled, softcap_log2 = scores
    rng_seed, rng_base, rng_stride, dropout_p = rng
    bit_col, stride_sq, block_bits = bits
    # a constexpr tuple's items stay constexpr when indexed (not when unpacked)
    HAS_MASK: tl.constexpr = MASK_FORM[0]
    MASK_ROWS_SHARED: tl.constexpr = MASK_FORM[1]
    MASK_COLS_SHARED: tl.constexpr = MASK_FORM[2]
    HAS_BIAS: tl.constexpr = BIAS_FORM[0]
    BIAS_ROWS_SHARED: tl.constexpr = BIAS_FORM[1]
    BIAS_COLS_SHARED: tl.constexpr = BIAS_FORM[2]
    local_n = tl.arange(0, offs_n.shape[0])
    if FROM_LIST:
        # the next index is loaded one iteration ahead: tile addresses never wait on it
        next_tile = tl.load(tile_list)
    for i in range(num_tiles):
        if FROM_LIST:
            tile_m = next_tile
            next_tile = tl.load(tile_list + tl.minimum(i + 1, num_tiles - 1))
        else:
            tile_m = first_tile + i
        start_m = tile_m * BLOCK_M
        rows = start_m + offs_m
        q = load_rows(q_tile + start_m.to(tl.int64) * stride_qm, rows, seqlen_q, offs_d, EVEN_M,
                      HEAD_DIM, BLOCK_D)  # [BM, BD]
        do = load_rows(do_tile + start_m.to(tl.int64) * stride_dom, rows, seqlen_q, offs_d, EVEN_M,
                       HEAD_DIM, BLOCK_D)  # [BM, BD]
        if EVEN_M:
            lse = tl.load(lse_tile + rows)
            delta = tl.load(delta_tile + rows)
        else:
            lse = tl.load(lse_tile + rows, mask=rows < seqlen_q, other=float("inf"))
            delta = tl.load(delta_tile + rows, mask=rows < seqlen_q, other=0.0)
        # a row that saw no key has lse = -inf: +inf makes its probabilities 0
        lse = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # [BN, BM]
        s_t, capped_t = scores_log2(qk_t, qk_scale_log2, softcap_inv_scaled, softcap_log2, SOFTCAP)
        if HAS_BIAS:
            bias_t = load_pair_tile(bias_cols + start_m.to(tl.int64) * stride_bm, local_n, offs_m,
                                    stride_bn, stride_bm, cols_left, seqlen_q - start_m,
                                    BIAS_COLS_SHARED, BIAS_ROWS_SHARED, EVEN_N, EVEN_M)
            s_t += bias_t.to(tl.float32) * LOG2E
        p_t = tl.exp2(s_t - lse[None, :])
        if PARTIAL:
            key_end = row_key_end(row_lens, rows, seqlen_q, seqlen_k, HAS_ROW_LENS)  # [BM]
            visible_t = tl.trans(visible_elements(rows, offs_n, key_end, diag_offset, window_left,
                                                  window_right, HAS_LEFT, HAS_RIGHT,
                                                  HAS_ROW_LENS or not EVEN_N))  # [BN, BM]
            if HAS_MASK:
                keep_t = load_pair_tile(mask_cols + start_m.to(tl.int64) * stride_mm, local_n,
                                        offs_m, stride_mn, stride_mm, cols_left,
                                        seqlen_q - start_m, MASK_COLS_SHARED, MASK_ROWS_SHARED,
                                        EVEN_N, EVEN_M)
                visible_t = visible_t & (keep_t != 0)
            if HAS_BITS:
                visible_t = visible_t & block_bits_keep(
                    bit_col + (start_m // USER_BQ) * stride_sq, block_bits, rows, offs_n,
                    USER_BQ, USER_BK, True)
            if TOPK_FORM[0]:
                threshold, last_tie = row_pairs(pair_rows, stride_tp, rows, seqlen_q, stride_tpm,
                                                True)
                visible_t = visible_t & topk_tile_keep(
                    score_cols + start_m.to(tl.int64) * stride_tm, offs_m, local_n, stride_tm,
                    stride_tn, seqlen_q - start_m, cols_left, offs_n, threshold, last_tie,
                    TOPK_FORM, EVEN_M, EVEN_N, True)
            p_t = tl.where(visible_t, p_t, 0.0)
        if WITH_DK:
            # issued before dV's matmul: after it, H100 block-sparse 16k fwd+bwd took 16.72 ms
            # against 16.00 (docs/perf/backward.md, "The dK/dV loop's matmul order")
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # [BN, BM]
        if DROPOUT:
            keep_t = dropout_keep(rng_seed, rng_base, rows, offs_n, rng_stride, dropout_p, True)
        if WITH_DV:
            if DROPOUT:
                # dropped elements carry neither probability to dV nor gradient to dP
                dv += tl.dot(tl.where(keep_t, p_t / (1.0 - dropout_p), 0.0).to(do.dtype), do,
                             input_precision=DOT_PRECISION)
            else:
                dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        if WITH_DK:
            if DROPOUT:
                dp_t = tl.where(keep_t, dp_t / (1.0 - dropout_p), 0.0)
            ds_t = p_t * (dp_t - delta[None, :])  # d loss / d (score + bias)
            if DBIAS:
                if BIAS_ROWS_SHARED:
                    dbias_keys += tl.sum(ds_t, 1)
                else:
                    store_pair_tile(dbias_cols + start_m.to(tl.int64) * stride_dbm, ds_t,
                                    local_n, offs_m, stride_dbn, stride_dbm, cols_left,
                                    seqlen_q - start_m, DBIAS_ACCUMULATE)
            if SOFTCAP:
                ds_t = ds_t * (1.0 - capped_t * capped_t)
            ds_t = ds_t.to(q.dtype)
            dk += tl.dot(ds_t, q, input_precision=DOT_PRECISION)
            if ATOMIC_DQ:
                dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION) * softmax_scale
                if ROW_ORDER:  # dq_tile sits at rows offs_m: move each row to its caller row
                    caller_rows = tl.load(row_order + rows, mask=rows < seqlen_q, other=0)
                    dq_ptrs = dq_tile + (caller_rows - offs_m).to(tl.int64)[:, None] * stride_dqm
                else:
                    dq_ptrs = dq_tile + start_m.to(tl.int64) * stride_dqm  # [BM, BD]
                if EVEN_M and BLOCK_D == HEAD_DIM:
                    tl.atomic_add(dq_ptrs, dq, sem="relaxed")
                else:
                    tl.atomic_add(dq_ptrs, dq, sem="relaxed",
                                  mask=(rows[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM))
    return dk, dv, dbias_keys


@triton.jit
def _dq_tiles(
    dq, dbias_rows, q, do, lse, delta, k_tile, v_tile, tile_list, first_tile, num_tiles,
    offs_m, offs_n, offs_d, stride_kn, stride_vn, mask_view, bias_view, rows_left, dbias_view,
    seqlen_k, key_end, window, scores, rng, bits, topk_view,
    FROM_LIST: tl.constexpr, PARTIAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, KEY_BOUND: tl.constexpr,
    SOFTCAP: tl.constexpr, MASK_FORM: tl.constexpr, BIAS_FORM: tl.constexpr,
    TOPK_FORM: tl.constexpr,
    DROPOUT: tl.constexpr, DBIAS: tl.constexpr, DBIAS_TILES: tl.constexpr,
    HAS_BITS: tl.constexpr, USER_BQ: tl.constexpr, USER_BK: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Accumulate dQ [BM, BD] of one query tile over `num_tiles` key tiles. Keys past Sk load
    k = v = 0, so they add nothing to dQ. With DBIAS (a bias with one column for every key) the
    score gradient is summed over keys into dbias_rows [BM]; with DBIAS_TILES (a full bias, one
    head per query head) it is stored per element from dbias_tile_rows, contiguous along keys.
    Grouped arguments as `_dkdv_tiles`'s (pointers at this query tile's first row, key 0;
    bits: this query tile's bitmap row, its stride along key blocks, the bitmaps; topk_view:
    the top-k scores at this query tile's first row, their strides, the rows' pairs [BM])."""
    mask_rows, stride_mm, stride_mn = mask_view
    score_rows, stride_tm, stride_tn, threshold, last_tie = topk_view
    bias_rows, stride_bm, stride_bn = bias_view
    dbias_tile_rows, stride_dbm, stride_dbn = dbias_view
    diag_offset, window_left, window_right = window
    qk_scale_log2, softcap_inv_scaled, softcap_log2 = scores
    rng_seed, rng_base, rng_stride, dropout_p = rng
    bit_row, stride_sk, block_bits = bits
    # a constexpr tuple's items stay constexpr when indexed (not when unpacked)
    HAS_MASK: tl.constexpr = MASK_FORM[0]
    MASK_ROWS_SHARED: tl.constexpr = MASK_FORM[1]
    MASK_COLS_SHARED: tl.constexpr = MASK_FORM[2]
    HAS_BIAS: tl.constexpr = BIAS_FORM[0]
    BIAS_ROWS_SHARED: tl.constexpr = BIAS_FORM[1]
    BIAS_COLS_SHARED: tl.constexpr = BIAS_FORM[2]
    local_m = tl.arange(0, offs_m.shape[0])
    if FROM_LIST:
        # the next index is loaded one iteration ahead: tile addresses never wait on it
        next_tile = tl.load(tile_list)
    for i in range(num_tiles):
        if FROM_LIST:
            tile_n = next_tile
            next_tile = tl.load(tile_list + tl.minimum(i + 1, num_tiles - 1))
        else:
            tile_n = first_tile + i
        start_n = tile_n * BLOCK_N
        keys = start_n + offs_n
        k = load_rows(k_tile + start_n.to(tl.int64) * stride_kn, keys, seqlen_k, offs_d, EVEN_N,
                      HEAD_DIM, BLOCK_D)  # [BN, BD]
        v = load_rows(v_tile + start_n.to(tl.int64) * stride_vn, keys, seqlen_k, offs_d, EVEN_N,
                      HEAD_DIM, BLOCK_D)  # [BN, BD]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BM, BN]
        s, capped = scores_log2(qk, qk_scale_log2, softcap_inv_scaled, softcap_log2, SOFTCAP)
        if HAS_BIAS:
            bias = load_pair_tile(bias_rows + start_n.to(tl.int64) * stride_bn, local_m, offs_n,
                                  stride_bm, stride_bn, rows_left, seqlen_k - start_n,
                                  BIAS_ROWS_SHARED, BIAS_COLS_SHARED, EVEN_M, EVEN_N)
            s += bias.to(tl.float32) * LOG2E
        p = tl.exp2(s - lse[:, None])
        if PARTIAL:
            visible = visible_elements(offs_m, keys, key_end, diag_offset, window_left,
                                       window_right, HAS_LEFT, HAS_RIGHT, KEY_BOUND)
            if HAS_MASK:
                keep = load_pair_tile(mask_rows + start_n.to(tl.int64) * stride_mn, local_m,
                                      offs_n, stride_mm, stride_mn, rows_left, seqlen_k - start_n,
                                      MASK_ROWS_SHARED, MASK_COLS_SHARED, EVEN_M, EVEN_N)
                visible = visible & (keep != 0)
            if HAS_BITS:
                visible = visible & block_bits_keep(
                    bit_row + (start_n // USER_BK) * stride_sk, block_bits, offs_m, keys,
                    USER_BQ, USER_BK, False)
            if TOPK_FORM[0]:
                visible = visible & topk_tile_keep(
                    score_rows + start_n.to(tl.int64) * stride_tn, local_m, offs_n, stride_tm,
                    stride_tn, rows_left, seqlen_k - start_n, keys, threshold, last_tie,
                    TOPK_FORM, EVEN_M, EVEN_N, False)
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # [BM, BN]
        if DROPOUT:
            dp = tl.where(dropout_keep(rng_seed, rng_base, offs_m, keys, rng_stride, dropout_p,
                                       False), dp / (1.0 - dropout_p), 0.0)
        ds = p * (dp - delta[:, None])
        if DBIAS:
            dbias_rows += tl.sum(ds, 1)
        if DBIAS_TILES:
            store_pair_tile(dbias_tile_rows + start_n.to(tl.int64) * stride_dbn, ds, local_m,
                            offs_n, stride_dbm, stride_dbn, rows_left, seqlen_k - start_n, False)
        if SOFTCAP:
            ds = ds * (1.0 - capped * capped)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq, dbias_rows


@triton.jit
def _topk_program_view(topk_view, off_h, start, TRANSPOSED: tl.constexpr):
    """One program's part of bwd_kernel's topk_view, for query head off_h: its top-k scores at
    key `start` (TRANSPOSED: a dK/dV program's key tile) or row `start` (a dQ program's query
    tile), their row and key strides, its threshold pairs at row 0, the pairs' pair and row
    strides."""
    (score_batch, stride_tsh, stride_tsm, stride_tsn, score_head_div,
     pair_batch, stride_tp, stride_tph, stride_tpm, pair_head_div) = topk_view
    score_head = score_batch + (off_h // score_head_div).to(tl.int64) * stride_tsh
    if TRANSPOSED:
        score_tile = score_head + start.to(tl.int64) * stride_tsn
    else:
        score_tile = score_head + start.to(tl.int64) * stride_tsm
    pair_head = pair_batch + (off_h // pair_head_div).to(tl.int64) * stride_tph
    return score_tile, stride_tsm, stride_tsn, pair_head, stride_tp, stride_tpm


@triton.jit
def _dkdv_program(
    tile_n, off_b, first_head, HEADS: tl.constexpr, kv_slot, Q, DOut, Lse, Delta, DK, DV, DQ,
    k_base, v_base, q_strides, stride_kn, stride_vn, do_strides, dk_strides, dv_strides,
    lse_strides, dq_strides, lists, list_strides, mask_view, bias_view, dbias_view, row_lens,
    row_order, bits, seqlen_q, seqlen_k, window, softmax_scale, scores, rng, topk_view,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    MASK_FORM: tl.constexpr, BIAS_FORM: tl.constexpr, TOPK_FORM: tl.constexpr,
    HAS_ROW_LENS: tl.constexpr, DROPOUT: tl.constexpr, DBIAS: tl.constexpr,
    DBIAS_PER_QHEAD: tl.constexpr, EXPLICIT: tl.constexpr, EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr, HAS_BITS: tl.constexpr, USER_BQ: tl.constexpr,
    USER_BK: tl.constexpr, DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    LENGTH_RANGES: tl.constexpr, ROW_ORDER: tl.constexpr, WITH_DK: tl.constexpr,
    WITH_DV: tl.constexpr, ATOMIC_KV: tl.constexpr,
):
    """dK/dV (WITH_DK / WITH_DV: the ones asked for) of key tile `tile_n`, summed over query
    heads [first_head, first_head + HEADS) (a KV group, or a part of one) into head slot
    `kv_slot` of DK/DV (ATOMIC_KV: added into the fp32 DK/DV, which the group's other parts add
    to as well); with DBIAS (a bias spanning the keys) and WITH_DK also dbias of its keys:
    per query head, or summed over the heads into slot `kv_slot` when DBIAS_PER_QHEAD is off.
    With ATOMIC_DQ and WITH_DK also each query head's dQ share, added into the fp32 DQ.
    Grouped arguments: the tensors' strides ((batch, row, head) / lse (batch, head)), the
    schedule's lists (num, indices, full num, full indices) and their strides (three each, then
    the list head divisor), mask_view / bias_view ((batch base, head, row, column strides, head
    divisor)), dbias_view (batch base, head, row, column strides), bits (batch base, head, query-block, key-block
    strides, the bitmaps), window (diag_offset, left, right), scores (`scores_log2`'s terms),
    rng (seed, batch base, head stride, row stride, dropout_p), topk_view (bwd_kernel's);
    MASK_FORM / BIAS_FORM / TOPK_FORM (given, rows shared, columns shared)."""
    stride_qb, stride_qm, stride_qh = q_strides
    stride_dob, stride_dom, stride_doh = do_strides
    stride_dkb, stride_dkn, stride_dkh = dk_strides
    stride_dvb, stride_dvn, stride_dvh = dv_strides
    stride_lb, stride_lh = lse_strides
    stride_dqb, stride_dqm, stride_dqh = dq_strides
    QNum, QIdx, FullQNum, FullQIdx = lists
    (stride_qnb, stride_qnh, stride_qnn, stride_qib, stride_qih, stride_qin,
     stride_gnb, stride_gnh, stride_gnn, stride_gib, stride_gih, stride_gin,
     list_head_div) = list_strides
    mask_batch, stride_mh, stride_mm, stride_mn, mask_head_div = mask_view
    bias_batch, stride_bh, stride_bm, stride_bn, bias_head_div = bias_view
    dbias_batch, stride_dbh, stride_dbm, stride_dbn = dbias_view
    bit_batch, stride_sh, stride_sq, stride_sk, block_bits = bits
    diag_offset, window_left, window_right = window
    qk_scale_log2, softcap_inv_scaled, softcap_log2 = scores
    rng_seed, rng_batch_base, rng_head_stride, rng_stride, dropout_p = rng
    # a constexpr tuple's items stay constexpr when indexed (not when unpacked)
    HAS_MASK: tl.constexpr = MASK_FORM[0]
    MASK_ROWS_SHARED: tl.constexpr = MASK_FORM[1]
    MASK_COLS_SHARED: tl.constexpr = MASK_FORM[2]
    HAS_BIAS: tl.constexpr = BIAS_FORM[0]
    BIAS_ROWS_SHARED: tl.constexpr = BIAS_FORM[1]
    BIAS_COLS_SHARED: tl.constexpr = BIAS_FORM[2]
    start_n = tile_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    local_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k = load_rows(k_base + start_n.to(tl.int64) * stride_kn + local_n[:, None] * stride_kn
                  + offs_d[None, :], offs_n, seqlen_k, offs_d, EVEN_N, HEAD_DIM, BLOCK_D)
    v = k  # not read without dK
    if WITH_DK:
        v = load_rows(v_base + start_n.to(tl.int64) * stride_vn + local_n[:, None] * stride_vn
                      + offs_d[None, :], offs_n, seqlen_k, offs_d, EVEN_N, HEAD_DIM, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dbias_keys = tl.zeros([BLOCK_N], dtype=tl.float32)
    lo, full_lo, full_hi, hi = implicit_q_range(
        start_n, seqlen_q, seqlen_k, diag_offset, window_left, window_right,
        BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if LENGTH_RANGES:
        lo, full_lo, full_hi, hi = length_q_range(lo, full_lo, full_hi, hi, row_lens, seqlen_q,
                                                  seqlen_k, start_n, BLOCK_M, BLOCK_N, 1024)
    for g in range(HEADS):
        off_h = first_head + g
        q_tile = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh \
            + offs_m[:, None] * stride_qm + offs_d[None, :]
        do_tile = DOut + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh \
            + offs_m[:, None] * stride_dom + offs_d[None, :]
        lse_tile = Lse + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh
        delta_tile = Delta + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh
        dq_tile = DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh \
            + offs_m[:, None] * stride_dqm + offs_d[None, :]
        mask_cols = mask_batch + (off_h // mask_head_div).to(tl.int64) * stride_mh \
            + start_n.to(tl.int64) * stride_mn
        bias_cols = bias_batch + (off_h // bias_head_div).to(tl.int64) * stride_bh \
            + start_n.to(tl.int64) * stride_bn
        bit_col = bit_batch + off_h * stride_sh + (start_n // USER_BK) * stride_sk
        score_cols, stride_tsm, stride_tsn, pair_head, stride_tp, stride_tpm = \
            _topk_program_view(topk_view, off_h, start_n, True)
        dbias_slot = off_h if DBIAS_PER_QHEAD else kv_slot
        dbias_cols = dbias_batch + dbias_slot.to(tl.int64) * stride_dbh \
            + start_n.to(tl.int64) * stride_dbn
        part_num, part_idx, full_num, full_idx = schedule_rows(
            QNum, QIdx, FullQNum, FullQIdx, off_b, off_h, tile_n,
            stride_qnb, stride_qnh, stride_qnn, stride_qib, stride_qih, stride_qin,
            stride_gnb, stride_gnh, stride_gnn, stride_gib, stride_gih, stride_gin,
            list_head_div)
        for phase in tl.static_range(3):
            tile_list, first_tile, num_tiles = schedule_phase(
                phase, EXPLICIT, QIdx, part_num, part_idx, full_num, full_idx,
                lo, full_lo, full_hi, hi)
            dk, dv, dbias_keys = _dkdv_tiles(
                dk, dv, dbias_keys, k, v, q_tile, do_tile, lse_tile, delta_tile,
                tile_list, first_tile, num_tiles, offs_m, offs_n, offs_d, stride_qm, stride_dom,
                (mask_cols, stride_mm, stride_mn), (bias_cols, stride_bm, stride_bn),
                (dbias_cols, stride_dbm, stride_dbn), seqlen_k - start_n, row_lens, row_order,
                seqlen_q, seqlen_k, (diag_offset, window_left, window_right),
                (qk_scale_log2, softcap_inv_scaled, softcap_log2),
                (rng_seed, rng_batch_base + off_h * rng_head_stride, rng_stride, dropout_p),
                (bit_col, stride_sq, block_bits), dq_tile, stride_dqm, softmax_scale,
                (score_cols, stride_tsm, stride_tsn, pair_head, stride_tp, stride_tpm),
                EXPLICIT, phase != 1, EVEN_M, EVEN_N, HAS_LEFT, HAS_RIGHT, SOFTCAP,
                (HAS_MASK, MASK_ROWS_SHARED, MASK_COLS_SHARED),
                (HAS_BIAS, BIAS_ROWS_SHARED, BIAS_COLS_SHARED), TOPK_FORM, HAS_ROW_LENS, DROPOUT, DBIAS and WITH_DK, (not DBIAS_PER_QHEAD) and HEADS > 1,
                HAS_BITS, USER_BQ, USER_BK, HEAD_DIM, BLOCK_D, BLOCK_M, DOT_PRECISION,
                ATOMIC_DQ, ROW_ORDER, WITH_DK, WITH_DV)
        if DBIAS and WITH_DK and BIAS_ROWS_SHARED:
            # a key bias: the sum over this head's queries, in the head's own slot
            tl.static_assert(DBIAS_PER_QHEAD, "a key bias's gradient has a slot per query head")
            tl.store(dbias_cols + local_n * stride_dbn,
                     dbias_keys.to(dbias_cols.dtype.element_ty), mask=offs_n < seqlen_k)
            dbias_keys = tl.zeros([BLOCK_N], dtype=tl.float32)
    dk = dk * softmax_scale
    dk_ptrs = DK + off_b.to(tl.int64) * stride_dkb + kv_slot.to(tl.int64) * stride_dkh \
        + start_n.to(tl.int64) * stride_dkn + local_n[:, None] * stride_dkn + offs_d[None, :]
    dv_ptrs = DV + off_b.to(tl.int64) * stride_dvb + kv_slot.to(tl.int64) * stride_dvh \
        + start_n.to(tl.int64) * stride_dvn + local_n[:, None] * stride_dvn + offs_d[None, :]
    store_mask = (offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
    if ATOMIC_KV:
        if WITH_DK:
            tl.atomic_add(dk_ptrs, dk, mask=store_mask, sem="relaxed")
        if WITH_DV:
            tl.atomic_add(dv_ptrs, dv, mask=store_mask, sem="relaxed")
    else:
        if WITH_DK:
            tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=store_mask)
        if WITH_DV:
            tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=store_mask)


@triton.jit
def _dq_program(
    tile_m, off_b, off_h, Q, DOut, Lse, Delta, DQ, k_base, v_base, q_strides, stride_kn,
    stride_vn, do_strides, dq_strides, lse_strides, lists, list_strides, mask_view, bias_view,
    dbias_view, row_lens, row_order, bits, seqlen_q, seqlen_k, window, softmax_scale, scores,
    rng, topk_view,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    MASK_FORM: tl.constexpr, BIAS_FORM: tl.constexpr, TOPK_FORM: tl.constexpr,
    HAS_ROW_LENS: tl.constexpr, DROPOUT: tl.constexpr, DBIAS: tl.constexpr,
    DBIAS_TILES: tl.constexpr, EXPLICIT: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, HAS_BITS: tl.constexpr,
    USER_BQ: tl.constexpr, USER_BK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LENGTH_RANGES: tl.constexpr, ROW_ORDER: tl.constexpr,
):
    """dQ of query tile `tile_m` of query head `off_h`; with DBIAS (a bias with one column for
    every key) also its dbias rows, with DBIAS_TILES (a full bias per query head) its dbias
    tiles, in the slot of query head `off_h`. ROW_ORDER: q, dO, lse and delta come in length
    order, row r's dQ goes to the caller's row row_order[r].
    Grouped arguments: the tensors' strides ((batch, row, head) / lse (batch, head)), the
    schedule's lists (num, indices, full num, full indices) and their strides (three each, then
    the list head divisor), mask_view / bias_view ((batch base, head, row, column strides, head
    divisor)), dbias_view (batch base, head, row, column strides), bits (batch base, head, query-block, key-block
    strides, the bitmaps), window (diag_offset, left, right), scores (`scores_log2`'s terms),
    rng (seed, batch base, head stride, row stride, dropout_p), topk_view (bwd_kernel's);
    MASK_FORM / BIAS_FORM / TOPK_FORM (given, rows shared, columns shared)."""
    stride_qb, stride_qm, stride_qh = q_strides
    stride_dob, stride_dom, stride_doh = do_strides
    stride_dqb, stride_dqm, stride_dqh = dq_strides
    stride_lb, stride_lh = lse_strides
    KvNum, KvIdx, FullKvNum, FullKvIdx = lists
    (stride_knb, stride_knh, stride_knm, stride_kib, stride_kih, stride_kim,
     stride_fnb, stride_fnh, stride_fnm, stride_fib, stride_fih, stride_fim,
     list_head_div) = list_strides
    mask_batch, stride_mh, stride_mm, stride_mn, mask_head_div = mask_view
    bias_batch, stride_bh, stride_bm, stride_bn, bias_head_div = bias_view
    dbias_batch, stride_dbh, stride_dbm, stride_dbn = dbias_view
    bit_batch, stride_sh, stride_sq, stride_sk, block_bits = bits
    diag_offset, window_left, window_right = window
    qk_scale_log2, softcap_inv_scaled, softcap_log2 = scores
    rng_seed, rng_batch_base, rng_head_stride, rng_stride, dropout_p = rng
    # a constexpr tuple's items stay constexpr when indexed (not when unpacked)
    HAS_MASK: tl.constexpr = MASK_FORM[0]
    MASK_ROWS_SHARED: tl.constexpr = MASK_FORM[1]
    MASK_COLS_SHARED: tl.constexpr = MASK_FORM[2]
    HAS_BIAS: tl.constexpr = BIAS_FORM[0]
    BIAS_ROWS_SHARED: tl.constexpr = BIAS_FORM[1]
    BIAS_COLS_SHARED: tl.constexpr = BIAS_FORM[2]
    start_m = tile_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    local_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = load_rows(Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
                  + start_m.to(tl.int64) * stride_qm + local_m[:, None] * stride_qm
                  + offs_d[None, :], offs_m, seqlen_q, offs_d, EVEN_M, HEAD_DIM, BLOCK_D)
    do = load_rows(DOut + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
                   + start_m.to(tl.int64) * stride_dom + local_m[:, None] * stride_dom
                   + offs_d[None, :], offs_m, seqlen_q, offs_d, EVEN_M, HEAD_DIM, BLOCK_D)
    row_base = off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh
    lse = tl.load(Lse + row_base + offs_m, mask=offs_m < seqlen_q, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    delta = tl.load(Delta + row_base + offs_m, mask=offs_m < seqlen_q, other=0.0)
    k_tile = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]
    v_tile = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]
    mask_rows = mask_batch + (off_h // mask_head_div).to(tl.int64) * stride_mh \
        + start_m.to(tl.int64) * stride_mm
    bias_rows = bias_batch + (off_h // bias_head_div).to(tl.int64) * stride_bh \
        + start_m.to(tl.int64) * stride_bm
    dbias_tile_rows = dbias_batch + off_h.to(tl.int64) * stride_dbh \
        + start_m.to(tl.int64) * stride_dbm
    key_end = row_key_end(row_lens, offs_m, seqlen_q, seqlen_k, HAS_ROW_LENS)  # [BM]
    bit_row = bit_batch + off_h * stride_sh + (start_m // USER_BQ) * stride_sq
    score_rows, stride_tsm, stride_tsn, pair_head, stride_tp, stride_tpm = _topk_program_view(
        topk_view, off_h, start_m, False)
    threshold, last_tie = row_pairs(pair_head, stride_tp, offs_m, seqlen_q, stride_tpm,
                                    TOPK_FORM[0])
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dbias_rows = tl.zeros([BLOCK_M], dtype=tl.float32)
    lo, full_lo, full_hi, hi = implicit_kv_range(
        start_m, seqlen_q, seqlen_k, diag_offset, window_left, window_right,
        BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if LENGTH_RANGES:
        lo, full_lo, full_hi, hi = length_kv_range(lo, full_lo, full_hi, hi, key_end, offs_m,
                                                   seqlen_q, seqlen_k, BLOCK_N)
    part_num, part_idx, full_num, full_idx = schedule_rows(
        KvNum, KvIdx, FullKvNum, FullKvIdx, off_b, off_h, tile_m,
        stride_knb, stride_knh, stride_knm, stride_kib, stride_kih, stride_kim,
        stride_fnb, stride_fnh, stride_fnm, stride_fib, stride_fih, stride_fim, list_head_div)
    for phase in tl.static_range(3):
        tile_list, first_tile, num_tiles = schedule_phase(
            phase, EXPLICIT, KvIdx, part_num, part_idx, full_num, full_idx,
            lo, full_lo, full_hi, hi)
        dq, dbias_rows = _dq_tiles(
            dq, dbias_rows, q, do, lse, delta, k_tile, v_tile, tile_list, first_tile, num_tiles,
            offs_m, offs_n, offs_d, stride_kn, stride_vn, (mask_rows, stride_mm, stride_mn),
            (bias_rows, stride_bm, stride_bn), seqlen_q - start_m,
            (dbias_tile_rows, stride_dbm, stride_dbn), seqlen_k, key_end,
            (diag_offset, window_left, window_right),
            (qk_scale_log2, softcap_inv_scaled, softcap_log2),
            (rng_seed, rng_batch_base + off_h * rng_head_stride, rng_stride, dropout_p),
            (bit_row, stride_sk, block_bits),
            (score_rows, stride_tsm, stride_tsn, threshold, last_tie),
            EXPLICIT, phase != 1, EVEN_M, EVEN_N, HAS_LEFT, HAS_RIGHT,
            HAS_ROW_LENS or not EVEN_N, SOFTCAP, (HAS_MASK, MASK_ROWS_SHARED, MASK_COLS_SHARED),
            (HAS_BIAS, BIAS_ROWS_SHARED, BIAS_COLS_SHARED), TOPK_FORM, DROPOUT, DBIAS, DBIAS_TILES,
            HAS_BITS, USER_BQ, USER_BK, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION)
    dq = dq * softmax_scale
    dq_rows = start_m.to(tl.int64) + local_m[:, None]
    if ROW_ORDER:
        dq_rows = tl.load(row_order + offs_m, mask=offs_m < seqlen_q, other=0).to(tl.int64)[:, None]
    dq_ptrs = DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh \
        + dq_rows * stride_dqm + offs_d[None, :]
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty),
             mask=(offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM))
    if DBIAS:
        dbias_ptr = dbias_batch + off_h.to(tl.int64) * stride_dbh
        if BIAS_ROWS_SHARED:
            # rows past Sq have p = 0, so they add nothing to the sum over queries
            tl.store(dbias_ptr, tl.sum(dbias_rows, 0).to(dbias_ptr.dtype.element_ty))
        else:
            tl.store(dbias_ptr + offs_m * stride_dbm, dbias_rows.to(dbias_ptr.dtype.element_ty),
                     mask=offs_m < seqlen_q)


@triton.jit
def bwd_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, DK, DV, q_strides, k_strides, v_strides, do_strides,
    dq_strides, dk_strides, dv_strides, lse_strides,
    KvNum, KvIdx, FullKvNum, FullKvIdx, QNum, QIdx, FullQNum, FullQIdx, list_strides,
    Mask, mask_layout, Bias, bias_layout, DBias, dbias_strides,
    RowLens, stride_rlb, RowOrder, CuSeqlensQ, CuSeqlensK, BitSlots, bit_strides, BlockBits,
    TopkScores, TopkPairs, topk_layout, shape, window, scores, rng,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PROGRAMS: tl.constexpr,
    DKDV_TILE: tl.constexpr, DQ_TILE: tl.constexpr, WINDOW_FORM: tl.constexpr,
    SOFTCAP: tl.constexpr, MASK_FORM: tl.constexpr, BIAS_FORM: tl.constexpr,
    DBIAS_FORM: tl.constexpr, ROW_LENS_FORM: tl.constexpr, VARLEN: tl.constexpr,
    DROPOUT: tl.constexpr, EXPLICIT: tl.constexpr, BITS_FORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TOPK_FORM: tl.constexpr,
):
    """Programs [0, n_tiles_n * kv_split) of the program axis compute dK/dV (one per key tile and
    HEADS_PER_PROGRAM query heads of the KV group: kv_split parts, each writing a DK/DV head slot
    of its own, or with ATOMIC_KV each adding into its KV head's fp32 slot; DKDV_APART: twice
    as many, even ones dV, odd ones dK), the rest dQ (one per query tile and query head of the
    KV group). LONGEST_FIRST
    (causal): the program axis is grid axis 1, so the GPU starts every (batch, KV head)'s first
    program before any second one, and dQ programs take their query tiles last to first: the
    longest run first.
    Tensors are arguments of their own (a call plan's replay sets only top-level pointers); the
    rest is grouped: the tensors' strides ((batch, row, head) / lse and delta (batch, head)),
    list_strides ((b, h, row) of each of the four lists of key tiles per query tile, which the
    dQ programs walk, and their list head divisor, then the same of the four of query tiles per
    key tile, which the dK/dV programs walk), mask_layout / bias_layout (batch, head, row, column strides, head divisor),
    dbias_strides (batch, head, row, column), bit_strides (b, h, query block, key block),
    topk_layout (TopkTerm.operands' strides), shape (seqlen_q, seqlen_k, num_heads, group: query
    heads per KV head, n_tiles_n key tiles, n_tiles_m query tiles), window (diag_offset, left,
    right), scores (`scores_log2`'s scale and softcap terms, softmax_scale), rng (seed,
    dropout_p); PROGRAMS (HEADS_PER_PROGRAM, DKDV_APART, ATOMIC_DQ: dQ added by the dK/dV
    programs, no dQ programs, LONGEST_FIRST, ATOMIC_KV), DKDV_TILE / DQ_TILE (the dK/dV and
    the dQ programs' BLOCK_M, BLOCK_N, EVEN_M, EVEN_N), WINDOW_FORM (HAS_LEFT, HAS_RIGHT),
    MASK_FORM / BIAS_FORM / TOPK_FORM (given, rows shared, columns shared), DBIAS_FORM (DBIAS, DBIAS_PER_QHEAD,
    DBIAS_TILES_IN_DQ: a full bias's tiles stored by the dQ programs), ROW_LENS_FORM (HAS_ROW_LENS,
    LENGTH_RANGES: query ranges from the lengths, ROW_ORDER), BITS_FORM (HAS_BITS, USER_BQ,
    USER_BK)."""
    stride_kb, stride_kn, stride_kh = k_strides
    stride_vb, stride_vn, stride_vh = v_strides
    stride_mb, stride_mh, stride_mm, stride_mn, mask_head_div = mask_layout
    stride_bb, stride_bh, stride_bm, stride_bn, bias_head_div = bias_layout
    stride_dbb, stride_dbh, stride_dbm, stride_dbn = dbias_strides
    stride_sb, stride_sh, stride_sq, stride_sk = bit_strides
    (stride_tsb, stride_tsh, stride_tsm, stride_tsn, score_head_div,
     stride_tp, stride_tpb, stride_tph, stride_tpm, pair_head_div) = topk_layout
    seqlen_q, seqlen_k, num_heads, group, n_tiles_n, n_tiles_m = shape
    diag_offset, window_left, window_right = window
    qk_scale_log2, softcap_inv_scaled, softcap_log2, softmax_scale = scores
    rng_seed, dropout_p = rng
    kv_list_strides, q_list_strides = list_strides
    # a constexpr tuple's items stay constexpr when indexed (not when unpacked)
    HEADS_PER_PROGRAM: tl.constexpr = PROGRAMS[0]
    DKDV_APART: tl.constexpr = PROGRAMS[1]
    ATOMIC_DQ: tl.constexpr = PROGRAMS[2]
    LONGEST_FIRST: tl.constexpr = PROGRAMS[3]
    ATOMIC_KV: tl.constexpr = PROGRAMS[4]
    BLOCK_M1: tl.constexpr = DKDV_TILE[0]
    BLOCK_N1: tl.constexpr = DKDV_TILE[1]
    EVEN_M1: tl.constexpr = DKDV_TILE[2]
    EVEN_N1: tl.constexpr = DKDV_TILE[3]
    BLOCK_M2: tl.constexpr = DQ_TILE[0]
    BLOCK_N2: tl.constexpr = DQ_TILE[1]
    EVEN_M2: tl.constexpr = DQ_TILE[2]
    EVEN_N2: tl.constexpr = DQ_TILE[3]
    HAS_LEFT: tl.constexpr = WINDOW_FORM[0]
    HAS_RIGHT: tl.constexpr = WINDOW_FORM[1]
    BIAS_COLS_SHARED: tl.constexpr = BIAS_FORM[2]
    DBIAS: tl.constexpr = DBIAS_FORM[0]
    DBIAS_PER_QHEAD: tl.constexpr = DBIAS_FORM[1]
    DBIAS_TILES_IN_DQ: tl.constexpr = DBIAS_FORM[2]
    HAS_ROW_LENS: tl.constexpr = ROW_LENS_FORM[0]
    LENGTH_RANGES: tl.constexpr = ROW_LENS_FORM[1]
    ROW_ORDER: tl.constexpr = ROW_LENS_FORM[2]
    HAS_BITS: tl.constexpr = BITS_FORM[0]
    USER_BQ: tl.constexpr = BITS_FORM[1]
    USER_BK: tl.constexpr = BITS_FORM[2]
    if LONGEST_FIRST:
        pid = tl.program_id(1)
        off_bhk = tl.program_id(0)
    else:
        pid = tl.program_id(0)
        off_bhk = tl.program_id(1)
    num_heads_k = num_heads // group
    off_b = off_bhk // num_heads_k
    off_hk = off_bhk % num_heads_k
    # dropout counters as in the forward pass: (batch, query head, row, key) in the launch's grid
    rng_stride = seqlen_k
    rng_head_stride = (seqlen_q + tl.zeros([], tl.int64)) * seqlen_k
    rng_batch_base = off_b.to(tl.int64) * num_heads * rng_head_stride
    # packed sequences: every row-indexed base moves to this batch's first row (batch strides 0);
    # a (batch, row, head) stride tuple's [1] is its row stride
    first_q, seqlen_q, first_k, seqlen_k = sequence_bounds(CuSeqlensQ, CuSeqlensK, off_b,
                                                           seqlen_q, seqlen_k, VARLEN)
    if VARLEN:
        diag_offset = seqlen_k - seqlen_q
    row0 = first_q.to(tl.int64)
    key0 = first_k.to(tl.int64)
    Q += row0 * q_strides[1]
    DOut += row0 * do_strides[1]
    DQ += row0 * dq_strides[1]
    Lse += row0
    Delta += row0
    DK += key0 * dk_strides[1]
    DV += key0 * dv_strides[1]
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh + key0 * stride_kn
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh + key0 * stride_vn
    mask_batch = Mask + off_b.to(tl.int64) * stride_mb + row0 * stride_mm
    bias_batch = Bias + off_b.to(tl.int64) * stride_bb + row0 * stride_bm
    dbias_batch = DBias + off_b.to(tl.int64) * stride_dbb + row0 * stride_dbm
    row_lens = RowLens + off_b.to(tl.int64) * stride_rlb + row0
    row_order = RowOrder + off_b.to(tl.int64) * stride_rlb
    bit_batch = BitSlots + off_b * stride_sb
    topk_view = (TopkScores + off_b.to(tl.int64) * stride_tsb + row0 * stride_tsm, stride_tsh,
                 stride_tsm, stride_tsn, score_head_div,
                 TopkPairs + off_b.to(tl.int64) * stride_tpb + row0 * stride_tpm, stride_tp,
                 stride_tph, stride_tpm, pair_head_div)
    kv_split = group // HEADS_PER_PROGRAM
    kv_programs = n_tiles_n * kv_split * (2 if DKDV_APART else 1)
    if pid < kv_programs:
        tile_pid = pid // 2 if DKDV_APART else pid
        tile_n = tile_pid // kv_split
        if tile_n * BLOCK_N1 >= seqlen_k:  # packed: the grid covers the longest sequence
            return
        part = tile_pid % kv_split
        # one copy per kind compiled: DKDV_APART's dV (kind 0) and dK (kind 1) programs
        for kind in tl.static_range(2 if DKDV_APART else 1):
            if (not DKDV_APART) or (pid % 2 == kind):
                _dkdv_program(
                    tile_n, off_b, off_hk * group + part * HEADS_PER_PROGRAM, HEADS_PER_PROGRAM,
                    off_hk if ATOMIC_KV else off_hk * kv_split + part, Q, DOut, Lse, Delta,
                    DK, DV, DQ, k_base, v_base,
                    q_strides, stride_kn, stride_vn, do_strides, dk_strides, dv_strides,
                    lse_strides, dq_strides, (QNum, QIdx, FullQNum, FullQIdx), q_list_strides,
                    (mask_batch, stride_mh, stride_mm, stride_mn, mask_head_div),
                    (bias_batch, stride_bh, stride_bm, stride_bn, bias_head_div),
                    (dbias_batch, stride_dbh, stride_dbm, stride_dbn), row_lens, row_order,
                    (bit_batch, stride_sh, stride_sq, stride_sk, BlockBits),
                    seqlen_q, seqlen_k, (diag_offset, window_left, window_right), softmax_scale,
                    (qk_scale_log2, softcap_inv_scaled, softcap_log2),
                    (rng_seed, rng_batch_base, rng_head_stride, rng_stride, dropout_p), topk_view,
                    HEAD_DIM, BLOCK_D, BLOCK_M1, BLOCK_N1, HAS_LEFT, HAS_RIGHT, SOFTCAP,
                    MASK_FORM, BIAS_FORM, TOPK_FORM, HAS_ROW_LENS, DROPOUT,
                    DBIAS and not BIAS_COLS_SHARED and not DBIAS_TILES_IN_DQ,
                    DBIAS_PER_QHEAD, EXPLICIT, EVEN_M1, EVEN_N1, HAS_BITS, USER_BQ, USER_BK,
                    DOT_PRECISION, ATOMIC_DQ, LENGTH_RANGES, ROW_ORDER,
                    (not DKDV_APART) or kind == 1, (not DKDV_APART) or kind == 0, ATOMIC_KV)
    else:
        work = pid - kv_programs
        tile_m = work % n_tiles_m
        if LONGEST_FIRST:
            tile_m = n_tiles_m - 1 - tile_m
        if tile_m * BLOCK_M2 >= seqlen_q:
            return
        _dq_program(
            tile_m, off_b, off_hk * group + work // n_tiles_m,
            Q, DOut, Lse, Delta, DQ, k_base, v_base, q_strides, stride_kn, stride_vn, do_strides,
            dq_strides, lse_strides, (KvNum, KvIdx, FullKvNum, FullKvIdx), kv_list_strides,
            (mask_batch, stride_mh, stride_mm, stride_mn, mask_head_div),
            (bias_batch, stride_bh, stride_bm, stride_bn, bias_head_div),
            (dbias_batch, stride_dbh, stride_dbm, stride_dbn), row_lens, row_order,
            (bit_batch, stride_sh, stride_sq, stride_sk, BlockBits),
            seqlen_q, seqlen_k, (diag_offset, window_left, window_right), softmax_scale,
            (qk_scale_log2, softcap_inv_scaled, softcap_log2),
            (rng_seed, rng_batch_base, rng_head_stride, rng_stride, dropout_p), topk_view,
            HEAD_DIM, BLOCK_D, BLOCK_M2, BLOCK_N2, HAS_LEFT, HAS_RIGHT, SOFTCAP,
            MASK_FORM, BIAS_FORM, TOPK_FORM, HAS_ROW_LENS, DROPOUT,
            DBIAS and BIAS_COLS_SHARED,
            DBIAS_TILES_IN_DQ, EXPLICIT, EVEN_M2, EVEN_N2, HAS_BITS, USER_BQ, USER_BK,
            DOT_PRECISION, LENGTH_RANGES, ROW_ORDER)
