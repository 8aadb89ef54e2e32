"""Pieces: the local attention calls that make up one rank's share of a context-parallel call.

A piece is this rank's query rows of one chunk against the keys of one chunk it holds (or has
gathered), cut to the rows that see any of those keys and the keys any of them sees. Masks are
in global positions; a piece states them in its own: single-device causal and windows are
bottom-right aligned, so a piece whose rows start at global row r0 and end at r1 and whose keys
end at global key b has its diagonal shifted by d = b - r1 (global offset j - i = local offset
+ d), and the cut keeps both window bounds representable (>= 0). A global BlockMask becomes the
piece's own BlockMask over its rectangle, with the call's causal / window folded into it (its
blocks must then start on the mask's block grid). Pieces that see nothing are never computed.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..api import attention as local_attention
from ..api import attention_backward as local_backward
from ..masks.block_mask import BlockMask
from ..masks.evaluate import predicate_blocks
from ..predicate import FULL, HIDDEN, RelativePredicate
from .layout import Chunk


@dataclass(frozen=True)
class Piece:
    """One local attention call: rows [rows[0], rows[1]) of this rank's shard against keys
    [keys[0], keys[1]) of the K/V block held, which start at global key `key_position` (per-row
    key lengths count from it); `causal` / `window` in the piece's own (bottom-right aligned)
    positions, or `block_mask` over the piece's rectangle. `where`: the global rows and keys,
    for explain."""

    rows: tuple[int, int]
    keys: tuple[int, int]
    key_position: int
    causal: bool = False
    window: tuple[int, int] | None = None
    block_mask: BlockMask | None = None
    where: str = ""

    @property
    def unmasked(self) -> bool:
        return not self.causal and self.window is None and self.block_mask is None

    def describe(self) -> str:
        mask = f"its part of block_mask, density {self.block_mask.density:.2f}" \
            if self.block_mask is not None else "causal" if self.causal \
            else f"window={self.window}" if self.window is not None else "every key"
        return f"{self.where}: {mask}"

    def run(self, q, k, v, attn_bias, row_lens, options: dict, topk_scores=None):
        """(out (B, rows, H, D), lse (B, H, rows) float32) of this piece: q this rank's shard,
        k / v (B, keys held, Hk, D) and attn_bias / topk_scores (B|1, Hm, 1, keys held) the
        block held, row_lens (B, S/P) this rank's rows' global key lengths."""
        tensors, keywords = self._call(q, k, v, attn_bias, row_lens, options, topk_scores)
        return local_attention(*tensors, return_lse=True, **keywords)

    def gradients(self, dout, out, lse, dlse, q, k, v, attn_bias, row_lens, options: dict):
        """(dq (B, rows, H, D), dk / dv (B, keys, Hk, D), dbias (B|1, Hm, 1, keys) or None) of
        this piece, from the merged out (B, S/P, H, D) and lse (B, H, S/P) of this rank's rows
        (the softmax over every key they see) and their gradients dout, dlse | None: the
        piece's share of the rows' gradients, with no forward. Arguments as run's; dbias when
        attn_bias requires grad."""
        (i0, i1) = self.rows
        tensors, keywords = self._call(q, k, v, attn_bias, row_lens, options)
        if attn_bias is not None and attn_bias.requires_grad:
            # the slice as a leaf of its own, whatever the grad mode: its gradient is asked for
            keywords["attn_bias"] = keywords["attn_bias"].detach().requires_grad_()
        return local_backward(dout[:, i0:i1], *tensors, out[:, i0:i1], lse[..., i0:i1],
                              dlse[..., i0:i1] if dlse is not None else None, **keywords)

    def _call(self, q, k, v, attn_bias, row_lens, options: dict, topk_scores=None):
        """(q, k, v) and the keywords of this piece's local call."""
        (i0, i1), (j0, j1) = self.rows, self.keys
        lens = None
        if row_lens is not None:
            lens = (row_lens[:, i0:i1] - self.key_position).clamp(0, j1 - j0).to(torch.int32)
        extra = dict(options)
        if topk_scores is not None:
            extra["topk_scores"] = topk_scores[..., j0:j1]
        if attn_bias is not None:
            extra["attn_bias"] = attn_bias[..., j0:j1]
        return (q[:, i0:i1], k[:, j0:j1], v[:, j0:j1]), dict(
            causal=self.causal, window=self.window, block_mask=self.block_mask,
            seqlens_k_per_row=lens,
            # the lengths were checked once, globally, and clamped here: no sync per piece
            check_inputs=lens is None, **extra)


