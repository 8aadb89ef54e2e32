"""flash_attn (FlashAttention-3 interface) façade with the per-row key lengths extension of the
variable_seqlenk_mask seed: `flash_attn_func` and `flash_attn_varlen_func` over
`omniattn.attention`, returning (out, softmax_lse) as the seed's examples use them.

q (B, Sq, H, D), k/v (B, Sk, Hk, D); varlen: q (total_q, H, D), k/v (total_k, Hk, D).
per_row_seqlens_k: int32 (B, Sq) or (B * Sq,) (varlen: (total_q,)): query row i sees keys
[0, len_i). Unlike the seed it combines with causal and window_size (all ANDed), and the
gradients flow through it. softmax_lse: (B, H, Sq) float32 (varlen: (H, total_q)).

seqused_k (varlen, int32 (B,)): sequence b uses the first seqused_k[b] of its keys; it runs as
per-row key lengths (ANDed with per_row_seqlens_k), so it is supported without causal and
window_size only (the original aligns their diagonal to the used keys). Unused keys in a key
tile that holds used ones are multiplied by zero probabilities: they must be finite (a KV
cache from torch.empty may hold NaN; zero it once). A padded batch with keys in use per
sequence is `per_row_seqlens_k=seqused_k[:, None].expand(B, Sq)`.

Differences from the original: num_splits, pack_gqa and sm_margin are scheduling hints of the
CUDA kernels and are accepted and ignored; FP8 descales, qv, attention_chunk and seqused_q are
not supported (NotImplementedError).
"""
from __future__ import annotations

import torch

from ..api import attention
from ..predicate import check_window


def _given(value) -> str:
    """What a caller passed, for a message: a tensor's shape and dtype, never its values."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}, dtype {value.dtype}"
    if isinstance(value, (bool, int, float)):
        return repr(value)
    return f"a {type(value).__name__}"


def _unsupported(**given) -> None:
    for name, (value, default) in given.items():
        # `is` first: == on a tensor compares element-wise
        if value is not default and (isinstance(value, torch.Tensor) or value != default):
            raise NotImplementedError(f"flash_attn façade: {name} is not supported by omniattn "
                                      f"(got {_given(value)}; only {default!r})")


def _window(window_size) -> tuple[int, int] | None:
    """window_size as attention's window (None when unbounded both ways), checked by
    attention's rule under the name window_size."""
    check_window(window_size, "window_size")
    left, right = window_size
    return None if left < 0 and right < 0 else (left, right)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                    k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                    softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                    per_row_seqlens_k=None):
    """Returns (out (B, Sq, H, D), softmax_lse (B, H, Sq) float32)."""
    _unsupported(qv=(qv, None), q_descale=(q_descale, None), k_descale=(k_descale, None),
                 v_descale=(v_descale, None), attention_chunk=(attention_chunk, 0))
    window = _window(window_size)
    return attention(q, k, v, causal=bool(causal), window=window,
                     softmax_scale=softmax_scale, softcap=float(softcap),
                     seqlens_k_per_row=per_row_seqlens_k, deterministic=bool(deterministic),
                     return_lse=True)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                           qv=None, q_descale=None, k_descale=None, v_descale=None,
                           window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0,
                           per_row_seqlens_k=None):
    """Packed sequences; returns (out (total_q, H, D), softmax_lse (H, total_q) float32). As in
    flash_attn, the values of cu_seqlens_* (and max_seqlen_*, at least the longest sequence) are
    the caller's to get right: nothing reads them on the host, so a call never syncs with the
    device (`attention(..., check_inputs=False)`)."""
    _unsupported(seqused_q=(seqused_q, None), qv=(qv, None),
                 q_descale=(q_descale, None), k_descale=(k_descale, None),
                 v_descale=(v_descale, None), attention_chunk=(attention_chunk, 0))
    window = _window(window_size)
    if seqused_k is not None:
        per_row_seqlens_k = _used_keys_per_row(seqused_k, cu_seqlens_q, q.shape[0], causal,
                                               window, per_row_seqlens_k)
    return attention(q, k, v, causal=bool(causal), window=window,
                     softmax_scale=softmax_scale, softcap=float(softcap),
                     seqlens_k_per_row=per_row_seqlens_k, cu_seqlens_q=cu_seqlens_q,
                     cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k, deterministic=bool(deterministic),
                     return_lse=True, check_inputs=False)


def _used_keys_per_row(seqused_k, cu_seqlens_q, total_q: int, causal, window,
                       per_row_seqlens_k):
    """seqused_k (B,) as per-row key lengths (total_q,), ANDed with per_row_seqlens_k."""
    if causal or window is not None:
        raise NotImplementedError("flash_attn façade: seqused_k with causal or window_size is not "
                                  "supported (the original aligns the diagonal to the used keys); "
                                  "pass per_row_seqlens_k or pack the used keys")
    if not isinstance(seqused_k, torch.Tensor) or seqused_k.dtype != torch.int32:
        got = f"dtype {seqused_k.dtype}" if isinstance(seqused_k, torch.Tensor) \
            else type(seqused_k).__name__
        raise TypeError(f"seqused_k must be an int32 tensor of shape (B,), got {got}")
    if not isinstance(cu_seqlens_q, torch.Tensor) or \
            tuple(seqused_k.shape) != (cu_seqlens_q.shape[0] - 1,):
        raise ValueError(f"seqused_k has shape {tuple(seqused_k.shape)}; expected (B,) with B = "
                         f"len(cu_seqlens_q) - 1")
    rows_per_sequence = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    used = torch.repeat_interleave(seqused_k, rows_per_sequence, output_size=total_q)
    return used if per_row_seqlens_k is None else torch.minimum(per_row_seqlens_k, used)


__all__ = ["flash_attn_func", "flash_attn_varlen_func"]
