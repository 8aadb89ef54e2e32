"""BlockMask: builders against brute force, attention(block_mask=) against the reference with the
equivalent dense element mask (kernels under the interpreter or on the GPU, and the CPU path)."""
from __future__ import annotations

import pytest
import torch

import omniattn
from helpers import (DEVICE, GPU, case_id, check_against_reference, element_visibility, predicate,
                     random_block_mask, random_qkv)
from omniattn.masks.block_mask import FULL, HIDDEN, PARTIAL, BlockMask, RelativePredicate

BLOCK_SIZES = [16, 32, 48, (16, 64), (64, 32)]


@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=str)
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(100, 100), (37, 150), (150, 37), (1, 64)])
@pytest.mark.parametrize("kind", ["causal", "window", "causal_window"])
def test_builders_are_exact(block_size, seqlen_q, seqlen_k, kind):
    causal, window = {"causal": (True, None), "window": (False, (20, 7)),
                      "causal_window": (True, (33, -1))}[kind]
    if kind == "causal":
        mask = omniattn.causal_block_mask(seqlen_q, seqlen_k, block_size)
    else:
        mask = omniattn.window_block_mask(seqlen_q, seqlen_k, window, causal, block_size)
    exact = predicate(seqlen_q, seqlen_k, causal, window).cpu()
    assert torch.equal(element_visibility(mask)[0, 0].cpu(), exact)
    # FULL exactly where a block is all visible, absent exactly where none is
    block_q, block_k = mask.block_size
    for qb in range(mask.n_blocks[0]):
        for kb in range(mask.n_blocks[1]):
            tile = exact[qb * block_q:(qb + 1) * block_q, kb * block_k:(kb + 1) * block_k]
            expected = FULL if tile.all() else PARTIAL if tile.any() else HIDDEN
            assert mask.states[0, 0, qb, kb] == expected


