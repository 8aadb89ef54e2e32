"""Triton kernels against the float64 reference: output, lse, dq, dk, dv.

Without a GPU these run under TRITON_INTERPRET=1 (fp16/fp32, tiny shapes, 16x16 tiles so odd
lengths span many tiles); on a GPU the full matrix runs, bf16 included. Outputs are poisoned with
NaN before each launch so an element the kernels fail to write fails the test.
"""
from __future__ import annotations

import itertools

from helpers import (DEVICE, GPU, case_id, check_against_reference, random_qkv,
                     replace_backward_configs)
import pytest
import torch

import omniattn
from omniattn import plan
from omniattn.backends.gluon_sm90 import backward as bwd_hopper
from omniattn.backends.triton import configs
from omniattn.kernels.schedule import KernelArgs
from omniattn.passes import (GLUON_BACKWARD, GLUON_FORWARD, attention_backward,
                             attention_forward)

MASKS = {
    "dense": dict(causal=False, window=None),
    "causal": dict(causal=True, window=None),
    "window": dict(causal=False, window=(9, 4)),
    "causal_window": dict(causal=True, window=(20, -1)),
    "left_only": dict(causal=False, window=(6, -1)),
    "right_only": dict(causal=False, window=(-1, 3)),
}
# windows several GPU tiles wide: tiles cut on the left, whole and cut on the right in one row
WIDE_WINDOWS = {
    "sliding": dict(causal=True, window=(300, -1)),
    "wide_window": dict(causal=False, window=(250, 170)),
}


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def run_kernels(q, k, v, dout, causal=False, window=None, softmax_scale=None, softcap=0.0,
                schedule=None, deterministic=False):
    """Forward + backward straight through the launchers (the kernels the plan names), into
    NaN-poisoned buffers."""
    args = KernelArgs.make(q.shape[-1], causal, window, softmax_scale, softcap)
    form = plan.CallForm(q, k, v, args, deterministic=deterministic,
                         given_lists=schedule is not None)
    lists = None if schedule is None else plan.ListTiles(
        *((tiles.block_m, tiles.block_n) for tiles in (schedule.forward, schedule.dq,
                                                         schedule.dkdv)), ((0, 0), (0, 0)), None)
    out = nan_like(q)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device)
    attention_forward(q.detach(), k.detach(), v.detach(), args,
                      schedule.forward if schedule is not None else None, out=out, lse=lse,
                      kernel=plan.forward_pass(form, lists).kernel)
    grads = (nan_like(q), nan_like(k), nan_like(v))
    attention_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, args, schedule,
                       deterministic=deterministic, dq=grads[0], dk=grads[1], dv=grads[2],
                       kernel=plan.backward_pass(form, lists).kernel)
    return out, lse, grads


def check_case(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, mask, softcap=0.0,
               softmax_scale=None, deterministic=False):
    torch.manual_seed(seqlen_q * 1000 + seqlen_k * 10 + head_dim + heads_k)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype)
    dout = torch.randn_like(q)
    options = dict({**MASKS, **WIDE_WINDOWS}[mask], softcap=softcap, softmax_scale=softmax_scale)
    out, lse, grads = run_kernels(q, k, v, dout, deterministic=deterministic, **options)
    check_against_reference(out, lse, grads, q, k, v, dout, **options)


