"""The top-k thresholds kernels (kernels/select.py: radix select; kernels/select_ranges.py:
per-key scores over key ranges) against reference.topk_thresholds: the same threshold pairs,
bit for bit, with ties, NaN and infinities among the scores; the mask they materialise against
predicate.topk_keep. Under the interpreter without a GPU (fp32 / fp16 scores: it computes bf16
wrongly)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

import omniattn
from helpers import DEVICE, GPU, random_block_mask
from omniattn.kernels import select, select_ranges
from omniattn.kernels.elementwise import Elementwise
from omniattn.kernels.schedule import KernelArgs
from omniattn.kernels.select import keep_mask, row_thresholds
from omniattn.kernels.sequences import PackedSequences
from omniattn.predicate import order_keys, topk_keep
from omniattn.reference import topk_thresholds


def scores_with_ties(shape, seed, dtype=torch.float32):
    """Integer-valued scores in [-3, 3] with some NaN, +-inf and -0.0."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, shape, generator=generator).float()
    draw = torch.rand(shape, generator=generator)
    for value, low in ((float("nan"), 0.0), (float("inf"), 0.03), (float("-inf"), 0.06),
                       (-0.0, 0.09)):
        scores = torch.where((draw >= low) & (draw < low + 0.03), value, scores)
    return scores.to(DEVICE, dtype)


def assert_same_pairs(got, expected):
    assert got.threshold.shape == expected.threshold.shape
    assert torch.equal(got.threshold, expected.threshold.to(got.threshold.device))
    assert torch.equal(got.last_tie, expected.last_tie.to(got.last_tie.device))


def run_both(batch, seqlen_q, seqlen_k, heads, heads_k, topk, scores, causal=False, window=None,
             attn_mask=None, row_lens=None, block_mask=None):
    """(kernel pairs, reference pairs) of one padded call."""
    q = torch.empty(batch, seqlen_q, heads, 8, device=DEVICE)
    k = torch.empty(batch, seqlen_k, heads_k, 8, device=DEVICE)
    expected = topk_thresholds(q, k, topk, scores, causal=causal, window=window,
                               attn_mask=attn_mask, block_mask=block_mask,
                               seqlens_k_per_row=row_lens, chunk_size=5)
    got = row_thresholds(topk, Elementwise.of(scores, heads),
                         KernelArgs.make(8, causal, window, None, 0.0), batch, seqlen_q,
                         seqlen_k, heads, heads_k,
                         mask=Elementwise.of(attn_mask, heads) if attn_mask is not None else None,
                         block_mask=block_mask, row_lens=row_lens)
    return got, expected


def lengths(batch, seqlen_q, seqlen_k, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, seqlen_k + 1, (batch, seqlen_q), generator=generator,
                         dtype=torch.int32).to(DEVICE)


# (name, B, Sq, Sk, H, Hk, topk, score shape, options): the radix select
RADIX_CASES = [
    ("full-causal", 2, 19, 37, 2, 1, 4, (2, 2, 19, 37), dict(causal=True)),
    ("key-scores-row-mask", 1, 13, 40, 4, 2, 5, (1, 2, 1, 40), dict(mask=(1, 4, 13, 40))),
    ("hk-full-window-lengths", 2, 11, 30, 4, 2, 3, (1, 2, 11, 30),
     dict(window=(9, 2), lengths=True)),
    ("row-scores-all-tied", 2, 9, 25, 2, 2, 6, (2, 2, 9, 1), dict(causal=True)),
    ("one-row-for-all", 2, 9, 25, 2, 2, 3, (2, 2, 1, 25), dict(mask=(2, 1, 1, 25))),
    ("fp16-sq-above-sk", 1, 30, 12, 2, 2, 2, (1, 2, 30, 12), dict(causal=True, dtype="fp16")),
]


