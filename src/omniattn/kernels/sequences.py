"""How the rows of a batch lie in memory: padded (B, S, H, D) tensors, or packed (total, H, D)
tensors whose sequences start at cu_seqlens (varlen). Kernels see both through the same
arguments: a packed tensor has batch stride 0 and the kernel offsets each sequence's rows."""
from __future__ import annotations

from dataclasses import dataclass
import functools

import torch
import triton
import triton.language as tl

from ..runtime.launch import launch
from ..runtime.switches import interpreting
from .sizes import cdiv


@dataclass(frozen=True)
class PackedSequences:
    """Sequence b holds query rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and key rows
    [cu_seqlens_k[b], cu_seqlens_k[b + 1]); int32 (B + 1,) tensors on the device."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1

    def seqlens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) query and key lengths, on the device."""
        return (self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1],
                self.cu_seqlens_k[1:] - self.cu_seqlens_k[:-1])


def batch_shape(q: torch.Tensor, k: torch.Tensor, packed: PackedSequences | None):
    """(batch, Sq, Sk) the kernels are launched for: the longest sequences when packed."""
    if packed is not None:
        return packed.batch, packed.max_seqlen_q, packed.max_seqlen_k
    return q.shape[0], q.shape[1], k.shape[1]


def row_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, row, head) strides of q/k/v/out/grads: batch 0 for a packed (total, H, D) tensor."""
    return (0, t.stride(0), t.stride(1)) if t.dim() == 3 else (t.stride(0), t.stride(1), t.stride(2))


def broadcast_strides(t: torch.Tensor) -> tuple[int, ...]:
    """t's strides, 0 for each size-1 dim: what the kernels read as a broadcast (no expand,
    which costs a torch op per tensor and call)."""
    return tuple(0 if size == 1 else stride for size, stride in zip(t.shape, t.stride()))


def lse_strides(lse: torch.Tensor) -> tuple[int, int]:
    """(batch, head) strides of the lse: (B, H, Sq) padded, (H, total_q) packed."""
    return (0, lse.stride(0)) if lse.dim() == 2 else (lse.stride(0), lse.stride(1))


def lse_shape(q: torch.Tensor) -> tuple[int, ...]:
    return (q.shape[1], q.shape[0]) if q.dim() == 3 else (q.shape[0], q.shape[2], q.shape[1])


@functools.lru_cache(maxsize=None)
def placeholder(device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """One zero element per (device, dtype), made once: the pointer operand of a feature a launch
    does not use (never read). A fresh tensor per launch cost a fill kernel each."""
    return torch.zeros(1, dtype=dtype, device=device)


def check_row_order(row_order, row_lens, args, schedule, mask, bias, packed, dropout) -> None:
    """A launcher's row_order belongs to per-row key lengths alone: every other term of the
    predicate (causal, window, mask, bias, block mask, dropout counters, packing) is indexed by
    the caller's rows, the tiles by the sorted ones."""
    if row_order is None:
        return
    others = args.masked or schedule is not None or mask is not None or bias is not None \
        or packed is not None or dropout[0] > 0
    if row_lens is None or others:
        raise ValueError("row_order orders the rows of per-row key lengths alone: pass it with "
                         "row_lens and no causal, window, mask, bias, schedule, packing or dropout")
    if row_order.shape != row_lens.shape or row_order.stride() != row_lens.stride():
        raise ValueError("row_order must be laid out like row_lens (the kernels share its stride)")


def row_lens_operands(row_lens: torch.Tensor | None, device: torch.device,
                      row_order: torch.Tensor | None = None) -> tuple:
    """(lengths, batch stride, row order) of per-row key lengths: int32 (B, Sq), or (total_q,)
    packed; the optional row order (int32 (B, Sq), rows in length order) shares the stride (see
    check_row_order)."""
    order = placeholder(device) if row_order is None else row_order
    if row_lens is None:
        return placeholder(device), 0, order
    return row_lens, row_lens.stride(0) if row_lens.dim() == 2 else 0, order


