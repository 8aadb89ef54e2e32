"""The work `omniattn bench` counts: (query, key) pairs inside the tiles omniattn's forward
kernel computes (`computed_pairs` for dense, causal and windows, `block_mask_pairs` for block
masks, `element_mask_pairs` for element masks, `row_lengths_pairs` for per-row key lengths,
`selection_pairs` for top-k selected inside attention), so TFLOP/s compares providers on equal
work, and the exact visible pairs (`visible_pairs`) beside them."""
from __future__ import annotations

import torch
import triton

import omniattn
from omniattn.kernels.elementwise import Elementwise, TopkTerm, topk_tile_states
from omniattn.kernels.schedule import KernelArgs
from omniattn.kernels.select import threshold_pairs
from omniattn.plan import groups_rows_by_length
from omniattn.predicate import HIDDEN, RelativePredicate

from .workloads import ExtraInputs, Workload

# backward = 2.5x forward FLOPs (FlashAttention's convention: 5 matmuls against 2)
_FWD_BWD_FLOP_FACTOR = 3.5


def tile_extents(length: int, block: int, count: int, device=None) -> torch.Tensor:
    """The length each of `count` tiles of `block` covers of `length` (the last may be short)."""
    return (length - torch.arange(count, device=device) * block).clamp(max=block)


def computed_pairs(seqlen_q: int, seqlen_k: int, causal: bool, block_m: int, block_n: int,
                   window: tuple[int, int] | None = None) -> int:
    """(query, key) pairs inside the key tiles the forward kernel visits, rows clipped to Sq and
    keys to Sk. Causal and windows (left, right; -1 unbounded) are bottom-right aligned: query
    tile m visits the key tiles from the one holding its first row's first key to the one
    holding its last row's last key (causal: n * block_n <= min((m + 1) * block_m, Sq) - 1 +
    Sk - Sq)."""
    predicate = RelativePredicate.make(causal, window)
    left, right = predicate.left, predicate.right
    diag = seqlen_k - seqlen_q
    pairs = 0
    for start_m in range(0, seqlen_q, block_m):
        end_m = min(start_m + block_m, seqlen_q)
        key_lo = max(start_m + diag - left, 0) if left >= 0 else 0  # first row's first key
        key_hi = min(max(end_m + diag + right, 0), seqlen_k) if right >= 0 else seqlen_k
        first = key_lo // block_n * block_n
        end = min(triton.cdiv(key_hi, block_n) * block_n, seqlen_k)
        pairs += (end_m - start_m) * max(end - first, 0)
    return pairs


def block_mask_pairs(block_mask: omniattn.BlockMask) -> float:
    """(query, key) pairs inside the listed blocks, each block clipped to (Sq, Sk): the tiles
    the kernel computes. Per (batch, head), averaged over the mask's (B|1, H|1) entries."""
    block_q, block_k = block_mask.block_size
    seqlen_q, seqlen_k = block_mask.seq_lengths
    n_q, n_k = block_mask.n_blocks
    rows, cols = tile_extents(seqlen_q, block_q, n_q), tile_extents(seqlen_k, block_k, n_k)
    listed = (block_mask.states != 0).cpu().to(torch.int64)  # (B|1, H|1, n_q, n_k)
    pairs = (listed * rows[:, None] * cols[None, :]).sum().item()
    return pairs / (listed.shape[0] * listed.shape[1])


