"""Split-KV decoding (backends/triton/decode.py) against the float64 reference: output and lse
of calls with a few query rows and no gradient, which `attention` plans as `fwd_decode`, over
contiguous caches and pages, with causal / window / per-row lengths / element masks / biases /
softcap / top-k, odd cache lengths, GQA ratios, rows that see no key and NaN inputs.

Without a GPU these run under TRITON_INTERPRET=1 (fp16 / fp32: the interpreter computes bf16
wrongly) at 16 x 16 tiles and 3 splits, so tiny caches cross several splits and the combine;
on a GPU the bf16 cases at decoding sizes run too. Uninitialised memory is NaN (torch's
deterministic mode): an element the kernels fail to write fails the test.
"""
from __future__ import annotations

from helpers import DEVICE, GPU, assert_close, brute_force_topk, case_id, visible_keys
import pytest
import torch

import omniattn
from omniattn.kernels.schedule import KernelArgs
from omniattn.passes import decode_forward
from omniattn.predicate import EVERY_TIE
from omniattn.reference import attention_reference, paged_reference, topk_thresholds
from test_mask_bias import elementwise_shape
from test_mask_bias import nan_poisoned_memory  # noqa: F401 (autouse fixture)


def paged_cache(k: torch.Tensor, v: torch.Tensor, page_size: int, seed: int, spare: int = 3):
    """k, v (B, Sk, Hk, D) as pages (num_pages, page_size, Hk, D) in a shuffled order, with
    `spare` pages no sequence lists and the tail of each sequence's last page NaN (a read of
    either fails the test), and the block table (B, cdiv(Sk, page_size)) int32."""
    batch, seqlen_k, heads_k, head_dim = k.shape
    per_seq = -(-seqlen_k // page_size)
    order = torch.randperm(batch * per_seq + spare, generator=torch.Generator().manual_seed(seed))
    order = order.to(k.device)

    def pages(t):
        padded = torch.nn.functional.pad(t, (0, 0, 0, 0, 0, per_seq * page_size - seqlen_k),
                                         value=float("nan"))
        cache = torch.full((batch * per_seq + spare, page_size, heads_k, head_dim),
                           float("nan"), dtype=t.dtype, device=t.device)
        cache[order[:batch * per_seq]] = padded.reshape(-1, page_size, heads_k, head_dim)
        return cache

    return pages(k), pages(v), order[:batch * per_seq].view(batch, per_seq).to(torch.int32)


def check_decode(q, k, v, **options):
    """attention(q, k, v, **options) is planned as fwd_decode and matches the float64
    reference within 2x plain PyTorch's error (per-sequence reference for pages / seqused_k)."""
    assert omniattn.explain(q, k, v, **options).forward.kernel == "fwd_decode"
    out, lse = omniattn.attention(q, k, v, return_lse=True, **options)
    tensors = ("attn_mask", "attn_bias", "seqlens_k_per_row", "block_table", "seqused_k")
    extra = {name: options.pop(name, None) for name in tensors}
    table, used = extra.pop("block_table"), extra.pop("seqused_k")
    exact = paged_reference(q.double(), k.double(), v.double(), table, used, return_lse=True,
                            **{n: t.double() if n == "attn_bias" and t is not None else t
                               for n, t in extra.items()}, **options)
    plain = paged_reference(q, k, v, table, used, return_lse=True, upcast=False, **extra,
                            **options)
    assert_close("out", out, exact[0], plain[0], q.dtype)
    assert_close("lse", lse, exact[1], plain[1], q.dtype)
    return out, lse


def qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    def randn(*shape):
        return torch.randn(shape, generator=generator, dtype=dtype).to(DEVICE)
    return (randn(batch, seqlen_q, heads, head_dim), randn(batch, seqlen_k, heads_k, head_dim),
            randn(batch, seqlen_k, heads_k, head_dim))


# (B, Sq, Sk, H, Hk, D, dtype, options): odd cache lengths, GQA 1 / 2 / 4 / 8, rows of several
# row tiles (Sq 16 x group 4), head dims padded to a power of two
SHAPES = [
    (2, 1, 77, 4, 1, 32, torch.float16, dict()),
    (1, 1, 129, 8, 1, 64, torch.float16, dict(causal=True)),
    (3, 1, 33, 2, 2, 16, torch.float32, dict(causal=True)),
    (1, 4, 50, 6, 3, 24, torch.float16, dict(causal=True)),
    (1, 16, 40, 4, 1, 32, torch.float16, dict(causal=True)),
    (2, 3, 61, 4, 2, 32, torch.float16, dict(window=(10, 2))),
    (1, 2, 90, 4, 2, 32, torch.float32, dict(causal=True, window=(25, -1), softcap=3.0)),
    (2, 1, 45, 4, 4, 32, torch.float16, dict(softcap=5.0, softmax_scale=0.3)),
]
if GPU:
    SHAPES += [
        (1, 1, 32768, 32, 8, 128, torch.bfloat16, dict()),
        (8, 1, 4099, 32, 8, 128, torch.bfloat16, dict(causal=True)),
        (3, 4, 5000, 32, 8, 128, torch.bfloat16, dict(causal=True, window=(700, -1))),
        (2, 1, 3000, 16, 16, 64, torch.float16, dict(softcap=20.0)),
        (2, 2, 2500, 8, 1, 256, torch.bfloat16, dict(causal=True)),
    ]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", SHAPES, ids=case_id)
def test_decode_shapes(case):
    *shape, dtype, options = case
    check_decode(*qkv(*shape, dtype, seed=sum(shape)), **options)


@pytest.mark.interpreter
@pytest.mark.parametrize("form", ["b1qs", "bk1s", "111s", "bhqs"])
def test_decode_key_bias_and_mask(form):
    batch, seqlen_q, seqlen_k, heads, heads_k = 2, 2, 53, 4, 2
    q, k, v = qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 32, torch.float16, seed=7)
    sizes = {"b": batch, "h": heads, "k": heads_k, "q": seqlen_q, "s": seqlen_k, "1": 1}
    shape = tuple(sizes[c] for c in form)
    generator = torch.Generator().manual_seed(8)
    bias = torch.randn(shape, generator=generator, dtype=torch.float16).to(DEVICE)
    mask = (torch.rand(shape, generator=generator) < 0.7).to(DEVICE)
    check_decode(q, k, v, attn_bias=bias, causal=True)
    check_decode(q, k, v, attn_mask=mask, attn_bias=bias)


