"""Benchmark suites behind `omniattn bench`: omniattn against SDPA backends and FlexAttention.

Every provider takes q (B, Sq, H, D), k/v (B, Sk, Hk, D) in omniattn's layout and returns
out (B, Sq, H, D); what a workload adds to q, k, v (block mask, element mask, bias, per-row key
lengths) is built once per workload (`ExtraInputs`) and shared by every provider and mode. FLOPs
are counted on the tiles omniattn's forward kernel actually computes (`computed_pairs`,
`block_mask_pairs` for block-sparse workloads, `element_mask_pairs` for dynamic ones,
`row_lengths_pairs` for per-row key lengths), so TFLOP/s compares providers on equal work; the
exact visible-pair count is recorded beside it as `flops_exact`.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import platform
import re
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path
from time import process_time
from typing import Callable, NamedTuple

import torch
import triton

import omniattn
from omniattn.api import groups_rows_by_length
from omniattn.kernels.configs import (forward_config, hopper_forward_config, interpreting,
                                      switches)
from omniattn.kernels.gluon_blocks import gluon_refusal
from omniattn.kernels.schedule import KernelArgs
from omniattn.predicate import RelativePredicate

MODES = ("fwd", "fwd+bwd")
SUITES = ("core", "seqlen", "sparse", "gqa", "headdim", "dynamic", "rows", "window", "varlen")
# the "seqlen" suite keeps batch x seqlen at this many tokens (FlashAttention's papers: 16k)
SEQLEN_SUITE_TOKENS = 16384
# rows of one workload family at this many sequence lengths or more, each with the same batch x
# seqlen, are drawn as time against sequence length (`plot_results`)
MIN_SEQLEN_SERIES = 3
# densities of the random block masks of the "sparse" suite; 1.0 (every block listed) is the
# reference their times scale against
SPARSE_DENSITIES = (1.0, 0.50, 0.26, 0.11)
# SDPA has no block-sparse masks: its providers get no row on a sparse workload
BLOCK_MASK_PROVIDERS = ("omniattn", "flex")
# learnable biases of the "dynamic" suite, by name: their shapes
DYNAMIC_BIASES = {"full": "(B, H, Sq, Sk)", "key": "(B, H, 1, Sk)"}
# per-row key lengths of the "rows" suite (seqlens_k_per_row), by name: query row i of batch b
# sees keys [0, lengths[b, i])
ROW_LENGTHS = {"uniform": "uniform in [1, Sk]", "progressive": "i + 1"}
# packed documents of the "varlen" suite (cu_seqlens), by name: each document's length is drawn
# uniformly from this range of fractions of the packed total (16k: [128, 4096], [32, 1024])
DOCUMENTS = {"long": (1 / 128, 1 / 4), "short": (1 / 512, 1 / 16)}
# SDPA gets a dynamic workload's mask and bias as one float attn_mask, differentiable under its
# efficient and math backends, and a rows or window workload's mask as a bool attn_mask; flash
# takes no attn_mask, and issue #4's SDPA baseline is the efficient backend, so flash and cuDNN
# get no row on a dynamic, rows, window or varlen workload
ELEMENT_MASK_PROVIDERS = ("omniattn", "flex", "sdpa-efficient", "sdpa-math")
# backward = 2.5x forward FLOPs (FlashAttention's convention: 5 matmuls against 2)
_FWD_BWD_FLOP_FACTOR = 3.5
# CPU timing (`_time_cpu`): untimed calls first (the first call of a pass can run 100x slower),
# then at least CPU_MIN_RUNS timed calls lasting CPU_MIN_TIME_S in all, their median reported.
# On one thread, in process CPU time: on a CPU shared with other work, several threads wait on
# each other and a call's wall time swings 10-100x; CPU time leaves out the waits for a core
# (idle, the two clocks agree)
CPU_WARMUP_RUNS = 3
CPU_MIN_RUNS = 20
CPU_MIN_TIME_S = 0.1
CPU_TIMING_THREADS = 1

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Workload:
    """One attention shape. `density` set: a random block mask listing that fraction of the
    (block_size x block_size) blocks is the only mask (see `workload_block_mask`). `topk` set (a
    dynamic workload): a top-k element mask keeping `topk` keys per query row, within causal if
    `causal` (see `workload_keep_mask`), plus a learnable `bias` named in DYNAMIC_BIASES (see
    `workload_bias`). `row_lengths` set (a rows workload): per-row key lengths named in
    ROW_LENGTHS are the only mask (see `workload_row_lengths`). `window` set (a window
    workload): attention's window (left, right), -1 unbounded, is the only mask. `documents` set
    (a varlen workload): one batch of seqlen_q tokens packed from documents whose lengths are
    drawn as DOCUMENTS names (see `workload_documents`), attended each on its own (causal within
    each if `causal`)."""

    name: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_k: int
    head_dim: int
    causal: bool
    dtype: torch.dtype
    density: float | None = None
    block_size: int = 128
    topk: int | None = None
    bias: str | None = None
    row_lengths: str | None = None
    window: tuple[int, int] | None = None
    documents: str | None = None

    def __post_init__(self):
        if self.density is not None and not 0 < self.density <= 1:
            raise ValueError(f"{self.name}: density must lie in (0, 1], got {self.density}")
        if self.density is not None and self.causal:
            # Flex gets the block mask alone, so a causal sparse workload would differ by provider
            raise ValueError(f"{self.name}: a sparse workload's block mask is its only mask; "
                             f"causal must be False")
        if self.density is not None and self.topk is not None:
            raise ValueError(f"{self.name}: a workload has a block mask (density) or a top-k "
                             f"mask (topk), not both")
        if (self.topk is None) != (self.bias is None):
            raise ValueError(f"{self.name}: a dynamic workload has both a top-k mask (topk) and a "
                             f"bias, any other workload neither")
        if self.bias is not None and self.bias not in DYNAMIC_BIASES:
            raise ValueError(f"{self.name}: bias must be one of {list(DYNAMIC_BIASES)}, "
                             f"got {self.bias!r}")
        if self.row_lengths is not None:
            if self.row_lengths not in ROW_LENGTHS:
                raise ValueError(f"{self.name}: row_lengths must be one of {list(ROW_LENGTHS)}, "
                                 f"got {self.row_lengths!r}")
            if self.density is not None or self.topk is not None:
                raise ValueError(f"{self.name}: a rows workload's lengths are its only mask; "
                                 f"no density, topk or bias")
            if self.causal:
                # the tile counts (`row_lengths_pairs`) are those of the lengths alone
                raise ValueError(f"{self.name}: a rows workload's lengths are its only mask; "
                                 f"causal must be False (progressive lengths are causal's)")
        if self.window is not None:
            if len(self.window) != 2 or min(self.window) < -1:
                raise ValueError(f"{self.name}: window must be (left, right), each -1 "
                                 f"(unbounded) or more, got {self.window}")
            if self.causal or self.density is not None or self.topk is not None \
                    or self.row_lengths is not None:
                raise ValueError(f"{self.name}: a window workload's window is its only mask; "
                                 f"no causal (a right bound of 0 is causal), density, topk or "
                                 f"row_lengths")
        if self.documents is not None:
            if self.documents not in DOCUMENTS:
                raise ValueError(f"{self.name}: documents must be one of {list(DOCUMENTS)}, "
                                 f"got {self.documents!r}")
            if self.batch != 1 or self.seqlen_q != self.seqlen_k:
                raise ValueError(f"{self.name}: a varlen workload packs its documents in one "
                                 f"batch of seqlen_q == seqlen_k tokens")
            if self.density is not None or self.topk is not None \
                    or self.row_lengths is not None or self.window is not None:
                raise ValueError(f"{self.name}: a varlen workload's documents are its only "
                                 f"mask (with causal); no density, topk, row_lengths or window")


def _dense_and_causal(shapes, heads: int, head_dim: int, dtype: torch.dtype,
                      suffix: str = "") -> list[Workload]:
    """Self-attention, dense then causal, for each (batch, seqlen) in shapes."""
    return [
        Workload(f"{'causal' if causal else 'dense'}-b{batch}-s{seqlen}{suffix}", batch, seqlen,
                 seqlen, heads, heads, head_dim, causal, dtype)
        for batch, seqlen in shapes
        for causal in (False, True)
    ]


def _core_suite(cuda: bool) -> list[Workload]:
    if cuda:
        return _dense_and_causal([(2, 4096), (1, 16384)], 16, 128, torch.bfloat16)
    return _dense_and_causal([(1, 256), (1, 512)], 4, 64, torch.float32)


def _seqlen_suite(cuda: bool) -> list[Workload]:
    if cuda:
        tokens, heads, head_dim, dtype = SEQLEN_SUITE_TOKENS, 16, 128, torch.bfloat16
        seqlens = (1024, 2048, 4096, 8192, 16384)
    else:
        tokens, heads, head_dim, dtype = 256, 4, 64, torch.float32
        seqlens = (64, 128, 256)
    return _dense_and_causal([(tokens // seqlen, seqlen) for seqlen in seqlens], heads, head_dim,
                             dtype)


def _sparse_suite(cuda: bool) -> list[Workload]:
    if cuda:
        batch, seqlen, heads, head_dim, dtype, block_size = 1, 16384, 16, 128, torch.bfloat16, 128
    else:
        batch, seqlen, heads, head_dim, dtype, block_size = 1, 512, 4, 64, torch.float32, 64
    return [
        Workload(f"sparse-d{density:.2f}-b{batch}-s{seqlen}", batch, seqlen, seqlen, heads,
                 heads, head_dim, False, dtype, density=density, block_size=block_size)
        for density in SPARSE_DENSITIES
    ]


def _gqa_suite(cuda: bool) -> list[Workload]:
    if cuda:
        batch, seqlen, heads, heads_k, head_dim, dtype = 1, 8192, 32, 8, 128, torch.bfloat16
    else:
        batch, seqlen, heads, heads_k, head_dim, dtype = 1, 512, 8, 2, 64, torch.float32
    return [Workload(f"gqa-causal-b{batch}-s{seqlen}-h{heads}-hk{heads_k}", batch, seqlen, seqlen,
                     heads, heads_k, head_dim, True, dtype)]


def _headdim_suite(cuda: bool) -> list[Workload]:
    shapes, heads, dtype = ([(2, 4096)], 16, torch.bfloat16) if cuda \
        else ([(1, 256)], 4, torch.float32)
    return [workload for head_dim in (64, 256)
            for workload in _dense_and_causal(shapes, heads, head_dim, dtype, f"-d{head_dim}")]


def _dynamic_suite(cuda: bool) -> list[Workload]:
    if cuda:
        batch, seqlen, heads, head_dim, dtype = 2, 4096, 16, 128, torch.bfloat16
    else:
        batch, seqlen, heads, head_dim, dtype = 1, 256, 2, 64, torch.float32
    # issue #4's workload keeps a quarter of the keys per row: 1024 at 4k
    return [Workload(f"dyn-{bias}-b{batch}-s{seqlen}", batch, seqlen, seqlen, heads, heads,
                     head_dim, True, dtype, topk=seqlen // 4, bias=bias)
            for bias in DYNAMIC_BIASES]


def _rows_suite(cuda: bool) -> list[Workload]:
    if cuda:
        batch, seqlen, heads, head_dim, dtype = 2, 8192, 16, 128, torch.bfloat16
    else:  # two batches: each has its own lengths
        batch, seqlen, heads, head_dim, dtype = 2, 256, 2, 64, torch.float32
    # the dense run of the same shape is the reference the lengths' times scale against
    dense = Workload(f"dense-b{batch}-s{seqlen}", batch, seqlen, seqlen, heads, heads, head_dim,
                     False, dtype)
    return [dense] + [Workload(f"rows-{lengths}-b{batch}-s{seqlen}", batch, seqlen, seqlen,
                               heads, heads, head_dim, False, dtype, row_lengths=lengths)
                      for lengths in ROW_LENGTHS]


def _window_suite(cuda: bool) -> list[Workload]:
    if cuda:
        batch, seqlen, heads, dtype = 2, 8192, 16, torch.bfloat16
        shapes = [(1024, 0, heads, 128), (512, 512, heads, 128), (1024, 0, 4, 128),
                  (1024, 0, heads, 256)]
    else:
        batch, seqlen, heads, dtype = 1, 256, 4, torch.float32
        shapes = [(64, 0, heads, 64), (32, 32, heads, 64)]
    workloads = []
    for left, right, heads_k, head_dim in shapes:
        kind = f"sliding{left}" if right == 0 else f"window{left}-{right}"
        name = f"{kind}-b{batch}-s{seqlen}" + (f"-hk{heads_k}" if heads_k != heads else "") \
            + f"-d{head_dim}"
        workloads.append(Workload(name, batch, seqlen, seqlen, heads, heads_k, head_dim, False,
                                  dtype, window=(left, right)))
    return workloads


def _varlen_suite(cuda: bool) -> list[Workload]:
    if cuda:  # D256 named apart: both passes run their own Gluon kernels there
        total, heads, head_dims, dtype = 16384, 16, (128, 256), torch.bfloat16
    else:
        total, heads, head_dims, dtype = 256, 2, (64,), torch.float32
    return [Workload(f"docs-{documents}{'-causal' if causal else ''}"
                     f"{'-d256' if head_dim == 256 else ''}-s{total}", 1, total, total, heads,
                     heads, head_dim, causal, dtype, documents=documents)
            for head_dim in head_dims for documents in DOCUMENTS for causal in (False, True)]


_SUITE_BUILDERS = {"core": _core_suite, "seqlen": _seqlen_suite, "sparse": _sparse_suite,
                   "gqa": _gqa_suite, "headdim": _headdim_suite, "dynamic": _dynamic_suite,
                   "rows": _rows_suite, "window": _window_suite, "varlen": _varlen_suite}


def default_workloads(device: str | torch.device, suite: str = "core") -> list[Workload]:
    """Workloads of one suite, or of all of them with suite="all":

    core: dense and causal, 4k B2 and 16k B1, H16 D128 (the FlashAttention-style suite);
    seqlen: dense and causal at sequence lengths 1k-16k, batch x seqlen = SEQLEN_SUITE_TOKENS,
    H16 D128 (plotted as time against sequence length);
    sparse: 16k B1 H16 D128 under random 128 x 128 block masks at each of SPARSE_DENSITIES;
    gqa: causal 8k B1, 32 query heads on 8 key/value heads, D128;
    headdim: dense and causal 4k B2 H16 at D 64 and D 256;
    dynamic: causal 4k B2 H16 D128 under a causal top-k mask keeping 1024 keys per row, with a
    full or a key bias (Dynamic Mask Attention, issue #4);
    rows: 8k B2 H16 D128, dense, then per-row key lengths (seqlens_k_per_row, not causal) each
    of ROW_LENGTHS: uniform in [1, Sk] per row, and i + 1 (causal's pattern: whole tiles skipped);
    window: 8k B2 H16 under a sliding window (1024, 0) at D128, GQA 16/4 and D256, and a local
    one (512, 512) at D128;
    varlen: 16k tokens H16 D128 and D256 packed from documents of 128-4096 or 32-1024 tokens
    (cu_seqlens), each attended alone, dense or causal.
    GPU: bf16. CPU: small fp32 equivalents that run in seconds (they check the plumbing; their
    numbers say nothing about the GPU kernels). "all": every suite's workloads, each once (the
    seqlen suite shares shapes with core and rows)."""
    cuda = torch.device(device).type == "cuda"
    if suite == "all":
        return list(dict.fromkeys(workload for build in _SUITE_BUILDERS.values()
                                  for workload in build(cuda)))
    if suite not in _SUITE_BUILDERS:
        raise ValueError(f"unknown suite {suite!r}; choose from {[*SUITES, 'all']}")
    return _SUITE_BUILDERS[suite](cuda)


def workload_block_mask(workload: Workload,
                        device: str | torch.device) -> omniattn.BlockMask | None:
    """The sparse workload's mask: round(density x blocks) of its (1, 1, nQ, nK) blocks, drawn
    by a randperm seeded 0 (so a lower density's blocks are a subset of a higher one's), all
    FULL. None for a workload without density."""
    if workload.density is None:
        return None
    n_q = triton.cdiv(workload.seqlen_q, workload.block_size)
    n_k = triton.cdiv(workload.seqlen_k, workload.block_size)
    generator = torch.Generator().manual_seed(0)
    listed = torch.randperm(n_q * n_k, generator=generator)[:round(workload.density * n_q * n_k)]
    blocks = torch.zeros(n_q * n_k, dtype=torch.bool)
    blocks[listed] = True
    return omniattn.block_mask_from_blocks(blocks.view(1, 1, n_q, n_k).to(device),
                                           workload.block_size,
                                           seq_lengths=(workload.seqlen_q, workload.seqlen_k))


def workload_keep_mask(workload: Workload, device: str | torch.device) -> torch.Tensor | None:
    """The dynamic workload's element mask: bool (B, H, Sq, Sk), True = keep, from `topk_mask`:
    each query row keeps the `topk` keys of largest score among those causal lets it see (all of
    them when it sees fewer), so the mask hides what causal hides. The scores are per key,
    (B, H, 1, Sk) random normal from a CPU generator seeded 0: the same mask on every device.
    None for a workload without topk."""
    if workload.topk is None:
        return None
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn((workload.batch, workload.heads, 1, workload.seqlen_k),
                         generator=generator)
    return omniattn.topk_mask(scores.to(device), workload.topk, causal=workload.causal,
                              seqlen_q=workload.seqlen_q)


def workload_bias(workload: Workload, device: str | torch.device) -> torch.Tensor | None:
    """The dynamic workload's learnable bias, shaped as DYNAMIC_BIASES names it, in the workload's
    dtype: random normal (seeded 1), a leaf that requires grad. None for a workload without
    bias."""
    if workload.bias is None:
        return None
    rows = workload.seqlen_q if workload.bias == "full" else 1
    generator = torch.Generator(device).manual_seed(1)
    bias = torch.randn((workload.batch, workload.heads, rows, workload.seqlen_k),
                       generator=generator, device=device, dtype=workload.dtype)
    return bias.requires_grad_()


def workload_row_lengths(workload: Workload,
                         device: str | torch.device) -> torch.Tensor | None:
    """The rows workload's per-row key lengths, int32 (B, Sq) on the device, in [1, Sk] (no row
    sees no key, where SDPA would return NaN): "uniform" draws each row's length uniformly
    (device generator seeded 2), "progressive" gives row i the length i + 1 (clipped to Sk).
    None for a workload without row_lengths."""
    if workload.row_lengths is None:
        return None
    shape, seqlen_k = (workload.batch, workload.seqlen_q), workload.seqlen_k
    if workload.row_lengths == "uniform":
        generator = torch.Generator(device).manual_seed(2)
        return torch.randint(1, seqlen_k + 1, shape, generator=generator, device=device,
                             dtype=torch.int32)
    lengths = torch.arange(1, workload.seqlen_q + 1, device=device, dtype=torch.int32)
    return lengths.clamp(max=seqlen_k).expand(shape).contiguous()


def workload_documents(workload: Workload) -> torch.Tensor | None:
    """The varlen workload's cu_seqlens, int32 (documents + 1,) on the CPU: document lengths
    drawn uniformly from the DOCUMENTS range (CPU generator seeded 3) until they fill seqlen_q,
    the last one cut to fit. None for a workload without documents."""
    if workload.documents is None:
        return None
    low, high = (max(1, round(f * workload.seqlen_q)) for f in DOCUMENTS[workload.documents])
    generator = torch.Generator().manual_seed(3)
    offsets = [0]
    while offsets[-1] < workload.seqlen_q:
        length = int(torch.randint(low, high + 1, (1,), generator=generator))
        offsets.append(min(offsets[-1] + length, workload.seqlen_q))
    return torch.tensor(offsets, dtype=torch.int32)


class ExtraInputs:
    """What one workload adds to q, k, v, built once per workload and shared by every provider
    and mode (omniattn caches its block-mask schedule on the BlockMask; the 4k keep mask and full
    bias are 1.6 GB): `block_mask` of a sparse workload, `keep` mask and `bias` of a dynamic one,
    `row_lens` of a rows one, `cu_seqlens` (on the device) and `max_document` of a varlen one
    (None where the workload has none). The forms one provider needs are built on its first use,
    outside any timed region."""

    def __init__(self, workload: Workload, device: str | torch.device):
        self.workload = workload
        self.device = torch.device(device)
        self.block_mask = workload_block_mask(workload, device)
        self.keep = workload_keep_mask(workload, device)
        self.bias = workload_bias(workload, device)
        self.row_lens = workload_row_lengths(workload, device)
        offsets = workload_documents(workload)
        self.cu_seqlens = None if offsets is None else offsets.to(self.device)
        self.max_document = None if offsets is None else int(offsets.diff().max())

    @property
    def learnable(self) -> tuple[torch.Tensor, ...]:
        """The tensors besides q, k, v that fwd+bwd differentiates, as omniattn and Flex read
        them."""
        return () if self.bias is None else (self.bias,)

    @functools.cached_property
    def sdpa_mask(self) -> torch.Tensor:
        """SDPA's form of the keep mask and bias: one float (B, H, Sq, Sk) attn_mask, the bias
        where kept and -inf elsewhere; a leaf that requires grad, so fwd+bwd computes its
        gradient. A key bias is expanded and materialised too: SDPA takes no bias besides
        attn_mask, so this is its only way to apply one (its gradient comes back (B, H, Sq, Sk),
        left unsummed over queries)."""
        return torch.where(self.keep, self.bias.detach(), float("-inf")).requires_grad_()

    @functools.cached_property
    def sdpa_row_mask(self) -> torch.Tensor:
        """SDPA's form of the row lengths: bool (B, 1, Sq, Sk) attn_mask, True where key j <
        lengths[b, i], materialised (256 MB at B2 8k), broadcast over heads."""
        keys = torch.arange(self.workload.seqlen_k, device=self.device)
        return (keys < self.row_lens[..., None]).unsqueeze(1)

    @functools.cached_property
    def sdpa_window_mask(self) -> torch.Tensor:
        """SDPA's form of the window: bool (1, 1, Sq, Sk) attn_mask, materialised (64 MB at 8k),
        broadcast over batch and heads."""
        w = self.workload
        return RelativePredicate.make(window=w.window).holds(
            torch.arange(w.seqlen_q, device=self.device)[:, None],
            torch.arange(w.seqlen_k, device=self.device), w.seqlen_q, w.seqlen_k)[None, None]

    @functools.cached_property
    def document_ids(self) -> torch.Tensor:
        """Each token's document, int64 (seqlen_q,) on the device."""
        lengths = self.cu_seqlens.diff().long()
        return torch.repeat_interleave(torch.arange(len(lengths), device=self.device), lengths)

    @functools.cached_property
    def sdpa_document_mask(self) -> torch.Tensor:
        """SDPA's form of the documents: bool (1, 1, S, S) attn_mask, True within a document
        (and causal inside it if the workload is), materialised (256 MB at 16k)."""
        docs = self.document_ids
        mask = docs[:, None] == docs[None, :]
        return (mask.tril() if self.workload.causal else mask)[None, None]

    @functools.cached_property
    def flex_block_mask(self):
        """FlexAttention's form of the mask: the block mask converted, the keep mask as a
        mask_mod (causal included, see `workload_keep_mask`), the row lengths as a mask_mod
        (one mask for every head), the window, the documents (causal inside each if the
        workload is) or bottom-right causal as a mask_mod; None for a dense workload."""
        from torch.nn.attention.flex_attention import create_block_mask

        workload = self.workload
        if self.block_mask is not None:
            return self.block_mask.to_flex()
        if self.keep is not None:
            keep = self.keep

            def kept(b, h, q_idx, kv_idx):
                return keep[b, h, q_idx, kv_idx]

            return create_block_mask(kept, workload.batch, workload.heads, workload.seqlen_q,
                                     workload.seqlen_k, device=self.device)
        if self.row_lens is not None:
            lens = self.row_lens

            def within_row_length(b, h, q_idx, kv_idx):
                return kv_idx < lens[b, q_idx]

            return create_block_mask(within_row_length, workload.batch, None, workload.seqlen_q,
                                     workload.seqlen_k, device=self.device)
        if workload.window is not None:
            predicate = RelativePredicate.make(window=workload.window)

            def in_window(b, h, q_idx, kv_idx):
                return predicate.holds(q_idx, kv_idx, workload.seqlen_q, workload.seqlen_k)

            return create_block_mask(in_window, None, None, workload.seqlen_q,
                                     workload.seqlen_k, device=self.device)
        if self.cu_seqlens is not None:
            docs, causal = self.document_ids, workload.causal

            def same_document(b, h, q_idx, kv_idx):
                inside = docs[q_idx] == docs[kv_idx]
                return inside & (kv_idx <= q_idx) if causal else inside

            return create_block_mask(same_document, None, None, workload.seqlen_q,
                                     workload.seqlen_k, device=self.device)
        if workload.causal:
            diag_offset = workload.seqlen_k - workload.seqlen_q

            def bottom_right_causal(b, h, q_idx, kv_idx):
                return kv_idx <= q_idx + diag_offset

            return create_block_mask(bottom_right_causal, None, None, workload.seqlen_q,
                                     workload.seqlen_k, device=self.device)
        return None


