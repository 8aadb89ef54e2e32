"""`omniattn.attention`: validate, normalise, choose the schedule, dispatch to a backend."""
from __future__ import annotations

import math
import weakref

import torch

from . import call_plans
from .autograd import (attention_with_graph, forward_parts, kernel_inputs, records_graph,
                       triton_attention)
from .kernels.configs import (backward_config, forward_config, hopper_forward_config,
                               interpreting)
from .kernels.elementwise import (Elementwise, fine_tile_of, mask_forward_schedule,
                                  mask_tile_states, row_length_states, states_schedule)
from .kernels.fwd_hopper import gluon_candidate
from .kernels.schedule import KernelArgs, Schedule
from .kernels.sequences import PackedSequences, batch_shape, length_order
from .masks.block_mask import BlockMask
from .predicate import RelativePredicate, check_window, coarsen_states
from .reference import attention_reference

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MASK_DTYPES = (torch.bool, torch.uint8, *SUPPORTED_DTYPES)
MAX_HEAD_DIM = 256
DROPOUT_LEVELS = 2 ** 16  # the kernels' dropout draws are 16-bit
SMALLEST_MASK_TILE = 64  # the bf16/fp16 tiles of masked schedules (configs.py) are 64 or 128

def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _check_qkv(q, k, v, packed: bool) -> None:
    dims, layout = (3, "(total, heads, head_dim) with cu_seqlens_q/k") if packed else \
        (4, "(batch, seqlen, heads, head_dim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; expected torch.float16, torch.bfloat16 "
                            f"or torch.float32")
        if t.dim() != dims:
            hint = "" if packed or t.dim() != 3 else " (3-D packed inputs need cu_seqlens_q/k)"
            raise ValueError(f"{name} must be {dims}-D {layout}, got {_describe(t)}{hint}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    num_heads, head_dim = q.shape[-2:]
    if k.shape != v.shape:
        kv_layout = "(total_k, Hk, D)" if packed else "(B, Sk, Hk, D)"
        raise ValueError(f"k and v must have the same shape {kv_layout}, got k {tuple(k.shape)} "
                         f"and v {tuple(v.shape)}")
    if not packed and k.shape[0] != q.shape[0]:
        raise ValueError(f"k has batch size {k.shape[0]} but q has {q.shape[0]}")
    if k.shape[-1] != head_dim:
        raise ValueError(f"k/v have head_dim {k.shape[-1]} but q has {head_dim}")
    if head_dim > MAX_HEAD_DIM or head_dim < 1:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim} "
                         f"(q {_describe(q)})")
    num_heads_k = k.shape[-2]
    if num_heads_k == 0 or num_heads % num_heads_k != 0:
        raise ValueError(f"the number of query heads ({num_heads}) must be a multiple of the "
                         f"number of key/value heads ({num_heads_k}) for GQA/MQA")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension, got "
                             f"strides {t.stride()}; call {name}.contiguous() first")


def _check_options(causal, window, softmax_scale, softcap, dropout_p) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    check_window(window)
    if softmax_scale is not None:
        if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
            raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
        if not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(f"softmax_scale must be a finite positive number, got {softmax_scale}")
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap}")
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")


def _check_block_mask(block_mask, q, k, packed: PackedSequences | None) -> None:
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be an omniattn.BlockMask, got {type(block_mask).__name__}"
                        f" (a FlexAttention BlockMask converts with omniattn.BlockMask.from_flex)")
    batch, seqlen_q, seqlen_k = batch_shape(q, k, packed)
    num_heads = q.shape[-2]
    mask_batch, mask_heads = block_mask.kv_num_blocks.shape[:2]
    if block_mask.seq_lengths != (seqlen_q, seqlen_k):
        lengths = "max_seqlen_q = {}, max_seqlen_k = {} (packed: the mask covers the longest " \
            "sequences)" if packed is not None else "Sq = {}, Sk = {}"
        raise ValueError(f"block_mask was built for (Sq, Sk) = {block_mask.seq_lengths}, but q/k "
                         f"have {lengths.format(seqlen_q, seqlen_k)}")
    if mask_batch not in (1, batch) or mask_heads not in (1, num_heads):
        raise ValueError(f"block_mask lists have batch/head dims ({mask_batch}, {mask_heads}); "
                         f"expected (1 or {batch}, 1 or {num_heads})")
    if block_mask.kv_indices.device != q.device:
        raise ValueError(f"block_mask is on {block_mask.kv_indices.device} but q is on {q.device}")