@pytest.mark.interpreter
def test_decode_per_row_lengths():
    q, k, v = qkv(2, 3, 47, 4, 2, 32, torch.float16, seed=3)
    lens = torch.tensor([[0, 20, 47], [5, 33, 1]], dtype=torch.int32, device=DEVICE)
    out, lse = check_decode(q, k, v, seqlens_k_per_row=lens, causal=True)
    assert (out[0, 0] == 0).all() and (lse[0, :, 0] == -float("inf")).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_decode_pages(page_size):
    batch, seqlen_q, seqlen_k, heads, heads_k = 3, 2, 300, 4, 2
    q, k, v = qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 32, torch.float16, seed=page_size)
    k_pages, v_pages, table = paged_cache(k, v, page_size, seed=page_size)
    generator = torch.Generator().manual_seed(page_size)
    used = torch.tensor([300, 17, 161], dtype=torch.int32, device=DEVICE)
    bias = torch.randn(batch, heads_k, 1, table.shape[1] * page_size,
                       generator=generator).to(DEVICE, torch.float16)
    check_decode(q, k_pages, v_pages, block_table=table, seqused_k=used, causal=True,
                 attn_bias=bias)
    # the same keys through a contiguous cache with spare keys
    contiguous = check_decode(q, k, v, seqused_k=used, causal=True)
    paged = omniattn.attention(q, k_pages, v_pages, block_table=table, seqused_k=used,
                               causal=True, return_lse=True)
    torch.testing.assert_close(paged, contiguous, atol=1e-3, rtol=1e-3)


