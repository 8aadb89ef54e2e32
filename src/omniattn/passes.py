"""Each pass of a call on the kernels the plan names (plan.py): what every kernel of the pass
needs first, then that kernel's launcher in its backend (backends/triton, backends/gluon_sm90).
The forward: its outputs and the calls with nothing to compute (split-KV decoding's too). The
backward: the preprocess (delta = rowsum(dO * O) - dlse, the length order's copies, for the
Gluon kernels lse / scale beside delta and dQ's fp32 sums; one Triton kernel for both
backends), the dbias buffer and its reduction to the bias's shape, and the exact gradient of a
bias with one column for all keys."""
from __future__ import annotations

import torch

from .backends.gluon_sm90.backward import backward_row_stats, hopper_backward
from .backends.gluon_sm90.backward_wide import hopper_backward_wide
from .backends.gluon_sm90.blocks import flat_rows
from .backends.gluon_sm90.configs import hopper_backward_config
from .backends.gluon_sm90.forward import hopper_forward
from .backends.triton.backward import triton_backward
from .backends.triton.backward_steps import bwd_preprocess
from .backends.triton.decode import triton_decode
from .backends.triton.forward import triton_forward
from .kernels.elementwise import Elementwise, TopkTerm
from .kernels.schedule import BlockBits, KernelArgs, Schedule, TileLists
from .kernels.sequences import (PackedSequences, PagedKeys, batch_shape, broadcast_strides,
                                check_row_order, lse_shape, lse_strides, packed_operands,
                                placeholder, row_strides, tma_compatible)
from .kernels.sizes import cdiv, padded_head_dim
from .runtime.launch import launch

GLUON_FORWARD, TRITON_FORWARD = "fwd_hopper", "fwd"  # the kernels a plan names
GLUON_BACKWARD, GLUON_BACKWARD_WIDE, TRITON_BACKWARD = "bwd_hopper", "bwd_hopper_wide", "bwd"
DECODE_FORWARD = "fwd_decode"  # split-KV decoding, forward only


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: KernelArgs,
                      schedule: TileLists | None = None, bits: BlockBits | None = None,
                      mask: Elementwise | None = None,
                      bias: Elementwise | None = None, row_lens: torch.Tensor | None = None,
                      packed: PackedSequences | None = None, dropout: tuple[float, int] = (0.0, 0),
                      out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                      row_order: torch.Tensor | None = None,
                      kernel: str = TRITON_FORWARD,
                      topk: TopkTerm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Sq, H, D), k/v (B, Sk, Hk, D), last dim contiguous -> out like q, lse (B, H, Sq) fp32;
    packed (varlen): q (total_q, H, D), k/v (total_k, Hk, D) -> lse (H, total_q).
    `schedule`: the explicit forward lists (None: dense / causal / window from `args`); the mask,
    the block mask's element bitmaps `bits` and the per-row key lengths row_lens (int32 (B, Sq)
    or packed (total_q,)) are applied in its PARTIAL tiles, the bias in every visited tile.
    row_lens without a schedule (not packed): each query tile's key range comes from its rows'
    lengths, which the backward pass needs sorted longest first within each batch: with
    row_order (int32 (B, Sq), row i of a batch in that order is its row row_order[b, i]) q, out
    and lse stay in the caller's order while row_lens and the tiles follow the sorted one.
    dropout: (p, seed) of the Philox stream. topk: the rows' top-k threshold pairs and their
    scores, applied in PARTIAL tiles (the Triton kernels read them).
    `out` / `lse` may be given (preallocated, any strides with a contiguous last dim).
    kernel: the plan's (plan.py): GLUON_FORWARD runs the Gluon forward, which the plan gives only
    calls it takes; TRITON_FORWARD the Triton one."""
    check_row_order(row_order, row_lens, args, schedule, mask, bias, packed, dropout)
    out = torch.empty_like(q) if out is None else out
    if lse is None:
        lse = torch.empty(lse_shape(q), device=q.device, dtype=torch.float32)
    if k.numel() == 0:  # every row sees no key
        return out.zero_(), lse.fill_(float("-inf"))
    if out.numel() == 0:
        return out, lse
    if kernel == GLUON_FORWARD and not tma_compatible(q, k, v):
        kernel = TRITON_FORWARD  # a plan made while tracing could not see the bases' alignment
    if kernel == GLUON_FORWARD:
        hopper_forward(q, k, v, args, out, lse, schedule, mask, bias, row_lens, row_order, packed)
    else:
        triton_forward(q, k, v, args, out, lse, schedule, bits, mask, bias, row_lens, packed,
                       dropout, row_order, topk)
    return out, lse


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
                       kernel: str = TRITON_BACKWARD, topk: TopkTerm | None = None):
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
    kernel: the plan's (plan.py): GLUON_BACKWARD / GLUON_BACKWARD_WIDE run the Gluon backward
    (head dims 64 / 128, or 256), which the plan gives only calls they take; TRITON_BACKWARD the
    Triton one (`triton_backward`). topk: as in attention_forward."""
    if bias_grad and bias.cols_shared:
        dq, dk, dv, _ = attention_backward(dout, q, k, v, out, lse, args, schedule, mask, bias,
                                           False, dlse, row_lens, packed, dropout, deterministic,
                                           dq, dk, dv, row_order, kernel, topk)
        return dq, dk, dv, row_constant_bias_grad(bias, lse, dlse, q.shape[-2])
    batch, seqlen_q, seqlen_k = batch_shape(q, k, packed)
    num_heads, head_dim = q.shape[-2:]
    check_row_order(row_order, row_lens, args, schedule, mask, bias, packed, dropout)
    num_heads_k = k.shape[-2]
    block_d = padded_head_dim(head_dim)
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    gluon = kernel in (GLUON_BACKWARD, GLUON_BACKWARD_WIDE)
    if gluon and not tma_compatible(q, k, v):
        # a plan made while tracing could not see the bases' alignment
        gluon, kernel = False, TRITON_BACKWARD
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
    dq, dk, dv = triton_backward(dout, q, k, v, lse, delta, args, dq, dk, dv, schedule, mask, bias,
                                 (dbias_buffer, dbias_strides, dbias_per_qhead, zero_unlisted)
                                 if bias_grad else None, row_lens, packed, dropout, deterministic,
                                 row_order, topk)
    return dq, dk, dv, finish_dbias(dbias_buffer) if bias_grad else None


def decode_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: KernelArgs,
                   mask: Elementwise | None = None, bias: Elementwise | None = None,
                   row_lens: torch.Tensor | None = None, paged: PagedKeys | None = None,
                   num_splits: int = 0,
                   topk: TopkTerm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV decoding's forward (DECODE_FORWARD): q (B, Sq, H, D); k/v (B, Sk, Hk, D), or
    pages (num_pages, page_size, Hk, D) with `paged` -> out like q, lse (B, H, Sq) float32;
    the rest as backends/triton/decode.py's triton_decode takes it (topk: the rows' threshold
    pairs over each sequence's used keys, and their scores)."""
    out = torch.empty_like(q)
    lse = torch.empty(lse_shape(q), device=q.device, dtype=torch.float32)
    if out.numel():
        triton_decode(q, k, v, args, out, lse, mask, bias, row_lens, paged, num_splits, topk)
    return out, lse
