"""Element-exact block masks: block_mask_from_predicate and the document / prefix-LM / streaming
builders against brute-force definitions, their element bitmaps through the kernels (forward and
backward) against the reference, and block masks over packed (varlen) sequences."""
from __future__ import annotations

import re

import pytest
import torch

import omniattn
from helpers import DEVICE, GPU, check_against_reference, random_qkv
from omniattn.masks.block_mask import FULL, HIDDEN, PARTIAL, BlockMask


def brute_force(mask_mod, batch, heads, seqlen_q, seqlen_k) -> torch.Tensor:
    """(B, H, Sq, Sk) bool: mask_mod on every element (test-only, tiny shapes)."""
    b = torch.arange(batch, device=DEVICE)[:, None, None, None]
    h = torch.arange(heads, device=DEVICE)[None, :, None, None]
    q_idx = torch.arange(seqlen_q, device=DEVICE)[None, None, :, None]
    kv_idx = torch.arange(seqlen_k, device=DEVICE)[None, None, None, :]
    return mask_mod(b, h, q_idx, kv_idx).expand(batch, heads, seqlen_q, seqlen_k)


def assert_exact(mask: BlockMask, expected: torch.Tensor) -> None:
    """The mask shows exactly `expected` (B|1, H|1, Sq, Sk), and classifies every block exactly:
    FULL iff all visible, absent iff none."""
    seqlen_q, seqlen_k = mask.seq_lengths
    visible = mask.visible(torch.arange(seqlen_q, device=DEVICE), seqlen_q, seqlen_k)
    assert torch.equal(visible.expand_as(expected).cpu(), expected.cpu())
    block_q, block_k = mask.block_size
    states = mask.states.expand(*expected.shape[:2], -1, -1).cpu()
    for qb in range(mask.n_blocks[0]):
        for kb in range(mask.n_blocks[1]):
            tile = expected[..., qb * block_q:(qb + 1) * block_q, kb * block_k:(kb + 1) * block_k]
            tile = tile.flatten(2).cpu()
            kind = torch.where(tile.all(-1), FULL, torch.where(tile.any(-1), PARTIAL, HIDDEN))
            assert torch.equal(states[..., qb, kb], kind.to(torch.int8)), (qb, kb)


def document_ids(cu_seqlens: list[int]) -> torch.Tensor:
    ids = [d for d in range(len(cu_seqlens) - 1) for _ in range(cu_seqlens[d + 1] - cu_seqlens[d])]
    return torch.tensor(ids, device=DEVICE)


@pytest.mark.parametrize("block_size", [16, 32, (16, 48)], ids=str)
@pytest.mark.parametrize("hinted", [False, True])
def test_from_predicate_is_exact(block_size, hinted):
    """An arbitrary per-(batch, head) element mask (captured tensor) and a structured one."""
    generator = torch.Generator().manual_seed(1)
    table = (torch.rand(2, 3, 70, 90, generator=generator) < 0.3).to(DEVICE)
    table[..., :40, :48] = True  # whole blocks FULL
    table[..., 40:, 48:] = False  # and hidden

    def mask_mod(b, h, q_idx, kv_idx):
        return table[b, h, q_idx, kv_idx]

    states = None
    if hinted:  # a correct picture: exact where it says FULL / hidden
        exact = omniattn.block_mask_from_predicate(mask_mod, 2, 3, 70, 90, block_size,
                                                   device=DEVICE).states
        states = torch.where(exact == HIDDEN, HIDDEN, PARTIAL).to(torch.int8)
    mask = omniattn.block_mask_from_predicate(mask_mod, 2, 3, 70, 90, block_size, device=DEVICE,
                                              block_states=states, chunk_elements=4096)
    assert_exact(mask, table)
    assert mask.element_bits.shape[0] <= int((mask.states == PARTIAL).sum())


def test_identical_bitmaps_are_stored_once():
    mask = omniattn.block_mask_from_predicate(lambda b, h, q, kv: kv <= q, 1, 1, 256, 256, 32,
                                              device=DEVICE, chunk_elements=2048)
    assert mask.element_bits.shape[0] == 1 and int((mask.element_slots == 0).sum()) == 8
    assert (mask.element_slots[mask.states != PARTIAL] == -1).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_size", [16, (32, 16)], ids=str)
def test_document_block_mask_is_exact(causal, block_size):
    bounds = [0, 5, 5, 37, 38, 90, 100]  # an empty and a one-token document
    doc = document_ids(bounds)
    q_idx = torch.arange(100, device=DEVICE)
    expected = doc[:, None] == doc[None, :]
    if causal:
        expected &= q_idx[None, :] <= q_idx[:, None]
    mask = omniattn.document_block_mask(torch.tensor(bounds, device=DEVICE), block_size, causal)
    assert_exact(mask, expected[None, None])


