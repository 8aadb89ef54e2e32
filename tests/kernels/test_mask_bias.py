"""Element mask + learnable bias on the kernels (issue #4) against the float64 reference: output,
lse, dq, dk, dv and dbias in the bias's own shape, for every broadcast form.

Uninitialised memory is filled with NaN (torch's deterministic mode), so an output or gradient
element the kernels fail to write fails the test.
"""
from __future__ import annotations

from helpers import (DEVICE, GPU, case_id, check_against_reference, element_visibility,
                     random_block_mask, random_qkv, replace_backward_configs)
import pytest
import torch

import omniattn


@pytest.fixture(autouse=True)
def nan_poisoned_memory():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(previous)


def elementwise_shape(form: str, batch: int, heads: int, heads_k: int, seqlen_q: int,
                      seqlen_k: int) -> tuple[int, ...]:
    """form: 4 letters for (batch, heads, Sq, Sk): b/1, h (H) / k (Hk) / 1, q/1, s/1."""
    sizes = {"b": batch, "h": heads, "k": heads_k, "q": seqlen_q, "s": seqlen_k, "1": 1}
    return tuple(sizes[c] for c in form)


def make_mask(shape, dtype, generator, keep_fraction=0.7):
    keep = torch.rand(shape, generator=generator) < keep_fraction
    if dtype == torch.bool:
        return keep.to(DEVICE)
    return keep.to(dtype).to(DEVICE)


def case_inputs(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, mask_form, mask_dtype,
                bias_form, masked_rows=False, neg_inf_bias=False, bias_grad=True):
    """Seeded q, k, v (requiring grad), the mask and the bias (None where the form is None) of
    a case: masked_rows hides every key from the first 3 rows, neg_inf_bias sets a fifth of the
    bias to -inf."""
    generator = torch.Generator().manual_seed(seqlen_q * 31 + seqlen_k + heads_k)
    torch.manual_seed(seqlen_q + 7 * seqlen_k)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype)
    dims = (batch, heads, heads_k, seqlen_q, seqlen_k)
    mask = bias = None
    if mask_form is not None:
        mask = make_mask(elementwise_shape(mask_form, *dims), mask_dtype, generator)
        if masked_rows:
            mask[..., : min(3, mask.shape[2]), :] = 0  # rows that see no key
    if bias_form is not None:
        bias = torch.randn(elementwise_shape(bias_form, *dims), generator=generator)
        if neg_inf_bias:
            bias[torch.rand(bias.shape, generator=generator) < 0.2] = float("-inf")
        bias = bias.to(device=DEVICE, dtype=dtype).requires_grad_(bias_grad)
    return q, k, v, mask, bias


def run_case(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, mask_form, mask_dtype,
             bias_form, causal=False, window=None, softcap=0.0, block_mask=None,
             masked_rows=False, neg_inf_bias=False, bias_grad=True):
    q, k, v, mask, bias = case_inputs(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype,
                                      mask_form, mask_dtype, bias_form, masked_rows,
                                      neg_inf_bias, bias_grad)
    out, _, grads = run_and_check(q, k, v, attn_mask=mask, attn_bias=bias, block_mask=block_mask,
                                  causal=causal, window=window, softcap=softcap)
    return out, grads


def run_and_check(q, k, v, attn_mask=None, attn_bias=None, block_mask=None, **kwargs):
    """The kernels' out, lse, dq, dk, dv (and dbias) against the float64 reference, which sees
    the block mask expanded into the element mask; every gradient must be finite. `kwargs` go
    to both. Returns (out, lse, grads)."""
    dout = torch.randn_like(q)
    out, lse = omniattn.attention(q, k, v, attn_mask=attn_mask, attn_bias=attn_bias,
                                  block_mask=block_mask, return_lse=True, **kwargs)
    leaves = (q, k, v) if attn_bias is None or not attn_bias.requires_grad \
        else (q, k, v, attn_bias)
    grads = torch.autograd.grad(out, leaves, dout)
    for name, g in zip(("dq", "dk", "dv", "dbias"), grads):
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
    keep = attn_mask
    if block_mask is not None:
        visible = element_visibility(block_mask)
        keep = visible if keep is None else (keep != 0) & visible
    check_against_reference(out, lse, grads, q, k, v, dout, attn_mask=keep, attn_bias=attn_bias,
                            **kwargs)
    return out, lse, grads


