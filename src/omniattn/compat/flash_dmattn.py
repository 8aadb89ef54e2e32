"""flash-dmattn (Flash Dynamic Mask Attention) façade: `flash_dmattn_func` with the original's
argument order and return convention over `omniattn.attention`, and `prepare_dynamic_mask`,
which builds its top-k keep mask and bias from dt states."""
from __future__ import annotations

from ..api import attention
from ..masks.dynamic import prepare_dynamic_mask


def flash_dmattn_func(query, key, value, attn_mask=None, attn_bias=None, softmax_scale=None,
                      is_causal=None, softcap=None, deterministic=None, return_attn_probs=None):
    """Attention with an element mask and an additive (learnable) bias, forward and backward.

    For query row i and key j of each (batch, head):
    score = softcap * tanh(softmax_scale * q_i . k_j / softcap) + attn_bias[..., i, j] (no tanh
    when softcap is 0), -inf where attn_mask[..., i, j] is 0 / False or, with is_causal, where
    j > i + Sk - Sq; out_i = softmax(scores) @ V.

    Args:
        query: (B, Sq, H, D); key, value: (B, Sk, Hk, D) with H a multiple of Hk (GQA / MQA).
            float16, bfloat16 or float32, D <= 256.
        attn_mask: None (every key visible) or a keep mask: bool (True = keep) or uint8 / float
            (nonzero = keep), of shape (B|1, Hm, Sq|1, Sk|1) with Hm in {1, Hk, H}; size-1 dims
            broadcast and are never expanded. Tiles the mask hides entirely are skipped, forward
            and backward.
        attn_bias: None or a float16 / bfloat16 / float32 bias broadcastable like attn_mask,
            added to the scores; differentiable, its gradient comes back in its own shape
            (summed over the dims it broadcasts).
        softmax_scale: defaults to 1 / sqrt(D).
        is_causal: None or False: no causal mask; True: key j visible to query i iff
            j <= i + Sk - Sq (bottom-right aligned), ANDed with attn_mask.
        softcap: None or 0 disables it.
        deterministic: a backward pass without atomics, bitwise reproducible run to run.
        return_attn_probs: also return softmax_lse.

    Returns:
        out (B, Sq, H, D) in query's dtype, or (out, softmax_lse) with return_attn_probs:
        softmax_lse (B, H, Sq) float32, the natural log-sum-exp of each row's scores. A row
        that sees no key gets out 0 and lse -inf.

    Differences from the original:
        - attn_mask and attn_bias broadcast (size-1 dims, 1 / Hk / H heads) instead of being
          required at (B, Hk, Sq, Sk); any float dtype is taken for the bias.
        - return_attn_probs returns (out, softmax_lse) without the attention probabilities:
          an (Sq, Sk) matrix per head is exactly what this library never materialises.
        - prepare_dynamic_mask returns the bias as (B, Hk, 1, Sk) and the keep mask as bool
          (B, Hk, 1|Sq, Sk), not both expanded to (B, Hk, Sq, Sk), and does not fill the bias
          with the dtype's minimum where masked (the mask carries that). Its top-k breaks ties
          to the lower key index (torch.topk's order is unspecified) and ranks NaN highest: the
          rule of `attention(topk=...)`, so the mask keeps what that call would. Its
          `block_size` (of flash-dmattn's later `create_mask`) smooths the selection as the
          original does, then ANDs it with attention_mask and causal: a majority block never
          shows a key they hide.
    """
    out, lse = attention(query, key, value, causal=bool(is_causal), softmax_scale=softmax_scale,
                         softcap=float(softcap or 0.0), attn_mask=attn_mask, attn_bias=attn_bias,
                         deterministic=bool(deterministic), return_lse=True)
    return (out, lse) if return_attn_probs else out


__all__ = ["flash_dmattn_func", "prepare_dynamic_mask"]