@pytest.mark.parametrize("seqlen_q, seqlen_k, prefix", [(80, 80, 21), (50, 90, 64), (90, 40, 0)])
def test_prefix_lm_block_mask_is_exact(seqlen_q, seqlen_k, prefix):
    q_idx = torch.arange(seqlen_q, device=DEVICE)[:, None]
    kv_idx = torch.arange(seqlen_k, device=DEVICE)[None, :]
    expected = (kv_idx < prefix) | (kv_idx <= q_idx + seqlen_k - seqlen_q)
    assert_exact(omniattn.prefix_lm_block_mask(seqlen_q, seqlen_k, prefix, 16, DEVICE),
                 expected[None, None])


@pytest.mark.parametrize("seqlen_q, seqlen_k, sink, local", [(100, 100, 4, 19), (40, 100, 0, 30),
                                                             (100, 60, 17, 0)])
def test_token_streaming_block_mask_is_exact(seqlen_q, seqlen_k, sink, local):
    q_idx = torch.arange(seqlen_q, device=DEVICE)[:, None]
    kv_idx = torch.arange(seqlen_k, device=DEVICE)[None, :]
    diagonal = q_idx + seqlen_k - seqlen_q
    expected = (kv_idx <= diagonal) & ((kv_idx < sink) | (kv_idx > diagonal - local))
    mask = omniattn.streaming_block_mask(seqlen_q, seqlen_k, sink, local, 16, in_tokens=True,
                                         device=DEVICE)
    assert_exact(mask, expected[None, None])


def test_block_streaming_block_mask_counts_blocks():
    mask = omniattn.streaming_block_mask(96, 96, 1, 2, 16, device=DEVICE)
    assert mask.to_string() == "\n".join(["+.....", "#+....", "##+...", "#.#+..", "#..#+.",
                                          "#...#+"])
    q_idx = torch.arange(96, device=DEVICE)[:, None]
    kv_idx = torch.arange(96, device=DEVICE)[None, :]
    block_row, block_col = q_idx // 16, kv_idx // 16
    expected = ((block_col < 1) | (block_col > block_row - 2)) & (kv_idx <= q_idx)
    assert_exact(mask, expected[None, None])


def test_builder_errors():
    with pytest.raises(ValueError, match=r"^cu_seqlens must start at 0 and never decrease; "
                                         r"cu_seqlens\[2\] = 4 is below cu_seqlens\[1\] = 9$"):
        omniattn.document_block_mask(torch.tensor([0, 9, 4]))
    with pytest.raises(ValueError, match=r"^cu_seqlens must start at 0 and never decrease; "
                                         r"cu_seqlens\[0\] = 2$"):
        omniattn.document_block_mask(torch.tensor([2, 9]))
    with pytest.raises(ValueError, match=r"^cu_seqlens must be a 1-D integer tensor \(documents "
                                         r"\+ 1,\) of offsets from 0, got shape \(2, 2\)$"):
        omniattn.document_block_mask(torch.tensor([[0, 9], [9, 12]]))
    with pytest.raises(TypeError, match=r"^cu_seqlens must have an integer dtype, got "
                                        r"torch.float32$"):
        omniattn.document_block_mask(torch.tensor([0.0, 9.0]))
    with pytest.raises(ValueError, match="sink and local must be >= 0"):
        omniattn.streaming_block_mask(64, 64, -1, 4)
    table = torch.ones(2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="element_bits must be \\(n_slots >= 1, 16, 16\\)"):
        BlockMask.from_states(torch.ones(1, 1, 1, 1, dtype=torch.int8), 16, (16, 16),
                              element_bits=table, element_slots=torch.zeros(1, 1, 1, 1))


