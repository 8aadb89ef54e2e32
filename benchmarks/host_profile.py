"""Where one `attention` call's host time goes: cProfile over calls queued while the GPU is held
busy (so no launch waits on the device), the functions with the most own time. Run once per tree
to compare two trees in one session:

    PYTHONPATH=src python benchmarks/host_profile.py --causal --seqlen 16384 --backward
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import omniattn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backward", action="store_true", help="profile forward + backward")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--top", type=int, default=30, help="functions printed")
    parser.add_argument("--sort", default="tottime", help="a pstats sort key (cumulative, ...)")
    opts = parser.parse_args()
    shape = (1, opts.seqlen, opts.heads, opts.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16,
                           requires_grad=opts.backward) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def call():
        out = omniattn.attention(q, k, v, causal=opts.causal)
        if opts.backward:
            out.backward(dout)

    for _ in range(3):  # compiles, caches, call plans
        call()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    start = time.perf_counter()
    for _ in range(opts.calls):
        call()
    unprofiled = time.perf_counter() - start
    torch.cuda.synchronize()
    print(f"host us per call: {unprofiled / opts.calls * 1e6:.0f}")
    # ~1 s of GPU sleep: the queued calls never wait for a free launch slot
    torch.cuda._sleep(2_000_000_000)
    start = time.perf_counter()
    with cProfile.Profile() as profiler:
        for _ in range(opts.calls):
            call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    print(f"host us per call under the profiler: {elapsed / opts.calls * 1e6:.0f}")
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(opts.sort).print_stats(opts.top)
    print(text.getvalue())


if __name__ == "__main__":
    main()