class BuiltAttention(NamedTuple):
    """A provider built for one workload: fn(q, k, v) -> out, and the tensors besides q, k, v
    that fn reads and fwd+bwd differentiates (the bias, in the form this provider takes it)."""

    fn: AttentionFn
    learnable: tuple[torch.Tensor, ...] = ()


def _to_sdpa_layout(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)  # (B, S, H, D) <-> (B, H, S, D), a view


def _omniattn(workload: Workload, device: torch.device, extra: ExtraInputs) -> BuiltAttention:
    block_mask, keep, bias, row_lens = extra.block_mask, extra.keep, extra.bias, extra.row_lens
    cu_seqlens, longest = extra.cu_seqlens, extra.max_document

    # check_inputs=False: the values it checks are the row lengths' and cu_seqlens', right by
    # construction (`workload_row_lengths`, `workload_documents`); checking them syncs with the
    # host on every timed call. (1, S, H, D) -> the packed (S, H, D) views by squeeze, whose
    # gradient is a view too (q[0]'s is a zero fill and a copy per input)
    def run_packed(q, k, v):
        return omniattn.attention(q.squeeze(0), k.squeeze(0), v.squeeze(0),
                                  causal=workload.causal, cu_seqlens_q=cu_seqlens,
                                  cu_seqlens_k=cu_seqlens, max_seqlen_q=longest,
                                  max_seqlen_k=longest, check_inputs=False).unsqueeze(0)

    if cu_seqlens is not None:
        return BuiltAttention(run_packed)

    def run(q, k, v):
        return omniattn.attention(q, k, v, causal=workload.causal, window=workload.window,
                                  block_mask=block_mask, attn_mask=keep, attn_bias=bias,
                                  seqlens_k_per_row=row_lens, check_inputs=False)

    return BuiltAttention(run, extra.learnable)


