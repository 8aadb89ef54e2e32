"""Bad-input tests for `omniattn.attention`.

Every error must be raised by validation, before anything is computed or launched, with the
right exception type and a message naming the argument and what was expected. Tiny CPU tensors
only, so the whole file runs in well under a second.
"""
from __future__ import annotations

import re

import pytest
import torch

import omniattn
import omniattn.api as api_mod
from omniattn import validation
from omniattn import attention

B, S, H, D = 1, 4, 2, 8


def make(*, b=B, sq=S, sk=None, h=H, hk=None, d=D, dtype=torch.float16, requires_grad=False):
    sk = S if sk is None else sk
    hk = h if hk is None else hk
    q = torch.randn(b, sq, h, d, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(b, sk, hk, d, dtype=dtype)
    v = torch.randn(b, sk, hk, d, dtype=dtype)
    return q, k, v


@pytest.fixture(autouse=True)
def _no_compute(monkeypatch):
    """Fail loudly if a bad-input call gets as far as a backend: errors must come first."""
    def boom(*args, **kwargs):
        raise AssertionError("a backend was called: validation should have rejected the input")
    monkeypatch.setattr(api_mod, "triton_attention", boom)
    monkeypatch.setattr(api_mod, "decode_attention", boom)
    monkeypatch.setattr(api_mod, "attention_reference", boom)


def esc(s: str) -> str:
    return re.escape(s)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_control_valid_inputs_reach_backend(dtype):
    q, k, v = make(dtype=dtype)
    with pytest.raises(AssertionError, match="a backend was called"):
        attention(q, k, v, causal=True, window=(2, 0), softmax_scale=0.5, softcap=30.0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.bool, torch.complex64])
def test_q_unsupported_dtype(dtype):
    q, k, v = make()
    q = torch.zeros(B, S, H, D, dtype=dtype)
    with pytest.raises(TypeError, match=esc(f"q has dtype {dtype}; expected torch.float16, "
                                            f"torch.bfloat16 or torch.float32")):
        attention(q, k, v)


def test_v_unsupported_dtype():
    q, k, v = make()
    with pytest.raises(TypeError, match=r"^v has dtype torch\.float64; expected"):
        attention(q, k, v.double())


def test_mixed_dtypes():
    q, k, v = make(dtype=torch.float16)
    with pytest.raises(TypeError, match=esc("q, k, v must share one dtype, got torch.float16, "
                                            "torch.float32, torch.float16")):
        attention(q, k.float(), v)


def test_mixed_dtypes_bf16_fp16():
    q, k, v = make(dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"q, k, v must share one dtype.*torch\.bfloat16, "
                                        r"torch\.bfloat16, torch\.float16"):
        attention(q, k, v.half())


@pytest.mark.parametrize("bad", [[[1.0]], None, 3.0, "q"])
def test_q_not_a_tensor(bad):
    _, k, v = make()
    with pytest.raises(TypeError, match=f"^q must be a torch.Tensor, got {type(bad).__name__}$"):
        attention(bad, k, v)


def test_k_not_a_tensor_numpy():
    np = pytest.importorskip("numpy")
    q, k, v = make()
    with pytest.raises(TypeError, match="^k must be a torch.Tensor, got ndarray$"):
        attention(q, np.zeros((B, S, H, D), dtype=np.float16), v)


def test_q_3d_without_cu_seqlens():
    q, k, v = make()
    q3 = q.reshape(B * S, H, D)
    with pytest.raises(ValueError, match=r"^q must be 4-D \(batch, seqlen, heads, head_dim\), "
                                         r"got shape \(4, 2, 8\).*cu_seqlens_q/k"):
        attention(q3, k, v)


def test_k_5d():
    q, k, v = make()
    with pytest.raises(ValueError, match=r"^k must be 4-D .*got shape \(1, 1, 4, 2, 8\)"):
        attention(q, k.unsqueeze(0), v)