# (B, Sq, Sk, H, Hk, D, dtype, mask, softcap): tiny and chosen so the interpreter stays fast while
# every path is crossed: odd lengths, Sq != Sk both ways, GQA ratios 1 / 2 / H, padded head dims,
# rows that see no key (causal with Sq > Sk), softcap, fp16 and fp32.
INTERPRETER_CASES = [
    (1, 17, 17, 2, 2, 32, torch.float16, "dense", 0.0),
    (1, 17, 17, 2, 2, 32, torch.float16, "causal", 0.0),
    (2, 1, 33, 4, 1, 32, torch.float16, "dense", 0.0),
    (1, 1, 1, 2, 1, 16, torch.float32, "causal", 0.0),
    (1, 40, 17, 4, 2, 24, torch.float32, "causal", 0.0),
    (1, 33, 50, 4, 4, 64, torch.float16, "window", 0.0),
    (1, 45, 29, 2, 1, 32, torch.float16, "causal_window", 0.0),
    (1, 29, 45, 2, 2, 32, torch.float32, "left_only", 0.0),
    (1, 31, 31, 2, 2, 96, torch.float16, "right_only", 0.0),
    (1, 23, 37, 4, 2, 32, torch.float16, "causal", 5.0),
    (1, 23, 37, 2, 2, 32, torch.float32, "dense", 2.0),
    (1, 113, 17, 2, 1, 16, torch.float16, "causal", 0.0),
    (1, 32, 48, 2, 2, 128, torch.float16, "dense", 0.0),
    (1, 19, 21, 1, 1, 192, torch.float32, "causal", 0.0),
    (1, 16, 33, 1, 1, 256, torch.float16, "window", 0.0),
    (1, 19, 23, 2, 1, 36, torch.float16, "causal", 0.0),  # 72-byte rows: no tensor descriptors
]


@pytest.mark.interpreter
@pytest.mark.skipif(GPU, reason="interpreter cases run where there is no GPU")
@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=case_id)
def test_kernels_interpreter(case):
    check_case(*case)


@pytest.mark.interpreter
@pytest.mark.skipif(GPU, reason="interpreter cases run where there is no GPU")
def test_kernels_interpreter_long_keys():
    check_case(1, 17, 255, 2, 2, 16, torch.float16, "causal")


HEAD_DIMS = (32, 64, 96, 128, 192, 256)
LENGTHS = ((1, 1), (17, 17), (113, 255), (255, 113), (128, 384), (1, 300))
GQA = ((8, 8), (8, 2), (8, 1))


def _gpu_matrix():
    """dtype x head dim x mask in full for fp16/bf16 (fp32 on two head dims: its IEEE-dot kernels
    compile slowly); lengths and GQA ratios rotate through the product."""
    cases = []
    combos = list(itertools.product((torch.bfloat16, torch.float16), HEAD_DIMS, MASKS))
    combos += list(itertools.product((torch.float32,), (64, 96), MASKS))
    for i, (dtype, head_dim, mask) in enumerate(combos):
        seqlen_q, seqlen_k = LENGTHS[i % len(LENGTHS)]
        heads, heads_k = GQA[i % len(GQA)]
        cases.append((2, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, mask, 0.0))
    for (seqlen_q, seqlen_k), (heads, heads_k) in itertools.product(LENGTHS, GQA):
        for mask in ("dense", "causal"):
            cases.append((2, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16, mask, 0.0))
    for dtype, mask in itertools.product((torch.bfloat16, torch.float16), ("dense", "causal")):
        cases.append((1, 300, 200, 4, 2, 64, dtype, mask, 30.0))
    return cases


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("case", _gpu_matrix(), ids=case_id)
def test_kernels_gpu(case):
    check_case(*case)


@pytest.mark.parametrize("case", [(1, 33, 47, 2, 1, 64, torch.float16, "dense", 0.0),
                                  (1, 40, 17, 4, 2, 32, torch.float16, "causal", 0.0)],
                         ids=["dense", "causal"])
def test_pointer_loads(monkeypatch, case):
    """The path without tensor descriptors (pre-Hopper GPUs, unaligned strides) stays exact."""
    monkeypatch.setenv("OMNIATTN_TMA", "0")
    check_case(*case)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("case", [(2, 256, 512, 8, 2, 64, torch.bfloat16, "dense", 0.0),
                                  (2, 384, 256, 8, 8, 128, torch.float16, "dense", 0.0),
                                  (1, 1000, 2048, 4, 1, 128, torch.bfloat16, "dense", 0.0)],
                         ids=case_id)
def test_tma_dense_tiles(case):
    """Dense launches of many full 128x128 tiles through tensor descriptors (outputs poisoned:
    a warp-specialised variant of this loop once left lse rows unwritten)."""
    check_case(*case)