def _sdpa(backend, cuda_only: bool):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    # extra.block_mask is always None: run_suite gives SDPA no sparse workload
    # (BLOCK_MASK_PROVIDERS)
    def build(workload: Workload, device: torch.device, extra: ExtraInputs) -> BuiltAttention:
        if cuda_only and device.type != "cuda":
            raise RuntimeError("benchmarked on CUDA only")
        # a dynamic workload's float mask hides what causal hides (SDPA takes no attn_mask
        # together with is_causal); a rows or window workload's bool mask is its only mask
        # (never causal), a varlen one's holds its causal
        attn_mask = extra.sdpa_mask if extra.keep is not None \
            else extra.sdpa_row_mask if extra.row_lens is not None \
            else extra.sdpa_window_mask if workload.window is not None \
            else extra.sdpa_document_mask if extra.cu_seqlens is not None else None
        is_causal = workload.causal and attn_mask is None
        # SDPA's is_causal is top-left aligned; it equals omniattn's bottom-right causal only here
        if is_causal and workload.seqlen_q != workload.seqlen_k:
            raise ValueError(f"SDPA is_causal differs from omniattn's causal when Sq != Sk "
                             f"({workload.seqlen_q} != {workload.seqlen_k})")
        enable_gqa = workload.heads != workload.heads_k

        def run(q, k, v):
            with sdpa_kernel(backend):
                out = scaled_dot_product_attention(
                    _to_sdpa_layout(q), _to_sdpa_layout(k), _to_sdpa_layout(v),
                    attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)
            return _to_sdpa_layout(out)

        # the float mask carries the bias and its gradient; the bool one has none
        return BuiltAttention(run, (attn_mask,) if extra.keep is not None else ())

    return build


