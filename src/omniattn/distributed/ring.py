"""Ring attention: each rank keeps its query rows; at step t it computes with the K/V shard (and
key bias) of the rank t behind, received while the step before is computed, and merges each
step's pieces (pieces.py) into the running output by their log-sum-exp. Only the shards that
some row of the receiving rank sees travel (visibility.py): a step at which no rank needs the
shard of the rank that far behind is never taken, and a rank that neither sends nor receives at
a step skips it. The backward receives the same shards again; each piece's gradients come from
the merged output and lse of its rows (its probabilities exp(s - lse), no forward recomputed),
and the key-side gradients (dK, dV, dbias) of a shard go straight back to its owner as float32
partial sums, which the owner adds to its own. Where the cost model gives some rank more work
than the others, slices of its rows are handed to lighter ranks that compute them against their
own keys (balance.py; Handoff below)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .comm import RingExchange
from .pieces import Piece, merge


class Handoff(NamedTuple):
    """Query rows computed by another rank than their owner (balance.py): `rows` of the
    owner's shard, `piece` those rows alone (its rows (0, n)) against the helper's own keys;
    `peer` the other rank (the helper, on the owner; the owner, on the helper)."""

    peer: int
    rows: tuple[int, int]
    piece: Piece


class RingSchedule(NamedTuple):
    """What a ring call computes and moves on this rank: the pieces of each step (step t holds
    the K/V of rank (rank - t) mod P; none where this rank does not receive them) and
    needs[r][s] (P x P, the same on every rank): rank r's rows see a key of rank s, so rank s's
    K/V go to rank r; no other shard moves. `given`: this rank's rows that other ranks compute,
    `taken`: other ranks' rows this rank computes against its own keys, both in the order
    every rank posts them; `offloading`: some rank hands rows off."""

    steps: list[list[Piece]]
    needs: tuple[tuple[bool, ...], ...]
    group: object
    rank: int
    world: int
    given: tuple[Handoff, ...] = ()
    taken: tuple[Handoff, ...] = ()
    offloading: bool = False

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


def _handoff_exchange(exchange: RingExchange | None, outgoing, incoming):
    """Posts one batch of hand-off messages: outgoing / incoming lists of (peer rank, tensors),
    sent / received in that order; None when this rank has none."""
    if exchange is None:
        return None
    return exchange.post([(peer, t) for peer, tensors in outgoing for t in tensors],
                         [(peer, t) for peer, tensors in incoming for t in tensors])


def _grouped(transfer, size: int) -> list[list[torch.Tensor]]:
    """A hand-off batch's received tensors, `size` per hand-off (waits for the batch)."""
    arrived = transfer.wait() if transfer is not None else []
    return [arrived[i:i + size] for i in range(0, len(arrived), size)]


def _empty_rows(like: torch.Tensor, handoff: Handoff, dim: int) -> torch.Tensor:
    """A buffer shaped like `like` with the hand-off's rows along dim."""
    shape = list(like.shape)
    shape[dim] = handoff.rows[1] - handoff.rows[0]
    return torch.empty(shape, dtype=like.dtype, device=like.device)