GLUON_CASES = [(2, 1000, 1000, 8, 2, 128, torch.bfloat16, "causal", 0.0),
               (1, 513, 2049, 4, 1, 128, torch.float16, "dense", 0.0),
               (2, 2048, 1024, 4, 4, 128, torch.bfloat16, "causal", 0.0),
               (1, 700, 900, 4, 2, 128, torch.bfloat16, "right_only", 0.0),
               (3, 129, 1, 2, 2, 128, torch.float16, "causal", 0.0),
               (1, 255, 113, 4, 2, 128, torch.bfloat16, "causal", 0.0),
               (2, 1, 17, 4, 1, 128, torch.float16, "dense", 0.0),
               # head dim 256: the forward at 64-key tiles in two K/V buffers, the backward
               # with dK / dV / dQ split by head dim (the wide Gluon backward); 512 x 512: the
               # tensors seen as (B * S, H * D) by TMA
               (2, 1000, 1000, 8, 2, 256, torch.bfloat16, "causal", 0.0),
               (1, 513, 2049, 4, 1, 256, torch.float16, "dense", 0.0),
               (1, 700, 900, 4, 2, 256, torch.bfloat16, "right_only", 0.0),
               (1, 255, 113, 4, 4, 256, torch.float16, "causal", 0.0),
               (2, 1, 17, 4, 1, 256, torch.bfloat16, "dense", 0.0),
               (2, 512, 512, 4, 2, 256, torch.bfloat16, "causal", 0.0),
               (1, 512, 512, 6, 3, 256, torch.float16, "dense", 0.0),
               # left window bounds: a program's first key tile past 0, a consumer's first step
               # past the program's (its leading steps released), tiles cut on both sides
               (2, 1000, 1000, 8, 2, 128, torch.bfloat16, "sliding", 0.0),
               (1, 700, 900, 4, 2, 128, torch.float16, "wide_window", 0.0),
               (2, 513, 2049, 4, 1, 128, torch.bfloat16, "window", 0.0),
               (1, 300, 200, 4, 4, 128, torch.bfloat16, "causal_window", 0.0),
               (1, 255, 113, 4, 2, 128, torch.float16, "left_only", 0.0),
               (2, 1024, 1024, 4, 2, 128, torch.bfloat16, "sliding", 0.0),
               (2, 1000, 1000, 8, 2, 256, torch.bfloat16, "sliding", 0.0),
               (1, 700, 900, 4, 2, 256, torch.float16, "wide_window", 0.0),
               (1, 300, 200, 4, 4, 256, torch.bfloat16, "causal_window", 0.0),
               (1, 512, 512, 4, 2, 256, torch.bfloat16, "window", 0.0),
               # head dim 64: three consumer warpgroups of 64 rows (the forward only); 768: the
               # tensors seen as (B * S, H * D) by TMA
               (2, 1000, 1000, 8, 2, 64, torch.bfloat16, "causal", 0.0),
               (1, 513, 2049, 4, 1, 64, torch.float16, "dense", 0.0),
               (1, 700, 900, 4, 2, 64, torch.bfloat16, "right_only", 0.0),
               (3, 129, 1, 2, 2, 64, torch.float16, "causal", 0.0),
               (1, 255, 113, 4, 2, 64, torch.bfloat16, "causal", 0.0),
               (2, 1, 17, 4, 1, 64, torch.float16, "dense", 0.0),
               (2, 768, 768, 4, 2, 64, torch.bfloat16, "causal", 0.0),
               (1, 768, 768, 6, 3, 64, torch.float16, "dense", 0.0),
               (2, 1000, 1000, 8, 2, 64, torch.bfloat16, "sliding", 0.0),
               (1, 700, 900, 4, 2, 64, torch.float16, "wide_window", 0.0),
               (1, 300, 200, 4, 4, 64, torch.bfloat16, "causal_window", 0.0),
               (1, 255, 113, 4, 2, 64, torch.float16, "left_only", 0.0)]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9, reason="needs sm90")