def _flex_score_mod(workload: Workload, bias: torch.Tensor | None):
    """FlexAttention's score_mod adding the dynamic workload's bias; None without one."""
    if workload.bias == "full":
        return lambda score, b, h, q_idx, kv_idx: score + bias[b, h, q_idx, kv_idx]
    if workload.bias == "key":
        return lambda score, b, h, q_idx, kv_idx: score + bias[b, h, 0, kv_idx]
    return None


def _flex(workload: Workload, device: torch.device, extra: ExtraInputs) -> BuiltAttention:
    if device.type != "cuda":
        raise RuntimeError("benchmarked on CUDA only")
    from torch.nn.attention.flex_attention import flex_attention

    flex_mask = extra.flex_block_mask
    score_mod = _flex_score_mod(workload, extra.bias)
    # static shapes, and a fresh compile cache per workload, so the suite never reaches dynamo's
    # recompile limit nor falls back to a slower dynamic-shape kernel
    torch.compiler.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    enable_gqa = workload.heads != workload.heads_k

    def run(q, k, v):
        out = compiled(_to_sdpa_layout(q), _to_sdpa_layout(k), _to_sdpa_layout(v),
                       score_mod=score_mod, block_mask=flex_mask, enable_gqa=enable_gqa)
        return _to_sdpa_layout(out)

    return BuiltAttention(run, extra.learnable)


def _providers() -> dict[str, Callable[[Workload, torch.device, ExtraInputs], BuiltAttention]]:
    """name -> build(workload, device, extra)."""
    from torch.nn.attention import SDPBackend

    return {
        "omniattn": _omniattn,
        "sdpa-cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION, cuda_only=True),
        "sdpa-flash": _sdpa(SDPBackend.FLASH_ATTENTION, cuda_only=True),
        "sdpa-efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION, cuda_only=True),
        "sdpa-math": _sdpa(SDPBackend.MATH, cuda_only=False),
        "flex": _flex,
    }


PROVIDERS = tuple(_providers())


def default_providers(device: str | torch.device) -> tuple[str, ...]:
    if torch.device(device).type == "cuda":
        return ("omniattn", "sdpa-cudnn", "sdpa-flash", "sdpa-efficient", "flex")
    return ("omniattn", "sdpa-math")


