"""Minimal Gluon kernels that are race-free by construction, with the structure of the attention
kernels (fwd_hopper.py, bwd_hopper.py): shared memory and mbarriers allocated in the kernel
entry, `gl.warp_specialize` with a default partition of 4 warps and a 1-warp worker, values and
buffers captured by the partitions. `compute-sanitizer --tool racecheck` over them tells which
hazard reports come from the structure itself rather than from our kernels' protocols
(tools/sanitize.py runs them as the family "minimal"; docs/sanitizer.md).

    python tools/racecheck_minimal.py            # run all variants on an sm90 GPU, check outputs
    python tools/racecheck_minimal.py --ptx DIR  # compile them for sm_90a (no GPU) into DIR

Variants, each copying src (rows, COLS) into dst and checked against it:
- bare: no shared memory of its own, nothing handed over; the partitions capture kernel
  arguments and program ids only (Triton rematerialises those in each partition), so the only
  shared-memory traffic is warp_specialize's own (which partition each worker warp runs).
- wide: as bare, with the attention forward's partitions: a default of 4 warps and workers of
  4, 4 and 1 warps (bare has one 1-warp worker).
- captures: as bare, but the row count is loaded from global memory, a value Triton cannot
  rematerialise: it goes to the workers through warp_specialize's capture area in shared memory.
- smem: the worker copies tiles through registers into a ring of shared-memory buffers
  (st.shared), the default partition waits on the buffer's mbarrier, reads it (ld.shared),
  releases it and writes it out; a loaded round count is captured.
- tma: as smem, but the worker fills the buffers by TMA (an mbarrier with expected bytes),
  as the attention kernels' producers do.
Every hand-over orders all writers before all readers: each side's threads meet at a barrier
(`gl.thread_barrier`) before its thread 0 arrives on the mbarrier the other side waits on, and
generic reads of a TMA buffer are fenced against the next copy into it.
"""
from __future__ import annotations

import argparse
import pathlib
import re

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

VARIANTS = ("bare", "wide", "captures", "smem", "tma")
TILE_ROWS = 16
COLS = 64
NUM_BUF = 2
ROUNDS = 8  # tiles per program
PROGRAMS = 2


