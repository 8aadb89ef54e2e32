import importlib.util
import json
import math

import pytest
import torch

import omniattn
from omniattn import api, bench
from omniattn.backends.gluon_sm90 import blocks as gluon_blocks
from omniattn.backends.triton import configs
from omniattn.bench import plot, report, timing
from omniattn.bench.pairs import (block_mask_pairs, computed_pairs, element_mask_pairs,
                                  row_lengths_pairs, visible_pairs, workload_pairs)
from omniattn.bench.providers import BuiltAttention, forward_plan, provider_builders, providers_for
from omniattn.bench.workloads import (DOCUMENTS, ROW_LENGTHS, SPARSE_DENSITIES,
                                      ExtraInputs, make_inputs, workload_block_mask,
                                      workload_documents, workload_row_lengths)
from omniattn.predicate import RelativePredicate


@pytest.fixture
def reference_path(monkeypatch):
    """omniattn on CPU runs the PyTorch reference (conftest turns the slow interpreter on)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture
def plan_as_gpu(monkeypatch):
    """plan_as(hopper): omniattn plans CPU tensors from then on as on a GPU, with the GPU's tile
    configs (not the interpreter's), the Gluon kernels on (hopper, an sm90 GPU, as
    tests/test_plan.py's `hopper` fixture) or refused (another GPU). Plans only: nothing can
    run on the CPU after it."""
    device_refusal = gluon_blocks.device_refusal

    def plan_as(hopper: bool):
        monkeypatch.setattr(gluon_blocks, "device_refusal",
                            (lambda device: None) if hopper else device_refusal)
        monkeypatch.setattr(configs, "interpreting", lambda: False)
        monkeypatch.setattr(api, "uses_kernels", lambda q: True)

    return plan_as


def _forward_plan(workload, extra):
    """omniattn's forward plan for the workload, on q / k / v of its shapes (planning reads no
    values: left uninitialised, cheap at GPU sizes)."""
    def empty(seqlen, heads):
        return torch.empty((workload.batch, seqlen, heads, workload.head_dim),
                           dtype=workload.dtype)

    return forward_plan(workload, extra, empty(workload.seqlen_q, workload.heads),
                        empty(workload.seqlen_k, workload.heads_k),
                        empty(workload.seqlen_k, workload.heads_k))


def _tiny(name, causal=False, density=None):
    """B1 H2 S64 D16 fp32, 16 x 16 blocks: 4 x 4 blocks for the sparse case."""
    return bench.Workload(name, 1, 64, 64, 2, 2, 16, causal, torch.float32, density=density,
                          block_size=16)


def _tiny_dynamic(name, bias):
    """B1 H2 S64 D16 fp32, causal, a top-k mask keeping 16 keys per row."""
    return bench.Workload(name, 1, 64, 64, 2, 2, 16, True, torch.float32, topk=16, bias=bias)


def _tiny_rows(name, lengths, batch=2):
    """B2 (or batch) H2 S64 D16 fp32, not causal, per-row key lengths named in ROW_LENGTHS."""
    return bench.Workload(name, batch, 64, 64, 2, 2, 16, False, torch.float32,
                          row_lengths=lengths)


def _tiny_window(name, window):
    """B1 H2 S64 D16 fp32, attention's window its only mask."""
    return bench.Workload(name, 1, 64, 64, 2, 2, 16, False, torch.float32, window=window)


def _tiny_varlen(name, documents, causal=False):
    """One batch of 64 tokens packed from documents (DOCUMENTS), H2 D16 fp32."""
    return bench.Workload(name, 1, 64, 64, 2, 2, 16, causal, torch.float32, documents=documents)


def _assert_providers_agree(workload, extra):
    """omniattn and SDPA math give the same output and q / k / v gradients on the CPU."""
    q, k, v, dout = make_inputs(workload, torch.device("cpu"), requires_grad=True)
    results = []
    for provider in ("omniattn", "sdpa-math"):
        out = provider_builders()[provider](workload, torch.device("cpu"), extra).fn(q, k, v)
        results.append([out, *torch.autograd.grad(out, (q, k, v), dout)])
    for ours, sdpa in zip(*results):
        torch.testing.assert_close(ours, sdpa)