def computed_pairs(seqlen_q: int, seqlen_k: int, causal: bool, block_m: int, block_n: int,
                   window: tuple[int, int] | None = None) -> int:
    """(query, key) pairs inside the key tiles the forward kernel visits, rows clipped to Sq and
    keys to Sk. Causal and windows (left, right; -1 unbounded) are bottom-right aligned: query
    tile m visits the key tiles from the one holding its first row's first key to the one
    holding its last row's last key (causal: n * block_n <= min((m + 1) * block_m, Sq) - 1 +
    Sk - Sq)."""
    predicate = RelativePredicate.make(causal, window)
    left, right = predicate.left, predicate.right
    diag = seqlen_k - seqlen_q
    pairs = 0
    for start_m in range(0, seqlen_q, block_m):
        end_m = min(start_m + block_m, seqlen_q)
        key_lo = max(start_m + diag - left, 0) if left >= 0 else 0  # first row's first key
        key_hi = min(max(end_m + diag + right, 0), seqlen_k) if right >= 0 else seqlen_k
        first = key_lo // block_n * block_n
        end = min(triton.cdiv(key_hi, block_n) * block_n, seqlen_k)
        pairs += (end_m - start_m) * max(end - first, 0)
    return pairs


def block_mask_pairs(block_mask: omniattn.BlockMask) -> float:
    """(query, key) pairs inside the listed blocks, each block clipped to (Sq, Sk): the tiles
    the kernel computes. Per (batch, head), averaged over the mask's (B|1, H|1) entries."""
    block_q, block_k = block_mask.block_size
    seqlen_q, seqlen_k = block_mask.seq_lengths
    n_q, n_k = block_mask.n_blocks
    rows = (seqlen_q - torch.arange(n_q) * block_q).clamp(max=block_q)  # last block may be short
    cols = (seqlen_k - torch.arange(n_k) * block_k).clamp(max=block_k)
    listed = (block_mask.states != 0).cpu().to(torch.int64)  # (B|1, H|1, n_q, n_k)
    pairs = (listed * rows[:, None] * cols[None, :]).sum().item()
    return pairs / (listed.shape[0] * listed.shape[1])


def element_mask_pairs(keep: torch.Tensor, causal: bool, block_m: int,
                       block_n: int) -> tuple[float, float, float]:
    """(pairs, visible, active_tile_fraction) of an element mask: the (query, key) pairs inside
    the (block_m x block_n) tiles holding at least one visible element (kept and, if causal,
    not hidden by causal: the tiles the forward kernel visits), each tile clipped to (Sq, Sk);
    the visible elements; the fraction of all tiles so visited. Pairs per (batch, head),
    averaged over the mask's leading entries. Counted on the host with tensor ops."""
    seqlen_q, seqlen_k = keep.shape[-2:]
    visible = keep.cpu()
    if causal:  # bottom-right aligned
        q_idx, k_idx = torch.arange(seqlen_q)[:, None], torch.arange(seqlen_k)
        visible = visible & (k_idx <= q_idx + seqlen_k - seqlen_q)
    n_q, n_k = triton.cdiv(seqlen_q, block_m), triton.cdiv(seqlen_k, block_n)
    # whole tiles: the padding is hidden
    tiles = torch.nn.functional.pad(visible, (0, n_k * block_n - seqlen_k,
                                              0, n_q * block_m - seqlen_q))
    tiles = tiles.unflatten(-1, (n_k, block_n)).unflatten(-3, (n_q, block_m))
    active = tiles.any(dim=(-3, -1))  # (..., n_q, n_k)
    rows = (seqlen_q - torch.arange(n_q) * block_m).clamp(max=block_m)  # last tile may be short
    cols = (seqlen_k - torch.arange(n_k) * block_n).clamp(max=block_n)
    entries = active[..., 0, 0].numel()
    pairs = (active * rows[:, None] * cols[None, :]).sum().item() / entries
    # count_nonzero: a bool sum() widens every element first (seconds at 4k)
    exact = visible.count_nonzero().item() / entries
    return pairs, exact, active.count_nonzero().item() / active.numel()


def row_lengths_pairs(row_lens: torch.Tensor, seqlen_k: int, block_m: int, block_n: int,
                      grouped: bool = False) -> tuple[float, float, float]:
    """(pairs, visible, active_tile_fraction) of per-row key lengths (B, Sq), row i of batch b
    seeing keys [0, min(lengths[b, i], Sk)): the (query, key) pairs inside the (block_m x
    block_n) tiles holding at least one visible element (query tile m visits the key tiles
    below cdiv(its longest row, block_n): the tiles the forward kernel visits), each tile
    clipped to (Sq, Sk); the visible elements; the fraction of all tiles so visited. grouped:
    the rows are tiled longest first, as omniattn.attention runs lengths alone (see
    groups_rows_by_length). Pairs per batch (heads share the lengths), averaged over the
    batches. O(B * Sq) memory, on the lengths' device: no (Sq, Sk) picture."""
    lens = row_lens.to(torch.int64).clamp(0, seqlen_k)
    if grouped:
        lens = lens.sort(dim=-1, descending=True).values
    batch, seqlen_q = lens.shape
    n_q, n_k = triton.cdiv(seqlen_q, block_m), triton.cdiv(seqlen_k, block_n)
    # padding rows see no key
    longest = torch.nn.functional.pad(lens, (0, n_q * block_m - seqlen_q)).view(
        batch, n_q, block_m).amax(-1)  # (B, n_q)
    key_tiles = (longest + block_n - 1) // block_n  # visited by each query tile
    rows = (seqlen_q - torch.arange(n_q, device=lens.device) * block_m).clamp(max=block_m)
    pairs = (rows * (key_tiles * block_n).clamp(max=seqlen_k)).sum().item() / batch
    exact = lens.sum().item() / batch
    return pairs, exact, key_tiles.sum().item() / (batch * n_q * n_k)


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool,
                  window: tuple[int, int] | None = None) -> int:
    """(query, key) pairs the mask lets through: Sq * Sk dense, the bottom-right triangle causal,
    the band of a window (left, right; -1 unbounded) about the bottom-right diagonal."""
    predicate = RelativePredicate.make(causal, window)
    left, right = predicate.left, predicate.right
    diag = seqlen_k - seqlen_q
    pairs = 0
    for i in range(seqlen_q):
        first = max(i + diag - left, 0) if left >= 0 else 0
        end = min(max(i + diag + right + 1, 0), seqlen_k) if right >= 0 else seqlen_k
        pairs += max(end - first, 0)
    return pairs


def _flops(workload: Workload, pairs: int, mode: str) -> float:
    # 2 matmuls (QK^T, PV) of 2 FLOPs per multiply-add
    fwd = 4 * workload.batch * workload.heads * workload.head_dim * pairs
    return fwd * (_FWD_BWD_FLOP_FACTOR if mode == "fwd+bwd" else 1.0)


class Timing(NamedTuple):
    """A median time per call and the calls behind it: `warmup_runs` untimed, then
    `timed_runs` timed (both None where do_bench picks them from its time budgets; all three None
    for a run that raised)."""

    ms: float | None
    warmup_runs: int | None
    timed_runs: int | None


def _timer_fields(device: torch.device) -> dict:
    """How a device's runs are timed, as records carry it: the clock and the CPU threads."""
    if device.type == "cuda":
        return {"timer": "triton.testing.do_bench", "threads": None}
    return {"timer": "time.process_time", "threads": CPU_TIMING_THREADS}


