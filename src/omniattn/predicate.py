"""Visibility, defined once: which keys a query sees, and the states of whole tiles.

The element predicate is the AND of whichever terms a call gives: the relative terms (causal,
bottom-right aligned, and sliding windows), per-row key lengths, an element mask and a block
mask's own predicate; documents (varlen) are the relative terms on each sequence's own
diagonal. Top-k then keeps, per row, the `topk` visible keys of largest score (ties to the lower
key index), a selection held as one threshold pair per row (`RowThresholds`). A tile is FULL
when every term holds on all of it (no predicate work), HIDDEN when none of its elements is
visible (never loaded), else PARTIAL. The reference, the masks, the
façades and the schedule builders use these definitions; each kernel dialect mirrors them in one
device helper. This module imports nothing from the rest of the package.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

HIDDEN, PARTIAL, FULL = 0, 1, 2  # tile / block states


def check_window(window, name: str = "window") -> None:
    """The window rule of `attention` and the compat façades, under the caller's argument name:
    None, or a (left, right) pair of ints, each >= 0 or -1 (unbounded on that side)."""
    if window is None:
        return
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window)):
        # the types, never the values: a window of tensors must not print them
        got = type(window).__name__ if not isinstance(window, (tuple, list)) else \
            f"{type(window).__name__}[{', '.join(type(w).__name__ for w in window)}]"
        raise TypeError(f"{name} must be a (left, right) pair of ints, got {got}")
    if any(w < -1 for w in window):
        raise ValueError(f"{name} offsets must be >= 0, or -1 for unbounded, got {tuple(window)}")


@dataclass(frozen=True)
class RelativePredicate:
    """Key j visible to query i iff -left <= j - i - (Sk - Sq) <= right; -1 = unbounded."""

    left: int = -1
    right: int = -1

    @staticmethod
    def make(causal: bool = False, window: tuple[int, int] | None = None) -> "RelativePredicate":
        left, right = window if window is not None else (-1, -1)
        if causal:
            right = 0 if right < 0 else min(right, 0)
        return RelativePredicate(left, right)

    def __and__(self, other: "RelativePredicate") -> "RelativePredicate":
        def tighter(a, b):
            return b if a < 0 else a if b < 0 else min(a, b)
        return RelativePredicate(tighter(self.left, other.left), tighter(self.right, other.right))

    def holds(self, q_idx: torch.Tensor, kv_idx: torch.Tensor, seqlen_q: int,
              seqlen_k: int) -> torch.Tensor:
        """Bool, the broadcast of q_idx and kv_idx: whether key kv_idx is visible to query q_idx."""
        rel = kv_idx - q_idx - (seqlen_k - seqlen_q)
        visible = torch.ones_like(rel, dtype=torch.bool)
        if self.right >= 0:
            visible = visible & (rel <= self.right)
        if self.left >= 0:
            visible = visible & (rel >= -self.left)
        return visible

    def visible(self, q_idx: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor | None:
        """Bool [len(q_idx), Sk]: which keys rows q_idx may see; None when all of them."""
        if self.unbounded:
            return None
        k_idx = torch.arange(seqlen_k, device=q_idx.device)
        return self.holds(q_idx[:, None], k_idx[None, :], seqlen_q, seqlen_k)

    @property
    def unbounded(self) -> bool:
        return self.left < 0 and self.right < 0

    def classify(self, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int,
                 device=None, lengths: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor:
        """int8 (n_q_blocks, n_k_blocks): HIDDEN / PARTIAL / FULL of each block under this
        predicate, blocks clipped to (Sq, Sk). O(blocks) work and memory. With `lengths`, the
        (B,) query and key lengths of packed sequences (Sq, Sk their maxima): (B, n_q_blocks,
        n_k_blocks), each sequence on its own diagonal, blocks past its end HIDDEN."""
        n_m, n_n = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
        first_q = (torch.arange(n_m, device=device) * block_m)[None, :, None]
        first_k = (torch.arange(n_n, device=device) * block_n)[None, None, :]
        if lengths is None:
            len_q = torch.full((1, 1, 1), seqlen_q, device=device)
            len_k = torch.full((1, 1, 1), seqlen_k, device=device)
        else:
            len_q, len_k = (n.to(device).long().view(-1, 1, 1) for n in lengths)
        last_q = torch.minimum(first_q + block_m, len_q) - 1
        last_k = torch.minimum(first_k + block_n, len_k) - 1
        offset = len_k - len_q
        # extreme offsets from the diagonal inside each block: [B|1, n_m, n_n]
        rel_min = first_k - last_q - offset
        rel_max = last_k - first_q - offset
        full = torch.ones_like(rel_min, dtype=torch.bool)
        hidden = (first_q >= len_q) | (first_k >= len_k)
        if self.right >= 0:
            full &= rel_max <= self.right
            hidden |= rel_min > self.right
        if self.left >= 0:
            full &= rel_min >= -self.left
            hidden |= rel_max < -self.left
        state = torch.where(hidden, HIDDEN, torch.where(full, FULL, PARTIAL)).to(torch.int8)
        return state if lengths is not None else state[0]


def row_length_keep(row_lens: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """Bool (..., rows, Sk) from int (..., rows) per-row key lengths: row i sees keys [0, len_i)."""
    keys = torch.arange(seqlen_k, device=row_lens.device)
    return keys < row_lens[..., None]


def blocks_from_lists(num_blocks: torch.Tensor, indices: torch.Tensor, n_cols: int,
                      values: torch.Tensor | None = None) -> torch.Tensor:
    """(..., R) counts + (..., R, C) indices -> dense (..., R, n_cols) block picture: bool (True
    where listed), or `values` (..., R, C) scattered to the listed columns (0 elsewhere)."""
    listed = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None].long()
    # unlisted slots scatter into a spare column that is dropped
    target = torch.where(listed, indices.long(), n_cols)
    dtype = torch.bool if values is None else values.dtype
    blocks = torch.zeros(*num_blocks.shape, n_cols + 1, dtype=dtype, device=indices.device)
    if values is None:
        blocks.scatter_(-1, target, True)
    else:
        blocks.scatter_(-1, target, values.expand_as(target))
    return blocks[..., :n_cols]


def lists_from_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dense bool (..., R, C) -> int32 counts (..., R) and indices (..., R, C), listed ones first."""
    num_blocks = blocks.sum(-1, dtype=torch.int32)
    # stable sort of "not listed" puts the listed columns first, in increasing order
    indices = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num_blocks, indices.contiguous()


