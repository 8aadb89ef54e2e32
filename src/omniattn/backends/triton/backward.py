"""The backward's launcher (its Triton kernels are in bwd_kernels.py): a preprocess (delta =
rowsum(dO * O)) then one launch whose first programs compute dK/dV for a key tile (walking the
transposed schedule of one query head of its KV group, fp32 partials summed per KV head by a
small kernel after; of every head of the group where a full bias's gradient is summed over it:
GQA needs neither repeated K/V nor atomics). dQ either comes from the same programs, added into
an fp32 buffer with atomics, or (deterministic) from programs of its own that walk the forward
schedule for a query tile and write every gradient once. The plan's Gluon backward kernels run
from here too (bwd_hopper.py, bwd_hopper_wide.py), after the same preprocess."""
from __future__ import annotations

import math

import torch

from ...kernels.elementwise import Elementwise
from ...kernels.schedule import BlockBits, KernelArgs, Schedule, TileLists
from ...kernels.sequences import (PackedSequences, batch_shape, broadcast_strides, check_row_order,
                                  lse_strides, packed_operands, placeholder, row_lens_operands,
                                  row_strides, tma_compatible)
from ...kernels.sizes import cdiv, next_power_of_2, padded_head_dim
from ...runtime.launch import launch, tensors_then_tuple
from ..gluon_sm90.backward import backward_row_stats, hopper_backward
from ..gluon_sm90.backward_wide import hopper_backward_wide
from ..gluon_sm90.blocks import flat_rows
from ..gluon_sm90.configs import hopper_backward_config
from .backward_kernels import bwd_kernel, bwd_preprocess, sum_kv_parts, zero_unlisted_kernel
from .configs import DKDV_HEADS_PER_PROGRAM, DROPOUT_MAX_STAGES, backward_config

GLUON_BACKWARD, GLUON_BACKWARD_WIDE, TRITON_BACKWARD = "bwd_hopper", "bwd_hopper_wide", "bwd"


def _zero_unlisted(buffer: torch.Tensor, strides, lists: TileLists, transposed: bool,
                   seqlen_q: int, seqlen_k: int) -> None:
    """Zero the tiles of a (B, H, Sq, Sk) dbias buffer that `lists` (the backward pass writing
    dbias) never visit: half of it under causal (H100, 4k top-k full bias: 0.16 ms against 0.38
    for all of it)."""
    batch, heads = buffer.shape[:2]
    n_rows, n_cols = cdiv(seqlen_q, lists.block_m), cdiv(seqlen_k, lists.block_n)
    if transposed:
        n_rows, n_cols = n_cols, n_rows
    launch(zero_unlisted_kernel, (n_rows * n_cols, batch * heads),
        buffer, *strides, seqlen_q, seqlen_k, heads, n_cols,
        *lists.operands(),
        BLOCK_M=lists.block_m, BLOCK_N=lists.block_n, COLS=next_power_of_2(n_cols),
        TRANSPOSED=transposed,
    )


