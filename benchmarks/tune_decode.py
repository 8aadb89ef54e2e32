"""Sweep split-KV decoding's tiles and split counts (GPU): issue #55's decode shapes, one query
token, GQA 32/8 D128 bf16, contiguous and paged (256-key pages). Prints ms and K/V GB/s per
(shape, tiles, splits), the split count configs.decode_splits picks marked; writes JSON.

    python benchmarks/tune_decode.py --json out.json [--splits 0,1,2,4,8,16,32,64]
"""
from __future__ import annotations

import argparse
import json

import torch
import triton

from omniattn.backends.triton import configs
from omniattn.backends.triton.configs import DecodeConfig
from omniattn.passes import decode_forward
from omniattn.kernels.schedule import KernelArgs
from omniattn.kernels.sequences import PagedKeys

SHAPES = [(1, 131072), (8, 32768), (64, 4096)]
HEADS, HEADS_K, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 256
# (block_n, warps, stages); block_m follows the rows (16 here)
CANDIDATES = [(64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (32, 4, 4), (64, 2, 3),
              (128, 4, 2), (256, 8, 2)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--splits", default="0,1,2,4,8,16,32,64,128",
                        help="split counts to time; 0 = configs.decode_splits's choice")
    opts = parser.parse_args()
    splits = [int(s) for s in opts.splits.split(",")]
    args = KernelArgs.make(HEAD_DIM, False, None, None, 0.0)
    default = configs._DECODE[HEAD_DIM]
    rows = []
    for batch, seqlen_k in SHAPES:
        q = torch.randn(batch, 1, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, seqlen_k, HEADS_K, HEAD_DIM, device="cuda",
                            dtype=torch.bfloat16) for _ in range(2))
        per_seq = seqlen_k // PAGE_SIZE
        table = torch.randperm(batch * per_seq, device="cuda").view(batch, per_seq).int()
        pages = PagedKeys(table, None, PAGE_SIZE, seqlen_k)
        kv_bytes = 2 * k.numel() * k.element_size()
        for paged in (False, True):
            keys = (k.view(-1, PAGE_SIZE, HEADS_K, HEAD_DIM), v.view(-1, PAGE_SIZE, HEADS_K,
                                                                    HEAD_DIM)) if paged else (k, v)
            for block_n, warps, stages in CANDIDATES:
                configs._DECODE[HEAD_DIM] = DecodeConfig(16, block_n, warps, stages)
                for count in splits:
                    def run():
                        return decode_forward(q, *keys, args, paged=pages if paged else None,
                                              num_splits=count)
                    try:
                        run()
                        ms = triton.testing.do_bench(run, warmup=25, rep=100,
                                                     return_mode="median")
                    except Exception as exc:  # out of shared memory, ...
                        ms, error = None, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                    else:
                        error = None
                    row = dict(batch=batch, seqlen_k=seqlen_k, paged=paged, block_n=block_n,
                               num_warps=warps, num_stages=stages, splits=count, ms=ms,
                               gbps=None if ms is None else kv_bytes / ms / 1e6, error=error)
                    rows.append(row)
                    chosen = "*" if (block_n, warps, stages) == (default.block_n,
                                                                  default.num_warps,
                                                                  default.num_stages) else " "
                    timing = f"{ms:.4f} ms {row['gbps']:.0f} GB/s" if ms else error
                    print(f"{chosen} B{batch} k{seqlen_k}{' paged' if paged else ''} "
                          f"n{block_n} w{warps} s{stages} splits {count or 'auto'}: {timing}")
    configs._DECODE[HEAD_DIM] = default
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
