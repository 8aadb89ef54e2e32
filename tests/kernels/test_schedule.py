"""The explicit BCSR schedule path of the kernels, with hand-made schedules.

A FULL tile is visible without any predicate; a PARTIAL tile applies causal/window; an unlisted
tile is hidden. The oracle is the reference with the equivalent dense element mask.
"""
from __future__ import annotations

import pytest
import torch

from helpers import (DEVICE, GPU, case_id, check_against_reference, expand_blocks, predicate,
                     random_qkv)
from omniattn.kernels.schedule import Schedule
from omniattn.predicate import FULL, HIDDEN, PARTIAL, blocks_from_lists, coarsen_states
from test_kernels import run_kernels


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
@pytest.mark.parametrize("case", CASES, ids=case_id)
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


def test_transposed_lists_round_trip():
    """The dK/dV lists (per key tile) are the transpose of the forward lists (per query tile)."""
    generator = torch.Generator().manual_seed(0)
    partial, full = random_schedule(2, 3, 5, 7, 0.5, 0.4, generator)
    schedule = Schedule.from_blocks(16, 16, partial, full)
    fwd, t = schedule.forward, schedule.dkdv
    for blocks, (num, idx), (t_num, t_idx) in (
            (partial, (fwd.num_blocks, fwd.indices), (t.num_blocks, t.indices)),
            (full, (fwd.full_num_blocks, fwd.full_indices), (t.full_num_blocks, t.full_indices))):
        assert torch.equal(blocks_from_lists(num, idx, 7), blocks)
        assert torch.equal(blocks_from_lists(t_num, t_idx, 5).transpose(-1, -2), blocks)


@pytest.mark.parametrize("factors", [(1, 1), (2, 4), (3, 2), (8, 8)], ids=str)
def test_coarsen_states(factors):
    """A coarse tile is FULL iff all its sub-tiles are, HIDDEN iff all are, else PARTIAL."""
    factor_m, factor_n = factors
    generator = torch.Generator().manual_seed(factor_m * 10 + factor_n)
    states = torch.randint(0, 3, (2, 1, 7, 9), generator=generator, dtype=torch.int8)
    states[0, 0, :4, :4] = FULL
    states[1, 0, :4, :4] = HIDDEN
    coarse = coarsen_states(states, factor_m, factor_n)
    n_m, n_n = -(-7 // factor_m), -(-9 // factor_n)
    assert coarse.shape == (2, 1, n_m, n_n) and coarse.dtype == torch.int8
    for i in range(n_m):
        for j in range(n_n):
            sub = states[..., i * factor_m:(i + 1) * factor_m, j * factor_n:(j + 1) * factor_n]
            expected = torch.where((sub == FULL).flatten(2).all(-1), FULL,
                                   torch.where((sub == HIDDEN).flatten(2).all(-1), HIDDEN, PARTIAL))
            assert torch.equal(coarse[..., i, j], expected.to(torch.int8))

