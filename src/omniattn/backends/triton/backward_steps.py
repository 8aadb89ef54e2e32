"""The small kernels around the backward: the preprocess both backends run (delta = rowsum(dO *
O) - dlse, rows gathered in length order; for the Gluon backward lse / scale beside delta and
dQ's fp32 sums zeroed), the sum of a KV group's fp32 dK/dV partials, and the zeros of a dbias
buffer's tiles that no list visits."""
from __future__ import annotations

import triton
import triton.language as tl

from ...kernels.common import load_rows, schedule_rows


@triton.jit
def sum_kv_parts(
    DKParts, DVParts, DK, DV, stride_pb, stride_pn, stride_ph,
    stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
    seqlen_k, num_heads_k, parts,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dK and dV of BLOCK_N keys of one (batch, KV head): the sums, in slot order, of the fp32
    partials the dK/dV programs of its `parts` query head groups wrote to head slots
    [hk * parts, (hk + 1) * parts) (one part: the fp32 sums the programs added, cast)."""
    off_b = (tl.program_id(1) // num_heads_k).to(tl.int64)
    off_hk = (tl.program_id(1) % num_heads_k).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    keys = offs_n.to(tl.int64)[:, None]
    inside = (offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
    parts_base = off_b * stride_pb + keys * stride_pn + offs_d[None, :]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for part in range(parts):
        slot = (off_hk * parts + part) * stride_ph
        dk += tl.load(DKParts + parts_base + slot, mask=inside, other=0.0)
        dv += tl.load(DVParts + parts_base + slot, mask=inside, other=0.0)
    tl.store(DK + off_b * stride_dkb + off_hk * stride_dkh + keys * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=inside)
    tl.store(DV + off_b * stride_dvb + off_hk * stride_dvh + keys * stride_dvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=inside)


@triton.jit
def bwd_preprocess(
    Out, DOut, Delta, DLse, Q, Lse, RowOrder, QInOrder, DOutInOrder, LseInOrder, LseScaled,
    DqSum, CuSeqlensQ, stride_ob, stride_om, stride_oh, stride_dob, stride_dom, stride_doh,
    stride_db, stride_dh, stride_dlb, stride_dlh, stride_qb, stride_qm, stride_qh,
    stride_lb, stride_lh, stride_rob, stride_sqb, stride_sqm, stride_sqh,
    stride_sdb, stride_sdm, stride_sdh, stride_zb, stride_zm, stride_zh, seqlen_q, stats_rows,
    num_heads, inv_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_DLSE: tl.constexpr, ROW_ORDER: tl.constexpr, FOR_GLUON: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """delta = rowsum(out * dO) - dlse for BLOCK_M rows of one (batch, head), stored for rows below
    stats_rows (0 past seqlen_q). ROW_ORDER: row r is the caller's row row_order[r] (rows in length
    order); delta is stored in that order and q, dO, lse are copied into it (QInOrder, DOutInOrder,
    LseInOrder; not lse with FOR_GLUON) for the backward kernel. FOR_GLUON: the Gluon backward's
    other operands too (a memset launch less per call, and two fills at lengths that are not a
    multiple of its tile): lse * inv_scale in LseScaled (laid out like delta; +inf where lse = -inf,
    a row that saw no key, and past seqlen_q: p = 0 there) and DqSum (fp32, like q) zeroed.
    VARLEN (with FOR_GLUON): batch off_b is packed sequence off_b, its rows from
    CuSeqlensQ[b] of the packed tensors and from 0 of the stats (Delta, LseScaled)."""
    off_bh = tl.program_id(1)
    off_b = (off_bh // num_heads).to(tl.int64)
    off_h = (off_bh % num_heads).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    first_q = 0
    if VARLEN:
        first_q = tl.load(CuSeqlensQ + off_b)
        seqlen_q = tl.load(CuSeqlensQ + off_b + 1) - first_q
    in_rows = offs_m < seqlen_q
    callers = offs_m + first_q  # packed: batch strides are 0
    if ROW_ORDER:
        callers = tl.load(RowOrder + off_b * stride_rob + offs_m, mask=in_rows, other=0)
    rows = callers.to(tl.int64)[:, None]
    o = load_rows(Out + off_b * stride_ob + off_h * stride_oh + rows * stride_om + offs_d[None, :],
                  offs_m, seqlen_q, offs_d, False, HEAD_DIM, BLOCK_D)
    do = load_rows(DOut + off_b * stride_dob + off_h * stride_doh + rows * stride_dom
                   + offs_d[None, :], offs_m, seqlen_q, offs_d, False, HEAD_DIM, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:  # d lse / d s = p: the lse's gradient enters as -dlse
        delta -= tl.load(DLse + off_b * stride_dlb + off_h * stride_dlh + callers, mask=in_rows,
                         other=0.0)
    in_stats = offs_m < stats_rows
    tl.store(Delta + off_b * stride_db + off_h * stride_dh + offs_m, delta, mask=in_stats)
    if FOR_GLUON:
        lse = tl.load(Lse + off_b * stride_lb + off_h * stride_lh + callers, mask=in_rows,
                      other=float("-inf"))
        tl.store(LseScaled + off_b * stride_db + off_h * stride_dh + offs_m,
                 tl.where(lse == float("-inf"), float("inf"), lse * inv_scale), mask=in_stats)
        tl.store(DqSum + off_b * stride_zb + off_h * stride_zh
                 + (offs_m + first_q).to(tl.int64)[:, None] * stride_zm + offs_d[None, :],
                 tl.zeros([BLOCK_M, BLOCK_D], tl.float32),
                 mask=in_rows[:, None] & (offs_d[None, :] < HEAD_DIM))
    if ROW_ORDER:
        store_mask = in_rows[:, None] & (offs_d[None, :] < HEAD_DIM)
        in_order = offs_m.to(tl.int64)[:, None]
        tl.store(DOutInOrder + off_b * stride_sdb + off_h * stride_sdh + in_order * stride_sdm
                 + offs_d[None, :], do, mask=store_mask)
        q = load_rows(Q + off_b * stride_qb + off_h * stride_qh + rows * stride_qm
                      + offs_d[None, :], offs_m, seqlen_q, offs_d, False, HEAD_DIM, BLOCK_D)
        tl.store(QInOrder + off_b * stride_sqb + off_h * stride_sqh + in_order * stride_sqm
                 + offs_d[None, :], q, mask=store_mask)
        if not FOR_GLUON:
            lse = tl.load(Lse + off_b * stride_lb + off_h * stride_lh + callers, mask=in_rows)
            # laid out like delta (both empty_like(lse))
            tl.store(LseInOrder + off_b * stride_db + off_h * stride_dh + offs_m, lse,
                     mask=in_rows)


@triton.jit
def zero_unlisted_kernel(
    Buf, stride_bb, stride_bh, stride_bm, stride_bn, seqlen_q, seqlen_k, num_heads, n_cols,
    Num, Idx, FullNum, FullIdx, list_strides,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COLS: tl.constexpr, TRANSPOSED: tl.constexpr,
):
    """Zeros into one (BLOCK_M, BLOCK_N) tile of one (batch, query head) if the lists of its row
    (a query tile, or a key tile when TRANSPOSED) leave it out: the tiles no backward program
    writes. Lists in any order; COLS >= n_cols (a power of two); list_strides: TileLists.operands'
    strides and list head divisor."""
    row = tl.program_id(0) // n_cols
    col = tl.program_id(0) % n_cols
    off_b = tl.program_id(1) // num_heads
    off_h = tl.program_id(1) % num_heads
    part_num, part_idx, full_num, full_idx = schedule_rows(
        Num, Idx, FullNum, FullIdx, off_b, off_h, row, *list_strides)
    slots = tl.arange(0, COLS)
    listed_part = tl.load(part_idx + slots, mask=slots < tl.load(part_num), other=-1)  # [COLS]
    listed_full = tl.load(full_idx + slots, mask=slots < tl.load(full_num), other=-1)
    if tl.max(((listed_part == col) | (listed_full == col)).to(tl.int32), 0) == 0:
        tile_m = col if TRANSPOSED else row
        tile_n = row if TRANSPOSED else col
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        keys = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        base = Buf + off_b.to(tl.int64) * stride_bb + off_h.to(tl.int64) * stride_bh
        tl.store(base + rows.to(tl.int64)[:, None] * stride_bm + keys[None, :] * stride_bn,
                 tl.zeros([BLOCK_M, BLOCK_N], Buf.dtype.element_ty),
                 mask=(rows[:, None] < seqlen_q) & (keys[None, :] < seqlen_k))