# (B, Sq, Sk, H, Hk, D, dtype, mask form, mask dtype, bias form, causal, window, softcap)
CASES = [
    (2, 37, 45, 4, 2, 32, torch.float16, "bhqs", torch.bool, "bhqs", False, None, 0.0),
    (2, 37, 45, 4, 2, 32, torch.float16, "b11s", torch.bool, "bh1s", True, None, 0.0),
    (1, 33, 29, 4, 2, 32, torch.float16, "1kqs", torch.uint8, "1kqs", False, None, 0.0),
    (2, 30, 41, 4, 2, 16, torch.float16, "bkq1", torch.float16, "bkq1", True, None, 0.0),
    (2, 19, 35, 4, 1, 32, torch.float16, "11qs", torch.bool, "1111", False, (7, 5), 0.0),
    (2, 40, 33, 4, 4, 32, torch.float32, "bhqs", torch.float32, "11qs", True, None, 3.0),
    (1, 17, 50, 2, 1, 64, torch.float16, "1hqs", torch.bool, "1k1s", False, None, 0.0),
    (2, 21, 21, 4, 2, 32, torch.float16, None, None, "b1qs", True, None, 0.0),
    (2, 21, 34, 4, 2, 32, torch.float16, "bhqs", torch.bool, None, False, None, 0.0),
    (1, 1, 17, 2, 2, 32, torch.float16, "bhqs", torch.bool, "bhqs", False, None, 0.0),
]
if GPU:
    CASES = [(b, sq * 9, sk * 9, h, hk, 4 * d, dt, mf, md, bf, c,
              None if w is None else (w[0] * 9, w[1] * 9), cap)
             for (b, sq, sk, h, hk, d, dt, mf, md, bf, c, w, cap) in CASES]
    CASES += [(b, sq, sk, h, hk, d, torch.bfloat16, mf, md, bf, c, w, cap)
              for (b, sq, sk, h, hk, d, dt, mf, md, bf, c, w, cap) in CASES
              if dt == torch.float16]
    # causal at head dim 256: the masked tiles of the Triton backward's D256 config
    CASES.append((2, 300, 410, 4, 2, 256, torch.bfloat16, "bhqs", torch.bool, "bh1s", True, None,
                  0.0))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_mask_and_bias(case):
    (batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, mask_form, mask_dtype, bias_form,
     causal, window, softcap) = case
    run_case(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, mask_form, mask_dtype,
             bias_form, causal=causal, window=window, softcap=softcap)


# cases whose mask spans (Sq, Sk): heads H / Hk, batch-broadcast, one query row
SPANNING_MASK_CASES = [case for case in CASES if case[7] is not None and case[7][2:] == "qs"][:4]


@pytest.mark.parametrize("case", SPANNING_MASK_CASES, ids=case_id)
def test_mask_forward_without_grad(case):
    """A call that records no graph builds its forward lists in the pre-pass's launch
    (`mask_forward_schedule`): out and lse bitwise equal to those of the same call with
    gradients (two launches, lists for every pass), which test_mask_and_bias checks against the
    reference; rows that see no key included."""
    *inputs, causal, window, softcap = case
    q, k, v, mask, bias = case_inputs(*inputs, masked_rows=True, bias_grad=False)
    kwargs = dict(attn_mask=mask, attn_bias=bias, causal=causal, window=window, softcap=softcap,
                  return_lse=True)
    out, lse = omniattn.attention(q, k, v, **kwargs)
    with torch.no_grad():
        out_without_grad, lse_without_grad = omniattn.attention(q, k, v, **kwargs)
    assert torch.equal(out_without_grad, out) and torch.equal(lse_without_grad, lse)


@pytest.mark.parametrize("case", [CASES[i] for i in (0, 1, 5)], ids=case_id)
def test_mask_and_bias_with_dkdv_in_two_programs(monkeypatch, case):
    """dK (and dbias: a full bias, a key bias, a bias per query row) from programs apart from
    dV's (BwdTileConfig.dkdv_apart)."""
    monkeypatch.setenv("OMNIATTN_GLUON", "0")
    replace_backward_configs(monkeypatch, dkdv_apart=True)
    test_mask_and_bias(case)


def test_fully_masked_rows_and_neg_inf_bias():
    """Rows that keep no key and -inf bias entries: 0 output, -inf lse, finite gradients."""
    seqlen = 200 if GPU else 29
    out, grads = run_case(2, seqlen, seqlen + 3, 4, 2, 32, torch.float16, "bhqs", torch.bool,
                          "bhqs", causal=True, masked_rows=True, neg_inf_bias=True)
    assert (out[:, :3] == 0).all()


def test_block_mask_with_mask_and_bias():
    """A block mask, an element mask and a bias together: the schedule is their AND."""
    seqlen_q, seqlen_k = (300, 410) if GPU else (40, 53)
    block_mask = random_block_mask(1, 4, seqlen_q, seqlen_k, 64 if GPU else 16, 0.6, 3)
    run_case(2, seqlen_q, seqlen_k, 4, 2, 64 if GPU else 32, torch.float16, "b11s", torch.bool,
             "bh1s", causal=True, block_mask=block_mask)