@pytest.mark.interpreter
def test_decode_rows_that_see_no_key():
    """A sequence using no key, rows before the cache's first key (causal, Sq > used), and a
    window past every key: output 0, lse -inf."""
    q, k, v = qkv(3, 4, 40, 4, 2, 16, torch.float16, seed=11)
    used = torch.tensor([0, 2, 40], dtype=torch.int32, device=DEVICE)
    out, lse = check_decode(q, k, v, seqused_k=used, causal=True)
    assert (out[0] == 0).all() and (lse[0] == -float("inf")).all()
    assert (out[1, :2] == 0).all() and (lse[1, :, :2] == -float("inf")).all()
    assert torch.isfinite(out[2]).all() and torch.isfinite(lse[2]).all()
    out, lse = check_decode(q, k, v, window=(-1, 0), attn_mask=torch.zeros(1, 1, 1, 40,
                                                                          dtype=torch.bool,
                                                                          device=DEVICE))
    assert (out == 0).all() and (lse == -float("inf")).all()


@pytest.mark.interpreter
def test_decode_nan_reaches_the_rows_that_see_it():
    q, k, v = qkv(2, 2, 50, 4, 2, 16, torch.float16, seed=5)
    q[0, 1, 3] = float("nan")  # batch 0, row 1, query head 3
    k[1, 10, 0] = float("nan")  # batch 1, key 10 of KV head 0 (query heads 0, 1)
    out, lse = omniattn.attention(q, k, v, causal=True, return_lse=True)
    nan_out = torch.isnan(out).any(-1)  # (B, Sq, H)
    expected = torch.zeros_like(nan_out)
    expected[0, 1, 3] = True
    expected[1, :, :2] = True  # both rows see key 10
    assert torch.equal(nan_out, expected)
    assert torch.equal(torch.isnan(lse).transpose(1, 2), expected)


@pytest.mark.interpreter
@pytest.mark.parametrize("splits", [1, 2, 7])
def test_decode_split_counts_agree(splits):
    """One split writes out / lse directly; several merge partials: the same result."""
    q, k, v = qkv(2, 2, 70, 4, 2, 32, torch.float32, seed=2)
    args = KernelArgs.make(32, True, None, None, 0.0)
    out, lse = decode_forward(q, k, v, args, num_splits=splits)
    exact = paged_reference(q.double(), k.double(), v.double(), causal=True, return_lse=True)
    torch.testing.assert_close(out.double(), exact[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), exact[1].double(), atol=1e-5, rtol=1e-5)


TOPK_IN_PLAN = "top-k: each packed row keeps the keys of its own threshold pair"


def scores_of(form, batch, seqlen_q, seqlen_k, heads, heads_k, seed, dtype=torch.float32,
              ties=True):
    """Top-k scores of `form` (elementwise_shape's letters): integer-valued in [-3, 3] (every
    value tied many times) with `ties`, else normal."""
    shape = elementwise_shape(form, batch, heads, heads_k, seqlen_q, seqlen_k)
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, shape, generator=generator).float() if ties \
        else torch.randn(shape, generator=generator)
    return scores.to(DEVICE, dtype)


def check_topk_decode(q, k, v, topk, scores, **options):
    """check_decode of attention(q, k, v, topk=topk, topk_scores=scores, **options), which the
    plan gives split-KV decoding with its top-k term."""
    plan = omniattn.explain(q, k, v, topk=topk, topk_scores=scores, **options)
    assert plan.forward.kernel == "fwd_decode" and TOPK_IN_PLAN in plan.forward.schedule
    return check_decode(q, k, v, topk=topk, topk_scores=scores, **options)


