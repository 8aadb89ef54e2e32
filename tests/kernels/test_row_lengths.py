"""Per-row key lengths and packed (varlen) sequences on the kernels (issue #5) against the
float64 reference: output, lse, dq, dk, dv (and dbias), combined with causal, window, softcap,
GQA, element masks, biases and block masks; the schedule the lengths produce; determinism.

Uninitialised memory is filled with NaN (torch's deterministic mode), so an output or gradient
element the kernels fail to write fails the test.
"""
from __future__ import annotations

import dataclasses

from helpers import DEVICE, GPU, case_id, check_against_reference, random_block_mask, random_qkv
import pytest
from test_mask_bias import (exact_tile_states, nan_poisoned_memory,  # noqa: F401 (autouse fixture)
                            run_and_check)
import torch

import omniattn

SCALE = 7 if GPU else 1  # GPU shapes span several 64/128 tiles, interpreter ones 16-tiles


def random_row_lens(batch, seqlen_q, seqlen_k, seed):
    """int32 (B, Sq) uniform in [0, Sk], with rows of length 0 and Sk in every batch."""
    generator = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, seqlen_k + 1, (batch, seqlen_q), generator=generator,
                         dtype=torch.int32)
    lens[:, 0] = 0
    lens[:, -1] = seqlen_k
    return lens.to(DEVICE)


def run_rows(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, lens, causal=False,
             window=None, softcap=0.0, attn_mask=None, attn_bias=None, block_mask=None,
             flat=False):
    torch.manual_seed(seqlen_q * 3 + seqlen_k)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype)
    # the reference reads the lengths in either form too
    out, lse, _ = run_and_check(q, k, v, attn_mask=attn_mask, attn_bias=attn_bias,
                                block_mask=block_mask, causal=causal, window=window,
                                softcap=softcap, seqlens_k_per_row=lens.flatten() if flat else lens)
    empty_rows = lens == 0
    if not causal and window is None and attn_mask is None:
        assert (out[empty_rows] == 0).all()
        assert (lse.transpose(1, 2)[empty_rows] == -float("inf")).all()
    return out


# (B, Sq, Sk, H, Hk, D, dtype, causal, window, softcap, flat)
CASES = [
    (2, 37, 45, 4, 2, 32, torch.float16, False, None, 0.0, False),
    (2, 37, 45, 4, 2, 32, torch.float16, True, None, 0.0, True),
    (1, 50, 33, 4, 1, 16, torch.float32, False, (9, 4), 0.0, False),
    (2, 17, 64, 2, 2, 32, torch.float16, True, None, 5.0, False),
    (1, 1, 29, 2, 1, 32, torch.float16, False, None, 0.0, True),
]
if GPU:
    CASES = [(b, sq * SCALE, sk * SCALE, h, hk, 4 * d, dt, c,
              None if w is None else (w[0] * SCALE, w[1] * SCALE), cap, flat)
             for (b, sq, sk, h, hk, d, dt, c, w, cap, flat) in CASES]
    CASES += [(*case[:6], torch.bfloat16, *case[7:]) for case in CASES
              if case[6] == torch.float16]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_row_lengths(case):
    batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, causal, window, softcap, flat = case
    lens = random_row_lens(batch, seqlen_q, seqlen_k, seed=seqlen_q + seqlen_k)
    run_rows(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, lens, causal=causal,
             window=window, softcap=softcap, flat=flat)


def test_structured_lengths():
    """Lengths that hide whole key tiles (i + 1, a shifted staircase, all Sk, all 0)."""
    seqlen_q, seqlen_k = 40 * SCALE, 53 * SCALE
    rows = torch.arange(seqlen_q, dtype=torch.int32)
    lens = torch.stack([(rows + 1).clamp(max=seqlen_k), (seqlen_k - 2 * rows).clamp(min=0),
                        torch.full_like(rows, seqlen_k), torch.zeros_like(rows)]).to(DEVICE)
    run_rows(4, seqlen_q, seqlen_k, 2, 1, 32, torch.float16, lens)


