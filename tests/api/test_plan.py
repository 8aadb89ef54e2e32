"""`omniattn.explain` and the plan: which kernel runs each pass and why the faster ones were
refused. On a CPU the Hopper cases plan as on an sm90 GPU (the device check patched); nothing
is launched."""
from __future__ import annotations

from helpers import DEVICE, GPU
import pytest
import torch

import omniattn
from omniattn import api, plan
from omniattn.backends.gluon_sm90 import blocks as gluon_blocks
from omniattn.backends.triton import configs


@pytest.fixture
def hopper(monkeypatch):
    """Plan CPU tensors as on an sm90 GPU with the Gluon kernels on, with the GPU's tile
    configs (not the interpreter's)."""
    monkeypatch.setattr(gluon_blocks, "device_refusal", lambda device: None)
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    monkeypatch.setattr(api, "uses_kernels", lambda q: True)


def qkv(seqlen=256, heads=4, heads_k=4, head_dim=128, dtype=torch.bfloat16, packed=False):
    shape_q = (2 * seqlen, heads, head_dim) if packed else (2, seqlen, heads, head_dim)
    shape_k = (2 * seqlen, heads_k, head_dim) if packed else (2, seqlen, heads_k, head_dim)
    return (torch.randn(shape_q, dtype=dtype, requires_grad=True),
            torch.randn(shape_k, dtype=dtype, requires_grad=True),
            torch.randn(shape_k, dtype=dtype, requires_grad=True))


def refused(pass_plan: plan.PassPlan) -> str:
    return " ".join(r.reason for r in pass_plan.refused)


def test_dense_d128_on_hopper_runs_gluon(hopper):
    explained = omniattn.explain(*qkv(), causal=True)
    assert explained.forward.kernel == "fwd_hopper" and explained.forward.refused == ()
    assert explained.backward.kernel == "bwd_hopper"
    assert explained.forward.tiles == (128, 128)
    text = str(explained)
    assert "forward: fwd_hopper at 128 x 128 tiles, causal" in text
    assert "backward: bwd_hopper" in text


def test_head_dim_96_takes_triton(hopper):
    explained = omniattn.explain(*qkv(head_dim=96))
    assert explained.forward.kernel == "fwd" and explained.backward.kernel == "bwd"
    assert "no Gluon forward tiles for head dim 96" in refused(explained.forward)
    assert "no Gluon backward tiles for head dim 96" in refused(explained.backward)


def test_full_bias(hopper):
    q, k, v = qkv()
    per_head = torch.randn(2, 4, 256, 256, dtype=torch.bfloat16, requires_grad=True)
    explained = omniattn.explain(q, k, v, attn_bias=per_head)
    assert (explained.forward.kernel, explained.backward.kernel) == ("fwd_hopper", "bwd_hopper")
    assert explained.forward.tiles == (128, 64)  # its tiles with a bias spanning (Sq, Sk)
    shared = torch.randn(2, 1, 256, 256, dtype=torch.bfloat16, requires_grad=True)
    explained = omniattn.explain(q, k, v, attn_bias=shared)
    assert explained.forward.kernel == "fwd_hopper" and explained.backward.kernel == "bwd"
    assert "shared by several query heads" in refused(explained.backward)
    fp32 = torch.randn(2, 4, 256, 256, dtype=torch.float32)
    explained = omniattn.explain(q, k, v, attn_bias=fp32)
    assert explained.forward.kernel == "fwd" and "torch.float32" in refused(explained.forward)


def test_per_row_lengths(hopper):
    lengths = torch.randint(0, 257, (2, 256), dtype=torch.int32)
    explained = omniattn.explain(*qkv(), seqlens_k_per_row=lengths)
    assert explained.forward.kernel == "fwd_hopper"
    assert "rows in length order" in explained.forward.schedule
    explained = omniattn.explain(*qkv(), seqlens_k_per_row=lengths, causal=True)
    assert explained.forward.kernel == "fwd"
    assert "per-row key lengths with other masks" in refused(explained.forward)
    assert "explicit lists (per-row key lengths)" in explained.forward.schedule


def test_packed_sequences_with_a_mask(hopper):
    q, k, v = qkv(packed=True)
    cu = torch.tensor([0, 100, 512], dtype=torch.int32)
    mask = torch.rand(512, 1, 412) > 0.5
    explained = omniattn.explain(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, attn_mask=mask)
    assert explained.forward.kernel == "fwd"
    assert "packed sequences with a mask" in refused(explained.forward)
    assert "packed sequences with a mask" in refused(explained.backward)
    explained = omniattn.explain(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    assert (explained.forward.kernel, explained.backward.kernel) == ("fwd_hopper", "bwd_hopper")


def test_deterministic_backward(hopper):
    explained = omniattn.explain(*qkv(), deterministic=True)
    assert explained.forward.kernel == "fwd_hopper" and explained.backward.kernel == "bwd"
    assert "deterministic=True" in refused(explained.backward)


def test_head_dim_256_backward_splits_the_head_dim(hopper):
    explained = omniattn.explain(*qkv(head_dim=256), causal=True)
    assert explained.backward.kernel == "bwd_hopper_wide"
    mask = torch.rand(2, 1, 256, 256) > 0.5
    explained = omniattn.explain(*qkv(head_dim=256), attn_mask=mask)
    assert explained.forward.kernel == "fwd_hopper" and explained.backward.kernel == "bwd"
    assert "head dim 256" in refused(explained.backward)


def test_cpu_tensors_take_the_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    explained = omniattn.explain(*qkv(head_dim=64))
    assert explained.backend == "reference" and explained.forward.kernel == "reference"
    assert "CPU tensors run the exact PyTorch reference" in str(explained)


@pytest.mark.skipif(GPU, reason="the interpreter runs where there is no GPU")
def test_interpreter_and_switch_refusals(monkeypatch):
    explained = omniattn.explain(*qkv(dtype=torch.float16))
    assert explained.forward.kernel == "fwd"
    assert "interpreter" in refused(explained.forward)
    monkeypatch.setenv("OMNIATTN_GLUON", "0")
    assert "OMNIATTN_GLUON=0" in refused(omniattn.explain(*qkv(dtype=torch.float16)).forward)


def test_explain_validates_like_attention():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="window offsets must be >= 0"):
        omniattn.explain(q, k, v, window=(-2, 0))
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['causl'\\]"):
        omniattn.explain(q, k, v, causl=True)


