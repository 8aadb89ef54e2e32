"""Block-Sparse-Attention façade against a float64 reference whose masks are built element by
element from the original's definitions: every head type alone and mixed, causal or not, block
and token streaming, block dims 16 / 32 / 16x32, varlen with unequal lengths (a length-1
sequence, Sq != Sk), GQA, rows that see no key, the return convention and bad arguments."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import DEVICE, GPU, assert_close, oracle
from omniattn.compat import (block_sparse_attn_func, block_streaming_attn_func,
                             token_streaming_attn_func)


def visibility(head_mask_type, streaming_info, base_blockmask, lengths_q, lengths_k, causal,
               exact_streaming, block_m, block_n):
    """Per sequence, bool (H, Sq_b, Sk_b): which key each query sees, from the original's rules."""
    kinds = list(head_mask_type)
    per_sequence = []
    for b, (seqlen_q, seqlen_k) in enumerate(zip(lengths_q, lengths_k)):
        i = torch.arange(seqlen_q)[:, None]
        j = torch.arange(seqlen_k)[None, :]
        offset = seqlen_k - seqlen_q
        below_diagonal = j <= i + offset if causal else torch.ones(seqlen_q, seqlen_k, dtype=bool)
        heads, ones_seen = [], 0
        for h, kind in enumerate(kinds):
            if kind == 0:
                keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
            elif kind > 0:
                # the original numbers the entries equal to 1 in head order
                ones_seen += kind == 1
                mask = base_blockmask[b, (ones_seen if kind == 1 else kind) - 1].cpu()
                keep = mask[i // block_m, j // block_n] != 0
            else:
                sink, local = streaming_info[2 * h], streaming_info[2 * h + 1]
                if exact_streaming:
                    keep = (j < sink) | (j > i + offset - local)
                else:
                    key_block = j // block_n
                    if causal:
                        # the key block of the diagonal of the query block's last row
                        last_row = torch.clamp((i // block_m + 1) * block_m, max=seqlen_q) - 1
                        diagonal = torch.div(last_row + offset, block_n, rounding_mode="floor")
                    else:
                        diagonal = (seqlen_k - 1) // block_n
                    keep = (key_block < sink) | ((key_block <= diagonal)
                                                 & (key_block > diagonal - local))
            heads.append(keep & below_diagonal)
        per_sequence.append(torch.stack(heads))
    return per_sequence


def check_facade(out, lse, grads, q, k, v, dout, cu_q, cu_k, visible, softmax_scale=None):
    """Output, lse and dq/dk/dv against float64 attention run per sequence with its dense mask;
    rows that see no key must give 0 output, lse -inf and finite gradients."""
    exact, plain = [], []
    for b, keep in enumerate(visible):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        pair = oracle(q[rows][None], k[keys][None], v[keys][None], dout[rows][None],
                      attn_mask=keep[None].to(q.device), softmax_scale=softmax_scale)
        exact.append(pair[0])
        plain.append(pair[1])

    def joined(results, index):
        dim = -1 if index == 1 else 0  # lse is (H, total_q), the rest (total, heads, D)
        return torch.cat([r[index][0] for r in results], dim=dim)

    dtype = q.dtype
    for index, (name, got) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads))):
        expected = joined(exact, index)
        assert got.shape == expected.shape, f"{name}: {tuple(got.shape)} != {tuple(expected.shape)}"
        compare_dtype = torch.float32 if name == "lse" and dtype == torch.float32 else dtype
        assert_close(name, got, expected, joined(plain, index), compare_dtype)
    empty_rows = torch.cat([~keep.any(-1) for keep in visible], dim=-1).to(q.device)  # (H, total_q)
    assert (out.transpose(0, 1)[empty_rows] == 0).all()
    assert torch.isneginf(lse[empty_rows]).all()
    assert all(torch.isfinite(g).all() for g in grads)
    return int(empty_rows.sum())


