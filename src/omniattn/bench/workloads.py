"""The workloads of `omniattn bench`: their shapes and masks (`Workload`), the suites
(`default_workloads`), and what each adds to q, k, v, built once and shared by every provider
(`ExtraInputs`)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

import omniattn
from omniattn.predicate import RelativePredicate

SUITES = ("core", "seqlen", "sparse", "gqa", "headdim", "dynamic", "rows", "window", "varlen",
          "decode")
# the "seqlen" suite keeps batch x seqlen at this many tokens (FlashAttention's papers: 16k)
SEQLEN_SUITE_TOKENS = 16384
# densities of the random block masks of the "sparse" suite; 1.0 (every block listed) is the
# reference their times scale against
SPARSE_DENSITIES = (1.0, 0.50, 0.26, 0.11)
# learnable biases of the "dynamic" suite, by name: their shapes
DYNAMIC_BIASES = {"full": "(B, H, Sq, Sk)", "key": "(B, H, 1, Sk)",
                  "kv_key": "(B, Hk, 1, Sk)"}
# the "dynamic" suite's calls that select inside attention (topk=, the key bias the scores), at
# issue #53's lengths: (batch, seqlen, heads, heads_k, topk, bias); no (Sq, Sk) mask exists there
DYNAMIC_SELECT_SHAPES = ((2, 4096, 16, 16, 1024, "key"), (1, 32768, 16, 4, 2048, "kv_key"),
                         (1, 131072, 16, 4, 2048, "kv_key"))
# per-row key lengths of the "rows" suite (seqlens_k_per_row), by name: query row i of batch b
# sees keys [0, lengths[b, i])
ROW_LENGTHS = {"uniform": "uniform in [1, Sk]", "progressive": "i + 1"}
# packed documents of the "varlen" suite (cu_seqlens), by name: each document's length is drawn
# uniformly from this range of fractions of the packed total (16k: [128, 4096], [32, 1024])
DOCUMENTS = {"long": (1 / 128, 1 / 4), "short": (1 / 512, 1 / 16)}
# the "decode" suite's (batch, keys per sequence) on a GPU: issue #55's three shapes
DECODE_SHAPES = ((1, 131072), (8, 32768), (64, 4096))
# pages of the "decode" suite's paged rows (keys per page)
DECODE_PAGE_SIZE = 256


@dataclass(frozen=True)
class Workload:
    """One attention shape. `density` set: a random block mask listing that fraction of the
    (block_size x block_size) blocks is the only mask (see `workload_block_mask`). `topk` set (a
    dynamic workload): a top-k element mask keeping `topk` keys per query row, within causal if
    `causal` (see `workload_keep_mask`), plus a learnable `bias` named in DYNAMIC_BIASES (see
    `workload_bias`); with `select` no mask: attention selects the `topk` keys itself, the key
    bias its scores (omniattn alone). `row_lengths` set (a rows workload): per-row key lengths
    named in ROW_LENGTHS are the only mask (see `workload_row_lengths`). `window` set (a window
    workload): attention's window (left, right), -1 unbounded, is the only mask. `documents` set
    (a varlen workload): one batch of seqlen_q tokens packed from documents whose lengths are
    drawn as DOCUMENTS names (see `workload_documents`), attended each on its own (causal within
    each if `causal`). `forward_only` (decoding): timed in the fwd mode alone. `page_size` set
    (paged decoding, forward only): k and v are pages of that many keys in a shuffled order
    that a block table lists (see `workload_block_table`); only omniattn reads pages."""

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
    forward_only: bool = False
    page_size: int | None = None
    select: bool = False

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
        if self.select and self.bias not in ("key", "kv_key"):
            raise ValueError(f"{self.name}: a workload that selects inside attention takes a "
                             f"key bias (its scores), 'key' or 'kv_key', got {self.bias!r}")
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
        if self.page_size is not None:
            if not self.forward_only or self.seqlen_k % self.page_size:
                raise ValueError(f"{self.name}: a paged workload is forward only, its seqlen_k "
                                 f"a multiple of its page_size")
            if self.density is not None or self.topk is not None \
                    or self.row_lengths is not None or self.documents is not None:
                raise ValueError(f"{self.name}: a paged workload takes no density, topk, "
                                 f"row_lengths or documents")


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
    masked = [Workload(f"dyn-{bias}-b{batch}-s{seqlen}", batch, seqlen, seqlen, heads, heads,
                       head_dim, True, dtype, topk=seqlen // 4, bias=bias)
              for bias in ("full", "key")]
    shapes = DYNAMIC_SELECT_SHAPES if cuda else ((1, 256, 2, 2, 64, "key"),
                                                 (1, 256, 4, 2, 32, "kv_key"))
    return masked + [
        Workload(f"dyn-select-{bias}-b{b}-s{s}" + (f"-hk{hk}" if hk != h else ""), b, s, s, h,
                 hk, head_dim, True, dtype, topk=topk, bias=bias, select=True)
        for b, s, h, hk, topk, bias in shapes]


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


def _decode_suite(cuda: bool) -> list[Workload]:
    if cuda:
        shapes, heads, heads_k, head_dim, dtype = DECODE_SHAPES, 32, 8, 128, torch.bfloat16
        page_size = DECODE_PAGE_SIZE
    else:
        shapes, heads, heads_k, head_dim, dtype = ((1, 1024), (4, 256)), 8, 2, 64, torch.float32
        page_size = 64
    return [Workload(f"decode-b{batch}-k{seqlen_k}{f'-paged{pages}' if pages else ''}", batch, 1,
                     seqlen_k, heads, heads_k, head_dim, False, dtype, forward_only=True,
                     page_size=pages)
            for pages in (None, page_size) for batch, seqlen_k in shapes]


_SUITE_BUILDERS = {"core": _core_suite, "seqlen": _seqlen_suite, "sparse": _sparse_suite,
                   "gqa": _gqa_suite, "headdim": _headdim_suite, "dynamic": _dynamic_suite,
                   "rows": _rows_suite, "window": _window_suite, "varlen": _varlen_suite,
                   "decode": _decode_suite}


def default_workloads(device: str | torch.device, suite: str = "core") -> list[Workload]:
    """Workloads of one suite, or of all of them with suite="all":

    core: dense and causal, 4k B2 and 16k B1, H16 D128 (the FlashAttention-style suite);
    seqlen: dense and causal at sequence lengths 1k-16k, batch x seqlen = SEQLEN_SUITE_TOKENS,
    H16 D128 (plotted as time against sequence length);
    sparse: 16k B1 H16 D128 under random 128 x 128 block masks at each of SPARSE_DENSITIES;
    gqa: causal 8k B1, 32 query heads on 8 key/value heads, D128;
    headdim: dense and causal 4k B2 H16 at D 64 and D 256;
    dynamic: causal 4k B2 H16 D128 under a causal top-k mask keeping 1024 keys per row, with a
    full or a key bias (Dynamic Mask Attention, issue #4); then calls that select inside
    attention (topk=, the key bias the scores: no mask) at DYNAMIC_SELECT_SHAPES (omniattn
    alone, issue #53);
    rows: 8k B2 H16 D128, dense, then per-row key lengths (seqlens_k_per_row, not causal) each
    of ROW_LENGTHS: uniform in [1, Sk] per row, and i + 1 (causal's pattern: whole tiles skipped);
    window: 8k B2 H16 under a sliding window (1024, 0) at D128, GQA 16/4 and D256, and a local
    one (512, 512) at D128;
    varlen: 16k tokens H16 D128 and D256 packed from documents of 128-4096 or 32-1024 tokens
    (cu_seqlens), each attended alone, dense or causal;
    decode: one query token per sequence over DECODE_SHAPES' caches, GQA 32/8 D128, forward
    only, from contiguous K/V then from pages of DECODE_PAGE_SIZE keys (omniattn alone).
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
    None for a workload without topk, or one that selects inside attention."""
    if workload.topk is None or workload.select:
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
    heads = workload.heads_k if workload.bias == "kv_key" else workload.heads
    generator = torch.Generator(device).manual_seed(1)
    bias = torch.randn((workload.batch, heads, rows, workload.seqlen_k),
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


def workload_block_table(workload: Workload,
                         device: str | torch.device) -> torch.Tensor | None:
    """The paged workload's block table, int32 (B, seqlen_k / page_size) on the device: the
    pages of all sequences in an order drawn by a randperm (CPU generator seeded 4), as a cache
    that allocated them as sequences grew would hold them. None for a workload without pages."""
    if workload.page_size is None:
        return None
    per_seq = workload.seqlen_k // workload.page_size
    order = torch.randperm(workload.batch * per_seq, generator=torch.Generator().manual_seed(4))
    return order.view(workload.batch, per_seq).to(device, torch.int32)


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
    `row_lens` of a rows one, `cu_seqlens` (on the device) and `max_document` of a varlen one,
    `block_table` of a paged one (None where the workload has none). The forms one provider needs are built on its first use,
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
        self.block_table = workload_block_table(workload, device)

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


def make_inputs(workload: Workload, device: torch.device, requires_grad: bool):
    """q (B, Sq, H, D), k, v (B, Sk, Hk, D) (a paged workload: pages (B x Sk / page_size,
    page_size, Hk, D)) and dout like q; random normal, seeded."""
    generator = torch.Generator(device).manual_seed(0)

    def randn(seqlen, heads, grad, batch=workload.batch):
        shape = (batch, seqlen, heads, workload.head_dim)
        t = torch.randn(shape, generator=generator, device=device, dtype=workload.dtype)
        return t.requires_grad_(grad)

    q = randn(workload.seqlen_q, workload.heads, requires_grad)
    keys = (workload.seqlen_k, workload.heads_k, requires_grad)
    if workload.page_size is not None:
        pages = workload.batch * workload.seqlen_k // workload.page_size
        keys = (workload.page_size, workload.heads_k, requires_grad, pages)
    k = randn(*keys)
    v = randn(*keys)
    dout = randn(workload.seqlen_q, workload.heads, False)
    return q, k, v, dout

