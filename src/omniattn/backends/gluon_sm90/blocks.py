"""Pieces the Gluon kernels (fwd_hopper.py, bwd_hopper.py, bwd_hopper_wide.py) share: TMA tile loads
and descriptors, producer rings, list walkers, hand-overs, rows gathered / scattered in length
order, packed flat views, mask / bias forms (`ElementForm`), the window predicate, whether the
kernels take a call."""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...kernels.common import sequence_bounds
from ...kernels.elementwise import Elementwise
from ...kernels.schedule import KernelArgs
from ...kernels.sequences import tma_compatible
from ...runtime.switches import compute_capability, gluon_enabled, interpreting
from .configs import hopper_backward_config, hopper_forward_config


@gluon.jit
def drop_outside_window(x, rows, keys, diag, diag_left, key_limit, fill, HAS_LEFT: gl.constexpr,
                        HAS_RIGHT: gl.constexpr, LIMIT: gl.constexpr, KEYS_FIRST: gl.constexpr):
    """x with `fill` at the keys outside each row's window: `predicate.RelativePredicate` on
    the device, row i seeing key j iff i + diag_left <= j <= i + diag (diag = Sk - Sq + right,
    diag_left = Sk - Sq - left; HAS_LEFT / HAS_RIGHT: the bounds there are). x is [BM, BN] over
    rows [BM] and keys [BN] in its slice layouts, [BN, BM] with KEYS_FIRST. LIMIT (rows first
    only): keys at or past key_limit (Sk, or [BM] per-row key ends) go in the right bound's
    select. One select per bound: ANDed first, the booleans stayed in registers."""
    if LIMIT:
        key_end = gl.full_like(rows, 0) + key_limit
        if HAS_RIGHT:
            key_end = gl.minimum(key_end, rows + diag + 1)
        x = gl.where(keys[None, :] < key_end[:, None], x, fill)
    elif HAS_RIGHT:
        if KEYS_FIRST:
            x = gl.where(keys[:, None] <= rows[None, :] + diag, x, fill)
        else:
            x = gl.where(keys[None, :] <= rows[:, None] + diag, x, fill)
    if HAS_LEFT:
        if KEYS_FIRST:
            x = gl.where(keys[:, None] >= rows[None, :] + diag_left, x, fill)
        else:
            x = gl.where(keys[None, :] >= (rows + diag_left)[:, None], x, fill)
    return x


@gluon.jit
def copy_tile(desc, off_b, row, head, seq_start, ready, dst, HEAD_DIM: gl.constexpr,
               FLAT: gl.constexpr):
    """TMA copy of the tile at (batch, first row, head) into dst; it arrives on `ready`, whose
    expected bytes the caller set. FLAT: the batch's rows start at seq_start of the 2-d view."""
    if FLAT:
        tma.async_copy_global_to_shared(desc, [seq_start + row, head * HEAD_DIM], ready, dst)
    else:
        tma.async_copy_global_to_shared(desc, [off_b, row, head, 0], ready, dst)


@gluon.jit
def load_tile(desc, off_b, row, head, seq_start, ready, dst, HEAD_DIM: gl.constexpr,
               FLAT: gl.constexpr):
    """`copy_tile` as the only copy arriving on `ready`."""
    mbarrier.expect(ready, desc.block_type.nbytes)
    copy_tile(desc, off_b, row, head, seq_start, ready, dst, HEAD_DIM, FLAT)


