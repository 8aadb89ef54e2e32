"""Top-k row thresholds of per-key scores (one score row for every query) when each row sees a
contiguous key range: causal, window, per-row lengths, packed sequences, and a per-key mask
(keys it hides rank last, after every other key).

Every key gets its rank in the rule's order (valid first, larger score first, lower index first:
one stable sort per key array). A row's selection is then the topk-th smallest rank within its
range [lo, hi), which a wavelet matrix over the ranks answers in log2(Sk) steps of two counts
each: build O(Sk log Sk) per key array, O(Sq log Sk) for the rows, against O(Sq x Sk) for
rescanning each causal prefix. Memory: log2(Sk) + 5 int32 per key and array (16 bytes per key
while sorting), nothing per (row, key): 128k keys, 16 heads: 190 MB.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..predicate import EVERY_TIE, KEEP_ALL, order_keys
from ..runtime.launch import launch
from ..runtime.switches import interpreting
from .common import sequence_bounds, used_keys
from .elementwise import Elementwise
from .schedule import KernelArgs
from .sequences import PackedSequences, packed_operands, placeholder
from .sizes import cdiv, next_power_of_2

_KEEP_ALL, _EVERY_TIE = tl.constexpr(KEEP_ALL), tl.constexpr(EVERY_TIE)
# untuned: keys per step of the build, rows per program of the queries
BUILD_BLOCK, RANGE_BLOCK_M = 1024, 128


@triton.jit
def _rank_levels_kernel(Work, Zeros, seqlen_k, num_levels, BLOCK: tl.constexpr):
    """The wavelet matrix of one key array's ranks (a permutation of [0, Sk)), program = array.
    Work (arrays, 2, Sk): row 1 holds the ranks in key order; level l reads row (l + 1) % 2 and
    writes its successor's order to row l % 2. Level l splits on bit num_levels - 1 - l:
    Zeros (arrays, num_levels, Sk + 1)[l, i] = how many of level l's first i elements have it 0;
    the next level's order is this one's, those elements first, each side in order."""
    work = Work + tl.program_id(0).to(tl.int64) * 2 * seqlen_k
    zeros = Zeros + tl.program_id(0).to(tl.int64) * num_levels * (seqlen_k + 1)
    offs = tl.arange(0, BLOCK)
    for level in range(num_levels):
        bit = num_levels - 1 - level
        src = work + ((level + 1) % 2) * seqlen_k
        dst = work + (level % 2) * seqlen_k
        level_zeros = zeros + level * (seqlen_k + 1)
        tl.store(level_zeros + offs, tl.zeros([BLOCK], tl.int32), mask=offs == 0)
        total = 0
        for start in range(0, seqlen_k, BLOCK):
            idx = start + offs
            inside = idx < seqlen_k
            value = tl.load(src + idx, mask=inside, other=0, cache_modifier=".cg")
            zero = ((((value >> bit) & 1) == 0) & inside).to(tl.int32)
            tl.store(level_zeros + 1 + idx, total + tl.cumsum(zero, 0), mask=inside)
            total += tl.sum(zero, 0)
        # the counts other threads stored are read back below (and the order by the next level)
        tl.debug_barrier()
        if level + 1 < num_levels:
            for start in range(0, seqlen_k, BLOCK):
                idx = start + offs
                inside = idx < seqlen_k
                value = tl.load(src + idx, mask=inside, other=0, cache_modifier=".cg")
                before = tl.load(level_zeros + idx, mask=inside, other=0, cache_modifier=".cg")
                dest = tl.where(((value >> bit) & 1) == 0, before, total + idx - before)
                tl.store(dst + dest, value, mask=inside)
            tl.debug_barrier()


@triton.jit
def _range_select_kernel(
    Keys, Perm, Valid, Zeros, RowLens, stride_rb, CuSeqlensQ, CuSeqlensK, SeqUsed,
    Threshold, LastTie, stride_tb, stride_th,
    topk, seqlen_q, seqlen_k, array_k, heads_out, array_batched, window_left, window_right,
    num_levels, top_bit, BLOCK_M: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_ROW_LENS: tl.constexpr, VARLEN: tl.constexpr, HAS_SEQUSED: tl.constexpr,
):
    """Threshold pairs of BLOCK_M rows of one (batch, head), program (row tile, batch x
    heads_out). Per array (batch if array_batched, head), Sk = array_k: Keys int32 order keys
    (KEEP_ALL where the mask hides the key), Perm int32 the key of each rank, Valid int32
    (Sk + 1,) counts of the keys the mask lets through before each, Zeros the wavelet matrix
    (_rank_levels_kernel). HAS_SEQUSED: batch b uses its first SeqUsed[b] keys (causal /
    window align to them)."""
    off_b = tl.program_id(1) // heads_out
    off_h = tl.program_id(1) % heads_out
    first_q, seqlen_q, _, seqlen_k = sequence_bounds(CuSeqlensQ, CuSeqlensK, off_b, seqlen_q,
                                                     seqlen_k, VARLEN)
    seqlen_k = used_keys(SeqUsed, off_b, seqlen_k, HAS_SEQUSED)
    diag_offset = seqlen_k - seqlen_q
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    inside = rows < seqlen_q
    # the row's key range [lo, hi), empty past the last row
    lo = tl.zeros([BLOCK_M], tl.int32)
    hi = tl.where(inside, seqlen_k, 0)
    if HAS_LEFT:
        lo = rows + diag_offset - window_left
    if HAS_RIGHT:
        hi = tl.minimum(hi, rows + diag_offset + window_right + 1)
    if HAS_ROW_LENS:
        hi = tl.minimum(hi, tl.load(RowLens + off_b * stride_rb + first_q + rows, mask=inside,
                                    other=0))
    hi = tl.maximum(hi, 0)
    lo = tl.minimum(tl.maximum(lo, 0), hi)
    array = (off_b * array_batched * heads_out + off_h).to(tl.int64)
    keys = Keys + array * array_k
    perm = Perm + array * array_k
    valid = Valid + array * (array_k + 1)
    zeros = Zeros + array * num_levels * (array_k + 1)
    selects = tl.load(valid + hi) - tl.load(valid + lo) > topk
    # descend the levels to the topk-th smallest rank in [lo, hi)
    rank = tl.zeros([BLOCK_M], tl.int32)
    wanted = tl.zeros([BLOCK_M], tl.int32) + topk - 1
    level_lo = lo
    level_hi = hi
    for level in range(num_levels):
        level_zeros = zeros + level * (array_k + 1)
        zeros_lo = tl.load(level_zeros + level_lo)
        zeros_hi = tl.load(level_zeros + level_hi)
        total = tl.load(level_zeros + array_k)
        to_zeros = wanted < zeros_hi - zeros_lo
        wanted = tl.where(to_zeros, wanted, wanted - (zeros_hi - zeros_lo))
        level_lo = tl.where(to_zeros, zeros_lo, total + level_lo - zeros_lo)
        level_hi = tl.where(to_zeros, zeros_hi, total + level_hi - zeros_hi)
        rank = tl.where(to_zeros, rank, rank | (top_bit >> level))
    chosen = tl.load(perm + rank, mask=selects, other=0)
    threshold = tl.load(keys + chosen, mask=selects, other=0)
    # a tie is cut iff the next key in rank order scores the same and lies in the range (keys
    # scoring alike rank by index, so it is the first of them after `chosen`)
    has_next = selects & (rank + 1 < tl.load(valid + array_k))
    following = tl.load(perm + rank + 1, mask=has_next, other=0)
    cut = has_next & (tl.load(keys + following, mask=has_next, other=0) == threshold) \
        & (following < hi)
    out = off_b.to(tl.int64) * stride_tb + off_h * stride_th + first_q + rows
    tl.store(Threshold + out, tl.where(selects, threshold, _KEEP_ALL), mask=inside)
    tl.store(LastTie + out, tl.where(cut, chosen, _EVERY_TIE), mask=inside)


def _key_arrays(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B|1, Hm, 1, Sk|1) -> (B|1, heads, Sk|1) view, output head h reading head h // (heads /
    Hm): a copy only where Hm is neither 1 nor heads."""
    t = t[:, :, 0]
    return t if t.shape[1] in (1, heads) else t.repeat_interleave(heads // t.shape[1], dim=1)


def range_thresholds(topk: int, scores: Elementwise, mask: Elementwise | None, args: KernelArgs,
                     batch: int, seqlen_q: int, seqlen_k: int, row_lens: torch.Tensor | None,
                     packed: PackedSequences | None, threshold: torch.Tensor,
                     last_tie: torch.Tensor, seqused_k: torch.Tensor | None = None) -> None:
    """select.row_thresholds for per-key scores and mask (one row for every query), into
    threshold / last_tie (B, heads, Sq) (packed: (1, heads, total_q)); topk < Sk; seqused_k
    as row_thresholds takes it."""
    heads = threshold.shape[1]
    device = threshold.device
    keys = order_keys(_key_arrays(scores.tensor, heads))
    if mask is not None:
        # keys the mask hides rank last: KEEP_ALL lies below every order key
        keys = torch.where(_key_arrays(mask.tensor, heads) != 0, keys, KEEP_ALL)
    array_k = scores.tensor.shape[-1] if not scores.cols_shared else (
        mask.tensor.shape[-1] if mask is not None and not mask.cols_shared else seqlen_k)
    keys = keys.expand(*keys.shape[:2], array_k).contiguous()
    num_arrays, num_levels = keys.shape[0] * keys.shape[1], max(1, (array_k - 1).bit_length())
    valid_before = torch.nn.functional.pad((keys != KEEP_ALL).cumsum(-1, dtype=torch.int32),
                                           (1, 0))
    # the rule's order: a stable sort keeps keys scoring alike in index order
    perm = keys.sort(dim=-1, descending=True, stable=True).indices.view(num_arrays, array_k)
    work = torch.empty(num_arrays, 2, array_k, dtype=torch.int32, device=device)
    ranks = torch.arange(array_k, dtype=torch.int32, device=device).expand(num_arrays, array_k)
    work[:, 1].scatter_(-1, perm, ranks)
    perm = perm.to(torch.int32)
    zeros = torch.empty(num_arrays, num_levels, array_k + 1, dtype=torch.int32, device=device)
    build = 32 if interpreting() else min(BUILD_BLOCK, next_power_of_2(array_k))
    launch(_rank_levels_kernel, (num_arrays,), work, zeros, array_k, num_levels, BLOCK=build,
           num_warps=1 if interpreting() else 8)
    block_m = 16 if interpreting() else RANGE_BLOCK_M
    row_operands = (placeholder(device), 0) if row_lens is None else \
        (row_lens, row_lens.stride(0) if row_lens.dim() == 2 else 0)
    num_batches = packed.batch if packed is not None else batch
    launch(_range_select_kernel, (cdiv(seqlen_q, block_m), num_batches * heads),
           keys, perm, valid_before, zeros, *row_operands, *packed_operands(packed, device),
           seqused_k if seqused_k is not None else placeholder(device), threshold, last_tie,
           0 if packed is not None else threshold.stride(0), threshold.stride(1),
           topk, seqlen_q, seqlen_k, array_k, heads, int(keys.shape[0] > 1), args.window_left,
           args.window_right, num_levels, 1 << (num_levels - 1), BLOCK_M=block_m,
           HAS_LEFT=args.has_left, HAS_RIGHT=args.has_right, HAS_ROW_LENS=row_lens is not None,
           VARLEN=packed is not None, HAS_SEQUSED=seqused_k is not None,
           num_warps=1 if interpreting() else 4)
