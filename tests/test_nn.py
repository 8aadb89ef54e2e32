"""DynamicMaskAttention: a tiny model learns on the CPU (reference path)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from omniattn.nn import DynamicMaskAttention

VOCAB, HIDDEN, SEQLEN = 16, 32, 24


class TinyCopyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.position = nn.Parameter(torch.randn(SEQLEN, HIDDEN) * 0.5)
        self.attn = DynamicMaskAttention(HIDDEN, num_heads=4, num_heads_k=2, window_size=8)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        return self.head(self.attn(self.embed(tokens) + self.position))


def test_tiny_model_loss_falls(monkeypatch):
    """Copy task: predict the token 3 positions back, which needs attention to one selected key
    among a keep window of 8 (of up to 24 visible keys)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(0)
    model = TinyCopyModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    losses = []
    for _ in range(60):
        tokens = torch.randint(0, VOCAB, (8, SEQLEN))
        logits = model(tokens)[:, 3:]
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, :-3].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # chance level is log(16) = 2.77; the copy is learned well below it
    assert sum(losses[:5]) / 5 > 2.5 and sum(losses[-5:]) / 5 < 1.5
    assert model.attn.A.grad is not None and model.attn.dt_proj.weight.grad is not None


def test_bad_heads():
    with pytest.raises(ValueError, match="num_heads \\(6\\) must be a multiple of num_heads_k"):
        DynamicMaskAttention(24, num_heads=6, num_heads_k=4)