@gluon.jit
def _copy_rows(src, dst, first_row, num_rows, COLS: gl.constexpr, WARPS: gl.constexpr):
    """Rows [first_row, first_row + num_rows) of src into dst through registers, by the
    partition's WARPS warps."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    rows = gl.arange(0, 4 * WARPS, gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, gl.SliceLayout(0, layout))
    for r in range(first_row, first_row + num_rows, 4 * WARPS):
        offsets = (r + rows)[:, None] * COLS + cols[None, :]
        inside = (r + rows < first_row + num_rows)[:, None]
        gl.store(dst + offsets, gl.load(src + offsets, mask=inside), mask=inside)


@gluon.jit
def _ws_bare_kernel(Src, Dst, rows_per_program, COLS: gl.constexpr):
    first = gl.program_id(0) * rows_per_program
    half = rows_per_program // 2
    gl.warp_specialize([(_copy_rows, (Src, Dst, first, half, COLS, 4)),
                        (_copy_rows, (Src, Dst, first + half, rows_per_program - half, COLS, 1))],
                       [1], [40])


@gluon.jit
def _ws_wide_kernel(Src, Dst, rows_per_program, COLS: gl.constexpr):
    first = gl.program_id(0) * rows_per_program
    part = rows_per_program // 4
    gl.warp_specialize([(_copy_rows, (Src, Dst, first, part, COLS, 4)),
                        (_copy_rows, (Src, Dst, first + part, part, COLS, 4)),
                        (_copy_rows, (Src, Dst, first + 2 * part, part, COLS, 4)),
                        (_copy_rows, (Src, Dst, first + 3 * part, rows_per_program - 3 * part,
                                      COLS, 1))],
                       [4, 4, 1], [40, 40, 40])


@gluon.jit
def _ws_captures_kernel(Src, Dst, RowsPerProgram, COLS: gl.constexpr):
    rows_per_program = gl.load(RowsPerProgram)  # not rematerialisable: captured through smem
    first = gl.program_id(0) * rows_per_program
    half = rows_per_program // 2
    gl.warp_specialize([(_copy_rows, (Src, Dst, first, half, COLS, 4)),
                        (_copy_rows, (Src, Dst, first + half, rows_per_program - half, COLS, 1))],
                       [1], [40])


@gluon.jit
def _tile_offsets(first_row, step, TILE_ROWS: gl.constexpr, COLS: gl.constexpr,
                  layout: gl.constexpr):
    rows = gl.arange(0, TILE_ROWS, gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, gl.SliceLayout(0, layout))
    return (first_row + step * TILE_ROWS + rows)[:, None] * COLS + cols[None, :]


@gluon.jit
def _consume(Dst, ring, ready, free, first_row, rounds, TILE_ROWS: gl.constexpr,
             COLS: gl.constexpr, NUM_BUF: gl.constexpr, FROM_TMA: gl.constexpr):
    """Default partition (4 warps): each round's tile, once its buffer is ready, from shared
    memory to dst; the buffer goes back to the worker after every thread has read it."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    for i in range(rounds):
        slot = i % NUM_BUF
        mbarrier.wait(ready.index(slot), (i // NUM_BUF) & 1)
        tile = ring.index(slot).load(layout)
        if FROM_TMA:
            fence_async_shared()  # these generic reads before the next TMA write of the buffer
        gl.thread_barrier()  # every thread's read before thread 0's release
        mbarrier.arrive(free.index(slot))
        gl.store(Dst + _tile_offsets(first_row, i, TILE_ROWS, COLS, layout), tile)


@gluon.jit
def _produce_by_registers(Src, ring, ready, free, first_row, rounds, TILE_ROWS: gl.constexpr,
                          COLS: gl.constexpr, NUM_BUF: gl.constexpr):
    """Worker (1 warp): each round's tile from src through registers into its buffer, once the
    default partition released the buffer's previous round."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
    for i in range(rounds):
        slot = i % NUM_BUF
        # a fresh barrier passes a wait on parity 1: the first round needs no release
        mbarrier.wait(free.index(slot), ((i // NUM_BUF) & 1) ^ 1)
        ring.index(slot).store(gl.load(Src + _tile_offsets(first_row, i, TILE_ROWS, COLS,
                                                           layout)))
        gl.thread_barrier()  # every lane's store before lane 0's arrival
        mbarrier.arrive(ready.index(slot))


@gluon.jit
def _produce_by_tma(src_desc, ring, ready, free, first_row, rounds, TILE_ROWS: gl.constexpr,
                    NUM_BUF: gl.constexpr):
    """Worker (1 warp): each round's tile by TMA into its buffer, arriving on its barrier."""
    for i in range(rounds):
        slot = i % NUM_BUF
        mbarrier.wait(free.index(slot), ((i // NUM_BUF) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), src_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(src_desc, [first_row + i * TILE_ROWS, 0],
                                        ready.index(slot), ring.index(slot))


@gluon.jit
def _ws_smem_kernel(Src, Dst, Rounds, TILE_ROWS: gl.constexpr, COLS: gl.constexpr,
                    NUM_BUF: gl.constexpr):
    rounds = gl.load(Rounds)
    first_row = gl.program_id(0) * rounds * TILE_ROWS
    ring = gl.allocate_shared_memory(gl.float16, [NUM_BUF, TILE_ROWS, COLS],
                                     gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=1)
    gl.warp_specialize([(_consume, (Dst, ring, ready, free, first_row, rounds, TILE_ROWS, COLS,
                                    NUM_BUF, False)),
                        (_produce_by_registers, (Src, ring, ready, free, first_row, rounds,
                                                 TILE_ROWS, COLS, NUM_BUF))],
                       [1], [40])


@gluon.jit
def _ws_tma_kernel(src_desc, Dst, Rounds, TILE_ROWS: gl.constexpr, COLS: gl.constexpr,
                   NUM_BUF: gl.constexpr):
    rounds = gl.load(Rounds)
    first_row = gl.program_id(0) * rounds * TILE_ROWS
    ring = gl.allocate_shared_memory(src_desc.dtype, [NUM_BUF] + src_desc.block_type.shape,
                                     src_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=1)
    gl.warp_specialize([(_consume, (Dst, ring, ready, free, first_row, rounds, TILE_ROWS, COLS,
                                    NUM_BUF, True)),
                        (_produce_by_tma, (src_desc, ring, ready, free, first_row, rounds,
                                           TILE_ROWS, NUM_BUF))],
                       [1], [40])


KERNELS = {"bare": _ws_bare_kernel, "wide": _ws_wide_kernel, "captures": _ws_captures_kernel, "smem": _ws_smem_kernel,
           "tma": _ws_tma_kernel}


def launch_arguments(variant: str, src: torch.Tensor, dst: torch.Tensor):
    """(kernel, grid, args, kwargs) of `variant` copying src (PROGRAMS * ROUNDS * TILE_ROWS,
    COLS) fp16 into dst."""
    rows_per_program = ROUNDS * TILE_ROWS
    if variant == "bare":
        return _ws_bare_kernel, (PROGRAMS,), (src, dst, rows_per_program), dict(COLS=COLS)
    if variant == "wide":
        return _ws_wide_kernel, (PROGRAMS,), (src, dst, rows_per_program), dict(COLS=COLS)
    if variant == "captures":
        count = torch.tensor([rows_per_program], dtype=torch.int32, device=src.device)
        return _ws_captures_kernel, (PROGRAMS,), (src, dst, count), dict(COLS=COLS)
    rounds = torch.tensor([ROUNDS], dtype=torch.int32, device=src.device)
    tiles = dict(TILE_ROWS=TILE_ROWS, COLS=COLS, NUM_BUF=NUM_BUF)
    if variant == "smem":
        return _ws_smem_kernel, (PROGRAMS,), (src, dst, rounds), tiles
    if variant == "tma":
        layout = gl.NVMMASharedLayout.get_default_for([TILE_ROWS, COLS], gl.float16)
        desc = TensorDescriptor(src, list(src.shape), list(src.stride()), [TILE_ROWS, COLS],
                                layout)
        return _ws_tma_kernel, (PROGRAMS,), (desc, dst, rounds), tiles
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def inputs(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """src (distinct values, exact in fp16) and a dst of NaNs."""
    rows = PROGRAMS * ROUNDS * TILE_ROWS
    src = (torch.arange(rows * COLS, device=device) % 2039).to(torch.float16).view(rows, COLS)
    return src, torch.full_like(src, float("nan"))


def run(variant: str) -> None:
    """Launch `variant` on the current CUDA device (sm90) and check dst == src."""
    src, dst = inputs("cuda")
    kernel, grid, args, kwargs = launch_arguments(variant, src, dst)
    kernel[grid](*args, **kwargs, num_warps=4)
    torch.cuda.synchronize()
    torch.testing.assert_close(dst, src, rtol=0, atol=0, msg=f"{variant}: dst differs from src")


def runs_here() -> bool:
    """Whether the current CUDA device is an sm90 (Hopper) one, the only target of the
    variants (TMA, setmaxnreg)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def compile_for_sm90(variant: str) -> dict[str, str]:
    """The variant's Triton stages compiled for sm_90a without a GPU (CPU tensors stand in for
    the arguments): {"ttgir": ..., "llir": ..., "ptx": ...}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    src, dst = inputs("cpu")
    kernel, _, args, kwargs = launch_arguments(variant, src, dst)
    kwargs = dict(kwargs, num_warps=4)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                              specialization, options)
    compiled = triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    return {stage: compiled.asm[stage] for stage in ("ttgir", "llir", "ptx")}


_LOC = re.compile(r"^\s*\.loc\s+\d+\s+(\d+)\s+\d+\s*(?://\s*(.*))?$")
_SHARED_ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:ld|st|atom|red)\.shared[\w.:]*)\s+(.*?);")


def shared_accesses(ptx: str) -> list[tuple[str, str, str]]:
    """The generic shared-memory accesses of a PTX listing (ld / st / atom / red .shared: the
    ones racecheck sees as plain reads and writes; TMA, wgmma and mbarrier operations are not
    among them), each as (source position with its inlining chain, as the .loc comment gives
    it; instruction; operands), in program order."""
    accesses, place = [], "?"
    for line in ptx.splitlines():
        if (loc := _LOC.match(line)):
            place = (loc.group(2) or f"line {loc.group(1)}").strip()
        elif (access := _SHARED_ACCESS.match(line)):
            accesses.append((place, access.group(1), " ".join(access.group(2).split())))
    return accesses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--ptx", metavar="DIR",
                        help="compile for sm_90a (no GPU needed), write each variant's TTGIR, "
                        "LLVM IR and PTX into DIR and list their generic shared-memory "
                        "accesses, instead of running")
    parser.add_argument("--shared-accesses", nargs="+", metavar="PTX",
                        help="list the generic shared-memory accesses of these PTX files (e.g. "
                        "Triton's cache's _fwd_hopper_kernel.ptx) by source line, and exit")
    opts = parser.parse_args()
    if opts.shared_accesses:
        for path in opts.shared_accesses:
            print(f"{path}:")
            for place, op, operands in shared_accesses(pathlib.Path(path).read_text()):
                print(f"  {place:<60} {op} {operands}")
        return
    variants = [v for v in opts.variants.split(",") if v]
    for variant in variants:
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    if opts.ptx:
        out = pathlib.Path(opts.ptx)
        out.mkdir(parents=True, exist_ok=True)
        for variant in variants:
            stages = compile_for_sm90(variant)
            for stage, text in stages.items():
                (out / f"{variant}.{stage}").write_text(text)
            print(f"{variant}: {out / variant}.{{ttgir,llir,ptx}}")
            for place, op, operands in shared_accesses(stages["ptx"]):
                print(f"  {place:<60} {op} {operands}")
        return
    if not runs_here():
        print("skipped: the minimal kernels run on sm90 only")
        return
    for variant in variants:
        run(variant)
        print(f"{variant}: ok ({KERNELS[variant].fn.__name__})", flush=True)


if __name__ == "__main__":
    main()