@pytest.mark.parametrize("max_rank_pairs", [0, 1 << 20])
def test_length_order(max_rank_pairs):
    """Each batch's rows longest first, lengths past Sk counting as Sk, equal lengths in their
    own order; the sorted lengths come with the order. Both ways: counting ranks (a Triton
    kernel) and torch's sort (long rows)."""
    from omniattn.kernels.sequences import length_order

    lens = torch.tensor([[3, 0, 7, 3], [1, 9, 9, 2]], dtype=torch.int32, device=DEVICE)
    order, sorted_lens = length_order(lens, 8, max_rank_pairs)
    assert order.dtype == sorted_lens.dtype == torch.int32
    assert order.tolist() == [[2, 0, 3, 1], [1, 2, 3, 0]]
    assert sorted_lens.tolist() == [[7, 3, 3, 0], [8, 8, 2, 1]]

    # several rank blocks, many ties, a last block cut short, values outside [0, Sk]
    generator = torch.Generator().manual_seed(5)
    lens = torch.randint(-2, 12, (3, 53), generator=generator, dtype=torch.int32).to(DEVICE)
    order, sorted_lens = length_order(lens, 9, max_rank_pairs)
    shortfall, expected = torch.sort(9 - lens.clamp(0, 9), dim=-1, stable=True)
    assert torch.equal(order.long(), expected)
    assert torch.equal(sorted_lens, (9 - shortfall).to(torch.int32))


def test_rows_to_callers():
    """Rows computed in length order go back to the caller's rows, cast to the destination's
    dtype, through strided (B, S, H, D) views; nothing else of the destination is written.
    Without an order the rows are copied in place."""
    from omniattn.kernels.sequences import rows_to_callers

    generator = torch.Generator().manual_seed(4)
    src = torch.randn(2, 37, 3, 24, generator=generator).to(DEVICE)
    order = torch.stack([torch.randperm(37, generator=generator) for _ in range(2)])
    order = order.to(DEVICE, torch.int32)
    storage = torch.full((2, 3, 37, 40), float("nan"), device=DEVICE, dtype=torch.float16)
    dst = storage[..., :24].transpose(1, 2)  # (B, S, H, D), rows 40 apart per head
    rows_to_callers(src, order, dst)
    expected = torch.empty_like(src)
    for b in range(2):
        expected[b, order[b].long()] = src[b]
    assert torch.equal(dst, expected.to(torch.float16))
    assert storage[..., 24:].isnan().all()
    # no order: the rows are the caller's already
    rows_to_callers(src, None, dst)
    assert torch.equal(dst, src.to(torch.float16))


@pytest.mark.parametrize("deterministic", [True, False])
def test_lengths_alone_group_rows(monkeypatch, deterministic):
    """Lengths as the only mask: attention reorders the rows by length and the kernels take each
    tile's range from the lengths (no lists). Both dQ paths (atomics switched on everywhere:
    deterministic=True must keep the dQ programs), GQA, rows of length 0 and Sk, a length
    shared by many rows, a last query tile cut short."""
    from omniattn.backends.triton import configs

    for key, cfg in list(configs._BWD.items()):
        monkeypatch.setitem(configs._BWD, key, dataclasses.replace(cfg, atomic_dq=True))
    seqlen_q, seqlen_k = 45 * SCALE, 38 * SCALE
    assert omniattn.plan.groups_rows_by_length(seqlen_q, 32, torch.float16)
    lens = random_row_lens(2, seqlen_q, seqlen_k, seed=11)
    lens[1, 5:20] = seqlen_k // 3
    torch.manual_seed(12)
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 4, 2, 32, torch.float16)
    dout = torch.randn_like(q)
    out, lse = omniattn.attention(q, k, v, seqlens_k_per_row=lens, deterministic=deterministic,
                                  return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, lse, grads, q, k, v, dout, seqlens_k_per_row=lens)


# (B, Sq, Sk, H, Hk, D, dtype): several query and key tiles, lengths past the tiles' edges,
# a last tile cut short, GQA; D256 (bwd_hopper_wide's 64 x 64 tiles)
GLUON_ROWS = [(2, 1000, 1000, 8, 2, 128, torch.bfloat16),
              (1, 513, 2049, 4, 1, 128, torch.float16),
              (2, 1024, 384, 4, 4, 128, torch.bfloat16),
              (3, 129, 1, 2, 2, 128, torch.float16),
              (2, 700, 900, 4, 2, 256, torch.bfloat16)]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9, reason="needs sm90")
