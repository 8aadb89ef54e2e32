"""omniattn.api.attention_backward: the backward of an attention call alone, from a given out
and lse, equal to autograd of `attention` itself (the 2x rule against the float64 reference),
on the reference path and through the kernels (the interpreter without a GPU); from a larger
softmax's out and lse, each part's share of its gradients; no forward runs."""
from __future__ import annotations

import pytest
import torch

import omniattn
from helpers import ATOL, DEVICE, GPU, max_error, random_qkv
from omniattn.api import attention_backward

DTYPE = torch.bfloat16 if GPU else torch.float32
SEQLEN_Q, SEQLEN_K = 40, 33


def _options(mask: str, heads: int, generator) -> dict:
    """attention's keywords of a mask case (a bias gets its gradient)."""
    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(DEVICE, DTYPE)

    if mask == "causal_softcap":
        return {"causal": True, "softcap": 3.0, "softmax_scale": 0.3}
    if mask == "window_key_bias":
        return {"window": (9, 4), "attn_bias": randn(1, heads, 1, SEQLEN_K).requires_grad_()}
    if mask == "full_bias_mask":
        return {"attn_bias": randn(2, 1, SEQLEN_Q, SEQLEN_K).requires_grad_(),
                "attn_mask": torch.rand(2, heads, SEQLEN_Q, SEQLEN_K, generator=generator)
                .to(DEVICE) > 0.3}
    if mask == "row_bias":  # one column for every key: the kernels take it from dlse
        return {"causal": True, "attn_bias": randn(2, heads, SEQLEN_Q, 1).requires_grad_()}
    if mask == "block_mask":
        blocks = torch.rand(2, heads, 3, 3, generator=generator) < 0.7
        return {"block_mask": omniattn.block_mask_from_blocks(
            blocks.to(DEVICE), 16, seq_lengths=(SEQLEN_Q, SEQLEN_K))}
    if mask == "row_lengths":
        lengths = torch.randint(0, SEQLEN_K + 1, (2, SEQLEN_Q), generator=generator)
        return {"seqlens_k_per_row": lengths.to(DEVICE, torch.int32), "window": (20, -1)}
    if mask == "topk":
        return {"causal": True, "topk": 7, "topk_scores": randn(2, 1, 1, SEQLEN_K)}
    raise ValueError(mask)


def _attention_gradients(q, k, v, dout, dlse, options, reference: bool):
    """(out, lse, dq, dk, dv[, dbias]) of autograd through attention (or, reference, through
    the float64 reference)."""
    leaves = [q, k, v] + ([options["attn_bias"]] if "attn_bias" in options else [])
    leaves = [t.detach().double() if reference else t.detach() for t in leaves]
    leaves = [t.requires_grad_() for t in leaves]
    call = {**options, **({"attn_bias": leaves[3]} if len(leaves) == 4 else {})}
    if reference:
        out, lse = omniattn.reference.attention_reference(*leaves[:3], return_lse=True, **call)
    else:
        out, lse = omniattn.attention(*leaves[:3], return_lse=True, **call)
    loss = (out * dout.to(out.dtype)).sum()
    if dlse is not None:
        loss = loss + (lse.masked_fill(torch.isinf(lse), 0.0) * dlse.to(lse.dtype)).sum()
    return (out.detach(), lse.detach(), *torch.autograd.grad(loss, leaves))


def _check(got, exact, attention_grads) -> None:
    """The 2x rule: each gradient within twice attention's own error (+ atol) of the float64
    reference's."""
    for name, g, e, a in zip(("dq", "dk", "dv", "dbias"), got, exact, attention_grads):
        assert g.shape == e.shape and g.dtype == a.dtype, name
        err, base = max_error(g, e), max_error(a, e)
        assert err <= 2 * base + ATOL[DTYPE], \
            f"{name}: error {err:.3g} > 2 x attention's {base:.3g} + atol {ATOL[DTYPE]:.1g}"


