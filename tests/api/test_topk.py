"""Top-k selection (issue #53): the rule of predicate.py and reference.topk_thresholds against a
brute-force float64 selection (integer-valued scores, so ties are everywhere), with every score
broadcast form and every other mask; attention(topk=...) on CPU against attention with the
brute-force keep mask, gradients included (the Triton kernels under the interpreter, the
reference without it); the plan; the top-k tile states."""
from __future__ import annotations

import pytest
import torch

import omniattn
from helpers import (DEVICE, GPU, brute_force_topk, check_against_reference, random_block_mask,
                     visible_keys)
from omniattn.kernels.elementwise import Elementwise, TopkTerm, topk_tile_states
from omniattn.predicate import (EVERY_TIE, FULL, HIDDEN, KEEP_ALL, order_keys,
                                select_thresholds, topk_keep)
from omniattn.reference import topk_thresholds

B, SQ, SK, H, HK = 2, 20, 37, 4, 2


def tied_scores(shape, seed, specials=False):
    """Integer-valued float scores in [-3, 3]; with `specials`, some NaN, +-inf and -0.0."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, shape, generator=generator).float()
    if specials:
        draw = torch.rand(shape, generator=generator)
        for value, low in ((float("nan"), 0.0), (float("inf"), 0.04), (float("-inf"), 0.08),
                           (-0.0, 0.12)):
            scores = torch.where((draw >= low) & (draw < low + 0.04), value, scores)
    return scores


def kept_by_pairs(scores, pairs, visible):
    """Bool (B, H, Sq, Sk): what threshold pairs (B, Hs, Sq|1) keep of `visible` (on the CPU)."""
    scores, visible = scores.cpu(), visible.cpu()
    batch, heads, seqlen_q, _ = visible.shape
    threshold, last_tie = (t.cpu().repeat_interleave(heads // t.shape[1], 1)
                           .expand(batch, heads, seqlen_q)
                           for t in (pairs.threshold, pairs.last_tie))
    keys = order_keys(spread_heads(scores, heads)).expand(visible.shape)
    return visible & topk_keep(keys, threshold, last_tie)


def spread_heads(t, heads):
    """(B|1, Hm, ...) -> (B|1, heads, ...): query head h reads head h // (heads / Hm)."""
    return t.repeat_interleave(heads // t.shape[1], 1)


def test_order_keys_order_scores_as_floats():
    values = [float("-inf"), -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, float("inf"), float("nan")]
    keys = order_keys(torch.tensor(values)).tolist()
    assert keys == sorted(keys) and keys[3] == keys[4]  # -0 = +0
    assert order_keys(torch.tensor([-float("nan")])).item() == keys[-1]  # any NaN ranks highest
    half = torch.tensor(values, dtype=torch.float16)
    assert torch.equal(order_keys(half), order_keys(half.float()))


def test_select_thresholds_small_rows():
    scores = torch.tensor([[3.0, 1.0, 3.0, 2.0, 3.0, 0.0]])
    visible = torch.tensor([[True, True, True, True, True, False]])
    keys = order_keys(scores)
    expected = {1: [0], 2: [0, 2], 3: [0, 2, 4], 4: [0, 2, 3, 4], 5: [0, 1, 2, 3, 4],
                9: [0, 1, 2, 3, 4]}
    for topk, kept in expected.items():
        threshold, last_tie = select_thresholds(keys, visible, topk)
        keep = topk_keep(keys, threshold, last_tie) & visible
        assert keep.nonzero()[:, 1].tolist() == kept, topk
    # a cut tie names its last kept key; no cut tie, or no selection, leaves EVERY_TIE
    assert select_thresholds(keys, visible, 2)[1].item() == 2
    assert select_thresholds(keys, visible, 3)[1].item() == EVERY_TIE
    assert select_thresholds(keys, visible, 5) == (KEEP_ALL, EVERY_TIE)


SCORE_FORMS = {  # name: shape
    "full": (B, H, SQ, SK), "per_key": (B, HK, 1, SK), "key_shared": (1, 1, 1, SK),
    "per_row": (B, H, SQ, 1), "scalar": (1, 1, 1, 1), "hk_full": (1, HK, SQ, SK),
}
MASKS = ["none", "causal", "window", "row_lens", "attn_mask", "key_mask", "causal_row_lens",
         "block_mask"]


def other_masks(kind, seed):
    """attention keywords of one mask kind, and the keys they leave visible (B, H, Sq, Sk)."""
    generator = torch.Generator().manual_seed(seed)
    options = {
        "none": {}, "causal": dict(causal=True), "window": dict(window=(6, 2)),
        "row_lens": dict(seqlens_k_per_row=torch.randint(0, SK + 1, (B, SQ), generator=generator,
                                                          dtype=torch.int32)),
        "attn_mask": dict(attn_mask=torch.rand(B, 1, SQ, SK, generator=generator) > 0.3),
        "key_mask": dict(attn_mask=torch.rand(B, H, 1, SK, generator=generator) > 0.3),
        "block_mask": dict(block_mask=random_block_mask(B, H, SQ, SK, 16, 0.6, seed)),
    }
    if kind == "causal_row_lens":
        options = dict(causal=True, seqlens_k_per_row=options["row_lens"]["seqlens_k_per_row"])
    else:
        options = options[kind]
    visible = visible_keys(B, H, SQ, SK, options.get("causal", False), options.get("window"),
                           options.get("attn_mask"), options.get("seqlens_k_per_row"),
                           options.get("block_mask"))
    return options, visible


@pytest.mark.parametrize("topk", [1, 5])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("form", list(SCORE_FORMS))
def test_thresholds_match_brute_force(form, mask, topk):
    seed = list(SCORE_FORMS).index(form) * len(MASKS) + MASKS.index(mask)
    scores = tied_scores(SCORE_FORMS[form], seed, specials=form == "full")
    options, visible = other_masks(mask, seed)
    visible = visible.cpu()
    # the thresholds where the call's tensors are; the brute force and the comparison on the CPU
    options = {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value
               for name, value in options.items()}
    q, k = torch.empty(B, SQ, H, 8, device=DEVICE), torch.empty(B, SK, HK, 8, device=DEVICE)
    pairs = topk_thresholds(q, k, topk, scores.to(DEVICE), chunk_size=7, **options)
    pairs = type(pairs)(pairs.threshold.cpu(), pairs.last_tie.cpu())
    expected = brute_force_topk(spread_heads(scores, H), visible, topk)
    assert torch.equal(kept_by_pairs(scores, pairs, visible), expected)
    assert torch.equal(expected.sum(-1), visible.sum(-1).clamp(max=topk))
    rows_shared = mask in ("none", "key_mask") and form not in ("full", "per_row", "hk_full")
    assert pairs.threshold.shape[-1] == (1 if rows_shared else SQ)


@pytest.mark.parametrize("topk", [SK, SK + 5])
def test_topk_of_every_key_keeps_every_visible_key(topk):
    scores = tied_scores((B, HK, 1, SK), 3)
    pairs = topk_thresholds(torch.empty(B, SQ, H, 8), torch.empty(B, SK, HK, 8), topk, scores,
                            causal=True)
    assert (pairs.threshold == KEEP_ALL).all() and (pairs.last_tie == EVERY_TIE).all()


def test_packed_thresholds_match_brute_force_per_sequence():
    cu_q = torch.tensor([0, 6, 6, 19], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 20, 33], dtype=torch.int32)
    scores = tied_scores((1, HK, 13), 4)  # packed per-key scores (1, Hm, max_k)
    pairs = topk_thresholds(torch.empty(19, H, 8), torch.empty(33, HK, 8), 3, scores,
                            causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert pairs.threshold.shape == (1, HK, 19)
    for i in (0, 2):
        q0, q1, k0, k1 = cu_q[i].item(), cu_q[i + 1].item(), cu_k[i].item(), cu_k[i + 1].item()
        per_key = scores[:, :, : k1 - k0][:, :, None]  # (1, Hk, 1, len_k)
        visible = visible_keys(1, HK, q1 - q0, k1 - k0, causal=True)
        part = type(pairs)(pairs.threshold[..., q0:q1], pairs.last_tie[..., q0:q1])
        assert torch.equal(kept_by_pairs(per_key, part, visible),
                           brute_force_topk(per_key, visible, 3))


# (dtype, causal, window, score form, bias form or None, mask kind, topk, H, Hk)
ATTENTION_CASES = [
    (torch.float16, True, None, None, (B, HK, 1, SK), "none", 5, H, HK),  # DMA: the key bias
    (torch.float32, False, (7, 3), (B, H, SQ, SK), (B, 1, SQ, SK), "row_lens", 4, H, HK),
    (torch.float16, True, None, (1, 1, 1, SK), (B, 1, SQ, 1), "attn_mask", 1, 4, 1),
    (torch.float32, False, None, (B, 1, SQ, 1), None, "block_mask", 6, H, H),
]


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"{c[0]}-{c[5]}-k{c[6]}"
                         .replace("torch.", ""))
