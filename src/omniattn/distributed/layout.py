"""Sequence layouts of context parallelism: which global positions each rank holds, and the
reordering between every rank's shard and the full sequence.

zigzag: the sequence is cut into 2P equal chunks; rank r holds chunks r and 2P-1-r, in that
order (each rank gets one early and one late chunk: equal causal work). contiguous: P equal
chunks, rank r holds chunk r. Positions only: the collectives are in comm.py.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

LAYOUTS = ("zigzag", "contiguous")


class Chunk(NamedTuple):
    """A run of positions a rank holds: `length` positions from global `start`, stored from
    `local` on in the rank's shard."""

    start: int
    local: int
    length: int

    @property
    def stop(self) -> int:
        return self.start + self.length


def check_layout(layout) -> None:
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a str, one of {LAYOUTS}, got {type(layout).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(repr(n) for n in LAYOUTS)}, got "
                         f"{layout!r}")


def chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def required_multiple(layout: str, world: int) -> int:
    """What the global sequence length must be a multiple of."""
    return chunks_per_rank(layout) * world


def chunks(layout: str, rank: int, world: int, seqlen: int) -> tuple[Chunk, ...]:
    """The chunks rank `rank` of `world` holds of a sequence of `seqlen` positions, in shard
    order."""
    if layout == "zigzag":
        length = seqlen // (2 * world)
        return (Chunk(rank * length, 0, length),
                Chunk((2 * world - 1 - rank) * length, length, length))
    length = seqlen // world
    return (Chunk(rank * length, 0, length),)


def check_divides(name: str, seqlen: int, layout: str, world: int, per_rank: bool) -> None:
    """A ValueError naming the multiple required when `seqlen` (the global length, or with
    per_rank the length of one rank's shard) does not split into the layout's chunks."""
    if per_rank:
        per = chunks_per_rank(layout)
        if seqlen % per:
            raise ValueError(f"{name} has {seqlen} positions per rank; layout={layout!r} needs a "
                             f"multiple of {per} (the global length a multiple of "
                             f"{required_multiple(layout, world)} = {per} x {world} ranks)")
        return
    multiple = required_multiple(layout, world)
    if seqlen % multiple:
        how = f"2P = {multiple}" if layout == "zigzag" else f"P = {multiple}"
        raise ValueError(f"{name} has length {seqlen}; layout={layout!r} over {world} ranks "
                         f"needs a multiple of {how}")


def to_global(shards: list[torch.Tensor], layout: str, dim: int) -> torch.Tensor:
    """Every rank's shard (rank order) -> the full tensor in global order along dim."""
    if layout == "contiguous":
        return torch.cat(shards, dim)
    halves = [s.chunk(2, dim) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def to_shards(full: torch.Tensor, layout: str, world: int, dim: int) -> list[torch.Tensor]:
    """The full tensor in global order along dim -> each rank's shard (views where possible)."""
    if layout == "contiguous":
        return list(full.chunk(world, dim))
    pieces = full.chunk(2 * world, dim)
    return [torch.cat((pieces[r], pieces[2 * world - 1 - r]), dim) for r in range(world)]
