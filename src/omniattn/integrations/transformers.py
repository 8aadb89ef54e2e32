"""HuggingFace transformers attention function, registered as "omniattn" on import when
transformers is installed: `import omniattn.integrations.transformers`, then load a model with
`attn_implementation="omniattn"`.
"""
from __future__ import annotations

import importlib.util

import torch

from ..api import attention
from ..masks.dynamic import allowed_keys, keep_window_arguments


def _keep_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """2-D padding masks (B, Sk), nonzero = keep, become (B, 1, 1, Sk); 4-D masks are bool
    (True = keep) or transformers' additive floats (0 = keep)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        return (attention_mask != 0)[:, None, None, :]
    if attention_mask.dim() != 4:
        raise ValueError(f"attention_mask must be 2-D (batch, seqlen_k) or 4-D "
                         f"(batch, heads|1, seqlen_q|1, seqlen_k), got shape "
                         f"{tuple(attention_mask.shape)}")
    return allowed_keys(attention_mask)


def flash_dynamic_mask_attention_forward(module, query, key, value, attention_mask,
                                         attention_bias=None, scaling=None, window_size=None,
                                         softcap=None, block_size=None, **kwargs):
    """query (B, H, Sq, D), key/value (B, Hk, Sk, D) as transformers passes them ->
    (out (B, Sq, H, D), None).

    With `window_size` and a bias (B|1, {1, Hk, H}, Sq|1, Sk), each row keeps its `window_size`
    highest-bias keys among those the mask allows (Dynamic Mask Attention), selected inside
    attention (`attention(topk=window_size)`): no (Sq, Sk) tensor is built for it. block_size
    smooths each row's selection over blocks of keys (`masks.topk_mask` gives the rule), as a
    key-wise mask when every row selects alike and a `masks.topk_block_mask` otherwise. Causal
    comes from `is_causal` (keyword, else the module's attribute) when the mask is 2-D or
    absent; a 4-D mask already holds it.
    """
    keep = _keep_mask(attention_mask)
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", False)))
    if attention_mask is not None and attention_mask.dim() == 4:
        causal = False
    if block_size is not None and window_size is None:
        raise ValueError(f"block_size ({block_size}) smooths the keep window's selection: pass "
                         f"window_size too")
    selection = {"attn_mask": keep}
    if window_size is not None and attention_bias is not None:
        selection = keep_window_arguments(attention_bias, window_size, keep, causal=causal,
                                          seqlen_q=query.shape[2], num_heads=query.shape[1],
                                          block_size=block_size)
    dropout = kwargs.get("dropout", 0.0)
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                    causal=causal, softmax_scale=scaling, softcap=float(softcap or 0.0),
                    attn_bias=attention_bias,
                    dropout_p=float(dropout) if module is not None and module.training else 0.0,
                    **selection)
    return out, None


def register() -> bool:
    """Register with transformers' AttentionInterface as "omniattn", with SDPA's mask builder
    (4-D bool masks, or None when causal alone suffices); False if transformers is missing."""
    if importlib.util.find_spec("transformers") is None:
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("omniattn", flash_dynamic_mask_attention_forward)
    AttentionMaskInterface.register("omniattn", sdpa_mask)
    return True


register()