def test_attention_topk_is_attention_with_the_selected_keys(case):
    """out, lse, dq, dk, dv (and dbias) of attention(topk=...) against the float64 oracle with
    the brute-force keep mask (2x plain PyTorch's error + atol)."""
    dtype, causal, window, score_shape, bias_shape, mask, topk, heads, heads_k = case
    torch.manual_seed(topk)
    q = torch.randn(B, SQ, heads, 16, dtype=dtype, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(B, SK, heads_k, 16, dtype=dtype, device=DEVICE, requires_grad=True)
            for _ in range(2))
    bias = None if bias_shape is None else \
        tied_scores(bias_shape, 5).to(DEVICE, dtype).requires_grad_()
    scores = tied_scores(score_shape, 6).to(DEVICE) if score_shape is not None else None
    options, visible = other_masks(mask, topk)
    options = {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value
               for name, value in options.items()}
    options.update(causal=causal, window=window)
    visible = visible.cpu() & visible_keys(B, heads, SQ, SK, causal, window).cpu()
    dout = torch.randn_like(q)
    out, lse = omniattn.attention(q, k, v, attn_bias=bias, topk=topk, topk_scores=scores,
                                  return_lse=True, **options)
    leaves = (q, k, v) if bias is None else (q, k, v, bias)
    grads = torch.autograd.grad(out, leaves, dout)
    selected_by = (scores if scores is not None else bias.detach()).float()
    keep = brute_force_topk(spread_heads(selected_by, heads).cpu(), visible, topk).to(DEVICE)
    check_against_reference(out, lse, grads, q, k, v, dout, attn_bias=bias, attn_mask=keep,
                            causal=causal, window=window)


