"""Hopper forward for the schedules without per-element terms (dense, causal, windows, GQA),
written in Gluon: a producer warp streams K/V tiles through TMA into a ring of shared-memory buffers
(a buffer's K goes back to it once QK^T has read it, its V after P V), two consumer warpgroups each
own 64 query rows of the program's 128 (three of 192 at head dim 64, dense / causal / windows
alone: `configs._FWD_HOPPER_PLAIN`). Each consumer issues the next tile's QK^T before the softmax
of the current one, so the softmax runs while the tensor cores compute P V of the tile before (FA3's
intra-warpgroup overlap, with asynchronous wgmma and explicit waits that Triton's `tl.dot` does not
expose). It also runs element masks, biases and bitmap-free block masks: the key tiles then come
from the schedule's lists (PARTIAL tiles first, then FULL ones). A byte mask and a 2-byte bias
spanning (Sq, Sk) come by TMA with K (the producer's), their broadcast forms by each consumer's
loads straight into the scores' layout; either is read while the wgmmas run. Per-row key lengths
alone run with the rows in length order: each consumer gathers its q rows and scatters its out
rows, and takes its key range from its rows' lengths. Packed sequences (varlen) without masks or
biases read their tiles at each sequence's first row of the flat views; a tile cut by a sequence's
end stores its rows inside it without TMA. Lengths with other terms, packed sequences with masks,
dropout, softcap and block-mask bitmaps run in `fwd.py`."""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from ...kernels.common import clip_ranges, implicit_kv_range, load_pair_tile, schedule_rows
from ...kernels.elementwise import Elementwise
from ...kernels.schedule import KernelArgs, TileLists
from ...kernels.sequences import (PackedSequences, batch_shape, lse_strides, packed_operands,
                                  row_lens_operands, row_strides, tma_compatible)
from ...kernels.sizes import cdiv
from ...runtime.launch import launch
from .blocks import (ElementForm, by_tma, copy_tile, descriptor, drop_outside_window,
                     flat_launch, flat_rows, flat_view_bounds, gather_rows, gluon_refusal,
                     hand_over, handed, load_tile, producer_tiles, scatter_rows, tile_at)
from .configs import hopper_forward_config

LN2 = gl.constexpr(0.6931471805599453)
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _next_key_start(step, first_tile, num_tiles, next_tiles, buf, EXPLICIT: gl.constexpr,
                    BLOCK_N: gl.constexpr):
    """Consumer, once K of `step` (in buffer buf) is there: the key start of the step after it
    (explicit: as the producer handed it over; the last step repeats itself)."""
    if EXPLICIT:
        tile = handed(next_tiles.index(buf))
    else:
        tile = first_tile + gl.minimum(step + 1, num_tiles - 1)
    return tile * BLOCK_N


