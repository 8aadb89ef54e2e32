"""Minimal Gluon kernels that are race-free by construction, with the structure of the attention
kernels (the Gluon forward, the Gluon backward): shared memory and mbarriers allocated in the kernel
entry, `gl.warp_specialize` with a default partition of 4 warps and a 1-warp worker, values and
buffers captured by the partitions. `compute-sanitizer --tool racecheck` over them tells which
hazard reports come from the structure itself rather than from our kernels' protocols
(tools/sanitize.py runs them as the family "minimal"; docs/sanitizer.md).

    python tools/racecheck_minimal.py            # run all variants on an sm90 GPU, check outputs
    python tools/racecheck_minimal.py --ptx DIR  # compile them for sm_90a (no GPU) into DIR

Variants. These five copy src (rows, COLS) into dst and are checked against it:
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
These four have the D128 forward's partitions and register budgets: a default of 4 warps,
workers of 4 and 1 warps (384 threads), setmaxnreg 232 / 40.
- regs: as wide (a copy through registers, nothing of its own in shared memory) with those.
- ring: the 1-warp producer TMA-loads a stream of tiles into a ring; both 4-warp partitions wait
  for each, multiply it by their rows of X (a wgmma with X in registers, as the forward's P V)
  and release it (an mbarrier of count 2); out = X @ (sum of the tiles), stored from registers.
  A loaded round count is captured.
- ring_tma_store: as ring, out stored as the forward's epilogue does: staged in shared memory
  (stmatrix), fenced, TMA store, store_wait.
- forward: the forward's dense protocol without its softmax, at its tiles (64 query rows per
  consumer, 128-key K / V tiles, 3 buffers: 224 KB of shared memory) and on a (programs, heads)
  grid: the producer loads each consumer's q tile and the K and V rings; each consumer issues
  S_j = Q K_j^T beside P_{j-1} V_{j-1} (P = S in fp16), releases K_j and V_{j-1} as the forward
  does, stages out in its q buffer and stores it by TMA. Nothing is captured (the tile count
  comes from arguments), as in the dense forward. out = (Q K^T) V per head.
The matmul variants take inputs of -1, 0 and 1, so their results are integers that fp32 and fp16
hold exactly, checked for equality with the float64 reference.
Every hand-over orders all writers before all readers: each side's threads meet at a barrier
(`gl.thread_barrier`, or the one Triton puts before an arrive) before its thread 0 arrives on
the mbarrier the other side waits on; generic reads of a TMA buffer are fenced against the next
copy into it, and a wgmma's reads of a buffer are waited for (`warpgroup_mma_wait`) before its
release.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# smem last: its reports (an artefact, docs/sanitizer.md) reach racecheck's print limit, which
# would hide those of the variants after it in the same process
VARIANTS = ("bare", "wide", "captures", "tma", "regs", "ring", "ring_tma_store", "forward",
            "smem")
TILE_ROWS = 16
COLS = 64
NUM_BUF = 2
ROUNDS = 8  # tiles per program
PROGRAMS = 2
# regs, ring, ring_tma_store, forward: the D128 forward's partitions (consumer warpgroups of 64
# rows, the default and a 4-warp worker; a 1-warp producer) and register budgets
CONSUMER_REGS, PRODUCER_REGS = 232, 40
BLOCK_M = 64
BLOCK_K = 64  # ring: rows of a streamed tile (the wgmma's reduction)
RING_COLS = 64
# forward: the D128 forward's tiles and ring (224 KB of shared memory), a (programs, heads) grid
HEAD_DIM = 128
FORWARD_BLOCK_N = 128
FORWARD_NUM_BUF = 3
FORWARD_ROUNDS = 4  # key tiles per head
HEADS = 2


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


@gluon.jit
def _ws_regs_kernel(Src, Dst, rows_per_program, COLS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                    PRODUCER_REGS: gl.constexpr):
    first = gl.program_id(0) * rows_per_program
    part = rows_per_program // 3
    gl.warp_specialize([(_copy_rows, (Src, Dst, first, part, COLS, 4)),
                        (_copy_rows, (Src, Dst, first + part, part, COLS, 4)),
                        (_copy_rows, (Src, Dst, first + 2 * part, rows_per_program - 2 * part,
                                      COLS, 1))],
                       [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def _ring_barriers(NUM_BUF: gl.constexpr, CONSUMERS: gl.constexpr):
    """(ready, free): a ring buffer's copy arrives on ready[slot]; free[slot] completes once every
    consumer released it."""
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=CONSUMERS)
    return ready, free


@gluon.jit
def _ring_consume(X, Out, out_desc, out_smem, ring, ready, free, x_row, rounds,
                  CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                  COLS: gl.constexpr, NUM_BUF: gl.constexpr, TMA_STORE: gl.constexpr):
    """Consumer warpgroup CONSUMER (4 warps): its BLOCK_M rows of X [., BLOCK_K] from x_row +
    CONSUMER * BLOCK_M, in registers as the wgmma's first operand, times each round's
    [BLOCK_K, COLS] tile of the ring, summed in fp32 (an asynchronous wgmma per tile, waited
    for before the release, as the forward's P V); the sum in fp16 to the same rows of Out
    [., COLS], from registers or (TMA_STORE) staged in out_smem[CONSUMER] and stored by TMA,
    as the forward's epilogue."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, COLS, 16])
    x_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row0 = x_row + CONSUMER * BLOCK_M
    x_rows = gl.arange(0, BLOCK_M, gl.SliceLayout(1, x_layout))
    x_cols = gl.arange(0, BLOCK_K, gl.SliceLayout(0, x_layout))
    x = gl.load(X + (row0 + x_rows)[:, None] * BLOCK_K + x_cols[None, :])
    acc = gl.zeros([BLOCK_M, COLS], gl.float32, acc_layout)
    for i in range(rounds):
        slot = i % NUM_BUF
        mbarrier.wait(ready.index(slot), (i // NUM_BUF) & 1)
        acc = warpgroup_mma(x, ring.index(slot), acc, is_async=True)
        acc, x = warpgroup_mma_wait(0, deps=(acc, x))
        mbarrier.arrive(free.index(slot))
    out = acc.to(gl.float16)
    if TMA_STORE:
        staged = out_smem.index(CONSUMER)
        staged.store(out)
        fence_async_shared()  # the generic writes before the TMA engine's reads
        tma.async_copy_shared_to_global(out_desc, [row0, 0], staged)
        tma.store_wait(0)
    else:
        rows = gl.arange(0, BLOCK_M, gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, COLS, gl.SliceLayout(0, acc_layout))
        gl.store(Out + (row0 + rows)[:, None] * COLS + cols[None, :], out)


@gluon.jit
def _ws_ring_kernel(X, tile_desc, Out, Rounds, BLOCK_M: gl.constexpr, COLS: gl.constexpr,
                    NUM_BUF: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                    PRODUCER_REGS: gl.constexpr):
    BLOCK_K: gl.constexpr = tile_desc.block_type.shape[0]
    rounds = gl.load(Rounds)  # not rematerialisable: captured through shared memory
    x_row = gl.program_id(0) * 2 * BLOCK_M
    tile_row = gl.program_id(0) * rounds * BLOCK_K
    ring = gl.allocate_shared_memory(tile_desc.dtype, [NUM_BUF] + tile_desc.block_type.shape,
                                     tile_desc.layout)
    ready, free = _ring_barriers(NUM_BUF, 2)
    # without TMA_STORE the consumers take tile_desc and ring as unused stand-ins
    gl.warp_specialize([(_ring_consume, (X, Out, tile_desc, ring, ring, ready, free, x_row,
                                         rounds, 0, BLOCK_M, BLOCK_K, COLS, NUM_BUF, False)),
                        (_ring_consume, (X, Out, tile_desc, ring, ring, ready, free, x_row,
                                         rounds, 1, BLOCK_M, BLOCK_K, COLS, NUM_BUF, False)),
                        (_produce_by_tma, (tile_desc, ring, ready, free, tile_row, rounds,
                                           BLOCK_K, NUM_BUF))],
                       [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def _ws_ring_tma_store_kernel(X, tile_desc, out_desc, Rounds, BLOCK_M: gl.constexpr,
                              COLS: gl.constexpr, NUM_BUF: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    BLOCK_K: gl.constexpr = tile_desc.block_type.shape[0]
    rounds = gl.load(Rounds)
    x_row = gl.program_id(0) * 2 * BLOCK_M
    tile_row = gl.program_id(0) * rounds * BLOCK_K
    ring = gl.allocate_shared_memory(tile_desc.dtype, [NUM_BUF] + tile_desc.block_type.shape,
                                     tile_desc.layout)
    out_smem = gl.allocate_shared_memory(out_desc.dtype, [2] + out_desc.block_type.shape,
                                         out_desc.layout)
    ready, free = _ring_barriers(NUM_BUF, 2)
    gl.warp_specialize([(_ring_consume, (X, X, out_desc, out_smem, ring, ready, free, x_row,
                                         rounds, 0, BLOCK_M, BLOCK_K, COLS, NUM_BUF, True)),
                        (_ring_consume, (X, X, out_desc, out_smem, ring, ready, free, x_row,
                                         rounds, 1, BLOCK_M, BLOCK_K, COLS, NUM_BUF, True)),
                        (_produce_by_tma, (tile_desc, ring, ready, free, tile_row, rounds,
                                           BLOCK_K, NUM_BUF))],
                       [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def _forward_load(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready,
                  kv_free, q_row, k_row, num_tiles, BLOCK_M: gl.constexpr,
                  NUM_BUF: gl.constexpr):
    """Producer (1 warp), as the forward's `_load_kv` of a dense call: each consumer's q tile
    once, then step j's K and V tiles into buffer j % NUM_BUF, K once both consumers released
    the buffer's K (kv_free[buf]), V once they released its V (kv_free[NUM_BUF + buf])."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    for c in gl.static_range(2):
        mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + c * BLOCK_M, 0], q_ready.index(c),
                                        q_smem.index(c))
    for j in range(num_tiles):
        buf = j % NUM_BUF
        mbarrier.wait(kv_free.index(buf), ((j // NUM_BUF) & 1) ^ 1)
        mbarrier.expect(k_ready.index(buf), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row + j * BLOCK_N, 0], k_ready.index(buf),
                                        k_smem.index(buf))
        mbarrier.wait(kv_free.index(NUM_BUF + buf), ((j // NUM_BUF) & 1) ^ 1)
        mbarrier.expect(v_ready.index(buf), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [k_row + j * BLOCK_N, 0], v_ready.index(buf),
                                        v_smem.index(buf))


@gluon.jit
def _forward_attend(o_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_free, q_row,
                    num_tiles, CONSUMER: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_BUF: gl.constexpr):
    """Consumer warpgroup CONSUMER, as the forward's `_attend` / `_overlapped_tile` of a dense
    call without the softmax: out = sum over steps j of (Q K_j^T in fp16) V_j. Step j issues
    S_j = Q K_j^T and acc += P_{j-1} V_{j-1} (P: the previous S in fp16, a register operand),
    releases K_j once S_j is done and V_{j-1} after its matmul; at the end out goes through
    the query buffer (waited for again, as the forward does) and TMA."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q = q_smem.index(CONSUMER)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    mbarrier.wait(q_ready.index(CONSUMER), 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(kv_free.index(0))
    p_op = gl.convert_layout(s.to(gl.float16), p_layout)
    for j in range(1, num_tiles):
        buf = j % NUM_BUF
        prev = (j - 1) % NUM_BUF
        mbarrier.wait(k_ready.index(buf), (j // NUM_BUF) & 1)
        s = warpgroup_mma(q, k_smem.index(buf).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // NUM_BUF) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))  # groups retire in order: S_j is done
        mbarrier.arrive(kv_free.index(buf))
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        mbarrier.arrive(kv_free.index(NUM_BUF + prev))
        p_op = gl.convert_layout(s.to(gl.float16), p_layout)
    last = (num_tiles - 1) % NUM_BUF
    mbarrier.wait(v_ready.index(last), ((num_tiles - 1) // NUM_BUF) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    mbarrier.arrive(kv_free.index(NUM_BUF + last))
    mbarrier.wait(q_ready.index(CONSUMER), 0)
    q.store(acc.to(gl.float16))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row + CONSUMER * BLOCK_M, 0], q)
    tma.store_wait(0)


@gluon.jit
def _ws_forward_kernel(q_desc, k_desc, v_desc, o_desc, seqlen_q, seqlen_k, NUM_BUF: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    head = gl.program_id(1)
    q_row = head * seqlen_q + gl.program_id(0) * 2 * BLOCK_M
    k_row = head * seqlen_k
    num_tiles = gl.cdiv(seqlen_k, BLOCK_N)  # arguments only: recomputed, not captured
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape,
                                       q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_BUF] + k_desc.block_type.shape,
                                       k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_BUF] + v_desc.block_type.shape,
                                       v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [2 * NUM_BUF, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(q_ready.index(c), count=1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_free.index(i), count=2)
        mbarrier.init(kv_free.index(NUM_BUF + i), count=2)
    gl.warp_specialize([(_forward_attend, (o_desc, q_smem, k_smem, v_smem, q_ready, k_ready,
                                           v_ready, kv_free, q_row, num_tiles, 0, BLOCK_M,
                                           BLOCK_N, HEAD_DIM, NUM_BUF)),
                        (_forward_attend, (o_desc, q_smem, k_smem, v_smem, q_ready, k_ready,
                                           v_ready, kv_free, q_row, num_tiles, 1, BLOCK_M,
                                           BLOCK_N, HEAD_DIM, NUM_BUF)),
                        (_forward_load, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready,
                                         k_ready, v_ready, kv_free, q_row, k_row, num_tiles,
                                         BLOCK_M, NUM_BUF))],
                       [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


KERNELS = {"bare": _ws_bare_kernel, "wide": _ws_wide_kernel, "captures": _ws_captures_kernel,
           "smem": _ws_smem_kernel, "tma": _ws_tma_kernel, "regs": _ws_regs_kernel,
           "ring": _ws_ring_kernel, "ring_tma_store": _ws_ring_tma_store_kernel,
           "forward": _ws_forward_kernel}


@dataclasses.dataclass
class Problem:
    """A variant's launch, kernel[grid](*args, **kwargs, num_warps=4), which writes `out`; it
    must equal `expected` exactly."""

    kernel: object
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict
    out: torch.Tensor
    expected: torch.Tensor


def _signs(*shape: int, seed: int, device: str) -> torch.Tensor:
    """fp16 of -1, 0 and 1: the matmuls' products and sums are small integers, exact in fp16
    and fp32 in any order, so the kernels' results equal the reference's exactly."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-1, 2, shape, generator=generator).to(torch.float16).to(device)


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float16)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def problem(variant: str, device: str) -> Problem:
    """`variant`'s inputs on `device`, its launch and the result it must give."""
    budgets = dict(CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS)
    if variant in ("ring", "ring_tma_store"):
        x = _signs(PROGRAMS * 2 * BLOCK_M, BLOCK_K, seed=0, device=device)
        tiles = _signs(PROGRAMS * ROUNDS * BLOCK_K, RING_COLS, seed=1, device=device)
        expected = (x.double().view(PROGRAMS, 2 * BLOCK_M, BLOCK_K)
                    @ tiles.double().view(PROGRAMS, ROUNDS, BLOCK_K, RING_COLS).sum(1))
        out = torch.full((PROGRAMS * 2 * BLOCK_M, RING_COLS), float("nan"), dtype=torch.float16,
                         device=device)
        rounds = torch.tensor([ROUNDS], dtype=torch.int32, device=device)
        tile_desc = _descriptor(tiles, [BLOCK_K, RING_COLS])
        sizes = dict(BLOCK_M=BLOCK_M, COLS=RING_COLS, NUM_BUF=NUM_BUF, **budgets)
        if variant == "ring":
            args = (x, tile_desc, out, rounds)
        else:
            args = (x, tile_desc, _descriptor(out, [BLOCK_M, RING_COLS]), rounds)
        return Problem(KERNELS[variant], (PROGRAMS,), args, sizes, out,
                       expected.view_as(out).to(torch.float16))
    if variant == "forward":
        seqlen_q, seqlen_k = PROGRAMS * 2 * BLOCK_M, FORWARD_ROUNDS * FORWARD_BLOCK_N
        q = _signs(HEADS, seqlen_q, HEAD_DIM, seed=2, device=device)
        k = _signs(HEADS, seqlen_k, HEAD_DIM, seed=3, device=device)
        v = _signs(HEADS, seqlen_k, HEAD_DIM, seed=4, device=device)
        # P = Q K^T is exact in fp16 (|entries| <= HEAD_DIM), as the kernel's operand
        expected = (q.double() @ k.double().transpose(1, 2)) @ v.double()
        out = torch.full_like(q, float("nan"))
        q_desc, o_desc = (_descriptor(t.view(-1, HEAD_DIM), [BLOCK_M, HEAD_DIM]) for t in (q, out))
        k_desc, v_desc = (_descriptor(t.view(-1, HEAD_DIM), [FORWARD_BLOCK_N, HEAD_DIM])
                          for t in (k, v))
        return Problem(_ws_forward_kernel, (PROGRAMS, HEADS),
                       (q_desc, k_desc, v_desc, o_desc, seqlen_q, seqlen_k),
                       dict(NUM_BUF=FORWARD_NUM_BUF, **budgets), out, expected.to(torch.float16))
    src, dst = inputs(device)
    rows_per_program = ROUNDS * TILE_ROWS
    copy = dict(COLS=COLS)
    if variant in ("bare", "wide"):
        args = (src, dst, rows_per_program)
    elif variant == "regs":
        args, copy = (src, dst, rows_per_program), dict(copy, **budgets)
    elif variant == "captures":
        args = (src, dst, torch.tensor([rows_per_program], dtype=torch.int32, device=device))
    elif variant in ("smem", "tma"):
        rounds = torch.tensor([ROUNDS], dtype=torch.int32, device=device)
        copy = dict(TILE_ROWS=TILE_ROWS, COLS=COLS, NUM_BUF=NUM_BUF)
        args = (src if variant == "smem" else _descriptor(src, [TILE_ROWS, COLS]), dst, rounds)
    else:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    return Problem(KERNELS[variant], (PROGRAMS,), args, copy, dst, src)


def inputs(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """src (distinct values, exact in fp16) and a dst of NaNs."""
    rows = PROGRAMS * ROUNDS * TILE_ROWS
    src = (torch.arange(rows * COLS, device=device) % 2039).to(torch.float16).view(rows, COLS)
    return src, torch.full_like(src, float("nan"))


def run(variant: str) -> None:
    """Launch `variant` on the current CUDA device (sm90) and check its output."""
    launch = problem(variant, "cuda")
    launch.kernel[launch.grid](*launch.args, **launch.kwargs, num_warps=4)
    torch.cuda.synchronize()
    torch.testing.assert_close(launch.out, launch.expected, rtol=0, atol=0,
                               msg=f"{variant}: the output differs from the reference")


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
    launch = problem(variant, "cpu")
    kernel, kwargs = launch.kernel, dict(launch.kwargs, num_warps=4)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                              specialization, options)
    compiled = triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    return {stage: compiled.asm[stage] for stage in ("ttgir", "llir", "ptx")}


_LOC = re.compile(r"^\s*\.loc\s+\d+\s+(\d+)\s+\d+\s*(?://\s*(.*))?$")
_SHARED_ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:ld|st|atom|red)\.shared[\w.:]*|"
                            r"(?:ld|st)matrix\.[\w.:]*\.shared[\w.:]*)\s+(.*?);")


def shared_accesses(ptx: str) -> list[tuple[str, str, str]]:
    """The generic shared-memory accesses of a PTX listing (ld / st / atom / red .shared, and
    ldmatrix / stmatrix: the ones racecheck sees as plain reads and writes; TMA, wgmma and
    mbarrier operations are not among them), each as (source position with its inlining chain,
    as the .loc comment gives it; instruction; operands), in program order."""
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
