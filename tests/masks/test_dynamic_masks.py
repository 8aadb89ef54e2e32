"""Top-k keep-window masks against a brute-force torch.topk per row, and with ties against the
float64 brute force of issue #53's rule (ties to the lower key index), identical to what
attention(topk=...) keeps on either path (the kernels', the chunked one); the memory of training
with them (issue #4)."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import brute_force_topk, visible_keys
from omniattn import attention
from omniattn.masks import prepare_dynamic_mask, topk_block_mask, topk_mask
from omniattn.predicate import order_keys, topk_keep
from omniattn.reference import topk_thresholds


def brute_force(scores, window, allowed):
    """Row by row: the window largest allowed scores (all allowed ones if fewer)."""
    scores, allowed = torch.broadcast_tensors(scores, allowed)
    keep = torch.zeros(scores.shape, dtype=torch.bool)
    for index in torch.cartesian_prod(*[torch.arange(n) for n in scores.shape[:-1]]):
        row_scores, row_allowed = scores[tuple(index)], allowed[tuple(index)]
        candidates = row_allowed.nonzero().flatten()
        best = candidates[row_scores[candidates].argsort(descending=True)[:window]]
        keep[tuple(index)][best] = True
    return keep


@pytest.mark.parametrize("seqlen_q, seqlen_k, window", [(9, 20, 5), (1, 30, 7), (6, 6, 8), (13, 40, 39)])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "padding", "additive"])
def test_topk_mask_matches_brute_force(seqlen_q, seqlen_k, window, mask_kind):
    torch.manual_seed(seqlen_q + seqlen_k)
    scores = torch.randn(2, 3, 1, seqlen_k)
    rows = torch.arange(seqlen_q)[:, None]
    cols = torch.arange(seqlen_k)[None, :]
    allowed = {
        "none": torch.ones(1, 1, 1, seqlen_k, dtype=torch.bool),
        "causal": (cols <= rows + seqlen_k - seqlen_q)[None, None],
        "padding": torch.rand(2, 1, 1, seqlen_k) > 0.3,
        "additive": (cols <= rows + seqlen_k - seqlen_q)[None, None],
    }[mask_kind]
    mask_arg = None if mask_kind == "none" else allowed
    if mask_kind == "additive":
        mask_arg = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    keep = topk_mask(scores, window, mask_arg, chunk_size=4)
    assert keep.dtype == torch.bool
    expected = brute_force(scores, window, allowed)
    assert keep.shape == expected.shape
    assert torch.equal(keep, expected)


def test_per_key_scores_stay_small():
    keep = topk_mask(torch.randn(2, 4, 1, 300), 64)
    assert keep.shape == (2, 4, 1, 300) and keep.sum(-1).eq(64).all()


def test_prepare_dynamic_mask():
    torch.manual_seed(0)
    hidden = torch.randn(2, 4, 10, 8, dtype=torch.float16)  # query states (B, H, Sq, D)
    dt_states = torch.rand(2, 2, 25)
    bias, mask = prepare_dynamic_mask(hidden, dt_states, keep_window_size=6)
    assert bias.shape == (2, 2, 1, 25) and bias.dtype == torch.float16
    assert mask.shape == (2, 2, 1, 25) and mask.sum(-1).eq(6).all()
    assert torch.equal(mask, brute_force(dt_states[:, :, None], 6, torch.ones(1, 1, 1, 25, dtype=torch.bool)))
    causal = torch.ones(10, 25, dtype=torch.bool).tril(15)[None, None]
    _, causal_mask = prepare_dynamic_mask(hidden, dt_states, 6, causal)
    assert causal_mask.shape == (2, 2, 10, 25)
    assert torch.equal(causal_mask, brute_force(dt_states[:, :, None], 6, causal))


def test_bad_arguments():
    with pytest.raises(ValueError, match="window_size must be a positive int"):
        topk_mask(torch.randn(1, 1, 1, 4), 0)
    with pytest.raises(ValueError, match="pass a bool mask"):
        topk_mask(torch.randn(1, 1, 1, 4), 2, torch.ones(1, 1, 1, 4))
    with pytest.raises(ValueError, match="attention_mask has 3 query rows"):
        prepare_dynamic_mask(torch.randn(1, 1, 5, 8), torch.randn(1, 1, 9), 2,
                             torch.ones(1, 1, 3, 9, dtype=torch.bool))


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(12, 12), (5, 17), (17, 17)])
def test_causal_topk_without_a_causal_mask(seqlen_q, seqlen_k):
    torch.manual_seed(seqlen_q)
    scores = torch.randn(2, 3, 1, seqlen_k)
    causal = (torch.arange(seqlen_k)[None, :]
              <= torch.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q)[None, None]
    keep = topk_mask(scores, 4, causal=True, seqlen_q=seqlen_q, chunk_size=5)
    assert keep.shape == (2, 3, seqlen_q, seqlen_k)
    assert torch.equal(keep, brute_force(scores, 4, causal))


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "chunks"])
@pytest.mark.parametrize("scores_shape, mask_shape, causal", [
    ((2, 3, 1, 23), None, True),  # dt states: per-key scores, causal
    ((2, 3, 9, 23), (2, 1, 9, 23), False),
    ((2, 1, 1, 23), (2, 3, 1, 23), False),
    ((3, 9, 23), (1, 9, 23), True),
])
def test_topk_mask_ties_and_attention_keep_the_same_keys(scores_shape, mask_shape, causal,
                                                         kernels, monkeypatch):
    """Integer-valued scores (ties everywhere, some NaN and -inf): the mask is the float64 brute
    force of the rule and what attention(topk=4, topk_scores=scores) keeps, on the kernels'
    path (the interpreter's, CUDA's) and on the chunked one."""
    if not kernels:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    generator = torch.Generator().manual_seed(len(scores_shape) + scores_shape[2])
    scores = torch.randint(-2, 3, scores_shape, generator=generator).float()
    draw = torch.rand(scores_shape, generator=generator)
    scores = torch.where(draw < 0.05, float("nan"), torch.where(draw > 0.95, -float("inf"),
                                                                 scores))
    mask = None if mask_shape is None else torch.rand(mask_shape, generator=generator) > 0.3
    keep = topk_mask(scores, 4, mask, causal=causal, seqlen_q=9, chunk_size=4)
    four_d = [t if t is None or t.dim() == 4 else t[None] for t in (scores, mask)]
    batch, heads, rows = (1,) * (4 - keep.dim()) + keep.shape[:-1]
    visible = visible_keys(batch, heads, rows, 23, causal, attn_mask=four_d[1]).cpu()
    expected = brute_force_topk(four_d[0].expand(visible.shape), visible, 4)
    assert torch.equal(keep.reshape(expected.shape), expected)
    q, k = torch.empty(batch, rows, heads, 8), torch.empty(batch, 23, heads, 8)
    pairs = topk_thresholds(q, k, 4, four_d[0], causal=causal, attn_mask=four_d[1])
    keys = order_keys(four_d[0]).expand(visible.shape)
    attention_keeps = visible & topk_keep(keys, pairs.threshold, pairs.last_tie)
    assert torch.equal(keep.reshape(expected.shape), attention_keeps)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mask_layout", ["per_row_topk", "per_key_topk"])
def test_key_bias_training_memory(mask_layout):
    """Issue #4: forward + backward with a key bias (B, H, 1, Sk) allocate O(B·H·Sk) plus the
    usual O(B·S·H·D) beyond their inputs: nothing shaped (Sq, Sk) (the schedule is per tile)."""
    batch, seqlen, heads, head_dim = 2, 4096, 4, 64
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    scores = torch.randn(batch, heads, 1, seqlen, device="cuda")
    mask = topk_mask(scores, 1024, causal=True, seqlen_q=seqlen) \
        if mask_layout == "per_row_topk" else topk_mask(scores, 1024)
    bias = torch.randn(batch, heads, 1, seqlen, device="cuda", dtype=torch.bfloat16,
                       requires_grad=True)
    dout = torch.randn_like(q)

    def step():
        out = attention(q, k, v, causal=True, attn_mask=mask, attn_bias=bias)
        return torch.autograd.grad(out, (q, k, v, bias), dout)

    step()  # compiles, fills lazy caches
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = step()
    peak = torch.cuda.max_memory_allocated() - before
    rows = q.numel() * q.element_size()  # one (B, S, H, D) bf16 tensor
    per_key = batch * heads * seqlen * 4  # one fp32 (B, H, Sk)
    per_tile = batch * heads * (seqlen // 64) ** 2 * 4  # one int32 per 64x64 tile
    assert peak <= 8 * rows + 8 * per_key + 4 * per_tile, (peak, rows)
    assert peak < batch * heads * seqlen * seqlen  # a byte per (Sq, Sk) element would not fit
    assert grads[3].shape == bias.shape and torch.isfinite(grads[3]).all()


def smoothed_by_blocks(keep: torch.Tensor, block_size: int) -> torch.Tensor:
    """The original's block_smooth, block by block: each block of `block_size` keys (the last
    one the remainder) becomes all True when more than half of its keys are, else all False."""
    smoothed = torch.zeros_like(keep)
    for start in range(0, keep.shape[-1], block_size):
        block = keep[..., start:start + block_size]
        majority = 2 * block.sum(-1, keepdim=True) > block.shape[-1]
        smoothed[..., start:start + block_size] = majority.expand_as(block)
    return smoothed


BLOCK_CASES = [  # scores shape, mask shape, causal: Sq = 9, Sk = 23
    ((2, 3, 1, 23), None, True),  # dt states, causal
    ((2, 3, 1, 23), (2, 1, 1, 23), True),  # and padding
    ((2, 3, 1, 23), (2, 1, 1, 23), False),  # every row alike
    ((2, 3, 9, 23), (2, 1, 9, 23), False),  # per-row scores and mask
    ((1, 1, 1, 23), (2, 3, 9, 23), True),
]


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "chunks"])
@pytest.mark.parametrize("block_size", [2, 3, 5, 16, 30])
@pytest.mark.parametrize("scores_shape, mask_shape, causal", BLOCK_CASES)
def test_block_size_smooths_the_selection(scores_shape, mask_shape, causal, block_size, kernels,
                                          monkeypatch):
    """topk_mask(block_size=) is the brute-force top-k (integer scores: ties everywhere, some
    NaN and -inf) smoothed block by block, then ANDed with what the rows see; topk_block_mask's
    BlockMask, ANDed with the same, keeps exactly that too."""
    if not kernels:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    generator = torch.Generator().manual_seed(block_size + len(BLOCK_CASES) * scores_shape[2])
    scores = torch.randint(-2, 3, scores_shape, generator=generator).float()
    draw = torch.rand(scores_shape, generator=generator)
    scores = torch.where(draw < 0.05, float("nan"), torch.where(draw > 0.95, -float("inf"),
                                                                 scores))
    mask = None if mask_shape is None else torch.rand(mask_shape, generator=generator) > 0.3
    visible = visible_keys(2, 3, 9, 23, causal, attn_mask=mask).cpu()
    expected = smoothed_by_blocks(brute_force_topk(scores.expand(visible.shape), visible, 4),
                                  block_size) & visible
    keep = topk_mask(scores, 4, mask, causal=causal, seqlen_q=9, chunk_size=4,
                     block_size=block_size)
    assert torch.equal(keep.expand(visible.shape), expected)
    block_mask = topk_block_mask(scores, 4, block_size, mask, causal=causal, seqlen_q=9,
                                 chunk_size=4)
    assert block_mask.block_size == (16, math.lcm(block_size, 16))
    assert torch.equal(block_mask.visible(torch.arange(9), 9, 23).expand(visible.shape) & visible,
                       expected)


def test_topk_block_mask_spreads_kv_heads_to_query_heads():
    """A selection over Hk = 2 heads becomes a BlockMask over H = 6: query head h reads KV head
    h // 3."""
    torch.manual_seed(3)
    scores = torch.randn(2, 2, 1, 40)
    keep = topk_mask(scores, 9, causal=True, seqlen_q=40, block_size=8)
    block_mask = topk_block_mask(scores, 9, 8, causal=True, seqlen_q=40, num_heads=6)
    assert block_mask.shape == (2, 6, 40, 40)
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    seen = block_mask.visible(torch.arange(40), 40, 40) & causal
    assert torch.equal(seen, keep.repeat_interleave(3, dim=1))
    with pytest.raises(ValueError, match=r"^num_heads \(5\) must be a multiple of the "
                                         r"selection's heads \(2"):
        topk_block_mask(scores, 9, 8, causal=True, seqlen_q=40, num_heads=5)


