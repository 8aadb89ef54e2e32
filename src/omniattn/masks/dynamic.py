"""Dynamic "keep window" masks of Dynamic Mask Attention: per query row, keep the `window_size`
keys with the largest scores among the keys it may see, ties to the lower key index (the rule of
`attention(topk=...)`, predicate.select_thresholds).

Shapes stay as small as the inputs allow: a per-key score (B, H, 1, Sk) without a row-dependent
mask gives a (B, H, 1, Sk) mask. With a row-dependent mask (causal, padding per row) the result is
(B, H, Sq, Sk) bool (one byte per element: the cost of per-row top-k). On CUDA the rows'
thresholds (kernels/select.py) and one kernel write it, with nothing (Sq, Sk) beside it; elsewhere
it is built in chunks of query rows, with int64 (B, H, chunk, Sk) temporaries.
"""
from __future__ import annotations

import torch

from ..kernels.elementwise import Elementwise
from ..kernels.schedule import KernelArgs
from ..kernels.select import keep_mask, row_thresholds
from ..predicate import RelativePredicate, order_keys, select_thresholds, topk_keep
from ..runtime.switches import interpreting


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


def topk_mask(scores: torch.Tensor, window_size: int, attention_mask: torch.Tensor | None = None,
              chunk_size: int = 1024, causal: bool = False,
              seqlen_q: int | None = None) -> torch.Tensor:
    """Bool keep mask: for each row, the `window_size` largest `scores` among the keys that
    `attention_mask` (and `causal`) allow, ties to the lower key index (all of them when a row
    allows at most `window_size`): the selection `attention(topk=window_size,
    topk_scores=scores)` makes, materialised. A NaN score ranks above +inf.

    scores: (..., Sq|1, Sk) float; attention_mask: bool or additive float, broadcastable to it.
    causal: bottom-right aligned, built per chunk of rows, so no (Sq, Sk) causal mask is ever
    needed; seqlen_q gives the number of rows when neither scores nor the mask has them.
    Returns bool of the broadcast shape of the inputs (with Sq rows when causal). On CUDA (and
    under TRITON_INTERPRET=1), for inputs of at most 4 dims, the row thresholds come from
    kernels/select.py and the mask from one kernel; elsewhere from predicate.select_thresholds,
    `chunk_size` rows at a time. Both keep exactly the same keys.
    """
    if not isinstance(window_size, int) or isinstance(window_size, bool) or window_size <= 0:
        raise ValueError(f"window_size must be a positive int, got {window_size!r}")
    allowed = allowed_keys(attention_mask)
    shape = torch.broadcast_shapes(scores.shape, allowed.shape) if allowed is not None \
        else scores.shape
    if causal:
        rows = seqlen_q if seqlen_q is not None else shape[-2]
        shape = torch.broadcast_shapes(shape, (rows, 1))
    seqlen_k = shape[-1]
    if seqlen_k <= window_size and not causal:
        keep = allowed if allowed is not None else torch.ones((), dtype=torch.bool,
                                                              device=scores.device)
        return keep.expand(shape)
    if (scores.is_cuda or interpreting()) and len(shape) <= 4:
        return _kernel_mask(scores, window_size, allowed, causal, shape)
    def chunk_rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
        return t[..., rows, :] if t.dim() > 1 and t.shape[-2] > 1 else t

    chunks = []
    for start in range(0, shape[-2], chunk_size):
        rows = slice(start, start + chunk_size)
        chunk_scores = chunk_rows(scores, rows)
        chunk_allowed = chunk_rows(allowed, rows) if allowed is not None else None
        chunk_shape = (*shape[:-2], min(chunk_size, shape[-2] - start), seqlen_k)
        if causal:
            q_idx = torch.arange(start, start + chunk_shape[-2], device=scores.device)
            by_causal = RelativePredicate.make(causal=True).visible(q_idx, shape[-2], seqlen_k)
            chunk_allowed = by_causal if chunk_allowed is None else chunk_allowed & by_causal
        keys = order_keys(chunk_scores)
        keys = keys.expand(*keys.shape[:-1], seqlen_k)  # scores shared by the keys
        keep = topk_keep(keys, *select_thresholds(keys, chunk_allowed, window_size))
        if chunk_allowed is not None:
            keep = keep & chunk_allowed
        chunks.append(keep.expand(chunk_shape))
    return torch.cat(chunks, dim=-2)


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


def prepare_dynamic_mask(hidden_states: torch.Tensor, dt_states: torch.Tensor,
                         keep_window_size: int = 2048,
                         attention_mask: torch.Tensor | None = None, causal: bool = False):
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
    to hidden_states' dtype, whose ties could select otherwise).
    """
    attn_bias = dt_states[:, :, None, :].to(hidden_states.dtype)
    allowed = allowed_keys(attention_mask)
    if allowed is not None and allowed.shape[-2] not in (1, hidden_states.shape[2]):
        raise ValueError(f"attention_mask has {allowed.shape[-2]} query rows, expected 1 or "
                         f"Sq = {hidden_states.shape[2]}")
    attn_mask = topk_mask(dt_states[:, :, None, :], keep_window_size, allowed, causal=causal,
                          seqlen_q=hidden_states.shape[2])
    return attn_bias, attn_mask
