"""Whether per-row key length calls are GPU-bound: B2 H16 D128 8k bf16, uniform random lengths,
forward and fwd+bwd. For each: the call's median (triton.testing.do_bench) against the time of
its kernels (torch.profiler, device time per call), with the lengths' range check remembered
(calls after the first replay call plans) and, as the base, read on every call (a host sync per
call, no plan). --json writes the numbers."""
from __future__ import annotations

import argparse
import datetime
import json
from unittest import mock

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import omniattn
from omniattn import api

CALLS_PROFILED = 20


def kernel_ms(fn) -> float:
    """Device time of fn's kernels per call, from the profiler's CUDA events."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS_PROFILED):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    return total_us / 1000 / CALLS_PROFILED


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--commit", default="", help="the commit measured, for the record")
    args = parser.parse_args()
    torch.manual_seed(0)
    shape = (2, args.seqlen, 16, 128)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    lens = torch.randint(0, args.seqlen + 1, shape[:2], device="cuda", dtype=torch.int32)

    def forward():
        with torch.no_grad():
            return omniattn.attention(q, k, v, seqlens_k_per_row=lens)

    def forward_backward():
        torch.autograd.grad(omniattn.attention(q, k, v, seqlens_k_per_row=lens), (q, k, v), dout)

    def dense_forward():
        with torch.no_grad():
            return omniattn.attention(q, k, v)

    # the harness's own floor: a planned dense forward of the same shape
    call = triton.testing.do_bench(dense_forward, warmup=25, rep=200, return_mode="median")
    kernels = kernel_ms(dense_forward)
    results = [{"lengths": "none (dense)", "mode": "fwd", "call_ms": call, "kernels_ms": kernels,
                "call_over_kernels": call / kernels}]
    print(f"{'none (dense)':20s} {'fwd':8s} call {call:.3f} ms  kernels {kernels:.3f} ms  "
          f"ratio {call / kernels:.3f}")
    for label, remembered in (("checked every call", False), ("check remembered", True)):
        patch = mock.patch.object(api, "known_checked", lambda *a: False) if not remembered \
            else mock.patch.object(api, "known_checked", api.known_checked)
        with patch:
            for mode, fn in (("fwd", forward), ("fwd+bwd", forward_backward)):
                call = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                kernels = kernel_ms(fn)
                results.append({"lengths": label, "mode": mode, "call_ms": call,
                                "kernels_ms": kernels, "call_over_kernels": call / kernels})
                print(f"{label:20s} {mode:8s} call {call:.3f} ms  kernels {kernels:.3f} ms  "
                      f"ratio {call / kernels:.3f}")
    if args.json:
        commit = args.commit
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
                       "commit": commit, "torch": torch.__version__,
                       "triton": triton.__version__,
                       "shape": f"B2 H16 {args.seqlen} D128 bf16, uniform random lengths",
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