def test_k_v_shape_mismatch():
    q, k, _ = make()
    v = torch.randn(B, S + 1, H, D, dtype=q.dtype)
    with pytest.raises(ValueError, match=esc("k and v must have the same shape (B, Sk, Hk, D), "
                                             "got k (1, 4, 2, 8) and v (1, 5, 2, 8)")):
        attention(q, k, v)


def test_k_v_head_dim_mismatch():
    """A different value head dim is not supported: reported as a k/v shape mismatch."""
    q, k, _ = make()
    v = torch.randn(B, S, H, 2 * D, dtype=q.dtype)
    with pytest.raises(ValueError, match=r"k and v must have the same shape.*v \(1, 4, 2, 16\)"):
        attention(q, k, v)


def test_batch_mismatch():
    q, _, _ = make()
    _, k, v = make(b=2)
    with pytest.raises(ValueError, match="^k has batch size 2 but q has 1$"):
        attention(q, k, v)


def test_head_dim_mismatch():
    q, _, _ = make(d=8)
    _, k, v = make(d=16)
    with pytest.raises(ValueError, match=r"^k/v have head_dim 16 but q has 8$"):
        attention(q, k, v)


def test_head_dim_too_large():
    q, k, v = make(d=320)
    with pytest.raises(ValueError, match=r"^head_dim must be in \[1, 256\], got 320 "
                                         r"\(q shape \(1, 4, 2, 320\)"):
        attention(q, k, v)


def test_head_dim_zero():
    q, k, v = make(d=0)
    with pytest.raises(ValueError, match=r"^head_dim must be in \[1, 256\], got 0"):
        attention(q, k, v)


@pytest.mark.parametrize("h,hk", [(3, 2), (2, 4), (2, 0)])
def test_heads_not_multiple_of_kv_heads(h, hk):
    q, k, v = make(h=h, hk=hk)
    with pytest.raises(ValueError, match=esc(f"the number of query heads ({h}) must be a multiple "
                                             f"of the number of key/value heads ({hk}) for GQA/MQA")):
        attention(q, k, v)


def test_q_transposed_view_not_contiguous_in_last_dim():
    q, k, v = make()
    qt = torch.randn(B, S, D, H, dtype=q.dtype).transpose(2, 3)  # shape (B, S, H, D), stride(-1)=H
    assert qt.shape == q.shape and qt.stride(-1) != 1
    with pytest.raises(ValueError, match=esc(f"q must be contiguous in its last (head_dim) "
                                             f"dimension, got strides {qt.stride()}; call "
                                             f"q.contiguous() first")):
        attention(qt, k, v)


def test_v_broadcast_last_dim_not_contiguous():
    q, k, _ = make()
    v = torch.randn(B, S, H, 1, dtype=q.dtype).expand(B, S, H, D)  # stride(-1) == 0
    with pytest.raises(ValueError, match=r"^v must be contiguous in its last \(head_dim\) "
                                         r"dimension.*call v\.contiguous\(\) first"):
        attention(q, k, v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="mixed devices need a CUDA GPU")
def test_mixed_devices():
    q, k, v = make()
    with pytest.raises(ValueError, match=r"^q, k, v must be on one device, got cpu, cuda:0, cpu$"):
        attention(q, k.cuda(), v)


@pytest.mark.parametrize("causal", [1, 0, None, "True", torch.tensor(True)])
def test_causal_not_bool(causal):
    q, k, v = make()
    with pytest.raises(TypeError, match=f"^causal must be a bool, got {type(causal).__name__}$"):
        attention(q, k, v, causal=causal)


@pytest.mark.parametrize("window, got", [
    (3, "int"), ((1,), "tuple[int]"), ((1, 2, 3), "tuple[int, int, int]"),
    ((1.0, 2), "tuple[float, int]"), ((True, 0), "tuple[bool, int]"), ("ab", "str"),
    ({0: 1, 1: 2}, "dict"), (torch.tensor([1, 2]), "Tensor"),
    ((torch.tensor(1), 2), "tuple[Tensor, int]")])
