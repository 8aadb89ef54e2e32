"""Hopper backward in Gluon, for the calls the Gluon forward takes and more: dense, causal / right
window, GQA, explicit schedules without bitmaps (element masks, whole-block masks) and biases, with
the gradient of a key bias (B, Hb, 1, Sk) or of a bias with a (Sq, Sk) tile per query head, and
per-row key lengths alone (q, dO and the row stats in length order, dQ written back to the caller
rows), and packed sequences (varlen) without masks or biases (tiles read from each sequence's first
row, what they read of the next sequence dropped; a key tile cut by its sequence's end stores dK /
dV without TMA). A program owns BLOCK_N keys of one (batch, KV head) and walks the query tiles of
every query head of the group that see them (dK and dV summed over the group in registers: no
partials); explicit schedules list them per head, PARTIAL first. A producer warp streams q and dO
tiles, with their rows of lse and delta, through TMA into a ring of shared-memory buffers; two
consumer warpgroups each own half of the keys. Per query tile a consumer computes S^T = K Q^T (keys
as the wgmma's M), P^T, dV += P^T dO, dP^T = V dO^T, dS^T and dK += dS^T Q, with P^T and dS^T
as register operands, dS^T stored to shared memory as well; once both halves of dS are there it
computes dQ = dS K for its half of the head dim (in the step, or where a third dS buffer fits and it
measured faster, in the next one: `hopper_backward_dq_trails`) and reduce-adds it into an fp32
buffer through TMA (5 matmuls per tile pair; the Triton kernel's dQ programs make it 7). P is
rounded to bf16 / fp16 before dS = P (dP - delta), as in the dV matmul. A 1-byte mask spanning
(Sq, Sk) comes by TMA with q; a 2-byte bias spanning (Sq, Sk) by a TMA copy each consumer issues a
step ahead into its half of the dS buffer that the step's dS overwrites; other mask and bias tiles
are plain loads into the S^T layout, issued before the step's waits. Everything else runs in
`bwd.py`."""
from __future__ import annotations

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from ...kernels.common import implicit_q_range, load_pair_tile, schedule_rows, store_pair_tile
from ...kernels.elementwise import Elementwise
from ...kernels.schedule import KernelArgs, TileLists
from ...kernels.sequences import (PackedSequences, batch_shape, packed_operands, row_lens_operands,
                                  row_strides, rows_to_callers, tma_compatible)
from ...kernels.sizes import cdiv
from ...runtime.launch import launch
from ...runtime.switches import sm_count
from .blocks import (ElementForm, by_tma, copy_tile, descriptor, drop_outside_window,
                     flat_launch, flat_rows, flat_view_bounds, gluon_refusal, hand_over, handed,
                     load_tile, producer_tiles, scatter_rows, tensor_descriptor, tile_at)
from .configs import (causal_pairs_per_group, hopper_backward_config, hopper_backward_dq_trails,
                      hopper_backward_p_rounding, hopper_backward_splits_head_dim)

LOG2E = gl.constexpr(1.4426950408889634)

# rows of lse / delta: 64 fp32 = 256 bytes, past a 128-byte swizzle's box: unswizzled
_STATS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


@builtin
def async_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA reduce-add of the shared-memory tile src into the tensor at coord (a bulk async
    operation, waited for with tma.store_wait like a TMA store); gluon 3.6 exposes the copy but
    not the reduction."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle,
                                              coord, src.handle)


@gluon.jit
def _round_in_pairs(x, dtype: gl.constexpr):
    """fp32 x rounded to dtype (bf16 / fp16), two elements per conversion (round to nearest
    even, as `.to`). P^T's `.to` came out as one scalar F2F per element, as slow as the step's
    exp2, because dS^T read the rounded values back one by one; the asm's packed result keeps
    them paired."""
    if dtype == gl.bfloat16:
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x],
                                         dtype=gl.bfloat16, is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [x],
                                         dtype=gl.float16, is_pure=True, pack=2)


@gluon.jit
def _head_steps(first_head, h, lists, list_strides, first_m, end_m, EXPLICIT: gl.constexpr):
    """Query tiles of the group's head h (query head first_head + h): (num_part, part_list,
    full_list, num_steps, first); step j visits tile first + `tile_at(j, ...)`. Explicit: the
    head's PARTIAL list, then its FULL one (lists: num, indices, full num, full indices at the
    list head of the group's first head; list_strides: the launch's, per-head strides 0 where the
    schedule broadcasts heads, then the list head divisor); implicit: tiles [first_m, end_m)."""
    part_num, part_list, full_num, full_list = lists
    (_, stride_pnh, _, _, stride_pih, _, _, stride_fnh, _, _, stride_fih, _,
     head_div) = list_strides
    if EXPLICIT:
        # lists with fewer heads than the queries: heads of the group may share one
        list_h = (first_head + h) // head_div - first_head // head_div
        num_part = gl.load(part_num + list_h * stride_pnh)
        num_steps = num_part + gl.load(full_num + list_h * stride_fnh)
        part_list += list_h * stride_pih
        full_list += list_h * stride_fih
        first = 0
    else:
        num_part = 0
        num_steps = end_m - first_m
        first = first_m
    return num_part, part_list, full_list, num_steps, first