# calls the Gluon kernels take (sm90, head dim 128): (B, Sq, Sk, H, Hk, dtype, mask form, mask
# dtype, bias form, causal, window, rows that see no key and -inf bias entries). The forward
# takes no bias spanning (Sq, Sk), the backward none shared by several query heads (its dbias is
# a sum over them)
GLUON_CASES = [
    (2, 1000, 1000, 8, 2, torch.bfloat16, "bhqs", torch.bool, "bh1s", True, None, False),
    (1, 300, 410, 4, 2, torch.float16, "bhqs", torch.uint8, "bkq1", False, None, False),
    (2, 256, 384, 4, 4, torch.bfloat16, "b11s", torch.bool, "1k1s", True, None, False),
    (1, 255, 113, 4, 2, torch.bfloat16, "bkq1", torch.float16, "b1q1", True, None, False),
    (2, 1, 17, 4, 1, torch.float16, "1hqs", torch.bool, "1111", False, None, False),
    (2, 640, 640, 4, 2, torch.bfloat16, None, None, "bh1s", True, None, False),
    (1, 513, 2049, 4, 1, torch.float16, "11qs", torch.bool, None, False, None, False),
    (1, 700, 900, 4, 2, torch.bfloat16, "bhqs", torch.bool, "bk1s", False, (-1, 37), False),
    (2, 300, 303, 4, 2, torch.float16, "bhqs", torch.bool, "bh1s", True, None, True),
    (1, 300, 410, 4, 2, torch.bfloat16, "bhqs", torch.bool, "bhqs", True, None, True),
    (2, 255, 256, 4, 2, torch.float16, "bkqs", torch.bool, "1hqs", False, None, False),
    (1, 512, 512, 4, 2, torch.bfloat16, None, None, "bhqs", True, None, False),
    (1, 384, 384, 4, 2, torch.bfloat16, "bhqs", torch.bool, "bkqs", True, None, False),
    # masks the backward loads by TMA (1 byte, rows of 16-byte multiples): with a key bias
    # (issue #4's form) and with a scalar bias
    (2, 256, 512, 4, 2, torch.bfloat16, "bhqs", torch.bool, "bh1s", True, None, False),
    (1, 200, 256, 4, 2, torch.float16, "bhqs", torch.uint8, "1111", True, None, False),
    # and the forward by TMA too: one mask batch for two, keys past Sk in the last tile, rows
    # that see no key
    (2, 113, 272, 4, 2, torch.float16, "1kqs", torch.bool, "bh1s", False, None, True),
    # (Sq, Sk) biases the forward loads by TMA (rows of 16-byte multiples), with a mask it loads
    # by TMA too and with one its consumers load, -inf entries and rows that see no key
    (1, 255, 256, 4, 4, torch.float16, "bhqs", torch.uint8, "bhqs", True, None, True),
    (2, 113, 200, 4, 2, torch.bfloat16, "bhqs", torch.bool, "bkqs", True, None, True),
    # a (Sq, Sk) bias per query head the backward's consumers copy by TMA: two heads per
    # program (a copy at each head's first step), keys past Sk, beside a mask they load
    (2, 177, 200, 4, 2, torch.bfloat16, "1kqs", torch.bool, "bhqs", True, None, False),
    # masks the backward loads by TMA beside a one-column bias (its dbias row sums in scratch)
    (2, 256, 512, 4, 2, torch.bfloat16, "bhqs", torch.bool, "bhq1", True, None, False),
    (1, 200, 256, 4, 4, torch.float16, "bhqs", torch.uint8, "b1q1", False, None, True),
    # left window bounds: biases on the implicit schedule (a (Sq, Sk) dbias zeroed in the tiles
    # left and right of the window; with GQA and without), and masks, whose lists take the
    # Gluon backward (its PARTIAL tiles apply the left bound) and the Triton forward's forward
    # (`schedules.build_schedule`), one with rows that see no key
    (1, 512, 520, 4, 2, torch.bfloat16, None, None, "bhqs", False, (100, 150), False),
    (1, 300, 410, 4, 4, torch.bfloat16, None, None, "bhqs", False, (100, 50), False),
    (2, 640, 640, 4, 2, torch.float16, None, None, "bh1s", True, (200, -1), False),
    (1, 300, 410, 4, 2, torch.float16, "bhqs", torch.bool, "bh1s", False, (60, 20), False),
    (2, 700, 600, 4, 2, torch.bfloat16, "bhqs", torch.bool, "bhqs", True, (250, -1), True),
    (1, 513, 640, 4, 4, torch.bfloat16, "bhqs", torch.bool, "bh1s", True, (300, -1), False),
]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9, reason="needs sm90")
@pytest.mark.parametrize("case", GLUON_CASES, ids=case_id)
def test_gluon_with_mask_and_bias(gluon_calls, case):
    """The Gluon forward and backward with element masks (schedule lists at their tiles) and
    biases (listed or implicit schedules) in every broadcast form, dbias included, odd lengths,
    GQA, rows that see no key; fails if a pass that should take the Gluon path did not."""
    (batch, seqlen_q, seqlen_k, heads, heads_k, dtype, mask_form, mask_dtype, bias_form, causal,
     window, degenerate) = case
    out, _ = run_case(batch, seqlen_q, seqlen_k, heads, heads_k, 128, dtype, mask_form,
                      mask_dtype, bias_form, causal=causal, window=window,
                      masked_rows=degenerate, neg_inf_bias=degenerate)
    if degenerate:
        assert (out[:, :3] == 0).all()
    spans = bias_form is not None and bias_form[2:] == "qs"
    # the forward takes an (Sq, Sk) bias whose rows TMA can read (2-byte elements: Sk % 8 == 0)
    expected = ([] if spans and seqlen_k % 8 else ["fwd"]) \
        + ([] if spans and bias_form[1] != "h" else ["bwd"])
    if window is not None and window[0] >= 0 and mask_form is not None:
        expected.remove("fwd")  # the Triton forward's finer tiles for lists with a left bound
    assert gluon_calls == expected, f"Gluon launches: {gluon_calls}"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9, reason="needs sm90")