@pytest.mark.parametrize("case", RADIX_CASES, ids=lambda c: c[0])
def test_radix_select_matches_the_reference(case):
    name, batch, seqlen_q, seqlen_k, heads, heads_k, topk, shape, options = case
    seed = RADIX_CASES.index(case)
    dtype = torch.float16 if options.get("dtype") == "fp16" else torch.float32
    scores = scores_with_ties(shape, seed, dtype)
    mask = torch.rand(options["mask"], generator=torch.Generator().manual_seed(seed)) > 0.3 \
        if "mask" in options else None
    got, expected = run_both(batch, seqlen_q, seqlen_k, heads, heads_k, topk, scores,
                             options.get("causal", False), options.get("window"),
                             None if mask is None else mask.to(DEVICE),
                             lengths(batch, seqlen_q, seqlen_k, seed)
                             if options.get("lengths") else None)
    assert_same_pairs(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_radix_select_with_its_gpu_digits(monkeypatch, dtype):
    """4-bit digits (8 passes, 4 of 16-bit keys), as on the GPU; the interpreter's default is
    8 bits."""
    monkeypatch.setattr(select, "INTERPRETER_RADIX_BITS", 4)
    got, expected = run_both(2, 10, 33, 2, 1, 3, scores_with_ties((2, 1, 10, 33), 11, dtype),
                             causal=True)
    assert_same_pairs(got, expected)


def bitmap_or_random_block_mask(bitmaps: bool, batch, heads, seqlen_q, seqlen_k, seed):
    """16 x 16 blocks: element bitmaps of a predicate every block cuts, or random whole
    blocks (density 0.6)."""
    if bitmaps:
        return omniattn.block_mask_from_predicate(
            lambda b, h, q_idx, kv_idx: (q_idx + kv_idx) % 3 != 0, 1, 1, seqlen_q, seqlen_k,
            block_size=16, device=DEVICE)
    return random_block_mask(batch, heads, seqlen_q, seqlen_k, 16, 0.6, seed)


@pytest.mark.parametrize("bitmaps", [False, True])
def test_radix_select_reads_block_masks(bitmaps):
    batch, seqlen_q, seqlen_k, heads = 2, 24, 40, 2
    block_mask = bitmap_or_random_block_mask(bitmaps, batch, heads, seqlen_q, seqlen_k, 5)
    scores = scores_with_ties((batch, 1, 1, seqlen_k), 6)
    got, expected = run_both(batch, seqlen_q, seqlen_k, heads, heads, 5, scores, causal=bitmaps,
                             block_mask=block_mask)
    assert_same_pairs(got, expected)


# (name, B, Sq, Sk, H, Hk, topk, score shape, options): few rows over many keys, the split
# radix select (integer scores: ties at the threshold are cut in most rows)
SPLIT_CASES = [
    ("one-row-per-head", 2, 1, 1500, 4, 2, 300, (2, 2, 1, 1500), {}),
    ("topk-1", 1, 1, 1200, 2, 2, 1, (1, 2, 1, 1200), {}),
    ("causal-fp16", 1, 3, 1400, 2, 1, 60, (1, 1, 3, 1400), dict(causal=True, dtype="fp16")),
    ("window-lengths", 2, 4, 1300, 2, 2, 200, (2, 2, 4, 1300),
     dict(window=(700, 3), lengths=True)),
    ("key-mask-topk-past-visible", 1, 1, 1200, 2, 2, 1000, (1, 2, 1, 1200),
     dict(mask=(1, 1, 1, 1200))),
    ("row-mask", 1, 2, 1200, 2, 2, 500, (1, 2, 1, 1200), dict(mask=(1, 2, 2, 1200))),
    ("per-key-causal-window", 1, 5, 1300, 2, 2, 90, (1, 2, 1, 1300), dict(window=(1000, 0))),
]


def forced_splits(monkeypatch, splits, select_pairs):
    """(the pairs with each row tile's keys cut into `splits` slices, the single-program
    select's pairs) of select_pairs()."""
    monkeypatch.setattr(select, "key_splits", lambda *args: splits)
    split = select_pairs()
    monkeypatch.setattr(select, "key_splits", lambda *args: 1)
    return split, select_pairs()


@pytest.mark.parametrize("splits", [3, 12], ids=["3-slices", "12-slices"])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: c[0])
def test_split_select_matches_the_reference(monkeypatch, case, splits):
    """The same pairs as the reference and as the single-program select, with 3 slices of
    several key tiles and with 12 (more than some row tiles have key tiles: slices empty)."""
    name, batch, seqlen_q, seqlen_k, heads, heads_k, topk, shape, options = case
    seed = 80 + SPLIT_CASES.index(case)
    dtype = torch.float16 if options.get("dtype") == "fp16" else torch.float32
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.rand(options["mask"], generator=generator) > 0.3).to(DEVICE) \
        if "mask" in options else None
    row_lens = lengths(batch, seqlen_q, seqlen_k, seed) if options.get("lengths") else None
    scores = scores_with_ties(shape, seed, dtype)
    split, single = forced_splits(monkeypatch, splits, lambda: run_both(
        batch, seqlen_q, seqlen_k, heads, heads_k, topk, scores, options.get("causal", False),
        options.get("window"), mask, row_lens))
    assert_same_pairs(split[0], split[1])
    assert_same_pairs(split[0], single[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_split_select_with_its_gpu_digits(monkeypatch, dtype):
    """4-bit digits (8 levels, 4 of 16-bit keys; 16 counts per row and level), as on the GPU."""
    monkeypatch.setattr(select, "INTERPRETER_RADIX_BITS", 4)
    monkeypatch.setattr(select, "key_splits", lambda *args: 5)
    got, expected = run_both(2, 2, 1000, 2, 2, 150, scores_with_ties((2, 2, 2, 1000), 90, dtype),
                             window=(600, 0), row_lens=lengths(2, 2, 1000, 90))
    assert_same_pairs(got, expected)


def test_half_keys_are_the_float32_keys_in_order():
    """Every fp16 bit pattern (NaNs, infinities, -0 and subnormals among them): its 16-bit select
    key orders and ties as its float32 order key, and the threshold written back from it is
    that order key."""

    @triton.jit
    def keys_and_thresholds(Scores, Keys, Thresholds, N: tl.constexpr):
        offs = tl.program_id(0) * N + tl.arange(0, N)
        keys = select.half_order_keys(tl.load(Scores + offs))
        tl.store(Keys + offs, keys.to(tl.int32))
        tl.store(Thresholds + offs, select.row_threshold(keys, offs >= 0, Scores, 16))

    scores = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16) \
        .view(torch.float16).to(DEVICE)
    keys, thresholds = (torch.empty(2 ** 16, dtype=torch.int32, device=DEVICE) for _ in range(2))
    keys_and_thresholds[(2 ** 6,)](scores, keys, thresholds, N=2 ** 10)
    expected = order_keys(scores)
    assert torch.equal(thresholds, expected)
    order = torch.argsort(expected, stable=True)
    keys, expected = keys[order], expected[order]
    assert (keys[1:] >= keys[:-1]).all()
    assert torch.equal(keys[1:] == keys[:-1], expected[1:] == expected[:-1])


@pytest.mark.parametrize("bitmaps", [False, True])
def test_split_select_reads_block_masks(monkeypatch, bitmaps):
    batch, seqlen_q, seqlen_k, heads = 1, 2, 1200, 2
    block_mask = bitmap_or_random_block_mask(bitmaps, batch, heads, seqlen_q, seqlen_k, 91)
    monkeypatch.setattr(select, "key_splits", lambda *args: 6)
    got, expected = run_both(batch, seqlen_q, seqlen_k, heads, heads, 250,
                             scores_with_ties((batch, 1, 1, seqlen_k), 91), causal=bitmaps,
                             block_mask=block_mask)
    assert_same_pairs(got, expected)


def test_split_select_of_packed_sequences(monkeypatch):
    """Packed rows (per-row scores), an empty sequence and one seeing fewer keys than topk
    among them."""
    cu_q = torch.tensor([0, 2, 2, 3, 4], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 900, 1000, 1100, 2300], dtype=torch.int32, device=DEVICE)
    packed = PackedSequences(cu_q, cu_k, 2, 1200)
    scores = scores_with_ties((4, 2, 1200), 92)
    q, k = torch.empty(4, 2, 8, device=DEVICE), torch.empty(2300, 2, 8, device=DEVICE)
    expected = topk_thresholds(q, k, 150, scores, causal=True, cu_seqlens_q=cu_q,
                               cu_seqlens_k=cu_k)
    split, single = forced_splits(monkeypatch, 4, lambda: row_thresholds(
        150, Elementwise.of(scores, 2), KernelArgs.make(8, True, None, None, 0.0), 4, 2, 1200,
        2, 2, packed=packed, total_q=4))
    assert_same_pairs(split, expected)
    assert_same_pairs(split, single)


