"""Forward and backward registered as torch custom ops (with fake implementations), joined by
torch.library.register_autograd: traceable by torch.compile(fullgraph=True)."""
from __future__ import annotations

import torch

from .kernels.bwd import attention_backward
from .kernels.fwd import attention_forward
from .kernels.schedule import KernelArgs, Schedule

# the explicit schedule crosses the op boundary as its 8 tensors (empty list = implicit schedule)
_SCHEDULE_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _schedule_tensors(schedule: Schedule | None) -> list[torch.Tensor]:
    return [] if schedule is None else [getattr(schedule, f) for f in _SCHEDULE_FIELDS]


def _rebuild_schedule(tensors: list[torch.Tensor], block_m: int, block_n: int) -> Schedule | None:
    if not tensors:
        return None
    return Schedule(block_m, block_n, *tensors)


@torch.library.custom_op("omniattn::attention_fwd", mutates_args=())
def attention_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, softcap: float,
    window_left: int, window_right: int, schedule: list[torch.Tensor], block_m: int, block_n: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    args = KernelArgs(softmax_scale, softcap, window_left, window_right)
    return attention_forward(q, k, v, args, _rebuild_schedule(schedule, block_m, block_n))


@attention_fwd_op.register_fake
def _(q, k, v, softmax_scale, softcap, window_left, window_right, schedule, block_m, block_n):
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return torch.empty_like(q), lse


@torch.library.custom_op("omniattn::attention_bwd", mutates_args=())
def attention_bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dlse: torch.Tensor | None, softmax_scale: float, softcap: float,
    window_left: int, window_right: int, schedule: list[torch.Tensor], block_m: int, block_n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    args = KernelArgs(softmax_scale, softcap, window_left, window_right)
    return attention_backward(dout, q, k, v, out, lse, args,
                              _rebuild_schedule(schedule, block_m, block_n), dlse=dlse)


@attention_bwd_op.register_fake
def _(dout, q, k, v, out, lse, dlse, softmax_scale, softcap, window_left, window_right, schedule,
      block_m, block_n):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, softcap, window_left, window_right, schedule, block_m, block_n = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *schedule)
    ctx.scalars = (softmax_scale, softcap, window_left, window_right)
    ctx.blocks = (block_m, block_n)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *schedule = ctx.saved_tensors
    dq, dk, dv = attention_bwd_op(dout, q, k, v, out, lse, dlse, *ctx.scalars, schedule,
                                  *ctx.blocks)
    # the schedule list needs a matching list of (absent) gradients
    return dq, dk, dv, None, None, None, None, [None] * len(schedule), None, None


attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def triton_attention(q, k, v, args: KernelArgs, schedule: Schedule | None = None):
    """Differentiable kernel attention: returns (out, lse)."""
    block_m, block_n = (schedule.block_m, schedule.block_n) if schedule is not None else (0, 0)
    return attention_fwd_op(q, k, v, args.softmax_scale, args.softcap, args.window_left,
                            args.window_right, _schedule_tensors(schedule), block_m, block_n)
