"""`omniattn.compat.flash_attn_with_kvcache` against FlashAttention's semantics, rebuilt here
independently: the cache after the append written slot by slot, rotary as complex products
(interleaved) or rotate-half (not), and each sequence's valid keys [leftpad, seqlens + new)
attended by the float64 reference. Decode-sized calls run split-KV decoding (the interpreter on
a CPU), the prefill-sized one the per-sequence path."""
from __future__ import annotations

from helpers import DEVICE
import pytest
import torch

from omniattn.compat import flash_attn_with_kvcache
from omniattn.reference import attention_reference


def _rotary_tables(seqlen_ro, rotary_dim, generator):
    angles = torch.rand(seqlen_ro, rotary_dim // 2, generator=generator, dtype=torch.float64) * 6
    return angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)


def _rotate(x, cos, sin, positions, interleaved):
    """x (S, heads, D) float64 rotated at positions (S,)."""
    half = cos.shape[1]
    c, s = cos.double()[positions][:, None], sin.double()[positions][:, None]
    x = x.clone()
    if interleaved:
        pairs = torch.complex(x[..., 0:2 * half:2], x[..., 1:2 * half:2]) * torch.complex(c, s)
        x[..., 0:2 * half:2], x[..., 1:2 * half:2] = pairs.real, pairs.imag
    else:
        part = x[..., :2 * half]
        turned = torch.cat((-part[..., half:], part[..., :half]), -1)
        x[..., :2 * half] = part * torch.cat((c, c), -1) + turned * torch.cat((s, s), -1)
    return x


