"""transformers attention function (plain function tests; registration only if installed)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import omniattn
from omniattn.integrations.transformers import flash_dynamic_mask_attention_forward
from omniattn.masks import topk_mask


class Module(torch.nn.Module):
    is_causal = True


def _inputs():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 7, 16, generator=generator)  # (B, H, Sq, D), transformers' layout
    k = torch.randn(2, 2, 12, 16, generator=generator)
    v = torch.randn(2, 2, 12, 16, generator=generator)
    return q, k, v


@pytest.fixture(autouse=True)
def _reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_padding_mask_and_causal_from_module():
    q, k, v = _inputs()
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, :3] = 0  # left padding of the second sequence
    out, weights = flash_dynamic_mask_attention_forward(Module(), q, k, v, padding)
    assert weights is None and out.shape == (2, 7, 4, 16)
    expected = omniattn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                  causal=True, attn_mask=(padding != 0)[:, None, None, :])
    torch.testing.assert_close(out, expected)


def test_additive_4d_mask_and_keep_window():
    q, k, v = _inputs()
    causal = torch.ones(7, 12, dtype=torch.bool).tril(5)[None, None]
    additive = torch.where(causal, 0.0, torch.finfo(torch.float32).min).expand(2, 1, 7, 12)
    bias = torch.randn(2, 2, 1, 12)
    out, _ = flash_dynamic_mask_attention_forward(Module(), q, k, v, additive, bias, scaling=0.5,
                                                  window_size=4)
    keep = topk_mask(bias, 4, causal)
    expected = omniattn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                  attn_mask=keep, attn_bias=bias, softmax_scale=0.5)
    torch.testing.assert_close(out, expected)


def test_bad_mask_rank():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="attention_mask must be 2-D"):
        flash_dynamic_mask_attention_forward(Module(), q, k, v, torch.ones(2, 7, 12))


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed")
def test_llama_with_omniattn_matches_eager():
    """A tiny Llama (GQA) loaded with attn_implementation="omniattn" gives eager's logits, with
    and without left padding."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    eager = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="eager")
    ours = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="omniattn")
    ours.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 64, (2, 19))
    padding = torch.ones(2, 19, dtype=torch.long)
    padding[1, :4] = 0
    with torch.no_grad():
        for mask in (None, padding):
            expected = eager.eval()(ids, attention_mask=mask).logits
            got = ours.eval()(ids, attention_mask=mask).logits
            # left-padded positions are garbage in both; compare the real tokens
            torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(got[1, 4:], expected[1, 4:], atol=1e-5, rtol=1e-4)
