"""Validation of `attention`'s arguments: every bad input raises a ValueError / TypeError naming
the argument, what it got (shape, dtype, device; never values) and what was expected, before
anything is computed or launched."""
from __future__ import annotations

import math
import weakref

import torch

from .kernels.sequences import PackedSequences, PagedKeys, batch_shape, lse_shape
from .masks.block_mask import BlockMask
from .predicate import check_window

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MASK_DTYPES = (torch.bool, torch.uint8, *SUPPORTED_DTYPES)
MAX_HEAD_DIM = 256

def describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_qkv(q, k, v, packed: bool, paged: bool = False) -> None:
    """paged: k/v are pages (num_pages, page_size, Hk, D), not one row of keys per sequence."""
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
            raise ValueError(f"{name} must be {dims}-D {layout}, got {describe(t)}{hint}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    num_heads, head_dim = q.shape[-2:]
    if k.shape != v.shape:
        kv_layout = "(total_k, Hk, D)" if packed else "(B, Sk, Hk, D)"
        raise ValueError(f"k and v must have the same shape {kv_layout}, got k {tuple(k.shape)} "
                         f"and v {tuple(v.shape)}")
    if not packed and not paged and k.shape[0] != q.shape[0]:
        raise ValueError(f"k has batch size {k.shape[0]} but q has {q.shape[0]}")
    if k.shape[-1] != head_dim:
        raise ValueError(f"k/v have head_dim {k.shape[-1]} but q has {head_dim}")
    if head_dim > MAX_HEAD_DIM or head_dim < 1:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim} "
                         f"(q {describe(q)})")
    num_heads_k = k.shape[-2]
    if num_heads_k == 0 or num_heads % num_heads_k != 0:
        raise ValueError(f"the number of query heads ({num_heads}) must be a multiple of the "
                         f"number of key/value heads ({num_heads_k}) for GQA/MQA")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension, got "
                             f"strides {t.stride()}; call {name}.contiguous() first")


def check_options(causal, window, softmax_scale, softcap, dropout_p) -> None:
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


def check_block_mask(block_mask, q, k, packed: PackedSequences | None) -> None:
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


def check_tensor_argument(name: str, t, dtypes, q: torch.Tensor) -> None:
    """An optional tensor argument given: a torch.Tensor of one of `dtypes`, on q's device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of "
                        f"{', '.join(str(d) for d in dtypes)}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def check_int32_argument(name: str, t, q: torch.Tensor, optional: bool) -> None:
    """An int32 tensor argument (lengths, page tables) on q's device; `optional`: None is also
    accepted (the caller skips it), which the message says."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{' or None' if optional else ''}, got "
                        f"{type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def check_elementwise(name: str, t, dtypes, q: torch.Tensor, k: torch.Tensor,
                       packed: PackedSequences | None) -> None:
    """attn_mask / attn_bias: 4-D (packed: 3-D (total_q, Hm, max_seqlen_k)), each dim 1 or full,
    heads in {1, Hk, H}; never expanded."""
    check_tensor_argument(name, t, dtypes, q)
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


def check_topk(topk, topk_scores, attn_bias, q: torch.Tensor, k: torch.Tensor,
               packed: PackedSequences | None) -> None:
    """topk: None or a positive int; topk_scores: None (the attn_bias selects) or a float
    tensor laid out like attn_bias, and only with topk."""
    if topk is None:
        if topk_scores is not None:
            raise ValueError("topk_scores selects keys only with topk: pass topk=K (the keys "
                             "each row keeps) too")
        return
    if not isinstance(topk, int) or isinstance(topk, bool):
        raise TypeError(f"topk must be a positive int or None, got {type(topk).__name__}")
    if topk <= 0:
        raise ValueError(f"topk must be a positive int (the keys each row keeps), got {topk}")
    if topk_scores is None and attn_bias is None:
        raise ValueError("topk needs scores to select by: pass topk_scores, or an attn_bias "
                         "(the default scores)")
    if topk_scores is not None:
        check_elementwise("topk_scores", topk_scores, SUPPORTED_DTYPES, q, k, packed)