def test_window_wrong_type(window, got):
    """The types, never the values: a window of tensors must not print them."""
    q, k, v = make()
    with pytest.raises(TypeError, match=esc(f"window must be a (left, right) pair of ints, "
                                            f"got {got}") + "$"):
        attention(q, k, v, window=window)


@pytest.mark.parametrize("window", [(-2, 0), (0, -5), [-3, -3]])
def test_window_below_minus_one(window):
    q, k, v = make()
    with pytest.raises(ValueError, match=esc(f"window offsets must be >= 0, or -1 for unbounded, "
                                             f"got {tuple(window)}")):
        attention(q, k, v, window=window)


@pytest.mark.parametrize("softcap", [-1.0, -1e-6, float("-inf"), float("inf"), float("nan")])
def test_softcap_negative_or_not_finite(softcap):
    q, k, v = make()
    with pytest.raises(ValueError, match=esc(f"softcap must be a finite number >= 0 (0 disables it), "
                                             f"got {softcap}")):
        attention(q, k, v, softcap=softcap)


@pytest.mark.parametrize("softcap", [None, "30", True])
def test_softcap_wrong_type(softcap):
    q, k, v = make()
    with pytest.raises(TypeError, match=f"^softcap must be a float, got {type(softcap).__name__}$"):
        attention(q, k, v, softcap=softcap)