def test_the_call_runs_what_the_plan_says(monkeypatch):
    """attention launches the kernels its plan names (here under the interpreter: fwd / bwd)."""
    from omniattn import autograd, passes

    launched = []
    forward, backward = passes.attention_forward, passes.attention_backward
    monkeypatch.setattr(autograd, "attention_forward",
                        lambda *a, **kw: launched.append(kw["kernel"]) or forward(*a, **kw))
    monkeypatch.setattr(autograd, "attention_backward",
                        lambda *a, **kw: launched.append(kw["kernel"]) or backward(*a, **kw))
    q, k, v = (t.detach().to(DEVICE).requires_grad_()
               for t in qkv(seqlen=24, heads=2, heads_k=1, head_dim=16, dtype=torch.float16))
    explained = omniattn.explain(q, k, v, causal=True)
    omniattn.attention(q, k, v, causal=True).sum().backward()
    assert launched == [explained.forward.kernel, explained.backward.kernel]


def decode_qkv(seqlen_q=1, seqlen_k=4096, heads=32, heads_k=8, requires_grad=False):
    q = torch.randn(2, seqlen_q, heads, 128, dtype=torch.bfloat16, requires_grad=requires_grad)
    k = torch.randn(2, seqlen_k, heads_k, 128, dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


def test_decode_shaped_calls_run_split_kv(hopper):
    explained = omniattn.explain(*decode_qkv(), causal=True)
    assert explained.forward.kernel == "fwd_decode" and explained.forward.refused == ()
    assert explained.forward.tiles == (16, 64)
    text = str(explained)
    assert "forward: fwd_decode at 16 x 64 tiles, split-KV" in text
    assert "4 query heads x 1 rows packed per tile" in text
    # speculative decoding, a key bias per KV head, per-row lengths, softcap
    q, k, v = decode_qkv(seqlen_q=4)
    bias = torch.randn(2, 8, 1, 4096, dtype=torch.bfloat16)
    lengths = torch.full((2, 4), 4000, dtype=torch.int32)
    explained = omniattn.explain(q, k, v, causal=True, attn_bias=bias, softcap=30.0,
                                 seqlens_k_per_row=lengths, window=(1024, -1))
    assert explained.forward.kernel == "fwd_decode"


def test_why_not_split_kv(hopper):
    """Decode-shaped calls split-KV does not take say why; prefill-shaped ones do not list it
    (it is no faster candidate there)."""
    explained = omniattn.explain(*decode_qkv(requires_grad=True), causal=True)
    assert explained.forward.kernel == "fwd_hopper"
    assert "not fwd_decode: the call records a gradient" in str(explained)
    mask = omniattn.block_mask_from_blocks(torch.ones(1, 1, 1, 32, dtype=torch.bool), 128,
                                           seq_lengths=(1, 4096))
    explained = omniattn.explain(*decode_qkv(), block_mask=mask)
    assert "a block mask" in refused(explained.forward)
    explained = omniattn.explain(*decode_qkv(), dropout_p=0.1)
    assert "not fwd_decode: dropout" in str(explained)
    explained = omniattn.explain(*decode_qkv(seqlen_q=17))
    assert explained.forward.kernel == "fwd_hopper" and explained.forward.refused == ()
    assert "fwd_decode" not in str(explained)


def test_paged_calls(hopper):
    q, _, _ = decode_qkv()
    pages = torch.randn(40, 256, 8, 128, dtype=torch.bfloat16)
    table = torch.arange(32, dtype=torch.int32).view(2, 16)
    used = torch.tensor([4096, 1000], dtype=torch.int32)
    explained = omniattn.explain(q, pages, pages, block_table=table, seqused_k=used)
    assert explained.forward.kernel == "fwd_decode"
    assert "K/V from pages of 256 keys through the block table" in explained.forward.schedule
    assert explained.backward.kernel == "per_sequence"
    # prefill-sized: each sequence's pages gathered, and why not split-KV
    q = torch.randn(2, 300, 32, 128, dtype=torch.bfloat16)
    explained = omniattn.explain(q, pages, pages, block_table=table, seqused_k=used)
    assert explained.forward.kernel == "per_sequence"
    assert "gathered from its pages into contiguous K/V" in explained.forward.schedule
    assert "300 query rows per sequence, more than 16" in refused(explained.forward)