def test_split_select_of_used_keys(monkeypatch):
    """seqused_k, one row per (batch, head): each sequence's pairs are the reference's of its
    used keys alone (all of them, fewer than topk, none)."""
    batch, seqlen_k, heads, heads_k, topk = 4, 1500, 4, 2, 200
    used = torch.tensor([1500, 150, 1100, 0], dtype=torch.int32, device=DEVICE)
    scores = scores_with_ties((batch, heads_k, 1, seqlen_k), 93)
    monkeypatch.setattr(select, "key_splits", lambda *args: 7)
    got = row_thresholds(topk, Elementwise.of(scores, heads),
                         KernelArgs.make(8, False, None, None, 0.0), batch, 1, seqlen_k, heads,
                         heads_k, seqused_k=used)
    for b, n in enumerate(used.tolist()):
        q = torch.empty(1, 1, heads, 8, device=DEVICE)
        k = torch.empty(1, n, heads_k, 8, device=DEVICE)
        expected = topk_thresholds(q, k, topk, scores[b:b + 1, ..., :n])
        assert_same_pairs(type(got)(got.threshold[b:b + 1], got.last_tie[b:b + 1]), expected)


def test_the_split_rule():
    """Slices for two programs per SM where the row tiles leave SMs idle, MIN_SLICE_TILES key
    tiles or more each; none where the row tiles fill the GPU or the keys are few. An H100's
    decoding shapes (1024-key steps): B1 x 8 heads x 128k keys, B8 x 32k."""
    assert select.key_splits(8, 128, 132) == 32
    assert select.key_splits(64, 32, 132) == 5
    assert select.key_splits(264, 4096, 132) == 1
    assert select.key_splits(8, 7, 132) == 1
    # row tiles no taller than the rows, as many elements
    (rows, keys, _), (all_rows, all_keys, _) = select.radix_tiles(3), select.radix_tiles(1000)
    assert rows == 4 and rows * keys == all_rows * all_keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
