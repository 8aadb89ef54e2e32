"""Host time of a top-k decoding call without a GPU (issue #55): CPU tensors at the decode shapes
(GQA 32/8, D128, a key bias (B, 8, 1, Sk) as the scores), fp16, the GPU's configs forced (no
interpreter tiles, an H100's 132 SMs) and every kernel launch stubbed by the hit path of
runtime.launch's cache: the argument key is computed, nothing runs. Prints per call the host
us (best of 5 x --calls) and the launches with their argument counts (Triton's launcher cost
grows with them), for the whole call, `row_thresholds` alone and the call without top-k.
What a stub hides: Triton's compiled launcher per launch, and CUDA-only paths (call plans key
only CUDA tensors, so the planned replay is not measured here).

    PYTHONPATH=src python benchmarks/topk_decode_host.py --shapes 1x131072 8x32768
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import sys
import time

import torch

import omniattn
import omniattn.api
import omniattn.autograd
import omniattn.backends.triton.decode
import omniattn.passes
from omniattn.kernels import select
from omniattn.kernels.elementwise import Elementwise
from omniattn.kernels.schedule import KernelArgs
from omniattn.runtime import launch as launch_module

HEADS, HEADS_K, HEAD_DIM, SMS = 32, 8, 128, 132


class StubLaunches:
    """Stands in for runtime.launch.launch: its cache key, and per kernel the launches counted
    (while `counting`) and their arguments (tuple leaves and keywords)."""

    def __init__(self):
        self.counts = collections.Counter()
        self.arguments = {}
        self.counting = False

    def __call__(self, kernel, grid, *args, **kwargs):
        hash((launch_module.arguments_key(args), tuple(kwargs),
              launch_module.arguments_key(kwargs.values())))
        if self.counting:
            name = kernel.fn.__name__
            self.counts[name] += 1
            self.arguments[name] = _leaves(args) + len(kwargs)

    def summary(self) -> str:
        return ", ".join(f"{name} x{count} ({self.arguments[name]} args)"
                         for name, count in self.counts.items())


def _leaves(value) -> int:
    return sum(map(_leaves, value)) if type(value) is tuple else 1


def force_gpu_host_path(stub: StubLaunches) -> None:
    """Every omniattn module's launch stubbed, the GPU's configs and SM count, CPU tensors sent
    to the kernels' path."""
    real_launch = launch_module.launch
    for name, module in list(sys.modules.items()):
        if not name.startswith("omniattn.") or module is None or module is launch_module:
            continue
        if getattr(module, "launch", None) is real_launch:
            module.launch = stub
        if hasattr(module, "interpreting") and name != "omniattn.runtime.switches":
            module.interpreting = lambda: False
        if hasattr(module, "sm_count"):
            module.sm_count = lambda device: SMS
        if hasattr(module, "compute_capability"):
            module.compute_capability = lambda device: (9, 0)
        if hasattr(module, "uses_kernels"):
            module.uses_kernels = lambda q: True


def host_us(fn, calls: int) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["1x131072", "8x32768"],
                        help="BATCHxKEYS")
    parser.add_argument("--topk", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--profile", action="store_true",
                        help="also cProfile's top functions of the top-k call")
    opts = parser.parse_args()
    stub = StubLaunches()
    force_gpu_host_path(stub)
    for shape in opts.shapes:
        batch, seqlen = map(int, shape.split("x"))
        q = torch.randn(batch, 1, HEADS, HEAD_DIM, dtype=torch.float16)
        k, v = (torch.randn(batch, seqlen, HEADS_K, HEAD_DIM, dtype=torch.float16)
                for _ in range(2))
        bias = torch.randn(batch, HEADS_K, 1, seqlen, dtype=torch.float16)
        scores = Elementwise.of(bias, HEADS)
        for causal in (False, True):
            args = KernelArgs.make(HEAD_DIM, causal, None, None, 0.0)
            calls = dict(
                topk_call=lambda: omniattn.attention(q, k, v, attn_bias=bias, topk=opts.topk,
                                                     causal=causal),
                thresholds=lambda: select.row_thresholds(opts.topk, scores, args, batch, 1,
                                                         seqlen, HEADS, HEADS_K),
                bias_call=lambda: omniattn.attention(q, k, v, attn_bias=bias, causal=causal))
            print(f"B{batch} x {seqlen} keys, causal={causal}:")
            for label, fn in calls.items():
                for _ in range(3):
                    fn()
                stub.counts.clear()
                stub.counting = True
                fn()
                stub.counting = False
                print(f"  {label:10s} {host_us(fn, opts.calls):6.1f} us, "
                      f"{sum(stub.counts.values())} launches: {stub.summary()}", flush=True)
            if opts.profile:
                with cProfile.Profile() as profiler:
                    for _ in range(opts.calls):
                        calls["topk_call"]()
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
                print(text.getvalue())


if __name__ == "__main__":
    main()
