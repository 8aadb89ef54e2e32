"""A call's explicit schedule: the block mask at the blocks the kernels walk, and the lists of a
block mask, an element mask and/or per-row key lengths built at the tiles the plan chose
(plan.py `list_tiles`)."""
from __future__ import annotations

import math

import torch

from .kernels.elementwise import (Elementwise, TopkTerm, fine_tile_of, mask_forward_schedule,
                                  mask_tile_states, row_length_states, states_schedule,
                                  topk_tile_states)
from .kernels.schedule import KernelArgs, Schedule
from .kernels.sequences import batch_shape
from .plan import CallForm, ListTiles
from .predicate import RelativePredicate, coarsen_states, common_heads
from .runtime.switches import interpreting

SMALLEST_MASK_TILE = 64  # the bf16/fp16 tiles of masked schedules (Triton configs) are 64 or 128


def kernel_block_mask(block_mask, args: KernelArgs, attn_mask, row_lens, packed):
    """The block mask at the blocks the kernels walk. Blocks smaller than the kernels' tiles
    would shrink the tiles: such masks run at coarser blocks whose bitmaps carry the sub-block
    picture. PARTIAL tiles apply one predicate: when attention's terms would cut the mask's FULL
    blocks too, the mask's own predicate moves into bitmaps (not for packed sequences, whose
    predicates sit on each sequence's own diagonal). Conversions are cached on the mask."""
    if block_mask is None:
        return None
    outer = RelativePredicate(args.window_left, args.window_right)
    coarse = tuple(math.lcm(size, SMALLEST_MASK_TILE) for size in block_mask.block_size)
    if coarse != block_mask.block_size and not interpreting():
        block_mask = block_mask.coarsened(*coarse)
    cut_by_outer = (outer & block_mask.predicate) != block_mask.predicate or \
        attn_mask is not None or row_lens is not None
    if not block_mask.predicate.unbounded and cut_by_outer and packed is None:
        block_mask = block_mask.coarsened(*block_mask.block_size)
    return block_mask


def _and_states(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    """The AND of two tile-state maps (B|1, Hs, n|1, n|1): their minimum, at the heads of
    `common_heads` (the larger count where one divides the other, as 1, Hk and H do)."""
    if a is None:
        return b
    return torch.minimum(*common_heads(a, b))


def build_schedule(form: CallForm, lists: ListTiles, attn_mask: torch.Tensor | None,
                   backward: bool = True,
                   topk: TopkTerm | None = None) -> tuple[Schedule, KernelArgs]:
    """The lists of form's block mask (kernel_block_mask's), element mask (attn_mask, the
    caller's tensor), per-row key lengths and/or top-k term, each pass at its `lists` tiles,
    and the kernel arguments whose predicate their PARTIAL tiles apply (attention's ANDed with
    the block mask's). Element-exact tile states (the mask's pre-pass, the lengths' min/max per
    tile, the top-k scores' and thresholds' per tile) are computed once, at the finest tile any
    pass uses, and ANDed. The lists keep the head count of those states (of a block mask's
    where it has more): a mask or top-k term per KV head gives lists per KV head, which the
    query heads of a group share. backward=False (no gradient will flow): lists built per call
    are built for the forward only (those of a mask spanning (Sq, Sk) alone by its pre-pass's
    launch)."""
    q, k, args, block_mask, row_lens, packed = form.q, form.k, form.args, form.block_mask, \
        form.row_lens, form.packed
    num_heads = q.shape[-2]
    _, seqlen_q, seqlen_k = batch_shape(q, k, packed)
    outer_args = args
    outer = RelativePredicate(args.window_left, args.window_right)
    tiles = [lists.forward, lists.dq, lists.dkdv]
    if block_mask is not None:
        merged = outer & block_mask.predicate
        # PARTIAL tiles apply attention's predicate ANDed with the mask's own
        args = KernelArgs(args.softmax_scale, args.softcap, merged.left, merged.right)
    fine_tile = fine_tile_of(*tiles)
    # a mask spanning (Sq, Sk) alone, forward lists only: its pre-pass builds them
    forward_lists_by_pre_pass = not backward and block_mask is None and row_lens is None \
        and topk is None and attn_mask is not None and Elementwise.spans_both(attn_mask)
    element_states = None  # (B|1, Hs, n|1, n|1) at fine_tile
    if attn_mask is not None and not forward_lists_by_pre_pass:
        element_states = mask_tile_states(Elementwise.of(attn_mask, num_heads), seqlen_q,
                                          seqlen_k, *fine_tile, outer_args, packed)
    if row_lens is not None:
        element_states = _and_states(element_states, row_length_states(
            row_lens, seqlen_q, seqlen_k, *fine_tile, packed))
    if topk is not None:
        element_states = _and_states(element_states, topk_tile_states(
            topk, seqlen_q, seqlen_k, *fine_tile, packed))
    if forward_lists_by_pre_pass:
        schedule = mask_forward_schedule(Elementwise.of(attn_mask, num_heads), fine_tile,
                                         seqlen_q, seqlen_k, outer_args, tiles[0], packed)
    elif block_mask is None:
        schedule = states_schedule(element_states, fine_tile, seqlen_q, seqlen_k, outer_args,
                                   *tiles, packed=packed, backward=backward)
    elif element_states is None and packed is None:
        schedule = block_mask.kernel_schedule(*tiles, outer)
    else:
        # element states and per-sequence predicates join the block mask's on the host
        # (tile-granular tensors)
        lengths = packed.seqlens() if packed is not None else None

        def states_at(block_m: int, block_n: int) -> torch.Tensor:
            element = None if element_states is None else coarsen_states(
                element_states, block_m // fine_tile[0], block_n // fine_tile[1])
            return block_mask.kernel_states(block_m, block_n, outer, element, lengths)

        schedule = Schedule.build(states_at, *tiles, block_mask.kernel_bits)
    return schedule.launched_with(*lists.launch), args