def test_few_rows_take_the_split(monkeypatch, causal, dtype):
    """Under the interpreter's stand-in SM count a decoding shape splits, per-key scores under
    causal too (at most RANGE_SELECT_ROWS rows): its launches, a level per digit of 32-bit keys,
    of 16-bit keys for 16-bit scores."""
    launched = []
    monkeypatch.setattr(select, "launch", lambda kernel, *args, **kwargs: launched.append(
        kernel.fn.__name__))
    row_thresholds(100, Elementwise.of(torch.zeros(1, 2, 1, 3000, device=DEVICE, dtype=dtype), 2),
                   KernelArgs.make(8, causal, None, None, 0.0), 1, 1, 3000, 2, 2)
    levels = (32 if dtype == torch.float32 else 16) // select.INTERPRETER_RADIX_BITS
    assert launched == ["_slice_digit_counts_kernel"] * levels + ["_slice_tie_bound_kernel"]


# (name, B, Sq, Sk, H, Hk, topk, score shape, options): per-key scores over key ranges
RANGE_CASES = [
    ("causal", 2, 21, 37, 4, 2, 5, (2, 2, 1, 37), dict(causal=True)),
    ("causal-sk-below-sq", 1, 30, 17, 2, 2, 3, (1, 2, 1, 17), dict(causal=True)),
    ("window", 2, 19, 19, 2, 2, 4, (2, 1, 1, 19), dict(window=(7, 0))),
    ("lengths-key-mask", 2, 17, 33, 2, 1, 3, (2, 1, 1, 33), dict(lengths=True,
                                                                mask=(2, 2, 1, 33))),
    ("causal-mqa-fp16", 1, 17, 17, 4, 1, 1, (1, 1, 1, 17), dict(causal=True, dtype="fp16")),
]


def range_select_launches(monkeypatch):
    """The names of the kernels range_thresholds launches from here on."""
    launched = []
    launch = select_ranges.launch
    monkeypatch.setattr(select_ranges, "launch", lambda kernel, *args, **kwargs: (
        launched.append(kernel.fn.__name__), launch(kernel, *args, **kwargs)))
    return launched