def test_topk_scores_take_no_gradient_and_nan_is_kept():
    q, k, v = (torch.randn(1, 6, 2, 8, requires_grad=True) for _ in range(3))
    bias = torch.zeros(1, 2, 1, 6, requires_grad=True)
    scores = torch.tensor([0.0, 1.0, float("nan"), 2.0, 3.0, -1.0]).expand(1, 2, 1, 6) \
        .clone().requires_grad_()
    out = omniattn.attention(q, k, v, attn_bias=bias, topk=2, topk_scores=scores)
    out.sum().backward()
    assert scores.grad is None and bias.grad is not None
    # the NaN key is among every row's two; with a zero bias the output stays finite
    pairs = topk_thresholds(q, k, 2, scores.detach())
    kept = topk_keep(order_keys(scores.detach()), pairs.threshold, pairs.last_tie)
    assert kept[0, 0, 0].nonzero().flatten().tolist() == [2, 4]
    assert torch.isfinite(out).all()


def test_packed_attention_topk_matches_each_sequence():
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 8, 19], dtype=torch.int32)
    q, k, v = torch.randn(12, 4, 8), torch.randn(19, 2, 8), torch.randn(19, 2, 8)
    bias = tied_scores((1, 2, 11), 7)  # packed per-key (1, Hk, max_k)
    out = omniattn.attention(q, k, v, causal=True, attn_bias=bias, topk=3, cu_seqlens_q=cu_q,
                             cu_seqlens_k=cu_k)
    for i in range(2):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        per_key = bias[:, :, : ks.stop - ks.start].permute(1, 0, 2)[None]
        alone = omniattn.attention(q[None, qs], k[None, ks], v[None, ks], causal=True,
                                   attn_bias=per_key, topk=3)
        torch.testing.assert_close(out[qs], alone[0])