# (B, Sq, Sk, H, Hk, D, dtype, topk, scores form ("bias": none given, attn_bias (B, Hk, 1, Sk)
# selects), options): per-key scores per KV head (one row per tile), per query head, shared by
# every head; per-row scores; K = 1; K at least every row's visible keys (30-key window) but
# below Sk; GQA 4:1 and 1:1; odd cache lengths, 1000 keys
TOPK_CASES = [
    (2, 1, 301, 8, 2, 32, torch.float16, 17, "bk1s", dict()),
    (2, 3, 301, 8, 2, 32, torch.float32, 9, "bh1s", dict(causal=True)),
    (1, 3, 257, 4, 1, 16, torch.float16, 1, "111s", dict(window=(100, 0))),
    (2, 3, 99, 8, 2, 32, torch.float16, 40, "bias", dict(causal=True, window=(30, -1))),
    (2, 1, 150, 8, 2, 32, torch.float32, 12, "bias", dict(softcap=5.0)),
    (2, 3, 150, 8, 2, 32, torch.float32, 5, "bhqs", dict(causal=True)),
    (2, 3, 121, 4, 4, 32, torch.float16, 7, "b1qs", dict(window=(50, 2))),
    (1, 1, 1003, 8, 2, 64, torch.float16, 64, "bk1s", dict(causal=True)),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", TOPK_CASES, ids=case_id)
def test_decode_topk(case):
    batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, topk, form, options = case
    seed = TOPK_CASES.index(case)
    q, k, v = qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, seed=seed)
    if form == "bias":
        bias = scores_of("bk1s", batch, seqlen_q, seqlen_k, heads, heads_k, seed, dtype)
        check_topk_decode(q, k, v, topk, None, attn_bias=bias, **options)
    else:
        scores = scores_of(form, batch, seqlen_q, seqlen_k, heads, heads_k, seed)
        check_topk_decode(q, k, v, topk, scores, **options)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_topk_ties_go_to_the_lower_key(dtype):
    """Integer-valued per-key scores with ties cut at every row's threshold: the output is
    attention over exactly the brute-force selection (ties to the lower key index), per query
    head (scores (B, H, 1, Sk), GQA 4:1), with causal rows."""
    batch, seqlen_q, seqlen_k, heads, heads_k, topk = 2, 3, 77, 8, 2, 10
    q, k, v = qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 32, dtype, seed=21)
    generator = torch.Generator().manual_seed(21)
    scores = torch.randint(-2, 3, (batch, heads, 1, seqlen_k), generator=generator).float()
    scores = scores.to(DEVICE)
    pairs = topk_thresholds(q, k, topk, scores, causal=True)
    assert (pairs.last_tie != EVERY_TIE).all()  # every row cuts a tie: the rule decides
    plan = omniattn.explain(q, k, v, causal=True, topk=topk, topk_scores=scores)
    assert plan.forward.kernel == "fwd_decode"
    out, lse = omniattn.attention(q, k, v, causal=True, topk=topk, topk_scores=scores,
                                  return_lse=True)
    visible = visible_keys(batch, heads, seqlen_q, seqlen_k, causal=True).cpu()
    keep = brute_force_topk(scores.cpu(), visible, topk).to(DEVICE)
    exact = attention_reference(q.double(), k.double(), v.double(), attn_mask=keep,
                                causal=True, return_lse=True)
    plain = attention_reference(q, k, v, attn_mask=keep, causal=True, return_lse=True,
                                upcast=False)
    assert_close("out", out, exact[0], plain[0], dtype)
    assert_close("lse", lse, exact[1], plain[1], dtype)


@pytest.mark.interpreter
def test_decode_topk_per_row_lengths():
    """Per-row key lengths narrow what each row selects among; a row seeing no key keeps none:
    output 0, lse -inf."""
    q, k, v = qkv(2, 3, 47, 8, 2, 32, torch.float16, seed=3)
    lens = torch.tensor([[0, 20, 47], [5, 33, 1]], dtype=torch.int32, device=DEVICE)
    scores = scores_of("bk1s", 2, 3, 47, 8, 2, seed=3)
    out, lse = check_topk_decode(q, k, v, 4, scores, seqlens_k_per_row=lens, causal=True)
    assert (out[0, 0] == 0).all() and (lse[0, :, 0] == -float("inf")).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("form", ["b11s", "bhqs"])
