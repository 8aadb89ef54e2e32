"""Dropout on the kernels (issue #5): the keep rate, reproducibility from torch's seed, and
forward/backward consistency: the mask each call draws is recovered exactly through the
public API (zero scores, one-hot values), then the kernels' output and every gradient are
checked against a float64 dense reference that applies that same mask.
"""
from __future__ import annotations

import math

import pytest
import torch

import omniattn
from helpers import DEVICE, GPU, assert_close, replace_backward_configs

SEED = 1234


def dropout_mask(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, p, **kwargs):
    """(B, H, Sq, Sk) bool keep mask of the call made right after torch.manual_seed(SEED):
    with q = k = 0 every visible probability of row i is 1 / (its visible keys) and a one-hot
    value row j shows element j. Hidden elements (causal) read as dropped."""
    q = torch.zeros(batch, seqlen_q, heads, head_dim, device=DEVICE, dtype=torch.float32)
    rows = torch.arange(seqlen_q, device=DEVICE)
    visible_keys = torch.full_like(rows, seqlen_k)
    if kwargs.get("causal"):
        visible_keys = (rows + seqlen_k - seqlen_q + 1).clamp(0, seqlen_k)
    keep = torch.empty(batch, heads, seqlen_q, seqlen_k, dtype=torch.bool, device=DEVICE)
    for first in range(0, seqlen_k, head_dim):
        keys = torch.arange(first, min(first + head_dim, seqlen_k), device=DEVICE)
        k = torch.zeros(batch, seqlen_k, heads_k, head_dim, device=DEVICE)
        v = torch.zeros_like(k)
        v[:, keys, :, keys - first] = 1.0
        torch.manual_seed(SEED)
        out = omniattn.attention(q, k, v, dropout_p=p, **kwargs)  # (B, Sq, H, D)
        scaled = out[..., : len(keys)].permute(0, 2, 1, 3) * visible_keys[:, None] * (1 - p)
        assert torch.allclose(scaled, scaled.round(), atol=1e-3)  # 0 or 1: one element each
        keep[..., keys] = scaled.round() == 1
    return keep


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate(p):
    batch, seqlen_q, seqlen_k, heads = (2, 200, 300, 4) if GPU else (1, 33, 40, 2)
    keep = dropout_mask(batch, seqlen_q, seqlen_k, heads, heads, 64 if GPU else 16, p)
    sigma = math.sqrt(p * (1 - p) / keep.numel())
    assert abs(keep.float().mean().item() - (1 - p)) < 4 * sigma
    # neighbouring keys (two halves of one 32-bit draw), and keys 8 apart (the next Philox
    # counter), are dropped independently: both kept at rate (1 - p)^2
    for first, second in ((keep[..., 0:-1:2], keep[..., 1::2]), (keep[..., :-8], keep[..., 8:])):
        pairs = first[..., :second.shape[-1]] & second[..., :first.shape[-1]]
        both = (1 - p) ** 2
        assert abs(pairs.float().mean().item() - both) < 5 * math.sqrt(
            both * (1 - both) / pairs.numel()), "correlated dropout decisions"
    # every (batch, head) draws its own elements
    assert not torch.equal(keep[:, 0], keep[:, 1])


def reference_with_mask(q, k, v, keep, p, dout, dtype, causal=False):
    """out and (dq, dk, dv) of attention whose probabilities are multiplied by keep / (1 - p),
    in `dtype` (float64: the exact reference; the input dtype: plain PyTorch)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    q_, k_, v_ = (t.transpose(1, 2) for t in leaves)
    group = q_.shape[1] // k_.shape[1]
    k_, v_ = k_.repeat_interleave(group, 1), v_.repeat_interleave(group, 1)
    scores = q_ @ k_.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = scores.shape[-2:]
        visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, -1) * keep / (1 - p)
    out = (probs @ v_).transpose(1, 2)
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    return out.detach(), grads


@pytest.mark.parametrize("dkdv_apart", [False, True], ids=["dkdv_together", "dkdv_apart"])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_backward_consistency(monkeypatch, causal, dkdv_apart):
    batch, seqlen_q, seqlen_k, heads, heads_k, head_dim = \
        (2, 130, 257, 4, 2, 64) if GPU else (1, 21, 37, 4, 2, 16)
    p = 0.3
    if dkdv_apart:  # dV and dK from programs of their own draw the same dropout mask
        replace_backward_configs(monkeypatch, dkdv_apart=True)
    keep = dropout_mask(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, p, causal=causal)
    dtype = torch.float16
    q = torch.randn(batch, seqlen_q, heads, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, seqlen_k, heads_k, head_dim, device=DEVICE, dtype=dtype,
                    requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    dout = torch.randn_like(q)
    torch.manual_seed(SEED)  # the same seed: the same mask
    out = omniattn.attention(q, k, v, dropout_p=p, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    exact_out, exact_grads = reference_with_mask(q, k, v, keep, p, dout, torch.float64, causal)
    plain_out, plain_grads = reference_with_mask(q, k, v, keep, p, dout, dtype, causal)
    assert_close("out", out, exact_out, plain_out, dtype)
    for name, got, exact, plain in zip(("dq", "dk", "dv"), grads, exact_grads, plain_grads):
        assert_close(name, got, exact, plain, dtype)


def test_reproducible_and_seed_dependent():
    q, k, v = (torch.randn(1, 19, 2, 16, device=DEVICE, dtype=torch.float16) for _ in range(3))
    outs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        outs.append(omniattn.attention(q, k, v, dropout_p=0.5))
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])