def test_prepare_dynamic_mask_block_size():
    torch.manual_seed(4)
    hidden = torch.randn(2, 4, 10, 8)
    dt_states = torch.randn(2, 2, 25)
    _, mask = prepare_dynamic_mask(hidden, dt_states, 6, block_size=5)
    _, plain = prepare_dynamic_mask(hidden, dt_states, 6)
    assert mask.shape == (2, 2, 1, 25)
    assert torch.equal(mask, smoothed_by_blocks(plain, 5))


def test_bad_block_arguments():
    with pytest.raises(ValueError, match=r"^block_size must be a positive int, got 0$"):
        topk_mask(torch.randn(1, 1, 1, 8), 2, block_size=0)
    with pytest.raises(TypeError, match=r"^block_size must be a positive int, got 2.0$"):
        topk_block_mask(torch.randn(1, 1, 1, 8), 2, 2.0)
    with pytest.raises(ValueError, match=r"^scores and attention_mask must broadcast to 4-D "
                                         r"\(B\|1, Hs, Sq\|1, Sk\), got shape \(1, 1, 8\)$"):
        topk_block_mask(torch.randn(1, 1, 8), 2, 4)
    with pytest.raises(ValueError, match=r"^scores and attention_mask have 3 query rows, "
                                         r"expected 1 or seqlen_q = 5$"):
        topk_block_mask(torch.randn(1, 1, 3, 8), 2, 4, seqlen_q=5)
    with pytest.raises(ValueError, match=r"^scores and attention_mask have 3 query rows"):
        topk_block_mask(torch.randn(1, 1, 3, 8), 2, 4, causal=True, seqlen_q=5)


@pytest.mark.parametrize("causal, scores_rows", [(True, 1), (False, 40)],
                         ids=["causal_key_scores", "row_scores"])
def test_attention_with_topk_block_mask_on_the_kernels(causal, scores_rows):
    """Under the interpreter (the kernels' path) attention with topk_block_mask's BlockMask and
    the padding gives attention with the materialised smoothed mask, forward and backward."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 40, 2, 16, requires_grad=True) for _ in range(3))
    scores = torch.randn(1, 2, scores_rows, 40)
    padding = torch.rand(1, 1, 1, 40) > 0.2
    block_mask = topk_block_mask(scores, 12, 8, padding, causal=causal, seqlen_q=40)
    keep = topk_mask(scores, 12, padding, causal=causal, seqlen_q=40, block_size=8)
    out = attention(q, k, v, causal=causal, attn_mask=padding, block_mask=block_mask)
    expected = attention(q, k, v, causal=causal, attn_mask=keep)
    torch.testing.assert_close(out, expected)
    dout = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dout),
                         torch.autograd.grad(expected, (q, k, v), dout)):
        torch.testing.assert_close(got, want)
