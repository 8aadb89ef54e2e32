"""Omni-Attention façade: typed block masks, forward and backward, against the reference."""
from __future__ import annotations

import pytest
import torch

from helpers import DEVICE, GPU, case_id, check_against_reference, random_qkv
from omniattn.compat import (BlockMaskType, create_causal_block_mask, create_full_block_mask,
                             create_hybrid_block_mask, create_omni_block_mask,
                             omni_attention_forward)

MASKED, CAUSAL, FULL = BlockMaskType.MASKED, BlockMaskType.CAUSAL, BlockMaskType.FULL


def dense_visibility(kv_num_blocks, kv_indices, block_mask_types, seqlen_q, seqlen_k,
                     block_m, block_n):
    """(B, H, Sq, Sk) bool straight from the original's definition, element by element."""
    batch, heads, n_q_blocks = kv_num_blocks.shape
    visible = torch.zeros(batch, heads, seqlen_q, seqlen_k, dtype=torch.bool)
    q_idx = torch.arange(seqlen_q)[:, None]
    k_idx = torch.arange(seqlen_k)[None, :]
    causal = k_idx <= q_idx + seqlen_k - seqlen_q
    for b in range(batch):
        for h in range(heads):
            for qb in range(n_q_blocks):
                for slot in range(int(kv_num_blocks[b, h, qb])):
                    kb = int(kv_indices[b, h, qb, slot])
                    kind = int(block_mask_types[b, h, qb, slot])
                    rows = slice(qb * block_m, (qb + 1) * block_m)
                    cols = slice(kb * block_n, (kb + 1) * block_n)
                    if kind == FULL:
                        visible[b, h, rows, cols] = True
                    elif kind == CAUSAL:
                        visible[b, h, rows, cols] = causal[rows, cols]
    return visible.to(DEVICE)


def test_creators_match_the_original_patterns():
    num, idx, types = create_causal_block_mask(2, 3, 64, 64, 16, 16, device=DEVICE)
    assert num.shape == (2, 3, 4) and num[1, 2].tolist() == [1, 2, 3, 4]
    assert (types[0, 0][idx[0, 0] <= torch.arange(4, device=DEVICE)[:, None]] != MASKED).all()
    num, idx, types = create_full_block_mask(1, 1, 40, 70, 16, 32, device=DEVICE)
    assert num.flatten().tolist() == [3, 3, 3] and (types == FULL).all()
    num, idx, types = create_hybrid_block_mask(1, 1, 64, 64, prefix_len=32, BLOCK_M=16,
                                               BLOCK_N=16, device=DEVICE)
    assert num.flatten().tolist() == [2, 2, 3, 4]
    assert types[0, 0, 0].tolist() == [FULL, FULL, MASKED, MASKED]  # padded slots are MASKED
    assert types[0, 0, 3].tolist() == [CAUSAL] * 4


def test_pattern_callable_with_python_control_flow():
    """The original's example: a callable with `if` on block indices (evaluated per block)."""
    def custom(q_idx, kv_idx):
        if q_idx < 2 and kv_idx < 2:
            return BlockMaskType.FULL
        elif kv_idx <= q_idx:
            return BlockMaskType.CAUSAL
        return BlockMaskType.MASKED

    num, idx, types = create_omni_block_mask(1, 2, 64, 64, custom, 16, 16, device=DEVICE)
    assert num[0, 0].tolist() == [2, 2, 3, 4]
    assert types[0, 1, 0].tolist() == [FULL, FULL, MASKED, MASKED]


CASES = [
    # B, Sq, Sk, H, Hk, D, dtype, block (m, n), pattern
    (2, 45, 45, 4, 2, 32, torch.float16, (16, 16), "causal"),
    (1, 64, 80, 2, 2, 16, torch.float32, (32, 16), "hybrid"),
    (1, 50, 50, 2, 1, 32, torch.float16, (16, 32), "random"),
]
if GPU:
    CASES = [(b, sq * 10, sk * 10, h, hk, d, torch.bfloat16 if dt == torch.float16 else dt,
              (128, 128), kind) for (b, sq, sk, h, hk, d, dt, _, kind) in CASES]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_omni_attention_forward_and_backward(case):
    batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, (block_m, block_n), kind = case
    if kind == "causal":
        lists = create_causal_block_mask(batch, heads, seqlen_q, seqlen_k, block_m, block_n, DEVICE)
    elif kind == "hybrid":
        lists = create_hybrid_block_mask(batch, heads, seqlen_q, seqlen_k, seqlen_q // 3,
                                         block_m, block_n, DEVICE)
    else:
        n_q, n_k = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
        pattern = torch.randint(0, 3, (n_q, n_k), generator=torch.Generator().manual_seed(0))
        lists = create_omni_block_mask(batch, heads, seqlen_q, seqlen_k, pattern, block_m,
                                       block_n, DEVICE)
    torch.manual_seed(1)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype)
    dout = torch.randn_like(q)
    out, lse = omni_attention_forward(q, k, v, *lists, BLOCK_M=block_m, BLOCK_N=block_n)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    visible = dense_visibility(*[t.cpu() for t in lists], seqlen_q, seqlen_k, block_m, block_n)
    check_against_reference(out, lse, grads, q, k, v, dout, attn_mask=visible)