def check_packed(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
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


def known_checked(row_lens, k: torch.Tensor) -> bool:
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


def check_row_lens(row_lens, q, k, packed: PackedSequences | None,
                    check_inputs: bool) -> torch.Tensor:
    """seqlens_k_per_row: int32 (B, Sq) or (B * Sq,) (packed: (total_q,)), values in [0, Sk] of
    the row's sequence. Returns it contiguous, (B, Sq) or packed (total_q,)."""
    check_int32_argument("seqlens_k_per_row", row_lens, q, optional=False)
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


def check_gradient_inputs(dout, out, lse, dlse, q, dropout_p) -> None:
    """`attention_backward`'s own arguments: dout and out like q, lse and dlse float32 like the
    lse attention returns; no dropout (its draws belong to a forward)."""
    for name, t, shape, dtype in (("dout", dout, tuple(q.shape), q.dtype),
                                  ("out", out, tuple(q.shape), q.dtype),
                                  ("lse", lse, lse_shape(q), torch.float32),
                                  ("dlse", dlse, lse_shape(q), torch.float32)):
        if t is None and name == "dlse":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != q.device:
            raise ValueError(f"{name} must have shape {shape}, dtype {dtype} and q's device "
                             f"{q.device}, got {describe(t)}")
    if dropout_p != 0:
        raise ValueError(f"dropout_p must be 0 in attention_backward, got {dropout_p!r}: the "
                         f"dropped elements are drawn by the forward that ran")


def check_paged(q, k, block_table, seqused_k, packed: bool, check_inputs: bool) -> PagedKeys:
    """block_table: int32 (B, max_pages_per_seq) on q's device, k/v then pages (num_pages,
    page_size, Hk, D) with page_size a multiple of 16; seqused_k: int32 (B,) on q's device.
    With check_inputs their values are read (a sync): seqused_k within the keys a sequence
    holds, and the pages each sequence uses listed within [0, num_pages)."""
    if packed:
        raise ValueError("block_table / seqused_k take q as (B, Sq, H, D); they do not combine "
                         "with cu_seqlens_q / cu_seqlens_k")
    batch = q.shape[0]
    for name, t in (("block_table", block_table), ("seqused_k", seqused_k)):
        if t is None:
            continue
        check_int32_argument(name, t, q, optional=True)
    page_size, seqlen_k = 0, k.shape[1]
    if block_table is not None:
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table has shape {tuple(block_table.shape)}; expected "
                             f"(B={batch}, max_pages_per_seq)")
        if block_table.stride(-1) != 1 and block_table.shape[-1] > 1:
            raise ValueError(f"block_table must be contiguous in its last dimension, got strides "
                             f"{block_table.stride()}")
        page_size = k.shape[1]
        if page_size == 0 or page_size % 16:
            raise ValueError(f"with block_table, k/v are pages (num_pages, page_size, Hk, D) "
                             f"with page_size a positive multiple of 16; got k {describe(k)}")
        seqlen_k = block_table.shape[1] * page_size
    if seqused_k is not None:
        if tuple(seqused_k.shape) != (batch,):
            raise ValueError(f"seqused_k has shape {tuple(seqused_k.shape)}; expected (B={batch},)")
        seqused_k = seqused_k.contiguous()
    if check_inputs:
        _check_used_keys(k, block_table, seqused_k, page_size, seqlen_k)
    return PagedKeys(block_table, seqused_k, page_size, seqlen_k)


def _check_used_keys(k, block_table, seqused_k, page_size: int, seqlen_k: int) -> None:
    """The values of seqused_k and of the block table's used entries (one host read each)."""
    holds = f"{block_table.shape[1]} pages of {page_size} keys" if block_table is not None \
        else f"Sk = {seqlen_k}"
    if seqused_k is not None and seqused_k.numel():
        bad = (seqused_k < 0) | (seqused_k > seqlen_k)
        if bool(bad.any()):
            raise ValueError(f"seqused_k[{int(bad.nonzero()[0, 0])}] lies outside [0, "
                             f"{seqlen_k}] (a sequence holds {holds}); pass check_inputs=False "
                             f"to skip this check (it syncs)")
    if block_table is not None and block_table.numel():
        pages = block_table.shape[1]
        used = seqused_k if seqused_k is not None else torch.full_like(block_table[:, 0], seqlen_k)
        needed = (used + page_size - 1) // page_size
        listed = torch.arange(pages, device=k.device) < needed[:, None]
        bad = listed & ((block_table < 0) | (block_table >= k.shape[0]))
        if bool(bad.any()):
            batch, slot = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"block_table[{batch}, {slot}] is not a page of k/v (num_pages = "
                             f"{k.shape[0]}), and sequence {batch} uses it; pass "
                             f"check_inputs=False to skip this check (it syncs)")