def cut(rows: Chunk, keys: Chunk, predicate: RelativePredicate) -> Piece | None:
    """The piece of global rows `rows` against global keys `keys` under causal / window
    `predicate` (global positions, Sq = Sk: the diagonal is j = i), or None when no row sees
    any key."""
    left, right = predicate.left, predicate.right
    r0, r1, a, b = rows.start, rows.stop, keys.start, keys.stop
    # rows that see a key of [a, b), then the keys those rows see
    if right >= 0:
        r0 = max(r0, a - right)
    if left >= 0:
        r1 = min(r1, b + left)
    if r0 >= r1:
        return None
    if left >= 0:
        a = max(a, r0 - left)
    if right >= 0:
        b = min(b, r1 + right)
    where = f"rows [{r0}, {r1}) x keys [{a}, {b})"
    local_rows = (r0 - rows.start + rows.local, r1 - rows.start + rows.local)
    local_keys = (a - keys.start + keys.local, b - keys.start + keys.local)
    # whether every row sees every key: then no predicate at all
    if (left < 0 or a - (r1 - 1) >= -left) and (right < 0 or (b - 1) - r0 <= right):
        return Piece(local_rows, local_keys, a, where=where)
    shift = b - r1
    left, right = (left + shift if left >= 0 else -1), (right - shift if right >= 0 else -1)
    causal = left < 0 and right == 0
    return Piece(local_rows, local_keys, a, causal=causal,
                 window=None if causal else (left, right), where=where)


def masked_piece(rows: Chunk, keys: Chunk, predicate: RelativePredicate,
                 block_mask: BlockMask) -> Piece | None:
    """The piece of rows x keys (a whole key chunk; rows starting on the mask's block grid)
    under a global block mask ANDed with `predicate`, or None when the mask hides all of it."""
    part = block_mask_part(block_mask, (rows.start, rows.stop), (keys.start, keys.stop),
                           predicate)
    if part is None:
        return None
    n_rows, n_keys = part.seq_lengths
    where = f"rows [{rows.start}, {rows.start + n_rows}) x keys [{keys.start}, " \
        f"{keys.start + n_keys})"
    return Piece((rows.local, rows.local + n_rows), (keys.local, keys.local + n_keys),
                 keys.start, block_mask=part, where=where)


def pieces(row_chunks, key_chunks, predicate: RelativePredicate, block_mask: BlockMask | None,
           by_position: bool, sees=None, given_away=None) -> list[Piece]:
    """This rank's pieces of its row chunks against the key chunks held, leaving out the pairs
    for which sees(rows, keys) is False and the rows another rank computes: given_away maps
    (row chunk start, key chunk start) to the global rows [a, b) of it handed off (balance.py).
    Unmasked pieces next to each other in the shards become one call, unless by_position
    (per-row key lengths count keys from a piece's first global key, so its keys must be
    consecutive there)."""
    found = []
    for chunk in row_chunks:
        for keys in key_chunks:
            if sees is not None and not sees(chunk, keys):
                continue
            handed = (given_away or {}).get((chunk.start, keys.start))
            for rows in _kept(chunk, handed) if handed is not None else (chunk,):
                piece = masked_piece(rows, keys, predicate, block_mask) \
                    if block_mask is not None else cut(rows, keys, predicate)
                if piece is not None:
                    found.append(piece)
    if by_position:
        return found
    return _joined(_joined(found, along_keys=True), along_keys=False)