def _dbias_buffer(bias: Elementwise, batch: int, num_heads: int, num_heads_k: int,
                  explicit_lists: bool, gluon: bool):
    """Where the kernels write dbias, and how it reduces to the bias's shape.

    One slot per query head when the bias has H heads or a single row or column (then a vector
    per head): the dK/dV programs, one per query head, write a key bias's (one row); the dQ
    programs a query bias's (one column) and a full bias's tiles (the dK/dV programs when dQ
    goes through atomics: see attention_backward). Otherwise one slot per KV head: the dK/dV
    program sums its group in place. Slots and batches the bias broadcasts are summed
    afterwards. A packed bias with a row per query is written once for every sequence (each
    writes its own rows).
    zero_unlisted: a full bias with a slot per query head under explicit lists (`explicit_lists`:
    a schedule over a padded batch) is stored tile by tile by one pass, so only the tiles its
    lists leave out need zeros: the caller writes them (`_zero_unlisted`) instead of the buffer
    being zeroed whole. The Gluon backward (`gluon`) zeroes a full bias's unvisited tiles itself.
    Returns (buffer, its kernel strides, per_qhead, zero_unlisted, finish)."""
    bias_batch, bias_heads, rows, cols = bias.tensor.shape
    dtype_out = bias.tensor.dtype
    spans = bias.spans_queries_and_keys
    per_qhead = cols == 1 or rows == 1 or bias_heads == num_heads
    slots = num_heads if per_qhead else num_heads_k
    buffer_batch = 1 if bias.packed and rows != 1 else batch
    accumulate = spans and not per_qhead and num_heads > num_heads_k
    reduce = slots != bias_heads or bias_batch != buffer_batch
    dtype = torch.float32 if reduce or accumulate else dtype_out
    # elements of tiles no program visits must read 0 (packed: keys past a sequence's end too);
    # other layouts are written in full
    zero_unlisted = explicit_lists and spans and bias_heads == num_heads and not gluon
    alloc = torch.zeros if (spans or bias.packed) and not zero_unlisted and not gluon \
        else torch.empty
    buffer = alloc((buffer_batch, slots, rows, cols), dtype=dtype, device=bias.tensor.device)
    # size-1 dims at stride 0: packed rows are addressed from each sequence's first row
    strides = broadcast_strides(buffer)

    def finish(buf: torch.Tensor) -> torch.Tensor:
        summed = buf
        if reduce:
            summed = buf.view(buffer_batch, bias_heads, slots // bias_heads, rows, cols).sum(2)
            if bias_batch != buffer_batch:
                summed = summed.sum(0, keepdim=True)
        return bias.unpacked(summed.to(dtype_out))

    return buffer, strides, per_qhead, zero_unlisted, finish


def row_constant_bias_grad(bias: Elementwise, lse: torch.Tensor, dlse: torch.Tensor | None,
                           num_heads: int) -> torch.Tensor:
    """dbias, exact, for a bias with one column for all keys ((B|1, Hm, Sq|1, 1)): adding a
    constant to a row's scores leaves its softmax, hence the output, unchanged, so only lse
    depends on it, with d lse_i / d b_i = 1 where row i sees a key. Summing the kernels' dS over
    keys instead leaves the error of delta, which comes from the rounded output (bf16: up to
    0.06 where the true value is 0). lse / dlse: (B, H, Sq), packed (H, total_q)."""
    grad = torch.zeros_like(lse) if dlse is None else \
        torch.where(lse == float("-inf"), 0.0, dlse.float())
    grad = torch.where(torch.isnan(lse), lse, grad)  # NaN in, NaN out
    if bias.packed:
        grad = grad.unsqueeze(0)  # (1, H, total_q), as the bias's (1, Hm, total_q|1, 1) view
    bias_batch, bias_heads, rows, _ = bias.tensor.shape
    # query head h reads bias head h // (H / Hm)
    grad = grad.view(grad.shape[0], bias_heads, num_heads // bias_heads, -1).sum(2)
    if rows == 1:
        grad = grad.sum(-1, keepdim=True)
    if bias_batch == 1 and grad.shape[0] != 1:
        grad = grad.sum(0, keepdim=True)
    return bias.unpacked(grad.unsqueeze(-1).to(bias.tensor.dtype))


def attention_backward(dout, q, k, v, out, lse, args: KernelArgs, schedule: Schedule | None = None,
                       mask: Elementwise | None = None, bias: Elementwise | None = None,
                       bias_grad: bool = False, dlse: torch.Tensor | None = None,
                       row_lens: torch.Tensor | None = None, packed: PackedSequences | None = None,
                       dropout: tuple[float, int] = (0.0, 0), deterministic: bool = False,
                       dq=None, dk=None, dv=None, row_order: torch.Tensor | None = None,
                       kernel: str = TRITON_BACKWARD):
    """Gradients (dq, dk, dv, dbias) shaped like (q, k, v, bias); dk/dv are reduced over each KV
    group; dbias is None unless bias_grad. dlse (like lse), the gradient reaching lse, enters as
    delta - dlse (d lse / d s = p). Layouts as in attention_forward (packed: 3-D q/k/v, lse
    (H, total_q)); dropout: the forward's (p, seed). dq / dk / dv may be given (preallocated).
    row_lens without a schedule: as in attention_forward, sorted longest first within each batch
    (a key tile's rows are then a prefix), with the same row_order (q, dout, out, lse, dq in
    the caller's order: q, dout, lse and delta are gathered once into length order, dq written
    back to each row's place). With a config's atomic_dq and not deterministic, the dK/dV
    programs also add dQ into an fp32 buffer (atomics) and no dQ programs run (5 matmuls per
    tile pair instead of 7); otherwise dQ programs of their own write every gradient once. A
    bias with one column for all keys gets its gradient from lse alone (`row_constant_bias_grad`).
    kernel: the plan's (plan.py): GLUON_BACKWARD / GLUON_BACKWARD_WIDE run bwd_hopper.py's /
    bwd_hopper_wide.py's kernel, which the plan gives only calls they take; TRITON_BACKWARD
    this module's."""
    if bias_grad and bias.cols_shared:
        dq, dk, dv, _ = attention_backward(dout, q, k, v, out, lse, args, schedule, mask, bias,
                                           False, dlse, row_lens, packed, dropout, deterministic,
                                           dq, dk, dv, row_order, kernel)
        return dq, dk, dv, row_constant_bias_grad(bias, lse, dlse, q.shape[-2])
    batch, seqlen_q, seqlen_k = batch_shape(q, k, packed)
    num_heads, head_dim = q.shape[-2:]
    check_row_order(row_order, row_lens, args, schedule, mask, bias, packed, dropout)
    num_heads_k = k.shape[-2]
    group = num_heads // num_heads_k
    block_d = padded_head_dim(head_dim)
    bits = schedule.bits if schedule is not None else None
    causal_only = args.has_right and args.window_right == 0 and not args.has_left \
        and args.softcap == 0 and schedule is None and bias is None and row_lens is None \
        and packed is None and dropout[0] == 0
    cfg = backward_config(head_dim, q.dtype, masked=args.masked or schedule is not None,
                          full_bias=bias is not None and bias.spans_queries_and_keys,
                          causal_only=causal_only)
    # dK/dV programs walk query tiles of block_m1 for a key tile of block_n1; dQ programs the
    # reverse with (block_m2, block_n2). Explicit schedules carry their own tiles.
    block_m1, block_n1, block_m2, block_n2 = cfg.block_m1, cfg.block_n1, cfg.block_m2, cfg.block_n2
    num_warps, num_stages = cfg.num_warps, cfg.num_stages
    if schedule is not None:
        block_m1, block_n1 = schedule.dkdv.block_m, schedule.dkdv.block_n
        block_m2, block_n2 = schedule.dq.block_m, schedule.dq.block_n
        if schedule.dkdv.num_warps:
            num_warps, num_stages = schedule.dkdv.num_warps, schedule.dkdv.num_stages
    if dropout[0] > 0:
        # the dropout draws are regrouped through shared memory: one stage less
        num_stages = min(num_stages, DROPOUT_MAX_STAGES)
    # a bias with one column for all keys sums its gradient over keys in the dQ programs
    atomic_dq = cfg.atomic_dq and not deterministic and not (bias_grad and bias.cols_shared)
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    gluon = kernel in (GLUON_BACKWARD, GLUON_BACKWARD_WIDE)
    # the Gluon kernels read dO by TMA (packed: heads packed in its rows)
    if dout.stride(-1) != 1 or (gluon and not (tma_compatible(dout) and (
            packed is None or flat_rows(dout)))):
        dout = dout.contiguous()
    dbias_buffer, dbias_strides, dbias_per_qhead, zero_unlisted, finish_dbias = \
        None, None, True, False, None
    if bias_grad:
        dbias_buffer, dbias_strides, dbias_per_qhead, zero_unlisted, finish_dbias = \
            _dbias_buffer(bias, batch, num_heads, num_heads_k,
                          explicit_lists=schedule is not None and packed is None, gluon=gluon)
    if q.numel() == 0 or k.numel() == 0:
        dbias = finish_dbias(dbias_buffer.zero_()) if bias_grad else None
        return dq.zero_(), dk.zero_(), dv.zero_(), dbias
    # delta is per row: packed rows are one long sequence here, but for the Gluon kernel
    pre_batch, pre_rows = (1, q.shape[0]) if packed is not None and not gluon \
        else (batch, seqlen_q)
    if gluon:
        # lse / scale and delta side by side in a buffer the Gluon kernel loads by TMA, and dQ's
        # fp32 sums: the preprocess fills the one and zeroes the other
        row_stats, lse_scaled, delta = backward_row_stats(
            batch, num_heads, seqlen_q, hopper_backward_config(head_dim).block_m, q.device)
        dq_sum = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        stats_rows = delta.shape[-1]
    else:
        lse_scaled = dq_sum = None
        delta = torch.empty_like(lse)
        stats_rows = pre_rows
    if dlse is not None and dlse.stride(-1) != 1:
        dlse = dlse.contiguous()
    # rows in length order: q, dO and lse are copied into it beside delta. An index in the dK/dV
    # programs' inner loop instead (each query tile's rows looked up) cost 30% of the backward
    # on the H100
    if row_order is not None:
        # the Gluon kernel reads lse / scale in length order from row_stats instead
        q_in_order, dout_in_order = torch.empty_like(q), torch.empty_like(dout)
        lse_in_order = placeholder(q.device, torch.float32) if gluon else torch.empty_like(delta)
        order_operands = (row_order, q_in_order, dout_in_order, lse_in_order)
        order_strides = (row_order.stride(0), *row_strides(q_in_order),
                         *row_strides(dout_in_order))
    else:
        unused_rows = placeholder(q.device, q.dtype)
        order_operands = (placeholder(q.device), unused_rows, unused_rows,
                          placeholder(q.device, torch.float32))
        order_strides = (0,) * 7
    launch(bwd_preprocess, (cdiv(stats_rows, 64), pre_batch * num_heads),
        out, dout, delta, dlse if dlse is not None else delta, q, lse, *order_operands,
        lse_scaled if gluon else delta, dq_sum if gluon else delta,
        packed_operands(packed, q.device)[0], *row_strides(out), *row_strides(dout),
        *lse_strides(delta),
        *(lse_strides(dlse) if dlse is not None else (0, 0)), *row_strides(q), *lse_strides(lse),
        *order_strides, *(row_strides(dq_sum) if gluon else (0, 0, 0)), pre_rows, stats_rows,
        num_heads, 1.0 / args.softmax_scale, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=64,
        HAS_DLSE=dlse is not None, ROW_ORDER=row_order is not None, FOR_GLUON=gluon,
        VARLEN=gluon and packed is not None,
    )
    if row_order is not None:
        q, dout, lse = q_in_order, dout_in_order, lse_in_order
    if gluon:
        if bias_grad and bias.cols_shared:
            # summed over keys by atomics across key tiles: fp32 zeros
            dbias_buffer = torch.zeros(dbias_buffer.shape, dtype=torch.float32,
                                       device=q.device)
        if kernel == GLUON_BACKWARD_WIDE:  # no lists, masks or biases
            hopper_backward_wide(dout, q, k, v, row_stats, dq_sum, args, dq, dk, dv, row_lens,
                                 row_order, packed)
        else:
            hopper_backward(dout, q, k, v, row_stats, dq_sum, args, dq, dk, dv,
                            schedule.dkdv if schedule is not None else None, mask, bias,
                            (dbias_buffer, dbias_strides) if bias_grad else None, row_lens,
                            row_order, packed)
        return dq, dk, dv, finish_dbias(dbias_buffer) if bias_grad else None
    n_tiles_m = cdiv(seqlen_q, block_m2)
    n_tiles_n = cdiv(seqlen_k, block_n1)
    if schedule is not None:
        fwd_sched = schedule.dq.operands()
        t_sched = schedule.dkdv.operands()
    else:
        fwd_sched = t_sched = TileLists.placeholder_operands(q.device)
    unused = Elementwise.placeholder_operands(q.device)
    dbias_operands = (dbias_buffer, dbias_strides) if bias_grad \
        else tensors_then_tuple(unused[:5], 1)
    dq_sum = dq
    if atomic_dq:
        # fp32, laid out like q: the dK/dV programs add their shares
        dq_sum = dq.zero_() if dq.dtype == torch.float32 else \
            torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    # who stores dbias: the dQ programs for a bias with one column for all keys (a sum over keys)
    # and for a full bias per query head (stores contiguous along keys); the dK/dV programs for
    # a key bias (a sum over queries) and a full bias shared by a KV group (a sum over the
    # group). With atomic dQ there are no dQ programs: full biases go to dK/dV (biases with one
    # column for all keys are kept off that path above).
    dbias_tiles_in_dq = bias_grad and dbias_per_qhead and bias.spans_queries_and_keys \
        and not atomic_dq
    if zero_unlisted:
        _zero_unlisted(dbias_buffer, dbias_strides,
                       schedule.dq if dbias_tiles_in_dq else schedule.dkdv,
                       not dbias_tiles_in_dq, seqlen_q, seqlen_k)
    # a KV group split across dK/dV programs: each part writes fp32 partials to a head slot of
    # its own, summed after. A full bias shared by a KV group sums its gradient in one program
    heads_per_program = group if bias_grad and not dbias_per_qhead else \
        math.gcd(group, DKDV_HEADS_PER_PROGRAM)
    kv_split = group // heads_per_program
    dk_out, dv_out = dk, dv
    if kv_split > 1:
        parts_shape = (*k.shape[:-2], num_heads_k * kv_split, head_dim)
        dk = torch.empty(parts_shape, dtype=torch.float32, device=k.device)
        dv = torch.empty(parts_shape, dtype=torch.float32, device=k.device)
    n_programs = n_tiles_n * kv_split * (2 if cfg.dkdv_apart else 1) + \
        (0 if atomic_dq else group * n_tiles_m)
    # causal: programs in tile order across heads, longest first (H200, GQA 32/8 causal 8k
    # backward kernel 4.35 ms against 4.91). Dense keeps each head's programs together (tile
    # order 1.76 ms against 1.63: fewer programs share K/V in L2). Grid axis 1 holds at most
    # 65535 programs
    longest_first = schedule is None and args.later_rows_see_more and n_programs <= 65535
    grid = (batch * num_heads_k, n_programs) if longest_first \
        else (n_programs, batch * num_heads_k)
    even = packed is None
    launch(bwd_kernel, grid,
        q, k, v, dout, lse, delta, dq_sum, dk, dv,
        row_strides(q), row_strides(k), row_strides(v), row_strides(dout), row_strides(dq_sum),
        row_strides(dk), row_strides(dv), lse_strides(lse),
        *tensors_then_tuple(fwd_sched, 4), *tensors_then_tuple(t_sched, 4),
        *tensors_then_tuple(mask.operands() if mask is not None else unused, 1),
        *tensors_then_tuple(bias.operands() if bias is not None else unused, 1),
        *dbias_operands,
        *row_lens_operands(row_lens, q.device, row_order), *packed_operands(packed, q.device),
        *(bits.operands() if bits is not None
          else BlockBits.placeholder_operands(q.device)),
        (seqlen_q, seqlen_k, num_heads, group), (n_tiles_n, n_tiles_m),
        (seqlen_k - seqlen_q, args.window_left, args.window_right), args.softmax_scale,
        (args.qk_scale_log2, args.softcap_inv_scaled, args.softcap_log2),
        (dropout[1], dropout[0]),
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        PROGRAMS=(heads_per_program, cfg.dkdv_apart, atomic_dq, longest_first),
        DKDV_TILE=(block_m1, block_n1, even and seqlen_q % block_m1 == 0,
                   even and seqlen_k % block_n1 == 0),
        DQ_TILE=(block_m2, block_n2, even and seqlen_q % block_m2 == 0,
                 even and seqlen_k % block_n2 == 0),
        WINDOW_FORM=(args.has_left, args.has_right), SOFTCAP=args.softcap > 0,
        MASK_FORM=Elementwise.form(mask), BIAS_FORM=Elementwise.form(bias),
        DBIAS_FORM=(bias_grad, dbias_per_qhead, dbias_tiles_in_dq),
        ROW_LENS_FORM=(row_lens is not None, row_lens is not None and schedule is None,
                       row_order is not None),
        VARLEN=packed is not None, DROPOUT=dropout[0] > 0, EXPLICIT=schedule is not None,
        BITS_FORM=BlockBits.kernel_form(bits), DOT_PRECISION=KernelArgs.dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    if dq_sum is not dq:
        dq.copy_(dq_sum)
    if kv_split > 1:
        sum_batch, sum_rows = (1, k.shape[0]) if packed is not None else (batch, seqlen_k)
        launch(sum_kv_parts, (cdiv(sum_rows, 64), sum_batch * num_heads_k),
            dk, dv, dk_out, dv_out, *row_strides(dk), *row_strides(dk_out), *row_strides(dv_out),
            sum_rows, num_heads_k, kv_split, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=64,
        )
    return dq, dk_out, dv_out, finish_dbias(dbias_buffer) if bias_grad else None