@pytest.mark.parametrize("case", [
    (2, 300, 410, 4, 2, torch.bfloat16, "bhqs", torch.bool, "bh1s", True, None, True),
    (1, 255, 113, 4, 2, torch.float16, "bkq1", torch.float16, "b1q1", True, None, False),
    (1, 200, 256, 4, 4, torch.bfloat16, "1hqs", torch.uint8, "bhqs", False, None, False),
], ids=case_id)
def test_gluon_forward_head_dim_256_with_mask_and_bias(gluon_calls, case):
    """Head dim 256: the Gluon forward walks an element mask's lists (its consumers load the
    mask) with a key / broadcast bias; a bias spanning (Sq, Sk) stays in the Triton forward (no tiles for
    it); the backward is the Triton backward's."""
    (batch, seqlen_q, seqlen_k, heads, heads_k, dtype, mask_form, mask_dtype, bias_form, causal,
     window, degenerate) = case
    run_case(batch, seqlen_q, seqlen_k, heads, heads_k, 256, dtype, mask_form, mask_dtype,
             bias_form, causal=causal, window=window, masked_rows=degenerate,
             neg_inf_bias=degenerate)
    expected = [] if bias_form[2:] == "qs" else ["fwd"]
    assert gluon_calls == expected, f"Gluon launches: {gluon_calls}"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9, reason="needs sm90")
@pytest.mark.parametrize("case", [
    (2, 300, 410, 4, 2, torch.bfloat16, None, None, "bh1s", True, None, False),
    (1, 255, 256, 4, 4, torch.float16, None, None, "bhqs", False, None, True),
    (2, 1000, 1000, 8, 2, torch.bfloat16, None, None, "bhqs", True, None, False),
    (1, 513, 2049, 4, 1, torch.float16, None, None, "bh1s", False, None, False),
    (1, 700, 900, 4, 2, torch.bfloat16, None, None, "b1q1", True, None, False),
    (2, 1, 17, 4, 1, torch.bfloat16, None, None, "bh1s", False, None, False),
    (2, 640, 640, 4, 2, torch.float16, None, None, "bh1s", True, (200, -1), False),
    (2, 200, 256, 4, 2, torch.bfloat16, "bhqs", torch.bool, "bkqs", True, None, False),
], ids=case_id)
def test_gluon_backward_head_dim_64_with_mask_and_bias(gluon_calls, case):
    """Head dim 64: biases (per key, (Sq, Sk) per query head with a fifth -inf, one column)
    with their gradients take the Gluon backward on its implicit schedule (multi-tile, GQA,
    odd lengths, a left window bound); an element mask's lists are at the Triton backward's tiles, so that
    call stays there. The forward is the Triton forward's."""
    (batch, seqlen_q, seqlen_k, heads, heads_k, dtype, mask_form, mask_dtype, bias_form, causal,
     window, degenerate) = case
    run_case(batch, seqlen_q, seqlen_k, heads, heads_k, 64, dtype, mask_form, mask_dtype,
             bias_form, causal=causal, window=window, masked_rows=degenerate,
             neg_inf_bias=degenerate)
    expected = [] if mask_form is not None else ["bwd"]
    assert gluon_calls == expected, f"Gluon launches: {gluon_calls}"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9, reason="needs sm90")
def test_gluon_backward_with_shared_bias_without_grad(gluon_calls):
    """A (Sq, Sk) bias shared by each KV group and not learned: the Gluon backward's consumers
    copy its tiles by TMA from the group's head (rows past Sq are the next head's)."""
    run_case(2, 255, 384, 4, 2, 128, torch.float16, "bhqs", torch.bool, "bkqs", causal=True,
             masked_rows=True, neg_inf_bias=True, bias_grad=False)
    assert gluon_calls == ["fwd", "bwd"], f"Gluon launches: {gluon_calls}"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9, reason="needs sm90")