@gluon.jit
def producer_tiles(desc, NUM_BUF: gl.constexpr, BY_TMA: gl.constexpr, CONSUMERS: gl.constexpr = 2):
    """Shared memory for the mask / bias tiles a producer copies through `desc` (BY_TMA): one
    box per consumer and buffer, index CONSUMERS * buf + c; without BY_TMA a small stand-in, not
    read."""
    if BY_TMA:
        smem = gl.allocate_shared_memory(desc.dtype, [NUM_BUF * CONSUMERS] + desc.block_type.shape,
                                         desc.layout)
    else:
        smem = gl.allocate_shared_memory(gl.uint8, [2, 16, 16],
                                         gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
    return smem


@gluon.jit
def tile_at(step, num_part, part_list, full_list, EXPLICIT: gl.constexpr):
    """Key tile of a program's step: explicit schedules walk the PARTIAL list, then the FULL
    one; implicit ones tiles 0, 1, ..."""
    if EXPLICIT:
        if step < num_part:
            tile = gl.load(part_list + step)
        else:
            tile = gl.load(full_list + (step - num_part))
    else:
        tile = step
    return tile


@gluon.jit
def flat_view_bounds(CuSeqlensQ, CuSeqlensK, off_b, seqlen_q, seqlen_k, diag_offset,
                     PACKED: gl.constexpr):
    """(first query row, Sq, first key row, Sk, diag offset) of batch off_b in the flat views:
    a padded batch's rows from off_b * S with the launch's lengths; packed sequences' from
    cu_seqlens (`common.sequence_bounds`), each sequence's diagonal at its own bottom right."""
    if PACKED:
        q_start, seqlen_q, k_start, seqlen_k = sequence_bounds(CuSeqlensQ, CuSeqlensK, off_b,
                                                               seqlen_q, seqlen_k, True)
        diag_offset = seqlen_k - seqlen_q
    else:
        q_start = off_b * seqlen_q
        k_start = off_b * seqlen_k
    return q_start, seqlen_q, k_start, seqlen_k, diag_offset


@gluon.jit
def hand_over(slot, value):
    """Producer (one warp): value into a one-int32 shared-memory slot, stored before the barrier
    arrival that tells the consumers the step's tiles are there (`handed` reads it after that
    wait). A consumer's own load of a list entry stalls it: the wgmma fence of its next matmul
    waits for the load (`_listed_tiles` in bwd_hopper.py has the backward's number). Forward,
    H100, issue #4's top-k mask + full bias: kernel 0.421 ms handed over against 0.433
    (docs/perf/forward.md, "The next key tile from the producer"). Every lane stores the value;
    the warp barrier orders lanes 1-31's stores before lane 0's arrival too (`bar.warp.sync`)."""
    slot.store(gl.full([1], value, gl.int32, gl.BlockedLayout([1], [32], [1], [0])))
    gl.thread_barrier()


@gluon.jit
def handed(slot):
    """Consumer warpgroup: the value `hand_over` left in slot, once its barrier is waited for."""
    return gl.max(slot.load(gl.BlockedLayout([1], [32], [4], [0])), 0)


# whole rows, 8 consecutive elements (16 bytes) per thread and access
ROWS_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))


@gluon.jit
def caller_rows(rows_base, stride_m, order_rows, row0, seqlen_q, BLOCK_M: gl.constexpr,
                 HEAD_DIM: gl.constexpr, ORDERED: gl.constexpr = True):
    """(pointers [BM, D], rows inside Sq [BM]) of rows [row0, row0 + BM) of the length order at
    their caller rows order_rows[r] of rows_base (not ORDERED: at rows row0 + r), in
    `ROWS_LAYOUT`."""
    local = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ROWS_LAYOUT))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ROWS_LAYOUT))
    inside = row0 + local < seqlen_q
    if ORDERED:
        callers = gl.load(order_rows + row0 + local, mask=inside, other=0)
    else:
        callers = row0 + local
    return rows_base + callers.to(gl.int64)[:, None] * stride_m + cols[None, :], inside


@gluon.jit
def gather_rows(rows_base, stride_m, order_rows, row0, seqlen_q, dst, BLOCK_M: gl.constexpr,
                 HEAD_DIM: gl.constexpr):
    """dst ([BM, D] in shared memory) <- rows [row0, row0 + BM) of the length order, each read
    from its caller row order_rows[r] of rows_base (rows past Sq: 0), ready for a wgmma."""
    ptrs, inside = caller_rows(rows_base, stride_m, order_rows, row0, seqlen_q, BLOCK_M,
                                HEAD_DIM)
    dst.store(gl.load(ptrs, mask=inside[:, None], other=0.0))
    fence_async_shared()


