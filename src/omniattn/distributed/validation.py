"""Validation of `omniattn.distributed.attention`: every bad argument raises a ValueError /
TypeError naming it, what it got (shape, dtype, device; never values) and what was expected,
before any communication; and the choice of method, with the reason each one is refused."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..masks.block_mask import BlockMask
from ..predicate import RelativePredicate
from ..validation import (SUPPORTED_DTYPES, check_int32_argument, check_options, check_qkv,
                          check_tensor_argument, describe)
from .comm import group_info
from .layout import check_divides, check_layout, chunks_per_rank
from .sharding import resolve_group

METHODS = ("ulysses", "ring", "allgather")  # auto's order of preference
WHY = {
    "ulysses": "one single-device call over the whole sequence with H/P heads, every mask "
               "unchanged; moves q, k, v and out once each (all-to-all)",
    "ring": "K/V shards travel to the ranks whose rows see them while each step is computed; "
            "K/V memory stays S/P per rank",
    "allgather": "every rank gathers all of K/V (memory S per rank) and attends with its rows",
}


@dataclass(frozen=True)
class Call:
    """A validated call: the group and this rank's place in it, the global sequence length,
    the masks in global positions, and the method with the reasons behind it."""

    group: object
    rank: int
    world: int
    layout: str
    seqlen: int
    causal: bool
    window: tuple[int, int] | None
    predicate: RelativePredicate
    block_mask: BlockMask | None
    row_lens: torch.Tensor | None  # (B, S/P) int32
    options: dict  # the local calls' softmax_scale, softcap (and topk)
    method: str
    chosen_by_auto: bool
    refused: tuple[tuple[str, str], ...]


def _check_keywise(name: str, t, q: torch.Tensor, k: torch.Tensor) -> None:
    """attn_bias / topk_scores: (B|1, Hm, 1, S/P) with Hm in {1, Hk, H}, this rank's keys."""
    check_tensor_argument(name, t, SUPPORTED_DTYPES, q)
    batch, rows, heads, _ = q.shape
    heads_k = k.shape[2]
    if t.dim() != 4 or t.shape[0] not in (1, batch) or t.shape[1] not in (1, heads_k, heads) \
            or t.shape[2] != 1 or t.shape[3] != rows:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; omniattn.distributed takes it "
                         f"key-wise, this rank's keys: (B={batch} or 1, Hm in "
                         f"{{1,{heads_k},{heads}}}, 1, S/P={rows})")


def _check_row_lens(row_lens, q: torch.Tensor, seqlen: int) -> torch.Tensor:
    """seqlens_k_per_row: int32 (B, S/P) or (B * S/P,), global key lengths in [0, S]; returns
    it (B, S/P). Reads the values (a sync), once per call."""
    check_int32_argument("seqlens_k_per_row", row_lens, q, optional=False)
    batch, rows = q.shape[:2]
    if tuple(row_lens.shape) not in ((batch, rows), (batch * rows,)):
        raise ValueError(f"seqlens_k_per_row has shape {tuple(row_lens.shape)}; expected this "
                         f"rank's rows, ({batch}, {rows}) or ({batch * rows},)")
    row_lens = row_lens.reshape(batch, rows).contiguous()
    if row_lens.numel() and bool(((row_lens < 0) | (row_lens > seqlen)).any()):
        raise ValueError(f"seqlens_k_per_row must lie in [0, S] (global key lengths, "
                         f"S = {seqlen})")
    return row_lens


def _check_topk(topk, topk_scores, q, k) -> None:
    if topk is not None and (not isinstance(topk, int) or isinstance(topk, bool)):
        raise TypeError(f"topk must be an int or None, got {type(topk).__name__}")
    if topk is not None and topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if topk_scores is not None:
        if topk is None:
            raise ValueError("topk_scores needs topk (the number of keys each row keeps)")
        _check_keywise("topk_scores", topk_scores, q, k)


