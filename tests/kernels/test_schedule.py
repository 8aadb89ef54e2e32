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



# (H, Hk, list heads): lists per KV head (groups of 2 and 4), fewer than the KV heads, and
# between the KV heads and the query heads
LIST_HEADS = [(4, 2, 2), (8, 2, 2), (8, 4, 2), (8, 2, 4)]


def banded_lists(batch, list_heads, n_m, n_n, generator):
    """(partial, full) block pictures (B, Hl, n_m, n_n) in which list head l hides every key tile
    n with n % Hl == l, and lists a random half of the others FULL: each head shows key tiles
    that another hides, so a query head walking another head's list gets other keys."""
    listed = torch.rand(batch, list_heads, n_m, n_n, generator=generator) < 0.8
    own_band = torch.arange(n_n) % list_heads == torch.arange(list_heads)[:, None]  # (Hl, n_n)
    listed &= ~own_band[None, :, None, :]
    full = listed & (torch.rand(batch, list_heads, n_m, n_n, generator=generator) < 0.5)
    return (listed & ~full).to(DEVICE), full.to(DEVICE)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "dq_programs"])
@pytest.mark.parametrize("heads", LIST_HEADS, ids=lambda h: "H{}-Hk{}-lists{}".format(*h))
def test_lists_with_fewer_heads_than_the_queries(heads, deterministic):
    """Lists of Hl heads (a divisor of H): query head h walks list head h // (H / Hl) in the
    forward, dQ and dK/dV programs (a dK/dV program's KV group then shares one list, or spans
    several). Out, lse and gradients against the reference with the lists spread to H."""
    num_heads, heads_k, list_heads = heads
    block_m, block_n = BLOCKS[0]
    batch, seqlen_q, seqlen_k = 2, 4 * block_m - 3, 4 * block_n
    generator = torch.Generator().manual_seed(sum(heads))
    partial, full = banded_lists(batch, list_heads, 4, 4, generator)
    schedule = Schedule.from_blocks(block_m, block_n, partial, full)
    assert schedule.forward.num_blocks.shape[1] == schedule.dkdv.num_blocks.shape[1] == list_heads
    visible = expand_blocks(partial | full, block_m, block_n, seqlen_q, seqlen_k)
    visible = visible.repeat_interleave(num_heads // list_heads, dim=1)

    torch.manual_seed(num_heads + list_heads)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, num_heads, heads_k, 32, torch.float16)
    dout = torch.randn_like(q)
    out, lse, grads = run_kernels(q, k, v, dout, schedule=schedule, deterministic=deterministic)
    check_against_reference(out, lse, grads, q, k, v, dout, attn_mask=visible)


@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("source", ["mask", "topk", "block_mask_1", "block_mask_H"])
def test_gqa_calls_build_lists_per_kv_head(monkeypatch, source, group):
    """A call whose tile states come per KV head (an element mask (B, Hk, Sq, Sk), a top-k term
    over per-key scores (B, Hk, 1, Sk), the mask with a block mask of one head) builds its lists
    at Hk heads, which the query heads of a KV group share; with a block mask of H heads, at H.
    Each KV head's mask or scores hide key tiles the other shows, so a query head walking the
    wrong list drops visible keys or keeps hidden ones: out, lse and gradients against the
    reference, the mask's also with a full bias's gradient (zeroed where its lists leave tiles
    out) and without a gradient (the pre-pass's one-launch forward lists)."""
    import omniattn
    from helpers import element_visibility
    from omniattn import api
    from omniattn.schedules import build_schedule

    built = []

    def recording(*args, **kwargs):
        schedule, kernel_args = build_schedule(*args, **kwargs)
        built.append(schedule)
        return schedule, kernel_args

    monkeypatch.setattr(api, "build_schedule", recording)
    # on a GPU, head dim 128: the Gluon forward and backward take the calls they can
    heads_k, band, head_dim = (2, 128, 128) if GPU else (2, 16, 32)
    num_heads = heads_k * group
    batch, seqlen, dtype = 2, 4 * band, torch.float16
    generator = torch.Generator().manual_seed(group)
    torch.manual_seed(group)
    q, k, v = random_qkv(batch, seqlen, seqlen, num_heads, heads_k, head_dim, dtype)
    dout = torch.randn_like(q)
    # KV head j hides (mask) or scores low (top-k) the keys of bands b with b % Hk == j
    own_band = (torch.arange(seqlen) // band % heads_k == torch.arange(heads_k)[:, None])
    options, reference, expected_heads = {}, {}, heads_k
    if source == "topk":
        scores = torch.randn(batch, heads_k, 1, seqlen, generator=generator) \
            - 8.0 * own_band[None, :, None, :]
        options = reference = dict(topk=seqlen // 4, topk_scores=scores.to(DEVICE))
    else:
        mask = (torch.rand(batch, heads_k, seqlen, seqlen, generator=generator) < 0.8) \
            & ~own_band[None, :, None, :]
        options = dict(attn_mask=mask.to(DEVICE))
        reference = dict(attn_mask=mask.repeat_interleave(group, dim=1).to(DEVICE))
    if source.startswith("block_mask"):
        mask_heads = 1 if source == "block_mask_1" else num_heads
        blocks = torch.rand(1, mask_heads, 4, 4, generator=generator) < 0.7
        options["block_mask"] = omniattn.block_mask_from_blocks(blocks.to(DEVICE), band)
        reference["attn_mask"] = reference["attn_mask"] \
            & element_visibility(options["block_mask"]).to(DEVICE)
        expected_heads = heads_k if mask_heads == 1 else num_heads
    leaves = (q, k, v)
    if source == "mask":
        bias = torch.randn(batch, num_heads, seqlen, seqlen, dtype=dtype, device=DEVICE,
                           requires_grad=True)
        options["attn_bias"] = reference["attn_bias"] = bias
        leaves += (bias,)
    out, lse = omniattn.attention(q, k, v, return_lse=True, **options)
    grads = torch.autograd.grad(out, leaves, dout)
    check_against_reference(out, lse, grads, q, k, v, dout, **reference)
    if source == "mask":
        with torch.no_grad():
            out, lse = omniattn.attention(q, k, v, attn_mask=options["attn_mask"],
                                          return_lse=True)
        check_against_reference(out, lse, None, q, k, v, dout, attn_mask=reference["attn_mask"])
    assert built, "the call built no lists"
    for schedule in built:
        for lists in (schedule.forward, schedule.dq, schedule.dkdv):
            assert lists.num_blocks.shape[1] == lists.full_indices.shape[1] == expected_heads
