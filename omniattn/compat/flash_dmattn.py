"""flash-dmattn façade: `flash_dmattn_func` with the original's argument order and return
convention, over `omniattn.attention`.

query (B, Sq, H, D), key/value (B, Sk, Hk, D); attn_mask (True / nonzero = keep) and attn_bias
(B|1, {1, Hk, H}, Sq|1, Sk|1), never expanded; the bias gradient comes back in its own shape.
Returns the output, or with return_attn_probs (out, softmax_lse) — the original's third item,
the attention probabilities for testing, is not produced: an (Sq, Sk) matrix per head is exactly
what this library never materialises.
"""
from __future__ import annotations

from ..api import attention
from ..masks.dynamic import prepare_dynamic_mask


def flash_dmattn_func(query, key, value, attn_mask=None, attn_bias=None, softmax_scale=None,
                      is_causal=None, softcap=None, deterministic=None, return_attn_probs=None):
    out, lse = attention(query, key, value, causal=bool(is_causal), softmax_scale=softmax_scale,
                         softcap=float(softcap or 0.0), attn_mask=attn_mask, attn_bias=attn_bias,
                         deterministic=bool(deterministic), return_lse=True)
    return (out, lse) if return_attn_probs else out


__all__ = ["flash_dmattn_func", "prepare_dynamic_mask"]