def _check_block_mask(block_mask, q, seqlen: int) -> None:
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be an omniattn.BlockMask, got "
                        f"{type(block_mask).__name__}")
    batch, heads = q.shape[0], q.shape[2]
    if block_mask.seq_lengths != (seqlen, seqlen):
        raise ValueError(f"block_mask was built for (Sq, Sk) = {block_mask.seq_lengths}; "
                         f"omniattn.distributed takes the global mask, ({seqlen}, {seqlen}) "
                         f"(S = P x {q.shape[1]} rows per rank)")
    mask_batch, mask_heads = block_mask.kv_num_blocks.shape[:2]
    if mask_batch not in (1, batch) or mask_heads not in (1, heads):
        raise ValueError(f"block_mask lists have batch/head dims ({mask_batch}, {mask_heads}); "
                         f"expected (1 or {batch}, 1 or {heads})")
    if block_mask.kv_indices.device != q.device:
        raise ValueError(f"block_mask is on {block_mask.kv_indices.device} but q is on {q.device}")


def refusal(method: str, q, k, world: int, layout: str, block_mask, topk) -> str | None:
    """Why `method` cannot run this call exactly, or None."""
    heads, heads_k = q.shape[2], k.shape[2]
    chunk = q.shape[1] // chunks_per_rank(layout)
    if method == "ulysses":
        if heads % world or heads_k % world:
            return (f"it splits heads over the {world} ranks: H = {heads} query and Hk = "
                    f"{heads_k} key/value heads must be multiples of {world}")
        return None
    if method == "ring" and topk is not None:
        return ("top-k keeps each row's best keys of the whole sequence, which no ring step "
                "sees at once (ulysses or allgather computes it exactly)")
    if block_mask is not None:
        block_q, block_k = block_mask.block_size
        if chunk % block_q or (method == "ring" and chunk % block_k):
            sizes = f"{block_q}" if method == "allgather" else f"{block_q} and {block_k}"
            return (f"its pieces cut block_mask at the {layout} chunks of {chunk} positions, "
                    f"which must be multiples of the mask's block size {sizes}")
    return None


def check_call(q, k, v, group, layout, method, causal, window, softmax_scale, softcap,
               attn_bias, block_mask, seqlens_k_per_row, topk, topk_scores,
               return_lse) -> Call:
    """Every check of `omniattn.distributed.attention`, and the method it runs."""
    check_layout(layout)
    if not isinstance(method, str):
        raise TypeError(f"method must be a str, got {type(method).__name__}")
    if method not in ("auto", *METHODS):
        raise ValueError(f"method must be 'auto', 'ulysses', 'ring' or 'allgather', got "
                         f"{method!r}")
    group = resolve_group(group)
    rank, world = group_info(group)
    check_qkv(q, k, v, packed=False)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"q has {q.shape[1]} positions per rank and k {k.shape[1]}: "
                         f"omniattn.distributed attends one sequence, sharded alike (q "
                         f"{describe(q)}, k {describe(k)})")
    check_divides("q", q.shape[1], layout, world, per_rank=True)
    seqlen = q.shape[1] * world
    check_options(causal, window, softmax_scale, softcap, 0.0)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if attn_bias is not None:
        _check_keywise("attn_bias", attn_bias, q, k)
    _check_topk(topk, topk_scores, q, k)
    if block_mask is not None:
        _check_block_mask(block_mask, q, seqlen)
    row_lens = _check_row_lens(seqlens_k_per_row, q, seqlen) \
        if seqlens_k_per_row is not None else None
    refused = tuple((m, why) for m in METHODS
                    if (why := refusal(m, q, k, world, layout, block_mask, topk)) is not None)
    reasons = dict(refused)
    able = [m for m in METHODS if m not in reasons]
    if not able:
        raise ValueError("no method can run this call exactly: " + "; ".join(
            f"not {m}: {why}" for m, why in refused))
    chosen = able[0] if method == "auto" else method
    if chosen in reasons:
        raise ValueError(f"method={method!r} cannot run this call: {reasons[method]}; use "
                         f"method={' or '.join(repr(m) for m in able)}")
    options = {"softmax_scale": softmax_scale, "softcap": softcap}
    if topk is not None:
        options["topk"] = topk
    return Call(group, rank, world, layout, seqlen, causal, window,
                RelativePredicate.make(causal, window), block_mask, row_lens, options, chosen,
                method == "auto", refused)
