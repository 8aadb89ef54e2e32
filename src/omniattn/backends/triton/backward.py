"""The Triton backward (its kernels are in backward_kernels.py): after the preprocess
(`passes.attention_backward`: delta = rowsum(dO * O), shared with the Gluon backward), one launch
whose first programs compute dK/dV for a key tile (walking the transposed schedule of one query
head of its KV group, fp32 partials summed per KV head by a small kernel after; of every head of
the group where a full bias's gradient is summed over it: GQA needs neither repeated K/V nor
atomics). dQ either comes from the same programs, added into an fp32 buffer with atomics, or
(deterministic) from programs of its own that walk the forward schedule for a query tile and
write every gradient once."""
from __future__ import annotations

import math

import torch

from ...kernels.elementwise import Elementwise, TopkTerm
from ...kernels.schedule import BlockBits, KernelArgs, Schedule, TileLists
from ...kernels.sequences import (PackedSequences, batch_shape, lse_strides, packed_operands,
                                  row_lens_operands, row_strides)
from ...kernels.sizes import cdiv, next_power_of_2, padded_head_dim
from ...runtime.launch import launch, tensors_then_tuple
from .backward_kernels import bwd_kernel
from .backward_steps import sum_kv_parts, zero_unlisted_kernel
from .configs import DKDV_HEADS_PER_PROGRAM, DROPOUT_MAX_STAGES, BwdTileConfig, backward_config


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
        *tensors_then_tuple(lists.operands(heads), 4),
        BLOCK_M=lists.block_m, BLOCK_N=lists.block_n, COLS=next_power_of_2(n_cols),
        TRANSPOSED=transposed,
    )


def backward_tiles(head_dim: int, dtype: torch.dtype, args: KernelArgs, explicit: bool,
                   bias: Elementwise | None, row_lens: bool, packed: bool,
                   dropout: bool) -> BwdTileConfig:
    """The tiles of a Triton backward without explicit lists (which carry their own), as the
    plan reports them and `triton_backward` runs them; only calls whose sole mask is causal take
    `_BWD_CAUSAL`'s."""
    causal_only = args.has_right and args.window_right == 0 and not args.has_left \
        and args.softcap == 0 and not explicit and bias is None and not row_lens \
        and not packed and not dropout
    return backward_config(head_dim, dtype, masked=args.masked or explicit,
                           full_bias=bias is not None and bias.spans_queries_and_keys,
                           causal_only=causal_only)


def triton_backward(dout, q, k, v, lse, delta, args: KernelArgs, dq, dk, dv,
                    schedule: Schedule | None, mask: Elementwise | None,
                    bias: Elementwise | None, dbias: tuple | None, row_lens: torch.Tensor | None,
                    packed: PackedSequences | None, dropout: tuple[float, int],
                    deterministic: bool, row_order: torch.Tensor | None,
                    topk: TopkTerm | None = None):
    """The Triton backward's dK/dV and dQ programs after the preprocess (`passes.
    attention_backward` has the layouts and the arguments' meaning): (dq, dk, dv), dk / dv
    reduced over each KV group. delta: the preprocess's rowsum(dO * O) - dlse; q, dout and lse
    in length order where row_order is given. dbias: (buffer, its kernel strides, one slot per
    query head, its unlisted tiles to be zeroed here) from `passes`, or None without a bias
    gradient. With a config's atomic_dq and not deterministic, the dK/dV programs also add dQ
    into an fp32 buffer (atomics) and no dQ programs run (5 matmuls per tile pair instead of 7);
    otherwise dQ programs of their own write every gradient once."""
    batch, seqlen_q, seqlen_k = batch_shape(q, k, packed)
    num_heads, head_dim = q.shape[-2:]
    num_heads_k = k.shape[-2]
    group = num_heads // num_heads_k
    bias_grad = dbias is not None
    dbias_buffer, dbias_strides, dbias_per_qhead, zero_unlisted = dbias if bias_grad \
        else (None, None, True, False)
    block_d = padded_head_dim(head_dim)
    bits = schedule.bits if schedule is not None else None
    cfg = backward_tiles(head_dim, q.dtype, args, schedule is not None, bias, row_lens is not None,
                         packed is not None, dropout[0] > 0)
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
    n_tiles_m = cdiv(seqlen_q, block_m2)
    n_tiles_n = cdiv(seqlen_k, block_n1)
    if schedule is not None:
        fwd_sched = schedule.dq.operands(num_heads)
        t_sched = schedule.dkdv.operands(num_heads)
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
    # a KV group split across dK/dV programs: each part adds its fp32 dK/dV into the KV head's
    # (atomics), or, deterministic, writes them to a head slot of its own, summed after in slot
    # order; the slots cost group x the KV heads' fp32 dK/dV (B1 H16 Hk4 128k: 2 GiB, against
    # 0.5 for the atomics' one). A full bias shared by a KV group sums its gradient in one program
    heads_per_program = group if bias_grad and not dbias_per_qhead else \
        math.gcd(group, DKDV_HEADS_PER_PROGRAM)
    kv_split = group // heads_per_program
    atomic_kv = kv_split > 1 and not deterministic
    dk_out, dv_out = dk, dv
    if atomic_kv:
        dk, dv = (grad.zero_() if grad.dtype == torch.float32 else
                  torch.zeros(grad.shape, dtype=torch.float32, device=grad.device)
                  for grad in (dk, dv))
    elif kv_split > 1:
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
        *fwd_sched[:4], *t_sched[:4], (fwd_sched[4:], t_sched[4:]),
        *tensors_then_tuple(mask.operands() if mask is not None else unused, 1),
        *tensors_then_tuple(bias.operands() if bias is not None else unused, 1),
        *dbias_operands,
        *row_lens_operands(row_lens, q.device, row_order), *packed_operands(packed, q.device),
        *(bits.operands() if bits is not None
          else BlockBits.placeholder_operands(q.device)),
        *(topk.operands(num_heads) if topk is not None
          else TopkTerm.placeholder_operands(q.device)),
        (seqlen_q, seqlen_k, num_heads, group, n_tiles_n, n_tiles_m),
        (seqlen_k - seqlen_q, args.window_left, args.window_right),
        (args.qk_scale_log2, args.softcap_inv_scaled, args.softcap_log2, args.softmax_scale),
        (dropout[1], dropout[0]),
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        PROGRAMS=(heads_per_program, cfg.dkdv_apart, atomic_dq, longest_first, atomic_kv),
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
        TOPK_FORM=TopkTerm.form(topk), num_warps=num_warps, num_stages=num_stages,
    )
    if dq_sum is not dq:
        dq.copy_(dq_sum)
    if dk is not dk_out:  # the slots' sums, or the atomics' fp32 sums in the gradients' dtype
        sum_batch, sum_rows = (1, k.shape[0]) if packed is not None else (batch, seqlen_k)
        launch(sum_kv_parts, (cdiv(sum_rows, 64), sum_batch * num_heads_k),
            dk, dv, dk_out, dv_out, *row_strides(dk), *row_strides(dk_out), *row_strides(dv_out),
            sum_rows, num_heads_k, 1 if atomic_kv else kv_split, HEAD_DIM=head_dim,
            BLOCK_D=block_d, BLOCK_N=64,
        )
    return dq, dk_out, dv_out
