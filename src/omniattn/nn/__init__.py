"""Modules built on omniattn.attention."""
from .dynamic_mask_attention import DynamicMaskAttention

__all__ = ["DynamicMaskAttention"]
