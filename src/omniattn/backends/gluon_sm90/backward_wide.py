"""Hopper backward in Gluon for head dim 256: dense, causal, windows, GQA, per-row key lengths
alone (rows in length order, as in bwd_hopper.py), packed sequences (tiles from each sequence's
first row, as there; dK / dV are plain stores in any case); no lists, masks or biases: those
calls stay in bwd.py.

At D256 one consumer cannot hold dK and dV of 64 keys (2 x 64 x 256 fp32: 256 registers), so
the two consumer warpgroups split the work two ways. A program owns 64 keys of one (batch, KV
head) and walks 64-row query tiles of every head of the group. For S = Q K^T and dP = dO V^T
consumer c takes keys [32c, 32c + 32) (the whole head dim contracted); both write their halves
of P^T and dS^T to shared memory and meet; then consumer c computes dV, dK and dQ for head-dim
columns [128c, 128c + 128). Every operand is kept in [64, 64] boxes (128-byte rows) so that
each matmul reads whole boxes. dQ is reduce-added by TMA from the tile's own q and dO boxes of
this consumer's columns, which nothing reads any more once both consumers met: 224 KB of
shared memory in all (K, V 64; q, dO 2 x 64; P^T, dS^T 2 x 16)."""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from ...kernels.common import implicit_q_range
from ...kernels.schedule import KernelArgs
from ...kernels.sequences import (PackedSequences, batch_shape, packed_operands, row_lens_operands,
                                  row_strides, rows_to_callers)
from ...kernels.sizes import cdiv
from ...runtime.launch import launch
from .backward import (async_reduce_add, key_tile_grid, key_tile_program, length_q_tiles,
                       stats_descriptor)
from .blocks import descriptor, drop_outside_window, flat_launch, flat_view_bounds
from .configs import hopper_backward_config

BOX = 64  # rows and columns of every box (64 bf16 columns: a 128-byte swizzle's row)


@gluon.jit
def _copy_boxes(desc, off_b, row, head, seq_start, ready, dst, first,
                HEAD_DIM: gl.constexpr, FLAT: gl.constexpr):
    """The [64, 256] tile at (batch, first row, head) into boxes dst[first .. first + 3], one
    TMA copy per 64 columns, arriving on `ready` (whose expected bytes the caller set). FLAT:
    the batch's rows start at seq_start of the 2-d view."""
    for k in gl.static_range(4):
        if FLAT:
            tma.async_copy_global_to_shared(desc, [seq_start + row,
                                                   head * HEAD_DIM + k * 64], ready,
                                            dst.index(first + k))
        else:
            tma.async_copy_global_to_shared(desc, [off_b, row, head, k * 64], ready,
                                            dst.index(first + k))


