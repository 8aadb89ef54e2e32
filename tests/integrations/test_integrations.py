"""transformers attention function (plain function tests; registration only if installed): the
keep window selected inside attention against the materialised mask it replaced."""
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


def _materialised(q, k, v, attention_mask, bias, window_size, causal, block_size=None):
    """The function's result before issue #53 part 3: the keep mask materialised by topk_mask."""
    keep = None if attention_mask is None else (
        (attention_mask != 0)[:, None, None, :] if attention_mask.dim() == 2
        else attention_mask == 0)
    if window_size is not None and (block_size is not None or k.shape[2] > window_size):
        keep = topk_mask(bias, window_size, keep, causal=causal, seqlen_q=q.shape[2],
                         block_size=block_size)
    return omniattn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              causal=causal, attn_mask=keep, attn_bias=bias)


MASK_FORMS = ["none", "padding_2d", "additive_4d"]
BIAS_SHAPES = {"key": (2, 2, 1, 12), "full": (2, 4, 7, 12), "shared": (1, 1, 1, 12)}


@pytest.mark.parametrize("window_size", [4, 12], ids=["window_4", "window_Sk"])
@pytest.mark.parametrize("bias_shape", BIAS_SHAPES)
@pytest.mark.parametrize("mask_form", MASK_FORMS)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_keep_window_inside_attention_matches_the_materialised_mask(causal, mask_form,
                                                                    bias_shape, window_size):
    """window_size selects inside attention (topk) what topk_mask materialised: integer-valued
    biases (ties to the lower key index), GQA (4 query heads, 2 KV heads), 2-D padding and 4-D
    additive masks, key-wise, full and shared biases, a window of all Sk keys."""
    q, k, v = _inputs()
    generator = torch.Generator().manual_seed(len(mask_form) + window_size)
    bias = torch.randint(-2, 3, BIAS_SHAPES[bias_shape], generator=generator).float()
    mask = {"none": None, "padding_2d": torch.ones(2, 12, dtype=torch.long),
            "additive_4d": torch.where(torch.rand(2, 1, 7, 12, generator=generator) > 0.3, 0.0,
                                       torch.finfo(torch.float32).min)}[mask_form]
    if mask_form == "padding_2d":
        mask[1, :3] = 0
    module = Module()
    module.is_causal = causal
    out, _ = flash_dynamic_mask_attention_forward(module, q, k, v, mask, bias,
                                                  window_size=window_size)
    # a 4-D mask holds causal itself
    expected = _materialised(q, k, v, mask, bias, window_size,
                             causal and mask_form != "additive_4d")
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("block_size", [3, 5])
@pytest.mark.parametrize("bias_shape", ["key", "full"])
@pytest.mark.parametrize("mask_form", MASK_FORMS)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_block_size_matches_the_materialised_mask(causal, mask_form, bias_shape, block_size):
    """block_size smooths the selection as topk_mask(block_size=) does, through a key-wise mask
    or a topk_block_mask, with window_size smaller than Sk and not."""
    q, k, v = _inputs()
    generator = torch.Generator().manual_seed(block_size)
    bias = torch.randn(BIAS_SHAPES[bias_shape], generator=generator)
    mask = {"none": None, "padding_2d": (torch.rand(2, 12, generator=generator) > 0.2).long(),
            "additive_4d": torch.where(torch.rand(2, 1, 7, 12, generator=generator) > 0.3, 0.0,
                                       -1e9)}[mask_form]
    module = Module()
    module.is_causal = causal
    for window_size in (5, 12):
        out, _ = flash_dynamic_mask_attention_forward(module, q, k, v, mask, bias,
                                                      window_size=window_size,
                                                      block_size=block_size)
        expected = _materialised(q, k, v, mask, bias, window_size,
                                 causal and mask_form != "additive_4d", block_size)
        torch.testing.assert_close(out, expected)


def test_no_seqlen_squared_argument_for_a_padding_mask(monkeypatch):
    """A 2-D padding mask and a key-wise bias reach attention as (B, 1, 1, Sk) and
    (B, Hk, 1, Sk) tensors and topk, causal or not: nothing (Sq, Sk)."""
    import omniattn.integrations.transformers as integration

    calls, attention = [], integration.attention

    def spy(q, k, v, **kwargs):
        calls.append({name: tuple(value.shape) for name, value in kwargs.items()
                      if isinstance(value, torch.Tensor)} | {"topk": kwargs.get("topk")})
        return attention(q, k, v, **kwargs)

    monkeypatch.setattr(integration, "attention", spy)
    q, k, v = _inputs()
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[0, 9:] = 0
    for causal in (False, True):
        module = Module()
        module.is_causal = causal
        flash_dynamic_mask_attention_forward(module, q, k, v, padding, torch.randn(2, 2, 1, 12),
                                             window_size=4)
    key_wise = {"attn_mask": (2, 1, 1, 12), "attn_bias": (2, 2, 1, 12),
                "topk_scores": (2, 2, 1, 12), "topk": 4}
    assert calls == [key_wise, key_wise]


def test_block_size_needs_a_window():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=r"^block_size \(4\) smooths the keep window's "
                                         r"selection: pass window_size too$"):
        flash_dynamic_mask_attention_forward(Module(), q, k, v, None, torch.randn(2, 2, 1, 12),
                                             block_size=4)
    with pytest.raises(ValueError, match=r"^window_size must be a positive int, got 0$"):
        flash_dynamic_mask_attention_forward(Module(), q, k, v, None, torch.randn(2, 2, 1, 12),
                                             window_size=0)


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