def test_gluon_with_bias_in_another_dtype(gluon_calls):
    """An fp16 (Sq, Sk) bias with bf16 inputs: both Gluon passes copy its tiles by TMA as fp16
    (the backward into its bf16 dS buffer, reinterpreted); dbias comes back in fp16."""
    generator = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    q, k, v = random_qkv(2, 200, 256, 4, 2, 128, torch.bfloat16)
    mask = make_mask((2, 4, 200, 256), torch.bool, generator)
    bias = torch.randn((2, 4, 200, 256), generator=generator).to(DEVICE, torch.float16)
    _, _, grads = run_and_check(q, k, v, attn_mask=mask, attn_bias=bias.requires_grad_(),
                                causal=True)
    assert grads[3].dtype == torch.float16
    assert gluon_calls == ["fwd", "bwd"], f"Gluon launches: {gluon_calls}"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9, reason="needs sm90")
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(700, 600), (333, 520)], ids=str)
def test_gluon_full_bias_gradient_of_unvisited_tiles(gluon_calls, seqlen_q, seqlen_k):
    """The Gluon backward writes a full bias's gradient into an uninitialised (NaN-poisoned)
    buffer and zeroes the tiles its lists skip itself: whole tiles hidden by the mask inside
    the causal part (gaps in both the PARTIAL and the FULL lists), a FULL run past them, the
    causal part's hidden tiles, rows past Sq and keys past Sk."""
    generator = torch.Generator().manual_seed(8)
    torch.manual_seed(8)
    q, k, v = random_qkv(1, seqlen_q, seqlen_k, 4, 2, 128, torch.float16)
    keep = torch.rand(1, 4, seqlen_q, seqlen_k, generator=generator) < 0.8
    keep[..., 64:256, :256] = False  # hidden 64 x 128 tiles between listed ones
    keep[..., 320:, :128] = True  # FULL tiles after them
    bias = torch.randn(1, 4, seqlen_q, seqlen_k, generator=generator).to(DEVICE, torch.float16)
    _, _, grads = run_and_check(q, k, v, attn_mask=keep.to(DEVICE),
                                attn_bias=bias.requires_grad_(), causal=True)
    assert (grads[3][..., 64:256, :256] == 0).all()
    assert gluon_calls == ["fwd", "bwd"], f"Gluon launches: {gluon_calls}"


# (mask shape, bias shape) of packed sequences: t = total_q, h / k = H / Hk heads, s = max Sk
PACKED_FORMS = [("tks", "ths"), ("1ks", "1ks"), ("t1s", "t11"), (None, "tks"), ("tks", None)]


@pytest.mark.parametrize("mask_form, bias_form", PACKED_FORMS, ids=str)
def test_packed_mask_and_bias(mask_form, bias_form):
    """Varlen with an element mask and a bias in the seed's packed layout (row i's columns count
    from its sequence's first key), causal per sequence, a sequence of one query, rows that
    see no key; dbias in the bias's packed shape."""
    lengths_q, lengths_k = ([300, 1, 257], [411, 7, 200]) if GPU else ([17, 1, 30], [25, 3, 12])
    heads, heads_k = 4, 2
    sizes = {"t": sum(lengths_q), "h": heads, "k": heads_k, "s": max(lengths_k), "1": 1}
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32,
                               device=DEVICE) for n in (lengths_q, lengths_k))
    generator = torch.Generator().manual_seed(len(mask_form or "") + len(bias_form or ""))
    mask = bias = None
    if mask_form is not None:
        mask = make_mask(tuple(sizes[c] for c in mask_form), torch.bool, generator)
        if mask.shape[0] > 1:
            mask[:2] = False  # rows that see no key
    if bias_form is not None:
        bias = torch.randn(tuple(sizes[c] for c in bias_form), generator=generator)
        bias = bias.to(device=DEVICE, dtype=torch.float16).requires_grad_()
    torch.manual_seed(1)
    dtype = torch.bfloat16 if GPU else torch.float16
    q = torch.randn(sizes["t"], heads, 32, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lengths_k), heads_k, 32, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    if bias is not None:
        bias = bias.to(dtype).detach().requires_grad_()
    run_and_check(q, k, v, attn_mask=mask, attn_bias=bias, causal=True, cu_seqlens_q=cu_q,
                  cu_seqlens_k=cu_k)