def _time_cpu(fn: Callable[[], object]) -> Timing:
    """Median process CPU time per call of fn on CPU_TIMING_THREADS threads, after
    CPU_WARMUP_RUNS untimed calls, over at least CPU_MIN_RUNS calls and CPU_MIN_TIME_S seconds of
    them; the process's thread count is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(CPU_TIMING_THREADS)
    try:
        for _ in range(CPU_WARMUP_RUNS):
            fn()
        seconds = []
        while len(seconds) < CPU_MIN_RUNS or sum(seconds) < CPU_MIN_TIME_S:
            start = process_time()
            fn()
            seconds.append(process_time() - start)
    finally:
        torch.set_num_threads(threads)
    return Timing(statistics.median(seconds) * 1e3, CPU_WARMUP_RUNS, len(seconds))


def _make_inputs(workload: Workload, device: torch.device, requires_grad: bool):
    """q (B, Sq, H, D), k, v (B, Sk, Hk, D) and dout like q; random normal, seeded."""
    generator = torch.Generator(device).manual_seed(0)

    def randn(seqlen, heads, grad):
        shape = (workload.batch, seqlen, heads, workload.head_dim)
        t = torch.randn(shape, generator=generator, device=device, dtype=workload.dtype)
        return t.requires_grad_(grad)

    q = randn(workload.seqlen_q, workload.heads, requires_grad)
    k = randn(workload.seqlen_k, workload.heads_k, requires_grad)
    v = randn(workload.seqlen_k, workload.heads_k, requires_grad)
    dout = randn(workload.seqlen_q, workload.heads, False)
    return q, k, v, dout


def _step(attn: BuiltAttention, mode: str, q, k, v, dout) -> Callable[[], object]:
    if mode == "fwd":
        def forward():
            # a bias requires grad in both modes (built once per workload): record no graph
            with torch.no_grad():
                return attn.fn(q, k, v)

        return forward
    leaves = (q, k, v, *attn.learnable)
    return lambda: torch.autograd.grad(attn.fn(q, k, v), leaves, dout)


def _measure(build, workload: Workload, extra: ExtraInputs, mode: str, device: torch.device,
             inputs) -> Timing:
    step = _step(build(workload, device, extra), mode, *inputs)
    if device.type != "cuda":
        return _time_cpu(step)
    step()  # compiles kernels and surfaces an unavailable backend before timing starts
    ms = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
    return Timing(ms, None, None)


def _providers_for(workload: Workload, providers: tuple[str, ...]) -> tuple[str, ...]:
    """The providers that run the workload: those that take its kind of mask."""
    if workload.density is not None:
        runnable = BLOCK_MASK_PROVIDERS
    elif workload.topk is not None or workload.row_lengths is not None \
            or workload.window is not None or workload.documents is not None:
        runnable = ELEMENT_MASK_PROVIDERS
    else:
        return providers
    return tuple(p for p in providers if p in runnable)


def _gluon_forward(workload: Workload, extra: ExtraInputs, plain: bool) -> bool:
    """Whether omniattn's forward of this workload runs the Gluon kernel (`gluon_refusal`, from
    the device, dtype, head dim and options; plain: no mask, bias, lengths or packing)."""
    probe = torch.empty((0, 0, workload.heads, workload.head_dim), device=extra.device,
                        dtype=workload.dtype)
    args = KernelArgs.make(workload.head_dim, workload.causal, workload.window, None, 0.0)
    full_bias = extra.bias if workload.bias == "full" else None
    return gluon_refusal(probe, args, full_bias, plain=plain) is None


def _pairs(workload: Workload, extra: ExtraInputs) -> tuple[float, float, float | None]:
    """(pairs in the tiles omniattn's forward kernel computes, visible pairs, active tile
    fraction) per (batch, head); the fraction is for element masks and row lengths only (None
    otherwise). Tiles: the Gluon forward's where it takes the workload, else the Triton one's."""
    if extra.block_mask is not None:
        pairs = block_mask_pairs(extra.block_mask)
        return pairs, pairs, None
    if extra.keep is not None:
        # an element mask with a left window bound keeps the Triton forward's finer tiles
        left = workload.window is not None and workload.window[0] >= 0
        tile = forward_config(workload.head_dim, workload.dtype, masked=True, elementwise=True,
                              gluon=not left and _gluon_forward(workload, extra, plain=False),
                              full_bias=workload.bias == "full")
        return element_mask_pairs(extra.keep, workload.causal, tile.block_m, tile.block_n)
    if extra.row_lens is not None:
        # per-row lengths alone keep the dense tiles (128 x 128 at D128 bf16 on the GPU), as
        # omniattn.attention picks them
        tile = forward_config(workload.head_dim, workload.dtype, masked=workload.causal)
        grouped = not workload.causal and groups_rows_by_length(
            workload.seqlen_q, workload.head_dim, workload.dtype)
        return row_lengths_pairs(extra.row_lens, workload.seqlen_k, tile.block_m, tile.block_n,
                                 grouped)
    masked = workload.causal or workload.window is not None
    plain = extra.cu_seqlens is None
    tile = forward_config(workload.head_dim, workload.dtype, masked=masked)
    if _gluon_forward(workload, extra, plain):
        tile = hopper_forward_config(workload.head_dim, plain=plain)
    if extra.cu_seqlens is not None:  # each document alone
        lengths = extra.cu_seqlens.diff().tolist()
        return (sum(computed_pairs(n, n, workload.causal, tile.block_m, tile.block_n)
                    for n in lengths),
                sum(visible_pairs(n, n, workload.causal) for n in lengths), None)
    pairs = computed_pairs(workload.seqlen_q, workload.seqlen_k, workload.causal, tile.block_m,
                           tile.block_n, workload.window)
    exact = visible_pairs(workload.seqlen_q, workload.seqlen_k, workload.causal, workload.window)
    return pairs, exact, None


def _workload_fields(workload: Workload) -> dict:
    fields = dataclasses.asdict(workload)
    fields["dtype"] = str(workload.dtype).removeprefix("torch.")
    return fields


def run_suite(
    workloads: list[Workload],
    providers: list[str] | tuple[str, ...] | None = None,
    modes: tuple[str, ...] = MODES,
    progress: bool = True,
    device: str | torch.device | None = None,
) -> list[dict]:
    """One dict per workload x mode x provider: the workload's fields, device, provider, mode,
    flops (tile count), flops_exact, active_tile_fraction (element masks and row lengths; else
    None), ms (the median per call), tflops, error, and how ms was taken: timer, threads (CPU
    threads; None on the GPU), warmup_runs and timed_runs (calls; None where do_bench picks
    them, see `Timing`). A provider that raises is recorded with its error (ms, tflops and the
    counts None) and the suite goes on. Sparse workloads (density set) run only
    BLOCK_MASK_PROVIDERS, dynamic ones (topk set) and rows ones (row_lengths set) only
    ELEMENT_MASK_PROVIDERS; masks, bias and lengths are built once per workload (`ExtraInputs`)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    providers = tuple(providers or default_providers(device))
    builders = _providers()
    unknown = [p for p in providers if p not in builders]
    if unknown:
        raise ValueError(f"unknown providers {unknown}; choose from {list(builders)}")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; choose from {list(MODES)}")

    runs = sum(len(_providers_for(workload, providers)) for workload in workloads) * len(modes)
    bar = _progress_bar(runs, progress)
    results = []
    for workload in workloads:
        extra = ExtraInputs(workload, device)
        pairs, exact, active_tile_fraction = _pairs(workload, extra)
        for mode in modes:
            inputs = _make_inputs(workload, device, requires_grad=mode == "fwd+bwd")
            flops = _flops(workload, pairs, mode)
            for provider in _providers_for(workload, providers):
                if bar is not None:
                    bar.set_description(f"{workload.name} {mode} {provider}")
                try:
                    timing = _measure(builders[provider], workload, extra, mode, device, inputs)
                    error = None
                except Exception as exc:  # a backend that is unavailable here, or out of memory
                    timing, error = Timing(None, None, None), _describe_error(exc)
                ms = timing.ms
                results.append({
                    **_workload_fields(workload), "device": device.type, "provider": provider,
                    "mode": mode, "flops": flops, "flops_exact": _flops(workload, exact, mode),
                    "active_tile_fraction": active_tile_fraction, "ms": ms,
                    "tflops": None if ms is None else flops / (ms * 1e-3) / 1e12, "error": error,
                    **_timer_fields(device), "warmup_runs": timing.warmup_runs,
                    "timed_runs": timing.timed_runs,
                })
                if bar is not None:
                    bar.update()
    if bar is not None:
        bar.close()
    return results