def packed_operands(packed: PackedSequences | None, device: torch.device) -> tuple:
    if packed is None:
        return placeholder(device), placeholder(device)
    return packed.cu_seqlens_q, packed.cu_seqlens_k


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need 16-byte aligned bases and 16-byte multiples for every stride but
    the (contiguous) last. While torch.compile traces, bases have no address: only the strides
    are checked, and `passes` checks the bases of the call that runs."""
    tracing = torch.compiler.is_compiling()
    for t in tensors:
        *outer, last = t.stride()
        if last != 1 or (not tracing and t.data_ptr() % 16):
            return False
        elements = 16 // t.element_size()  # per 16 bytes (sizes 1, 2, 4, 8)
        for stride in outer:
            if stride % elements:
                return False
    return True


# rank by counting: B x Sq^2 comparisons in one launch, up to this many; torch's segmented sort
# (radix passes and a memset) above (H100, B2 x 8k: rank 0.030 ms, sort 0.061; B2 x 16k: 0.100,
# 0.061)
RANK_MAX_PAIRS = 2 ** 27
# (rows, keys) per step of the rank kernel, warps: B2 x 8k 0.030 ms; (128, 128, 8) 0.031
RANK_TILE = (64, 128, 4)


@triton.jit
def _length_rank_kernel(RowLens, stride_lb, Order, Lengths, seqlen_q, seqlen_k,
                        BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Each row's place when its batch's rows are ordered by key length, longest first, ties in
    row order: the count of rows before it in that order. A row's key, length x Sq + (Sq - 1 -
    row), is unique and larger for every row placed earlier. One program per BLOCK rows."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    off_b = tl.program_id(1).to(tl.int64)
    lens_base = RowLens + off_b * stride_lb
    in_rows = rows < seqlen_q
    lens = tl.minimum(tl.maximum(tl.load(lens_base + rows, mask=in_rows, other=0), 0), seqlen_k)
    keys = lens * seqlen_q + (seqlen_q - 1 - rows)  # [BLOCK]
    earlier = tl.zeros([BLOCK, CHUNK], dtype=tl.int32)
    for start in range(0, seqlen_q, CHUNK):
        others = start + tl.arange(0, CHUNK)
        in_others = others < seqlen_q
        other_lens = tl.minimum(tl.maximum(tl.load(lens_base + others, mask=in_others, other=0),
                                           0), seqlen_k)
        other_keys = tl.where(in_others, other_lens * seqlen_q + (seqlen_q - 1 - others), -1)
        earlier += (other_keys[None, :] > keys[:, None]).to(tl.int32)  # [BLOCK, CHUNK]
    out = off_b * seqlen_q + tl.sum(earlier, axis=1)
    tl.store(Order + out, rows, mask=in_rows)
    tl.store(Lengths + out, lens, mask=in_rows)


def length_order(row_lens: torch.Tensor, seqlen_k: int,
                 max_rank_pairs: int = RANK_MAX_PAIRS) -> tuple[torch.Tensor, torch.Tensor]:
    """Each batch's rows of row_lens (int32 (B, Sq)) by key length, longest first (ties in their
    own order): (order, lengths), int32 (B, Sq) each, contiguous; row i of batch b in that order
    is its row order[b, i], of length lengths[b, i] (clamped to [0, Sk]). No host sync."""
    batch, seqlen_q = row_lens.shape
    # the rank kernel's keys, length x Sq + row, are int32
    if batch * seqlen_q ** 2 > max_rank_pairs or (seqlen_k + 1) * seqlen_q >= 2 ** 31:
        shortfall, order = torch.sort(seqlen_k - row_lens.clamp(0, seqlen_k), dim=-1, stable=True)
        return order.to(torch.int32), (seqlen_k - shortfall).to(torch.int32)
    order = torch.empty((batch, seqlen_q), dtype=torch.int32, device=row_lens.device)
    lengths = torch.empty_like(order)
    if order.numel():
        block, chunk, num_warps = (16, 16, 1) if interpreting() else RANK_TILE
        launch(_length_rank_kernel, (cdiv(seqlen_q, block), batch),
            row_lens, row_lens.stride(0), order, lengths, seqlen_q, seqlen_k,
            BLOCK=block, CHUNK=chunk, num_warps=num_warps)
    return order, lengths


@triton.jit
def _rows_to_callers_kernel(Src, Order, Dst, stride_sb, stride_sm, stride_sh, stride_ob,
                            stride_db, stride_dm, stride_dh, seqlen, num_heads,
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_M: tl.constexpr):
    """Dst[b, Order[b, r], h] = Src[b, r, h] (cast to Dst's dtype) for BLOCK_M rows r of one
    (batch, head)."""
    off_bh = tl.program_id(1)
    off_b = (off_bh // num_heads).to(tl.int64)
    off_h = (off_bh % num_heads).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    in_rows = rows < seqlen
    callers = tl.load(Order + off_b * stride_ob + rows, mask=in_rows, other=0).to(tl.int64)
    inside = in_rows[:, None] & (cols[None, :] < HEAD_DIM)
    tile = tl.load(Src + off_b * stride_sb + off_h * stride_sh
                   + rows.to(tl.int64)[:, None] * stride_sm + cols[None, :], mask=inside)
    tl.store(Dst + off_b * stride_db + off_h * stride_dh + callers[:, None] * stride_dm
             + cols[None, :], tile.to(Dst.dtype.element_ty), mask=inside)


def rows_to_callers(src: torch.Tensor, row_order: torch.Tensor | None,
                    dst: torch.Tensor) -> None:
    """dst[b, row_order[b, r]] = src[b, r] for (B, S, H, D) tensors (last dims contiguous;
    row_order int32 (B, S), contiguous rows), cast to dst's dtype: rows computed in length order
    back to the caller's, in one pass. row_order None: src is in the caller's order (a copy)."""
    if row_order is None:
        dst.copy_(src)
        return
    batch, seqlen, heads, head_dim = src.shape
    if src.numel():
        launch(_rows_to_callers_kernel, (cdiv(seqlen, 64), batch * heads),
            src, row_order, dst, *row_strides(src), row_order.stride(0), *row_strides(dst),
            seqlen, heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_M=64)


@dataclass(frozen=True)
class PagedKeys:
    """The keys of each sequence when a call gives `block_table` and / or `seqused_k`: k/v are
    pages (num_pages, page_size, Hk, D) that block_table (int32 (B, max_pages)) lists per
    sequence (page_size 0: a contiguous (B, Sk, Hk, D) cache), and sequence b uses its first
    seqused_k[b] keys (int32 (B,); None: all seqlen_k). seqlen_k: the keys a sequence can hold
    (max_pages x page_size, or Sk), the key dim of masks and biases; causal and windows align
    to each sequence's used keys (bottom-right)."""

    block_table: torch.Tensor | None
    seqused_k: torch.Tensor | None
    page_size: int
    seqlen_k: int

    def logical_keys(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """A (B, seqlen_k, Hk, D) view holding no memory (stride 0): the shape masks, biases and
        per-row lengths are checked against."""
        return k.new_empty(()).expand(q.shape[0], self.seqlen_k, *k.shape[2:])

    def operands(self, device: torch.device) -> tuple:
        """(block table, its batch stride, seqused_k) for the decode kernel."""
        table = self.block_table if self.block_table is not None else placeholder(device)
        used = self.seqused_k if self.seqused_k is not None else placeholder(device)
        stride = self.block_table.stride(0) if self.block_table is not None else 0
        return table, stride, used
