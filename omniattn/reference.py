"""Exact attention in plain PyTorch: the correctness oracle and the CPU backend.

It implements every semantic of the public API (docs/design.md): bottom-right aligned causal, sliding
window, element mask, additive bias (broadcast, never expanded), per-row key lengths, varlen,
softcap, GQA, LSE, dropout (from torch.rand), and rows that see no key (output 0, lse -inf, zero
gradients).

Queries are processed in chunks so memory stays O(chunk * Sk). When gradients are needed each
chunk runs under activation checkpointing, so the backward pass also stays O(chunk * Sk).
"""
from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from .predicate import RelativePredicate

__all__ = ["attention_reference"]


def _as_5d(t: torch.Tensor, num_heads_k: int, group: int) -> torch.Tensor:
    """View a (B|1, Hm|1, Sq|1, Sk|1) mask/bias as (B|1, Hk|1, G|1, Sq|1, Sk|1) without copying."""
    b, hm, sq, sk = t.shape
    if hm == 1:
        return t.view(b, 1, 1, sq, sk)
    if hm == num_heads_k * group and group > 1:
        return t.view(b, num_heads_k, group, sq, sk)
    return t.view(b, hm, 1, sq, sk)


def _chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    keep: torch.Tensor | None,
    scale: float,
    softcap: float,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hk, G, c, D], k/v [B, Hk, 1, Sk, D], keep broadcastable to [B, Hk, G, c, Sk]."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, Hk, G, c, Sk]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hk, G, c]
    seen = torch.isfinite(lse)
    # rows that see no key: probabilities 0 instead of NaN, lse stays -inf
    probs = torch.exp(scores - torch.where(seen, lse, torch.zeros_like(lse)).unsqueeze(-1))
    probs = torch.where(seen.unsqueeze(-1), probs, torch.zeros_like(probs))
    if dropout_p > 0:
        # checkpoint's recomputation replays the RNG state, so the backward sees the same mask
        probs = probs * (torch.rand_like(probs) >= dropout_p) / (1.0 - dropout_p)
    out = torch.matmul(probs.to(v.dtype), v)
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
):
    """Exact attention.

    Shapes: q (B, Sq, H, D), k/v (B, Sk, Hk, D), H % Hk == 0; varlen: q (total_q, H, D),
    k/v (total_k, Hk, D) with int32 cu_seqlens_q/k (B+1). attn_mask (bool, True = keep, or numeric,
    nonzero = keep) and attn_bias broadcastable to (B, Hm, Sq, Sk) with Hm in {1, Hk, H} (varlen:
    (total_q, Hm, max_seqlen_k)). seqlens_k_per_row: (B, Sq) or (B*Sq,), row i sees keys [0, len).
    block_mask: an omniattn.BlockMask (B|1, H|1 lists): FULL blocks visible, PARTIAL blocks apply
    its predicate and element bitmaps, other blocks hidden; expanded one chunk of rows at a time
    (varlen: its batch dim indexes the sequences).

    Returns out (like q, in q's dtype) and, if return_lse, lse (B, H, Sq) float32 (varlen: (H, total_q)).
    With upcast=True the arithmetic is float32 (float64 inputs stay float64); with upcast=False it
    runs in the input dtype, which is the "plain PyTorch" error baseline of the tests.
    """
    if cu_seqlens_q is not None:
        return _varlen_reference(
            q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, window=window,
            softmax_scale=softmax_scale, softcap=softcap, attn_mask=attn_mask, attn_bias=attn_bias,
            seqlens_k_per_row=seqlens_k_per_row, block_mask=block_mask, dropout_p=dropout_p,
            return_lse=return_lse, upcast=upcast, chunk_size=chunk_size,
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
    mask5 = None
    if attn_mask is not None:
        keep = attn_mask if attn_mask.dtype == torch.bool else attn_mask != 0
        mask5 = _as_5d(keep, num_heads_k, group)
    bias5 = _as_5d(attn_bias.to(compute_dtype), num_heads_k, group) if attn_bias is not None else None
    row_lens = None
    if seqlens_k_per_row is not None:
        row_lens = seqlens_k_per_row.reshape(batch, seqlen_q).to(q.device)

    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, attn_bias)
    )
    outs, lses = [], []
    for start in range(0, seqlen_q, chunk_size):
        stop = min(start + chunk_size, seqlen_q)
        q_idx = torch.arange(start, stop, device=q.device)
        keep = predicate.visible(q_idx, seqlen_q, seqlen_k)
        keep = keep.view(1, 1, 1, stop - start, seqlen_k) if keep is not None else None
        if mask5 is not None:
            m = mask5[..., start:stop, :] if mask5.shape[3] != 1 else mask5
            keep = m if keep is None else keep & m
        if block_mask is not None:
            by_blocks = block_mask.visible(q_idx, seqlen_q, seqlen_k).to(q.device)
            by_blocks = _as_5d(by_blocks, num_heads_k, group)
            keep = by_blocks if keep is None else keep & by_blocks
        if row_lens is not None:
            k_idx = torch.arange(seqlen_k, device=q.device)
            by_len = k_idx.view(1, 1, 1, 1, -1) < row_lens[:, start:stop].view(batch, 1, 1, -1, 1)
            keep = by_len if keep is None else keep & by_len
        bias = None
        if bias5 is not None:
            bias = bias5[..., start:stop, :] if bias5.shape[3] != 1 else bias5
        q_chunk = q5[..., start:stop, :]
        if needs_grad:
            out, lse = checkpoint(
                _chunk_attention, q_chunk, k5, v5, bias, keep, scale, softcap, dropout_p,
                use_reentrant=False,
            )
        else:
            out, lse = _chunk_attention(q_chunk, k5, v5, bias, keep, scale, softcap, dropout_p)
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
                      seqlens_k_per_row, block_mask, return_lse, **kwargs):
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
            block_mask=block_mask.sequence(i, q1 - q0, k1 - k0) if block_mask is not None else None,
            return_lse=True, **kwargs,
        )
        outs.append(out[0])
        lses.append(lse[0])
    out = torch.cat(outs, dim=0)
    if not return_lse:
        return out
    return out, torch.cat(lses, dim=-1)