def _describe_error(exc: Exception) -> str:
    """Exception type and the first line of its message (backend errors run to many lines)."""
    message = str(exc).strip()
    return f"{type(exc).__name__}: {message.splitlines()[0]}" if message else type(exc).__name__


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="run", leave=False)


def _git_commit() -> str | None:
    """HEAD of the checkout the package is imported from; None if it is not a git checkout."""
    checkout = Path(__file__).resolve().parent.parent
    try:
        lines = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=checkout,
                               capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    # an installed copy inside some other repository (a venv in a project) is not this checkout
    return lines[1] if Path(lines[0]).resolve() == checkout else None


def device_name() -> str:
    """The GPU's name, or the CPU's architecture where there is none."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def environment_info() -> dict:
    cuda = torch.cuda.is_available()
    return {
        "device": device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "triton_interpret": interpreting(),
        "switches": switches(),
        "omniattn": omniattn.__version__,
        "git_commit": _git_commit(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _header(results: list[dict], tflops: bool = True) -> str:
    """`tflops=False` for a plot with no TFLOP/s panel: its times need no FLOP convention."""
    if any(r["device"] == "cpu" for r in results):
        path = "Triton kernels under the interpreter" if interpreting() else "reference path"
        return (f"CPU: a smoke test of omniattn's {path} against SDPA math, not a speed "
                f"measurement of the kernels; run on a GPU for that")
    if not tflops:
        return "GPU: median time per call"
    return "GPU: TFLOP/s = FLOPs of the tiles omniattn computes / time, for every provider"


def _timing_lines(results: list[dict]) -> list[str]:
    """How the CPU rows' times were taken, from their records; none for do_bench's rows or
    records that predate the counts."""
    counted = [r for r in results if r.get("timed_runs")]
    if not counted:
        return []
    runs = min(r["timed_runs"] for r in counted)
    warmups, threads = ("/".join(map(str, sorted({r[field] for r in counted})))
                        for field in ("warmup_runs", "threads"))
    return [f"ms: median CPU time per call over >= {runs} timed calls per row, after {warmups} "
            f"untimed warm-up calls; CPU threads {threads}; clock {counted[0]['timer']}"]


def _mask_label(r: dict) -> str:
    """The mask form of a record's workload, e.g. "causal", "block 0.50 of 64x64" (records
    older than a mask kind lack its field)."""
    causal = " causal" if r["causal"] else ""
    if r.get("density") is not None:
        return f"block {r['density']:.2f} of {r['block_size']}x{r['block_size']}"
    if r.get("topk") is not None:
        return f"top-{r['topk']}{causal} + {r['bias']} bias"
    if r.get("row_lengths") is not None:
        return f"row lengths {r['row_lengths']}"
    if r.get("window") is not None:  # a list in records read back from JSON
        return f"window {tuple(r['window'])}"
    if r.get("documents") is not None:
        return f"docs {r['documents']}{causal}"
    return "causal" if r["causal"] else "none"


# the table's columns naming a row: the workload's shape, mask and mode; left-aligned where text
_ROW_COLUMNS = ("workload", "B", "Sq", "Sk", "H/Hk", "D", "dtype", "mask", "mode")
_TEXT_COLUMNS = {"workload", "dtype", "mask", "mode"}


def _row_cells(r: dict) -> list[str]:
    return [r["name"], str(r["batch"]), str(r["seqlen_q"]), str(r["seqlen_k"]),
            f"{r['heads']}/{r['heads_k']}", str(r["head_dim"]), r["dtype"], _mask_label(r),
            r["mode"]]


def format_table(results: list[dict]) -> str:
    """Plain-text table: one row per (workload, mode), labelled with its shape (B, Sq, Sk, H/Hk,
    D, dtype) and mask form, ms and TFLOP/s columns per provider ('-' where the provider has no
    row: SDPA on sparse workloads, SDPA flash and cuDNN on dynamic and rows ones); under the
    header, how CPU times were taken; errors are listed under the table, then notes on the
    sparse, dynamic and rows workloads."""
    providers = list(dict.fromkeys(r["provider"] for r in results))
    rows = {}
    for r in results:
        rows.setdefault((r["name"], r["mode"]), {})[r["provider"]] = r
    header = list(_ROW_COLUMNS)
    for provider in providers:
        header += [f"{provider} ms", f"{provider} TFLOP/s"]
    table = [header]
    for by_provider in rows.values():
        line = _row_cells(next(iter(by_provider.values())))
        for provider in providers:
            r = by_provider.get(provider)
            if r is None or r["ms"] is None:
                line += ["error" if r else "-", "-"]
            else:
                line += [f"{r['ms']:.3f}", f"{r['tflops']:.4g}"]
        table.append(line)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [_header(results), *_timing_lines(results), ""]
    for i, row in enumerate(table):
        cells = [c.ljust(w) if name in _TEXT_COLUMNS else c.rjust(w)
                 for name, c, w in zip(header, row, widths)]
        lines.append("  ".join(cells))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    # one line per distinct error: an unavailable backend fails every run the same way
    errors = {}
    for r in results:
        if r["error"]:
            errors.setdefault((r["provider"], r["error"]), []).append(f"{r['name']} {r['mode']}")
    if errors:
        lines += ["", "errors:"]
        lines += [f"  {provider} ({', '.join(runs)}): {error}"
                  for (provider, error), runs in errors.items()]
    if any(r["density"] is not None for r in results):
        lines += ["", f"sparse-d<density>: random block mask listing that fraction of the blocks; "
                      f"only {', '.join(BLOCK_MASK_PROVIDERS)} run block masks"]
    dynamic = {r["name"]: r for r in results if r["topk"] is not None}
    if dynamic:
        lines += ["", f"dyn-<bias>: top-k element mask + learnable bias, its gradient timed in "
                      f"fwd+bwd; only {', '.join(ELEMENT_MASK_PROVIDERS)} run them"]
        lines += [f"  {name}: {r['topk']} keys per row{' (causal)' if r['causal'] else ''}, "
                  f"{r['active_tile_fraction']:.0%} of the forward tiles active, "
                  f"{r['bias']} bias {DYNAMIC_BIASES[r['bias']]}"
                  for name, r in dynamic.items()]
    lines += _rows_notes(results)
    if any(r.get("window") is not None for r in results):
        lines += ["", f"sliding<left> / window<left>-<right>: attention's window=(left, right) "
                      f"about the bottom-right diagonal is the only mask; only "
                      f"{', '.join(ELEMENT_MASK_PROVIDERS)} run them (SDPA on a bool mask)"]
    if any(r.get("documents") is not None for r in results):
        lines += ["", f"docs-<lengths>: one batch packed from documents (omniattn: cu_seqlens; "
                      f"the others: a document mask), lengths as fractions of the total "
                      f"{DOCUMENTS}; only {', '.join(ELEMENT_MASK_PROVIDERS)} run them"]
    return "\n".join(lines)


def _shape_key(r: dict) -> tuple:
    return tuple(r[field] for field in ("batch", "seqlen_q", "seqlen_k", "heads", "heads_k",
                                        "head_dim", "dtype"))


def _rows_notes(results: list[dict]) -> list[str]:
    """Notes on the rows workloads: their lengths, active tile fraction, and per mode omniattn's
    time over (its time on the dense workload of the same shape x that fraction), the ratio
    issue #5's acceptance bounds by 1.1 (where the run has that dense time)."""
    rows = {r["name"]: r for r in results if r["row_lengths"] is not None}
    if not rows:
        return []
    dense_ms = {(_shape_key(r), r["mode"]): r["ms"] for r in results
                if r["provider"] == "omniattn" and r["ms"] is not None and not r["causal"]
                and r["density"] is None and r["topk"] is None and r["row_lengths"] is None
                and r.get("window") is None and r.get("documents") is None}
    lines = ["", f"rows-<lengths>: per-row key lengths (seqlens_k_per_row), not causal; only "
                 f"{', '.join(ELEMENT_MASK_PROVIDERS)} run them; ratio = omniattn ms / (dense "
                 f"ms x active tile fraction), to stay <= 1.1"]
    for name, r in rows.items():
        fraction = r["active_tile_fraction"]
        ratios = []
        for run in results:
            dense = dense_ms.get((_shape_key(run), run["mode"]))
            if run["name"] == name and run["provider"] == "omniattn" and run["ms"] is not None \
                    and dense is not None and fraction:
                ratios.append(f"{run['mode']} {run['ms'] / (dense * fraction):.2f}")
        line = f"  {name}: lengths {ROW_LENGTHS[r['row_lengths']]}, {fraction:.1%} of the " \
               f"forward tiles active"
        lines.append(line + (f"; ratio {', '.join(ratios)}" if ratios else ""))
    return lines


