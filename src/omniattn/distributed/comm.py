"""The collectives context parallelism uses, on one process group: all-gather and
reduce-scatter of shards, the all-to-all between sequence and head shards (both differentiable
where attention needs them), and the ring's non-blocking transfers between ranks a step apart
and between the ranks that hand query rows off and compute them."""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from .layout import to_global, to_shards


def group_info(group) -> tuple[int, int]:
    """(this rank's index in group, the group's size)."""
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's x (same shape on every rank), in rank order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return parts


def reduce_scatter(parts: list[torch.Tensor], group) -> torch.Tensor:
    """The sum over ranks of each rank's parts[r], on rank r."""
    parts = [p.contiguous() for p in parts]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    """Shards (this rank's positions) -> the full sequence in global order, on every rank; the
    backward sums every rank's gradient of this rank's positions (each rank attends with
    different rows, so the gradients add)."""

    @staticmethod
    def forward(ctx, x, group, layout, dim):
        ctx.group, ctx.layout, ctx.dim = group, layout, dim
        return to_global(all_gather(x, group), layout, dim)

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size(ctx.group)
        return reduce_scatter(to_shards(grad, ctx.layout, world, ctx.dim), ctx.group), None, \
            None, None


def gather_sequence(x: torch.Tensor | None, group, layout: str, dim: int):
    """The full sequence of x along dim (None stays None); differentiable, gradients summed
    over ranks."""
    if x is None:
        return None
    if not x.requires_grad or not torch.is_grad_enabled():
        return to_global(all_gather(x, group), layout, dim)
    return _GatherSequence.apply(x, group, layout, dim)


def _sequence_to_heads(x, group, layout, seq_dim, head_dim):
    """(.., S/P positions, .., H heads) -> (.., S positions in global order, .., H/P heads):
    rank r keeps heads [r H/P, (r + 1) H/P)."""
    world = dist.get_world_size(group)
    sends = [part.contiguous() for part in x.chunk(world, head_dim)]
    received = [torch.empty_like(sends[0]) for _ in range(world)]
    dist.all_to_all(received, sends, group=group)
    return to_global(received, layout, seq_dim)


def _heads_to_sequence(x, group, layout, seq_dim, head_dim):
    """The inverse of _sequence_to_heads."""
    world = dist.get_world_size(group)
    sends = [part.contiguous() for part in to_shards(x, layout, world, seq_dim)]
    received = [torch.empty_like(sends[0]) for _ in range(world)]
    dist.all_to_all(received, sends, group=group)
    return torch.cat(received, head_dim)


class _AllToAll(torch.autograd.Function):
    """Sequence shards <-> head shards (to_heads says which way); the backward goes back."""

    @staticmethod
    def forward(ctx, x, group, layout, seq_dim, head_dim, to_heads):
        ctx.args = (group, layout, seq_dim, head_dim)
        ctx.to_heads = to_heads
        move = _sequence_to_heads if to_heads else _heads_to_sequence
        return move(x, group, layout, seq_dim, head_dim)

    @staticmethod
    def backward(ctx, grad):
        move = _heads_to_sequence if ctx.to_heads else _sequence_to_heads
        return move(grad, *ctx.args), None, None, None, None, None


def sequence_to_heads(x, group, layout: str, seq_dim: int, head_dim: int) -> torch.Tensor:
    """Differentiable all-to-all: this rank's positions of every head -> every position (global
    order) of this rank's H/P heads."""
    return _AllToAll.apply(x, group, layout, seq_dim, head_dim, True)


def heads_to_sequence(x, group, layout: str, seq_dim: int, head_dim: int) -> torch.Tensor:
    """Differentiable all-to-all: every position of this rank's heads -> this rank's positions
    of every head."""
    return _AllToAll.apply(x, group, layout, seq_dim, head_dim, False)


class RingExchange:
    """The ring's non-blocking transfers: at step t this rank sends to the rank t ahead and
    receives from the rank t behind (every rank at step t does the same, so the pairs match),
    either side left out where no row needs it; and batches between any ranks (`post`, the
    rows handed off). Every rank posts them in one order (ring.py), so those between two ranks
    meet in the same order on both."""

    # groups whose communicator is known to exist: NCCL creates it at a group's first call,
    # which every rank must join, and a step's transfers may leave ranks out
    _started: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, group, device: torch.device):
        self.group = group
        self.rank, self.world = group_info(group)
        if group not in RingExchange._started:
            dist.all_reduce(torch.zeros(1, device=device), group=group)
            RingExchange._started.add(group)

    def start(self, step: int, send: list[torch.Tensor] | None,
              receive: list[torch.Tensor] | None) -> "_Transfer | None":
        """Posts `send` to the rank `step` ahead and the receipt of tensors shaped like
        `receive` from the rank `step` behind (a negative step: the other way round); None if
        neither."""
        ahead, behind = (self.rank + step) % self.world, (self.rank - step) % self.world
        return self.post([(ahead, t) for t in send or []],
                         [(behind, torch.empty(t.shape, dtype=t.dtype, device=t.device))
                          for t in receive or []])

    def post(self, sends: list[tuple[int, torch.Tensor]],
             receives: list[tuple[int, torch.Tensor]]) -> "_Transfer | None":
        """Posts each (rank in the group, tensor) of `sends` to that rank and the receipt of
        each (rank, buffer) of `receives` into the buffer, as one batch; None if neither. The
        transfer's wait() returns the buffers, in order."""
        if not sends and not receives:
            return None
        sends = [(peer, t.contiguous()) for peer, t in sends]
        ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(self.group, peer), self.group)
               for peer, t in sends]
        ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(self.group, peer), self.group)
                for peer, t in receives]
        return _Transfer(dist.batch_isend_irecv(ops), [t for _, t in receives],
                         [t for _, t in sends])


class _Transfer:
    def __init__(self, requests, received, sends):
        # the sent tensors stay referenced until the transfer completes
        self.requests, self.received, self.sends = requests, received, sends

    def wait(self) -> list[torch.Tensor]:
        for request in self.requests:
            request.wait()
        self.requests = []  # waited once, whoever waits again
        return self.received