def element_mask_pairs(keep: torch.Tensor, causal: bool, block_m: int,
                       block_n: int) -> tuple[float, float, float]:
    """(pairs, visible, active_tile_fraction) of an element mask: the (query, key) pairs inside
    the (block_m x block_n) tiles holding at least one visible element (kept and, if causal,
    not hidden by causal: the tiles the forward kernel visits), each tile clipped to (Sq, Sk);
    the visible elements; the fraction of all tiles so visited. Pairs per (batch, head),
    averaged over the mask's leading entries. Counted on the host with tensor ops."""
    seqlen_q, seqlen_k = keep.shape[-2:]
    visible = keep.cpu()
    if causal:  # bottom-right aligned
        q_idx, k_idx = torch.arange(seqlen_q)[:, None], torch.arange(seqlen_k)
        visible = visible & (k_idx <= q_idx + seqlen_k - seqlen_q)
    n_q, n_k = triton.cdiv(seqlen_q, block_m), triton.cdiv(seqlen_k, block_n)
    # whole tiles: the padding is hidden
    tiles = torch.nn.functional.pad(visible, (0, n_k * block_n - seqlen_k,
                                              0, n_q * block_m - seqlen_q))
    tiles = tiles.unflatten(-1, (n_k, block_n)).unflatten(-3, (n_q, block_m))
    active = tiles.any(dim=(-3, -1))  # (..., n_q, n_k)
    rows, cols = tile_extents(seqlen_q, block_m, n_q), tile_extents(seqlen_k, block_n, n_k)
    entries = active[..., 0, 0].numel()
    pairs = (active * rows[:, None] * cols[None, :]).sum().item() / entries
    # count_nonzero: a bool sum() widens every element first (seconds at 4k)
    exact = visible.count_nonzero().item() / entries
    return pairs, exact, active.count_nonzero().item() / active.numel()


def row_lengths_pairs(row_lens: torch.Tensor, seqlen_k: int, block_m: int, block_n: int,
                      grouped: bool = False) -> tuple[float, float, float]:
    """(pairs, visible, active_tile_fraction) of per-row key lengths (B, Sq), row i of batch b
    seeing keys [0, min(lengths[b, i], Sk)): the (query, key) pairs inside the (block_m x
    block_n) tiles holding at least one visible element (query tile m visits the key tiles
    below cdiv(its longest row, block_n): the tiles the forward kernel visits), each tile
    clipped to (Sq, Sk); the visible elements; the fraction of all tiles so visited. grouped:
    the rows are tiled longest first, as omniattn.attention runs lengths alone (see
    groups_rows_by_length). Pairs per batch (heads share the lengths), averaged over the
    batches. O(B * Sq) memory, on the lengths' device: no (Sq, Sk) picture."""
    lens = row_lens.to(torch.int64).clamp(0, seqlen_k)
    if grouped:
        lens = lens.sort(dim=-1, descending=True).values
    batch, seqlen_q = lens.shape
    n_q, n_k = triton.cdiv(seqlen_q, block_m), triton.cdiv(seqlen_k, block_n)
    # padding rows see no key
    longest = torch.nn.functional.pad(lens, (0, n_q * block_m - seqlen_q)).view(
        batch, n_q, block_m).amax(-1)  # (B, n_q)
    key_tiles = (longest + block_n - 1) // block_n  # visited by each query tile
    rows = tile_extents(seqlen_q, block_m, n_q, lens.device)
    pairs = (rows * (key_tiles * block_n).clamp(max=seqlen_k)).sum().item() / batch
    exact = lens.sum().item() / batch
    return pairs, exact, key_tiles.sum().item() / (batch * n_q * n_k)


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool,
                  window: tuple[int, int] | None = None) -> int:
    """(query, key) pairs the mask lets through: Sq * Sk dense, the bottom-right triangle causal,
    the band of a window (left, right; -1 unbounded) about the bottom-right diagonal."""
    predicate = RelativePredicate.make(causal, window)
    left, right = predicate.left, predicate.right
    diag = seqlen_k - seqlen_q
    pairs = 0
    for i in range(seqlen_q):
        first = max(i + diag - left, 0) if left >= 0 else 0
        end = min(max(i + diag + right + 1, 0), seqlen_k) if right >= 0 else seqlen_k
        pairs += max(end - first, 0)
    return pairs


