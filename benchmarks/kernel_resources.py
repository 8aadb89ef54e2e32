"""Registers, spills and shared memory of the attention kernels as compiled for Hopper (sm_90a),
on any machine: no GPU needed (Triton compiles for a named target; its bundled ptxas reports).

    python benchmarks/kernel_resources.py --kernel bwd --causal --bwd-tiles 64,128,128,64,8,3
    python benchmarks/kernel_resources.py --kernel gluon-bwd --seqlen 256 --mask --bias full
    python benchmarks/kernel_resources.py --kernel decode --heads-k 4 --page-size 256 --bias key

The launchers run on CPU tensors with the kernel launch replaced by a compile, so the kernels
get exactly the constexprs and specialisations a GPU call of that shape would give them. The
numbers match the H100's `CompiledKernel.n_regs` / shared memory (2026-11-25: D128 backward 255
registers, 164,864 bytes); ptxas counts spills in bytes (n_spills on the device counts words).
The Gluon kernels (the Gluon forward, the Gluon backward; the wide Gluon backward at head dim 256) run their
launchers the same way, with issue #4's element mask and biases on request; their partitions set
their own register budgets (setmaxnreg), so `registers` is the launch's, and the spills are what
tells. `barriers` and `barrier_bytes_overwritten` read the SASS (cuobjdump): the mbarriers
initialised, and their bytes that a fixed-offset shared store also writes, which must be none.
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
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import JITFunction, create_function_from_signature

from omniattn.backends.gluon_sm90 import backward as bwd_hopper
from omniattn.backends.gluon_sm90 import backward_wide as bwd_hopper_wide
from omniattn.backends.gluon_sm90 import configs as gluon_configs
from omniattn.backends.gluon_sm90 import forward as fwd_hopper
from omniattn.backends.triton import configs
from omniattn.backends.triton import decode
from omniattn.backends.triton import forward as fwd
from omniattn.kernels.elementwise import Elementwise, TopkTerm
from omniattn.kernels.schedule import KernelArgs, TileLists
from omniattn.kernels.sequences import PackedSequences, PagedKeys
from omniattn.passes import attention_backward, attention_forward, decode_forward
from omniattn.predicate import FULL, PARTIAL

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")
# SASS: an mbarrier's init, and a shared store at a fixed offset (warp_specialize's captures)
_BARRIER_INIT = re.compile(r"SYNCS\.EXCH\.64 URZ, \[UR\d+\+0x([0-9a-f]+)\]")
_FIXED_STORE = re.compile(r"\bSTS(\.U8|\.S8|\.U16|\.S16|\.64|\.128)? \[UR\d+\+0x([0-9a-f]+)\]")
_STORE_BYTES = {None: 4, ".U8": 1, ".S8": 1, ".U16": 2, ".S16": 2, ".64": 8, ".128": 16}


def barrier_overwrites(cubin: bytes) -> tuple[int, int]:
    """(mbarriers initialised, bytes of them that a plain shared store at a fixed offset also
    writes). Triton 3.6 gives a barrier that no partition uses (initialised, never waited on) to
    warp_specialize's captures, which the workers read back: on an H100 time-sliced between
    processes some warps then read the barrier's state in place of a loop bound and the
    kernel hung (docs/perf/faults.md, "A hang under concurrent processes")."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    inits = _BARRIER_INIT.findall(sass)
    barriers = {int(offset, 16) + byte for offset in inits for byte in range(8)}
    stored = {int(offset, 16) + byte for width, offset in _FIXED_STORE.findall(sass)
              for byte in range(_STORE_BYTES[width or None])}
    return len(inits), len(barriers & stored)