def test_constructor_checks():
    num = torch.tensor([[[1]]], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_size\\[0\\] must be a positive multiple of 16"):
        BlockMask(num, torch.zeros(1, 1, 1, 1, dtype=torch.int32), block_size=(24, 16))
    with pytest.raises(ValueError, match="kv_indices lists a key block outside \\[0, 2\\)"):
        BlockMask(num, torch.tensor([[[[2]]]], dtype=torch.int32), block_size=16,
                  seq_lengths=(16, 32))
    with pytest.raises(ValueError, match="seq_lengths\\[0\\] = 40 needs 3 query blocks of 16"):
        BlockMask(num, torch.zeros(1, 1, 1, 1, dtype=torch.int32), block_size=16,
                  seq_lengths=(40, 16))


def test_full_blocks_ignore_the_mask_predicate():
    """FlexAttention semantics: a FULL block above the diagonal of a causal mask stays visible,
    also when attention's own window cuts it (the mask's predicate then moves into bitmaps)."""
    states = torch.tensor([[[[PARTIAL, FULL], [FULL, PARTIAL]]]], dtype=torch.int8, device=DEVICE)
    mask = BlockMask.from_states(states, 16, (32, 32), causal=True)
    assert element_visibility(mask)[0, 0, 0, 16:].all()
    q, k, v = random_qkv(1, 32, 32, 2, 2, 16, torch.float16)
    dout = torch.randn_like(q)
    out, lse = omniattn.attention(q, k, v, block_mask=mask, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, lse, grads, q, k, v, dout, attn_mask=element_visibility(mask))
    out, lse = omniattn.attention(q, k, v, block_mask=mask, window=(3, 3), return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    in_window = predicate(32, 32, False, (3, 3)).to(DEVICE)
    check_against_reference(out, lse, grads, q, k, v, dout,
                            attn_mask=element_visibility(mask) & in_window)
    with pytest.raises(NotImplementedError, match="FULL blocks that its own causal/window"):
        mask.kernel_states(16, 16, RelativePredicate.make(False, (3, 3)))


def test_repr_picture_and_transposed_lists():
    mask = omniattn.causal_block_mask(64, 64, 32)
    assert repr(mask) == ("BlockMask(shape=(1, 1, 64, 64), block_size=(32, 32), density=0.750, "
                          "partial blocks apply causal)")
    assert mask.to_string() == "+.\n#+"
    q_num, q_idx, full_q_num, full_q_idx = mask.transposed
    assert q_num.flatten().tolist() == [1, 1] and full_q_num.flatten().tolist() == [1, 0]
    assert q_idx[0, 0, 0, 0] == 0 and q_idx[0, 0, 1, 0] == 1 and full_q_idx[0, 0, 0, 0] == 1


def test_kernel_schedule_is_cached():
    mask = omniattn.causal_block_mask(64, 64, 32)
    predicate_none = mask.predicate.make()
    tiles = ((16, 16), (32, 16), (16, 32))
    assert mask.kernel_schedule(*tiles, predicate_none) is \
        mask.kernel_schedule(*tiles, predicate_none)
    assert mask.kernel_states(16, 16, predicate_none) is mask.kernel_states(16, 16, predicate_none)


def test_flex_round_trip():
    blocks = torch.rand(2, 3, 4, 5, generator=torch.Generator().manual_seed(0)) > 0.5
    mask = omniattn.block_mask_from_blocks(blocks, (32, 16), seq_lengths=(120, 70))
    flex = mask.to_flex()
    back = BlockMask.from_flex(flex)
    assert back.block_size == (32, 16) and back.seq_lengths == (120, 70)
    assert torch.equal(back.states, mask.states)
    causal = omniattn.causal_block_mask(96, 96, 32)
    assert torch.equal(BlockMask.from_flex(causal.to_flex(), causal=True).states, causal.states)


CASES = [
    # B, Sq, Sk, H, Hk, D, dtype, mask batch/heads, block size, density, causal, window
    (2, 70, 50, 4, 2, 32, torch.float16, (1, 1), 16, 0.5, False, None),
    (1, 64, 96, 4, 1, 16, torch.float32, (1, 4), 32, 0.6, True, None),
    (2, 45, 45, 2, 2, 32, torch.float16, (2, 2), (16, 32), 0.7, False, (10, 3)),
]
if GPU:
    CASES = [(b, sq * 8, sk * 8, h, hk, d, torch.bfloat16 if dt == torch.float16 else dt, bh,
              bs if isinstance(bs, int) and bs > 16 else 64, dens, c, w)
             for (b, sq, sk, h, hk, d, dt, bh, bs, dens, c, w) in CASES]
    CASES.append((1, 1000, 1300, 8, 2, 128, torch.bfloat16, (1, 8), (128, 256), 0.3, True, None))
    CASES.append((1, 700, 900, 4, 2, 256, torch.bfloat16, (1, 4), 128, 0.4, True, None))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_attention_with_block_mask(case):
    batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, (mb, mh), block_size, density, \
        causal, window = case
    mask = random_block_mask(mb, mh, seqlen_q, seqlen_k, block_size, density, seqlen_q)
    visible = element_visibility(mask) & predicate(seqlen_q, seqlen_k, causal, window)
    torch.manual_seed(seqlen_k)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype)
    dout = torch.randn_like(q)
    out, lse = omniattn.attention(q, k, v, causal=causal, window=window, block_mask=mask,
                                  return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert (out[:, :mask.block_size[0]] == 0).all()
    check_against_reference(out, lse, grads, q, k, v, dout, attn_mask=visible)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9, reason="needs sm90")
@pytest.mark.parametrize("seqlens", [(1000, 1300), (1024, 768)], ids=str)
def test_gluon_with_block_mask(gluon_calls, seqlens):
    """Block masks of whole blocks (no causal / window, no element bitmaps) run their lists in
    the Gluon kernels, the forward's at 128x128 tiles, the backward's at 64x128: a FULL tile
    past Sk, query blocks that see nothing, GQA. Fails if either pass took the other path."""
    seqlen_q, seqlen_k = seqlens
    mask = random_block_mask(2, 8, seqlen_q, seqlen_k, 128, 0.4, seqlen_q)
    torch.manual_seed(seqlen_k)
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 8, 2, 128, torch.bfloat16)
    dout = torch.randn_like(q)
    out, lse = omniattn.attention(q, k, v, block_mask=mask, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert (out[:, :128] == 0).all()
    check_against_reference(out, lse, grads, q, k, v, dout, attn_mask=element_visibility(mask))
    assert gluon_calls == ["fwd", "bwd"], f"Gluon launches: {gluon_calls}"


# (Sq, Sk, window, block size, attention's causal): masks whose PARTIAL blocks apply their own
# causal / window predicate, no bitmaps
PREDICATE_BLOCK_MASKS = [
    (1000, 1300, (-1, 0), 128, False),
    (1000, 1300, (300, 0), 128, False),
    (1024, 768, (250, 170), 128, False),  # Sq > Sk: the first rows see no key
    (777, 1029, (300, 0), (256, 128), True),  # attention's causal adds nothing to the mask's
]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9, reason="needs sm90")
@pytest.mark.parametrize("case", PREDICATE_BLOCK_MASKS, ids=case_id)
def test_gluon_with_predicate_block_mask(gluon_calls, case):
    """Causal / window block masks at blocks the Gluon tiles divide run their lists in the
    Gluon kernels, the predicate (left bounds included) in the PARTIAL tiles. Fails if either
    pass took the other path."""
    seqlen_q, seqlen_k, window, block_size, causal = case
    mask = omniattn.window_block_mask(seqlen_q, seqlen_k, window, block_size=block_size,
                                      device=DEVICE)
    torch.manual_seed(seqlen_q)
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 8, 2, 128, torch.bfloat16)
    dout = torch.randn_like(q)
    out, lse = omniattn.attention(q, k, v, causal=causal, block_mask=mask, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    visible = element_visibility(mask) & predicate(seqlen_q, seqlen_k, causal, None)
    check_against_reference(out, lse, grads, q, k, v, dout, attn_mask=visible)
    assert gluon_calls == ["fwd", "bwd"], f"Gluon launches: {gluon_calls}"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9, reason="needs sm90")
