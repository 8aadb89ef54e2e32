"""`omniattn.distributed.attention` and `explain`: validate (no communication before every
check has passed), choose the method, cut this rank's pieces, run."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .allgather import allgather_attention
from .layout import Chunk, chunks
from .pieces import Piece, pieces
from .ring import RingSchedule, ring_attention
from .ulysses import ulysses_attention
from .validation import WHY, Call, check_call


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
              layout: str = "zigzag", method: str = "auto", causal: bool = False,
              window: tuple[int, int] | None = None, softmax_scale: float | None = None,
              softcap: float = 0.0, attn_bias: torch.Tensor | None = None, block_mask=None,
              seqlens_k_per_row: torch.Tensor | None = None, topk: int | None = None,
              topk_scores: torch.Tensor | None = None, return_lse: bool = False):
    """Context-parallel attention: one sequence sharded over the ranks of `group`, every mask in
    global positions, exactly `omniattn.attention` of the whole sequence.

    Args:
        q: (B, S/P, H, D), k / v: (B, S/P, Hk, D): this rank's shards in `layout` (`shard`
            makes them), S the global length, P the group's size.
        group: a ProcessGroup (e.g. a DeviceMesh's `mesh.get_group("cp")`), a 1-D DeviceMesh,
            or None for the default group. Every rank of it must make the same call.
        layout: "zigzag" (rank r holds chunks r and 2P-1-r of 2P; balanced causal work) or
            "contiguous" (chunk r of P).
        method: "ulysses" (all-to-all to H/P heads of the whole sequence; needs H and Hk
            multiples of P), "ring" (K/V passed around the ring, overlapped with compute;
            pieces that see nothing skipped), "allgather" (K/V gathered; dK/dV
            reduce-scattered) or "auto" (`explain` says which, and why).
        causal, window, softmax_scale, softcap: as `omniattn.attention`, in global positions
            (bottom-right aligned over S x S).
        attn_bias: key-wise (B|1, Hm, 1, S/P), Hm in {1, Hk, H}: this rank's keys; it gets
            its gradient.
        block_mask: the global omniattn.BlockMask over (S, S); ring and allgather cut it at the
            layout's chunks, which must be multiples of its block size.
        seqlens_k_per_row: int32 (B, S/P): this rank's rows' global key lengths (row i sees
            keys [0, len_i) of the whole sequence).
        topk, topk_scores: passed to the single-device calls where the method computes them
            exactly (ulysses, allgather); topk_scores key-wise like attn_bias.
        return_lse: also return this rank's lse (B, H, S/P) float32.

    Returns:
        this rank's shard of the output (B, S/P, H, D), or (out, lse). Gradients reach q, k, v
        and attn_bias (this rank's shards).
    """
    call = check_call(q, k, v, group, layout, method, causal, window, softmax_scale, softcap,
                      attn_bias, block_mask, seqlens_k_per_row, topk, topk_scores, return_lse)
    if call.method == "ulysses":
        out, lse = ulysses_attention(q, k, v, attn_bias, topk_scores, call.row_lens,
                                     call.block_mask, call.group, call.rank, call.world,
                                     call.layout, call.causal, call.window, call.options)
    elif call.method == "allgather":
        out, lse = allgather_attention(q, k, v, attn_bias, topk_scores, call.row_lens,
                                       _allgather_pieces(call), call.group, call.layout,
                                       call.options)
    else:
        schedule = RingSchedule(_ring_steps(call), call.group, call.world)
        out, lse = ring_attention(q, k, v, attn_bias, call.row_lens, schedule, call.options)
    return (out, lse) if return_lse else out


def _rows(call: Call) -> tuple[Chunk, ...]:
    return chunks(call.layout, call.rank, call.world, call.seqlen)


def _allgather_pieces(call: Call) -> list[Piece]:
    everything = (Chunk(0, 0, call.seqlen),)
    return pieces(_rows(call), everything, call.predicate, call.block_mask,
                  by_position=call.row_lens is not None)


def _ring_steps(call: Call) -> list[list[Piece]]:
    """The pieces of each ring step: step t holds the K/V of rank (rank - t) mod P."""
    return [pieces(_rows(call), chunks(call.layout, (call.rank - step) % call.world,
                                       call.world, call.seqlen),
                   call.predicate, call.block_mask,
                   by_position=call.row_lens is not None)
            for step in range(call.world)]


@dataclass(frozen=True)
class DistributedPlan:
    """What `omniattn.distributed.attention` runs on this rank: the method and why, the methods
    refused and why, and this rank's work."""

    method: str
    reason: str
    refused: tuple[tuple[str, str], ...]
    rank: int
    world: int
    layout: str
    rows: tuple[Chunk, ...]
    work: tuple[str, ...]

    def __str__(self) -> str:
        rows = " and ".join(f"[{c.start}, {c.stop})" for c in self.rows)
        lines = [f"method: {self.method} ({self.reason})",
                 *(f"  not {m}: {why}" for m, why in self.refused),
                 f"rank {self.rank} of {self.world}, {self.layout} layout: rows {rows}"]
        return "\n".join(lines + [f"  {line}" for line in self.work])


def explain(q, k, v, **options) -> DistributedPlan:
    """What `attention(q, k, v, **options)` would run on this rank, without communicating or
    computing: the method (auto's choice and why), the methods refused and why, and this
    rank's local calls. `print(omniattn.distributed.explain(...))` reads it. Options are
    `attention`'s keywords, validated as it validates them."""
    import inspect

    known = [name for name, p in inspect.signature(attention).parameters.items()
             if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = set(options) - set(known)
    if unknown:
        raise TypeError(f"explain() got unexpected keyword arguments {sorted(unknown)}; it takes "
                        f"attention's: {', '.join(known)}")
    defaults = {name: inspect.signature(attention).parameters[name].default for name in known}
    call = check_call(q, k, v, **{**defaults, **options})
    reason = ("auto: " if call.chosen_by_auto else "asked for: ") + WHY[call.method]
    if call.method == "ulysses":
        heads, heads_k = q.shape[2] // call.world, k.shape[2] // call.world
        work = (f"one call over all {call.seqlen} positions with query heads "
                f"[{call.rank * heads}, {(call.rank + 1) * heads}) and key/value heads "
                f"[{call.rank * heads_k}, {(call.rank + 1) * heads_k})",)
    elif call.method == "allgather":
        work = tuple(p.describe() for p in _allgather_pieces(call))
    else:
        work = tuple(
            f"step {step}, K/V of rank {(call.rank - step) % call.world}: "
            + ("; ".join(p.describe() for p in step_pieces) or "nothing visible, skipped")
            for step, step_pieces in enumerate(_ring_steps(call)))
    return DistributedPlan(call.method, reason, call.refused, call.rank, call.world,
                           call.layout, _rows(call), work)
