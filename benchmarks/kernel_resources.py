"""Registers, spills and shared memory of the attention kernels as compiled for Hopper (sm_90a),
on any machine: no GPU needed (Triton compiles for a named target; its bundled ptxas reports).

    python benchmarks/kernel_resources.py --kernel bwd --causal --bwd-tiles 64,128,128,64,8,3

The launchers run on CPU tensors with the kernel launch replaced by a compile, so the kernels
get exactly the constexprs and specialisations a GPU call of that shape would give them. The
numbers match the H100's `CompiledKernel.n_regs` / shared memory (2026-11-25: D128 backward 255
registers, 164,864 bytes); ptxas counts spills in bytes (n_spills on the device counts words).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from omniattn.kernels import bwd, configs, fwd
from omniattn.kernels.schedule import KernelArgs

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def compile_for_target(fn: JITFunction, args, kwargs) -> dict:
    """What fn[grid](*args, **kwargs) would compile on TARGET, with ptxas' resource report."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                          specialization, options)
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET,
                              options=options.__dict__)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        report = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", ptx.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return dict(kernel=fn.__name__, num_warps=options.num_warps, num_stages=options.num_stages,
                registers=int(re.search(r"Used (\d+) registers", report).group(1)),
                spill_store_bytes=int(spills.group(1)), spill_load_bytes=int(spills.group(2)),
                shared_bytes=compiled.metadata.shared, cubin=compiled.asm["cubin"])


@contextlib.contextmanager
def launches_compiled(names: set[str], reports: list[dict]):
    """Within: launches of the kernels named `names` compile for TARGET (appended to reports);
    every other launch is skipped."""
    original = JITFunction.__getitem__

    def compile_instead(self, grid):
        def launch(*args, **kwargs):
            if self.fn.__name__ in names:
                reports.append(compile_for_target(self, args, dict(kwargs)))
        return launch

    JITFunction.__getitem__ = compile_instead
    try:
        yield
    finally:
        JITFunction.__getitem__ = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=("fwd", "bwd"), default="bwd")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--heads-k", type=int, default=16, help="of 16 query heads (GQA below 16)")
    parser.add_argument("--bwd-tiles", help="m1,n1,m2,n2,warps,stages in place of the config")
    parser.add_argument("--cubin", metavar="PATH", help="write the cubin (cuobjdump -sass it)")
    opts = parser.parse_args()
    if opts.bwd_tiles:
        tiles = configs.BwdTileConfig(*map(int, opts.bwd_tiles.split(",")))
        configs._BWD[configs._key(opts.head_dim, opts.causal)] = tiles
    # the forward takes tensor descriptors on Hopper; these CPU tensors would not say so
    fwd.tma_enabled = lambda device: True
    q = torch.randn(2, opts.seqlen, 16, opts.head_dim, dtype=torch.bfloat16)
    k, v = (torch.randn(2, opts.seqlen, opts.heads_k, opts.head_dim, dtype=torch.bfloat16)
            for _ in range(2))
    args = KernelArgs.make(opts.head_dim, opts.causal, None, None, 0.0)
    lse = torch.zeros(2, 16, opts.seqlen)
    reports: list[dict] = []
    with launches_compiled({"_fwd_kernel", "_bwd_kernel"}, reports):
        if opts.kernel == "fwd":
            fwd.attention_forward(q, k, v, args)
        else:
            bwd.attention_backward(q, q, k, v, q, lse, args)
    for report in reports:
        cubin = report.pop("cubin")
        if opts.cubin:
            with open(opts.cubin, "wb") as f:
                f.write(cubin)
        print(" ".join(f"{key}={value}" for key, value in report.items()))


if __name__ == "__main__":
    main()