def transposed_lists(partial: torch.Tensor, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(num, indices) of PARTIAL then of FULL blocks per key column: the lists dK/dV walk."""
    return (*lists_from_blocks(partial.transpose(-1, -2)),
            *lists_from_blocks(full.transpose(-1, -2)))


def common_heads(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two tile-state maps (B|1, Ha, ...) and (B|1, Hb, ...), head counts dividing the query
    heads' (query head h reads head h // (H / Ha)), at lcm(Ha, Hb) heads where neither is 1
    (one head broadcasts): what their AND is computed at, fewer heads than H where both have
    fewer (a per-KV-head mask and a top-k term per KV head stay at Hk)."""
    heads_a, heads_b = a.shape[1], b.shape[1]
    if 1 in (heads_a, heads_b) or heads_a == heads_b:
        return a, b
    heads = math.lcm(heads_a, heads_b)
    return (a if heads_a == heads else a.repeat_interleave(heads // heads_a, dim=1),
            b if heads_b == heads else b.repeat_interleave(heads // heads_b, dim=1))


def coarsen_states(states: torch.Tensor, factor_m: int, factor_n: int) -> torch.Tensor:
    """int8 (..., n_m, n_n) tile states -> states of tiles factor_m x factor_n times larger: FULL
    iff every sub-tile is FULL, HIDDEN iff every one is HIDDEN. Only for element-exact states
    (mask / predicate): a coarse PARTIAL tile re-applies the element terms, not the sub-tile map."""
    if factor_m == factor_n == 1:
        return states
    *lead, n_m, n_n = states.shape
    pad_m, pad_n = -n_m % factor_m, -n_n % factor_n
    # edge padding repeats the last tile: it changes neither the min nor the max
    padded = torch.nn.functional.pad(states.float().reshape(-1, 1, n_m, n_n), (0, pad_n, 0, pad_m),
                                     mode="replicate")
    window = (factor_m, factor_n)
    lowest = -torch.nn.functional.max_pool2d(-padded, window)
    highest = torch.nn.functional.max_pool2d(padded, window)
    coarse = torch.where(highest == HIDDEN, HIDDEN, torch.where(lowest == FULL, FULL, PARTIAL))
    return coarse.to(torch.int8).reshape(*lead, *coarse.shape[-2:])


# Top-k selection: each row keeps the `topk` visible keys of largest score, ties to the lower key
# index. Scores are compared through order keys, int32 whose signed order is the scores' order
# as float32: -0 equals +0, and NaN ranks above +inf (as in torch.sort), so a NaN score is kept
# and shows in the output instead of vanishing from it. The kernels' radix digits are the
# unsigned form, key ^ 0x80000000.
KEEP_ALL = -2 ** 31  # threshold of a row that keeps every visible key: below every order key
EVERY_TIE = 2 ** 31 - 1  # tie bound of a row that drops no key scoring its threshold
NAN_KEY = 2 ** 31 - 1


def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """int32 order keys of float scores (fp16 / bf16 exactly, float64 rounded to float32)."""
    x = scores.float()
    bits = torch.where(x == 0, 0, x.view(torch.int32))  # -0 -> +0
    # negative floats order backwards by magnitude: flip their magnitude bits
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return torch.where(torch.isnan(x), NAN_KEY, keys)


@dataclass(frozen=True)
class RowThresholds:
    """The selection of every row as a threshold pair: key n of a row is kept iff it is visible
    and (key[n] > threshold or (key[n] == threshold and n <= last_tie)), key the order key of
    its score. int32 (B, Hs, Sq|1), Hs in {1, Hk, H} (query head h reads h // (H // Hs)); packed
    sequences: (1, Hs, total_q). A row seeing at most `topk` keys has (KEEP_ALL, EVERY_TIE);
    last_tie is EVERY_TIE wherever no visible key scoring the threshold is dropped."""

    threshold: torch.Tensor
    last_tie: torch.Tensor


def topk_keep(keys: torch.Tensor, threshold: torch.Tensor, last_tie: torch.Tensor) -> torch.Tensor:
    """Bool (..., Sk): which keys the threshold pairs (...) keep, visibility aside; keys (..., Sk)
    order keys (broadcastable but for Sk, which gives the key indices: expand scores shared by
    the keys)."""
    key_idx = torch.arange(keys.shape[-1], device=keys.device)
    threshold, last_tie = threshold[..., None], last_tie[..., None]
    return (keys > threshold) | ((keys == threshold) & (key_idx <= last_tie))


def select_thresholds(keys: torch.Tensor, visible: torch.Tensor | None,
                      topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(threshold, last_tie) int32 (...) of rows whose order keys are keys (..., Sk) and visible
    keys `visible` (bool (..., Sk), broadcastable; None: all), exactly as the rule and
    RowThresholds say. keys are broadcastable but for Sk, which counts the keys (expand scores
    shared by the keys). O(rows x Sk) memory: callers pass chunks of rows."""
    shape = keys.shape if visible is None else torch.broadcast_shapes(keys.shape, visible.shape)
    seqlen_k = shape[-1]
    keep_all = torch.full(shape[:-1], KEEP_ALL, dtype=torch.int32, device=keys.device)
    every_tie = torch.full_like(keep_all, EVERY_TIE)
    if topk >= seqlen_k:
        return keep_all, every_tie
    # one distinct int64 per key in the rule's order: its order key, then the lower index first
    low = 2 ** 32 - 1 - torch.arange(seqlen_k, device=keys.device)
    order = (keys.long() << 32) | low
    if visible is not None:
        order = torch.where(visible, order, torch.iinfo(torch.int64).min)
    order = order.expand(shape)
    kth = order.kthvalue(seqlen_k - topk + 1, dim=-1).values  # the topk-th largest
    threshold = (kth >> 32).to(torch.int32)
    last_tie = (2 ** 32 - 1 - (kth & 0xFFFFFFFF)).to(torch.int32)
    at_least = (order >= (threshold.long() << 32)[..., None]).sum(-1)  # keys >= threshold
    last_tie = torch.where(at_least == topk, EVERY_TIE, last_tie)
    count = seqlen_k if visible is None else visible.expand(shape).sum(-1)
    few = torch.as_tensor(count, device=keys.device) <= topk
    return torch.where(few, keep_all, threshold), torch.where(few, every_tie, last_tie)


def selection_heads(num_heads: int, num_heads_k: int, *head_counts: int) -> int:
    """The heads of a selection whose inputs have these head counts (each 1, Hk or H): the
    largest, so that inputs shared by a group of query heads keep one selection for it."""
    if any(n == num_heads for n in head_counts if n > 1):
        return num_heads
    return num_heads_k if any(n > 1 for n in head_counts) else 1