@pytest.mark.parametrize("scale", [0.0, 0, -0.5, float("nan"), float("inf"), float("-inf")])
def test_softmax_scale_not_finite_positive(scale):
    q, k, v = make()
    with pytest.raises(ValueError, match=esc(f"softmax_scale must be a finite positive number, "
                                             f"got {scale}")):
        attention(q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("scale", ["0.1", True, torch.tensor(0.1)])
def test_softmax_scale_wrong_type(scale):
    q, k, v = make()
    with pytest.raises(TypeError, match=f"^softmax_scale must be a float or None, got "
                                        f"{type(scale).__name__}$"):
        attention(q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("p", ["0.1", None, False])
def test_dropout_p_wrong_type(p):
    q, k, v = make()
    with pytest.raises(TypeError, match=f"^dropout_p must be a float, got {type(p).__name__}$"):
        attention(q, k, v, dropout_p=p)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan")])
def test_dropout_p_out_of_range(p):
    q, k, v = make()
    with pytest.raises(ValueError, match=esc(f"dropout_p must be a float in [0, 1), got {p!r}")):
        attention(q, k, v, dropout_p=p)


@pytest.mark.parametrize("det", [1, None, "yes"])
def test_deterministic_not_bool(det):
    q, k, v = make()
    with pytest.raises(TypeError, match=f"^deterministic must be a bool, got {type(det).__name__}$"):
        attention(q, k, v, deterministic=det)


@pytest.mark.parametrize("ret", [1, "no", None])
def test_return_lse_not_bool(ret):
    q, k, v = make()
    with pytest.raises(TypeError, match=f"^return_lse must be a bool, got {type(ret).__name__}$"):
        attention(q, k, v, return_lse=ret)


def packed(total_q=2 * S, total_k=2 * S):
    q = torch.randn(total_q, H, D, dtype=torch.float16)
    k = torch.randn(total_k, H, D, dtype=torch.float16)
    return q, k, k.clone()


CU = torch.tensor([0, S, 2 * S], dtype=torch.int32)


@pytest.mark.parametrize("lens, error, message", [
    (torch.full((B, S), S, dtype=torch.int64), TypeError,
     "seqlens_k_per_row must be int32, got torch.int64"),
    ([S] * S, TypeError, "seqlens_k_per_row must be a torch.Tensor, got list"),
    (torch.full((B, S + 1), S, dtype=torch.int32), ValueError,
     f"seqlens_k_per_row has shape {(B, S + 1)}; expected {(B, S)} or {(B * S,)}"),
    (torch.tensor([[0, 1, S + 1, 2]], dtype=torch.int32), ValueError,
     f"seqlens_k_per_row must lie in [0, Sk] of its row's sequence; entry (0, 2) is {S + 1} "
     f"(Sk = {S}); pass check_inputs=False"),
    (torch.tensor([0, -1, 1, 2], dtype=torch.int32), ValueError,
     "seqlens_k_per_row must lie in [0, Sk] of its row's sequence; entry (0, 1) is -1"),
])
def test_seqlens_k_per_row_invalid(lens, error, message):
    q, k, v = make()
    with pytest.raises(error, match="^" + esc(message)):
        attention(q, k, v, seqlens_k_per_row=lens)


def test_seqlens_k_per_row_checked_again_after_a_change():
    """A lengths tensor checked once is not read again while unchanged (its calls can replay
    plans), but an in-place write, or keys fewer than it was checked against, check it again."""
    q, k, v = make()
    lens = torch.full((B, S), S, dtype=torch.int32)
    for _ in range(2):
        with pytest.raises(AssertionError, match="a backend was called"):
            attention(q, k, v, seqlens_k_per_row=lens)
    assert validation.known_checked(lens, k)
    q_short, k_short, v_short = make(sk=S - 1)
    with pytest.raises(ValueError, match="^" + esc("seqlens_k_per_row must lie in [0, Sk]")):
        attention(q_short, k_short, v_short, seqlens_k_per_row=lens)
    lens[0, 1] = S + 1
    assert not validation.known_checked(lens, k)
    with pytest.raises(ValueError, match="^" + esc("seqlens_k_per_row must lie in [0, Sk]")):
        attention(q, k, v, seqlens_k_per_row=lens)


def test_seqlens_k_per_row_unchecked_reaches_backend():
    """check_inputs=False skips the value check (no host sync), not the shape checks."""
    q, k, v = make()
    lens = torch.full((B, S), S + 5, dtype=torch.int32)
    with pytest.raises(AssertionError, match="a backend was called"):
        attention(q, k, v, seqlens_k_per_row=lens, check_inputs=False)


def test_seqlens_k_per_row_packed_bound_is_per_sequence():
    q, k, v = packed(total_k=S + 2)
    cu_k = torch.tensor([0, S, S + 2], dtype=torch.int32)
    lens = torch.tensor([S] * S + [2, 3, 0, 0], dtype=torch.int32)  # row 5 sees 3 of 2 keys
    with pytest.raises(ValueError, match=esc("entry (5,) is 3 (Sk = 2)")):
        attention(q, k, v, cu_seqlens_q=CU, cu_seqlens_k=cu_k, seqlens_k_per_row=lens)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(cu_seqlens_q=CU), ValueError, "varlen needs both cu_seqlens_q and cu_seqlens_k"),
    (dict(cu_seqlens_q=CU.long(), cu_seqlens_k=CU), TypeError,
     "cu_seqlens_q must be int32, got torch.int64"),
    (dict(cu_seqlens_q=CU, cu_seqlens_k=CU[None]), ValueError,
     "cu_seqlens_k must be 1-D (batch + 1,) with batch >= 1, got shape (1, 3)"),
    (dict(cu_seqlens_q=torch.tensor([0, 5, 3], dtype=torch.int32), cu_seqlens_k=CU), ValueError,
     "cu_seqlens_q must start at 0, end at the packed length 8 and never decrease, got [0, 5, 3]"),
    (dict(cu_seqlens_q=CU, cu_seqlens_k=torch.tensor([0, 7], dtype=torch.int32)), ValueError,
     "cu_seqlens_k must start at 0, end at the packed length 8"),
    (dict(cu_seqlens_q=CU, cu_seqlens_k=torch.tensor([0, 2, 6, 8], dtype=torch.int32)),
     ValueError, "cu_seqlens_q and cu_seqlens_k must have one entry per sequence + 1, got 3 and 4"),
    (dict(cu_seqlens_q=CU, cu_seqlens_k=CU, max_seqlen_q=S - 1), ValueError,
     f"max_seqlen_q = {S - 1} is shorter than the longest sequence ({S})"),
    (dict(cu_seqlens_q=CU, cu_seqlens_k=CU, max_seqlen_k=float(S)), TypeError,
     "max_seqlen_k must be an int or None, got float"),
    (dict(cu_seqlens_q=CU, cu_seqlens_k=CU, attn_mask=torch.ones(2 * S, 1, S + 1, dtype=torch.bool)),
     ValueError, f"attn_mask has shape ({2 * S}, 1, {S + 1}); packed sequences take (total_q="
                 f"{2 * S}, H in {{1,{H},{H}}}, max_seqlen_k={S})"),
    (dict(cu_seqlens_q=CU, cu_seqlens_k=CU, attn_bias=torch.ones(1, 2 * S, H, S)),
     ValueError, f"attn_bias has shape (1, {2 * S}, {H}, {S}); packed sequences take"),
])
def test_varlen_invalid(kwargs, error, message):
    q, k, v = packed()
    with pytest.raises(error, match="^" + esc(message)):
        attention(q, k, v, **kwargs)


