"""Ring attention: each rank keeps its query rows; at step t it computes with the K/V shard (and
key bias) of the rank t behind, received while the step before is computed, and merges each
step's pieces (pieces.py) into the running output by their log-sum-exp. Only the shards that
some row of the receiving rank sees travel (visibility.py): a step at which no rank needs the
shard of the rank that far behind is never taken, and a rank that neither sends nor receives at
a step skips it. The backward receives the same shards again; each piece's gradients come from
the merged output and lse of its rows (its probabilities exp(s - lse), no forward recomputed),
and the key-side gradients (dK, dV, dbias) of a shard go straight back to its owner as float32
partial sums, which the owner adds to its own."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .comm import RingExchange
from .pieces import Piece, merge


class RingSchedule(NamedTuple):
    """What a ring call computes and moves on this rank: the pieces of each step (step t holds
    the K/V of rank (rank - t) mod P; none where this rank does not receive them) and
    needs[r][s] (P x P, the same on every rank): rank r's rows see a key of rank s, so rank s's
    K/V go to rank r; no other shard moves."""

    steps: list[list[Piece]]
    needs: tuple[tuple[bool, ...], ...]
    group: object
    rank: int
    world: int

    def receives(self, step: int) -> bool:
        """Whether this rank takes the K/V of the rank `step` behind."""
        return self.needs[self.rank][(self.rank - step) % self.world]

    def sends(self, step: int) -> bool:
        """Whether the rank `step` ahead takes this rank's K/V."""
        return self.needs[(self.rank + step) % self.world][self.rank]

    def moving_steps(self) -> list[int]:
        """The steps in 1..P-1 at which some rank sends its K/V to the rank that far ahead."""
        return [step for step in range(1, self.world)
                if any(self.needs[(r + step) % self.world][r] for r in range(self.world))]


def ring_attention(q, k, v, attn_bias, row_lens, schedule: RingSchedule, options: dict):
    """(out (B, S/P, H, D), lse (B, H, S/P) float32) of this rank's rows; q, k, v, attn_bias
    this rank's shards, row_lens (B, S/P) | None."""
    return _RingAttention.apply(q, k, v, attn_bias, row_lens, schedule, options)


def _key_side(k, v, attn_bias) -> list[torch.Tensor]:
    return [k, v] if attn_bias is None else [k, v, attn_bias]


def _kv_transfer(exchange: RingExchange, schedule: RingSchedule, step: int, own):
    """Posts this rank's K/V transfers of `step` (None when it has none)."""
    return exchange.start(step, own if schedule.sends(step) else None,
                          own if schedule.receives(step) else None)


def _arrivals(exchange: RingExchange, schedule: RingSchedule, own, sent: list):
    """Posts this rank's K/V transfers step by step, yielding (step, transfer) at each step that
    receives; those that only send are posted on the way and kept in `sent` (they send this
    rank's own tensors: waited at the end)."""
    for step in schedule.moving_steps():
        transfer = _kv_transfer(exchange, schedule, step, own)
        if schedule.receives(step):
            yield step, transfer
        elif transfer is not None:
            sent.append(transfer)


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, attn_bias, row_lens, schedule, options):
        batch, rows, heads, _ = q.shape
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((batch, heads, rows), float("-inf"), dtype=torch.float32,
                         device=q.device)
        own = _key_side(k, v, attn_bias)

        def compute(step, held):
            bias = held[2] if attn_bias is not None else None
            for piece in schedule.steps[step]:
                piece_out, piece_lse = piece.run(q, held[0], held[1], bias, row_lens, options)
                merge(out, lse, piece.rows, piece_out, piece_lse)

        sent = []
        arrivals = _arrivals(RingExchange(schedule.group, q.device), schedule, own, sent) \
            if schedule.moving_steps() else iter(())
        upcoming = next(arrivals, None)  # in flight while this rank's own K/V are computed
        compute(0, own)
        while upcoming is not None:
            step, transfer = upcoming
            held = transfer.wait()
            upcoming = next(arrivals, None)
            compute(step, held)
        for transfer in sent:
            transfer.wait()
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
        own = _key_side(k, v, attn_bias)
        count = 3 if bias_grad else 2

        def zeros(held):
            return [torch.zeros(t.shape, dtype=torch.float32, device=t.device)
                    for t in held[:count]]

        def compute(step, held, grads):
            bias = held[2].detach().requires_grad_(bias_grad) if attn_bias is not None else None
            for piece in schedule.steps[step]:
                found = piece.gradients(dout, out, lse, dlse, q, held[0], held[1], bias,
                                        row_lens, options)
                (i0, i1), (j0, j1) = piece.rows, piece.keys
                dq[:, i0:i1] += found[0]
                grads[0][:, j0:j1] += found[1]
                grads[1][:, j0:j1] += found[2]
                if bias_grad:
                    grads[2][..., j0:j1] += found[3]

        def add(grads, transfer):
            for grad, arrived in zip(grads, transfer.wait()):
                grad.add_(arrived)

        own_grads = zeros(own)
        steps = schedule.moving_steps()
        exchange = RingExchange(schedule.group, q.device) if steps else None
        # every rank walks the same steps and posts the K/V of the next one before the
        # gradients of this one: K/V and gradients between two ranks meet in one order on both
        kv = _kv_transfer(exchange, schedule, steps[0], own) if steps else None
        compute(0, own, own_grads)
        sent, grads_out = [], None
        for i, step in enumerate(steps):
            held = None
            if schedule.receives(step):
                held = kv.wait()
            elif kv is not None:
                sent.append(kv)
            kv = _kv_transfer(exchange, schedule, steps[i + 1], own) \
                if i + 1 < len(steps) else None
            grads = None
            if held is not None:
                grads = zeros(held)
                compute(step, held, grads)
            if grads_out is not None:
                add(own_grads, grads_out)
            # the held shard's gradients back to its owner, the rank `step` behind; those of
            # this rank's shard from the rank `step` ahead
            grads_out = exchange.start(-step, grads,
                                       own_grads if schedule.sends(step) else None)
        if grads_out is not None:
            add(own_grads, grads_out)
        for transfer in sent:
            transfer.wait()
        dk, dv, *dbias = (grad.to(t.dtype) for grad, t in zip(own_grads, own))
        return dq.to(q.dtype), dk, dv, dbias[0] if bias_grad else None, None, None, None