class _RingAttention(torch.autograd.Function):
    """Hand-offs (balance.py) ride beside the ring: every rank posts the rows it hands off (and
    the receipt of those it takes) before any K/V, computes the rows it takes right after its
    own step 0 (they arrive meanwhile), and posts the results right after its last K/V
    transfer, so the transfers between two ranks meet in one order on both.

    Forward: q rows go out; (out, lse) come back, out in q's dtype, as the piece's local call
    returns it (the owner merges what it would have computed itself). Backward: the rows' dout,
    merged out, lse and dlse go out (dlse zeros where this rank has none: whether lse gets a
    gradient may differ by rank, the messages may not); dq comes back in q's dtype, the
    piece's own, and the helper adds the piece's dK / dV / dbias to those of its own keys."""

    @staticmethod
    def forward(ctx, q, k, v, attn_bias, row_lens, schedule, options):
        batch, rows, heads, _ = q.shape
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((batch, heads, rows), float("-inf"), dtype=torch.float32,
                         device=q.device)
        own = _key_side(k, v, attn_bias)
        given, taken = schedule.given, schedule.taken

        def compute(step, held):
            bias = held[2] if attn_bias is not None else None
            for piece in schedule.steps[step]:
                piece_out, piece_lse = piece.run(q, held[0], held[1], bias, row_lens, options)
                merge(out, lse, piece.rows, piece_out, piece_lse)

        exchange = RingExchange(schedule.group, q.device) \
            if schedule.moving_steps() or schedule.offloading else None
        inputs = _handoff_exchange(exchange, [(h.peer, [q[:, slice(*h.rows)]]) for h in given],
                                   [(h.peer, [_empty_rows(q, h, 1)]) for h in taken])
        sent = []
        arrivals = _arrivals(exchange, schedule, own, sent) \
            if schedule.moving_steps() else iter(())
        upcoming = next(arrivals, None)  # in flight while this rank's own K/V are computed
        compute(0, own)
        taken_q = [arrived[0] for arrived in _grouped(inputs, 1)] if taken else []
        helped = [h.piece.run(q_rows, k, v, attn_bias, None, options)
                  for h, q_rows in zip(taken, taken_q)]

        def post_results():
            return _handoff_exchange(
                exchange, [(h.peer, result) for h, result in zip(taken, helped)],
                [(h.peer, [_empty_rows(q, h, 1), _empty_rows(lse, h, 2)]) for h in given])

        results = post_results() if upcoming is None else None
        while upcoming is not None:
            step, transfer = upcoming
            held = transfer.wait()
            upcoming = next(arrivals, None)
            if upcoming is None:  # every K/V transfer posted
                results = post_results()
            compute(step, held)
        for h, (piece_out, piece_lse) in zip(given, _grouped(results, 2)):
            merge(out, lse, h.rows, piece_out, piece_lse)
        for transfer in [inputs, *sent]:
            if transfer is not None:
                transfer.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, attn_bias, row_lens, out, lse)
        ctx.schedule, ctx.options, ctx.taken_q = schedule, options, taken_q
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, attn_bias, row_lens, out, lse = ctx.saved_tensors
        schedule, options = ctx.schedule, ctx.options
        given, taken = schedule.given, schedule.taken
        if dout is None:
            dout = torch.zeros_like(out)
        bias_grad = attn_bias is not None and ctx.needs_input_grad[3]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        own = _key_side(k, v, attn_bias)
        count = 3 if bias_grad else 2

        def zeros(held):
            return [torch.zeros(t.shape, dtype=torch.float32, device=t.device)
                    for t in held[:count]]

        def add_key_grads(grads, piece, found):
            j0, j1 = piece.keys
            grads[0][:, j0:j1] += found[1]
            grads[1][:, j0:j1] += found[2]
            if bias_grad:
                grads[2][..., j0:j1] += found[3]

        def held_bias(held):
            return held[2].detach().requires_grad_(bias_grad) if attn_bias is not None else None

        def compute(step, held, grads):
            bias = held_bias(held)
            for piece in schedule.steps[step]:
                found = piece.gradients(dout, out, lse, dlse, q, held[0], held[1], bias,
                                        row_lens, options)
                i0, i1 = piece.rows
                dq[:, i0:i1] += found[0]
                add_key_grads(grads, piece, found)

        def add(grads, transfer):
            for grad, arrived in zip(grads, transfer.wait()):
                grad.add_(arrived)

        def given_rows(h):
            rows = slice(*h.rows)
            lse_grad = dlse[..., rows] if dlse is not None else torch.zeros_like(lse[..., rows])
            return [dout[:, rows], out[:, rows], lse[..., rows], lse_grad]

        own_grads = zeros(own)
        steps = schedule.moving_steps()
        exchange = RingExchange(schedule.group, q.device) \
            if steps or schedule.offloading else None
        inputs = _handoff_exchange(
            exchange, [(h.peer, given_rows(h)) for h in given],
            [(h.peer, [_empty_rows(out, h, 1), _empty_rows(out, h, 1), _empty_rows(lse, h, 2),
                       _empty_rows(lse, h, 2)]) for h in taken])
        # every rank walks the same steps and posts the K/V of the next one before the
        # gradients of this one: K/V and gradients between two ranks meet in one order on both
        kv = _kv_transfer(exchange, schedule, steps[0], own) if steps else None
        compute(0, own, own_grads)
        taken_dq = []
        for h, q_rows, arrived in zip(taken, ctx.taken_q, _grouped(inputs, 4) if taken else []):
            found = h.piece.gradients(*arrived, q_rows, k, v, held_bias(own), None, options)
            add_key_grads(own_grads, h.piece, found)
            taken_dq.append(found[0])

        def post_results():
            return _handoff_exchange(exchange, [(h.peer, [d]) for h, d in zip(taken, taken_dq)],
                                     [(h.peer, [_empty_rows(q, h, 1)]) for h in given])

        # the results go right after the last K/V transfer is posted
        results = post_results() if len(steps) <= 1 else None
        sent, grads_out = [], None
        for i, step in enumerate(steps):
            held = None
            if schedule.receives(step):
                held = kv.wait()
            elif kv is not None:
                sent.append(kv)
            kv = _kv_transfer(exchange, schedule, steps[i + 1], own) \
                if i + 1 < len(steps) else None
            if i + 2 == len(steps):
                results = post_results()
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
        for h, (rows_dq,) in zip(given, _grouped(results, 1)):
            dq[:, slice(*h.rows)] += rows_dq
        for transfer in [inputs, *sent]:
            if transfer is not None:
                transfer.wait()
        dk, dv, *dbias = (grad.to(t.dtype) for grad, t in zip(own_grads, own))
        return dq.to(q.dtype), dk, dv, dbias[0] if bias_grad else None, None, None, None
