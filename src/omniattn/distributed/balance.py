"""Balancing the ring: where the cost model (visibility.rank_work) gives the busiest rank more
work than the mean, slices of its query rows are handed to lighter ranks, each of which computes
them against keys it owns: the helper takes the slice's q rows and returns its partial output and
lse (in the backward: its dq), so no K/V moves for that part and the part's dK / dV / dbias stay
with the keys' owner. Decided on the host from the masks' global structure, alike on every rank
(like visibility.py); per-row key lengths are not in the cost model, so calls with them offload
nothing.

Greedy passes: the busiest rank hands the rows of one (its row chunk, a lighter rank's key
chunk) pair, a prefix or suffix of the rows that see those keys, sized so that the two ranks'
modelled work comes as close to equal as whole granules allow; each pair is handed once and
never against the direction of an earlier hand-off between the same two ranks. A rank may hand
rows on after taking some (a chain of ranks, each seeing the keys of the next). Passes stop when
the busiest rank is within MARGIN of the mean or has nothing to hand; hand-offs after the last
pass that lowered the busiest rank's work are dropped (they would move rows without shortening
the call).
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

from ..masks.block_mask import BlockMask
from ..predicate import RelativePredicate
from .layout import Chunk
from .visibility import layout_chunks, rank_work, row_work, visibility

# Below this excess of the busiest rank over the mean a hand-off costs about what it saves: its
# q rows travel to the helper and its output back (again in the backward), and both ranks make
# one more local call (and merge) for it.
MARGIN = 0.05
# Rows move in multiples of a query tile of the GPU kernels (128), so a slice leaves neither rank
# a partial tile; chunks shorter than MIN_GRANULES tiles (or not a multiple of one) take the
# largest power of two that fits, so that a slice can still be sized. A block mask's slices are
# whole query blocks (its parts start on its grid).
TILE_ROWS = 128
MIN_GRANULES = 16


@dataclass(frozen=True)
class Offload:
    """Global rows [rows.start, rows.stop) of rank `owner` (stored from rows.local in its
    shard), computed by rank `helper` against its own key chunk `keys` (global start, stored
    from keys.local in the helper's shard); `work` the modelled pairs moved; `whole`: these are
    all the rows of the owner's chunk that see `keys`, which that chunk then needs no more."""

    owner: int
    helper: int
    rows: Chunk
    keys: Chunk
    work: float
    whole: bool

    def describe(self) -> str:
        return (f"rows [{self.rows.start}, {self.rows.stop}) of rank {self.owner} computed by "
                f"rank {self.helper} against its own keys [{self.keys.start}, "
                f"{self.keys.stop})")


@dataclass(frozen=True)
class Balance:
    """The hand-offs of a call (in the order every rank posts them) and each rank's modelled
    work before and after them."""

    offloads: tuple[Offload, ...]
    before: tuple[float, ...]
    after: tuple[float, ...]

    def given_away(self, rank: int) -> dict[tuple[int, int], tuple[int, int]]:
        """(global start of a row chunk, of a key chunk) -> the global rows [a, b) of that
        chunk that rank `rank` hands off against those keys."""
        # chunks are all keys.length long and start at multiples of it
        return {(o.rows.start - o.rows.start % o.keys.length, o.keys.start):
                (o.rows.start, o.rows.stop) for o in self.offloads if o.owner == rank}

    def whole_pairs(self) -> set[tuple[int, int]]:
        """(row chunk, key chunk) indices (global order) of the pairs handed off whole."""
        return {(o.rows.start // o.keys.length, o.keys.start // o.keys.length)
                for o in self.offloads if o.whole}


def granule(length: int, block_mask: BlockMask | None) -> int:
    """The rows a slice is a multiple of, for chunks of `length` positions."""
    if block_mask is not None:
        return block_mask.block_size[0]
    rows = TILE_ROWS
    while rows > 1 and (length < MIN_GRANULES * rows or length % rows):
        rows //= 2
    return rows


def balance(layout: str, world: int, seqlen: int, predicate: RelativePredicate,
            block_mask: BlockMask | None) -> Balance:
    """The call's hand-offs; cached per mask object (as visibility's tables) and per call
    shape."""
    if block_mask is None:
        return _predicate_balance(layout, world, seqlen, predicate)
    cache = _mask_balances.setdefault(block_mask, {})
    key = (layout, world, predicate)
    if key not in cache:
        cache[key] = _balanced(layout, world, seqlen, predicate, block_mask)
    return cache[key]


_mask_balances: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=256)
def _predicate_balance(layout: str, world: int, seqlen: int,
                       predicate: RelativePredicate) -> Balance:
    return _balanced(layout, world, seqlen, predicate, None)


@dataclass(frozen=True)
class _Slice:
    granules: tuple[int, int]  # [first, stop) of the chunk's granules
    work: float
    whole: bool


def _balanced(layout, world, seqlen, predicate, block_mask) -> Balance:
    before = rank_work(layout, world, seqlen, predicate, block_mask)
    owned = layout_chunks(layout, world, seqlen)
    table = visibility(layout, world, seqlen, predicate, block_mask)
    length = owned[0][1].length
    step = granule(length, block_mask)
    work, mean = list(before), sum(before) / world
    handed: list[Offload] = []
    directions: set[tuple[int, int]] = set()  # (owner, helper) of the hand-offs so far
    best = (max(work), 0, tuple(work))  # the busiest rank's work, hand-offs kept, every rank's
    for _ in range(len(owned) ** 2):
        busy = max(range(world), key=work.__getitem__)
        if work[busy] <= (1 + MARGIN) * mean:
            break
        found = None
        for i, (owner, rows) in enumerate(owned):
            for j, (helper, keys) in enumerate(owned):
                if owner != busy or helper == busy or work[helper] >= work[busy] \
                        or (helper, busy) in directions or not table.visible[i][j] \
                        or any(o.rows.start // length == i and o.keys.start == keys.start
                               for o in handed):
                    continue
                part = _slice(row_work(rows, keys, predicate, block_mask, step),
                              (work[busy] - work[helper]) / 2)
                if part is None:
                    continue
                # the lower the pair's busier rank ends, the better; then the fewer rows moved
                score = (max(work[busy] - part.work, work[helper] + part.work),
                         part.granules[1] - part.granules[0])
                if score[0] < work[busy] and (found is None or score < found[0]):
                    first, stop = (g * step for g in part.granules)
                    sliced = Chunk(rows.start + first, rows.local + first, stop - first)
                    found = (score, Offload(busy, helper, sliced, keys, part.work, part.whole))
        if found is None:
            break
        offload = found[1]
        handed.append(offload)
        directions.add((offload.owner, offload.helper))
        work[offload.owner] -= offload.work
        work[offload.helper] += offload.work
        if max(work) < best[0]:
            best = (max(work), len(handed), tuple(work))
    return Balance(tuple(handed[:best[1]]), before, best[2])


def _slice(granule_work: list[float], target: float) -> _Slice | None:
    """The run of granules at either end of those that see anything (a prefix or a suffix of
    the visible rows: what stays with the owner is one run) whose work comes nearest `target`,
    the shorter on a tie; None if no granule sees anything."""
    seen = [g for g, w in enumerate(granule_work) if w > 0]
    if not seen or target <= 0:
        return None
    first, last = seen[0], seen[-1] + 1
    best = None
    for from_start in (True, False):
        moved = 0.0
        for n in range(1, last - first + 1):
            moved += granule_work[first + n - 1] if from_start else granule_work[last - n]
            span = (first, first + n) if from_start else (last - n, last)
            candidate = (abs(moved - target), n, _Slice(span, moved, span == (first, last)))
            if best is None or candidate[:2] < best[:2]:
                best = candidate
    return best[2]
