"""The chunked reference against a naive dense float64 attention written independently here."""
from __future__ import annotations

import math

import pytest
import torch

import omniattn
from omniattn import causal_block_mask
from omniattn.reference import attention_reference


def naive_attention(q, k, v, *, causal=False, window=None, scale=None, softcap=0.0, keep=None,
                    bias=None, row_lens=None):
    """Dense (B, H, Sq, Sk) everything, K/V repeated per group: obviously right, tiny shapes only."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    group = heads // heads_k
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + expand_heads(bias, heads, group)
    visible = torch.ones(batch, heads, seqlen_q, seqlen_k, dtype=torch.bool)
    for i in range(seqlen_q):
        for j in range(seqlen_k):
            diag = i + seqlen_k - seqlen_q
            if causal and j > diag:
                visible[:, :, i, j] = False
            if window is not None:
                left, right = window
                if (left >= 0 and j < diag - left) or (right >= 0 and j > diag + right):
                    visible[:, :, i, j] = False
    if keep is not None:
        visible &= expand_heads(keep, heads, group)
    if row_lens is not None:
        visible &= torch.arange(seqlen_k)[None, None, None, :] < row_lens[:, None, :, None]
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse


def expand_heads(t, heads, group):
    """(B|1, Hm|1, Sq|1, Sk|1) -> per query head, with Hm in {1, Hk, H}."""
    if t.shape[1] not in (1, heads):
        t = t.repeat_interleave(group, dim=1)
    return t


def rand(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, (3, 2)),
                                            (True, (4, -1)), (False, (-1, 0))])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(7, 7), (5, 9), (9, 5), (1, 6)])
def test_masks_and_gqa(causal, window, seqlen_q, seqlen_k):
    torch.manual_seed(0)
    q, k, v = rand(2, seqlen_q, 4, 8), rand(2, seqlen_k, 2, 8), rand(2, seqlen_k, 2, 8)
    out, lse = attention_reference(q, k, v, causal=causal, window=window, return_lse=True,
                                   chunk_size=3)
    ref_out, ref_lse = naive_attention(q, k, v, causal=causal, window=window)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse.float())


@pytest.mark.parametrize("mask_shape", [(2, 1, 1, 9), (1, 4, 6, 9), (2, 2, 6, 1), (2, 4, 6, 9)])
def test_mask_bias_broadcasts_and_dbias(mask_shape):
    torch.manual_seed(1)
    q, k, v = rand(2, 6, 4, 8), rand(2, 9, 2, 8), rand(2, 9, 2, 8)
    keep = torch.rand(mask_shape) > 0.3
    bias = rand(*mask_shape).requires_grad_()
    out = attention_reference(q, k, v, attn_mask=keep, attn_bias=bias, softcap=3.0, chunk_size=4)
    ref_out, _ = naive_attention(q, k, v, keep=keep, bias=bias, softcap=3.0)
    torch.testing.assert_close(out, ref_out)
    dout = rand(*out.shape)
    (dbias,) = torch.autograd.grad(out, bias, dout)
    (ref_dbias,) = torch.autograd.grad(ref_out, bias, dout)
    assert dbias.shape == bias.shape
    torch.testing.assert_close(dbias, ref_dbias)


def test_per_row_lengths_and_empty_rows():
    torch.manual_seed(2)
    q, k, v = [rand(2, 5, 2, 8).requires_grad_() for _ in range(3)]
    row_lens = torch.tensor([[0, 1, 5, 3, 0], [2, 2, 0, 4, 5]], dtype=torch.int32)
    out, lse = attention_reference(q, k, v, seqlens_k_per_row=row_lens, return_lse=True)
    ref_out, ref_lse = naive_attention(q, k, v, row_lens=row_lens)
    torch.testing.assert_close(out, ref_out)
    assert (out[0, 0] == 0).all() and (lse[0, :, 0] == float("-inf")).all()
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    assert (grads[0][0, 0] == 0).all()


def test_varlen_matches_per_sequence():
    torch.manual_seed(3)
    cu_q = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 11, 13], dtype=torch.int32)
    q, k, v = rand(10, 4, 8), rand(13, 2, 8), rand(13, 2, 8)
    out, lse = attention_reference(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                                   return_lse=True)
    for i in range(3):
        qs = slice(cu_q[i], cu_q[i + 1])
        ks = slice(cu_k[i], cu_k[i + 1])
        ref_out, ref_lse = naive_attention(q[None, qs], k[None, ks], v[None, ks], causal=True)
        torch.testing.assert_close(out[qs], ref_out[0])
        torch.testing.assert_close(lse[:, qs], ref_lse[0].float())


def test_chunked_backward_matches_unchunked():
    """The checkpointed chunks give the same gradients as one chunk."""
    torch.manual_seed(4)
    q, k, v = [rand(1, 11, 2, 8).requires_grad_() for _ in range(3)]
    grads = []
    for chunk in (2, 64):
        out = attention_reference(q, k, v, causal=True, chunk_size=chunk)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_dropout_backward_replays_the_forward_mask():
    """With v the identity, out is the dropped-out probabilities P, so dV = P^T dout holds only
    if each checkpointed chunk's backward draws the forward's dropout mask again."""
    torch.manual_seed(5)
    q, k = rand(1, 9, 2, 9).requires_grad_(), rand(1, 9, 2, 9)
    v = torch.eye(9, dtype=torch.float64)[None, :, None, :].repeat(1, 1, 2, 1).requires_grad_()
    out = attention_reference(q, k, v, causal=True, dropout_p=0.4, chunk_size=4)
    dout = rand(*out.shape)
    (dv,) = torch.autograd.grad(out, v, dout)
    torch.testing.assert_close(dv, torch.einsum("bihj,bihd->bjhd", out, dout))


# NaN cases: q (1, 6, 2, 4) and k/v (1, 6, 1, 4) (both query heads read the one key head),
# causal with per-row key lengths: row i sees keys j <= i with j < ROW_LENS[i]
ROW_LENS = torch.tensor([[0, 2, 1, 4, 5, 3]], dtype=torch.int32)
SEES = ((torch.arange(6)[None, :] <= torch.arange(6)[:, None])
        & (torch.arange(6) < ROW_LENS[0, :, None]))
NAN = float("nan")


def nan_inputs(where):
    """(q, k, v, bias) float64 with one NaN placed as `where` says, the same without it, and
    the bool (Sq, H) rows the NaN reaches."""
    torch.manual_seed(6)
    clean = [rand(1, 6, 2, 4), rand(1, 6, 1, 4), rand(1, 6, 1, 4), rand(1, 2, 6, 6)]
    poisoned = [t.clone() for t in clean]
    q, k, v, bias = poisoned
    reached = torch.zeros(6, 2, dtype=torch.bool)
    if where == "q":
        q[0, 3, 1, 2] = NAN
        reached[3, 1] = True
    elif where == "q of a row that sees no key":
        q[0, 0, 0, 1] = NAN
    elif where in ("k", "v"):
        (k if where == "k" else v)[0, 2, 0, 1] = NAN
        reached[SEES[:, 2]] = True  # rows 3, 4, 5 in both heads
    elif where == "bias":
        bias[0, 0, 4, 3] = NAN
        bias[0, 1, 1, 4] = NAN  # row 1 doesn't see key 4
        bias[0, 1, 0, 0] = NAN  # row 0 sees no key
        reached[4, 0] = True
    return poisoned, clean, reached


def forward_backward(q, k, v, bias, dout, attention=attention_reference):
    q, k, v, bias = (t.clone().requires_grad_() for t in (q, k, v, bias))
    out, lse = attention(q, k, v, causal=True, seqlens_k_per_row=ROW_LENS, attn_bias=bias,
                         return_lse=True)
    return (out, lse.transpose(1, 2)), torch.autograd.grad(out, (q, k, v, bias), dout)


def assert_nan_exactly_at(t, clean, nan_at):
    """t is NaN exactly at nan_at (broadcast over t's trailing dims: NaN somewhere in them)
    and equals clean elsewhere."""
    nan_at = nan_at.expand(t.shape[:nan_at.dim()])
    nan_in_t = t.isnan().flatten(nan_at.dim()).any(-1) if t.dim() > nan_at.dim() else t.isnan()
    assert torch.equal(nan_in_t, nan_at)
    torch.testing.assert_close(t[~nan_at], clean[~nan_at])


@pytest.mark.parametrize("where", ["q", "q of a row that sees no key", "k", "v", "bias"])
def test_nan_reaches_exactly_the_rows_that_see_it(where):
    """NaN in, NaN out: a NaN in q, k, v or attn_bias makes NaN the rows that see it (and their
    gradients), and nothing else; rows that see no key stay 0 with lse -inf and zero grads."""
    poisoned, clean, reached = nan_inputs(where)
    dout = rand(1, 6, 2, 4)
    (out, lse), grads = forward_backward(*poisoned, dout)
    (ref_out, ref_lse), ref_grads = forward_backward(*clean, dout)
    if where == "v":  # the NaN is in value column 1 only, and the probabilities stay finite
        assert_nan_exactly_at(out, ref_out, reached[None, :, :, None] & (torch.arange(4) == 1))
        assert_nan_exactly_at(lse, ref_lse, torch.zeros(1, 6, 2, dtype=torch.bool))
    else:
        assert_nan_exactly_at(out, ref_out, reached[None])
        assert_nan_exactly_at(lse, ref_lse, reached[None])
    assert (out[0, 0] == 0).all() and (lse[0, 0] == float("-inf")).all()

    dq, dk, dv, dbias = grads
    ref_dq, ref_dk, ref_dv, ref_dbias = ref_grads
    # a reached row's gradient reaches every key it sees; the gradient of v is that of the
    # probabilities, NaN only in the rows whose probabilities are
    keys_seen = (reached.T[:, :, None] & SEES).any(1).any(0)  # (Sk,): seen by a reached row
    assert_nan_exactly_at(dq, ref_dq, reached[None])
    assert_nan_exactly_at(dk, ref_dk, keys_seen[None, :, None])
    assert_nan_exactly_at(dv, ref_dv, keys_seen[None, :, None] & (where != "v"))
    assert_nan_exactly_at(dbias, ref_dbias, reached.T[None, :, :, None] & SEES)
    assert (dq[0, 0] == 0).all() and (dbias[:, :, ~SEES] == 0).all()


def test_cpu_attention_keeps_nan(monkeypatch):
    """omniattn.attention on CPU tensors without the interpreter is the reference: NaN in q and
    in k reach the rows that see them there too."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    poisoned, _, _ = nan_inputs("k")
    poisoned[0][0, 1, 0, 0] = NAN  # row 1 sees keys 0 and 1, not the NaN key 2
    q, k, v, bias = (t.float() for t in poisoned)
    dout = torch.randn(1, 6, 2, 4)
    (out, lse), grads = forward_backward(q, k, v, bias, dout, attention=omniattn.attention)
    (ref_out, ref_lse), ref_grads = forward_backward(q, k, v, bias, dout)
    assert out.isnan().any(-1)[0, :, 0].tolist() == [False, True, False, True, True, True]
    for got, want in zip((out, lse, *grads), (ref_out, ref_lse, *ref_grads)):
        torch.testing.assert_close(got, want, equal_nan=True)


def saved_bytes(run, inputs) -> int:
    """Bytes autograd keeps for the backward while run() records its graph: each storage once,
    the caller's inputs left out."""
    theirs = {t.untyped_storage().data_ptr() for t in inputs}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in theirs:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()  # noqa: F841 (the graph, and what it saved, stays alive until counted)
        return sum(saved.values())


@pytest.mark.parametrize("masks", ["causal", "window", "row lengths", "numeric mask", "bias",
                                   "block mask", "top-k"])
def test_saved_for_backward_grows_linearly(masks):
    """The checkpointed chunks keep O(Sq * D + inputs) for the backward, no (Sq, Sk) mask: 4x
    the rows, 4x the bytes. fp16 inputs: their float32 copies are the part that grows."""
    saved = []
    for seqlen in (512, 2048):
        torch.manual_seed(7)
        q = torch.randn(1, seqlen, 2, 8, dtype=torch.float16, requires_grad=True)
        k, v = (torch.randn(1, seqlen, 1, 8, dtype=torch.float16) for _ in range(2))
        options = {"causal": True}
        if masks == "window":
            options["window"] = (100, -1)
        elif masks == "row lengths":
            options["seqlens_k_per_row"] = torch.randint(0, seqlen, (1, seqlen), dtype=torch.int32)
        elif masks == "numeric mask":
            options["attn_mask"] = (torch.rand(1, 1, seqlen, seqlen) > 0.5).half()
        elif masks == "bias":
            options["attn_bias"] = torch.randn(1, 1, seqlen, seqlen, dtype=torch.float16)
        elif masks == "block mask":
            options = {"block_mask": causal_block_mask(seqlen, seqlen, 128)}
        elif masks == "top-k":  # per-key scores: each chunk selects its rows' keys inside
            options.update(topk=64, topk_scores=torch.randn(1, 1, 1, seqlen))
        inputs = [q, k, v, *(t for t in options.values() if isinstance(t, torch.Tensor))]
        saved.append(saved_bytes(lambda: attention_reference(q, k, v, **options), inputs))
    assert saved[1] <= 4.5 * saved[0], saved
