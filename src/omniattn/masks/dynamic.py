"""Dynamic "keep window" masks of Dynamic Mask Attention: per query row, keep the `window_size`
keys with the largest scores among the keys it may see, ties to the lower key index (the rule of
`attention(topk=...)`, predicate.select_thresholds).

Shapes stay as small as the inputs allow: a per-key score (B, H, 1, Sk) without a row-dependent
mask gives a (B, H, 1, Sk) mask. With a row-dependent mask (causal, padding per row) the result is
(B, H, Sq, Sk) bool (one byte per element: the cost of per-row top-k). On CUDA the rows'
thresholds (kernels/select.py) and one kernel write it, with nothing (Sq, Sk) beside it; elsewhere
it is built in chunks of query rows, with int64 (B, H, chunk, Sk) temporaries.

Without materialising: `keep_window_arguments` gives attention's own arguments for the same
selection (topk / topk_scores; with `block_size`, a key-wise mask or a `topk_block_mask`), which
`nn.DynamicMaskAttention` and the transformers integration use.
"""
from __future__ import annotations

import math

import torch

from ..kernels.elementwise import Elementwise
from ..kernels.schedule import KernelArgs
from ..kernels.select import keep_mask, row_thresholds
from ..predicate import (FULL, HIDDEN, PARTIAL, RelativePredicate, order_keys, select_thresholds,
                         topk_keep)
from ..runtime.switches import interpreting
from .block_mask import BlockMask
from .evaluate import predicate_blocks


