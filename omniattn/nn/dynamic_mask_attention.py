"""Dynamic Mask Attention as a module: each KV head learns per-key scores from its value states;
each query keeps the `window_size` best-scored keys it may see, and the score is also added as a
learnable bias."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..api import attention
from ..masks.dynamic import prepare_dynamic_mask


class DynamicMaskAttention(nn.Module):
    """hidden (B, S, hidden_size) -> (B, S, hidden_size).

    q/k/v/o projections with GQA (num_heads query heads over num_heads_k KV heads), `dt_proj`
    (num_heads_k * head_dim -> num_heads_k) on the value states and `A` (num_heads_k).

    Key scores: dt = A * softplus(dt_proj(v)), shape (B, Hk, S). The seed used exp(A * softplus(.));
    we use the form its authors later adopted, A * softplus(.): linear in A, so the bias cannot
    blow up exponentially as A grows, its gradient stays O(1), and with A = 0 at init the layer
    starts as plain attention (bias 0) with a uniform top-k.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_heads_k: int | None = None,
                 head_dim: int | None = None, window_size: int = 2048, causal: bool = True,
                 bias: bool = False):
        super().__init__()
        num_heads_k = num_heads_k or num_heads
        if num_heads % num_heads_k:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_heads_k "
                             f"({num_heads_k})")
        self.num_heads, self.num_heads_k = num_heads, num_heads_k
        self.head_dim = head_dim or hidden_size // num_heads
        self.window_size, self.causal = window_size, causal
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_heads_k * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_heads_k * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=bias)
        self.dt_proj = nn.Linear(num_heads_k * self.head_dim, num_heads_k, bias=bias)
        self.A = nn.Parameter(torch.zeros(num_heads_k))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seqlen, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(batch, seqlen, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(batch, seqlen, self.num_heads_k, self.head_dim)
        v_flat = self.v_proj(hidden_states)  # [B, S, Hk * D]
        v = v_flat.view(batch, seqlen, self.num_heads_k, self.head_dim)
        dt_states = (self.A * F.softplus(self.dt_proj(v_flat))).transpose(1, 2)  # [B, Hk, S]
        # prepare_dynamic_mask takes query states as (B, H, Sq, D)
        attn_bias, attn_mask = prepare_dynamic_mask(q.transpose(1, 2), dt_states, self.window_size,
                                                    causal=self.causal)
        out = attention(q, k, v, causal=self.causal, attn_mask=attn_mask, attn_bias=attn_bias)
        return self.o_proj(out.reshape(batch, seqlen, self.num_heads * self.head_dim))
