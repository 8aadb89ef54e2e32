"""flash_dmattn_func façade: argument order, return convention, mask/bias forwarding."""
from __future__ import annotations

import torch

import omniattn
from omniattn.compat import flash_dmattn_func


def test_matches_attention_on_the_reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(0)
    q = torch.randn(2, 9, 4, 16, requires_grad=True)
    k = torch.randn(2, 13, 2, 16, requires_grad=True)
    v = torch.randn(2, 13, 2, 16, requires_grad=True)
    mask = torch.rand(2, 2, 9, 13) > 0.3
    bias = torch.randn(2, 1, 1, 13, requires_grad=True)
    # positional order of the original: query, key, value, attn_mask, attn_bias, softmax_scale,
    # is_causal, softcap, deterministic, return_attn_probs
    out, lse = flash_dmattn_func(q, k, v, mask, bias, 0.3, True, 5.0, True, True)
    expected, expected_lse = omniattn.attention(q, k, v, attn_mask=mask, attn_bias=bias,
                                                softmax_scale=0.3, causal=True, softcap=5.0,
                                                return_lse=True)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, expected_lse)
    (dbias,) = torch.autograd.grad(flash_dmattn_func(q, k, v, mask, bias).sum(), bias)
    assert dbias.shape == bias.shape
    plain = flash_dmattn_func(q, k, v)
    torch.testing.assert_close(plain, omniattn.attention(q, k, v))


def test_docstring_states_shapes_and_differences():
    doc = flash_dmattn_func.__doc__
    assert doc is not None
    for term in ("(B, Sq, H, D)", "(B, Sk, Hk, D)", "attn_mask", "attn_bias", "is_causal",
                 "softcap", "deterministic", "return_attn_probs", "(B, H, Sq)", "Differences"):
        assert term in doc, term
