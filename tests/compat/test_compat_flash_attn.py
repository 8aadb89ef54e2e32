"""flash_attn façade (FlashAttention-3 interface + per_row_seqlens_k): argument order, the 2-D and
1-D length forms, varlen, window_size mapping, (out, lse) return, unsupported arguments."""
from __future__ import annotations

import pytest
import torch

import omniattn
from helpers import DEVICE, check_against_reference, random_qkv
from omniattn.compat import flash_attn_func, flash_attn_varlen_func


@pytest.mark.parametrize("flat", [False, True], ids=["2d", "1d"])
def test_per_row_seqlens_k(flat):
    torch.manual_seed(0)
    q, k, v = random_qkv(2, 21, 30, 4, 2, 32, torch.float16)
    lens = torch.randint(0, 31, (2, 21), dtype=torch.int32, device=DEVICE)
    lens[0, 0] = 0
    # positional order of the original: q, k, v, softmax_scale, causal
    out, lse = flash_attn_func(q, k, v, 0.2, True, window_size=(11, -1),
                               per_row_seqlens_k=lens.flatten() if flat else lens)
    assert lse.shape == (2, 4, 21) and lse.dtype == torch.float32
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, lse, grads, q, k, v, dout, softmax_scale=0.2, causal=True,
                            window=(11, 0), seqlens_k_per_row=lens)


def test_varlen():
    torch.manual_seed(1)
    lengths_q, lengths_k = [3, 19, 8], [10, 19, 1]
    q = torch.randn(sum(lengths_q), 2, 16, device=DEVICE, dtype=torch.float16)
    k = torch.randn(sum(lengths_k), 1, 16, device=DEVICE, dtype=torch.float16)
    v = torch.randn_like(k)
    cu_q = torch.tensor([0, 3, 22, 30], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 10, 29, 30], dtype=torch.int32, device=DEVICE)
    lens = torch.cat([torch.randint(0, n + 1, (m,)) for m, n in zip(lengths_q, lengths_k)])
    lens = lens.int().to(DEVICE)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 19, 19, causal=True,
                                      per_row_seqlens_k=lens)
    assert lse.shape == (2, 30)
    check_against_reference(out, lse, None, q, k, v, torch.zeros_like(q), causal=True,
                            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqlens_k_per_row=lens)


@pytest.mark.parametrize("with_rows", [False, True])
def test_seqused_k(with_rows):
    """seqused_k: each sequence uses its first keys only, as per-row lengths ANDed with
    per_row_seqlens_k: keys past them (large values here) change nothing and get zero
    gradients."""
    torch.manual_seed(2)
    lengths_q, lengths_k, used = [5, 17, 2], [12, 20, 3], [7, 20, 0]
    cu_q = torch.tensor([0, 5, 22, 24], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 12, 32, 35], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(lengths_q), 2, 16, device=DEVICE, dtype=torch.float16)
    k = torch.randn(sum(lengths_k), 2, 16, device=DEVICE, dtype=torch.float16)
    v = torch.randn_like(k)
    for start, n_used, n_k in zip(cu_k.tolist(), used, lengths_k):
        k[start + n_used:start + n_k] = 1e4
        v[start + n_used:start + n_k] = 1e4
    seqused_k = torch.tensor(used, dtype=torch.int32, device=DEVICE)
    expected_lens = torch.repeat_interleave(seqused_k, torch.tensor(lengths_q, device=DEVICE))
    rows = None
    if with_rows:
        rows = torch.cat([torch.randint(0, n + 1, (m,)) for m, n in zip(lengths_q, lengths_k)])
        rows = rows.int().to(DEVICE)
        expected_lens = torch.minimum(expected_lens, rows)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 20, seqused_k=seqused_k,
                                      per_row_seqlens_k=rows)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    # the reference sees the same call with the unused keys zeroed and lengths per row
    unused = torch.ones(k.shape[0], dtype=torch.bool, device=DEVICE)
    for start, n_used in zip(cu_k.tolist(), used):
        unused[start:start + n_used] = False
    assert (grads[1][unused] == 0).all() and (grads[2][unused] == 0).all()
    clean = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with torch.no_grad():
        clean[1][unused] = 0
        clean[2][unused] = 0
    check_against_reference(out, lse, grads, *clean, dout, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            seqlens_k_per_row=expected_lens.int())


def test_seqused_k_errors():
    q = torch.randn(6, 2, 16, device=DEVICE, dtype=torch.float16)
    k = torch.randn(6, 2, 16, device=DEVICE, dtype=torch.float16)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE)
    used = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(NotImplementedError, match="seqused_k with causal"):
        flash_attn_varlen_func(q, k, k, cu, cu, 4, 4, seqused_k=used, causal=True)
    with pytest.raises(TypeError, match=r"^seqused_k must be an int32 tensor of shape \(B,\), got "
                                        r"dtype torch.int64$"):
        flash_attn_varlen_func(q, k, k, cu, cu, 4, 4, seqused_k=used.long())
    with pytest.raises(ValueError, match="seqused_k has shape"):
        flash_attn_varlen_func(q, k, k, cu, cu, 4, 4, seqused_k=used[:1])


@pytest.mark.parametrize("kwargs", [dict(attention_chunk=64), dict(qv=torch.zeros(1)),
                                    dict(q_descale=torch.ones(1))])
def test_unsupported_arguments(kwargs):
    q, k, v = random_qkv(1, 4, 4, 2, 2, 16, torch.float16, requires_grad=False)
    name = next(iter(kwargs))
    with pytest.raises(NotImplementedError, match=f"^flash_attn façade: {name} is not supported"):
        flash_attn_func(q, k, v, **kwargs)


def test_unsupported_tensor_is_described_not_printed():
    q, k, v = random_qkv(1, 4, 4, 2, 2, 16, torch.float16, requires_grad=False)
    with pytest.raises(NotImplementedError) as raised:
        flash_attn_func(q, k, v, qv=torch.randn(1, 4, 2, 64))
    message = str(raised.value)
    assert "tensor(" not in message and len(message) < 200, message
    assert "shape (1, 4, 2, 64), dtype torch.float32" in message


def _packed_qkv():
    q = torch.randn(6, 2, 16, device=DEVICE, dtype=torch.float16)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE)
    return q, cu


@pytest.mark.parametrize("window, error", [((-2, -2), ValueError), ((0, -3), ValueError),
                                           ((1.5, 0), TypeError), (3, TypeError)])
def test_window_size_follows_attentions_rule(window, error):
    """One window rule: attention's message, under the façade's argument name."""
    q, k, v = random_qkv(1, 4, 4, 2, 2, 16, torch.float16, requires_grad=False)
    with pytest.raises(error) as direct:
        omniattn.attention(q, k, v, window=window)
    expected = str(direct.value).replace("window", "window_size", 1)
    assert expected.startswith("window_size ")
    with pytest.raises(error) as facade:
        flash_attn_func(q, k, v, window_size=window)
    assert str(facade.value) == expected
    packed, cu = _packed_qkv()
    with pytest.raises(error) as facade:
        flash_attn_varlen_func(packed, packed, packed, cu, cu, 4, 4, window_size=window)
    assert str(facade.value) == expected