@gluon.jit
def scatter_rows(src, rows_base, stride_m, order_rows, row0, seqlen_q, BLOCK_M: gl.constexpr,
                  HEAD_DIM: gl.constexpr, ORDERED: gl.constexpr = True):
    """`gather_rows` reversed: src's rows ([BM, D] in shared memory) to their caller rows (not
    ORDERED: to rows row0 + r, those inside Sq)."""
    ptrs, inside = caller_rows(rows_base, stride_m, order_rows, row0, seqlen_q, BLOCK_M,
                                HEAD_DIM, ORDERED)
    gl.store(ptrs, src.load(ROWS_LAYOUT), mask=inside[:, None])


def device_refusal(device: torch.device) -> str | None:
    """Why no Gluon kernel runs on `device` (None: an sm90 GPU, Gluon not turned off)."""
    if not gluon_enabled():
        return "turned off by OMNIATTN_GLUON=0"
    if interpreting():
        return "the Triton interpreter runs Triton kernels only"
    if device.type != "cuda":
        return f"q is on {device}, not a CUDA GPU"
    major, minor = compute_capability(device)
    if major != 9:
        return f"the GPU is sm{major}{minor}; the Gluon kernels are built for Hopper (sm90)"
    return None


def gluon_refusal(q: torch.Tensor, args: KernelArgs, full_bias: torch.Tensor | None = None,
                  backward: bool = False, plain: bool = False) -> str | None:
    """Why the Gluon forward (backward: the Gluon backward) cannot take calls on q's device,
    dtype and head dim with these arguments, or None where it can: sm90, bf16 / fp16, a head
    dim it has tiles for (plain: see `hopper_forward_config`), no softcap; a bias spanning
    (Sq, Sk) (full_bias) only with 2-byte elements that `tiles_by_tma` accepts; not turned off
    by OMNIATTN_GLUON=0."""
    refusal = device_refusal(q.device)
    if refusal is not None:
        return refusal
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"{q.dtype} inputs; the Gluon kernels take bf16 / fp16"
    if args.softcap != 0:
        return "softcap (the Gluon kernels have no tanh step)"
    if full_bias is not None and full_bias.element_size() != 2:
        return f"a bias spanning (Sq, Sk) in {full_bias.dtype} (its TMA tiles take 2-byte elements)"
    if full_bias is not None and not tiles_by_tma(full_bias):
        return "a bias spanning (Sq, Sk) that TMA cannot read (not contiguous or not 16-byte " \
            "aligned rows)"
    config = hopper_backward_config(q.shape[-1]) if backward \
        else hopper_forward_config(q.shape[-1], full_bias is not None, plain)
    if config is None:
        what = " with a bias spanning (Sq, Sk)" if full_bias is not None and not backward else ""
        return f"no Gluon {'backward' if backward else 'forward'} tiles for head dim " \
            f"{q.shape[-1]}{what}"
    return None


def flat_rows(t: torch.Tensor) -> bool:
    """(B, S, H, D) with heads and rows packed: viewable as (B * S, H * D); packed sequences'
    (total, H, D) with heads packed: as (total, H * D)."""
    if t.dim() == 3:
        return t.stride(1) == t.shape[2]
    batch, seqlen, heads, dim = t.shape
    return t.stride(2) == dim and t.stride(0) == seqlen * t.stride(1)


GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32,
              torch.uint8: gl.uint8}