def test_max_seqlen_without_cu_seqlens():
    q, k, v = make()
    with pytest.raises(ValueError, match="^max_seqlen_q / max_seqlen_k belong to packed inputs"):
        attention(q, k, v, max_seqlen_q=S)


def test_varlen_k_must_be_3d():
    q, k, v = packed()
    with pytest.raises(ValueError, match=r"^k must be 3-D \(total, heads, head_dim\) with "
                                         r"cu_seqlens_q/k, got shape \(1, 8, 2, 8\)"):
        attention(q, k[None], v[None], cu_seqlens_q=CU, cu_seqlens_k=CU)


@pytest.mark.parametrize("shape", [(B, H, S), (2, H, S, S), (B, 3, S, S), (B, H, S + 1, S),
                                   (B, H, S, 2)])
def test_elementwise_shape(shape):
    q, k, v = make()
    with pytest.raises(ValueError, match=esc(f"attn_bias has shape {shape}, not broadcastable to "
                                             f"(B={B}, H in {{1,{H},{H}}}, Sq={S}, Sk={S})")):
        attention(q, k, v, attn_bias=torch.zeros(shape, dtype=torch.float16))


def test_elementwise_dtypes():
    q, k, v = make()
    with pytest.raises(TypeError, match="^attn_bias has dtype torch.int32; expected one of"):
        attention(q, k, v, attn_bias=torch.zeros(B, H, S, S, dtype=torch.int32))
    with pytest.raises(TypeError, match="^attn_mask has dtype torch.int64; expected one of "
                                        "torch.bool, torch.uint8"):
        attention(q, k, v, attn_mask=torch.ones(B, H, S, S, dtype=torch.int64))
    with pytest.raises(TypeError, match="^attn_mask must be a torch.Tensor or None, got list"):
        attention(q, k, v, attn_mask=[[True]])


def test_block_mask_wrong_type():
    q, k, v = make()
    with pytest.raises(TypeError, match=r"^block_mask must be an omniattn.BlockMask, got object "
                                        r"\(a FlexAttention BlockMask converts with "):
        attention(q, k, v, block_mask=object())


def test_block_mask_wrong_lengths():
    q, k, v = make()
    mask = omniattn.causal_block_mask(S + 16, S, block_size=16)
    with pytest.raises(ValueError, match=esc(f"block_mask was built for (Sq, Sk) = ({S + 16}, {S}), "
                                             f"but q/k have Sq = {S}, Sk = {S}")):
        attention(q, k, v, block_mask=mask)