def test_explain_names_the_kernels_that_read_thresholds(monkeypatch):
    # a gradient: not split-KV decoding, which the 8 query rows would take without one
    q = torch.randn(1, 8, 2, 16, requires_grad=True)
    k, v = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    bias = torch.randn(1, 2, 1, 8)
    monkeypatch.setattr(omniattn.api, "uses_kernels", lambda q: True)  # as on a GPU
    plan = omniattn.explain(q, k, v, attn_bias=bias, topk=4)
    assert (plan.forward.kernel, plan.backward.kernel) == ("fwd", "bwd")
    decode = omniattn.explain(q.detach(), k, v, attn_bias=bias, topk=4)
    assert decode.forward.kernel == "fwd_decode" and decode.forward.refused == ()
    assert "top-k: each packed row keeps the keys of its own threshold pair" in str(decode)
    assert "explicit lists (top-k tile states)" in str(plan)
    assert "a Gluon forward that read them ran slower" in str(plan)
    # K at least Sk: nothing to select
    assert "top-k" not in str(omniattn.explain(q, k, v, attn_bias=bias, topk=8))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert "while torch.compile traces" in str(omniattn.explain(q, k, v, attn_bias=bias, topk=4))
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "CPU tensors run the exact PyTorch reference" in str(
        omniattn.explain(q, k, v, attn_bias=bias, topk=4))