PATHS = ["reference", "kernels"]
MASKS = ["causal_softcap", "window_key_bias", "full_bias_mask", "row_bias", "block_mask",
         "row_lengths", "topk"]


# (mask, whether a gradient reaches lse too)
CASES = [(mask, True) for mask in MASKS] + [("causal_softcap", False), ("window_key_bias", False)]


@pytest.mark.parametrize("mask, with_dlse", CASES,
                         ids=[m + ("" if d else "-no_dlse") for m, d in CASES])
@pytest.mark.parametrize("path", PATHS)
def test_equals_attention_autograd(monkeypatch, path, mask, with_dlse):
    if path == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    if path == "kernels" and mask == "topk":
        pytest.skip("top-k calls take the reference on every device")
    generator = torch.Generator().manual_seed(MASKS.index(mask))
    q, k, v = random_qkv(2, SEQLEN_Q, SEQLEN_K, 4, 2, 16, DTYPE, requires_grad=False)
    options = _options(mask, 4, generator)
    dout = torch.randn(q.shape, generator=generator).to(DEVICE, DTYPE)
    dlse = torch.randn(2, 4, SEQLEN_Q, generator=generator).to(DEVICE) if with_dlse else None
    out, lse, *attention_grads = _attention_gradients(q, k, v, dout, dlse, options, False)
    exact = _attention_gradients(q, k, v, dout, dlse, options, True)[2:]
    got = attention_backward(dout, q, k, v, out, lse, dlse, **options)
    assert (got[3] is None) == ("attn_bias" not in options)
    _check([g for g in got if g is not None], exact, attention_grads)


def _sum(a, b):
    return (a.float() + b.float()).to(a.dtype)


@pytest.mark.parametrize("cut", ["one_key", "key_halves", "row_halves"])
@pytest.mark.parametrize("path", PATHS)
def test_parts_of_a_larger_softmax(monkeypatch, path, cut):
    """A call cut in two, each part's backward from the whole call's out and lse (the pieces
    of the distributed ring). Keys cut: dq sums the parts', dk / dv / the key bias's gradient
    join them; a part of one key has a one-column bias, whose gradient sums over its key. Rows
    cut (strided views of out, lse and dlse): dq joins, the others sum."""
    if path == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    generator = torch.Generator().manual_seed(len(cut))
    q, k, v = random_qkv(2, SEQLEN_Q, SEQLEN_K, 4, 1, 16, DTYPE, requires_grad=False)
    bias = torch.randn(1, 4, 1, SEQLEN_K, generator=generator).to(DEVICE, DTYPE)
    dout = torch.randn(q.shape, generator=generator).to(DEVICE, DTYPE)
    dlse = torch.randn(2, 4, SEQLEN_Q, generator=generator).to(DEVICE)
    options = {"attn_bias": bias.requires_grad_(), "softcap": 2.0}
    out, lse, *attention_grads = _attention_gradients(q, k, v, dout, dlse, options, False)
    exact = _attention_gradients(q, k, v, dout, dlse, options, True)[2:]
    if cut == "row_halves":
        parts = [attention_backward(dout[:, rows], q[:, rows], k, v, out[:, rows],
                                    lse[..., rows], dlse[..., rows], **options)
                 for rows in (slice(0, 20), slice(20, SEQLEN_Q))]
        got = [torch.cat([parts[0][0], parts[1][0]], dim=1)] + [
            _sum(parts[0][i], parts[1][i]) for i in (1, 2, 3)]
    else:
        split = 1 if cut == "one_key" else 20
        parts = [attention_backward(dout, q, k[:, keys], v[:, keys], out, lse, dlse,
                                    attn_bias=bias[..., keys].detach().requires_grad_(),
                                    softcap=2.0)
                 for keys in (slice(0, split), slice(split, SEQLEN_K))]
        got = [_sum(parts[0][0], parts[1][0])] + [
            torch.cat([parts[0][i], parts[1][i]], dim=1 if i < 3 else 3) for i in (1, 2, 3)]
    _check(got, exact, attention_grads)