def _expected(q, k_cache, v_cache, k, v, seqlens, leftpad=None, batch_idx=None,
              block_table=None, rotary=None, interleaved=True, causal=False, window=None,
              softcap=0.0):
    """(out float64, lse, the caches after the append) by FlashAttention's semantics."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    page_size = k_cache.shape[1]
    outs, lses = [], []
    for b in range(q.shape[0]):
        start = int(seqlens[b])
        new = 0 if k is None else k.shape[1]
        qb, kb = q[b].double(), None if k is None else k[b].double()
        if rotary is not None:
            kb = _rotate(kb, *rotary, torch.arange(start, start + new), interleaved)
            rows = torch.arange(start, start + q.shape[1]) if causal or window is not None \
                else torch.full((q.shape[1],), start)
            qb = _rotate(qb, *rotary, rows, interleaved)
        for j in range(new):  # slot by slot
            slot = start + j
            if block_table is not None:
                where = (int(block_table[b, slot // page_size]), slot % page_size)
            else:
                where = (int(batch_idx[b]) if batch_idx is not None else b, slot)
            k_cache[where] = kb[j].to(k_cache.dtype)
            v_cache[where] = v[b, j]
        if block_table is not None:
            keys = k_cache[block_table[b].long()].flatten(0, 1)
            values = v_cache[block_table[b].long()].flatten(0, 1)
        else:
            row = int(batch_idx[b]) if batch_idx is not None else b
            keys, values = k_cache[row], v_cache[row]
        first = int(leftpad[b]) if leftpad is not None else 0
        keys, values = keys[first:start + new], values[first:start + new]
        out, lse = attention_reference(qb[None], keys[None].double(), values[None].double(),
                                       causal=causal, window=window, softcap=softcap,
                                       return_lse=True)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), k_cache, v_cache


def _inputs(batch, seqlen_q, new, heads, heads_k, head_dim, cache_rows, cache_len, seed):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=generator, dtype=torch.float16).to(DEVICE)

    cache = (cache_rows, cache_len, heads_k, head_dim)
    return (randn(batch, seqlen_q, heads, head_dim), randn(*cache), randn(*cache),
            randn(batch, new, heads_k, head_dim), randn(batch, new, heads_k, head_dim), generator)


def _check(got, expected, caches):
    out, lse = got
    torch.testing.assert_close(out.double(), expected[0], atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(lse.double(), expected[1].double(), atol=3e-3, rtol=3e-3)
    for cache, after in zip(caches, expected[2:]):
        torch.testing.assert_close(cache, after, atol=2e-3, rtol=2e-3)


@pytest.mark.interpreter
@pytest.mark.parametrize("interleaved", [True, False])
def test_append_with_rotary(interleaved):
    q, k_cache, v_cache, k, v, generator = _inputs(3, 1, 1, 4, 2, 32, 3, 80, seed=1)
    seqlens = torch.tensor([0, 37, 79], dtype=torch.int32, device=DEVICE)
    rotary = _rotary_tables(80, 16, generator)
    expected = _expected(q, k_cache, v_cache, k, v, seqlens, rotary=rotary,
                         interleaved=interleaved, causal=True)
    got = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, *rotary, cache_seqlens=seqlens,
                                  causal=True, rotary_interleaved=interleaved,
                                  return_softmax_lse=True)
    _check(got, expected, (k_cache, v_cache))


@pytest.mark.interpreter
@pytest.mark.parametrize("cache_len", [64, 70])  # one page per row, or gathered
def test_cache_batch_idx(cache_len):
    q, k_cache, v_cache, k, v, generator = _inputs(2, 3, 2, 4, 1, 16, 5, cache_len, seed=2)
    seqlens = torch.tensor([40, 9], dtype=torch.int32, device=DEVICE)
    batch_idx = torch.tensor([4, 1], dtype=torch.int32, device=DEVICE)
    rotary = _rotary_tables(cache_len, 16, generator)
    expected = _expected(q, k_cache, v_cache, k, v, seqlens, batch_idx=batch_idx, rotary=rotary,
                         interleaved=False)  # not causal: q rotated at seqlens
    got = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, *rotary, cache_seqlens=seqlens,
                                  cache_batch_idx=batch_idx, rotary_interleaved=False,
                                  return_softmax_lse=True)
    _check(got, expected, (k_cache, v_cache))


@pytest.mark.interpreter
@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_append_window_softcap_leftpad(page_size):
    batch, pages_per_seq = 2, 128 // page_size
    q, k_cache, v_cache, k, v, generator = _inputs(batch, 2, 2, 6, 3, 32, batch * pages_per_seq
                                                   + 2, page_size, seed=page_size)
    table = torch.randperm(batch * pages_per_seq + 2, generator=generator)[
        :batch * pages_per_seq].view(batch, pages_per_seq).to(DEVICE, torch.int32)
    seqlens = torch.tensor([100, 31], dtype=torch.int32, device=DEVICE)
    leftpad = torch.tensor([3, 0], dtype=torch.int32, device=DEVICE)
    options = dict(causal=True, window=(40, -1), softcap=4.0)
    expected = _expected(q, k_cache, v_cache, k, v, seqlens, leftpad=leftpad, block_table=table,
                         **options)
    got = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                  cache_leftpad=leftpad, block_table=table, causal=True,
                                  window_size=(40, -1), softcap=4.0, return_softmax_lse=True)
    _check(got, expected, (k_cache, v_cache))


@pytest.mark.interpreter
def test_no_append_and_int_seqlens():
    q, k_cache, v_cache, _, _, _ = _inputs(2, 1, 0, 2, 2, 16, 2, 48, seed=4)
    expected = _expected(q, k_cache, v_cache, None, None, [30, 30])
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=30)
    torch.testing.assert_close(out.double(), expected[0], atol=3e-3, rtol=3e-3)
    # no cache_seqlens: every slot
    expected = _expected(q, k_cache, v_cache, None, None, [48, 48])
    out = flash_attn_with_kvcache(q, k_cache, v_cache, causal=True)
    torch.testing.assert_close(out.double(), expected[0], atol=3e-3, rtol=3e-3)


@pytest.mark.interpreter
def test_prefill_sized_append():
    """20 query rows: the per-sequence path (ordinary kernels), pages gathered."""
    q, k_cache, v_cache, k, v, generator = _inputs(2, 20, 20, 2, 1, 16, 8, 16, seed=5)
    table = torch.randperm(8, generator=generator).view(2, 4).to(DEVICE, torch.int32)
    seqlens = torch.tensor([3, 40], dtype=torch.int32, device=DEVICE)
    expected = _expected(q, k_cache, v_cache, k, v, seqlens, block_table=table, causal=True)
    got = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                  block_table=table, causal=True, return_softmax_lse=True)
    _check(got, expected, (k_cache, v_cache))


def test_errors_write_nothing():
    q, k_cache, v_cache, k, v, _ = _inputs(2, 1, 1, 2, 2, 16, 2, 32, seed=6)
    before = k_cache.clone()
    seqlens = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(NotImplementedError, match="alibi_slopes is not supported"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                alibi_slopes=torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="k and v are appended together"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, cache_seqlens=seqlens)
    with pytest.raises(ValueError, match="needs cache_seqlens"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v)
    with pytest.raises(TypeError, match="cache_seqlens must be an int32 tensor, got dtype "
                                        "torch.int64"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens.long())
    with pytest.raises(ValueError, match="rotate the new keys: pass k and v too"):
        flash_attn_with_kvcache(q, k_cache, v_cache, rotary_cos=torch.ones(32, 4),
                                rotary_sin=torch.ones(32, 4), cache_seqlens=seqlens)
    with pytest.raises(ValueError, match=r"expected \(seqlen_ro >= 32 cache slots"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, torch.ones(16, 4, device=DEVICE),
                                torch.ones(16, 4, device=DEVICE), cache_seqlens=seqlens)
    with pytest.raises(ValueError, match="cache_batch_idx indexes a contiguous cache"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                block_table=torch.zeros(2, 1, dtype=torch.int32, device=DEVICE),
                                cache_batch_idx=seqlens)
    with pytest.raises(ValueError, match="v has shape"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v[:, :, :1], cache_seqlens=seqlens)
    assert torch.equal(k_cache, before)
