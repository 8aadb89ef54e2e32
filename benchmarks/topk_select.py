"""Top-k row thresholds on a GPU (issue #53), bf16 per-key scores (B, H, 1, S), causal: the range
select (kernels/select_ranges.py, O(S log S)) at each length; up to --radix-max, the radix select
on the same selection (per-key scores with an all-True row-spanning mask send it there: it
rescans every row's causal prefix, O(S^2)); `topk_mask` against torch.topk + scatter on the
rows a chunk at a time; peak memory of each beyond its inputs. Not measured yet: written for
the session that has the GPU (this one had none).

    python benchmarks/topk_select.py --seqlen 4096 32768 131072 --batch 1 --heads 16
"""
from __future__ import annotations

import argparse

import torch
import triton

from omniattn.kernels.elementwise import Elementwise
from omniattn.kernels.schedule import KernelArgs
from omniattn.kernels.select import row_thresholds
from omniattn.masks import topk_mask


def measured(fn) -> tuple[float, float]:
    """(median ms, peak MiB allocated beyond what was allocated before)."""
    fn()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    peak = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
    return triton.testing.do_bench(fn), peak


def torch_topk_mask(scores: torch.Tensor, topk: int, chunk: int = 1024) -> torch.Tensor:
    """torch.topk + scatter, causal, a chunk of rows at a time (what topk_mask did before)."""
    batch, heads, _, seqlen = scores.shape
    keep = torch.empty(batch, heads, seqlen, seqlen, dtype=torch.bool, device=scores.device)
    keys = torch.arange(seqlen, device=scores.device)
    for start in range(0, seqlen, chunk):
        rows = torch.arange(start, min(start + chunk, seqlen), device=scores.device)
        causal = keys[None, :] <= rows[:, None]
        masked = scores.float().masked_fill(~causal, float("-inf"))
        top = masked.topk(topk, dim=-1, sorted=False).indices
        part = torch.zeros(batch, heads, len(rows), seqlen, dtype=torch.bool,
                           device=scores.device)
        keep[:, :, rows] = part.scatter_(-1, top, True) & causal
    return keep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--topk", type=int, default=None, help="default: S / 4 up to 2048")
    parser.add_argument("--radix-max", type=int, default=16384)
    parser.add_argument("--mask-max", type=int, default=4096)
    args = parser.parse_args()
    causal = KernelArgs.make(128, True, None, None, 0.0)
    for seqlen in args.seqlen:
        topk = args.topk or min(seqlen // 4, 2048)
        batch, heads = args.batch, args.heads
        scores = torch.randn(batch, heads, 1, seqlen, device="cuda", dtype=torch.bfloat16)
        form = Elementwise.of(scores, heads)
        rows = [("ranges", measured(lambda: row_thresholds(topk, form, causal, batch, seqlen,
                                                             seqlen, heads, heads)))]
        if seqlen <= args.radix_max:
            every = Elementwise.of(torch.ones(1, 1, seqlen, seqlen, dtype=torch.bool,
                                              device="cuda"), heads)
            rows.append(("radix", measured(lambda: row_thresholds(
                topk, form, causal, batch, seqlen, seqlen, heads, heads, mask=every))))
        if seqlen <= args.mask_max:
            rows.append(("topk_mask", measured(lambda: topk_mask(scores, topk, causal=True))))
            rows.append(("torch topk+scatter", measured(lambda: torch_topk_mask(scores, topk))))
        for name, (ms, mib) in rows:
            print(f"B{batch} H{heads} S{seqlen} K{topk} {name:>20}: {ms:8.3f} ms, "
                  f"peak +{mib:8.1f} MiB")


if __name__ == "__main__":
    main()