def test_block_mask_wrong_heads():
    q, k, v = make()
    mask = omniattn.block_mask_from_blocks(torch.ones(1, H + 1, 1, 1, dtype=torch.bool), 16,
                                           seq_lengths=(S, S))
    with pytest.raises(ValueError, match=esc(f"block_mask lists have batch/head dims (1, {H + 1}); "
                                             f"expected (1 or {B}, 1 or {H})")):
        attention(q, k, v, block_mask=mask)


def test_options_are_keyword_only():
    q, k, v = make()
    with pytest.raises(TypeError, match="positional argument"):
        attention(q, k, v, True)


def test_unknown_keyword_sdpa_style():
    q, k, v = make()
    with pytest.raises(TypeError, match="unexpected keyword argument 'is_causal'"):
        attention(q, k, v, is_causal=True)


KEY_SCORES = torch.zeros(B, H, 1, S)


@pytest.mark.parametrize("options, error, message", [
    (dict(topk=0, topk_scores=KEY_SCORES), ValueError,
     "topk must be a positive int (the keys each row keeps), got 0"),
    (dict(topk=2.0, topk_scores=KEY_SCORES), TypeError, "topk must be a positive int or None, got "
                                                        "float"),
    (dict(topk=True, topk_scores=KEY_SCORES), TypeError, "topk must be a positive int or None, "
                                                         "got bool"),
    (dict(topk=torch.tensor(3), topk_scores=KEY_SCORES), TypeError,
     "topk must be a positive int or None, got Tensor"),
    (dict(topk_scores=KEY_SCORES), ValueError, "topk_scores selects keys only with topk"),
    (dict(topk=2), ValueError, "topk needs scores to select by: pass topk_scores, or an "
                               "attn_bias"),
    (dict(topk=2, topk_scores=torch.zeros(B, 3, 1, S)), ValueError,
     f"topk_scores has shape (1, 3, 1, {S}), not broadcastable to (B={B}, H in {{1,{H},{H}}}, "
     f"Sq={S}, Sk={S})"),
    (dict(topk=2, topk_scores=torch.zeros(B, H, 1, S, dtype=torch.int32)), TypeError,
     "topk_scores has dtype torch.int32; expected one of"),
    (dict(topk=2, topk_scores=torch.zeros(B, H, 1, S, device="meta")), ValueError,
     "topk_scores is on meta but q is on cpu"),
    (dict(topk=2, topk_scores=[0.5]), TypeError, "topk_scores must be a torch.Tensor or None, "
                                                 "got list"),
])
def test_topk_arguments(options, error, message):
    """Named in every message; shapes, dtypes and devices, never a tensor's values."""
    q, k, v = make()
    with pytest.raises(error, match="^" + esc(message)) as raised:
        attention(q, k, v, **options)
    assert "tensor(" not in str(raised.value)


def test_error_leaves_inputs_and_grads_untouched(monkeypatch):
    calls = []
    monkeypatch.setattr(api_mod, "triton_attention", lambda *a, **kw: calls.append("triton"))
    monkeypatch.setattr(api_mod, "attention_reference", lambda *a, **kw: calls.append("ref"))

    q, _, v = make(dtype=torch.float32, requires_grad=True)
    k = torch.randn(B, S, H, 2 * D, dtype=torch.float32)  # bad: head_dim 16 vs q's 8
    v = torch.randn(B, S, H, 2 * D, dtype=torch.float32)
    q_before, k_before, v_before = q.detach().clone(), k.clone(), v.clone()

    # pytest.raises fails the test if any *other* exception type escapes
    with pytest.raises(ValueError, match=r"^k/v have head_dim 16 but q has 8$"):
        attention(q, k, v, causal=True)

    assert calls == []
    assert q.grad is None
    assert torch.equal(q.detach(), q_before)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)
    # q is still a plain leaf
    assert q.is_leaf and q.grad_fn is None
    # q is still usable afterwards
    (q * 2).sum().backward()
    assert torch.equal(q.grad, torch.full_like(q, 2.0))


def test_public_export():
    assert omniattn.attention is api_mod.attention


