"""flash_attn_with_kvcache (FlashAttention's KV-cache interface) over `omniattn.attention`: new
keys and values appended to the cache in place, rotary embeddings, contiguous or paged caches.

q (B, Sq, H, D); k_cache / v_cache (B_cache, Sk_cache, Hk, D), or pages (num_pages, page_size,
Hk, D) with block_table (B, max_pages) int32 (page_size a multiple of 16); k / v (B, S_new, Hk,
D): written into sequence b's cache slots cache_seqlens[b] .. cache_seqlens[b] + S_new - 1
before the attention, which covers its keys [cache_leftpad[b], cache_seqlens[b] + S_new)
(cache_seqlens None: every slot; an int: the same for every sequence). causal is bottom-right
aligned to the last of them, as `window_size` (left, right) is.
rotary_cos / rotary_sin (seqlen_ro >= the cache's slots, rotary_dim / 2) with k and v: the
first rotary_dim dims of the new keys are rotated at their slots, those of q at slots
cache_seqlens[b] + i when causal or windowed, else all at cache_seqlens[b];
rotary_interleaved pairs dims (0, 1), (2, 3), ... (else i and i + rotary_dim / 2). Slots count
from the cache's first (cache_leftpad does not shift them), computed in fp32.
cache_batch_idx (B,) int32: sequence b is row cache_batch_idx[b] of a contiguous cache.
Returns out (B, Sq, H, D), or (out, softmax_lse (B, H, Sq) float32) with return_softmax_lse.

Differences from the original: alibi_slopes is not supported (NotImplementedError); num_splits
is a scheduling hint, accepted and ignored (the plan picks the split); a contiguous cache with
cache_batch_idx whose Sk_cache is not a multiple of 16 is gathered (a copy) before attention;
a row that sees no key gets output 0 and lse -inf (the original's unsplit kernel writes +inf).
Like the original, no value is checked on the host: slots past the cache are the caller's to
avoid; decoding-sized calls read nothing on the host, larger ones (attention's per-sequence
path) read the used key counts. Forward only (no gradient reaches the cache).
"""
from __future__ import annotations

import torch

from ..api import attention
from .flash_attn import _unsupported, _window


def _int32(name: str, t, shape: tuple, device) -> None:
    """t: an int32 tensor of `shape` (None: any size there) on `device`."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        got = f"dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name} must be an int32 tensor, got {got}")
    if t.dim() != len(shape) or any(n is not None and n != m for n, m in zip(shape, t.shape)):
        expected = ", ".join("_" if n is None else str(n) for n in shape)
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected ({expected})")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def _check(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad,
           block_table) -> int:
    """What the append and the rotary read, checked before anything is written; returns the
    slots a sequence's cache holds. attention checks the rest."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor, got {got}")
    batch = q.shape[0]
    if block_table is not None:
        _int32("block_table", block_table, (batch, None), q.device)
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx indexes a contiguous cache; with block_table, list "
                             "each sequence's pages in the block table")
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is not None:
            _int32(name, t, (batch,), q.device)
    slots = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    if (k is None) != (v is None):
        raise ValueError("k and v are appended together: pass both or neither")
    if k is not None:
        for name, new, cache in (("k", k, k_cache), ("v", v, v_cache)):
            if not isinstance(new, torch.Tensor) or new.dim() != 4 \
                    or (new.shape[0], *new.shape[2:]) != (batch, *cache.shape[2:]) \
                    or new.shape[1] != k.shape[1]:
                got = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
                raise ValueError(f"{name} has shape {got}; expected (B={batch}, S_new, Hk, D) "
                                 f"with {name}_cache's Hk and D and one S_new for k and v")
            if new.dtype != cache.dtype or new.device != cache.device:
                raise TypeError(f"{name} ({new.dtype} on {new.device}) must match {name}_cache "
                                f"({cache.dtype} on {cache.device})")
    if rotary_cos is not None or rotary_sin is not None:
        if k is None:
            raise ValueError("rotary_cos / rotary_sin rotate the new keys: pass k and v too")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape != rotary_cos.shape \
                    or not t.is_floating_point():
                raise ValueError(f"rotary_cos and rotary_sin must be float tensors of one shape "
                                 f"(seqlen_ro, rotary_dim / 2), got {name} "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else t}")
        if 2 * rotary_cos.shape[1] > q.shape[-1] or rotary_cos.shape[0] < slots:
            raise ValueError(f"rotary_cos / rotary_sin have shape {tuple(rotary_cos.shape)}; "
                             f"expected (seqlen_ro >= {slots} cache slots, rotary_dim / 2 <= "
                             f"{q.shape[-1] // 2})")
    return slots


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
             interleaved: bool) -> torch.Tensor:
    """x (B, S, heads, D) with its first rotary_dim dims rotated by the rows `slots` (B, S) of
    cos / sin (seqlen_ro, rotary_dim / 2); computed in fp32, returned in x's dtype."""
    half = cos.shape[1]
    c, s = (t[slots].unsqueeze(2).float() for t in (cos, sin))  # (B, S, 1, half)
    x_rot = x[..., :2 * half].float()
    if interleaved:
        even, odd = x_rot[..., 0::2], x_rot[..., 1::2]
        turned = torch.stack((even * c - odd * s, even * s + odd * c), -1).flatten(-2)
    else:
        first, second = x_rot[..., :half], x_rot[..., half:]
        turned = torch.cat((first * c - second * s, first * s + second * c), -1)
    return torch.cat((turned.to(x.dtype), x[..., 2 * half:]), -1)