def test_mask_tile_skipping():
    """Key tiles the mask hides are never loaded (NaN keys there do not leak), and the
    all-kept tiles are FULL: the schedule lists match the mask's tile picture."""
    from helpers import explicit_schedule

    from omniattn.backends.triton.configs import forward_config
    from omniattn.kernels.schedule import KernelArgs

    seqlen = 512 if GPU else 64
    tile = forward_config(64, torch.float16, masked=True)
    q, k, v = random_qkv(1, seqlen, seqlen, 2, 2, 64, torch.float16, requires_grad=False)
    n_k = seqlen // tile.block_n
    keep = torch.zeros(1, 1, seqlen, seqlen, dtype=torch.bool, device=DEVICE)
    keep[..., :, : tile.block_n] = True  # key tile 0: FULL everywhere
    keep[..., ::2, tile.block_n + 1] = True  # key tile 1: PARTIAL
    k[:, 2 * tile.block_n:] = float("nan")  # key tiles >= 2: hidden, never loaded
    v[:, 2 * tile.block_n:] = float("nan")
    out = omniattn.attention(q, k, v, attn_mask=keep)
    assert torch.isfinite(out).all()
    schedule, _ = explicit_schedule(q, k, KernelArgs.make(64, False, None, None, 0.0), keep)
    fwd = schedule.forward
    assert (fwd.full_num_blocks == 1).all() and (fwd.full_indices[..., 0] == 0).all()
    assert (fwd.num_blocks == 1).all() and (fwd.indices[..., 0] == 1).all()
    assert n_k > 2
    check_against_reference(out, omniattn.attention(q, k, v, attn_mask=keep, return_lse=True)[1],
                            None, q, k[:, :2 * tile.block_n], v[:, :2 * tile.block_n],
                            torch.zeros_like(q), attn_mask=keep[..., : 2 * tile.block_n])


def test_forward_without_gradients():
    """No gradient will flow (no_grad, or no input requiring one): only the forward's lists are
    built, and the output is the one a differentiable call gives."""
    from helpers import explicit_schedule

    from omniattn.kernels.schedule import KernelArgs

    seqlen = 300 if GPU else 40
    q, k, v = random_qkv(2, seqlen, seqlen + 7, 4, 2, 32, torch.float16)
    generator = torch.Generator().manual_seed(6)
    keep = (torch.rand(2, 1, seqlen, seqlen + 7, generator=generator) < 0.7).to(DEVICE)
    bias = torch.randn(2, 4, 1, seqlen + 7, generator=generator).to(DEVICE, torch.float16)
    args = KernelArgs.make(32, True, None, None, 0.0)
    schedule, _ = explicit_schedule(q, k, args, keep, bias, backward=False)
    assert schedule.dq.indices is schedule.forward.indices
    assert schedule.dkdv.indices is schedule.forward.indices
    with torch.no_grad():
        out, lse = omniattn.attention(q, k, v, causal=True, attn_mask=keep, attn_bias=bias,
                                      return_lse=True)
    assert torch.equal(out, omniattn.attention(q, k, v, causal=True, attn_mask=keep,
                                               attn_bias=bias))
    check_against_reference(out, lse, None, q, k, v, torch.zeros_like(q), causal=True,
                            attn_mask=keep, attn_bias=bias)


def exact_tile_states(visible: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    """int8 (..., nQ, nK) of a dense bool (..., Sq, Sk): FULL all visible, HIDDEN none."""
    seqlen_q, seqlen_k = visible.shape[-2:]
    n_m, n_n = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    padded = torch.zeros(*visible.shape[:-2], n_m * block_m, n_n * block_n, dtype=torch.int32)
    inside = torch.zeros_like(padded)
    padded[..., :seqlen_q, :seqlen_k] = visible.cpu().int()
    inside[..., :seqlen_q, :seqlen_k] = 1
    tiles = (*visible.shape[:-2], n_m, block_m, n_n, block_n)
    kept = padded.view(tiles).sum((-3, -1))
    total = inside.view(tiles).sum((-3, -1))
    return torch.where(kept == 0, 0, torch.where(kept == total, 2, 1)).to(torch.int8)


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, (20, 7))],
                         ids=["dense", "causal", "window"])
@pytest.mark.parametrize("form", ["bhqs", "1kqs", "b11s", "1kq1"])
@pytest.mark.parametrize("lengths", [(70, 90), (64, 96)], ids=["ragged", "even"])
@pytest.mark.parametrize("one_launch, row_elements", [(False, 256), (True, 256), (True, 16)],
                         ids=["two_launches", "one_launch", "one_launch_small_groups"])
