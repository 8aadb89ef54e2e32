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


def test_forward_is_documented():
    doc = DynamicMaskAttention.forward.__doc__
    assert doc is not None
    for term in ("(B, S, hidden_size)", "attention_mask", "(B, S)"):
        assert term in doc, term


def test_hidden_size_the_heads_do_not_divide():
    with pytest.raises(ValueError, match=r"^hidden_size \(128\) is not a multiple of num_heads "
                                         r"\(3\)"):
        DynamicMaskAttention(128, num_heads=3)
    layer = DynamicMaskAttention(128, num_heads=3, head_dim=32)
    assert layer.q_proj.out_features == 96 and layer.o_proj.out_features == 128


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_heads=0), r"^num_heads must be a positive int, got 0$"),
    (dict(num_heads=4, num_heads_k=0), r"^num_heads_k must be a positive int or None, got 0$"),
    (dict(num_heads=4, head_dim=-8), r"^head_dim must be a positive int or None, got -8$"),
    (dict(num_heads=4, window_size=0), r"^window_size must be a positive int, got 0$"),
])
def test_bad_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicMaskAttention(32, **kwargs)
    with pytest.raises(TypeError, match=r"^hidden_size must be a positive int, got float$"):
        DynamicMaskAttention(32.0, num_heads=4)


def test_wrong_input_width():
    layer = DynamicMaskAttention(32, num_heads=4)
    with pytest.raises(ValueError, match=r"^hidden_states must be \(B, S, hidden_size = 32\), got "
                                         r"shape \(1, 5, 24\): its last dim 24 is not "
                                         r"hidden_size 32$"):
        layer(torch.randn(1, 5, 24))
    with pytest.raises(ValueError, match=r"^hidden_states must be \(B, S, hidden_size = 32\), got "
                                         r"shape \(5, 32\)$"):
        layer(torch.randn(5, 32))


@pytest.mark.parametrize("mask, error, message", [
    (torch.ones(2, 7, dtype=torch.bool), ValueError,
     r"^attention_mask must be a \(B, S\) = \(2, 6\) key padding mask \(bool or 0/1, True / 1 = "
     r"real token\), got shape \(2, 7\)$"),
    (torch.zeros(2, 1, 6, 6), ValueError, r"^attention_mask must be a \(B, S\) = \(2, 6\) key"),
    (torch.full((2, 6), 0.5), ValueError,
     r"^attention_mask \(dtype torch.float32\) must hold only 0 and 1 \(1 = real token\); an "
     r"additive mask is not a padding mask$"),
    ([[1] * 6] * 2, TypeError, r"^attention_mask must be a torch.Tensor or None, got list$"),
], ids=["length", "4-d", "not-0-1", "list"])
def test_bad_attention_mask(mask, error, message):
    layer = DynamicMaskAttention(32, num_heads=4)
    with pytest.raises(error, match=message):
        layer(torch.randn(2, 6, 32), attention_mask=mask)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_mask_matches_the_unpadded_sequence(monkeypatch, causal, side):
    """A padded sequence's real rows equal the module on its real tokens alone (padded keys are
    hidden from every query and from the top-k); padded rows output 0 and send no gradient."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(0)
    layer = DynamicMaskAttention(HIDDEN, num_heads=4, num_heads_k=2, window_size=5,
                                 causal=causal, bias=True)
    nn.init.normal_(layer.A)  # per-key scores that differ, so the top-k selects
    seqlen, real = 12, 8
    hidden = torch.randn(2, seqlen, HIDDEN, requires_grad=True)
    kept = slice(0, real) if side == "right" else slice(seqlen - real, seqlen)
    mask = torch.ones(2, seqlen, dtype=torch.long)  # transformers' 0/1 form
    mask[1] = 0
    mask[1, kept] = 1
    out = layer(hidden, attention_mask=mask)
    torch.testing.assert_close(out[0], layer(hidden[:1])[0])
    torch.testing.assert_close(out[1, kept], layer(hidden[1:, kept])[0])
    padded = mask[1] == 0
    assert torch.equal(out[1, padded], torch.zeros_like(out[1, padded]))
    (grad,) = torch.autograd.grad(out.sum(), hidden)
    assert torch.equal(grad[1, padded], torch.zeros_like(grad[1, padded]))
    assert grad[1, kept].abs().sum() > 0


def test_padding_mask_reaches_attention_key_wise(monkeypatch):
    """Without causal the keep mask stays (B, Hk, 1, S): the padding never makes it (S, S)."""
    import omniattn.nn.dynamic_mask_attention as module

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    shapes, attention = [], module.attention

    def spy(q, k, v, **kwargs):
        shapes.append(tuple(kwargs["attn_mask"].shape))
        return attention(q, k, v, **kwargs)

    monkeypatch.setattr(module, "attention", spy)
    layer = DynamicMaskAttention(HIDDEN, num_heads=4, num_heads_k=2, window_size=4, causal=False)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, 7:] = False
    layer(torch.randn(2, 10, HIDDEN), attention_mask=mask)
    assert shapes == [(2, 2, 1, 10)]