def test_bad_types():
    num, idx, types = create_causal_block_mask(1, 1, 32, 32, 16, 16, device=DEVICE)
    q, k, v = random_qkv(1, 32, 32, 1, 1, 16, torch.float16)
    with pytest.raises(ValueError, match=r"block_mask_types\[0, 0, 0, 0\] = 4 is not a "
                                         r"BlockMaskType"):
        omni_attention_forward(q, k, v, num, idx, types + 3, BLOCK_M=16, BLOCK_N=16)


def test_block_mask_type_is_documented():
    doc = BlockMaskType.__doc__
    assert doc is not None and all(name in doc for name in ("MASKED", "CAUSAL", "FULL"))


def _causal_lists():
    """Causal lists of a (1, 2) batch/head, 32 x 32 in blocks of 16: two query blocks, two
    slots each; writable copies."""
    return [t.clone() for t in create_causal_block_mask(1, 2, 32, 32, 16, 16, device=DEVICE)]


@pytest.mark.parametrize("which, position, value, message", [
    (1, (0, 1, 1, 0), 7, r"^kv_indices\[0, 1, 1, 0\] = 7 is outside \[0, 2\) \(Sk = 32 in key "
                         r"blocks of BLOCK_N = 16\)$"),
    (1, (0, 0, 1, 1), -1, r"^kv_indices\[0, 0, 1, 1\] = -1 is outside \[0, 2\)"),
    (0, (0, 1, 0), 3, r"^kv_num_blocks\[0, 1, 0\] = 3 is outside \[0, 2\] \(the 2 slots of "
                      r"kv_indices\)$"),
    (2, (0, 0, 1, 1), 5, r"^block_mask_types\[0, 0, 1, 1\] = 5 is not a BlockMaskType \(0 "
                         r"MASKED, 1 CAUSAL, 2 FULL\)$"),
], ids=["index-past-end", "index-negative", "count", "type"])
def test_list_values_out_of_range(which, position, value, message):
    """Named argument, range and position; never the tensor, and nothing launched."""
    lists = _causal_lists()
    lists[which][position] = value
    q, k, v = random_qkv(1, 32, 32, 2, 2, 16, torch.float16)
    with pytest.raises(ValueError, match=message):
        omni_attention_forward(q, k, v, *lists, BLOCK_M=16, BLOCK_N=16)


@pytest.mark.parametrize("change, error, message", [
    (lambda n, i, t: (n[..., :1], i[..., :1, :], t[..., :1, :]), ValueError,
     r"^kv_num_blocks has shape \(1, 2, 1\); expected \(B\|1, H\|1, n_q_blocks = 2\) for "
     r"Sq = 32 in query blocks of BLOCK_M = 16$"),
    (lambda n, i, t: (n, i[..., 0], t[..., 0]), ValueError,
     r"^kv_indices has shape \(1, 2, 2\); expected kv_num_blocks' \(1, 2, 2\) plus a slot "
     r"dim"),
    (lambda n, i, t: (n, i, t[..., :1]), ValueError,
     r"^block_mask_types has shape \(1, 2, 2, 1\), kv_indices \(1, 2, 2, 2\): they must match"),
    (lambda n, i, t: (n.expand(3, 2, 2), i.expand(3, 2, 2, 2), t.expand(3, 2, 2, 2)),
     ValueError, r"^kv_num_blocks has batch/head dims \(3, 2\); expected \(1 or B, 1 or H\) with "
     r"\(B, H\) = \(1, 2\)$"),
    (lambda n, i, t: (n.float(), i, t), TypeError,
     r"^kv_num_blocks must be an int32 \(or int64\) tensor, got dtype torch.float32$"),
    (lambda n, i, t: (n.tolist(), i, t), TypeError,
     r"^kv_num_blocks must be an int32 \(or int64\) tensor, got list$"),
], ids=["q-blocks", "slots", "types", "batch", "dtype", "list"])
def test_list_shapes(change, error, message):
    q, k, v = random_qkv(1, 32, 32, 2, 2, 16, torch.float16)
    with pytest.raises(error, match=message):
        omni_attention_forward(q, k, v, *change(*_causal_lists()), BLOCK_M=16, BLOCK_N=16)


def test_slots_past_the_count_are_ignored(monkeypatch):
    """As in the original, only the first kv_num_blocks slots of a row are read: what lies past
    them (here out-of-range indices and types) is neither validated nor used."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    lists = [t.cpu() for t in _causal_lists()]
    q, k, v = random_qkv(1, 32, 32, 2, 2, 16, torch.float32, device="cpu", requires_grad=False)
    expected, _ = omni_attention_forward(q, k, v, *lists, BLOCK_M=16, BLOCK_N=16)
    lists[1][:, :, 0, 1] = 99  # query block 0 lists one block: slot 1 is unused
    lists[2][:, :, 0, 1] = 7
    out, _ = omni_attention_forward(q, k, v, *lists, BLOCK_M=16, BLOCK_N=16)
    torch.testing.assert_close(out, expected)