@pytest.mark.parametrize("case", GLUON_CASES, ids=case_id)
def test_gluon_kernels(gluon_calls, case):
    """Multi-tile launches of the Gluon forward and backward (producer + two or three consumer
    warpgroups): ring wrap-around, masked tail tiles, rows that see no key, a consumer with fewer
    tiles than its program, odd lengths, GQA groups summed in one backward program. Fails if
    a pass did not take the Gluon path."""
    check_case(*case)
    assert gluon_calls == ["fwd", "bwd"], f"Gluon launches: {gluon_calls}"


# workloads run back to back without a sync: (batch, seqlen, heads, heads_k, head_dim, options);
# "mask" / "full_bias" / "key_bias" / "block_window" / "row_lengths" stand for tensors made in
# the test
BACK_TO_BACK = {
    # each program's second consumer skips the first key tile its producer loads
    "d256-sliding": (2, 8192, 16, 16, 256, dict(window=(1024, 0))),
    "d128-window960": (2, 8192, 16, 16, 128, dict(window=(960, 0))),
    "gqa-causal": (2, 8192, 16, 4, 128, dict(causal=True)),
    "d256-gqa-causal": (2, 4096, 16, 4, 256, dict(causal=True)),
    "dense": (2, 4096, 16, 16, 128, {}),
    "d64-key-bias": (2, 4096, 16, 16, 64, dict(causal=True, key_bias=True)),
    # three consumers, each skipping the leading key tiles only the others need
    "d64-sliding": (2, 8192, 16, 16, 64, dict(window=(1024, 0))),
    # lists: the mask and the bias by TMA with K (forward) / with q (backward)
    "mask-full-bias": (2, 4096, 16, 16, 128, dict(causal=True, mask=True, full_bias=True)),
    "gqa-key-bias-sliding": (2, 4096, 16, 4, 128, dict(window=(1024, 0), key_bias=True)),
    "block-mask-window": (1, 16384, 16, 16, 128, dict(block_window=(1024, 0))),
    # per-row key lengths alone: q gathered and out scattered by the consumers
    "row-lengths": (2, 8192, 16, 16, 128, dict(row_lengths=True)),
}


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9, reason="needs sm90")
@pytest.mark.parametrize("name", list(BACK_TO_BACK))
def test_gluon_back_to_back_calls_are_bit_identical(gluon_calls, name):
    """Races in the warp-specialised kernels' barrier rings show as outputs that change between
    identical calls (or as a fault): 200 forwards, then 20 forward + backward passes, none
    synced, must repeat the first call's output, dK, dV and bias gradient bit for bit (dQ is
    reduce-added in a varying order, so it is not compared). While the steps a consumer skips
    waited for their V only, "d256-sliding" differed in 157,088 elements over 300 calls and
    faulted the launch at times (H100)."""
    batch, seqlen, heads, heads_k, head_dim, options = BACK_TO_BACK[name]
    options = dict(options)
    q, k, v = random_qkv(batch, seqlen, seqlen, heads, heads_k, head_dim, torch.bfloat16)
    bias = None
    if options.pop("mask", False):
        options["attn_mask"] = torch.rand(batch, heads, seqlen, seqlen, device=DEVICE) < 0.75
    if options.pop("full_bias", False):
        bias = torch.randn(batch, heads, seqlen, seqlen, device=DEVICE, dtype=torch.bfloat16)
    if options.pop("key_bias", False):
        bias = torch.randn(batch, heads, 1, seqlen, device=DEVICE, dtype=torch.bfloat16)
    if bias is not None:
        options["attn_bias"] = bias.requires_grad_()
    if options.pop("row_lengths", False):
        options["seqlens_k_per_row"] = torch.randint(0, seqlen + 1, (batch, seqlen),
                                                     device=DEVICE, dtype=torch.int32)
    if "block_window" in options:
        options["block_mask"] = omniattn.window_block_mask(
            seqlen, seqlen, options.pop("block_window"), device=DEVICE)
    with torch.no_grad():
        first = omniattn.attention(q, k, v, **options)
        mismatches = torch.zeros((), dtype=torch.int64, device=DEVICE)
        for _ in range(200):
            mismatches += (omniattn.attention(q, k, v, **options) != first).sum()
    inputs = (k, v) if bias is None else (k, v, bias)
    dout = torch.randn_like(q)
    first_grads = None
    for _ in range(21):
        grads = torch.autograd.grad(omniattn.attention(q, k, v, **options), inputs, dout)
        if first_grads is None:
            first_grads = grads
        for grad, first_grad in zip(grads, first_grads):
            mismatches += (grad != first_grad).sum()
    assert mismatches.item() == 0
    assert gluon_calls, "no Gluon kernel ran"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9, reason="needs sm90")
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("pairs", [1, 2, 4])
@pytest.mark.parametrize("heads_k", [3, 6])
def test_gluon_causal_backward_in_pair_groups(gluon_calls, monkeypatch, pairs, head_dim, heads_k):
    """The causal Gluon backward runs its programs a group of (batch, KV head) pairs at a time;
    9 or 18 pairs in groups of 2 or 4 leave a short last group: every program's dK / dV is
    written and exact. At D128, GQA and one pair per group compute dQ a step behind."""
    monkeypatch.setattr(bwd_hopper, "causal_pairs_per_group", lambda *args: pairs)
    dq_trails = []
    rule = bwd_hopper.hopper_backward_dq_trails
    monkeypatch.setattr(bwd_hopper, "hopper_backward_dq_trails",
                        lambda *args: dq_trails.append(rule(*args)) or dq_trails[-1])
    check_case(3, 300, 400, 6, heads_k, head_dim, torch.bfloat16, "causal", 0.0)
    assert gluon_calls == ["fwd", "bwd"], f"Gluon launches: {gluon_calls}"
    if head_dim == 128:
        assert dq_trails == [heads_k < 6 or pairs == 1]