@gluon.jit
def _load(q_desc, do_desc, k_desc, v_desc, stats_desc, q_smem, do_smem, k_smem, v_smem,
          lse_smem, delta_smem, kv_ready, q_ready, do_ready, qdo_free, off_b, off_hk, num_heads,
          delta_row0, start_n, first_m, end_m, group, q_start, k_start,
          BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, FLAT: gl.constexpr):
    """Producer: the program's K and V once, then q with its lse row and dO with its delta row
    of each query tile of each head of the group into buffer i % 2 (boxes 4b .. 4b + 3) once
    both consumers released the tile that used it before."""
    box_bytes: gl.constexpr = k_desc.block_type.nbytes
    mbarrier.expect(kv_ready.index(0), 4 * box_bytes)
    _copy_boxes(k_desc, off_b, start_n, off_hk, k_start, kv_ready.index(0), k_smem, 0, HEAD_DIM,
                FLAT)
    mbarrier.expect(kv_ready.index(1), 4 * box_bytes)
    _copy_boxes(v_desc, off_b, start_n, off_hk, k_start, kv_ready.index(1), v_smem, 0, HEAD_DIM,
                FLAT)
    i = 0
    for h in range(group):
        head = off_hk * group + h
        stats_row = off_b * num_heads + head
        for tile_m in range(first_m, end_m):
            row = tile_m * BLOCK_M
            buf = i % 2
            # a fresh barrier passes a wait on parity 1: the first round needs no release
            mbarrier.wait(qdo_free.index(buf), ((i // 2) & 1) ^ 1)
            mbarrier.expect(q_ready.index(buf), 4 * box_bytes + stats_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(stats_desc, [stats_row, row], q_ready.index(buf),
                                            lse_smem.index(buf))
            _copy_boxes(q_desc, off_b, row, head, q_start, q_ready.index(buf), q_smem, 4 * buf,
                        HEAD_DIM, FLAT)
            mbarrier.expect(do_ready.index(buf), 4 * box_bytes + stats_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(stats_desc, [delta_row0 + stats_row, row],
                                            do_ready.index(buf), delta_smem.index(buf))
            _copy_boxes(do_desc, off_b, row, head, q_start, do_ready.index(buf), do_smem,
                        4 * buf, HEAD_DIM, FLAT)
            i += 1


@gluon.jit
def _box(smem, index):
    """Box `index` of a buffer of TMA boxes, as [64, 64]."""
    return smem.index(index).reshape([64, 64])


@gluon.jit
def _row_stats(stats_smem, buf, s_layout: gl.constexpr):
    """Row buf of lse / scale or delta ([1, 64] in shared memory) as [64, 1] in s_layout."""
    layout: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [1, 4], [1, 0])
    row = gl.sum(stats_smem.index(buf).load(layout), axis=0)
    return gl.convert_layout(row, gl.SliceLayout(1, s_layout))[:, None]


@gluon.jit
def _scores(a_smem, b_smem, a_first, key_rows, init, s_layout: gl.constexpr):
    """init + A B^T over the head dim: A's boxes a_first .. + 3 ([64 rows, 64 cols] each), B's
    rows key_rows of its boxes 0 .. 3 (this consumer's 32 keys): [64, 32] in s_layout."""
    acc = init
    for k in gl.static_range(4):
        acc = warpgroup_mma(_box(a_smem, a_first + k), _box(b_smem, k).slice(key_rows, 32)
                            .permute((1, 0)), acc, is_async=True)
    return acc


@gluon.jit
def _reduce_box(values, box, dq_desc, off_b, row, col, head, q_start, HEAD_DIM: gl.constexpr,
                FLAT: gl.constexpr):
    """values [64, 32] fp32 into the 8 KB box `box` (a dead bf16 box seen as fp32 with the same
    128-byte swizzle), then a TMA reduce-add of it at (row, head-dim column col)."""
    target = box._reinterpret(gl.float32, dq_desc.block_type.shape, dq_desc.layout)
    target.reshape([64, 32]).store(values)
    fence_async_shared()
    if FLAT:
        async_reduce_add(dq_desc, [q_start + row, head * HEAD_DIM + col], target)
    else:
        async_reduce_add(dq_desc, [off_b, row, head, col], target)


@gluon.jit
def _add_dq_half(dq, q_smem, do_smem, box, dq_desc, off_b, row, col, head, q_start,
                 softmax_scale, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                 FLAT: gl.constexpr):
    """dq [BM, 64] (head-dim columns col .. col + 63) reduce-added as two fp32 boxes of 32
    columns staged in the tile's dead q box and dO box `box`."""
    lo, hi = gl.split((dq * softmax_scale).reshape([BLOCK_M, 2, 32]).permute((0, 2, 1)))
    _reduce_box(lo, q_smem.index(box), dq_desc, off_b, row, col, head, q_start, HEAD_DIM, FLAT)
    _reduce_box(hi, do_smem.index(box), dq_desc, off_b, row, col + 32, head, q_start, HEAD_DIM,
                FLAT)


@gluon.jit
def _query_tile(i, tile_m, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, p_smem,
                ds_smem, q_ready, do_ready, qdo_free, pds_ready, dq_desc, dv0, dv1, dk0, dk1,
                keys, off_b, head, q_start, seqlen_q, seqlen_k, diag, diag_left, qk_scale_log2,
                softmax_scale, lens_rows, MASKED: gl.constexpr, HAS_LEFT: gl.constexpr,
                HAS_RIGHT: gl.constexpr, EVEN_N: gl.constexpr, ROW_ORDER: gl.constexpr,
                CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                FLAT: gl.constexpr, s_layout: gl.constexpr, acc_layout: gl.constexpr):
    """One query tile: this consumer's 32 keys of S and dP, its halves of P^T and dS^T into
    shared memory, then (both halves there) dV, dK, dQ for its 128 head-dim columns, dQ
    reduce-added from the tile's dead q / dO boxes. The buffers of tile i - 1 go back to the
    producer here, once its reductions have read them. ROW_ORDER: MASKED tiles drop the keys
    past each row's length (lens_rows: the batch's, rows in length order)."""
    buf = i % 2
    phase = (i // 2) & 1
    start_m = tile_m * BLOCK_M
    rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    row_ends = 0
    if MASKED and ROW_ORDER:
        row_ends = gl.load(lens_rows + rows, mask=rows < seqlen_q, other=0)  # [BM]
    mbarrier.wait(q_ready.index(buf), phase)
    lse_scaled = _row_stats(lse_smem, buf, s_layout)  # [BM, 1]
    s_zero = gl.zeros([BLOCK_M, 32], gl.float32, s_layout)
    s = _scores(q_smem, k_smem, 4 * buf, CONSUMER * 32, s_zero - lse_scaled, s_layout)
    if i > 0:
        tma.store_wait(0)  # tile i - 1's reductions have read its q / dO boxes
        mbarrier.arrive(qdo_free.index((i - 1) % 2))
    s = warpgroup_mma_wait(0, deps=(s,))
    p = gl.exp2(s * qk_scale_log2)  # [BM, 32]; rows past Sq have lse = +inf: p = 0
    if MASKED:
        if not EVEN_N:
            p = gl.where(keys[None, :] < seqlen_k, p, 0.0)
        p = drop_outside_window(p, rows, keys, diag, diag_left, 0, 0.0, HAS_LEFT, HAS_RIGHT,
                                False, False)
        if ROW_ORDER:
            p = gl.where(keys[None, :] < row_ends[:, None], p, 0.0)
    mbarrier.wait(do_ready.index(buf), phase)
    delta = _row_stats(delta_smem, buf, s_layout)  # [BM, 1]
    dp = _scores(do_smem, v_smem, 4 * buf, CONSUMER * 32, s_zero - delta, s_layout)
    dp = warpgroup_mma_wait(0, deps=(dp,))
    p = p.to(q_smem.dtype)
    ds = (p.to(gl.float32) * dp).to(q_smem.dtype)
    # this consumer's 32 keys of P^T and dS^T ([64 keys, BM] buffers, keys as rows)
    p_smem.index(buf).slice(CONSUMER * 32, 32).permute((1, 0)).store(p)
    ds_smem.index(buf).slice(CONSUMER * 32, 32).permute((1, 0)).store(ds)
    fence_async_shared()
    mbarrier.arrive(pds_ready.index(buf))
    mbarrier.wait(pds_ready.index(buf), phase)
    # this consumer's head-dim columns: boxes 2c, 2c + 1
    box0 = 2 * CONSUMER
    p_t = p_smem.index(buf)
    ds_t = ds_smem.index(buf)
    dv0 = warpgroup_mma(p_t, _box(do_smem, 4 * buf + box0), dv0, is_async=True)
    dv1 = warpgroup_mma(p_t, _box(do_smem, 4 * buf + box0 + 1), dv1, is_async=True)
    dk0 = warpgroup_mma(ds_t, _box(q_smem, 4 * buf + box0), dk0, is_async=True)
    dk1 = warpgroup_mma(ds_t, _box(q_smem, 4 * buf + box0 + 1), dk1, is_async=True)
    dv0, dv1, dk0, dk1 = warpgroup_mma_wait(0, deps=(dv0, dv1, dk0, dk1))
    acc_zero = gl.zeros([BLOCK_M, 64], gl.float32, acc_layout)
    # q's and dO's boxes of these columns are dead now (the other consumer reads its own):
    # each holds one fp32 [64, 32] box of dQ. One half of dQ at a time: both in flight spilled
    # (ptxas, sm_90a: 392 bytes against 84)
    col0 = CONSUMER * 128
    for half in gl.static_range(2):
        dq = warpgroup_mma(ds_t.permute((1, 0)), _box(k_smem, box0 + half), acc_zero,
                           use_acc=False, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq,))
        _add_dq_half(dq, q_smem, do_smem, 4 * buf + box0 + half, dq_desc, off_b, start_m,
                     col0 + half * 64, head, q_start, softmax_scale, BLOCK_M, HEAD_DIM, FLAT)
    return dv0, dv1, dk0, dk1


@gluon.jit
def _query_tiles(first, end, i, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, p_smem,
                 ds_smem, q_ready, do_ready, qdo_free, pds_ready, dq_desc, dv0, dv1, dk0, dk1,
                 keys, off_b, head, q_start, seqlen_q, seqlen_k, diag, diag_left, qk_scale_log2,
                 softmax_scale, lens_rows, MASKED: gl.constexpr, HAS_LEFT: gl.constexpr,
                 HAS_RIGHT: gl.constexpr, EVEN_N: gl.constexpr, ROW_ORDER: gl.constexpr,
                 CONSUMER: gl.constexpr,
                 BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, FLAT: gl.constexpr,
                 s_layout: gl.constexpr, acc_layout: gl.constexpr):
    """Query tiles [first, end) of a head through `_query_tile`, all MASKED or none (i: the
    running tile count across heads, which picks the buffers)."""
    for tile_m in range(first, end):
        dv0, dv1, dk0, dk1 = _query_tile(
            i, tile_m, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, p_smem, ds_smem,
            q_ready, do_ready, qdo_free, pds_ready, dq_desc, dv0, dv1, dk0, dk1, keys, off_b,
            head, q_start, seqlen_q, seqlen_k, diag, diag_left, qk_scale_log2, softmax_scale,
            lens_rows, MASKED, HAS_LEFT, HAS_RIGHT, EVEN_N, ROW_ORDER, CONSUMER, BLOCK_M,
            HEAD_DIM, FLAT, s_layout, acc_layout)
        i += 1
    return dv0, dv1, dk0, dk1, i


@gluon.jit
def _store_columns(acc, base, keys, stride_n, stride_d, col, seqlen_k, acc_layout: gl.constexpr):
    """acc [64 keys, 64] (fp32) into columns col .. col + 63 of rows `keys` at base."""
    cols = col + gl.arange(0, 64, layout=gl.SliceLayout(0, acc_layout))
    ptrs = base + keys[:, None].to(gl.int64) * stride_n + cols[None, :] * stride_d
    gl.store(ptrs, acc.to(base.dtype.element_ty), mask=keys[:, None] < seqlen_k)


@gluon.jit
def _key_gradients(q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, p_smem, ds_smem,
                   kv_ready, q_ready, do_ready, qdo_free, pds_ready, dq_desc, DK, DV, dk_strides,
                   dv_strides, off_b, off_hk, start_n, first_m, first_full, last_full, end_m,
                   group, q_start, dk_row0, seqlen_q, seqlen_k, diag, diag_left, qk_scale_log2,
                   softmax_scale, lens_rows, CONSUMER: gl.constexpr, HAS_LEFT: gl.constexpr,
                   HAS_RIGHT: gl.constexpr, EVEN_N: gl.constexpr, ROW_ORDER: gl.constexpr,
                   BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, FLAT: gl.constexpr):
    """Consumer warpgroup: S / dP for keys [start_n + 32c, + 32), dK / dV for head-dim columns
    [128c, + 128) of all 64 keys, over the query tiles of every head of the group: [first_m,
    first_full) and [last_full, end_m) masked (ROW_ORDER: by the rows' lengths too),
    [first_full, last_full) whole. q_start: the batch's first row of the flat views (dQ's
    reduce-adds); dk_row0: its first key row of dK / dV past the batch stride (packed: the
    sequence's)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 32, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 64, 16])
    keys = start_n + CONSUMER * 32 + gl.arange(0, 32, layout=gl.SliceLayout(0, s_layout))
    dv0 = gl.zeros([64, 64], gl.float32, acc_layout)
    dv1 = gl.zeros([64, 64], gl.float32, acc_layout)
    dk0 = gl.zeros([64, 64], gl.float32, acc_layout)
    dk1 = gl.zeros([64, 64], gl.float32, acc_layout)
    mbarrier.wait(kv_ready.index(0), 0)
    mbarrier.wait(kv_ready.index(1), 0)
    i = 0
    for h in range(group):
        head = off_hk * group + h
        # runs of query tiles: masked, whole, and with a left bound those cut by the windows'
        # left edges (with row lengths those cut by them)
        run_ends = (first_m, first_full, last_full, end_m)
        for run in gl.static_range(3):
            if run < 2 or HAS_LEFT or ROW_ORDER:
                dv0, dv1, dk0, dk1, i = _query_tiles(
                    run_ends[run], run_ends[run + 1], i, q_smem, do_smem, lse_smem, delta_smem,
                    k_smem, v_smem, p_smem, ds_smem, q_ready, do_ready, qdo_free, pds_ready,
                    dq_desc, dv0, dv1, dk0, dk1, keys, off_b, head, q_start, seqlen_q, seqlen_k,
                    diag, diag_left, qk_scale_log2, softmax_scale, lens_rows, run != 1,
                    HAS_LEFT, HAS_RIGHT, EVEN_N, ROW_ORDER, CONSUMER, BLOCK_M, HEAD_DIM, FLAT,
                    s_layout, acc_layout)
    tma.store_wait(0)
    all_keys = start_n + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
    dk_b, dk_n, dk_h, dk_d = dk_strides
    dv_b, dv_n, dv_h, dv_d = dv_strides
    dk_base = DK + off_b.to(gl.int64) * dk_b + off_hk.to(gl.int64) * dk_h \
        + dk_row0.to(gl.int64) * dk_n
    dv_base = DV + off_b.to(gl.int64) * dv_b + off_hk.to(gl.int64) * dv_h \
        + dk_row0.to(gl.int64) * dv_n
    col0 = CONSUMER * 128
    _store_columns(dk0 * softmax_scale, dk_base, all_keys, dk_n, dk_d, col0, seqlen_k,
                   acc_layout)
    _store_columns(dk1 * softmax_scale, dk_base, all_keys, dk_n, dk_d, col0 + 64, seqlen_k,
                   acc_layout)
    _store_columns(dv0, dv_base, all_keys, dv_n, dv_d, col0, seqlen_k, acc_layout)
    _store_columns(dv1, dv_base, all_keys, dv_n, dv_d, col0 + 64, seqlen_k, acc_layout)


@gluon.jit
def _bwd_wide_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, stats_desc, DK, DV, stride_dkb, stride_dkn,
    stride_dkh, stride_dkd, stride_dvb, stride_dvn, stride_dvh, stride_dvd, seqlen_q, seqlen_k,
    num_heads_k, group, delta_row0, diag_offset, window_left, window_right, qk_scale_log2,
    softmax_scale, num_pairs, pairs_per_group, RowLens, stride_rlb, CuSeqlensQ, CuSeqlensK,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, LONGEST_FIRST: gl.constexpr,
    EVEN_N: gl.constexpr, ROW_ORDER: gl.constexpr, PACKED: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, FLAT: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    tile_n, off_b, off_hk = key_tile_program(seqlen_k, num_heads_k, num_pairs, pairs_per_group,
                                             BLOCK_N, LONGEST_FIRST)
    start_n = tile_n * BLOCK_N
    q_start, seqlen_q, k_start, seqlen_k, diag_offset = flat_view_bounds(
        CuSeqlensQ, CuSeqlensK, off_b, seqlen_q, seqlen_k, diag_offset, PACKED)
    # dK / dV's first row past the batch stride: 0; packed (batch stride 0): the sequence's
    dk_row0 = off_b * 0
    if PACKED:
        dk_row0 = k_start
        if start_n >= seqlen_k:  # the grid covers the longest sequence
            return
    diag = diag_offset + window_right  # row r sees keys up to r + diag (HAS_RIGHT)
    diag_left = diag_offset - window_left  # and from r + diag_left (HAS_LEFT)
    # query tiles [first_m, end_m) see the program's keys; [first_full, last_full) all of them
    first_m, first_full, last_full, end_m = implicit_q_range(
        start_n, seqlen_q, seqlen_k, diag_offset, window_left, window_right, BLOCK_M, BLOCK_N,
        HAS_LEFT, HAS_RIGHT)
    if not HAS_LEFT:
        last_full = end_m  # a last tile past Sq is whole here: its rows have p = 0
    # rows in length order: the tiles that see these keys, and those that see all, are prefixes
    lens_rows = RowLens + off_b.to(gl.int64) * stride_rlb
    if ROW_ORDER:
        last_full, end_m = length_q_tiles(lens_rows, start_n, seqlen_q, seqlen_k,
                                          gl.cdiv(seqlen_q, BLOCK_M), BLOCK_M, BLOCK_N)
    if start_n + BLOCK_N > seqlen_k:
        first_full = end_m  # keys past Sk in every tile
        last_full = end_m

    box: gl.constexpr = k_desc.block_type.shape
    # K, V: 4 boxes each; q, dO: 4 boxes per buffer, 2 buffers
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [4] + box, k_desc.layout)
    v_smem = gl.allocate_shared_memory(k_desc.dtype, [4] + box, k_desc.layout)
    q_smem = gl.allocate_shared_memory(k_desc.dtype, [8] + box, k_desc.layout)
    do_smem = gl.allocate_shared_memory(k_desc.dtype, [8] + box, k_desc.layout)
    # P^T and dS^T, [64 keys, BM] per buffer
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], k_desc.dtype)
    p_smem = gl.allocate_shared_memory(k_desc.dtype, [2, 64, 64], pds_layout)
    ds_smem = gl.allocate_shared_memory(k_desc.dtype, [2, 64, 64], pds_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [2] + stats_desc.block_type.shape,
                                         stats_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [2] + stats_desc.block_type.shape,
                                           stats_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    qdo_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2):
        mbarrier.init(kv_ready.index(b), count=1)
        mbarrier.init(q_ready.index(b), count=1)
        mbarrier.init(do_ready.index(b), count=1)
        mbarrier.init(qdo_free.index(b), count=2)  # one release per consumer
        mbarrier.init(pds_ready.index(b), count=2)

    dk_strides = (stride_dkb, stride_dkn, stride_dkh, stride_dkd)
    dv_strides = (stride_dvb, stride_dvn, stride_dvh, stride_dvd)
    gl.warp_specialize([
        (_key_gradients, (q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, p_smem,
                          ds_smem, kv_ready, q_ready, do_ready, qdo_free, pds_ready, dq_desc, DK,
                          DV, dk_strides, dv_strides, off_b, off_hk, start_n, first_m,
                          first_full, last_full, end_m, group, q_start, dk_row0, seqlen_q,
                          seqlen_k, diag, diag_left, qk_scale_log2, softmax_scale, lens_rows,
                          0, HAS_LEFT, HAS_RIGHT, EVEN_N, ROW_ORDER, BLOCK_M, HEAD_DIM, FLAT)),
        (_key_gradients, (q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, p_smem,
                          ds_smem, kv_ready, q_ready, do_ready, qdo_free, pds_ready, dq_desc, DK,
                          DV, dk_strides, dv_strides, off_b, off_hk, start_n, first_m,
                          first_full, last_full, end_m, group, q_start, dk_row0, seqlen_q,
                          seqlen_k, diag, diag_left, qk_scale_log2, softmax_scale, lens_rows,
                          1, HAS_LEFT, HAS_RIGHT, EVEN_N, ROW_ORDER, BLOCK_M, HEAD_DIM, FLAT)),
        (_load, (q_desc, do_desc, k_desc, v_desc, stats_desc, q_smem, do_smem, k_smem, v_smem,
                 lse_smem, delta_smem, kv_ready, q_ready, do_ready, qdo_free, off_b, off_hk,
                 num_heads_k * group, delta_row0, start_n, first_m, end_m, group,
                 q_start, k_start, BLOCK_M, HEAD_DIM, FLAT)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def hopper_backward_wide(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, row_stats: torch.Tensor, dq_sum: torch.Tensor,
                         args: KernelArgs, dq: torch.Tensor, dk: torch.Tensor,
                         dv: torch.Tensor, row_lens: torch.Tensor | None = None,
                         row_order: torch.Tensor | None = None,
                         packed: PackedSequences | None = None) -> None:
    """As `bwd_hopper.hopper_backward` for head dim 256 without lists, masks or biases: dq (like
    q), dk / dv (like k / v, any strides, summed over each KV group) written in place; row_stats
    from `backward_row_stats` at the config's block_m, filled in; dQ summed in dq_sum (fp32
    like q, zeroed); row_lens / row_order and packed as there. The caller checked
    the plan (plan.py)."""
    batch, seqlen_q, seqlen_k = batch_shape(q, k, packed)
    num_heads, head_dim = q.shape[-2:]
    num_heads_k = k.shape[-2]
    cfg = hopper_backward_config(head_dim)  # 64 x 64 tiles: the kernel's boxes
    flat = packed is not None or flat_launch(seqlen_q, seqlen_k, cfg.block_m, cfg.block_n, q, k,
                                             v, dout, dq_sum)
    # rows in length order: key tile 0s first, as in hopper_backward (H100, B2 H16 4k uniform
    # lengths, backward kernel 2.364 ms; bwd.py's 3.43)
    longest_first = args.later_rows_see_more or row_order is not None
    num_pairs = batch * num_heads_k
    grid, pairs_per_group = key_tile_grid(cdiv(seqlen_k, cfg.block_n), num_pairs, longest_first,
                                          q.device)
    # [64, 64] boxes (dQ's: fp32 [64, 32])
    launch(_bwd_wide_kernel, grid,
        *(descriptor(t, BOX, flat, BOX) for t in (q, k, v, dout)),
        descriptor(dq_sum, BOX, flat, 32), stats_descriptor(row_stats, cfg.block_m), dk, dv,
        *row_strides(dk), dk.stride(-1), *row_strides(dv), dv.stride(-1), seqlen_q, seqlen_k,
        num_heads_k, num_heads // num_heads_k, batch * num_heads, seqlen_k - seqlen_q,
        args.window_left, args.window_right, args.qk_scale_log2, args.softmax_scale, num_pairs,
        pairs_per_group, *row_lens_operands(row_lens, q.device)[:2],
        *packed_operands(packed, q.device), HAS_LEFT=args.has_left,
        HAS_RIGHT=args.has_right, LONGEST_FIRST=longest_first, ROW_ORDER=row_order is not None,
        EVEN_N=packed is None and seqlen_k % cfg.block_n == 0, PACKED=packed is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=head_dim, FLAT=flat,
        CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs, num_warps=4)
    rows_to_callers(dq_sum, row_order, dq)