def compile_for_target(fn: JITFunction, args, kwargs) -> dict:
    """What fn[grid](*args, **kwargs) would compile on TARGET, with ptxas' resource report."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                          specialization, options)
    source = GluonASTSource if fn.is_gluon() else ASTSource
    compiled = triton.compile(source(fn, signature, constexprs, attrs), target=TARGET,
                              options=options.__dict__)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        # the ptxas Triton compiled with: the PTX's .version is that one's. Inductor points
        # TRITON_PTXAS_PATH at torch's own ptxas (CUDA 13 on the H100 hosts) for its process
        # and children: Triton's bundled one (12.8) exited 255 on that PTX 9.0 in the GPU
        # suite's shards that had compiled a FlexAttention call first
        run = subprocess.run([knobs.nvidia.ptxas.path, "-v", "--gpu-name", "sm_90a", ptx.name,
                              "-o", os.devnull], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"ptxas exited {run.returncode} on {fn.__name__}:\n{run.stdout}"
                           f"{run.stderr}")
    report = run.stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    barriers, overwritten = barrier_overwrites(compiled.asm["cubin"])
    return dict(kernel=fn.__name__, num_warps=options.num_warps, num_stages=options.num_stages,
                registers=int(re.search(r"Used (\d+) registers", report).group(1)),
                spill_store_bytes=int(spills.group(1)), spill_load_bytes=int(spills.group(2)),
                shared_bytes=compiled.metadata.shared, barriers=barriers,
                barrier_bytes_overwritten=overwritten, cubin=compiled.asm["cubin"])


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


def _elementwise(q: torch.Tensor, mask: bool, bias_form: str | None):
    """(mask, bias) Elementwise for q (B, S, H, D): a bool mask spanning (Sq, Sk) if `mask`; a
    bias of `bias_form` "key" (B, H, 1, Sk), "column" (B, H, Sq, 1) or "full" (B, H, Sq, Sk)."""
    batch, seqlen, heads, _ = q.shape
    masks = Elementwise.of(torch.ones(batch, heads, seqlen, seqlen, dtype=torch.bool), heads) \
        if mask else None
    bias = None
    if bias_form is not None:
        rows = 1 if bias_form == "key" else seqlen
        cols = 1 if bias_form == "column" else seqlen
        bias = Elementwise.of(torch.randn(batch, heads, rows, cols, dtype=q.dtype), heads)
    return masks, bias


def _gluon_call(kernel: str, q: torch.Tensor, k: torch.Tensor, args: KernelArgs, mask: bool,
                bias_form: str | None, full_lists: bool, row_lengths: bool,
                packed: bool) -> None:
    """The Gluon forward or backward launcher on CPU tensors: with `mask`, a bool mask spanning
    (Sq, Sk) and every tile of the lists PARTIAL (their lengths do not change the code); with
    `full_lists` (no mask), lists of FULL tiles, as a block mask's; a bias of `bias_form` "key"
    (B, H, 1, Sk), "column" (B, H, Sq, 1) or "full" (B, H, Sq, Sk), with its gradient;
    `row_lengths`: per-row key lengths alone, the rows in length order; `packed`: the batch's
    rows as packed sequences (varlen) of equal lengths."""
    batch, seqlen, heads, head_dim = q.shape
    masks, bias = _elementwise(q, mask, bias_form)
    sequences = None
    if packed:
        starts = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32)
        sequences = PackedSequences(starts, starts, seqlen, seqlen)
        q, k = q.flatten(0, 1), k.flatten(0, 1)

    def lists(block_m: int, block_n: int, transposed: bool) -> TileLists:
        states = torch.full((batch, heads, seqlen // block_m, seqlen // block_n),
                            PARTIAL if mask else FULL, dtype=torch.int8)
        return TileLists.from_states(states, block_m, block_n, transposed)

    # lengths sorted longest first, and the caller row of each
    lengths = (torch.arange(seqlen, 0, -1, dtype=torch.int32).expand(batch, seqlen).contiguous(),
               torch.arange(seqlen, dtype=torch.int32).expand(batch, seqlen).contiguous()) \
        if row_lengths else (None, None)
    if kernel == "gluon-fwd":
        cfg = fwd_hopper.hopper_forward_config(head_dim, bias_form == "full")
        schedule = lists(cfg.block_m, cfg.block_n, False) if mask or full_lists else None
        lse = torch.empty(heads, batch * seqlen) if packed else torch.empty(batch, heads, seqlen)
        fwd_hopper.hopper_forward(q, k, k, args, torch.empty_like(q), lse, schedule, masks, bias,
                                  *lengths, sequences)
        return
    cfg = gluon_configs.hopper_backward_config(head_dim)
    row_stats, _, _ = bwd_hopper.backward_row_stats(batch, heads, seqlen, cfg.block_m,
                                                    q.device)
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(k))
    if gluon_configs.hopper_backward_splits_head_dim(head_dim):
        if mask or bias is not None or full_lists:
            raise SystemExit(f"the Gluon backward takes no lists, masks or biases at head dim "
                             f"{head_dim}")
        bwd_hopper_wide.hopper_backward_wide(q, q, k, k, row_stats, torch.zeros(q.shape), args,
                                             *grads, *lengths)
        return
    schedule = lists(cfg.block_m, cfg.block_n, True) if mask or full_lists else None
    dbias = None
    if bias is not None:
        # a key (column) bias's sums over queries (keys) in fp32; a full bias's tiles in the
        # inputs' dtype
        grad = torch.empty(bias.tensor.shape, dtype=q.dtype if bias_form == "full"
                           else torch.float32)
        dbias = (grad, tuple(grad.stride()))
    bwd_hopper.hopper_backward(q, q, k, k, row_stats, torch.zeros(q.shape), args, *grads,
                               schedule, masks, bias, dbias, *lengths, sequences)


def _decode_call(q: torch.Tensor, k: torch.Tensor, args: KernelArgs, query_rows: int,
                 page_size: int | None, mask: bool, bias_form: str | None,
                 topk_form: str | None = None) -> None:
    """Split-KV decoding's launcher on CPU tensors: `query_rows` rows per sequence over k's
    keys, from pages of `page_size` keys if given; a key mask (B, 1, 1, Sk) with `mask`, a key
    bias (B, Hk, 1, Sk) with bias_form "key"; a top-k term over per-key scores (B, Hk, 1, Sk)
    with topk_form "key" (one score row per tile), (B, H, 1, Sk) with "head" (a row per query
    head), its rows' threshold pairs made up (the code does not depend on their values); an
    H100's 132 SMs choose the split."""
    batch, seqlen, heads_k, head_dim = k.shape
    decode.sm_count = lambda device: 132
    if bias_form not in (None, "key"):
        raise SystemExit("split-KV decoding is timed here with a key bias only")
    heads = q.shape[2]
    masks = Elementwise.of(torch.ones(batch, 1, 1, seqlen, dtype=torch.bool), heads) \
        if mask else None
    bias = Elementwise.of(torch.randn(batch, heads_k, 1, seqlen, dtype=q.dtype), heads) \
        if bias_form else None
    paged = None
    if page_size is not None:
        table = torch.arange(batch * seqlen // page_size, dtype=torch.int32).view(batch, -1)
        paged = PagedKeys(table, torch.full((batch,), seqlen, dtype=torch.int32), page_size,
                          seqlen)
        k = k.reshape(-1, page_size, heads_k, head_dim)
    topk = None
    if topk_form is not None:
        score_heads = heads_k if topk_form == "key" else heads
        scores = torch.randn(batch, score_heads, 1, seqlen, dtype=q.dtype)
        topk = TopkTerm(Elementwise.of(scores, heads),
                        torch.zeros(2, batch, score_heads, query_rows, dtype=torch.int32))
    decode_forward(q[:, :query_rows], k, k, args, mask=masks, bias=bias, paged=paged, topk=topk)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=("fwd", "bwd", "gluon-fwd", "gluon-bwd", "decode"),
                        default="bwd")
    parser.add_argument("--mask", action="store_true",
                        help="a bool element mask spanning (Sq, Sk)")
    parser.add_argument("--lists", action="store_true",
                        help="Gluon kernels: lists of FULL tiles (a block mask's), no mask")
    parser.add_argument("--bias", choices=("key", "column", "full"),
                        help="a key bias (B, H, 1, Sk), a column (B, H, Sq, 1) or a full one")
    parser.add_argument("--row-lengths", action="store_true",
                        help="Gluon kernels: per-row key lengths alone, rows in length order")
    parser.add_argument("--packed", action="store_true",
                        help="Gluon kernels: the batch as packed sequences (varlen)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--window", help="left,right (-1: unbounded), as attention's window")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--heads-k", type=int, default=16, help="of 16 query heads (GQA below 16)")
    parser.add_argument("--bwd-tiles", help="m1,n1,m2,n2,warps,stages[,atomic_dq[,dkdv_apart]] "
                        "(flags 0 / 1) in place of the config")
    parser.add_argument("--query-rows", type=int, default=1,
                        help="decode: query rows per sequence (--seqlen: its cached keys)")
    parser.add_argument("--page-size", type=int, help="decode: keys from pages of this size")
    parser.add_argument("--topk", choices=("key", "head"),
                        help="decode: a top-k term over scores (B, Hk, 1, Sk) or (B, H, 1, Sk)")
    parser.add_argument("--cubin", metavar="PATH", help="write the cubin (cuobjdump -sass it)")
    opts = parser.parse_args()
    if opts.bwd_tiles:
        tiles = configs.BwdTileConfig(*map(int, opts.bwd_tiles.split(",")))
        key = configs._key(opts.head_dim, opts.causal)
        configs._BWD[key] = tiles
        configs._BWD_CAUSAL.pop(key[0], None)  # this tool's causal calls have no other mask
    # the forward takes tensor descriptors on Hopper; these CPU tensors would not say so
    fwd.tma_enabled = lambda device: True
    bwd_hopper.sm_count = lambda device: 132  # an H100's
    q = torch.randn(2, opts.seqlen, 16, opts.head_dim, dtype=torch.bfloat16)
    k, v = (torch.randn(2, opts.seqlen, opts.heads_k, opts.head_dim, dtype=torch.bfloat16)
            for _ in range(2))
    window = tuple(map(int, opts.window.split(","))) if opts.window else None
    args = KernelArgs.make(opts.head_dim, opts.causal, window, None, 0.0)
    lse = torch.zeros(2, 16, opts.seqlen)
    reports: list[dict] = []
    with launches_compiled({"_fwd_kernel", "bwd_kernel", "_fwd_hopper_kernel",
                            "_bwd_hopper_kernel", "_bwd_wide_kernel", "decode_split_kernel",
                            "decode_combine_kernel"}, reports):
        if opts.kernel == "fwd":
            mask, bias = _elementwise(q, opts.mask, opts.bias)
            attention_forward(q, k, v, args, mask=mask, bias=bias)
        elif opts.kernel == "bwd":
            mask, bias = _elementwise(q, opts.mask, opts.bias)
            attention_backward(q, q, k, v, q, lse, args, mask=mask, bias=bias,
                               bias_grad=bias is not None)
        elif opts.kernel == "decode":
            _decode_call(q, k, args, opts.query_rows, opts.page_size, opts.mask, opts.bias,
                         opts.topk)
        else:
            _gluon_call(opts.kernel, q, k, args, opts.mask, opts.bias, opts.lists,
                        opts.row_lengths, opts.packed)
    for report in reports:
        cubin = report.pop("cubin")
        if opts.cubin:
            with open(opts.cubin, "wb") as f:
                f.write(cubin)
        print(" ".join(f"{key}={value}" for key, value in report.items()))


if __name__ == "__main__":
    main()