def test_a_gluon_plan_for_unaligned_bases_runs_the_triton_kernels(gluon_calls):
    """A plan made while torch.compile traces sees no addresses: when the Gluon kernels it names
    get bases off 16-byte alignment, each pass runs the Triton kernel instead (on any device;
    here the Gluon kernels could not run at all)."""
    torch.manual_seed(9)
    shape = (1, 40, 2, 16)
    storage = torch.randn(3 * 1280 + 1, device=DEVICE, dtype=torch.float16)
    q, k, v = (storage[1 + i * 1280:1 + (i + 1) * 1280].view(shape) for i in range(3))
    assert q.data_ptr() % 16
    args = KernelArgs.make(16, True, None, None, 0.0)
    out, lse = attention_forward(q, k, v, args, kernel=GLUON_FORWARD)
    dout = torch.randn_like(q)
    grads = attention_backward(dout, q, k, v, out, lse, args, kernel=GLUON_BACKWARD)[:3]
    check_against_reference(out, lse, grads, q, k, v, dout, causal=True)
    assert gluon_calls == []


@pytest.mark.gpu
@pytest.mark.skipif(not GPU or torch.cuda.get_device_capability()[0] != 9, reason="needs sm90")
@pytest.mark.parametrize("seqlen, head_dim", [(256, 128), (200, 128), (256, 256)])
def test_gluon_head_major_layout(gluon_calls, seqlen, head_dim):
    """q/k/v/out as (B, H, S, D) storage seen through (B, S, H, D) views: heads are not packed
    within a row, so the descriptors are 4-d whatever the lengths; dK / dV written through the
    same strides."""
    torch.manual_seed(seqlen)
    q, k, v = (torch.randn(2, heads, seqlen, head_dim, device=DEVICE, dtype=torch.bfloat16)
               .transpose(1, 2) for heads in (8, 2, 2))
    args = KernelArgs.make(head_dim, True, None, None, 0.0)
    form = plan.CallForm(q, k, v, args)
    out = nan_like(q.transpose(1, 2).contiguous()).transpose(1, 2)
    lse = torch.full((2, 8, seqlen), float("nan"), device=DEVICE)
    attention_forward(q, k, v, args, out=out, lse=lse, kernel=plan.forward_pass(form, None).kernel)
    dout = torch.randn_like(q)
    grads = tuple(nan_like(t.transpose(1, 2).contiguous()).transpose(1, 2) for t in (q, k, v))
    attention_backward(dout, q, k, v, out, lse, args, dq=grads[0], dk=grads[1], dv=grads[2],
                       kernel=plan.backward_pass(form, None).kernel)
    check_against_reference(out, lse, grads, q, k, v, dout, causal=True)
    assert gluon_calls == ["fwd", "bwd"], f"Gluon launches: {gluon_calls}"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("case", [(2, 255, 113, 8, 2, 128, torch.bfloat16, "dense", 0.0),
                                  (2, 113, 255, 8, 8, 128, torch.float16, "causal", 0.0)],
                         ids=["dense", "causal"])
