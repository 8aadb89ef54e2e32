"""Ulysses attention: an all-to-all turns sequence shards into head shards (every position of
H/P heads), the single-device attention runs over the whole sequence with every mask unchanged,
and an all-to-all turns the output (and lse) back. Key-wise tensors and per-row key lengths are
all-gathered (in global order) and the heads of this rank taken."""
from __future__ import annotations

import torch

from ..api import attention as local_attention
from .comm import all_gather, gather_sequence, heads_to_sequence, sequence_to_heads
from .layout import to_global
from .pieces import block_mask_heads


def _rank_heads(t: torch.Tensor | None, rank: int, world: int) -> torch.Tensor | None:
    """This rank's part of a (B|1, Hm, 1, S) tensor's heads (all of one shared by them)."""
    if t is None or t.shape[1] == 1:
        return t
    return t.chunk(world, 1)[rank]


def ulysses_attention(q, k, v, attn_bias, topk_scores, row_lens, block_mask, group, rank: int,
                      world: int, layout: str, causal: bool, window, options: dict):
    """(out (B, S/P, H, D), lse (B, H, S/P) float32) of this rank's rows; q, k, v, attn_bias,
    topk_scores, row_lens this rank's shards; H and Hk multiples of P."""
    heads = [sequence_to_heads(t, group, layout, 1, 2) for t in (q, k, v)]
    bias = _rank_heads(gather_sequence(attn_bias, group, layout, 3), rank, world)
    extra = dict(options)
    if topk_scores is not None:
        with torch.no_grad():
            scores = gather_sequence(topk_scores, group, layout, 3)
        extra["topk_scores"] = _rank_heads(scores, rank, world)
    lens = None
    if row_lens is not None:
        lens = to_global(all_gather(row_lens, group), layout, 1)
    out, lse = local_attention(
        *heads, causal=causal, window=window,
        block_mask=block_mask_heads(block_mask, rank, world) if block_mask is not None else None,
        attn_bias=bias, seqlens_k_per_row=lens, return_lse=True,
        # every rank's lengths were checked before the gather
        check_inputs=lens is None, **extra)
    return heads_to_sequence(out, group, layout, 1, 2), heads_to_sequence(lse, group, layout, 2, 1)
