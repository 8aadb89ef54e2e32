"""omniattn.attention end to end: autograd, backends, lse, empty sizes, compile, determinism."""
from __future__ import annotations

import pytest
import torch

import omniattn
from helpers import DEVICE, GPU, check_against_reference, random_qkv


def _run(q, k, v, dout, **kwargs):
    out, lse = omniattn.attention(q, k, v, return_lse=True, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out, lse, grads


@pytest.mark.parametrize("causal", [False, True])
def test_attention_autograd(causal):
    torch.manual_seed(1)
    q, k, v = random_qkv(2, 37, 21, 4, 2, 32, torch.float16)
    dout = torch.randn_like(q)
    out, lse, grads = _run(q, k, v, dout, causal=causal, softcap=8.0)
    check_against_reference(out, lse, grads, q, k, v, dout, causal=causal, softcap=8.0)


def test_cpu_reference_backend(monkeypatch):
    """CPU tensors outside the interpreter take the reference path, with the same semantics."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(2)
    q, k, v = random_qkv(1, 40, 30, 4, 1, 16, torch.float32, device="cpu")
    dout = torch.randn_like(q)
    out, lse, grads = _run(q, k, v, dout, causal=True, window=(7, -1))
    check_against_reference(out, lse, grads, q, k, v, dout, causal=True, window=(7, -1))


@pytest.mark.parametrize("mask", ["causal", "row_lengths"])
@pytest.mark.parametrize("out_in_loss", [True, False])
def test_lse_gradient(out_in_loss, mask):
    """lse is differentiable: d lse / d s = p enters the backward pass as delta - dlse; a loss
    of lse alone leaves the output without a gradient (no dout reaches the backward pass).
    Per-row key lengths alone run with the rows in length order: dlse follows them there."""
    torch.manual_seed(3)
    seqlen_q = 19 if mask == "causal" else 45  # lengths: more than one query tile
    q, k, v = random_qkv(1, seqlen_q, 27, 2, 2, 32, torch.float32)
    weights = torch.randn(1, 2, seqlen_q, device=DEVICE)
    options = dict(causal=True) if mask == "causal" else dict(
        seqlens_k_per_row=torch.randint(1, 28, (1, seqlen_q), dtype=torch.int32, device=DEVICE))
    out, lse = omniattn.attention(q, k, v, return_lse=True, **options)
    loss = (lse.double() * weights).sum()
    if out_in_loss:
        loss = loss + (out.double() ** 2).sum()
    grads = torch.autograd.grad(loss, (q, k, v) if out_in_loss else (q, k))
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = omniattn.reference.attention_reference(*ref_inputs, return_lse=True,
                                                              **options)
    ref_loss = (ref_lse * weights).sum()
    if out_in_loss:
        ref_loss = ref_loss + (ref_out ** 2).sum()
    else:
        ref_inputs = ref_inputs[:2]
    for got, ref in zip(grads, torch.autograd.grad(ref_loss, ref_inputs)):
        torch.testing.assert_close(got.double(), ref, atol=2e-4, rtol=1e-3)


def test_rows_that_see_nothing():
    """Causal with Sq > Sk: the first Sq - Sk rows see no key. Output 0, lse -inf, grads 0."""
    q, k, v = random_qkv(1, 30, 10, 2, 2, 32, torch.float16)
    dout = torch.randn_like(q)
    out, lse, (dq, dk, dv) = _run(q, k, v, dout, causal=True)
    assert (out[:, :20] == 0).all() and (lse[:, :, :20] == float("-inf")).all()
    assert (dq[:, :20] == 0).all()
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences(seqlen_q, seqlen_k):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 2, 1, 16, torch.float16)
    out, lse = omniattn.attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 2, seqlen_q)
    assert (out == 0).all() and (lse == float("-inf")).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


def test_strided_inputs():
    """q/k/v as views of one packed qkv tensor (last dim contiguous, other strides arbitrary)."""
    torch.manual_seed(4)
    qkv = torch.randn(2, 33, 3, 4, 32, device=DEVICE, dtype=torch.float16, requires_grad=True)
    q, k, v = qkv.unbind(2)
    dout = torch.randn(2, 33, 4, 32, device=DEVICE, dtype=torch.float16)
    out, lse, grads = _run(q, k, v, dout, causal=True)
    check_against_reference(out, lse, grads, q, k, v, dout, causal=True)


@pytest.mark.interpreter
@pytest.mark.skipif(GPU, reason="interpreter case runs where there is no GPU")
def test_torch_compile_traces_the_plan():
    """fullgraph tracing plans the call on fake tensors (no addresses: the bases' alignment is
    checked when the op runs); aot_eager, as inductor would need a C++ compiler here."""
    torch.manual_seed(5)
    q, k, v = random_qkv(1, 40, 40, 2, 1, 16, torch.float16)

    def step(q, k, v):
        return omniattn.attention(q, k, v, causal=True, deterministic=True).float().square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    grads = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    ref_grads = torch.autograd.grad(step(q, k, v), (q, k, v))
    for got, ref in zip(grads, ref_grads):
        assert torch.equal(got, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_torch_compile_fullgraph():
    torch.manual_seed(5)
    q, k, v = random_qkv(2, 256, 256, 8, 2, 64, torch.bfloat16)

    def step(q, k, v):
        # deterministic: the gradients are compared bitwise
        return omniattn.attention(q, k, v, causal=True, deterministic=True).float().square().sum()

    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    ref_loss = step(q, k, v)
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
    torch.testing.assert_close(loss, ref_loss)
    for got, ref in zip(grads, ref_grads):
        assert torch.equal(got, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("causal", [False, True])
def test_backward_is_deterministic(causal):
    """deterministic=True: bitwise-identical gradients over 10 runs (the default path adds dQ
    with atomics, whose order varies)."""
    torch.manual_seed(6)
    q, k, v = random_qkv(2, 1000, 1024, 8, 2, 128, torch.bfloat16)
    dout = torch.randn_like(q)
    first = _run(q, k, v, dout, causal=causal, deterministic=True)[2]
    for _ in range(9):
        again = _run(q, k, v, dout, causal=causal, deterministic=True)[2]
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_int64_addressing():
    """K/V of 2**31+ elements: the last head of the last keys sits past 2**31 from the base. The
    same head computed from small, separately allocated tensors must agree bitwise."""
    seqlen_k, heads, head_dim = (1 << 31) // (16 * 128) + 1000, 16, 128
    torch.manual_seed(7)
    q = torch.randn(1, 128, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, seqlen_k, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    assert k.numel() > 2 ** 31
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    dout = torch.randn_like(q)
    # deterministic: the gradients are compared bitwise
    out, lse, (dq, dk, dv) = _run(q, k, v, dout, causal=True, deterministic=True)
    last = [t[:, :, -1:].detach().contiguous().requires_grad_() for t in (q, k, v)]
    out_last, lse_last, grads_last = _run(*last, dout[:, :, -1:].contiguous(), causal=True,
                                          deterministic=True)
    assert torch.equal(out[:, :, -1:], out_last)
    assert torch.equal(lse[:, -1:], lse_last)
    for full, small in zip((dq, dk, dv), grads_last):
        assert torch.equal(full[:, :, -1:], small)


@pytest.mark.parametrize("shape", [(2, 1, 1, 23), (1, 4, 11, 23), (2, 2, 11, 1), (2, 4, 11, 23),
                                   (1, 1, 11, 1)], ids=str)
def test_mask_and_bias_on_the_reference_path(monkeypatch, shape):
    """CPU tensors outside the interpreter: every broadcast form of attn_mask / attn_bias, and
    dbias back in the bias's own shape, against an independent naive float64 attention."""
    from test_reference import naive_attention

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    generator = torch.Generator().manual_seed(sum(shape))
    q, k, v = (torch.randn(2, n, h, 16, generator=generator, dtype=torch.float64)
               for n, h in ((11, 4), (23, 2), (23, 2)))
    q, k, v = q.float().requires_grad_(), k.float().requires_grad_(), v.float().requires_grad_()
    keep = torch.rand(shape, generator=generator) > 0.3
    bias = torch.randn(shape, generator=generator).requires_grad_()
    out = omniattn.attention(q, k, v, attn_mask=keep, attn_bias=bias, causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, bias), dout)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    ref_out, _ = naive_attention(*exact[:3], causal=True, keep=keep, bias=exact[3])
    ref_grads = torch.autograd.grad(ref_out, exact, dout.double())
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-4)
    assert grads[3].shape == bias.shape
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-4)