@gluon.jit
def _load_q_do(loads, num_heads, delta_row0, group, list_strides, mask_head_div,
               BLOCK_M: gl.constexpr, HALF_N: gl.constexpr, HEAD_DIM: gl.constexpr,
               NUM_BUF: gl.constexpr, FLAT: gl.constexpr, EXPLICIT: gl.constexpr,
               MASK_FORM: gl.constexpr):
    """Producer: the program's K and V tiles once (each consumer's half of the keys a copy of its
    own: barriers K0, K1, V0, V1), then for the query tiles of each head of the group
    (`_head_steps`) q with its lse row and dO with its delta row into buffer i % NUM_BUF, as soon
    as both consumers released the tiles that used it before. A mask by TMA (MASK_FORM.tma): the
    masked steps' mask tiles too, a [BM, BN/2] box per consumer (mask rows (batch, head, query)
    flattened: mask_row0 is the batch's first). Explicit schedules: each step's query tile and
    the head's next one into rows_smem beside its buffer before q_ready's arrival, for the
    consumers (`_listed_tiles`). loads: the program's values and buffers, as the kernel packs
    them; then the launch's scalars, as the kernel takes them (see `_key_gradients`): heads,
    delta's first row, group, list strides, the mask's head divisor."""
    (q_desc, do_desc, k_desc, v_desc, stats_desc, q_smem, do_smem, k_smem, v_smem, lse_smem,
     delta_smem, kv_ready, q_ready, do_ready, qdo_free, off_b, q_start, k_start, off_hk, start_n,
     first_m, end_m, seqlen_q, lists, mask_desc, mask_smem, mask_row0, rows_smem) = loads
    for c in gl.static_range(2):
        key0 = start_n + c * HALF_N
        load_tile(k_desc, off_b, key0, off_hk, k_start, kv_ready.index(c), k_smem.index(c),
                   HEAD_DIM, FLAT)
        load_tile(v_desc, off_b, key0, off_hk, k_start, kv_ready.index(2 + c), v_smem.index(c),
                   HEAD_DIM, FLAT)
    i = 0
    for h in range(group):
        head = off_hk * group + h
        num_part, head_part, head_full, num_steps, first = _head_steps(
            off_hk * group, h, lists, list_strides, first_m, end_m, EXPLICIT)
        mask_row = mask_row0 + (head // mask_head_div) * seqlen_q
        # the list entry of step j + 1 is read during step j
        next_tile = first + tile_at(0, num_part, head_part, head_full, EXPLICIT)
        for j in range(num_steps):
            tile = next_tile
            next_tile = first + tile_at(gl.minimum(j + 1, num_steps - 1), num_part, head_part,
                                         head_full, EXPLICIT)
            row = tile * BLOCK_M
            buf = i % NUM_BUF
            # a fresh barrier passes a wait on parity 1: the first round needs no release
            mbarrier.wait(qdo_free.index(buf), ((i // NUM_BUF) & 1) ^ 1)
            if EXPLICIT:
                hand_over(rows_smem.index(2 * buf), tile)
                hand_over(rows_smem.index(2 * buf + 1), next_tile)
            # one expect per barrier and phase: it arrives, so all copies' bytes go in it
            stats_row = off_b * num_heads + head
            q_bytes: gl.constexpr = q_desc.block_type.nbytes + stats_desc.block_type.nbytes
            if MASK_FORM.tma:
                with_mask = j < num_part  # the PARTIAL steps
                mask_bytes: gl.constexpr = 2 * mask_desc.block_type.nbytes
                mbarrier.expect(q_ready.index(buf), q_bytes + mask_bytes, pred=with_mask)
                mbarrier.expect(q_ready.index(buf), q_bytes, pred=j >= num_part)
                # rows past Sq read the next head's (or zeros): p = 0 there
                for c in gl.static_range(2):
                    tma.async_copy_global_to_shared(
                        mask_desc, [mask_row + row, start_n + c * HALF_N], q_ready.index(buf),
                        mask_smem.index(buf * 2 + c), pred=with_mask)
            else:
                mbarrier.expect(q_ready.index(buf), q_bytes)
            tma.async_copy_global_to_shared(stats_desc, [stats_row, row], q_ready.index(buf),
                                            lse_smem.index(buf))
            copy_tile(q_desc, off_b, row, head, q_start, q_ready.index(buf), q_smem.index(buf),
                       HEAD_DIM, FLAT)
            mbarrier.expect(do_ready.index(buf),
                            do_desc.block_type.nbytes + stats_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(stats_desc, [delta_row0 + stats_row, row],
                                            do_ready.index(buf), delta_smem.index(buf))
            copy_tile(do_desc, off_b, row, head, q_start, do_ready.index(buf),
                       do_smem.index(buf), HEAD_DIM, FLAT)
            i += 1


@gluon.jit
def _store_ds_tile(ds_own, dbias_rows, stride_dbm, stride_dbn, rows_left, cols_left,
                   BLOCK_M: gl.constexpr, HALF_N: gl.constexpr, EVEN_M: gl.constexpr,
                   EVEN_N: gl.constexpr):
    """This consumer's dS^T ([BN/2 keys, BM] in shared memory, rounded to the inputs' dtype)
    into the dbias tile whose query start_m, key key0 is at dbias_rows: read back as [BM, BN/2]
    so each thread stores 8 consecutive keys (stored from the scores' layout, [BN/2, BM], each
    element went alone and the addresses spilled)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    ds = ds_own.permute((1, 0)).load(layout)  # [BM, BN/2]
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HALF_N, layout=gl.SliceLayout(0, layout))
    ptrs = dbias_rows + rows[:, None].to(gl.int64) * stride_dbm + cols[None, :] * stride_dbn
    if EVEN_M and EVEN_N:
        gl.store(ptrs, ds)
    else:
        gl.store(ptrs, ds, mask=(rows[:, None] < rows_left) & (cols[None, :] < cols_left))


@gluon.jit
def _zero_hidden_tiles(dbias_cols, stride_dbm, stride_dbn, num_part, part_list, full_list,
                       num_steps, first, num_m_tiles, seqlen_q, cols_left,
                       EXPLICIT: gl.constexpr, BLOCK_M: gl.constexpr, HALF_N: gl.constexpr):
    """Zeros into this consumer's [BM, BN/2] tiles of a (Sq, Sk) dbias (dbias_cols: the head's
    query 0, the consumer's first key) that the head's steps never visit, so the buffer needs
    no zero fill of its own. Implicit: tiles outside [first, first + num_steps); explicit:
    those in neither list, both ascending (a merge walk). H100, B2 H16 4k causal full bias:
    fwd+bwd 2.02 ms against 2.17 with its 1 GB memset (docs/perf/masks-and-bias.md, "dbias zeros
    written by the Gluon backward")."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HALF_N, layout=gl.SliceLayout(0, layout))
    ptrs = dbias_cols + rows[:, None].to(gl.int64) * stride_dbm + cols[None, :] * stride_dbn
    zeros = gl.zeros([BLOCK_M, HALF_N], dbias_cols.dtype.element_ty, layout)
    inside_cols = cols[None, :] < cols_left
    if EXPLICIT:
        num_full = num_steps - num_part
        listed_part = 0
        listed_full = 0
        next_part = gl.load(part_list, mask=num_part > 0, other=-1)
        next_full = gl.load(full_list, mask=num_full > 0, other=-1)
    for tile_m in range(num_m_tiles):
        if EXPLICIT:
            hidden = True
            if tile_m == next_part:
                listed_part += 1
                next_part = gl.load(part_list + listed_part, mask=listed_part < num_part,
                                    other=-1)
                hidden = False
            elif tile_m == next_full:
                listed_full += 1
                next_full = gl.load(full_list + listed_full, mask=listed_full < num_full,
                                    other=-1)
                hidden = False
        else:
            hidden = (tile_m < first) | (tile_m >= first + num_steps)
        if hidden:
            start_m = tile_m * BLOCK_M
            gl.store(ptrs + start_m.to(gl.int64) * stride_dbm, zeros,
                     mask=(rows[:, None] < seqlen_q - start_m) & inside_cols)


@gluon.jit
def _bias_buffer(bias_desc, ds_smem, i, CONSUMER: gl.constexpr, HALF_N: gl.constexpr,
                 NUM_DS: gl.constexpr):
    """Where step i's bias tile lands, [BM queries, BN/2 keys] as the TMA box (the bias's own
    dtype and layout): this consumer's half of dS buffer i % NUM_DS, which the step's dS
    overwrites once the bias is read."""
    return ds_smem.index(i % NUM_DS).slice(CONSUMER * HALF_N, HALF_N)._reinterpret(
        bias_desc.dtype, bias_desc.block_type.shape, bias_desc.layout)


@gluon.jit
def _copy_bias_tile(bias_desc, row, key0, bias_ready, ds_smem, i, pred,
                    CONSUMER: gl.constexpr, HALF_N: gl.constexpr, NUM_DS: gl.constexpr):
    """The consumer's own TMA copy of step i's bias tile (query rows from row, keys from key0)
    into `_bias_buffer`. Issued once both consumers' dQ of step i - NUM_DS read that buffer:
    the program's first step, a head's first step, or after the ds_ready wait of step i - 1
    (i - 2 where dQ trails a step)."""
    ready = bias_ready.index(CONSUMER * 2 + i % 2)
    mbarrier.expect(ready, bias_desc.block_type.nbytes, pred=pred)
    landing = _bias_buffer(bias_desc, ds_smem, i, CONSUMER, HALF_N, NUM_DS)
    tma.async_copy_global_to_shared(bias_desc, [row, key0], ready, landing, pred=pred)


@gluon.jit
def _listed_tiles(rows_smem, buf):
    """Consumer, explicit schedules, once q_ready of buffer buf is waited for: (the step's
    query tile, the head's next one), as the producer wrote them beside the buffer. A
    consumer's own load of the list entry stalled it (the wgmma fence of its next matmul waits
    for the load): H100, block mask 16k at density 1, backward kernel 11.47 ms against 13.07."""
    return handed(rows_smem.index(2 * buf)), handed(rows_smem.index(2 * buf + 1))


@gluon.jit
def _dq_matmuls(ds_buf, k_dq0, k_dq1, BLOCK_M: gl.constexpr, HALF_N: gl.constexpr,
                HEAD_DIM: gl.constexpr, dq_layout: gl.constexpr):
    """dQ = dS K of a step ([BM, D/2]: this consumer's half of the head dim) from both
    consumers' halves of dS^T in ds_buf ([BN, BM]), issued, not waited for."""
    dq = warpgroup_mma(ds_buf.slice(0, HALF_N).permute((1, 0)), k_dq0,
                       gl.zeros([BLOCK_M, HEAD_DIM // 2], gl.float32, dq_layout), use_acc=False,
                       is_async=True)
    return warpgroup_mma(ds_buf.slice(HALF_N, HALF_N).permute((1, 0)), k_dq1, dq,
                         is_async=True)


@gluon.jit
def _reduce_add_dq(dq, dq_smem, dq_desc, off_b, q_start, tile_m, head, softmax_scale,
                   CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                   FLAT: gl.constexpr):
    """This consumer's half of query tile tile_m's dQ (of head head), scaled, reduce-added into
    the fp32 dQ buffer through dq_smem by TMA."""
    # TMA boxes of a 128-byte swizzle span 32 fp32 columns: D/2 = 64 goes out as two boxes
    dq_lo, dq_hi = gl.split((dq * softmax_scale).reshape([BLOCK_M, 2, HEAD_DIM // 4])
                            .permute((0, 2, 1)))
    tma.store_wait(0)  # the previous tile's reductions have read dq_smem
    dq_smem.index(0).reshape([BLOCK_M, HEAD_DIM // 4]).store(dq_lo)
    dq_smem.index(1).reshape([BLOCK_M, HEAD_DIM // 4]).store(dq_hi)
    fence_async_shared()
    for c in gl.static_range(2):
        col = head * HEAD_DIM + CONSUMER * (HEAD_DIM // 2) + c * (HEAD_DIM // 4)
        if FLAT:
            async_reduce_add(dq_desc, [q_start + tile_m * BLOCK_M, col],
                              dq_smem.index(c))
        else:
            async_reduce_add(dq_desc, [off_b, tile_m * BLOCK_M, head, col - head * HEAD_DIM],
                              dq_smem.index(c))


@gluon.jit
def _query_tile(i, tile_m, buffers, k_half, v_half, k_dq0, k_dq1, barriers, dq_desc, dk, dv,
                dbias_keys, keys, key0, off_b, q_start, head, seqlen_q, seqlen_k, diag, diag_left,
                qk_scale_log2, softmax_scale, mask_view, bias_view, dbias_view, bias_tma,
                head_bias, has_next, prev_tile_m, prev_head, lens_rows, MASKED: gl.constexpr,
                KEY_END: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
                EXPLICIT: gl.constexpr, ROW_ORDER: gl.constexpr, MASK_FORM: gl.constexpr,
                BIAS_FORM: gl.constexpr, DBIAS: gl.constexpr, DBIAS_FROM_DS: gl.constexpr,
                P_ROUNDING: gl.constexpr, EVEN_M: gl.constexpr, EVEN_N: gl.constexpr,
                CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr, HALF_N: gl.constexpr,
                HEAD_DIM: gl.constexpr, NUM_BUF: gl.constexpr, NUM_DS: gl.constexpr,
                FLAT: gl.constexpr, s_layout: gl.constexpr, dq_layout: gl.constexpr):
    """One query tile against this consumer's keys: dK and dV accumulate, dQ of the tile (both
    consumers' keys, this consumer's half of the head dim) is reduce-added into dq_desc. MASKED
    tiles drop keys right of each row's window (diag = Sk - Sq + window_right), left of it
    (diag_left = Sk - Sq - window_left) and where the mask (if given) is 0; MASKED or KEY_END
    ones keys past Sk; the bias (if given) is added in every tile. mask_cols / bias_cols /
    dbias_cols point at this consumer's first key (key0), query 0, of the head. DBIAS: the score
    gradient goes to dbias_keys [BN/2] (a key bias: summed over queries), is added into the fp32
    dbias by atomics (one column or a scalar: summed over keys) or is stored as the tile.
    ROW_ORDER: MASKED tiles also drop the keys past each row's length (lens_rows: the batch's
    lengths, rows in length order). Explicit schedules read the step's tile_m (and the next
    step's) from rows_smem once its q has landed. NUM_DS: dS buffers; with 3, the dQ of the
    previous step (prev_tile_m of head prev_head) is computed in this one. P_ROUNDING: how P^T is
    rounded for dV and which P^T dS^T takes (`hopper_backward_p_rounding`). Returns (dk, dv,
    dbias_keys, tile_m).
    Grouped arguments: buffers (q, dO, lse, delta, dS, dQ, mask and list-row shared buffers),
    barriers (q ready, dO ready, q / dO free, dS ready), mask_view / bias_view / dbias_view
    (pointer, stride along queries, stride along keys), bias_tma (descriptor, row, barrier);
    MASK_FORM / BIAS_FORM: `ElementForm`s."""
    q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, mask_smem, rows_smem = buffers
    q_ready, do_ready, qdo_free, ds_ready = barriers
    mask_cols, stride_mm, stride_mn = mask_view
    bias_cols, stride_bm, stride_bn = bias_view
    dbias_cols, stride_dbm, stride_dbn = dbias_view
    bias_desc, bias_row, bias_ready = bias_tma
    DQ_TRAILS: gl.constexpr = NUM_DS > 2
    buf = i % NUM_BUF
    phase = (i // NUM_BUF) & 1
    next_m = tile_m + 1
    if EXPLICIT:
        mbarrier.wait(q_ready.index(buf), phase)
        tile_m, next_m = _listed_tiles(rows_smem, buf)
    start_m = tile_m * BLOCK_M
    rows_left = seqlen_q - start_m
    cols_left = seqlen_k - key0
    local_n = gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
    local_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    # mask / bias tiles [BN/2, BM] (or their broadcast forms), implicit: loads in flight
    # during the wait
    keep_t = 0
    bias_t = 0
    row_ends = 0
    if MASKED and ROW_ORDER:
        row_ends = gl.load(lens_rows + start_m + local_m, mask=local_m < rows_left, other=0)
    if MASKED and MASK_FORM.given and not MASK_FORM.tma:
        keep_t = load_pair_tile(mask_cols + start_m.to(gl.int64) * stride_mm, local_n, local_m,
                                stride_mn, stride_mm, cols_left, rows_left, MASK_FORM.cols_shared,
                                MASK_FORM.rows_shared, EVEN_N, EVEN_M)
    if BIAS_FORM.given and BIAS_FORM.rows_shared:
        bias_t = head_bias
    elif BIAS_FORM.given and not BIAS_FORM.tma:
        bias_t = load_pair_tile(bias_cols + start_m.to(gl.int64) * stride_bm, local_n, local_m,
                                stride_bn, stride_bm, cols_left, rows_left, BIAS_FORM.cols_shared,
                                BIAS_FORM.rows_shared, EVEN_N, EVEN_M)
    q = q_smem.index(buf).reshape([BLOCK_M, HEAD_DIM])
    do = do_smem.index(buf).reshape([BLOCK_M, HEAD_DIM])
    # the accumulators start at -lse / scale and -delta (rows of the producer's stats tiles,
    # broadcast over the keys), so S^T and dP^T come out shifted; a row that saw no key has
    # lse / scale = +inf there: its probabilities are 0
    s_zero = gl.zeros([HALF_N, BLOCK_M], gl.float32, s_layout)
    if not EXPLICIT:
        mbarrier.wait(q_ready.index(buf), phase)
    lse_scaled = lse_smem.index(buf).load(s_layout)  # [1, BM]
    s_t = warpgroup_mma(k_half, q.permute((1, 0)), s_zero - lse_scaled, is_async=True)
    s_t = warpgroup_mma_wait(0, deps=(s_t,))  # [BN/2, BM]
    if BIAS_FORM.tma:
        mbarrier.wait(bias_ready.index(CONSUMER * 2 + i % 2), (i // 2) & 1)
        bias_t = _bias_buffer(bias_desc, ds_smem, i, CONSUMER, HALF_N,
                              NUM_DS).permute((1, 0)).load(s_layout)
    if BIAS_FORM.given:
        p_t = gl.exp2(s_t * qk_scale_log2 + bias_t.to(gl.float32) * LOG2E)
    else:
        p_t = gl.exp2(s_t * qk_scale_log2)
    # each term its own select (a predicate each)
    if MASKED:
        if MASK_FORM.given:
            if MASK_FORM.tma:
                # the producer's tile, [BM, BN/2] in shared memory: read here, not held
                keep_t = mask_smem.index(buf * 2 + CONSUMER).permute((1, 0)).load(s_layout)
            p_t = gl.where(keep_t != 0, p_t, 0.0)
    if (MASKED or KEY_END) and not EVEN_N:
        p_t = gl.where(keys[:, None] < seqlen_k, p_t, 0.0)
    if MASKED:
        rows = start_m + local_m
        if HAS_RIGHT:
            # explicit lists: PARTIAL tiles inside the window skip it
            if (not EXPLICIT) or (start_m + diag < key0 + HALF_N - 1):
                p_t = drop_outside_window(p_t, rows, keys, diag, diag_left, 0, 0.0, False, True,
                                          False, True)
        p_t = drop_outside_window(p_t, rows, keys, diag, diag_left, 0, 0.0, HAS_LEFT, False,
                                  False, True)
        if ROW_ORDER:
            p_t = gl.where(keys[:, None] < row_ends[None, :], p_t, 0.0)
    # P^T rounded (P_ROUNDING: `hopper_backward_p_rounding`) and dS^T are the A operands of dV
    # and dK from registers: through shared memory each took a store, a fence and a warpgroup
    # barrier per step (H100, backward kernel 6-10% slower). dP^T after P^T: S^T and
    # dP^T in flight together, with P^T in fp32, left the consumer short of registers
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv.type.layout,
                                                 k_width=2)
    if P_ROUNDING == 0:
        p_round = p_t.to(q.dtype)
    else:
        p_round = _round_in_pairs(p_t, q.dtype)
    # dO must have landed before the dV matmul reads it (issued first, it raced the copy)
    mbarrier.wait(do_ready.index(buf), phase)
    dv = warpgroup_mma(gl.convert_layout(p_round, a_layout), do, dv, is_async=True)
    delta = delta_smem.index(buf).load(s_layout)  # [1, BM]
    dp_t = warpgroup_mma(v_half, do.permute((1, 0)), s_zero - delta, is_async=True)
    dv, dp_t = warpgroup_mma_wait(0, deps=(dv, dp_t))
    if P_ROUNDING == 2:
        ds_t = p_t * dp_t  # [BN/2, BM], d loss / d (score + bias)
    else:
        ds_t = p_round.to(gl.float32) * dp_t
    if DBIAS:
        if BIAS_FORM.rows_shared and BIAS_FORM.cols_shared:
            gl.atomic_add(dbias_cols, gl.sum(gl.sum(ds_t, 1), 0), sem="relaxed")
        elif BIAS_FORM.rows_shared:
            dbias_keys += gl.sum(ds_t, 1)
        elif BIAS_FORM.cols_shared:
            # a bias with one column: this tile's row sums, added across key tiles
            gl.atomic_add(dbias_cols + (start_m + local_m).to(gl.int64) * stride_dbm,
                          gl.sum(ds_t, 0), mask=local_m < rows_left, sem="relaxed")
        elif not DBIAS_FROM_DS:
            store_pair_tile(dbias_cols + start_m.to(gl.int64) * stride_dbm, ds_t, local_n,
                            local_m, stride_dbn, stride_dbm, cols_left, rows_left, False)
    ds_t = ds_t.to(q.dtype)
    ds_own = ds_smem.index(i % NUM_DS).slice(CONSUMER * HALF_N, HALF_N)
    ds_own.store(ds_t)
    fence_async_shared()
    if not DQ_TRAILS:
        mbarrier.arrive(ds_ready.index(i % NUM_DS))
    dk = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q, dk, is_async=True)
    if DBIAS and DBIAS_FROM_DS:
        # read while the dK wgmma reads it too
        _store_ds_tile(ds_own, dbias_cols + start_m.to(gl.int64) * stride_dbm, stride_dbm,
                       stride_dbn, rows_left, cols_left, BLOCK_M, HALF_N, EVEN_M, EVEN_N)
    # dQ of this step or (DQ_TRAILS) of the previous one, whose dS is whole unless the other
    # consumer is a step behind, so the consumers need not meet at every step (their softmax
    # phases may drift apart). The program's first step has no previous one: its dQ matmuls
    # read a stale buffer and their result is dropped (async accumulators cannot pass a branch)
    dq_ds = (i + NUM_DS - 1) % NUM_DS if DQ_TRAILS else i % NUM_DS
    if DQ_TRAILS:
        mbarrier.wait(ds_ready.index(dq_ds), ((i - 1) // NUM_DS) & 1, pred=i > 0)
    else:
        # one buffer per parity of i, so a consumer one tile ahead never overwrites what the
        # other still reads
        mbarrier.wait(ds_ready.index(dq_ds), (i // NUM_DS) & 1)
    if BIAS_FORM.tma:
        _copy_bias_tile(bias_desc, bias_row + next_m * BLOCK_M, key0, bias_ready, ds_smem,
                        i + 1, has_next, CONSUMER, HALF_N, NUM_DS)
    dq = _dq_matmuls(ds_smem.index(dq_ds), k_dq0, k_dq1, BLOCK_M, HALF_N, HEAD_DIM, dq_layout)
    dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
    mbarrier.arrive(qdo_free.index(buf))
    if DQ_TRAILS:
        # this step's dS is there and the previous one's no longer read by this consumer
        mbarrier.arrive(ds_ready.index(i % NUM_DS))
        if i > 0:
            _reduce_add_dq(dq, dq_smem, dq_desc, off_b, q_start, prev_tile_m, prev_head,
                           softmax_scale, CONSUMER, BLOCK_M, HEAD_DIM, FLAT)
    else:
        _reduce_add_dq(dq, dq_smem, dq_desc, off_b, q_start, tile_m, head, softmax_scale,
                       CONSUMER, BLOCK_M, HEAD_DIM, FLAT)
    return dk, dv, dbias_keys, tile_m


@gluon.jit
def _query_tiles(steps_begin, steps_end, i, prev_tile_m, prev_head, first, num_steps, buffers,
                 k_half, v_half, k_dq0, k_dq1, barriers, dq_desc, dk, dv, dbias_keys, keys, key0,
                 off_b, q_start, head, seqlen_q, seqlen_k, diag, diag_left, qk_scale_log2,
                 softmax_scale, mask_view, bias_view, dbias_view, bias_tma, head_bias, lens_rows,
                 MASKED: gl.constexpr, KEY_END: gl.constexpr, HAS_LEFT: gl.constexpr,
                 HAS_RIGHT: gl.constexpr, EXPLICIT: gl.constexpr, ROW_ORDER: gl.constexpr,
                 MASK_FORM: gl.constexpr, BIAS_FORM: gl.constexpr, DBIAS: gl.constexpr,
                 DBIAS_FROM_DS: gl.constexpr, P_ROUNDING: gl.constexpr, EVEN_M: gl.constexpr,
                 EVEN_N: gl.constexpr, CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr,
                 HALF_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_BUF: gl.constexpr,
                 NUM_DS: gl.constexpr, FLAT: gl.constexpr, s_layout: gl.constexpr,
                 dq_layout: gl.constexpr):
    """Steps [steps_begin, steps_end) of a head's query tiles through `_query_tile`, all MASKED
    or none: tiles first + j, or (explicit) those the producer read from the lists. Returns
    (dk, dv, dbias_keys, i, prev_tile_m, prev_head): the last step's tile and head."""
    for j in range(steps_begin, steps_end):
        dk, dv, dbias_keys, prev_tile_m = _query_tile(
            i, first + j, buffers, k_half, v_half, k_dq0, k_dq1, barriers, dq_desc, dk, dv,
            dbias_keys, keys, key0, off_b, q_start, head, seqlen_q, seqlen_k, diag, diag_left,
            qk_scale_log2, softmax_scale, mask_view, bias_view, dbias_view, bias_tma, head_bias,
            j + 1 < num_steps, prev_tile_m, prev_head, lens_rows, MASKED, KEY_END, HAS_LEFT,
            HAS_RIGHT, EXPLICIT, ROW_ORDER, MASK_FORM, BIAS_FORM, DBIAS, DBIAS_FROM_DS,
            P_ROUNDING, EVEN_M, EVEN_N, CONSUMER, BLOCK_M, HALF_N, HEAD_DIM, NUM_BUF, NUM_DS,
            FLAT, s_layout, dq_layout)
        prev_head = head
        i += 1
    return dk, dv, dbias_keys, i, prev_tile_m, prev_head


@gluon.jit
def _key_gradients(program, dq_smem, group, list_strides, mask_layout, bias_layout,
                   dbias_strides, dk_strides, dv_strides, CONSUMER: gl.constexpr,
                   HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, EXPLICIT: gl.constexpr,
                   ROW_ORDER: gl.constexpr, PACKED: gl.constexpr, MASK_FORM: gl.constexpr,
                   BIAS_FORM: gl.constexpr, DBIAS: gl.constexpr, DBIAS_FROM_DS: gl.constexpr,
                   P_ROUNDING: gl.constexpr, EVEN_M: gl.constexpr, EVEN_N: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                   NUM_BUF: gl.constexpr, NUM_DS: gl.constexpr, FLAT: gl.constexpr):
    """Consumer warpgroup: dK and dV of keys [start_n + CONSUMER * BN/2, + BN/2) over the query
    tiles of every head of the group (`_head_steps`). Implicit schedules: tiles [first_m,
    first_full) and [last_full, end_m) are masked (ROW_ORDER: by the rows' lengths too),
    [first_full, last_full) whole; explicit: the PARTIAL ones, or all of them when the key tile runs
    past Sk. mask_batch / bias_batch / dbias_batch point at key start_n of the batch. PACKED: a
    key tile cut by its sequence's end stores its rows inside it to dk_rows / dv_rows (key 0 of
    the sequence and KV head) without TMA. q_start / k_start: the batch's first rows of the flat
    (FLAT) views; bias_row0: the batch's first row of the bias's TMA descriptor.
    program: the values and buffers both consumers take, as the kernel packs them; dq_smem: this
    consumer's dQ staging. group and the stride tuples are the launch's (`_bwd_hopper_kernel`),
    passed as the kernel takes them: Triton makes a launch's scalars of 1 constexprs, which a
    tuple assigned in the kernel turns into tensors, captures of the partitions (a group of 1,
    a head divisor of 1 then divide at run time: the D128 backward's SASS changed).
    MASK_FORM / BIAS_FORM: `ElementForm`s."""
    (dq_desc, dk_desc, dv_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem,
     kv_ready, q_ready, do_ready, qdo_free, ds_ready, kv_done, off_b, q_start, k_start, off_hk,
     start_n, first_m, first_full, last_full, end_m, num_m_tiles, seqlen_q, seqlen_k, diag,
     diag_left, qk_scale_log2, softmax_scale, lists, mask_batch, bias_batch, dbias_batch,
     mask_smem, bias_desc, bias_row0, bias_ready, rows_smem, lens_rows, dk_rows,
     dv_rows) = program
    _, stride_mh, stride_mm, stride_mn, mask_head_div = mask_layout
    _, stride_bh, stride_bm, stride_bn, bias_head_div = bias_layout
    _, stride_dbh, stride_dbm, stride_dbn = dbias_strides
    stride_dkm, _ = dk_strides
    stride_dvm, _ = dv_strides
    HALF_N: gl.constexpr = BLOCK_N // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM // 2, 16])
    key0 = start_n + CONSUMER * HALF_N
    keys = key0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
    mask_batch += (CONSUMER * HALF_N) * stride_mn
    bias_batch += (CONSUMER * HALF_N) * stride_bn
    dbias_batch += (CONSUMER * HALF_N) * stride_dbn
    k_half = k_smem.index(CONSUMER).reshape([HALF_N, HEAD_DIM])
    v_half = v_smem.index(CONSUMER).reshape([HALF_N, HEAD_DIM])
    # dQ's operands: both halves of the keys, this consumer's half of the head dim
    k_dq0 = k_smem.index(0).reshape([HALF_N, HEAD_DIM]).slice(CONSUMER * (HEAD_DIM // 2),
                                                               HEAD_DIM // 2, dim=1)
    k_dq1 = k_smem.index(1).reshape([HALF_N, HEAD_DIM]).slice(CONSUMER * (HEAD_DIM // 2),
                                                               HEAD_DIM // 2, dim=1)
    dk = gl.zeros([HALF_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([HALF_N, HEAD_DIM], gl.float32, acc_layout)
    dbias_keys = gl.zeros([HALF_N], gl.float32, gl.SliceLayout(1, s_layout))
    mbarrier.wait(kv_ready.index(0), 0)
    mbarrier.wait(kv_ready.index(1), 0)
    mbarrier.wait(kv_ready.index(2 + CONSUMER), 0)
    i = 0
    prev_tile_m = 0
    prev_head = 0
    for h in range(group):
        head = off_hk * group + h
        num_part, head_part, head_full, num_steps, first = _head_steps(
            off_hk * group, h, lists, list_strides, first_m, end_m, EXPLICIT)
        if EXPLICIT:
            num_masked = num_part
            whole_end = num_steps
            if start_n + BLOCK_N > seqlen_k:
                # its FULL tiles drop the keys past Sk, and only those: a block mask's FULL
                # tiles may lie outside its causal / window predicate
                whole_end = num_part
        else:
            num_masked = first_full - first_m
            whole_end = last_full - first_m
        mask_cols = mask_batch + (head // mask_head_div).to(gl.int64) * stride_mh
        bias_cols = bias_batch + (head // bias_head_div).to(gl.int64) * stride_bh
        dbias_cols = dbias_batch + head.to(gl.int64) * stride_dbh
        if DBIAS and not BIAS_FORM.rows_shared and not BIAS_FORM.cols_shared:
            _zero_hidden_tiles(dbias_cols, stride_dbm, stride_dbn, num_part, head_part,
                               head_full, num_steps, first, num_m_tiles, seqlen_q,
                               seqlen_k - key0, EXPLICIT, BLOCK_M, HALF_N)
        # bias rows (batch, head, query) flattened, as the TMA descriptor sees them
        bias_row = bias_row0 + (head // bias_head_div) * seqlen_q
        head_bias = 0
        if BIAS_FORM.given and BIAS_FORM.rows_shared:
            # a bias constant over queries: this head's [BN/2, 1] once, not a load per step
            head_bias = load_pair_tile(bias_cols, keys - key0, keys - key0, stride_bn, 0,
                                       seqlen_k - key0, 1, BIAS_FORM.cols_shared, True, EVEN_N,
                                       True)
        if BIAS_FORM.tma:
            # the head's first tile from the list itself: from the producer, its copy would
            # wait for the step's q to land (once per head, outside the loop of steps)
            first_m_of_head = first + tile_at(0, num_part, head_part, head_full, EXPLICIT)
            _copy_bias_tile(bias_desc, bias_row + first_m_of_head * BLOCK_M, key0, bias_ready,
                            ds_smem, i, num_steps > 0, CONSUMER, HALF_N, NUM_DS)
        # runs of steps: the masked ones, the whole ones, then (implicit) with a left bound the
        # tiles cut by the windows' left edges, or (explicit) FULL tiles past Sk
        run_ends = (0, num_masked, whole_end, num_steps)
        for run in gl.static_range(3):
            if run < 2 or HAS_LEFT or ROW_ORDER or (EXPLICIT and not EVEN_N):
                dk, dv, dbias_keys, i, prev_tile_m, prev_head = _query_tiles(
                    run_ends[run], run_ends[run + 1], i, prev_tile_m, prev_head, first,
                    num_steps, (q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                                mask_smem, rows_smem),
                    k_half, v_half, k_dq0, k_dq1, (q_ready, do_ready, qdo_free, ds_ready),
                    dq_desc, dk, dv, dbias_keys, keys, key0, off_b, q_start, head,
                    seqlen_q, seqlen_k, diag, diag_left, qk_scale_log2, softmax_scale,
                    (mask_cols, stride_mm, stride_mn), (bias_cols, stride_bm, stride_bn),
                    (dbias_cols, stride_dbm, stride_dbn), (bias_desc, bias_row, bias_ready),
                    head_bias, lens_rows, run == 0 or (run == 2 and not EXPLICIT), run != 1,
                    HAS_LEFT, HAS_RIGHT, EXPLICIT, ROW_ORDER, MASK_FORM, BIAS_FORM, DBIAS,
                    DBIAS_FROM_DS, P_ROUNDING, EVEN_M, EVEN_N, CONSUMER, BLOCK_M, HALF_N,
                    HEAD_DIM, NUM_BUF, NUM_DS, FLAT, s_layout, dq_layout)
        if DBIAS and BIAS_FORM.rows_shared and not BIAS_FORM.cols_shared:
            # a key bias: the sum over this head's queries, in the head's own slot
            gl.store(dbias_cols + (keys - key0) * stride_dbn,
                     dbias_keys.to(dbias_cols.dtype.element_ty), mask=keys < seqlen_k)
            dbias_keys = gl.zeros([HALF_N], gl.float32, gl.SliceLayout(1, s_layout))
    if NUM_DS > 2:
        if i > 0:
            # the last step's dQ (both consumers arrived on its ds_ready after their steps)
            mbarrier.wait(ds_ready.index((i - 1) % NUM_DS), ((i - 1) // NUM_DS) & 1)
            dq = _dq_matmuls(ds_smem.index((i - 1) % NUM_DS), k_dq0, k_dq1, BLOCK_M, HALF_N,
                             HEAD_DIM, dq_layout)
            dq = warpgroup_mma_wait(0, deps=(dq,))
            _reduce_add_dq(dq, dq_smem, dq_desc, off_b, q_start, prev_tile_m, prev_head,
                           softmax_scale, CONSUMER, BLOCK_M, HEAD_DIM, FLAT)
    # V's half is this consumer's alone; K's is read by the other consumer's dQ until it is done
    v_half.store(dv.to(v_half.dtype))
    mbarrier.arrive(kv_done)
    mbarrier.wait(kv_done, 0)
    k_half.store((dk * softmax_scale).to(k_half.dtype))
    if PACKED and key0 + HALF_N > seqlen_k:
        # TMA would write the next sequence's keys too
        scatter_rows(v_half, dv_rows, stride_dvm, dv_rows, key0, seqlen_k, HALF_N, HEAD_DIM,
                      ORDERED=False)
        scatter_rows(k_half, dk_rows, stride_dkm, dk_rows, key0, seqlen_k, HALF_N, HEAD_DIM,
                      ORDERED=False)
    elif FLAT:
        fence_async_shared()
        tma.async_copy_shared_to_global(dv_desc, [k_start + key0, off_hk * HEAD_DIM],
                                        v_smem.index(CONSUMER))
        tma.async_copy_shared_to_global(dk_desc, [k_start + key0, off_hk * HEAD_DIM],
                                        k_smem.index(CONSUMER))
    else:
        fence_async_shared()
        tma.async_copy_shared_to_global(dv_desc, [off_b, key0, off_hk, 0], v_smem.index(CONSUMER))
        tma.async_copy_shared_to_global(dk_desc, [off_b, key0, off_hk, 0], k_smem.index(CONSUMER))
    tma.store_wait(0)


@gluon.jit
def length_q_tiles(lens_rows, start_n, seqlen_q, seqlen_k, num_m_tiles, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, CHUNK: gl.constexpr = 512):
    """(full_end, end) of key tile [start_n, start_n + BN) for rows in length order, longest
    first (lens_rows: the batch's lengths, clamped to Sk): query tiles [0, end) have a row that
    reaches the tile (their first row does), [0, full_end) only rows that see all of it (their
    last row does). Two loads per CHUNK query tiles, not a pass over the rows."""
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
    key_hi = gl.minimum(start_n + BLOCK_N, seqlen_k)
    end = 0
    full_end = 0
    for first in range(0, num_m_tiles, CHUNK):
        tiles = first + gl.arange(0, CHUNK, layout=layout)
        inside = tiles < num_m_tiles
        longest = gl.load(lens_rows + tiles * BLOCK_M, mask=inside, other=0)
        shortest = gl.load(lens_rows + gl.minimum(tiles * BLOCK_M + BLOCK_M, seqlen_q) - 1,
                           mask=inside, other=0)
        end += gl.sum((longest > start_n).to(gl.int32), 0)
        full_end += gl.sum((shortest >= key_hi).to(gl.int32), 0)
    return full_end, end


@gluon.jit
def key_tile_program(seqlen_k, num_heads_k, num_pairs, pairs_per_group, BLOCK_N: gl.constexpr,
                     LONGEST_FIRST: gl.constexpr):
    """(key tile, batch, KV head) of this program of a `key_tile_grid` launch."""
    if LONGEST_FIRST:
        # causal (a 1-d grid): key tile 0 has the most query tiles. The (batch, KV head) pairs
        # go in groups of about a wave of programs, tile 0s first, so the programs that read a
        # pair's q / dO rows and add into its dQ run together (`causal_pairs_per_group`)
        num_tiles_n = gl.cdiv(seqlen_k, BLOCK_N)
        pid = gl.program_id(0)
        first_pair = pid // (pairs_per_group * num_tiles_n) * pairs_per_group
        group_len = gl.minimum(pairs_per_group, num_pairs - first_pair)
        rank = pid - first_pair * num_tiles_n
        tile_n = rank // group_len
        off_bh = first_pair + rank % group_len
    else:
        tile_n = gl.program_id(0)
        off_bh = gl.program_id(1)
    return tile_n, off_bh // num_heads_k, off_bh % num_heads_k


@gluon.jit
def _bwd_hopper_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, dk_desc, dv_desc, stats_desc, shape, window, scales,
    pairs, QNum, QIdx, FullQNum, FullQIdx, list_strides, Mask, mask_layout, mask_desc,
    mask_batch_rows, Bias, bias_layout, bias_desc, bias_batch_rows, DBias, dbias_strides, RowLens,
    stride_rlb, CuSeqlensQ, CuSeqlensK, DK, dk_strides, DV, dv_strides,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, LONGEST_FIRST: gl.constexpr,
    EXPLICIT: gl.constexpr, ROW_ORDER: gl.constexpr, PACKED: gl.constexpr,
    MASK_FORM: gl.constexpr, BIAS_FORM: gl.constexpr, DBIAS: gl.constexpr,
    DBIAS_FROM_DS: gl.constexpr, P_ROUNDING: gl.constexpr, EVEN_M: gl.constexpr,
    EVEN_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    NUM_BUF: gl.constexpr, NUM_DS: gl.constexpr, FLAT: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    """Tensors and descriptors are arguments of their own (call plans replay a launch by setting
    them); their scalars come in tuples, in the order the launcher flattens: shape (Sq, Sk, KV
    heads, group, B * H: delta's first row in the stats), window (diag offset, left, right),
    scales (qk_scale_log2, softmax_scale), pairs (`key_tile_grid`'s (batch, KV head) pairs and
    pairs per group), list_strides ((batch, head, key tile) of the transposed lists' num,
    indices, full num, full indices, then the list head divisor), mask_layout / bias_layout (batch, head, row, column
    strides, head divisor), dbias_strides (batch, head, row, column), dk_strides / dv_strides
    (row, head). MASK_FORM / BIAS_FORM: `ElementForm`s. The partitions take these tuples as
    they come (`_key_gradients`); what the kernel computes with is unpacked here."""
    seqlen_q, seqlen_k, num_heads_k, group, _ = shape
    diag_offset, window_left, window_right = window
    qk_scale_log2, softmax_scale = scales
    num_pairs, pairs_per_group = pairs
    stride_mb, _, _, stride_mn, _ = mask_layout
    stride_bb, _, _, stride_bn, _ = bias_layout
    stride_dbb, _, _, stride_dbn = dbias_strides
    stride_dkm, stride_dkh = dk_strides
    stride_dvm, stride_dvh = dv_strides
    tile_n, off_b, off_hk = key_tile_program(seqlen_k, num_heads_k, num_pairs, pairs_per_group,
                                             BLOCK_N, LONGEST_FIRST)
    start_n = tile_n * BLOCK_N
    q_start, seqlen_q, k_start, seqlen_k, diag_offset = flat_view_bounds(
        CuSeqlensQ, CuSeqlensK, off_b, seqlen_q, seqlen_k, diag_offset, PACKED)
    if PACKED and start_n >= seqlen_k:  # the grid covers the longest sequence
        return
    dk_rows = DK + off_hk.to(gl.int64) * stride_dkh + k_start.to(gl.int64) * stride_dkm
    dv_rows = DV + off_hk.to(gl.int64) * stride_dvh + k_start.to(gl.int64) * stride_dvm
    num_m_tiles = gl.cdiv(seqlen_q, BLOCK_M)
    diag = diag_offset + window_right  # row r sees keys up to r + diag (HAS_RIGHT)
    diag_left = diag_offset - window_left  # and from r + diag_left (HAS_LEFT)
    if EXPLICIT:
        first_m = 0
        first_full = 0
        last_full = num_m_tiles
        end_m = num_m_tiles
    else:
        # query tiles [first_m, end_m) see the program's keys; [first_full, last_full) see
        # all of them
        first_m, first_full, last_full, end_m = implicit_q_range(
            start_n, seqlen_q, seqlen_k, diag_offset, window_left, window_right, BLOCK_M,
            BLOCK_N, HAS_LEFT, HAS_RIGHT)
        if not HAS_LEFT:
            last_full = end_m  # a last tile past Sq is whole here: its rows have p = 0
    # rows in length order (per-row key lengths alone): the tiles that see these keys, and
    # those that see all of them, are prefixes
    lens_rows = RowLens + off_b.to(gl.int64) * stride_rlb
    if ROW_ORDER:
        last_full, end_m = length_q_tiles(lens_rows, start_n, seqlen_q, seqlen_k, num_m_tiles,
                                          BLOCK_M, BLOCK_N)
    if start_n + BLOCK_N > seqlen_k:
        first_full = end_m  # keys past Sk in every tile
        last_full = end_m
    # the transposed lists of the group's first head (per-head steps in the partitions)
    lists = schedule_rows(QNum, QIdx, FullQNum, FullQIdx, off_b, off_hk * group, tile_n,
                          *list_strides)
    # int64: batch / key offsets of a (B, H, Sq, Sk) mask or bias pass 2**31 elements
    mask_batch = Mask + off_b.to(gl.int64) * stride_mb + start_n.to(gl.int64) * stride_mn
    bias_batch = Bias + off_b.to(gl.int64) * stride_bb + start_n.to(gl.int64) * stride_bn
    dbias_batch = DBias + off_b.to(gl.int64) * stride_dbb + start_n.to(gl.int64) * stride_dbn

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_BUF] + q_desc.block_type.shape,
                                       q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [NUM_BUF] + do_desc.block_type.shape,
                                        do_desc.layout)
    # K and V in halves of the keys, one per consumer (stored back as dK and dV)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape,
                                       k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape,
                                       v_desc.layout)
    # lse / scale and delta of each buffered query tile
    lse_smem = gl.allocate_shared_memory(gl.float32, [NUM_BUF] + stats_desc.block_type.shape,
                                         stats_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [NUM_BUF] + stats_desc.block_type.shape,
                                           stats_desc.layout)
    # each buffered query tile's mask, a [BM, BN/2] tile per consumer
    mask_smem = producer_tiles(mask_desc, NUM_BUF, MASK_FORM.tma)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M],
                                                                   q_desc.dtype)
    ds_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_DS, BLOCK_N, BLOCK_M], ds_layout)
    # dQ staging per consumer: two boxes laid out like the dQ descriptor's block
    dq_smem0 = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape,
                                         dq_desc.layout)
    dq_smem1 = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape,
                                         dq_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    kv_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    qdo_free = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [NUM_DS, 1], mbarrier.MBarrierLayout())
    # per consumer, per parity of the step: its bias tile by TMA landed (`_copy_bias_tile`)
    bias_ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    # explicit schedules: each buffered step's query tile and the next, from the producer
    rows_smem = gl.allocate_shared_memory(gl.int32, [2 * NUM_BUF, 1],
                                          gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for b in gl.static_range(4):
        mbarrier.init(kv_ready.index(b), count=1)
    mbarrier.init(kv_done, count=2)
    for b in gl.static_range(NUM_BUF):
        mbarrier.init(q_ready.index(b), count=1)
        mbarrier.init(do_ready.index(b), count=1)
        mbarrier.init(qdo_free.index(b), count=2)  # one release per consumer
    for b in gl.static_range(NUM_DS):
        mbarrier.init(ds_ready.index(b), count=2)
    # initialised only where used: Triton gives an unused barrier's bytes to warp_specialize's
    # captures, and an H100 time-sliced between processes then handed some consumer warps the
    # barrier's state for a loop bound (a hang: docs/perf/faults.md)
    if BIAS_FORM.tma:
        for b in gl.static_range(4):
            mbarrier.init(bias_ready.index(b), count=1)

    # the values and buffers the consumers (program) and the producer (loads) take, packed once.
    # The constexprs stay out, and so do the launch's scalars the partitions take (group:
    # shape[3], heads: shape[2] * shape[3], delta's first row: shape[4]; the stride tuples), which
    # go as the kernel takes them (`_key_gradients`)
    program = (dq_desc, dk_desc, dv_desc, q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem,
               ds_smem, kv_ready, q_ready, do_ready, qdo_free, ds_ready, kv_done, off_b, q_start,
               k_start, off_hk, start_n, first_m, first_full, last_full, end_m, num_m_tiles,
               seqlen_q, seqlen_k, diag, diag_left, qk_scale_log2, softmax_scale, lists,
               mask_batch, bias_batch, dbias_batch, mask_smem, bias_desc,
               off_b * bias_batch_rows, bias_ready, rows_smem, lens_rows, dk_rows, dv_rows)
    loads = (q_desc, do_desc, k_desc, v_desc, stats_desc, q_smem, do_smem, k_smem, v_smem,
             lse_smem, delta_smem, kv_ready, q_ready, do_ready, qdo_free, off_b, q_start, k_start,
             off_hk, start_n, first_m, end_m, seqlen_q, lists, mask_desc, mask_smem,
             off_b * mask_batch_rows, rows_smem)
    gl.warp_specialize([
        (_key_gradients, (program, dq_smem0, shape[3], list_strides, mask_layout, bias_layout,
                          dbias_strides, dk_strides, dv_strides, 0, HAS_LEFT, HAS_RIGHT, EXPLICIT,
                          ROW_ORDER, PACKED, MASK_FORM, BIAS_FORM, DBIAS, DBIAS_FROM_DS,
                          P_ROUNDING, EVEN_M, EVEN_N, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_BUF, NUM_DS,
                          FLAT)),
        (_key_gradients, (program, dq_smem1, shape[3], list_strides, mask_layout, bias_layout,
                          dbias_strides, dk_strides, dv_strides, 1, HAS_LEFT, HAS_RIGHT, EXPLICIT,
                          ROW_ORDER, PACKED, MASK_FORM, BIAS_FORM, DBIAS, DBIAS_FROM_DS,
                          P_ROUNDING, EVEN_M, EVEN_N, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_BUF, NUM_DS,
                          FLAT)),
        (_load_q_do, (loads, shape[2] * shape[3], shape[4], shape[3], list_strides,
                      mask_layout[4], BLOCK_M, BLOCK_N // 2, HEAD_DIM, NUM_BUF, FLAT, EXPLICIT,
                      MASK_FORM)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def hopper_backward_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            args: KernelArgs, schedule_tiles: tuple[int, int] | None = None,
                            mask: Elementwise | None = None, bias: Elementwise | None = None,
                            bias_grad: bool = False,
                            packed: PackedSequences | None = None) -> str | None:
    """Why no Gluon backward (`hopper_backward`, or at head dims it splits `bwd_hopper_wide`'s,
    which takes no lists, masks or biases) can run this call, or None where one can: a
    `gluon_refusal`-free call (device, dtype, arguments) with a head dim it has tiles for, q / k
    / v aligned for TMA (dO is made so by the launcher), transposed lists (if any: an element
    mask's or a block mask's; schedule_tiles their (block_m, block_n)) at its tiles, and a bias
    gradient it writes: any but that of a (Sq, Sk) bias shared by several query heads (its sum
    over them is bwd.py's). Packed sequences: (total, H, D) tensors with heads packed, without
    lists or a bias. The caller refuses what this does not see (bitmaps, lengths, dropout,
    determinism)."""
    refusal = gluon_refusal(q, args, backward=True)
    if refusal is not None:
        return refusal
    cfg = hopper_backward_config(q.shape[-1])
    if q.dim() != (4 if packed is None else 3):
        return "q is not (B, S, H, D) (packed: (total, H, D))"
    if packed is not None and (schedule_tiles is not None or bias is not None):
        return "packed sequences with a mask or bias"
    if packed is not None and not all(flat_rows(t) for t in (q, k, v)):
        return "packed q / k / v whose heads are not packed in their rows"
    if hopper_backward_splits_head_dim(q.shape[-1]) \
            and (schedule_tiles is not None or mask is not None or bias is not None):
        return f"masks, biases or lists at head dim {q.shape[-1]} (its Gluon backward splits " \
            f"the head dim and takes none)"
    # head dim 64 and implicit left windows without GQA (where the fp32 dQ pass weighs most) take
    # it since P^T and dS^T enter the wgmmas from registers (H100, D64 dense 4k backward kernels
    # 0.881 ms against bwd.py's 0.911; docs/perf/backward.md, "The D64 and MHA left-window
    # backwards on Gluon"), block masks since the consumers take their tiles from the producer
    # (16k density 1: 11.27 against 12.34; docs/perf/block-sparse.md)
    if schedule_tiles is not None and schedule_tiles != (cfg.block_m, cfg.block_n):
        return f"lists at {schedule_tiles[0]} x {schedule_tiles[1]} tiles, not its " \
            f"{cfg.block_m} x {cfg.block_n}"
    if bias_grad and bias.spans_queries_and_keys and bias.tensor.shape[1] != q.shape[2]:
        return "the gradient of a (Sq, Sk) bias shared by several query heads (summed over " \
            "them by bwd.py)"
    if not tma_compatible(q, k, v):
        return "q / k / v strides or bases TMA cannot read (16-byte multiples needed)"
    return None


def backward_row_stats(batch: int, heads: int, seqlen_q: int, block_m: int,
                       device: torch.device):
    """The per-row operands of the Gluon backward in one fp32 buffer the producer loads by TMA
    (each row a multiple of 16 bytes): (2, B, H, Sq rounded up to block_m), [0] lse / scale
    (+inf past Sq and where lse = -inf: p = 0 there), [1] delta (0 past Sq); packed sequences
    at their rows from 0 (Sq: the longest). Returns (buffer, its halves (B, H, Sq rounded up)
    for the preprocess to fill, padding included)."""
    padded = cdiv(seqlen_q, block_m) * block_m
    stats = torch.empty((2, batch, heads, padded), dtype=torch.float32, device=device)
    return (stats, *stats.unbind(0))


def key_tile_grid(n_tiles_n: int, num_pairs: int, longest_first: bool, device: torch.device):
    """(grid, pairs_per_group) of a Gluon backward whose programs each own a key tile of a
    (batch, KV head) pair: longest_first (causal, rows in length order), a 1-d grid the kernel
    maps to key tile 0s first, pairs in groups of `causal_pairs_per_group`; else (key tiles,
    pairs)."""
    if longest_first:
        return (num_pairs * n_tiles_n,), causal_pairs_per_group(n_tiles_n, num_pairs,
                                                                 sm_count(device))
    return (n_tiles_n, num_pairs), num_pairs


def stats_descriptor(row_stats: torch.Tensor, block_m: int):
    """`backward_row_stats`' buffer as (2 * B * H, rows) in [1, block_m] boxes."""
    rows = row_stats.view(-1, row_stats.shape[-1])
    return tensor_descriptor(rows, list(rows.shape), list(rows.stride()), (1, block_m),
                             _STATS_LAYOUT)


def hopper_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    row_stats: torch.Tensor, dq_sum: torch.Tensor, args: KernelArgs,
                    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                    schedule: TileLists | None = None,
                    mask: Elementwise | None = None, bias: Elementwise | None = None,
                    dbias: tuple | None = None, row_lens: torch.Tensor | None = None,
                    row_order: torch.Tensor | None = None,
                    packed: PackedSequences | None = None) -> None:
    """dq (like q), dk / dv (like k / v, summed over each KV group) written in place from dout (like
    q) and row_stats (`backward_row_stats`, filled in: delta = rowsum(dO * O) - dlse); dQ is summed
    in dq_sum (fp32 like q, zeroed) and copied to dq. schedule: the transposed (dK/dV) lists,
    PARTIAL tiles apply the mask; the bias is added in every tile. dbias: (buffer, its 4 strides), a
    slot per query head: a key bias's sums over queries, a (Sq, Sk) bias's tiles (those no list
    visits are the caller's to zero), or, for a bias with one column, sums over keys added into it
    (fp32, zeroed by the caller). row_lens / row_order (per-row key lengths alone, `length_order`):
    dout, q and row_stats come in length order, dQ is summed in it and written to the caller's rows
    of dq. packed: (total, H, D) tensors, row_stats at each sequence's rows from 0. The caller
    checked the plan (plan.py). dQ is reduce-added in fp32 across key tiles, so it is not
    bitwise reproducible."""
    batch, seqlen_q, seqlen_k = batch_shape(q, k, packed)
    num_heads, head_dim = q.shape[-2:]
    num_heads_k = k.shape[-2]
    if mask is not None and schedule is None:
        raise ValueError("hopper_backward: an element mask comes with its schedule's lists")
    if (row_lens is None) != (row_order is None):
        raise ValueError("hopper_backward: row_lens and row_order come together")
    cfg = hopper_backward_config(head_dim)
    if not tma_compatible(dk, dv) or (packed is not None
                                      and not (flat_rows(dk) and flat_rows(dv))):
        dk_out, dv_out, dk, dv = dk, dv, torch.empty_like(k), torch.empty_like(v)
    else:
        dk_out = dv_out = None
    flat = packed is not None or flat_launch(seqlen_q, seqlen_k, cfg.block_m, cfg.block_n, q, k,
                                             v, dout, dq_sum, dk, dv)
    even = packed is None
    # rows in length order: key tile 0 has the most query tiles, as with causal (H100, B2 8k GQA
    # 16/4 uniform lengths, backward kernel 2.906 ms longest first against 3.495)
    longest_first = schedule is None and (args.later_rows_see_more or row_order is not None)
    num_pairs = batch * num_heads_k
    grid, pairs_per_group = key_tile_grid(cdiv(seqlen_k, cfg.block_n), num_pairs, longest_first,
                                          q.device)
    half_n = cfg.block_n // 2
    stats_desc = stats_descriptor(row_stats, cfg.block_m)
    lists = schedule.operands(num_heads) if schedule is not None \
        else TileLists.placeholder_operands(q.device)
    unused = Elementwise.placeholder_operands(q.device)
    one_column_dbias = dbias is not None and bias.cols_shared and not bias.rows_shared
    # the mask's ring beside a one-column dbias's scratch fits since P^T left shared memory
    # (216,192 bytes): mask .5 + (B, H, Sq, 1) bias, backward kernel 1.976 ms against 2.183 with
    # the consumers' loads (H100)
    mask_tma = by_tma(mask, cfg.block_m, half_n, 1)
    # a (Sq, Sk) bias by TMA: issue #4's full bias + top-k mask, backward kernel 1.490 ms against
    # 1.976 loaded into the S^T layout, which spilled (H100)
    bias_tma = by_tma(bias, cfg.block_m, half_n, 2)
    # a third dS buffer (16 KB) fits beside the mask's ring since P^T left shared memory, but
    # is slower there (H100, top-k mask + full bias, backward kernel 1.585 ms against 1.442 with
    # two); not beside that scratch
    dq_trails = mask_tma is None and not one_column_dbias and hopper_backward_dq_trails(
        head_dim, args.has_left, args.has_right, num_heads // num_heads_k,
        pairs_per_group if longest_first else None,
        bias is not None and bias.spans_queries_and_keys)
    # (tensor, its (batch, head, row, column) strides, head divisor)
    mask_operands = mask.operands() if mask is not None else unused
    bias_operands = bias.operands() if bias is not None else unused
    launch(_bwd_hopper_kernel, grid,
        descriptor(q, cfg.block_m, flat), descriptor(k, half_n, flat),
        descriptor(v, half_n, flat), descriptor(dout, cfg.block_m, flat),
        descriptor(dq_sum, cfg.block_m, flat, head_dim // 4), descriptor(dk, half_n, flat),
        descriptor(dv, half_n, flat), stats_desc,
        (seqlen_q, seqlen_k, num_heads_k, num_heads // num_heads_k, batch * num_heads),
        (seqlen_k - seqlen_q, args.window_left, args.window_right),
        (args.qk_scale_log2, args.softmax_scale), (num_pairs, pairs_per_group), *lists[:4],
        lists[4:], mask_operands[0], mask_operands[1:],
        *(mask_tma if mask_tma is not None else (stats_desc, 0)), bias_operands[0],
        bias_operands[1:], *(bias_tma if bias_tma is not None else (stats_desc, 0)),
        *((dbias[0], dbias[1]) if dbias is not None else (unused[0], unused[1:5])),
        *row_lens_operands(row_lens, q.device)[:2], *packed_operands(packed, q.device),
        dk, row_strides(dk)[1:], dv, row_strides(dv)[1:],
        HAS_LEFT=args.has_left, HAS_RIGHT=args.has_right, LONGEST_FIRST=longest_first,
        EXPLICIT=schedule is not None, ROW_ORDER=row_order is not None,
        PACKED=packed is not None,
        MASK_FORM=ElementForm.of(mask, mask_tma is not None),
        BIAS_FORM=ElementForm.of(bias, bias_tma is not None),
        DBIAS=dbias is not None,
        # a (Sq, Sk) gradient in the inputs' dtype is the dS tile dQ reads: stored from there
        DBIAS_FROM_DS=dbias is not None and bias.spans_queries_and_keys
        and dbias[0].dtype == q.dtype,
        EVEN_M=even and seqlen_q % cfg.block_m == 0, EVEN_N=even and seqlen_k % cfg.block_n == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=head_dim, NUM_BUF=cfg.num_buffers,
        NUM_DS=3 if dq_trails else 2, FLAT=flat,
        P_ROUNDING=hopper_backward_p_rounding(
            dq_trails, schedule is not None,
            bias is not None and bias.rows_shared and not bias.cols_shared,
            bias is not None and bias.spans_queries_and_keys),
        CONSUMER_REGS=cfg.consumer_regs,
        PRODUCER_REGS=cfg.producer_regs,
        num_warps=4)
    rows_to_callers(dq_sum, row_order, dq)
    if dk_out is not None:
        dk_out.copy_(dk)
        dv_out.copy_(dv)