def test_triton_kernels_where_gluon_applies(monkeypatch, case):
    """OMNIATTN_GLUON=0: the calls the Gluon kernels take on sm90 stay exact in the Triton forward and
    the Triton backward."""
    monkeypatch.setenv("OMNIATTN_GLUON", "0")
    check_case(*case)


DETERMINISTIC_CASES = [(1, 17, 33, 4, 2, 32, torch.float16, "dense", 0.0),
                       (1, 40, 17, 4, 1, 32, torch.float32, "causal", 0.0),
                       (1, 23, 37, 2, 2, 32, torch.float16, "window", 5.0)]
if GPU:
    DETERMINISTIC_CASES += [(2, 255, 113, 8, 2, 128, torch.bfloat16, "causal", 0.0),
                            (2, 300, 384, 8, 8, 64, torch.float16, "dense", 0.0),
                            (1, 113, 255, 4, 1, 256, torch.bfloat16, "causal_window", 0.0)]


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("case", DETERMINISTIC_CASES,
                         ids=case_id)
def test_atomic_and_deterministic_dq(monkeypatch, case, deterministic):
    """Every backward config set to add dQ with atomics: deterministic=True must still take the
    dQ programs, False the atomics (on the GPU most tuned configs use the dQ programs)."""
    replace_backward_configs(monkeypatch, atomic_dq=True)
    check_case(*case, deterministic=deterministic)


APART_CASES = [(1, 40, 17, 4, 2, 32, torch.float16, "causal", 0.0),
               (1, 23, 37, 4, 2, 32, torch.float16, "window", 5.0),
               (2, 1, 33, 4, 1, 24, torch.float32, "dense", 0.0)]
if GPU:
    APART_CASES += [(2, 255, 113, 8, 2, 128, torch.bfloat16, "dense", 0.0),
                    (2, 300, 384, 8, 8, 64, torch.float16, "causal", 3.0),
                    (1, 113, 255, 4, 1, 256, torch.bfloat16, "causal_window", 0.0)]


@pytest.mark.parametrize("atomic_dq", [False, True], ids=["dq_programs", "atomic_dq"])
@pytest.mark.parametrize("case", APART_CASES,
                         ids=case_id)
def test_dkdv_in_two_programs(monkeypatch, case, atomic_dq):
    """dV and dK of each key tile from two programs (BwdTileConfig.dkdv_apart): exact with the
    dQ programs and with the dK programs' atomic dQ, for GQA groups, softcap, windows."""
    monkeypatch.setenv("OMNIATTN_GLUON", "0")
    replace_backward_configs(monkeypatch, dkdv_apart=True, atomic_dq=atomic_dq)
    check_case(*case)


