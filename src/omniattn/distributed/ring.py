"""Ring attention: each rank keeps its query rows; the K/V shards (with their key bias) travel
around the ring, one hop per step, the next hop in flight while this one is computed; each
step's pieces (pieces.py) are merged into the running output by their log-sum-exp. The
backward passes K/V around again, recomputes each piece's softmax and sends the key-side
gradients (dK, dV, dbias) along behind them, so that after P hops they are back with their
owner."""
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
        # D of the merged softmax: rowsum(dout * out) (B, H, S/P), what each piece's share of
        # the gradient is measured against
        total = (dout.float() * out.float()).sum(-1).transpose(1, 2)
        # rows that see no key: exp(lse_p - 0) = 0 below
        finite_lse = lse.masked_fill(lse == float("-inf"), 0.0)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        ring = RingExchange(schedule.group) if schedule.world > 1 else None
        held = _key_side(k, v, attn_bias)
        grads_in = None  # the key-side gradients of the block held, from the ranks before
        for step, step_pieces in enumerate(schedule.steps):
            transfer = ring.start(held) if step < schedule.world - 1 else None
            grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device)
                     for t in held[:3 if bias_grad else 2]]
            for piece in step_pieces:
                _piece_gradients(piece, q, held, row_lens, options, dout, dlse, total,
                                 finite_lse, dq, grads)
            if grads_in is not None:
                for grad, arrived in zip(grads, grads_in.wait()):
                    grad.add_(arrived)
            if ring is not None:
                grads_in = ring.start(grads)  # to the next rank; the previous rank's arrive
            if transfer is not None:
                held = transfer.wait()
        key_grads = grads_in.wait() if grads_in is not None else grads
        dk, dv = key_grads[0].to(k.dtype), key_grads[1].to(v.dtype)
        dbias = key_grads[2].to(attn_bias.dtype) if bias_grad else None
        return dq.to(q.dtype), dk, dv, dbias, None, None, None


def _piece_gradients(piece: Piece, q, held, row_lens, options, dout, dlse, total, finite_lse,
                     dq, grads) -> None:
    """Adds one piece's share of the gradients to dq (this rank's rows) and grads (dK, dV[,
    dbias] of the block held), float32, in place. The piece's softmax is recomputed: its
    probabilities are exp(lse_p - lse) times the merged softmax's, so its output gets that
    share of dout and its lse the gradient w (dout . out_p - dout . out) (+ w dlse)."""
    (i0, i1), (j0, j1) = piece.rows, piece.keys
    leaves = [q[:, i0:i1].detach().requires_grad_(),
              *(t[..., j0:j1, :, :].detach().requires_grad_() for t in held[:2])]
    bias = None
    if len(grads) == 3:
        bias = held[2].detach().requires_grad_()
        leaves.append(bias)
    elif len(held) == 3:
        bias = held[2]
    shifted = Piece((0, i1 - i0), (0, j1 - j0), piece.key_position, piece.causal, piece.window,
                    piece.block_mask)
    lens = row_lens[:, i0:i1] if row_lens is not None else None
    with torch.enable_grad():
        piece_out, piece_lse = shifted.run(leaves[0], leaves[1], leaves[2],
                                           bias[..., j0:j1] if bias is not None else None,
                                           lens, options)
    share = torch.exp(piece_lse - finite_lse[..., i0:i1])  # (B, H, rows)
    rows_dout = dout[:, i0:i1]
    own = (rows_dout.float() * piece_out.float()).sum(-1).transpose(1, 2)
    piece_dlse = share * (own - total[..., i0:i1])
    if dlse is not None:
        piece_dlse = piece_dlse + share * dlse[..., i0:i1]
    piece_dout = (rows_dout.float() * share.transpose(1, 2).unsqueeze(-1)).to(piece_out.dtype)
    found = torch.autograd.grad((piece_out, piece_lse), leaves, (piece_dout, piece_dlse))
    dq[:, i0:i1] += found[0]
    grads[0][:, j0:j1] += found[1]
    grads[1][:, j0:j1] += found[2]
    if len(found) == 4:
        grads[2] += found[3]
