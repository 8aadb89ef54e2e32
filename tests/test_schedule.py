"""The explicit BCSR schedule path of the kernels, with hand-made schedules.

A FULL tile is visible without any predicate; a PARTIAL tile applies causal/window; an unlisted
tile is hidden. The oracle is the reference with the equivalent dense element mask.
"""
from __future__ import annotations

import pytest
import torch

from helpers import DEVICE, GPU, check_against_reference, random_qkv
from omniattn.kernels.schedule import Schedule
from test_kernels import run_kernels


def expand_blocks(blocks: torch.Tensor, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int):
    """(b, h, nQ, nK) bool -> (b, h, Sq, Sk) element mask (test-only: tiny shapes)."""
    return blocks.repeat_interleave(block_m, 2).repeat_interleave(block_n, 3)[..., :seqlen_q, :seqlen_k]


def predicate(seqlen_q, seqlen_k, causal, window):
    q_idx = torch.arange(seqlen_q, device=DEVICE)[:, None]
    k_idx = torch.arange(seqlen_k, device=DEVICE)[None, :]
    rel = k_idx - q_idx - (seqlen_k - seqlen_q)
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=DEVICE)
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if right >= 0:
        keep &= rel <= right
    if left >= 0:
        keep &= rel >= -left
    return keep


def random_schedule(sched_b, sched_h, n_m, n_n, density, full_fraction, generator):
    listed = torch.rand(sched_b, sched_h, n_m, n_n, generator=generator) < density
    full = listed & (torch.rand(sched_b, sched_h, n_m, n_n, generator=generator) < full_fraction)
    return (listed & ~full).to(DEVICE), full.to(DEVICE)


BLOCKS = [(64, 64), (128, 64)] if GPU else [(16, 16)]
CASES = [
    # B, Sq, Sk, H, Hk, D, dtype, schedule b/h broadcast, density, full fraction, causal, window
    (2, 49, 61, 4, 2, 32, torch.float16, (1, 1), 0.5, 0.5, False, None),
    (2, 64, 48, 2, 1, 32, torch.float32, (2, 2), 0.6, 0.3, True, None),
    (1, 40, 77, 4, 4, 16, torch.float16, (1, 4), 0.4, 0.6, False, (10, 5)),
    (1, 33, 33, 2, 2, 64, torch.float16, (1, 2), 1.0, 1.0, False, None),
    (1, 33, 33, 2, 1, 32, torch.float16, (1, 1), 0.3, 0.0, True, (12, -1)),
]
if GPU:
    CASES = [(b, sq * 8, sk * 8, h, hk, d, dt, bh, dens, full, c, w)
             for (b, sq, sk, h, hk, d, dt, bh, dens, full, c, w) in CASES]
    CASES += [(2, 1000, 1500, 8, 2, 128, torch.bfloat16, (2, 8), 0.3, 0.5, True, None)]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_explicit_schedule(case, block):
    batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, (sb, sh), density, full_fraction, \
        causal, window = case
    block_m, block_n = block
    generator = torch.Generator().manual_seed(seqlen_q * 7 + seqlen_k)
    n_m, n_n = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    partial, full = random_schedule(sb, sh, n_m, n_n, density, full_fraction, generator)
    partial[..., 0, :] = False  # the first query tile sees nothing: its rows must output 0
    full[..., 0, :] = False
    schedule = Schedule.from_blocks(block_m, block_n, partial, full)

    visible = expand_blocks(partial, block_m, block_n, seqlen_q, seqlen_k) \
        & predicate(seqlen_q, seqlen_k, causal, window)
    visible |= expand_blocks(full, block_m, block_n, seqlen_q, seqlen_k)

    torch.manual_seed(seqlen_q + seqlen_k)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype)
    dout = torch.randn_like(q)
    out, lse, grads = run_kernels(q, k, v, dout, causal=causal, window=window, schedule=schedule)
    assert (out[:, :block_m] == 0).all() and (lse[:, :, :block_m] == float("-inf")).all()
    check_against_reference(out, lse, grads, q, k, v, dout, attn_mask=visible)


def test_lists_and_blocks_agree():
    """from_kv_lists (FlexAttention-style lists) builds the same transposed lists as from_blocks."""
    generator = torch.Generator().manual_seed(0)
    partial, full = random_schedule(2, 3, 5, 7, 0.5, 0.4, generator)
    by_blocks = Schedule.from_blocks(16, 16, partial, full)
    by_lists = Schedule.from_kv_lists(16, 16, 7, by_blocks.kv_num_blocks, by_blocks.kv_indices,
                                      by_blocks.full_kv_num_blocks, by_blocks.full_kv_indices)
    for name in ("q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(by_blocks, name), getattr(by_lists, name))
    for count, name in (("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        num = getattr(by_blocks, count)
        slots = torch.arange(getattr(by_blocks, name).shape[-1], device=num.device) < num[..., None]
        assert torch.equal(getattr(by_blocks, name)[slots], getattr(by_lists, name)[slots])
    # transposing twice gives back the block picture
    for num, idx, blocks in ((by_blocks.q_num_blocks, by_blocks.q_indices, partial),
                             (by_blocks.full_q_num_blocks, by_blocks.full_q_indices, full)):
        listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
        picture = torch.zeros(2, 3, 7, 6, dtype=torch.bool, device=idx.device)
        picture.scatter_(-1, torch.where(listed, idx.long(), 5), True)  # column 5: unlisted slots
        assert torch.equal(picture[..., :5].transpose(-1, -2), blocks)

