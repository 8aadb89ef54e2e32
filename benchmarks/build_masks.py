"""Time and peak memory of building 128k-token block masks on the GPU (issue #3: < 50 ms and
< 64 MB each). Prints one line per builder; --json writes them."""
from __future__ import annotations

import argparse
import json

import torch
import triton

import omniattn

SEQLEN = 131072


def builders(device: str) -> dict:
    bounds = torch.randint(1, SEQLEN, (23,), generator=torch.Generator().manual_seed(0))
    cu_seqlens = torch.cat([torch.tensor([0]), bounds.sort().values,
                            torch.tensor([SEQLEN])]).to(device)
    return {
        "causal": lambda: omniattn.causal_block_mask(SEQLEN, SEQLEN, 128, device=device),
        "window 4096": lambda: omniattn.window_block_mask(SEQLEN, SEQLEN, (4096, 0),
                                                          block_size=128, device=device),
        "document (24 docs, causal)": lambda: omniattn.document_block_mask(cu_seqlens, 128,
                                                                           causal=True),
        "streaming tokens (64, 4000)": lambda: omniattn.streaming_block_mask(
            SEQLEN, SEQLEN, 64, 4000, 128, in_tokens=True, device=device),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = []
    for name, build in builders("cuda").items():
        build()  # warm-up: kernels compiled, allocator primed
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        mask = build()
        torch.cuda.synchronize()
        peak_mb = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
        ms = triton.testing.do_bench(build, warmup=5, rep=50, return_mode="median")
        bitmaps = 0 if mask.element_bits is None else mask.element_bits.shape[0]
        results.append({"builder": name, "ms": ms, "peak_mb": peak_mb, "bitmaps": bitmaps,
                        "density": mask.density})
        print(f"{name:30s} {ms:8.2f} ms {peak_mb:8.1f} MB  bitmaps {bitmaps:5d}  "
              f"density {mask.density:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
