"""All-gather attention: every rank gathers the whole K/V (and key bias / top-k scores) in
global order and attends with its own rows, one local call per piece (pieces.py); autograd
takes the gradients back through the gather, whose backward reduce-scatters dK / dV / dbias to
their owners."""
from __future__ import annotations

import torch

from .comm import gather_sequence
from .pieces import Piece


def allgather_attention(q, k, v, attn_bias, topk_scores, row_lens, pieces: list[Piece], group,
                        layout: str, options: dict):
    """(out (B, S/P, H, D), lse (B, H, S/P) float32) of this rank's rows; q, k, v, attn_bias,
    topk_scores this rank's shards; `pieces` cover this rank's rows in order, keys indexed in
    global positions."""
    k_all, v_all = gather_sequence(k, group, layout, 1), gather_sequence(v, group, layout, 1)
    bias_all = gather_sequence(attn_bias, group, layout, 3)
    with torch.no_grad():
        scores_all = gather_sequence(topk_scores, group, layout, 3)
    outs, lses = [], []
    for piece in pieces:
        out, lse = piece.run(q, k_all, v_all, bias_all, row_lens, options, scores_all)
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, 1), torch.cat(lses, 2)