def bitmap_masks(seqlen: int, block: int):
    """(name, BlockMask, dense (1|B, 1|H, S, S) visibility) for the kernel tests."""
    bounds = [0, seqlen // 3, seqlen // 3 + 1, seqlen]
    doc = document_ids(bounds)
    q_idx = torch.arange(seqlen, device=DEVICE)[:, None]
    kv_idx = torch.arange(seqlen, device=DEVICE)[None, :]
    sink, local = 3, seqlen // 4
    generator = torch.Generator().manual_seed(seqlen)
    table = (torch.rand(1, 2, seqlen, seqlen, generator=generator) < 0.4).to(DEVICE)
    table[..., block:, :block] = True  # FULL blocks next to bitmap blocks
    return [
        ("document-causal", omniattn.document_block_mask(torch.tensor(bounds, device=DEVICE),
                                                         block, causal=True),
         ((doc[:, None] == doc[None, :]) & (kv_idx <= q_idx))[None, None]),
        ("streaming-tokens", omniattn.streaming_block_mask(seqlen, seqlen, sink, local, block,
                                                           in_tokens=True, device=DEVICE),
         ((kv_idx <= q_idx) & ((kv_idx < sink) | (kv_idx > q_idx - local)))[None, None]),
        ("random-per-head", omniattn.block_mask_from_predicate(
            lambda b, h, q, kv: table[b, h, q, kv], 1, 2, seqlen, seqlen, block, device=DEVICE),
         table),
    ]


SEQLEN, BLOCK = (1000, 128) if GPU else (77, 32)
KERNEL_CASES = [(name, dtype) for name in ("document-causal", "streaming-tokens", "random-per-head")
                for dtype in ((torch.bfloat16, torch.float16) if GPU else (torch.float16,))]


@pytest.mark.parametrize("name, dtype", KERNEL_CASES, ids=str)
def test_attention_with_element_bitmaps(name, dtype):
    """Bitmap blocks bigger than the kernel tile (tiles are refined per bitmap), GQA, rows of a
    document that see nothing, and attention's own window ANDed on top."""
    mask, visible = next((m, v) for n, m, v in bitmap_masks(SEQLEN, BLOCK) if n == name)
    torch.manual_seed(1)
    q, k, v = random_qkv(1, SEQLEN, SEQLEN, 2, 1, 32 if not GPU else 128, dtype)
    dout = torch.randn_like(q)
    window = (SEQLEN // 2, -1)
    out, lse = omniattn.attention(q, k, v, block_mask=mask, window=window, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q_idx = torch.arange(SEQLEN, device=DEVICE)
    in_window = q_idx[None, :] >= q_idx[:, None] - window[0]
    check_against_reference(out, lse, grads, q, k, v, dout, attn_mask=visible & in_window)


def test_varlen_block_mask_per_sequence():
    """Packed sequences, a block mask per sequence (batch dim = sequences), causal on each
    sequence's own diagonal: each sequence equals the reference on its own."""
    lengths_q, lengths_k = [40, 1, 33], [60, 1, 20]
    if GPU:
        lengths_q, lengths_k = [400, 1, 333], [600, 1, 200]
    block = 16 if not GPU else 64
    max_q, max_k = max(lengths_q), max(lengths_k)
    n_q, n_k = -(-max_q // block), -(-max_k // block)
    generator = torch.Generator().manual_seed(4)
    blocks = (torch.rand(3, 2, n_q, n_k, generator=generator) < 0.6).to(DEVICE)
    mask = omniattn.block_mask_from_blocks(blocks, block, seq_lengths=(max_q, max_k))
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32,
                        device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32,
                        device=DEVICE)
    dtype = torch.bfloat16 if GPU else torch.float16
    torch.manual_seed(2)
    q = torch.randn(sum(lengths_q), 2, 32, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lengths_k), 1, 32, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    dout = torch.randn_like(q)
    out, lse = omniattn.attention(q, k, v, causal=True, block_mask=mask, cu_seqlens_q=cu_q,
                                  cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                                  return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for b, (len_q, len_k) in enumerate(zip(lengths_q, lengths_k)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        q_idx = torch.arange(len_q, device=DEVICE)[:, None]
        kv_idx = torch.arange(len_k, device=DEVICE)[None, :]
        visible = blocks[b][:, q_idx // block, kv_idx // block] & (kv_idx <= q_idx + len_k - len_q)
        leaves = [t[None].detach().requires_grad_() for t in (q[rows], k[keys], v[keys])]
        check_against_reference(out[rows][None], lse[:, rows][None], (dq[rows][None],
                                dk[keys][None], dv[keys][None]), *leaves, dout[rows][None],
                                attn_mask=visible[None])


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA (compiled FlexAttention)")
def test_bitmaps_through_flex_as_second_oracle():
    """to_flex() carries the bitmaps into FlexAttention's mask_mod: an independent kernel."""
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(6)
    for name, mask, visible in bitmap_masks(1024, 128):
        q, k, v = random_qkv(1, 1024, 1024, 2, 2, 64, torch.bfloat16, requires_grad=False)
        ours = omniattn.attention(q, k, v, block_mask=mask)
        # Flex's default tiles with a gathering mask_mod ask for more shared memory than an H100
        # has (247,808 of 232,448 bytes)
        flex = torch.compile(flex_attention)(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask.to_flex(),
            kernel_options={"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2})
        seen = visible.expand(1, 2, 1024, 1024).any(-1).transpose(1, 2)[..., None]
        torch.testing.assert_close(torch.where(seen, ours, 0).float(),
                                   torch.where(seen, flex.transpose(1, 2), 0).float(),
                                   atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.parametrize("kind", ["window", "random"])
def test_coarsened_mask_keeps_every_element(kind):
    """Small user blocks at coarser blocks (what kernel tiles larger than the blocks run): the
    sub-block picture and the predicate move into bitmaps; the same elements stay visible."""
    seqlen_q, seqlen_k = 90, 75
    q_idx = torch.arange(seqlen_q, device=DEVICE)[:, None]
    kv_idx = torch.arange(seqlen_k, device=DEVICE)[None, :]
    if kind == "window":
        mask = omniattn.window_block_mask(seqlen_q, seqlen_k, (20, 7), block_size=16,
                                          device=DEVICE)
        rel = kv_idx - q_idx - (seqlen_k - seqlen_q)
        expected = ((rel <= 7) & (rel >= -20))[None, None]
        coarse_size = (32, 32)
    else:
        generator = torch.Generator().manual_seed(3)
        blocks = (torch.rand(1, 2, 6, 3, generator=generator) < 0.5).to(DEVICE)
        mask = omniattn.block_mask_from_blocks(blocks, (16, 32), seq_lengths=(seqlen_q, seqlen_k))
        expected = blocks[:, :, q_idx // 16, kv_idx // 32]
        coarse_size = (48, 64)
    coarse = mask.coarsened(*coarse_size)
    assert coarse.block_size == coarse_size and coarse.predicate.unbounded
    assert mask.coarsened(*coarse_size) is coarse
    assert_exact(coarse, expected)
    torch.manual_seed(0)
    q, k, v = random_qkv(1, seqlen_q, seqlen_k, 2, 2, 16, torch.float16)
    dout = torch.randn_like(q)
    out, lse = omniattn.attention(q, k, v, block_mask=coarse, causal=True, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, lse, grads, q, k, v, dout,
                            attn_mask=expected & (kv_idx <= q_idx + seqlen_k - seqlen_q))


@pytest.mark.parametrize("blocks, error, message", [
    (torch.ones(2, 3, 4, dtype=torch.bool), ValueError,
     "blocks must be 4-D (B|1, H|1, n_q_blocks, n_k_blocks), got shape (2, 3, 4)"),
    (torch.ones(1, 1, 2, 2), TypeError,
     "blocks must be a bool tensor (True = visible block), got dtype torch.float32"),
    ([[[[True]]]], TypeError,
     "blocks must be a bool torch.Tensor (B|1, H|1, n_q_blocks, n_k_blocks), got list"),
], ids=["3-d", "float", "list"])
def test_from_blocks_says_what_is_wrong(blocks, error, message):
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        omniattn.block_mask_from_blocks(blocks, 16)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(seq_lengths=(32, 64)), ValueError,
     "seq_lengths = (32, 64) needs (2, 4) blocks of (16, 16), but blocks has (2, 2)"),
    (dict(seq_lengths=(32, 16)), ValueError,
     "seq_lengths = (32, 16) needs (2, 1) blocks of (16, 16), but blocks has (2, 2)"),
    (dict(seq_lengths=32), TypeError, "seq_lengths must be a pair of ints (Sq, Sk), got int"),
    (dict(block_size=torch.tensor(16)), TypeError,
     "block_size must be an int or a pair of ints (BQ, BK), got Tensor"),
    (dict(block_size=(16, 24)), ValueError,
     "block_size[1] must be a positive multiple of 16, got 24"),
], ids=["short-k", "long-k", "lengths-type", "size-type", "size-value"])
def test_from_blocks_grid(kwargs, error, message):
    with pytest.raises(error, match="^" + re.escape(message)):
        omniattn.block_mask_from_blocks(torch.ones(1, 1, 2, 2, dtype=torch.bool),
                                        **{"block_size": 16, **kwargs})


def test_list_errors_name_the_position():
    num = torch.tensor([[[1, 3]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 0], [0, 1]]]], dtype=torch.int32)
    with pytest.raises(ValueError, match=re.escape("kv_num_blocks[0, 0, 1] = 3 is outside [0, 2] "
                                                   "(the columns of kv_indices)")):
        BlockMask(num, idx, block_size=16, seq_lengths=(32, 32))
    num[0, 0, 1] = 2
    idx[0, 0, 1, 1] = 5
    with pytest.raises(ValueError, match=re.escape("kv_indices lists a key block outside [0, 2) "
                                                   "for Sk = 32 and block size 16: "
                                                   "kv_indices[0, 0, 1, 1] = 5")):
        BlockMask(num, idx, block_size=16, seq_lengths=(32, 32))