def allowed_keys(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Bool keep mask from a bool mask (True = keep) or an additive float mask (0 = keep,
    negative = masked: transformers' 4-D convention)."""
    if attention_mask is None or attention_mask.dtype == torch.bool:
        return attention_mask
    if not attention_mask.is_floating_point():
        raise TypeError(f"attention_mask must be bool (True = keep) or an additive float mask, got "
                        f"{attention_mask.dtype}")
    if (attention_mask > 0).any():
        raise ValueError("an additive float attention_mask must be 0 where kept and negative where "
                         "masked; pass a bool mask (True = keep) for 0/1 masks")
    return attention_mask == 0


def _check_size(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _selection_shape(scores: torch.Tensor, allowed: torch.Tensor | None, causal: bool,
                     seqlen_q: int | None) -> torch.Size:
    """The broadcast shape of scores and mask, with Sq rows when causal (rows then differ)."""
    shape = torch.broadcast_shapes(scores.shape, allowed.shape) if allowed is not None \
        else scores.shape
    if causal:
        shape = torch.broadcast_shapes(shape, (seqlen_q if seqlen_q is not None else shape[-2], 1))
    return shape


def _rows_of(t: torch.Tensor, rows: slice) -> torch.Tensor:
    return t[..., rows, :] if t.dim() > 1 and t.shape[-2] > 1 else t


def _visible_rows(allowed: torch.Tensor | None, causal: bool, shape: torch.Size, rows: slice,
                  device) -> torch.Tensor | None:
    """Bool, broadcastable to rows `rows` of `shape`: the keys the mask and causal let them see
    (None: all). Causal is built for these rows only."""
    visible = _rows_of(allowed, rows) if allowed is not None else None
    if causal:
        q_idx = torch.arange(shape[-2], device=device)[rows]
        by_causal = RelativePredicate.make(causal=True).visible(q_idx, shape[-2], shape[-1])
        visible = by_causal if visible is None else visible & by_causal
    return visible


def _selected_rows(scores: torch.Tensor, window_size: int, allowed: torch.Tensor | None,
                   causal: bool, shape: torch.Size, chunk_size: int):
    """Yields, `chunk_size` rows at a time, bool (*shape[:-2], rows, Sk): the keys each row
    keeps (predicate.select_thresholds, visible keys only), with int64 (rows, Sk) temporaries."""
    seqlen_k = shape[-1]
    for start in range(0, shape[-2], chunk_size):
        rows = slice(start, start + chunk_size)
        visible = _visible_rows(allowed, causal, shape, rows, scores.device)
        keys = order_keys(_rows_of(scores, rows))
        keys = keys.expand(*keys.shape[:-1], seqlen_k)  # scores shared by the keys
        keep = topk_keep(keys, *select_thresholds(keys, visible, window_size))
        if visible is not None:
            keep = keep & visible
        yield keep.expand(*shape[:-2], min(chunk_size, shape[-2] - start), seqlen_k)


def _kept_blocks(keep: torch.Tensor, block_size: int) -> torch.Tensor:
    """bool (..., Sk) -> (..., ceil(Sk / block_size)): whether more than half of each block of
    keys is kept, the last block counting its own length (the original's `block_smooth`)."""
    seqlen_k = keep.shape[-1]
    n_blocks = -(-seqlen_k // block_size)
    padded = torch.nn.functional.pad(keep, (0, n_blocks * block_size - seqlen_k))
    counts = padded.reshape(*keep.shape[:-1], n_blocks, block_size).sum(-1)
    lengths = torch.full((n_blocks,), block_size, device=keep.device)
    lengths[-1] = seqlen_k - (n_blocks - 1) * block_size
    return 2 * counts > lengths


def topk_mask(scores: torch.Tensor, window_size: int, attention_mask: torch.Tensor | None = None,
              chunk_size: int = 1024, causal: bool = False, seqlen_q: int | None = None,
              block_size: int | None = None) -> torch.Tensor:
    """Bool keep mask: for each row, the `window_size` largest `scores` among the keys that
    `attention_mask` (and `causal`) allow, ties to the lower key index (all of them when a row
    allows at most `window_size`): the selection `attention(topk=window_size,
    topk_scores=scores)` makes, materialised. A NaN score ranks above +inf.

    scores: (..., Sq|1, Sk) float; attention_mask: bool or additive float, broadcastable to it.
    causal: bottom-right aligned, built per chunk of rows, so no (Sq, Sk) causal mask is ever
    needed; seqlen_q gives the number of rows when neither scores nor the mask has them.
    block_size (the original's `create_mask(block_size=)`): each row's selection is then
    smoothed over blocks of `block_size` keys (key 0 onwards, the last block the remainder): a
    block is kept whole when more than half of its length was selected, dropped whole otherwise;
    the result is ANDed with the mask and causal (which the original leaves to the kernel). The
    half counts the block's length, not its visible keys: a block that a row sees at most half
    of (with causal, the block of its own diagonal) is dropped.
    Returns bool of the broadcast shape of the inputs (with Sq rows when causal). On CUDA (and
    under TRITON_INTERPRET=1), for inputs of at most 4 dims, the row thresholds come from
    kernels/select.py and the mask from one kernel; elsewhere from predicate.select_thresholds,
    `chunk_size` rows at a time. Both keep exactly the same keys.
    """
    _check_size("window_size", window_size)
    if block_size is not None:
        _check_size("block_size", block_size)
    allowed = allowed_keys(attention_mask)
    shape = _selection_shape(scores, allowed, causal, seqlen_q)
    if shape[-1] <= window_size and not causal:
        keep = allowed if allowed is not None else torch.ones((), dtype=torch.bool,
                                                              device=scores.device)
        keep = keep.expand(shape)
    elif (scores.is_cuda or interpreting()) and len(shape) <= 4:
        keep = _kernel_mask(scores, window_size, allowed, causal, shape)
    else:
        keep = torch.cat(list(_selected_rows(scores, window_size, allowed, causal, shape,
                                             chunk_size)), dim=-2)
    if block_size is None or block_size == 1:  # blocks of one key keep what top-k keeps
        return keep
    smoothed = []
    for start in range(0, shape[-2], chunk_size):
        rows = slice(start, start + chunk_size)
        kept = _kept_blocks(keep[..., rows, :], block_size)
        kept = kept.repeat_interleave(block_size, dim=-1)[..., :shape[-1]]
        visible = _visible_rows(allowed, causal, shape, rows, scores.device)
        smoothed.append(kept if visible is None else kept & visible)
    return torch.cat(smoothed, dim=-2)


def _kernel_mask(scores: torch.Tensor, window_size: int, allowed: torch.Tensor | None,
                 causal: bool, shape: torch.Size) -> torch.Tensor:
    """topk_mask on the GPU: the inputs as (B|1, H|1, Sq|1, Sk|1), thresholds, then the mask."""
    def four_d(t):
        return t[(None,) * (4 - t.dim())]

    batch, heads, seqlen_q, seqlen_k = (1,) * (4 - len(shape)) + tuple(shape)
    scores = Elementwise.of(four_d(scores), heads)
    mask = Elementwise.of(four_d(allowed), heads) if allowed is not None else None
    args = KernelArgs.make(1, causal, None, None, 0.0)
    pairs = row_thresholds(window_size, scores, args, batch, seqlen_q, seqlen_k, heads, heads,
                           mask=mask)
    return keep_mask(pairs, scores, args, batch, seqlen_q, seqlen_k, heads, mask).view(shape)


def _block_states(kept: torch.Tensor, block_q: int, blocks_per_key_block: int) -> torch.Tensor:
    """int8 (B, H, n_q_blocks, n_k_blocks) HIDDEN / PARTIAL / FULL of a row-by-smoothing-block
    selection `kept` (B, H, Sq, n_smoothing_blocks) at BlockMask blocks of `block_q` rows and
    `blocks_per_key_block` smoothing blocks: exact where all or none of a block is kept."""
    batch, heads, seqlen_q, n_blocks = kept.shape
    n_q = -(-seqlen_q // block_q)
    n_k = -(-n_blocks // blocks_per_key_block)
    # the last row / block repeated into the padding: it lies past Sq / Sk, where nothing is read
    kept = torch.cat([kept, kept[..., -1:, :].expand(batch, heads, n_q * block_q - seqlen_q,
                                                      n_blocks)], dim=-2)
    kept = torch.cat([kept, kept[..., -1:].expand(batch, heads, n_q * block_q,
                                                   n_k * blocks_per_key_block - n_blocks)], -1)
    grouped = kept.view(batch, heads, n_q, block_q, n_k, blocks_per_key_block)
    every, some = grouped.all(5).all(3), grouped.any(5).any(3)
    return torch.where(every, FULL, torch.where(some, PARTIAL, HIDDEN)).to(torch.int8)


def topk_block_mask(scores: torch.Tensor, window_size: int, block_size: int,
                    attention_mask: torch.Tensor | None = None, causal: bool = False,
                    seqlen_q: int | None = None, num_heads: int | None = None,
                    chunk_size: int = 256) -> BlockMask:
    """The block selection of `topk_mask(..., block_size=block_size)` as a BlockMask, without an
    (Sq, Sk) tensor: `attention(q, k, v, causal=causal, attn_mask=attention_mask,
    block_mask=topk_block_mask(...))` sees exactly the keys that
    `attention(q, k, v, attn_mask=topk_mask(scores, window_size, attention_mask, causal=causal,
    block_size=block_size))` sees. The BlockMask holds the smoothed selection only: pass the
    same causal and attention_mask to attention, which ANDs them.

    scores: (B|1, Hs, Sq|1, Sk) float, Hs in {1, Hk, H}; attention_mask: bool or additive float,
    broadcastable to it; seqlen_q: the rows when neither input has them; num_heads: the query
    heads H, to which a selection over Hk heads is spread (a BlockMask has 1 or H heads).
    Rows select `chunk_size` at a time (int64 (B, Hs, chunk, Sk) temporaries, as `topk_mask`'s
    and the reference's chunks); what is kept is one bool per row and smoothing block,
    (B|1, Hs, Sq, ceil(Sk / block_size)), turned into BlockMask blocks of (16, lcm(block_size,
    16)): FULL where all 16 rows keep all its smoothing blocks, hidden where none does, PARTIAL
    with an element bitmap (stored once per distinct bitmap) otherwise.
    """
    _check_size("window_size", window_size)
    _check_size("block_size", block_size)
    allowed = allowed_keys(attention_mask)
    shape = _selection_shape(scores, allowed, False, None)
    if len(shape) != 4:
        raise ValueError(f"scores and attention_mask must broadcast to 4-D (B|1, Hs, Sq|1, Sk), "
                         f"got shape {tuple(shape)}")
    batch, heads, rows, seqlen_k = shape
    seqlen_q = rows if seqlen_q is None else seqlen_q
    if rows not in (1, seqlen_q):
        raise ValueError(f"scores and attention_mask have {rows} query rows, expected 1 or "
                         f"seqlen_q = {seqlen_q}")
    if causal:  # every row selects among its own keys
        shape = torch.Size((batch, heads, seqlen_q, seqlen_k))
    kept = torch.cat([_kept_blocks(keep, block_size) for keep in _selected_rows(
        scores, window_size, allowed, causal, shape, chunk_size)], dim=-2)
    kept = kept.expand(batch, heads, seqlen_q, kept.shape[-1])
    block_k = math.lcm(block_size, 16)
    hint = _block_states(kept, 16, block_k // block_size)

    def mask_mod(b, h, q_idx, kv_idx):
        return kept[b, h, q_idx, kv_idx // block_size]

    states, bits, slots = predicate_blocks(mask_mod, batch, heads, seqlen_q, seqlen_k,
                                           (16, block_k), kept.device, block_states=hint)
    if num_heads is not None and heads not in (1, num_heads):
        if num_heads % heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of the selection's "
                             f"heads ({heads}, of scores and attention_mask)")
        # query head h reads the selection of head h // (num_heads / heads)
        states = states.repeat_interleave(num_heads // heads, dim=1)
        slots = None if slots is None else slots.repeat_interleave(num_heads // heads, dim=1)
    return BlockMask.from_states(states, (16, block_k), (seqlen_q, seqlen_k),
                                 element_bits=bits, element_slots=slots)


def keep_window_arguments(scores: torch.Tensor, window_size: int,
                          attention_mask: torch.Tensor | None = None, *, causal: bool = False,
                          seqlen_q: int, num_heads: int,
                          block_size: int | None = None) -> dict:
    """The keyword arguments of `attention` that apply Dynamic Mask Attention's keep window
    without an (Sq, Sk) tensor: `attention(q, k, v, causal=causal, attn_bias=...,
    **keep_window_arguments(...))` sees exactly the keys that `attn_mask=topk_mask(scores,
    window_size, attention_mask, causal=causal, block_size=block_size)` would let it see.

    scores: (B|1, Hs, Sq|1, Sk) float, Hs in {1, Hk, H}; attention_mask: bool or additive float
    broadcastable to (B|1, Hm, Sq|1, Sk). Returns attn_mask (the bool mask), and: without
    block_size, topk / topk_scores (attention's own selection; none when Sk <= window_size,
    where every row keeps every key it sees); with block_size > 1, a key-wise attn_mask
    (B|1, Hs, 1, Sk) when every row selects alike (no causal, scores and mask without rows),
    otherwise a `topk_block_mask` block_mask."""
    _check_size("window_size", window_size)
    if block_size is not None:
        _check_size("block_size", block_size)
    scores = scores.detach()  # they select only
    allowed = allowed_keys(attention_mask)
    if block_size is None or block_size == 1:  # blocks of one key keep what top-k keeps
        selects = scores.shape[-1] > window_size
        return {"attn_mask": allowed, "topk": window_size if selects else None,
                "topk_scores": scores if selects else None}
    if not causal and scores.shape[-2] == 1 and (allowed is None or allowed.shape[-2] == 1):
        return {"attn_mask": topk_mask(scores, window_size, allowed, block_size=block_size)}
    return {"attn_mask": allowed,
            "block_mask": topk_block_mask(scores, window_size, block_size, allowed,
                                          causal=causal, seqlen_q=seqlen_q,
                                          num_heads=num_heads)}


def prepare_dynamic_mask(hidden_states: torch.Tensor, dt_states: torch.Tensor,
                         keep_window_size: int = 2048,
                         attention_mask: torch.Tensor | None = None, causal: bool = False,
                         block_size: int | None = None):
    """Bias and keep mask of Dynamic Mask Attention from dt states.

    hidden_states: the query states (B, H, Sq, D) (their dtype and Sq are used);
    dt_states: (B, Hk, Sk) per-key scores; attention_mask: bool (True = keep) or additive float,
    broadcastable to (B, Hk, Sq, Sk); causal (an addition to the original): bottom-right aligned
    causal applied row by row without materialising a causal mask.
    Returns (attn_bias (B, Hk, 1, Sk) in hidden_states' dtype, attn_mask bool (B, Hk, 1|Sq, Sk)):
    each row keeps its `keep_window_size` largest dt states among the keys attention_mask allows
    (all allowed keys when Sk <= keep_window_size). Unlike the original, the bias is not filled
    with the dtype's minimum where masked: the bool mask carries that, and omniattn skips the
    tiles it hides. The mask keeps what `attention(..., topk=keep_window_size,
    topk_scores=dt_states[:, :, None, :])` keeps (the dt states as given, not the bias rounded
    to hidden_states' dtype, whose ties could select otherwise). block_size: the selection
    smoothed over blocks of keys, as `topk_mask` says.
    """
    attn_bias = dt_states[:, :, None, :].to(hidden_states.dtype)
    allowed = allowed_keys(attention_mask)
    if allowed is not None and allowed.shape[-2] not in (1, hidden_states.shape[2]):
        raise ValueError(f"attention_mask has {allowed.shape[-2]} query rows, expected 1 or "
                         f"Sq = {hidden_states.shape[2]}")
    attn_mask = topk_mask(dt_states[:, :, None, :], keep_window_size, allowed, causal=causal,
                          seqlen_q=hidden_states.shape[2], block_size=block_size)
    return attn_bias, attn_mask
