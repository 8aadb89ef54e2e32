"""Top-k in split-KV decoding on a GPU (issue #55), GQA 32/8, D128, bf16, one query token per
sequence, a key bias (B, 8, 1, Sk) as the scores: the rows' thresholds (`row_thresholds`) with
the split radix select against the single-program one (`key_splits` held at 1), and whole
`attention` calls with and without `topk`, causal and not; the floor is K, V and bias bytes at
--bandwidth. One JSON record per line.

    python benchmarks/topk_decode.py --shapes 1x131072 8x32768 --topk 4096
"""
from __future__ import annotations

import argparse
import json

import torch
import triton

import omniattn
from omniattn.kernels import select
from omniattn.kernels.elementwise import Elementwise
from omniattn.kernels.schedule import KernelArgs

HEADS, HEADS_K, HEAD_DIM = 32, 8, 128


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median")


def record(batch: int, seqlen: int, topk: int, causal: bool, bandwidth: float,
           profile: bool) -> dict:
    q = torch.randn(batch, 1, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen, HEADS_K, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    bias = torch.randn(batch, HEADS_K, 1, seqlen, device="cuda", dtype=torch.bfloat16)
    scores = Elementwise.of(bias, HEADS)
    args = KernelArgs.make(HEAD_DIM, causal, None, None, 0.0)

    def thresholds():
        return select.row_thresholds(topk, scores, args, batch, 1, seqlen, HEADS, HEADS_K)

    split_ms = median_ms(thresholds)
    rule = select.key_splits
    select.key_splits = lambda *shape: 1
    try:
        single_ms = median_ms(thresholds)
    finally:
        select.key_splits = rule
    floor_ms = (k.numel() + v.numel() + bias.numel()) * 2 / bandwidth * 1e3

    def topk_call():
        return omniattn.attention(q, k, v, attn_bias=bias, topk=topk, causal=causal)

    extra = {}
    if profile:
        from call_overhead import host_us
        from topk_attention import kernel_times

        # host ms per call over 50 calls the GPU stays behind
        extra = dict(topk_call_kernels=kernel_times(topk_call),
                     topk_call_host_ms=host_us(topk_call, 50) / 1e3,
                     thresholds_host_ms=host_us(thresholds, 50) / 1e3)
    return dict(gpu=torch.cuda.get_device_name(), batch=batch, seqlen_k=seqlen, topk=topk,
                causal=causal, thresholds_ms=split_ms, thresholds_single_program_ms=single_ms,
                topk_call_ms=median_ms(topk_call),
                bias_call_ms=median_ms(lambda: omniattn.attention(q, k, v, attn_bias=bias,
                                                                  causal=causal)),
                floor_ms=floor_ms,
                plan=str(omniattn.explain(q, k, v, attn_bias=bias, topk=topk, causal=causal)),
                **extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["1x131072", "8x32768"],
                        help="BATCHxKEYS")
    parser.add_argument("--topk", type=int, default=4096)
    parser.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes / s")
    parser.add_argument("--profile", action="store_true",
                        help="also each kernel's device ms in a top-k call and host ms per call")
    opts = parser.parse_args()
    for shape in opts.shapes:
        batch, seqlen = map(int, shape.split("x"))
        for causal in (False, True):
            print(json.dumps(record(batch, seqlen, opts.topk, causal, opts.bandwidth,
                                    opts.profile)),
                  flush=True)


if __name__ == "__main__":
    main()