@pytest.mark.parametrize("case", RANGE_CASES, ids=lambda c: c[0])
def test_range_select_matches_the_reference(monkeypatch, case):
    """More rows than a radix row tile (RANGE_SELECT_ROWS): the range select."""
    name, batch, seqlen_q, seqlen_k, heads, heads_k, topk, shape, options = case
    launched = range_select_launches(monkeypatch)
    seed = 20 + RANGE_CASES.index(case)
    dtype = torch.float16 if options.get("dtype") == "fp16" else torch.float32
    mask = torch.rand(options["mask"], generator=torch.Generator().manual_seed(seed)) > 0.3 \
        if "mask" in options else None
    got, expected = run_both(batch, seqlen_q, seqlen_k, heads, heads_k, topk,
                             scores_with_ties(shape, seed, dtype), options.get("causal", False),
                             options.get("window"), None if mask is None else mask.to(DEVICE),
                             lengths(batch, seqlen_q, seqlen_k, seed)
                             if options.get("lengths") else None)
    assert_same_pairs(got, expected)
    assert "_range_select_kernel" in launched


@pytest.mark.parametrize("per_key", [True, False], ids=["ranges", "radix"])
def test_packed_sequences(monkeypatch, per_key):
    """Varlen (an empty sequence among them): per-key packed scores (1, Hk, max_k) take the
    range select, per-row ones (total_q, H, max_k) the radix select."""
    cu_q = torch.tensor([0, 6, 6, 23], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 9, 20, 37], dtype=torch.int32, device=DEVICE)
    packed = PackedSequences(cu_q, cu_k, 17, 17)
    scores = scores_with_ties((1, 2, 17) if per_key else (23, 4, 17), 30)
    row_lens = torch.tensor([9, 0, 3, 9, 5, 1] + [11] * 17, dtype=torch.int32, device=DEVICE)
    q, k = torch.empty(23, 4, 8, device=DEVICE), torch.empty(37, 2, 8, device=DEVICE)
    expected = topk_thresholds(q, k, 3, scores, causal=True, seqlens_k_per_row=row_lens,
                               cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    launched = range_select_launches(monkeypatch)
    got = row_thresholds(3, Elementwise.of(scores, 4), KernelArgs.make(8, True, None, None, 0.0),
                         3, 17, 17, 4, 2, row_lens=row_lens, packed=packed, total_q=23)
    assert_same_pairs(got, expected)
    assert ("_range_select_kernel" in launched) == per_key


@pytest.mark.parametrize("window", [None, (6, 1)], ids=["causal", "window"])
@pytest.mark.parametrize("per_key", [True, False], ids=["ranges", "radix"])
def test_used_keys_of_each_sequence(per_key, window):
    """seqused_k (split-KV decoding's partly used caches): sequence b selects among its first
    seqused_k[b] keys, causal / window aligned to them: each sequence's pairs are the
    reference's of that sequence alone (all its keys, fewer than topk, none)."""
    batch, seqlen_q, seqlen_k, heads, heads_k, topk = 4, 17, 40, 4, 2, 4
    used = torch.tensor([40, 3, 23, 0], dtype=torch.int32, device=DEVICE)
    shape = (batch, heads_k, 1, seqlen_k) if per_key else (batch, heads, seqlen_q, seqlen_k)
    scores = scores_with_ties(shape, 70)
    got = row_thresholds(topk, Elementwise.of(scores, heads),
                         KernelArgs.make(8, window is None, window, None, 0.0), batch, seqlen_q,
                         seqlen_k, heads, heads_k, seqused_k=used)
    for b, n in enumerate(used.tolist()):
        q = torch.empty(1, seqlen_q, heads, 8, device=DEVICE)
        k = torch.empty(1, n, heads_k, 8, device=DEVICE)
        expected = topk_thresholds(q, k, topk, scores[b:b + 1, ..., :n], causal=window is None,
                                   window=window)
        part = type(got)(got.threshold[b:b + 1], got.last_tie[b:b + 1])
        assert_same_pairs(part, expected)


def test_keep_mask_is_the_keep_predicate():
    """The mask kernel keeps exactly what predicate.topk_keep keeps of the visible keys."""
    batch, seqlen_q, seqlen_k, heads = 2, 13, 29, 2
    scores = scores_with_ties((batch, heads, 1, seqlen_k), 40)
    mask = (torch.rand(batch, 1, seqlen_q, seqlen_k,
                       generator=torch.Generator().manual_seed(40)) > 0.2).to(DEVICE)
    args = KernelArgs.make(8, True, None, None, 0.0)
    score_form, mask_form = Elementwise.of(scores, heads), Elementwise.of(mask, heads)
    pairs = row_thresholds(4, score_form, args, batch, seqlen_q, seqlen_k, heads, heads,
                           mask=mask_form)
    keep = keep_mask(pairs, score_form, args, batch, seqlen_q, seqlen_k, heads, mask_form)
    visible = mask & torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=DEVICE).tril(
        seqlen_k - seqlen_q)
    keys = order_keys(scores).expand(batch, heads, seqlen_q, seqlen_k)
    assert torch.equal(keep, visible & topk_keep(keys, pairs.threshold, pairs.last_tie))
    assert torch.equal(keep.sum(-1), visible.sum(-1).clamp(max=4).expand(batch, heads, -1))


