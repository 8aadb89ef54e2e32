"""The chunked reference against a naive dense float64 attention written independently here."""
from __future__ import annotations

import math

import pytest
import torch

from omniattn.reference import attention_reference


def naive_attention(q, k, v, *, causal=False, window=None, scale=None, softcap=0.0, keep=None,
                    bias=None, row_lens=None):
    """Dense (B, H, Sq, Sk) everything, K/V repeated per group: obviously right, tiny shapes only."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    group = heads // heads_k
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + expand_heads(bias, heads, group)
    visible = torch.ones(batch, heads, seqlen_q, seqlen_k, dtype=torch.bool)
    for i in range(seqlen_q):
        for j in range(seqlen_k):
            diag = i + seqlen_k - seqlen_q
            if causal and j > diag:
                visible[:, :, i, j] = False
            if window is not None:
                left, right = window
                if (left >= 0 and j < diag - left) or (right >= 0 and j > diag + right):
                    visible[:, :, i, j] = False
    if keep is not None:
        visible &= expand_heads(keep, heads, group)
    if row_lens is not None:
        visible &= torch.arange(seqlen_k)[None, None, None, :] < row_lens[:, None, :, None]
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse


def expand_heads(t, heads, group):
    """(B|1, Hm|1, Sq|1, Sk|1) -> per query head, with Hm in {1, Hk, H}."""
    if t.shape[1] not in (1, heads):
        t = t.repeat_interleave(group, dim=1)
    return t


def rand(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, (3, 2)),
                                            (True, (4, -1)), (False, (-1, 0))])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(7, 7), (5, 9), (9, 5), (1, 6)])
def test_masks_and_gqa(causal, window, seqlen_q, seqlen_k):
    torch.manual_seed(0)
    q, k, v = rand(2, seqlen_q, 4, 8), rand(2, seqlen_k, 2, 8), rand(2, seqlen_k, 2, 8)
    out, lse = attention_reference(q, k, v, causal=causal, window=window, return_lse=True,
                                   chunk_size=3)
    ref_out, ref_lse = naive_attention(q, k, v, causal=causal, window=window)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse.float())


@pytest.mark.parametrize("mask_shape", [(2, 1, 1, 9), (1, 4, 6, 9), (2, 2, 6, 1), (2, 4, 6, 9)])
def test_mask_bias_broadcasts_and_dbias(mask_shape):
    torch.manual_seed(1)
    q, k, v = rand(2, 6, 4, 8), rand(2, 9, 2, 8), rand(2, 9, 2, 8)
    keep = torch.rand(mask_shape) > 0.3
    bias = rand(*mask_shape).requires_grad_()
    out = attention_reference(q, k, v, attn_mask=keep, attn_bias=bias, softcap=3.0, chunk_size=4)
    ref_out, _ = naive_attention(q, k, v, keep=keep, bias=bias, softcap=3.0)
    torch.testing.assert_close(out, ref_out)
    dout = rand(*out.shape)
    (dbias,) = torch.autograd.grad(out, bias, dout)
    (ref_dbias,) = torch.autograd.grad(ref_out, bias, dout)
    assert dbias.shape == bias.shape
    torch.testing.assert_close(dbias, ref_dbias)


def test_per_row_lengths_and_empty_rows():
    torch.manual_seed(2)
    q, k, v = [rand(2, 5, 2, 8).requires_grad_() for _ in range(3)]
    row_lens = torch.tensor([[0, 1, 5, 3, 0], [2, 2, 0, 4, 5]], dtype=torch.int32)
    out, lse = attention_reference(q, k, v, seqlens_k_per_row=row_lens, return_lse=True)
    ref_out, ref_lse = naive_attention(q, k, v, row_lens=row_lens)
    torch.testing.assert_close(out, ref_out)
    assert (out[0, 0] == 0).all() and (lse[0, :, 0] == float("-inf")).all()
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][0, 0] == 0).all()


def test_varlen_matches_per_sequence():
    torch.manual_seed(3)
    cu_q = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 11, 13], dtype=torch.int32)
    q, k, v = rand(10, 4, 8), rand(13, 2, 8), rand(13, 2, 8)
    out, lse = attention_reference(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                                   return_lse=True)
    for i in range(3):
        qs = slice(cu_q[i], cu_q[i + 1])
        ks = slice(cu_k[i], cu_k[i + 1])
        ref_out, ref_lse = naive_attention(q[None, qs], k[None, ks], v[None, ks], causal=True)
        torch.testing.assert_close(out[qs], ref_out[0])
        torch.testing.assert_close(lse[:, qs], ref_lse[0].float())


def test_chunked_backward_matches_unchunked():
    """The checkpointed chunks give the same gradients as one chunk."""
    torch.manual_seed(4)
    q, k, v = [rand(1, 11, 2, 8).requires_grad_() for _ in range(3)]
    grads = []
    for chunk in (2, 64):
        out = attention_reference(q, k, v, causal=True, chunk_size=chunk)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