@functools.lru_cache(maxsize=None)
def shared_layout(block: tuple[int, ...], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    # made once: building the layout was a quarter of the launch's host time
    return gl.NVMMASharedLayout.get_default_for(list(block), GL_DTYPES[dtype])


def tensor_descriptor(base: torch.Tensor, shape: list[int], strides: list[int],
                      block: tuple[int, ...], layout: gl.NVMMASharedLayout) -> TensorDescriptor:
    """A host TensorDescriptor without the dataclass's validation (3.6 against 14.6 us of host
    time each on a CI CPU, and a backward passes eight): callers pass non-empty tensors that
    `tma_compatible` accepted, blocks of powers of two."""
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.shape, desc.strides = base, shape, strides
    desc.block_shape, desc.layout, desc.padding = list(block), layout, "zero"
    return desc


def descriptor(t: torch.Tensor, block_rows: int, flat: bool,
                block_cols: int | None = None) -> TensorDescriptor:
    """4-d over (B, S, H, D): tiles stop at each sequence's end (TMA fills 0, drops stores);
    flat: 2-d over (B * S, H * D), for launches whose tiles never cross a sequence's end (H100
    dense 16k forward 3.47 ms against 3.82 through 4-d descriptors), or over
    packed sequences' (total, H, D) as (total, H * D), whose tiles do (the kernels drop what
    they read of the next sequence and store none of its rows). block_cols: of the head dim
    (all of it by default)."""
    if t.dim() == 3:
        t = t.unsqueeze(0)
    batch, seqlen, heads, dim = t.shape
    block_cols = dim if block_cols is None else block_cols
    if flat:  # rows packed (`flat_launch`): the view (B * S, H * D) without making it
        block = (block_rows, block_cols)
        shape, strides = [batch * seqlen, heads * dim], [t.stride(1), 1]
    else:
        block = (1, block_rows, 1, block_cols)
        shape, strides = list(t.shape), list(t.stride())
    return tensor_descriptor(t, shape, strides, block, shared_layout(block, t.dtype))


def tiles_by_tma(t: torch.Tensor) -> bool:
    """Whether a (B|1, H|Hk|1, Sq, Sk) mask or bias can come by TMA: contiguous, its rows
    16-byte aligned."""
    return t.is_contiguous() and tma_compatible(t)


def by_tma(elementwise: Elementwise | None, block_rows: int, block_cols: int,
           element_size: int):
    """(descriptor, rows per batch) of a mask (element_size 1) or bias (2) that a producer loads
    by TMA in [block_rows, block_cols] boxes: spanning (Sq, Sk), `tiles_by_tma`, seen as
    (B|1 * Hm * Sq, Sk); None where the consumers load it themselves (its broadcast forms are a
    row or a column per tile; wider elements' buffers would not fit in shared memory)."""
    if elementwise is None or not elementwise.spans_queries_and_keys:
        return None
    t = elementwise.tensor
    if t.element_size() != element_size or not tiles_by_tma(t):
        return None
    rows = t.view(-1, t.shape[-1])
    block = (block_rows, block_cols)
    dtype = torch.uint8 if element_size == 1 else t.dtype  # bool masks: bytes
    desc = tensor_descriptor(rows, list(rows.shape), list(rows.stride()), block,
                             shared_layout(block, dtype))
    return desc, t.shape[1] * t.shape[2] if t.shape[0] > 1 else 0


class ElementForm(NamedTuple):
    """How a Gluon kernel takes a mask or bias: a constexpr whose fields the kernels read by name
    (`MASK_FORM.tma`; a field is a Python bool there, so not an item of a tuple built in a
    kernel: pass the form)."""
    given: bool
    tma: bool  # its tiles come from the producer, by TMA
    rows_shared: bool  # one row for every query
    cols_shared: bool  # one column for every key

    @staticmethod
    def of(elementwise: Elementwise | None, tma: bool = False) -> "ElementForm":
        if elementwise is None:
            return ElementForm(False, False, False, False)
        return ElementForm(True, tma, elementwise.rows_shared, elementwise.cols_shared)


def flat_launch(seqlen_q: int, seqlen_k: int, block_m: int, block_n: int,
                *tensors: torch.Tensor) -> bool:
    """Whether 2-d descriptors serve: the lengths fill whole tiles and every tensor's rows are
    packed (B, S, H, D)."""
    return seqlen_q % block_m == 0 and seqlen_k % block_n == 0 \
        and all(flat_rows(t) for t in tensors)