def plot_results(results: list[dict], path: str | Path, device: str | None = None) -> None:
    """PNG at `path`, one column per mode: time (ms) against density for the sparse rows, one
    line per provider (top); time against sequence length for the rows of a workload family
    measured at MIN_SEQLEN_SERIES or more lengths with the same batch x seqlen (the seqlen suite);
    and TFLOP/s of the other rows as bars grouped by workload (bottom). Rows without a time
    (errors) are left out. `device` names the GPU in the title (default: this
    machine's). Needs matplotlib (imported here, not with the module); raises ValueError if no
    row has a time."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    timed = [r for r in results if r["ms"] is not None]
    if not timed:
        raise ValueError("no run has a time to plot")
    modes = list(dict.fromkeys(r["mode"] for r in timed))
    sparse = [r for r in timed if r["density"] is not None]
    series_families = _seqlen_series_families(timed)
    series = [r for r in timed if r["density"] is None and _family(r) in series_families]
    others = [r for r in timed if r["density"] is None and _family(r) not in series_families]
    panel_rows = [(draw, rows) for draw, rows in ((_plot_time_vs_density, sparse),
                                                  (_plot_time_vs_seqlen, series),
                                                  (_plot_tflops_bars, others)) if rows]
    fig = Figure(figsize=(7 * len(modes), 4.5 * len(panel_rows)), layout="constrained")
    axes = fig.subplots(len(panel_rows), len(modes), squeeze=False)
    for (draw, rows), row_axes in zip(panel_rows, axes):
        for ax, mode in zip(row_axes, modes):
            mode_rows = [r for r in rows if r["mode"] == mode]
            if mode_rows:
                draw(ax, mode_rows, mode)
            else:  # every run of this mode failed
                ax.set_visible(False)
    fig.suptitle(f"{_header(results, tflops=bool(others))} ({device or device_name()})")
    fig.savefig(path, dpi=120)


def _heads_label(r: dict) -> str:
    return f"H{r['heads']}" if r["heads"] == r["heads_k"] else f"H{r['heads']}/{r['heads_k']}"


def _shape_label(r: dict) -> str:
    return f"B{r['batch']} {_heads_label(r)} S{r['seqlen_q']} D{r['head_dim']} {r['dtype']}"


def _plot_time_vs_density(ax, rows: list[dict], mode: str) -> None:
    shapes = list(dict.fromkeys(_shape_label(r) for r in rows))
    lines = {}
    for r in sorted(rows, key=lambda r: r["density"]):
        # a provider's line per shape, should one run mix sparse shapes
        label = r["provider"] if len(shapes) == 1 else f"{r['provider']} {_shape_label(r)}"
        lines.setdefault(label, []).append((r["density"], r["ms"]))
    for label, points in lines.items():
        ax.plot(*zip(*points), marker="o", label=label)
    block = rows[0]["block_size"]
    ax.set_title(f"{mode}: block-sparse, {' | '.join(shapes)}, {block}x{block} blocks")
    ax.set_xlabel("density (listed blocks / all blocks)")
    ax.set_ylabel("time (ms)")
    ax.set_xlim(0, 1.05)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()


# what a workload family shares across the sequence lengths of a series, besides its tokens
_FAMILY_FIELDS = ("heads", "heads_k", "head_dim", "causal", "dtype", "density", "block_size",
                  "topk", "bias", "row_lengths", "window", "documents")


def _family(r: dict) -> tuple:
    # records read back from JSON hold windows as lists
    return tuple(tuple(r[f]) if isinstance(r[f], list) else r[f] for f in _FAMILY_FIELDS) \
        + (r["batch"] * r["seqlen_q"],)


def _seqlen_series_families(rows: list[dict]) -> set[tuple]:
    """The families (`_family`: fields but the shape, at one batch x seqlen) that rows measured
    at MIN_SEQLEN_SERIES or more sequence lengths."""
    seqlens = {}
    for r in rows:
        seqlens.setdefault(_family(r), set()).add((r["seqlen_q"], r["seqlen_k"]))
    return {family for family, lengths in seqlens.items() if len(lengths) >= MIN_SEQLEN_SERIES}


def _series_shape(r: dict) -> str:
    return (f"{_heads_label(r)} D{r['head_dim']} {r['dtype']}, {r['batch'] * r['seqlen_q']} "
            f"tokens per call")


def _plot_time_vs_seqlen(ax, rows: list[dict], mode: str) -> None:
    from matplotlib.ticker import FuncFormatter

    series = {}  # family -> its rows by sequence length
    for r in sorted(rows, key=lambda r: r["seqlen_q"]):
        series.setdefault(_family(r), []).append(r)
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    colors = [f"C{i}" for i in range(len(providers))]  # as the bars: a colour per provider
    styles = ["-", "--", ":", "-."]
    shapes = list(dict.fromkeys(_series_shape(r) for r in rows))
    for f, mine in enumerate(series.values()):
        # the workload's name without its batch and length: "dense", "causal", "sliding1024"
        label = re.sub(r"-b\d+-s\d+", "", mine[0]["name"])
        if len(shapes) > 1:
            label += f" ({_series_shape(mine[0])})"
        for p, provider in enumerate(providers):
            points = [(r["seqlen_q"], r["ms"]) for r in mine if r["provider"] == provider]
            if points:
                ax.plot(*zip(*points), marker="o", color=colors[p],
                        linestyle=styles[f % len(styles)], label=f"{provider} {label}")
    ax.set_title(f"{mode}: time against sequence length"
                 + (f"\n{shapes[0]} (batch x seqlen)" if len(shapes) == 1 else ""))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)  # time doubles with the length at a fixed token count
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    seqlens = sorted({r["seqlen_q"] for r in rows})
    ax.set_xticks(seqlens, [f"{s // 1024}k" if s % 1024 == 0 else str(s) for s in seqlens])
    ax.set_xlabel("sequence length")
    ax.set_ylabel("time (ms)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small", ncol=2)


def _plot_tflops_bars(ax, rows: list[dict], mode: str) -> None:
    names = list(dict.fromkeys(r["name"] for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    width = 0.8 / len(providers)
    for i, provider in enumerate(providers):
        mine = [r for r in rows if r["provider"] == provider]
        offset = (i - (len(providers) - 1) / 2) * width
        ax.bar([names.index(r["name"]) + offset for r in mine], [r["tflops"] for r in mine],
               width, label=provider)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_title(f"{mode}: TFLOP/s on the tiles omniattn computes")
    ax.set_ylabel("TFLOP/s")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()


def load_records(paths: list[str | Path]) -> tuple[list[dict], str]:
    """The results of records written by write_json (`omniattn bench --json`), concatenated,
    and the device they were measured on. Raises ValueError for records of different devices."""
    results, devices = [], []
    for path in paths:
        with open(path) as f:
            record = json.load(f)
        results += record["results"]
        devices.append(record["environment"]["device"])
    if len(set(devices)) > 1:
        raise ValueError(f"records of different devices cannot share a plot: "
                         f"{dict(zip(map(str, paths), devices))}")
    return results, devices[0]


def write_json(path: str | Path, results: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"environment": environment_info(), "results": results}, f, indent=2)
        f.write("\n")