def test_mask_schedule_is_sound(monkeypatch, form, causal, window, lengths, one_launch,
                                row_elements):
    """The device-built lists (pre-pass + list builder, tiles coarser than the pre-pass's): a
    listed FULL tile has every element visible, an unlisted tile none, and every tile whose
    elements are all visible is FULL (up to the ragged last tile of the listed dimension, which
    the kernels treat as PARTIAL). Even lengths: the pre-pass reads whole tiles unmasked.
    one_launch: `mask_forward_schedule`, whose pre-pass programs build the forward's lists
    (masks spanning (Sq, Sk)), a row by the last of its programs (16 keys a program: several
    tile groups per row)."""
    from helpers import predicate

    from omniattn.kernels import elementwise
    from omniattn.kernels.elementwise import (Elementwise, fine_tile_of, mask_forward_schedule,
                                              mask_tile_states, states_schedule)
    from omniattn.kernels.schedule import KernelArgs
    from omniattn.predicate import blocks_from_lists

    (batch, heads, heads_k), (seqlen_q, seqlen_k) = (2, 4, 2), lengths
    generator = torch.Generator().manual_seed(len(form) + causal)
    shape = elementwise_shape(form, batch, heads, heads_k, seqlen_q, seqlen_k)
    mask = make_mask(shape, torch.bool, generator, keep_fraction=0.97)
    mask[..., :32, :] = True  # FULL tiles
    if mask.shape[-1] > 1:
        mask[..., :, 48:64] = False  # HIDDEN tiles
    args = KernelArgs.make(32, causal, window, None, 0.0)
    tiles = ((32, 16), (16, 32), (32, 32))
    monkeypatch.setattr(elementwise, "MASK_ROW_ELEMENTS", row_elements)
    fine_tile = fine_tile_of(*tiles)  # the pre-pass reads the mask once, at the finest tile
    if one_launch:
        if not Elementwise.spans_both(mask):
            pytest.skip("one launch serves masks spanning (Sq, Sk)")
        schedule = mask_forward_schedule(Elementwise.of(mask, heads), fine_tile, seqlen_q,
                                         seqlen_k, args, tiles[0])
    else:
        fine = mask_tile_states(Elementwise.of(mask, heads), seqlen_q, seqlen_k, *fine_tile,
                                args)
        schedule = states_schedule(fine, fine_tile, seqlen_q, seqlen_k, args, *tiles)
    # lists keep the mask's heads (1kqs: one per KV head)
    visible = mask.expand(batch, -1, seqlen_q, seqlen_k) & predicate(seqlen_q, seqlen_k, causal,
                                                                      window)
    passes = [(schedule.forward, False)]
    if not one_launch:
        passes += [(schedule.dq, False), (schedule.dkdv, True)]
    for lists, transposed in passes:
        assert lists.num_blocks.shape[1] == lists.indices.shape[1] == mask.shape[1]
        exact = exact_tile_states(visible, lists.block_m, lists.block_n)
        n_rows, n_cols = exact.shape[-2:] if not transposed else exact.shape[-2:][::-1]
        pictures = [blocks_from_lists(num, idx, n_cols).cpu()
                    for num, idx in ((lists.num_blocks, lists.indices),
                                     (lists.full_num_blocks, lists.full_indices))]
        partial, full = (p.transpose(-1, -2) if transposed else p for p in pictures)
        partial, full = partial.expand_as(exact), full.expand_as(exact)
        assert not (partial & full).any()
        assert (exact[full] == 2).all(), "a FULL tile has a hidden element"
        assert (exact[~(partial | full)] == 0).all(), "an unlisted tile has a visible element"
        missed_full = (exact == 2) & ~full
        if not transposed and seqlen_k % lists.block_n:
            missed_full[..., -1] = False
        if transposed and seqlen_q % lists.block_m:
            missed_full[..., -1, :] = False
        assert not missed_full.any(), "an all-visible tile is not FULL"


@pytest.mark.parametrize("form", ["bhqs", "b1qs", "b11s"])
@pytest.mark.parametrize("lengths", [(70, 90), (128, 96)], ids=["ragged", "even"])
@pytest.mark.parametrize("row_elements", [64, 1024], ids=["2_tiles", "all_tiles"])
def test_mask_states_read_in_chunks(monkeypatch, form, lengths, row_elements):
    """The pre-pass stops reading a tile once it has seen a kept and a dropped element: tiles
    whose only dropped (or only kept) element is in their last row, or past their first chunk,
    must still come out exact; all-kept and all-dropped tiles are read whole. A program reads
    two neighbouring tiles (the last program's second past the mask), or every tile of a row."""
    from omniattn.kernels import elementwise
    from omniattn.kernels.elementwise import MASK_CHUNK_M, Elementwise, mask_tile_states
    from omniattn.kernels.schedule import KernelArgs

    monkeypatch.setattr(elementwise, "MASK_ROW_ELEMENTS", row_elements)
    (batch, heads), (seqlen_q, seqlen_k), block = (2, 2), lengths, (64, 32)
    assert block[0] > MASK_CHUNK_M  # several chunks per tile
    generator = torch.Generator().manual_seed(sum(lengths) + len(form))
    shape = elementwise_shape(form, batch, heads, heads, seqlen_q, seqlen_k)
    mask = torch.rand(shape, generator=generator) < 0.5  # PARTIAL tiles, decided early
    mask[..., :, :32] = True  # FULL tiles ...
    mask[..., :, 32:64] = False  # ... and HIDDEN ones
    if mask.shape[-2] > 1:
        mask[..., min(63, seqlen_q - 1), 31] = False  # dropped only in the tile's last row
        mask[..., MASK_CHUNK_M + 1, 40] = True  # kept only past the first chunk
    mask = mask.to(DEVICE)
    args = KernelArgs.make(32, False, None, None, 0.0)
    states = mask_tile_states(Elementwise.of(mask, heads), seqlen_q, seqlen_k, *block, args)
    assert torch.equal(states.cpu(), exact_tile_states(mask, *block))
    if mask.shape[-2] > 1:
        assert states[..., 0, 0].eq(1).all() and states[..., 0, 1].eq(1).all()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("left_window", [False, True])