@pytest.mark.parametrize("path", PATHS)
def test_packed_sequences(monkeypatch, path):
    """Packed (varlen) calls: lse (H, total_q), causal per sequence."""
    if path == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    generator = torch.Generator().manual_seed(5)
    cu_q = torch.tensor([0, 13, 13, 40], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 9, 30, 52], dtype=torch.int32, device=DEVICE)
    q, k, v = (torch.randn(total, heads, 16, generator=generator).to(DEVICE, DTYPE)
               for total, heads in ((40, 4), (52, 2), (52, 2)))
    dout = torch.randn(q.shape, generator=generator).to(DEVICE, DTYPE)
    dlse = torch.randn(4, 40, generator=generator).to(DEVICE)
    options = {"causal": True, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    out, lse, *attention_grads = _attention_gradients(q, k, v, dout, dlse, options, False)
    exact = _attention_gradients(q, k, v, dout, dlse, options, True)[2:]
    _check(attention_backward(dout, q, k, v, out, lse, dlse, **options)[:3], exact,
           attention_grads)


def test_runs_no_forward(monkeypatch):
    """Through the kernels: the backward's launcher alone, no forward launcher."""
    from omniattn import autograd

    calls = []
    forward, backward = autograd._forward_impl, autograd._backward_impl
    monkeypatch.setattr(autograd, "_forward_impl", lambda *a: calls.append("fwd") or forward(*a))
    monkeypatch.setattr(autograd, "_backward_impl",
                        lambda *a: calls.append("bwd") or backward(*a))
    q, k, v = random_qkv(1, 32, 32, 2, 2, 16, DTYPE, requires_grad=False)
    out, lse = omniattn.attention(q, k, v, causal=True, return_lse=True)
    calls.clear()
    attention_backward(torch.ones_like(out), q, k, v, out, lse, causal=True)
    assert calls == ["bwd"]


def _bad_calls():
    """(id, the call's arguments changed, expected exception, a regex of its message)."""
    lse = torch.zeros(1, 2, 8)
    return [
        ("dropout", {"dropout_p": 0.1}, ValueError, r"dropout_p must be 0 in attention_backward"),
        ("dout_rows", {"dout": torch.zeros(1, 7, 2, 16)}, ValueError,
         r"dout must have shape \(1, 8, 2, 16\), dtype torch.float32 and q's device cpu, got "
         r"shape \(1, 7, 2, 16\)"),
        ("lse_dtype", {"lse": lse.double()}, ValueError,
         r"lse must have shape \(1, 2, 8\), dtype torch.float32 .* dtype torch.float64"),
        ("dlse_rows", {"dlse": lse[..., :7]}, ValueError, r"dlse must have shape \(1, 2, 8\)"),
        ("out_type", {"out": 0.0}, TypeError, r"out must be a torch.Tensor, got float"),
        ("keyword", {"casual": True}, TypeError, r"unexpected keyword arguments \['casual'\]"),
    ]


@pytest.mark.parametrize("change, error, message", [c[1:] for c in _bad_calls()],
                         ids=[c[0] for c in _bad_calls()])
def test_errors_name_the_argument(change, error, message):
    q, k, v = random_qkv(1, 8, 8, 2, 2, 16, torch.float32, device="cpu", requires_grad=False)
    given = {"dout": torch.zeros_like(q), "out": torch.zeros_like(q),
             "lse": torch.zeros(1, 2, 8), "dlse": None}
    options = {key: value for key, value in change.items() if key not in given}
    given.update({key: value for key, value in change.items() if key in given})
    with pytest.raises(error, match=message) as caught:
        attention_backward(given["dout"], q, k, v, given["out"], given["lse"], given["dlse"],
                           **options)
    assert "tensor(" not in str(caught.value)
