"""Forward and backward registered as torch custom ops (with fake implementations), joined by
torch.library.register_autograd: traceable by torch.compile(fullgraph=True)."""
from __future__ import annotations

import torch

from .kernels.bwd import attention_backward
from .kernels.elementwise import Elementwise
from .kernels.fwd import attention_forward
from .kernels.schedule import KernelArgs, Schedule

# An explicit schedule crosses the op boundary as its 12 tensors and 6 tile sizes (empty lists:
# implicit schedule); mask and bias as optional tensors.


def _rebuild(schedule: list[torch.Tensor], tiles: list[int], attn_mask, attn_bias, num_heads):
    sched = Schedule.from_parts(schedule, tiles) if schedule else None
    mask = Elementwise.of(attn_mask, num_heads) if attn_mask is not None else None
    bias = Elementwise.of(attn_bias, num_heads) if attn_bias is not None else None
    return sched, mask, bias


@torch.library.custom_op("omniattn::attention_fwd", mutates_args=())
def attention_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
    attn_bias: torch.Tensor | None, softmax_scale: float, softcap: float, window_left: int,
    window_right: int, schedule: list[torch.Tensor], tiles: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    args = KernelArgs(softmax_scale, softcap, window_left, window_right)
    sched, mask, bias = _rebuild(schedule, tiles, attn_mask, attn_bias, q.shape[2])
    return attention_forward(q, k, v, args, sched.forward if sched is not None else None,
                             mask=mask, bias=bias)


@attention_fwd_op.register_fake
def _(q, k, v, attn_mask, attn_bias, softmax_scale, softcap, window_left, window_right, schedule,
      tiles):
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return torch.empty_like(q), lse


@torch.library.custom_op("omniattn::attention_bwd", mutates_args=())
def attention_bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dlse: torch.Tensor | None, attn_mask: torch.Tensor | None,
    attn_bias: torch.Tensor | None, bias_grad: bool, softmax_scale: float, softcap: float,
    window_left: int, window_right: int, schedule: list[torch.Tensor], tiles: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dbias); dbias is an empty tensor unless bias_grad."""
    args = KernelArgs(softmax_scale, softcap, window_left, window_right)
    sched, mask, bias = _rebuild(schedule, tiles, attn_mask, attn_bias, q.shape[2])
    dq, dk, dv, dbias = attention_backward(dout, q, k, v, out, lse, args, sched, mask=mask,
                                           bias=bias, bias_grad=bias_grad, dlse=dlse)
    return dq, dk, dv, dbias if dbias is not None else q.new_empty(0)


@attention_bwd_op.register_fake
def _(dout, q, k, v, out, lse, dlse, attn_mask, attn_bias, bias_grad, softmax_scale, softcap,
      window_left, window_right, schedule, tiles):
    dbias = torch.empty_like(attn_bias) if bias_grad else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias


def _setup_context(ctx, inputs, output):
    (q, k, v, attn_mask, attn_bias, softmax_scale, softcap, window_left, window_right, schedule,
     tiles) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, attn_bias, *schedule)
    ctx.scalars = (softmax_scale, softcap, window_left, window_right)
    ctx.tiles = tiles


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, attn_mask, attn_bias, *schedule = ctx.saved_tensors
    bias_grad = attn_bias is not None and ctx.needs_input_grad[4]
    dq, dk, dv, dbias = attention_bwd_op(dout, q, k, v, out, lse, dlse, attn_mask, attn_bias,
                                         bias_grad, *ctx.scalars, schedule, ctx.tiles)
    # gradients mirror the inputs' structure: a list per tensor list; an int list is one leaf
    # (an empty one a list)
    return (dq, dk, dv, None, dbias if bias_grad else None, None, None, None, None,
            [None] * len(schedule), None if ctx.tiles else [])


attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def triton_attention(q, k, v, args: KernelArgs, schedule: Schedule | None = None,
                     attn_mask: torch.Tensor | None = None, attn_bias: torch.Tensor | None = None):
    """Differentiable kernel attention: returns (out, lse); attn_bias gets a gradient too."""
    tensors, tiles = (schedule.tensors(), schedule.tiles()) if schedule is not None else ([], [])
    return attention_fwd_op(q, k, v, attn_mask, attn_bias, args.softmax_scale, args.softcap,
                            args.window_left, args.window_right, tensors, tiles)
