"""`omniattn.distributed.attention` and `explain`: validate (no communication before every
check has passed), choose the method, cut this rank's pieces, run."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .allgather import allgather_attention
from .balance import MARGIN, Balance, Offload, balance
from .comm import all_gather
from .layout import Chunk, chunks, chunks_per_rank
from .pieces import Piece, pieces
from .ring import Handoff, RingSchedule, ring_attention
from .ulysses import ulysses_attention
from .validation import WHY, Call, check_call, refusal
from .visibility import Visibility, rank_work, visibility


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
            multiples of P), "ring" (K/V shards sent to the ranks whose rows see them,
            overlapped with compute; shards and pieces no row sees skipped), "allgather" (K/V
            gathered; dK/dV reduce-scattered) or "auto" (`explain` says which, and why).
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
        table = _visibility(call)
        if call.row_lens is not None:
            table = table.narrowed(_reach(call))
        out, lse = ring_attention(q, k, v, attn_bias, call.row_lens,
                                  _ring_schedule(call, table, _handoffs(call)), call.options)
    return (out, lse) if return_lse else out


def _rows(call: Call) -> tuple[Chunk, ...]:
    return chunks(call.layout, call.rank, call.world, call.seqlen)


def _allgather_pieces(call: Call) -> list[Piece]:
    everything = (Chunk(0, 0, call.seqlen),)
    return pieces(_rows(call), everything, call.predicate, call.block_mask,
                  by_position=call.row_lens is not None)


def _visibility(call: Call, layout: str | None = None) -> Visibility:
    return visibility(layout or call.layout, call.world, call.seqlen, call.predicate,
                      call.block_mask)


def _reach(call: Call) -> list[int]:
    """The largest key length of each chunk's rows (global chunk order), every rank's: one
    all-gather of (chunks per rank,) int32 and one read of it."""
    largest = torch.stack([call.row_lens[:, c.local:c.local + c.length].amax()
                           for c in _rows(call)])
    reach = [0] * (call.seqlen // _rows(call)[0].length)
    gathered = torch.stack(all_gather(largest, call.group)).tolist()
    for rank, found in enumerate(gathered):
        for chunk, length in zip(chunks(call.layout, rank, call.world, call.seqlen), found):
            reach[chunk.start // chunk.length] = length
    return reach


def _handoffs(call: Call) -> Balance | None:
    """The ring's hand-offs of rows (balance.py); None with per-row key lengths, which the
    cost model does not see (it could hand rows the wrong way)."""
    if call.row_lens is not None:
        return None
    return balance(call.layout, call.world, call.seqlen, call.predicate, call.block_mask)


def _ring_schedule(call: Call, table: Visibility, handoffs: Balance | None) -> RingSchedule:
    """This rank's pieces at each ring step (step t holds the K/V of rank (rank - t) mod P),
    none where the table says its rows see none of those keys, without the rows handed off;
    and the hand-offs this rank makes and takes."""
    offloads = handoffs.offloads if handoffs is not None else ()
    if offloads:
        table = table.without(handoffs.whole_pairs())
    needs = table.needs(call.world)
    given_away = handoffs.given_away(call.rank) if offloads else None
    steps = []
    for step in range(call.world):
        source = (call.rank - step) % call.world
        steps.append(pieces(_rows(call), chunks(call.layout, source, call.world, call.seqlen),
                            call.predicate, call.block_mask,
                            by_position=call.row_lens is not None, sees=table.sees,
                            given_away=given_away)
                     if needs[call.rank][source] else [])
    given = [_handoff(call, o, o.helper) for o in offloads if o.owner == call.rank]
    taken = [_handoff(call, o, o.owner) for o in offloads if o.helper == call.rank]
    return RingSchedule(steps, needs, call.group, call.rank, call.world,
                        tuple(h for h in given if h is not None),
                        tuple(h for h in taken if h is not None), bool(offloads))


def _handoff(call: Call, offload: Offload, peer: int) -> Handoff | None:
    """An offload's piece: its rows alone against the helper's key chunk; None where the mask
    hides all of it (its listed blocks' bitmaps), alike on both ranks: nothing moves."""
    found = pieces([Chunk(offload.rows.start, 0, offload.rows.length)], [offload.keys],
                   call.predicate, call.block_mask, by_position=False)
    if not found:
        return None
    (i0, i1), local = found[0].rows, offload.rows.local
    return Handoff(peer, (local + i0, local + i1), replace(found[0], rows=(0, i1 - i0)))


@dataclass(frozen=True)
class DistributedPlan:
    """What `omniattn.distributed.attention` runs on this rank: the method and why, the methods
    refused and why, this rank's work, and (ring, allgather) the cost model: every rank's
    visible (query, key) pairs, the K/V shards the ring moves as (from rank, to rank), and the
    balance; for the ring, the rows handed from busier ranks to lighter ones (`offloads`) and
    every rank's work after them (`balanced_work`, None where the ring hands nothing off)."""

    method: str
    reason: str
    refused: tuple[tuple[str, str], ...]
    rank: int
    world: int
    layout: str
    rows: tuple[Chunk, ...]
    work: tuple[str, ...]
    rank_work: tuple[float, ...] | None  # None for ulysses: every rank has 1/P of the heads
    kv_moves: tuple[tuple[int, int], ...]
    balance: tuple[str, ...]
    offloads: tuple[Offload, ...] = ()
    balanced_work: tuple[float, ...] | None = None

    def __str__(self) -> str:
        rows = " and ".join(f"[{c.start}, {c.stop})" for c in self.rows)
        lines = [f"method: {self.method} ({self.reason})",
                 *(f"  not {m}: {why}" for m, why in self.refused),
                 f"rank {self.rank} of {self.world}, {self.layout} layout: rows {rows}"]
        return "\n".join(lines + [f"  {line}" for line in self.work] + list(self.balance))


def explain(q, k, v, **options) -> DistributedPlan:
    """What `attention(q, k, v, **options)` would run on this rank, without communicating or
    computing: the method (auto's choice and why), the methods refused and why, this rank's
    local calls and, for ring and allgather, each rank's work (visible pairs), the ring's
    steps taken and skipped and the rows it hands from busier ranks to lighter ones, and
    whether the other layout would suit the masks better.
    `print(omniattn.distributed.explain(...))` reads it. Options are `attention`'s keywords,
    validated as it validates them (per-row key lengths are this rank's: the shards they
    spare others are known at run time only)."""
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
        return DistributedPlan(call.method, reason, call.refused, call.rank, call.world,
                               call.layout, _rows(call), work, None, (), ())
    ring = call.method == "ring"
    handoffs = _handoffs(call) if ring else None
    moves = _kv_moves(call, call.layout, handoffs) if ring else ()
    if ring:
        work = _ring_lines(call, _ring_schedule(call, _visibility(call), handoffs))
    else:
        work = tuple(p.describe() for p in _allgather_pieces(call))
    found = _rank_work(call, call.layout)
    offloads = handoffs.offloads if handoffs is not None else ()
    return DistributedPlan(call.method, reason, call.refused, call.rank, call.world,
                           call.layout, _rows(call), work, found, moves,
                           _balance(call, q, k, found, moves, handoffs), offloads,
                           handoffs.after if offloads else None)


def _rank_work(call: Call, layout: str) -> tuple[float, ...]:
    return rank_work(layout, call.world, call.seqlen, call.predicate, call.block_mask)


def _kv_moves(call: Call, layout: str,
              handoffs: Balance | None = None) -> tuple[tuple[int, int], ...]:
    """The (from rank, to rank) K/V shards the ring moves; without the pairs of chunks handed
    off whole where `handoffs` are given."""
    table = _visibility(call, layout)
    if handoffs is not None:
        table = table.without(handoffs.whole_pairs())
    needs = table.needs(call.world)
    return tuple((source, rank) for rank in range(call.world) for source in range(call.world)
                 if source != rank and needs[rank][source])


def _ring_lines(call: Call, schedule: RingSchedule) -> tuple[str, ...]:
    moving = schedule.moving_steps()
    lines = []
    for step, step_pieces in enumerate(schedule.steps):
        computed = "; ".join(p.describe() for p in step_pieces) or "nothing visible, skipped"
        if step == 0:
            lines.append(f"step 0, own K/V: {computed}")
        elif step not in moving:
            lines.append(f"step {step}: no rank sees keys of the rank {step} behind it, "
                         f"skipped")
        else:
            source, target = (call.rank - step) % call.world, (call.rank + step) % call.world
            got = computed if schedule.receives(step) else "none seen here, not received"
            sent = "sent to" if schedule.sends(step) else "not seen by, not sent to"
            lines.append(f"step {step}, K/V of rank {source}: {got}; own K/V {sent} rank "
                         f"{target}")
    lines += [f"handed to rank {h.peer}, which holds the keys: {h.piece.describe()}"
              for h in schedule.given]
    lines += [f"for rank {h.peer}, with own K/V: {h.piece.describe()}" for h in schedule.taken]
    return tuple(lines)


def _shares(work: tuple[float, ...]) -> str:
    """Every rank's share of the work and the busiest rank against the mean."""
    total = sum(work)
    return (", ".join(f"{w / total:.3f}" for w in work) +
            f"; busiest / mean {max(work) * len(work) / total:.2f}")


def _balance(call: Call, q, k, found: tuple[float, ...], moves: tuple[tuple[int, int], ...],
             handoffs: Balance | None) -> tuple[str, ...]:
    """The cost model's lines: every rank's work and the spread, the rows the ring hands off
    and the work after them, the shards the ring moves, and the other layout where its busiest
    rank has less work (or, about as busy, the ring moves fewer shards), both layouts before
    any hand-off (a layout balanced by itself moves no rows)."""
    ring = call.method == "ring"
    unit = "the (query, key) pairs of the listed blocks" if call.block_mask is not None \
        else "the visible (query, key) pairs"
    total = sum(found)
    if not total:
        return ("work per rank: none, every (query, key) pair is hidden",)
    lines = [f"work per rank (shares of {unit}): {_shares(found)}"]
    if ring and handoffs is not None and handoffs.offloads:
        lines.append(f"rows handed off (busiest / mean above {1 + MARGIN:.2f}):")
        lines += [f"  {o.describe()}: {o.work / total:.3f} of the work"
                  for o in handoffs.offloads]
        lines.append(f"work per rank after: {_shares(handoffs.after)}")
    elif ring and handoffs is not None and max(found) * len(found) > (1 + MARGIN) * total:
        lines.append("no rows handed off: no slice of the busiest rank's rows against keys a "
                     "lighter rank holds lowers its work")
    if ring:
        lines.append(f"K/V shards moved: {len(moves)} of {call.world * (call.world - 1)} "
                     f"(the backward moves them again, and their gradients back)")
    other = "contiguous" if call.layout == "zigzag" else "zigzag"
    if q.shape[1] % chunks_per_rank(other) == 0 and refusal(
            call.method, q, k, call.world, other, call.block_mask, None) is None:
        other_found = _rank_work(call, other)
        own_moves = _kv_moves(call, call.layout) if ring else ()
        other_moves = _kv_moves(call, other) if ring else ()
        busiest, other_busiest = max(found), max(other_found)
        # within 1%, the busiest ranks take as long; then fewer transfers decide
        if other_busiest < 0.99 * busiest or (other_busiest <= 1.01 * busiest
                                              and len(other_moves) < len(own_moves)):
            fewer = f"; K/V shards moved: {len(other_moves)} ({len(own_moves)} here)" \
                if ring else ""
            lines.append(f"layout={other!r} suits these masks better: its busiest rank has "
                         f"{other_busiest / total:.3f} of the work ({busiest / total:.3f} "
                         f"here){fewer}")
    if ring and call.row_lens is not None:
        lines.append("seqlens_k_per_row: the ranks share their rows' largest key lengths at "
                     "run time (one all-gather), which may spare more shards; no rows are "
                     "handed off (the cost model does not see each row's key length)")
    return tuple(lines)