def packed_inputs(lengths_q, lengths_k, heads, heads_k, head_dim, dtype, seed):
    torch.manual_seed(seed)
    q = torch.randn(sum(lengths_q), heads, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(sum(lengths_k), heads_k, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    cu_q = [0, *torch.tensor(lengths_q).cumsum(0).tolist()]
    cu_k = [0, *torch.tensor(lengths_k).cumsum(0).tolist()]
    return ([t.requires_grad_() for t in (q, k, v)], torch.randn_like(q), cu_q, cu_k)


def int_tensor(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def random_blockmask(batch, n_masks, n_q_blocks, n_k_blocks, seed):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, n_masks, n_q_blocks, n_k_blocks, generator=generator) < 0.5
    mask[:, :, 0, 0] = True
    if n_q_blocks > 1:
        mask[0, 0, 1] = False  # a query block of the first block-sparse head that sees nothing
    return mask.to(DEVICE)


BLOCK_CASES = [
    # lengths q, lengths k, H, Hk, D, dtype, (m_block_dim, n_block_dim), head_mask_type,
    # is_causal, exact_streaming
    ([1, 37, 20], [9, 37, 45], 4, 2, 32, torch.float16, (16, 16), [1, 0, -1, 1], True, False),
    ([30, 50], [50, 21], 4, 4, 16, torch.float32, (32, 32), [-1, 1, 1, 0], False, False),
    ([40, 33], [64, 17], 4, 2, 16, torch.float16, (16, 32), [-1, 1, 0, -1], True, False),
    ([25, 48], [48, 48], 4, 2, 32, torch.float16, (16, 16), [1, -1, 0, -1], True, True),
    ([19, 40], [40, 40], 2, 1, 16, torch.float16, (16, 16), [0, 0], True, False),
    ([45, 8], [45, 30], 2, 1, 16, torch.float16, (16, 16), [-1, -1], True, False),
    ([45, 8], [45, 30], 2, 2, 16, torch.float16, (16, 16), [-1, -1], False, False),
    ([33, 20], [50, 20], 2, 1, 16, torch.float16, (32, 16), [1, 1], False, False),
]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: "-".join(
    map(str, (c[7], "causal" if c[8] else "full", "exact" if c[9] else "blocks", *c[6],
              c[5]))).replace("torch.", "").replace(" ", ""))
def test_block_sparse_attn_func(case):
    (lengths_q, lengths_k, heads, heads_k, head_dim, dtype, (block_m, block_n), head_mask_type,
     causal, exact) = case
    (q, k, v), dout, cu_q, cu_k = packed_inputs(lengths_q, lengths_k, heads, heads_k, head_dim,
                                                dtype, seed=len(lengths_q) + heads)
    max_q, max_k = max(lengths_q), max(lengths_k)
    n_masks = head_mask_type.count(1)
    base_blockmask = random_blockmask(len(lengths_q), n_masks, math.ceil(max_q / block_m),
                                      math.ceil(max_k / block_n), seed=heads) if n_masks else None
    # in blocks, or in tokens for exact streaming
    streaming_info = [3, 9, 0, 14, 1, 5, 5, 1][:2 * heads] if exact else \
        [1, 1, 0, 2, 2, 1, 0, 1][:2 * heads]
    out, lse, probs = block_sparse_attn_func(
        q, k, v, int_tensor(cu_q), int_tensor(cu_k), int_tensor(head_mask_type),
        int_tensor(streaming_info), base_blockmask, max_q, max_k, 0.0, is_causal=causal,
        exact_streaming=exact, return_attn_probs=True, m_block_dim=block_m, n_block_dim=block_n)
    assert probs is None and lse.dtype == torch.float32
    grads = torch.autograd.grad(out, (q, k, v), dout)
    visible = visibility(head_mask_type, streaming_info, base_blockmask, lengths_q, lengths_k,
                         causal, exact, block_m, block_n)
    empty = check_facade(out, lse, grads, q, k, v, dout, cu_q, cu_k, visible)
    if n_masks and max_q > block_m:
        assert empty > 0  # the query block hidden by random_blockmask


def test_token_streaming_attn_func():
    lengths_q, lengths_k = [1, 60, 35], [70, 60, 35]
    (q, k, v), dout, cu_q, cu_k = packed_inputs(lengths_q, lengths_k, 4, 2, 32, torch.float16, 3)
    head_mask_type, streaming_info = [-1, 0, -1, -1], [4, 16, 0, 0, 0, 1, 9, 30]
    out, lse, _ = token_streaming_attn_func(
        q, k, v, int_tensor(cu_q), int_tensor(cu_k), int_tensor(head_mask_type),
        int_tensor(streaming_info), max(lengths_q), max(lengths_k), softmax_scale=0.3,
        return_attn_probs=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    visible = visibility(head_mask_type, streaming_info, None, lengths_q, lengths_k, True, True,
                         128, 128)
    check_facade(out, lse, grads, q, k, v, dout, cu_q, cu_k, visible, softmax_scale=0.3)


def test_block_streaming_attn_func_uses_blocks_of_128():
    lengths_q, lengths_k = [130, 1], [160, 130]
    (q, k, v), dout, cu_q, cu_k = packed_inputs(lengths_q, lengths_k, 2, 1, 16, torch.float16, 4)
    head_mask_type, streaming_info = [-1, 0], [0, 1, 0, 0]
    out = block_streaming_attn_func(q, k, v, int_tensor(cu_q), int_tensor(cu_k),
                                    int_tensor(head_mask_type), int_tensor(streaming_info),
                                    max(lengths_q), max(lengths_k), 0.0)
    out_lse = block_sparse_attn_func(q, k, v, int_tensor(cu_q), int_tensor(cu_k),
                                     int_tensor(head_mask_type), int_tensor(streaming_info), None,
                                     max(lengths_q), max(lengths_k), 0.0, is_causal=True,
                                     return_attn_probs=True)
    assert torch.equal(out, out_lse[0])
    grads = torch.autograd.grad(out, (q, k, v), dout)
    visible = visibility(head_mask_type, streaming_info, None, lengths_q, lengths_k, True, False,
                         128, 128)
    check_facade(out, out_lse[1], grads, q, k, v, dout, cu_q, cu_k, visible)


def original_block_diagonal(query_block, seqlen_q, seqlen_k, block):
    """The original's causal streaming diagonal (block m == n): its last local key block."""
    start_row = max((seqlen_q - seqlen_k) // block, 0)
    return -(-max(seqlen_k - seqlen_q, 0) // block) + query_block - start_row


def test_block_streaming_diagonal_is_the_originals_on_full_query_blocks():
    """The documented rule (the key block of the diagonal of the query block's last row) equals
    the original's formula except on a partial last query block of a sequence with Sq != Sk."""
    block = 16
    differ = 0
    for seqlen_q in range(1, 70):
        for seqlen_k in range(1, 70):
            for query_block in range(math.ceil(seqlen_q / block)):
                original = original_block_diagonal(query_block, seqlen_q, seqlen_k, block)
                last_row = min((query_block + 1) * block, seqlen_q) - 1
                ours = (last_row + seqlen_k - seqlen_q) // block
                if (query_block + 1) * block <= seqlen_q or seqlen_q == seqlen_k:
                    assert ours == original, (seqlen_q, seqlen_k, query_block)
                else:
                    assert ours in (original, original - 1)
                    differ += ours != original
    assert differ > 0


def test_dropout_is_seeded_and_applied():
    lengths = [20, 12]
    (q, k, v), dout, cu_q, cu_k = packed_inputs(lengths, lengths, 2, 2, 16, torch.float32, 5)
    args = (q, k, v, int_tensor(cu_q), int_tensor(cu_k), int_tensor([0, 1]), None,
            torch.ones(2, 1, 2, 2, dtype=torch.bool, device=DEVICE), 20, 20)
    torch.manual_seed(0)
    first = block_sparse_attn_func(*args, 0.5, m_block_dim=16, n_block_dim=16)
    torch.manual_seed(0)
    again = block_sparse_attn_func(*args, 0.5, m_block_dim=16, n_block_dim=16)
    plain = block_sparse_attn_func(*args, 0.0, m_block_dim=16, n_block_dim=16)
    assert torch.equal(first, again) and not torch.allclose(first, plain)


def _bad_arguments():
    q = torch.randn(10, 2, 16, device=DEVICE, dtype=torch.float16)
    k = v = torch.randn(12, 2, 16, device=DEVICE, dtype=torch.float16)
    cu_q, cu_k = int_tensor([0, 4, 10]), int_tensor([0, 6, 12])
    mask = torch.ones(2, 1, 1, 1, dtype=torch.bool, device=DEVICE)
    good = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                head_mask_type=int_tensor([1, -1]), streaming_info=int_tensor([0, 1, 1, 1]),
                base_blockmask=mask, max_seqlen_q_=6, max_seqlen_k_=6, p_dropout=0.0,
                m_block_dim=16, n_block_dim=16)
    return good, [
        (dict(head_mask_type=int_tensor([1, -1, 0])), ValueError,
         r"head_mask_type must have shape \(2,\)"),
        (dict(head_mask_type=torch.tensor([1.0, 0.0])), TypeError,
         "head_mask_type must have an integer dtype"),
        (dict(base_blockmask=torch.ones(2, 1, 2, 1, dtype=torch.bool, device=DEVICE)), ValueError,
         r"base_blockmask has shape \(2, 1, 2, 1\); expected \(B=2, n_blocksparse_heads, "),
        (dict(base_blockmask=torch.ones(2, 2, 1, 1, dtype=torch.bool, device=DEVICE)), ValueError,
         "base_blockmask has 2 masks in dim 1"),
        (dict(base_blockmask=None), ValueError, r"^head_mask_type\[0\] = 1 is a block-sparse head "
         r"\(values > 0\) but block_sparse_attn_func got no base_blockmask"),
        (dict(base_blockmask=mask.float()), TypeError, "base_blockmask must be bool or integer"),
        (dict(head_mask_type=int_tensor([1, 3])), ValueError,
         r"^head_mask_type\[1\] = 3 refers to mask 3 \(after numbering the entries equal to 1\), "
         r"but base_blockmask has 1$"),
        (dict(m_block_dim=24), ValueError, "m_block_dim must be a positive multiple of 16, got 24"),
        (dict(n_block_dim=0), ValueError, "n_block_dim must be a positive multiple of 16"),
        (dict(n_block_dim=16.0), TypeError, "n_block_dim must be an int"),
        (dict(streaming_info=int_tensor([0, 1, 1])), ValueError,
         r"streaming_info must have shape \(4,\)"),
        (dict(streaming_info=None), ValueError,
         r"^head_mask_type\[1\] = -1 is a streaming head but streaming_info is None"),
        (dict(streaming_info=int_tensor([0, 1, 1, -2])), ValueError, "both must be >= 0"),
        (dict(exact_streaming=True), ValueError, "pass is_causal=True"),
        (dict(p_dropout=1.0), ValueError, r"p_dropout must be in \[0, 1\)"),
        (dict(max_seqlen_q_=None), TypeError, "max_seqlen_q must be an int"),
        (dict(max_seqlen_k_=0), ValueError, "max_seqlen_k must be at least 1"),
        (dict(cu_seqlens_k=int_tensor([0, 12])), ValueError, "cu_seqlens_q and cu_seqlens_k"),
    ]


GOOD_ARGUMENTS, BAD_ARGUMENTS = _bad_arguments()


@pytest.mark.parametrize("change, error, message", BAD_ARGUMENTS,
                         ids=[f"{next(iter(change))}-{i}" for i, (change, _, _) in
                              enumerate(BAD_ARGUMENTS)])
def test_bad_arguments(change, error, message):
    with pytest.raises(error, match=message):
        block_sparse_attn_func(**{**GOOD_ARGUMENTS, **change})


def test_streaming_functions_reject_block_sparse_heads():
    good = GOOD_ARGUMENTS
    args = (good["q"], good["k"], good["v"], good["cu_seqlens_q"], good["cu_seqlens_k"],
            int_tensor([1, 0]), good["streaming_info"], 6, 6)
    with pytest.raises(ValueError, match="token_streaming_attn_func got no base_blockmask"):
        token_streaming_attn_func(*args)
    with pytest.raises(ValueError, match="block_streaming_attn_func got no base_blockmask"):
        block_streaming_attn_func(*args, 0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("exact", [False, True], ids=["block-streaming", "token-streaming"])
def test_mixed_heads_bf16_on_gpu(exact):
    lengths_q, lengths_k = [300, 1000, 517, 1], [300, 1200, 517, 700]
    heads, block = 8, 128
    (q, k, v), dout, cu_q, cu_k = packed_inputs(lengths_q, lengths_k, heads, 2, 128,
                                                torch.bfloat16, 6)
    head_mask_type = [1, 0, -1, 1, 1, -1, 0, 1]
    streaming_info = [100, 300, 0, 0, 64, 256, 0, 0, 0, 0, 7, 129, 0, 0, 0, 0] if exact else \
        [1, 2, 0, 0, 0, 3, 0, 0, 0, 0, 2, 1, 0, 0, 0, 0]
    max_q, max_k = max(lengths_q), max(lengths_k)
    base_blockmask = random_blockmask(len(lengths_q), 4, math.ceil(max_q / block),
                                      math.ceil(max_k / block), seed=7)
    out, lse, _ = block_sparse_attn_func(
        q, k, v, int_tensor(cu_q), int_tensor(cu_k), int_tensor(head_mask_type),
        int_tensor(streaming_info), base_blockmask, max_q, max_k, 0.0, is_causal=True,
        exact_streaming=exact, return_attn_probs=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    visible = visibility(head_mask_type, streaming_info, base_blockmask, lengths_q, lengths_k,
                         True, exact, block, block)
    check_facade(out, lse, grads, q, k, v, dout, cu_q, cu_k, visible)