def _kept(chunk: Chunk, handed: tuple[int, int]) -> list[Chunk]:
    """The runs of `chunk` outside the global rows [a, b) handed off."""
    a, b = handed
    return [Chunk(start, chunk.local + start - chunk.start, stop - start)
            for start, stop in ((chunk.start, a), (b, chunk.stop)) if stop > start]


def _joined(found: list[Piece], along_keys: bool) -> list[Piece]:
    """Unmasked pieces with the same rows and adjacent keys (or the same keys and adjacent
    rows) as one piece."""
    joined: list[Piece] = []
    for piece in found:
        for i, other in enumerate(joined):
            same, near = ("rows", "keys") if along_keys else ("keys", "rows")
            if not (piece.unmasked and other.unmasked
                    and getattr(piece, same) == getattr(other, same)):
                continue
            if getattr(other, near)[1] == getattr(piece, near)[0]:
                span = (getattr(other, near)[0], getattr(piece, near)[1])
                joined[i] = Piece(**{same: getattr(piece, same), near: span},
                                  key_position=other.key_position,
                                  where=f"{other.where} + {piece.where}")
                break
        else:
            joined.append(piece)
    return joined


# a global BlockMask's parts, per (rows, keys, predicate), kept as long as the mask lives: a
# mask reused across layers and steps is cut once
_parts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def block_mask_part(mask: BlockMask, rows: tuple[int, int], keys: tuple[int, int],
                    predicate: RelativePredicate) -> BlockMask | None:
    """The BlockMask of global rows [r0, r1) x keys [a, b) of `mask` ANDed with `predicate`
    (global positions), its rectangle starting at (r0, a) on the mask's block grid and ending
    where the last row sees a key and the last key is seen (its seq_lengths); None if all
    hidden. Its blocks are the mask's. Where the mask's PARTIAL blocks apply its predicate alone
    (no bitmaps), the part keeps one window of its own; otherwise its partial blocks carry
    element bitmaps of what they show, which no Gluon kernel reads."""
    cache = _parts.setdefault(mask, {})
    key = (rows, keys, predicate)
    if key not in cache:
        cache[key] = _cut_block_mask(mask, rows, keys, predicate)
    return cache[key]


