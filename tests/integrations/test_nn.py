"""DynamicMaskAttention: a tiny model learns on the CPU (reference path); the selection inside
attention (topk, block_size) against the materialised keep mask it replaced; no (S, S)
allocation at S = 4096."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from omniattn import attention
from omniattn.masks import prepare_dynamic_mask
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


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_padding_mask_reaches_attention_key_wise(monkeypatch, causal):
    """The padding reaches attention as a (B, 1, 1, S) key mask and the selection as topk over
    (B, Hk, 1, S) scores: nothing (S, S), causal or not."""
    import omniattn.nn.dynamic_mask_attention as module

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    calls, attention = [], module.attention

    def spy(q, k, v, **kwargs):
        calls.append({name: tuple(value.shape) if isinstance(value, torch.Tensor) else value
                      for name, value in kwargs.items() if name != "causal"})
        return attention(q, k, v, **kwargs)

    monkeypatch.setattr(module, "attention", spy)
    layer = DynamicMaskAttention(HIDDEN, num_heads=4, num_heads_k=2, window_size=4, causal=causal)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, 7:] = False
    layer(torch.randn(2, 10, HIDDEN), attention_mask=mask)
    assert calls == [{"attn_mask": (2, 1, 1, 10), "attn_bias": (2, 2, 1, 10), "topk": 4,
                      "topk_scores": (2, 2, 1, 10)}]


def materialised_forward(layer: DynamicMaskAttention, hidden: torch.Tensor,
                         attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The module's forward before issue #53 part 3: the keep mask materialised as a
    (B, Hk, S|1, S) bool tensor by prepare_dynamic_mask, then attention with mask and bias."""
    batch, seqlen, _ = hidden.shape
    q = layer.q_proj(hidden).view(batch, seqlen, layer.num_heads, layer.head_dim)
    k = layer.k_proj(hidden).view(batch, seqlen, layer.num_heads_k, layer.head_dim)
    v_flat = layer.v_proj(hidden)
    v = v_flat.view(batch, seqlen, layer.num_heads_k, layer.head_dim)
    dt_states = (layer.A * nn.functional.softplus(layer.dt_proj(v_flat))).transpose(1, 2)
    real = None if attention_mask is None else attention_mask != 0
    attn_bias, attn_mask = prepare_dynamic_mask(
        q.transpose(1, 2), dt_states, layer.window_size,
        attention_mask=None if real is None else real[:, None, None, :], causal=layer.causal,
        block_size=layer.block_size)
    out = attention(q, k, v, causal=layer.causal, attn_mask=attn_mask, attn_bias=attn_bias)
    out = layer.o_proj(out.reshape(batch, seqlen, layer.num_heads * layer.head_dim))
    return out if real is None else out.masked_fill(~real[..., None], 0.0)


def _padding(kind: str, seqlen: int) -> torch.Tensor | None:
    """None, or a (2, S) 0/1 padding mask whose second sequence is padded on `kind`'s side."""
    if kind == "none":
        return None
    mask = torch.ones(2, seqlen, dtype=torch.long)
    if kind == "right":
        mask[1, seqlen - 5:] = 0
    else:
        mask[1, :5] = 0
    return mask


def _assert_same_forward_and_gradients(layer, hidden, mask):
    out = layer(hidden, attention_mask=mask)
    expected = materialised_forward(layer, hidden, mask)
    torch.testing.assert_close(out, expected)
    inputs = (hidden, layer.A, layer.dt_proj.weight, layer.q_proj.weight, layer.v_proj.weight)
    dout = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, inputs, dout),
                         torch.autograd.grad(expected, inputs, dout)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("scores", ["random", "tied"])
@pytest.mark.parametrize("window_size", [5, 64], ids=["window_5", "window_past_S"])
@pytest.mark.parametrize("padding", ["none", "right", "left"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_topk_inside_attention_matches_the_materialised_mask(monkeypatch, causal, padding,
                                                             window_size, scores):
    """attention(topk=, topk_scores=) keeps what the materialised keep mask kept: outputs and
    gradients equal, GQA, with padding, causal or not, a window past S; `tied` (A = 0: every
    score 0) makes the tie rule (lower key index) choose every key."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(1)
    layer = DynamicMaskAttention(HIDDEN, num_heads=4, num_heads_k=2, window_size=window_size,
                                 causal=causal, bias=True)
    if scores == "random":
        nn.init.normal_(layer.A)
    hidden = torch.randn(2, 12, HIDDEN, requires_grad=True)
    _assert_same_forward_and_gradients(layer, hidden, _padding(padding, 12))


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_block_size_matches_the_materialised_mask(monkeypatch, causal, padding, block_size):
    """block_size (key-wise mask without causal, topk_block_mask with it) keeps what
    prepare_dynamic_mask(block_size=) materialises; 3 leaves a shorter last block of 20 keys."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(2)
    layer = DynamicMaskAttention(HIDDEN, num_heads=4, num_heads_k=2, window_size=7,
                                 causal=causal, block_size=block_size)
    nn.init.normal_(layer.A)
    hidden = torch.randn(2, 20, HIDDEN, requires_grad=True)
    _assert_same_forward_and_gradients(layer, hidden, _padding(padding, 20))


def test_block_size_is_checked():
    with pytest.raises(ValueError, match=r"^block_size must be a positive int or None, got 0$"):
        DynamicMaskAttention(32, num_heads=4, block_size=0)
    with pytest.raises(TypeError, match=r"^block_size must be a positive int or None, got float$"):
        DynamicMaskAttention(32, num_heads=4, block_size=4.0)


class LargestAllocation(TorchDispatchMode):
    """The bytes of the largest storage any operator returns while the mode is on (a view
    counts its base: whatever it shows was allocated)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.largest = max(self.largest, leaf.untyped_storage().nbytes())
        return out


LONG = 4096


@pytest.mark.parametrize("block_size", [None, 64], ids=["topk", "block_size_64"])
def test_forward_allocates_nothing_seqlen_squared(monkeypatch, block_size):
    """S = 4096, causal, padded, GQA (2 query heads on 1 KV head): no operator of the forward
    returns S x S bytes or more (one bool per query and key; the materialised keep mask was
    (B, Hk, S, S) bool): the reference path's largest are its (chunk, S) temporaries."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(0)
    layer = DynamicMaskAttention(16, num_heads=2, num_heads_k=1, window_size=512,
                                 block_size=block_size)
    nn.init.normal_(layer.A)
    hidden = torch.randn(1, LONG, 16)
    mask = torch.ones(1, LONG, dtype=torch.bool)
    mask[0, :100] = False
    with torch.no_grad(), LargestAllocation() as allocations:
        out = layer(hidden, attention_mask=mask)
    assert out.shape == hidden.shape and torch.isfinite(out).all()
    assert 0 < allocations.largest < LONG * LONG, allocations.largest


def test_largest_allocation_sees_a_materialised_keep_mask(monkeypatch):
    """The check above can fail: the materialised causal keep mask at S = 4096 is caught."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with torch.no_grad(), LargestAllocation() as allocations:
        prepare_dynamic_mask(torch.empty(1, 2, LONG, 8), torch.randn(1, 1, LONG), 512,
                             causal=True)
    assert allocations.largest >= LONG * LONG