@pytest.mark.parametrize("window", [(-1, 0), (300, 0)], ids=str)
def test_gluon_with_full_blocks_outside_the_predicate(gluon_calls, window):
    """FULL blocks need no predicate, also where the mask's own causal / window predicate would
    hide keys: a first key block FULL for every query block (beside the window's left edge), a
    first query block FULL everywhere (its rows' first step is FULL) and keys past Sk in the
    last block. The Gluon kernels apply the predicate to the PARTIAL tiles only; the FULL ones
    of the last key tile drop the keys past Sk alone."""
    seqlen_q, seqlen_k = 700, 1000
    states = RelativePredicate.make(False, window).classify(seqlen_q, seqlen_k, 128, 128,
                                                            device=DEVICE)
    states[:, 0] = FULL
    states[0, :] = FULL
    mask = BlockMask.from_states(states[None, None], 128, (seqlen_q, seqlen_k), window=window)
    torch.manual_seed(3)
    q, k, v = random_qkv(1, seqlen_q, seqlen_k, 4, 2, 128, torch.bfloat16)
    dout = torch.randn_like(q)
    out, lse = omniattn.attention(q, k, v, block_mask=mask, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, lse, grads, q, k, v, dout, attn_mask=element_visibility(mask))
    assert gluon_calls == ["fwd", "bwd"], f"Gluon launches: {gluon_calls}"


@pytest.mark.parametrize("block_size", [16, 32, (32, 16)], ids=str)
def test_causal_block_mask_equals_causal(block_size):
    """The mask's own predicate runs in its PARTIAL blocks: no causal=True needed."""
    torch.manual_seed(0)
    seqlen = 256 if GPU else 50
    block_size = (128, 64) if GPU and block_size == 32 else block_size
    q, k, v = random_qkv(1, seqlen, seqlen + 13, 2, 1, 32, torch.float16)
    dout = torch.randn_like(q)
    mask = omniattn.causal_block_mask(seqlen, seqlen + 13, block_size, device=DEVICE)
    out, lse = omniattn.attention(q, k, v, block_mask=mask, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, lse, grads, q, k, v, dout, causal=True)


def test_cpu_reference_backend_with_block_mask(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    mask = random_block_mask(1, 2, 40, 56, 16, 0.5, 3)
    mask = BlockMask(mask.kv_num_blocks.cpu(), mask.kv_indices.cpu(),
                     mask.full_kv_num_blocks.cpu(), mask.full_kv_indices.cpu(),
                     block_size=mask.block_size, seq_lengths=mask.seq_lengths)
    q, k, v = random_qkv(1, 40, 56, 2, 2, 16, torch.float32, device="cpu")
    dout = torch.randn_like(q)
    out, lse = omniattn.attention(q, k, v, block_mask=mask, causal=True, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    visible = element_visibility(mask) & predicate(40, 56, True, None).cpu()
    check_against_reference(out, lse, grads, q, k, v, dout, attn_mask=visible)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA (compiled FlexAttention)")
@pytest.mark.parametrize("kind", ["random", "causal"])
def test_flex_attention_as_second_oracle(kind):
    """The same blocks through compiled FlexAttention (an independent implementation)."""
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(5)
    seqlen = 1024
    if kind == "random":
        mask = random_block_mask(1, 4, seqlen, seqlen, 128, 0.4, 5)
    else:
        mask = omniattn.causal_block_mask(seqlen, seqlen, 128, device=DEVICE)
    q, k, v = random_qkv(1, seqlen, seqlen, 4, 4, 64, torch.bfloat16, requires_grad=False)
    ours = omniattn.attention(q, k, v, block_mask=mask)
    flex = torch.compile(flex_attention)(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         block_mask=mask.to_flex()).transpose(1, 2)
    visible_rows = element_visibility(mask).expand(1, 4, seqlen, seqlen).any(-1)
    visible_rows = visible_rows.transpose(1, 2)[..., None]  # (B, Sq, H, 1)
    # rows that see nothing: omniattn outputs 0 by contract; compare the others
    torch.testing.assert_close(torch.where(visible_rows, ours, 0).float(),
                               torch.where(visible_rows, flex, 0).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("builder", ["causal", "window", "document", "streaming"])
def test_128k_builders_stay_small(builder):
    """Building a 128k-token mask takes O(blocks) memory: under 64 MB of GPU memory (the
    document mask has 24 documents of random lengths, its boundaries inside blocks)."""
    bounds = torch.randint(1, 131072, (23,), generator=torch.Generator().manual_seed(0))
    cu_seqlens = torch.cat([torch.tensor([0]), bounds.sort().values,
                            torch.tensor([131072])]).cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    if builder == "causal":
        mask = omniattn.causal_block_mask(131072, 131072, 128, device="cuda")
    elif builder == "window":
        mask = omniattn.window_block_mask(131072, 131072, (4096, 0), block_size=128, device="cuda")
    elif builder == "document":
        mask = omniattn.document_block_mask(cu_seqlens, 128, causal=True)
    else:
        mask = omniattn.streaming_block_mask(131072, 131072, 64, 4000, 128, in_tokens=True,
                                             device="cuda")
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 64 * 2 ** 20
    assert mask.n_blocks == (1024, 1024)