def _window_part(mask: BlockMask, rows, keys, predicate) -> BlockMask | None:
    """block_mask_part with the mask's and the call's predicates as one bottom-right aligned
    window of the part: the ends are cut as `cut` cuts them (rows past the last key's reach,
    keys past the last row's), which keeps both window bounds >= 0."""
    combined = predicate & mask.predicate
    (r0, r1), (a, b) = rows, keys
    if combined.left >= 0:
        r1 = min(r1, b + combined.left)
    if combined.right >= 0:
        b = min(b, r1 + combined.right)
    if r0 >= r1 or a >= b:
        return None
    shift = b - r1
    own = RelativePredicate(combined.left + shift if combined.left >= 0 else -1,
                            combined.right - shift if combined.right >= 0 else -1)
    block_q, block_k = mask.block_size
    states = _mask_states(mask)[0][..., r0 // block_q:-(-r1 // block_q),
                                   a // block_k:-(-b // block_k)]
    states = torch.minimum(states, own.classify(r1 - r0, b - a, block_q, block_k,
                                                device=states.device))
    if not bool((states != HIDDEN).any()):
        return None
    return BlockMask.from_states(states, (block_q, block_k), (r1 - r0, b - a),
                                 window=(own.left, own.right))


def _cut_block_mask(mask: BlockMask, rows, keys, predicate) -> BlockMask | None:
    states, window_parts = _mask_states(mask)
    if window_parts:
        return _window_part(mask, rows, keys, predicate)
    (r0, r1), (a, b) = rows, keys
    block_q, block_k = mask.block_size
    seqlen_q, seqlen_k = mask.seq_lengths
    device = mask.kv_indices.device
    q_blocks = slice(r0 // block_q, -(-r1 // block_q))
    k_blocks = slice(a // block_k, -(-b // block_k))
    hint = states[..., q_blocks, k_blocks]
    if not predicate.unbounded:
        outer = predicate.classify(seqlen_q, seqlen_k, block_q, block_k, device=device)
        hint = torch.minimum(hint, outer[q_blocks, k_blocks])
    if not bool((hint != HIDDEN).any()):
        return None

    def mask_mod(b_idx, h_idx, q_idx, kv_idx):
        q_global, kv_global = q_idx + r0, kv_idx + a
        keep = mask.mask_mod(b_idx, h_idx, q_global, kv_global)
        return keep & predicate.holds(q_global, kv_global, seqlen_q, seqlen_k)

    states, bits, slots = predicate_blocks(mask_mod, *hint.shape[:2], r1 - r0, b - a,
                                           (block_q, block_k), device, block_states=hint)
    if not bool((states != HIDDEN).any()):
        return None
    return BlockMask.from_states(states, (block_q, block_k), (r1 - r0, b - a),
                                 element_bits=bits, element_slots=slots)


# a global BlockMask's dense block states and whether its parts can keep a window of their own,
# computed once per mask for all its parts
_whole_masks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _mask_states(mask: BlockMask) -> tuple[torch.Tensor, bool]:
    """(mask.states, window_parts): window_parts where the mask's PARTIAL blocks apply its
    predicate alone (no bitmaps) and none of its FULL blocks is one the predicate would cut (a
    PARTIAL block of a part, which applies the predicate, must not hide what the mask shows)."""
    if mask not in _whole_masks:
        states = mask.states
        window_parts = mask.element_bits is None
        if window_parts and not mask.predicate.unbounded:
            own = mask.predicate.classify(*mask.seq_lengths, *mask.block_size,
                                          device=mask.kv_indices.device)
            window_parts = not bool(((states == FULL) & (own != FULL)).any())
        _whole_masks[mask] = (states, window_parts)
    return _whole_masks[mask]


_head_parts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def block_mask_heads(mask: BlockMask, rank: int, world: int) -> BlockMask:
    """Rank `rank`'s H/P heads of a mask with per-head lists (one shared by every head stays
    as it is)."""
    heads = mask.kv_num_blocks.shape[1]
    if heads == 1:
        return mask
    cache = _head_parts.setdefault(mask, {})
    if (rank, world) not in cache:
        part = slice(rank * heads // world, (rank + 1) * heads // world)
        slots = mask.element_slots
        cache[(rank, world)] = BlockMask(
            mask.kv_num_blocks[:, part], mask.kv_indices[:, part],
            mask.full_kv_num_blocks[:, part], mask.full_kv_indices[:, part],
            block_size=mask.block_size, seq_lengths=mask.seq_lengths,
            window=(mask.predicate.left, mask.predicate.right),
            element_bits=mask.element_bits,
            element_slots=slots[:, part] if slots is not None else None)
    return cache[(rank, world)]


def merge(out: torch.Tensor, lse: torch.Tensor, rows: tuple[int, int],
          piece_out: torch.Tensor, piece_lse: torch.Tensor) -> None:
    """Adds a piece's softmax to rows [rows) of the running float32 out (B, S/P, H, D) and lse
    (B, H, S/P), in place: both rescaled to the new log-sum-exp. Rows that have seen no key
    keep out 0 and lse -inf."""
    i0, i1 = rows
    old = lse[..., i0:i1]
    new = torch.logaddexp(old, piece_lse)
    # exp(-inf - 0) = 0 where neither has seen a key (exp(-inf - -inf) would be NaN)
    finite = new.masked_fill(new == float("-inf"), 0.0)
    keep_old = torch.exp(old - finite).transpose(1, 2).unsqueeze(-1)
    take_new = torch.exp(piece_lse - finite).transpose(1, 2).unsqueeze(-1)
    rows_out = out[:, i0:i1]
    rows_out.mul_(keep_old).add_(piece_out.float() * take_new)
    old.copy_(new)