def _brute_force_pairs(blocks: torch.Tensor, block_size: int, seqlen_q: int, seqlen_k: int) -> int:
    """Visible (query, key) elements of a (1, 1, nQ, nK) block picture, one element at a time."""
    return sum(bool(blocks[0, 0, i // block_size, j // block_size])
               for i in range(seqlen_q) for j in range(seqlen_k))


@pytest.mark.parametrize("seq_lengths", [(64, 64), (50, 70)])
def test_block_mask_pairs_match_brute_force(seq_lengths):
    seqlen_q, seqlen_k = seq_lengths
    generator = torch.Generator().manual_seed(1)
    blocks = torch.rand((1, 1, -(-seqlen_q // 16), -(-seqlen_k // 16)), generator=generator) < 0.4
    mask = omniattn.block_mask_from_blocks(blocks, 16, seq_lengths=seq_lengths)
    assert block_mask_pairs(mask) == _brute_force_pairs(blocks, 16, seqlen_q, seqlen_k)


def _brute_force_element_pairs(keep: torch.Tensor, causal: bool, block_m: int, block_n: int):
    """element_mask_pairs one element at a time: (pairs, visible, active tile fraction)."""
    batch, heads, seqlen_q, seqlen_k = keep.shape
    kept = keep.tolist()
    elements = [(b, h, i, j) for b in range(batch) for h in range(heads)
                for i in range(seqlen_q) for j in range(seqlen_k)]

    def tile(b, h, i, j):
        return b, h, i // block_m, j // block_n

    visible = [(b, h, i, j) for b, h, i, j in elements
               if kept[b][h][i][j] and (not causal or j <= i + seqlen_k - seqlen_q)]
    active = {tile(*e) for e in visible}
    pairs = sum(tile(*e) in active for e in elements)
    n_tiles = batch * heads * -(-seqlen_q // block_m) * -(-seqlen_k // block_n)
    entries = batch * heads
    return pairs / entries, len(visible) / entries, len(active) / n_tiles


@pytest.mark.parametrize("seq_lengths", [(64, 64), (40, 56)])
@pytest.mark.parametrize("causal", [False, True])
def test_element_mask_pairs_match_brute_force(seq_lengths, causal):
    seqlen_q, seqlen_k = seq_lengths
    generator = torch.Generator().manual_seed(2)
    # sparse enough that some tiles hold no kept element
    keep = torch.rand((2, 2, seqlen_q, seqlen_k), generator=generator) < 0.004
    counts = element_mask_pairs(keep, causal, 16, 32)
    assert counts == pytest.approx(_brute_force_element_pairs(keep, causal, 16, 32))
    assert 0 < counts[2] < 1


def _length_mask(lens: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """bool (B, 1, Sq, Sk) picture of per-row key lengths, one element at a time."""
    batch, seqlen_q = lens.shape
    keep = torch.zeros((batch, 1, seqlen_q, seqlen_k), dtype=torch.bool)
    for b in range(batch):
        for i in range(seqlen_q):
            keep[b, 0, i, :int(lens[b, i])] = True
    return keep


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("seq_lengths, tile", [((64, 64), (16, 32)), ((40, 56), (16, 32)),
                                               ((50, 33), (32, 16)), ((7, 100), (16, 16))])
def test_row_lengths_pairs_match_brute_force(seq_lengths, tile, grouped):
    """grouped: the rows are tiled longest first (as attention runs lengths alone)."""
    seqlen_q, seqlen_k = seq_lengths
    generator = torch.Generator().manual_seed(3)
    # skewed towards short rows, so that some key tiles see no row
    lens = (torch.rand((2, seqlen_q), generator=generator) ** 3 * (seqlen_k + 1)).to(torch.int32)
    lens[1, :16] = 0  # a query tile that sees no key (the whole tile for 16-row tiles)
    lens[0, 0], lens[1, -1] = 0, seqlen_k  # the ends of the range
    counts = row_lengths_pairs(lens, seqlen_k, *tile, grouped=grouped)
    tiled = lens.sort(dim=-1, descending=True).values if grouped else lens
    assert counts == pytest.approx(_brute_force_element_pairs(_length_mask(tiled, seqlen_k),
                                                              False, *tile))
    assert counts[1] == sum(min(int(n), seqlen_k) for n in lens.flatten()) / 2
    assert 0 < counts[2] < 1


def test_row_lengths_pairs_clip_to_seqlen_k():
    """Lengths past Sk count as Sk (as omniattn clamps them)."""
    lens = torch.tensor([[100, 3, 40]], dtype=torch.int32)
    assert row_lengths_pairs(lens, 40, 16, 16) == pytest.approx(
        _brute_force_element_pairs(_length_mask(lens.clamp(max=40), 40), False, 16, 16))


def test_rows_workload_inputs_and_flops(reference_path, plan_as_gpu):
    """The reference path (no tiles) counts the visible pairs; the kernels count the pairs of
    the tiles their forward visits, rows tiled longest first."""
    uniform, progressive = _tiny_rows("uniform", "uniform"), _tiny_rows("progressive",
                                                                        "progressive")
    lens = ExtraInputs(uniform, "cpu").row_lens
    assert lens.shape == (2, 64) and lens.dtype == torch.int32
    assert 1 <= lens.min() and lens.max() <= 64
    assert torch.equal(lens, workload_row_lengths(uniform, "cpu"))  # seeded
    assert workload_row_lengths(progressive, "cpu").tolist() == [list(range(1, 65))] * 2
    extra = ExtraInputs(progressive, "cpu")
    assert extra.block_mask is None and extra.keep is None and extra.bias is None
    assert extra.learnable == ()
    assert torch.equal(extra.sdpa_row_mask, _length_mask(extra.row_lens, 64))
    [row] = bench.run_suite([progressive], providers=["omniattn"], modes=("fwd",),
                            progress=False, device="cpu")
    assert row["row_lengths"] == "progressive"
    triangle = visible_pairs(64, 64, causal=True)  # lengths i + 1
    assert row["flops"] == row["flops_exact"] == 4 * 2 * 2 * 16 * triangle
    assert row["active_tile_fraction"] == triangle / 64 ** 2

    plan_as_gpu(hopper=False)
    tile = configs.forward_config(16, torch.float32)
    assert _forward_plan(progressive, extra).tiles == (tile.block_m, tile.block_n)
    longest_first = extra.row_lens.sort(dim=-1, descending=True).values
    counts = workload_pairs(progressive, extra, (tile.block_m, tile.block_n))
    assert counts == pytest.approx(_brute_force_element_pairs(
        _length_mask(longest_first, 64), False, tile.block_m, tile.block_n))
    assert counts[1] == triangle


@pytest.mark.parametrize("hopper", [False, True], ids=["gpu", "hopper"])
def test_rows_active_fraction_is_on_the_dense_gpu_tiles(plan_as_gpu, hopper):
    """The acceptance scales the dense time by the fraction of 128 x 128 tiles: the tiles the
    GPU forward kernel runs for D128 bf16 with lengths alone (no causal), as for dense."""
    plan_as_gpu(hopper)
    workload = bench.default_workloads("cuda", "rows")[2]
    extra = ExtraInputs(workload, "cpu")
    planned = _forward_plan(workload, extra)
    assert planned.kernel == ("fwd_hopper" if hopper else "fwd")
    assert planned.tiles == (128, 128)
    # progressive lengths at 8k: query tile m visits key tiles 0..m of 64
    assert workload_pairs(workload, extra, planned.tiles)[2] == pytest.approx(65 / 128)


def test_pairs_on_the_kernels_tiles(plan_as_gpu):
    """Computed pairs are counted on the tiles omniattn plans for the workload's forward: on
    Hopper the Gluon forward's, 192 x 128 for a plain D64 call, 128 x 128 for packed D128
    documents (not plain); on another GPU the Triton forward's."""
    d64 = next(w for w in bench.default_workloads("cuda", "headdim")
               if w.head_dim == 64 and w.causal)
    documents = next(w for w in bench.default_workloads("cuda", "varlen")
                     if w.head_dim == 128 and w.causal)
    for workload, gluon_tiles in ((d64, (192, 128)), (documents, (128, 128))):
        extra = ExtraInputs(workload, "cpu")
        lengths = [workload.seqlen_q] if extra.cu_seqlens is None \
            else extra.cu_seqlens.diff().tolist()
        for hopper in (False, True):
            plan_as_gpu(hopper)
            triton_tile = configs.forward_config(workload.head_dim, workload.dtype, masked=True)
            tiles = gluon_tiles if hopper else (triton_tile.block_m, triton_tile.block_n)
            planned = _forward_plan(workload, extra)
            assert planned.kernel == ("fwd_hopper" if hopper else "fwd"), workload.name
            assert planned.tiles == tiles, (workload.name, hopper)
            pairs, exact, _ = workload_pairs(workload, extra, planned.tiles)
            assert pairs == sum(computed_pairs(n, n, True, *tiles) for n in lengths)
            assert exact == sum(visible_pairs(n, n, True) for n in lengths)
            assert pairs > exact  # the diagonal tiles' hidden pairs


def test_rows_providers_agree(reference_path):
    """omniattn (seqlens_k_per_row) and SDPA math (bool mask) compute the same output and
    gradients."""
    workload = _tiny_rows("rows", "uniform")
    extra = ExtraInputs(workload, "cpu")
    q, k, v, dout = make_inputs(workload, torch.device("cpu"), requires_grad=True)
    results = []
    for provider in ("omniattn", "sdpa-math"):
        built = provider_builders()[provider](workload, torch.device("cpu"), extra)
        assert built.learnable == ()
        out = built.fn(q, k, v)
        results.append([out, *torch.autograd.grad(out, (q, k, v), dout)])
    for ours, sdpa in zip(*results):
        torch.testing.assert_close(ours, sdpa)


@pytest.mark.parametrize("seq_lengths", [(64, 64), (50, 70), (70, 45)], ids=str)
@pytest.mark.parametrize("causal, window", [(True, None), (False, (20, 0)), (False, (9, 13)),
                                            (True, (30, 40)), (False, (-1, 5)), (False, None)],
                         ids=str)
def test_window_pairs_match_brute_force(seq_lengths, causal, window):
    """visible_pairs counts the band element by element; computed_pairs the (16 x 32) tiles
    from each query tile's first visible key tile to its last."""
    seqlen_q, seqlen_k = seq_lengths
    rows, keys = torch.arange(seqlen_q)[:, None], torch.arange(seqlen_k)
    visible = RelativePredicate.make(window=window).holds(rows, keys, seqlen_q, seqlen_k)
    if causal:
        visible &= keys <= rows + seqlen_k - seqlen_q
    assert visible_pairs(seqlen_q, seqlen_k, causal, window) == visible.sum().item()
    pairs = 0
    for start in range(0, seqlen_q, 16):
        seen = visible[start:start + 16].any(0).nonzero()
        if len(seen):
            first = seen.min().item() // 32 * 32
            end = min(-(-(seen.max().item() + 1) // 32) * 32, seqlen_k)
            pairs += min(16, seqlen_q - start) * (end - first)
    assert computed_pairs(seqlen_q, seqlen_k, causal, 16, 32, window) == pairs


def test_window_providers_agree(reference_path):
    """omniattn (window=) and SDPA math (its bool mask) compute the same output and gradients;
    the workload's flops count the band."""
    workload = _tiny_window("window", (9, 4))
    extra = ExtraInputs(workload, "cpu")
    assert extra.sdpa_window_mask.shape == (1, 1, 64, 64)
    assert extra.sdpa_window_mask.sum().item() == visible_pairs(64, 64, False, (9, 4))
    _assert_providers_agree(workload, extra)
    row = bench.run_suite([workload], providers=["omniattn"], modes=("fwd",), progress=False,
                          device="cpu")[0]
    assert row["window"] == (9, 4)
    assert row["flops_exact"] == 4 * 2 * 16 * visible_pairs(64, 64, False, (9, 4))
    assert "window<left>-<right>" in bench.format_table([row])
    assert "window (9, 4)" in bench.format_table([row])


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_workload_inputs_flops_and_providers(reference_path, plan_as_gpu, causal):
    """The documents fill the batch within their length range; flops count each document's own
    visible pairs on the reference path, its own tiles on the kernels; omniattn (cu_seqlens) and
    SDPA math (the document mask) agree, gradients too."""
    workload = _tiny_varlen("docs", "short", causal)
    offsets = workload_documents(workload)
    lengths = offsets.diff()
    assert offsets[0] == 0 and offsets[-1] == 64 and offsets.dtype == torch.int32
    assert len(lengths) > 2 and lengths.min() >= 1 and lengths[:-1].max() <= 4  # 64 / 16
    assert torch.equal(offsets, workload_documents(workload))  # seeded
    extra = ExtraInputs(workload, "cpu")
    assert extra.max_document == lengths.max()
    mask = extra.sdpa_document_mask[0, 0]
    starts = offsets[:-1].tolist()
    for first, length in zip(starts, lengths.tolist()):  # a block per document on the diagonal
        block = mask[first:first + length, first:first + length]
        whole = torch.ones_like(block)
        assert torch.equal(block, whole.tril() if causal else whole)
    assert mask.sum() == sum(visible_pairs(n, n, causal) for n in lengths.tolist())
    _assert_providers_agree(workload, extra)
    [row] = bench.run_suite([workload], providers=["omniattn"], modes=("fwd",), progress=False,
                            device="cpu")
    assert row["flops"] == row["flops_exact"] == 4 * 2 * 16 * mask.sum().item()
    assert "docs-<lengths>" in bench.format_table([row])
    assert f"docs short{' causal' if causal else ''} " in bench.format_table([row])
    assert providers_for(workload, bench.PROVIDERS) == (
        "omniattn", "sdpa-efficient", "sdpa-math", "flex")

    plan_as_gpu(hopper=False)
    tile = configs.forward_config(16, torch.float32, masked=causal)
    assert _forward_plan(workload, extra).tiles == (tile.block_m, tile.block_n)
    pairs, exact, _ = workload_pairs(workload, extra, (tile.block_m, tile.block_n))
    assert pairs == sum(computed_pairs(n, n, causal, tile.block_m, tile.block_n)
                        for n in lengths.tolist())
    assert exact == mask.sum().item()


@pytest.mark.parametrize("fields, match", [
    (dict(documents="tiny"), "documents must be"),
    (dict(documents="long", batch=2), "one batch"),
    (dict(documents="long", window=(4, 0)), "only"),
])
def test_varlen_workload_validation(fields, match):
    fields = {"batch": 1, **fields}
    with pytest.raises(ValueError, match=match):
        bench.Workload(name="bad", seqlen_q=64, seqlen_k=64, heads=2, heads_k=2, head_dim=16,
                       causal=False, dtype=torch.float32, **fields)


def test_rows_workloads_skip_sdpa_flash_and_cudnn(reference_path):
    workload = _tiny_rows("rows", "progressive")
    assert providers_for(workload, bench.PROVIDERS) == (
        "omniattn", "sdpa-efficient", "sdpa-math", "flex")


def test_dynamic_workload_inputs_and_flops(reference_path, plan_as_gpu):
    """The reference path (no tiles) counts the kept pairs; the kernels count the pairs of the
    tiles holding a kept one."""
    workload = _tiny_dynamic("dyn", "key")
    extra = ExtraInputs(workload, "cpu")
    assert extra.block_mask is None
    assert extra.keep.shape == (1, 2, 64, 64) and extra.keep.dtype == torch.bool
    # each row keeps its 16 keys of largest score among the causal ones (all of them before)
    assert extra.keep.sum(-1).tolist() == [[[min(i + 1, 16) for i in range(64)]] * 2]
    assert not extra.keep.triu(1).any()
    assert extra.bias.shape == (1, 2, 1, 64) and extra.bias.requires_grad
    assert ExtraInputs(_tiny_dynamic("dyn", "full"), "cpu").bias.shape == (1, 2, 64, 64)
    [row] = bench.run_suite([workload], providers=["omniattn"], modes=("fwd",), progress=False,
                            device="cpu")
    assert row["flops"] == row["flops_exact"] == 4 * 1 * 2 * 16 * extra.keep.sum().item() / 2
    assert row["active_tile_fraction"] == extra.keep.sum().item() / (2 * 64 * 64)

    plan_as_gpu(hopper=False)
    tile = configs.forward_config(16, torch.float32, masked=True, elementwise=True)
    assert _forward_plan(workload, extra).tiles == (tile.block_m, tile.block_n)
    counts = workload_pairs(workload, extra, (tile.block_m, tile.block_n))
    assert counts == pytest.approx(_brute_force_element_pairs(extra.keep, True, tile.block_m,
                                                              tile.block_n))
    assert counts[0] > counts[1]


@pytest.mark.parametrize("bias", ["full", "key"])
def test_dynamic_providers_agree(reference_path, bias):
    """omniattn and SDPA math (one float mask) compute the same output and bias gradient."""
    workload = _tiny_dynamic("dyn", bias)
    extra = ExtraInputs(workload, "cpu")
    q, k, v, dout = make_inputs(workload, torch.device("cpu"), requires_grad=True)
    results = []
    for provider in ("omniattn", "sdpa-math"):
        built = provider_builders()[provider](workload, torch.device("cpu"), extra)
        out = built.fn(q, k, v)
        *grads, dbias = torch.autograd.grad(out, (q, k, v, *built.learnable), dout)
        # SDPA's gradient is that of its (B, H, Sq, Sk) mask: sum it to the bias's shape
        results.append([out, *grads, dbias.sum_to_size(extra.bias.shape)])
    for ours, sdpa in zip(*results):
        torch.testing.assert_close(ours, sdpa)


@pytest.mark.parametrize("bias, heads_k", [("key", 2), ("kv_key", 1)])
def test_selection_inside_attention_workloads(reference_path, bias, heads_k):
    """No mask: attention selects; omniattn alone runs it, with topk, and matches the call with
    the materialised keep mask; the reference path counts the kept pairs, the kernels the
    causal tiles the top-k tile states leave (fewer than the causal ones, at least the kept)."""
    workload = bench.Workload("sel", 1, 128, 128, 2, heads_k, 16, True, torch.float32, topk=8,
                              bias=bias, select=True)
    extra = ExtraInputs(workload, "cpu")
    assert extra.keep is None and extra.bias.shape == (1, 2 if bias == "key" else 1, 1, 128)
    assert providers_for(workload, bench.PROVIDERS) == ("omniattn",)
    q, k, v, dout = make_inputs(workload, torch.device("cpu"), requires_grad=True)
    out = provider_builders()["omniattn"](workload, torch.device("cpu"), extra).fn(q, k, v)
    keep = omniattn.topk_mask(extra.bias.detach(), 8, causal=True, seqlen_q=128)
    torch.testing.assert_close(out, omniattn.attention(q, k, v, causal=True, attn_mask=keep,
                                                       attn_bias=extra.bias))
    [row] = bench.run_suite([workload], providers=["omniattn", "sdpa-math"], modes=("fwd",),
                            progress=False, device="cpu")
    kept = sum(min(i + 1, 8) for i in range(128))
    assert row["provider"] == "omniattn"
    assert row["flops"] == row["flops_exact"] == 4 * 2 * 16 * kept
    computed, exact, fraction = workload_pairs(workload, extra, (16, 16))
    causal = sum(16 * min(16 * (m + 1), 128) for m in range(8))
    assert exact == kept and kept <= computed <= causal and 0 < fraction <= 1
    with pytest.raises(ValueError, match="key bias"):
        bench.Workload("sel", 1, 64, 64, 2, 2, 16, True, torch.float32, topk=8, bias="full",
                       select=True)


def test_dynamic_workloads_skip_sdpa_flash_and_cudnn(reference_path):
    workload = _tiny_dynamic("dyn", "key")
    assert providers_for(workload, bench.PROVIDERS) == (
        "omniattn", "sdpa-efficient", "sdpa-math", "flex")
    rows = bench.run_suite([workload], providers=["omniattn", "sdpa-cudnn", "sdpa-flash",
                                                  "sdpa-math"],
                           modes=("fwd",), progress=False, device="cpu")
    assert [r["provider"] for r in rows] == ["omniattn", "sdpa-math"]


def test_sparse_workload_mask_density_and_flops(reference_path):
    workload = _tiny("sparse", density=0.5)
    mask = workload_block_mask(workload, "cpu")
    assert mask.density == 0.5
    pairs = _brute_force_pairs(mask.states != 0, 16, 64, 64)
    assert pairs == 64 * 64 // 2
    [row] = bench.run_suite([workload], providers=["omniattn"], modes=("fwd",), progress=False,
                            device="cpu")
    assert row["flops"] == row["flops_exact"] == 4 * 1 * 2 * 16 * pairs
    # every block listed: the dense count
    full = workload_block_mask(_tiny("full", density=1.0), "cpu")
    assert block_mask_pairs(full) == visible_pairs(64, 64, causal=False)


def test_sparse_masks_are_nested_across_densities():
    masks = [workload_block_mask(_tiny(f"d{d}", density=d), "cpu").states
             for d in (0.25, 0.5, 1.0)]
    for sparser, denser in zip(masks, masks[1:]):
        assert not ((sparser != 0) & (denser == 0)).any()


def test_sparse_workload_must_not_be_causal():
    with pytest.raises(ValueError, match="causal"):
        _tiny("bad", causal=True, density=0.5)


@pytest.mark.parametrize("fields, match", [
    (dict(density=0.5, topk=16, bias="key"), "not both"),
    (dict(topk=16), "both a top-k mask"),
    (dict(bias="key"), "both a top-k mask"),
    (dict(topk=16, bias="query"), "bias must be one of"),
])
def test_dynamic_workload_validation(fields, match):
    with pytest.raises(ValueError, match=match):
        bench.Workload("bad", 1, 64, 64, 2, 2, 16, False, torch.float32, **fields)


@pytest.mark.parametrize("causal, fields, match", [
    (False, dict(row_lengths="random"), "row_lengths must be one of"),
    (False, dict(row_lengths="uniform", density=0.5), "only mask"),
    (False, dict(row_lengths="uniform", topk=16, bias="key"), "only mask"),
    (True, dict(row_lengths="progressive"), "causal must be False"),
])
def test_rows_workload_validation(causal, fields, match):
    with pytest.raises(ValueError, match=match):
        bench.Workload("bad", 1, 64, 64, 2, 2, 16, causal, torch.float32, **fields)


@pytest.mark.parametrize("causal, fields, match", [
    (True, dict(window=(16, 0)), "only mask"),
    (False, dict(window=(16, 0), density=0.5), "only mask"),
    (False, dict(window=(16, 0), row_lengths="uniform"), "only mask"),
    (False, dict(window=(-2, 0)), "window must be"),
    (False, dict(window=(16,)), "window must be"),
])
def test_window_workload_validation(causal, fields, match):
    with pytest.raises(ValueError, match=match):
        bench.Workload("bad", 1, 64, 64, 2, 2, 16, causal, torch.float32, **fields)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_suite_constructs(device):
    suites = {suite: bench.default_workloads(device, suite) for suite in bench.SUITES}
    assert all(suites.values())
    # the seqlen suite shares shapes with core and rows: "all" runs each once
    assert bench.default_workloads(device, "all") == list(dict.fromkeys(
        w for ws in suites.values() for w in ws))
    names = [w.name for w in bench.default_workloads(device, "all")]
    assert len(names) == len(set(names))
    assert bench.default_workloads(device) == suites["core"]
    assert len({w.batch * w.seqlen_q for w in suites["seqlen"]}) == 1
    assert len({w.seqlen_q for w in suites["seqlen"]}) >= plot.MIN_SEQLEN_SERIES
    assert [w.causal for w in suites["seqlen"]] == [False, True] * (len(suites["seqlen"]) // 2)
    assert [w.density for w in suites["sparse"]] == list(SPARSE_DENSITIES)
    assert all(w.heads != w.heads_k and w.causal for w in suites["gqa"])
    assert {w.head_dim for w in suites["headdim"]} == {64, 256}
    masked = [w for w in suites["dynamic"] if not w.select]
    assert [w.bias for w in masked] == ["full", "key"]
    assert all(w.causal and w.topk == w.seqlen_k // 4 for w in masked)
    assert all(w.causal and w.bias in ("key", "kv_key")
               for w in suites["dynamic"] if w.select)
    assert [w.row_lengths for w in suites["rows"]] == [None, *ROW_LENGTHS]
    assert all(w.window is not None and not w.causal for w in suites["window"])
    head_dims = (128, 256) if device == "cuda" else (64,)
    assert [(w.head_dim, w.documents, w.causal) for w in suites["varlen"]] == [
        (head_dim, documents, causal) for head_dim in head_dims for documents in DOCUMENTS
        for causal in (False, True)]
    assert len({(w.batch, w.seqlen_q, w.seqlen_k, w.heads, w.head_dim, w.dtype, w.causal)
                for w in suites["rows"]}) == 1  # the dense reference has the lengths' shape
    assert all(w.forward_only and w.seqlen_q == 1 and w.heads != w.heads_k
               for w in suites["decode"])
    # each paged row has a contiguous one of its shape
    assert [w.page_size is not None for w in suites["decode"]] == [False] * 3 + [True] * 3 \
        if device == "cuda" else [False] * 2 + [True] * 2
    if device == "cpu":  # masks build here only on the CPU
        for workload in suites["sparse"]:
            mask = workload_block_mask(workload, device)
            assert mask.seq_lengths == (workload.seqlen_q, workload.seqlen_k)
            assert mask.density == pytest.approx(workload.density, abs=0.01)
        for workload in suites["dynamic"]:
            extra = ExtraInputs(workload, device)
            shape = (workload.batch, workload.heads, workload.seqlen_q, workload.seqlen_k)
            assert extra.keep is None if workload.select else extra.keep.shape == shape
            assert extra.bias.dtype == workload.dtype and extra.bias.requires_grad
        for workload in suites["rows"][1:]:
            lens = ExtraInputs(workload, device).row_lens
            assert lens.shape == (workload.batch, workload.seqlen_q)
            assert lens.dtype == torch.int32
            assert 1 <= lens.min() and lens.max() <= workload.seqlen_k


def test_core_suite_is_unchanged_on_gpu():
    core = bench.default_workloads("cuda", "core")
    assert [(w.name, w.batch, w.seqlen_q, w.heads, w.head_dim, w.dtype) for w in core] == [
        ("dense-b2-s4096", 2, 4096, 16, 128, torch.bfloat16),
        ("causal-b2-s4096", 2, 4096, 16, 128, torch.bfloat16),
        ("dense-b1-s16384", 1, 16384, 16, 128, torch.bfloat16),
        ("causal-b1-s16384", 1, 16384, 16, 128, torch.bfloat16),
    ]


def test_seqlen_suite_on_gpu():
    """Dense and causal H16 D128 bf16 at 1k-16k, 16k tokens per call (FlashAttention's papers'
    form)."""
    seqlen = bench.default_workloads("cuda", "seqlen")
    assert [(w.name, w.batch, w.seqlen_q, w.heads, w.head_dim, w.dtype) for w in seqlen] == [
        (f"{kind}-b{16384 // s}-s{s}", 16384 // s, s, 16, 128, torch.bfloat16)
        for s in (1024, 2048, 4096, 8192, 16384) for kind in ("dense", "causal")]


def test_dynamic_suite_on_gpu():
    """Issue #4's workloads: B2 H16 D128 4k bf16, causal, 1024 keys per row; then issue #53's
    selection inside attention at 4k, 32k and 128k (K 2048, GQA 16/4 with per-KV-head scores
    past 4k)."""
    dynamic = bench.default_workloads("cuda", "dynamic")
    assert [(w.name, w.batch, w.seqlen_q, w.heads, w.heads_k, w.head_dim, w.dtype, w.causal,
             w.topk, w.bias, w.select) for w in dynamic] == [
        ("dyn-full-b2-s4096", 2, 4096, 16, 16, 128, torch.bfloat16, True, 1024, "full", False),
        ("dyn-key-b2-s4096", 2, 4096, 16, 16, 128, torch.bfloat16, True, 1024, "key", False),
        ("dyn-select-key-b2-s4096", 2, 4096, 16, 16, 128, torch.bfloat16, True, 1024, "key",
         True),
        ("dyn-select-kv_key-b1-s32768-hk4", 1, 32768, 16, 4, 128, torch.bfloat16, True, 2048,
         "kv_key", True),
        ("dyn-select-kv_key-b1-s131072-hk4", 1, 131072, 16, 4, 128, torch.bfloat16, True, 2048,
         "kv_key", True),
    ]


def test_rows_suite_on_gpu():
    """B2 H16 D128 8k bf16, not causal: the dense reference, then uniform and progressive
    lengths."""
    rows = bench.default_workloads("cuda", "rows")
    assert [(w.name, w.batch, w.seqlen_q, w.seqlen_k, w.heads, w.heads_k, w.head_dim, w.dtype,
             w.causal, w.row_lengths) for w in rows] == [
        ("dense-b2-s8192", 2, 8192, 8192, 16, 16, 128, torch.bfloat16, False, None),
        ("rows-uniform-b2-s8192", 2, 8192, 8192, 16, 16, 128, torch.bfloat16, False, "uniform"),
        ("rows-progressive-b2-s8192", 2, 8192, 8192, 16, 16, 128, torch.bfloat16, False,
         "progressive"),
    ]


def test_window_suite_on_gpu():
    """8k B2 H16 bf16: sliding (1024, 0) at D128, GQA 16/4 and D256; local (512, 512) at D128."""
    window = bench.default_workloads("cuda", "window")
    assert [(w.name, w.batch, w.seqlen_q, w.heads, w.heads_k, w.head_dim, w.dtype, w.window)
            for w in window] == [
        ("sliding1024-b2-s8192-d128", 2, 8192, 16, 16, 128, torch.bfloat16, (1024, 0)),
        ("window512-512-b2-s8192-d128", 2, 8192, 16, 16, 128, torch.bfloat16, (512, 512)),
        ("sliding1024-b2-s8192-hk4-d128", 2, 8192, 16, 4, 128, torch.bfloat16, (1024, 0)),
        ("sliding1024-b2-s8192-d256", 2, 8192, 16, 16, 256, torch.bfloat16, (1024, 0)),
    ]


def test_unknown_suite():
    with pytest.raises(ValueError, match="unknown suite"):
        bench.default_workloads("cpu", "nope")


@pytest.fixture(scope="module")
def tiny_results():
    """run_suite on a sparse, a dense, a dynamic and a rows tiny workload, omniattn (reference
    path) and SDPA math."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        return bench.run_suite([_tiny("tiny-sparse", density=0.5), _tiny("tiny-dense"),
                                _tiny_dynamic("tiny-dyn", "full"),
                                _tiny_rows("tiny-rows", "uniform", batch=1)],
                               providers=["omniattn", "sdpa-math"], progress=False, device="cpu")


def test_run_suite_rows(tiny_results):
    runs = [(r["name"], r["mode"], r["provider"]) for r in tiny_results]
    assert runs == [
        ("tiny-sparse", "fwd", "omniattn"),
        ("tiny-sparse", "fwd+bwd", "omniattn"),  # SDPA has no row on a sparse workload
        ("tiny-dense", "fwd", "omniattn"),
        ("tiny-dense", "fwd", "sdpa-math"),
        ("tiny-dense", "fwd+bwd", "omniattn"),
        ("tiny-dense", "fwd+bwd", "sdpa-math"),
        ("tiny-dyn", "fwd", "omniattn"),
        ("tiny-dyn", "fwd", "sdpa-math"),
        ("tiny-dyn", "fwd+bwd", "omniattn"),
        ("tiny-dyn", "fwd+bwd", "sdpa-math"),
        ("tiny-rows", "fwd", "omniattn"),
        ("tiny-rows", "fwd", "sdpa-math"),
        ("tiny-rows", "fwd+bwd", "omniattn"),
        ("tiny-rows", "fwd+bwd", "sdpa-math"),
    ]
    for r in tiny_results:
        assert r["error"] is None and r["ms"] > 0 and r["tflops"] > 0
        assert math.isfinite(r["ms"]) and math.isfinite(r["tflops"])
        assert r["density"] == (0.5 if r["name"] == "tiny-sparse" else None)
        assert r["row_lengths"] == ("uniform" if r["name"] == "tiny-rows" else None)
        assert (r["active_tile_fraction"] is None) == (r["name"] not in ("tiny-dyn", "tiny-rows"))
        assert r["flops_exact"] <= r["flops"]


def test_format_table_names_workloads(tiny_results):
    table = bench.format_table(tiny_results)
    assert "tiny-sparse" in table and "tiny-dense" in table and "tiny-dyn" in table
    assert "errors:" not in table
    assert "tiny-dyn: 16 keys per row (causal)" in table
    # tiny-dense has tiny-rows' shape: the acceptance ratio in both modes
    assert "ratio = omniattn ms / (dense ms x active tile fraction)" in table
    assert "tiny-rows: lengths uniform in [1, Sk], " in table
    assert "ratio fwd " in table and ", fwd+bwd " in table


def test_cpu_table_labels_rows_and_says_smoke_test(tiny_results):
    """Every row of the CPU table names its full shape (B, Sq, Sk, H/Hk, D, dtype) and mask
    form; the header says it is a smoke test, not a measurement of the kernels, and how the
    times were taken."""
    lines = bench.format_table(tiny_results).splitlines()
    assert "smoke test" in lines[0] and "not a speed measurement of the kernels" in lines[0]
    assert "run on a GPU for that" in lines[0]
    fewest = min(r["timed_runs"] for r in tiny_results)  # the tiny calls run past the minimum
    assert lines[1] == (f"ms: median CPU time per call over >= {fewest} timed calls "
                        f"per row, after {timing.CPU_WARMUP_RUNS} untimed warm-up calls; CPU "
                        f"threads 1; clock time.process_time")
    header = lines[3].split()
    assert header[:9] == ["workload", "B", "Sq", "Sk", "H/Hk", "D", "dtype", "mask", "mode"]
    masks = {"tiny-sparse": "block 0.50 of 16x16", "tiny-dense": "none",
             "tiny-dyn": "top-16 causal + full bias", "tiny-rows": "row lengths uniform"}
    rows = [line for line in lines[5:] if line.startswith("tiny-")]
    assert len(rows) == len({(r["name"], r["mode"]) for r in tiny_results}) == 8
    for line in rows:
        name = line.split()[0]
        assert line.split()[1:7] == ["1", "64", "64", "2/2", "16", "float32"]
        assert f" {masks[name]} " in line


def test_cpu_records_carry_warmup_and_median_counts(tiny_results):
    """Each CPU record says its time is the median over at least CPU_MIN_RUNS timed calls,
    after CPU_WARMUP_RUNS untimed ones, on one thread."""
    assert timing.CPU_WARMUP_RUNS >= 1 and timing.CPU_MIN_RUNS >= 10
    for r in tiny_results:
        assert r["timer"] == "time.process_time" and r["threads"] == 1
        assert r["warmup_runs"] == timing.CPU_WARMUP_RUNS
        assert r["timed_runs"] >= timing.CPU_MIN_RUNS


def _scripted_clock(monkeypatch, durations):
    """bench's CPU clock advanced only by a step that takes the next of `durations` (seconds)
    per call; returns the step and the thread counts it ran under."""
    now, remaining, threads = [0.0], iter(durations), []
    monkeypatch.setattr(timing, "process_time", lambda: now[0])

    def step():
        threads.append(torch.get_num_threads())
        now[0] += next(remaining)

    return step, threads


def test_time_cpu_reports_the_median_after_warmup(monkeypatch):
    """The warm-up calls are not timed; the time is the median of the timed calls (not their
    mean nor minimum), on CPU_TIMING_THREADS threads, the thread count restored after."""
    monkeypatch.setattr(timing, "CPU_WARMUP_RUNS", 3)
    monkeypatch.setattr(timing, "CPU_MIN_RUNS", 20)
    monkeypatch.setattr(timing, "CPU_MIN_TIME_S", 0.1)
    timed = [0.03, 0.01, 0.02] * 6 + [9.0, 9.0]
    step, threads = _scripted_clock(monkeypatch, [100.0] * 3 + timed)
    before = torch.get_num_threads()
    measured = timing._time_cpu(step)
    assert measured == (pytest.approx(20.0), 3, 20)
    assert threads == [timing.CPU_TIMING_THREADS] * 23
    assert torch.get_num_threads() == before


def test_time_cpu_runs_until_the_minimum_time(monkeypatch):
    """Calls shorter than CPU_MIN_TIME_S / CPU_MIN_RUNS are repeated until CPU_MIN_TIME_S."""
    monkeypatch.setattr(timing, "CPU_MIN_RUNS", 20)
    monkeypatch.setattr(timing, "CPU_MIN_TIME_S", 0.1)
    call = 0.1 / 40.5  # 41 calls reach the minimum time, 40 do not
    step, _ = _scripted_clock(monkeypatch, [call] * (timing.CPU_WARMUP_RUNS + 100))
    measured = timing._time_cpu(step)
    assert measured.timed_runs == 41 and measured.ms == pytest.approx(call * 1e3)


def test_time_cpu_restores_threads_when_the_step_raises():
    before = torch.get_num_threads()

    def failing():
        raise RuntimeError("backend unavailable")

    with pytest.raises(RuntimeError, match="backend unavailable"):
        timing._time_cpu(failing)
    assert torch.get_num_threads() == before


def test_gpu_timing_is_do_bench(monkeypatch):
    """On CUDA a run is one untimed call, then do_bench's median over its 25 ms warm-up and
    100 ms budget; its records name no counts or threads."""
    calls, benched = [], []

    def fake_do_bench(fn, **kwargs):
        benched.append(kwargs)
        fn()
        return 1.5

    monkeypatch.setattr(timing.triton.testing, "do_bench", fake_do_bench)
    built = BuiltAttention(lambda q, k, v: calls.append("fn") or q)
    workload = _tiny("tiny-dense")
    measured = timing.measure(lambda *args: built, workload, None, "fwd", torch.device("cuda"),
                              (torch.zeros(1),) * 4)
    assert measured == (1.5, None, None)
    assert calls == ["fn", "fn"]
    assert benched == [{"warmup": 25, "rep": 100, "return_mode": "median"}]
    assert timing.timer_fields(torch.device("cuda")) == {"timer": "triton.testing.do_bench",
                                                         "threads": None}


def test_write_json_round_trips(tiny_results, tmp_path):
    path = tmp_path / "bench.json"
    bench.write_json(path, tiny_results)
    written = json.loads(path.read_text())
    assert written["results"] == tiny_results
    assert written["environment"]["torch"] == torch.__version__


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib not installed")
def test_plot_writes_png(tiny_results, tmp_path):
    path = tmp_path / "bench.png"
    bench.plot_results(tiny_results, path)
    assert path.read_bytes().startswith(b"\x89PNG")


def test_plot_draws_time_against_seqlen(tmp_path, monkeypatch, reference_path):
    """Rows of one family at MIN_SEQLEN_SERIES lengths with the same batch x seqlen are drawn
    as time against sequence length, not as bars; the same family at other token counts, or at
    fewer lengths, stays in the bars. Records read back from JSON (windows as lists) draw too."""
    pytest.importorskip("matplotlib")
    series = [bench.Workload(f"{'causal' if causal else 'dense'}-b{256 // s}-s{s}", 256 // s, s,
                             s, 2, 2, 16, causal, torch.float32)
              for s in (32, 64, 128) for causal in (False, True)]
    others = [bench.Workload("dense-b1-s32", 1, 32, 32, 2, 2, 16, False, torch.float32),
              bench.Workload("dense-b1-s64", 1, 64, 64, 2, 2, 16, False, torch.float32),
              _tiny_window("tiny-window", (16, 0))]
    results = bench.run_suite(series + others, providers=["omniattn", "sdpa-math"],
                              modes=("fwd",), progress=False, device="cpu")
    families = plot._seqlen_series_families(results)
    in_series = {r["name"] for r in results if plot._family(r) in families}
    assert in_series == {w.name for w in series}
    drawn = []
    monkeypatch.setattr(plot, "_plot_time_vs_seqlen",
                        lambda ax, rows, mode: drawn.append(("seqlen", [r["name"] for r in rows])))
    monkeypatch.setattr(plot, "_plot_tflops_bars",
                        lambda ax, rows, mode: drawn.append(("bars", [r["name"] for r in rows])))
    bench.plot_results(results, tmp_path / "mocked.png")
    assert [kind for kind, _ in drawn] == ["seqlen", "bars"]
    assert set(drawn[0][1]) == in_series
    assert set(drawn[1][1]) == {w.name for w in others}
    gpu_rows = [dict(r, device="cuda") for r in results]  # a plot of times alone has no FLOPs
    assert "TFLOP/s" in report.results_header(gpu_rows)
    assert "TFLOP/s" not in report.results_header(gpu_rows, tflops=False)
    monkeypatch.undo()
    path = tmp_path / "record.json"
    bench.write_json(path, results)
    loaded, _ = bench.load_records([path])
    bench.plot_results(loaded, tmp_path / "seqlen.png")
    assert (tmp_path / "seqlen.png").read_bytes().startswith(b"\x89PNG")


def test_load_records_and_plot_command(tiny_results, tmp_path, monkeypatch, capsys):
    """`omniattn plot` draws saved records of one device (its name in the title), refuses
    records of two devices, and says so when matplotlib is missing."""
    from omniattn import cli

    first, second, other = (tmp_path / name for name in ("a.json", "b.json", "c.json"))
    bench.write_json(first, tiny_results[:4])
    bench.write_json(second, tiny_results[4:])
    results, device = bench.load_records([first, second])
    assert results == tiny_results and device == bench.device_name()
    record = json.loads(first.read_text())
    record["environment"]["device"] = f"not {bench.device_name()}"  # on any machine
    other.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="different devices"):
        bench.load_records([first, other])
    assert cli.main(["plot", str(first), str(other), "--out", str(tmp_path / "x.png")]) == 2
    drawn = []
    monkeypatch.setattr(cli, "plot_results", lambda *args: drawn.append(args))
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: object())  # "installed"
    assert cli.main(["plot", str(other), "--out", "out.png"]) == 0
    assert drawn[0][1:] == ("out.png", f"not {bench.device_name()}")
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    assert cli.main(["plot", str(other), "--out", "out.png"]) == 1
    assert "plots need matplotlib" in capsys.readouterr().out


def test_cli_bench_suite_option(monkeypatch, capsys):
    from omniattn import cli

    calls = []

    def fake_run_suite(workloads, **kwargs):
        calls.append(workloads)
        return []

    monkeypatch.setattr(cli, "run_suite", fake_run_suite)
    monkeypatch.setattr(cli, "format_table", lambda results: "table")
    assert cli.main(["bench", "--suite", "all,gqa"]) == 0
    assert calls == [bench.default_workloads(cli._current_device(), "all")]
    assert cli.main(["bench", "--suite", "dynamic"]) == 0
    assert calls[-1] == bench.default_workloads(cli._current_device(), "dynamic")
    with pytest.raises(SystemExit):
        cli.main(["bench", "--suite", "nope"])
    capsys.readouterr()

    # without matplotlib, --plot says so and the run still succeeds
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    assert cli.main(["bench", "--suite", "gqa", "--plot", "out.png"]) == 0
    assert "plots need matplotlib" in capsys.readouterr().out


def test_info_and_records_carry_the_switches(monkeypatch, capsys):
    from omniattn import cli

    for name in ("OMNIATTN_GLUON", "OMNIATTN_TMA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMNIATTN_CALL_PLANS", "0")
    assert report.environment_info()["switches"] == {
        "OMNIATTN_GLUON": True, "OMNIATTN_TMA": True, "OMNIATTN_CALL_PLANS": False}
    assert cli.main(["info"]) == 0
    assert "switches: OMNIATTN_GLUON on, OMNIATTN_TMA on, OMNIATTN_CALL_PLANS off" \
        in capsys.readouterr().out


def test_decode_suite_on_gpu():
    decode = bench.default_workloads("cuda", "decode")
    assert [(w.name, w.batch, w.seqlen_k, w.heads, w.heads_k, w.head_dim, w.dtype, w.page_size)
            for w in decode] == [
        ("decode-b1-k131072", 1, 131072, 32, 8, 128, torch.bfloat16, None),
        ("decode-b8-k32768", 8, 32768, 32, 8, 128, torch.bfloat16, None),
        ("decode-b64-k4096", 64, 4096, 32, 8, 128, torch.bfloat16, None),
        ("decode-b1-k131072-paged256", 1, 131072, 32, 8, 128, torch.bfloat16, 256),
        ("decode-b8-k32768-paged256", 8, 32768, 32, 8, 128, torch.bfloat16, 256),
        ("decode-b64-k4096-paged256", 64, 4096, 32, 8, 128, torch.bfloat16, 256),
    ]


def test_decode_workloads_plan_split_kv(plan_as_gpu):
    """On an H100 omniattn's forward of every decode row is split-KV decoding, paged too."""
    plan_as_gpu(hopper=True)
    for workload in bench.default_workloads("cuda", "decode"):
        extra = ExtraInputs(workload, "cpu")
        # planning reads no values: left uninitialised, cheap at GPU sizes
        q = torch.empty((workload.batch, 1, workload.heads, workload.head_dim),
                        dtype=workload.dtype)
        shape = (workload.batch * workload.seqlen_k // workload.page_size, workload.page_size) \
            if workload.page_size else (workload.batch, workload.seqlen_k)
        k = torch.empty((*shape, workload.heads_k, workload.head_dim), dtype=workload.dtype)
        plan = forward_plan(workload, extra, q, k, k)
        assert plan.kernel == "fwd_decode", (workload.name, plan)


def test_decode_providers_agree_and_pages_are_omniattns(reference_path):
    contiguous, paged = bench.default_workloads("cpu", "decode")[1::2]
    assert providers_for(paged, ("omniattn", "sdpa-math", "flex")) == ("omniattn",)
    assert providers_for(contiguous, ("omniattn", "sdpa-math")) == ("omniattn", "sdpa-math")
    extra = ExtraInputs(contiguous, "cpu")
    q, k, v, _ = make_inputs(contiguous, torch.device("cpu"), requires_grad=False)
    outs = [provider_builders()[p](contiguous, torch.device("cpu"), extra).fn(q, k, v)
            for p in ("omniattn", "sdpa-math")]
    torch.testing.assert_close(*outs)
    # the paged inputs hold the keys the block table lists
    extra = ExtraInputs(paged, "cpu")
    q, k_pages, v_pages, _ = make_inputs(paged, torch.device("cpu"), requires_grad=False)
    assert k_pages.shape == (4 * 256 // 64, 64, 2, 64)
    assert sorted(extra.block_table.flatten().tolist()) == list(range(16))
    out = provider_builders()["omniattn"](paged, torch.device("cpu"), extra).fn(q, k_pages,
                                                                               v_pages)
    keys = k_pages[extra.block_table.long()].flatten(1, 2)
    values = v_pages[extra.block_table.long()].flatten(1, 2)
    torch.testing.assert_close(out, omniattn.attention(q, keys, values))
    rows = bench.run_suite([contiguous, paged], providers=["omniattn", "sdpa-math"],
                           progress=False, device="cpu")
    assert [(r["name"], r["mode"], r["provider"]) for r in rows] == [
        (contiguous.name, "fwd", "omniattn"), (contiguous.name, "fwd", "sdpa-math"),
        (paged.name, "fwd", "omniattn")]  # forward only; pages: omniattn alone
    table = bench.format_table(rows)
    assert "pages of 64" in table and f"{paged.name}: 1.0 MB" in table