@pytest.mark.parametrize("case", GLUON_ROWS, ids=case_id)
def test_gluon_row_lengths(gluon_calls, case):
    """Lengths alone on the Gluon kernels, rows in length order: each consumer gathers its q
    rows and scatters out / lse, the backward reads q / dO copied into that order and writes dQ
    back to each row. Random lengths with rows of length 0 and Sk and a run of equal ones in
    batch 0, "i + 1" (the caller's order reversed) in batch 1."""
    batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype = case
    assert omniattn.plan.groups_rows_by_length(seqlen_q, head_dim, dtype)
    lens = random_row_lens(batch, seqlen_q, seqlen_k, seed=seqlen_q)
    lens[0, 3:seqlen_q // 2] = seqlen_k // 3
    if batch > 1:
        lens[1] = torch.arange(1, seqlen_q + 1, device=DEVICE).clamp(max=seqlen_k)
    run_rows(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, lens)
    assert gluon_calls == ["fwd", "bwd"], gluon_calls


def test_row_lengths_with_mask_bias_and_block_mask():
    """Lengths AND an element mask AND a learnable key bias AND a block mask."""
    seqlen_q, seqlen_k = 40 * SCALE, 53 * SCALE
    generator = torch.Generator().manual_seed(5)
    lens = random_row_lens(2, seqlen_q, seqlen_k, seed=9)
    mask = (torch.rand(2, 1, seqlen_q, seqlen_k, generator=generator) < 0.8).to(DEVICE)
    bias = torch.randn(2, 4, 1, seqlen_k, generator=generator).to(DEVICE, torch.float16)
    run_rows(2, seqlen_q, seqlen_k, 4, 2, 32, torch.float16, lens, causal=True, attn_mask=mask,
             attn_bias=bias.requires_grad_())
    block_mask = random_block_mask(1, 4, seqlen_q, seqlen_k, 16 * SCALE if GPU else 16, 0.6, 4)
    full_bias = torch.randn(2, 4, seqlen_q, seqlen_k, generator=generator).to(DEVICE, torch.float16)
    run_rows(2, seqlen_q, seqlen_k, 4, 2, 32, torch.float16, lens, block_mask=block_mask,
             attn_bias=full_bias.requires_grad_())


def test_row_length_tile_skipping():
    """Key tiles past every row's length are never loaded (NaN keys there do not leak) and the
    lists match the exact tile picture of the lengths: FULL tiles all visible, unlisted empty."""
    from helpers import explicit_schedule

    from omniattn.kernels.schedule import KernelArgs
    from omniattn.predicate import blocks_from_lists

    seqlen_q, seqlen_k = 96 * SCALE, 160 * SCALE
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 2, 1, 32, torch.float16, requires_grad=False)
    lens = random_row_lens(2, seqlen_q, seqlen_k // 2, seed=3)  # keys >= Sk / 2: never visible
    # NaN keys from the first kernel tile (<= 128 keys) past every length: never loaded. (A
    # visited tile must not hold NaN values: 0 probability x NaN is NaN in any matmul.)
    half = -(-(seqlen_k // 2) // 128) * 128 if GPU else seqlen_k // 2
    k[:, half:] = float("nan")
    v[:, half:] = float("nan")
    out, lse = omniattn.attention(q, k, v, seqlens_k_per_row=lens, return_lse=True)
    assert torch.isfinite(out).all()
    check_against_reference(out, lse, None, q, k[:, :half], v[:, :half], torch.zeros_like(q),
                            seqlens_k_per_row=lens)
    for causal in (False, True):
        schedule, _ = explicit_schedule(q, k, KernelArgs.make(32, causal, None, None, 0.0),
                                        row_lens=lens)
        keys = torch.arange(seqlen_k, device=DEVICE)
        visible = (keys[None, None, :] < lens[..., None]).unsqueeze(1)  # (B, 1, Sq, Sk)
        if causal:
            rows = torch.arange(seqlen_q, device=DEVICE)
            visible &= keys[None, :] <= rows[:, None] + seqlen_k - seqlen_q
        for lists, transposed in ((schedule.forward, False), (schedule.dq, False),
                                  (schedule.dkdv, True)):
            exact = exact_tile_states(visible, lists.block_m, lists.block_n)
            n_cols = exact.shape[-1] if not transposed else exact.shape[-2]
            partial, full = (blocks_from_lists(num, idx, n_cols).cpu()
                             for num, idx in ((lists.num_blocks, lists.indices),
                                              (lists.full_num_blocks, lists.full_indices)))
            if transposed:
                partial, full = partial.transpose(-1, -2), full.transpose(-1, -2)
            assert (exact[full.expand_as(exact)] == 2).all(), "a FULL tile has a hidden element"
            listed = (partial | full).expand_as(exact)
            assert (exact[~listed] == 0).all(), "an unlisted tile has a visible element"
            assert listed.sum() < exact.numel(), "lengths skipped no tile"


def packed_sequences(lengths_q, lengths_k, heads, heads_k, head_dim, dtype, seed):
    torch.manual_seed(seed)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = torch.randn(total_q, heads, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(total_k, heads_k, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn(total_k, heads_k, head_dim, device=DEVICE, dtype=dtype)

    def offsets(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                            device=DEVICE)

    return [t.requires_grad_() for t in (q, k, v)], offsets(lengths_q), offsets(lengths_k)


# (lengths_q, lengths_k, H, Hk, D, dtype, causal, window, per-row lengths)
VARLEN_CASES = [
    ([5, 17, 1, 30], [9, 3, 20, 30], 4, 2, 32, torch.float16, False, None, False),
    ([5, 17, 1, 30], [9, 3, 20, 30], 4, 2, 32, torch.float16, True, None, True),
    ([33, 0, 12], [40, 7, 0], 2, 1, 16, torch.float32, False, (6, 2), False),
    ([1, 40], [1, 40], 2, 2, 32, torch.float16, True, None, False),
]
if GPU:
    VARLEN_CASES = [([n * SCALE for n in lq], [n * SCALE + (n % 3) for n in lk], h, hk, 4 * d,
                     dt, c, None if w is None else (w[0] * SCALE, w[1] * SCALE), rl)
                    for (lq, lk, h, hk, d, dt, c, w, rl) in VARLEN_CASES]
    VARLEN_CASES += [(*case[:5], torch.bfloat16, *case[6:]) for case in VARLEN_CASES
                     if case[5] == torch.float16]
    generator = torch.Generator().manual_seed(0)
    random_lengths = torch.randint(1, 301, (2, 12), generator=generator).tolist()
    VARLEN_CASES.append((*random_lengths, 8, 2, 128, torch.bfloat16, True, None, True))


@pytest.mark.parametrize("case", VARLEN_CASES, ids=case_id)
def test_varlen(case):
    run_varlen(*case)


def run_varlen(lengths_q, lengths_k, heads, heads_k, head_dim, dtype, causal, window,
               with_row_lens):
    (q, k, v), cu_q, cu_k = packed_sequences(lengths_q, lengths_k, heads, heads_k, head_dim,
                                             dtype, seed=sum(lengths_q))
    row_lens = None
    if with_row_lens:
        generator = torch.Generator().manual_seed(1)
        row_lens = torch.cat([torch.randint(0, n_k + 1, (n_q,), generator=generator)
                              for n_q, n_k in zip(lengths_q, lengths_k)]).int().to(DEVICE)
    dout = torch.randn_like(q)
    out, lse = omniattn.attention(q, k, v, causal=causal, window=window, cu_seqlens_q=cu_q,
                                  cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q),
                                  max_seqlen_k=max(lengths_k), seqlens_k_per_row=row_lens,
                                  return_lse=True)
    assert lse.shape == (heads, q.shape[0])
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
    check_against_reference(out, lse, grads, q, k, v, dout, causal=causal, window=window,
                            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqlens_k_per_row=row_lens)


# (lengths_q, lengths_k, H, Hk, D, dtype, causal, window): sequences of 1, 17, 113, 255 rows and
# more, one whose rows see no key (Sk = 0) and one with keys and no rows (Sq = 0); whole tiles
# and tiles cut by a sequence's end, on both sides of it
GLUON_VARLEN = [
    ([1, 17, 113, 255, 300, 0, 129], [1, 40, 113, 200, 300, 70, 0], 4, 2, 128, torch.bfloat16,
     False, None),
    ([1, 17, 113, 255, 300, 0, 129], [1, 40, 113, 200, 300, 70, 0], 4, 2, 128, torch.bfloat16,
     True, None),
    ([256, 384, 5], [256, 384, 5], 4, 4, 128, torch.float16, True, None),
    ([700, 64, 333], [650, 64, 400], 8, 2, 128, torch.bfloat16, False, (100, 0)),
    ([1, 17, 255, 300], [1, 40, 200, 301], 4, 2, 256, torch.bfloat16, True, None),
    ([129, 0, 64, 77, 200], [100, 50, 0, 200, 130], 4, 1, 256, torch.float16, False, (60, 20)),
    ([1, 17, 113, 255, 300, 0, 129], [1, 40, 113, 200, 300, 70, 0], 4, 2, 64, torch.bfloat16,
     True, None),
    ([700, 64, 333], [650, 64, 400], 8, 8, 64, torch.float16, False, (100, 0)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9, reason="needs sm90")
@pytest.mark.parametrize("case", GLUON_VARLEN, ids=case_id)
def test_gluon_varlen(gluon_calls, case):
    """Packed sequences on the Gluon kernels: tiles read from each sequence's first row (what a
    tile reads of the next sequence dropped), out / dK / dV of a tile cut by the sequence's end
    stored without TMA, dQ summed at each sequence's rows. At head dim 64 the forward is
    the Triton forward's (the Gluon one takes plain calls only there)."""
    run_varlen(*case, with_row_lens=False)
    assert gluon_calls == (["bwd"] if case[4] == 64 else ["fwd", "bwd"]), gluon_calls


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9, reason="needs sm90")
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_varlen_many_sequences(gluon_calls, causal):
    """Many sequences (300) of up to 2 tiles, empty ones among them (Sq = 0, Sk = 0, both): the
    grid's programs past a sequence's tiles do nothing, the others read their own bounds."""
    lengths_q = [(i * 37) % 160 for i in range(300)]
    lengths_k = [(i * 53) % 190 for i in range(300)]
    run_varlen(lengths_q, lengths_k, 2, 1, 128, torch.bfloat16, causal, None, with_row_lens=False)
    assert gluon_calls == ["fwd", "bwd"], gluon_calls


def test_varlen_without_max_seqlen_and_unchecked():
    """max_seqlen_* are computed when omitted; check_inputs=False gives the same result."""
    (q, k, v), cu_q, cu_k = packed_sequences([7, 20], [12, 3], 2, 1, 32, torch.float16, seed=2)
    checked = omniattn.attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    unchecked = omniattn.attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                   max_seqlen_q=20, max_seqlen_k=12, check_inputs=False)
    assert torch.equal(checked, unchecked)


def test_backward_is_deterministic():
    """deterministic=True: bitwise-identical gradients run to run, dbias included."""
    seqlen = 200 if GPU else 40
    runs = 10 if GPU else 2
    q, k, v = random_qkv(2, seqlen, seqlen + 9, 4, 2, 64 if GPU else 32, torch.float16)
    bias = torch.randn(2, 2, seqlen, seqlen + 9, device=DEVICE, dtype=torch.float16,
                       requires_grad=True)
    lens = random_row_lens(2, seqlen, seqlen + 9, seed=4)
    dout = torch.randn_like(q)
    first = None
    for _ in range(runs):
        out = omniattn.attention(q, k, v, causal=True, attn_bias=bias, seqlens_k_per_row=lens,
                                 deterministic=True)
        grads = torch.autograd.grad(out, (q, k, v, bias), dout)
        if first is None:
            first = grads
        else:
            assert all(torch.equal(a, b) for a, b in zip(first, grads))


def test_row_order_is_for_lengths_alone():
    """The launchers refuse a row order next to a term indexed by the caller's rows."""
    from omniattn.passes import attention_forward
    from omniattn.kernels.schedule import KernelArgs

    q, k, v = random_qkv(1, 20, 20, 2, 2, 16, torch.float16, requires_grad=False)
    lens = torch.full((1, 20), 20, dtype=torch.int32, device=DEVICE)
    order = torch.arange(20, dtype=torch.int32, device=DEVICE)[None]
    with pytest.raises(ValueError, match="row_order"):
        attention_forward(q, k, v, KernelArgs.make(16, True, None, None, 0.0), row_lens=lens,
                          row_order=order)
    with pytest.raises(ValueError, match="row_order"):
        attention_forward(q, k, v, KernelArgs.make(16, False, None, None, 0.0), row_order=order)
