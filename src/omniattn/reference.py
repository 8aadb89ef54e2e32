"""Exact attention in plain PyTorch: the correctness oracle and the CPU backend.

It implements every semantic of the public API (docs/design.md): bottom-right aligned causal,
sliding window, element mask, additive bias (broadcast, never expanded), per-row key lengths, varlen,
softcap, GQA, LSE, dropout (from torch.rand), top-k selection (each chunk of rows selects its own
keys: `topk_thresholds` gives the same pairs whole) and rows that see no key (output 0, lse -inf,
zero gradients).

A NaN in q, k, v or attn_bias reaches exactly the rows that see it: their outputs (and lse,
unless the NaN is in v) and the gradients they reach are NaN; masked elements and the other rows
are as without it.

Queries are processed in chunks so memory stays O(chunk * Sk). When gradients are needed each
chunk runs under activation checkpointing and builds its masks inside from O(chunk)-sized
inputs, so what the forward keeps for the backward is O(B * H * Sq * D) besides the inputs, and
the backward recomputes each chunk in O(chunk * Sk). `reference_backward` gives the gradients
from an output and lse given (those of a larger softmax this call is part of) the same way.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from .predicate import (RelativePredicate, RowThresholds, order_keys, row_length_keep,
                        select_thresholds, selection_heads, topk_keep)

__all__ = ["attention_reference", "paged_reference", "reference_backward", "topk_thresholds"]


def _as_5d(t: torch.Tensor, num_heads_k: int, group: int) -> torch.Tensor:
    """View a (B|1, Hm|1, Sq|1, Sk|1) mask/bias as (B|1, Hk|1, G|1, Sq|1, Sk|1) without copying."""
    b, hm, sq, sk = t.shape
    if hm == 1:
        return t.view(b, 1, 1, sq, sk)
    if hm == num_heads_k * group and group > 1:
        return t.view(b, num_heads_k, group, sq, sk)
    return t.view(b, hm, 1, sq, sk)


@dataclass(frozen=True)
class _KeyVisibility:
    """What decides which keys a row sees, apart from the per-row tensors each chunk is given:
    the causal/window predicate, the block mask, the heads layout of the masks and top-k."""

    predicate: RelativePredicate
    block_mask: object
    seqlen_q: int
    seqlen_k: int
    num_heads_k: int
    group: int
    topk: int | None = None

    def keep(self, first_row: int, num_rows: int, mask: torch.Tensor | None,
             row_lens: torch.Tensor | None, device: torch.device,
             scores: torch.Tensor | None = None) -> torch.Tensor | None:
        """Bool, broadcastable to [B, Hk, G, c, Sk]: which keys rows first_row..first_row + c
        see; None when all of them. mask: the chunk's rows of the (B|1, Hk|1, G|1, c|1, Sk|1)
        element mask (bool, or numeric: nonzero = keep); row_lens: (B, c) key lengths; scores:
        the chunk's rows of the top-k scores, laid out like mask (with topk)."""
        q_idx = torch.arange(first_row, first_row + num_rows, device=device)
        keep = self.predicate.visible(q_idx, self.seqlen_q, self.seqlen_k)
        keep = keep.view(1, 1, 1, num_rows, self.seqlen_k) if keep is not None else None
        if mask is not None:
            by_mask = mask if mask.dtype == torch.bool else mask != 0
            keep = by_mask if keep is None else keep & by_mask
        if self.block_mask is not None:
            by_blocks = self.block_mask.visible(q_idx, self.seqlen_q, self.seqlen_k).to(device)
            by_blocks = _as_5d(by_blocks, self.num_heads_k, self.group)
            keep = by_blocks if keep is None else keep & by_blocks
        if row_lens is not None:
            by_len = row_length_keep(row_lens, self.seqlen_k).unsqueeze(1).unsqueeze(1)
            keep = by_len if keep is None else keep & by_len
        if self.topk is not None:
            keys = order_keys(scores)
            keys = keys.expand(*keys.shape[:-1], self.seqlen_k)  # scores shared by the keys
            threshold, last_tie = select_thresholds(keys, keep, self.topk)
            by_topk = topk_keep(keys, threshold, last_tie)
            keep = by_topk if keep is None else keep & by_topk
        return keep


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [B, Hk, G, c, D] @ k [B, Hk, 1, Sk, D]^T, where an inf/NaN in query row i or key j
    reaches score (i, j) only, in the backward too: the plain product's gradients would carry
    0 * NaN (a masked score's zero gradient times the NaN) from a key to the rows that don't see
    it, and from a row to the keys it doesn't see. The inf/NaN elements get zero gradients."""
    q_finite, k_finite = torch.isfinite(q), torch.isfinite(k)
    if q_finite.all() and k_finite.all():
        return torch.matmul(q, k.transpose(-1, -2))
    q_clean, k_clean = torch.where(q_finite, q, 0.0), torch.where(k_finite, k, 0.0)
    clean = torch.matmul(q_clean, k_clean.transpose(-1, -2))
    with torch.no_grad():
        plain = torch.matmul(q, k.transpose(-1, -2))
        reached = ~q_finite.all(-1, keepdim=True) | ~k_finite.all(-1).unsqueeze(-2)
        # the plain product's values where they are not finite, with the gradients of clean
        correction = torch.where(reached, plain - clean, 0.0)
    return clean + correction


def _weighted_values(probs: torch.Tensor, v: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """probs [B, Hk, G, c, Sk] @ v [B, Hk, 1, Sk, D], where a key's inf/NaN values reach only
    the rows that see it (seen, like probs; probs are 0 where not seen): the plain product also
    adds 0 * NaN to the rows that don't. Its gradient puts the NaN in that key's column of the
    gradient of probs, which the caller keeps to the rows that see the key."""
    finite = torch.isfinite(v)
    reached = torch.matmul(seen.to(v.dtype), (~finite).to(v.dtype)) > 0
    return torch.where(reached, torch.matmul(probs, v),
                       torch.matmul(probs, torch.where(finite, v, 0.0)))


def _chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    row_lens: torch.Tensor | None,
    topk_scores: torch.Tensor | None,
    first_row: int,
    visibility: _KeyVisibility,
    scale: float,
    softcap: float,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows first_row.. of the output: q [B, Hk, G, c, D], k/v [B, Hk, 1, Sk, D]; bias and mask
    the chunk's rows of the user's (B|1, Hk|1, G|1, c|1, Sk|1) views (topk_scores too), row_lens
    (B, c). Returns
    out [B, Hk, G, c, D] and lse [B, Hk, G, c]. The keep mask is built here, from these
    O(c)-sized inputs, so that under checkpointing the backward recomputes it chunk by chunk
    instead of keeping a (c, Sk) mask of every chunk.

    A NaN in q, k, v or the bias reaches exactly the rows that see it (a row sees the keys whose
    score is not -inf), in the output and in the gradients."""
    keep = visibility.keep(first_row, q.shape[-2], mask, row_lens, q.device, topk_scores)
    scores = _scores(q, k) * scale  # [B, Hk, G, c, Sk]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hk, G, c]
    # rows that see no key (lse -inf) subtract 0: probabilities and gradients 0, not NaN
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))
    values_finite = bool(torch.isfinite(v).all())
    seen = None
    if not values_finite or torch.isnan(lse).any():
        # a row whose lse is NaN has NaN probabilities where it sees no key too, and a NaN
        # value puts NaN in its key's column of the gradient of probs: both stay where seen
        seen = scores != float("-inf")
        probs = torch.where(seen, probs, 0.0)
    if dropout_p > 0:
        # checkpoint's recomputation replays the RNG state, so the backward sees the same mask
        probs = probs * (torch.rand_like(probs) >= dropout_p) / (1.0 - dropout_p)
    probs = probs.to(v.dtype)
    out = torch.matmul(probs, v) if values_finite else _weighted_values(probs, v, seen)
    return out, lse


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    attn_mask: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    block_mask=None,
    seqlens_k_per_row: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    upcast: bool = True,
    chunk_size: int = 256,
    topk: int | None = None,
    topk_scores: torch.Tensor | None = None,
):
    """Exact attention.

    Shapes: q (B, Sq, H, D), k/v (B, Sk, Hk, D), H % Hk == 0; varlen: q (total_q, H, D),
    k/v (total_k, Hk, D) with int32 cu_seqlens_q/k (B+1). attn_mask (bool, True = keep, or numeric,
    nonzero = keep) and attn_bias broadcastable to (B, Hm, Sq, Sk) with Hm in {1, Hk, H} (varlen:
    (total_q, Hm, max_seqlen_k)). seqlens_k_per_row: (B, Sq) or (B*Sq,), row i sees keys [0, len).
    block_mask: an omniattn.BlockMask (B|1, H|1 lists): FULL blocks visible, PARTIAL blocks apply
    its predicate and element bitmaps, other blocks hidden; expanded one chunk of rows at a time
    (varlen: its batch dim indexes the sequences). topk: each row keeps only the `topk` keys of
    largest topk_scores (default attn_bias; laid out like it, never differentiated) among those
    it sees, ties to the lower key index (predicate.select_thresholds).

    Returns out (like q, in q's dtype) and, if return_lse, lse (B, H, Sq) float32 (varlen: (H, total_q)).
    With upcast=True the arithmetic is float32 (float64 inputs stay float64); with upcast=False it
    runs in the input dtype, which is the "plain PyTorch" error baseline of the tests.
    """
    if cu_seqlens_q is not None:
        return _varlen_reference(
            q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, window=window,
            softmax_scale=softmax_scale, softcap=softcap, attn_mask=attn_mask, attn_bias=attn_bias,
            seqlens_k_per_row=seqlens_k_per_row, block_mask=block_mask, dropout_p=dropout_p,
            return_lse=return_lse, upcast=upcast, chunk_size=chunk_size, topk=topk,
            topk_scores=topk_scores,
        )
    batch, seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_heads_k = k.shape[1], k.shape[2]
    group = num_heads // num_heads_k
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    predicate = RelativePredicate.make(causal, window)
    compute_dtype = q.dtype
    if upcast and q.dtype != torch.float64:
        compute_dtype = torch.float32

    # [B, Hk, G, Sq, D] and [B, Hk, 1, Sk, D]: GQA by broadcasting, K/V never repeated
    q5 = q.to(compute_dtype).permute(0, 2, 1, 3).reshape(batch, num_heads_k, group, seqlen_q, head_dim)
    k5 = k.to(compute_dtype).permute(0, 2, 1, 3).unsqueeze(2)
    v5 = v.to(compute_dtype).permute(0, 2, 1, 3).unsqueeze(2)
    # the user's masks as views: each chunk converts and slices its own rows
    mask5 = _as_5d(attn_mask, num_heads_k, group) if attn_mask is not None else None
    bias5 = _as_5d(attn_bias, num_heads_k, group) if attn_bias is not None else None
    row_lens = None
    if seqlens_k_per_row is not None:
        row_lens = seqlens_k_per_row.reshape(batch, seqlen_q).to(q.device)
    if topk is not None and topk_scores is None:
        topk_scores = attn_bias
    scores5 = _as_5d(topk_scores.detach(), num_heads_k, group) if topk is not None else None
    visibility = _KeyVisibility(predicate, block_mask, seqlen_q, seqlen_k, num_heads_k, group,
                                topk)

    def rows(t: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
        """Rows start..stop of a 5-d mask or bias (all of one broadcast over the rows)."""
        if t is None or t.shape[3] == 1:
            return t
        return t[..., start:stop, :]

    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, attn_bias)
    )
    outs, lses = [], []
    for start in range(0, seqlen_q, chunk_size):
        stop = min(start + chunk_size, seqlen_q)
        # only O(chunk)-sized tensors and views of the inputs go in: checkpoint keeps its inputs
        # for the backward
        lens = row_lens[:, start:stop] if row_lens is not None else None
        args = (q5[..., start:stop, :], k5, v5, rows(bias5, start, stop), rows(mask5, start, stop),
                lens, rows(scores5, start, stop), start, visibility, scale, softcap, dropout_p)
        if needs_grad:
            out, lse = checkpoint(_chunk_attention, *args, use_reentrant=False)
        else:
            out, lse = _chunk_attention(*args)
        outs.append(out)
        lses.append(lse)
    if not outs:  # Sq = 0
        outs = [q5.new_empty(*q5.shape[:-1], head_dim)]
        lses = [q5.new_empty(q5.shape[:-1])]
    out = torch.cat(outs, dim=3).reshape(batch, num_heads, seqlen_q, head_dim).transpose(1, 2)
    out = out.to(q.dtype)
    if not return_lse:
        return out
    lse = torch.cat(lses, dim=3).reshape(batch, num_heads, seqlen_q).float()
    return out, lse


def _varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, *, attn_mask, attn_bias,
                      seqlens_k_per_row, block_mask, return_lse, topk_scores, **kwargs):
    """Packed sequences: each sequence is attended on its own; packed masks are
    (total_q, Hm, max_k); a block mask's batch dim indexes sequences, its blocks count from each
    sequence's start."""
    outs, lses = [], []
    bounds_q = cu_seqlens_q.tolist()
    bounds_k = cu_seqlens_k.tolist()
    for i in range(len(bounds_q) - 1):
        q0, q1 = bounds_q[i], bounds_q[i + 1]
        k0, k1 = bounds_k[i], bounds_k[i + 1]

        def packed(t):
            if t is None:
                return None
            rows = t[q0:q1] if t.shape[0] != 1 else t
            # (len_q|1, Hm, max_k|1) -> (1, Hm, len_q|1, len_k|1)
            cols = rows[..., : k1 - k0] if rows.shape[-1] != 1 else rows
            return cols.permute(1, 0, 2).unsqueeze(0)

        lens = seqlens_k_per_row[q0:q1].view(1, -1) if seqlens_k_per_row is not None else None
        out, lse = attention_reference(
            q[q0:q1].unsqueeze(0), k[k0:k1].unsqueeze(0), v[k0:k1].unsqueeze(0),
            attn_mask=packed(attn_mask), attn_bias=packed(attn_bias), seqlens_k_per_row=lens,
            topk_scores=packed(topk_scores),
            block_mask=block_mask.sequence(i, q1 - q0, k1 - k0) if block_mask is not None else None,
            return_lse=True, **kwargs,
        )
        outs.append(out[0])
        lses.append(lse[0])
    out = torch.cat(outs, dim=0)
    if not return_lse:
        return out
    return out, torch.cat(lses, dim=-1)


def reference_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None = None, *,
                       attn_bias: torch.Tensor | None = None, bias_grad: bool = False,
                       **options):
    """(dq, dk, dv, dbias or None) of attention_reference(q, k, v, attn_bias=attn_bias,
    **options) taken from the given out (like q) and lse ((B, H, Sq) float32; packed
    (H, total_q)) with dout reaching out and dlse (None: nothing) reaching lse: the gradients of
    p = exp(s - lse) as if out and lse were this call's. Given a larger softmax's out and lse
    (this call's keys a part of its keys), they are this part's share of its gradients.

    Autograd through the reference, as its own backward is (chunks recomputed): this call's own
    output o and lse l, rescaled to the given normaliser, are o exp(l - lse) and exp(l - lse),
    whose gradients under dout and dlse - rowsum(dout * out) are the ones asked for. Computed in
    float32 (float64 inputs in float64), returned in the inputs' dtypes; dbias only with
    bias_grad."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    leaves = [t.detach().to(compute).requires_grad_() for t in (q, k, v)]
    bias = attn_bias
    if bias_grad:
        bias = attn_bias.detach().to(compute).requires_grad_()
        leaves.append(bias)
    # rowsum(dout * out) in lse's layout: what each row's normaliser passes back
    delta = (dout.to(compute) * out.to(compute)).sum(-1).movedim(-1, -2)
    weight = -delta if dlse is None else dlse.to(compute) - delta
    with torch.enable_grad():
        own_out, own_lse = attention_reference(*leaves[:3], attn_bias=bias, return_lse=True,
                                               **options)
        # rows that see no key (lse -inf) take no share
        share = torch.exp(own_lse - lse.masked_fill(lse == float("-inf"), 0.0))
        rows_share = share.movedim(-1, -2).unsqueeze(-1)  # like out, one per row and head
        loss = (own_out * rows_share * dout.to(compute)).sum() + (share * weight).sum()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
    dq, dk, dv = (g.to(t.dtype) for g, t in zip(grads, (q, k, v)))
    return dq, dk, dv, grads[3].to(attn_bias.dtype) if bias_grad else None


def topk_thresholds(
    q: torch.Tensor,
    k: torch.Tensor,
    topk: int,
    topk_scores: torch.Tensor,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    attn_mask: torch.Tensor | None = None,
    block_mask=None,
    seqlens_k_per_row: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    chunk_size: int = 256,
) -> RowThresholds:
    """The threshold pairs of `attention_reference(..., topk=topk, topk_scores=topk_scores)`'s
    rows, in query chunks (O(chunk x Sk) memory); q and k are read for their shapes only, the
    other arguments as attention_reference reads them.

    Returns RowThresholds (B, Hs, Sq|1) (packed: (1, Hs, total_q)), Hs in {1, Hk, H} the most
    heads of topk_scores, attn_mask and block_mask; one row (Sq|1 = 1) when no row differs:
    scores and mask shared by the rows, no causal / window / block mask / per-row lengths."""
    num_heads, num_heads_k = q.shape[-2], k.shape[-2]
    # heads are dim 1 of padded (B, Hm, Sq, Sk) and packed (total_q, Hm, max_k) layouts alike
    head_counts = [t.shape[1] for t in (topk_scores, attn_mask) if t is not None]
    if block_mask is not None:
        head_counts.append(block_mask.kv_num_blocks.shape[1])
    heads = selection_heads(num_heads, num_heads_k, *head_counts)
    if cu_seqlens_q is not None:
        empty = torch.empty(1, heads, 0, dtype=torch.int32, device=topk_scores.device)
        parts = [(empty, empty)]
        bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for i in range(len(bounds_q) - 1):
            q0, q1, k0, k1 = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
            if q1 == q0:
                continue

            def packed(t):  # (len_q|1, Hm, max_k|1) -> (1, Hm, len_q|1, len_k|1)
                if t is None:
                    return None
                rows = t[q0:q1] if t.shape[0] != 1 else t
                cols = rows[..., : k1 - k0] if rows.shape[-1] != 1 else rows
                return cols.permute(1, 0, 2)[None]

            lens = seqlens_k_per_row[q0:q1].view(1, -1) if seqlens_k_per_row is not None else None
            part = _thresholds(q1 - q0, k1 - k0, num_heads, num_heads_k, heads, topk,
                               packed(topk_scores), causal, window, packed(attn_mask),
                               block_mask.sequence(i, q1 - q0, k1 - k0)
                               if block_mask is not None else None, lens, 1, chunk_size)
            parts.append([t.expand(1, heads, q1 - q0) for t in part])
        return RowThresholds(*(torch.cat(p, dim=-1) for p in zip(*parts)))
    lens = None if seqlens_k_per_row is None else seqlens_k_per_row.reshape(q.shape[0], q.shape[1])
    return RowThresholds(*_thresholds(q.shape[1], k.shape[1], num_heads, num_heads_k, heads,
                                      topk, topk_scores, causal, window, attn_mask, block_mask,
                                      lens, q.shape[0], chunk_size))


def _thresholds(seqlen_q, seqlen_k, num_heads, num_heads_k, heads, topk, scores, causal, window,
                attn_mask, block_mask, row_lens, batch, chunk_size):
    """(threshold, last_tie) int32 (B, heads, Sq|1) of one padded batch (see topk_thresholds)."""
    group = num_heads // num_heads_k
    predicate = RelativePredicate.make(causal, window)
    visibility = _KeyVisibility(predicate, block_mask, seqlen_q, seqlen_k, num_heads_k, group)
    scores5 = _as_5d(scores, num_heads_k, group)
    mask5 = _as_5d(attn_mask, num_heads_k, group) if attn_mask is not None else None
    rows_differ = scores.shape[2] > 1 or (attn_mask is not None and attn_mask.shape[2] > 1) \
        or not predicate.unbounded or block_mask is not None or row_lens is not None
    num_rows = seqlen_q if rows_differ else 1
    # (Hk, G) of the selection's heads: all of them, one per group, or one
    split = (num_heads_k, group) if heads == num_heads else (heads, 1)
    pairs = []
    for start in range(0, num_rows, chunk_size):
        stop = min(start + chunk_size, num_rows)

        def rows(t):
            return t if t is None or t.shape[3] == 1 else t[..., start:stop, :]

        lens = row_lens[:, start:stop] if row_lens is not None else None
        keep = visibility.keep(start, stop - start, rows(mask5), lens, scores.device)
        keys = order_keys(rows(scores5))
        pair = select_thresholds(keys.expand(*keys.shape[:-1], seqlen_k), keep, topk)
        pairs.append([t.expand(batch, *split, stop - start).reshape(batch, heads, stop - start)
                      for t in pair])
    if not pairs:  # Sq = 0
        empty = torch.empty(batch, heads, 0, dtype=torch.int32, device=scores.device)
        return empty, empty
    return tuple(torch.cat(p, dim=-1) for p in zip(*pairs))


def sequence_keys(k: torch.Tensor, block_table: torch.Tensor | None, batch: int,
                  used: int) -> torch.Tensor:
    """(1, used, Hk, D): the first `used` keys (or values) of sequence `batch`, gathered from
    its pages (block_table given: k is (num_pages, page_size, Hk, D)) or a view of a contiguous
    (B, Sk, Hk, D) k. Differentiable."""
    if block_table is None:
        return k[batch:batch + 1, :used]
    pages = block_table[batch, :-(-used // k.shape[1])].long()
    return k[pages].reshape(1, -1, *k.shape[2:])[:, :used]


def sequence_masks(batch: int, used: int, attn_mask, attn_bias, seqlens_k_per_row,
                   topk_scores=None) -> tuple:
    """(mask, bias, lengths, top-k scores) of sequence `batch` on its first `used` keys: masks,
    biases and scores (B|1, Hm, Sq|1, Sk|1) cut to (1, Hm, Sq|1, used|1) (views), per-row
    lengths (B, Sq) to (1, Sq)."""
    def cut(t):
        if t is None:
            return None
        rows = t[batch:batch + 1] if t.shape[0] != 1 else t
        return rows[..., :used] if rows.shape[-1] != 1 else rows

    lens = None if seqlens_k_per_row is None else seqlens_k_per_row[batch:batch + 1]
    return cut(attn_mask), cut(attn_bias), lens, cut(topk_scores)


def per_sequence(attend, q, k, v, block_table, seqused_k, attn_mask=None, attn_bias=None,
                 seqlens_k_per_row=None, topk_scores=None):
    """(out, lse) of paged or partly used keys, one sequence at a time: attend(q_b, k_b, v_b,
    attn_mask=, attn_bias=, seqlens_k_per_row=, topk_scores=, return_lse=True) on each
    sequence's rows, its first seqused_k[b] keys (read on the host; None: every key it holds)
    gathered from its pages or sliced from k / v, and its rows of the masks, scores and
    lengths. Shapes as paged_reference's."""
    batch, seqlen_q, num_heads, _ = q.shape
    capacity = k.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    used = seqused_k.tolist() if seqused_k is not None else [capacity] * batch
    if seqlens_k_per_row is not None:
        seqlens_k_per_row = seqlens_k_per_row.reshape(batch, seqlen_q)
    outs, lses = [], []
    for b, n in enumerate(used):
        n = min(max(n, 0), capacity)
        mask, bias, lens, scores = sequence_masks(b, n, attn_mask, attn_bias, seqlens_k_per_row,
                                                  topk_scores)
        out, lse = attend(q[b:b + 1], sequence_keys(k, block_table, b, n),
                          sequence_keys(v, block_table, b, n), attn_mask=mask, attn_bias=bias,
                          seqlens_k_per_row=lens, topk_scores=scores, return_lse=True)
        outs.append(out)
        lses.append(lse)
    if not outs:  # no sequence
        return torch.empty_like(q), q.new_empty((0, num_heads, seqlen_q), dtype=torch.float32)
    return torch.cat(outs), torch.cat(lses)


def paged_reference(q, k, v, block_table=None, seqused_k=None, *, attn_mask=None,
                    attn_bias=None, seqlens_k_per_row=None, topk_scores=None, return_lse=False,
                    **options):
    """Exact attention over paged or partly used keys.

    q (B, Sq, H, D); k/v pages (num_pages, page_size, Hk, D) that block_table (int32
    (B, max_pages)) lists per sequence, or (B, Sk, Hk, D) without a block table; sequence b
    uses its first seqused_k[b] keys (int32 (B,), read on the host; None: every key it holds),
    and causal / window align to them (bottom-right). attn_mask / attn_bias broadcast to
    (B, Hm, Sq, max_pages x page_size (or Sk)), topk_scores too; seqlens_k_per_row (B, Sq).
    Each sequence's keys are gathered alone (O(its keys) memory) and run through
    attention_reference with `options` (its keywords). Returns out, and lse (B, H, Sq) if
    return_lse."""
    out, lse = per_sequence(functools.partial(attention_reference, **options), q, k, v,
                            block_table, seqused_k, attn_mask, attn_bias, seqlens_k_per_row,
                            topk_scores)
    return (out, lse) if return_lse else out