def test_full_bias_gradient_outside_the_lists(monkeypatch, deterministic, left_window):
    """A full bias (one per query head, broadcast over the batch) under causal (or a causal
    window, which also hides key tiles left of it) and a mask with hidden tiles: its gradient
    buffer is zeroed only where the backward's lists never go (the dK/dV lists with atomic dQ,
    forced here when not deterministic, or the dQ lists); NaN-poisoned memory elsewhere must all
    be overwritten, and the hidden tiles come back 0."""
    replace_backward_configs(monkeypatch, atomic_dq=True)
    scale = 9 if GPU else 1
    # causal with 20 keys left of the diagonal: the last rows see no key tile of the first 24
    structure = dict(window=(20 * scale, 0)) if left_window else dict(causal=True)
    seqlen_q, seqlen_k = 37 * scale, 45 * scale
    generator = torch.Generator().manual_seed(21)
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 4, 2, 32, torch.float16)
    keep = torch.rand(2, 4, seqlen_q, seqlen_k, generator=generator) < 0.7
    keep[:, :, : 20 * scale, : 16 * scale] = False  # whole tiles hidden inside the causal part
    keep = keep.to(DEVICE)
    bias = torch.randn(1, 4, seqlen_q, seqlen_k, generator=generator).to(DEVICE, torch.float16)
    bias.requires_grad_()
    dout = torch.randn_like(q)
    out, lse = omniattn.attention(q, k, v, attn_mask=keep, attn_bias=bias,
                                  deterministic=deterministic, return_lse=True, **structure)
    grads = torch.autograd.grad(out, (q, k, v, bias), dout)
    assert (grads[3][..., : 20 * scale, : 16 * scale] == 0).all()
    check_against_reference(out, lse, grads, q, k, v, dout, attn_mask=keep, attn_bias=bias,
                            **structure)


@pytest.mark.parametrize("form", ["b1q1", "bhq1", "1k11", "11q1"])
@pytest.mark.parametrize("lse_loss", [False, True], ids=["out", "out+lse"])
def test_row_constant_bias_gradient_is_exact(form, lse_loss):
    """A bias with one column for all keys shifts each row's scores by a constant: the output
    does not depend on it, only lse does (d lse / d b = 1 on rows that see a key). Its gradient
    must be exact (0 from the output alone), not the sum of rounded per-key terms."""
    batch, heads, heads_k = 2, 4, 2
    seqlen_q, seqlen_k, head_dim = (333, 517, 128) if GPU else (37, 45, 32)
    dtype = torch.bfloat16 if GPU else torch.float16
    torch.manual_seed(3)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype)
    shape = elementwise_shape(form, batch, heads, heads_k, seqlen_q, seqlen_k)
    bias = torch.randn(shape, device=DEVICE, dtype=dtype, requires_grad=True)
    row_lens = torch.randint(0, seqlen_k + 1, (batch, seqlen_q), device=DEVICE,
                             dtype=torch.int32)
    row_lens[:, :3] = 0  # rows that see no key
    out, lse = omniattn.attention(q, k, v, attn_bias=bias, seqlens_k_per_row=row_lens,
                                  causal=True, return_lse=True)
    dlse = torch.randn_like(lse) if lse_loss else torch.zeros_like(lse)
    (dbias,) = torch.autograd.grad((out * torch.randn_like(out)).sum() + (lse * dlse).sum(),
                                   bias)
    # the exact value: dlse summed over the dims the bias broadcasts, on rows that see a key
    seen = row_lens.view(batch, 1, seqlen_q).expand(batch, heads, seqlen_q) > 0
    exact = torch.where(seen, dlse, 0.0).double()
    exact = exact.view(batch, shape[1], heads // shape[1], seqlen_q).sum(2)
    exact = exact.sum(-1, keepdim=True) if shape[2] == 1 else exact
    exact = exact.sum(0, keepdim=True) if shape[0] == 1 else exact
    exact = exact.unsqueeze(-1)
    assert dbias.shape == bias.shape
    error = (dbias.double() - exact).abs().max().item()
    assert error <= 1e-2 * exact.abs().max().item() + 1e-6, error