def paged(b=B, pages=6, page_size=16, hk=H, pages_per_seq=2):
    k = torch.randn(pages, page_size, hk, D, dtype=torch.float16)
    table = torch.arange(b * pages_per_seq, dtype=torch.int32).view(b, pages_per_seq)
    return k, torch.randn_like(k), table


@pytest.mark.parametrize("change, error, message", [
    (dict(block_table=torch.zeros(B, 2, dtype=torch.int64)), TypeError,
     "block_table must be int32, got torch.int64"),
    (dict(block_table=torch.zeros(B + 1, 2, dtype=torch.int32)), ValueError,
     "block_table has shape (2, 2); expected (B=1, max_pages_per_seq)"),
    (dict(block_table=torch.zeros(B, 4, dtype=torch.int32)[:, ::2]), ValueError,
     "block_table must be contiguous in its last dimension"),
    (dict(seqused_k=torch.zeros(B, 1, dtype=torch.int32)), ValueError,
     "seqused_k has shape (1, 1); expected (B=1,)"),
    (dict(seqused_k=[3]), TypeError, "seqused_k must be a torch.Tensor or None, got list"),
    (dict(seqused_k=torch.tensor([33], dtype=torch.int32)), ValueError,
     "seqused_k[0] lies outside [0, 32] (a sequence holds 2 pages of 16 keys)"),
    (dict(block_table=torch.tensor([[0, 6]], dtype=torch.int32)), ValueError,
     "block_table[0, 1] is not a page of k/v (num_pages = 6), and sequence 0 uses it"),
    (dict(attn_bias=torch.zeros(B, H, 1, 16)), ValueError,
     "attn_bias has shape (1, 2, 1, 16), not broadcastable to (B=1, H in {1,2,2}, Sq=4, "
     "Sk=32)"),
    (dict(block_mask="unused"), ValueError, "block_mask with block_table / seqused_k"),
])
def test_paged_invalid(change, error, message):
    q, _, _ = make()
    k, v, table = paged()
    with pytest.raises(error, match=esc(message)):
        attention(q, k, v, **{"block_table": table, **change})


def test_paged_values_are_never_printed():
    q, _, _ = make()
    k, v, _ = paged()
    with pytest.raises(ValueError) as raised:
        attention(q, k, v, block_table=torch.tensor([[0, 123456]], dtype=torch.int32))
    assert "123456" not in str(raised.value)
    with pytest.raises(ValueError) as raised:
        attention(q, k, v, block_table=torch.tensor([[0, 1]], dtype=torch.int32),
                  seqused_k=torch.tensor([987654], dtype=torch.int32))
    assert "987654" not in str(raised.value)


@pytest.mark.parametrize("page_size", [0, 24])
def test_page_size_multiple_of_16(page_size):
    q, _, _ = make()
    k, v, table = paged(page_size=page_size)
    with pytest.raises(ValueError, match="page_size a positive multiple of 16; got k shape "
                                         f"\\(6, {page_size}, 2, 8\\)"):
        attention(q, k, v, block_table=table)


def test_paged_k_batch_may_differ_and_contiguous_seqused_k_checks_sk():
    q, k, v = make(sk=16)
    with pytest.raises(ValueError, match=esc("seqused_k[0] lies outside [0, 16] (a sequence "
                                             "holds Sk = 16)")):
        attention(q, k, v, seqused_k=torch.tensor([17], dtype=torch.int32))
    with pytest.raises(ValueError, match="k has batch size 2 but q has 1"):
        attention(q, torch.cat([k, k]), torch.cat([v, v]),
                  seqused_k=torch.tensor([3], dtype=torch.int32))
    with pytest.raises(ValueError, match="do not combine with cu_seqlens_q"):
        attention(q[0], k[0], v[0], cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32),
                  cu_seqlens_k=torch.tensor([0, 16], dtype=torch.int32),
                  seqused_k=torch.tensor([3], dtype=torch.int32))
