"""Ring attention: each rank keeps its query rows; the K/V shards (with their key bias) travel
around the ring, one hop per step, the next hop in flight while this one is computed; each
step's pieces (pieces.py) are merged into the running output by their log-sum-exp. The
backward passes K/V around again; each piece's gradients come from the merged output and lse
of its rows (its probabilities exp(s - lse), no forward recomputed), and the key-side
gradients (dK, dV, dbias) travel along behind the K/V, so that after P hops they are back with
their owner."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .comm import RingExchange
from .pieces import Piece, merge


class RingSchedule(NamedTuple):
    """What a ring call computes on this rank: the pieces of each step (step t holds the K/V of
    rank (rank - t) mod P), over `group` of `world` ranks."""

    steps: list[list[Piece]]
    group: object
    world: int


def ring_attention(q, k, v, attn_bias, row_lens, schedule: RingSchedule, options: dict):
    """(out (B, S/P, H, D), lse (B, H, S/P) float32) of this rank's rows; q, k, v, attn_bias
    this rank's shards, row_lens (B, S/P) | None."""
    return _RingAttention.apply(q, k, v, attn_bias, row_lens, schedule, options)


def _key_side(k, v, attn_bias) -> list[torch.Tensor]:
    return [k, v] if attn_bias is None else [k, v, attn_bias]


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, attn_bias, row_lens, schedule, options):
        batch, rows, heads, _ = q.shape
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((batch, heads, rows), float("-inf"), dtype=torch.float32,
                         device=q.device)
        ring = RingExchange(schedule.group) if schedule.world > 1 else None
        held = _key_side(k, v, attn_bias)
        for step, step_pieces in enumerate(schedule.steps):
            transfer = ring.start(held) if step < schedule.world - 1 else None
            bias = held[2] if attn_bias is not None else None
            for piece in step_pieces:
                piece_out, piece_lse = piece.run(q, held[0], held[1], bias, row_lens, options)
                merge(out, lse, piece.rows, piece_out, piece_lse)
            if transfer is not None:
                held = transfer.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, attn_bias, row_lens, out, lse)
        ctx.schedule, ctx.options = schedule, options
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, attn_bias, row_lens, out, lse = ctx.saved_tensors
        schedule, options = ctx.schedule, ctx.options
        if dout is None:
            dout = torch.zeros_like(out)
        bias_grad = attn_bias is not None and ctx.needs_input_grad[3]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        ring = RingExchange(schedule.group) if schedule.world > 1 else None
        held = _key_side(k, v, attn_bias)
        grads_in = None  # the key-side gradients of the block held, from the ranks before
        for step, step_pieces in enumerate(schedule.steps):
            transfer = ring.start(held) if step < schedule.world - 1 else None
            grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device)
                     for t in held[:3 if bias_grad else 2]]
            bias = held[2].detach().requires_grad_(bias_grad) if attn_bias is not None else None
            for piece in step_pieces:
                found = piece.gradients(dout, out, lse, dlse, q, held[0], held[1], bias,
                                        row_lens, options)
                (i0, i1), (j0, j1) = piece.rows, piece.keys
                dq[:, i0:i1] += found[0]
                grads[0][:, j0:j1] += found[1]
                grads[1][:, j0:j1] += found[2]
                if bias_grad:
                    grads[2][..., j0:j1] += found[3]
            if grads_in is not None:
                for grad, arrived in zip(grads, grads_in.wait()):
                    grad.add_(arrived)
            if step == schedule.world - 1:
                # complete sums now, for their owner: the last hop (the one not overlapped with
                # compute) carries them in their own dtype (bf16: half the bytes of float32)
                grads = [grad.to(t.dtype) for grad, t in zip(grads, held)]
            if ring is not None:
                grads_in = ring.start(grads)  # to the next rank; the previous rank's arrive
            if transfer is not None:
                held = transfer.wait()
        dk, dv, *dbias = grads_in.wait() if grads_in is not None else grads
        return dq.to(q.dtype), dk, dv, dbias[0] if bias_grad else None, None, None, None