def _append(cache: torch.Tensor, new: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
            block_table: torch.Tensor | None) -> None:
    """cache[sequence b's slot slots[b, j]] = new[b, j], in place: row rows[b] of a contiguous
    cache, or through the block table into pages."""
    if block_table is None:
        cache.index_put_((rows[:, None].expand_as(slots), slots), new)
        return
    page_size = cache.shape[1]
    pages = block_table.gather(1, slots // page_size).long()
    cache.index_put_((pages, slots % page_size), new)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """Returns out (B, Sq, H, D), or (out, softmax_lse (B, H, Sq) float32)."""
    _unsupported(alibi_slopes=(alibi_slopes, None))
    window = _window(window_size)
    slots = _check(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx,
                   cache_leftpad, block_table)
    batch, seqlen_q = q.shape[:2]
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    elif cache_seqlens is not None:
        _int32("cache_seqlens", cache_seqlens, (batch,), q.device)
    elif k is not None:
        raise ValueError("appending k / v needs cache_seqlens (where each sequence's new keys go)")
    used = cache_seqlens
    if k is not None:
        new_slots = cache_seqlens[:, None].long() + torch.arange(k.shape[1], device=q.device)
        if rotary_cos is not None:
            k = _rotated(k, rotary_cos, rotary_sin, new_slots, rotary_interleaved)
            q_slots = cache_seqlens[:, None].long() + (
                torch.arange(seqlen_q, device=q.device) if causal or window is not None
                else torch.zeros(seqlen_q, dtype=torch.long, device=q.device))
            q = _rotated(q, rotary_cos, rotary_sin, q_slots, rotary_interleaved)
        rows = cache_batch_idx.long() if cache_batch_idx is not None \
            else torch.arange(batch, device=q.device)
        _append(k_cache, k, new_slots, rows, block_table)
        _append(v_cache, v, new_slots, rows, block_table)
        used = cache_seqlens + k.shape[1]
    if cache_batch_idx is not None:
        if k_cache.shape[1] % 16 == 0:  # each sequence's row of the cache is one page
            block_table = cache_batch_idx.view(batch, 1)
        else:
            rows = cache_batch_idx.long()
            k_cache, v_cache = k_cache.index_select(0, rows), v_cache.index_select(0, rows)
    attn_mask = None
    if cache_leftpad is not None:  # keys before each sequence's first
        attn_mask = (torch.arange(slots, device=q.device) >= cache_leftpad[:, None])[:, None, None]
    return attention(q, k_cache, v_cache, causal=bool(causal), window=window,
                     softmax_scale=softmax_scale, softcap=float(softcap), attn_mask=attn_mask,
                     block_table=block_table, seqused_k=used, return_lse=return_softmax_lse,
                     check_inputs=False)


__all__ = ["flash_attn_with_kvcache"]