def test_topk_of_every_key_launches_nothing(monkeypatch):
    monkeypatch.setattr(select, "launch", lambda *a, **k: pytest.fail("launched"))
    scores = scores_with_ties((1, 1, 1, 8), 50)
    got, expected = run_both(1, 8, 8, 2, 2, 8, scores, causal=True)
    assert_same_pairs(got, expected)


# every select kernel's launch, compiled for sm_90a in place of running (no GPU needed)
_COMPILE = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from kernel_resources import launches_compiled
import omniattn
from omniattn.kernels.elementwise import Elementwise
from omniattn.kernels.schedule import KernelArgs
from omniattn.kernels import select
from omniattn.kernels.select import keep_mask, row_thresholds
from omniattn.predicate import RowThresholds
reports, (b, s, h) = [], (2, 256, 4)
causal = KernelArgs.make(64, True, None, None, 0.0)
select.sm_count = lambda device: 132  # an H100's: few rows over many keys take the split
names = {"_radix_select_kernel", "_rank_levels_kernel", "_range_select_kernel",
         "_keep_mask_kernel", "_slice_digit_counts_kernel", "_slice_tie_bound_kernel"}
with launches_compiled(names, reports):
    full = Elementwise.of(torch.randn(b, h, s, s, dtype=torch.bfloat16), h)
    mask = Elementwise.of(torch.ones(b, 1, s, s, dtype=torch.bool), h)
    row_thresholds(64, full, causal, b, s, s, h, h, mask=mask,
                   row_lens=torch.full((b, s), s, dtype=torch.int32))
    blocks = omniattn.block_mask_from_predicate(lambda b, h, q, k: (q - k) % 3 != 0, 1, 1, s, s,
                                                block_size=64)
    key = Elementwise.of(torch.randn(b, h, 1, s, dtype=torch.bfloat16), h)
    row_thresholds(64, key, causal, b, s, s, h, h, block_mask=blocks)
    row_thresholds(64, key, causal, b, s, s, h, h)
    used = torch.full((b,), s - 3, dtype=torch.int32)
    row_thresholds(64, key, causal, b, s, s, h, h, seqused_k=used)
    row_thresholds(64, full, causal, b, s, s, h, h, seqused_k=used)
    pairs = RowThresholds(*(torch.zeros(b, h, s, dtype=torch.int32) for _ in range(2)))
    keep_mask(pairs, key, causal, b, s, s, h, mask)
    # decoding's one query row over 32k keys, with a key mask and seqused_k
    decode = Elementwise.of(torch.randn(b, h, 1, 32768, dtype=torch.bfloat16), h)
    key_mask = Elementwise.of(torch.ones(b, 1, 1, 32768, dtype=torch.bool), h)
    row_thresholds(4096, decode, KernelArgs.make(64, False, None, None, 0.0), b, 1, 32768, h,
                   h, mask=key_mask, seqused_k=used)
for r in reports:
    print(r["kernel"])