def _check_elementwise(name: str, t, dtypes, q: torch.Tensor, k: torch.Tensor,
                       packed: PackedSequences | None) -> None:
    """attn_mask / attn_bias: 4-D (packed: 3-D (total_q, Hm, max_seqlen_k)), each dim 1 or full,
    heads in {1, Hk, H}; never expanded."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of "
                        f"{', '.join(str(d) for d in dtypes)}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    num_heads, num_heads_k = q.shape[-2], k.shape[-2]
    if packed is not None:
        total_q, max_k = q.shape[0], packed.max_seqlen_k
        if (t.dim() != 3 or t.shape[0] not in (1, total_q)
                or t.shape[1] not in (1, num_heads_k, num_heads) or t.shape[2] not in (1, max_k)):
            raise ValueError(f"{name} has shape {tuple(t.shape)}; packed sequences take "
                             f"(total_q={total_q}, H in {{1,{num_heads_k},{num_heads}}}, "
                             f"max_seqlen_k={max_k}), row i's keys counted from its sequence's "
                             f"first key; size-1 dims broadcast")
        return
    batch, seqlen_q = q.shape[:2]
    seqlen_k = k.shape[1]
    if (t.dim() != 4 or t.shape[0] not in (1, batch) or t.shape[1] not in (1, num_heads_k, num_heads)
            or t.shape[2] not in (1, seqlen_q) or t.shape[3] not in (1, seqlen_k)):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, not broadcastable to (B={batch}, "
                         f"H in {{1,{num_heads_k},{num_heads}}}, Sq={seqlen_q}, Sk={seqlen_k}); "
                         f"size-1 dims broadcast")


def _check_packed(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  check_inputs: bool) -> PackedSequences:
    """cu_seqlens_q/k: int32 (B + 1,) on q's device, from 0 to total, non-decreasing;
    max_seqlen_q/k: ints at least the longest sequence (computed, with a sync, when None)."""
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("varlen needs both cu_seqlens_q and cu_seqlens_k (int32, batch + 1)")
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]),
                            ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must be 1-D (batch + 1,) with batch >= 1, got shape "
                             f"{tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
        if check_inputs:
            bounds = cu.tolist()
            if bounds[0] != 0 or bounds[-1] != total or any(
                    b < a for a, b in zip(bounds, bounds[1:])):
                raise ValueError(f"{name} must start at 0, end at the packed length {total} and "
                                 f"never decrease, got {bounds}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one entry per sequence + 1, "
                         f"got {cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    maxima = []
    for name, given, cu in (("max_seqlen_q", max_seqlen_q, cu_seqlens_q),
                            ("max_seqlen_k", max_seqlen_k, cu_seqlens_k)):
        if given is not None and (not isinstance(given, int) or isinstance(given, bool)):
            raise TypeError(f"{name} must be an int or None, got {type(given).__name__}")
        longest = int((cu[1:] - cu[:-1]).max()) if given is None or check_inputs else given
        if given is not None and given < longest:
            raise ValueError(f"{name} = {given} is shorter than the longest sequence ({longest})")
        maxima.append(longest if given is None else given)
    return PackedSequences(cu_seqlens_q, cu_seqlens_k, *maxima)


# seqlens_k_per_row tensors whose values passed the range check, by id: (a weak reference, the
# tensor's version and the Sk it was checked against). A training step passes one lengths
# tensor to every layer: it is read on the host (a sync) once, and the calls after it can be
# replayed from call plans (H100, B2 H16 D128 8k forward: 1.14-1.44 ms per call, synced every
# call, against ~0.9 ms of kernels)
_checked_row_lens: dict[int, tuple[weakref.ref, int, int]] = {}


def _remember_checked(row_lens: torch.Tensor, seqlen_k: int) -> None:
    try:
        version = row_lens._version
    except RuntimeError:  # inference tensors keep no version
        return
    key = id(row_lens)
    ref = weakref.ref(row_lens, lambda _, key=key: _checked_row_lens.pop(key, None))
    _checked_row_lens[key] = (ref, version, seqlen_k)


def _known_checked(row_lens, k: torch.Tensor) -> bool:
    """Whether seqlens_k_per_row passed the range check for this Sk and is unchanged since
    (no in-place write bumped its version); reads no value."""
    entry = _checked_row_lens.get(id(row_lens))
    if entry is None or entry[0]() is not row_lens or not isinstance(k, torch.Tensor) \
            or k.dim() != 4 or entry[2] != k.shape[1]:
        return False
    try:
        return entry[1] == row_lens._version
    except RuntimeError:
        return False


def _check_row_lens(row_lens, q, k, packed: PackedSequences | None,
                    check_inputs: bool) -> torch.Tensor:
    """seqlens_k_per_row: int32 (B, Sq) or (B * Sq,) (packed: (total_q,)), values in [0, Sk] of
    the row's sequence. Returns it contiguous, (B, Sq) or packed (total_q,)."""
    if not isinstance(row_lens, torch.Tensor):
        raise TypeError(f"seqlens_k_per_row must be a torch.Tensor, got {type(row_lens).__name__}")
    if row_lens.dtype != torch.int32:
        raise TypeError(f"seqlens_k_per_row must be int32, got {row_lens.dtype}")
    if row_lens.device != q.device:
        raise ValueError(f"seqlens_k_per_row is on {row_lens.device} but q is on {q.device}")
    if packed is not None:
        shapes, normal = [(q.shape[0],)], (q.shape[0],)
    else:
        shapes, normal = [(q.shape[0], q.shape[1]), (q.shape[0] * q.shape[1],)], q.shape[:2]
    if tuple(row_lens.shape) not in shapes:
        raise ValueError(f"seqlens_k_per_row has shape {tuple(row_lens.shape)}; expected "
                         f"{' or '.join(str(s) for s in shapes)}")
    given = row_lens
    row_lens = row_lens.reshape(normal).contiguous()
    if check_inputs and row_lens.numel():
        if packed is not None:
            lens_q, lens_k = packed.seqlens()
            limit = torch.repeat_interleave(lens_k, lens_q.long(), output_size=q.shape[0])
        else:
            limit = torch.full_like(row_lens, k.shape[1])
        bad = (row_lens < 0) | (row_lens > limit)
        if bool(bad.any()):
            first = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(f"seqlens_k_per_row must lie in [0, Sk] of its row's sequence; "
                             f"entry {first} is {int(row_lens[first])} (Sk = {int(limit[first])})"
                             f"; pass check_inputs=False to skip this check (it syncs)")
        if packed is None:
            _remember_checked(given, k.shape[1])
    return row_lens