@pytest.mark.parametrize("seed", range(4))
def test_topk_tile_states_never_hide_a_kept_key_nor_cut_a_full_tile(seed):
    """A HIDDEN tile holds no key any of its rows keeps; a FULL one only keys all its rows keep
    (visibility aside): per-key scores with long runs of equal values, so tiles of every kind
    occur."""
    generator = torch.Generator().manual_seed(seed)
    seqlen_q, seqlen_k, block_m, block_n = 45, 70, 8, 16
    runs = torch.randint(-4, 5, (B, HK, 1, seqlen_k // 10 + 1), generator=generator).float()
    scores = runs.repeat_interleave(10, -1)[..., :seqlen_k]
    pairs = topk_thresholds(torch.empty(B, seqlen_q, H, 1), torch.empty(B, seqlen_k, HK, 1), 9,
                            scores, causal=True)
    term = TopkTerm(Elementwise.of(scores, H), torch.stack((pairs.threshold, pairs.last_tie)))
    states = topk_tile_states(term, seqlen_q, seqlen_k, block_m, block_n)
    kept = topk_keep(order_keys(scores).expand(B, HK, seqlen_q, seqlen_k),
                     pairs.threshold, pairs.last_tie)  # (B, Hk, Sq, Sk)
    per_tile = torch.nn.functional.pad(kept, (0, 80 - seqlen_k, 0, 48 - seqlen_q)).float() \
        .view(B, HK, 48 // block_m, block_m, 80 // block_n, block_n)
    any_kept = per_tile.amax((3, 5)) > 0
    valid = torch.nn.functional.pad(torch.ones(seqlen_q, seqlen_k), (0, 80 - seqlen_k, 0,
                                                                     48 - seqlen_q))
    valid = valid.view(48 // block_m, block_m, 80 // block_n, block_n)
    all_kept = ((per_tile >= valid[None, None]).all(5).all(3))
    assert states.shape == (B, HK, 48 // block_m, 80 // block_n)
    assert not any_kept[states == HIDDEN].any()
    assert all_kept[states == FULL].all()
    assert (states == HIDDEN).any() and (states == FULL).any()


@pytest.mark.skipif(GPU, reason="the kernels under the interpreter")
@pytest.mark.parametrize("causal", [False, True])
def test_topk_decoding_computes_nothing_with_torch(causal):
    """A top-k decode step's own torch work is allocations and views alone (no fills, stack or
    value read on the host: no sync), all of it what a call plan records and replays; its out
    is that of attention with the brute-force keep mask."""
    from omniattn.runtime import call_plans, launch

    torch.manual_seed(7)
    seqlen, topk = 300, 40
    q = torch.randn(2, 1, 4, 16, dtype=torch.float16)
    k, v = (torch.randn(2, seqlen, 2, 16, dtype=torch.float16) for _ in range(2))
    bias = tied_scores((2, 2, 1, seqlen), 8).half()
    assert omniattn.explain(q, k, v, attn_bias=bias, topk=topk, causal=causal) \
        .forward.kernel == "fwd_decode"
    with launch.record_launches() as launches, call_plans._Recorder(launches) as recorder:
        out = omniattn.attention(q, k, v, attn_bias=bias, topk=topk, causal=causal)
    assert recorder.replayable
    keep = brute_force_topk(bias.float(), visible_keys(2, 2, 1, seqlen, causal=causal), topk)
    expected = omniattn.attention(q, k, v, attn_bias=bias,
                                  attn_mask=keep.repeat_interleave(2, 1), causal=causal)
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seqlen", [200, 1031])
def test_gpu_top_k_runs_the_triton_kernels(dtype, seqlen):
    """The DMA case on the GPU kernels: per-key scores = the key bias, causal, GQA; out, lse and
    every gradient against the oracle with the brute-force keep mask."""
    torch.manual_seed(seqlen)
    q = torch.randn(2, seqlen, 4, 64, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, seqlen, 2, 64, device="cuda", dtype=dtype, requires_grad=True)
            for _ in range(2))
    bias = tied_scores((2, 2, 1, seqlen), 3).to("cuda", dtype).requires_grad_()
    plan = omniattn.explain(q, k, v, causal=True, attn_bias=bias, topk=64)
    assert (plan.forward.kernel, plan.backward.kernel) == ("fwd", "bwd")
    out, lse = omniattn.attention(q, k, v, causal=True, attn_bias=bias, topk=64,
                                  return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, bias), dout)
    keep = brute_force_topk(bias.detach().float().cpu(),
                            visible_keys(2, 2, seqlen, seqlen, causal=True).cpu(), 64)
    check_against_reference(out, lse, grads, q, k, v, dout, attn_bias=bias,
                            attn_mask=keep.repeat_interleave(2, 1).cuda(), causal=True)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("form", ["per_query_head", "shared", "full"])
def test_gpu_top_k_scores_apart_from_the_bias(form):
    """Scores given apart from the bias (per query head, one row for all heads, or spanning
    (Sq, Sk)) with a window and no bias: the forward against the oracle."""
    torch.manual_seed(3)
    batch, seqlen, heads, heads_k = 2, 517, 4, 2
    q = torch.randn(batch, seqlen, heads, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen, heads_k, 128, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    shape = {"per_query_head": (batch, heads, 1, seqlen), "shared": (1, 1, 1, seqlen),
             "full": (batch, 1, seqlen, seqlen)}[form]
    scores = tied_scores(shape, 5).to("cuda", torch.float32)
    window = (300, 0)
    out, lse = omniattn.attention(q, k, v, window=window, topk=40, topk_scores=scores,
                                  return_lse=True)
    scores = scores.cpu().expand(batch, -1, seqlen, seqlen)
    visible = visible_keys(*scores.shape[:2], seqlen, seqlen, window=window)
    keep = brute_force_topk(scores, visible, 40)
    check_against_reference(out, lse, None, q, k, v, torch.zeros_like(out), window=window,
                            attn_mask=keep.expand(batch, heads, -1, -1).cuda())