def selection_pairs(workload: Workload, extra: ExtraInputs, tiles: tuple[int, int] | None
                    ) -> tuple[float, float, float | None]:
    """(pairs in the tiles the forward walks, kept pairs, walked fraction of the causal tiles)
    per (batch, head) of a workload selecting inside attention (causal, the key bias its
    scores): row i keeps min(i + 1, topk) keys; the kernels walk the causal tiles that the
    top-k tile states do not hide (`topk_tile_states`, from the rows' threshold pairs, computed
    here outside any timed call). tiles None (the reference, which has none): the kept pairs,
    counted one by one."""
    seqlen, topk = workload.seqlen_q, workload.topk
    kept = sum(min(i + 1, topk) for i in range(seqlen))
    if tiles is None:
        return kept, kept, None
    block_m, block_n = tiles
    scores = Elementwise.of(extra.bias.detach(), workload.heads)
    args = KernelArgs.make(workload.head_dim, True, None, None, 0.0)
    pairs = threshold_pairs(topk, scores, args, workload.batch, seqlen, seqlen, workload.heads,
                            workload.heads_k)
    states = topk_tile_states(TopkTerm(scores, pairs), seqlen, seqlen, block_m, block_n).cpu()
    n_q, n_k = triton.cdiv(seqlen, block_m), triton.cdiv(seqlen, block_n)
    rows, cols = tile_extents(seqlen, block_m, n_q), tile_extents(seqlen, block_n, n_k)
    causal = torch.arange(n_k)[None, :] * block_n <= torch.arange(n_q)[:, None] * block_m \
        + block_m - 1
    walked = (states != HIDDEN) & causal  # (B|1, Hs, n_q, n_k)
    entries = walked.shape[0] * walked.shape[1]
    computed = (walked * rows[:, None] * cols[None, :]).sum().item() / entries
    return computed, kept, walked.count_nonzero().item() / (causal.count_nonzero().item()
                                                             * entries)


def flop_count(workload: Workload, pairs: int, mode: str) -> float:
    # 2 matmuls (QK^T, PV) of 2 FLOPs per multiply-add
    fwd = 4 * workload.batch * workload.heads * workload.head_dim * pairs
    return fwd * (_FWD_BWD_FLOP_FACTOR if mode == "fwd+bwd" else 1.0)


def workload_pairs(workload: Workload, extra: ExtraInputs,
                   tiles: tuple[int, int] | None) -> tuple[float, float, float | None]:
    """(pairs in the tiles omniattn's forward kernel computes, visible pairs, active tile
    fraction) per (batch, head); the fraction is for element masks and row lengths only (None
    otherwise). tiles: the forward kernel's (block_m, block_n), as omniattn plans the workload
    (`forward_plan`); None where the PyTorch reference runs it (CPU tensors without the
    interpreter), which has no tiles: its pairs are counted one by one (1 x 1 tiles), the
    visible ones."""
    block_m, block_n = tiles or (1, 1)
    if extra.block_mask is not None:
        pairs = block_mask_pairs(extra.block_mask)
        return pairs, pairs, None
    if extra.keep is not None:
        return element_mask_pairs(extra.keep, workload.causal, block_m, block_n)
    if workload.select:
        return selection_pairs(workload, extra, tiles)
    if extra.row_lens is not None:
        grouped = not workload.causal and groups_rows_by_length(
            workload.seqlen_q, workload.head_dim, workload.dtype)
        return row_lengths_pairs(extra.row_lens, workload.seqlen_k, block_m, block_n, grouped)
    if extra.cu_seqlens is not None:  # each document alone
        lengths = extra.cu_seqlens.diff().tolist()
        return (sum(computed_pairs(n, n, workload.causal, block_m, block_n) for n in lengths),
                sum(visible_pairs(n, n, workload.causal) for n in lengths), None)
    pairs = computed_pairs(workload.seqlen_q, workload.seqlen_k, workload.causal, block_m,
                           block_n, workload.window)
    exact = visible_pairs(workload.seqlen_q, workload.seqlen_k, workload.causal, workload.window)
    return pairs, exact, None
