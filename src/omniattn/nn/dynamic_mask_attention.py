"""Dynamic Mask Attention as a module: each KV head learns per-key scores from its value states;
each query keeps the `window_size` best-scored keys it may see, and the score is also added as a
learnable bias."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..api import attention
from ..masks.dynamic import keep_window_arguments


def _check_positive(name: str, value, optional: bool = False) -> None:
    if optional and value is None:
        return
    expected = f"a positive int{' or None' if optional else ''}"
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be {expected}, got {value}")


class DynamicMaskAttention(nn.Module):
    """hidden (B, S, hidden_size) -> (B, S, hidden_size).

    q/k/v/o projections with GQA (num_heads query heads over num_heads_k KV heads, default
    num_heads) of head_dim each (default hidden_size // num_heads, which must then divide
    exactly), `dt_proj` (num_heads_k * head_dim -> num_heads_k) on the value states and `A`
    (num_heads_k). Self-attention over the S tokens: causal (bottom-right aligned) by default.

    Key scores: dt = A * softplus(dt_proj(v)), shape (B, Hk, S). The seed used exp(A * softplus(.));
    we use the form its authors later adopted, A * softplus(.): linear in A, so the bias cannot
    blow up exponentially as A grows, its gradient stays O(1), and with A = 0 at init the layer
    starts as plain attention (bias 0) with a uniform top-k.

    Keep window: each query keeps the `window_size` keys of highest dt among those it sees
    (causal, padding), ties to the lower key index: `attention(topk=window_size,
    topk_scores=dt)` with dt (B, Hk, 1, S) as the bias, so no (S, S) tensor is built.
    block_size (the original's `create_mask(block_size=)`): each query's selection is then
    smoothed over blocks of `block_size` keys, a block kept whole when more than half of its
    length was selected and dropped whole otherwise (`masks.topk_mask` gives the rule; note that
    with causal a query drops the block of its own diagonal while it sees at most half of it).
    Without causal every query selects alike and the smoothed selection is a (B, Hk, 1, S) key
    mask; with causal it is a `masks.topk_block_mask` BlockMask, built from one bool per query
    and key block.

    The module uses no positions (no rotary embedding): position information is the caller's to
    add to the hidden states.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_heads_k: int | None = None,
                 head_dim: int | None = None, window_size: int = 2048, causal: bool = True,
                 bias: bool = False, block_size: int | None = None):
        super().__init__()
        _check_positive("hidden_size", hidden_size)
        _check_positive("num_heads", num_heads)
        _check_positive("num_heads_k", num_heads_k, optional=True)
        _check_positive("head_dim", head_dim, optional=True)
        _check_positive("window_size", window_size)
        _check_positive("block_size", block_size, optional=True)
        num_heads_k = num_heads if num_heads_k is None else num_heads_k
        if num_heads % num_heads_k:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_heads_k "
                             f"({num_heads_k})")
        if head_dim is None and hidden_size % num_heads:
            raise ValueError(f"hidden_size ({hidden_size}) is not a multiple of num_heads "
                             f"({num_heads}); pass head_dim to choose the heads' width")
        self.hidden_size = hidden_size
        self.num_heads, self.num_heads_k = num_heads, num_heads_k
        self.head_dim = head_dim or hidden_size // num_heads
        self.window_size, self.causal, self.block_size = window_size, causal, block_size
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_heads_k * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_heads_k * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=bias)
        self.dt_proj = nn.Linear(num_heads_k * self.head_dim, num_heads_k, bias=bias)
        self.A = nn.Parameter(torch.zeros(num_heads_k))

    def _real_tokens(self, attention_mask, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """attention_mask as bool (B, S), True = real token (None stays None)."""
        if attention_mask is None:
            return None
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor or None, got "
                            f"{type(attention_mask).__name__}")
        expected = tuple(hidden_states.shape[:2])
        if tuple(attention_mask.shape) != expected:
            raise ValueError(f"attention_mask must be a (B, S) = {expected} key padding mask "
                             f"(bool or 0/1, True / 1 = real token), got shape "
                             f"{tuple(attention_mask.shape)}")
        if attention_mask.device != hidden_states.device:
            raise ValueError(f"attention_mask is on {attention_mask.device} but hidden_states is "
                             f"on {hidden_states.device}")
        if attention_mask.dtype == torch.bool:
            return attention_mask
        if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise ValueError(f"attention_mask (dtype {attention_mask.dtype}) must hold only 0 and "
                             f"1 (1 = real token); an additive mask is not a padding mask")
        return attention_mask != 0

    def forward(self, hidden_states: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states (B, S, hidden_size) -> (B, S, hidden_size).

        attention_mask: None, or a (B, S) key padding mask, bool or 0/1 (True / 1 = real token,
        as transformers' attention_mask): padded keys are hidden from every query and never
        enter its top-k; padded query rows output 0 (and pass no gradient). It reaches the
        attention as a (B, 1, 1, S) key mask."""
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got "
                            f"{type(hidden_states).__name__}")
        if hidden_states.dim() != 3:
            raise ValueError(f"hidden_states must be (B, S, hidden_size = {self.hidden_size}), "
                             f"got shape {tuple(hidden_states.shape)}")
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states must be (B, S, hidden_size = {self.hidden_size}), "
                             f"got shape {tuple(hidden_states.shape)}: its last dim "
                             f"{hidden_states.shape[-1]} is not hidden_size {self.hidden_size}")
        real = self._real_tokens(attention_mask, hidden_states)
        batch, seqlen, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(batch, seqlen, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(batch, seqlen, self.num_heads_k, self.head_dim)
        v_flat = self.v_proj(hidden_states)  # [B, S, Hk * D]
        v = v_flat.view(batch, seqlen, self.num_heads_k, self.head_dim)
        dt_states = (self.A * F.softplus(self.dt_proj(v_flat))).transpose(1, 2)  # [B, Hk, S]
        scores = dt_states[:, :, None, :]  # [B, Hk, 1, S]: each key's score, shared by the rows
        selection = keep_window_arguments(
            scores, self.window_size, None if real is None else real[:, None, None, :],
            causal=self.causal, seqlen_q=seqlen, num_heads=self.num_heads,
            block_size=self.block_size)
        out = attention(q, k, v, causal=self.causal, attn_bias=scores.to(q.dtype), **selection)
        out = self.o_proj(out.reshape(batch, seqlen, self.num_heads * self.head_dim))
        # o_proj's bias would make padded rows nonzero
        return out if real is None else out.masked_fill(~real[..., None], 0.0)
