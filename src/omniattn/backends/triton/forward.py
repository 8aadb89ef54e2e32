"""Forward kernel: one program per (query tile, batch x query head), online softmax over the key
tiles its schedule lists. FULL tiles skip the predicate entirely; PARTIAL tiles apply it."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...kernels.common import (LOG2E, block_bits_keep, dropout_keep, implicit_kv_range,
                               length_kv_range, load_pair_tile, load_rows, row_key_end, row_pairs,
                               schedule_phase, schedule_rows, scores_log2, sequence_bounds,
                               topk_tile_keep, visible_elements)
from ...kernels.elementwise import Elementwise, TopkTerm
from ...kernels.schedule import BlockBits, KernelArgs, TileLists
from ...kernels.sequences import (PackedSequences, batch_shape, lse_strides, packed_operands,
                                  row_lens_operands, row_strides, tma_compatible)
from ...kernels.sizes import cdiv, padded_head_dim
from ...runtime.launch import descriptor_workspace, launch, tensors_then_tuple
from ...runtime.switches import tma_enabled
from .configs import DROPOUT_MAX_STAGES, forward_config


@triton.jit
def _fwd_tiles(
    acc, m_i, l_i, q, k_src, v_src, tile_list, first_tile, num_tiles,
    offs_m, offs_n, offs_d, stride_kn, stride_vn,
    mask_rows, stride_mm, stride_mn, bias_rows, stride_bm, stride_bn, rows_left,
    seqlen_k, key_end, diag_offset, window_left, window_right,
    qk_scale_log2, softcap_inv_scaled, softcap_log2, rng_seed, rng_base, rng_stride, dropout_p,
    bit_slots, stride_sk, block_bits, topk_view,
    FROM_LIST: tl.constexpr, PARTIAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, KEY_BOUND: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_ROWS_SHARED: tl.constexpr, MASK_COLS_SHARED: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_ROWS_SHARED: tl.constexpr, BIAS_COLS_SHARED: tl.constexpr,
    DROPOUT: tl.constexpr, HAS_BITS: tl.constexpr, USER_BQ: tl.constexpr, USER_BK: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, PLAIN_SCORES: tl.constexpr,
    TOPK_FORM: tl.constexpr,
):
    """Online softmax over `num_tiles` key tiles: listed in `tile_list` or first_tile, +1, ...
    k_src / v_src: tensor descriptors of this sequence's keys / values (TMA) or pointers to
    their [BN, BD] tile at key 0.
    mask_rows / bias_rows point at this query tile's first row (key 0) of the mask / bias;
    key_end [BM] is where each row's keys end (PARTIAL tiles only); bit_slots points at the
    block-bitmap slots of this query tile's user block row (HAS_BITS); topk_view: the top-k
    scores at this query tile's first row (key 0), their row and key strides, the rows'
    threshold pairs [BM] (TOPK_FORM: given, rows shared, columns shared)."""
    score_rows, stride_tm, stride_tn, threshold, last_tie = topk_view
    HAS_TOPK: tl.constexpr = TOPK_FORM[0]
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
        if TMA:  # rows past the sequence's end read 0
            k = k_src.load([start_n, 0])  # [BN, BD]
            v = v_src.load([start_n, 0])
        else:
            k = load_rows(k_src + start_n.to(tl.int64) * stride_kn, keys, seqlen_k, offs_d,
                          EVEN_N, HEAD_DIM, BLOCK_D)  # [BN, BD]
            v = load_rows(v_src + start_n.to(tl.int64) * stride_vn, keys, seqlen_k, offs_d,
                          EVEN_N, HEAD_DIM, BLOCK_D)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BM, BN]
        if PLAIN_SCORES and not PARTIAL:
            # FULL tile of plain scores: one FMA per element (the scale is positive, so the row
            # max commutes with it) and no -inf guard: every row sees a finite score here
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale_log2)
            m_shift = m_new
            p = tl.exp2(qk * qk_scale_log2 - m_new[:, None])
        else:
            s, _ = scores_log2(qk, qk_scale_log2, softcap_inv_scaled, softcap_log2, SOFTCAP)
            if HAS_BIAS:
                bias = load_pair_tile(bias_rows + start_n.to(tl.int64) * stride_bn, local_m,
                                      offs_n, stride_bm, stride_bn, rows_left,
                                      seqlen_k - start_n, BIAS_ROWS_SHARED, BIAS_COLS_SHARED,
                                      EVEN_M, EVEN_N)
                s += bias.to(tl.float32) * LOG2E
            if PARTIAL:
                visible = visible_elements(offs_m, keys, key_end, diag_offset, window_left,
                                           window_right, HAS_LEFT, HAS_RIGHT, KEY_BOUND)
                if HAS_MASK:
                    keep = load_pair_tile(mask_rows + start_n.to(tl.int64) * stride_mn, local_m,
                                          offs_n, stride_mm, stride_mn, rows_left,
                                          seqlen_k - start_n, MASK_ROWS_SHARED,
                                          MASK_COLS_SHARED, EVEN_M, EVEN_N)
                    visible = visible & (keep != 0)
                if HAS_BITS:
                    visible = visible & block_bits_keep(
                        bit_slots + (start_n // USER_BK) * stride_sk, block_bits, offs_m, keys,
                        USER_BQ, USER_BK, False)
                if HAS_TOPK:
                    visible = visible & topk_tile_keep(
                        score_rows + start_n.to(tl.int64) * stride_tn, local_m, offs_n,
                        stride_tm, stride_tn, rows_left, seqlen_k - start_n, keys, threshold,
                        last_tie, TOPK_FORM, EVEN_M, EVEN_N, False)
                s = tl.where(visible, s, float("-inf"))
            elif not EVEN_N:
                # a FULL tile of an explicit schedule may still run past Sk
                s = tl.where(keys[None, :] < seqlen_k, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row with nothing visible yet keeps m = -inf; subtract 0 there: no inf - inf
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)  # the softmax denominator counts dropped elements
        if DROPOUT:
            p = tl.where(dropout_keep(rng_seed, rng_base, offs_m, keys, rng_stride, dropout_p,
                                      False), p, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(
    Q, K, V, Out, Lse, q_strides, k_strides, v_strides, out_strides, lse_strides,
    KvNum, KvIdx, FullKvNum, FullKvIdx, list_strides, Mask, mask_layout, Bias, bias_layout,
    RowLens, stride_rlb, RowOrder, CuSeqlensQ, CuSeqlensK, BitSlots, bit_strides, BlockBits,
    TopkScores, TopkPairs, topk_layout, shape, window, scores, rng,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
    WINDOW_FORM: tl.constexpr, SOFTCAP: tl.constexpr, MASK_FORM: tl.constexpr,
    BIAS_FORM: tl.constexpr, ROW_LENS_FORM: tl.constexpr, VARLEN: tl.constexpr,
    DROPOUT: tl.constexpr, EXPLICIT: tl.constexpr, BITS_FORM: tl.constexpr,
    REVERSE_M: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    PLAIN_SCORES: tl.constexpr, TOPK_FORM: tl.constexpr,
):
    """Out and Lse of query tile program_id(0) of (batch x query head) program_id(1).
    Tensors are arguments of their own (a call plan's replay sets only top-level pointers); the
    rest is grouped: the tensors' strides ((batch, row, head) / lse (batch, head)), the lists'
    strides ((b, h, row) of each of the four, then the list head divisor), mask_layout / bias_layout (batch, head, row,
    column strides, head divisor), bit_strides (b, h, query block, key block), shape (seqlen_q,
    seqlen_k, num_heads, group: query heads per KV head), window (diag_offset, left, right),
    scores (`scores_log2`'s scale and softcap terms), rng (seed, dropout_p); TILE (BLOCK_M,
    BLOCK_N, EVEN_M, EVEN_N), WINDOW_FORM (HAS_LEFT, HAS_RIGHT), MASK_FORM / BIAS_FORM / TOPK_FORM
    (given, rows shared, columns shared; top-k: of its scores), topk_layout (TopkTerm.operands'
    strides), ROW_LENS_FORM (HAS_ROW_LENS, LENGTH_RANGES: key ranges from
    the lengths, ROW_ORDER), BITS_FORM (HAS_BITS, USER_BQ, USER_BK)."""
    stride_qb, stride_qm, stride_qh = q_strides
    stride_kb, stride_kn, stride_kh = k_strides
    stride_vb, stride_vn, stride_vh = v_strides
    stride_ob, stride_om, stride_oh = out_strides
    stride_lb, stride_lh = lse_strides
    (stride_knb, stride_knh, stride_knm, stride_kib, stride_kih, stride_kim,
     stride_fnb, stride_fnh, stride_fnm, stride_fib, stride_fih, stride_fim,
     list_head_div) = list_strides
    stride_mb, stride_mh, stride_mm, stride_mn, mask_head_div = mask_layout
    stride_bb, stride_bh, stride_bm, stride_bn, bias_head_div = bias_layout
    stride_sb, stride_sh, stride_sq, stride_sk = bit_strides
    seqlen_q, seqlen_k, num_heads, group = shape
    diag_offset, window_left, window_right = window
    qk_scale_log2, softcap_inv_scaled, softcap_log2 = scores
    rng_seed, dropout_p = rng
    (stride_tsb, stride_tsh, stride_tsm, stride_tsn, score_head_div,
     stride_tp, stride_tpb, stride_tph, stride_tpm, pair_head_div) = topk_layout
    # a constexpr tuple's items stay constexpr when indexed (not when unpacked)
    BLOCK_M: tl.constexpr = TILE[0]
    BLOCK_N: tl.constexpr = TILE[1]
    EVEN_M: tl.constexpr = TILE[2]
    EVEN_N: tl.constexpr = TILE[3]
    HAS_LEFT: tl.constexpr = WINDOW_FORM[0]
    HAS_RIGHT: tl.constexpr = WINDOW_FORM[1]
    HAS_MASK: tl.constexpr = MASK_FORM[0]
    MASK_ROWS_SHARED: tl.constexpr = MASK_FORM[1]
    MASK_COLS_SHARED: tl.constexpr = MASK_FORM[2]
    HAS_BIAS: tl.constexpr = BIAS_FORM[0]
    BIAS_ROWS_SHARED: tl.constexpr = BIAS_FORM[1]
    BIAS_COLS_SHARED: tl.constexpr = BIAS_FORM[2]
    HAS_ROW_LENS: tl.constexpr = ROW_LENS_FORM[0]
    LENGTH_RANGES: tl.constexpr = ROW_LENS_FORM[1]
    ROW_ORDER: tl.constexpr = ROW_LENS_FORM[2]
    HAS_BITS: tl.constexpr = BITS_FORM[0]
    USER_BQ: tl.constexpr = BITS_FORM[1]
    USER_BK: tl.constexpr = BITS_FORM[2]
    tile_m = tl.program_id(0)
    if REVERSE_M:
        # causal: the longest rows start first, so the tail of the grid is short work
        tile_m = tl.num_programs(0) - 1 - tile_m
    off_bh = tl.program_id(1)
    off_b = off_bh // num_heads
    off_h = off_bh % num_heads
    off_hk = off_h // group
    start_m = tile_m * BLOCK_M
    # dropout counters: (batch, head, row, key) in the launch's (max) Sq x Sk grid
    rng_base = off_bh.to(tl.int64) * seqlen_q * seqlen_k
    rng_stride = seqlen_k
    # packed sequences: this batch's rows start at first_q / first_k (batch strides are 0)
    first_q, seqlen_q, first_k, seqlen_k = sequence_bounds(CuSeqlensQ, CuSeqlensK, off_b,
                                                           seqlen_q, seqlen_k, VARLEN)
    if VARLEN:
        if start_m >= seqlen_q:  # the grid covers the longest sequence
            return
        diag_offset = seqlen_k - seqlen_q
    row0 = (first_q + start_m).to(tl.int64)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    # int64 bases: batch/head/sequence offsets can pass 2**31 elements
    # this sequence's first row of q / out
    q_rows = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh \
        + first_q.to(tl.int64) * stride_qm
    o_rows = Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh \
        + first_q.to(tl.int64) * stride_om
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh \
        + first_k.to(tl.int64) * stride_kn
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh \
        + first_k.to(tl.int64) * stride_vn
    mask_rows = Mask + off_b.to(tl.int64) * stride_mb \
        + (off_h // mask_head_div).to(tl.int64) * stride_mh + row0 * stride_mm
    bias_rows = Bias + off_b.to(tl.int64) * stride_bb \
        + (off_h // bias_head_div).to(tl.int64) * stride_bh + row0 * stride_bm
    if TMA:
        # this sequence's keys only: tiles past its end read 0, not the next sequence
        k_src = tl.make_tensor_descriptor(k_base, [tl.maximum(seqlen_k, 1), HEAD_DIM],
                                          [stride_kn, 1], [BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(v_base, [tl.maximum(seqlen_k, 1), HEAD_DIM],
                                          [stride_vn, 1], [BLOCK_N, BLOCK_D])
    else:
        k_src = k_base + offs_n[:, None] * stride_kn + offs_d[None, :]  # [BN, BD] at key 0
        v_src = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]
    key_end = row_key_end(RowLens + off_b.to(tl.int64) * stride_rlb + first_q, offs_m, seqlen_q,
                          seqlen_k, HAS_ROW_LENS)  # [BM]
    bit_slots = BitSlots + off_b * stride_sb + off_h * stride_sh + (start_m // USER_BQ) * stride_sq
    score_rows = TopkScores + off_b.to(tl.int64) * stride_tsb \
        + (off_h // score_head_div).to(tl.int64) * stride_tsh + row0 * stride_tsm
    threshold, last_tie = row_pairs(
        TopkPairs + off_b.to(tl.int64) * stride_tpb
        + (off_h // pair_head_div).to(tl.int64) * stride_tph + first_q * stride_tpm,
        stride_tp, offs_m, seqlen_q, stride_tpm, TOPK_FORM[0])
    # rows in length order: row offs_m of this tile is the caller's row caller_m
    caller_m = offs_m
    if ROW_ORDER:
        caller_m = tl.load(RowOrder + off_b.to(tl.int64) * stride_rlb + offs_m,
                           mask=offs_m < seqlen_q, other=0)

    if TMA and not ROW_ORDER:
        q_desc = tl.make_tensor_descriptor(q_rows, [tl.maximum(seqlen_q, 1), HEAD_DIM],
                                           [stride_qm, 1], [BLOCK_M, BLOCK_D])
        q = q_desc.load([start_m, 0])  # [BM, BD]
    else:
        q = load_rows(q_rows + caller_m[:, None] * stride_qm + offs_d[None, :], offs_m, seqlen_q,
                      offs_d, EVEN_M, HEAD_DIM, BLOCK_D)  # [BM, BD]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # both are cheap scalar work; schedule_phase reads the one the schedule kind needs
    lo, full_lo, full_hi, hi = implicit_kv_range(
        start_m, seqlen_q, seqlen_k, diag_offset, window_left, window_right,
        BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if LENGTH_RANGES:
        lo, full_lo, full_hi, hi = length_kv_range(lo, full_lo, full_hi, hi, key_end, offs_m,
                                                   seqlen_q, seqlen_k, BLOCK_N)
    kv_num, kv_idx, full_num, full_idx = schedule_rows(
        KvNum, KvIdx, FullKvNum, FullKvIdx, off_b, off_h, tile_m,
        stride_knb, stride_knh, stride_knm, stride_kib, stride_kih, stride_kim,
        stride_fnb, stride_fnh, stride_fnm, stride_fib, stride_fih, stride_fim, list_head_div)
    # phases: PARTIAL tiles, FULL tiles, PARTIAL tiles (the last only for implicit schedules)
    for phase in tl.static_range(3):
        tile_list, first_tile, num_tiles = schedule_phase(
            phase, EXPLICIT, KvIdx, kv_num, kv_idx, full_num, full_idx, lo, full_lo, full_hi, hi)
        acc, m_i, l_i = _fwd_tiles(
            acc, m_i, l_i, q, k_src, v_src, tile_list, first_tile, num_tiles,
            offs_m, offs_n, offs_d, stride_kn, stride_vn,
            mask_rows, stride_mm, stride_mn, bias_rows, stride_bm, stride_bn, seqlen_q - start_m,
            seqlen_k, key_end, diag_offset, window_left, window_right,
            qk_scale_log2, softcap_inv_scaled, softcap_log2, rng_seed, rng_base, rng_stride,
            dropout_p, bit_slots, stride_sk, BlockBits,
            (score_rows, stride_tsm, stride_tsn, threshold, last_tie), EXPLICIT, phase != 1, EVEN_M, EVEN_N, HAS_LEFT, HAS_RIGHT,
            HAS_ROW_LENS or not EVEN_N, SOFTCAP,
            HAS_MASK, MASK_ROWS_SHARED, MASK_COLS_SHARED, HAS_BIAS, BIAS_ROWS_SHARED,
            BIAS_COLS_SHARED, DROPOUT, HAS_BITS, USER_BQ, USER_BK, HEAD_DIM, BLOCK_D, BLOCK_N,
            DOT_PRECISION, TMA, PLAIN_SCORES, TOPK_FORM)

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]  # rows that saw no key: 0
    if DROPOUT:
        out = out / (1.0 - dropout_p)
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / LOG2E, float("-inf"))

    lse_ptrs = Lse + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh + first_q \
        + caller_m
    out = out.to(Out.dtype.element_ty)
    if EVEN_M:
        tl.store(lse_ptrs, lse)
    else:
        tl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)
    if TMA and not ROW_ORDER:  # rows past the sequence's end are not written
        o_desc = tl.make_tensor_descriptor(o_rows, [tl.maximum(seqlen_q, 1), HEAD_DIM],
                                           [stride_om, 1], [BLOCK_M, BLOCK_D])
        o_desc.store([start_m, 0], out)
    else:
        o_ptrs = o_rows + caller_m[:, None] * stride_om + offs_d[None, :]
        if EVEN_M and BLOCK_D == HEAD_DIM:
            tl.store(o_ptrs, out)
        else:
            tl.store(o_ptrs, out, mask=(offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM))


def triton_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: KernelArgs,
                   out: torch.Tensor, lse: torch.Tensor, schedule: TileLists | None,
                   bits: BlockBits | None, mask: Elementwise | None, bias: Elementwise | None,
                   row_lens: torch.Tensor | None, packed: PackedSequences | None,
                   dropout: tuple[float, int], row_order: torch.Tensor | None,
                   topk: TopkTerm | None = None) -> None:
    """The Triton forward into out / lse, for a call with keys and queries (`passes.
    attention_forward` has the layouts and the arguments' meaning)."""
    batch, seqlen_q, seqlen_k = batch_shape(q, k, packed)
    num_heads, head_dim = q.shape[-2:]
    num_heads_k = k.shape[-2]
    elementwise = mask is not None or bias is not None or topk is not None
    tma = tma_enabled(q.device) and tma_compatible(q, k, v, out)
    masked = args.masked or schedule is not None
    cfg = forward_config(head_dim, q.dtype, masked, elementwise, tma)
    block_m, block_n = cfg.block_m, cfg.block_n
    num_warps, num_stages = cfg.num_warps, cfg.num_stages
    if schedule is not None:
        block_m, block_n = schedule.block_m, schedule.block_n
        if schedule.num_warps:
            num_warps, num_stages = schedule.num_warps, schedule.num_stages
    if dropout[0] > 0:
        # the dropout draws are regrouped through shared memory: one stage less
        num_stages = min(num_stages, DROPOUT_MAX_STAGES)
    n_tiles_m = cdiv(seqlen_q, block_m)
    even_m = packed is None and seqlen_q % block_m == 0
    even_n = packed is None and seqlen_k % block_n == 0
    lists = schedule.operands(num_heads) if schedule is not None \
        else TileLists.placeholder_operands(q.device)
    unused = Elementwise.placeholder_operands(q.device)
    with descriptor_workspace():
        launch(_fwd_kernel, (n_tiles_m, batch * num_heads),
            q, k, v, out, lse,
            row_strides(q), row_strides(k), row_strides(v), row_strides(out), lse_strides(lse),
            *tensors_then_tuple(lists, 4),
            *tensors_then_tuple(mask.operands() if mask is not None else unused, 1),
            *tensors_then_tuple(bias.operands() if bias is not None else unused, 1),
            *row_lens_operands(row_lens, q.device, row_order), *packed_operands(packed, q.device),
            *(bits.operands() if bits is not None
              else BlockBits.placeholder_operands(q.device)),
            *(topk.operands(num_heads) if topk is not None
              else TopkTerm.placeholder_operands(q.device)),
            (seqlen_q, seqlen_k, num_heads, num_heads // num_heads_k),
            (seqlen_k - seqlen_q, args.window_left, args.window_right),
            (args.qk_scale_log2, args.softcap_inv_scaled, args.softcap_log2),
            (dropout[1], dropout[0]),
            HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim),
            TILE=(block_m, block_n, even_m, even_n),
            WINDOW_FORM=(args.has_left, args.has_right), SOFTCAP=args.softcap > 0,
            MASK_FORM=Elementwise.form(mask), BIAS_FORM=Elementwise.form(bias),
            ROW_LENS_FORM=(row_lens is not None, row_lens is not None and schedule is None,
                           row_order is not None),
            VARLEN=packed is not None, DROPOUT=dropout[0] > 0, EXPLICIT=schedule is not None,
            BITS_FORM=BlockBits.kernel_form(bits),
            REVERSE_M=schedule is None and args.later_rows_see_more,
            DOT_PRECISION=KernelArgs.dot_precision(q.dtype), TMA=tma,
            PLAIN_SCORES=even_n and bias is None and args.softcap == 0,
            TOPK_FORM=TopkTerm.form(topk),
            num_warps=num_warps, num_stages=num_stages,
        )