@pytest.mark.parametrize("options, causal_only", [
    (dict(causal=True), True),
    (dict(causal=True, window=(-1, 0)), True),
    (dict(), False),
    (dict(causal=True, softcap=5.0), False),
    (dict(causal=True, window=(9, 0)), False),
    (dict(window=(-1, 3)), False),
    (dict(causal=True, attn_mask=True), False),
    (dict(causal=True, attn_bias=True), False),
    (dict(causal=True, dropout_p=0.2), False),
    (dict(causal=True, seqlens_k_per_row=True), False),
], ids=["causal", "causal_as_window", "dense", "softcap", "causal_left_window", "right_window",
        "mask", "bias", "dropout", "row_lengths"])
def test_causal_only_backward_tiles(monkeypatch, options, causal_only):
    """Only calls whose sole mask is causal ask for `configs._BWD_CAUSAL`'s tiles (D256's need
    more shared memory with any other mask, option or explicit schedule)."""
    from omniattn.backends.triton import backward as bwd

    asked = []

    def recording(*args, **kwargs):
        asked.append(kwargs.get("causal_only", False))
        return configs.backward_config(*args, **kwargs)

    monkeypatch.setattr(bwd, "backward_config", recording)
    q, k, v = random_qkv(1, 19, 23, 2, 1, 16, torch.float16)
    if options.pop("attn_mask", False):
        options["attn_mask"] = torch.rand(1, 2, 19, 23, device=DEVICE) < 0.8
    if options.pop("attn_bias", False):
        options["attn_bias"] = torch.randn(1, 2, 1, 23, device=DEVICE, dtype=torch.float16)
    if options.pop("seqlens_k_per_row", False):
        options["seqlens_k_per_row"] = torch.full((1, 19), 20, device=DEVICE, dtype=torch.int32)
    omniattn.attention(q, k, v, **options).sum().backward()
    # the plan asks for the tiles it reports, the launcher for those it runs
    assert asked and set(asked) == {causal_only}


def test_custom_scale():
    check_case(1, 20, 30, 2, 1, 32, torch.float16, "causal", softmax_scale=0.37)


def test_unlisted_tiles_are_never_loaded():
    """NaN in every key/value tile that causal + window hide from all rows: if the kernels loaded
    such a tile, NaN would reach out or the gradients (0 * NaN is NaN)."""
    torch.manual_seed(0)
    # bottom-right aligned, window (8, 0): rows see keys [Sk - Sq - 8, Sk); tiles are <= 128 keys
    # on the GPU and 16 in the interpreter, so keys below the poisoned bound lie in unvisited tiles
    seqlen_q, seqlen_k, hidden = (64, 256, 128) if GPU else (16, 64, 32)
    q, k, v = random_qkv(1, seqlen_q, seqlen_k, 2, 1, 32, torch.float16, requires_grad=False)
    dout = torch.randn_like(q)
    k[:, :hidden] = float("nan")
    v[:, :hidden] = float("nan")
    out, lse, (dq, dk, dv) = run_kernels(q, k, v, dout, causal=True, window=(8, -1))
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()
    assert torch.isfinite(dk[:, hidden:]).all() and torch.isfinite(dv[:, hidden:]).all()
    assert (dk[:, :hidden] == 0).all() and (dv[:, :hidden] == 0).all()


@pytest.mark.interpreter
@pytest.mark.skipif(GPU, reason="the GPU matrix runs the tuned tiles")
@pytest.mark.parametrize("fwd_tiles, bwd_tiles", [((32, 16), (16, 32, 32, 16)),
                                                  ((16, 32), (32, 16, 16, 32))])
@pytest.mark.parametrize("mask", ["causal", "window"])
def test_non_square_tiles(monkeypatch, fwd_tiles, bwd_tiles, mask):
    """Tile ranges and tails stay right when query and key tiles differ, and when the dK/dV
    programs' tiles differ from the dQ programs' (as the tuned GPU configs do)."""
    monkeypatch.setattr(configs, "_INTERPRETER", configs.TileConfig(*fwd_tiles, 1, 1))
    monkeypatch.setattr(configs, "_INTERPRETER_BWD", configs.BwdTileConfig(*bwd_tiles, 1, 1))
    check_case(1, 45, 71, 2, 1, 16, torch.float16, mask)
