"""Where a call's time goes: its do_bench median against the device time of its kernels
(torch.profiler), the kernels it launches and the host time of one call (perf_counter over calls
queued without a sync). Run with PYTHONPATH at each tree to compare two trees in one session:

    PYTHONPATH=src python benchmarks/call_overhead.py --causal --seqlen 16384
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import omniattn

CALLS = 20


def profiled(fn) -> tuple[float, float]:
    """(device ms of fn's kernels per call, kernels per call)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    return (sum(e.device_time_total for e in events) / 1000 / CALLS,
            sum(e.count for e in events) / CALLS)


def host_us(fn, calls: int = CALLS) -> float:
    """Host time of one call, the calls queued without a sync (fewer than the queue holds)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--label", default="", help="printed and recorded with the numbers")
    opts = parser.parse_args()
    shape = (opts.batch, opts.seqlen, opts.heads, opts.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16,
                           requires_grad=opts.backward) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def call():
        out = omniattn.attention(q, k, v, causal=opts.causal)
        if opts.backward:
            out.backward(dout)

    call()
    median = triton.testing.do_bench(call, warmup=50, rep=300, return_mode="median")
    device_ms, kernels = profiled(call)
    record = dict(label=opts.label, shape=shape, causal=opts.causal, backward=opts.backward,
                  call_ms=round(median, 4), kernels_ms=round(device_ms, 4),
                  kernels_per_call=kernels, host_us=round(host_us(call), 1))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