def test_decode_topk_with_an_element_mask(form):
    """The keys an element mask hides are not selected (a row keeps its K best among those it
    may see); per-key scores, a key bias beside them."""
    batch, seqlen_q, seqlen_k, heads, heads_k = 2, 3, 90, 8, 2
    q, k, v = qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 32, torch.float16, seed=31)
    generator = torch.Generator().manual_seed(31)
    shape = elementwise_shape(form, batch, heads, heads_k, seqlen_q, seqlen_k)
    mask = (torch.rand(shape, generator=generator) < 0.5).to(DEVICE)
    bias = torch.randn(batch, heads_k, 1, seqlen_k, generator=generator).to(DEVICE, q.dtype)
    scores = scores_of("bk1s", batch, seqlen_q, seqlen_k, heads, heads_k, seed=31)
    check_topk_decode(q, k, v, 6, scores, attn_mask=mask, attn_bias=bias, causal=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("page_size", [16, 64])
def test_decode_topk_pages(page_size):
    """Pages and partly used caches: each sequence selects among its first seqused_k keys
    (causal / window aligned to them), its scores cut to them; one sequence uses fewer keys
    than it keeps."""
    batch, seqlen_q, seqlen_k, heads, heads_k = 3, 3, 300, 8, 2
    q, k, v = qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 32, torch.float16, seed=page_size)
    k_pages, v_pages, table = paged_cache(k, v, page_size, seed=page_size)
    used = torch.tensor([300, 8, 161], dtype=torch.int32, device=DEVICE)
    capacity = table.shape[1] * page_size
    scores = scores_of("bk1s", batch, seqlen_q, capacity, heads, heads_k, seed=page_size)
    check_topk_decode(q, k_pages, v_pages, 10, scores, block_table=table, seqused_k=used,
                      causal=True)
    # spare keys of a contiguous cache, per-row scores per query head (the radix select)
    scores = scores_of("bhqs", batch, seqlen_q, seqlen_k, heads, heads_k, seed=page_size)
    check_topk_decode(q, k, v, 10, scores, seqused_k=used, window=(60, 0))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_decode_pages_gpu(page_size):
    batch, seqlen_q, seqlen_k, heads, heads_k = 4, 1, 20000, 32, 8
    q, k, v = qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16, seed=1)
    k_pages, v_pages, table = paged_cache(k, v, page_size, seed=page_size)
    generator = torch.Generator().manual_seed(page_size)
    used = torch.tensor([20000, 1, 9999, 4096], dtype=torch.int32, device=DEVICE)
    bias = torch.randn(batch, heads_k, 1, table.shape[1] * page_size,
                       generator=generator).to(DEVICE, torch.bfloat16)
    check_decode(q, k_pages, v_pages, block_table=table, seqused_k=used, attn_bias=bias,
                 causal=True)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("form", ["bk1s", "bh1s"])
def test_decode_topk_pages_gpu(form):
    """Issue #55's case at decoding sizes: top-k over per-key scores of paged, partly used
    caches (bf16, GQA 4:1, one and four query rows, causal), several splits per sequence."""
    batch, seqlen_k, heads, heads_k = 4, 20000, 32, 8
    for seqlen_q in (1, 4):
        q, k, v = qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16,
                      seed=seqlen_q)
        k_pages, v_pages, table = paged_cache(k, v, 256, seed=seqlen_q)
        used = torch.tensor([20000, 1, 9999, 4096], dtype=torch.int32, device=DEVICE)
        scores = scores_of(form, batch, seqlen_q, table.shape[1] * 256, heads, heads_k,
                           seed=seqlen_q, dtype=torch.bfloat16, ties=False)
        check_topk_decode(q, k_pages, v_pages, 2048, scores, block_table=table, seqused_k=used,
                          causal=True)


@pytest.mark.interpreter
def test_decode_under_torch_compile_fullgraph():
    """A paged decode step traces whole (the decode op, unchecked inputs) and gives eager's."""
    q, k, v = qkv(2, 1, 64, 4, 2, 32, torch.float16 if not GPU else torch.bfloat16, seed=9)
    k_pages, v_pages, table = paged_cache(k, v, 16, seed=9)
    used = torch.tensor([64, 20], dtype=torch.int32, device=DEVICE)

    def step(q, k_pages, v_pages, table, used):
        return omniattn.attention(q, k_pages, v_pages, block_table=table, seqused_k=used,
                                  causal=True, check_inputs=False)

    compiled = torch.compile(step, fullgraph=True)
    assert torch.equal(compiled(q, k_pages, v_pages, table, used),
                       step(q, k_pages, v_pages, table, used))