"""
PTXAS = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton build has no bundled ptxas")
def test_kernels_compile_for_hopper():
    """The interpreter types less strictly than the compiler: each kernel (radix select with
    masks, lengths and a block mask with bitmaps; the wavelet build and queries; both selects
    with seqused_k; the split radix select's levels and tie bound, one row over 32k keys; the
    mask writer) compiles for sm_90a. (Untuned: the radix select with a block mask's bitmaps
    spills 20 bytes at 255 registers.)"""
    benchmarks = pathlib.Path(__file__).parents[2] / "benchmarks"
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-c", _COMPILE, str(benchmarks)], capture_output=True,
                         text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(set(run.stdout.split())) == [
        "_keep_mask_kernel", "_radix_select_kernel", "_range_select_kernel",
        "_rank_levels_kernel", "_slice_digit_counts_kernel", "_slice_tie_bound_kernel"]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("form", ["full", "key"])
def test_gpu_thresholds_at_tile_sizes(form):
    """Several tiles of every kernel (64-key radix steps, 128-row range programs, 1024-key build
    steps), bf16 scores with ties."""
    batch, seqlen, heads = 2, 1500, 4
    shape = (batch, heads, seqlen, seqlen) if form == "full" else (batch, heads, 1, seqlen)
    scores = scores_with_ties(shape, 60, torch.bfloat16)
    got, expected = run_both(batch, seqlen, seqlen, heads, heads, 300, scores, causal=True,
                             row_lens=lengths(batch, seqlen, seqlen, 60))
    assert_same_pairs(got, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("seqlen_k", [50000, 131072])
def test_gpu_split_select_of_decoding_rows(monkeypatch, seqlen_k):
    """A decode step's rows (one per (batch, KV head)) over many keys take the split select on
    the GPU's own SM count: bf16 scores with ties, a key mask and seqused_k; the pairs of the
    single-program select and, per sequence, of the reference."""
    batch, heads, heads_k, topk = 2, 8, 4, 4096
    scores = scores_with_ties((batch, heads_k, 1, seqlen_k), 61, torch.bfloat16)
    key_mask = torch.rand(batch, 1, 1, seqlen_k, generator=torch.Generator().manual_seed(61)) > 0.1
    used = torch.tensor([seqlen_k - 5, 3000], dtype=torch.int32, device="cuda")
    launched = []
    launch = select.launch
    monkeypatch.setattr(select, "launch", lambda kernel, *args, **kwargs: (
        launched.append(kernel.fn.__name__), launch(kernel, *args, **kwargs)))

    def select_pairs():
        return row_thresholds(topk, Elementwise.of(scores, heads),
                              KernelArgs.make(128, False, None, None, 0.0), batch, 1, seqlen_k,
                              heads, heads_k, mask=Elementwise.of(key_mask.cuda(), heads),
                              seqused_k=used)

    split = select_pairs()
    assert "_slice_tie_bound_kernel" in launched
    monkeypatch.setattr(select, "key_splits", lambda *args: 1)
    assert_same_pairs(split, select_pairs())
    for b, n in enumerate(used.tolist()):
        q = torch.empty(1, 1, heads, 8, device="cuda")
        k = torch.empty(1, n, heads_k, 8, device="cuda")
        expected = topk_thresholds(q, k, topk, scores[b:b + 1, ..., :n],
                                   attn_mask=key_mask[b:b + 1, ..., :n].cuda())
        assert_same_pairs(type(split)(split.threshold[b:b + 1], split.last_tie[b:b + 1]),
                          expected)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_gpu_per_key_causal_thresholds_memory_is_linear():
    """Issue #53's DMA case at 32k keys: the range select allocates O(heads x Sk log Sk) (its
    wavelet matrix, 15 levels, and 5 int32 per key beside it), no (Sq, Sk) temporary."""
    heads, seqlen = 4, 32768
    scores = torch.randn(1, heads, 1, seqlen, device="cuda", dtype=torch.bfloat16)
    args = KernelArgs.make(128, True, None, None, 0.0)
    form = Elementwise.of(scores, heads)
    row_thresholds(2048, form, args, 1, seqlen, seqlen, heads, heads)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    pairs = row_thresholds(2048, form, args, 1, seqlen, seqlen, heads, heads)
    peak = torch.cuda.max_memory_allocated() - before
    assert peak <= heads * seqlen * 4 * (15 + 10) + (16 << 20), peak
    keys = order_keys(scores[0, :, 0])
    kept = (keys[:, None, :] > pairs.threshold[0, :, -3:, None]).sum(-1)  # the last rows
    assert (kept <= 2048).all()