@gluon.jit
def _load_kv(loads, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
             NUM_BUF: gl.constexpr, FLAT: gl.constexpr, EXPLICIT: gl.constexpr,
             MASK_FORM: gl.constexpr, BIAS_FORM: gl.constexpr, ROW_ORDER: gl.constexpr,
             CONSUMERS: gl.constexpr):
    """Producer: each consumer's query rows once (not with ROW_ORDER: the consumers gather theirs),
    then the K and V tiles of step j (key tile first_tile + j of an implicit schedule) into buffer j
    % NUM_BUF, each as soon as every consumer released the one of the step that used the buffer
    before (kv_free: K's barriers, then V's; K goes back a step earlier). A mask by TMA
    (MASK_FORM.tma): the masked steps' mask tiles too, a [BM, BN] box per consumer arriving with
    K (mask rows (batch, head, query) flattened: mask_row is the program's first); a bias by TMA:
    every step's bias tiles, likewise.
    Explicit schedules: the next step's key tile into next_tiles beside the buffer, before K's
    arrival (the list entry read a step ahead). q_start / k_start: the batch's first row of the
    flat (FLAT) descriptors. loads: the program's values and buffers, as the kernel packs them."""
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_free, off_b,
     off_h, off_hk, start_m, first_tile, num_tiles, num_part, part_list, full_list, q_start,
     k_start, mask_desc, mask_smem, mask_row, bias_desc, bias_smem, bias_row, next_tiles) = loads
    if not ROW_ORDER:
        for c in gl.static_range(CONSUMERS):
            load_tile(q_desc, off_b, start_m + c * BLOCK_M, off_h, q_start, q_ready.index(c),
                       q_smem.index(c), HEAD_DIM, FLAT)
    next_tile = tile_at(0, num_part, part_list, full_list, EXPLICIT)
    for j in range(num_tiles):
        buf = j % NUM_BUF
        tile = next_tile
        next_tile = tile_at(gl.minimum(j + 1, num_tiles - 1), num_part, part_list, full_list,
                             EXPLICIT)
        start_n = (first_tile + tile) * BLOCK_N
        # a fresh barrier passes a wait on parity 1: the first round needs no release
        mbarrier.wait(kv_free.index(buf), ((j // NUM_BUF) & 1) ^ 1)
        if EXPLICIT:
            hand_over(next_tiles.index(buf), next_tile)
        if MASK_FORM.tma or BIAS_FORM.tma:
            k_bytes: gl.constexpr = k_desc.block_type.nbytes + BIAS_FORM.tma * CONSUMERS * \
                bias_desc.block_type.nbytes
            # one expect per barrier and phase: it arrives, so all copies' bytes go in it
            if MASK_FORM.tma:
                # the consumers apply the mask in the PARTIAL steps and always in the first one
                with_mask = (j < num_part) | (j == 0)
                mask_bytes: gl.constexpr = CONSUMERS * mask_desc.block_type.nbytes
                mbarrier.expect(k_ready.index(buf), k_bytes + mask_bytes, pred=with_mask)
                mbarrier.expect(k_ready.index(buf), k_bytes, pred=(j >= num_part) & (j != 0))
                # rows past Sq read the next head's (or zeros): they are never stored
                for c in gl.static_range(CONSUMERS):
                    tma.async_copy_global_to_shared(
                        mask_desc, [mask_row + c * BLOCK_M, start_n], k_ready.index(buf),
                        mask_smem.index(buf * CONSUMERS + c), pred=with_mask)
            else:
                mbarrier.expect(k_ready.index(buf), k_bytes)
            if BIAS_FORM.tma:
                for c in gl.static_range(CONSUMERS):
                    tma.async_copy_global_to_shared(
                        bias_desc, [bias_row + c * BLOCK_M, start_n], k_ready.index(buf),
                        bias_smem.index(buf * CONSUMERS + c))
            copy_tile(k_desc, off_b, start_n, off_hk, k_start, k_ready.index(buf),
                       k_smem.index(buf), HEAD_DIM, FLAT)
        else:
            load_tile(k_desc, off_b, start_n, off_hk, k_start, k_ready.index(buf),
                       k_smem.index(buf), HEAD_DIM, FLAT)
        mbarrier.wait(kv_free.index(NUM_BUF + buf), ((j // NUM_BUF) & 1) ^ 1)
        load_tile(v_desc, off_b, start_n, off_hk, k_start, v_ready.index(buf),
                   v_smem.index(buf), HEAD_DIM, FLAT)


@gluon.jit
def _key_end(row, seqlen_k, diag_offset, window_right, HAS_RIGHT: gl.constexpr):
    """Where the keys that query `row` sees end (exclusive, at least 0)."""
    if HAS_RIGHT:
        end = gl.maximum(gl.minimum(seqlen_k, row + diag_offset + window_right + 1), 0)
    else:
        end = seqlen_k
    return end


@gluon.jit
def _load_elementwise(view, start_n, rows_left, cols_left, layout: gl.constexpr,
                      FORM: gl.constexpr, EVEN_M: gl.constexpr, EVEN_N: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """A mask's / bias's [BM, BN] tile at key start_n (view: (its row 0, key 0; row stride;
    column stride)) in the scores' layout; a dim it broadcasts (FORM) is loaded once ([1, BN],
    [BM, 1] or a scalar). Elements past Sq / Sk read 0."""
    rows_base, stride_m, stride_n = view
    base = rows_base + start_n.to(gl.int64) * stride_n
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    return load_pair_tile(base, rows, cols, stride_m, stride_n, rows_left, cols_left,
                          FORM.rows_shared, FORM.cols_shared, EVEN_M, EVEN_N)


@gluon.jit
def _drop_past_key_end(z, rows, start_n, row_ends, diag_offset, window_left, window_right,
                       HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, BLOCK_N: gl.constexpr):
    """z [BM, BN] of the key tile at start_n with -inf past each row's end (row_ends: Sk, or
    [BM] per-row key lengths) and outside each row's window."""
    keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, z.type.layout))
    return drop_outside_window(z, rows, keys, diag_offset + window_right,
                               diag_offset - window_left, row_ends, float("-inf"), HAS_LEFT,
                               HAS_RIGHT, True, False)


@gluon.jit
def _softmax_tile(s, m_i, l_i, rows, start_n, row_ends, key_full, diag_offset, window_left,
                  window_right, qk_scale_log2, keep, bias, KEYS: gl.constexpr,
                  MASK: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_LEFT: gl.constexpr,
                  HAS_RIGHT: gl.constexpr, EXPLICIT: gl.constexpr, BLOCK_N: gl.constexpr):
    """Online-softmax update for the scores s [BM, BN] of the key tile at start_n -> (p, m, l,
    alpha). KEYS: drop keys past each row's end (row_ends: Sk, or the per-row key lengths) and
    outside each row's window (explicit schedules without a left bound: only in tiles that
    reach past key_full, the first row's key end; with one, in
    every PARTIAL tile, as the left edges cut tiles anywhere before it);
    MASK: drop the keys whose `keep` is 0; bias: added to the scores (HAS_BIAS). A tile with
    none of these is seen whole by every row: its row max is finite and needs no -inf guard.
    Each term is its own select (a predicate each): ANDing them first kept the booleans in
    registers."""
    if KEYS or MASK or HAS_BIAS:
        if HAS_BIAS:
            # natural units, one FMA per element; log2(e) goes into the exp2's FMA
            z = s * (qk_scale_log2 * LN2) + bias.to(gl.float32)
            unit = LOG2E
        else:
            z = s  # the scale goes into the exp2's FMA (it is positive: the max commutes)
            unit = qk_scale_log2
        if MASK:
            z = gl.where(keep != 0, z, float("-inf"))
        if KEYS:
            if EXPLICIT and not HAS_LEFT:
                if start_n + BLOCK_N > key_full:
                    z = _drop_past_key_end(z, rows, start_n, row_ends, diag_offset,
                                           window_left, window_right, HAS_LEFT, HAS_RIGHT,
                                           BLOCK_N)
            else:
                z = _drop_past_key_end(z, rows, start_n, row_ends, diag_offset, window_left,
                                       window_right, HAS_LEFT, HAS_RIGHT, BLOCK_N)
        m_new = gl.maximum(m_i, gl.max(z, 1) * unit)
        # a row with nothing visible yet keeps m = -inf; subtract 0 there: no inf - inf
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(z * unit - m_shift[:, None])
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale_log2)
        m_shift = m_new
        p = gl.exp2(s * qk_scale_log2 - m_new[:, None])
    alpha = gl.exp2(m_i - m_shift)
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _elementwise_tiles(start_n, mask_view, bias_view, rows_left, cols_left, layout: gl.constexpr,
                       MASKED: gl.constexpr, MASK_FORM: gl.constexpr, BIAS_FORM: gl.constexpr,
                       EVEN_M: gl.constexpr, EVEN_N: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr):
    """(keep, bias) tiles of the key tile at start_n that a step loads itself (0 for one it does
    not): the mask in MASKED steps, the bias in every one, each unless the producer's (by TMA)."""
    keep = 0
    bias = 0
    if MASKED and MASK_FORM.given and not MASK_FORM.tma:
        keep = _load_elementwise(mask_view, start_n, rows_left, cols_left, layout, MASK_FORM,
                                 EVEN_M, EVEN_N, BLOCK_M, BLOCK_N)
    if BIAS_FORM.given and not BIAS_FORM.tma:
        bias = _load_elementwise(bias_view, start_n, rows_left, cols_left, layout, BIAS_FORM,
                                 EVEN_M, EVEN_N, BLOCK_M, BLOCK_N)
    return keep, bias


@gluon.jit
def _release_steps(first, end, k_ready, v_ready, kv_free, NUM_BUF: gl.constexpr):
    """Steps [first, end), loaded for other consumers only: each released once its K and V
    are there. Waiting for K too keeps this consumer's later waits on k_ready in phase: they
    test parity only, so a skipped phase lets the wait for step j + NUM_BUF pass on step j's
    when V lands before K (H100, D256, window (1024, 0): identical calls gave different
    outputs, and launches faulted)."""
    for j in range(first, end):
        mbarrier.wait(k_ready.index(j % NUM_BUF), (j // NUM_BUF) & 1)
        mbarrier.wait(v_ready.index(j % NUM_BUF), (j // NUM_BUF) & 1)
        mbarrier.arrive(kv_free.index(j % NUM_BUF))
        mbarrier.arrive(kv_free.index(NUM_BUF + j % NUM_BUF))


@gluon.jit
def _attend(common, CONSUMER: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
            EXPLICIT: gl.constexpr, ROW_ORDER: gl.constexpr, PACKED: gl.constexpr,
            MASK_FORM: gl.constexpr, BIAS_FORM: gl.constexpr, EVEN_M: gl.constexpr,
            EVEN_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            HEAD_DIM: gl.constexpr, NUM_BUF: gl.constexpr, FLAT: gl.constexpr,
            CONSUMERS: gl.constexpr):
    """Consumer warpgroup: rows [start_m + CONSUMER * BM, + BM) over its key tiles, each through
    `_overlapped_tile`. Explicit schedules: the program's PARTIAL tiles (predicate and mask),
    then its FULL ones. Implicit (step j: key tile first_tile + j): the tiles cut by the left
    edge of this consumer's rows' windows, those every row sees whole, then those cut on the
    right; a tile only other consumers need is still released once loaded, so the
    producer's ring keeps turning. This consumer's first step is always treated as PARTIAL.
    MASK_FORM / BIAS_FORM (`ElementForm`): by TMA, the mask / bias tiles come from the producer
    (mask_smem / bias_smem), else each consumer loads its own. Explicit schedules read each
    step's next key tile from the producer (next_tiles) once the step's K is there. ROW_ORDER
    (per-row key lengths alone, rows in length order, longest first; lens_rows / order_rows: the
    batch's sorted lengths and caller rows): keys [0, the last row's length) are seen whole, none
    past the first row's; the consumer gathers its q rows from q_rows and scatters out to o_rows
    (each at row 0 of the (batch, head)). PACKED: a tile cut by the sequence's end stores its rows
    inside it to o_rows (TMA would write the next sequence's rows too). lse_rows_base: the
    (batch, head)'s lse at row 0; q_start: the batch's first row of the flat (FLAT) view. common:
    the program's values and buffers, as the kernel packs them (one tuple for every consumer)."""
    (o_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_free, lse_rows_base, q_start,
     off_b, off_h, start_m, seqlen_q, seqlen_k, diag_offset, window_left, window_right,
     qk_scale_log2, first_tile, num_tiles_cta, num_part, part_list, full_list, mask_rows,
     stride_mm, stride_mn, bias_rows, stride_bm, stride_bn, mask_smem, bias_smem, next_tiles,
     q_rows, stride_qm, o_rows, stride_om, lens_rows, order_rows) = common
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row0 = start_m + CONSUMER * BLOCK_M
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    rows_left = seqlen_q - row0
    mask_rows += CONSUMER * BLOCK_M * stride_mm
    bias_rows += CONSUMER * BLOCK_M * stride_bm
    # keys past Sk or outside a row's window exist in the PARTIAL tiles only if:
    KEYS: gl.constexpr = HAS_LEFT or HAS_RIGHT or not EVEN_N or ROW_ORDER
    q = q_smem.index(CONSUMER).reshape([BLOCK_M, HEAD_DIM])
    row_ends = seqlen_k
    if ROW_ORDER:
        gather_rows(q_rows, stride_qm, order_rows, row0, seqlen_q, q, BLOCK_M, HEAD_DIM)
        row_ends = gl.load(lens_rows + rows, mask=rows < seqlen_q, other=0)  # [BM]
    # keys [0, key_full) are visible to every row of this consumer (explicit schedules)
    key_full = _key_end(row0, seqlen_k, diag_offset, window_right, HAS_RIGHT)
    if EXPLICIT:
        # steps [0, num_part) PARTIAL, then FULL
        first = 0
        num_tiles = num_tiles_cta
        left_end = num_part
        whole_end = num_tiles
    else:
        # steps [first, left_end) cut on the left, [left_end, whole_end) whole, the rest up to
        # num_tiles cut on the right
        lo, full_lo, full_hi, hi = implicit_kv_range(
            row0, seqlen_q, seqlen_k, diag_offset, window_left, window_right, BLOCK_M, BLOCK_N,
            HAS_LEFT, HAS_RIGHT)
        if ROW_ORDER:
            longest = gl.load(lens_rows + row0, mask=row0 < seqlen_q, other=0)
            shortest = gl.load(lens_rows + gl.minimum(row0 + BLOCK_M, seqlen_q) - 1,
                               mask=row0 < seqlen_q, other=0)
            lo, full_lo, full_hi, hi = clip_ranges(lo, full_lo, full_hi, hi,
                                                   shortest // BLOCK_N, gl.cdiv(longest, BLOCK_N))
        first = lo - first_tile
        num_tiles = hi - first_tile
        left_end = full_lo - first_tile
        whole_end = full_hi - first_tile
    if row0 >= seqlen_q:
        first = 0
        num_tiles = 0
    _release_steps(0, first, k_ready, v_ready, kv_free, NUM_BUF)

    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    if num_tiles > first:
        start_n = (first_tile + tile_at(first, num_part, part_list, full_list, EXPLICIT)) \
            * BLOCK_N
        keep, bias = _elementwise_tiles(
            start_n, (mask_rows, stride_mm, stride_mn), (bias_rows, stride_bm, stride_bn),
            rows_left, seqlen_k - start_n, s_layout, True, MASK_FORM, BIAS_FORM, EVEN_M, EVEN_N,
            BLOCK_M, BLOCK_N)
        first_buf = first % NUM_BUF
        if not ROW_ORDER:
            mbarrier.wait(q_ready.index(CONSUMER), 0)
        mbarrier.wait(k_ready.index(first_buf), (first // NUM_BUF) & 1)
        next_n = _next_key_start(first, first_tile, num_tiles, next_tiles, first_buf, EXPLICIT,
                                 BLOCK_N)
        s = warpgroup_mma(q, k_smem.index(first_buf).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)),
                          s_zero, use_acc=False, is_async=True)
        if MASK_FORM.given and MASK_FORM.tma:
            keep = mask_smem.index(CONSUMER).load(s_layout)
        if BIAS_FORM.tma:
            bias = bias_smem.index(first_buf * CONSUMERS + CONSUMER).load(s_layout)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(kv_free.index(first_buf))
        step0_left = window_left
        step0_right = window_right
        if EXPLICIT:
            if num_part == 0:
                # a FULL first step drops only the keys past Sk: a block mask's FULL tiles may
                # lie outside its predicate
                step0_left = seqlen_q + seqlen_k
                step0_right = seqlen_q + seqlen_k
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, rows, start_n, row_ends, key_full,
                                           diag_offset, step0_left, step0_right, qk_scale_log2,
                                           keep, bias, KEYS, MASK_FORM.given, BIAS_FORM.given,
                                           HAS_LEFT, HAS_RIGHT, EXPLICIT, BLOCK_N)
        p_op = gl.convert_layout(p.to(q.dtype), p_layout)
        # three runs of steps. Explicit: the PARTIAL ones, then the FULL ones; implicit: the
        # tiles cut by the windows' left edges, those seen whole, those cut on the right or by
        # Sk. The middle run applies no window term (a block mask's FULL tiles may lie outside
        # its predicate); an explicit schedule's FULL tiles may still run past Sk
        run_ends = (left_end, whole_end, num_tiles)
        for run in gl.static_range(3):
            if (run == 0 and (EXPLICIT or HAS_LEFT)) or run == 1 or (run == 2 and not EXPLICIT):
                if run == 0:
                    begin = first + 1
                else:
                    begin = gl.maximum(run_ends[run - 1], first + 1)
                for j in range(begin, run_ends[run]):
                    acc, p_op, m_i, l_i, next_n = _overlapped_tile(
                        j, next_n, q, k_smem, v_smem, k_ready, v_ready, kv_free, acc, p_op, m_i,
                        l_i, s_zero, rows, rows_left, seqlen_k, row_ends, key_full, diag_offset,
                        window_left, window_right, qk_scale_log2, first_tile, num_tiles,
                        (mask_rows, stride_mm, stride_mn), (bias_rows, stride_bm, stride_bn),
                        mask_smem, bias_smem, next_tiles, CONSUMER, EXPLICIT, run != 1,
                        (run != 1 and KEYS) or (EXPLICIT and not EVEN_N), MASK_FORM, BIAS_FORM,
                        HAS_LEFT and run != 1, HAS_RIGHT and run != 1, EVEN_M, EVEN_N, BLOCK_M,
                        BLOCK_N, HEAD_DIM, NUM_BUF, CONSUMERS, s_layout, o_layout, p_layout)
        last = (num_tiles - 1) % NUM_BUF
        mbarrier.wait(v_ready.index(last), ((num_tiles - 1) // NUM_BUF) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(last).reshape([BLOCK_N, HEAD_DIM]), acc,
                            is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        mbarrier.arrive(kv_free.index(NUM_BUF + last))
    _release_steps(num_tiles, num_tiles_cta, k_ready, v_ready, kv_free, NUM_BUF)

    seen = l_i > 0.0
    l_o = gl.convert_layout(gl.where(seen, l_i, 1.0), gl.SliceLayout(1, o_layout))
    out = (acc / l_o[:, None]).to(q.dtype)  # rows that saw no key: 0
    lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    lse_rows = rows
    if ROW_ORDER:
        lse_rows = gl.load(order_rows + rows, mask=rows < seqlen_q, other=0)
    gl.store(lse_rows_base + lse_rows, lse, mask=rows < seqlen_q)
    # the query buffer is free now: stage the output there
    if ROW_ORDER:
        q.store(out)
        scatter_rows(q, o_rows, stride_om, order_rows, row0, seqlen_q, BLOCK_M, HEAD_DIM)
    else:
        mbarrier.wait(q_ready.index(CONSUMER), 0)
        q.store(out)
        if PACKED and row0 + BLOCK_M > seqlen_q:
            scatter_rows(q, o_rows, stride_om, order_rows, row0, seqlen_q, BLOCK_M, HEAD_DIM,
                          ORDERED=False)
        else:
            # padded: TMA drops rows past Sq
            fence_async_shared()
            if FLAT:
                tma.async_copy_shared_to_global(o_desc, [q_start + row0, off_h * HEAD_DIM],
                                                q_smem.index(CONSUMER))
            else:
                tma.async_copy_shared_to_global(o_desc, [off_b, row0, off_h, 0],
                                                q_smem.index(CONSUMER))
            tma.store_wait(0)


@gluon.jit
def _overlapped_tile(j, start_n, q, k_smem, v_smem, k_ready, v_ready, kv_free, acc, p_op, m_i, l_i,
                     s_zero, rows, rows_left, seqlen_k, row_ends, key_full, diag_offset,
                     window_left, window_right, qk_scale_log2, first_tile, num_tiles, mask_view,
                     bias_view, mask_smem, bias_smem, next_tiles, CONSUMER: gl.constexpr,
                     EXPLICIT: gl.constexpr, MASKED: gl.constexpr, KEYS: gl.constexpr,
                     MASK_FORM: gl.constexpr, BIAS_FORM: gl.constexpr, HAS_LEFT: gl.constexpr,
                     HAS_RIGHT: gl.constexpr, EVEN_M: gl.constexpr, EVEN_N: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                     NUM_BUF: gl.constexpr, CONSUMERS: gl.constexpr, s_layout: gl.constexpr,
                     o_layout: gl.constexpr, p_layout: gl.constexpr):
    """Step j, on the key tile at start_n: issue S_j = Q K_j^T and acc += P_{j-1} V_{j-1}; the
    softmax of S_j runs while the second matmul is on the tensor cores. K_j's buffer goes back
    to the producer once S_j is done, V_{j-1}'s after its matmul. MASKED: a PARTIAL step (reads
    the mask, applies the KEYS predicate). Returns the next step's key start (explicit: from
    the producer, with K_j), known a step ahead like the mask / bias tiles, whose loads are
    issued before the waits (by TMA: the producer's tiles are read while the matmuls run).
    mask_view / bias_view: (row 0 of this consumer at key 0, row stride, column stride)."""
    keep, bias = _elementwise_tiles(start_n, mask_view, bias_view, rows_left, seqlen_k - start_n,
                                    s_layout, MASKED, MASK_FORM, BIAS_FORM, EVEN_M, EVEN_N,
                                    BLOCK_M, BLOCK_N)
    buf = j % NUM_BUF
    prev = (j - 1) % NUM_BUF
    mbarrier.wait(k_ready.index(buf), (j // NUM_BUF) & 1)
    s = warpgroup_mma(q, k_smem.index(buf).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                      use_acc=False, is_async=True)
    next_n = _next_key_start(j, first_tile, num_tiles, next_tiles, buf, EXPLICIT, BLOCK_N)
    mbarrier.wait(v_ready.index(prev), ((j - 1) // NUM_BUF) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc,
                        is_async=True)
    # the producer's tiles are read while the matmuls run, the mask joined with the bias (one
    # -inf select off the softmax's path: 0.410 against 0.416 ms); a mask the consumer loads
    # itself would be waited for here (0.452 against 0.439)
    if BIAS_FORM.tma:
        bias = bias_smem.index(buf * CONSUMERS + CONSUMER).load(s_layout)
    TERMS: gl.constexpr = MASKED and MASK_FORM.given and MASK_FORM.tma
    if TERMS:
        keep = mask_smem.index(buf * CONSUMERS + CONSUMER).load(s_layout)
        if BIAS_FORM.given:
            bias = gl.where(keep != 0, bias.to(gl.float32), float("-inf"))
        else:
            bias = gl.where(keep != 0, 0.0, float("-inf"))
    s = warpgroup_mma_wait(1, deps=(s,))  # groups retire in order: S_j is done
    mbarrier.arrive(kv_free.index(buf))  # K_j (and the step's mask / bias tiles, read above)
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, rows, start_n, row_ends, key_full,
                                       diag_offset, window_left, window_right, qk_scale_log2,
                                       keep, bias, KEYS, MASKED and MASK_FORM.given and not TERMS,
                                       BIAS_FORM.given or TERMS, HAS_LEFT, HAS_RIGHT, EXPLICIT,
                                       BLOCK_N)
    # P_{j-1} stays live until its matmul is done: the wgmma reads it from registers
    acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    mbarrier.arrive(kv_free.index(NUM_BUF + prev))
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return acc, gl.convert_layout(p.to(q.dtype), p_layout), m_i, l_i, next_n


@gluon.jit
def _fwd_hopper_kernel(
    q_desc, k_desc, v_desc, o_desc, Lse, lse_strides, KvNum, KvIdx, FullKvNum, FullKvIdx,
    list_strides, Mask, mask_layout, mask_desc, mask_batch_rows, Bias, bias_layout, bias_desc,
    bias_batch_rows, shape, window, qk_scale_log2, Q, q_strides, Out, out_strides, RowLens,
    stride_rlb, RowOrder, CuSeqlensQ, CuSeqlensK,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, REVERSE_M: gl.constexpr,
    EXPLICIT: gl.constexpr, ROW_ORDER: gl.constexpr, PACKED: gl.constexpr,
    MASK_FORM: gl.constexpr, BIAS_FORM: gl.constexpr,
    EVEN_M: gl.constexpr, EVEN_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr, NUM_BUF: gl.constexpr, FLAT: gl.constexpr, CONSUMERS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    """Tensors and descriptors are arguments of their own (call plans replay a launch by setting
    them); their scalars come in tuples, in the order the launcher flattens: lse_strides (batch,
    head), list_strides ((batch, head, row) of the lists' num, indices, full num, full indices,
    then the list head divisor), mask_layout / bias_layout (batch, head, row, column strides, head divisor), shape (Sq, Sk,
    heads, group), window (diag offset, left, right), q_strides / out_strides (batch, row, head).
    MASK_FORM / BIAS_FORM: `ElementForm`s."""
    stride_lb, stride_lh = lse_strides
    stride_mb, stride_mh, stride_mm, stride_mn, mask_head_div = mask_layout
    stride_bb, stride_bh, stride_bm, stride_bn, bias_head_div = bias_layout
    seqlen_q, seqlen_k, num_heads, group = shape
    diag_offset, window_left, window_right = window
    stride_qb, stride_qm, stride_qh = q_strides
    stride_ob, stride_om, stride_oh = out_strides
    tile_m = gl.program_id(0)
    if REVERSE_M:
        # causal: the longest rows start first, so the tail of the grid is short work
        tile_m = gl.num_programs(0) - 1 - tile_m
    off_bh = gl.program_id(1)
    off_b = off_bh // num_heads
    off_h = off_bh % num_heads
    start_m = tile_m * (CONSUMERS * BLOCK_M)
    # packed: q_start is the sequence's first row of out / lse too
    q_start, seqlen_q, k_start, seqlen_k, diag_offset = flat_view_bounds(
        CuSeqlensQ, CuSeqlensK, off_b, seqlen_q, seqlen_k, diag_offset, PACKED)
    if PACKED and start_m >= seqlen_q:  # the grid covers the longest sequence
        return
    if EXPLICIT:
        part_num, part_list, full_num, full_list = schedule_rows(
            KvNum, KvIdx, FullKvNum, FullKvIdx, off_b, off_h, tile_m, *list_strides)
        num_part = gl.load(part_num)
        num_tiles = num_part + gl.load(full_num)
        first_tile = 0
    else:
        num_part = 0
        part_list = KvIdx
        full_list = FullKvIdx
        # the producer loads the tiles any of the program's rows needs: from the first row's
        # first (the first consumer's) to the last row's last (the last consumer's)
        first_tile, _, _, end_tile = implicit_kv_range(
            start_m, seqlen_q, seqlen_k, diag_offset, window_left, window_right,
            CONSUMERS * BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        num_tiles = end_tile - first_tile
    # rows in length order: the program's first row is its longest
    lens_rows = RowLens + off_b.to(gl.int64) * stride_rlb
    order_rows = RowOrder + off_b.to(gl.int64) * stride_rlb
    if ROW_ORDER:
        num_tiles = gl.minimum(num_tiles, gl.cdiv(gl.load(lens_rows + start_m), BLOCK_N))
    q_rows = Q + off_b.to(gl.int64) * stride_qb + off_h.to(gl.int64) * stride_qh
    o_rows = Out + off_b.to(gl.int64) * stride_ob + off_h.to(gl.int64) * stride_oh
    lse_rows_base = Lse + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh
    if PACKED:
        o_rows += q_start.to(gl.int64) * stride_om
        lse_rows_base += q_start
    # int64: batch / head / row offsets of a (B, H, Sq, Sk) mask pass 2**31 elements
    mask_rows = Mask + off_b.to(gl.int64) * stride_mb \
        + (off_h // mask_head_div).to(gl.int64) * stride_mh + start_m.to(gl.int64) * stride_mm
    bias_rows = Bias + off_b.to(gl.int64) * stride_bb \
        + (off_h // bias_head_div).to(gl.int64) * stride_bh + start_m.to(gl.int64) * stride_bm

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape,
                                       q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_BUF] + k_desc.block_type.shape,
                                       k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_BUF] + v_desc.block_type.shape,
                                       v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    # releases of each buffer's K (index buf) and V (NUM_BUF + buf)
    kv_free = gl.allocate_shared_memory(gl.int64, [2 * NUM_BUF, 1], mbarrier.MBarrierLayout())
    # each step's mask / bias, a [BM, BN] tile per consumer
    mask_smem = producer_tiles(mask_desc, NUM_BUF, MASK_FORM.tma, CONSUMERS)
    bias_smem = producer_tiles(bias_desc, NUM_BUF, BIAS_FORM.tma, CONSUMERS)
    # explicit schedules: the key tile of the step after each buffered one, from the producer
    next_tiles = gl.allocate_shared_memory(gl.int32, [NUM_BUF, 1],
                                           gl.SwizzledSharedLayout(1, 1, 1, [0]))
    # initialised only where used (a gathered q has none: see bwd_hopper's bias_ready)
    if not ROW_ORDER:
        for c in gl.static_range(CONSUMERS):
            mbarrier.init(q_ready.index(c), count=1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_free.index(i), count=CONSUMERS)  # one release per consumer
        mbarrier.init(kv_free.index(NUM_BUF + i), count=CONSUMERS)

    # the values and buffers each consumer (common) and the producer take, packed once; the
    # constexprs stay out: a tuple assigned in a kernel turns them into tensors
    common = (o_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_free, lse_rows_base,
              q_start, off_b, off_h, start_m, seqlen_q, seqlen_k, diag_offset, window_left,
              window_right, qk_scale_log2, first_tile, num_tiles, num_part, part_list, full_list,
              mask_rows, stride_mm, stride_mn, bias_rows, stride_bm, stride_bn, mask_smem,
              bias_smem, next_tiles, q_rows, stride_qm, o_rows, stride_om, lens_rows, order_rows)
    producer = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready,
                kv_free, off_b, off_h, off_h // group, start_m, first_tile, num_tiles, num_part,
                part_list, full_list, q_start, k_start, mask_desc, mask_smem,
                off_b * mask_batch_rows + (off_h // mask_head_div) * seqlen_q + start_m,
                bias_desc, bias_smem,
                off_b * bias_batch_rows + (off_h // bias_head_div) * seqlen_q + start_m,
                next_tiles)
    gl.static_assert(CONSUMERS == 2 or CONSUMERS == 3, "two or three consumer warpgroups")
    if CONSUMERS == 3:
        gl.warp_specialize([(_attend, (common, 0, HAS_LEFT, HAS_RIGHT, EXPLICIT, ROW_ORDER, PACKED,
                                       MASK_FORM, BIAS_FORM, EVEN_M, EVEN_N, BLOCK_M, BLOCK_N,
                                       HEAD_DIM, NUM_BUF, FLAT, CONSUMERS)),
                            (_attend, (common, 1, HAS_LEFT, HAS_RIGHT, EXPLICIT, ROW_ORDER, PACKED,
                                       MASK_FORM, BIAS_FORM, EVEN_M, EVEN_N, BLOCK_M, BLOCK_N,
                                       HEAD_DIM, NUM_BUF, FLAT, CONSUMERS)),
                            (_attend, (common, 2, HAS_LEFT, HAS_RIGHT, EXPLICIT, ROW_ORDER, PACKED,
                                       MASK_FORM, BIAS_FORM, EVEN_M, EVEN_N, BLOCK_M, BLOCK_N,
                                       HEAD_DIM, NUM_BUF, FLAT, CONSUMERS)),
                            (_load_kv, (producer, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_BUF, FLAT,
                                        EXPLICIT, MASK_FORM, BIAS_FORM, ROW_ORDER, CONSUMERS))],
                           [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_attend, (common, 0, HAS_LEFT, HAS_RIGHT, EXPLICIT, ROW_ORDER, PACKED,
                                       MASK_FORM, BIAS_FORM, EVEN_M, EVEN_N, BLOCK_M, BLOCK_N,
                                       HEAD_DIM, NUM_BUF, FLAT, CONSUMERS)),
                            (_attend, (common, 1, HAS_LEFT, HAS_RIGHT, EXPLICIT, ROW_ORDER, PACKED,
                                       MASK_FORM, BIAS_FORM, EVEN_M, EVEN_N, BLOCK_M, BLOCK_N,
                                       HEAD_DIM, NUM_BUF, FLAT, CONSUMERS)),
                            (_load_kv, (producer, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_BUF, FLAT,
                                        EXPLICIT, MASK_FORM, BIAS_FORM, ROW_ORDER, CONSUMERS))],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _plain(schedule, bias: Elementwise | None, packed: PackedSequences | None,
           row_lens: torch.Tensor | None) -> bool:
    """A call `hopper_forward_config` calls plain: no schedule, bias, per-row lengths or
    packing."""
    return schedule is None and bias is None and packed is None and row_lens is None


def hopper_forward_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           args: KernelArgs, schedule_tiles: tuple[int, int] | None = None,
                           bias: Elementwise | None = None,
                           packed: PackedSequences | None = None,
                           row_lens: torch.Tensor | None = None) -> str | None:
    """Why `hopper_forward` cannot run this call, or None where it can: a candidate
    (`gluon_refusal`) with (B, S, H, D) tensors that TMA can read and an explicit schedule, if
    any (its (block_m, block_n): schedule_tiles), at its tiles; packed sequences with (total, H,
    D) tensors whose heads are packed (viewable as (total, H * D)), without a schedule or bias.
    The results are the launcher's: out like q (its layout when q's is dense, else contiguous;
    TMA reads either where it reads q), lse contiguous."""
    full_bias = bias.tensor if bias is not None and bias.spans_queries_and_keys else None
    if packed is not None:
        if schedule_tiles is not None or bias is not None:
            return "packed sequences with a mask or bias"
        if q.dim() != 3 or not all(flat_rows(t) for t in (q, k, v)):
            return "packed q / k / v whose heads are not packed in their rows"
    elif q.dim() != 4:
        return "q is not (B, S, H, D)"
    plain = _plain(schedule_tiles, bias, packed, row_lens)
    refusal = gluon_refusal(q, args, full_bias, plain=plain)
    if refusal is not None:
        return refusal
    cfg = hopper_forward_config(q.shape[-1], full_bias is not None, plain)
    if schedule_tiles is not None and schedule_tiles != (cfg.block_m, cfg.block_n):
        return f"schedule lists at {schedule_tiles[0]} x {schedule_tiles[1]} tiles, not its " \
            f"{cfg.block_m} x {cfg.block_n}"
    if not tma_compatible(q, k, v):
        return "q / k / v strides or bases TMA cannot read (16-byte multiples needed)"
    return None


def hopper_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: KernelArgs,
                   out: torch.Tensor, lse: torch.Tensor, schedule: TileLists | None = None,
                   mask: Elementwise | None = None, bias: Elementwise | None = None,
                   row_lens: torch.Tensor | None = None,
                   row_order: torch.Tensor | None = None,
                   packed: PackedSequences | None = None) -> None:
    """q (B, Sq, H, D), k/v (B, Sk, Hk, D) -> out (like q), lse (B, H, Sq) fp32, written in place;
    packed: q (total_q, H, D), k/v (total_k, Hk, D) -> lse (H, total_q). schedule: the forward lists
    (None: dense / causal / window from args); the mask (which needs them) is applied in their
    PARTIAL tiles, the bias in every tile. row_lens / row_order (int32 (B, Sq), contiguous; per-row
    key lengths alone): the lengths sorted longest first within each batch, clamped to [0, Sk], and
    the caller row of each (`length_order`): tiles follow that order, q / out / lse stay in the
    caller's. The plan (plan.py) gives it only calls `hopper_forward_refusal` accepts."""
    batch, seqlen_q, seqlen_k = batch_shape(q, k, packed)
    num_heads, head_dim = q.shape[-2:]
    num_heads_k = k.shape[-2]
    if mask is not None and schedule is None:
        raise ValueError("hopper_forward: an element mask comes with its schedule's lists")
    if (row_lens is None) != (row_order is None):
        raise ValueError("hopper_forward: row_lens and row_order come together")
    cfg = hopper_forward_config(head_dim, bias is not None and bias.spans_queries_and_keys,
                                _plain(schedule, bias, packed, row_lens))
    block_m = cfg.block_m // cfg.consumers  # rows per consumer warpgroup
    n_tiles_m = cdiv(seqlen_q, cfg.block_m)
    flat = packed is not None or flat_launch(seqlen_q, seqlen_k, cfg.block_m, cfg.block_n, q, k,
                                             v, out)
    even = packed is None
    lists = schedule.operands(num_heads) if schedule is not None \
        else TileLists.placeholder_operands(q.device)
    unused = Elementwise.placeholder_operands(q.device)
    # (tensor, its (batch, head, row, column) strides, head divisor)
    mask_operands = mask.operands() if mask is not None else unused
    bias_operands = bias.operands() if bias is not None else unused
    mask_tma = by_tma(mask, block_m, cfg.block_n, 1) if cfg.mask_buffers else None
    bias_tma = by_tma(bias, block_m, cfg.block_n, 2)
    q_desc = descriptor(q, block_m, flat)
    launch(_fwd_hopper_kernel, (n_tiles_m, batch * num_heads),
        q_desc, descriptor(k, cfg.block_n, flat),
        descriptor(v, cfg.block_n, flat), descriptor(out, block_m, flat), lse,
        lse_strides(lse), *lists[:4], lists[4:], mask_operands[0], mask_operands[1:],
        *(mask_tma if mask_tma is not None else (q_desc, 0)), bias_operands[0],
        bias_operands[1:], *(bias_tma if bias_tma is not None else (q_desc, 0)),
        (seqlen_q, seqlen_k, num_heads, num_heads // num_heads_k),
        (seqlen_k - seqlen_q, args.window_left, args.window_right), args.qk_scale_log2, q,
        row_strides(q), out, row_strides(out), *row_lens_operands(row_lens, q.device, row_order),
        *packed_operands(packed, q.device),
        HAS_LEFT=args.has_left, HAS_RIGHT=args.has_right, REVERSE_M=args.later_rows_see_more,
        EXPLICIT=schedule is not None, ROW_ORDER=row_order is not None, PACKED=packed is not None,
        MASK_FORM=ElementForm.of(mask, mask_tma is not None),
        BIAS_FORM=ElementForm.of(bias, bias_tma is not None),
        EVEN_M=even and seqlen_q % cfg.block_m == 0, EVEN_N=even and seqlen_k % cfg.block_n == 0,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n, HEAD_DIM=head_dim,
        NUM_BUF=cfg.num_buffers if mask_tma is None else cfg.mask_buffers, FLAT=flat,
        CONSUMERS=cfg.consumers, CONSUMER_REGS=cfg.consumer_regs,
        PRODUCER_REGS=cfg.producer_regs, num_warps=4)
