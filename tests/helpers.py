"""Shared test machinery: random inputs, the float64 oracle and the error criterion, and the
element-level truth of windows, block masks and top-k selections.

A result passes when its max error against the float64 reference is at most 2x the error of plain
PyTorch in the same dtype (the reference with upcast=False), plus a small atol.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import torch

import omniattn
from omniattn import plan
from omniattn.backends.triton import configs
from omniattn.kernels.elementwise import Elementwise
from omniattn.masks.block_mask import FULL, PARTIAL, BlockMask
from omniattn.reference import attention_reference
from omniattn.schedules import build_schedule

ATOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 2e-5}

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def explicit_schedule(q, k, args, attn_mask=None, attn_bias=None, row_lens=None,
                      backward=True):
    """(schedule, kernel args) of the lists `attention` builds for these masks: at plan.py's
    tiles, by schedules.py."""
    heads = q.shape[-2]
    form = plan.CallForm(q, k, k, args,
                         mask=Elementwise.of(attn_mask, heads) if attn_mask is not None else None,
                         bias=Elementwise.of(attn_bias, heads) if attn_bias is not None else None,
                         row_lens=row_lens)
    return build_schedule(form, plan.list_tiles(form), attn_mask, backward)


def random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, device=DEVICE,
               requires_grad=True):
    q = torch.randn(batch, seqlen_q, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_k, head_dim, device=device, dtype=dtype)
    v = torch.randn(batch, seqlen_k, heads_k, head_dim, device=device, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def case_id(case) -> str:
    """A parametrized case tuple as a test id: its fields joined by '-', dtypes without
    'torch.'."""
    return "-".join(str(x) for x in case).replace("torch.", "")


def replace_backward_configs(monkeypatch, **changes) -> None:
    """Every the Triton backward tile config (the tuned tables, fp32's, the interpreter's) with `changes`
    (BwdTileConfig fields) applied, for the test's duration."""
    for table in (configs._BWD, configs._BWD_FULL_BIAS, configs._BWD_CAUSAL):
        for key, cfg in list(table.items()):
            monkeypatch.setitem(table, key, dataclasses.replace(cfg, **changes))
    for name in ("_FP32_BWD", "_INTERPRETER_BWD"):
        monkeypatch.setattr(configs, name, dataclasses.replace(getattr(configs, name), **changes))


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max abs difference; matching infinities (lse of empty rows) count as 0, NaN as inf."""
    actual = actual.double()
    expected = expected.double()
    both_inf = torch.isinf(actual) & torch.isinf(expected) & (actual == expected)
    diff = torch.where(both_inf, torch.zeros_like(actual), (actual - expected).abs())
    if torch.isnan(diff).any():
        return float("inf")
    return diff.max().item() if diff.numel() else 0.0


def assert_close(name: str, actual, expected, baseline, dtype) -> None:
    err = max_error(actual, expected)
    base = max_error(baseline, expected)
    bound = 2 * base + ATOL[dtype]
    assert err <= bound, f"{name}: error {err:.3g} > 2 x torch {base:.3g} + atol {ATOL[dtype]:.1g}"


def oracle(q, k, v, dout, attn_bias=None, **kwargs):
    """(out, lse, dq, dk, dv[, dbias]) of the float64 reference and of plain PyTorch in q's dtype;
    dbias when attn_bias is given."""
    results = []
    for upcast in (True, False):
        leaves = (q, k, v) if attn_bias is None else (q, k, v, attn_bias)
        inputs = [t.detach().double() if upcast else t.detach().clone() for t in leaves]
        inputs = [t.requires_grad_() for t in inputs]
        bias = inputs[3] if attn_bias is not None else None
        out, lse = attention_reference(*inputs[:3], attn_bias=bias, return_lse=True,
                                       upcast=upcast, **kwargs)
        grads = torch.autograd.grad(out, inputs, dout.to(out.dtype))
        results.append((out.detach(), lse.detach(), *grads))
    return results


def check_against_reference(out, lse, grads, q, k, v, dout, **kwargs) -> None:
    """Compare kernel out/lse/(dq, dk, dv[, dbias]) with the oracle; grads may be None (forward
    only); a 4th gradient is compared with dbias (attn_bias must be among kwargs)."""
    exact, plain = oracle(q, k, v, dout, **kwargs)
    dtype = q.dtype
    assert_close("out", out, exact[0], plain[0], dtype)
    assert_close("lse", lse, exact[1], plain[1], torch.float32 if dtype == torch.float32 else dtype)
    if grads is not None:
        for name, got, ref, base in zip(("dq", "dk", "dv", "dbias"), grads, exact[2:], plain[2:]):
            assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
            assert_close(name, got, ref, base, dtype)


def expand_blocks(blocks: torch.Tensor, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int):
    """(b, h, nQ, nK) bool -> (b, h, Sq, Sk) element mask (test-only: tiny shapes)."""
    return blocks.repeat_interleave(block_m, 2).repeat_interleave(block_n, 3)[..., :seqlen_q, :seqlen_k]


def predicate(seqlen_q, seqlen_k, causal, window):
    """(Sq, Sk) bool: the keys causal / window (left, right) let each query see, with the last
    query aligned to the last key; -1 leaves a side unbounded."""
    q_idx = torch.arange(seqlen_q, device=DEVICE)[:, None]
    k_idx = torch.arange(seqlen_k, device=DEVICE)[None, :]
    rel = k_idx - q_idx - (seqlen_k - seqlen_q)
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=DEVICE)
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if right >= 0:
        keep &= rel <= right
    if left >= 0:
        keep &= rel >= -left
    return keep


def element_visibility(mask: BlockMask) -> torch.Tensor:
    """(B|1, H|1, Sq, Sk) bool, expanded in full: test-only, tiny shapes."""
    seqlen_q, seqlen_k = mask.seq_lengths
    states = expand_blocks(mask.states, *mask.block_size, seqlen_q, seqlen_k)
    left, right = mask.predicate.left, mask.predicate.right
    by_predicate = predicate(seqlen_q, seqlen_k, False, (left, right)).to(states.device)
    return (states == FULL) | ((states == PARTIAL) & by_predicate)


def random_block_mask(batch, heads, seqlen_q, seqlen_k, block_size, density, seed):
    """A (batch, heads) BlockMask over (Sq, Sk): each block FULL with probability `density`
    (seeded by `seed`), the others hidden."""
    block_q, block_k = (block_size, block_size) if isinstance(block_size, int) else block_size
    n_q, n_k = -(-seqlen_q // block_q), -(-seqlen_k // block_k)
    blocks = torch.rand(batch, heads, n_q, n_k, generator=torch.Generator().manual_seed(seed))
    blocks = blocks < density
    blocks[..., 0, :] = False  # the first query block sees nothing
    return omniattn.block_mask_from_blocks(blocks.to(DEVICE), (block_q, block_k),
                                           seq_lengths=(seqlen_q, seqlen_k))


def brute_force_topk(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """Bool like `visible` (..., Sq, Sk): per row, the `topk` visible keys of largest score in
    float64, NaN above every number, ties to the lower key index (every visible key of a row
    with at most topk). A Python sort per row: tiny shapes only."""
    scores = scores.double().expand(visible.shape).cpu()
    visible = visible.cpu()
    keep = torch.zeros_like(visible)
    for index in itertools.product(*map(range, visible.shape[:-1])):
        row = scores[index].tolist()
        candidates = visible[index].nonzero().flatten().tolist()
        candidates.sort(key=lambda n: (not math.isnan(row[n]),
                                       0.0 if math.isnan(row[n]) else -row[n], n))
        keep[index][candidates[:topk]] = True
    return keep


def visible_keys(batch, heads, seqlen_q, seqlen_k, causal=False, window=None, attn_mask=None,
                 row_lens=None, block_mask=None) -> torch.Tensor:
    """Bool (B, H, Sq, Sk): every key each row sees under the other masks, expanded (test-only,
    tiny shapes); attn_mask (B|1, H|1, Sq|1, Sk|1) with heads in {1, H}."""
    keep = predicate(seqlen_q, seqlen_k, causal, window).expand(batch, heads, seqlen_q, seqlen_k)
    if attn_mask is not None:
        keep = keep & (attn_mask != 0).to(keep.device)
    if row_lens is not None:
        keys = torch.arange(seqlen_k, device=keep.device)
        keep = keep & (keys < row_lens.reshape(batch, 1, seqlen_q, 1).to(keep.device))
    if block_mask is not None:
        keep = keep & element_visibility(block_mask).to(keep.device)
    return keep