def _kernel_tile(block: int, preferred: int) -> int:
    """Largest power-of-two tile <= preferred (>= 16) dividing the mask's block."""
    tile = preferred
    while block % tile:
        tile //= 2
    return tile


def _gluon_walks_blocks(block_mask: BlockMask, head_dim: int, full_bias: bool) -> bool:
    """Whether the Gluon forward can walk this block mask's lists at its own tiles: no element
    bitmaps, blocks whole multiples of its tiles (the caller checked the rest)."""
    tile = hopper_forward_config(head_dim, full_bias)
    return block_mask.kernel_bits is None and block_mask.block_size[0] % tile.block_m == 0 \
        and block_mask.block_size[1] % tile.block_n == 0


def _explicit_schedule(q, k, args: KernelArgs, block_mask, attn_mask, attn_bias=None,
                       row_lens=None, packed: PackedSequences | None = None,
                       backward: bool = True, dropout: bool = False):
    """Schedule of a block mask, an element mask and/or per-row key lengths, each pass at its
    own tiles, and the kernel arguments whose predicate its PARTIAL tiles apply (attention's
    ANDed with the block mask's). Element-exact tile states (the mask's pre-pass, the lengths'
    min/max per tile) are computed once, at the finest tile any pass uses, and ANDed.
    backward=False (no gradient will flow): lists built per call are built for the forward only
    (those of a mask spanning (Sq, Sk) alone by its pre-pass's launch).
    Element masks and block masks the Gluon forward takes (no lengths, packing, dropout or
    bitmaps, blocks multiples of its tiles: `_gluon_walks_blocks`; no element mask with a left
    window bound) get forward lists at its tiles."""
    head_dim, num_heads = q.shape[-1], q.shape[-2]
    _, seqlen_q, seqlen_k = batch_shape(q, k, packed)
    outer_args = args
    outer = RelativePredicate(args.window_left, args.window_right)
    if block_mask is not None:
        # blocks smaller than the kernels' tiles would shrink the tiles: such masks run at
        # coarser blocks whose bitmaps carry the sub-block picture (converted once, cached)
        coarse = tuple(math.lcm(size, SMALLEST_MASK_TILE) for size in block_mask.block_size)
        if coarse != block_mask.block_size and not interpreting():
            block_mask = block_mask.coarsened(*coarse)
        # PARTIAL tiles apply one predicate: when attention's terms would cut the mask's FULL
        # blocks too, the mask's own predicate moves into bitmaps (converted once, cached).
        # Not for packed sequences, whose predicates sit on each sequence's own diagonal.
        cut_by_outer = (outer & block_mask.predicate) != block_mask.predicate or \
            attn_mask is not None or row_lens is not None
        if not block_mask.predicate.unbounded and cut_by_outer and packed is None:
            block_mask = block_mask.coarsened(*block_mask.block_size)
    elementwise = attn_mask is not None or attn_bias is not None
    full_bias = attn_bias is not None and Elementwise.spans_both(attn_bias)
    # per-row lengths alone, or a block mask without PARTIAL blocks, leave most visited tiles
    # FULL: the dense (or causal) tiles stay the best
    sparse = attn_mask is not None or args.masked or (
        block_mask is not None and block_mask.has_partial_blocks)
    # an element mask's lists with a left window bound keep fwd.py's 64 x 64 tiles, which waste
    # less of the window's edges than the Gluon 128 x 128 ones. H100, B2 H16 4k, a 75% random
    # mask + key bias, window (1024, 0), forward kernel ms: 0.284-0.288 / 0.297-0.303 Gluon
    gluon = row_lens is None and packed is None and not dropout \
        and not (attn_mask is not None and args.has_left) \
        and gluon_candidate(q, args, attn_bias if full_bias else None) \
        and (block_mask is None or _gluon_walks_blocks(block_mask, head_dim, full_bias))
    fwd = forward_config(head_dim, q.dtype, masked=sparse, elementwise=elementwise, gluon=gluon,
                         full_bias=full_bias)
    bwd = backward_config(head_dim, q.dtype, masked=sparse, full_bias=full_bias)
    tiles = [(fwd.block_m, fwd.block_n), (bwd.block_m2, bwd.block_n2), (bwd.block_m1, bwd.block_n1)]
    if block_mask is not None:
        block_q, block_k = block_mask.block_size
        tiles = [(_kernel_tile(block_q, m), _kernel_tile(block_k, n)) for m, n in tiles]
        merged = outer & block_mask.predicate
        # PARTIAL tiles apply attention's predicate ANDed with the mask's own
        args = KernelArgs(args.softmax_scale, args.softcap, merged.left, merged.right)
    fine_tile = fine_tile_of(*tiles)
    # a mask spanning (Sq, Sk) alone, forward lists only: its pre-pass builds them
    forward_lists_by_pre_pass = not backward and block_mask is None and row_lens is None \
        and attn_mask is not None and Elementwise.spans_both(attn_mask)
    element_states = None  # (B|1, Hs, n|1, n|1) at fine_tile
    if attn_mask is not None and not forward_lists_by_pre_pass:
        element_states = mask_tile_states(Elementwise.of(attn_mask, num_heads), seqlen_q,
                                          seqlen_k, *fine_tile, outer_args, packed)
    if row_lens is not None:
        by_length = row_length_states(row_lens, seqlen_q, seqlen_k, *fine_tile, packed)
        element_states = by_length if element_states is None \
            else torch.minimum(element_states, by_length)  # AND of states
    if forward_lists_by_pre_pass:
        schedule = mask_forward_schedule(Elementwise.of(attn_mask, num_heads), fine_tile,
                                         seqlen_q, seqlen_k, num_heads, outer_args, tiles[0],
                                         packed)
    elif block_mask is None:
        schedule = states_schedule(element_states, fine_tile, seqlen_q, seqlen_k, num_heads,
                                   outer_args, *tiles, packed=packed, backward=backward)
    elif element_states is None and packed is None:
        schedule = block_mask.kernel_schedule(*tiles, outer, num_heads)
    else:
        # element states and per-sequence predicates join the block mask's on the host
        # (tile-granular tensors)
        lengths = packed.seqlens() if packed is not None else None

        def states_at(block_m: int, block_n: int) -> torch.Tensor:
            element = None if element_states is None else coarsen_states(
                element_states, block_m // fine_tile[0], block_n // fine_tile[1])
            return block_mask.kernel_states(block_m, block_n, outer, element, lengths)

        schedule = Schedule.build(states_at, *tiles, num_heads, block_mask.kernel_bits)
    return schedule.launched_with((fwd.num_warps, fwd.num_stages),
                                  (bwd.num_warps, bwd.num_stages)), args


def groups_rows_by_length(seqlen_q: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether a call whose only mask is per-row key lengths (no causal / window / other mask,
    bias, dropout or packing: the caller's condition) runs with each batch's query rows reordered
    by length, longest first; this function adds the size condition (two query tiles or more).
    A query tile then holds rows of similar lengths, so it is FULL up to its shortest row and
    skips every key tile past its longest, where rows in their own order leave almost every
    tile PARTIAL (uniform lengths: H100 8k fwd 2.54 -> 1.29 ms of kernels, about half the tiles
    visited). Rows are independent given K and V, so the result is the same; the kernels then
    take each tile's key range from the lengths (no schedule lists) and read and write every
    row where the caller has it (no copies in the new order)."""
    return seqlen_q > forward_config(head_dim, dtype).block_m


def _use_kernels(q: torch.Tensor) -> bool:
    """CUDA tensors run the Triton kernels; CPU tensors too under TRITON_INTERPRET=1."""
    return q.is_cuda or interpreting()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    attn_mask: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    block_mask=None,
    seqlens_k_per_row: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
    check_inputs: bool = True,
):
    """Exact attention with every mask on one kernel core, forward and backward.

    Args:
        q: (B, Sq, H, D); k, v: (B, Sk, Hk, D) with H % Hk == 0 (GQA/MQA). fp16, bf16 or fp32,
            contiguous in the last dimension, D <= 256. Packed (varlen, with cu_seqlens_q/k):
            q (total_q, H, D), k/v (total_k, Hk, D).
        causal: key j is visible to query i iff j <= i + Sk - Sq (bottom-right aligned, per
            sequence when packed).
        window: (left, right): key j visible iff i + Sk - Sq - left <= j <= i + Sk - Sq + right;
            -1 = unbounded on that side. ANDed with causal.
        softmax_scale: defaults to 1 / sqrt(D).
        softcap: if > 0, scores become softcap * tanh(scores / softcap) before the softmax.
        attn_mask: bool (True = keep) or numeric (nonzero = keep), broadcastable to
            (B, Hm, Sq, Sk) with Hm in {1, Hk, H}; size-1 dims are read with stride 0. Packed:
            (total_q|1, Hm, max_seqlen_k|1), row i's columns counting from the first key of its
            sequence (the layout of the seed's varlen API).
        attn_bias: fp16/bf16/fp32, broadcastable like attn_mask, added to the scores after the
            softcap; differentiable, its gradient comes back in its own shape (summed over the
            dims it broadcasts, inside the backward pass). The mask is classified per tile by a
            pre-pass: all-kept tiles skip the mask load, all-masked tiles are never loaded.
        block_mask: an omniattn.BlockMask for (Sq, Sk): only its listed blocks are computed; its
            PARTIAL blocks apply its own causal/window predicate and element bitmaps; ANDed with
            causal/window and the other masks. Packed: built for (max_seqlen_q, max_seqlen_k),
            its batch dim (1 or B) indexes the sequences, blocks count from each sequence's start.
        seqlens_k_per_row: int32 (B, Sq) or (B * Sq,) (packed: (total_q,)): query row i sees
            keys [0, len_i) of its sequence, ANDed with every other mask. Key tiles past a query
            tile's longest row are never loaded; those below its shortest skip the predicate.
        cu_seqlens_q, cu_seqlens_k: int32 (B + 1,) offsets of the packed sequences (varlen);
            max_seqlen_q / max_seqlen_k: their longest lengths (computed, with a host sync, if
            None). Each sequence attends only to itself.
        deterministic: the backward pass without atomics: dQ gets programs of its own (which
            recompute the scores), every gradient is written once in a fixed order,
            bitwise-identical run to run. Otherwise dQ may be summed over key tiles in an fp32
            buffer with atomics (summation order varies by ~1 ulp of fp32): the Gluon backward
            on Hopper (head dim 128, calls without masks, biases, lengths, varlen or dropout)
            always, the Triton backward where a tile config asks for it (none of the GPU ones
            today: kernels/configs.py).
        return_lse: also return the log-sum-exp (B, H, Sq) float32 (natural log; packed:
            (H, total_q)), -inf for a row that sees no key. It is differentiable.
        check_inputs: validate the values of cu_seqlens_* and seqlens_k_per_row (this syncs with
            the host). Pass False under CUDA-graph capture; out-of-range values then cannot
            fault (lengths clamp to [0, Sk]) but give unspecified results. Packed calls replay
            call plans only unchecked, with max_seqlen_q / max_seqlen_k given.

    Returns:
        out like q, in q's dtype (0 on rows that see no key), or (out, lse).

    dropout_p: probability of zeroing each attention probability (the kept ones are scaled by
        1 / (1 - p)); the lse is that of the undropped softmax. The kernels draw a counter-based
        Philox stream seeded from torch's generator (torch.manual_seed reproduces it) and
        regenerate it in the backward pass (p is rounded to a multiple of 2^-16 there: 16-bit
        draws, 8 per Philox call); the CPU reference path draws from torch.rand, so the two
        backends drop different elements.
    """
    # packed sequences whose host work reads no value of cu_seqlens (unchecked, maxima given):
    # their offsets are inputs of the plan like q's
    plain_layout = cu_seqlens_q is None and cu_seqlens_k is None and max_seqlen_q is None \
        and max_seqlen_k is None
    unread_offsets = check_inputs is False and max_seqlen_q is not None \
        and max_seqlen_k is not None
    # per-row key lengths whose values were checked before (and not changed since) need no
    # new read: the call's host work then depends on their layout alone
    unread_lengths = seqlens_k_per_row is None or check_inputs is False or (
        plain_layout and check_inputs is True and _known_checked(seqlens_k_per_row, k))
    checks = check_inputs if seqlens_k_per_row is None or not unread_lengths or not plain_layout \
        else False

    def call(graph_parts: bool = False):
        return _attention(q, k, v, causal, window, softmax_scale, softcap, attn_mask, attn_bias,
                          block_mask, seqlens_k_per_row, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q, max_seqlen_k, dropout_p, deterministic, return_lse,
                          checks, graph_parts)

    if block_mask is None and unread_lengths and (plain_layout or unread_offsets) \
            and isinstance(dropout_p, (int, float)) and dropout_p == 0:
        inputs = (q, k, v, attn_mask, attn_bias, cu_seqlens_q, cu_seqlens_k, seqlens_k_per_row)
        graph = records_graph(q, k, v, attn_bias)
        key = call_plans.signature(inputs, (graph, causal, window, softmax_scale, softcap,
                                            deterministic, return_lse, checks,
                                            max_seqlen_q, max_seqlen_k))
        if key is not None:
            if not graph:
                return call_plans.run(key, inputs, call)
            # the forward's work (validation and schedule included) planned inside the Function
            out, lse = attention_with_graph(q, k, v, attn_mask, attn_bias,
                                            lambda: call_plans.run(key, inputs,
                                                                   lambda: call(True)), key)
            return (out, lse) if return_lse else out
    return call()


def _attention(q, k, v, causal, window, softmax_scale, softcap, attn_mask, attn_bias, block_mask,
               seqlens_k_per_row, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               dropout_p, deterministic, return_lse, check_inputs, graph_parts=False):
    """`attention` past its call plans (arguments in its order). graph_parts: the forward of a
    call recording a graph, as attention_with_graph's forward gives it (see forward_parts)."""
    packed_layout = cu_seqlens_q is not None or cu_seqlens_k is not None
    _check_qkv(q, k, v, packed_layout)
    _check_options(causal, window, softmax_scale, softcap, dropout_p)
    for name, flag in (("deterministic", deterministic), ("return_lse", return_lse),
                       ("check_inputs", check_inputs)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    packed = None
    if packed_layout:
        packed = _check_packed(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               check_inputs)
    elif max_seqlen_q is not None or max_seqlen_k is not None:
        raise ValueError("max_seqlen_q / max_seqlen_k belong to packed inputs: pass them with "
                         "cu_seqlens_q and cu_seqlens_k")

    if block_mask is not None:
        _check_block_mask(block_mask, q, k, packed)
    if attn_mask is not None:
        _check_elementwise("attn_mask", attn_mask, MASK_DTYPES, q, k, packed)
    if attn_bias is not None:
        _check_elementwise("attn_bias", attn_bias, SUPPORTED_DTYPES, q, k, packed)
    if seqlens_k_per_row is not None:
        seqlens_k_per_row = _check_row_lens(seqlens_k_per_row, q, k, packed, check_inputs)

    if _use_kernels(q):
        args = KernelArgs.make(q.shape[-1], causal, window, softmax_scale, softcap)
        row_order = None
        if (seqlens_k_per_row is not None and not args.masked and packed is None
                and block_mask is None and attn_mask is None and attn_bias is None
                and dropout_p == 0 and groups_rows_by_length(q.shape[1], q.shape[-1], q.dtype)):
            # q, out and lse stay in the caller's order: the kernels read and write each row
            # where it is and tile the rows (and their lengths) in this order
            row_order, seqlens_k_per_row = length_order(seqlens_k_per_row, k.shape[1])
        # rows grouped by length: the kernels take each tile's range from the lengths (no lists)
        schedule = None
        explicit_lengths = seqlens_k_per_row is not None and row_order is None
        if (block_mask is not None or attn_mask is not None or explicit_lengths) \
                and q.numel() and k.numel():
            needs_grad = graph_parts or records_graph(q, k, v, attn_bias)
            schedule, args = _explicit_schedule(q, k, args, block_mask, attn_mask, attn_bias,
                                                seqlens_k_per_row, packed, backward=needs_grad,
                                                dropout=dropout_p > 0)
        # a fresh Philox seed per call from torch's (CPU) generator: torch.manual_seed makes
        # the dropout pattern reproducible, and drawing it needs no device sync
        seed = int(torch.randint(2, 2 ** 31 - 1, ())) if dropout_p > 0 else 0
        # the kernels draw 16-bit numbers: p on their grid keeps the 1 / (1 - p) scale exact
        kernel_p = round(dropout_p * DROPOUT_LEVELS) / DROPOUT_LEVELS
        inputs = kernel_inputs(q, k, v, args, schedule, attn_mask, attn_bias, seqlens_k_per_row,
                               packed, (kernel_p, seed), deterministic, row_order)
        if graph_parts:
            return forward_parts(inputs)
        out, lse = triton_attention(inputs)
    else:
        out, lse = attention_reference(q, k, v, causal=causal, window=window,
                                       softmax_scale=softmax_scale, softcap=float(softcap),
                                       attn_mask=attn_mask, attn_bias=attn_bias,
                                       block_mask=block_mask, seqlens_k_per_row=seqlens_k_per_row,
                                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                       dropout_p=float(dropout_p), return_lse=True)
    return (out, lse) if return_lse else out
