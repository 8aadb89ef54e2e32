"""What a context-parallel call's masks leave visible, per chunk of the layout, decided on the
host from their global structure and alike on every rank: whether any row of one chunk sees any
key of another (the ring moves and computes only the K/V shards some row of a rank sees), and a
cost model of each rank's work (the (query, key) pairs it computes), which explain reports with
the layout that would suit the masks better.

Chunks are the layout's (2P of S/2P positions zigzag, P of S/P contiguous), indexed in global
order. The table is exact for causal / window (`cut`); with a block mask it is taken at the
mask's blocks (a listed block counts as visible, whatever its element bitmap), so a rank may
receive a shard that its pieces then find empty, never miss one it needs. Per-row key lengths
narrow it per call (`narrowed`).
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

from ..masks.block_mask import BlockMask
from ..predicate import HIDDEN, RelativePredicate
from .layout import Chunk, chunks
from .pieces import cut


def layout_chunks(layout: str, world: int, seqlen: int) -> list[tuple[int, Chunk]]:
    """Every chunk of the layout as (owner rank, Chunk), in global order."""
    owned = [(rank, chunk) for rank in range(world)
             for chunk in chunks(layout, rank, world, seqlen)]
    return sorted(owned, key=lambda item: item[1].start)


@dataclass(frozen=True)
class Visibility:
    """visible[i][j]: some row of chunk i sees some key of chunk j (global chunk indices);
    `owners[i]` the rank holding chunk i."""

    length: int  # positions per chunk
    owners: tuple[int, ...]
    visible: tuple[tuple[bool, ...], ...]

    def sees(self, rows: Chunk, keys: Chunk) -> bool:
        return self.visible[rows.start // self.length][keys.start // self.length]

    def needs(self, world: int) -> tuple[tuple[bool, ...], ...]:
        """(P x P) needs[r][s]: rank r's rows see a key of rank s's shard."""
        found = [[False] * world for _ in range(world)]
        for i, row in enumerate(self.visible):
            for j, seen in enumerate(row):
                if seen:
                    found[self.owners[i]][self.owners[j]] = True
        return tuple(tuple(row) for row in found)

    def without(self, pairs) -> "Visibility":
        """The table with the (row chunk, key chunk) index pairs `pairs` hidden: pairs whose
        every visible row is computed by another rank (balance.py)."""
        visible = tuple(tuple(seen and (i, j) not in pairs for j, seen in enumerate(row))
                        for i, row in enumerate(self.visible))
        return Visibility(self.length, self.owners, visible)

    def narrowed(self, reach: list[int]) -> "Visibility":
        """Under per-row key lengths: reach[i], the largest key length of chunk i's rows (row
        x sees keys [0, len_x)), hides every chunk starting at or past it."""
        visible = tuple(tuple(seen and j * self.length < reach[i] for j, seen in enumerate(row))
                        for i, row in enumerate(self.visible))
        return Visibility(self.length, self.owners, visible)


def visibility(layout: str, world: int, seqlen: int, predicate: RelativePredicate,
               block_mask: BlockMask | None) -> Visibility:
    """The chunk table of a call's causal / window `predicate` and global `block_mask` (whose
    blocks divide the chunks); cached per mask object and per call shape."""
    if block_mask is None:
        return _predicate_visibility(layout, world, seqlen, predicate)
    cache = _mask_tables.setdefault(block_mask, {})
    key = (layout, world, predicate)
    if key not in cache:
        owned = layout_chunks(layout, world, seqlen)
        length = owned[0][1].length
        block_q, block_k = block_mask.block_size
        n = len(owned)
        seen = _block_grid(block_mask, predicate) > 0  # (n_q_blocks, n_k_blocks)
        table = seen.view(n, length // block_q, n, length // block_k).any(3).any(1)
        cache[key] = Visibility(length, tuple(rank for rank, _ in owned),
                                tuple(tuple(row) for row in table.tolist()))
    return cache[key]


@functools.lru_cache(maxsize=256)
def _predicate_visibility(layout: str, world: int, seqlen: int,
                          predicate: RelativePredicate) -> Visibility:
    owned = layout_chunks(layout, world, seqlen)
    visible = tuple(tuple(cut(rows, keys, predicate) is not None for _, keys in owned)
                    for _, rows in owned)
    return Visibility(owned[0][1].length, tuple(rank for rank, _ in owned), visible)


# per global BlockMask: its chunk tables and block grids, kept as long as the mask lives (a mask
# reused across layers and steps is read once)
_mask_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_mask_grids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _block_grid(mask: BlockMask, predicate: RelativePredicate) -> torch.Tensor:
    """float32 (n_q_blocks, n_k_blocks) on the CPU: the share of the mask's (batch, head) lists
    listing each block, with the call's causal / window ANDed in."""
    cache = _mask_grids.setdefault(mask, {})
    if predicate not in cache:
        states = mask.states
        if not predicate.unbounded:
            seqlen_q, seqlen_k = mask.seq_lengths
            outer = predicate.classify(seqlen_q, seqlen_k, *mask.block_size,
                                       device=states.device)
            states = torch.minimum(states, outer)
        cache[predicate] = (states != HIDDEN).float().mean((0, 1)).cpu()
    return cache[predicate]


def rank_work(layout: str, world: int, seqlen: int, predicate: RelativePredicate,
              block_mask: BlockMask | None) -> tuple[float, ...]:
    """The cost model: each rank's visible (query, key) pairs, its rows against every key:
    exact under causal / window; with a block mask, the area of the blocks it lists (averaged
    over its batch and head lists) that the causal / window leave visible."""
    grid = _block_grid(block_mask, predicate) if block_mask is not None else None
    work = [0.0] * world
    for rank, rows in layout_chunks(layout, world, seqlen):
        if grid is not None:
            block_q, block_k = block_mask.block_size
            listed = grid[rows.start // block_q:rows.stop // block_q].sum()
            work[rank] += float(listed) * block_q * block_k
        else:
            work[rank] += int(_visible_keys(rows, Chunk(0, 0, seqlen), predicate).sum())
    return tuple(work)


def row_work(rows: Chunk, keys: Chunk, predicate: RelativePredicate,
             block_mask: BlockMask | None, granule: int) -> list[float]:
    """The cost model of rows x keys (two chunks of the layout) per `granule` rows: the visible
    (query, key) pairs of each run of `granule` rows (with a block mask, granule its query
    block size: the area of the blocks listed in that block row, as rank_work counts it)."""
    if block_mask is not None:
        block_q, block_k = block_mask.block_size
        grid = _block_grid(block_mask, predicate)
        listed = grid[rows.start // block_q:rows.stop // block_q,
                      keys.start // block_k:keys.stop // block_k].sum(1)
        return (listed.double() * block_q * block_k).tolist()
    return _visible_keys(rows, keys, predicate).view(-1, granule).sum(1).double().tolist()


def _visible_keys(rows: Chunk, keys: Chunk, predicate: RelativePredicate) -> torch.Tensor:
    """int64 (rows,): how many keys of `keys` each row of `rows` sees under the predicate (key
    j visible to row i iff -left <= j - i <= right)."""
    row = torch.arange(rows.start, rows.stop, dtype=torch.int64)
    first = (row - predicate.left).clamp(min=keys.start) if predicate.left >= 0 \
        else torch.full_like(row, keys.start)
    stop = (row + predicate.right + 1).clamp(max=keys.stop) if predicate.right >= 0 \
        else torch.full_like(row, keys.stop)
    return (stop - first).clamp(min=0)
