"""`attention(..., block_table=, seqused_k=)` off the split-KV path: the CPU reference and the
per-sequence path (a gradient, or prefill-sized calls), against the same keys given
contiguously; gradients reach the pages."""
from __future__ import annotations

from helpers import DEVICE
import pytest
import torch

import omniattn
from omniattn.reference import attention_reference


def _paged(batch=2, seqlen_q=3, heads=4, heads_k=2, head_dim=16, page_size=16, pages=9,
           dtype=torch.float32, seed=0, device=DEVICE):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=generator, dtype=dtype)
    k = torch.randn(pages, page_size, heads_k, head_dim, generator=generator, dtype=dtype)
    v = torch.randn(pages, page_size, heads_k, head_dim, generator=generator, dtype=dtype)
    table = torch.randperm(pages, generator=generator)[:batch * 4].view(batch, 4)
    return [t.to(device).requires_grad_() for t in (q, k, v)] + [table.to(device, torch.int32)]


def _contiguous(q, k, v, table, used, **options):
    """Each sequence's keys gathered by hand, attended alone."""
    outs = []
    for b, n in enumerate(used.tolist()):
        kb = k[table[b].long()].flatten(0, 1)[:n][None]
        vb = v[table[b].long()].flatten(0, 1)[:n][None]
        bias = options.get("attn_bias")
        kwargs = dict(options, attn_bias=bias[b:b + 1, ..., :n]) if bias is not None else options
        outs.append(attention_reference(q[b:b + 1], kb, vb, return_lse=True, **kwargs))
    return torch.cat([out for out, _ in outs]), torch.cat([lse for _, lse in outs])


@pytest.mark.parametrize("path", ["reference", "per_sequence"])
def test_paged_matches_contiguous_with_gradients(path, monkeypatch):
    device = DEVICE
    if path == "reference":  # CPU tensors without the interpreter
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        device = "cpu"
    q, k, v, table = _paged(device=device)
    used = torch.tensor([50, 7], dtype=torch.int32, device=device)
    bias = torch.randn(2, 2, 1, 64, device=device)
    options = dict(causal=True, window=(30, -1), softcap=2.0, attn_bias=bias)
    plan = omniattn.explain(q, k, v, block_table=table, seqused_k=used, **options)
    assert plan.forward.kernel == path
    out = omniattn.attention(q, k, v, block_table=table, seqused_k=used, **options)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    expected, _ = _contiguous(q, k, v, table, used, **options)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    for got, want in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v))):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert grads[1][table[1, 1:].long()].abs().sum() == 0  # pages past sequence 1's 7 keys


def test_prefill_sized_paged_call_without_gradient():
    q, k, v, table = _paged(seqlen_q=20)
    used = torch.tensor([64, 33], dtype=torch.int32, device=DEVICE)
    with torch.no_grad():
        assert omniattn.explain(q, k, v, block_table=table,
                                seqused_k=used).forward.kernel == "per_sequence"
        out, lse = omniattn.attention(q, k, v, block_table=table, seqused_k=used, causal=True,
                                      return_lse=True)
        expected = _contiguous(q, k, v, table, used, causal=True)
    torch.testing.assert_close(out, expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, expected[1], atol=1e-4, rtol=1e-4)


def test_paged_topk_selects_within_each_sequence():
    """top-k over paged keys: each sequence selects among its used keys, its scores cut to them."""
    q, k, v, table = _paged()
    used = torch.tensor([64, 21], dtype=torch.int32, device=DEVICE)
    scores = torch.randn(2, 2, 1, 64, device=DEVICE)
    with torch.no_grad():
        out = omniattn.attention(q, k, v, block_table=table, seqused_k=used, causal=True,
                                 topk=5, topk_scores=scores)
        expected = torch.cat([
            attention_reference(q[b:b + 1], k[table[b].long()].flatten(0, 1)[:n][None],
                                v[table[b].long()].flatten(0, 1)[:n][None], causal=True, topk=5,
                                topk_scores=scores[b:b + 1, ..., :n])
            for b, n in enumerate(used.tolist())])
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
